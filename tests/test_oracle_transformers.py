"""Specs against the models' own implementations (mkdsl/verify/transformers.py): every spec whose
`checkpoint hf` names a transformers class is built at its mini size with random weights, loaded
through its mapping and compared per layer; a spec with one equation broken fails naming the
layer and the op. Needs the `oracle` extra (torch, transformers), which .ci/run installs: these
tests do not skip without it, they fail."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mkdsl
from mkdsl.cli import main
from mkdsl.lang.diagnostics import SpecError
from mkdsl.verify.transformers import OracleError, verify_against_transformers, verify_checkpoint

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted(ROOT.glob("specs/*.mk"))

# The specs transformers has no class for, and what checks their equations instead. Every other
# spec in specs/ is compared with transformers below: one without a `checkpoint hf` mapping naming
# its class fails there, saying so. Kimi K3 is compared with mkdsl's stand-in (`KimiK3ForCausalLM`:
# transformers' KimiLinear with K3's parts, mkdsl/verify/kimi_k3.py), layer by layer, its attention
# residuals replaced by plain adds (their ops have float64 oracles, tests/test_ops_kimi.py); its
# DSpark drafter with another (`KimiK3DSparkForCausalLM`: transformers' Qwen3 decoder layers with
# the drafter's context cache and Markov bias, mkdsl/verify/dspark.py), step by step
# (mkdsl/verify/draft_step.py).
NO_TRANSFORMERS_CLASS = {
    "tiny": "mkdsl's own test model: no published checkpoint, no model to compare with",
}
# Prompt tokens where 8 do not reach what a spec must show: the drafter's context rows past its
# mini window of 64 slots (slots reused, the oldest rows masked).
PROMPT_TOKENS = {"kimi_k3_dspark": 70}
ORACLE_SPECS = [p for p in SPECS if p.stem not in NO_TRANSFORMERS_CLASS]


def _architecture(path: Path) -> str | None:
    spec = mkdsl.load(path)
    return next((c.architecture for c in spec.model.checkpoints if c.format == "hf"), None)


def test_every_spec_is_compared_or_says_why():
    """specs/ is enumerated: each spec is compared with transformers (test_spec_agrees_with_transformers)
    or named above with what checks it instead; every spec but tiny maps its published checkpoint."""
    stems = {p.stem for p in SPECS}
    assert set(NO_TRANSFORMERS_CLASS) <= stems, "a spec named in NO_TRANSFORMERS_CLASS is gone"
    assert len(ORACLE_SPECS) >= 17  # the 12 of issue 24, Nemotron-H, Mamba-Codestral, Llama 4 Scout, Kimi K3, DSpark
    for path in SPECS:
        if path.stem == "tiny":
            continue
        formats = [c.format for c in mkdsl.load(path).model.checkpoints]
        assert "hf" in formats, f"{path.stem} has no `checkpoint hf` mapping of its published checkpoint"
        if path.stem not in NO_TRANSFORMERS_CLASS:
            assert _architecture(path), f"{path.stem}: its `checkpoint hf` has no config {{ architecture = ... }}"


@pytest.mark.slow
@pytest.mark.parametrize("path", ORACLE_SPECS, ids=lambda p: p.stem)
def test_spec_agrees_with_transformers(path):
    spec = mkdsl.load(path, "mini")
    report = verify_against_transformers(spec.model, str(path), steps=1, prompt=PROMPT_TOKENS.get(path.stem, 8))
    print(report.text())
    assert report.ok, report.text()
    assert 0 < report.worst["layer"] and 0 < report.worst["logits"] <= 1  # something was compared


@pytest.mark.slow
def test_broken_norm_is_named(tmp_path):
    """Qwen3-Next's (1 + w) input norm of the GDN layers written as w: layer 0 (the first GDN
    layer) fails, and the op named is that rmsnorm, at its line."""
    source = (ROOT / "specs/qwen3_next_80b_a3b.mk").read_text()
    good = "layer gdn(x) {\n  x = x + gated_deltanet(rmsnorm(x, input_norm, eps=EPS, offset=1.0))"
    assert good in source
    broken = source.replace(good, good.replace(", offset=1.0))", "))"))
    path = tmp_path / "broken.mk"
    path.write_text(broken)
    line = broken[: broken.index("gated_deltanet(rmsnorm(x, input_norm, eps=EPS))")].count("\n") + 1
    report = verify_against_transformers(mkdsl.load(path, "mini").model, str(path), steps=1, prompt=8)
    assert not report.ok
    first = next(f for f in report.failures if " layer " in f)
    assert "prefill layer 0 (gdn)" in first and f"`rmsnorm` at spec line {line}" in first, first


@pytest.mark.slow
def test_kimi_k3_with_a_broken_mla_split_is_named(tmp_path, capsys):
    """`mkdsl verify --against transformers` on a copy of Kimi K3 whose MLA takes its latent from the
    wrong end of the kv projection (the 64 extra key dims first): the first MLA layer (3) fails and
    the op named is that `slice`, at its line; the report says what the stand-in configured or
    replaced and which ops only float64 oracles check."""
    source = (ROOT / "specs/kimi_k3.mk").read_text()
    good = "c = rmsnorm(slice(kv, start=0, size=KVR), mla_kvnorm, eps=EPS)"
    extra = "slice(kv, start=KVR, size=XK)"
    assert good in source and extra in source
    broken = source.replace(good, good.replace("start=0", "start=XK")).replace(extra, "slice(kv, start=0, size=XK)")
    path = tmp_path / "kimi_k3.mk"
    path.write_text(broken)
    line = broken[: broken.index("slice(kv, start=XK, size=KVR)")].count("\n") + 1
    args = ["verify", str(path), "--profile", "mini", "--against", "transformers", "--steps", "1"]
    assert main([*args, "--prompt-tokens", "8"]) == 1
    out = capsys.readouterr().out
    first = next(x for x in out.splitlines() if "FAILED: prefill layer" in x)
    assert "prefill layer 3 (mla_moe)" in first and f"`slice` at spec line {line}" in first, out
    assert "KimiLinearForCausalLM with Kimi K3's parts" in out and "`res_mix`" in out and "float64" in out, out
    assert "layer by layer, every op but `res_mix`, `res_snapshot`, `res_init`: kda_dense (layers 0)" in out, out
    assert not any("layer 0 (" in x or "layer 1 (" in x for x in out.splitlines() if "FAILED" in x), out


@pytest.mark.slow
def test_dspark_without_its_q_norm_is_named(tmp_path, capsys):
    """`mkdsl verify --against transformers` on a copy of the DSpark drafter whose queries skip
    their per-head RMSNorm: the first drafter step's layer 0 fails, and the op named is the first
    value that then differs, the `rope` of that query line (the stand-in's `q_norm` output has no
    match; the spec's rotated queries are compared with the stand-in's); the report says what the
    stand-in takes from transformers and what is mkdsl's glue."""
    source = (ROOT / "specs/kimi_k3_dspark.mk").read_text()
    good = "q = rope(rmsnorm(linear(h, wq), q_norm, heads=NH, eps=EPS), positions"
    assert good in source
    broken = source.replace(good, "q = rope(linear(h, wq), positions")
    path = tmp_path / "kimi_k3_dspark.mk"
    path.write_text(broken)
    line = broken[: broken.index("q = rope(linear(h, wq), positions")].count("\n") + 1
    args = ["verify", str(path), "--profile", "mini", "--against", "transformers", "--steps", "1"]
    assert main([*args, "--prompt-tokens", "4"]) == 1
    out = capsys.readouterr().out
    first = next(x for x in out.splitlines() if "FAILED: draft step 0 layer" in x)
    assert "layer 0 (decoder)" in first and f"`rope` at spec line {line}" in first, out
    assert "Qwen3DecoderLayer" in out and "Markov bias" in out and "q_norm" in out, out


@pytest.mark.slow
def test_dspark_with_a_narrower_window_is_named(tmp_path):
    """The drafter's context window written 8 in place of its cache's W (64 at mini): with the
    prompt's 12 context rows before the anchor, the rows 8 or more positions back are masked in the
    spec but not in the stand-in, and the first drafter step's layer 0 fails naming
    `block_attention` (the stand-in's attention output has no match)."""
    source = (ROOT / "specs/kimi_k3_dspark.mk").read_text()
    good = "heads=NH, kv_heads=NKVR, window=W)"
    assert source.count(good) == 1
    path = tmp_path / "kimi_k3_dspark.mk"
    path.write_text(source.replace(good, good.replace("window=W", "window=8")))
    report = verify_against_transformers(mkdsl.load(path, "mini").model, str(path), steps=1, prompt=12)
    first = next(f for f in report.failures if " layer " in f)
    assert "draft step 0 layer 0 (decoder)" in first and "`block_attention`" in first, report.text()


def test_kimi_k3_checkpoint_is_not_read_by_transformers(tmp_path):
    with pytest.raises(OracleError, match="no `KimiK3ForCausalLM` to read a checkpoint with"):
        verify_checkpoint(mkdsl.load(ROOT / "specs/kimi_k3.mk", "mini").model, "kimi_k3", tmp_path)


def test_plain_residual_drops_the_block_carry():
    """The residual-stream ops (`OpDef.plain_residual`) leave Kimi K3's stack: one carry, the stream,
    each layer `x + attn(norm(x))` then `+ mlp(norm(.))`, and the embedding entering layer 0."""
    from mkdsl.verify.plain_residual import plain_residual_model, replaced_ops

    model = mkdsl.load(ROOT / "specs/kimi_k3.mk", "mini").model
    plain = plain_residual_model(model)
    assert replaced_ops(model) == ["res_mix", "res_snapshot", "res_init"] and not replaced_ops(plain)
    for kind in plain.kinds:
        assert [p.name for p in kind.params] == ["prefix"] and len(kind.results) == 1
        assert kind.nodes[0].op == "rmsnorm" and kind.nodes[0].inputs[0].name == "prefix"
    stack = next(n for n in plain.step.nodes if n.op == "layers")
    assert [r.name for r in stack.inputs] == ["embedding"] and len(stack.outputs) == 1
    assert plain_residual_model(plain) == plain  # nothing left to replace


def test_config_section_folds(tmp_path):
    path = tmp_path / "c.mk"
    path.write_text(
        (ROOT / "specs/tiny.mk").read_text()
        + """
const FACTOR = 8
checkpoint hf {
  config {
    architecture = "LlamaForCausalLM"
    rope_scaling.factor = FACTOR / 2
    rope_scaling.rope_type = "llama3"
    layer_types = ["a", "b"]
    q_lora_rank = null
    tie_word_embeddings = true
  }
}
"""
    )
    with pytest.raises(SpecError) as e:  # the section maps no weight: reported, the config still parses
        mkdsl.load(path)
    assert "does not say where" in str(e.value)


def test_config_errors(tmp_path):
    base = (ROOT / "specs/smollm2_135m.mk").read_text()
    twice = base.replace("    rope_theta = THETA\n", "    rope_theta = THETA\n    rope_theta = 1.0\n", 1)
    path = tmp_path / "twice.mk"
    path.write_text(twice)
    with pytest.raises(SpecError, match="config field `rope_theta` is set twice"):
        mkdsl.load(path)
    path.write_text(base.replace('architecture = "LlamaForCausalLM"', "architecture = 3", 1))
    with pytest.raises(SpecError, match="names a transformers class"):
        mkdsl.load(path)


def test_config_values():
    cmap = next(
        c for c in mkdsl.load(ROOT / "specs/qwen3_next_80b_a3b.mk", "mini").model.checkpoints if c.format == "hf"
    )
    config = cmap.config()
    assert cmap.architecture == "Qwen3NextForCausalLM" and "architecture" not in config
    assert config["hidden_size"] == 256 and config["partial_rotary_factor"] == 0.25 and config["norm_topk_prob"] is True


def test_no_architecture_is_an_error():
    with pytest.raises(OracleError, match="no `checkpoint hf` section"):
        verify_against_transformers(mkdsl.load(ROOT / "specs/tiny.mk").model, "specs/tiny.mk")


def test_cli_usage(capsys):
    assert main(["verify", str(ROOT / "specs/tiny.mk"), "--against", "transformers", "--steps", "0"]) == 2
    assert main(["verify", str(ROOT / "specs/tiny.mk"), "--against", "transformers"]) == 1
    assert "no `checkpoint hf` section" in capsys.readouterr().err


@pytest.fixture(scope="module")
def saved_smollm2(tmp_path_factory):
    """A small saved transformers checkpoint: SmolLM2's mini size, random weights, bf16."""
    from mkdsl.verify.transformers import build_hf_model, save_bf16

    root = tmp_path_factory.mktemp("smollm2-mini")
    save_bf16(build_hf_model(mkdsl.load(ROOT / "specs/smollm2_135m.mk", "mini").model, seed=4), root)
    return root


@pytest.mark.slow
def test_a_saved_checkpoint_agrees_and_a_config_the_spec_does_not_say_fails(saved_smollm2, tmp_path, capsys):
    """`--against transformers --weights DIR`: transformers reads the directory itself, the spec
    its mapping; three random prompts, each compared layer by layer and teacher forced. The same
    weights with a rope_theta in config.json that the spec does not have (/ 100): transformers
    rotates otherwise, and the first layer's `rope` is named."""
    spec = str(ROOT / "specs/smollm2_135m.mk")
    args = ["verify", spec, "--profile", "mini", "--against", "transformers", "--steps", "1", "--prompt-tokens", "6"]
    assert main([*args, "--weights", str(saved_smollm2)]) == 0
    out = capsys.readouterr().out
    assert "prompt 3:" in out and "agrees with transformers" in out, out
    for f in saved_smollm2.iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "config.json").unlink()
    config = json.loads((saved_smollm2 / "config.json").read_text())
    theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
    config.setdefault("rope_parameters", {})["rope_theta"] = theta / 100
    config["rope_theta"] = theta / 100
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main([*args, "--weights", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "FAILED: prefill layer 0" in out and "`rope`" in out, out


def test_weights_usage_errors(tmp_path, capsys):
    spec = str(ROOT / "specs/smollm2_135m.mk")
    assert main(["verify", spec, "--weights", str(tmp_path)]) == 2
    assert "add --against transformers" in capsys.readouterr().err
    assert main(["verify", spec, "--against", "transformers", "--prompt", "hi"]) == 2
    assert "--prompt needs --weights" in capsys.readouterr().err
    assert main(["verify", spec, "--against", "transformers", "--weights", str(tmp_path / "none")]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert main(["verify", spec, "--profile", "mini", "--against", "transformers", "--weights", str(tmp_path)]) == 1
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("gap", [0.001, 0.1], ids=["near-tie", "clear"])
def test_a_failing_decode_row_is_rerun_at_its_routing_near_tie(gap):
    """A decode step's row that fails in a layer that routes is run again (from the same state:
    `rerun`) with the routing's near tie taken the other way (`OpDef.near_tie` of `topk`): a near
    tie (top-k gap 0.1% of the k-th score, under ROUTE_TIE) is reported, not failed; a clear choice
    (10%) is no near tie, and the row fails (no `moved`: no ill-conditioning check). The rerun here routes scores whose k-th and next
    values are `gap` apart and gives back transformers' output."""
    import numpy as np

    from mkdsl.lazy import jnp
    from mkdsl.ops import OPS
    from mkdsl.verify.oracle_trace import HFTrace
    from mkdsl.verify.transformers import OracleReport, compare_layer

    model = mkdsl.load(ROOT / "specs/qwen3_30b_a3b.mk", "mini").model
    k, h, p = model.const["TOPK"], model.const["H"], 5
    rng = np.random.default_rng(1)
    entering = rng.standard_normal((p + 1, h)).astype(np.float32)
    want = entering + rng.standard_normal((p + 1, h)).astype(np.float32)
    layers = len(model.schedule)
    trace = HFTrace(None, [entering] * layers, [want] * layers, [[] for _ in range(layers)])
    got = want[p : p + 1] + 0.5  # far outside the bound
    scores = np.sort(rng.uniform(0.2, 0.3, size=(1, 16)))[:, ::-1].copy()
    scores[0, k] = scores[0, k - 1] * (1 - gap)  # the runner-up, `gap` below the k-th choice
    scores[0, k + 1 :] = np.minimum(scores[0, k + 1 :], scores[0, k] * 0.5)  # the rest well below it

    def rerun(row):
        def run():
            OPS["topk"].reference(jnp.asarray(scores), k=k)  # the layer's routing, under the near-tie rule
            return want[p : p + 1]

        return row, run

    report = OracleReport("spec", "arch")
    compare_layer(report, model, 0, got, trace, slice(p, p + 1), "step 1", rerun)
    if gap < 2.0**-6:
        assert report.ties and not report.failures, report.text()
        assert "step 1 layer 0" in report.ties[0] and "row 5" in report.ties[0] and "runner-up fits" in report.ties[0]
    else:
        assert report.failures and not report.ties, report.text()
        assert "step 1 layer 0" in report.failures[0]


@pytest.mark.parametrize("tie", [None, 0, 1, 2])
def test_a_greedy_token_after_a_routing_near_tie_of_the_spec_s_run_is_a_tie(tie):
    """Greedy token 1 differs from transformers' choice by a wide margin: a failure, unless the
    spec's own run made a routing near tie at or before that token (`free_run`'s `ties`), from which
    its stream may take other experts than transformers'."""
    import numpy as np

    from mkdsl.verify.oracle_trace import HFTrace
    from mkdsl.verify.transformers import OracleReport, check_greedy

    logits = np.random.default_rng(2).standard_normal((6, 32)).astype(np.float32)
    prompt, greedy = 4, np.asarray([logits[3].argmax(), logits[4].argmin()], np.int32)
    report = OracleReport("spec", "arch")
    check_greedy(report, HFTrace(logits, [], [], []), greedy, prompt, tie)
    if tie is not None and tie <= 1:
        assert not report.failures and "greedy token 1" in report.ties[0] and "routing near tie" in report.ties[0]
    else:
        assert report.failures and "greedy token 1" in report.failures[0] and "no near tie" in report.failures[0]


@pytest.mark.parametrize("gap", [0.001, 0.1], ids=["near-tie", "clear"])
def test_the_spec_s_run_watches_its_routing_for_near_ties(gap):
    """While `free_run` runs, each routing op (`OpDef.near_tie`) of the model reports a row whose
    k-th choice is within ROUTE_TIE of its runner-up, and its results stay the plain reference's."""
    import numpy as np

    from mkdsl.lazy import jnp
    from mkdsl.ops import OPS
    from mkdsl.verify.transformers import watching_route_ties

    model = mkdsl.load(ROOT / "specs/kimi_k3.mk", "mini").model
    k = model.const["TOPK"]
    scores = np.sort(np.random.default_rng(3).uniform(0.2, 0.8, size=(2, 16)))[:, ::-1].copy()
    scores[1, k] = scores[1, k - 1] - gap  # row 1's runner-up, `gap` below its k-th choice
    scores[1, k + 1 :] = np.minimum(scores[1, k + 1 :], scores[1, k] - 0.1)
    scores[0, k:] = np.minimum(scores[0, k:], scores[0, k - 1] - 0.1)  # row 0: a clear choice
    bias = jnp.zeros(16, jnp.float32)
    want = OPS["route"].reference(jnp.asarray(scores), bias, k=k)
    found, original = [], OPS["route"]
    with watching_route_ties(model, lambda: found.append(True)):
        got = OPS["route"].reference(jnp.asarray(scores), bias, k=k)
    assert OPS["route"] is original  # restored
    assert np.array_equal(np.asarray(got[1]), np.asarray(want[1]))
    assert found == ([True] if gap < 2.0**-6 else [])
    with watching_route_ties(model, lambda: None, flip=0):  # the first near tie takes the runner-up
        ids = np.asarray(OPS["route"].reference(jnp.asarray(scores), bias, k=k)[1])
    assert np.array_equal(ids[0], np.asarray(want[1])[0])  # row 0 had no near tie
    swapped = np.asarray(want[1])[1].copy()
    swapped[-1] = k if gap < 2.0**-6 else swapped[-1]  # the k-th choice given to the runner-up
    assert np.array_equal(ids[1], swapped)
