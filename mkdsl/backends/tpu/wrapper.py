"""What the generated module's Python wrapper checks before anything is traced
(templates/wrapper/checks.py.jinja): the ranges of the build-time sizes and of token ids, taken
from the whole model, and a valid cache length for the docstring's example."""

from __future__ import annotations

import math

from mkdsl.lang.ir import Model


def wrapper_context(model: Model, kv_tile: int) -> dict:
    """Template values: the cache lengths the spec's dims allow, the token ids the embedding
    takes, and the smallest cache length `build_decode_step` accepts (for the example)."""
    from mkdsl.lang.elaborate import graph_value_type

    seq = model.dims[1:]
    low, high = max((d.low for d in seq), default=1), min((d.high for d in seq), default=2**31 - 1)
    tokens = model.inputs[0].name  # the step's first input: the token ids
    tables = [  # declared tensors that a node reading the token ids takes: the table they index
        r.name
        for n in model.step.nodes
        if any(i.kind == "input" and i.name == tokens for i in n.inputs)
        for r in n.inputs
        if r.kind == "tensor"
    ]
    if tables:
        vocab = model.tensor(tables[0]).type.shape[0]
    else:
        vocab = graph_value_type(model.step, model.step.results[0]).shape[1]
    example = max(kv_tile, -(-low // kv_tile) * kv_tile)
    return {
        "seq_range": (low, high),
        "seq_dims": " and ".join(f"`{d.name}` in {d.low} .. {d.high}" for d in seq) or "no cache dims",
        "vocab": vocab,
        "example_seq_len": example,
        "example_batch": model.dims[0].low,
        "devices": math.prod(n for _, n in model.mesh),
    }
