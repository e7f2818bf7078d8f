"""A random valid spec generator (Csmith-style) and its kernel-vs-reference check.

`generate(seed, index)` draws one complete `.mk` spec from what the language allows *and* what
compiles today (docs/language.md, "What compiles today"): one to three layer kinds with a drawn
schedule, each a residual chain of sublayers (GQA attention with or without rope, q/k l2norm and a
per-head output norm; MLPs with swiglu, situ, silu or a sigmoid gate, optionally soft-capped with a
layer-dependent cap; a `slice` gate over a padded projection; a `compact` gate over per-device
padding; latent attention; a routed MXFP4 MoE; a KDA block; elementwise sublayers), plain residuals
or attention residuals (`res_init` / `res_mix` / `res_snapshot`), per-kind, per-layer or global
weights, a one-device or a 2-device `tp` mesh with the parts the shard pass can split split over
it, and a batch in 1 .. 8. Every case is a pure function of (seed, index), so a failure reproduces
from the two numbers: `python tests/spec_gen.py --seed S --index I --show`.

`check_case` compiles the spec (`compile_source`), imports the kernel and runs STEPS decode steps in
TPU interpret mode, each compared layer by layer with the reference (`mkdsl.verify.kernel.check_batch`:
the bounds and their derivation are in mkdsl/verify/kernel.py). Any failure is a mismatch.
Run many: `python tests/spec_gen.py --cases 200 --seed 7` (or MKDSL_SPECGEN_CASES with pytest).
"""

from __future__ import annotations

import dataclasses
import os
import random
from dataclasses import dataclass, field

from xla_cpu import xla_flags

STEPS = 1  # decode steps per case (the caches start random, so attention reads earlier tokens anyway)
KV_TILE = 128  # the kv_tile hint: a 256-token cache is two tiles (verify.check_seq_len)

# Forms the language allows that the kernel cannot run, found by this generator and now
# diagnostics (the lowerings' checks reject them; tests/test_reliability.py); drawn only when
# named in MKDSL_SPECGEN_GAPS (comma-separated) or with MKDSL_SPECGEN_GAPS=all, where a case must
# then fail to compile. Remove an entry once the kernel runs it. (The last two, w_kvb stacked
# unlike its latent cache and expert weights stacked unlike each other, are drawn since the
# kernels read each weight at its own layer slot.)
KNOWN_GAPS: dict[str, str] = {}
_wanted = os.environ.get("MKDSL_SPECGEN_GAPS", "")
GAPS = set(KNOWN_GAPS) if _wanted == "all" else set(filter(None, _wanted.split(",")))


@dataclass(frozen=True)
class Case:
    seed: int
    index: int
    text: str
    batch: int
    devices: int
    summary: str


@dataclass
class Builder:
    """The spec being drawn: constants, tensors, blocks, and which sublayers each kind runs."""

    rng: random.Random
    tp: int
    hidden: int
    kinds: list[str]
    lines: list[str] = field(default_factory=list)  # weight / state declarations
    blocks: list[str] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)  # for the summary
    count: int = 0

    def name(self, base: str) -> str:
        self.count += 1
        return f"{base}{self.count}"

    def stack(self, kind: str, allow_global: bool = True) -> str:
        """A weight's stacking: this kind's layers, every layer, or one tensor for all."""
        choice = self.rng.choices(["kind", "all", "global"], [6, 2, 2 if allow_global else 0])[0]
        return {"kind": f" per layer({kind})", "all": " per layer", "global": ""}[choice]

    def weight(self, base: str, dtype: str, shape: str, kind: str | None, allow_global: bool = True, own=False) -> str:
        """A weight of `kind` (None: the step's); `own`: stacked like the kind's state (KNOWN_GAPS)."""
        name = self.name(base)
        stacking = (f" per layer({kind})" if own else self.stack(kind, allow_global)) if kind else ""
        self.lines.append(f"weight {name}: {dtype}[{shape}]{stacking}")
        return name

    def state(self, base: str, dtype: str, shape: str, kind: str) -> str:
        name = self.name(base)
        self.lines.append(f"state {name}: {dtype}[{shape}] per layer({kind})")
        return name

    def split(self, wanted: bool) -> str:
        return " @tp" if wanted and self.tp > 1 else ""

    def norm(self, x: str, kind: str) -> str:
        """`x` through an rmsnorm with a drawn eps, or `x` itself."""
        if self.rng.random() < 0.15:
            return x
        w = self.weight("norm", "bf16", "H", kind)
        eps = self.rng.choice(["1e-5", "1e-6", "EPS"])
        return f"rmsnorm({x}, {w}, eps={eps})"


# ---------------------------------------------------------------------------- sublayers
# Each takes the builder, the layer kind and the (normed) input expression and returns the lines
# of a block `NAME(h) { ... }` body and the block's name; the block returns a [B, H] update.


def _block(b: Builder, base: str, body: list[str], result: str) -> str:
    name = b.name(base)
    lines = [f"  {line}" for line in body] + [f"  return {result}"]
    b.blocks.append(f"block {name}(h) {{\n" + "\n".join(lines) + "\n}")
    return name


def attention(b: Builder, kind: str) -> str:
    rng = b.rng
    d = rng.choice([64, 128])
    sharded = b.tp > 1 and rng.random() < 0.7
    ways = b.tp if sharded else 1
    heads = [(q, k) for q, k in [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 2)] if q % k == 0]
    heads = [(q, k) for q, k in heads if q % ways == 0 and k % ways == 0 and k * d // ways % 128 == 0]
    nh, nkv = rng.choice(heads)
    s = b.split(sharded)
    wq = b.weight("wq", "bf16", f"H, {nh * d}{s}", kind)
    wk = b.weight("wk", "bf16", f"H, {nkv * d}{s}", kind)
    wv = b.weight("wv", "bf16", f"H, {nkv * d}{s}", kind)
    wo = b.weight("wo", "bf16", f"{nh * d}{s}, H", kind)
    kc = b.state("kc", "bf16", f"B, {nkv}{s}, S, {d}", kind)
    vc = b.state("vc", "bf16", f"B, {nkv}{s}, S, {d}", kind)
    q, k = f"linear(h, {wq})", f"linear(h, {wk})"
    if rng.random() < 0.25:
        q, k = f"l2norm({q}, heads={nh}, scale={d**0.5})", f"l2norm({k}, heads={nkv})"
    if rng.random() < 0.75:
        theta = rng.choice(["10000.0", "500000.0", "THETA"])
        q, k = f"rope({q}, pos, heads={nh}, theta={theta})", f"rope({k}, pos, heads={nkv}, theta={theta})"
    scale = rng.choice(["", "", f", scale={rng.choice(['0.1', 'D0 ** -0.5'])}"])
    body = [f"q = {q}", f"k = {k}"]
    body.append(f"a = attention(q, k, linear(h, {wv}), {kc}, {vc}, pos, heads={nh}, kv_heads={nkv}{scale})")
    if rng.random() < 0.3:
        onorm = b.weight("onorm", "bf16", str(d), kind)
        body.append(f"a = rmsnorm(a, {onorm}, heads={nh})")
    b.parts.append(f"attn(h{nh}/kv{nkv}, d{d}{', tp' if s else ''})")
    return _block(b, "attn", body, f"linear(a, {wo})")


def mlp(b: Builder, kind: str) -> str:
    rng = b.rng
    sharded = b.tp > 1 and rng.random() < 0.7
    width = 128 * rng.randint(1, 3) * (b.tp if sharded else 1)
    s = b.split(sharded)
    act = rng.choice(["swiglu", "situ", "silu", "gate"])
    wg = b.weight("wg", "bf16", f"H, {width}{s}", kind)
    wd = b.weight("wd", "bf16", f"{width}{s}, H", kind)
    if act == "silu":
        y = f"silu(linear(h, {wg}))"
    else:
        wu = b.weight("wu", "bf16", f"H, {width}{s}", kind)
        g, u = f"linear(h, {wg})", f"linear(h, {wu})"
        y = {
            "swiglu": f"swiglu({g}, {u})",
            "situ": f"situ({g}, {u}, beta={rng.choice(['4.0', '2.0'])}, linear_beta={rng.choice(['25.0', '8.0'])})",
            "gate": f"sigmoid({g}) * {u}",
        }[act]
    out = f"linear({y}, {wd})"
    if rng.random() < 0.25:
        out = f"softcap({out}, cap={rng.choice(['2.0 * (l + 1)', '30.0', 'CAP'])})"
    b.parts.append(f"mlp({act}, {width}{', tp' if s else ''})")
    return _block(b, "mlp", [], out)


def slice_gate(b: Builder, kind: str) -> str:
    """A narrow projection stored padded to 128 columns; `slice` drops the padding."""
    rng = b.rng
    size = 16 * rng.randint(1, 7)
    start = 16 * rng.randint(0, (128 - size) // 16)
    wb = b.weight("wb", "bf16", "H, 128", kind)
    up = b.weight("up", "bf16", f"{size}, H", kind)
    b.parts.append(f"slice({start}+{size})")
    return _block(b, "gate", [], f"linear(sigmoid(slice(linear(h, {wb}), start={start}, size={size})), {up})")


def compact_gate(b: Builder, kind: str) -> str:
    """Per-device padded blocks of 128 columns; `compact` keeps the first `keep` of each."""
    rng = b.rng
    sharded = b.tp > 1 and rng.random() < 0.7
    blocks = rng.randint(1, 2) * (b.tp if sharded else 1)
    keep = 16 * rng.randint(1, 4)
    s = b.split(sharded)
    wc = b.weight("wc", "bf16", f"H, {blocks * 128}{s}", kind)
    up = b.weight("up", "bf16", f"{blocks * keep}{s}, H", kind)
    b.parts.append(f"compact({blocks}x{keep}{', tp' if s else ''})")
    return _block(b, "cgate", [], f"linear(silu(compact(linear(h, {wc}), block=128, keep={keep})), {up})")


def mla(b: Builder, kind: str) -> str:
    """Latent attention (no rope, as Kimi K3's): q from a projection, the latent and extra key sliced
    from one padded down-projection."""
    rng = b.rng
    sharded = b.tp > 1 and rng.random() < 0.7
    nope, extra, vdim = rng.choice([(128, 64, 128), (64, 64, 64), (128, 64, 64)])
    ways = b.tp if sharded else 1
    nh = rng.choice([h for h in (2, 4) if h % ways == 0 and h // ways * (nope + extra) % 128 == 0])
    rank = 128
    s = b.split(sharded)
    kvp = (rank + extra + 127) // 128 * 128
    wq = b.weight("mq", "bf16", f"H, {nh * (nope + extra)}{s}", kind)
    wkv = b.weight("mkv", "bf16", f"H, {kvp}", kind)
    wkvb = b.weight("mkvb", "bf16", f"{rank}, {nh * (nope + vdim)}{s}", kind)
    wo = b.weight("mo", "bf16", f"{nh * vdim}{s}, H", kind)
    cache = b.state("mc", "bf16", f"B, S, {rank + extra}", kind)
    c = f"slice(kv, start=0, size={rank})"
    if rng.random() < 0.5:
        c = f"rmsnorm({c}, {b.weight('kvnorm', 'bf16', str(rank), kind)})"
    body = [
        f"kv = linear(h, {wkv})",
        f"y = mla_attention(linear(h, {wq}), {c}, slice(kv, start={rank}, size={extra}), {wkvb}, {cache}, pos, "
        f"heads={nh}, nope={nope}, extra={extra}, vdim={vdim})",
    ]
    b.parts.append(f"mla(h{nh}, {nope}/{extra}/{vdim}{', tp' if s else ''})")
    return _block(b, "mla", body, f"linear(y, {wo})")


def moe(b: Builder, kind: str) -> str:
    """Routed MXFP4 experts behind a router padded to 128 columns; widths that are not whole
    tiles (stored padded by the kernel), each expert weight stacked its own way."""
    rng = b.rng
    experts = rng.choice([8, 8, 16])
    k = rng.choice([1, 2, 2, 4])
    split = rng.choice(["", "experts", "columns"]) if b.tp > 1 else ""
    lat = rng.choice([256, 256, 192, 320])
    width = rng.choice([128, 256, 96, 160]) * (b.tp if split == "columns" else 1)
    e_s = " @tp" if split == "experts" else ""
    f_s = " @tp" if split == "columns" else ""
    wr = b.weight("router", "bf16", "H, 128", kind)
    bias = b.weight("bias", "f32", str(experts), kind)
    down = b.weight("zdown", "bf16", f"H, {lat}", kind)
    w1 = b.weight("w1_", "mxfp4", f"{experts}{e_s}, {lat}, {width}{f_s}", kind)
    w3 = b.weight("w3_", "mxfp4", f"{experts}{e_s}, {lat}, {width}{f_s}", kind)
    w2 = b.weight("w2_", "mxfp4", f"{experts}{e_s}, {width}{f_s}, {lat}", kind)
    up = b.weight("zup", "bf16", f"{lat}, H", kind)
    scores = f"slice(linear(h, {wr}), start=0, size={experts})"
    if rng.random() < 0.3:  # Qwen3's router: softmax, the top k, renormalised
        routing = [f"p, ids = topk(softmax({scores}), k={k})", "w = p / rowsum(p)"]
    else:
        routing = [f"w, ids = route({rng.choice(['sigmoid', 'softmax'])}({scores}), {bias}, k={k})"]
    act = expert_act(b)
    body = [*routing, f"r = moe_experts(linear(h, {down}), w, ids, {w1}, {w3}, {w2}, act={act})"]
    b.parts.append(f"moe(E{experts}, k{k}, D{lat}, F{width}{', ' + split if split else ''})")
    return _block(b, "moe", body, f"linear(r, {up})")


def expert_act(b: Builder) -> str:
    """The experts' gated activation: an op's name, or a block of elementwise ops."""
    form = b.rng.choice(["swiglu", "situ", "clamped"])
    if form == "swiglu":
        return "swiglu"
    body = {
        "situ": f"return situ(g, u, beta={b.rng.choice(['4.0', '2.0'])}, linear_beta=25.0)",
        "clamped": "g = clamp(g, hi=7.0)\n  u = clamp(u, lo=-7.0, hi=7.0)\n  return g * sigmoid(g * 1.702) * (u + 1.0)",
    }[form]
    name = b.name("act")
    b.blocks.append(f"block {name}(g, u) {{\n  {body}\n}}")
    return name


def kda(b: Builder, kind: str) -> str:
    """Kimi Delta Attention: short convs, l2-normed q and k, a decay gate, and a member of the
    recurrent family (the delta rule, or the plain gated outer product), with value heads 128 or
    64 wide (64: the width whose loop over the heads' slots libtpu once refused)."""
    rng = b.rng
    heads, d, taps = rng.choice([1, 2]), 128, rng.choice([2, 4])
    dv, rule = rng.choice([128, 64]), rng.choice(["delta", "outer"])
    width, vwidth = heads * d, heads * dv
    widths = {"q": width, "k": width, "v": vwidth}
    proj = {n: b.weight(f"k{n}", "bf16", f"H, {widths[n]}", kind) for n in "qkv"}
    conv = {n: b.weight(f"c{n}", "bf16", f"{taps}, {widths[n]}", kind) for n in "qkv"}
    cs = {n: b.state(f"cs{n}", "f32", f"B, {taps - 1}, {widths[n]}", kind) for n in "qkv"}
    wfa = b.weight("wfa", "bf16", f"H, {d}", kind)
    wfb = b.weight("wfb", "bf16", f"{d}, {width}", kind)
    a_log = b.weight("alog", "f32", str(heads), kind)
    dt = b.weight("dtb", "f32", str(width), kind)
    wb = b.weight("kb", "bf16", "H, 128", kind)
    st = b.state("ks", "f32", f"B, {heads}, {d}, {dv}", kind)
    wo = b.weight("ko", "bf16", f"{vwidth}, H", kind)
    conv_of = {n: f"short_conv(linear(h, {proj[n]}), {conv[n]}, {cs[n]})" for n in "qkv"}
    body = [
        f"q = l2norm({conv_of['q']}, heads={heads}, scale={d**-0.5})",
        f"k = l2norm({conv_of['k']}, heads={heads})",
        f"g = kda_gate(linear(linear(h, {wfa}), {wfb}), {a_log}, {dt}, heads={heads})",
        f"beta = sigmoid(slice(linear(h, {wb}), start=0, size={heads}))",
        f'o = recurrent(q, k, {conv_of["v"]}, {st}, g, beta, heads={heads}, rule="{rule}")',
    ]
    b.parts.append(f"kda(h{heads}, dv{dv}, {rule}, taps{taps})")
    return _block(b, "kda", body, f"linear(o, {wo})")


def elementwise(b: Builder, kind: str) -> str:
    rng = b.rng
    y = rng.choice(["h * h", "silu(h)", "h * sigmoid(h)", "softcap(h, cap=1.0 + l)", "softcap(h * h, cap=4.0)"])
    b.parts.append("elementwise")
    return _block(b, "ew", [], y)


SUBLAYERS = {  # name -> (draw, weight): attention and MLPs are the common case
    "attention": (attention, 5),
    "mlp": (mlp, 5),
    "slice": (slice_gate, 1),
    "compact": (compact_gate, 1),
    "mla": (mla, 2),
    "moe": (moe, 2),
    "kda": (kda, 1),
    "elementwise": (elementwise, 1),
}


# ---------------------------------------------------------------------------- layers and the spec


def schedule(rng: random.Random, layers: int, kinds: list[str]) -> tuple[list[str], str]:
    """Each layer's kind (every kind at least once) and the `layers` rules that give it."""
    order = kinds + [rng.choice(kinds) for _ in range(layers - len(kinds))]
    rng.shuffle(order)
    rules = []
    for kind in kinds[:-1]:
        at = [i for i, k in enumerate(order) if k == kind]
        parity = [i for i in range(layers) if i % 2 == at[0] % 2]
        earlier = {i for i, k in enumerate(order) if k in kinds[: kinds.index(kind)]}
        if [i for i in parity if i not in earlier] == at and len(at) > 1:
            rules.append(f"  {kind}: l % 2 == {at[0] % 2}")
        else:
            rules.append(f"  {kind}: " + " or ".join(f"l == {i}" for i in at))
    rules.append(f"  {kinds[-1]}: otherwise")
    return order, "layers L {\n" + "\n".join(rules) + "\n}"


def layer_kind(b: Builder, kind: str, residual: bool) -> str:
    """One kind: a chain of 1 .. 3 sublayers, each added to the residual (or the attention-residual prefix)."""
    names = list(SUBLAYERS)
    drawn = b.rng.choices(names, [SUBLAYERS[n][1] for n in names], k=b.rng.choice([1, 1, 2]))
    blocks = [SUBLAYERS[n][0](b, kind) for n in drawn]
    if residual:
        body = [f"  x = x + {blk}({b.norm('x', kind)})" for blk in blocks[:-1]]
        body.append(f"  return x + {blocks[-1]}({b.norm('x', kind)})")
        return f"layer {kind}(x) {{\n" + "\n".join(body) + "\n}"
    mix = b.weight("rmix", "bf16", "H", kind)
    body = [
        f"  h = res_mix(blocks, prefix, {mix}, layer=l, block=BLOCK)",
        "  blocks, prefix = res_snapshot(blocks, prefix, layer=l, block=BLOCK)",
        f"  prefix = prefix + {blocks[0]}({b.norm('h', kind)})",
    ]
    for blk in blocks[1:]:
        mix = b.weight("rmix", "bf16", "H", kind)
        body.append(f"  m = res_mix(blocks, prefix, {mix}, layer=l, block=BLOCK, after_snapshot=true)")
        body.append(f"  prefix = prefix + {blk}({b.norm('m', kind)})")
    body.append("  return blocks, prefix")
    return f"layer {kind}(blocks, prefix) {{\n" + "\n".join(body) + "\n}"


def step(b: Builder, residual: bool) -> str:
    rng = b.rng
    head = f"rmsnorm(x, {b.weight('normf', 'bf16', 'H', None)}, eps=EPS)" if rng.random() < 0.85 else "x"
    logits = f"linear({head}, lm_head)"
    if rng.random() < 0.3:
        logits = f"softcap({logits}, cap=CAP)"
    if residual:
        body = ["  x = layers(embedding(tokens, embed))"]
    else:
        out = b.weight("rout", "bf16", "H", None)
        body = [
            "  blocks, prefix = res_init(embedding(tokens, embed), nblocks=NB)",
            "  blocks, prefix = layers(blocks, prefix)",
            f"  x = res_mix(blocks, prefix, {out}, layer=L - 1, block=BLOCK, after_snapshot=true)",
        ]
    body += [f"  logits = {logits}", "  return logits, argmax(logits)"]
    return "step(tokens, pos) {\n" + "\n".join(body) + "\n}"


def generate(seed: int, index: int) -> Case:
    """The case `index` of the run with `seed`: a spec, a batch and its mesh size."""
    rng = random.Random(f"{seed}:{index}")
    tp = rng.choice([1, 1, 2])
    layers = rng.randint(1, 3)
    kinds = [f"k{i}" for i in range(rng.randint(1, min(3, layers)))]
    b = Builder(rng, tp, rng.choice([128, 128, 128, 256]), kinds)
    residual = rng.random() < 0.75
    vsplit, esplit = (rng.random() < 0.7, rng.random() < 0.4) if tp > 1 else (False, False)
    vocab = 128 * tp * rng.randint(2, 3)
    b.lines += [f"weight embed: bf16[V{b.split(esplit)}, H]", f"weight lm_head: bf16[H, V{b.split(vsplit)}]"]
    kind_text = [layer_kind(b, k, residual) for k in kinds]
    order, rules = schedule(rng, layers, kinds)
    step_text = step(b, residual)
    hints = [f"kv_tile = {KV_TILE}"]
    if rng.random() < 0.4:
        hints.append(f"ring_depth = {rng.randint(2, 6)}")
    if rng.random() < 0.4:
        hints.append(f"tile_n = {rng.choice([128, 256])}")
    block = rng.randint(1, layers)
    consts = {
        "L": layers, "H": b.hidden, "V": vocab, "EPS": "1e-5", "THETA": "10000.0 * (1 + L)",
        "CAP": rng.choice(["30.0", "15.0"]), "D0": 64, "BLOCK": block, "NB": "1 + (L - 1) // BLOCK",
    }  # fmt: skip
    parts = [
        f"# Drawn by tests/spec_gen.py: seed {seed}, case {index}",
        "model gen",
        "\n".join(f"const {k} = {v}" for k, v in consts.items()),
        "dim B in 1 .. 8\ndim S in 1 .. 256",
        *([f"mesh {{ tp = {tp} }}"] if tp > 1 else []),
        "hints { " + "  ".join(hints) + " }",
        "\n".join(b.lines),
        *b.blocks,
        *kind_text,
        rules,
        step_text,
    ]
    summary = f"L{layers} H{b.hidden} V{vocab} tp{tp} {'res' if residual else 'attn-res'} {order}: " + "; ".join(
        b.parts
    )
    return Case(seed, index, "\n\n".join(parts) + "\n", rng.randint(1, 8), tp, summary)


# ---------------------------------------------------------------------------- the check


def compile_case(case: Case, directory):
    """(model, imported kernel module, checker) for a case; SpecError if it does not compile."""
    from mkdsl.compiler import compile_source
    from mkdsl.verify import kernel as verify

    out, _ = compile_source(case.text, "gen.mk", None, None)
    module = verify.import_generated(out.files["kernel.py"], directory, f"gen_{case.seed}_{case.index}")
    return out.model, module, verify.LayerChecker(out.model)


def check_case(case: Case, directory, races: bool = True) -> list[str]:
    """The case's kernel against the reference in interpret mode: its failures (empty: it matched).

    `races`: with the interpreter's race detector (as `verify.check_batch`); without it a case runs
    about twice as fast, for long runs on demand (every other check is the same)."""
    from mkdsl.verify import kernel as verify

    model, module, checker = compile_case(case, directory)
    params = None if races else dataclasses.replace(verify.interpret_params(), detect_races=False)
    return verify.check_batch(model, module, checker, case.batch, STEPS, seed=case.index, interpret=params).failures


def main(argv=None) -> int:
    import argparse
    import os
    import tempfile
    import time
    import traceback

    p = argparse.ArgumentParser(description="Random valid specs: kernel vs reference in interpret mode.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", type=int, default=1)
    p.add_argument("--index", type=int, default=0, help="the first case")
    p.add_argument("--show", action="store_true", help="print the specs; run nothing")
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--no-races", action="store_true", help="without the interpreter's race detector (faster)")
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = xla_flags(8, os.environ.get("XLA_FLAGS", ""))
    bad, t0 = 0, time.time()
    with tempfile.TemporaryDirectory(prefix="mkdsl-specgen-") as tmp:
        for index in range(args.index, args.index + args.cases):
            case = generate(args.seed, index)
            if args.show:
                print(case.text)
                continue
            t, cpu = time.time(), time.process_time()
            try:
                failures = (
                    [] if args.compile_only and compile_case(case, tmp) else check_case(case, tmp, not args.no_races)
                )
            except Exception as e:  # a case that does not compile or crashes is a finding, reported as one
                failures = [f"{type(e).__name__}: {e}"[:3000], traceback.format_exc()[-3000:]]
            bad += bool(failures)
            verdict = "FAIL" if failures else "ok"
            took = f"{time.time() - t:.0f} s, {time.process_time() - cpu:.0f} s CPU"
            print(f"case {index} batch {case.batch}: {verdict} ({took}) {case.summary}", flush=True)
            for f in failures[:6]:
                print(f"    {f}", flush=True)
    print(f"seed {args.seed}: {args.cases} cases, {bad} failed, {time.time() - t0:.0f} s", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
