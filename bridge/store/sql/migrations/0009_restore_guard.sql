-- Schema version 9: a restore from the changelog replays states; it must not act on them.
--
-- A restore replaces a task by deleting and re-inserting it. Deleting a held dead head fired the purge trigger
-- and released its key's parked record, which the changelog still had PARKED (SPEC §12 × §10). While a restore
-- statement runs, one row is in `restore_guard` (written and removed inside the same operation): the release
-- triggers do nothing then.
CREATE TABLE restore_guard (active INTEGER NOT NULL);

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
                        AND o.status IN ('PENDING', 'IN_FLIGHT'));
END;

DROP TRIGGER tasks_release_parked_on_purge;
CREATE TRIGGER tasks_release_parked_on_purge AFTER DELETE ON tasks
 WHEN OLD.order_key IS NOT NULL AND OLD.status = 'DEAD' AND OLD.order_hold = 1
  AND NOT EXISTS (SELECT 1 FROM restore_guard)
BEGIN
  UPDATE tasks SET status = 'PENDING', next_attempt_at = COALESCE(OLD.finished_at, 0), version = version + 1
   WHERE id = (SELECT p.id FROM tasks p WHERE p.order_key = OLD.order_key AND p.status = 'PARKED'
                ORDER BY p.order_seq LIMIT 1)
     AND NOT EXISTS (SELECT 1 FROM tasks o WHERE o.order_key = OLD.order_key AND o.status IN ('PENDING', 'IN_FLIGHT'));
END;
