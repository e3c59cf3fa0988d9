#include "native.h"

/* ------------------------------------------------------------------------------------------------------------ Node */

PyTypeObject *node_type;

static PyMemberDef node_members[] = {
    {"op", T_OBJECT, offsetof(NodeObject, op), 0, NULL},
    {"src", T_OBJECT, offsetof(NodeObject, src), 0, NULL},
    {"arg", T_OBJECT, offsetof(NodeObject, arg), 0, NULL},
    {"arg2", T_OBJECT, offsetof(NodeObject, arg2), 0, NULL},
    {"shape", T_OBJECT, offsetof(NodeObject, shape), 0, NULL},
    {"dtype", T_OBJECT, offsetof(NodeObject, dtype), 0, NULL},
    {"device", T_OBJECT, offsetof(NodeObject, device), 0, NULL},
    {"pinned", T_OBJECT, offsetof(NodeObject, pinned), 0, NULL},
    {"rc", T_PYSSIZET, offsetof(NodeObject, rc), 0, NULL},
    {"buffer", T_OBJECT, offsetof(NodeObject, buffer), 0, NULL},
    {"view", T_OBJECT, offsetof(NodeObject, view), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyObject *node_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Py_ssize_t n = PyTuple_Size(args);
    PyObject *arg2 = NULL; /* (borrowed: arg2 given by name) */
    if (kwds != NULL && PyDict_Size(kwds) != 0) {
        arg2 = PyDict_GetItemString(kwds, "arg2");
        if (arg2 == NULL || PyDict_Size(kwds) != 1 || n != 7)
            n = -1;
    }
    if (n < 7 || n > 8) {
        PyErr_SetString(PyExc_TypeError, "Node(op, src, arg, shape, dtype, device, pinned, arg2=None) takes 7 or 8 "
                                         "positional arguments");
        return NULL;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    NodeObject *self = (NodeObject *)alloc(type, 0);
    if (self == NULL)
        return NULL;
    PyObject **fields[8] = {&self->op, &self->src, &self->arg, &self->shape, &self->dtype, &self->device,
                            &self->pinned, &self->arg2};
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *v = PyTuple_GetItem(args, k);
        Py_INCREF(v);
        *fields[k] = v;
    }
    if (n == 7) {
        self->arg2 = arg2 != NULL ? arg2 : Py_None;
        Py_INCREF(self->arg2);
    }
    Py_INCREF(Py_None);
    self->buffer = Py_None;
    Py_INCREF(Py_None);
    self->view = Py_None;
    return (PyObject *)self;
}

static int node_traverse(NodeObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE((PyObject *)self));
    Py_VISIT(self->op);
    Py_VISIT(self->src);
    Py_VISIT(self->arg);
    Py_VISIT(self->arg2);
    Py_VISIT(self->shape);
    Py_VISIT(self->dtype);
    Py_VISIT(self->device);
    Py_VISIT(self->pinned);
    Py_VISIT(self->buffer);
    Py_VISIT(self->view);
    return 0;
}

static int node_clear(NodeObject *self) {
    Py_CLEAR(self->op);
    Py_CLEAR(self->src);
    Py_CLEAR(self->arg);
    Py_CLEAR(self->arg2);
    Py_CLEAR(self->shape);
    Py_CLEAR(self->dtype);
    Py_CLEAR(self->device);
    Py_CLEAR(self->pinned);
    Py_CLEAR(self->buffer);
    Py_CLEAR(self->view);
    return 0;
}

/* a GC-tracked object of a heap type: untracked, its references cleared, freed, its type's reference dropped */
void dealloc_tracked(PyObject *self, inquiry clear) {
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    clear(self);
    freefunc free_ = (freefunc)PyType_GetSlot(type, Py_tp_free);
    free_(self);
    Py_DECREF(type);
}

static void node_dealloc(NodeObject *self) { dealloc_tracked((PyObject *)self, (inquiry)node_clear); }

static PyObject *node_repr(NodeObject *self) {
    PyObject *op = self->op ? PyObject_GetAttrString(self->op, "name") : NULL;
    PyObject *dt = self->dtype ? PyObject_GetAttrString(self->dtype, "name") : NULL;
    PyErr_Clear();
    PyObject *out = PyUnicode_FromFormat("Node(%S, src=%S, arg=%R, shape=%S, %S, %S)", op ? op : Py_None,
                                         self->src ? self->src : Py_None, self->arg ? self->arg : Py_None,
                                         self->shape ? self->shape : Py_None, dt ? dt : Py_None,
                                         self->device ? self->device : Py_None);
    Py_XDECREF(op);
    Py_XDECREF(dt);
    return out;
}

static PyType_Slot node_slots[] = {
    {Py_tp_doc, "A node of the graph: its op, sources (ids), arguments, shape, dtype, device, whether its device was "
                "asked for (pinned), its reference count, and once realized its buffer and view."},
    {Py_tp_new, node_new},
    {Py_tp_dealloc, node_dealloc},
    {Py_tp_traverse, node_traverse},
    {Py_tp_clear, node_clear},
    {Py_tp_repr, node_repr},
    {Py_tp_members, node_members},
    {0, NULL},
};

PyType_Spec node_spec = {"azyx._native.Node", sizeof(NodeObject), 0,
                                Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, node_slots};

/* ------------------------------------------------------------------------------------- what setup() tells the walk */

PyObject *op_const, *op_pad, *op_assign, *op_binary, *op_leaf, *scalar_mark, *bool_dtype, *donates_fn;
PyObject *op_unary, *op_reduce, *op_reshape;

PyObject *setup(PyObject *mod, PyObject *args) {
    PyObject *c, *p, *a, *b, *leaf, *un, *red, *resh, *mark, *bdt, *don;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOO", &c, &p, &a, &b, &leaf, &un, &red, &resh, &mark, &bdt, &don))
        return NULL;
    PyObject **slots[11] = {&op_const, &op_pad, &op_assign, &op_binary, &op_leaf, &op_unary, &op_reduce, &op_reshape,
                            &scalar_mark, &bool_dtype, &donates_fn};
    PyObject *vals[11] = {c, p, a, b, leaf, un, red, resh, mark, bdt, don};
    for (int k = 0; k < 11; k++) {
        Py_INCREF(vals[k]);
        Py_XDECREF(*slots[k]);
        *slots[k] = vals[k];
    }
    Py_RETURN_NONE;
}
