"""The small protocol every backend implements, and the Buffer that carries its readiness."""

from __future__ import annotations

import bisect
import os
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Any, TypeVar

import numpy as np

from azyx import debug
from azyx.allocator import MemoryUsage, PoolAllocator
from azyx.codegen import search_actions as optimize
from azyx.codegen.dialect import Dialect
from azyx.codegen.kernel import render_kernel
from azyx.codegen.launch import Launch
from azyx.codegen.render import kernel_source
from azyx.compiler import Compiler
from azyx.compiler import kernel_list as kernel_list  # (re-exported: a message's kernel names)
from azyx.config import COMPILE_TIMEOUT_S, ConfigError
from azyx.dtypes import DType, dtypes, scalar_packer
from azyx.errors import (
    AzyxError,
    CompileError,
    DeviceFailedError,
    IndexOutOfRange,
    RuntimeStateError,
    kept,
)
from azyx.graph import Node, Shape, StridedView, contiguous_strides, prod
from azyx.ir import CHECK_WORDS, Kernel, index_sites
from azyx.memory import Lent as Lent  # (re-exported: the lent blocks of staging pools)
from azyx.memory import Memory
from azyx.plan import ExecutionPlan, KernelStep, TransferStep
from azyx.timeline import TimelineSignal
from azyx.workers import in_worker_thread, in_worker_thread_within

T = TypeVar("T")

DISK = "disk"  # the storage device's name (there is one: file-backed tensors, azyx.io)


class Buffer:
    """Device memory plus the timeline value (on its own device) at which its contents are ready, and the record of
    the run that wrote it (None: written by no plan, or by work known to have succeeded)."""

    __slots__ = ("device", "nbytes", "mem", "ptr", "ready", "pooled", "run", "__weakref__")

    def __init__(self, device: Device, nbytes: int, mem: Any, ptr: int, pooled: bool):
        self.device, self.nbytes, self.mem, self.ptr, self.pooled = device, nbytes, mem, ptr, pooled
        self.ready = 0
        self.run: RunRecord | None = None

    def __repr__(self) -> str:
        return f"Buffer({self.device.name}, {self.nbytes} bytes, ready@{self.ready})"

    def __del__(self) -> None:
        try:
            self.device.release(self)
        except Exception:  # interpreter shutdown
            pass



LaunchItem = tuple["KernelStep", list["Buffer"], tuple[int, ...]]  # a kernel, its buffers, its scalar arguments' words
# a plan's whole run on one device as one call (Runner.lane): (bindings, scalars) -> the outputs' buffers and views, or
# None when the device's state does not let it run that way now (the executor's step path runs it then)
Lane = Callable[[list["Buffer"], "Sequence[Any]"], "list[tuple[Buffer, StridedView]] | None"]


class BatchState:
    """Kernels that one plan runs back to back on one device (a batch): their total work, how the device runs them
    (`how`) and what it derives from them once (`prepared`: its launch tables), both set by `Device.prepare` and kept by
    the executor with the plan for the plan's later runs."""

    __slots__ = ("steps", "work", "how", "prepared")

    def __init__(self, steps: list[KernelStep]):
        self.steps = steps
        self.work = sum(step.work for step in steps)
        self.how = QUEUED
        self.prepared: Any = None


# ---------------------------------------------------------------------------------------------- one runner per plan
# How a device runs a batch of a plan's kernels (BatchState.how), decided once per plan by `Device.prepare`:
INLINE = "inline"  # on the submitting thread, where the device's queue is idle and nothing is waited for (else queued)
QUEUED = "queued"  # a work item on the device's queue (its worker thread, its native runner, its command stream)
GRAPH = "graph"  # collected with the launches around it and submitted as one, replayed as a captured graph once steady


class Runner:
    """How a plan runs on one device, decided once, on the plan's first run (`Device.prepare`): the executor keeps it
    with the plan and follows it; nothing on the run's path decides it again.
    - `lane`: the plan's whole run as one call (a plan of one kernel on a device that has one: CUDA's `native.Lane`);
      the executor's step path runs only where the lane declines for the device's state at that moment (see `Lane`);
    - `together`: the device collects the run's launches from its start to its end (`begin_batch`/`end_batch`) and
      submits them as one (a single-device plan on a device with graphs);
    - `gathers`: runs of the plan that become ready together (a crowd of realizes in one loop iteration) may be
      gathered into one submission of the device (`open_gather`, `gather_launch`, `close_gather`): a plan of kernels
      on this device alone (`gatherable`) on a device that can gather;
    - per batch of the plan's kernels on the device, `BatchState.how` (INLINE, QUEUED or GRAPH)."""

    __slots__ = ("lane", "together", "gathers")

    def __init__(self, lane: Lane | None = None, together: bool = False, gathers: bool = False):
        self.lane, self.together, self.gathers = lane, together, gathers


ARENA_ALIGN = 256  # each temporary's offset in a replayed batch's one allocation (`Replay`): as cuMemAlloc aligns
ARENA_MAX = 16 << 20  # the largest such allocation (`arena_of`)
# the largest temporary that lives in it (a batch-32 GPT-2 decode step's 6.4 MB of logits does, beside its ~140 small
# temporaries: one allocation a step); a larger one has its own buffer
ARENA_PIECE = 8 << 20
ADDRESSES_KEPT = 16  # a frozen batch's runs whose addresses it keeps (`Replay.addresses`)


class Replay:
    """A steady batch's launches frozen as data: made once per batch of a plan (the executor's, before its first run,
    where its device can replay it: `Device.freeze`), so that a run binds its buffers and scalar values
    into it and submits, building nothing per kernel and deciding nothing again.
    - each kernel argument is a slot of the run: one the run binds (`bound`: an input, an output, a temporary that
      outlives the batch, check words), or a temporary of this batch alone, which lives at its offset (`arena`) in one
      allocation of `arena_size` bytes per run (where the device's kernels can take it: `Device.arena`);
    - `addresses`: the run's address of every buffer argument, kernel after kernel (one numpy gather), kept for the
      last ADDRESSES_KEPT runs' buffers (chained steps take a few buffers in turn: their runs gather nothing);
    - `words`: every kernel's scalar words for the run's values, packed by one call, kept while runs pass the same
      values (a jit replay's), in kernel order (`word_counts` each);
    - `written`: the bound slots the batch writes (their buffers' `ready` is the batch's value);
    - `prepared`: what the device derived from it (`Device.freeze`: its table's layout, its graph's key parts)."""

    __slots__ = ("batch", "extents", "arena", "arena_size", "bound", "written", "get", "offsets", "bound_at", "entries",
                 "arg_counts", "word_counts", "pack", "last", "prepared", "seen")

    def __init__(self, batch: BatchState, extents: dict[int, tuple[int, int]], arena_size: int):
        self.batch = batch
        steps = batch.steps
        self.extents = extents  # temporary slot -> (offset, bytes) in the arena (`arena_of`: lives apart share room)
        self.arena = arena = {s: at for s, (at, _) in extents.items()}
        self.arena_size = arena_size
        used = list(dict.fromkeys(s for k in steps for s in k.args))  # (the batch's slots, in order of first use)
        index = {s: i for i, s in enumerate(used)}
        self.bound = [s for s in used if s not in arena]
        self.written = [s for k in steps for s in k.args[:k.outs] if s not in arena]
        self.get: Callable[[list[Any]], Any] = slot_picker(self.bound)
        self.offsets = np.array([arena.get(s, 0) for s in used], np.uint64)  # (a bound slot's entry: overwritten)
        self.bound_at = np.array([index[s] for s in self.bound], np.intp)
        self.entries = np.array([index[s] for k in steps for s in k.args], np.intp)
        self.arg_counts = [len(k.args) for k in steps]
        self.word_counts = [len(k.scalars) for k in steps]
        dts = [d for k in steps for d in k.scalar_dtypes]
        self.pack = scalar_packer(dts, tuple(a for k in steps for a in k.scalars)) if dts else None
        self.last: tuple[object, np.ndarray] = (None, np.zeros(0, np.uint64))
        self.prepared: Any = None
        self.seen: dict[tuple[int, ...], np.ndarray] = {}  # (arena, bound buffers' addresses) -> addresses

    def addresses(self, bufs: list[Any], arena: Buffer | None) -> np.ndarray:
        """The run's address of each buffer argument of each kernel, in order (uint64): a temporary's in `arena`, a
        bound slot's its buffer's (`bufs`: the run's buffers by slot). Read-only: the array is kept for later runs."""
        ptrs = [b.ptr for b in self.get(bufs)]
        key = (arena.ptr if arena is not None else 0, *ptrs)
        found = self.seen.get(key)
        if found is not None:
            return found
        at = self.offsets + np.uint64(key[0]) if arena is not None else self.offsets.copy()
        at[self.bound_at] = ptrs
        if len(self.seen) >= ADDRESSES_KEPT:
            self.seen.pop(next(iter(self.seen)))
        found = self.seen[key] = at[self.entries]
        found.flags.writeable = False
        return found

    def table_at(self) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Where a run's values sit in a table of the batch's arguments (`table_at`)."""
        return table_at(self.batch.steps)

    def words(self, scalars: Sequence[Any]) -> np.ndarray:
        """Every kernel's scalar words for the run's `scalars` (uint64), packed anew only for new values."""
        last = self.last
        if last[0] is not scalars and (scalars or last[0] is None):
            packed = self.pack(scalars) if self.pack is not None else ()
            self.last = last = (scalars, np.array(packed, np.uint64))
        return last[1]


def table_at(steps: list[KernelStep]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Where a run's values sit in a table of the arguments of kernels `steps` that holds, kernel after kernel, its
    buffer addresses and then its scalar words (CUDA's kernelParams, the C runtime's argument table): the positions
    of the addresses (in the order of `Replay.addresses`), of the words (in `Replay.words`' order), and each kernel's
    start in the table, its end last (the table's length)."""
    arg_at: list[int] = []
    word_at: list[int] = []
    starts = [0]
    for k in steps:
        at = starts[-1]
        arg_at += range(at, at + len(k.args))
        word_at += range(at + len(k.args), at + len(k.args) + len(k.scalars))
        starts.append(at + len(k.args) + len(k.scalars))
    return np.array(arg_at, np.intp), np.array(word_at, np.intp), starts


def slot_picker(slots: Sequence[int]) -> Callable[[list[Any]], Any]:
    """What picks `slots`' entries out of a run's list, as a tuple (one C call, for any count)."""
    if len(slots) == 1:
        only = slots[0]
        return lambda bufs: (bufs[only],)
    return itemgetter(*slots) if slots else (lambda bufs: ())


def arena_of(plan: ExecutionPlan, steps: list[KernelStep], frees: list[int]) -> tuple[dict[int, tuple[int, int]], int]:
    """The temporaries that a batch of `plan` (`steps`, whose last uses free `frees`) writes and drops within itself,
    each at an offset (ARENA_ALIGN) in one allocation: (slot -> (offset, bytes of room), the allocation's bytes).
    Temporaries whose lives in the batch do not overlap share room: the batch runs in order on its device's queue (a
    CUDA stream or graph captured from one, the C runtime's kernels one after another, an in-order OpenCL queue), so a
    temporary's last reader has run before a later kernel writes over it. Kernel by kernel, each temporary it writes
    takes the smallest free room that holds it (freed by lives that ended before the kernel), else room on top, up to
    ARENA_MAX: one that finds none has a buffer of its own, as has one of more than ARENA_PIECE bytes. The
    allocation's size is a power of two (plans of other shapes share the pool's cached blocks, as their temporaries
    one by one would); ({}, 0) where no temporary lives in it."""
    freed, slots = set(frees) - {s for s, _ in plan.outputs}, plan.slots
    born: list[list[int]] = [[] for _ in steps]
    last: dict[int, int] = {}
    for i, k in enumerate(steps):
        for s in () if k.kernel.inplace else k.args[:k.outs]:  # (an assignment writes into a buffer made before it)
            if s in freed and s not in last and slots[s].kind == "temp" and slots[s].nbytes <= ARENA_PIECE:
                born[i].append(s)
                last[s] = i
        for s in k.args:
            if s in last:
                last[s] = i
    extents: dict[int, tuple[int, int]] = {}
    ends: dict[int, list[int]] = {}
    free: list[tuple[int, int]] = []  # rooms free below the top, by offset, none touching another
    top = 0
    for i, written in enumerate(born):
        for s in sorted(written, key=lambda s: -slots[s].nbytes):
            room = -(-max(slots[s].nbytes, 1) // ARENA_ALIGN) * ARENA_ALIGN
            fits = [j for j, (a, e) in enumerate(free) if e - a >= room]
            if fits:
                j = min(fits, key=lambda j: free[j][1] - free[j][0])
                at, end = free[j]
                if end - at == room:
                    del free[j]
                else:
                    free[j] = (at + room, end)
            elif free and free[-1][1] == top and free[-1][0] + room <= ARENA_MAX:  # (the free room on top, grown)
                at = free.pop()[0]
                top = at + room
            elif top + room <= ARENA_MAX:
                at, top = top, top + room
            else:
                continue  # (no room: a buffer of its own)
            extents[s] = (at, room)
            ends.setdefault(last[s], []).append(s)
        for s in ends.pop(i, ()):  # (lives that end with this kernel: free for the kernels after it)
            _give_room(free, *extents[s])
    if not top:
        return {}, 0
    return extents, 1 << (top - 1).bit_length()


def _give_room(free: list[tuple[int, int]], at: int, room: int) -> None:
    """Room [at, at + room) free again: into `free` (by offset), joined with the rooms it touches."""
    j = bisect.bisect(free, (at, at))
    start, end = at, at + room
    if j < len(free) and free[j][0] == end:
        end = free.pop(j)[1]
    if j and free[j - 1][1] == start:
        j -= 1
        start = free.pop(j)[0]
    free.insert(j, (start, end))


def work_devices(plan: ExecutionPlan) -> list[str]:
    """The plan's devices less those that only hand it inputs (each of their steps a transfer of a plan input out of
    them: host data uploaded for a request). A plan whose work is on one device runs there as one batch (`Runner.
    together`) even where it uploads its inputs first."""
    work = {s.device for s in plan.steps if isinstance(s, KernelStep)}
    for s in plan.steps:
        if isinstance(s, TransferStep):
            work.add(s.dst_device)
            if s.src >= plan.n_inputs:
                work.add(s.src_device)
    return [d for d in plan.devices if d in work]


def gatherable(plan: ExecutionPlan, uploads: bool = False) -> bool:
    """Whether runs of `plan` may be gathered with other runs into one submission of its device: its steps are all
    kernels on one device (no transfer, so no wait on another device) and none writes into an input in place (such a
    kernel waits for other devices' work that may still read that input). `uploads`: the device gathers copies too
    (`Device.gathers_copies`), so a plan may also copy its inputs in from devices that only hand it inputs (a copy
    that must wait for its source is submitted after the gathered work, in order, as any other submission)."""
    work = work_devices(plan) if uploads else plan.devices
    if len(work) != 1 or not all(isinstance(s, KernelStep) or uploads and s.dst_device == work[0] and s.src
                                 < plan.n_inputs for s in plan.steps):
        return False
    return not any(s.kernel.inplace and s.args[0] in plan.overwrites for s in plan.kernels)


def lone_kernel(plan: ExecutionPlan) -> KernelStep | None:
    """The plan's one kernel where launching it is the whole run (what a lane replays): no transfer, nothing written
    into an input in place, no upload kept, no index check, every output an input or written by the kernel; else
    None."""
    if len(plan.steps) != 1 or plan.adopt or plan.checks or not isinstance(step := plan.steps[0], KernelStep):
        return None
    if step.kernel.inplace and step.args[0] in plan.overwrites:
        return None
    written = step.args[:step.outs]
    return step if all(s < plan.n_inputs or s in written for s, _ in plan.outputs) else None


class RunRecord:
    """The failure record of one run of a plan: per device the timeline values (first, last] of the work it
    submitted, and the records of the runs that wrote its inputs while those may still fail. A failure of any of
    that work (`Device.record_failure`) is this run's: raised to the realizes that wait for its buffers and to later
    runs that read them, never to unrelated work on the same devices."""

    __slots__ = ("spans", "parents", "error", "clean", "checks")

    def __init__(self, parents: list[RunRecord]):
        self.spans: dict[Device, tuple[int, int]] = {}
        self.parents = parents
        self.error: BaseException | None = None
        self.clean = False  # all its work (and its inputs') is done and none failed: nothing to check any more
        # where its kernels checked the indices they read (ir.Kernel.check): per device, its check words' buffer, the
        # host copy that the run's last work item reads them into (None: a host-memory device's own words), the plan
        self.checks: list[tuple[Device, Buffer, np.ndarray | None, ExecutionPlan]] | None = None

    def cover(self, dev: Device, before: int, after: int) -> None:
        """This run's work on `dev` includes the timeline values (before, after]."""
        lo = self.spans[dev][0] if dev in self.spans else before
        self.spans[dev] = (lo, after)

    def failure(self) -> BaseException | None:
        """The first failure of this run's work or its inputs' found so far (final once the work is done)."""
        if self.error is not None or self.clean:
            return self.error
        done = True
        for dev, (lo, hi) in self.spans.items():
            if dev.failures and (err := dev.failure_in(lo, hi)) is not None:
                self.error = err
                return err
            done = done and dev.timeline.value >= hi
        for p in self.parents:
            if (err := p.failure()) is not None:
                self.error = err
                return err
            done = done and p.clean
        if done:
            if self.checks is not None and (err := self.checked()) is not None:
                self.error = err
                return err
            self.clean, self.spans, self.parents = True, {}, []  # (drops the chain of records behind it)
        return None

    def checked(self) -> BaseException | None:
        """Once its work is done: an IndexOutOfRange where a kernel of it found an index out of range (the device's
        check words, which are then cleared for the runs after it), naming the op, the value and the size."""
        checks, self.checks = self.checks, None
        for dev, buf, host, plan in checks or ():
            words = host if host is not None else np.asarray(buf.mem).reshape(-1).view(np.int32)[:CHECK_WORDS]
            if not words[0]:
                # still zero on the device: a later run takes them as they are (no write to clear them)
                if len(dev.zeroed_checks) < ZEROED_CHECKS and not any(words.tolist()):
                    dev.zeroed_checks.append(buf)
                continue
            site, lo, hi, size = (int(w) for w in words[:CHECK_WORDS])
            value = (hi << 32) | (lo & 0xFFFFFFFF)
            what = next((v.arg.what for k in plan.kernels if k.device == dev.name and k.kernel.check >= 0
                         for v in index_sites(k.kernel) if v.arg.name == f"ix{site - 1}" and v.arg.vmax + 1 == size),
                        "gather")
            return IndexOutOfRange(
                f"{what}: index {value} is out of range for an axis of size {size} (on {dev.name}; "
                f"{_CHECKED_OPS.get(what, what)}); AZYX_CHECKS=0 turns the check off (indices are then clamped)")
        return None


# where the user meets each op that reads indices from memory, for IndexOutOfRange's message
_CHECKED_OPS = {"gather": "an integer-tensor index: t[idx], gather, nn.Embedding, one_hot, cross_entropy targets",
                "scatter": "the gradient of a gather", "assign": "t[idx] = value with an integer-tensor index"}


def buffer_of(n: Node) -> Buffer:
    """A realized node's memory as the Buffer it is (the graph, below this layer, knows it as a graph.Storage)."""
    b = n.buffer
    assert isinstance(b, Buffer), f"{n} holds no buffer"
    return b


# the longest a query for completion spins on a device whose kernels run on this machine's CPU (PoCL, lavapipe): the
# loop would spin on a core the kernels need
CPU_SPIN_S = 100e-6
# rough GFLOP/s by the kind of processor an API names (WebGPU's adapter types; Vulkan's device types map to them), for
# AUTO placement; other kinds: ROUGH_GFLOPS_OTHER
ROUGH_GFLOPS = {"CPU": 10.0, "IntegratedGPU": 200.0, "DiscreteGPU": 2000.0}
ROUGH_GFLOPS_OTHER = 50.0
FAILURES_KEPT = 256  # failures a device remembers (by timeline value) for the runs that have yet to look
ZEROED_CHECKS = 16  # check words a device keeps for reuse, found zero after a run (Device.check_words)

class Device:
    """One logical device, made of four parts, split as runtimes that serve many APIs split it. Each part is written
    once; a backend (one module, azyx/backends/<kind>.py, found by azyx.registry) writes only what differs for its API.

    - memory: `mem`, a memory.Memory: the pool of blocks (`mem.pool`, reached as `allocator`: an
      allocator.PoolAllocator over the backend's "create a block of n bytes") of `capacity` bytes, buffers of at most
      `mem.max_block` bytes, the pools of host staging blocks (`mem.staging`: memory.Staging, lent as Lent) and what
      becomes of blocks once the device closed (`mem.close`: cached ones destroyed, `mem.destroy`, and those given
      back later). `alloc`, `alloc_many`, `release`, `reserve`, `memory`, `free_memory` delegate to it. Host staging
      for `copy_from_host` (`host_staging`, `staging_block`) is memory the API copies from fastest (pinned, mapped).
    - queue + timeline, written in azyx.queues: in-order work, each item a value of the device's TimelineSignal
      (`pending`, `queued`, `poll`, `collect`), what an item holds kept until it completed, failures recorded per
      value (`record_failure`). The part is `queue`: a `queues.EventQueue`, which queues.QueuedDevice composes, for an
      API with completion events (a waiter thread, a submit thread where submitting may block, one translation of
      waits into native events); a `queues.WorkQueue`, which queues.HostDevice composes, for host memory (an in-order
      worker thread). The transfer calls the executor
      routes (`copy`, `copy_peer`, `copy_to_host`, `copy_from_host`, `hold`) queue there too.
    - compiler: the kernels a plan needs -> one source (`source`) -> loaded `programs` (`compile`; the backend's
      `build`: compile, on a worker thread, within `compile_timeout_s`, through `builder`, a compiler.Compiler: the
      one on-disk cache of artifacts, a compiler that is a process run and killed at the limit, one CompileError).
    - program/launch: `render` (name, source, `Launch`: codegen's, in the device's `dialect`) and the backend's
      `launch`/`launch_many` of a loaded program with its buffers and the 64-bit words of its scalars (`word_table`
      packs a batch's words where the API reads them from memory).

    The protocol a new backend implements, in its module azyx/backends/<kind>.py (opencl.py is the shortest whole
    example, ~300 lines):
    1. `CONFIG` at the module's top (its config section's defaults; `AUTO`, `LIBRARIES` where they apply), and a
       Device subclass (most: of queues.QueuedDevice) that sets the facts below that differ (`kind`, `dialect`, ...)
       and `count` (how many devices its API has).
    2. `__init__`: open the API (a context its devices share: `Contexts`); `self.mem.open_pool(options, default,
       create)` where `create(n)` makes a block of n bytes (small ones as pieces of slabs where the
       API's allocations are slow: allocator.Slabs' `block` and `destroy`; a pool that holds its blocks, where the
       API's block objects release their handle as they are finalized: memory.OwnedPool); `runs_on(processor)` where
       the API names the kind of processor; where blocks must be freed
       through the API, `self.mem.destroy`; where kernels take buffers by address, `self.mem.address`; where one
       buffer has a limit, `self.mem.max_block`; host staging by `self.mem.staging(create, what)` (memory.Staging: its
       blocks lent by `lend(n)`, a mapped one's memory by `host(n)`); then `queue.start()` (the waiter thread, and the
       submit thread unless it submits on its own path: `start(submits=False)`).
    3. Completion: submit each command after its waits and hand its native event to the waiter thread: by
       `queue.enqueue(run, waits, keep)` and `submit(run, waits, v)` (which calls `queue.native_waits`, or
       `queue.host_waited` where the host waits for the rest on the submit thread, and returns the event),
       or its own path that puts (event, value, post) on `queue.completions`; `wait_event(ev, v)` blocks on one
       (an error it raises fails the command; `lost` where the device is gone with it);
       `native_wait(dev, v)` and `peer(dev)` say what it waits on natively (the rest the host completes);
       `query(v)` lets `poll` ask without a wake-up.
    4. Compile: `build(src, steps)` -> {kernel name: what launching it needs}, through `self.builder`: `artifact`
       for a compiler that is a process (cached on disk), `each` for kernels built one by one, `failed` for the error
       of a build that failed (an artifact of a compiler in this process: compiler.cached_build).
    5. Launch: `launch(step, bufs, waits, words)` (or `launch_many` for several at once).
    6. Copies: `copy`, `copy_to_host`, `copy_from_host` (and `copy_peer` where `peer` is not enough; `hold` on a
       host-memory device);
       reads and blocking writes come from them (QueuedDevice's `read`, `read_into`, `write`).
    7. Closing (QueuedDevice's `close`, written once): `drain` (wait for the API's queue) and `let_go` (destroy
       what the API made), where the API needs them.
    A host-memory backend subclasses queues.HostDevice instead, whose memory and queue are ready: it writes
    `build`, `prepare_batch` and `batch_fn` (the work item that runs a batch of kernels)."""

    kind: str = "abstract"
    dialect: Dialect | None = None
    tiles = False  # whether register tiling pays off on this device
    host_memory = False  # buffers are host memory (Buffer.mem is a numpy array, Buffer.ptr its address)
    alloc_anywhere = False  # `alloc` may be called on any thread (a stream then allocates off the loop)
    # the smallest block a plan's run would have to make anew (not from the pool's cache) that costs enough to be made
    # off the loop's thread beforehand (`reserve`); 0: never (a driver call that can wait on the driver's lock: CUDA's)
    reserve_min = 0
    listed = True  # a compute device that azyx.devices() lists
    unlisted_compute = False  # a compute device that azyx.devices() does not list (the dummy: it plans, holds no data)
    storage = False  # buffers are file ranges (disk): reading them waits on storage, so never on the event loop
    arena = False  # a steady batch's temporaries may share one allocation per run (by address; OpenCL: sub-buffers)
    # its open batch or gather takes copies too (`gatherable(plan, uploads=True)`; a crowd's reads join its gather:
    # `UnifiedExecutor.gather_read`): one command for a crowd's uploads, kernels and reads
    gathers_copies = False
    spin = 0.0  # seconds `poll` may query for completion when the loop would sleep otherwise (see realize.wait_for)
    spin_cap = float("inf")  # the most `poll` queries for at once (CPU_SPIN_S on a device whose kernels run on the CPU)
    kills_builds = False  # its compiler is a process that `build` kills at compile_timeout_s (else: abandoned)
    shaders = False  # each kernel's source is a whole program (a shader), which `build` compiles alone
    max_buffers = 0  # storage buffers one kernel may bind, a scalar words buffer included (0: no limit)
    multiprocessors = 0  # a GPU's multiprocessors (CUDA's SMs), which a product's split over K fills (0: not known)
    sm90 = 0  # the multiprocessors of a CUDA device of compute capability 9.0: its products take wgmma (render_kernel)

    def __init__(self, index: int, options: dict[str, Any]):
        self.index = index
        self.name = f"{self.kind}:{index}"
        self.options = options
        self.timeline = TimelineSignal(self.name)
        self.mem = self.memory_part()
        self.builder = Compiler(self)  # the compiler part, which a backend's `build` compiles through
        self.compute = 1.0
        self.threads = 1
        self.programs: dict[str, Any] = {}  # kernel name -> what launching it needs (Device.build's)
        # failures of queued work by timeline value, for the runs whose work they were (RunRecord)
        self.failures: dict[int, BaseException] = {}
        self.failed_from: dict[int, int] = {}  # a failed batch's first value, by its last (`record_failure`)
        self.zeroed_checks: list[Buffer] = []  # check words a clean run left zero, for later runs (`check_words`)
        self.compile_timeout_s = float(options.get("compile_timeout_s", COMPILE_TIMEOUT_S))  # see config.py
        # whether its runners may gather a crowd's runs (Runner.gathers), where the backend can: its section's `gather`
        self.gather_runs = bool(options.get("gather", True))
        if not self.compile_timeout_s > 0:
            raise ConfigError(f"{self.kind}: compile_timeout_s must be a positive number of seconds, got "
                              f"{options.get('compile_timeout_s')!r}")

    def __repr__(self) -> str:
        return f"<Device {self.name}>"

    @classmethod
    def count(cls, options: dict[str, Any]) -> int:
        """How many devices of this backend to start: what its config section says (`devices`), else what the API
        reports (raising where the driver is missing)."""
        return int(options.get("devices", 1))

    # failures
    def record_failure(self, v: int, err: BaseException, first: int = 0) -> None:
        """The work item of timeline value `v` failed (any thread; before the timeline reaches `v`). The first
        failure of an item is kept; an error that is no AzyxError is wrapped in one that names the device. `first`:
        the item completes the values reserved from `first` on (a batch's), each of which fails with it."""
        if v in self.failures:
            return
        if first and first < v:
            self.failed_from[v] = first
        if not isinstance(err, AzyxError):  # (a bug, most likely: its traceback goes into the message)
            tb = "".join(traceback.format_exception(err)).rstrip()
            err = RuntimeStateError(f"{self.name}: work item {v} failed: {err!r}\n{tb}")
        self.failures[v] = kept(err)  # waiters raise fresh copies of it
        while len(self.failures) > FAILURES_KEPT:
            self.failed_from.pop(gone := next(iter(self.failures)), None)
            self.failures.pop(gone, None)
        debug.log(debug.DEVICES, f"{self.name}: work item {v} failed: {err}")

    def failure_in(self, lo: int, hi: int) -> BaseException | None:
        """The failure of a work item with a timeline value in (lo, hi], if any."""
        if self.failures:
            for v, err in list(self.failures.items()):
                if lo < v and self.failed_from.get(v, v) <= hi:
                    return err
        return None

    def fail(self, cause: BaseException | str) -> DeviceFailedError:
        """Mark the device failed (a kernel faulted, the driver lost it): every waiter on its timeline, present or
        future, gets a DeviceFailedError naming the device and `cause` instead of hanging, and nothing more is
        submitted to it. Other devices keep working. Returns the error."""
        why = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        err = DeviceFailedError(f"device {self.name} has failed ({why}); its queued work is lost and it takes no "
                                f"more (other devices keep working)")
        if isinstance(cause, BaseException):
            err.__cause__ = kept(cause)
        debug.log(debug.DEVICES, str(err))
        self.timeline.fail(err)
        return err

    @property
    def failed(self) -> BaseException | None:
        """Why the device failed (a DeviceFailedError), or None while it works."""
        return self.timeline.failure

    def check_alive(self) -> None:
        """Raise the device's DeviceFailedError if it has failed."""
        self.timeline.check()

    def queued(self) -> int:
        """The timeline value of the last work item submitted (its completion is `timeline` reaching it); a device
        with a queue says it (the base submits nothing of its own)."""
        return self.timeline.value

    def pending(self) -> int:
        """How many submitted work items have not completed yet."""
        return self.queued() - self.timeline.value

    # memory: the device's memory part (`mem`, azyx.memory); call sites reach it through these
    def memory_part(self) -> Memory:
        """The memory part this device starts with (a backend gives it its pool in `__init__`)."""
        return Memory(self, Buffer)

    @property
    def capacity(self) -> int:
        """The bytes its buffers may hold in all."""
        return self.mem.capacity

    @capacity.setter
    def capacity(self, value: int) -> None:
        self.mem.capacity = value

    @property
    def allocator(self) -> PoolAllocator:
        """The memory part's pool (AttributeError on a device that has none)."""
        if self.mem.pool is None:
            raise AttributeError(f"{self.name} has no pool")
        return self.mem.pool

    @allocator.setter
    def allocator(self, pool: PoolAllocator) -> None:
        self.mem.pool = pool

    def free_memory(self) -> int:
        """Bytes this device can still take."""
        return self.mem.free()

    def memory(self) -> MemoryUsage:
        """Bytes this device's buffers hold and bytes its pool caches for reuse (what `azyx.stats()` reports)."""
        return self.mem.usage()

    def alloc(self, nbytes: int) -> Buffer:
        """A buffer of at least `nbytes` bytes from the pool (AllocationError past the API's limit or the capacity)."""
        return self.mem.alloc(nbytes)

    def alloc_many(self, sizes: list[int]) -> list[Buffer]:
        """A buffer of each size (a plan step's outputs, made together)."""
        return [self.alloc(n) for n in sizes]

    def release(self, buf: Buffer) -> None:
        """A buffer's block back to the pool (Buffer.__del__)."""
        self.mem.release(buf)

    def reserve(self, sizes: list[int]) -> None:
        """Make blocks of `sizes` bytes and give them back to the pool, which keeps them cached for the next `alloc`s
        (a worker thread's call, where `alloc_anywhere`: a plan's large new buffers are then taken from the cache on
        the loop's thread instead of made there). A Buffer gives its block back when dropped: releasing it here as
        well would put the block in the pool twice, and two later buffers would share it."""
        bufs = self.alloc_many(sizes)
        del bufs

    def check_words(self, prefer: Buffer | None = None) -> Buffer:
        """A run's check words (ir.CHECK_WORDS int32, zero until a kernel finds an index out of range), which its
        kernels that check the indices they read are bound to: those an earlier run found still zero
        (`RunRecord.checked`; `prefer` where it is one of them: a replayed plan's runs then bind the same few
        addresses in turn), else taken from the pool and zeroed (host memory now, another device's by a write
        queued before the run's kernels), so no run is blamed for another's index."""
        if zeroed := self.zeroed_checks:
            if prefer is not None:
                for i, b in enumerate(zeroed):
                    if b is prefer:
                        return zeroed.pop(i)
            return zeroed.pop()
        buf = self.alloc(4 * CHECK_WORDS)
        if self.host_memory:
            np.asarray(buf.mem).reshape(-1).view(np.uint8)[:4 * CHECK_WORDS] = 0
        else:
            zeros = np.zeros(4 * CHECK_WORDS, np.uint8)
            buf.ready = self.copy_from_host(zeros, buf, [], zeros)
        return buf

    def buffer_from_numpy(self, arr: np.ndarray) -> Buffer:
        """A buffer that is `arr` itself: on a host-memory device only (host data reaches any other device through
        host:0 and a transfer)."""
        raise AssertionError(f"host data reaches a {self.kind} device through host:0 and a transfer")

    def read(self, buf: Buffer, view: StridedView, shape: Shape, dtype: DType) -> np.ndarray:
        raise NotImplementedError

    # program/launch, onto the queue: `waits` are (device, timeline value) pairs to wait for first, on the device side
    # (its queue's wait primitive or its worker thread), never on the event loop
    def launch(self, step: KernelStep, bufs: list[Buffer], waits: list[tuple[Device, int]],
               words: tuple[int, ...] = ()) -> int:
        """Queue a kernel with its buffers and the 64-bit words of its scalar arguments (KernelStep.words); returns the
        timeline value at which it will have completed. (A backend overrides this or `launch_many`, each the
        other's default.)"""
        return self.launch_many([(step, bufs, words)], waits)

    def launch_many(self, items: list[LaunchItem], waits: list[tuple[Device, int]],
                    batch: BatchState | None = None) -> int:
        """Queue kernels that run back to back (a device may submit them as one piece of work); returns the timeline
        value at which all have completed. The queue is in order: the first kernel's waits hold for the rest. `batch`
        (when given) is these steps' state in one plan: a device may keep there what it derives from the steps alone,
        for the plan's next run."""
        v = 0
        for i, (step, bufs, words) in enumerate(items):
            v = self.launch(step, bufs, waits if i == 0 else [], words)
        return v

    def prepare(self, plan: ExecutionPlan, batches: list[BatchState]) -> Runner:
        """How `plan` runs on this device, decided once (its first run; the executor keeps the answer with the plan):
        each of `batches` (the plan's kernels on this device, in runs) prepared (`prepare_batch`), and the `Runner`:
        the base runs the plan step by step, with no lane and no run-long batch."""
        for batch in batches:
            self.prepare_batch(batch)
        return Runner()

    def prepare_batch(self, batch: BatchState) -> None:
        """Decide how `batch` runs here (`batch.how`; the base: QUEUED) and derive what its runs reuse (`prepared`):
        once per plan, or per call for kernels launched outside a plan (`batch_of`)."""
        batch.how = QUEUED

    def batch_of(self, items: list[LaunchItem]) -> BatchState:
        """A batch prepared now for kernels launched outside a plan (azyx.search's timing runs)."""
        batch = BatchState([step for step, _, _ in items])
        self.prepare_batch(batch)
        return batch

    def freeze(self, replay: Replay) -> bool:
        """Whether this device replays `replay` (a steady batch frozen as data: `launch_replay`), leaving in
        `replay.prepared` what it derives from it once; the base does not (its batches run as launch items)."""
        return False

    def launch_replay(self, replay: Replay, bufs: list[Any], arena: Buffer | None, scalars: Sequence[Any],
                      waits: list[tuple[Device, int]]) -> int:
        """Queue a frozen batch (`freeze`) for a run: its kernels with the run's buffers (`bufs`, by slot; the batch's
        temporaries in `arena`, held with the bound buffers until the work has run) and `scalars`' words, after
        `waits`, as `launch_many` would queue them; returns the timeline value at which all have completed."""
        raise NotImplementedError

    def begin_batch(self) -> None:
        """The launches until `end_batch` are one plan's, on this device alone (where its `Runner.together` says so):
        the device submits them together (CUDA replays them as a graph once steady)."""

    def end_batch(self) -> None:
        pass

    # gathering: runs of plans whose runner `gathers` (Runner.gathers), submitted by the executor one after the other
    # in one loop iteration (a crowd of realizes), become one submission of the device (UnifiedExecutor.flush_gathers)
    def open_gather(self) -> None:
        """From now until `close_gather`, `gather_launch` collects kernels (the runs of a crowd) to submit as one piece
        of work; other submissions to the device meanwhile keep program order (they come after the gathered kernels).
        Only on a device that says `Runner.gathers` for some plan."""
        raise NotImplementedError

    def gather_launch(self, items: list[LaunchItem], batch: BatchState) -> int:
        """Collect a run's kernels (`batch`'s, with no waits: a `gatherable` plan's) into the open gather; returns the
        timeline value at which they will have completed (reserved now, reached once `close_gather` submitted them)."""
        raise NotImplementedError

    def close_gather(self) -> None:
        """Submit what the open gather collected, as one piece of work (one work item, one batch with one event)."""
        raise NotImplementedError

    def render(self, k: Kernel) -> tuple[str, str, Launch]:
        """(name, source, launch) of a kernel in this device's dialect, made with the actions that won the search for
        its structure on this device where the disk cache has them (a dict lookup), else as the heuristics made it."""
        if self.search_actions and self.winners is not None:
            k = self.tuned(k)
        return self.render_ir(k)

    def render_ir(self, k: Kernel) -> tuple[str, str, Launch]:
        """(name, source, launch) of exactly kernel `k`."""
        assert self.dialect is not None
        return render_kernel(k, self.dialect, self.threads, self.sm90)

    # kernel search: which actions (search_actions) this device's renderer understands, and the winners found on it
    @property
    def search_actions(self) -> frozenset[str]:
        """The actions a search may try here: the C-family renderer's register tiles and reduce unrolls everywhere,
        work-group sizes where kernels run one work item per point (GPU-style dialects), vector widths where the
        dialect has vector types, block sizes where a dialect has a product template with a table of them
        (`Dialect.block_search`: the host's, CUDA's and Vulkan's tiles, not OpenCL's CPU template); none without a
        dialect. (Split reductions' parts,
        optimize.SPLIT, are searched by azyx.tune wherever the planner splits.)"""
        dl = self.dialect
        if dl is None:
            return frozenset()
        tiles = frozenset({optimize.UPCAST, optimize.SWAP, optimize.UNROLL})
        if not dl.global_ids:
            return tiles | {optimize.BLOCK} if dl.gemm else tiles  # (BLOCK: the host product's block sizes)
        vector = {optimize.VECTOR} if dl.vector else set()
        block = {optimize.BLOCK} if dl.block_search else set()
        return tiles | {optimize.LOCAL, optimize.GROUP} | vector | block

    def identity(self) -> dict[str, Any]:
        """What a search result depends on besides the kernel: the hardware, its driver and compiler versions
        (backends add theirs; the base knows the kind, the label and the architecture where a backend has them)."""
        return {"kind": self.kind, "label": str(getattr(self, "label", "")), "arch": str(getattr(self, "arch", "")),
                "dialect": self.dialect.name if self.dialect is not None else ""}

    def winner_cache(self) -> optimize.WinnerCache:
        """The on-disk cache of search winners for this device's identity (read once, on first use)."""
        cache = self.__dict__.get("_winners")
        if cache is None:
            cache = self.__dict__["_winners"] = optimize.WinnerCache(self.identity())
        return cache

    @property
    def winners(self) -> optimize.WinnerCache | None:
        """The winner cache where it has entries, else None (a device without any pays nothing on render; where
        nothing was ever searched, not even its identity is asked for)."""
        if "_winners" not in self.__dict__ and not optimize.cache_root().is_dir():
            return None
        cache = self.winner_cache()
        return cache if len(cache) else None

    def tuned(self, k: Kernel) -> Kernel:
        """`k` made with its cached winning actions (from its base, the kernel before the heuristics' actions); `k`
        itself where there is no entry, or where the entry does not apply (a debug line: never trusted)."""
        base = k.base or k
        if not optimize.searchable(base):
            return k
        cache = self.winners
        key = optimize.kernel_key(base)
        opts = cache.get(key) if cache is not None else None
        if opts is None or opts == k.opts:
            return k
        try:
            return optimize.apply(base, opts)
        except optimize.OptError as e:
            debug.log(debug.SEARCH, f"{self.name}: cached actions {opts} for kernel {key} do not apply ({e}): ignored")
            return k

    def split_choice(self, site: optimize.SplitSite) -> int | None:
        """The parts (0: none) that won the search for split reduction `site` on this device (azyx.tune), or None:
        no entry, or one that is not a split of it (a debug line: never trusted)."""
        cache = self.winners if self.search_actions else None
        opts = cache.get(site.key) if cache is not None else None
        if opts is None:
            return None
        if len(opts) == 1 and opts[0].kind == optimize.SPLIT and site.fits(opts[0].amount):
            return opts[0].amount
        debug.log(debug.SEARCH, f"{self.name}: cached {list(opts)} for {site.key} is not a split of it: ignored")
        return None

    # compiler: the kernels a plan needs and the device lacks -> one source -> loaded programs, by kernel name
    def has_program(self, name: str) -> bool:
        """Whether kernel `name` is compiled and loaded for this device."""
        return name in self.programs

    async def compile(self, steps: list[KernelStep]) -> None:
        """Build and load the kernels of `steps` that are not loaded yet, as one source (each kernel once), on a worker
        thread: the loop only waits. Past `compile_timeout_s` a CompileError names the device and the kernels; a
        build that cannot be killed (in this process) is abandoned, while `kills_builds` backends stop their
        compiler themselves (`build` then enforces the limit). A cancelled realize stops waiting; the build still
        finishes into the on-disk cache."""
        todo = {s.name: s for s in steps if s.name not in self.programs}
        if not todo:
            return
        src = self.source(list(todo.values()))
        debug.log(debug.SOURCE, lambda: f"{self.name}: source of {', '.join(todo)}:\n{src}")
        if self.kills_builds:
            built = await in_worker_thread(self.build, src, list(todo.values()))
        else:
            built = await self.build_within_limit(list(todo), self.build, src, list(todo.values()))
        self.programs.update(built)

    def source(self, steps: list[KernelStep]) -> str:
        """The one source of the kernels of `steps` that `build` compiles: the dialect's prelude and each kernel (where
        kernels are `shaders`: each one's own, one after the other, for the debug log)."""
        if self.shaders:
            return "\n".join(s.src for s in steps)
        assert self.dialect is not None
        return kernel_source([s.src for s in steps], self.dialect)

    def build(self, src: str, steps: list[KernelStep]) -> dict[str, Any]:
        """Compile `src` (the kernels of `steps`) and load it, on a worker thread: per kernel name, what launching it
        needs (a function handle, an entry point). Compiled artifacts go to the on-disk cache
        (`compiler.cached_build`)."""
        raise NotImplementedError

    async def build_within_limit(self, names: list[str], build: Callable[..., T], *args: Any) -> T:
        """Run `build(*args)` (a compile in this process: it cannot be killed) on a worker thread; past
        `compile_timeout_s` raise CompileError naming the device, the kernels and the limit. The abandoned build runs
        on to its end and its result is dropped: nothing of it counts as compiled."""
        try:
            return await in_worker_thread_within(self.compile_timeout_s, build, *args)
        except TimeoutError:
            raise CompileError(f"{self.name}: compiling {kernel_list(names)} took longer than compile_timeout_s="
                               f"{self.compile_timeout_s:g} s; abandoned") from None

    def write(self, buf: Buffer, host: np.ndarray) -> None:
        """Blocking write of raw bytes into `buf` (called on worker threads)."""
        raise NotImplementedError

    # transfers: the executor routes each one (UnifiedExecutor.execute_transfer); each call queues its part on this
    # device after `waits` and returns the timeline value at which that part is done
    def copy(self, src: Buffer, dst: Buffer, n: int, waits: list[tuple[Device, int]]) -> int:
        """Queue a copy of the first `n` bytes of `src` into `dst`, both on this device."""
        raise NotImplementedError

    def reads_peer(self, other: Device) -> bool:
        """Whether this device's kernels read `other`'s buffers where they lie (a collective's pieces, no copy: the
        scheduler's `reads_in_place`). No by default; CUDA devices of this process with peer access between them do."""
        return False

    def copy_peer(self, src: Buffer, dst: Buffer, n: int, waits: list[tuple[Device, int]]) -> int | None:
        """Queue a copy of the first `n` bytes of `src`, on another device of this kind, into `dst` (on this one);
        None where the API has no peer path between the two (the executor then stages through host memory)."""
        return None

    def copy_to_host(self, buf: Buffer, out: np.ndarray, waits: list[tuple[Device, int]], offset: int = 0) -> int:
        """Queue a read of `out.nbytes` bytes of `buf` from byte `offset` into the host array `out`, in program order
        on this device's own queue. Reading in program order is what keeps cross-device waits free of cycles."""
        raise NotImplementedError

    def copy_from_host(self, host: np.ndarray, dst: Buffer, waits: list[tuple[Device, int]], keep: Any,
                       offset: int = 0) -> int:
        """Queue a write of the host bytes `host` into `dst` from byte `offset`; `keep` keeps `host` valid, and is
        held (with `dst`) until the write is done. `host` may come from `host_staging` (with its keep-alive)."""
        raise NotImplementedError

    def host_staging(self, nbytes: int) -> tuple[np.ndarray, Any]:
        """Host memory (uint8) for `nbytes` bytes that another device reads into for `copy_from_host`, and what keeps
        it valid: the memory this device writes from fastest (pinned, where it has a pool of it)."""
        arr = np.empty(nbytes, np.uint8)
        return arr, arr

    def staging_block(self, nbytes: int) -> tuple[np.ndarray, Any]:
        """Like `host_staging`, but called on a worker thread (never the loop's), so it may take its time: pinned
        memory allocated and registered now where the device's pool has none cached (a stream's read-ahead ring)."""
        return self.host_staging(nbytes)

    def send(self, src: Buffer, dst: Buffer, n: int) -> int | None:
        """A source device's own way of writing the first `n` bytes of its `src` into `dst` on another device (the
        disk's: reads staged through the destination's ring, off the loop), returning the destination's timeline value
        at which dst is written; None: the executor's usual ways (`UnifiedExecutor._host_staged`)."""
        return None

    def hold(self, waits: list[tuple[Device, int]], keep: Any) -> int:
        """Queue nothing but waiting for `waits`, holding `keep` until then: this device's part of a transfer that
        another device's read wrote straight into its memory (a host-memory device's)."""
        raise NotImplementedError

    def read_into(self, buf: Buffer, out: np.ndarray) -> None:
        """Blocking read of the first `out.nbytes` raw bytes of `buf` into the uint8 array `out` (worker threads)."""
        out[...] = self.read(buf, StridedView(0, (1,)), (out.nbytes,), dtypes.uint8)

    def collect(self) -> None:
        """Drop what completed work still holds (called by `synchronize` once the device is idle)."""

    def poll(self, v: int, spin: float = 0.0) -> bool:
        """Advance the timeline to `v` if the device can tell that its work up to `v` has completed, without a wake-up
        from another thread: at once, or by querying for up to `spin` seconds (the caller's loop has nothing else to
        do). Returns whether `v` is reached. Optional: a device without a cheap query says no."""
        return self.timeline.value >= v

    def spun(self, done: Callable[[], bool], spin: float) -> bool:
        """Whether `done()` holds now or, asked again and again, within `spin` seconds (at most `spin_cap`): the query
        of a backend's `poll`. On a device whose kernels run on this machine's CPU the core is yielded between queries
        (PoCL, 2-core EPYC at load 2-3: a small realize spun its 100 us while PoCL's threads waited for a core, then
        slept for the waiter thread's wake-up: 360-450 us, 100-175 us yielding; 922beb9 137-170 us)."""
        if done():
            return True
        deadline = time.perf_counter() + min(spin, self.spin_cap)
        cpu = self.spin_cap == CPU_SPIN_S  # (its kernels' threads may need this core: it is theirs between queries)
        while time.perf_counter() < deadline:
            if cpu:
                os.sched_yield()
            if done():
                return True
        return False

    def runs_on(self, processor: str) -> None:
        """The kind of processor the API names (ROUGH_GFLOPS' keys: WebGPU's adapter types, what Vulkan's device types
        map to): its rough GFLOP/s (`compute`, for AUTO placement), and on a CPU the most `poll` spins at once
        (CPU_SPIN_S: its kernels run on the cores the loop would spin on)."""
        self.compute = ROUGH_GFLOPS.get(processor, ROUGH_GFLOPS_OTHER)
        if processor == "CPU":
            self.spin_cap = CPU_SPIN_S

    def lost(self, v: int, cause: BaseException) -> bool:
        """Work item `v` failed and took the device with it (the device lost, a kernel that faulted: the API's context
        is unusable): its failure recorded and the device failed (`fail`); False (what `wait_event` returns then)."""
        self.record_failure(v, cause)
        self.fail(cause)
        return False

    def close(self) -> None:
        pass


class Contexts:
    """An API's contexts by key (a physical device, a platform), each shared by the devices of this process that use
    it (so that they wait on each other's events and copy between each other's buffers: `QueuedDevice.peer`): made by
    the first to `take` it and, where the API's context must be destroyed (`close`), destroyed once the last user
    `release`s it."""

    def __init__(self, close: Callable[[Any], None] | None = None):
        self.close = close
        self.lock = threading.Lock()
        self.held: dict[Any, tuple[Any, int]] = {}  # key -> (its context, its users)

    def __len__(self) -> int:
        return len(self.held)

    def take(self, key: Any, make: Callable[[], T]) -> T:
        """The context of `key` (made by `make()` where there is none), with one user more."""
        with self.lock:
            ctx, users = self.held[key] if key in self.held else (make(), 0)
            self.held[key] = (ctx, users + 1)
            return ctx

    def release(self, key: Any) -> None:
        """A user of `key`'s context is done with it; the last one closes it."""
        with self.lock:
            ctx, users = self.held.pop(key)
            if users > 1:
                self.held[key] = (ctx, users - 1)
                return
        if self.close is not None:
            self.close(ctx)


def word_table(rows: list[list[int]], sizes: list[int], align: int) -> tuple[list[int], np.ndarray]:
    """The 64-bit words of several kernels in one table (uint64), each row at an offset aligned to `align` bytes and
    taking `sizes[i]` bytes (at least its words): the rows' byte offsets and the table."""
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at += -(-size // align) * align
    table = np.zeros(at // 8, np.uint64)
    for off, row in zip(offsets, rows):
        table[off // 8:off // 8 + len(row)] = row
    return offsets, table


def after_waits(waits: list[tuple[Device, int]], fn: Callable[[], None]) -> None:
    """Run `fn` once every (device, value) of `waits` is reached (on the thread that reaches the last one; at once
    when all are)."""
    if not waits:
        fn()
        return
    (dev, v), rest = waits[0], waits[1:]
    dev.timeline.on_reach(v, lambda: after_waits(rest, fn))


def host_view(mem: np.ndarray, view: StridedView, shape: Shape, dtype: DType) -> np.ndarray:
    """A strided view of host memory as an array of `dtype`'s numpy type (bfloat16: its raw 16 bits), no copy."""
    item = dtype.itemsize
    raw = mem.reshape(-1).view(np.uint8)
    flat = raw[: len(raw) // item * item].view(dtype.np)
    if shape and 0 in shape:
        return np.empty(shape, dtype.np)
    if tuple(view.strides) == contiguous_strides(shape):  # (a slice: as_strided is ~10 times its cost)
        out = flat[view.offset:view.offset + prod(shape)].reshape(shape)
        out.flags.writeable = False
        return out
    return np.lib.stride_tricks.as_strided(flat[view.offset :], shape, tuple(s * item for s in view.strides),
                                           writeable=False)


def host_read(mem: np.ndarray, view: StridedView, shape: Shape, dtype: DType) -> np.ndarray:
    """Copy a strided view of host memory into a new C-contiguous array (bfloat16 widened to float32)."""
    return widened(np.array(host_view(mem, view, shape, dtype), copy=True, order="C"), dtype)


def widened(out: np.ndarray, dtype: DType) -> np.ndarray:
    """`out`, of `dtype`, as every device's `read` returns it: bfloat16 widened to float32."""
    return (out.astype(np.uint32) << 16).view(np.float32) if dtype is dtypes.bfloat16 else out
