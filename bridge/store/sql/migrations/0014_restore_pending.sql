-- Schema version 14: what a restore has yet to find, kept on disk, not in the bridge's memory (SPEC §10).
--
-- A restore from the beginning drops a task the changelog once logged and no longer holds (its tombstone compacted
-- away). It found those by keeping every id it restored in a Python set until the partition finished: ~100 bytes a
-- task, a hundred MiB at a million. Now the ids this file logged before the restore began are written here at its
-- start, each batch strikes off the ones it restores, and what is left when the partition's changelog is read to
-- its end is what the changelog no longer holds. A fresh store (a new volume) starts with nothing here. Rows of a
-- restore that was given up (the partition revoked) are replaced by the next restore of their partition.
CREATE TABLE restore_pending (
    home_topic     TEXT NOT NULL,
    home_partition INTEGER NOT NULL,
    task_id        TEXT NOT NULL,
    PRIMARY KEY (home_topic, home_partition, task_id)
) WITHOUT ROWID;
