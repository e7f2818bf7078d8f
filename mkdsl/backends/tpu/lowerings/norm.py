"""`rmsnorm` and `layernorm`: one fused pass over a row (or each head of it), weight (and bias)
fetched per layer."""

from __future__ import annotations

from mkdsl.backends.tpu.lowering import EmitContext, Lowering, Site, register_lowering


def norm_weight(em: EmitContext, node, pre: list[str]) -> str:
    """Code for a norm's fetched weight row, in the (offset + w) form where the node has an offset
    (added once to the fetched row)."""
    if node.opt_arg("weight") is None:  # weightless: the runtime multiplies by nothing
        return "None"
    w = em.fetched(node.arg("weight").name, pre)
    if node.attr.get("offset", 0.0) != 0.0:
        w = f"({em.attr_codes(node)['offset']} + {w})"
    return w


def _rmsnorm_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    node = at.node
    return dict(x=ins[0], w=norm_weight(em, node, pre), eps=em.attr_codes(node)["eps"], heads=node.attr["heads"])


register_lowering(Lowering("rmsnorm", "lowerings/norm.jinja", "rmsnorm", _rmsnorm_record))


def _layernorm_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    node = at.node
    bias = node.opt_arg("bias")
    return dict(
        x=ins[0],
        w=em.fetched(node.arg("weight").name, pre),
        b="None" if bias is None else em.fetched(bias.name, pre),
        eps=em.attr_codes(node)["eps"],
        heads=node.attr["heads"],
    )


register_lowering(
    Lowering("layernorm", "lowerings/norm.jinja", "layernorm", _layernorm_record, runtime=("runtime/norm.py.jinja",))
)
