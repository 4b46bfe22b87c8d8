"""A TCP proxy in front of the lease store (one per Celery worker, or the fault run's): a network path a test can cut.

``down()`` closes every forwarded connection and answers new ones by closing them at once, as a store
behind a broken link or a dead pooler does; ``up()`` forwards again. The upstream is a TCP address or a
Unix socket (the embedded PostgreSQL listens on a socket only).
"""

from __future__ import annotations

import contextlib
import socket
import threading


def upstream_of(info: dict[str, str]) -> tuple[str, int] | str:
    """Where a connection's parts (``psycopg2.extensions.parse_dsn``) point: a TCP address, or the server's
    Unix socket when the host is a directory (the embedded PostgreSQL)."""
    host = info.get("host") or "127.0.0.1"
    port = int(info.get("port") or 5432)
    return f"{host}/.s.PGSQL.{port}" if host.startswith("/") else (host, port)


class StoreProxy:
    def __init__(self, upstream: tuple[str, int] | str) -> None:
        self.upstream = upstream
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(256)
        self.port = int(self.listener.getsockname()[1])
        self._up = True
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, name=f"store-proxy:{self.port}", daemon=True).start()

    def _connect_upstream(self) -> socket.socket:
        if isinstance(self.upstream, str):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(self.upstream)
        else:
            sock = socket.create_connection(self.upstream, timeout=5)
            sock.settimeout(None)
        return sock

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self._up:
                client.close()
                continue
            try:
                server = self._connect_upstream()
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open.update((client, server))
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
                with self._lock:
                    self._open.discard(sock)

    def down(self) -> None:
        self._up = False
        with self._lock:
            sockets = list(self._open)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def up(self) -> None:
        self._up = True

    def close(self) -> None:
        self._closed = True
        self.down()
        self.listener.close()
