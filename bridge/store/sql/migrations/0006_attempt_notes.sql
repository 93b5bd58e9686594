-- Schema version 6: an attempt may carry a note (SPEC §11): e.g. how long its task waited for the queue's
-- circuit breaker before it ran, so a DLQ reader can tell "failed 5 times" from "failed during the outage".
ALTER TABLE attempts ADD COLUMN note TEXT;
