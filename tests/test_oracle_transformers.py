"""Specs against the models' own implementations (mkdsl/verify/transformers.py): every spec whose
`checkpoint hf` names a transformers class is built at its mini size with random weights, loaded
through its mapping and compared per layer; a spec with one equation broken fails naming the
layer and the op. Needs the `oracle` extra (torch, transformers), which .ci/run installs: these
tests do not skip without it, they fail."""

from __future__ import annotations

from pathlib import Path

import pytest

import mkdsl
from mkdsl.cli import main
from mkdsl.lang.diagnostics import SpecError
from mkdsl.verify.transformers import OracleError, verify_against_transformers

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted(ROOT.glob("specs/*.mk"))


def _architecture(path: Path) -> str | None:
    spec = mkdsl.load(path)
    return next((c.architecture for c in spec.model.checkpoints if c.format == "hf"), None)


ORACLE_SPECS = [p for p in SPECS if _architecture(p) is not None]


def test_the_specs_with_an_architecture():
    """Every spec whose model transformers implements says so (more join as their mappings land)."""
    names = {p.stem for p in ORACLE_SPECS}
    assert {
        "qwen3_next_80b_a3b",
        "qwen3_30b_a3b",
        "llama3_8b",
        "smollm2_135m",
        "gemma3_27b",
        "olmo2_7b",
        "phi3_mini_4k",
        "mixtral_8x7b",
        "qwen2_5_7b",
        "deepseek_v2_lite",
        "nemotron_h_8b",
        "mamba_codestral_7b",
        "llama4_scout",
    } <= names


@pytest.mark.slow
@pytest.mark.parametrize("path", ORACLE_SPECS, ids=lambda p: p.stem)
def test_spec_agrees_with_transformers(path):
    spec = mkdsl.load(path, "mini")
    report = verify_against_transformers(spec.model, str(path), steps=1, prompt=8)
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
