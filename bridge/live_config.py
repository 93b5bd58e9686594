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

from bridge.config import (
    POLICY_FIELDS,
    BridgeConfig,
    ConfigError,
    QueueConfig,
    deep_merge,
    load_config,
    parse_config,
    restart_only_changes,
)

log = logging.getLogger(__name__)


class LiveConfig:
    def __init__(self, config: BridgeConfig, path: Path | None = None) -> None:
        self._config = config
        self.path = path
        self._mtime = self._stat()
        self._overrides: dict[str, dict[str, Any]] = {}
        self._effective: dict[str, QueueConfig] = {}
        self._reloading: asyncio.Future[bool] | None = None
        self._rebuild()

    @property
    def current(self) -> BridgeConfig:
        return self._config

    def queue(self, name: str) -> QueueConfig | None:
        return self._effective.get(name)

    def queue_names(self) -> list[str]:
        return list(self._effective)

    def set_override(self, queue: str, policy: dict[str, Any] | None) -> QueueConfig:
        """Layer an operator's retry policy over a queue's config (deep-merged), validated as the whole file
        would be. Only retry-policy fields (POLICY_FIELDS); raises ConfigError naming what is wrong."""
        base = self._config.queues.get(queue)
        if base is None:
            raise ConfigError(f"no queue named {queue!r} in the configuration")
        if policy:
            others = sorted(set(policy) - POLICY_FIELDS)
            if others:
                raise ConfigError(f"set-policy changes only the retry policy ({', '.join(sorted(POLICY_FIELDS))}); "
                                  f"not {', '.join(others)}")
            merged = self._merged(queue, base, policy)
            self._overrides[queue] = policy
        else:
            merged = base
            self._overrides.pop(queue, None)
        self._effective[queue] = merged
        return merged

    def _merged(self, name: str, base: QueueConfig, policy: dict[str, Any]) -> QueueConfig:
        """The queue with `policy` deep-merged in, checked with every rule of the config (cross-field ones too)."""
        reveal = {"reveal_secrets": True}  # the tree is parsed again, not shown
        tree = self._config.model_dump(mode="json", exclude_unset=True, context=reveal)
        tree["queues"][name] = deep_merge(base.model_dump(mode="json", exclude_unset=True, context=reveal), policy)
        return parse_config(tree, f"policy of queue {name!r}").queues[name]

    @staticmethod
    def policy_of(queue: QueueConfig) -> dict[str, Any]:
        """A queue's effective retry policy (what set-policy answers with: never handler URLs or headers)."""
        policy = queue.model_dump(mode="json", include=set(POLICY_FIELDS))
        policy["backoff"]["jitter"] = queue.backoff.effective_jitter
        return policy

    def _rebuild(self) -> None:
        effective = {}
        for name, queue in self._config.queues.items():
            policy = self._overrides.get(name)
            try:
                effective[name] = self._merged(name, queue, policy) if policy else queue
            except ConfigError as e:
                log.warning("override of queue %s no longer validates; using the file's policy: %s", name, e)
                effective[name] = queue
        self._effective = effective

    def _stat(self) -> float | None:
        try:
            return self.path.stat().st_mtime if self.path else None
        except OSError:
            return None

    async def reload(self) -> bool:
        """Re-read the file (off the event loop). Applied only when it is valid and changes nothing but queues'
        retry policies; otherwise the running config stays and the log says why. True when it was applied."""
        if self.path is None:
            return False
        self._mtime = self._stat()
        try:
            fresh = await asyncio.to_thread(load_config, self.path)
        except ConfigError as e:
            log.error("config reload failed; keeping the running configuration:\n%s", e)
            return False
        needs_restart = restart_only_changes(self._config, fresh)
        if needs_restart:
            log.error("config reload refused; keeping the running configuration. These changes apply only at a "
                      "restart: %s", "; ".join(needs_restart))
            return False
        self._config = fresh
        self._rebuild()
        log.info("configuration reloaded from %s", self.path)
        return True

    def reload_soon(self) -> None:
        """For a signal handler: reload on the loop, reading the file in a thread."""
        self._reloading = asyncio.ensure_future(self.reload())  # referenced so it is not collected mid-way

    async def watch(self, stop: asyncio.Event, interval: float = 1.0) -> None:
        """Reload when the file's modification time changes."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
            if self.path is not None and await asyncio.to_thread(self._stat) != self._mtime:
                await self.reload()
