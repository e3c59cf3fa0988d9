#include "native.h"

/* ------------------------------------------------------------------------------------------ the pool's free lists */

/* Pool(capacity, cache_limit, lowest): the caching allocator's free lists and counts (azyx.allocator.PoolAllocator),
 * each call one step under the GIL: a free from a finalizer, on any thread, can never find it half done. Blocks are
 * any objects; with `lowest` they are ints (addresses) and a request takes the lowest cached one of its size. */
Py_ssize_t bucket_of(Py_ssize_t nbytes) { /* azyx.allocator.bucket */
    if (nbytes < 1)
        nbytes = 1;
    if (nbytes <= 4096) {
        Py_ssize_t b = 64;
        while (b < nbytes)
            b <<= 1;
        return b;
    }
    Py_ssize_t gran = nbytes <= (1 << 20) ? 4096 : (1 << 16);
    return (nbytes + gran - 1) / gran * gran;
}

static int less(PyObject *a, PyObject *b) { return PyObject_RichCompareBool(a, b, Py_LT); }

/* heapq's push and pop on a list (the lowest first) */
static int heap_push(PyObject *heap, PyObject *item) {
    if (PyList_Append(heap, item) < 0)
        return -1;
    Py_ssize_t k = PyList_Size(heap) - 1;
    while (k > 0) {
        Py_ssize_t parent = (k - 1) / 2;
        PyObject *p = PyList_GetItem(heap, parent), *c = PyList_GetItem(heap, k);
        int lt = less(c, p);
        if (lt < 0)
            return -1;
        if (!lt)
            break;
        Py_INCREF(p);
        Py_INCREF(c);
        PyList_SetItem(heap, parent, c);
        PyList_SetItem(heap, k, p);
        k = parent;
    }
    return 0;
}

PyObject *list_pop_last(PyObject *list) {
    Py_ssize_t n = PyList_Size(list);
    PyObject *last = PyList_GetItem(list, n - 1);
    Py_INCREF(last);
    if (PyList_SetSlice(list, n - 1, n, NULL) < 0) {
        Py_DECREF(last);
        return NULL;
    }
    return last;
}

static PyObject *heap_pop(PyObject *heap) {
    PyObject *last = list_pop_last(heap);
    Py_ssize_t n = PyList_Size(heap);
    if (last == NULL || n == 0)
        return last;
    PyObject *top = PyList_GetItem(heap, 0);
    Py_INCREF(top);
    PyList_SetItem(heap, 0, last); /* (steals last) */
    Py_ssize_t k = 0;
    for (;;) {
        Py_ssize_t child = 2 * k + 1;
        if (child >= n)
            break;
        if (child + 1 < n) {
            int lt = less(PyList_GetItem(heap, child + 1), PyList_GetItem(heap, child));
            if (lt < 0)
                goto fail;
            child += lt;
        }
        int lt = less(PyList_GetItem(heap, child), PyList_GetItem(heap, k));
        if (lt < 0)
            goto fail;
        if (!lt)
            break;
        PyObject *c = PyList_GetItem(heap, child), *p = PyList_GetItem(heap, k);
        Py_INCREF(c);
        Py_INCREF(p);
        PyList_SetItem(heap, k, c);
        PyList_SetItem(heap, child, p);
        k = child;
    }
    return top;
fail:
    Py_DECREF(top);
    return NULL;
}

static PyObject *pool_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Py_ssize_t capacity, cache_limit;
    int lowest;
    if (!PyArg_ParseTuple(args, "nnp", &capacity, &cache_limit, &lowest))
        return NULL;
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    PoolObject *self = (PoolObject *)alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->lists = PyDict_New();
    if (self->lists == NULL) {
        Py_DECREF((PyObject *)self);
        return NULL;
    }
    self->capacity = capacity;
    self->cache_limit = cache_limit;
    self->lowest = lowest;
    return (PyObject *)self;
}

/* A cached block of `size` bytes (a new reference), or NULL with no exception when none is cached. */
PyObject *pool_pop(PoolObject *self, Py_ssize_t size) {
    PyObject *key = PyLong_FromSsize_t(size);
    if (key == NULL)
        return NULL;
    PyObject *lst = PyDict_GetItemWithError(self->lists, key); /* (borrowed) */
    Py_DECREF(key);
    if (lst == NULL || PyList_Size(lst) == 0)
        return NULL;
    PyObject *mem = self->lowest ? heap_pop(lst) : list_pop_last(lst);
    if (mem != NULL)
        self->cached -= size;
    return mem;
}

/* take(nbytes) -> (block, size): a cached block, or (None, size) for the caller to make one (counted in use already);
 * None when the request is over the capacity. */
static PyObject *pool_take(PoolObject *self, PyObject *arg) {
    Py_ssize_t nbytes = PyLong_AsSsize_t(arg);
    if (nbytes == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t size = bucket_of(nbytes);
    PyObject *mem = pool_pop(self, size);
    if (mem == NULL) {
        if (PyErr_Occurred())
            return NULL;
        if (self->in_use + size > self->capacity)
            Py_RETURN_NONE;
        Py_INCREF(Py_None);
        mem = Py_None;
    }
    self->in_use += size;
    PyObject *out = Py_BuildValue("(On)", mem, size);
    Py_DECREF(mem);
    return out;
}

/* take_many(sizes) -> [(block or None, size)], all or none: the index of the first request over the capacity when
 * one is (nothing taken then) */
static PyObject *pool_take_many(PoolObject *self, PyObject *sizes) {
    Py_ssize_t n = PySequence_Size(sizes);
    if (n < 0)
        return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *item = PySequence_GetItem(sizes, k), *got = item ? pool_take(self, item) : NULL;
        Py_XDECREF(item);
        if (got == Py_None || got == NULL) { /* give back what this call took */
            for (Py_ssize_t j = 0; j < PyList_Size(out); j++) {
                PyObject *pair = PyList_GetItem(out, j);
                PyObject *mem = PyTuple_GetItem(pair, 0);
                Py_ssize_t size = PyLong_AsSsize_t(PyTuple_GetItem(pair, 1));
                self->in_use -= size;
                if (mem != Py_None) {
                    PyObject *key = PyLong_FromSsize_t(size);
                    PyObject *lst = key ? PyDict_GetItemWithError(self->lists, key) : NULL;
                    Py_XDECREF(key);
                    if (lst != NULL && (self->lowest ? heap_push(lst, mem) : PyList_Append(lst, mem)) == 0)
                        self->cached += size;
                }
            }
            Py_DECREF(out);
            if (got == NULL)
                return NULL;
            Py_DECREF(got);
            return PyLong_FromSsize_t(k);
        }
        int bad = PyList_Append(out, got);
        Py_DECREF(got);
        if (bad < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

/* give(block, size): the block back (None: only its size leaves the in-use count); cached while under the limit */
static PyObject *pool_give(PoolObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "give(block, size)");
        return NULL;
    }
    PyObject *mem = args[0];
    Py_ssize_t size = PyLong_AsSsize_t(args[1]);
    if (size == -1 && PyErr_Occurred())
        return NULL;
    self->in_use -= size;
    if (mem == Py_None || self->cached + size > self->cache_limit)
        Py_RETURN_NONE;
    PyObject *key = PyLong_FromSsize_t(size);
    if (key == NULL)
        return NULL;
    PyObject *lst = PyDict_GetItemWithError(self->lists, key);
    if (lst == NULL) {
        if (PyErr_Occurred() || (lst = PyList_New(0)) == NULL || PyDict_SetItem(self->lists, key, lst) < 0) {
            Py_XDECREF(lst);
            Py_DECREF(key);
            return NULL;
        }
        Py_DECREF(lst); /* (the dict holds it) */
    }
    Py_DECREF(key);
    if ((self->lowest ? heap_push(lst, mem) : PyList_Append(lst, mem)) < 0)
        return NULL;
    self->cached += size;
    Py_RETURN_NONE;
}

/* reuse(nbytes) -> (block, size) of a cached block, or None: never one to make */
static PyObject *pool_reuse(PoolObject *self, PyObject *arg) {
    Py_ssize_t nbytes = PyLong_AsSsize_t(arg);
    if (nbytes == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t size = bucket_of(nbytes);
    PyObject *mem = pool_pop(self, size);
    if (mem == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    self->in_use += size;
    PyObject *out = Py_BuildValue("(On)", mem, size);
    Py_DECREF(mem);
    return out;
}

/* drain() -> {size: [blocks]}: every cached block, out of the free lists */
static PyObject *pool_drain(PoolObject *self, PyObject *unused) {
    PyObject *fresh = PyDict_New();
    if (fresh == NULL)
        return NULL;
    PyObject *lists = self->lists;
    self->lists = fresh;
    self->cached = 0;
    return lists;
}

/* blocks(size) -> a list of the blocks cached under bucketed size `size` */
static PyObject *pool_blocks(PoolObject *self, PyObject *arg) {
    PyObject *lst = PyDict_GetItemWithError(self->lists, arg);
    if (lst == NULL)
        return PyErr_Occurred() ? NULL : PyList_New(0);
    return PyList_GetSlice(lst, 0, PyList_Size(lst));
}

/* account(delta): bytes that left (or came into) use outside the free lists (host data a buffer wraps) */
static PyObject *pool_account(PoolObject *self, PyObject *arg) {
    Py_ssize_t delta = PyLong_AsSsize_t(arg);
    if (delta == -1 && PyErr_Occurred())
        return NULL;
    self->in_use += delta;
    Py_RETURN_NONE;
}

static PyObject *pool_usage(PoolObject *self, PyObject *unused) {
    return Py_BuildValue("(nn)", self->in_use, self->cached);
}

static PyMethodDef pool_methods[] = {
    {"take", (PyCFunction)pool_take, METH_O, "take(nbytes) -> (block or None, size), None over the capacity"},
    {"take_many", (PyCFunction)pool_take_many, METH_O, "take_many(sizes) -> [(block or None, size)] or None"},
    {"give", (PyCFunction)(void (*)(void))pool_give, METH_FASTCALL, "give(block, size)"},
    {"reuse", (PyCFunction)pool_reuse, METH_O, "reuse(nbytes) -> (block, size) or None"},
    {"drain", (PyCFunction)pool_drain, METH_NOARGS, "drain() -> {size: [blocks]}: every cached block"},
    {"blocks", (PyCFunction)pool_blocks, METH_O, "blocks(size) -> the blocks cached under bucketed size `size`"},
    {"account", (PyCFunction)pool_account, METH_O, "account(delta): bytes in use outside the free lists"},
    {"usage", (PyCFunction)pool_usage, METH_NOARGS, "usage() -> (in use, cached)"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef pool_members[] = {
    {"in_use", T_PYSSIZET, offsetof(PoolObject, in_use), READONLY, NULL},
    {"cached", T_PYSSIZET, offsetof(PoolObject, cached), READONLY, NULL},
    {"capacity", T_PYSSIZET, offsetof(PoolObject, capacity), 0, NULL},
    {"cache_limit", T_PYSSIZET, offsetof(PoolObject, cache_limit), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static int pool_traverse(PoolObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE((PyObject *)self));
    Py_VISIT(self->lists);
    return 0;
}

static int pool_clear(PoolObject *self) {
    Py_CLEAR(self->lists);
    return 0;
}

static void pool_dealloc(PoolObject *self) { dealloc_tracked((PyObject *)self, (inquiry)pool_clear); }

static PyType_Slot pool_slots[] = {
    {Py_tp_doc, "Pool(capacity, cache_limit, lowest): the caching allocator's free lists and counts"},
    {Py_tp_new, pool_new},
    {Py_tp_methods, pool_methods},
    {Py_tp_members, pool_members},
    {Py_tp_traverse, pool_traverse},
    {Py_tp_clear, pool_clear},
    {Py_tp_dealloc, pool_dealloc},
    {0, NULL},
};

PyType_Spec pool_spec = {"azyx._native.Pool", sizeof(PoolObject), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
                                pool_slots};
