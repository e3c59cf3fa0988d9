#include "native.h"

#ifndef AZYX_ABI
#error "AZYX_ABI: the sources' hash (azyx.csrc.source_abi), which setup.py defines"
#endif

PyObject *s_view, *s_buffer, *s_offset, *s_strides, *s_device, *s_name, *s_id, *s_recording;
PyObject *s_failure, *s_value, *s_ready, *s_run, *s_clean, *s_spans, *s_ptr;

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
    {"read_range", (PyCFunction)(void (*)(void))read_range, METH_FASTCALL,
     "read_range(fd, offset, run, step, start, outs, identity, path) -> bytes read, -1 where the file changed: a "
     "range's bytes into writable buffers, the GIL released throughout (read.c)"},
    {"read_direct", (PyCFunction)(void (*)(void))read_direct, METH_FASTCALL,
     "read_direct(dfd, offset, nbytes, block, outs, identity, path, fd) -> bytes read, -1 where the file changed, -2 "
     "where O_DIRECT is refused: an O_DIRECT read through an aligned block, the GIL released throughout (read.c)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "azyx._native",
                                    "azyx's native core: the graph's node, the canonical walk, the release of nodes.",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddStringConstant(m, "ABI", AZYX_ABI) < 0) /* (the sources' hash: azyx/csrc/__init__.py) */
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
    if (queue_setup() < 0)
        goto fail;
    PyObject *lane = PyType_FromSpec(&lane_spec);
    if (lane == NULL || PyModule_AddObject(m, "Lane", lane) < 0)
        goto fail;
    PyObject *table_call = PyType_FromSpec(&table_call_spec);
    if (table_call == NULL || PyModule_AddObject(m, "TableCall", table_call) < 0)
        goto fail;
    const char *names[] = {"view", "buffer", "offset", "strides", "device", "name", "id", "recording", "failure",
                           "value", "ready", "run", "clean", "spans", "ptr"};
    PyObject **interned[] = {&s_view, &s_buffer, &s_offset, &s_strides, &s_device, &s_name, &s_id, &s_recording,
                             &s_failure, &s_value, &s_ready, &s_run, &s_clean, &s_spans, &s_ptr};
    for (size_t k = 0; k < sizeof(names) / sizeof(names[0]); k++)
        if ((*interned[k] = PyUnicode_InternFromString(names[k])) == NULL)
            goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
