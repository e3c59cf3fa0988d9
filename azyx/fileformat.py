"""The safetensors format: reading and validating a header, and writing one.

A file is an 8-byte little-endian header length N, N bytes of UTF-8 JSON (a dict: tensor name -> {"dtype", "shape",
"data_offsets"}, plus an optional "__metadata__" dict of str -> str), then the data section. The checks are the
format's own (those of the reference implementation): N at most 100 MB and inside the file; the JSON an object
starting with "{", without duplicate keys; known dtypes; every dimension (and every partial product of a shape, times
the item size) below 2**63 bytes, whatever the other dimensions are; each tensor's byte length = prod(shape) *
itemsize; the ranges, sorted, tile the data section exactly from its first byte to the end of the file (no gaps, no
overlaps, nothing after). Every problem raises `SafetensorsError` naming the file; nothing is read past the header.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from azyx.dtypes import DType, dtypes
from azyx.errors import AzyxIOError
from azyx.graph import Shape, prod

MAX_HEADER = 100_000_000  # bytes: the reference implementation's limit
MAX_BYTES = (1 << 63) - 1  # a tensor's byte length, and each dimension: what an index (int64, numpy's intp) can hold
DTYPES: dict[str, DType] = {d.safetensors: d for d in dtypes.all()}  # F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL
OTHER_FORMAT_DTYPES = ("U16", "U32", "U64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "C64")


class SafetensorsError(AzyxIOError):
    """A malformed safetensors file (or a bad request about one). `e.filename` is the file, `e.problem` what is
    wrong."""

    def __init__(self, path: str, problem: str):
        super().__init__(f"{path}: {problem}")
        self.filename, self.problem = path, problem

    def __str__(self) -> str:  # OSError would format it as "[Errno None] None: path" once filename is set
        return str(self.args[0])


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the header; `begin`/`end` are byte offsets into the data section."""

    name: str
    dtype: DType
    shape: Shape
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    """A validated header: tensors in file order, where the data section starts, the file-level metadata."""

    path: str
    data_start: int  # 8 + header length
    file_size: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str] | None


def read_header(fd: int, path: str, size: int) -> Header:
    """Read and validate the header of the open file `fd` of `size` bytes; reads nothing past the header."""
    if size < 8:
        raise SafetensorsError(path, f"file of {size} bytes is too small to hold the 8-byte header length")
    n = int.from_bytes(_pread_exact(fd, path, 8, 0), "little")
    if n > MAX_HEADER:
        raise SafetensorsError(path, f"header length {n} exceeds the format's limit of {MAX_HEADER} bytes")
    if n > size - 8:
        raise SafetensorsError(path, f"header length {n} runs past the end of the file ({size} bytes)")
    tensors, metadata = parse_header(_pread_exact(fd, path, n, 8), path, size - 8 - n)
    return Header(path, 8 + n, size, tensors, metadata)


def _pread_exact(fd: int, path: str, n: int, offset: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = os.pread(fd, n - got, offset + got)
        if not chunk:
            raise SafetensorsError(path, f"unexpected end of file reading the header at byte {offset + got}")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _no_duplicates(path: str) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise SafetensorsError(path, f"duplicate key {k!r} in the header")
            out[k] = v
        return out

    return hook


def parse_header(raw: bytes, path: str, data_len: int) -> tuple[dict[str, TensorEntry], dict[str, str] | None]:
    """Validate the JSON header `raw` against a data section of `data_len` bytes; tensors come out in file order."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SafetensorsError(path, f"header is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not text.startswith("{"):
        raise SafetensorsError(path, f"header does not start with '{{' (a JSON object), it starts with {text[:16]!r}")
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates(path))
    except json.JSONDecodeError as e:
        raise SafetensorsError(path, f"header is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
                               ) from None
    except RecursionError:
        raise SafetensorsError(path, "header JSON is nested too deeply") from None
    if not isinstance(obj, dict):
        raise SafetensorsError(path, f"header JSON must be an object (a dict), got {type(obj).__name__}")
    metadata = obj.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise SafetensorsError(path, "__metadata__ must map strings to strings")
    entries = [_entry(path, name, info) for name, info in obj.items()]
    entries.sort(key=lambda t: (t.begin, t.end))
    pos = 0
    for i, t in enumerate(entries):
        if t.end > data_len:
            raise SafetensorsError(path, f"tensor {t.name!r} has data_offsets [{t.begin}, {t.end}] past the end of "
                                         f"the data section ({data_len} bytes): the file is truncated or the offsets "
                                         f"are wrong")
        if t.begin < pos:
            prev = entries[i - 1]
            raise SafetensorsError(path, f"tensor {t.name!r} (bytes {t.begin}..{t.end}) overlaps tensor "
                                         f"{prev.name!r} (bytes {prev.begin}..{prev.end})")
        if t.begin > pos:
            raise SafetensorsError(path, f"a gap of {t.begin - pos} bytes before tensor {t.name!r}: the format's data "
                                         f"section must be covered exactly")
        pos = t.end
    if pos != data_len:
        raise SafetensorsError(path, f"{data_len - pos} bytes after the last tensor: the data section must end with "
                                     f"the last tensor")
    return {t.name: t for t in entries}, metadata


def _entry(path: str, name: str, info: Any) -> TensorEntry:
    if not isinstance(info, dict):
        raise SafetensorsError(path, f"tensor {name!r}: its entry must be an object, got {type(info).__name__}")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
    if missing:
        raise SafetensorsError(path, f"tensor {name!r}: missing {', '.join(missing)}")
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if code not in DTYPES:
        known = ", ".join(DTYPES)
        what = "is not supported by azyx" if code in OTHER_FORMAT_DTYPES else "is unknown"
        raise SafetensorsError(path, f"tensor {name!r}: dtype {code!r} {what} (supported: {known})")
    if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
        raise SafetensorsError(path, f"tensor {name!r}: shape must be a list of non-negative ints, got {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise SafetensorsError(path, f"tensor {name!r}: data_offsets must be [begin, end] with 0 <= begin <= end, "
                                     f"got {offsets!r}")
    dtype = DTYPES[code]
    # every dimension, and every partial product of the dimensions, bounded whatever the others are (a zero among
    # them makes the product 0: [2**62, 2**62, 0] holds 0 bytes, and no array can be made of it), as the reference
    # implementation's overflow-checked product is
    running = dtype.itemsize
    for s in shape:
        running *= s if s else 1
        if running > MAX_BYTES:
            raise SafetensorsError(path, f"tensor {name!r}: shape {shape} of {code} is too large (dimension {s} "
                                         f"takes the size past the format's limit of {MAX_BYTES} bytes)")
    expected = prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != expected:
        raise SafetensorsError(path, f"tensor {name!r}: shape {shape} of {code} needs {expected} bytes but "
                                     f"data_offsets {offsets} hold {offsets[1] - offsets[0]}")
    return TensorEntry(name, dtype, tuple(shape), offsets[0], offsets[1])


def header_bytes(entries: list[TensorEntry], metadata: dict[str, str] | None) -> bytes:
    """The 8-byte length and the JSON header for `entries` (offsets already laid out), padded with spaces to a
    multiple of 8 bytes like the reference writer, so the data section starts aligned."""
    obj: dict[str, Any] = {}
    if metadata:
        obj["__metadata__"] = metadata
    for e in entries:
        obj[e.name] = {"dtype": e.dtype.safetensors, "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text
