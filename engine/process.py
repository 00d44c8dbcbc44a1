"""What every pdserve process (worker, tensor-parallel rank, router, controller, CLI) does as it
starts: one log line format, and once it serves, freezing its startup objects out of the garbage
collector's way. Torch-free: the router imports it."""
from __future__ import annotations

import gc
import logging
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str | int, prefix: str = "") -> None:
    """The process's log lines on stderr at `level` ("info" or logging.INFO); `prefix` names the
    process in each line when several share one terminal (e.g. "[router 1]", "tp rank 2")."""
    line = LOG_FORMAT.replace("%(name)s", f"{prefix} %(name)s") if prefix else LOG_FORMAT
    logging.basicConfig(level=level.upper() if isinstance(level, str) else level, stream=sys.stderr, format=line)


def freeze_startup_objects() -> None:
    """Call once a server process holds what it serves with (imports, model, tokenizer): collect,
    then move every object to the permanent generation. A full garbage collection then walks only
    what was made while serving. Without it, each walks the ~400k objects of torch's and
    transformers' imports: ~150 ms with the GIL held in a worker with the default model (an
    engine step, and every stream of the worker, stalled that long). Only for processes, never in
    a library call: cycles among frozen objects are never collected."""
    gc.collect()
    gc.freeze()
