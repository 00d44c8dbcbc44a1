"""From a decode worker's TokenChunks to OpenAI output: text deltas, SSE events, whole bodies.

`OutputAssembler` owns one request's output: it detokenizes incrementally (never half a UTF-8
character), applies stop strings (`engine.detokenizer.IncrementalDetokenizer`), and counts
tokens. When a stop string matches, the request is over for the client even though the worker
would go on: the caller aborts the worker (`Generation.abort`).

`sse_events` and `collect` drive a response's started choices (`ChoiceStream`: a `Generation`
each; several with `n` > 1) to their end and render them as SSE lines or as one response body. With tools (router/tools.py), an output that is a tool call is never
streamed as content: its text is held until it can be told apart from a plain answer, and a
complete call is sent as `tool_calls` at the end (finish_reason "tool_calls", or "stop" when
`tool_choice` named the function, as OpenAI does); a call cut by max_tokens is sent as text.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from router import protocol
from router.dispatch import ClientGone, Generation
from router.errors import APIError, upstream_failed
from router.logprobs import TextOffsets, TokenText, chat_logprobs, completion_logprobs
from router.tools import ToolPlan

FINISH_REASONS = ("stop", "length")


@dataclass
class OutputEvent:
    text: str
    logprob_entries: list[Any] = field(default_factory=list)
    finish_reason: str | None = None


class OutputAssembler:
    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params)
        self._want_logprobs = params.logprobs is not None
        self._per_token = bool(params.stop)  # to know exactly which token completed a stop string
        self.prompt_token_ids = list(prompt_token_ids)
        self.prompt_logprobs: list[Any] = []  # wire TokenLogprobs of prompt tokens 1.. (with prompt_logprobs)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_cached_tokens = 0
        self.output_token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stopped_by_string = False

    @property
    def num_completion_tokens(self) -> int:
        return len(self.output_token_ids)

    def add(self, chunk: Any) -> OutputEvent:
        """Consume one TokenChunk; raises APIError (502) when the worker reports a failure."""
        if self.finish_reason is not None:
            return OutputEvent("")
        if chunk.finish_reason == "error":
            raise upstream_failed(f"the decode worker failed the request: {chunk.error or 'no details'}")
        if chunk.finish_reason == "abort":
            raise upstream_failed("the decode worker aborted the request")
        if chunk.finish_reason and chunk.finish_reason not in FINISH_REASONS:
            raise upstream_failed(f"the decode worker sent an unknown finish reason {chunk.finish_reason!r}")
        self.num_cached_tokens = max(self.num_cached_tokens, chunk.num_cached_tokens)
        if chunk.prompt_logprobs:
            self.prompt_logprobs = list(chunk.prompt_logprobs)
        token_ids = list(chunk.token_ids)
        final = bool(chunk.finish_reason)
        groups = [[t] for t in token_ids] if self._per_token and token_ids else [token_ids]
        # "stop" from the worker is an EOS or a stop token id (stop strings are the router's)
        stop_token = chunk.finish_reason == "stop"
        taken, text, stopped = 0, "", False
        for index, group in enumerate(groups):
            last = index == len(groups) - 1
            delta = self._detokenizer.add_tokens(group, final=final and last, stop_token=stop_token and last)
            taken += len(group)
            text += delta.new_text
            if delta.stopped:
                stopped = True
                break
        self.output_token_ids.extend(token_ids[:taken])
        entries = list(chunk.logprobs)[:taken] if self._want_logprobs else []
        self.text += text
        self.stopped_by_string = stopped
        self.finish_reason = "stop" if stopped else (chunk.finish_reason or None)
        return OutputEvent(text, entries, self.finish_reason)

    @property
    def usage(self) -> dict[str, Any]:
        return protocol.usage_dict(self.num_prompt_tokens, self.num_completion_tokens, self.num_cached_tokens)


@dataclass
class ResponseContext:
    """What rendering needs besides the output itself."""
    endpoint: protocol.Endpoint
    request_id: str
    model: str
    created: int
    token_text: TokenText
    want_logprobs: bool = False
    include_usage: bool = False
    tool_plan: ToolPlan | None = None
    echo: bool = False  # completions: each choice's prompt (`ChoiceStream.echoed`) comes first
    no_output: bool = False  # echo with max_tokens 0: the generated token is not returned
    want_prompt_logprobs: bool = False  # vLLM's prompt_logprobs field on each choice

    def tool_result(self, assembler: "OutputAssembler") -> tuple[dict[str, Any] | None, str | None]:
        """(the tool call, the finish reason to report) for a finished output; no call when the
        output is not a whole one (plain text, or cut short: then it is returned as text)."""
        plan = self.tool_plan
        call = plan.parse(assembler.text) if plan is not None and plan.is_call(assembler.text) else None
        if call is None:
            return None, assembler.finish_reason
        return call, "stop" if plan.mode == "named" else "tool_calls"

    def streams_text(self, text: str) -> bool:
        """Whether the output so far may be sent as content (not a tool call, or not yet known)."""
        return self.tool_plan is None or self.tool_plan.is_call(text) is False

    def logprobs(self, entries: list[Any], offsets: int | TextOffsets) -> Any:
        """`entries` rendered for the endpoint; completions' offsets start at `offsets` in the
        returned text (after an echoed prompt), or run on from a stream's `TextOffsets`."""
        if not self.want_logprobs:
            return None
        if self.endpoint == "completions":
            return completion_logprobs(self.token_text, entries, offsets)
        return chat_logprobs(self.token_text, entries)


async def drive(generation: Generation, assembler: OutputAssembler, first_chunk: Any) -> AsyncIterator[OutputEvent]:
    """Feed the Generate stream through the assembler until the request finishes."""
    chunk = first_chunk
    while True:
        if chunk is None:
            raise upstream_failed("the decode worker closed the stream before the request finished")
        event = assembler.add(chunk)
        yield event
        if event.finish_reason:
            if assembler.stopped_by_string:
                generation.abort()
            return
        chunk = await generation.next_chunk()


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


@dataclass
class ChoiceStream:
    """One choice of a response: its Generation (started: `first_chunk` is its first TokenChunk)
    and its output. A request with `n` > 1, `best_of` or a batch of prompts has one per sequence
    (router/choices.py); `prompt_index` is its prompt's place in the batch, `echoed` the text
    that echo returns before its output ("" without echo)."""
    index: int
    generation: Generation
    assembler: OutputAssembler
    first_chunk: Any
    prompt_index: int = 0
    echoed: str = ""
    finish_reason: str = "abort"  # what close() reports unless the choice completes (the client went away)

    def close(self) -> None:
        self.generation.close(self.finish_reason, self.assembler.output_token_ids, self.assembler.num_cached_tokens)


def usage(choices: Sequence[ChoiceStream], no_output: bool = False) -> dict[str, Any]:
    """Usage of a whole response: each prompt once (prefilled once), every choice's tokens."""
    firsts = [group[0].assembler for group in _by_prompt(choices)]
    completion = 0 if no_output else sum(c.assembler.num_completion_tokens for c in choices)
    return protocol.usage_dict(sum(a.num_prompt_tokens for a in firsts), completion,
                               sum(a.num_cached_tokens for a in firsts))


def _by_prompt(choices: Sequence[ChoiceStream]) -> list[list[ChoiceStream]]:
    """The choices grouped by prompt, in prompt order."""
    groups: dict[int, list[ChoiceStream]] = {}
    for choice in choices:
        groups.setdefault(choice.prompt_index, []).append(choice)
    return [groups[index] for index in sorted(groups)]


async def _choice_chunks(ctx: ResponseContext, choice: ChoiceStream) -> AsyncIterator[dict[str, Any]]:
    """One choice's stream chunks: text as it becomes final, except what may still turn out to be
    a tool call, which is held (with its logprobs) until that is known."""
    args = (ctx.endpoint, ctx.request_id, ctx.model, ctx.created)
    assembler, index = choice.assembler, choice.index
    prompt_entries = list(choice.first_chunk.prompt_logprobs)
    if ctx.endpoint == "chat" or ctx.echo or ctx.want_prompt_logprobs:
        # First: the assistant role (chat), the echoed prompt (completions; "" without echo), the
        # prompt's logprobs.
        if ctx.endpoint == "chat":
            text = "" if ctx.tool_plan is None else None
        else:
            text = choice.echoed
        logprobs = (echo_logprobs(ctx.token_text, choice.echoed, assembler.prompt_token_ids, prompt_entries, [])
                    if ctx.echo and ctx.want_logprobs else None)
        chunk = protocol.stream_chunk(*args, text, None, logprobs, first=ctx.endpoint == "chat", index=index)
        if ctx.want_prompt_logprobs:
            chunk["choices"][0]["prompt_logprobs"] = prompt_logprobs_field(ctx.token_text, prompt_entries)
        yield chunk
    # `sent`: characters of text sent; `offsets`: where the next logprob entry's token starts (its
    # text may still be held: the offsets run on over the tokens, as in a whole body)
    sent, held, offsets = 0, [], TextOffsets(ctx.token_text, len(choice.echoed))
    try:
        async for event in drive(choice.generation, assembler, choice.first_chunk):
            held.extend(event.logprob_entries)
            if ctx.no_output:  # echo with max_tokens 0: the prompt alone
                if event.finish_reason:
                    yield protocol.stream_chunk(*args, "", "length", None, index=index)
                continue
            if event.finish_reason:
                call, reason = ctx.tool_result(assembler)
                rest = "" if call is not None else assembler.text[sent:]
                text = rest if rest or ctx.endpoint == "completions" else None
                logprobs = ctx.logprobs(held, offsets) if held and call is None else None
                yield protocol.stream_chunk(*args, text, reason, logprobs, tool_call=call, index=index)
            elif ctx.streams_text(assembler.text) and (len(assembler.text) > sent or held):
                yield protocol.stream_chunk(*args, assembler.text[sent:], None, ctx.logprobs(held, offsets),
                                            index=index)
                sent, held = len(assembler.text), []
    except APIError:
        choice.finish_reason = "error"
        raise
    choice.finish_reason = ctx.tool_result(assembler)[1] or "error"


async def interleaved_chunks(ctx: ResponseContext, choices: Sequence[ChoiceStream]) -> AsyncIterator[dict[str, Any]]:
    """Every choice's chunks as they come (one choice: its own stream, no task). The first failure
    (APIError, ClientGone) is raised here and ends the others. `sse_events` sends them as they are;
    router/responses.py says them again as the Responses API's events. The caller closes the
    choices."""
    if len(choices) == 1:
        async for chunk in _choice_chunks(ctx, choices[0]):
            yield chunk
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(choice: ChoiceStream) -> None:
        try:
            async for chunk in _choice_chunks(ctx, choice):
                queue.put_nowait(chunk)
            queue.put_nowait(done)
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(pump(choice)) for choice in choices]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def sse_events(ctx: ResponseContext, choices: Sequence[ChoiceStream]) -> AsyncIterator[str]:
    """The SSE body: each choice's chunks as its text becomes final (choices interleaved, told
    apart by `index`), then usage (if asked), then `data: [DONE]`. A failure after the stream
    began is sent as an `{"error": ...}` event before [DONE]."""
    args = (ctx.endpoint, ctx.request_id, ctx.model, ctx.created)
    try:
        try:
            async for chunk in interleaved_chunks(ctx, choices):
                yield sse(chunk)
        except APIError as exc:
            yield sse(exc.body())
            yield sse("[DONE]")
            return
        if ctx.include_usage:
            yield sse(protocol.usage_chunk(*args, usage(choices, ctx.no_output)))
        yield sse("[DONE]")
    except ClientGone:
        return
    finally:
        for choice in choices:
            choice.close()


async def _collect_choice(ctx: ResponseContext, choice: ChoiceStream) -> list[Any]:
    """Drive one choice to its end; its logprob entries."""
    entries: list[Any] = []
    try:
        async for event in drive(choice.generation, choice.assembler, choice.first_chunk):
            entries.extend(event.logprob_entries)
    except APIError:
        choice.finish_reason = "error"
        raise
    choice.finish_reason = ctx.tool_result(choice.assembler)[1] or "error"
    return entries


async def collect(ctx: ResponseContext, choices: Sequence[ChoiceStream], keep: int | None = None) -> dict[str, Any]:
    """The whole (non-streaming) response body; APIError / ClientGone propagate. With `keep`
    below the number of choices per prompt (`best_of`), each prompt's `keep` with the highest
    cumulative logprob (their generations must have asked for logprobs), best first, as choices
    `prompt_index * keep + rank`."""
    tasks = [asyncio.ensure_future(_collect_choice(ctx, choice)) for choice in choices]
    try:
        entries = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for choice in choices:
            choice.close()
    entries_of = {id(choice): choice_entries for choice, choice_entries in zip(choices, entries)}
    ranked: list[tuple[int, ChoiceStream]] = []
    for group in _by_prompt(choices):
        if keep is not None and keep < len(group):
            best = sorted(group, key=lambda c: -sum(entry.logprob for entry in entries_of[id(c)]))[:keep]
            ranked += [(c.prompt_index * keep + rank, c) for rank, c in enumerate(best)]
        else:
            ranked += [(c.index, c) for c in group]
    body_choices = []
    for index, choice in ranked:
        assembler = choice.assembler
        call, reported_finish = ctx.tool_result(assembler)
        text = "" if ctx.no_output else assembler.text
        shown = [] if ctx.no_output else entries_of[id(choice)]
        if ctx.echo:
            logprobs = (echo_logprobs(ctx.token_text, choice.echoed, assembler.prompt_token_ids,
                                      assembler.prompt_logprobs, shown) if ctx.want_logprobs else None)
            text = choice.echoed + text
        else:
            logprobs = ctx.logprobs(shown, 0) if call is None else None
        body = protocol.completion_choice(ctx.endpoint, index, text,
                                          "length" if ctx.no_output else reported_finish, logprobs, call)
        if ctx.want_prompt_logprobs:
            body["prompt_logprobs"] = prompt_logprobs_field(ctx.token_text, assembler.prompt_logprobs)
        body_choices.append(body)
    return protocol.completion_body(ctx.endpoint, ctx.request_id, ctx.model, ctx.created, body_choices,
                                    usage(choices, ctx.no_output))


def echo_logprobs(token_text: TokenText, echoed: str, prompt_token_ids: Sequence[int],
                  prompt_entries: Sequence[Any], entries: Sequence[Any]) -> dict[str, Any]:
    """Completions' `logprobs` with echo: the prompt's tokens first (the first one has no logprob:
    nothing predicts it; the others are `prompt_entries`), then the output's `entries`, text
    offsets running through both (the output's start after `echoed`, the prompt's text)."""
    first = token_text.token_str(prompt_token_ids[0])
    offsets = TextOffsets(token_text)
    if echoed.startswith(first):  # (a BOS the tokenizer added is not in the text as sent: no characters)
        offsets.take(prompt_token_ids[0])
    prompt = completion_logprobs(token_text, prompt_entries, offsets)
    output = completion_logprobs(token_text, entries, len(echoed))
    head = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
    return {key: head[key] + prompt[key] + output[key] for key in head}


def prompt_logprobs_field(token_text: TokenText, entries: Sequence[Any]) -> list[Any]:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else {token id: {"logprob",
    "decoded_token"}} for the prompt's token and the top k there."""
    def item(token_id: int, logprob: float) -> tuple[str, dict[str, Any]]:
        return str(token_id), {"logprob": logprob, "decoded_token": token_text.token_str(token_id)}

    return [None] + [dict([item(entry.token_id, entry.logprob), *(item(t.token_id, t.logprob) for t in entry.top)])
                     for entry in entries]
