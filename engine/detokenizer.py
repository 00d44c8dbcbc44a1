"""Incremental detokenization of one request's output, with stop strings.

Contract:
- `add_tokens(ids)` returns only text that is final: never half a UTF-8 character (while the
  decoded tail ends in U+FFFD the new tokens are held back) and never text that could still turn
  out to be the start of a stop string. After the last call (`final=True`), the concatenated
  deltas equal `tokenizer.decode(output_ids, skip_special_tokens=...)` up to stop-string
  truncation (for tokenizers whose decoder strips a leading space, such as SentencePiece, the
  text keeps the space that follows the prompt, so prompt text + output text reads right).
- Each call decodes a short window (a few tokens of context plus the unreleased ones: vLLM's
  prefix-offset / read-offset technique), so its cost is O(new tokens), not O(output).
- Stop strings: the earliest-ending match stops the request; the text after it (and the stop
  string itself unless `include_stop_str_in_output`) is never emitted. Stop token ids and EOS
  are the scheduler's business, not this class's.

`tokenizer` is anything with `decode(ids, skip_special_tokens=...) -> str`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from engine.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded in front of the output, so the first output token decodes in context.
CONTEXT_TOKENS = 5
# A split character needs at most 3 held tokens; a longer run ending in U+FFFD is real
# replacement text (invalid bytes from the model), released so the window stays short.
MAX_HELD_TOKENS = 16


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class DetokenizerDelta:
    new_text: str  # safe to emit now
    stopped: bool = False  # a stop string matched (this call or before)
    stop_reason: str | None = None  # the stop string that matched


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stops = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        # Token window: window[:read] decodes to prefix_text (already released); window[read:] is held.
        self._window = [int(t) for t in prompt_token_ids[-CONTEXT_TOKENS:]]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        self._decoded = ""  # every complete character decoded so far
        self._emitted = 0  # how much of _decoded has been handed out
        self._stop_reason: str | None = None

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._decoded[:self._emitted]

    @property
    def stopped(self) -> bool:
        return self._stop_reason is not None

    def add_tokens(self, token_ids: Sequence[int], final: bool = False, stop_token: bool = False) -> DetokenizerDelta:
        """Feed newly sampled tokens; `final=True` on the request's last call releases everything
        still held back (a trailing partial character, a possible stop-string start).
        `stop_token=True`: the last of `token_ids` is the EOS or stop token id that ended the
        output; as in vLLM its text is left out unless `include_stop_str_in_output`."""
        if self.stopped:
            return DetokenizerDelta("", True, self._stop_reason)
        if stop_token and token_ids and not self._include_stop:
            token_ids = token_ids[:-1]
        previous_length = len(self._decoded)
        for token_id in token_ids:
            self._window.append(int(token_id))
            self._release(force=False)
        if final:
            self._release(force=True)
        return self._emit(previous_length, final)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _release(self, force: bool) -> None:
        """Move the held tokens' text into _decoded when it ends on a whole character."""
        num_held = len(self._window) - self._read
        if num_held == 0:
            return
        text = self._decode(self._window)
        if not force and text.endswith(REPLACEMENT_CHAR) and num_held < MAX_HELD_TOKENS:
            return
        if len(text) > len(self._prefix_text):
            self._decoded += text[len(self._prefix_text):]
            self._window = self._window[self._read:]
            self._read = len(self._window)
            self._prefix_text = self._decode(self._window)

    def _emit(self, previous_length: int, final: bool) -> DetokenizerDelta:
        if self._stops:
            match = self._find_stop(max(0, previous_length - self._max_stop_len + 1))
            if match is not None:
                index, stop = match
                self._decoded = self._decoded[:index + len(stop) if self._include_stop else index]
                self._stop_reason = stop
                new_text = self._decoded[self._emitted:]
                self._emitted = len(self._decoded)
                return DetokenizerDelta(new_text, True, stop)
        hold = 0 if final or self._include_stop else self._possible_stop_start()
        end = max(self._emitted, len(self._decoded) - hold)
        new_text = self._decoded[self._emitted:end]
        self._emitted = end
        return DetokenizerDelta(new_text)

    def _find_stop(self, search_from: int) -> tuple[int, str] | None:
        """The stop string occurrence that ends first (then starts first) at or after search_from."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            index = self._decoded.find(stop, search_from)
            if index >= 0 and (best is None or (index + len(stop), index) < best[:2]):
                best = (index + len(stop), index, stop)
        return None if best is None else (best[1], best[2])

    def _possible_stop_start(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string.
        Only prefixes ending in the text's last character can be one: each stop's candidates are
        found with `rfind` and compared in C, longest first (no per-length Python loop)."""
        text = self._decoded
        if not text:
            return 0
        last, best = text[-1], 0
        for stop in self._stops:
            end = stop.rfind(last, 0, min(len(stop) - 1, len(text)))
            while end + 1 > best:
                if text.endswith(stop[:end + 1]):
                    best = end + 1
                    break
                end = stop.rfind(last, 0, end)
        return best
