"""The 8-bit KV cache (engine/kv_quant.py): the block format, attention over it on every CPU
backend against dequantize-then-attend, and the layout both sides of a transfer must share."""
from __future__ import annotations

import random

import pytest
import torch

from engine.attention import get_attention_backend
from engine.attention.metadata import AttentionMetadata
from engine.kv_quant import MIN_SCALE, KVQuantFormat, kv_quant_format
from kvtransfer import KVLayout, LayoutMismatchError
from kvtransfer.layout import check_layouts

FORMATS = ("int8", "fp8_e4m3")
# |error| / the block's absmax: a value written once is off by at most half a step (int8: 0.5 / 127;
# fp8 e4m3 keeps 3 mantissa bits, 2^-4 relative); each time its block's scale grows it is rounded
# again, at the new scale. Bounded here by two steps, over seven growths.
TOLERANCE = {"int8": 2.0 / 127, "fp8_e4m3": 2 * 2.0 ** -4}


def empty_layer(fmt: KVQuantFormat, num_blocks: int) -> torch.Tensor:
    return torch.zeros(num_blocks, fmt.block_bytes, dtype=torch.uint8)


@pytest.mark.parametrize("name", FORMATS)
def test_a_block_reads_back_what_was_written_as_its_scale_grows(name):
    fmt = KVQuantFormat(name, block_size=8, num_kv_heads=2, head_dim=16)
    layer = empty_layer(fmt, 4)
    torch.manual_seed(0)
    written = torch.zeros(8, 2, 2, 16)
    for offset in range(8):  # decodes: one token per step, each larger than the last
        k, v = torch.randn(1, 2, 16) * (1 + offset), torch.randn(1, 2, 16) * (1 + offset)
        fmt.store(k, v, layer, torch.tensor([2 * 8 + offset]))
        written[offset, 0], written[offset, 1] = k[0], v[0]
    block = fmt.dequantize(layer, torch.tensor([2]), torch.float32)[0]  # [2, 8, heads, dim]
    expected = written.permute(1, 0, 2, 3)
    _, scales, refs = fmt.split(layer)
    assert torch.equal(refs[2], written[0, 0].to(torch.bfloat16))  # K's reference: the first token's K
    centred = expected.clone()
    centred[0] -= refs[2].float()
    absmax = centred.abs().amax(dim=(1, 3))  # per (K/V, head): what was quantized
    error = (block - expected).abs().amax(dim=(1, 3))
    assert bool((error <= TOLERANCE[name] * absmax * 1.01).all()), (error / absmax).max()
    assert torch.allclose(scales[2], absmax / fmt.qmax)  # the largest |x - ref| / QMAX, after it grew 7 times
    assert bool((scales[[0, 1, 3]] == 0).all()) and bool((refs[[0, 1, 3]] == 0).all())  # other blocks untouched


@pytest.mark.parametrize("name", FORMATS)
def test_a_write_at_offset_zero_starts_the_block_afresh(name):
    fmt = KVQuantFormat(name, block_size=4, num_kv_heads=1, head_dim=8)
    layer = empty_layer(fmt, 2)
    fmt.store(torch.full((4, 1, 8), 100.0), torch.full((4, 1, 8), -100.0), layer, torch.arange(4, 8))
    small = torch.linspace(-0.01, 0.01, 8).view(1, 1, 8)  # a new owner of block 1: tiny values
    fmt.store(small, small, layer, torch.tensor([4]))
    _, scales, refs = fmt.split(layer)
    assert torch.equal(refs[1], small[0].to(torch.bfloat16))  # its own K, not the old owner's 100s
    # V's scale from its values, K's from what is left after the reference: the bf16 rounding
    assert torch.allclose(scales[1, 1], torch.full((1,), 0.01 / fmt.qmax))  # not the old owner's 100
    assert scales[1, 0].item() <= (small - small.to(torch.bfloat16).float()).abs().max().item() / fmt.qmax * 1.001
    back = fmt.dequantize(layer, torch.tensor([1]), torch.float32)[0, :, 0, 0]
    assert torch.allclose(back, small.view(1, 8).expand(2, 8), atol=0.01 * TOLERANCE[name])
    zeros = torch.zeros(1, 1, 8)  # a block of zeros: the smallest scale, never a division by 0
    fmt.store(zeros, zeros, layer, torch.tensor([0]))
    assert bool((scales[0] == MIN_SCALE).all())
    assert bool((fmt.dequantize(layer, torch.tensor([0]), torch.float32)[0, :, 0] == 0).all())


def test_the_format_checks_what_it_is_given():
    fmt = kv_quant_format("int8", 16, 3, 64)
    assert kv_quant_format("auto", 16, 3, 64) is None
    # values, a float32 scale per K/V and head, a bf16 K reference row per head
    assert fmt.block_bytes == 2 * 16 * 3 * 64 + 2 * 3 * 4 + 3 * 64 * 2 == 6552
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8_e4m3, int8"):
        kv_quant_format("fp4", 16, 3, 64)
    with pytest.raises(ValueError, match=r"must be \[num_blocks, 6552\] uint8"):
        fmt.split(torch.zeros(4, 2, 16, 3, 64))
    layer = torch.zeros(4, fmt.block_bytes, dtype=torch.uint8)
    fmt.store(torch.ones(2, 3, 64), torch.ones(2, 3, 64), layer, torch.tensor([-1, -1]))  # skipped slots
    assert bool((layer == 0).all())
    with pytest.raises(ValueError, match="slot_mapping has 1 entries for 2 tokens"):
        fmt.store(torch.ones(2, 3, 64), torch.ones(2, 3, 64), layer, torch.tensor([0]))


# ---- attention over an 8-bit cache -------------------------------------------------------------

def random_batch(rng: random.Random, fmt: KVQuantFormat, num_blocks: int):
    """Ragged sequences with random block tables: some decodes, some prefill chunks over a cached
    prefix, one whole prompt; the cached prefixes are stored first."""
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    query_lens, seq_lens, tables, prefixes = [], [], [], []
    for query_len, context in ((1, 37), (1, 5), (9, 20), (1, 64), (13, 0), (4, 3)):
        seq_len = context + query_len
        count = -(-seq_len // fmt.block_size)
        tables.append([ids.pop() for _ in range(count)])
        query_lens.append(query_len)
        seq_lens.append(seq_len)
        prefixes.append(context)
    return query_lens, seq_lens, tables, prefixes


def dequantize_then_attend(fmt, layer, query, meta, scale, num_heads):
    """The reference: every sequence's K/V read back from the 8-bit cache, then softmax attention
    in float64, causal over the cached prefix and the new tokens."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    group = num_heads // fmt.num_kv_heads
    start = 0
    for query_len, seq_len, table in zip(meta.query_lens_cpu, meta.seq_lens_cpu, meta.block_tables.tolist()):
        blocks = fmt.dequantize(layer, torch.tensor(table[: -(-seq_len // fmt.block_size)]), torch.float64)
        keys = blocks[:, 0].reshape(-1, fmt.num_kv_heads, fmt.head_dim)[:seq_len]
        values = blocks[:, 1].reshape(-1, fmt.num_kv_heads, fmt.head_dim)[:seq_len]
        for i in range(query_len):
            position = seq_len - query_len + i
            for head in range(num_heads):
                kv_head = head // group
                scores = keys[: position + 1, kv_head] @ query[start + i, head].double() * scale
                out[start + i, head] = torch.softmax(scores, 0) @ values[: position + 1, kv_head]
        start += query_len
    return out


@pytest.mark.parametrize("backend_name,dtype", [("torch", torch.float32), ("cpu", torch.float32),
                                                ("cpu", torch.bfloat16)])
@pytest.mark.parametrize("name", FORMATS)
def test_attention_over_an_8bit_cache_matches_dequantize_then_attend(backend_name, dtype, name):
    """GQA (4 query heads per KV head), ragged lengths, random block tables, decodes and prefill
    chunks in one batch (bf16 on the cpu backend: its flash prefill kernel where the CPU has
    AVX512-BF16); and it stays close to attention over the unquantized values."""
    rng = random.Random(7)
    torch.manual_seed(7)
    num_heads, fmt = 8, KVQuantFormat(name, block_size=8, num_kv_heads=2, head_dim=32)
    num_blocks = 48
    query_lens, seq_lens, tables, prefixes = random_batch(rng, fmt, num_blocks)
    backend = get_attention_backend(backend_name, fmt)
    float_backend = get_attention_backend("torch")
    layer = empty_layer(fmt, num_blocks)
    float_cache = torch.zeros(num_blocks, 2, fmt.block_size, fmt.num_kv_heads, fmt.head_dim)
    # the cached prefixes, written as earlier steps would have
    for context, table in zip(prefixes, tables):
        if context:
            slots = torch.tensor([table[p // fmt.block_size] * fmt.block_size + p % fmt.block_size
                                  for p in range(context)])
            k, v = torch.randn(context, 2, 32), torch.randn(context, 2, 32)
            backend.store_kv(k, v, layer, slots)
            float_backend.store_kv(k, v, float_cache, slots)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, fmt.block_size, "cpu")
    tokens = sum(query_lens)
    query, key, value = torch.randn(tokens, num_heads, 32), torch.randn(tokens, 2, 32), torch.randn(tokens, 2, 32)
    scale = 32 ** -0.5
    out = backend.forward(query.to(dtype), key.to(dtype), value.to(dtype), layer, meta, scale)
    assert out.dtype == dtype
    expected = dequantize_then_attend(fmt, layer, query.to(dtype), meta, scale, num_heads)
    atol, rtol = (2e-5, 1e-4) if dtype == torch.float32 else (2e-2, 2e-2)
    assert torch.allclose(out.double(), expected, atol=atol, rtol=rtol), (out.double() - expected).abs().max()
    unquantized = float_backend.forward(query, key, value, float_cache, meta, scale)
    error = (out.float() - unquantized).abs().max().item()
    assert error < {"int8": 0.03, "fp8_e4m3": 0.15}[name], error


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", FORMATS)
def test_decode_over_an_8bit_cache_reads_it_in_place_and_matches(name, dtype):
    """A decode-only batch on the cpu backend (the native kernel reads the 8-bit blocks in place):
    ragged lengths (a block's first token, a full block, long ones), random tables, GQA, against
    dequantize-then-attend."""
    rng = random.Random(11)
    torch.manual_seed(11)
    fmt = KVQuantFormat(name, block_size=16, num_kv_heads=3, head_dim=64)
    num_heads, num_blocks = 9, 96
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    seq_lens = [1, 16, 17, 100, 250, 33, 64]
    tables = [[ids.pop() for _ in range(-(-n // 16))] for n in seq_lens]
    backend = get_attention_backend("cpu", fmt)
    layer = empty_layer(fmt, num_blocks)
    for n, table in zip(seq_lens, tables):
        if n > 1:  # the context before this step's token
            slots = torch.tensor([table[p // 16] * 16 + p % 16 for p in range(n - 1)])
            backend.store_kv(torch.randn(n - 1, 3, 64) * 3, torch.randn(n - 1, 3, 64), layer, slots)
    meta = AttentionMetadata.build([1] * len(seq_lens), seq_lens, tables, 16, "cpu")
    query = torch.randn(len(seq_lens), num_heads, 64).to(dtype)
    key, value = torch.randn(len(seq_lens), 3, 64).to(dtype), torch.randn(len(seq_lens), 3, 64).to(dtype)
    out = backend.forward(query, key, value, layer, meta, 0.125)
    assert out.dtype == dtype
    expected = dequantize_then_attend(fmt, layer, query, meta, 0.125, num_heads)
    tolerance = 1e-4 if dtype is torch.float32 else 2e-2
    assert torch.allclose(out.double(), expected, atol=tolerance, rtol=tolerance), (out.double() - expected).abs().max()


# ---- the transfer layout -----------------------------------------------------------------------

def test_8bit_layouts_name_their_format_and_refuse_a_mismatched_peer():
    fmt = KVQuantFormat("fp8_e4m3", 16, 3, 64)
    packed = KVLayout.from_caches([torch.zeros(10, fmt.block_bytes, dtype=torch.uint8)] * 30, fmt)
    bf16 = KVLayout.from_caches([torch.zeros(10, 2, 16, 3, 64, dtype=torch.bfloat16)] * 30)
    fp32 = KVLayout.from_caches([torch.zeros(10, 2, 16, 3, 64)] * 30)
    # the chunks move as they are: half of bf16's bytes, a quarter of fp32's, plus per head 8 bytes
    # of scales and a bf16 K reference row (128 bytes)
    assert packed.chunk_nbytes == bf16.chunk_nbytes // 2 + 3 * (8 + 128) == fp32.chunk_nbytes // 4 + 408
    assert packed.chunk_nbytes / bf16.chunk_nbytes < 0.534
    assert KVLayout.from_wire(packed.to_wire()) == packed
    with pytest.raises(LayoutMismatchError) as refused:
        check_layouts(packed, bf16)
    assert "dtype=fp8_e4m3 with float32 scales and bf16 K references" in str(refused.value) and "dtype=bfloat16" in str(refused.value)
    int8 = KVLayout.from_caches([torch.zeros(10, fmt.block_bytes, dtype=torch.uint8)] * 30,
                                KVQuantFormat("int8", 16, 3, 64))
    with pytest.raises(LayoutMismatchError, match="int8 with float32 scales"):
        check_layouts(packed, int8)
    with pytest.raises(ValueError, match=r"an fp8_e4m3 cache is \[num_blocks, 6552\] uint8"):
        KVLayout.from_caches([torch.zeros(10, 2, 16, 3, 64)], fmt)


def test_a_blocks_kv_heads_split_into_blocks_of_their_own_and_join_back():
    """Tensor parallelism: a rank's share of a block (its KV heads' values, scales and K references) is a block
    of the same format over fewer heads, reading back exactly those heads."""
    from engine.config import CacheConfig
    fmt = KVQuantFormat("int8", block_size=4, num_kv_heads=3, head_dim=8)
    layer = empty_layer(fmt, 5)
    torch.manual_seed(5)
    fmt.store(torch.randn(20, 3, 8) * torch.tensor([1.0, 10.0, 100.0])[None, :, None], torch.randn(20, 3, 8),
              layer, torch.arange(20))
    ids = torch.tensor([3, 0, 4])
    shares = [fmt.select_heads(layer[ids], 0, 1), fmt.select_heads(layer[ids], 1, 2)]
    assert [share.shape[1] for share in shares] == [fmt.with_heads(1).block_bytes, fmt.with_heads(2).block_bytes]
    whole = fmt.dequantize(layer, ids, torch.float32)
    for share, (start, count) in zip(shares, ((0, 1), (1, 2))):
        part = fmt.with_heads(count).dequantize(share, torch.arange(3), torch.float32)
        assert torch.equal(part, whole[:, :, :, start:start + count])
    assert torch.equal(fmt.join_heads(shares), layer[ids])
    with pytest.raises(ValueError, match="parts hold 2 KV heads, the format has 3"):
        fmt.join_heads(shares[1:])
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8_e4m3, int8, got 'fp16'"):
        CacheConfig(kv_cache_dtype="fp16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", FORMATS)
def test_the_native_store_writes_the_bytes_the_reference_writes(name, dtype):
    """The cpu backend's store (engine/csrc/kv_store_cpu.cpp) against `KVQuantFormat.store`, byte
    for byte: random writes of 1-12 tokens (skipped slots, several tokens per block, blocks
    started afresh at offset 0, scales that grow and re-quantize what a block holds)."""
    backend = get_attention_backend("cpu", KVQuantFormat(name, block_size=8, num_kv_heads=2, head_dim=32))
    if not backend.native:
        pytest.skip("the native CPU kernels are not built here")
    fmt = backend.kv_format
    reference, native = empty_layer(fmt, 20), empty_layer(fmt, 20)
    rng = random.Random(3)
    torch.manual_seed(3)
    for _ in range(60):
        count = rng.randint(1, 12)
        slots = torch.tensor(rng.sample(range(-1, 160), count), dtype=torch.int64)
        key = (torch.randn(count, 2, 32) * rng.uniform(0.1, 5)).to(dtype)
        value = (torch.randn(count, 2, 32) * rng.uniform(0.1, 5)).to(dtype)
        fmt.store(key, value, reference, slots)
        backend.store_kv(key, value, native, slots)
        assert torch.equal(native, reference)
    assert bool((fmt.split(native).scales > 0).all())  # every block was written
