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
#include <time.h>

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

/* realized(shape, dtype, device, pinned, buffer, view) -> a handle of a new leaf node that holds `buffer` seen through
 * `view` (azyx.jit's replay: Tensor._realized) */
static PyObject *realized(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
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

/* ------------------------------------------------------------------------------ a CUDA device's queue and its lanes */

/* Queue: the per-command bookkeeping of a CUDA device (azyx.backends.cuda's CUDADevice) in C, on the device's own
 * tables and locks, for its two per-request steps: `poll` (a command's event queried, the completed unwatched commands
 * dropped, the timeline advanced) and a lane's run (below). A case the common path does not cover calls the device's
 * Python for that step: a new event, a context to make current, a driver error, a full unwatched queue, a timeline
 * with waiters to wake. */

typedef int (*cu_launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                            void **, void **);
typedef int (*cu_event_fn)(void *, void *);
typedef int (*cu_query_fn)(void *);
typedef int (*cu_current_fn)(void **);
typedef int (*cu_write_fn)(void *, u64, u64, unsigned);
#define CU_NOT_READY 600

typedef struct {
    PyObject_HEAD
    PyObject *dev, *timeline, *pool, *holding, *events, *free_events, *unwatched, *deferred, *posts;
    PyObject *lock_acquire, *lock_release, *qlock_acquire, *qlock_release, *unwatched_append, *unwatched_popleft;
    PyObject *free_append, *tl_acquire, *tl_release, *signal, *waiters;
    PyObject *alloc, *use, *new_event, *watch, *fail, *check_alive, *buffer_type, *record_type;
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

static PyTypeObject *pool_type, *queue_type;
static PyObject *s_submitted, *s_demanded, *s_waited, *s_handed, *s_batch, *s_failure, *s_value, *s_ready, *s_run;
static PyObject *s_clean, *s_spans, *s_ptr, *s_sync_waiters;

static PyObject *attr(PyObject *o, const char *name) { return PyObject_GetAttrString(o, name); }

static Py_ssize_t attr_int(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL)
        return -1;
    Py_ssize_t x = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    return x;
}

static int set_int(PyObject *o, PyObject *name, Py_ssize_t x) {
    PyObject *v = PyLong_FromSsize_t(x);
    int r = v == NULL ? -1 : PyObject_SetAttr(o, name, v);
    Py_XDECREF(v);
    return r;
}

static int call_void(PyObject *fn) {
    PyObject *r = PyObject_CallNoArgs(fn);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* a call that must run while an exception may be set (a lock's release on the way out): the exception stays */
static int call_keeping_error(PyObject *fn) {
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
static int queue_take_done(QueueObject *self, PyObject *done) {
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

static PyType_Spec queue_spec = {"azyx._native.Queue", sizeof(QueueObject), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
                                 queue_slots};

/* Lane: the whole run of a plan that is one kernel on one CUDA device (CUDADevice.lane), with no Python between the
 * call and the launch: the run's output blocks from the device's pool, the kernel's parameters, cuLaunchKernel, its
 * event and the device's bookkeeping of it (its value, what it holds until it completes, the event in the unwatched
 * queue), then the run's failure record and the targets' buffers. It is CUDADevice.begin_batch, alloc, launch_many and
 * end_batch for a batch of one launch; where those would not launch inline (a deferred command queued first, a batch
 * open) it returns None, for the executor's path. */

typedef struct {
    PyObject_HEAD
    QueueObject *queue;
    PyObject *outputs, *pack, *last_scalars, *last_words;
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
    Py_ssize_t before = bad ? -1 : attr_int(q->dev, s_submitted), v = -1;
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
    if (v < 0 || set_int(q->dev, s_submitted, v) < 0)
        return -1;
    /* the launched kernel's raw blocks become its output buffers (a failure here leaves a block out of the pool, in
     * use: the kernel writes it) */
    for (Py_ssize_t s = 0; s < self->n_slots; s++)
        if (raw[s]) {
            PyObject *size = PyLong_FromSsize_t(raw[s]);
            PyObject *b = size == NULL ? NULL : PyObject_CallFunctionObjArgs(q->buffer_type, q->dev, size, bufs[s],
                                                                            bufs[s], Py_True, NULL);
            Py_XDECREF(size);
            raw[s] = 0;
            if (b == NULL)
                return -1;
            Py_DECREF(bufs[s]);
            bufs[s] = b;
        }
    /* launched: what it holds until it completes (first: whatever fails next, its buffers stay out of the pools while
     * it may run), its event, its place in the unwatched queue (CUDADevice._record) */
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
        Py_ssize_t demanded = attr_int(q->dev, s_demanded), queued = PyObject_Size(q->unwatched);
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
    if (span == NULL || PyDict_SetItem(spans, q->dev, span) < 0)
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
    PyObject *batch = PyObject_GetAttr(q->dev, s_batch);
    Py_ssize_t deferred = PyObject_Size(q->deferred);
    Py_XDECREF(batch);
    if (batch != Py_None || deferred != 0) { /* (a batch open, a deferred command first, or an error) */
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
    return 0;
}

static int lane_clear(LaneObject *self) {
    Py_CLEAR(self->queue);
    Py_CLEAR(self->outputs);
    Py_CLEAR(self->pack);
    Py_CLEAR(self->last_scalars);
    Py_CLEAR(self->last_words);
    return 0;
}

static void lane_dealloc(LaneObject *self) {
    free(self->args);
    free(self->sizes);
    self->args = NULL;
    self->sizes = NULL;
    dealloc_tracked((PyObject *)self, (inquiry)lane_clear);
}

static PyType_Slot lane_slots[] = {
    {Py_tp_doc, "Lane(queue, function, grid, block, smem, slots, outs, n_inputs, sizes, outputs, pack): "
                "lane(bindings, scalars) runs a plan of one kernel on a CUDA device (see CUDADevice.lane)."},
    {Py_tp_new, lane_new},
    {Py_tp_call, lane_call},
    {Py_tp_traverse, lane_traverse},
    {Py_tp_clear, lane_clear},
    {Py_tp_dealloc, lane_dealloc},
    {0, NULL},
};

static PyType_Spec lane_spec = {"azyx._native.Lane", sizeof(LaneObject), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
                                lane_slots};

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
    {"realized", (PyCFunction)(void (*)(void))realized, METH_FASTCALL,
     "realized(shape, dtype, device, pinned, buffer, view) -> a handle of a new leaf node holding `buffer`"},
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
    if (PyModule_AddIntConstant(m, "ABI", 3) < 0) /* (azyx/native.py's ABI: bump both with any change of a call) */
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
    pool_type = (PyTypeObject *)pool;
    Py_INCREF(pool); /* (the lane's type check) */
    PyObject *queue = PyType_FromSpec(&queue_spec);
    if (queue == NULL || PyModule_AddObject(m, "Queue", queue) < 0)
        goto fail;
    queue_type = (PyTypeObject *)queue;
    Py_INCREF(queue); /* (the lane's type check) */
    PyObject *lane = PyType_FromSpec(&lane_spec);
    if (lane == NULL || PyModule_AddObject(m, "Lane", lane) < 0)
        goto fail;
    PyObject *table_call = PyType_FromSpec(&table_call_spec);
    if (table_call == NULL || PyModule_AddObject(m, "TableCall", table_call) < 0)
        goto fail;
    const char *names[] = {"view", "buffer", "offset", "strides", "device", "name", "id", "recording", "submitted",
                           "demanded", "waited", "batch", "failure", "value", "ready", "run", "clean", "spans", "ptr",
                           "handed", "_sync_waiters"};
    PyObject **interned[] = {&s_view, &s_buffer, &s_offset, &s_strides, &s_device, &s_name, &s_id, &s_recording,
                             &s_submitted, &s_demanded, &s_waited, &s_batch, &s_failure, &s_value, &s_ready, &s_run,
                             &s_clean, &s_spans, &s_ptr, &s_handed, &s_sync_waiters};
    for (size_t k = 0; k < sizeof(names) / sizeof(names[0]); k++)
        if ((*interned[k] = PyUnicode_InternFromString(names[k])) == NULL)
            goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
