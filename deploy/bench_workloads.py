"""Serving workloads for `pdserve bench` (deploy/bench.py; also benchmarks/serve.py and the other
benchmark scripts, through benchmarks/workloads.py): seeded, real text, sized in approximate tokens.

A workload is a list of conversations; a conversation is a list of turns sent one after the
other (each turn appends its content to the history, then the model's reply). Single-request
workloads are conversations of one turn.

  random        fixed input / output lengths, random word text
  chat          a synthetic ShareGPT-like mix: log-normal input and output lengths from the seed,
                clipped to the model's context (no download)
  interference  steady short chat streams; every `long_every`-th arrival is a long prompt with a
                short answer (it shows how a long prefill stalls the decodes that share its worker)
  agent         conversations of `agent_turns` turns: a long system prompt with a tool schema that
                every conversation shares, then per turn a tool result and a short reply, with an
                exponential think time between a reply and the next turn
  code_edit     a Python function (seeded, 12-24 lines) and a small edit to make (rename a variable):
                the answer repeats most of the code, what speculative decoding by prompt lookup is for
  json_echo     a JSON record (seeded) to return with one field changed: an answer that copies its prompt

Text is drawn from common English words, most of them one token in the usual BPE vocabularies
(SmolLM2's included), so a prompt of N words is close to N tokens: about 1.1 N with capitals and
full stops, plus ~30 for the chat template (SmolLM2: 1536 words are 1708-1710 tokens). The context
check (`WorkloadConfig.check_fits`) counts `estimated_prompt_tokens(N)` = 1.15 N + 48, so a workload
too long for the server is refused before anything is sent; the server's usage reports the exact
counts. Output lengths are exact when the server honours `ignore_eos`.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

WORKLOADS = ("random", "chat", "interference", "agent", "code_edit", "json_echo")

COMMON_WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there would their we him been has when who will more no if out so said what up its "
    "about into than them can only other new some could time these two may then do first any my now such like "
    "our over man me even most made after also did many before must through back years where much your way well "
    "down should because each just those people how too little state good very make world still own see men "
    "work long get here between both life being under never day same another know while last might us great old "
    "year off come since against go came right used take three"
).split()

TOOL_SCHEMA = """Tools you can call, one per reply, as JSON on a single line:
{"name": "search_files", "description": "find files whose contents match a pattern",
 "parameters": {"pattern": "string", "path": "string", "max_results": "integer"}}
{"name": "read_file", "description": "read a file, optionally a range of lines",
 "parameters": {"path": "string", "start_line": "integer", "end_line": "integer"}}
{"name": "run_command", "description": "run a shell command and return its output",
 "parameters": {"command": "string", "timeout_seconds": "integer"}}
{"name": "edit_file", "description": "replace one exact string in a file",
 "parameters": {"path": "string", "old": "string", "new": "string"}}
"""


TOKENS_PER_WORD = 1.15  # measured ~1.1 (SmolLM2's tokenizer), with a margin
CHAT_TEMPLATE_TOKENS = 48  # measured ~30 (SmolLM2's template, its default system prompt included)


def estimated_prompt_tokens(words: int) -> int:
    """A prompt of `words` words (TextMaker's, or any size counted as such) in tokens, chat template
    included: an upper estimate, ceil(1.15 x words) + 48, never below what BPE tokenizers give."""
    return math.ceil(TOKENS_PER_WORD * words) + CHAT_TEMPLATE_TOKENS


def max_prompt_words(tokens: int) -> int:
    """The most words whose estimated prompt (estimated_prompt_tokens) fits in `tokens`; 0 if none."""
    words = max(0, math.floor((tokens - CHAT_TEMPLATE_TOKENS) / TOKENS_PER_WORD))
    while words and estimated_prompt_tokens(words) > tokens:
        words -= 1
    return words


@dataclass(frozen=True)
class Turn:
    """One request of a conversation: the new message, its reply budget, and when to send it."""
    content: str
    max_tokens: int
    approx_new_tokens: int
    think_time_s: float = 0.0  # wait between the previous reply and this turn
    tag: str = ""


@dataclass
class Conversation:
    conversation_id: int
    turns: list[Turn]
    system_prompt: str | None = None


@dataclass
class Workload:
    name: str
    conversations: list[Conversation]
    description: str = ""

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)


@dataclass
class WorkloadConfig:
    """Every knob of every workload (token counts are approximate input sizes)."""
    max_model_len: int = 2048
    # random
    input_len: int = 128
    output_len: int = 32
    # chat: log-normal lengths (median, sigma), clipped
    chat_input_median: int = 96
    chat_input_sigma: float = 0.9
    chat_input_max: int = 1024
    chat_output_median: int = 48
    chat_output_sigma: float = 0.6
    chat_output_max: int = 192
    # interference
    short_input_len: int = 64
    short_output_len: int = 64
    long_input_len: int = 1536
    long_output_len: int = 4
    long_every: int = 8
    # agent
    agent_turns: int = 6
    agent_system_tokens: int = 768
    agent_tool_result_tokens: int = 96
    agent_reply_tokens: int = 16
    agent_think_time_s: float = 0.5
    agent_shared_system_prompt: bool = True
    # code_edit and json_echo: the answer's budget (the edited code or record, and some words)
    edit_output_len: int = 320
    json_output_len: int = 224

    def __post_init__(self) -> None:
        positive = ("max_model_len", "input_len", "output_len", "chat_input_median", "chat_input_max",
                    "chat_output_median", "chat_output_max", "short_input_len", "short_output_len",
                    "long_input_len", "long_output_len", "long_every", "agent_turns", "agent_system_tokens",
                    "agent_tool_result_tokens", "agent_reply_tokens", "edit_output_len", "json_output_len")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("chat_input_sigma", "chat_output_sigma", "agent_think_time_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.long_every < 2:
            raise ValueError(f"long_every must be >= 2 (one long prompt per that many arrivals), got {self.long_every}")

    def request_sizes(self, workload: str) -> list[tuple[str, int, int]]:
        """(what, prompt words, output tokens) of `workload`'s largest requests. Prompt sizes given
        in tokens (the agent's system prompt, code and records) count as words: an overestimate."""
        turns = self.agent_turns
        sizes = {"random": [("input_len + output_len", self.input_len, self.output_len)],
                 "chat": [("8 input words (the least chat sends) + chat_output_max", 8, self.chat_output_max)],
                 "interference": [("long_input_len + long_output_len", self.long_input_len, self.long_output_len),
                                  ("short_input_len + short_output_len", self.short_input_len,
                                   self.short_output_len)],
                 # every turn: its tool result and ~16 words around it; the replies are history
                 "agent": [("the agent's last turn (system + turns x (tool result + reply))",
                            self.agent_system_tokens + turns * (self.agent_tool_result_tokens + 16),
                            turns * self.agent_reply_tokens)],
                 "code_edit": [("the function twice (prompt and answer)", self.edit_output_len,
                                self.edit_output_len)],
                 "json_echo": [("the record twice (prompt and answer)", self.json_output_len, self.json_output_len)]}
        return sizes[workload]

    def check_fits(self, workload: str) -> None:
        """ValueError when one of `workload`'s requests may not fit the context: its estimated
        prompt (estimated_prompt_tokens, an upper estimate) plus its output tokens above
        max_model_len. Chat clips its inputs to fit instead."""
        for what, words, output in self.request_sizes(workload):
            tokens = estimated_prompt_tokens(words) + output
            if tokens > self.max_model_len:
                raise ValueError(f"{what} is up to about {tokens} tokens ({words} words of prompt at "
                                 f"{TOKENS_PER_WORD:g} tokens each plus {CHAT_TEMPLATE_TOKENS} for the chat "
                                 f"template, {output} out), more than the context allows (max_model_len "
                                 f"{self.max_model_len})")


class TextMaker:
    """Seeded sentences of common words: `words(n)` is about n tokens of real text."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def words(self, n: int) -> str:
        out: list[str] = []
        while len(out) < n:
            sentence = [self._rng.choice(COMMON_WORDS) for _ in range(min(n - len(out), self._rng.randint(6, 16)))]
            sentence[0] = sentence[0].capitalize()
            sentence[-1] += "."
            out.extend(sentence)
        return " ".join(out)


def build_workload(name: str, num_requests: int, config: WorkloadConfig | None = None, seed: int = 0) -> Workload:
    """`num_requests` requests in total (agent: whole conversations of `agent_turns`, at least one)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    if not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests must be a positive integer, got {num_requests!r}")
    config = config or WorkloadConfig()
    config.check_fits(name)
    rng = random.Random(seed)
    builders = {"random": _random, "chat": _chat, "interference": _interference, "agent": _agent,
                "code_edit": _code_edit, "json_echo": _json_echo}
    return builders[name](num_requests, config, rng)


def _single(conversation_id: int, text: str, max_tokens: int, approx: int, tag: str) -> Conversation:
    return Conversation(conversation_id, [Turn(text, max_tokens, approx, tag=tag)])


def _random(n: int, config: WorkloadConfig, rng: random.Random) -> Workload:
    text = TextMaker(rng)
    conversations = [_single(i, text.words(config.input_len), config.output_len, config.input_len, "random")
                     for i in range(n)]
    return Workload("random", conversations, f"{n} requests, ~{config.input_len} tokens in, "
                                             f"{config.output_len} out")


def _lognormal(rng: random.Random, median: int, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, int(round(median * math.exp(rng.gauss(0.0, sigma))))))


def _chat(n: int, config: WorkloadConfig, rng: random.Random) -> Workload:
    text = TextMaker(rng)
    conversations = []
    for i in range(n):
        output_len = _lognormal(rng, config.chat_output_median, config.chat_output_sigma, 4, config.chat_output_max)
        input_cap = min(config.chat_input_max, max_prompt_words(config.max_model_len - output_len))
        input_len = _lognormal(rng, config.chat_input_median, config.chat_input_sigma, 8, input_cap)
        conversations.append(_single(i, text.words(input_len), output_len, input_len, "chat"))
    return Workload("chat", conversations,
                    f"{n} requests, log-normal lengths: input median {config.chat_input_median} "
                    f"(sigma {config.chat_input_sigma}, max {config.chat_input_max}), output median "
                    f"{config.chat_output_median} (sigma {config.chat_output_sigma}, max {config.chat_output_max})")


def _interference(n: int, config: WorkloadConfig, rng: random.Random) -> Workload:
    text = TextMaker(rng)
    conversations = []
    for i in range(n):
        if i % config.long_every == config.long_every // 2:
            conversations.append(_single(i, text.words(config.long_input_len), config.long_output_len,
                                         config.long_input_len, "long"))
        else:
            conversations.append(_single(i, text.words(config.short_input_len), config.short_output_len,
                                         config.short_input_len, "short"))
    return Workload("interference", conversations,
                    f"{n} requests: short ~{config.short_input_len} in / {config.short_output_len} out, and every "
                    f"{config.long_every}th a long ~{config.long_input_len} in / {config.long_output_len} out")


def agent_system_prompt(config: WorkloadConfig, rng: random.Random) -> str:
    """A system prompt of about `agent_system_tokens` tokens ending with the tool schema."""
    text = TextMaker(rng)
    schema_tokens = len(TOOL_SCHEMA.split()) * 3  # JSON punctuation splits into several tokens
    filler = max(16, config.agent_system_tokens - schema_tokens)
    return ("You are a coding agent working in a large repository. Follow these project notes. "
            + text.words(filler) + "\n\n" + TOOL_SCHEMA)


def _agent(n: int, config: WorkloadConfig, rng: random.Random) -> Workload:
    text = TextMaker(rng)
    shared = agent_system_prompt(config, rng)
    num_conversations = max(1, n // config.agent_turns)
    conversations = []
    for i in range(num_conversations):
        system = shared if config.agent_shared_system_prompt else agent_system_prompt(config, rng)
        turns = []
        for turn in range(config.agent_turns):
            task = f"Task {i}: fix the failing test in module {rng.randint(1, 999)}. " if turn == 0 else ""
            content = (f"{task}Tool result of call {turn + 1}:\n" + text.words(config.agent_tool_result_tokens)
                       + "\nWhat is the next tool call?")
            think = 0.0 if turn == 0 else rng.expovariate(1.0 / config.agent_think_time_s) \
                if config.agent_think_time_s > 0 else 0.0
            turns.append(Turn(content, config.agent_reply_tokens, config.agent_tool_result_tokens + 8,
                              think_time_s=think, tag=f"turn{turn}"))
        conversations.append(Conversation(i, turns, system_prompt=system))
    return Workload("agent", conversations,
                    f"{num_conversations} conversations x {config.agent_turns} turns: shared system prompt + tool "
                    f"schema ~{config.agent_system_tokens} tokens, tool results ~{config.agent_tool_result_tokens}, "
                    f"replies {config.agent_reply_tokens}, think time mean {config.agent_think_time_s} s")


_NAMES = ("total", "count", "items", "value", "result", "index", "offset", "record", "buffer", "limit", "price",
          "weight", "score", "name", "path", "line", "size", "state", "queue", "batch")
_VERBS = ("load", "parse", "merge", "update", "compute", "filter", "collect", "render", "check", "build")


def python_function(rng: random.Random) -> tuple[str, list[str]]:
    """A seeded Python function of 12-24 lines; returns it and the local names it uses."""
    names = rng.sample(_NAMES, 6)
    data, acc, item, key, limit, out = names
    lines = [f"def {rng.choice(_VERBS)}_{rng.choice(_NAMES)}({data}, {limit}={rng.randint(2, 64)}):",
             f'    """Return the {acc} of every {item} in {data} up to {limit}."""',
             f"    {acc} = 0", f"    {out} = []"]
    while len(lines) < rng.randint(12, 24) - 3:
        kind = rng.randrange(4)
        if kind == 0:
            lines += [f"    for {item} in {data}:", f"        if {item}.{key} > {limit}:", "            continue",
                      f"        {acc} += {item}.{key} * {rng.randint(2, 9)}"]
        elif kind == 1:
            lines += [f"    if {acc} > {limit}:", f"        {out}.append({acc})", f"        {acc} = {acc} // 2"]
        elif kind == 2:
            lines += [f"    {key} = [{item}.{rng.choice(_NAMES)} for {item} in {data} if {item}]"]
        else:
            lines += [f"    while len({out}) < {limit} and {acc}:", f"        {out}.append({acc} % {rng.randint(3, 17)})",
                      f"        {acc} -= 1"]
    lines += [f"    {out}.sort()", f"    return {acc}, {out}"]
    return "\n".join(lines) + "\n", [data, acc, item, limit, out]


def _code_edit(n: int, config: WorkloadConfig, rng: random.Random) -> Workload:
    conversations = []
    for i in range(n):
        code, names = python_function(rng)
        old = rng.choice(names)
        new = f"{old}_{rng.choice(_NAMES)}"
        content = (f"Rename the variable `{old}` to `{new}` in this function. Reply with the whole function "
                   f"and nothing else.\n\n```python\n{code}```")
        conversations.append(_single(i, content, config.edit_output_len, len(code) // 3, "code_edit"))
    return Workload("code_edit", conversations, f"{n} requests: rename a variable in a 12-24 line Python "
                                                f"function, up to {config.edit_output_len} tokens out")


def json_record(rng: random.Random) -> dict:
    text = TextMaker(rng)
    return {"id": rng.randint(1000, 99999), "name": text.words(2).rstrip("."), "status": "active",
            "owner": {"user": rng.choice(_NAMES), "team": rng.choice(_NAMES), "level": rng.randint(1, 9)},
            "tags": rng.sample(_NAMES, 4), "scores": [rng.randint(0, 100) for _ in range(5)],
            "created": f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
            "note": text.words(rng.randint(6, 14))}


def _json_echo(n: int, config: WorkloadConfig, rng: random.Random) -> Workload:
    import json
    conversations = []
    for i in range(n):
        record = json.dumps(json_record(rng), indent=2)
        content = ('Return this JSON object with "status" set to "archived" and everything else unchanged. '
                   f"Reply with the JSON only.\n\n{record}")
        conversations.append(_single(i, content, config.json_output_len, len(record) // 3, "json_echo"))
    return Workload("json_echo", conversations, f"{n} requests: return a JSON record with one field changed, "
                                                f"up to {config.json_output_len} tokens out")
