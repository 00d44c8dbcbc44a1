"""Token log-probabilities in the two OpenAI shapes (completions and chat).

A token's text is its own bytes: byte-level BPE tokens (GPT-2 style, `Ġ` for a space), byte
fallback tokens (`<0xE4>`) and SentencePiece pieces (`▁` for a space) map back to raw bytes, so
a character split across tokens shows up as its UTF-8 pieces in `bytes` rather than as
replacement characters only.
"""
from __future__ import annotations

import codecs
import functools
import re
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_METASPACE = "\u2581"  # SentencePiece's word-boundary mark


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return {char: byte for byte, char in table.items()}


class TokenText:
    """Maps token ids to their bytes and display strings, with a small per-id cache."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._convert = tokenizer.hf_tokenizer.convert_ids_to_tokens
        self._byte_level = tokenizer.is_byte_level
        self._cache: dict[int, bytes] = {}

    def token_bytes(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._compute_bytes(token_id)
            if len(self._cache) < 200_000:
                self._cache[token_id] = cached
        return cached

    def token_str(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def _compute_bytes(self, token_id: int) -> bytes:
        piece = self._convert(token_id)
        if isinstance(piece, str):
            fallback = _BYTE_FALLBACK.match(piece)
            if fallback:
                return bytes([int(fallback.group(1), 16)])
            if self._byte_level:
                inverse = _byte_level_decoder()
                if all(char in inverse for char in piece):
                    return bytes(inverse[char] for char in piece)
            elif _METASPACE in piece:
                # SentencePiece (Llama-2 style): "▁" is the space before a word. Decoding the token
                # alone would strip it (the decoder drops a text's leading space).
                return piece.replace(_METASPACE, " ").encode("utf-8")
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")


class TextOffsets:
    """Where each token of a text starts in it, in characters, token after token (across a
    stream's chunks too): the characters its bytes complete. A character split across tokens
    starts at its first token; the tokens after it in that character start there as well."""

    def __init__(self, token_text: TokenText, start: int = 0) -> None:
        self._token_text = token_text
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.offset = start

    def take(self, token_id: int) -> int:
        """The offset of the next token, `token_id`; the offsets move past it."""
        offset = self.offset
        self.offset += len(self._decoder.decode(self._token_text.token_bytes(token_id)))
        return offset


def completion_logprobs(token_text: TokenText, entries: Iterable[Any], offsets: int | TextOffsets) -> dict[str, Any]:
    """The completions API's `logprobs` object for `entries` (wire TokenLogprob messages), whose
    text starts at character `offsets` of the completion (or where a stream's `TextOffsets` is)."""
    if isinstance(offsets, int):
        offsets = TextOffsets(token_text, offsets)
    tokens, token_logprobs, top_logprobs, starts = [], [], [], []
    for entry in entries:
        tokens.append(token_text.token_str(entry.token_id))
        token_logprobs.append(entry.logprob)
        top_logprobs.append({token_text.token_str(top.token_id): top.logprob for top in entry.top} or None)
        starts.append(offsets.take(entry.token_id))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": starts}


def chat_logprobs(token_text: TokenText, entries: Iterable[Any]) -> dict[str, Any]:
    """The chat API's `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        raw = token_text.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    content = [{**item(entry.token_id, entry.logprob),
                "top_logprobs": [item(top.token_id, top.logprob) for top in entry.top]} for entry in entries]
    return {"content": content}
