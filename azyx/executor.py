"""UnifiedExecutor: runs an ExecutionPlan on any mix of devices, with no dependency graph at run time.

Each step goes to its device's in-order queue. A step that reads a buffer from another device waits for
that buffer's (device, timeline value) on the device side (the worker thread, or the API's own wait
primitive), never on the event loop. Buffers freed by the plan return to their pool only once the queued
work that holds them has run.

Each run keeps a failure record (`RunRecord`): the timeline values of the work it submitted per device and the
records of its inputs' runs. The buffers it hands out carry it, so a failure of that work is raised to the realizes
that wait for them or read them later, and to no other. A run that cannot go on (an allocation refused, a failed
device) raises at once; what it had submitted still runs and then gives its buffers back (`settle`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from enum import Enum
from threading import get_ident
from typing import Any

import numpy as np

from azyx import debug
from azyx.device import (
    BatchState,
    Buffer,
    Device,
    Lane,
    LaunchItem,
    Replay,
    Runner,
    RunRecord,
    arena_of,
    slot_picker,
    work_devices,
)
from azyx.errors import DeviceError
from azyx.graph import StridedView
from azyx.ir import CHECK_WORDS
from azyx.memory import EXTENT
from azyx.plan import ExecutionPlan, KernelStep, TransferStep
from azyx.timeline import checkpoint
from azyx.workers import drain

STAGE = 8 << 20  # bytes per piece of a transfer staged through host memory (pieces overlap: see `_host_staged`)
# a transfer of a plan's input up to this size runs before the plan's kernels (see `_ordered`)
EARLY_BYTES = 1 << 20
# a run whose loads out of files come to this many pieces of Python or more is long: its caller runs it off the event
# loop's thread (`runs_long`; each piece ~10-40 us: 256 staged copies of a 2 GiB load held an H200 host's loop 8-11 ms)
LONG_RUN = 32


class SyncStrategy(Enum):
    SAME_DEVICE = "same device"
    PEER = "peer-to-peer"
    HOST_STAGED = "host-staged"


class UnifiedExecutor:
    def __init__(self) -> None:
        self.devices: dict[str, Device] = {}
        # what running a plan needs that the plan itself does not say (its segments, its devices' runners), derived on
        # its first run here and kept while the plan lives
        self.prepared: weakref.WeakKeyDictionary[ExecutionPlan, Prepared] = weakref.WeakKeyDictionary()
        self.partial: RunRecord | None = None  # the record of the last run that raised part way (see `settle`)
        self.last: tuple[ExecutionPlan | None, Prepared] = (None, _NOTHING)  # (the last plan run: a steady loop's)
        # a crowd's gathers (see `run`): the devices with one open, the loop whose iteration they belong to (it closes
        # them: `flush_gathers`) and its thread; runs gathered and gathers closed, counted (what tests read)
        self.gathering: list[Device] = []
        self.gather_loop: Any = None
        self.gather_thread = 0
        self.gathered = self.gathers = 0

    def runs_long(self, plan: ExecutionPlan) -> bool:
        """Whether a run of `plan` is long Python work: its transfers out of files (each a load's bookkeeping,
        `DiskDevice.send`) and the copies they stage (one per EXTENT bytes onto a device whose memory is not the host's,
        queued one by one) come to LONG_RUN pieces or more; and every device of it may allocate on any thread
        (`alloc_anywhere`). Its caller runs it on a worker thread, not the event loop's (`realize`; asked once per
        plan)."""
        pieces = 0
        for step in plan.steps:
            if isinstance(step, TransferStep) and self.devices[step.src_device].storage:
                staged = not self.devices[step.dst_device].host_memory
                pieces += 1 + (-(-plan.slots[step.dst].nbytes // EXTENT) if staged else 0)
        return pieces >= LONG_RUN and all(self.devices[d].alloc_anywhere or self.devices[d].storage
                                          for d in plan.devices)

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

    @staticmethod
    def _waits(dev: Device, bufs: list[Buffer]) -> list[tuple[Device, int]]:
        """What `dev` must wait for: buffers of other devices not ready yet (its own queue is in order). A buffer of a
        failed device (read in place where memory is shared) raises its failure: its memory went with it."""
        waits = []
        for b in bufs:
            if b.device is not dev:
                if b.device.timeline.failure is not None:
                    b.device.check_alive()
                if b.device.timeline.value < b.ready:
                    waits.append((b.device, b.ready))
        return waits

    def execute_kernel(self, dev: Device, items: list[LaunchItem], batch: BatchState, same_device: bool = False,
                       overwrites: bool = False, gathered: bool = False) -> int:
        """Kernels of one device that run back to back (one piece of work where the device can make it one), each
        with its buffers and the words of its scalar arguments; `batch` is these steps' state in their plan (how the
        device runs them, what it derived from them: `Device.prepare`). `same_device`: the plan's only device (its
        queue is in order: nothing to wait for). `overwrites`: one writes into a buffer the plan was given
        (ExecutionPlan.overwrites), so it waits for the work other devices have queued, which may still read that
        buffer (a copy out of it). `gathered`: into the device's open gather (a gatherable plan's: no waits)."""
        waits = [] if same_device else [w for step, bufs, _ in items for w in self._waits(dev, bufs[step.outs:])]
        if overwrites:
            waits += [(d, d.queued()) for d in self.devices.values() if d is not dev and d.pending()]
        v = dev.gather_launch(items, batch) if gathered else dev.launch_many(items, waits, batch)
        for step, bufs, _ in items:
            for b in bufs[:step.outs]:
                b.ready = v
        return v

    def execute_transfer(self, src: Buffer, dst: Buffer) -> int:
        """Copy src into dst once src is ready, as `sync_strategy` says: a copy on the device's own queue (same
        device), the destination's peer copy (same kind, where the API has a path between the two), else staged
        through host memory (`_host_staged`). Returns the destination's timeline value at which dst is written."""
        sdev, ddev = src.device, dst.device
        n = min(src.nbytes, dst.nbytes)
        waits = self._waits(ddev, [src])
        strategy = self.sync_strategy(sdev.name, ddev.name)
        if strategy is SyncStrategy.SAME_DEVICE:
            v = ddev.copy(src, dst, n, waits)
        else:
            peer = ddev.copy_peer(src, dst, n, waits) if strategy is SyncStrategy.PEER else None
            v = peer if peer is not None else self._host_staged(src, dst, n, waits)
        dst.ready = v
        return v

    @staticmethod
    def _host_staged(src: Buffer, dst: Buffer, n: int, waits: list[tuple[Device, int]]) -> int:
        """A transfer through host memory. A source that moves its bytes itself does (`Device.send`: a file's, by the
        disk's load pipeline, off the loop). Host memory takes no extra copy: a host-memory source is written from
        directly, and a host-memory destination is read into directly (its queue then only waits for the read,
        holding both buffers). Otherwise the source reads, in its own program order (after the work that wrote src),
        into the destination's staging memory in pieces, and the destination writes each piece once it is read: the
        source reads piece i+1 while the destination writes piece i."""
        sdev, ddev = src.device, dst.device
        if (sent := sdev.send(src, dst, n)) is not None:
            return sent
        if sdev.host_memory:
            return ddev.copy_from_host(src.mem.reshape(-1).view(np.uint8)[:n], dst, waits, src)
        if ddev.host_memory:
            done = sdev.copy_to_host(src, dst.mem.reshape(-1).view(np.uint8)[:n], [])
            return ddev.hold([(sdev, done)], (src, dst))
        v = 0
        for o in range(0, max(n, 1), STAGE):
            host, keep = ddev.host_staging(min(STAGE, n - o))
            done = sdev.copy_to_host(src, host, [], o)
            v = ddev.copy_from_host(host, dst, [(sdev, done)], keep, o)
        return v

    def run(self, plan: ExecutionPlan, bindings: list[Buffer], scalars: list[Any] | tuple[Any, ...] = (),
            crowd: Any = None) -> tuple[list[tuple[Buffer, StridedView]], list[Buffer]]:
        """Submit every step of `plan` with `bindings` as its inputs and `scalars` as the values of its scalars (the
        walk's); returns the targets' buffers (not yet necessarily ready: each carries the timeline value at which it
        will be) and the uploads of host data that the inputs' leaves keep (`plan.adopt`, in its order).
        `crowd`: the running asyncio loop, where other work is ready in its iteration (None: none is): see `_gather`."""
        assert len(bindings) == plan.n_inputs and len(scalars) == plan.n_scalars
        last, prepared = self.last
        if last is not plan:  # (a weak dictionary's lookup is Python code: a steady loop skips it)
            found = self.prepared.get(plan)
            if found is None:
                found = self.prepared[plan] = Prepared(plan, self.devices)
            self.last = (plan, prepared := found)
        gathered = (self.gathering or crowd is not None and prepared.gathers is not None) and self._gather(
            prepared.gathers, crowd)
        if not gathered and (lane := prepared.lane) is not None:  # (the device's one call for the whole run)
            got = lane(bindings if type(bindings) is list else list(bindings), scalars)
            if got is not None:
                return got, []
        slots = plan.slots
        bufs: list[Buffer | None] = (bindings if type(bindings) is list else list(bindings)) + prepared.pad
        segments, alone, together = prepared.segments, prepared.alone, prepared.together
        if plan.checks:  # (each run's own check words: kernels that read indices flag one out of range)
            used = prepared.checks
            for i, s in enumerate(plan.checks):
                words = self.devices[slots[s].device].check_words(used[i][0])
                bufs[s], used[i] = words, (*used[i][1:], words)
        record = RunRecord(_parents(bindings))
        spans = record.spans  # (record.cover's body; a gather's runs may share one value: `after - 1`)
        if together is not None and not gathered:
            together.begin_batch()
        try:
            for seg in segments:
                dev = seg.dev
                if dev.timeline.failure is not None:
                    dev.check_alive()  # a failed device takes no more work
                before = dev.queued()
                replay = seg.replay if not gathered else None
                _alloc(dev, seg.sizes if replay is None else seg.bound_sizes, bufs)
                if seg.transfer is not None:
                    after = self._transfer(record, bufs[seg.transfer.src], bufs[seg.transfer.dst])  # type: ignore[arg-type]
                elif replay is not None:
                    after = self._replay(dev, replay, bufs, scalars, alone, seg.overwrites)
                else:
                    after = self.execute_kernel(dev, seg.items(bufs, scalars), seg.batch, alone,  # type: ignore[arg-type]
                                                seg.overwrites, gathered)
                spans[dev] = (spans[dev][0] if dev in spans else min(before, after - 1), after)
                for s in seg.frees:
                    bufs[s] = None  # queued work still holds it; the pool gets it back after that work ran
            if plan.checks:
                self._read_checks(plan, record, bufs)
            outs = self._outputs(plan, bufs, record)
            if not plan.adopt:
                return outs, []
            adopted: list[Buffer] = [bufs[dst] for _, dst in plan.adopt]  # type: ignore[misc]
            if record.checks is not None:  # (an index out of range is the outputs' error, not the uploads')
                uploads = RunRecord(record.parents)
                uploads.spans = record.spans
            else:
                uploads = record
            for b in adopted:
                b.run = uploads
            return outs, adopted
        except BaseException:
            self.partial = record  # what the failed run had submitted, for its caller to `settle`
            raise
        finally:
            bufs.clear()
            if together is not None and not gathered:
                together.end_batch()

    def _outputs(self, plan: ExecutionPlan, bufs: list[Buffer | None], record: RunRecord
                 ) -> list[tuple[Buffer, StridedView]]:
        """A run's targets' buffers and views, each carrying the run's record."""
        outs = []
        for slot, view in plan.outputs:
            b = bufs[slot]
            if b is None:  # an empty output: no kernel wrote it
                s = plan.slots[slot]
                b = bufs[slot] = self.devices[s.device].alloc(max(s.nbytes, 1))
            b.run = record
            outs.append((b, view))
        return outs

    def _replay(self, dev: Device, replay: Replay, bufs: list[Buffer | None], scalars: list[Any] | tuple[Any, ...],
                same_device: bool, overwrites: bool) -> int:
        """A frozen batch's run (`Replay`): its temporaries in one allocation, its bound buffers and scalar words bound
        into the frozen launches; waits as `execute_kernel`'s."""
        waits = [] if same_device else self._waits(dev, [b for b in replay.get(bufs) if b is not None])
        if overwrites:
            waits += [(d, d.queued()) for d in self.devices.values() if d is not dev and d.pending()]
        arena = dev.alloc(replay.arena_size) if replay.arena_size else None
        v = dev.launch_replay(replay, bufs, arena, scalars, waits)
        for s in replay.written:
            bufs[s].ready = v  # type: ignore[union-attr]
        return v

    def gather_read(self, dev: Device, crowd: Any) -> None:
        """A read of `dev`'s queued by the loop's thread while a `crowd` is ready on the loop (a crowd of requests
        reading their results): into `dev`'s gather, opened for the iteration where none is, where its gathers take
        copies (`Device.gathers_copies`): the crowd's reads are one command with its runs."""
        if dev.gathers_copies:
            self._gather(dev, crowd, run=False)

    def _gather(self, dev: Device | None, crowd: Any, run: bool = True) -> bool:
        """Whether a run joins the gather of `dev`, the device that gathers its plan's runs (`Prepared.gathers`; None:
        it has none), with a `crowd` on the loop (see `run`). It does where both are there: the first such run of the
        loop's iteration opens the device's gather (`Device.open_gather`) and asks the loop to close the gathers once
        the iteration's ready work has run (`flush_gathers`), so a crowd's runs become one submission (one work item,
        one batch with one event, one graph launch once steady). Each run still has its own buffers, record and check
        words: its own result, failure and cancellation. Another run of the loop's thread closes the gathers first
        (it comes after them); another thread's run leaves them to their loop (it queues or waits behind them)."""
        gathered = dev is not None and crowd is not None
        if self.gathering and (not gathered or crowd is not self.gather_loop):
            if self.gather_thread != get_ident():
                return False
            self.flush_gathers()
        if not gathered:
            return False
        assert dev is not None
        if not self.gathering:
            crowd.call_soon(self.flush_gathers)
            self.gather_loop, self.gather_thread = crowd, get_ident()
        self.gathered += run
        if dev not in self.gathering:
            dev.open_gather()
            self.gathering.append(dev)
        return True

    def flush_gathers(self) -> None:
        """Close the open gathers (`Device.close_gather`: each device submits what it gathered): at the end of the loop
        iteration that opened them, or before a run that cannot join them (it comes after them). Only on the thread
        whose loop opened them. A gather that cannot be submitted fails its device (its runs would wait forever)."""
        if not self.gathering or self.gather_thread != get_ident():
            return
        devices, self.gathering, self.gather_loop = self.gathering, [], None
        for dev in devices:
            self.gathers += 1
            try:
                dev.close_gather()
            except BaseException as e:
                dev.fail(e)

    def _read_checks(self, plan: ExecutionPlan, record: RunRecord, bufs: list[Buffer | None]) -> None:
        """The run's record reads its check words (Device.check_words: the run's own) once its work is done
        (RunRecord.checked): a host-memory device's directly, another's through a read queued after the run's
        kernels."""
        record.checks = []
        for s in plan.checks:
            dev, buf = self.devices[plan.slots[s].device], bufs[s]
            assert buf is not None
            host = None
            if not dev.host_memory:
                host = np.zeros(CHECK_WORDS, np.int32)
                before = dev.queued()
                record.cover(dev, before, dev.copy_to_host(buf, host.view(np.uint8), []))
            record.checks.append((dev, buf, host, plan))

    def _transfer(self, record: RunRecord, src: Buffer, dst: Buffer) -> int:
        """A run's transfer; a source device with a queue reads out in its own order: its work is the run's too."""
        before = src.device.queued()
        v = self.execute_transfer(src, dst)
        if src.device is not dst.device:
            record.cover(src.device, before, src.device.queued())
        return v

    async def settle(self, record: RunRecord | None) -> None:
        """Wait (on the event loop) until the work a run submitted has run, so that the buffers it took are back in
        their pools (after a run that raised part way); a failure of that work, or of its device, is not raised."""
        if record is None:
            return
        for dev, (_, hi) in record.spans.items():
            try:
                await dev.timeline.wait(hi)
            except DeviceError:  # a failed device: its work is lost, its buffers are released with it
                pass
            dev.collect()

    async def synchronize_all(self) -> None:
        """Wait (on the event loop) until every device, and every compile started, has finished."""
        self.flush_gathers()
        await drain()
        for dev in list(self.devices.values()):
            await dev.timeline.wait(dev.queued())
        for dev in list(self.devices.values()):
            dev.collect()
        # a checkpoint, always (as in trio): until the calling task yields, the loop's handle that resumed it still
        # holds the future it awaited, and that future's result (a gather's CancelledErrors, whose tracebacks hold
        # the cancelled frames and their tensors); a caller that found everything done would see those alive
        await checkpoint()

    def close(self) -> None:
        self.flush_gathers()
        for dev in self.devices.values():
            dev.close()
        self.devices.clear()
        self.last = (None, _NOTHING)


class _Segment:
    """One piece of submitted work of a plan: a transfer, or kernels in a row on one device (one batch); the slots
    its outputs need and the slots whose last use it is. Derived once per plan (`Prepared`)."""

    __slots__ = ("device", "dev", "transfer", "kernels", "allocs", "frees", "batch", "last", "overwrites", "args",
                 "replay", "bound_allocs", "sizes", "bound_sizes")

    def __init__(self, dev: Device, transfer: TransferStep | None, kernels: list[KernelStep]):
        self.device, self.dev, self.transfer, self.kernels = dev.name, dev, transfer, kernels
        self.allocs: list[int] = [transfer.dst] if transfer is not None else [
            s for k in kernels for s in k.args[:k.outs]]
        self.frees: list[int] = []
        self.batch: BatchState | None = None  # (made once the kernels are all in)
        self.last: tuple[object, list[tuple[int, ...]]] = (None, [])
        self.overwrites = False  # a kernel of it writes into an input of the plan (ExecutionPlan.overwrites)
        # per kernel, what picks its buffers out of a run's slots (made once the kernels are all in)
        self.args: list[Callable[[list[Any]], Any]] = []
        # its kernels frozen for its device (`Prepared.freeze`), and the slots a run then allocates one by one (the
        # rest are the frozen batch's temporaries, in one allocation)
        self.replay: Replay | None = None
        self.bound_allocs: list[int] = []
        # (slot, bytes) of `allocs` and of `bound_allocs`, for `_alloc` (made once the kernels are all in)
        self.sizes: list[tuple[int, int]] = []
        self.bound_sizes: list[tuple[int, int]] = []

    def words(self, scalars: list[Any] | tuple[Any, ...]) -> list[tuple[int, ...]]:
        """Each kernel's scalar arguments as the words that carry them, for this run's values: packed anew only for
        new values (a plan without scalars, or a replay of the same values such as azyx.jit's constants, packs none;
        a run's scalars are never changed once bound)."""
        if self.last[0] is not scalars and (scalars or self.last[0] is None):
            words: list[tuple[int, ...]] = []  # (a loop: a comprehension is a call of its own on Python 3.11)
            for k in self.kernels:
                words.append(k.pack(scalars) if k.pack is not None else ())
            self.last = (scalars, words)
        return self.last[1]

    def items(self, bufs: list[Buffer | None], scalars: list[Any] | tuple[Any, ...]) -> list[LaunchItem]:
        """The kernels' launch items for a run: each kernel, its buffers (from the run's slots), its scalar words."""
        out: list[LaunchItem] = []  # (a loop: a comprehension is a call of its own on Python 3.11)
        for k, get, w in zip(self.kernels, self.args, self.words(scalars)):
            out.append((k, list(get(bufs)), w))
        return out


CHECKS_KEPT = 4  # runs back whose check words a plan's run prefers (`Prepared.checks`)


class Prepared:
    """How the executor runs a plan, derived on its first run and kept with it (UnifiedExecutor.prepared): its segments
    and each device's `Runner` (`Device.prepare`, once), whose answers it follows on every run:
    - `lane`: the plan's whole run as one call (a lone kernel's device's), tried first;
    - `together`: the device that collects the run's launches from its start to its end (a single-device plan's);
    - `alone`: the plan has one device (its kernels wait for nothing: that device's queue is in order);
    - `gathers`: the device that gathers concurrent runs of the plan into one submission (`UnifiedExecutor.run`)."""

    __slots__ = ("segments", "runners", "lane", "together", "alone", "gathers", "checks", "pad")

    def __init__(self, plan: ExecutionPlan, devices: dict[str, Device]):
        self.segments = _segments(plan, devices)
        self.pad: list[None] = [None] * (len(plan.slots) - plan.n_inputs)  # (a run's slots past its inputs, empty)
        self.alone = len(plan.devices) == 1
        # per check slot, the words of the plan's last CHECKS_KEPT runs: a run prefers the oldest
        # (`Device.check_words`), so that chained runs take a few buffers in turn, as a replayed batch's graphs do
        self.checks: list[tuple[Buffer | None, ...]] = [(None,) * CHECKS_KEPT] * len(plan.checks)
        self.runners: dict[str, Runner] = {}
        for name in plan.devices:
            dev = devices[name]
            batches = [seg.batch for seg in self.segments if seg.dev is dev and seg.batch is not None]
            self.runners[name] = dev.prepare(plan, batches)
        runners = list(self.runners.values())
        self.lane: Lane | None = runners[0].lane if self.alone else None
        # (a plan whose work is on one device, its inputs uploaded from others first, is that device's)
        work = plan.devices if self.alone else work_devices(plan)
        one = self.runners[work[0]] if len(work) == 1 else None
        self.together: Device | None = devices[work[0]] if one is not None and one.together else None
        self.gathers: Device | None = devices[work[0]] if one is not None and one.gathers else None
        self.freeze(plan)

    def freeze(self, plan: ExecutionPlan) -> None:
        """A plan is steady from its first run (its shapes are its own; it is compiled and its runners are decided):
        each batch of two kernels or more becomes a `Replay` where its device replays one (`Device.freeze`), so even
        its first run binds one; its temporaries share one allocation per run where the device's kernels take
        addresses (`Device.arena`; a transition from their own buffers would leave those cached in the pool)."""
        for seg in self.segments:
            batch = seg.batch
            if batch is None or len(seg.kernels) < 2:
                continue
            arena, size = arena_of(plan, seg.kernels, seg.frees) if seg.dev.arena else ({}, 0)
            replay = Replay(batch, arena, size)
            if seg.dev.freeze(replay):
                seg.replay, seg.bound_allocs = replay, [s for s in seg.allocs if s not in arena]
                seg.bound_sizes = _sizes(plan, seg.bound_allocs)


def _ordered(plan: ExecutionPlan) -> list[tuple[Any, tuple[int, ...]]]:
    """The plan's steps (with their frees) in the order the executor submits them: small transfers of the plan's inputs
    (a decode step's token ids and positions) first, since they wait for nothing in the plan, so that the kernels
    between them form one batch (one graph launch on CUDA) instead of a batch between each two uploads. An input a
    kernel overwrites in place keeps its transfer where it was; a large transfer too (it would hold its memory
    longer)."""
    steps = list(zip(plan.steps, plan.frees))
    early = [i for i, (s, _) in enumerate(steps) if isinstance(s, TransferStep) and s.src < plan.n_inputs
             and s.src not in plan.overwrites and plan.slots[s.dst].nbytes <= EARLY_BYTES]
    if not early or early == list(range(len(early))):
        return steps
    moved = set(early)
    return [steps[i] for i in early] + [x for i, x in enumerate(steps) if i not in moved]


def _segments(plan: ExecutionPlan, devices: dict[str, Device]) -> list[_Segment]:
    out: list[_Segment] = []
    for step, frees in _ordered(plan):
        if isinstance(step, KernelStep):
            last = out[-1] if out else None
            if last is not None and last.transfer is None and last.device == step.device:
                last.kernels.append(step)
                last.allocs.extend(step.args[:step.outs])
            else:
                out.append(last := _Segment(devices[step.device], None, [step]))
        else:
            assert isinstance(step, TransferStep)
            out.append(last := _Segment(devices[step.dst_device], step, []))
        last.frees.extend(frees)
    for seg in out:
        seg.args = [slot_picker(k.args) for k in seg.kernels]
        seg.sizes = _sizes(plan, seg.allocs)
        if seg.transfer is None:
            seg.batch = BatchState(seg.kernels)
            seg.overwrites = any(k.args[0] in plan.overwrites for k in seg.kernels if k.kernel.inplace)
    return out


def _parents(bindings: list[Buffer] | list[Buffer | None]) -> list[RunRecord]:
    """The records of the runs that wrote `bindings` (a run's inputs) that may still fail, each once (a decode step's
    cache tensors were all written by the step before, whose record a failure() walked once per tensor, 25 times a
    GPT-2 step)."""
    parents: list[RunRecord] = []
    for binding in bindings:
        if (r := binding.run) is not None and not r.clean and r not in parents:  # type: ignore[union-attr]
            parents.append(r)
    return parents


def _sizes(plan: ExecutionPlan, allocs: list[int]) -> list[tuple[int, int]]:
    """Each slot of `allocs` with the bytes its buffer takes (at least one)."""
    return [(s, max(plan.slots[s].nbytes, 1)) for s in allocs]


def _alloc(dev: Device, sizes: list[tuple[int, int]], bufs: list[Buffer | None]) -> None:
    """A segment's buffers that its run has yet to make (`sizes`: (slot, bytes); a slot is written once: its buffer is
    made right before the work that writes it)."""
    need = [(s, n) for s, n in sizes if bufs[s] is None]
    if len(need) == 1:
        bufs[need[0][0]] = dev.alloc(need[0][1])
    elif need:
        for (s, _), made in zip(need, dev.alloc_many([n for _, n in need])):
            bufs[s] = made


_NOTHING = Prepared.__new__(Prepared)  # (UnifiedExecutor.last before any run: paired with no plan, never read)
