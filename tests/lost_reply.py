"""A TCP proxy in front of the test PostgreSQL that can lose one answer: the statement (or commit) reaches the
server and is applied, and the connection is cut before the client reads the server's answer.

That is what a network cut, a pooler restart or a failover in the middle of a round trip does to a client:
the write happened, and the client cannot know. :meth:`LostReplyProxy.lose_reply` arms it once: after a
connection sent ``after`` (bytes of a statement's text), the first answer on it that leaves the server
idle, outside any transaction (PostgreSQL's ReadyForQuery with status ``I``: an autocommit statement's
answer, or a ``COMMIT``'s), is read in full and dropped, and both sides of that connection are closed. So
the server has finished (committed) what it answers before the client is cut off, and the test decides
nothing about timing.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any

import psycopg2.extensions

#: ReadyForQuery, transaction status idle: the last message of an answer once a transaction has ended.
IDLE = b"Z\x00\x00\x00\x05I"


class _Pair:
    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client = client
        self.server = server
        self.armed = False  # this connection sent ``after``: its next idle answer is lost


class LostReplyProxy:
    """Forwards 127.0.0.1:``port`` to ``upstream`` (``(host, port)``, or a Unix socket path)."""

    def __init__(self, upstream: tuple[str, int] | str) -> None:
        self.upstream = upstream
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = int(self.listener.getsockname()[1])
        self._lock = threading.Lock()
        self._after: bytes | None = None
        self._pairs: set[_Pair] = set()
        self._closed = False
        #: Set once an answer was lost (the armed plan fired).
        self.lost = threading.Event()
        threading.Thread(target=self._accept, name=f"lost-reply-proxy:{self.port}", daemon=True).start()

    @classmethod
    def for_dsn(cls, dsn: str) -> LostReplyProxy:
        info = psycopg2.extensions.parse_dsn(dsn)
        host, port = info.get("host", "127.0.0.1"), int(info.get("port", 5432))
        return cls(f"{host}/.s.PGSQL.{port}" if host.startswith("/") else (host, port))

    def dsn(self, dsn: str) -> str:
        """``dsn`` with its host and port replaced by this proxy's."""
        info: dict[str, Any] = dict(psycopg2.extensions.parse_dsn(dsn))
        info.update(host="127.0.0.1", port=str(self.port))
        return psycopg2.extensions.make_dsn(**info)

    def uri(self, dsn: str) -> str:
        """A ``postgresql://`` URI through this proxy (what an Airflow connection takes)."""
        info = psycopg2.extensions.parse_dsn(dsn)
        user = info.get("user", "postgres")
        return f"postgresql://{user}@127.0.0.1:{self.port}/{info.get('dbname', 'postgres')}"

    def lose_reply(self, *, after: bytes) -> None:
        """Arm: the first connection to send ``after`` loses its next idle answer (once)."""
        with self._lock:
            self._after = after
            self.lost.clear()

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        with self._lock:
            pairs = list(self._pairs)
        for pair in pairs:
            self._cut(pair)

    # -- forwarding --------------------------------------------------------------------------------

    def _connect_upstream(self) -> socket.socket:
        if isinstance(self.upstream, str):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(self.upstream)
            return sock
        sock = socket.create_connection(self.upstream, timeout=5)
        sock.settimeout(None)
        return sock

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = self._connect_upstream()
            except OSError:
                client.close()
                continue
            pair = _Pair(client, server)
            with self._lock:
                self._pairs.add(pair)
            threading.Thread(target=self._to_server, args=(pair,), daemon=True).start()
            threading.Thread(target=self._to_client, args=(pair,), daemon=True).start()

    def _to_server(self, pair: _Pair) -> None:
        try:
            while data := pair.client.recv(65536):
                with self._lock:
                    if self._after is not None and self._after in data:
                        self._after = None
                        pair.armed = True
                pair.server.sendall(data)
        except OSError:
            pass
        self._cut(pair)

    def _to_client(self, pair: _Pair) -> None:
        try:
            while data := pair.server.recv(65536):
                if pair.armed and data.endswith(IDLE):
                    self.lost.set()  # the server answered (committed): the client never hears it
                    break
                pair.client.sendall(data)
        except OSError:
            pass
        self._cut(pair)

    def _cut(self, pair: _Pair) -> None:
        for sock in (pair.client, pair.server):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        with self._lock:
            self._pairs.discard(pair)
