"""What one fetch of a restore brought (restore.py): each changelog partition's records in log order, then picked
by the decoder, and how far each partition was read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError

from bridge.changelog.picking import Picked, Record

Changelog = tuple[str, int]  # a changelog partition: (topic, partition)


@dataclass
class Fetched:
    """What one fetch brought: each partition's records, then picked (and their count), and how far it was read."""

    records: dict[Changelog, list[Record]] = field(default_factory=dict)
    batches: dict[Changelog, tuple[Picked, int]] = field(default_factory=dict)
    reached: dict[Changelog, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0  # reading
    decoding: float = 0.0  # the decoder's own time (a process's is not its round trip's)

    def reach(self, key: Changelog, offset: int) -> None:
        self.reached[key] = max(self.reached.get(key, -1), offset)

    def at_ends(self, ends: dict[Changelog, int]) -> bool:
        """Every partition in `ends` read to its end: nothing more is coming for them."""
        return all(self.reached.get(key, -1) >= end for key, end in ends.items())

    def take(self, messages: list[Any], ends: dict[Changelog, int]) -> None:
        """A consume's records, by partition (those of `ends` only: another was finished or given up, paused
        after its records were fetched); its end-of-partition events and errors noted."""
        records = self.records
        for msg in messages:
            key, offset = (msg.topic(), msg.partition()), msg.offset()
            if key not in ends or offset is None:
                continue
            error = msg.error()
            if error is None:
                records.setdefault(key, []).append((offset, msg.key(), msg.value()))
                self.reach(key, offset + 1)
            elif error.code() == KafkaError._PARTITION_EOF:
                self.reach(key, offset)
            else:
                self.warnings.append(f"{key[0]}/{key[1]}: {error}")
