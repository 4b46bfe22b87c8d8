"""``S3FenceHook``: the object-store fence (``fences.s3``) through an Airflow AWS connection.

Needs the ``s3`` extra (``pip install 'airflow-lease-provider[s3]'``: the Amazon provider). The boto3
client is the Amazon provider's ``S3Hook(aws_conn_id=...).get_conn()``, so everything that connection
says applies: credentials, role assumption, region, and ``endpoint_url`` in its extra for an
S3-compatible store (MinIO, Ceph, R2, moto). The store must answer conditional writes (``If-Match`` /
``If-None-Match`` on PutObject) with 412: AWS S3 does; docs/core.md, "Fencing at the object store".
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseHook

from airflow_lease_provider.fences.s3 import (
    DEFAULT_MARKER_PREFIX,
    FencedObject,
    ObjectFence,
    ObjectPublish,
)

DEFAULT_AWS_CONN_ID = "aws_default"


class S3FenceHook(BaseHook):
    """Fenced writes to S3 (or any S3-compatible store) through an Airflow AWS connection.

    :param aws_conn_id: the AWS connection (default ``aws_default``), as the Amazon provider reads it.
    :param region_name: overrides the connection's region.
    :param marker_prefix: where idempotency claims are kept in each bucket (default ``.lease-fence/``).
    :param max_attempts: compare-and-swaps to try against writes of the same grant (see :class:`ObjectFence`).
    """

    conn_name_attr = "aws_conn_id"
    default_conn_name = DEFAULT_AWS_CONN_ID
    conn_type = "aws"
    hook_name = "Lease fence (S3)"

    def __init__(
        self,
        aws_conn_id: str | None = DEFAULT_AWS_CONN_ID,
        *,
        region_name: str | None = None,
        marker_prefix: str = DEFAULT_MARKER_PREFIX,
        max_attempts: int = 10,
    ) -> None:
        super().__init__()
        self.aws_conn_id = aws_conn_id
        self.region_name = region_name
        self.marker_prefix = marker_prefix
        self.max_attempts = max_attempts
        self._fence: ObjectFence | None = None

    def get_conn(self) -> Any:
        """The boto3 S3 client, from the Amazon provider's ``S3Hook``."""
        try:
            from airflow.providers.amazon.aws.hooks.s3 import S3Hook
        except ImportError as exc:  # pragma: no cover - depends on what is installed
            raise ImportError(
                "S3FenceHook needs the Amazon provider: pip install 'airflow-lease-provider[s3]' "
                "(apache-airflow-providers-amazon)"
            ) from exc
        return S3Hook(aws_conn_id=self.aws_conn_id, region_name=self.region_name).get_conn()

    def get_fence(self) -> ObjectFence:
        if self._fence is None:
            self._fence = ObjectFence(
                self.get_conn(), marker_prefix=self.marker_prefix, max_attempts=self.max_attempts
            )
        return self._fence

    def put(self, bucket: str, key: str, body: bytes | str, **kwargs: Any) -> ObjectPublish:
        """:meth:`ObjectFence.put` (``token=``, ``lease_key=``, ``owner=``, ``store_id=``, ...)."""
        return self.get_fence().put(bucket, key, body, **kwargs)

    def read(self, bucket: str, key: str, *, body: bool = True) -> FencedObject | None:
        """:meth:`ObjectFence.read`: the object with the token of the write that made it."""
        return self.get_fence().read(bucket, key, body=body)

    def current(self, resource: str, *, key: str) -> int | None:
        """:meth:`ObjectFence.current`: lease ``key``'s largest token at ``resource`` (``s3://bucket/object``)."""
        return self.get_fence().current(resource, key=key)
