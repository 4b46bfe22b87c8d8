"""``airflow-lease`` against a real store: tables for people, ``--json`` parsed back, exit codes."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg2.extensions
import psycopg2.sql
import pytest

from airflow_lease_provider import cli
from airflow_lease_provider.core import EventKind, InvalidArgument, LeaseStore

HOLDER = "daily_article/scheduled__2026-11-29T10:00:00+00:00"
SKIPPED = "daily_article/scheduled__2026-11-29T10:10:00+00:00"
VENV_BIN = Path(sys.executable).parent


@pytest.fixture
def run(pg_dsn: str, schema: str) -> Callable[..., tuple[int, str]]:
    """``airflow-lease --dsn ... --schema ... ARGS`` in-process: (exit code, stdout)."""

    def invoke(*args: str, answer: str = "") -> tuple[int, str]:
        out = io.StringIO()
        code = cli.main(["--dsn", pg_dsn, "--schema", schema, *args], out=out, confirm=lambda _prompt: answer)
        return code, out.getvalue()

    return invoke


def run_json(run: Callable[..., tuple[int, str]], *args: str) -> Any:
    code, text = run(*args, "--json")
    assert code == 0, text
    return json.loads(text)


@pytest.fixture
def skip(store: LeaseStore) -> int:
    """A held lease and an overlap skip recorded the way the leased operator records one."""
    lease = store.acquire("daily-article", HOLDER, timedelta(minutes=10))
    assert lease is not None
    store.events.record(
        EventKind.SKIPPED_OVERLAP,
        "daily-article",
        owner=SKIPPED,
        detail={
            "dag_id": "daily_article",
            "run_id": SKIPPED.split("/")[1],
            "task_id": "write",
            "map_index": -1,
            "reason": f"lease 'daily-article' is {lease.describe()}",
            "holder_owner": HOLDER,
            "holder_token": lease.token,
            "holder_expires_at": lease.expires_at.isoformat(),
        },
    )
    return lease.token


def test_status_names_the_task_instance_that_holds_a_key(
    run: Callable[..., tuple[int, str]], store: LeaseStore
) -> None:
    """Two tasks of one run share a key: the HOLDER column says which one holds it, and which map index.

    Before, it printed the run with the map index glued to the run id (``etl/manual__...[3]``) and no task.
    """
    owner = "etl/manual__2026-12-01T10:00:00+00:00/load[3]"
    assert store.acquire("shared", owner, timedelta(minutes=10)) is not None
    code, text = run("status", "--wide")
    assert code == 0, text
    row = text.splitlines()[1].split()
    assert row[:3] == ["shared", "held", owner]


def test_tables_escape_control_characters(
    run: Callable[..., tuple[int, str]], store: LeaseStore, pg_dsn: str, schema: str
) -> None:
    """A key templated from a run's conf, an owner or a force-release reason reach the on-call's terminal:
    ESC sequences, newlines and bidi overrides are shown escaped, not obeyed. Before, the events table
    printed ``force-released by mallory<ESC>[31mRED...`` raw (seen with ``release --force --by``)."""
    key = "sync-\x1b]0;pwned\x07\u202eyek"
    # Such a key is refused now (core/validation.py); a row an older version wrote can still hold one.
    with pytest.raises(InvalidArgument, match="U\\+001B"):
        store.acquire(key, "etl/manual__2026-12-01T10:00:00+00:00/load", timedelta(minutes=10))
    lease = store.acquire("sync-legacy", "etl/manual__2026-12-01T10:00:00+00:00/load", timedelta(minutes=10))
    assert lease is not None
    conn = psycopg2.connect(pg_dsn)
    with conn, conn.cursor() as cur:
        table = psycopg2.sql.Identifier(schema, "lease")
        cur.execute(psycopg2.sql.SQL("UPDATE {} SET key = %s WHERE key = 'sync-legacy'").format(table), (key,))
    conn.close()
    store.force_release(key, by="mallory\x1b[31mRED\x1b[0m\nFAKE LINE", reason="r\x1b[2J")
    for command in (("status", "--wide"), ("events", "--wide")):
        code, text = run(*command)
        assert code == 0, text
        assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text, text
        assert "sync-\\x1b]0;pwned\\x07\\u202eyek" in text, text
    code, text = run("events", "--wide")
    assert "mallory\\x1b[31mRED\\x1b[0m\\nFAKE LINE" in text
    assert not any(line.startswith("FAKE LINE") for line in text.splitlines())


def test_status_table_and_json(run: Callable[..., tuple[int, str]], skip: int) -> None:
    code, text = run("status")
    assert code == 0
    header, row = text.splitlines()[:2]
    assert header.split()[:3] == ["KEY", "STATE", "HOLDER"]
    assert row.split()[:4] == ["daily-article", "held", HOLDER, str(skip)]

    data = run_json(run, "status")
    (lease,) = data["leases"]
    assert lease["held"] is True and lease["token"] == skip
    assert lease["holder_run"] == {
        "dag_id": "daily_article",
        "run_id": "scheduled__2026-11-29T10:00:00+00:00",
        "map_index": -1,
        "path": "dags/daily_article/runs/scheduled__2026-11-29T10%3A00%3A00%2B00%3A00",
    }
    assert 0 < lease["expires_in_seconds"] <= 600
    # --json after the command works as well as before it
    code, text = run("status", "--held", "--json")
    assert code == 0 and json.loads(text)["leases"][0]["key"] == "daily-article"


def test_events_filter_and_json(run: Callable[..., tuple[int, str]], skip: int) -> None:
    data = run_json(run, "events", "--kind", "skipped_overlap", "--since", "1h")
    (event,) = data["events"]
    assert event["key"] == "daily-article" and event["owner"] == SKIPPED
    assert event["run"]["run_id"] == SKIPPED.split("/")[1]
    assert event["task"]["task_id"] == "write"
    assert event["blocked_by"]["run_id"] == HOLDER.split("/")[1]
    assert f"held by {HOLDER} with token {skip}" in event["summary"]

    code, text = run("events", "--key", "daily-article")
    assert code == 0
    assert "skipped_overlap" in text and "acquired" in text and f"held by {HOLDER}" in text

    assert run_json(run, "events", "--since", "2999-01-01T00:00:00")["events"] == []
    code, _ = run("events", "--kind", "no-such-kind")
    assert code == 2


def test_counts(run: Callable[..., tuple[int, str]], skip: int) -> None:
    data = run_json(run, "counts")
    (row,) = data["counts"]
    assert row["key"] == "daily-article"
    assert row["kinds"]["skipped_overlap"] == {"last_24h": 1, "last_7d": 1}
    assert row["kinds"]["acquired"] == {"last_24h": 1, "last_7d": 1}
    code, text = run("counts")
    assert code == 0 and "SKIPPED_OVERLAP" in text and "1 / 1" in text


def _holds(store: LeaseStore, key: str, ttl: timedelta, held_seconds: list[float]) -> None:
    """A key whose lease has ``ttl`` and whose ledger shows these hold times (as release() records them)."""
    for seconds in held_seconds:
        store.events.record(
            EventKind.RELEASED, key, owner="dag/run", token=1, detail={"held_seconds": seconds}
        )
    assert store.acquire(key, "dag/run", ttl) is not None


def test_advise_ttl(run: Callable[..., tuple[int, str]], store: LeaseStore) -> None:
    _holds(store, "too-short", timedelta(minutes=2), [60, 100, 120])  # advice 3m-4m
    _holds(store, "fits", timedelta(minutes=3, seconds=30), [60, 100, 120])
    _holds(store, "too-long", timedelta(hours=2), [60, 100, 120])
    assert store.acquire("fresh", "dag/run", timedelta(minutes=5)) is not None

    data = run_json(run, "advise-ttl")
    verdicts = {a["key"]: a for a in data["advice"]}
    assert {k: a["verdict"] for k, a in verdicts.items()} == {
        "fits": "ok",
        "fresh": "no_data",
        "too-long": "too_long",
        "too-short": "too_short",
    }
    assert verdicts["too-short"]["worst_hold_seconds"] == 120
    assert verdicts["too-short"]["recommended_min_seconds"] == 180
    assert verdicts["too-short"]["recommended_max_seconds"] == 240
    assert "zombie" in verdicts["too-short"]["message"]
    assert "after a crash" in verdicts["too-long"]["message"]

    code, text = run("advise-ttl", "--check")
    assert code == cli.EXIT_ADVICE
    assert "too_short" in text and "3m-4m" in text
    assert run("advise-ttl", "--key", "fits", "--check")[0] == 0


def test_release_needs_force(run: Callable[..., tuple[int, str]], store: LeaseStore, skip: int) -> None:
    code, _ = run("release", "daily-article")
    assert code == cli.EXIT_USAGE
    holder = store.holder("daily-article")
    assert holder is not None and holder.token == skip


def test_release_force_bumps_token_and_records_who(
    run: Callable[..., tuple[int, str]], store: LeaseStore, skip: int
) -> None:
    code, _ = run("release", "--force", "daily-article", "--expected-token", str(skip + 5))
    assert code == cli.EXIT_ERROR
    assert store.holder("daily-article") is not None

    result = run_json(
        run, "release", "--force", "daily-article", "--by", "alice", "--reason", "host lost", "--yes"
    )
    assert result["previous"]["owner"] == HOLDER and result["previous"]["token"] == skip
    assert result["new_token"] == skip + 1
    assert store.holder("daily-article") is None
    (event,) = store.events.query(key="daily-article", kind=EventKind.FORCE_RELEASED)
    assert event.detail["by"] == "alice" and event.detail["reason"] == "host lost"
    assert event.detail["new_token"] == skip + 1

    assert run("release", "--force", "no-such-key", "--yes")[0] == cli.EXIT_ERROR


def test_release_on_a_terminal_asks_for_the_key(
    run: Callable[..., tuple[int, str]], store: LeaseStore, skip: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    code, _ = run("release", "--force", "daily-article", answer="nope")
    assert code == cli.EXIT_NOT_CONFIRMED
    assert store.holder("daily-article") is not None
    code, text = run("release", "--force", "daily-article", answer="daily-article")
    assert code == 0 and f"the token is now {skip + 1}" in text


def test_unreachable_store_fails_without_showing_the_password(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(
        ["--dsn", "postgresql://lease:s3cret-pw@127.0.0.1:9/nowhere", "status"], out=io.StringIO()
    )
    assert code == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert "unreachable" in err and "s3cret-pw" not in err


def test_console_script(pg_dsn: str, schema: str, skip: int) -> None:
    """The installed ``airflow-lease`` entry point, as a script would call it."""
    result = subprocess.run(
        [str(VENV_BIN / "airflow-lease"), "--dsn", pg_dsn, "--schema", schema, "--json", "status"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["leases"][0]["token"] == skip


@pytest.mark.slow
def test_airflow_connection_settings(pg_dsn: str, schema: str, skip: int, tmp_path: Path) -> None:
    """Without --dsn the store comes from the same settings as the hooks: [lease] conn_id and schema."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(
        AIRFLOW_HOME=str(tmp_path),
        AIRFLOW_CONN_MY_LEASES=pg_dsn,
        AIRFLOW__LEASE__CONN_ID="my_leases",
        AIRFLOW__LEASE__SCHEMA=schema,
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
    )
    result = subprocess.run(
        [str(VENV_BIN / "airflow-lease"), "status", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["leases"][0]["owner"] == HOLDER


def test_a_bad_schema_in_the_connection_is_blamed_on_the_connection(pg_dsn: str, tmp_path: Path) -> None:
    """The user passed no --schema: the error must point at where the bad value is (the connection)."""
    info = psycopg2.extensions.parse_dsn(pg_dsn)
    conn = {"conn_type": "lease", "host": info.get("host", "127.0.0.1"), "port": int(info.get("port", 5432)),
            "login": info.get("user", "postgres"), "schema": info.get("dbname", "test"),
            "extra": {"lease_schema": "s" * 80}}
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(AIRFLOW_HOME=str(tmp_path), AIRFLOW_CONN_MY_LEASES=json.dumps(conn),
               AIRFLOW__LEASE__CONN_ID="my_leases", AIRFLOW__CORE__LOAD_EXAMPLES="False")
    result = subprocess.run([str(VENV_BIN / "airflow-lease"), "status"], capture_output=True, text=True,
                            timeout=300, check=False, env=env)
    assert result.returncode == cli.EXIT_USAGE, (result.returncode, result.stderr[-2000:])
    assert "--schema" not in result.stderr and "connection 'my_leases'" in result.stderr, result.stderr[-2000:]
