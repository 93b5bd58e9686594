"""A fault-injecting TCP proxy in front of a real broker, reading the Kafka protocol's framing.

Every client connection (and the broker's own, when it advertises the proxy) goes through it. It forwards bytes
as they are and can hold back the broker's answer to one kind of request: an EndTxn (the commit or abort of a
transaction) after a Produce to a given topic — the broker has done the work, the client does not hear of it in
time (`commit_transaction` times out while the broker committed).

Framing: a request is a 4-byte length and then api_key (int16), api_version (int16), correlation_id (int32), …; a
response is a 4-byte length and then the correlation_id (int32), …
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time

_PRODUCE = 0
_END_TXN = 26


class KafkaProxy:
    def __init__(self, target_port: int, port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.port = port
        self._server = socket.create_server(("127.0.0.1", port), reuse_port=False)
        self._lock = threading.Lock()
        self._hold_topic: bytes | None = None
        self._hold_seconds = 0.0
        self._armed = False  # a Produce to the topic was seen: the next EndTxn's answer is held back
        self._held: set[tuple[int, int]] = set()  # (connection, correlation id) of EndTxn answers to hold
        self.held_answers = 0
        self._closed = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="kafka-proxy").start()

    def hold_commit_after_produce_to(self, topic: str, seconds: float) -> None:
        """The next transaction that writes to `topic`: its EndTxn answer reaches the client `seconds` late."""
        with self._lock:
            self._hold_topic, self._hold_seconds, self._armed = topic.encode(), seconds, False

    def close(self) -> None:
        self._closed = True
        for sock in [self._server, *self._sockets]:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:  # the broker is not up yet: the client retries
                client.close()
                continue
            self._sockets += [client, upstream]
            conn = id(client)
            threading.Thread(target=self._requests, args=(conn, client, upstream), daemon=True).start()
            threading.Thread(target=self._responses, args=(conn, upstream, client), daemon=True).start()

    @staticmethod
    def _frame(sock: socket.socket) -> bytes | None:
        head = _read(sock, 4)
        if head is None:
            return None
        body = _read(sock, struct.unpack(">i", head)[0])
        return None if body is None else head + body

    def _requests(self, conn: int, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while (frame := self._frame(src)) is not None:
                api_key, _, correlation = struct.unpack(">hhi", frame[4:12])
                with self._lock:
                    if api_key == _PRODUCE and self._hold_topic is not None and self._hold_topic in frame:
                        self._armed = True
                    elif api_key == _END_TXN and self._armed:
                        self._held.add((conn, correlation))
                        self._armed, self._hold_topic = False, None
                dst.sendall(frame)
        _shut(src, dst)

    def _responses(self, conn: int, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while (frame := self._frame(src)) is not None:
                (correlation,) = struct.unpack(">i", frame[4:8])
                with self._lock:
                    hold = (conn, correlation) in self._held
                    self._held.discard((conn, correlation))
                if hold:
                    self.held_answers += 1
                    time.sleep(self._hold_seconds)
                dst.sendall(frame)
        _shut(src, dst)


def _read(sock: socket.socket, n: int) -> bytes | None:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _shut(*socks: socket.socket) -> None:
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
