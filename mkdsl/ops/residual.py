"""Block attention residuals (Kimi K3): the residual stream as snapshotted blocks plus a prefix.

Instead of `x + f(x)`, the stream is carried as two activations:

* `blocks` f32 [B, NB·H]: NB equal blocks of width H side by side. Block 0 is the embedding;
  block j (j >= 1) is the snapshot taken at layer j·block, holding the sum of the outputs of
  layers (j-1)·block .. j·block-1. Blocks not yet written are zero and never mixed.
* `prefix` f32 [B, H]: the running sum of layer outputs since the last snapshot.

Every sublayer input is a softmax-weighted mix of the valid entries,

    mix(V; w) = Σ_i softmax_i( (v_i·w) · rsqrt(mean(v_i²) + eps) ) · v_i,

in f32 (w is the residual-norm weight times the residual-projection weight, one vector per
use). With `block` layers per residual block and L layers, a decode step composes as

    blocks, prefix = res_init(embedding, nblocks=1 + (L-1) // block)
    for l in range(L):
        h = res_mix(blocks, prefix, attn_res_w[l], layer=l, block=block)
        blocks, prefix = res_snapshot(blocks, prefix, layer=l, block=block)
        prefix = prefix + attn(rmsnorm(h, input_norm))
        m = res_mix(blocks, prefix, mlp_res_w[l], layer=l, block=block, after_snapshot=True)
        prefix = prefix + mlp(rmsnorm(m, post_attention_norm))
    out = res_mix(blocks, prefix, output_res_w, layer=L-1, block=block, after_snapshot=True)

which is facts/kimi_k3.md's layer: `h = mix(attn_res[l])`; if `l % block == 0` (l > 0) the
prefix becomes a new block and restarts, so `prefix = a` there and `prefix + a` elsewhere;
`prefix += MLP(rms(mix(mlp_res[l])))`. Which entries are valid follows from the layer alone:

* attention input (before the snapshot): blocks 0 .. (l-1) // block, plus the prefix if l > 0
  (at l = 0 only the embedding is mixed, so h is the embedding itself);
* MLP input and the final output (after the snapshot): blocks 0 .. l // block, plus the prefix
  (which then holds at least this layer's attention output).

Layer 0 is never a snapshot: block 0 is the embedding, so L layers need 1 + (L-1) // block
blocks (8 for Kimi K3's 93 layers with block 12).
"""

from __future__ import annotations

from mkdsl.lang.dtypes import F32
from mkdsl.lang.ir import TensorType
from mkdsl.lazy import jax, jnp
from mkdsl.ops.registry import (
    REQUIRED,
    Cost,
    OpDef,
    OpError,
    expect_float,
    expect_rank,
    nbytes,
    register,
)


def _int_attr(attrs, name: str, low: int) -> int:
    v = attrs[name]
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise OpError(f"{name} must be an integer >= {low}, got {v!r}", name)
    return v


def mixed_entries(layer: int, block: int, after_snapshot: bool) -> tuple[int, bool]:
    """(number of leading blocks mixed, whether the prefix is mixed) at this layer's
    attention input (before the snapshot) or MLP input (after it)."""
    if after_snapshot:
        return 1 + layer // block, True
    if layer == 0:
        return 1, False
    return 1 + (layer - 1) // block, True


def _stream(args, attrs):
    """Check blocks [B, NB·H] and prefix [B, H]; return (B, NB, H) (NB None if H is symbolic)."""
    blocks, prefix = args[0], args[1]
    expect_rank(blocks, 2, 0, "the residual blocks [B, NB·H]")
    expect_float(blocks, 0)
    expect_rank(prefix, 2, 1, "the residual prefix [B, H]")
    expect_float(prefix, 1)
    b, width = blocks.type.shape
    pb, h = prefix.type.shape
    if pb != b:
        raise OpError(f"prefix `{prefix.name}` has {pb} rows but blocks `{blocks.name}` have {b}", 1)
    if not (isinstance(width, int) and isinstance(h, int)):
        return b, None, h
    if h <= 0 or width <= 0 or width % h:
        raise OpError(
            f"blocks `{blocks.name}` are {width} wide, which is not a whole number of blocks of the prefix width {h}",
            0,
            "the stream is blocks [B, nblocks·H] and prefix [B, H], as res_init makes them",
        )
    return b, width // h, h


# ---------------------------------------------------------------- res_init


def res_init(x, nblocks):
    """(blocks with x in block 0 and zeros elsewhere, zero prefix), f32."""
    x = x.astype(jnp.float32)
    rest = jnp.zeros((x.shape[0], (nblocks - 1) * x.shape[1]), jnp.float32)
    return jnp.concatenate([x, rest], axis=1), jnp.zeros_like(x)


def _res_init_infer(args, attrs):
    (x,) = args
    expect_rank(x, 2, 0, "the embedding")
    expect_float(x, 0)
    nblocks = _int_attr(attrs, "nblocks", 1)
    b, h = x.type.shape
    if not isinstance(h, int):
        raise OpError(f"the embedding width must be a constant, but `{x.name}` is {x.type}", 0)
    return TensorType(F32, (b, nblocks * h)), TensorType(F32, (b, h))


register(
    OpDef(
        "res_init",
        ("x",),
        _res_init_infer,
        res_init,
        lambda ins, outs, a: Cost(),
        attrs={"nblocks": REQUIRED},
        outputs=2,
        doc="Start the block residual stream: (blocks [B, nblocks·H] with x in block 0, zero prefix [B, H]).",
        shard="whole",
        plain_residual=("x", "x"),  # the stream starts at the embedding
    )
)


# ---------------------------------------------------------------- res_mix


def res_mix(blocks, prefix, w, layer, block, after_snapshot=False, eps=1e-5):
    """Softmax over the valid entries of (v_i·w)·rsqrt(mean(v_i²)+eps), then Σ_i p_i·v_i; f32."""
    prefix = prefix.astype(jnp.float32)
    h = prefix.shape[1]
    n, with_prefix = mixed_entries(layer, block, after_snapshot)
    entries = blocks.astype(jnp.float32)[:, : n * h].reshape(blocks.shape[0], n, h)
    if with_prefix:
        entries = jnp.concatenate([entries, prefix[:, None, :]], axis=1)
    wf = w.astype(jnp.float32)
    logits = jnp.sum(entries * wf, axis=-1) * jax.lax.rsqrt(jnp.mean(entries * entries, axis=-1) + eps)
    p = jax.nn.softmax(logits, axis=-1)
    return jnp.sum(p[..., None] * entries, axis=1)


def _res_mix_infer(args, attrs):
    b, nb, h = _stream(args, attrs)
    w = args[2]
    if w.kind != "tensor" or w.is_state:
        raise OpError(f"the mixing weight must be a declared weight, not `{w.name}`", 2)
    expect_rank(w, 1, 2, "the mixing weight [H]")
    expect_float(w, 2)
    if w.type.dtype.quantised:
        raise OpError(f"the mixing weight `{w.name}` must not be quantised, but it is {w.type}", 2)
    if w.type.shape[0] != h:
        raise OpError(f"mixing weight `{w.name}` has {w.type.shape[0]} elements but the prefix is {h} wide", 2)
    layer, block = _int_attr(attrs, "layer", 0), _int_attr(attrs, "block", 1)
    if not isinstance(attrs["after_snapshot"], bool):
        raise OpError(f"after_snapshot must be true or false, got {attrs['after_snapshot']!r}", "after_snapshot")
    n, _ = mixed_entries(layer, block, attrs["after_snapshot"])
    if nb is not None and n > nb:
        raise OpError(
            f"layer {layer} with block={block} mixes {n} blocks, but `{args[0].name}` holds only {nb}",
            "layer",
            f"res_init needs nblocks >= {n}",
        )
    return (TensorType(F32, (b, h)),)


def _res_mix_cost(ins, outs, attrs):
    blocks, prefix, w = ins
    n, with_prefix = mixed_entries(attrs["layer"], attrs["block"], attrs["after_snapshot"])
    # per entry element: square and sum 2, dot with w 2, weighted sum 2
    return Cost(weight_bytes=nbytes(w), flops=6 * (n + with_prefix) * prefix.shape[0] * prefix.shape[1])


register(
    OpDef(
        "res_mix",
        ("blocks", "prefix", "w"),
        _res_mix_infer,
        lambda blocks, prefix, w, **a: (res_mix(blocks, prefix, w, **a),),
        _res_mix_cost,
        attrs={"layer": REQUIRED, "block": REQUIRED, "after_snapshot": False, "eps": 1e-5},
        doc="Attention-residual mix of the blocks valid at `layer` (and the prefix): "
        "Σ softmax((v·w)·rsqrt(mean(v²)+eps))·v, f32; after_snapshot selects the MLP input.",
        shard="whole",
        plain_residual=("prefix",),  # the stream itself
    )
)


# ---------------------------------------------------------------- res_snapshot


def res_snapshot(blocks, prefix, layer, block):
    """At layer % block == 0 (layer > 0): block layer // block := prefix, prefix := 0."""
    blocks, prefix = jnp.asarray(blocks, jnp.float32), jnp.asarray(prefix, jnp.float32)
    if layer == 0 or layer % block:
        return blocks, prefix
    h = prefix.shape[1]
    j = layer // block
    blocks = blocks.at[:, j * h : (j + 1) * h].set(prefix)
    return blocks, jnp.zeros_like(prefix)


def _res_snapshot_infer(args, attrs):
    b, nb, h = _stream(args, attrs)
    layer, block = _int_attr(attrs, "layer", 0), _int_attr(attrs, "block", 1)
    if layer > 0 and layer % block == 0 and nb is not None and layer // block >= nb:
        raise OpError(
            f"layer {layer} with block={block} writes block {layer // block}, but `{args[0].name}` "
            f"holds only {nb} blocks",
            "layer",
            f"res_init needs nblocks >= {layer // block + 1}",
        )
    return TensorType(F32, args[0].type.shape), TensorType(F32, args[1].type.shape)


register(
    OpDef(
        "res_snapshot",
        ("blocks", "prefix"),
        _res_snapshot_infer,
        res_snapshot,
        lambda ins, outs, a: Cost(),
        attrs={"layer": REQUIRED, "block": REQUIRED},
        outputs=2,
        doc="At a residual-block boundary (layer % block == 0, layer > 0) store the prefix as block "
        "layer // block and restart the prefix at zero; otherwise pass both through.",
        shard="whole",
        in_place=((0, 0), (1, 1)),
        plain_residual=("blocks", "prefix"),  # no block boundary: the stream runs on
    )
)
