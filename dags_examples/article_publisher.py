"""Article publisher: every 45 minutes, write an article and publish it, once, from the newest run only.

What each piece is for:

- ``CappedCatchupTimetable(timedelta(minutes=45), max_backfill=1)``: "every 45 minutes" is no cron;
  after downtime only the newest missed slot runs (stale articles are worthless), and the skipped
  slots are recorded once in the lease ledger and counted in ``scheduled.skipped_catchup``.
- ``@task.leased(lease_ttl=80 min)``: a run takes up to ~45 minutes at worst, so the TTL is about
  1.5-2x that; the lease renews every TTL/3 while the task runs. A run that starts while the previous
  one still writes is **skipped** (not failed), with the holder named in the reason.
- ``slot_idempotency_key("article_publisher", context)``: one key per slot (the data interval's start)
  for scheduled, backfilled and manual runs with a logical date; a manual run without a logical date
  (the Airflow 3 default from the UI, ``airflow dags trigger`` and the REST API) has no slot and is keyed
  by its run id.
- ``lease.fenced_transaction(...)``: the article row and the fence advance commit in one transaction,
  and the per-slot idempotency key means a slot is published at most once: a retry or a cleared re-run
  of a published slot writes nothing and ends **skipped** ("published already").
- ``lease.fence(...)`` + a git push carrying the token: the external side effect. The fence advances
  first; the repository's own pre-receive hook then refuses a push whose token is not larger than the
  last one it accepted (the resource-side gate), so a zombie that woke late cannot push either.

Connections: ``lease_default`` (the lease store; on a single host the embedded PostgreSQL is used when
it is not defined) and ``blog_db`` for the articles table (falls back to the lease store's database).
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pendulum
from airflow.providers.common.compat.sdk import AirflowSkipException  # Airflow 3.1-3.3 alike
from airflow.sdk import DAG, Param, task
from psycopg2 import sql

from airflow_lease_provider.core import DuplicatePublish
from airflow_lease_provider.timetables import CappedCatchupTimetable, slot_idempotency_key

log = logging.getLogger(__name__)

# The blog's database; without a blog_db connection the example writes next to the leases.
BLOG_CONN = "blog_db" if os.environ.get("AIRFLOW_CONN_BLOG_DB") else None
BLOG_SCHEMA = os.environ.get("LEASE_EXAMPLES_SCHEMA", "public")
ARTICLES = sql.Identifier(BLOG_SCHEMA, "example_articles")
BLOG_REPO = Path(os.environ.get("AIRFLOW_HOME", "/tmp")) / "example-blog.git"

# A pre-receive hook: the repository remembers the largest token it accepted and refuses smaller ones.
PRE_RECEIVE = """#!/bin/sh
# Resource-side fence for pushes: each pushed commit carries "token: N" in its message.
last=$(cat "$GIT_DIR/fence-token" 2>/dev/null || echo 0)
while read old new ref; do
  token=$(git log -1 --format=%B "$new" | sed -n 's/^token: //p')
  if [ -z "$token" ] || [ "$token" -le "$last" ]; then
    echo "fence: token '$token' is not larger than $last: push refused" >&2
    exit 1
  fi
  echo "$token" > "$GIT_DIR/fence-token"
done
"""


def ensure_blog_repo() -> Path:
    if not (BLOG_REPO / "HEAD").exists():
        subprocess.run(["git", "init", "--quiet", "--bare", "--initial-branch=main", str(BLOG_REPO)], check=True)
        hook = BLOG_REPO / "hooks" / "pre-receive"
        hook.write_text(PRE_RECEIVE)
        hook.chmod(0o755)
    return BLOG_REPO


def push_article(text: str, token: int) -> None:
    """Commit the article to a fresh clone and push it; the commit message carries the token."""
    repo = ensure_blog_repo()
    with tempfile.TemporaryDirectory() as work:
        git = ["git", "-C", work, "-c", "user.name=publisher", "-c", "user.email=publisher@example.invalid"]
        subprocess.run(["git", "clone", "--quiet", str(repo), work], check=True, capture_output=True)
        Path(work, "article.md").write_text(text)
        subprocess.run([*git, "add", "article.md"], check=True)
        subprocess.run([*git, "commit", "--quiet", "-m", f"article\n\ntoken: {token}"], check=True)
        subprocess.run([*git, "push", "--quiet", "origin", "HEAD:refs/heads/main"], check=True)


# [START article_publisher]
with DAG(
    dag_id="article_publisher",
    schedule=CappedCatchupTimetable(timedelta(minutes=45), max_backfill=1),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=True,  # with the cap: after downtime, only the newest missed slot runs
    max_active_runs=2,  # two runs may start; the lease decides which one writes
    params={"work_seconds": Param(1, type="integer", minimum=0, description="simulated writing time")},
    tags=["lease-example"],
):

    @task.leased(lease_key="article-publisher", lease_ttl=timedelta(minutes=80))
    def write_and_publish(lease=None, params=None, **context):
        time.sleep(params["work_seconds"])  # writing the article takes a while
        # The slot's key for scheduled, backfilled and manual runs with a logical date; a manual run
        # without one (the Airflow 3 default) has no slot and is keyed by its run id instead.
        slot = slot_idempotency_key("article_publisher", context)
        article = f"# Article for {slot}\n\nWritten under lease token {lease.token}.\n"

        # Exactly once into PostgreSQL: the row commits together with the fence advance. A retry or a
        # cleared re-run of a slot that was published already writes nothing (DuplicatePublish).
        try:
            with lease.fenced_transaction("blog.articles", conn_id=BLOG_CONN, idempotency_key=slot) as cur:
                cur.execute(
                    sql.SQL(
                        "CREATE TABLE IF NOT EXISTS {} "
                        "(slot text PRIMARY KEY, body text NOT NULL, token bigint NOT NULL)"
                    ).format(ARTICLES)
                )
                cur.execute(
                    sql.SQL("INSERT INTO {} (slot, body, token) VALUES (%s, %s, %s)").format(ARTICLES),
                    (slot, article, lease.token),
                )
        except DuplicatePublish:
            log.info("%s is in blog.articles already; not written again", slot)

        # An external side effect: advance the fence first (once per slot), then push carrying the token.
        try:
            lease.fence("blog.git", idempotency_key=slot)
        except DuplicatePublish:
            raise AirflowSkipException(f"{slot} was published already; nothing to do") from None
        push_article(article, lease.token)
        return {"slot": slot, "token": lease.token}

    write_and_publish()
# [END article_publisher]
