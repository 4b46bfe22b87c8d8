"""The store's SQL text: the named queries of ``sql/queries.sql``, the ``{schema}`` placeholder, and the
prepared-statement texts of the hot queries.

``{schema}`` is the one templating scheme of every SQL file of the package (``queries.sql``,
``schema.sql``, ``fence_schema.sql``, the migrations from 0011 on): :func:`with_schema` replaces it with
the schema's name as a quoted identifier. Values are always ``%(name)s`` parameters.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from functools import cache
from importlib import resources
from typing import Any

import psycopg2
import psycopg2.extensions
from psycopg2 import sql

from airflow_lease_provider.core.errors import InvalidArgument

_NAME_RE = re.compile(r"^-- name: (\w+)( \[prepared\])?\s*$", re.MULTILINE)
_PARAM_RE = re.compile(r"%\((\w+)\)s")
#: A connection sends a [prepared] query this many times as plain text before it prepares it: a
#: connection used for one operation (the Airflow hooks' default) never pays for a PREPARE.
PREPARE_AFTER = 2

#: The placeholder of the schema's name in every SQL file of the package.
SCHEMA_PLACEHOLDER = "{schema}"


def with_identifiers(statement: str, identifiers: Mapping[str, str | Sequence[str]] | None) -> Any:
    """A caller's own SQL with its ``{placeholder}`` names filled in as quoted identifiers (a name, or a
    tuple of parts such as ``("schema", "table")``); ``statement`` as it is when there are none."""
    if not identifiers:
        return statement
    names = {
        placeholder: sql.Identifier(*([name] if isinstance(name, str) else name))
        for placeholder, name in identifiers.items()
    }
    return sql.SQL(statement).format(**names)


def with_names_for(cursor: Any, statement: str, identifiers: Mapping[str, str | Sequence[str]] | None) -> Any:
    """:func:`with_identifiers` for a psycopg2 ``cursor``; for any other driver's (the DB-API fence's
    targets), the names quoted as standard SQL does (``"name"``, a ``"`` doubled; a list schema-qualified)."""
    if not identifiers or isinstance(cursor, psycopg2.extensions.cursor):
        return with_identifiers(statement, identifiers)
    names: dict[str, str] = {}
    for placeholder, name in identifiers.items():
        parts = [name] if isinstance(name, str) else list(name)
        if not parts or not all(isinstance(p, str) and p and "\x00" not in p for p in parts):
            raise InvalidArgument(f"identifiers[{placeholder!r}]", name, "must be a non-empty name or list of names")
        names[placeholder] = ".".join('"' + p.replace('"', '""') + '"' for p in parts)
    return statement.format(**names)


def with_schema(text: str, schema: str, conn: Any) -> str:
    """``text`` with every ``{schema}`` replaced by ``schema`` as a quoted identifier (quoted by the driver
    for ``conn``). Nothing else in the text is touched (a ``'{}'::jsonb`` stays as it is)."""
    return text.replace(SCHEMA_PLACEHOLDER, sql.Identifier(schema).as_string(conn))


@cache
def _parsed_queries() -> tuple[dict[str, str], frozenset[str]]:
    text = resources.files("airflow_lease_provider.core.sql").joinpath("queries.sql").read_text()
    parts = _NAME_RE.split(text)
    # parts = [preamble, name1, flag1, body1, name2, flag2, body2, ...]; a flag is " [prepared]" or None
    queries: dict[str, str] = {}
    prepared: set[str] = set()
    for i in range(1, len(parts), 3):
        queries[parts[i]] = parts[i + 2].strip()
        if parts[i + 1]:
            prepared.add(parts[i])
    return queries, frozenset(prepared)


def named_queries() -> dict[str, str]:
    """The ``-- name: x`` blocks of ``sql/queries.sql``, read once."""
    return _parsed_queries()[0]


def prepared_queries() -> frozenset[str]:
    """The names of the queries marked ``[prepared]``: one statement each, planned the same whatever
    its values (a function call or a primary-key lookup), sent many times on one connection."""
    return _parsed_queries()[1]


def _sql_body(text: str) -> str:
    """A query without its comment lines and trailing semicolon (what a PREPARE wraps)."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("--")]
    return "\n".join(lines).strip().rstrip(";").rstrip()


def stale_plan(exc: psycopg2.Error) -> bool:
    """"cached plan must not change result type": raised where PostgreSQL revalidates a prepared plan,
    before it runs. Told by where it comes from, not by its message (which the server's lc_messages
    translates)."""
    return exc.pgcode == "0A000" and getattr(exc.diag, "source_function", None) == "RevalidateCachedQuery"


class PreparedTexts:
    """The three texts of one prepared query: EXECUTE it, PREPARE then EXECUTE it, and replace a stale one.

    Each carries the same SET LOCAL prefix and the query's values as ``%(name)s`` parameters (so the
    driver quotes them exactly as for the plain text); in the PREPARE they are ``$1``, ``$2``, ...
    """

    __slots__ = ("name", "execute", "prepare", "replace")

    def __init__(self, prefix: str, source: str) -> None:
        body = _sql_body(source)
        order: list[str] = []

        def positional(match: re.Match[str]) -> str:
            if match.group(1) not in order:
                order.append(match.group(1))
            return f"${order.index(match.group(1)) + 1}"

        body = _PARAM_RE.sub(positional, body)
        # The name says which text it stands for: the same name is the same statement on any session.
        self.name = "airflow_lease_" + hashlib.sha256(body.encode()).hexdigest()[:32]
        args = "(" + ", ".join(f"%({n})s" for n in order) + ")" if order else ""
        execute = f"EXECUTE {self.name}{args}"
        prepare = f"PREPARE {self.name} AS {body}; {execute}"
        self.execute = prefix + execute
        self.prepare = prefix + prepare
        # After a migration changed what the statement returns, the old plan cannot be reused.
        self.replace = prefix + f"DEALLOCATE {self.name}; {prepare}"


class Statement:
    """One named query as sent: the prefix and the query as plain text, and for a ``[prepared]`` query its
    prepared texts; ``source`` is the query text it was built from."""

    __slots__ = ("source", "plain", "prepared")

    def __init__(self, prefix: str, source: str, *, prepared: bool) -> None:
        self.source = source
        self.plain = prefix + source
        self.prepared = PreparedTexts(prefix, source) if prepared else None

