"""The supervisor's own metrics (its gateway serves them beside its children's merged pages)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class SupervisorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.restarts = Counter("rdq_supervisor_restarts", "Child processes restarted after they died",
                                ["process"], registry=self.registry)
        self.children = Gauge("rdq_supervisor_children", "Child processes configured", registry=self.registry)
        self.running = Gauge("rdq_supervisor_children_running", "Child processes running", registry=self.registry)
