-- Schema version 13: a restored task's attempts are kept as one value, as its changelog record held them (SPEC §10).
--
-- A restore is its partition's downtime, and five attempt rows a task (each a b-tree insert into the
-- WITHOUT ROWID attempts table) were most of the store's share of it. Now the restore writes the record's
-- attempts array as it stands, one row a task; the attempts a task makes after its restore are rows of `attempts`
-- as ever. Every reader reads `attempt_history`: the two as one history, in `seq` order where it asks for it.
-- Attempts are never updated, only appended and deleted with their task, so a restored value is never rewritten.
CREATE TABLE restored_attempts (
    task_id  TEXT PRIMARY KEY,   -- a rowid table: a ~2 KB value inserted twice as fast as into a WITHOUT ROWID one
    attempts TEXT NOT NULL       -- a JSON array of the changelog record's attempt objects (bridge/changelog/codec.py)
);

-- The restored values as the rows they stand for. A view of one SELECT: SQLite folds it into the query that reads
-- it, so a filter on task_id (a parameter, a correlated column, an IN list) finds the row by its key.
CREATE VIEW restored_attempt_rows AS
SELECT restored.task_id, e.value ->> '$.seq' AS seq, e.value ->> '$.attempt_no' AS attempt_no,
       e.value ->> '$.redrive_no' AS redrive_no, e.value ->> '$.started_at' AS started_at,
       e.value ->> '$.finished_at' AS finished_at, e.value ->> '$.outcome' AS outcome,
       e.value ->> '$.error_type' AS error_type, e.value ->> '$.error_message' AS error_message,
       e.value ->> '$.error_stack' AS error_stack, e.value ->> '$.worker' AS worker,
       e.value ->> '$.late_result_of' AS late_result_of, e.value ->> '$.note' AS note
  FROM restored_attempts restored, json_each(restored.attempts) e;

-- Every attempt of every task. SQLite 3.40 pushes a filter into a UNION ALL view only where it compares task_id
-- with a parameter (get_attempts); a correlated or IN filter made it scan both tables whole. Queries that filter
-- so write the two arms themselves (attempts_of_many); tests/test_restored_history.py checks every plan.
CREATE VIEW attempt_history AS
SELECT task_id, seq, attempt_no, redrive_no, started_at, finished_at, outcome, error_type, error_message,
       error_stack, worker, late_result_of, note
  FROM attempts
UNION ALL
SELECT * FROM restored_attempt_rows;

-- The value goes with its task, whichever path deletes it (purge, a handed-over partition, a restore's replace).
CREATE TRIGGER tasks_restored_attempts_go AFTER DELETE ON tasks
BEGIN
    DELETE FROM restored_attempts WHERE task_id = OLD.id;
END;
