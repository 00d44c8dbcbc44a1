"""End to end with real processes: a prefill worker, a decode worker and the router
(`python -m router`) on the default model, driven by the official `openai` client.

The decode worker runs n-gram speculative decoding (`--speculative ngram`) and the offline
engine does not, so every comparison below also checks that speculation changes no output.
Greedy outputs must be identical to the offline engine (`engine.LLM`), including non-ASCII
text; a repeated prefix reports cached tokens; a client that disconnects frees its blocks on
the decode worker (seen through the router's /status); structured output (JSON Schema through
`response_format` and the client's `parse`, regex and choice through `structured_outputs`)
obeys its constraint across the prefill/decode split and matches the offline engine.
"""
import json
import re
import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.sampling_params import SamplingParams
from tests.helpers import wait_until
from tests.router.processes import grpc_address, start_router, start_worker, worker_stats

pytestmark = pytest.mark.slow

NUM_BLOCKS = 512

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
NON_ASCII_CHATS = [[{"role": "user", "content": "Say hello in Japanese."}],  # kana split across tokens
                   [{"role": "user", "content": "Écris une phrase sur le café."}]]
PLAIN = "The quick brown fox"
LONG_PREFIX = ("Here is a long document that several questions will share as their common prefix. " * 12)
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def cluster():
    processes = []
    try:
        # two prefill workers (routing between them is tested); threshold 0: every prompt is
        # prefilled on a prefill worker and its KV transferred to the decode worker
        blocks = ["--num-blocks", str(NUM_BLOCKS)]
        processes += [start_worker("prefill_worker", *blocks), start_worker("prefill_worker", *blocks),
                      start_worker("decode_worker", *blocks, "--local-prefill-threshold", "0", "--speculative", "ngram")]
        prefill_addresses = [grpc_address(p) for p in processes[:2]]
        decode_address = grpc_address(processes[2])
        # every prompt qualifies for the P/D engagement alarm, which must stay silent here
        router, url = start_router("--model", "default", "--prefill", ",".join(prefill_addresses),
                                   "--decode", decode_address, "--engagement-min-prompt-tokens", "1",
                                   "--engagement-min-requests", "2")
        processes.append(router)
        yield {"url": url, "decode": decode_address, "prefill": prefill_addresses}
    finally:
        for process in reversed(processes):
            process.stop()


@pytest.fixture(scope="module")
def offline():
    from engine import LLM
    return LLM("default", num_blocks=NUM_BLOCKS)


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster["url"] + "/v1", api_key="unused", max_retries=0, timeout=600)


def offline_greedy(offline, prompt, max_tokens=NEW_TOKENS):
    [output] = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return offline.tokenizer.decode(output.token_ids), output


def decode_status(cluster):
    status = httpx.get(cluster["url"] + "/status").json()
    return next(w for w in status["workers"] if w["address"] == cluster["decode"])


def prefill_status(cluster) -> dict[str, dict]:
    status = httpx.get(cluster["url"] + "/status").json()
    return {w["address"]: w for w in status["workers"] if w["role"] == "prefill"}


@pytest.mark.parametrize("stream", [False, True])
def test_chat_greedy_matches_the_offline_engine(client, offline, stream):
    expected, output = offline_greedy(offline, CHAT)
    if stream:
        chunks = list(client.chat.completions.create(model="default", messages=CHAT, max_tokens=NEW_TOKENS,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        out = client.chat.completions.create(model="default", messages=CHAT, max_tokens=NEW_TOKENS, temperature=0)
        text, usage = out.choices[0].message.content, out.usage
        # the Responses API is served as the same chat request (router/responses.py)
        response = client.responses.create(model="default", input=CHAT, max_output_tokens=NEW_TOKENS, temperature=0)
        assert response.output_text == text
        assert (response.usage.input_tokens, response.usage.output_tokens) == (usage.prompt_tokens,
                                                                                usage.completion_tokens)
    assert text == expected
    assert usage.completion_tokens == len(output.token_ids)
    assert usage.prompt_tokens == len(output.prompt_token_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_greedy_matches_the_offline_engine(client, offline, stream):
    expected, output = offline_greedy(offline, PLAIN)
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(
            model="default", prompt=PLAIN, max_tokens=NEW_TOKENS, temperature=0, stream=True))
    else:
        out = client.completions.create(model="default", prompt=PLAIN, max_tokens=NEW_TOKENS, temperature=0)
        text = out.choices[0].text
        assert out.choices[0].finish_reason == ("length" if len(output.token_ids) == NEW_TOKENS else "stop")
    assert text == expected


@pytest.mark.parametrize("messages", NON_ASCII_CHATS)
def test_non_ascii_output(client, offline, messages):
    expected, _ = offline_greedy(offline, messages, max_tokens=32)
    assert any(ord(ch) > 127 for ch in expected)
    pieces = [c.choices[0].delta.content for c in client.chat.completions.create(
        model="default", messages=messages, max_tokens=32, temperature=0, stream=True)
        if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == expected
    assert all("\ufffd" not in piece for piece in pieces)
    out = client.chat.completions.create(model="default", messages=messages, max_tokens=32, temperature=0)
    assert out.choices[0].message.content == expected


def test_stop_string_and_max_tokens(client, offline):
    expected, _ = offline_greedy(offline, PLAIN)
    words = expected.split()
    assert len(words) > 3
    stop = " " + words[2]
    out = client.completions.create(model="default", prompt=PLAIN, max_tokens=NEW_TOKENS, temperature=0, stop=[stop])
    assert out.choices[0].text == expected[:expected.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    out = client.completions.create(model="default", prompt=PLAIN, max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_token_that_comes_first_from_the_prefill_worker_is_not_in_the_text(client, offline, stream):
    """The prefill worker's first token is a stop token id (the decode worker would stream it as
    the prefill worker answers): the output ends there, its text left out as for any stop token."""
    _, output = offline_greedy(offline, PLAIN)
    first = output.token_ids[0]
    body = dict(model="default", prompt=PLAIN, max_tokens=NEW_TOKENS, temperature=0,
                extra_body={"stop_token_ids": [first]})
    if stream:
        chunks = list(client.completions.create(**body, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        reason = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
        usage = chunks[-1].usage
    else:
        out = client.completions.create(**body)
        text, reason, usage = out.choices[0].text, out.choices[0].finish_reason, out.usage
    assert (text, reason, usage.completion_tokens) == ("", "stop", 1)


def test_seeded_sampling_is_reproducible(client):
    texts = [client.chat.completions.create(model="default", messages=CHAT, max_tokens=16, temperature=1.0,
                                            seed=1234).choices[0].message.content for _ in range(2)]
    assert texts[0] == texts[1]


def _kv_transfer_bytes(url: str) -> float:
    metrics = httpx.get(url + "/metrics").text
    return float(next(line for line in metrics.splitlines()
                      if line.startswith("pdserve:kv_transfer_bytes_total")).split()[-1])


def test_repeated_prefix_reports_cached_tokens(client, cluster):
    moved_before = _kv_transfer_bytes(cluster["url"])
    first = client.completions.create(model="default", prompt=LONG_PREFIX + "First question?", max_tokens=2,
                                      temperature=0)
    second = client.completions.create(model="default", prompt=LONG_PREFIX + "Second question?", max_tokens=2,
                                       temperature=0)
    assert first.usage.prompt_tokens > 64
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert _kv_transfer_bytes(cluster["url"]) > moved_before  # these prompts' KV moved from P to D


def _remote_fills(url: str) -> float:
    metrics = httpx.get(url + "/metrics").text
    return float(next((line for line in metrics.splitlines() if line.startswith(
        'pdserve:prompt_fill_requests_total{path="remote",reason=""}')), " 0").split()[-1])


def test_tenants_share_no_cached_block_unless_they_share_a_salt_for_the_system_prompt(client, cluster):
    """cache_salt through real workers (router/cache_salt.py): the same prompt under another
    tenant's salt finds nothing cached on the prefill worker that holds it; the same tenant finds
    it; two tenants with one shared_cache_salt share the system prompt's blocks only. Every one
    is prefilled remotely: the prefill worker's block hashes, salts and all, match the decode
    worker's (a mismatch would fall back, and count as a fallback)."""
    system = {"role": "system", "content": "You answer questions about the bookshop's opening hours. " * 6}

    def cached(salt: str, question: str, shared: str | None = None) -> tuple[int, int]:
        extra = {"cache_salt": salt, **({"shared_cache_salt": shared} if shared else {})}
        out = client.chat.completions.create(model="default", messages=[system, {"role": "user", "content": question}],
                                             max_tokens=2, temperature=0, extra_body=extra)
        return out.usage.prompt_tokens_details.cached_tokens, out.usage.prompt_tokens

    remote_before = _remote_fills(cluster["url"])
    assert cached("tenant-a", "Open on Sunday?")[0] == 0
    assert cached("tenant-b", "Open on Sunday?")[0] == 0  # another tenant: nothing of tenant-a's
    hit, prompt_tokens = cached("tenant-a", "Open on Sunday?")
    assert prompt_tokens - 16 <= hit < prompt_tokens  # its own: all but the last partial block
    assert cached("tenant-c", "Open on Monday?", shared="bookshop")[0] == 0
    hit, prompt_tokens = cached("tenant-d", "Open at night?", shared="bookshop")
    system_tokens = httpx.post(cluster["url"] + "/tokenize", json={"model": "default", "messages": [system],
                                                                   "add_generation_prompt": False}).json()["count"]
    assert system_tokens - 32 < hit <= system_tokens < prompt_tokens  # the system prompt's full blocks only
    assert _remote_fills(cluster["url"]) == remote_before + 5


def _step_counts(cluster) -> dict[tuple[str, str], float]:
    """{(role, kind): model steps of that role's workers} from pdserve:worker_step_seconds_count on
    the router's /metrics."""
    counts: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(httpx.get(cluster["url"] + "/metrics").text):
        for s in family.samples:
            if s.name == "pdserve:worker_step_seconds_count":
                key = (s.labels["role"], s.labels["kind"])
                counts[key] = counts.get(key, 0) + s.value
    return counts


def test_each_workers_model_steps_reach_metrics_by_kind(client, cluster):
    """The workers' step-time histograms (engine/step_times.py) on /metrics: a remotely prefilled
    request adds prompt steps on the prefill worker, which never runs a decode step, and decode
    steps on the decode worker."""
    before = _step_counts(cluster)
    prompt = " ".join(f"item{i}" for i in range(90))  # uncached: prefilled by the prefill worker
    client.completions.create(model="default", prompt=prompt, max_tokens=6, temperature=0,
                              extra_body={"ignore_eos": True})
    wait_until(lambda: _step_counts(cluster).get(("decode", "decode"), 0) > before.get(("decode", "decode"), 0)
               and _step_counts(cluster).get(("prefill", "prefill"), 0) > before.get(("prefill", "prefill"), 0),
               timeout=30, what="the workers' new steps on /metrics")
    assert _step_counts(cluster).get(("prefill", "decode"), 0) == 0


def test_client_disconnect_frees_blocks(client, cluster):
    before = decode_status(cluster)
    assert before["kv_blocks_free"] == before["kv_blocks_total"] == NUM_BLOCKS
    with httpx.stream("POST", cluster["url"] + "/v1/completions",
                      json={"model": "default", "prompt": PLAIN, "max_tokens": 400, "temperature": 0,
                            "ignore_eos": True, "stream": True}, timeout=600) as response:
        lines = response.iter_lines()  # keep a reference: a dropped iterator closes the connection
        received = 0
        while received < 3:
            received += next(lines).startswith("data: ")
        during = decode_status(cluster)
        assert during["running"] == 1 and during["kv_blocks_free"] < NUM_BLOCKS
    wait_until(lambda: decode_status(cluster)["running"] == 0, timeout=60, what="the request to be aborted")
    after = decode_status(cluster)
    assert after["kv_blocks_free"] == after["kv_blocks_total"]
    status = httpx.get(cluster["url"] + "/status").json()
    assert status["inflight_requests"] == 0


def test_logprobs_from_real_workers(client, offline):
    expected, output = offline_greedy(offline, PLAIN, max_tokens=8)
    out = client.completions.create(model="default", prompt=PLAIN, max_tokens=8, temperature=0, logprobs=2)
    logprobs = out.choices[0].logprobs
    assert out.choices[0].text == expected
    assert len(logprobs.tokens) == len(output.token_ids)
    assert "".join(logprobs.tokens) == expected
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob <= 0.0 and len(top) == 2
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)  # greedy: the sampled token is the top one


def test_logit_bias_bans_or_forces_a_token_and_min_tokens_delays_eos(client, offline):
    tokenizer = offline.tokenizer
    _, output = offline_greedy(offline, PLAIN, max_tokens=3)
    first = output.token_ids[0]
    top = client.completions.create(model="default", prompt=PLAIN, max_tokens=1, temperature=0, logprobs=2)
    ranked = sorted(top.choices[0].logprobs.top_logprobs[0].items(), key=lambda item: -item[1])
    assert ranked[0][0] == tokenizer.decode([first])
    banned = client.completions.create(model="default", prompt=PLAIN, max_tokens=1, temperature=0,
                                       logit_bias={str(first): -100})
    assert banned.choices[0].text == ranked[1][0]  # the next-best token
    forced_id = tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced = client.completions.create(model="default", prompt=PLAIN, max_tokens=3, temperature=0.8, seed=5,
                                       logit_bias={str(forced_id): 100})
    assert forced.choices[0].text == tokenizer.decode([forced_id] * 3)
    short = client.chat.completions.create(model="default", messages=CHAT, max_tokens=64, temperature=0)
    assert short.choices[0].finish_reason == "stop"  # EOS well before 64 tokens
    n = short.usage.completion_tokens
    longer = client.chat.completions.create(model="default", messages=CHAT, max_tokens=64, temperature=0,
                                            extra_body={"min_tokens": n + 4})
    assert longer.usage.completion_tokens >= n + 4
    assert longer.choices[0].message.content.startswith(short.choices[0].message.content)


COPY_CHAT = [{"role": "user", "content": 'Repeat exactly: {"id": 7, "name": "Ada", "tags": ["x", "y"], "ok": true}'}]


def _spec_counters(cluster) -> tuple[int, int, float]:
    """The decode worker's (draft tokens, accepted tokens, acceptance rate) on the router's /metrics."""
    values = {}
    worker = 'worker="{}"'.format(cluster["decode"])
    for line in httpx.get(cluster["url"] + "/metrics").text.splitlines():
        for name in ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                     "worker_spec_decode_acceptance_rate"):
            if line.startswith(f"pdserve:{name}{{") and worker in line:
                values[name] = float(line.rsplit(" ", 1)[1])
    return (int(values["spec_decode_num_draft_tokens_total"]), int(values["spec_decode_num_accepted_tokens_total"]),
            values["worker_spec_decode_acceptance_rate"])


def test_speculative_decoding_keeps_the_output_and_reports_its_acceptance(client, cluster, offline):
    """A chat that copies its prompt: the decode worker's drafts are mostly accepted (seen on
    /metrics), the text is the offline engine's (which does not speculate), streamed or not; a
    request with `speculative: false` gets the same text and drafts nothing."""
    [reference] = offline.generate(COPY_CHAT, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
    expected = offline.tokenizer.decode(reference.token_ids, skip_special_tokens=True)
    drafted, accepted, _ = _spec_counters(cluster)
    out = client.chat.completions.create(model="default", messages=COPY_CHAT, max_tokens=40, temperature=0)
    assert out.choices[0].message.content == expected
    assert out.usage.completion_tokens == len(reference.token_ids)
    wait_until(lambda: _spec_counters(cluster)[0] > drafted, timeout=30, what="the decode worker's drafts on /metrics")
    drafted_after, accepted_after, rate = _spec_counters(cluster)
    assert accepted_after - accepted > (drafted_after - drafted) / 2 and rate > 0
    stream = client.chat.completions.create(model="default", messages=COPY_CHAT, max_tokens=40, temperature=0,
                                            stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == expected
    before = worker_stats(cluster["decode"], "decode").spec_draft_tokens
    opted_out = client.chat.completions.create(model="default", messages=COPY_CHAT, max_tokens=40, temperature=0,
                                               extra_body={"speculative": False})
    assert opted_out.choices[0].message.content == expected
    assert worker_stats(cluster["decode"], "decode").spec_draft_tokens == before


STORY = LONG_PREFIX + "Now tell me a short story about a lighthouse."


def _texts(response) -> list[str]:
    assert [choice.index for choice in response.choices] == list(range(len(response.choices)))
    return [choice.text for choice in response.choices]


def test_n_choices_prefill_the_prompt_once_and_share_its_blocks(client, cluster, offline):
    """n=4: one prefill on a prefill worker, one KV transfer; the other three choices start on the
    same decode worker and read the prompt's full blocks from its prefix cache. Greedy choices are
    identical (and equal the offline engine's output)."""
    [reference] = offline.generate(STORY, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                   use_tqdm=False)
    expected = offline.tokenizer.decode(reference.token_ids)
    prefill_before, decode_before = prefill_status(cluster), decode_status(cluster)
    out = client.completions.create(model="default", prompt=STORY, max_tokens=8, temperature=0, n=4,
                                    extra_body={"ignore_eos": True})
    prefill_after, decode_after = prefill_status(cluster), decode_status(cluster)
    assert _texts(out) == [expected] * 4
    assert out.usage.completion_tokens == 4 * 8
    prompt_len = out.usage.prompt_tokens
    routed = sum(prefill_after[a]["router_num_routed"] - prefill_before[a]["router_num_routed"] for a in prefill_after)
    computed = sum(prefill_after[a]["prompt_tokens_computed"] - prefill_before[a]["prompt_tokens_computed"]
                   for a in prefill_after)
    assert routed == 1 and 0 < computed <= prompt_len  # prefilled once (minus what that worker had cached)
    full_block_tokens = (prompt_len - 1) // 16 * 16
    hits = decode_after["prefix_cache_hits"] - decode_before["prefix_cache_hits"]
    assert hits >= 3 * full_block_tokens  # the three later choices shared the transferred blocks
    recomputed = decode_after["prompt_tokens_computed"] - decode_before["prompt_tokens_computed"]
    assert recomputed <= 3 * (prompt_len - full_block_tokens)  # each only its last partial block
    assert decode_after["running"] == 0 and decode_after["kv_blocks_free"] == decode_after["kv_blocks_total"]


def test_seeded_n_choices_are_reproducible_streamed_or_not_and_in_any_batch(client):
    """Choice i samples with seed + i: the four differ, and the same four come back on every run,
    streamed (interleaved by index) or not, alone or beside other traffic."""
    def ask(**extra):
        return client.completions.create(model="default", prompt=PLAIN, max_tokens=12, temperature=1.0, seed=77,
                                         n=4, **extra)
    first = _texts(ask())
    assert len(set(first)) > 1
    assert _texts(ask()) == first
    background = threading.Thread(target=lambda: client.completions.create(
        model="default", prompt=STORY, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}), daemon=True)
    background.start()
    pieces = [""] * 4
    finish = [None] * 4
    usage = None
    for chunk in ask(stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            pieces[choice.index] += choice.text
            finish[choice.index] = choice.finish_reason or finish[choice.index]
        usage = chunk.usage or usage
    background.join(timeout=600)
    assert pieces == first and finish == ["length"] * 4
    assert usage.completion_tokens == 4 * 12
    chat = client.chat.completions.create(model="default", messages=CHAT, max_tokens=6, temperature=1.0, seed=9, n=3)
    assert [c.index for c in chat.choices] == [0, 1, 2] and all(c.message.content for c in chat.choices)


def test_best_of_returns_the_most_likely_of_its_candidates(client):
    """best_of=3, n=1 draws the same three candidates as n=3 with the same seed (seed + i) and
    returns the one with the highest cumulative logprob; usage counts all three."""
    candidates = client.completions.create(model="default", prompt=PLAIN, max_tokens=6, temperature=1.0, seed=3,
                                           n=3, logprobs=0)
    scores = [sum(choice.logprobs.token_logprobs) for choice in candidates.choices]
    best = client.completions.create(model="default", prompt=PLAIN, max_tokens=6, temperature=1.0, seed=3,
                                     n=1, extra_body={"best_of": 3})
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == candidates.choices[scores.index(max(scores))].text
    assert best.usage.completion_tokens == 3 * 6


def test_a_batch_of_prompts_gives_each_prompt_what_it_gets_alone(client, offline):
    """OpenAI's list of prompts (what evaluation harnesses send): choice i * n + j is prompt i's
    choice j; greedy choices equal the offline engine's output for their prompt, streamed or
    not; seeded ones and best_of equal the same prompt sent alone; echo with logprobs and
    max_tokens 0 (a batch of loglikelihoods) scores each prompt as it does alone."""
    prompts = [PLAIN, "def fibonacci(n):", "Once upon a time"]
    greedy = client.completions.create(model="default", prompt=prompts, max_tokens=8, temperature=0, n=2)
    expected = [offline_greedy(offline, p, max_tokens=8)[0] for p in prompts]
    assert [c.index for c in greedy.choices] == list(range(6))
    assert _texts(greedy) == [text for text in expected for _ in range(2)]
    assert greedy.usage.prompt_tokens == sum(len(offline.tokenizer.encode(p)) for p in prompts)
    as_ids = client.completions.create(model="default", prompt=[offline.tokenizer.encode(p) for p in prompts],
                                       max_tokens=8, temperature=0)
    assert _texts(as_ids) == expected
    pieces = [""] * 3
    for chunk in client.completions.create(model="default", prompt=prompts, max_tokens=8, temperature=0,
                                           stream=True):
        for choice in chunk.choices:
            pieces[choice.index] += choice.text
    assert pieces == expected

    def sampled(prompt, **extra):
        return _texts(client.completions.create(model="default", prompt=prompt, max_tokens=6, temperature=1.0,
                                                seed=5, **extra))
    batch = sampled(prompts[:2], n=2)
    assert batch == sampled(prompts[0], n=2) + sampled(prompts[1], n=2)
    assert sampled(prompts[:2], extra_body={"best_of": 3}) == (sampled(prompts[0], extra_body={"best_of": 3}) +
                                                                sampled(prompts[1], extra_body={"best_of": 3}))
    scored = client.completions.create(model="default", prompt=prompts, max_tokens=0, echo=True, logprobs=0,
                                       temperature=0)
    assert len(scored.choices) == len(prompts)
    for choice, prompt in zip(scored.choices, prompts):
        alone = client.completions.create(model="default", prompt=prompt, max_tokens=0, echo=True, logprobs=0,
                                          temperature=0).choices[0]
        assert choice.text == alone.text == prompt
        assert choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(alone.logprobs.token_logprobs[1:], abs=1e-4)


def test_echo_and_prompt_logprobs_match_transformers(client, cluster, offline):
    """echo with logprobs and max_tokens 0 (what evaluation harnesses send for a loglikelihood):
    the prompt back, each prompt token's logprob (the first: none) within 1e-4 of transformers'
    in fp32, no completion. vLLM's prompt_logprobs field likewise, beside a completion. Both are
    computed where the prompt is prefilled: on the decode worker (no KV transfer)."""
    import torch
    import transformers
    from engine.model.loader import resolve_model
    ids = offline.tokenizer.encode(PLAIN)
    hf = transformers.AutoModelForCausalLM.from_pretrained(resolve_model("default").model_dir,
                                                           torch_dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = [float(want[p - 1, ids[p]]) for p in range(1, len(ids))]
    prefill_before = prefill_status(cluster)
    out = client.completions.create(model="default", prompt=PLAIN, max_tokens=0, echo=True, logprobs=1,
                                    temperature=0)
    choice = out.choices[0]
    assert choice.text == PLAIN and out.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == len(ids)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert "".join(choice.logprobs.tokens) == PLAIN
    with_output = client.completions.create(model="default", prompt=PLAIN, max_tokens=4, temperature=0,
                                            extra_body={"prompt_logprobs": 2})
    entries = with_output.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for p, entry in enumerate(entries[1:], start=1):
        assert entry[str(ids[p])]["logprob"] == pytest.approx(expected[p - 1], abs=1e-4)
        top = want[p - 1].topk(2).indices.tolist()
        assert all(str(t) in entry for t in top)
    assert with_output.choices[0].text == offline_greedy(offline, PLAIN, max_tokens=4)[0]
    # streamed: the echoed prompt (with its logprobs and prompt_logprobs) first, then the completion
    chunks = list(client.completions.create(model="default", prompt=PLAIN, max_tokens=4, temperature=0, echo=True,
                                            logprobs=1, stream=True, extra_body={"prompt_logprobs": 2}))
    first = chunks[0].choices[0]
    assert first.text == PLAIN and first.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    streamed = [e and {k: v["logprob"] for k, v in e.items()} for e in first.model_extra["prompt_logprobs"]]
    whole = [e and {k: v["logprob"] for k, v in e.items()} for e in entries]
    assert streamed[0] is None and len(streamed) == len(whole)
    assert all(s.keys() == w.keys() and s == pytest.approx(w, abs=1e-4) for s, w in zip(streamed[1:], whole[1:]))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PLAIN + with_output.choices[0].text
    prefill_after = prefill_status(cluster)
    assert all(prefill_after[a]["router_num_routed"] == prefill_before[a]["router_num_routed"] for a in prefill_after)


def test_shared_prefix_goes_to_one_prefill_worker_and_hits_its_cache(client, cluster):
    document = "A shared report on river ecology, water quality and fish populations. " * 10
    before = prefill_status(cluster)
    for question in ["Which fish?", "How is the water?", "Who wrote it?", "Summarize it."]:
        client.completions.create(model="default", prompt=document + question, max_tokens=1, temperature=0)
    after = prefill_status(cluster)
    routed = {a: after[a]["router_num_routed"] - before[a]["router_num_routed"] for a in cluster["prefill"]}
    assert sorted(routed.values()) == [0, 4]
    chosen = max(routed, key=routed.get)
    assert after[chosen]["prefix_cache_hit_rate"] > (before[chosen]["prefix_cache_hit_rate"] or 0.0)


def test_different_prefixes_spread_over_the_prefill_workers(client, cluster):
    """Without a shared prefix, each request goes to the prefill worker with the least work; idle
    workers are told apart by how many requests each has been sent. (/status polls the workers,
    so the router's view of their queues is fresh before each request.)"""
    topics = ["volcanoes", "glaciers", "deserts", "coral reefs", "tundra", "rainforests"]
    start = [w["router_num_routed"] for w in prefill_status(cluster).values()]
    for topic in topics:
        before = {a: w["router_num_routed"] for a, w in prefill_status(cluster).items()}
        prompt = f"Write a detailed essay about {topic}. " * 8
        client.completions.create(model="default", prompt=prompt, max_tokens=1, temperature=0)
        after = {a: w["router_num_routed"] for a, w in prefill_status(cluster).items()}
        [target] = [a for a in after if after[a] == before[a] + 1]
        assert before[target] == min(before.values())
    totals = list(after.values())
    assert abs(totals[0] - totals[1]) <= max(abs(start[0] - start[1]) - len(topics), 1)


# ---- structured output: the prefill worker samples the first token, the decode worker the rest,
# both under the same grammar ---------------------------------------------------------------------

PERSON_SCHEMA = {"type": "object",
                 "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                "city": {"type": "string"}},
                 "required": ["name", "age", "city"], "additionalProperties": False}
PERSON_ASK = [{"role": "user", "content": "Describe Ana, who is 31 and lives in Lisbon, as JSON."}]


def offline_constrained(offline, prompt, constraint, max_tokens=96) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_output=constraint)
    return offline.generate(prompt, params, use_tqdm=False)[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_response_format_matches_the_offline_engine(client, offline, stream):
    from engine import StructuredOutput
    expected = offline_constrained(offline, PERSON_ASK, StructuredOutput.json_schema(PERSON_SCHEMA))
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA,
                                                              "strict": True}}
    kwargs = dict(model="default", messages=PERSON_ASK, max_tokens=96, temperature=0, response_format=response_format)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        text, finish = choice.message.content, [choice.finish_reason]
    assert text == expected and finish == ["stop"]
    value = json.loads(text)
    assert set(value) == {"name", "age", "city"} and isinstance(value["age"], int)


def test_openai_parse_with_a_pydantic_model(client):
    """The openai client's `parse` sends the model's strict JSON schema and validates the reply."""
    import pydantic

    class Person(pydantic.BaseModel):
        name: str
        age: int
        city: str

    completion = client.chat.completions.parse(model="default", messages=PERSON_ASK, max_tokens=96, temperature=0,
                                               response_format=Person)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and person.name


def test_regex_and_choice_through_structured_outputs(client, offline):
    from engine import StructuredOutput
    pattern = r"\+351 \d{3} \d{3} \d{3}"
    out = client.completions.create(model="default", prompt="Ana's phone number is", max_tokens=32, temperature=0,
                                    extra_body={"structured_outputs": {"regex": pattern}})
    text = out.choices[0].text
    assert re.fullmatch(pattern, text) and out.choices[0].finish_reason == "stop"
    assert text == offline_constrained(offline, "Ana's phone number is", StructuredOutput.regex(pattern), 32)
    out = client.chat.completions.create(model="default", messages=CHAT, max_tokens=8, temperature=0.7, seed=5,
                                         extra_body={"structured_outputs": {"choice": ["Paris", "Lyon"]}})
    assert out.choices[0].message.content in ("Paris", "Lyon")


def test_an_invalid_schema_is_a_400_before_any_worker(client):
    with pytest.raises(openai.BadRequestError, match='Unsupported type'):
        client.chat.completions.create(model="default", messages=CHAT, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}})


def test_a_constraint_no_text_satisfies_is_a_400(client, cluster):
    """Matching nothing from the start (refused as the worker builds the request) or dead-ending part
    way (a string pattern nothing matches, inside an object): the request's own error, a 400 with
    the reason, not a 502; the worker frees what it held."""
    with pytest.raises(openai.BadRequestError, match="regex constraint matches no text"):
        client.completions.create(model="default", prompt="x", max_tokens=8,
                                  extra_body={"structured_outputs": {"regex": "[^\\s\\S]"}})
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "[^\\s\\S]"}}, "required": ["a"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "never", "schema": schema}}
    with pytest.raises(openai.BadRequestError, match="json_schema constraint allows no token after"):
        client.chat.completions.create(model="default", messages=CHAT, max_tokens=32, response_format=response_format)
    wait_until(lambda: decode_status(cluster)["kv_blocks_free"] == NUM_BLOCKS, timeout=60,
               what="the decode worker to free every block")


# ---- tool calling (router/tools.py over structured output) --------------------------------------

TOOLS = [{"type": "function", "function": {
              "name": "get_weather", "description": "Current weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {
              "name": "add", "description": "Add two integers",
              "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                             "required": ["a", "b"]}}}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_call(call, names=("get_weather", "add")):
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    arguments = json.loads(call.function.arguments)
    required = {"get_weather": {"city"}, "add": {"a", "b"}}[call.function.name]
    assert set(arguments) == required
    return arguments


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_returns_its_call(client, stream):
    kwargs = dict(model="default", messages=WEATHER_ASK, max_tokens=48, temperature=0, tools=TOOLS,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert all(not d.content for d in deltas)  # a call is never streamed as text
        calls = [call for d in deltas for call in (d.tool_calls or [])]
        assert len(calls) == 1 and calls[0].index == 0
        call, finish = calls[0], chunks[-1].choices[0].finish_reason
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        call, finish = choice.message.tool_calls[0], choice.finish_reason
    assert finish == "stop"  # OpenAI's finish reason when tool_choice names the function
    assert isinstance(_check_call(call, ("get_weather",))["city"], str)
    # the Responses API's function call, through P/D as the same chat request, streamed or not
    flat_tools = [{"type": "function", **tool["function"]} for tool in TOOLS]
    kwargs = dict(model="default", input=WEATHER_ASK, max_output_tokens=48, temperature=0, tools=flat_tools,
                  tool_choice={"type": "function", "name": "get_weather"})
    if stream:
        with client.responses.stream(**kwargs) as events:
            response = events.get_final_response()
    else:
        response = client.responses.create(**kwargs)
    [item] = response.output
    assert (item.type, item.name, json.loads(item.arguments)) == ("function_call", "get_weather",
                                                                   json.loads(call.function.arguments))


def test_required_tool_choice_then_the_tool_result_turn(client, cluster):
    first = client.chat.completions.create(model="default", messages=WEATHER_ASK, max_tokens=48, temperature=0,
                                           tools=TOOLS, tool_choice="required").choices[0]
    assert first.finish_reason == "tool_calls"
    assert 'pdserve:request_finished_total{finish_reason="tool_calls"}' in httpx.get(cluster["url"] + "/metrics").text
    call = first.message.tool_calls[0]
    _check_call(call)
    follow_up = WEATHER_ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"}]
    second = client.chat.completions.create(model="default", messages=follow_up, max_tokens=24, temperature=0,
                                            tools=TOOLS, tool_choice="none").choices[0]
    assert second.message.tool_calls is None and second.message.content and second.finish_reason in ("stop", "length")


def test_auto_tool_choice_gives_a_call_or_plain_text_the_same_streamed_or_not(client):
    """With `auto` the model decides; whichever it is, the reply is well formed and the same
    streamed or not."""
    kwargs = dict(model="default", messages=WEATHER_ASK, max_tokens=48, temperature=0, tools=TOOLS)
    choice = client.chat.completions.create(**kwargs).choices[0]
    text, calls, finish = choice.message.content or "", choice.message.tool_calls or [], choice.finish_reason
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed_calls = [call for d in deltas for call in (d.tool_calls or [])]
    assert "".join(d.content or "" for d in deltas) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [finish]
    if calls:
        assert finish == "tool_calls" and not text and len(calls) == 1
        arguments = _check_call(calls[0])
        name = next(c.function.name for c in streamed_calls if c.function and c.function.name)
        streamed = "".join(c.function.arguments or "" for c in streamed_calls if c.function)
        assert (name, json.loads(streamed)) == (calls[0].function.name, arguments)
    else:
        assert not streamed_calls
        assert text and not text.lstrip().startswith("<") and finish in ("stop", "length")


def test_the_engagement_alarm_stays_silent_when_prompts_go_to_the_prefill_workers(client, cluster):
    """(router/engagement.py; it firing is tests/router/test_engagement.py's.) After this module's
    requests, most of them prefilled remotely, /health reports no `degraded` detail."""
    for question in ("Name a planet.", "Name a river."):
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": question}],
                                       max_tokens=2, temperature=0)
    assert httpx.get(cluster["url"] + "/health").json() == {"status": "ok"}
    samples = {(s.name, frozenset(s.labels.items())): s.value for family in
               text_string_to_metric_families(httpx.get(cluster["url"] + "/metrics").text) for s in family.samples}
    remote = samples[("pdserve:prompt_fill_requests_total", frozenset({"path": "remote", "reason": ""}.items()))]
    assert remote >= 2 and samples[("pdserve:disaggregation_degraded", frozenset())] == 0
