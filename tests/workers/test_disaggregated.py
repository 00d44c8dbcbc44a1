"""Prefill + decode workers as separate processes: token-exact against the colocated worker and
the offline engine over every kvtransfer transport, prefix-cache hits on the prefill worker,
follow-up turns that move only the missing blocks (also when the decode worker's copy of the
history waited in its host cache tier), conditional disaggregation, bad requests.

The colocated worker runs n-gram speculative decoding (`--speculative ngram`), the decode workers
and the offline engine do not: its greedy outputs equal the offline engine's, and its seeded
samples and logprobs equal a disaggregated run's."""
import random

import grpc
import pytest

import kvtransfer
import wire
from engine import LLM, SamplingParams
from engine.model.loader import resolve_model
from tests.helpers import wait_until
from tests.transports import transport_params
from tests.workers.harness import all_blocks_free, generate, sampling, start_workers, stop_workers

pytestmark = pytest.mark.slow

TRANSPORTS = kvtransfer.available_transports()  # the cluster's decode workers, one per transport
BLOCK = 16
NEW = 12
THRESHOLD = 8
ENGINE = ["--num-blocks", "256"]
TIERED_BLOCKS = 16


@pytest.fixture(scope="module")
def cluster():
    specs = [("prefill", ENGINE), ("decode", ENGINE + ["--role", "both", "--speculative", "ngram"])]
    specs += [("decode", ENGINE + ["--transport", t, "--local-prefill-threshold", str(THRESHOLD)]) for t in TRANSPORTS]
    # a decode worker whose pool holds one conversation, with a host cache tier behind it
    specs.append(("decode", ["--num-blocks", str(TIERED_BLOCKS), "--host-cache-gb", "0.2", "--transport", "tcp",
                             "--local-prefill-threshold", "0"]))
    workers = start_workers(specs)
    prefill, colocated, *decodes, tiered = workers
    yield {"prefill": prefill, "colocated": colocated, "decode": dict(zip(TRANSPORTS, decodes)), "tiered": tiered}
    stop_workers(workers)


@pytest.fixture(scope="module")
def llm():
    return LLM("default", num_blocks=256)


@pytest.fixture(scope="module")
def bytes_per_block(llm):
    cache = llm.engine.runner.kv_cache.data
    return cache[:, 0].numel() * cache.element_size()


@pytest.fixture(autouse=True)
def no_blocks_held_after(cluster):
    yield
    for worker in [cluster["prefill"], cluster["colocated"], *cluster["decode"].values(), cluster["tiered"]]:
        wait_until(lambda: all_blocks_free(worker), what=f"{worker.grpc_address} to free every block")


def offline(llm, prompt, max_tokens=NEW):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0].token_ids


def random_prompt(seed, length):
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(length)]


def blocks(num_tokens):
    return -(-num_tokens // BLOCK)


@pytest.mark.parametrize("transport", transport_params())
def test_disaggregated_greedy_is_token_exact(cluster, llm, bytes_per_block, transport):
    tok = llm.tokenizer
    text = tok.encode("The history of the Roman empire begins with the founding of the city, which according to "
                      "legend happened in 753 BC, and continues through the kingdom, the republic and the empire.")
    other = tok.encode("Les fleurs du jardin sont belles au printemps, quand le soleil revient enfin sur la ville "
                       "et que les enfants jouent dans les parcs jusqu'au soir.")
    # a whole number of blocks, a partial last block, a longer one (distinct: no prefix hit on D)
    prompts = [text[:BLOCK * 2], other[:BLOCK * 2 + 5], random_prompt(len(transport), 77)]
    decode = cluster["decode"][transport]
    assert decode.transport_address.startswith(f"{transport}://")
    for index, prompt in enumerate(prompts):
        result = generate(decode, f"{transport}-{index}", prompt, cluster["prefill"])
        assert result.token_ids == offline(llm, prompt)
        assert result.finish_reason == "length"
        assert result.kv_outcome.prefilled_remotely
        # every prompt position's KV arrives, including a partial last block
        assert result.kv_outcome.kv_bytes_received == blocks(len(prompt)) * bytes_per_block
        assert result.kv_outcome.num_prompt_tokens == len(prompt)


def test_colocated_and_disaggregated_match_offline(cluster, llm):
    tok = llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True)
               for c in ("Name a fruit that is yellow.", "Écris un mot en français.")]
    prompts.append(tok.encode("Les fleurs du jardin sont belles au printemps, quand le soleil revient et que"))
    prompts.append(tok.encode("one two three four five one two three four five one two three four"))
    decode = cluster["decode"][TRANSPORTS[0]]
    drafts_before = cluster["colocated"].stats().spec_draft_tokens
    for index, prompt in enumerate(prompts):
        reference = offline(llm, prompt, 24)
        colocated = generate(cluster["colocated"], f"colo-{index}", prompt, params=sampling(24))
        disaggregated = generate(decode, f"pd-{index}", prompt, cluster["prefill"], params=sampling(24))
        assert colocated.token_ids == reference
        assert disaggregated.token_ids == reference
        assert not colocated.kv_outcome.prefilled_remotely
        assert disaggregated.kv_outcome.prefilled_remotely
    stats = cluster["colocated"].stats()
    assert stats.spec_draft_tokens > drafts_before and stats.spec_accepted_tokens > 0  # it did speculate


@pytest.mark.parametrize("repetitive", [False, True])
def test_seeded_sampling_and_logprobs_match_colocated(cluster, llm, repetitive):
    """The prefill worker samples output position 0, the decode worker the rest: a seeded
    request gives the same tokens (and logprobs) as on one colocated engine, which speculates
    (on the repetitive prompt, with drafts mostly accepted)."""
    prompt = llm.tokenizer.encode("red green blue " * 12) if repetitive else random_prompt(7, 40)
    params = sampling(16, temperature=0.9, seed=1234, logprobs=2, top_p=0.95)
    colocated = generate(cluster["colocated"], f"seeded-colo-{repetitive}", prompt, params=params)
    disaggregated = generate(cluster["decode"][TRANSPORTS[0]], f"seeded-pd-{repetitive}", prompt, cluster["prefill"],
                             params=params)
    assert disaggregated.kv_outcome.prefilled_remotely
    assert disaggregated.token_ids == colocated.token_ids
    colo_lp = [lp for chunk in colocated.chunks for lp in chunk.logprobs]
    pd_lp = [lp for chunk in disaggregated.chunks for lp in chunk.logprobs]
    assert [lp.token_id for lp in pd_lp] == colocated.token_ids == [lp.token_id for lp in colo_lp]
    assert len(pd_lp[0].top) == 2
    for mine, theirs in zip(pd_lp, colo_lp):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t.token_id for t in mine.top] == [t.token_id for t in theirs.top]


def test_a_resumed_generation_continues_exactly(cluster, llm):
    """What the router sends after a decode worker died mid-stream: the prompt plus the tokens
    already delivered, marked as resumed. Colocated and through a prefill worker (which then
    samples output position 5), greedy and seeded, the stream goes on with the uninterrupted
    run's tokens, max_tokens counting the resumed ones."""
    decode = cluster["decode"][TRANSPORTS[0]]
    for index, params in enumerate((sampling(20), sampling(20, temperature=0.9, seed=99, frequency_penalty=0.3))):
        prompt = random_prompt(61 + index, 50)  # new to every worker (seeds no other test uses)
        full = generate(cluster["colocated"], f"resume-full-{params.seed}", prompt, params=params).token_ids
        colocated = generate(cluster["colocated"], f"resume-colo-{params.seed}", prompt + full[:5], params=params,
                             num_resumed_tokens=5)
        disaggregated = generate(decode, f"resume-pd-{params.seed}", prompt + full[:5], cluster["prefill"],
                                 params=params, num_resumed_tokens=5)
        assert colocated.token_ids == full[5:] and disaggregated.token_ids == full[5:]
        assert disaggregated.kv_outcome.prefilled_remotely
        assert colocated.kv_outcome.num_prompt_tokens == disaggregated.kv_outcome.num_prompt_tokens == len(prompt)
    assert full != generate(cluster["colocated"], "resume-greedy", prompt, params=sampling(20)).token_ids  # seeded differs


def test_shared_prefix_hits_the_prefill_workers_cache(cluster, llm):
    first = random_prompt(11, 100)
    second = first[:96] + random_prompt(12, 20)
    prefill = cluster["prefill"]
    decodes = list(cluster["decode"].values())
    generate(decodes[0], "prefix-a", first, prefill)
    before = prefill.stats()
    # a decode worker that has not seen the prefix: it receives every block, P computes only the tail
    result = generate(decodes[-1], "prefix-b", second, prefill)
    after = prefill.stats()
    assert after.prefix_cache_hits - before.prefix_cache_hits == 96
    assert after.prompt_tokens_computed - before.prompt_tokens_computed == len(second) - 96
    assert result.kv_outcome.num_cached_tokens == 96
    assert result.token_ids == offline(llm, second)


def test_follow_up_turn_transfers_only_missing_blocks(cluster, llm, bytes_per_block):
    decode, prefill = cluster["decode"][TRANSPORTS[0]], cluster["prefill"]
    turn1 = random_prompt(21, 50)
    answer = generate(decode, "turn-1", turn1, prefill)
    assert answer.kv_outcome.kv_bytes_received == blocks(len(turn1)) * bytes_per_block
    turn2 = turn1 + answer.token_ids + random_prompt(22, 30)
    before = decode.stats()
    result = generate(decode, "turn-2", turn2, prefill)
    after = decode.stats()
    # the decode worker cached the full blocks of turn 1 and of its own answer (all computed but the last token)
    cached_blocks = (len(turn1) + len(answer.token_ids) - 1) // BLOCK
    assert after.prefix_cache_hits - before.prefix_cache_hits == cached_blocks * BLOCK
    expected = (blocks(len(turn2)) - cached_blocks) * bytes_per_block
    assert result.kv_outcome.prefilled_remotely
    assert result.kv_outcome.kv_bytes_received == expected
    assert after.kv_bytes_received - before.kv_bytes_received == expected
    # imported prompt tokens count as computed: the decode worker ran only the decode steps
    assert after.prompt_tokens_computed == before.prompt_tokens_computed
    assert after.decode_tokens - before.decode_tokens == NEW - 1
    assert expected < blocks(len(turn2)) * bytes_per_block
    assert result.token_ids == offline(llm, turn2)


def test_follow_up_turn_after_eviction_reloads_the_history_from_the_host_tier(cluster, llm, bytes_per_block):
    """The decode worker's small pool is filled by other traffic between two turns; its host
    tier kept the first turn's blocks, so turn 2 copies them back and receives only the rest."""
    decode, prefill = cluster["tiered"], cluster["prefill"]
    assert decode.stats().host_cache_blocks_total > 0
    turn1 = random_prompt(71, 50)
    answer = generate(decode, "tier-1", turn1, prefill)
    for index in range(2):  # each fills the 16-block pool
        generate(decode, f"tier-filler-{index}", random_prompt(72 + index, 14 * BLOCK), prefill, params=sampling(2))
    turn2 = turn1 + answer.token_ids + random_prompt(74, 30)
    before = decode.stats()
    result = generate(decode, "tier-2", turn2, prefill)
    after = decode.stats()
    restored = (len(turn1) + len(answer.token_ids) - 1) // BLOCK * BLOCK
    assert after.host_cache_hits - before.host_cache_hits == restored
    assert after.prefix_cache_hits - before.prefix_cache_hits == restored  # all of D's hit came from the tier
    assert result.kv_outcome.kv_bytes_received == (blocks(len(turn2)) - restored // BLOCK) * bytes_per_block
    assert result.token_ids == offline(llm, turn2)


def test_short_uncached_tail_is_prefilled_locally(cluster, llm):
    decode, prefill = cluster["decode"][TRANSPORTS[0]], cluster["prefill"]
    prompt = random_prompt(31, THRESHOLD - 3)
    before = prefill.stats()
    result = generate(decode, "short", prompt, prefill)
    assert not result.kv_outcome.prefilled_remotely
    assert result.kv_outcome.kv_bytes_received == 0
    assert prefill.stats().prefix_cache_queries == before.prefix_cache_queries  # P never saw it
    assert result.token_ids == offline(llm, prompt)


def _refused(call, *args):
    with pytest.raises(grpc.RpcError) as info:
        result = call(*args, timeout=60)
        if not isinstance(result, wire.messages().PrefillResponse):
            list(result)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return info.value.details()


@pytest.mark.parametrize("worker", ["decode", "colocated"])
def test_bad_requests_are_invalid_argument(cluster, worker):
    pb = wire.messages()
    decode = cluster["decode"][TRANSPORTS[0]] if worker == "decode" else cluster["colocated"]
    stub = decode.stub()
    prefill_address = cluster["prefill"].grpc_address

    def ask(prompt, params):
        return _refused(stub.Generate, pb.GenerateRequest(request_id="bad", prompt_token_ids=prompt, sampling=params,
                                                          prefill_address=prefill_address))

    assert "prompt is empty" in ask([], sampling())
    assert "context is 8192 tokens" in ask([5] * 9000, sampling())
    assert "outside the vocabulary" in ask([5, 10 ** 6], sampling())
    assert "temperature" in ask([5, 6], sampling(temperature=-1.0))
    assert "top_p" in ask([5, 6], sampling(top_p=0.0))
    assert "top_k" in ask([5, 6], sampling(top_k=-7))
    assert "max_tokens" in ask([5, 6], sampling(max_tokens=0))
    assert "repetition_penalty" in ask([5, 6], sampling(repetition_penalty=0.0))


def test_prefill_worker_refuses_bad_requests(cluster, llm):
    pb = wire.messages()
    stub = cluster["prefill"].stub()
    cache = llm.engine.runner.kv_cache.data
    layout = pb.KVLayout(num_layers=cache.shape[0], block_size=BLOCK, num_kv_heads=cache.shape[4],
                         head_dim=cache.shape[5], dtype="float32")

    def ask(prompt, params=None, **destination):
        fields = dict(transport="tcp", address="tcp://127.0.0.1:9", layout=layout, block_ids=[1, 2],
                      first_block_index=0)
        fields.update(destination)
        return _refused(stub.Prefill, pb.PrefillRequest(request_id="bad", prompt_token_ids=prompt,
                                                        sampling=params or sampling(),
                                                        destination=pb.KVDestination(**fields)))

    assert "prompt is empty" in ask([])
    assert "temperature" in ask([5] * 20, sampling(temperature=-2.0))
    message = ask([5] * 20, layout=pb.KVLayout(num_layers=2, block_size=BLOCK, num_kv_heads=3, head_dim=64,
                                               dtype="float32"))
    assert "KV layout mismatch" in message and "layers=2" in message and f"layers={cache.shape[0]}" in message
    assert "has 2 blocks" in ask([5] * 20, block_ids=[1, 2, 3])
    assert "address is empty" in ask([5] * 20, address="")


# Resident memory beyond the weights (their pre-blocked copies included) and the KV cache: the
# interpreter, torch, gRPC, the tokenizer and the allocator's cached activations after the tests
# above (measured: see the test's output).
WORKER_MEMORY_OVERHEAD_BYTES = 1 << 30


def test_each_workers_memory_is_weights_plus_kv_cache_plus_a_bounded_overhead(cluster, bytes_per_block):
    """After the requests above: a worker's RSS (its Stats) stays within its weights (float32, and
    their pre-blocked copy where oneDNN is there: `weight_bytes`), its KV cache, its host cache tier
    and WORKER_MEMORY_OVERHEAD_BYTES."""
    import math
    loaded = resolve_model("default")
    params = 4 * sum(math.prod(shape) for shape in loaded.weight_shapes().values())
    for worker in [cluster["prefill"], cluster["colocated"], *cluster["decode"].values(), cluster["tiered"]]:
        stats = worker.stats()
        weights = stats.weight_bytes
        assert params <= weights <= 2 * params  # the parameters, and at most one blocked copy of each
        budget = weights + stats.kv_blocks_total * bytes_per_block + stats.host_cache_blocks_total * bytes_per_block
        overhead = stats.rss_bytes - weights - stats.kv_blocks_total * bytes_per_block
        print(f"{worker.grpc_address}: rss {stats.rss_bytes / 2**20:.0f} MiB, overhead {overhead / 2**20:.0f} MiB")
        assert weights < stats.rss_bytes <= budget + WORKER_MEMORY_OVERHEAD_BYTES
