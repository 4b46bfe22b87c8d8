"""The hot-key cell again with a C client: ``pgbench``, so the SQL is measured without Python clients.

On a 2-core machine 64 Python client processes take most of the CPU the server needs, so the
store arms measure library + client + server together. Here the same statements run from pgbench
(two threads) on a held key: the statement as the library sends it (simple protocol), the same with the
SET LOCAL prefix the library sends in the same query, prepared, version 6's acquire for a before/after
pair, and version 8's, simple and prepared (its function still has the SET search_path clause that
migration 0009 removed), for the pair that measures that clause. ShedLock runs on JDBC, which switches to
server-prepared statements after five executions, so its prepared form is the fair one.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from airflow_lease_provider.core.db import Database, named_queries
from bench import arms, sqltext
from bench.figures import spread
from bench.server import Server

HOLDER_TTL = "interval '60 seconds'"


def _one_line(statement: str) -> str:
    """A statement as one pgbench script line (pgbench ends a command at the end of a line)."""
    lines = [ln for ln in statement.splitlines() if not ln.strip().startswith("--")]
    return " ".join(" ".join(lines).split()).rstrip(";") + ";\n"


LEASE_SIMPLE = "lease acquire SQL, simple protocol (the statement the library sent as text before it prepared it)"
LEASE_WITH_PREFIX = "lease acquire SQL with its SET LOCAL prefix, simple protocol (the whole query of a connection's first call)"
LEASE_SENT = (
    "lease acquire as the library sends it from a connection's second call on: the SET LOCAL prefix and "
    "EXECUTE of the statement it prepared, simple protocol"
)
HOLDER_FLOOR = "floor: a bare SELECT of the holder's row (what acquire returns on a held key), prepared"
LEASE_PREPARED = "lease acquire SQL, prepared"
LEASE_BEFORE = "lease acquire SQL of version 6 (before), simple protocol"
LEASE_V8_SIMPLE = "lease acquire SQL of version 8 (with SET search_path), simple protocol"
LEASE_V8_PREPARED = "lease acquire SQL of version 8 (with SET search_path), prepared"
SHEDLOCK_UPSERT = "ShedLock upsert, prepared (as JDBC sends it)"
SHEDLOCK_UPDATE = "ShedLock UPDATE, prepared"


def _scripts(server: Server, dsn: str, schema: str) -> dict[str, tuple[str, str]]:
    """(protocol, script text) per arm, with the schema quoted and the values written in as literals."""
    values = {"key": "'hot'", "owner": "'w1'", "ttl": HOLDER_TTL, "name": "'hot'", "by": "'w1'", "secs": "60",
              # acquire's run columns (migrations/0011): a holder that names no run.
              "dag_id": "NULL", "run_id": "NULL", "task_id": "NULL", "map_index": "NULL"}

    def render(text: str) -> str:
        rendered = sqltext.compose(text, schema).as_string(server.conn)
        return re.sub(r"%\((\w+)\)s", lambda m: values[m.group(1)], rendered)

    lease = _one_line(render(named_queries()["acquire"]))
    store = Database(dsn, schema=schema)
    prepared = store._statement("acquire", True, server.conn).prepared
    assert prepared is not None  # acquire is a [prepared] query

    def compound(text: str) -> str:  # statements joined into one pgbench command (one round trip)
        text = re.sub(r"%\((\w+)\)s", lambda m: values[m.group(1)], text)  # the schema is in already
        return " \\; ".join(" ".join(part.split()) for part in text.split(";") if part.strip())

    # Each client prepares on its first transaction (which is an attempt too) and executes after it, as
    # the library does on one connection: pgbench keeps a client's variables from one script run to the
    # next, and every client starts with prepared = 0 (-D).
    sent = (
        "\\if :prepared\n" + compound(prepared.execute) + ";\n\\else\n" + compound(prepared.prepare)
        + ";\n\\set prepared 1\n\\endif\n"
    )
    floor = _one_line(render(sqltext.HOLDER_ROW_FLOOR))
    before = _one_line(render(sqltext.BEFORE_ACQUIRE_CALL))
    v8 = _one_line(render(sqltext.V8_ACQUIRE_CALL))
    upsert = _one_line(render(sqltext.SHEDLOCK_UPSERT))
    update = _one_line(render(sqltext.SHEDLOCK_UPDATE))
    # The library's SET LOCAL prefix and the call as one simple-protocol query (pgbench's \; joins them).
    settings = [part.strip() for part in store._prefix(True).split(";") if part.strip()]
    with_prefix = " \\; ".join([*settings, lease.rstrip().rstrip(";")]) + ";\n"
    return {
        LEASE_SIMPLE: ("simple", lease),
        LEASE_WITH_PREFIX: ("simple", with_prefix),
        LEASE_PREPARED: ("prepared", lease),
        LEASE_SENT: ("simple", sent),
        HOLDER_FLOOR: ("prepared", floor),
        LEASE_BEFORE: ("simple", before),
        LEASE_V8_SIMPLE: ("simple", v8),
        LEASE_V8_PREPARED: ("prepared", v8),
        SHEDLOCK_UPSERT: ("prepared", upsert),
        SHEDLOCK_UPDATE: ("prepared", update),
    }


def find_pgbench(server: Server) -> str | None:
    major = server.version_num // 10000
    for candidate in (f"/usr/lib/postgresql/{major}/bin/pgbench", shutil.which("pgbench")):
        if candidate and Path(candidate).exists():
            out = subprocess.run([candidate, "--version"], capture_output=True, text=True, check=False).stdout
            found = re.search(r"(\d+)", out)
            if found and int(found.group(1)) == major:
                return candidate
    return None


def _run_one(
    pgbench: str, dsn: str, clients: int, seconds: float, protocol: str, script: Path
) -> dict[str, Any]:
    cmd = [
        pgbench,
        "-n",
        "-c",
        str(clients),
        "-j",
        "2",
        "-T",
        str(max(1, round(seconds))),
        "-M",
        protocol,
        "-D",
        "prepared=0",
        "-f",
        str(script),
        dsn,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120, check=False)
    tps = re.search(r"^tps = ([\d.]+)", proc.stdout, re.MULTILINE)
    latency = re.search(r"latency average = ([\d.]+) ms", proc.stdout)
    failed = re.search(r"number of failed transactions: (\d+)", proc.stdout)
    if tps is None:
        return {"error": (proc.stdout + proc.stderr)[-1500:]}
    return {
        "tps": float(tps.group(1)),
        "latency_avg_ms": float(latency.group(1)) if latency else None,
        "failed": int(failed.group(1)) if failed else 0,
    }


def run_pgbench(
    server: Server, dsn: str, schema: str, clients: int, seconds: float, repeats: int
) -> dict[str, Any]:
    """The four arms, interleaved, ``repeats`` times; tps and average latency per arm."""
    pgbench = find_pgbench(server)
    if pgbench is None:
        return {"status": f"not measured: no pgbench for PostgreSQL {server.version_num // 10000}"}
    server.reset(schema, ("lease", "event", "shedlock"))
    server.seed(schema, sqltext.SEED_HELD_LEASE, {"key": arms.HOT_KEY}, table="lease")
    server.seed(schema, sqltext.SEED_HELD_SHEDLOCK, {"key": arms.HOT_KEY})
    server.vacuum(schema, ("lease", "shedlock"))
    scripts = _scripts(server, dsn, schema)
    names = list(scripts)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    folder = Path(tempfile.mkdtemp(prefix="lease-bench-pgbench-"))
    try:
        paths = {}
        for i, name in enumerate(names):
            paths[name] = folder / f"arm{i}.sql"
            paths[name].write_text(scripts[name][1])
        for repeat in range(repeats):
            shift = repeat % len(names)
            for name in names[shift:] + names[:shift]:
                runs[name].append(_run_one(pgbench, dsn, clients, seconds, scripts[name][0], paths[name]))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    token = server.one(
        sqltext.compose("SELECT token FROM {schema}.lease WHERE key = %s", schema), (arms.HOT_KEY,)
    )
    out: dict[str, Any] = {
        "status": "measured",
        "pgbench": pgbench,
        "clients": clients,
        "threads": 2,
        "seconds": max(1, round(seconds)),
        "holder_token_after": token,  # still 1: no attempt took the held lease
        "arms": {},
    }
    for name in names:
        out["arms"][name] = {
            "tps": spread(r.get("tps") for r in runs[name]),
            "latency_avg_ms": spread(r.get("latency_avg_ms") for r in runs[name]),
            "runs": runs[name],
        }
    out["ratios"] = {
        f"{name} / {baseline}": spread(
            a["tps"] / b["tps"]
            for a, b in zip(runs[name], runs[baseline], strict=True)
            if "tps" in a and "tps" in b
        )
        for baseline in (SHEDLOCK_UPSERT, SHEDLOCK_UPDATE)
        for name in names
        if name not in (SHEDLOCK_UPSERT, SHEDLOCK_UPDATE) or (name == SHEDLOCK_UPDATE and baseline == SHEDLOCK_UPSERT)
    }
    return out
