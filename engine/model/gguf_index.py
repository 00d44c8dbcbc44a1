"""A GGUF file's tensors, read without decoding its metadata.

`gguf.GGUFReader` turns every metadata value into numpy views, one per string: Gemma 3's
262,144-token vocabulary alone took 28 s of a 2-vCPU machine. Serving the tensors as they are
stored (engine/model/gguf_quantized.py) needs only their index, the architecture's name and the
alignment, so this reads the header as the format defines it (ggml's docs/gguf.md): magic
"GGUF", version (2 or 3), tensor count, metadata count; the metadata pairs (skipped, but for
`general.architecture` and `general.alignment`); each tensor's name, dimensions (innermost
first), ggml type and offset; the data from the next multiple of the alignment. The conversion to a
Hugging Face folder (gguf_loader.py) still uses GGUFReader: it needs the metadata.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# byte sizes of the fixed-size metadata value types (uint8 ... float64; 7 is bool)
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                   12: "<d"}
_WANTED = ("general.architecture", "general.alignment")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: the names `gguf.ReaderTensor` uses for the same things."""
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # innermost (a row's length) first, as GGUF stores it
    data: np.ndarray  # its bytes (uint8), a view of the file's read-only memory map
    n_bytes: int


@dataclass(frozen=True)
class GGUFIndex:
    architecture: str | None
    tensors: dict[str, GGUFTensor]


class _Cursor:
    def __init__(self, buffer: np.ndarray) -> None:
        self.buffer = buffer
        self.view = memoryview(buffer)
        self.position = 0

    def unpack(self, fmt: str):
        value = struct.unpack_from(fmt, self.view, self.position)[0]
        self.position += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        text = bytes(self.view[self.position:self.position + length]).decode("utf-8")
        self.position += length
        return text

    def skip_string(self) -> None:
        self.position += 8 + struct.unpack_from("<Q", self.view, self.position)[0]

    def value(self, kind: int, keep: bool):
        """The value of metadata type `kind`, or None having skipped it when not `keep`."""
        if kind == _STRING:
            if keep:
                return self.string()
            self.skip_string()
        elif kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in _FIXED:
                self.position += _FIXED[item] * count
            else:
                for _ in range(count):
                    self.value(item, False)
        elif kind in _FIXED:
            if keep:
                return self.unpack(_SCALAR_FORMATS[kind])
            self.position += _FIXED[kind]
        else:
            raise ValueError(f"unknown metadata value type {kind} at byte {self.position}")
        return None


def read_gguf_index(path: str) -> GGUFIndex:
    """The tensors of the GGUF file at `path`, memory-mapped; ValueError for a file that is not
    GGUF version 2 or 3, or whose tensors run past its end."""
    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(buffer)
    try:
        if bytes(cursor.view[:4]) != _MAGIC:
            raise ValueError("it does not start with 'GGUF'")
        cursor.position = 4
        version = cursor.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (2 and 3 are read)")
        tensor_count, metadata_count = cursor.unpack("<Q"), cursor.unpack("<Q")
        found: dict[str, object] = {}
        for _ in range(metadata_count):
            key = cursor.string()
            kind = cursor.unpack("<I")
            value = cursor.value(kind, key in _WANTED)
            if key in _WANTED:
                found[key] = value
        infos = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = tuple(cursor.unpack("<Q") for _ in range(cursor.unpack("<I")))
            infos.append((name, GGMLQuantizationType(cursor.unpack("<I")), dims, cursor.unpack("<Q")))
        alignment = int(found.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-cursor.position // alignment) * alignment
        tensors = {}
        for name, kind, dims, offset in infos:
            block, block_bytes = GGML_QUANT_SIZES[kind]
            n_bytes = int(np.prod(dims, dtype=np.int64)) // block * block_bytes
            begin = start + offset
            if begin + n_bytes > len(buffer):
                raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")
            tensors[name] = GGUFTensor(name, kind, dims, buffer[begin:begin + n_bytes], n_bytes)
    except (ValueError, struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not a valid GGUF file ({exc}); the file may be truncated or not a GGUF "
                         "model: download or convert it again") from exc
    architecture = found.get("general.architecture")
    return GGUFIndex(architecture if isinstance(architecture, str) else None, tensors)
