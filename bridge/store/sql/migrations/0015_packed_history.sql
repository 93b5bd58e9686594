-- Schema version 15: a restored history is stored packed (an LZ4 block; bridge/store/history.py).
--
-- Writing a restored history's ~2 KB was most of the store's time in a restore. The restore now writes the value
-- packed (a BLOB); the view reads every value through rdq_history(), which unpacks a packed one and hands a
-- value written before this version (TEXT) back as it is, so nothing already stored is rewritten. rdq_history is
-- a function the bridge gives each connection it opens: a plain sqlite3 shell reads the tables, not this view.
DROP VIEW attempt_history;
DROP VIEW restored_attempt_rows;

CREATE VIEW restored_attempt_rows AS
SELECT restored.task_id, e.value ->> '$.seq' AS seq, e.value ->> '$.attempt_no' AS attempt_no,
       e.value ->> '$.redrive_no' AS redrive_no, e.value ->> '$.started_at' AS started_at,
       e.value ->> '$.finished_at' AS finished_at, e.value ->> '$.outcome' AS outcome,
       e.value ->> '$.error_type' AS error_type, e.value ->> '$.error_message' AS error_message,
       e.value ->> '$.error_stack' AS error_stack, e.value ->> '$.worker' AS worker,
       e.value ->> '$.late_result_of' AS late_result_of, e.value ->> '$.note' AS note
  FROM restored_attempts restored, json_each(rdq_history(restored.attempts)) e;

-- As in version 13.
CREATE VIEW attempt_history AS
SELECT task_id, seq, attempt_no, redrive_no, started_at, finished_at, outcome, error_type, error_message,
       error_stack, worker, late_result_of, note
  FROM attempts
UNION ALL
SELECT * FROM restored_attempt_rows;
