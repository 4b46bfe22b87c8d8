"""A real S3 API server for the object-fence tests: moto's server mode (``moto_server``, from the test
dependency group's ``moto[server]``), started as a subprocess on a free port and killed afterwards.

It answers ``If-Match`` / ``If-None-Match`` on PutObject with 412 PreconditionFailed, as AWS S3 does
(``test_the_server_refuses_a_stale_etag`` checks that premise first).

One difference from AWS matters to a race test: the ``moto_server`` script serves requests in threads, and
moto checks a PutObject's condition and stores the object in two steps without a lock, so two
conditional writes sent at once can both pass (seen: 1 round in 60 of 16 writers of 2 MB each, all with
the same ``If-Match``). AWS S3 makes the check and the write one atomic step. So the server here is the
same moto server application and request handler that ``moto_server`` runs (``moto.server.main``), on
werkzeug with ``threaded=False``: one request at a time, so each conditional write is atomic, as on AWS.
``MOTO_SERVER_THREADED=1`` starts the ``moto_server`` script itself instead.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

ROOT = Path(__file__).parents[1]

#: moto accepts any credentials; these are distinctive so a test can check no message carries them.
ACCESS_KEY = "AKIAFENCETESTKEY0001"
SECRET_KEY = "fence-test-secret-Zq8x"
REGION = "us-east-1"


#: ``moto_server`` (``moto.server.main``) with ``threaded=False``: see the module's docstring.
_SERIAL_SERVER = """
import os, sys
from werkzeug.serving import run_simple
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
host, port = sys.argv[1], int(sys.argv[2])
os.environ.setdefault("MOTO_PORT", str(port))
run_simple(host, port, DomainDispatcherApplication(create_backend_app), threaded=False,
           request_handler=MotoRequestHandler)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MotoServer:
    """``moto_server -H 127.0.0.1 -p <free port>`` as a child process."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if os.environ.get("MOTO_SERVER_THREADED") == "1":
            exe = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which("moto_server")
            if exe is None:
                raise RuntimeError("moto_server is not installed (the test dependency group's moto[server])")
            command = [exe, "-H", "127.0.0.1", "-p", str(self.port)]
        else:
            command = [sys.executable, "-c", _SERIAL_SERVER, "127.0.0.1", str(self.port)]
        # Its output goes to a file, shown if it does not start (importing moto alone takes seconds, and
        # far longer on a loaded 2-core machine: the wait is generous, and ends at once if it exits).
        self._log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            command,
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "MOTO_CALL_RESET_API": "false"},
        )
        deadline = time.monotonic() + 180
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"moto_server exited at start (code {self.process.returncode}): {self._tail()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto_server did not listen within 180 s: {self._tail()}") from None
                time.sleep(0.05)

    def __enter__(self) -> MotoServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _tail(self) -> str:
        self._log.seek(0)
        return self._log.read()[-2000:].decode("utf-8", "replace")

    def client(self, **config: Any) -> Any:
        return boto3.client(
            "s3", endpoint_url=self.url, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
            region_name=REGION, config=Config(retries={"max_attempts": 2, "mode": "standard"}, **config),
        )

    def bucket(self, *, versioned: bool = False) -> str:
        name = f"fence-{uuid.uuid4().hex[:16]}"
        client = self.client()
        client.create_bucket(Bucket=name)
        if versioned:
            client.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
        return name

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        self._log.close()
