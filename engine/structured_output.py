"""Structured output (constrained decoding): a grammar decides which tokens may come next.

A request asks for one of five constraints (`StructuredOutput`): any JSON object, JSON matching a
JSON Schema, a regular expression, one of a list of strings, or an EBNF grammar. The grammar
engine is xgrammar (the one vLLM and SGLang use).

Contract:
- `StructuredOutput` is validated at construction (the grammar is parsed once, no tokenizer
  needed; at most `MAX_SPEC_CHARS` characters, `MAX_GRAMMAR_CHARS` for EBNF, and for a schema
  `MAX_JSON_DEPTH` levels of nesting), so a bad schema, regex or grammar is a client's `ValueError` (HTTP 400 at the
  router) and never reaches a worker's step loop. Parsing and compiling take milliseconds, but
  servers run them off their event loops (the router and workers use a thread).
- `GrammarCompiler` (one per engine, built on first use from the engine's tokenizer) compiles a
  constraint against the vocabulary, with a cache, and hands each request its own `GrammarState`.
- A `GrammarState` follows the request's output tokens: every token appended to the request is
  accepted into it (`Request.append_output`), including a migrated request's resumed tokens and
  the first token a prefill worker sampled. Before each sampling step the runner asks it for the
  bitmask of allowed next tokens; the sampler masks the other logits to -inf.
- When the grammar is complete the mask allows only the end-of-sequence tokens; once one is
  accepted the state is terminated and the request stops (even with `ignore_eos`).
- Preemption needs nothing: recomputing KV does not change the output tokens, so the state stays.
"""
from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import Any, Sequence

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
_MAX_CHOICES = 1024
# Parsing cost grows steeply with nesting (xgrammar: a schema 100 objects deep takes ~0.1 s, 600
# deep several seconds), so a client cannot stall a worker with one request.
MAX_SPEC_CHARS = 64 << 10
MAX_GRAMMAR_CHARS = 256 << 10  # EBNF is longer than the schema it may come from (the router's tool grammars)
MAX_JSON_DEPTH = 64
# xgrammar prefixes its errors with a timestamp and a C++ source location.
_NATIVE_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")


def _xgrammar():
    import xgrammar
    return xgrammar


def _native_message(exc: Exception) -> str:
    return _NATIVE_PREFIX.sub("", str(exc)).strip() or type(exc).__name__


@dataclass(frozen=True)
class StructuredOutput:
    """What the generated text must match. Build it with the class methods:
    `json_object()`, `json_schema(schema)`, `regex(pattern)`, `choice(options)`, `grammar(ebnf)`.

    `spec` holds the schema (as JSON text), the regex or the EBNF grammar; `choices` the options
    of `choice`. Raises ValueError, naming what is wrong, when the constraint cannot be parsed."""
    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind == "choice":
            if not self.choices or len(self.choices) > _MAX_CHOICES:
                raise ValueError(f"a choice constraint needs 1 to {_MAX_CHOICES} options, got {len(self.choices)}")
            if not all(isinstance(c, str) and c for c in self.choices):
                raise ValueError("choice options must be non-empty strings")
        elif self.choices:
            raise ValueError(f"choices are only for the 'choice' kind, not {self.kind!r}")
        if self.kind in ("json_schema", "regex", "grammar") and not (isinstance(self.spec, str) and self.spec.strip()):
            raise ValueError(f"a {self.kind} constraint needs a non-empty {self._spec_name}")
        size, limit = len(self.spec) + sum(len(c) for c in self.choices), MAX_SPEC_CHARS
        if self.kind == "grammar":
            limit = MAX_GRAMMAR_CHARS
        if size > limit:
            raise ValueError(f"the {self.kind} constraint has {size} characters, more than the "
                             f"{limit} this server accepts")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except (json.JSONDecodeError, RecursionError) as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"a JSON schema must be an object (or true/false), got {type(schema).__name__}")
            if _depth(schema) > MAX_JSON_DEPTH:
                raise ValueError(f"the JSON schema nests deeper than {MAX_JSON_DEPTH} levels")
        # Parse it now (a bad constraint is the client's error, reported here) and keep the result.
        object.__setattr__(self, "_grammar", self._parse())

    @property
    def _spec_name(self) -> str:
        return {"json_schema": "JSON schema", "regex": "regular expression", "grammar": "EBNF grammar"}.get(
            self.kind, "spec")

    @classmethod
    def json_object(cls) -> "StructuredOutput":
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: dict | bool | str) -> "StructuredOutput":
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def regex(cls, pattern: str) -> "StructuredOutput":
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> "StructuredOutput":
        if isinstance(options, str):
            raise ValueError("choice options must be a list of strings, not one string")
        return cls("choice", "", tuple(options))

    @classmethod
    def grammar(cls, ebnf: str) -> "StructuredOutput":
        return cls("grammar", ebnf)

    def ebnf(self) -> str | None:
        """The EBNF this constraint compiles from, for the kinds that are written as one."""
        if self.kind == "grammar":
            return self.spec
        if self.kind == "choice":
            # JSON string escapes are also xgrammar EBNF string-literal escapes.
            return "root ::= " + " | ".join(json.dumps(option, ensure_ascii=False) for option in self.choices)
        return None

    def grammar_object(self) -> Any:
        """The parsed xgrammar `Grammar` (vocabulary-independent)."""
        return self._grammar

    def _parse(self) -> Any:
        xgr = _xgrammar()
        try:
            if self.kind == "json_object":
                # An object, as OpenAI's JSON mode promises; xgrammar's builtin JSON grammar takes
                # any value, so a sampled answer could be `[1]` or `"x"`.
                return xgr.Grammar.from_json_schema(_ANY_OBJECT, any_whitespace=True)
            if self.kind == "json_schema":
                return xgr.Grammar.from_json_schema(self.spec, any_whitespace=False)
            if self.kind == "regex":
                return xgr.Grammar.from_regex(self.spec)
            return xgr.Grammar.from_ebnf(self.ebnf())
        except RuntimeError as exc:
            raise ValueError(f"invalid {self._spec_name if self.kind != 'choice' else 'choice'}: "
                             f"{_native_message(exc)}") from None


_ANY_OBJECT = '{"type": "object", "additionalProperties": true}'


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in children)
    return deepest


class GrammarState:
    """One request's position in its grammar (an xgrammar `GrammarMatcher`)."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self.rejected_token: int | None = None  # the first token the grammar refused, if any

    def accept(self, token_id: int) -> bool:
        """Advance by one generated token; False (and remembered) if the grammar refuses it."""
        if self.rejected_token is not None:
            return False
        if self._matcher.is_terminated() or not self._matcher.accept_token(int(token_id)):
            self.rejected_token = int(token_id)
            return False
        return True

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and an end-of-sequence token was accepted."""
        return self._matcher.is_terminated()

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 bitmask (`allocate_bitmask`)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def allows_nothing(self) -> bool:
        """No next token is allowed (the constraint cannot be satisfied from here: an impossible
        pattern inside a schema, say); the sampler then has nothing to draw."""
        bitmask = allocate_bitmask(1, self._vocab_size)
        self.fill_bitmask(bitmask, 0)
        return not bool(allowed_tokens(bitmask, 0, self._vocab_size).any())


def allowed_tokens(bitmask: Any, row: int, vocab_size: int) -> Any:
    """Row `row` of an int32 bitmask unpacked: a bool tensor [vocab_size], True where allowed."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32)
    return ((bitmask[row][:, None] >> shifts) & 1).flatten()[:vocab_size].bool()


def allocate_bitmask(num_rows: int, vocab_size: int) -> Any:
    """An int32 [num_rows, ceil(vocab / 32)] bitmask on the CPU, every token allowed."""
    return _xgrammar().allocate_token_bitmask(num_rows, vocab_size)


def apply_bitmask(logits: Any, bitmask: Any, rows: list[int]) -> None:
    """Set the disallowed logits of `rows` to -inf, in place (float32 [n, vocab] logits, any
    device). On CPU: the native kernel (engine/csrc/token_mask_cpu.cpp), else unpacked bits and
    a masked fill; on CUDA: xgrammar's kernel."""
    import torch

    if logits.is_cuda:
        _xgrammar().apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
        return
    from engine import cpu_kernels

    kernels = cpu_kernels.load()
    index = torch.tensor(rows, dtype=torch.int64)
    if kernels is not None:
        kernels.apply_token_bitmask_(logits, bitmask, index)
        return
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = (bitmask[index].unsqueeze(-1) >> shifts).bitwise_and_(1).view(len(rows), -1)[:, :vocab].bool()
    logits[index] = logits[index].masked_fill_(~allowed, float("-inf"))


class GrammarCompiler:
    """Compiles constraints against one tokenizer's vocabulary, caching compiled grammars.
    Thread-safe: workers build requests off the engine thread."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 cache_limit_bytes: int = 256 << 20) -> None:
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        self._info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                        stop_token_ids=sorted(stop_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=True,
                                             cache_limit_bytes=cache_limit_bytes)
        self._lock = threading.Lock()

    def state(self, constraint: StructuredOutput) -> GrammarState:
        """A fresh state for `constraint` (at the start of the output)."""
        xgr = _xgrammar()
        with self._lock:
            try:
                compiled = self._compiler.compile_grammar(constraint.grammar_object())
            except RuntimeError as exc:
                raise ValueError(f"cannot compile the {constraint.kind} constraint: {_native_message(exc)}") from None
        state = GrammarState(xgr.GrammarMatcher(compiled), self.vocab_size)
        if state.allows_nothing:  # e.g. a regex no string matches, or `root ::= root`
            raise ValueError(f"the {constraint.kind} constraint matches no text: no output can satisfy it")
        return state
