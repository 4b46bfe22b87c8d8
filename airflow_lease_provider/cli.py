"""``airflow-lease``: the operator's command line for leases, events and TTL advice.

::

    airflow-lease status                      # every key: holder, token, expires in, last renewal
    airflow-lease events --kind skipped_overlap --since 24h
    airflow-lease counts                      # per key and kind: last 24 h / 7 days
    airflow-lease advise-ttl                  # TTL vs 1.5-2x the worst observed hold
    airflow-lease release --force daily-article --reason "worker host lost"
    airflow-lease failover --reason "restored from last night's dump"   # a new token epoch

The store is found like the hooks find it (``[lease] conn_id``, default ``lease_default``, or the
embedded PostgreSQL of a single-host Airflow); ``--dsn``/``--schema`` bypass Airflow's configuration
entirely (and Airflow is then not even imported). Tables by default, ``--json`` for scripts: the same
shapes as the Leases page's JSON endpoints (docs/ui.md).

Exit codes: 0 done, 1 the store failed or the key is unknown, 2 bad usage, 3 ``advise-ttl --check``
found a TTL to fix, 4 ``release`` was not confirmed. With ``--json`` an error is JSON on stdout too,
``{"error": {"kind": ..., "exit_code": ..., "message": ...}}``, beside its line on stderr.
"""

from __future__ import annotations

import argparse
import getpass
import json
import math
import os
import re
import socket
import sys
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any, NoReturn, TextIO

from airflow_lease_provider import reading
from airflow_lease_provider.core import (
    DEFAULT_SCHEMA,
    EventKind,
    InvalidArgument,
    Lease,
    LeaseError,
    LeaseStore,
    validation,
)
from airflow_lease_provider.core.db import describe_dsn, redact, remember_secrets
from airflow_lease_provider.core.lease import LeaseChanged
from airflow_lease_provider.core.schema import SchemaMissing
from airflow_lease_provider.ttl_advice import ttl_advice

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_ADVICE, EXIT_NOT_CONFIRMED = 0, 1, 2, 3, 4
#: Ctrl-C, as a shell reports a process ended by SIGINT.
EXIT_INTERRUPTED = 130
_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
#: The longest --since/--until look-back and --days window (the ledger keeps 30 days by default).
MAX_DAYS = 3650
#: The most events one call prints (the core's own limit).
MAX_LIMIT = 10_000
#: Cells longer than this are cut in tables (``--wide`` shows them whole; ``--json`` always does).
MAX_CELL = 64


# -- arguments --------------------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors: ``airflow-lease: error: argument --days: ...``, exit 2.

    The message never carries a password: a ``--dsn`` given on the command line is redacted from it.
    """

    def error(self, message: str) -> NoReturn:
        text = f"error: {redact(' '.join(message.split()))}"
        _json_error("usage", EXIT_USAGE, text)
        self.exit(EXIT_USAGE, f"airflow-lease: {text}\n")


def _usage_error(problem: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(problem)


def when(value: str) -> datetime:
    """``30m``, ``24h``, ``7d`` (that long ago) or an ISO timestamp (UTC unless it says otherwise)."""
    match = _RELATIVE.match(value.strip())
    if match:
        try:
            ago = timedelta(**{_UNITS[match[2]]: float(match[1])})
        except (OverflowError, ValueError):
            ago = timedelta.max
        if ago > timedelta(days=MAX_DAYS):
            raise _usage_error(f"{value!r} is too far back: at most {MAX_DAYS}d")
        return datetime.now(timezone.utc) - ago
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        raise _usage_error(f"{value!r}: use 30m, 24h, 7d or an ISO timestamp") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def _limit(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise _usage_error(f"{value!r}: must be a whole number from 1 to {MAX_LIMIT}") from None
    if not 1 <= number <= MAX_LIMIT:
        raise _usage_error(f"{value!r}: must be a whole number from 1 to {MAX_LIMIT}")
    return number


def _days(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise _usage_error(
            f"{value!r}: must be a number of days, more than 0 and at most {MAX_DAYS}"
        ) from None
    if not math.isfinite(number) or not 0 < number <= MAX_DAYS:
        raise _usage_error(f"{value!r}: must be a number of days, more than 0 and at most {MAX_DAYS}")
    return number


def _token(value: str) -> int:
    try:
        return validation.token("token", int(value))
    except (ValueError, InvalidArgument):
        raise _usage_error(f"{value!r}: must be a positive whole number (a fencing token)") from None


def _checked(check: Callable[[str, object], object]) -> Callable[[str], str]:
    """An argparse type from a core validator: the core's own rule, reported as a usage error."""

    def parse(value: str) -> str:
        try:
            check("value", value)
        except InvalidArgument as exc:
            raise _usage_error(f"{_shown(value)}: {exc.problem}") from None
        return value

    return parse


def _shown(value: str) -> str:
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _reason(value: str) -> str:
    if "\x00" in value or len(value) > validation.MAX_NAME_LENGTH:
        raise _usage_error(f"must be at most {validation.MAX_NAME_LENGTH} characters, without NUL")
    return value


def _schema(value: str) -> str:
    try:
        return validation.schema(value)
    except InvalidArgument as exc:
        raise _usage_error(f"{_shown(value)}: {exc.problem}") from None


def _dsn(value: str) -> str:
    # The value is never echoed: it may hold a password.
    if not value.strip() or "\x00" in value:
        raise _usage_error("must be a non-empty libpq connection string or postgresql:// URI")
    remember_secrets(value)
    return value


def _kind(value: str) -> str:
    kinds = [k.value for k in EventKind]
    if value not in kinds:
        raise _usage_error(f"{_shown(value)}: one of {', '.join(kinds)}")
    return value


def build_parser() -> argparse.ArgumentParser:
    # The store and output options work before or after the command (airflow-lease --json status, or
    # airflow-lease status --json): SUPPRESS keeps a subcommand from resetting what was given before it.
    def common(suppress: bool) -> Parser:
        default: Any = argparse.SUPPRESS if suppress else None
        parser = Parser(add_help=False)
        group = parser.add_argument_group("lease store")
        group.add_argument(
            "--conn-id",
            default=default,
            type=_checked(validation.name),
            help="Airflow connection of the store (default: [lease] conn_id, lease_default)",
        )
        group.add_argument(
            "--dsn",
            default=default,
            type=_dsn,
            help="a libpq DSN or postgresql:// URI; bypasses Airflow's configuration",
        )
        group.add_argument(
            "--schema",
            default=default,
            type=_schema,
            help=f"the store's PostgreSQL schema (default: [lease] schema, or {DEFAULT_SCHEMA})",
        )
        out = parser.add_argument_group("output")
        out.add_argument(
            "--json",
            action="store_true",
            default=argparse.SUPPRESS if suppress else False,
            help="print JSON (the Leases page's API shapes) instead of a table",
        )
        out.add_argument(
            "--wide",
            action="store_true",
            default=argparse.SUPPRESS if suppress else False,
            help="never cut long cells in tables",
        )
        return parser

    parser = Parser(
        prog="airflow-lease",
        parents=[common(False)],
        description="Leases, skips and TTL advice of the Airflow lease provider. Times are UTC.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub = [common(True)]

    status = commands.add_parser("status", parents=sub, help="current leases: holder, token, expires in")
    status.add_argument("--held", action="store_true", help="only keys held right now")
    status.add_argument(
        "--key", type=_checked(validation.name), help="only this key (one lookup, however many keys)"
    )

    events = commands.add_parser("events", parents=sub, help="recent events, newest first")
    events.add_argument(
        "--key",
        type=_checked(validation.name),
        help="only this key (for fence rejections: the fence resource)",
    )
    events.add_argument("--kind", type=_kind, help="only this kind, e.g. skipped_overlap")
    events.add_argument("--since", type=when, help="30m, 24h, 7d or an ISO timestamp")
    events.add_argument("--until", type=when, help="30m, 24h, 7d or an ISO timestamp")
    events.add_argument(
        "--limit", type=_limit, default=50, help=f"at most this many (default 50, at most {MAX_LIMIT})"
    )

    commands.add_parser("counts", parents=sub, help="per key and kind: events in the last 24 hours / 7 days")

    release = commands.add_parser(
        "release", parents=sub, help="force-release a lease (admin): frees it now and bumps its token"
    )
    release.add_argument("key", type=_checked(validation.name), help="the lease key")
    release.add_argument(
        "--force",
        action="store_true",
        help="required: a normal release belongs to the holder; this frees it for anyone",
    )
    release.add_argument("--reason", type=_reason, default="", help="why, for the event ledger")
    release.add_argument(
        "--by",
        type=_checked(validation.name),
        default=None,
        help="who, for the event ledger (default: user@host)",
    )
    release.add_argument(
        "--expected-token", type=_token, default=None, help="release only if the lease still has this token"
    )
    release.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation on a terminal")

    failover = commands.add_parser(
        "failover",
        parents=sub,
        help="start a new token epoch after a failover or restore the store cannot see (docs/core.md)",
    )
    failover.add_argument("--reason", type=_reason, default="", help="why, recorded with the epoch")
    failover.add_argument(
        "--show",
        action="store_true",
        help="only show the epoch (a store on a new timeline moves to its new epoch first, as an acquire would)",
    )
    failover.add_argument(
        "--above",
        type=_token,
        default=None,
        help="also make every token from now on larger than this one (the token a fence kept elsewhere "
        "accepted from this store before it was recreated: the fence's refusal names it; docs/deploy.md)",
    )

    advise = commands.add_parser("advise-ttl", parents=sub, help="TTL vs 1.5-2x the worst observed hold")
    advise.add_argument("--key", type=_checked(validation.name), help="only this key")
    advise.add_argument(
        "--days",
        type=_days,
        default=30.0,
        help=f"look at holds of the last N days (default 30, at most {MAX_DAYS})",
    )
    advise.add_argument(
        "--check",
        action="store_true",
        help=f"exit {EXIT_ADVICE} when a TTL is too short or far too long (for monitoring)",
    )
    return parser


# -- the store --------------------------------------------------------------------------------------


def open_store(args: argparse.Namespace) -> tuple[LeaseStore, str]:
    """The store and a description of where it is (never with a password).

    Read-only: the CLI never creates a store where there is none (a mistyped DSN or schema says
    "no lease store there"), even for ``release``.
    """
    if args.dsn:
        schema = args.schema or DEFAULT_SCHEMA
        store = LeaseStore(args.dsn, schema=schema, read_only=True)
        return store, f"{describe_dsn(args.dsn)} schema {schema}"
    # Only now is Airflow imported: its configuration names the connection and the schema.
    from airflow_lease_provider.hooks import LeaseHook

    hook = LeaseHook(args.conn_id, schema=args.schema, read_only=True)
    return hook.get_store(), hook.location.where


# -- tables -----------------------------------------------------------------------------------------


def _clip(text: str, wide: bool) -> str:
    text = " ".join(text.split())
    return text if wide or len(text) <= MAX_CELL else text[: MAX_CELL - 1] + "…"


# Control characters and the bidirectional overrides, shown escaped: keys, owners, reasons and names come
# from DAG code, a run's conf (a templated key) or the UI, and the terminal of the person reading a table
# must not obey them (an ESC sequence that recolours, retitles or clears it; a newline that forges a row;
# U+202E that shows a key reversed).
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _printable(text: str) -> str:
    return _UNPRINTABLE.sub(
        lambda m: repr(m.group())[1:-1] if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", text
    )


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], out: TextIO, *, wide: bool = False) -> None:
    """A plain aligned table; empty cells show as ``-``. The last column is never cut: it aligns nothing."""
    last = len(headers) - 1
    cells = [
        [
            _clip("-" if v is None or v == "" else _printable(str(v)), wide or i == last)
            for i, v in enumerate(row)
        ]
        for row in rows
    ]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()
    out.write(line + "\n")
    for row in cells:
        out.write("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() + "\n")


def _t(iso: str | None) -> str | None:
    return reading.short_time(iso).removesuffix(" UTC") if iso else None


def _d(seconds: float | None) -> str | None:
    return reading.format_duration(seconds) if seconds is not None else None


def _run(run: dict[str, Any] | None, fallback: str | None = None) -> str | None:
    if not run:
        return fallback
    suffix = f"[{run['map_index']}]" if run.get("map_index", -1) >= 0 else ""
    return f"{run['dag_id']}/{run['run_id']}{suffix}"


# -- commands ---------------------------------------------------------------------------------------


def cmd_status(store: LeaseStore, args: argparse.Namespace, out: TextIO) -> int:
    if args.key:
        row = reading.lease(store, args.key)
        if row is None or (args.held and not row["held"]):
            return _fail(
                f"no {'held ' if args.held else ''}lease {args.key!r} in the store", kind="not_found"
            )
        # A semaphore (lease_slots=N): the key's row (slot 1) and the row of every other slot held now.
        others = [r for r in reading.slot_rows(store, args.key) if r["key"] != row["key"]] if row["slots"] > 1 else []
        data: dict[str, Any] = {"observed_at": row["observed_at"], "leases": [row, *others]}
    else:
        data = {"observed_at": None, "leases": []}
        cursor = None
        while True:  # every key, a page at a time (keyset pagination: no page costs more than the first)
            page = reading.leases(store, held_only=args.held, cursor=cursor)
            data["leases"] += page["leases"]
            data["observed_at"] = page["observed_at"] or data["observed_at"]
            cursor = page["next_cursor"]
            if cursor is None:
                break
    if args.json:
        return _json(data, out)
    table(
        ["KEY", "STATE", "HOLDER", "TOKEN", "ACQUIRED", "EXPIRES IN", "LAST RENEWAL", "TTL", "WAITING"],
        [
            [
                r["key"],
                # A semaphore's slot (lease_slots=N): "held (slot 2 of 3)".
                ("held" if r["held"] else "free") + (f" ({r['slot_label']})" if r.get("slot_label") else ""),
                # The owner as written (docs/airflow.md, "Who holds a lease"): its task and map index
                # say which task of the run holds a key that two tasks share.
                r["owner"],
                r["token"],
                _t(r["acquired_at"]),
                _d(r["expires_in_seconds"]) if r["held"] else None,
                _t(r["renewed_at"]),
                _d(r["ttl_seconds"]),
                # The runs holding a waiting place (wait with max_waiting), oldest first.
                ", ".join(w["owner"] for w in r.get("waiting") or []) or None,
            ]
            for r in data["leases"]
        ],
        out,
        wide=args.wide,
    )
    return EXIT_OK


def cmd_events(store: LeaseStore, args: argparse.Namespace, out: TextIO) -> int:
    data = reading.events(
        store, key=args.key, kind=args.kind, since=args.since, until=args.until, limit=args.limit
    )
    if args.json:
        return _json(data, out)
    table(
        ["AT", "KIND", "KEY", "RUN", "TASK", "WHAT HAPPENED"],
        [
            [
                _t(e["at"]),
                e["kind"],
                e["key"],
                _run(e["run"], e["owner"]),
                (e["task"] or {}).get("task_id"),
                e["summary"],
            ]
            for e in data["events"]
        ],
        out,
        wide=args.wide,
    )
    return EXIT_OK


def cmd_counts(store: LeaseStore, args: argparse.Namespace, out: TextIO) -> int:
    data = reading.counts(store)
    if args.json:
        return _json(data, out)
    kinds = [k for k in data["kinds"] if any(k in row["kinds"] for row in data["counts"])]
    table(
        ["KEY", *[k.upper() for k in kinds]],
        [[row["key"], *[_pair(row["kinds"].get(k)) for k in kinds]] for row in data["counts"]],
        out,
        wide=args.wide,
    )
    out.write("(each cell: last 24 hours / last 7 days)\n")
    return EXIT_OK


def _range(low: float | None, high: float | None) -> str | None:
    if low is None or high is None:
        return None
    return _d(low) if low == high else f"{_d(low)}-{_d(high)}"


def _pair(counts: dict[str, int] | None) -> str:
    counts = counts or {"last_24h": 0, "last_7d": 0}
    return f"{counts['last_24h']} / {counts['last_7d']}"


def cmd_advise(store: LeaseStore, args: argparse.Namespace, out: TextIO) -> int:
    data = ttl_advice(store, window=timedelta(days=args.days), key=args.key)
    flagged = [a for a in data["advice"] if a["verdict"] in ("too_short", "too_long")]
    if args.json:
        _json(data, out)
    else:
        table(
            ["KEY", "VERDICT", "TTL", "WORST HOLD", "HOLDS", "RECOMMENDED", "WHY"],
            [
                [
                    a["key"],
                    a["verdict"],
                    _d(a["ttl_seconds"]),
                    _d(a["worst_hold_seconds"]),
                    a["holds"],
                    _range(a["recommended_min_seconds"], a["recommended_max_seconds"]),
                    a["message"],
                ]
                for a in data["advice"]
            ],
            out,
            wide=args.wide,
        )
    return EXIT_ADVICE if args.check and flagged else EXIT_OK


def _force_release(
    store: LeaseStore, key: str, current: Lease, expected: int | None, *, by: str, reason: str
) -> tuple[Lease, int] | None:
    """Force-release ``key``, its event naming the run whose lease it was (the owner read just before).

    Without an expected token whoever holds it now is released: when the lease changed since ``current``
    was read, the new one is read and released instead (so the run recorded is the one released).
    """
    for _ in range(3):
        try:
            return store.force_release_with_token(
                key,
                by=by,
                reason=reason,
                expected_token=current.token if expected is None else expected,
                run=current.run,
            )
        except LeaseChanged as exc:
            if expected is not None:
                raise
            current = exc.current
    return store.force_release_with_token(
        key, by=by, reason=reason
    )  # changing all the time: release it anyway


def cmd_release(
    store: LeaseStore, args: argparse.Namespace, out: TextIO, confirm: Callable[[str], str]
) -> int:
    if not args.force:
        return _fail(
            "release needs --force: a normal release belongs to the holder; a forced one frees the lease for "
            "anyone and bumps its token, so the holder can no longer renew it and its leased publishes are refused",
            EXIT_USAGE,
            kind="usage",
        )
    current = store.lease(args.key)
    if current is None:
        return _fail(f"no lease {args.key!r} in the store", kind="not_found")
    expected = args.expected_token
    if expected is not None and current.token != expected:
        return _fail(
            f"lease {args.key!r} has token {current.token}, not {expected}: nothing released", kind="changed"
        )
    if not args.yes and sys.stdin.isatty():
        state = (
            f"held by {current.owner} with token {current.token}" if current.held else "not held right now"
        )
        try:
            answer = confirm(f"Force-release {args.key!r} ({state})? Type the key to confirm: ")
        except (KeyboardInterrupt, EOFError):  # Ctrl-C or Ctrl-D at the prompt: nothing was sent
            answer = None
        if answer is None or answer.strip() != args.key:
            return _fail("not confirmed; nothing released", EXIT_NOT_CONFIRMED, kind="not_confirmed")
        # What was confirmed is what gets released: if the lease changed meanwhile, nothing is.
        expected = current.token
    by = args.by or f"{getpass.getuser()}@{socket.gethostname()} (airflow-lease)"
    reason = args.reason or "force-released with airflow-lease"
    try:
        done = _force_release(store, args.key, current, expected, by=by, reason=reason)
    except LeaseChanged as exc:
        return _fail(str(exc), kind="changed")
    if done is None:
        return _fail(f"no lease {args.key!r} in the store", kind="not_found")
    previous, new_token = done
    result = {
        "key": args.key,
        "by": by,
        "previous": reading.lease_row(previous),
        "new_token": new_token,
    }
    if args.json:
        return _json(result, out)
    was = f"held by {previous.owner}" if previous.held else f"not held (last holder {previous.owner})"
    out.write(
        f"force-released {args.key!r}: it was {was} with token {previous.token}; "
        f"the token is now {result['new_token']}. Recorded as by {by!r}.\n"
    )
    return EXIT_OK


def _epoch_row(epoch: Any) -> dict[str, Any]:
    return {
        "epoch": epoch.epoch,
        "tokens_above": epoch.floor,
        "system_identifier": str(epoch.system_identifier),
        "timeline": epoch.timeline,
        "changed_at": epoch.changed_at.isoformat(),
        "reason": epoch.reason,
    }


def cmd_failover(store: LeaseStore, args: argparse.Namespace, out: TextIO) -> int:
    if args.show:
        data = {"epoch": _epoch_row(store.token_epoch())}
    else:
        reason = args.reason or f"airflow-lease failover by {getpass.getuser()}@{socket.gethostname()}"
        # "previous" is read in the bump's transaction, under its row lock: two concurrent runs print
        # 0 -> 1 and 1 -> 2, not 0 -> 1 and 0 -> 2.
        before, after = store.bump_epoch_from(reason, above=args.above)
        data = {"previous": _epoch_row(before), "epoch": _epoch_row(after)}
    if args.json:
        return _json(data, out)
    now = data["epoch"]
    if "previous" in data:
        out.write(f"token epoch {data['previous']['epoch']} -> {now['epoch']}: ")
    else:
        out.write(f"token epoch {now['epoch']}: ")
    out.write(
        f"every token issued from now on is above {now['tokens_above']} (timeline {now['timeline']}, "
        f"since {_t(now['changed_at'])}: {now['reason']})\n"
    )
    return EXIT_OK


def _results_only_stdout() -> TextIO:
    """The real stdout for our output, with file descriptor 1 sent to stderr from now on.

    Airflow logs to stdout (a warning when it parses a connection with extras, for one), which would
    corrupt ``--json`` for scripts; with fd 1 on stderr every such line goes there instead.
    """
    sys.stdout.flush()
    results = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    return results


def _json(data: Any, out: TextIO) -> int:
    json.dump(data, out, indent=2, sort_keys=False, default=str)
    out.write("\n")
    return EXIT_OK


#: Where ``--json`` errors go (the results stream), or None without ``--json``; set by :func:`main`.
_json_errors: TextIO | None = None


def _json_error(kind: str, code: int, message: str, **details: Any) -> None:
    """An error as JSON on the results stream, when ``--json`` was asked for: scripts parse one stream.

    The shape is ``{"error": {"kind", "exit_code", "message", ...}}``; ``kind`` is one of ``usage``,
    ``not_found``, ``changed``, ``not_confirmed``, ``schema_missing``, ``store``, ``interrupted`` and
    ``failed``. The message is the stderr line's, redacted the same way.
    """
    if _json_errors is None:
        return
    error = {"kind": kind, "exit_code": code, "message": " ".join(redact(message).split()), **details}
    _json({"error": error}, _json_errors)
    _json_errors.flush()


def _fail(message: str, code: int = EXIT_ERROR, kind: str = "failed", **details: Any) -> int:
    text = " ".join(redact(message).split())
    print(f"airflow-lease: {text}", file=sys.stderr)
    _json_error(kind, code, text, **details)
    return code


def _option(parameter: str, args: argparse.Namespace) -> str:
    """Where a core parameter came from, for error messages: the option, or the connection that set it."""
    if not args.dsn and parameter in ("schema", "dsn"):
        from airflow_lease_provider import settings  # imports Airflow: only when Airflow names the store

        conn_id = args.conn_id or settings.conn_id()
        if parameter == "dsn":
            return f"connection {conn_id!r}"
        if not args.schema:
            return f"the schema (the extra lease_schema of connection {conn_id!r}, or [lease] schema)"
    return {"dsn": "--dsn", "schema": "--schema"}.get(parameter, parameter)


def _remember_argument_secrets(argv: Sequence[str]) -> None:
    """Remember the password of every argument that may be a connection string, before parsing.

    A usage error quotes arguments back (``unrecognized arguments: --dns postgresql://u:pw@h/db``, a
    DSN given without ``--dsn``, ``ambiguous option: --d=postgresql://...``), and argparse says so before
    ``--dsn``'s own type has seen the value; :meth:`Parser.error` redacts what is remembered here.
    """
    for arg in argv:
        candidates = [arg]
        if arg.startswith("-") and "=" in arg:
            candidates.append(arg.split("=", 1)[1])
        for candidate in candidates:
            if "\x00" not in candidate:
                remember_secrets(candidate)


def main(
    argv: Sequence[str] | None = None, *, out: TextIO | None = None, confirm: Callable[[str], str] = input
) -> int:
    global _json_errors
    argv = list(sys.argv[1:] if argv is None else argv)
    _remember_argument_secrets(argv)
    # A usage error is found before --json is parsed: an argument spelled --json (before any "--") asks.
    options = argv[: argv.index("--")] if "--" in argv else argv
    _json_errors = (out or sys.stdout) if "--json" in options else None
    try:
        return _main(argv, out, confirm)
    finally:
        _json_errors = None


def _main(argv: list[str], out: TextIO | None, confirm: Callable[[str], str]) -> int:
    global _json_errors
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # usage errors and --help: argparse has printed them; return its code
        return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_USAGE
    if out is None:
        out = sys.stdout if args.dsn else _results_only_stdout()
    _json_errors = out if args.json else None
    store = None
    where = None
    try:
        store, where = open_store(args)
        if args.command == "status":
            code = cmd_status(store, args, out)
        elif args.command == "events":
            code = cmd_events(store, args, out)
        elif args.command == "counts":
            code = cmd_counts(store, args, out)
        elif args.command == "advise-ttl":
            code = cmd_advise(store, args, out)
        elif args.command == "failover":
            code = cmd_failover(store, args, out)
        else:
            code = cmd_release(store, args, out, confirm)
    except InvalidArgument as exc:
        # A connection string or connection setting the store refused: usage, naming the option.
        return _fail(
            f"error: {_option(exc.parameter, args)}: {redact(exc.problem)}", EXIT_USAGE, kind="usage"
        )
    except SchemaMissing as exc:
        return _fail(redact(str(exc)), kind="schema_missing")
    except LeaseError as exc:
        message = redact(str(exc))
        return _fail(
            message if where is None or where in message else f"{message} (store: {where})",
            kind="store",
            type=type(exc).__name__,
        )
    except KeyboardInterrupt:
        # Ctrl-C while waiting on the store: no traceback. A statement already sent may still commit.
        return _fail("interrupted", EXIT_INTERRUPTED, kind="interrupted")
    except Exception as exc:  # never a traceback; never a password
        return _fail(
            f"failed: {type(exc).__name__}: {redact(' '.join(str(exc).split()))}", type=type(exc).__name__
        )
    finally:
        if store is not None:
            store.close()
        out.flush()
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
