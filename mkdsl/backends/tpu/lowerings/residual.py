"""The block residual stream: `res_init`, `res_mix`, `res_snapshot` (runtime part `residual`).

`res_mix` and `res_snapshot` take their layer-dependent attributes (`layer=l`) as traced
scalars, so one layer kind serves every layer."""

from __future__ import annotations

from mkdsl.backends.tpu.lowering import EmitContext, Lowering, Site, register_lowering

RESIDUAL = ("runtime/residual.py.jinja",)


def _init_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    return dict(x=ins[0])


def _mix_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    attr = em.attr_codes(at.node)
    return dict(
        blocks=ins[0],
        prefix=ins[1],
        w=em.fetched(at.node.arg("w").name, pre),
        layer=attr["layer"],
        block=attr["block"],
        after=attr["after_snapshot"],
        eps=attr["eps"],
    )


def _snapshot_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    attr = em.attr_codes(at.node)
    return dict(blocks=ins[0], prefix=ins[1], layer=attr["layer"], block=attr["block"])


T = "lowerings/residual.jinja"
register_lowering(Lowering("res_init", T, "res_init", _init_record, runtime=RESIDUAL))
register_lowering(Lowering("res_mix", T, "res_mix", _mix_record, runtime=RESIDUAL, layer_attrs=True))
register_lowering(Lowering("res_snapshot", T, "res_snapshot", _snapshot_record, runtime=RESIDUAL, layer_attrs=True))
