"""Rope types and partial rotary against transformers 5's own rotary modules: the cos/sin tables
(attention factor included) and the rotated query/key, bit for bit, inside and past the original
context where transformers' choice is deterministic."""
from __future__ import annotations

import logging

import pytest
import torch

from engine.model import rope as rope_mod
from engine.model.rope import ROPE_SCALING_PARAMS, RotaryEmbedding

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, Phi3Config  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding  # noqa: E402
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as hf_apply_partial  # noqa: E402

HEAD_DIM = 64
HEADS = 2
THETA = 10000.0
ORIGINAL = 128  # the pretraining length the scaled types extend
ENGINE_MAX = 512  # the engine's max_position (max_model_len), past ORIGINAL


@pytest.fixture(autouse=True)
def _quiet_transformers():
    # transformers warns about rope keys its validators don't expect (partial_rotary_factor etc.)
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def llama_config(params: dict, max_position_embeddings: int) -> LlamaConfig:
    return LlamaConfig(hidden_size=HEAD_DIM * HEADS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                       head_dim=HEAD_DIM, max_position_embeddings=max_position_embeddings,
                       rope_parameters={"rope_theta": THETA, **params})


def hf_cos_sin(module: torch.nn.Module, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos/sin [seq_len, rotary_dim] for one sequence of positions 0..seq_len-1."""
    cos, sin = module(torch.zeros(1, dtype=torch.float32), torch.arange(seq_len)[None])
    return cos[0], sin[0]


def ours(params: dict, max_position: int, **extra) -> RotaryEmbedding:
    return RotaryEmbedding(HEAD_DIM, max_position, THETA, {**params, **extra})


def assert_rotation_matches(rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
                            dtype: torch.dtype) -> None:
    """Our forward on tokens at `rows` equals transformers' rotation with its cos/sin rows (the
    generic partial-rotary apply_rotary_pos_emb, which is Llama's when rotary_dim == head_dim)."""
    torch.manual_seed(len(rows))
    q = torch.randn(len(rows), 3, HEAD_DIM).to(dtype)
    k = torch.randn(len(rows), 1, HEAD_DIM).to(dtype)
    got_q, got_k = rope(rows, q, k)
    want_q, want_k = hf_apply_partial(q.transpose(0, 1), k.transpose(0, 1), cos[rows].to(dtype),
                                      sin[rows].to(dtype), unsqueeze_dim=0)
    assert torch.equal(got_q, want_q.transpose(0, 1))
    assert torch.equal(got_k, want_k.transpose(0, 1))


def assert_table_rows(rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor, lo: int, hi: int) -> None:
    assert torch.equal(rope.cos_cache[lo:hi], cos[lo:hi])
    assert torch.equal(rope.sin_cache[lo:hi], sin[lo:hi])


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
LENGTH_INDEPENDENT = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
    "yarn": YARN,
    "yarn-beta-attention-factor": {**YARN, "beta_fast": 16, "beta_slow": 2, "attention_factor": 1.25},
    "yarn-untruncated": {**YARN, "truncate": False},
    # DeepSeek-V3: attention factor from mscale / mscale_all_dim (equal there: factor 1.0)
    "yarn-deepseek": {**YARN, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
    "yarn-mscale-ratio": {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0},
}


@pytest.mark.parametrize("name", list(LENGTH_INDEPENDENT))
def test_length_independent_types_match_transformers(name):
    params = LENGTH_INDEPENDENT[name]
    hf = LlamaRotaryEmbedding(llama_config(dict(params), ENGINE_MAX))
    cos, sin = hf_cos_sin(hf, ENGINE_MAX)
    rope = ours(params, ENGINE_MAX)
    assert rope.attention_scaling == hf.attention_scaling
    assert_table_rows(rope, cos, sin, 0, ENGINE_MAX)
    rows = torch.tensor([0, 1, 77, ORIGINAL - 1, ORIGINAL, 300, ENGINE_MAX - 1])
    for dtype in (torch.float32, torch.bfloat16):
        assert_rotation_matches(rope, cos, sin, rows, dtype)


def test_yarn_attention_factor_scales_the_tables():
    rope = ours(YARN, 64)
    plain = ours({"rope_type": "yarn", **{k: v for k, v in YARN.items() if k != "rope_type"},
                  "attention_factor": 1.0}, 64)
    assert rope.attention_scaling == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    assert torch.equal(rope.cos_cache, plain.cos_cache * rope.attention_scaling)


DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}


def test_dynamic_within_the_original_length_is_transformers_exactly():
    # the model's max_position_embeddings is what transformers' dynamic NTK scales against
    rope = ours(DYNAMIC, ENGINE_MAX, max_position_embeddings=ORIGINAL)
    for seq_len in (ORIGINAL, 50):
        cos, sin = hf_cos_sin(LlamaRotaryEmbedding(llama_config(dict(DYNAMIC), ORIGINAL)), seq_len)
        assert_table_rows(rope, cos, sin, 0, seq_len)
        assert_rotation_matches(rope, cos, sin, torch.tensor([0, 5, seq_len - 1]), torch.bfloat16)


def test_dynamic_beyond_the_original_length_uses_the_engine_max_position_frequencies():
    rope = ours(DYNAMIC, ENGINE_MAX, max_position_embeddings=ORIGINAL)
    cos, sin = hf_cos_sin(LlamaRotaryEmbedding(llama_config(dict(DYNAMIC), ORIGINAL)), ENGINE_MAX)
    assert_table_rows(rope, cos, sin, ORIGINAL, ENGINE_MAX)
    assert_rotation_matches(rope, cos, sin, torch.tensor([ORIGINAL, 200, ENGINE_MAX - 1]), torch.float32)
    # documented difference: a sequence this long gets scaled frequencies at every position in
    # transformers; here positions below the original length keep the unscaled ones
    assert not torch.equal(rope.cos_cache[1:ORIGINAL], cos[1:ORIGINAL])


def test_dynamic_with_an_engine_within_the_original_length_is_unscaled():
    rope = ours(DYNAMIC, 100, max_position_embeddings=ORIGINAL)
    assert torch.equal(rope.cos_cache, ours({"rope_type": "default"}, 100).cos_cache)


def longrope_params(dim: int) -> dict:
    half = dim // 2
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(half)],
            "long_factor": [1.0 + 0.9 * i for i in range(half)], "original_max_position_embeddings": ORIGINAL}


@pytest.mark.parametrize("extra", [{}, {"factor": 8.0}, {"attention_factor": 1.1}])
def test_longrope_matches_transformers_for_a_request_of_the_engine_length(extra):
    params = {**longrope_params(HEAD_DIM), **extra}
    # Phi-3 style: no factor, derived from max_position_embeddings / original (here 4)
    model_max = 4 * ORIGINAL
    for engine_max in (ENGINE_MAX, ORIGINAL, 100):  # long factors only past the original length
        hf = LlamaRotaryEmbedding(llama_config(dict(params), model_max))
        cos, sin = hf_cos_sin(hf, engine_max)
        rope = ours(params, engine_max, max_position_embeddings=model_max)
        assert rope.attention_scaling == hf.attention_scaling != 1.0
        assert_table_rows(rope, cos, sin, 0, engine_max)
        assert_rotation_matches(rope, cos, sin, torch.tensor([0, 3, engine_max - 1]), torch.bfloat16)
    # documented difference: an engine longer than the original length serves short requests with
    # the long factors; transformers uses the short ones for them
    short_cos, _ = hf_cos_sin(LlamaRotaryEmbedding(llama_config(dict(params), model_max)), 64)
    assert not torch.equal(ours(params, ENGINE_MAX, max_position_embeddings=model_max).cos_cache[1:64],
                           short_cos[1:64])


def phi3_config(params: dict, partial: float) -> Phi3Config:
    return Phi3Config(hidden_size=HEAD_DIM * HEADS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                      max_position_embeddings=4 * ORIGINAL, original_max_position_embeddings=ORIGINAL,
                      partial_rotary_factor=partial, rope_parameters={"rope_theta": THETA, **params})


@pytest.mark.parametrize("partial", [0.5, 0.75])
def test_partial_rotary_default_and_longrope_match_phi3(partial):
    rotary_dim = int(HEAD_DIM * partial)
    for params, extra in (({"rope_type": "default"}, {}),
                          (longrope_params(rotary_dim), {"max_position_embeddings": 4 * ORIGINAL})):
        hf = Phi3RotaryEmbedding(phi3_config(dict(params), partial))
        cos, sin = hf_cos_sin(hf, ENGINE_MAX)
        for rope in (RotaryEmbedding(HEAD_DIM, ENGINE_MAX, THETA, {**params, **extra}, rotary_dim=rotary_dim),
                     RotaryEmbedding(HEAD_DIM, ENGINE_MAX, THETA, {**params, **extra, "partial_rotary_factor": partial})):
            assert rope.cos_cache.shape == (ENGINE_MAX, rotary_dim)
            assert_table_rows(rope, cos, sin, 0, ENGINE_MAX)
            for dtype in (torch.float32, torch.bfloat16):
                assert_rotation_matches(rope, cos, sin, torch.tensor([0, 9, ORIGINAL, ENGINE_MAX - 1]), dtype)


@pytest.mark.parametrize("params", [YARN, {"rope_type": "linear", "factor": 2.0}], ids=["yarn", "linear"])
def test_partial_rotary_with_scaling_matches_transformers(params):
    partial = 0.5
    hf = LlamaRotaryEmbedding(llama_config({**params, "partial_rotary_factor": partial}, ENGINE_MAX))
    cos, sin = hf_cos_sin(hf, ENGINE_MAX)
    rope = RotaryEmbedding(HEAD_DIM, ENGINE_MAX, THETA, params, rotary_dim=HEAD_DIM // 2)
    assert_table_rows(rope, cos, sin, 0, ENGINE_MAX)
    assert_rotation_matches(rope, cos, sin, torch.tensor([2, ORIGINAL + 3, ENGINE_MAX - 1]), torch.bfloat16)


def test_partial_rotary_passes_the_other_dims_through():
    rope = RotaryEmbedding(HEAD_DIM, 64, THETA, None, rotary_dim=16)
    q, k = torch.randn(5, 2, HEAD_DIM), torch.randn(5, 1, HEAD_DIM)
    got_q, got_k = rope(torch.arange(5), q, k)
    assert torch.equal(got_q[..., 16:], q[..., 16:]) and torch.equal(got_k[..., 16:], k[..., 16:])
    assert not torch.equal(got_q[1:, :, :16], q[1:, :, :16])


def test_existing_four_argument_constructor_is_unchanged():
    rope = RotaryEmbedding(HEAD_DIM, 32, THETA, None)
    assert rope.rotary_dim == HEAD_DIM and rope.cos_cache.shape == (32, HEAD_DIM) and rope.attention_scaling == 1.0
    inv_freq = 1.0 / (THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.int64).float() / HEAD_DIM))
    assert torch.equal(rope_mod.rope_inv_freq(HEAD_DIM, THETA, None), inv_freq)


def test_constructs_on_the_meta_device():
    # the model is first built on the meta device; every rope type must construct there
    with torch.device("meta"):
        for params in (*LENGTH_INDEPENDENT.values(), {**DYNAMIC, "max_position_embeddings": ORIGINAL},
                       {**longrope_params(HEAD_DIM), "max_position_embeddings": 4 * ORIGINAL}):
            assert RotaryEmbedding(HEAD_DIM, ENGINE_MAX, THETA, params).cos_cache.is_meta


def test_unknown_rope_type_names_the_supported_ones():
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'mrope'") as err:
        RotaryEmbedding(HEAD_DIM, 32, THETA, {"rope_type": "mrope"})
    for rope_type in ("default", *ROPE_SCALING_PARAMS):
        assert rope_type in str(err.value)


def test_missing_required_parameters_and_bad_rotary_dims_raise():
    with pytest.raises(ValueError, match="dynamic rope scaling needs max_position_embeddings"):
        RotaryEmbedding(HEAD_DIM, 32, THETA, DYNAMIC)
    with pytest.raises(ValueError, match="llama3 rope scaling needs low_freq_factor"):
        RotaryEmbedding(HEAD_DIM, 32, THETA, {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 64})
    with pytest.raises(ValueError, match="long_factor has"):
        RotaryEmbedding(HEAD_DIM, 32, THETA, {**longrope_params(HEAD_DIM), "long_factor": [1.0],
                                               "max_position_embeddings": 4 * ORIGINAL})
    for rotary_dim in (0, 15, HEAD_DIM + 2):
        with pytest.raises(ValueError, match="rotary_dim must be even"):
            RotaryEmbedding(HEAD_DIM, 32, THETA, None, rotary_dim=rotary_dim)
    with pytest.raises(ValueError, match="contradicts partial_rotary_factor"):
        RotaryEmbedding(HEAD_DIM, 32, THETA, {"partial_rotary_factor": 0.5}, rotary_dim=16)


def test_rope_scaling_params_table():
    assert ROPE_SCALING_PARAMS["linear"] == ("factor",)
    assert ROPE_SCALING_PARAMS["llama3"] == ("factor", "low_freq_factor", "high_freq_factor",
                                             "original_max_position_embeddings")
    assert set(ROPE_SCALING_PARAMS) == {"linear", "llama3", "dynamic", "yarn", "longrope"}
