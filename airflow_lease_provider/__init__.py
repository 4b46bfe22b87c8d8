"""Leases with fencing tokens, capped catch-up and visible skips for Apache Airflow 3.

The package is layered: :mod:`airflow_lease_provider.core` knows nothing of Airflow (the lease and fence
store, its SQL, its exceptions); the Airflow-facing parts (hooks, operators, decorators, triggers,
timetables, plugins) sit on top of it and reach Airflow's internals only through
:mod:`airflow_lease_provider.version_compat`. Importing this package imports neither.

Supported: Apache Airflow 3.1, 3.2 and 3.3 (docs/install.md). With an older Airflow installed, importing
the package raises at once, like the official providers do, instead of failing later on a missing name.
"""

from __future__ import annotations

from importlib import metadata

__all__ = ["MIN_AIRFLOW_VERSION", "__version__"]

DISTRIBUTION = "airflow-lease-provider"

# The oldest Apache Airflow this package runs on; pyproject.toml declares the same lower bound.
MIN_AIRFLOW_VERSION = "3.1.0"

try:
    # The version is written once, in pyproject.toml; everything else reads the installed metadata.
    __version__: str = metadata.version(DISTRIBUTION)
except metadata.PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"


def check_airflow_version(found: str) -> None:
    """Raise ``RuntimeError`` when Airflow ``found`` is older than :data:`MIN_AIRFLOW_VERSION`."""
    from packaging.version import Version

    if Version(Version(found).base_version) < Version(MIN_AIRFLOW_VERSION):
        raise RuntimeError(
            f"The package `{DISTRIBUTION}:{__version__}` needs Apache Airflow {MIN_AIRFLOW_VERSION}+ "
            f"(found Apache Airflow {found}); upgrade Airflow, or use a release of {DISTRIBUTION} that "
            "supports yours"
        )


def _installed_airflow() -> str | None:
    """The installed Airflow's version from its distribution metadata, without importing Airflow."""
    for name in ("apache-airflow-core", "apache-airflow"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


# Checked from metadata so that the Airflow-free core stays importable (and cheap) without Airflow;
# version_compat checks airflow.__version__ again when the Airflow-facing modules load.
_airflow = _installed_airflow()
if _airflow is not None:
    check_airflow_version(_airflow)
del _airflow
