"""The dtype table: every fact about a dtype lives here once, and every backend reads it."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from azyx.errors import DTypeError
from azyx.native import native


@dataclass(frozen=True, eq=False)
class DType:
    """An element type of azyx tensors (`dtypes.float32`, ...): its `name`, `itemsize` in bytes, `kind` ("b" bool,
    "i" signed, "u" unsigned, "f" float) and the numpy type of its host storage (`np`; bfloat16 is stored as
    uint16). Compare with `is`/`==`: each dtype is one object."""
    name: str
    itemsize: int
    kind: str  # "b" bool, "i" signed int, "u" unsigned int, "f" float
    rank: int  # order inside its kind, for promotion
    np: Any  # numpy dtype used for host storage (bfloat16 is stored as uint16)
    safetensors: str

    def __repr__(self) -> str:
        return f"dtypes.{self.name}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (to_dtype, (self.name,))

    @property
    def is_float(self) -> bool:
        """True for float16, bfloat16, float32 and float64."""
        return self.kind == "f"

    @property
    def is_int(self) -> bool:
        """True for the integer dtypes (signed and unsigned)."""
        return self.kind in "iu"

    @property
    def is_bool(self) -> bool:
        """True for bool."""
        return self.kind == "b"

    @property
    def numpy(self) -> np.dtype:
        """The dtype `Tensor.numpy()` returns: bfloat16 is widened to float32 (numpy has no bfloat16)."""
        return np.dtype(np.float32) if self is dtypes.bfloat16 else np.dtype(self.np)


class dtypes:
    """The dtypes of azyx: `dtypes.bool int8 uint8 int16 int32 int64 float16 bfloat16 float32 float64`.

    `dtypes.default_float` (float32) is what Python floats become, `dtypes.default_int` (int32) Python ints. Every
    `dtype=` argument of azyx also takes a numpy dtype or a name (`"float32"`, and `"half"`, `"float"`, `"double"`,
    `"int"`, `"long"`)."""
    bool = DType("bool", 1, "b", 0, np.bool_, "BOOL")
    int8 = DType("int8", 1, "i", 1, np.int8, "I8")
    uint8 = DType("uint8", 1, "u", 1, np.uint8, "U8")
    int16 = DType("int16", 2, "i", 2, np.int16, "I16")
    int32 = DType("int32", 4, "i", 3, np.int32, "I32")
    uint32 = DType("uint32", 4, "u", 3, np.uint32, "U32")  # internal: random bits, never a default
    int64 = DType("int64", 8, "i", 4, np.int64, "I64")
    float16 = DType("float16", 2, "f", 1, np.float16, "F16")
    bfloat16 = DType("bfloat16", 2, "f", 1, np.uint16, "BF16")
    float32 = DType("float32", 4, "f", 2, np.float32, "F32")
    float64 = DType("float64", 8, "f", 3, np.float64, "F64")
    default_float = float32
    default_int = int32

    @staticmethod
    def all() -> tuple[DType, ...]:
        """Every user-facing dtype, each once (the defaults are aliases, not listed again)."""
        return ALL


ALL: tuple[DType, ...] = tuple(v for v in vars(dtypes).values() if isinstance(v, DType) and v.name != "uint32")
ALL = tuple(dict.fromkeys(ALL))  # default_float/default_int are aliases
_BY_NAME: dict[str, DType] = {d.name: d for d in (*ALL, dtypes.uint32)}
_BY_NAME.update({"half": dtypes.float16, "float": dtypes.float32, "double": dtypes.float64, "int": dtypes.int32,
                 "long": dtypes.int64, "bool_": dtypes.bool})
_BY_NP: dict[np.dtype, DType] = {np.dtype(d.np): d for d in (*ALL, dtypes.uint32) if d is not dtypes.bfloat16}


def to_dtype(x: Any) -> DType:
    """Accept a DType, a numpy dtype (or type), or a dtype name."""
    if isinstance(x, DType):
        return x
    if isinstance(x, str):
        if x in _BY_NAME:
            return _BY_NAME[x]
        raise DTypeError(f"unknown dtype {x!r}; known: {', '.join(d.name for d in ALL)}")
    try:
        nd = np.dtype(x)
    except TypeError:
        raise DTypeError(f"unknown dtype {x!r}") from None
    if nd in _BY_NP:
        return _BY_NP[nd]
    raise DTypeError(f"unsupported dtype {x!r}; supported: {', '.join(d.name for d in ALL)}")


def from_numpy(nd: np.dtype) -> DType:
    """The azyx dtype of numpy dtype `nd` (`DTypeError` naming it when azyx has none)."""
    return to_dtype(nd)


def promote(a: DType, b: DType) -> DType:
    """PyTorch's promotion between two tensor dtypes: higher kind wins, then the wider type."""
    if a is b:
        return a
    if a.kind in "iu" and b.kind in "iu" and a.kind != b.kind:  # signed with unsigned: a signed type holding both
        s, u = (a, b) if a.kind == "i" else (b, a)
        return s if s.itemsize > u.itemsize else _SIGNED_BY_SIZE.get(u.itemsize * 2, dtypes.int64)
    ka, kb = _KIND_ORDER[a.kind], _KIND_ORDER[b.kind]
    if ka != kb:
        return a if ka > kb else b
    if a.kind == "f" and a.itemsize == b.itemsize:  # float16 with bfloat16
        return dtypes.float32
    return a if a.itemsize > b.itemsize else b


def scalar_dtype(v: Any) -> DType:
    """The dtype a Python scalar gets when it creates a tensor: bool, int32 (int64 for an int outside int32's range,
    as numpy and PyTorch give no int a narrower type than its value needs), float32. An int outside int64's range
    raises DTypeError naming it."""
    if isinstance(v, bool | np.bool_):
        return dtypes.bool
    if isinstance(v, int | np.integer):
        if _I32_MIN <= v <= _I32_MAX:
            return dtypes.default_int
        check_int(dtypes.int64, v)
        return dtypes.int64
    if isinstance(v, float | np.floating):
        return dtypes.default_float
    raise DTypeError(f"unsupported scalar {v!r} of type {type(v).__name__}")


def promote_scalar(t: DType, v: Any) -> DType:
    """Tensor op Python scalar: the scalar only matters when its kind is higher (PyTorch rule). An int that does not
    fit an integer tensor's dtype raises DTypeError (see `check_int`): it is never wrapped silently."""
    s = scalar_dtype(v)
    if _KIND_ORDER[s.kind] > _KIND_ORDER[t.kind]:
        return s
    if t.kind in "iu" and s.kind in "iu":
        check_int(t, v)
    return t


_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


def int_range(d: DType) -> tuple[int, int]:
    """The Python ints a tensor of integer dtype `d` accepts as a number in an op or a factory: its own range, and
    for an unsigned dtype the negatives down to -max too (they wrap, as PyTorch's `uint8_tensor - 3` does)."""
    bits = 8 * d.itemsize
    if d.kind == "u":
        return -(2**bits - 1), 2**bits - 1
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def check_int(d: DType, v: Any) -> None:
    """Raise DTypeError naming `v` where the Python int `v` does not fit integer dtype `d` (numpy 2 and PyTorch raise
    too; azyx never wraps a number silently). A value that fits costs two comparisons."""
    lo, hi = int_range(d)
    if not lo <= v <= hi:
        shown = int.__repr__(v) if isinstance(v, int) else v  # (a traced number: its value)
        raise DTypeError(f"the Python int {shown} does not fit {d.name} (range {lo}..{hi}); "
                         f"cast the tensor first (e.g. `.cast(\"int64\")`) or pass a float")


def least_float(d: DType) -> DType:
    """The dtype of a float-valued op (exp, /, mean) on `d`."""
    return d if d.is_float else dtypes.default_float


_KIND_ORDER = {"b": 0, "u": 1, "i": 1, "f": 2}
_SIGNED_BY_SIZE = {2: dtypes.int16, 4: dtypes.int32, 8: dtypes.int64}


# how a scalar kernel argument of each dtype is passed: its compute type (float16 and bfloat16 compute in float32) as
# a struct code; every argument travels in a 64-bit word (little-endian, the value in its low bytes)
SCALAR_CODES = {"int8": "b", "uint8": "B", "int16": "h", "int32": "i", "uint32": "I", "int64": "q",
                "float16": "f", "bfloat16": "f", "float32": "f", "float64": "d"}


def scalar_size(d: DType) -> int:
    """The bytes of a scalar argument of dtype `d` (of its compute type, SCALAR_CODES)."""
    import struct

    return struct.calcsize(SCALAR_CODES[d.name])


def scalar_packer(dts: list[DType], at: tuple[int, ...]) -> Any:
    """A function from a run's scalar values to the 64-bit words that carry values[at[k]] (of dtype dts[k]) to a
    kernel (see SCALAR_CODES)."""
    import struct

    codes = [SCALAR_CODES[d.name] for d in dts]
    if native is not None:  # (in C: no struct, no list of the values)
        return functools.partial(native.pack_words, "".join(codes).encode(), at)
    pack = struct.Struct("<" + "".join(c + f"{8 - struct.calcsize(c)}x" if struct.calcsize(c) < 8 else c
                                       for c in codes)).pack
    words = struct.Struct("<" + "Q" * len(codes)).unpack
    if not any(d.is_int for d in dts):
        return lambda values: words(pack(*[values[i] for i in at]))
    # an int scalar wraps into its dtype like PyTorch's (uint8 tensor + -3 adds 253), where struct would raise
    wraps = [_wrap(d) for d in dts]
    return lambda values: words(pack(*[w(values[i]) for w, i in zip(wraps, at)]))


def _wrap(d: DType) -> Any:
    if not d.is_int:
        return lambda v: v
    bits = 8 * d.itemsize
    mask, sign = (1 << bits) - 1, 1 << (bits - 1)
    if d.kind == "u":
        return lambda v: int(v) & mask
    return lambda v: ((int(v) + sign) & mask) - sign
