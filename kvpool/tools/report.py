"""``kvpool report``: the tables in the docs, rendered from the results records in ``docs/results/``.

A record is one JSON file per run of a command (``docs/results/DATE-NAME.json``)::

    {"command": "kvpool bench path --quick --json", "date": "2026-12-05", "commit": "7fb1de5",
     "host": {"description": "...", "cores": 2, "shared": true}, "output": {...the command's JSON...}}

``commit`` may be null (not known); ``transcribed_from_docs: true`` marks a record copied from figures the
docs gave rather than saved from the command's own output (``output`` then holds only the figures the docs
had, and ``source`` says where they were); ``withdrawn`` says why a record's figures do not hold (the run was
kept, and its table rows say "withdrawn"). A table in a doc lives between two markers::

    <!-- report:NAME -->
    | ... |
    <!-- /report:NAME -->

and is ``kvpool.tools.report_tables.TABLES[NAME]`` rendered over the records it selects. ``--write``
rewrites every table from the records; ``--check`` exits 1 when any table differs from its rendering (a table
edited by hand, or a record added without ``--write``), when a marker names no table, or when a table is in no
doc. Only the standard library: the records are data, the rendering is text.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the checkout: kvpool/tools/report.py
REQUIRED = ("command", "date", "host", "commit", "output")
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
# a marker is a line of its own (one named in the middle of prose is text)
MARKER = re.compile(r"^<!-- report:(?P<name>[\w.-]+) -->\n(?P<body>.*?)^<!-- /report:(?P=name) -->$", re.S | re.M)
OPEN_MARKER = re.compile(r"^<!-- /?report:([\w.-]+) -->$", re.M)
MISSING = "–"


class RecordError(ValueError):
    """A results record that does not parse or lacks a field; the message names the file."""


@dataclass(frozen=True, slots=True)
class Column:
    """One column (or, transposed, one row): ``path`` is ``/``-separated keys into the record
    (``output/cold/rpcs_per_request``; a list index is a number); ``fmt`` a format spec for numbers."""

    header: str
    path: str
    fmt: str = ""


@dataclass(frozen=True, slots=True)
class Table:
    """The records whose file name matches one of ``records`` (globs), oldest first, as rows.

    ``transpose`` makes each record a column and each ``Column`` a row (for a long list of keys). ``rows``
    makes a row of each item of a list or object inside every record (``output/runs``; an object's items are
    its values that are objects, named by ``key_header``, only ``row_keys`` when given); a column path then
    starts at the item, or at the record with a leading ``@``. A path ``a|b`` takes the first present.
    """

    records: tuple[str, ...]
    columns: tuple[Column, ...]
    transpose: bool = False
    rows: str = ""
    row_keys: tuple[str, ...] = ()
    key_header: str = ""


def load_records(results: Path) -> dict[str, dict[str, Any]]:
    """Every record in ``results`` by file name, checked: required fields, a date, an object as output."""
    records = {}
    for path in sorted(results.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise RecordError(f"{path.name}: not JSON: {exc}") from None
        if not isinstance(record, dict):
            raise RecordError(f"{path.name}: a record is a JSON object")
        missing = [key for key in REQUIRED if key not in record]
        if missing:
            raise RecordError(f"{path.name}: missing {', '.join(missing)}")
        if not isinstance(record["date"], str) or not DATE.match(record["date"]):
            raise RecordError(f"{path.name}: date must be YYYY-MM-DD, not {record['date']!r}")
        if not path.name.startswith(record["date"]):
            raise RecordError(f"{path.name}: the file name starts with the record's date ({record['date']})")
        if not isinstance(record["output"], dict) or not record["output"]:
            raise RecordError(f"{path.name}: output must be the command's JSON object")
        if not isinstance(record["host"], dict) or not record["host"].get("description"):
            raise RecordError(f"{path.name}: host must be an object with a description")
        if record.get("transcribed_from_docs") and not record.get("source"):
            raise RecordError(f"{path.name}: a transcribed record says where from (source)")
        if "withdrawn" in record and not (isinstance(record["withdrawn"], str) and record["withdrawn"].strip()):
            raise RecordError(f"{path.name}: withdrawn says why the figures do not hold")
        records[path.name] = record
    return records


def lookup(record: dict[str, Any], path: str) -> Any:
    for alternative in path.split("|"):
        value = _lookup(record, alternative)
        if value is not None:
            return value
    return None


def _lookup(record: dict[str, Any], path: str) -> Any:
    value: Any = record
    for key in path.split("/"):
        if isinstance(value, dict):
            value = value.get(key)
        elif isinstance(value, list) and key.lstrip("-").isdigit() and -len(value) <= int(key) < len(value):
            value = value[int(key)]
        else:
            return None
        if value is None:
            return None
    return value


def cell(value: Any, fmt: str) -> str:
    if value is None:
        return MISSING
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)) and fmt:
        return format(value, fmt)
    if isinstance(value, list):
        return ", ".join(cell(v, fmt) for v in value)
    return str(value).replace("|", "\\|")


def record_label(name: str, record: dict[str, Any]) -> str:
    commit = record.get("commit") or "commit not recorded"
    mark = ", transcribed" if record.get("transcribed_from_docs") else ""
    mark += ", withdrawn" if record.get("withdrawn") else ""
    return f"[{record['date']}](results/{name}) ({commit}{mark})"


def select(table: Table, records: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    chosen = [(name, r) for name, r in records.items() if any(fnmatch.fnmatch(name, g) for g in table.records)]
    return sorted(chosen, key=lambda item: (item[1]["date"], not item[1].get("transcribed_from_docs"), item[0]))


def items(table: Table, record: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows ``table.rows`` names inside ``record``: a list's objects, an object's object values."""
    found = lookup(record, table.rows)
    if isinstance(found, list):
        return [item for item in found if isinstance(item, dict)]
    if isinstance(found, dict):
        keys = table.row_keys or tuple(k for k, v in found.items() if isinstance(v, dict))
        return [{"_key": k, **found[k]} for k in keys if isinstance(found.get(k), dict)]
    return []


def value(column: Column, record: dict[str, Any], item: dict[str, Any] | None) -> str:
    if item is not None and not column.path.startswith("@"):
        return cell(lookup(item, column.path), column.fmt)
    return cell(lookup(record, column.path.lstrip("@")), column.fmt)


def render(table: Table, records: dict[str, dict[str, Any]]) -> str:
    """The table as Markdown, no trailing newline; a table with no record says so."""
    chosen = select(table, records)
    if not chosen:
        return f"(no record matches {', '.join(table.records)})"
    if table.transpose:
        header = ["key", *(record_label(name, r) for name, r in chosen)]
        body = [[c.header, *(value(c, r, None) for _, r in chosen)] for c in table.columns]
    elif table.rows:
        key = [table.key_header] if table.key_header else []
        header = ["record", *key, *(c.header for c in table.columns)]
        body = [[record_label(name, r), *([cell(item.get("_key"), "")] if key else []),
                 *(value(c, r, item) for c in table.columns)]
                for name, r in chosen for item in items(table, r)]
    else:
        header = ["record", *(c.header for c in table.columns)]
        body = [[record_label(name, r), *(value(c, r, None) for c in table.columns)] for name, r in chosen]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


def regenerate(text: str, tables: dict[str, Table], records: dict[str, dict[str, Any]]) -> tuple[str, list[str]]:
    """``text`` with every marked table rendered afresh, and the names of the tables it holds."""
    names: list[str] = []

    def fill(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in tables:
            raise KeyError(f"report:{name} names no table (kvpool/tools/report_tables.py)")
        names.append(name)
        return f"<!-- report:{name} -->\n{render(tables[name], records)}\n<!-- /report:{name} -->"

    out = MARKER.sub(fill, text)
    opened = OPEN_MARKER.findall(text)
    if len(opened) != 2 * len(names):
        raise KeyError("a report marker without its pair: " + ", ".join(sorted(set(opened) - set(names)) or names))
    return out, names


@dataclass(slots=True)
class Outcome:
    differing: list[str] = field(default_factory=list)  # "docs/x.md: NAME"
    unplaced: list[str] = field(default_factory=list)  # tables in no doc
    errors: list[str] = field(default_factory=list)


def run(root: Path, tables: dict[str, Table], write: bool) -> Outcome:
    """Render every doc's tables under ``root/docs`` from ``root/docs/results``; write them when asked."""
    outcome = Outcome()
    try:
        records = load_records(root / "docs" / "results")
    except RecordError as exc:
        outcome.errors.append(str(exc))
        return outcome
    placed: set[str] = set()
    for doc in sorted((root / "docs").glob("*.md")):
        text = doc.read_text()
        try:
            new, names = regenerate(text, tables, records)
        except KeyError as exc:
            outcome.errors.append(f"{doc.relative_to(root)}: {exc.args[0]}")
            continue
        placed.update(names)
        if new != text:
            outcome.differing += [f"{doc.relative_to(root)}: {n}" for n in names
                                  if _block(text, n) != _block(new, n)]
            if write:
                doc.write_text(new)
    outcome.unplaced = sorted(set(tables) - placed)
    return outcome


def _block(text: str, name: str) -> str:
    match = re.search(rf"^<!-- report:{re.escape(name)} -->\n(.*?)^<!-- /report:{re.escape(name)} -->$", text,
                      re.S | re.M)
    return match[1] if match else ""


def add_report_parser(sub: Any) -> None:
    p = sub.add_parser("report", help="render the docs' results tables from the records in docs/results/",
                       description="Each table in docs/*.md between <!-- report:NAME --> and <!-- /report:NAME --> "
                       "is rendered from the JSON records in docs/results/ (one per run of a command). Without a "
                       "flag, print which tables differ; --write rewrites them; --check exits 1 if any differs.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite every table from the records")
    mode.add_argument("--check", action="store_true", help="exit 1 if any table differs from its records")
    p.add_argument("--root", default=str(ROOT), help="the checkout whose docs/ to render (default: this one)")


def main(args: argparse.Namespace, tables: dict[str, Table]) -> int:
    """``kvpool report``: ``tables`` are ``kvpool.tools.report_tables.TABLES`` (the caller passes them)."""
    outcome = run(Path(args.root), tables, write=args.write)
    for error in outcome.errors:
        print(f"kvpool report: {error}", file=sys.stderr)
    for name in outcome.unplaced:
        print(f"kvpool report: table {name} is in no doc", file=sys.stderr)
    verb = "rewrote" if args.write else "differs from its records"
    for item in outcome.differing:
        print(f"kvpool report: {item} {verb}")
    if outcome.errors or outcome.unplaced:
        return 1
    if args.check and outcome.differing:
        return 1
    if not outcome.differing:
        print("kvpool report: every table equals its records")
    return 0
