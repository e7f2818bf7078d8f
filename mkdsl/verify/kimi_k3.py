"""Kimi K3 for `verify --against transformers`: transformers has no K3 class, so `KimiK3ForCausalLM`
(the spec's `architecture`) is built here from transformers' `KimiLinearForCausalLM`, whose KDA,
MLA, MoE router, short convolutions and norms are K3's, with each part where K3 differs either
configured to match or replaced (and said so in the report, `NOTES`):

* KDA decay gate: KimiLinear's `-exp(A_log)·softplus(f)` is swapped for transformers' own
  Glm5Next forget gate with K3's `gate_lower_bound` (`lower·sigmoid(exp(A_log)·f)`): configured.
* KDA output gate: full rank (`g_proj`, H -> NH·D) in place of the low-rank `g_a_proj·g_b_proj`:
  `g_a_proj` widened to the full gate, `g_b_proj` the identity. Replaced.
* MLA output gate `sigmoid(x·Wg)` on the attention output before `o_proj`: added. Replaced.
* MLA's latent norms take the config's eps (KimiLinear builds them with 1e-6): configured.
* MoE: transformers' router (sigmoid, correction bias, renormalised, scaling 1.0) and shared
  experts; the routed experts run in K3's latent space (down, experts, norm, up): replaced.
* SiTU (`hidden_act = "situ"`, which ACT2FN lacks; beta 4, linear beta 25) as the MLPs' and
  experts' activation; the short convolutions keep SiLU: replaced.
* Attention residuals: no counterpart. The spec is compared with its residual-stream ops replaced
  by KimiLinear's plain adds (mkdsl/verify/plain_residual.py); those ops have float64 oracles.

The model is saved in K3's published layout (facts: "Checkpoint tensor names"), experts as the
dequantised save the spec's mapping also reads, so that the spec loads it through its own mapping.
"""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np

from mkdsl.lang.ir import Model
from mkdsl.ops import OPS

SITU_BETA, SITU_LINEAR_BETA = 4.0, 25.0  # K3's config: hidden_act = situ, beta 4, linear beta 25
P = "language_model.model."
BASE = "transformers' KimiLinearForCausalLM with Kimi K3's parts (mkdsl/verify/kimi_k3.py)"

NOTES = (
    "configured to match: the KDA decay gate (transformers' Glm5Next forget gate with K3's "
    "gate_lower_bound), the MLA latent norms' eps, the router (sigmoid, renormalised, scaling 1.0)",
    "replaced (no transformers form): the KDA full-rank output gate, the MLA output gate, the latent "
    "expert space (down, experts, norm, up around transformers' routing) and the SiTU activation",
    "no transformers counterpart: attention residuals; the spec runs with plain residual adds in "
    "their place here, and {ops} are checked against float64 oracles (tests/test_ops_kimi.py)",
)


def _situ_gate(g):
    import torch

    return SITU_BETA * torch.tanh(g / SITU_BETA) * torch.sigmoid(g)


def _situ_up(u):
    import torch

    return SITU_LINEAR_BETA * torch.tanh(u / SITU_LINEAR_BETA)


def _modules():
    """The torch module classes (defined here so that mkdsl imports without torch)."""
    import torch
    from torch import nn
    from torch.nn import functional as F
    from transformers.models.kimi_linear import modeling_kimi_linear as kl

    class SituGate(nn.Module):
        """SiTU's gate part, `beta·tanh(g / beta)·sigmoid(g)`, as an MLP's `act_fn`."""

        def forward(self, g):
            return _situ_gate(g)

    class SituUp(nn.Linear):
        """An MLP's up projection followed by SiTU's linear part, so `act(gate) * up` is SiTU."""

        def forward(self, x):
            return _situ_up(F.linear(x, self.weight))

    class GatedOut(nn.Linear):
        """MLA's `o_proj` with K3's output gate, `gate` set from the layer input by a pre-hook."""

        gate = None

        def forward(self, y):
            return F.linear(y * self.gate, self.weight)

    class LatentExperts(nn.Module):
        """K3's routed experts: `up(norm(Σ_k w_k · W2_k situ(W1_k z, W3_k z)))`, z = down(x)."""

        def __init__(self, config, latent: int):
            super().__init__()
            e, f, h = config.num_local_experts, config.moe_intermediate_size, config.hidden_size
            self.down = nn.Linear(h, latent, bias=False)
            self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * f, latent))
            self.down_proj = nn.Parameter(torch.empty(e, latent, f))
            self.norm = kl.KimiLinearRMSNorm(latent, config.rms_norm_eps)
            self.up = nn.Linear(latent, h, bias=False)

        def forward(self, x, top_k_index, top_k_weights):
            z = self.down(x)
            r = torch.zeros_like(z)
            for e in range(self.gate_up_proj.shape[0]):
                token, slot = torch.where(top_k_index == e)
                if len(token):
                    gate, up = F.linear(z[token], self.gate_up_proj[e]).chunk(2, dim=-1)
                    y = F.linear(_situ_gate(gate) * _situ_up(up), self.down_proj[e])
                    r.index_add_(0, token, y * top_k_weights[token, slot, None])
            return self.up(self.norm(r))

    return types.SimpleNamespace(
        SituGate=SituGate, SituUp=SituUp, GatedOut=GatedOut, LatentExperts=LatentExperts, kl=kl
    )


def layer_types(model: Model) -> tuple[list[str], list[str]]:
    """(attention, MLP) type of each layer, from the spec's kinds: a layer keeping a cache (state
    that is not a row state) attends fully, the others are linear; a layer that routes is sparse."""
    rows = model.row_states()
    attention, mlp = [], []
    for kind in model.schedule:
        g = model.kind(kind)
        states = {r.name for n in g.nodes for r in n.inputs if r.kind == "tensor" and r.name in _states(model)}
        attention.append("full_attention" if states - set(rows) else "linear_attention")
        mlp.append("sparse" if any(OPS[n.op].near_tie for n in g.nodes) else "dense")
    return attention, mlp


def _states(model: Model) -> set[str]:
    return {t.name for t in model.states}


def build(model: Model, fields: dict):
    """KimiLinearForCausalLM with K3's parts (module docstring), f32, parameters as initialised."""
    import torch
    from torch import nn
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextForgetGate

    m = _modules()
    fields = dict(fields)
    latent = fields.pop("routed_expert_hidden_size")
    fields.pop("attn_res_block_size", None)
    fields.pop("hidden_act")  # SiTU, installed below; KimiLinear's default act (SiLU) stays its convolutions' as K3's
    dense = fields.pop("first_k_dense_replace")
    lower = fields["linear_attn_config"]["gate_lower_bound"]
    attention, mlp = layer_types(model)
    if mlp != ["dense" if i < dense else "sparse" for i in range(len(mlp))]:
        from mkdsl.verify.transformers import OracleError

        raise OracleError(f"the spec's dense layers are not the first {dense} (config first_k_dense_replace)")
    config = m.kl.KimiLinearConfig(**fields, layer_types=attention, mlp_layer_types=mlp)
    config._attn_implementation = "eager"
    hf = m.kl.KimiLinearForCausalLM(config).eval().to(torch.float32)
    h, heads, d = config.hidden_size, config.linear_num_heads, config.linear_head_dim
    for layer in hf.model.layers:
        attn = layer.self_attn
        if isinstance(attn, m.kl.KimiLinearDeltaAttention):
            old = attn.forget_gate
            gate_config = types.SimpleNamespace(
                linear_head_dim=d, linear_num_heads=heads, hidden_size=h, linear_lower_bound=lower
            )
            attn.forget_gate = Glm5NextTextForgetGate(gate_config)
            with torch.no_grad():
                attn.forget_gate.A_log.copy_(old.A_log.reshape(-1))
                attn.forget_gate.dt_bias.copy_(old.dt_bias)
            attn.g_a_proj, attn.g_b_proj = nn.Linear(h, heads * d, bias=False), nn.Identity()
        else:
            attn.q_a_layernorm.variance_epsilon = config.rms_norm_eps
            attn.kv_a_layernorm.variance_epsilon = config.rms_norm_eps
            attn.g_proj = nn.Linear(h, config.num_attention_heads * config.v_head_dim, bias=False)
            attn.o_proj = m.GatedOut(attn.o_proj.in_features, h, bias=False)
            attn.register_forward_pre_hook(_set_output_gate, with_kwargs=True)
        mlps = [layer.mlp] if isinstance(layer.mlp, m.kl.KimiLinearMLP) else [layer.mlp.shared_experts]
        if not isinstance(layer.mlp, m.kl.KimiLinearMLP):
            layer.mlp.experts = m.LatentExperts(config, latent)
        for mlp_module in mlps:
            mlp_module.up_proj = m.SituUp(h, mlp_module.intermediate_size, bias=False)
            mlp_module.act_fn = m.SituGate()
    return hf


def _set_output_gate(module, args, kwargs):
    import torch

    x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    module.o_proj.gate = torch.sigmoid(module.g_proj(x))


def _k3_name(name: str, sparse: set[int]) -> str:
    """A parameter of the stand-in under K3's published name (one-to-one but the split tensors)."""
    if not name.startswith("model.layers."):
        return {"lm_head.weight": "language_model.lm_head.weight"}.get(name, "language_model." + name)
    _, _, layer, rest = name.split(".", 3)
    rest = rest.replace("self_attn.forget_gate.", "self_attn.").replace("self_attn.g_a_proj.", "self_attn.g_proj.")
    if int(layer) in sparse:
        rest = rest.replace("mlp.", "block_sparse_moe.", 1)
        for ours, theirs in (
            ("down.", "routed_expert_down_proj."),
            ("up.", "routed_expert_up_proj."),
            ("norm.", "routed_expert_norm."),
        ):
            rest = rest.replace("experts." + ours, theirs)
    return f"{P}layers.{layer}.{rest}"


def k3_tensors(hf) -> dict[str, np.ndarray]:
    """The stand-in's parameters in K3's layout: [out, in] matrices, the fused short convolution
    split into q / k / v, each routed expert's w1 (gate), w3 (up), w2 (down) on its own."""
    sparse = {i for i, t in enumerate(hf.config.mlp_layer_types) if t == "sparse"}
    out: dict[str, np.ndarray] = {}
    for name, p in hf.state_dict().items():
        x = p.detach().float().numpy()
        k3 = _k3_name(name, sparse)
        if k3.endswith("self_attn.conv1d.weight"):
            for part, piece in zip("qkv", np.split(x, 3, axis=0)):
                out[k3.replace("conv1d", f"{part}_conv1d")] = piece
        elif k3.endswith("experts.gate_up_proj") or k3.endswith("experts.down_proj"):
            base = k3.rsplit(".", 1)[0]
            for e, w in enumerate(x):
                if k3.endswith("down_proj"):
                    out[f"{base}.{e}.w2.weight"] = w
                else:
                    out[f"{base}.{e}.w1.weight"], out[f"{base}.{e}.w3.weight"] = np.split(w, 2, axis=0)
        else:
            out[k3] = x
    return out


def save(hf, directory: Path) -> None:
    """The stand-in's weights as K3's checkpoint (bf16; f32 where K3 keeps f32)."""
    import ml_dtypes
    from safetensors.numpy import save_file

    keep_f32 = ("e_score_correction_bias", "A_log", "dt_bias")
    tensors = {
        n: np.ascontiguousarray(x if n.endswith(keep_f32) else x.astype(ml_dtypes.bfloat16))
        for n, x in k3_tensors(hf).items()
    }
    save_file(tensors, str(Path(directory) / "model.safetensors"), metadata={"format": "pt"})


def reload(hf, directory: Path):
    """`hf` with the expert weights read back from the (grid-rounded) save."""
    import torch
    from safetensors.numpy import load_file

    stored = {n: x for f in sorted(Path(directory).glob("*.safetensors")) for n, x in load_file(str(f)).items()}
    sparse = {i for i, t in enumerate(hf.config.mlp_layer_types) if t == "sparse"}
    with torch.no_grad():
        for i in sparse:
            experts, base = hf.model.layers[i].mlp.experts, f"{P}layers.{i}.block_sparse_moe.experts"
            for e in range(experts.gate_up_proj.shape[0]):
                w1, w3, w2 = (stored[f"{base}.{e}.{w}.weight"].astype(np.float32) for w in ("w1", "w3", "w2"))
                experts.gate_up_proj[e].copy_(torch.from_numpy(np.concatenate([w1, w3])))
                experts.down_proj[e].copy_(torch.from_numpy(w2))
    return hf
