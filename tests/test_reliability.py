"""No input makes mkdsl fail internally (exit 3) or run without bound.

Each case is a minimal spec (tiny.mk with one edit) or command that once crashed, hung or ran
out of memory; now it is a positioned diagnostic (exit 1), a usage error (exit 2) or accepted.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from mkdsl.cli import main

ROOT = Path(__file__).resolve().parent.parent
TINY = (ROOT / "specs" / "tiny.mk").read_text(encoding="utf-8")
LAST = "  return x + linear(swiglu(linear(h, w_gate), linear(h, w_up)), w_down)"


def tiny(old: str, new: str) -> str:
    assert old in TINY, old
    return TINY.replace(old, new, 1)


def run(tmp_path: Path, capsys, text: str, command: str = "check", *extra: str) -> tuple[int, str, Path]:
    spec = tmp_path / "spec.mk"
    spec.write_text(text, encoding="utf-8")
    args = [command, str(spec), *extra]
    if command == "compile" and "-o" not in extra:
        args += ["-o", str(tmp_path / "out")]
    t0 = time.perf_counter()
    code = main(args)
    assert time.perf_counter() - t0 < 60, "took too long"  # a hang guard; each case takes ~1 s on an idle core
    return code, capsys.readouterr().err, spec


def diagnosed(tmp_path, capsys, text, message, command="check", line=None):
    """Exit 1 with a positioned first diagnostic containing `message`; nothing written."""
    code, err, spec = run(tmp_path, capsys, text, command)
    assert code == 1, err
    m = re.match(rf"{re.escape(str(spec))}:(\d+):(\d+): error: (.*)", err)
    assert m, err
    assert message in m[3], err
    if line is not None:
        assert int(m[1]) == line, err
    assert not (tmp_path / "out").exists()
    return err


def line_of(text: str, needle: str) -> int:
    return next(i for i, s in enumerate(text.split("\n"), 1) if needle in s)  # as the parser counts


# ---------------------------------------------------------------- constants a kernel can hold

# name: (text replaced in tiny.mk, replacement, message, text of the line the first error is on)
BIG_CONSTANTS = {
    "over-4300-digits": (
        "const V = 256",
        "const V = 256\nconst BIG = 10 ** 5000\ndim Q in BIG .. 1",
        "`10 ** 5000` is out of range",
        "BIG =",
    ),
    "a-long-literal": (
        "const V = 256",
        "const V = 99999999999999999999999",
        "this number is out of range",
        "const V =",
    ),
    "theta-10-400": ("heads=NH)\n  k", "heads=NH, theta=10 ** 400)\n  k", "10 ** 400", "theta="),
    "vocabulary-2e400": ("const V = 256", "const V = 2 * 10 ** 400", "10 ** 400", "const V ="),
    "repeated-squaring": (  # 3 ** 2 ** k: A6 = 3 ** 64 is the first beyond int64
        "const V = 256",
        "const V = 256\nconst A0 = 3\n" + "".join(f"const A{i + 1} = A{i} * A{i}\n" for i in range(40)),
        "the result of `*` is out of range",
        "const A6 =",
    ),
    "layers-2-64": ("layers L {", "layers 2 ** 64 {", "the result of `**` is out of range", "layers 2"),
    "layers-2-40": ("layers L {", "layers 2 ** 40 {", "the layer count must be at most 4096", "layers 2"),
    "cache-2-60": ("dim S in 1 .. 256", "dim S in 1 .. 2 ** 60", "the upper bound of `S` must be at most", "dim S"),
    "hidden-2-40": ("const H = 128", "const H = 2 ** 40", "must be at most 2147483647", "weight embed"),
    "mesh-2-40": (
        "dim B in 1 .. 8",
        "dim B in 1 .. 8\nmesh { tp = 2 ** 40 }",
        "mesh axis `tp` must be at most",
        "mesh",
    ),
    "mesh-product": ("dim B in 1 .. 8", "dim B in 1 .. 8\nmesh { a = 2 ** 16  b = 2 }", "devices, more than", "mesh"),
}


@pytest.mark.parametrize("old, new, message, at", BIG_CONSTANTS.values(), ids=BIG_CONSTANTS)
def test_constants_are_bounded(tmp_path, capsys, old, new, message, at):
    text = tiny(old, new)
    diagnosed(tmp_path, capsys, text, message, command="compile", line=line_of(text, at))


ATTRIBUTES = {
    "inf": ("theta=1e400", "out of range: it is inf"),
    "nan": ("theta=1e400 - 1e400", "out of range: it is inf"),
    "beyond-float32": ("theta=1e300", "beyond float32's range"),
    "rounds-to-zero": ("theta=1e-50", "rounds to 0 in float32"),
}


@pytest.mark.parametrize("attr, message", ATTRIBUTES.values(), ids=ATTRIBUTES)
def test_attributes_are_finite_and_representable(tmp_path, capsys, attr, message):
    text = tiny("heads=NH)\n  k", f"heads=NH, {attr})\n  k")
    diagnosed(tmp_path, capsys, text, message, command="compile", line=line_of(text, attr))


def test_a_split_over_a_size_one_axis_of_a_multi_device_mesh(tmp_path, capsys):
    """Splitting over a size-1 axis is no split (it crashed the plan report)."""
    text = tiny("dim B in 1 .. 8", "dim B in 1 .. 8\nmesh { tp = 2  dp = 1 }").replace("bf16[H, V]", "bf16[H, V @dp]")
    code, err, _ = run(tmp_path, capsys, text, "compile")
    assert code == 0, err
    assert (tmp_path / "out" / "plan.md").is_file()


# ---------------------------------------------------------------- depth: no RecursionError


def test_long_constant_chains_and_expressions_evaluate(tmp_path, capsys):
    chain = "".join(f"const C{i + 1} = C{i} + 1\n" for i in range(3000))
    text = tiny("const L = 2", "const C0 = 0\n" + chain + "const L = C3000 - 2998")
    text = text.replace("decoder: otherwise", "decoder: " + " or ".join(f"l == {i}" for i in range(500)))
    text = text.replace("const V = 256", "const V = " + "(" * 5000 + "256" + ")" * 5000)
    code, err, _ = run(tmp_path, capsys, text, "compile")
    assert code == 0, err


def test_nesting_up_to_the_bound_is_accepted(tmp_path, capsys):
    """Blocks and tensor expressions nest up to 100 deep (even under pytest's deep stack)."""
    blocks = "".join(f"block b{i}(x) {{ return b{i + 1}(x) }}\n" for i in range(45)) + "block b45(x) { return x }\n"
    text = tiny("layer decoder", blocks + "layer decoder").replace("h = rmsnorm(x, norm1)", "h = rmsnorm(b0(x), norm1)")
    text = text.replace(
        LAST, "  return x" + " + x" * 90 + " + linear(swiglu(linear(h, w_gate), linear(h, w_up)), w_down)"
    )
    code, err, _ = run(tmp_path, capsys, text)
    assert code == 0, err


def test_chained_blocks_are_bounded(tmp_path, capsys):
    blocks = "".join(f"block b{i}(x) {{ return b{i + 1}(x) }}\n" for i in range(300)) + "block b300(x) { return x }\n"
    text = tiny("layer decoder", blocks + "layer decoder").replace("h = rmsnorm(x, norm1)", "h = rmsnorm(b0(x), norm1)")
    err = diagnosed(tmp_path, capsys, text, "nest more than 100 deep")
    assert err.count("error:") == 1


def test_deep_tensor_expressions_are_bounded(tmp_path, capsys):
    text = tiny(LAST, "  return x" + " + x" * 500 + " + linear(swiglu(linear(h, w_gate), linear(h, w_up)), w_down)")
    diagnosed(tmp_path, capsys, text, "nest more than 100 deep", line=line_of(text, "return x + x"))


# ---------------------------------------------------------------- input files


def test_reading_dev_zero_is_a_usage_error(capsys):
    assert main(["check", "/dev/zero"]) == 2
    assert "too large for a spec" in capsys.readouterr().err


def test_a_huge_spec_is_a_usage_error(tmp_path, capsys):
    spec = tmp_path / "huge.mk"
    spec.write_text(TINY + "#" * 2**20, encoding="utf-8")
    assert main(["check", str(spec)]) == 2
    assert "too large for a spec" in capsys.readouterr().err


@pytest.fixture
def current_output(tmp_path, capsys) -> Path:
    out = tmp_path / "gen"
    assert main(["compile", str(ROOT / "specs" / "tiny.mk"), "-o", str(out)]) == 0
    capsys.readouterr()
    return out


def check_fails(out: Path, capsys, message: str) -> None:
    assert main(["compile", str(ROOT / "specs" / "tiny.mk"), "--check", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert message in err and "internal error" not in err, err


def test_check_of_a_non_utf8_file(current_output, capsys):
    (current_output / "kernel.py").write_bytes(b"\xff\xfe")
    check_fails(current_output, capsys, "kernel.py: differs (not UTF-8 text)")


def test_check_of_a_directory_in_place_of_a_file(current_output, capsys):
    (current_output / "plan.md").unlink()
    (current_output / "plan.md").mkdir()
    check_fails(current_output, capsys, "plan.md: not a regular file")


def test_check_of_an_unreadable_file(current_output, capsys, monkeypatch):
    real = Path.read_text

    def read_text(self, *args, **kwargs):  # as chmod 000 would for a user other than root
        if self.name == "kernel.py":
            raise PermissionError(13, "Permission denied")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    check_fails(current_output, capsys, "kernel.py: unreadable (Permission denied)")


# ---------------------------------------------------------------- diagnostics that mislead


@pytest.mark.parametrize("char", ["\f", "\v", "\u2028", "\x85"], ids=["form-feed", "vertical-tab", "U+2028", "NEL"])
def test_odd_line_breaks_do_not_shift_line_numbers(tmp_path, capsys, char):
    """Lines are counted at `\\n` only, as the parser counts them, and shown that way
    (the character, in a comment, would make Python's `splitlines` start a new line)."""
    text = tiny("# The smallest", f"#{char}The smallest").replace("const V = 256", "const V = zzz")
    err = diagnosed(tmp_path, capsys, text, "unknown constant `zzz`", line=line_of(text, "const V ="))
    assert f"{line_of(text, 'const V ='):>5} | const V = zzz\n" in err
    assert char not in err


def test_a_control_character_is_shown_visibly(tmp_path, capsys):
    text = tiny("const L = 2", "const L = 2 \v")
    err = diagnosed(tmp_path, capsys, text, "unexpected character U+000B", line=line_of(text, "const L"))
    assert "\v" not in err and "\u240b" in err


def test_a_duplicate_name_has_no_follow_on_errors(tmp_path, capsys):
    text = (
        (ROOT / "specs" / "kimi_k3.mk").read_text().replace("const L     = 93", "const L     = 93\nconst kda_moe = 1")
    )
    err = diagnosed(tmp_path, capsys, text, "`kda_moe` is already defined at line")
    assert err.count("error:") == 1, err


def test_vmem_budget_points_at_the_largest_allocation(tmp_path, capsys):
    """Not at 1:1 (a comment), and no advice about hints that cannot help."""
    text = tiny("const F = 256", "const F = 2 ** 22")
    err = diagnosed(tmp_path, capsys, text, "VMEM budget exceeded", "compile", line=line_of(text, "w_down)"))
    assert "ring_depth" not in err and "the spec's shapes" in err


def test_error_reporting_is_linear(tmp_path, capsys):
    """The first 200 errors are shown in full, the rest counted; the time grows linearly with the
    count (it once grew quadratically: 20,000 errors took ~50 s). 8x the errors must take well under
    the 64x a quadratic report would: < 24x, robust to a loaded machine; the small run is the best of two."""

    def seconds(n: int) -> float:
        text = TINY + "".join(f"const Z{i} = zzz\n" for i in range(n))
        t0 = time.perf_counter()
        err = diagnosed(tmp_path, capsys, text, "unknown constant `zzz`")
        assert err.count("error:") == 200 and err.endswith(
            f"{n} errors in " + str(tmp_path / "spec.mk") + " (the first 200 found are shown)\n"
        )
        return time.perf_counter() - t0

    small = min(seconds(1250), seconds(1250))
    assert seconds(10000) < 24 * small


def test_a_long_line_is_shown_around_the_caret(tmp_path, capsys):
    text = "model x const A = " + "1 + " * 100_000 + "$ + 1\n"
    err = diagnosed(tmp_path, capsys, text, "unexpected character `$`", line=1)
    assert len(err) < 1000
    shown, caret = err.splitlines()[1:3]
    assert shown[caret.index("^")] == "$"


def test_a_long_token_is_shortened_in_the_message(tmp_path, capsys):
    err = diagnosed(tmp_path, capsys, "model x const A = 1 " + "b" * 100_000, "(100000 characters)", line=1)
    assert len(err) < 1000


# ---------------------------------------------------------------- specs that checked but could not compile or run

KIMI = (ROOT / "specs" / "kimi_k3.mk").read_text(encoding="utf-8")
EMBED_STEP = "  x = layers(embedding(tokens, embed))"
NOT_LOWERED = {  # name: (spec text, message of the first diagnostic, text of its line)
    "nested-layers": (  # KeyError in buffer assignment
        tiny(EMBED_STEP, "  x = layers(layers(embedding(tokens, embed)))"),
        "`layers(...)` is called twice",
        "layers(layers(",
    ),
    "state-per-layer-read-as-a-value": (
        tiny("  return x + linear(swiglu", "  x = x + hist\n  return x + linear(swiglu").replace(
            "weight out_norm:", "state hist: f32[B, H] per layer\nweight out_norm:"
        ),
        "the kernel reads a state as a value when it holds one row per step row",
        "x + hist",
    ),
    "rope-theta-per-layer": (  # TypeError in the emitter
        tiny("heads=NH)\n  k", "heads=NH, theta=10000.0 * (l + 1))\n  k"),
        "`rope` needs `theta` to be the same at every layer of a kind",
        "theta=",
    ),
    "attention-scale-per-layer": (
        tiny("kv_heads=NKV)", "kv_heads=NKV, scale=0.1 * (l + 1))"),
        "`attention` needs `scale` to be the same at every layer of a kind",
        "scale=",
    ),
    "moe-beta-per-layer": (
        KIMI.replace("  return situ(g, u)\n", "  return situ(g, u, beta=4.0 + l)\n", 1),  # the experts' `act` block
        "`situ` has a layer-dependent attribute",
        "beta=4.0 + l",
    ),
    "embedding-of-a-computed-index": (  # silently looked up the token ids (logits 34x off the bound)
        tiny(
            "  logits = linear(rmsnorm(x, out_norm), lm_head)",
            "  x = x + embedding(argmax(linear(x, lm_head)), embed)\n  logits = linear(rmsnorm(x, out_norm), lm_head)",
        ),
        "the kernel looks up rows by the step's token ids only, not by a computed index",
        "embedding(argmax",
    ),
    "embedding-of-the-positions": (
        tiny("  return x + linear(swiglu", "  x = x + embedding(pos, embed)\n  return x + linear(swiglu"),
        "not by the positions",
        "embedding(pos",
    ),
    "embedding-of-a-per-layer-table": (  # failed at trace time (a broadcast of mismatched shapes)
        tiny("  return x + linear(swiglu", "  x = x + embedding(tokens, etab)\n  return x + linear(swiglu").replace(
            "weight out_norm:", "weight etab: bf16[V, H] per layer\nweight out_norm:"
        ),
        "the kernel reads one embedding table: `etab` is stacked per layer",
        "embedding(tokens, etab)",
    ),
}

# Found by the random spec generator: the kernels read these at one layer slot (a wrong slice),
# then rejected them; now each weight is read at its own slot. They compile (and emit the own
# slot); tests/test_spec_gen.py runs such stackings kernel against reference.
OWN_SLOTS = {  # the changed spec, and the kernel's call that reads the weight at its own slot
    "mla-w_kvb-stacked-unlike-its-cache": (  # the cache at the kind's slot table, w_kvb at the layer
        KIMI.replace("NH*(NOPE+D) @(ep, tp)] per layer(mla_moe)", "NH*(NOPE+D) @(ep, tp)] per layer"),
        r"attention\d\(slots\d+_ref\[li\], r\.\w+, r\.\w+, r\.\w+, r\.\w+, li\)",
    ),
    "moe-experts-stacked-unlike-each-other": (  # (w1's, w3's, w2's) slots
        KIMI.replace("FE @tp, LAT]   per layer(kda_moe, mla_moe)", "FE @tp, LAT]   per layer"),
        r"\.experts\(\((slots\d+_ref\[li\]), \1, li\), ",
    ),
}


@pytest.mark.parametrize("text, emitted", OWN_SLOTS.values(), ids=OWN_SLOTS)
def test_weights_stacked_unlike_their_op_partners_compile_at_their_own_slots(tmp_path, capsys, text, emitted):
    assert text != KIMI, "the spec no longer has the stacking this test changes"
    code, err, _ = run(tmp_path, capsys, text, "compile")
    assert code == 0, err
    assert re.search(emitted, (tmp_path / "out" / "kernel.py").read_text(encoding="utf-8"))


@pytest.mark.parametrize("text, message, at", NOT_LOWERED.values(), ids=NOT_LOWERED)
def test_what_the_kernel_cannot_lower_is_a_diagnostic(tmp_path, capsys, text, message, at):
    diagnosed(tmp_path, capsys, text, message, command="compile", line=line_of(text, at))


def test_a_matrix_before_the_layers_streams_in_the_prologue(tmp_path, capsys):
    """`linear` before the layer stack (StopIteration in the emitter once, then refused) streams
    through the ring ahead of layer 0's tiles, over a state read as a value (`read_state`)."""
    text = tiny(EMBED_STEP, "  x = layers(linear(embedding(tokens, embed) + hist, w_pre))").replace(
        "weight out_norm:", "weight w_pre: bf16[H, H]\nstate hist: f32[B, H]\nweight out_norm:"
    )
    code, err, _ = run(tmp_path, capsys, text, "compile")
    assert code == 0, err
    kernel = (tmp_path / "out" / "kernel.py").read_text(encoding="utf-8")
    tiles = int(re.search(r"^PROLOGUE_TILES = (\d+)$", kernel, re.M)[1])
    assert tiles >= 1 and re.search(rf"^LAYER_TILE_BASE = np.array\(\[{tiles}, ", kernel, re.M)
    assert "pltpu.sync_copy(r.hist, r.rs0_stage)" in kernel


def test_an_embedding_of_the_tokens_inside_a_layer_compiles(tmp_path, capsys):
    """The check is no wider than the restriction: the step's tokens and one table are fine anywhere."""
    text = tiny("  return x + linear(swiglu", "  x = x + embedding(tokens, embed)\n  return x + linear(swiglu")
    code, err, _ = run(tmp_path, capsys, text, "compile")
    assert code == 0, err


def test_a_cap_beyond_float32_is_a_diagnostic(tmp_path, capsys):
    """`cap = 10 ** 400` emitted a kernel that overflowed when run."""
    text = tiny("lm_head)\n", "lm_head), cap=10 ** 400)\n").replace("logits = linear(", "logits = softcap(linear(")
    diagnosed(tmp_path, capsys, text, "10 ** 400", command="compile", line=line_of(text, "cap="))


def test_plan_context_beyond_the_cache_is_a_usage_error(capsys):
    assert main(["plan", str(ROOT / "specs" / "tiny.mk"), "--context", "100000"]) == 2
    assert "--context 100000 is beyond `S` in 1 .. 256" in capsys.readouterr().err
    assert main(["plan", str(ROOT / "specs" / "tiny.mk"), "--context", "256"]) == 0
