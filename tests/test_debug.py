"""azyx.debug.LoopStalls: the heartbeat and sampler that name what held an event loop."""

from __future__ import annotations

import asyncio
import sys
import time

from azyx.debug import LoopStalls


def hold_the_loop(seconds: float) -> None:
    """Python work on the loop's thread (what a stall looks like)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def test_loop_stalls_name_the_code_that_held_the_loop() -> None:
    async with LoopStalls() as stalls:
        await asyncio.sleep(0.01)
        hold_the_loop(0.2)
        await asyncio.sleep(0.01)
    assert stalls.worst_ms >= 190, stalls.lateness
    length, samples = stalls.worst
    assert length >= 0.19 and samples
    report = stalls.report()
    loop_lines = [line for line in report.splitlines() if " loop: " in line]
    assert loop_lines and "hold_the_loop" in loop_lines[0], report
    if sys.platform == "linux" and stalls.worst_sched is not None:  # (busy, not asleep: on a CPU or waiting for one)
        ran, waited, window = stalls.worst_sched
        assert window > 0.1 and (ran + waited) / 1e9 >= 0.5 * window, report
        assert "slept" in report


async def test_an_on_time_loop_has_no_stall() -> None:
    async with LoopStalls(late_after=1.0) as stalls:
        await asyncio.sleep(0.05)
    assert stalls.lateness and stalls.worst == (0.0, [])
    assert stalls.report().startswith("no stall longer than 1000 ms was sampled")


async def test_a_loop_held_asleep_is_late_of_its_own() -> None:
    """A blocking call on the loop's thread (a sleep: it waits for no CPU) counts in full against the process: the
    lateness less the waits for a CPU keeps it, however busy the machine is."""
    async with LoopStalls() as stalls:
        await asyncio.sleep(0.01)
        time.sleep(0.2)
        await asyncio.sleep(0.01)
    assert stalls.worst_own_ms >= 190, (stalls.own, stalls.lateness)
    assert stalls.worst_own_ms <= stalls.worst_ms + 1e-6
    assert len(stalls.own) == len(stalls.lateness)
