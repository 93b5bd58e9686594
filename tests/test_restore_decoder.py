"""The restore's decoding process (bridge/changelog/decoder.py): what it gives is what the restore thread would;
when it dies the batch is decoded here and nothing is lost; when its bridge is killed it does not stay behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.bench_changelog import task_record
from bridge.changelog.decoder import Decoder
from bridge.changelog.picking import Picked, Record, pick_last


def _batch() -> list[Record]:
    """Tasks with histories, a later state of one, a tombstone, an unreadable record, a NUL in an error."""
    records: list[Record] = [(i, *task_record(i, "src", 3)) for i in range(300)]
    records.append((300, *task_record(7, "src", 5)))
    records.append((301, task_record(5, "src", 1)[0], None))
    records.append((302, b"T-bad", b"{not json"))
    key, value = task_record(400, "src", 2)
    records.append((303, key, value.replace(b'"refused"', b'"re\\u0000fused"', 1)))
    return records


async def _in_thread(records: list[Record]) -> Picked:
    return pick_last(records)


async def _started(decoder: Decoder) -> None:
    decoder.start()
    assert decoder.process._started is not None
    await asyncio.wrap_future(decoder.process._started)


def test_freed_memory_can_be_given_back_here() -> None:
    """The restore's batches, freed, are returned to the system (glibc's malloc_trim, found on this Linux); a
    restore of 30,000 tasks left 215 MiB resident without it, 95 MiB with (bench_changelog restore)."""
    from bridge.memory import give_back_freed_memory

    assert give_back_freed_memory() is True


async def test_the_process_decodes_a_batch_as_the_restore_thread_does() -> None:
    records = _batch()
    decoder = Decoder(_in_thread)
    try:
        await _started(decoder)
        picked = await decoder.pick(records)
        assert decoder.batches_in_process == 1
    finally:
        decoder.close()
    here = pick_last(records)
    assert picked == here
    assert (picked.applied, picked.tombstones, len(picked.unreadable)) == (302, 1, 1)
    assert picked.last[task_record(7, "src", 1)[0].decode()].task[8] == 5  # type: ignore[union-attr]  # its last
    assert picked.last[task_record(400, "src", 1)[0].decode()].history is None  # type: ignore[union-attr]  # NUL


async def test_a_decoding_process_killed_loses_no_batch() -> None:
    records = _batch()
    decoder = Decoder(_in_thread)
    try:
        await _started(decoder)
        assert decoder.process._pool is not None
        [pid] = list(decoder.process._pool._processes)  # type: ignore[attr-defined]
        os.kill(pid, signal.SIGKILL)
        picked = await decoder.pick(records)  # decoded on the restore thread instead
        assert picked == pick_last(records) and decoder.batches_in_process == 0
        assert await decoder.pick(records[:10]) == pick_last(records[:10])  # and so is the rest of the restore
    finally:
        decoder.close()


_PARENT = """
import asyncio, json, sys, time
sys.path.insert(0, {root!r})
from bridge.changelog.decoder import Decoder

async def main():
    decoder = Decoder(None)
    decoder.start()
    await asyncio.wrap_future(decoder.process._started)
    print(json.dumps(list(decoder.process._pool._processes)), flush=True)
    time.sleep(600)

if __name__ == "__main__":
    asyncio.run(main())
"""


def test_a_bridge_killed_leaves_no_decoding_process_behind(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(_PARENT.format(root=str(Path(__file__).resolve().parents[1])))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        [worker] = json.loads(parent.stdout.readline())
        os.kill(worker, 0)  # it runs
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), "the decoding process outlived its bridge"
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) is gone too
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False
