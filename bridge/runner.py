"""Run one handler on one context and say what happened: the piece shared by first delivery and retries."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import traceback
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from bridge.config import ErrorsConfig
from bridge.handler_api import HandlerContext, LeaseLost, Retry
from bridge.model import ErrorInfo, Outcome
from bridge.policy import classify
from bridge.registry import Handler

_STACK_LIMIT = 16_000


@dataclass(frozen=True)
class RunOutcome:
    outcome: Outcome
    error: ErrorInfo | None = None
    requested_delay: float | None = None
    lease_lost: bool = False

    @property
    def ok(self) -> bool:
        return self.outcome == Outcome.SUCCESS


SUCCESS = RunOutcome(Outcome.SUCCESS)


def error_info(exc: BaseException) -> ErrorInfo:
    stack = "".join(traceback.format_exception(exc))[-_STACK_LIMIT:]
    return ErrorInfo.from_exception(exc, stack)


async def start_handler(handler: Handler, ctx: HandlerContext, executor: Executor | None) -> asyncio.Future[None]:
    """Start the handler: async ones as a task on the loop, sync ones in the thread pool."""
    loop = asyncio.get_running_loop()
    if handler.is_async:
        return asyncio.ensure_future(handler.fn(ctx))  # type: ignore[arg-type]
    # run_in_executor does not carry context variables: copy them, so the attempt's span is current in the thread.
    call: Callable[[], Any] = functools.partial(contextvars.copy_context().run, handler.fn, ctx)
    return loop.run_in_executor(executor, call)


def outcome_of(running: asyncio.Future[None], errors: ErrorsConfig) -> RunOutcome:
    """Classify a finished handler future (SPEC §4.3): explicit Retry/Permanent first, then `errors`."""
    if running.cancelled():
        return RunOutcome(Outcome.RETRYABLE_FAILURE, ErrorInfo("rdq.Cancelled", "the attempt was cancelled"),
                          lease_lost=True)
    exc = running.exception()
    if exc is None:
        return SUCCESS
    if isinstance(exc, LeaseLost):
        return RunOutcome(Outcome.RETRYABLE_FAILURE, error_info(exc), lease_lost=True)
    delay = exc.after if isinstance(exc, Retry) else None
    return RunOutcome(classify(exc, errors), error_info(exc), delay)
