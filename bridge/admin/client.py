"""The client side of the admin topic: send a signed command, gather every instance's replies."""

from __future__ import annotations

import getpass
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from bridge.admin.protocol import COMMAND_KEY, encode_command
from bridge.config import BridgeConfig
from bridge.kafka_clients import KAFKA_LOG


class AdminClientError(RuntimeError):
    pass


def default_issuer() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # no user name in this environment
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


@dataclass
class Replies:
    request_id: str
    final: list[dict[str, Any]] = field(default_factory=list)
    partial: list[dict[str, Any]] = field(default_factory=list)

    ignored: list[dict[str, Any]] = field(default_factory=list)  # unverified refusals, later duplicates

    def by_instance(self) -> dict[str, dict[str, Any]]:
        return {r.get("instance", "?"): r for r in self.final}

    def add_final(self, body: dict[str, Any], trust_unverified: bool) -> None:
        """One answer per instance. A refusal the bridge marks unverified (its record was not signed with a
        configured key, so its request_id may be forged) is not an answer to this request; nor is a second answer
        from the same instance (a replay of this very command is refused as Replayed after it ran)."""
        if body.get("verified") is False and not trust_unverified:
            self.ignored.append(body)
            return
        instance = body.get("instance")
        earlier = next((r for r in self.final if r.get("instance") == instance), None)
        if earlier is None:
            self.final.append(body)
        elif body.get("ok") and not earlier.get("ok"):
            self.final[self.final.index(earlier)] = body
            self.ignored.append(earlier)
        else:
            self.ignored.append(body)


class AdminSession:
    def __init__(self, config: BridgeConfig, issued_by: str | None = None, key_id: str | None = None) -> None:
        if config.admin is None:
            raise AdminClientError("the configuration has no `admin` section (topic, reply_topic, auth)")
        self.config = config
        self.admin = config.admin
        self.issued_by = issued_by or default_issuer()
        self.key_id = key_id
        base: dict[str, Any] = {"bootstrap.servers": config.kafka.bootstrap_servers, "logger": KAFKA_LOG,
                                **config.kafka.client}
        self._producer = Producer({**base, "acks": "all"})
        self._consumer = Consumer({**base, "group.id": f"rdq-cli-{uuid.uuid4().hex}", "enable.auto.commit": False})
        self._base = base
        self._listening = False
        self._group_size: int | None = None
        self._sent: set[bytes] = set()  # this session's request ids
        self._kept: dict[bytes, list[dict[str, Any]]] = {}  # replies read while collecting another request's
        # Requests may be sent and collected from several threads at once (the console): one reads the replies at
        # a time, and keeps those of the others' requests for them.
        self._reading = threading.Lock()
        self.poll_seconds = 0.2  # one read of the replies waits this long when fewer than a batch arrived

    def group_size(self, fresh: bool = False) -> int | None:
        """How many bridge instances there are: the members of their consumer group (`kafka.group_id`; the admin
        topic is read by assignment, outside any group). None when the broker cannot say (then only `--timeout`
        ends a request). Asked once per session, unless `fresh`."""
        if self._group_size is None or fresh:
            group = self.config.kafka.group_id
            admin = AdminClient(self._base)  # held while its future is pending: a collected client never answers
            try:
                future = admin.describe_consumer_groups([group], request_timeout=5)[group]
                self._group_size = len(future.result(timeout=10).members) or None
            except Exception:  # KafkaException, a timeout: fall back to waiting for the timeout
                self._group_size = None
        return self._group_size

    def _listen(self) -> None:
        """Assign every reply partition at its end before sending: no reply can be missed."""
        with self._reading:
            self._assign_replies()

    def _assign_replies(self) -> None:
        if self._listening:
            return
        topic = self.admin.reply_topic
        metadata = self._consumer.list_topics(topic, timeout=15).topics.get(topic)
        if metadata is None or metadata.error is not None:
            raise AdminClientError(f"reply topic {topic!r} is not available: {metadata.error if metadata else ''}")
        assignment = [TopicPartition(topic, p, self._end_of(TopicPartition(topic, p))) for p in metadata.partitions]
        self._consumer.assign(assignment)
        self._listening = True

    def _end_of(self, tp: TopicPartition, within: float = 15.0) -> int:
        """The partition's end offset; an error (a leader not elected yet, right after the topic was created; a
        leader moving) is retried within `within` seconds, then said in one line (a CLI run in a broker's restart
        ended in a traceback)."""
        deadline = time.monotonic() + within
        while True:
            try:
                return int(self._consumer.get_watermark_offsets(tp, timeout=within)[1])
            except KafkaException as e:  # e.g. NOT_LEADER_FOR_PARTITION, which librdkafka does not flag retriable
                if time.monotonic() > deadline:
                    raise AdminClientError(f"reply topic {tp.topic!r} partition {tp.partition}: its end could not "
                                           f"be read within {within:g} s: {e.args[0].str()}") from e
                time.sleep(0.2)

    def request(self, command: str, args: dict[str, Any], timeout: float = 5.0, instances: int | None = None,
                on_partial: Callable[[dict[str, Any]], None] | None = None,
                request_id: str | None = None) -> Replies:
        self._listen()
        if self.key_id is not None and self.admin.auth != "none" and self.key_id not in self.admin.auth.keys:
            raise AdminClientError(f"no key {self.key_id!r} in admin.auth.keys")
        request_id, value, headers = encode_command(command, args, self.issued_by, self.admin.auth,
                                                    request_id=request_id, key_id=self.key_id)
        self._sent.add(request_id.encode())
        self._producer.produce(self.admin.topic, value=value, key=COMMAND_KEY, headers=cast(Any, headers))
        if self._producer.flush(15) != 0:
            raise AdminClientError(f"could not send the command to {self.admin.topic!r}")
        return self.collect(Replies(request_id), timeout, instances, on_partial)

    def collect(self, replies: Replies, timeout: float = 5.0, instances: int | None = None,
                on_partial: Callable[[dict[str, Any]], None] | None = None) -> Replies:
        """Gather the replies to `replies.request_id` (more of them, when called again: e.g. the final answers of
        a bulk redrive interrupted by Ctrl-C, after its cancel). Replies to other requests of this session read
        meanwhile are kept for their own `collect`."""
        if instances is None:
            # Done as soon as every instance answered; `timeout` stays the bound (an instance not in the group
            # right now — starting, rebalancing — may still answer within it when the count is unknown).
            instances = self.group_size()
        wanted = replies.request_id.encode()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (instances is None or len(replies.final) < instances):
            with self._reading:
                kept = self._kept.pop(wanted, [])
                bodies = kept or [json.loads(m.value() or b"{}") for m in self._read(wanted)]
            for body in bodies:
                if body.get("partial"):
                    replies.partial.append(body)
                    if on_partial:
                        on_partial(body)
                    deadline = max(deadline, time.monotonic() + timeout)  # progress keeps it alive
                else:
                    replies.add_final(body, trust_unverified=self.admin.auth == "none")
        return replies

    def _read(self, wanted: bytes) -> list[Any]:
        """One poll: the replies to `wanted`; those to this session's other requests are kept."""
        mine = []
        for msg in self._consumer.consume(100, self.poll_seconds):
            if msg.error() is not None:
                continue
            key = msg.key()
            if key == wanted:
                mine.append(msg)
            elif key in self._sent:
                self._kept.setdefault(key, []).append(json.loads(msg.value() or b"{}"))
        return mine

    def close(self) -> None:
        self._consumer.close()
        self._producer.flush(5)
