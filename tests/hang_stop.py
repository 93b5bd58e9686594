"""A handler module for tests/test_cli_run.py: with `RDQ_HANG_STOP` set, the source consumer's graceful stop
blocks in a thread for an hour and the stop budget is 3 s, so `rdq run` has to name the stuck part, cancel it
and exit although a thread is still blocked. In any other process it changes nothing."""

from __future__ import annotations

import asyncio
import os
import time

from bridge.config.models import EngineConfig
from bridge.source.consumer import SourceConsumer


async def _blocked_in_a_client_call(self: SourceConsumer) -> None:
    await asyncio.to_thread(time.sleep, 3600)


if os.environ.get("RDQ_HANG_STOP"):
    SourceConsumer._shutdown = _blocked_in_a_client_call  # type: ignore[method-assign]
    EngineConfig.stop_budget = property(lambda self: 3.0)  # type: ignore[assignment,method-assign]
