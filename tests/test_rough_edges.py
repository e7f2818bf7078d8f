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


# ---------------------------------------------------------------------------- mkdsl run

LLAMA = ROOT / "specs" / "llama3_8b.mk"


@pytest.fixture(scope="module")
def llama_hf(tmp_path_factory):
    """The Llama mini as a Hugging Face checkpoint with a byte-level tokenizer (as tests/test_run.py)."""
    import json

    from checkpoint_writers import hf_tensors
    from safetensors.numpy import save_file
    from test_run import write_tokenizer

    import mkdsl

    spec = mkdsl.load(LLAMA, "mini")
    weights, _ = mkdsl.random_inputs(spec, batch=1, seq_len=256, seed=5)
    root = tmp_path_factory.mktemp("llama_mini_hf")
    save_file(hf_tensors(weights, 2), str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    write_tokenizer(root, spec.model.const["V"])
    return root


@pytest.fixture
def run_cache(tmp_path_factory, monkeypatch) -> Path:
    cache = tmp_path_factory.getbasetemp() / "mkdsl-cache"
    monkeypatch.setenv("MKDSL_CACHE", str(cache))
    return cache


@pytest.fixture
def no_load(monkeypatch):
    """`mkdsl run` must not reach the checkpoint's data."""
    from mkdsl.checkpoint import loader

    def refuse(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded before the arguments were checked")

    monkeypatch.setattr(loader, "load_weights", refuse)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompt", ""], "--prompt 1 is empty"),
        (["--prompt", "hi", "--max-tokens", "200000"], "prompt tokens + --max-tokens 200000 exceed the cache (131072)"),
        (
            ["--prompt", "the " * 132000, "--max-tokens", "1"],
            "prompt tokens + --max-tokens 1 exceed the cache (131072)",
        ),
        (["--prompt", "a", "--prompt", "b " * 131070, "--batch", "1"], "exceed the cache"),  # the second group
    ],
)
def test_run_reports_argument_problems_before_loading(llama_hf, run_cache, no_load, capsys, extra, message):
    argv = ["run", str(LLAMA), "-p", "mini", "--weights", str(llama_hf), *extra]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_run_with_empty_standard_input_is_a_usage_error(llama_hf, run_cache, no_load, monkeypatch, capsys):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("\n  \n"))
    assert main(["run", str(LLAMA), "-p", "mini", "--weights", str(llama_hf)]) == 2
    assert "standard input is empty" in capsys.readouterr().err


class HistoryDecoder:
    """A stand-in for the kernel's decoder whose next token depends on each row's whole history
    (every token fed, at its position), so a row fed the wrong token or position goes astray."""

    prefill_fn = None

    def __init__(self, batch: int, steps_per_call: int, vocab: int = 97):
        self.batch, self.steps_per_call, self.vocab = batch, steps_per_call, vocab
        self.history: list[list[int]] = []

    def _next(self, h: list[int]) -> int:
        return (sum((i + 3) * t for i, t in enumerate(h)) * 31 + len(h)) % self.vocab

    def prefill(self, tokens):
        self.history = [list(map(int, r)) for r in tokens]
        import numpy as np

        return np.array([self._next(h) for h in self.history])

    def decode(self, tokens, position, n):
        import numpy as np

        out = []
        for h, t in zip(self.history, tokens, strict=True):
            assert len(h) == position  # every row is at the shared position
            row, t = [], int(t)
            for _ in range(n):
                h.append(t)
                t = self._next(h)
                row.append(t)
            out.append(row)
        return np.array(out)


@pytest.mark.parametrize("steps_per_call", [1, 3])
def test_rows_with_different_prompts_generate_as_each_would_alone(steps_per_call):
    from mkdsl.run.decode import generate

    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8], [9], [4, 4, 4, 4]]
    together = generate(HistoryDecoder(4, steps_per_call), prompts, 6, frozenset())
    for row, prompt in enumerate(prompts):
        alone = generate(HistoryDecoder(1, 1), prompt, 6, frozenset())
        assert list(together.tokens[row]) == list(alone.tokens[0]), row
        assert len(alone.tokens[0]) == 6


def test_prompt_groups_fill_rows_in_order():
    from mkdsl.run.prompts import groups

    def encode(text):
        return [len(text)] * len(text)

    (one,) = groups(["ab"], 3, encode, lambda n: None)
    assert one.texts == ("ab",) * 3 and one.shown == 1
    first, last = groups(["a", "bb", "ccc"], 2, encode, lambda n: None)
    assert first.texts == ("a", "bb") and first.ids == ((1,), (2, 2)) and first.shown == 2
    assert last.texts == ("ccc", "ccc") and last.shown == 1


def test_a_damaged_cached_kernel_is_rebuilt(run_cache):
    from mkdsl.run import decode

    source = TINY.read_text()
    _, where = decode.cached_kernel(source, str(TINY), None)
    kernel = where / "kernel.py"
    good = kernel.read_bytes()
    kernel.write_bytes(good[: len(good) // 2])  # a half-written copy, say
    for name in [n for n in sys.modules if n.startswith("mkdsl_cached_kernel_")]:
        del sys.modules[name]  # a new process
    module, again = decode.cached_kernel(source, str(TINY), None)
    assert again == where and kernel.read_bytes() == good
    assert hasattr(module, "build_decode_step")
    where.with_name(where.name + ".sha256").unlink()  # an entry without its digest is not trusted either
    kernel.write_bytes(b"garbage")
    decode.cached_kernel(source, str(TINY), None)
    assert kernel.read_bytes() == good


CACHE_MOVES = """
import os, sys, pathlib, jax, jax.numpy as jnp
from mkdsl.run.decode import use_compilation_cache
for i, root in enumerate(sys.argv[1:]):
    os.environ["MKDSL_CACHE"] = root
    use_compilation_cache()
    jax.jit(lambda x: x * (i + 2) + 1)(jnp.ones(3)).block_until_ready()
print(*(len(list((pathlib.Path(r) / "jax").glob("*"))) for r in sys.argv[1:]))
"""


def test_the_compilation_cache_follows_mkdsl_cache_within_a_process(tmp_path):
    """JAX opens its persistent cache once, at the first directory it sees: a second directory in
    the same process (a test session, a server) got nothing until mkdsl reset it (CI failed so).
    A fresh process, so that this worker's JAX keeps its own settings."""
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", CACHE_MOVES, *roots], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    first, second = map(int, done.stdout.split())
    assert first >= 1 and second >= 1, done.stdout  # each directory holds its own executable


@pytest.mark.slow
def test_run_gives_each_row_its_prompt_says_it_emulates_and_caches_compiles(llama_hf, run_cache, capsys):
    argv = ["run", str(LLAMA), "-p", "mini", "--weights", str(llama_hf), "--interpret", "--max-tokens", "2"]
    assert main([*argv, "--prompt", "the hello", "--prompt", "he"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("the hello")
    assert re.search(r"^\[row 1\] he", out, re.M), out  # row 1 ran its own prompt
    assert err.count("TPU interpret mode, an emulation on the CPU") == 1
    assert err.index("emulation on the CPU") < err.index("loaded 21 tensors")  # said up front
    assert re.search(r"expect roughly [\d.]+ s per step, \d+ s for 2 tokens", err), err
    assert any((run_cache / "jax").iterdir())  # XLA's executables kept for the next run


def test_an_interrupt_landing_in_a_collector_callback_is_not_lost():
    import gc
    import signal

    from mkdsl.run.prompts import interrupts_kept

    def _xla_gc_callback(phase, info):  # named as JAX's: Ctrl-C pressed while it runs
        if phase == "start":
            signal.raise_signal(signal.SIGINT)

    gc.callbacks.append(_xla_gc_callback)
    went_on = False
    try:
        with pytest.raises(KeyboardInterrupt), interrupts_kept():
            gc.collect()  # Python would print "Exception ignored" and drop a KeyboardInterrupt raised here
            went_on = True
    finally:
        gc.callbacks.remove(_xla_gc_callback)
    assert went_on  # the collector finished undisturbed; the interrupt came after


def test_an_interrupt_landing_in_a_finalizer_is_not_lost_nor_printed(monkeypatch):
    """As above, in a `weakref.finalize` callback (a temporary file's cleanup during a load: CI saw
    "Exception ignored in: <finalize object ...>" and a traceback once)."""
    import signal
    import sys
    import weakref

    from mkdsl.run.prompts import interrupts_kept

    class Held:
        pass

    ignored = []
    monkeypatch.setattr(sys, "unraisablehook", ignored.append)
    went_on = False
    with pytest.raises(KeyboardInterrupt), interrupts_kept():
        held = Held()
        weakref.finalize(held, signal.raise_signal, signal.SIGINT)  # Ctrl-C pressed while it runs
        del held
        went_on = True
    assert went_on and ignored == []


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.4, 1.5])
def test_ctrl_c_while_the_checkpoint_loads_stops_the_run(llama_hf, run_cache, delay):
    import queue
    import signal
    import time

    argv = ["run", str(LLAMA), "-p", "mini", "--weights", str(llama_hf), "--prompt", "the", "--interpret"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MKDSL_CACHE": str(run_cache)}
    p = subprocess.Popen(
        [sys.executable, "-m", "mkdsl", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in p.stderr] + [lines.put(None)], daemon=True).start()
    seen = []
    try:
        while not seen or "emulation on the CPU" not in seen[-1]:  # the notice comes right before the load
            line = lines.get(timeout=90)
            assert line is not None, "".join(seen)
            seen.append(line)
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        p.wait(timeout=120)
    finally:
        p.kill()
        p.wait()
    while (line := lines.get(timeout=10)) is not None:
        seen.append(line)
    err = "".join(seen)
    assert p.returncode == 130, err
    assert "mkdsl: interrupted" in err
    assert "Exception ignored" not in err and "Traceback" not in err


# ---------------------------------------------------------------------------- inputs out of range, NaN


@pytest.fixture(scope="module")
def tiny_spec():
    import mkdsl

    return mkdsl.load(TINY)


def test_reference_step_clamps_and_flags_inputs_out_of_range(tiny_spec):
    import numpy as np

    import mkdsl

    weights, state = mkdsl.random_inputs(tiny_spec, batch=5, seq_len=256, seed=1)
    tokens = np.array([3, 256, -1, 7, 9], np.int32)  # vocabulary 256, cache 256
    positions = np.array([4, 0, 0, -1, 256], np.int32)
    logits, next_tokens, new_state = mkdsl.reference_step(tiny_spec)(weights, state, tokens, positions)
    logits, next_tokens = np.asarray(logits), np.asarray(next_tokens)
    assert list(next_tokens[1:]) == [-1, -1, -1, -1]
    assert np.isnan(logits[1:]).all() and np.isfinite(logits[0]).all()
    assert 0 <= next_tokens[0] < 256
    for name, s in new_state.items():  # every write stayed inside the cache, every value finite
        assert s.shape == state[name].shape and np.isfinite(np.asarray(s, np.float32)).all(), name
    alone, _ = mkdsl.random_inputs(tiny_spec, batch=1, seq_len=256, seed=1)
    one_state = {k: v[:, :1] for k, v in state.items()}  # row 0 of the caches (stacked: [layers, batch, ...])
    ref0, tok0, _ = mkdsl.reference_step(tiny_spec)(weights, one_state, tokens[:1], positions[:1])
    assert int(tok0[0]) == next_tokens[0]
    np.testing.assert_array_equal(np.asarray(ref0)[0], logits[0])  # the same arithmetic on the same row


def test_prefill_step_clamps_and_flags_inputs_out_of_range(tiny_spec):
    import numpy as np

    import mkdsl

    weights, state = mkdsl.random_inputs(tiny_spec, batch=4, seq_len=256, seed=2)
    tokens = np.array([[1, 2, 3], [1, 256, 3], [1, 2, 3], [4, 5, 6]], np.int32)
    start = np.array([0, 0, -1, 254], np.int32)  # row 3 would write positions 254..256
    prefill = mkdsl.prefill_step(tiny_spec, donate=False)
    logits, next_tokens, new_state = prefill(weights, state, tokens, start=start)
    logits, next_tokens = np.asarray(logits), np.asarray(next_tokens)
    assert list(next_tokens[1:]) == [-1, -1, -1]
    assert np.isnan(logits[1:]).all() and np.isfinite(logits[0]).all() and 0 <= next_tokens[0] < 256
    for name, s in new_state.items():
        assert np.isfinite(np.asarray(s, np.float32)).all(), name


def test_a_nan_logit_is_never_chosen_by_the_reference_or_the_sampler():
    import numpy as np

    from mkdsl.ops import OPS
    from mkdsl.run.sampling import Sampling, sample_tokens

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 64)).astype(np.float32)
    top = logits.argmax(axis=1)
    logits[0, 5] = np.nan  # a NaN beside a finite best
    logits[1, top[1]] = np.nan  # the best itself is NaN: the next best wins
    logits[2] = np.nan  # all NaN: token 0
    second = int(np.argsort(np.where(np.isnan(logits[1]), -np.inf, logits[1]))[-1])
    want = [int(top[0]), second, 0]
    (greedy,) = OPS["argmax"].reference(logits)
    assert list(np.asarray(greedy)) == want
    positions = np.zeros(3, np.int32)
    assert list(np.asarray(sample_tokens(logits, positions, 0, Sampling()))) == want
    for seed in range(5):  # sampling never draws a NaN logit either
        drawn = np.asarray(sample_tokens(logits[:2], positions[:2], seed, Sampling(temperature=1.0, top_k=8)))
        assert not np.isnan(logits[np.arange(2), drawn]).any()


@pytest.mark.slow
def test_the_kernel_under_an_outer_jit_clamps_flags_and_skips_nan_logits(tiny_spec):
    import jax
    import numpy as np

    import mkdsl

    weights, state = mkdsl.random_inputs(tiny_spec, batch=5, seq_len=256, seed=3)
    tokens = np.array([3, 256, -1, 5, 6], np.int32)
    positions = np.array([2, 0, 0, 256, -1], np.int32)  # rows 1..4 out of range: no check sees them under jit
    ref_logits, ref_next, _ = mkdsl.reference_step(tiny_spec)(weights, state, tokens, positions)
    best = int(np.asarray(ref_next)[0])
    weights["lm_head"] = np.array(weights["lm_head"])
    weights["lm_head"][:, best] = np.nan  # row 0's best logit becomes NaN
    ref_logits, ref_next, _ = mkdsl.reference_step(tiny_spec)(weights, state, tokens, positions)
    ref_logits, ref_next = np.asarray(ref_logits), np.asarray(ref_next)
    assert ref_next[0] != best and list(ref_next[1:]) == [-1] * 4

    step = mkdsl.build_step(tiny_spec, batch=5, seq_len=256)
    outer = jax.jit(lambda w, s, t, p: step(w, s, t, p))  # values unknown to the wrapper's checks
    logits, next_tokens, new_state = outer(mkdsl.kernel_weights(weights), state, tokens, positions)
    logits, next_tokens = np.asarray(logits), np.asarray(next_tokens)
    assert list(next_tokens) == list(ref_next)  # the NaN column skipped as the reference skips it
    assert np.isnan(logits[1:]).all()
    finite = np.isfinite(ref_logits[0])
    assert np.array_equal(np.isfinite(logits[0]), finite) and not finite[best]
    # 2^-6 of the row's largest logit: mkdsl/verify/kernel.py's logit bound (bf16 matmul inputs)
    scale = float(np.abs(ref_logits[0][finite]).max())
    assert float(np.abs(logits[0][finite] - ref_logits[0][finite]).max()) <= 2**-6 * scale
    for name, s in new_state.items():
        assert s.shape == state[name].shape and np.isfinite(np.asarray(s, np.float32)).all(), name


def test_load_weights_can_refuse_non_finite_values(tmp_path):
    import json

    import numpy as np
    from checkpoint_writers import hf_tensors
    from safetensors.numpy import save_file

    import mkdsl
    from mkdsl.checkpoint.formats import CheckpointError

    spec = mkdsl.load(LLAMA, "mini")
    weights, _ = mkdsl.random_inputs(spec, batch=1, seq_len=256, seed=5)
    tensors = hf_tensors(weights, 2)
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name].copy()
    tensors[name][3, 4] = np.nan
    tensors[name][5, 6] = np.inf
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    with pytest.raises(CheckpointError, match=rf"tensor `{re.escape(name)}` holds 2 non-finite values"):
        mkdsl.load_weights(spec, tmp_path, host=True, progress=False, check_finite=True)
    loaded, _ = mkdsl.load_weights(spec, tmp_path, host=True, progress=False)  # by default it loads
    assert np.isnan(np.asarray(loaded["w_up"], np.float32)).any()


def test_a_gguf_exports_as_a_hugging_face_checkpoint(tmp_path):
    import gguf
    import numpy as np
    from checkpoint_writers import gguf_tensors

    import mkdsl
    from mkdsl.checkpoint.formats import open_checkpoint
    from mkdsl.checkpoint.tokenizer import load_codec

    spec = mkdsl.load(LLAMA, "mini")
    c = spec.model.const
    weights, _ = mkdsl.random_inputs(spec, batch=1, seq_len=256, seed=7)
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_tokenizer_model("gpt2")
    tokens = [f"<t{i}>" for i in range(c["V"] - 4)] + ["a", "b", "ab", "<eos>"]
    w.add_token_list(tokens)
    w.add_token_merges(["a b"])
    w.add_eos_token_id(c["V"] - 1)
    w.add_chat_template("{{ messages[0]['content'] }}!")
    for name, (x, kind) in gguf_tensors(weights, 2, c["NH"], c["NKV"]).items():
        qtype = gguf.GGMLQuantizationType[kind]
        w.add_tensor(name, x if kind == "F32" else gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    out = mkdsl.export_hf(spec, path, tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    from_gguf, _ = mkdsl.load_weights(spec, path, host=True, progress=False)
    from_hf, report = mkdsl.load_weights(spec, out, host=True, progress=False)
    assert report.format == "hf" and set(from_hf) == set(from_gguf)
    for name in from_gguf:  # bf16 out, bf16 back: the same bits (q/k permutation and transposes undone exactly)
        np.testing.assert_array_equal(np.asarray(from_hf[name]), np.asarray(from_gguf[name]), err_msg=name)
    a, b = load_codec(open_checkpoint(path)), load_codec(open_checkpoint(out))
    assert b.encode("abab") == a.encode("abab") == [c["V"] - 2] * 2
    assert b.eos_ids == a.eos_ids == {c["V"] - 1} and b.chat("hi") == a.chat("hi") == "hi!"


def test_a_mosaic_error_while_a_command_runs_is_an_internal_compiler_error(monkeypatch, capsys):
    from mkdsl import cli

    def fail(args):
        raise RuntimeError("INTERNAL: Mosaic failed to compile TPU kernel: unsupported layout")

    monkeypatch.setattr(cli, "cmd_bench", fail)
    assert main(["bench", str(TINY)]) == 3
    err = capsys.readouterr().err
    assert "internal compiler error" in err and "Mosaic failed to compile TPU kernel: unsupported layout" in err
