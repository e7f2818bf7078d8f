"""Model drafters of speculative decoding, written in the language: a draft spec (a block drafter
such as Kimi K3's DSpark, `specs/kimi_k3_dspark.mk`) run on the host by its reference.

They implement the `Drafter` protocol of the speculative loop (`rows`, `context_layers`,
`start(prompt, context)`, `propose(anchor, position)`, `accept(tokens, context)`; context is the
target's hidden states [rows, len(context_layers), H] of the rows it accepted). The drafter's step
runs as the spec's unfused reference (jitted JAX on the host), not as a megakernel: `mkdsl check`
says which of its ops the kernel cannot lower yet (docs/language.md, "Drafters").
"""

from __future__ import annotations

import numpy as np

from mkdsl.lang.ir import Model

EMPTY = -1  # a slot or context row that holds no position
_STEPS: dict = {}  # id(spec) (or ("mtp", id)) -> (spec, its jitted reference): drafters of a spec share it


class DraftSpecError(ValueError):
    """A draft spec that does not pair with its target (vocabulary, width, context layers)."""


def _const(model: Model, name: str):
    return model.const.get(name)


def _vocab(model: Model):
    """The width of the step's logits."""
    from mkdsl.lang.elaborate import graph_value_type

    return graph_value_type(model.step, model.step.results[0]).shape[1]


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
    t_hidden, t_vocab = _const(target, "H"), _vocab(target)  # the width its layers' hidden states have (`H`)
    bad = [lay for lay in layers if lay >= len(target.schedule)]
    if bad:
        raise DraftSpecError(f"{draft.name} reads layers {bad} of {target.name}, which has {len(target.schedule)}")
    if t_hidden is not None and width != len(layers) * t_hidden:
        raise DraftSpecError(
            f"{draft.name}'s context is {width} wide, {len(layers)} layers of {target.name} make {len(layers) * t_hidden}"
        )
    if _vocab(draft) != t_vocab:
        raise DraftSpecError(f"{draft.name}'s vocabulary {_vocab(draft)} is not {target.name}'s {t_vocab}")


def empty_state(model: Model, rows: int, seq_len: int | None = None, names: set[str] | None = None) -> dict:
    """Zero caches, every slot, position and context row empty (-1), for `rows` rows and caches of
    `seq_len` tokens (default the longest); only the state tensors in `names` when given."""
    import ml_dtypes

    from mkdsl.run.random_params import concrete_shape

    sizes = {d.name: rows for d in model.dims[:1]} | {d.name: seq_len or d.high for d in model.dims[1:]}
    out = {}
    for t in model.tensors:
        if t.kind != "state" or (names is not None and t.name not in names):
            continue
        shape = concrete_shape(t.full_shape, sizes)
        dtype = ml_dtypes.bfloat16 if t.type.dtype.name == "bf16" else np.dtype(t.type.dtype.numpy)
        out[t.name] = np.zeros(shape, dtype) if t.type.dtype.float else np.full(shape, EMPTY, dtype)
    return out


class SpecDrafter:
    """A block drafter from a draft spec: each `propose` runs one drafter step over the block
    [anchor, MASK, ..., MASK] at positions anchor.., after writing the context rows the target
    accepted since (more than `rows` of them, as after the prompt, go in earlier steps whose block
    is discarded: the block's rows are causal, so nothing of it stays)."""

    draft_probs = None  # deterministic drafts (the speculative loop's protocol)

    def __init__(self, spec, weights: dict, rows: int, target: Model | None = None):
        from mkdsl.run.reference import build_reference

        model = spec.model
        check_pairing(model, target)
        lo, hi = spec.batch_range
        if not lo <= rows <= hi:
            raise DraftSpecError(f"{model.name}: {rows} rows is outside its `{model.dims[0].name}` range {lo}..{hi}")
        self.rows, self.spec, self.weights = rows, spec, weights
        self.ctx_name, self.pos_name, self.context_layers = model.context
        self.mask = int(_const(model, "MASK"))
        self._step = _STEPS.setdefault(id(spec), (spec, build_reference(model)))[1]  # one jit per spec
        self.state = self._empty_state()
        self.pending: list[tuple[int, np.ndarray]] = []  # (position, context row) not yet written
        self.next_pos = 0  # the position of the next context row
        self.drafts: list[int] = []

    def _empty_state(self) -> dict:
        return empty_state(self.spec.model, self.rows)

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
    from mkdsl.run.random_params import random_params

    model = spec.model
    sizes = {model.dims[0].name: model.dims[0].low, **{d.name: 1 for d in model.dims[1:]}}
    return random_params(model, sizes, seed)[0]


class MtpDrafter:
    """The target spec's `mtp` head, run R-1 times per step: draft k+1 is the argmax of the head's
    logits fed its own hidden state after draft k and draft k (the first: the target's hidden
    state of the token before the anchor, and the anchor). The head's cache holds a pair (hidden
    state of position i, token at i + 1) at position i + 1: the prompt's pairs after `start`, the
    accepted ones after `accept` (the pairs it wrote while drafting are overwritten there before
    they are read). Its context is the target's last layer's output (before the final norm)."""

    draft_probs = None  # deterministic drafts (the speculative loop's protocol)

    def __init__(self, spec, weights: dict, rows: int, seq_len: int | None = None):
        from mkdsl.run.reference import build_mtp_reference

        model = spec.model
        if model.mtp is None:
            raise DraftSpecError(f"{model.name} declares no `mtp` head: --draft mtp needs one")
        self.spec, self.weights, self.rows, self.seq_len = spec, weights, rows, seq_len
        self.context_layers = (len(model.schedule) - 1,)
        self._mtp = _STEPS.setdefault(("mtp", id(spec)), (spec, build_mtp_reference(model)))[1]
        reads = {r.name for n in model.mtp.nodes for r in n.inputs if r.kind == "tensor"}
        self.state_names = {t.name for t in model.tensors if t.kind == "state" and t.name in reads}
        self.state, self.last_h = self._empty_state(), None

    def _empty_state(self) -> dict:
        return empty_state(self.spec.model, 1, self.seq_len, self.state_names)

    def _run(self, h, token: int, position: int):
        h2, logits, self.state = self._mtp(
            self.weights,
            self.state,
            np.asarray(h, np.float32).reshape(1, -1),
            np.array([token], np.int32),
            np.array([position], np.int32),
        )
        return np.asarray(h2)[0], np.asarray(logits)[0]

    def _pairs(self, hidden, tokens: list[int], first: int) -> None:
        for i, t in enumerate(tokens):
            self._run(hidden[i], int(t), first + i)

    def start(self, prompt_tokens: list[int], context) -> None:
        hs = np.asarray(context, np.float32).reshape(len(prompt_tokens), -1)
        self.state, self.pos = self._empty_state(), len(prompt_tokens)
        self._pairs(hs, prompt_tokens[1:], 1)
        self.last_h = hs[-1]

    def propose(self, anchor_token: int, position: int) -> list[int]:
        h, tok, out = self.last_h, int(anchor_token), []
        for k in range(self.rows - 1):
            h, logits = self._run(h, tok, position + k)
            tok = int(np.argmax(logits))
            out.append(tok)
        self.pos = position
        return out

    def accept(self, tokens: list[int], context) -> None:
        """Context: the target's hidden states of the anchor and the kept drafts (one per token but
        the last, the next anchor)."""
        hs = np.asarray(context, np.float32).reshape(len(tokens), -1)
        self._pairs(hs, tokens[:-1], self.pos + 1)
        self.last_h = hs[-1]


def make_drafter(kind_or_spec, target_spec=None, weights: dict | None = None, rows: int = 8, seed=0, seq_len=None):
    """A model drafter: `mtp` (the target spec's `mtp` head, with the target's weights) or a loaded
    draft spec (`mkdsl.api.make_drafter` takes its path), paired with `target_spec` first. Without
    `weights` it gets random ones (seeded); `seq_len` sizes the MTP head's cache (default the
    spec's longest). The n-gram drafter lives with the speculative loop (mkdsl/run/drafters.py)."""
    if kind_or_spec == "mtp":
        if target_spec is None:
            raise DraftSpecError("--draft mtp: the target spec's `mtp` head needs the target spec")
        if target_spec.model.mtp is None:
            raise DraftSpecError(f"--draft mtp: {target_spec.model.name} declares no `mtp` head")
        if weights is None:
            weights = random_drafter_weights(target_spec, seed)
        return MtpDrafter(target_spec, weights, rows, seq_len)
    if isinstance(kind_or_spec, str):
        raise DraftSpecError(f"--draft {kind_or_spec}: expected mtp or a loaded draft spec here")
    spec, target = kind_or_spec, target_spec.model if target_spec is not None else None
    check_pairing(spec.model, target)
    return SpecDrafter(spec, weights if weights is not None else random_drafter_weights(spec, seed), rows, target)


def drafter_floor_us(model: Model, rows: int, context: int = 0) -> tuple[float, int]:
    """Modeled: a drafter's step at its HBM floor per device, (us, bytes), from its ops' costs on the
    per-device model (weights read, state read and written, caches at `context` tokens where an op
    charges by tokens), at the dense ring's measured rate. A drafter has no kernel yet, so this is
    the floor its step cannot beat, not a planned schedule (`mkdsl plan --draft` sets it beside the
    target's verify step)."""
    from mkdsl.lang.elaborate import graph_value_type
    from mkdsl.lang.ir import TensorType
    from mkdsl.ops import OPS, Cost
    from mkdsl.plan.cost_model import floor_bytes_per_s
    from mkdsl.plan.nodes import concrete, cost_attrs
    from mkdsl.spmd.shard import is_sharded, shard

    local = shard(model) if is_sharded(model) else model
    sizes = {d.name: rows for d in local.dims[:1]} | {d.name: context + 1 for d in local.dims[1:]}

    def typ(graph, ref) -> TensorType:
        if ref.kind == "tensor":
            return local.tensor(ref.name).type
        if ref.kind == "input":
            return next(v.type for v in local.inputs if v.name == ref.name)
        return graph_value_type(graph, ref)

    total = Cost()
    runs = {g.name: local.schedule.count(g.name) for g in local.kinds} | {local.step.name: 1}
    for graph in (*local.kinds, local.step):
        for node in graph.nodes:
            if node.op not in OPS:
                continue
            ins = [concrete(typ(graph, r), sizes) for r in node.inputs]
            outs = [concrete(v.type, sizes) for v in node.outputs]
            cost = OPS[node.op].cost(ins, outs, cost_attrs(node))
            total = total + Cost(cost.weight_bytes * runs[graph.name], cost.state_bytes * runs[graph.name])
    moved = total.weight_bytes + total.state_bytes
    return moved / floor_bytes_per_s() * 1e6, moved
