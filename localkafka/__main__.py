"""`python -m localkafka fetch | start | dev` — the local-broker tooling behind `make run` and `make test`.

- fetch: resolve the broker jars into the cache (a second call reuses it) and print the folder.
- start: run a broker in the foreground until Ctrl-C / SIGTERM; prints its bootstrap address.
- dev:   start a broker (unless KAFKA_BOOTSTRAP_SERVERS or RDQ_KAFKA__BOOTSTRAP_SERVERS names one), create the
         config's topics with `rdq topics`, run `rdq run` in the foreground; Ctrl-C or SIGTERM stops the bridge,
         then the broker.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from localkafka.broker import BrokerError, LocalBroker, free_port, resolve_jars


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _wait_for_signal() -> None:
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    while not stop:
        time.sleep(0.2)


def cmd_fetch(args: argparse.Namespace) -> int:
    began = time.monotonic()
    libs = resolve_jars()
    print(f"{libs} ({time.monotonic() - began:.1f}s)")
    return 0


def cmd_start(args: argparse.Namespace) -> int:
    broker = LocalBroker(Path(args.dir) if args.dir else None, port=args.port).start()
    print(f"kafka {broker.bootstrap_servers} started in {broker.startup_seconds:.1f}s (logs: {broker.log_path})")
    sys.stdout.flush()
    try:
        _wait_for_signal()
    finally:
        broker.stop()
    return 0


def _start_dev_broker(args: argparse.Namespace) -> LocalBroker:
    port = args.port if _port_free(args.port) else free_port()
    if port != args.port:
        print(f"port {args.port} is taken; the local broker uses {port}")
    broker = LocalBroker(Path(args.dir), port=port, controller_port=free_port())
    broker.start()
    print(f"kafka {broker.bootstrap_servers} started in {broker.startup_seconds:.1f}s (logs: {broker.log_path})")
    return broker


def _run_bridge(config: str, env: dict[str, str]) -> int:
    """`rdq topics`, then `rdq run` until it ends. The bridge runs in its own session, so only this launcher
    receives a terminal's Ctrl-C or a SIGTERM (from `make`, which forwards SIGTERM to its child, or from
    `kill`), and passes each one on exactly once: the first stops the bridge gracefully, a second forces it.
    (Had the bridge shared the terminal's process group, one Ctrl-C would reach it twice: once from the
    terminal, once forwarded — a forced exit.)"""
    rdq = [sys.executable, "-m", "bridge.cli"]
    subprocess.run([*rdq, "topics", "--config", config], env=env, check=True)
    child = subprocess.Popen([*rdq, "run", "--config", config], env=env, start_new_session=True)

    def forward(signum: int, frame: object) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def cmd_dev(args: argparse.Namespace) -> int:
    env = dict(os.environ)
    configured = env.get("RDQ_KAFKA__BOOTSTRAP_SERVERS") or env.get("KAFKA_BOOTSTRAP_SERVERS")
    broker = None if configured else _start_dev_broker(args)
    env["RDQ_KAFKA__BOOTSTRAP_SERVERS"] = configured or (broker.bootstrap_servers if broker else "")
    try:
        return _run_bridge(args.config, env)
    finally:
        if broker is not None:
            print("stopping the local kafka broker")
            broker.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m localkafka", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch", help="resolve the broker jars into the cache").set_defaults(fn=cmd_fetch)
    start = sub.add_parser("start", help="run a broker in the foreground")
    start.add_argument("--port", type=int, default=None)
    start.add_argument("--dir", default=None, help="work folder (data and logs); a temporary one by default")
    start.set_defaults(fn=cmd_start)
    dev = sub.add_parser("dev", help="broker + topics + `rdq run` in the foreground")
    dev.add_argument("--config", default="config/bridge.yaml")
    dev.add_argument("--port", type=int, default=9092)
    dev.add_argument("--dir", default=".rdq/kafka", help="broker data and logs, kept between runs")
    dev.set_defaults(fn=cmd_dev)
    args = parser.parse_args(argv)
    try:
        return int(args.fn(args))
    except BrokerError as e:
        print(f"local kafka: {e}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as e:
        print(f"local kafka: {e}", file=sys.stderr)
        return e.returncode or 1


if __name__ == "__main__":
    sys.exit(main())
