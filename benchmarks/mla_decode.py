"""What multi-head latent attention (MLA) costs and saves in a decode step on CPU: a dense
DeepSeek-V3-shaped model (latent attention, no experts) against a Llama with grouped-query
attention (GQA), both random and fp32, same hidden size, layers, query heads and MLP, through the
offline engine at given contexts (prompt lengths) and batches. Reports each model's KV cache bytes
per token (all layers, read from the engine's cache tensor), the KV bytes a decode step reads at a
context (bytes per token x context x batch), its weight bytes (the engine's, pre-blocked copies
included, and the parameters alone), and its decode step time: the wall time of each engine step
after every prompt has its first token (decode-only steps), their median (`step_ms`), mean and
minimum over `--rounds` runs of `--steps` steps, the two models alternating so that both see the
same load. The load average before and after is recorded: on a shared machine it says how far to
trust the times (and there `--threads 1` is steadier: two threads on two busy cores wait for each
other at every parallel region).

MLA: `DeepseekV3Config`, hidden 1024, 8 layers, 16 heads, q_lora_rank 384, kv_lora_rank 512,
qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128, every layer dense
(`first_k_dense_replace` = layers): its cache holds one 512 + 64 latent per token and layer.
GQA: `LlamaConfig`, hidden 1024, 8 layers, 16 query heads, 4 KV heads of head_dim 128: its cache
holds a key and a value per KV head, 2 x 4 x 128 per token and layer. Both: MLP 2048 wide,
vocabulary 4096, tied embeddings.

Each model's engine prefills the largest batch's longest prompts once; every other run's prompts
are prefixes of those (prefix cache hits). That prefill is most of the run time: MLA's prefill is
torch (engine/attention/latent.py), ~25 s per 2048-token prompt on one thread of the 2-vCPU EPYC,
so 2048 x 8 alone takes minutes; the default contexts stop at 1024.

    python benchmarks/mla_decode.py [--contexts 512 1024] [--batches 1 8] [--steps 8] [--rounds 3]
                                    [--threads N]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import transformers  # noqa: E402

from benchmarks.common import run_metadata  # noqa: E402
from benchmarks.random_model import INITIALIZER_RANGE, write_tokenizer  # noqa: E402

BLOCK_SIZE = 16
SHAPE = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
             num_attention_heads=16, max_position_embeddings=4096, initializer_range=INITIALIZER_RANGE,
             tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
MLA = dict(num_key_value_heads=16, q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
           v_head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
           # dense: no layer has experts (the expert fields only have to be valid)
           first_k_dense_replace=SHAPE["num_hidden_layers"], n_routed_experts=4, num_experts_per_tok=2,
           n_group=1, topk_group=1, n_shared_experts=1, moe_intermediate_size=256)
GQA = dict(num_key_value_heads=4, head_dim=128, rope_theta=10000.0)


def _save(config: transformers.PretrainedConfig, folder: str) -> str:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    write_tokenizer(folder, config.vocab_size)
    return folder


def _decode_steps_ms(llm, prompts, steps: int) -> list[float]:
    """Run `prompts` to `steps` + 1 tokens each; the wall time of each engine step after every
    prompt has its first token (decode-only steps: one token for every sequence), in ms."""
    from engine import SamplingParams
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    requests = [engine.make_request(p, params) for p in prompts]
    for request in requests:
        engine.add(request)
    started, times = set(), []
    while engine.has_unfinished():
        decoding = len(started) == len(requests)
        start = time.perf_counter()
        deltas = engine.step()
        if decoding:
            times.append((time.perf_counter() - start) * 1000)
        started.update(d.request_id for d in deltas if d.new_token_ids)
    return times


def _open(folder: str, stack: contextlib.ExitStack, contexts: list[int], batches: list[int], runs: int,
          steps: int) -> tuple:
    """The model's engine, what it says about its cache and weights, and the prompts (the largest
    batch at the longest context), prefilled: a shorter context's or batch's prompts are prefixes
    of these, so every later run finds its prompt in the prefix cache."""
    from engine import LLM
    from engine.kv_cache import bytes_per_block
    longest, widest = max(contexts), max(batches)
    prompts = [[3 + (7919 * i + 31 * j) % 4093 for j in range(longest)] for i in range(widest)]
    # the prompts' blocks plus fresh blocks for every run's generated tokens, so that no prompt
    # block is evicted (and prefilled again) before its context's runs
    per_run = -(-(steps + 3) // BLOCK_SIZE) + 1
    num_blocks = widest * (-(-longest // BLOCK_SIZE) + runs * per_run) + 64
    llm = stack.enter_context(LLM(folder, dtype="float32", num_blocks=num_blocks, block_size=BLOCK_SIZE,
                                  max_model_len=longest + steps + 16, max_num_seqs=widest))
    runner = llm.engine.runner
    cache = runner.kv_cache.data
    kv_bytes_per_token = cache.numel() * cache.element_size() // (runner.num_blocks * runner.block_size)
    expected = bytes_per_block(runner.arch, runner.block_size, runner.dtype, runner.model.shard.num_kv_heads)
    assert kv_bytes_per_token * runner.block_size == expected, (kv_bytes_per_token, expected)
    info = {"kv_cache_shape": list(cache.shape),  # [layers, blocks, K/V, block_size, kv heads, head_dim]
            "kv_bytes_per_token": kv_bytes_per_token,
            "weight_bytes": runner.weight_bytes,  # the engine's: parameters and their pre-blocked copies
            "param_bytes": sum(p.numel() * p.element_size() for p in runner.model.parameters())}
    start = time.perf_counter()
    _decode_steps_ms(llm, prompts, 0)
    info["prefill_s"] = round(time.perf_counter() - start, 1)
    return llm, info, prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024], help="prompt lengths")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per run")
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs per (model, context, batch), the models alternating, so both see the same load")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: every CPU)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    configs = [(c, b) for c in args.contexts for b in args.batches]
    results: dict = {"load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        folders = {"mla": _save(transformers.DeepseekV3Config(**SHAPE, **MLA), os.path.join(tmp, "mla")),
                   "gqa": _save(transformers.LlamaConfig(**SHAPE, **GQA), os.path.join(tmp, "gqa"))}
        engines = {}
        for name, folder in folders.items():
            llm, results[name], prompts = _open(folder, stack, args.contexts, args.batches,
                                                len(configs) * (args.rounds + 1), args.steps)
            engines[name] = (llm, prompts)
        times = {(name, c, b): [] for name in engines for c, b in configs}
        for round_ in range(args.rounds):
            for context, batch in configs:
                for name, (llm, prompts) in engines.items():
                    batch_prompts = [p[:context] for p in prompts[:batch]]
                    if round_ == 0:
                        _decode_steps_ms(llm, batch_prompts, 2)  # warm: this shape's decode path
                    times[name, context, batch] += _decode_steps_ms(llm, batch_prompts, args.steps)
        for (name, context, batch), samples in times.items():
            out, key = results[name], f"ctx{context}_batch{batch}"
            out[f"{key}_step_ms"] = round(statistics.median(samples), 2)
            out[f"{key}_step_ms_mean"] = round(statistics.fmean(samples), 2)
            out[f"{key}_step_ms_min"] = round(min(samples), 2)
            out[f"{key}_kv_read_bytes"] = out["kv_bytes_per_token"] * context * batch
    results["load_average_after"] = os.getloadavg()
    print(json.dumps({"args": vars(args), "results": results, **run_metadata()}, indent=1))


if __name__ == "__main__":
    main()
