"""The docs are reference pages: they say what is true now, with no history.

Measured results are dated records in docs/results/, and the tables rendered from them (between
``<!-- report:NAME -->`` markers, ``kvpool report``) are the one place a page may show a date. Outside them no
page names one of our issues or a date.
"""

from __future__ import annotations

import re

import pytest

from kvpool.tools.report import MARKER, ROOT

PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
HISTORY = re.compile(r"\b[Ii]ssues? \d+|(?<![\w/])#\d+\b|\b20\d\d-\d\d-\d\d\b")


def prose(text: str) -> str:
    return MARKER.sub("", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_names_an_issue_or_a_date_outside_its_results_tables(page):
    found = [(n, m.group()) for n, line in enumerate(prose(page.read_text()).splitlines(), 1)
             for m in HISTORY.finditer(line)]
    assert found == [], f"{page.name}: history belongs in git and results in docs/results/"


def test_the_check_sees_an_issue_and_a_date_but_not_a_rendered_table():
    assert HISTORY.findall("fixed in issue 22 on 2026-12-02, see #7") == ["issue 22", "2026-12-02", "#7"]
    table = "<!-- report:x -->\n| [2026-12-05](results/2026-12-05-x.json) |\n<!-- /report:x -->\n"
    assert HISTORY.findall(prose("a page\n" + table)) == []
