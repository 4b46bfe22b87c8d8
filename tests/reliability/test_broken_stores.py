"""The fault harness's broken-on-purpose fences are really broken (on real PostgreSQL).

The checker's own tests (tests/reliability/test_chaos.py) run each broken variant for 20 s of faults and
expect a violation; when a refactor of the real store bypasses the seam a broken variant overrides, that
variant silently behaves correctly and the chaos test fails only as "no violation found", after minutes.
This checks the seam directly, in milliseconds: the cross-key fence compares tokens of different lease keys
at one resource, which the real fence never does."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from airflow_lease_provider.core import FenceStore, StaleFencingToken
from chaos.stores import CrossKeyFenceStore


@pytest.fixture
def cross_key(pg_dsn: str, schema: str) -> Iterator[CrossKeyFenceStore]:
    fences = CrossKeyFenceStore(pg_dsn, schema=schema)
    yield fences
    fences.close()


def test_the_real_fence_compares_tokens_within_one_lease_key_only(fences: FenceStore) -> None:
    assert fences.accept("target-0", 5, key="job-0")
    assert fences.accept("target-0", 3, key="job-1")  # another key's count: not compared


def test_the_cross_key_fence_refuses_a_valid_holder_of_a_key_whose_count_is_behind(
    cross_key: CrossKeyFenceStore,
) -> None:
    assert cross_key.accept("target-0", 5, key="job-0")
    assert not cross_key.accept("target-0", 3, key="job-1")  # broken on purpose: the chaos checker's prey
    with pytest.raises(StaleFencingToken):
        with cross_key.transaction("target-0", 4, key="job-1") as cur:
            cur.execute("SELECT 1")
