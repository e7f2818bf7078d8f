"""The order the suite's test files are queued in: heaviest first.

With `--dist loadfile` (pyproject.toml) xdist hands each worker a whole file, and the run lasts as
long as the busier worker. Queued heaviest first (longest-processing-time first), the last files
handed out are short, so the two workers finish within seconds of each other. xdist's default
order (most tests first, `--loadscope-reorder`) queued the megakernel files, a few tests of
minutes each, last: one worker then ran them alone for minutes. pyproject.toml turns that off
(`--no-loadscope-reorder`), and tests/conftest.py orders the items with `heaviest_first`.

A file's weight is its serial seconds in tests/module_seconds.json (measured with
`python -m pytest -n 0 --junitxml=REPORT.xml`, written by `python tests/suite_order.py REPORT.xml`).
A file not in it (a new one) is estimated from its tests' marks: SLOW_GUESS seconds per slow test,
FAST_GUESS per other test. Only the order depends on these figures, never a result.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

TABLE = Path(__file__).with_name("module_seconds.json")
SLOW_GUESS = 30.0  # a slow test: an interpret-mode kernel or a libtpu compile, tens of seconds
FAST_GUESS = 0.5


def load_table(path: Path = TABLE) -> dict[str, float]:
    """File name -> measured serial seconds; empty if the table is missing or unreadable."""
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text(encoding="utf-8")).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def file_weights(tests: Iterable[tuple[str, bool]], table: dict[str, float]) -> dict[str, float]:
    """(file name, slow?) per test -> each file's weight: measured seconds, else the marks' guess."""
    guess: dict[str, float] = defaultdict(float)
    for name, slow in tests:
        guess[name] += SLOW_GUESS if slow else FAST_GUESS
    return {name: table.get(name, g) for name, g in guess.items()}


def heaviest_first(files: Sequence[str], slow: Sequence[bool], table: dict[str, float]) -> list[int]:
    """A permutation of the tests (given by file name and slow mark, in collection order): files
    by weight descending (ties by name), each file's tests together and in their own order."""
    weights = file_weights(zip(files, slow, strict=True), table)
    return sorted(range(len(files)), key=lambda i: (-weights[files[i]], files[i], i))


def seconds_per_file(junit_xml: Path) -> dict[str, float]:
    """Serial seconds per test file (calls, set-ups and teardowns) from a pytest JUnit XML report."""
    total: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")  # tests.test_x, or tests.test_x.TestClass
        total[parts[1 if parts[0] == "tests" else 0] + ".py"] += float(case.get("time", 0.0))
    return {k: round(v, 1) for k, v in sorted(total.items(), key=lambda kv: -kv[1])}


if __name__ == "__main__":  # python tests/suite_order.py REPORT.xml: rewrite module_seconds.json
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/suite_order.py REPORT.xml")
    TABLE.write_text(json.dumps(seconds_per_file(Path(sys.argv[1])), indent=1) + "\n", encoding="utf-8")
