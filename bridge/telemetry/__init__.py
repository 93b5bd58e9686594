"""Observability: traces that follow a record's whole life, Prometheus metrics, and the
`/metrics` `/healthz` `/readyz` endpoint."""
