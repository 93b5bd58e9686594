"""An example remote worker: serves the handler ref `remote-example` over the worker protocol.

    python -m handlers.remote_worker_example --address tcp://127.0.0.1:7070 --token s3cret [--name w-1]

Payload (JSON): {"ms": n} sleeps n ms heartbeating; {"ms_first": n} sleeps only on the first attempt;
{"fail": n} fails retryably on the first n attempts; {"permanent": true} fails permanently.
Each success appends a JSON line {"worker", "task_id", "attempt"} to RDQ_EXAMPLE_LOG when it names a file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

from bridge.handler_api import Permanent
from bridge.workers.client import RemoteTask, WorkerClient
from handlers.examples import append_example_log


def example(task: RemoteTask, name: str) -> None:
    data = json.loads(task.payload or b"{}")
    sleep_ms = data.get("ms", data.get("ms_first", 0) if task.attempt == 1 else 0)
    deadline = time.monotonic() + sleep_ms / 1000
    while time.monotonic() < deadline:
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        task.heartbeat()
    if data.get("permanent"):
        raise Permanent("remote-example: permanent failure requested")
    if task.attempt <= int(data.get("fail", 0)):
        raise ConnectionError(f"remote-example: attempt {task.attempt} fails")
    append_example_log({"worker": name, "task_id": task.task_id, "attempt": task.attempt})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--name", default=f"example-{os.getpid()}")
    parser.add_argument("--heartbeat", type=float, default=1.0)
    args = parser.parse_args()
    client = WorkerClient(args.address, args.token, {"remote-example": lambda t: example(t, args.name)},
                          name=args.name, heartbeat_interval=args.heartbeat, wait=5.0)
    print(json.dumps(client.connect()), flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        client.run()


if __name__ == "__main__":
    main()
