"""The console's admin client: the CLI's signed session (`AdminSession`), asked from the event loop, with a memory
of which instances answered before — an instance that stops answering is shown as such, never waited for."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaException

from bridge.admin.client import AdminClientError, AdminSession, Replies
from bridge.config import BridgeConfig

ASK_TIMEOUT = 3.0  # seconds a page waits for instances that do not answer
GROUP_FRESH = 15.0  # seconds the group's member count is trusted
FORGET_AFTER = 600.0  # an instance silent this long is no longer listed as not answering (scaled down, renamed)


@dataclass
class Answers:
    """Every instance's final reply to one request, and who was expected but did not answer."""

    replies: list[dict[str, Any]]
    missing: list[str] = field(default_factory=list)
    members: int | None = None
    problem: str | None = None  # the request could not even be sent (the broker unreachable, no reply topic)

    def ok(self) -> list[dict[str, Any]]:
        return [r for r in self.replies if r.get("ok")]

    def errors(self) -> list[dict[str, Any]]:
        return [r for r in self.replies if not r.get("ok")]


class ConsoleAdmin:
    def __init__(self, config: BridgeConfig, issued_by: str, key_id: str | None = None) -> None:
        self.session = AdminSession(config, issued_by=issued_by, key_id=key_id)
        self.session.poll_seconds = 0.02  # a page waits for its replies: read them as they come
        self.seen: dict[str, float] = {}  # instance → when it last answered
        self._sized_at = 0.0
        self._members: int | None = None

    def members(self) -> int | None:
        if time.monotonic() - self._sized_at > GROUP_FRESH:
            self._members = self.session.group_size(fresh=True)
            self._sized_at = time.monotonic()
        return self._members

    def request(self, command: str, args: dict[str, Any], timeout: float = ASK_TIMEOUT, instances: int | None = None,
                on_partial: Any = None, request_id: str | None = None) -> Replies:
        """The CLI's `Session`: what BulkRedrive and Import call (from a worker thread)."""
        wanted = instances if instances is not None else self.members()
        replies = self.session.request(command, args, timeout, wanted, on_partial=on_partial, request_id=request_id)
        self._saw(replies.final)
        return replies

    def collect(self, replies: Replies, timeout: float = ASK_TIMEOUT, instances: int | None = None,
                on_partial: Any = None) -> Replies:
        return self.session.collect(replies, timeout, instances if instances is not None else self.members(),
                                    on_partial)

    def _saw(self, replies: list[dict[str, Any]]) -> None:
        now = time.monotonic()
        for r in replies:
            self.seen[str(r.get("instance", "?"))] = now

    async def ask(self, command: str, args: dict[str, Any], within: float = ASK_TIMEOUT) -> Answers:
        try:
            replies = await asyncio.to_thread(self.request, command, args, within)
        except (AdminClientError, KafkaException) as e:  # the page says so; the next one tries again
            return Answers([], sorted(self.seen), self._members, f"{type(e).__name__}: {e}")
        answered = {str(r.get("instance")) for r in replies.final}
        recent = time.monotonic() - FORGET_AFTER
        missing = sorted(i for i, at in self.seen.items() if i not in answered and at > recent)
        return Answers(replies.final, missing, self._members)

    def close(self) -> None:
        self.session.close()
