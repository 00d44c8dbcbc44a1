#!/usr/bin/env bash
# GPU check for the attention kernels: tests/gpu at real sizes, then the decode/prefill kernel
# micro-benchmark (achieved GB/s against the measured copy bandwidth). Under 5 minutes on one H200.
# Results go to $OUT when it is set, else to benchmarks/results/gpu_check/.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${OUT:-benchmarks/results/gpu_check}"
mkdir -p "$RESULTS"
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: torch sees no CUDA device; nothing to check" | tee "$RESULTS/gpu_check.txt"
  exit 1
fi
"$PYTHON" - <<'PY' | tee "$RESULTS/environment.txt"
import torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
print("device", torch.cuda.get_device_name(0), "SMs", torch.cuda.get_device_properties(0).multi_processor_count)
PY

timeout 200 "$PYTHON" -m pytest tests/gpu -q -m gpu -p no:cacheprovider --junitxml="$RESULTS/gpu_tests.xml" \
  2>&1 | tee "$RESULTS/gpu_tests.txt"
tests_rc=${PIPESTATUS[0]}

timeout 80 "$PYTHON" benchmarks/kernel_bench.py --compare-torch --json "$RESULTS/kernel_bench.json" \
  2>&1 | tee "$RESULTS/kernel_bench.txt"
bench_rc=${PIPESTATUS[0]}

echo "gpu_check: tests rc=$tests_rc, benchmark rc=$bench_rc; results in $RESULTS" | tee -a "$RESULTS/gpu_check.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
