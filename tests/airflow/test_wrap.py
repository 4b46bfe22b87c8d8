"""``LeasedOperator.wrap(X)``: one class per operator class, findable by its dotted name and picklable."""

from __future__ import annotations

import importlib
import pickle
import subprocess
import sys
import textwrap

import pytest
from airflow.providers.standard.operators.bash import BashOperator
from airflow.providers.standard.operators.empty import EmptyOperator

from airflow_lease_provider.operators import LeasedOperator
from airflow_lease_provider.operators import wrap as wrap_module


def test_wrap_builds_one_class_per_operator_class() -> None:
    leased = LeasedOperator.wrap(BashOperator)
    assert leased is LeasedOperator.wrap(BashOperator)
    assert LeasedOperator.wrap(leased) is leased  # already leased: returned as it is
    assert issubclass(leased, LeasedOperator) and issubclass(leased, BashOperator)
    assert leased.__name__ == "LeasedBashOperator"
    assert set(BashOperator.template_fields) | {"lease_key"} == set(leased.template_fields)


def test_a_built_class_is_found_by_its_dotted_name_and_pickles() -> None:
    leased = LeasedOperator.wrap(EmptyOperator)
    module = importlib.import_module(leased.__module__)
    assert module is wrap_module and getattr(module, leased.__qualname__) is leased
    assert pickle.loads(pickle.dumps(leased)) is leased
    with pytest.raises(AttributeError, match="LeasedNoSuchOperator"):
        wrap_module.LeasedNoSuchOperator  # noqa: B018


def test_wrap_refuses_what_is_not_an_operator_class() -> None:
    for value in (BashOperator(task_id="x", bash_command="true"), dict, "BashOperator"):
        with pytest.raises(TypeError, match="must be an operator class"):
            LeasedOperator.wrap(value)  # type: ignore[arg-type]


def test_a_task_of_a_built_class_pickles_in_a_dag_file_process() -> None:
    # As a DAG file does it, in a fresh process: wrap at import, build a task, pickle it and load it back
    # (which finds the class again by its dotted name).
    code = textwrap.dedent(
        """
        import pickle
        from datetime import timedelta
        from airflow.providers.standard.operators.empty import EmptyOperator
        from airflow_lease_provider.operators import LeasedOperator

        task = LeasedOperator.wrap(EmptyOperator)(task_id="sync", lease_ttl=timedelta(minutes=5))
        copy = pickle.loads(pickle.dumps(task))
        print(type(copy).__module__, type(copy).__name__, type(copy) is type(task), copy.lease_ttl)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    assert last.split() == ["airflow_lease_provider.operators.wrap", "LeasedEmptyOperator", "True", "0:05:00"]
