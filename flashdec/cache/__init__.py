"""The paged KV cache: block allocator, shared prefixes, token transactions and the façade."""

from flashdec.cache.allocator import BlockAllocator
from flashdec.cache.kv_spec import KVGroupSpec, format_kv_spec, parse_kv_spec
from flashdec.cache.paged_kv_cache import PagedKVCache
from flashdec.cache.prefix_registry import PrefixRegistry
from flashdec.cache.slots import TransactionSlots
from flashdec.cache.state import PrefixState, RequestState
from flashdec.cache.transaction import (
    TokenTransaction,
    TokenTransactionView,
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
