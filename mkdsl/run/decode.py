"""`mkdsl run`: a spec, a checkpoint and a prompt to streamed text.

The kernel is compiled into a cache directory (keyed by the spec, its profile and mkdsl's own
sources) and imported from there. Generation goes through a `Decoder`:

- `Decoder.prefill(tokens[B, T]) -> next_tokens[B]` writes the caches for positions 0..T-1 and
  samples each row's next token: by default the spec's XLA prefill (`mkdsl.run.prefill`), or the
  kernel's step once per prompt token (`prefill="steps"`, and for specs without prefill rules).
- `Decoder.decode(tokens[B], position, n) -> tokens[B, n]` feeds `tokens` at `position` and
  returns the next `n` tokens: the kernel's step with its in-kernel sampling, `steps_per_call`
  steps per device call (a last, shorter call uses a step built for its count).

Both sample with the same `mkdsl.run.sampling.Sampling` and seed, so the prefill's token and the
kernel's are drawn by the same code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mkdsl.run.distributed import to_host


class Decoder:
    """The kernel's step with its weights and state, and the prefill that fills the state."""

    def __init__(
        self,
        spec,
        module,
        weights,
        batch,
        seq_len,
        sampling,
        *,
        interpret,
        seed=0,
        steps_per_call=1,
        prefill="auto",
        decode="kernel",
        mesh=None,
        per_device_prefill=None,
    ):
        self.module, self.weights, self.batch, self.seq_len = module, weights, batch, seq_len
        self.sampling, self.seed, self.interpret, self.steps_per_call = sampling, seed, interpret, steps_per_call
        self.model, self.mesh, self.decode_with = spec.model, mesh, decode
        self.state = _zeros(module.state_layout(batch, seq_len), _state_shardings(module, mesh))
        self._steps: dict[int, Callable] = {}
        self._prefill_options = (prefill, per_device_prefill)
        self.prefill_fn = _prefill_fn(spec.model, module, sampling, prefill, mesh, per_device_prefill)
        self._by_sampling = {sampling: (self._steps, self.prefill_fn)}

    def use_sampling(self, sampling) -> None:
        """Sample with `sampling` from now on (its steps and prefill built once, then kept)."""
        if sampling == self.sampling:
            return
        if sampling not in self._by_sampling:
            fn = _prefill_fn(
                self.model, self.module, sampling, *self._prefill_options[:1], self.mesh, self._prefill_options[1]
            )
            self._by_sampling[sampling] = ({}, fn)
        self.sampling = sampling
        self._steps, self.prefill_fn = self._by_sampling[sampling]

    def step(self, n: int) -> Callable:
        """The kernel's step running `n` decode steps per call (built once per count); with
        `decode="reference"` the spec's unfused XLA step, `n` times, sampled as the kernel samples."""
        if n not in self._steps and self.decode_with == "reference":
            self._steps[n] = _reference_steps(self.model, self.module, self.sampling, n)
        if n not in self._steps:
            kernel_sampling = self.module.Sampling(**dataclasses.asdict(self.sampling))  # the module's own class
            options = {"interpret": self.interpret, "sampling": kernel_sampling, "steps_per_call": n}
            step = self.module.build_decode_step(self.batch, self.seq_len, **options)
            if self.interpret and hasattr(self.module, "MESH_SHAPE"):
                from mkdsl.api import _HostCallbacks  # a sharded step in interpret mode (see build_step)

                step = _HostCallbacks(step)
            self._steps[n] = step
        return self._steps[n]

    def _call(self, tokens, position: int, n: int) -> np.ndarray:
        return self.step_rows(tokens, np.full((self.batch,), position, np.int32), n)

    def step_rows(self, tokens, positions, n: int = 1) -> np.ndarray:
        """`n` steps from each row's token at its own position: tokens [B, n]."""
        tokens, positions = np.asarray(tokens, np.int32), np.asarray(positions, np.int32)
        self.logits, chosen, self.state = self.step(n)(self.weights, self.state, tokens, positions, self.seed)
        chosen = to_host(chosen)  # waits for the call
        return chosen.reshape(self.batch, n)

    def prefill(self, tokens: np.ndarray, lengths=None, start=None) -> np.ndarray:
        """Each row's prompt (its first `lengths[b]` tokens, at positions from `start[b]`; the
        XLA prefill only) into the state; the next token of each row."""
        if self.prefill_fn is not None:
            self.logits, chosen, self.state = self.prefill_fn(
                self.weights, self.state, np.asarray(tokens, np.int32), lengths, start, seed=self.seed
            )
            return to_host(chosen)
        if lengths is not None or start is not None:
            raise ValueError("prompts of their own lengths per row need the spec's XLA prefill")
        for t in range(tokens.shape[1]):
            chosen = self._call(tokens[:, t], t, 1)[:, 0]
        return chosen

    def decode(self, tokens: np.ndarray, position: int, n: int) -> np.ndarray:
        return self._call(tokens, position, n)


def unpad_weights(weights: dict, pads: dict) -> dict:
    """The kernel's padded arrays (the module's PADDED: name -> per padded axis (axis, valid,
    padded, blocks)) back in the spec's layout, which the prefill (like the reference) reads."""
    import jax.numpy as jnp

    out = dict(weights)
    for name, axes in pads.items():
        w = out[name]
        if any(w.shape[axis] != padded * blocks for axis, _, padded, blocks in axes):
            continue  # not padded
        for axis, valid, padded, blocks in axes:
            w = jnp.moveaxis(w, axis, -1)
            parts = jnp.reshape(w, (*w.shape[:-1], blocks, padded))[..., :valid]
            w = jnp.moveaxis(jnp.reshape(parts, (*w.shape[:-1], blocks * valid)), -1, axis)
        out[name] = w
    return out


def _zeros(layout: dict, shardings: dict | None = None) -> dict:
    """The zero state; with shardings, global arrays each process makes its own shards of."""
    import jax
    import jax.numpy as jnp

    if shardings is None:
        return {name: jnp.zeros(s.shape, s.dtype) for name, s in layout.items()}
    make = jax.jit(lambda: {n: jnp.zeros(s.shape, s.dtype) for n, s in layout.items()}, out_shardings=shardings)
    return make()


def _state_shardings(module, mesh) -> dict | None:
    return module.state_shardings(mesh) if mesh is not None and hasattr(module, "state_shardings") else None


def _prefill_fn(model, module, sampling, prefill: str, mesh, per_device: bool | None) -> Callable | None:
    """The spec's XLA prefill on the kernel's (padded) weights: per device under `shard_map` for
    a sharded spec given its mesh (unless `per_device=False`: then the whole model under `jit`,
    partitioned by XLA over the weights' shardings); None for kernel steps (asked, or an op
    without a prefill rule)."""
    from mkdsl.run.prefill import PrefillError, build_prefill, check_prefill
    from mkdsl.spmd.shard import is_sharded

    if prefill == "steps":
        return None
    try:
        check_prefill(model)
    except PrefillError:
        if prefill == "xla":
            raise
        return None
    if per_device is None:
        per_device = mesh is not None and is_sharded(model)
    if per_device:
        from mkdsl.run.prefill_spmd import build_sharded_prefill

        fn = build_sharded_prefill(model, mesh, sampling=sampling, state_shardings=_state_shardings(module, mesh))
    else:
        fn = build_prefill(model, sampling=sampling, state_shardings=_state_shardings(module, mesh))
    pads = getattr(module, "PADDED", {})
    return lambda w, *a, **k: fn(unpad_weights(w, pads), *a, **k)


def _reference_steps(model, module, sampling, n: int) -> Callable:
    """`n` steps of the spec's reference on the kernel's weights, each token drawn by the
    module's sampling code at its position: what the kernel's step computes, unfused in XLA."""
    import jax

    from mkdsl.run.prefill import reference_weights
    from mkdsl.run.reference import build_reference
    from mkdsl.run.sampling import sample_tokens

    ref, pads = build_reference(model, jit=False), getattr(module, "PADDED", {})

    def steps(weights, state, tokens, positions, seed):
        weights = reference_weights(model, unpad_weights(weights, pads))
        chosen = []
        for i in range(n):
            logits, greedy, state = ref(weights, state, tokens, positions + i)
            tokens = sample_tokens(logits, positions + i, seed, sampling, greedy)
            chosen.append(tokens)
        return logits, jax.numpy.stack(chosen, axis=1), state

    jitted = jax.jit(steps, donate_argnums=(1,))
    return lambda weights, state, tokens, positions, seed: jitted(
        weights, state, tokens, positions, np.uint32(seed % 2**32)
    )


@dataclass
class Generation:
    tokens: np.ndarray  # [B, generated]
    prompt_tokens: int
    prefill: str  # how: "XLA" or "kernel steps"
    prefill_s: float
    calls: list[tuple[int, float]]  # decode calls: (steps, seconds)

    def summary(self, batch: int) -> str:
        """The closing line. ms/step leaves out the first kernel call (its trace and compile)
        unless it is the only one, and then says so."""
        head = f"prefill ({self.prefill}) {self.prefill_s:.2f} s for {self.prompt_tokens} tokens"
        if not self.calls:
            return f"{head}; no decode steps"
        timed = self.calls[1:] or self.calls
        steps, secs = sum(n for n, _ in timed), sum(t for _, t in timed)
        if len(self.calls) > 1:
            head += f"; first decode call (trace and compile) {self.calls[0][1]:.1f} s"
        note = "" if len(self.calls) > 1 else ", the only call: trace and compile included"
        return (
            f"{head}; decode {1000 * secs / steps:.1f} ms/step, {batch * steps / secs:.2f} tokens/s "
            f"(batch {batch}, {steps} timed steps{note})"
        )


def generate(
    decoder: Decoder,
    prompt: list[int],
    max_tokens: int,
    stop: frozenset[int],
    on_tokens: Callable[[np.ndarray], None] | None = None,
) -> Generation:
    """Prefill `prompt` (every row the same), then decode `steps_per_call` tokens per call until
    every row has stopped or `max_tokens` tokens are made; `on_tokens` sees each call's new tokens.
    The cache must hold the prompt, `max_tokens` and one call's worth more (see `cache_length`)."""
    rows = np.tile(np.asarray(prompt, np.int32), (decoder.batch, 1))
    t0 = time.perf_counter()
    token = decoder.prefill(rows)
    prefill_s = time.perf_counter() - t0
    out, done, position, calls = [token[:, None]], np.isin(token, list(stop)), len(prompt), []
    if on_tokens:
        on_tokens(out[0])
    made = 1
    while made < max_tokens and not done.all():
        n = decoder.steps_per_call
        t0 = time.perf_counter()
        new = decoder.decode(out[-1][:, -1], position, n)[:, : max_tokens - made]
        calls.append((n, time.perf_counter() - t0))
        position, made = position + n, made + new.shape[1]
        out.append(new)
        done |= np.isin(new, list(stop)).any(axis=1)
        if on_tokens:
            on_tokens(new)
    how = "XLA" if decoder.prefill_fn is not None else "kernel steps"
    return Generation(np.concatenate(out, axis=1), len(prompt), how, prefill_s, calls)


def cache_length(prompt: int, max_tokens: int, steps_per_call: int, kv_tile: int) -> int:
    """The cache length a generation needs, rounded up to whole KV tiles."""
    need = prompt + max_tokens + steps_per_call
    return -(-need // kv_tile) * kv_tile


# ---------------------------------------------------------------------------- the kernel cache


def cache_root() -> Path:
    """Where `mkdsl run` keeps compiled kernels: $MKDSL_CACHE, or ~/.cache/mkdsl (XDG_CACHE_HOME)."""
    if os.environ.get("MKDSL_CACHE"):
        return Path(os.environ["MKDSL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mkdsl"


def _mkdsl_sources_hash() -> str:
    root = Path(__file__).parents[1]  # the mkdsl package
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.suffix in (".py", ".jinja", ".lark") and "__pycache__" not in p.parts:
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def cached_kernel(source: str, spec_path: str, profile: str | None):
    """(the generated module, its directory): compiled once per spec, profile and mkdsl version."""
    from mkdsl.compiler import compile_source, write_atomically

    key = hashlib.sha256(f"{profile}\0{source}\0{_mkdsl_sources_hash()}".encode()).hexdigest()[:16]
    out_dir = cache_root() / "kernels" / key
    kernel = out_dir / "kernel.py"
    if not kernel.exists():
        out, _ = compile_source(source, spec_path, profile, out_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(out, out_dir)
    name = f"mkdsl_cached_kernel_{key}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, kernel)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses in the module look their module up by name
        spec.loader.exec_module(module)
    return sys.modules[name], out_dir
