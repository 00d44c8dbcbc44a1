"""serving's process-level helpers, in a fresh interpreter (they change the whole process)."""
from __future__ import annotations

import subprocess
import sys

FREEZE = """
import gc, torch, transformers, serving
before = len(gc.get_objects())
serving.freeze_startup_objects()
junk = [[i] for i in range(1000)]
print(before, len(gc.get_objects()))
"""


def test_after_startup_a_full_collection_walks_only_what_serving_made():
    """A worker freezes what it started with (`serving.freeze_startup_objects`, called by
    `serving.serve` and the Ray worker actors; the router processes do the same): a full garbage
    collection then walks the objects made afterwards, not the ~200k+ of torch's and transformers'
    imports (each walk ~150 ms with the GIL held in a worker with the default model)."""
    result = subprocess.run([sys.executable, "-c", FREEZE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    before, after = map(int, result.stdout.split())
    assert before > 100_000
    assert 1_000 <= after < 2_000  # the 1000 lists made after the freeze, and little else
