"""Attention variants (sliding window, logit soft-cap, sinks; engine/attention/variant.py) in the
cpu backend's native kernels and in the torch backend, against a plain-torch reference written
here the way transformers' eager attention computes it (in float64).

Batches use shuffled block tables, ragged lengths, GQA, decodes whose context is longer than the
window, prefill chunks whose cached prefix crosses the window (a prefix-cache hit is such a chunk),
in float32 and bfloat16, with each variant alone and all together. Blocks wholly outside every
query's window are filled with NaN, so a kernel that reads (not just masks) them fails.
"""
from __future__ import annotations

import importlib.util
import shutil
from dataclasses import dataclass

import pytest
import torch

from engine.attention import AttentionMetadata, TorchAttentionBackend, get_attention_backend
from engine.attention.variant import AttentionVariant
from engine.kv_quant import KVQuantFormat

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


def make_batch(query_lens, seq_lens, *, heads=8, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
               seed=0, poison_before=None) -> Batch:
    """A random batch over a random cache. `poison_before[s]`: sequence s's blocks wholly before
    that position are NaN (no query of it may read them)."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 2
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for count in needed:
        tables.append(free[:count])
        free = free[count:]
    cache = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, generator=g).to(dtype)
    for s, table in enumerate(tables):
        if poison_before is not None:
            for b in table[: poison_before[s] // block_size]:
                cache[b] = float("nan")
    tokens = sum(query_lens)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return Batch(rand(tokens, heads, head_dim), rand(tokens, kv_heads, head_dim), rand(tokens, kv_heads, head_dim),
                 cache, AttentionMetadata.build(query_lens, seq_lens, tables, block_size, "cpu"),
                 list(query_lens), list(seq_lens), tables)


def reference(batch: Batch, variant: AttentionVariant) -> torch.Tensor:
    """Eager attention in float64: the new K/V stored, then per sequence scores * scale ->
    soft-cap -> causal and sliding-window mask -> sinks in the denominator -> softmax -> P V."""
    cache = batch.kv_cache.double().clone()
    block_size = cache.shape[2]
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    token = 0
    for query_len, seq_len, table in zip(batch.query_lens, batch.seq_lens, batch.block_tables):
        context = seq_len - query_len
        positions = torch.arange(seq_len)
        blocks, offsets = torch.tensor(table)[positions // block_size], positions % block_size
        cache[blocks[context:], 0, offsets[context:]] = batch.key[token:token + query_len].double()
        cache[blocks[context:], 1, offsets[context:]] = batch.value[token:token + query_len].double()
        keys, values = cache[blocks, 0, offsets], cache[blocks, 1, offsets]  # [seq, kv_heads, dim]
        # poisoned (NaN) positions are never visible: as zeros they add exactly nothing here
        out[token:token + query_len] = eager(batch.query[token:token + query_len], keys.nan_to_num(0.0),
                                             values.nan_to_num(0.0), variant)
        token += query_len
    return out


def eager(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, variant: AttentionVariant) -> torch.Tensor:
    """The last len(query) positions of a sequence with K/V `keys`/`values` [seq, kv_heads, dim]
    attend to it, in float64 (GQA: query head h reads KV head h // group)."""
    query_len, seq_len, heads = query.shape[0], keys.shape[0], query.shape[1]
    keys = keys.double().repeat_interleave(heads // keys.shape[1], dim=1).transpose(0, 1)  # [heads, seq, dim]
    values = values.double().repeat_interleave(heads // values.shape[1], dim=1).transpose(0, 1)
    scores = query.double().transpose(0, 1) @ keys.transpose(1, 2) * SCALE  # [heads, queries, seq]
    if variant.softcap is not None:
        scores = variant.softcap * torch.tanh(scores / variant.softcap)
    qpos = torch.arange(seq_len - query_len, seq_len)[:, None]
    kpos = torch.arange(seq_len)[None, :]
    visible = kpos <= qpos
    if variant.sliding_window is not None:
        visible &= kpos > qpos - variant.sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    if variant.sinks is not None:
        sinks = variant.sinks.double()[:, None, None].expand(-1, query_len, 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return (probs @ values).transpose(0, 1)


def run(backend, batch: Batch, variant: AttentionVariant) -> torch.Tensor:
    return backend.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), batch.meta, SCALE,
                           variant)


def _cpu_backend(kv_format=None):
    backend = get_attention_backend("cpu", kv_format)
    if not backend.native:
        if shutil.which("c++") and importlib.util.find_spec("ninja"):
            pytest.fail("the native CPU kernels did not build although a compiler is present")
        pytest.skip("no C++ compiler/ninja: the cpu backend runs the torch path")
    return backend


def variants(num_heads: int, dtype: torch.dtype, window: int) -> dict[str, AttentionVariant]:
    sinks = (torch.linspace(-2.0, 3.0, num_heads)).to(dtype if dtype != torch.float16 else torch.float32)
    return {
        "window": AttentionVariant(sliding_window=window),
        "softcap": AttentionVariant(softcap=1.5),
        "sinks": AttentionVariant(sinks=sinks),
        "all": AttentionVariant(sliding_window=window, softcap=2.0, sinks=sinks),
    }


def poison(query_lens, seq_lens, window):
    """Per sequence, the position before which no query of it sees a key."""
    return [max(0, n - q - window + 1) for q, n in zip(query_lens, seq_lens)]


# (heads, kv_heads, head_dim, block_size, window, query_lens, seq_lens). Decodes with contexts
# shorter than, equal to, one past and far past the window; prefill chunks without a prefix
# (longer than the window), after a prefix crossing the window, and a prefix hit (a short chunk
# far past the window); next to each other in one batch. head_dim 64/128 take the SIMD decode
# path, 48 the portable loop (and torch for prefill).
CASES = {
    "decode": (8, 2, 64, 16, 20, [1] * 7, [1, 19, 20, 21, 37, 100, 64]),
    "decode_d128_gqa4": (8, 2, 128, 16, 33, [1] * 4, [5, 33, 34, 170]),
    "decode_window1": (4, 4, 64, 8, 1, [1] * 3, [1, 2, 30]),
    "decode_d48": (6, 2, 48, 8, 12, [1] * 4, [3, 12, 13, 50]),
    "prefill": (4, 2, 64, 16, 24, [70, 5], [70, 5]),
    "prefix_crosses_window": (8, 2, 64, 16, 24, [20, 33], [50, 100]),
    "prefix_hit": (4, 1, 128, 16, 40, [3, 1], [131, 77]),
    "mixed": (8, 4, 64, 32, 30, [1, 17, 1, 40, 1], [95, 17, 12, 130, 31]),
    "mixed_d48": (6, 3, 48, 16, 10, [1, 9, 20], [40, 30, 20]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["window", "softcap", "sinks", "all"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_backends_match_the_reference(case, kind, dtype):
    heads, kv_heads, head_dim, block_size, window, query_lens, seq_lens = CASES[case]
    variant = variants(heads, dtype, window)[kind]
    poisoned = poison(query_lens, seq_lens, window) if variant.sliding_window else None
    batch = make_batch(query_lens, seq_lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                       block_size=block_size, dtype=dtype, seed=len(case) + window, poison_before=poisoned)
    expected = reference(batch, variant)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    out = run(_cpu_backend(), batch, variant)
    assert out.dtype == dtype and out.shape == batch.query.shape
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    if poisoned is None:  # the torch backend gathers whole sequences: NaN blocks would reach it
        torch.testing.assert_close(run(TorchAttentionBackend(), batch, variant).double(), expected,
                                   atol=tol, rtol=tol)


@pytest.mark.parametrize("case", ["decode", "prefix_crosses_window", "mixed"])
def test_torch_backend_matches_the_reference_with_every_variant_at_once(case):
    heads, kv_heads, head_dim, block_size, window, query_lens, seq_lens = CASES[case]
    variant = variants(heads, torch.float32, window)["all"]
    batch = make_batch(query_lens, seq_lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                       block_size=block_size, seed=3)
    torch.testing.assert_close(run(TorchAttentionBackend(), batch, variant).double(), reference(batch, variant),
                               atol=2e-5, rtol=2e-5)


def test_plain_variant_and_a_window_wider_than_every_context_change_nothing():
    backend = _cpu_backend()
    batch = make_batch([1, 1, 12], [40, 7, 30], seed=9)
    plain = run(backend, batch, None)
    assert torch.equal(run(backend, batch, AttentionVariant()), plain)
    torch.testing.assert_close(run(backend, batch, AttentionVariant(sliding_window=40)), plain, atol=1e-6, rtol=1e-6)


def test_long_decode_reads_only_the_window():
    """8k context, window 512: every block before the window is NaN, so a kernel that touched one
    (for a masked-out score, say) would give NaN. Float32 and bf16, one and several sequences."""
    backend = _cpu_backend()
    window = 512
    for dtype, seq_lens in ((torch.float32, [8192]), (torch.bfloat16, [8192, 600, 513, 9])):
        variant = AttentionVariant(sliding_window=window, softcap=30.0)
        batch = make_batch([1] * len(seq_lens), seq_lens, heads=4, kv_heads=2, head_dim=64, block_size=16,
                           dtype=dtype, seed=1, poison_before=poison([1] * len(seq_lens), seq_lens, window))
        out = run(backend, batch, variant)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.double(), reference(batch, variant), atol=tol, rtol=tol)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("kind", ["window", "softcap", "sinks", "all"])
def test_8bit_cache_decode_and_prefill_match_the_torch_backend(name, kind):
    """The native 8-bit decode (in place) and the cpu backend's prefill over the dequantized
    blocks against the torch backend's dequantize-everything reference, on the same 8-bit cache."""
    backend = _cpu_backend(fmt := KVQuantFormat(name, block_size=16, num_kv_heads=2, head_dim=64))
    reference_backend = get_attention_backend("torch", fmt)
    query_lens, seq_lens = [1, 1, 20, 1, 3], [70, 18, 45, 5, 90]
    batch = make_batch(query_lens, seq_lens, heads=8, kv_heads=2, seed=21)
    variant = variants(8, torch.float32, 24)[kind]
    slots = torch.tensor([table[p // 16] * 16 + p % 16 for table, q, n in zip(batch.block_tables, query_lens, seq_lens)
                          for p in range(n - q)], dtype=torch.int64)
    cached = batch.kv_cache.transpose(1, 2).reshape(-1, 2, 2, 64).index_select(0, slots)
    expected_layer = torch.zeros(batch.kv_cache.shape[0], fmt.block_bytes, dtype=torch.uint8)
    reference_backend.store_kv(cached[:, 0], cached[:, 1], expected_layer, slots)
    layer = expected_layer.clone()
    expected = reference_backend.forward(batch.query, batch.key, batch.value, expected_layer, batch.meta, SCALE,
                                         variant)
    out = backend.forward(batch.query, batch.key, batch.value, layer, batch.meta, SCALE, variant)
    torch.testing.assert_close(out, expected, atol=5e-5, rtol=5e-5)
    assert torch.equal(layer, expected_layer)


def test_cpu_backend_without_its_kernels_runs_the_torch_reference(monkeypatch):
    from engine import cpu_kernels
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    backend = get_attention_backend("cpu")
    assert not backend.native
    heads, kv_heads, head_dim, block_size, window, query_lens, seq_lens = CASES["mixed"]
    batch = make_batch(query_lens, seq_lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                       block_size=block_size, seed=5)
    variant = variants(heads, torch.float32, window)["all"]
    assert torch.equal(run(backend, batch, variant), run(TorchAttentionBackend(), batch, variant))


def test_kernels_check_their_variant_arguments():
    kernels = _cpu_backend()._kernels
    batch = make_batch([1, 1], [5, 9], heads=4, kv_heads=2)
    args = (batch.query, batch.kv_cache, batch.meta.block_tables, batch.meta.seq_lens, SCALE)
    with pytest.raises(RuntimeError, match="sinks"):
        kernels.paged_decode_attention(*args, sinks=torch.zeros(3))
    with pytest.raises(RuntimeError, match="window"):
        kernels.paged_decode_attention(*args, window=-1)
    with pytest.raises(RuntimeError, match="softcap"):
        kernels.paged_decode_attention(*args, softcap=-1.0)
    # the defaults are plain attention; window 0 and softcap 0 mean "none"
    assert torch.equal(kernels.paged_decode_attention(*args),
                       kernels.paged_decode_attention(*args, window=0, softcap=0.0, sinks=None))


# (num_keys, num_queries, window, softcap, sinks): the bf16 flash prefill kernel called directly.
# Keys before the first query's window are skipped in whole 64-key tiles (300 keys, window 50:
# from key 192); window 1 and 3 put some of a 4-row register block's windows in a later key tile
# than its first row's; a large sink outweighs every key.
FLASH_CASES = [
    (300, 10, 50, None, None),
    (300, 10, 50, 3.0, (-1.0, 2.0)),
    (70, 70, 1, None, None),
    (131, 67, 3, None, (0.0, 1.0)),
    (200, 130, 64, 5.0, None),
    (90, 90, 200, None, (30.0, 40.0)),
]


@pytest.mark.parametrize("num_keys,num_queries,window,softcap,sinks", FLASH_CASES)
def test_bf16_flash_prefill_kernel(num_keys, num_queries, window, softcap, sinks):
    backend = _cpu_backend()
    if not backend._flash_prefill:
        pytest.skip("this CPU has no AVX512-BF16: bf16 prefill runs the torch reference")
    g = torch.Generator().manual_seed(num_keys + window)
    heads, kv_heads, dim = 4, 2, 64
    query = torch.randn(num_queries, heads, dim, generator=g).bfloat16()
    keys, values = (torch.randn(num_keys, kv_heads, dim, generator=g).bfloat16() for _ in range(2))
    sink_tensor = None if sinks is None else torch.linspace(*sinks, heads)
    variant = AttentionVariant(sliding_window=window, softcap=softcap, sinks=sink_tensor)
    out = backend._kernels.flash_prefill_attention(query, keys, values, SCALE, window, softcap or 0.0, sink_tensor)
    torch.testing.assert_close(out.double(), eager(query, keys, values, variant), atol=2e-2, rtol=2e-2)
