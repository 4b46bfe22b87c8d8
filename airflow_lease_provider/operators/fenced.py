"""Fenced publishing: the write target itself turns away writers with an old fencing token.

Two gates, in order, right before the side effect:

1. the early safety net: a fresh read of the lease store shows this run still holding the lease
   with this token (a run that lost it stops here, before touching anything);
2. the final gate: the fence of the resource accepts the token only if it is larger than every token
   it accepted before. With a SQL target the fence advance and the write share one transaction
   (exactly once); for anything else the fence advances first and the side effect follows, carrying
   the token.

``FencedSQLOperator`` is the SQL form: on PostgreSQL, or on any connection whose hook is a common.sql
``DbApiHook`` of a dialect the fence is known to work on (SQLite), with the fence's tables in that
database (hooks/dbapi_fence.py). Inside a leased task use the lease context instead
(``lease.fenced_transaction(...)`` / ``lease.fence(...)``); in a separate publish task under a
run lease, use this operator or ``@task.fenced_publish``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator

from airflow_lease_provider.core import DuplicatePublish, validation
from airflow_lease_provider.core.db import with_names_for
from airflow_lease_provider.runtime.arguments import check_publish_arguments
from airflow_lease_provider.runtime.context import LeaseContext
from airflow_lease_provider.runtime.task_lease import publishing_lease
from airflow_lease_provider.version_compat import AirflowSkipException


class FencedSQLOperator(BaseOperator):
    """Run SQL on the target database in the same transaction as the fence advance: exactly once.

    The target is PostgreSQL or any connection whose hook is a common.sql ``DbApiHook`` of a dialect the
    fence is known to work on (SQLite; any other is refused: docs/airflow.md, "Where the fence is kept").

    :param resource: the fence's name for the write target (e.g. ``"blog.articles"``). Templated.
    :param sql: the statement, or a list of statements, to run (templated); values go in ``parameters``,
        never into the SQL text.
    :param parameters: query parameters in the driver's own style (psycopg2: ``%(name)s``; sqlite3:
        ``:name``). With a dict, the lease's token is added as ``fencing_token`` (``%(fencing_token)s`` /
        ``:fencing_token``) so the row can carry it.
    :param identifiers: names to fill into ``{placeholders}`` of ``sql`` as quoted identifiers, e.g.
        ``sql="INSERT INTO {table} ..."``, ``identifiers={"table": ["billing", "invoices"]}``
        (schema-qualified as a list), quoted by psycopg2 on PostgreSQL and as standard SQL's ``"name"``
        elsewhere. Names never go into SQL text unquoted.
    :param fence_conn_id: the target database's connection (default: the lease store's).
    :param idempotency_key: optional per-slot key (templated): a slot already published is refused
        whatever the token, so retries and re-runs publish once. Compute it with
        ``slot_idempotency_key(job, context)`` in a task and pull it from XCom
        (``"{{ ti.xcom_pull(task_ids='collect')['slot'] }}"``); ``{{ data_interval_start }}`` is undefined
        in a run without a logical date (Airflow 3's default for manual runs).
    :param on_duplicate: what a publish whose ``idempotency_key`` was published already does (a retry
        or a cleared re-run of a published slot): ``"fail"`` (default, ``DuplicatePublish``) or
        ``"skip"`` (the task is skipped with the reason; nothing is written).
    :param lease_key: the run lease to publish under (templated; default the DAG id, the run
        lease's default key).
    :param lease_conn_id: the lease store's connection.
    """

    template_fields: Sequence[str] = (
        "resource", "sql", "parameters", "identifiers", "idempotency_key", "lease_key",
    )
    template_fields_renderers = {"sql": "sql", "parameters": "json"}
    template_ext: Sequence[str] = (".sql",)
    ui_color = "#ede8f4"
    resource: str
    fence_conn_id: str | None
    idempotency_key: str | None
    on_duplicate: str
    lease_key: str | None
    lease_conn_id: str | None

    def __init__(
        self,
        *,
        resource: str,
        sql: str | Sequence[str],
        parameters: dict[str, Any] | Sequence[Any] | None = None,
        identifiers: dict[str, str | Sequence[str]] | None = None,
        fence_conn_id: str | None = None,
        idempotency_key: str | None = None,
        on_duplicate: str = "fail",
        lease_key: str | None = None,
        lease_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        publishing = check_publish_arguments(
            resource=resource, idempotency_key=idempotency_key, lease_key=lease_key, on_duplicate=on_duplicate,
            fence_conn_id=fence_conn_id, lease_conn_id=lease_conn_id,
        )
        statements = [sql] if isinstance(sql, str) else list(sql) if isinstance(sql, Sequence) else [None]
        if not statements or not all(isinstance(q, str) and q.strip() for q in statements):
            raise validation.InvalidArgument("sql", sql, "must be a non-empty string or list of non-empty strings")
        if identifiers is not None and not (
            isinstance(identifiers, dict)
            and all(isinstance(v, str) or (isinstance(v, list | tuple) and v) for v in identifiers.values())
        ):
            raise validation.InvalidArgument(
                "identifiers", identifiers, "must be a dict of placeholder -> name or [schema, name]"
            )
        for name, value in publishing.items():
            setattr(self, name, value)
        self.sql = sql
        self.parameters = parameters
        self.identifiers = identifiers

    def execute(self, context: Any) -> int:
        lease = publishing_lease(self, context, lease_key=self.lease_key, conn_id=self.lease_conn_id)
        try:
            rows = self._publish(lease)
        except DuplicatePublish as exc:
            if self.on_duplicate != "skip":
                raise
            raise AirflowSkipException(f"{exc.args[0]}: nothing written (on_duplicate='skip')") from None
        self.log.info("fence: published to %r with token %s (%s rows)", self.resource, lease.token, rows)
        return lease.token

    def _publish(self, lease: LeaseContext) -> int:
        with lease.fenced_transaction(
            self.resource, conn_id=self.fence_conn_id, idempotency_key=self.idempotency_key
        ) as cur:
            parameters = self.parameters
            if isinstance(parameters, dict) or parameters is None:
                parameters = {**(parameters or {}), "fencing_token": lease.token}
            rows = 0
            for statement in [self.sql] if isinstance(self.sql, str) else self.sql:
                cur.execute(with_names_for(cur, statement, self.identifiers), parameters)
                rows += max(cur.rowcount, 0)
        return rows


