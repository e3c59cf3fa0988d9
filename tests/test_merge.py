"""Multi-output kernels (merge.py): elementwise kernels over the same loops, realized together, run as one kernel that
writes several buffers; every output is checked against numpy, on every device kind."""

from __future__ import annotations

import numpy as np

import azyx
from azyx import Tensor
from azyx.merge import MAX_PARAMS
from azyx.plan import KernelStep
from tests.compare import sample

rng = np.random.default_rng(11)


def _kernels(*ts: Tensor) -> list[KernelStep]:
    return azyx.schedule(*ts).kernels


async def _values(*ts: Tensor) -> list[np.ndarray]:
    await azyx.realize(*ts)
    return [await t.numpy() for t in ts]


async def test_adam_like_update_is_one_kernel_writing_every_output(device: str) -> None:
    pn, gn, mn, vn = (sample(rng, (37, 53), d) for d in ("any", "any", "any", "pos"))
    p, g, m, v = (Tensor(x, device=device) for x in (pn, gn, mn, vn))
    m2 = m * 0.9 + g * 0.1
    v2 = v * 0.99 + g.square() * 0.01
    p2 = p - m2 * 0.001 / (v2.sqrt() + 1e-8)  # reads both other outputs where they are written
    ks = _kernels(m2, v2, p2)
    assert len(ks) == 1 and ks[0].outs == 3
    m_ref = mn * np.float32(0.9) + gn * np.float32(0.1)
    v_ref = vn * np.float32(0.99) + np.square(gn) * np.float32(0.01)
    refs = [m_ref, v_ref, pn - m_ref * np.float32(0.001) / (np.sqrt(v_ref) + np.float32(1e-8))]
    for out, ref in zip(await _values(m2, v2, p2), refs):
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


async def test_outputs_of_different_dtypes_and_guarded_reads(device: str) -> None:
    xn = sample(rng, (9, 14))
    x = Tensor(xn, device=device)
    padded = x.pad(((1, 2), (3, 0)), value=-1.0)  # (12, 17): loads under index conditions
    a = padded * 2
    b = (padded > 0).cast("int32") + 7
    c = padded.exp() > 1.5
    ks = _kernels(a, b, c)
    assert len(ks) == 1 and ks[0].outs == 3
    pn = np.pad(xn, ((1, 2), (3, 0)), constant_values=-1.0)
    got = await _values(a, b, c)
    np.testing.assert_allclose(got[0], pn * 2, rtol=1e-6)
    np.testing.assert_array_equal(got[1], (pn > 0).astype(np.int32) + 7)
    np.testing.assert_array_equal(got[2], np.exp(pn) > 1.5)
    assert [o.dtype for o in got] == [np.float32, np.int32, np.bool_]


async def test_an_output_read_at_another_index_stays_a_kernel_of_its_own(device: str) -> None:
    xn = sample(rng, (64,))
    x = Tensor(xn, device=device)
    y = x * 3 + 1
    z = y.flip(0) - x  # element i reads y at 63 - i: another iteration's result
    assert len(_kernels(y, z)) == 2
    got = await _values(y, z)
    np.testing.assert_allclose(got[0], xn * 3 + 1, rtol=1e-6, atol=1e-6)  # (C may fuse x * 3 + 1 into one fma)
    np.testing.assert_allclose(got[1], (xn * 3 + 1)[::-1] - xn, rtol=1e-6, atol=1e-6)


async def test_a_reader_in_between_keeps_the_order(device: str) -> None:
    xn = sample(rng, (32, 8))
    x = Tensor(xn, device=device)
    a = x * 2
    s = a.sum()  # a reduce that reads a (a different loop nest, not merged)
    b = x * s  # over the same loops as a, but needs s, which needs a first
    assert len(_kernels(a, s, b)) == 3
    got = await _values(a, s, b)
    np.testing.assert_allclose(got[0], xn * 2, rtol=1e-6)
    np.testing.assert_allclose(got[1], (xn * 2).sum(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[2], xn * (xn * 2).sum(), rtol=1e-5, atol=1e-5)


async def test_float16_outputs_read_back_rounded(device: str) -> None:
    xn = sample(rng, (40,), "pos").astype(np.float16)
    x = Tensor(xn, device=device)
    a = x * 1.001  # computed in float32, rounded to float16 when stored
    b = a * 1000 - x * 1000  # must see a as stored (rounded), not the wider value it was computed in
    got = await _values(a, b)
    x32 = xn.astype(np.float32)
    a_ref = (x32 * np.float32(1.001)).astype(np.float16)
    np.testing.assert_array_equal(got[0], a_ref)
    # every float16 op rounds to float16 (as numpy's float16 arithmetic does)
    b_ref = (a_ref * np.float16(1000)) - (xn * np.float16(1000))
    np.testing.assert_array_equal(got[1], b_ref)


async def test_many_outputs_split_into_kernels_within_the_parameter_limit(device: str) -> None:
    xn = sample(rng, (5, 6))
    x = Tensor(xn, device=device)
    outs = [x * float(i) + i for i in range(2 * MAX_PARAMS)]
    ks = _kernels(*outs)
    assert 1 < len(ks) < len(outs) and all(len(k.args) <= MAX_PARAMS for k in ks)
    for i, got in enumerate(await _values(*outs)):
        np.testing.assert_allclose(got, xn * np.float32(i) + i, rtol=1e-5, atol=1e-5)


async def test_a_transfer_of_an_output_in_between() -> None:
    xn = sample(rng, (16, 4))
    x = Tensor(xn, device="c:0")
    a = x * 5
    moved = a.to("c:1") + 1  # the copy to c:1 reads a before the next c:0 kernel runs
    b = x - 2
    assert len(_kernels(a, moved, b)) == 3
    got = await _values(a, moved, b)
    np.testing.assert_allclose(got[0], xn * 5, rtol=1e-6)
    np.testing.assert_allclose(got[1], xn * 5 + 1, rtol=1e-6)
    np.testing.assert_allclose(got[2], xn - 2, rtol=1e-6)
