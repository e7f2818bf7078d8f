"""The suite's file order (tests/suite_order.py): heaviest files first, each file's tests together,
and xdist told to keep that order."""

from __future__ import annotations

import tomllib
from pathlib import Path

from suite_order import FAST_GUESS, SLOW_GUESS, file_weights, heaviest_first, load_table, seconds_per_file

ROOT = Path(__file__).resolve().parent.parent


def test_files_are_queued_by_measured_seconds_then_by_their_marks():
    files = ["test_a.py", "test_b.py", "test_a.py", "test_new.py", "test_c.py", "test_b.py", "test_new.py"]
    slow = [False, False, False, True, False, True, False]
    table = {"test_a.py": 5.0, "test_b.py": 100.0, "test_c.py": 1.0}
    order = heaviest_first(files, slow, table)
    assert sorted(order) == list(range(len(files)))
    # test_b (100 s measured) > test_new (one slow + one fast test, guessed) > test_a (5 s) > test_c (1 s)
    assert SLOW_GUESS + FAST_GUESS > 5.0
    assert order == [1, 5, 3, 6, 0, 2, 4]
    assert file_weights(zip(files, slow, strict=True), table)["test_new.py"] == SLOW_GUESS + FAST_GUESS


def test_many_fast_tests_do_not_outrank_one_slow_test():
    files = ["test_many.py"] * 40 + ["test_kernel.py"]
    order = heaviest_first(files, [False] * 40 + [True], {})
    assert order[0] == 40 and order[1:] == list(range(40))


class FakeItem:
    """What tests/conftest.py's collection hook reads of a pytest item."""

    def __init__(self, path: str, name: str):
        self.path, self.originalname, self.marks = Path(path), name, set()

    def add_marker(self, mark) -> None:
        self.marks.add(mark.name)

    def get_closest_marker(self, name: str):
        return name if name in self.marks else None


def test_the_collection_hook_marks_then_queues_heaviest_file_first():
    """tests/conftest.py applies the order: a megakernel file of two slow tests, collected last
    (as xdist's test-count order queued it), comes first; fast files keep their relative order."""
    import conftest

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


def test_the_table_is_read_from_a_junit_report(tmp_path):
    report = tmp_path / "report.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_x" name="test_a" time="1.25"/>'
        '<testcase classname="tests.test_x.TestGroup" name="test_b" time="2.5"/>'
        '<testcase classname="tests.test_y" name="test_c" time="0.5"/>'
        "</testsuite></testsuites>",
        encoding="utf-8",
    )
    assert seconds_per_file(report) == {"test_x.py": 3.8, "test_y.py": 0.5}  # rounded to 0.1 s
    table = tmp_path / "t.json"
    assert load_table(table) == {}  # missing: every file guessed from its marks
    table.write_text('{"test_x.py": 3.8}', encoding="utf-8")
    assert load_table(table) == {"test_x.py": 3.8}
