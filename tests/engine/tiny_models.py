"""Tiny random Llama-family model folders that the whole engine (`LLM`) can load: config, seeded
weights and a 128-token word-level tokenizer (`t0` .. `t127`; prompts are token ids).

The weights are drawn with `initializer_range=0.2` (transformers' default 0.02 makes a 3-layer
model repeat its last prompt token forever, which would hide a broken attention), and every bias
at std 0.5, so that biases matter.
"""
from __future__ import annotations

import torch
import transformers

VOCAB = 128


def tiny_config(kind: str = "llama", **overrides) -> transformers.PretrainedConfig:
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  tie_word_embeddings=True, initializer_range=0.2)
    common.update(overrides)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.LlamaConfig(**common)


def save_tiny_model(folder, config: transformers.PretrainedConfig, seed: int = 0, edit=None) -> str:
    """Write a random model of `config` and the tokenizer into `folder`; returns it as a string.
    `edit(model)`, under no_grad, may set weights of its own before the model is saved."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(std=0.5)
        if edit is not None:
            edit(model)
    model.save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", eos_token="t1")
    fast.save_pretrained(folder)
    return str(folder)


# ---- one tiny model of each family beside Llama (engine/model/families/) ----

WINDOW = 8  # sliding layers see the last 8 positions: every prompt below crosses it
FAMILY_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                     rms_norm_eps=1e-5, initializer_range=0.2, pad_token_id=0, bos_token_id=0, eos_token_id=1)


def family_config(name: str) -> transformers.PretrainedConfig:
    """A tiny transformers config of each family pdserve runs (the ones the README lists)."""
    if name == "qwen3":
        return transformers.Qwen3Config(tie_word_embeddings=False, **FAMILY_COMMON)
    if name == "gemma2":
        return transformers.Gemma2Config(
            query_pre_attn_scalar=24, sliding_window=WINDOW, attn_logit_softcapping=4.0, final_logit_softcapping=6.0,
            layer_types=["sliding_attention", "full_attention"] * 2, **FAMILY_COMMON)
    if name == "gemma3":
        return transformers.Gemma3TextConfig(
            query_pre_attn_scalar=12, sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}},
            **FAMILY_COMMON)
    if name == "mistral-sliding":
        return transformers.MistralConfig(sliding_window=WINDOW, tie_word_embeddings=False, **FAMILY_COMMON)
    if name == "phi3":
        common = {k: v for k, v in FAMILY_COMMON.items() if k != "head_dim"}
        return transformers.Phi3Config(
            tie_word_embeddings=False, original_max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, **common)
    if name == "mixtral":
        return transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                                          **FAMILY_COMMON)
    if name == "qwen3-moe":  # layer 1 dense; top-2 weights not renormalized
        return transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                           mlp_only_layers=[1], norm_topk_prob=False, tie_word_embeddings=False,
                                           **FAMILY_COMMON)
    if name == "gpt-oss":  # sinks, biased experts, a clamped SwiGLU that bites (limit 1), yarn
        return transformers.GptOssConfig(
            num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, swiglu_limit=1.0,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 64, "rope_theta": 150000.0},
            **FAMILY_COMMON)
    if name == "glm4-moe":  # layer 0 dense; 8 experts in 4 groups, 2 eligible; a shared expert; q/k norms
        return transformers.Glm4MoeConfig(
            n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
            moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=2.5, use_qk_norm=True,
            attention_bias=True, tie_word_embeddings=False, **FAMILY_COMMON)
    if name in ("deepseek-v3", "deepseek-v2-lite"):
        # latent attention (a 40-value latent: 32 + 8 rotated dims) and shared experts. V3: q
        # compression, interleaved RoPE dims, yarn with both mscales, sigmoid grouped routing.
        # DeepseekV2ForCausalLM in V2-Lite's shape (one q_proj), with V2's group-limited greedy
        # softmax routing (V2-Lite's own is plain greedy: tests/engine/test_moe.py)
        common = {k: v for k, v in FAMILY_COMMON.items() if k not in ("head_dim", "num_key_value_heads")}
        mla = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                   n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                   moe_intermediate_size=32, first_k_dense_replace=1, tie_word_embeddings=False, **common)
        if name == "deepseek-v2-lite":
            return transformers.DeepseekV2Config(q_lora_rank=None, topk_method="group_limited_greedy",
                                                 routed_scaling_factor=1.5, **mla)
        rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8, "rope_theta": 10000.0}
        return transformers.DeepseekV3Config(q_lora_rank=24, rope_interleave=True, rope_parameters=rope,
                                             routed_scaling_factor=2.5, **mla)
    if name == "olmo2":
        common = {k: v for k, v in FAMILY_COMMON.items() if k != "head_dim"}
        return transformers.Olmo2Config(tie_word_embeddings=False, **common)
    raise KeyError(name)


FAMILIES = ["qwen3", "gemma2", "gemma3", "mistral-sliding", "phi3", "olmo2", "mixtral", "qwen3-moe", "gpt-oss",
            "glm4-moe", "deepseek-v3", "deepseek-v2-lite"]


def _randomize_norms(model) -> None:
    """Norm weights (and q/k norms) away from their constant initialization: N(1, 0.3) as a
    multiplier, so a Gemma norm that forgets its 1 + w, or a norm in the wrong place, shows; MoE
    routers (Qwen3-MoE starts them at 0), attention sinks and expert biases N(0, 1), so tokens
    spread over the experts and a sink or bias left out changes the tokens; DeepSeek-style routers'
    score correction biases (buffers) N(0, 0.5), so that the choice differs from the weights'."""
    for name, param in model.named_parameters():
        if name.endswith((".gate.weight", ".router.weight", ".router.bias", "_bias", ".sinks")):
            param.normal_(0.0, 1.0)
        elif "norm" in name:
            if "gemma" in type(model).__name__.lower():
                param.normal_(0.0, 0.3)  # Gemma multiplies by 1 + w
            else:
                param.normal_(1.0, 0.3)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.normal_(0.0, 0.5)


def save_family_model(folder, name: str, seed: int = 0) -> str:
    """A tiny random model of family `name` (one of FAMILIES) with its norms randomized."""
    return save_tiny_model(folder, family_config(name), seed=seed, edit=_randomize_norms)
