"""`| stored`: a weight that keeps the checkpoint's GGUF block format (Q8_0, Q4_0, Q4_1, Q4_K,
Q5_K, Q6_K).

The kernel's layout depends on each weight's dtype, so the spec is retyped for the file before it
is compiled: the declaration `weight wq: bf16[...]` becomes `weight wq: q4_1[...]` where every
stored tensor of `wq` is Q4_1, and the loader then moves the file's blocks into the kernel's
storage bit for bit (`pairs.BLOCKS`). Weights stored in anything else keep their declared dtype.
"""

from __future__ import annotations

import itertools
import re

from mkdsl.checkpoint.gguf_blocks import KEPT
from mkdsl.lang.dtypes import GGUF
from mkdsl.lang.ir import Model


def stored_formats(model: Model, reader) -> dict[str, str]:
    """Weight -> the GGUF dtype (`dtypes.GGUF`) it keeps from `reader`'s file: every stored tensor
    of a `| stored` entry in one format mkdsl keeps (and K a multiple of what it needs); weights already of that dtype are left out."""
    ckpt = next((c for c in model.checkpoints if c.format == reader.format), None)
    out: dict[str, str] = {}
    for src in ckpt.sources if ckpt is not None else ():
        t = model.tensor(src.weight)
        if not src.keeps or t.type.dtype.quantised or len(t.type.shape) - len(src.stack) != 2:
            continue
        layers = [i for i, s in enumerate(t.slots) if s >= 0] if t.stacked else [None]
        lead = [range(n) for n in t.type.shape[: len(src.stack)]]
        kinds = set()
        for layer, idx in itertools.product(layers, itertools.product(*lead)):
            info = reader.info(src.names(layer, idx)[0])
            kinds.add(info.dtype if info is not None else None)
        kind = kinds.pop() if len(kinds) == 1 else None
        # a K the format cannot hold (Q6_K's pairs of super-blocks) rounds, as `stored` says
        if kind in KEPT and t.type.shape[-2] % GGUF[KEPT[kind]].dtype.k_multiple() == 0:
            out[src.weight] = KEPT[kind]
    return out


def retype(source: str, model: Model, formats: dict[str, str]) -> str:
    """The spec's text with each weight of `formats` declared in its stored format."""
    lines = source.splitlines(keepends=True)
    for name, fmt in formats.items():
        i = model.tensor(name).span.line - 1
        lines[i] = re.sub(rf"(\bweight\s+{re.escape(name)}\s*:\s*)[A-Za-z_]\w*", rf"\g<1>{fmt}", lines[i], count=1)
    return "".join(lines)
