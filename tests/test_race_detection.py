"""mkdsl/backends/tpu/race_detection.py: the vectorised race detector reports what jax's own
detector reports, and it finds a real race in an interpreted kernel (and none once it is fixed)."""

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
from jax._src.pallas.mosaic.interpret.race_detection_state import RaceDetectionState
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mkdsl.backends.tpu.race_detection import VectorisedRaceDetection, unordered

# Ranges as the interpreter builds them (`to_range`): a slice with a start and stop, or an index,
# per leading dimension; fewer dimensions than the buffer mean whole trailing dimensions.
RANGES = [
    (),
    (slice(0, 2),),
    (slice(1, 3),),
    (slice(2, 4), slice(0, 8)),
    (slice(0, 4), slice(8, 16)),
    (1,),
    (3, slice(0, 8)),
    (slice(0, 1), 5),
]
ACCESS = st.tuples(
    st.sampled_from(["read", "write"]),
    st.integers(0, 2),  # device
    st.integers(0, 1),  # buffer
    st.lists(st.integers(0, 2), min_size=3, max_size=3),  # vector clock over 3 cores
    st.sampled_from(RANGES),
)


def _apply(detector, access) -> list[str]:
    """One access checked by `detector`; the clock lines of the races it printed."""
    kind, device, buffer, clock, rnge = access
    out = io.StringIO()
    check = detector.check_read if kind == "read" else detector.check_write
    with contextlib.redirect_stdout(out):
        check(device, 0, np.array(clock, np.int32), ("vmem", buffer, 0, 0), rnge)
    return re.findall(r"clock: \[.*\]", out.getvalue())


@settings(max_examples=300, deadline=None)
@given(st.lists(ACCESS, min_size=1, max_size=40))
def test_it_reports_the_races_jax_reports_in_the_same_order(history):
    """After every access of a random history: the same verdict, and the same clocks printed
    (the racing access and the earlier one it races with: the first such, in jax's order)."""
    theirs, ours = RaceDetectionState(num_cores=3), VectorisedRaceDetection(num_cores=3)
    for i, access in enumerate(history):
        assert _apply(ours, access) == _apply(theirs, access), f"access {i}: {access}"
        assert ours.races_found == theirs.races_found, f"access {i}: {access}"


def test_unordered_is_neither_strictly_before_nor_after():
    clocks = np.array([[0, 0, 0], [1, 2, 0], [1, 1, 1], [2, 0, 0], [1, 2, 1], [3, 3, 3]], np.int32)
    # [1, 2, 0]: before it [0,0,0]; itself (equal: unordered); concurrent [1,1,1], [2,0,0];
    # after it [1,2,1], [3,3,3].
    assert unordered(clocks, np.array([1, 2, 0], np.int32)).tolist() == [1, 2, 3]


def _dma_then_read(wait_first: bool):
    """A kernel copying its input into VMEM by DMA and reading the copy: after waiting for the
    DMA (correct), or before (a race between the DMA's write and the read)."""

    def kernel(x_hbm, o_ref, scratch, sem):
        copy = pltpu.make_async_copy(x_hbm, scratch, sem)
        copy.start()
        if wait_first:
            copy.wait()
        o_ref[...] = scratch[...] + 1.0
        if not wait_first:
            copy.wait()

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA],
        interpret=pltpu.InterpretParams(detect_races=True),
    )


def test_an_interpreted_kernel_s_race_is_found_and_its_fix_is_clean(capsys):
    """conftest installs the vectorised detector, as mkdsl does wherever it asks for interpret mode."""
    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    jax.block_until_ready(_dma_then_read(wait_first=False)(x))
    assert type(ipc.races) is VectorisedRaceDetection
    assert ipc.races.races_found
    assert "RACE DETECTED" in capsys.readouterr().out
    out = jax.block_until_ready(_dma_then_read(wait_first=True)(x))
    assert not ipc.races.races_found
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x) + 1.0)  # exact: integers in f32
