-- Schema version 10: a key held by a dead record stays held whichever of its records ends (SPEC §12).
--
-- The release triggers looked only for a task of the key running or due: a record that ended while an earlier
-- dead record of its key still held the key (an earlier record redriven ahead of it, or a parked record timed
-- out) released the key's next parked record. Now a dead record that holds its key (order_hold 1) keeps every
-- parked record of the key parked, whichever record's end fired the trigger.

DROP TRIGGER tasks_release_parked;
CREATE TRIGGER tasks_release_parked AFTER UPDATE OF status, order_hold ON tasks
 WHEN NEW.order_key IS NOT NULL
  AND (NEW.status = 'SUCCEEDED' OR (NEW.status = 'DEAD' AND NEW.order_hold = 0))
  AND NOT (OLD.status = NEW.status AND OLD.order_hold = NEW.order_hold)
  AND NOT EXISTS (SELECT 1 FROM restore_guard)
BEGIN
  UPDATE tasks SET status = 'PENDING', next_attempt_at = COALESCE(NEW.finished_at, 0), version = version + 1
   WHERE id = (SELECT p.id FROM tasks p WHERE p.order_key = NEW.order_key AND p.status = 'PARKED'
                ORDER BY p.order_seq LIMIT 1)
     AND NOT EXISTS (SELECT 1 FROM tasks o WHERE o.order_key = NEW.order_key AND o.id != NEW.id
                        AND (o.status IN ('PENDING', 'IN_FLIGHT') OR (o.status = 'DEAD' AND o.order_hold = 1)));
END;

DROP TRIGGER tasks_release_parked_on_purge;
CREATE TRIGGER tasks_release_parked_on_purge AFTER DELETE ON tasks
 WHEN OLD.order_key IS NOT NULL AND OLD.status = 'DEAD' AND OLD.order_hold = 1
  AND NOT EXISTS (SELECT 1 FROM restore_guard)
BEGIN
  UPDATE tasks SET status = 'PENDING', next_attempt_at = COALESCE(OLD.finished_at, 0), version = version + 1
   WHERE id = (SELECT p.id FROM tasks p WHERE p.order_key = OLD.order_key AND p.status = 'PARKED'
                ORDER BY p.order_seq LIMIT 1)
     AND NOT EXISTS (SELECT 1 FROM tasks o WHERE o.order_key = OLD.order_key
                        AND (o.status IN ('PENDING', 'IN_FLIGHT') OR (o.status = 'DEAD' AND o.order_hold = 1)));
END;
