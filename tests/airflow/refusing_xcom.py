"""An XCom backend that refuses the lease's XCom of one DAG, like an API server refusing a push.

Set with ``[core] xcom_backend = tests.airflow.refusing_xcom.RefusingXCom`` (test_scheduler_e2e.py).
"""

from __future__ import annotations

from typing import Any

from airflow.sdk.bases.xcom import BaseXCom

REFUSED_DAG = "live_xcom_refused"


class RefusingXCom(BaseXCom):
    @staticmethod
    def serialize_value(value: Any, *, key: str | None = None, task_id: str | None = None,
                        dag_id: str | None = None, run_id: str | None = None, map_index: int | None = None) -> Any:
        if dag_id == REFUSED_DAG and key == "lease":
            raise RuntimeError("XCom push refused: 413 Request Entity Too Large")
        return BaseXCom.serialize_value(value, key=key, task_id=task_id, dag_id=dag_id, run_id=run_id,
                                        map_index=map_index)
