"""Run one handler on one context and say what happened: the piece shared by first delivery and retries."""

from __future__ import annotations

import asyncio
import collections.abc
import concurrent.futures
import contextvars
import functools
import linecache
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bridge.config import ErrorsConfig
from bridge.engine.policy import classify
from bridge.engine.threads import HandlerThreads, QueuePool
from bridge.handler_api import HandlerContext, LeaseLost, Retry
from bridge.model import ErrorInfo, Outcome
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
    return ErrorInfo.from_exception(exc, format_stack(exc)[-_STACK_LIMIT:])


def format_stack(exc: BaseException) -> str:
    """The text of `traceback.format_exception(exc)`, chained exceptions included, without what makes it cost
    ~100 µs per failure: `checkcache` stats every file of every frame, and Python 3.11 parses each source line
    to place its `^^^` carets (left out here). Source lines come from linecache, read once per file."""
    parts: list[str] = []
    seen: set[int] = set()
    _format_chain(exc, parts, seen)
    return "".join(parts)


def _format_chain(exc: BaseException, parts: list[str], seen: set[int]) -> None:
    seen.add(id(exc))
    cause, context = exc.__cause__, exc.__context__
    if cause is not None and id(cause) not in seen:
        _format_chain(cause, parts, seen)
        parts.append("\nThe above exception was the direct cause of the following exception:\n\n")
    elif context is not None and not exc.__suppress_context__ and id(context) not in seen:
        _format_chain(context, parts, seen)
        parts.append("\nDuring handling of the above exception, another exception occurred:\n\n")
    if exc.__traceback__ is not None:
        parts.append("Traceback (most recent call last):\n")
        for frame, lineno in traceback.walk_tb(exc.__traceback__):
            code = frame.f_code
            parts.append(f'  File "{code.co_filename}", line {lineno}, in {code.co_name}\n')
            line = linecache.getline(code.co_filename, lineno or 0, frame.f_globals).strip()
            if line:
                parts.append(f"    {line}\n")
    parts.extend(_exception_only(exc))


def _exception_only(exc: BaseException) -> list[str]:
    """`traceback.format_exception_only(exc)` without building a `TracebackException`: that walks the chain's
    tracebacks again (a third of a failing record's handler-thread time). A SyntaxError's own layout is left to
    `traceback`."""
    kind = type(exc)
    if issubclass(kind, SyntaxError):
        return traceback.format_exception_only(exc)
    name = kind.__qualname__
    module = kind.__module__
    if module not in ("__main__", "builtins"):
        name = f"{module if isinstance(module, str) else '<unknown>'}.{name}"
    text = _safe_str(exc, "exception", str)
    lines = [f"{name}: {text}\n" if text else f"{name}\n"]
    notes = getattr(exc, "__notes__", None)
    if isinstance(notes, collections.abc.Sequence):
        for note in notes:
            lines.extend(line + "\n" for line in _safe_str(note, "note", str).split("\n"))
    elif notes is not None:
        lines.append(_safe_str(notes, "__notes__", repr))
    return lines


def _safe_str(value: object, what: str, fn: Callable[[object], str]) -> str:
    try:
        return fn(value)
    except Exception:  # what traceback prints for an exception whose str() (or a note's) raises
        return f"<{what} {fn.__name__}() failed>"


@dataclass
class Started:
    """A running handler: `future` to await; for a sync handler, also its call in the queue's thread pool."""

    future: asyncio.Future[None]
    call: concurrent.futures.Future[Any] | None = None
    pool: QueuePool | None = None

    def abandon(self, on_late_success: Callable[[], object] | None = None) -> None:
        """Give up on this run: an async handler is cancelled; a sync one cannot be, so its thread is counted
        stuck until it returns, and if it then succeeds `on_late_success` is called (from that thread)."""
        self.future.cancel()
        if self.call is None or self.pool is None or not self.pool.abandon(self.call):
            return
        if on_late_success is not None:
            def finished(call: concurrent.futures.Future[Any]) -> None:
                if not call.cancelled() and call.exception() is None:
                    on_late_success()

            self.call.add_done_callback(finished)


def start_handler(handler: Handler, ctx: HandlerContext, threads: HandlerThreads | None) -> Started:
    """Start the handler: async ones as a task on the loop, sync ones on the threads of its queue (`ctx.queue`)."""
    if handler.is_async:
        return Started(asyncio.ensure_future(handler.fn(ctx)))  # type: ignore[arg-type]
    # Threads do not inherit context variables: copy them, so the attempt's span is current in the thread.
    call: Callable[[], Any] = functools.partial(contextvars.copy_context().run, handler.fn, ctx)
    if threads is None:
        return Started(asyncio.get_running_loop().run_in_executor(None, call))
    pool = threads.pool(ctx.queue)
    running = pool.submit(call)
    return Started(asyncio.wrap_future(running), running, pool)


def outcome_of_exception(exc: BaseException, errors: ErrorsConfig) -> RunOutcome:
    """Classify a handler's exception (SPEC §4.3): explicit Retry/Permanent first, then `errors`."""
    if isinstance(exc, LeaseLost):
        return RunOutcome(Outcome.RETRYABLE_FAILURE, error_info(exc), lease_lost=True)
    delay = exc.after if isinstance(exc, Retry) else None
    return RunOutcome(classify(exc, errors), error_info(exc), delay)


def outcome_of(running: asyncio.Future[None], errors: ErrorsConfig) -> RunOutcome:
    """Classify a finished handler future (SPEC §4.3): explicit Retry/Permanent first, then `errors`."""
    if running.cancelled():
        return RunOutcome(Outcome.RETRYABLE_FAILURE, ErrorInfo("rdq.Cancelled", "the attempt was cancelled"),
                          lease_lost=True)
    exc = running.exception()
    if exc is None:
        return SUCCESS
    return outcome_of_exception(exc, errors)
