"""Write a float32 copy of a GGUF model: every quantized tensor dequantized, metadata kept.

pdserve dequantizes a GGUF when it loads it and computes in float32 on CPU; a peer given the
original (the default model ships as Q4_1) would read a quarter of the bytes per step. Give the
peer this copy so both compute on the same float32 weights (benchmarks/peer_compare.py).

    python benchmarks/gguf_f32.py default /tmp/smollm2-f32.gguf
    python benchmarks/gguf_f32.py model.Q8_0.gguf model-f32.gguf
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def convert(src: Path, dst: Path) -> None:
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue  # the writer writes the header and architecture itself
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_file_type(LlamaFileType.ALL_F32)
    for tensor in reader.tensors:
        if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
            data = np.asarray(tensor.data, dtype=np.float32)
        else:
            data = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, data.reshape(tuple(reversed([int(d) for d in tensor.shape]))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", help="a .gguf file, or 'default' (the default model's)")
    parser.add_argument("dst", type=Path)
    args = parser.parse_args()
    if args.src == "default":
        from engine.model.default_model import default_gguf_path
        src = Path(default_gguf_path())
    else:
        src = Path(args.src)
    convert(src, args.dst)
    print(f"wrote {args.dst} ({args.dst.stat().st_size / 1e6:.0f} MB, float32) from {src}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
