-- Schema version 4: each DLQ outbox entry has its own retry time and last error, so one record that cannot be
-- published (too large even trimmed, an envelope that cannot be built) never blocks the others at the head of
-- the outbox; and a table for the bridge's own secrets (the key that signs remote workers' lease tokens).

ALTER TABLE tasks ADD COLUMN dlq_failures INTEGER NOT NULL DEFAULT 0;  -- failed publish tries since DEAD
ALTER TABLE tasks ADD COLUMN dlq_next_at INTEGER;                     -- not retried before (ms); NULL: now
ALTER TABLE tasks ADD COLUMN dlq_error TEXT;                           -- why the last try failed

DROP INDEX tasks_dlq_outbox;
CREATE INDEX tasks_dlq_outbox ON tasks (COALESCE(dlq_next_at, 0), finished_at)
 WHERE status = 'DEAD' AND dlq_state = 'PENDING';

CREATE TABLE secrets (
    name   TEXT PRIMARY KEY,
    value  BLOB NOT NULL
) WITHOUT ROWID;

-- The audit records which verified key signed each admin command, beside the self-asserted `issued_by`.
ALTER TABLE admin_requests ADD COLUMN key_id TEXT;
ALTER TABLE redrives ADD COLUMN key_id TEXT;
ALTER TABLE queue_settings ADD COLUMN updated_key_id TEXT;
