"""The in-kernel collectives (runtime/comm.py.jinja) inside one Pallas TPU kernel.

The runtime text is exec'd after core.py.jinja into a namespace holding the imports of a
generated module. The test kernel runs, in a `fori_loop` of 3 iterations on fresh data,
f32 all-reduces over all axes and over tp, bf16-wire all-reduces over ep and over all axes,
all-gathers over tp and over ep and the argmax combine over all axes and over ep: 17 exchange
phases per iteration, bit 0 used 5 times (odd, so its slot parity differs from one iteration to
the next), all through the same scratch. It runs twice: with 8 rows on the wire (a kernel built
for batches 2-8) and with 1 (batch 1; 2 iterations): every comm buffer then has 1 row, rows 1-15
of every value must never travel, and row 0 must equal the reference.

* Interpret: 8 devices, mesh ("ep", "tp") = (4, 2), TPU interpret mode with the race detector,
  NaN-filled uninitialised memory and raising out-of-bounds reads, in a subprocess (the host
  device count must be set before jax initialises; this file is the subprocess's script).
  Before its entry barrier the kernel writes NaN into the receive slots, standing for the
  previous step's use of that scratch: a peer's write not ordered after it by the barrier is a
  race. Checks against numpy: all-reduces equal an exact emulation of the recursive doubling
  (same pairing, same order, bf16 rounding of the partials) bit for bit, and are close to the
  float64 sum (f32 wire: 2^-20 of the sum of |x|; bf16 wire: phases * 2^-6 of it, 4x the bf16
  rounding of each phase's two partials); every device of a group holds the same bits;
  all-gathers are exact, in group-index order; argmax returns the first maximum of the
  concatenated row (half the rows are drawn from 4 integers, so ties across devices are
  common); no NaN; no race; no semaphore left non-zero at kernel exit. A deadlock fails on the
  subprocess timeout. The bit-for-bit check holds on any IEEE machine: each exchange phase is one
  two-operand f32 add (commutative, correctly rounded) or a bf16 cast, in the same order on both
  sides, with no sum whose order XLA could choose. Draws: seed 0 by default (reproducible, like the
  Hypothesis profile `ci`); fresh ones with MKDSL_HYPOTHESIS_PROFILE=dev (the seed is in the
  failure message); MKDSL_COMM_SEED=n repeats one.
* Compile: the same kernel through libtpu for the compile-only TPU7x topologies tpu7x:2x2x1
  (8 devices, mesh (4, 2)) and tpu7x:4x4x1 (32 devices, mesh (8, 4)).

Seen failing (MKDSL_COMM_RUNTIME=<broken copy>): wrong peer, no add, bf16 sum of unrounded own
partial, no barrier or a partial one, one slot per bit, a shared receive semaphore, no send
wait, the counter not advanced (races); tie to the larger index, no tie rule, reversed group
order, gathered block put at the wrong offset (values/NaN); a doubled receive wait (timeout). At
1 row on the wire: 8-row buffers (as before exchange_rows: rows past the wire changed, and the
in-kernel rows check), an all-gather not zeroing the rows past the wire (NaN).

Pitfall: with several host devices, TPU interpret mode deadlocks once any buffer of a device
(input, output or scratch) reaches 100 KiB: the io_callback allocating it device_puts the
initial value to the CPU device, which waits behind device threads blocked in the interpreter
(skipping that device_put in jax._src.callback.io_callback_impl removes the hang). Every
buffer of the interpret run stays below 100 KiB.
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
# Another copy of comm.py.jinja to check (e.g. a deliberately broken one: the checks must fail).
COMM = Path(os.environ.get("MKDSL_COMM_RUNTIME", RUNTIME / "comm.py.jinja"))
AXES = ("ep", "tp")
ROWS = 16  # padded rows of every value
# Rows on the wire (runtime exchange_rows) -> iterations of the test kernel: a kernel built for
# batches 2-8 sends 8 rows (rows 8-15 never travel), one built for batch 1 sends 1 row (rows
# 1-15 never travel). The 1-row case runs 2 iterations (the parity of bit 0 still alternates).
ITERS = {8: 3, 1: 2}
WIRE_ROWS = 8  # the default case
W = 256  # all-reduce width
WD = 128  # narrow all-reduces (bf16 RS+AG over all: one non-empty chunk; one-shot over all)
GW = 128  # all-gather slice width
VW = 256  # vocabulary columns per device (argmax)
BIG = 2**30


# ---------------------------------------------------------------------------- the kernel


def load_runtime(comm_path: Path = COMM) -> dict:
    """core.py.jinja then the collectives, exec'd as a generated module would hold them."""
    import dataclasses
    import math

    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    ns = dict(jax=jax, jnp=jnp, np=np, pl=pl, pltpu=pltpu, math=math, dataclasses=dataclasses)
    for path in (RUNTIME / "core.py.jinja", Path(comm_path)):
        exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), ns)
    return ns


def shapes(sizes, wire_rows=WIRE_ROWS):
    """name -> per-device shape (leading iterations) of the kernel's inputs and outputs."""
    iters = ITERS[wire_rows]
    ep, tp = sizes
    ins = {"a": W, "b": W, "c": W, "d": WD, "g": GW, "h": GW, "v": VW, "t": W, "u": W, "o": WD, "w": W, "f": W, "e": WD}
    outs = {
        "A": (W, "f4"),  # RS+AG over all, f32 wire
        "B": (W, "f4"),  # RS+AG over tp, f32
        "C": (W, "f4"),  # RS+AG over ep, bf16
        "D": (WD, "f4"),  # RS+AG over all, bf16
        "GT": (GW * tp, "f4"),
        "GE_lo": (GW * ep // 2, "f4"),  # the ep gather, split in halves (each buffer < 100 KiB)
        "GE_hi": (GW * ep // 2, "f4"),
        "MV": (128, "f4"),  # argmax over all axes: value, index (lane-broadcast)
        "MI": (128, "i4"),
        "EV": (128, "f4"),  # argmax over ep
        "EI": (128, "i4"),
        "T": (W, "f4"),  # chip-hierarchical over all, f32 wire, inner RS+AG
        "U": (W, "f4"),  # chip-hierarchical over all, bf16 wire, inner one-shot
        "O": (WD, "f4"),  # one-shot over all, f32
        "X": (W, "f4"),  # one-shot over all, bf16
        "F": (W, "f4"),  # F and E: RS+AG over ep, bf16, fused into the same two exchanges
        "E": (WD, "f4"),
    }
    return ({k: (iters, ROWS, n) for k, n in ins.items()}, {k: ((iters, ROWS, n), t) for k, (n, t) in outs.items()})


def body_of(ns, r, comm, local_argmax, x):
    """One iteration: 23 exchanges, 7 over all, 7 over tp and 9 over ep (odd, so each mask's
    parity differs from one iteration to the next), all through the same scratch; x: wire rows."""
    import jax.numpy as jnp

    F32, BF16 = jnp.float32, jnp.bfloat16
    every, m_tp, m_ep = comm.mask(), comm.mask("tp"), comm.mask("ep")
    ep_index = comm.group_index(m_ep)

    def body(it, carry):
        for name, src, mask, wire, method in (
            ("A", "a", every, F32, "all_reduce"),
            ("B", "b", m_tp, F32, "all_reduce"),
            ("C", "c", m_ep, BF16, "all_reduce"),
            ("D", "d", every, BF16, "all_reduce"),
            ("O", "o", every, F32, "all_reduce_oneshot"),
            ("X", "w", every, BF16, "all_reduce_oneshot"),
        ):
            getattr(r, name)[it] = getattr(r, src)[it]
            getattr(comm, method)(getattr(r, name).at[it], mask, wire=wire)
        r.F[it] = r.f[it]
        r.E[it] = r.e[it]
        comm.all_reduce(r.F.at[it], m_ep, wire=BF16, fused=(r.E.at[it],))
        comm.all_gather(r.g.at[it], r.GT.at[it], m_tp)
        value, col = local_argmax(r.v[it, 0:x])
        value, index = comm.argmax(value, comm.idx * VW + col, every)
        r.MV[it] = jnp.broadcast_to(jnp.pad(value, ((0, ROWS - x), (0, 0))), (ROWS, 128))
        r.MI[it] = jnp.broadcast_to(jnp.pad(index, ((0, ROWS - x), (0, 0))), (ROWS, 128))
        comm.all_gather(r.h.at[it], r.ge, m_ep)
        half = GW * comm.sizes[0] // 2
        r.GE_lo[it] = r.ge[:, 0:half]
        r.GE_hi[it] = r.ge[:, half : 2 * half]
        value, col = local_argmax(r.v[it, 0:x])
        value, index = comm.argmax(value, ep_index * VW + col, m_ep)
        r.EV[it] = jnp.broadcast_to(jnp.pad(value, ((0, ROWS - x), (0, 0))), (ROWS, 128))
        r.EI[it] = jnp.broadcast_to(jnp.pad(index, ((0, ROWS - x), (0, 0))), (ROWS, 128))
        r.T[it] = r.t[it]
        comm.all_reduce_hier(r.T.at[it], every)
        r.U[it] = r.u[it]
        comm.all_reduce_hier(r.U.at[it], every, wire=BF16, inner="all_reduce_oneshot")
        return carry

    return body


def build(ns: dict, mesh, sizes, interpret=None, wire_rows=WIRE_ROWS):
    """(the shard_map'd kernel: f(*inputs stacked over devices on axis 0) -> outputs, same way;
    its scratch: name -> (kind, shape, dtype))."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from jax.sharding import PartitionSpec as P

    ep, tp = sizes
    ins, outs = shapes(sizes, wire_rows)
    every = ns["axis_mask"](AXES, sizes, AXES)
    masks = [ns["axis_mask"](AXES, sizes, names) for names in (("tp",), ("ep",))] + [every, 1, every ^ 1]
    slots = dict.fromkeys(masks, 128)  # the hierarchical all-reduce exchanges over bit 0, then the rest
    slots[ns["axis_mask"](AXES, sizes, ("ep",))] = 256  # the fused pair: two 128-lane chunks per message
    # Other messages fit 128 int32 lanes; the widest staging is an RS over all devices of one
    # 128-lane chunk each, or the fused RS over ep of 256 lanes each.
    spec = ns["comm_scratch"](wire_rows, slots, max(128 * ep * tp, 256 * ep), half_width=W)
    scratch = {**spec, "ge": ("VMEM", (ROWS, GW * ep), jnp.float32)}
    names = [*ins, *outs, *scratch]
    I32 = jnp.int32

    def kernel(*refs):
        r = ns["Refs"](names, refs)
        comm = ns["Comm"](r, axes=AXES, sizes=sizes)
        # Stand-in for the previous step's use of the receive slots: local writes (NaN bits, so a
        # read before a peer's write still shows) that the peers' first writes race with unless
        # the entry barrier orders them.
        for mask in slots:
            buf = getattr(r, f"comm_recv_{mask}")
            buf[...] = jnp.full(buf.shape, 0x7FC00000, I32)
        comm.enter()

        def local_argmax(v):
            m = jnp.max(v, axis=1, keepdims=True)
            col = jax.lax.broadcasted_iota(I32, v.shape, 1)
            return m, jnp.min(jnp.where(v == m, col, BIG), axis=1, keepdims=True)

        assert comm.rows == wire_rows  # what the messages carry: the stage's rows
        jax.lax.fori_loop(0, ITERS[wire_rows], body_of(ns, r, comm, local_argmax, wire_rows), 0)

    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    call = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(s, jnp.dtype(t)) for s, t in outs.values()],
        in_specs=[vmem] * len(ins),
        out_specs=[vmem] * len(outs),
        scratch_shapes=ns["comm_scratch_shapes"](scratch),
        compiler_params=pltpu.CompilerParams(collective_id=0),
        interpret=interpret if interpret is not None else False,
    )
    spec = P(AXES)
    fn = jax.shard_map(
        lambda *xs: tuple(call(*xs)),
        mesh=mesh,
        in_specs=(spec,) * len(ins),
        out_specs=(spec,) * len(outs),
        check_vma=False,
    )
    return jax.jit(fn), scratch


def tie_rows(wire_rows: int) -> int:
    return max(1, wire_rows // 2)


def draw_inputs(seed: int, devices: int, sizes, wire_rows=WIRE_ROWS) -> dict:
    """Fresh normal draws (never zero) per device and iteration; the first half of the argmax
    rows on the wire (at least one) from 4 integers."""
    rng = np.random.default_rng(seed)
    ins, _ = shapes(sizes, wire_rows)
    data = {k: rng.standard_normal((devices, *s)).astype(np.float32) for k, s in ins.items()}
    ties = (devices, ITERS[wire_rows], tie_rows(wire_rows), VW)
    data["v"][:, :, : ties[2]] = rng.integers(1, 5, ties).astype(np.float32)
    return data


# ---------------------------------------------------------------------------- the subprocess


def run_interpret(out_path: str, comm_path: str, seed: int, wire_rows: int) -> None:
    """Run the kernel on 8 host devices in TPU interpret mode; save inputs, outputs, race flag
    and the rows of every comm VMEM buffer."""
    import jax
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from mkdsl.verify.kernel import interpret_params

    sizes = (4, 2)
    mesh = jax.make_mesh(sizes, AXES)
    params = interpret_params()  # race detector, NaN-filled fresh memory, OOB reads raising
    ns = load_runtime(Path(comm_path))
    fn, scratch = build(ns, mesh, sizes, interpret=params, wire_rows=wire_rows)
    data = draw_inputs(seed, 8, sizes, wire_rows)
    args = [jax.device_put(x.reshape(-1, *x.shape[2:]), NamedSharding(mesh, P(AXES))) for x in data.values()]
    outs = jax.block_until_ready(fn(*args))
    _, names = shapes(sizes, wire_rows)
    iters = ITERS[wire_rows]
    result = {f"in_{k}": v for k, v in data.items()}
    result.update({f"out_{k}": np.asarray(v).reshape(8, iters, *v.shape[1:]) for k, v in zip(names, outs, strict=True)})
    comm = [shape for name, (kind, shape, _) in scratch.items() if kind == "VMEM" and name.startswith("comm_")]
    result["buffer_rows"] = np.array([shape[-2] for shape in comm])  # recv_<M> [2, rows, .], stage, half
    result["races"] = np.array(ipc.races is not None and ipc.races.races_found)
    np.savez(out_path, **result)


# ---------------------------------------------------------------------------- references


def bf16(x: np.ndarray) -> np.ndarray:
    import jax.numpy as jnp

    return np.asarray(x.astype(jnp.bfloat16).astype(np.float32))


def chunk_width(n: int, group: int, wire16: bool) -> int:
    unit = 256 if wire16 else 128
    per = -(-n // group)
    return -(-per // unit) * unit


def ordered_sum(parts: list[np.ndarray]) -> np.ndarray:
    """f32 sum left to right, one rounding per add, as the kernel adds."""
    total = parts[0].astype(np.float32)
    for p in parts[1:]:
        total = (total + p).astype(np.float32)
    return total


def padded(x: np.ndarray, width: int) -> np.ndarray:
    return np.concatenate([x, np.zeros((*x.shape[:-1], width - x.shape[-1]), np.float32)], -1)


def rs_ag_sum(x: np.ndarray, mask: int, wire16: bool) -> np.ndarray:
    """The kernel's reduce-scatter + all-gather, per device (axis 0): member c of each group sums
    chunk c of the members' (wire-rounded) partials in group-index order, rounds the sum to the
    wire, and every member takes every chunk."""
    rnd = bf16 if wire16 else (lambda v: v.astype(np.float32))
    n = x.shape[-1]
    out = np.empty_like(x, dtype=np.float32)
    for d in range(x.shape[0]):
        group = group_members(d, mask, x.shape[0])
        cw = chunk_width(n, len(group), wire16)
        full = [padded(rnd(x[e]), cw * len(group)) for e in group]
        sums = [rnd(ordered_sum([p[..., c * cw : (c + 1) * cw] for p in full])) for c in range(len(group))]
        out[d] = np.concatenate(sums, -1)[..., :n]
    return out


def oneshot_sum(x: np.ndarray, mask: int, wire16: bool) -> np.ndarray:
    """The one-shot all-reduce: the members' wire-rounded partials added in group-index order."""
    rnd = bf16 if wire16 else (lambda v: v.astype(np.float32))
    return np.stack([ordered_sum([rnd(x[e]) for e in group_members(d, mask, x.shape[0])]) for d in range(x.shape[0])])


def hier_sum(inner):
    def emulate(x: np.ndarray, mask: int, wire16: bool) -> np.ndarray:
        """Chip first: the lowest bit's pair reduce-scatters halves (RS over 2), `inner` over the
        other bits on the kept half, then the pair gathers the halves (rounded to the wire)."""
        low = mask & -mask
        n = x.shape[-1]
        cw = chunk_width(n, 2, wire16)
        rnd = bf16 if wire16 else (lambda v: v.astype(np.float32))
        half = np.empty((*x.shape[:-1], cw), np.float32)
        for d in range(x.shape[0]):
            pair = group_members(d, low, x.shape[0])
            c = pair.index(d)
            half[d] = rnd(ordered_sum([padded(rnd(x[e]), 2 * cw)[..., c * cw : (c + 1) * cw] for e in pair]))
        half = inner(half, mask ^ low, wire16)
        out = np.empty_like(x, dtype=np.float32)
        for d in range(x.shape[0]):
            out[d] = np.concatenate([rnd(half[e]) for e in group_members(d, low, x.shape[0])], -1)[..., :n]
        return out

    return emulate


def group_members(d: int, mask: int, devices: int = 8) -> list[int]:
    """The devices of d's group in group-index order."""
    members = [e for e in range(devices) if (e & ~mask) == (d & ~mask)]
    return sorted(members, key=lambda e: [(e >> k) & 1 for k in reversed(range(mask.bit_length())) if mask >> k & 1])


def check_all_reduce(got, x, mask, wire16, what, emulate, rows):
    """got, x: [devices, iterations, ROWS, n]; the first rows rows are reduced, the others keep
    the device's own partial."""
    assert np.array_equal(got[:, :, rows:], x[:, :, rows:]), f"{what}: rows past the wire rows changed"
    got, x = got[:, :, :rows], x[:, :, :rows]
    for d in range(8):
        group = group_members(d, mask)
        exact = x[group].astype(np.float64).sum(0)
        scale = np.abs(x[group]).astype(np.float64).sum(0)
        # f32 wire: at most 8 adds reach any term, each rounding once (2^-24 of the |x| summed so
        # far): <= 8·2^-24·scale = 2^-21·scale, and 2^-20 is 2x that. bf16 wire: a term meets at
        # most 3 roundings to bf16 (its partial, a hierarchical pair's sum, the final sum; each
        # 2^-8 relative of at most scale), so <= 3·2^-8·scale (+ the f32 adds); 2^-6 is 1.3x that
        # (the bit-exact emulation below is the strict check).
        tol = (2.0**-6 if wire16 else 2.0**-20) * scale
        err = np.abs(got[d] - exact)
        assert (err <= tol).all(), f"{what}: device {d} off by {err.max()} (tolerance {tol[err > tol].min()})"
        for e in group:
            assert np.array_equal(got[d], got[e]), f"{what}: devices {d} and {e} of one group differ"
    emulated = emulate(x, mask, wire16)
    assert np.array_equal(got, emulated), f"{what}: not bit-identical to the emulated exchanges"


def check_all_gather(got, x, mask, what, rows):
    assert (got[:, :, rows:] == 0).all(), f"{what}: rows past the wire rows not zeroed"
    for d in range(8):
        want = np.concatenate([x[e] for e in group_members(d, mask)], axis=-1)[:, :rows]
        assert np.array_equal(got[d, :, :rows], want), f"{what}: device {d}"


def check_argmax(value, index, v, mask, what, rows):
    value, index, v = value[:, :, :rows], index[:, :, :rows], v[:, :, :rows]
    for d in range(8):
        row = np.concatenate([v[e] for e in group_members(d, mask)], axis=-1)  # [iterations, rows, G * VW]
        want_i = np.argmax(row, axis=-1)
        want_v = np.max(row, axis=-1)
        assert (index[d] == want_i[..., None]).all(), f"{what}: device {d} index"
        assert (value[d] == want_v[..., None]).all(), f"{what}: device {d} value"


# ---------------------------------------------------------------------------- tests


def test_runtime_is_plain_python():
    """Included verbatim by the module template: rendering leaves it unchanged."""
    import jinja2

    text = COMM.read_text(encoding="utf-8")
    assert jinja2.Environment(keep_trailing_newline=True).from_string(text).render() == text
    ns = load_runtime()
    assert ns["axis_mask"](("ep", "tp"), (8, 4), ("tp",)) == 0b00011
    assert ns["axis_mask"](("ep", "tp"), (8, 4), ("ep",)) == 0b11100
    spec = ns["comm_scratch"](8, {0b11111: 128, 0b00011: 896}, 4096)
    assert spec["comm_recv_31"][1] == (2, 8, 32 * 128) and spec["comm_rsem_31"][1] == (64,)
    assert spec["comm_recv_3"][1] == (2, 8, 4 * 896) and spec["comm_ssem_3"][1] == (4,)
    assert [ns["exchange_rows"](b) for b in (1, 2, 7, 8, 9, 16)] == [1, 8, 8, 8, 16, 16]
    spec = ns["comm_scratch"](ns["exchange_rows"](1), {0b11111: 128}, 4096, half_width=256)
    assert [spec[f"comm_{k}"][1] for k in ("recv_31", "stage", "half")] == [(2, 1, 4096), (1, 4096), (1, 256)]
    assert [ns["expand"](0b11100, j) for j in (1, 2, 5)] == [0b00100, 0b01000, 0b10100]
    assert ns["chunk_width"](7168, 32, ns["BF16"]) == 256 and ns["chunk_width"](3584, 32, ns["F32"]) == 128
    import jax.numpy as jnp

    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 512)), jnp.float32)
    m = ns["pack"](x, ns["BF16"])
    assert m.shape == (8, 256) and m.dtype == jnp.int32
    assert np.array_equal(np.asarray(ns["unpack"](m, ns["BF16"])), bf16(np.asarray(x)))  # exact bf16 values
    assert np.array_equal(np.asarray(ns["unpack"](ns["pack"](x, ns["F32"]), ns["F32"])), np.asarray(x))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("wire_rows", sorted(ITERS, reverse=True))
def test_collectives_interpret_8_devices(tmp_path, wire_rows):
    """Batches 2-8 (8 rows on the wire) and batch 1 (1 row: every comm buffer has 1 row, the
    other 15 rows of every value never travel, row 0 equals the reference)."""
    fresh = os.environ.get("MKDSL_HYPOTHESIS_PROFILE") == "dev"
    seed = int(os.environ.get("MKDSL_COMM_SEED", np.random.SeedSequence().entropy % 2**31 if fresh else 0))
    out = tmp_path / "run.npz"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(8)}
    run = subprocess.run(
        [sys.executable, __file__, str(out), str(COMM), str(seed), str(wire_rows)],
        capture_output=True,
        text=True,
        env=env,
        timeout=150,
    )
    log = run.stdout + run.stderr
    assert run.returncode == 0, f"seed {seed}:\n{log[-4000:]}"
    assert "non-zero count" not in log, log[-4000:]  # a semaphore left signalled at kernel exit
    r = dict(np.load(out))
    assert (r["buffer_rows"] == wire_rows).all() and len(r["buffer_rows"]) == 5, r[
        "buffer_rows"
    ]  # recv over bit 0, ep, all; stage; half
    assert not r["races"], f"seed {seed}: race detected\n{log[-4000:]}"
    for k, v in r.items():
        if k.startswith("out_"):
            assert np.isfinite(v).all(), f"{k}: NaN (uninitialised memory read)"
    every, tp, ep = 0b111, 0b001, 0b110
    for out, x, mask, wire16, what, emulate in (
        ("A", "a", every, False, "f32 RS+AG over all", rs_ag_sum),
        ("B", "b", tp, False, "f32 RS+AG over tp", rs_ag_sum),
        ("C", "c", ep, True, "bf16 RS+AG over ep", rs_ag_sum),
        ("D", "d", every, True, "bf16 RS+AG over all (one non-empty chunk)", rs_ag_sum),
        ("O", "o", every, False, "f32 one-shot over all", oneshot_sum),
        ("X", "w", every, True, "bf16 one-shot over all", oneshot_sum),
        ("F", "f", ep, True, "bf16 RS+AG over ep, fused with E", rs_ag_sum),
        ("E", "e", ep, True, "bf16 RS+AG over ep, fused with F", rs_ag_sum),
        ("T", "t", every, False, "f32 chip-hierarchical over all", hier_sum(rs_ag_sum)),
        ("U", "u", every, True, "bf16 chip-hierarchical over all, one-shot inside", hier_sum(oneshot_sum)),
    ):
        check_all_reduce(r[f"out_{out}"], r[f"in_{x}"], mask, wire16, f"{what} (seed {seed})", emulate, wire_rows)
    check_all_gather(r["out_GT"], r["in_g"], tp, "all_gather over tp", wire_rows)
    gathered = np.concatenate([r["out_GE_lo"], r["out_GE_hi"]], -1)
    check_all_gather(gathered, r["in_h"], ep, "all_gather over ep", wire_rows)
    check_argmax(r["out_MV"], r["out_MI"], r["in_v"], every, f"argmax over all (seed {seed})", wire_rows)
    check_argmax(r["out_EV"], r["out_EI"], r["in_v"], ep, f"argmax over ep (seed {seed})", wire_rows)
    row = np.concatenate(list(r["in_v"][:, :, :wire_rows]), -1)  # [iterations, rows, 8 * VW]: the whole vocabulary
    ties = (row == row.max(-1, keepdims=True)).sum(-1) > 1
    assert ties.sum() >= ITERS[wire_rows] * tie_rows(wire_rows), "too few ties to test the tie-breaking"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wire_rows", sorted(ITERS, reverse=True))
@pytest.mark.parametrize("topology, sizes", [("tpu7x:2x2x1", (4, 2)), ("tpu7x:4x4x1", (8, 4))])
def test_collectives_compile_tpu7x(topology, sizes, wire_rows):
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)  # needs libtpu: never skipped
    mesh = jax.sharding.Mesh(np.array(topo.devices).reshape(sizes), AXES)
    fn, _ = build(load_runtime(), mesh, sizes, wire_rows=wire_rows)
    devices = sizes[0] * sizes[1]
    ins, _ = shapes(sizes, wire_rows)
    avals = [
        jax.ShapeDtypeStruct((devices * s[0], *s[1:]), jnp.float32, sharding=NamedSharding(mesh, P(AXES)))
        for s in ins.values()
    ]
    compiled = fn.lower(*avals).compile()
    assert "tpu_custom_call" in compiled.as_text()


def test_the_plan_runs_the_cheapest_modeled_algorithm_and_says_its_phases():
    """Kimi K3 (32 cores): every all-reduce is the cheapest of the runtime's options for the
    messages of the kernel's batch (8 rows at batch 8, 1 row at batch 1: the kernel built for
    batch 1 runs those picked for 1 row, Plan.one_row), all-gathers and the argmax are one direct
    phase to every peer, and the receive buffers are as wide as the widest message over each
    mask (per kernel batch: an expression in the kernel's wire_rows)."""
    from mkdsl import load
    from mkdsl.plan import collectives as co
    from mkdsl.plan.planner import make_plan

    spec = load(ROOT / "specs" / "kimi_k3.mk")
    plan = make_plan(spec.local, batch=8, context=1152)
    one = make_plan(spec.local, batch=1, context=1152, ring_depth=plan.ring_depth)
    for p, rows in ((plan, 8), (one, 1)):
        assert p.collectives and p.exchange_phases == co.step_totals(spec.local, list(p.collectives))[0]
        for c in (m for shared in p.collectives for m in shared.apart()):  # ready-together ones as they run alone
            assert all(ph.rows == rows for ph in c.phases), c
            if c.exchange == "sum" and not c.fused:
                options = co.all_reduce_options(co.mask_of(spec.local.mesh, c.axes), c.width, rows, "bf16")
                assert c.time_us() == pytest.approx(min(sum(ph.time_us() for ph in o[2]) for o in options)), c
                assert c.wire == "bf16" and len(c.phases) <= 4
            elif c.exchange in ("scatter", "scaled"):  # a deferred norm's: one algorithm each, direct phases
                mask, inputs = co.mask_of(spec.local.mesh, c.axes), 3 if c.exchange == "scaled" else 1
                assert c.phases == co.scatter_phases(c.exchange, mask, c.width, rows, "bf16", inputs), c
                assert all(ph.peers == co.group_size(mask) - 1 for ph in c.phases)
            else:
                (phase,) = c.phases
                assert phase.peers == co.group_size(co.mask_of(spec.local.mesh, c.axes)) - 1
    assert [c.algorithm for c in one.collectives] == [c.algorithm for c in plan.one_row]
    assert [c.algorithm for c in one.collectives] != [c.algorithm for c in plan.collectives]  # 1 row: other picks
    comm = {a.name: a.shape for a in one.vmem if a.name.startswith("comm_") and a.memory == "VMEM"}
    assert comm and all("wire_rows" in shape for shape in comm.values()), comm  # sized by the kernel's batch
    # Over all 32 cores the widest message is the scaled all-reduce's first (the two partials' chunks
    # of 224 bf16 columns, 224 lanes, then the squares: 256 lanes) in both kernels; chip first (bits 0,
    # then 1-4) only at 1 row, where the other kernel keeps one 128-lane slot per member.
    assert comm["comm_recv_31"][2] == 32 * 256
    assert comm["comm_recv_1"][2] == "3584 if wire_rows == 1 else 256"
    assert plan.comm_masks == ((0b1, 0b11, 0b11100, 0b11110, 0b11111), (0b11, 0b11100, 0b11111))
    # The emitted kernel switches where the picks differ (once per layer kind and call site).
    text = (ROOT / "generated" / "kimi_k3" / "kernel.py").read_text(encoding="utf-8")
    switched = {
        (o.graph, o.value) for o, c in zip(plan.one_row, plan.collectives, strict=True) if o.algorithm != c.algorithm
    }
    assert switched and text.count("if comm.rows == 1:") >= len(switched)
    assert 'comm.all_reduce_hier(r.v10_7168, 31, wire=BF16, inner="all_reduce_oneshot")' in text
    slots, stage, half = co.comm_buffers(list(plan.collectives))
    assert slots[0b11111] == 256 and stage == 32 * 256  # the scaled all-reduce's RS over 32: 256 lanes each
    assert co.direct_latency_us(7) == pytest.approx(2.65) and co.direct_latency_us(1) == pytest.approx(2.1)
    # The measured check of the direct fit: an all-reduce of [8, 8192] bf16 over 8 cores as RS + AG
    # took 7.28 us; the model's two phases of 7 x [8, 512 bf16] = 57 KB each give 7.44 us.
    assert sum(p.time_us() for p in co.reduce_phases("rs_ag", 0b111, 8192, 8, "bf16")) == pytest.approx(7.28, rel=0.05)


FUSED_SPEC = """\
model fused_pair

const L = 2
const H = 256
const V = 256

dim B in 1 .. 8

mesh { tp = 2 }

weight embed:   bf16[V, H]
weight norm1:   bf16[H]          per layer
weight wa:      bf16[H @tp, H]   per layer
weight wb:      bf16[H @tp, H]   per layer
weight norm_f:  bf16[H]
weight lm_head: bf16[H, V]

layer dense(x) {
  h = rmsnorm(x, norm1)
  return x + linear(h, wa) * linear(h, wb)
}

layers L { dense: otherwise }

step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  logits = linear(rmsnorm(x, norm_f), lm_head)
  return logits, argmax(logits)
}
"""


@pytest.mark.timeout(300)
def test_adjacent_all_reduces_run_fused_and_match_the_reference(tmp_path):
    """Two row-split projections multiplied: the shard pass puts their all-reduces side by side,
    the planner fuses them into one exchange (one-shot: cheaper than two over a chip's two cores),
    and the kernel, on 2 devices in TPU interpret mode with the race detector, matches the
    reference layer by layer (mkdsl/verify/kernel.py's bounds)."""
    from mkdsl.compiler import compile_source
    from mkdsl.verify import kernel as verify

    out, _ = compile_source(FUSED_SPEC, "fused_pair.mk", None)
    dense = [c for c in out.plan.collectives if c.graph == "dense"]
    assert len(dense) == 1 and dense[0].fused and len(dense[0].phases) == 1, dense
    source = out.files["kernel.py"]
    assert source.count(", fused=(r.") == 1 and "all-reduced with the next node's value" in source
    module = verify.import_generated(source, tmp_path, "fused_pair")
    result = verify.check_batch(out.model, module, verify.LayerChecker(out.model), batch=3, steps=1, seed=4)
    assert not result.failures, result.failures


if __name__ == "__main__":  # the interpret run's subprocess: python test_comm.py OUT.npz COMM_PATH SEED ROWS
    os.environ["XLA_FLAGS"] = xla_flags(8)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    run_interpret(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
