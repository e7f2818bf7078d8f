"""The order the suite's test files are queued in: heaviest first.

With `--dist loadfile` (pyproject.toml) xdist hands each worker a whole file, and the run lasts as
long as the busier worker. Queued heaviest first (longest-processing-time first), the last files
handed out are short, so the two workers finish within seconds of each other. xdist's default
order (most tests first, `--loadscope-reorder`) queued the megakernel files, a few tests of
minutes each, last: one worker then ran them alone for minutes. pyproject.toml turns that off
(`--no-loadscope-reorder`), and tests/conftest.py orders the items with `heaviest_first`.

A file's weight is the sum of its tests' seconds: measured for the slowest tests, listed in
tests/slowest_tests.json (test id -> seconds), else guessed from the test's marks (SLOW_GUESS for a
slow test, FAST_GUESS for another). `python tests/suite_order.py REPORT` updates the list with the
tests of a pytest JUnit XML report (`--junitxml=REPORT`) or of a saved `--durations=N` listing. Only the order
depends on these figures, never a result.
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

TABLE = Path(__file__).with_name("slowest_tests.json")
SLOW_GUESS = 10.0  # a slow test not listed: below the listed ones (an interpret-mode kernel, a compile)
FAST_GUESS = 0.5
LISTED = SLOW_GUESS  # tests of at least this many seconds are listed
DURATION = re.compile(r"^([0-9.]+)s (?:setup|call|teardown)\s+(\S+)$")


def load_table(path: Path = TABLE) -> dict[str, float]:
    """Test id -> measured seconds; empty if the list is missing or unreadable."""
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text(encoding="utf-8")).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def file_weights(ids: Sequence[str], slow: Sequence[bool], table: dict[str, float]) -> dict[str, float]:
    """Each test file's weight: its tests' measured seconds, else their marks' guesses."""
    weights: dict[str, float] = defaultdict(float)
    for test, is_slow in zip(ids, slow, strict=True):
        guess = SLOW_GUESS if is_slow else FAST_GUESS
        weights[test.split("::")[0]] += table.get(test, guess)
    return dict(weights)


def heaviest_first(ids: Sequence[str], slow: Sequence[bool], table: dict[str, float]) -> list[int]:
    """A permutation of the tests (ids `path::name`, slow marks, in collection order): files by
    weight descending (ties by path), each file's tests together and in their own order."""
    weights = file_weights(ids, slow, table)
    files = [test.split("::")[0] for test in ids]
    return sorted(range(len(ids)), key=lambda i: (-weights[files[i]], files[i], i))


def seconds_per_test(report: Path) -> dict[str, float]:
    """Test id -> seconds (set-up, call and teardown) from a JUnit XML report or a `--durations`
    listing."""
    total: dict[str, float] = defaultdict(float)
    text = report.read_text(encoding="utf-8")
    if text.lstrip().startswith("<"):
        for case in ET.fromstring(text).iter("testcase"):
            module, *cls = case.get("classname", "").split(".")[1:] or [""]  # tests.test_x[.Class]
            total["::".join([f"tests/{module}.py", *cls, case.get("name", "")])] += float(case.get("time", 0.0))
    else:
        for line in text.splitlines():
            if m := DURATION.match(line.strip()):
                total[m[2]] += float(m[1])
    return dict(total)


def updated(table: dict[str, float], measured: dict[str, float]) -> dict[str, float]:
    """The list with a (partial) run's measurements: a measured test is listed with its new
    seconds if it took LISTED or more, and dropped otherwise; other entries stay. Slowest first."""
    kept = {k: v for k, v in table.items() if k not in measured}
    kept.update({k: round(v, 1) for k, v in measured.items() if v >= LISTED})
    return dict(sorted(kept.items(), key=lambda kv: -kv[1]))


if __name__ == "__main__":  # python tests/suite_order.py REPORT: update tests/slowest_tests.json
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/suite_order.py REPORT (a JUnit XML report or a --durations listing)")
    table = updated(load_table(), seconds_per_test(Path(sys.argv[1])))
    TABLE.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
