"""The in-kernel collectives (runtime/comm.py.jinja) inside one Pallas TPU kernel.

The runtime text is exec'd after core.py.jinja into a namespace holding the imports of a
generated module. The test kernel runs, in a `fori_loop` of ITERS iterations on fresh data,
f32 all-reduces over all axes and over tp, bf16-wire all-reduces over ep and over all axes,
all-gathers over tp and over ep and the argmax combine over all axes and over ep: 17 exchange
phases per iteration, bit 0 used 5 times (odd, so its slot parity differs from one iteration to
the next), all through the same scratch.

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
order, gathered block put at the wrong offset (values/NaN); a doubled receive wait (timeout).

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

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "mkdsl" / "backends" / "tpu" / "templates" / "runtime"
# Another copy of comm.py.jinja to check (e.g. a deliberately broken one: the checks must fail).
COMM = Path(os.environ.get("MKDSL_COMM_RUNTIME", RUNTIME / "comm.py.jinja"))
AXES = ("ep", "tp")
ITERS = 5
ROWS = 16
W = 256  # all-reduce width (f32 wire, bf16 wire over ep)
WD = 128  # bf16-wire all-reduce over all axes
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


def shapes(sizes):
    """name -> per-device shape (leading ITERS) of the kernel's inputs and outputs."""
    ep, tp = sizes
    ins = {"a": W, "b": W, "c": W, "d": WD, "g": GW, "h": GW, "v": VW, "t": W, "u": W, "w": W}
    outs = {
        "A": (W, "f4"),
        "B": (W, "f4"),
        "C": (W, "f4"),
        "D": (WD, "f4"),
        "GT": (GW * tp, "f4"),
        "GE_lo": (GW * ep // 2, "f4"),  # the ep gather, split in halves (each buffer < 100 KiB)
        "GE_hi": (GW * ep // 2, "f4"),
        "MV": (128, "f4"),  # argmax over all axes: value, index (lane-broadcast)
        "MI": (128, "i4"),
        "EV": (128, "f4"),  # argmax over ep
        "EI": (128, "i4"),
        "T": (W, "f4"),  # two-level all-reduce over all, f32 wire
        "U": (W, "f4"),  # two-level all-reduce over all, bf16 wire
        "X": (W, "f4"),  # all-reduce over all of the first 8 rows only
    }
    return ({k: (ITERS, ROWS, n) for k, n in ins.items()}, {k: ((ITERS, ROWS, n), t) for k, (n, t) in outs.items()})


def build(ns: dict, mesh, sizes, interpret=None):
    """The shard_map'd kernel: f(*inputs stacked over devices on axis 0) -> outputs, same way."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from jax.sharding import PartitionSpec as P

    ep, tp = sizes
    bits = int(np.log2(ep * tp))
    ins, outs = shapes(sizes)
    f32_width = max(W, GW * max(ep, tp) // 2)
    spec = ns["comm_scratch"](ROWS, bits, f32_width, max(W, WD))
    scratch = {**spec, "comm_half": ("VMEM", (ROWS, W // 2), jnp.float32), "ge": ("VMEM", (ROWS, GW * ep), jnp.float32)}
    names = [*ins, *outs, *scratch]
    F32, I32, BF16 = jnp.float32, jnp.int32, jnp.bfloat16

    def kernel(*refs):
        r = ns["Refs"](names, refs)
        comm = ns["Comm"](r, axes=AXES, sizes=sizes)
        every, m_tp, m_ep = comm.mask(), comm.mask("tp"), comm.mask("ep")
        # Stand-in for the previous step's use of the receive slots: local writes (NaN, so a
        # read before a peer's write still shows) that the peers' first writes race with
        # unless the entry barrier orders them.
        r.comm_recv[...] = jnp.full(r.comm_recv.shape, jnp.nan, F32)
        r.comm_recv_bf16[...] = jnp.full(r.comm_recv_bf16.shape, jnp.nan, BF16)
        comm.enter(every)
        ep_index = comm.group_index(m_ep)

        def local_argmax(v):
            m = jnp.max(v, axis=1, keepdims=True)
            col = jax.lax.broadcasted_iota(I32, v.shape, 1)
            return m, jnp.min(jnp.where(v == m, col, BIG), axis=1, keepdims=True)

        def body(it, carry):
            r.A[it] = r.a[it]
            comm.all_reduce(r.A.at[it], every)
            comm.all_gather(r.g.at[it], r.GT.at[it], m_tp)
            r.C[it] = r.c[it]
            comm.all_reduce(r.C.at[it], m_ep, wire=BF16)
            value, col = local_argmax(r.v[it])
            value, index = comm.argmax(value, comm.idx * VW + col, every)
            r.MV[it] = jnp.broadcast_to(value, (ROWS, 128))
            r.MI[it] = jnp.broadcast_to(index, (ROWS, 128))
            r.B[it] = r.b[it]
            comm.all_reduce(r.B.at[it], m_tp)
            comm.all_gather(r.h.at[it], r.ge, m_ep)
            half = GW * ep // 2
            r.GE_lo[it] = r.ge[:, 0:half]
            r.GE_hi[it] = r.ge[:, half : 2 * half]
            r.D[it] = r.d[it]
            comm.all_reduce(r.D.at[it], every, wire=BF16)
            value, col = local_argmax(r.v[it])
            value, index = comm.argmax(value, ep_index * VW + col, m_ep)
            r.EV[it] = jnp.broadcast_to(value, (ROWS, 128))
            r.EI[it] = jnp.broadcast_to(index, (ROWS, 128))
            r.T[it] = r.t[it]
            comm.all_reduce_two_level(r.T.at[it], every)
            r.U[it] = r.u[it]
            comm.all_reduce_two_level(r.U.at[it], every, wire=BF16)
            r.X[it] = r.w[it]
            comm.all_reduce(r.X.at[it], every, rows=8)
            return carry

        jax.lax.fori_loop(0, ITERS, body, 0)

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
    return jax.jit(fn)


def draw_inputs(seed: int, devices: int, sizes) -> dict:
    """Fresh normal draws (never zero) per device and iteration; argmax rows 0-7 from 4 integers."""
    rng = np.random.default_rng(seed)
    ins, _ = shapes(sizes)
    data = {k: rng.standard_normal((devices, *s)).astype(np.float32) for k, s in ins.items()}
    data["v"][:, :, : ROWS // 2] = rng.integers(1, 5, (devices, ITERS, ROWS // 2, VW)).astype(np.float32)
    return data


# ---------------------------------------------------------------------------- the subprocess


def run_interpret(out_path: str, comm_path: str, seed: int) -> None:
    """Run the kernel on 8 host devices in TPU interpret mode; save inputs, outputs, race flag."""
    import jax
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    from jax.experimental.pallas import tpu as pltpu
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sizes = (4, 2)
    mesh = jax.make_mesh(sizes, AXES)
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan", out_of_bounds_reads="raise")
    fn = build(load_runtime(Path(comm_path)), mesh, sizes, interpret=params)
    data = draw_inputs(seed, 8, sizes)
    args = [jax.device_put(x.reshape(-1, *x.shape[2:]), NamedSharding(mesh, P(AXES))) for x in data.values()]
    outs = jax.block_until_ready(fn(*args))
    _, names = shapes(sizes)
    result = {f"in_{k}": v for k, v in data.items()}
    result.update({f"out_{k}": np.asarray(v).reshape(8, ITERS, *v.shape[1:]) for k, v in zip(names, outs, strict=True)})
    result["races"] = np.array(ipc.races is not None and ipc.races.races_found)
    np.savez(out_path, **result)


# ---------------------------------------------------------------------------- references


def peers_sum(x: np.ndarray, mask: int, bf16: bool) -> np.ndarray:
    """Recursive doubling over the bits of `mask` as the kernel does it, per device (axis 0)."""
    import jax.numpy as jnp

    x = x.astype(np.float32)
    idx = np.arange(x.shape[0])
    for k in range(mask.bit_length()):
        if mask >> k & 1:
            if bf16:
                x = x.astype(jnp.bfloat16).astype(np.float32)
            x = x + x[idx ^ (1 << k)]
    return x


def two_level_sum(x: np.ndarray, mask: int, bf16: bool) -> np.ndarray:
    """The two-level all-reduce as the kernel does it: the lowest bit's pair swaps halves and adds
    (reduce-scatter), recursive doubling over the other bits on the kept half, then the pair
    swaps the finished halves (exact f32)."""
    import jax.numpy as jnp

    x = x.astype(np.float32)
    if bf16:
        x = x.astype(jnp.bfloat16).astype(np.float32)
    k0 = (mask & -mask).bit_length() - 1
    idx = np.arange(x.shape[0])
    h = x.shape[-1] // 2
    first = ((idx >> k0) & 1 == 0).reshape(-1, *([1] * (x.ndim - 1)))
    sibling = x[idx ^ (1 << k0)]
    half = np.where(first, x[..., :h], x[..., h:]) + np.where(first, sibling[..., :h], sibling[..., h:])
    half = peers_sum(half, mask & ~(1 << k0), bf16)
    other = half[idx ^ (1 << k0)]
    return np.where(first, np.concatenate([half, other], -1), np.concatenate([other, half], -1))


def group_members(d: int, mask: int, devices: int = 8) -> list[int]:
    """The devices of d's group in group-index order."""
    members = [e for e in range(devices) if (e & ~mask) == (d & ~mask)]
    return sorted(members, key=lambda e: [(e >> k) & 1 for k in reversed(range(mask.bit_length())) if mask >> k & 1])


def check_all_reduce(got, x, mask, bf16, what, emulate=None):
    phases = bin(mask).count("1")
    for d in range(8):
        group = group_members(d, mask)
        exact = x[group].astype(np.float64).sum(0)
        scale = np.abs(x[group]).astype(np.float64).sum(0)
        # f32 wire: each phase's add rounds once (2^-24 of the |x| summed so far): <= phases·2^-24·scale
        # <= 2^-22.4·scale, and 2^-20 is 5x that. bf16 wire: each phase also rounds both partials to
        # bf16 (2^-8 relative each, so 2^-8 of scale for the two), compounding to
        # <= phases·(2^-8 + 2^-16)·scale (two-level: its first rounding stands for the lowest bit's
        # phase); 2^-6 per phase is 4x that (the bit-exact emulation below is the strict check).
        # Observed: worst 0.13x (f32) and 0.18x (bf16) of these over seeds 0 and 123456789.
        tol = (phases * 2.0**-6 if bf16 else 2.0**-20) * scale
        err = np.abs(got[d] - exact)
        assert (err <= tol).all(), f"{what}: device {d} off by {err.max()} (tolerance {tol[err > tol].min()})"
        for e in group:
            assert np.array_equal(got[d], got[e]), f"{what}: devices {d} and {e} of one group differ"
    emulated = (emulate or peers_sum)(x, mask, bf16)
    assert np.array_equal(got, emulated), f"{what}: not bit-identical to the emulated exchanges"


def check_all_gather(got, x, mask, what):
    for d in range(8):
        want = np.concatenate([x[e] for e in group_members(d, mask)], axis=-1)
        assert np.array_equal(got[d], want), f"{what}: device {d}"


def check_argmax(value, index, v, mask, what):
    for d in range(8):
        row = np.concatenate([v[e] for e in group_members(d, mask)], axis=-1)  # [ITERS, ROWS, G * VW]
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
    spec = ns["comm_scratch"](16, 5, 7168, 7168)
    assert spec["comm_recv"][1] == (10, 16, 7168) and spec["comm_recv_sem"][1] == (10,)


@pytest.mark.timeout(200)
def test_collectives_interpret_8_devices(tmp_path):
    fresh = os.environ.get("MKDSL_HYPOTHESIS_PROFILE") == "dev"
    seed = int(os.environ.get("MKDSL_COMM_SEED", np.random.SeedSequence().entropy % 2**31 if fresh else 0))
    out = tmp_path / "run.npz"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    run = subprocess.run(
        [sys.executable, __file__, str(out), str(COMM), str(seed)],
        capture_output=True,
        text=True,
        env=env,
        timeout=150,
    )
    log = run.stdout + run.stderr
    assert run.returncode == 0, f"seed {seed}:\n{log[-4000:]}"
    assert "non-zero count" not in log, log[-4000:]  # a semaphore left signalled at kernel exit
    r = dict(np.load(out))
    assert not r["races"], f"seed {seed}: race detected\n{log[-4000:]}"
    for k, v in r.items():
        if k.startswith("out_"):
            assert np.isfinite(v).all(), f"{k}: NaN (uninitialised memory read)"
    every, tp, ep = 0b111, 0b001, 0b110
    check_all_reduce(r["out_A"], r["in_a"], every, False, f"f32 all_reduce over all (seed {seed})")
    check_all_reduce(r["out_B"], r["in_b"], tp, False, f"f32 all_reduce over tp (seed {seed})")
    check_all_reduce(r["out_C"], r["in_c"], ep, True, f"bf16 all_reduce over ep (seed {seed})")
    check_all_reduce(r["out_D"], r["in_d"], every, True, f"bf16 all_reduce over all (seed {seed})")
    check_all_gather(r["out_GT"], r["in_g"], tp, "all_gather over tp")
    check_all_gather(np.concatenate([r["out_GE_lo"], r["out_GE_hi"]], -1), r["in_h"], ep, "all_gather over ep")
    check_argmax(r["out_MV"], r["out_MI"], r["in_v"], every, f"argmax over all (seed {seed})")
    check_argmax(r["out_EV"], r["out_EI"], r["in_v"], ep, f"argmax over ep (seed {seed})")
    check_all_reduce(r["out_T"], r["in_t"], every, False, f"two-level f32 all_reduce (seed {seed})", two_level_sum)
    check_all_reduce(r["out_U"], r["in_u"], every, True, f"two-level bf16 all_reduce (seed {seed})", two_level_sum)
    check_all_reduce(r["out_X"][:, :, :8], r["in_w"][:, :, :8], every, False, f"8-row all_reduce (seed {seed})")
    assert np.array_equal(r["out_X"][:, :, 8:], r["in_w"][:, :, 8:]), "rows past the 8 reduced must be left alone"
    row = np.concatenate(list(r["in_v"]), -1)  # [ITERS, ROWS, 8 * VW]: the whole vocabulary
    ties = (row == row.max(-1, keepdims=True)).sum(-1) > 1
    assert ties.sum() >= ITERS * ROWS // 2, "too few ties to test the tie-breaking"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("topology, sizes", [("tpu7x:2x2x1", (4, 2)), ("tpu7x:4x4x1", (8, 4))])
def test_collectives_compile_tpu7x(topology, sizes):
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)  # needs libtpu: never skipped
    mesh = jax.sharding.Mesh(np.array(topo.devices).reshape(sizes), AXES)
    fn = build(load_runtime(), mesh, sizes)
    devices = sizes[0] * sizes[1]
    ins, _ = shapes(sizes)
    avals = [
        jax.ShapeDtypeStruct((devices * s[0], *s[1:]), jnp.float32, sharding=NamedSharding(mesh, P(AXES)))
        for s in ins.values()
    ]
    compiled = fn.lower(*avals).compile()
    assert "tpu_custom_call" in compiled.as_text()


if __name__ == "__main__":  # the interpret run's subprocess: python test_comm.py OUT.npz COMM_PATH SEED
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    run_interpret(sys.argv[1], sys.argv[2], int(sys.argv[3]))
