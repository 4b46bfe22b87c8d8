"""The API-path deployment tier (marker ``apipath``; .ci/run's own stage): a failed test shows its
deployment's process logs and newest task logs, as the deployment tier's do; ``store`` reads a module's
deployment's lease store, as there."""
from __future__ import annotations

from tests.deployment.conftest import pytest_runtest_makereport, store  # noqa: F401  (the hook and the fixture, here too)
