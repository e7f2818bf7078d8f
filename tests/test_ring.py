"""The weight ring's descriptor table (runtime/core.py.jinja `ring_tables`): every global tile's
(arm, slot, k, n) is the tile the old per-stream dispatch would have started, the packed SMEM
words decode to it, and each consumer's arm set holds the arm of every tile it issues, while
staying small (that is what keeps the issue code, and so the kernel, small)."""

from __future__ import annotations

import bisect
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from mkdsl.compiler import compile_source
from mkdsl.verify import kernel as verify

ROOT = Path(__file__).resolve().parent.parent
# (spec, profile, the most arms one consumer may pick among): Llama's `w_down` issues into
# `w_down`, the next layer's `wq` and, in the last layer, `lm_head`; Kimi K3's last stream of a
# layer kind issues into its own tiles and the first stream of either next kind.
# Kimi K3's DSpark drafter (mini) streams `fc` in the step's prologue, ahead of layer 0's tiles;
# its small tiles each issue one arm (the one-arm `own` and `beyond` loops of `linear`).
CASES = [
    ("specs/llama3_8b.mk", None, 4),
    ("specs/kimi_k3.mk", "core", 3),
    ("specs/tiny.mk", None, 0),
    ("specs/kimi_k3_dspark.mk", "mini", 1),
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{Path(c[0]).stem}-{c[1]}")
def module(request, tmp_path_factory):
    spec, profile, most = request.param
    out, _ = compile_source((ROOT / spec).read_text(encoding="utf-8"), spec, profile)
    mod = verify.import_generated(out.files["kernel.py"], tmp_path_factory.mktemp("ring"), f"ring_{Path(spec).stem}")
    return mod, most


def _tile_of(mod, g: int):
    """Tile g the way the old dispatch found it: its layer by LAYER_TILE_BASE (past the last: the
    epilogue, before the first: the prologue, both reading slice 0), then its stream by start:
    ((stream, slot), index in it)."""
    layer = bisect.bisect_right(list(mod.LAYER_TILE_BASE), g) - 1
    j = g - int(mod.LAYER_TILE_BASE[layer]) if layer >= 0 else g
    if layer < 0:
        streams = [(st, None) for st in mod.PROLOGUE_STREAMS]
    elif layer == mod.NUM_LAYERS:
        streams = [(st, None) for st in mod.EPILOGUE_STREAMS]
    else:
        streams = mod.KIND_STREAMS[int(mod.LAYER_KIND[layer])]
    st, table = next((st, t) for st, t in streams if st.start <= j < st.start + st.tiles)
    slot = (layer if table is None else int(table[layer])) if st.stacked and 0 <= layer < mod.NUM_LAYERS else 0
    return (st, slot), j - st.start


def test_every_tile_is_described_as_the_stream_owning_it(module):
    mod, _ = module
    ring = mod.RING
    assert ring.tiles == int(mod.LAYER_TILE_BASE[-1]) + sum(st.tiles for st in mod.EPILOGUE_STREAMS)
    assert int(mod.LAYER_TILE_BASE[0]) == sum(st.tiles for st in getattr(mod, "PROLOGUE_STREAMS", ()))
    for g, (arm, slot, k, n) in enumerate(ring.static):
        (st, want_slot), j = _tile_of(mod, g)
        assert ring.arms[arm] == dataclasses.replace(st, start=0), g
        assert (slot, k, n) == (want_slot, j % st.nk, j // st.nk), g
        w0, w1 = int(ring.desc[2 * g]), int(ring.desc[2 * g + 1])
        assert (w0 & 255, w0 >> 8, w1 & 0xFFFF, w1 >> 16) == (arm, slot, k, n), g


def test_each_consumer_picks_among_few_arms_that_cover_what_it_issues(module):
    mod, most = module
    ring, depth = mod.RING, mod.RING_DEPTH
    widest = 0
    for g in range(ring.tiles):
        owner, _ = _tile_of(mod, g)
        arms, past = ring.ahead[owner[0]]
        widest = max(widest, len(arms))
        ahead = g + depth - 1
        if ahead < ring.tiles:
            assert ring.static[ahead][0] in arms, (g, owner[0])
        else:
            assert past, (g, owner[0])
    assert widest <= most, widest
    assert set(np.asarray(ring.desc[0::2]) & 255) == set(range(len(ring.arms)))  # every arm is used
