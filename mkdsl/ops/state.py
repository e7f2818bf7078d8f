"""`read_state`: a state tensor read as a value, inserted by the elaborator, never written in a spec.

Ops that own a state move it themselves (in place, or `OpDef.reach` "own"). Any other op that reads
a state tensor (a drafter's `linear(context, fc)` over the target's hidden states) reads it
through this op: the elaborator puts a `read_state` node before it, so that the kernel has one
place that copies the state from HBM into a VMEM value, the planner one place to charge its bytes,
and the shard pass one rule (the value keeps the state's split). Its reference is the identity.
"""

from __future__ import annotations

from mkdsl.lazy import jnp
from mkdsl.ops.registry import Cost, OpDef, nbytes, register

READ_STATE = "read_state"


def _same(args, attrs):
    return (args[0].type,)


def _prefill(rows, x):
    """Over a prompt's B*T rows (mkdsl/ops/prefill.py `Rows`): each token row reads its sequence's
    row of the state (a state kept per row already has the B*T rows)."""
    if x.shape[0] == rows.batch * rows.length:
        return (x,)
    return (jnp.take(x, rows.row_ids(), axis=0),)


register(
    OpDef(
        READ_STATE,
        ("x",),
        _same,
        lambda x: (x,),
        lambda ins, outs, a: Cost(state_bytes=nbytes(ins[0])),
        doc="A state tensor as a value (rows x width): the kernel copies it from HBM into VMEM once per step.",
        internal=True,
        shard="any",  # the value is split as the state is
        reach=(("x", "own"),),  # its lowering moves the state
        prefill=_prefill,
    )
)
