"""`--quantization gguf` / `auto` / `int8` (engine/model/gguf_quantized.py) on the default model,
SmolLM2-135M from its packaged Q4_1 GGUF (linear layers Q4_1, the tied embedding Q8_0): kept as
stored, the weights held are the file's tensors' bytes and greedy outputs equal the dequantized
model's (`quantization="none"`, the kernels dequantize exactly as it does, only fp32 sums are
ordered differently); quantized to Q8_0 at load (`int8`), a quarter of float32's bytes. Both
within 1% of the dequantized model's perplexity on a fixed passage. (Under tensor parallelism the
ranks' cuts are tested in test_quant_linear.py, their all-reduce in test_hf_quantized.py.)
Refusals: a Hugging Face folder for `gguf`, a format that is not supported."""
from __future__ import annotations

import math

import pytest

from engine import cpu_kernels
from engine.config import EngineConfig
from engine.llm import LLM
from engine.model.quant_linear import GGUFLinear
from engine.model.packaged_models import packaged_gguf_path
from engine.sampling_params import SamplingParams
from tests.engine.tiny_models import save_tiny_model, tiny_config

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def needs_native_gguf_linear() -> None:
    module = cpu_kernels.load()
    if module is None or not module.has_gguf_linear():
        pytest.skip("no native GGUF linear here: the reference path would dequantize every layer at every step")


def both_ways(model: str, prompts: list[str], max_tokens: int, ways=("none", "gguf")) -> list[tuple[list, int]]:
    """(greedy token ids, weight bytes) of `model` in float32, dequantized at load, then each other way."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    results = []
    for quantization in ways:
        with LLM(model, dtype="float32", quantization=quantization) as llm:
            results.append(([out.token_ids for out in llm.generate(prompts, params)], llm.engine.runner.weight_bytes,
                             perplexity(llm)))
    return [result[:2] for result in results] if ways == ("none", "gguf") else results


PASSAGE = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is "
           "named after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 "
           "to 1889. Locally nicknamed the Iron Lady, it was constructed as the centrepiece of the 1889 "
           "World's Fair, and to crown the centennial anniversary of the French Revolution.")


def perplexity(llm: LLM) -> float:
    """exp(mean negative log-likelihood) of PASSAGE's tokens after its first, from prompt logprobs."""
    out = llm.generate([PASSAGE], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)[0]
    logprobs = [entry.logprob for entry in out.prompt_logprobs[1:]]
    return math.exp(-sum(logprobs) / len(logprobs))


def file_tensor_bytes(model: str) -> int:
    from gguf import GGUFReader
    return sum(int(t.n_bytes) for t in GGUFReader(packaged_gguf_path(model)).tensors)


@pytest.mark.slow
def test_the_default_model_kept_as_stored_and_in_int8_against_the_dequantized_one():
    needs_native_gguf_linear()
    (expected, float_bytes, float_ppl), (got, held, kept_ppl), (_, int8_bytes, int8_ppl) = both_ways(
        "default", PROMPTS, 16, ways=("none", "auto", "int8"))
    assert got == expected  # auto: a .gguf model on one CPU process is kept as stored
    assert held == file_tensor_bytes("default"), held
    assert held < float_bytes / 5  # 4.5-8.5 bits a weight instead of 32 (float32's pre-blocked copies aside)
    assert int8_bytes < float_bytes / 3.5, (int8_bytes, float_bytes)  # 8.5 bits a weight
    assert abs(kept_ppl / float_ppl - 1) < 0.01 and abs(int8_ppl / float_ppl - 1) < 0.01, (float_ppl, kept_ppl, int8_ppl)


def test_what_is_not_supported_is_refused_at_load():
    with pytest.raises(ValueError, match="quantization must be one of none, auto, gguf, int8, fp8, awq, gptq, got 'nf4'"):
        EngineConfig(quantization="nf4")


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


def test_auto_serves_a_float_folder_as_it_is_and_int8_quantizes_it(tmp_path):
    """A Hugging Face folder has nothing stored quantized: auto serves it in float, with the float
    model's tokens; int8 holds Q8_0 copies of its projections, embedding and head."""
    needs_native_gguf_linear()
    folder = save_tiny_model(tmp_path / "tiny", tiny_config(hidden_size=64, intermediate_size=128))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    held = {}
    for quantization in ("none", "auto", "int8"):
        with LLM(folder, quantization=quantization) as llm:
            held[quantization] = (llm.generate([[5, 17, 99, 3]], params, use_tqdm=False)[0].token_ids,
                                  llm.engine.runner.weight_bytes,
                                  sum(isinstance(m, GGUFLinear) for m in llm.engine.runner.model.modules()))
    assert held["auto"] == held["none"] and held["none"][2] == 0
    assert held["int8"][2] > 0 and held["int8"][1] < held["none"][1] / 2

