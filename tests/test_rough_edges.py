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


def write_gguf_tokenizer(path: Path, tokens: list, merges: list, eos: int = 0, data: bool = True) -> Path:
    """A GGUF file holding a byte-level BPE tokenizer (and one small F32 tensor)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_eos_token_id(eos)
    if data:
        w.add_tensor("t", np.arange(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


GOOD_TOKENS = ["a", "b", "ab", "<eos>"]


@pytest.mark.parametrize(
    "tokens, merges, eos, message",
    [
        ([*GOOD_TOKENS[:3], b"\xff\xfe"], ["a b"], 0, "tokenizer.ggml.tokens` item 3 is not UTF-8"),
        (GOOD_TOKENS, ["a c"], 3, "merge 0 'a c' names 'c', not in the vocabulary"),
        (GOOD_TOKENS, ["ab"], 3, "merge 0 'ab' is not two tokens separated by a space"),
        (GOOD_TOKENS, ["a b"], 4, "`tokenizer.ggml.eos_token_id` is 4, not a token id in 0 .. 3"),
    ],
)
def test_gguf_tokenizer_metadata_is_validated(tmp_path, tokens, merges, eos, message):
    from mkdsl.checkpoint.formats import CheckpointError, open_checkpoint
    from mkdsl.checkpoint.tokenizer import load_codec

    path = write_gguf_tokenizer(tmp_path / "t.gguf", tokens, merges, eos)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_codec(open_checkpoint(path))


def test_a_valid_gguf_tokenizer_still_loads(tmp_path):
    from mkdsl.checkpoint.formats import open_checkpoint
    from mkdsl.checkpoint.tokenizer import load_codec

    codec = load_codec(open_checkpoint(write_gguf_tokenizer(tmp_path / "t.gguf", GOOD_TOKENS, ["a b"], 3)))
    assert codec.eos_ids == {3} and codec.encode("ab") == [2]


def test_a_truncated_gguf_says_how_many_bytes_it_has(tmp_path):
    from mkdsl.checkpoint.formats import CheckpointError, open_checkpoint

    path = write_gguf_tokenizer(tmp_path / "t.gguf", GOOD_TOKENS, ["a b"], 3)
    whole = path.read_bytes()
    path.write_bytes(whole[:-100])
    with pytest.raises(CheckpointError, match=rf"truncated: {len(whole) - 100} of {len(whole)} bytes"):
        open_checkpoint(path)


def test_gguf_tensors_sharing_bytes_are_refused(tmp_path):
    import gguf
    import numpy as np

    from mkdsl.checkpoint.formats import CheckpointError, open_checkpoint

    path = tmp_path / "two.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.w", np.arange(64, dtype=np.float32))
    w.add_tensor("blk.1.w", np.arange(64, dtype=np.float32) + 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    first, second = gguf.GGUFReader(str(path)).tensors
    at = second.field.offset + sum(p.nbytes for p in second.field.parts[:5])  # its data offset, a u64
    data = bytearray(path.read_bytes())
    data[at : at + 8] = first.field.parts[5].tobytes()  # the second tensor's data is the first's
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="tensors `blk.0.w` and `blk.1.w` overlap"):
        open_checkpoint(path)


def test_readme_starts_with_a_virtual_environment_and_git_ignores_it():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first = readme.split("```sh\n", 1)[1].splitlines()[0]
    assert first.startswith("python -m venv .venv && . .venv/bin/activate")
    ignored = subprocess.run(
        ["git", "check-ignore", ".venv/bin/python", "out/tiny/kernel.py"], cwd=ROOT, capture_output=True, text=True
    )
    assert ignored.stdout.split() == [".venv/bin/python", "out/tiny/kernel.py"]


def test_readme_and_cli_agree_on_the_exit_status_of_an_unreadable_checkpoint(tmp_path, capsys):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    status = readme.split("Exit status:", 1)[1].split("\n\n", 1)[0]
    one = status.split(" 1 ", 1)[1].split(", 2 ", 1)[0]
    assert "truncated" in one  # README: a truncated checkpoint exits 1
    path = write_gguf_tokenizer(tmp_path / "t.gguf", GOOD_TOKENS, ["a b"], 3)
    path.write_bytes(path.read_bytes()[:-100])
    spec = ROOT / "specs" / "llama3_8b.mk"
    assert main(["run", str(spec), "-p", "mini", "--weights", str(path), "--prompt", "x"]) == 1
    assert "truncated" in capsys.readouterr().err
