/* azyx's native core: the graph's node, the canonical walk and the release of nodes, the per-request work of every
 * realize (azyx.graph and azyx.walk hold the same in Python, which runs where this module is not built).
 *
 * Built against Python's stable ABI (3.11): one library serves every later Python. Nothing here releases the GIL;
 * the only calls back into Python are a leaf's view and buffer attributes and an ASSIGN's donation check. */

#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

typedef uint64_t u64;

/* ------------------------------------------------------------------------------------------------------------ Node */

typedef struct {
    PyObject_HEAD
    PyObject *op, *src, *arg, *arg2, *shape, *dtype, *device, *pinned;
    Py_ssize_t rc;
    PyObject *buffer, *view;
} NodeObject;

static PyTypeObject *node_type;

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
static void dealloc_tracked(PyObject *self, inquiry clear) {
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

static PyType_Spec node_spec = {"azyx._native.Node", sizeof(NodeObject), 0,
                                Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, node_slots};

/* ------------------------------------------------------------------------------------- what setup() tells the walk */

static PyObject *op_const, *op_pad, *op_assign, *op_binary, *op_leaf, *scalar_mark, *bool_dtype, *donates_fn;
static PyObject *op_unary, *op_reduce, *op_reshape;
static PyObject *s_view, *s_buffer, *s_offset, *s_strides, *s_device, *s_name;

static PyObject *setup(PyObject *mod, PyObject *args) {
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

/* ------------------------------------------------------------------------------------------------------ the walk */

/* A node's place in the walk, by id: marks[i] == epoch says index[i] holds it. One table serves every walk (a walk
 * runs with the GIL held; one whose callback let another thread walk meanwhile finds the table busy and uses its
 * own). */
typedef struct {
    uint32_t *marks;
    Py_ssize_t *index;
    Py_ssize_t cap;
    uint32_t epoch;
    int busy;
} Table;

static Table shared_table;

static int table_reserve(Table *t, Py_ssize_t n) {
    if (n <= t->cap)
        return 0;
    Py_ssize_t cap = t->cap ? t->cap : 1024;
    while (cap < n)
        cap *= 2;
    uint32_t *marks = (uint32_t *)calloc((size_t)cap, sizeof(uint32_t));
    Py_ssize_t *index = (Py_ssize_t *)malloc((size_t)cap * sizeof(Py_ssize_t));
    if (marks == NULL || index == NULL) {
        free(marks);
        free(index);
        PyErr_NoMemory();
        return -1;
    }
    free(t->marks);
    free(t->index);
    t->epoch = 0;
    t->marks = marks;
    t->index = index;
    t->cap = cap;
    return 0;
}

static int table_begin(Table *t, Py_ssize_t n) {
    if (table_reserve(t, n) < 0)
        return -1;
    if (++t->epoch == 0) { /* wrapped: forget every mark */
        memset(t->marks, 0, (size_t)t->cap * sizeof(uint32_t));
        t->epoch = 1;
    }
    return 0;
}

static NodeObject *node_at(PyObject *nodes, Py_ssize_t i) {
    PyObject *n = PyList_GetItem(nodes, i); /* (borrowed; raises IndexError past the end) */
    if (n == NULL)
        return NULL;
    if (Py_TYPE(n) != node_type) {
        PyErr_Format(PyExc_AssertionError, "node %zd is %R, not a live node", i, n);
        return NULL;
    }
    return (NodeObject *)n;
}

typedef struct {
    PyObject *id; /* borrowed from a source tuple or the targets list */
    Py_ssize_t i;
    int done;
} Frame;

typedef struct {
    Frame *items;
    Py_ssize_t n, cap;
} Stack;

static int stack_push(Stack *s, PyObject *id, Py_ssize_t i, int done) {
    if (s->n == s->cap) {
        Py_ssize_t cap = s->cap ? 2 * s->cap : 64;
        Frame *items = (Frame *)realloc(s->items, (size_t)cap * sizeof(Frame));
        if (items == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        s->items = items;
        s->cap = cap;
    }
    s->items[s->n++] = (Frame){id, i, done};
    return 0;
}

/* (shape, dtype, device, view.offset, view.strides, buffer.device.name): how a leaf looks to a plan */
static PyObject *leaf_entry(NodeObject *n) {
    PyObject *off = NULL, *strides = NULL, *dev = NULL, *name = NULL, *out = NULL;
    if ((off = PyObject_GetAttr(n->view, s_offset)) && (strides = PyObject_GetAttr(n->view, s_strides)) &&
        (dev = PyObject_GetAttr(n->buffer, s_device)) && (name = PyObject_GetAttr(dev, s_name)))
        out = PyTuple_Pack(6, n->shape, n->dtype, n->device, off, strides, name);
    Py_XDECREF(off);
    Py_XDECREF(strides);
    Py_XDECREF(dev);
    Py_XDECREF(name);
    return out;
}

static PyObject *small_int(Py_ssize_t k) { return PyLong_FromSsize_t(k); }

/* walk(nodes, targets, graph) -> (entries, target positions, topo, leaves, scalars, scalar nodes, donated)
 * The iterative form of azyx.walk's recursive walk, in the same order: sources in order, each node after them. */
static PyObject *walk(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "walk(nodes: list, targets: list, graph)");
        return NULL;
    }
    if (op_const == NULL) {
        PyErr_SetString(PyExc_AssertionError, "azyx._native.setup() was not called");
        return NULL;
    }
    PyObject *nodes = args[0], *targets = args[1], *graph = args[2];
    Table own = {NULL, NULL, 0, 0, 0};
    Table *t = shared_table.busy ? &own : &shared_table;
    Stack stack = {NULL, 0, 0};
    PyObject *entries = PyList_New(0), *topo = PyList_New(0), *leaves = PyList_New(0), *scalars = PyList_New(0);
    PyObject *scalar_nodes = PyList_New(0), *donated = PyDict_New(), *tk = NULL, *result = NULL, *key = NULL;
    if (!entries || !topo || !leaves || !scalars || !scalar_nodes || !donated)
        goto fail;
    if (table_begin(t, PyList_Size(nodes)) < 0)
        goto fail;
    t->busy = 1;
    uint32_t epoch = t->epoch;
    Py_ssize_t n_targets = PyList_Size(targets);
    tk = PyTuple_New(n_targets);
    if (tk == NULL)
        goto fail;
    for (Py_ssize_t ti = 0; ti < n_targets; ti++) {
        PyObject *tid = PyList_GetItem(targets, ti);
        Py_ssize_t root = PyLong_AsSsize_t(tid);
        if (root == -1 && PyErr_Occurred())
            goto fail;
        if (root < 0 || root >= t->cap) {
            PyErr_Format(PyExc_IndexError, "node %zd is not in the graph", root);
            goto fail;
        }
        if (t->marks[root] != epoch && stack_push(&stack, tid, root, 0) < 0)
            goto fail;
        while (stack.n) {
            Frame f = stack.items[--stack.n];
            NodeObject *n = node_at(nodes, f.i);
            if (n == NULL)
                goto fail;
            if (f.done) {
                Py_ssize_t ns = PyTuple_Size(n->src);
                PyObject *srck = PyTuple_New(ns);
                if (srck == NULL)
                    goto fail;
                for (Py_ssize_t k = 0; k < ns; k++) {
                    Py_ssize_t s = PyLong_AsSsize_t(PyTuple_GetItem(n->src, k));
                    PyObject *pos = small_int(t->index[s]);
                    if (pos == NULL) {
                        Py_DECREF(srck);
                        goto fail;
                    }
                    PyTuple_SetItem(srck, k, pos);
                }
                PyObject *arg = n->arg, *arg2 = n->arg2, *scalar = NULL;
                PyObject *flag = NULL;
                if (n->op == op_binary) {
                    if (arg2 != Py_None)
                        scalar = arg2, arg2 = scalar_mark;
                } else if (n->op == op_const) {
                    if (n->dtype != bool_dtype)
                        scalar = arg, arg = scalar_mark;
                } else if (n->op == op_pad) {
                    if (n->dtype != bool_dtype)
                        scalar = arg2, arg2 = scalar_mark;
                } else if (n->op == op_assign) {
                    flag = PyObject_CallFunctionObjArgs(donates_fn, graph, (PyObject *)n, NULL);
                    if (flag == NULL) {
                        Py_DECREF(srck);
                        goto fail;
                    }
                    arg2 = flag;
                }
                Py_ssize_t k = PyList_Size(entries);
                PyObject *entry = PyTuple_Pack(8, n->op, arg, arg2, n->shape, n->dtype, n->device, n->pinned, srck);
                Py_DECREF(srck);
                int bad = entry == NULL || PyList_Append(entries, entry) < 0 || PyList_Append(topo, f.id) < 0;
                Py_XDECREF(entry);
                if (!bad && scalar != NULL)
                    bad = PyList_Append(scalars, scalar) < 0 || PyList_Append(scalar_nodes, f.id) < 0;
                if (!bad && flag == Py_True) {
                    PyObject *pos = small_int(k);
                    bad = pos == NULL || PyDict_SetItem(donated, f.id, pos) < 0;
                    Py_XDECREF(pos);
                }
                Py_XDECREF(flag);
                if (bad)
                    goto fail;
                t->marks[f.i] = epoch;
                t->index[f.i] = k;
                continue;
            }
            if (t->marks[f.i] == epoch)
                continue;
            if (n->buffer != Py_None) {
                Py_INCREF((PyObject *)n); /* (the callbacks in leaf_entry may run anything) */
                PyObject *entry = leaf_entry(n);
                Py_DECREF((PyObject *)n);
                Py_ssize_t k = PyList_Size(entries);
                int bad = entry == NULL || PyList_Append(entries, entry) < 0 || PyList_Append(leaves, f.id) < 0;
                Py_XDECREF(entry);
                if (bad)
                    goto fail;
                t->marks[f.i] = epoch;
                t->index[f.i] = k;
                continue;
            }
            if (stack_push(&stack, f.id, f.i, 1) < 0)
                goto fail;
            for (Py_ssize_t k = PyTuple_Size(n->src) - 1; k >= 0; k--) {
                PyObject *sid = PyTuple_GetItem(n->src, k);
                Py_ssize_t s = PyLong_AsSsize_t(sid);
                if (s < 0 || s >= t->cap) {
                    if (!PyErr_Occurred())
                        PyErr_Format(PyExc_IndexError, "source %zd of node %zd is not in the graph", s, f.i);
                    goto fail;
                }
                if (t->marks[s] != epoch && stack_push(&stack, sid, s, 0) < 0)
                    goto fail;
            }
        }
        PyObject *pos = small_int(t->index[root]);
        if (pos == NULL)
            goto fail;
        PyTuple_SetItem(tk, ti, pos);
    }
    key = PyList_AsTuple(entries);
    if (key == NULL)
        goto fail;
    result = PyTuple_Pack(7, key, tk, topo, leaves, scalars, scalar_nodes, donated);
fail:
    t->busy = 0;
    if (t == &own) {
        free(own.marks);
        free(own.index);
    }
    free(stack.items);
    Py_XDECREF(key);
    Py_XDECREF(tk);
    Py_XDECREF(entries);
    Py_XDECREF(topo);
    Py_XDECREF(leaves);
    Py_XDECREF(scalars);
    Py_XDECREF(scalar_nodes);
    Py_XDECREF(donated);
    return result;
}

/* --------------------------------------------------------------------------------------------------- the release */

/* Graph.release: drops one reference to node i; when it was the last, the node's slot is freed (its id to `freed`,
 * out of every id set of `kept`) and its sources are released in turn. 0, or -1 with an exception set. */
static int release_node(PyObject *nodes, PyObject *freed, PyObject *kept, Py_ssize_t i) {
    NodeObject *n = node_at(nodes, i);
    if (n == NULL)
        return -1;
    if (n->rc <= 0) {
        PyErr_Format(PyExc_AssertionError, "release of dead node %zd", i);
        return -1;
    }
    if (--n->rc)
        return 0;
    Py_ssize_t cap = 64, top = 0;
    Py_ssize_t *stack = (Py_ssize_t *)malloc((size_t)cap * sizeof(Py_ssize_t));
    if (stack == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    stack[top++] = i;
    Py_ssize_t n_kept = PyList_Size(kept);
    PyObject *ok = Py_None;
    while (top) {
        Py_ssize_t j = stack[--top];
        PyObject *jid = PyLong_FromSsize_t(j);
        NodeObject *m = jid ? node_at(nodes, j) : NULL;
        if (m == NULL) {
            Py_XDECREF(jid);
            ok = NULL;
            break;
        }
        Py_INCREF((PyObject *)m);
        Py_INCREF(Py_None);
        PyList_SetItem(nodes, j, Py_None); /* (steals None; drops the list's reference to m) */
        int bad = PyList_Append(freed, jid) < 0;
        for (Py_ssize_t k = 0; k < n_kept && !bad; k++) /* the id will be reused: it must not look recorded */
            bad = PySet_Discard(PyList_GetItem(kept, k), jid) < 0;
        Py_DECREF(jid);
        Py_ssize_t ns = bad ? 0 : PyTuple_Size(m->src);
        for (Py_ssize_t k = 0; k < ns && !bad; k++) {
            Py_ssize_t s = PyLong_AsSsize_t(PyTuple_GetItem(m->src, k));
            NodeObject *src = s < 0 ? NULL : node_at(nodes, s);
            if (src == NULL) {
                bad = 1;
                break;
            }
            if (--src->rc == 0) {
                if (top == cap) {
                    Py_ssize_t *more = (Py_ssize_t *)realloc(stack, (size_t)(2 * cap) * sizeof(Py_ssize_t));
                    if (more == NULL) {
                        PyErr_NoMemory();
                        bad = 1;
                        break;
                    }
                    stack = more;
                    cap *= 2;
                }
                stack[top++] = s;
            }
        }
        Py_DECREF((PyObject *)m); /* (its buffer goes back to its pool here, as in Python) */
        if (bad) {
            ok = NULL;
            break;
        }
    }
    free(stack);
    return ok == NULL ? -1 : 0;
}

/* release(nodes, free, kept, i) */
static PyObject *release(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyList_Check(args[0]) || !PyList_Check(args[1]) || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "release(nodes: list, free: list, kept: list, i: int)");
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(args[3]);
    if ((i == -1 && PyErr_Occurred()) || release_node(args[0], args[1], args[2], i) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------- building: x op y */

/* what setup_tensor() tells the operators: the handle type, the graph and its lists, the dtypes by kind */
static PyObject *tensor_type, *graph_obj, *graph_nodes, *graph_free, *float_dtypes, *int_dtypes, *disk_name;
static PyObject *s_id, *s_recording;
static PyObject *method_type; /* types.MethodType: what `t.__add__` gives (Method below) */

static PyObject *setup_tensor(PyObject *mod, PyObject *args) {
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

enum { OUT_BOOL = 1, INT_NUMBERS = 2, FLOAT_OK = 4, REVERSE = 8, FLOAT_KIND = 16, UNARY = 32, REDUCE_ALL = 64 };

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

static PyObject *binary(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
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

static PyType_Spec method_spec = {"azyx._native.Method", sizeof(MethodObject), 0,
                                  Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_METHOD_DESCRIPTOR, method_slots};

/* ------------------------------------------------------------------------------------------ the pool's free lists */

/* Pool(capacity, cache_limit, lowest): the caching allocator's free lists and counts (azyx.allocator.PoolAllocator),
 * each call one step under the GIL: a free from a finalizer, on any thread, can never find it half done. Blocks are
 * any objects; with `lowest` they are ints (addresses) and a request takes the lowest cached one of its size. */
typedef struct {
    PyObject_HEAD
    PyObject *lists; /* bucketed size -> list of blocks (a heap with `lowest`) */
    Py_ssize_t capacity, cache_limit, in_use, cached;
    int lowest;
} PoolObject;

static Py_ssize_t bucket_of(Py_ssize_t nbytes) { /* azyx.allocator.bucket */
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

static PyObject *list_pop_last(PyObject *list) {
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
static PyObject *pool_pop(PoolObject *self, Py_ssize_t size) {
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

static PyType_Spec pool_spec = {"azyx._native.Pool", sizeof(PoolObject), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
                                pool_slots};

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

static PyType_Spec table_call_spec = {"azyx._native.TableCall", sizeof(TableCallObject), 0, Py_TPFLAGS_DEFAULT,
                                      table_call_slots};

/* become_leaf(nodes, free, kept, i, buffer, view): Graph.become_leaf. A realized node keeps its buffer and view
 * (a node placed automatically moves to its buffer's device); unless a live tape holds it (an id set of `kept` has
 * it), it forgets its sources. */
static PyObject *become_leaf(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || !PyList_Check(args[0]) || !PyList_Check(args[1]) || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "become_leaf(nodes: list, free: list, kept: list, i, buffer, view)");
        return NULL;
    }
    PyObject *nodes = args[0], *kept = args[2], *buffer = args[4], *view = args[5];
    Py_ssize_t i = PyLong_AsSsize_t(args[3]);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    NodeObject *n = node_at(nodes, i);
    if (n == NULL)
        return NULL;
    Py_INCREF((PyObject *)n);
    PyObject *old_buffer = n->buffer, *old_view = n->view;
    Py_INCREF(buffer);
    Py_INCREF(view);
    n->buffer = buffer;
    n->view = view;
    Py_XDECREF(old_buffer);
    Py_XDECREF(old_view);
    PyObject *dev = NULL, *listed = NULL;
    int pinned = PyObject_IsTrue(n->pinned), err = pinned < 0;
    if (!err && !pinned) {
        dev = PyObject_GetAttr(buffer, s_device);
        listed = dev ? PyObject_GetAttrString(dev, "listed") : NULL;
        int is_listed = listed ? PyObject_IsTrue(listed) : -1;
        err = is_listed < 0;
        if (is_listed > 0) {
            PyObject *name = PyObject_GetAttr(dev, s_name);
            if (name == NULL)
                err = 1;
            else {
                PyObject *old = n->device;
                n->device = name;
                Py_XDECREF(old);
            }
        }
    }
    Py_XDECREF(dev);
    Py_XDECREF(listed);
    Py_ssize_t ns = err ? 0 : PyTuple_Size(n->src);
    if (ns > 0) {
        PyObject *id = args[3];
        int taped = 0;
        Py_ssize_t n_kept = PyList_Size(kept);
        for (Py_ssize_t k = 0; k < n_kept && !taped && !err; k++) {
            taped = PySet_Contains(PyList_GetItem(kept, k), id);
            err = taped < 0;
        }
        if (!taped && !err) { /* forget how it was made: a leaf now, its sources released */
            PyObject *src = n->src, *empty = PyTuple_New(0);
            if (empty == NULL)
                err = 1;
            else {
                PyObject *olds[3] = {n->op, n->arg, n->arg2};
                n->src = empty;
                Py_INCREF(op_leaf);
                n->op = op_leaf;
                Py_INCREF(Py_None);
                n->arg = Py_None;
                Py_INCREF(Py_None);
                n->arg2 = Py_None;
                for (int k = 0; k < 3; k++)
                    Py_XDECREF(olds[k]);
                for (Py_ssize_t k = 0; k < ns && !err; k++) {
                    Py_ssize_t s = PyLong_AsSsize_t(PyTuple_GetItem(src, k));
                    err = (s == -1 && PyErr_Occurred()) || release_node(nodes, args[1], kept, s) < 0;
                }
            }
            Py_DECREF(src);
        }
    }
    Py_DECREF((PyObject *)n);
    if (err)
        return NULL;
    Py_RETURN_NONE;
}

/* --------------------------------------------------------------------------------------- a run's scalar arguments */

/* pack_words(codes, at, scalars) -> tuple of ints: the 64-bit words that carry scalars[at[k]] to a kernel, each as
 * struct code codes[k] packs it (azyx.dtypes.SCALAR_CODES) in its low bytes, the rest zero: "f" a float32's bits, "d" a
 * float64's, "b" "B" "h" "i" "I" "q" an integer wrapped into that many bits (as PyTorch wraps a scalar into an int
 * tensor's dtype). A float out of float32's range raises OverflowError, as struct does. */
static PyObject *pack_words(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
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

static int as_u64(PyObject *v, u64 *out) {
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
static PyObject *call(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
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
static PyObject *call_out(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
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
#define MAX_PARAMS 64
static PyObject *launch_kernel(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
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

/* ------------------------------------------------------------------------------------------------------ the module */

static PyMethodDef methods[] = {
    {"setup", setup, METH_VARARGS,
     "setup(CONST, PAD, ASSIGN, BINARY, LEAF, UNARY, REDUCE, RESHAPE, scalar mark, bool dtype, donates): the ops and "
     "what the walk needs of azyx.graph"},
    {"pack_words", (PyCFunction)(void (*)(void))pack_words, METH_FASTCALL,
     "pack_words(codes, at, scalars) -> the 64-bit words of scalars[at[k]], each packed as struct code codes[k]"},
    {"call", (PyCFunction)(void (*)(void))call, METH_FASTCALL,
     "call(fn, *args) -> int: a C function of integer and pointer parameters (at most 11), the GIL held"},
    {"call_out", (PyCFunction)(void (*)(void))call_out, METH_FASTCALL,
     "call_out(fn, *args) -> the value fn writes through its first parameter (0 when it returns an error)"},
    {"launch_kernel", (PyCFunction)(void (*)(void))launch_kernel, METH_FASTCALL,
     "launch_kernel(cuLaunchKernel, f, gx, gy, gz, bx, by, bz, smem, stream, values) -> CUresult"},
    {"become_leaf", (PyCFunction)(void (*)(void))become_leaf, METH_FASTCALL,
     "become_leaf(nodes, free, kept, i, buffer, view): Graph.become_leaf"},
    {"walk", (PyCFunction)(void (*)(void))walk, METH_FASTCALL,
     "walk(nodes, targets, graph) -> (entries, target positions, topo, leaves, scalars, scalar nodes, donated)"},
    {"release", (PyCFunction)(void (*)(void))release, METH_FASTCALL,
     "release(nodes, free, kept, i): drop a reference to node i, freeing it and its sources as their last goes"},
    {"setup_tensor", setup_tensor, METH_VARARGS,
     "setup_tensor(Tensor, graph, float dtypes, int dtypes, disk device's name, types.MethodType): what the "
     "operators need"},
    {"binary", (PyCFunction)(void (*)(void))binary, METH_FASTCALL,
     "binary(op, flags, x, other) -> the new handle of x op other, or None where the caller builds it"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "azyx._native",
                                    "azyx's native core: the graph's node, the canonical walk, the release of nodes.",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "ABI", 2) < 0) /* (azyx/native.py's ABI: bump both with any change of a call) */
        goto fail;
    node_type = (PyTypeObject *)PyType_FromSpec(&node_spec);
    if (node_type == NULL || PyModule_AddObject(m, "Node", (PyObject *)node_type) < 0)
        goto fail;
    Py_INCREF((PyObject *)node_type); /* (the module's reference was stolen; this one is the walk's) */
    PyObject *method = PyType_FromSpec(&method_spec);
    if (method == NULL || PyModule_AddObject(m, "Method", method) < 0)
        goto fail;
    PyObject *pool = PyType_FromSpec(&pool_spec);
    if (pool == NULL || PyModule_AddObject(m, "Pool", pool) < 0)
        goto fail;
    PyObject *table_call = PyType_FromSpec(&table_call_spec);
    if (table_call == NULL || PyModule_AddObject(m, "TableCall", table_call) < 0)
        goto fail;
    const char *names[8] = {"view", "buffer", "offset", "strides", "device", "name", "id", "recording"};
    PyObject **interned[8] = {&s_view, &s_buffer, &s_offset, &s_strides, &s_device, &s_name, &s_id, &s_recording};
    for (int k = 0; k < 8; k++)
        if ((*interned[k] = PyUnicode_InternFromString(names[k])) == NULL)
            goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
