"""A kernel libtpu rejects is mkdsl's internal compiler error (exit 3), naming the op, the spec line
and Mosaic's message; never a usage error with a traceback.

The rejected kernel is tests/data/delta_narrow.mk's with the fix for its narrow value heads undone
(the loop over the heads' slots kept, slicing 64-wide columns at a loop index): what libtpu refused
before the fix. Cost: one failed compile and one lowering, ~15 s (slow-marked); the CLI test is fast
(the compile replaced by its failure).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from compile_helpers import compile_one_core, tpu7x_devices

from mkdsl import cli
from mkdsl.backends.tpu import bundle_dump
from mkdsl.backends.tpu.mosaic_errors import KernelCompileError, Site
from mkdsl.compiler import compile_source

NARROW = Path(__file__).resolve().parent / "data" / "delta_narrow.mk"
FIX = "self.unrolled = s_in.shape[2] % 128 != 0 or s_in.shape[3] % 128 != 0"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rejected_kernel_names_the_op_and_the_spec_line(tmp_path):
    text = NARROW.read_text(encoding="utf-8")
    out, _ = compile_source(text, str(NARROW), None, None)
    kernel = out.files["kernel.py"]
    assert FIX in kernel
    path = tmp_path / "kernel.py"
    path.write_text(kernel.replace(FIX, "self.unrolled = False"), encoding="utf-8")
    spec = importlib.util.spec_from_file_location("delta_narrow_unfixed", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(KernelCompileError) as err:
        compile_one_core(module, tpu7x_devices("tpu7x:2x2x1")[0], 1, 256)
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if "= recurrent(" in ln)
    message = str(err.value)
    assert f"op recurrent, linear at spec line {line}: o = recurrent(" in message, message
    assert "Recurrent.block" in message and "multiple of 128" in message, message
    assert {s.spec_line for s in err.value.sites} == {line}, err.value.sites


def test_cli_reports_a_rejected_kernel_as_an_internal_error(monkeypatch, capsys):
    """`mkdsl plan --static` (its compile in a child process) exits 3, not 2, and prints no traceback."""
    site = Site(37, "o = recurrent(q, k, v, st)", "Recurrent.block", 1009)
    mosaic = "INTERNAL: Mosaic failed to compile TPU kernel: cannot statically prove that index in dimension 1 is a multiple of 128"

    def rejected(*args, **kwargs):
        raise KernelCompileError("", text=str(KernelCompileError(mosaic, (site,))))

    monkeypatch.setattr(bundle_dump, "dump_kernel", rejected)
    status = cli.main(["plan", str(NARROW), "--static"])
    err = capsys.readouterr().err
    assert status == 3, err
    assert "internal compiler error" in err and "spec line 37" in err and "multiple of 128" in err, err
    assert "Traceback" not in err, err
