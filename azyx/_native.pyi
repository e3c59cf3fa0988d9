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

def setup(const: Any, pad: Any, assign: Any, binary: Any, leaf: Any, scalar: Any, bool_dtype: Any, donates: Any
          ) -> None: ...
def walk(nodes: list[Any], targets: list[int], graph: Any
         ) -> tuple[tuple[tuple[Any, ...], ...], tuple[int, ...], list[int], list[int], list[Any], list[int],
                    dict[int, int]]: ...
def release(nodes: list[Any], free: list[int], kept: list[set[int]], i: int) -> None: ...
def become_leaf(nodes: list[Any], free: list[int], kept: list[set[int]], i: int, buffer: Any, view: Any) -> None: ...
def setup_tensor(tensor: type, graph: Any, float_dtypes: tuple[Any, ...], int_dtypes: tuple[Any, ...],
                 disk: str, method_type: type) -> None: ...
def binary(op: str, flags: int, x: Any, other: Any) -> Any: ...

class Method:
    __wrapped__: Any
    def __init__(self, op: str | None, flags: int, fallback: Any, name: str, qualname: str, doc: str | None
                 ) -> None: ...
    def __call__(self, *args: Any) -> Any: ...

class TableCall:
    def __init__(self, run: int | None, n: int, fns: int, table: int, slots: int, argc: int, kinds: int, trips: int
                 ) -> None: ...
    def __call__(self, pool: int, values: list[int]) -> None: ...
