"""What the planner and the timeline both read off a node: the weight it streams, its attributes
for a cost rule, its types with the step's sizes filled in."""

from __future__ import annotations

from mkdsl.lang.ir import LayerExpr, Node, TensorType
from mkdsl.ops import OPS


def streamed_weight(node: Node):
    """The operand of `node` that streams through the ring (`OpDef.reach`) if it is a declared matrix."""
    op = OPS.get(node.op)
    if op is None:
        return None
    refs = zip(op.operands[: len(node.inputs)], node.inputs, strict=True)  # optional operands may be left out
    return next((r for name, r in refs if op.reached(name) == "stream" and r.kind == "tensor"), None)


def concrete(t: TensorType, sizes: dict[str, int]) -> TensorType:
    return TensorType(t.dtype, tuple(sizes.get(d, d) if isinstance(d, str) else d for d in t.shape))


def cost_attrs(node: Node) -> dict:
    """Attributes for cost rules: a layer-dependent one at its first layer (costs ignore them)."""
    return {k: v.first if isinstance(v, LayerExpr) else v for k, v in node.attrs}
