"""The re-creation cost sweep of ``benchmarks/scheduling.py``, on its quick workloads: it reads the
measured container figure when there is one, and says so on the plot when there is none."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import scheduling


def test_sweep_marks_the_measured_recreation_when_the_file_exists(tmp_path):
    (tmp_path / scheduling.MEASURED).write_text(json.dumps({"inplace_s": 7.0, "recreate_s": 75.0}))
    sweep = scheduling.recreate_sweep(tmp_path, quick=True)
    assert sweep["measured_s"] == 75.0
    assert {75.0, sweep["default_s"], *scheduling.RECREATE_COSTS_S} == set(sweep["costs_s"])
    assert all(r > 0 for r in sweep["avg_jct_ratio"])
    assert (tmp_path / "recreate_sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "recreate_sweep.csv").stat().st_size > 0


def test_without_a_measurement_the_sweep_has_none_and_a_bad_file_is_refused(tmp_path):
    assert scheduling.measured_recreate_s(tmp_path) is None
    (tmp_path / scheduling.MEASURED).write_text(json.dumps({"inplace_s": 7.0}))
    with pytest.raises(ValueError, match="no positive number recreate_s"):
        scheduling.measured_recreate_s(tmp_path)


def test_the_documented_scheduling_tables_are_the_committed_results():
    """Every row of docs/benchmarks.md section 2's tables is the one ``benchmarks/tables.py`` makes
    from the committed results: a re-run of the benchmark that is not carried into the document
    (or a hand edit of a figure) fails here."""
    import subprocess

    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "tables.py")], check=True,
                         capture_output=True, text=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    assert len(rows) > 60  # six tables
    doc = set((REPO / "docs" / "benchmarks.md").read_text().splitlines())
    assert [row for row in rows if row not in doc] == []
