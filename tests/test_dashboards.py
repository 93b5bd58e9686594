"""The Grafana dashboard and the Prometheus alert rules (deploy/): every metric they name is exported by a running
bridge (a real broker, a scenario with retries and dead letters), the rules pass `promtool check rules` and each
alert carries its runbook."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.conftest import KafkaEnv
from tests.kafka_helpers import aread_dlq, kafka_config, produce, running_bridge, wait_until

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "rdq-bridge.json"
RULES = ROOT / "deploy" / "prometheus" / "rdq-rules.yaml"
METRIC = re.compile(r"\brdq_[a-z_]+\b")


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert panels and all(p["targets"] for p in panels)
    return [t["expr"] for p in panels for t in p["targets"]]


def rules() -> list[dict[str, object]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def exported(body: str) -> set[str]:
    """Every series name /metrics can hold: each family's, with its type's suffixes."""
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", body, re.MULTILINE):
        names.add(name)
        names.update({"counter": [f"{name}_total"], "histogram": [f"{name}_bucket", f"{name}_count", f"{name}_sum"]}
                     .get(kind, []))
    names.update(re.findall(r"^(rdq_[a-z_]+)[{ ]", body, re.MULTILINE))
    return names


def test_every_alert_has_a_runbook_and_the_dashboard_covers_what_sres_watch() -> None:
    for rule in rules():
        annotations = rule["annotations"]
        assert isinstance(annotations, dict) and {"summary", "runbook"} <= set(annotations), rule["alert"]
        assert len(str(annotations["runbook"])) > 80, rule["alert"]
    named = {m for expr in dashboard_exprs() for m in METRIC.findall(expr)}
    for metric in ("rdq_records_consumed_total", "rdq_dead_total", "rdq_open_tasks", "rdq_dlq_stuck",
                   "rdq_breaker_state", "rdq_partition_restoring", "rdq_changelog_lag", "rdq_handler_threads_stuck"):
        assert metric in named, metric


def test_promtool_accepts_the_rules() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        assert not os.environ.get("CI"), "CI installs promtool (Debian's prometheus package): .ci/run"
        return  # by hand on a machine without promtool: the other checks still ran
    result = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout


@pytest.mark.kafka
async def test_every_metric_the_dashboard_and_the_alerts_name_is_exported(kafka: KafkaEnv, tmp_path: Path,
                                                                          unique: str) -> None:
    topic = f"in-{unique}"
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "q": {"handler": "flaky", "sources": [topic], "dlq_topic": f"dlq-{unique}", "max_attempts": 2,
              "backoff": {"kind": "fixed", "base": "20ms"}}}, telemetry={"port": 0})
    async with running_bridge(config) as bridge:
        produce(config, topic, [(None, b'{"fail": 0}', []), (None, b'{"fail": 99}', [])])
        await aread_dlq(kafka.bootstrap_servers, f"dlq-{unique}", expect=1)
        await wait_until(lambda: bridge.dlq.published == 1, what="the DLQ record")
        assert bridge.health is not None and bridge.health.bound_port
        port = bridge.health.bound_port
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())
    have = exported(body)
    named = {m for expr in [*dashboard_exprs(), *(str(r["expr"]) for r in rules())] for m in METRIC.findall(expr)}
    assert named and not named - have, sorted(named - have)
