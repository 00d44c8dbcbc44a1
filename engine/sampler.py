"""Batched sampling: logits of one step -> one token per sequence (plus logprobs on request).

Contract:
- Processing order per row: penalties (repetition on prompt + output tokens, the Hugging Face
  way; presence / frequency on output tokens, the OpenAI way) -> temperature -> top-k -> top-p
  -> min-p -> draw. A row is greedy when its temperature is below 1e-5: it takes the argmax of
  its penalized logits. Rows with different settings share one batch; every step is a fixed
  number of tensor operations whatever the batch size (no per-row Python loop).
- The draw is inverse-CDF sampling with one uniform number per row. A seeded row's uniform is a
  pure function of (seed, output position) (splitmix64, never Python's `hash()`), so its token
  depends only on that and its logits: not on the batch, the row index or the process (across
  device kinds only up to the rounding of the probabilities). That lets the prefill worker sample
  position 0 and a decode worker the rest. Unseeded rows draw from the sampler's own generator,
  seeded at construction.
- Top-k / top-p / min-p keep ties at the cut-off (thresholds on values), so the kept set never
  depends on sort order.
- Structured output: a row with a grammar first has the tokens its grammar does not allow set to
  -inf (engine/structured_output.py); everything after sees only the allowed tokens.
- Logit bias (after the penalties): each row's `logit_bias` is added to its tokens' logits, and
  the tokens it may not sample yet (`banned`: EOS and stop token ids before `min_tokens`) get -inf,
  unless its grammar allows nothing else (an output that has reached the grammar's end ends).
- Logprobs are of the model's raw distribution (log_softmax of the unprocessed logits, before
  penalties and grammar masks).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams
from engine.structured_output import allocate_bitmask, allowed_tokens, apply_bitmask

GREEDY_TEMPERATURE = 1e-5
# On CPU a full sort of the vocabulary is slow; top-p first looks for the nucleus among this many
# candidates per row (exact: rows whose nucleus is larger move on to the next size, then a full sort).
_TOP_P_CANDIDATES = (256, 4096)
_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) that drives a seeded request's draw at an output position.

    24 bits, like float32 `torch.rand`, so it is exact in float32 on every device."""
    mixed = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (mixed >> 40) * 2.0 ** -24


@dataclass
class PenaltyTensors:
    """Sparse penalty updates, as flat positions (row * vocab + token) into the [n, vocab] logits.

    Work and memory grow with the number of distinct penalized tokens, not with batch x vocab."""
    seen_positions: torch.Tensor | None  # int64, unique: prompt or output tokens of repetition-penalty rows
    seen_repetition: torch.Tensor | None  # float32: that row's repetition penalty, per seen position
    output_positions: torch.Tensor | None  # int64, unique: output tokens of presence/frequency rows
    output_subtract: torch.Tensor | None  # float32: frequency * count + presence, per output position


@dataclass
class SamplingMetadata:
    """Per-step tensors for the sampler, built once per step from the batch's requests.

    Optional tensors are None when no row of the batch needs them (the sampler skips that stage).
    """
    num_seqs: int
    all_greedy: bool
    greedy_mask: torch.Tensor | None  # [n] bool; None when no row (or every row) is greedy
    temperature: torch.Tensor | None  # [n] float32, 1.0 on greedy rows; None when all greedy
    top_k: torch.Tensor | None  # [n] int64, vocab_size where disabled
    max_top_k: int  # largest enabled top_k (0 when none)
    top_p: torch.Tensor | None  # [n] float32
    min_p: torch.Tensor | None  # [n] float32
    seeded_uniforms: torch.Tensor | None  # [n] float32, NaN on unseeded rows; None when no seeded row
    penalties: PenaltyTensors | None
    num_logprobs: list[int | None]
    max_num_logprobs: int | None  # None when no row asked for logprobs
    vocab_size: int
    token_bitmask: torch.Tensor | None = None  # int32 [n, ceil(vocab / 32)] allowed tokens; None: no grammar
    bitmask_rows: list[int] | None = None  # the rows that have a grammar
    bias_positions: torch.Tensor | None = None  # int64 flat (row * vocab + token); None: no bias, nothing banned
    bias_values: torch.Tensor | None = None  # float32, added there (-inf: banned)

    @classmethod
    def build(cls, params: list[SamplingParams], prompt_token_ids: list[list[int]],
              output_token_ids: list[list[int]], vocab_size: int, device,
              grammars: list | None = None, banned: list[list[int]] | None = None) -> "SamplingMetadata":
        """`grammars`: per row, its `GrammarState` or None (structured output). `banned`: per row,
        the tokens it may not sample at this step (min_tokens: EOS and stop token ids)."""
        num_seqs = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == num_seqs):
            raise ValueError(f"got {num_seqs} sampling params, {len(prompt_token_ids)} prompts and "
                             f"{len(output_token_ids)} outputs: one of each per sequence is required")
        if num_seqs == 0:
            raise ValueError("cannot sample an empty batch")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        device = torch.device(device)
        greedy = [p.temperature < GREEDY_TEMPERATURE for p in params]
        all_greedy = all(greedy)
        num_logprobs = [p.logprobs for p in params]
        asked = [k for k in num_logprobs if k is not None]
        max_num_logprobs = max(asked) if asked else None
        penalties = _build_penalties(params, prompt_token_ids, output_token_ids, vocab_size, device)

        def row_tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        meta = cls(num_seqs=num_seqs, all_greedy=all_greedy, greedy_mask=None, temperature=None,
                   top_k=None, max_top_k=0, top_p=None, min_p=None, seeded_uniforms=None,
                   penalties=penalties, num_logprobs=num_logprobs, max_num_logprobs=max_num_logprobs,
                   vocab_size=vocab_size)
        grammar_rows = [i for i, g in enumerate(grammars or ()) if g is not None]
        if grammar_rows:
            meta.token_bitmask = allocate_bitmask(num_seqs, vocab_size)
            meta.bitmask_rows = grammar_rows
            for row in grammar_rows:
                grammars[row].fill_bitmask(meta.token_bitmask, row)
            if banned:
                banned = _unban_where_the_grammar_must_end(banned, meta.token_bitmask, grammar_rows, vocab_size)
        meta.bias_positions, meta.bias_values = _build_bias(params, banned, vocab_size, device)
        if all_greedy:
            return meta
        random_params = [p for p, g in zip(params, greedy) if not g]
        if any(greedy):
            meta.greedy_mask = row_tensor(greedy, torch.bool)
        meta.temperature = row_tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)],
                                      torch.float32)
        if any(p.top_k != -1 and p.top_k < vocab_size for p in random_params):
            top_ks = [vocab_size if g or p.top_k == -1 else min(p.top_k, vocab_size)
                      for p, g in zip(params, greedy)]
            meta.top_k = row_tensor(top_ks, torch.int64)
            meta.max_top_k = max(k for k in top_ks if k < vocab_size)
        if any(p.top_p < 1.0 for p in random_params):
            meta.top_p = row_tensor([1.0 if g else p.top_p for p, g in zip(params, greedy)], torch.float32)
        if any(p.min_p > 0.0 for p in random_params):
            meta.min_p = row_tensor([0.0 if g else p.min_p for p, g in zip(params, greedy)], torch.float32)
        if any(p.seed is not None for p in random_params):
            uniforms = [seeded_uniform(p.seed, len(out)) if p.seed is not None and not g else float("nan")
                        for p, out, g in zip(params, output_token_ids, greedy)]
            meta.seeded_uniforms = row_tensor(uniforms, torch.float32)
        return meta


def _unban_where_the_grammar_must_end(banned: list[list[int]], bitmask: torch.Tensor, grammar_rows: list[int],
                                      vocab_size: int) -> list[list[int]]:
    """`min_tokens` bans EOS and the stop ids; a grammar that has reached its end allows only
    those. Where the two together would leave no token, the grammar wins: the row may end."""
    banned = list(banned)
    for row in grammar_rows:
        if not banned[row]:
            continue
        others = allowed_tokens(bitmask, row, vocab_size)
        others[[t for t in banned[row] if t < vocab_size]] = False
        if not bool(others.any()):
            banned[row] = []
    return banned


def _build_bias(params: list[SamplingParams], banned: list[list[int]] | None, vocab_size: int,
                device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Flat positions and additions for every row's logit bias and banned tokens (ids outside the
    vocabulary are ignored: the router refuses them, a padded vocabulary has none)."""
    positions: list[int] = []
    values: list[float] = []
    for row, p in enumerate(params):
        for token, bias in p.logit_bias.items():
            if token < vocab_size:
                positions.append(row * vocab_size + token)
                values.append(float(bias))
        for token in (banned[row] if banned else ()):
            if token < vocab_size:
                positions.append(row * vocab_size + token)
                values.append(float("-inf"))
    if not positions:
        return None, None
    return (torch.tensor(positions, dtype=torch.int64, device=device),
            torch.tensor(values, dtype=torch.float32, device=device))


def _build_penalties(params: list[SamplingParams], prompt_token_ids: list[list[int]],
                     output_token_ids: list[list[int]], vocab_size: int,
                     device: torch.device) -> PenaltyTensors | None:
    repetition_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    output_rows = [i for i, p in enumerate(params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
    if not (repetition_rows or output_rows):
        return None
    penalties = PenaltyTensors(None, None, None, None)
    if repetition_rows:
        positions = torch.cat([_flat_positions(prompt_token_ids, repetition_rows, vocab_size),
                               _flat_positions(output_token_ids, repetition_rows, vocab_size)]).unique()
        repetition = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
        penalties.seen_positions = positions.to(device)
        penalties.seen_repetition = repetition[positions // vocab_size].to(device)
    if output_rows:
        positions, counts = _flat_positions(output_token_ids, output_rows, vocab_size).unique(return_counts=True)
        rows = positions // vocab_size
        frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)
        presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)
        penalties.output_positions = positions.to(device)
        penalties.output_subtract = (frequency[rows] * counts.to(torch.float32) + presence[rows]).to(device)
    return penalties


def _flat_positions(token_lists: list[list[int]], rows: list[int], vocab_size: int) -> torch.Tensor:
    """row * vocab_size + token for every token of the given rows (int64, on the CPU)."""
    flat = torch.tensor(list(itertools.chain.from_iterable(token_lists[i] for i in rows)), dtype=torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= vocab_size):
        bad = int(flat.min()) if int(flat.min()) < 0 else int(flat.max())
        raise ValueError(f"token id {bad} is outside the vocabulary (size {vocab_size})")
    lengths = torch.tensor([len(token_lists[i]) for i in rows], dtype=torch.int64)
    return torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths) * vocab_size + flat


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[float] | None  # the sampled token's logprob per row, when any row asked
    top_logprobs: list[list[tuple[int, float]]] | None  # per row, its top-k (k = its logprobs); [] if it did not ask


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str | None = None) -> None:
        """`seed` drives unseeded rows; `device` is only a hint (generators follow the logits)."""
        if not isinstance(seed, int):
            raise ValueError(f"sampler seed must be an integer, got {seed!r}")
        self.seed = seed
        self.device = torch.device(device) if device is not None else None
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed & _MASK64)
            self._generators[device] = generator
        return self._generators[device]

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != meta.num_seqs:
            raise ValueError(f"logits must be [num_seqs={meta.num_seqs}, vocab], got {tuple(logits.shape)}")
        logits = logits.float()
        sparse = meta.penalties is not None or meta.token_bitmask is not None or meta.bias_positions is not None
        if sparse and meta.vocab_size != logits.shape[1]:
            raise ValueError(f"sampling metadata was built for a vocabulary of "
                             f"{meta.vocab_size}, the logits have {logits.shape[1]}")
        penalized = logits
        if meta.token_bitmask is not None:
            penalized = logits.clone()  # the raw logits stay for logprobs
            apply_bitmask(penalized, meta.token_bitmask, meta.bitmask_rows)
        if meta.penalties is not None:
            penalized = apply_penalties(penalized, meta.penalties)
        if meta.bias_positions is not None:
            if penalized is logits:
                penalized = logits.clone()  # the raw logits stay for logprobs
            penalized.view(-1).index_add_(0, meta.bias_positions, meta.bias_values)
        if meta.all_greedy:
            tokens = penalized.argmax(dim=-1)
        else:
            tokens = self._sample(penalized, meta)
        return self._output(logits, tokens, meta)

    def _sample(self, penalized: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        scaled = penalized / meta.temperature[:, None]
        if meta.top_k is not None or meta.top_p is not None:
            scaled = apply_top_k_top_p(scaled, meta.top_k, meta.max_top_k, meta.top_p)
        if meta.min_p is not None:
            scaled = apply_min_p(scaled, meta.min_p)
        probs = torch.softmax(scaled, dim=-1)
        uniforms = torch.rand(meta.num_seqs, generator=self._generator(probs.device), device=probs.device)
        if meta.seeded_uniforms is not None:
            uniforms = torch.where(meta.seeded_uniforms.isnan(), uniforms, meta.seeded_uniforms)
        tokens = inverse_cdf_sample(probs, uniforms)
        if meta.greedy_mask is not None:
            tokens = torch.where(meta.greedy_mask, penalized.argmax(dim=-1), tokens)
        return tokens

    @staticmethod
    def _output(logits: torch.Tensor, tokens: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if meta.max_num_logprobs is None:
            return SamplerOutput(token_ids=tokens.tolist(), logprobs=None, top_logprobs=None)
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        sampled = raw_logprobs.gather(1, tokens[:, None]).squeeze(1)
        top_logprobs: list[list[tuple[int, float]]] = [[] for _ in range(meta.num_seqs)]
        if meta.max_num_logprobs > 0:
            top = torch.topk(raw_logprobs, min(meta.max_num_logprobs, logits.shape[1]), dim=-1)
            top_ids, top_values = top.indices.tolist(), top.values.tolist()
            top_logprobs = [list(zip(top_ids[row][:k], top_values[row][:k])) if k else []
                            for row, k in enumerate(meta.num_logprobs)]
        return SamplerOutput(token_ids=tokens.tolist(), logprobs=sampled.tolist(), top_logprobs=top_logprobs)


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors) -> torch.Tensor:
    """Repetition (prompt + output: divide positive logits, multiply negative ones), then frequency
    and presence (output only: logit -= frequency * count + presence). Returns a new tensor."""
    flat = logits.reshape(-1).clone()
    if penalties.seen_positions is not None:
        values = flat[penalties.seen_positions]
        repetition = penalties.seen_repetition
        flat[penalties.seen_positions] = torch.where(values > 0, values / repetition, values * repetition)
    if penalties.output_positions is not None:
        flat[penalties.output_positions] -= penalties.output_subtract
    return flat.view_as(logits)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) what top-k (per-row k; vocab size = off) and then top-p (per-row p; 1 = off)
    remove. Ties at either cut-off are kept."""
    if top_k is not None:
        logits = apply_top_k(logits, top_k, max_top_k)
    if top_p is not None:
        logits = apply_top_p(logits, top_p)
    return logits


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    vocab = logits.shape[-1]
    k = max(1, min(max_top_k, vocab))
    kth = torch.topk(logits, k, dim=-1).values.gather(1, (top_k.clamp(max=k) - 1)[:, None])
    kth = kth.masked_fill(top_k[:, None] >= vocab, float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p (plus ties).

    On CPU a full sort of the vocabulary is slow, so rows first look for their nucleus among
    their top few hundred, then few thousand candidates; only rows whose nucleus is larger
    get a full sort. On CUDA every row is sorted at once (no host synchronization)."""
    vocab = logits.shape[-1]
    log_normalizer = torch.logsumexp(logits, dim=-1, keepdim=True)
    if logits.is_cuda:
        cutoff, _ = _nucleus_cutoff(torch.sort(logits, dim=-1, descending=True).values, log_normalizer, top_p)
    else:
        cutoff = torch.empty_like(log_normalizer)
        rows = torch.arange(logits.shape[0], device=logits.device)
        for size in [s for s in _TOP_P_CANDIDATES if s < vocab] + [vocab]:
            subset = logits.index_select(0, rows)
            values = (torch.topk(subset, size, dim=-1).values if size < vocab
                      else torch.sort(subset, dim=-1, descending=True).values)
            row_cutoff, covered = _nucleus_cutoff(values, log_normalizer.index_select(0, rows),
                                                  top_p.index_select(0, rows))
            if size == vocab:
                covered = torch.ones_like(covered)
            cutoff[rows[covered]] = row_cutoff[covered]
            rows = rows[~covered]
            if rows.numel() == 0:
                break
    cutoff = cutoff.masked_fill(top_p[:, None] >= 1.0, float("-inf"))
    return logits.masked_fill(logits < cutoff, float("-inf"))


def _nucleus_cutoff(values: torch.Tensor, log_normalizer: torch.Tensor,
                    top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From each row's largest logits (sorted, descending): the logit of the token at which the
    cumulative probability first reaches top_p, and whether that happens within these values."""
    cumulative = (values - log_normalizer).exp().cumsum(dim=-1)
    index = (cumulative < top_p[:, None]).sum(dim=-1, keepdim=True)
    covered = index[:, 0] < values.shape[-1]
    return values.gather(1, index.clamp(max=values.shape[-1] - 1)), covered


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens whose probability is at least min_p times the top token's (in logit space)."""
    threshold = logits.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]
    return logits.masked_fill(logits < threshold, float("-inf"))


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row i takes the first token whose cumulative probability exceeds uniforms[i] (in [0, 1))."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    targets = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)
    # With a monotone cdf and a target below its top, the token found has a positive probability.
    # A GPU's parallel scan may round non-monotonically: never return a zero-probability token.
    chosen = probs.gather(1, tokens[:, None]).squeeze(1)
    if not bool((chosen > 0).all()):
        tokens = torch.where(chosen > 0, tokens, probs.argmax(dim=-1))
    return tokens
