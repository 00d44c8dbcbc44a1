"""The Triton backend's attention variants (engine/attention/variant.py: sliding window, logit
soft-cap, per-head sinks; alone and together) against the torch backend, their reference.

Batches: random block tables over a cache pre-filled with random values, ragged lengths, GQA,
decodes whose context is longer than the window, prefill chunks whose cached prefix crosses the
window, split-KV decodes (the sink joins the denominator once, in the combine), the 8-bit caches.
Without CUDA the kernels run under `TRITON_INTERPRET=1`, so the shapes are small (head_dim 16,
tiles of 16 tokens over blocks of 8).
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.attention import AttentionMetadata, TorchAttentionBackend, get_attention_backend  # noqa: E402
from engine.attention.triton_backend import TritonAttentionBackend, TritonAttentionConfig  # noqa: E402
from engine.attention.variant import AttentionVariant  # noqa: E402
from engine.kv_quant import KVQuantFormat  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 0.5  # head_dim 16, unit-variance inputs: scores of a few units, so a soft-cap of 2 bites
HEAD_DIM = 16
BLOCK_SIZE = 8
TILE = 16


def triton_backend(splits: int | None = None, kv_format: KVQuantFormat | None = None) -> TritonAttentionBackend:
    get_attention_backend("triton")  # turns the interpreter on where there is no CUDA
    return TritonAttentionBackend(TritonAttentionConfig(decode_tile_n=TILE, prefill_block_m=16, prefill_tile_n=TILE,
                                                        decode_num_splits=splits), kv_format=kv_format)


def make_batch(query_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int, seed: int,
               dtype: torch.dtype = torch.float32):
    """(query, key, value, cache, metadata): shuffled block ids, a few spare blocks, random cache."""
    generator = torch.Generator().manual_seed(seed)
    needed = [-(-n // BLOCK_SIZE) for n in seq_lens]
    free = torch.randperm(sum(needed) + 3, generator=generator).tolist()
    tables = []
    for count in needed:
        tables.append(free[:count])
        free = free[count:]
    tokens = sum(query_lens)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    cache = rand(sum(needed) + 3, 2, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE, "cpu")
    return (rand(tokens, num_heads, HEAD_DIM), rand(tokens, num_kv_heads, HEAD_DIM),
            rand(tokens, num_kv_heads, HEAD_DIM), cache, meta)


def on_device(meta: AttentionMetadata) -> AttentionMetadata:
    return meta.to(DEVICE)


def compare(batch, variant: AttentionVariant, splits: int | None = None, atol: float = 1e-5,
            kv_format: KVQuantFormat | None = None) -> torch.Tensor:
    """Triton (on the device) vs the torch backend on CPU: the outputs and the caches after the
    store. Returns the torch output."""
    query, key, value, cache, meta = batch
    expected_cache = cache.clone()
    expected = TorchAttentionBackend(kv_format).forward(query, key, value, expected_cache, meta, SCALE, variant)
    device_cache = cache.clone().to(DEVICE)
    device_variant = variant
    if variant.sinks is not None:
        device_variant = AttentionVariant(variant.sliding_window, variant.softcap, variant.sinks.to(DEVICE))
    out = triton_backend(splits, kv_format).forward(query.to(DEVICE), key.to(DEVICE), value.to(DEVICE), device_cache,
                                                    on_device(meta), SCALE, device_variant)
    assert out.dtype == query.dtype and out.shape == query.shape
    torch.testing.assert_close(out.cpu(), expected, atol=atol, rtol=0)
    assert torch.equal(device_cache.cpu(), expected_cache)
    return expected


def sinks_for(num_heads: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sinks from well below to above the scores' range: some heads barely feel theirs, some
    are dominated by it."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(num_heads, generator=generator) * 3.0).to(dtype)


def variants(num_heads: int, window: int) -> dict[str, AttentionVariant]:
    sinks = sinks_for(num_heads, window)
    return {
        "window": AttentionVariant(sliding_window=window),
        "softcap": AttentionVariant(softcap=2.0),
        "sinks": AttentionVariant(sinks=sinks),
        "all": AttentionVariant(sliding_window=window, softcap=2.0, sinks=sinks),
    }


# (query_lens, seq_lens): every decode's context and every chunk's cached prefix reach past the
# window of 20 (a chunk's first query sees from inside its prefix, the last from inside the chunk)
# except a few short ones (a first token, a context shorter than the window).
BATCHES = {
    # a window start on a tile's first key (36: keys 16..35), its last (51: 31..50) and its middle;
    # 70: 3 tiles skipped
    "decodes": ([1, 1, 1, 1, 1], [1, 36, 70, 19, 51]),
    # chunks after a prefix longer than the window, one shorter, and a first chunk longer than it
    "prefill": ([6, 24, 5], [41, 30, 5]),
    "mixed": ([1, 9, 1, 25, 1], [33, 50, 16, 25, 58]),
}
CASES = [
    # batch, (heads, kv heads), forced decode splits
    ("decodes", (4, 2), None),
    ("decodes", (6, 2), 2),
    ("decodes", (4, 1), 4),
    ("prefill", (4, 2), None),
    ("prefill", (6, 3), None),
    ("mixed", (6, 2), None),
    ("mixed", (4, 2), 4),
]


@pytest.mark.parametrize("name", ["window", "softcap", "sinks", "all"])
@pytest.mark.parametrize("batch_name,heads,splits", CASES)
def test_variant_matches_torch(batch_name, heads, splits, name):
    query_lens, seq_lens = BATCHES[batch_name]
    batch = make_batch(query_lens, seq_lens, *heads, seed=len(batch_name) + heads[0])
    variant = variants(heads[0], window=20)[name]
    expected = compare(batch, variant, splits)
    plain = TorchAttentionBackend().forward(batch[0], batch[1], batch[2], batch[3].clone(), batch[4], SCALE)
    assert not torch.allclose(expected, plain, atol=1e-3)  # the variant changes every batch here


@pytest.mark.parametrize("window", [1, 12, 16, 17, 200])
def test_window_edges(window):
    """A window of one key (the query's own), tile-sized and one past it, longer than any context:
    decodes split 2 ways and a mixed batch whose chunk crosses tile edges (window 12: the chunk's
    second query tile, queries 26.., sees from key 15 on, a tile's last)."""
    batch = make_batch([1, 1, 12, 1], [40, 17, 30, 64], 4, 2, seed=window)
    sinks = sinks_for(4, seed=window)
    compare(batch, AttentionVariant(sliding_window=window), splits=2)
    compare(batch, AttentionVariant(sliding_window=window, sinks=sinks), splits=None)


def test_extreme_scores_and_sinks_stay_finite():
    """Scores far past the soft-cap (tanh saturated both ways) and sinks far above and below every
    score: outputs near zero for the heads a sink dominates, no overflow or NaN, split or not."""
    batch = make_batch([1, 1, 7], [50, 9, 26], 4, 2, seed=3)
    query = batch[0] * 30.0
    batch = (query, *batch[1:])
    sinks = torch.tensor([80.0, -80.0, 0.0, 40.0])
    for splits in (None, 4):
        out = compare(batch, AttentionVariant(sliding_window=24, softcap=3.0, sinks=sinks), splits)
        assert bool(out.isfinite().all())


def test_sinks_in_a_16bit_dtype_and_fp16_inputs():
    """bf16 sinks (a checkpoint's dtype) with fp16 queries and cache: the kernels read the sinks
    as float32 values of the bf16 ones, as the reference does."""
    batch = make_batch([1, 1, 6], [37, 12, 28], 4, 2, seed=9, dtype=torch.float16)
    variant = AttentionVariant(sliding_window=20, softcap=2.0, sinks=sinks_for(4, 9, torch.bfloat16))
    query, key, value, cache, meta = batch
    as_fp32 = (query.float(), key.float(), value.float(), cache.float(), meta)
    expected = TorchAttentionBackend().forward(*as_fp32[:4], meta, SCALE, variant)
    for splits in (None, 2):
        out = triton_backend(splits).forward(query.to(DEVICE), key.to(DEVICE), value.to(DEVICE),
                                             cache.clone().to(DEVICE), on_device(meta), SCALE,
                                             AttentionVariant(20, 2.0, variant.sinks.to(DEVICE)))
        assert out.dtype == torch.float16
        torch.testing.assert_close(out.cpu().float(), expected, atol=2e-3, rtol=0)


@pytest.mark.parametrize("fmt_name,splits", [("int8", None), ("fp8_e4m3", 2)])
def test_variants_over_an_8bit_cache(fmt_name, splits):
    """The 8-bit caches: the variants act on the dequantized scores, as in the torch backend's
    dequantize-then-attend. The layer starts zeroed (fresh blocks), the prefixes stored first."""
    fmt = KVQuantFormat(fmt_name, block_size=BLOCK_SIZE, num_kv_heads=2, head_dim=HEAD_DIM)
    query_lens, seq_lens = [1, 7, 1], [45, 30, 9]
    generator = torch.Generator().manual_seed(5)
    needed = [-(-n // BLOCK_SIZE) for n in seq_lens]
    order = torch.randperm(sum(needed) + 2, generator=generator).tolist()
    tables = [order[sum(needed[:i]):sum(needed[:i + 1])] for i in range(len(needed))]
    layer = torch.zeros(sum(needed) + 2, fmt.block_bytes, dtype=torch.uint8)
    prefix = AttentionMetadata.build(seq_lens, seq_lens, tables, BLOCK_SIZE, "cpu")
    fmt.store(torch.randn(sum(seq_lens), 2, HEAD_DIM, generator=generator),
              torch.randn(sum(seq_lens), 2, HEAD_DIM, generator=generator), layer, prefix.slot_mapping)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE, "cpu")
    tokens = sum(query_lens)
    query, key, value = (torch.randn(tokens, heads, HEAD_DIM, generator=generator) for heads in (4, 2, 2))
    batch = (query, key, value, layer, meta)
    compare(batch, AttentionVariant(sliding_window=20, softcap=2.0, sinks=sinks_for(4, 5)), splits, atol=2e-5,
            kv_format=fmt)


def test_a_sliding_window_decode_skips_the_tiles_before_the_window(monkeypatch):
    """The decode loop starts at the window's first tile: the tiles before it are never visited
    (not merely masked), split or not; the prefill loop starts at its first query's first tile."""
    if DEVICE != "cpu":
        pytest.skip("counts tiles through the interpreter")
    from engine.attention import triton_kernels

    visited = []
    offsets = triton_kernels._paged_tile_offsets

    def recording(block_table_row_ptr, tokens, token_mask, *args, **kwargs):
        visited.append(int(tokens.handle.data.min()))
        return offsets(block_table_row_ptr, tokens, token_mask, *args, **kwargs)

    monkeypatch.setattr(triton_kernels, "_paged_tile_offsets", recording)
    batch = make_batch([1], [100], 2, 1, seed=1)  # window 20: keys 80..99, tiles 80 and 96
    for splits in (None, 2):
        visited.clear()
        compare(batch, AttentionVariant(sliding_window=20), splits)
        assert sorted(visited) == [80, 96]
    batch = make_batch([5], [100], 2, 1, seed=2)  # queries at 95..99 see keys 76..99
    visited.clear()
    compare(batch, AttentionVariant(sliding_window=20, sinks=sinks_for(2, 2)))
    assert sorted(visited) == [64, 80, 96]


def test_a_sinks_tensor_of_the_wrong_shape_is_refused_before_the_store():
    query, key, value, cache, meta = make_batch([1, 3], [10, 3], 4, 2, seed=4)
    device_cache = cache.clone().to(DEVICE)
    with pytest.raises(ValueError, match="sinks must have shape"):
        triton_backend().forward(query.to(DEVICE), key.to(DEVICE), value.to(DEVICE), device_cache, on_device(meta),
                                 SCALE, AttentionVariant(sinks=torch.zeros(2, device=DEVICE)))
    assert torch.equal(device_cache.cpu(), cache)
