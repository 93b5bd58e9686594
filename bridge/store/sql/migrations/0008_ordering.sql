-- Schema version 8: per-key ordering with durable parking (SPEC §12).
--
-- A new status, PARKED: a record of a key whose earlier record has an open task, stored behind it without running
-- and without spending an attempt. SQLite cannot change a CHECK constraint in place, so the table is rebuilt
-- (same columns, same order, every row copied) with PARKED allowed, and its indexes made again.
CREATE TABLE tasks_v8 (
    id                   TEXT PRIMARY KEY,          -- ULID, stable for the task's whole life
    queue                TEXT NOT NULL,
    handler_ref          TEXT NOT NULL,
    handler_version      TEXT,
    payload              BLOB NOT NULL,
    payload_content_type TEXT NOT NULL,
    headers              TEXT NOT NULL,             -- JSON object of strings
    status               TEXT NOT NULL CHECK (status IN ('PENDING', 'IN_FLIGHT', 'SUCCEEDED', 'DEAD', 'PARKED')),
    attempt_count        INTEGER NOT NULL DEFAULT 0,
    redrive_count        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at      INTEGER,                   -- null once terminal, and while parked
    lease_expires_at     INTEGER,                   -- set only while IN_FLIGHT
    lease_token          INTEGER NOT NULL DEFAULT 0, -- fencing: +1 on every claim
    lease_owner          TEXT,
    lease_started_at     INTEGER,
    created_at           INTEGER NOT NULL,
    life_started_at      INTEGER NOT NULL,          -- created_at (or parked), or the last redrive (queue_timeout)
    finished_at          INTEGER,
    fetched_at           INTEGER,
    dead_reason_type     TEXT,
    dead_reason_message  TEXT,
    dlq_state            TEXT CHECK (dlq_state IN ('PENDING', 'PUBLISHED')),
    dlq_topic            TEXT,
    dlq_partition        INTEGER,
    dlq_offset           INTEGER,
    source_ref           TEXT,
    dlq_failures         INTEGER NOT NULL DEFAULT 0,
    dlq_next_at          INTEGER,
    dlq_error            TEXT,
    home_topic           TEXT,
    home_partition       INTEGER,
    version              INTEGER NOT NULL DEFAULT 1,
    logged_version       INTEGER NOT NULL DEFAULT 0,
    -- A queue with `ordering: key`: the key's records of one partition (topic/partition/base64 key) in offset
    -- order (order_seq); order_hold: its on_dead is `hold` — dead, it keeps holding its key until redriven/skipped.
    order_key            TEXT,
    order_seq            INTEGER,
    order_hold           INTEGER NOT NULL DEFAULT 0,
    CHECK ((status = 'IN_FLIGHT') = (lease_expires_at IS NOT NULL)),
    CHECK ((status IN ('SUCCEEDED', 'DEAD', 'PARKED')) = (next_attempt_at IS NULL))
);

INSERT INTO tasks_v8 (id, queue, handler_ref, handler_version, payload, payload_content_type, headers, status,
                      attempt_count, redrive_count, next_attempt_at, lease_expires_at, lease_token, lease_owner,
                      lease_started_at, created_at, life_started_at, finished_at, fetched_at, dead_reason_type,
                      dead_reason_message, dlq_state, dlq_topic, dlq_partition, dlq_offset, source_ref, dlq_failures,
                      dlq_next_at, dlq_error, home_topic, home_partition, version, logged_version)
SELECT id, queue, handler_ref, handler_version, payload, payload_content_type, headers, status,
       attempt_count, redrive_count, next_attempt_at, lease_expires_at, lease_token, lease_owner,
       lease_started_at, created_at, life_started_at, finished_at, fetched_at, dead_reason_type,
       dead_reason_message, dlq_state, dlq_topic, dlq_partition, dlq_offset, source_ref, dlq_failures,
       dlq_next_at, dlq_error, home_topic, home_partition, version, logged_version
  FROM tasks;

DROP TABLE tasks;
ALTER TABLE tasks_v8 RENAME TO tasks;

CREATE INDEX tasks_due ON tasks (queue, next_attempt_at) WHERE status = 'PENDING';
CREATE INDEX tasks_lease ON tasks (lease_expires_at) WHERE status = 'IN_FLIGHT';
CREATE INDEX tasks_open ON tasks (queue, life_started_at) WHERE status IN ('PENDING', 'IN_FLIGHT', 'PARKED');
CREATE INDEX tasks_finished ON tasks (queue, finished_at) WHERE status IN ('SUCCEEDED', 'DEAD');
CREATE INDEX tasks_fetched ON tasks (queue, fetched_at) WHERE fetched_at IS NOT NULL;
CREATE UNIQUE INDEX tasks_source_ref ON tasks (source_ref) WHERE source_ref IS NOT NULL;
CREATE INDEX tasks_dlq_outbox ON tasks (COALESCE(dlq_next_at, 0), finished_at)
 WHERE status = 'DEAD' AND dlq_state = 'PENDING';
CREATE INDEX tasks_home ON tasks (home_topic, home_partition);
CREATE INDEX tasks_unlogged ON tasks (home_topic, home_partition) WHERE version > logged_version;
CREATE INDEX tasks_order ON tasks (order_key, order_seq) WHERE order_key IS NOT NULL;

-- Release (SPEC §12): when a key's head ends — succeeded, or dead with on_dead `release`, or a held dead head
-- skipped (order_hold 1 → 0) — the key's earliest parked task becomes due at once, unless another task of the
-- key is running or due already. In the transaction of the head's own transition: a crash cannot separate them.
CREATE TRIGGER tasks_release_parked AFTER UPDATE OF status, order_hold ON tasks
 WHEN NEW.order_key IS NOT NULL
  AND (NEW.status = 'SUCCEEDED' OR (NEW.status = 'DEAD' AND NEW.order_hold = 0))
  AND NOT (OLD.status = NEW.status AND OLD.order_hold = NEW.order_hold)
BEGIN
  UPDATE tasks SET status = 'PENDING', next_attempt_at = COALESCE(NEW.finished_at, 0), version = version + 1
   WHERE id = (SELECT p.id FROM tasks p WHERE p.order_key = NEW.order_key AND p.status = 'PARKED'
                ORDER BY p.order_seq LIMIT 1)
     AND NOT EXISTS (SELECT 1 FROM tasks o WHERE o.order_key = NEW.order_key AND o.id != NEW.id
                        AND o.status IN ('PENDING', 'IN_FLIGHT'));
END;

-- A held dead head purged (its DLQ record acknowledged) no longer holds its key: the next parked task goes.
CREATE TRIGGER tasks_release_parked_on_purge AFTER DELETE ON tasks
 WHEN OLD.order_key IS NOT NULL AND OLD.status = 'DEAD' AND OLD.order_hold = 1
BEGIN
  UPDATE tasks SET status = 'PENDING', next_attempt_at = COALESCE(OLD.finished_at, 0), version = version + 1
   WHERE id = (SELECT p.id FROM tasks p WHERE p.order_key = OLD.order_key AND p.status = 'PARKED'
                ORDER BY p.order_seq LIMIT 1)
     AND NOT EXISTS (SELECT 1 FROM tasks o WHERE o.order_key = OLD.order_key AND o.status IN ('PENDING', 'IN_FLIGHT'));
END;
