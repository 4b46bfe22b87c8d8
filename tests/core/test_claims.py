"""An idempotency claim is given back only when the side effect certainly did not happen (issue 38, defect 7's
rule at the SQL and DB-API fences' ``with fences.guard(...)``): an exception the block raised itself gives it
back; one raised into it from outside (a lost lease, SIGTERM's ``TaskTerminated``, ``KeyboardInterrupt``),
after which the side effect may have happened, keeps it. Against the real PostgreSQL fence.
"""

from __future__ import annotations

import pytest

from airflow_lease_provider.core import DuplicatePublish, FenceStore, LeaseLost
from airflow_lease_provider.core.errors import Interruption
from airflow_lease_provider.runtime.signals import TaskTerminated


def test_a_side_effect_that_failed_by_itself_gives_the_claim_back(fences: FenceStore) -> None:
    with pytest.raises(RuntimeError), fences.guard("blog.git", 1, key="job", owner="a", idempotency_key="slot"):
        raise RuntimeError("git push: remote rejected")
    with fences.guard("blog.git", 2, key="job", owner="b", idempotency_key="slot"):
        pass  # the retry publishes the slot


@pytest.mark.parametrize(
    "interruption",
    [
        pytest.param(LeaseLost("job", 1, "renewal refused"), id="LeaseLost"),
        pytest.param(TaskTerminated("SIGTERM"), id="TaskTerminated"),
        pytest.param(KeyboardInterrupt(), id="KeyboardInterrupt"),
    ],
)
def test_a_side_effect_interrupted_from_outside_keeps_the_claim(fences: FenceStore, interruption: BaseException) -> None:
    pushed: list[str] = []
    with (
        pytest.raises(type(interruption)),
        fences.guard("blog.git", 1, key="job", owner="a", idempotency_key="slot"),
    ):
        pushed.append("article")  # the push happened ...
        raise interruption  # ... and the signal handler's exception landed right after it
    with pytest.raises(DuplicatePublish):  # the task's retry: the slot is published once
        fences.guard("blog.git", 2, key="job", owner="a", idempotency_key="slot")
    assert pushed == ["article"]


def test_task_terminated_is_an_interruption_and_still_an_exception() -> None:
    """An Exception, so Airflow's retries apply to it as to any failure."""
    assert issubclass(TaskTerminated, Interruption) and issubclass(TaskTerminated, Exception)
