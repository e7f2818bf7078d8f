"""Microbenchmarks of `mkdsl calibrate` across cores, run by the kernel's own collectives (`Comm`
of the rendered runtime, calibrate/runtime.py; runtime/comm.py.jinja): all-gathers over the chip's
other core (mask 1), over a core of another chip (mask 2) and directly over 2..N cores (the low
bits), the chip-hierarchical all-reduce over every core, and the per-step entry barrier
(`Comm.enter`) at 1 and N steps per device call. One kernel per device under `jax.shard_map`
over a one-axis mesh, as a generated sharded kernel runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mkdsl.backends.tpu.calibrate import runtime

AXIS = "d"


def _group(idx: int, mask: int, rt) -> list[int]:
    """The devices of idx's group over `mask`, by group index."""
    return [(idx & ~mask) | rt.expand(mask, c) for c in range(1 << len(rt.mask_bits(mask)))]


def _comm_call(scratch: dict, kernel, out_shape, rt, interpret):
    """The kernel over one device's block: refs by name (inputs x, output o, then the scratch)."""
    names = ("x", "o", *scratch)
    return pl.pallas_call(
        lambda *refs: kernel(rt.Refs(names, refs)),
        out_shape=out_shape,
        in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=rt.comm_scratch_shapes(scratch),
        compiler_params=pltpu.CompilerParams(collective_id=0),
        interpret=interpret,
    )


def exchange(devices: int, form: str, mask: int, x: np.ndarray, reps: int, interpret=None):
    """`reps` collectives over `mask` of the kernel's `Comm`: form "gather" (`all_gather`, one
    direct phase: each core sends its block to every peer of the group) or "hier"
    (`all_reduce_hier` over every core). x [devices, rows, lanes] f32, one block per device.
    Result per device: the gathered blocks by group index, or the group's sum."""
    rt = runtime.module(2)
    rows, n = x.shape[1:]
    group = 1 << len(rt.mask_bits(mask))
    if form == "gather":
        scratch = rt.comm_scratch(rows, {mask: n}, n)
        width = n * group
    else:
        cw = rt.chunk_width(n, 2, rt.F32)
        inner = group // 2
        stage = max(2 * cw, inner * rt.chunk_width(cw, inner, rt.F32))
        scratch = rt.comm_scratch(rows, {1: n, mask ^ 1: n}, stage, half_width=cw)
        width = n

    def kernel(r):
        comm = rt.Comm(r, axes=(AXIS,), sizes=(devices,))
        comm.enter()
        if form == "gather":
            jax.lax.fori_loop(0, reps, lambda _, c: (comm.all_gather(r.x, r.o, mask), c)[1], 0)
        else:

            def once(_, c):
                r.o[...] = r.x[...]
                comm.all_reduce_hier(r.o, mask)
                return c

            jax.lax.fori_loop(0, reps, once, 0)

    call = _comm_call(scratch, kernel, jax.ShapeDtypeStruct((rows, width), jnp.float32), rt, interpret)
    fn = _sharded(lambda xs: call(xs[0])[None], devices)
    if form == "gather":
        expected = np.stack([np.concatenate([x[j] for j in _group(i, mask, rt)], axis=1) for i in range(devices)])
    else:
        expected = np.stack([x[_group(i, mask, rt)].sum(0) for i in range(devices)])
    return fn, (jnp.asarray(x),), expected


def barrier_steps(devices: int, steps: int, interpret=None):
    """`steps` decode steps in one device call, each a kernel whose only work is the kernel's entry
    barrier (`Comm.enter` over every core: what each step of mkdsl's kernel pays before its first
    exchange). Result: each device's count of steps."""
    rt = runtime.module(2)
    scratch = rt.comm_scratch(8, {devices - 1: 128}, 128)

    def kernel(r):
        rt.Comm(r, axes=(AXIS,), sizes=(devices,)).enter()
        r.o[...] = r.x[...] + 1

    call = _comm_call(scratch, kernel, jax.ShapeDtypeStruct((8, 128), jnp.int32), rt, interpret)

    def per_device(c):
        return jax.lax.fori_loop(0, steps, lambda _, v: call(v[0])[None], c)

    fn = _sharded(per_device, devices)
    return fn, (jnp.zeros((devices, 8, 128), jnp.int32),), np.full((devices, 8, 128), steps, np.int32)


def _sharded(per_device, devices: int):
    auto = (jax.sharding.AxisType.Auto,)  # arrays are resharded to the split shard_map expects
    mesh = jax.make_mesh((devices,), (AXIS,), axis_types=auto, devices=jax.devices()[:devices])
    spec = jax.sharding.PartitionSpec(AXIS)
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
