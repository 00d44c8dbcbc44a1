"""Compile every Triton kernel launch the engine's wrappers make, for a GPU, on a machine without one.

Run as a script in a process where TRITON_INTERPRET is unset (the kernels must be defined as real
JIT functions): `python tests/engine/triton_compile_check.py [--arch 90]`. The wrappers run on CPU
tensors with `JITFunction.run` replaced by a recorder, so each launch's arguments, constexprs and
options are the ones a GPU run would pass; each distinct launch is then compiled to a cubin for
`cuda:<arch>` with the ptxas Triton ships, specialized as Triton's launcher specializes a GPU launch
(`launch_specialization`: integer arguments equal to 1 become constexprs, integers divisible by 16
and 16-byte-aligned pointers get divisibility hints, which decide vectorization and software
pipelining, hence shared memory); a launch that needs more shared memory per block than the
architecture has fails. Prints one JSON object: {"compiled": [...], "failed": {launch: error},
"shared": {launch: bytes}}. tests/engine/test_triton_compile.py runs it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

_TORCH_TO_TRITON = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int8: "i8",
                    torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")
# constexprs the wrappers set from the tensors' device: what a launch on CUDA passes
ON_CUDA = {"NEED_BY_RECIPROCAL": True, "LIBDEVICE": True}
# shared memory a block may use (opt-in maximum): A100 (sm_80) 163 KB, H100/H200 (sm_90) 227 KB
SHARED_MEMORY_PER_BLOCK = {80: 166912, 90: 232448}


def record_launches(run_wrappers) -> list[tuple[JITFunction, dict, dict]]:
    """(kernel, {param: value}, options) of every launch `run_wrappers()` makes, none executed."""
    launches = []

    def record(self, *args, grid, warmup, **kwargs):
        options = {name: kwargs.pop(name) for name in LAUNCH_OPTIONS if name in kwargs}
        values = dict(zip(self.arg_names, args), **kwargs)
        values.update({name: value for name, value in ON_CUDA.items() if name in values})
        launches.append((self, values, options))

    original, JITFunction.run = JITFunction.run, record
    try:
        run_wrappers()
    finally:
        JITFunction.run = original
    return launches


def signature_of(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TORCH_TO_TRITON[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton signature for {type(value).__name__} {value!r}")


def launch_specialization(param, value) -> tuple[str | None, object]:
    """What Triton's launcher makes of a runtime argument (`native_specialize_impl`, as
    `JITFunction.run` calls it): ("constexpr", value) for an integer 1, (None, "D") for a multiple of
    16 or a 16-byte-aligned pointer (the CPU tensors here are at least that aligned, as CUDA's)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    kind, hint = native_specialize_impl(BaseBackend, value, False, not param.do_not_specialize,
                                        not param.do_not_specialize_on_alignment)
    return ("constexpr", hint) if kind == "constexpr" else (None, hint)


def specialization(kernel: JITFunction, values: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of a launch, as `ASTSource` takes them."""
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[(index,)] = "constexpr", value
            continue
        kind, hint = launch_specialization(param, value)
        if kind == "constexpr":
            signature[param.name], constexprs[(index,)] = "constexpr", hint
            continue
        signature[param.name] = signature_of(value)
        if hint == "D":
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def describe(kernel: JITFunction, signature: dict, constexprs: dict) -> str:
    pointers = ", ".join(f"{name}:{kind}" for name, kind in signature.items() if kind.startswith("*"))
    consts = ", ".join(f"{kernel.params[index].name}={value}" for (index,), value in constexprs.items())
    return f"{kernel.fn.__name__}({pointers}; {consts})"


def engine_launches():
    """What a SmolLM2-135M-shaped model's forward launches (9 query heads, 3 KV heads, head dim
    64, block size 16): the store, decode (one split and several) and prefill kernels over caches
    in each float dtype and both 8-bit formats, and the elementwise ops; and the attention
    variants' specializations of the decode, combine and prefill kernels: each feature alone
    (bf16), all together over each float dtype and both 8-bit formats; the fused-MoE grouped
    GEMM's launches (`moe_launches`), the latent-attention decode's (`latent_launches`) and the
    quantized linear layers' (`quant_launches`)."""
    from engine.attention import triton_kernels as tk
    from engine.attention import triton_store as ts
    from engine.attention.variant import AttentionVariant
    from engine.kv_quant import KVQuantFormat
    from engine.model import triton_ops

    heads, kv_heads, dim, block, blocks = 9, 3, 64, 16, 8
    seq_lens = torch.tensor([5, 40], dtype=torch.int32)
    tables = torch.arange(2 * 4, dtype=torch.int32).view(2, 4)
    slots = torch.arange(4, dtype=torch.int64)

    sinks = torch.zeros(heads, dtype=torch.bfloat16)  # a checkpoint's dtype: the wrappers pass float32
    every = AttentionVariant(sliding_window=24, softcap=50.0, sinks=sinks)
    alone = [AttentionVariant(sliding_window=24), AttentionVariant(softcap=50.0), AttentionVariant(sinks=sinks)]

    def attend(query, cache, fmt, variant):
        for splits in (1, 4):
            tk.paged_decode_attention(torch.zeros_like(query), query, cache, tables, seq_lens,
                                      torch.tensor([0, 1, 2], dtype=torch.int32), 0.125, max_seq_len=40,
                                      num_splits=splits, tile_n=16, kv_format=fmt, variant=variant)
        tk.paged_prefill_attention(torch.zeros_like(query), query, cache, tables, seq_lens,
                                   torch.tensor([0, 2, 4], dtype=torch.int32), 0.125, max_query_len=2,
                                   block_m=64, tile_n=64, skip_single_token=True, kv_format=fmt, variant=variant)

    def run():
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            query = torch.zeros(4, heads, dim, dtype=dtype)
            key = torch.zeros(4, kv_heads, dim, dtype=dtype)
            caches = [(torch.zeros(blocks, 2, block, kv_heads, dim, dtype=dtype), None)]
            ts.store_kv_triton(key, key, caches[0][0], slots)
            for name in ("int8", "fp8_e4m3"):
                fmt = KVQuantFormat(name, block, kv_heads, dim)
                layer = torch.zeros(blocks, fmt.block_bytes, dtype=torch.uint8)
                ts.store_kv_8bit_triton(key, key, layer, slots, fmt, ts.sort_slots(slots))
                caches.append((layer, fmt))
            for cache, fmt in caches:
                attend(query, cache, fmt, None)
            attend(query, caches[0][0], None, every)
            if dtype == torch.bfloat16:
                for cache, fmt in caches[1:]:
                    attend(query, cache, fmt, every)
                for variant in alone:
                    attend(query, caches[0][0], None, variant)
            if dtype != torch.float16:
                x = torch.zeros(4, 576, dtype=dtype)
                triton_ops.rms_norm(x, torch.ones(576, dtype=dtype), 1e-5)
                triton_ops.add_rms_norm_(x, x.clone(), torch.ones(576, dtype=dtype), 1e-5)
                triton_ops.silu_and_mul(torch.zeros(4, 2 * 1536, dtype=dtype))
                cos = torch.zeros(128, dim, dtype=torch.float32)
                triton_ops.rotary_embedding(torch.zeros(4, dtype=torch.int64), query, key, cos, cos)
        moe_launches()
        latent_launches()
        quant_launches()
    return run


def moe_launches():
    """`triton_moe.fused_moe`'s two grouped GEMMs (gate_up with the activation fused, down with
    the routing weight), over bf16, fp16 and fp32, for a decode step (16-row blocks) and a prefill
    chunk (64-row blocks): SwiGLU without biases in each dtype; in bf16 also GeGLU, and gpt-oss's
    clamped SwiGLU with biases and bf16 routing weights."""
    from engine.model.moe import ExpertActivation, ExpertWeights
    from engine.model.triton_moe import fused_moe

    num_experts, hidden, inter, top_k = 8, 64, 32, 2
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        kinds = [("silu", False)]
        if dtype == torch.bfloat16:
            kinds += [("gelu_pytorch_tanh", False), ("clamped_swiglu", True)]
        for kind, bias in kinds:
            activation = ExpertActivation(kind, 1.702, 7.0) if kind == "clamped_swiglu" else ExpertActivation(kind)
            w = ExpertWeights(torch.zeros(num_experts, 2 * inter, hidden, dtype=dtype),
                              torch.zeros(num_experts, hidden, inter, dtype=dtype),
                              torch.zeros(num_experts, 2 * inter, dtype=dtype) if bias else None,
                              torch.zeros(num_experts, hidden, dtype=dtype) if bias else None, activation)
            for tokens in (1, 100):  # moe_config: 16-row blocks, then 64-row
                experts = torch.arange(tokens * top_k).view(tokens, top_k) % num_experts
                weights = torch.full((tokens, top_k), 0.5, dtype=dtype if bias else torch.float32)
                fused_moe(torch.zeros(tokens, hidden, dtype=dtype), weights, experts, w)


def latent_launches():
    """`triton_latent.latent_decode_attention` (MLA decode) at DeepSeek-V3's sizes on one GPU of
    TP 8 (16 heads, latent 576 = 512 + 64, value 512, block size 16) and the tiny test models'
    (4 heads, latent 40 = 32 + 8, value 32, block size 4): one split and four (with the combine
    kernel), over bf16, fp16 and fp32 caches, and the 8-bit caches under bf16 queries at
    DeepSeek's sizes."""
    from engine.attention import triton_latent
    from engine.kv_quant import KVQuantFormat

    seq_lens = torch.tensor([5, 200], dtype=torch.int32)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)
    for heads, value, rope, block in ((16, 512, 64, 16), (4, 32, 8, 4)):
        half = (value + rope) // 2
        blocks = -(-200 // block)
        tables = torch.arange(2 * blocks, dtype=torch.int32).view(2, blocks)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            query = torch.zeros(2, heads, 2 * half, dtype=dtype)
            out = torch.zeros(2, heads, value, dtype=dtype)
            caches = [(torch.zeros(2 * blocks, 2, block, 1, half, dtype=dtype), None)]
            if dtype == torch.bfloat16 and value == 512:
                for name in ("int8", "fp8_e4m3"):
                    fmt = KVQuantFormat(name, block, 1, half)
                    caches.append((torch.zeros(2 * blocks, fmt.block_bytes, dtype=torch.uint8), fmt))
            for cache, fmt in caches:
                for splits in (1, 4):
                    triton_latent.latent_decode_attention(out, query, cache, tables, seq_lens, starts, 0.07, value,
                                                          max_seq_len=200, num_splits=splits, kv_format=fmt)


def quant_launches():
    """`triton_quant`'s weight-only linear layers for a decode step (M 1: 16-row tiles) and a
    prefill chunk (M 64: 64-row tiles): fp8 with 128 x 128 block scales (DeepSeek-V3, Qwen3 FP8)
    and per-channel scales, over bf16 and fp16 x, with and without bias, N = K = 2048; AWQ and GPTQ
    (act-order g_idx, AutoGPTQ's zero offset 1) with groups of 128 over bf16 x, N = K = 1024."""
    from engine.model.triton_quant import fp8_linear, int4_linear

    n = k = 2048
    weight = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
    scales = {(128, 128): torch.ones(n // 128, k // 128), None: torch.ones(n, 1)}
    for dtype in (torch.bfloat16, torch.float16):
        for block, scale in scales.items():
            for m in (1, 64):
                fp8_linear(torch.zeros(m, k, dtype=dtype), weight, scale, block,
                           torch.zeros(n, dtype=dtype) if block is None else None)
    n = k = 1024
    group_index = torch.arange(k, dtype=torch.int32) // 128
    for awq in (True, False):
        qweight = torch.zeros((k, n // 8) if awq else (k // 8, n), dtype=torch.int32)
        qzeros = torch.zeros(k // 128, n // 8, dtype=torch.int32)
        for m in (1, 64):
            int4_linear(torch.zeros(m, k, dtype=torch.bfloat16), qweight, qzeros,
                        torch.ones(k // 128, n, dtype=torch.float16), group_index, awq, 0 if awq else 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90: H100/H200)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the kernels must be defined as JIT functions to compile")
    compiled, failed, shared = [], {}, {}
    for kernel, values, options in record_launches(engine_launches()):
        signature, constexprs, attrs = specialization(kernel, values)
        name = describe(kernel, signature, constexprs) + (f" {options}" if options else "")
        if name in compiled or name in failed:
            continue
        try:
            source = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
            binary = triton.compile(source, target=GPUTarget("cuda", args.arch, 32), options=options)
            if not binary.asm.get("cubin"):
                raise RuntimeError("no cubin")
            limit = SHARED_MEMORY_PER_BLOCK.get(args.arch)
            if limit is not None and binary.metadata.shared > limit:
                raise RuntimeError(f"needs {binary.metadata.shared} bytes of shared memory per block; "
                                   f"sm_{args.arch} has {limit}")
            compiled.append(name)
            shared[name] = binary.metadata.shared
        except Exception:  # noqa: BLE001 (report every launch's failure, not just the first)
            failed[name] = traceback.format_exc(limit=-3)[-3000:]
    print(json.dumps({"arch": args.arch, "triton": triton.__version__, "compiled": compiled, "failed": failed,
                      "shared": shared}))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
