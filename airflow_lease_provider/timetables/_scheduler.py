"""What :class:`~airflow_lease_provider.timetables.CappedCatchupTimetable` reads through the scheduler's
session, and only when the stored next run is older than the newest due slot (it may move it forward).

``Timetable.next_run_info_from_dag_model`` (Airflow 3.2+; 3.1 never calls it) receives only the ``dag``
row. When the cap may move the stored next run, the timetable needs facts the row does not carry: the
DAG's ``catchup`` flag (``catchup=False`` keeps only the newest slot) and ``end_date``, and the logical
dates its runs already have. Both are read with
the session that loaded the row (the scheduler's, inside its transaction): one ``serialized_dag`` read
and one ``dag_run`` read. When the row has no session (``airflow dags next-execution`` closes its session
first; a plain object in a test) nothing is read and the answer is None. The Airflow names come from
:mod:`airflow_lease_provider.version_compat`; the queries are this module's.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

from airflow_lease_provider import version_compat

if TYPE_CHECKING:
    from airflow.timetables.base import TimeRestriction


def dag_time_restriction(dag_model: Any) -> TimeRestriction | None:
    """The time restriction of ``dag_model``'s DAG (``start_date``, ``end_date``, ``catchup``), or None.

    Read as the scheduler reads the DAG right before it calls ``next_run_info_from_dag_model``
    (``SerializedDagModel.get``), and the restriction Airflow's own ``next_dagrun_info`` applies. None
    when ``dag_model`` has no session or the DAG is not serialized.
    """
    session = version_compat.scheduler_session(dag_model)
    if session is None:
        return None
    serialized = version_compat.SerializedDagModel.get(dag_id=dag_model.dag_id, session=session)
    if serialized is None:
        return None
    return version_compat.time_restriction_of(serialized.dag)


def taken_logical_dates(dag_model: Any, since: datetime.datetime) -> set[datetime.datetime] | None:
    """Logical dates from ``since`` on that runs of ``dag_model``'s DAG already have, or None if unknown.

    The scheduler checks only the stored next run for an existing run, then creates whatever
    ``next_run_info_from_dag_model`` returns; a logical date already taken (a manual run with a logical
    date, a backfill) fails that insert on ``dag_run_dag_id_logical_date_key`` and leaves the scheduler's
    session unusable. None when ``dag_model`` has no session.
    """
    from sqlalchemy import select

    session = version_compat.scheduler_session(dag_model)
    if session is None:
        return None
    DagRun = version_compat.DagRun  # noqa: N806 - the model's own name
    taken = session.scalars(
        select(DagRun.logical_date).where(DagRun.dag_id == dag_model.dag_id, DagRun.logical_date >= since)
    ).all()
    return {value for value in taken if value is not None}
