"""What the engine hands back: per-step deltas (streaming) and whole results (offline API)."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv_hooks import KVImportOutcome, KVSendResult


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class StreamDelta:
    """New tokens of one request from one engine step (what `AsyncEngine.generate` yields)."""
    request_id: str
    new_token_ids: list[int]
    new_text: str = ""
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | "prefill_done"
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0
    error: str | None = None
    invalid_request: bool = False  # the error is the request's own (`StepOutput.invalid_request`)
    # Disaggregation (engine/kv_connector.py): a prefill-role request's first-token delta carries
    # its send's report once every layer is pushed (error None; `answers_prefill`), its final
    # delta how the send ended; a decode-role request's first one how it got its KV (after a
    # failed load that falls back before any token, at once, in a delta without tokens).
    kv_send: KVSendResult | None = None
    kv_import: KVImportOutcome | None = None
    # With SamplingParams.prompt_logprobs, on the delta of the first output token: one entry per
    # prompt token (None for the first).
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def answers_prefill(self) -> bool:
        """Whether this prefill-role delta is the one its worker answers the decode worker with:
        its first token's, when that carries the send's report (`KVConnector.send_report`), else
        its final one (the send ended: its outcome; or the request failed)."""
        return self.finished or (self.kv_send is not None and self.kv_send.error is None)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, delta: StreamDelta, want_logprobs: bool) -> None:
        self.token_ids.extend(delta.new_token_ids)
        self.text += delta.new_text
        if want_logprobs:
            self.logprobs = (self.logprobs or []) + delta.new_logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.error = delta.error
