"""How an op runs over a whole prompt at once (prefill): the rows it sees and the generic rules.

In prefill every value has B*T rows, row b*T + t being prompt row b's token t. A row-wise op
(linear, norms, elementwise, moe, embedding, ...) needs nothing more: its decode reference runs
over the B*T rows unchanged, which is the default (`OpDef.prefill` None). An op that updates
state (`inout`) must declare its rule: attention writes every position into its cache and is
causal over it; a recurrent op scans its one-token reference over T (`scan_rule`). Tokens past
a row's length (`Rows.valid` False) are computed but write nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mkdsl.lazy import jax, jnp


@dataclass(frozen=True)
class Rows:
    """The B*T rows of a prefill: per row its position in the cache and whether it is a token."""

    batch: int
    length: int
    positions: object  # i32 [B*T]
    valid: object  # bool [B*T]
    # Verify rows (mkdsl/run/rows.py): a recurrent state has a slot per row, [B*T, ...], row
    # b*T + t holding the state after token t; the step reads its start from slot T - 1.
    row_states: bool = False

    def by_token(self, x):
        """[B*T, ...] -> [T, B, ...] (scan order)."""
        return jnp.swapaxes(x.reshape(self.batch, self.length, *x.shape[1:]), 0, 1)

    def by_row(self, x):
        """[T, B, ...] -> [B*T, ...]."""
        return jnp.swapaxes(x, 0, 1).reshape(self.batch * self.length, *x.shape[2:])

    def write_positions(self, size: int):
        """Each row's cache position, or `size` (dropped by a scatter with mode="drop") past its length."""
        return jnp.where(self.valid, self.positions, size)

    def row_ids(self):
        """Each row's prompt row b."""
        return jnp.repeat(jnp.arange(self.batch), self.length)


def scan_rule(step: Callable, tokens: tuple[int, ...], state: int) -> Callable:
    """The prefill rule of a recurrent op: its one-token `step(*operands) -> (out, new_state)`
    scanned over the prompt; operands `tokens` have a row per token, `state` is the carried
    state (kept where a row has no token), the others are passed as they are."""

    def rule(rows: Rows, *operands, **attrs):
        def body(s, xs):
            *xt, ok = xs
            args = list(operands)
            for i, x in zip(tokens, xt):
                args[i] = x
            args[state] = s
            out, new = step(*args, **attrs)
            keep = ok.reshape(ok.shape + (1,) * (new.ndim - 1))
            return jnp.where(keep, new, s), out

        seqs = (*[rows.by_token(operands[i]) for i in tokens], rows.by_token(rows.valid))
        if not rows.row_states:
            final, outs = jax.lax.scan(body, operands[state], seqs)
            return rows.by_row(outs), final
        init = operands[state]  # the committed state sits in each sequence's last row slot
        init = init.reshape(rows.batch, rows.length, *init.shape[1:])[:, -1]

        def keep_every(s, xs):
            new, out = body(s, xs)
            return new, (out, new)

        _, (outs, states) = jax.lax.scan(keep_every, init, seqs)
        return rows.by_row(outs), rows.by_row(states)

    return rule


def device_index(axes) -> object:
    """This device's block index over mesh `axes`, row-major in their order (as the kernel numbers
    blocks); inside `shard_map` only (the SPMD prefill rules)."""
    return jax.lax.axis_index(tuple(axes))
