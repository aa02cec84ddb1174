"""A fast GGUF header reader: metadata as Python values, tensors as views into one memmap.

gguf.GGUFReader builds a numpy object per array element, which takes seconds for a 150K-token
vocabulary; this reads the same header in a tight struct loop. Format (v2/v3, little-endian):
magic "GGUF", version u32, tensor count u64, KV count u64, the KVs, the tensor infos, then the
tensor data at the next multiple of general.alignment.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUF value types -> struct format (scalars); 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file (or end early); the caller adds the path."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str  # ggml type name, e.g. "Q4_1"
    type_id: int
    shape: tuple[int, ...]  # numpy order: slowest dim first (ggml lists it last)
    offset: int  # absolute byte offset in the file
    n_bytes: int


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise GGUFFormatError("a string runs past the end of the file")
        s = bytes(self.buf[self.pos:end]).decode("utf-8", errors="replace")
        self.pos = end
        return s

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type == _STRING:
                return [self.string() for _ in range(count)]
            if item_type in _SCALARS:  # numbers in bulk, not one struct call each
                fmt = _SCALARS[item_type]
                size = struct.calcsize(fmt)
                if self.pos + size * count > len(self.buf):
                    raise GGUFFormatError("an array runs past the end of the file")
                arr = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=count, offset=self.pos)
                self.pos += size * count
                return arr.tolist()
            return [self.value(item_type) for _ in range(count)]
        raise GGUFFormatError(f"unknown metadata value type {vtype}")


def read_gguf_header(path: Path) -> tuple[dict[str, Any], list[GGUFTensor], np.memmap]:
    """(metadata, tensor infos, the file's read-only memmap). Raises GGUFFormatError."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    data = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(data))
    try:
        if bytes(cur.buf[:4]) != b"GGUF":
            raise GGUFFormatError("no GGUF magic at the start")
        cur.pos = 4
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            meta[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
            infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
    except struct.error:
        raise GGUFFormatError("the header ends early") from None
    alignment = int(meta.get("general.alignment", 32))
    start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, dims, type_id, offset in infos:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise GGUFFormatError(f"tensor {name} has unknown type id {type_id}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        n = int(np.prod(dims)) if dims else 1
        tensors.append(GGUFTensor(name, qtype.name, type_id, tuple(reversed(dims)),
                                  start + offset, n // block * type_size))
    return meta, tensors, data


def tensor_data(mm: np.memmap, t: GGUFTensor) -> np.ndarray:
    """The tensor's bytes as gguf.quants.dequantize expects them: F32/F16 typed with the
    element shape; everything else uint8 with rows of packed blocks."""
    # A plain ndarray view of the map: slices of an np.memmap each run Python-level bookkeeping,
    # and dequantizing splits a tensor into thousands of them.
    raw = mm[t.offset : t.offset + t.n_bytes].view(np.ndarray)
    if t.type_name == "F32":
        return raw.view(np.float32).reshape(t.shape)
    if t.type_name == "F16":
        return raw.view(np.float16).reshape(t.shape)
    rows = int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else 1
    return raw.reshape(*t.shape[:-1], t.n_bytes // rows) if len(t.shape) > 1 else raw
