"""From a checkpoint file to a spec's weights: mappings (`mapping.py`, checked with the spec),
readers of safetensors and GGUF (`formats.py`), the loader (`loader.py`) and the tokenizer
(`tokenizer.py`). Nothing heavy is imported until a loader runs."""

from __future__ import annotations


def load_weights(*args, **kwargs):
    """See `mkdsl.checkpoint.loader.load_weights`."""
    from mkdsl.checkpoint.loader import load_weights as load

    return load(*args, **kwargs)


def export_hf(*args, **kwargs):
    """See `mkdsl.checkpoint.export.export_hf`: a GGUF written out as a Hugging Face checkpoint."""
    from mkdsl.checkpoint.export import export_hf as export

    return export(*args, **kwargs)
