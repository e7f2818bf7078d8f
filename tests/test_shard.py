"""The shard pass (mkdsl/shard.py): what each device runs, checked three ways.

1. Structure: the Kimi K3 layout of the spec (32 devices: 8-way expert parallel x 4-way inside each
   expert; heads, columns and vocabulary split 32 ways) gives the published per-device shapes and the
   collectives the design calls for, in the places it calls for them.
2. Numerics without a kernel: the per-device models are evaluated in lockstep, one per simulated
   device, each op by its reference on the device's slices of the weights, the collectives done
   across the devices here in numpy (sum / concatenate / slice). The result must match the unfused
   single-device reference: this proves the placement rules and the inserted collectives, with the
   kernel out of the picture (tests/test_kimi_kernel.py runs the generated kernel itself).
3. Diagnostics: shardings that do not agree where tensors meet name the op, the tensor and the axes.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from mkdsl.diagnostics import SpecError
from mkdsl.elaborate import elaborate
from mkdsl.ir import LayerExpr, Model, Ref
from mkdsl.ops import OPS
from mkdsl.quant import QTensor
from mkdsl.random_params import random_params
from mkdsl.reference import build_reference
from mkdsl.shard import shard
from mkdsl.syntax import parse

ROOT = Path(__file__).resolve().parent.parent
KIMI = (ROOT / "specs" / "kimi_k3.mk").read_text(encoding="utf-8")
LLAMA = (ROOT / "specs" / "llama3_8b.mk").read_text(encoding="utf-8")


def load(text: str, profile: str | None) -> Model:
    return elaborate(parse(text), profile, text)


def collectives(g) -> list[tuple]:
    out = []
    for n in g.nodes:
        if n.op in ("all_reduce", "all_gather", "shard_slice"):
            out.append((n.op, n.attr["axes"]))
        elif n.attr.get("shard_axes") or n.attr.get("expert_axes"):
            out.append((n.op, n.attr.get("shard_axes") or n.attr.get("expert_axes")))
    return out


# ---------------------------------------------------------------------------- 1. structure


def test_kimi_k3_per_device_shapes_follow_the_published_layout():
    local = shard(load(KIMI, None))
    shape = {t.name: t.type.shape for t in local.tensors}
    assert dict(local.mesh) == {"ep": 8, "tp": 4}
    assert shape["kda_wq"] == (7168, 3 * 128)  # 3 heads per device
    assert shape["kda_state"] == ("B", 3, 128, 128)
    assert shape["mla_wkvb"] == (512, 3 * 256)
    assert shape["moe_w1"] == (112, 3584, 768)  # 112 local experts, 768 of the 3072 columns each
    assert shape["moe_w2"] == (112, 768, 3584)
    assert shape["lm_head"] == (7168, 5120) and shape["embed"] == (5120, 7168)  # vocabulary 5120 per device
    assert shape["shared_gate"] == (7168, 256)  # 6144 columns padded to 8192, 256 per device
    assert shape["mla_cache"] == ("B", "S", 576)  # the latent cache is shared by all heads: whole
    heads = {n.op: n.attr["heads"] for k in local.kinds for n in k.nodes if "heads" in n.attr and n.attr["heads"] > 1}
    assert heads == {"l2norm": 3, "kda_gate": 3, "delta_rule": 3, "rmsnorm": 3, "mla_attention": 3}


def test_kimi_k3_collectives_are_where_the_design_puts_them():
    local = shard(load(KIMI, None))
    both = ("ep", "tp")
    moe = [
        ("all_gather", ("ep",)),  # router scores: columns split over the expert-parallel groups
        ("all_gather", ("tp",)),  # the latent activation
        ("moe_experts", ("ep",)),  # each device runs the chosen experts it holds
        ("all_reduce", both),  # expert outputs: partial over experts and columns
        ("shard_slice", both),  # this device's rows of the row-parallel latent up-projection
        ("all_reduce", both),  # up-projection + shared experts, one all-reduce for both
    ]
    assert collectives(local.kind("kda_moe")) == [("all_reduce", both), *moe]  # after the KDA output projection
    assert collectives(local.kind("mla_moe")) == [("all_reduce", both), *moe]  # after the MLA output projection
    assert collectives(local.kind("kda_dense")) == [("all_reduce", both), ("all_reduce", both)]
    assert collectives(local.step) == [("embedding", both), ("all_reduce", both), ("argmax", both)]


def test_one_device_mesh_is_the_model_itself():
    model = load(KIMI, "core")
    assert shard(model) is model
    model = load(LLAMA, None)
    assert shard(model) is model


# ---------------------------------------------------------------------------- 2. lockstep numerics


def shard_index(coords: dict[str, int], mesh: dict[str, int], axes) -> int:
    i = 0
    for a in axes:
        i = i * mesh[a] + coords[a]
    return i


def local_slice(array, split, coords, mesh):
    """This device's block of a global array (split: mesh axes per dimension, () for whole)."""
    if isinstance(array, QTensor):
        return QTensor(
            local_slice(array.codes, split, coords, mesh),
            local_slice(array.scales, split, coords, mesh),
            array.fmt,
            array.group,
        )
    index = []
    for dim, axes in enumerate(split):
        if not axes:
            index.append(slice(None))
            continue
        size = array.shape[dim] // math.prod(mesh[a] for a in axes)
        i = shard_index(coords, mesh, axes)
        index.append(slice(i * size, (i + 1) * size))
    return array[tuple(index)]


def run_lockstep(local: Model, weights, state, tokens, positions):
    """Every device's per-device model, one op at a time across all devices."""
    mesh = dict(local.mesh)
    names = list(mesh)
    devices = [
        dict(zip(names, np.unravel_index(d, [mesh[a] for a in names]), strict=True))
        for d in range(math.prod(mesh.values()))
    ]
    devices = [{a: int(c) for a, c in dev.items()} for dev in devices]

    def split_of(t):
        return ((),) * t.stacked + tuple(t.sharding)

    w = [{t.name: local_slice(weights[t.name], split_of(t), dev, mesh) for t in local.weights} for dev in devices]
    st = [
        {t.name: jnp.asarray(local_slice(state[t.name], split_of(t), dev, mesh)) for t in local.states}
        for dev in devices
    ]
    inputs = dict(zip([v.name for v in local.inputs], (tokens, positions), strict=True))

    def group(d, axes):
        """Devices sharing d's coordinates off `axes`, ordered by their index over `axes`."""
        same = [e for e, dev in enumerate(devices) if all(dev[a] == devices[d][a] for a in names if a not in axes)]
        return sorted(same, key=lambda e: shard_index(devices[e], mesh, axes))

    def run_graph(g, carries, layer):
        env = [{v.name: c for v, c in zip(g.params, cs, strict=True)} for cs in carries]

        def read(d, ref: Ref):
            if ref.kind == "value":
                return env[d][ref.name]
            if ref.kind == "input":
                return inputs[ref.name]
            t = local.tensor(ref.name)
            src = w[d] if t.kind == "weight" else st[d]
            a = src[t.name]
            if not t.stacked:
                return a
            slot = t.slots[layer]
            return QTensor(a.codes[slot], a.scales[slot], a.fmt, a.group) if isinstance(a, QTensor) else a[slot]

        for node in g.nodes:
            attrs = {k: v.at(layer) if isinstance(v, LayerExpr) else v for k, v in node.attrs}
            if node.op == "layers":
                outs = run_layers([[read(d, r) for r in node.inputs] for d in range(len(devices))])
                for d in range(len(devices)):
                    for v, o in zip(node.outputs, outs[d], strict=True):
                        env[d][v.name] = o
                continue
            xs = [[read(d, r) for r in node.inputs] for d in range(len(devices))]
            for d in range(len(devices)):
                if node.op == "all_reduce":
                    outs = (sum(xs[e][0] for e in group(d, attrs["axes"])),)
                elif node.op == "all_gather":
                    outs = (jnp.concatenate([xs[e][0] for e in group(d, attrs["axes"])], axis=-1),)
                elif node.op == "shard_slice":
                    x = xs[d][0]
                    n = x.shape[-1] // attrs["ways"]
                    i = shard_index(devices[d], mesh, attrs["axes"])
                    outs = (x[:, i * n : (i + 1) * n],)
                elif node.op == "embedding" and attrs.get("shard_axes"):
                    tok, table = xs[d]
                    lo = shard_index(devices[d], mesh, attrs["shard_axes"]) * table.shape[0]
                    mine = (tok >= lo) & (tok < lo + table.shape[0])
                    rows = jnp.asarray(table)[jnp.clip(tok - lo, 0, table.shape[0] - 1)].astype(jnp.float32)
                    outs = (jnp.where(mine[:, None], rows, 0.0),)
                elif node.op == "argmax" and attrs.get("shard_axes"):
                    whole = jnp.concatenate([xs[e][0] for e in group(d, attrs["shard_axes"])], axis=-1)
                    outs = OPS["argmax"].reference(whole)
                elif node.op == "moe_experts" and attrs.get("expert_axes"):
                    z, wts, ids, w1, w3, w2 = xs[d]
                    e = w1.codes.shape[0]
                    lo = shard_index(devices[d], mesh, attrs["expert_axes"]) * e
                    held = (ids >= lo) & (ids < lo + e)
                    outs = OPS["moe_experts"].reference(
                        z,
                        jnp.where(held, wts, 0.0),
                        jnp.clip(ids - lo, 0, e - 1),
                        w1,
                        w3,
                        w2,
                        beta=attrs["beta"],
                        linear_beta=attrs["linear_beta"],
                    )
                else:
                    kw = {k: v for k, v in attrs.items() if k in OPS[node.op].attrs}
                    outs = OPS[node.op].reference(*xs[d], **kw)
                op = OPS[node.op]
                for name, new in zip(node.writes, outs[op.outputs :], strict=True):
                    t = local.tensor(name)
                    st[d][name] = st[d][name].at[t.slots[layer]].set(new) if t.stacked else new
                for v, o in zip(node.outputs, outs, strict=False):
                    env[d][v.name] = o
        return [[read(d, r) for r in g.results] for d in range(len(devices))]

    def run_layers(carries):
        for layer, kind in enumerate(local.schedule):
            carries = run_graph(local.kind(kind), carries, layer)
        return carries

    results = run_graph(local.step, [[] for _ in devices], None)
    return devices, results, st


@pytest.mark.parametrize(
    "text, profile, mesh",
    [
        pytest.param(KIMI, "mini", None, id="kimi_k3-mini-ep4xtp2"),
        pytest.param(LLAMA, "mini", "mesh { tp = 2 }", id="llama3_8b-mini-tp2"),
    ],
)
@pytest.mark.parametrize("batch", [1, 3])
def test_per_device_models_in_lockstep_match_the_reference(text, profile, mesh, batch):
    if mesh:
        text = text.replace("mesh { tp = 1 }", mesh)
    model = load(text, profile)
    local = shard(model)
    assert local is not model
    seq = 32
    weights, state = random_params(model, {"B": batch, "S": seq}, seed=batch)
    rng = np.random.default_rng(batch)
    # Residual-mixing queries drawn like projections, as in tests/test_kimi_kernel.py: near-one queries
    # make the mix nearly one-hot, where f32 rounding differences upstream swing a layer's input.
    for name in sorted({n.inputs[2].name for g in [*model.kinds, model.step] for n in g.nodes if n.op == "res_mix"}):
        q = weights[name]
        weights[name] = (rng.standard_normal(q.shape, np.float32) / np.sqrt(q.shape[-1])).astype(q.dtype)
    vocab = model.tensor("embed").type.shape[0]
    tokens = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    positions = jnp.asarray(rng.integers(0, seq, batch), jnp.int32)
    ref_logits, ref_next, ref_state = build_reference(model)(weights, state, tokens, positions)
    devices, results, st = run_lockstep(local, weights, state, tokens, positions)
    mesh_sizes = dict(local.mesh)
    vocab_axes = next(n.attr["shard_axes"] for n in local.step.nodes if n.op == "argmax")
    firsts = [d for d, dev in enumerate(devices) if all(dev[a] == 0 for a in mesh_sizes if a not in vocab_axes)]
    order = sorted(firsts, key=lambda d: shard_index(devices[d], mesh_sizes, vocab_axes))
    logits = np.concatenate([np.asarray(results[d][0]) for d in order], axis=-1)
    ref = np.asarray(ref_logits)
    assert not np.isnan(logits).any()
    # Row-parallel partial sums add in another order than the reference's one matmul: f32 rounding, which
    # can flip the bf16 rounding of a later matmul input (2^-8 relative), compounding over the layers.
    np.testing.assert_allclose(logits, ref, atol=2.0**-5, rtol=2.0**-6)
    for d in range(len(devices)):  # replicated results are the same on every device
        assert np.array_equal(np.asarray(results[d][1]), np.asarray(results[0][1]))
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2.0**-4
    assert np.array_equal(np.asarray(results[0][1])[clear], np.asarray(ref_next)[clear])
    for t in local.states:
        split = ((),) * t.stacked + tuple(t.sharding)
        for d, dev in enumerate(devices):
            want = np.asarray(local_slice(np.asarray(ref_state[t.name]), split, dev, mesh_sizes), np.float32)
            got = np.asarray(st[d][t.name], np.float32)
            np.testing.assert_allclose(got, want, atol=2.0**-5 * max(1.0, np.abs(want).max()), rtol=0, err_msg=t.name)


# ---------------------------------------------------------------------------- 3. diagnostics


def shard_errors(text: str) -> list[tuple[int, str]]:
    with pytest.raises(SpecError) as e:
        shard(load(text, "mini"))
    return [(d.span.line, d.message) for d in e.value.diagnostics]


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_a_cache_split_unlike_its_heads_is_named():
    text = LLAMA.replace("mesh { tp = 1 }", "mesh { tp = 2 }").replace(
        "state k_cache: bf16[B, NKV @tp, S, D]", "state k_cache: bf16[B, NKV, S, D]"
    )
    (err,) = shard_errors(text)
    assert err[1] == "attention: `k_cache` must be split over tp like `q`, but it is whole", err
    assert err[0] == line_of(text, "attention(")


def test_a_projection_split_along_both_dimensions_is_named():
    text = KIMI.replace("weight kda_wo:      bf16[NH*D @(ep, tp), H]", "weight kda_wo:      bf16[NH*D @ep, H @tp]")
    errs = shard_errors(text)
    assert (
        line_of(text, "return linear(rmsnorm(o, kda_onorm"),
        "linear: `kda_wo` is split along both dimensions; split its rows or its columns",
    ) in errs, errs


def test_experts_split_unlike_each_other_are_named():
    text = KIMI.replace("weight moe_w3:      mxfp4[E @ep, LAT, FE @tp]", "weight moe_w3:      mxfp4[E @ep, LAT, FE]")
    errs = shard_errors(text)
    assert any("moe_experts: split the experts' weights alike" in m for _, m in errs), errs


# ---------------------------------------------------------------------------- 4. layouts for loaders


def test_generated_module_exposes_per_device_layouts(tmp_path):
    """A loader pre-shards a checkpoint from the module alone: WEIGHT_SPLIT says how each array is
    split, LOCAL_WEIGHTS what each core holds, place_weights puts global arrays on the mesh."""
    import importlib.util

    import jax

    from mkdsl.compiler import compile_source
    from mkdsl.random_params import kernel_weights

    out, _ = compile_source(KIMI, "specs/kimi_k3.mk", "mini", None)
    path = tmp_path / "kernel.py"
    path.write_text(out.files["kernel.py"], encoding="utf-8")
    spec = importlib.util.spec_from_file_location("kimi_mini_layouts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sizes = dict(zip(module.MESH_AXES, module.MESH_SHAPE, strict=True))
    assert sizes == {"ep": 4, "tp": 2}
    for name, (shape, _) in module.WEIGHTS.items():
        split = module.WEIGHT_SPLIT[name]
        want = tuple(
            d // math.prod(sizes[a] for a in ((s,) if isinstance(s, str) else s or ()))
            for d, s in zip(shape, split, strict=True)
        )
        assert module.LOCAL_WEIGHTS[name] == want, name
    assert module.LOCAL_WEIGHTS["moe_w1_codes"][1] == 16 // 4  # 4 experts per expert-parallel group
    weights, _ = random_params(out.model, {"B": 1, "S": 16}, seed=0)
    placed = module.place_weights(
        {k: jax.numpy.asarray(v) for k, v in kernel_weights(weights).items()}, module.make_mesh()
    )
    local = module.local_weight_layout()
    for name, a in placed.items():
        shards = a.addressable_shards
        assert len(shards) == 8 and all(s.data.shape == local[name].shape for s in shards), name
