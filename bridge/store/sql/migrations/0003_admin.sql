-- Schema version 3: admin commands already seen (replay protection, SPEC §7.5).
-- A request_id is kept a little longer than the staleness window; an older replay is refused as stale.

CREATE TABLE admin_requests (
    request_id  TEXT PRIMARY KEY,
    seen_at     INTEGER NOT NULL,
    command     TEXT NOT NULL,
    issued_by   TEXT
) WITHOUT ROWID;
CREATE INDEX admin_requests_seen ON admin_requests (seen_at);
