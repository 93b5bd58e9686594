"""The changelog producer's calls, on a thread of their own, each with a deadline past its own timeout.

librdkafka does not always return by its timeout: `send_offsets_to_transaction` can block for ever after the
coordinator went away and came back (confluentinc/librdkafka#5456, open in 2.16: a coordinator request's
timeout is never checked). Seen here after a broker restart under load: the writer's thread blocked, no round
ever ended, every dead task waited for a DLQ publish that never came, and the stop hung on it. A call past its
deadline is abandoned with its thread (a daemon: it cannot keep the process from exiting) and reported as a
fatal error, so the writer replaces the producer; the new one's `init_transactions` fences the old one, whose
open transaction the broker aborts. The commit is a call of its own after the send, so an abandoned send never
commits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from bridge.aio import OneThread

log = logging.getLogger(__name__)
WEDGED_AFTER = 20.0  # beyond a call's own timeout: librdkafka did not return, it will not


class ProducerCalls:
    def __init__(self, name: str) -> None:
        self._name = name
        self._thread = OneThread(name)
        self.abandoned = 0  # calls given up on, each with its thread

    async def call(self, within: float, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the producer's thread; `within`: the timeout `fn` itself was given."""
        running = asyncio.ensure_future(self._thread.call(fn, *args))
        done, _ = await asyncio.wait([running], timeout=within + WEDGED_AFTER)
        if done:
            return running.result()
        running.add_done_callback(_ignore_outcome)  # should it ever return, nobody waits for it
        self._thread.shutdown()  # its thread ends after the call, if the call ever ends
        self._thread = OneThread(self._name)
        self.abandoned += 1
        name = getattr(fn, "__name__", repr(fn))
        log.error("changelog producer call %s did not return within %.0f s (librdkafka #5456): abandoned with its "
                  "thread; a new producer takes over", name, within + WEDGED_AFTER)
        raise KafkaException(KafkaError(KafkaError._FATAL, f"{name} did not return within "
                                        f"{within + WEDGED_AFTER:.0f} s", fatal=True))

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False)


def _ignore_outcome(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
