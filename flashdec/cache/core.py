"""What the facade's views (``steps``: :class:`~flashdec.cache.step_access.StepAccess`,
``prefix_cache``: :class:`~flashdec.cache.prefix_caching.PrefixCache`) reach of the cache they
belong to: its parts and the steps of its transaction they drive.

A Protocol, so that a view names the shape of the facade without importing it: the facade
(:mod:`flashdec.cache.paged_kv_cache`) builds the views, so a view importing the facade back
would close an import cycle. The members are the facade's own, private to the package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from flashdec.cache.group_layout import GroupLayout
    from flashdec.cache.layer_group import LayerGroup
    from flashdec.cache.requests import RequestTable
    from flashdec.cache.reservation import Plan
    from flashdec.cache.state import RequestId, RequestRecord
    from flashdec.cache.transaction import TransactionLog


class CacheCore(Protocol):
    """The members of :class:`~flashdec.cache.PagedKVCache` its views use."""

    _groups: list[LayerGroup]
    _layout: GroupLayout
    _layers: list[tuple[torch.Tensor, torch.Tensor]]  # per global layer: its K and V views
    _num_layers: int
    _requests: RequestTable
    _tx: TransactionLog
    _version: int

    def _plan(self, records: list[RequestRecord], counts: list[int]) -> Plan: ...

    def _take_all(self, plan: Plan, one_each: bool) -> None: ...

    def _release(self, reserved: list[dict[RequestId, list[int]]]) -> None: ...

    def _publish(
        self, records: list[RequestRecord], counts: list[int], reserved: list, starts: list
    ) -> None: ...

    def _open_journals(self) -> None: ...

    def _close_journals(self, bytes_restored: bool = True) -> None: ...

    def _release_record(self, record: RequestRecord, keep_cached: bool = False) -> None: ...
