"""The configuration's models (SPEC §2): every section and field, its type, bounds and default.

Durations are seconds (int/float) or strings such as `250ms`, `30s`, `10m`, `2h`, `7d`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    SecretStr,
    SerializationInfo,
    model_validator,
)

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
ENV_PREFIX = "RDQ_"


class ConfigError(ValueError):
    """The configuration file or an override is invalid; the message names the file and the field."""


def parse_duration(value: Any) -> Any:
    """`250ms` → 0.25, `10m` → 600.0, 5 → 5.0; anything else is left for pydantic to reject."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match is None:
            raise ValueError("not a duration (use seconds or e.g. 250ms, 30s, 10m, 2h, 7d)")
        return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    return value


# Bounded so that no duration can overflow a millisecond timestamp (SQLite INTEGER) or be NaN/infinite.
MAX_DURATION = 100 * 365 * 86400.0
Duration = Annotated[float, BeforeValidator(parse_duration), Field(ge=0, le=MAX_DURATION, allow_inf_nan=False)]
PositiveDuration = Annotated[float, BeforeValidator(parse_duration),
                             Field(gt=0, le=MAX_DURATION, allow_inf_nan=False)]


def _secret_out(value: SecretStr, info: SerializationInfo) -> str:
    """Masked (`**********`) wherever a config is dumped — a reply, a log — unless a config file is being written
    on purpose (`file_tree()`)."""
    return value.get_secret_value() if (info.context or {}).get("reveal_secrets") else str(value)


# Admin keys, worker tokens, HTTP handler headers: never in a reply, a log line or an error message.
Secret = Annotated[SecretStr, PlainSerializer(_secret_out, return_type=str)]
MIN_ADMIN_KEY_BYTES = 32


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KafkaConfig(_Model):
    bootstrap_servers: str
    group_id: str = "rdq-bridge"
    # Passed through to librdkafka as is (SASL/SSL settings included): `client` to every client the bridge
    # makes, `consumer` and `producer` to those only (e.g. session.timeout.ms, group.instance.id).
    client: dict[str, str | int | float | bool] = Field(default_factory=dict)
    consumer: dict[str, str | int | float | bool] = Field(default_factory=dict)
    producer: dict[str, str | int | float | bool] = Field(default_factory=dict)
    # Records of one partition handled at once on first delivery (SPEC §5.2).
    partition_concurrency: int = Field(default=16, ge=1, le=10_000)
    # Memory for fetched records not yet handled, in MB: half is librdkafka's prefetch queue
    # (queued.max.messages.kbytes), half the bridge's own backlog, shared by the assigned partitions (a partition
    # past its share is paused until it drains).
    max_buffered_mb: float = Field(default=64.0, ge=1.0, le=65_536.0)
    # Topics the dev launcher / `rdq topics` create when missing.
    topic_partitions: int = Field(default=3, ge=1)
    topic_replication_factor: int = Field(default=1, ge=1)
    # Largest DLQ record the bridge produces (and the max.message.bytes `rdq topics` gives DLQ topics): a DLQ
    # record carries the payload base64-encoded plus its history, so it outgrows the source record.
    dlq_max_message_bytes: int = Field(default=8 * 1024 * 1024, ge=10_000, le=1_000_000_000)


class StoreConfig(_Model):
    path: Path = Path("./rdq.db")
    busy_timeout: Duration = 5.0
    synchronous: Literal["FULL", "NORMAL", "EXTRA"] = "FULL"
    # Most writes one transaction groups together.
    group_commit_max: int = Field(default=2000, ge=1)
    # Cap on the store file; past it the store is full: consumption pauses until tasks are purged. None: no cap.
    max_size_mb: float | None = Field(default=None, gt=0)
    # Tasks outlive the bridge (SPEC §10): every transition goes to a compacted changelog topic co-partitioned
    # with its source; an instance assigned a partition restores its tasks. False: tasks live in this file only
    # (a single bridge on a durable volume), and a lost disk or a scale-down strands them.
    changelog: bool = True
    # How often the changelog's Kafka transaction commits (with the source offsets): the added latency of a
    # stored failure before its offset may move, and of a DLQ record before readers see it.
    changelog_commit_interval: PositiveDuration = 0.1


class BackoffConfig(_Model):
    kind: Literal["fixed", "exponential"] = "exponential"
    base: Duration = 1.0
    factor: float = Field(default=2.0, ge=1.0)
    max: Duration = 300.0
    # Unset: by kind. A fixed backoff waits what it says (`none`); an exponential one is fully jittered.
    jitter: Literal["none", "full"] | None = None

    @property
    def effective_jitter(self) -> str:
        return self.jitter or ("none" if self.kind == "fixed" else "full")


class HeartbeatConfig(_Model):
    # How often a running handler's heartbeats are turned into lease extensions; default lease / 3.
    interval: PositiveDuration | None = None


class ErrorsConfig(_Model):
    permanent: list[str] = Field(default_factory=list)
    retryable: list[str] = Field(default_factory=list)
    default: Literal["retryable", "permanent"] = "retryable"


class HttpHandlerConfig(_Model):
    """Run this queue's tasks by calling the app beside the sidecar (SPEC §8.2)."""

    url: str = Field(pattern=r"^https?://")
    method: Literal["POST", "PUT", "PATCH"] = "POST"
    timeout: PositiveDuration = 10.0
    headers: dict[str, Secret] = Field(default_factory=dict)  # often a bearer token
    max_connections: int = Field(default=32, ge=1)


class BreakerConfig(_Model):
    """The queue's circuit breaker (SPEC §11): trips when, within `window`, at least `min_attempts` attempts ran and
    at least `failure_ratio` of them failed retryably (an outage, not a record's fault)."""

    enabled: bool = True
    window: PositiveDuration = 30.0
    min_attempts: int = Field(default=20, ge=1)
    # An outage fails nearly everything; a stream with poison records or a flaky retry (half its first attempts
    # failing, half their retries succeeding) stays well below.
    failure_ratio: float = Field(default=0.8, gt=0.0, le=1.0)
    # Open this long, then half-open; each re-trip soon after (a failed probe, or within `reset_after` of closing)
    # doubles it, up to `max_open_for`.
    open_for: PositiveDuration = 5.0
    max_open_for: PositiveDuration = 60.0
    reset_after: PositiveDuration = 60.0
    # Half-open: this many tasks run as probes; after a success, retries are claimed at a limit growing from
    # `probes` to the queue's concurrency over `ramp` (a recovering downstream is not stampeded).
    probes: int = Field(default=1, ge=1)
    ramp: Duration = 10.0


class QueueConfig(_Model):
    handler: str = Field(min_length=1)
    sources: list[str] = Field(default_factory=list)
    max_attempts: int = Field(default=5, ge=1)
    backoff: BackoffConfig = Field(default_factory=BackoffConfig)
    lease: PositiveDuration = 30.0
    heartbeat: HeartbeatConfig = Field(default_factory=HeartbeatConfig)
    errors: ErrorsConfig = Field(default_factory=ErrorsConfig)
    version_mismatch: Literal["run-latest", "dead-letter"] = "run-latest"
    queue_timeout: PositiveDuration | None = None
    # The longest delay a handler may ask for (`Retry(after=…)`, HTTP `Retry-After`, a worker's `retry_after`);
    # a longer one is cut to this (and to queue_timeout).
    max_retry_after: PositiveDuration = 86400.0
    task_ttl: Duration = 7 * 86400.0
    retain_from: Literal["finished", "fetched"] = "finished"
    dlq_topic: str | None = None
    concurrency: int = Field(default=8, ge=1, le=10_000)
    max_open_tasks: int = Field(default=100_000, ge=1)
    # The handler is the app at this URL (registered under `handler` at start).
    http: HttpHandlerConfig | None = None
    # The handler runs in remote workers (the socket protocol): this bridge stores and leases, never runs it.
    remote: bool = False
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    # The redrive loop guard (SPEC §13): a task already redriven this many times is refused by a redrive unless it
    # is forced (`rdq redrive --force`): a task that keeps dying is a bug to fix, not a task to retry forever.
    max_redrives: int = Field(default=5, ge=0)
    # Per-key ordering (SPEC §12): `key` runs at most one record per key at a time, in offset order (concurrently
    # across keys); a failed record's later same-key records are parked behind its task. `on_dead` decides what a
    # dead head does: `release` (the next record runs) or `hold` (the key waits for a redrive or `rdq skip`).
    ordering: Literal["none", "key"] = "none"
    on_dead: Literal["release", "hold"] = "release"

    @model_validator(mode="before")
    @classmethod
    def _retain_alias(cls, data: Any) -> Any:
        # SPEC §2 names the retention setting both `task_ttl` and `retain`; accept either, not both.
        if isinstance(data, dict) and "retain" in data:
            if "task_ttl" in data:
                raise ValueError("set `task_ttl` or `retain`, not both")
            data = {**data, "task_ttl": data["retain"]}
            del data["retain"]
        return data

    @property
    def heartbeat_interval(self) -> float:
        return self.heartbeat.interval or self.lease / 3


# The fields of a queue that are its retry policy: they apply live (config reload, admin `set-policy`) to tasks
# already queued. Every other setting is read at start: changing it needs a restart.
POLICY_FIELDS = frozenset({
    "max_attempts", "backoff", "lease", "heartbeat", "errors", "version_mismatch", "queue_timeout",
    "max_retry_after", "task_ttl", "retain_from", "concurrency", "max_open_tasks", "max_redrives",
})


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """`override` over `base`, mapping into mapping: overriding `backoff.base` keeps the file's `backoff.max`."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


class WorkersConfig(_Model):
    """Remote workers (SPEC §8.2): listen addresses, tcp://host:port or unix:///path, and accepted tokens."""

    listen: list[str] = Field(min_length=1)
    tokens: list[Secret] = Field(min_length=1)
    # How long a claim may wait for a task before answering with none.
    max_wait: PositiveDuration = 30.0
    # A peer must say hello (and authenticate) within this long; and how many connections are served at once.
    hello_timeout: PositiveDuration = 10.0
    max_connections: int = Field(default=256, ge=1, le=100_000)

    @model_validator(mode="after")
    def _addresses(self) -> WorkersConfig:
        for address in self.listen:
            if not (address.startswith("tcp://") or address.startswith("unix://")):
                raise ValueError("a listen address must start with tcp:// or unix://")
        return self


class AdminAuth(_Model):
    keys: dict[str, Secret] = Field(min_length=1)
    # The key the CLI signs with; the first key when unset.
    signing_key: str | None = None
    max_skew: PositiveDuration = 300.0

    @model_validator(mode="after")
    def _signing_key_known(self) -> AdminAuth:
        if self.signing_key is not None and self.signing_key not in self.keys:
            # Its value is not shown: a key pasted here by mistake is a secret.
            raise ValueError(f"signing_key names no key of keys (its ids: {', '.join(map(repr, self.keys))})")
        return self

    @model_validator(mode="after")
    def _keys_long_enough(self) -> AdminAuth:
        # SPEC §7.5: a key shorter than 32 bytes is a configuration error. The message names the key, never its value.
        short = [k for k, v in self.keys.items() if len(v.get_secret_value().encode("utf-8")) < MIN_ADMIN_KEY_BYTES]
        if short:
            raise ValueError(f"admin key(s) {', '.join(map(repr, short))} shorter than {MIN_ADMIN_KEY_BYTES} bytes "
                             "(use e.g. `openssl rand -hex 32`)")
        return self

    def key(self, key_id: str) -> bytes | None:
        secret = self.keys.get(key_id)
        return None if secret is None else secret.get_secret_value().encode("utf-8")


class AdminConfig(_Model):
    topic: str = "rdq.admin"
    reply_topic: str = "rdq.admin.replies"
    # Running without signatures must be said explicitly: `auth: none`.
    auth: AdminAuth | Literal["none"]


class TelemetryConfig(_Model):
    tracing: Literal["none", "console", "otlp"] = "none"
    otlp_endpoint: str | None = None
    # The sampler is parent-based: a record that carries a traceparent is traced when its producer sampled it
    # (flag 01) and not otherwise; a record without one starts a trace sampled with this probability. An
    # unsampled record builds no span and no span attribute.
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)
    host: str = "127.0.0.1"
    port: int | None = Field(default=None, ge=0, le=65535)


class EngineConfig(_Model):
    instance_id: str | None = None
    # Bridge processes under one supervisor (bridge/supervisor): each a member of the consumer group with its own
    # store file, transactional id and instance id `<id>-<i>`. `auto`: one per core this process may run on
    # (affinity, or a cgroup's CPU quota rounded up where lower: bridge/config/cores.py).
    processes: Annotated[int, Field(ge=1, le=256, strict=True)] | Literal["auto"] = 1
    sweep_interval: PositiveDuration = 1.0
    grace_period: Duration = 10.0
    handler_modules: list[str] = Field(default_factory=lambda: ["handlers"])

    @property
    def stop_budget(self) -> float:
        """How long a graceful stop may take in all: the running handlers' grace period, the lanes' drain (a
        grace period again) and the last changelog flush. A part still stopping then is named with its stack
        and cancelled (bridge/engine/core.py), so a stop always ends; a supervisor kills a child 5 s later."""
        return 2 * self.grace_period + 25.0


class BridgeConfig(_Model):
    kafka: KafkaConfig
    store: StoreConfig = Field(default_factory=StoreConfig)
    queues: dict[str, QueueConfig] = Field(min_length=1)
    admin: AdminConfig | None = None
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    workers: WorkersConfig | None = None

    @model_validator(mode="after")
    def _remote_needs_workers(self) -> BridgeConfig:
        for name, queue in self.queues.items():
            if queue.remote and queue.http is not None:
                raise ValueError(f"queue {name!r}: a handler is remote or http, not both")
            if queue.remote and self.workers is None:
                raise ValueError(f"queue {name!r} is remote but there is no `workers` section to serve it")
        return self

    @model_validator(mode="after")
    def _one_queue_per_source(self) -> BridgeConfig:
        owner: dict[str, str] = {}
        for name, queue in self.queues.items():
            for topic in queue.sources:
                if topic in owner:
                    raise ValueError(f"source topic {topic!r} is claimed by queues {owner[topic]!r} and {name!r}")
                owner[topic] = name
        return self

    def file_tree(self) -> dict[str, Any]:
        """The config as a YAML/JSON tree that loads back as this config, secrets included (to write a file)."""
        return self.model_dump(mode="json", exclude_none=True, context={"reveal_secrets": True})

    def dlq_topic(self, queue: str) -> str:
        return self.queues[queue].dlq_topic or f"{queue}.dlq"

    def changelog_topic(self, source_topic: str) -> str:
        """The changelog of one source topic: named after the group too, so two groups never share one."""
        name = f"{self.kafka.group_id}-{source_topic}-rdq-changelog"
        return re.sub(r"[^a-zA-Z0-9._-]", "_", name)[:249]

    def source_topics(self) -> list[str]:
        return list(dict.fromkeys(t for q in self.queues.values() for t in q.sources))

    def queue_for_topic(self, topic: str) -> str | None:
        for name, queue in self.queues.items():
            if topic in queue.sources:
                return name
        return None

    def topics(self) -> list[str]:
        """Every topic the bridge reads or writes: sources, DLQs, admin and replies."""
        names: list[str] = []
        for name, queue in self.queues.items():
            names += [*queue.sources, self.dlq_topic(name)]
        if self.admin is not None:
            names += [self.admin.topic, self.admin.reply_topic]
        return list(dict.fromkeys(names))
