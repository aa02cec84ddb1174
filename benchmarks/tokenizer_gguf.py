"""Write a tokenizer-only GGUF (the tokenizer.* metadata of a GGUF, no tensors): a GPU box that
cannot take the 98 MB SmolLM2 GGUF (over the device's carry limit) takes this ~1.7 MB file, e.g.

    python benchmarks/tokenizer_gguf.py .whl/tok/smollm2-tokenizer.gguf
    python3 benchmarks/structured_bench.py --tokenizer .whl/tok/smollm2-tokenizer.gguf   # on the GPU

Default source: the embedded SmolLM2 GGUF. Checks that both files encode a sample alike.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def write_tokenizer_gguf(src: str, dest: str) -> None:
    import gguf

    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    Path(dest).parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(dest, arch=arch)
    for name, field in reader.fields.items():
        if name.startswith("tokenizer.") or name == "general.name":
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> int:
    from homelab_llm.assets import default_model_path
    from homelab_llm.engine.tokenizer import load_tokenizer

    p = argparse.ArgumentParser()
    p.add_argument("dest")
    p.add_argument("--src", default=None, help="default: the embedded SmolLM2 GGUF")
    a = p.parse_args()
    src = a.src or str(default_model_path())
    write_tokenizer_gguf(src, a.dest)
    sample = 'Hello, world! {"a": [1, 2]} <|im_start|>user'
    same = load_tokenizer(src).encode(sample) == load_tokenizer(a.dest).encode(sample)
    print(f"{a.dest}: {Path(a.dest).stat().st_size} bytes, encodes like {src}: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
