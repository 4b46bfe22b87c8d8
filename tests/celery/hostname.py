"""``[core] hostname_callable`` for the Celery tier: each worker reports the host name it is given.

Both workers run on one machine; in a real deployment they are two hosts. ``LEASE_TEST_HOSTNAME`` in a
worker's environment stands in for its host name (Airflow records it as the task instance's hostname).
"""

from __future__ import annotations

import os
import socket


def get() -> str:
    return os.environ.get("LEASE_TEST_HOSTNAME") or socket.getfqdn()
