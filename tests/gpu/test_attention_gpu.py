"""Triton attention kernels on a real GPU at real sizes, against the torch backend in fp32.

Skipped without CUDA. Batches of 64+ sequences, contexts up to 8k, head_dim 64 and 128,
bf16 and fp16, block sizes 16 and 32, random non-contiguous block tables.
"""
from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionMetadata, TorchAttentionBackend, get_attention_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ATOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3}


def make_case(query_lens, seq_lens, *, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 8
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, used = [], 0
    for count in blocks:
        tables.append(order[used:used + count])
        used += count
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, "cuda")
    num_tokens = sum(query_lens)
    cuda = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=cuda, device="cuda", dtype=torch.float32).to(dtype)

    query = rand(num_tokens, num_heads, head_dim)
    key = rand(num_tokens, num_kv_heads, head_dim)
    value = rand(num_tokens, num_kv_heads, head_dim)
    kv_cache = rand(num_blocks, 2, block_size, num_kv_heads, head_dim)
    return query, key, value, kv_cache, meta


def check_against_torch(case, backend, dtype):
    query, key, value, kv_cache, meta = case
    scale = query.shape[-1] ** -0.5
    reference_cache = kv_cache.float()
    expected = TorchAttentionBackend().forward(query.float(), key.float(), value.float(), reference_cache,
                                               meta, scale)
    out = backend.forward(query, key, value, kv_cache, meta, scale)
    torch.cuda.synchronize()
    assert out.dtype == dtype and out.shape == query.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=0)
    assert torch.equal(kv_cache.float(), reference_cache)


def random_lengths(count, low, high, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (count,), generator=generator).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,head_dim,block_size", [((32, 8), 128, 16), ((9, 3), 64, 32), ((16, 16), 64, 16)])
def test_decode_batch(dtype, heads, head_dim, block_size):
    seq_lens = random_lengths(64, 1, 4096, seed=head_dim + block_size)
    seq_lens[0] = 8192
    case = make_case([1] * len(seq_lens), seq_lens, num_heads=heads[0], num_kv_heads=heads[1],
                     head_dim=head_dim, block_size=block_size, dtype=dtype, seed=1)
    check_against_torch(case, get_attention_backend("triton"), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_few_long_sequences_use_split_kv(dtype):
    from engine.attention.triton_backend import TritonAttentionBackend
    backend = TritonAttentionBackend()
    seq_lens = [8192, 7000, 3001, 17]
    case = make_case([1] * 4, seq_lens, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                     dtype=dtype, seed=2)
    assert backend._decode_splits(case[0], 4, 8, max(seq_lens)) > 1
    check_against_torch(case, backend, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,block_size", [(128, 16), (64, 32)])
def test_prefill_with_cached_prefix(dtype, head_dim, block_size):
    query_lens = [1024, 700, 513, 64]
    prefixes = [0, 3000, 1500, 7000]
    seq_lens = [q + p for q, p in zip(query_lens, prefixes)]
    case = make_case(query_lens, seq_lens, num_heads=32, num_kv_heads=8, head_dim=head_dim,
                     block_size=block_size, dtype=dtype, seed=3)
    check_against_torch(case, get_attention_backend("triton"), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_batch_of_decodes_and_prefill_chunks(dtype):
    decode_lens = random_lengths(96, 1, 6000, seed=4)
    query_lens = [1] * 96 + [512, 300, 1]
    seq_lens = decode_lens + [512, 2300, 1]
    case = make_case(query_lens, seq_lens, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                     dtype=dtype, seed=5)
    check_against_torch(case, get_attention_backend("triton"), dtype)


def test_store_kv_matches_torch_at_size():
    from engine.attention import store_kv
    from engine.attention.triton_store import store_kv_triton
    generator = torch.Generator(device="cuda").manual_seed(6)
    cache = torch.randn(4096, 2, 16, 8, 128, generator=generator, device="cuda").to(torch.bfloat16)
    key = torch.randn(2048, 8, 128, generator=generator, device="cuda").to(torch.bfloat16)
    value = torch.randn_like(key)
    slots = torch.randperm(4096 * 16, device="cuda")[:2048]
    slots[::7] = -1
    expected = cache.clone()
    store_kv(key, value, expected, slots)
    store_kv_triton(key, value, cache, slots)
    assert torch.equal(cache, expected)
