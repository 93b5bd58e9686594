"""`engine.processes: N`: a supervisor of N bridge processes (children.py: one child, restarted with backoff;
supervisor.py: signals; gateway.py: one /metrics and /readyz; lifeline.py: the child's end of its pipes)."""
