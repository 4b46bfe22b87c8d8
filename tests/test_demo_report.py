"""The demo's closing report names the UI's users and where their passwords are, never the passwords.

``scripts/demo`` runs in CI, whose logs keep what it prints; the passwords Airflow generated for the
demo's users stay in their file, made readable by its owner only.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from demo import airflow_demo


def test_the_report_names_the_users_and_their_file_and_prints_no_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    passwords = tmp_path / "simple_auth_manager_passwords.json.generated"
    secrets = {"admin": "Sx9-admin-secret", "viewer": "Qz7-viewer-secret"}
    passwords.write_text(json.dumps(secrets))
    passwords.chmod(0o644)  # as Airflow leaves it
    monkeypatch.setattr(airflow_demo, "HOME", tmp_path)
    store = SimpleNamespace(events=SimpleNamespace(query=lambda limit: []))

    airflow_demo.report(store, "manual__zombie")

    out = capsys.readouterr().out
    assert "admin, viewer" in out and str(passwords) in out, out
    assert not any(secret in out for secret in secrets.values()), out
    assert stat.S_IMODE(passwords.stat().st_mode) == 0o600
