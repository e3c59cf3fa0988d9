"""azyx's native core (azyx/csrc) against the Python it replaces: the canonical walk of random graphs gives the
same key, order, leaves, scalars and donations; releasing nodes frees the same slots; nodes behave as the Python
class's do. The suite as a whole runs on the native core wherever it is built (`pip install -e .` builds it)."""

from __future__ import annotations

import asyncio
import gc
import os
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import azyx
import azyx.csrc as csrc
from azyx import Tensor
from azyx import native as native_mod
from azyx import walk as walk_mod
from azyx.allocator import PoolAllocator
from azyx.csrc import source_abi
from azyx.dtypes import SCALAR_CODES, dtypes
from azyx.graph import GRAPH, Graph, Node, Op
from azyx.native import native
from azyx.tape import GradientTape

pytestmark = pytest.mark.skipif(native is None and os.environ.get("AZYX_NATIVE") == "0",
                                reason="AZYX_NATIVE=0: the Python core alone")


def test_native_core_is_built() -> None:
    """An install from source builds the extension (a lost build would quietly run the slower Python)."""
    assert native is not None and Node is native.Node, \
        "azyx._native is not built: `pip install -e .` (needs a C compiler and Python headers)"


def test_abi_is_the_hash_of_the_sources(tmp_path: Path) -> None:
    """The built module's ABI is the hash of the sources beside it (setup.py defines it from them); a change of any
    source file changes it, and a module of other sources is refused with a warning, not used."""
    assert native is not None and native.ABI == source_abi()
    assert sorted(p.name for p in Path(csrc.__file__).parent.iterdir() if p.suffix in (".c", ".h")) == \
        sorted(csrc.SOURCES)  # (every source is built and hashed)
    for name in csrc.SOURCES:
        (tmp_path / name).write_bytes((Path(csrc.__file__).parent / name).read_bytes())
    assert source_abi(tmp_path) == native.ABI
    with open(tmp_path / "pool.c", "a") as f:
        f.write("\n")
    assert source_abi(tmp_path) not in (None, native.ABI)
    (tmp_path / "lane.c").unlink()
    assert source_abi(tmp_path) is None  # (an installed build without its sources: the module's ABI stands)


def test_a_module_of_other_sources_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_mod, "source_abi", lambda: "0" * 16)
    with pytest.warns(RuntimeWarning, match="built from other sources"):
        assert native_mod._load() is None
    monkeypatch.setattr(native_mod, "source_abi", lambda: None)
    assert native_mod._load() is native


def _walks(targets: list[int]) -> list[walk_mod.Walk]:
    assert native is not None
    return [walk_mod._walk_native(GRAPH, targets), walk_mod._walk_recursive(GRAPH, targets),
            walk_mod._walk_iterative(GRAPH, targets)]


def _same(walks: list[walk_mod.Walk]) -> None:
    first = walks[0]
    for w in walks[1:]:
        assert w.key == first.key
        assert hash(w.key) == hash(first.key)
        assert w.topo == first.topo and w.leaves == first.leaves
        assert w.scalars == first.scalars and w.scalar_nodes == first.scalar_nodes
        assert w.scalar_of == first.scalar_of and w.donated == first.donated


def _random_graph(rng: np.random.Generator, leaves: list[tuple[Tensor, np.ndarray]]
                  ) -> list[tuple[Tensor, np.ndarray]]:
    """A graph of every kind of node the walk treats apart, with numpy's value of each: numbers on binary ops (both
    sides), constants (bool ones too), pads with a fill, shared sources, realized intermediates, movement, reductions,
    where, casts."""
    vals = list(leaves)
    for _ in range(int(rng.integers(3, 25))):
        a, an = vals[int(rng.integers(len(vals)))]
        b, bn = vals[int(rng.integers(len(vals)))]
        c = float(rng.integers(-8, 8)) / 4
        choice = int(rng.integers(12))
        if choice == 0:
            y, yn = a * c, an * np.float32(c)
        elif choice == 1:
            y, yn = c - a, np.float32(c) - an
        elif choice == 2:
            y, yn = a + b, an + bn
        elif choice == 3:
            y, yn = a * a, an * an
        elif choice == 4:
            y, yn = Tensor.where(a > b, a, c), np.where(an > bn, an, np.float32(c))
        elif choice == 5:
            y, yn = Tensor.where(a > 0, a, b).relu(), np.maximum(np.where(an > 0, an, bn), 0)
        elif choice == 6:
            y = a.pad(((1, 0), (0, 2)), value=c)[1:, :-2]
            yn = np.pad(an, ((1, 0), (0, 2)), constant_values=c)[1:, :-2]
        elif choice == 7:
            y, yn = a.T.T.exp() * 0.5, np.exp(an) * np.float32(0.5)
        elif choice == 8:
            y, yn = (a.sum(axis=1, keepdim=True) + b) / 3.0, (an.sum(axis=1, keepdims=True) + bn) / np.float32(3)
        elif choice == 9:
            y = a.cast(dtypes.float16).cast(dtypes.float32) + Tensor.full(a.shape, c)
            yn = an.astype(np.float16).astype(np.float32) + np.float32(c)
        elif choice == 10:
            y, yn = Tensor.where(Tensor.full(a.shape, True, dtype=dtypes.bool), a, b), an
        else:
            y, yn = (a * c).realize_sync(), an * np.float32(c)  # a realized node in the middle
        if np.abs(yn).max() > 1e6:  # (exp of exp: keep the values comparable)
            continue
        vals.append((y, yn.astype(np.float32)))
    n = int(rng.integers(1, 4))
    return [vals[-1 - int(k)] for k in rng.choice(min(len(vals), 6), size=n, replace=False)]


@pytest.mark.parametrize("seed", range(40))
def test_walk_matches_python(seed: int) -> None:
    rng = np.random.default_rng(seed)
    leaves = []
    for _ in range(3):
        xn = rng.standard_normal((4, 6)).astype(np.float32)
        leaves.append((Tensor(xn), xn))
    outs = _random_graph(rng, leaves)
    targets = list(dict.fromkeys(t.id for t, _ in outs if GRAPH[t.id].buffer is None))
    if targets:
        _same(_walks(targets))
    asyncio.run(azyx.realize(*[t for t, _ in outs]))  # the plan made from the native walk computes numpy's values
    for t, ref in outs:
        np.testing.assert_allclose(t.numpy_sync(), ref, rtol=2e-3, atol=1e-5)


def test_walk_scalars_reach_kernels() -> None:
    """Graphs that differ only in numbers share a key; each realize binds its own numbers (numpy's values)."""
    xn = np.arange(12, dtype=np.float32).reshape(3, 4)
    x = Tensor(xn, device="c:0")
    keys = set()
    for a, b, fill in [(0.5, 1.0, -1.0), (2.0, -3.0, 7.0), (-1.25, 0.0, 2.5)]:
        y = ((x * a + b).relu() - a).pad(((0, 1), (1, 0)), value=fill)
        keys.add(walk_mod.canonicalize(GRAPH, [y.id]).key)
        ref = np.pad(np.maximum(xn * a + b, 0) - a, ((0, 1), (1, 0)), constant_values=fill)
        np.testing.assert_allclose(y.numpy_sync(), ref, rtol=1e-6)
    assert len(keys) == 1


def test_walk_donations_match_python() -> None:
    """An ASSIGN into a buffer nothing else holds is donated in both walks; one whose base another leaf reads is not."""
    w = Tensor(np.zeros((4, 4), np.float32)).realize_sync()
    w[1:3] = 5.0
    _same(_walks([w.id]))
    assert walk_mod._walk_native(GRAPH, [w.id]).donated
    v = Tensor(np.ones((4, 4), np.float32)).realize_sync()
    view = v.T  # another handle reads v's buffer: not donated
    v[0] = 2.0
    walks = _walks([v.id, view.id])
    _same(walks)
    np.testing.assert_array_equal(v.numpy_sync()[0], np.full(4, 2.0, np.float32))
    np.testing.assert_array_equal(view.numpy_sync(), np.ones((4, 4), np.float32))


def test_walk_of_a_deep_chain() -> None:
    """The native walk is iterative: a chain far deeper than Python's recursion limit walks (and computes)."""
    x = Tensor(np.ones(8, np.float32))
    y = x
    for _ in range(20000):
        y = y + 1.0
    w = walk_mod.canonicalize(GRAPH, [y.id])
    assert len(w.topo) == 20000 and len(w.scalars) == 20000 and w.leaves == [x.id]
    assert w.key == walk_mod._walk_iterative(GRAPH, [y.id]).key


def test_release_frees_what_python_frees() -> None:
    """Dropping the last handle frees a whole graph, slot by slot, and the slots are reused; a tape's id sets lose
    the freed ids."""
    before = len(GRAPH)
    x = Tensor(np.ones((2, 3), np.float32))
    ys = [x * float(k) + x for k in range(50)]
    shared = ys[0] * ys[1]
    assert len(GRAPH) > before + 100
    del ys, shared
    assert len(GRAPH) == before + 1
    del x
    assert len(GRAPH) == before
    with GradientTape():
        a = Tensor(np.ones(3, np.float32))
        b = a * 2.0
        bid = b.id
        assert any(bid in ids for ids in GRAPH.kept)
        del b
        assert not any(bid in ids for ids in GRAPH.kept)


def test_release_of_a_dead_node_is_an_assertion() -> None:
    g = Graph()
    i = g.add(Node(Op.CONST, (), 1.0, (), dtypes.float32, "c:0", False))
    g.retain(i)
    g.release(i)
    with pytest.raises(AssertionError):
        g.release(i)


def test_node_fields_and_repr() -> None:
    x = Tensor(np.ones((2, 2), np.float32)) * 3.0
    n = GRAPH[x.id]
    assert n.op is Op.BINARY and n.arg == "mul" and n.arg2 == 3.0 and n.shape == (2, 2) and n.buffer is None
    n.pinned = True
    assert n.pinned is True
    assert repr(n).startswith("Node(BINARY, src=(") and "float32" in repr(n)
    with pytest.raises(TypeError):
        Node(Op.CONST, ())  # type: ignore[call-arg]  # too few arguments
    with pytest.raises(TypeError):
        Node(Op.CONST, (), 1.0, (), dtypes.float32, "c:0", False, value=None)  # type: ignore[call-arg]
    assert Node(Op.PAD, (1,), ((0, 1),), (3,), dtypes.float32, "c:0", False, arg2=2.5).arg2 == 2.5


def test_node_in_a_cycle_is_collected() -> None:
    """A node that holds itself (through its argument) is freed by the cyclic collector, not leaked."""
    n = Node(Op.CONST, (), None, (), dtypes.float32, "c:0", False)
    holder = [n]
    n.arg = holder

    class Probe:
        pass

    probe = Probe()
    n.arg2 = probe
    gone = weakref.ref(probe)
    del n, holder, probe
    gc.collect()
    assert gone() is None


OPERANDS = [2, 3.5, -1, True]


@pytest.mark.parametrize("dtype", ["float32", "float16", "int32", "uint8", "bool"])
def test_operators_in_c_match_python(dtype: str) -> None:
    """Each operator built in C (Method) gives the graph and the values that the Python operator (its __wrapped__)
    gives: numbers of each kind on either side, tensors of the same or another dtype and shape, constants."""
    rng = np.random.default_rng(3)
    xn = (rng.integers(1, 5, (2, 3)) if dtype != "bool" else rng.integers(0, 2, (2, 3))).astype(dtype)
    x = Tensor(xn)
    others: list = [*OPERANDS, x, Tensor(xn[::-1].copy()), Tensor(np.ones(3, np.float32)),
                    Tensor.full((2, 3), 2, dtype=dtype)]
    names = ["__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
             "__lt__", "__ge__", "__eq__", "__and__", "__or__", "__xor__", "maximum"]
    for name in names:
        op = getattr(Tensor, name)
        for other in others:
            outcome = []
            for fn in (op, op.__wrapped__):
                try:
                    y = fn(x, other)
                except azyx.AzyxError as e:
                    outcome.append(type(e))
                    continue
                n = GRAPH[y.id]
                v = y.numpy_sync()  # (bit for bit: 0 / 0 is a NaN in both)
                outcome.append((n.op, n.arg, n.arg2, n.shape, n.dtype, n.device, n.pinned, len(n.src), v.dtype,
                                v.tobytes()))
            assert outcome[0] == outcome[1], (name, dtype, other)


def test_operator_binds_like_a_method() -> None:
    x = Tensor(np.arange(3, dtype=np.float32))
    bound = x.__mul__
    assert bound.__self__ is x and Tensor.__mul__.__name__ == "__mul__"
    np.testing.assert_array_equal(bound(2.0).numpy_sync(), [0.0, 2.0, 4.0])
    np.testing.assert_array_equal(Tensor.maximum(x, 1.0).numpy_sync(), [1.0, 1.0, 2.0])
    assert "elementwise" in (Tensor.__add__.__doc__ or "")


def test_finalizer_frees_nodes() -> None:
    before = len(GRAPH)
    x = Tensor(np.ones(4, np.float32))
    y = x
    for _ in range(100):
        y = y * 2.0 + x  # each rebinding drops the last handle of the node before
    assert len(GRAPH) == before + 201
    del y
    assert len(GRAPH) == before + 1
    del x
    assert len(GRAPH) == before


def test_become_leaf_keeps_sources_only_on_a_tape() -> None:
    """A realized node forgets how it was made (its sources released) unless a live tape recorded it."""
    x = Tensor(np.full(3, 2.0, np.float32), device="c:0")
    y = (x * 3.0).realize_sync()
    n = GRAPH[y.id]
    assert n.op is Op.LEAF and n.src == () and n.arg is None and n.buffer is not None and n.device == "c:0"
    with GradientTape() as tape:
        x2 = Tensor(np.full(3, 2.0, np.float32))
        z = (x2 * x2).realize_sync()
        assert GRAPH[z.id].op is Op.BINARY and GRAPH[z.id].src == (x2.id, x2.id)
        total = z.sum()
    (g,) = tape.gradient(total, [x2])
    np.testing.assert_allclose(g.numpy_sync(), [4.0, 4.0, 4.0])
    np.testing.assert_allclose(z.numpy_sync(), [4.0, 4.0, 4.0])


def test_a_realized_leaf_matches_python() -> None:
    """native.realized (an azyx.jit replay's results) makes the node and handle that Python's Node, Graph.add and
    Tensor._wrap make: a LEAF holding the buffer and view, counted once, recorded by a live tape, freed with its
    handle."""
    x = Tensor(np.arange(6, dtype=np.float32), device="c:0").realize_sync()
    src = GRAPH[x.id]
    buf, view = src.buffer, src.view
    before = len(GRAPH)
    made = []
    with GradientTape():
        for make in (native.realized, None):
            if make is None:
                node = Node(Op.LEAF, (), None, (6,), dtypes.float32, "c:0", True)
                node.buffer, node.view = buf, view
                t = Tensor._wrap(GRAPH.add(node))
            else:
                t = make((6,), dtypes.float32, "c:0", True, buf, view)
            assert type(t) is Tensor and t.id in GRAPH.recording[-1]
            made.append(t)
        a, b = (GRAPH[t.id] for t in made)
        assert (a.op, a.src, a.arg, a.shape, a.dtype, a.device, a.pinned, a.rc) == \
               (b.op, b.src, b.arg, b.shape, b.dtype, b.device, b.pinned, b.rc) == \
               (Op.LEAF, (), None, (6,), dtypes.float32, "c:0", True, 1)
        assert a.buffer is b.buffer is buf and a.view is b.view is view
        np.testing.assert_array_equal(made[0].numpy_sync(), np.arange(6, dtype=np.float32))
        np.testing.assert_array_equal((made[0] + made[1]).numpy_sync(), 2 * np.arange(6, dtype=np.float32))
    assert len(GRAPH) == before + 2
    del t
    made.clear()
    assert len(GRAPH) == before


def test_scalar_words_match_struct() -> None:
    """The words C packs for each scalar dtype are struct's (azyx.dtypes' Python packer), ints wrapped into their
    dtype as PyTorch wraps them; a float beyond float32 raises as struct does."""
    import struct

    values = [0.1, -2.5, 3, True, 1e30, -0.0, 300, -129, 2**40 + 7, -1, 65537, 2.75]
    for d in (dtypes.float32, dtypes.float64, dtypes.float16, dtypes.bfloat16, dtypes.int8, dtypes.uint8,
              dtypes.int16, dtypes.int32, dtypes.uint32, dtypes.int64):
        code = SCALAR_CODES[d.name]
        for k, v in enumerate(values):
            if d.is_float and isinstance(v, int) and abs(v) > 2**24:
                continue
            got = native.pack_words(code.encode(), (k,), values)  # type: ignore[union-attr]
            if d.is_float:
                ref = struct.unpack("<Q", struct.pack("<" + code + ("4x" if code == "f" else ""), v))
            else:
                bits = 8 * struct.calcsize(code)
                ref = ((int(v) & ((1 << bits) - 1)),)
            assert got == ref, (d, v)
    with pytest.raises(OverflowError):
        native.pack_words(b"f", (0,), [1e300])  # type: ignore[union-attr]


def test_calls_of_c_functions() -> None:
    """native.call and native.call_out (the CUDA launch path's driver calls) call C functions of integer and pointer
    parameters by address: libc's here."""
    import ctypes

    libc = ctypes.CDLL(None)

    def addr(f: object) -> int:
        return ctypes.cast(f, ctypes.c_void_p).value  # type: ignore[arg-type,return-value]

    assert native is not None
    assert native.call(addr(libc.abs), -7 & (2**64 - 1)) == 7  # (an int parameter: the low 32 bits)
    text = ctypes.create_string_buffer(b"azyx runtime")
    assert native.call(addr(libc.strlen), ctypes.addressof(text)) == 12
    fds = native.call_out(addr(libc.pipe))  # (pipe writes two ints through its pointer)
    r, w = fds & 0xFFFFFFFF, fds >> 32
    try:
        os.write(w, b"ok")
        assert os.read(r, 2) == b"ok"
    finally:
        os.close(r)
        os.close(w)
    with pytest.raises(ValueError):
        native.call(0)


def _python_pool(*args: object, **kw: object) -> PoolAllocator:
    """A PoolAllocator with the native core's pool taken out: the Python free lists and lock."""
    a = PoolAllocator(*args, **kw)  # type: ignore[arg-type]
    a.pool = None
    del a.free  # (the instance's C `give`)
    return a


@pytest.mark.parametrize("lowest", [False, True])
def test_pool_matches_python(lowest: bool) -> None:
    """The native pool hands out, caches and refuses exactly as the Python one: buckets, the lowest address first
    (`lowest`) or the block freed last, the cache limit, the capacity, all-or-none steps, draining with `keep`."""
    rng = np.random.default_rng(5)
    made = [iter(range(10**6, 10**7, 64)), iter(range(10**6, 10**7, 64))]  # (the same blocks for each)
    pools = [PoolAllocator(1 << 20, 1 << 16, lambda size: next(made[0]), "p", lowest=lowest),
             _python_pool(1 << 20, 1 << 16, lambda size: next(made[1]), "p", lowest=lowest)]
    assert pools[0].pool is not None
    held: list[list[tuple[int, int]]] = [[], []]
    for step in range(400):
        op = int(rng.integers(5))
        nbytes = int(rng.choice([1, 64, 100, 4096, 5000, 70000, 300000]))
        k = int(rng.integers(1 << 30))
        outcome = []
        for pool, h in zip(pools, held):
            try:
                if op in (0, 1):
                    mem, size = pool.alloc(nbytes)
                    h.append((mem, size))
                    got: object = (mem, size)
                elif op == 2 and h:
                    mem, size = h.pop(k % len(h))
                    pool.free(mem, size)
                    got = None
                elif op == 3:
                    blocks = pool.alloc_many([nbytes, 64, 4096])
                    h.extend(blocks)
                    got = blocks
                else:
                    r = pool.reuse(nbytes)
                    if r is not None:
                        h.append(r)
                    got = r
            except azyx.AzyxError as e:
                got = str(e)
            outcome.append((got, pool.in_use, pool.cached, tuple(pool.usage())))
        assert outcome[0] == outcome[1], (step, op, nbytes)
    assert held[0] == held[1]
    for size in (64, 4096, 8192, 73728, 303104):
        assert pools[0].cached_blocks(size) == pools[1].cached_blocks(size)
    kept = [pool.take_cached(keep=lambda m: m % 128 == 0) for pool in pools]
    assert sorted(kept[0]) == sorted(kept[1]) and pools[0].usage() == pools[1].usage()


def test_pool_counts_stay_exact_with_frees_from_another_thread() -> None:
    """Frees from another thread (a Buffer's finalizer runs on any) meet allocations here: the counts stay exact."""
    import threading

    pool = PoolAllocator(1 << 30, 1 << 30, lambda size: bytearray(size), "p")
    blocks = [pool.alloc(4096) for _ in range(2000)]

    def frees() -> None:
        for mem, size in blocks[1000:]:
            pool.free(mem, size)

    t = threading.Thread(target=frees)
    t.start()
    again = [pool.alloc(4096) for _ in range(500)]
    t.join()
    assert pool.in_use == (1000 + 500) * 4096 and len(again) == 500
    assert 500 * 4096 <= pool.cached <= 1000 * 4096 and pool.usage() == (pool.in_use, pool.cached)


UNARY = ["abs", "exp", "log", "exp2", "log2", "sqrt", "rsqrt", "reciprocal", "sin", "cos", "tan", "tanh", "erf",
         "sigmoid", "relu", "silu", "softplus", "sign"]


def _graph_and_value(t: Tensor) -> tuple:
    n = GRAPH[t.id]
    srcs = tuple((GRAPH[s].op, GRAPH[s].arg, GRAPH[s].shape, GRAPH[s].dtype) for s in n.src)
    v = t.numpy_sync()
    return n.op, n.arg, n.shape, n.dtype, n.device, n.pinned, srcs, v.dtype, v.tobytes()


@pytest.mark.parametrize("dtype", ["float32", "float16", "int32", "bool"])
def test_unary_and_reduce_methods_in_c_match_python(dtype: str) -> None:
    """x.exp() and the like, and x.sum() over every axis, built in C give the graph and the values of the Python
    methods (their __wrapped__), for float and other dtypes, constants, 0-d and empty tensors; calls with arguments
    are the Python method's."""
    rng = np.random.default_rng(11)
    xs = [Tensor(rng.uniform(0.5, 2.0, (3, 4)).astype(dtype)), Tensor.full((2, 3), 2, dtype=dtype),
          Tensor(np.array(1.5).astype(dtype)), Tensor(np.zeros((0, 3), dtype))]
    for x in xs:
        for name in [*UNARY, "sum", "prod", "max", "min"]:
            method = getattr(Tensor, name)
            outcome = []
            for fn in (method, method.__wrapped__):
                try:
                    outcome.append(_graph_and_value(fn(x)))
                except Exception as e:  # (numpy's own, folding a bool constant's sign: the same from both)
                    outcome.append(type(e))
            assert outcome[0] == outcome[1], (name, dtype, x.shape)
    x = xs[0]
    xn = x.numpy_sync()
    np.testing.assert_allclose(x.sum(axis=1).numpy_sync(), xn.sum(axis=1), rtol=1e-3)
    np.testing.assert_array_equal(x.max(0, True).numpy_sync(), xn.max(axis=0, keepdims=True))
    np.testing.assert_allclose(x.sum(keepdim=True).numpy_sync(), xn.sum(keepdims=True), rtol=1e-3)


def test_a_batch_call_in_c_matches_the_ctypes_call() -> None:
    """native.TableCall (the C device's inline batch call: the table filled and azyx_run called in C) against the
    Python form of the same call (the table packed by struct, azyx_run called through ctypes): one small plan of
    several kernels and runtime scalars, run steady through each, gives numpy's values each time."""
    import ctypes

    from azyx.backends.c import _Layout
    from azyx.runtime import RT

    rng = np.random.default_rng(11)
    xn, yn = rng.standard_normal((16, 24)).astype(np.float32), rng.standard_normal((16, 24)).astype(np.float32)
    x, y = Tensor(xn, device="c:0"), Tensor(yn, device="c:0")

    def build(a: float) -> Tensor:
        t = (x * a + y).relu()
        return (t - t.max(axis=1, keepdims=True)).exp().sum(axis=1) * (y - a).sum() + a

    def want(a: float) -> np.ndarray:
        t = np.maximum(xn * np.float32(a) + yn, 0).astype(np.float64)
        return np.exp(t - t.max(axis=1, keepdims=True)).sum(axis=1) * (yn.astype(np.float64) - a).sum() + a

    build(0.5).numpy_sync()  # (planned, compiled, prepared)
    probe = build(0.25)
    plan = RT.plan_cache.get(walk_mod.canonicalize(GRAPH, [probe.id]).key)
    assert plan is not None and len(plan.kernels) > 1
    probe.numpy_sync()
    layouts = [s.batch.prepared for s in RT.executor.prepared[plan].segments if s.batch is not None]
    assert layouts and all(isinstance(lay, _Layout) and lay.call is not None and lay.n_words for lay in layouts)
    calls = [lay.call for lay in layouts]
    made: list[int] = []

    def counted(call: Any) -> Any:
        def run(pool: int, values: list[int]) -> None:
            made.append(len(values))
            call(pool, values)
        return run

    for in_c in (True, False, True):
        for lay, call in zip(layouts, calls):
            lay.call = counted(call) if in_c else None  # (None: the ctypes call of the same table)
            ctypes.memset(lay.scratch, 0, ctypes.sizeof(lay.scratch))
        made.clear()
        try:
            for k in range(4):
                a = 0.75 * k - 1.0
                np.testing.assert_allclose(build(a).numpy_sync(), want(a), rtol=1e-4, atol=1e-3)
        finally:
            for lay, call in zip(layouts, calls):
                lay.call = call
        if in_c:  # (every run took the inline call)
            assert len(made) == 4 * len(layouts)
        else:  # (the Python form filled the table)
            assert all(any(lay.scratch) for lay in layouts)
