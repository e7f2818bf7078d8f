"""Malformed specs: each is reported with its exact message, line, column, underlined text and hint,
and never as a Python traceback.

Every spec is BASE, a minimal valid spec, with one or two targeted replacements, so the line and
column of each error are known. Replacements keep the line count unless a case says otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mkdsl.cli import main
from mkdsl.lang.diagnostics import Diagnostic, SpecError
from mkdsl.lang.elaborate import elaborate
from mkdsl.lang.syntax import parse
from mkdsl.ops.elementwise import BROADCASTS

REPO = Path(__file__).resolve().parents[1]

# specs/tiny.mk plus a profile, a mesh with a sharded dimension, hints, an attribute and a block.
# Line numbers: model 2, consts 4-11, dims 13-14, profile 16, mesh 18, hints 20, weights 22-33,
# states 35-36, block mlp 38-41, layer decoder 43-50, layers 52, step 54-58.
BASE = """\
# A minimal valid spec for the diagnostics tests.
model tiny

const L = 2
const H = 128
const NH = 2
const NKV = 1
const D = 64
const F = 256
const V = 256
const EPS = 0.00001

dim B in 1 .. 8
dim S in 1 .. 256

profile small { L = 1 }

mesh { tp = 1 }

hints { ring_depth = 2 }

weight embed:    bf16[V, H]
weight norm1:    bf16[H]            per layer
weight wq:       bf16[H, NH*D @tp]  per layer
weight wk:       bf16[H, NKV*D]     per layer
weight wv:       bf16[H, NKV*D]     per layer
weight wo:       bf16[NH*D @tp, H]  per layer
weight norm2:    bf16[H]            per layer
weight w_gate:   bf16[H, F]         per layer
weight w_up:     bf16[H, F]         per layer
weight w_down:   bf16[F, H]         per layer
weight out_norm: bf16[H]
weight lm_head:  bf16[H, V]

state k_cache: bf16[B, NKV, S, D] per layer
state v_cache: bf16[B, NKV, S, D] per layer

block mlp(x) {
  g = linear(x, w_gate)
  return linear(swiglu(g, linear(x, w_up)), w_down)
}

layer decoder(x) {
  h = rmsnorm(x, norm1, eps=EPS)
  q = rope(linear(h, wq), pos, heads=NH)
  k = rope(linear(h, wk), pos, heads=NKV)
  a = attention(q, k, linear(h, wv), k_cache, v_cache, pos, heads=NH, kv_heads=NKV)
  x = x + linear(a, wo)
  return x + mlp(rmsnorm(x, norm2))
}

layers L { decoder: otherwise }

step(tokens, pos) {
  x = layers(embedding(tokens, embed))
  logits = linear(rmsnorm(x, out_norm), lm_head)
  return logits, argmax(logits)
}
"""


def edit(old: str, new: str, spec: str = BASE) -> str:
    """`spec` with `old`, which must occur exactly once, replaced by `new`."""
    assert spec.count(old) == 1, f"{old!r} occurs {spec.count(old)} times"
    return spec.replace(old, new)


@dataclass(frozen=True)
class Err:
    line: int
    column: int
    under: str  # the source text the caret run underlines
    message: str
    hint: str | None = None


def found(spec: str, d: Diagnostic) -> Err:
    lines = spec.splitlines()
    text = lines[d.span.line - 1] if d.span.line <= len(lines) else ""
    under = text[d.span.column - 1 : d.span.column - 1 + d.span.width]
    return Err(d.span.line, d.span.column, under, d.message, d.hint)


def diagnostics(spec: str, profile: str | None = None) -> tuple[Diagnostic, ...]:
    with pytest.raises(SpecError) as info:  # any other exception fails the test with its traceback
        elaborate(parse(spec), profile, spec)
    return info.value.diagnostics


def case(id: str, spec: str, *errors: Err, profile: str | None = None):
    return pytest.param(spec, profile, errors, id=id)


NOT_ON_TENSORS = "tensors support `+ - * /` (with tensors or constants), `**` with a constant exponent, and prefix `-`"
STEP_RESULT = "`step` must return (logits f32[B, V], next tokens i32[B]); it returns "
STEP_RESULT_HINT = "end the step with `return logits, argmax(logits)`"
LINEAR_ROWS = "(weights are stored [in, out])"

CASES = [
    # ------------------------------------------------------------------ syntax
    case(
        "syntax-missing-closing-brace",
        edit("  return x + mlp(rmsnorm(x, norm2))\n}\n", "  return x + mlp(rmsnorm(x, norm2))\n\n"),
        Err(52, 1, "layers", "unexpected `layers`", "expected `,`, `return`, `}`, a name"),
    ),
    case(
        "syntax-missing-open-brace",
        edit("block mlp(x) {", "block mlp(x)"),
        Err(39, 3, "g", "unexpected `g`", "expected `{`"),
    ),
    case(
        "syntax-stray-character",
        edit("g = linear(x, w_gate)", "g = linear(x, w_gate) $"),
        Err(39, 25, "$", "unexpected character `$`"),
    ),
    case(
        "syntax-unexpected-end-of-file",
        BASE[: BASE.rindex("}")],
        Err(57, 32, "", "unexpected end of file", "expected `,`, `return`, `}`, a name"),
    ),
    case(
        "syntax-bad-token",
        edit("const EPS = 0.00001", "const EPS = = 0.00001"),
        Err(11, 13, "=", "unexpected `=`", "expected an expression"),
    ),
    case("syntax-bad-range", edit("dim B in 1 .. 8", "dim B in 1 ... 8"), Err(13, 14, ".", "unexpected character `.`")),
    case(
        "syntax-integer-literal-too-long",
        edit("const V = 256", "const V = " + "9" * 5000),
        Err(10, 11, "9" * 5000, "integer literal of 5000 digits is too long"),
    ),
    # ------------------------------------------------------------------ unknown names
    case(
        "unknown-constant",
        edit("bf16[H, F]         per layer\nweight w_down", "bf16[H, FF]        per layer\nweight w_down"),
        Err(30, 26, "FF", "unknown constant `FF`", "did you mean `F`?"),
    ),
    case(
        "unknown-tensor",
        edit("linear(x, w_up)", "linear(x, w_upp)"),
        Err(40, 37, "w_upp", "unknown name `w_upp`", "did you mean `w_up`?"),
    ),
    case(
        "unknown-op",
        edit("swiglu(g,", "swiglo(g,"),
        Err(40, 17, "swiglo", "unknown op or block `swiglo`", "did you mean `swiglu`?"),
    ),
    case(
        "unknown-block",
        edit("x + mlp(rmsnorm", "x + nlp(rmsnorm"),
        Err(49, 14, "nlp", "unknown op or block `nlp`", "did you mean `mlp`?"),
    ),
    case(
        "unknown-layer-kind",
        edit("{ decoder: otherwise }", "{ decoder: l == 0  decodr: otherwise }"),
        Err(52, 29, "decodr", "unknown layer kind `decodr`", "did you mean `decoder`?"),
    ),
    case(
        "unknown-dtype",
        edit("weight lm_head:  bf16", "weight lm_head:  bf61"),
        Err(33, 18, "bf61", "unknown dtype `bf61`", "did you mean `bf16`?"),
    ),
    case(
        "unknown-mesh-axis",
        edit("bf16[H, NH*D @tp]", "bf16[H, NH*D @tpp]"),
        Err(24, 32, "tpp", "`tpp` is not a mesh axis", "did you mean `tp`?"),
    ),
    case(
        "mesh-axis-without-mesh",
        edit("mesh { tp = 1 }", ""),
        Err(24, 32, "tp", "`tp` is not a mesh axis", "declare it: `mesh { tp = N }`"),
        Err(27, 29, "tp", "`tp` is not a mesh axis", "declare it: `mesh { tp = N }`"),
    ),
    case(
        "unknown-hint",
        edit("ring_depth = 2", "ring_dept = 2"),
        Err(20, 9, "ring_dept", "unknown schedule hint `ring_dept`", "did you mean `ring_depth`?"),
    ),
    case(
        "unknown-attribute",
        edit("eps=EPS", "esp=EPS"),
        Err(44, 25, "esp", "`rmsnorm` has no attribute `esp`", "did you mean `eps`?"),
    ),
    case(
        "unknown-constant-in-attribute",
        edit("eps=EPS", "eps=EPSS"),
        Err(44, 29, "EPSS", "unknown constant `EPSS`", "did you mean `EPS`?"),
    ),
    case(
        "unknown-profile",
        BASE,
        Err(2, 1, "model tiny", "no profile named `smal` (profiles in this spec: small)", "did you mean `small`?"),
        profile="smal",
    ),
    # ------------------------------------------------------------------ arity
    case(
        "op-operand-count",
        edit("argmax(logits)", "argmax(logits, x)"),
        Err(57, 18, "argmax(logits, x)", "`argmax` takes 1 operand (x), got 2"),
    ),
    case(
        "block-argument-count",
        edit("mlp(rmsnorm(x, norm2))", "mlp(rmsnorm(x, norm2), x)"),
        Err(49, 14, "mlp(rmsnorm(x, norm2), x)", "block `mlp` takes 1 argument (x), got 2"),
    ),
    case(
        "block-unknown-parameter",
        edit("mlp(rmsnorm(x, norm2))", "mlp(rmsnorm(x, norm2), eps=1)"),
        Err(49, 37, "eps", "block `mlp` has no parameter `eps`", "its parameters: x"),
    ),
    case(
        "step-input-count",
        edit("step(tokens, pos)", "step(tokens, pos, extra)"),
        Err(
            54,
            1,
            "step",
            "`step` takes 2 inputs (token ids, positions), got 3",
            "write `step(tokens, positions) { ... }`",
        ),
    ),
    case(
        "layer-carry-count",
        edit("layer decoder(x)", "layer decoder(x, y)"),
        Err(43, 7, "decoder", "layer `decoder` takes 2 carried values but `layers(...)` at line 55 passes 1"),
    ),
    case(
        "missing-required-attribute",
        edit("return logits, argmax(logits)", "return softcap(logits), argmax(logits)"),
        Err(57, 10, "softcap(logits)", "`softcap` needs the attribute `cap=...`"),
    ),
    # ------------------------------------------------------------------ shapes
    case(
        "linear-in-out-mismatch",
        edit("bf16[NH*D @tp, H]", "bf16[F, H]"),
        Err(48, 21, "wo", f"linear: `a` has 128 columns but weight `wo` has 256 input rows {LINEAR_ROWS}"),
    ),
    case(
        "linear-of-a-nested-call",
        edit("w_up)), w_down)", "w_up)), w_up)"),
        Err(
            40, 45, "w_up", f"linear: `swiglu(...)` has 256 columns but weight `w_up` has 128 input rows {LINEAR_ROWS}"
        ),
    ),
    case(
        "add-shape-mismatch",
        edit("x = x + linear(a, wo)", "x = x + linear(a, w_gate)"),
        Err(
            48,
            11,
            "linear(a, w_gate)",
            "add: operand shapes do not broadcast: `x` is f32[B, 128], `linear(...)` is f32[B, 256]",
            BROADCASTS + "; widen per-head scalars with `repeat(s, each=D)`",
        ),
    ),
    case(
        "norm-width",
        edit("weight norm2:    bf16[H]", "weight norm2:    bf16[F]"),
        Err(49, 29, "norm2", "rmsnorm: norm weight `norm2` has 256 elements but each row of `x` has 128"),
    ),
    case(
        "attention-kv-heads-vs-cache",
        edit("kv_heads=NKV)", "kv_heads=NH)"),
        Err(47, 38, "k_cache", "attention: caches must have 2 KV heads in dimension 2, got bf16[B, 1, S, 64]"),
    ),
    case(
        "attention-query-heads",
        edit("pos, heads=NH, kv", "pos, heads=NKV, kv"),
        Err(47, 17, "q", "attention: q `q` has 128 columns, expected 64"),
    ),
    # ------------------------------------------------------------------ dtypes
    case(
        "int-positions-into-float-op",
        edit("rope(linear(h, wk), pos,", "rope(linear(h, wk), silu(pos),"),
        Err(46, 32, "pos", "silu: expected a floating-point tensor, but `pos` is i32[B]"),
    ),
    case(
        "float-values-as-positions",
        edit("rope(linear(h, wk), pos,", "rope(linear(h, wk), h,"),
        Err(46, 27, "h", "rope: `h` has dtype f32, expected one of: i32"),
    ),
    case(
        "quantised-embedding",
        edit("weight embed:    bf16[V, H]", "weight embed:    int4(group=128)[V, H]"),
        Err(55, 32, "embed", "embedding: embedding table `embed` must not be quantised"),
    ),
    case(
        "quantised-state",
        edit("state k_cache: bf16", "state k_cache: mxfp4"),
        Err(35, 16, "mxfp4", "state `k_cache` cannot be quantised (mxfp4)"),
    ),
    case(
        "int4-without-group",
        edit("weight w_down:   bf16", "weight w_down:   int4"),
        Err(31, 18, "int4", "int4 needs a group size", "write `int4(group=128)[...]`"),
    ),
    case(
        "quantised-input-not-a-multiple-of-group",
        edit("weight w_down:   bf16", "weight w_down:   int4(group=96)"),
        Err(31, 33, "F", "the input dimension of int4(group=96) weight `w_down` (256) must be a multiple of 96"),
    ),
    case(
        "indivisible-sharding",
        edit("mesh { tp = 1 }", "mesh { tp = 256 }"),
        Err(24, 26, "NH*D @tp", "dimension 2 of `wq` has size 128, which mesh axis `tp` (size 256) does not divide"),
        Err(27, 23, "NH*D @tp", "dimension 1 of `wo` has size 128, which mesh axis `tp` (size 256) does not divide"),
    ),
    case(
        "indivisible-over-two-axes",
        edit(
            "weight wo:       bf16[NH*D @tp, H]",
            "weight wo:       bf16[NH*D @(tp, ep), H]",
            spec=edit("mesh { tp = 1 }", "mesh { tp = 16  ep = 16 }"),
        ),
        Err(
            27,
            23,
            "NH*D @(tp, ep)",
            "dimension 1 of `wo` has size 128, which mesh axes `tp` x `ep` (16 x 16 = 256) do not divide",
        ),
    ),
    case(
        "mesh-axis-not-a-power-of-two",
        edit("mesh { tp = 1 }", "mesh { tp = 3 }"),
        Err(
            18,
            13,
            "3",
            "mesh axis `tp` has size 3; it must be a power of two",
            "in-kernel collectives pair devices by XOR of their mesh coordinates",
        ),
    ),
    case(
        "axes-out-of-mesh-order",
        edit("bf16[NH*D @tp, H]", "bf16[NH*D @(ep, tp), H]", spec=edit("mesh { tp = 1 }", "mesh { tp = 1  ep = 1 }")),
        Err(
            27,
            30,
            "ep",
            "dimension 1 of `wo` lists mesh axes out of mesh order",
            "write @(tp, ep): blocks are numbered row-major in the order of `mesh`",
        ),
    ),
    case(
        "build-time-dim-split",
        edit("state k_cache: bf16[B, NKV, S, D]", "state k_cache: bf16[B @tp, NKV, S, D]"),
        Err(
            35, 21, "B @tp", "dimension 1 of `k_cache` is `B`, a size given when the step is built; it cannot be split"
        ),
    ),
    case(
        "axis-repeated-in-a-dimension",
        edit("bf16[NH*D @tp, H]", "bf16[NH*D @(tp, tp), H]"),
        Err(27, 34, "tp", "dimension 1 of `wo` is split over mesh axis `tp` twice"),
    ),
    # ------------------------------------------------------------------ layer schedule
    case(
        "layer-indices-not-covered",
        edit("{ decoder: otherwise }", "{ decoder: l == 0 }"),
        Err(
            52,
            1,
            "layers L { decoder: l == 0 }",
            "1 of 2 layers match no rule (layers 1)",
            "add a last rule `KIND: otherwise`",
        ),
    ),
    case(
        "otherwise-not-last",
        edit("{ decoder: otherwise }", "{ decoder: otherwise  decoder: l == 1 }"),
        Err(52, 12, "decoder", "`otherwise` must be the last rule: the rules after it are never used"),
    ),
    case(
        "layer-kind-never-scheduled",
        edit("layers L {", "layer extra(x) {\n  return x\n}\n\nlayers L {"),  # +4 lines
        Err(52, 7, "extra", "layer kind `extra` is never scheduled", "add a rule `extra: ...` to `layers`"),
    ),
    case(
        "layer-rule-not-boolean",
        edit("decoder: otherwise", "decoder: l + 1"),  # once, not once per layer
        Err(52, 23, "+", "a layer rule must be true or false, got 1", "compare the layer index, e.g. `l % 4 == 3`"),
    ),
    # ------------------------------------------------------------------ cycles
    case(
        "constant-cycle",
        edit("const V = 256", "const V = F * 2", spec=edit("const F = 256", "const F = V")),
        Err(9, 7, "F", "constant `F` depends on itself: F -> V -> F"),
    ),
    case(
        "constant-self-reference",
        edit("const H = 128", "const H = H"),
        Err(5, 7, "H", "constant `H` depends on itself: H -> H"),
    ),
    case(
        "block-recursion",
        edit("  g = linear(x, w_gate)", "  g = mlp(x)"),
        Err(39, 7, "mlp", "block `mlp` calls itself (mlp -> mlp); blocks are inlined, so recursion is not allowed"),
    ),
    case(
        "block-mutual-recursion",
        edit(
            "  g = linear(x, w_gate)",
            "  g = linear(helper(x), w_gate)",
            spec=edit("block mlp(x) {", "block helper(x) {\n  return mlp(x)\n}\n\nblock mlp(x) {"),
        ),  # +4 lines
        Err(
            39,
            10,
            "mlp",
            "block `mlp` calls itself (mlp -> helper -> mlp); blocks are inlined, so recursion is not allowed",
        ),
    ),
    # ------------------------------------------------------------------ profiles
    case(
        "profile-overrides-unknown-constant",
        edit("{ L = 1 }", "{ LL = 1 }"),
        Err(16, 17, "LL", "profile `small` overrides `LL`, which is not a constant", "did you mean `L`?"),
    ),
    case(
        "profile-overrides-twice",
        edit("{ L = 1 }", "{ L = 1  L = 2 }"),
        Err(16, 24, "L", "profile `small` overrides `L` twice"),
    ),
    case(
        "duplicate-profile",
        edit("profile small { L = 1 }", "profile small { L = 1 }  profile small { H = 64 }"),
        Err(16, 34, "small", "profile `small` is already defined at line 16"),
    ),
    # ------------------------------------------------------------------ duplicates
    case(
        "duplicate-constant",
        edit("const EPS = 0.00001", "const EPS = 0.00001  const H = 64"),
        Err(11, 28, "H", "`H` is already defined at line 5"),
    ),
    case(
        "duplicate-tensor",
        edit("weight lm_head:  bf16[H, V]", "weight lm_head:  bf16[H, V]  weight embed: bf16[V, H]"),
        Err(33, 37, "embed", "`embed` is already defined at line 22"),
    ),
    case(
        "duplicate-parameter",
        edit("block mlp(x)", "block mlp(x, x)", spec=edit("mlp(rmsnorm(x, norm2))", "mlp(rmsnorm(x, norm2), x)")),
        Err(38, 7, "mlp", "`mlp` has two parameters named `x`"),
    ),
    case(
        "duplicate-attribute", edit("eps=EPS", "eps=EPS, eps=1.0"), Err(44, 34, "eps", "attribute `eps` is given twice")
    ),
    case(
        "duplicate-hint",
        edit("ring_depth = 2", "ring_depth = 2  ring_depth = 3"),
        Err(20, 25, "ring_depth", "hint `ring_depth` is given twice"),
    ),
    case(
        "duplicate-mesh-axis",
        edit("mesh { tp = 1 }", "mesh { tp = 1  tp = 2 }"),
        Err(18, 16, "tp", "mesh axis `tp` is declared twice"),
    ),
    # ------------------------------------------------------------------ constants
    case("division-by-zero", edit("const D = 64", "const D = 64 // (NH - 2)"), Err(8, 14, "//", "division by zero")),
    case(
        "zero-to-a-negative-power", edit("const D = 64", "const D = 0 ** -1"), Err(8, 11, "0 ** -1", "division by zero")
    ),
    case(
        "power-overflow",
        edit("const EPS = 0.00001", "const EPS = 10.0 ** 400"),
        Err(11, 13, "10.0 ** 400", "the result of `**` is too large"),
    ),
    case(
        "dim-used-as-constant",
        edit("const V = 256", "const V = B * 32"),
        Err(10, 11, "B", "`B` is a `dim`, known only when the step is built: not a constant"),
    ),
    case(
        "weight-depends-on-dim",
        edit("weight out_norm: bf16[H]", "weight out_norm: bf16[B]"),  # and nothing more
        Err(32, 23, "B", "weight `out_norm` cannot depend on `B`, which is only known when the step is built"),
    ),
    # ------------------------------------------------------------------ misuse in function bodies
    case(
        "stacked-weight-outside-layer",
        edit("rmsnorm(x, out_norm)", "rmsnorm(x, norm1)"),
        Err(56, 30, "norm1", "`norm1` is declared per layer, so it can only be used inside a layer"),
    ),
    case(
        "constant-used-as-tensor",
        edit("rmsnorm(x, out_norm)", "rmsnorm(x, EPS)"),
        Err(56, 30, "EPS", "`EPS` is a constant, not a tensor", "pass constants as attributes, e.g. `eps=EPS`"),
    ),
    case(
        "number-used-as-tensor",
        edit("rmsnorm(x, out_norm)", "rmsnorm(x, 1.0)"),
        Err(
            56,
            30,
            "1.0",
            "expected a tensor, got the number 1.0",
            "numbers can be passed as keyword attributes, e.g. `eps=1e-5`",
        ),
    ),
    case(
        "tensor-used-as-attribute",
        edit("eps=EPS", "eps=norm1"),
        Err(
            44,
            29,
            "norm1",
            "attribute `eps` must be a constant, but `norm1` is a tensor",
            "tensors are operands: pass them before the attributes",
        ),
    ),
    case(
        "operator-not-defined-on-tensors",
        edit("x = x + linear(a, wo)", "x = x // linear(a, wo)"),
        Err(48, 9, "//", "operator `//` is not defined on tensors", NOT_ON_TENSORS),
    ),
    case(
        "weight-as-in-place-state",
        edit("linear(a, wo)", "linear(a, k_cache)"),
        Err(48, 21, "k_cache", "linear: the second operand of linear must be a declared weight, not `k_cache`"),
    ),
    case(
        "same-state-updated-twice",
        edit("k_cache, v_cache, pos", "k_cache, k_cache, pos"),
        Err(
            47,
            47,
            "k_cache",
            "attention: `k_cache` is passed as both `k_cache` and `v_cache`, which are updated in place",
            "give each its own state tensor",
        ),
    ),
    case(
        "tuple-assignment-count",
        edit("  g = linear(x, w_gate)", "  g, g2 = linear(x, w_gate)"),  # no follow-on
        Err(39, 3, "g, g2 = linear(x, w_gate)", "the right side gives 1 value but 2 names are assigned"),
    ),
    case(
        "two-values-as-one-operand",
        edit("argmax(logits)", "argmax(topk(logits, k=2))"),
        Err(57, 25, "topk(logits, k=2)", "this gives 2 values where one operand is expected"),
    ),
    case(
        "missing-return",
        edit("  return linear(swiglu(g, linear(x, w_up)), w_down)\n", "\n"),
        Err(38, 7, "mlp", "`mlp` has no `return`"),
    ),
    case(
        "return-not-last",  # and no "unknown name `logits`" for the statement after it
        edit(
            "  logits = linear(rmsnorm(x, out_norm), lm_head)\n  return logits, argmax(logits)",
            "  return logits, argmax(logits)\n  logits = linear(rmsnorm(x, out_norm), lm_head)",
        ),
        Err(56, 3, "return logits, argmax(logits)", "`return` must be the last statement"),
    ),
    case(
        "step-return-type",
        edit("return logits, argmax(logits)", "return logits"),
        Err(57, 3, "return logits", STEP_RESULT + "(f32[B, 256])", STEP_RESULT_HINT),
    ),
    case(
        "step-returns-a-weight",
        edit("return logits, argmax(logits)", "return embed, argmax(logits)"),
        Err(57, 3, "return embed, argmax(logits)", STEP_RESULT + "(bf16[256, 128], i32[B])", STEP_RESULT_HINT),
    ),
    case(
        "layer-return-type",
        edit("return x + mlp(rmsnorm(x, norm2))", "return linear(x, w_gate)"),
        Err(
            49,
            3,
            "return linear(x, w_gate)",
            "layer `decoder` must return what it carries (f32[B, 128]), but returns (f32[B, 256])",
        ),
    ),
    case(
        "layer-returns-a-weight",
        edit("return x + mlp(rmsnorm(x, norm2))", "return norm2"),
        Err(
            49, 3, "return norm2", "layer `decoder` must return what it carries (f32[B, 128]), but returns (bf16[128])"
        ),
    ),
    case(
        "layers-called-from-block",
        edit("g = linear(x, w_gate)", "g = linear(layers(x), w_gate)"),
        Err(39, 14, "layers", "`layers(...)` can only be called from `step`"),
    ),
    case(
        "layers-called-twice",
        edit("linear(rmsnorm(x, out_norm)", "linear(rmsnorm(layers(x), out_norm)"),
        Err(56, 27, "layers", "`layers(...)` is called twice; the layer stack runs once per step"),
    ),
    case(
        "step-never-calls-layers",
        edit("x = layers(embedding(tokens, embed))", "x = embedding(tokens, embed)"),
        Err(54, 1, "step", "the step never calls `layers(...)`, so no layer is run"),
    ),
]


def test_enough_malformed_specs():
    assert len(CASES) >= 36


def test_base_spec_is_valid():
    model = elaborate(parse(BASE), None, BASE)
    assert model.schedule == ("decoder", "decoder")
    assert elaborate(parse(BASE), "small", BASE).schedule == ("decoder",)


@pytest.mark.parametrize("spec, profile, expected", CASES)
def test_malformed_spec(spec, profile, expected):
    assert [found(spec, d) for d in diagnostics(spec, profile)] == list(expected)


# At the command line an unknown profile is a usage error instead (tests/test_cli_polish.py).
CHECK_CASES = [c for c in CASES if c.id != "unknown-profile"]


@pytest.mark.parametrize("spec, profile, expected", CHECK_CASES)
def test_cli_reports_malformed_spec(spec, profile, expected, tmp_path, capsys):
    path = tmp_path / "bad.mk"
    path.write_text(spec)
    assert main(["check", str(path)] + (["--profile", profile] if profile else [])) == 1
    out, err = capsys.readouterr()
    assert out == ""
    first, n = expected[0], len(expected)
    assert err.splitlines()[0] == f"{path}:{first.line}:{first.column}: error: {first.message}"
    assert err.endswith(f"\n{n} error{'s' if n != 1 else ''} in {path}\n")
    assert "internal error" not in err


def test_several_independent_errors_are_reported_sorted_by_line():
    spec = BASE
    for old, new in [
        ("rmsnorm(x, out_norm)", "rmsnorm(x, out_norms)"),  # 56, step
        ("eps=EPS", "esp=EPS"),  # 44, layer: checked before the block it calls
        ("linear(x, w_up)", "linear(x, w_upp)"),  # 40, block
        ("bf16[H, NH*D @tp]", "bf16[H, NH*D @tpp]"),  # 24, tensors
        ("ring_depth = 2", "ring_dept = 2"),  # 20, hints
        ("{ L = 1 }", "{ LL = 1 }"),  # 16, profiles
    ]:
        spec = edit(old, new, spec)
    assert [found(spec, d) for d in diagnostics(spec)] == [
        Err(16, 17, "LL", "profile `small` overrides `LL`, which is not a constant", "did you mean `L`?"),
        Err(20, 9, "ring_dept", "unknown schedule hint `ring_dept`", "did you mean `ring_depth`?"),
        Err(24, 32, "tpp", "`tpp` is not a mesh axis", "did you mean `tp`?"),
        Err(40, 37, "w_upp", "unknown name `w_upp`", "did you mean `w_up`?"),
        Err(44, 25, "esp", "`rmsnorm` has no attribute `esp`", "did you mean `eps`?"),
        Err(56, 30, "out_norms", "unknown name `out_norms`", "did you mean `out_norm`?"),
    ]


def test_duplicates_do_not_hide_other_errors():
    spec = edit(
        "ring_depth = 2", "ring_dept = 2", spec=edit("const EPS = 0.00001", "const EPS = 0.00001  const H = 64")
    )
    assert [d.message for d in diagnostics(spec)] == [
        "`H` is already defined at line 5",
        "unknown schedule hint `ring_dept`",
    ]


def test_power_operator():
    model = elaborate(parse(edit("const D = 64", "const D = 2 ** 3 * 2 ** 3")), None, "")
    assert model.const["D"] == 64


def test_attention_blames_the_value_cache():
    spec = edit("state v_cache: bf16[B, NKV, S, D]", "state v_cache: bf16[B, NH, S, D]")
    (d,) = diagnostics(spec)
    assert found(spec, d).under == "v_cache"
    assert "bf16[B, 2, S, 64]" in d.message


# ---------------------------------------------------------------------------- the CLI, in a subprocess


def mkdsl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "mkdsl", *args], capture_output=True, text=True, cwd=cwd, env=env)


CLI_CASES = [
    pytest.param(
        edit("g = linear(x, w_gate)", "g = linear(x, w_gate) $"),
        [],
        """\
spec.mk:39:25: error: unexpected character `$`
   39 |   g = linear(x, w_gate) $
                                ^
1 error in spec.mk
""",
        id="stray-character",
    ),
    pytest.param(
        edit("linear(x, w_up)", "linear(x, w_upp)"),
        [],
        """\
spec.mk:40:37: error: unknown name `w_upp`
   40 |   return linear(swiglu(g, linear(x, w_upp)), w_down)
                                            ^^^^^
      = hint: did you mean `w_up`?
1 error in spec.mk
""",
        id="unknown-name",
    ),
    pytest.param(
        edit("  g = linear(x, w_gate)", "\tg = linear(x, w_gat)"),
        [],
        """\
spec.mk:39:16: error: unknown name `w_gat`
   39 | \tg = linear(x, w_gat)
        \t              ^^^^^
      = hint: did you mean `w_gate`?
1 error in spec.mk
""",
        id="caret-after-tab",
    ),
    # an unknown profile: a usage error at the command line (tests/test_cli_polish.py)
    pytest.param(
        edit("{ decoder: otherwise }", "{ decoder: l == 0  decodr: otherwise }"),
        [],
        """\
spec.mk:52:29: error: unknown layer kind `decodr`
   52 | layers L { decoder: l == 0  decodr: otherwise }
                                    ^^^^^^
      = hint: did you mean `decoder`?
1 error in spec.mk
""",
        id="unknown-layer-kind",
    ),
    pytest.param(
        edit("const V = 256", "const V = 256 // (NH - 2)", spec=edit("mesh { tp = 1 }", "mesh { tp = 256 }")),
        [],
        """\
spec.mk:10:15: error: division by zero
   10 | const V = 256 // (NH - 2)
                      ^^
spec.mk:24:26: error: dimension 2 of `wq` has size 128, which mesh axis `tp` (size 256) does not divide
   24 | weight wq:       bf16[H, NH*D @tp]  per layer
                                 ^^^^^^^^
spec.mk:27:23: error: dimension 1 of `wo` has size 128, which mesh axis `tp` (size 256) does not divide
   27 | weight wo:       bf16[NH*D @tp, H]  per layer
                              ^^^^^^^^
3 errors in spec.mk
""",
        id="several-errors",
    ),
]


@pytest.mark.parametrize("spec, options, stderr", CLI_CASES)
def test_cli_subprocess_renders_diagnostics(spec, options, stderr, tmp_path):
    (tmp_path / "spec.mk").write_text(spec)
    r = mkdsl("check", "spec.mk", *options, cwd=tmp_path)
    assert (r.returncode, r.stdout) == (1, "")
    assert "Traceback" not in r.stderr
    assert r.stderr == stderr


def test_check_of_a_valid_spec_writes_nothing(tmp_path):
    # `check` also runs the lowerings' checks: a 64-column `wk` could not stream in 128-lane tiles
    (tmp_path / "spec.mk").write_text(edit("const D = 64", "const D = 128"))

    def listing():
        return sorted(
            (str(p.relative_to(tmp_path)), p.stat().st_size, p.stat().st_mtime_ns) for p in tmp_path.rglob("*")
        )

    before = listing()
    r = mkdsl("check", "spec.mk", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("spec.mk: ok: model tiny, 2 layers (decoder x2), 12 weights, 2 state tensors")
    assert r.stderr == ""
    assert listing() == before
