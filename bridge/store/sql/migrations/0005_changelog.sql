-- Schema version 5: tasks outlive their bridge (SPEC §10). SQLite becomes the local index of the tasks whose
-- home partition this instance owns; the compacted changelog topic is the copy that survives the machine.
--
-- A task's home is its source partition (from `rdq.source` = kafka://topic/partition/offset).
ALTER TABLE tasks ADD COLUMN home_topic TEXT;
ALTER TABLE tasks ADD COLUMN home_partition INTEGER;
-- `version` counts the task's durable transitions; `logged_version` is the last one the changelog acknowledged.
-- version > logged_version: the changelog outbox (what the next Kafka transaction writes).
ALTER TABLE tasks ADD COLUMN version INTEGER NOT NULL DEFAULT 1;
ALTER TABLE tasks ADD COLUMN logged_version INTEGER NOT NULL DEFAULT 0;

UPDATE tasks
   SET home_topic = substr(src, 1, instr(src, '/') - 1),
       home_partition = CAST(substr(substr(src, instr(src, '/') + 1), 1,
                                    instr(substr(src, instr(src, '/') + 1), '/') - 1) AS INTEGER)
  FROM (SELECT id AS sid, substr(json_extract(headers, '$."rdq.source"'), 9) AS src FROM tasks
         WHERE json_extract(headers, '$."rdq.source"') LIKE 'kafka://%/%/%') AS s
 WHERE tasks.id = s.sid;

-- Tasks stored before the changelog existed: never logged, their source offsets committed long ago. -1 marks
-- them; the bridge writes them to the changelog at its first start (whoever owns their partition), and never drops
-- them from this file before that.
UPDATE tasks SET logged_version = -1;

CREATE INDEX tasks_home ON tasks (home_topic, home_partition);
CREATE INDEX tasks_unlogged ON tasks (home_topic, home_partition) WHERE version > logged_version;

-- The homes assigned to this instance and restored. 'active': its tasks run here; 'leaving': revoked, its last
-- transitions still go to the changelog but nothing new starts. Emptied at every start.
CREATE TABLE homes (
    topic      TEXT NOT NULL,
    partition  INTEGER NOT NULL,
    state      TEXT NOT NULL DEFAULT 'active' CHECK (state IN ('active', 'leaving')),
    PRIMARY KEY (topic, partition)
) WITHOUT ROWID;

-- The source topics that have a changelog in the running config (set at every start). A task whose home topic is
-- not one (no rdq.source, or a topic this config no longer reads) stays in this file only, acted on here.
CREATE TABLE changelogged (
    topic TEXT PRIMARY KEY
) WITHOUT ROWID;

-- A purged task leaves a tombstone to write to its changelog partition.
CREATE TABLE tombstones (
    task_id        TEXT PRIMARY KEY,
    home_topic     TEXT NOT NULL,
    home_partition INTEGER NOT NULL
) WITHOUT ROWID;

-- Changelog records this bridge could not read (corrupt, or a newer schema): kept, never silently dropped.
CREATE TABLE changelog_unreadable (
    topic      TEXT NOT NULL,
    partition  INTEGER NOT NULL,
    offset     INTEGER NOT NULL,
    key        BLOB,
    value      BLOB,
    error      TEXT NOT NULL,
    seen_at    INTEGER NOT NULL,
    PRIMARY KEY (topic, partition, offset)
) WITHOUT ROWID;
