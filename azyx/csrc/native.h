/* azyx's native core: the graph's node, the canonical walk and the release of nodes, the per-request work of every
 * realize (azyx.graph and azyx.walk hold the same in Python, which runs where this module is not built).
 *
 * Built against Python's stable ABI (3.11): one library serves every later Python. Nothing here releases the GIL
 * but read.c's file reads; the only calls back into Python are a leaf's view and buffer attributes and an ASSIGN's
 * donation check. */

#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include <time.h>

typedef uint64_t u64;

typedef struct {
    PyObject_HEAD
    PyObject *op, *src, *arg, *arg2, *shape, *dtype, *device, *pinned;
    Py_ssize_t rc;
    PyObject *buffer, *view;
} NodeObject;

typedef struct {
    PyObject_HEAD
    PyObject *lists; /* bucketed size -> list of blocks (a heap with `lowest`) */
    Py_ssize_t capacity, cache_limit, in_use, cached;
    int lowest;
} PoolObject;

typedef int (*cu_launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                            void **, void **);
typedef int (*cu_event_fn)(void *, void *);
typedef int (*cu_query_fn)(void *);
typedef int (*cu_current_fn)(void **);
typedef int (*cu_write_fn)(void *, u64, u64, unsigned);
#define CU_NOT_READY 600

/* queue.c: a CUDA device's command queue. Its state is its own (the counters, the open batch, the tables, read and
 * advanced by the device's Python paths as its members); the rest is the record the device built once (its locks,
 * the hooks of the cases C leaves to Python, the driver's functions, its stream). */
typedef struct {
    PyObject_HEAD
    /* the state the queue owns */
    Py_ssize_t submitted, waited, handed, demanded; /* the last value reserved, handled by the waiter, handed to it,
                                                        waited for by someone */
    PyObject *batch;                                /* the open batch's launches (a list), or None */
    PyObject *holding, *events, *free_events, *unwatched; /* value -> what it holds; value -> its event; events to
                                                              record anew; (event, value) not yet watched (a deque) */
    /* the record the device built */
    PyObject *device, *timeline, *pool, *deferred, *posts, *lock, *qlock;
    PyObject *alloc, *use, *new_event, *watch, *fail, *check_alive, *buffer_type, *record_type;
    /* bound methods, looked up once */
    PyObject *lock_acquire, *lock_release, *qlock_acquire, *qlock_release, *unwatched_append, *unwatched_popleft;
    PyObject *free_append, *signal;
    cu_launch_fn launch;
    cu_event_fn record;
    cu_query_fn query;
    cu_current_fn current;
    cu_write_fn write; /* cuStreamWriteValue64: a lane's value into `flag` once its command completed (NULL: none) */
    volatile u64 *flag;
    u64 flag_dev;
    void *stream;
    u64 ctx;
    Py_ssize_t unwatched_max;
} QueueObject;

/* ------------------------------------------------------------------------------ shared between the source files */

#define MAX_PARAMS 64 /* a launch's parameters kept on the stack (more: allocated) */

/* node.c: the node's type and what setup() tells the walk and the operators */
extern PyTypeObject *node_type;
extern PyObject *op_const, *op_pad, *op_assign, *op_binary, *op_leaf, *scalar_mark, *bool_dtype, *donates_fn;
extern PyObject *op_unary, *op_reduce, *op_reshape;
/* interned attribute names (module.c interns them) */
extern PyObject *s_view, *s_buffer, *s_offset, *s_strides, *s_device, *s_name, *s_id, *s_recording;
extern PyObject *s_failure, *s_value, *s_ready, *s_run, *s_clean, *s_spans, *s_ptr;
/* build.c: what setup_tensor() tells the operators */
extern PyObject *tensor_type, *graph_obj, *graph_nodes, *graph_free, *float_dtypes, *int_dtypes, *disk_name;
extern PyTypeObject *pool_type, *queue_type;
extern PyType_Spec node_spec, method_spec, pool_spec, table_call_spec, queue_spec, lane_spec;

void dealloc_tracked(PyObject *self, inquiry clear);
int release_node(PyObject *nodes, PyObject *freed, PyObject *kept, Py_ssize_t i);
NodeObject *node_at(PyObject *nodes, Py_ssize_t i);
Py_ssize_t bucket_of(Py_ssize_t nbytes);
PyObject *list_pop_last(PyObject *list);
PyObject *pool_pop(PoolObject *self, Py_ssize_t size);
int as_u64(PyObject *v, u64 *out);
Py_ssize_t attr_int(PyObject *o, PyObject *name);
int call_void(PyObject *fn);
int call_keeping_error(PyObject *fn);
int queue_take_done(QueueObject *self, PyObject *done);
int queue_setup(void);

/* the module's functions (module.c's table) */
PyObject *setup(PyObject *mod, PyObject *args);
PyObject *setup_tensor(PyObject *mod, PyObject *args);
PyObject *walk(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
PyObject *release(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
PyObject *become_leaf(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
PyObject *realized(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
PyObject *binary(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
PyObject *pack_words(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
PyObject *call(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
PyObject *call_out(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
PyObject *launch_kernel(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
PyObject *read_range(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
PyObject *read_direct(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
