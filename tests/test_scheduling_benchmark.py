"""The scheduling benchmark: its re-creation cost sweep on its quick workloads (it reads the measured
container figure when there is one, and says so on the plot when there is none), and the tables of
docs/benchmarks.md made from its committed results."""

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


def test_every_policy_of_the_plots_has_a_colour_of_its_own():
    """The ratios plot had 7 colours for 9 policies: matplotlib cycled them, and optimus was drawn
    grey like static, afs_l green like adaptive."""
    assert set(scheduling.POLICIES) <= set(scheduling.COLOURS)
    colours = [scheduling.COLOURS[p] for p in scheduling.POLICIES]
    assert len(set(colours)) == len(colours)


def test_without_a_measurement_the_sweep_has_none_and_a_bad_file_is_refused(tmp_path):
    assert scheduling.measured_recreate_s(tmp_path) is None
    (tmp_path / scheduling.MEASURED).write_text(json.dumps({"inplace_s": 7.0}))
    with pytest.raises(ValueError, match="no positive number recreate_s"):
        scheduling.measured_recreate_s(tmp_path)


def test_the_documented_scheduling_tables_are_the_committed_results():
    """Every table of docs/benchmarks.md that ``benchmarks/tables.py`` makes from the committed
    results is, row for row, the one it makes: a re-run of a benchmark that is not carried into the
    document, a hand edit of a figure, a stale or a missing row fails here."""
    import tables

    made = tables.tables(REPO / "benchmarks" / "results")
    assert len(made) == 8  # sections 2 (six tables and the ablation's) and 6
    doc = (REPO / "docs" / "benchmarks.md").read_text()
    assert tables.with_tables(doc, made) == doc


def test_tables_replace_a_documents_tables_by_header_in_order(tmp_path):
    import tables

    doc = "# t\n\n| a | b |\n| --- | --- |\n| 1 | old |\n| stale | row |\n\ntext\n\n| c |\n| --- |\n| 3 |\n"
    new = [["| a | b |", "| --- | --- |", "| 1 | 2 |"], ["| c |", "| --- |", "| 4 |"]]
    assert tables.with_tables(doc, new) == "# t\n\n| a | b |\n| --- | --- |\n| 1 | 2 |\n\ntext\n\n| c |\n| --- |\n| 4 |\n"
    with pytest.raises(ValueError, match="no table with the header '| d |'"):
        tables.with_tables(doc, [["| d |", "| --- |"]])
    assert tables.tables(tmp_path) == []  # no result files: no tables
