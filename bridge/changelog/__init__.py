"""Tasks outlive their bridge (SPEC §10): each task's transitions go to a compacted changelog topic co-partitioned
with its source topic; the instance assigned a source partition restores that partition's tasks into SQLite
before running them. Modules: `codec` (the rdq.task/v1 record), `topics` (names, creation, checks), `local`
(the SQLite side: outbox, homes, restore), `writer` (Kafka transactions), `restore` (assign → restore → run)."""
