"""What an 8-bit KV cache does to the default model (SmolLM2-135M-Instruct, fp32 weights):
next-token logits over a fixed text, the perplexity of that text, and greedy agreement over the
prompts of test_default_model.py, each against the same model with a full-precision cache.

The fixed text is fed in 16-token chunks, so every chunk attends to earlier blocks read back from
the 8-bit cache, as decodes and later prefill chunks do, and one token at a time, as decodes
write it.
"""
import random

import pytest
import torch

from engine.attention.backend import get_attention_backend
from engine.attention.metadata import AttentionMetadata
from engine.kv_cache import allocate_kv_cache
from engine.kv_quant import kv_quant_format
from tests.engine.paged_harness import greedy_generate_paged
from tests.engine.test_default_model import CHATS, NEW_TOKENS, PLAIN, load_default_model

pytestmark = pytest.mark.slow

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a "
    "goldsmith from Mainz, combined several existing technologies into a single system for producing "
    "books. Movable type had been used in East Asia for centuries, but Gutenberg's innovation was a "
    "hand mould that allowed metal letters to be cast quickly and in large numbers, together with an "
    "oil-based ink that adhered to metal and a press adapted from those used to make wine. Within a "
    "few decades, printing shops had spread to more than two hundred cities across Europe. The price "
    "of books fell sharply, literacy rose, and ideas began to travel faster than ever before. Scholars "
    "could now compare identical copies of a text, which encouraged the careful correction of errors "
    "and the growth of shared standards in spelling and grammar. Many historians argue that the "
    "Reformation, the Scientific Revolution and the rise of newspapers would have been impossible "
    "without the steady supply of cheap printed material that the new presses made available."
)
# Stated tolerances, measured on this model and text (2026-12-03, with K smoothing: each block's
# first K row is its reference, engine/kv_quant.py): next-token distributions' KL divergence from
# the full-precision cache's (int8: mean 0.0008, max 0.0041; fp8: mean 0.0023, max 0.041), top-1
# agreement (int8 99.5%, fp8 96.8%), perplexity (19.851 -> int8 19.843, fp8 19.806). Without the
# reference fp8 rose 1.16%; the bar is 1% for both.
TOLERANCE = {"int8": {"mean_kl": 0.003, "max_kl": 0.02, "top1": 0.98, "perplexity": 1.01},
             "fp8_e4m3": {"mean_kl": 0.008, "max_kl": 0.15, "top1": 0.95, "perplexity": 1.01}}


@pytest.fixture(scope="module")
def default_model():
    model, tokenizer, _ = load_default_model()
    return model, tokenizer


def teacher_forced_logits(model, kv_cache_dtype: str, tokens: list[int], chunk: int = 16, block_size: int = 16):
    arch = model.arch
    fmt = kv_quant_format(kv_cache_dtype, block_size, arch.num_key_value_heads, arch.head_dim)
    num_blocks = -(-len(tokens) // block_size) + 2
    table = list(range(num_blocks))
    random.Random(0).shuffle(table)
    cache = allocate_kv_cache(arch, num_blocks, block_size, torch.float32, "cpu", kv_format=fmt)
    backend = get_attention_backend("cpu", fmt)
    logits = []
    with torch.inference_mode():
        for start in range(0, len(tokens), chunk):
            ids = tokens[start:start + chunk]
            meta = AttentionMetadata.build([len(ids)], [start + len(ids)], [table], block_size, "cpu")
            logits.append(model(torch.tensor(ids), torch.arange(start, start + len(ids)), cache.layers, meta,
                                backend, torch.arange(len(ids))))
    return torch.cat(logits)


def perplexity(logits: torch.Tensor, tokens: list[int]) -> float:
    return torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(tokens[1:])).exp().item()


@pytest.mark.parametrize("chunk", [16, 1])
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_8bit_kv_keeps_logits_and_perplexity_close(default_model, kv_cache_dtype, chunk):
    """chunk 16: each chunk fills a block at once; chunk 1: every write is a decode's, so block
    scales grow and re-quantize as in serving (measured: int8 KL 0.0015, perplexity +0.03%; fp8
    KL 0.0035, -0.53%)."""
    model, tokenizer = default_model
    tokens = tokenizer.encode(TEXT)
    assert len(tokens) > 180
    full = teacher_forced_logits(model, "auto", tokens, chunk)
    quantized = teacher_forced_logits(model, kv_cache_dtype, tokens, chunk)
    kl = (full.softmax(-1) * (full.log_softmax(-1) - quantized.log_softmax(-1))).sum(-1)
    top1 = (quantized.argmax(-1) == full.argmax(-1)).float().mean().item()
    ratio = perplexity(quantized, tokens) / perplexity(full, tokens)
    print(f"{kv_cache_dtype}, chunks of {chunk}: KL mean {kl.mean():.4f} max {kl.max():.4f}, top-1 agreement {top1:.3f}, "
          f"perplexity {perplexity(full, tokens):.3f} -> {perplexity(quantized, tokens):.3f}")
    bound = TOLERANCE[kv_cache_dtype]
    assert kl.mean().item() <= bound["mean_kl"] and kl.max().item() <= bound["max_kl"]
    assert top1 >= bound["top1"]
    assert ratio < bound["perplexity"]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_8bit_kv_greedy_agreement_over_the_test_prompts(default_model, kv_cache_dtype):
    """Agreement: the share of generated tokens inside each prompt's longest common prefix with
    the full-precision run (a token after the first divergence counts as disagreeing)."""
    model, tokenizer = default_model
    prompts = [tokenizer.apply_chat_template(c) for c in CHATS] + [tokenizer.encode(p) for p in PLAIN]
    arch = model.arch
    fmt = kv_quant_format(kv_cache_dtype, 16, arch.num_key_value_heads, arch.head_dim)
    with torch.inference_mode():
        full = greedy_generate_paged(model, get_attention_backend("cpu"), prompts, NEW_TOKENS)
        quantized = greedy_generate_paged(model, get_attention_backend("cpu", fmt), prompts, NEW_TOKENS,
                                          kv_format=fmt)
    common = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(full, quantized)]
    rate = sum(common) / (len(prompts) * NEW_TOKENS)
    identical = sum(c == NEW_TOKENS for c in common)
    print(f"{kv_cache_dtype}: greedy agreement {rate:.3f} over {len(prompts)} prompts x {NEW_TOKENS} tokens, "
          f"{identical} identical")
    # measured (2026-12-03): int8 0.648 (3 of 8 prompts identical), fp8 e4m3 0.469 (0 of 8) on an
    # AVX512-BF16 CPU; int8 0.488 on an AVX2-only one (its kernels sum in another order, and one
    # early divergence moves the whole prompt's share). The bound is for both.
    assert rate >= {"int8": 0.4, "fp8_e4m3": 0.3}[kv_cache_dtype]
