-- rdq-bridge store, schema version 1.
-- Times are integer milliseconds since the Unix epoch (UTC).

CREATE TABLE tasks (
    id                   TEXT PRIMARY KEY,          -- ULID, stable for the task's whole life
    queue                TEXT NOT NULL,
    handler_ref          TEXT NOT NULL,
    handler_version      TEXT,
    payload              BLOB NOT NULL,
    payload_content_type TEXT NOT NULL,
    headers              TEXT NOT NULL,             -- JSON object of strings
    status               TEXT NOT NULL CHECK (status IN ('PENDING', 'IN_FLIGHT', 'SUCCEEDED', 'DEAD')),
    attempt_count        INTEGER NOT NULL DEFAULT 0,
    redrive_count        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at      INTEGER,                   -- null once terminal
    lease_expires_at     INTEGER,                   -- set only while IN_FLIGHT
    lease_token          INTEGER NOT NULL DEFAULT 0, -- fencing: +1 on every claim
    lease_owner          TEXT,
    lease_started_at     INTEGER,
    created_at           INTEGER NOT NULL,
    life_started_at      INTEGER NOT NULL,          -- created_at, or the last redrive (queue_timeout)
    finished_at          INTEGER,
    fetched_at           INTEGER,
    dead_reason_type     TEXT,
    dead_reason_message  TEXT,
    dlq_state            TEXT CHECK (dlq_state IN ('PENDING', 'PUBLISHED')),
    dlq_topic            TEXT,
    dlq_partition        INTEGER,
    dlq_offset           INTEGER,
    CHECK ((status = 'IN_FLIGHT') = (lease_expires_at IS NOT NULL)),
    CHECK ((status IN ('SUCCEEDED', 'DEAD')) = (next_attempt_at IS NULL))
);

-- Claim reads only due PENDING rows: its cost does not grow with terminal or future tasks.
CREATE INDEX tasks_due ON tasks (queue, next_attempt_at) WHERE status = 'PENDING';
CREATE INDEX tasks_lease ON tasks (lease_expires_at) WHERE status = 'IN_FLIGHT';
CREATE INDEX tasks_open ON tasks (queue, life_started_at) WHERE status IN ('PENDING', 'IN_FLIGHT');
CREATE INDEX tasks_finished ON tasks (queue, finished_at) WHERE status IN ('SUCCEEDED', 'DEAD');
CREATE INDEX tasks_fetched ON tasks (queue, fetched_at) WHERE fetched_at IS NOT NULL;
CREATE INDEX tasks_dlq_outbox ON tasks (finished_at) WHERE status = 'DEAD' AND dlq_state = 'PENDING';

-- Appended, never rewritten. seq orders a task's whole history across redrives.
CREATE TABLE attempts (
    task_id        TEXT NOT NULL,
    seq            INTEGER NOT NULL,
    attempt_no     INTEGER NOT NULL,               -- 1.. within one redrive epoch
    redrive_no     INTEGER NOT NULL,
    started_at     INTEGER NOT NULL,
    finished_at    INTEGER NOT NULL,
    outcome        TEXT NOT NULL CHECK (outcome IN ('SUCCESS', 'RETRYABLE_FAILURE', 'PERMANENT_FAILURE', 'LEASE_EXPIRED')),
    error_type     TEXT,
    error_message  TEXT,
    error_stack    TEXT,
    worker         TEXT,
    late_result_of INTEGER,                        -- set when a late result of attempt N finished the task
    PRIMARY KEY (task_id, seq)
) WITHOUT ROWID;

CREATE TABLE redrives (
    task_id     TEXT NOT NULL,
    redrive_no  INTEGER NOT NULL,
    at          INTEGER NOT NULL,
    by          TEXT,
    request_id  TEXT,
    PRIMARY KEY (task_id, redrive_no)
) WITHOUT ROWID;

-- Operator overrides of a queue's retry policy (admin set-policy), and paused queues.
CREATE TABLE queue_settings (
    queue        TEXT PRIMARY KEY,
    policy       TEXT,                             -- JSON: fields of the queue config that override it
    paused       INTEGER NOT NULL DEFAULT 0,
    updated_at   INTEGER NOT NULL,
    updated_by   TEXT
) WITHOUT ROWID;
