#include "native.h"

/* Lane: the whole run of a plan that is one kernel on one CUDA device (CUDADevice.lane), with no Python between the
 * call and the launch: the run's output blocks from the device's pool, the kernel's parameters, cuLaunchKernel, its
 * event and the queue's bookkeeping of it (its value, what it holds until it completes, the event in the unwatched
 * queue), then the run's failure record and the targets' buffers (new objects of the run: C sets their `ready` and
 * `run` as the executor does). It is CUDADevice.begin_batch, alloc, launch_many and end_batch for a batch of one
 * launch; where those would not launch inline (a deferred command queued first, a batch open) it returns None, for the
 * executor's path. A lane is a frozen record Python builds once per plan: its fields are read-only. */

typedef struct {
    PyObject_HEAD
    QueueObject *queue;
    PyObject *outputs, *pack, *last_scalars, *last_words;
    PyObject *function, *grid_t, *slots_t, *sizes_t; /* (the record as given, read back by its members) */
    void *fn;
    unsigned grid[3], block, smem;
    Py_ssize_t n_inputs, n_slots, n_args, n_outs;
    Py_ssize_t *args;  /* the kernel's slots, its outputs first */
    Py_ssize_t *sizes; /* bytes of each slot the lane allocates (-1: an input's) */
} LaneObject;

static PyObject *lane_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *queue, *fn, *grid, *slots, *sizes, *outputs, *pack;
    unsigned block, smem;
    Py_ssize_t n_outs, n_inputs;
    if (!PyArg_ParseTuple(args, "O!OO!IIO!nnO!O!O", queue_type, &queue, &fn, &PyTuple_Type, &grid, &block, &smem,
                          &PyTuple_Type, &slots, &n_outs, &n_inputs, &PyTuple_Type, &sizes, &PyTuple_Type, &outputs,
                          &pack))
        return NULL;
    if (PyTuple_Size(grid) != 3 || n_outs > PyTuple_Size(slots)) {
        PyErr_SetString(PyExc_ValueError, "Lane: a grid of three, outputs among the slots");
        return NULL;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    LaneObject *self = (LaneObject *)alloc(type, 0);
    if (self == NULL)
        return NULL;
    Py_INCREF(queue);
    self->queue = (QueueObject *)queue;
    Py_INCREF(outputs);
    self->outputs = outputs;
    Py_INCREF(pack);
    self->pack = pack;
    PyObject *given[] = {fn, grid, slots, sizes}, **kept[] = {&self->function, &self->grid_t, &self->slots_t,
                                                              &self->sizes_t};
    for (int k = 0; k < 4; k++) {
        Py_INCREF(given[k]);
        *kept[k] = given[k];
    }
    self->n_args = PyTuple_Size(slots);
    self->n_slots = PyTuple_Size(sizes);
    self->n_outs = n_outs;
    self->n_inputs = n_inputs;
    self->block = block;
    self->smem = smem;
    self->args = (Py_ssize_t *)calloc((size_t)self->n_args + 1, sizeof(Py_ssize_t));
    self->sizes = (Py_ssize_t *)calloc((size_t)self->n_slots + 1, sizeof(Py_ssize_t));
    if (self->args == NULL || self->sizes == NULL) {
        Py_DECREF((PyObject *)self);
        return PyErr_NoMemory();
    }
    int bad = n_inputs > self->n_slots;
    for (Py_ssize_t k = 0; k < self->n_args; k++) {
        self->args[k] = PyLong_AsSsize_t(PyTuple_GetItem(slots, k));
        bad |= self->args[k] < 0 || self->args[k] >= self->n_slots;
    }
    for (Py_ssize_t k = 0; k < self->n_slots; k++)
        self->sizes[k] = PyLong_AsSsize_t(PyTuple_GetItem(sizes, k));
    for (int k = 0; k < 3; k++)
        self->grid[k] = (unsigned)PyLong_AsUnsignedLong(PyTuple_GetItem(grid, k));
    self->fn = PyLong_AsVoidPtr(fn);
    for (Py_ssize_t k = 0; k < PyTuple_Size(outputs); k++) {
        PyObject *o = PyTuple_GetItem(outputs, k);
        Py_ssize_t s = PyTuple_Check(o) && PyTuple_Size(o) == 2 ? PyLong_AsSsize_t(PyTuple_GetItem(o, 0)) : -1;
        bad |= s < 0 || s >= self->n_slots;
    }
    if (PyErr_Occurred() || bad || self->fn == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "Lane: a slot out of range, or a null function");
        Py_DECREF((PyObject *)self);
        return NULL;
    }
    return (PyObject *)self;
}

/* A block of `nbytes` for a run's output: the pool's cached block itself (a new reference to its address, `*size` its
 * bucketed size: it becomes a Buffer once the kernel is launched, off the launch's path), or else the device's alloc
 * (a Buffer of a new block, `*size` 0; or the refusal, NULL). */
static PyObject *lane_take(QueueObject *q, Py_ssize_t nbytes, Py_ssize_t *size) {
    PoolObject *pool = (PoolObject *)q->pool;
    *size = bucket_of(nbytes);
    PyObject *mem = pool_pop(pool, *size);
    if (mem != NULL) {
        pool->in_use += *size;
        return mem;
    }
    *size = 0;
    if (PyErr_Occurred())
        return NULL;
    PyObject *n = PyLong_FromSsize_t(nbytes);
    PyObject *b = n == NULL ? NULL : PyObject_CallFunctionObjArgs(q->alloc, n, NULL);
    Py_XDECREF(n);
    return b;
}

/* a raw block back to the pool (a run that did not launch) */
static void lane_give(QueueObject *q, PyObject *mem, Py_ssize_t size) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *r = PyObject_CallMethod(q->pool, "give", "On", mem, size);
    Py_XDECREF(r);
    PyErr_Clear();
    PyErr_Restore(type, value, tb);
}

/* the kernel's scalar words for this run's values (packed anew only for a new list of values) */
static PyObject *lane_words(LaneObject *self, PyObject *scalars) {
    if (self->pack == Py_None)
        return NULL;
    if (self->last_scalars != scalars || self->last_words == NULL) {
        PyObject *words = PyObject_CallFunctionObjArgs(self->pack, scalars, NULL);
        if (words == NULL || !PyTuple_Check(words)) {
            if (words != NULL)
                PyErr_SetString(PyExc_TypeError, "Lane: a kernel's packed words must be a tuple");
            Py_XDECREF(words);
            return NULL;
        }
        Py_INCREF(scalars);
        Py_XDECREF(self->last_scalars);
        self->last_scalars = scalars;
        Py_XDECREF(self->last_words);
        self->last_words = words;
    }
    return self->last_words;
}

/* Under the device's lock: the launch and its event; the run's value, or -1 with an exception. */
static Py_ssize_t lane_submit(LaneObject *self, PyObject **bufs, Py_ssize_t *raw, PyObject *scalars) {
    QueueObject *q = self->queue;
    PyObject *words = lane_words(self, scalars);
    if (words == NULL && PyErr_Occurred())
        return -1;
    Py_ssize_t n_words = words != NULL ? PyTuple_Size(words) : 0, n = self->n_args + n_words;
    u64 local_vals[MAX_PARAMS], *vals = local_vals;
    void *local_params[MAX_PARAMS], **params = local_params;
    if (n > MAX_PARAMS) {
        vals = (u64 *)malloc((size_t)n * sizeof(u64));
        params = (void **)malloc((size_t)n * sizeof(void *));
        if (vals == NULL || params == NULL) {
            free(vals);
            free(params);
            PyErr_NoMemory();
            return -1;
        }
    }
    int bad = 0;
    for (Py_ssize_t k = 0; k < n && !bad; k++) {
        if (k < self->n_args && raw[self->args[k]]) /* a pool block's address */
            bad = as_u64(bufs[self->args[k]], &vals[k]) < 0;
        else if (k < self->n_args) { /* a buffer's device pointer */
            PyObject *w = PyObject_GetAttr(bufs[self->args[k]], s_ptr);
            bad = w == NULL || as_u64(w, &vals[k]) < 0;
            Py_XDECREF(w);
        } else /* a scalar argument's word */
            bad = as_u64(PyTuple_GetItem(words, k - self->n_args), &vals[k]) < 0;
        params[k] = &vals[k];
    }
    Py_ssize_t before = bad ? -1 : q->submitted, v = -1;
    void *cur = NULL;
    if (before >= 0 && (q->current(&cur) != 0 || (u64)(uintptr_t)cur != q->ctx) && call_void(q->use) < 0)
        before = -1;
    if (before >= 0) {
        int err = q->launch(self->fn, self->grid[0], self->grid[1], self->grid[2], self->block, 1, 1, self->smem,
                            q->stream, params, NULL);
        if (err) { /* (raises the DeviceError `check` would) */
            PyObject *r = PyObject_CallFunction(q->fail, "is", err, "cuLaunchKernel");
            Py_XDECREF(r);
        } else
            v = before + 1;
    }
    if (vals != local_vals) {
        free(vals);
        free(params);
    }
    if (v < 0)
        return -1;
    q->submitted = v;
    /* the launched kernel's raw blocks become its output buffers (a failure here leaves a block out of the pool, in
     * use: the kernel writes it) */
    for (Py_ssize_t s = 0; s < self->n_slots; s++)
        if (raw[s]) {
            PyObject *size = PyLong_FromSsize_t(raw[s]);
            PyObject *b = size == NULL ? NULL : PyObject_CallFunctionObjArgs(q->buffer_type, q->device, size, bufs[s],
                                                                            bufs[s], Py_True, NULL);
            Py_XDECREF(size);
            raw[s] = 0;
            if (b == NULL)
                return -1;
            Py_DECREF(bufs[s]);
            bufs[s] = b;
        }
    /* launched: what it holds until it completes (first: whatever fails next, its buffers stay out of the pools while
     * it may run), its event, its place in the unwatched queue (EventQueue.record) */
    PyObject *vo = PyLong_FromSsize_t(v), *held = vo != NULL ? PyTuple_New(self->n_args) : NULL;
    if (held != NULL) {
        for (Py_ssize_t k = 0; k < self->n_args; k++) {
            Py_INCREF(bufs[self->args[k]]);
            PyTuple_SetItem(held, k, bufs[self->args[k]]);
        }
    }
    int ok = held != NULL && PyDict_SetItem(q->holding, vo, held) == 0;
    Py_XDECREF(held);
    PyObject *ev = !ok ? NULL : PyList_Size(q->free_events) ? list_pop_last(q->free_events)
                                                            : PyObject_CallNoArgs(q->new_event);
    PyObject *handle = ev == NULL ? NULL : PyNumber_Long(ev);
    ok = handle != NULL;
    if (ok) {
        int err = q->record(PyLong_AsVoidPtr(handle), q->stream);
        if (err) {
            PyObject *r = PyObject_CallFunction(q->fail, "is", err, "cuEventRecord");
            Py_XDECREF(r);
            ok = 0;
        }
    }
    Py_XDECREF(handle);
    if (ok && q->write != NULL) { /* (stream order: after the kernel and its event) */
        int err = q->write(q->stream, q->flag_dev, (u64)v, 0);
        if (err) {
            PyObject *r = PyObject_CallFunction(q->fail, "is", err, "cuStreamWriteValue64");
            Py_XDECREF(r);
            ok = 0;
        }
    }
    ok = ok && PyDict_SetItem(q->events, vo, ev) == 0;
    if (ok && (ok = call_void(q->qlock_acquire) == 0)) {
        Py_ssize_t demanded = q->demanded, queued = PyObject_Size(q->unwatched);
        PyObject *r = NULL;
        if (!PyErr_Occurred()) {
            if (demanded < v && queued < q->unwatched_max) {
                PyObject *pair = PyTuple_Pack(2, ev, vo);
                r = pair == NULL ? NULL : PyObject_CallFunctionObjArgs(q->unwatched_append, pair, NULL);
                Py_XDECREF(pair);
            } else
                r = PyObject_CallFunctionObjArgs(q->watch, ev, vo, NULL);
        }
        ok = r != NULL;
        Py_XDECREF(r);
        if (call_keeping_error(q->qlock_release) < 0)
            ok = 0;
    }
    Py_XDECREF(ev);
    Py_XDECREF(vo);
    return ok ? v : -1;
}

/* the run's record (azyx.device.RunRecord: its span on the device, its inputs' runs that may still fail) */
static PyObject *lane_record(LaneObject *self, PyObject **bufs, Py_ssize_t v) {
    QueueObject *q = self->queue;
    PyObject *parents = PyList_New(0);
    int good = parents != NULL;
    for (Py_ssize_t s = 0; good && s < self->n_inputs; s++) {
        PyObject *run = PyObject_GetAttr(bufs[s], s_run);
        if (run != NULL && run != Py_None) {
            PyObject *clean = PyObject_GetAttr(run, s_clean);
            good = clean != NULL && (clean == Py_True || PyList_Append(parents, run) == 0);
            Py_XDECREF(clean);
        }
        good = good && run != NULL;
        Py_XDECREF(run);
    }
    PyObject *record = good ? PyObject_CallFunctionObjArgs(q->record_type, parents, NULL) : NULL;
    Py_XDECREF(parents);
    PyObject *spans = record != NULL ? PyObject_GetAttr(record, s_spans) : NULL;
    PyObject *span = spans != NULL ? Py_BuildValue("(nn)", v - 1, v) : NULL;
    if (span == NULL || PyDict_SetItem(spans, q->device, span) < 0)
        Py_CLEAR(record);
    Py_XDECREF(span);
    Py_XDECREF(spans);
    return record;
}

/* lane(bindings, scalars) -> [(buffer, view)] of the plan's outputs, or None where the device's batch path must run it */
static PyObject *lane_call(LaneObject *self, PyObject *args, PyObject *kwds) {
    QueueObject *q = self->queue;
    PyObject *bindings, *scalars;
    if (!PyArg_ParseTuple(args, "O!O", &PyList_Type, &bindings, &scalars))
        return NULL;
    if (PyList_Size(bindings) != self->n_inputs) {
        PyErr_Format(PyExc_ValueError, "Lane: %zd bindings for %zd inputs", PyList_Size(bindings), self->n_inputs);
        return NULL;
    }
    PyObject *failure = PyObject_GetAttr(q->timeline, s_failure);
    if (failure == NULL)
        return NULL;
    Py_DECREF(failure);
    if (failure != Py_None) /* (raises its DeviceFailedError) */
        return call_void(q->check_alive) < 0 ? NULL : PyErr_Format(PyExc_AssertionError, "Lane: a failed device");
    PyObject *local_bufs[16], **bufs = local_bufs;
    Py_ssize_t local_raw[16], *raw = local_raw; /* per slot: the size of the raw pool block bufs[s] is, else 0 */
    if (self->n_slots > 16) {
        bufs = (PyObject **)calloc((size_t)self->n_slots, sizeof(PyObject *));
        raw = (Py_ssize_t *)calloc((size_t)self->n_slots, sizeof(Py_ssize_t));
        if (bufs == NULL || raw == NULL) {
            free(bufs);
            free(raw);
            return PyErr_NoMemory();
        }
    }
    for (Py_ssize_t s = 0; s < self->n_slots; s++) {
        bufs[s] = s < self->n_inputs ? PyList_GetItem(bindings, s) : NULL;
        Py_XINCREF(bufs[s]);
        raw[s] = 0;
    }
    PyObject *out = NULL, *done = PyList_New(0), *record = NULL;
    Py_ssize_t v = -1;
    if (done == NULL || call_void(q->lock_acquire) < 0)
        goto end;
    Py_ssize_t deferred = PyObject_Size(q->deferred);
    if (q->batch != Py_None || deferred != 0) { /* (a batch open, a deferred command first, or an error) */
        int failed = call_keeping_error(q->lock_release) < 0 || PyErr_Occurred();
        if (!failed) {
            Py_INCREF(Py_None);
            out = Py_None;
        }
        goto end;
    }
    /* what completed work held goes back to the pools before the plan allocates (CUDADevice.begin_batch) */
    int ok = queue_take_done(q, done) == 0;
    for (Py_ssize_t k = 0; ok && k < self->n_outs; k++) {
        Py_ssize_t s = self->args[k];
        if (bufs[s] == NULL)
            ok = (bufs[s] = lane_take(q, self->sizes[s], &raw[s])) != NULL;
    }
    if (ok)
        v = lane_submit(self, bufs, raw, scalars);
    if (call_keeping_error(q->lock_release) < 0)
        v = -1;
    if (v < 0)
        goto end;
    PyObject *vo = PyLong_FromSsize_t(v);
    int good = vo != NULL;
    for (Py_ssize_t k = 0; good && k < self->n_outs; k++)
        good = PyObject_SetAttr(bufs[self->args[k]], s_ready, vo) == 0;
    Py_XDECREF(vo);
    record = good ? lane_record(self, bufs, v) : NULL;
    Py_ssize_t n_out = PyTuple_Size(self->outputs);
    out = record != NULL ? PyList_New(n_out) : NULL;
    for (Py_ssize_t k = 0; out != NULL && k < n_out; k++) {
        PyObject *o = PyTuple_GetItem(self->outputs, k);
        PyObject *b = bufs[PyLong_AsSsize_t(PyTuple_GetItem(o, 0))];
        PyObject *pair = b != NULL && PyObject_SetAttr(b, s_run, record) == 0 ?
                         PyTuple_Pack(2, b, PyTuple_GetItem(o, 1)) : NULL;
        if (pair == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_AssertionError, "Lane: an output slot no kernel wrote");
            Py_CLEAR(out);
            break;
        }
        PyList_SetItem(out, k, pair);
    }
end:
    for (Py_ssize_t s = 0; s < self->n_slots; s++) {
        if (raw[s]) /* (taken for a run that did not launch) */
            lane_give(q, bufs[s], raw[s]);
        Py_XDECREF(bufs[s]);
    }
    if (bufs != local_bufs) {
        free(bufs);
        free(raw);
    }
    Py_XDECREF(record);
    if (done != NULL) { /* what completed work held goes back to the pools outside the lock */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        Py_DECREF(done);
        PyErr_Restore(type, value, tb);
    }
    return out;
}

static int lane_traverse(LaneObject *self, visitproc visit, void *arg) {
    Py_VISIT((PyObject *)self->queue);
    Py_VISIT(self->outputs);
    Py_VISIT(self->pack);
    Py_VISIT(self->last_scalars);
    Py_VISIT(self->last_words);
    Py_VISIT(self->function);
    Py_VISIT(self->grid_t);
    Py_VISIT(self->slots_t);
    Py_VISIT(self->sizes_t);
    return 0;
}

static int lane_clear(LaneObject *self) {
    Py_CLEAR(self->queue);
    Py_CLEAR(self->outputs);
    Py_CLEAR(self->pack);
    Py_CLEAR(self->last_scalars);
    Py_CLEAR(self->last_words);
    Py_CLEAR(self->function);
    Py_CLEAR(self->grid_t);
    Py_CLEAR(self->slots_t);
    Py_CLEAR(self->sizes_t);
    return 0;
}

static void lane_dealloc(LaneObject *self) {
    free(self->args);
    free(self->sizes);
    self->args = NULL;
    self->sizes = NULL;
    dealloc_tracked((PyObject *)self, (inquiry)lane_clear);
}

static PyMemberDef lane_members[] = {
    {"queue", T_OBJECT, offsetof(LaneObject, queue), READONLY, "the device's native.Queue"},
    {"function", T_OBJECT, offsetof(LaneObject, function), READONLY, "the kernel's CUfunction handle"},
    {"grid", T_OBJECT, offsetof(LaneObject, grid_t), READONLY, "the launch's grid"},
    {"block", T_UINT, offsetof(LaneObject, block), READONLY, "threads per block"},
    {"smem", T_UINT, offsetof(LaneObject, smem), READONLY, "dynamic shared memory, bytes"},
    {"slots", T_OBJECT, offsetof(LaneObject, slots_t), READONLY, "the kernel's arguments as plan slots"},
    {"outs", T_PYSSIZET, offsetof(LaneObject, n_outs), READONLY, "how many of them (the first) it writes"},
    {"n_inputs", T_PYSSIZET, offsetof(LaneObject, n_inputs), READONLY, "the plan's bound inputs"},
    {"sizes", T_OBJECT, offsetof(LaneObject, sizes_t), READONLY, "bytes per slot the lane allocates (-1: an input)"},
    {"outputs", T_OBJECT, offsetof(LaneObject, outputs), READONLY, "the plan's outputs: (slot, view)"},
    {"pack", T_OBJECT, offsetof(LaneObject, pack), READONLY, "the scalar words' packer, or None"},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot lane_slots[] = {
    {Py_tp_members, lane_members},
    {Py_tp_doc, "Lane(queue, function, grid, block, smem, slots, outs, n_inputs, sizes, outputs, pack): "
                "lane(bindings, scalars) runs a plan of one kernel on a CUDA device (see CUDADevice.lane)."},
    {Py_tp_new, lane_new},
    {Py_tp_call, lane_call},
    {Py_tp_traverse, lane_traverse},
    {Py_tp_clear, lane_clear},
    {Py_tp_dealloc, lane_dealloc},
    {0, NULL},
};

PyType_Spec lane_spec = {"azyx._native.Lane", sizeof(LaneObject), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
                                lane_slots};
