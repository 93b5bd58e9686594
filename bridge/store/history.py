"""A restored history is stored packed: the changelog record's attempts array as an LZ4 block (SPEC §10, migration
0015).

A restore writes a task's whole history as one value (`restored_attempts`), and writing those bytes was most of the
store's time in a restore: a row of 1,756 bytes cost the store's thread 13.8 us, one of 400 bytes 3.8 us, most of
it the kernel copying WAL frames and the checkpoint's copy after them (a py-spy profile: pwrite 59 %; RESULTS.md,
"diagnostic"); a history is ~1.8 KB with five short stack traces, several KB with real ones, and its attempts repeat
their keys and mostly their stack. The decode packs it (LZ4: ~1 us for 1.8 KB -> 0.4 KB; zlib's fastest level took
9-69 us, more than it saved the store); the store reads it back as the JSON text it was through the SQL function
`rdq_history`, which the view `restored_attempt_rows` calls and every connection the bridge opens registers
(`with_history_functions`). A value written before (TEXT) reads as it is.
"""

from __future__ import annotations

import sqlite3

import lz4.block

FUNCTION = "rdq_history"


def pack(history: bytes) -> bytes:
    """A history's JSON text as the store keeps it: an LZ4 block, its length first."""
    packed: bytes = lz4.block.compress(history)
    return packed


def unpacked(value: bytes | str | None) -> str | None:
    """The JSON text of a stored history: a packed one (BLOB) unpacked, one stored as text before as it is."""
    if isinstance(value, bytes):
        text: bytes = lz4.block.decompress(value)
        return text.decode()
    return value


def with_history_functions(conn: sqlite3.Connection) -> sqlite3.Connection:
    """Give this connection `rdq_history`, without which the views of the attempts cannot be read."""
    conn.create_function(FUNCTION, 1, unpacked, deterministic=True)
    return conn
