"""The Triton backend over the 8-bit KV cache (engine/kv_quant.py): its store writes exactly the
bytes `KVQuantFormat.store` writes, its attention (decode with and without split-KV, prefill
chunks with and without a cached prefix, mixed batches) matches dequantize-then-attend, and its
fp8 e4m3 bit decoding and rounding match torch's. Without CUDA the kernels run under
`TRITON_INTERPRET=1` on CPU tensors; with CUDA on the GPU (benchmarks/gpu_check.sh runs them).
"""
from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.attention import get_attention_backend  # noqa: E402
from engine.attention.metadata import AttentionMetadata  # noqa: E402
from engine.attention.triton_backend import TritonAttentionBackend, TritonAttentionConfig  # noqa: E402
from engine.attention.triton_kernels import _unscaled_8bit  # noqa: E402
from engine.attention.triton_store import _quantize, _stored_to_f32  # noqa: E402
from engine.cuda_graphs import DecodeGraphs  # noqa: E402
from engine.kv_quant import KVQuantFormat  # noqa: E402
from tests.engine.test_attention import on_device_tensor  # noqa: E402
from tests.engine.test_kv_quant import FORMATS, dequantize_then_attend  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from random_model import write_random_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QUANT = {"int8": 1, "fp8_e4m3": 2}


def triton_8bit_backend(fmt: KVQuantFormat, decode_num_splits: int | None = None) -> TritonAttentionBackend:
    """The factory's backend for `fmt` (the factory turns the interpreter on where there is no
    CUDA), with small tiles."""
    made = get_attention_backend("triton", fmt)
    assert isinstance(made, TritonAttentionBackend) and made.kv_format is fmt
    return TritonAttentionBackend(TritonAttentionConfig(decode_tile_n=16, prefill_block_m=16, prefill_tile_n=16,
                                                        decode_num_splits=decode_num_splits), kv_format=fmt)


# ---- fp8 e4m3 bits and quantization, element by element -----------------------------------------

@triton.jit
def _decode_e4m3_kernel(bits_ptr, unscaled_ptr, stored_ptr):
    offsets = tl.arange(0, 256)
    bits = tl.load(bits_ptr + offsets)
    tl.store(unscaled_ptr + offsets, _unscaled_8bit(bits, tl.float32, 2))
    tl.store(stored_ptr + offsets, _stored_to_f32(bits, 2))


def test_triton_decodes_every_fp8_e4m3_bit_pattern_as_torch():
    bits = on_device_tensor(torch.arange(256, dtype=torch.int32).to(torch.uint8))
    unscaled, stored = torch.empty(256, device=DEVICE), torch.empty(256, device=DEVICE)
    _decode_e4m3_kernel[(1,)](bits, unscaled, stored)
    expected = bits.cpu().view(torch.float8_e4m3fn).float()
    nan = torch.tensor([0x7F, 0xFF])
    number = torch.ones(256, dtype=torch.bool)
    number[nan] = False
    assert int(number.sum()) == 254 and not bool(expected[number].isnan().any())
    # the attention kernels read value / 256 (the scale puts the 256 back)
    assert torch.equal(unscaled.cpu()[number] * 256, expected[number])
    assert torch.equal(stored.cpu()[number], expected[number])
    assert bool(stored.cpu()[nan].isnan().all())  # the store's re-quantization keeps NaN as NaN


@triton.jit
def _quantize_kernel(x_ptr, scale_ptr, out_ptr, n, qmax, QUANT: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    scale = tl.load(scale_ptr + offsets, mask=mask, other=1.0)
    tl.store(out_ptr + offsets, _quantize(x, scale, qmax, QUANT), mask=mask)


def quantize_inputs(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Values on and between the 8-bit grid (ties, one float32 ulp either side of them), past
    +-qmax, tiny ones (fp8 subnormals), signed zeros, and random ones at random scales."""
    generator = torch.Generator().manual_seed(3)
    if name == "int8":
        grid = torch.arange(-127, 128, dtype=torch.float32)
    else:
        grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
        grid = grid[~grid.isnan()].sort().values
    ties = (grid[1:] + grid[:-1]) / 2
    on_scale_one = torch.cat([grid, ties, torch.nextafter(ties, torch.tensor(float("inf"))),
                              torch.nextafter(ties, torch.tensor(float("-inf"))),
                              torch.tensor([0.0, -0.0, 127.4, 127.6, 200.0, -448.0, 449.0, 500.0, -1e6, 1e-3,
                                            -2.0 ** -10, 2.0 ** -12, 3 * 2.0 ** -11])])
    random_x = torch.randn(2000, generator=generator) * 10.0 ** torch.randint(-3, 3, (2000,), generator=generator)
    random_scales = torch.rand(2000, generator=generator) * 0.1 + 1e-8
    x = torch.cat([on_scale_one, random_x])
    scales = torch.cat([torch.ones_like(on_scale_one), random_scales])
    if name == "fp8_e4m3":  # NaN stays NaN (int8 has none: converting NaN to it is undefined)
        x = torch.cat([x, torch.tensor([float("nan")])])
        scales = torch.cat([scales, torch.ones(1)])
    return x, scales


@pytest.mark.parametrize("name", FORMATS)
def test_triton_quantizes_exactly_as_kv_quant_format(name):
    fmt = KVQuantFormat(name, 8, 1, 16)
    x, scales = quantize_inputs(name)
    expected = fmt.quantize(on_device_tensor(x), on_device_tensor(scales)).view(torch.uint8).cpu()
    out = torch.empty(x.shape[0], dtype=torch.int8 if name == "int8" else torch.uint8, device=DEVICE)
    _quantize_kernel[(triton.cdiv(x.shape[0], 1024),)](on_device_tensor(x), on_device_tensor(scales), out,
                                                        x.shape[0], fmt.qmax, QUANT=QUANT[name], BLOCK=1024)
    got = out.view(torch.uint8).cpu()
    differ = (got != expected).nonzero().flatten()[:5].tolist()
    assert not differ, [(x[i].item(), scales[i].item(), got[i].item(), expected[i].item()) for i in differ]


# ---- the store -----------------------------------------------------------------------------------

def garbage_layer(fmt: KVQuantFormat, num_blocks: int, generator: torch.Generator) -> torch.Tensor:
    """What earlier owners left: random bytes (fp8 NaN patterns too), positive scales and finite
    K references (a block is only ever continued mid-block by the owner that started it)."""
    layer = torch.randint(0, 256, (num_blocks, fmt.block_bytes), dtype=torch.uint8, generator=generator)
    _, scales, refs = fmt.split(layer)
    scales.copy_(torch.rand(scales.shape, generator=generator) * 0.05 + 1e-4)
    refs.copy_(torch.randn(refs.shape, generator=generator))
    return layer


@pytest.mark.parametrize("name", FORMATS)
def test_triton_store_writes_the_bytes_kv_quant_format_store_writes(name):
    """Writes as a serving loop makes them, onto blocks earlier owners left behind: a prompt over
    fresh blocks, decodes whose growing values re-quantize their blocks, a chunk that starts
    mid-block, then slots in no order (blocks interleaved, -1 padding) from float16 rows.
    3 KV heads x head_dim 24: neither a power of two."""
    fmt = KVQuantFormat(name, block_size=8, num_kv_heads=3, head_dim=24)
    generator = torch.Generator().manual_seed(1)
    expected = garbage_layer(fmt, 14, generator)
    layer = on_device_tensor(expected.clone())
    backend = triton_8bit_backend(fmt)

    def slots_of(block: int, offsets) -> list[int]:
        return [block * 8 + offset for offset in offsets]

    writes = [
        (slots_of(5, range(8)) + slots_of(2, range(8)) + slots_of(9, range(4)), 1.0, torch.float32),
        (slots_of(9, [4]) + slots_of(1, [3]) + [-1], 3.0, torch.float32),
        (slots_of(1, [4]) + slots_of(9, [5]), 8.0, torch.float32),
        (slots_of(9, [6, 7]) + slots_of(11, range(6)), 20.0, torch.float32),
        (None, 40.0, torch.float16),
    ]
    for slots, magnitude, dtype in writes:
        if slots is None:
            slots = slots_of(11, [6, 7]) + slots_of(12, range(5)) + slots_of(3, [2, 5]) + [-1, -1]
            random.Random(2).shuffle(slots)
        slots = torch.tensor(slots)
        key = (torch.randn(len(slots), 3, 24, generator=generator) * magnitude).to(dtype)
        value = (torch.randn(len(slots), 3, 24, generator=generator) * magnitude).to(dtype)
        fmt.store(key, value, expected, slots)
        backend.store_kv(on_device_tensor(key), on_device_tensor(value), layer, on_device_tensor(slots))
        differ = (layer.cpu() != expected).nonzero()
        assert differ.shape[0] == 0, (slots.tolist(), differ[:5].tolist())


# ---- attention against dequantize-then-attend ---------------------------------------------------

# (query_lens, seq_lens): decodes only (a sequence's first token, block and tile edges),
# prefill chunks without and with a cached prefix, and a mix of both.
CASES_8BIT = {
    "decode_only": ([1, 1, 1, 1, 1], [1, 9, 16, 33, 64]),
    "prefill_only": ([5, 19, 2], [5, 19, 2]),
    "prefill_with_prefix": ([7, 16, 3], [30, 48, 11]),
    "mixed": ([1, 9, 1, 20, 1, 4], [33, 9, 16, 52, 70, 7]),
}
TRITON_8BIT_CASES = [
    # case, forced decode splits (None: the backend's choice), query dtype
    ("decode_only", 1, torch.float32),
    ("decode_only", 4, torch.float32),
    ("prefill_only", None, torch.float32),
    ("prefill_with_prefix", None, torch.float32),
    ("mixed", 1, torch.float32),
    ("mixed", 2, torch.float32),
    ("mixed", 2, torch.float16),
]


@pytest.mark.parametrize("case,splits,dtype", TRITON_8BIT_CASES)
@pytest.mark.parametrize("name", FORMATS)
def test_triton_attention_over_an_8bit_cache_matches_dequantize_then_attend(name, case, splits, dtype):
    """GQA (4 query heads per KV head), ragged lengths, random block tables (a tile of 16 tokens
    spans two blocks of 8) over blocks earlier owners left garbage in; the cached prefixes stored
    by the backend first; the cache after the forward pass holds the bytes `KVQuantFormat.store`
    writes."""
    query_lens, seq_lens = CASES_8BIT[case]
    rng = random.Random(len(case) + QUANT[name])
    generator = torch.Generator().manual_seed(len(case))
    num_heads, fmt = 8, KVQuantFormat(name, block_size=8, num_kv_heads=2, head_dim=32)
    num_blocks = sum(-(-n // 8) for n in seq_lens) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = [[ids.pop() for _ in range(-(-n // 8))] for n in seq_lens]
    backend = triton_8bit_backend(fmt, splits)
    expected_layer = garbage_layer(fmt, num_blocks, generator)
    layer = on_device_tensor(expected_layer.clone())

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    for query_len, seq_len, table in zip(query_lens, seq_lens, tables):
        context = seq_len - query_len
        if context:  # written by earlier steps
            slots = torch.tensor([table[p // 8] * 8 + p % 8 for p in range(context)])
            key, value = rand(context, 2, 32, scale=2.0), rand(context, 2, 32)
            fmt.store(key, value, expected_layer, slots)
            backend.store_kv(on_device_tensor(key), on_device_tensor(value), layer, on_device_tensor(slots))
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, 8, DEVICE)
    tokens = sum(query_lens)
    query, key, value = rand(tokens, num_heads, 32), rand(tokens, 2, 32, scale=2.0), rand(tokens, 2, 32)
    scale = 32 ** -0.5
    out = backend.forward(on_device_tensor(query), on_device_tensor(key), on_device_tensor(value), layer, meta, scale)
    assert out.dtype == dtype and out.shape == query.shape
    fmt.store(key, value, expected_layer, meta.slot_mapping.cpu())
    assert torch.equal(layer.cpu(), expected_layer)
    cpu_meta = AttentionMetadata.build(query_lens, seq_lens, tables, 8, "cpu")
    expected = dequantize_then_attend(fmt, expected_layer, query, cpu_meta, scale, num_heads)
    atol, rtol = (2e-5, 1e-4) if dtype == torch.float32 else (3e-3, 3e-3)
    error = (out.cpu().double() - expected).abs().max().item()
    assert torch.allclose(out.cpu().double(), expected, atol=atol, rtol=rtol), error


def test_auto_picks_the_triton_backend_on_cuda_for_an_8bit_cache_too():
    from engine.config import CacheConfig, EngineConfig
    config = EngineConfig(device="cpu", cache=CacheConfig(kv_cache_dtype="int8"))
    assert config.backend_name == "cpu"
    config.device = "cuda:0"  # what resolve_device gives where CUDA is
    assert config.backend_name == "triton"


# ---- the engine ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FORMATS)
def test_the_engine_on_triton_over_an_8bit_cache_gives_the_torch_backends_tokens(tmp_path, name):
    """A tiny random model, greedy: prompts that cross blocks, then decode steps as CUDA graphs
    (without CUDA their padded static-buffer path run eagerly: padding rows have slot -1 and
    context 0), token-identical to the torch backend's dequantize-then-attend."""
    model_dir = write_random_model(str(tmp_path), num_layers=2, dtype=torch.float32, vocab_size=512,
                                   hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    rng = random.Random(3)
    prompts = [[rng.randint(3, 511) for _ in range(rng.randint(2, 24))] for _ in range(3)]
    options = dict(device=DEVICE, dtype="float32", num_blocks=64, max_num_seqs=20, kv_cache_dtype=name)
    expected = LLM(model_dir, attention_backend="torch", **options).generate(prompts, greedy, use_tqdm=False)
    llm = LLM(model_dir, attention_backend="triton", **options)
    runner = llm.engine.runner
    assert runner.backend.name == "triton" and runner.backend.kv_format is runner.kv_format
    if runner.decode_graphs is None:  # no CUDA
        runner.decode_graphs = DecodeGraphs(runner.model, runner.kv_layers, runner.backend, runner.block_size,
                                            runner.max_model_len, 20, runner.arch.vocab_size, runner.device,
                                            capture=False)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert runner.decode_graphs.num_replays == greedy.max_tokens - 1
