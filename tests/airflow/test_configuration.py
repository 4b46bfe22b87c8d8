"""One table of configuration facts (``get_provider_info.OPTIONS`` and the connection form), read back the
way Airflow and our own code read them: Airflow's config, Airflow's connection form, ``settings``, the
hook, the core's own defaults and the documented table."""

from __future__ import annotations

import ast
import json
import re
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest

from airflow_lease_provider import settings
from airflow_lease_provider.core import DEFAULT_SCHEMA
from airflow_lease_provider.core.db import DEFAULT_STATEMENT_TIMEOUT, Database
from airflow_lease_provider.core.events import DEFAULT_RETENTION
from airflow_lease_provider.core.keeper import DEFAULT_RENEW_FRACTION
from airflow_lease_provider.core.validation import MAX_DEFAULT_SAFETY_MARGIN
from airflow_lease_provider.get_provider_info import (
    CONN_TYPE,
    CONNECTION_FIELDS,
    CONNECTION_FORM,
    DEFAULT_CONN_ID,
    HOOK_NAME,
    OPTIONS,
    get_provider_info,
)
from airflow_lease_provider.hooks import LeaseHook
from tests.airflow.harness import DAGS, base_env

ROOT = Path(__file__).parents[2]
PACKAGE = ROOT / "airflow_lease_provider"

# Run by Airflow's own interpreter in a fresh AIRFLOW_HOME with no [lease] settings at all.
_READ_BACK = """
import json
from airflow.configuration import conf
from airflow.providers_manager import ProvidersManager
from airflow_lease_provider.get_provider_info import OPTIONS

manager = ProvidersManager()
widget = manager.connection_form_widgets["extra__lease__lease_schema"]
print(json.dumps({
    "config": {name: conf.get("lease", name) for name in OPTIONS},
    "behaviour": manager.field_behaviours["lease"],
    "hook_name": manager.hooks["lease"].hook_name,
    "widget_default": widget.field["value"],
}))
"""


@pytest.fixture(scope="module")
def airflow_reads(tmp_path_factory: pytest.TempPathFactory) -> dict:
    home = tmp_path_factory.mktemp("config-home")
    result = subprocess.run(
        ["python", "-c", _READ_BACK], env=base_env(home, DAGS), capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_airflow_config_falls_back_to_the_declared_defaults(airflow_reads: dict) -> None:
    assert airflow_reads["config"] == {name: option["default"] for name, option in OPTIONS.items()}
    assert settings.DEFAULTS == airflow_reads["config"]


def test_the_connection_form_airflow_shows_is_the_hooks(airflow_reads: dict) -> None:
    # Airflow 3.2+ reads the form from the provider info, 3.1 from the hook: both say the same.
    assert airflow_reads["behaviour"] == LeaseHook.get_ui_field_behaviour() == CONNECTION_FORM
    assert airflow_reads["hook_name"] == LeaseHook.hook_name == HOOK_NAME
    assert airflow_reads["widget_default"] == DEFAULT_SCHEMA


def test_the_provider_info_is_built_from_the_table() -> None:
    info = get_provider_info()
    assert info["config"]["lease"]["options"] == OPTIONS
    (connection,) = info["connection-types"]
    assert connection["connection-type"] == CONN_TYPE == LeaseHook.conn_type
    assert connection["conn-fields"] == CONNECTION_FIELDS
    behaviour = connection["ui-field-behaviour"]
    assert {key.replace("-", "_"): value for key, value in behaviour.items()} == CONNECTION_FORM
    # What Airflow is handed is a copy: changing it changes nothing here.
    behaviour["placeholders"]["host"] = "elsewhere"
    info["config"]["lease"]["options"]["schema"]["default"] = "elsewhere"
    assert CONNECTION_FORM["placeholders"]["host"] == "localhost" and OPTIONS["schema"]["default"] == DEFAULT_SCHEMA


def test_the_core_defaults_and_the_airflow_defaults_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OPTIONS:
        monkeypatch.delenv(f"AIRFLOW__LEASE__{name.upper()}", raising=False)
    assert settings.schema() == DEFAULT_SCHEMA
    assert settings.conn_id() == DEFAULT_CONN_ID == LeaseHook.default_conn_name
    assert settings.renew_fraction() == pytest.approx(DEFAULT_RENEW_FRACTION, abs=1e-4)
    assert settings.event_retention() == DEFAULT_RETENTION
    assert settings.clock_skew_warning() == timedelta(seconds=float(OPTIONS["clock_skew_warning_seconds"]["default"]))
    assert (settings.embedded(), settings.hold_connection(), settings.prepare_statements()) == ("auto", False, True)
    assert settings.push_lease_xcom() is False  # the lease XCom is pushed only where a deployment opts in
    assert Database("dbname=x").prepare is settings.prepare_statements()  # the core's default is the same
    # The table states the core's defaults (it does not import the core): the same values.
    assert CONNECTION_FIELDS["lease_schema"]["schema"]["default"] == DEFAULT_SCHEMA
    assert OPTIONS["schema"]["default"] == DEFAULT_SCHEMA
    assert OPTIONS["renew_fraction"]["default"] == f"{DEFAULT_RENEW_FRACTION:.4f}"
    assert OPTIONS["event_retention_days"]["default"] == str(DEFAULT_RETENTION.days)


def test_the_documented_defaults_are_the_declared_ones() -> None:
    text = (ROOT / "docs" / "airflow.md").read_text()
    documented = dict(re.findall(r"^\| `\[lease\] (\w+)` \| `([^`]*)` \|", text, flags=re.M))
    expected = {name: option["default"] for name, option in OPTIONS.items()}
    expected["embedded_dir"] = "$AIRFLOW_HOME/lease-postgres"  # the empty default, as it is resolved
    assert documented == expected


def test_no_other_module_writes_a_default_of_the_table() -> None:
    # The distinctive values: a module that needs one imports it (settings.DEFAULTS, the hook's attributes).
    values = {DEFAULT_CONN_ID, DEFAULT_SCHEMA, HOOK_NAME}
    owners = {PACKAGE / "get_provider_info.py", PACKAGE / "core" / "db" / "database.py"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Constant) and node.value in values and path not in owners:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert found == []


def test_the_core_figures_the_docs_quote_are_the_cores() -> None:
    # The core's own defaults (renewal, safety margin, statement timeout) as the docs state them.
    airflow_md = " ".join((ROOT / "docs" / "airflow.md").read_text().split())
    core_md = " ".join((ROOT / "docs" / "core.md").read_text().split())
    margin = f"{MAX_DEFAULT_SAFETY_MARGIN.total_seconds():g} s"
    assert DEFAULT_RENEW_FRACTION == pytest.approx(1 / 3)
    assert (
        "TTL x `renew_fraction` (TTL/3) | must be shorter than the TTL minus the keeper's safety margin "
        f"(TTL/10, at most {margin})"
    ) in airflow_md
    assert f"(`safety_margin`, default TTL/10 up to {margin}," in core_md
    assert f"`statement_timeout` ({DEFAULT_STATEMENT_TIMEOUT.total_seconds():g} s by default)" in core_md
