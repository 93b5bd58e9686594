-- Schema version 12: the admin audit (the console's Audit page, `rdq audit`): what each command asked for.
--
-- admin_requests already held who (issued_by, key_id), which command and when, for replay protection only. Now the
-- command's arguments (JSON, capped) are kept too, and the commands that change something stay 30 days.

ALTER TABLE admin_requests ADD COLUMN args TEXT;
