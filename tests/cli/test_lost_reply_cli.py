"""``airflow-lease release --force`` when the store's answer to the release is lost (issue 38, defect 6).

The CLI reaches the real PostgreSQL through a proxy that lets the force-release commit and then cuts the
connection before its answer (tests/lost_reply.py). Before the fix the statement was sent again, found
the token it had bumped itself, and the admin read "changed since you looked; nothing was released".
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from datetime import timedelta

import pytest

from airflow_lease_provider import cli
from airflow_lease_provider.core import EventKind, LeaseStore
from tests.lost_reply import LostReplyProxy

HOLDER = "daily_article/scheduled__2026-11-29T10:00:00+00:00/write"


@pytest.fixture
def proxy(pg_dsn: str) -> Iterator[LostReplyProxy]:
    cut = LostReplyProxy.for_dsn(pg_dsn)
    yield cut
    cut.close()


@pytest.mark.parametrize("expected", [False, True], ids=["confirmed-by-key", "expected-token"])
def test_a_force_release_whose_answer_is_lost_is_reported_released(
    store: LeaseStore, proxy: LostReplyProxy, pg_dsn: str, schema: str, expected: bool
) -> None:
    lease = store.acquire("daily-article", HOLDER, timedelta(minutes=10))
    assert lease is not None
    proxy.lose_reply(after=b"AS new_token")
    args = ["--dsn", proxy.dsn(pg_dsn), "--schema", schema, "release", "--force", "daily-article", "--json",
            "--by", "alice"]
    args += ["--expected-token", str(lease.token)] if expected else ["--yes"]
    out = io.StringIO()
    code = cli.main(args, out=out, confirm=lambda _prompt: "")
    assert proxy.lost.is_set(), "the proxy lost no answer: the test tested nothing"
    assert code == cli.EXIT_OK, out.getvalue()
    result = json.loads(out.getvalue())
    assert result["previous"]["owner"] == HOLDER and result["previous"]["token"] == lease.token
    assert result["new_token"] == lease.token + 1
    row = store.lease("daily-article")
    assert row is not None and row.token == lease.token + 1 and not row.held  # released, bumped once
    (event,) = store.events.query(key="daily-article", kind=EventKind.FORCE_RELEASED)
    assert event.detail["by"] == "alice" and event.token == lease.token
