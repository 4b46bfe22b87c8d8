"""The API-path deployment tier (marker ``apipath``; .ci/run's own stage): a failed test shows its
deployment's process logs and newest task logs, as the deployment tier's do."""
from __future__ import annotations

from tests.deployment.conftest import pytest_runtest_makereport  # noqa: F401  (the hook, registered here too)
