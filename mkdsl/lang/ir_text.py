"""The graph IR as deterministic text (`mkdsl check --dump ir`), to inspect, diff and test a stage.

One line per declaration and per node: `%v` a value of the graph, `@t` a declared tensor, `$i` a
step input. Attributes are sorted by name; a layer-dependent one is shown as `<expr in l>`. The same
spec and mkdsl version give the same text.
"""

from __future__ import annotations

from mkdsl.lang.ir import Graph, LayerExpr, Model, Node, Ref, Tensor

_SIGIL = {"value": "%", "tensor": "@", "input": "$"}


def dump_ir(model: Model) -> str:
    """The whole model: header, constants, dims, mesh, tensors, hints, schedule and graphs."""
    lines = [f"model {model.name} profile={model.profile or 'none'}"]
    lines += [f"const {name} = {value!r}" for name, value in model.consts]
    lines += [f"dim {d.name} in {d.low} .. {d.high}" for d in model.dims]
    if model.mesh:
        lines.append("mesh " + ", ".join(f"{axis}={size}" for axis, size in model.mesh))
    lines += [_tensor(t) for t in model.tensors]
    lines += [f"hint {h.name} = {h.value}" for h in model.hints]
    lines.append("schedule " + " ".join(model.schedule))
    for g in (*model.kinds, model.step):
        lines += _graph(g, "kind" if g is not model.step else "step")
    return "\n".join(lines) + "\n"


def _tensor(t: Tensor) -> str:
    split = "" if not any(t.sharding) else " split [" + ", ".join(" ".join(a) or "-" for a in t.sharding) + "]"
    stack = f" stacked {t.stack} slots {list(t.slots)}" if t.stacked else ""
    return f"{t.kind} @{t.name}: {t.type}{split}{stack}"


def _ref(r: Ref) -> str:
    return _SIGIL[r.kind] + r.name


def _attr(v) -> str:
    return f"<{v.py}>" if isinstance(v, LayerExpr) else repr(v)


def _node(n: Node) -> str:
    outs = ", ".join(f"%{v.name}: {v.type}" for v in n.outputs)
    attrs = ", ".join(f"{k}={_attr(v)}" for k, v in sorted(n.attrs))
    text = f"  {outs} = {n.op}({', '.join(_ref(r) for r in n.inputs)})" + (f" {{{attrs}}}" if attrs else "")
    if n.writes:
        text += " writes " + ", ".join("@" + w for w in n.writes)
    return text + f"  # line {n.span.line}" + (f", block {n.block}" if n.block else "")


def _graph(g: Graph, what: str) -> list[str]:
    params = ", ".join(f"%{v.name}: {v.type}" for v in g.params)
    return [
        f"{what} {g.name}({params}) {{",
        *(_node(n) for n in g.nodes),
        "  return " + ", ".join(_ref(r) for r in g.results),
        "}",
    ]
