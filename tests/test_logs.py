"""Logs for machines and for people: JSON lines off a terminal, one readable line on one, `--log-format` chooses."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from bridge.logs import setup_logging

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _restore_root_logger():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _emit(capsys: pytest.CaptureFixture[str], fmt: str | None) -> str:
    setup_logging("INFO", fmt)
    logging.getLogger("bridge.scheduler").info("attempt %d failed", 2, extra={"task_id": "01T", "queue": "orders"})
    return capsys.readouterr().err.strip()


def test_json_lines_carry_the_message_and_the_task_fields(capsys: pytest.CaptureFixture[str]) -> None:
    entry = json.loads(_emit(capsys, "json"))
    assert entry["level"] == "info" and entry["logger"] == "bridge.scheduler" and entry["msg"] == "attempt 2 failed"
    assert entry["task_id"] == "01T" and entry["queue"] == "orders" and entry["ts"].endswith("Z")


def test_text_is_one_readable_line_with_the_task_fields(capsys: pytest.CaptureFixture[str]) -> None:
    line = _emit(capsys, "text")
    assert "\n" not in line and not line.startswith("{")
    assert "INFO" in line and "bridge.scheduler" in line and "attempt 2 failed" in line
    assert line.endswith("task_id=01T queue=orders")


def test_off_a_terminal_the_default_is_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert json.loads(_emit(capsys, None))["msg"] == "attempt 2 failed"  # capsys's stderr is not a terminal


def test_the_cli_flag_chooses_the_format() -> None:
    """`rdq --log-format text` and `json`, through the CLI's own setup (every command logs its name at DEBUG)."""
    for fmt, check in (("json", lambda line: json.loads(line)["level"] == "debug"),
                       ("text", lambda line: " DEBUG " in line and not line.startswith("{"))):
        proc = subprocess.run([sys.executable, "-m", "bridge.cli", "--log-level", "DEBUG", "--log-format", fmt,
                               "check-config", "--config", str(ROOT / "config" / "bridge.yaml")],
                              capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert proc.returncode == 0, proc.stderr
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert lines and all(check(line) for line in lines), (fmt, proc.stderr)
