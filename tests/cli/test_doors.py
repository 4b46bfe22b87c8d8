"""The CLI as a person meets it: a store with more than 1,000 keys, bad input, bad DSNs, typos.

Issue 11 items 5-8, through ``airflow-lease`` itself (in-process ``cli.main`` and the console script).
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from airflow_lease_provider import cli
from airflow_lease_provider.core import EventKind, InvalidArgument, LeaseStore, LeaseStoreUnavailable
from airflow_lease_provider.core.db import describe_dsn
from tests.pg import execute, new_schema_name, q

VENV_BIN = Path(sys.executable).parent
KEYS = 1005
#: Passwords with the characters a URI gives meaning to, unencoded and encoded.
#: Their pieces between those characters are distinctive, so finding one anywhere in the output is a leak.
PASSWORDS = ["Qz7x/Wk3p@Rm9v:Ty4u?Hb2n", "Jd8s/Lq2w", "Vn5c@Gh6j/Pf3k:Xr8t?Zm1", "Ku4e:/@?Bw7y"]

Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def run(pg_dsn: str, schema: str, capsys: pytest.CaptureFixture[str]) -> Run:
    """``airflow-lease --dsn ... --schema ... ARGS`` in-process: (exit code, stdout, stderr)."""

    def invoke(*args: str, dsn: str | None = None, answer: str = "") -> tuple[int, str, str]:
        out = io.StringIO()
        capsys.readouterr()
        code = cli.main(
            ["--dsn", dsn or pg_dsn, "--schema", schema, *args], out=out, confirm=lambda _prompt: answer
        )
        return code, out.getvalue(), capsys.readouterr().err

    return invoke


@pytest.fixture
def many(pg_dsn: str, schema: str) -> Iterator[LeaseStore]:
    """1,005 keys (``key-0000`` .. ``key-1004``), each acquired once by a task of a run (its run columns
    written as an acquire writes them); the last one is the one we look up."""
    store = LeaseStore(pg_dsn, schema=schema, record_events=False)
    store.ensure_schema()
    execute(
        pg_dsn,
        q(
            "INSERT INTO {schema}.lease (key, owner, token, ttl, acquired_at, renewed_at, expires_at,"
            " dag_id, run_id, task_id, map_index) "
            "SELECT 'key-' || lpad(i::text, 4, '0'), 'dag_' || mod(i, 7) || '/run_' || i || '/t', 1, "
            "interval '10 minutes', clock_timestamp(), clock_timestamp(), clock_timestamp() + interval '10 minutes', "
            "'dag_' || mod(i, 7), 'run_' || i, 't', -1 "
            "FROM generate_series(0, %s) AS i",
            schema,
        ),
        (KEYS - 1,),
    )
    yield store
    store.close()


# -- item 5: any size ---------------------------------------------------------------------------------


def test_status_and_release_find_a_key_past_the_first_thousand(run: Run, many: LeaseStore) -> None:
    last = f"key-{KEYS - 1:04d}"
    code, out, err = run("status", "--key", last, "--json")
    assert code == 0, err
    (row,) = json.loads(out)["leases"]
    assert row["key"] == last and row["held"] and row["token"] == 1

    everything = json.loads(run("status", "--json")[1])["leases"]
    assert len(everything) == KEYS
    assert [r["key"] for r in everything] == sorted(r["key"] for r in everything)

    code, out, err = run("release", "--force", last, "--by", "ops", "--yes", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["previous"]["token"] == 1 and result["new_token"] == 2
    after = many.lease(last)
    assert after is not None and not after.held and after.token == 2


def test_release_with_a_stale_expected_token_releases_nothing(run: Run, many: LeaseStore) -> None:
    key = f"key-{KEYS - 2:04d}"
    code, _, err = run("release", "--force", key, "--expected-token", "7", "--yes")
    assert code == cli.EXIT_ERROR
    assert "token 1, not 7" in err and "nothing released" in err
    current = many.lease(key)
    assert current is not None and current.held and current.token == 1
    assert run("release", "--force", key, "--expected-token", "1", "--yes")[0] == 0
    current = many.lease(key)
    assert current is not None and not current.held and current.token == 2


def test_confirmed_release_does_not_free_a_lease_that_changed_meanwhile(
    run: Run, store: LeaseStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the operator confirmed (token N) is what is released: compared and released in one statement."""
    first = store.acquire("job", "dag/run_1/t", timedelta(minutes=5))
    assert first is not None
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)

    def answer_after_a_reacquire(_prompt: str) -> str:
        assert store.acquire("job", "dag/run_1/t", timedelta(minutes=5)) is not None  # token bumps
        return "job"

    out = io.StringIO()
    code = cli.main(
        ["--dsn", store.db.dsn, "--schema", store.schema, "release", "--force", "job"],
        out=out,
        confirm=answer_after_a_reacquire,
    )
    assert code == cli.EXIT_ERROR
    holder = store.holder("job")
    assert holder is not None and holder.token == first.token + 1
    assert store.events.query(key="job", kind=EventKind.FORCE_RELEASED) == []


def test_core_force_release_compares_in_sql(store: LeaseStore) -> None:
    from airflow_lease_provider.core.lease import LeaseChanged

    assert store.force_release("never", by="ops", expected_token=1) is None
    lease = store.acquire("k", "dag/run/t", timedelta(minutes=5))
    assert lease is not None
    with pytest.raises(LeaseChanged) as caught:
        store.force_release("k", by="ops", expected_token=lease.token + 1)
    assert caught.value.current.token == lease.token
    assert store.events.query(key="k", kind=EventKind.FORCE_RELEASED) == []
    previous = store.force_release("k", by="ops", expected_token=lease.token)
    assert previous is not None and previous.token == lease.token
    row = store.lease("k")
    assert row is not None and row.token == lease.token + 1 and not row.held
    assert store.lease("nope") is None


def test_concurrent_force_releases_with_one_expected_token_free_it_once(pg_dsn: str, schema: str) -> None:
    """Eight admins who all saw token N: exactly one releases, the others find it changed (one statement,
    compared under the row lock; a read-then-write would let several through, each bumping the token)."""
    import threading

    from airflow_lease_provider.core.lease import LeaseChanged

    setup = LeaseStore(pg_dsn, schema=schema)
    lease = setup.acquire("contended", "dag/run/t", timedelta(minutes=5))
    assert lease is not None
    stores = [LeaseStore(pg_dsn, schema=schema) for _ in range(8)]
    outcomes: list[str] = []
    start = threading.Barrier(len(stores))

    def admin(store: LeaseStore) -> None:
        start.wait()
        try:
            store.force_release("contended", by="ops", expected_token=lease.token)
            outcomes.append("released")
        except LeaseChanged:
            outcomes.append("changed")

    threads = [threading.Thread(target=admin, args=(s,)) for s in stores]
    try:
        for s in stores:
            s.ensure_schema()  # connect before the race
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert sorted(outcomes) == ["changed"] * 7 + ["released"]
        after = setup.lease("contended")
        assert after is not None and after.token == lease.token + 1
        assert len(setup.events.query(key="contended", kind=EventKind.FORCE_RELEASED)) == 1
    finally:
        for s in [*stores, setup]:
            s.close()


def test_lease_pages_are_keyset_paginated(many: LeaseStore) -> None:
    seen: list[str] = []
    after = None
    while True:
        page = many.leases(400, after=after)
        seen += [lease.key for lease in page]
        if len(page) < 400:
            break
        after = page[-1].key
    assert len(seen) == KEYS == len(set(seen))
    only = many.leases(1000, dag_ids={"dag_3"})
    assert only and all(lease.owner.startswith("dag_3/") for lease in only)
    assert len(only) == len([i for i in range(KEYS) if i % 7 == 3])
    assert many.leases(10, dag_ids=set()) == []


# -- item 6: bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["events", "--since", "999999999w"], "--since"),
        (["events", "--until", "99999999999999999999d"], "--until"),
        (["events", "--since", "yesterday"], "--since"),
        (["events", "--since", "3651d"], "--since"),
        (["advise-ttl", "--days", "nan"], "--days"),
        (["advise-ttl", "--days", "1e12"], "--days"),
        (["advise-ttl", "--days", "inf"], "--days"),
        (["advise-ttl", "--days", "-1"], "--days"),
        (["advise-ttl", "--days", "0"], "--days"),
        (["events", "--limit", "0"], "--limit"),
        (["events", "--limit", "1e3"], "--limit"),
        (["events", "--limit", "99999999999999999999"], "--limit"),
        (["events", "--kind", "nope"], "--kind"),
        (["events", "--key", "x" * 600], "--key"),
        (["status", "--key", "   "], "--key"),
        (["release", "--force", "k", "--expected-token", "0"], "--expected-token"),
        (["release", "--force", "k", "--expected-token", str(2**63)], "--expected-token"),
        (["release", "--force", "k", "--expected-token", "abc"], "--expected-token"),
        (["release", "--force", "k", "--reason", "r" * 600], "--reason"),
        (["release", "--force", "k", "--by", ""], "--by"),
        (["release", "--force", "x" * 600], "key"),
        (["--schema", "Bad-Schema", "status"], "--schema"),
        (["--schema", "pg_catalog", "status"], "--schema"),
        (["status", "--nope"], "--nope"),
    ],
)
def test_bad_input_is_one_line_naming_the_option_and_exit_2(
    run: Run, store: LeaseStore, args: list[str], option: str
) -> None:
    store.ensure_schema()
    code, out, err = run(*args)
    assert code == cli.EXIT_USAGE, err
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert option in err and "Traceback" not in err


def test_the_errors_docs_cli_md_shows(run: Run) -> None:
    assert run("advise-ttl", "--days", "nan")[2] == (
        "airflow-lease: error: argument --days: 'nan': must be a number of days, more than 0 and at most 3650\n"
    )
    assert run("events", "--since", "999999999w")[2] == (
        "airflow-lease: error: argument --since: '999999999w' is too far back: at most 3650d\n"
    )


_OPTIONS = {
    "status": [["--key"], ["--held"]],
    "events": [["--key"], ["--kind"], ["--since"], ["--until"], ["--limit"]],
    "counts": [],
    "advise-ttl": [["--key"], ["--days"], ["--check"]],
    "release": [["--reason"], ["--by"], ["--expected-token"]],
}
_FLAGS = {"--held", "--check"}
_text = st.one_of(
    st.text(min_size=0, max_size=40),
    st.from_regex(r"-?[0-9]{1,25}(\.[0-9]{0,5})?(e[0-9]{1,4})?[smhdw]?", fullmatch=True),
    st.sampled_from(["nan", "inf", "-inf", "1e308", "0", "-0", "2026-02-30", "9999-12-31T23:59:59+14:00"]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_options_never_crash(run: Run, store: LeaseStore, data: st.DataObject) -> None:
    """Any value of any option: exit 0, 1 or 2; an error is one line; never a traceback."""
    store.ensure_schema()
    command = data.draw(st.sampled_from(sorted(_OPTIONS)))
    args = [command]
    if command == "release":
        args += ["--force", data.draw(_text), "--yes"]
    for (option,) in data.draw(st.lists(st.sampled_from(_OPTIONS[command]), unique_by=tuple, max_size=3)) if _OPTIONS[command] else []:
        args += [option] if option in _FLAGS else [option, data.draw(_text)]
    if any("\x00" in a for a in args):
        args = [a.replace("\x00", "") for a in args]  # a real argv cannot carry NUL
    code, _, err = run(*args)
    assert code in (0, 1, 2), (args, code, err)
    assert "Traceback" not in err
    if code != 0:
        assert len(err.strip().splitlines()) == 1, (args, err)
    if code == 1:
        # Only the store's answers are exit 1 here: an unknown key, a release of a key never acquired.
        assert re.search(r"no (held )?lease|nothing released", err), (args, err)


# -- item 7: no secret in any message -------------------------------------------------------------


def _fragments(password: str) -> set[str]:
    return {p for p in re.split(r"[/@:?]", password) if len(p) >= 2}


@pytest.mark.parametrize("password", PASSWORDS)
@pytest.mark.parametrize("encode", [False, True])
def test_a_password_never_shows_when_the_dsn_fails(run: Run, password: str, encode: bool) -> None:
    secret = quote(password, safe="") if encode else password
    # Port 9: nothing listens, so the connection fails (or the URI does not even parse).
    dsn = f"postgresql://lease_user:{secret}@127.0.0.1:9/leases"
    code, out, err = run("status", dsn=dsn)
    assert code in (cli.EXIT_ERROR, cli.EXIT_USAGE), err
    assert len(err.strip().splitlines()) == 1, err
    for shown in (out, err):
        assert password not in shown and secret not in shown
        for fragment in _fragments(password):
            assert fragment not in shown, (fragment, shown)
    if encode:
        assert "unreachable" in err and "lease_user@127.0.0.1:9/leases" in err


@pytest.mark.parametrize("password", PASSWORDS)
def test_describe_dsn_never_prints_the_password(password: str) -> None:
    for dsn in (
        f"postgresql://lease_user:{password}@db.example:6543/leases",
        f"postgresql://lease_user:{quote(password, safe='')}@db.example:6543/leases",
        f"host=db.example port=6543 user=lease_user dbname=leases password='{password}'",
    ):
        where = describe_dsn(dsn)
        assert where == "lease_user@db.example:6543/leases", (dsn, where)
        assert password not in where


def test_console_script_with_a_bad_dsn_prints_no_password() -> None:
    password = PASSWORDS[0]
    result = subprocess.run(
        [str(VENV_BIN / "airflow-lease"), "--dsn", f"postgresql://u:{password}@127.0.0.1:9/db", "counts"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode in (1, 2)
    assert "Traceback" not in result.stderr
    for fragment in {password} | _fragments(password):
        assert fragment not in result.stdout + result.stderr, result.stderr


#: Issue 23: the three forms that still showed part of the password (in the message, in the cause chain
#: a task's logged traceback prints, or in ``airflow-lease --dsn`` output).
THREE_FORMS = {
    "URI with its scheme mistyped": "postgresql//lease_user:{pw}@127.0.0.1:9/leases",
    "unencoded / in the password": "postgresql://lease_user:Wq4z/{pw}@127.0.0.1:9/leases",
    "unencoded % in the password": "postgresql://lease_user:{pw}%Zt6h@127.0.0.1:9/leases",
}
FORM_PASSWORD = "Hk8vRy3mTq"


def _form_pieces(dsn: str) -> set[str]:
    """The password as written in ``dsn`` (between the user's ':' and the '@') and each of its pieces."""
    written = dsn.split("lease_user:", 1)[1].rsplit("@", 1)[0]
    return {written, FORM_PASSWORD} | {p for p in re.split(r"[/@:?%]", written) if len(p) >= 3}


def _chain_text(exc: BaseException) -> str:
    """Everything the exception and every exception it links to say (__cause__ and __context__ both)."""
    import traceback

    texts, todo, seen = [], [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        texts += [str(e), repr(e), repr(getattr(e, "args", ())), repr(vars(e)) if hasattr(e, "__dict__") else ""]
        todo += [e.__cause__, e.__context__]
    return "\n".join(texts + traceback.format_exception(exc))


@pytest.mark.parametrize("form", sorted(THREE_FORMS))
def test_the_three_dsn_forms_show_no_piece_of_the_password_anywhere(form: str) -> None:
    dsn = THREE_FORMS[form].format(pw=FORM_PASSWORD)
    store = LeaseStore(dsn)
    with pytest.raises(Exception) as caught:  # noqa: PT011 - the kind is checked below
        store.ensure_schema()
    assert isinstance(caught.value, (InvalidArgument, LeaseStoreUnavailable)), caught.value
    text = _chain_text(caught.value)
    for piece in _form_pieces(dsn):
        assert piece not in text, (piece, text)
    assert "does not parse" in str(caught.value)  # what it says: the string, not the password
    # The console script: its output, and its --json output.
    for extra in ((), ("--json",)):
        result = subprocess.run(
            [str(VENV_BIN / "airflow-lease"), "--dsn", dsn, "status", *extra],
            capture_output=True, text=True, timeout=120, check=False,
        )
        assert result.returncode == cli.EXIT_USAGE, result.stderr
        assert "Traceback" not in result.stderr
        for piece in _form_pieces(dsn):
            assert piece not in result.stdout + result.stderr, (piece, result.stderr)


@pytest.mark.parametrize(
    "args",
    [
        # A mistyped option: argparse quotes it and its value back before --dsn's type ever ran.
        ("status", "--dns", "postgresql://u:{password}@127.0.0.1:9/db"),
        # The DSN given without --dsn at all.
        ("status", "postgresql://u:{password}@127.0.0.1:9/db"),
        # An abbreviation two options share: "ambiguous option: --d=... could match --dsn, --days".
        ("advise-ttl", "--d=postgresql://u:{password}@127.0.0.1:9/db"),
        ("status", "host=127.0.0.1 port=9 password='{password}'"),
    ],
)
@pytest.mark.parametrize("password", PASSWORDS[:2])
def test_a_usage_error_never_quotes_a_password_back(args: tuple[str, ...], password: str) -> None:
    argv = [arg.format(password=password) for arg in args]
    result = subprocess.run(
        [str(VENV_BIN / "airflow-lease"), *argv], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == cli.EXIT_USAGE, result.stderr
    assert result.stderr.startswith("airflow-lease: error: "), result.stderr
    for fragment in {password} | _fragments(password):
        assert fragment not in result.stdout + result.stderr, result.stderr


# -- item 8: readers never create a store --------------------------------------------------------------


def _schema_exists(dsn: str, name: str) -> bool:
    return bool(execute(dsn, "SELECT 1 FROM pg_namespace WHERE nspname = %s", (name,)))


@pytest.mark.parametrize(
    "args",
    [["status"], ["status", "--key", "k"], ["events"], ["counts"], ["advise-ttl"], ["release", "--force", "k", "--yes"]],
)
def test_a_mistyped_schema_says_no_store_there_and_creates_none(
    pg_dsn: str, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    typo = new_schema_name()
    code = cli.main(["--dsn", pg_dsn, "--schema", typo, *args], out=io.StringIO())
    err = capsys.readouterr().err
    assert code == cli.EXIT_ERROR
    assert "no lease store in schema" in err and "nothing was created" in err
    assert not _schema_exists(pg_dsn, typo)


def test_connection_settings_in_the_dsn_are_honoured(pg_dsn: str, schema: str) -> None:
    sep = "&" if "?" in pg_dsn else "?"
    store = LeaseStore(
        f"{pg_dsn}{sep}application_name=lease-ops&connect_timeout=3&keepalives_idle=42", schema=schema
    )
    try:
        store.ensure_schema()
        rows = execute(pg_dsn, "SELECT application_name FROM pg_stat_activity WHERE application_name = 'lease-ops'")
        assert rows == [("lease-ops",)]
        conn = store.db._connection()
        params = conn.get_dsn_parameters()
        assert params["connect_timeout"] == "3" and params["keepalives_idle"] == "42"
    finally:
        store.close()


@pytest.mark.parametrize(
    ("setting", "problem"),
    [
        ("connect_timeout=0", "connect_timeout"),
        ("keepalives_count=-1", "keepalives_count"),
        # '²'.isdigit() is true: int('²') was a ValueError naming no setting ("failed: ValueError", exit 1).
        ("keepalives_idle=%C2%B2", "keepalives_idle"),
    ],
)
def test_connection_settings_that_defeat_failing_closed_are_refused(
    run: Run, pg_dsn: str, setting: str, problem: str
) -> None:
    sep = "&" if "?" in pg_dsn else "?"
    code, _, err = run("status", dsn=f"{pg_dsn}{sep}{setting}")
    assert code == cli.EXIT_USAGE
    assert problem in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "conn",
    [
        # A URI Airflow itself cannot read: the unencoded / ends its authority, so a piece of the
        # password becomes the "port".
        f"postgresql://lease_user:{PASSWORDS[0]}@127.0.0.1:9/leases",
        # A JSON connection: the hook builds the DSN (quoted); nothing listens on port 9.
        json.dumps(
            {"conn_type": "postgres", "host": "127.0.0.1", "port": 9, "login": "lease_user",
             "password": PASSWORDS[2], "schema": "leases"}
        ),
    ],
)
def test_the_hook_never_shows_the_password_of_its_connection(conn: str, tmp_path: Path) -> None:
    """Through LeaseHook (``--conn-id``): Airflow's connection lookup, the DSN it builds, the store."""
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("AIRFLOW")}
    env.update(AIRFLOW_HOME=str(tmp_path), AIRFLOW_CONN_BAD_LEASES=conn, AIRFLOW__CORE__LOAD_EXAMPLES="False")
    result = subprocess.run(
        [str(VENV_BIN / "airflow-lease"), "--conn-id", "bad_leases", "status"],
        capture_output=True, text=True, timeout=300, check=False, env=env,
    )
    assert result.returncode in (1, 2), result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("airflow-lease:")]
    assert len(errors) == 1, result.stderr[-2000:]
    if conn.startswith("postgresql://"):
        assert "'bad_leases' is set (AIRFLOW_CONN_BAD_LEASES) but Airflow could not read it" in errors[0]
    else:
        assert "unreachable" in errors[0] and "lease_user@127.0.0.1:9/leases" in errors[0]
    for password in PASSWORDS:
        for piece in {password, quote(password, safe="")} | _fragments(password):
            assert piece not in result.stdout + result.stderr, (piece, result.stderr[-2000:])


# -- Ctrl-C and Ctrl-D at the force-release prompt, on a real terminal --------------------------------


def _reading_the_terminal(pid: int) -> bool:
    """Whether ``pid`` is blocked reading its terminal (the kernel's n_tty_read waits in ``wait_woken``).

    A person types ^C at a prompt they see, while the program waits for a line. Typed the instant the
    prompt is written, before the program is in its read, CPython's handler only sets a flag and the
    read then blocks with the KeyboardInterrupt pending: a race of the test's own making (it was red once
    in a loaded run), not what a user can do, so the keys wait for the read."""
    try:
        with open(f"/proc/{pid}/wchan") as wchan:
            return wchan.read().strip() in _TERMINAL_WAITS
    except OSError:
        return True  # no /proc: send as before


#: Where the kernel shows a process blocked on its terminal: n_tty_read (a plain read, as ``input()``
#: without readline), or select/poll (``input()`` with readline loaded).
_TERMINAL_WAITS = {"wait_woken", "n_tty_read", "do_select", "poll_schedule_timeout", "do_sys_poll"}
#: Seconds after the prompt showed to type anyway, where the kernel names the wait otherwise (or hides it).
_READ_GRACE = 3.0


def _on_a_terminal(argv: list[str], keys: bytes, *, prompt: bytes, timeout: float = 60.0) -> tuple[int, str]:
    """Run ``argv`` on a pseudo-terminal, type ``keys`` once ``prompt`` shows: (exit status, all output)."""
    import os
    import pty
    import select
    import signal
    import time

    pid, fd = pty.fork()
    if pid == 0:  # the child: the console script, its stdin, stdout and stderr the terminal
        try:
            # As a shell starts a command: an ignored SIGINT (pytest-xdist's workers ignore it) would be
            # inherited through exec, and ^C would then do nothing.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execv(argv[0], argv)
        finally:
            os._exit(127)
    output, sent, end = b"", False, time.monotonic() + timeout
    prompted = 0.0  # when the prompt first showed
    try:
        while time.monotonic() < end:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(fd, 4096)
                except OSError:  # the child closed the terminal: it exited
                    break
                if not chunk:
                    break
                output += chunk
            if not sent and prompt in output:
                prompted = prompted or time.monotonic()
                if _reading_the_terminal(pid) or time.monotonic() - prompted > _READ_GRACE:
                    os.write(fd, keys)  # the terminal turns ^C into SIGINT, ^D into end of input
                    sent = True
        else:
            os.kill(pid, 9)
            raise AssertionError(f"no exit within {timeout} s; output so far: {output!r}")
    finally:
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), output.decode(errors="replace")


@pytest.mark.parametrize("keys", [b"\x03", b"\x04"], ids=["ctrl-c", "ctrl-d"])
def test_ctrl_c_or_ctrl_d_at_the_confirmation_prompt_releases_nothing_and_prints_no_traceback(
    store: LeaseStore, keys: bytes
) -> None:
    held = store.acquire("job", "dag/run_1/t", timedelta(minutes=5))
    assert held is not None
    code, output = _on_a_terminal(
        [str(VENV_BIN / "airflow-lease"), "--dsn", store.db.dsn, "--schema", store.schema, "release", "--force", "job"],
        keys,
        prompt=b"Type the key to confirm: ",
    )
    assert "Traceback" not in output, output
    assert code == cli.EXIT_NOT_CONFIRMED, output
    assert "not confirmed; nothing released" in output
    holder = store.holder("job")
    assert holder is not None and holder.token == held.token and holder.owner == held.owner
    assert store.events.query(key="job", kind=EventKind.FORCE_RELEASED) == []
