"""Where a source record enters: the poll loop, one state per assigned partition (its phase, lane, offsets) and
who changes it (ownership, restores, back-pressure), the in-flight journal, and the first delivery of each record."""
