"""Loads `sql/queries.sql` (named queries) and `sql/migrations/*.sql` (versioned schema)."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)


@cache
def queries() -> dict[str, str]:
    text = resources.files("bridge.store").joinpath("sql/queries.sql").read_text(encoding="utf-8")
    parts = _NAME.split(text)
    named = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        lines = [line for line in body.strip().splitlines() if not line.lstrip().startswith("--")]
        named[name] = "\n".join(lines).strip().rstrip(";")
    return named


def q(name: str) -> str:
    return queries()[name]


@cache
def migrations() -> tuple[tuple[int, str, str], ...]:
    """(version, file name, sql) in order; a version is the file's numeric prefix."""
    folder = resources.files("bridge.store").joinpath("sql/migrations")
    found = []
    for entry in folder.iterdir():
        if entry.name.endswith(".sql"):
            found.append((int(entry.name.split("_", 1)[0]), entry.name, entry.read_text(encoding="utf-8")))
    found.sort()
    versions = [v for v, _, _ in found]
    if versions != list(range(1, len(found) + 1)):
        raise RuntimeError(f"migrations must be numbered 1..n without gaps, found {versions}")
    return tuple(found)
