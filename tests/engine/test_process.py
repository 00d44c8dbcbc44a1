"""engine.process: what every pdserve process does as it starts, in a fresh interpreter (it
changes the whole process)."""
from __future__ import annotations

import re
import subprocess
import sys

FREEZE = """
import gc, torch, transformers
from engine.process import freeze_startup_objects
before = len(gc.get_objects())
freeze_startup_objects()
junk = [[i] for i in range(1000)]
print(before, len(gc.get_objects()))
"""

LOG = """
import logging
from engine.process import configure_logging
configure_logging("info", prefix="[router 1]")
logging.getLogger("router.pool").info("worker joined")
logging.getLogger("router.pool").debug("not shown")
"""


def test_after_startup_a_full_collection_walks_only_what_serving_made():
    """A server process freezes what it started with (`freeze_startup_objects`, called by
    `serving.serve`, the Ray worker actors and the routers): a full garbage collection then walks
    the objects made afterwards, not the ~200k+ of torch's and transformers' imports (each walk
    ~150 ms with the GIL held in a worker with the default model)."""
    result = subprocess.run([sys.executable, "-c", FREEZE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    before, after = map(int, result.stdout.split())
    assert before > 100_000
    assert 1_000 <= after < 2_000  # the 1000 lists made after the freeze, and little else


def test_every_process_logs_one_line_format_named_by_its_prefix():
    result = subprocess.run([sys.executable, "-c", LOG], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO \[router 1\] router.pool: worker joined\n",
                        result.stderr), result.stderr
