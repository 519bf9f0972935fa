"""The paged KV cache: block allocator, shared prefixes, token transactions and the façade."""

from typing import Any

from flashdec.cache.allocator import BlockAllocator
from flashdec.cache.kv_spec import KVGroupSpec, format_kv_spec, parse_kv_spec
from flashdec.cache.paged_kv_cache import PagedKVCache
from flashdec.cache.prefix_registry import PrefixRegistry
from flashdec.cache.state import PrefixState, RequestState
from flashdec.cache.transaction import (
    TokenTransaction,
    TokenTransactionView,
    TransactionSlots,
    TransactionState,
)

__all__ = [
    "BlockAllocator",
    "KVGroupSpec",
    "PagedKVCache",
    "PrefixRegistry",
    "PrefixState",
    "RequestState",
    "TokenTransaction",
    "TokenTransactionView",
    "TransactionSlots",
    "TransactionState",
    "format_kv_spec",
    "parse_kv_spec",
]

# Names that moved to the engine (they join the cache and the kernels); the old import path
# still resolves. The only import of a higher layer in this package, and a lazy one.
_MOVED_TO_ENGINE = ("RopeAppendResult", "rope_paged_kv_append")


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_ENGINE:
        from flashdec.engine import layer_ops

        return getattr(layer_ops, name)
    raise AttributeError(f"module 'flashdec.cache' has no attribute {name!r}")
