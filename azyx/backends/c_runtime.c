/* The C backend's runtime (azyx/backends/c.py): the pool of helper threads that share a kernel's loop, the runner
   thread that runs submitted batches in order with no Python, and the entry points c.py calls through ctypes
   (azyx_run, azyx_submit, azyx_wait_done, azyx_runner_stop, azyx_pool_new, azyx_pool_free).
   c.py builds it once as a shared library of its own (after #define _GNU_SOURCE, for sched_getcpu), with the first C
   device's compiler and flags, cached on disk under the hash of its text; kernel libraries hold only the kernels and
   their name_argv entries, which this runtime calls through pointers. Shipped as package data. */

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
    /* stop is read after `seen`: a stop made before that read is seen here, one made after it changes the epoch (a
       helper that starts late, once azyx_run has returned and the pool is being freed, would otherwise wait for an
       epoch that never changes again, and azyx_pool_free's join with it) */
    if (__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE)) return NULL;
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
