"""A bridge process's memory management (bridge/memory.py): the cyclic GC's pace is set by the process's entry
point, `serve()`, and by nothing a library user calls."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bridge import service
from bridge.config import parse_config
from bridge.memory import GC_THRESHOLDS, tune_gc


class _Opened(Exception):
    """Raised where `serve()` opens its bridge: what the process's GC was set to by then is the test's answer."""


@pytest.fixture
def restored_gc() -> Iterator[None]:
    before = gc.get_threshold()
    try:
        yield
    finally:
        gc.set_threshold(*before)


def test_tune_gc_sets_the_bridge_thresholds_and_returns_the_ones_before(restored_gc: None) -> None:
    gc.set_threshold(700, 10, 10)
    assert tune_gc() == (700, 10, 10)
    assert gc.get_threshold() == GC_THRESHOLDS
    assert GC_THRESHOLDS[0] > 700  # young collections rarer than Python's default, or the tuning does nothing


def test_a_bridge_process_tunes_its_gc_before_it_opens_the_bridge(restored_gc: None, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    gc.set_threshold(700, 10, 10)
    config = parse_config({"kafka": {"bootstrap_servers": "127.0.0.1:1", "group_id": "g"},
                           "store": {"path": str(tmp_path / "rdq.db")},
                           "queues": {"q": {"handler": "ok", "sources": ["t"]}}}, "<test>")
    seen: list[tuple[int, int, int]] = []

    async def open_bridge(*args: Any, **kwargs: Any) -> Any:
        seen.append(gc.get_threshold())
        raise _Opened

    monkeypatch.setattr(service, "open_bridge", open_bridge)
    with pytest.raises(_Opened):
        asyncio.run(service.serve(config))
    assert seen == [GC_THRESHOLDS]

