"""A handler module that fails to import in one child of a supervisor (`RDQ_CRASH_CHILD=<index>`): that child
exits at every start, a crash loop (tests/test_processes.py). In any other process it registers nothing."""

from __future__ import annotations

import json
import os

_spec = json.loads(os.environ.get("RDQ_CHILD") or "{}")
if os.environ.get("RDQ_CRASH_CHILD") == str(_spec.get("index")):
    raise SystemExit(f"crash_child: child {_spec['index']} refuses to start")
