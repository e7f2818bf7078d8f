"""The random transformers model saved as the spec's mapping reads it (`verify --against
transformers`): where the spec keeps a weight quantised that transformers saves in bf16 (gpt-oss's
MXFP4 experts, DeepSeek-V3's fp8 blocks), the saved values are moved to the nearest values of
that format (codes times power-of-two scales, `checkpoint.quantise.grid_values`) and the model is
read back from the file, so both sides compute with the same weights. Weights that the compared
step does not read (DeepSeek-V3's multi-token-prediction head, which transformers' model has not)
are left out of the comparison and said so.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from mkdsl.lang.ir import Model


def step_weights(model: Model) -> set[str]:
    """The weights the decode step reads: its layers' and its own (not an MTP head's)."""
    graphs = (*model.kinds, model.step)
    return {r.name for g in graphs for n in g.nodes for r in n.inputs if r.kind == "tensor"}


def compared_model(model: Model) -> tuple[Model, list[str]]:
    """`model` without the weights its step does not read, and their names."""
    read = step_weights(model)
    unread = [t.name for t in model.weights if t.name not in read]
    keep = tuple(t for t in model.tensors if t.kind != "weight" or t.name in read)
    return dataclasses.replace(model, tensors=keep), unread


def on_the_spec_grids(model: Model, directory: Path) -> int:
    """Rewrite the bf16 save in `directory` so that every stored tensor feeding a quantised weight
    through a plain source holds values of that weight's format; how many tensors it changed."""
    from safetensors.numpy import load_file, save_file

    from mkdsl.checkpoint.formats import open_checkpoint
    from mkdsl.checkpoint.loader import choose_source

    reader = open_checkpoint(directory)
    cmap = next(c for c in model.checkpoints if c.format == "hf")
    files = sorted(Path(directory).glob("*.safetensors"))
    stored = {n: x for f in files for n, x in load_file(str(f)).items()}
    changed: set[str] = set()
    for t in model.weights:
        src = choose_source(t, cmap.source(t.name), reader)
        if not t.type.dtype.quantised or src.scales is not None:
            continue
        for name in _piece_names(t, src):
            stored[name] = _to_grid(t.type.dtype, stored[name], src.steps)
            changed.add(name)
    if changed:
        for f in files:
            f.unlink()
        save_file(stored, str(Path(directory) / "model.safetensors"), metadata={"format": "pt"})
        index = Path(directory) / "model.safetensors.index.json"
        index.unlink(missing_ok=True)
    return len(changed)


def _piece_names(t, src) -> list[str]:
    import itertools

    if len(src.patterns) != 1:
        raise ValueError(f"`{t.name}`: a concatenated source cannot be moved onto its format's grid")
    layers = [i for i, s in enumerate(t.slots) if s >= 0] if t.stacked else [None]
    lead = t.type.shape[: len(src.stack)]
    return [src.names(i, idx)[0] for i in layers for idx in itertools.product(*(range(n) for n in lead))]


def _to_grid(dtype, x: np.ndarray, steps) -> np.ndarray:
    """`x` (stored) with the entries the steps carry into the weight rounded onto `dtype`'s grid,
    in the weight's layout (where its scale groups are), then put back where they came from."""
    from mkdsl.checkpoint.mapping import apply_steps
    from mkdsl.checkpoint.quantise import grid_values

    where = apply_steps(np.arange(1, x.size + 1).reshape(x.shape), steps)  # 0: padding
    values = grid_values(dtype, apply_steps(x.astype(np.float32), steps))
    out = x.astype(np.float32).reshape(-1)
    keep = where > 0
    out[where[keep] - 1] = values[keep]
    return out.reshape(x.shape).astype(x.dtype)
