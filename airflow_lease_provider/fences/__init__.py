"""Fences of the user's write targets that need a client library the core does not (docs/core.md, "Fences").

``fences.s3``: the fence at an S3-compatible object store (botocore: the ``s3`` extra). Each implements the
core's :class:`~airflow_lease_provider.core.fencing.FenceView` and decides by its one rule,
:func:`~airflow_lease_provider.core.fencing.decide`. Nothing here imports Airflow; the hooks
(``hooks.s3_fence``) build these from Airflow connections.
"""
