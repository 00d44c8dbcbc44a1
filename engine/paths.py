"""Where pdserve keeps what it builds once and reuses: one root, `$PDSERVE_CACHE_DIR` (default
`~/.cache/pdserve`), defined here and only here.

    <root>/models/      converted GGUF models (engine/model/gguf_loader.py); `models/gguf/` the GGUFs
                        assembled from packaged chunks (engine/model/packaged_models.py)
    <root>/native/      compiled native code: the CPU kernels (engine/cpu_kernels.py; $TORCH_EXTENSIONS_DIR
                        wins when set) and kvtransfer's chunk copy (kvtransfer/_chunk_copy.py)
    <root>/serve.json   the running `pdserve serve`'s state file (deploy/cluster.py; $PDSERVE_STATE_FILE wins)

kvtransfer imports no other project package (pyproject's import-linter layers), so
kvtransfer/_chunk_copy.py reads the same variable with the same default itself;
tests/test_wheel_install.py checks that the two agree. Torch-free and cheap to import.
"""
from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "PDSERVE_CACHE_DIR"


def cache_root() -> Path:
    """$PDSERVE_CACHE_DIR, else ~/.cache/pdserve (absolute, `~` expanded; not created)."""
    root = os.environ.get(CACHE_DIR_ENV) or os.path.join("~", ".cache", "pdserve")
    return Path(os.path.abspath(os.path.expanduser(root)))


def models_dir() -> Path:
    """Converted models: <root>/models."""
    return cache_root() / "models"


def native_dir() -> Path:
    """Compiled native libraries: <root>/native."""
    return cache_root() / "native"


def state_file() -> Path:
    """The default `pdserve serve` state file: <root>/serve.json."""
    return cache_root() / "serve.json"
