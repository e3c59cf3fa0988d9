"""azyx.io: safetensors files written by the `safetensors` package and by azyx, read lazily (disk tensors),
partially, streamed and saved atomically; malformed files; cancellation. Real files in tmp_path, no mocks."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
from hypothesis import given, settings
from safetensors.numpy import load_file, save_file
from test_fuzz_views import apply, chains

import azyx
from azyx import Tensor, dtypes
from azyx.graph import GRAPH
from azyx.runtime import RT

# numpy arrays for every dtype the format and azyx share (bfloat16: its bits as uint16)
DTYPES = ["float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"]
ST_NAMES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
            "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def sample(name: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if name == "bool":
        return rng.random(shape) < 0.5
    if name == "bfloat16":  # bfloat16 bits of exactly representable values (finite, varied)
        return (rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    if name.startswith("float"):
        return (rng.standard_normal(shape) * 10).astype(name)
    info = np.iinfo(name)
    return rng.integers(info.min, info.max, shape, dtype=name, endpoint=True)


def as_float(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits -> the float32 values azyx's numpy() returns for them."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def write_with_safetensors(path: Path, arrays: dict[str, tuple[str, np.ndarray]], metadata: Any = None) -> None:
    """The `safetensors` package's own writer (TensorSpec: it takes bfloat16 as raw bits)."""
    keep = {k: np.ascontiguousarray(a) for k, (_, a) in arrays.items()}
    specs = {k: safetensors.TensorSpec(dtype=dt, shape=list(keep[k].shape), data_ptr=keep[k].ctypes.data,
                                       data_len=keep[k].nbytes) for k, (dt, _) in arrays.items()}
    safetensors.serialize_file(specs, str(path), metadata=metadata)


def raw_file(path: Path, header: Any, data: bytes = b"", length: int | None = None) -> Path:
    """A file with any header (an object, or raw bytes), for malformed cases."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(text) if length is None else length
    path.write_bytes(n.to_bytes(8, "little") + text + data)
    return path


def disk() -> Any:
    return azyx.io.disk_device()


def in_use() -> dict[str, int]:
    return {n: d.allocator.in_use for n, d in RT.executor.devices.items() if hasattr(d, "allocator")}


async def settle() -> tuple[int, dict[str, int], int]:
    await azyx.synchronize()
    gc.collect()
    return len(GRAPH), in_use(), disk().buffers


async def runtime_still_works() -> None:
    assert (await (Tensor(np.arange(4, dtype=np.float32)) * 2).numpy()).tolist() == [0.0, 2.0, 4.0, 6.0]


# ------------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("name", DTYPES)
async def test_every_dtype_round_trips(tmp_path: Path, name: str) -> None:
    a, b = sample(name, (5, 7), 1), sample(name, (3,), 2)
    src = tmp_path / "in.safetensors"
    write_with_safetensors(src, {"a": (name, a), "b": (name, b)}, metadata={"who": "safetensors"})
    want = as_float(a) if name == "bfloat16" else a
    ts = azyx.io.load_safetensors(src)
    assert ts["a"].dtype is getattr(dtypes, name) and ts["a"].shape == (5, 7) and ts["a"].device == "disk"
    np.testing.assert_array_equal(await ts["a"].numpy(), want)  # read from disk
    np.testing.assert_array_equal(await ts["a"].to("c:0").numpy(), want)  # loaded onto a device
    streamed = {k: await t.numpy() async for k, t in azyx.io.stream_safetensors(src, device="c:0")}
    np.testing.assert_array_equal(streamed["a"], want)
    assert azyx.io.metadata_of(src) == {"who": "safetensors"}
    # and back out: azyx's file, read by the safetensors package, holds the same bytes
    out = tmp_path / "out.safetensors"
    c0 = Tensor(np.asarray(want), dtype=name, device="c:0")
    await azyx.io.save_safetensors(out, {"disk_a": ts["a"], "b": ts["b"], "c0": c0}, metadata={"k": "v"})
    got = dict(safetensors.deserialize(out.read_bytes()))
    for key, arr in (("disk_a", a), ("b", b), ("c0", a)):
        assert got[key]["dtype"] == ST_NAMES[name] and got[key]["shape"] == list(arr.shape)
        assert bytes(got[key]["data"]) == np.ascontiguousarray(arr).tobytes()
    with safetensors.safe_open(str(out), "numpy") as f:
        assert f.metadata() == {"k": "v"}
    if name != "bfloat16":  # numpy has no bfloat16
        np.testing.assert_array_equal(load_file(out)["c0"], a)


async def test_empty_and_scalar_tensors(tmp_path: Path) -> None:
    p = tmp_path / "e.safetensors"
    save_file({"empty": np.zeros((0, 3), np.float32), "scalar": np.array(2.5, np.float32),
               "one": np.ones((1,), np.int64)}, p)
    ts = azyx.io.load_safetensors(p)
    assert (await ts["empty"].numpy()).shape == (0, 3)
    assert await ts["scalar"].item() == 2.5
    assert (await (ts["scalar"] + ts["one"]).numpy()).tolist() == [3.5]
    q = tmp_path / "e2.safetensors"
    await azyx.io.save_safetensors(q, ts)
    back = load_file(q)
    assert back["empty"].shape == (0, 3) and back["scalar"].shape == () and back["scalar"] == 2.5


# ------------------------------------------------------------------------------------------------ lazy and partial
async def test_nothing_is_read_until_realized(tmp_path: Path) -> None:
    x = np.arange(24 * 32, dtype=np.float32).reshape(24, 32) / 1000
    p = tmp_path / "x.safetensors"
    save_file({"x": x, "y": np.ones(8, np.int32)}, p)
    before = disk().bytes_read
    ts = azyx.io.load_safetensors(p)
    t = Tensor.from_safetensors(p, "x")
    y = ((t * 2).sum(axis=1) + ts["y"].sum()).exp2()  # a graph over disk tensors: still nothing read
    assert disk().bytes_read == before
    assert t.device == "disk" and "disk" not in azyx.devices()
    out = await y.numpy()
    assert disk().bytes_read == before + x.nbytes + 8 * 4  # each tensor read once, whole
    np.testing.assert_allclose(out, np.exp2(x.sum(1) * 2 + 8), rtol=1e-5)


async def test_large_reads_are_split_across_threads(tmp_path: Path) -> None:
    from azyx.loads import SPLIT

    x = np.random.default_rng(5).standard_normal((5 * SPLIT // 2 + 12) // 4).astype(np.float32)  # pieces unaligned
    p = tmp_path / "big.safetensors"
    save_file({"x": x}, p)
    t = Tensor.from_safetensors(p, "x")
    reads, nbytes = disk().reads, disk().bytes_read
    np.testing.assert_array_equal(await t.numpy(), x)  # the disk's own read (`Loads.read_split`): pieces on the readers
    assert disk().bytes_read - nbytes == x.nbytes and disk().reads - reads >= min(2, os.cpu_count() or 1)
    np.testing.assert_array_equal(await t.to("c:0").numpy(), x)  # (a plan's transfer: the load pipeline's extents)
    streamed = [await v.numpy() async for _, v in azyx.io.stream_safetensors(p, device="c:0")]
    np.testing.assert_array_equal(streamed[0], x)


async def test_slices_read_only_their_bytes(tmp_path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((100, 64)).astype(np.float32)
    p = tmp_path / "x.safetensors"
    save_file({"x": x}, p)
    t = Tensor.from_safetensors(p, "x")
    row = 64 * 4
    cases = [
        (lambda: t[2:5], x[2:5], 3 * row),
        (lambda: t[7], x[7], row),
        (lambda: t[-1, 3:9], x[-1, 3:9], 6 * 4),
        (lambda: t[10:20].reshape(5, 128), x[10:20].reshape(5, 128), 10 * row),
        (lambda: t[2:5].cast("float16") * 2, (x[2:5].astype(np.float16) * 2), 3 * row),  # cast after the slice
        (lambda: t[4:6].to("c:1") + 1, x[4:6] + 1, 2 * row),
        (lambda: t[:, 1], x[:, 1], 100 * 4),  # a column: its elements only (runs of one element, one per row)
        (lambda: t[:, 1:3], x[:, 1:3], 100 * 2 * 4),  # columns: one run per row
        (lambda: t[:, 1:3][4:6], x[4:6, 1:3], 100 * 2 * 4),  # a view of runs: all the runs read, sliced on a device
        (lambda: t[3, 5].reshape(1, 1).expand(2, 3), np.full((2, 3), x[3, 5]), 4),  # one element, broadcast
        (lambda: t[5:8].T.flip(0), x[5:8].T[::-1], 3 * row),
    ]
    for build, want, nbytes in cases:
        before = disk().bytes_read
        v = build()
        assert disk().bytes_read == before, "building read something"
        np.testing.assert_allclose(await v.numpy(), want, rtol=1e-3)
        assert disk().bytes_read - before == nbytes
    assert t[2:5].device == "disk" and t[7].shape == (64,)  # views of a disk tensor stay on disk


@settings(max_examples=60, deadline=None, derandomize=True)
@given(chains())
def test_random_view_chains_over_a_disk_tensor_match_numpy(case: tuple[np.ndarray, list[tuple]]) -> None:
    """The movement-op chains of test_fuzz_views, starting from a file: views stay on disk as narrower ranges,
    the rest computes on a device, and every result matches numpy."""
    x, ops = case
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "x.safetensors"
        save_file({"x": x}, p)
        ref = np.asarray(apply(x, ops, True))
        out = apply(Tensor.from_safetensors(p, "x"), ops, False).numpy_sync()  # type: ignore[attr-defined]
    assert out.shape == ref.shape, ops
    np.testing.assert_allclose(out, ref, rtol=1e-6, err_msg=str(ops))


async def test_ops_on_disk_tensors_compute_on_a_compute_device(tmp_path: Path) -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    p = tmp_path / "a.safetensors"
    save_file({"a": a, "b": a * 10}, p)
    ts = azyx.io.load_safetensors(p)
    s = ts["a"] + ts["b"]  # all operands on disk: AUTO
    assert s.device in azyx.devices()
    pinned = ts["a"] * Tensor(np.ones(3, np.float32), device="c:1")  # a pinned compute operand wins
    assert pinned.device == "c:1"
    assert (ts["a"] + 1).device in azyx.devices() and ts["a"].argmax().device in azyx.devices()
    np.testing.assert_array_equal(await s.numpy(), a * 11)
    np.testing.assert_array_equal(await pinned.numpy(), a)
    assert await ts["a"].argmax().item() == 5
    with pytest.raises(azyx.DeviceError, match="disk"):
        Tensor(a).to("disk")
    assert ts["a"].to("disk") is ts["a"]


async def test_saving_over_the_file_a_tensor_was_loaded_from(tmp_path: Path) -> None:
    """Saving over the file lazy tensors come from works (the save reads them, then replaces the file atomically);
    after that they raise, naming the file, rather than serve the replaced file's bytes."""
    p = tmp_path / "w.safetensors"
    save_file({"w": np.full(4, 1.0, np.float32)}, p)
    w = Tensor.from_safetensors(p, "w")
    await azyx.io.save_safetensors(p, {"w": w * 3})  # reads the old file, replaces it atomically
    with pytest.raises(azyx.AzyxIOError, match=re.escape(str(p)) + ".*replaced"):
        await w.numpy()
    assert (await Tensor.from_safetensors(p, "w").numpy()).tolist() == [3.0] * 4
    assert load_file(p)["w"].tolist() == [3.0] * 4


async def test_a_file_truncated_after_opening_fails_at_realize(tmp_path: Path) -> None:
    p = tmp_path / "t.safetensors"
    save_file({"a": np.ones(1000, np.float32), "b": np.ones(1000, np.float32)}, p)
    ts = azyx.io.load_safetensors(p)
    os.truncate(p, os.path.getsize(p) - 100)
    with pytest.raises(azyx.AzyxIOError, match=re.escape(str(p))):
        await ts["b"].to("c:0").realize()
    with pytest.raises(azyx.AzyxIOError, match="truncated"):
        await ts["b"].numpy()
    await runtime_still_works()


async def test_file_reads_never_run_on_the_event_loop(tmp_path: Path) -> None:
    """Small reads too (a host device runs small copies inline, on the loop's thread, but never a file read)."""
    p = tmp_path / "small.safetensors"
    save_file({"a": np.arange(4, dtype=np.float32), "b": np.ones((2, 2), np.int8)}, p)
    before = disk().reads_on_loop, disk().reads
    ts = azyx.io.load_safetensors(p)
    await ts["a"].numpy()
    await (ts["a"].to("c:0") + ts["b"].sum()).realize()
    await ts["b"][1].to("c:1").realize()
    [t async for t in azyx.io.stream_safetensors(p, device="c:0")]
    await azyx.io.save_safetensors(tmp_path / "copy.safetensors", ts)
    await azyx.synchronize()
    assert disk().reads - before[1] >= 6 and disk().reads_on_loop == before[0]


# ------------------------------------------------------------------------------------------------ streaming
def _bucketed_file(tmp_path: Path, sizes: list[int]) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    arrays = {f"t{i:02d}": rng.standard_normal(n // 4).astype(np.float32) for i, n in enumerate(sizes)}
    p = tmp_path / "s.safetensors"
    save_file(arrays, p)
    return p, arrays


async def test_stream_reads_ahead_while_the_consumer_computes(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    arrays = {f"w{i}": rng.standard_normal((128, 128)).astype(np.float32) for i in range(8)}
    p = tmp_path / "m.safetensors"
    save_file(arrays, p)
    size = 128 * 128 * 4
    x = Tensor(rng.standard_normal((64, 128)).astype(np.float32), device="c:0")
    stream = azyx.io.stream_safetensors(p, device="c:0", prefetch=3 * size)
    names, pending = [], []
    async for name, w in stream:
        i = len(names)
        names.append(name)
        assert w.device == "c:0" and GRAPH[w.id].buffer is not None  # realized, on the device
        # the next tensors are already being read (up to the budget) while this one is used
        assert stream.next == min(i + 1 + 3, 8) and stream.ahead_bytes <= 3 * size
        pending.append(asyncio.ensure_future((x @ w).relu().sum().item()))  # compute, concurrently with reads
        del w
    assert names == sorted(arrays)  # file order
    sums = await asyncio.gather(*pending)
    xs = await x.numpy()
    want = [float(np.maximum(xs @ arrays[n], 0).sum()) for n in names]
    np.testing.assert_allclose(sums, want, rtol=1e-4)


async def test_stream_memory_is_bounded_by_the_tensor_in_use_plus_prefetch(tmp_path: Path) -> None:
    sizes = [1 << 20, 64 << 10, 3 << 20, 256 << 10, 2 << 20, 4 << 10, 1 << 20, 512 << 10]
    p, arrays = _bucketed_file(tmp_path, sizes)
    prefetch = 1 << 20
    _, base, _ = await settle()
    stream = azyx.io.stream_safetensors(p, device="c:0", prefetch=prefetch)
    peak = 0
    async for name, t in stream:
        grown = in_use()["c:0"] - base["c:0"]
        peak = max(peak, grown)
        assert stream.ahead_bytes <= prefetch
        assert grown <= arrays[name].nbytes + prefetch + 4 * (64 << 10), (name, grown)  # + pool rounding
        np.testing.assert_array_equal(await t.numpy(), arrays[name])
        del t
    assert peak < sum(sizes) // 2


async def test_stream_through_host_memory_to_other_devices(tmp_path: Path, device: str) -> None:
    """Devices whose memory is not host memory get the tensor through their staging blocks (read into, then copied
    over); the dummy device plans and accounts but holds no data, so it checks the path and the accounting."""
    p, arrays = _bucketed_file(tmp_path, [4096, 8192, 1024])
    async for name, t in azyx.io.stream_safetensors(p, device=device):
        assert t.device == device
        np.testing.assert_array_equal(await t.numpy(), arrays[name])
    del t
    base = await settle()
    async for name, t in azyx.io.stream_safetensors(p, device="dummy:0"):
        assert t.device == "dummy:0" and t.shape == arrays[name].shape and t.dtype is dtypes.float32
        assert GRAPH[t.id].buffer is not None
    del t
    assert await settle() == base  # the staging blocks and the buffers went back


async def test_stream_progress_bar(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p, arrays = _bucketed_file(tmp_path, [1 << 16] * 4)
    async with azyx.io.stream_safetensors(p, device="c:0", progress=True) as stream:
        n = sum([1 async for _ in stream])
    assert n == 4
    err = capsys.readouterr().err
    assert p.name in err and "256k" in err and "100%" in err


async def test_stream_under_trio(tmp_path: Path) -> None:
    import trio

    p, arrays = _bucketed_file(tmp_path, [4096, 2048])

    async def main() -> dict[str, float]:
        return {name: await t.sum().item() async for name, t in azyx.io.stream_safetensors(p, device="c:0")}

    loop_thread_result: dict[str, float] = await asyncio.to_thread(trio.run, main)
    assert loop_thread_result == pytest.approx({k: float(v.sum()) for k, v in arrays.items()}, rel=1e-4)


# ------------------------------------------------------------------------------------------------ saving
async def test_save_realizes_lazy_tensors_and_is_readable(tmp_path: Path) -> None:
    x = np.random.default_rng(2).standard_normal((16, 8)).astype(np.float32)
    a = Tensor(x, device="c:0")
    lazy = {"sum": a.sum(axis=0), "t": a.T, "cast": (a * 4).cast("int16"), "flag": a > 0, "slice": a[3:5, ::2]}
    p = tmp_path / "lazy.safetensors"
    await azyx.io.save_safetensors(p, lazy)
    back = load_file(p)
    np.testing.assert_allclose(back["sum"], x.sum(0), rtol=1e-5)
    np.testing.assert_array_equal(back["t"], x.T)
    np.testing.assert_array_equal(back["cast"], (x * 4).astype(np.int16))
    np.testing.assert_array_equal(back["flag"], x > 0)
    np.testing.assert_array_equal(back["slice"], x[3:5, ::2])
    assert sorted(os.listdir(tmp_path)) == ["lazy.safetensors"]  # no temporary left


async def test_a_failing_save_keeps_the_old_file(tmp_path: Path) -> None:
    p = tmp_path / "keep.safetensors"
    save_file({"old": np.arange(3, dtype=np.float32)}, p)
    old = p.read_bytes()
    good = Tensor(np.ones(1000, np.float32), device="c:0")
    nodata = Tensor(np.ones(8, np.float32), device="dummy:0") + 1  # computed on the dummy device: no data to read
    with pytest.raises(azyx.DeviceError, match="dummy"):
        await azyx.io.save_safetensors(p, {"good": good, "nodata": nodata})  # fails after "good" was written
    assert p.read_bytes() == old and os.listdir(tmp_path) == ["keep.safetensors"]
    # a source file truncated behind our back: the save fails reading it, the destination is untouched
    src = tmp_path / "src.safetensors"
    save_file({"a": np.ones(4096, np.float32)}, src)
    lazy = Tensor.from_safetensors(src, "a")
    os.truncate(src, 1000)
    new = tmp_path / "new.safetensors"
    with pytest.raises(azyx.AzyxIOError, match=re.escape(str(src))):
        await azyx.io.save_safetensors(new, {"good": good, "a": lazy})
    assert sorted(os.listdir(tmp_path)) == ["keep.safetensors", "src.safetensors"]
    with pytest.raises(azyx.AzyxIOError, match="nope"):
        await azyx.io.save_safetensors(tmp_path / "nope" / "x.safetensors", {"good": good})
    with pytest.raises(azyx.AzyxIOError, match="__metadata__"):
        await azyx.io.save_safetensors(p, {"__metadata__": good})
    with pytest.raises(azyx.AzyxIOError, match="list"):
        await azyx.io.save_safetensors(p, {"x": [1, 2]})  # type: ignore[dict-item]
    assert p.read_bytes() == old
    await runtime_still_works()


async def test_a_cancelled_save_leaves_no_file(tmp_path: Path) -> None:
    big = Tensor(np.ones(4 << 20, np.float32), device="c:0")
    for yields in range(0, 12, 2):
        p = tmp_path / f"c{yields}.safetensors"
        task = asyncio.ensure_future(azyx.io.save_safetensors(p, {"a": big, "b": big * 2, "c": big + 1}))
        for _ in range(yields):
            await asyncio.sleep(0)  # let the save reach a different await point each time
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        await azyx.synchronize()  # abandoned writes finish, then the temporary is removed
        files = os.listdir(tmp_path)
        assert not [f for f in files if f.endswith(".tmp")], files
        if p.name in files:  # the save finished before the cancel arrived: then the file is whole
            assert load_file(p)["c"][0] == 2.0


# ------------------------------------------------------------------------------------------------ malformed files
def _ok_header(n: int = 4) -> dict[str, Any]:
    return {"a": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}}


MALFORMED: dict[str, tuple[Any, bytes, int | None, str]] = {
    # id: (header, data, header length override, what the message says)
    "empty_file": (b"", b"", None, "too small"),
    "truncated_length": (b"", b"", None, "too small"),  # replaced by 5 bytes below
    "header_longer_than_file": (_ok_header(), b"\0" * 16, 10_000, "past the end of the file"),
    "absurd_header_size": (b"{}", b"", 1 << 62, "limit"),
    "header_just_over_limit": (b"{}", b"", 100_000_001, "limit"),
    "invalid_json": (b'{"a": {"dtype": "F32",', b"", None, "not valid JSON"),
    "json_not_a_dict": (b"[1, 2, 3]", b"", None, "start with '{'"),
    "json_not_a_dict_after_brace": (b'{"a": 1}', b"", None, "must be an object"),
    "invalid_utf8": (b'{"\xff\xfe": 1}', b"", None, "UTF-8"),
    "duplicate_key": (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {"dtype": "F32", '
                      b'"shape": [1], "data_offsets": [0, 4]}}', b"\0" * 4, None, "duplicate"),
    "unknown_dtype": ({"a": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, None, "unknown"),
    "unsupported_dtype": ({"a": {"dtype": "U16", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, None,
                          "not supported"),
    "shape_length_mismatch": ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None,
                              "needs 12 bytes"),
    "negative_dim": ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, None,
                     "non-negative"),
    # a zero among the dimensions makes 0 bytes, but no array has a dimension of 2**62 * 2**62 elements
    "huge_dims_of_no_bytes": ({"b": {"dtype": "F32", "shape": [2**62, 2**62, 0], "data_offsets": [0, 0]},
                               **_ok_header(1)}, b"\0" * 4, None, "too large"),
    "zero_then_huge_dims": ({"b": {"dtype": "U8", "shape": [0, 2**63], "data_offsets": [0, 0]}, **_ok_header(1)},
                            b"\0" * 4, None, "too large"),
    "one_huge_dim": ({"a": {"dtype": "F32", "shape": [2**62], "data_offsets": [0, 2**64]}}, b"\0" * 4, None,
                     "too large"),
    "offsets_not_pair": ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4]}}, b"\0" * 4, None,
                         "data_offsets"),
    "offsets_reversed": ({"a": {"dtype": "F32", "shape": [0], "data_offsets": [4, 0]}}, b"\0" * 4, None,
                         "data_offsets"),
    "missing_field": ({"a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4, None, "missing data_offsets"),
    "truncated_data": (_ok_header(1000), b"\0" * 3000, None, "truncated"),
    "offsets_outside_file": ({"a": {"dtype": "U8", "shape": [8], "data_offsets": [1 << 40, (1 << 40) + 8]}},
                             b"\0" * 8, None, "past the end"),
    "overlapping": ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                     "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, b"\0" * 24, None, "overlaps"),
    "gap": ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, None, "gap"),
    "trailing_bytes": (_ok_header(1), b"\0" * 12, None, "after the last tensor"),
    "bad_metadata": ({"__metadata__": {"k": 1}, **_ok_header(1)}, b"\0" * 4, None, "__metadata__"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_malformed_files_raise_at_the_call_naming_the_file(tmp_path: Path, case: str) -> None:
    header, data, length, problem = MALFORMED[case]
    p = tmp_path / f"{case}.safetensors"
    if case == "empty_file":
        p.write_bytes(b"")
    elif case == "truncated_length":
        p.write_bytes(b"\x10\0\0\0\0")
    else:
        raw_file(p, header, data, length)
    tracemalloc.start()
    try:
        with pytest.raises(azyx.AzyxIOError, match=re.escape(str(p))) as e1:
            azyx.io.load_safetensors(p)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert problem in str(e1.value)
    assert peak < (1 << 20)  # nothing sized by the file's claims was allocated
    with pytest.raises(azyx.AzyxIOError, match=re.escape(problem)):
        Tensor.from_safetensors(p, "a")
    with pytest.raises(azyx.AzyxIOError, match=re.escape(str(p))):
        async for _ in azyx.io.stream_safetensors(p, device="c:0"):
            pass
    await runtime_still_works()


async def test_bad_requests_name_what_is_wrong(tmp_path: Path) -> None:
    p = tmp_path / "ok.safetensors"
    save_file({"a": np.ones(2, np.float32), "b": np.ones(2, np.float32)}, p)
    with pytest.raises(azyx.AzyxIOError, match=r"no tensor named 'c'; it has 'a', 'b'"):
        Tensor.from_safetensors(p, "c")
    with pytest.raises(azyx.AzyxIOError, match="missing.safetensors"):
        azyx.io.load_safetensors(tmp_path / "missing.safetensors")
    with pytest.raises(azyx.AzyxIOError, match="not a regular file"):
        azyx.io.load_safetensors(tmp_path)
    with pytest.raises(azyx.DeviceError, match="nope:3"):
        azyx.io.stream_safetensors(p, device="nope:3")
    with pytest.raises(azyx.AzyxIOError, match="compute device"):
        azyx.io.stream_safetensors(p, device="disk")
    await runtime_still_works()


# ------------------------------------------------------------------------------------------------ cancellation
async def _cancel_loads(p: Path, yields: int) -> None:
    ts = azyx.io.load_safetensors(p)
    tasks = [asyncio.ensure_future((t.to("c:0") * 2).sum().realize()) for t in ts.values()]
    tasks.append(asyncio.ensure_future(ts["t00"].numpy()))
    for _ in range(yields):
        await asyncio.sleep(0)  # let the tasks reach a different await point for each parameter
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    # the runtime is consistent: the same tensors load correctly afterwards
    assert (await ts["t01"].to("c:1").numpy()).shape == ts["t01"].shape


async def _cancel_stream(p: Path, yields: int, device: str = "c:0", prefetch: int = 1 << 20) -> None:
    async def consume() -> None:
        async for _, t in azyx.io.stream_safetensors(p, device=device, prefetch=prefetch):
            await t.sum().realize()

    task = asyncio.ensure_future(consume())
    for _ in range(yields):
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _leave_stream_early(p: Path) -> None:
    async with azyx.io.stream_safetensors(p, device="c:0", prefetch=4 << 20) as stream:
        async for _, t in stream:
            assert stream.ahead and t.device == "c:0"  # reads under way when we leave
            break
    del t


@pytest.mark.parametrize("yields", [0, 1, 3, 8, 30])
async def test_cancelling_a_disk_load_leaks_nothing(tmp_path: Path, yields: int) -> None:
    p, _ = _bucketed_file(tmp_path, [1 << 20, 3 << 20, 256 << 10, 2 << 20])
    base = await settle()
    await _cancel_loads(p, yields)
    await _cancel_stream(p, yields)
    await _leave_stream_early(p)
    assert await settle() == base
