"""Quantized Hugging Face checkpoints (engine/model/quant_formats.py, engine/model/hf_quantized.py)
end to end, on a tiny random Qwen2 (q/k/v biases, a separate LM head) written in each format by
`quant_formats.save_quantized_copy`: fp8 with 32x32 block scales (q | k | v fuse; gate | up, 112 rows, do not:
a block straddles them) and per channel, AWQ (group 16), GPTQ with act-order (v1 zeros; each part
its own random permutation here, so the parts are not fused) and with one group (v2).

- Dequantized at load (`none`), the model is the float model of the dequantized weights: its greedy
  tokens are transformers' on a float folder holding them.
- The layers kept as stored never get float memory: they load as meta placeholders.
- Kept as stored, through the Triton kernels (the Triton attention backend: on CPU, Triton's
  interpreter), the greedy tokens are those of the dequantized model, and the weights held are the
  stored tensors' bytes; the reference path (a CPU engine) gives them too.
- Under tensor parallelism (two ranks) each rank keeps its part of each layer with its scales, and
  the tokens are still the dequantized model's.
- Refusals name what is supported: another quant_method, 8-bit AWQ, a format that is not the
  checkpoint's, a layer missing one of its tensors.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import transformers
from safetensors.torch import save_file

from engine.llm import LLM
from engine.model.decoder import DecoderForCausalLM
from engine.model.hf_quantized import QuantizedLinear, allocate_all_but_kept, keep_hf_quantized
from engine.model.loader import resolve_model
from engine.model.quant_formats import QuantFormat, save_quantized_copy
from engine.model.quant_linear import ConcatLinear
from engine.sampling_params import SamplingParams
from tests.engine.tiny_models import save_tiny_model, tiny_config

FORMATS = {"fp8-block": (QuantFormat("fp8", block=(32, 32)), False),
           "fp8-channel": (QuantFormat("fp8"), False),
           "awq": (QuantFormat("awq", group_size=16), False),
           "gptq-act-order": (QuantFormat("gptq", group_size=16, zero_offset=1), True),
           "gptq-v2-one-group": (QuantFormat("gptq", group_size=-1), False)}
PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41, 3, 99, 12, 77, 2, 64, 23]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("float"), tiny_config("qwen2", tie_word_embeddings=False))


@pytest.fixture(scope="module", params=list(FORMATS))
def checkpoint(request, source, tmp_path_factory) -> tuple[str, QuantFormat]:
    fmt, act_order = FORMATS[request.param]
    return save_quantized_copy(source, tmp_path_factory.mktemp(request.param), fmt, act_order=act_order), fmt


def generate(folder: str, **options) -> tuple[list[list[int]], LLM]:
    with LLM(folder, dtype="float32", **options) as llm:
        tokens = [out.token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        return tokens, llm


def test_dequantized_at_load_is_transformers_on_the_dequantized_weights(checkpoint, tmp_path):
    folder, fmt = checkpoint
    loaded = resolve_model(folder)
    assert loaded.quant_format == fmt
    weights = {name: tensor.contiguous() for name, tensor in loaded.iter_weights()}
    assert set(weights) == set(loaded.weight_shapes())
    float_folder = tmp_path / "dequantized"
    shutil.copytree(folder, float_folder)
    save_file(weights, float_folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((float_folder / "config.json").read_text())
    del config["quantization_config"]
    (float_folder / "config.json").write_text(json.dumps(config))
    reference = transformers.AutoModelForCausalLM.from_pretrained(float_folder, dtype=torch.float32).eval()
    expected = []
    for prompt in PROMPTS:
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
        expected.append(out[0, len(prompt):].tolist())
    tokens, _ = generate(folder, quantization="none")
    assert tokens == expected


def test_kept_as_stored_through_the_triton_kernels(checkpoint, request):
    folder, fmt = checkpoint
    reference, dequantized = generate(folder, quantization="none", attention_backend="triton")
    tokens, kept = generate(folder, quantization=fmt.method, attention_backend="triton")
    assert tokens == reference
    model = kept.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and {layer.kernel for layer in layers} == {"triton"}
    fused = {type(model.layers[0].self_attn.qkv_proj), type(model.layers[0].mlp.gate_up_proj)}
    if fmt.block is not None:  # q | k | v rows (64, 32, 32) keep 32-row blocks whole; gate | up (112, 112) do not
        assert fused == {QuantizedLinear, ConcatLinear}
    elif FORMATS[request.node.callspec.params["checkpoint"]][1]:  # act-order: each part its own g_idx here
        assert fused == {ConcatLinear}
    else:
        assert fused == {QuantizedLinear}
    stored = sum(p.numel() * p.element_size() for layer in layers for p in layer.stored.values())
    floats = 4 * sum(layer.in_features * layer.out_features for layer in layers)
    assert stored < floats * (0.3 if fmt.method == "fp8" else 0.2)  # fp8: 1 byte a weight; int4: half a byte
    assert kept.engine.runner.weight_bytes < dequantized.engine.runner.weight_bytes


def test_the_reference_path_on_a_cpu_engine_and_auto_there(source, tmp_path):
    folder = save_quantized_copy(source, tmp_path / "awq", QuantFormat("awq", group_size=16))
    reference, dequantized = generate(folder, quantization="none", device="cpu")
    tokens, kept = generate(folder, quantization="awq", device="cpu")
    assert tokens == reference
    assert {m.kernel for m in kept.engine.runner.model.modules() if isinstance(m, QuantizedLinear)} == {"reference"}
    automatic, auto = generate(folder, quantization="auto", device="cpu")  # dequantized at load: faster on CPU
    assert automatic == reference and auto.engine.runner.weight_bytes == dequantized.engine.runner.weight_bytes


def _edit_config(folder, **quantization_config) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(path, "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported (supported: fp8"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "awq with 8 bits is not supported (4-bit only)"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version gemm with zero points only"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "group_size must be -1 or a positive multiple of 8"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fp8 format 'e5m2' is not supported (e4m3 only)"),
])
def test_an_unsupported_quantization_config_is_refused_naming_what_is(source, tmp_path, config, message):
    folder = save_quantized_copy(source, tmp_path / "q", QuantFormat("awq", group_size=16))
    _edit_config(folder, **config)
    with pytest.raises(ValueError, match="config.json: .*") as error:
        resolve_model(folder)
    assert message in str(error.value)


def test_a_format_that_is_not_the_checkpoints_and_a_missing_part_are_refused(source, tmp_path):
    folder = save_quantized_copy(source, tmp_path / "fp8", QuantFormat("fp8"))
    with pytest.raises(ValueError, match="quantization 'awq' keeps a awq checkpoint's tensors as stored, but .* is a "
                                         "fp8 checkpoint: use quantization 'auto' or 'none'"):
        LLM(folder, quantization="awq")
    with pytest.raises(ValueError, match="quantization 'gptq' .* is not quantized"):
        LLM(source, quantization="gptq")
    gptq = save_quantized_copy(source, tmp_path / "gptq", QuantFormat("gptq", group_size=16))
    from safetensors.torch import load_file
    tensors = load_file(os.path.join(gptq, "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.qzeros"]
    save_file(tensors, os.path.join(gptq, "model.safetensors"))
    with pytest.raises(ValueError, match="quantized layer model.layers.1.mlp.down_proj lacks qzeros"):
        resolve_model(gptq)


@pytest.mark.usefixtures("one_torch_thread")
def test_tensor_parallel_ranks_keep_their_part_with_its_scales(source, tmp_path):
    """Two ranks (gloo, the reference path): each keeps its rows of q / k / v and gate / up and its
    input columns of o_proj and down_proj, with their scales, o_proj and down_proj inside the
    all-reduce; the tokens are one process's with the weights dequantized. (Each format's cut, and
    a cut through a scale block refused: test_quant_formats.py.)"""
    # GPTQ with act-order: every rank keeps all groups; each format's cut: test_quant_formats.py
    fmt = QuantFormat("gptq", group_size=16, zero_offset=1)
    folder = save_quantized_copy(source, tmp_path / fmt.method, fmt, act_order=True)
    reference, _ = generate(folder, quantization="none", device="cpu")
    tokens, parallel = generate(folder, quantization=fmt.method, device="cpu", tensor_parallel_size=2)
    assert tokens == reference
    assert type(parallel.engine.runner.model.layers[0].self_attn.o_proj).__name__ == "RowParallel"


def test_the_layers_kept_as_stored_never_get_float_memory(source, tmp_path):
    """`allocate_all_but_kept` leaves exactly the kept projections' weights on the meta device
    (their biases get memory: they load as float), and the float load passes them as meta
    placeholders without reading their parts: an fp8 checkpoint loads in about its own size."""
    folder = save_quantized_copy(source, tmp_path / "fp8", QuantFormat("fp8", block=(32, 32)))
    loaded = resolve_model(folder)
    with torch.device("meta"):
        model = DecoderForCausalLM(loaded.arch)
    placeholders = allocate_all_but_kept(model, loaded, torch.device("cpu"))
    assert placeholders == loaded.quantized_layers() and len(placeholders) == 7 * loaded.arch.num_hidden_layers
    on_meta = {name for name, p in model.named_parameters() if p.is_meta}
    assert on_meta == {f"layers.{i}.{projection}.weight" for i in range(loaded.arch.num_hidden_layers)
                       for projection in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}
    weights = dict(loaded.iter_weights(placeholders))
    assert {name for name, tensor in weights.items() if tensor.is_meta} == {f"{name}.weight" for name in placeholders}
    model.load_weights(weights.items())
    keep_hf_quantized(model, loaded, "reference", torch.device("cpu"))
    assert not any(p.is_meta for p in model.parameters())
