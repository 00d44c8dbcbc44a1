"""The grouped mixture-of-experts layer (engine/model/moe.py `SparseMoE`) against a per-token
reference: tokens routed to every expert, experts that no token chose, all tokens to one expert,
a single token (a decode step), with and without renormalized top-k weights; and the checkpoint
layouts it loads (Mixtral's names, per-expert tensors, transformers 5's fused 3-D tensors)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from engine.model.arch import ModelArchConfig, canonical_weights
from engine.model.decoder import TensorParallelShard
from engine.model.moe import SparseMoE

HIDDEN, EXPERTS, INTER = 32, 4, 24


def _moe(top_k: int, renormalize: bool) -> SparseMoE:
    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=EXPERTS,
                                         num_experts_per_tok=top_k, moe_intermediate_size=INTER,
                                         norm_topk_prob=renormalize)
    arch = ModelArchConfig.from_hf_config(config)
    torch.manual_seed(top_k)
    moe = SparseMoE(arch, TensorParallelShard.of(arch))
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0.0, 0.5)
    return moe


def _reference(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax router, top-k, optional renormalization, the chosen experts' SwiGLU."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ moe.gate.weight.T, dim=-1)
        weights, chosen = torch.topk(probs, moe.top_k)
        if moe.gate.renormalize:
            weights = weights / weights.sum()
        for weight, e in zip(weights, chosen.tolist()):
            gate, up = (moe.experts_gate_up[e] @ x[t]).chunk(2)
            out[t] += weight * (moe.experts_down[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("top_k,renormalize", [(2, True), (2, False), (1, False), (4, True)])
@pytest.mark.parametrize("routing", ["spread", "none-to-two-experts", "all-to-one", "one-token"])
def test_grouped_experts_match_the_per_token_reference(top_k, renormalize, routing):
    moe = _moe(top_k, renormalize)
    x = torch.randn(1 if routing == "one-token" else 37, HIDDEN)
    with torch.no_grad():
        if routing == "none-to-two-experts":  # positive inputs: experts 2 and 3 never win (with top_k <= 2)
            x = x.abs()
            moe.gate.weight[2:] = -10.0
        if routing == "all-to-one":  # expert 3 first for every token
            x = x.abs()
            moe.gate.weight[3] = 10.0
        probs = torch.softmax(x @ moe.gate.weight.T, dim=-1)
        chosen = set(torch.topk(probs, top_k).indices.flatten().tolist())
        if routing == "spread":
            assert chosen == set(range(EXPERTS))
        if routing == "none-to-two-experts" and top_k <= 2:
            assert chosen <= {0, 1}
        if routing == "all-to-one":
            assert (torch.topk(probs, 1).indices == 3).all()
        torch.testing.assert_close(moe(x), _reference(moe, x), rtol=1e-5, atol=1e-4)  # outputs reach ~100


def test_expert_checkpoint_layouts_read_as_one_naming():
    """Mixtral's block_sparse_moe names, per-expert tensors and fused 3-D tensors all come out as
    the router `mlp.gate.weight` and `mlp.experts.{e}.{gate,up,down}_proj.weight`, values split
    with the gate rows first."""
    gate_up = torch.randn(2, 2 * INTER, HIDDEN)
    down = torch.randn(2, HIDDEN, INTER)
    fused = dict(canonical_weights([("model.layers.0.mlp.experts.gate_up_proj", gate_up),
                                    ("model.layers.0.mlp.experts.down_proj", down)]))
    assert torch.equal(fused["model.layers.0.mlp.experts.1.gate_proj.weight"], gate_up[1, :INTER])
    assert torch.equal(fused["model.layers.0.mlp.experts.1.up_proj.weight"], gate_up[1, INTER:])
    assert torch.equal(fused["model.layers.0.mlp.experts.0.down_proj.weight"], down[0])
    mixtral = dict(canonical_weights([("model.layers.3.block_sparse_moe.gate.weight", (4, 8)),
                                      ("model.layers.3.block_sparse_moe.experts.2.w1.weight", (6, 8)),
                                      ("model.layers.3.block_sparse_moe.experts.2.w3.weight", (6, 8)),
                                      ("model.layers.3.block_sparse_moe.experts.2.w2.weight", (8, 6)),
                                      ("model.layers.3.self_attn.q_proj.weight", (8, 8))]))
    assert mixtral == {"model.layers.3.mlp.gate.weight": (4, 8), "model.layers.3.mlp.experts.2.gate_proj.weight": (6, 8),
                       "model.layers.3.mlp.experts.2.up_proj.weight": (6, 8),
                       "model.layers.3.mlp.experts.2.down_proj.weight": (8, 6),
                       "model.layers.3.self_attn.q_proj.weight": (8, 8)}


def _assert_same_routing(weights, experts, want_weights, want_experts) -> None:
    """The same experts per token, with the same weights, in any order."""
    order, want_order = experts.argsort(dim=-1), want_experts.argsort(dim=-1)
    assert torch.equal(experts.gather(1, order), want_experts.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order))


@pytest.mark.parametrize("renormalize", [True, False])
def test_deepseek_v3_grouped_routing_matches_transformers(renormalize):
    """DeepSeek-V3's router (GLM-4.5 shares it): sigmoid scores, a correction bias that steers
    the choice only, the top groups by their two best scores, the scaling factor. Same experts
    and weights per token as transformers' DeepseekV3TopkRouter, with a bias large enough to
    change the choice and groups that exclude some tokens' best experts."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from engine.model.moe import Router
    moe = dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
               norm_topk_prob=renormalize, moe_intermediate_size=INTER, hidden_size=HIDDEN)
    reference = DeepseekV3TopkRouter(transformers.DeepseekV3Config(**moe)).eval()
    arch = ModelArchConfig.from_hf_config(transformers.Glm4MoeConfig(
        vocab_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, first_k_dense_replace=1, n_shared_experts=1, **moe))
    router = Router(arch)
    torch.manual_seed(0)
    with torch.no_grad():
        reference.weight.normal_(0.0, 0.5)
        reference.e_score_correction_bias.normal_(0.0, 0.5)
        router.weight.copy_(reference.weight)
        router.e_score_correction_bias.copy_(reference.e_score_correction_bias)
    x = torch.randn(64, HIDDEN)
    _, want_weights, want_experts = reference(x)
    weights, experts = router(x)
    _assert_same_routing(weights, experts, want_weights, want_experts)
    # the bias changed some choices, and the groups kept some tokens from their best experts
    unbiased = torch.topk(torch.sigmoid(x @ reference.weight.T), 4, dim=-1).indices.sort(-1).values
    assert not torch.equal(unbiased, experts.sort(-1).values)


_V2_MLA = dict(vocab_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=16,
               qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, first_k_dense_replace=1, n_shared_experts=1)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_routing_matches_transformers(method):
    """DeepSeek-V2's router: softmax scores, the top k of all experts (V2-Lite's greedy) or of
    the best groups by their best score (V2's group-limited greedy), times the scaling factor.
    Same experts and weights per token as transformers' DeepseekV2TopkRouter; the groups keep
    some tokens from their best experts."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from engine.model.moe import Router
    groups = dict(n_group=4, topk_group=2) if method == "group_limited_greedy" else {}
    config = transformers.DeepseekV2Config(n_routed_experts=16, num_experts_per_tok=4, routed_scaling_factor=1.5,
                                           topk_method=method, moe_intermediate_size=INTER, hidden_size=HIDDEN,
                                           **groups, **_V2_MLA)
    reference = DeepseekV2TopkRouter(config).eval()
    arch = ModelArchConfig.from_hf_config(config)
    assert arch.moe_router == ("softmax_group_topk" if groups else "softmax_topk")
    router = Router(arch)
    torch.manual_seed(0)
    with torch.no_grad():
        reference.weight.normal_(0.0, 0.5)
        router.weight.copy_(reference.weight)
    x = torch.randn(64, HIDDEN)
    _, want_weights, want_experts = reference(x)
    weights, experts = router(x)
    _assert_same_routing(weights, experts, want_weights, want_experts)
    unlimited = torch.topk(x @ reference.weight.T, 4, dim=-1).indices.sort(-1).values
    assert torch.equal(unlimited, experts.sort(-1).values) == (not groups)


@pytest.mark.parametrize("field, value, named", [("topk_method", "noaux_tc", "topk_method 'noaux_tc'"),
                                                  ("norm_topk_prob", True, "norm_topk_prob=true"),
                                                  ("scoring_func", "sigmoid", "scoring_func")])
def test_deepseek_v2_options_it_cannot_run_are_refused(field, value, named):
    config = transformers.DeepseekV2Config(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=INTER,
                                           hidden_size=HIDDEN, **_V2_MLA).to_dict()
    config.update({field: value, "architectures": ["DeepseekV2ForCausalLM"]})
    with pytest.raises(ValueError, match=named):
        ModelArchConfig.from_hf_config(config)


def test_multi_token_prediction_layers_are_skipped_only_where_the_config_has_them():
    """GLM-4.5 and DeepSeek-V3 checkpoints store their MTP layer after the last layer: skipped
    when the config declares it, refused as unexpected otherwise."""
    from engine.model.arch import check_weights
    config = dict(vocab_size=64, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                  moe_intermediate_size=INTER, first_k_dense_replace=1, n_shared_experts=1)
    with_mtp = ModelArchConfig.from_hf_config(transformers.Glm4MoeConfig(num_nextn_predict_layers=1, **config))
    without = ModelArchConfig.from_hf_config(transformers.Glm4MoeConfig(num_nextn_predict_layers=0, **config))
    shapes = dict(with_mtp.expected_weight_shapes())
    assert shapes["model.layers.1.mlp.gate.e_score_correction_bias"] == (4,)
    assert shapes["model.layers.1.mlp.shared_experts.down_proj.weight"] == (HIDDEN, INTER)
    assert "model.layers.0.mlp.gate.weight" not in shapes  # the first layer is dense
    shapes["model.layers.2.eh_proj.weight"] = (HIDDEN, 2 * HIDDEN)
    check_weights(with_mtp, shapes)
    with pytest.raises(ValueError, match="unexpected tensor model.layers.2.eh_proj.weight"):
        check_weights(without, shapes)


def test_grouped_routing_refuses_groups_it_cannot_form():
    config = dict(vocab_size=64, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=INTER)
    for groups in dict(n_group=3, topk_group=1), dict(n_group=8, topk_group=2), dict(n_group=4, topk_group=5):
        with pytest.raises(ValueError, match="grouped routing needs n_group"):
            ModelArchConfig.from_hf_config(transformers.Glm4MoeConfig(**config, **groups))
