#!/usr/bin/env bash
# GPU check, in one pass sized for a short lease on one GPU (~5 minutes on an H200):
#   1. tests: the Triton attention kernels at real sizes (tests/gpu, and test_attention's triton
#      cases) and over the 8-bit KV cache (int8, fp8 e4m3: test_kv_quant_triton.py, whose store
#      must write torch's bytes on the GPU too), the Triton elementwise kernels (test_triton_ops.py),
#      the whole engine on the GPU token-exact with transformers (tests/gpu/test_engine_gpu.py), the
#      CUDA sampler, kvtransfer with CUDA caches, and the quantized linears (fp8, AWQ, GPTQ:
#      test_triton_quant.py, and test_hf_quantized.py's tiny checkpoints through the engine);
#   2. the KV transfer benchmark twice: CPU caches on this host's cores (tcp/shm/ucx/gloo against
#      the plain socket and memcpy), and CUDA caches (against a device copy through CUDA IPC), then
#      CUDA caches per KV dtype (bf16, int8, fp8: the same tokens, bytes and time per transfer);
#   3. the offline benchmark on the GPU: engine vs transformers on a SmolLM2-135M-shaped model with
#      random weights (the default model's GGUF does not travel; speed depends only on the shape),
#      and its decode step at batch 64 x 512 per KV cache dtype (bf16, int8, fp8 on Triton);
#   4. the attention kernel micro-benchmark (achieved GB/s against the measured copy bandwidth);
#   5. the quantized checkpoints (benchmarks/quantized_gpu.py): fp8 128x128 blocks, AWQ and GPTQ
#      copies of that random model, each kept as stored (the Triton kernels) against itself
#      dequantized at load: weights held, greedy agreement, decode step at batch 1 and 64, throughput;
#   6. `cluster` (not in the default list: ~4-6 more minutes): `pdserve serve` on the GPU with the
#      same random model, 1 prefill + 1 decode worker sharing it (--worker-gpus 0.5), over ucx and
#      tcp, token-exact against one colocated worker, then the serving benchmark (1024 in / 128
#      out, concurrency 64) of each (benchmarks/cluster_check.py).
# GPU_CHECK_STEPS picks steps (default "tests kvtransfer offline kernels quantized"; "cluster" alone:
# GPU_CHECK_STEPS=cluster). ucx needs ucxx: where it is not installed, put the wheels' contents on
# PYTHONPATH (the README says how); the cluster step skips ucx, saying so, without it.
# Results go to $OUT when it is set, else to benchmarks/results/gpu_check/. With $OUT (a device
# session, which brings back at most 8 files) they end as two files: gpu_check.txt (the summary)
# and gpu_check.tar.gz (every result file).
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${OUT:-benchmarks/results/gpu_check}"
mkdir -p "$RESULTS"
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: torch sees no CUDA device; nothing to check" | tee "$RESULTS/gpu_check.txt"
  exit 1
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1
  "$PYTHON" - <<'PY'
import os, platform, torch, triton
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "triton", triton.__version__, "cpus", os.cpu_count())
print("device", torch.cuda.get_device_name(0), "SMs", torch.cuda.get_device_properties(0).multi_processor_count)
PY
} 2>&1 | tee "$RESULTS/environment.txt"

STEPS=" ${GPU_CHECK_STEPS:-tests kvtransfer offline kernels quantized} "
step() { [[ "$STEPS" == *" $1 "* ]]; }
tests_rc=0 offline_rc=0 kv_rc=0 bench_rc=0 cluster_rc=0 quant_rc=0
MODEL_DIR="${TMPDIR:-/tmp}/pdserve-smollm2-random"

if step tests; then
timeout 300 "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts="-ra --timeout=240" \
  tests/gpu tests/kvtransfer/test_gpu.py tests/engine/test_attention.py tests/engine/test_sampler.py \
  tests/engine/test_triton_ops.py tests/engine/test_kv_quant_triton.py tests/engine/test_triton_quant.py \
  tests/engine/test_hf_quantized.py \
  -k "gpu or cuda or triton or Gpu or quant" 2>&1 | tee "$RESULTS/gpu_tests.txt"
tests_rc=${PIPESTATUS[0]}
fi

if step kvtransfer; then
{
  echo "--- CPU caches, $(nproc) cores ---"
  OMP_NUM_THREADS=1 timeout 150 "$PYTHON" benchmarks/kvtransfer_bench.py --repeats 5 \
    --json "$RESULTS/kvtransfer_cpu.json" &&
  echo "--- CUDA caches ---" &&
  timeout 120 "$PYTHON" benchmarks/kvtransfer_bench.py --device cuda --repeats 5 \
    --json "$RESULTS/kvtransfer_cuda.json" &&
  echo "--- CUDA caches, the same tokens per KV cache dtype ---" &&
  timeout 120 "$PYTHON" benchmarks/kvtransfer_bench.py --device cuda --repeats 3 --sizes 16,64 \
    --kv-dtypes bfloat16,int8,fp8_e4m3
} 2>&1 | tee "$RESULTS/kvtransfer.txt"
kv_rc=${PIPESTATUS[0]}
fi

if step offline; then
{
  "$PYTHON" benchmarks/random_model.py "$MODEL_DIR" --layers 30 &&
  timeout 200 "$PYTHON" benchmarks/offline.py --device cuda --model "$MODEL_DIR" --json "$RESULTS/offline_gpu.json" &&
  echo "--- the engine again with decode steps run eagerly (no CUDA graphs) ---" &&
  timeout 90 "$PYTHON" benchmarks/offline.py --device cuda --model "$MODEL_DIR" --no-transformers --no-cuda-graphs &&
  echo "--- decode step per KV cache dtype (batch 64, 512-token context) ---" &&
  timeout 120 "$PYTHON" benchmarks/offline.py --device cuda --model "$MODEL_DIR" --kv-cache-dtypes auto,int8,fp8_e4m3
} 2>&1 | grep -v "Writing model shards" | tee "$RESULTS/offline_gpu.txt"
offline_rc=${PIPESTATUS[0]}
fi

if step kernels; then
timeout 100 "$PYTHON" benchmarks/kernel_bench.py --compare-torch --json "$RESULTS/kernel_bench.json" \
  2>&1 | tee "$RESULTS/kernel_bench.txt"
bench_rc=${PIPESTATUS[0]}
fi

if step quantized; then
timeout 300 "$PYTHON" benchmarks/quantized_gpu.py --device cuda --json "$RESULTS/quantized_gpu.json" \
  2>&1 | grep -v "Writing model shards" | tee "$RESULTS/quantized_gpu.txt"
quant_rc=${PIPESTATUS[0]}
fi

if step cluster; then
# The script writes the model unless the offline step already did (same folder, same shape), and
# stops every `pdserve serve` it started, on SIGTERM too (-k: 90 s for that before SIGKILL).
timeout -k 90 360 "$PYTHON" benchmarks/cluster_check.py --device cuda --transports ucx,tcp \
  --model-dir "$MODEL_DIR" --json "$RESULTS/cluster.json" --markdown "$RESULTS/cluster.md" \
  2>&1 | grep -v "Writing model shards" | tee "$RESULTS/cluster.txt"
cluster_rc=${PIPESTATUS[0]}
fi

echo "gpu_check ($STEPS): tests rc=$tests_rc, offline rc=$offline_rc, kvtransfer rc=$kv_rc," \
  "kernel benchmark rc=$bench_rc, quantized rc=$quant_rc, cluster rc=$cluster_rc; results in $RESULTS" | tee -a "$RESULTS/gpu_check.txt"
if [ -n "${OUT:-}" ]; then  # one archive: the device session brings back at most 8 files
  (cd "$RESULTS" && files=$(ls | grep -v -e '^gpu_check.tar.gz$') &&
   tar -czf gpu_check.tar.gz $files && rm -f $(echo "$files" | grep -v '^gpu_check.txt$'))
fi
[ "$tests_rc" -eq 0 ] && [ "$offline_rc" -eq 0 ] && [ "$kv_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$quant_rc" -eq 0 ] && [ "$cluster_rc" -eq 0 ]
