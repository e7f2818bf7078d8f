"""`mkdsl run`: a spec, a checkpoint and a prompt to streamed text.

The kernel is compiled into a cache directory (keyed by the spec, its profile and mkdsl's own
sources) and imported from there. Generation goes through a `Decoder`, the seam where a prefill
and in-kernel sampling plug in:

- `Decoder.prefill(tokens[B, T]) -> next_tokens[B]` writes the caches for positions 0..T-1 and
  picks each row's next token. The default feeds the prompt to the kernel one token per step;
  a `prefill_fn(weights, state, tokens[B, T]) -> (logits f32[B, V], state)` passed in replaces
  that loop (an XLA prefill that writes the kernel's cache layout).
- `Decoder.decode(tokens[B], position, n) -> tokens[B, n]` feeds `tokens` at `position` and
  returns the next `n` tokens, each fed to the following step. The default calls the kernel's
  step `n` times and samples on the host (greedy: the kernel's own argmax); a
  `decode_fn(weights, state, tokens, positions, n, sampling) -> (tokens[B, n], state)` passed in
  replaces it (several steps per device call, sampling in the kernel).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    seed: int = 0


def sample(logits: np.ndarray, s: Sampling, rng: np.random.Generator) -> np.ndarray:
    """Host-side sampling of one token per row: temperature, then top-k, then top-p (nucleus)."""
    x = np.asarray(logits, np.float64) / s.temperature
    if s.top_k > 0:
        kth = np.sort(x, axis=-1)[:, -min(s.top_k, x.shape[-1])][:, None]
        x = np.where(x >= kth, x, -np.inf)
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    if s.top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=-1)
        keep = np.cumsum(sorted_p, axis=-1) - sorted_p < s.top_p  # the smallest prefix reaching top_p
        mask = np.zeros_like(keep)
        np.put_along_axis(mask, order, keep, axis=-1)
        p = np.where(mask, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    return np.array([rng.choice(p.shape[-1], p=row) for row in p], np.int32)


class Decoder:
    """The kernel's step with its weights and state (see the module docstring for the seams)."""

    def __init__(self, module, weights, batch: int, seq_len: int, sampling: Sampling, *, interpret, **hooks):
        self.module, self.weights, self.batch, self.seq_len = module, weights, batch, seq_len
        self.sampling = sampling
        self.rng = np.random.default_rng(sampling.seed)
        options = {"interpret": interpret}
        self.step = module.build_decode_step(batch, seq_len, **options)
        self.state = _zeros(module.state_layout(batch, seq_len))
        self.prefill_fn: Callable | None = hooks.get("prefill_fn")
        self.decode_fn: Callable | None = hooks.get("decode_fn")
        self.first_call_s: float | None = None  # the first step's trace and compile

    def _pick(self, logits, greedy) -> np.ndarray:
        if self.sampling.temperature == 0:
            return np.asarray(greedy, np.int32)
        return sample(np.asarray(logits), self.sampling, self.rng)

    def _step(self, tokens: np.ndarray, position: int):
        t0 = time.perf_counter()
        positions = np.full((self.batch,), position, np.int32)
        logits, greedy, self.state = self.step(self.weights, self.state, np.asarray(tokens, np.int32), positions)
        greedy = np.asarray(greedy)  # waits for the step
        if self.first_call_s is None:
            self.first_call_s = time.perf_counter() - t0
        return logits, greedy

    def prefill(self, tokens: np.ndarray) -> np.ndarray:
        if self.prefill_fn is not None:
            logits, self.state = self.prefill_fn(self.weights, self.state, np.asarray(tokens, np.int32))
            return self._pick(logits, np.argmax(np.asarray(logits), axis=-1))
        for t in range(tokens.shape[1]):
            logits, greedy = self._step(tokens[:, t], t)
        return self._pick(logits, greedy)

    def decode(self, tokens: np.ndarray, position: int, n: int) -> np.ndarray:
        if self.decode_fn is not None:
            positions = np.full((self.batch,), position, np.int32)
            out, self.state = self.decode_fn(self.weights, self.state, tokens, positions, n, self.sampling)
            return np.asarray(out)
        out = []
        for i in range(n):
            logits, greedy = self._step(tokens, position + i)
            tokens = self._pick(logits, greedy)
            out.append(tokens)
        return np.stack(out, axis=1)


def _zeros(layout: dict) -> dict:
    import jax.numpy as jnp

    return {name: jnp.zeros(s.shape, s.dtype) for name, s in layout.items()}


@dataclass
class Generation:
    tokens: np.ndarray  # [B, generated]
    prompt_tokens: int
    prefill_s: float
    decode_s: float
    steps: int
    first_call_s: float | None

    def summary(self, batch: int) -> str:
        ms = 1000 * self.decode_s / max(self.steps, 1)
        rate = batch * self.steps / self.decode_s if self.decode_s else 0.0
        first = f" (incl. the first call's trace and compile, {self.first_call_s:.1f} s)" if self.first_call_s else ""
        return (
            f"prefill {self.prefill_s:.2f} s for {self.prompt_tokens} tokens{first}; "
            f"decode {ms:.1f} ms/step, {rate:.2f} tokens/s ({self.steps} steps x batch {batch})"
        )


def generate(
    decoder: Decoder,
    prompt: list[int],
    max_tokens: int,
    stop: frozenset[int],
    steps_per_call: int = 1,
    on_tokens: Callable[[np.ndarray], None] | None = None,
) -> Generation:
    """Prefill `prompt` (every row the same), then decode until every row has stopped or
    `max_tokens` tokens; `on_tokens` sees each new column of tokens as it is made."""
    rows = np.tile(np.asarray(prompt, np.int32), (decoder.batch, 1))
    t0 = time.perf_counter()
    token = decoder.prefill(rows)
    prefill_s = time.perf_counter() - t0
    out, done, position, steps = [token], np.isin(token, list(stop)), len(prompt), 0
    if on_tokens:
        on_tokens(token[:, None])
    t0 = time.perf_counter()
    while len(out) < max_tokens and not done.all() and position < decoder.seq_len:
        n = min(steps_per_call, max_tokens - len(out), decoder.seq_len - position)
        new = decoder.decode(out[-1], position, n)
        steps, position = steps + n, position + n
        out.extend(new.T)
        done |= np.isin(new, list(stop)).any(axis=1)
        if on_tokens:
            on_tokens(new)
    return Generation(
        np.stack(out, axis=1), len(prompt), prefill_s, time.perf_counter() - t0, steps, decoder.first_call_s
    )


# ---------------------------------------------------------------------------- the kernel cache


def cache_root() -> Path:
    """Where `mkdsl run` keeps compiled kernels: $MKDSL_CACHE, or ~/.cache/mkdsl (XDG_CACHE_HOME)."""
    if os.environ.get("MKDSL_CACHE"):
        return Path(os.environ["MKDSL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mkdsl"


def _mkdsl_sources_hash() -> str:
    root = Path(__file__).parent
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
