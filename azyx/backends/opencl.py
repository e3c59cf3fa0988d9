"""The OpenCL backend (pyopencl): kernels in OpenCL C from the shared C-family renderer, one in-order queue per
device, completion through the queue's events into the device's TimelineSignal.

Completion: one waiter thread per device takes the events in queue order and waits on each (the GIL is released
while it waits), then advances the timeline (`queues.QueuedDevice`). A realize whose work is small asks first
(`poll`): while the loop has nothing else to run it queries the event for about as long as the work took last time,
and advances the timeline itself when it completed, without the waiter thread's wake-up of the loop (PoCL, AMD EPYC:
a 10-op graph on 1024 elements realized in 82-86 us instead of 123-129, scalars still passed as bytes). On a CPU
device the query spins on one of the cores the kernels run on, so it stops after `CPU_SPIN_S`. pyopencl's
`Event.set_callback` was the first choice for completion, but it starts an OS thread per callback, which costs more
than the work of a small kernel and races the interpreter's shutdown (a callback thread acquiring the GIL of a
finalizing interpreter aborts the process).

Waits: on a buffer of another OpenCL device of the same context, the event that produced it; on a buffer of
any other device, a user event completed by that device's timeline (`TimelineSignal.on_reach`), so the
wait happens in the OpenCL runtime, never on the event loop.

Submission: one submit thread per device makes the OpenCL calls that queue work (as wgpu's queue thread): the loop's
thread only numbers the command and hands it over. A driver may block in them: PoCL's clEnqueue* wait while its own
thread compiles a new kernel's work-group function (a read-back's enqueue on the loop waited 200-370 ms beside 200
requests' new kernels, beside two busy processes). Where it cannot (every launch of a command queued before, and no
command with a first launch still running) and the submit thread is idle, the caller queues it itself (`_command`:
a small realize 200-260 us -> ~100 without the hand-over).

Replay: a steady batch (device.Replay) is a `_Record`: the loop's thread hands its run's buffers, arena and packed
words to the submit thread as one command, which sets the kernels' arguments (each kind in one C call; the tuples
rebuilt only when the run's buffers or words differ from the last) and queues them in one loop of pyopencl's C
enqueue. The batch's temporaries are sub-buffers of one arena block per run.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import numpy as np

from azyx import debug
from azyx.codegen.dialect import OPENCL
from azyx.codegen.templates import gemm_host
from azyx.device import (
    ARENA_ALIGN,
    CPU_SPIN_S,
    Buffer,
    Contexts,
    Device,
    LaunchItem,
    Replay,
    after_waits,
)
from azyx.dtypes import DType, scalar_size
from azyx.errors import DeviceError
from azyx.plan import KernelStep
from azyx.queues import CommandGathers
from azyx.workers import at_lower_priority, python_lane

# spin_us: how long a realize may query its work's completion on an idle loop before it sleeps (realize.wait_for)
CONFIG = {"enabled": True, "platform_ids": [], "spin_us": 20, "gather": True}

try:
    import pyopencl as cl
    from pyopencl import _cl  # (the C calls that cl.enqueue_copy picks among in ~20 us of Python on the loop)
except ImportError as e:  # the runtime skips this backend (AZYX_DEBUG=1 says why)
    raise ImportError(f"pyopencl is not installed: {e}") from None

_CONTEXTS = Contexts()  # platform index -> context shared by that platform's devices
# a scalar argument's bits, by its size: the unsigned C type pyopencl packs them as (`_set_arg_buf_pack_multi`; its
# types stop at C's long: 8 bytes where it is that long, else packed here)
ARENA_BLOCKS = 4  # arena blocks whose sub-buffers a frozen batch keeps (`_Record`)
_PACKS = {1: b"B", 2: b"H", 4: b"I", 8: b"L" if struct.calcsize("L") == 8 else None}


@functools.cache
def _scalars(dts: tuple[DType, ...], first: int) -> tuple[tuple[int, bytes | None, int], ...]:
    """Per scalar argument (after `first` buffers): its index, its pack type and the low bits of its word that it
    takes (as many as its size)."""
    return tuple((first + j, _PACKS[scalar_size(d)], (1 << 8 * scalar_size(d)) - 1) for j, d in enumerate(dts))


def _words(step: KernelStep, first: int, words: Sequence[int]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """A kernel's scalar arguments by value, for `_set_arg_buf_pack_multi` and `_set_arg_buf_multi` (flat index, type,
    value): each word's low bytes, as many as the argument's type has, packed by pyopencl as the unsigned integer of
    its size (about a microsecond; as raw bytes its generic path took ~30), or here where pyopencl has no such type."""
    codes = list(zip(_scalars(step.scalar_dtypes, first), words))
    return (tuple(x for (i, pack, mask), w in codes if pack is not None for x in (i, pack, int(w) & mask)),
            tuple(x for (i, pack, mask), w in codes if pack is None for x in (i, struct.pack("=Q", int(w) & mask))))


def _set_args(knl: Any, mems: tuple[Any, ...], word_args: tuple[tuple[Any, ...], tuple[Any, ...]]) -> None:
    """A kernel's every argument set: its buffers (flat (index, buffer) pairs) and its scalars (`_words`)."""
    scalars, packed = word_args
    knl._set_arg_multi(mems)
    if scalars:
        knl._set_arg_buf_pack_multi(scalars)
    if packed:
        knl._set_arg_buf_multi(packed)


class _Record:
    """A frozen batch (device.Replay) as OpenCL queues it, used on the submit thread alone: per kernel its cl.Kernel,
    sizes, where its buffers are among the run's (the bound slots, then the temporaries in the arena) and where its
    words are among the batch's; the argument tuples of the last run's buffers and words, rebuilt only when a run's
    differ. (pyopencl keeps one cl.Kernel per kernel name, shared by every plan and by a batch's repeated kernels, so
    each launch sets all its arguments, each kind in one C call; a kernel object of the record's own costs ~150 us of
    Python to make on PoCL.) The temporaries are sub-buffers of the run's arena, made once per arena block for the
    last ARENA_BLOCKS blocks (a steady loop's runs take the same few blocks from the pool again; each kept block's
    memory stays held until it is dropped from here)."""

    __slots__ = ("launches", "mem_at", "word_at", "steps", "regions", "subs", "mems", "mem_args", "words", "word_args")

    def __init__(self, replay: Replay, programs: dict[str, Any]):
        temps = list(replay.extents)
        index = {s: i for i, s in enumerate([*replay.bound, *temps])}
        self.regions = list(replay.extents.values())  # (temporaries apart in time may share room: arena_of)
        self.subs: dict[Any, tuple[Any, ...]] = {}  # arena block's cl.Buffer -> its temporaries' sub-buffers
        self.steps = replay.batch.steps
        self.launches = [(programs[k.name], (k.launch.items,), (k.launch.group,)) for k in self.steps]
        self.mem_at = [[index[s] for s in k.args] for k in self.steps]
        ends = np.cumsum([0, *replay.word_counts]).tolist()
        self.word_at = list(zip(ends, ends[1:]))
        self.mems: tuple[Any, ...] | None = None
        self.mem_args: list[tuple[Any, ...]] = []
        self.words: Any = None
        self.word_args: list[tuple[tuple[Any, ...], tuple[Any, ...]]] = []

    def temporaries(self, arena: Buffer | None) -> tuple[Any, ...]:
        """The sub-buffers of `arena` where the batch's temporaries live (made once per arena block)."""
        if arena is None:
            return ()
        subs = self.subs.get(arena.mem)
        if subs is None:
            if len(self.subs) >= ARENA_BLOCKS:
                del self.subs[next(iter(self.subs))]
            subs = self.subs[arena.mem] = tuple(arena.mem.get_sub_region(at, n) for at, n in self.regions)
        return subs

    def enqueue(self, queue: Any, bound: tuple[Buffer, ...], arena: Buffer | None, words: np.ndarray,
                wait_for: list[Any] | None) -> Any:
        """(The submit thread.) Every kernel bound and queued in one loop, the first after `wait_for` (the queue is in
        order); returns the last one's event."""
        mems = (*(b.mem for b in bound), *self.temporaries(arena))
        if mems != self.mems:  # (by identity first: a pool's blocks come back as the same objects)
            self.mems = mems
            self.mem_args = [tuple(x for i, s in enumerate(at) for x in (i, mems[s])) for at in self.mem_at]
        if words is not self.words:
            self.words = words
            values = words.tolist()
            self.word_args = [_words(k, len(k.args), values[a:b]) for k, (a, b) in zip(self.steps, self.word_at)]
        return _enqueue(queue, zip(self.launches, self.mem_args, self.word_args), wait_for)


def _enqueue(queue: Any, launches: Iterable[Any], wait_for: list[Any] | None) -> Any:
    """(The submit thread.) Kernels ((cl.Kernel, global size, local size), buffer arguments, `_words`) bound and queued
    in one loop, the first after `wait_for` (the queue is in order); returns the last one's event."""
    ev, enqueue = None, _cl.enqueue_nd_range_kernel
    for (knl, glob, local), mem_args, word_args in launches:
        _set_args(knl, mem_args, word_args)
        ev = enqueue(queue, knl, glob, local, None, wait_for)
        wait_for = None
    return ev


def _in_order(runs: list[Callable[[list[Any] | None], Any]], events: list[Any], wait_for: list[Any] | None) -> Any:
    """(A gather's command) its commands queued in turn, the first after `wait_for`, each one's event kept in `events`
    (held until the gather's command completed: pyopencl's event of a read, dropped before its read is done, waits for
    it holding the GIL, which the work queued before it may need); returns the last one's event."""
    ev = None
    for run in runs:
        ev = run(wait_for)
        events.append(ev)
        wait_for = None
    return ev


def device_list(options: dict[str, Any]) -> list[tuple[int, Any]]:
    """(platform index, cl.Device) for every device of the configured platforms (all when none are named)."""
    try:
        platforms = cl.get_platforms()
    except cl.Error as e:
        raise DeviceError(f"no OpenCL platform: {e}") from None
    wanted = options.get("platform_ids") or list(range(len(platforms)))
    # (a CPU platform starts the threads that run its kernels with its devices: below the loop's priority)
    return [(p, d) for p in wanted if p < len(platforms) for d in at_lower_priority(platforms[p].get_devices)]


class OpenCLDevice(CommandGathers):
    kind = "opencl"
    dialect = OPENCL
    tiles = True

    @classmethod
    def count(cls, options: dict[str, Any]) -> int:
        return int(options["devices"]) if "devices" in options else len(device_list(options))

    def __init__(self, index: int, options: dict[str, Any]):
        super().__init__(index, options)
        devices = device_list(options)
        if index >= len(devices):
            raise DeviceError(f"no OpenCL device {index} (found {len(devices)})")
        plat, self.cl_device = devices[index]
        self.ctx = _CONTEXTS.take(plat, lambda: cl.Context([d for p, d in devices if p == plat]))
        self.cl_queue = cl.CommandQueue(self.ctx, self.cl_device)
        self.mem.open_pool(options, self.cl_device.global_mem_size * 3 // 4,
                           lambda size: cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, size), 1 / 4)
        self.compute = float(self.cl_device.max_compute_units * 25)  # rough GFLOP/s, for AUTO placement
        if self.cl_device.type & cl.device_type.CPU:  # (PoCL) matrix products by a CPU-style template
            width = 4 * int(self.cl_device.native_vector_width_float)
            self.dialect = dataclasses.replace(OPENCL, gemm=True, simd=width if width in (16, 32, 64) else 16)
            self.spin_cap = CPU_SPIN_S
        self.max_local = int(self.cl_device.max_work_group_size)
        # a steady batch's temporaries as sub-buffers of one allocation, where their offsets suit a sub-buffer's origin
        self.arena = int(self.cl_device.mem_base_addr_align) // 8 <= ARENA_ALIGN
        if self.max_local < OPENCL.group_size:
            raise DeviceError(f"{self.name}: work groups of {self.max_local} items are too small for grouped reduces")
        # the launches queued so far ((kernel, global, local) sizes), and the last command that queued a new one:
        # PoCL compiles a work-group function for a launch's first runs, and its clEnqueue* block meanwhile
        self.launched: set[tuple[str, int, int]] = set()
        self.fresh_v = 0
        # (a gather's commands, `gathered`, each queues its pyopencl commands); their launches
        self.gathered_keys: list[tuple[str, int, int]] = []
        self.queue.start()
        debug.log(debug.DEVICES, f"{self.name}: {self.cl_device.name} ({self.cl_device.platform.name})")

    def identity(self) -> dict[str, Any]:
        d = self.cl_device
        return {**super().identity(), "platform": f"{d.platform.name} {d.platform.version}", "device": d.name,
                "driver": d.driver_version, "version": d.version, "units": int(d.max_compute_units),
                "gemm": gemm_host.VERSION if self.dialect.gemm else None}

    # ------------------------------------------------------------------ compile and launch
    def build(self, src: str, steps: list[KernelStep]) -> dict[str, Any]:
        """Build and fetch the kernels (once: prg.name on each launch is slow), on a worker thread. pyopencl makes
        each new kernel's Python invoker (generated source, compiled, kept in a database: ~1 ms of Python holding the
        GIL) then: in workers' Python lane, in turn with the graphs being planned (two workers making invokers at once
        beside two busy processes held the loop's thread off the GIL ~35 ms); launches set the arguments themselves
        (`launch`), so no invoker for the scalars' types is made. (pyopencl caches built binaries on disk.)"""
        names = [s.name for s in steps]
        try:
            program = cl.Program(self.ctx, src).build(options=["-cl-std=CL1.2"])
        except cl.Error as e:
            raise self.builder.failed("OpenCL build", names, e, src) from None
        with python_lane():
            return {s.name: cl.Kernel(program, s.name) for s in steps}

    def submit(self, enqueue: Callable[[list[Any] | None], Any], waits: list[tuple[Device, int]], v: int) -> Any:
        """(The submit thread.) The command queued after its waits: the native ones as events, the rest as one user
        event that their devices' timelines complete."""
        wait_for, host = self.queue.native_waits(waits)
        if host:
            uev = cl.UserEvent(self.ctx)
            after_waits(host, partial(uev.set_status, cl.command_execution_status.COMPLETE))
            wait_for.append(uev)
        ev = enqueue(wait_for or None)  # (not under the lock: PoCL's enqueue may block; the loop's enqueue takes it)
        with self.queue.lock:
            self.queue.events[v] = ev
        return ev

    def query(self, v: int) -> Callable[[], bool] | None:
        """The command's event: complete (CL_COMPLETE is 0; queued, submitted, running above). A failed one (below)
        is left to the waiter thread, which records the failure before the timeline moves."""
        ev = self.queue.events.get(v)
        return None if ev is None else lambda: ev.command_execution_status == 0

    def wait_event(self, ev: Any, v: int) -> bool:
        if ev is None:  # (it could not be queued: its failure is recorded)
            return False
        ev.wait()  # (a cl.Error: the command failed, recorded by the waiter thread)
        return True

    def launch_many(self, items: list[LaunchItem], waits: list[tuple[Device, int]], batch: Any = None) -> int:
        """The kernels as one command (one event), bound and queued in one loop (`_enqueue`, where `_command` says; a
        kernel returns early past its global size)."""
        launches = [((self.programs[s.name], (s.launch.items,), (s.launch.group,)),
                     tuple(x for i, b in enumerate(bufs) for x in (i, b.mem)),  # (index, buffer) pairs, flat
                     _words(s, len(bufs), w) if w else ((), ())) for s, bufs, w in items]
        keys = [(s.name, s.launch.items, s.launch.group) for s, _, _ in items]
        return self._command(partial(_enqueue, self.cl_queue, launches), waits, items, keys)

    def _command(self, run: Callable[[list[Any] | None], Any], waits: list[tuple[Device, int]], keep: Any,
                 keys: Sequence[tuple[str, int, int]] = ()) -> int:
        """Queue command `run` (its launches `keys`), on the calling thread where PoCL cannot block it, else on the
        submit thread (`EventQueue.enqueue`'s `inline`): PoCL's enqueue blocks the caller while its own thread compiles
        a launch's work-group function (200-370 ms of the loop's thread beside two busy processes), which it does for
        a launch's first runs. So: every launch of it queued before, and every command that queued a new one
        complete. In an open gather a command that waits for nothing joins it (its value reserved: the gather's one
        command completes it); one that waits comes after the commands gathered so far."""
        queue = self.queue
        with queue.lock:
            if self.gathered is not None:
                if not waits:
                    self.gathered.append(run)
                    self.gathered_keys += keys
                    return queue.reserve(keep)
                self._flush_gathered()
            return queue.enqueue(run, waits, keep, inline=self._inline(keys))

    def _inline(self, keys: Sequence[tuple[str, int, int]]) -> bool:
        """Under the lock: whether a command of launches `keys` may be queued on the calling thread (`_command`)."""
        if all(k in self.launched for k in keys):
            return self.timeline.value >= self.fresh_v
        self.launched.update(keys)
        self.fresh_v = self.queue.submitted + 1
        return False

    # a gather (CommandGathers) is one command queueing the commands it took, in order, one event
    def _flush_gathered(self) -> None:
        runs, keys = self.gathered, self.gathered_keys
        if runs:
            self.gathered, self.gathered_keys = [], []
            queue = self.queue
            events: list[Any] = []
            first, last = queue.submitted - len(runs) + 1, queue.submitted
            queue.holding[last] = (queue.holding[last], events)
            queue.enqueue(partial(_in_order, runs, events), [], None, inline=self._inline(keys), first=first)

    def freeze(self, replay: Replay) -> bool:
        """A steady batch replays as a `_Record`: the loop's thread hands over the run's buffers, arena and words, the
        submit thread binds and queues every kernel in one loop (one command, one event)."""
        replay.prepared = _Record(replay, self.programs)
        return True

    def launch_replay(self, replay: Replay, bufs: list[Any], arena: Buffer | None, scalars: Sequence[Any],
                      waits: list[tuple[Device, int]]) -> int:
        bound = replay.get(bufs)
        words = replay.words(scalars)
        run = partial(replay.prepared.enqueue, self.cl_queue, bound, arena, words)
        return self._command(run, waits, (arena, bound))  # (a steady batch: its launches ran before)

    # ------------------------------------------------------------------ copies
    def copy(self, src: Buffer, dst: Buffer, n: int, waits: list[tuple[Device, int]]) -> int:
        return self._command(lambda w: _cl._enqueue_copy_buffer(self.cl_queue, src.mem, dst.mem, n, 0, 0, w), waits,
                             (src, dst))

    def copy_to_host(self, buf: Buffer, out: np.ndarray, waits: list[tuple[Device, int]], offset: int = 0) -> int:
        return self._command(lambda w: _cl._enqueue_read_buffer(self.cl_queue, buf.mem, out, offset, w, False), waits,
                             (buf, out))

    def copy_from_host(self, host: np.ndarray, dst: Buffer, waits: list[tuple[Device, int]], keep: Any,
                       offset: int = 0) -> int:
        return self._command(lambda w: _cl._enqueue_write_buffer(self.cl_queue, dst.mem, host, offset, w, False),
                             waits, (keep, dst))

    def drain(self) -> None:
        try:
            self.cl_queue.finish()
        except cl.Error:
            pass
