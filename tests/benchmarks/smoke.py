"""Run a benchmark script in its CI-sized form (`--smoke`) and return its JSON results."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_smoke(script: str, tmp_path: Path) -> tuple[dict, str]:
    """`python benchmarks/<script> --smoke --json ...` from the repo root: (results, stdout)."""
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, f"benchmarks/{script}", "--smoke", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout
