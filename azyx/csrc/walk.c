#include "native.h"

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

NodeObject *node_at(PyObject *nodes, Py_ssize_t i) {
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
PyObject *walk(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
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
int release_node(PyObject *nodes, PyObject *freed, PyObject *kept, Py_ssize_t i) {
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
PyObject *release(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyList_Check(args[0]) || !PyList_Check(args[1]) || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "release(nodes: list, free: list, kept: list, i: int)");
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(args[3]);
    if ((i == -1 && PyErr_Occurred()) || release_node(args[0], args[1], args[2], i) < 0)
        return NULL;
    Py_RETURN_NONE;
}


/* become_leaf(nodes, free, kept, i, buffer, view): Graph.become_leaf. A realized node keeps its buffer and view
 * (a node placed automatically moves to its buffer's device); unless a live tape holds it (an id set of `kept` has
 * it), it forgets its sources. */
PyObject *become_leaf(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
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
