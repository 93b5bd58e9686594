-- Schema version 2: the first-delivery journal, and one task per source record.
--
-- The journal (poison-pill protection, SPEC §4.4 applied to first delivery).
-- Before a batch's handlers run, each partition's range of offsets handed to handlers is written here (one
-- transaction per batch, not one per record). A range left by an earlier run of the bridge (it died) marks the
-- records that may have killed it: when they come back they become tasks with a LEASE_EXPIRED attempt.

CREATE TABLE inflight (
    topic      TEXT NOT NULL,
    partition  INTEGER NOT NULL,
    run_id     TEXT NOT NULL,
    lo         INTEGER NOT NULL,   -- lowest offset not yet done
    hi         INTEGER NOT NULL,   -- highest offset handed to a handler
    written_at INTEGER NOT NULL,
    PRIMARY KEY (topic, partition, run_id)
) WITHOUT ROWID;

-- One task per source record and store: a record redelivered after a crash (its offset not yet committed)
-- whose failure is already stored does not become a second task, nor a second DLQ record. The record's
-- timestamp is part of the reference so a recreated topic reusing offsets is not mistaken for the old one.
ALTER TABLE tasks ADD COLUMN source_ref TEXT;
CREATE UNIQUE INDEX tasks_source_ref ON tasks (source_ref) WHERE source_ref IS NOT NULL;
