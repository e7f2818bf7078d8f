"""Collectives ready together as ONE exchange (`Comm.together`, runtime/comm.py.jinja), over 8 devices.

The kernel runs, in a `fori_loop` of ITERS iterations on fresh data, three shared exchanges: the
Kimi K3 case (an all-gather over tp and one over ep, as the router scores and the latent
activation); two all-reduces (reduce-scatter + all-gather over ep on a bf16 wire, whose first
phase is shared, and a one-shot over tp in f32); a chip-first all-reduce over all devices (bf16,
one-shot inside; its pair reduce-scatter over bit 0 shared) with an all-gather over ep. Then the
same six collectives one after the other through the plain methods, all through the same
scratch. TPU interpret mode with the race detector, NaN-filled uninitialised memory and raising
out-of-bounds reads, on 8 host devices, mesh ("ep", "tp") = (4, 2), in a subprocess (this file
is its script; see tests/test_comm.py for why), at 8 rows on the wire (batches 2-8) and at 1 (a
kernel built for batch 1). The receive slots are NaN-filled before the entry barrier (a peer's
write not ordered after it is a race). Checks: the shared exchanges give the same bits as the
plain methods (all rows, including the rows past the wire: an all-reduce keeps its partial
there, an all-gather zeroes them), the all-gathers equal the group's slices in group-index
order, no race, no NaN; the work run `during` the first one (it overwrites the buffer that exchange
gathers from, as a window reusing a dead input would) is right and leaves the gather right.

A deliberately broken copy of the runtime (the members' messages staged over each other's
columns) must fail the same checks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from xla_cpu import xla_flags

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "mkdsl" / "backends" / "tpu" / "templates" / "runtime"
AXES, SIZES = ("ep", "tp"), (4, 2)
ITERS = 2
ROWS = 16  # padded rows; rows on the wire: 8 (batches 2-8; rows 8-15 never travel) or 1 (batch 1)
GW, W = 128, 256  # all-gather slice width; all-reduce width
INS = {"a": GW, "b": GW, "c": W, "d": W, "t": W}  # a: gathered over tp, b: over ep; c summed over ep, d tp, t all
OUTS = {"GA": GW * 2, "GB": GW * 4, "RC": W, "RD": W, "RT": W, "GE": GW * 4}  # shared; U* by the plain methods
# Written by the work run `during` the first shared exchange (mkdsl/spmd/overlap.py's windows): A2 holds a
# copy of `a` that exchange gathers, overwritten during it (a window may reuse a collective's dead
# input buffer: inputs are staged before the sends start); DA is computed during it.
DURING = {"A2": GW, "DA": GW}


def load_runtime(comm_path: Path) -> dict:
    """core.py.jinja then the collectives, exec'd as a generated module would hold them."""
    import dataclasses
    import math

    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    ns = dict(jax=jax, jnp=jnp, np=np, pl=pl, pltpu=pltpu, math=math, dataclasses=dataclasses)
    for path in (RUNTIME / "core.py.jinja", comm_path):
        exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), ns)
    return ns


def body_of(r, comm):
    import jax.numpy as jnp

    F32, BF16 = jnp.float32, jnp.bfloat16  # noqa: N806
    tp, ep, every = comm.mask("tp"), comm.mask("ep"), comm.mask()

    def body(it, carry):
        r.A2[it] = r.a[it]

        def during():
            r.DA[it] = r.a[it] * 2.0 + 1.0
            r.A2[it] = jnp.full(r.A2.shape[1:], -1.0, F32)

        shared = (("gather", r.A2.at[it], r.GA.at[it], tp, F32), ("gather", r.b.at[it], r.GB.at[it], ep, F32))
        comm.together(shared, during=during)
        comm.together((("rs_ag", r.c.at[it], r.RC.at[it], ep, BF16), ("oneshot", r.d.at[it], r.RD.at[it], tp, F32)))
        comm.together(
            (
                ("hier", r.t.at[it], r.RT.at[it], every, BF16, "all_reduce_oneshot"),
                ("gather", r.b.at[it], r.GE.at[it], ep, F32),
            )
        )
        comm.all_gather(r.a.at[it], r.UGA.at[it], tp)
        comm.all_gather(r.b.at[it], r.UGB.at[it], ep)
        r.URC[it] = r.c[it]
        comm.all_reduce(r.URC.at[it], ep, wire=BF16)
        r.URD[it] = r.d[it]
        comm.all_reduce_oneshot(r.URD.at[it], tp, wire=F32)
        r.URT[it] = r.t[it]
        comm.all_reduce_hier(r.URT.at[it], every, wire=BF16, inner="all_reduce_oneshot")
        comm.all_gather(r.b.at[it], r.UGE.at[it], ep)
        return carry

    return body


def build(ns: dict, mesh, interpret, wire_rows: int):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from jax.sharding import PartitionSpec as P  # noqa: N817

    outs = {**OUTS, **{"U" + k: n for k, n in OUTS.items()}, **DURING}
    tp, ep = (ns["axis_mask"](AXES, SIZES, (a,)) for a in ("tp", "ep"))
    slots = {tp: W, ep: 128}  # tp (bit 0): the one-shot's whole 256 columns; ep: 128-lane slices, bf16 chunks
    # Widest staging: the second shared phase, 4 bf16 chunks of 128 lanes over ep beside 256 over tp.
    # The chip-first all-reduce keeps half of 256 bf16 columns: one 256-column chunk.
    spec = ns["comm_scratch"](wire_rows, slots, 4 * 128 + W, half_width=W)
    names = [*INS, *outs, *spec]

    def kernel(*refs):
        r = ns["Refs"](names, refs)
        comm = ns["Comm"](r, axes=AXES, sizes=SIZES)
        for mask in slots:  # the previous step's use of the slots: NaN bits a racing write would show
            buf = getattr(r, f"comm_recv_{mask}")
            buf[...] = jnp.full(buf.shape, 0x7FC00000, jnp.int32)
        comm.enter()
        jax.lax.fori_loop(0, ITERS, body_of(r, comm), 0)

    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    call = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((ITERS, ROWS, n), jnp.float32) for n in outs.values()],
        in_specs=[vmem] * len(INS),
        out_specs=[vmem] * len(outs),
        scratch_shapes=ns["comm_scratch_shapes"](spec),
        compiler_params=pltpu.CompilerParams(collective_id=0),
        interpret=interpret,
    )
    split = P(AXES)
    fn = jax.shard_map(
        lambda *xs: tuple(call(*xs)),
        mesh=mesh,
        in_specs=(split,) * len(INS),
        out_specs=(split,) * len(outs),
        check_vma=False,
    )
    return jax.jit(fn), list(outs)


def run_interpret(out_path: str, comm_path: str, wire_rows: int) -> None:
    import jax
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P  # noqa: N817

    from mkdsl.verify.kernel import interpret_params

    mesh = jax.make_mesh(SIZES, AXES)
    params = interpret_params()  # race detector, NaN-filled fresh memory, OOB reads raising
    fn, names = build(load_runtime(Path(comm_path)), mesh, params, wire_rows)
    rng = np.random.default_rng(0)
    data = {k: rng.standard_normal((8, ITERS, ROWS, n)).astype(np.float32) for k, n in INS.items()}
    args = [jax.device_put(x.reshape(-1, *x.shape[2:]), NamedSharding(mesh, P(AXES))) for x in data.values()]
    outs = jax.block_until_ready(fn(*args))
    result = {f"in_{k}": v for k, v in data.items()}
    result.update({f"out_{k}": np.asarray(v).reshape(8, ITERS, ROWS, -1) for k, v in zip(names, outs, strict=True)})
    result["races"] = np.array(ipc.races is not None and ipc.races.races_found)
    np.savez(out_path, **result)


def members(d: int, mask: int) -> list[int]:
    """The devices of d's group over `mask`, by group index (mask bits packed, low first)."""
    bits = [k for k in range(3) if mask >> k & 1]
    return [(d & ~mask) | sum(((j >> i) & 1) << k for i, k in enumerate(bits)) for j in range(1 << len(bits))]


def failures(res, wire_rows: int) -> list[str]:
    """What is wrong with one run (empty: nothing)."""
    out = ["race detected"] if bool(res["races"]) else []
    for k in OUTS:
        got, plain = res[f"out_{k}"], res[f"out_U{k}"]
        if np.isnan(got).any() or np.isnan(plain).any():
            out.append(f"{k}: NaN")
        elif not np.array_equal(got.view(np.int32), plain.view(np.int32)):
            out.append(f"{k}: shared exchange differs from the plain method")
    if not np.array_equal(res["out_DA"], res["in_a"] * np.float32(2) + np.float32(1)):
        out.append("DA: the work run during the exchange is wrong")
    for k, src, mask in (("GA", "a", 0b001), ("GB", "b", 0b110), ("GE", "b", 0b110)):
        x = res[f"in_{src}"]
        for d in range(8):
            want = np.concatenate([x[m, :, :wire_rows] for m in members(d, mask)], axis=-1)
            if not np.array_equal(res[f"out_{k}"][d, :, :wire_rows], want):
                out.append(f"{k}: device {d} is not the group's slices in group-index order")
                break
    return out


def run(tmp_path: Path, comm: Path, wire_rows: int) -> dict:
    out = tmp_path / "out.npz"
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu")
    cmd = [sys.executable, __file__, str(out), str(comm), str(wire_rows)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    return dict(np.load(out))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("wire_rows", [8, 1])
def test_ready_together_exchange_equals_the_collectives_one_by_one(tmp_path, wire_rows):
    res = run(tmp_path, RUNTIME / "comm.py.jinja", wire_rows)
    assert failures(res, wire_rows) == []
    # Rows past the wire: the all-gathers zero them, the all-reduces keep their own partial.
    assert not res["out_GA"][:, :, wire_rows:].any()
    assert np.array_equal(res["out_RC"][:, :, wire_rows:], res["in_c"][:, :, wire_rows:])


@pytest.mark.timeout(300)
def test_a_broken_shared_exchange_fails_the_checks(tmp_path):
    text = (RUNTIME / "comm.py.jinja").read_text(encoding="utf-8")
    broken = text.replace("            off += width\n", "")  # every member staged at column 0
    assert broken != text
    path = tmp_path / "comm_broken.py"
    path.write_text(broken, encoding="utf-8")
    assert failures(run(tmp_path, path, 1), 1) != []


if __name__ == "__main__":
    run_interpret(sys.argv[1], sys.argv[2], int(sys.argv[3]))
