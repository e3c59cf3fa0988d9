"""azyx.debug.LoopStalls: the heartbeat and sampler that name what held an event loop."""

from __future__ import annotations

import asyncio
import platform
import sys
import threading
import time

import pytest

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


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64"),
                    reason="reads /proc's syscall numbers of x86_64 and aarch64")
async def test_the_sampler_tells_a_loop_asleep_in_its_selector_from_one_held() -> None:
    """A loop's thread asleep in its selector's wait is idle (in a stall: a wake-up the machine did not deliver, left
    out of the lateness of its own); one held by a blocking call on it never is."""
    def looks(stalls: LoopStalls, loop_thread: int, out: list[bool]) -> threading.Thread:
        def run() -> None:
            for _ in range(20):
                time.sleep(2e-3)
                out.append(stalls._loop_idle(sys._current_frames().get(loop_thread)))
        thread = threading.Thread(target=run)
        thread.start()
        return thread

    waiting: list[bool] = []
    held: list[bool] = []
    async with LoopStalls() as stalls:
        thread = looks(stalls, threading.get_ident(), waiting)
        await asyncio.sleep(0.1)  # (the heartbeat wakes it each ms: asleep in its selector most of the time)
        thread.join()
        thread = looks(stalls, threading.get_ident(), held)
        time.sleep(0.1)
        thread.join()
    assert any(waiting), waiting
    assert len(held) == 20 and not any(held), held
