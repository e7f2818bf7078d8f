"""Each spec's full-size sizes against the published configuration, where a source is at hand on
this offline machine (issue 27: the newer specs' sizes were written from memory):

* transformers' config classes whose defaults describe the published checkpoint (read live from
  the installed transformers, so the test does not transcribe them), compared field by field with
  the `config { ... }` block of the spec's `checkpoint hf` (the fields `verify --against
  transformers` builds the model from);
* the config.json values the team's model facts transcribe from published copies (kept here as
  literals, each with its source), for checkpoints no config class defaults to.

Specs with no such source are listed in UNSOURCED with why: their sizes stay as their headers cite.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mkdsl.api import load
from mkdsl.verify.transformers import hf_map

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted(p.stem for p in (ROOT / "specs").glob("*.mk"))
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
HEADS = ("num_key_value_heads", "head_dim")

# spec -> (config class, fields compared, why its defaults are that checkpoint's)
DEFAULTS = {
    "deepseek_v3": (
        "DeepseekV3Config",
        (
            *SIZES,
            "num_key_value_heads",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
        )
        + ("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size", "n_group")
        + ("topk_group", "first_k_dense_replace", "rms_norm_eps", "rope_theta"),
        "its defaults are DeepSeek-V3's (61 layers, 256 experts; the docstring names a tiny test copy)",
    ),
    "gpt_oss_120b": (
        "GptOssConfig",
        (*SIZES, *HEADS, "num_local_experts", "num_experts_per_tok", "sliding_window", "rms_norm_eps", "rope_theta"),
        "its defaults are gpt-oss-120b's (36 layers, 128 experts; the docstring names the 20b)",
    ),
    "llama4_scout": (
        "Llama4TextConfig",
        (*SIZES, *HEADS, "num_local_experts", "num_experts_per_tok", "interleave_moe_layer_step", "rms_norm_eps")
        + ("no_rope_layer_interval", "attention_chunk_size", "use_qk_norm", "floor_scale", "attn_scale", "rope_theta"),
        "its docstring names meta-llama/Llama-4-Scout-17B-16E",
    ),
    "mamba_codestral_7b": (
        "Mamba2Config",
        ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim", "state_size", "n_groups")
        + ("conv_kernel", "expand", "layer_norm_epsilon", "use_conv_bias", "residual_in_fp32"),
        "its defaults are Mamba-Codestral-7B's (a 32768 Mistral vocabulary, 8 groups), written when "
        "transformers added that model; the docstring's mamba2-2.8b has another vocabulary and width",
    ),
    "mixtral_8x7b": (
        "MixtralConfig",
        (*SIZES, "num_key_value_heads", "num_local_experts", "num_experts_per_tok", "rms_norm_eps", "rope_theta"),
        "its docstring names mistralai/Mixtral-8x7B-v0.1",
    ),
    "nemotron_h_8b": (
        "NemotronHConfig",
        ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", *HEADS, "mamba_num_heads")
        + ("mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel", "expand", "layer_norm_epsilon")
        + ("use_conv_bias", "mlp_hidden_act"),
        "its widths are Nemotron-H-8B's (the class was written for it; the docstring now names "
        "Nemotron-3-Nano, whose layer pattern is the default). The 52-layer pattern has no source here",
    ),
    "phi3_mini_4k": (
        "Phi3Config",
        (*SIZES, "num_key_value_heads", "rms_norm_eps", "rope_theta"),
        "its docstring names microsoft/Phi-3-mini-4k-instruct",
    ),
    "qwen3_next_80b_a3b": (
        "Qwen3NextConfig",
        (*SIZES[:2], *SIZES[3:], *HEADS, "linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads")
        + ("linear_value_head_dim", "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok")
        + ("moe_intermediate_size", "shared_expert_intermediate_size", "rms_norm_eps"),
        "its docstring names Qwen/Qwen3-Next-80B-A3B-Instruct (intermediate_size is unused: every layer is MoE)",
    ),
}

# spec -> (source, published values): the model facts' transcriptions of published config.json copies
PUBLISHED = {
    "qwen3_30b_a3b": (
        "Qwen/Qwen3-30B-A3B config.json (a verbatim copy in a public repo, as the model facts transcribe it)",
        dict(
            num_hidden_layers=48,
            hidden_size=2048,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            vocab_size=151936,
            rms_norm_eps=1e-6,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
    ),
    "smollm2_135m": (
        "HuggingFaceTB/SmolLM2-135M config.json (several verbatim copies, as the model facts transcribe them)",
        dict(
            num_hidden_layers=30,
            hidden_size=576,
            num_attention_heads=9,
            num_key_value_heads=3,
            intermediate_size=1536,
            vocab_size=49152,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
    ),
}

PUBLISHED["qwen3_next_80b_a3b"] = (
    "Qwen/Qwen3-Next-80B-A3B config.json (published copies, as the model facts transcribe them; "
    "Qwen3NextConfig's default rope_theta of 10000 is not the checkpoint's)",
    dict(rope_theta=10_000_000.0, partial_rotary_factor=0.25, full_attention_interval=4, num_hidden_layers=48),
)

# Kimi K3 has no transformers class: its constants against the model facts' config table.
KIMI = dict(L=93, H=7168, V=163840, NH=96, D=128, CONV=4, QR=1536, KVR=512, NOPE=128, XK=64, E=896, TOPK=16)
KIMI.update(FE=3072, LAT=3584, FS=2 * 3072, FD=33792, BLOCK=12)

UNSOURCED = {
    "deepseek_v2_lite": "DeepseekV2Config's defaults are not V2-Lite's (4096 wide, 32 layers); no copy of its config here",
    "gemma3_27b": "Gemma3TextConfig's defaults are a 2304-wide model, not the 27B; no copy of its config here",
    "llama3_8b": "LlamaConfig's defaults are Llama 2 7B's; no copy of Llama 3's config here",
    "olmo2_7b": "Olmo2Config's defaults keep OLMo 1's vocabulary (50304) and eps; no copy of OLMo 2's config here",
    "qwen2_5_7b": "Qwen2Config's defaults are not Qwen2.5-7B's (4096 wide, 32 layers); no copy of its config here",
    "kimi_k3_dspark": "a drafter of Kimi K3 (its widths are Kimi K3's, checked through kimi_k3)",
    "tiny": "a test model, no published checkpoint",
}


def test_every_spec_is_sourced_or_says_why_not():
    covered = set(DEFAULTS) | set(PUBLISHED) | {"kimi_k3"} | set(UNSOURCED)
    assert covered == set(SPECS), covered ^ set(SPECS)
    assert not set(UNSOURCED) & (set(DEFAULTS) | set(PUBLISHED) | {"kimi_k3"})


def _config(stem: str) -> dict:
    return hf_map(load(str(ROOT / "specs" / f"{stem}.mk")).model).config()


def _default(config, field: str):
    """A config's default; rope_theta lives in `rope_parameters` in transformers 5."""
    return config.rope_parameters["rope_theta"] if field == "rope_theta" else getattr(config, field)


@pytest.mark.parametrize("stem", sorted(DEFAULTS))
def test_sizes_equal_the_config_class_defaults(stem):
    transformers = pytest.importorskip("transformers", reason="the oracle extra (transformers) is not installed")
    name, fields, _why = DEFAULTS[stem]
    have, published = _config(stem), getattr(transformers, name)()
    wrong = {
        f: (have.get(f, "absent"), _default(published, f)) for f in fields if have.get(f) != _default(published, f)
    }
    assert not wrong, f"{stem}: spec vs {name} defaults: {wrong}"


@pytest.mark.parametrize("stem", sorted(PUBLISHED))
def test_sizes_equal_the_published_config(stem):
    source, values = PUBLISHED[stem]
    have = _config(stem)
    wrong = {f: (have.get(f, "absent"), v) for f, v in values.items() if have.get(f) != v}
    assert not wrong, f"{stem}: spec vs {source}: {wrong}"


def test_kimi_k3_sizes_equal_its_config_table():
    const = load(str(ROOT / "specs" / "kimi_k3.mk")).model.const
    assert {k: const[k] for k in KIMI} == KIMI


def test_nemotron_h_pattern_is_as_long_as_its_layers():
    """The one size with no source here is the layer pattern: at least it agrees with the layer count."""
    cfg = _config("nemotron_h_8b")
    assert len(cfg["hybrid_override_pattern"]) == cfg["num_hidden_layers"] == 52
