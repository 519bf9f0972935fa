"""The paged KV cache: block allocator, shared prefixes, token transactions and the façade."""

from flashdec.cache.allocator import BlockAllocator
from flashdec.cache.paged_kv_cache import PagedKVCache
from flashdec.cache.prefix_registry import PrefixRegistry
from flashdec.cache.rope_append import RopeAppendResult, rope_paged_kv_append
from flashdec.cache.state import PrefixState, RequestState
from flashdec.cache.transaction import (
    TokenTransaction,
    TokenTransactionView,
    TransactionState,
)

__all__ = [
    "BlockAllocator",
    "PagedKVCache",
    "PrefixRegistry",
    "PrefixState",
    "RequestState",
    "RopeAppendResult",
    "TokenTransaction",
    "TokenTransactionView",
    "TransactionState",
    "rope_paged_kv_append",
]
