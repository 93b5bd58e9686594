"""changelog/side.py's process, started from a program that is not the bridge's own command: a spawned interpreter
imports its parent's main script again (as `__mp_main__`), so a script without `if __name__ == "__main__":` would
run whole a second time in the helper — a second bridge, say, with the same instance and transactional id. The
side process leaves the parent's main script alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_UNGUARDED = """
import asyncio, os, sys
sys.path.insert(0, {root!r})
with open({marks!r}, "a") as marks:  # each time this script's top level runs
    marks.write(f"{{os.getpid()}}\\n")
from bridge.changelog.side import SideProcess

async def main():
    side = SideProcess("test")
    side.start()
    try:
        print(await side.run(os.getpid), flush=True)
    finally:
        side.close()

asyncio.run(main())
"""


def test_a_script_without_a_main_guard_is_not_run_again_in_the_side_process(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    script = tmp_path / "embedding.py"
    script.write_text(_UNGUARDED.format(root=str(Path(__file__).resolve().parents[1]), marks=str(marks)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    parent, helper = marks.read_text().split(), int(done.stdout.split()[-1])
    assert len(parent) == 1 and int(parent[0]) != helper, (parent, helper, done.stderr[-2000:])
