"""The cpu backend's latent attention (DeepSeek's MLA): decodes in the native kernel
(engine/csrc/latent_decode_cpu.cpp), read in place from the paged latent cache, against latent.py's
torch reference.

Batches: random block tables over a cache pre-filled with random latents (so a read of the wrong
block or past a sequence's end shows), ragged contexts (one token, part of a block, several
blocks, long enough to be split across threads), batch 1 and 8, 16 and 3 heads (a partial
register block of heads), 40 (two head groups), the tiny models' latent (40 = 32 values + 8
rotated: half 20, not a whole register) and DeepSeek-V3's (576 = 512 + 64) with few tokens, fp32
(tight), bf16 and fp16 (loose), forced context splits and head groups (the merge), an empty
context, a mixed batch (decodes and chunks), rows past the batch (zeros), the 8-bit caches
(against the torch backend: dequantize, then the reference); that decode rows go through the
kernel (the backend's kernels module is its one seam: a recording wrapper stands in for it) and
only the chunks through the reference; the fallbacks (no kernels, a cache the kernel does not
take); what the kernel refuses; and a tiny DeepSeek model's greedy tokens through the engine, the
cpu backend against the torch one.
"""
from __future__ import annotations

import importlib.util
import shutil

import pytest
import torch

from engine import cpu_kernels
from engine.attention import AttentionMetadata, TorchAttentionBackend
from tests.engine.latent_batches import TINY, make_8bit_batch, make_batch
from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.latent import latent_attention
from engine.kv_quant import KVQuantFormat

DEEPSEEK = (512, 64)  # DeepSeek-V3's latent of 576


@pytest.fixture(scope="module")
def kernels():
    """The kernels module with `latent_decode_attention`; it must have built wherever a C++
    compiler and AVX2 + FMA exist (AVX-512 builds report it absent until their 16-lane path has
    run on an AVX-512 machine: there `make test`'s second run, PDSERVE_CPU_ISA=avx2, tests the
    8-lane path)."""
    module = cpu_kernels.load()
    if module is None or not module.has_latent_decode():
        features = set(cpu_kernels.cpu_features())
        if module is not None and cpu_kernels.isa() == "native" and "avx512f" in features:
            pytest.skip("AVX-512 build: latent_decode_attention reports itself absent (PDSERVE_CPU_ISA=avx2 tests it)")
        simd = "avx512f" in features or {"avx2", "fma", "f16c"} <= features
        if shutil.which("c++") and importlib.util.find_spec("ninja") and simd:
            pytest.fail("the native latent decode kernel did not build although a compiler and AVX2 + FMA are present")
        pytest.skip("no compiler or no AVX2 + FMA: latent attention keeps the torch reference")
    return module


class Recording:
    """The kernels module, recording how many query rows each latent decode call was given."""

    def __init__(self, module) -> None:
        self._module = module
        self.rows: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self._module, name)

    def latent_decode_attention(self, query, *args, **kwargs):
        self.rows.append(query.shape[0])
        return self._module.latent_decode_attention(query, *args, **kwargs)

    def latent_decode_attention_8bit(self, query, *args, **kwargs):
        self.rows.append(query.shape[0])
        return self._module.latent_decode_attention_8bit(query, *args, **kwargs)


def cpu_backend(kernels, kv_format: KVQuantFormat | None = None) -> CpuAttentionBackend:
    backend = CpuAttentionBackend(kv_format)
    backend._kernels = Recording(kernels)
    return backend


def compare(kernels, batch, atol: float = 1e-5, rtol: float = 1e-5, kv_format: KVQuantFormat | None = None,
            reference: torch.Tensor | None = None) -> CpuAttentionBackend:
    """The cpu backend against the reference in float32 (over the same values; `reference`: the
    expected result instead); rows past the batch must be zeros, and every decode row must have
    gone through the kernel in one call. Returns the backend."""
    query, cache, meta, value_dim = batch
    scale = query.shape[-1] ** -0.5
    if reference is None:
        reference = latent_attention(query.float(), cache.float(), meta, scale, value_dim)
    backend = cpu_backend(kernels, kv_format)
    out = backend.latent_attention(query, cache, meta, scale, value_dim)
    assert out.dtype == query.dtype and out.shape == (query.shape[0], query.shape[1], value_dim)
    torch.testing.assert_close(out.float(), reference.float(), atol=atol, rtol=rtol)
    num_tokens = sum(meta.query_lens_cpu)
    assert not out[num_tokens:].any()
    decodes = meta.query_lens_cpu.count(1)
    assert backend._kernels.rows == ([decodes] if decodes else [])
    return backend


# contexts: a first token, part of a block, a whole block, several blocks, long (split across threads)
DECODE_LENS = {1: [700], 8: [1, 5, 16, 24, 100, 300, 3, 47]}


@pytest.mark.parametrize("batch_size", [1, 8])
@pytest.mark.parametrize("heads", [16, 3])
def test_decodes_match_the_reference(kernels, heads, batch_size):
    seq_lens = DECODE_LENS[batch_size]
    compare(kernels, make_batch([1] * len(seq_lens), seq_lens, heads, seed=heads + batch_size))


@pytest.mark.parametrize("heads", [16, 3])
def test_decodes_without_padding_rows(kernels, heads):
    """The whole query is the batch's decodes: the kernel's result is the backend's."""
    compare(kernels, make_batch([1] * 3, [33, 1, 17], heads, seed=heads, padding=0))


@pytest.mark.parametrize("heads,lens", [(16, [3, 40]), (16, [90]), (40, [5, 33])])
def test_deepseek_sizes(kernels, heads, lens):
    """DeepSeek-V3's latent (576 = 512 + 64: the value spans the K half and most of the V half),
    16 heads (one GPU's share at TP 8) and 40 (more than a work item takes: two groups), few tokens."""
    compare(kernels, make_batch([1] * len(lens), lens, heads, DEEPSEEK, seed=len(lens)), atol=2e-5)


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_16_bit_dtypes(kernels, dtype, atol):
    """bf16 / fp16 query and cache: against the reference in float32 over the same values (the
    kernel computes in fp32 and rounds the result once)."""
    compare(kernels, make_batch([1] * 4, [1, 37, 90, 300], 16, seed=4, dtype=dtype), atol=atol, rtol=atol)
    compare(kernels, make_batch([1, 1], [3, 40], 16, DEEPSEEK, seed=5, dtype=dtype), atol=atol, rtol=atol)


@pytest.mark.parametrize("num_splits,heads_per_item", [(1, 0), (3, 0), (7, 0), (0, 4), (2, 8), (5, 1), (64, 16)])
def test_forced_splits_and_head_groups(kernels, num_splits, heads_per_item):
    """The kernel's work items forced (whatever the thread count): contexts in `num_splits` ranges
    (merged afterwards; more than a context has tiles means one a tile), heads in groups."""
    query, cache, meta, value_dim = make_batch([1] * 5, [1, 20, 64, 150, 333], 13, seed=num_splits, padding=0)
    scale = 0.1
    expected = latent_attention(query, cache, meta, scale, value_dim)
    out = kernels.latent_decode_attention(query, cache, meta.block_tables, meta.seq_lens, scale, value_dim,
                                          num_splits=num_splits, heads_per_item=heads_per_item)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_a_mixed_batch(kernels, monkeypatch):
    """Decodes and multi-token chunks, interleaved and after the decodes (as the scheduler places
    them), with padding rows: the decodes in one kernel call, the chunks (only they) in the
    reference as one sub-batch."""
    handed = []
    reference = TorchAttentionBackend.latent_attention

    def attend(self, query, cache, meta, scale, value_dim):
        handed.append((meta.query_lens_cpu, meta.seq_lens_cpu))
        return reference(self, query, cache, meta, scale, value_dim)

    monkeypatch.setattr(TorchAttentionBackend, "latent_attention", attend)
    compare(kernels, make_batch([1, 7, 1, 12, 1], [40, 20, 1, 12, 70], 16, seed=1))
    assert handed == [([7, 12], [20, 12])]
    compare(kernels, make_batch([1, 1, 1, 9], [33, 8, 300, 30], 3, seed=2))
    assert handed[1:] == [([9], [30])]
    compare(kernels, make_batch([1, 1, 5], [3, 40, 25], 16, DEEPSEEK, seed=3), atol=2e-5)
    assert handed[2:] == [([5], [25])]
    compare(kernels, make_batch([6, 4], [6, 10], 3, seed=4))  # no decodes: all of it in the reference
    assert handed[3:] == [([6, 4], [6, 10])]


def test_the_plan_is_kept_per_metadata(kernels):
    """Every layer of a forward pass shares one metadata: the second layer's call reuses the plan,
    and a new metadata (the next step) gets its own."""
    query, cache, meta, value_dim = make_batch([1, 4, 1], [9, 30, 50], 3, seed=6)
    backend = cpu_backend(kernels)
    first = backend.latent_attention(query, cache, meta, 0.2, value_dim)
    plan = backend._latent_plan
    second = backend.latent_attention(query, cache * 2, meta, 0.2, value_dim)
    assert backend._latent_plan is plan and not torch.equal(first, second)
    torch.testing.assert_close(second, latent_attention(query, cache * 2, meta, 0.2, value_dim), atol=1e-5, rtol=1e-5)
    other = make_batch([1, 1], [5, 7], 3, seed=7)
    backend.latent_attention(other[0], other[1], other[2], 0.2, value_dim)
    assert backend._latent_plan is not plan and backend._kernels.rows == [2, 2, 2]


@pytest.mark.parametrize("fmt_name", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dims", [TINY, DEEPSEEK])
def test_8bit_caches(kernels, fmt_name, dims):
    """An 8-bit cache (engine/kv_quant.py, one KV head of half the latent), read in place by the
    kernel (the chunk: dequantized): against the torch backend, which dequantizes the blocks and
    runs the reference."""
    value_dim, rope = dims
    half, block_size = (value_dim + rope) // 2, 8
    query_lens, seq_lens = [1, 6, 1, 1], [30, 20, 1, 45] if dims == TINY else [9, 6, 1, 20]
    query, layer, meta, fmt = make_8bit_batch(fmt_name, query_lens, seq_lens, half, block_size=block_size)
    scale = query.shape[-1] ** -0.5
    expected = TorchAttentionBackend(fmt).latent_attention(query, layer, meta, scale, value_dim)
    compare(kernels, (query, layer, meta, value_dim), atol=2e-5, kv_format=fmt, reference=expected)


def test_falls_back_where_the_kernel_does_not_apply(kernels, monkeypatch):
    """A dtype the kernel does not take (float64), a non-contiguous cache: the reference, no
    kernel call. Without the kernels at all (`cpu_kernels.load()` None): the reference too."""
    query, cache, meta, value_dim = make_batch([1, 1, 3], [4, 30, 9], 3, seed=8)
    expected = latent_attention(query, cache, meta, 0.3, value_dim)
    backend = cpu_backend(kernels)
    torch.testing.assert_close(backend.latent_attention(query.double(), cache.double(), meta, 0.3, value_dim),
                               latent_attention(query.double(), cache.double(), meta, 0.3, value_dim))
    wide = torch.cat([cache, cache], dim=-1)[..., :cache.shape[-1]]
    assert not wide.is_contiguous()
    torch.testing.assert_close(backend.latent_attention(query, wide, meta, 0.3, value_dim), expected)
    assert backend._kernels.rows == []
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    plain = CpuAttentionBackend()
    assert not plain.native
    torch.testing.assert_close(plain.latent_attention(query, cache, meta, 0.3, value_dim), expected)


def test_the_kernel_refuses_what_it_cannot_read(kernels):
    query, cache, meta, value_dim = make_batch([1, 1], [5, 20], 3, seed=9, padding=0)
    tables = meta.block_tables.clone()
    tables[1, 1] = cache.shape[0]  # a block id past the cache
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.latent_decode_attention(query, cache, tables, meta.seq_lens, 0.1, value_dim)
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        kernels.latent_decode_attention(query, cache, meta.block_tables, meta.seq_lens + 16, 0.1, value_dim)
    with pytest.raises(RuntimeError, match="value_dim"):
        kernels.latent_decode_attention(query, cache, meta.block_tables, meta.seq_lens, 0.1, 41)
    with pytest.raises(RuntimeError, match="2 \\* half"):
        kernels.latent_decode_attention(query[..., :-2], cache, meta.block_tables, meta.seq_lens, 0.1, value_dim)


def test_an_empty_context_gives_zeros(kernels):
    """A sequence of length 0 (never a decode; the kernel still defines it): zeros, its neighbours
    unchanged."""
    query, cache, meta, value_dim = make_batch([1, 1, 1], [5, 1, 20], 3, seed=10, padding=0)
    expected = latent_attention(query, cache, meta, 0.1, value_dim)
    lens = meta.seq_lens.clone()
    lens[1] = 0
    for splits in (0, 2):
        out = kernels.latent_decode_attention(query, cache, meta.block_tables, lens, 0.1, value_dim, num_splits=splits)
        assert not out[1].any()
        torch.testing.assert_close(out[[0, 2]], expected[[0, 2]], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_tiny_deepseek_model_gives_the_torch_backends_tokens(kernels, tmp_path, monkeypatch, kv_cache_dtype):
    """A tiny DeepSeek-V2-Lite-shaped model, greedy, through the engine: chunked prefill (chunks in
    the reference, each chunk's last token and every decode through the kernel) on the cpu
    backend gives the torch backend's tokens, over a float cache and an 8-bit one."""
    from engine import LLM, SamplingParams
    from tests.engine.tiny_models import save_family_model

    folder = save_family_model(tmp_path, "deepseek-v2-lite")
    prompts = [[5, 17, 99, 3, 64, 22, 9, 31, 40, 2, 77, 13, 6], [42, 7] * 4, [100, 3]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    recording = Recording(kernels)
    monkeypatch.setattr(cpu_kernels, "load", lambda: recording)
    tokens = {}
    for name in ("torch", "cpu"):
        with LLM(folder, attention_backend=name, kv_cache_dtype=kv_cache_dtype, block_size=4, num_blocks=64,
                 max_num_batched_tokens=12) as llm:
            tokens[name] = [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["cpu"] == tokens["torch"]
    assert len(recording.rows) >= 5 * 4  # the decode steps' layers (4) at least
    assert len({tuple(t) for t in tokens["torch"]}) == len(prompts)
