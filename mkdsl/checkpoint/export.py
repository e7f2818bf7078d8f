"""A GGUF checkpoint written out as a Hugging Face one (`mkdsl.export_hf`): `model.safetensors`
by the spec's own `checkpoint hf` mapping, `config.json` (the layer count the loader checks) and
the GGUF's tokenizer as `tokenizer.json` with `tokenizer_config.json` (end and start tokens, the
chat template), so `mkdsl run` and `mkdsl.load_weights` read the result as any HF checkpoint.

The weights are read by the spec's `checkpoint gguf` mapping (decoded and rounded into the spec's
dtypes, as `mkdsl run` loads them), then each is put back through the inverse of its `hf` steps.
Only steps that move values without dropping any can be undone (`transpose`, `squeeze`, `round`,
and index maps that are permutations, such as `unpermute` or `regroup`); a weight cut from a
fused tensor (`rows`), concatenated, stacked or stored as a quantised pair is refused, naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mkdsl.checkpoint.formats import CheckpointError, open_checkpoint
from mkdsl.checkpoint.mapping import Step, WeightSource
from mkdsl.checkpoint.steps import STEPS


def export_hf(model, gguf_path, out_dir) -> Path:
    """Write the GGUF at `gguf_path` as a Hugging Face checkpoint in `out_dir` (created; files
    of these names are replaced). `model`: a `mkdsl.Spec` or its `Model`. Returns `out_dir`."""
    from safetensors.numpy import save_file

    from mkdsl.checkpoint.loader import load_weights
    from mkdsl.checkpoint.tokenizer import load_codec

    model = getattr(model, "model", model)
    hf = next((c for c in model.checkpoints if c.format == "hf"), None)
    if hf is None:
        raise CheckpointError(f"the spec of `{model.name}` has no `checkpoint hf` mapping to export by")
    reader = open_checkpoint(gguf_path)
    if reader.format != "gguf":
        raise CheckpointError(f"{gguf_path}: not a GGUF file")
    for src in hf.sources:
        _check_exportable(src)
    codec = load_codec(reader)
    weights, _ = load_weights(model, reader, host=True, progress=False)
    tensors = {}
    for src in hf.sources:
        t = model.tensor(src.weight)
        w = np.asarray(weights[t.name])
        layers = [(i, s) for i, s in enumerate(t.slots) if s >= 0] if t.stacked else [(None, None)]
        for layer, slot in layers:
            (name,) = src.names(layer)
            tensors[name] = np.ascontiguousarray(_undo(w[slot] if layer is not None else w, src))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"num_hidden_layers": len(model.schedule)}, indent=1))
    codec.tokenizer.save(str(out / "tokenizer.json"))
    config = {"bos_token": codec.bos_token, "eos_token": codec.eos_token, "chat_template": codec.chat_template}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return out


def _check_exportable(src: WeightSource) -> None:
    if src.scales is not None or len(src.patterns) != 1 or src.stack:
        how = "a quantised pair" if src.scales else "stacked" if src.stack else "concatenated"
        raise CheckpointError(f"`{src.weight}` (spec line {src.span.line}): its hf source is {how}; cannot export")
    for st in src.steps:
        if st.name not in ("transpose", "squeeze", "round") and STEPS[st.name].select is None:
            raise CheckpointError(f"`{src.weight}` (spec line {src.span.line}): step `{st}` cannot be undone")


def _undo(y: np.ndarray, src: WeightSource) -> np.ndarray:
    """The stored tensor whose steps give `y`: the steps undone, last first."""
    for st in reversed(src.steps):
        y = _undo_step(y, st, src)
    return y


def _undo_step(y: np.ndarray, st: Step, src: WeightSource) -> np.ndarray:
    if st.name == "round":
        return y
    if st.name == "transpose":
        return np.swapaxes(y, -1, -2)
    if st.name == "squeeze":
        return np.expand_dims(y, st.arg.get("dim", 0))
    sel = STEPS[st.name].select(y.shape, st.arg)  # a permutation keeps the axis' length
    if isinstance(sel, str):
        raise CheckpointError(f"`{src.weight}` (spec line {src.span.line}): step `{st}`: {sel}")
    d, idx = sel
    if len(idx) != y.shape[d] or not np.array_equal(np.sort(idx), np.arange(y.shape[d])):
        raise CheckpointError(f"`{src.weight}` (spec line {src.span.line}): step `{st}` drops values; cannot export")
    return np.take(y, np.argsort(idx), axis=d)
