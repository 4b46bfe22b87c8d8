"""A fault-injection harness for the lease and fence store, with a checker over the recorded history.

Run it with ``python -m chaos --profile short`` (CI, under three minutes) or ``--profile long`` (release
checks). It starts a private PostgreSQL, runs worker processes that acquire leases, work, publish through
the fence and release, injects faults (paused holders, killed sessions, a killed postmaster, skewed
clocks, statement timeouts; and, for the workers that go through the lease API (``chaos.api``: the
plugin's app on a real uvicorn in a process of its own), its server paused, killed and restarted, and its
replies lost after the store committed), records every operation with database timestamps to a JSON-lines history,
and checks the history (see :mod:`chaos.checker`).
"""

from __future__ import annotations
