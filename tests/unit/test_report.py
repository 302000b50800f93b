"""``kvpool report``: every results record parses, and every table in the docs is its records' rendering.

A table edited by hand (or a record added without ``kvpool report --write``) fails here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.services.cli import _run_report
from kvpool.services.cli_parser import build_parser
from kvpool.tools.report import ROOT, Column, RecordError, Table, load_records, regenerate, render, run
from kvpool.tools.report_tables import TABLES

TABLE = Table(("*-bench-x*.json",), columns=(Column("speed", "output/speed", ".2f"), Column("ok", "output/ok")))
ROWS = Table(("*-bench-x*.json",), rows="output/cases", key_header="case",
             columns=(Column("ms", "ms", ",.0f"), Column("errors", "@output/errors")))


def kvpool(argv: list[str]) -> int:
    """``kvpool report ...`` as the command parses and runs it, without configuring this process's logging
    (structlog would keep pytest's captured stream, closed after the test)."""
    return _run_report(build_parser(argv[0]).parse_args(argv))


def record(date: str = "2026-12-05", **output: object) -> dict:
    return {"command": "kvpool bench x --json", "date": date, "commit": "abc1234",
            "host": {"description": "2 shared cores", "cores": 2}, "output": output or {"speed": 1.0}}


def write(folder: Path, name: str, data: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(data))


def test_every_record_in_docs_results_parses_and_says_how_it_was_made():
    records = load_records(ROOT / "docs" / "results")
    assert records
    for name, data in records.items():
        assert data["command"].startswith("kvpool "), name
        assert isinstance(data.get("transcribed_from_docs", False), bool), name


def test_every_table_in_the_docs_equals_its_rendering_from_the_records():
    outcome = run(ROOT, TABLES, write=False)
    assert outcome.errors == []
    assert outcome.differing == [], "run `kvpool report --write` after adding a record; never edit a table by hand"
    assert outcome.unplaced == []


def test_a_table_renders_one_row_a_record_oldest_first_with_a_link_and_the_commit(tmp_path):
    write(tmp_path, "2026-12-05-bench-x.json", record(speed=2.345, ok=True))
    write(tmp_path, "2026-12-01-bench-x.json", record("2026-12-01", speed=1, ok=False) | {"commit": None,
          "transcribed_from_docs": True, "source": "docs/benchmarks.md"})
    assert render(TABLE, load_records(tmp_path)).splitlines() == [
        "| record | speed | ok |",
        "| --- | --- | --- |",
        "| [2026-12-01](results/2026-12-01-bench-x.json) (commit not recorded, transcribed) | 1.00 | no |",
        "| [2026-12-05](results/2026-12-05-bench-x.json) (abc1234) | 2.35 | yes |",
    ]


def test_a_withdrawn_record_stays_and_its_rows_say_so(tmp_path):
    write(tmp_path, "2026-12-05-bench-x.json", record(speed=1.0, ok=True) | {
        "withdrawn": "both sides ran the same code"})
    assert render(TABLE, load_records(tmp_path)).splitlines()[2:] == [
        "| [2026-12-05](results/2026-12-05-bench-x.json) (abc1234, withdrawn) | 1.00 | yes |"]


def test_rows_inside_a_record_and_a_missing_key_shows_a_dash(tmp_path):
    write(tmp_path, "2026-12-05-bench-x.json", record(errors=0, cases={"a": {"ms": 1234.5}, "b": {}, "n": 3}))
    assert render(ROWS, load_records(tmp_path)).splitlines()[2:] == [
        "| [2026-12-05](results/2026-12-05-bench-x.json) (abc1234) | a | 1,234 | 0 |",
        "| [2026-12-05](results/2026-12-05-bench-x.json) (abc1234) | b | – | 0 |",
    ]


def doc_with_table(tmp_path: Path) -> Path:
    write(tmp_path / "docs" / "results", "2026-12-05-bench-x.json", record(speed=3.0, ok=True))
    doc = tmp_path / "docs" / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n<!-- report:x -->\nstale\n<!-- /report:x -->\n\nprose after\n")
    assert run(tmp_path, {"x": TABLE}, write=True).differing == ["docs/benchmarks.md: x"]
    assert run(tmp_path, {"x": TABLE}, write=False).differing == []
    return doc


def test_write_renders_the_table_between_its_markers_and_leaves_the_prose(tmp_path):
    text = doc_with_table(tmp_path).read_text()
    assert text.startswith("# Benchmarks\n\n<!-- report:x -->\n| record | speed | ok |\n")
    assert text.endswith("| 3.00 | yes |\n<!-- /report:x -->\n\nprose after\n")


def test_a_table_edited_by_hand_fails_the_check_and_the_command_exits_1(tmp_path, capsys, monkeypatch):
    doc = doc_with_table(tmp_path)
    doc.write_text(doc.read_text().replace("| 3.00 |", "| 3.50 |"))
    assert run(tmp_path, {"x": TABLE}, write=False).differing == ["docs/benchmarks.md: x"]
    monkeypatch.setattr("kvpool.tools.report_tables.TABLES", {"x": TABLE})
    assert kvpool(["report", "--check", "--root", str(tmp_path)]) == 1
    assert "docs/benchmarks.md: x differs from its records" in capsys.readouterr().out
    assert kvpool(["report", "--write", "--root", str(tmp_path)]) == 0
    assert kvpool(["report", "--check", "--root", str(tmp_path)]) == 0
    assert "| 3.00 |" in doc.read_text()


def test_a_marker_naming_no_table_or_without_its_pair_is_an_error(tmp_path):
    write(tmp_path / "docs" / "results", "2026-12-05-bench-x.json", record())
    doc = tmp_path / "docs" / "a.md"
    doc.write_text("<!-- report:nope -->\n<!-- /report:nope -->\n")
    assert "report:nope names no table" in run(tmp_path, {"x": TABLE}, write=False).errors[0]
    doc.write_text("<!-- report:x -->\nno end\n")
    assert "without its pair" in run(tmp_path, {"x": TABLE}, write=False).errors[0]
    with pytest.raises(KeyError):
        regenerate("<!-- report:y -->\n<!-- /report:y -->", {"x": TABLE}, {})


def test_a_marker_named_inside_prose_is_text(tmp_path):
    write(tmp_path / "docs" / "results", "2026-12-05-bench-x.json", record())
    doc = tmp_path / "docs" / "a.md"
    doc.write_text("Tables live between `<!-- report:NAME -->` and `<!-- /report:NAME -->`.\n")
    outcome = run(tmp_path, {"x": TABLE}, write=False)
    assert (outcome.errors, outcome.differing, outcome.unplaced) == ([], [], ["x"])


def test_a_table_in_no_doc_is_reported(tmp_path):
    write(tmp_path / "docs" / "results", "2026-12-05-bench-x.json", record())
    assert run(tmp_path, {"x": TABLE}, write=False).unplaced == ["x"]


@pytest.mark.parametrize("change, message", [
    (lambda r: r.pop("commit"), "missing commit"),
    (lambda r: r.update(date="5 Dec"), "date must be YYYY-MM-DD"),
    (lambda r: r.update(output={}), "output must be"),
    (lambda r: r.update(host={"cores": 2}), "host must be"),
    (lambda r: r.update(transcribed_from_docs=True), "says where from"),
    (lambda r: r.update(withdrawn=""), "withdrawn says why"),
])
def test_a_record_missing_what_a_record_must_say_does_not_load(tmp_path, change, message):
    data = record()
    change(data)
    write(tmp_path, "2026-12-05-bench-x.json", data)
    with pytest.raises(RecordError, match=message):
        load_records(tmp_path)


def test_a_record_named_for_another_date_does_not_load(tmp_path):
    write(tmp_path, "2026-12-04-bench-x.json", record())
    with pytest.raises(RecordError, match="starts with the record's date"):
        load_records(tmp_path)
