"""Attributes that are blocks: a spec block of elementwise ops passed to an op by name.

`moe_experts(z, w, ids, w1, w3, w2, act=oss_act)` applies the block `oss_act(g, u)` to each
chosen expert's gate and up results. The block is elaborated on its own (its parameters typed
by the op, `OpDef.block_attrs`) into an `ir.BlockAttr`; the reference evaluates it op by op
(`apply_block`) and the kernel composes the ops' `kernel_expr`s where the op needs it. The name
of a registered elementwise op taking that many operands is accepted too (`act=swiglu`).
"""

from __future__ import annotations

from mkdsl.lang.diagnostics import NOWHERE
from mkdsl.lang.dtypes import F32
from mkdsl.lang.ir import BlockAttr, Graph, LayerExpr, Node, Ref, TensorType, Value
from mkdsl.lang.syntax import Name
from mkdsl.ops.registry import OPS, REQUIRED, OpError

# Shard rules of ops that act entry by entry (the broadcasting ones too: inside a block every
# operand is a parameter of the same shape, so nothing broadcasts there).
ELEMENTWISE_RULES = ("elementwise", "sum", "broadcast", "broadcast_sum")


def op_block(op: str, types: tuple[TensorType, ...], **attrs) -> Graph:
    """The one-node block applying the elementwise op `op` to parameters of `types`."""
    opdef = OPS[op]
    params = tuple(Value(name, t, NOWHERE) for name, t in zip(opdef.operands, types, strict=True))
    values = {k: v for k, v in opdef.attrs.items() if v is not REQUIRED} | attrs
    out = Value("out", TensorType(F32, types[0].shape), NOWHERE)
    node = Node(op, tuple(Ref("value", p.name) for p in params), tuple(sorted(values.items())), (out,), (), NOWHERE)
    return Graph(op, params, (node,), (Ref("value", "out"),), NOWHERE)


def apply_block(block: BlockAttr, *arrays):
    """The block's result on `arrays` (one per parameter), each op by its reference."""
    env = {p.name: a for p, a in zip(block.graph.params, arrays, strict=True)}
    for n in block.graph.nodes:
        outs = OPS[n.op].reference(*(env[r.name] for r in n.inputs), **n.attr)
        env.update((v.name, o) for v, o in zip(n.outputs, outs))
    return env[block.graph.results[0].name]


def _problem(g: Graph) -> tuple[object, str] | None:
    """(span, message) of the first thing that keeps `g` from being an elementwise block."""
    for n in g.nodes:
        op = OPS[n.op]
        if op.kernel_expr is None or op.shard not in ELEMENTWISE_RULES:
            return n.span, f"`{n.op}` is not an elementwise op"
        outside = next((r for r in n.inputs if r.kind != "value"), None)
        if outside is not None:
            return n.span, f"`{outside.name}` is not a parameter of the block or a value computed in it"
        if any(isinstance(v, LayerExpr) for _, v in n.attrs):
            return n.span, f"`{n.op}` has a layer-dependent attribute"
    if len(g.results) != 1:
        return g.span, f"it returns {len(g.results)} values, not one"
    return None


def _from_block(ctx, v: Name, types: tuple[TensorType, ...], what: str, kind: str | None) -> Graph | None:
    f = ctx.el.d.blocks[v.id]
    if len(f.params) != len(types):
        ctx.rep.error(v.span, f"{what} takes {len(types)} parameters, but block `{v.id}` has {len(f.params)}")
        return None
    params = tuple(Value(p, t, f.span) for p, t in zip(f.params, types))
    g = ctx.build_graph(f.name, f, params, layer_kind=kind)  # the caller's kind: its tensors resolve
    if g is None:
        return None
    problem = _problem(g)
    if problem is None and ctx.type_of(g, g.results[0]).shape != types[0].shape:
        problem = f.span, f"it returns {ctx.type_of(g, g.results[0])}, not {types[0]}"
    if problem is not None:
        ctx.rep.error(problem[0], f"block `{v.id}` cannot be {what}: {problem[1]}", "use only elementwise ops")
        return None
    return g


def _resolve(ctx, e, op, name: str, v, types, kind: str | None) -> Graph | None:
    what = f"`{op.name}`'s `{name}`"
    if isinstance(v, Name) and v.id in ctx.el.d.blocks:
        return _from_block(ctx, v, types, what, kind)
    target = OPS.get(v.id) if isinstance(v, Name) else None
    if target is not None and target.kernel_expr is not None and len(target.operands) == len(types):
        if all(d is not REQUIRED for d in target.attrs.values()) and target.shard in ELEMENTWISE_RULES:
            return op_block(v.id, types)
    span = getattr(v, "span", e.span)
    ctx.rep.error(
        span,
        f"{what} must name a block of elementwise ops with {len(types)} parameters",
        f"e.g. `block act(g, u) {{ return swiglu(g, u) }}` and `{name}=act`",
    )
    return None


def resolve_block_attrs(ctx, e, op, attrs: dict, operands, kind: str | None = None) -> bool:
    """Replace each block attribute's name by its elaborated `BlockAttr`; False after an error."""
    ok = True
    for name, param_types in op.block_attrs:
        v = attrs.get(name)
        if v is None or v is REQUIRED:
            continue
        try:
            types = param_types(operands)
        except OpError:
            continue  # the op's shape rule reports the operand
        g = _resolve(ctx, e, op, name, v, types, kind)
        if g is None:
            ok = False
        else:
            attrs[name] = BlockAttr(g)
    return ok
