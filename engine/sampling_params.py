"""Per-request sampling parameters, validated at construction.

A `ValueError` raised here is a client's mistake: workers map it to INVALID_ARGUMENT and the
router to HTTP 400, with this message.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.structured_output import StructuredOutput

# Each stop string's length cap: the detokenizer checks the output's tail against every stop after
# every token, and a request body may be megabytes.
MAX_STOP_LENGTH = 4096


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's; k: plus the top k
    # The prompt's tokens' logprobs, each given the tokens before it (None: none; k: plus the top
    # k at each position). The whole prompt is computed (no prefix-cache hits) where it is prefilled.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrained decoding (JSON, JSON Schema, regex, choice, EBNF): engine/structured_output.py
    structured_output: StructuredOutput | None = None
    # Added to a token's logit before sampling (OpenAI's logit_bias: -100 bans it, +100 forces it)
    logit_bias: dict[int, float] = field(default_factory=dict)
    # EOS and stop_token_ids cannot be sampled before this many output tokens (vLLM's min_tokens)
    min_tokens: int = 0
    # With speculative decoding on (engine/speculative.py): False keeps this request's decodes
    # to one token per step (its output is the same either way; only its speed differs)
    speculative: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.logit_bias = dict(self.logit_bias)
        if self.top_k == 0:
            self.top_k = -1
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens must be an integer >= 1"),
            (0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100]"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 1, "top_k must be -1 (disabled) or >= 1"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 10.0, "repetition_penalty must be in (0, 10]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs must be in [0, 20]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (len(self.stop) <= 16, "at most 16 stop strings"),
            (all(len(s) <= MAX_STOP_LENGTH for s in self.stop),
             f"stop strings must be at most {MAX_STOP_LENGTH} characters"),
            (self.seed is None or isinstance(self.seed, int), "seed must be an integer"),
            (self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
             "structured_output must be an engine.StructuredOutput"),
            (all(isinstance(t, int) and t >= 0 for t in self.logit_bias), "logit_bias keys must be token ids >= 0"),
            (all(-100.0 <= float(b) <= 100.0 for b in self.logit_bias.values()),
             "logit_bias values must be in [-100, 100]"),
            (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
             "min_tokens must be an integer in [0, max_tokens]"),
            (isinstance(self.speculative, bool), "speculative must be true or false"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
