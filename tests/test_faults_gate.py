"""The fault suite's gate fails on every claim a row makes, not only on `lost` (bench/faults.py)."""

from __future__ import annotations

from bench.faults import Row


def test_a_row_passes_only_when_each_of_its_claims_holds() -> None:
    assert Row("hang", 30, 0, 30, 0, 0, expect={"dlq": 30, "successes": 0}).failures() == []
    assert Row("hang", 30, 0, 29, 0, 0, expect={"dlq": 30}).failures() == ["dlq = 29, expected 30"]
    assert Row("x", 10, 5, 5, 0, 1, duplicate_dlq=1).failures() == ["1 duplicates in the DLQ"]
    assert Row("x", 10, 5, 4, 1, 0).failures() == ["lost 1"]
    assert Row("sigkill", 100, 90, 3, 0, 0, expect={"dlq": (5, 100)}).failures() == ["dlq = 3, expected (5, 100)"]
    assert Row("old", 50, 50, 0, 0, 0, expect={"schema": 4}, schema=3).failures() == ["schema = 3, expected 4"]


def test_the_bad_config_row_fails_when_a_config_is_not_refused(tmp_path: object) -> None:
    """Its gate checked only `lost` (hard-coded 0): "0/4 refused" passed."""
    import bench.faults as faults

    class Proc:
        returncode = 0
        stderr = ""

    original = faults.subprocess.run
    faults.subprocess.run = lambda *a, **k: Proc()  # type: ignore[assignment]  # nothing refused
    try:
        row = faults.bad_configs(tmp_path)  # type: ignore[arg-type]
    finally:
        faults.subprocess.run = original
    assert row.failures() == ["refused = 0, expected 4"] and row.note == "0/4 refused clearly"


def test_a_row_may_declare_duplicates_it_reports_but_does_not_gate() -> None:
    assert Row("sigkill", 10, 8, 2, 0, 1, duplicate_dlq=1, expect={"duplicate_dlq": (0, 10)}).failures() == []
