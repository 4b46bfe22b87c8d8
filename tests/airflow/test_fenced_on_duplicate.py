"""``FencedSQLOperator(on_duplicate=...)``: a bad value fails at parse time, naming the parameter.

What ``on_duplicate="skip"`` does at run time (a cleared re-run of a published slot ends skipped,
nothing written) is checked under a real scheduler: ``tests/deployment/test_examples.py``.
"""

from __future__ import annotations

import pytest

from airflow_lease_provider.core import InvalidArgument
from airflow_lease_provider.operators import FencedSQLOperator


@pytest.mark.parametrize("value", ["ignore", "", None, True, "SKIP"])
def test_an_unknown_on_duplicate_is_refused_naming_it(value: object) -> None:
    with pytest.raises(InvalidArgument) as caught:
        FencedSQLOperator(task_id="publish", resource="billing", sql="SELECT 1", on_duplicate=value)  # type: ignore[arg-type]
    assert caught.value.parameter == "on_duplicate"
    assert "fail, skip" in str(caught.value)


@pytest.mark.parametrize("value", ["fail", "skip"])
def test_the_two_policies_are_accepted(value: str) -> None:
    assert FencedSQLOperator(task_id="publish", resource="billing", sql="SELECT 1", on_duplicate=value).on_duplicate == value
