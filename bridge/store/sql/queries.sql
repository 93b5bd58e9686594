-- Every query the store runs, one name each (loaded by bridge/queries.py).
-- Each post-claim transition is a compare-and-set on (id, lease_token, status): no row changed = refused.

-- name: insert_task
-- A source record that already has a task here (redelivered after a crash) is not stored twice.
-- A PARKED task (ordering: key) is parked only behind an open task of its key — running, due, parked, or dead and
-- holding its key; with none (the head ended meanwhile) it is stored PENDING, due at once. Decided here, in the
-- insert: no head can end between the check and the write. A failed record's retry (PENDING) of a key with a task
-- running or due already — an earlier record redriven while this one ran inline and its task was on its way here —
-- parks behind it instead of running beside it.
INSERT INTO tasks (id, queue, handler_ref, handler_version, payload, payload_content_type, headers, status,
                   attempt_count, redrive_count, next_attempt_at, created_at, life_started_at, finished_at,
                   dead_reason_type, dead_reason_message, dlq_state, source_ref, home_topic, home_partition,
                   order_key, order_seq, order_hold)
SELECT :id, :queue, :handler_ref, :handler_version, :payload, :payload_content_type, :headers,
       CASE WHEN held.beside THEN 'PARKED' WHEN :status != 'PARKED' THEN :status
            WHEN held.open THEN 'PARKED' ELSE 'PENDING' END,
       :attempt_count, 0,
       CASE WHEN held.beside THEN NULL WHEN :status != 'PARKED' THEN :next_attempt_at
            WHEN held.open THEN NULL ELSE :created_at END,
       :created_at, :created_at, :finished_at,
       :dead_reason_type, :dead_reason_message, :dlq_state, :source_ref, :home_topic, :home_partition,
       :order_key, :order_seq, :order_hold
  FROM (SELECT :status = 'PARKED' AND EXISTS (
          SELECT 1 FROM tasks o WHERE o.order_key = :order_key
             AND (o.status IN ('PENDING', 'IN_FLIGHT', 'PARKED') OR (o.status = 'DEAD' AND o.order_hold = 1))) AS open,
               :status = 'PENDING' AND :order_key IS NOT NULL AND EXISTS (
          SELECT 1 FROM tasks o WHERE o.order_key = :order_key AND o.id != :id
             AND o.status IN ('PENDING', 'IN_FLIGHT')) AS beside
       ) AS held
 -- A record to park whose key already has a later record's task ran before this one: the lane runs a key's
 -- records in order, so it was handled (succeeded) before a crash and is redelivered; parking it would run it
 -- again after the later ones. Not stored: done.
 WHERE NOT (:status = 'PARKED' AND EXISTS (SELECT 1 FROM tasks o WHERE o.order_key = :order_key
                                              AND o.order_seq > :order_seq))
ON CONFLICT (source_ref) WHERE source_ref IS NOT NULL DO NOTHING;

-- name: insert_tasks_unordered
-- Tasks without an order key, many in one statement (:rows: that many VALUES rows, each bound in the columns'
-- order): SQLite steps once for the whole batch. executemany stepped once a row and gave the GIL up and back each
-- time, which, with the lanes and the changelog busy in Python, was most of a commit's time. Without an order key
-- `insert_task`'s parking rules do not apply: a row is its values.
INSERT INTO tasks (id, queue, handler_ref, handler_version, payload, payload_content_type, headers, status,
                   attempt_count, next_attempt_at, created_at, life_started_at, finished_at,
                   dead_reason_type, dead_reason_message, dlq_state, source_ref, home_topic, home_partition)
VALUES :rows
ON CONFLICT (source_ref) WHERE source_ref IS NOT NULL DO NOTHING;

-- name: insert_first_attempts
-- The first attempts of many new tasks in one statement (as insert_tasks_unordered): each only where its task was
-- stored (not a redelivered record's) and has no attempt yet.
INSERT INTO attempts (task_id, seq, attempt_no, redrive_no, started_at, finished_at, outcome,
                      error_type, error_message, error_stack, worker, late_result_of, note)
SELECT v.column1, 1, v.column2, v.column3, v.column4, v.column5, v.column6,
       v.column7, v.column8, v.column9, v.column10, v.column11, v.column12
  FROM (VALUES :rows) AS v
 WHERE EXISTS (SELECT 1 FROM tasks WHERE id = v.column1)
   AND NOT EXISTS (SELECT 1 FROM attempts WHERE attempts.task_id = v.column1)
   AND NOT EXISTS (SELECT 1 FROM restored_attempts restored WHERE restored.task_id = v.column1);

-- name: insert_first_attempt
INSERT INTO attempts (task_id, seq, attempt_no, redrive_no, started_at, finished_at, outcome,
                      error_type, error_message, error_stack, worker, late_result_of, note)
SELECT :task_id, 1, :attempt_no, :redrive_no, :started_at, :finished_at, :outcome,
       :error_type, :error_message, :error_stack, :worker, :late_result_of, :note
 WHERE EXISTS (SELECT 1 FROM tasks WHERE id = :task_id)
   AND NOT EXISTS (SELECT 1 FROM attempt_history WHERE task_id = :task_id);

-- name: insert_attempt
INSERT INTO attempts (task_id, seq, attempt_no, redrive_no, started_at, finished_at, outcome,
                      error_type, error_message, error_stack, worker, late_result_of, note)
VALUES (:task_id, (SELECT COALESCE(MAX(seq), 0) + 1 FROM attempt_history WHERE task_id = :task_id),
        :attempt_no, :redrive_no, :started_at, :finished_at, :outcome,
        :error_type, :error_message, :error_stack, :worker, :late_result_of, :note);

-- name: claim_due
UPDATE tasks
   SET status = 'IN_FLIGHT', attempt_count = attempt_count + 1, lease_token = lease_token + 1,
       lease_expires_at = :now + :lease_ms, lease_owner = :owner, lease_started_at = :now,
       version = version + 1
 WHERE id IN (SELECT id FROM tasks
               WHERE queue = :queue AND status = 'PENDING' AND next_attempt_at <= :now
                 AND (:scoped = 0 OR NOT EXISTS (SELECT 1 FROM changelogged c WHERE c.topic = home_topic)
      OR EXISTS (SELECT 1 FROM homes h WHERE h.topic = home_topic AND h.partition = home_partition
                  AND h.state = 'active'))
               ORDER BY next_attempt_at LIMIT :limit)
RETURNING *;

-- name: lost_a_lease
-- Of these claimed tasks, those whose history has a lapsed lease (a handler that may kill its process).
SELECT task_id FROM attempts
 WHERE task_id IN (SELECT value FROM json_each(:ids)) AND outcome = 'LEASE_EXPIRED'
UNION
SELECT task_id FROM restored_attempt_rows
 WHERE task_id IN (SELECT value FROM json_each(:ids)) AND outcome = 'LEASE_EXPIRED';

-- name: next_due_at
-- When the next task claim_due may claim is due: of its scope only. A task of a partition being restored (or
-- handed over) is not claimable however due it is, and counted here it made the claim loop look again at once,
-- for ever: every look a claim scanning that partition's due tasks in the writer's transaction, a restore of due
-- tasks at half its speed (bench_processes restore). In due order, the first in scope, up to :until: the claim
-- loop looks again within a second anyway, and unbounded, with no task in scope, the look walked every pending
-- task out of it (209 ms at 500,000 restoring tasks, every second of a restore).
SELECT next_attempt_at FROM tasks
 WHERE queue = :queue AND status = 'PENDING' AND next_attempt_at <= :until
   AND (:scoped = 0 OR NOT EXISTS (SELECT 1 FROM changelogged c WHERE c.topic = home_topic)
        OR EXISTS (SELECT 1 FROM homes h WHERE h.topic = home_topic AND h.partition = home_partition
                    AND h.state = 'active'))
 ORDER BY next_attempt_at LIMIT 1;

-- name: extend_lease
UPDATE tasks SET lease_expires_at = :now + :lease_ms
 WHERE id = :id AND lease_token = :token AND status = 'IN_FLIGHT' AND lease_expires_at > :now;

-- name: finish_success
UPDATE tasks
   SET version = version + 1, status = 'SUCCEEDED', next_attempt_at = NULL, lease_expires_at = NULL, lease_owner = NULL,
       lease_started_at = NULL, finished_at = :now
 WHERE id = :id AND lease_token = :token AND status = 'IN_FLIGHT'
RETURNING attempt_count, redrive_count;

-- name: finish_late_success
-- A stale holder's success still counts while nothing finished the task (first result wins, SPEC §4.5).
-- Fencing: the token must be one this store really issued for this task (1..lease_token): a forged 0, a
-- negative or a future token changes nothing. (The current holder's own token goes through finish_success.)
-- From PENDING it is one more attempt; from IN_FLIGHT it takes the current holder's attempt number.
UPDATE tasks
   SET version = version + 1, attempt_count = attempt_count + (status = 'PENDING'),
       status = 'SUCCEEDED', next_attempt_at = NULL, lease_expires_at = NULL, lease_owner = NULL,
       lease_started_at = NULL, finished_at = :now
 WHERE id = :id AND status IN ('PENDING', 'IN_FLIGHT') AND :token >= 1 AND :token <= lease_token
RETURNING attempt_count, redrive_count;

-- name: reschedule
UPDATE tasks
   SET version = version + 1, status = 'PENDING', next_attempt_at = :next_attempt_at, lease_expires_at = NULL, lease_owner = NULL,
       lease_started_at = NULL
 WHERE id = :id AND lease_token = :token AND status = 'IN_FLIGHT'
RETURNING attempt_count, redrive_count;

-- name: reschedule_uncounted
-- A half-open probe's retryable failure (SPEC §11): recorded as attempt N (RETURNING), counted as none.
UPDATE tasks
   SET version = version + 1, status = 'PENDING', next_attempt_at = :next_attempt_at, lease_expires_at = NULL, lease_owner = NULL,
       lease_started_at = NULL, attempt_count = attempt_count - 1
 WHERE id = :id AND lease_token = :token AND status = 'IN_FLIGHT'
RETURNING attempt_count + 1, redrive_count;

-- name: finish_dead
UPDATE tasks
   SET version = version + 1, status = 'DEAD', next_attempt_at = NULL, lease_expires_at = NULL, lease_owner = NULL,
       lease_started_at = NULL, finished_at = :now, dead_reason_type = :reason_type,
       dead_reason_message = :reason_message, dlq_state = 'PENDING'
 WHERE id = :id AND lease_token = :token AND status = 'IN_FLIGHT'
RETURNING attempt_count, redrive_count;

-- name: release_lease
-- Graceful stop hands the task back at once; the interrupted run does not count as an attempt.
UPDATE tasks
   SET version = version + 1, status = 'PENDING', next_attempt_at = :now, attempt_count = attempt_count - 1,
       lease_expires_at = NULL, lease_owner = NULL, lease_started_at = NULL
 WHERE id = :id AND lease_token = :token AND status = 'IN_FLIGHT';

-- name: lapsed_leases
SELECT id, queue, lease_token, attempt_count, redrive_count, lease_started_at, lease_owner, lease_expires_at
  FROM tasks WHERE status = 'IN_FLIGHT' AND lease_expires_at <= :now AND (:scoped = 0 OR NOT EXISTS (SELECT 1 FROM changelogged c WHERE c.topic = home_topic)
      OR EXISTS (SELECT 1 FROM homes h WHERE h.topic = home_topic AND h.partition = home_partition
                  AND h.state = 'active'))
 ORDER BY lease_expires_at LIMIT :limit;

-- name: expire_lease_reschedule
-- A lapsed lease (sweep), or with :any_time a lease whose holder is known gone (its worker's socket dropped).
UPDATE tasks
   SET version = version + 1, status = 'PENDING', next_attempt_at = :next_attempt_at, lease_expires_at = NULL, lease_owner = NULL,
       lease_started_at = NULL
 WHERE id = :id AND lease_token = :token AND status = 'IN_FLIGHT' AND (:any_time OR lease_expires_at <= :now);

-- name: expire_lease_dead
UPDATE tasks
   SET version = version + 1, status = 'DEAD', next_attempt_at = NULL, lease_expires_at = NULL, lease_owner = NULL,
       lease_started_at = NULL, finished_at = :now, dead_reason_type = :reason_type,
       dead_reason_message = :reason_message, dlq_state = 'PENDING'
 WHERE id = :id AND lease_token = :token AND status = 'IN_FLIGHT' AND (:any_time OR lease_expires_at <= :now);

-- name: timed_out
-- A PARKED task's queue_timeout runs from when it was parked (its life_started_at).
SELECT id, status, lease_token, attempt_count, redrive_count, lease_started_at, lease_owner
  FROM tasks
 WHERE queue = :queue AND status IN ('PENDING', 'IN_FLIGHT', 'PARKED') AND life_started_at < :cutoff
   AND (:scoped = 0 OR NOT EXISTS (SELECT 1 FROM changelogged c WHERE c.topic = home_topic)
      OR EXISTS (SELECT 1 FROM homes h WHERE h.topic = home_topic AND h.partition = home_partition
                  AND h.state = 'active'))
 LIMIT :limit;

-- name: time_out_task
UPDATE tasks
   SET version = version + 1, status = 'DEAD', next_attempt_at = NULL, lease_expires_at = NULL, lease_owner = NULL,
       lease_started_at = NULL, finished_at = :now, dead_reason_type = 'rdq.Timeout',
       dead_reason_message = :reason_message, dlq_state = 'PENDING'
 WHERE id = :id AND status = :status AND lease_token = :token AND life_started_at < :cutoff;

-- name: purge_finished
-- A DEAD task is never purged before its DLQ record is acknowledged: that would lose it. Retained from its finish,
-- or from its life here when that began later: a task put back from its DLQ record (insert_task_copy) died long ago,
-- and counted from its death it was purged again at once (an import of an old DLQ, a redrive re-creating it). A
-- task's life otherwise starts before it finishes: for the rest, this is finished_at < :cutoff alone.
DELETE FROM tasks
 WHERE id IN (SELECT id FROM tasks
               WHERE queue = :queue AND status IN ('SUCCEEDED', 'DEAD') AND finished_at < :cutoff
                 AND life_started_at < :cutoff
                 AND (:scoped = 0 OR NOT EXISTS (SELECT 1 FROM changelogged c WHERE c.topic = home_topic)
      OR EXISTS (SELECT 1 FROM homes h WHERE h.topic = home_topic AND h.partition = home_partition
                  AND h.state = 'active'))
               LIMIT :limit)
   AND dlq_state IS NOT 'PENDING'
RETURNING id, home_topic, home_partition;

-- name: purge_fetched
DELETE FROM tasks
 WHERE id IN (SELECT id FROM tasks
               WHERE queue = :queue AND fetched_at IS NOT NULL AND fetched_at < :cutoff
                 AND (:scoped = 0 OR NOT EXISTS (SELECT 1 FROM changelogged c WHERE c.topic = home_topic)
      OR EXISTS (SELECT 1 FROM homes h WHERE h.topic = home_topic AND h.partition = home_partition
                  AND h.state = 'active')) LIMIT :limit)
   AND status IN ('SUCCEEDED', 'DEAD') AND dlq_state IS NOT 'PENDING'
RETURNING id, home_topic, home_partition;

-- name: purge_task
DELETE FROM tasks WHERE id = :id AND status IN ('SUCCEEDED', 'DEAD') AND dlq_state IS NOT 'PENDING'
   AND (:scoped = 0 OR NOT EXISTS (SELECT 1 FROM changelogged c WHERE c.topic = home_topic)
      OR EXISTS (SELECT 1 FROM homes h WHERE h.topic = home_topic AND h.partition = home_partition
                  AND h.state = 'active'))
RETURNING id, home_topic, home_partition;

-- name: delete_attempts
DELETE FROM attempts WHERE task_id = :id;

-- name: delete_redrives
DELETE FROM redrives WHERE task_id = :id;

-- name: mark_fetched
UPDATE tasks SET version = version + 1, fetched_at = :now
 WHERE id = :id AND status IN ('SUCCEEDED', 'DEAD') AND fetched_at IS NULL;

-- name: redrive
-- Of a key (ordering: key) with a task running or due now, or an earlier record dead and holding the key
-- (on_dead: hold), it waits PARKED; its order_seq puts it in its place among the key's parked records (at the front
-- for a redriven head): the key's records run one at a time, in offset order.
UPDATE tasks
   SET version = version + 1,
       status = CASE WHEN order_key IS NOT NULL AND EXISTS (
                  SELECT 1 FROM tasks o WHERE o.order_key = tasks.order_key AND o.id != tasks.id
                     AND (o.status IN ('PENDING', 'IN_FLIGHT')
                          OR (o.status = 'DEAD' AND o.order_hold = 1 AND o.order_seq < tasks.order_seq)))
                  THEN 'PARKED' ELSE 'PENDING' END,
       attempt_count = 0, redrive_count = redrive_count + 1,
       next_attempt_at = CASE WHEN order_key IS NOT NULL AND EXISTS (
                  SELECT 1 FROM tasks o WHERE o.order_key = tasks.order_key AND o.id != tasks.id
                     AND (o.status IN ('PENDING', 'IN_FLIGHT')
                          OR (o.status = 'DEAD' AND o.order_hold = 1 AND o.order_seq < tasks.order_seq)))
                  THEN NULL ELSE :now END,
       life_started_at = :now, finished_at = NULL, fetched_at = NULL, dead_reason_type = NULL,
       dead_reason_message = NULL, dlq_state = NULL, dlq_topic = NULL, dlq_partition = NULL, dlq_offset = NULL,
       dlq_failures = 0, dlq_next_at = NULL, dlq_error = NULL
 WHERE id = :id AND status = 'DEAD' AND (:scoped = 0 OR NOT EXISTS (SELECT 1 FROM changelogged c WHERE c.topic = home_topic)
      OR EXISTS (SELECT 1 FROM homes h WHERE h.topic = home_topic AND h.partition = home_partition
                  AND h.state = 'active'))
   -- The loop guard (SPEC §13): a task redriven max_redrives times already stays DEAD unless forced (NULL).
   AND (:max_redrives IS NULL OR redrive_count < :max_redrives)
RETURNING redrive_count, queue, headers;

-- name: insert_redrive
INSERT INTO redrives (task_id, redrive_no, at, by, request_id, key_id)
VALUES (:task_id, :redrive_no, :at, :by, :request_id, :key_id);

-- name: dlq_outbox
-- Entries whose last try failed wait for their own retry time; the others go first, oldest first.
-- :skip (a JSON array): entries already on their way, not read again. parked_behind: the records of its key
-- waiting behind it (ordering: key), for its envelope.
SELECT tasks.*, CASE WHEN order_key IS NULL THEN 0 ELSE (SELECT COUNT(*) FROM tasks p
         WHERE p.order_key = tasks.order_key AND p.status = 'PARKED') END AS parked_behind
  FROM tasks
 WHERE status = 'DEAD' AND dlq_state = 'PENDING' AND COALESCE(dlq_next_at, 0) <= :now
   AND id NOT IN (SELECT value FROM json_each(:skip))
   AND (:scoped = 0 OR NOT EXISTS (SELECT 1 FROM changelogged c WHERE c.topic = home_topic)
      OR EXISTS (SELECT 1 FROM homes h WHERE h.topic = home_topic AND h.partition = home_partition
                  AND h.state = 'active'))
 ORDER BY COALESCE(dlq_next_at, 0), finished_at LIMIT :limit;

-- name: dlq_publish_failed
UPDATE tasks SET dlq_failures = dlq_failures + 1, dlq_next_at = :next_at, dlq_error = :error
 WHERE id = :id AND status = 'DEAD' AND dlq_state = 'PENDING';

-- name: dlq_stuck_by_queue
-- Outbox entries whose last publish failed, by queue (the stuck-DLQ gauge, `rdq stats`).
SELECT queue, COUNT(*) AS n, MAX(dlq_failures) AS most_failures FROM tasks
 WHERE status = 'DEAD' AND dlq_state = 'PENDING' AND dlq_failures > 0 GROUP BY queue;

-- name: secret_get
SELECT value FROM secrets WHERE name = :name;

-- name: secret_put
INSERT INTO secrets (name, value) VALUES (:name, :value) ON CONFLICT (name) DO NOTHING;

-- name: mark_dlq_published
-- With :logged, the DLQ record and this state's changelog record went out in one Kafka transaction.
UPDATE tasks
   SET version = version + 1,
       logged_version = CASE WHEN :logged AND logged_version = version THEN version + 1 ELSE logged_version END,
       dlq_state = 'PUBLISHED', dlq_topic = :topic, dlq_partition = :partition, dlq_offset = :offset,
       fetched_at = COALESCE(fetched_at, :now), dlq_next_at = NULL, dlq_error = NULL
 WHERE id = :id AND status = 'DEAD' AND dlq_state = 'PENDING' AND redrive_count = :redrive_count;

-- name: get_task
SELECT * FROM tasks WHERE id = :id;

-- name: get_attempts
SELECT * FROM attempt_history WHERE task_id = :id ORDER BY seq;

-- name: get_redrives
SELECT * FROM redrives WHERE task_id = :id ORDER BY redrive_no;

-- name: attempts_of_many
-- The attempts of several tasks at once (:ids is a JSON array), for the DLQ outbox.
SELECT * FROM attempts WHERE task_id IN (SELECT value FROM json_each(:ids))
UNION ALL
SELECT * FROM restored_attempt_rows WHERE task_id IN (SELECT value FROM json_each(:ids))
ORDER BY task_id, seq;

-- name: attempts_json_of_many
-- The attempts of the DLQ outbox's tasks, each already the JSON object its envelope carries (SPEC §6: times
-- RFC 3339 in UTC with milliseconds) but late_result_of and note, rarely set, which the reader appends when they
-- are (json_patch would parse every object again): the publisher embeds them as they are, never decoding an
-- attempt it only passes on.
SELECT task_id, json_object(
         'attempt_no', attempt_no, 'redrive_no', redrive_no,
         'started_at', strftime('%Y-%m-%dT%H:%M:%S', started_at / 1000, 'unixepoch')
                       || printf('.%03dZ', started_at % 1000),
         'finished_at', strftime('%Y-%m-%dT%H:%M:%S', finished_at / 1000, 'unixepoch')
                        || printf('.%03dZ', finished_at % 1000),
         'outcome', outcome,
         'error', CASE WHEN error_type IS NULL THEN NULL ELSE json_object(
                    'type', error_type, 'message', COALESCE(error_message, ''), 'stack', error_stack) END,
         'worker', worker) AS body, late_result_of, note
  FROM (SELECT * FROM attempts WHERE task_id IN (SELECT value FROM json_each(:ids))
        UNION ALL
        SELECT * FROM restored_attempt_rows WHERE task_id IN (SELECT value FROM json_each(:ids)))
 ORDER BY task_id, seq;

-- name: matching_tasks
-- Tasks matching a filter (list, insights, the console's dead letters): the dead reason's type module-qualified or
-- by class name alone (as in dead_tasks_filtered); death time in [since, until); the record key (base64, as the
-- rdq.kafka.key header holds it); text in the dead reason's message, any case. Newest death first, or by id.
SELECT id, dead_reason_type, finished_at FROM tasks
 WHERE (:queue IS NULL OR queue = :queue) AND (:status IS NULL OR status = :status)
   AND (:error_type IS NULL OR dead_reason_type = :error_type
        OR (instr(:error_type, '.') = 0 AND substr(dead_reason_type, -length(:error_type) - 1) = '.' || :error_type))
   AND (:since IS NULL OR finished_at >= :since) AND (:until IS NULL OR finished_at < :until)
   AND (:key_b64 IS NULL OR json_extract(headers, '$."rdq.kafka.key"') = :key_b64)
   AND (:text IS NULL OR instr(lower(COALESCE(dead_reason_message, '')), lower(:text)) > 0)
 ORDER BY CASE WHEN :newest THEN -COALESCE(finished_at, created_at) ELSE 0 END, id
 LIMIT :limit;

-- name: tasks_of_many
SELECT * FROM tasks WHERE id IN (SELECT value FROM json_each(:ids));

-- name: outcomes_of_many
-- Attempts by outcome of a set of tasks (:ids is a JSON array): the console's "attempts by outcome".
SELECT outcome, COUNT(*) AS n
  FROM (SELECT outcome FROM attempts WHERE task_id IN (SELECT value FROM json_each(:ids))
        UNION ALL
        SELECT outcome FROM restored_attempt_rows WHERE task_id IN (SELECT value FROM json_each(:ids)))
 GROUP BY outcome;

-- name: dead_tasks_filtered
SELECT id, redrive_count FROM tasks
 WHERE queue = :queue AND status = 'DEAD' AND (:scoped = 0 OR NOT EXISTS (SELECT 1 FROM changelogged c WHERE c.topic = home_topic)
      OR EXISTS (SELECT 1 FROM homes h WHERE h.topic = home_topic AND h.partition = home_partition
                  AND h.state = 'active'))
   -- The error type as stored (module-qualified, e.g. handlers.examples.TransientError) or by its class name alone,
   -- as the config's `errors` lists accept it.
   AND (:error_type IS NULL OR dead_reason_type = :error_type
        OR (instr(:error_type, '.') = 0 AND substr(dead_reason_type, -length(:error_type) - 1) = '.' || :error_type))
   AND (:since IS NULL OR finished_at >= :since) AND (:until IS NULL OR finished_at < :until)
   AND id NOT IN (SELECT value FROM json_each(:exclude))
 -- Oldest death first; the records of one key (ordering: key) together, in offset order, from the key's oldest
 -- death: redriven in order, the first runs and the others park behind it.
 ORDER BY CASE WHEN order_key IS NULL THEN finished_at ELSE MIN(finished_at) OVER (PARTITION BY order_key) END,
          order_key, order_seq, id
 LIMIT :limit;

-- name: redrive_outcomes
-- Where the tasks of one redrive request are now. `tried`: an attempt ran since the redrive (attempt_count is reset
-- to 0 by it); a purged task has no row (status NULL).
SELECT t.status AS status, COALESCE(t.attempt_count > 0, 0) AS tried, COUNT(*) AS n
  FROM redrives r LEFT JOIN tasks t ON t.id = r.task_id
 WHERE r.request_id = :request_id
 GROUP BY 1, 2;

-- name: count_by_queue_status
SELECT queue, status, COUNT(*) AS n FROM tasks GROUP BY queue, status;

-- name: count_open_by_queue_status
-- The open-tasks gauge, read every 2 s: each status counted through an index of its own, not every open task's row
-- (235 ms at 500,000 restored tasks against 30: tasks_due holds the queue, so PENDING is counted in the index alone;
-- IN_FLIGHT tasks are few, tasks_lease finds them; a PARKED task always has an order_key, so tasks_order).
SELECT queue, 'PENDING', COUNT(*) FROM tasks WHERE status = 'PENDING' GROUP BY queue
UNION ALL
SELECT queue, 'IN_FLIGHT', COUNT(*) FROM tasks WHERE status = 'IN_FLIGHT' GROUP BY queue
UNION ALL
SELECT queue, 'PARKED', COUNT(*) FROM tasks WHERE status = 'PARKED' AND order_key IS NOT NULL GROUP BY queue;

-- name: count_open
-- A queue's open tasks, counted up to :most (its max_open_tasks: whether it is at the limit is all backpressure asks).
-- Counted every 250 ms: uncapped, a million restored tasks were read four times a second (bench_processes restore).
SELECT COUNT(*) FROM (SELECT 1 FROM tasks WHERE queue = :queue AND status IN ('PENDING', 'IN_FLIGHT', 'PARKED')
                       LIMIT :most);

-- name: journal_inflight
INSERT INTO inflight (topic, partition, run_id, lo, hi, written_at)
VALUES (:topic, :partition, :run_id, :lo, :hi, :now)
ON CONFLICT (topic, partition, run_id) DO UPDATE SET lo = excluded.lo, hi = excluded.hi,
                                                     written_at = excluded.written_at;

-- name: journal_prune
-- Ranges wholly below the committed offset can no longer come back.
DELETE FROM inflight WHERE topic = :topic AND partition = :partition AND hi < :committed;

-- name: journal_forget_partition
-- The partition went to another instance: what this store journaled for it can no longer be used here.
DELETE FROM inflight WHERE topic = :topic AND partition = :partition;

-- name: journal_forget_run
DELETE FROM inflight WHERE run_id = :run_id;

-- name: journal_suspects
SELECT topic, partition, lo, hi FROM inflight WHERE run_id != :run_id;

-- name: admin_request_seen
INSERT INTO admin_requests (request_id, seen_at, command, issued_by, key_id, args)
VALUES (:request_id, :now, :command, :issued_by, :key_id, :args)
ON CONFLICT (request_id) DO NOTHING;

-- name: admin_requests_prune
-- Reads (get, list, stats, insights, audit) are kept for replay protection only; the commands that change
-- something stay for the audit until :audit_before.
DELETE FROM admin_requests
 WHERE seen_at < :before AND (command IN ('get', 'list', 'stats', 'insights', 'audit') OR seen_at < :audit_before);

-- name: admin_requests_recent
SELECT request_id, seen_at, command, issued_by, key_id, args FROM admin_requests
 WHERE (:since IS NULL OR seen_at >= :since)
   AND (:reads OR command NOT IN ('get', 'list', 'stats', 'insights', 'audit'))
 ORDER BY seen_at DESC, request_id LIMIT :limit;

-- name: queue_settings_all
SELECT queue, policy, paused, updated_at, updated_by FROM queue_settings;

-- name: queue_set_paused
INSERT INTO queue_settings (queue, paused, updated_at, updated_by, updated_key_id)
VALUES (:queue, :paused, :now, :by, :key_id)
ON CONFLICT (queue) DO UPDATE SET paused = excluded.paused, updated_at = excluded.updated_at,
                                  updated_by = excluded.updated_by, updated_key_id = excluded.updated_key_id;

-- name: queue_set_policy
INSERT INTO queue_settings (queue, policy, updated_at, updated_by, updated_key_id)
VALUES (:queue, :policy, :now, :by, :key_id)
ON CONFLICT (queue) DO UPDATE SET policy = excluded.policy, updated_at = excluded.updated_at,
                                  updated_by = excluded.updated_by, updated_key_id = excluded.updated_key_id;

-- name: purge_terminal
-- Operator purge of finished tasks of a queue (a DEAD task whose DLQ record is not yet acknowledged stays).
DELETE FROM tasks
 WHERE id IN (SELECT id FROM tasks
               WHERE queue = :queue AND status IN ('SUCCEEDED', 'DEAD')
                 AND (:status IS NULL OR status = :status) AND (:before IS NULL OR finished_at < :before)
                 AND (:scoped = 0 OR NOT EXISTS (SELECT 1 FROM changelogged c WHERE c.topic = home_topic)
      OR EXISTS (SELECT 1 FROM homes h WHERE h.topic = home_topic AND h.partition = home_partition
                  AND h.state = 'active'))
               LIMIT :limit)
   AND dlq_state IS NOT 'PENDING'
RETURNING id, home_topic, home_partition;

-- name: insert_task_copy
-- A task re-created from its DLQ envelope (redrive after the store purged it): same id, history kept, its place in
-- its key kept (ordering: key); it holds the key no more (its hold ended when it was acknowledged and purged). Its
-- finish stays its death; its life here starts :now (purge_finished retains it from then), and its DLQ record,
-- acknowledged already, counts as read :now (retain_from: fetched, as mark_dlq_published; unread, it stayed for ever).
INSERT INTO tasks (id, queue, handler_ref, handler_version, payload, payload_content_type, headers, status,
                   attempt_count, redrive_count, next_attempt_at, created_at, life_started_at, finished_at, fetched_at,
                   dead_reason_type, dead_reason_message, dlq_state, dlq_topic, dlq_partition, dlq_offset,
                   source_ref, home_topic, home_partition, order_key, order_seq, order_hold)
VALUES (:id, :queue, :handler_ref, :handler_version, :payload, :payload_content_type, :headers, 'DEAD',
        :attempt_count, :redrive_count, NULL, :created_at, :now, :finished_at, :now,
        :dead_reason_type, :dead_reason_message, 'PUBLISHED', :dlq_topic, :dlq_partition, :dlq_offset, NULL,
        :home_topic, :home_partition, :order_key, :order_seq, 0);

-- name: insert_attempt_copy
INSERT INTO attempts (task_id, seq, attempt_no, redrive_no, started_at, finished_at, outcome,
                      error_type, error_message, error_stack, worker, late_result_of, note)
VALUES (:task_id, :seq, :attempt_no, :redrive_no, :started_at, :finished_at, :outcome,
        :error_type, :error_message, :error_stack, :worker, :late_result_of, :note);

-- ---- the changelog (SPEC §10) ----------------------------------------------------------------------------

-- name: changelog_outbox_records
-- The outbox as changelog records (bridge/changelog/codec.py defines the format; tests/test_changelog_store.py
-- holds the two equal on random tasks), built by SQLite: its steps run without the GIL, which the lanes need meanwhile.
-- The payload is left "" to be spliced in base64 by the reader (SQLite 3.40 has no base64). Subquery results
-- are wrapped in json() so they are embedded as JSON, not as strings. The attempts in seq order, the redrives
-- in redrive_no order: an aggregate over an ordered subquery keeps its order. Left out before any record is built:
-- the tasks in :skip (a JSON array of ids) and the states in :sent (a JSON array of "<id> <version>": sent, their
-- marks not committed yet; built again and dropped in Python, they were nearly half of the read's work on the
-- failure path). A newer state of a task sent is read.
SELECT t.id, t.home_topic, t.home_partition, t.version, t.payload,
       json_object(
         'schema', CASE WHEN t.order_key IS NOT NULL THEN 'rdq.task/v2' ELSE 'rdq.task/v1' END,
         'version', t.version,
         'task', json_object('payload', '',
           'id', t.id,
           'queue', t.queue,
           'handler_ref', t.handler_ref,
           'handler_version', t.handler_version,
           'payload_content_type', t.payload_content_type,
           'status', t.status,
           'attempt_count', t.attempt_count,
           'redrive_count', t.redrive_count,
           'next_attempt_at', t.next_attempt_at,
           'lease_expires_at', t.lease_expires_at,
           'lease_token', t.lease_token,
           'lease_owner', t.lease_owner,
           'lease_started_at', t.lease_started_at,
           'created_at', t.created_at,
           'life_started_at', t.life_started_at,
           'finished_at', t.finished_at,
           'fetched_at', t.fetched_at,
           'dead_reason_type', t.dead_reason_type,
           'dead_reason_message', t.dead_reason_message,
           'dlq_state', t.dlq_state,
           'dlq_topic', t.dlq_topic,
           'dlq_partition', t.dlq_partition,
           'dlq_offset', t.dlq_offset,
           'home_topic', t.home_topic,
           'home_partition', t.home_partition,
           'order_key', t.order_key,
           'order_seq', t.order_seq,
           'order_hold', t.order_hold,
           'headers', json(t.headers)),
         'attempts', json((SELECT json_group_array(json_object(
             'seq', a.seq,
             'attempt_no', a.attempt_no,
             'redrive_no', a.redrive_no,
             'started_at', a.started_at,
             'finished_at', a.finished_at,
             'outcome', a.outcome,
             'error_type', a.error_type,
             'error_message', a.error_message,
             'error_stack', a.error_stack,
             'worker', a.worker,
             'late_result_of', a.late_result_of,
             'note', a.note))
           FROM (SELECT * FROM attempts WHERE task_id = t.id
                 UNION ALL
                 SELECT * FROM restored_attempt_rows WHERE task_id = t.id ORDER BY seq) a)),
         'redrives', json((SELECT json_group_array(json_object(
             'redrive_no', r.redrive_no,
             'at', r.at,
             'by', r.by,
             'request_id', r.request_id,
             'key_id', r.key_id))
           FROM (SELECT * FROM redrives WHERE task_id = t.id ORDER BY redrive_no) r))
       ) AS record
  FROM tasks t
 WHERE t.version > t.logged_version
   AND EXISTS (SELECT 1 FROM homes h WHERE h.topic = t.home_topic AND h.partition = t.home_partition)
   AND t.id NOT IN (SELECT value FROM json_each(:skip))
   AND t.id || ' ' || t.version NOT IN (SELECT value FROM json_each(:sent))
 LIMIT :limit;

-- name: changelog_logged
-- A round's records acknowledged (:marks is a JSON object, task id → version, a task once: its highest): one
-- statement, not a step a task (each step gave the GIL up and back); an object's keys and integer values are
-- read as they are (an array of pairs took a path lookup for each and a GROUP BY: a fifth slower). A version
-- never goes back.
UPDATE tasks SET logged_version = m.value
  FROM json_each(:marks) AS m
 WHERE tasks.id = m.key AND tasks.logged_version < m.value;

-- name: changelog_unlogged_of
-- Of several tasks (:ids is a JSON array), those with a transition the changelog has not acknowledged.
SELECT id FROM tasks WHERE id IN (SELECT value FROM json_each(:ids)) AND version > logged_version;

-- name: tombstone_add
INSERT INTO tombstones (task_id, home_topic, home_partition) VALUES (:id, :home_topic, :home_partition)
ON CONFLICT (task_id) DO NOTHING;

-- name: tombstones_due
SELECT task_id, home_topic, home_partition FROM tombstones t
 WHERE EXISTS (SELECT 1 FROM homes h WHERE h.topic = t.home_topic AND h.partition = t.home_partition)
 LIMIT :limit;

-- name: tombstone_done
-- Tombstones in the changelog (:ids is a JSON array of task ids).
DELETE FROM tombstones WHERE task_id IN (SELECT value FROM json_each(:ids));

-- name: home_activate
INSERT INTO homes (topic, partition, state) VALUES (:topic, :partition, 'active')
ON CONFLICT (topic, partition) DO UPDATE SET state = 'active';

-- name: home_leaving
UPDATE homes SET state = 'leaving' WHERE topic = :topic AND partition = :partition;

-- name: home_deactivate
DELETE FROM homes WHERE topic = :topic AND partition = :partition;

-- name: homes_clear
DELETE FROM homes;

-- name: changelogged_clear
DELETE FROM changelogged;

-- name: changelogged_add
INSERT INTO changelogged (topic) VALUES (:topic) ON CONFLICT DO NOTHING;

-- name: home_drop_tasks
-- The partition went to another instance, its changelog flushed: this file no longer holds its tasks (except those
-- from before the changelog not yet written to it).
DELETE FROM tasks WHERE home_topic = :topic AND home_partition = :partition AND logged_version != -1 RETURNING id;

-- name: premigration_outbox
-- Tasks from before the changelog, of a changelogged topic, whatever partition: written once, at the first start.
SELECT * FROM tasks
 WHERE logged_version = -1 AND EXISTS (SELECT 1 FROM changelogged c WHERE c.topic = home_topic)
 LIMIT :limit;

-- name: home_drop_tombstones
DELETE FROM tombstones WHERE home_topic = :topic AND home_partition = :partition;

-- name: restore_guard_on
INSERT INTO restore_guard (active) VALUES (1);

-- name: restore_guard_off
DELETE FROM restore_guard;

-- name: versions_of
SELECT id, version FROM tasks WHERE id IN (SELECT value FROM json_each(:ids));

-- name: restore_pending_begin
-- A restore's start: the tasks of its partition this file had logged are what it has yet to find (migration 0014).
-- A row left by a restore of the partition that was given up is replaced first (restore_pending_clear).
INSERT INTO restore_pending (home_topic, home_partition, task_id)
SELECT home_topic, home_partition, id FROM tasks
 WHERE home_topic = :topic AND home_partition = :partition AND logged_version > 0;

-- name: restore_pending_clear
DELETE FROM restore_pending WHERE home_topic = :topic AND home_partition = :partition;

-- name: restore_pending_found
-- A batch's tasks (:ids, a JSON array) are in the changelog: found, whatever their record says.
DELETE FROM restore_pending
 WHERE home_topic = :topic AND home_partition = :partition AND task_id IN (SELECT value FROM json_each(:ids));

-- name: restore_pending_gone
-- The partition's changelog read to its end: what it never held of what this file had logged (purged, the
-- tombstone compacted away). Only a task still of this partition and still logged.
SELECT p.task_id FROM restore_pending p JOIN tasks t ON t.id = p.task_id
 WHERE p.home_topic = :topic AND p.home_partition = :partition
   AND t.home_topic = p.home_topic AND t.home_partition = p.home_partition AND t.logged_version > 0;

-- name: homes_present
SELECT DISTINCT home_topic, home_partition FROM tasks WHERE home_topic IS NOT NULL;

-- name: source_ref_holders
-- The tasks standing for these source records (:refs is expanded to one placeholder per reference).
SELECT id FROM tasks WHERE source_ref IN (:refs);

-- name: delete_task
DELETE FROM tasks WHERE id = :id;

-- name: restore_tasks
-- A restore batch's tasks, many in one statement (:rows: that many VALUES rows, in the column order of
-- LocalIndex's _TASK_ROW): SQLite steps once a chunk, not once a task, and binds by position, not by name. The
-- changelog's state is logged as it stands (logged_version = version).
INSERT OR REPLACE INTO tasks (
    id, queue, handler_ref, handler_version, payload, payload_content_type, headers, status, attempt_count,
    redrive_count, next_attempt_at, lease_expires_at, lease_token, lease_owner, lease_started_at, created_at,
    life_started_at, finished_at, fetched_at, dead_reason_type, dead_reason_message, dlq_state, dlq_topic,
    dlq_partition, dlq_offset, source_ref, home_topic, home_partition, order_key, order_seq, order_hold,
    version, logged_version, dlq_failures)
SELECT v.column1, v.column2, v.column3, v.column4, v.column5, v.column6, v.column7, v.column8, v.column9,
       v.column10, v.column11, v.column12, v.column13, v.column14, v.column15, v.column16, v.column17, v.column18,
       v.column19, v.column20, v.column21, v.column22, v.column23, v.column24, v.column25, v.column26, v.column27,
       v.column28, v.column29, v.column30, COALESCE(v.column31, 0), v.column32, v.column32, 0
  FROM (VALUES :rows) AS v;

-- name: restore_history
-- A restore batch's histories, each the changelog record's attempts array as one value (restored_attempts), many
-- in one statement (as restore_tasks): one row a task instead of one an attempt.
INSERT OR REPLACE INTO restored_attempts (task_id, attempts) VALUES :rows;

-- name: restore_attempts
-- A restore batch's attempts as rows, where a history cannot be one value (codec.Restored.history; as
-- restore_tasks; LocalIndex's _ATTEMPT_ROW).
INSERT INTO attempts (task_id, seq, attempt_no, redrive_no, started_at, finished_at, outcome,
                      error_type, error_message, error_stack, worker, late_result_of, note)
VALUES :rows;

-- name: restore_redrives
-- A restore batch's redrives, many in one statement (as restore_tasks; LocalIndex's _REDRIVE_ROW).
INSERT INTO redrives (task_id, redrive_no, at, by, request_id, key_id)
VALUES :rows;

-- name: unreadable_add
INSERT INTO changelog_unreadable (topic, partition, offset, key, value, error, seen_at)
VALUES (:topic, :partition, :offset, :key, :value, :error, :now) ON CONFLICT DO NOTHING;

-- name: unreadable_count
SELECT topic, partition, COUNT(*) AS n FROM changelog_unreadable GROUP BY topic, partition;

-- name: quarantine_add
INSERT OR REPLACE INTO changelog_quarantine (task_id, topic, partition, offset, error, seen_at)
VALUES (:task_id, :topic, :partition, :offset, :error, :now);

-- name: quarantine_end
-- A restore batch's tasks (:ids, a JSON array) are no longer held: one statement for the batch.
DELETE FROM changelog_quarantine WHERE task_id IN (SELECT value FROM json_each(:ids));

-- name: quarantine_count
SELECT topic, partition, COUNT(*) AS n FROM changelog_quarantine GROUP BY topic, partition;

-- name: partitions_status
-- Per home partition: open tasks, and transitions not yet in the changelog (its lag, in transitions' tasks).
SELECT home_topic, home_partition,
       SUM(status IN ('PENDING', 'IN_FLIGHT')) AS open, SUM(version > logged_version) AS unlogged
  FROM tasks WHERE home_topic IS NOT NULL GROUP BY home_topic, home_partition;

-- name: order_skip
-- `skip` (SPEC §12): a dead head that holds its key (on_dead: hold) holds it no more; the trigger releases the
-- key's next parked task.
UPDATE tasks SET version = version + 1, order_hold = 0
 WHERE id = :id AND status = 'DEAD' AND order_key IS NOT NULL AND order_hold = 1
RETURNING order_key;

-- name: order_open_keys
-- The keys of a partition's ordered queue that hold back their later records: a task running, due, parked, or
-- dead and holding.
SELECT DISTINCT order_key FROM tasks
 WHERE home_topic = :topic AND home_partition = :partition AND queue = :queue AND order_key IS NOT NULL
   AND (status IN ('PENDING', 'IN_FLIGHT', 'PARKED') OR (status = 'DEAD' AND order_hold = 1));

-- name: order_open_of
SELECT DISTINCT order_key FROM tasks
 WHERE order_key IN (SELECT value FROM json_each(:keys))
   AND (status IN ('PENDING', 'IN_FLIGHT', 'PARKED') OR (status = 'DEAD' AND order_hold = 1));

-- name: order_keys_of
SELECT DISTINCT order_key FROM tasks WHERE id IN (SELECT value FROM json_each(:ids)) AND order_key IS NOT NULL;

-- name: order_head
-- What a parked task waits for: the key's earliest task that is not parked and not finished (or a held dead one).
SELECT id, status FROM tasks
 WHERE order_key = :order_key AND id != :id
   AND (status IN ('PENDING', 'IN_FLIGHT') OR (status = 'DEAD' AND order_hold = 1))
 ORDER BY order_seq LIMIT 1;

-- name: order_parked_behind
SELECT COUNT(*) FROM tasks WHERE order_key = :order_key AND status = 'PARKED';

-- name: parked_oldest
-- A PARKED task always has an order_key (ordering: key): said here, the plan reads the tasks_order index, not every
-- row of the table (read every 2 s by the health probe; a whole-table scan of a million tasks each time).
SELECT queue, COUNT(*) AS n, MIN(life_started_at) AS oldest FROM tasks
 WHERE status = 'PARKED' AND order_key IS NOT NULL GROUP BY queue;
