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
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mkdsl.backends.tpu.interpret import use_host_callbacks
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
        self.spec, self.model, self.mesh, self.decode_with = spec, spec.model, mesh, decode
        self.zero_state()
        self._steps: dict[int, Callable] = {}
        self._prefill_options = (prefill, per_device_prefill)
        self.prefill_fn = _prefill_fn(spec.model, module, sampling, prefill, mesh, per_device_prefill)
        self._by_sampling = {sampling: (self._steps, self.prefill_fn)}
        self._context_prefills: dict = {}  # (sampling, layers) -> the XLA prefill giving hidden states
        self._verify_steps: dict = {}  # (sampling, rows, layers) -> the verify step

    def zero_state(self) -> None:
        """Every row's caches and recurrent state zeroed, in the plain layout (a new generation)."""
        self.state = _zeros(
            self.module.state_layout(self.batch, self.seq_len), _state_shardings(self.module, self.mesh)
        )

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
            if self.interpret:
                use_host_callbacks()
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

    def prefill_with_context(self, tokens: np.ndarray, layers: tuple[int, ...], bucket: int = 1):
        """(next tokens [B], the prompt's hidden states after `layers` [B, T, len, H] or None):
        `prefill`, or with layers the spec's XLA prefill asked for them (whole, under jit).
        `bucket` > 1 (the XLA prefill only): the prompt padded to a multiple of it, its length
        given, so that prompts of nearby lengths share one compiled prefill (a server's)."""
        tokens = np.asarray(tokens, np.int32)
        t = tokens.shape[1]
        lengths = start = None
        if bucket > 1 and self.prefill_fn is not None:
            padded = np.zeros((tokens.shape[0], -(-t // bucket) * bucket), np.int32)
            padded[:, :t] = tokens
            tokens, lengths, start = padded, np.full(len(tokens), t, np.int32), np.zeros(len(tokens), np.int32)
        if not layers:
            return self.prefill(tokens, lengths, start), None
        if self.prefill_fn is None:
            raise ValueError("a drafter reading the target's hidden states needs the spec's XLA prefill")
        from mkdsl.run.prefill import build_prefill

        key = (self.sampling, tuple(layers))
        if key not in self._context_prefills:  # built once per sampling and layers
            shardings = _state_shardings(self.module, self.mesh)
            self._context_prefills[key] = build_prefill(
                self.model, sampling=self.sampling, state_shardings=shardings, context_layers=key[1]
            )
        fn = self._context_prefills[key]
        weights = unpad_weights(self.weights, getattr(self.module, "PADDED", {}))
        self.logits, chosen, self.state, context = fn(weights, self.state, tokens, lengths, start, seed=self.seed)
        return to_host(chosen), to_host(context)[:, :t]

    def verify_target(self, rows: int, layers: tuple[int, ...] = ()):
        """The R-row verify step as a speculative target (mkdsl/run/verify_rows.py), one sequence,
        on the current state: the kernel's (`verify_rows=rows`), or with `decode="reference"` the
        spec's verify reference on the kernel's weights, its tokens drawn as the kernel draws them.
        The step is built once per sampling, R and layers (a server verifies request after request)."""
        from mkdsl.run.speculative import kernel_rows_target

        key = (self.sampling, rows, tuple(layers))
        if key not in self._verify_steps:
            self._verify_steps[key] = self._verify_step(rows, tuple(layers))
        step = self._verify_steps[key]
        return kernel_rows_target(self.module, step, self.weights, self.state, rows, self.seed, tuple(layers))

    def _verify_step(self, rows: int, layers: tuple[int, ...]) -> Callable:
        if self.decode_with == "reference":
            return _reference_rows(self.model, self.module, self.sampling, rows, layers)
        kernel_sampling = self.module.Sampling(**dataclasses.asdict(self.sampling))
        options = {"interpret": self.interpret, "sampling": kernel_sampling}
        if rows > 1 or layers:
            options |= {"verify_rows": rows, "context_layers": layers}
        step = self.module.build_decode_step(self.batch, self.seq_len, **options)
        if self.interpret:
            use_host_callbacks()
        return step


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


def _reference_rows(model, module, sampling, rows: int, layers: tuple[int, ...]) -> Callable:
    """The spec's verify reference of `rows` rows on the kernel's weights, as the kernel's verify
    step is called (`step(weights, state, tokens [1, R], positions [1, R], seed)`; R = 1 without
    layers: tokens [1]), each row's token drawn by the module's sampling code at its position,
    keyed by its sequence (span R), as the kernel draws it."""
    import jax

    from mkdsl.run.prefill import reference_weights
    from mkdsl.run.rows import run_verify
    from mkdsl.run.sampling import sample_tokens

    pads = getattr(module, "PADDED", {})

    def step(weights, state, tokens, positions, seed):
        weights = reference_weights(model, unpad_weights(weights, pads))
        t, p = tokens.reshape(-1, rows), positions.reshape(-1, rows)
        logits, greedy, state, *context = run_verify(model, weights, state, t, p, layers)
        chosen = sample_tokens(
            logits.reshape(-1, logits.shape[-1]), p.reshape(-1), seed, sampling, greedy.reshape(-1), span=rows
        )
        if rows == 1 and not layers:
            return logits.reshape(-1, logits.shape[-1]), chosen, state
        return (logits, chosen.reshape(t.shape), state, *context)

    jitted = jax.jit(step, donate_argnums=(1,))
    return lambda weights, state, tokens, positions, seed: jitted(
        weights, state, tokens, positions, np.uint32(seed % 2**32)
    )


@dataclass
class Generation:
    tokens: list[np.ndarray]  # per row, the tokens generated (rows that stopped early have fewer)
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
    prompt,
    max_tokens: int,
    stop: frozenset[int],
    on_tokens: Callable[[list], None] | None = None,
) -> Generation:
    """Prefill, then decode until every row has stopped or made `max_tokens` tokens. `prompt`: one
    prompt's ids (every row the same) or one per row, of any lengths: the prefill takes the
    shortest length, then rows with more prompt are fed it one step at a time (the step's
    positions are shared, so a row still in its prompt ignores the sampled token), then
    `steps_per_call` tokens per call. `on_tokens` sees each call's new tokens, a list per row.
    The cache must hold the longest prompt, `max_tokens` and one call's worth more (`cache_length`)."""
    rows = _rows(prompt, decoder.batch)
    shortest = min(len(r) for r in rows)
    t0 = time.perf_counter()
    token = decoder.prefill(np.array([r[:shortest] for r in rows], np.int32))
    prefill_s = time.perf_counter() - t0
    made: list[list[int]] = [[] for _ in rows]
    position, calls = shortest, []
    _take(made, rows, position - 1, token[:, None], max_tokens, on_tokens)
    while not all(len(m) >= max_tokens or stop & set(m) for m in made):
        forcing = any(len(r) > position for r in rows)
        n = 1 if forcing else decoder.steps_per_call
        inputs = [r[position] if position < len(r) else (m[-1] if m else 0) for r, m in zip(rows, made, strict=True)]
        t0 = time.perf_counter()
        new = decoder.decode(np.asarray(inputs, np.int32), position, n)
        calls.append((n, time.perf_counter() - t0))
        _take(made, rows, position, new, max_tokens, on_tokens)
        position += n
    how = "XLA" if decoder.prefill_fn is not None else "kernel steps"
    return Generation([np.asarray(m, np.int32) for m in made], shortest, how, prefill_s, calls)


def _rows(prompt, batch: int) -> list[list[int]]:
    """One prompt for every row, or a prompt per row."""
    if len(prompt) and not isinstance(prompt[0], int | np.integer):
        rows = [[int(t) for t in r] for r in prompt]
        if len(rows) != batch:
            raise ValueError(f"{len(rows)} prompts for a batch of {batch}")
        return rows
    return [[int(t) for t in prompt]] * batch


def _take(made, rows, position: int, new: np.ndarray, max_tokens: int, on_tokens) -> None:
    """Each row keeps the tokens sampled at or after its last prompt position (`position` is the
    first one `new` was sampled at), up to `max_tokens`."""
    shown = []
    for b, (r, m) in enumerate(zip(rows, made, strict=True)):
        keep = [int(t) for i, t in enumerate(new[b]) if position + i >= len(r) - 1][: max_tokens - len(m)]
        m.extend(keep)
        shown.append(keep)
    if on_tokens:
        on_tokens(shown)


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
    """(the generated module, its directory): compiled once per spec, profile and mkdsl version.
    An entry counts only with its digest (`<key>.sha256`, written after the directory is in place)
    matching its files: a damaged or half-copied one is rebuilt, never imported."""
    from mkdsl.compiler import compile_source, write_atomically

    key = hashlib.sha256(f"{profile}\0{source}\0{_mkdsl_sources_hash()}".encode()).hexdigest()[:16]
    out_dir = cache_root() / "kernels" / key
    digest = out_dir.with_name(f"{key}.sha256")
    kernel = out_dir / "kernel.py"
    if not _intact(out_dir, digest):
        out, _ = compile_source(source, spec_path, profile, out_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        digest.unlink(missing_ok=True)
        if out_dir.exists():
            shutil.rmtree(out_dir)  # ours (the cache), damaged: write_atomically would refuse what it cannot read
        write_atomically(out, out_dir)
        tmp = digest.with_name(f".{digest.name}.{os.getpid()}")
        tmp.write_text(_digest(out_dir, out.files), encoding="utf-8")
        os.replace(tmp, digest)
    name = f"mkdsl_cached_kernel_{key}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, kernel)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses in the module look their module up by name
        spec.loader.exec_module(module)
    return sys.modules[name], out_dir


def _digest(out_dir: Path, names) -> str:
    """`name sha256` lines of an entry's files."""
    return "".join(f"{n} {hashlib.sha256((out_dir / n).read_bytes()).hexdigest()}\n" for n in sorted(names))


def _intact(out_dir: Path, digest: Path) -> bool:
    """The entry is there and its files are the bytes its digest names."""
    try:
        lines = digest.read_text(encoding="utf-8").splitlines()
        names = [line.split(" ", 1)[0] for line in lines]
        return bool(names) and "kernel.py" in names and _digest(out_dir, names) == "\n".join(lines) + "\n"
    except (OSError, ValueError):
        return False


def use_compilation_cache() -> None:
    """JAX's persistent compilation cache in `cache_root()/jax`: a later `mkdsl run` of the same
    kernel, batch and cache length loads XLA's compiled executables instead of compiling again.
    Every executable is kept (no minimum compile time): on a fast CPU a mini kernel compiles in
    under a second, and keeping it still saves the trace and lowering of the next run. JAX opens
    its cache once per process, at the first directory it sees: when a process (a server, a test
    session) moves to another directory, the cache is reset so that the new one is used."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    path = str(cache_root() / "jax")
    if jax.config.jax_compilation_cache_dir != path:
        jax.config.update("jax_compilation_cache_dir", path)
        compilation_cache.reset_cache()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
