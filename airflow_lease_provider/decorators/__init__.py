"""TaskFlow decorators: ``@task.leased`` and ``@task.fenced_publish`` (registered via provider info)."""

from __future__ import annotations
