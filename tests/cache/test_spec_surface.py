"""SPEC §4's names stay on the facade (add, don't rename), and the facade stays small: what the
engine alone needs lives on its views (``layout``, ``steps``, ``prefix_cache``)."""

from __future__ import annotations

from flashdec.cache import PagedKVCache

SPEC_4 = (
    "add_request",
    "finish_request",
    "cancel_request",
    "request_state",
    "seq_len",
    "request_block_ids",
    "block_tables",
    "seq_lens_tensor",
    "append",
    "begin_token",
    "write_token_layer",
    "commit_token",
    "abort_token",
    "transaction_view",
    "register_prefix",
    "attach_prefix",
    "evict_prefix",
    "prefix_state",
    "metrics",
    "validate_invariants",
)


def test_spec_names_are_on_the_facade():
    missing = [name for name in SPEC_4 if not callable(getattr(PagedKVCache, name, None))]
    assert missing == []


def test_the_facade_stays_small_and_its_views_are_attributes():
    public = [name for name in dir(PagedKVCache) if not name.startswith("_")]
    # 43 at the reshape (SPEC's 20, the constructor's arguments read back, the views, the
    # per-layer write, the scheduling snapshot's reads), + set_kv_scales (FP8 calibration):
    # the module docstring says why each
    assert len(public) <= 44, sorted(public)
    for view in ("layout", "steps", "prefix_cache"):
        assert isinstance(getattr(PagedKVCache, view), property)
