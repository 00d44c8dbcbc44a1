"""`--quantization gguf` (engine/model/gguf_quantized.py) on the default model, SmolLM2-135M from
its packaged Q4_1 GGUF (linear layers Q4_1, the tied embedding Q8_0): the weights held are the
file's tensors' bytes, and greedy outputs equal the dequantized model's (`quantization="none"`,
today's path; the kernels dequantize exactly as it does, only fp32 sums are ordered differently).
Refusals: a Hugging Face folder, tensor parallelism, a format that is not supported."""
from __future__ import annotations

import pytest

from engine import cpu_kernels
from engine.config import EngineConfig
from engine.llm import LLM
from engine.model.packaged_models import packaged_gguf_path
from engine.sampling_params import SamplingParams
from tests.engine.tiny_models import save_tiny_model, tiny_config

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def needs_native_gguf_linear() -> None:
    module = cpu_kernels.load()
    if module is None or not module.has_gguf_linear():
        pytest.skip("no native GGUF linear here: the reference path would dequantize every layer at every step")


def both_ways(model: str, prompts: list[str], max_tokens: int) -> list[tuple[list, int]]:
    """(greedy token ids, weight bytes) of `model` in float32, dequantized at load, then kept as stored."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    results = []
    for quantization in ("none", "gguf"):
        with LLM(model, dtype="float32", quantization=quantization) as llm:
            results.append(([out.token_ids for out in llm.generate(prompts, params)], llm.engine.runner.weight_bytes))
    return results


def file_tensor_bytes(model: str) -> int:
    from gguf import GGUFReader
    return sum(int(t.n_bytes) for t in GGUFReader(packaged_gguf_path(model)).tensors)


@pytest.mark.slow
def test_the_default_model_kept_as_stored_holds_the_files_bytes_and_decodes_as_the_dequantized_one():
    needs_native_gguf_linear()
    (expected, float_bytes), (got, held) = both_ways("default", PROMPTS, 16)
    assert got == expected
    assert held == file_tensor_bytes("default"), held
    assert held < float_bytes / 5  # 4.5-8.5 bits a weight instead of 32 (float32's pre-blocked copies aside)


def test_what_is_not_supported_is_refused_at_load():
    with pytest.raises(ValueError, match="quantization must be one of none, gguf, got 'awq'"):
        EngineConfig(quantization="awq")
    with pytest.raises(ValueError, match="no tensor parallelism"):
        EngineConfig(quantization="gguf", tensor_parallel_size=2)


def test_a_hugging_face_folder_is_refused_with_what_to_serve_instead(tmp_path):
    folder = save_tiny_model(tmp_path / "tiny", tiny_config())
    with pytest.raises(ValueError, match="is a Hugging Face folder: serve the .gguf file"):
        LLM(folder, quantization="gguf")


@pytest.mark.slow
def test_gemma_3_keeps_every_tensor_of_its_mixed_file_and_decodes_as_the_dequantized_one():
    """Gemma 3 270M's Q4_K_M file mixes formats: q, k, gate and up in Q5_0, v in Q5_0 or Q8_0 (a fused
    q | k | v of two formats), o_proj in Q4_K, down_proj in Q4_K or Q6_K, the embedding in Q8_0."""
    needs_native_gguf_linear()
    prompts = ["The capital of France is", "def add(a, b):"]
    (expected, float_bytes), (got, held) = both_ways("gemma-3-270m", prompts, 8)
    assert got == expected
    assert held == file_tensor_bytes("gemma-3-270m"), held
    assert held < float_bytes / 5, (held, float_bytes)
