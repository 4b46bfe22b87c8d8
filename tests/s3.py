"""A real S3 API server for the object-fence tests: moto's server mode (``moto_server``, from the test
dependency group's ``moto[server]``), started as a subprocess on a free port and killed afterwards.

It answers ``If-Match`` / ``If-None-Match`` on PutObject with 412 PreconditionFailed, as AWS S3 does
(``test_the_server_refuses_a_stale_etag`` checks that premise first).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

#: moto accepts any credentials; these are distinctive so a test can check no message carries them.
ACCESS_KEY = "AKIAFENCETESTKEY0001"
SECRET_KEY = "fence-test-secret-Zq8x"
REGION = "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MotoServer:
    """``moto_server -H 127.0.0.1 -p <free port>`` as a child process."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        exe = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which("moto_server")
        if exe is None:
            raise RuntimeError("moto_server is not installed (the test dependency group's moto[server])")
        self.process = subprocess.Popen(
            [exe, "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "MOTO_CALL_RESET_API": "false"},
        )
        deadline = time.monotonic() + 30
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"moto_server exited at start (code {self.process.returncode})")
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("moto_server did not listen within 30 s") from None
                time.sleep(0.05)

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
