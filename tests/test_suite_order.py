"""The suite's file order (tests/suite_order.py): heaviest files first, each file's tests together,
and xdist told to keep that order."""

from __future__ import annotations

import tomllib
from pathlib import Path

import conftest
from suite_order import FAST_GUESS, SLOW_GUESS, file_weights, heaviest_first, load_table, seconds_per_test, updated

ROOT = Path(__file__).resolve().parent.parent


def test_files_are_queued_by_measured_seconds_then_by_their_marks():
    ids = ["a.py::x", "b.py::x", "a.py::y", "new.py::x", "c.py::x", "b.py::y", "new.py::y"]
    slow = [False, False, False, True, False, True, False]
    table = {"a.py::x": 5.0, "b.py::y": 100.0, "c.py::x": 1.0}
    weights = file_weights(ids, slow, table)
    assert weights == {  # measured where listed, else guessed
        "a.py": 5.0 + FAST_GUESS,
        "b.py": FAST_GUESS + 100.0,
        "new.py": SLOW_GUESS + FAST_GUESS,
        "c.py": 1.0,
    }
    assert SLOW_GUESS > 5.0 + FAST_GUESS
    assert heaviest_first(ids, slow, table) == [1, 5, 3, 6, 0, 2, 4]  # b, new, a, c


def test_many_fast_tests_do_not_outrank_one_slow_test():
    ids = [f"many.py::t{k}" for k in range(15)] + ["kernel.py::t"]
    order = heaviest_first(ids, [False] * 15 + [True], {})
    assert order == [15, *range(15)]


class FakeItem:
    """What tests/conftest.py's collection hook reads of a pytest item."""

    def __init__(self, path: str, name: str):
        self.path, self.originalname, self.nodeid, self.marks = Path(path), name, f"{path}::{name}", set()

    def add_marker(self, mark) -> None:
        self.marks.add(mark.name)

    def get_closest_marker(self, name: str):
        return name if name in self.marks else None


def test_the_collection_hook_marks_then_queues_heaviest_file_first():
    """tests/conftest.py applies the order: a megakernel file of two slow tests, collected last
    (as xdist's test-count order queued it), comes first; fast files keep their relative order."""
    items = [FakeItem(f"tests/test_zz_fast_{k % 3}.py", f"test_{k}") for k in range(9)]
    items.sort(key=lambda i: i.path.name)
    items += [FakeItem("tests/test_kimi_kernel.py", "test_kimi_k3_mini_matches_reference")] * 2
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.path.name for i in items[:2]] == ["test_kimi_kernel.py"] * 2
    assert all(i.get_closest_marker("slow") for i in items[:2])
    assert [i.path.name for i in items[2:]] == sorted(i.path.name for i in items[2:])


def test_xdist_keeps_the_order_and_hands_out_whole_files():
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"]["ini_options"]
    opts = addopts["addopts"].split()
    assert "--no-loadscope-reorder" in opts  # else xdist re-sorts files by their number of tests
    assert opts[opts.index("--dist") + 1] == "loadfile"


def test_the_list_is_updated_from_a_junit_report_or_a_durations_listing(tmp_path):
    report = tmp_path / "report.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_x" name="test_a[1]" time="16.31"/>'
        '<testcase classname="tests.test_x.TestGroup" name="test_b" time="12.5"/>'
        '<testcase classname="tests.test_y" name="test_c" time="0.5"/>'
        "</testsuite></testsuites>",
        encoding="utf-8",
    )
    want = {"tests/test_x.py::TestGroup::test_b": 12.5, "tests/test_x.py::test_a[1]": 16.31}
    assert seconds_per_test(report) == {**want, "tests/test_y.py::test_c": 0.5}
    listing = tmp_path / "durations.txt"
    listing.write_text(
        "===== slowest durations =====\n12.00s call     tests/test_x.py::TestGroup::test_b\n"
        "0.50s setup    tests/test_x.py::TestGroup::test_b\n16.31s call     tests/test_x.py::test_a[1]\n"
        "9.90s call     tests/test_y.py::test_c\n",
        encoding="utf-8",
    )
    measured = seconds_per_test(listing)
    assert measured == {**want, "tests/test_y.py::test_c": 9.9}
    old = {"tests/test_y.py::test_c": 30.0, "tests/test_z.py::test_d": 20.0, "tests/test_x.py::test_a[1]": 11.0}
    # re-measured: updated (to 0.1 s), or dropped under LISTED seconds; not re-measured: kept
    assert list(updated(old, measured).items()) == [
        ("tests/test_z.py::test_d", 20.0),
        ("tests/test_x.py::test_a[1]", 16.3),
        ("tests/test_x.py::TestGroup::test_b", 12.5),
    ]
    table = tmp_path / "t.json"
    assert load_table(table) == {}  # missing: every test guessed from its marks
    table.write_text('{"tests/test_x.py::test_a[1]": 6.2}', encoding="utf-8")
    assert load_table(table) == {"tests/test_x.py::test_a[1]": 6.2}


def test_the_listed_tests_are_heavier_than_the_guesses():
    """The committed list holds the slow tail: each entry at least LISTED (= SLOW_GUESS) seconds, so a slow test
    that is not listed (guessed) is lighter than the listed ones."""
    table = load_table()
    assert table, "tests/slowest_tests.json is missing or empty"
    assert min(table.values()) >= SLOW_GUESS
