"""Serving benchmark for any OpenAI-compatible server (pdserve, vLLM, SGLang, ...).

Sends a workload (deploy/bench_workloads.py) with Poisson arrivals at --request-rate (requests per
second, or `inf`: all at once) and/or at most --max-concurrency requests in flight, streams every
response, and reports per request:

  TTFT   time to the first token (send -> first chunk carrying a token)
  ITL    every inter-token latency: the gap between chunks, split evenly over the tokens a chunk
         carries (a chunk of k tokens after a gap g gives k gaps of g/k; tokens that arrive with the
         first one get 0), so a request has exactly completion_tokens - 1 of them
  TPOT   (e2e - TTFT) / (completion_tokens - 1), the mean time per output token after the first
  E2E    send -> last byte; tokens in / out and cached prompt tokens from the stream's usage

Tokens per chunk are counted from the chunk's logprobs (`logprobs` is requested unless
--no-logprobs; one entry per token in the OpenAI API), otherwise one per non-empty text chunk.
The summary has mean / median / p90 / p99 / p99.9 of each, request and token throughput, and goodput:
requests per second that meet every --slo bound (e.g. `--slo ttft:500 tpot:50`, milliseconds).
For `agent`, --request-rate is the rate at which conversations start; their turns follow one
another, each after its think time.

    pdserve bench --base-url http://127.0.0.1:8000 --workload chat --request-rate 2 \\
        --num-requests 64 --slo ttft:1000 tpot:100 --json out.json
    python benchmarks/serve.py --base-url http://127.0.0.1:8000 ...   (the same program, from a checkout)

Part of the installed package (`pdserve bench` runs it in-process) and torch-free: the client
loads nothing of the engine (`run_metadata` asks `engine.cpu_kernels` for the CPU's name only when
a report is built). benchmarks/serve.py re-exports it for the scripts there; what every benchmark's record
shares is deploy/bench_record.py.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import httpx

from deploy.bench_record import REPO, percentile, run_metadata  # noqa: F401 (REPO: re-exported)
from deploy.bench_workloads import WORKLOADS, Conversation, Workload, WorkloadConfig, build_workload


ENDPOINTS = ("chat", "completions")
# p99.9: on a workload where streams rarely freeze (a long prompt prefilled beside them), the
# freezes can be under 1% of the intervals, so ITL p99 does not see them and p99.9 does.
PERCENTILES = (50, 90, 99, 99.9)


@dataclass
class SLO:
    """Latency bounds in milliseconds; None: not bounded."""
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"SLO {name} must be a positive number of milliseconds, got {value!r}")

    @classmethod
    def parse(cls, items: list[str] | None) -> "SLO":
        """From `ttft:MS` / `tpot:MS` items."""
        values: dict[str, float] = {}
        for item in items or []:
            key, sep, number = item.partition(":")
            if not sep or key not in ("ttft", "tpot"):
                raise ValueError(f"--slo takes ttft:MS and/or tpot:MS, got {item!r}")
            try:
                values[f"{key}_ms"] = float(number)
            except ValueError:
                raise ValueError(f"--slo {item!r}: {number!r} is not a number of milliseconds") from None
        return cls(**values)

    @property
    def is_set(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met_by(self, result: "RequestResult") -> bool:
        if not result.success:
            return False
        if self.ttft_ms is not None and result.ttft_s * 1000 > self.ttft_ms:
            return False
        tpot = result.tpot_s
        return self.tpot_ms is None or tpot is None or tpot * 1000 <= self.tpot_ms


@dataclass
class BenchConfig:
    """One benchmark run against one server."""
    base_url: str
    model: str | None = None  # None: the first model /v1/models lists
    api_key: str | None = None
    endpoint: str = "chat"
    request_rate: float = math.inf
    max_concurrency: int | None = None
    timeout_s: float | None = None  # the whole run; unfinished requests are cancelled and counted
    request_timeout_s: float = 600.0
    seed: int = 0
    slo: SLO = field(default_factory=SLO)
    ignore_eos: bool = True
    use_logprobs: bool = True
    temperature: float = 0.0
    show_progress: bool = True
    label: str = ""

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {self.base_url!r}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if not (self.request_rate > 0):
            raise ValueError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"--timeout must be > 0 seconds, got {self.timeout_s}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"--request-timeout must be > 0 seconds, got {self.request_timeout_s}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")

    @property
    def api_root(self) -> str:
        """The URL under which /chat/completions lives: base URL with /v1 (added when missing)."""
        root = self.base_url.rstrip("/")
        return root if root.endswith("/v1") else root + "/v1"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


NOT_SENT_BEFORE_TIMEOUT = "not sent before --timeout ended the run"
UNFINISHED_AT_TIMEOUT = "unfinished when --timeout ended the run"
EARLIER_TURN_FAILED = "not sent: an earlier turn of its conversation failed"


@dataclass
class RequestResult:
    """One planned request. Every request of the workload has one, sent or not: exactly one of
    success, incomplete (not finished: still running when --timeout ended the run, or never sent,
    `sent` False, with the reason in `error`) or failed (neither; `error` says why)."""
    conversation_id: int
    turn: int
    tag: str
    sent_at_s: float  # since the benchmark started; meaningless while `sent` is False
    success: bool = False
    incomplete: bool = False
    error: str = ""
    sent: bool = False
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    streamed_tokens: int = 0
    prompt_tokens: int | None = None  # None: the server sent no usage
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # None: the server did not report them (not 0)
    finish_reason: str | None = None
    text: str = ""

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.streamed_tokens

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def record(self) -> dict[str, Any]:
        """The JSON form (milliseconds, rounded; no text)."""
        def ms(value: float | None) -> float | None:
            return None if value is None else round(value * 1000, 3)
        return {"conversation_id": self.conversation_id, "turn": self.turn, "tag": self.tag,
                "sent": self.sent, "sent_at_s": round(self.sent_at_s, 4) if self.sent else None,
                "success": self.success, "incomplete": self.incomplete, "error": self.error,
                "ttft_ms": ms(self.ttft_s), "tpot_ms": ms(self.tpot_s), "e2e_ms": ms(self.e2e_s),
                "itl_ms": [ms(g) for g in self.itl_s], "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens,
                "streamed_tokens": self.streamed_tokens, "finish_reason": self.finish_reason}


# ---- one request --------------------------------------------------------------------------------

def build_payload(config: BenchConfig, model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": True,
                               "stream_options": {"include_usage": True}, "temperature": config.temperature}
    if config.endpoint == "chat":
        payload["messages"] = messages
        if config.use_logprobs:
            payload["logprobs"] = True
    else:
        payload["prompt"] = render_plain(messages)
        if config.use_logprobs:
            payload["logprobs"] = 0
    if config.ignore_eos:
        payload["ignore_eos"] = True
    if config.temperature > 0:
        payload["seed"] = config.seed
    return payload


def render_plain(messages: list[dict[str, str]]) -> str:
    """A conversation as one completions prompt."""
    parts = []
    for message in messages:
        role = message["role"]
        parts.append(message["content"] if role == "system" else f"{role.capitalize()}: {message['content']}")
    return "\n\n".join(parts) + "\n\nAssistant:"


def _chunk_tokens(choice: dict[str, Any], endpoint: str, use_logprobs: bool) -> tuple[int, str]:
    """(tokens in this chunk, its text)."""
    if endpoint == "chat":
        text = (choice.get("delta") or {}).get("content") or ""
    else:
        text = choice.get("text") or ""
    logprobs = choice.get("logprobs")
    if use_logprobs and logprobs:
        entries = logprobs.get("content") if endpoint == "chat" else logprobs.get("tokens")
        if entries is not None:
            return len(entries), text
    return (1 if text else 0), text


async def send_request(client: httpx.AsyncClient, config: BenchConfig, payload: dict[str, Any],
                       result: RequestResult, clock_start: float) -> None:
    """Stream one request into `result` (never raises, except on cancellation)."""
    url = f"{config.api_root}/{'chat/completions' if config.endpoint == 'chat' else 'completions'}"
    start = time.perf_counter()
    result.sent = True
    result.sent_at_s = start - clock_start
    texts: list[str] = []

    async def stream() -> bool:
        """Read the response into `result`; True when it ended with [DONE] (else result.error says why)."""
        last_token_at = start
        async with client.stream("POST", url, json=payload, headers=config.headers()) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", errors="replace")
                result.error = f"HTTP {response.status_code}: {_error_message(body)}"
                return False
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return True
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {_error_message(json.dumps(chunk))}"
                    return False
                now = time.perf_counter()
                for choice in chunk.get("choices") or []:
                    tokens, text = _chunk_tokens(choice, config.endpoint, config.use_logprobs)
                    texts.append(text)
                    if choice.get("finish_reason"):
                        result.finish_reason = choice["finish_reason"]
                    if tokens == 0:
                        continue
                    if result.ttft_s is None:
                        result.ttft_s = now - start
                        result.itl_s.extend([0.0] * (tokens - 1))
                    else:
                        result.itl_s.extend([(now - last_token_at) / tokens] * tokens)
                    last_token_at = now
                    result.streamed_tokens += tokens
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens")
                    result.completion_tokens = usage.get("completion_tokens")
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            result.error = "the stream ended without [DONE]"
            return False

    try:
        if not await within(config.request_timeout_s, stream()):
            return
        result.e2e_s = time.perf_counter() - start
        result.text = "".join(texts)
        if result.ttft_s is None:
            result.error = "the stream carried no token"
            return
        result.success = True
    except (TimeoutError, asyncio.TimeoutError):  # two classes before Python 3.11
        result.error = f"no complete response within --request-timeout {config.request_timeout_s:g} s"
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"


async def within(seconds: float, awaitable):
    """`await awaitable` with a time limit: TimeoutError (asyncio.TimeoutError before Python 3.11)
    when it runs longer. asyncio.timeout where there is one (3.11+), else asyncio.wait_for."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(seconds):
            return await awaitable
    return await asyncio.wait_for(awaitable, seconds)


def _error_message(body: str) -> str:
    try:
        error = json.loads(body).get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
    except (ValueError, AttributeError):
        pass
    return body.strip()[:300] or "(empty body)"


# ---- the run ------------------------------------------------------------------------------------

@dataclass
class RunOutcome:
    results: list[RequestResult]
    duration_s: float
    model: str
    max_model_len: int | None


async def discover_model(client: httpx.AsyncClient, config: BenchConfig) -> tuple[str, int | None]:
    """The model to send (config.model or the server's first) and its context length if the server says."""
    try:
        response = await client.get(f"{config.api_root}/models", headers=config.headers())
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {config.api_root}/models: {type(exc).__name__}: {exc}") from None
    if response.status_code != 200:
        if config.model:
            return config.model, None
        raise ValueError(f"GET {config.api_root}/models answered {response.status_code}: "
                         f"{_error_message(response.text)}; pass --model")
    cards = response.json().get("data") or []
    chosen = next((c for c in cards if c.get("id") == config.model), None) if config.model else \
        (cards[0] if cards else None)
    if chosen is None:
        if config.model:
            return config.model, None
        raise ValueError(f"{config.api_root}/models lists no model; pass --model")
    return chosen["id"], chosen.get("max_model_len")


def arrival_offsets(count: int, rate: float, rng: random.Random) -> list[float]:
    """Poisson arrivals: the first at 0, then exponential gaps of mean 1/rate (all 0 for inf)."""
    if math.isinf(rate):
        return [0.0] * count
    offsets, now = [], 0.0
    for index in range(count):
        if index:
            now += rng.expovariate(rate)
        offsets.append(now)
    return offsets


async def run_workload(config: BenchConfig, workload: Workload, model: str | None = None) -> RunOutcome:
    """Send every conversation of `workload` (arrivals, concurrency and timeouts as configured).
    The outcome has one result per planned request (workload.num_requests, in conversation and
    turn order), sent or not: a turn after a failed one is not sent (it would build on a reply
    that does not exist), and what --timeout cut off is unfinished or not sent (`incomplete`)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(config.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        if model is None:
            model, max_model_len = await discover_model(client, config)
        else:
            max_model_len = None
        rng = random.Random(config.seed)
        offsets = arrival_offsets(len(workload.conversations), config.request_rate, rng)
        semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        planned = [[RequestResult(c.conversation_id, index, turn.tag, 0.0) for index, turn in enumerate(c.turns)]
                   for c in workload.conversations]
        results = [result for conversation in planned for result in conversation]
        progress = _progress(workload.num_requests, config.show_progress, config.label or workload.name)
        clock_start = time.perf_counter()

        async def conversation_task(conversation: Conversation, offset: float, turn_results: list[RequestResult]) \
                -> None:
            await asyncio.sleep(max(0.0, clock_start + offset - time.perf_counter()))
            messages = [{"role": "system", "content": conversation.system_prompt}] if conversation.system_prompt \
                else []
            for index, (turn, result) in enumerate(zip(conversation.turns, turn_results)):
                if turn.think_time_s > 0:
                    await asyncio.sleep(turn.think_time_s)
                messages.append({"role": "user", "content": turn.content})
                payload = build_payload(config, model, list(messages), turn.max_tokens)
                if semaphore is None:
                    await send_request(client, config, payload, result, clock_start)
                else:
                    async with semaphore:
                        await send_request(client, config, payload, result, clock_start)
                progress.update(1)
                if not result.success:  # later turns would build on a reply that does not exist
                    for later in turn_results[index + 1:]:
                        later.incomplete, later.error = True, EARLIER_TURN_FAILED
                    progress.update(len(turn_results) - index - 1)
                    return
                messages.append({"role": "assistant", "content": result.text})

        tasks = [asyncio.create_task(conversation_task(c, o, r))
                 for c, o, r in zip(workload.conversations, offsets, planned)]
        try:
            done, pending = await asyncio.wait(tasks, timeout=config.timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for task in done:
                task.result()
        finally:
            progress.close()
        finished = [r.sent_at_s + r.e2e_s for r in results if r.e2e_s is not None]
        duration = max(finished) if finished else time.perf_counter() - clock_start
        if pending:
            duration = time.perf_counter() - clock_start
        for result in results:
            if not result.success and not result.error:
                result.incomplete = True
                result.error = UNFINISHED_AT_TIMEOUT if result.sent else NOT_SENT_BEFORE_TIMEOUT
        return RunOutcome(results, duration, model, max_model_len)


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, show: bool, label: str):
    if not show:
        return _NoProgress()
    from tqdm import tqdm
    return tqdm(total=total, desc=label, unit="req", dynamic_ncols=True, file=sys.stderr)


# ---- the report ---------------------------------------------------------------------------------

def distribution(values_s: list[float]) -> dict[str, float | None]:
    """mean / median / p90 / p99 / p99.9 / max in milliseconds (None when there are no values)."""
    if not values_s:
        return {"mean": None, **{_key(p): None for p in PERCENTILES}, "max": None, "count": 0}
    ms = sorted(v * 1000 for v in values_s)
    out: dict[str, float | None] = {"mean": statistics.fmean(ms)}
    for p in PERCENTILES:
        out[_key(p)] = percentile(ms, p)
    out["max"] = ms[-1]
    out["count"] = len(ms)
    return out


def _key(p: float) -> str:
    return "median" if p == 50 else f"p{p:g}"


def summarize(results: list[RequestResult], duration_s: float, slo: SLO) -> dict[str, Any]:
    """The run's numbers: `requests` = `completed` + `errors` (failed) + `incomplete` (unfinished
    at --timeout or never sent; `not_sent` of them never sent, `incomplete_reasons` counts each
    reason). Latencies and tokens are over the successful requests. `cached_tokens` and
    `prefix_cache_hit_rate` count only the requests whose server reported cached tokens; None when
    none did (a server that does not report them has an unknown hit rate, not 0)."""
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    reporting = [r for r in ok if r.cached_tokens is not None]
    cached_tokens = sum(r.cached_tokens for r in reporting) if reporting else None
    cached_of = sum(r.prompt_tokens or 0 for r in reporting)
    duration = max(duration_s, 1e-9)
    summary: dict[str, Any] = {
        "requests": len(results), "completed": len(ok),
        "errors": sum(1 for r in results if not r.success and not r.incomplete),
        "incomplete": sum(1 for r in results if r.incomplete),
        "not_sent": sum(1 for r in results if r.incomplete and not r.sent),
        "incomplete_reasons": dict(sorted(Counter(r.error for r in results if r.incomplete).items())),
        "duration_s": duration_s,
        "input_tokens": input_tokens, "output_tokens": output_tokens, "cached_tokens": cached_tokens,
        "prefix_cache_hit_rate": cached_tokens / cached_of if cached_tokens is not None and cached_of else None,
        "request_throughput": len(ok) / duration, "output_token_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "goodput": sum(1 for r in ok if slo.met_by(r)) / duration if slo.is_set else None,
        "slo": asdict(slo),
        "ttft_ms": distribution([r.ttft_s for r in ok]),
        "tpot_ms": distribution([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": distribution([g for r in ok for g in r.itl_s]),
        "e2e_ms": distribution([r.e2e_s for r in ok]),
    }
    errors = sorted({r.error for r in results if r.error and not r.incomplete})
    summary["error_messages"] = errors[:10]
    return summary


def summarize_by_tag(results: list[RequestResult], duration_s: float, slo: SLO) -> dict[str, dict[str, Any]]:
    tags = sorted({r.tag for r in results})
    if len(tags) < 2:
        return {}
    return {tag: summarize([r for r in results if r.tag == tag], duration_s, slo) for tag in tags}


def build_report(config: BenchConfig, workload: Workload, outcome: RunOutcome) -> dict[str, Any]:
    """The run's report: what was run (`run`: commit, CPU, command line, time, Python; the sampling
    settings sent; the limits), its summary, the summary per tag, and every planned request."""
    return {
        "label": config.label, "base_url": config.base_url, "endpoint": config.endpoint, "model": outcome.model,
        "workload": workload.name, "workload_description": workload.description,
        "request_rate": None if math.isinf(config.request_rate) else config.request_rate,
        "max_concurrency": config.max_concurrency, "seed": config.seed, "num_requests": workload.num_requests,
        "sampling": {"temperature": config.temperature, "ignore_eos": config.ignore_eos,
                     "logprobs": config.use_logprobs},
        "timeout_s": config.timeout_s, "request_timeout_s": config.request_timeout_s,
        "run": run_metadata(),
        "summary": summarize(outcome.results, outcome.duration_s, config.slo),
        "by_tag": summarize_by_tag(outcome.results, outcome.duration_s, config.slo),
        "requests": [r.record() for r in outcome.results],
    }


def run_benchmark(config: BenchConfig, workload_name: str, num_requests: int,
                  workload_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Build the workload (WorkloadConfig fields in `workload_options`; max_model_len defaults to the
    context the server reports), run it, and return the report."""
    async def go() -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=30.0) as client:
            model, max_model_len = await discover_model(client, config)
        options = dict(workload_options or {})
        if max_model_len and "max_model_len" not in options:
            options["max_model_len"] = max_model_len
        workload = build_workload(workload_name, num_requests, WorkloadConfig(**options), config.seed)
        outcome = await run_workload(config, workload, model)
        outcome.max_model_len = max_model_len
        return build_report(config, workload, outcome)
    return asyncio.run(go())


def format_report(report: dict[str, Any]) -> str:
    s = report["summary"]
    rate = "inf" if report["request_rate"] is None else f"{report['request_rate']:g}"
    width = 76
    lines = [f" {report['label'] or 'Serving benchmark'} ".center(width, "="),
             f"workload: {report['workload']} ({report['workload_description']})",
             f"model: {report['model']}   request rate: {rate}/s   max concurrency: "
             f"{report['max_concurrency'] or '-'}   endpoint: {report['endpoint']}"]

    def row(name: str, value: Any) -> None:
        lines.append(f"{name:<56}{str(value):>20}")
    row("Requests planned:", s["requests"])
    row("Successful requests:", s["completed"])
    row("Failed requests:", s["errors"])
    row("Unfinished or not sent:", s["incomplete"])
    for reason, count in s["incomplete_reasons"].items():
        row(f"  {reason}:", count)
    row("Duration (s):", f"{s['duration_s']:.2f}")
    cached = "-" if s["cached_tokens"] is None else s["cached_tokens"]
    row("Input tokens (cached):", f"{s['input_tokens']} ({cached})")
    hit_rate = s["prefix_cache_hit_rate"]
    row("Prefix cache hit rate:", "-" if hit_rate is None else f"{100 * hit_rate:.1f}%")
    row("Output tokens:", s["output_tokens"])
    row("Request throughput (req/s):", f"{s['request_throughput']:.3f}")
    if s["goodput"] is not None:
        slo = ", ".join(f"{k[:-3]} <= {v:g} ms" for k, v in s["slo"].items() if v is not None)
        row(f"Goodput (req/s, {slo}):", f"{s['goodput']:.3f}")
    row("Output token throughput (tok/s):", f"{s['output_token_throughput']:.2f}")
    row("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")
    lines.append("-" * width)
    columns = (("mean", 10), ("median", 10), ("p90", 10), ("p99", 10), ("p99.9", 10), ("max", 12))
    lines.append(f"{'(ms)':<14}" + "".join(f"{k:>{w}}" for k, w in columns))
    for key, title in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        d = s[key]
        cells = "".join(f"{'-' if d[k] is None else format(d[k], '.1f'):>{w}}"
                        for k, w in columns)
        lines.append(f"{title:<14}{cells}")
    for tag, tagged in report["by_tag"].items():
        t, p = tagged["ttft_ms"], tagged["tpot_ms"]
        lines.append(f"  [{tag}] n={tagged['completed']}  TTFT median {_fmt(t['median'])} p99 {_fmt(t['p99'])}  "
                     f"TPOT median {_fmt(p['median'])} p99 {_fmt(p['p99'])}")
    for message in s["error_messages"]:
        lines.append(f"error: {message}")
    lines.append("=" * width)
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


# ---- command line -------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL (with or without /v1)")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--endpoint", default="chat", choices=ENDPOINTS, help="default chat")
    parser.add_argument("--workload", default="chat", choices=WORKLOADS, help="default chat")
    parser.add_argument("--num-requests", type=int, default=64,
                        help="requests in all (agent: turns in all, in whole conversations); default 64")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="Poisson arrivals per second (agent: conversation starts); inf: all at once")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--timeout", type=float, default=None, help="end the run after this many seconds")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="one request's limit (s); default 600")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo", nargs="+", default=None, metavar="KIND:MS", help="e.g. ttft:500 tpot:50")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (for servers "
                                                                     "that refuse it); output lengths vary")
    parser.add_argument("--no-logprobs", action="store_true",
                        help="do not request logprobs; count one token per non-empty text chunk")
    parser.add_argument("--json", type=Path, default=None, help="write the report (with every request) here")
    parser.add_argument("--label", default="", help="a name for this run in the report")
    parser.add_argument("--no-progress", action="store_true")
    group = parser.add_argument_group("workload shape (approximate token counts)")
    for f in fields(WorkloadConfig):
        group.add_argument("--" + f.name.replace("_", "-"), type=_bool_arg if f.type == "bool" else
                           (int if f.type == "int" else float), default=None,
                           help=f"default {f.default}{' (or the server-reported context)' if f.name == 'max_model_len' else ''}")
    return parser


def _bool_arg(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = BenchConfig(base_url=args.base_url, model=args.model, api_key=args.api_key, endpoint=args.endpoint,
                             request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                             timeout_s=args.timeout, request_timeout_s=args.request_timeout, seed=args.seed,
                             slo=SLO.parse(args.slo), ignore_eos=not args.no_ignore_eos,
                             use_logprobs=not args.no_logprobs, temperature=args.temperature,
                             show_progress=not args.no_progress, label=args.label)
        if args.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
        overrides = {f.name: getattr(args, f.name) for f in fields(WorkloadConfig)
                     if getattr(args, f.name) is not None}
        report = run_benchmark(config, args.workload, args.num_requests, overrides)
    except ValueError as exc:
        print(f"pdserve bench: error: {exc}", file=sys.stderr)
        return 2
    print(format_report(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return exit_status(report)


def exit_status(report: dict[str, Any]) -> int:
    """0 when every planned request succeeded; 1 when any failed, was unfinished at --timeout or
    was never sent."""
    s = report["summary"]
    return 0 if s["errors"] == 0 and s["incomplete"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
