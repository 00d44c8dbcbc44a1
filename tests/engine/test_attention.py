"""Attention backends: torch against a plain loop reference, Triton (interpreted on CPU) against torch.

Every batch uses random, non-contiguous block tables (shuffled block ids), mixed sequence
lengths, and a cache pre-filled with random values, so a kernel that reads the wrong block,
the wrong KV head or past a sequence's end gives a wrong answer.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from engine.attention import (  # noqa: E402
    AttentionMetadata,
    TorchAttentionBackend,
    get_attention_backend,
    store_kv,
)
from engine.kv_quant import KVQuantFormat  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
SCALE = 0.125


@dataclass
class Batch:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    meta: AttentionMetadata
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]


def make_batch(query_lens: list[int], seq_lens: list[int], *, num_heads: int = 4, num_kv_heads: int = 2,
               head_dim: int = 64, block_size: int = 16, dtype: torch.dtype = torch.float32,
               seed: int = 0, spare_blocks: int = 3) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + spare_blocks
    free = torch.randperm(num_blocks, generator=generator).tolist()
    block_tables = []
    for count in blocks_needed:
        block_tables.append(free[:count])
        free = free[count:]
    num_tokens = sum(query_lens)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    return Batch(
        query=rand(num_tokens, num_heads, head_dim), key=rand(num_tokens, num_kv_heads, head_dim),
        value=rand(num_tokens, num_kv_heads, head_dim),
        kv_cache=rand(num_blocks, 2, block_size, num_kv_heads, head_dim),
        meta=AttentionMetadata.build(query_lens, seq_lens, block_tables, block_size, "cpu"),
        query_lens=query_lens, seq_lens=seq_lens, block_tables=block_tables)


def reference_attention(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Obviously correct: store token by token, then per sequence and head gather a contiguous
    K/V, and softmax over the visible positions. Returns (output, cache after the store)."""
    cache = batch.kv_cache.clone().double()
    block_size = cache.shape[2]
    num_heads, num_kv_heads = batch.query.shape[1], cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    token = 0
    for query_len, seq_len, table in zip(batch.query_lens, batch.seq_lens, batch.block_tables):
        for position in range(seq_len - query_len, seq_len):
            block, offset = table[position // block_size], position % block_size
            cache[block, 0, offset] = batch.key[token + position - (seq_len - query_len)].double()
            cache[block, 1, offset] = batch.value[token + position - (seq_len - query_len)].double()
        keys = torch.stack([cache[table[p // block_size], 0, p % block_size] for p in range(seq_len)])
        values = torch.stack([cache[table[p // block_size], 1, p % block_size] for p in range(seq_len)])
        for i in range(query_len):
            visible = seq_len - query_len + i + 1
            for head in range(num_heads):
                q = batch.query[token + i, head].double()
                scores = keys[:visible, head // group] @ q * SCALE
                weights = torch.softmax(scores, dim=0)
                out[token + i, head] = weights @ values[:visible, head // group]
        token += query_len
    return out, cache


def run_backend(backend, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    cache = batch.kv_cache.clone()
    out = backend.forward(batch.query, batch.key, batch.value, cache, batch.meta, SCALE)
    return out, cache


# (query_lens, seq_lens): decode-only, prefill-only, prefill after a cached prefix, mixed.
CASES = {
    "decode_only": ([1, 1, 1, 1], [1, 17, 40, 64]),
    "prefill_only": ([5, 19, 1], [5, 19, 1]),
    "prefill_with_prefix": ([7, 16, 3], [30, 48, 35]),
    "mixed": ([1, 9, 1, 20, 1], [33, 9, 16, 52, 70]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads,block_size", [((4, 2), 16), ((9, 3), 32), ((2, 2), 16)])
def test_torch_backend_matches_reference(case, heads, block_size):
    query_lens, seq_lens = CASES[case]
    batch = make_batch(query_lens, seq_lens, num_heads=heads[0], num_kv_heads=heads[1],
                       block_size=block_size, seed=len(case) + block_size)
    expected, expected_cache = reference_attention(batch)
    out, cache = run_backend(TorchAttentionBackend(), batch)
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)
    assert torch.equal(cache, expected_cache.float())


def test_torch_backend_head_dim_128_and_non_contiguous_query():
    batch = make_batch([1, 6, 1], [21, 40, 3], num_heads=8, num_kv_heads=2, head_dim=128, seed=5)
    expected, _ = reference_attention(batch)
    fused = torch.cat([batch.query.flatten(1), batch.key.flatten(1)], dim=1)
    batch.query = fused[:, : 8 * 128].view(-1, 8, 128)  # a strided view, as after a qkv split
    assert not batch.query.is_contiguous()
    out, _ = run_backend(TorchAttentionBackend(), batch)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)


def _cpu_backend():
    """The "cpu" backend; its native kernel must have built wherever a C++ compiler exists
    (CI has one), so a silent fallback to the torch path cannot pass these tests unnoticed."""
    backend = get_attention_backend("cpu")
    if not backend.native:
        if shutil.which("c++") and importlib.util.find_spec("ninja"):
            pytest.fail("the native CPU decode kernel did not build although a compiler is present")
        pytest.skip("no C++ compiler/ninja: the cpu backend runs the torch path")
    return backend


# Decode-only batches: (num_heads, num_kv_heads, head_dim, block_size, seq_lens). head_dim 64 and
# 128 take the AVX-512 path (where the CPU has it); 48 takes the portable loop. One sequence
# exercises the split-by-head work items, many sequences the whole-sequence items. Query groups
# of 1, 2, 3, 4 and 8 have compiled-in sizes, 5 and 7 take the run-time one; more than 16 query
# heads per work item are walked in several tiles (the last one short when 16 / group does not
# divide the KV heads).
CPU_DECODE_CASES = [
    (9, 3, 64, 16, [1, 15, 16, 17, 300, 33, 2, 64, 5]),
    (4, 4, 64, 16, [40]),
    (8, 2, 128, 32, [1, 31, 32, 33, 90]),
    (32, 4, 128, 16, [200]),
    (6, 2, 48, 8, [7, 8, 9, 70]),
    (16, 2, 64, 16, list(range(1, 40, 3))),
    (14, 2, 64, 16, [3, 50, 17, 100, 1]),
    (20, 4, 64, 8, [9, 33, 8, 1, 60]),
    (12, 12, 64, 16, [20, 5, 47, 1]),
    (24, 12, 128, 16, [70, 2, 18, 33]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,seq_lens", CPU_DECODE_CASES)
def test_cpu_backend_decode_matches_reference(dtype, heads, kv_heads, head_dim, block_size, seq_lens):
    backend = _cpu_backend()
    batch = make_batch([1] * len(seq_lens), seq_lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                       block_size=block_size, dtype=dtype, seed=head_dim + len(seq_lens))
    expected, expected_cache = reference_attention(batch)
    out, cache = run_backend(backend, batch)
    assert out.dtype == dtype and out.shape == batch.query.shape
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    assert torch.equal(cache, expected_cache.to(dtype))


@pytest.mark.parametrize("case", sorted(CASES))
def test_cpu_backend_equals_torch_backend_on_every_batch_kind(case):
    backend = _cpu_backend()
    query_lens, seq_lens = CASES[case]
    batch = make_batch(query_lens, seq_lens, num_heads=9, num_kv_heads=3, seed=11)
    expected, _ = run_backend(TorchAttentionBackend(), batch)
    out, _ = run_backend(backend, batch)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.fixture
def cpu_kernels_unavailable(monkeypatch):
    """The "cpu" backend as where its native kernels did not build or `PDSERVE_CPU_KERNELS=0`:
    `cpu_kernels.load()` gives None, so it must run the torch backend's paths."""
    from engine import cpu_kernels
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_cpu_backend_without_its_kernels_equals_torch_backend(cpu_kernels_unavailable, case, dtype):
    backend = get_attention_backend("cpu")
    assert not backend.native
    query_lens, seq_lens = CASES[case]
    batch = make_batch(query_lens, seq_lens, num_heads=9, num_kv_heads=3, dtype=dtype, seed=13)
    expected, expected_cache = run_backend(TorchAttentionBackend(), batch)
    out, cache = run_backend(backend, batch)
    assert torch.equal(out, expected)
    assert torch.equal(cache, expected_cache)


@pytest.mark.parametrize("case", sorted(CASES))
def test_cpu_backend_without_its_kernels_equals_torch_backend_on_an_int8_cache(cpu_kernels_unavailable, case):
    query_lens, seq_lens = CASES[case]
    batch = make_batch(query_lens, seq_lens, num_heads=9, num_kv_heads=3, seed=17)
    fmt = KVQuantFormat("int8", block_size=16, num_kv_heads=3, head_dim=64)
    reference, backend = get_attention_backend("torch", fmt), get_attention_backend("cpu", fmt)
    assert not backend.native
    # each sequence's tokens before this step, stored as earlier steps would have
    slots = torch.tensor([table[p // 16] * 16 + p % 16 for table, query_len, seq_len
                          in zip(batch.block_tables, query_lens, seq_lens) for p in range(seq_len - query_len)],
                         dtype=torch.int64)
    cached = batch.kv_cache.transpose(1, 2).reshape(-1, 2, 3, 64).index_select(0, slots)
    expected_layer = torch.zeros(batch.kv_cache.shape[0], fmt.block_bytes, dtype=torch.uint8)
    reference.store_kv(cached[:, 0], cached[:, 1], expected_layer, slots)
    layer = expected_layer.clone()
    expected = reference.forward(batch.query, batch.key, batch.value, expected_layer, batch.meta, SCALE)
    out = backend.forward(batch.query, batch.key, batch.value, layer, batch.meta, SCALE)
    assert torch.equal(out, expected)
    assert torch.equal(layer, expected_layer)


# Prefill-bearing batches for the bf16 flash-prefill kernel: (num_heads, num_kv_heads, head_dim,
# block_size, query_lens, seq_lens). Chunks shorter and longer than its 16-query blocks and
# 32-key tiles, with and without a cached prefix, next to decodes; head sizes that are not a
# multiple of 64 (96, 160, 224: its P V loop's groups of four 16-dim chunks, then two more).
CPU_PREFILL_CASES = [
    (9, 3, 64, 16, [5, 19, 1], [5, 19, 1]),
    (9, 3, 64, 16, [7, 16, 3], [30, 48, 35]),
    (9, 3, 64, 32, [1, 9, 1, 20, 1], [33, 9, 16, 52, 70]),
    (4, 4, 128, 16, [100, 33], [100, 90]),
    (8, 1, 32, 16, [64, 17], [64, 80]),
    (6, 2, 96, 16, [37, 1, 20], [37, 9, 85]),
    (4, 1, 160, 16, [21, 5], [70, 5]),
    (2, 2, 224, 32, [18], [90]),
]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,query_lens,seq_lens", CPU_PREFILL_CASES)
def test_cpu_backend_bf16_prefill_matches_reference(heads, kv_heads, head_dim, block_size, query_lens, seq_lens):
    backend = _cpu_backend()
    if not backend._flash_prefill:
        pytest.skip("this CPU has no AVX512-BF16: bf16 prefill stays on torch's SDPA")
    batch = make_batch(query_lens, seq_lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                       block_size=block_size, dtype=torch.bfloat16, seed=head_dim + sum(query_lens))
    expected, expected_cache = reference_attention(batch)
    out, cache = run_backend(backend, batch)
    assert out.dtype == torch.bfloat16 and out.shape == batch.query.shape
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
    assert torch.equal(cache, expected_cache.to(torch.bfloat16))
    # the same as torch's SDPA path up to bf16 rounding of the output
    torch_out, _ = run_backend(TorchAttentionBackend(), batch)
    torch.testing.assert_close(out.double(), torch_out.double(), atol=2e-2, rtol=2e-2)


def test_cpu_backend_rejects_a_query_whose_dtype_differs_from_the_cache():
    backend = _cpu_backend()
    batch = make_batch([1, 1], [5, 9])
    with pytest.raises(RuntimeError, match="dtype"):
        backend._kernels.paged_decode_attention(batch.query.double(), batch.kv_cache.double(),
                                                batch.meta.block_tables, batch.meta.seq_lens, SCALE)


def test_a_stale_kernel_build_lock_is_removed_and_a_live_one_kept(tmp_path):
    """torch waits forever on its build lock; one left by a builder that died must not hang
    every later worker, while a lock of a build in progress must stay."""
    from engine import cpu_kernels
    lock = tmp_path / "lock"
    lock.touch()
    cpu_kernels._remove_stale_lock(lock)
    assert lock.exists()
    old = lock.stat().st_mtime - cpu_kernels._STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    cpu_kernels._remove_stale_lock(lock)
    assert not lock.exists()
    cpu_kernels._remove_stale_lock(lock)  # already gone: fine


def test_padding_tokens_are_not_stored_and_give_zeros():
    batch = make_batch([1, 4], [9, 20], seed=3)
    expected, expected_cache = reference_attention(batch)
    pad = 3
    num_tokens = batch.query.shape[0]
    batch.query = torch.cat([batch.query, torch.randn(pad, *batch.query.shape[1:])])
    batch.key = torch.cat([batch.key, torch.randn(pad, *batch.key.shape[1:])])
    batch.value = torch.cat([batch.value, torch.randn(pad, *batch.value.shape[1:])])
    batch.meta.slot_mapping = torch.cat([batch.meta.slot_mapping, torch.full((pad,), -1)])
    out, cache = run_backend(TorchAttentionBackend(), batch)
    torch.testing.assert_close(out[:num_tokens].double(), expected, atol=2e-5, rtol=1e-5)
    assert torch.count_nonzero(out[num_tokens:]) == 0
    assert torch.equal(cache, expected_cache.float())


@pytest.mark.parametrize("contiguous", [True, False])
def test_store_kv_skips_negative_slots(contiguous):
    generator = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_kv_heads, head_dim = 4, 8, 2, 16
    storage = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    cache = storage.transpose(0, 1) if not contiguous else storage.transpose(0, 1).contiguous()
    assert cache.is_contiguous() == contiguous
    before = cache.clone()
    key = torch.randn(4, num_kv_heads, head_dim, generator=generator)
    value = torch.randn(4, num_kv_heads, head_dim, generator=generator)
    slots = torch.tensor([13, -1, 0, 31])
    store_kv(key, value, cache, slots)
    expected = before.clone()
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // block_size, 0, slot % block_size] = key[token]
            expected[slot // block_size, 1, slot % block_size] = value[token]
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_store_matches_torch_store_for_strided_rows(dtype):
    """The CPU backend's native store writes exactly what the torch store writes, from K/V that
    are views of a fused QKV output (rows strided), skipping slot -1."""
    backend = _cpu_backend()
    generator = torch.Generator().manual_seed(3)
    num_blocks, block_size, num_kv_heads, head_dim, tokens = 6, 16, 3, 64, 40
    qkv = torch.randn(tokens, (9 + 2 * num_kv_heads) * head_dim, generator=generator).to(dtype)
    key = qkv[:, 9 * head_dim:(9 + num_kv_heads) * head_dim].view(tokens, num_kv_heads, head_dim)
    value = qkv[:, (9 + num_kv_heads) * head_dim:].view(tokens, num_kv_heads, head_dim)
    assert not key.is_contiguous()
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:tokens]
    slots[::7] = -1
    cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    expected = cache.clone()
    store_kv(key, value, expected, slots)
    backend.store_kv(key, value, cache, slots)
    assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="past the cache"):
        backend.store_kv(key[:1], value[:1], cache, torch.tensor([num_blocks * block_size]))


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="choose one of cpu, torch, triton"):
        get_attention_backend("flash")


def test_shape_mismatch_is_a_clear_error():
    batch = make_batch([2], [2])
    with pytest.raises(ValueError, match="num_heads .* multiple of num_kv_heads"):
        TorchAttentionBackend().forward(batch.query[:, :3], batch.key, batch.value, batch.kv_cache,
                                        batch.meta, SCALE)
    with pytest.raises(ValueError, match="slot_mapping has 1 entries for 2 tokens"):
        batch.meta.slot_mapping = batch.meta.slot_mapping[:1]
        TorchAttentionBackend().forward(batch.query, batch.key, batch.value, batch.kv_cache,
                                        batch.meta, SCALE)


def test_importing_the_engine_does_not_import_triton():
    code = ("import sys, engine.attention; "
            "from engine.attention import get_attention_backend; get_attention_backend('torch'); "
            "assert 'triton' not in sys.modules, 'triton imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True,
                   env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})


def test_metadata_without_host_copies_gives_the_same_result():
    batch = make_batch([1, 6, 1], [12, 30, 5], seed=9)
    expected, _ = run_backend(TorchAttentionBackend(), batch)
    batch.meta.query_lens_cpu = batch.meta.seq_lens_cpu = None
    out, _ = run_backend(TorchAttentionBackend(), batch)
    assert torch.equal(out, expected)


# ---- Triton kernels under the interpreter (or on the GPU when there is one), against torch ----

def triton_backend(**config):
    from engine.attention.triton_backend import TritonAttentionBackend, TritonAttentionConfig
    get_attention_backend("triton")  # turns the interpreter on where there is no CUDA
    small_tiles = dict(decode_tile_n=16, prefill_block_m=16, prefill_tile_n=16)
    return TritonAttentionBackend(TritonAttentionConfig(**{**small_tiles, **config}))


def on_device(batch: Batch) -> Batch:
    if not torch.cuda.is_available():
        return batch
    meta = batch.meta
    moved = AttentionMetadata(
        slot_mapping=meta.slot_mapping.cuda(), query_start_loc=meta.query_start_loc.cuda(),
        seq_lens=meta.seq_lens.cuda(), block_tables=meta.block_tables.cuda(),
        max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
        query_lens_cpu=meta.query_lens_cpu, seq_lens_cpu=meta.seq_lens_cpu)
    return Batch(batch.query.cuda(), batch.key.cuda(), batch.value.cuda(), batch.kv_cache.cuda(),
                 moved, batch.query_lens, batch.seq_lens, batch.block_tables)


def compare_triton_to_torch(batch: Batch, backend, atol: float) -> None:
    """Triton in the batch's dtype vs torch in fp32 on the same (upcast) inputs."""
    as_fp32 = Batch(batch.query.float(), batch.key.float(), batch.value.float(), batch.kv_cache.float(),
                    batch.meta, batch.query_lens, batch.seq_lens, batch.block_tables)
    expected, expected_cache = run_backend(TorchAttentionBackend(), as_fp32)
    device_batch = on_device(batch)
    out, cache = run_backend(backend, device_batch)
    assert out.dtype == batch.query.dtype
    torch.testing.assert_close(out.cpu().float(), expected, atol=atol, rtol=0)
    assert torch.equal(cache.cpu().float(), expected_cache)


TRITON_CASES = [
    # case, (heads, kv heads), block_size, dtype, forced decode splits
    ("decode_only", (4, 2), 16, torch.float32, None),
    ("decode_only", (9, 3), 32, torch.float16, 4),
    ("prefill_only", (4, 2), 32, torch.float32, None),
    ("prefill_with_prefix", (9, 3), 16, torch.float32, None),
    ("prefill_with_prefix", (4, 2), 32, torch.float16, None),
    ("mixed", (9, 3), 16, torch.float32, 2),
    ("mixed", (4, 2), 32, torch.float16, None),
    ("mixed", (2, 2), 16, torch.float32, 4),
]


@pytest.mark.parametrize("case,heads,block_size,dtype,splits", TRITON_CASES)
def test_triton_matches_torch(case, heads, block_size, dtype, splits):
    query_lens, seq_lens = CASES[case]
    batch = make_batch(query_lens, seq_lens, num_heads=heads[0], num_kv_heads=heads[1],
                       block_size=block_size, dtype=dtype, seed=block_size + heads[0])
    atol = 1e-5 if dtype == torch.float32 else 2e-3
    compare_triton_to_torch(batch, triton_backend(decode_num_splits=splits), atol)


def test_triton_head_dim_128_default_tiles_padding_and_strided_inputs():
    batch = make_batch([1, 13, 1], [70, 20, 5], num_heads=8, num_kv_heads=2, head_dim=128, seed=11)
    pad = 2
    batch.query = torch.cat([batch.query, torch.randn(pad, 8, 128)])
    batch.key = torch.cat([batch.key, torch.randn(pad, 2, 128)])
    batch.value = torch.cat([batch.value, torch.randn(pad, 2, 128)])
    batch.meta.slot_mapping = torch.cat([batch.meta.slot_mapping, torch.full((pad,), -1)])
    fused = torch.cat([batch.query.flatten(1), batch.key.flatten(1), batch.value.flatten(1)], dim=1)
    q_width, kv_width = 8 * 128, 2 * 128  # strided views, as after a fused qkv projection
    batch.query = fused[:, :q_width].view(-1, 8, 128)
    batch.key = fused[:, q_width:q_width + kv_width].view(-1, 2, 128)
    batch.value = fused[:, q_width + kv_width:].view(-1, 2, 128)
    assert not batch.query.is_contiguous() and not batch.key.is_contiguous()
    from engine.attention.triton_backend import TritonAttentionBackend
    get_attention_backend("triton")
    compare_triton_to_torch(batch, TritonAttentionBackend(), atol=1e-5)


def test_triton_store_kv_matches_torch_and_skips_negative_slots():
    get_attention_backend("triton")
    from engine.attention.triton_store import store_kv_triton
    generator = torch.Generator().manual_seed(2)
    cache = torch.randn(5, 2, 16, 3, 64, generator=generator).half()
    key = torch.randn(6, 3, 64, generator=generator).half()
    value = torch.randn(6, 3, 64, generator=generator).half()
    slots = torch.tensor([0, -1, 79, 17, -1, 40])
    expected = cache.clone()
    store_kv(key, value, expected, slots)
    device_cache = on_device_tensor(cache.clone())
    store_kv_triton(on_device_tensor(key), on_device_tensor(value), device_cache, on_device_tensor(slots))
    assert torch.equal(device_cache.cpu(), expected)
    assert not torch.equal(expected, cache)


def on_device_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.cuda() if torch.cuda.is_available() else t


def test_triton_config_is_validated():
    from engine.attention.triton_backend import TritonAttentionConfig
    with pytest.raises(ValueError, match="decode_tile_n must be a power of two >= 16"):
        TritonAttentionConfig(decode_tile_n=24)
    with pytest.raises(ValueError, match="decode_num_splits must be a power of two"):
        TritonAttentionConfig(decode_num_splits=3)


def test_triton_on_cpu_without_interpreter_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    code = (
        "import torch\n"
        "from engine.attention import get_attention_backend, AttentionMetadata\n"
        "backend = get_attention_backend('triton')\n"
        "meta = AttentionMetadata.build([1], [1], [[0]], 16, 'cpu')\n"
        "q, kv = torch.zeros(1, 2, 16), torch.zeros(1, 1, 16)\n"
        "try:\n"
        "    backend.forward(q, kv, kv, torch.zeros(1, 2, 16, 1, 16), meta, 1.0)\n"
        "except ValueError as error:\n"
        "    print(error)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "TRITON_INTERPRET": "0"})
    assert "set TRITON_INTERPRET=1" in result.stdout, result.stderr


def test_kernel_bench_runs_on_cpu(tmp_path):
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        import kernel_bench
    finally:
        sys.path.remove(str(REPO_ROOT / "benchmarks"))
    json_path = tmp_path / "bench.json"
    results = kernel_bench.main(["--device", "cpu", "--batch-sizes", "2", "--context-lens", "40",
                                 "--prefill-lens", "20", "--iters", "1", "--json", str(json_path)])
    assert json_path.exists()
    assert [(row["batch"], row["context"]) for row in results["decode"]] == [(2, 40)]
    assert results["decode"][0]["bytes"] == 2 * 40 * 3 * 64 * 2 * 4 + 2 * 2 * 9 * 64 * 4 + 2 * 2 * 3 * 64 * 4
    assert [(row["batch"], row["length"]) for row in results["prefill"]] == [(1, 20)]
    assert results["copy_gb_per_s"] > 0
