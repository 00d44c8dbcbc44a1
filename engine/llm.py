"""The offline API: `LLM(model="default").generate(prompts, sampling_params)`.

Prompts are strings, token-id lists or chat message lists (`[{"role": ..., "content": ...}]`).
Engine options are EngineConfig fields plus the cache, scheduler and speculative fields by name,
e.g. `LLM(block_size=16, num_blocks=512, max_num_batched_tokens=256, speculative_method="ngram")`. With
`tensor_parallel_size=N` the engine starts N-1 follower processes: `close()` the LLM (or use it
as a context manager) to end them; they also end when this process does.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from tqdm import tqdm

from engine.config import (DECODE_ROLE_MAX_STEP_RATIO, PREFILL_ROLE_LONG_CHUNK_TOKENS, CacheConfig, EngineConfig,
                           SchedulerConfig, SpeculativeConfig)
from engine.engine import LLMEngine, Prompt
from engine.model.default_model import DEFAULT_MODEL_NAME
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


def build_engine_config(model: str = DEFAULT_MODEL_NAME, **options) -> EngineConfig:
    """Sort flat keyword options into EngineConfig / CacheConfig / SchedulerConfig /
    SpeculativeConfig; unknown names raise."""
    groups = {name: {} for name in ("engine", "cache", "scheduler", "speculative")}
    fields = {
        "engine": {f.name for f in dataclasses.fields(EngineConfig)} - {"cache", "scheduler", "speculative", "model"},
        "cache": {f.name for f in dataclasses.fields(CacheConfig)},
        "scheduler": {f.name for f in dataclasses.fields(SchedulerConfig)},
        "speculative": {f.name for f in dataclasses.fields(SpeculativeConfig)},
    }
    for key, value in options.items():
        owner = next((group for group, names in fields.items() if key in names), None)
        if owner is None:
            known = sorted(set().union(*fields.values()))
            raise ValueError(f"unknown engine option {key!r}; known options: {', '.join(known)}")
        groups[owner][key] = value
    if options.get("role") == "decode" and options.get("max_step_ms") is None and "max_step_ratio" not in options:
        groups["scheduler"]["max_step_ratio"] = DECODE_ROLE_MAX_STEP_RATIO
    config = EngineConfig(model=model, cache=CacheConfig(**groups["cache"]),
                          scheduler=SchedulerConfig(**groups["scheduler"]),
                          speculative=SpeculativeConfig(**groups["speculative"]), **groups["engine"])
    if config.role == "prefill" and "long_prefill_chunk_tokens" not in options:
        config.scheduler.long_prefill_chunk_tokens = PREFILL_ROLE_LONG_CHUNK_TOKENS[config.device.split(":")[0]]
    return config


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL_NAME, **options) -> None:
        self.engine = LLMEngine(build_engine_config(model, **options))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """End the engine's tensor-parallel followers, if any (idempotent)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        requests = [self.engine.make_request(p, sp) for p, sp in zip(prompts, params_list)]
        results: dict[str, RequestOutput] = {}
        try:
            for request in requests:
                self.engine.add(request)
                results[request.request_id] = RequestOutput(request.request_id, list(request.prompt_token_ids))
            want_logprobs = {r.request_id: r.sampling_params.logprobs is not None for r in requests}
            with tqdm(total=len(requests), desc="generate", disable=not use_tqdm) as progress:
                pending = len(requests)
                while pending:
                    for delta in self.engine.step():
                        output = results[delta.request_id]
                        output.append(delta, want_logprobs[delta.request_id])
                        if delta.finished:
                            pending -= 1
                            progress.update(1)
        except BaseException:  # a prompt refused, a step that failed, Ctrl-C: end this call's requests
            for request_id in results:
                self.engine.abort(request_id)  # frees its blocks; None if it had finished
            raise
        return [results[r.request_id] for r in requests]


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # one token-id prompt
    if prompts and all(isinstance(p, dict) for p in prompts):
        return [prompts]  # one chat conversation
    return prompts
