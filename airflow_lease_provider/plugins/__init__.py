"""Airflow plugins of the provider. Registered only through the ``airflow.plugins`` entry point."""

from __future__ import annotations
