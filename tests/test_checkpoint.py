"""Checkpoint mappings and the loader: synthetic Hugging Face and GGUF checkpoints (real tensor
names and layouts, mini sizes, random values) load exactly into the spec's layout, and every
mismatch is reported, naming the tensor, before anything is loaded.

The Llama family (Llama 3, SmolLM2) is written by `hf_tensors` / `gguf_tensors`; DeepSeek-V3
(fp8 with block scales), gpt-oss (MXFP4 experts, fused interleaved gate_up), Qwen3-Next (tensors
fused per key head) and Qwen3-30B-A3B by `checkpoint_writers.PUBLISHED`, as their published
checkpoints lay them out. That loaded weights also run a kernel step equal to the reference is
checked by the models' mini kernel tests, which take their weights through these checkpoints
(`checkpoint_writers.through_checkpoint`), and for the Llama mini by tests/test_run.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from checkpoint_writers import (
    LLAMA_NAMES,
    PUBLISHED,
    decode_blocks,
    demo_tensors,
    dequantised_save,
    expected_weights,
    gguf_tensors,
    hf_tensors,
    published_header,
    same_weight,
    write_gguf,
    write_sharded,
)
from kimi_checkpoint import dspark_expected, dspark_tensors
from safetensors.numpy import save_file

import mkdsl
from mkdsl.checkpoint.formats import CheckpointError
from mkdsl.cli import main
from mkdsl.lang.diagnostics import SpecError

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "specs" / "llama3_8b.mk"


@pytest.fixture(scope="module")
def llama():
    spec = mkdsl.load(LLAMA, "mini")
    weights, _ = mkdsl.random_inputs(spec, batch=1, seq_len=256, seed=3)
    return spec, weights


# Every spec with a mapping, at a mini profile (SmolLM2's: widths not multiples of 128, tied head).
MAPPED = ["llama3_8b", "smollm2_135m"]


@pytest.fixture(scope="module", params=MAPPED)
def mapped(request):
    spec = mkdsl.load(ROOT / "specs" / f"{request.param}.mk", "mini")
    weights, _ = mkdsl.random_inputs(spec, batch=1, seq_len=256, seed=3)
    return spec, weights


def _hf(tmp_path, tensors) -> Path:
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path


def test_safetensors_load_exactly_into_the_spec_layout(mapped, tmp_path):
    spec, weights = mapped
    tensors = hf_tensors(weights, 2)
    loaded, report = mkdsl.load_weights(spec, _hf(tmp_path, tensors), host=True, progress=False)
    assert set(loaded) == set(weights)
    for name, w in weights.items():
        assert loaded[name].dtype == w.dtype and np.array_equal(loaded[name], w), name
    assert report.tensors == len(tensors) and not report.rounded


def test_a_sharded_index_loads_the_same(llama, tmp_path):
    spec, weights = llama
    tensors = hf_tensors(weights, 2)
    names = sorted(tensors)
    halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for f, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / f))
    index = {"weight_map": {n: f for f, part in halves.items() for n in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded, _ = mkdsl.load_weights(spec, tmp_path, host=True, progress=False)
    assert all(np.array_equal(loaded[n], w) for n, w in weights.items())


def _unpermute(x: np.ndarray, heads: int) -> np.ndarray:
    """GGUF row 2j + s of a head is Hugging Face row s*d/2 + j."""
    d = x.shape[0] // heads
    out = np.empty_like(x)
    for h in range(heads):
        for j in range(d // 2):
            for s in range(2):
                out[h * d + s * (d // 2) + j] = x[h * d + 2 * j + s]
    return out


def test_gguf_q4_1_q8_0_load_dequantized_unpermuted_and_rounded(mapped, tmp_path):
    import gguf

    spec, weights = mapped
    c = spec.model.const
    tensors = gguf_tensors(weights, 2, c["NH"], c["NKV"])
    write_gguf(tmp_path / "m.gguf", tensors, block_count=2)
    loaded, report = mkdsl.load_weights(spec, tmp_path / "m.gguf", host=True, progress=False)
    for name, (_, gg, matrix) in LLAMA_NAMES.items():
        if name not in weights:
            continue
        for layer in range(2) if "{l}" in gg else [None]:
            x, kind = tensors[gg.format(l=layer)]
            if kind != "F32":
                x = decode_blocks(gguf.quants.quantize(x, gguf.GGMLQuantizationType[kind]), kind, x.shape)
            x = _unpermute(x, {"wq": c["NH"], "wk": c["NKV"]}[name]) if name in ("wq", "wk") else x
            want = (x.T if matrix else x).astype(ml_dtypes.bfloat16)
            got = loaded[name][layer] if layer is not None else loaded[name]
            assert np.array_equal(got, want), (name, layer)
    assert dict(report.rounded) == {"Q4_1": 7 * 2 + ("lm_head" in weights), "Q8_0": 1, "F32": 2 * 2 + 1}
    assert "rounded to nearest" in report.summary() and "Q4_1 -> bf16" in report.summary()


def test_every_mismatch_is_listed_before_anything_loads(llama, tmp_path):
    spec, weights = llama
    tensors = hf_tensors(weights, 2)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:64]
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.float32)
    with pytest.raises(CheckpointError) as e:
        mkdsl.load_weights(spec, _hf(tmp_path, tensors), host=True, progress=False)
    text = str(e.value)
    assert "3 problems" in text, text
    assert re.search(r"missing tensor `model\.layers\.1\.mlp\.up_proj\.weight` for `w_up` \(layer 1\)", text)
    assert re.search(
        r"tensor `model\.layers\.0\.self_attn\.k_proj\.weight` is BF16 \[64, 256\] "
        r"\(after `transpose`: \[256, 64\]\); expected \[256, 128\] for `wk` \(layer 0\)",
        text,
    )
    assert re.search(r"tensor `model\.norm\.weight` is F32, which bf16 cannot hold exactly .*`\| round`", text)


def test_a_checkpoint_with_more_layers_than_the_spec_is_refused(llama, tmp_path):
    spec, weights = llama
    path = _hf(tmp_path, hf_tensors(weights, 2))
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 30}))
    with pytest.raises(CheckpointError, match="the checkpoint has 30 layers; the spec has 2"):
        mkdsl.load_weights(spec, path, host=True, progress=False)


MAPPING_BASE = LLAMA.read_text()


@pytest.mark.parametrize(
    "old, new, message",
    [
        ('  wq         = "model', '  wqq        = "model', r"checkpoint hf: unknown weight `wqq`.*did you mean `wq`"),
        (
            'self_attn.q_proj.weight" | transpose\n',
            'self_attn.q_proj.weight" | transpose | transpos\n',
            r"unknown checkpoint step `transpos`.*did you mean `transpose`",
        ),
        ('"model.layers.{l}.self_attn.v_proj', '"model.layers.{l.self_attn.v_proj', r"bad name pattern"),
        ('"model.layers.{l}.input_layernorm', '"model.layers.input_layernorm', r"has no layer index `\{l\}`"),
        ('"model.norm.weight"', '"model.{l}.norm.weight"', r"uses `\{l\}`, but the weight is not per layer"),
        ("unpermute(heads=NH)", "unpermute(head=NH)", r"`unpermute` takes \(heads\)"),
        (  # an `or` source is checked as the first is
            'self_attn.q_proj.weight" | transpose\n',
            'self_attn.q_proj.weight" | transpose or "model.q.weight" | transpose\n',
            r"the pattern for `wq` has no layer index `\{l\}`",
        ),
        (
            'self_attn.q_proj.weight" | transpose\n',
            'self_attn.q_proj.weight" | transpose or "model.layers.{l}.q.weight" | transpos\n',
            r"unknown checkpoint step `transpos`",
        ),
        ('  lm_head    = "lm_head.weight" | transpose\n', "", r"checkpoint hf does not say where `lm_head` comes from"),
        ("checkpoint gguf", "checkpoint ggml", r"unknown checkpoint format `ggml`"),
        (
            '  final_norm = "model.norm.weight"',
            '  k_cache = "x"\n  final_norm = "model.norm.weight"',
            r"`k_cache` is state, not a weight",
        ),
    ],
)
def test_mapping_mistakes_are_diagnostics(tmp_path, old, new, message):
    assert old in MAPPING_BASE
    bad = tmp_path / "bad.mk"
    bad.write_text(MAPPING_BASE.replace(old, new, 1))
    with pytest.raises(SpecError) as e:
        mkdsl.load(bad, "mini")
    text = e.value.render(str(bad), bad.read_text())
    assert re.search(message, text, re.S), text
    assert re.search(r"bad\.mk:\d+:\d+: error", text)


# ---------------------------------------------------------------------------- published layouts


# Per spec, one stored tensor per kind of mistake: missing, a wrong shape (how to spoil it), a wrong
# dtype (F16 for bf16: not exact; bf16 codes for fp8), and the message each gives: it names the
# tensor, what was found and what was expected.
def _cut(index):
    return lambda x: np.ascontiguousarray(x[index])


def _f16(x):
    return x.astype(np.float16)


MISTAKES = {
    "kimi_k3": (
        (
            "language_model.model.layers.3.self_attention_res_proj.weight",
            None,
            r"missing tensor `language_model\.model\.layers\.3\.self_attention_res_proj\.weight` for `attn_res` "
            r"\(layer 3\)",
        ),
        (
            "language_model.model.layers.2.block_sparse_moe.experts.4.w2.weight_packed",
            _cut(np.s_[:, :-1]),
            r"U8 \[256, 127\] \* .* U8 \[256, 8\]: codes .* are not packed MXFP4",
        ),
        ("language_model.model.layers.1.self_attn.b_proj.weight", _f16, r"is F16, which bf16 cannot hold exactly"),
    ),
    "qwen3_30b_a3b": (
        ("model.layers.1.mlp.experts.5.up_proj.weight", None, r"expected \[256, 256\]"),
        (
            "model.layers.0.self_attn.k_proj.weight",
            _cut(np.s_[:-128]),
            r"is BF16 \[128, 256\] \(after `transpose`: \[256, 128\]\); expected \[256, 256\]",
        ),
        ("model.layers.0.mlp.gate.weight", _f16, r"is F16, which bf16 cannot hold exactly \(expected BF16"),
    ),
    "deepseek_v3": (
        (
            "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv",
            None,
            r"expected F8_E4M3 \* F32 holding \[256, 256\]",
        ),
        (
            "model.layers.0.self_attn.q_b_proj.weight",
            _cut(np.s_[:-128]),
            r"F8_E4M3 \[1408, 256\] \* .* F32 \[12, 2\]: scales \[12, 2\] are not one per 128x128 block of "
            r"codes \[1408, 256\] \(expected \[11, 2\]\)",
        ),
        (
            "model.layers.1.mlp.shared_experts.up_proj.weight",
            lambda x: x.astype(ml_dtypes.bfloat16),
            r"BF16 \[256, 256\] \* .* are not a pair that holds fp8_e4m3\(block=128\) \(expected F8_E4M3 \* F32",
        ),
    ),
    "gpt_oss_120b": (
        ("model.layers.1.mlp.experts.down_proj_scales", None, r"expected U8 \* U8 holding \[8, 256, 256\]"),
        (
            "model.layers.0.mlp.experts.gate_up_proj_blocks",
            _cut(np.s_[:, :, :-1]),
            r"U8 \[8, 512, 7, 16\] \* .* U8 \[8, 512, 8\]: codes .* are not MXFP4 blocks",
        ),
        ("model.layers.1.mlp.experts.gate_up_proj_bias", _f16, r"is F16, which bf16 cannot hold exactly"),
    ),
    "qwen3_next_80b_a3b": (
        ("model.layers.3.self_attn.q_proj.weight", None, r"for `attn_wq` \(layer 3\).*expected \[256, 1024\]"),
        (
            "model.layers.0.linear_attn.in_proj_qkvz.weight",
            _cut(np.s_[:-1]),
            r"is BF16 \[1535, 256\]: `group_rows\(groups=2, start=0, stop=128\)` needs dimension 0 \(1535\) "
            r"to be 2 equal groups .*; expected \[256, 256\] after the steps for `gdn_wq`",
        ),
        ("model.layers.2.linear_attn.in_proj_ba.weight", _f16, r"is F16, which bf16 cannot hold exactly"),
    ),
}


@pytest.fixture(scope="module", params=sorted(PUBLISHED))
def published(request, tmp_path_factory):
    """A mini spec, its random weights, the published checkpoint's tensors and what loading them
    gives; the tensors but the ones `MISTAKES` spoils written once, as a shared base file."""
    name = request.param
    spec = mkdsl.load(ROOT / "specs" / f"{name}.mk", "mini")
    weights, _ = mkdsl.random_inputs(spec, batch=1, seq_len=64, seed=3)
    m = spec.model
    tensors = PUBLISHED[name](weights, m.schedule, m.const)
    base = tmp_path_factory.mktemp(name) / "base.safetensors"
    spoiled = [n for n, _, _ in MISTAKES[name]]
    save_file({n: x for n, x in tensors.items() if n not in spoiled}, str(base))
    return name, spec, tensors, expected_weights(name, weights, tensors, m.const), base


def _sharded(root: Path, base: Path, tensors: dict, spoiled: list[str]) -> Path:
    return write_sharded(root, base, {n: tensors[n] for n in spoiled if n in tensors}, set(tensors) - set(spoiled))


def test_published_layouts_load_bit_exactly(published, tmp_path):
    """Every weight equals the spec-layout weight the checkpoint was written from, bit for bit
    (fp8 codes and scales transposed, MXFP4 re-packed, fused rows regrouped), except what the
    checkpoint holds otherwise (expected_weights: DeepSeek's kv_b_proj decoded to bf16, the
    zero padding of Qwen3-Next's [beta | a])."""
    name, spec, tensors, want, base = published
    spoiled = [n for n, _, _ in MISTAKES[name]]
    root = _sharded(tmp_path, base, tensors, spoiled)
    loaded, report = mkdsl.load_weights(spec, root, host=True, progress=False)
    assert set(loaded) == set(want)
    bad = [w for w in want if not same_weight(loaded[w], want[w])]
    assert not bad, f"{name}: loaded differently: {bad}"
    assert report.tensors == len(tensors)
    bf16_kvb = name == "deepseek_v3" and not spec.model.tensor("wkv_b").type.dtype.quantised
    rounded = {"F8_E4M3*F32": 2} if bf16_kvb else {}  # kv_b_proj decoded into a bf16 wkv_b
    if name == "kimi_k3":  # each residual vector a bf16 product (`round`): the output's, 2 a layer
        rounded = {"BF16*BF16": 1 + 2 * len(spec.model.schedule)}
    assert dict(report.rounded) == rounded, report.summary()


@pytest.mark.parametrize("mistake", [0, 1, 2], ids=["missing", "shape", "dtype"])
def test_published_layout_mistakes_exit_1_naming_the_tensor(published, tmp_path, capsys, mistake):
    name, spec, tensors, _, base = published
    spoiled = [n for n, _, _ in MISTAKES[name]]
    victim, spoil, message = MISTAKES[name][mistake]
    bad = dict(tensors)
    if spoil is None:
        del bad[victim]
    else:
        bad[victim] = spoil(bad[victim])
    root = _sharded(tmp_path, base, bad, spoiled)
    argv = ["run", str(ROOT / "specs" / f"{name}.mk"), "-p", "mini", "--weights", str(root), "--prompt", "x"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"`{victim}`" in err and re.search(message, err), err
    assert "Traceback" not in err


def test_published_layouts_load_onto_the_devices_in_the_kernels_layout(published, tmp_path):
    """With the generated module: every array the kernel takes (a quantised `w` as `w_codes` and
    `w_scales`, padded as `pad_weights` pads), at its layout and split over the module's mesh."""
    from mkdsl.compiler import compile_source
    from mkdsl.run.random_params import kernel_weights
    from mkdsl.verify import kernel as verify

    name, spec, tensors, want, base = published
    out, _ = compile_source(spec.source, str(spec.path), "mini", None)
    module = verify.import_generated(out.files["kernel.py"], tmp_path, f"{name}_mini")
    root = _sharded(tmp_path, base, tensors, [n for n, _, _ in MISTAKES[name]])
    loaded, _ = mkdsl.load_weights(spec, root, module=module, progress=False)
    layout, shardings = module.weight_layout(), module.weight_shardings(module.make_mesh())
    assert set(loaded) == set(layout)
    host = getattr(module, "pad_weights", dict)(kernel_weights(want))
    for n, x in loaded.items():
        assert (x.shape, x.dtype) == (layout[n].shape, layout[n].dtype), n
        assert x.sharding.is_equivalent_to(shardings[n], x.ndim), n
        assert same_weight(np.asarray(x), np.asarray(host[n])), n


DOCS = ROOT / "docs" / "language.md"


def test_the_manuals_example_loads_its_fused_interleaved_quantised_checkpoint(tmp_path):
    """docs/language.md's `checkpoint_demo`: its checkpoint as the prose lays it out (q and k rows
    fused per head, MXFP4 gate/up rows alternating, fp8 block-scaled down, norms [1, H]) loads into
    the spec's weights bit for bit."""
    text = DOCS.read_text(encoding="utf-8")
    block = re.search(r"```mk\n(# Weights whose checkpoint.*?model checkpoint_demo.*?)```", text, re.S)
    assert block, "the manual's checkpoint_demo example"
    (tmp_path / "demo.mk").write_text(block.group(1))
    spec = mkdsl.load(tmp_path / "demo.mk")
    weights, _ = mkdsl.random_inputs(spec, batch=1, seq_len=16, seed=2)
    save_file(demo_tensors(weights, spec.model.const), str(tmp_path / "model.safetensors"))
    loaded, _ = mkdsl.load_weights(spec, tmp_path / "model.safetensors", host=True, progress=False)
    assert [n for n in weights if not same_weight(loaded[n], weights[n])] == []


def test_the_manuals_step_table_lists_every_step():
    from mkdsl.checkpoint.steps import STEPS

    text = DOCS.read_text(encoding="utf-8")
    for name, sd in STEPS.items():
        d = dict(sd.defaults)
        args = ", ".join(f"{p}={d[p]}" if p in d else p for p in sd.params)
        row = (f"| `{name}({args})` |" if args else f"| `{name}` |") + f" {sd.doc} |"
        assert row in text, row
    assert len(
        re.findall(r"^\| `(\w+)[(`]", text.split("## Checkpoints")[1].split("## What compiles")[0], re.M)
    ) == len(STEPS)


DSV3 = ROOT / "specs" / "deepseek_v3.mk"
WQ_A = '"model.layers.{l}.self_attn.q_a_proj.weight"\n                * "model.layers.{l}.self_attn.q_a_proj.weight_scale_inv"'


@pytest.mark.parametrize(
    "new, message",
    [
        (
            '"model.layers.{l}.self_attn.q_a_proj.weight"',
            r"`wq_a` is fp8_e4m3\(block=128\), stored as codes and scales",
        ),
        ('["a{l}", "b{l}"] * "c{l}"', r"`\*` pairs one codes pattern with one scales pattern, not a list"),
        ('"a{l}" * "c{l}.{e}"', r"the patterns of a concatenation or a pair must use the same placeholders"),
        (WQ_A + " | group_rows(groups=2, start=0)", r"`group_rows` takes \(groups, start, stop, dim=0\)"),
    ],
)
def test_pair_mistakes_are_diagnostics(tmp_path, new, message):
    text = DSV3.read_text()
    assert WQ_A in text
    bad = tmp_path / "bad.mk"
    bad.write_text(text.replace(WQ_A, new, 1))
    with pytest.raises(SpecError) as e:
        mkdsl.load(bad, "mini")
    rendered = e.value.render(str(bad), bad.read_text())
    assert re.search(message, rendered, re.S), rendered


def test_steps_move_scales_only_in_whole_groups():
    """A quantised tensor's scales move with its elements only where a step keeps each group of
    elements sharing a scale whole (the short last group too); otherwise the step is refused."""
    from mkdsl.checkpoint.mapping import Step, mapped_grid
    from mkdsl.checkpoint.steps import Grid

    grid = Grid((256, 300), (128, 128))  # scales [2, 3], the last column block 44 wide
    scales = np.arange(6).reshape(2, 3)

    def rows(start, stop, dim):
        return (Step("rows", (("start", start), ("stop", stop), ("dim", dim)), None),)

    out, moves = mapped_grid(grid, rows(128, 256, 0))
    assert out.shape == (128, 300) and moves[0](scales).tolist() == [[3, 4, 5]]
    out, moves = mapped_grid(grid, rows(256, 300, 1))
    assert out.shape == (256, 44) and moves[0](scales).tolist() == [[2], [5]]
    for bad in (rows(0, 64, 0), rows(100, 228, 1)):
        out, why = mapped_grid(grid, bad)
        assert out is None and "splits the scale groups of dimension" in why, why
    regroup = (Step("regroup", (("groups", 2), ("parts", 1), ("dim", 0)), None),)
    assert mapped_grid(grid, regroup)[0] == grid


def test_repeat_widens_a_per_head_weight():
    """`repeat(each=D)`: a stored per-head [NH] weight as the [NH * D] vector it scales, entry h
    at h*D .. h*D + D - 1 (the heads' layout); along another dim too, and a bad `each` refused."""
    from mkdsl.checkpoint.mapping import Step, apply_steps, mapped_shape

    def repeat(each, dim=0):
        return (Step("repeat", (("each", each), ("dim", dim)), None),)

    w = np.array([0.5, -2.0, 3.0], np.float32)
    assert mapped_shape((3,), repeat(4))[0] == (12,)
    assert apply_steps(w, repeat(4)).tolist() == [0.5] * 4 + [-2.0] * 4 + [3.0] * 4
    m = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert apply_steps(m, repeat(2, 1)).tolist() == [[0, 0, 1, 1, 2, 2], [3, 3, 4, 4, 5, 5]]
    shape, why = mapped_shape((3,), repeat(0))
    assert shape is None and "needs each >= 1" in why


def test_a_file_that_cannot_be_read_is_an_error_naming_the_tensor(llama, tmp_path, monkeypatch):
    """Truncated: refused when opened. Failing while the data is read (an I/O error after the
    header checked out): an error naming the tensor, not a traceback, and no weights returned."""
    from mkdsl.checkpoint.formats import open_checkpoint

    spec, weights = llama
    path = _hf(tmp_path, hf_tensors(weights, 2))
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[:-4096])
    with pytest.raises(CheckpointError, match=r"not a readable safetensors file"):
        mkdsl.load_weights(spec, truncated, host=True, progress=False)
    reader = open_checkpoint(path)
    read = reader.read

    def failing(name):
        if name == "model.layers.1.mlp.down_proj.weight":
            raise OSError("Input/output error")
        return read(name)

    monkeypatch.setattr(reader, "read", failing)
    with pytest.raises(CheckpointError, match=r"tensor `model\.layers\.1\.mlp\.down_proj\.weight` cannot be read"):
        mkdsl.load_weights(spec, reader, host=True, progress=False)


@pytest.mark.parametrize("name", [*sorted(PUBLISHED), "kimi_k3_dspark"])
def test_full_size_mappings_fit_the_published_headers(name, tmp_path):
    """At the published sizes, every tensor each mapping names exists in the checkpoint's header
    (names, shapes and types as shared/facts/models.md tabulates them) and fits its weight: the
    plan finds no problem. Nothing is read (a header-only reader)."""
    from mkdsl.checkpoint.formats import Stored
    from mkdsl.checkpoint.loader import plan_load

    model = mkdsl.load(ROOT / "specs" / f"{name}.mk").model
    header = published_header(name, model.schedule)
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": len(model.schedule)}))

    class Header:
        format, root = "hf", tmp_path

        def info(self, n):
            return Stored(n, *header[n]) if n in header else None

    plans = plan_load(model, Header())
    used = {n for wp in plans for p in wp.pieces for n in p.names}
    assert used == set(header), sorted(set(header) - used)[:5]


def test_every_spec_with_a_mapping_is_tested():
    """A spec that gains a checkpoint section must gain its layout here: the Llama family through
    `hf_tensors` / `gguf_tensors` (MAPPED; its kernel step from a checkpoint: tests/test_run.py,
    tests/test_smollm2.py), the others through `PUBLISHED` (their kernel tests load from it) or,
    for a mapping whose `config` names a transformers class, through transformers' own save of the
    model (tests/test_oracle_transformers.py)."""
    paths = list((ROOT / "specs").glob("*.mk"))
    with_mapping = {p.stem for p in paths if re.search(r"^checkpoint ", p.read_text(), re.M)}
    oracle = {p.stem for p in paths if re.search(r"^\s*architecture = ", p.read_text(), re.M)}
    assert with_mapping == set(MAPPED) | set(PUBLISHED) | oracle | {"kimi_k3_dspark"}  # the drafter: below


def test_the_drafter_loads_its_checkpoint_repeating_kv_heads(tmp_path):
    """Kimi K3's DSpark drafter from its published layout, at the mini size split over 4 devices
    (each of the 2 stored key/value heads written twice, `repeat_groups`): every weight equals the
    one the checkpoint was written from, its repeated heads copies of the stored ones."""
    source = (ROOT / "specs/kimi_k3_dspark.mk").read_text()
    assert "  TP = 1\n}" in source
    path = tmp_path / "dspark.mk"
    path.write_text(source.replace("  TP = 1\n}", "  TP = 4\n}"))
    spec = mkdsl.load(path, "mini")
    c = spec.model.const
    assert c["REP"] == 2
    weights, _ = mkdsl.random_inputs(spec, batch=1, seq_len=64, seed=5)
    save_file(dspark_tensors(weights, len(spec.model.schedule), c), str(tmp_path / "model.safetensors"))
    loaded, report = mkdsl.load_weights(spec, tmp_path, host=True, progress=False)
    want = dspark_expected(weights, c)
    assert not [w for w in want if not same_weight(loaded[w], want[w])]
    heads = np.split(np.asarray(loaded["wk"][0]), c["NKVR"], axis=-1)
    assert np.array_equal(heads[0], heads[1]) and not np.array_equal(heads[1], heads[2])


@pytest.mark.parametrize("mistake", ["missing", "shape", "dtype"])
def test_smollm2_mistakes_exit_1_naming_the_tensor(tmp_path, capsys, mistake):
    spec = mkdsl.load(ROOT / "specs" / "smollm2_135m.mk", "mini")
    weights, _ = mkdsl.random_inputs(spec, batch=1, seq_len=64, seed=4)
    tensors = hf_tensors(weights, 2)
    name = "model.layers.1.mlp.down_proj.weight"
    if mistake == "missing":
        del tensors[name]
    elif mistake == "shape":
        tensors[name] = np.ascontiguousarray(tensors[name][:, :-32])
    else:
        tensors[name] = tensors[name].astype(np.float16)
    argv = ["run", str(ROOT / "specs" / "smollm2_135m.mk"), "-p", "mini", "--weights", str(_hf(tmp_path, tensors))]
    assert main([*argv, "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    message = {
        "missing": r"missing tensor `model\.layers\.1\.mlp\.down_proj\.weight` for `w_down` \(layer 1\).*: expected \[\d+, \d+\]",
        "shape": r"tensor `model\.layers\.1\.mlp\.down_proj\.weight` is BF16 \[\d+, \d+\] \(after `transpose`: .*\); expected",
        "dtype": r"tensor `model\.layers\.1\.mlp\.down_proj\.weight` is F16, which bf16 cannot hold exactly \(expected BF16",
    }[mistake]
    assert re.search(message, err), err


DECODED = """
model decoded
const H = 256
const V = 512
dim B in 1 .. 8
weight embed:   bf16[V, H]
weight w_fp8:   bf16[H, H]   # from fp8 codes * 128x128 block scales, decoded
weight w_mx:    f32[H, H]    # from MXFP4 blocks * E8M0 scales, decoded
weight lm_head: bf16[H, V]
layer l0(x) {
  return x + linear(x, w_fp8) + linear(x, w_mx)
}
layers 1 { l0: otherwise }
step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  logits = linear(x, lm_head)
  return logits, argmax(logits)
}
checkpoint hf {
  embed   = "embed"
  w_fp8   = "fp8.weight" * "fp8.weight_scale_inv" | transpose ROUND
  w_mx    = "mx.blocks" * "mx.scales" | transpose
  lm_head = "head" | transpose
}
"""


@pytest.mark.parametrize("rounds", [True, False])
def test_pairs_decode_into_a_plain_dtype(tmp_path, rounds):
    """A pair into a plain dtype: fp8 x f32 block scale rounds (f32 product, then bf16), so only
    with `round`; MXFP4 (e2m1 x 2^(byte - 127)) is exact in f32. Checked against numpy decodes."""
    from checkpoint_writers import fp8_blocks, fp8_decode, openai_blocks

    (tmp_path / "d.mk").write_text(DECODED.replace("ROUND", "| round" if rounds else ""))
    spec = mkdsl.load(tmp_path / "d.mk")
    rng = np.random.default_rng(0)
    codes, scales = fp8_blocks(rng.standard_normal((256, 256)).astype(np.float32))
    nib = rng.integers(0, 16, (256, 256)).astype(np.uint8)  # [out, in]
    exps = rng.integers(120, 134, (256, 8)).astype(np.uint8)
    bf = ml_dtypes.bfloat16
    tensors = {"embed": np.ones((512, 256), bf), "head": np.ones((512, 256), bf), "mx.scales": exps}
    tensors |= {"fp8.weight": codes, "fp8.weight_scale_inv": scales, "mx.blocks": openai_blocks(nib)}
    path = _hf(tmp_path, tensors)
    if not rounds:
        with pytest.raises(CheckpointError, match=r"`fp8\.weight` F8_E4M3 \[256, 256\] \* .* decode to products bf16"):
            mkdsl.load_weights(spec, path, host=True, progress=False)
        return
    loaded, report = mkdsl.load_weights(spec, path, host=True, progress=False)
    assert same_weight(loaded["w_fp8"], fp8_decode(codes, scales).T.astype(bf))
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)
    want = e2m1[nib] * 2.0 ** (np.repeat(exps, 32, axis=1).astype(np.float64) - 127)
    assert same_weight(loaded["w_mx"], want.T.astype(np.float32))
    assert dict(report.rounded) == {"F8_E4M3*F32": 1}


def _values(w) -> np.ndarray:
    from mkdsl.lang.quant import QTensor, dequantize

    return np.asarray(dequantize(w) if isinstance(w, QTensor) else w, np.float32)


def _power_of_two_scales(weights: dict) -> dict:
    """The fp8 weights' block scales moved to powers of two (codes kept): their values then are
    what a bf16 save of fp8 blocks holds exactly."""
    from mkdsl.lang.quant import QTensor

    out = dict(weights)
    for n, w in weights.items():
        if isinstance(w, QTensor) and w.fmt.startswith("fp8"):
            out[n] = w._replace(scales=np.exp2(np.round(np.log2(np.asarray(w.scales)))).astype(np.float32))
    return out


@pytest.mark.parametrize("name", ["gpt_oss_120b", "deepseek_v3"])
def test_dequantised_saves_load_by_the_alternative_sources(name, tmp_path):
    """A bf16 save of a quantised model (no blocks, no scales; gpt-oss's experts [in, out]) loads by
    the mapping's `or` sources: every weight's values equal the quantised ones it was saved from,
    re-quantised exactly (MXFP4 values and fp8 codes times power-of-two scales are bf16 values);
    nothing is rounded. The published layout still loads by the first sources (above)."""
    spec = mkdsl.load(ROOT / "specs" / f"{name}.mk", "mini")
    m = spec.model
    weights, _ = mkdsl.random_inputs(spec, batch=1, seq_len=64, seed=7)
    weights = _power_of_two_scales(weights)
    saved = dequantised_save(name, PUBLISHED[name](weights, m.schedule, m.const))
    assert not any(n.endswith(("_scale_inv", "_blocks", "_scales")) for n in saved)
    save_file(saved, str(tmp_path / "model.safetensors"))
    loaded, report = mkdsl.load_weights(spec, tmp_path, host=True, progress=False)
    quantised = [n for n, w in weights.items() if hasattr(w, "codes")]
    assert quantised and all(hasattr(loaded[n], "codes") for n in quantised)
    bad = [n for n in weights if not np.array_equal(_values(loaded[n]), _values(weights[n]))]
    assert not bad, f"{name}: values differ: {bad}"
    assert not report.rounded, report.summary()


def test_a_dequantised_save_off_the_grid_rounds_only_where_the_mapping_says_so(tmp_path):
    """DeepSeek-V3's bf16 sources say `round`: bf16 values that are no fp8 codes times power-of-two
    block scales load rounded to nearest codes (DeepSeek's amax / 448 scales: within half an e4m3
    step, 2^-4 of a value, plus the block's smallest normal), counted in the report. gpt-oss's
    do not: a value off the MXFP4 grid is refused, naming the tensor."""
    import ml_dtypes

    spec = mkdsl.load(ROOT / "specs/deepseek_v3.mk", "mini")
    m = spec.model
    weights, _ = mkdsl.random_inputs(spec, batch=1, seq_len=64, seed=8)
    saved = dequantised_save("deepseek_v3", PUBLISHED["deepseek_v3"](weights, m.schedule, m.const))
    rng = np.random.default_rng(0)
    name = "model.layers.0.self_attn.q_a_proj.weight"
    saved[name] = (rng.standard_normal(saved[name].shape) * 0.05).astype(ml_dtypes.bfloat16)
    save_file(saved, str(tmp_path / "model.safetensors"))
    loaded, report = mkdsl.load_weights(spec, tmp_path, host=True, progress=False)
    assert report.rounded["BF16"] >= 1 and "BF16 -> fp8_e4m3(block=128)" in report.summary()
    want = saved[name].astype(np.float32).T
    got = _values(loaded["wq_a"])[0]
    assert np.all(np.abs(got - want) <= 2.0**-4 * np.abs(want) + 2.0**-9 * np.abs(want).max())
    assert not np.array_equal(got, want)  # it did round

    oss = mkdsl.load(ROOT / "specs/gpt_oss_120b.mk", "mini")
    w, _ = mkdsl.random_inputs(oss, batch=1, seq_len=64, seed=9)
    saved = dequantised_save("gpt_oss_120b", PUBLISHED["gpt_oss_120b"](w, oss.model.schedule, oss.model.const))
    victim = "model.layers.1.mlp.experts.down_proj"
    bad = saved[victim].astype(np.float32)
    bad[0, 0, 0] = bad[0, 0, 0] * 1.0078125 + 0.01  # no e2m1 code times its group's scale
    saved[victim] = bad.astype(ml_dtypes.bfloat16)
    root = tmp_path / "oss"
    root.mkdir()
    save_file(saved, str(root / "model.safetensors"))
    with pytest.raises(
        CheckpointError,
        match=r"tensor `model\.layers\.1\.mlp\.experts\.down_proj` holds values that mxfp4 cannot hold exactly.*`w2`",
    ):
        mkdsl.load_weights(oss, root, host=True, progress=False)
