"""Fixtures for cache tests."""

from __future__ import annotations

import pytest

from flashdec.cache import PagedKVCache
from tests.cache.util import make_cache


@pytest.fixture
def cache() -> PagedKVCache:
    return make_cache()
