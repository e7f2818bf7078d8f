"""Model drafters of speculative decoding, written in the language: a draft spec (a block drafter
such as Kimi K3's DSpark, `specs/kimi_k3_dspark.mk`) run on the host by its reference.

They implement the `Drafter` protocol of the speculative loop (`rows`, `context_layers`,
`start(prompt, context)`, `propose(anchor, position)`, `accept(tokens, context)`; context is the
target's hidden states [rows, len(context_layers), H] of the rows it accepted). The drafter's step
runs as the spec's unfused reference (jitted JAX on the host), not as a megakernel: `mkdsl check`
says which of its ops the kernel cannot lower yet (docs/language.md, "Drafters").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mkdsl.lang.ir import Model

EMPTY = -1  # a slot or context row that holds no position
_STEPS: dict[int, tuple] = {}  # id(spec) -> (spec, its jitted reference step): drafters of a spec share it


class DraftSpecError(ValueError):
    """A draft spec that does not pair with its target (vocabulary, width, context layers)."""


def _const(model: Model, name: str):
    return model.const.get(name)


def check_pairing(draft: Model, target: Model | None) -> None:
    """A block drafter must declare its context and a mask token, and read layers the target has,
    with the target's width and vocabulary. Checked before any weight is drawn or loaded."""
    if draft.context is None:
        raise DraftSpecError(f"{draft.name}: a draft spec declares `context NAME from layers ...`")
    if _const(draft, "MASK") is None:
        raise DraftSpecError(f"{draft.name}: a block drafter declares `const MASK` (its mask token id)")
    if target is None:
        return
    name, _, layers = draft.context
    width = draft.tensor(name).type.shape[1]
    t_hidden, t_vocab = _const(target, "H"), _const(target, "V")
    bad = [lay for lay in layers if lay >= len(target.schedule)]
    if bad:
        raise DraftSpecError(f"{draft.name} reads layers {bad} of {target.name}, which has {len(target.schedule)}")
    if t_hidden is not None and width != len(layers) * t_hidden:
        raise DraftSpecError(
            f"{draft.name}'s context is {width} wide, {len(layers)} layers of {target.name} make {len(layers) * t_hidden}"
        )
    if t_vocab is not None and _const(draft, "V") != t_vocab:
        raise DraftSpecError(f"{draft.name}'s vocabulary {_const(draft, 'V')} is not {target.name}'s {t_vocab}")


class SpecDrafter:
    """A block drafter from a draft spec: each `propose` runs one drafter step over the block
    [anchor, MASK, ..., MASK] at positions anchor.., after writing the context rows the target
    accepted since (more than `rows` of them, as after the prompt, go in earlier steps whose block
    is discarded: the block's rows are causal, so nothing of it stays)."""

    def __init__(self, spec, weights: dict, rows: int, target: Model | None = None):
        from mkdsl.api import reference_step

        model = spec.model
        check_pairing(model, target)
        lo, hi = spec.batch_range
        if not lo <= rows <= hi:
            raise DraftSpecError(f"{model.name}: {rows} rows is outside its `{model.dims[0].name}` range {lo}..{hi}")
        self.rows, self.spec, self.weights = rows, spec, weights
        self.ctx_name, self.pos_name, self.context_layers = model.context
        self.mask = int(_const(model, "MASK"))
        self._step = _STEPS.setdefault(id(spec), (spec, reference_step(spec)))[1]  # one jit per spec
        self.state = self._empty_state()
        self.pending: list[tuple[int, np.ndarray]] = []  # (position, context row) not yet written
        self.next_pos = 0  # the position of the next context row
        self.drafts: list[int] = []

    def _empty_state(self) -> dict:
        """Caches of zeros, every slot and context row empty."""
        from mkdsl.run.random_params import concrete_shape

        m = self.spec.model
        sizes = {d.name: self.rows for d in m.dims[:1]} | {d.name: d.high for d in m.dims[1:]}
        out = {}
        for t in m.tensors:
            if t.kind != "state":
                continue
            shape = concrete_shape(t.full_shape, sizes)
            dtype = np.dtype(t.type.dtype.numpy) if t.type.dtype.name != "bf16" else None
            if dtype is None:
                import ml_dtypes

                dtype = ml_dtypes.bfloat16
            out[t.name] = np.full(shape, EMPTY, dtype) if not t.type.dtype.float else np.zeros(shape, dtype)
        return out

    def _queue(self, context) -> None:
        if context is None:
            raise DraftSpecError(
                f"{self.spec.model.name} reads the target's layers {self.context_layers}: no context given"
            )
        ctx = np.asarray(context, np.float32)
        ctx = ctx.reshape(ctx.shape[0], -1)
        for row in ctx:
            self.pending.append((self.next_pos, row))
            self.next_pos += 1

    def start(self, prompt_tokens: list[int], context) -> None:
        """Empty caches, then the prompt's context rows (one per prompt token) queued."""
        self.state, self.pending, self.next_pos = self._empty_state(), [], 0
        self._queue(context)
        if len(self.pending) != len(prompt_tokens):
            raise DraftSpecError(f"{len(prompt_tokens)} prompt tokens but {len(self.pending)} context rows")

    def _run(self, anchor: int, position: int, rows: list[tuple[int, np.ndarray]]):
        ctx = np.zeros(self.state[self.ctx_name].shape, np.float32)
        cpos = np.full((self.rows,), EMPTY, np.int32)
        for i, (p, row) in enumerate(rows):
            ctx[i], cpos[i] = row, p
        self.state[self.ctx_name], self.state[self.pos_name] = ctx.astype(self.state[self.ctx_name].dtype), cpos
        tokens = np.array([anchor] + [self.mask] * (self.rows - 1), np.int32)
        positions = np.arange(position, position + self.rows, dtype=np.int32)
        logits, drafts, new = self._step(self.weights, self.state, tokens, positions)
        self.state = {k: np.asarray(v) for k, v in new.items()}
        return np.asarray(drafts)

    def propose(self, anchor_token: int, position: int) -> list[int]:
        """R-1 drafts for positions position+1 .. position+R-1."""
        if any(p >= position for p, _ in self.pending):
            raise DraftSpecError(f"context rows at or after the anchor's position {position}")
        while len(self.pending) > self.rows:
            self._run(anchor_token, position, self.pending[: self.rows])
            self.pending = self.pending[self.rows :]
        drafts = self._run(anchor_token, position, self.pending)
        self.pending = []
        self.drafts = [int(t) for t in drafts[: self.rows - 1]]
        return self.drafts

    def accept(self, tokens: list[int], context) -> None:
        """The target's hidden states of the accepted rows (the anchor and the kept drafts: one
        fewer than `tokens`, whose last is the next anchor) queue for the next step."""
        self._queue(context)


def random_drafter_weights(spec, seed: int = 0) -> dict:
    """Well-scaled random weights of a draft spec (tests and smoke runs)."""
    from mkdsl.api import random_inputs

    return random_inputs(spec, batch=spec.batch_range[0], seq_len=1, seed=seed)[0]


def make_drafter(kind_or_path: str, target_spec=None, weights: dict | None = None, rows: int = 8, profile=None, seed=0):
    """A model drafter: a draft spec's path (`.mk`; `profile` picks its profile, default the
    target's). Without `weights` it gets random ones (seeded). The n-gram drafter lives with the
    speculative loop (mkdsl/run/drafters.py)."""
    from mkdsl.api import load

    if Path(kind_or_path).suffix != ".mk":
        raise DraftSpecError(f"--draft {kind_or_path}: expected a draft spec (.mk) here")
    target = target_spec.model if target_spec is not None else None
    spec = load(kind_or_path, profile if profile is not None else (target.profile if target else None))
    check_pairing(spec.model, target)
    return SpecDrafter(spec, weights if weights is not None else random_drafter_weights(spec, seed), rows, target)
