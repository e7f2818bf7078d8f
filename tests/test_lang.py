"""The language features of issue 10's elementwise part, at the checker: constants with tensors,
broadcasting, `repeat` and `rowsum`, blocks with constant parameters, the unused-weight warning,
their shard rules, and the kernel line of `rmsnorm(..., offset=1.0)`.

The ops' numerics are tested against oracles in tests/test_ops_elementwise.py and the kernels
in tests/test_kernel_elementwise.py; here, what the checker builds and what it reports.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mkdsl.cli import main
from mkdsl.compiler import compile_source
from mkdsl.lang.diagnostics import SpecError
from mkdsl.lang.elaborate import elaborate
from mkdsl.lang.syntax import parse
from mkdsl.spmd.shard import shard

ROOT = Path(__file__).resolve().parent.parent

SPEC = """\
model lang
const H = 256
const NH = 2
const D = H // NH
const V = 256
const SCALE = 0.5
{consts}
dim B in 1 .. 8
{mesh}
weight embed:   bf16[V, H]
weight w:       bf16[H, H{split}] per layer
weight bias:    bf16[H{split}]    per layer
weight gate_w:  bf16[H]           per layer
weight head_w:  bf16[H, H]        per layer
weight lm_head: bf16[H, V]
{blocks}
layer dense(x) {{
{body}
}}
layers 2 {{ dense: otherwise }}
step(tokens, positions) {{
  logits = linear(layers(embedding(tokens, embed)), lm_head)
  return logits, argmax(logits)
}}
"""

USE_ALL = "  u = linear(x, head_w) + rowsum(x * gate_w) + linear(x, w) * 0.0 + bias * 0.0\n"


def spec(body: str, blocks: str = "", consts: str = "", mesh: str = "", split: str = "", use_all=True) -> str:
    body = (USE_ALL if use_all else "") + body
    return SPEC.format(body=body, blocks=blocks, consts=consts, mesh=mesh, split=split)


def model(text: str):
    return elaborate(parse(text), None, text)


def errors(text: str) -> list[tuple[int, int, str, str | None]]:
    with pytest.raises(SpecError) as info:
        model(text)
    return [(d.span.line, d.span.column, d.message, d.hint) for d in info.value.diagnostics]


def nodes(m, kind="dense"):
    return [(n.op, dict(n.attrs)) for n in m.kind(kind).nodes]


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


# ---------------------------------------------------------------- constants with tensors


@pytest.mark.parametrize(
    "expr, op, s",
    [
        ("h * 2.5", "mul_scalar", 2.5),
        ("2.5 * h", "mul_scalar", 2.5),
        ("h * SCALE", "mul_scalar", 0.5),
        ("h * (SCALE / 4)", "mul_scalar", 0.125),
        ("h * sqrt(D)", "mul_scalar", 128**0.5),
        ("1.0 + h", "add_scalar", 1.0),
        ("h - 3", "sub_scalar", 3),
        ("1.0 - h", "rsub_scalar", 1.0),
        ("h / 4.0", "div_scalar", 4.0),
        ("1.0 / h", "rdiv_scalar", 1.0),
        ("h ** 2", "pow_scalar", 2),
        ("maximum(h, 0.0)", "maximum_scalar", 0.0),
        ("minimum(-1.5, h)", "minimum_scalar", -1.5),
        ("h * (l + 1)", "mul_scalar", None),  # layer-dependent: a LayerExpr
    ],
)
def test_a_constant_with_a_tensor_is_one_scalar_op(expr, op, s):
    m = model(spec(f"  h = linear(x, w)\n  return x + ({expr})"))
    node = [n for n in nodes(m) if n[0] == op][-1]  # the spec's own use comes after USE_ALL's
    if s is None:
        assert node[1]["s"].py == "(l + 1)" and node[1]["s"].kernel == "(li + 1)"
    else:
        assert node[1]["s"] == s and type(node[1]["s"]) is type(s)


def test_tensor_operators_and_negation():
    m = model(spec("  h = linear(x, w)\n  return -(x - h) / (h + 1.0) * x"))
    assert [op for op, _ in nodes(m)][-5:] == ["sub", "neg", "add_scalar", "div", "mul"]


@pytest.mark.parametrize(
    "expr, message",
    [
        ("x / 0.0", "div_scalar: division by zero"),
        ("x * true", "mul_scalar: a tensor combines with numbers, not true/false"),
        ("x * 1e39", "attribute `s` = 1e+39 is beyond float32's range"),
        ("x // 2", "operator `//` is not defined on tensors"),
        ("x ** x", "operator `**` is not defined on tensors"),
        ("x * ln(0.0)", "`ln` is not defined at 0.0: it needs a positive argument"),
    ],
)
def test_constant_operand_errors(expr, message):
    text = spec(f"  return {expr}")
    got = errors(text)
    assert [g[2] for g in got] == [message]
    assert got[0][0] == line_of(text, f"return {expr}")


def test_constants_alone_are_not_a_tensor():
    text = spec("  h = 2.0 * SCALE\n  return x")
    (err,) = errors(text)
    assert err[:3] == (line_of(text, "h = 2.0"), 11, "expected a tensor, got a constant expression")


# ---------------------------------------------------------------- broadcasting


def test_broadcasts_give_the_wider_shape():
    m = model(spec("  y = linear(x, w) + bias\n  g = rowsum(x * gate_w)\n  return y * g"))
    out = {v.name: str(v.type) for n in m.kind("dense").nodes for v in n.outputs}
    assert out["y"] == "f32[B, 256]" and out["g"] == "f32[B, 1]"
    assert nodes(m)[-1][0] == "mul"


def test_per_head_scalars_are_repeated():
    m = model(spec("  s = slice(linear(x, head_w), start=0, size=NH)\n  return x * repeat(sigmoid(s), each=D)"))
    rep = next(n for n in m.kind("dense").nodes if n.op == "repeat")
    assert str(rep.outputs[0].type) == "f32[B, 256]" and rep.attr["each"] == 128


def test_shapes_that_do_not_broadcast_are_blamed_with_the_hint():
    text = spec("  s = slice(linear(x, head_w), start=0, size=NH)\n  return x * s")
    ((line, col, message, hint),) = errors(text)
    assert line == line_of(text, "return x * s") and col == 14
    assert message == "mul: operand shapes do not broadcast: `x` is f32[B, 256], `s` is f32[B, 2]"
    assert "repeat(s, each=D)" in hint


# ---------------------------------------------------------------- blocks with constant parameters

BLOCKS = """
block scaled(x, factor, eps=1e-6) {
  return rmsnorm(x * factor, gate_w, eps=eps)
}
block outer(x, f=2.0) {
  return scaled(x, f * 2, eps=f / 100)
}
"""


def test_constant_parameters_reach_attributes_and_scalars():
    m = model(spec("  a = scaled(x, 3.0)\n  b = scaled(a, factor=SCALE, eps=0.01)\n  return outer(b)", BLOCKS))
    got = [(op, a.get("s"), a.get("eps")) for op, a in nodes(m) if op in ("mul_scalar", "rmsnorm")][-6:]
    assert got == [
        ("mul_scalar", 3.0, None),
        ("rmsnorm", None, 1e-6),
        ("mul_scalar", 0.5, None),
        ("rmsnorm", None, 0.01),
        ("mul_scalar", 4.0, None),
        ("rmsnorm", None, 0.02),
    ]


@pytest.mark.parametrize(
    "call, message, hint",
    [
        ("scaled(x, 2.0, epz=1.0)", "block `scaled` has no parameter `epz`", "did you mean `eps`?"),
        ("scaled(x, 2.0, factor=1.0)", "parameter `factor` of block `scaled` is given twice", None),
        ("scaled(x, eps=1.0)", "block `scaled` needs an argument for its parameter `factor`", None),
        ("scaled(x, 2.0, 1.0, 3.0)", "block `scaled` takes 3 arguments (x, factor, eps), got 4", None),
        (
            "scaled(x, l * 1.0)",
            "a block's constant argument must have one value at every layer of a kind",
            "split the layer kind, or pass the layer-dependent expression as an attribute",
        ),
    ],
)
def test_block_argument_errors(call, message, hint):
    text = spec(f"  return {call}", BLOCKS)
    ((line, _, got, got_hint),) = errors(text)
    assert (line, got, got_hint) == (line_of(text, call), message, hint)


def test_a_constant_parameter_is_not_a_tensor():
    blocks = "block f(x, k) {\n  return x + rmsnorm(k, gate_w)\n}\n"
    text = spec("  return f(x, 2.0)", blocks)
    ((line, col, message, _),) = errors(text)
    assert (line, col) == (line_of(text, "rmsnorm(k, gate_w)"), 22)
    assert message == "`k` is a constant parameter of this block, not a tensor"


def test_block_defaults_parse_and_a_missing_default_is_a_syntax_error():
    parse("block f(x, w=1.0, n=2) {\n return x\n}\n")
    with pytest.raises(SpecError) as info:
        parse("block f(x, w=) {\n return x\n}\n")
    assert info.value.diagnostics[0].message == "unexpected `)`"


# ---------------------------------------------------------------- the unused-weight warning


def test_unused_weight_is_a_warning_at_its_declaration(tmp_path, monkeypatch, capsys):
    text = spec("  return x + linear(x, w)", use_all=False)
    m = model(text)
    warned = {w.message: (w.span.line, w.span.column, w.severity) for w in m.warnings}
    assert warned == {
        f"weight `{n}` is declared but never used": (line_of(text, f"weight {n}:"), 8, "warning")
        for n in ("bias", "gate_w", "head_w")
    }
    monkeypatch.chdir(tmp_path)
    Path("spec.mk").write_text(text, encoding="utf-8")
    assert main(["check", "spec.mk"]) == 0
    out = capsys.readouterr()
    assert ": ok: model lang" in out.out
    line = line_of(text, "weight bias:")
    assert f"spec.mk:{line}:8: warning: weight `bias` is declared but never used\n" in out.err


def test_documented_warning_output_is_what_check_prints(tmp_path, monkeypatch, capsys):
    """The text block in language.md's Diagnostics section, from the spec it describes."""
    doc = (ROOT / "docs" / "language.md").read_text(encoding="utf-8")
    shown = doc.split("is a warning at\nits declaration:\n\n```text\n", 1)[1].split("```", 1)[0]
    text = "\n".join(
        [
            "model m",
            "const V = 256",
            "const H = 128",
            "dim B in 1 .. 8",
            "weight embed: bf16[V, H]",
            "weight w:     bf16[H, H]  per layer",
            "layer dense(x) {",
            "  return x + linear(x, w)",
            "}",
            "layers 1 { dense: otherwise }",
            "",
            "weight bias:  bf16[H]  per layer",
            "weight head:  bf16[H, V]",
            "step(tokens, positions) {",
            "  logits = linear(layers(embedding(tokens, embed)), head)",
            "  return logits, argmax(logits)",
            "}",
        ]
    )
    monkeypatch.chdir(tmp_path)
    Path("spec.mk").write_text(text, encoding="utf-8")
    assert main(["check", "spec.mk"]) == 0
    assert capsys.readouterr().err == shown


# ---------------------------------------------------------------- shard rules


def test_a_split_bias_follows_its_column_split_operand_and_a_row_sum_is_reduced():
    text = spec(
        "  y = linear(x, w) + bias\n  g = rowsum(y)\n  return x + linear(y * g, head_w) * 0.0 + bias * 0.0 + rowsum(x * gate_w)",
        mesh="mesh { tp = 2 }",
        split=" @tp",
        use_all=False,
    )
    local = shard(model(text))
    ops = [(n.op, n.inputs[0].name) for n in local.kind("dense").nodes]
    kinds = [op for op, _ in ops]
    y = kinds.index("add")  # linear (split) + bias (split): no exchange before it
    assert kinds[:y] == ["linear"]
    assert str(local.kind("dense").nodes[y].outputs[0].type) == "f32[B, 128]"  # per device
    g = kinds.index("rowsum")
    assert kinds[g + 1] == "all_reduce"  # the row sum of a split value is a partial sum
    assert "all_gather" in kinds[g + 1 :]  # y * g needs y whole for the unsplit head_w


# ---------------------------------------------------------------- rmsnorm offset in the kernel


def test_rmsnorm_offset_kernel_line_is_the_one_adding_an_op_shows():
    doc = (ROOT / "docs" / "adding-an-op.md").read_text(encoding="utf-8")
    shown = doc.split("```python offset kernel\n", 1)[1].split("```", 1)[0].strip()
    text = (ROOT / "specs" / "tiny.mk").read_text(encoding="utf-8")
    text = text.replace("  h = rmsnorm(x, norm2)", "  h = rmsnorm(x, norm2, offset=1.0)")
    out, _ = compile_source(text, "spec.mk", None)
    assert shown in out.files["kernel.py"]


def test_the_python_api_keeps_the_warnings(tmp_path):
    import mkdsl

    path = tmp_path / "spec.mk"
    path.write_text(spec("  return x + linear(x, w)", use_all=False), encoding="utf-8")
    warnings = mkdsl.load(str(path)).model.warnings
    assert sorted(w.message.split("`")[1] for w in warnings) == ["bias", "gate_w", "head_w"]
    assert {w.severity for w in warnings} == {"warning"}


OSS_ACT = """
block oss_act(g, u) {
  g = clamp(g, hi=7.0)
  u = clamp(u, lo=-7.0, hi=7.0)
  return (u + 1.0) * (g * sigmoid(g * 1.702)) - minimum(g, u) * 0.0
}
"""


def test_an_expert_activation_block_may_use_the_operators_and_constants():
    """gpt-oss's clamped SwiGLU as `moe_experts`' `act`: `+ - *` on tensors (broadcasting ops) and
    the scalar forms are elementwise for block attributes; the reference applies it per expert."""
    text = (ROOT / "specs" / "qwen3_30b_a3b.mk").read_text(encoding="utf-8")
    assert text.count("act=swiglu") == 1
    text = text.replace("act=swiglu", "act=oss_act") + OSS_ACT
    m = elaborate(parse(text), "mini", text)
    (node,) = [n for k in m.kinds for n in k.nodes if n.op == "moe_experts"]
    ops = [n.op for n in node.attr["act"].graph.nodes]
    assert {"clamp", "add_scalar", "mul_scalar", "mul", "sub", "minimum"} <= set(ops)
