"""The model families pdserve runs, one short module each, over one decoder (engine/model/decoder.py).

A family module declares `ARCHITECTURES` (config.json's `architectures` entry -> its transformers
`model_type`) and `arch_fields(model_type, config) -> dict`: the `ModelArchConfig` fields in
which it differs from a Llama (norm placement, q/k norms, soft-caps, sliding layers, ...), read
from an `engine.model.arch.HFConfig`. It imports no torch: the decoder implements every field, so
a family that needs no new kind of layer is config reading only. To add one: a module here, an
entry in `FAMILIES`, a tiny random model in tests/engine/tiny_models.py (FAMILIES), a row in the
README's table.
"""
from __future__ import annotations

from types import ModuleType

from engine.model.families import deepseek_v2, deepseek_v3, gemma, glm4_moe, gpt_oss, llama, mixtral, olmo2, phi3, qwen3, qwen3_moe

FAMILIES: tuple[ModuleType, ...] = (llama, qwen3, gemma, phi3, olmo2, mixtral, qwen3_moe, gpt_oss, glm4_moe, deepseek_v2, deepseek_v3)
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(a for family in FAMILIES for a in family.ARCHITECTURES)
_BY_ARCHITECTURE = {a: (family, t) for family in FAMILIES for a, t in family.ARCHITECTURES.items()}
_BY_MODEL_TYPE = {t: (family, a) for family in FAMILIES for a, t in reversed(family.ARCHITECTURES.items())}


def family_of(raw: dict) -> tuple[ModuleType, str, str]:
    """(family module, architecture, model_type) of a config.json dict; ValueError naming what
    pdserve runs when the architecture is not one of them."""
    architectures = raw.get("architectures")
    model_type = raw.get("model_type")
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if architectures:
        name = architectures[0] if isinstance(architectures, (list, tuple)) else architectures
        if name not in _BY_ARCHITECTURE:
            raise ValueError(f"unsupported model architecture {name!r}; pdserve runs {supported}")
        family, model_type = _BY_ARCHITECTURE[name]
        return family, name, model_type
    if model_type in _BY_MODEL_TYPE:
        family, name = _BY_MODEL_TYPE[model_type]
        return family, name, model_type
    raise ValueError(
        f"unsupported model architecture: config has model_type {model_type!r} and no known "
        f"'architectures' entry; pdserve runs {supported}")
