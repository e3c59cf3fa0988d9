"""Loading at the hardware's pace (issue 40): extents read in parallel (the stream and the lazy path), bytes equal to
safetensors' for every dtype and odd sizes and offsets, files truncated while they load, cancelled loads freeing their
staging, loads sharded at the file (each byte read once), and the loop's heartbeat during a first load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from runtime_state import settle
from safetensors.numpy import load_file, save_file
from test_io import _cancel_stream

import azyx
from azyx import Tensor, workers
from azyx.device import buffer_of
from azyx.io.stream import EXTENT, RING
from azyx.loads import HOST_EXTENT
from azyx.runtime import RT

ROOT = Path(__file__).resolve().parent.parent
DTYPES = ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"]  # (and bfloat16 below)


def disk() -> Any:
    return azyx.io.disk_device()


def _odd_file(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """Tensors of every dtype with odd element counts (so odd byte offsets follow them), small ones between large
    ones, and one larger than an extent (read in several)."""
    rng = np.random.default_rng(11)
    arrays: dict[str, np.ndarray] = {}
    for i, name in enumerate(DTYPES):
        n = (1, 3, 7, 13, 127, 1001, 4099)[i % 7]
        raw = rng.integers(0, 256, n * np.dtype(name).itemsize, dtype=np.uint8)
        a = raw.view(name) if name != "bool" else raw.astype(bool)
        if a.dtype.kind == "f":
            a = np.where(np.isfinite(a), a, 0).astype(name)  # (bytes of NaN payloads are not what this checks)
        arrays[f"x{i:02d}.{name}"] = a.reshape(-1)
    arrays["zbig"] = rng.standard_normal(EXTENT // 4 * 2 + 333).astype(np.float32)  # 2+ extents, odd tail
    arrays["zodd"] = rng.integers(-100, 100, (3, 5, 7), dtype=np.int16)
    p = tmp_path / "odd.safetensors"
    save_file(arrays, p)
    return p, arrays


# ------------------------------------------------------------------------------------------------ the native read
def _reference_file(tmp_path: Path, size: int = 3 * 4096 + 777) -> tuple[Path, np.ndarray]:
    raw = np.random.default_rng(21).integers(0, 256, size, dtype=np.uint8)
    p = tmp_path / "bytes.bin"
    raw.tofile(p)
    return p, np.fromfile(p, np.uint8)


def _split(n: int, cuts: list[int]) -> list[np.ndarray]:
    """Fresh destinations for n bytes, cut at `cuts` (empty pieces included)."""
    bounds = [0, *sorted(min(c, n) for c in cuts), n]
    return [np.zeros(hi - lo, np.uint8) for lo, hi in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("offset,start,n", [(0, 0, 1), (1, 0, 4095), (4095, 3, 4099), (7, 4093, 8193), (0, 0, 13065)])
def test_the_native_read_equals_numpys_read_of_the_file(tmp_path: Path, offset: int, start: int, n: int,
                                                         direct: bool) -> None:
    """`native.read_range` and `native.read_direct` (O_DIRECT through an aligned block smaller than the read, where
    the filesystem allows it) through `FileRange.read_views`: the bytes at odd offsets and sizes, into destinations
    cut at odd places (an empty one among them), equal numpy's read of the file, as do a range of runs' (a column
    slice's bytes)."""
    from azyx.files import DIRECT_ALIGN, DiskFile, FileRange, direct_block
    from azyx.native import native

    if native is None:
        pytest.skip("the native core is not built")
    p, ref = _reference_file(tmp_path)
    f = DiskFile(str(p))
    n = min(n, f.size - offset - start)
    outs = _split(n, [n // 3, n // 3, n - 1])
    block = direct_block(2 * DIRECT_ALIGN) if direct else None
    FileRange(f, offset, "bytes").read_views(start, [o.data for o in outs], block)
    assert np.concatenate(outs).tobytes() == ref[offset + start : offset + start + n].tobytes()
    run, step = 5, 13  # (5 bytes of every 13: the runs' bytes packed)
    rows = (f.size - offset) // step
    want = ref[offset : offset + rows * step].reshape(rows, step)[:, :run].reshape(-1)[start % 50 :]
    outs = _split(len(want), [3, 4, 77])
    FileRange(f, offset, "runs", (run, step)).read_views(start % 50, [o.data for o in outs], block)
    assert np.concatenate(outs).tobytes() == want.tobytes()
    f.close()


@pytest.mark.parametrize("direct", [False, True])
def test_the_native_read_of_a_short_file_raises_naming_it(tmp_path: Path, direct: bool) -> None:
    """A read past the end of the file (the file shorter than the range) raises AzyxIOError naming the file and where
    it ended; a file truncated after it was opened, naming what changed."""
    from azyx.files import DIRECT_ALIGN, DiskFile, FileRange, direct_block

    p, _ = _reference_file(tmp_path)
    f = DiskFile(str(p))
    block = direct_block(DIRECT_ALIGN) if direct else None
    with pytest.raises(azyx.AzyxIOError, match=rf"tensor 'w' of {p}: unexpected end of file at byte {f.size}"):
        FileRange(f, f.size - 100, "tensor 'w'").read_views(0, [np.zeros(300, np.uint8).data], block)
    os.truncate(p, 5000)
    with pytest.raises(azyx.AzyxIOError, match=rf"tensor 'w' of {p}: truncated to 5000 bytes"):
        FileRange(f, 0, "tensor 'w'").read_views(0, [np.zeros(300, np.uint8).data], block)
    f.close()


@pytest.mark.parametrize("prefetch,direct_io", [(0, False), (1 << 12, False), (64 << 20, False), (1 << 20, True)])
async def test_stream_bytes_equal_safetensors_for_every_dtype(tmp_path: Path, device: str, prefetch: int,
                                                              direct_io: bool) -> None:
    """(direct_io: O_DIRECT reads where the test's filesystem allows them, else the fallback: both must be exact.)"""
    p, _ = _odd_file(tmp_path)
    want = load_file(p)
    before, reads, on_loop = disk().bytes_read, disk().reads, disk().reads_on_loop
    got = {}
    async for name, t in azyx.io.stream_safetensors(p, device=device, prefetch=prefetch, direct_io=direct_io):
        assert t.device == device and t.shape == want[name].shape
        got[name] = await t.numpy()
    assert list(got) == list(want)  # file order
    for name, a in want.items():
        assert got[name].dtype == a.dtype and got[name].tobytes() == a.tobytes(), name
    assert disk().bytes_read - before == sum(a.nbytes for a in want.values())  # each byte read once
    assert disk().reads_on_loop == on_loop  # never on the loop's thread
    if prefetch >= 1 << 20:  # read ahead: the small tensors share extents (the large one is several)
        assert disk().reads - reads < len(want)


async def test_lazy_load_bytes_equal_safetensors(tmp_path: Path, device: str) -> None:
    p, _ = _odd_file(tmp_path)
    want = load_file(p)
    ts = azyx.io.load_safetensors(p)
    before, reads = disk().bytes_read, disk().reads
    moved = [t.to(device) for t in ts.values()]
    await azyx.realize(*moved)
    got = [await t.numpy() for t in moved]
    for (name, a), g in zip(want.items(), got):
        assert g.tobytes() == a.tobytes(), name
    assert disk().bytes_read - before == sum(a.nbytes for a in want.values())  # each byte once
    assert disk().reads - reads <= len(want) + 2  # (consecutive small ones share a read when a reader is busy)


def _change(p: Path, change: str) -> str:
    """Change the file at `p` behind a load's back, as `change` says; returns what the error must say. "replaced":
    another file of the same size and layout (other values) renamed over it, the case a descriptor would silently
    serve stale bytes for; "truncated": its last 100 bytes cut off."""
    if change == "replaced":
        new = p.with_suffix(".new")
        save_file({name: -a for name, a in load_file(p).items()}, new)
        assert new.stat().st_size == p.stat().st_size
        os.replace(new, p)
        return "replaced"
    os.truncate(p, p.stat().st_size - 100)
    return "truncated"


def _changing_file(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """Five float32 tensors, the third larger than an extent (read in several, staged or into host memory)."""
    rng = np.random.default_rng(5)
    sizes = [1000, 3001, HOST_EXTENT // 4 + 777, 5000, 64 << 10]
    arrays = {f"t{i}": rng.standard_normal(n).astype(np.float32) for i, n in enumerate(sizes)}
    p = tmp_path / "t.safetensors"
    save_file(arrays, p)
    return p, arrays


@pytest.mark.parametrize("change", ["replaced", "truncated"])
@pytest.mark.parametrize("staged", ["c:0", "vulkan:0", "cuda:0"])
async def test_a_file_changed_while_it_streams_raises_naming_it_and_hands_out_no_partial_tensor(
        tmp_path: Path, staged: str, change: str) -> None:
    """Changed between two tensors of the stream (its own order: with prefetch=0 each tensor is read when asked for):
    the tensors read before are whole and the file's old bytes; the next one raises, naming the file and the change;
    nothing more is handed out, and the stream's buffers go back. (c:0 reads into the tensors' memory, vulkan:0
    through staging blocks.)"""
    if staged not in azyx.devices():
        pytest.skip(f"{staged} is not available")
    p, arrays = _changing_file(tmp_path)
    base = await settle()
    stream = azyx.io.stream_safetensors(p, device=staged, prefetch=0)
    got = []
    with pytest.raises(azyx.AzyxIOError) as err:
        async for name, t in stream:
            got.append(name)
            np.testing.assert_array_equal(await t.numpy(), arrays[name])  # whole, and the bytes opened
            if len(got) == 2:
                said = _change(p, change)
    del t
    assert str(p) in str(err.value) and said in str(err.value)
    assert got == ["t0", "t1"]  # t2 (read in several extents) never handed out
    assert stream.closed
    assert await settle() == base  # its buffers went back


@pytest.mark.parametrize("change", ["replaced", "truncated"])
@pytest.mark.parametrize("staged", ["c:0", "vulkan:0", "cuda:0"])
async def test_a_file_changed_between_lazy_loads_raises_naming_it_and_realizes_nothing(
        tmp_path: Path, staged: str, change: str) -> None:
    """One lazy load, the file changed, a second load of the other tensors: it raises naming the file, none of
    them hands out bytes (each raises again when read), the first keeps its bytes, and a fresh load reads the new
    file."""
    if staged not in azyx.devices():
        pytest.skip(f"{staged} is not available")
    p, arrays = _changing_file(tmp_path)
    ts = azyx.io.load_safetensors(p)
    first = ts["t0"].to(staged)
    await first.realize()
    said = _change(p, change)
    rest = [t.to(staged) for name, t in ts.items() if name != "t0"]
    with pytest.raises(azyx.AzyxIOError) as err:
        await azyx.realize(*rest)
    assert str(p) in str(err.value) and said in str(err.value)
    for t in rest:  # no partial tensor: each raises when read
        with pytest.raises(azyx.AzyxIOError, match=said):
            await t.numpy()
    np.testing.assert_array_equal(await first.numpy(), arrays["t0"])
    if change == "replaced":
        fresh = azyx.io.load_safetensors(p)
        np.testing.assert_array_equal(await fresh["t4"].to(staged).numpy(), -arrays["t4"])


async def test_a_file_truncated_before_a_lazy_realize_raises_and_the_runtime_stays_usable(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    arrays = {f"t{i}": rng.standard_normal(1000 + i).astype(np.float32) for i in range(4)}
    p = tmp_path / "l.safetensors"
    save_file(arrays, p)
    ts = azyx.io.load_safetensors(p)
    os.truncate(p, os.path.getsize(p) - 100)
    with pytest.raises(azyx.AzyxIOError, match="truncated"):
        await azyx.realize(*[t.to("c:0") for t in ts.values()])
    with pytest.raises(azyx.AzyxIOError, match="truncated"):  # (t0's bytes are all there: the file changed still)
        await ts["t0"].to("c:0").numpy()
    assert (await (Tensor(np.ones(3, np.float32), device="c:0") + 1).numpy()).tolist() == [2.0] * 3


@pytest.mark.parametrize("into", ["c:1", "vulkan:0"])
async def test_a_tensor_that_does_not_fit_raises_when_asked_for_and_its_neighbours_load(tmp_path: Path,
                                                                                        into: str) -> None:
    """Read ahead, one extent covers all three tensors; the middle one's buffer cannot be allocated (on the reader
    thread; on a staged device, vulkan:0, as its copies are booked): the first is still handed out whole, the error
    is raised when the second is asked for."""
    if into not in azyx.devices():
        pytest.skip(f"{into} is not available")
    rng = np.random.default_rng(13)
    arrays = {"a": rng.standard_normal(1000).astype(np.float32), "b": rng.standard_normal(1 << 18).astype(np.float32),
              "c": rng.standard_normal(1000).astype(np.float32)}
    p = tmp_path / "m.safetensors"
    save_file(arrays, p)
    alloc = azyx.runtime.RT.device(into).allocator  # type: ignore[attr-defined]
    base = await settle()
    capacity = alloc.capacity
    alloc.capacity = alloc.in_use + (64 << 10)  # room for a and c, not for b
    try:
        stream = azyx.io.stream_safetensors(p, device=into)
        name, t = await stream.__anext__()
        assert name == "a"
        np.testing.assert_array_equal(await t.numpy(), arrays["a"])
        with pytest.raises(azyx.AllocationError):
            await stream.__anext__()
        del t
    finally:
        alloc.capacity = capacity
    assert stream.closed and await settle() == base


async def _lazy_load(p: Path, device: str) -> dict[str, np.ndarray]:
    """The lazy path: every tensor of the file `.to(device)`, realized at once, read back."""
    moved = {name: t.to(device) for name, t in azyx.io.load_safetensors(p).items()}
    await azyx.realize(*moved.values())
    return {name: await t.numpy() for name, t in moved.items()}


@pytest.mark.parametrize("path", ["stream", "lazy"])
async def test_the_loops_share_of_a_load_is_per_tensor_not_per_extent(tmp_path: Path, path: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors of three extents each onto c:0 (two on the lazy path: a plan's reads into host memory are HOST_EXTENT
    bytes): the loop's thread numbers a load's reads in one step and hands them to the booker (`Loads._book`),
    waking a reader thread at most once per load (a tensor's transfer on the lazy path, a read-ahead on the stream's),
    never once per extent; the reader threads start the reads. The bytes are the file's."""
    from azyx.loads import _reader_pool

    rng = np.random.default_rng(17)
    arrays = {f"w{i}": rng.standard_normal(3 * EXTENT // 4 - 5 - i).astype(np.float32) for i in range(6)}
    p = tmp_path / "share.safetensors"
    save_file(arrays, p)
    await azyx.realize(Tensor(np.zeros(1, np.float32), device="c:0"))  # (started)
    pool = _reader_pool()
    submit, loop = pool.submit, threading.get_ident()
    on_loop = [0]

    def counting(*args: Any, **kwargs: Any) -> Any:
        on_loop[0] += threading.get_ident() == loop
        return submit(*args, **kwargs)

    monkeypatch.setattr(pool, "submit", counting)
    reads = disk().reads
    if path == "stream":
        got = {}
        async for name, t in azyx.io.stream_safetensors(p, device="c:0", prefetch=0):  # (one tensor per load)
            got[name] = await t.numpy()
        del t
    else:
        got = await _lazy_load(p, "c:0")
    monkeypatch.undo()
    assert disk().reads - reads >= (3 if path == "stream" else 2) * len(arrays)  # (a tensor's extents: their reads)
    assert 0 < on_loop[0] <= len(arrays), f"{on_loop[0]} reader wake-ups from the loop for {len(arrays)} tensors"
    for name, a in arrays.items():
        np.testing.assert_array_equal(got[name], a)


async def test_a_small_tensors_read_joins_its_large_neighbours(tmp_path: Path) -> None:
    """A plan's transfers onto c:0 of two large tensors (HOST_EXTENT bytes: a read each), each followed in the file by
    a small one (a bias), are two reads: a read of SMALL bytes or less joins its neighbour's, whatever that one's size
    (`Loads._join`, the plan's reads started in file order), where each had been a read of its own; the two
    large ones stay two reads (two readers). The bytes are the file's."""
    rng = np.random.default_rng(23)
    arrays = {}
    for i in range(2):  # (in the file in name order: weight, bias, weight, bias)
        arrays[f"l{i}.a_weight"] = rng.standard_normal(HOST_EXTENT // 4).astype(np.float32)
        arrays[f"l{i}.b_bias"] = rng.standard_normal(1000 + i).astype(np.float32)
    p = tmp_path / "neighbours.safetensors"
    save_file(arrays, p)
    await azyx.realize(Tensor(np.zeros(1, np.float32), device="c:0"))  # (started)
    reads = disk().reads
    got = await _lazy_load(p, "c:0")
    assert disk().reads - reads == 2
    for name, a in arrays.items():
        np.testing.assert_array_equal(got[name], a)


@pytest.mark.parametrize("staged", ["vulkan:0", "cuda:0"])
@pytest.mark.parametrize("path", ["stream", "lazy"])
@pytest.mark.parametrize("direct_io", [False, True])
async def test_a_staged_load_reads_through_the_devices_bounded_ring(tmp_path: Path, direct_io: bool, path: str,
                                                                    staged: str) -> None:
    """On a device written through staging blocks (vulkan:0's mapped ones, CUDA's pinned ones) both paths (the stream
    and a plan's transfers) read through the device's ring (`memory.Ring`), each block read into again once its copy is
    done: with a ring of one block, tensors of three extents and more stream through it, a bfloat16 one too (widened
    in pieces), exactly; the ring never holds more than its blocks and gives them back once idle."""
    from safetensors.torch import save_file as torch_save

    if staged not in azyx.devices():
        pytest.skip(f"{staged} is not available")
    if path == "lazy" and direct_io:
        pytest.skip("a plan's transfers read through the page cache")
    rng = np.random.default_rng(14)
    tensors = {"a": torch.randn(1001), "big": torch.randn(3 * EXTENT // 4 + 13), "c": torch.randn(7).bfloat16(),
               "wide": torch.randn(EXTENT // 2 + 3).bfloat16(), "d": torch.from_numpy(rng.integers(0, 9, 5)),
               "e": torch.randn(2 * EXTENT // 4 + 1)}
    p = tmp_path / "ring.safetensors"
    torch_save(tensors, p)
    base = await settle()
    ring = azyx.runtime.RT.device(staged).mem.ring()
    assert not ring.blocks  # (idle)
    ring.size = 1
    try:
        got = {}
        if path == "stream":
            async for name, t in azyx.io.stream_safetensors(p, device=staged, direct_io=direct_io):
                assert len(ring.blocks) <= 1
                got[name] = await t.numpy()
            del t
        else:
            got = await _lazy_load(p, staged)
        for name, a in tensors.items():
            want = (a.float() if a.dtype == torch.bfloat16 else a).numpy()
            np.testing.assert_array_equal(got[name].astype(want.dtype), want)
        assert await settle() == base and not ring.blocks  # (given back once idle)
    finally:
        ring.size = RING


@pytest.mark.parametrize("staged", ["c:0", "vulkan:0", "cuda:0"])
async def test_cancelling_a_stream_frees_its_staging(tmp_path: Path, staged: str) -> None:
    if staged not in azyx.devices():
        pytest.skip(f"{staged} is not available")
    rng = np.random.default_rng(8)
    arrays = {f"t{i}": rng.standard_normal(n).astype(np.float32) for i, n in enumerate([1 << 20, 3000, 1 << 19] * 3)}
    p = tmp_path / "c.safetensors"
    save_file(arrays, p)
    base = await settle()
    for yields in (0, 1, 2, 5, 20):
        await _cancel_stream(p, yields, staged, 8 << 20)
        assert await settle() == base, yields
    async for name, t in azyx.io.stream_safetensors(p, device=staged):  # and the next load is whole
        np.testing.assert_array_equal(await t.numpy(), arrays[name])
    del t
    assert await settle() == base


async def test_stream_bfloat16_equals_torch_widened(tmp_path: Path, device: str) -> None:
    """bfloat16 tensors at odd sizes between others, one larger than an extent: on a device without bfloat16 each is
    widened to float32 (exactly: bfloat16 is a float32's upper half), else kept."""
    from safetensors.torch import save_file as torch_save

    torch.manual_seed(0)
    tensors = {"a": torch.randn(7).bfloat16(), "b": torch.randn(3, 5), "c": torch.randn(EXTENT // 2 + 5).bfloat16(),
               "d": torch.randn(1).bfloat16()}
    p = tmp_path / "bf.safetensors"
    torch_save(tensors, p)
    async for name, t in azyx.io.stream_safetensors(p, device=device):
        np.testing.assert_array_equal((await t.numpy()).astype(np.float32), tensors[name].float().numpy())


@pytest.mark.serial
@pytest.mark.parametrize("direct_io", [False, True])
async def test_a_streams_host_memory_stays_within_prefetch_and_the_largest_tensor(tmp_path: Path,
                                                                                 direct_io: bool) -> None:
    """The largest tensor first (a model's embedding), then smaller ones, each summed while the next are read: the
    host memory the process allocates while it streams onto c:0 (tracemalloc: the pool's blocks are numpy's) stays
    within prefetch + the largest tensor. The block of the first tensor, dropped, is a size no later tensor takes: the
    stream gives it back rather than growing the pool beside it (16 MiB over in bench/io.py's summing row before).
    O_DIRECT reads into host memory go through one DIRECT_PIECE block per reader thread (kept by the thread)."""
    from azyx.loads import DIRECT_PIECE, _reader_pool
    from azyx.memory import block_bytes

    rng = np.random.default_rng(16)
    arrays = {"a.embed": rng.standard_normal(4 << 20).astype(np.float32)}  # 16 MiB
    for i in range(10):
        arrays[f"b{i:02d}.w"] = rng.standard_normal(512 << 10).astype(np.float32)  # 2 MiB
        arrays[f"b{i:02d}.v"] = rng.standard_normal(1000 + i).astype(np.float32)
    p = tmp_path / "big_first.safetensors"
    save_file(arrays, p)
    prefetch, largest = (4 << 20) + (64 << 10), arrays["a.embed"].nbytes  # (two 2 MiB tensors and vectors ahead)
    for a in arrays.values():  # (the sums' plans made first: compiling is not loading)
        await Tensor(a, device="c:0").sum().realize()
    await settle()
    azyx.io.disk_device()  # (its reader threads started before the count)
    RT.device("c:0").allocator.take_cached()  # (an empty pool: every block the stream takes is new)
    sums = {}
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        async for name, t in azyx.io.stream_safetensors(p, device="c:0", prefetch=prefetch, direct_io=direct_io):
            sums[name] = await t.sum().item()
            del t
        await azyx.synchronize()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    bounces = _reader_pool()._max_workers * DIRECT_PIECE if direct_io else 0
    # (the largest tensor's block starts at a huge page: the room numpy allocates for that is address space, never
    # touched, but tracemalloc counts it; the 2 MiB blocks take none)
    largest = block_bytes(largest)
    assert peak <= prefetch + largest + bounces + (512 << 10), (peak / 2**20, (prefetch + largest + bounces) / 2**20)
    for name, a in arrays.items():
        np.testing.assert_allclose(sums[name], a.astype(np.float64).sum(), rtol=1e-4, atol=1e-3)


# ------------------------------------------------------------------------------------------------ sharded at load
def _sharded_file(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(9)
    arrays = {"col": rng.standard_normal((33, 70)).astype(np.float32), "row": rng.standard_normal((41, 6)),
              "cube": rng.integers(0, 1000, (4, 9, 5), dtype=np.int32), "keep": rng.standard_normal(17)}
    p = tmp_path / "sh.safetensors"
    save_file(arrays, p)
    return p, arrays


@pytest.mark.parametrize("axis", [0, 1, 2])
async def test_shard_of_a_disk_tensor_reads_each_byte_once(tmp_path: Path, axis: int) -> None:
    p, arrays = _sharded_file(tmp_path)
    ts = azyx.io.load_safetensors(p)
    for name in ("col", "row", "cube"):
        if axis >= arrays[name].ndim:
            continue
        before = disk().bytes_read
        s = ts[name].shard(["c:0", "c:1"], axis)
        await s.realize()
        for piece, want in zip(s.shards, np.array_split(arrays[name], 2, axis=axis)):
            assert piece.device in ("c:0", "c:1")
            np.testing.assert_array_equal(await piece.numpy(), want)
        assert disk().bytes_read - before == arrays[name].nbytes, (name, axis)


async def test_stream_shard_mapping_splits_matching_tensors_at_the_file(tmp_path: Path) -> None:
    p, arrays = _sharded_file(tmp_path)
    devs = ["c:0", "c:1"]
    before = disk().bytes_read
    got: dict[str, Any] = {}
    async for name, t in azyx.io.stream_safetensors(p, device="c:0", shard={"col": (devs, 1), "r*": (devs, 0),
                                                                             "cube": (devs, 2)}):
        got[name] = t
    assert disk().bytes_read - before == sum(a.nbytes for a in arrays.values())  # each byte once
    for name, axis in (("col", 1), ("row", 0), ("cube", 2)):
        assert [s.device for s in got[name].shards] == devs
        for piece, want in zip(got[name].shards, np.array_split(arrays[name], 2, axis=axis)):
            np.testing.assert_array_equal(await piece.numpy(), want)
    np.testing.assert_array_equal(await got["keep"].numpy(), arrays["keep"])
    with pytest.raises(azyx.AzyxIOError, match="devices, axis"):
        azyx.io.stream_safetensors(p, device="c:0", shard={"col": ("c:0", 1)})  # type: ignore[dict-item]


async def test_gpt2_loads_tensor_parallel_and_its_mlp_matches_the_one_device_reference(tmp_path: Path) -> None:
    """GPT-2's weights streamed onto c:0 + c:1 as tensor-parallel serving splits them: QKV and FC column-parallel
    (their Conv1D weights' output axis, 1, and biases), the projections row-parallel (axis 0). Each byte is read
    once, each piece equals the whole tensor split, and a block's MLP computed tensor-parallel from the pieces (FC
    per device, GELU, the projection's partial products summed) gives transformers' one-device output."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=128, n_positions=32)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    p = tmp_path / "model.safetensors"
    whole = load_file(p)
    devs = ["c:0", "c:1"]
    rules = {"*.attn.c_attn.weight": (devs, 1), "*.attn.c_attn.bias": (devs, 0), "*.mlp.c_fc.weight": (devs, 1),
             "*.mlp.c_fc.bias": (devs, 0), "*.attn.c_proj.weight": (devs, 0), "*.mlp.c_proj.weight": (devs, 0)}
    before = disk().bytes_read
    loaded: dict[str, Any] = {}
    async for name, t in azyx.io.stream_safetensors(p, device="c:0", shard=rules):
        loaded[name] = t
    assert disk().bytes_read - before == sum(a.nbytes for a in whole.values())
    for name, t in loaded.items():
        axis = next((ax for pat, (_, ax) in rules.items() if Path(name).match(pat)), None)
        if axis is None:
            np.testing.assert_array_equal(await t.numpy(), whole[name])
            continue
        for piece, want in zip(t.shards, np.array_split(whole[name], 2, axis=axis)):
            np.testing.assert_array_equal(await piece.numpy(), want)
    x = np.random.default_rng(10).standard_normal((5, 64)).astype(np.float32)
    pre = "transformer.h.1.mlp."
    parts = []
    for d, w_fc, b_fc, w_proj in zip(devs, loaded[pre + "c_fc.weight"].shards, loaded[pre + "c_fc.bias"].shards,
                                     loaded[pre + "c_proj.weight"].shards):
        h = (Tensor(x, device=d) @ w_fc + b_fc).gelu(approximate="tanh")
        parts.append((h @ w_proj).to("c:0"))
    y = await (parts[0] + parts[1] + loaded[pre + "c_proj.bias"]).numpy()
    with torch.no_grad():
        want = model.transformer.h[1].mlp(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------ the loop's heartbeat
@pytest.mark.serial
@pytest.mark.parametrize("path", ["stream", "lazy"])
async def test_both_load_paths_keep_the_loops_heartbeat(tmp_path: Path, device: str, path: str) -> None:
    """A 64 MiB load onto each device, by the stream and by one realize of every tensor `.to` it, beside a 1 ms
    heartbeat: the loop's thread only books reads and copies (`Loads.load`), so the lateness of the process's
    own stays within test_loop_latency's bound (BOUND_MS: CI's shared machine; bench/io.py reports the figure on a
    quiet one), and the bytes are the file's."""
    from test_loop_latency import BOUND_MS, _worst_lateness_ms

    rng = np.random.default_rng(15)
    arrays = {f"w{i}": rng.standard_normal((1024, 1024)).astype(np.float32) for i in range(16)}  # 4 MiB each
    arrays.update({f"b{i}": rng.standard_normal(1000 + i).astype(np.float32) for i in range(16)})
    p = tmp_path / "beat.safetensors"
    save_file(arrays, p)
    base = await settle()
    got: dict[str, Any] = {}

    async def load() -> None:
        if path == "stream":
            async for name, t in azyx.io.stream_safetensors(p, device=device):
                got[name] = t  # (read back after the heartbeat)
        else:
            moved = {name: t.to(device) for name, t in azyx.io.load_safetensors(p).items()}
            await azyx.realize(*moved.values())
            got.update(moved)

    worst, what = await _worst_lateness_ms(load)
    print(f"{device} {path}: the heartbeat was {worst:.1f} ms late of its own; {what}")  # -rP
    assert worst <= BOUND_MS, f"{device} {path}: the heartbeat was {worst:.1f} ms late of its own: {what}"
    for name, a in arrays.items():
        np.testing.assert_array_equal(await got[name].numpy(), a)
    got.clear()
    assert await settle() == base


FIRST_LOAD = """
import asyncio, json, sys, threading, time
starts = []  # (the thread that started it, its name): every thread the process starts
_start = threading.Thread.start

def start(self):
    starts.append((threading.get_ident(), self.name))
    return _start(self)

threading.Thread.start = start
import azyx

async def main(path, order):
    worst, stop = [0.0], asyncio.Event()

    async def beat():
        while not stop.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            worst[0] = max(worst[0], time.perf_counter() - t0 - 0.001)

    b = asyncio.ensure_future(beat())
    await asyncio.sleep(0.01)
    rows = {}
    for path_ in order.split(","):  # the first load: devices and the runtime's threads start here too
        if path_ == "stream":
            rows[path_] = 0
            async for _, t in azyx.io.stream_safetensors(path, device="c:0"):
                rows[path_] += t.shape[0]
        else:
            loaded = [t.to("c:0") for t in azyx.io.load_safetensors(path).values()]
            await azyx.realize(*loaded)
            rows[path_] = sum(t.shape[0] for t in loaded)
    stop.set()
    await b
    loop = threading.get_ident()
    print(json.dumps({"worst_ms": worst[0] * 1e3, "rows": rows, "on_loop": [n for t, n in starts if t == loop]}))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@pytest.mark.serial
@pytest.mark.parametrize("order", ["stream,lazy", "lazy,stream"])
def test_the_loop_keeps_its_heartbeat_during_a_first_load(tmp_path: Path, order: str) -> None:
    """The first load in a fresh process, by either path, beside a 1 ms heartbeat: the loop stays on time (a generous
    bound: a shared 2-core machine; bench/io.py reports the real figure), and no reader thread is started on the
    loop's thread (the runtime starts them all at its start-up, off the loop: a thread's start waits for it to run)."""
    rng = np.random.default_rng(12)
    arrays = {f"w{i}": rng.standard_normal((256, 1024)).astype(np.float32) for i in range(24)}  # 24 MiB
    p = tmp_path / "h.safetensors"
    save_file(arrays, p)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = subprocess.run([sys.executable, "-c", FIRST_LOAD, str(p), order], capture_output=True, text=True, env=env,
                         timeout=300, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{order}: worst heartbeat {result['worst_ms']:.1f} ms; threads started on the loop: {result['on_loop']}")
    assert result["rows"] == {"stream": 24 * 256, "lazy": 24 * 256}
    assert not [n for n in result["on_loop"] if n.startswith("azyx-disk")], result
    assert result["worst_ms"] < 250, result  # generous: a shared 2-core machine; the bench reports the real figure


def test_the_readers_start_with_the_runtime_below_the_loops_priority() -> None:
    """Every reader thread runs once the runtime has started (none is started by a load), below the priority of the
    thread that started the runtime where the native core reads (the GIL released through a read: a reader holds it
    only to begin and end one), else at its priority (Python reads hold the GIL between system calls)."""
    from azyx.loads import _reader_pool
    from azyx.native import native

    RT.start(["c"])
    readers = [t for t in threading.enumerate() if t.name.startswith("azyx-disk")]
    assert len(readers) == _reader_pool()._max_workers
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    want = min(mine + workers.WORKER_NICE, 19) if native is not None else mine  # (AZYX_WORKER_NICE: 10 unless set)
    for t in readers:
        assert t.native_id is not None
        assert os.getpriority(os.PRIO_PROCESS, t.native_id) == want, (t.name, want, mine)


@pytest.mark.parametrize("path", ["stream", "lazy"])
async def test_a_loads_large_destinations_are_made_off_the_loops_thread(tmp_path: Path, device: str, path: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block of 1 MiB and up that a load makes on the device is made on a thread other than the loop's: by the
    reader threads (a stream onto host memory, `alloc_anywhere`) or a worker reserving it (`reserve_min`: a staged
    stream's `load` and a plan's run take it from the pool's cache). A host device's plan (the lazy path on c) makes
    its outputs on the loop: numpy's empty arrays, whose pages the reader threads fault in."""
    from azyx.runtime import RT

    await azyx.realize(Tensor(np.zeros(1, np.float32), device=device))  # (started)
    dev = RT.device(device)
    if path == "lazy" and not dev.reserve_min:
        pytest.skip(f"{device}: reserve_min 0: a plan makes its outputs on the loop (host memory: np.empty, cheap)")
    rng = np.random.default_rng(16)
    # sizes no other test (nor the other path) makes, 1 MiB + 64 KiB steps + 4 KiB: not in the pool's cache, so made
    first = 3 if path == "stream" else 20
    arrays = {f"w{i:02d}": rng.standard_normal(((1 << 18) + (first + i) * (1 << 14) + 1024,)).astype(np.float32)
              for i in range(14)}
    p = tmp_path / "made.safetensors"
    save_file(arrays, p)
    made: list[tuple[int, int]] = []
    create = dev.allocator.create

    def recording(size: int) -> Any:
        made.append((threading.get_ident(), size))
        return create(size)

    monkeypatch.setattr(dev.allocator, "create", recording)
    got: dict[str, Tensor] = {}
    if path == "stream":
        async for name, t in azyx.io.stream_safetensors(p, device=device):
            got[name] = t
    else:
        got = {name: t.to(device) for name, t in azyx.io.load_safetensors(p).items()}
        await azyx.realize(*got.values())
    loop = threading.get_ident()
    big = [(tid, n) for tid, n in made if n >= 1 << 20]
    assert big, f"{device} {path}: the load made no large block"
    assert all(tid != loop for tid, _ in big), f"{device} {path}: large blocks made on the loop's thread: {big}"
    for name, a in arrays.items():
        np.testing.assert_array_equal(await got[name].numpy(), a)


@pytest.mark.parametrize("staged", ["c:0", "vulkan:0", "opencl:0", "wgpu:0", "cuda:0"])
async def test_a_long_load_is_submitted_off_the_loops_thread_and_its_bytes_are_the_files(
        tmp_path: Path, staged: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lazy load whose run is long (LONG_RUN transfers out of the file and staged copies or more:
    `UnifiedExecutor.runs_long`) runs on a worker thread, the loop's thread only walking it and making its targets
    leaves, onto host memory (c:0) and through staging: the bytes equal the file's, also for two realizes of it at
    once. Cancelled while its run is in flight, it leaves its tensors unrealized and every buffer back once the run's
    work is done, and loads whole again. A short load still runs on the loop."""
    import asyncio

    from azyx.executor import LONG_RUN
    from azyx.graph import GRAPH

    if staged not in azyx.devices():
        pytest.skip(f"{staged} is not available")
    rng = np.random.default_rng(40)
    arrays = {f"w{i:02d}": rng.standard_normal(EXTENT // 4 + 1 + 2 * i).astype(np.float32) for i in range(2)}
    arrays.update({f"v{i:02d}": rng.standard_normal(4099 + 8 * i).astype(np.float32) for i in range(LONG_RUN)})
    arrays["odd"] = rng.integers(-9, 9, (3, 5, 7), dtype=np.int16)
    p = tmp_path / "long.safetensors"
    save_file(arrays, p)
    small = tmp_path / "short.safetensors"
    save_file({"s": arrays["odd"]}, small)
    await azyx.realize(Tensor(np.zeros(1, np.float32), device=staged))  # (started)
    ran: list[int] = []
    started, go = threading.Event(), threading.Event()
    go.set()
    run = RT.executor.run

    def recording(*args: Any, **kwargs: Any) -> Any:
        ran.append(threading.get_ident())
        started.set()
        go.wait(30)
        return run(*args, **kwargs)

    monkeypatch.setattr(RT.executor, "run", recording)
    loop = threading.get_ident()
    for together in (1, 2):
        ran.clear()
        moved = {name: t.to(staged) for name, t in azyx.io.load_safetensors(p).items()}
        await asyncio.gather(*(azyx.realize(*moved.values()) for _ in range(together)))
        assert ran and loop not in ran, f"{staged}: the long load ran on the loop's thread"
        for name, a in arrays.items():
            np.testing.assert_array_equal(await moved[name].numpy(), a)
        del moved
    ran.clear()
    short = azyx.io.load_safetensors(small)["s"].to(staged)
    await azyx.realize(short)
    assert ran == [loop], f"{staged}: a short load left the loop's thread"
    np.testing.assert_array_equal(await short.numpy(), arrays["odd"])

    moved = {name: t.to(staged) for name, t in azyx.io.load_safetensors(p).items()}
    base = await settle()
    started.clear()
    go.clear()
    task = asyncio.ensure_future(azyx.realize(*moved.values()))
    await asyncio.get_running_loop().run_in_executor(None, started.wait, 30)  # (its run waits for `go`)
    task.cancel()
    go.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert all(GRAPH[t.id].buffer is None for t in moved.values())  # type: ignore[union-attr]
    assert await settle() == base
    await azyx.realize(*moved.values())
    for name, a in arrays.items():
        np.testing.assert_array_equal(await moved[name].numpy(), a)


async def test_large_host_blocks_start_at_a_huge_page(tmp_path: Path) -> None:
    """A lazy load onto c:0 reads a tensor of HUGE_MIN bytes or more into a block that starts at a huge page (its
    first touch then faults huge pages only), a small one into a 64-byte aligned block; the bytes are the file's."""
    from azyx.memory import ALIGN, HUGE, HUGE_MIN

    rng = np.random.default_rng(40)
    arrays = {"big": rng.standard_normal(HUGE_MIN // 4 + 3).astype(np.float32),
              "small": rng.standard_normal(1001).astype(np.float16)}
    p = tmp_path / "huge.safetensors"
    save_file(arrays, p)
    loaded = azyx.io.load_safetensors(p)
    big, small = await azyx.realize(loaded["big"].to("c:0"), loaded["small"].to("c:0"))
    assert buffer_of(big._node).ptr % HUGE == 0 and buffer_of(small._node).ptr % ALIGN == 0
    np.testing.assert_array_equal(await big.numpy(), arrays["big"])
    np.testing.assert_array_equal(await small.numpy(), arrays["small"])
