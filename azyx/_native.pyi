"""Types of azyx's native core (azyx/_native.c)."""

from typing import Any

class Node:
    op: Any
    src: tuple[int, ...]
    arg: Any
    arg2: Any
    shape: tuple[int, ...]
    dtype: Any
    device: str
    pinned: bool
    rc: int
    buffer: Any
    view: Any
    def __init__(self, op: Any, src: tuple[int, ...], arg: Any, shape: tuple[int, ...], dtype: Any, device: str,
                 pinned: bool, arg2: Any = None) -> None: ...

def setup(const: Any, pad: Any, assign: Any, binary: Any, scalar: Any, bool_dtype: Any, donates: Any) -> None: ...
def walk(nodes: list[Any], targets: list[int], graph: Any
         ) -> tuple[tuple[tuple[Any, ...], ...], tuple[int, ...], list[int], list[int], list[Any], list[int],
                    dict[int, int]]: ...
def release(nodes: list[Any], free: list[int], kept: list[set[int]], i: int) -> None: ...
def setup_tensor(tensor: type, graph: Any, float_dtypes: tuple[Any, ...], int_dtypes: tuple[Any, ...],
                 disk: str) -> None: ...
def binary(op: str, flags: int, x: Any, other: Any) -> Any: ...
