"""A client clock an hour off changes no decision: every expiry is judged by the database clock.

The skewed client is a real separate process whose clock libfaketime moves by an hour (Debian's
``faketime`` package), so ``time.time()`` and ``datetime.now()`` there are really wrong.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest

from airflow_lease_provider.core import LeaseStore
from tests.tools import libfaketime

LIBFAKETIME = libfaketime()

pytestmark = pytest.mark.needs("faketime")

CLIENT = textwrap.dedent(
    """
    import json, sys, threading
    from datetime import datetime, timedelta, timezone
    from airflow_lease_provider.core import LeaseStore
    dsn, schema, action = sys.argv[1:4]
    store = LeaseStore(dsn, schema=schema)
    if action == "acquire":
        lease = store.acquire("job", owner="skewed", ttl=timedelta(seconds=2))
        keeper = store.keep(lease)
        threading.Event().wait(3.5)  # longer than the TTL: only renewals keep it (time.sleep breaks under libfaketime)
        keeper.check()
        out = {"token": lease.token, "renewals": keeper.renewals, "remaining": keeper.lease.remaining.total_seconds()}
        keeper.stop(release=False)
    else:
        got = store.acquire("job", owner="skewed", ttl=timedelta(seconds=30))
        out = {"acquired": got is not None}
    out["local_clock"] = datetime.now(timezone.utc).isoformat()
    print(json.dumps(out))
    """
)


def _run_skewed(offset: str, dsn: str, schema: str, action: str) -> dict:
    env = {"FAKETIME": offset, "LD_PRELOAD": str(LIBFAKETIME), "DONT_FAKE_MONOTONIC": "1"}
    import os

    result = subprocess.run(
        [sys.executable, "-c", CLIENT, dsn, schema, action],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("offset", ["+1h", "-1h"])
def test_a_client_an_hour_off_changes_no_decision(offset: str, pg_dsn: str, schema: str) -> None:
    from datetime import datetime, timezone

    honest = LeaseStore(pg_dsn, schema=schema)
    honest.ensure_schema()

    # The skewed client takes the lease and keeps it past its TTL by renewing.
    out = _run_skewed(offset, pg_dsn, schema, "acquire")
    local = datetime.fromisoformat(out["local_clock"])
    assert abs((local - datetime.now(timezone.utc)).total_seconds()) > 3000, "the clock was not skewed"
    assert out["renewals"] >= 2 and 1.0 < out["remaining"] <= 2.0
    # It left the lease unreleased with about 2 s to go: still held for the honest client...
    held = honest.holder("job")
    assert held is not None and held.owner == "skewed"
    assert honest.acquire("job", owner="honest", ttl=timedelta(seconds=30)) is None
    # ...and free once the database clock says so, whatever the skewed client believes.
    time.sleep(held.remaining.total_seconds() + 0.2)
    taken = honest.acquire("job", owner="honest", ttl=timedelta(seconds=30))
    assert taken is not None and taken.token == out["token"] + 1
    # The skewed client cannot take a lease the database says is held.
    assert _run_skewed(offset, pg_dsn, schema, "try")["acquired"] is False
    honest.close()
