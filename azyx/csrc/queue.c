#include "native.h"

/* ------------------------------------------------------------------------------ a CUDA device's queue and its lanes */

/* Queue: the per-command bookkeeping of a CUDA device (azyx.backends.cuda's CUDADevice) in C, on the device's own
 * tables and locks, for its two per-request steps: `poll` (a command's event queried, the completed unwatched commands
 * dropped, the timeline advanced) and a lane's run (below). A case the common path does not cover calls the device's
 * Python for that step: a new event, a context to make current, a driver error, a full unwatched queue, a timeline
 * with waiters to wake. */

PyTypeObject *pool_type, *queue_type;

static PyObject *attr(PyObject *o, const char *name) { return PyObject_GetAttrString(o, name); }

Py_ssize_t attr_int(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL)
        return -1;
    Py_ssize_t x = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    return x;
}

int set_int(PyObject *o, PyObject *name, Py_ssize_t x) {
    PyObject *v = PyLong_FromSsize_t(x);
    int r = v == NULL ? -1 : PyObject_SetAttr(o, name, v);
    Py_XDECREF(v);
    return r;
}

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

static PyObject *queue_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *dev, *fns, *buffer_type, *record_type;
    Py_ssize_t unwatched_max;
    unsigned long long flag, flag_dev;
    if (!PyArg_ParseTuple(args, "OO!(KK)OOn", &dev, &PyTuple_Type, &fns, &flag, &flag_dev, &buffer_type, &record_type,
                          &unwatched_max))
        return NULL;
    if (PyTuple_Size(fns) != 5) {
        PyErr_SetString(PyExc_ValueError, "Queue: five driver functions");
        return NULL;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    QueueObject *self = (QueueObject *)alloc(type, 0);
    if (self == NULL)
        return NULL;
    Py_INCREF(dev);
    self->dev = dev;
    Py_INCREF(buffer_type);
    self->buffer_type = buffer_type;
    Py_INCREF(record_type);
    self->record_type = record_type;
    self->unwatched_max = unwatched_max;
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
    PyObject *lock = attr(dev, "lock"), *qlock = attr(dev, "qlock"), *allocator = attr(dev, "allocator"), *hot = NULL;
    if (lock != NULL && qlock != NULL && allocator != NULL && (hot = attr(dev, "hot")) != NULL) {
        self->lock_acquire = attr(lock, "acquire");
        self->lock_release = attr(lock, "release");
        self->qlock_acquire = attr(qlock, "acquire");
        self->qlock_release = attr(qlock, "release");
        self->pool = attr(allocator, "pool");
        self->fail = attr(hot, "fail");
    }
    Py_XDECREF(lock);
    Py_XDECREF(qlock);
    Py_XDECREF(allocator);
    Py_XDECREF(hot);
    if (PyErr_Occurred())
        goto fail;
    PyObject **fields[] = {&self->timeline, &self->holding, &self->events, &self->free_events, &self->unwatched,
                           &self->deferred, &self->posts, &self->alloc, &self->use, &self->new_event, &self->watch,
                           &self->check_alive};
    const char *names[] = {"timeline", "holding", "events", "free_events", "unwatched", "deferred", "posts", "alloc",
                           "use", "_new_event", "_watch", "check_alive"};
    for (size_t k = 0; k < sizeof(names) / sizeof(names[0]); k++)
        if ((*fields[k] = attr(dev, names[k])) == NULL)
            goto fail;
    PyObject *tl_lock = attr(self->timeline, "_lock");
    if (tl_lock != NULL) {
        self->tl_acquire = attr(tl_lock, "acquire");
        self->tl_release = attr(tl_lock, "release");
        Py_DECREF(tl_lock);
    }
    if (PyErr_Occurred() || (self->signal = attr(self->timeline, "signal")) == NULL ||
        (self->waiters = attr(self->timeline, "_waiters")) == NULL ||
        (self->unwatched_append = attr(self->unwatched, "append")) == NULL ||
        (self->unwatched_popleft = attr(self->unwatched, "popleft")) == NULL ||
        (self->free_append = attr(self->free_events, "append")) == NULL)
        goto fail;
    PyObject *ctx = attr(dev, "ctx_id"), *stream = ctx != NULL ? attr(dev, "stream_h") : NULL;
    if (stream != NULL) {
        self->ctx = (u64)PyLong_AsUnsignedLongLongMask(ctx);
        self->stream = PyLong_AsVoidPtr(stream);
    }
    Py_XDECREF(ctx);
    Py_XDECREF(stream);
    if (PyErr_Occurred())
        goto fail;
    if (self->launch == NULL || self->record == NULL || self->query == NULL || self->current == NULL ||
        Py_TYPE(self->pool) != pool_type || !PyDict_Check(self->holding) || !PyDict_Check(self->events) ||
        !PyList_Check(self->free_events) || !PyList_Check(self->waiters)) {
        PyErr_SetString(PyExc_ValueError, "Queue: a null driver function, or a device without a native pool and its "
                                          "tables");
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
    Py_ssize_t waited = -1;
    while ((k = first_key(self->events)) >= 0) {
        if (waited < 0 && (waited = attr_int(self->dev, s_waited)) < 0 && PyErr_Occurred())
            return -1;
        if (k > waited)
            break;
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

/* The timeline reaches `v`: set under its lock where nobody waits for a value up to `v` (no wake-up to make), else
 * TimelineSignal.signal in Python. */
static int queue_signal(QueueObject *self, Py_ssize_t v) {
    if (call_void(self->tl_acquire) < 0)
        return -1;
    Py_ssize_t value = attr_int(self->timeline, s_value), sync = attr_int(self->timeline, s_sync_waiters);
    int simple = value >= 0 && sync == 0, done = value >= v, r = 0;
    if (simple && !done && PyList_Size(self->waiters)) { /* (a heap of (value, seq, callback): the first is due first) */
        PyObject *head = PyList_GetItem(self->waiters, 0);
        Py_ssize_t due = PyTuple_Check(head) ? PyLong_AsSsize_t(PyTuple_GetItem(head, 0)) : 0;
        simple = due > v;
    }
    if (PyErr_Occurred())
        r = -1;
    else if (simple && !done)
        r = set_int(self->timeline, s_value, v);
    if (call_keeping_error(self->tl_release) < 0)
        r = -1;
    if (r == 0 && !simple && !done) {
        PyObject *vo = PyLong_FromSsize_t(v);
        PyObject *got = vo != NULL ? PyObject_CallFunctionObjArgs(self->signal, vo, NULL) : NULL;
        r = got == NULL ? -1 : 0;
        Py_XDECREF(got);
        Py_XDECREF(vo);
    }
    return r;
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
    int status = -1;
    if (ev != NULL && self->flag != NULL && PyObject_Size(self->posts) == 0 &&
        (Py_ssize_t)__atomic_load_n(self->flag, __ATOMIC_ACQUIRE) >= v)
        status = 0; /* (a lane's command at or after `v` has completed: the stream is in order) */
    else if (ev != NULL) {
        Py_INCREF(ev);
        Py_ssize_t n_posts = PyObject_Size(self->posts);
        PyObject *first = n_posts > 0 ? PySequence_GetItem(self->posts, 0) : NULL;
        int posted = first != NULL && PyLong_AsSsize_t(first) <= v; /* (a host-side `post` runs first) */
        Py_XDECREF(first);
        PyObject *handle = posted || PyErr_Occurred() ? NULL : PyNumber_Long(ev);
        Py_DECREF(ev);
        if (handle != NULL) {
            void *h = PyLong_AsVoidPtr(handle);
            Py_DECREF(handle);
            status = self->query(h);
            if (status == CU_NOT_READY && spin > 0) {
                struct timespec t0, t;
                clock_gettime(CLOCK_MONOTONIC, &t0);
                while ((status = self->query(h)) == CU_NOT_READY) {
                    if (self->flag != NULL && (Py_ssize_t)__atomic_load_n(self->flag, __ATOMIC_ACQUIRE) >= v) {
                        status = 0;
                        break;
                    }
                    clock_gettime(CLOCK_MONOTONIC, &t);
                    if ((double)(t.tv_sec - t0.tv_sec) + 1e-9 * (double)(t.tv_nsec - t0.tv_nsec) > spin)
                        break;
                }
            }
        }
    }
    Py_DECREF(vo);
    if (PyErr_Occurred())
        return NULL;
    if (status != 0) { /* (not yet, or no event to ask; an error stays for the waiter thread to report) */
        Py_ssize_t value = attr_int(self->timeline, s_value);
        if (value < 0 && PyErr_Occurred())
            return NULL;
        return PyBool_FromLong(value >= v);
    }
    /* complete: the unwatched commands up to `v` are (the stream is in order); when the waiter thread has nothing
     * older left, their completion is handled here */
    PyObject *done = PyList_New(0);
    if (done == NULL || call_void(self->lock_acquire) < 0) {
        Py_XDECREF(done);
        return NULL;
    }
    int ok = call_void(self->qlock_acquire) == 0;
    if (ok) {
        Py_ssize_t waited = attr_int(self->dev, s_waited), handed = attr_int(self->dev, s_handed);
        ok = !PyErr_Occurred();
        while (ok && waited >= handed && PyObject_Size(self->unwatched) > 0) {
            PyObject *head = PySequence_GetItem(self->unwatched, 0);
            Py_ssize_t u = head != NULL ? PyLong_AsSsize_t(PyTuple_GetItem(head, 1)) : -1;
            Py_XDECREF(head);
            if (u < 0 || u > v)
                break;
            PyObject *popped = PyObject_CallNoArgs(self->unwatched_popleft), *key = PyLong_FromSsize_t(u);
            PyObject *held = key != NULL ? PyDict_GetItemWithError(self->holding, key) : NULL;
            ok = popped != NULL && key != NULL && !PyErr_Occurred();
            if (ok && held != NULL)
                ok = PyList_Append(done, held) == 0 && PyDict_DelItem(self->holding, key) == 0;
            ok = ok && set_int(self->dev, s_waited, u) == 0;
            Py_XDECREF(popped);
            Py_XDECREF(key);
        }
        ok = ok && !PyErr_Occurred();
        if (call_keeping_error(self->qlock_release) < 0)
            ok = 0;
    }
    if (call_keeping_error(self->lock_release) < 0)
        ok = 0;
    if (!ok) {
        Py_DECREF(done);
        return NULL;
    }
    Py_DECREF(done); /* the commands' buffers go back to their pools, outside the locks */
    if (PyErr_Occurred() || queue_signal(self, v) < 0)
        return NULL;
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

#define QUEUE_FIELDS(self, amp)                                                                                        \
    {amp self->dev, amp self->timeline, amp self->pool, amp self->holding, amp self->events, amp self->free_events,    \
     amp self->unwatched, amp self->deferred, amp self->posts, amp self->lock_acquire, amp self->lock_release,        \
     amp self->qlock_acquire, amp self->qlock_release, amp self->unwatched_append, amp self->unwatched_popleft,       \
     amp self->free_append, amp self->tl_acquire, amp self->tl_release, amp self->signal, amp self->waiters,          \
     amp self->alloc, amp self->use, amp self->new_event, amp self->watch, amp self->fail, amp self->check_alive,      \
     amp self->buffer_type, amp self->record_type}

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
    {Py_tp_doc, "Queue(device, (cuLaunchKernel, cuEventRecord, cuEventQuery, cuCtxGetCurrent, cuStreamWriteValue64), "
                "(flag, its device address), Buffer, RunRecord, unwatched_max): a CUDA device's command bookkeeping in "
                "C (see CUDADevice)."},
    {Py_tp_new, queue_new},
    {Py_tp_methods, queue_methods},
    {Py_tp_traverse, queue_traverse},
    {Py_tp_clear, queue_clear},
    {Py_tp_dealloc, queue_dealloc},
    {0, NULL},
};

PyType_Spec queue_spec = {"azyx._native.Queue", sizeof(QueueObject), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
                                 queue_slots};
