"""A deferred norm's exchanges (`Comm.reduce_scatter`, `Comm.all_reduce_scaled`), over 8 devices.

mkdsl/spmd/defer_norm.py turns `all_reduce -> rmsnorm -> shard_slice -> linear [+ b] -> all_reduce`
into a reduce-scatter of exactly n / G columns per member, the projection of the weighted slice,
and one all-reduce that sums the projection's chunks, the other partial's and every member's sum
of squares in its first phase and applies the norm's row scale before its all-gather.

The kernel runs, in a `fori_loop` of ITERS iterations on fresh data, both exchanges over ep
(bits 1-2, 4 members, with the other partial b) and over tp (bit 0, 2 members, without b), the
first reduce-scatter with work run `during` its exchange. TPU interpret mode with the race
detector, NaN-filled uninitialised memory and raising out-of-bounds reads, on 8 host devices,
mesh ("ep", "tp") = (4, 2), in a subprocess (this file is its script; tests/test_comm.py says
why), at 8 rows on the wire on a bf16 wire and at 1 row on an f32 wire. Checks against numpy:

- the reduce-scatter is bit-identical to its emulation (member c sums chunk c of the members'
  wire-rounded partials in group-index order, once rounded to the wire);
- the scaled all-reduce is close to float64 arithmetic on the same inputs (the bound below is
  derived from its roundings), bit-identical on every member of a group;
- rows past the wire are zero, nothing is NaN, no race, the work run during the exchange is right.

A deliberately broken copy of the runtime (each member scaling by its own squares only) must fail.
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
EP, TP = 0b110, 0b001
ITERS = 2
ROWS = 16  # padded rows; rows on the wire: 8 or 1
N, H = 256, 256  # the normalised value's columns (whole); the projection's
EPS = 1e-5
INS = {"p1": N, "a1": H, "b1": H, "p2": N, "a2": H}  # 1: over ep with b; 2: over tp without b
OUTS = {"M1": N // 4, "Y1": H, "M2": N // 2, "Y2": H, "DA": H}


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


def body_of(r, comm, wire):
    def body(it, carry):
        def during():
            r.DA[it] = r.a1[it] * 2.0 + 1.0

        comm.reduce_scatter(r.p1.at[it], r.M1.at[it], EP, wire=wire, during=during)
        comm.all_reduce_scaled(r.a1.at[it], r.M1.at[it], r.Y1.at[it], EP, n=N, eps=EPS, b_ref=r.b1.at[it], wire=wire)
        comm.reduce_scatter(r.p2.at[it], r.M2.at[it], TP, wire=wire)
        comm.all_reduce_scaled(r.a2.at[it], r.M2.at[it], r.Y2.at[it], TP, n=N, eps=EPS, wire=wire)
        return carry

    return body


def build(ns: dict, mesh, interpret, wire_rows: int, wire16: bool):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from jax.sharding import PartitionSpec as P  # noqa: N817

    # Slots: the scaled all-reduce's first message is the widest, its chunks (64 columns of a and
    # of b over ep, 128 of a over tp) and at least one lane of squares: 256 lanes on the f32 wire
    # (128 on bf16). Widest staging: 4 such messages over ep.
    slots = {EP: 256, TP: 256}
    spec = ns["comm_scratch"](wire_rows, slots, 4 * 256)
    names = [*INS, *OUTS, *spec]
    wire = jnp.bfloat16 if wire16 else jnp.float32

    def kernel(*refs):
        r = ns["Refs"](names, refs)
        comm = ns["Comm"](r, axes=AXES, sizes=SIZES)
        for mask in slots:  # the previous step's use of the slots: NaN bits a racing write would show
            buf = getattr(r, f"comm_recv_{mask}")
            buf[...] = jnp.full(buf.shape, 0x7FC00000, jnp.int32)
        comm.enter()
        jax.lax.fori_loop(0, ITERS, body_of(r, comm, wire), 0)

    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    call = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((ITERS, ROWS, n), jnp.float32) for n in OUTS.values()],
        in_specs=[vmem] * len(INS),
        out_specs=[vmem] * len(OUTS),
        scratch_shapes=ns["comm_scratch_shapes"](spec),
        compiler_params=pltpu.CompilerParams(collective_id=0),
        interpret=interpret,
    )
    split = P(AXES)
    fn = jax.shard_map(
        lambda *xs: tuple(call(*xs)),
        mesh=mesh,
        in_specs=(split,) * len(INS),
        out_specs=(split,) * len(OUTS),
        check_vma=False,
    )
    return jax.jit(fn)


def run_interpret(out_path: str, comm_path: str, wire_rows: int, wire16: bool) -> None:
    import jax
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P  # noqa: N817

    from mkdsl.verify.kernel import interpret_params

    mesh = jax.make_mesh(SIZES, AXES)
    params = interpret_params()  # race detector, NaN-filled fresh memory, OOB reads raising
    fn = build(load_runtime(Path(comm_path)), mesh, params, wire_rows, wire16)
    rng = np.random.default_rng(0)
    data = {k: rng.standard_normal((8, ITERS, ROWS, n)).astype(np.float32) for k, n in INS.items()}
    args = [jax.device_put(x.reshape(-1, *x.shape[2:]), NamedSharding(mesh, P(AXES))) for x in data.values()]
    outs = jax.block_until_ready(fn(*args))
    result = {f"in_{k}": v for k, v in data.items()}
    result.update({f"out_{k}": np.asarray(v).reshape(8, ITERS, ROWS, -1) for k, v in zip(OUTS, outs, strict=True)})
    result["races"] = np.array(ipc.races is not None and ipc.races.races_found)
    np.savez(out_path, **result)


# ---------------------------------------------------------------------------- references


def members(d: int, mask: int) -> list[int]:
    """The devices of d's group over `mask`, by group index (mask bits packed, low first)."""
    bits = [k for k in range(3) if mask >> k & 1]
    return [(d & ~mask) | sum(((j >> i) & 1) << k for i, k in enumerate(bits)) for j in range(1 << len(bits))]


def rounder(wire16: bool):
    import jax.numpy as jnp

    return (lambda v: np.asarray(v.astype(jnp.bfloat16).astype(np.float32))) if wire16 else (lambda v: v)


def emulated_scatter(p: np.ndarray, d: int, mask: int, wire16: bool) -> np.ndarray:
    """Device d's reduce-scatter: its chunk of the group's wire-rounded partials, summed in
    group-index order one f32 add at a time, rounded to the wire once."""
    rnd, group = rounder(wire16), members(d, mask)
    cw = p.shape[-1] // len(group)
    c = group.index(d)
    total = rnd(p[group[0], ..., c * cw : (c + 1) * cw])
    for e in group[1:]:
        total = (total + rnd(p[e, ..., c * cw : (c + 1) * cw])).astype(np.float32)
    return rnd(total)


def scaled_bound(a, b, m, d, mask, wire16: bool):
    """(float64 value, its tolerance) of device d's scaled all-reduce, from the members' inputs
    a, b (or None) and their reduce-scattered slices m (as the kernel made them).

    y = Σa · s + Σb, s = (Σ rowsum(m²) / N + eps)^-1/2. Roundings, each at most u of its value (u =
    2^-9 on a bf16 wire, 2^-24 on f32): every partial, each chunk's sum, the result before the
    all-gather; the f32 adds (at most 3 per chunk, 2^-24 of the running |sum| each). So
    |Δ(Σa·s)| <= s·(2u + 3·2^-24)·Σ|a| + |Σa|·|Δs|, the same for b without s, plus u·|y|. The
    scale s is f32 arithmetic on exact f32 squares: the squares' sums (N / G + G terms) err by at
    most (N + 8)·2^-24 relative, rsqrt by a few ulp: |Δs| <= 2^-16·s covers both with margin.
    The tolerance is 2x the sum."""
    group = members(d, mask)
    u = 2.0**-9 if wire16 else 2.0**-24
    squares = sum((m[e].astype(np.float64) ** 2).sum(-1, keepdims=True) for e in group)
    s = 1.0 / np.sqrt(squares / N + EPS)
    sa = sum(a[e].astype(np.float64) for e in group)
    abs_a = sum(np.abs(a[e]).astype(np.float64) for e in group)
    want, err = sa * s, s * (2 * u + 3 * 2.0**-24) * abs_a + np.abs(sa) * s * 2.0**-16
    if b is not None:
        want = want + sum(b[e].astype(np.float64) for e in group)
        err = err + (2 * u + 3 * 2.0**-24) * sum(np.abs(b[e]).astype(np.float64) for e in group)
    return want, 2 * (err + u * np.abs(want))


def failures(res, wire_rows: int, wire16: bool) -> list[str]:
    """What is wrong with one run (empty: nothing)."""
    out = ["race detected"] if bool(res["races"]) else []
    out += [f"{k}: NaN" for k in OUTS if np.isnan(res[f"out_{k}"]).any()]
    out += [
        f"{k}: rows past the wire not zero" for k in ("M1", "Y1", "M2", "Y2") if res[f"out_{k}"][:, :, wire_rows:].any()
    ]
    if not np.array_equal(res["out_DA"], res["in_a1"] * np.float32(2) + np.float32(1)):
        out.append("DA: the work run during the exchange is wrong")
    w = slice(0, wire_rows)
    for mk, yk, p, a, b, mask in (("M1", "Y1", "p1", "a1", "b1", EP), ("M2", "Y2", "p2", "a2", None, TP)):
        m, y = res[f"out_{mk}"][:, :, w], res[f"out_{yk}"][:, :, w]
        for d in range(8):
            if not np.array_equal(m[d], emulated_scatter(res[f"in_{p}"][:, :, w], d, mask, wire16)):
                out.append(f"{mk}: device {d} differs from the emulated reduce-scatter")
                break
            bs = res[f"in_{b}"][:, :, w] if b else None
            want, tol = scaled_bound(res[f"in_{a}"][:, :, w], bs, m, d, mask, wire16)
            if not (np.abs(y[d] - want) <= tol).all():
                out.append(f"{yk}: device {d} off by {np.abs(y[d] - want).max()}")
                break
            if any(not np.array_equal(y[d].view(np.int32), y[e].view(np.int32)) for e in members(d, mask)):
                out.append(f"{yk}: the members of device {d}'s group differ")
                break
    return out


def run(tmp_path: Path, comm: Path, wire_rows: int, wire16: bool) -> dict:
    out = tmp_path / "out.npz"
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu")
    cmd = [sys.executable, __file__, str(out), str(comm), str(wire_rows), str(int(wire16))]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    return dict(np.load(out))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("wire_rows", "wire16"), [(8, True), (1, False)])
def test_deferred_norm_exchanges_equal_their_arithmetic(tmp_path, wire_rows, wire16):
    assert failures(run(tmp_path, RUNTIME / "comm.py.jinja", wire_rows, wire16), wire_rows, wire16) == []


@pytest.mark.timeout(300)
def test_a_broken_scaled_all_reduce_fails_the_checks(tmp_path):
    text = (RUNTIME / "comm.py.jinja").read_text(encoding="utf-8")
    own = "jnp.sum(mine * mine, axis=1, keepdims=True)"
    broken = text.replace("rsqrt(squares / n + eps)", f"rsqrt({own} / n + eps)")  # my own squares, not the group's
    assert broken != text
    path = tmp_path / "comm_broken.py"
    path.write_text(broken, encoding="utf-8")
    assert failures(run(tmp_path, path, 1, False), 1, False) != []


if __name__ == "__main__":
    run_interpret(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1")
