#include "native.h"

/* ------------------------------------------------------------------------------------- a CUDA device's command queue */

/* Queue: a CUDA device's command queue (azyx.backends.cuda's CUDADevice), for its two per-request steps in C: `poll`
 * (a command's event queried, the completed unwatched commands dropped, the timeline advanced) and a lane's run
 * (lane.c). Its state is its own members: the counters, the open batch and the tables (created here); the device's
 * Python paths (batches, deferred commands, the waiter thread) read and advance the same members, under the same
 * locks. What else it needs the device gives once, as keywords: its locks, its timeline (whose public `value`,
 * `failure` and `signal` alone are used), its pool, and the hooks for what C leaves to Python (a new event, a context
 * to make current, a driver error, a command the waiter thread must watch). C writes no attribute of a Python object
 * for the queue. */

PyTypeObject *pool_type, *queue_type;
static PyObject *deque_type; /* collections.deque: the unwatched commands' table */

int call_void(PyObject *fn) {
    PyObject *r = PyObject_CallNoArgs(fn);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* a call that must run while an exception may be set (a lock's release on the way out): the exception stays */
int call_keeping_error(PyObject *fn) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    int r = call_void(fn);
    if (type != NULL) {
        if (r < 0) /* (the first error is the one raised) */
            PyErr_Clear();
        PyErr_Restore(type, value, tb);
    }
    return r;
}

Py_ssize_t attr_int(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL)
        return -1;
    Py_ssize_t x = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    return x;
}

static int set_ref(PyObject **field, PyObject *v) {
    if (v == NULL)
        return -1;
    PyObject *old = *field;
    *field = v;
    Py_XDECREF(old);
    return 0;
}

static PyObject *queue_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"device", "timeline", "pool", "lock", "qlock", "deferred", "posts", "alloc", "use",
                             "new_event", "watch", "fail", "check_alive", "buffer", "record", "fns", "flag", "ctx",
                             "stream", "unwatched_max", NULL};
    PyObject *f[15], *fns;
    unsigned long long flag, flag_dev, ctx, stream;
    Py_ssize_t unwatched_max;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$OOO!OOOOOOOOOOOOO!(KK)KKn", kwlist, &f[0], &f[1], pool_type, &f[2],
                                     &f[3], &f[4], &f[5], &f[6], &f[7], &f[8], &f[9], &f[10], &f[11], &f[12], &f[13],
                                     &f[14], &PyTuple_Type, &fns, &flag, &flag_dev, &ctx, &stream, &unwatched_max))
        return NULL;
    if (PyTuple_Size(fns) != 5) {
        PyErr_SetString(PyExc_ValueError, "Queue: five driver functions");
        return NULL;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    QueueObject *self = (QueueObject *)alloc(type, 0);
    if (self == NULL)
        return NULL;
    PyObject **record[] = {&self->device, &self->timeline, &self->pool, &self->lock, &self->qlock, &self->deferred,
                           &self->posts, &self->alloc, &self->use, &self->new_event, &self->watch, &self->fail,
                           &self->check_alive, &self->buffer_type, &self->record_type};
    for (size_t k = 0; k < sizeof(record) / sizeof(record[0]); k++) {
        Py_INCREF(f[k]);
        *record[k] = f[k];
    }
    Py_INCREF(Py_None);
    self->batch = Py_None;
    self->unwatched_max = unwatched_max;
    self->ctx = (u64)ctx;
    self->stream = (void *)(uintptr_t)stream;
    self->launch = (cu_launch_fn)PyLong_AsVoidPtr(PyTuple_GetItem(fns, 0));
    self->record = (cu_event_fn)PyLong_AsVoidPtr(PyTuple_GetItem(fns, 1));
    self->query = (cu_query_fn)PyLong_AsVoidPtr(PyTuple_GetItem(fns, 2));
    self->current = (cu_current_fn)PyLong_AsVoidPtr(PyTuple_GetItem(fns, 3));
    self->write = (cu_write_fn)PyLong_AsVoidPtr(PyTuple_GetItem(fns, 4));
    if (PyErr_Occurred())
        goto fail;
    if (self->write != NULL && flag != 0 && flag_dev != 0) {
        self->flag = (volatile u64 *)(uintptr_t)flag;
        self->flag_dev = (u64)flag_dev;
    } else
        self->write = NULL;
    if (set_ref(&self->holding, PyDict_New()) < 0 || set_ref(&self->events, PyDict_New()) < 0 ||
        set_ref(&self->free_events, PyList_New(0)) < 0 ||
        set_ref(&self->unwatched, PyObject_CallNoArgs(deque_type)) < 0 ||
        set_ref(&self->lock_acquire, PyObject_GetAttrString(self->lock, "acquire")) < 0 ||
        set_ref(&self->lock_release, PyObject_GetAttrString(self->lock, "release")) < 0 ||
        set_ref(&self->qlock_acquire, PyObject_GetAttrString(self->qlock, "acquire")) < 0 ||
        set_ref(&self->qlock_release, PyObject_GetAttrString(self->qlock, "release")) < 0 ||
        set_ref(&self->unwatched_append, PyObject_GetAttrString(self->unwatched, "append")) < 0 ||
        set_ref(&self->unwatched_popleft, PyObject_GetAttrString(self->unwatched, "popleft")) < 0 ||
        set_ref(&self->free_append, PyObject_GetAttrString(self->free_events, "append")) < 0 ||
        set_ref(&self->signal, PyObject_GetAttrString(self->timeline, "signal")) < 0)
        goto fail;
    if (self->launch == NULL || self->record == NULL || self->query == NULL || self->current == NULL) {
        PyErr_SetString(PyExc_ValueError, "Queue: a null driver function");
        goto fail;
    }
    return (PyObject *)self;
fail:
    Py_DECREF((PyObject *)self);
    return NULL;
}

/* the first key of a dict (its oldest entry), or -1 when empty */
static Py_ssize_t first_key(PyObject *dict) {
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    return PyDict_Size(dict) && PyDict_Next(dict, &pos, &k, &v) ? PyLong_AsSsize_t(k) : -1;
}

/* Under the device's lock: CUDADevice._take_done. What completed commands held goes to `done` (for the caller to drop
 * outside the lock); the events the waiter thread is past are retired (a batch's values share one event: it is free
 * once its last value is past). */
int queue_take_done(QueueObject *self, PyObject *done) {
    Py_ssize_t reached = attr_int(self->timeline, s_value), k;
    if (reached < 0 && PyErr_Occurred())
        return -1;
    while ((k = first_key(self->holding)) >= 0 && k <= reached) {
        PyObject *key = PyLong_FromSsize_t(k), *held = key != NULL ? PyDict_GetItemWithError(self->holding, key) : NULL;
        int ok = held != NULL && PyList_Append(done, held) == 0 && PyDict_DelItem(self->holding, key) == 0;
        Py_XDECREF(key);
        if (!ok)
            return -1;
    }
    while ((k = first_key(self->events)) >= 0 && k <= self->waited) {
        PyObject *key = PyLong_FromSsize_t(k), *next = PyLong_FromSsize_t(k + 1);
        PyObject *ev = key != NULL ? PyDict_GetItemWithError(self->events, key) : NULL;
        int ok = next != NULL && ev != NULL;
        if (ok) {
            Py_INCREF(ev);
            ok = PyDict_DelItem(self->events, key) == 0;
            PyObject *after = ok ? PyDict_GetItemWithError(self->events, next) : NULL;
            if (ok && after != ev && !PyErr_Occurred()) {
                PyObject *r = PyObject_CallFunctionObjArgs(self->free_append, ev, NULL);
                ok = r != NULL;
                Py_XDECREF(r);
            }
            ok = ok && !PyErr_Occurred();
            Py_DECREF(ev);
        }
        Py_XDECREF(key);
        Py_XDECREF(next);
        if (!ok)
            return -1;
    }
    return 0;
}

/* whether a command at or after value `v` has completed by the lanes' flag (the stream is in order) */
static int flag_reached(QueueObject *self, Py_ssize_t v) {
    return self->flag != NULL && (Py_ssize_t)__atomic_load_n(self->flag, __ATOMIC_ACQUIRE) >= v;
}

/* the status of the command of value `v` (its event `ev`), queried for up to `spin` seconds: 0 when complete */
static int query_event(QueueObject *self, PyObject *ev, Py_ssize_t v, double spin) {
    PyObject *handle = PyNumber_Long(ev);
    if (handle == NULL)
        return -1;
    void *h = PyLong_AsVoidPtr(handle);
    Py_DECREF(handle);
    int status = self->query(h);
    if (status == CU_NOT_READY && spin > 0) {
        struct timespec t0, t;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        while ((status = self->query(h)) == CU_NOT_READY) {
            if (flag_reached(self, v))
                return 0;
            clock_gettime(CLOCK_MONOTONIC, &t);
            if ((double)(t.tv_sec - t0.tv_sec) + 1e-9 * (double)(t.tv_nsec - t0.tv_nsec) > spin)
                break;
        }
    }
    return status;
}

/* Under both locks: the unwatched commands up to `v`, complete, leave the queue when the waiter thread has nothing
 * older left; what they held goes to `done`. */
static int drop_unwatched(QueueObject *self, Py_ssize_t v, PyObject *done) {
    while (self->waited >= self->handed && PyObject_Size(self->unwatched) > 0) {
        PyObject *head = PySequence_GetItem(self->unwatched, 0);
        Py_ssize_t u = head != NULL ? PyLong_AsSsize_t(PyTuple_GetItem(head, 1)) : -1;
        Py_XDECREF(head);
        if (u < 0 || u > v)
            break;
        PyObject *popped = PyObject_CallNoArgs(self->unwatched_popleft), *key = PyLong_FromSsize_t(u);
        PyObject *held = key != NULL ? PyDict_GetItemWithError(self->holding, key) : NULL;
        int ok = popped != NULL && key != NULL && !PyErr_Occurred();
        if (ok && held != NULL)
            ok = PyList_Append(done, held) == 0 && PyDict_DelItem(self->holding, key) == 0;
        Py_XDECREF(popped);
        Py_XDECREF(key);
        if (!ok)
            return -1;
        self->waited = u;
    }
    return PyErr_Occurred() ? -1 : 0;
}

/* poll(v, spin) -> bool: CUDADevice.poll (see there) */
static PyObject *queue_poll(QueueObject *self, PyObject *args) {
    Py_ssize_t v;
    double spin;
    if (!PyArg_ParseTuple(args, "nd", &v, &spin))
        return NULL;
    PyObject *vo = PyLong_FromSsize_t(v);
    if (vo == NULL)
        return NULL;
    PyObject *ev = PyDict_GetItemWithError(self->events, vo); /* (borrowed) */
    Py_DECREF(vo);
    int status = -1;
    Py_ssize_t n_posts = ev != NULL ? PyObject_Size(self->posts) : 0;
    if (ev != NULL && n_posts == 0 && flag_reached(self, v))
        status = 0; /* (a lane's command at or after `v` has completed) */
    else if (ev != NULL && n_posts >= 0) {
        PyObject *first = n_posts > 0 ? PySequence_GetItem(self->posts, 0) : NULL;
        int posted = first != NULL && PyLong_AsSsize_t(first) <= v; /* (a host-side `post` runs first) */
        Py_XDECREF(first);
        if (!posted && !PyErr_Occurred()) {
            Py_INCREF(ev);
            status = query_event(self, ev, v, spin);
            Py_DECREF(ev);
        }
    }
    if (PyErr_Occurred())
        return NULL;
    if (status != 0) { /* (not yet, or no event to ask; an error stays for the waiter thread to report) */
        Py_ssize_t value = attr_int(self->timeline, s_value);
        if (value < 0 && PyErr_Occurred())
            return NULL;
        return PyBool_FromLong(value >= v);
    }
    /* complete: the unwatched commands up to `v` are (the stream is in order) */
    PyObject *done = PyList_New(0);
    if (done == NULL || call_void(self->lock_acquire) < 0) {
        Py_XDECREF(done);
        return NULL;
    }
    int ok = call_void(self->qlock_acquire) == 0;
    if (ok) {
        ok = drop_unwatched(self, v, done) == 0;
        if (call_keeping_error(self->qlock_release) < 0)
            ok = 0;
    }
    if (call_keeping_error(self->lock_release) < 0)
        ok = 0;
    Py_DECREF(done); /* the commands' buffers go back to their pools, outside the locks */
    if (!ok || PyErr_Occurred())
        return NULL;
    PyObject *vv = PyLong_FromSsize_t(v), *r = vv != NULL ? PyObject_CallFunctionObjArgs(self->signal, vv, NULL) : NULL;
    Py_XDECREF(vv);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_TRUE;
}

static PyObject *queue_take_done_py(QueueObject *self, PyObject *unused) {
    PyObject *done = PyList_New(0);
    if (done != NULL && queue_take_done(self, done) < 0)
        Py_CLEAR(done);
    return done;
}

static PyMethodDef queue_methods[] = {
    {"poll", (PyCFunction)queue_poll, METH_VARARGS, "poll(v, spin) -> whether value `v` is reached (CUDADevice.poll)"},
    {"take_done", (PyCFunction)queue_take_done_py, METH_NOARGS,
     "take_done() -> what completed commands held, to drop outside the lock (CUDADevice._take_done, under its lock)"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef queue_members[] = {
    {"submitted", T_PYSSIZET, offsetof(QueueObject, submitted), 0, "the last timeline value reserved"},
    {"waited", T_PYSSIZET, offsetof(QueueObject, waited), 0, "the last value whose completion was handled"},
    {"handed", T_PYSSIZET, offsetof(QueueObject, handed), 0, "the last value handed to the waiter thread"},
    {"demanded", T_PYSSIZET, offsetof(QueueObject, demanded), 0, "the highest value someone waited for"},
    {"batch", T_OBJECT, offsetof(QueueObject, batch), 0, "the open batch's launches (a list), or None"},
    {"holding", T_OBJECT, offsetof(QueueObject, holding), READONLY, "value -> what its command holds"},
    {"events", T_OBJECT, offsetof(QueueObject, events), READONLY, "value -> the event completing it"},
    {"free_events", T_OBJECT, offsetof(QueueObject, free_events), READONLY, "events to record anew"},
    {"unwatched", T_OBJECT, offsetof(QueueObject, unwatched), READONLY, "(event, value) not handed to the waiter yet"},
    {NULL, 0, 0, 0, NULL},
};

#define QUEUE_FIELDS(self, amp)                                                                                        \
    {amp self->batch, amp self->holding, amp self->events, amp self->free_events, amp self->unwatched,                \
     amp self->device, amp self->timeline, amp self->pool, amp self->deferred, amp self->posts, amp self->lock,        \
     amp self->qlock, amp self->alloc, amp self->use, amp self->new_event, amp self->watch, amp self->fail,            \
     amp self->check_alive, amp self->buffer_type, amp self->record_type, amp self->lock_acquire,                      \
     amp self->lock_release, amp self->qlock_acquire, amp self->qlock_release, amp self->unwatched_append,            \
     amp self->unwatched_popleft, amp self->free_append, amp self->signal}

static int queue_traverse(QueueObject *self, visitproc visit, void *arg) {
    PyObject *fields[] = QUEUE_FIELDS(self, );
    for (size_t k = 0; k < sizeof(fields) / sizeof(fields[0]); k++)
        Py_VISIT(fields[k]);
    return 0;
}

static int queue_clear(QueueObject *self) {
    PyObject **fields[] = QUEUE_FIELDS(self, &);
    for (size_t k = 0; k < sizeof(fields) / sizeof(fields[0]); k++)
        Py_CLEAR(*fields[k]);
    return 0;
}

static void queue_dealloc(QueueObject *self) { dealloc_tracked((PyObject *)self, (inquiry)queue_clear); }

static PyType_Slot queue_slots[] = {
    {Py_tp_doc, "Queue(*, device, timeline, pool, lock, qlock, deferred, posts, alloc, use, new_event, watch, fail, "
                "check_alive, buffer, record, fns, flag, ctx, stream, unwatched_max): a CUDA device's command queue, "
                "its state its own members (see CUDADevice)."},
    {Py_tp_new, queue_new},
    {Py_tp_methods, queue_methods},
    {Py_tp_members, queue_members},
    {Py_tp_traverse, queue_traverse},
    {Py_tp_clear, queue_clear},
    {Py_tp_dealloc, queue_dealloc},
    {0, NULL},
};

PyType_Spec queue_spec = {"azyx._native.Queue", sizeof(QueueObject), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
                          queue_slots};

/* module.c: what the queue's table of unwatched commands is */
int queue_setup(void) {
    PyObject *collections = PyImport_ImportModule("collections");
    deque_type = collections != NULL ? PyObject_GetAttrString(collections, "deque") : NULL;
    Py_XDECREF(collections);
    return deque_type == NULL ? -1 : 0;
}
