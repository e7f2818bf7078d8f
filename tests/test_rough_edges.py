"""The rough edges of issue 26, each pinned by a test: runtime inputs, loader, cache and CLI."""

from __future__ import annotations

import os
import re
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


def test_plan_prints_the_compile_ratio_to_three_places(tiny_out, capsys):
    assert main(["plan", str(TINY)]) == 0
    out = capsys.readouterr().out
    ratio = re.search(r"HBM floor [\d.]+ us \(([\d.]+) x\)", out)
    assert ratio and len(ratio[1].split(".")[1]) == 3, out  # compile prints `(234.557 x)`
    assert "profile none" not in out


def _svg_fills(svg: str) -> dict[str, str]:
    """VMEM category -> fill colour of its rect in plan.svg."""
    return {m["group"]: m["fill"] for m in re.finditer(r'fill="(?P<fill>#\w+)"[^>]*data-group="(?P<group>[^"]+)"', svg)}


def test_plan_svg_colours_labels_and_title(tiny_out, tmp_path):
    from mkdsl.report.svg import COLOURS

    tiny_svg = (tiny_out / "plan.svg").read_text()
    assert "profile none" not in tiny_svg
    assert "collectives 0.0 us" not in tiny_svg  # tiny runs on one device
    spec = ROOT / "specs" / "kimi_k3.mk"
    assert main(["compile", str(spec), "--profile", "mini", "-o", str(tmp_path / "kimi")]) == 0
    kimi_svg = (tmp_path / "kimi" / "plan.svg").read_text()
    a, b = _svg_fills(tiny_svg), _svg_fills(kimi_svg)
    assert a and b and set(a) != set(b)  # different category sets, so rank colouring would shift
    for group in set(a) & set(b):
        assert a[group] == b[group], group  # a category keeps its colour between pictures
    assert not set(a.values()) & set(COLOURS.values())  # and never shares one with a cost kind
    assert len(set(b.values())) == len(b)
    for svg in (tiny_svg, kimi_svg):  # every span of the step bar is named, however narrow
        graphs = set(re.findall(r'data-graph="([^"]+)"', svg.split('<g id="graphs">')[0]))
        texts = " ".join(re.findall(r"<text[^>]*>([^<]*)</text>", svg.split('<g id="graphs">')[0]))
        for g in graphs:
            assert ("outside the layers" if g == "step" else g) in texts, g


def test_plan_top_costs_name_what_the_spec_author_wrote(capsys):
    assert main(["plan", str(ROOT / "specs" / "kimi_k3.mk"), "--profile", "mini", "--full"]) == 0
    out = capsys.readouterr().out
    collectives = [line for line in out.splitlines() if "reduce" in line and " of " in line]
    assert collectives
    for line in collectives:  # no shard-pass suffix (`add__sum`), no numbered temporary (`linear_7`)
        assert not re.search(r"`\w*(__\w+|_\d+)`", line), line


def test_verify_without_libtpu_is_a_usage_error_naming_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "libtpu", None)  # as if not installed: import and find_spec fail
    assert main(["verify", str(TINY), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "pip install -e '.[tpu]'" in err and "--no-compile" in err
    assert "FAILED" not in err


MOSAIC_FAILURE = """Traceback (most recent call last):
  File "/x/mkdsl/backends/tpu/bundle_dump.py", line 69, in <module>
    print(json.dumps(_compile_here(kernel_path, int(b), int(s))))
  File "/tmp/mkdsl-static-1/kernel.py", line {line}, in _body
    acc = jnp.dot(x, w)
jax.errors.JaxRuntimeError: INTERNAL: Mosaic failed to compile TPU kernel: unsupported shape cast
"""


def test_a_libtpu_failure_is_an_internal_compiler_error_naming_the_spec_line(tiny_out, monkeypatch, capsys):
    from mkdsl.backends.tpu import bundle_dump

    kernel = (tiny_out / "kernel.py").read_text().splitlines()
    line = next(i for i, s in enumerate(kernel, 1) if "# spec line 44:" in s) + 1  # the line under it

    def fail(*args, **kwargs):
        raise bundle_dump.DumpError(f"the libtpu compile failed:\n{MOSAIC_FAILURE.format(line=line)}")

    monkeypatch.setattr(bundle_dump, "dump_kernel", fail)
    assert main(["plan", str(TINY), "--static"]) == 3
    err = capsys.readouterr().err
    assert "internal compiler error" in err and "spec line 44" in err
    assert "Mosaic failed to compile TPU kernel: unsupported shape cast" in err
    assert "Traceback" not in err and "File " not in err
