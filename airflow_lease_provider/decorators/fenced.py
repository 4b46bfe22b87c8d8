"""``@task.fenced_publish``: a publish step behind the fence.

::

    @task.fenced_publish(resource="blog.articles", idempotency_key="{{ ti.xcom_pull(task_ids='write')['slot'] }}")
    def publish(article, fence=None):
        fence.cursor.execute("INSERT INTO articles (body, token) VALUES (%s, %s)", (article, fence.token))

    @task.fenced_publish(resource="git:site", target="external")
    def push(fence=None):
        subprocess.run(["git", "push", remote, f"HEAD:refs/heads/token-{fence.token}"], check=True)

Under a run lease (or inside a leased task) the function runs only after (a) a fresh read of the
store shows this run still holding the lease and (b) the fence accepted its token. ``target="postgres"``
(default) runs the function inside the fence's transaction (``fence.cursor``), so the write commits with
the fence advance or not at all. ``target="external"`` advances the fence first, then calls the function,
which carries ``fence.token`` to the side effect; if the function raises, the ``idempotency_key``'s claim
is given back so a retry can publish the slot (a task killed inside it keeps the claim: at most once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from airflow.providers.standard.operators.python import PythonOperator

from airflow_lease_provider.core import validation
from airflow_lease_provider.decorators._python import PythonDecorated, template_fields
from airflow_lease_provider.runtime.arguments import check_publish_arguments
from airflow_lease_provider.runtime.context import LeaseContext, activated
from airflow_lease_provider.runtime.task_lease import publishing_lease
from airflow_lease_provider.version_compat import TaskDecorator, task_decorator_factory


@dataclass(frozen=True)
class FencedPublish:
    """Handed to a ``@task.fenced_publish`` function as ``fence``."""

    resource: str
    token: int
    owner: str
    idempotency_key: str | None
    cursor: Any = None


class _FencedPublishDecoratedOperator(PythonDecorated, PythonOperator):
    """A TaskFlow function run behind the fence, under the lease it publishes under."""

    template_fields: Sequence[str] = template_fields(PythonOperator, extra=("resource", "idempotency_key", "lease_key"))
    custom_operator_name = "@task.fenced_publish"
    resource: str
    target: str
    fence_conn_id: str | None
    idempotency_key: str | None
    lease_key: str | None
    lease_conn_id: str | None

    def __init__(
        self,
        *,
        resource: str,
        target: str = "postgres",
        fence_conn_id: str | None = None,
        idempotency_key: str | None = None,
        lease_key: str | None = None,
        lease_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        publishing = check_publish_arguments(
            resource=resource, target=target, idempotency_key=idempotency_key, lease_key=lease_key,
            fence_conn_id=fence_conn_id, lease_conn_id=lease_conn_id,
        )
        super().__init__(**kwargs)
        for name, value in publishing.items():
            setattr(self, name, value)

    def execute(self, context: Any) -> Any:
        self._context = context
        return super().execute(context)

    def execute_callable(self) -> Any:
        lease = publishing_lease(self, self._context, lease_key=self.lease_key, conn_id=self.lease_conn_id)
        with activated(lease), _behind_the_fence(
            lease, self.resource, target=self.target, conn_id=self.fence_conn_id, idempotency_key=self.idempotency_key
        ) as cursor:
            fence = FencedPublish(self.resource, lease.token, lease.owner, self.idempotency_key, cursor)
            self.log.info("fence: %r accepted token %s; publishing", self.resource, lease.token)
            return self.python_callable(*self.op_args, **{**self.op_kwargs, "fence": fence})


@contextmanager
def _behind_the_fence(
    lease: LeaseContext, resource: str, *, target: str, conn_id: str | None, idempotency_key: str | None
) -> Iterator[Any]:
    """The publish of ``target``: ``"postgres"`` (any SQL target) is :meth:`LeaseContext.fenced_transaction`
    (its cursor is yielded: exactly once), ``"external"`` is :meth:`LeaseContext.fence` around the block (None
    is yielded; the idempotency claim is given back if the block raises). One name each, on the lease."""
    if target == "postgres":
        with lease.fenced_transaction(resource, conn_id=conn_id, idempotency_key=idempotency_key) as cur:
            yield cur
    else:
        with lease.fence(resource, conn_id=conn_id, idempotency_key=idempotency_key):
            yield None


def fenced_publish_task(
    python_callable: Callable | None = None,
    multiple_outputs: bool | None = None,
    **kwargs: Any,
) -> TaskDecorator:
    """Wrap a publish function behind the fence (see the module docs). The function takes ``fence=None``."""
    if "resource" not in kwargs:
        raise validation.InvalidArgument("resource", None, "is required: the fence's name for the write target")
    check_publish_arguments(
        resource=kwargs["resource"], target=kwargs.get("target", "postgres"),
        idempotency_key=kwargs.get("idempotency_key"), lease_key=kwargs.get("lease_key"),
    )
    return task_decorator_factory(
        python_callable=python_callable,
        multiple_outputs=multiple_outputs,
        decorated_operator_class=_FencedPublishDecoratedOperator,
        **kwargs,
    )
