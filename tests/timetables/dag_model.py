"""What the scheduler hands a timetable back: the DagModel row it left after storing a next run."""

from __future__ import annotations

from types import SimpleNamespace

from airflow.timetables.base import DagRunInfo


def stored(info: DagRunInfo) -> SimpleNamespace:
    """The DagModel columns the scheduler reads back (``next_run_info_from_dag_model``); no session."""
    return SimpleNamespace(
        next_dagrun=info.logical_date,
        next_dagrun_data_interval=info.data_interval,
        next_dagrun_create_after=info.run_after,
        next_dagrun_partition_date=None,
        next_dagrun_partition_key=None,
    )
