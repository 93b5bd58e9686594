"""The live configuration: reloaded on SIGHUP and on file change; a reload that fails keeps the old one.

Queue policies are read from here at the moment they are needed (claim, outcome, sweep), so a queue retuned
mid-incident applies to tasks already queued (SPEC §2). Operator overrides (admin `set-policy`) layer on top.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from bridge.config import BridgeConfig, ConfigError, QueueConfig, describe_error, load_config

log = logging.getLogger(__name__)


class LiveConfig:
    def __init__(self, config: BridgeConfig, path: Path | None = None) -> None:
        self._config = config
        self.path = path
        self._mtime = self._stat()
        self._overrides: dict[str, dict[str, Any]] = {}
        self._effective: dict[str, QueueConfig] = {}
        self._rebuild()

    @property
    def current(self) -> BridgeConfig:
        return self._config

    def queue(self, name: str) -> QueueConfig | None:
        return self._effective.get(name)

    def queue_names(self) -> list[str]:
        return list(self._effective)

    def set_override(self, queue: str, policy: dict[str, Any] | None) -> QueueConfig:
        """Layer operator settings over a queue's config; validated like the file. Raises ConfigError."""
        base = self._config.queues.get(queue)
        if base is None:
            raise ConfigError(f"no queue named {queue!r} in the configuration")
        if policy:
            try:
                merged = QueueConfig.model_validate({**base.model_dump(exclude_unset=True), **policy})
            except ValidationError as e:
                raise ConfigError(describe_error(e, f"policy of queue {queue!r}")) from e
            self._overrides[queue] = policy
        else:
            merged = base
            self._overrides.pop(queue, None)
        self._effective[queue] = merged
        return merged

    def _rebuild(self) -> None:
        effective = {}
        for name, queue in self._config.queues.items():
            policy = self._overrides.get(name)
            try:
                effective[name] = QueueConfig.model_validate({**queue.model_dump(exclude_unset=True), **policy}) \
                    if policy else queue
            except ValueError as e:
                log.warning("override of queue %s no longer validates; using the file's policy: %s", name, e)
                effective[name] = queue
        self._effective = effective

    def _stat(self) -> float | None:
        try:
            return self.path.stat().st_mtime if self.path else None
        except OSError:
            return None

    def reload(self) -> bool:
        """Re-read the file. On any error keep the running config and log why; True when it changed."""
        if self.path is None:
            return False
        self._mtime = self._stat()
        try:
            fresh = load_config(self.path)
        except ConfigError as e:
            log.error("config reload failed; keeping the running configuration:\n%s", e)
            return False
        if fresh.kafka != self._config.kafka or fresh.store != self._config.store:
            log.warning("config reload: kafka and store settings apply at the next restart only")
            fresh = fresh.model_copy(update={"kafka": self._config.kafka, "store": self._config.store})
        self._config = fresh
        self._rebuild()
        log.info("configuration reloaded from %s", self.path)
        return True

    async def watch(self, stop: asyncio.Event, interval: float = 1.0) -> None:
        """Reload when the file's modification time changes."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
            if self.path is not None and self._stat() != self._mtime:
                self.reload()
