-- Schema version 2: the first-delivery journal (poison-pill protection, SPEC §4.4 applied to first delivery).
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
