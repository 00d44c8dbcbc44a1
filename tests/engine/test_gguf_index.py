"""engine/model/gguf_index.py: the tensor index read without the metadata is gguf.GGUFReader's,
byte for byte, on the packaged default model; a truncated or foreign file is a clear ValueError."""
import numpy as np
import pytest
from gguf import GGUFReader

from engine.model.gguf_index import read_gguf_index
from engine.model.packaged_models import packaged_gguf_path


def test_the_index_is_the_readers_on_the_default_model():
    path = packaged_gguf_path("default")
    index, reader = read_gguf_index(path), GGUFReader(path)
    assert index.architecture == "llama"
    assert list(index.tensors) == [tensor.name for tensor in reader.tensors]
    for tensor in reader.tensors:
        ours = index.tensors[tensor.name]
        assert (ours.tensor_type, ours.shape, ours.n_bytes) == (
            tensor.tensor_type, tuple(int(d) for d in tensor.shape), int(tensor.n_bytes)), tensor.name
        assert np.array_equal(ours.data, np.asarray(tensor.data).view(np.uint8).reshape(-1)), tensor.name


def test_a_truncated_or_foreign_file_is_refused(tmp_path):
    data = open(packaged_gguf_path("default"), "rb").read()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[:len(data) - 1000])
    with pytest.raises(ValueError, match=r"truncated.gguf is not a valid GGUF file \(tensor \S+ runs past the end"):
        read_gguf_index(str(truncated))
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:5000])  # cut inside the metadata
    with pytest.raises(ValueError, match="header.gguf is not a valid GGUF file"):
        read_gguf_index(str(header_only))
    foreign = tmp_path / "model.safetensors"
    foreign.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ValueError, match="does not start with 'GGUF'"):
        read_gguf_index(str(foreign))
