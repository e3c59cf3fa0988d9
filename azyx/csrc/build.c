#include "native.h"

/* ------------------------------------------------------------------------------------------- building: x op y */

/* what setup_tensor() tells the operators: the handle type, the graph and its lists, the dtypes by kind */
PyObject *tensor_type, *graph_obj, *graph_nodes, *graph_free, *float_dtypes, *int_dtypes, *disk_name;

static PyObject *method_type; /* types.MethodType: what `t.__add__` gives (Method below) */

PyObject *setup_tensor(PyObject *mod, PyObject *args) {
    PyObject *tt, *g, *fl, *in, *disk, *mt;
    if (!PyArg_ParseTuple(args, "OOOOOO", &tt, &g, &fl, &in, &disk, &mt))
        return NULL;
    Py_INCREF(mt);
    Py_XDECREF(method_type);
    method_type = mt;
    PyObject *nodes = PyObject_GetAttrString(g, "nodes"), *free_ = PyObject_GetAttrString(g, "free");
    if (nodes == NULL || free_ == NULL || !PyList_Check(nodes) || !PyList_Check(free_) || !PyTuple_Check(fl) ||
        !PyTuple_Check(in)) {
        Py_XDECREF(nodes);
        Py_XDECREF(free_);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "setup_tensor(Tensor, graph, float dtypes, int dtypes, disk, MethodType)");
        return NULL;
    }
    PyObject **slots[7] = {&tensor_type, &graph_obj, &graph_nodes, &graph_free, &float_dtypes, &int_dtypes, &disk_name};
    PyObject *vals[7] = {tt, g, nodes, free_, fl, in, disk};
    for (int k = 0; k < 7; k++) {
        if (k != 2 && k != 3)
            Py_INCREF(vals[k]);
        Py_XDECREF(*slots[k]);
        *slots[k] = vals[k];
    }
    Py_RETURN_NONE;
}

static int in_tuple(PyObject *tuple, PyObject *x) {
    Py_ssize_t n = PyTuple_Size(tuple);
    for (Py_ssize_t k = 0; k < n; k++)
        if (PyTuple_GetItem(tuple, k) == x)
            return 1;
    return 0;
}

static NodeObject *node_make(PyObject *op, PyObject *src, PyObject *arg, PyObject *shape, PyObject *dtype,
                             PyObject *device, PyObject *pinned, PyObject *arg2) {
    allocfunc alloc = (allocfunc)PyType_GetSlot(node_type, Py_tp_alloc);
    NodeObject *n = (NodeObject *)alloc(node_type, 0);
    if (n == NULL)
        return NULL;
    PyObject *vals[10] = {op, src, arg, arg2, shape, dtype, device, pinned, Py_None, Py_None};
    PyObject **fields[10] = {&n->op, &n->src, &n->arg, &n->arg2, &n->shape, &n->dtype, &n->device, &n->pinned,
                             &n->buffer, &n->view};
    for (int k = 0; k < 10; k++) {
        Py_INCREF(vals[k]);
        *fields[k] = vals[k];
    }
    return n;
}

/* Graph.add: the node takes a free slot (or a new one) and a reference to each source; live tapes record it.
 * Returns the new id (a new reference), or NULL. */
static PyObject *graph_add(NodeObject *node) {
    Py_ssize_t ns = PyTuple_Size(node->src);
    for (Py_ssize_t k = 0; k < ns; k++) {
        NodeObject *s = node_at(graph_nodes, PyLong_AsSsize_t(PyTuple_GetItem(node->src, k)));
        if (s == NULL)
            return NULL;
        s->rc++;
    }
    PyObject *id;
    Py_ssize_t nf = PyList_Size(graph_free);
    if (nf > 0) {
        id = PyList_GetItem(graph_free, nf - 1);
        Py_INCREF(id);
        if (PyList_SetSlice(graph_free, nf - 1, nf, NULL) < 0) {
            Py_DECREF(id);
            return NULL;
        }
        Py_INCREF((PyObject *)node);
        if (PyList_SetItem(graph_nodes, PyLong_AsSsize_t(id), (PyObject *)node) < 0) {
            Py_DECREF(id);
            return NULL;
        }
    } else {
        id = PyLong_FromSsize_t(PyList_Size(graph_nodes));
        if (id == NULL || PyList_Append(graph_nodes, (PyObject *)node) < 0) {
            Py_XDECREF(id);
            return NULL;
        }
    }
    PyObject *recording = PyObject_GetAttr(graph_obj, s_recording);
    if (recording == NULL) {
        Py_DECREF(id);
        return NULL;
    }
    Py_ssize_t nr = PyList_Check(recording) ? PyList_Size(recording) : 0;
    for (Py_ssize_t k = 0; k < nr; k++)
        if (PySet_Add(PyList_GetItem(recording, k), id) < 0) {
            Py_DECREF(recording);
            Py_DECREF(id);
            return NULL;
        }
    Py_DECREF(recording);
    return id;
}

static NodeObject *handle_node(PyObject *handle) {
    PyObject *id = PyObject_GetAttr(handle, s_id);
    if (id == NULL)
        return NULL;
    Py_ssize_t i = PyLong_AsSsize_t(id);
    Py_DECREF(id);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    return node_at(graph_nodes, i);
}

/* A new handle of the node: added to the graph, its count one (the handle's). */
static PyObject *new_handle(NodeObject *node) {
    PyObject *id = graph_add(node);
    if (id == NULL)
        return NULL;
    allocfunc alloc = (allocfunc)PyType_GetSlot((PyTypeObject *)tensor_type, Py_tp_alloc);
    PyObject *t = alloc((PyTypeObject *)tensor_type, 0);
    if (t == NULL || PyObject_SetAttr(t, s_id, id) < 0) {
        /* (the node stays in the graph unreferenced: the same as a Python failure at this point) */
        Py_XDECREF(t);
        Py_DECREF(id);
        return NULL;
    }
    Py_DECREF(id);
    node->rc++;
    return t;
}

/* realized(shape, dtype, device, pinned, buffer, view) -> a handle of a new leaf node that holds `buffer` seen through
 * `view` (azyx.jit's replay: Tensor._realized) */
PyObject *realized(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || tensor_type == NULL || op_leaf == NULL) {
        PyErr_SetString(PyExc_TypeError, "realized(shape, dtype, device, pinned, buffer, view), after setup_tensor");
        return NULL;
    }
    PyObject *empty = PyTuple_New(0);
    NodeObject *n = empty == NULL ? NULL : node_make(op_leaf, empty, Py_None, args[0], args[1], args[2], args[3],
                                                     Py_None);
    Py_XDECREF(empty);
    if (n == NULL)
        return NULL;
    Py_INCREF(args[4]);
    Py_INCREF(args[5]);
    Py_DECREF(n->buffer);
    Py_DECREF(n->view);
    n->buffer = args[4];
    n->view = args[5];
    PyObject *t = new_handle(n);
    Py_DECREF((PyObject *)n);
    return t;
}

enum { OUT_BOOL = 1, INT_NUMBERS = 2, FLOAT_OK = 4, REVERSE = 8, FLOAT_KIND = 16, UNARY = 32, REDUCE_ALL = 64 };

/* Whether the Python int `v` surely fits integer dtype `dtype` (one of -128..127 always does; a wider one fits a
 * 4-byte dtype within int32's range and an 8-byte one within int64's). 0 sends it to Python's check (dtypes.check_int),
 * which raises naming it or accepts it (an unsigned dtype's wrapping negatives). */
static int int_fits(PyObject *dtype, PyObject *v) {
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || (x == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    if (x >= -128 && x < 128)
        return 1;
    PyObject *size = PyObject_GetAttrString(dtype, "itemsize");
    long n = size != NULL ? PyLong_AsLong(size) : 0;
    Py_XDECREF(size);
    if (n == -1 && PyErr_Occurred())
        return 0;
    return n == 8 || (n == 4 && x >= -2147483648LL && x <= 2147483647LL);
}

/* binary(op, flags, x, other): the operators' common cases (tensor.py's `_binop`, which says which): a number of
 * the tensor's kind, or a tensor of the same dtype, shape and device. None for anything else: the caller builds it. */
static PyObject *binary_impl(PyObject *op, long flags, PyObject *self, PyObject *other) {
    if (tensor_type == NULL)
        Py_RETURN_NONE;
    NodeObject *na = handle_node(self);
    if (na == NULL)
        return NULL;
    PyTypeObject *tp = Py_TYPE(other);
    PyObject *out_dt = (flags & OUT_BOOL) ? bool_dtype : na->dtype;
    if (tp == &PyFloat_Type || tp == &PyLong_Type) {
        if (na->op == op_const)
            Py_RETURN_NONE;
        int is_float = in_tuple(float_dtypes, na->dtype);
        int ok = (is_float && (flags & FLOAT_OK)) ||
                 (tp == &PyLong_Type && (flags & INT_NUMBERS) && in_tuple(int_dtypes, na->dtype));
        if (!ok || PyObject_RichCompareBool(na->device, disk_name, Py_EQ) != 0)
            Py_RETURN_NONE;
        if (!is_float && !int_fits(na->dtype, other)) { /* an int the dtype may not hold: Python raises */
            if (PyErr_Occurred())
                return NULL;
            Py_RETURN_NONE;
        }
        PyObject *value = (is_float && tp == &PyLong_Type) ? PyNumber_Float(other) : (Py_INCREF(other), other);
        if (value == NULL)
            return NULL;
        PyObject *self_id = PyObject_GetAttr(self, s_id), *src = NULL, *out = NULL;
        NodeObject *node = NULL;
        if (self_id == NULL)
            goto number_done;
        if (!(flags & REVERSE)) { /* x op number: the number is the op's own (Op.BINARY's arg2) */
            src = PyTuple_Pack(1, self_id);
            if (src != NULL)
                node = node_make(op_binary, src, op, na->shape, out_dt, na->device, na->pinned, value);
        } else { /* number op x: a constant */
            PyObject *empty = PyTuple_New(0);
            NodeObject *c = empty ? node_make(op_const, empty, value, na->shape, na->dtype, na->device, na->pinned,
                                              Py_None) : NULL;
            Py_XDECREF(empty);
            PyObject *cid = c ? graph_add(c) : NULL;
            Py_XDECREF((PyObject *)c);
            if (cid != NULL) {
                src = PyTuple_Pack(2, cid, self_id);
                Py_DECREF(cid);
                if (src != NULL)
                    node = node_make(op_binary, src, op, na->shape, out_dt, na->device, na->pinned, Py_None);
            }
        }
        if (node != NULL)
            out = new_handle(node);
    number_done:
        Py_XDECREF((PyObject *)node);
        Py_XDECREF(src);
        Py_XDECREF(self_id);
        Py_DECREF(value);
        return out;
    }
    if ((PyObject *)tp != tensor_type)
        Py_RETURN_NONE;
    NodeObject *nb = handle_node(other);
    if (nb == NULL)
        return NULL;
    if (nb->dtype != na->dtype || (na->op == op_const && nb->op == op_const))
        Py_RETURN_NONE;
    int is_float = in_tuple(float_dtypes, na->dtype);
    if (((flags & FLOAT_KIND) && !is_float) || (!(flags & FLOAT_OK) && is_float))
        Py_RETURN_NONE;
    int same = PyObject_RichCompareBool(nb->device, na->device, Py_EQ);
    if (same != 1)
        return same < 0 ? NULL : (Py_INCREF(Py_None), Py_None);
    same = PyObject_RichCompareBool(nb->shape, na->shape, Py_EQ); /* (broadcasting: the caller's) */
    if (same != 1)
        return same < 0 ? NULL : (Py_INCREF(Py_None), Py_None);
    int disk = PyObject_RichCompareBool(na->device, disk_name, Py_EQ);
    if (disk != 0)
        return disk < 0 ? NULL : (Py_INCREF(Py_None), Py_None);
    int pinned = PyObject_IsTrue(na->pinned);
    if (pinned < 0)
        return NULL;
    PyObject *a_id = PyObject_GetAttr(self, s_id), *b_id = a_id ? PyObject_GetAttr(other, s_id) : NULL;
    PyObject *src = NULL, *out = NULL;
    if (b_id != NULL)
        src = (flags & REVERSE) ? PyTuple_Pack(2, b_id, a_id) : PyTuple_Pack(2, a_id, b_id);
    NodeObject *node = src ? node_make(op_binary, src, op, na->shape, out_dt, na->device,
                                       pinned ? na->pinned : nb->pinned, Py_None) : NULL;
    if (node != NULL)
        out = new_handle(node);
    Py_XDECREF((PyObject *)node);
    Py_XDECREF(src);
    Py_XDECREF(a_id);
    Py_XDECREF(b_id);
    return out;
}

PyObject *binary(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "binary(op, flags, x, other)");
        return NULL;
    }
    long flags = PyLong_AsLong(args[1]);
    if (flags == -1 && PyErr_Occurred())
        return NULL;
    return binary_impl(args[0], flags, args[2], args[3]);
}

/* x.op() for a unary op of a float tensor that is not a constant (tensor.py's `_unary` common case); None else */
static PyObject *unary_impl(PyObject *op, PyObject *self) {
    NodeObject *na = handle_node(self);
    if (na == NULL)
        return NULL;
    if (na->op == op_const || !in_tuple(float_dtypes, na->dtype))
        Py_RETURN_NONE;
    int disk = PyObject_RichCompareBool(na->device, disk_name, Py_EQ);
    if (disk != 0)
        return disk < 0 ? NULL : (Py_INCREF(Py_None), Py_None);
    PyObject *id = PyObject_GetAttr(self, s_id), *src = id ? PyTuple_Pack(1, id) : NULL, *out = NULL;
    NodeObject *node = src ? node_make(op_unary, src, op, na->shape, na->dtype, na->device, na->pinned, Py_None) : NULL;
    if (node != NULL)
        out = new_handle(node);
    Py_XDECREF((PyObject *)node);
    Py_XDECREF(src);
    Py_XDECREF(id);
    return out;
}

/* x.op() over every axis (tensor.py's `_reduce` with no axis, no keepdim): the reduce keeping its axes as 1 and the
 * reshape to () that drops them; None for a bool or 0-d tensor, a constant, an empty axis, a file-backed tensor */
static PyObject *reduce_all_impl(PyObject *op, PyObject *self) {
    NodeObject *na = handle_node(self);
    if (na == NULL)
        return NULL;
    Py_ssize_t nd = PyTuple_Size(na->shape);
    if (na->op == op_const || na->dtype == bool_dtype || nd <= 0)
        Py_RETURN_NONE;
    int disk = PyObject_RichCompareBool(na->device, disk_name, Py_EQ);
    if (disk != 0)
        return disk < 0 ? NULL : (Py_INCREF(Py_None), Py_None);
    PyObject *axes = PyTuple_New(nd), *keep = PyTuple_New(nd);
    int bad = axes == NULL || keep == NULL;
    for (Py_ssize_t k = 0; k < nd && !bad; k++) {
        PyObject *dim = PyTuple_GetItem(na->shape, k);
        if (PyLong_AsSsize_t(dim) == 0) { /* (an empty axis: the caller's errors and rules) */
            Py_XDECREF(axes);
            Py_XDECREF(keep);
            Py_RETURN_NONE;
        }
        PyObject *ax = PyLong_FromSsize_t(k), *one = PyLong_FromLong(1);
        bad = ax == NULL || one == NULL;
        if (!bad) {
            PyTuple_SetItem(axes, k, ax);
            PyTuple_SetItem(keep, k, one);
        } else {
            Py_XDECREF(ax);
            Py_XDECREF(one);
        }
    }
    PyObject *arg = bad ? NULL : PyTuple_Pack(2, op, axes), *id = arg ? PyObject_GetAttr(self, s_id) : NULL;
    PyObject *src = id ? PyTuple_Pack(1, id) : NULL, *rid = NULL, *src2 = NULL, *empty = NULL, *out = NULL;
    NodeObject *red = src ? node_make(op_reduce, src, arg, keep, na->dtype, na->device, na->pinned, Py_None) : NULL;
    NodeObject *node = NULL;
    if (red != NULL && (rid = graph_add(red)) != NULL && (src2 = PyTuple_Pack(1, rid)) != NULL &&
        (empty = PyTuple_New(0)) != NULL)
        node = node_make(op_reshape, src2, empty, empty, na->dtype, na->device, na->pinned, Py_None);
    if (node != NULL)
        out = new_handle(node);
    Py_XDECREF((PyObject *)node);
    Py_XDECREF((PyObject *)red);
    Py_XDECREF(empty);
    Py_XDECREF(src2);
    Py_XDECREF(rid);
    Py_XDECREF(src);
    Py_XDECREF(id);
    Py_XDECREF(arg);
    Py_XDECREF(axes);
    Py_XDECREF(keep);
    return out;
}

/* The handle's finalizer (Tensor.__del__): one reference to its node less. A handle without an id (a failed
 * __init__, interpreter shutdown) has nothing to give back. */
static PyObject *handle_del(PyObject *t) {
    PyObject *id = PyObject_GetAttr(t, s_id);
    if (id == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError) || PyErr_ExceptionMatches(PyExc_TypeError))
            PyErr_Clear();
        return PyErr_Occurred() ? NULL : (Py_INCREF(Py_None), Py_None);
    }
    Py_ssize_t i = PyLong_AsSsize_t(id);
    Py_DECREF(id);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    PyObject *n = PyList_GetItem(graph_nodes, i);
    if (n != NULL && Py_TYPE(n) == node_type && ((NodeObject *)n)->rc > 1) { /* (release's common case) */
        ((NodeObject *)n)->rc--;
        Py_RETURN_NONE;
    }
    PyErr_Clear();
    PyObject *kept = PyObject_GetAttrString(graph_obj, "kept");
    if (kept == NULL)
        return NULL;
    int err = PyList_Check(kept) ? release_node(graph_nodes, graph_free, kept, i) : -1;
    Py_DECREF(kept);
    if (err < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "graph.kept is not a list");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* Method(op, flags, fallback, name, qualname, doc): a Tensor operator in C (`binary`, then `fallback(x, other)` where
 * that returns None; with flags UNARY or REDUCE_ALL a method of the tensor alone, `x.exp()` or `x.sum()`, whose other
 * calls are the fallback's); Method(None, 0, None, "__del__", ...): the handle's finalizer. Called unbound with the handle
 * first (a method descriptor: Python's operator slots and method calls make no bound method of it). */
typedef struct {
    PyObject_HEAD
    PyObject *op, *fallback, *name, *qualname, *doc;
    long flags;
} MethodObject;


static PyObject *method_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *op, *fallback, *name, *qualname, *doc;
    long flags;
    if (!PyArg_ParseTuple(args, "OlOOOO", &op, &flags, &fallback, &name, &qualname, &doc))
        return NULL;
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    MethodObject *self = (MethodObject *)alloc(type, 0);
    if (self == NULL)
        return NULL;
    PyObject *vals[5] = {op, fallback, name, qualname, doc};
    PyObject **fields[5] = {&self->op, &self->fallback, &self->name, &self->qualname, &self->doc};
    for (int k = 0; k < 5; k++) {
        Py_INCREF(vals[k]);
        *fields[k] = vals[k];
    }
    self->flags = flags;
    return (PyObject *)self;
}

static PyObject *method_call(MethodObject *self, PyObject *args, PyObject *kwds) {
    Py_ssize_t n = PyTuple_Size(args);
    if (self->op == Py_None) {
        if (n != 1 || (kwds != NULL && PyDict_Size(kwds))) {
            PyErr_SetString(PyExc_TypeError, "__del__(self)");
            return NULL;
        }
        return handle_del(PyTuple_GetItem(args, 0));
    }
    if (self->flags & (UNARY | REDUCE_ALL)) { /* x.op(): the common case in C, anything else (arguments) Python's */
        PyObject *x = n >= 1 ? PyTuple_GetItem(args, 0) : NULL;
        if (n != 1 || (kwds != NULL && PyDict_Size(kwds)) || tensor_type == NULL ||
            !PyObject_TypeCheck(x, (PyTypeObject *)tensor_type))
            return PyObject_Call(self->fallback, args, kwds);
        PyObject *out = (self->flags & UNARY) ? unary_impl(self->op, x) : reduce_all_impl(self->op, x);
        if (out != Py_None)
            return out;
        Py_DECREF(out);
        return PyObject_Call(self->fallback, args, kwds);
    }
    if (n != 2 || (kwds != NULL && PyDict_Size(kwds))) {
        PyErr_Format(PyExc_TypeError, "%S() takes a tensor and one operand", self->qualname);
        return NULL;
    }
    PyObject *x = PyTuple_GetItem(args, 0), *other = PyTuple_GetItem(args, 1);
    if (tensor_type == NULL || !PyObject_TypeCheck(x, (PyTypeObject *)tensor_type))
        return PyObject_CallFunctionObjArgs(self->fallback, x, other, NULL);
    PyObject *out = binary_impl(self->op, self->flags, x, other);
    if (out != Py_None)
        return out;
    Py_DECREF(out);
    return PyObject_CallFunctionObjArgs(self->fallback, x, other, NULL);
}

static PyObject *method_get(PyObject *self, PyObject *obj, PyObject *type) {
    if (obj == NULL || obj == Py_None || method_type == NULL) {
        Py_INCREF(self);
        return self;
    }
    return PyObject_CallFunctionObjArgs(method_type, self, obj, NULL);
}

static int method_traverse(MethodObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE((PyObject *)self));
    Py_VISIT(self->op);
    Py_VISIT(self->fallback);
    Py_VISIT(self->name);
    Py_VISIT(self->qualname);
    Py_VISIT(self->doc);
    return 0;
}

static int method_clear(MethodObject *self) {
    Py_CLEAR(self->op);
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->name);
    Py_CLEAR(self->qualname);
    Py_CLEAR(self->doc);
    return 0;
}

static void method_dealloc(MethodObject *self) { dealloc_tracked((PyObject *)self, (inquiry)method_clear); }

static PyObject *method_repr(MethodObject *self) {
    return PyUnicode_FromFormat("<azyx operator %S>", self->qualname);
}

static PyMemberDef method_members[] = {
    {"__name__", T_OBJECT, offsetof(MethodObject, name), READONLY, NULL},
    {"__qualname__", T_OBJECT, offsetof(MethodObject, qualname), READONLY, NULL},
    {"__doc__", T_OBJECT, offsetof(MethodObject, doc), READONLY, NULL},
    {"__wrapped__", T_OBJECT, offsetof(MethodObject, fallback), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot method_slots[] = {
    {Py_tp_new, method_new},
    {Py_tp_call, method_call},
    {Py_tp_descr_get, method_get},
    {Py_tp_traverse, method_traverse},
    {Py_tp_clear, method_clear},
    {Py_tp_dealloc, method_dealloc},
    {Py_tp_repr, method_repr},
    {Py_tp_members, method_members},
    {0, NULL},
};

#ifndef Py_TPFLAGS_METHOD_DESCRIPTOR
#define Py_TPFLAGS_METHOD_DESCRIPTOR (1UL << 17)
#endif

PyType_Spec method_spec = {"azyx._native.Method", sizeof(MethodObject), 0,
                                  Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_METHOD_DESCRIPTOR, method_slots};
