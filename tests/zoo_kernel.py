"""Shared by the tests of specs written as a new user would (Gemma 3, Mixtral, Qwen2.5): build a
spec's mini kernel and run it against the reference in TPU interpret mode, layer by layer, with
the race detector on (the bounds are mkdsl/verify/kernel.py's, derived there)."""

from __future__ import annotations

import importlib.util
import math
import time
from pathlib import Path

import numpy as np
from jax.experimental.pallas import tpu as pltpu

from mkdsl.compiler import compile_source
from mkdsl.plan.hbm import HBM_USABLE_PER_CORE
from mkdsl.run.random_params import random_params
from mkdsl.verify import kernel as verify


def check_full_size(spec: Path, devices: int, min_cache: int = 32768, profile: str | None = None):
    """The full-size step through every stage (shard pass, planner, lowerings, emitted module) on
    its deployment mesh; one device's HBM holds it with a cache of at least `min_cache` tokens (or
    the cache dim's largest value) at the largest batch. Returns what one device runs."""
    out, _ = compile_source(spec.read_text(encoding="utf-8"), str(spec), profile, None)
    assert math.prod(n for _, n in out.model.mesh) == devices and "def build_decode_step" in out.files["kernel.py"]
    longest = min(min_cache, out.model.dims[1].high)
    assert out.plan.hbm_bytes < HBM_USABLE_PER_CORE and out.plan.hbm_max_cache >= longest
    return out.local


def build_mini_kernel(spec: Path, directory: Path, kv_tile: int = 16):
    """The spec's `mini` kernel with a small KV tile (a few steps then cross tiles cheaply)."""
    text = spec.read_text(encoding="utf-8") + f"\nhints {{ kv_tile = {kv_tile} }}\n"
    out, _ = compile_source(text, str(spec), "mini", None)
    path = directory / "kernel.py"
    path.write_text(out.files["kernel.py"], encoding="utf-8")
    module_spec = importlib.util.spec_from_file_location(f"{spec.stem}_mini_kv{kv_tile}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return out.model, module, verify.LayerChecker(out.model)


def run_mini_kernel(kernel, batch: int, seq_len: int, starts, steps: int, seed: int, vocab: int) -> dict:
    """`steps` decode steps from the kernel's own state and tokens, each checked layer by layer;
    returns the worst error / bound per checked item (asserts on any failure, race or NaN)."""
    model, module, checker = kernel
    weights, state = random_params(model, {"B": batch, "S": seq_len}, seed=seed)
    tokens = np.random.default_rng(seed).integers(0, vocab, batch).astype(np.int32)
    positions = np.asarray(starts[:batch], np.int32)
    step = module.build_decode_step(batch, seq_len, interpret=verify.interpret_params(), layer_trace=True)
    pltpu.reset_tpu_interpret_mode_state()
    sharded = int(np.prod(module.MESH_SHAPE)) > 1
    pad = getattr(module, "pad_weights", dict)
    worst: dict[str, float] = {}
    t0 = time.perf_counter()
    for i in range(steps):
        out = verify.run_kernel(step, weights, state, tokens, positions, sharded=sharded, pad=pad)
        assert not verify.races_found(), f"step {i}: the race detector reported a race"
        result = checker.check(weights, state, tokens, positions, out)
        assert result.ok, f"batch {batch} step {i}: " + "; ".join(result.failures[:8])
        for item, ratio in result.worst.items():
            worst[item] = max(worst.get(item, 0.0), ratio)
        state, tokens, positions = out.state, out.next_tokens.astype(np.int32), positions + 1
    print(f"\n{model.name} mini batch {batch}: worst error / bound {worst}; {time.perf_counter() - t0:.0f} s")
    return worst
