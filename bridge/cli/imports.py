"""`rdq import --topic T --queue Q`: another system's dead-letter topic → DEAD tasks of queue Q (SPEC §13).

The CLI walks the topic's partitions in ranges of records and sends one signed `import` command per range; the
bridges read the range themselves and each keeps the tasks whose home it owns (without a changelog: the one
instance named, `--instance` or the first by name). `--rate` paces it (records/s); `--dry-run` says what would be
imported and refused. The summary counts tasks imported, already there (an import run twice makes no second task),
refused with the reason, and records no instance took (their home partition unowned right now: run it again).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from typing import Any, TextIO

from confluent_kafka import Consumer, KafkaException, TopicPartition

from bridge.admin.protocol import IMPORT_RANGE_MAX
from bridge.config import BridgeConfig, ConfigError
from bridge.kafka_clients import KAFKA_LOG

DEFAULT_RATE = 1000.0  # records/s: an import makes DEAD tasks (nothing runs), but writes the store and changelog
UNCLAIMED = 7  # exit code: some records were taken by no instance


def watermarks(config: BridgeConfig, topic: str) -> dict[int, tuple[int, int]]:
    consumer = Consumer({"bootstrap.servers": config.kafka.bootstrap_servers, "logger": KAFKA_LOG,
                         "group.id": f"rdq-import-{uuid.uuid4().hex}", **config.kafka.client})
    try:
        metadata = consumer.list_topics(topic, timeout=15).topics.get(topic)
        if metadata is None or metadata.error is not None or not metadata.partitions:
            raise ConfigError(f"topic {topic!r} is not available: {metadata.error if metadata else 'no metadata'}")
        return {p: _offsets(consumer, topic, p) for p in sorted(metadata.partitions)}
    finally:
        consumer.close()


def _offsets(consumer: Consumer, topic: str, partition: int, within: float = 15.0) -> tuple[int, int]:
    """A partition's low and high offsets. A partition without a leader yet (a topic just created, a broker
    restarting: _UNKNOWN_PARTITION, NOT_LEADER) is asked again within `within` seconds, then a one-line error."""
    deadline = time.monotonic() + within
    while True:
        try:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=within)
            return int(low), int(high)
        except KafkaException as e:
            if time.monotonic() > deadline:
                raise ConfigError(f"topic {topic!r} partition {partition}: its offsets cannot be read: "
                                  f"{e.args[0].str() if e.args else e}") from e
            time.sleep(0.5)


class Import:
    def __init__(self, session: Any, config: BridgeConfig, args: argparse.Namespace, out: TextIO = sys.stdout,
                 err: TextIO = sys.stderr) -> None:
        self.session = session
        self.config = config
        self.args = args
        self.out = out
        self.err = err
        self.totals: dict[str, Any] = {"records": 0, "imported": 0, "exists": 0, "refused": 0, "unclaimed": 0,
                                       "filtered": 0, "formats": {}}
        self.refusals: list[dict[str, Any]] = []
        self.problems: list[str] = []

    def _ask(self, command: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
        final: list[dict[str, Any]] = self.session.request(command, payload, self.args.timeout,
                                                           self.args.instances).final
        return final

    def run(self) -> int:
        ranges = watermarks(self.config, self.args.topic)
        instance = self._importer()
        began = time.monotonic()
        for partition, (low, high) in ranges.items():
            step = max(1, min(IMPORT_RANGE_MAX, int(self.args.rate)))
            for start in range(low, high, step):
                end = min(high, start + step)
                self._range(partition, start, end, instance)
                done = self.totals["records"]
                wait = began + done / self.args.rate - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if self.err.isatty() and not self.args.json:
                    print(f"\rimport: partition {partition} offset {end}/{high} · {done} records",
                          end="", file=self.err, flush=True)
        if self.err.isatty() and not self.args.json:
            print(file=self.err)
        self.totals["seconds"] = round(time.monotonic() - began, 3)
        return self._finish()

    def _importer(self) -> str | None:
        """None with a changelog (every instance keeps its own); else the instance that imports everything."""
        replies = [r for r in self._ask("stats", {}) if r.get("ok")]
        if not replies:
            raise ConfigError("no bridge instance answered: is the bridge running with this config's admin topic?")
        if any("changelog" in r["result"] for r in replies):
            return None
        chosen: str = self.args.instance or sorted(str(r["instance"]) for r in replies)[0]
        return chosen

    def _range(self, partition: int, start: int, end: int, instance: str | None) -> None:
        payload = {"topic": self.args.topic, "partition": partition, "from_offset": start, "to_offset": end,
                   "queue": self.args.queue, "dry_run": self.args.dry_run,
                   **({"error_type": self.args.error_type} if self.args.error_type else {}),
                   **({"instance": instance} if instance else {})}
        replies = self._ask("import", payload)
        answered = [r for r in replies if r.get("ok")]
        for r in replies:
            if not r.get("ok") and r.get("error", {}).get("type") != "rdq.admin.NotChosen":
                self.problems.append(f"{r.get('instance')}: {r['error']['type']}: {r['error']['message']}")
        if not answered:
            self.problems.append(f"{self.args.topic}/{partition} [{start}, {end}): no instance answered")
            self.totals["unclaimed"] += end - start
            return
        read = max(int(r["result"]["read"]) for r in answered)
        refused = {x["offset"]: x["reason"] for r in answered for x in r["result"]["refused"]}
        imported = sum(int(r["result"]["imported"]) for r in answered)
        exists = sum(int(r["result"]["exists"]) for r in answered)
        filtered = max(int(r["result"].get("filtered", 0)) for r in answered)  # every reader filters the same
        self.totals["records"] += read
        self.totals["imported"] += imported
        self.totals["exists"] += exists
        self.totals["refused"] += len(refused)
        self.totals["filtered"] += filtered
        self.totals["unclaimed"] += max(0, read - imported - exists - len(refused) - filtered)
        for r in answered:
            for kind, n in r["result"]["formats"].items():
                self.totals["formats"][kind] = self.totals["formats"].get(kind, 0) + n
        self.refusals += [{"partition": partition, "offset": o, "reason": why} for o, why in sorted(refused.items())]

    def _finish(self) -> int:
        t = self.totals
        if self.args.json:
            print(json.dumps({"topic": self.args.topic, "queue": self.args.queue, "dry_run": self.args.dry_run,
                              **t, "refusals": self.refusals, "problems": self.problems}, indent=2), file=self.out)
        else:
            verb = "would import" if self.args.dry_run else "imported"
            formats = ", ".join(f"{k} {v}" for k, v in sorted(t["formats"].items())) or "none"
            lines = [f"{self.args.topic} → queue {self.args.queue}: {t['records']} records read in {t['seconds']}s",
                     f"{verb}: {t['imported']} ({formats}) · already there: {t['exists']} · refused: {t['refused']}"
                     f" · taken by no instance: {t['unclaimed']}"
                     + (f" · other error types: {t['filtered']}" if self.args.error_type else "")]
            lines += [f"  refused {r['partition']}/{r['offset']}: {r['reason']}" for r in self.refusals[:50]]
            if len(self.refusals) > 50:
                lines.append(f"  … and {len(self.refusals) - 50} more (--json lists them all)")
            lines += [f"  {p}" for p in self.problems]
            if t["unclaimed"]:
                lines.append("some records were taken by no instance (their home partition has no owner right now, "
                             "or an instance did not answer): run the same import again; imported ones are skipped")
            print("\n".join(lines), file=self.out)
        return UNCLAIMED if t["unclaimed"] or self.problems else 0
