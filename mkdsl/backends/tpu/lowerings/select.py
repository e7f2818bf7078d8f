"""`argmax`: an in-kernel scan of each row; split over a mesh, the devices combine their bests.
The step's next token (the argmax writing `next_tokens`) is drawn by `sampled_argmax`
(wrapper/sampling.py.jinja): the argmax itself when greedy, else the seeded draw."""

from __future__ import annotations

from mkdsl.backends.tpu.lowering import EmitContext, Lowering, Site, register_lowering


def chunk(width: int) -> int:
    """Columns scanned per step of an in-kernel reduction: a lane-aligned divisor of `width`."""
    if width % 128:
        return width
    best = 128
    for c in range(128, min(width, 2048) + 1, 128):
        if width % c == 0:
            best = c
    return best


def _argmax_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    width = em.value_width(at.graph, at.node.arg("x"))
    axes = at.node.attr.get("shard_axes", ())
    n = dict(x=ins[0], chunk=chunk(width), mask=em.mask(axes) if axes else None)
    n["sampled"] = em.output(at) == "next_tokens"  # the step's token: drawn as `sampling` says, in the kernel
    if axes:
        n.update(offset=f"{em.group_index(axes)} * {width}")
    return n


register_lowering(Lowering("argmax", "lowerings/select.jinja", "argmax", _argmax_record))
