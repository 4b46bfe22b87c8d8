"""Two DAGs that write one asset, leased by the asset (``lease_on="outlets"``), for test_asset_leases.py.

``writer_a`` holds its lease until the file ``$LEASE_TEST_MARKERS/release`` exists (it first writes
``holding``); ``writer_b`` returns at once. Both write the asset ``shared_table``; ``writer_b`` also writes
``other_table``, so its two leases are taken all or nothing.
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG, Asset, task

SHARED = Asset("shared_table", uri="postgres://warehouse/public/shared")
OTHER = Asset("other_table", uri="postgres://warehouse/public/other")
MARKERS = Path(os.environ.get("LEASE_TEST_MARKERS", "/tmp"))

with DAG("writer_a", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):

    @task.leased(lease_on="outlets", outlets=[SHARED], lease_ttl=timedelta(seconds=60))
    def write(lease=None):
        (MARKERS / "holding").write_text(f"{lease.key} {lease.token}")
        end = time.monotonic() + 120
        while not (MARKERS / "release").exists() and time.monotonic() < end:
            time.sleep(0.2)
        return lease.token

    write()

with DAG("writer_b", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):

    @task.leased(lease_on="outlets", outlets=[OTHER, SHARED], lease_ttl=timedelta(seconds=60))
    def write(lease=None):
        (MARKERS / "b_ran").write_text(" ".join(sorted(lease.leases)))
        return lease.token

    write()
