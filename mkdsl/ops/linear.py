"""Matrix ops: embedding gather and linear layers over bf16, fp8 or quantised weights."""

from __future__ import annotations

from mkdsl.lang.dtypes import F32
from mkdsl.lang.ir import TensorType
from mkdsl.lang.quant import QTensor, dequantize
from mkdsl.lazy import jnp
from mkdsl.ops.prefill import device_index
from mkdsl.ops.registry import (
    Cost,
    OpDef,
    OpError,
    expect_dtype,
    expect_float,
    expect_rank,
    nbytes,
    register,
)


def weight_f32(w):
    """A weight operand as f32: decoded if quantised, upcast otherwise (exact either way)."""
    return dequantize(w) if isinstance(w, QTensor) else w.astype(jnp.float32)


def linear(x, w, transposed=False, input="bf16"):
    """bf16(x) @ w (or @ w.T) with f32 accumulation: the MXU's contract for every weight format.
    `input="f32"` keeps x in f32 (routers the reference implementations compute in f32)."""
    xb = x.astype(jnp.float32) if input == "f32" else x.astype(jnp.bfloat16).astype(jnp.float32)
    wf = weight_f32(w)
    return jnp.dot(xb, wf.T if transposed else wf, precision="highest")


def _linear_infer(args, attrs):
    x, w = args
    expect_rank(x, 2, 0, "the input")
    expect_float(x, 0)
    if w.kind != "tensor" or w.is_state:
        raise OpError(f"the second operand of linear must be a declared weight, not `{w.name}`", 1)
    expect_rank(w, 2, 1, "the weight")
    if not isinstance(attrs["transposed"], bool):
        raise OpError("`transposed` must be true or false", "transposed")
    given = attrs.get("input", "bf16")  # shape rules may be asked without the defaults filled in
    if given not in ("bf16", "f32"):
        raise OpError(f'input must be "bf16" (rounded, the MXU default) or "f32", got {given!r}', "input")
    if attrs["transposed"] and w.type.dtype.quantised:
        raise OpError(f"a transposed weight must not be quantised, but `{w.name}` is {w.type.dtype}", 1)
    n, k = w.type.shape if attrs["transposed"] else reversed(w.type.shape)
    if x.type.shape[1] != k:
        what = (
            "input columns (it is stored [out, in], transposed)"
            if attrs["transposed"]
            else "input rows (weights are stored [in, out])"
        )
        raise OpError(f"`{x.name}` has {x.type.shape[1]} columns but weight `{w.name}` has {k} {what}", 1)
    return (TensorType(F32, (x.type.shape[0], n)),)


# ASSUMPTION (an estimate, not measured): vector-unit operations per weight of decoding a tile in
# VMEM, counted from the kernel's decoders (runtime/decode.py.jinja, gguf.py.jinja): unpacking
# nibbles (~2), bits above them (q5_k/q6_k ~5), conversions (1 each), scale and min (1 each),
# splitting an exact f32 value into bf16 parts (2 parts ~4, 3 parts ~7). Plain bf16 costs none;
# the cost model charges these at the vector unit's width where libtpu's schedule of the op was
# not read (plan/timeline.py `node_vector_us`, the `vector_estimate` assumption).
DECODE_OPS_PER_WEIGHT = {
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
    "mxfp4": 3,
    "nvfp4": 3,
    "int4": 8,
    "q8_0": 11,
    "q4_0": 14,
    "q4_1": 14,
    "q4_k": 15,
    "q5_k": 20,
    "q6_k": 21,
}


def decode_ops(dtype) -> int:
    """The estimate above for one weight of `dtype` (int4 with f32 scales: three bf16 parts, 11)."""
    if dtype.name == "int4" and dtype.scale == "float32":
        return 11
    return DECODE_OPS_PER_WEIGHT.get(dtype.name, 0)


def _linear_cost(ins, outs, attrs):
    x, w = ins
    k, n = w.shape
    passes = 3 if attrs.get("input") == "f32" else 1  # an f32 input is three bf16 parts on the MXU
    return Cost(weight_bytes=nbytes(w), flops=2 * x.shape[0] * k * n * passes, decode=k * n * decode_ops(w.dtype))


register(
    OpDef(
        "linear",
        ("x", "weight"),
        _linear_infer,
        lambda x, w, transposed=False, input="bf16": (linear(x, w, transposed, input),),
        _linear_cost,
        attrs={"transposed": False, "input": "bf16"},
        doc="x @ weight (weight.T if transposed: a tied head over the [V, H] embedding), f32 out; "
        'x is rounded to bf16 (kept f32 with input="f32"), weights of any format are decoded exactly.',
        shard="matmul",
        reach=(("weight", "stream"),),
    )
)


def _embedding_infer(args, attrs):
    tokens, table = args
    expect_dtype(tokens, ("i32",), 0)
    expect_rank(tokens, 1, 0, "the token ids")
    expect_rank(table, 2, 1, "the embedding table")
    if table.type.dtype.quantised:
        raise OpError(f"embedding table `{table.name}` must not be quantised", 1)
    return (TensorType(F32, (tokens.type.shape[0], table.type.shape[1])),)


def _embedding_cost(ins, outs, attrs):
    tokens, table = ins
    row = nbytes(TensorType(table.dtype, (1, table.shape[1])))
    return Cost(weight_bytes=tokens.shape[0] * row)


def _embedding_spmd(rows, arrays, attrs):
    """A vocabulary-split table: this device's rows, zeros for tokens another device holds (summed after)."""
    if not attrs.get("shard_axes"):
        return None
    tok, table = arrays
    lo = device_index(attrs["shard_axes"]) * table.shape[0]
    mine = (tok >= lo) & (tok < lo + table.shape[0])
    picked = jnp.asarray(table)[jnp.clip(tok - lo, 0, table.shape[0] - 1)].astype(jnp.float32)
    return (jnp.where(mine[:, None], picked, 0.0),)


register(
    OpDef(
        "embedding",
        ("tokens", "table"),
        _embedding_infer,
        lambda t, table: (jnp.take(table, t, axis=0).astype(jnp.float32),),
        _embedding_cost,
        doc="Rows of `table` gathered by token id, as f32.",
        shard="vocab_rows",
        reach=(("table", "own"),),
        spmd_prefill=_embedding_spmd,
    )
)
