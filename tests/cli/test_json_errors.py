"""With ``--json``, an error is JSON on stdout too (issue 23, "--json errors could be JSON").

Through the console script, as a script that runs ``airflow-lease ... --json`` and parses stdout meets
it: usage errors (found before ``--json`` itself is parsed), an unknown key, a release not confirmed,
a store that cannot be reached (its password never in the JSON), and the success path unchanged.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from airflow_lease_provider import cli
from airflow_lease_provider.core import LeaseStore

CONSOLE = str(Path(sys.executable).parent / "airflow-lease")


def _run(*args: str) -> tuple[int, str, str]:
    result = subprocess.run([CONSOLE, *args], capture_output=True, text=True, timeout=120, check=False)
    return result.returncode, result.stdout, result.stderr


def _error(stdout: str) -> dict[str, object]:
    document = json.loads(stdout)  # the whole of stdout is one JSON document
    assert set(document) == {"error"}, document
    error = document["error"]
    assert isinstance(error, dict)
    return error


@pytest.mark.parametrize(
    "args",
    [
        ("--json", "events", "--days", "-1"),  # an option the subcommand does not have
        ("events", "--since", "yesterday-ish", "--json"),  # a bad value
        ("--json", "frobnicate"),  # an unknown command
    ],
)
def test_a_usage_error_with_json_is_a_json_error_with_exit_2(args: tuple[str, ...]) -> None:
    code, out, err = _run("--dsn", "postgresql://u@127.0.0.1:9/db", *args)
    assert code == cli.EXIT_USAGE
    error = _error(out)
    assert error["kind"] == "usage" and error["exit_code"] == cli.EXIT_USAGE
    assert str(error["message"]).startswith("error: ")
    assert f"airflow-lease: {error['message']}" in err  # the same line a person reads on stderr


def test_without_json_an_error_leaves_stdout_empty() -> None:
    code, out, err = _run("--dsn", "postgresql://u@127.0.0.1:9/db", "events", "--since", "yesterday-ish")
    assert code == cli.EXIT_USAGE and out == "" and err.startswith("airflow-lease: error: ")


def test_an_unreachable_store_is_a_store_error_without_its_password() -> None:
    password = "Rk4mWq9zTp"
    code, out, err = _run("--dsn", f"postgresql://u:{password}@127.0.0.1:9/db", "status", "--json")
    assert code == cli.EXIT_ERROR
    error = _error(out)
    assert error["kind"] == "store" and error["type"] == "LeaseStoreUnavailable", error
    assert error["exit_code"] == cli.EXIT_ERROR
    assert password not in out + err and "Traceback" not in err


def test_an_unknown_key_and_an_unconfirmed_release(
    pg_dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LeaseStore(pg_dsn, schema=schema)
    store.ensure_schema()
    assert store.acquire("held-key", owner="dag/run/t", ttl=timedelta(minutes=5)) is not None
    base = ("--dsn", pg_dsn, "--schema", schema)

    code, out, _ = _run(*base, "status", "--key", "no-such-key", "--json")
    error = _error(out)
    assert (code, error["kind"], error["exit_code"]) == (cli.EXIT_ERROR, "not_found", cli.EXIT_ERROR)
    assert "no-such-key" in str(error["message"])

    code, out, _ = _run(*base, "release", "held-key", "--json")  # no --force
    assert (code, _error(out)["kind"]) == (cli.EXIT_USAGE, "usage")

    code, out, _ = _run(*base, "release", "--force", "held-key", "--expected-token", "99", "--json")
    assert (code, _error(out)["kind"]) == (cli.EXIT_ERROR, "changed")

    # A release that asked for confirmation and did not get it (in-process: the prompt needs a terminal).
    stdout = io.StringIO()
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    code = cli.main([*base, "release", "--force", "held-key", "--json"], out=stdout, confirm=lambda _: "no")
    assert code == cli.EXIT_NOT_CONFIRMED
    assert _error(stdout.getvalue())["kind"] == "not_confirmed"
    assert store.lease("held-key").held  # type: ignore[union-attr]  # nothing was released

    # Success is unchanged: the result document, no "error".
    code, out, _ = _run(*base, "status", "--key", "held-key", "--json")
    assert code == cli.EXIT_OK and "error" not in json.loads(out)
    store.close()
