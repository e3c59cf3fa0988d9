#include "native.h"

/* ------------------------------------------------------------------------------- a batch's call into a C runtime */

/* TableCall(run, n, fns, table, slots, argc, kinds, trips): a call of `run(pool, n, fns, table, argc, kinds, trips)`
 * (the C backend's azyx_run) whose 64-bit table of `slots` words each call fills first. Addresses only: whoever makes
 * it keeps the memory they point at alive. Called with the GIL held: it is for batches small enough to run inline. */
typedef void (*table_run_fn)(void *, long, void *, void *, const void *, const void *, const void *);

typedef struct {
    PyObject_HEAD
    table_run_fn run;
    long n;
    void *fns, *argc, *kinds, *trips;
    uint64_t *table;
    Py_ssize_t slots;
} TableCallObject;

static void *as_address(PyObject *v) { return PyLong_AsVoidPtr(v); }

static PyObject *table_call_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *run, *fns, *table, *argc, *kinds, *trips;
    long n;
    Py_ssize_t slots;
    if (!PyArg_ParseTuple(args, "OlOOnOOO", &run, &n, &fns, &table, &slots, &argc, &kinds, &trips))
        return NULL;
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    TableCallObject *self = (TableCallObject *)alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->run = (table_run_fn)as_address(run);
    self->n = n;
    self->fns = as_address(fns);
    self->table = (uint64_t *)as_address(table);
    self->slots = slots;
    self->argc = as_address(argc);
    self->kinds = as_address(kinds);
    self->trips = as_address(trips);
    if (PyErr_Occurred() || self->run == NULL || self->table == NULL) {
        Py_DECREF((PyObject *)self);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "TableCall: a null function or table");
        return NULL;
    }
    return (PyObject *)self;
}

/* call(pool, values): the table's words are `values` (ints, as many as it has slots), then the call */
static PyObject *table_call_call(TableCallObject *self, PyObject *args, PyObject *kwds) {
    PyObject *pool, *values;
    if (!PyArg_ParseTuple(args, "OO", &pool, &values))
        return NULL;
    if (!PyList_Check(values) || PyList_Size(values) != self->slots) {
        PyErr_Format(PyExc_ValueError, "TableCall: %zd values for a table of %zd", PyList_Check(values) ?
                     PyList_Size(values) : (Py_ssize_t)-1, self->slots);
        return NULL;
    }
    for (Py_ssize_t k = 0; k < self->slots; k++) {
        unsigned long long w = PyLong_AsUnsignedLongLongMask(PyList_GetItem(values, k));
        if (w == (unsigned long long)-1 && PyErr_Occurred())
            return NULL;
        self->table[k] = (uint64_t)w;
    }
    void *p = as_address(pool);
    if (p == NULL && PyErr_Occurred())
        return NULL;
    self->run(p, self->n, self->fns, self->table, self->argc, self->kinds, self->trips);
    Py_RETURN_NONE;
}

static void table_call_dealloc(TableCallObject *self) {
    PyTypeObject *type = Py_TYPE((PyObject *)self);
    freefunc free_ = (freefunc)PyType_GetSlot(type, Py_tp_free);
    free_(self);
    Py_DECREF(type);
}

static PyType_Slot table_call_slots[] = {
    {Py_tp_doc, "TableCall(run, n, fns, table, slots, argc, kinds, trips): call(pool, values) fills the table with "
                "`values` and calls run(pool, n, fns, table, argc, kinds, trips), holding the GIL."},
    {Py_tp_new, table_call_new},
    {Py_tp_call, table_call_call},
    {Py_tp_dealloc, table_call_dealloc},
    {0, NULL},
};

PyType_Spec table_call_spec = {"azyx._native.TableCall", sizeof(TableCallObject), 0, Py_TPFLAGS_DEFAULT,
                                      table_call_slots};


/* --------------------------------------------------------------------------------------- a run's scalar arguments */

/* pack_words(codes, at, scalars) -> tuple of ints: the 64-bit words that carry scalars[at[k]] to a kernel, each as
 * struct code codes[k] packs it (azyx.dtypes.SCALAR_CODES) in its low bytes, the rest zero: "f" a float32's bits, "d" a
 * float64's, "b" "B" "h" "i" "I" "q" an integer wrapped into that many bits (as PyTorch wraps a scalar into an int
 * tensor's dtype). A float out of float32's range raises OverflowError, as struct does. */
PyObject *pack_words(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyBytes_Check(args[0]) || !PyTuple_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "pack_words(codes: bytes, at: tuple, scalars)");
        return NULL;
    }
    const char *codes = PyBytes_AsString(args[0]);
    Py_ssize_t n = PyBytes_Size(args[0]);
    if (PyTuple_Size(args[1]) != n) {
        PyErr_SetString(PyExc_ValueError, "pack_words: as many positions as codes");
        return NULL;
    }
    PyObject *out = PyTuple_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GetItem(args[1], k));
        PyObject *v = at < 0 ? NULL : PySequence_GetItem(args[2], at);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        u64 w = 0;
        int bad = 0;
        char c = codes[k];
        if (c == 'f' || c == 'd') {
            double d = PyFloat_AsDouble(v);
            bad = d == -1.0 && PyErr_Occurred();
            if (!bad && c == 'f') {
                float f = (float)d;
                if (isinf(f) && !isinf(d)) {
                    PyErr_SetString(PyExc_OverflowError, "float too large to pack with f format");
                    bad = 1;
                }
                uint32_t bits;
                memcpy(&bits, &f, 4);
                w = bits;
            } else if (!bad)
                memcpy(&w, &d, 8);
        } else {
            PyObject *i = PyNumber_Long(v);
            bad = i == NULL;
            if (!bad) {
                w = (u64)PyLong_AsUnsignedLongLongMask(i);
                bad = w == (u64)-1 && PyErr_Occurred();
                Py_DECREF(i);
            }
            int bits = c == 'b' || c == 'B' ? 8 : c == 'h' ? 16 : c == 'i' || c == 'I' ? 32 : 64;
            if (bits < 64)
                w &= ((u64)1 << bits) - 1;
        }
        Py_DECREF(v);
        PyObject *word = bad ? NULL : PyLong_FromUnsignedLongLong(w);
        if (word == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SetItem(out, k, word);
    }
    return out;
}

/* ------------------------------------------------------------------------------------ calls of a driver's functions */

int as_u64(PyObject *v, u64 *out) {
    if (v == Py_None) {
        *out = 0;
        return 0;
    }
    *out = (u64)PyLong_AsUnsignedLongLongMask(v);
    return (*out == (u64)-1 && PyErr_Occurred()) ? -1 : 0;
}

/* call(fn, *args) -> int: the int that the C function at address `fn` returns, called with up to 11 arguments that
 * are each an integer or a pointer (as a Python int; None is 0), passed as 64 bits (what x86-64's and AArch64's calling
 * conventions make of any narrower integer parameter too). The GIL stays held: for calls that return at once. */
PyObject *call(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 12) {
        PyErr_SetString(PyExc_TypeError, "call(fn, *args): a function and at most 11 arguments");
        return NULL;
    }
    u64 a[11] = {0};
    void *fn = PyLong_AsVoidPtr(args[0]);
    if (fn == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "call: a null function");
        return NULL;
    }
    for (Py_ssize_t k = 1; k < nargs; k++)
        if (as_u64(args[k], &a[k - 1]) < 0)
            return NULL;
    typedef int (*f11)(u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64);
    /* (extra arguments are harmless to a callee that takes fewer: the caller cleans up, in both conventions) */
    int r = ((f11)fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10]);
    return PyLong_FromLong(r);
}

/* call_out(fn, *args) -> int: the 64-bit value the C function at `fn` writes through its first parameter (a pointer),
 * called with up to 10 more integer or pointer arguments after it; 0 when it returns an error (a nonzero int). */
PyObject *call_out(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 11) {
        PyErr_SetString(PyExc_TypeError, "call_out(fn, *args): a function and at most 10 arguments");
        return NULL;
    }
    u64 a[10] = {0}, out = 0;
    void *fn = PyLong_AsVoidPtr(args[0]);
    if (fn == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "call_out: a null function");
        return NULL;
    }
    for (Py_ssize_t k = 1; k < nargs; k++)
        if (as_u64(args[k], &a[k - 1]) < 0)
            return NULL;
    typedef int (*f11)(u64 *, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64);
    int r = ((f11)fn)(&out, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9]);
    return PyLong_FromUnsignedLongLong(r ? 0 : out);
}

/* launch_kernel(cuLaunchKernel, f, gx, gy, gz, bx, by, bz, smem, stream, values) -> CUresult: a launch whose kernel
 * parameters are `values` (ints: each a 64-bit value the kernel reads as many low bytes of as its parameter has),
 * pointed at from a table made here (the driver copies the parameters at launch). */
PyObject *launch_kernel(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "launch_kernel(fn, f, gx, gy, gz, bx, by, bz, smem, stream, values)");
        return NULL;
    }
    u64 a[9];
    void *fn = PyLong_AsVoidPtr(args[0]);
    if (fn == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "launch_kernel: a null function");
        return NULL;
    }
    for (int k = 0; k < 9; k++)
        if (as_u64(args[k + 1], &a[k]) < 0)
            return NULL;
    PyObject *values = args[10];
    Py_ssize_t n = PyTuple_Check(values) ? PyTuple_Size(values) : PyList_Check(values) ? PyList_Size(values) : -1;
    if (n < 0) {
        PyErr_SetString(PyExc_TypeError, "launch_kernel: values must be a tuple or list of ints");
        return NULL;
    }
    u64 local_vals[MAX_PARAMS], *vals = local_vals;
    void *local_params[MAX_PARAMS], **params = local_params;
    if (n > MAX_PARAMS) { /* (a long chain's hundreds of scalars) */
        vals = (u64 *)malloc((size_t)n * sizeof(u64));
        params = (void **)malloc((size_t)n * sizeof(void *));
        if (vals == NULL || params == NULL) {
            free(vals);
            free(params);
            return PyErr_NoMemory();
        }
    }
    int bad = 0;
    for (Py_ssize_t k = 0; k < n && !bad; k++) {
        PyObject *v = PyTuple_Check(values) ? PyTuple_GetItem(values, k) : PyList_GetItem(values, k);
        bad = as_u64(v, &vals[k]) < 0;
        params[k] = &vals[k];
    }
    int r = 0;
    if (!bad) {
        typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                                 void **, void **);
        r = ((launch_fn)fn)((void *)(uintptr_t)a[0], (unsigned)a[1], (unsigned)a[2], (unsigned)a[3], (unsigned)a[4],
                            (unsigned)a[5], (unsigned)a[6], (unsigned)a[7], (void *)(uintptr_t)a[8], params, NULL);
    }
    if (vals != local_vals) {
        free(vals);
        free(params);
    }
    return bad ? NULL : PyLong_FromLong(r);
}
