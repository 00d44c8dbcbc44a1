"""A minimal model-runner harness: greedy generation for many prompts through the paged cache.

Independent of the scheduler, so model and attention correctness are tested on their own: all
prompts prefill together in one flattened forward pass, then every step decodes one token for
each sequence in one pass. Block ids are shuffled so no sequence owns contiguous blocks.
"""
from __future__ import annotations

import random

import torch

from engine.attention.metadata import AttentionMetadata
from engine.kv_cache import allocate_kv_cache


def greedy_generate_paged(model, backend, prompts: list[list[int]], max_new_tokens: int, block_size: int = 16,
                          dtype=torch.float32, seed: int = 0, return_first_logits: bool = False, kv_format=None):
    """`kv_format`: an 8-bit cache in that format (engine/kv_quant.py; `backend` must read it)."""
    arch = model.arch
    blocks_per_seq = [(len(p) + max_new_tokens + block_size - 1) // block_size for p in prompts]
    ids = list(range(sum(blocks_per_seq) + 3))
    random.Random(seed).shuffle(ids)
    tables, cursor = [], 0
    for n in blocks_per_seq:
        tables.append(ids[cursor:cursor + n])
        cursor += n
    cache = allocate_kv_cache(arch, len(ids), block_size, dtype, "cpu", kv_format=kv_format)
    layers = cache.layers
    tokens = [list(p) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    first_logits = None
    computed = [0] * len(prompts)
    for step in range(max_new_tokens):
        query_lens = [len(t) - c for t, c in zip(tokens, computed)]
        seq_lens = [len(t) for t in tokens]
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, "cpu")
        input_ids = [tok for t, c in zip(tokens, computed) for tok in t[c:]]
        positions = [pos for t, c in zip(tokens, computed) for pos in range(c, len(t))]
        last = torch.tensor(meta.query_start_loc[1:].tolist(), dtype=torch.int64) - 1
        logits = model(torch.tensor(input_ids), torch.tensor(positions), layers, meta, backend, last)
        if step == 0:
            first_logits = logits.clone()
        next_ids = logits.argmax(-1).tolist()
        for i, tok in enumerate(next_ids):
            computed[i] = len(tokens[i])
            tokens[i].append(tok)
            outputs[i].append(tok)
    return (outputs, first_logits) if return_first_logits else outputs
