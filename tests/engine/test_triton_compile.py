"""Every Triton kernel launch the engine makes compiles for an A100 (sm_80) and an H100/H200 (sm_90),
here, without a GPU.

The CPU tests run the kernels under Triton's interpreter, which executes them as numpy and skips the
compiler's front end: code it accepts can still fail to compile for a GPU (a non-constexpr global,
two return types across constexpr branches: both were caught here). This runs
tests/engine/triton_compile_check.py (once per architecture, the two at once), which records the
launches of the store, decode (one and several splits), combine and prefill kernels over
bf16/fp16/fp32, int8 and fp8 caches, their attention-variant specializations (sliding window,
soft-cap, sinks: alone and together), the elementwise ops, the fused-MoE grouped GEMM (both
projections, each activation, decode- and prefill-sized blocks) and the latent-attention (MLA)
decode kernel (DeepSeek-V3's sizes and the tiny models', split and not, float and 8-bit caches), the
weight-only quantized linears (fp8 with block and per-channel scales, AWQ and GPTQ int4), and
compiles each to a cubin with the ptxas Triton ships, specialized as a GPU launch is (divisibility
hints, which set vectorization and pipelining), each within the architecture's shared memory per
block.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ARCHS = (80, 90)


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    """arch -> (exit status, stdout, stderr) of triton_compile_check.py for each architecture, both
    run at once: each is one process whose compiles (LLVM, then ptxas) run one at a time on one
    core, so with an empty Triton cache (a fresh machine) the pair takes about the time of one."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    folder = tmp_path_factory.mktemp("triton-compile")
    started = {}
    for arch in ARCHS:  # output to files: a full pipe would stall one process while the other is read
        out, err = (open(folder / f"sm_{arch}.{name}", "w+") for name in ("out", "err"))
        started[arch] = (subprocess.Popen([sys.executable, str(REPO / "tests" / "engine" / "triton_compile_check.py"),
                                           "--arch", str(arch)], cwd=REPO, env=env, stdout=out, stderr=err, text=True),
                         out, err)
    results, deadline = {}, time.monotonic() + 540
    try:
        for arch, (process, out, err) in started.items():
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
            out.seek(0)
            err.seek(0)
            results[arch] = (process.returncode, out.read(), err.read())
    finally:
        for process, out, err in started.values():
            if process.poll() is None:
                process.kill()
                process.wait()
            out.close()
            err.close()
    return results


@pytest.mark.parametrize("arch", ARCHS)
def test_every_triton_kernel_launch_compiles_for_the_gpu(arch, checks):
    returncode, stdout, stderr = checks[arch]
    report = json.loads(stdout.strip().splitlines()[-1]) if stdout.strip() else {}
    assert returncode == 0 and not report.get("failed"), (stderr[-3000:], report.get("failed"))
    kernels = {name.split("(")[0] for name in report["compiled"]}
    assert kernels == {"_store_kv_kernel", "_store_kv_8bit_kernel", "_paged_decode_kernel", "_combine_splits_kernel",
                       "_paged_prefill_kernel", "_rms_norm_kernel", "_silu_and_mul_kernel", "_rotary_kernel",
                       "_moe_gemm_kernel", "_latent_decode_kernel", "_fp8_linear_kernel", "_int4_linear_kernel"}
    # every cache kind reaches both attention kernels
    for quant in ("QUANT=0", "QUANT=1", "QUANT=2"):
        assert any(name.startswith("_paged_decode_kernel") and quant in name for name in report["compiled"])
        assert any(name.startswith("_paged_prefill_kernel") and quant in name for name in report["compiled"])

    def launched(kernel: str, *constexprs: str) -> bool:
        return any(name.startswith(kernel + "(") and all(f"{c}," in name or f"{c})" in name for c in constexprs)
                   for name in report["compiled"])

    # each attention variant alone, and all of them over every cache kind, split and not
    every = ("SLIDING=True", "SOFTCAP=True", "SINKS=True")
    for feature in every:
        others = [f.replace("True", "False") for f in every if f != feature]
        assert launched("_paged_decode_kernel", feature, *others, "NUM_SPLITS=1")
        assert launched("_paged_decode_kernel", feature, *others, "NUM_SPLITS=4")
        assert launched("_paged_prefill_kernel", feature, *others)
    for quant in ("QUANT=0", "QUANT=1", "QUANT=2"):
        for splits in ("NUM_SPLITS=1", "NUM_SPLITS=4"):
            assert launched("_paged_decode_kernel", quant, splits, *every)
        assert launched("_paged_prefill_kernel", quant, *every)
    for combine in (("SLIDING=True", "SINKS=False"), ("SLIDING=False", "SINKS=True"), ("SLIDING=True", "SINKS=True"),
                    ("SLIDING=False", "SINKS=False")):
        assert launched("_combine_splits_kernel", *combine)
    # the fused MoE's two GEMMs (gate_up with each activation fused; down with the routing weight),
    # in decode- and prefill-sized blocks, each float dtype, with and without biases
    for block_m in ("BLOCK_M=16", "BLOCK_M=64"):
        for activation in ("ACTIVATION=1", "ACTIVATION=2", "ACTIVATION=3"):
            assert launched("_moe_gemm_kernel", activation, "MUL_WEIGHT=False", block_m)
        assert launched("_moe_gemm_kernel", "ACTIVATION=0", "MUL_WEIGHT=True", "TOP_K=1", block_m)
        for bias in ("HAS_BIAS=False", "HAS_BIAS=True"):
            assert launched("_moe_gemm_kernel", "ACTIVATION=0", bias, block_m)
    for dtype in ("bf16", "fp16", "fp32"):
        assert any(name.startswith("_moe_gemm_kernel(") and f"a_ptr:*{dtype}" in name for name in report["compiled"])
    # MLA decode: DeepSeek-V3's sizes (latent 576 = 512 + 64) and the tiny models' (40 = 32 + 8), one
    # split and four (merged by the combine kernel at value width 512), each float dtype; 8-bit caches
    # at DeepSeek's sizes; within shared memory (the script fails a launch past it)
    def has(name: str, *constexprs: str) -> bool:
        return all(f"{c}," in name or f"{c})" in name for c in constexprs)

    latent = [name for name in report["compiled"] if name.startswith("_latent_decode_kernel(")]
    for splits in ("NUM_SPLITS=1", "NUM_SPLITS=4"):
        for value in ("VALUE_DIM=512", "VALUE_DIM=32"):
            for dtype in ("bf16", "fp16", "fp32"):
                assert any(f"query_ptr:*{dtype}" in name and has(name, value, splits, "QUANT=0") for name in latent)
        for quant in ("QUANT=1", "QUANT=2"):
            assert any(has(name, "VALUE_DIM=512", splits, quant) for name in latent)
    assert launched("_combine_splits_kernel", "DIM_POW2=512", "NUM_SPLITS=4")
    assert max(report["shared"][name] for name in latent) <= {80: 166912, 90: 232448}[arch]
