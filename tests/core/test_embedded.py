"""The embedded server's lifetime options (the lifetime itself is tested through the CLI: tests/cli)."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_lease_provider.core.embedded import EmbeddedPostgres


@pytest.mark.parametrize(
    ("kwargs", "on_exit", "keep"),
    [
        ({}, "keep", True),
        ({"keep": False}, "delete", False),
        ({"on_exit": "stop"}, "stop", True),
        ({"keep": False, "on_exit": "stop"}, "stop", True),  # the explicit option wins
    ],
)
def test_on_exit_and_its_keep_shorthand(tmp_path: Path, kwargs: dict, on_exit: str, keep: bool) -> None:
    server = EmbeddedPostgres(tmp_path / "data", **kwargs)
    assert (server.on_exit, server.keep) == (on_exit, keep)


def test_an_unknown_on_exit_is_refused_naming_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="on_exit='forever': must be one of keep, stop, delete"):
        EmbeddedPostgres(tmp_path / "data", on_exit="forever")  # type: ignore[arg-type]
    assert not (tmp_path / "data").exists()
