"""UnifiedExecutor: runs an ExecutionPlan on any mix of devices, with no dependency graph at run time.

Each step goes to its device's in-order queue. A step that reads a buffer from another device waits for
that buffer's (device, timeline value) on the device side (the worker thread, or the API's own wait
primitive), never on the event loop. Buffers freed by the plan return to their pool only once the queued
work that holds them has run.
"""

from __future__ import annotations

from enum import Enum

from azyx import debug
from azyx.device import Buffer, Device
from azyx.errors import DeviceError
from azyx.graph import StridedView
from azyx.plan import ExecutionPlan, KernelStep, TransferStep


class SyncStrategy(Enum):
    SAME_DEVICE = "same device"
    PEER = "peer-to-peer"
    HOST_STAGED = "host-staged"


class UnifiedExecutor:
    def __init__(self) -> None:
        self.devices: dict[str, Device] = {}
        self.adopted: list[Buffer] = []  # the last run's uploads that their leaves keep (ExecutionPlan.adopt)

    def add_device(self, device: Device) -> None:
        assert device.name not in self.devices, f"device {device.name} added twice"
        self.devices[device.name] = device
        debug.log(debug.DEVICES, f"device {device.name}: {device.capacity >> 20} MiB, ~{device.compute:.0f} GFLOP/s")

    def context(self, name: str) -> Device:
        """The per-device context: its queue, allocator and TimelineSignal."""
        try:
            return self.devices[name]
        except KeyError:
            raise DeviceError(f"unknown device {name!r}; available: {', '.join(self.devices)}") from None

    def sync_strategy(self, src: str, dst: str) -> SyncStrategy:
        if src == dst:
            return SyncStrategy.SAME_DEVICE
        if self.context(src).kind == self.context(dst).kind:
            return SyncStrategy.PEER
        return SyncStrategy.HOST_STAGED

    def single_device_check(self, plan: ExecutionPlan) -> Device | None:
        """The one device a plan touches, for the fast path without cross-device waits; None if several."""
        return self.devices[plan.devices[0]] if len(plan.devices) == 1 else None

    @staticmethod
    def _waits(dev: Device, bufs: list[Buffer]) -> list[tuple[Device, int]]:
        """What `dev` must wait for: buffers of other devices not ready yet (its own queue is in order)."""
        return [(b.device, b.ready) for b in bufs if b.device is not dev and b.device.timeline.value < b.ready]

    def execute_kernel(self, step: KernelStep, bufs: list[Buffer], same_device: bool = False) -> int:
        return self.execute_kernels([(step, bufs)], same_device)

    def execute_kernels(self, items: list[tuple[KernelStep, list[Buffer]]], same_device: bool = False) -> int:
        """Kernels of one device that run back to back (one piece of work where the device can make it one)."""
        dev = self.devices[items[0][0].device]
        waits = [] if same_device else [w for step, bufs in items for w in self._waits(dev, bufs[step.outs:])]
        v = dev.launch_many(items, waits)
        for step, bufs in items:
            for b in bufs[:step.outs]:
                b.ready = v
        return v

    def execute_transfer(self, src: Buffer, dst: Buffer) -> int:
        """Copy src into dst on the destination's queue once src is ready: on the device (same device, peer) or
        staged through host memory (different APIs); which one is the destination device's `copy_in`'s choice,
        by `sync_strategy`."""
        v = dst.device.copy_in(src, dst, self._waits(dst.device, [src]))
        dst.ready = v
        return v

    def run(self, plan: ExecutionPlan, bindings: list[Buffer]) -> list[tuple[Buffer, StridedView]]:
        """Submit every step of `plan` with `bindings` as its inputs; returns the targets' buffers (not yet
        necessarily ready: each carries the timeline value at which it will be)."""
        assert len(bindings) == plan.n_inputs
        slots = plan.slots
        bufs: list[Buffer | None] = [*bindings, *([None] * (len(slots) - plan.n_inputs))]
        only = self.single_device_check(plan)
        single = only is not None
        if only is not None:
            only.begin_batch()
        steps, n = plan.steps, len(plan.steps)
        try:
            i = 0
            while i < n:
                step = steps[i]
                if isinstance(step, KernelStep):  # with the kernels right after it on the same device: one batch
                    batch: list[tuple[KernelStep, list[Buffer]]] = []
                    while i < n and isinstance(k := steps[i], KernelStep) and k.device == step.device:
                        for out in k.args[:k.outs]:
                            if bufs[out] is None:
                                bufs[out] = self.devices[k.device].alloc(max(slots[out].nbytes, 1))
                        batch.append((k, [bufs[a] for a in k.args]))  # type: ignore[misc]
                        for s in plan.frees[i]:
                            bufs[s] = None  # the batch holds it; the pool gets it back after the batch ran
                        i += 1
                    self.execute_kernels(batch, single)
                    continue
                assert isinstance(step, TransferStep)
                if bufs[step.dst] is None:
                    bufs[step.dst] = self.devices[step.dst_device].alloc(max(slots[step.dst].nbytes, 1))
                self.execute_transfer(bufs[step.src], bufs[step.dst])  # type: ignore[arg-type]
                for s in plan.frees[i]:
                    bufs[s] = None  # queued work still holds it; the pool gets it back after that work ran
                i += 1
            outs = []
            for slot, view in plan.outputs:
                b = bufs[slot]
                if b is None:  # an empty output: no kernel wrote it
                    b = bufs[slot] = self.devices[slots[slot].device].alloc(max(slots[slot].nbytes, 1))
                outs.append((b, view))
            self.adopted = [bufs[dst] for _, dst in plan.adopt]  # type: ignore[misc]
            return outs
        finally:
            bufs.clear()
            if only is not None:
                only.end_batch()

    async def synchronize_all(self) -> None:
        """Wait (on the event loop) until every device, and every compile started, has finished."""
        from azyx.workers import drain

        await drain()
        for dev in list(self.devices.values()):
            await dev.timeline.wait(dev.timeline.value + dev.pending())
        for dev in list(self.devices.values()):
            dev.collect()

    def close(self) -> None:
        for dev in self.devices.values():
            dev.close()
        self.devices.clear()
