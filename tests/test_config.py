from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from bridge.config import ConfigError, load_config, parse_duration

SPEC_MINIMAL = """\
kafka:
  bootstrap_servers: 127.0.0.1:9092
  group_id: orders-bridge
store:
  path: ./rdq.db
queues:
  orders.process:
    handler: flaky
    sources: [orders]
    max_attempts: 4
    backoff: {kind: exponential, base: 100ms, factor: 2, max: 5s, jitter: full}
    lease: 30s
    dlq_topic: orders.dlq
admin:
  topic: rdq.admin
  reply_topic: rdq.admin.replies
  auth: {keys: {k1: "a-shared-secret-of-32-bytes-or-more"}}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bridge.yaml"
    path.write_text(text)
    return path


def test_spec_minimal_config_loads_as_written(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, SPEC_MINIMAL), environ={})
    queue = config.queues["orders.process"]
    assert config.kafka.bootstrap_servers == "127.0.0.1:9092"
    assert config.kafka.group_id == "orders-bridge"
    assert queue.handler == "flaky" and queue.sources == ["orders"] and queue.max_attempts == 4
    assert queue.backoff.base == pytest.approx(0.1) and queue.backoff.max == 5.0 and queue.backoff.factor == 2
    assert queue.backoff.jitter == "full" and queue.lease == 30.0
    assert config.dlq_topic("orders.process") == "orders.dlq"
    assert config.store.synchronous == "FULL"
    assert config.admin is not None and config.admin.auth != "none"
    assert config.queue_for_topic("orders") == "orders.process"


def test_example_config_loads() -> None:
    config = load_config(Path(__file__).parent.parent / "config" / "bridge.yaml", environ={})
    assert len(config.queues) == 2
    assert {q.handler for q in config.queues.values()} <= {"ok", "flaky", "permanent", "sleep", "crash"}


@pytest.mark.parametrize(("text", "seconds"), [("250ms", 0.25), ("30s", 30), ("10m", 600), ("7d", 604800),
                                               ("2h", 7200), (5, 5.0), (1.5, 1.5), ("12", 12)])
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


def test_env_overrides_nested_keys(tmp_path: Path) -> None:
    env = {"RDQ_KAFKA__BOOTSTRAP_SERVERS": "10.0.0.1:9093", "RDQ_QUEUES__ORDERS.PROCESS__MAX_ATTEMPTS": "9",
           "RDQ_STORE__SYNCHRONOUS": "NORMAL", "OTHER": "x"}
    config = load_config(write(tmp_path, SPEC_MINIMAL), environ=env)
    assert config.kafka.bootstrap_servers == "10.0.0.1:9093"
    assert config.queues["orders.process"].max_attempts == 9
    assert config.store.synchronous == "NORMAL"


def test_bad_field_names_file_and_field(tmp_path: Path) -> None:
    path = write(tmp_path, SPEC_MINIMAL.replace("max_attempts: 4", "max_attempts: 0"))
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    assert str(path) in str(err.value)
    assert "queues['orders.process'].max_attempts" in str(err.value)
    assert "greater than or equal to 1" in str(err.value)


@pytest.mark.parametrize(("change", "field"), [
    (("lease: 30s", "lease: soon"), "lease"),
    (("kind: exponential", "kind: linear"), "backoff.kind"),
    (("handler: flaky", "handler: flaky\n    colour: blue"), "colour"),
    (("  group_id: orders-bridge\n", ""), None),
])
def test_bad_values_are_refused(tmp_path: Path, change: tuple[str, str], field: str | None) -> None:
    path = write(tmp_path, SPEC_MINIMAL.replace(*change))
    if field is None:  # group_id has a default: still valid
        assert load_config(path, environ={}).kafka.group_id == "rdq-bridge"
        return
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    assert field in str(err.value) and str(path) in str(err.value)


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml", environ={})
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "kafka: [unclosed"), environ={})
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"), environ={})


def test_admin_auth_must_be_explicit(tmp_path: Path) -> None:
    no_auth = SPEC_MINIMAL.replace('  auth: {keys: {k1: "a-shared-secret-of-32-bytes-or-more"}}\n', "")
    with pytest.raises(ConfigError, match=r"admin\.auth"):
        load_config(write(tmp_path, no_auth), environ={})
    config = load_config(write(tmp_path, no_auth + "  auth: none\n"), environ={})
    assert config.admin is not None and config.admin.auth == "none"


def test_retain_alias_and_source_owned_once(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, SPEC_MINIMAL.replace("lease: 30s", "lease: 30s\n    retain: 2d")), environ={})
    assert config.queues["orders.process"].task_ttl == 172800
    with pytest.raises(ConfigError, match="claimed by queues"):
        again = "    dlq_topic: orders.dlq\n  again:\n    handler: ok\n    sources: [orders]\n"
        load_config(write(tmp_path, SPEC_MINIMAL.replace("    dlq_topic: orders.dlq\n", again)), environ={})


@pytest.mark.parametrize("key", ["", "tiny-KEY-42", "31-bytes-xxxxxxxxxxxxxxxxxxxxxx"])
def test_an_admin_key_shorter_than_32_bytes_is_refused_without_showing_it(tmp_path: Path, key: str) -> None:
    text = SPEC_MINIMAL.replace("a-shared-secret-of-32-bytes-or-more", key)
    with pytest.raises(ConfigError, match=r"admin\.auth: .*'k1' shorter than 32 bytes") as raised:
        load_config(write(tmp_path, text), environ={})
    assert not key or key not in str(raised.value)


def test_secrets_never_appear_in_config_errors_or_dumps(tmp_path: Path) -> None:
    """Keys, worker tokens and HTTP headers are secret types: masked in any dump (a reply, a log line) and never
    echoed in an error, while a config file written on purpose (`file_tree`) keeps them."""
    text = SPEC_MINIMAL + (
        "workers: {listen: ['tcp://127.0.0.1:0'], tokens: ['worker-token-SECRET-1'], max_wait: 1m}\n")
    text = text.replace("    dlq_topic: orders.dlq\n", "    dlq_topic: orders.dlq\n    http: {url: 'http://app/x', "
                        "headers: {authorization: 'Bearer TOKEN-SECRET-2'}}\n")
    config = load_config(write(tmp_path, text), environ={})
    shown = json.dumps(config.model_dump(mode="json")) + repr(config) + str(config)
    for secret in ("a-shared-secret-of-32-bytes-or-more", "worker-token-SECRET-1", "TOKEN-SECRET-2"):
        assert secret not in shown
        assert secret in json.dumps(config.file_tree())
    assert load_config(write(tmp_path, yaml.safe_dump(config.file_tree())), environ={}) == config
    bad = text.replace("'Bearer TOKEN-SECRET-2'", "['Bearer TOKEN-SECRET-2']").replace(
        "['worker-token-SECRET-1']", "[{'t': 'worker-token-SECRET-1'}]")
    with pytest.raises(ConfigError) as raised:
        load_config(write(tmp_path, bad), environ={})
    assert "SECRET" not in str(raised.value) and "headers" in str(raised.value) and "tokens" in str(raised.value)


def test_a_yaml_error_does_not_quote_the_line_that_may_hold_a_secret(tmp_path: Path) -> None:
    text = ('kafka: {bootstrap_servers: x}\nadmin:\n'
            '  auth: {keys: {k1: "SECRET-VALUE-of-32-bytes-or-more-123"}\n  x: [\n')
    with pytest.raises(ConfigError, match=r"not valid YAML: .* at line \d+, column \d+") as raised:
        load_config(write(tmp_path, text), environ={})
    assert "SECRET" not in str(raised.value)


def test_the_consumer_refetches_soon_after_its_prefetch_queue_was_full(tmp_path: Path) -> None:
    """librdkafka's default fetch.queue.backoff.ms (1 s) idles a consumer whose prefetch queue filled for most of
    each second (a bare loop measured 56k against 180k records/s, bench/RESULTS.md): the bridge's consumer asks
    for 20 ms, with the queue bound by kafka.max_buffered_mb; a `kafka.consumer` setting still wins."""
    from bridge.kafka_clients import consumer_config

    config = load_config(write(tmp_path, SPEC_MINIMAL), environ={})
    settings = consumer_config(config)
    assert settings["fetch.queue.backoff.ms"] == 20
    assert settings["queued.max.messages.kbytes"] == 32 * 1024  # half of the default 64 MB
    tuned = load_config(write(tmp_path, SPEC_MINIMAL.replace(
        "  group_id: orders-bridge\n",
        "  group_id: orders-bridge\n  consumer: {fetch.queue.backoff.ms: 250}\n")), environ={})
    assert consumer_config(tuned)["fetch.queue.backoff.ms"] == 250



def test_a_member_hears_of_a_rebalance_within_half_a_second(tmp_path: Path) -> None:
    """A cooperative rebalance takes two rounds, each noticed at a member's next heartbeat: at Kafka's 3 s a
    `processes: 2` restart formed its group 6.7 s after it started, its first child restoring every partition
    meanwhile (bench_processes restore); the bridge's consumer heartbeats every 500 ms; a `kafka.consumer` setting
    still wins."""
    from bridge.kafka_clients import consumer_config

    assert consumer_config(load_config(write(tmp_path, SPEC_MINIMAL), environ={}))["heartbeat.interval.ms"] == 500
    tuned = load_config(write(tmp_path, SPEC_MINIMAL.replace(
        "  group_id: orders-bridge\n",
        "  group_id: orders-bridge\n  consumer: {heartbeat.interval.ms: 3000}\n")), environ={})
    assert consumer_config(tuned)["heartbeat.interval.ms"] == 3000

TOKEN = "tok-9f8e7d6c5b4a39281706f5e4d3c2b1a0"


@pytest.mark.parametrize(("change", "field"), [
    # A typo (`token` for `tokens`): pydantic's own message quoted the unknown field's value.
    (("", f"workers: {{listen: ['tcp://127.0.0.1:0'], token: '{TOKEN}'}}\n"), "workers.token"),
    # A secret pasted where a key id belongs.
    (("auth: {keys: {k1: \"a-shared-secret-of-32-bytes-or-more\"}}",
      f"auth: {{keys: {{k1: \"a-shared-secret-of-32-bytes-or-more\"}}, signing_key: '{TOKEN}'}}"), "admin.auth"),
    # A token misplaced into a known field of another type, and into an unknown field of a queue.
    (("lease: 30s", f"lease: '{TOKEN}'"), "queues['orders.process'].lease"),
    (("lease: 30s", f"lease: 30s\n    password: '{TOKEN}'"), "queues['orders.process'].password"),
    (("group_id: orders-bridge", f"group_id: orders-bridge\n  sasl_password: '{TOKEN}'"), "kafka.sasl_password"),
    (("", f"workers: {{listen: ['{TOKEN}'], tokens: ['x']}}\n"), "workers"),
])
def test_no_config_error_prints_the_value_of_a_field(tmp_path: Path, change: tuple[str, str], field: str) -> None:
    old, new = change
    text = SPEC_MINIMAL.replace(old, new) if old else SPEC_MINIMAL + new
    with pytest.raises(ConfigError) as raised:
        load_config(write(tmp_path, text), environ={})
    message = str(raised.value)
    assert field in message and TOKEN not in message, message


def test_a_number_in_a_known_field_is_still_shown(tmp_path: Path) -> None:
    path = write(tmp_path, SPEC_MINIMAL.replace("max_attempts: 4", "max_attempts: 0"))
    with pytest.raises(ConfigError, match=r"max_attempts: .*greater than or equal to 1 \(got 0\)"):
        load_config(path, environ={})
    with pytest.raises(ConfigError, match=r"lease: .*not a duration.*\(got a string of 4 characters\)"):
        load_config(write(tmp_path, SPEC_MINIMAL.replace("lease: 30s", "lease: soon")), environ={})


async def test_a_failed_reload_does_not_log_a_misplaced_token(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    from bridge.live_config import LiveConfig

    good = write(tmp_path, SPEC_MINIMAL)
    live = LiveConfig(load_config(good, environ={}), good)
    good.write_text(SPEC_MINIMAL + f"workers: {{listen: ['tcp://127.0.0.1:0'], token: '{TOKEN}'}}\n")
    with caplog.at_level("ERROR"):
        assert await live.reload() is False
    assert "config reload failed" in caplog.text and "workers.token" in caplog.text
    assert TOKEN not in caplog.text


def test_neither_check_config_nor_run_prints_a_misplaced_token(tmp_path: Path) -> None:
    import subprocess
    import sys

    good = write(tmp_path, SPEC_MINIMAL + f"workers: {{listen: ['tcp://127.0.0.1:0'], token: '{TOKEN}'}}\n")
    for verb in ("check-config", "run"):
        done = subprocess.run([sys.executable, "-m", "bridge.cli", verb, "--config", str(good)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert "workers.token" in done.stderr and TOKEN not in done.stderr + done.stdout


@pytest.mark.parametrize(("producer", "expected"), [
    ({}, {"compression.type": "lz4"}),  # the default: the changelog's JSON records, lz4
    ({"compression.type": "zstd"}, {"compression.type": "zstd"}),  # the team's choice wins
    ({"compression.codec": "none"}, {"compression.codec": "none"}),  # librdkafka's other name for it, too
])
def test_the_changelog_producer_compresses_with_lz4_unless_the_config_says_otherwise(
        tmp_path: Path, producer: dict[str, str], expected: dict[str, str]) -> None:
    from bridge.kafka_clients import changelog_producer_config

    tree = yaml.safe_load(SPEC_MINIMAL)
    tree["kafka"]["producer"] = producer
    config = load_config(write(tmp_path, yaml.safe_dump(tree)), environ={})
    settings = changelog_producer_config(config, 1_000_000)
    chosen = {k: v for k, v in settings.items() if k in ("compression.type", "compression.codec")}
    assert chosen == expected
    assert settings["transactional.id"].startswith("rdq-orders-bridge-") and settings["enable.idempotence"] is True
