"""Triggers: the deferred wait of ``on_overlap="wait"``."""

from __future__ import annotations
