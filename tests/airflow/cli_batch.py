"""Several ``airflow`` CLI commands in one process, one after the other, each parsed and run as the
``airflow`` console script runs it (``airflow/__main__.py``): ``python -m tests.airflow.cli_batch JSON``,
where JSON is a list of argument lists (``[["dags", "test", "etl"], ...]``). An item
``{"wait_for": PATH}`` instead is a gate: the next command starts once that file exists (so a test can
act between two runs of one batch; gates are not counted in the command indexes).

Most of a command's cost is Airflow starting: importing it, loading the providers and, for ``dags test``,
building the in-process execution API. An ``airflow dags test`` of a one-task DAG took 10-11 CPU s on
its own (loaded machine), and three of them in one process 11.5 CPU s. The harness
(:meth:`tests.airflow.harness.AirflowHome.dags_test_many`) runs a test's several runs of one home here.

Before each command and after it, a line starting with :data:`MARK` goes to stdout and to stderr, so
the caller can give each command its own output and exit status (the end line carries it).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

MARK = "@@lease-cli-batch@@"
GATE_TIMEOUT = 600.0


def _mark(text: str) -> None:
    for stream in (sys.stdout, sys.stderr):
        stream.write(f"\n{MARK} {text}\n")
        stream.flush()


def _exit_status(exc: SystemExit) -> int:
    """What the interpreter would exit with (a message is printed to stderr and is status 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _wait_for(path: Path) -> None:
    end = time.monotonic() + GATE_TIMEOUT
    while not path.exists():
        if time.monotonic() > end:
            raise SystemExit(f"cli_batch: {path} did not appear within {GATE_TIMEOUT:.0f} s")
        time.sleep(0.1)


def parts(text: str) -> dict[int, tuple[int, str]]:
    """Command index -> (exit status, its output), from a batch's stdout or stderr."""
    found: dict[int, tuple[int, str]] = {}
    current: int | None = None
    lines: list[str] = []
    for line in text.splitlines(keepends=True):
        if line.startswith(MARK):
            word, index, *status = line[len(MARK):].split()
            if word == "start":
                current, lines = int(index), []
            elif current is not None:
                found[current] = (int(status[0]), "".join(lines))
                current = None
        elif current is not None:
            lines.append(line)
    return found


def main(commands: list[list[str] | dict[str, str]]) -> None:
    # As airflow/__main__.py: the configuration first, then the parser; the default configuration is
    # written once, before the first command (every command here needs it).
    from airflow import configuration  # noqa: F401
    from airflow.cli import cli_parser
    from airflow.cli.utils import redirect_stdout_log_handlers_to_stderr
    from airflow.configuration import write_default_airflow_configuration_if_needed

    parser = cli_parser.get_parser()
    write_default_airflow_configuration_if_needed()
    index = -1
    for command in commands:
        if isinstance(command, dict):
            _wait_for(Path(command["wait_for"]))
            continue
        index += 1
        _mark(f"start {index}")
        try:
            args = parser.parse_args(command)
            if hasattr(args, "output"):  # as airflow/__main__.py (for this and the later commands)
                redirect_stdout_log_handlers_to_stderr()
            args.func(args)
            status = 0
        except SystemExit as exc:
            status = _exit_status(exc)
        except Exception:  # as the interpreter would: the traceback on stderr, status 1
            traceback.print_exc()
            status = 1
        _mark(f"end {index} {status}")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
