"""The durable SQLite retry store: schema and named queries (`sql/`), compare-and-set transitions,
group commit, and a read-only reader for `rdq store`."""
