"""FP8 KV scales: calibration against an independent recomputation of the post-RoPE K/V, the
checkpoint conventions load_kv_scales reads, the save/load round trip and input validation."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flashdec._checks import FP8_MAX
from flashdec.kv_scales import (
    CALIBRATION_TOKENS,
    DYNAMIC_MARGIN,
    KVScales,
    calibrate_kv_scales,
    load_kv_scales,
    save_kv_scales,
    static_kv_scales,
)
from flashdec.models import build_random_model

# Llama (llama3 RoPE), Qwen3 (k-norm, head_dim != hidden / heads), Mistral with a 16-token window
# in every layer, Qwen2 (k/v bias, one KV head)
FAMILIES = ("tiny-llama", "tiny-qwen3", "tiny-mistral-swa", "tiny-qwen2")
PROMPT = [(7 * i + 3) % 256 for i in range(40)]  # longer than the 16-token window


def fresh_model(name: str) -> torch.nn.Module:
    return build_random_model(name, dtype=torch.float32, device="cpu", seed=0)


@functools.cache
def shared_model(name: str) -> torch.nn.Module:
    """A read-only model per family (calibration leaves it as it was, as a test below checks)."""
    return fresh_model(name)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference_kv(model: torch.nn.Module, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's K (k_proj, k-norm, RoPE) and V ``[Hkv, T, D]`` in float64, recomputed from
    each attention's inputs in a forward without a cache: independent of the cache code."""
    inputs = {}

    def capture(layer):
        def hook(module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            inputs[layer] = (module, hidden, kwargs["position_embeddings"])

        return hook

    layers = model.model.layers
    handles = [
        layer.self_attn.register_forward_pre_hook(capture(i), with_kwargs=True)
        for i, layer in enumerate(layers)
    ]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    out = []
    for i in range(len(layers)):
        attn, hidden, (cos, sin) = inputs[i]
        h = hidden.double()[0]  # [T, hidden]

        def project(linear, h=h, attn=attn):
            bias = None if linear.bias is None else linear.bias.double()
            y = torch.nn.functional.linear(h, linear.weight.double(), bias)
            return y.view(h.shape[0], -1, attn.head_dim).transpose(0, 1)  # [Hkv, T, D]

        k, v = project(attn.k_proj), project(attn.v_proj)
        if hasattr(attn, "k_norm"):  # Qwen3: RMSNorm over head_dim before RoPE
            norm = attn.k_norm
            k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
            k = k * norm.weight.double()
        cos, sin = cos.double()[0], sin.double()[0]  # [T, D]
        out.append((k * cos + rotate_half(k) * sin, v))
    return out


def expected_scales(kv, margin: float) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.stack([layer_k.abs().amax(dim=(1, 2)) for layer_k, _ in kv])
    v = torch.stack([layer_v.abs().amax(dim=(1, 2)) for _, layer_v in kv])
    return k * margin / FP8_MAX, v * margin / FP8_MAX


# --------------------------------------------------------------------------------------------
# calibration
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FAMILIES)
def test_calibration_matches_an_independent_recomputation(name):
    model = shared_model(name)
    scales = calibrate_kv_scales(model, PROMPT)
    config = model.config
    assert scales.source == "dynamic"
    assert scales.k.dtype == torch.float32 and scales.k.device.type == "cpu"
    assert scales.num_layers == config.num_hidden_layers
    assert scales.num_kv_heads == config.num_key_value_heads
    kv = reference_kv(model, PROMPT)
    assert kv[0][0].shape[1] == len(PROMPT)
    k_want, v_want = expected_scales(kv, DYNAMIC_MARGIN)
    torch.testing.assert_close(scales.k.double(), k_want, rtol=1e-5, atol=0)
    torch.testing.assert_close(scales.v.double(), v_want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("margin", [DYNAMIC_MARGIN, 1.0, 3.5])
def test_calibration_prompt_lands_exactly_at_fp8_max_over_margin(name, margin):
    """Every head's calibrated max-abs divided by its scale is FP8_MAX / margin: nothing of the
    calibration prompt saturates, and the headroom is exactly the margin (sliding-window layers
    included: all 40 tokens count, not only the window the model itself would cache)."""
    model = shared_model(name)
    scales = calibrate_kv_scales(model, PROMPT, margin=margin)
    for layer, (k, v) in enumerate(reference_kv(model, PROMPT)):
        for table, x in ((scales.k, k), (scales.v, v)):
            stored = x / table[layer].double()[:, None, None]
            peak = stored.abs().amax(dim=(1, 2))
            torch.testing.assert_close(
                peak, torch.full_like(peak, FP8_MAX / margin), rtol=1e-5, atol=0
            )


def test_sliding_window_calibration_sees_tokens_beyond_the_window():
    """The model's default cache keeps only the last window - 1 tokens of a sliding layer; the
    calibration must not be limited to those (it reads a full cache)."""
    model = shared_model("tiny-mistral-swa")
    window = model.config.sliding_window
    ids = PROMPT[:25] + [5] * 15  # varied tokens, then a repeated one filling the window
    with torch.no_grad():
        default = model(torch.tensor([ids]), use_cache=True).past_key_values
    assert default.layers[0].keys.shape[2] == window - 1  # what a naive reading would get
    tail = torch.stack([layer.keys.abs().amax(dim=(0, 2, 3)) for layer in default.layers])
    full = calibrate_kv_scales(model, ids).k * FP8_MAX / DYNAMIC_MARGIN
    assert (full >= tail * (1 - 1e-6)).all()
    assert (full > tail * 1.2).any()  # some heads peak before the window's tokens


def test_max_tokens_keeps_only_the_first_tokens():
    model = shared_model("tiny-llama")
    cut = calibrate_kv_scales(model, PROMPT, max_tokens=10)
    short = calibrate_kv_scales(model, PROMPT[:10])
    whole = calibrate_kv_scales(model, PROMPT)
    assert torch.equal(cut.k, short.k) and torch.equal(cut.v, short.v)
    assert not torch.equal(cut.k, whole.k)
    # more than the prompt: all of it
    longer = calibrate_kv_scales(model, PROMPT, max_tokens=len(PROMPT) + 5)
    assert torch.equal(longer.k, whole.k) and torch.equal(longer.v, whole.v)
    assert CALIBRATION_TOKENS == 512


def test_token_id_forms_agree():
    model = shared_model("tiny-qwen2")
    want = calibrate_kv_scales(model, PROMPT)
    for ids in (tuple(PROMPT), torch.tensor(PROMPT), torch.tensor(PROMPT, dtype=torch.int32)):
        got = calibrate_kv_scales(model, ids)
        assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
    got = calibrate_kv_scales(model, np.array(PROMPT))
    assert torch.equal(got.k, want.k)


def test_model_modes_and_weights_are_untouched():
    model = fresh_model("tiny-qwen3")
    model.train()
    model.lm_head.eval()  # a mixed state must come back module by module
    modes = {name: m.training for name, m in model.named_modules()}
    before = {name: p.detach().clone() for name, p in model.state_dict().items()}
    scales = calibrate_kv_scales(model, PROMPT)
    assert {name: m.training for name, m in model.named_modules()} == modes
    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    assert all(p.requires_grad for p in model.parameters())
    # and the forward ran in eval mode: same as calibrating the eval-mode model
    model.eval()
    again = calibrate_kv_scales(model, PROMPT)
    assert torch.equal(scales.k, again.k) and torch.equal(scales.v, again.v)


def test_an_all_zero_head_gets_scale_one():
    model = fresh_model("tiny-llama")
    attn = model.model.layers[1].self_attn
    with torch.no_grad():
        attn.v_proj.weight[attn.head_dim : 2 * attn.head_dim] = 0  # KV head 1 of layer 1
    scales = calibrate_kv_scales(model, PROMPT)
    assert scales.v[1, 1].item() == 1.0
    assert scales.v[1, 0].item() != 1.0 and scales.k[1, 1].item() != 1.0


def test_non_finite_keys_are_refused():
    model = fresh_model("tiny-llama")
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight[0, 0] = math.inf
    with pytest.raises(ValueError, match="layer 0's keys hold non-finite values"):
        calibrate_kv_scales(model, PROMPT)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"token_ids": []}, ValueError, "at least one token"),
        ({"token_ids": [1.0, 2.0]}, TypeError, "token_ids must hold int token ids"),
        ({"token_ids": torch.zeros(2, 3, dtype=torch.long)}, ValueError, "must be 1-D"),
        ({"token_ids": torch.zeros(3)}, TypeError, "integer token ids"),
        ({"token_ids": "abc"}, TypeError, "list of token ids"),
        ({"token_ids": [1, 256]}, ValueError, r"\[0, vocab_size=256\), got 256"),
        ({"token_ids": [-1]}, ValueError, "got -1"),
        ({"margin": 0.5}, ValueError, "margin must be finite and >= 1, got 0.5"),
        ({"margin": math.nan}, ValueError, "margin must be finite"),
        ({"margin": math.inf}, ValueError, "margin must be finite"),
        ({"margin": "2"}, TypeError, "margin must be a float, got str"),
        ({"margin": True}, TypeError, "margin must be a float, got bool"),
        ({"max_tokens": 0}, ValueError, "max_tokens must be >= 1"),
        ({"max_tokens": 2.0}, TypeError, "max_tokens must be an int"),
    ],
)
def test_calibration_arguments_are_checked(kwargs, error, message):
    args = {"token_ids": PROMPT, **kwargs}
    ids = args.pop("token_ids")
    with pytest.raises(error, match=message):
        calibrate_kv_scales(shared_model("tiny-llama"), ids, **args)


def test_calibration_needs_a_causal_lm():
    with pytest.raises(TypeError, match="transformers causal LM, got str"):
        calibrate_kv_scales("tiny-llama", PROMPT)
    with pytest.raises(TypeError, match="num_hidden_layers"):
        calibrate_kv_scales(torch.nn.Linear(2, 2), PROMPT)


# --------------------------------------------------------------------------------------------
# KVScales and static scales
# --------------------------------------------------------------------------------------------
def table(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_kv_scales_properties_and_immutability():
    scales = KVScales(table([1.0, 2.0, 3.0], [4.0, 5.0, 6.0]), table([1.0] * 3, [2.0] * 3), "x")
    assert (scales.num_layers, scales.num_kv_heads) == (2, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        scales.source = "y"


@pytest.mark.parametrize(
    ("k", "v", "source", "error", "message"),
    [
        ([[1.0]], table([1.0]), "s", TypeError, "k must be a torch.Tensor, got list"),
        (table([1.0]).double(), table([1.0]), "s", TypeError, "k must be float32"),
        (table([1.0]), table([1.0]).half(), "s", TypeError, "v must be float32"),
        (torch.ones(1, 1, device="meta"), table([1.0]), "s", TypeError, "on the CPU"),
        (torch.ones(3), table([1.0]), "s", ValueError, r"2-D .* got shape \(3,\)"),
        (torch.ones(0, 2), torch.ones(0, 2), "s", ValueError, r"both >= 1, got shape \(0, 2\)"),
        (table([1.0, 2.0]), table([1.0]), "s", ValueError, r"same shape.*\(1, 2\) and \(1, 1\)"),
        (table([1.0, 0.0]), table([1.0, 1.0]), "s", ValueError, "layer 0, head 1 is 0.0"),
        (table([1.0], [-2.0]), table([1.0], [1.0]), "s", ValueError, "layer 1, head 0 is -2.0"),
        (table([1.0]), table([math.inf]), "s", ValueError, "v must be finite and > 0.*inf"),
        (table([math.nan]), table([1.0]), "s", ValueError, "k must be finite and > 0.*nan"),
        (table([1.0]), table([1.0]), None, TypeError, "source must be a str, got NoneType"),
    ],
)
def test_kv_scales_validation(k, v, source, error, message):
    with pytest.raises(error, match=message):
        KVScales(k, v, source)


def test_static_scales():
    scales = static_kv_scales(3, 2, 0.25)
    assert scales.source == "static"
    assert torch.equal(scales.k, torch.full((3, 2), 0.25)) and torch.equal(scales.v, scales.k)
    assert scales.k.data_ptr() != scales.v.data_ptr()  # one table may change without the other
    assert torch.equal(static_kv_scales(1, 4).k, torch.ones(1, 4))
    assert static_kv_scales(2, 2, 3).k[1, 1].item() == 3.0


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((0, 2), ValueError, "num_layers must be >= 1"),
        ((2, 0), ValueError, "num_kv_heads must be >= 1"),
        ((2.0, 2), TypeError, "num_layers must be an int"),
        ((2, 2, 0.0), ValueError, "scale must be finite and > 0, got 0.0"),
        ((2, 2, -1.0), ValueError, "scale must be finite and > 0"),
        ((2, 2, math.inf), ValueError, "scale must be finite and > 0"),
        ((2, 2, math.nan), ValueError, "scale must be finite and > 0"),
        ((2, 2, "1"), TypeError, "scale must be a float, got str"),
        ((2, 2, True), TypeError, "scale must be a float, got bool"),
    ],
)
def test_static_scales_validation(args, error, message):
    with pytest.raises(error, match=message):
        static_kv_scales(*args)


# --------------------------------------------------------------------------------------------
# save / load
# --------------------------------------------------------------------------------------------
def test_save_load_round_trip_is_exact(tmp_path):
    scales = calibrate_kv_scales(shared_model("tiny-qwen3"), PROMPT)
    path = tmp_path / "scales.safetensors"
    save_kv_scales(scales, path)
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == {"format": "flashdec-kv-scales", "source": "dynamic"}
        assert sorted(handle.keys()) == sorted(
            f"model.layers.{i}.self_attn.{kind}_scale" for i in range(2) for kind in "kv"
        )
        row = handle.get_tensor("model.layers.1.self_attn.v_scale")
        assert row.dtype == torch.float32 and torch.equal(row, scales.v[1])
    for where in (path, str(path), tmp_path):  # the file, its name, its directory
        loaded = load_kv_scales(where, scales.num_layers, scales.num_kv_heads)
        assert torch.equal(loaded.k, scales.k) and torch.equal(loaded.v, scales.v)
        assert loaded.source == str(where)


def test_load_from_a_sharded_checkpoint_directory(tmp_path):
    """Scales spread over shards beside other weights; only the scale keys are read."""
    k = table([0.5, 0.25], [1.5, 2.0])
    v = table([3.0, 4.0], [0.125, 0.75])
    save_file(
        {
            "model.layers.0.self_attn.k_proj.weight": torch.ones(4, 4),
            "model.layers.0.self_attn.k_scale": k[0].clone(),
            "model.layers.0.self_attn.v_scale": v[0].clone(),
        },
        str(tmp_path / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {
            "model.layers.1.self_attn.k_scale": k[1].clone(),
            "model.layers.1.self_attn.v_scale": v[1].clone(),
            "lm_head.weight": torch.ones(2, 4),
        },
        str(tmp_path / "model-00002-of-00002.safetensors"),
    )
    (tmp_path / "config.json").write_text("{}")
    loaded = load_kv_scales(tmp_path, 2, 2)
    assert torch.equal(loaded.k, k) and torch.equal(loaded.v, v)


@pytest.mark.parametrize(
    ("k_name", "v_name"),
    [
        ("k_scale", "v_scale"),
        ("k_proj.output_scale", "v_proj.output_scale"),
        ("kv_scale", None),  # one scale for both
    ],
)
@pytest.mark.parametrize("prefix", ["model.layers", "layers", "model.language_model.layers"])
def test_each_checkpoint_convention(tmp_path, k_name, v_name, prefix):
    tensors = {}
    for i in range(3):
        tensors[f"{prefix}.{i}.self_attn.{k_name}"] = torch.tensor(0.5 + i)
        if v_name is not None:
            tensors[f"{prefix}.{i}.self_attn.{v_name}"] = torch.tensor([2.0 + i])
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = load_kv_scales(tmp_path / "model.safetensors", 3, 4)
    layers = torch.arange(3, dtype=torch.float32)[:, None]
    assert torch.equal(loaded.k, (0.5 + layers).expand(3, 4))
    v_want = loaded.k if v_name is None else (2.0 + layers).expand(3, 4)
    assert torch.equal(loaded.v, v_want)
    assert loaded.k.dtype == torch.float32 and loaded.k.is_contiguous()


def test_per_head_tensors_of_any_float_dtype(tmp_path):
    k = torch.tensor([0.5, 0.75, 1.0], dtype=torch.bfloat16)
    v = torch.tensor([2.0, 3.0, 4.0], dtype=torch.float16)
    path = tmp_path / "a.safetensors"
    save_file({"layers.0.self_attn.k_scale": k, "layers.0.self_attn.v_scale": v}, str(path))
    loaded = load_kv_scales(path, 1, 3)
    assert torch.equal(loaded.k, k.float()[None]) and torch.equal(loaded.v, v.float()[None])


def test_k_scale_is_preferred_over_the_older_fields(tmp_path):
    path = tmp_path / "a.safetensors"
    save_file(
        {
            "model.layers.0.self_attn.k_scale": torch.tensor(1.0),
            "model.layers.0.self_attn.k_proj.output_scale": torch.tensor(2.0),
            "model.layers.0.self_attn.kv_scale": torch.tensor(3.0),
            "model.layers.0.self_attn.v_proj.output_scale": torch.tensor(4.0),
        },
        str(path),
    )
    loaded = load_kv_scales(path, 1, 2)
    assert loaded.k.tolist() == [[1.0, 1.0]] and loaded.v.tolist() == [[4.0, 4.0]]


def write(tmp_path, tensors: dict[str, torch.Tensor]):
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path


def both(layers, value=1.0) -> dict[str, torch.Tensor]:
    out = {}
    for i in layers:
        out[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(value)
        out[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(value)
    return out


def test_missing_layers_are_named(tmp_path):
    path = write(tmp_path, both([0, 1, 2, 4]))
    with pytest.raises(ValueError, match=r"no K scale .* for layers 3, 5 of 6"):
        load_kv_scales(path, 6, 2)
    tensors = both([0, 1])
    del tensors["model.layers.1.self_attn.v_scale"]
    path = write(tmp_path, tensors)
    with pytest.raises(ValueError, match=r"no V scale .* for layers 1 of 2"):
        load_kv_scales(path, 2, 2)


@pytest.mark.parametrize(
    ("tensors", "num_layers", "message"),
    [
        ({"model.layers.0.self_attn.k_proj.weight": torch.ones(2, 2)}, 1, "holds no FP8 KV scales"),
        (
            {**both([0]), "model.layers.0.self_attn.k_scale": torch.ones(3)},
            1,
            r"model.layers.0.self_attn.k_scale must be a scalar or \[num_kv_heads=2\], "
            r"got shape \(3,\)",
        ),
        (
            {**both([0]), "model.layers.0.self_attn.v_scale": torch.ones(1, 2)},
            1,
            r"v_scale must be a scalar or .* got shape \(1, 2\)",
        ),
        (both([0], 0.0), 1, "k_scale must be finite and > 0, got 0.0"),
        (both([0], -1.0), 1, "must be finite and > 0, got -1.0"),
        (both([0], math.inf), 1, "must be finite and > 0, got inf"),
        (both([0], math.nan), 1, "must be finite and > 0, got nan"),
        (
            {**both([0]), "model.layers.0.self_attn.k_scale": torch.tensor([1, 2])},
            1,
            "k_scale must be a floating-point scale, got dtype torch.int64",
        ),
        (both([0, 2]), 2, "names layer 2, but the model has 2 layers"),
        (
            {**both([0, 1]), "other.layers.1.self_attn.k_scale": torch.tensor(1.0)},
            2,
            "both give layer 1's k_scale",
        ),
    ],
)
def test_bad_checkpoint_contents(tmp_path, tensors, num_layers, message):
    path = write(tmp_path, tensors)
    with pytest.raises(ValueError, match=message):
        load_kv_scales(path, num_layers, 2)


def test_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_kv_scales(tmp_path / "nope.safetensors", 1, 1)
    with pytest.raises(ValueError, match=r"holds no \*\.safetensors files"):
        load_kv_scales(tmp_path, 1, 1)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_kv_scales(junk, 1, 1)
    with pytest.raises(TypeError, match=r"path must be a str or os\.PathLike, got int"):
        load_kv_scales(3, 1, 1)
    with pytest.raises(ValueError, match="num_kv_heads must be >= 1"):
        load_kv_scales(junk, 1, 0)


def test_save_validation(tmp_path):
    scales = static_kv_scales(1, 1)
    with pytest.raises(TypeError, match="scales must be a KVScales, got dict"):
        save_kv_scales({"k": 1}, tmp_path / "a.safetensors")
    with pytest.raises(TypeError, match=r"path must be a str or os\.PathLike, got NoneType"):
        save_kv_scales(scales, None)
    with pytest.raises(ValueError, match="is a directory"):
        save_kv_scales(scales, tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        save_kv_scales(scales, tmp_path / "missing" / "a.safetensors")
    assert not list(tmp_path.iterdir())
