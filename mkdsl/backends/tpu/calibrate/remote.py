"""Microbenchmarks of `mkdsl calibrate` across cores: pairwise remote copies (the chip's other core,
a core of another chip), direct and hierarchical exchanges at several peer counts and sizes, and
the per-step entry barrier at 1 and N steps per device call. One kernel per device under
`jax.shard_map`, peers addressed as the collectives runtime addresses them (LOGICAL device ids,
the index XOR an offset; runtime/comm.py.jinja), an entry barrier on the barrier semaphore."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

AXIS = "d"


def _held(phases: list[list[int]]) -> list[list[int]]:
    """The blocks (XOR offsets) each device holds before each phase, and after the last."""
    out = [[0]]
    for offsets in phases:
        out.append(sorted({h ^ d for h in out[-1] for d in [0, *offsets]}))
    return out


def exchange(devices: int, phases: list[list[int]], x: np.ndarray, reps: int, interpret=None):
    """An all-gather by XOR offsets: in each phase every device sends each block it holds to every
    peer `idx ^ d` (d in the phase's offsets), one direct phase each; `[[1, 2, 3]]` is one direct
    phase over 4 cores, `[[1], [2, 4, 6]]` the hierarchical form over 8. `x` [devices, rows, lanes]:
    one block per device. Result per device: position p holds the block of device idx ^ p."""
    held = _held(phases)
    size = max(held[-1]) + 1
    rows, lanes = x.shape[1:]
    peers = sorted({d for offsets in phases for d in offsets})
    first = np.cumsum([0, *(len(o) * len(h) for o, h in zip(phases, held, strict=False))]).tolist()
    copies = first[-1]  # each phase its own semaphores: a fast peer's next phase must not satisfy this one's wait

    def kernel(x_ref, o_ref, buf, ssem, rsem):
        idx = jax.lax.axis_index(AXIS).astype(jnp.int32)
        barrier = pltpu.get_barrier_semaphore()
        for d in peers:
            pl.semaphore_signal(barrier, 1, device_id=idx ^ d, device_id_type=pl.DeviceIdType.LOGICAL)
        pl.semaphore_wait(barrier, len(peers))
        buf[0] = x_ref[...]

        def rep(_, carry):
            for n, (offsets, have) in enumerate(zip(phases, held, strict=False)):
                sent = []
                for k, (d, h) in enumerate(((d, h) for d in offsets for h in have), start=first[n]):
                    c = pltpu.make_async_remote_copy(
                        buf.at[h], buf.at[h ^ d], ssem.at[k], rsem.at[k],
                        device_id=idx ^ d, device_id_type=pl.DeviceIdType.LOGICAL,
                    )  # fmt: skip
                    c.start()
                    sent.append(c)
                for c in sent:
                    c.wait_send()
                    c.wait_recv()
            return carry

        jax.lax.fori_loop(0, reps, rep, 0)
        o_ref[...] = buf[...]

    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((size, rows, lanes), x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[
            pltpu.VMEM((size, rows, lanes), x.dtype),
            pltpu.SemaphoreType.DMA((copies,)),
            pltpu.SemaphoreType.DMA((copies,)),
        ],
        compiler_params=pltpu.CompilerParams(collective_id=0),
        interpret=interpret,
    )
    fn = _sharded(lambda xs: call(xs[0])[None], devices)
    expected = {p: np.stack([x[i ^ p] for i in range(devices)]) for p in held[-1]}
    return fn, (jnp.asarray(x),), expected


def barrier_steps(devices: int, steps: int, interpret=None):
    """`steps` decode steps in one device call, each a kernel whose only work is the entry barrier
    over every core (what each step of mkdsl's kernel pays before its first exchange). Result: each
    device's count of steps."""
    peers = [d for d in range(1, devices)]

    def kernel(c_ref, o_ref):
        idx = jax.lax.axis_index(AXIS).astype(jnp.int32)
        barrier = pltpu.get_barrier_semaphore()
        for d in peers:
            pl.semaphore_signal(barrier, 1, device_id=idx ^ d, device_id_type=pl.DeviceIdType.LOGICAL)
        pl.semaphore_wait(barrier, len(peers))
        o_ref[...] = c_ref[...] + 1

    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.int32),
        in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        compiler_params=pltpu.CompilerParams(collective_id=0),
        interpret=interpret,
    )

    def per_device(c):
        return jax.lax.fori_loop(0, steps, lambda _, v: call(v[0])[None], c)

    fn = _sharded(per_device, devices)
    return fn, (jnp.zeros((devices, 8, 128), jnp.int32),), np.full((devices, 8, 128), steps, np.int32)


def _sharded(per_device, devices: int):
    auto = (jax.sharding.AxisType.Auto,)  # arrays are resharded to the split shard_map expects
    mesh = jax.make_mesh((devices,), (AXIS,), axis_types=auto, devices=jax.devices()[:devices])
    spec = jax.sharding.PartitionSpec(AXIS)
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
