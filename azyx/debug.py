"""AZYX_DEBUG: a bitmask read once at import; each stage prints to stderr when its bit is set."""

from __future__ import annotations

import asyncio
import bisect
import collections
import os
import platform
import sys
import threading
import time
import types
from collections.abc import Callable

DEVICES, PLANS, LAUNCHES, IR, SOURCE, SEARCH = 1, 2, 4, 8, 16, 32  # SEARCH: what the kernel search tried, won

try:
    LEVEL = int(os.environ.get("AZYX_DEBUG", "0") or 0)
except ValueError:
    LEVEL = 0


def enabled(bit: int) -> bool:
    return bool(LEVEL & bit)


def log(bit: int, msg: str | Callable[[], str]) -> None:
    """Print `msg` (or the result of calling it, built only when enabled) if `bit` is on."""
    if LEVEL & bit:
        text = msg() if callable(msg) else msg
        print(f"azyx: {text}", file=sys.stderr, flush=True)


class LoopStalls:
    """What held an event loop when it was late: a heartbeat task on the loop (a sleep of `period` in a loop) and a
    sampler thread that, whenever the heartbeat has not come back for `late_after` seconds, records the stack of every
    thread (the loop's own, and the workers that may hold the GIL) every `every` seconds. `report()` names the longest
    stall, the stacks seen during it, and (Linux) how the loop's thread spent it: running, waiting for a CPU (the
    machine's load) or asleep (on the GIL, a lock or I/O).

        stalls = LoopStalls()
        async with stalls:          # starts the heartbeat and the sampler
            await work()
        print(stalls.worst_ms, stalls.report())
    """

    def __init__(self, period: float = 1e-3, late_after: float = 4e-3, every: float = 1e-3, depth: int = 8) -> None:
        self.period, self.late_after, self.every, self.depth = period, late_after, every, depth
        self.lateness: list[float] = []  # each wake-up's lateness past `period` (seconds)
        # ... less the time the loop's thread waited, runnable, for a CPU during that beat and the time the hypervisor
        # took a CPU from the machine meanwhile (Linux; elsewhere the same): the lateness the process itself caused
        # (work on the loop, the GIL held by its other threads), not the machine's. (A bare 1 ms heartbeat on a shared
        # 2-vCPU VM, no work at all: 5-25 ms late of its own a few times a minute, each time with 10-60 ms of steal.)
        self.own: list[float] = []
        self.stolen: list[float] = []  # per beat: the most time taken from one CPU by the hypervisor (s, 10 ms steps)
        # per stall the sampler saw (from its last on-time beat to the beat it last saw): the longest time one of the
        # process's other threads waited, runnable, for a CPU during it (one holding the GIL while the machine had no
        # core for it holds the loop's thread asleep on the GIL for as long: the machine's doing, not the process's).
        # It counts for every beat that came back within the stall: a sampler that itself waited for a CPU sees the
        # stall's end beats later than the beat that ended it
        self._others_waited: list[tuple[float, float, float]] = []
        # per stall: how long the loop's thread lay in its selector's wait (epoll_wait, between two samples that saw it
        # there) with the heartbeat's timer due: a wake-up the machine did not deliver (a bare heartbeat on a loaded
        # 2-vCPU VM: 44 ms with the GIL free and the loop not waiting for a CPU), left out like steal
        self._idle: list[float] = []
        self._stall_idle = 0.0
        self._idle_at: float | None = None  # (when a sample last saw it there)
        self._others0: dict[str, int] = {}
        self._wakes: list[float] = []
        self._last = 0.0
        self._running = False
        self._loop_thread = 0
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop_native = 0
        # /proc files read at every beat, kept open and read again with pread: opening one and reading it through a
        # Python file object took ~40-60 us of CPU a beat, 4-6% of a core with a 1 ms heartbeat (a 1 GiB load onto c:0
        # beside it took 0.26-0.33 CPU s instead of 0.20-0.21 without it)
        self._fds: dict[str, int] = {}
        self._stall: list[list[tuple[str, str]]] = []  # the current stall's samples: (thread, stack) per thread
        self._stall_start = 0.0
        self._sched_start = (0.0, 0, 0)
        # the longest stall: its length (s) and samples; from the sampler's last look before it, how long (ns) the
        # loop's thread ran and waited for a CPU, and how long that was (s)
        self.worst: tuple[float, list[list[tuple[str, str]]]] = (0.0, [])
        self.worst_sched: tuple[int, int, float] | None = None
        # every thread of the process (drivers' own too) at the current stall's start, and in the longest stall the
        # busiest: (name, ms on a CPU, ms runnable waiting for one), from its first sample to its end (Linux)
        self._tasks0: dict[str, tuple[str, int, int]] = {}
        self.worst_threads: list[tuple[str, float, float]] = []

    @property
    def worst_ms(self) -> float:
        """The heartbeat's worst lateness, in ms."""
        return max(self.lateness, default=0.0) * 1e3

    @property
    def worst_own_ms(self) -> float:
        """The heartbeat's worst lateness less, in each beat, the time the loop's thread waited for a CPU, the time
        the hypervisor took from a CPU (steal, in 10 ms steps) and, in a stall the sampler saw, the longest time
        another thread of the process waited for a CPU or, where longer, the time the loop's thread lay in its
        selector's wait with its timer due (a machine whose cores are all busy delays any thread's wake-up, and a
        thread that holds the GIL meanwhile holds the loop's thread with it; what is left is what the process's own
        work cost), in ms."""
        own = list(self.own)
        for (start, end, waited), idle in zip(self._others_waited, self._idle):
            lo, hi = bisect.bisect_right(self._wakes, start), bisect.bisect_right(self._wakes, end)
            for k in range(lo, hi):  # (the larger of the two: they may overlap)
                own[k] = max(own[k] - max(waited, idle), 0.0)
        return max(own, default=0.0) * 1e3

    async def __aenter__(self) -> LoopStalls:
        self._loop_thread = threading.get_ident()
        self._loop_native = threading.get_native_id()
        for path in (f"/proc/self/task/{self._loop_native}/schedstat", "/proc/stat"):
            try:
                self._fds[path] = os.open(path, os.O_RDONLY)
            except OSError:  # (not Linux: the counters read 0)
                pass
        self._running = True
        self._last = time.perf_counter()
        self._task = asyncio.get_running_loop().create_task(self._beat())
        self._thread = threading.Thread(target=self._sample, name="azyx-loop-sampler", daemon=True)
        self._thread.start()
        await asyncio.sleep(self.period * 10)
        self.lateness.clear()
        self.own.clear()
        self.stolen.clear()
        self._wakes.clear()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._running = False
        if self._task is not None:
            await self._task
        if self._thread is not None:
            self._thread.join()
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def _proc(self, path: str) -> bytes:
        """The contents of a /proc file opened at the start (`__aenter__`), read again through its descriptor (OSError
        where it could not be opened)."""
        fd = self._fds.get(path)
        if fd is None:
            raise OSError(f"{path} is not open")
        return os.pread(fd, 1 << 16, 0)

    async def _beat(self) -> None:
        waited0, steal0 = self._sched()[1], self._steal()  # (each beat's counters at its end are the next one's start)
        while self._running:
            t0 = time.perf_counter()
            await asyncio.sleep(self.period)
            self._last = now = time.perf_counter()
            late = now - t0 - self.period
            self.lateness.append(late)
            waited, steal = self._sched()[1], self._steal()
            stolen = max((b - a for a, b in zip(steal0, steal)), default=0) * _TICK
            self.stolen.append(stolen)
            self.own.append(max(late - (waited - waited0) * 1e-9 - stolen, 0.0))
            self._wakes.append(now)
            waited0, steal0 = waited, steal

    def _sample(self) -> None:
        on_time = (time.perf_counter(), *self._sched())  # the loop thread's counters when last seen on time
        delay = self.every
        while self._running:
            time.sleep(delay)
            if not self._running:  # (the heartbeat has stopped: no stall begins now)
                break
            now = time.perf_counter()
            since = now - self._last
            delay = self.every
            if since < self.late_after:
                if self._stall:
                    self._end_stall(self._last)
                on_time = (now, *self._sched())
                # (no stall can begin before the last beat is late_after old: woken each `every` meanwhile, the sampler
                # took the GIL and a CPU from the work it watches 1,000 times a second)
                delay = max(self.every, self.late_after - since)
                continue
            if not self._stall:
                self._stall_start = self._last
                self._sched_start = on_time
                self._others0 = self._waits()
                self._tasks0 = _tasks()
                self._stall_idle, self._idle_at = 0.0, None
            frames = sys._current_frames()
            idle = self._loop_idle(frames.get(self._loop_thread))
            if idle and self._idle_at is not None:
                self._stall_idle += now - self._idle_at
            self._idle_at = now if idle else None
            self._stall.append([(self._name(tid), self._stack(f)) for tid, f in frames.items()
                                if tid != threading.get_ident()])
        # a stall that the heartbeat's last beat ended counts; one begun after that beat (the heartbeat stopping) not
        if self._stall and self._last > self._stall_start:
            self._end_stall(self._last)

    def _end_stall(self, end: float) -> None:
        others = self._waits()
        waits = (others[t] - w for t, w in self._others0.items() if t in others)
        self._others_waited.append((self._stall_start, end, max(waits, default=0) * 1e-9))
        self._idle.append(self._stall_idle)
        length = end - self._stall_start
        if length > self.worst[0]:
            self.worst = (length, self._stall)
            at, ran0, waited0 = self._sched_start
            ran, waited = self._sched()
            self.worst_sched = (ran - ran0, waited - waited0, max(end - at, 0.0)) if ran else None
            now = _tasks()
            py = {str(t.native_id): t.name for t in threading.enumerate()}  # (a Python thread's OS name is python's)
            # (a thread started during the stall counts from its start: a driver's start-up thread, `at_lower_priority`)
            busy = [(py.get(tid, name), (r - then[1]) / 1e6, (w - then[2]) / 1e6) for tid, (name, r, w) in now.items()
                    if tid != str(self._loop_native) for then in [self._tasks0.get(tid, (name, 0, 0))]]
            self.worst_threads = sorted(busy, key=lambda b: -b[1])[:4]
        self._stall = []

    def _loop_idle(self, frame: types.FrameType | None) -> bool:
        """Whether the loop's thread is in its selector's wait (asyncio's select, and the kernel's epoll_wait: not
        back from it and waiting for the GIL, which is a futex), by its frame and /proc's syscall (Linux)."""
        if frame is None or frame.f_code.co_name != "select" or frame.f_back is None \
                or frame.f_back.f_code.co_name != "_run_once":
            return False
        try:
            with open(f"/proc/self/task/{self._loop_native}/syscall") as f:
                return int(f.read().split(maxsplit=1)[0]) in _EPOLL_WAITS
        except (OSError, ValueError, IndexError):
            return False

    def _waits(self) -> dict[str, int]:
        """Each other Python thread's time so far runnable and waiting for a CPU, in ns, by its task id (Linux; {}
        elsewhere). Python threads only (those that can hold the GIL; a driver's own threads, lavapipe's, wait for a
        CPU without holding the loop); the loop's thread and the sampler's own left out."""
        skip = {self._loop_native, threading.get_native_id()}
        tasks = [str(t.native_id) for t in threading.enumerate() if t.native_id is not None and t.native_id not in skip]
        out = {}
        for tid in tasks:
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    out[tid] = int(f.read().split()[1])
            except (OSError, ValueError, IndexError):
                continue
        return out

    def _sched(self) -> tuple[int, int]:
        """The loop thread's time on a CPU and runnable waiting for one, in ns so far (Linux; (0, 0) elsewhere)."""
        try:
            ran, waited = self._proc(f"/proc/self/task/{self._loop_native}/schedstat").split()[:2]
            return int(ran), int(waited)
        except (OSError, ValueError):
            return 0, 0

    def _steal(self) -> list[int]:
        """Each CPU's time so far taken by the hypervisor (steal), in /proc/stat's ticks (Linux; [] elsewhere)."""
        try:
            return [int(line.split()[8]) for line in self._proc("/proc/stat").split(b"\n")
                    if line.startswith(b"cpu") and line[3:4].isdigit()]
        except (OSError, ValueError, IndexError):
            return []

    def _name(self, tid: int) -> str:
        if tid == self._loop_thread:
            return "loop"
        for t in threading.enumerate():
            if t.ident == tid:
                return t.name
        return str(tid)

    def _stack(self, frame: types.FrameType | None) -> str:
        lines: list[str] = []
        while frame is not None and len(lines) < self.depth:
            code = frame.f_code
            lines.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}")
            frame = frame.f_back
        return " < ".join(lines)

    def report(self, top: int = 3) -> str:
        """The longest stall (ms, from the last on-time beat) and the stacks seen most often during it, per thread
        (the loop's first); threads idle in a wait are left out."""
        length, samples = self.worst
        unseen = ""
        if self.worst_ms > (length + self.late_after + self.every) * 1e3:
            unseen = (f" (the worst beat, {self.worst_ms:.1f} ms late, was not sampled: the sampler's thread could not "
                      f"run either, without a CPU or the GIL)")
        if not samples:
            return f"no stall longer than {self.late_after * 1e3:.0f} ms was sampled{unseen}"
        seen: collections.Counter[tuple[str, str]] = collections.Counter()
        for sample in samples:
            seen.update(s for s in sample if s[1].split(":")[0] not in _IDLE)
        lines = [f"longest stall sampled {length * 1e3:.1f} ms{unseen}, {len(samples)} samples"]
        if self.worst_sched is not None:  # (waiting for a CPU: the machine's load, not the GIL, which is a sleep)
            ran, waited, window = self.worst_sched
            slept = max(window * 1e3 - (ran + waited) / 1e6, 0.0)
            lines[0] += (f"; in its last {window * 1e3:.1f} ms the loop's thread ran {ran / 1e6:.1f} ms, waited "
                         f"{waited / 1e6:.1f} ms for a CPU, slept {slept:.1f} ms (on the GIL, a lock or I/O)")
        if any(self._idle):
            lines[0] += (f"; {sum(i > 0 for i in self._idle)} stalls had the loop's thread asleep in its selector with "
                         f"its timer due (up to {max(self._idle) * 1e3:.0f} ms, a wake-up the machine did not deliver: "
                         f"left out of the lateness of its own)")
        if any(self.stolen):
            lines[0] += (f"; {sum(s > 0 for s in self.stolen)} beats saw the hypervisor take a CPU (up to "
                         f"{max(self.stolen) * 1e3:.0f} ms, left out of the lateness of its own)")
        if hasattr(os, "getloadavg"):
            lines[0] += f"; load average {os.getloadavg()[0]:.1f}"
        if self.worst_threads:  # (a thread that ran while the loop's thread slept may have held the GIL)
            lines[0] += "; the busiest other threads in it (ms on a CPU / waiting for one): " + ", ".join(
                f"{name} {ran:.1f}/{waited:.1f}" for name, ran, waited in self.worst_threads)
        lines[0] += "; stacks seen (count, thread):"
        loop_first = sorted(seen.most_common(), key=lambda kv: (kv[0][0] != "loop", -kv[1]))
        shown: collections.Counter[str] = collections.Counter()
        for (name, stack), count in loop_first:
            if shown[name] < top:
                shown[name] += 1
                lines.append(f"  {count:3d} {name}: {stack}")
        return "\n".join(lines)


# the kernel's epoll waits by machine (/proc's syscall numbers): x86_64's epoll_wait, epoll_pwait, epoll_pwait2
_EPOLL_WAITS = {"x86_64": {232, 281, 441}, "aarch64": {22, 441}}.get(platform.machine(), set())
_TICK = 1 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)  # /proc/stat's unit (s)


def _tasks() -> dict[str, tuple[str, int, int]]:
    """Every thread of the process (Python's and drivers' own) by task id: its name, and its time so far on a CPU
    and runnable waiting for one, in ns (Linux; {} elsewhere)."""
    out: dict[str, tuple[str, int, int]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ran, waited = f.read().split()[:2]
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            out[tid] = (name, int(ran), int(waited))
        except (OSError, ValueError):
            continue
    return out


# a thread whose innermost frame is one of these is waiting, not working (its wait releases the GIL)
_IDLE = frozenset({"threading.py", "queue.py", "thread.py"})
