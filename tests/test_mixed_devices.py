"""One plan across one device of every kind present (c, opencl, vulkan, cuda): transfers between every ordered pair
of kinds, 200 concurrent tasks spread over them all, and cancellation mid-transfer through each non-C kind."""

from __future__ import annotations

import numpy as np
import pytest
from runtime_state import settle
from scenarios import cancel_transfers, spread_tasks

import azyx
from azyx import Tensor
from azyx.plan import TransferStep

KINDS = [d for d in azyx.devices() if d.endswith(":0")]  # one device of each kind
pytestmark = pytest.mark.skipif(len(KINDS) < 2, reason=f"one device kind only ({KINDS})")
rng = np.random.default_rng(11)


def test_one_plan_hops_between_every_ordered_pair_of_device_kinds() -> None:
    route = [KINDS[0]]
    for a in KINDS:
        for b in KINDS:
            if a != b:
                route += [d for d in (a, b) if d != route[-1]]
    xn = rng.standard_normal((64, 33)).astype(np.float32)
    t, want = Tensor(xn, device=route[0]) + 0.5, xn + 0.5  # (computed there: host data would skip the first hop)
    for i, d in enumerate(route[1:]):
        t = (t.to(d) * 1.5 - 0.25).relu() + i  # work on every device of the route
        want = np.maximum(want * 1.5 - 0.25, 0) + i
    out = t.sum(axis=1) + t.max()
    plan = azyx.schedule(out)
    hops = {(s.src_device, s.dst_device) for s in plan.steps if isinstance(s, TransferStep)}
    assert hops >= {(a, b) for a in KINDS for b in KINDS if a != b}, sorted(hops)
    assert set(plan.devices) >= set(KINDS)
    np.testing.assert_allclose(out.numpy_sync(), want.sum(axis=1) + want.max(), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int8", "bool", "float16", "int64"])
def test_round_trips_through_every_kind_keep_the_dtype(dtype: str) -> None:
    xn = (rng.standard_normal(1001) * 10).astype(dtype)
    t = Tensor(xn, device=KINDS[0])
    for d in [*KINDS[1:], *KINDS[::-1]]:
        t = t.to(d)
    np.testing.assert_array_equal(t.numpy_sync(), xn)


async def test_200_concurrent_tasks_spread_over_every_kind() -> None:
    base = await settle()
    await spread_tasks([*KINDS, "c:1"], rng)
    assert await settle() == base


@pytest.mark.parametrize("via", [d for d in KINDS if not d.startswith("c:")])
@pytest.mark.parametrize("yields", [0, 2, 10])
async def test_cancelling_mid_transfer_through_each_kind_leaks_nothing(via: str, yields: int) -> None:
    base = await settle()
    await cancel_transfers(yields, via, 1 << 20)
    assert await settle() == base
