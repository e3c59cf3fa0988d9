"""The loop latency scenarios (tests/test_loop_latency.py) beside two busy processes, on a machine whose cores are
all taken, with every kernel compiled afresh: the heartbeat stays within LOADED_BOUND_MS."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_loop_latency import SCENARIOS, on_time

from azyx.runtime import RT

pytestmark = pytest.mark.serial  # (timing: run alone, see dev.sh)

# the goal is 20 ms beside the busy processes; 100 is what held in 10 of 10 runs on CI's 2-core shared VM while other
# jobs kept its load at 30-370 (14-16 of 16 within 20 ms per run, worst 92.5 ms of its own at load 140; 150 before);
# each scenario's figure printed by `pytest -m serial -rP`. Before issue 35's fixes the same runs were 49-391 ms late
# of their own. Found and fixed since: PoCL's clEnqueue* calls waited for its thread's compile of a new kernel's
# work-group function (opencl:0 requests: the loop's thread asleep 200-370 ms in clEnqueueReadBuffer): OpenCL's
# enqueues run on a submit thread; wgpu's upload copy held the GIL through its page faults (the loop asleep 16-26 ms):
# numpy's copy lets go of it. What the lateness of its own leaves out (LoopStalls): the loop's waits for a CPU, the
# hypervisor's steal, a GIL holder's wait for a CPU, and the loop asleep in its selector with its timer due. A bare
# 1 ms heartbeat beside the two processes (nice 0 or 19 alike), with no azyx at all, read 12-25 ms late after its waits
# for a CPU, each time with 10-60 ms of steal, and 40 ms with none seen at load 60: while others load the machine the
# 20 ms goal is out of reach of any code in the process. What is left in these runs: wgpu's
# buffer creation on the loop's thread waiting for the driver's lock (12-30 ms, wgpu:0 requests and long_chain), and
# beats the sampler could not see (its own thread without a CPU)
LOADED_BOUND_MS = float(os.environ.get("AZYX_TEST_LOADED_LATENESS_MS", 100))
HOGS = 2


@pytest.fixture
def cpu_hog(fresh_cache: Path) -> Iterator[None]:
    """Two processes that keep a core each busy (at the loop's own priority) while the test runs, and an empty
    kernel cache (`fresh_cache`)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(HOGS)]
    try:
        yield
    finally:
        for p in hogs:
            p.kill()
            p.wait()


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
async def test_the_loop_stays_free_beside_a_cpu_hog(device: str, scenario: str, cpu_hog: None) -> None:
    """Each scenario of test_loop_latency, with every kernel compiled afresh, on a machine whose cores are busy with
    two other processes: the heartbeat stays within LOADED_BOUND_MS."""
    compiled = {name: len(dev.programs) for name, dev in RT.started_devices().items()}
    await on_time(device, SCENARIOS[scenario], LOADED_BOUND_MS, fresh=True)  # (kernels to compile)
    if scenario != "upload":  # (a copy there and back: no kernel)
        assert len(RT.started_devices()[device].programs) > compiled.get(device, 0), "no kernel was compiled"
