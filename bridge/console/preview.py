"""How a page shows what a task carries: a payload as pretty JSON, text or hex (capped), times, durations, and
the SVG charts of the dead letters page (drawn here: no chart library, nothing loaded from elsewhere)."""

from __future__ import annotations

import base64
import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

PREVIEW_BYTES = 64 * 1024  # of a payload shown; the rest is counted, not sent to the browser
HEX_BYTES = 4096  # of a binary payload shown as hex


@dataclass(frozen=True)
class Preview:
    kind: str  # json | text | hex | empty
    text: str
    size: int
    shown: int

    @property
    def capped(self) -> bool:
        return self.shown < self.size


def preview(payload_b64: str, content_type: str = "") -> Preview:
    data = base64.b64decode(payload_b64 or "")
    if not data:
        return Preview("empty", "", 0, 0)
    head = data[:PREVIEW_BYTES]
    if len(data) <= PREVIEW_BYTES:
        try:
            return Preview("json", json.dumps(json.loads(data), indent=2, ensure_ascii=False), len(data), len(data))
        except ValueError:
            pass
    try:
        return Preview("text", head.decode("utf-8"), len(data), len(head))
    except UnicodeDecodeError:
        if len(head) == PREVIEW_BYTES and _utf8_cut(head):
            return Preview("text", head.decode("utf-8", "ignore"), len(data), len(head))
    shown = data[:HEX_BYTES]
    return Preview("hex", hexdump(shown), len(data), len(shown))


def _utf8_cut(head: bytes) -> bool:
    """Text whose cap fell inside a multi-byte character."""
    try:
        head[:-3].decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def hexdump(data: bytes) -> str:
    lines = []
    for at in range(0, len(data), 16):
        row = data[at:at + 16]
        text = "".join(chr(b) if 32 <= b < 127 else "." for b in row)
        lines.append(f"{at:08x}  {row.hex(' '):<47}  {text}")
    return "\n".join(lines)


def parse_time(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


def duration_ms(start: str | None, end: str | None) -> int | None:
    a, b = parse_time(start), parse_time(end)
    return None if a is None or b is None else int((b - a).total_seconds() * 1000)


def trace_id(traceparent: str | None) -> str | None:
    parts = (traceparent or "").split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None


# ---- charts ----------------------------------------------------------------------------------------------


def bars_over_time(points: list[list[int]], bucket_ms: int, width: int = 720, height: int = 160) -> dict[str, Any]:
    """Dead tasks per time bucket as bars: what the template draws (coordinates, labels), computed here."""
    if not points:
        return {"bars": [], "width": width, "height": height, "max": 0, "first": None, "last": None}
    top = max(n for _, n in points)
    slot = max(1.0, (width - 40) / max(len(points), 1))
    bars = []
    for i, (t, n) in enumerate(points):
        h = max(1.0, (height - 30) * n / top)
        bars.append({"x": 40 + i * slot, "y": height - 20 - h, "w": max(1.0, slot - 2), "h": h, "n": n,
                     "label": _label(t, bucket_ms)})
    return {"bars": bars, "width": width, "height": height, "max": top, "first": bars[0]["label"],
            "last": bars[-1]["label"]}


def _label(ms: int, bucket_ms: int) -> str:
    at = dt.datetime.fromtimestamp(ms / 1000, dt.UTC)
    return at.strftime("%Y-%m-%d" if bucket_ms >= 86_400_000 else "%m-%d %H:%M")


def bars_by_count(counts: dict[str, int], width: int = 360) -> list[dict[str, Any]]:
    top = max(counts.values(), default=0)
    return [{"name": name, "n": n, "w": max(1.0, (width - 10) * n / top) if top else 0.0}
            for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
