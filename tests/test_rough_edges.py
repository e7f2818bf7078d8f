"""The rough edges of issue 26, each pinned by a test: runtime inputs, loader, cache and CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mkdsl.cli import main

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "specs" / "tiny.mk"


def tiny_with(old: str, new: str, tmp_path: Path) -> Path:
    text = TINY.read_text()
    assert old in text
    path = tmp_path / "t.mk"
    path.write_text(text.replace(old, new))
    return path


def test_a_dtype_parameter_given_twice_is_an_error(tmp_path, capsys):
    spec = tiny_with("weight w_down:    bf16", "weight w_down:    int4(group=128, group=64)", tmp_path)
    assert main(["check", str(spec)]) == 1
    assert "parameter `group` of int4 is given twice" in capsys.readouterr().err


def test_compile_of_a_named_pipe_returns(tmp_path, capsys):
    fifo = tmp_path / "spec.mk"
    os.mkfifo(fifo)
    done = []
    t = threading.Thread(target=lambda: done.append(main(["compile", str(fifo), "-o", str(tmp_path / "out")])))
    t.start()
    t.join(timeout=10)
    if t.is_alive():  # unblock the reader so the test process can end
        with open(fifo, "w"):
            pass
        t.join()
        pytest.fail("mkdsl compile waited for a writer on a named pipe")
    assert done == [2]
    assert "not a regular file" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "out"
    assert main(["compile", str(TINY), "-o", str(out)]) == 0
    return out


def test_compile_check_sees_an_extra_subdirectory(tiny_out, capsys):
    (tiny_out / "extra").mkdir()
    try:
        assert main(["compile", str(TINY), "-o", str(tiny_out), "--check"]) == 1
        assert "extra: not produced by the compiler" in capsys.readouterr().err
    finally:
        (tiny_out / "extra").rmdir()
    assert main(["compile", str(TINY), "-o", str(tiny_out), "--check"]) == 0


def test_compile_check_sees_crlf_line_ends(tiny_out, capsys):
    kernel = tiny_out / "kernel.py"
    text = kernel.read_bytes()
    kernel.write_bytes(text.replace(b"\n", b"\r\n"))
    try:
        assert main(["compile", str(TINY), "-o", str(tiny_out), "--check"]) == 1
        assert "kernel.py: differs" in capsys.readouterr().err
    finally:
        kernel.write_bytes(text)
