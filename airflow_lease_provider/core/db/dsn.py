"""Connection strings: where one points (without its password), and the redaction of every password this
process knows from every message the store builds."""

from __future__ import annotations

import re
import threading
from typing import Any
from urllib.parse import parse_qsl, unquote

import psycopg2
import psycopg2.extensions

#: A URI connection string (libpq accepts both schemes).
_URI_RE = re.compile(r"^\s*postgres(?:ql)?://", re.IGNORECASE)
#: What libpq may split an unencoded password at, and then echo a part of in its error message.
_SPLIT_RE = re.compile(r"[/@:?#&=%\s]+")
#: A URI whose scheme is mistyped (``postgresql//``, ``postgresql:/``, ``postgres:``): libpq reads it as
#: keyword/value pairs and quotes all of it back ('missing "=" after "postgresql//user:pw@..."').
_URI_LIKE_RE = re.compile(r"^\s*[A-Za-z][A-Za-z0-9+.-]*(?::/{0,3}|/{1,3})", re.IGNORECASE)
_PASSWORD_KEYWORD_RE = re.compile(r"(?:^|\s)password\s*=\s*('(?:[^'\\]|\\.)*'?|\S+)", re.IGNORECASE)
_PASSWORD_QUERY_RE = re.compile(r"[?&]password=([^&]*)", re.IGNORECASE)
#: Passwords of every connection string this process has described or opened: removed from every
#: message :func:`translate` builds, whichever connection the error came from.
_known_secrets: set[str] = set()
_secrets_lock = threading.Lock()
REDACTED = "***"


def _secrets_of(dsn: str) -> tuple[set[str], set[str]]:
    """(whole passwords, fragments) a connection string may carry, under every reading of it.

    A password with an unencoded ``/ @ : ?`` is read differently by libpq (part of it becomes the
    host, the port or the database), so every candidate is collected: the parsed password, the URI's
    userinfo after the user, a ``password=`` query parameter or keyword, each raw and percent-decoded;
    and their pieces between those characters, which libpq may quote in an error message.
    """
    whole: set[str] = set()
    try:
        parsed = psycopg2.extensions.parse_dsn(dsn).get("password")
        readable = True
    except psycopg2.Error:
        parsed, readable = None, False
    if parsed:
        whole.add(parsed)
    # A URI, or what libpq could not read and looks like one with its scheme mistyped: the password is
    # what stands between the user's ':' and the last '@', whatever libpq made of it.
    uri = _URI_RE if _URI_RE.match(dsn) else _URI_LIKE_RE if not readable and _URI_LIKE_RE.match(dsn) else None
    if uri is not None:
        rest = uri.sub("", dsn, count=1)
        if "@" in rest:
            userinfo = rest.rsplit("@", 1)[0]
            if ":" in userinfo:
                whole.add(userinfo.split(":", 1)[1])
        whole.update(m for m in _PASSWORD_QUERY_RE.findall(rest))
    for match in _PASSWORD_KEYWORD_RE.finditer(dsn):
        value = match.group(1)
        whole.add(value)
        if value.startswith("'"):
            whole.add(value.strip("'").replace("\\'", "'").replace("\\\\", "\\"))
    whole |= {unquote(w) for w in whole}
    whole.discard("")
    fragments = {part for w in whole for part in _SPLIT_RE.split(w) if part} - whole
    return whole, fragments


def remember_secrets(dsn: str) -> None:
    """Redact this connection string's password from every message translated from now on."""
    whole, fragments = _secrets_of(dsn)
    with _secrets_lock:
        _known_secrets.update(whole)
        _known_secrets.update("\x00" + f for f in fragments)  # a NUL marks a fragment: see redact()


def redact(text: str, dsn: str | None = None) -> str:
    """``text`` with every known password (and ``dsn``'s) replaced by ``***``.

    Whole passwords go wherever they appear; a fragment of one (a piece between ``/ @ : ?``, which
    libpq may echo after mis-reading an unencoded password) only where it stands as a word of its own.
    """
    with _secrets_lock:
        known = set(_known_secrets)
    whole = {s for s in known if not s.startswith("\x00")}
    fragments = {s[1:] for s in known if s.startswith("\x00")}
    if dsn is not None:
        more_whole, more_fragments = _secrets_of(dsn)
        whole |= more_whole
        fragments |= more_fragments
    for secret in sorted(whole, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    for fragment in sorted(fragments, key=len, reverse=True):
        text = re.sub(rf"(?<![A-Za-z0-9]){re.escape(fragment)}(?![A-Za-z0-9])", REDACTED, text)
    return text


def _describe_uri(dsn: str) -> str:
    user, host, port, dbname = _uri_parts(dsn)
    return f"{user or '?'}@{host or 'local socket'}:{port or '5432'}/{dbname or '?'}"


def _uri_parts(dsn: str) -> tuple[str, str, str, str]:
    """User, host, port and database name of a URI DSN (empty when not given)."""
    rest = _URI_RE.sub("", dsn.strip(), count=1)
    user = ""
    if "@" in rest:
        # The last @ ends the userinfo: a password with an unencoded @ or / stays on the left of it.
        userinfo, rest = rest.rsplit("@", 1)
        user = unquote(userinfo.split(":", 1)[0])
    hostport, _, path = rest.partition("/")
    dbname, _, query = path.partition("?")
    if "?" in hostport:
        hostport, _, query = hostport.partition("?")
    host, port = hostport, ""
    if hostport.startswith("["):  # [IPv6]:port
        host, _, tail = hostport.partition("]")
        host += "]"
        port = tail.removeprefix(":")
    elif hostport.count(":") == 1:
        host, port = hostport.split(":")
    params = dict(parse_qsl(query, keep_blank_values=True))
    host = params.get("host") or unquote(host)
    port = params.get("port") or port
    dbname = params.get("dbname") or unquote(dbname)
    user = params.get("user") or user
    return user, host, port, dbname


def server_endpoint(dsn: str) -> tuple[str, int] | None:
    """The one TCP endpoint (host, port) a DSN names; None for a Unix socket, several hosts, or an
    unparsable string. Read as :func:`describe_dsn` reads it (a URI's userinfo ends at the last ``@``)."""
    if _URI_RE.match(dsn):
        _, host, port, _ = _uri_parts(dsn)
    else:
        try:
            info = psycopg2.extensions.parse_dsn(dsn)
        except psycopg2.ProgrammingError:
            return None
        host, port = info.get("host") or info.get("hostaddr") or "", info.get("port") or ""
    host, port = host.strip("[]"), port or "5432"
    if not host or host.startswith("/") or "," in host or "," in port or not port.isdigit():
        return None
    return host, int(port)


def describe_dsn(dsn: str) -> str:
    """Where a DSN points, without its password: safe for logs and error messages.

    A URI is read here, not by libpq: libpq mis-reads a password with an unencoded ``/`` (part of it
    becomes the host or the database), so the userinfo ends at the *last* ``@``; and whatever is
    printed has every reading of the password removed.
    """
    remember_secrets(dsn)
    if _URI_RE.match(dsn):
        return redact(_describe_uri(dsn), dsn)
    try:
        info = psycopg2.extensions.parse_dsn(dsn)
    except psycopg2.ProgrammingError:
        return "<unparsable connection string>"
    host = info.get("host") or "local socket"
    port = info.get("port") or "5432"
    return redact(f"{info.get('user') or '?'}@{host}:{port}/{info.get('dbname') or '?'}", dsn)



def make_dsn(**params: Any) -> str:
    """A libpq connection string of ``params`` (keyword=value, quoted by libpq's rules)."""
    return str(psycopg2.extensions.make_dsn(**params))
