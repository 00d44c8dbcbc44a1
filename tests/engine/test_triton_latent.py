"""The Triton backend's latent attention (DeepSeek's MLA; engine/attention/triton_latent.py for its
decodes) against latent.py's torch reference.

Batches: random block tables over a cache pre-filled with random latents, ragged contexts (one
token, part of a block, several blocks, long enough to split), decodes alone and mixed with
multi-token chunks (interleaved, or after the decodes as the scheduler places them), head counts
that are not a multiple of the kernel's 16-head blocks, rows past the batch (zeros), the tiny
models' latent (40 = 32 values + 8 rotated) and DeepSeek-V3's (576 = 512 + 64) with few tokens,
a value wider or narrower than the cache's half (the latent's two tiles cut across its K and V
halves either way), fp16, the 8-bit caches; that decodes run in the kernel and only the chunks
in torch; and a tiny DeepSeek model's greedy tokens through the engine, the Triton backend
against the torch one. Without CUDA the kernel runs under `TRITON_INTERPRET=1`, in float32
(the interpreter's bf16 dot is broken) and fp16.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported, or its kernels' helpers are not interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine.attention import AttentionMetadata, get_attention_backend  # noqa: E402
from tests.engine.latent_batches import PADDING, TINY, make_8bit_batch  # noqa: E402
from tests.engine.latent_batches import make_batch as latent_batch  # noqa: E402
from engine.attention import triton_backend, triton_latent  # noqa: E402
from engine.attention.latent import latent_attention  # noqa: E402
from engine.attention.triton_backend import TritonAttentionBackend, TritonAttentionConfig  # noqa: E402
from engine.kv_quant import KVQuantFormat  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def backend(splits: int | None = None, kv_format: KVQuantFormat | None = None) -> TritonAttentionBackend:
    get_attention_backend("triton")  # turns the interpreter on where there is no CUDA
    return TritonAttentionBackend(TritonAttentionConfig(decode_num_splits=splits), kv_format=kv_format)


def make_batch(*args, block_size: int = 8, **kwargs):
    return latent_batch(*args, block_size=block_size, **kwargs)


def on_device(meta: AttentionMetadata) -> AttentionMetadata:
    return meta.to(DEVICE)


def compare(batch, splits: int | None = None, atol: float = 1e-5, kv_format: KVQuantFormat | None = None,
            reference_cache: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton backend (on the device) against the reference in float32 on CPU; rows past the
    batch must be zeros. Returns the backend's output."""
    query, cache, meta, value_dim = batch
    scale = query.shape[-1] ** -0.5
    reference = reference_cache if reference_cache is not None else cache.float()
    expected = latent_attention(query.float(), reference, meta, scale, value_dim)
    out = backend(splits, kv_format).latent_attention(query.to(DEVICE), cache.to(DEVICE), on_device(meta), scale,
                                                      value_dim)
    assert out.dtype == query.dtype and out.shape == (query.shape[0], query.shape[1], value_dim)
    torch.testing.assert_close(out.cpu().float(), expected, atol=atol, rtol=0)
    assert not out[-PADDING:].any()
    return out


# contexts: a first token, part of a block, several blocks, 100 tokens (4 splits of 32 at most)
DECODE_LENS = [1, 5, 24, 100]


@pytest.mark.parametrize("splits", [None, 4])
@pytest.mark.parametrize("heads", [4, 20])
def test_decodes_match_the_reference(heads, splits):
    """Decodes alone, one split and four (merged by the combine kernel); 4 heads (one partial
    head block) and 20 (a full one and a partial one)."""
    compare(make_batch([1] * 4, DECODE_LENS, heads, seed=heads), splits)


@pytest.mark.parametrize("splits", [None, 2])
def test_a_mixed_batch_matches_the_reference(splits):
    """Decodes and multi-token chunks interleaved (chunks after a cached prefix and a first chunk),
    and chunks after the decodes as the scheduler places them."""
    compare(make_batch([1, 7, 1, 12, 1], [40, 20, 1, 12, 70], 20, seed=1), splits)
    compare(make_batch([1, 1, 9, 5], [33, 8, 30, 5], 4, seed=2), splits)


@pytest.mark.parametrize("dims,heads,lens", [
    ((512, 64), 16, [3, 40]),  # DeepSeek-V3's latent on one GPU of TP 8, few tokens
    ((64, 32), 5, [17, 50]),  # latent 96: the value crosses into the V half
    ((16, 32), 18, [9, 33]),  # a value narrower than the half: the rotated dims cross instead
])
def test_other_latent_shapes(dims, heads, lens):
    compare(make_batch([1, 1], lens, heads, dims, block_size=16, seed=3), splits=2)


def test_fp16():
    """fp16 query and cache: against the reference in float32 over the same fp16 values (p is
    rounded to fp16 for its dot with the values, as in the paged decode kernel)."""
    batch = make_batch([1, 1, 1, 6], [1, 37, 90, 20], 4, seed=4, dtype=torch.float16)
    for splits in (None, 4):
        compare(batch, splits, atol=2e-3)


@pytest.mark.skipif(DEVICE == "cpu", reason="the interpreter's bf16 dot is broken")
def test_bf16_at_deepseek_sizes():
    batch = make_batch([1, 1, 1, 5], [1, 70, 300, 40], 16, (512, 64), block_size=16, seed=9, dtype=torch.bfloat16)
    for splits in (None, 4):
        compare(batch, splits, atol=2e-2)


@pytest.mark.parametrize("fmt_name,splits", [("int8", None), ("fp8_e4m3", 2)])
def test_8bit_caches(fmt_name, splits):
    """An 8-bit cache (engine/kv_quant.py, one KV head of half the latent), read in place by the
    kernel and dequantized for the chunks: against the reference over the dequantized layer."""
    query_lens, seq_lens, block_size, half = [1, 6, 1, 1], [30, 20, 1, 45], 8, 20
    query, layer, meta, fmt = make_8bit_batch(fmt_name, query_lens, seq_lens, half, block_size=block_size)
    dense = fmt.dequantize(layer, torch.arange(layer.shape[0]), torch.float32)
    compare((query, layer, meta, 32), splits, atol=2e-5, kv_format=fmt, reference_cache=dense)


def test_decodes_run_in_the_kernel_and_chunks_in_torch(monkeypatch):
    """The backend's one launch covers every decode row (the reference is only ever handed
    multi-token chunks); chunks placed after the decodes reach it as views of the batch."""
    launches, handed = [], []
    kernel, reference = triton_latent.latent_decode_attention, triton_backend.latent_attention

    def launch(out, *args, **kwargs):
        launches.append(kwargs["num_splits"])
        return kernel(out, *args, **kwargs)

    def attend(query, cache, meta, scale, value_dim):
        handed.append((query, meta))
        return reference(query, cache, meta, scale, value_dim)

    monkeypatch.setattr(triton_latent, "latent_decode_attention", launch)
    monkeypatch.setattr(triton_backend, "latent_attention", attend)
    interleaved = make_batch([1, 7, 1, 12, 1], [40, 20, 1, 12, 70], 4, seed=6)
    compare(interleaved, splits=2)
    assert launches == [2] and len(handed) == 1
    assert handed[0][1].query_lens_cpu == [7, 12] and handed[0][1].seq_lens_cpu == [20, 12]
    ordered = make_batch([1, 1, 9, 5], [33, 8, 30, 5], 4, seed=7)
    compare(ordered)
    query, meta = handed[1]
    assert launches == [2, 1] and meta.query_lens_cpu == [9, 5]
    assert query._is_view() and meta.block_tables._is_view()  # slices of the batch, not copies
    decodes_only = make_batch([1, 1], [3, 9], 4, seed=8)
    compare(decodes_only)
    assert len(launches) == 3 and len(handed) == 2
    # with the kernel's launch dropped, the decode rows are left as allocated: the kernel wrote them
    monkeypatch.setattr(triton_latent, "latent_decode_attention", lambda *args, **kwargs: None)
    with pytest.raises(AssertionError):
        compare(make_batch([1, 1], [3, 9], 4, seed=8))


def test_inputs_the_contract_does_not_allow_are_refused():
    query, cache, meta, value_dim = make_batch([1], [5], 4)
    with pytest.raises(ValueError, match="dtype"):
        backend().latent_attention(query, cache.half(), meta, 0.1, value_dim)
    with pytest.raises(ValueError, match="twice the cache's half"):
        backend().latent_attention(query[..., :-2], cache, meta, 0.1, value_dim)
    with pytest.raises(ValueError, match="one KV head|num_blocks, 2, block_size, 1, half"):
        backend().latent_attention(query, cache.expand(-1, -1, -1, 2, -1), meta, 0.1, value_dim)


@pytest.mark.skipif(DEVICE != "cpu", reason="the engine runs on CPU here (tests/gpu runs it on CUDA)")
def test_a_tiny_deepseek_model_gives_the_torch_backends_tokens(tmp_path, monkeypatch):
    """A tiny DeepSeek-V2-Lite-shaped model, greedy, through the engine: chunked prefill (chunks in
    torch, each chunk's last token and every decode through the kernel) on the Triton backend gives
    the torch backend's tokens."""
    from engine import LLM, SamplingParams
    from tests.engine.tiny_models import save_family_model

    folder = save_family_model(tmp_path, "deepseek-v2-lite")
    prompts = [[5, 17, 99, 3, 64, 22, 9, 31, 40, 2, 77, 13, 6], [42, 7] * 4, [100, 3]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    launches = []
    kernel = triton_latent.latent_decode_attention
    monkeypatch.setattr(triton_latent, "latent_decode_attention",
                        lambda *args, **kwargs: launches.append(args[1].shape[0]) or kernel(*args, **kwargs))
    tokens = {}
    for name in ("torch", "triton"):
        with LLM(folder, attention_backend=name, block_size=4, num_blocks=64, max_num_batched_tokens=12) as llm:
            tokens[name] = [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["triton"] == tokens["torch"]
    assert len(launches) >= 5 * 4  # the decode steps' layers (4) at least
    assert len({tuple(t) for t in tokens["torch"]}) == len(prompts)
