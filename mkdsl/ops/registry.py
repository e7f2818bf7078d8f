"""The op registry: what mkdsl knows about an op, apart from its TPU lowering, is one `OpDef`.

An op declares its operands and attributes, a shape rule, a plain-jnp reference, its cost and
the traits later stages ask of it (how it shards, how its weights are reached, ...). Adding an
elementwise op means writing one `OpDef` in one module of this package; a structured op also
has a TPU lowering in mkdsl/backends/tpu/lowerings/.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from mkdsl.lang.dtypes import DType
from mkdsl.lang.ir import TensorType

REQUIRED = object()


class OpError(Exception):
    """A shape/dtype rule failed; `arg` is the operand index (or attribute name) to blame."""

    def __init__(self, message: str, arg: int | str | None = None, hint: str | None = None):
        super().__init__(message)
        self.arg = arg
        self.hint = hint


@dataclass(frozen=True)
class Operand:
    """What the shape rule sees of one operand."""

    type: TensorType
    kind: str  # "value" | "tensor" | "input"
    name: str
    is_state: bool = False


@dataclass(frozen=True)
class Cost:
    """HBM traffic an op cannot avoid in a fused kernel, and its arithmetic.

    Activations live in VMEM inside the megakernel, so only declared tensors count: weight
    bytes read (storage bytes, scales included) and state bytes read plus written.
    """

    weight_bytes: int = 0
    state_bytes: int = 0
    flops: int = 0
    decode: int = 0  # vector-unit element operations of decoding its quantised weights (an estimate the op states)

    def __add__(self, other: Cost) -> Cost:
        return Cost(
            self.weight_bytes + other.weight_bytes,
            self.state_bytes + other.state_bytes,
            self.flops + other.flops,
            self.decode + other.decode,
        )


@dataclass(frozen=True)
class OpDef:
    name: str
    operands: tuple[str, ...]
    infer: Callable[..., tuple[TensorType, ...]]  # (operands, attrs) -> output types
    reference: Callable  # (*arrays, **attrs) -> outputs (+ new values of `inout` operands)
    cost: Callable[..., Cost]  # (operand types, output types, attrs), all dims concrete;
    # for a state operand the type's sequence dims hold the tokens actually read
    attrs: dict[str, object] = field(default_factory=dict)  # name -> default or REQUIRED
    inout: tuple[str, ...] = ()  # operands that must be state tensors; updated in place
    outputs: int = 1
    doc: str = ""
    # TPU lowering of an elementwise op: a jnp expression over `{operand}` values (f32 arrays)
    # and `{attr}` literals. Ops with more structure have a Lowering in backends/tpu/lowerings/.
    kernel_expr: str | None = None
    internal: bool = False  # inserted by the compiler; specs cannot call it
    # ---- traits: what later stages ask of the op instead of keeping lists of op names
    # The shard pass's rule family (mkdsl/spmd/shard.py RULES): "elementwise", "sum" (elementwise that
    # may add partial sums), "broadcast", "broadcast_sum" (binary arithmetic that broadcasts a
    # [N] or [B, 1] operand), "row_sum" (a split row sums to a partial sum), "whole", "norm",
    # "channels", "heads", "kv_heads", "key_heads", "block_heads", "markov", "latent_attention",
    # "matmul", "vocab_rows", "pick", "any", "experts"; "" = no sharding rule yet.
    shard: str = ""
    # How each weight operand is reached: "stream" (tiles through the weight ring) or "own" (the op's
    # lowering moves it itself). Weight operands not named here are fetched per layer.
    reach: tuple[tuple[str, str], ...] = ()
    traffic_group: str = ""  # bytes-per-step group of its weights ("" = the block it was inlined from)
    attends: bool = False  # its block counts as attention in the bytes-per-step split
    data_dependent: bool = False  # its first DMA waits for data computed in the same layer
    # The measured per-op latency the cost model charges it (plan/cost_model.py LATENCIES):
    # "cached_tokens" (decode attention, per 250 cached tokens per row) or "routing" (a top-k).
    latency: str = ""
    # What one iteration of its hot loop waits for, to match libtpu's loops to it
    # (plan/static_costs.py UNITS): "kv_tiles", "latent_tiles" or "expert_tiles".
    loop_unit: str = ""
    # A verify step's R rows of a sequence (speculative decoding) run its state in series: row r
    # reads the state row r - 1 wrote to HBM (the recurrent rules keep a state per row), so the
    # cost model charges its state stream after its compute, not under it (plan/timeline.py).
    rows_in_series: bool = False
    in_place: tuple[tuple[int, int], ...] = ()  # (output, operand) pairs that may share a buffer
    # devices exchange its value: "sum", "gather", "best" (an argmax), "scatter" (a reduce-scatter)
    # or "scaled" (an all-reduce with a deferred norm's row scale, mkdsl/spmd/defer_norm.py)
    exchange: str = ""
    exchange_axes: str = "axes"  # the attribute holding the mesh axes of the exchange
    # Attributes that name a spec block of elementwise ops (an `ir.BlockAttr`): attribute -> the
    # types of the block's parameters, from the op's operands (the block returns the first's type).
    block_attrs: tuple[tuple[str, Callable[[list[Operand]], tuple[TensorType, ...]]], ...] = ()
    # Attribute values that mean "not given" (the default, None), so that a block's constant
    # parameter can switch an optional feature off: attention's `window=0` is no window.
    unset: tuple[tuple[str, object], ...] = ()
    # The op written as simpler ops (the same function), for the shard pass where an op over whole
    # rows meets a row split over devices: `(node) -> nodes` whose last output is the node's.
    # RMSNorm of a split row: each device sums its squares, and the sum's all-reduce follows.
    row_split: Callable | None = None
    optional: int = 0  # how many trailing operands a call may leave out (e.g. the expert biases)
    # Prefill over a whole prompt (mkdsl/ops/prefill.py): `(rows, *arrays, **attrs)` -> as
    # `reference`; None runs `reference` over the prompt's B*T rows (row-wise ops). Required
    # for ops with `inout` state.
    prefill: Callable | None = None
    # Prefill of the per-device model under `shard_map` (mkdsl/run/prefill_spmd.py): `(rows, arrays,
    # attrs)` -> outputs, or None where the op runs as on one device. The collectives exchange over
    # the mesh; ops that index over a split (vocabulary rows, experts) take their device's part.
    spmd_prefill: Callable | None = None
    # Near ties of a discrete choice (mkdsl/verify/kernel.py): `(row, margin) -> reference` gives a
    # reference that takes the runner-up for `row` where its margin is below `margin`, and calls
    # `flipped()` when it did; None: the op makes no discrete choice that rounding can tip.
    near_tie: Callable | None = None
    # The trailing axes of an `inout` state that one update writes as a whole: the unit whose largest
    # entry scales the kernel check's state bound (mkdsl/verify/kernel.py). 1: each vector alone.
    state_unit: int = 1
    # What a plain residual stream (`x + block(x)`, as transformers' models add) has in the place of
    # each output: the operand it equals there (mkdsl/verify/plain_residual.py). () for every op but
    # a residual-stream op that such a model lacks (Kimi K3's attention residuals).
    plain_residual: tuple[str, ...] = ()

    def reached(self, operand: str) -> str:
        """How the kernel reaches a weight (or state) operand: "stream", "own" or "fetch"."""
        return dict(self.reach).get(operand, "fetch")


OPS: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    assert op.name not in OPS, op.name
    OPS[op.name] = op
    return op


# ---------------------------------------------------------------- helpers for shape rules


def expect_rank(x: Operand, rank: int, i: int, what: str) -> None:
    if len(x.type.shape) != rank:
        raise OpError(f"{what} must have rank {rank}, but `{x.name}` is {x.type}", i)


def expect_float(x: Operand, i: int) -> None:
    if not x.type.dtype.float:
        raise OpError(f"expected a floating-point tensor, but `{x.name}` is {x.type}", i)


def expect_dtype(x: Operand, names: tuple[str, ...], i: int) -> None:
    if x.type.dtype.name not in names:
        allowed = ", ".join(names)
        raise OpError(f"`{x.name}` has dtype {x.type.dtype}, expected one of: {allowed}", i)


def expect_divides(total, part: int, what: str, arg) -> int:
    if isinstance(total, int) and (part <= 0 or total % part):
        raise OpError(f"{what}: {total} is not divisible by {part}", arg)
    return total // part if isinstance(total, int) else total


def numel(t: TensorType) -> int:
    return math.prod(t.shape)


def nbytes(t: TensorType) -> int:
    from mkdsl.lang.dtypes import storage_bytes

    return storage_bytes(t.dtype, t.shape)


def act(dtype: DType, *shape) -> TensorType:
    return TensorType(dtype, tuple(shape))
