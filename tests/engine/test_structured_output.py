"""Structured output (engine/structured_output.py): constraint validation, the sampler's mask, and
the whole engine on the default model producing text that matches the constraint."""
import json
import re

import pytest
import torch

from engine import LLM, SamplingParams, StructuredOutput
from engine.sampler import Sampler, SamplingMetadata
from engine.structured_output import GrammarCompiler, allocate_bitmask

PERSON = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "languages": {"type": "array", "items": {"type": "string", "enum": ["pt", "en", "fr"]}}},
          "required": ["name", "age", "languages"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe Ana, who is 31 and speaks Portuguese and English, as JSON."}]


def _nested(levels):
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"inner": schema}}
    return schema


# ---- constraints, no model ----------------------------------------------------------------------

@pytest.mark.parametrize("make, message", [
    (lambda: StructuredOutput("xml"), "kind must be one of"),
    (lambda: StructuredOutput.json_schema("{not json"), "not valid JSON"),
    (lambda: StructuredOutput.json_schema("[1, 2]"), "must be an object"),
    (lambda: StructuredOutput.json_schema({"type": "foo"}), 'Unsupported type "foo"'),
    (lambda: StructuredOutput("json_schema", "  "), "needs a non-empty JSON schema"),
    (lambda: StructuredOutput.regex("[a-"), "invalid regular expression"),
    (lambda: StructuredOutput.grammar('root ::= "a" | '), "invalid EBNF grammar"),
    (lambda: StructuredOutput.choice([]), "needs 1 to 1024 options"),
    (lambda: StructuredOutput.choice(["a", ""]), "non-empty strings"),
    (lambda: StructuredOutput.choice("yes"), "a list of strings"),
    (lambda: StructuredOutput("regex", "a+", ("a",)), "only for the 'choice' kind"),
    (lambda: StructuredOutput.regex("a" * (64 << 10) + "b"), "more than the 65536 this server accepts"),
    (lambda: StructuredOutput.choice(["x" * 1000] * 70), "more than the 65536"),
    (lambda: StructuredOutput.json_schema(_nested(40)), "nests deeper than 64 levels"),
])
def test_a_bad_constraint_is_a_value_error_naming_the_problem(make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


def test_a_schema_at_the_depth_limit_is_accepted():
    assert StructuredOutput.json_schema(_nested(31)).kind == "json_schema"


@pytest.mark.parametrize("text, accepted", [
    ('{"a": [1, {"b": null}], "c": "d"}', True), ("{}", True), ("[1]", False), ('"x"', False), ("1", False),
    ("null", False),
])
def test_json_object_is_an_object_not_any_json_value(text, accepted):
    # OpenAI's JSON mode promises an object; seeded sampling once gave `[1]` and `[{}]`.
    xgr = pytest.importorskip("xgrammar")
    grammar = StructuredOutput.json_object().grammar_object()
    assert xgr.testing._is_grammar_accept_string(grammar, text) is accepted


def test_sampling_params_take_only_a_structured_output():
    with pytest.raises(ValueError, match="structured_output must be"):
        SamplingParams(structured_output={"regex": "a"})
    params = SamplingParams(structured_output=StructuredOutput.regex("a+"))
    assert params.structured_output.kind == "regex" and params.structured_output.spec == "a+"


class _AllowOnly:
    """A grammar state stand-in that allows a fixed set of tokens."""

    def __init__(self, allowed):
        self.allowed = allowed

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0
        for token in self.allowed:
            bitmask[row, token // 32] |= torch.tensor(1 << (token % 32), dtype=torch.int64).to(torch.int32)


def test_the_sampler_masks_only_rows_with_a_grammar_and_keeps_raw_logprobs():
    vocab = 100
    torch.manual_seed(0)
    logits = torch.randn(3, vocab)
    top = logits.argmax(dim=-1).tolist()
    allowed = [t for t in (5, 37, 64, 99) if t != top[0]]
    params = [SamplingParams(temperature=0.0, logprobs=2)] * 2 + [SamplingParams(temperature=0.7, seed=3)]
    grammars = [_AllowOnly(allowed), None, _AllowOnly([41])]
    meta = SamplingMetadata.build(params, [[1]] * 3, [[]] * 3, vocab, "cpu", grammars=grammars)
    assert meta.bitmask_rows == [0, 2]
    out = Sampler()(logits.clone(), meta)
    assert out.token_ids[0] == max(allowed, key=lambda t: logits[0, t])  # the best allowed token
    assert out.token_ids[1] == top[1]  # an unconstrained row in the same batch is untouched
    assert out.token_ids[2] == 41  # a sampled row can only draw what its grammar allows
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[0] == pytest.approx(raw[0, out.token_ids[0]].item(), abs=1e-5)
    assert [t for t, _ in out.top_logprobs[0]] == raw[0].topk(2).indices.tolist()


def test_min_tokens_does_not_ban_the_only_tokens_a_finished_grammar_allows():
    """min_tokens bans EOS (2) and the stop ids (7); a grammar at its end allows only EOS. The
    grammar wins there (the row ends); where it allows more, the ban holds."""
    vocab = 40
    logits = torch.zeros(3, vocab)
    logits[:, 2] = 5.0  # EOS is the model's favourite everywhere
    params = [SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[7]),
              SamplingParams(temperature=0.8, seed=1, min_tokens=4, stop_token_ids=[7]),
              SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[7])]
    grammars = [_AllowOnly([2]), _AllowOnly([2, 7]), _AllowOnly([2, 7, 11])]
    banned = [[2, 7]] * 3
    meta = SamplingMetadata.build(params, [[1]] * 3, [[]] * 3, vocab, "cpu", grammars=grammars, banned=banned)
    out = Sampler()(logits.clone(), meta)
    assert out.token_ids == [2, out.token_ids[1], 11]
    assert out.token_ids[1] in (2, 7)  # only banned tokens allowed: may end
    assert banned == [[2, 7]] * 3  # the caller's lists are not changed


@pytest.mark.slow
def test_min_tokens_with_a_constraint_ends_where_the_grammar_does(llm):
    """A choice is shorter than min_tokens: the output is the choice, finished, not an error."""
    for temperature in (0.0, 0.8):
        out = _generate(llm, ASK, StructuredOutput.choice(["yes", "no"]), min_tokens=8, temperature=temperature,
                        seed=5)
        assert (out.finish_reason, out.text) in (("stop", "yes"), ("stop", "no")), out
    _assert_clean(llm.engine)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch-fallback"])
def test_bitmask_application_matches_xgrammar_on_every_word_pattern(native, monkeypatch):
    """All-allowed, all-refused and mixed words, a vocabulary that is not a multiple of 32, and
    only some rows masked: the result equals xgrammar's reference kernel bit for bit."""
    import xgrammar

    from engine import cpu_kernels
    from engine.structured_output import apply_bitmask

    if native and cpu_kernels.load() is None:
        pytest.skip("the native CPU kernels cannot be built here")
    if not native:
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    generator = torch.Generator().manual_seed(1)
    vocab, num_rows = 1000, 5
    bitmask = torch.randint(-2**31, 2**31, (num_rows, (vocab + 31) // 32), dtype=torch.int64,
                            generator=generator).to(torch.int32)
    bitmask[:, :4] = -1  # every token allowed
    bitmask[:, 4:8] = 0  # every token refused
    bitmask[1] = 0
    logits = torch.randn(num_rows, vocab, generator=generator)
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask, indices=[0, 1, 3], backend="torch_native")
    apply_bitmask(logits, bitmask, [0, 1, 3])
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[1]).all() and not torch.isinf(logits[2]).any()


# ---- on the default model -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm():
    return LLM("default")


@pytest.fixture(scope="module")
def compiler(llm):
    return llm.engine._grammar_compiler()


def _generate(llm, prompt, constraint, **params):
    values = dict(max_tokens=96, temperature=0.0)
    values.update(params)
    return llm.generate([prompt], SamplingParams(structured_output=constraint, **values), use_tqdm=False)[0]


def _assert_clean(engine):
    engine.scheduler.check_integrity()
    stats = engine.scheduler.stats()
    assert stats.running == stats.waiting == 0 and stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.slow
def test_json_schema_output_parses_and_matches_the_schema(llm):
    out = _generate(llm, ASK, StructuredOutput.json_schema(PERSON))
    value = json.loads(out.text)
    assert out.finish_reason == "stop"
    assert set(value) == {"name", "age", "languages"}
    assert isinstance(value["name"], str) and isinstance(value["age"], int) and not isinstance(value["age"], bool)
    assert all(language in ("pt", "en", "fr") for language in value["languages"])
    assert out.token_ids[-1] in llm.engine.eos_token_ids  # it ended because the grammar was complete
    _assert_clean(llm.engine)


@pytest.mark.slow
def test_greedy_takes_the_most_likely_token_the_grammar_allows(llm, compiler):
    """Replaying the grammar over the output: at every position the sampled token is the one with
    the highest raw logprob among the allowed tokens of the top 20 (raw logprobs are returned)."""
    constraint = StructuredOutput.json_schema(PERSON)
    out = _generate(llm, ASK, constraint, logprobs=20)
    state = compiler.state(constraint)
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    checked = 0
    for token, entry in zip(out.token_ids, out.logprobs):
        state.fill_bitmask(bitmask, 0)
        allowed = [(lp, t) for t, lp in entry.top_logprobs if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
        if allowed:
            assert token == max(allowed)[1]
            checked += 1
        assert state.accept(token)
    assert state.is_terminated and checked >= len(out.token_ids) // 2


@pytest.mark.slow
@pytest.mark.parametrize("constraint, check", [
    (StructuredOutput.json_object(), lambda text: isinstance(json.loads(text), dict)),
    (StructuredOutput.regex(r"\+351 \d{3} \d{3} \d{3}"), lambda text: re.fullmatch(r"\+351 \d{3} \d{3} \d{3}", text)),
    (StructuredOutput.choice(['say "yes"', "no\\maybe", "não\n"]), lambda text: text in ('say "yes"', "no\\maybe",
                                                                                        "não\n")),
    (StructuredOutput.grammar('root ::= "The answer is " [A-D] "."'),
     lambda text: re.fullmatch(r"The answer is [A-D]\.", text)),
], ids=["json_object", "regex", "choice", "grammar"])
def test_every_kind_of_constraint_is_obeyed(llm, constraint, check):
    out = _generate(llm, ASK, constraint, max_tokens=200)
    assert out.finish_reason == "stop" and check(out.text), out.text


@pytest.mark.slow
def test_sampled_json_object_answers_are_objects(llm):
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=seed, structured_output=StructuredOutput.json_object())
              for seed in range(4)]
    for out in llm.generate([[{"role": "user", "content": "hi"}]] * 4, params, use_tqdm=False):
        assert out.text.lstrip().startswith("{"), out.text
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict), out.text


@pytest.mark.slow
def test_seeded_sampling_obeys_the_constraint_and_is_reproducible(llm):
    constraint = StructuredOutput.json_schema(PERSON)
    params = [SamplingParams(max_tokens=128, temperature=1.0, seed=seed, structured_output=constraint)
              for seed in range(4)]
    outs = llm.generate([ASK] * 4, params, use_tqdm=False)
    for out in outs:
        assert out.finish_reason in ("stop", "length")
        if out.finish_reason == "stop":
            assert set(json.loads(out.text)) == {"name", "age", "languages"}
    again = llm.generate([ASK], params[1], use_tqdm=False)[0]
    assert again.token_ids == outs[1].token_ids


@pytest.mark.slow
def test_the_grammar_ends_the_request_even_with_ignore_eos_and_max_tokens_cuts_it(llm):
    constraint = StructuredOutput.choice(["red", "green"])
    out = _generate(llm, ASK, constraint, ignore_eos=True)
    assert out.finish_reason == "stop" and out.text in ("red", "green")
    cut = _generate(llm, ASK, StructuredOutput.json_schema(PERSON), max_tokens=5)
    assert cut.finish_reason == "length" and len(cut.token_ids) == 5
    full = _generate(llm, ASK, StructuredOutput.json_schema(PERSON))
    assert full.token_ids[:5] == cut.token_ids
    _assert_clean(llm.engine)


@pytest.mark.slow
def test_constrained_and_free_requests_share_batches_and_chunked_prefill(llm):
    """A grammar row must not leak into its neighbours: the free request's tokens are the same
    alone and batched with constrained ones; the constrained output too."""
    prompts = [ASK, [{"role": "user", "content": "Tell me about Lisbon."}]]
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=96, temperature=0.0, structured_output=StructuredOutput.json_schema(PERSON))
    alone_free = llm.generate([prompts[1]], free, use_tqdm=False)[0].token_ids
    alone_constrained = llm.generate([prompts[0]], constrained, use_tqdm=False)[0].token_ids
    small = LLM("default", max_num_batched_tokens=16, num_blocks=64)
    both = small.generate(prompts, [constrained, free], use_tqdm=False)
    assert both[1].token_ids == alone_free
    assert both[0].token_ids == alone_constrained
    _assert_clean(small.engine)


@pytest.mark.slow
def test_a_resumed_constrained_request_continues_exactly(llm):
    """Migration: the delivered tokens are replayed into the grammar, so the continuation is the
    uninterrupted one; delivered tokens the grammar refuses are the client's error."""
    engine = llm.engine
    prompt = engine.tokenize(ASK)
    params = SamplingParams(max_tokens=96, temperature=0.8, seed=11, structured_output=StructuredOutput.json_schema(PERSON))
    full = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    delivered = full[:7]
    engine.add(engine.make_request(prompt + delivered, params, num_resumed_tokens=len(delivered)))
    streamed = []
    while engine.has_unfinished():
        for delta in engine.step():
            streamed.extend(delta.new_token_ids)
    assert streamed == full[7:]
    wrong = engine.tokenize("hello") or [42]
    with pytest.raises(ValueError, match="does not match the request's json_schema constraint"):
        engine.make_request(prompt + wrong, params, num_resumed_tokens=len(wrong))
    _assert_clean(engine)


@pytest.mark.slow
def test_a_first_token_the_grammar_refuses_ends_the_request_with_an_error():
    """Decode role: the prefill worker's first token is accepted into the grammar like any other;
    one that does not match (a prefill worker that ignored the constraint) fails the request."""
    from engine.step_types import SampledToken

    engine = LLM("default", role="decode", num_blocks=64).engine
    params = SamplingParams(max_tokens=8, temperature=0.0, structured_output=StructuredOutput.choice(["yes", "no"]))
    prompt = engine.tokenize(ASK)
    engine.add_imported(engine.make_request(prompt, params, "bad"))
    delta = engine.finish_import("bad", SampledToken(engine.tokenize("maybe")[0]))
    assert delta.finished and delta.finish_reason == "error" and "does not match" in delta.error
    engine.add_imported(engine.make_request(prompt, params, "ok"))
    delta = engine.finish_import("ok", SampledToken(engine.tokenize("yes")[0]))
    assert not delta.finished
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    # "yes" completes the grammar: the next token can only be end-of-sequence, which stops it.
    assert [o.new_token_ids[0] in engine.eos_token_ids for o in outputs] == [True]
    assert outputs[-1].finish_reason == "stop"
    _assert_clean(engine)


@pytest.mark.slow
def test_choice_options_with_quotes_backslashes_and_newlines_are_matched_exactly(llm, compiler):
    options = ['say "yes"', "no\\maybe", "não\n"]
    constraint = StructuredOutput.choice(options)
    eos = min(llm.engine.eos_token_ids)
    for option in options:
        state = compiler.state(constraint)
        assert all(state.accept(t) for t in llm.tokenizer.encode(option, add_special_tokens=False))
        assert state.accept(eos) and state.is_terminated
    state = compiler.state(constraint)
    assert not all(state.accept(t) for t in llm.tokenizer.encode("say yes", add_special_tokens=False))
    assert state.rejected_token is not None


@pytest.mark.slow
@pytest.mark.parametrize("constraint", [StructuredOutput.grammar("root ::= root"), StructuredOutput.regex("[^\\s\\S]")],
                         ids=["grammar", "regex"])
def test_a_constraint_no_text_matches_is_refused_when_the_request_is_made(llm, constraint):
    """Nothing to sample from the first token on: a ValueError (a 400 from the servers), not a
    request that samples token 0 and ends in an error."""
    with pytest.raises(ValueError, match=f"the {constraint.kind} constraint matches no text"):
        _generate(llm, ASK, constraint)
    _assert_clean(llm.engine)


@pytest.mark.slow
def test_a_constraint_that_dead_ends_part_way_says_so(llm):
    """A schema whose string pattern nothing matches: the output reaches `{"a": "` and no token is
    allowed after it. The request ends with an error naming that, not an inconsistent state."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "[^\\s\\S]"}}, "required": ["a"]}
    out = _generate(llm, ASK, StructuredOutput.json_schema(schema))
    assert out.finish_reason == "error"
    assert "json_schema constraint allows no token after" in out.error and "no text satisfies it" in out.error
    _assert_clean(llm.engine)
