-- Schema version 11: a task whose latest changelog record this bridge cannot read is quarantined (SPEC §10).
--
-- Skipping an unreadable record let the task's earlier record win: a DEAD, published task came back PENDING and
-- could be dead-lettered twice. Now the task is not restored from its earlier records: it is held here (not
-- runnable), its record kept in changelog_unreadable, shown by `rdq stats`; a later readable record of the task
-- (or its tombstone) ends the quarantine. A bridge that reads the record (a newer release) restores it.
CREATE TABLE changelog_quarantine (
    task_id    TEXT PRIMARY KEY,
    topic      TEXT NOT NULL,     -- the changelog topic, partition and offset of the record (in changelog_unreadable)
    partition  INTEGER NOT NULL,
    offset     INTEGER NOT NULL,
    error      TEXT NOT NULL,
    seen_at    INTEGER NOT NULL
) WITHOUT ROWID;
