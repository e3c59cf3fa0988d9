"""In-place updates of a slice (issue 18) on every device against numpy: `t[key] = value` writes only the view, into
the tensor's own buffer when nothing else holds the old value (one kernel, no copy of the rest), else into a copy
that the holders do not see; a Python int position is a runtime value (a KV cache written step after step runs one
plan); readers of the old value in the same plan read it before the write; gradients flow to both sides."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from compare import assert_matches

import azyx
from azyx import GradientTape, Tensor
from azyx.errors import DeviceError, IndexOutOfRange, ShapeError
from azyx.runtime import RT

try:
    import torch
except ImportError:
    torch = None  # type: ignore[assignment]


def base(shape: tuple[int, ...] = (4, 5, 3)) -> np.ndarray:
    return (np.arange(int(np.prod(shape))) + 1).reshape(shape).astype(np.float32)


# key, value (numpy; or a scalar)
CASES: list[tuple[str, Any, Any]] = [
    ("int", 2, np.full((5, 3), -1.0)),
    ("negative_int", -1, np.arange(15.0).reshape(5, 3)),
    ("int_pair", (0, 4), np.array([7.0, 8.0, 9.0])),
    ("slice", slice(1, 3), np.ones((2, 5, 3))),
    ("step", (slice(None), slice(0, 5, 2)), np.arange(36.0).reshape(4, 3, 3)),
    ("negative_step", (slice(None, None, -2), 1), np.arange(6.0).reshape(2, 3)),
    ("ellipsis", (Ellipsis, 0), np.arange(20.0).reshape(4, 5)),
    ("none", (1, None, slice(2, 4)), np.arange(6.0).reshape(1, 2, 3)),
    ("broadcast_row", (slice(None), 3), np.array([1.0, 2.0, 3.0])),
    ("scalar", (slice(1, None), slice(None), 2), 0.5),
    ("int_value_cast", 0, 3),
    ("everything", Ellipsis, 2.0),
    ("empty_slice", slice(2, 2), 1.0),
    ("index_list", [3, 0], np.arange(30.0).reshape(2, 5, 3)),
    ("index_second_axis", (slice(None), np.array([4, -5])), -2.0),
]


@pytest.mark.parametrize("name,key,value", CASES, ids=[c[0] for c in CASES])
def test_setitem_matches_numpy(device: str, name: str, key: Any, value: Any) -> None:
    x = base()
    t = Tensor(x, device=device)
    t[key] = Tensor(np.asarray(value, np.float32), device=device) if isinstance(value, np.ndarray) else value
    want = x.copy()
    want[key] = value
    assert_matches(t, want, dtype="float32")


def test_setitem_with_tensor_positions(device: str) -> None:
    x = base()
    t = Tensor(x, device=device)
    t[Tensor(np.array(2, np.int32), device=device), 1] = 0.0  # a 0-d tensor position: known only when it runs
    t[Tensor(np.array([0, 0, 3], np.int64), device=device)] = Tensor(np.full((3, 5, 3), 9.0, np.float32),
                                                                     device=device)
    want = x.copy()
    want[2, 1] = 0
    want[[0, 3]] = 9
    assert_matches(t, want, dtype="float32")
    t = Tensor(x, device=device)
    t[Tensor(np.array(-7, np.int32), device=device)] = 1.0  # out of range at run time: raises when realized
    with pytest.raises(IndexOutOfRange, match="index -7 is out of range"):
        t.numpy_sync()


def test_setitem_with_several_tensor_indices(device: str) -> None:
    """Integer-tensor indices broadcast together as numpy's: a KV cache's rows, each at its own slot and position
    (adjacent indices keep their place in the region, separated ones go in front); a key-value gradient too."""
    x = np.random.default_rng(3).standard_normal((5, 3, 8, 4)).astype(np.float32)
    slots, rows = np.array([0, 4, 2], np.int32), np.array([1, 7, 3], np.int32)
    for key in ((slots, slice(None), rows), (slots, rows % 3), (slice(1, 3), rows % 3, slots % 4)):
        want = x.copy()
        value = np.arange(want[key].size, dtype=np.float32).reshape(want[key].shape)
        want[key] = value
        t = Tensor(x, device=device)
        t[tuple(Tensor(k, device=device) if isinstance(k, np.ndarray) else k for k in key)] = \
            Tensor(value, device=device)
        assert_matches(t, want, dtype="float32")
    w = np.random.default_rng(4).standard_normal(x.shape).astype(np.float32)
    tx, tv = Tensor(x, device=device), Tensor(np.ones((3, 3, 4), np.float32), device=device)
    with GradientTape() as tape:
        y = tx * 1
        y[Tensor(slots, device=device), :, Tensor(rows, device=device)] = tv * 2
        loss = (y * Tensor(w, device=device)).sum()
    gx, gv = (g.numpy_sync() for g in tape.gradient(loss, [tx, tv]))
    want_x = w.copy()
    want_x[slots, :, rows] = 0
    np.testing.assert_allclose(gx, want_x, rtol=1e-6)
    np.testing.assert_allclose(gv, 2 * w[slots, :, rows], rtol=1e-6)
    t = Tensor(x, device=device)
    with pytest.raises(IndexOutOfRange, match="do not broadcast"):
        t[Tensor(slots, device=device), :, Tensor(rows[:2], device=device)] = 1.0


def test_bad_assignments_raise_at_the_call(device: str) -> None:
    t = Tensor(base(), device=device)
    with pytest.raises(IndexOutOfRange, match="index 4 is out of range"):
        t[4] = 1.0
    with pytest.raises(IndexOutOfRange, match="too many indices"):
        t[0, 0, 0, 0] = 1.0
    with pytest.raises(ShapeError, match="cannot assign a tensor of shape"):
        t[0] = Tensor(np.ones((4, 3), np.float32), device=device)
    with pytest.raises(IndexOutOfRange, match="index 9 is out of range"):
        t[[0, 9]] = 1.0
    with pytest.raises(IndexOutOfRange, match="slices only"):
        t[[0], 1] = 1.0
    other = next((d for d in azyx.devices() if d != device), None)
    if other is not None:
        with pytest.raises(DeviceError):
            t[0] = Tensor(np.ones((5, 3), np.float32), device=other)
    assert_matches(t, base(), dtype="float32")  # unchanged, still usable


def test_writes_in_place_without_copying_the_rest(device: str) -> None:
    cache = Tensor.zeros(64, 32, device=device)
    cache.realize_sync()
    buf = cache._node.buffer
    cache[5] = Tensor(np.ones(32, np.float32), device=device)
    plan = azyx.schedule(cache)
    assert len(plan.kernels) == 1 and plan.kernels[0].work == 32, plan.describe()  # the row alone
    (slot, _), = plan.outputs
    assert slot < plan.n_inputs  # written where the old value was bound: no new buffer
    cache.realize_sync()
    assert cache._node.buffer is buf
    want = np.zeros((64, 32), np.float32)
    want[5] = 1
    np.testing.assert_array_equal(cache.numpy_sync(), want)


def test_holders_of_the_old_value_keep_it(device: str) -> None:
    x = base()
    t = Tensor(x, device=device)
    t.realize_sync()
    old = Tensor(t)  # another handle to the old value
    doubled = t * 2  # a lazy reader of it
    t[1:3] = 0.0
    want = x.copy()
    want[1:3] = 0
    assert_matches(t, want, dtype="float32")
    assert_matches(old, x, dtype="float32")
    assert_matches(doubled, x * 2, dtype="float32")


async def test_one_plan_reads_the_old_value_and_writes_the_new(device: str) -> None:
    x = base()
    t = Tensor(x, device=device)
    await t.realize()
    total, row = t.sum(), t[0] * 3
    t[0] = t[1] * 2  # the value reads the base too
    t2 = t * 1  # and a consumer of the new value, fused after the write
    await azyx.realize(t, total, row, t2)
    want = x.copy()
    want[0] = x[1] * 2
    np.testing.assert_array_equal(await t.numpy(), want)
    np.testing.assert_array_equal(await t2.numpy(), want)
    np.testing.assert_allclose(await total.numpy(), x.sum(), rtol=1e-6)
    np.testing.assert_array_equal(await row.numpy(), x[0] * 3)


@pytest.mark.parametrize("position", ["int", "tensor"])
async def test_kv_cache_loop_runs_one_plan(device: str, position: str) -> None:
    """A KV cache written at step after step: the step is a runtime value, so after the first steps nothing is
    planned or compiled again, and each step writes its row into the cache's buffer."""
    steps, heads, dim = 12, 2, 8
    cache = Tensor.zeros(heads, steps, dim, device=device)
    await cache.realize()
    buf = cache._node.buffer
    want = np.zeros((heads, steps, dim), np.float32)
    rng = np.random.default_rng(1)
    for step in range(steps):
        kv = rng.standard_normal((heads, dim)).astype(np.float32)
        pos: Any = step if position == "int" else Tensor(np.array(step, np.int32), device=device)
        cache[:, pos] = Tensor(kv, device=device) * 0.5
        want[:, step] = kv * 0.5
        attn = (cache * Tensor(kv[:, None, :], device=device)).sum(axis=-1)  # a reader of the updated cache
        await azyx.realize(cache, attn)
        np.testing.assert_allclose(await attn.numpy(), (want * kv[:, None, :]).sum(-1), rtol=1e-5, atol=1e-5)
        if step == 1:
            counters = (len(RT.plan_cache), RT.compiled)
    assert (len(RT.plan_cache), RT.compiled) == counters, "a new step planned or compiled again"
    np.testing.assert_array_equal(await cache.numpy(), want)
    assert cache._node.buffer is buf  # every step wrote its row into the cache's own buffer


@pytest.mark.parametrize("jitted", [False, True])
async def test_several_assignments_in_one_plan_write_in_place(device: str, jitted: bool) -> None:
    """A batch of sequences each writing its row of a KV cache: assignment after assignment to one tensor in one
    plan all write into its buffer (none copies it), step after step, with runtime rows and positions; a reader of
    a value half-way along the chain makes the next assignment copy (the reader keeps what it read)."""
    cache = Tensor.zeros(3, 6, 2, device=device)
    await cache.realize()
    ptr = cache._node.buffer.ptr

    def step(slots: Tensor, positions: Tensor, kv: Tensor) -> Tensor:
        for i in range(2):
            cache[slots[i], positions[i]] = kv[i]
        return cache[slots].sum(axis=(1, 2))

    run = azyx.jit(step) if jitted else None
    want = np.zeros((3, 6, 2), np.float32)
    for pos in range(6):
        slots, positions = np.array([2, 0], np.int32), np.array([pos, 5 - pos], np.int32)
        kv = np.full((2, 2), pos + 1.0, np.float32) * np.array([[1], [-1]], np.float32)
        args = [Tensor(a, device=device) for a in (slots, positions, kv)]
        if run is not None:
            got = await (await run(*args)).numpy()
        else:
            out = step(*args)
            await azyx.realize(cache, out)
            got = await out.numpy()
        want[slots, positions] = kv
        np.testing.assert_allclose(got, want[slots].sum(axis=(1, 2)), rtol=1e-6)
        assert cache._node.buffer.ptr == ptr, f"step {pos} copied the cache"
    np.testing.assert_array_equal(await cache.numpy(), want)
    cache[0, 0] = 7.0
    middle = cache * 1  # reads the value between the two assignments
    cache[1, 1] = 8.0
    await azyx.realize(cache, middle)
    want[0, 0] = 7.0
    before = want.copy()
    want[1, 1] = 8.0
    np.testing.assert_array_equal(await middle.numpy(), before)
    np.testing.assert_array_equal(await cache.numpy(), want)


async def test_kv_cache_under_jit(device: str) -> None:
    cache = Tensor.zeros(6, 4, device=device)
    await cache.realize()
    buf = cache._node.buffer

    @azyx.jit
    def step(x: Tensor, pos: int) -> Tensor:
        cache[pos] = x * 2
        return cache.sum(axis=1)

    want = np.zeros((6, 4), np.float32)
    for p in range(6):
        x = np.full(4, p + 1.0, np.float32)
        got = await (await step(Tensor(x, device=device), p)).numpy()
        want[p] = x * 2
        np.testing.assert_allclose(got, want.sum(axis=1), rtol=1e-6)
        if p == 1:
            counters = (len(RT.plan_cache), RT.compiled)
    assert (len(RT.plan_cache), RT.compiled) == counters
    np.testing.assert_array_equal(await cache.numpy(), want)
    assert cache._node.buffer is buf  # every step wrote its row into the cache's own buffer


async def test_jit_never_overwrites_a_value_someone_holds(device: str) -> None:
    """A replay whose plan writes into the cache in place traces again (a plan that copies) when the old cache is
    held elsewhere: the holder keeps its value."""
    cache = Tensor.zeros(4, 3, device=device)
    await cache.realize()

    @azyx.jit
    def step(x: Tensor, pos: int) -> None:
        cache[pos] = x

    want = np.zeros((4, 3), np.float32)
    for p in range(4):
        held = Tensor(cache) if p == 2 else None  # another handle to the old value, at one step
        before = want.copy()
        await step(Tensor(np.full(3, p + 1.0, np.float32), device=device), p)
        want[p] = p + 1
        np.testing.assert_array_equal(await cache.numpy(), want)
        if held is not None:
            np.testing.assert_array_equal(await held.numpy(), before)


def test_optimiser_state_slice(device: str) -> None:
    """Momentum kept for the first columns only, updated in place each step."""
    m = Tensor.zeros(3, 6, device=device)
    want = np.zeros((3, 6), np.float32)
    for k in range(3):
        g = np.full((3, 2), k + 1.0, np.float32)
        m[:, :2] = m[:, :2] * 0.9 + Tensor(g, device=device)
        want[:, :2] = want[:, :2] * 0.9 + g
        m.realize_sync()
    np.testing.assert_allclose(m.numpy_sync(), want, rtol=1e-6)


def test_gradients_of_an_assignment(device: str) -> None:
    x = np.random.default_rng(3).standard_normal((4, 3)).astype(np.float32)
    v = np.random.default_rng(4).standard_normal((2, 3)).astype(np.float32)
    w = np.arange(12.0, dtype=np.float32).reshape(4, 3)
    tx, tv = Tensor(x, device=device), Tensor(v, device=device)
    with GradientTape() as tape:
        y = tx * 1
        y[1:3] = tv * 2
        y[0, 2] = 0.0
        loss = (y * y * Tensor(w, device=device)).sum()
    gx, gv = (g.numpy_sync() for g in tape.gradient(loss, [tx, tv]))
    y_np = x.copy()
    y_np[1:3] = v * 2
    y_np[0, 2] = 0
    want_x = 2 * y_np * w
    want_x[1:3] = 0
    want_x[0, 2] = 0
    want_v = 2 * y_np[1:3] * w[1:3] * 2
    if torch is not None:
        X, V = torch.tensor(x, requires_grad=True), torch.tensor(v, requires_grad=True)
        Y = X * 1
        Y[1:3] = V * 2
        Y[0, 2] = 0.0
        (Y * Y * torch.tensor(w)).sum().backward()
        want_x, want_v = X.grad.numpy(), V.grad.numpy()
    np.testing.assert_allclose(gx, want_x, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gv, want_v, rtol=1e-5, atol=1e-6)


async def test_an_in_place_write_waits_for_other_devices_reading_the_buffer() -> None:
    """A copy of the tensor to another device, still queued there, reads the buffer that a later assignment writes
    in place: the write waits for it (the copy gets the old value)."""
    others = [d for d in azyx.devices() if d.endswith(":0") and not d.startswith(("c:", "dummy"))]
    if not others:
        pytest.skip("no second device kind")
    x = np.arange(1 << 22, dtype=np.float32).reshape(1024, -1)  # 16 MiB: the copy takes a while
    for other in others:
        t = Tensor(x, device="c:0")
        await t.realize()
        copied = t.to(other)

        async def write() -> None:
            t[:] = -1.0
            await t.realize()

        await asyncio.gather(copied.realize(), write())
        np.testing.assert_array_equal(await copied.numpy(), x)
        np.testing.assert_array_equal(await t.numpy(), np.full_like(x, -1.0))


async def test_assignments_of_values_computed_on_another_device() -> None:
    """Halves computed on c:1 assigned into a c:0 tensor (odd sizes): the kernels after the second transfer run as one
    batch, whose assignment writes into the buffer made before it (not a temporary of the batch's own memory)."""
    x = np.arange(35, dtype=np.float32)
    a = await Tensor(x, device="c:1").realize()
    z = Tensor.zeros(35, device="c:0")
    z[0:17] = (a[0:17] + 1.0).to("c:0")
    z[17:35] = (a[17:35] + 1.0).to("c:0")
    np.testing.assert_array_equal(await z.reshape(5, 7).numpy(), (x + 1).reshape(5, 7))
