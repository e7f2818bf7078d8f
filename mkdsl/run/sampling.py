"""Sampling the next token, for the reference and prefill: the very code the generated module
carries (backends/tpu/templates/wrapper/sampling.py.jinja, plain Python), executed here; the
kernel's in-kernel draw there (`sampled_argmax`) shares its hash and keep rules, so that the
kernel's step and the reference choose the same token from the same logits, seed and
positions. `Sampling(temperature, top_k, top_p)`, `sample_tokens(logits, positions, seed,
sampling)`, `sample_uniform(seed, positions, vocab)`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mkdsl.lazy import jax, jnp

TEMPLATE = Path(__file__).parents[1] / "backends/tpu/templates/wrapper/sampling.py.jinja"


def _load() -> dict:
    import numpy as np

    scope = {"dataclasses": dataclasses, "jax": jax, "jnp": jnp, "np": np, "__name__": __name__}
    exec(compile(TEMPLATE.read_text(encoding="utf-8"), str(TEMPLATE), "exec"), scope)
    return scope


_scope = _load()
Sampling = _scope["Sampling"]
sample_tokens = _scope["sample_tokens"]
sample_uniform = _scope["sample_uniform"]
sampling_mask = _scope["sampling_mask"]

__all__ = ["Sampling", "sample_tokens", "sample_uniform", "sampling_mask"]
