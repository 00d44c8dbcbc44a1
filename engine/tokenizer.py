"""Tokenizer: text <-> token ids, chat templates, and the facts the engine needs (EOS ids, context).

`Tokenizer.from_pretrained(path)` reads a Hugging Face folder (tokenizer.json /
tokenizer_config.json) or a `.gguf` file (tokenizer built by transformers from its metadata),
or a packaged model's name (`default`, `gemma-3-270m`: engine.model.packaged_models; its GGUF,
as `resolve_model` finds it: the name wins over a folder of that name). Nothing is ever
downloaded. The object pickles cheaply (the router builds it once and may ship it to other processes).

Decoding never applies `clean_up_tokenization_spaces`, so decoding a sequence in pieces and
concatenating the pieces gives the same text as decoding it whole (what incremental
detokenization relies on). Ids outside the vocabulary decode to nothing.
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Sequence
from typing import Any

from engine.model.packaged_models import is_packaged_model, packaged_gguf_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Special tokens that end an assistant turn in common chat templates. They count as EOS when the
# model's chat template uses them, even if the model's configured EOS is another token.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                      "<|end_of_turn|>", "<|END_OF_TURN_TOKEN|>")
_EXPECTED = "a Hugging Face model folder (with tokenizer.json or tokenizer_config.json) or a .gguf file"
_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length")
_UNSET_MODEL_MAX_LENGTH = 10 ** 9  # transformers uses ~1e30 for "unknown"


class Tokenizer:
    """Wraps a transformers tokenizer with pdserve's contract (see the module docstring)."""

    def __init__(self, hf_tokenizer: Any, *, source: str, eos_token_ids: Iterable[int] = (),
                 max_model_len: int | None = None) -> None:
        self._hf = hf_tokenizer
        self.source = source
        eos = {int(i) for i in eos_token_ids}
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        template = _template_text(getattr(hf_tokenizer, "chat_template", None))
        for token in END_OF_TURN_TOKENS:
            token_id = self._special_token_id(token)
            if token_id is not None and token in template:
                eos.add(token_id)
        self._eos_token_ids = frozenset(eos)
        if max_model_len is None:
            model_max_length = getattr(hf_tokenizer, "model_max_length", None)
            if isinstance(model_max_length, int) and 0 < model_max_length < _UNSET_MODEL_MAX_LENGTH:
                max_model_len = model_max_length
        self._max_model_len = max_model_len

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "Tokenizer":
        """Build from a Hugging Face folder, a `.gguf` file or a packaged model's name (`default`,
        `gemma-3-270m`: its GGUF, assembled once if needed); ValueError otherwise (for a packaged
        model whose package is missing: which pip command installs it)."""
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"tokenizer path must be a string, got {type(path).__name__}; expected {_EXPECTED}")
        path = os.fspath(path)
        if is_packaged_model(path):  # as resolve_model: the name wins over a folder of that name
            path = packaged_gguf_path(path)
        if not os.path.exists(path):
            raise ValueError(f"tokenizer path {path!r} does not exist; expected {_EXPECTED}")
        if os.path.isdir(path):
            return cls._from_folder(path)
        if not path.endswith(".gguf"):
            raise ValueError(f"tokenizer path {path!r} is a file but not a .gguf file; expected {_EXPECTED}")
        return cls._from_gguf(path)

    @classmethod
    def _from_folder(cls, folder: str) -> "Tokenizer":
        if not any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES):
            raise ValueError(f"folder {folder!r} has no tokenizer: expected {' or '.join(TOKENIZER_FILES)} "
                             "in it (a Hugging Face model folder), or pass a .gguf file")
        from transformers import AutoTokenizer
        try:
            hf_tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except Exception as exc:  # transformers raises many types for a broken folder
            raise ValueError(f"could not load the tokenizer in {folder!r} ({type(exc).__name__}: {exc}); "
                             f"expected {_EXPECTED}") from exc
        eos: set[int] = set()
        max_model_len = None
        for name in ("generation_config.json", "config.json"):
            data = _read_json_dict(os.path.join(folder, name))
            eos |= _as_id_set(data.get("eos_token_id"))
            if name == "config.json":
                max_model_len = next((data[k] for k in _CONTEXT_KEYS if isinstance(data.get(k), int)), None)
        return cls(hf_tokenizer, source=folder, eos_token_ids=eos, max_model_len=max_model_len)

    @classmethod
    def _from_gguf(cls, path: str) -> "Tokenizer":
        metadata = read_gguf_scalars(path)
        if "tokenizer.ggml.model" not in metadata:
            raise ValueError(f"GGUF file {path!r} has no tokenizer (no tokenizer.ggml.model metadata)")
        from engine.model.gguf_loader import converted_dir, is_complete_conversion
        converted = converted_dir(path)
        try:
            if is_complete_conversion(converted):
                # The model's cached conversion holds this tokenizer, saved: ~2 s instead of the
                # ~15 s transformers takes to build it from the GGUF's vocabulary.
                hf_tokenizer = _saved_tokenizer(converted)
            else:
                from transformers import AutoTokenizer
                folder, name = os.path.split(os.path.abspath(path))
                hf_tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        except Exception as exc:
            raise ValueError(f"could not build a tokenizer from GGUF file {path!r} "
                             f"({type(exc).__name__}: {exc})") from exc
        eos = {metadata[key] for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                         "tokenizer.ggml.eom_token_id") if isinstance(metadata.get(key), int)}
        architecture = metadata.get("general.architecture")
        context = metadata.get(f"{architecture}.context_length")
        return cls(hf_tokenizer, source=path, eos_token_ids=eos,
                   max_model_len=context if isinstance(context, int) and context > 0 else None)

    # ---- text <-> ids ------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a string, got {type(text).__name__}")
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        backend = self.fast_backend
        if backend is not None:
            return backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return self._hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens,
                               clean_up_tokenization_spaces=False)

    # ---- chat --------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._hf, "chat_template", None))

    def render_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation ([{"role": ..., "content": ...}, ...])."""
        if not self.has_chat_template:
            raise ValueError(f"the model at {self.source!r} has no chat template; send a plain prompt "
                             "(completions API) instead of chat messages")
        conversation = _validated_messages(messages)
        from jinja2 import TemplateError
        try:
            text = self._hf.apply_chat_template(conversation, tokenize=False,
                                                add_generation_prompt=add_generation_prompt)
        except TemplateError as exc:
            raise ValueError(f"the chat template rejected these messages: {exc}") from exc
        if not isinstance(text, str):
            raise ValueError(f"the chat template produced {type(text).__name__}, not text")
        return text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered conversation (special tokens come from the template itself)."""
        return self.encode(self.render_chat_template(messages, add_generation_prompt), add_special_tokens=False)

    # ---- facts -------------------------------------------------------------------------------

    @property
    def eos_token_ids(self) -> set[int]:
        """The configured EOS id(s) plus the end-of-turn token of the chat template, if any."""
        return set(self._eos_token_ids)

    @property
    def bos_token_id(self) -> int | None:
        return self._hf.bos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return len(self._hf)

    @property
    def all_special_ids(self) -> list[int]:
        special = set(self._hf.all_special_ids)
        special |= {i for i, token in getattr(self._hf, "added_tokens_decoder", {}).items()
                    if getattr(token, "special", False)}
        return sorted(special)

    @property
    def max_model_len(self) -> int | None:
        """The model's context length when the tokenizer's source says it; None otherwise."""
        return self._max_model_len

    @property
    def hf_tokenizer(self) -> Any:
        return self._hf

    @property
    def fast_backend(self) -> Any:
        """The `tokenizers.Tokenizer` of a fast (Rust) Hugging Face tokenizer; None for a slow one."""
        return getattr(self._hf, "backend_tokenizer", None)

    @property
    def is_byte_level(self) -> bool:
        """Whether tokens are byte-level BPE pieces (GPT-2 style: each byte one printable char)."""
        decoder = getattr(self.fast_backend, "decoder", None)
        return decoder is not None and "ByteLevel" in repr(decoder)

    def _special_token_id(self, token: str) -> int | None:
        for token_id, added in getattr(self._hf, "added_tokens_decoder", {}).items():
            if str(added) == token or getattr(added, "content", None) == token:
                return int(token_id)
        return None

    def __repr__(self) -> str:
        return f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size})"


def _template_text(template: Any) -> str:
    if isinstance(template, dict):
        return "\n".join(str(v) for v in template.values())
    return template if isinstance(template, str) else ""


def _validated_messages(messages: Any) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("chat messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    conversation = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"chat message {index} must be an object with 'role' and 'content', "
                             f"got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"chat message {index} needs a non-empty string 'role'")
        if "content" not in message:
            raise ValueError(f"chat message {index} ({role}) has no 'content'")
        conversation.append({**message, "content": _content_text(message["content"], index)})
    return conversation


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise ValueError(f"chat message {index}: only text content parts "
                                 f"({{'type': 'text', 'text': ...}}) are supported, got {kind!r}")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"chat message {index}: a text content part needs a string 'text'")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"chat message {index}: 'content' must be a string or a list of text parts, "
                     f"got {type(content).__name__}")


def _read_json_dict(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path!r}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _as_id_set(value: Any) -> set[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


# ---- GGUF metadata ---------------------------------------------------------------------------
def _saved_tokenizer(folder: str) -> Any:
    """The tokenizer pdserve saved into a converted model folder, loaded by the class it was saved
    as (what AutoTokenizer chose then). AutoTokenizer itself would import torch (through
    transformers' model configs): a router process, which loads only this, stays torch-free."""
    import transformers
    name = _read_json_dict(os.path.join(folder, "tokenizer_config.json")).get("tokenizer_class")
    try:
        tokenizer_class = getattr(transformers, name) if isinstance(name, str) else None
    except AttributeError:
        tokenizer_class = None
    if tokenizer_class is None:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return tokenizer_class.from_pretrained(folder, local_files_only=True)


# The gguf package parses every array (the whole vocabulary) into Python objects, which takes
# seconds; the tokenizer only needs a few scalars, so it reads the key/value header itself.

_GGUF_MAGIC = b"GGUF"
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_scalars(path: str) -> dict[str, Any]:
    """Scalar and string metadata of a GGUF file (arrays are skipped); ValueError if not GGUF."""
    try:
        with open(path, "rb") as f:
            data = f.read(16 * 2**20)  # the header; grown below if the vocabulary is larger
            if data[:4] != _GGUF_MAGIC:
                raise ValueError(f"{path!r} is not a GGUF file (it does not start with b'GGUF')")
            while True:
                try:
                    return _parse_gguf_header(data)
                except _Truncated:
                    more = f.read(len(data))
                    if not more:
                        raise ValueError(f"GGUF file {path!r} is truncated (its metadata ends early)") from None
                    data += more
    except OSError as exc:
        raise ValueError(f"cannot read GGUF file {path!r}: {exc}") from exc


class _Truncated(Exception):
    pass


def _parse_gguf_header(data: bytes) -> dict[str, Any]:
    offset = 4

    def take(fmt: str) -> Any:
        nonlocal offset
        size = struct.calcsize(fmt)
        if offset + size > len(data):
            raise _Truncated
        (value,) = struct.unpack_from(fmt, data, offset)
        offset += size
        return value

    def take_string() -> str:
        nonlocal offset
        length = take("<Q")
        if offset + length > len(data):
            raise _Truncated
        text = data[offset:offset + length].decode("utf-8", errors="replace")
        offset += length
        return text

    version = take("<I")
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version} (or a big-endian file)")
    take("<Q")  # tensor count
    num_fields = take("<Q")
    fields: dict[str, Any] = {}
    for _ in range(num_fields):
        key = take_string()
        value_type = take("<I")
        if value_type == _GGUF_STRING:
            fields[key] = take_string()
        elif value_type == _GGUF_ARRAY:
            item_type, count = take("<I"), take("<Q")
            if item_type == _GGUF_STRING:
                for _ in range(count):
                    take_string()
            elif item_type in _GGUF_SCALARS:
                skip = struct.calcsize(_GGUF_SCALARS[item_type]) * count
                if offset + skip > len(data):
                    raise _Truncated
                offset += skip
            else:
                raise ValueError(f"GGUF metadata {key!r} is an array of unsupported type {item_type}")
        elif value_type in _GGUF_SCALARS:
            fields[key] = take(_GGUF_SCALARS[value_type])
        else:
            raise ValueError(f"GGUF metadata {key!r} has unknown value type {value_type}")
    return fields
