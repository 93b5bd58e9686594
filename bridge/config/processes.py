"""`engine.processes`: one bridge per core under a supervisor (bridge/supervisor). Each child reads the same file
and makes it its own, here, so that a reload in a child derives the same config as its start did:

- instance id `<id>-<i>`, `<id>` being `engine.instance_id`, or this host and store file when unset (two
  supervisors on one host, each with its own store, never share a child's transactional id);
- store file `<stem>-<i><suffix>` beside the configured one (`rdq.db` → `rdq-0.db`), `store.max_size_mb` split
  evenly between the children (the volume is shared);
- `/metrics`, `/healthz`, `/readyz` on a port of its own on 127.0.0.1 (the supervisor serves the configured one);
- a static member's `group.instance.id` suffixed `-<i>` (two members with one id fence each other);
- remote workers' listen addresses: tcp port `+ i` (0 stays 0), unix socket `<stem>-<i><suffix>`.

The supervisor tells a child which it is through the environment (`RDQ_CHILD`, JSON); that name has no `__`, so
it is not read as a config override.
"""

from __future__ import annotations

import hashlib
import json
import socket
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from bridge.config.cores import cores
from bridge.config.models import BridgeConfig, ConfigError

CHILD_ENV = "RDQ_CHILD"


@dataclass(frozen=True)
class ChildSpec:
    """Which child this process is, and the pipes to its supervisor (file descriptors inherited at spawn)."""

    index: int
    count: int
    lifeline_fd: int | None = None  # read end: end of file when the supervisor is gone
    report_fd: int | None = None  # write end: JSON lines to the supervisor (the health port once bound)

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_env(environ: Mapping[str, str]) -> ChildSpec | None:
        raw = environ.get(CHILD_ENV)
        if not raw:
            return None
        try:
            spec = ChildSpec(**json.loads(raw))
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{CHILD_ENV} is not a child's description (set by the supervisor): {e}") from None
        if not 0 <= spec.index < spec.count:
            raise ConfigError(f"{CHILD_ENV}: index {spec.index} is not one of {spec.count} processes")
        return spec


def process_count(config: BridgeConfig) -> int:
    """`engine.processes`, with `auto` as the cores this process may run on."""
    wanted = config.engine.processes
    return cores() if wanted == "auto" else wanted


def core_to_spare(environ: Mapping[str, str]) -> bool:
    """More cores than bridge processes here (this one, or a supervisor's children): a helper process of a
    bridge's (the changelog's outbox read) then runs beside them rather than taking a sibling's core."""
    try:
        spec = ChildSpec.from_env(environ)
    except ConfigError:
        return False
    return cores() > (spec.count if spec is not None else 1)


def base_identity(config: BridgeConfig) -> str:
    if config.engine.instance_id:
        return config.engine.instance_id
    where = hashlib.sha256(str(config.store.path.resolve()).encode()).hexdigest()[:8]
    return f"{socket.gethostname()}-{where}"


def _numbered(path: Path, index: int) -> Path:
    return path.with_name(f"{path.stem}-{index}{path.suffix}")


def _listen_address(address: str, index: int) -> str:
    if address.startswith("unix://"):
        return "unix://" + str(_numbered(Path(address[len("unix://"):]), index))
    host, _, port = address[len("tcp://"):].rpartition(":")
    return f"tcp://{host}:{int(port) + index if int(port) else 0}"


def child_config(config: BridgeConfig, index: int, count: int) -> BridgeConfig:
    """The config of child `index` of `count` (see the module's text)."""
    store = config.store.model_copy(update={
        "path": _numbered(config.store.path, index),
        "max_size_mb": None if config.store.max_size_mb is None else config.store.max_size_mb / count,
    })
    engine = config.engine.model_copy(update={"instance_id": f"{base_identity(config)}-{index}", "processes": 1})
    update: dict[str, object] = {"store": store, "engine": engine}
    if config.telemetry.port is not None:
        update["telemetry"] = config.telemetry.model_copy(update={"host": "127.0.0.1", "port": 0})
    static = config.kafka.consumer.get("group.instance.id")
    if static is not None:
        consumer = {**config.kafka.consumer, "group.instance.id": f"{static}-{index}"}
        update["kafka"] = config.kafka.model_copy(update={"consumer": consumer})
    if config.workers is not None:
        listen = [_listen_address(a, index) for a in config.workers.listen]
        update["workers"] = config.workers.model_copy(update={"listen": listen})
    return config.model_copy(update=update)


def as_child(config: BridgeConfig, environ: Mapping[str, str]) -> BridgeConfig:
    """The config this process runs: a supervisor's child makes the file's its own; any other process keeps it."""
    spec = ChildSpec.from_env(environ)
    return config if spec is None else child_config(config, spec.index, spec.count)
