import math

import pytest
import torch

from engine.sampler import (Sampler, SamplingMetadata, apply_min_p, apply_penalties, apply_top_k_top_p,
                            inverse_cdf_sample, seeded_uniform)
from engine.sampling_params import SamplingParams

VOCAB = 64


def build(params, vocab=VOCAB, prompts=None, outputs=None):
    prompts = prompts if prompts is not None else [[] for _ in params]
    outputs = outputs if outputs is not None else [[] for _ in params]
    return SamplingMetadata.build(params, prompts, outputs, vocab, "cpu")


def random_logits(num_rows, vocab=VOCAB, seed=0, scale=3.0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab, generator=generator) * scale


# ---- greedy and its limits ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    logits = random_logits(8).to(dtype)
    meta = build([SamplingParams(temperature=0.0)] * 8)
    assert meta.all_greedy and meta.temperature is None and meta.penalties is None
    out = Sampler()(logits, meta)
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_rows_in_a_mixed_batch_take_argmax():
    logits = random_logits(6)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5) for i in range(6)]
    out = Sampler()(logits, build(params))
    argmax = logits.argmax(-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]


def test_logit_bias_and_banned_tokens_per_row_leave_the_raw_logprobs():
    logits = random_logits(3)
    best = logits.argmax(-1).tolist()
    second = logits.topk(2, dim=-1).indices[:, 1].tolist()
    params = [SamplingParams(temperature=0.0, logit_bias={best[0]: -100.0}, logprobs=1),
              SamplingParams(temperature=0.0, logit_bias={7: 100.0}),
              SamplingParams(temperature=0.0)]
    meta = SamplingMetadata.build(params, [[], [], []], [[], [], []], VOCAB, "cpu", banned=[[], [], [best[2]]])
    out = Sampler()(logits, meta)
    assert out.token_ids == [second[0], 7, second[2]]  # banned: the next best; +100 forces
    raw = torch.log_softmax(logits[0], -1)
    assert out.logprobs[0] == pytest.approx(float(raw[second[0]]), abs=1e-5)  # of the unbiased distribution
    assert build([SamplingParams()] * 2).bias_positions is None  # nothing to add: no work


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    from engine.model_runner import _banned_now
    from engine.request import Request
    params = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[9])
    request = Request("r", [1, 2], params, eos_token_ids={0})
    assert _banned_now(request, 0) == _banned_now(request, 1) == [0, 9]
    assert _banned_now(request, 2) == []  # e.g. a draft's second row: two outputs before it
    with pytest.raises(ValueError, match=r"min_tokens must be an integer in \[0, max_tokens\]"):
        SamplingParams(max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError, match=r"logit_bias values must be in \[-100, 100\]"):
        SamplingParams(logit_bias={1: 101.0})


def test_top_k_one_is_greedy():
    logits = random_logits(32, seed=1)
    out = Sampler(seed=5)(logits, build([SamplingParams(temperature=2.0, top_k=1)] * 32))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_is_greedy():
    logits = random_logits(32, seed=2)
    out = Sampler(seed=6)(logits, build([SamplingParams(temperature=2.0, top_p=1e-6)] * 32))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_min_p_one_is_greedy_and_min_p_masks_below_the_ratio():
    logits = random_logits(32, seed=3)
    out = Sampler(seed=7)(logits, build([SamplingParams(temperature=1.0, min_p=1.0)] * 32))
    assert out.token_ids == logits.argmax(-1).tolist()

    probs = torch.tensor([[0.5, 0.3, 0.12, 0.08]])
    masked = apply_min_p(probs.log(), torch.tensor([0.2]))  # keeps p >= 0.1
    assert torch.isfinite(masked[0]).tolist() == [True, True, True, False]
    assert torch.equal(apply_min_p(probs.log(), torch.tensor([0.0])), probs.log())


# ---- penalties ----------------------------------------------------------------------------------

def reference_penalties(logits, params, prompts, outputs):
    result = logits.clone()
    for row, (p, prompt, output) in enumerate(zip(params, prompts, outputs)):
        for token in set(prompt) | set(output):
            value = result[row, token]
            result[row, token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        for token in set(output):
            result[row, token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return result


def test_penalties_change_exactly_the_right_logits():
    logits = random_logits(4, seed=4)
    params = [SamplingParams(repetition_penalty=1.5),
              SamplingParams(presence_penalty=0.7, frequency_penalty=0.3),
              SamplingParams(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.0),
              SamplingParams()]
    prompts = [[1, 2, 3, 3], [4, 5], [6, 7, 8], [9]]
    outputs = [[3, 10, 10], [5, 11, 11, 11], [12, 6, 12], [13]]
    meta = build(params, prompts=prompts, outputs=outputs)
    original = logits.clone()
    got = apply_penalties(logits, meta.penalties)
    assert torch.equal(logits, original)  # the caller's logits are not modified
    expected = reference_penalties(logits, params, prompts, outputs)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert torch.equal(got[3], logits[3])  # a row without penalties is untouched
    untouched = [t for t in range(VOCAB) if t not in {1, 2, 3, 10}]
    assert torch.equal(got[0, untouched], logits[0, untouched])


def test_penalties_steer_greedy_choice():
    logits = torch.full((1, VOCAB), -1.0)
    logits[0, 7], logits[0, 9] = 3.0, 2.5
    plain = Sampler()(logits, build([SamplingParams(temperature=0.0)], outputs=[[7, 7]]))
    assert plain.token_ids == [7]
    penalized = Sampler()(logits, build([SamplingParams(temperature=0.0, frequency_penalty=0.5)], outputs=[[7, 7]]))
    assert penalized.token_ids == [9]  # 3.0 - 2 * 0.5 = 2.0 < 2.5


def test_penalty_metadata_rejects_out_of_vocab_tokens():
    with pytest.raises(ValueError, match="token id 64 is outside the vocabulary"):
        build([SamplingParams(repetition_penalty=1.2)], prompts=[[1, 64]])


# ---- top-k / top-p against a per-row reference ---------------------------------------------------

def reference_top_k_top_p(logits, top_ks, top_ps):
    result = logits.clone()
    for row in range(logits.shape[0]):
        values = result[row]
        if top_ks[row] < logits.shape[1]:
            kth = torch.sort(values, descending=True).values[top_ks[row] - 1]
            values[values < kth] = -math.inf
        if top_ps[row] < 1.0:
            ordered = torch.sort(values, descending=True).values
            cumulative = torch.softmax(ordered, dim=0).cumsum(0)
            index = min(int((cumulative < top_ps[row]).sum()), len(ordered) - 1)
            values[values < ordered[index]] = -math.inf
    return result


@pytest.mark.parametrize("vocab", [64, 1000, 5000])
def test_top_k_top_p_match_reference(vocab):
    generator = torch.Generator().manual_seed(11)
    num_rows = 12
    logits = torch.randn(num_rows, vocab, generator=generator)
    logits[0, :5] = logits[0, 5]  # ties at a cut-off are kept
    if vocab > 256:  # nearly flat rows: nuclei larger than the first candidate sets
        logits[2] = 0.01 * logits[2]
        logits[11] = 0.01 * logits[11]
    top_ks = [vocab, 3, vocab, 10, 1, vocab, 50, vocab, 2, vocab, 7, vocab]
    top_ps = [0.9, 1.0, 0.95, 0.5, 0.3, 0.05, 1.0, 0.999, 0.7, 1.0, 0.8, 0.6]
    max_top_k = max(k for k in top_ks if k < vocab)
    got = apply_top_k_top_p(logits, torch.tensor(top_ks), max_top_k, torch.tensor(top_ps))
    expected = reference_top_k_top_p(logits, top_ks, top_ps)
    assert torch.equal(torch.isfinite(got), torch.isfinite(expected))
    assert torch.equal(got[torch.isfinite(got)], logits[torch.isfinite(got)])
    kept = torch.isfinite(got).sum(-1).tolist()
    if vocab == 5000:  # exercised each candidate stage: 256, 4096 and the full sort
        assert kept[5] < 256 < kept[11] < 4096 < kept[2]
    only_k = apply_top_k_top_p(logits, torch.tensor(top_ks), max_top_k, None)
    assert torch.equal(torch.isfinite(only_k), torch.isfinite(reference_top_k_top_p(logits, top_ks, [1.0] * 12)))


# ---- seeds ----------------------------------------------------------------------------------------

def test_seeded_rows_ignore_batch_row_index_and_sampler_seed():
    target = random_logits(1, seed=20)[0]
    seeded = SamplingParams(temperature=1.0, seed=1234, top_p=0.95)

    def draw(sampler, num_rows, row, output_len, batch_seed):
        logits = random_logits(num_rows, seed=batch_seed)
        logits[row] = target
        params = [SamplingParams(temperature=0.8 + 0.1 * i, seed=None if i % 2 else i) for i in range(num_rows)]
        params[row] = seeded
        outputs = [[0] * ((i * 7) % 5) for i in range(num_rows)]
        outputs[row] = [0] * output_len
        return sampler(logits, build(params, outputs=outputs)).token_ids[row]

    for output_len in range(6):
        alone = draw(Sampler(seed=0), 1, 0, output_len, batch_seed=1)
        assert draw(Sampler(seed=99), 9, 4, output_len, batch_seed=2) == alone
        assert draw(Sampler(seed=3), 5, 0, output_len, batch_seed=3) == alone


def test_seeds_and_positions_give_different_draws():
    logits = torch.zeros(1, VOCAB)  # uniform over the vocabulary

    def tokens(seed):
        return [Sampler()(logits, build([SamplingParams(seed=seed)], outputs=[[0] * pos])).token_ids[0]
                for pos in range(16)]

    first, second = tokens(1), tokens(2)
    assert first == tokens(1)
    assert first != second
    assert len(set(first)) > 4  # positions are not one repeated draw
    assert seeded_uniform(1, 0) != seeded_uniform(1, 1) and seeded_uniform(-5, 3) == seeded_uniform(-5, 3)
    assert all(0.0 <= seeded_uniform(s, p) < 1.0 for s in range(50) for p in range(50))


def test_unseeded_rows_follow_the_sampler_seed():
    logits = torch.zeros(16, VOCAB)
    meta = build([SamplingParams()] * 16)
    assert Sampler(seed=4)(logits, meta).token_ids == Sampler(seed=4)(logits, meta).token_ids
    assert Sampler(seed=4)(logits, meta).token_ids != Sampler(seed=5)(logits, meta).token_ids


# ---- distributions ----------------------------------------------------------------------------

def assert_frequencies(tokens, expected_probs):
    """Every token's empirical frequency within 5 standard errors of its probability."""
    num_draws = len(tokens)
    counts = torch.bincount(torch.tensor(tokens), minlength=len(expected_probs)).double() / num_draws
    expected = torch.as_tensor(expected_probs, dtype=torch.float64)
    bound = 5 * (expected * (1 - expected) / num_draws).sqrt() + 1e-12
    assert ((counts - expected).abs() <= bound).all(), (counts.tolist(), expected.tolist())


BASE_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


@pytest.mark.parametrize("params,keep", [
    (SamplingParams(temperature=0.7), 8),
    (SamplingParams(temperature=1.3, top_k=3), 3),
    (SamplingParams(temperature=1.0, top_p=0.8), None),
])
def test_sampling_distribution(params, keep):
    num_draws = 20000
    scaled = BASE_LOGITS / params.temperature
    probs = torch.softmax(scaled, 0).double()
    if keep is None:  # nucleus: smallest prefix reaching top_p
        keep = int((probs.cumsum(0) < params.top_p).sum()) + 1
    probs[keep:] = 0
    probs /= probs.sum()
    logits = BASE_LOGITS.repeat(num_draws, 1)
    tokens = Sampler(seed=17)(logits, build([params] * num_draws, vocab=8)).token_ids
    assert_frequencies(tokens, probs)


def test_seeded_draws_have_the_right_distribution():
    num_draws = 20000
    params = [SamplingParams(temperature=1.0, seed=seed) for seed in range(num_draws)]
    tokens = Sampler()(BASE_LOGITS.repeat(num_draws, 1), build(params, vocab=8)).token_ids
    assert_frequencies(tokens, torch.softmax(BASE_LOGITS, 0).double())
    positions = [[0] * (i % 97) for i in range(num_draws)]
    one_seed = [SamplingParams(temperature=1.0, seed=42 + i // 97) for i in range(num_draws)]
    tokens = Sampler()(BASE_LOGITS.repeat(num_draws, 1), build(one_seed, vocab=8, outputs=positions)).token_ids
    assert_frequencies(tokens, torch.softmax(BASE_LOGITS, 0).double())


def test_never_samples_masked_tokens():
    logits = torch.full((500, VOCAB), -2.0)
    logits[:, :3] = torch.tensor([1.0, 0.9, 0.8])
    tokens = Sampler()(logits, build([SamplingParams(temperature=5.0, top_k=3)] * 500)).token_ids
    assert set(tokens) == {0, 1, 2}


def test_inverse_cdf_edges_never_pick_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0, 0.0]] * 4)
    uniforms = torch.tensor([0.0, 0.2499, 0.25, 1.0 - 2.0 ** -24])
    assert inverse_cdf_sample(probs, uniforms).tolist() == [1, 1, 3, 3]


# ---- logprobs ----------------------------------------------------------------------------------

def test_logprobs_are_of_the_raw_distribution():
    logits = random_logits(4, seed=30)
    params = [SamplingParams(temperature=0.5, top_k=5, logprobs=3, repetition_penalty=2.0),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, logprobs=0),
              SamplingParams(temperature=0.0, logprobs=20)]
    out = Sampler(seed=1)(logits, build(params, prompts=[[1, 2]] * 4))
    raw = torch.log_softmax(logits, -1)
    for row, token in enumerate(out.token_ids):
        assert out.logprobs[row] == pytest.approx(raw[row, token].item(), abs=1e-6)
    assert out.top_logprobs[1] == [] and out.top_logprobs[2] == []
    for row, k in ((0, 3), (3, 20)):
        entries = out.top_logprobs[row]
        assert len(entries) == k
        values = [v for _, v in entries]
        assert values == sorted(values, reverse=True)
        expected = torch.topk(raw[row], k)
        assert [t for t, _ in entries] == expected.indices.tolist()
        assert values == pytest.approx(expected.values.tolist(), abs=1e-6)


# ---- errors ------------------------------------------------------------------------------------

def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="one of each per sequence"):
        SamplingMetadata.build([SamplingParams()], [[1], [2]], [[]], VOCAB, "cpu")
    with pytest.raises(ValueError, match="empty batch"):
        SamplingMetadata.build([], [], [], VOCAB, "cpu")
    with pytest.raises(ValueError, match=r"logits must be \[num_seqs=2, vocab\]"):
        Sampler()(torch.zeros(3, VOCAB), build([SamplingParams()] * 2))
    with pytest.raises(ValueError, match="built for a vocabulary of 64"):
        Sampler()(torch.zeros(1, 80), build([SamplingParams(presence_penalty=1.0)]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_agrees_with_cpu():
    vocab = 5000
    logits = random_logits(12, vocab=vocab, seed=40)
    logits[:, :8] += 6.0  # peaked, like a language model: draws are far from rounding boundaries
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=1),
              SamplingParams(temperature=0.7, top_k=5, seed=2), SamplingParams(top_p=0.8, seed=3),
              SamplingParams(min_p=0.1, seed=4), SamplingParams(repetition_penalty=1.3, seed=5, logprobs=4)] * 2
    prompts, outputs = [[1, 2, 3]] * 12, [[4, 5, 5]] * 12
    cpu = Sampler()(logits, build(params, vocab, prompts, outputs))
    gpu = Sampler()(logits.cuda(), SamplingMetadata.build(params, prompts, outputs, vocab, "cuda"))
    assert gpu.token_ids == cpu.token_ids
    assert gpu.logprobs == pytest.approx(cpu.logprobs, abs=1e-5)
    top_ks = [vocab, 3, vocab, 10]
    top_ps = [0.9, 1.0, 0.3, 0.6]
    masks = apply_top_k_top_p(logits[:4].cuda(), torch.tensor(top_ks).cuda(), 10, torch.tensor(top_ps).cuda())
    assert torch.equal(torch.isfinite(masks).cpu(), torch.isfinite(reference_top_k_top_p(logits[:4], top_ks, top_ps)))
