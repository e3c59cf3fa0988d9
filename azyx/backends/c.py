"""The C backend: kernels rendered to C99, compiled by the system compiler as an async subprocess, loaded
with ctypes and launched on the device's worker thread.

The kernels a plan runs back to back on the device are one batch: one work item, one call into C (`azyx_run`, built
into every kernel library), the GIL released for all of it. A batch whose turn has come when it is submitted (all
before it on the device's queue done or queued in C, its waits met) goes to the device's runner, a C thread that runs
queued batches in order with no Python, so it starts even while the submitting thread holds the GIL (building the next
step's graph); a thread that waits in C with the GIL released advances the timeline as they complete (`_Runner`).
Other batches run on the device's worker thread. The thread that runs a batch runs its kernels in
order; a kernel that shares a loop (cstyle.parallel_kind SHARED: its loop over [lo, hi) of a range) is split into
parts, and the device's pool of helper threads (threads - 1 of them, in C) takes parts too. Each thread starts with its
own run of parts (a static schedule, so that it keeps to its slice of the data) and then takes what others have left.
Nobody waits for a helper that has not taken a part: a helper that sleeps or lost its core means fewer hands, never a
stall, which keeps a busy machine (or PyTorch's OpenMP team beside ours, which makes OpenMP sleep between regions) from
costing a wake-up per kernel. Helpers spin for a while between batches and sleep after that, or at once when they lose
their core; one woken onto the worker's core moves off it (its CPU affinity then excludes that core).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from azyx import debug
from azyx.backends.host import HostDevice
from azyx.config import cache_dir
from azyx.cstyle import SHARED, C, kernel_source
from azyx.device import BatchState, LaunchItem, kernel_list
from azyx.errors import CompileError, DeviceError
from azyx.ir import scalar_args
from azyx.plan import KernelStep
from azyx.timeline import TimelineSignal
from azyx.workers import in_worker_thread

# kernel name -> (address of its `name_argv` entry, its cstyle.parallel_kind); shared by every C device (same compiler)
_PROGRAMS: dict[str, tuple[int, int]] = {}
_LIBS: list[ctypes.CDLL] = []
_RUNTIME_LIB: list[ctypes.CDLL] = []  # the first library loaded: its azyx_run and pool (every library has them)

_RUNTIME = r"""
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

typedef void (*azyx_kernel)(long lo, long hi, void** args);

static inline void azyx_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

static long azyx_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void azyx_sleep_while(int* word, int value) {  /* until *word changes (or a spurious wake-up) */
#if defined(__linux__)
  syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
#else
  (void)word; (void)value; sched_yield();
#endif
}

static void azyx_wake_all(int* word) {
#if defined(__linux__)
  syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, 1 << 30, NULL, NULL, 0);
#else
  (void)word;
#endif
}

/* Wait until *word != value: spin for up to `ns` (a thread that sleeps costs a wake-up, tens of microseconds on a VM),
   then sleep; sleep at once when the spinning thread lost its core for a while (another thread wants it: spinning on
   would only take time from that thread). */
static void azyx_wait_change(int* word, int value, long ns, int* sleepers) {
  long t0 = azyx_ns(), last = t0;
  for (long spins = 1; __atomic_load_n(word, __ATOMIC_ACQUIRE) == value; spins++) {
    azyx_pause();
    if (spins % 256 != 0) continue;
    long now = azyx_ns(), gap = now - last;
    last = now;
    if (now - t0 > ns || gap > 100000L) {
      __atomic_add_fetch(sleepers, 1, __ATOMIC_SEQ_CST);
      while (__atomic_load_n(word, __ATOMIC_SEQ_CST) == value) azyx_sleep_while(word, value);
      __atomic_sub_fetch(sleepers, 1, __ATOMIC_SEQ_CST);
      return;
    }
  }
}

/* One batch: the thread that called azyx_run runs its kernels in order; the pool's threads help with the parts of
   shared kernels while they are awake. Each thread has its own run of a loop's parts (thread t the t-th of T equal
   runs, like a static schedule: a thread keeps to the same slice of the data from kernel to kernel) and, once done,
   takes parts from the far end of the others' runs. Nobody waits for a helper that has not taken a part, so a helper
   that sleeps or lost its core only means fewer hands, never a stall. */
typedef struct {
  long n, threads;
  azyx_kernel* fns;  /* copies of the caller's tables: a helper may still look at them after azyx_run returned */
  void*** args;
  unsigned char* kinds;
  long *trip, *step, *parts, *done;  /* per kernel: loop trip count, part length, parts, parts done */
  unsigned long* runs;  /* per kernel and thread, a cache line apart: its run of parts [first, end) as first|end<<32 */
  int published;  /* kernels [0, published) are open to helpers (all before them are done); a futex word */
  int finished;
  int sleepers;
  int refs;       /* the caller and the helpers inside; the last one out frees it (under the pool lock) */
  int cpu;        /* where the caller runs */
} azyx_job;

typedef struct azyx_pool azyx_pool;
typedef struct { azyx_pool* pool; long id; } azyx_helper_arg;

/* A batch handed to the runner (azyx_submit): the caller keeps the tables alive until it has completed. */
typedef struct azyx_batch {
  struct azyx_batch* next;
  long n;
  azyx_kernel* fns;
  void** ptrs;
  const long* argc;
  const unsigned char* kinds;
  const long* trip;
} azyx_batch;

struct azyx_pool {
  pthread_mutex_t lock;
  azyx_job* job;  /* the batch running now, NULL between batches */
  int epoch;      /* a futex word: one more for every batch */
  int sleepers, stop, nthreads, started;
  azyx_helper_arg ids[63];
#if defined(__linux__)
  cpu_set_t cpus; /* where the pool's threads may run */
#endif
  pthread_t threads[63];
  /* the runner: a thread of its own (no Python) that runs submitted batches in order */
  azyx_batch *head, *tail;  /* under lock */
  int submitted;            /* a futex word: one more for every batch submitted */
  int runner_sleeping, runner_started, runner_stop, runner_exited;
  long completed;           /* batches the runner has run */
  int events;               /* a futex word: one more for every completion, and when the runner exits */
  int done_waiters;
  pthread_t runner;
};

static void azyx_release(azyx_pool* p, azyx_job* job) {
  pthread_mutex_lock(&p->lock);
  int last = --job->refs == 0;
  pthread_mutex_unlock(&p->lock);
  if (last) free(job);
}

/* Take a part of kernel k from run r: its first part (own == 1) or its last; -1 when the run is empty. */
static long azyx_take(azyx_job* job, long k, long r, int own) {
  unsigned long* run = &job->runs[(k * job->threads + r) * 8];
  unsigned long v = __atomic_load_n(run, __ATOMIC_RELAXED);
  for (;;) {
    unsigned long first = v & 0xffffffffUL, end = v >> 32;
    if (first >= end) return -1;
    unsigned long next = own ? (first + 1) | end << 32 : first | (end - 1) << 32;
    if (__atomic_compare_exchange_n(run, &v, next, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
      return (long)(own ? first : end - 1);
  }
}

static void azyx_work(azyx_job* job, long k, long me) {  /* parts of shared kernel k: its own run, then the others' */
  for (long i = 0; i < job->threads; i++) {
    long r = (me + i) % job->threads;
    for (long part; (part = azyx_take(job, k, r, i == 0)) >= 0;) {
      long lo = part * job->step[k], hi = lo + job->step[k] < job->trip[k] ? lo + job->step[k] : job->trip[k];
      job->fns[k](lo, hi, job->args[k]);
      __atomic_add_fetch(&job->done[k], 1, __ATOMIC_RELEASE);
    }
  }
}

/* A helper woken on the caller's core would only take turns with it: move it to the others (the scheduler tends to
   wake a thread where its waker runs, and a helper that sleeps between batches is woken anew for each). */
static void azyx_move_off(azyx_pool* p, int cpu) {
#if defined(__linux__)
  if (cpu < 0 || sched_getcpu() != cpu || !CPU_ISSET(cpu, &p->cpus) || CPU_COUNT(&p->cpus) < 2) return;
  cpu_set_t others = p->cpus;
  CPU_CLR(cpu, &others);
  sched_setaffinity(0, sizeof(others), &others);
#else
  (void)p; (void)cpu;
#endif
}

static void* azyx_helper(void* arg) {
  azyx_pool* p = ((azyx_helper_arg*)arg)->pool;
  long me = ((azyx_helper_arg*)arg)->id;
  int seen = __atomic_load_n(&p->epoch, __ATOMIC_ACQUIRE);
  for (;;) {
    azyx_wait_change(&p->epoch, seen, 1000000L, &p->sleepers);  /* between batches */
    seen = __atomic_load_n(&p->epoch, __ATOMIC_ACQUIRE);
    if (__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE)) return NULL;
    pthread_mutex_lock(&p->lock);
    azyx_job* job = p->job;
    if (job) job->refs++;
    pthread_mutex_unlock(&p->lock);
    if (!job) continue;
    azyx_move_off(p, job->cpu);
    for (long k = 0; k < job->n;) {
      int open = __atomic_load_n(&job->published, __ATOMIC_ACQUIRE);
      if (k < open) {
        if (job->kinds[k] == 1 && me < job->threads) azyx_work(job, k, me);
        k++;
      } else if (__atomic_load_n(&job->finished, __ATOMIC_ACQUIRE)) {
        break;
      } else {
        azyx_wait_change(&job->published, open, 100000L, &job->sleepers);  /* the caller runs a serial kernel */
      }
    }
    azyx_release(p, job);
  }
}

void* azyx_pool_new(int threads) {
  azyx_pool* p = (azyx_pool*)calloc(1, sizeof(azyx_pool));
  pthread_mutex_init(&p->lock, NULL);
  p->nthreads = threads < 1 ? 1 : (threads > 64 ? 64 : threads);
#if defined(__linux__)
  if (sched_getaffinity(0, sizeof(p->cpus), &p->cpus) != 0) CPU_ZERO(&p->cpus);
#endif
  return p;
}

void azyx_run(void* pool, long n, azyx_kernel* fns, void** ptrs, const long* argc, const unsigned char* kinds,
              const long* trip);

/* The runner: takes submitted batches in order and runs each like azyx_run, with no Python (and so no GIL) between
   them; it spins a while for the next batch, then sleeps. It leaves once told to stop and nothing is left. */
static void* azyx_runner(void* arg) {
  azyx_pool* p = (azyx_pool*)arg;
#if defined(__linux__)
  setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 10);  /* like the device's worker (the helpers inherit it) */
#endif
  for (;;) {
    pthread_mutex_lock(&p->lock);
    azyx_batch* b = p->head;
    if (b && !(p->head = b->next)) p->tail = NULL;
    int seen = __atomic_load_n(&p->submitted, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&p->lock);
    if (!b) {
      if (__atomic_load_n(&p->runner_stop, __ATOMIC_ACQUIRE)) break;
      azyx_wait_change(&p->submitted, seen, 200000L, &p->runner_sleeping);
      continue;
    }
    azyx_run(p, b->n, b->fns, b->ptrs, b->argc, b->kinds, b->trip);
    free(b);
    __atomic_add_fetch(&p->completed, 1, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&p->events, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&p->done_waiters, __ATOMIC_SEQ_CST)) azyx_wake_all(&p->events);
  }
  __atomic_store_n(&p->runner_exited, 1, __ATOMIC_SEQ_CST);
  __atomic_add_fetch(&p->events, 1, __ATOMIC_SEQ_CST);
  azyx_wake_all(&p->events);
  return NULL;
}

/* Queue a batch for the runner and return at once; its tables must live until azyx_wait_done has counted it. */
void azyx_submit(void* pool, long n, azyx_kernel* fns, void** ptrs, const long* argc, const unsigned char* kinds,
                 const long* trip) {
  azyx_pool* p = (azyx_pool*)pool;
  azyx_batch* b = (azyx_batch*)malloc(sizeof(azyx_batch));
  b->next = NULL, b->n = n, b->fns = fns, b->ptrs = ptrs, b->argc = argc, b->kinds = kinds, b->trip = trip;
  pthread_mutex_lock(&p->lock);
  if (p->tail) p->tail->next = b; else p->head = b;
  p->tail = b;
  __atomic_add_fetch(&p->submitted, 1, __ATOMIC_SEQ_CST);
  if (!p->runner_started && pthread_create(&p->runner, NULL, azyx_runner, p) == 0) p->runner_started = 1;
  pthread_mutex_unlock(&p->lock);
  if (__atomic_load_n(&p->runner_sleeping, __ATOMIC_SEQ_CST)) azyx_wake_all(&p->submitted);
}

/* Block until the runner has completed more than `seen` batches: returns how many it has, or -1 once it has exited
   with no more (it spins briefly, then sleeps on a futex: call it with the GIL released). */
long azyx_wait_done(void* pool, long seen) {
  azyx_pool* p = (azyx_pool*)pool;
  for (;;) {
    int ev = __atomic_load_n(&p->events, __ATOMIC_SEQ_CST);
    long done = __atomic_load_n(&p->completed, __ATOMIC_SEQ_CST);
    if (done != seen) return done;
    if (__atomic_load_n(&p->runner_exited, __ATOMIC_SEQ_CST)) return -1;
    azyx_wait_change(&p->events, ev, 20000L, &p->done_waiters);
  }
}

/* Let the runner finish what was submitted and leave; returns once it has (the pool itself stays). */
void azyx_runner_stop(void* pool) {
  azyx_pool* p = (azyx_pool*)pool;
  pthread_mutex_lock(&p->lock);
  int started = p->runner_started;
  __atomic_store_n(&p->runner_stop, 1, __ATOMIC_SEQ_CST);
  pthread_mutex_unlock(&p->lock);
  if (!started) {
    __atomic_store_n(&p->runner_exited, 1, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&p->events, 1, __ATOMIC_SEQ_CST);
    azyx_wake_all(&p->events);
    return;
  }
  __atomic_add_fetch(&p->submitted, 1, __ATOMIC_SEQ_CST);  /* wakes a sleeping runner (it finds nothing new) */
  azyx_wake_all(&p->submitted);
  pthread_join(p->runner, NULL);
  p->runner_started = 0;
}

void azyx_pool_free(void* pool) {
  azyx_pool* p = (azyx_pool*)pool;
  azyx_runner_stop(p);
  __atomic_store_n(&p->stop, 1, __ATOMIC_RELEASE);
  __atomic_add_fetch(&p->epoch, 1, __ATOMIC_SEQ_CST);
  azyx_wake_all(&p->epoch);
  for (int i = 0; i < p->started; i++) pthread_join(p->threads[i], NULL);
  pthread_mutex_destroy(&p->lock);
  free(p);
}

/* Run n kernels in order on the calling thread, the pool helping with shared ones. kinds: 0 serial (one call), 1 shared
   (called for parts of its shared loop, trip[k] iterations), 2 opens its own OpenMP region (one call). Kernel k's
   buffers are argc[k] entries of ptrs, right after kernel k-1's. */
void azyx_run(void* pool, long n, azyx_kernel* fns, void** ptrs, const long* argc, const unsigned char* kinds,
              const long* trip) {
  azyx_pool* p = (azyx_pool*)pool;
  long shared = 0;
  for (long k = 0; k < n; k++) shared += kinds[k] == 1;
  if (!shared || p->nthreads < 2) {
    for (long k = 0; k < n; ptrs += argc[k], k++) fns[k](0, trip[k], ptrs);
    return;
  }
  if (!p->started)  /* the helpers start with the first batch, from the device's worker (they inherit its priority) */
    for (; p->started < p->nthreads - 1; p->started++) {
      p->ids[p->started].pool = p, p->ids[p->started].id = p->started + 1;
      if (pthread_create(&p->threads[p->started], NULL, azyx_helper, &p->ids[p->started]) != 0) break;
    }
  long nt = p->started + 1;
  size_t size = (sizeof(azyx_job) + n * ((4 + 8 * nt) * sizeof(long) + 2 * sizeof(void*) + 1) + 63) / 64 * 64;
  azyx_job* job = (azyx_job*)aligned_alloc(64, size);  /* (its runs a cache line apart) */
  memset(job, 0, size);
  long* tables = (long*)(job + 1);
  job->n = n, job->threads = nt, job->refs = 1;
  job->trip = tables, job->step = tables + n, job->parts = tables + 2 * n, job->done = tables + 3 * n;
  job->runs = (unsigned long*)(tables + 4 * n);
  job->fns = (azyx_kernel*)(tables + (4 + 8 * nt) * n);
  job->args = (void***)(job->fns + n);
  job->kinds = (unsigned char*)(job->args + n);
  memcpy(job->fns, fns, n * sizeof(void*));
  for (long k = 0, at = 0; k < n; at += argc[k], k++) job->args[k] = ptrs + at;
  memcpy(job->kinds, kinds, n);
#if defined(__linux__)
  job->cpu = sched_getcpu();
#else
  job->cpu = -1;
#endif
  long most = 4L * nt;  /* parts per loop: a few per thread, so that whoever is free can take over the rest */
  for (long k = 0; k < n; k++) {
    long t = trip[k] > 0 ? trip[k] : 0, parts = t < most ? t : most;
    job->trip[k] = t;
    job->step[k] = parts ? (t + parts - 1) / parts : 0;
    job->parts[k] = parts = job->step[k] ? (t + job->step[k] - 1) / job->step[k] : 0;
    for (long r = 0; r < nt; r++)
      job->runs[(k * nt + r) * 8] = (unsigned long)(parts * r / nt) | (unsigned long)(parts * (r + 1) / nt) << 32;
  }
  pthread_mutex_lock(&p->lock);
  p->job = job;
  pthread_mutex_unlock(&p->lock);
  __atomic_add_fetch(&p->epoch, 1, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&p->sleepers, __ATOMIC_SEQ_CST)) azyx_wake_all(&p->epoch);
  for (long k = 0; k < n; k++) {
    if (job->kinds[k] != 1) {
      fns[k](0, trip[k], job->args[k]);
      continue;
    }
    __atomic_store_n(&job->published, (int)(k + 1), __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&job->sleepers, __ATOMIC_SEQ_CST)) azyx_wake_all(&job->published);
    azyx_work(job, k, 0);
    long t0 = 0;  /* parts still in helpers' hands: spin, yielding once it takes long (a helper lost its core) */
    for (long spins = 1; __atomic_load_n(&job->done[k], __ATOMIC_ACQUIRE) < job->parts[k]; spins++) {
      if (spins == 1) t0 = azyx_ns();
      if (spins % 256 == 0 && azyx_ns() - t0 > 50000L) sched_yield(); else azyx_pause();
    }
  }
  __atomic_store_n(&job->finished, 1, __ATOMIC_SEQ_CST);
  __atomic_store_n(&job->published, (int)n + 1, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&job->sleepers, __ATOMIC_SEQ_CST)) azyx_wake_all(&job->published);
  pthread_mutex_lock(&p->lock);
  p->job = NULL;
  pthread_mutex_unlock(&p->lock);
  azyx_release(p, job);
}
"""


def _entries(arity: dict[str, int], kinds: dict[str, int], scalars: dict[str, list[str]]) -> str:
    """`name_argv(lo, hi, args)`: every kernel callable the same way, its buffers and then pointers to its scalar
    arguments as one array (what azyx_run calls); lo and hi bound the shared loop of a SHARED kernel, the others
    ignore them."""
    out = []
    for name, n in arity.items():
        bufs = ", ".join([f"a[{i}]" for i in range(n)] +
                         [f"*({t}*)a[{n + i}]" for i, t in enumerate(scalars[name])])
        call = f"{name}(lo, hi, {bufs})" if kinds[name] == SHARED else f"(void)lo; (void)hi; {name}({bufs})"
        out.append(f"void {name}_argv(long lo, long hi, void** a) {{ {call}; }}")
    return "\n".join(out)


class CDevice(HostDevice):
    kind = "c"
    dialect = C
    tiles = True

    def __init__(self, index: int, options: dict[str, Any]):
        super().__init__(index, options)
        self.compiler = options.get("compiler", "gcc")
        if shutil.which(self.compiler) is None:
            raise DeviceError(f"C compiler {self.compiler!r} not found on PATH")
        self.flags = list(options.get("flags", []))
        self.threads = int(options.get("threads") or os.cpu_count() or 1)
        self.compute = 30.0 * self.threads  # rough GFLOP/s, for AUTO placement
        self.pool: int | None = None  # the C thread pool that shares kernels' loops (azyx_pool_new)
        self.serial_pool: int | None = None  # a pool of one thread (the caller): small batches run serially
        os.environ.setdefault("OMP_NUM_THREADS", str(self.threads))  # for kernels with a region of their own

    def has_program(self, name: str) -> bool:
        return name in _PROGRAMS

    async def compile(self, steps: list[KernelStep]) -> None:
        todo = {s.name: s for s in steps if s.name not in _PROGRAMS}
        if not todo:
            return
        arity = {name: len(s.args) for name, s in todo.items()}
        kinds = {name: s.launch.parallel for name, s in todo.items()}
        scalars = {name: [C.compute_type(v.dtype) for v in scalar_args(s.kernel)] for name, s in todo.items()}
        src = kernel_source([s.src for s in todo.values()], C)  # once each
        debug.log(debug.SOURCE, lambda: f"C source for {', '.join(todo)}:\n{src}")
        src = "#define _GNU_SOURCE\n" + src + "\n" + _entries(arity, kinds, scalars) + "\n" + _RUNTIME  # (sched_getcpu)
        # build (or find in the disk cache) and load on a worker thread: the loop only waits; a cancelled realize
        # stops waiting while the build still finishes into the cache
        entries = await in_worker_thread(self._build_and_load, src, arity)  # (limited there: _run_compiler)
        _PROGRAMS.update({name: (address, kinds[name]) for name, address in entries.items()})

    def _build_and_load(self, src: str, arity: dict[str, int]) -> dict[str, int]:
        flags = [*self.flags, "-shared", "-fPIC", "-std=gnu11"]
        key = hashlib.sha256((src + "\0" + self.compiler + " ".join(flags)).encode()).hexdigest()[:24]
        lib_path = cache_dir() / "c" / f"{key}.so"
        if not lib_path.exists():
            lib_path.parent.mkdir(parents=True, exist_ok=True)
            stem = lib_path.with_suffix(f".{os.getpid()}.{threading.get_ident()}")
            c_path, tmp_lib = stem.with_suffix(stem.suffix + ".c"), stem.with_suffix(stem.suffix + ".tmp")
            try:
                c_path.write_text(src)
                self._run_compiler([self.compiler, *flags, str(c_path), "-o", str(tmp_lib), "-lm"], list(arity), src)
                os.replace(tmp_lib, lib_path)  # atomic: a concurrent reader never sees half a library
            finally:
                c_path.unlink(missing_ok=True)
                tmp_lib.unlink(missing_ok=True)
        lib = ctypes.CDLL(str(lib_path))
        _LIBS.append(lib)
        if not _RUNTIME_LIB:
            lib.azyx_run.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_char_p, ctypes.c_void_p]
            lib.azyx_run.restype = None
            lib.azyx_pool_new.argtypes = [ctypes.c_int]
            lib.azyx_pool_new.restype = ctypes.c_void_p
            lib.azyx_pool_free.argtypes = [ctypes.c_void_p]
            lib.azyx_pool_free.restype = None
            lib.azyx_submit.argtypes = lib.azyx_run.argtypes
            lib.azyx_submit.restype = None
            lib.azyx_wait_done.argtypes = [ctypes.c_void_p, ctypes.c_long]
            lib.azyx_wait_done.restype = ctypes.c_long
            lib.azyx_runner_stop.argtypes = [ctypes.c_void_p]
            lib.azyx_runner_stop.restype = None
            _RUNTIME_LIB.append(lib)
        return {name: ctypes.cast(getattr(lib, f"{name}_argv"), ctypes.c_void_p).value or 0 for name in arity}

    def _run_compiler(self, cmd: list[str], names: list[str], src: str) -> None:
        """Run the compiler (worker thread) in a process group of its own, so that at `compile_timeout_s` the whole
        group goes (a driver such as gcc runs cc1 and as as its children); raise CompileError on a timeout or a
        failure, naming the device and the kernels."""
        what = f"{self.name}: {self.compiler} compiling {kernel_list(names)}"
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=self.compile_timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise CompileError(f"{what} took longer than compile_timeout_s={self.compile_timeout_s:g} s; its process "
                               f"group was killed") from None
        finally:
            if proc.poll() is None:  # any other way out (an interrupt): no compiler is left behind
                _kill_group(proc)
        if proc.returncode != 0:
            raise CompileError(f"{what} failed (exit {proc.returncode}):\n{err.decode(errors='replace')}\n"
                               f"--- source ---\n{src}")

    def batch_fn(self, items: list[LaunchItem], batch: BatchState | None = None) -> Callable[[], None]:
        if self.pool is None:  # its helper threads start with the first batch that shares a loop
            self.pool = _RUNTIME_LIB[0].azyx_pool_new(self.threads)
            self.queue.native = _Runner(self.pool, self.timeline, self.name)
        if debug.enabled(debug.LAUNCHES):  # one call per kernel, each timed
            calls = [_Batch([item], _Layout([item[0]]), self.pool) for item in items]

            def timed() -> None:
                for call, (step, _, _) in zip(calls, items):
                    t0 = time.perf_counter()
                    call()
                    debug.log(debug.LAUNCHES, f"{self.name}: {step.name} work={step.work} "
                                              f"{(time.perf_counter() - t0) * 1e6:.1f} us")
            return timed
        layout = batch.prepared if batch is not None else None
        if not isinstance(layout, _Layout):
            layout = _Layout([step for step, _, _ in items])
            if batch is not None:
                batch.prepared = layout
        if layout.work > self.inline_work:
            return _Batch(items, layout, self.pool)
        # small work, which may run inline on the event loop's thread: by that thread alone, never waiting for a
        # helper that took a part and then lost its core to another process (a stall of a scheduler time slice)
        if self.serial_pool is None:
            self.serial_pool = _RUNTIME_LIB[0].azyx_pool_new(1)
        return _Batch(items, layout, self.serial_pool)

    def close(self) -> None:
        worker = self.queue.thread
        super().close()
        runner = self.queue.native
        if isinstance(runner, _Runner):
            runner.close()  # after the worker: it may wait for a batch in the runner's queue
            self.queue.native = None
        if self.pool is not None and (worker is None or not worker.is_alive()):  # nothing runs on the pool any more
            _RUNTIME_LIB[0].azyx_pool_free(self.pool)
            self.pool = None
        if self.serial_pool is not None and (worker is None or not worker.is_alive()):
            _RUNTIME_LIB[0].azyx_pool_free(self.serial_pool)
            self.serial_pool = None


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill a compiler's process group and reap it (its pipes close with the group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    try:
        proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:  # a process that left the group holds the pipes: stop reading them
        proc.kill()
        proc.wait()


class _Layout:
    """What a batch's call into C needs that depends on its kernels alone (entry points, kinds, trip counts, how many
    buffers each takes): made once per plan's batch, so a run only fills in the buffers' addresses."""

    __slots__ = ("n", "fns", "argc", "kinds", "trips", "ptrs_type", "scalars", "scalar_at", "work", "last")

    def __init__(self, steps: list[KernelStep]):
        self.n = len(steps)
        self.work = sum(step.work for step in steps)
        entries = [_PROGRAMS[step.name] for step in steps]
        self.fns = (ctypes.c_void_p * self.n)(*[address for address, _ in entries])
        self.argc = (ctypes.c_long * self.n)(*[len(step.args) + len(step.scalars) for step in steps])
        self.kinds = bytes([kind for _, kind in entries])
        self.trips = (ctypes.c_long * self.n)(*[step.launch.trip for step in steps])
        n_words = sum(len(step.scalars) for step in steps)
        self.ptrs_type = ctypes.c_void_p * (sum(self.argc) + n_words)  # one type per layout, not per run
        self.scalars = n_words > 0  # pointers to scalar arguments follow a kernel's buffers; their values end the table
        self.scalar_at: list[int] = []  # where those pointers are
        self.last: tuple[list[int], Any] = ([], None)  # the last run's table and what it was made of (read-only in C)
        at = 0
        for step in steps:
            self.scalar_at += range(at + len(step.args), at + len(step.args) + len(step.scalars))
            at += len(step.args) + len(step.scalars)


class _Batch:
    """Kernels run back to back by one call into C; holds their buffers until it has run (then the pool may reuse
    them)."""

    __slots__ = ("layout", "ptrs", "pool", "items")

    def __init__(self, items: list[LaunchItem], layout: _Layout, pool: int):
        self.layout, self.pool, self.items = layout, pool, items
        if not layout.scalars:
            ptrs = [b.ptr for _, bufs, _ in items for b in bufs]  # every kernel's buffers
            if ptrs != layout.last[0]:  # (a steady plan gets the same blocks from the pool: the same table serves)
                layout.last = (ptrs, layout.ptrs_type(*ptrs))
            self.ptrs = layout.last[1]
            return
        # the scalar arguments' values sit at the end of the same table, which lives until the batch has run; each
        # kernel's entries after its buffers point at its values
        ptrs = []
        words: list[int] = []
        for _, bufs, ws in items:
            ptrs += [b.ptr for b in bufs]
            ptrs += ws  # (placeholders: the addresses of the values, known once the table is, go here)
            words += ws
        ptrs += words
        if ptrs != layout.last[0]:
            table = layout.ptrs_type(*ptrs)
            base = ctypes.addressof(table) + 8 * (len(ptrs) - len(words))
            for j, at in enumerate(layout.scalar_at):  # the j-th value's pointer
                table[at] = base + 8 * j
            layout.last = (ptrs, table)
        self.ptrs = layout.last[1]

    def __call__(self) -> None:
        lay = self.layout
        _RUNTIME_LIB[0].azyx_run(self.pool, lay.n, lay.fns, self.ptrs, lay.argc, lay.kinds, lay.trips)


class _Runner:
    """The device's C runner seen from Python (a WorkQueue's native queue): `put` hands a batch to it (azyx_submit
    only queues it, so it starts with no Python thread and no GIL), and a completion thread that waits in C with the
    GIL released drops each batch, so its buffers, once it has run, then advances the timeline."""

    def __init__(self, pool: int, timeline: TimelineSignal, name: str):
        self.pool, self.timeline, self.name = pool, timeline, name
        self.held: deque[tuple[int, _Batch]] = deque()  # (timeline value, batch) handed over, in order
        self.thread: threading.Thread | None = None

    def takes(self, fn: Callable[[], None]) -> bool:
        return type(fn) is _Batch

    def put(self, fn: Callable[[], None], v: int) -> None:
        assert isinstance(fn, _Batch)
        self.held.append((v, fn))  # before the runner can count it
        if self.thread is None:
            self.thread = threading.Thread(target=self._complete, name=f"azyx-{self.name}-done", daemon=True)
            self.thread.start()
        lay = fn.layout
        _RUNTIME_LIB[0].azyx_submit(self.pool, lay.n, lay.fns, fn.ptrs, lay.argc, lay.kinds, lay.trips)

    def _complete(self) -> None:
        seen, wait_done = 0, _RUNTIME_LIB[0].azyx_wait_done
        while (done := wait_done(self.pool, seen)) >= 0:
            v = 0
            for _ in range(done - seen):
                v = self.held.popleft()[0]  # the batch goes, and its buffers back to the pool, before the signal
            seen = done
            self.timeline.signal(v)

    def close(self) -> None:
        """Let the runner run what it was given, then stop it and the completion thread."""
        _RUNTIME_LIB[0].azyx_runner_stop(self.pool)
        if self.thread is not None:
            self.thread.join()
            self.thread = None
