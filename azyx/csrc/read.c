#include "native.h"

#include <errno.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

/* ------------------------------------------------------------------------------------ positional reads of a file */

/* read_range(fd, offset, run, step, start, outs, identity, path) -> int: azyx.files' reads on the disk device's reader
 * threads, the GIL released from the first check to the last, so that a reader takes it once per extent rather than
 * once per system call (a Python read took it back after each fstat, stat and preadv, and the loop's thread waited
 * behind sixteen readers doing so). The range's logical byte k is the file's byte offset + k (run 0) or, a range of
 * runs, offset + (k / run) * step + k % run; its bytes from `start` on fill the writable buffers `outs`, one after the
 * other, by preadv (one call per contiguous file span, at most 64 buffers each, repeated where it returns short).
 * The file is checked before and after against `identity` (st_dev, st_ino, st_size, st_mtime_ns) and `path` (what
 * names it: the same device and inode, or nothing any more: a removed file still reads). Returns the bytes read: all
 * of them, fewer where the file ended first, -1 where the file is not that version (nothing read, or what was read
 * not to be used: the caller raises what changed). A read error raises OSError. */

typedef struct {
    unsigned long long dev, ino;
    long long size, mtime_ns;
} Identity;

static long long mtime_ns(const struct stat *st) {
#ifdef __APPLE__
    return (long long)st->st_mtimespec.tv_sec * 1000000000LL + st->st_mtimespec.tv_nsec;
#else
    return (long long)st->st_mtim.tv_sec * 1000000000LL + st->st_mtim.tv_nsec;
#endif
}

/* (the GIL released) whether the open file and what its path names are still `id` */
static int same_file(int fd, const char *path, const Identity *id) {
    struct stat st;
    if (fstat(fd, &st) != 0 || (unsigned long long)st.st_dev != id->dev || (unsigned long long)st.st_ino != id->ino ||
        (long long)st.st_size != id->size || mtime_ns(&st) != id->mtime_ns)
        return 0;
    if (stat(path, &st) != 0)
        return errno == ENOENT; /* removed: the descriptor keeps its bytes */
    return (unsigned long long)st.st_dev == id->dev && (unsigned long long)st.st_ino == id->ino;
}

/* one read: the file (its usual descriptor, version and path), the destinations, and what read_range or read_direct
 * read into them */
typedef struct {
    int fd;
    Identity id;
    PyObject *path; /* bytes (PyUnicode_FSConverter) */
    Py_buffer *bufs;
    Py_ssize_t nbufs, held;
    long long total; /* the destinations' bytes */
    long long offset, run, step, start; /* read_range's range */
    int dfd;                            /* read_direct's O_DIRECT descriptor, */
    long long nbytes;                   /* bytes, */
    Py_buffer block;                    /* block (held: `has_block`) of `room` bytes */
    int has_block;
    long long room;
    int in_block; /* ... and whether they stay in it (outs None) */
} Reading;

/* `r`'s file and destinations from the arguments (outs: a list of writable buffers, or None where `none_ok`); 0 and
 * an exception where they are malformed. reading_end releases what it took, either way. */
static int reading_begin(Reading *r, PyObject *fd, PyObject *outs, PyObject *identity, PyObject *path, int none_ok) {
    if ((outs == Py_None ? !none_ok : !PyList_Check(outs)) || !PyTuple_Check(identity) ||
        PyTuple_Size(identity) != 4) {
        PyErr_SetString(PyExc_TypeError, "a read's outs must be a list, its identity a tuple of 4 ints");
        return 0;
    }
    r->fd = (int)PyLong_AsLong(fd);
    r->id.dev = PyLong_AsUnsignedLongLong(PyTuple_GetItem(identity, 0));
    r->id.ino = PyLong_AsUnsignedLongLong(PyTuple_GetItem(identity, 1));
    r->id.size = PyLong_AsLongLong(PyTuple_GetItem(identity, 2));
    r->id.mtime_ns = PyLong_AsLongLong(PyTuple_GetItem(identity, 3));
    if (PyErr_Occurred() || !PyUnicode_FSConverter(path, &r->path))
        return 0;
    r->nbufs = outs == Py_None ? 0 : PyList_Size(outs);
    if ((r->bufs = PyMem_Calloc(r->nbufs ? r->nbufs : 1, sizeof(Py_buffer))) == NULL) {
        PyErr_NoMemory();
        return 0;
    }
    for (; r->held < r->nbufs; r->held++) {
        if (PyObject_GetBuffer(PyList_GetItem(outs, r->held), &r->bufs[r->held], PyBUF_WRITABLE) < 0)
            return 0;
        r->total += r->bufs[r->held].len;
    }
    return 1;
}

static void reading_end(Reading *r) {
    for (Py_ssize_t b = 0; b < r->held; b++)
        PyBuffer_Release(&r->bufs[b]);
    if (r->has_block)
        PyBuffer_Release(&r->block);
    PyMem_Free(r->bufs);
    Py_XDECREF(r->path);
}

typedef long long (*read_fn)(Reading *r, int *err);

/* `read` with the GIL released, the file checked before and after it: the bytes it read (-2: O_DIRECT refused), -1
 * where the file changed, or OSError where it failed */
static PyObject *checked_read(Reading *r, read_fn read) {
    const char *where = PyBytes_AsString(r->path);
    long long got = -1;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    if (same_file(r->fd, where, &r->id)) {
        got = read(r, &err);
        if (got >= 0 && !err && !same_file(r->fd, where, &r->id))
            got = -1;
    }
    Py_END_ALLOW_THREADS
    if (!err)
        return PyLong_FromLongLong(got);
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

/* (the GIL released) the range's bytes [start, start + total) into the buffers; -1 and `*err` set where one failed */
static long long read_spans(Reading *r, int *err) {
    struct iovec iov[64]; /* (at most 64 buffers a call: more take more calls) */
    long long done = 0, total = r->total;
    Py_ssize_t at = 0, within = 0; /* the buffer the next byte lands in, and where in it */
    while (done < total) {
        long long k = r->start + done, pos, span;
        if (r->run > 0) {
            pos = r->offset + (k / r->run) * r->step + k % r->run;
            span = r->run - k % r->run;
        } else {
            pos = r->offset + k;
            span = total - done;
        }
        if (span > total - done)
            span = total - done;
        int n = 0;
        long long covered = 0;
        for (Py_ssize_t b = at; b < r->nbufs && covered < span && n < 64; b++) {
            long long skip = b == at ? within : 0, len = (long long)r->bufs[b].len - skip;
            if (len <= 0)
                continue;
            if (len > span - covered)
                len = span - covered;
            iov[n].iov_base = (char *)r->bufs[b].buf + skip;
            iov[n].iov_len = (size_t)len;
            covered += len;
            n++;
        }
        ssize_t got = preadv(r->fd, iov, n, (off_t)pos);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            *err = errno;
            return -1;
        }
        if (got == 0)
            break; /* the file ended */
        done += got;
        for (long long left = got; left > 0;) { /* the cursor past what was read */
            long long room = (long long)r->bufs[at].len - within;
            if (left < room) {
                within += (Py_ssize_t)left;
                break;
            }
            left -= room;
            at++;
            within = 0;
        }
    }
    return done;
}

PyObject *read_range(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "read_range(fd, offset, run, step, start, outs, identity, path)");
        return NULL;
    }
    Reading r = {0};
    PyObject *result = NULL;
    r.offset = PyLong_AsLongLong(args[1]);
    r.run = PyLong_AsLongLong(args[2]);
    r.step = PyLong_AsLongLong(args[3]);
    r.start = PyLong_AsLongLong(args[4]);
    if (!PyErr_Occurred() && reading_begin(&r, args[0], args[5], args[6], args[7], 0))
        result = checked_read(&r, read_spans);
    reading_end(&r);
    return result;
}

/* read_direct(dfd, offset, nbytes, block, outs, identity, path, fd) -> int: bytes [offset, offset + nbytes) of the
 * file read with O_DIRECT (`dfd`, past the page cache) into `block` (writable, its address aligned to DIRECT_ALIGN),
 * in aligned pieces of at most the block's size, each piece's bytes copied on into the writable buffers `outs`, one
 * after the other; `outs` None: one piece, its bytes left in the block from offset % DIRECT_ALIGN on (the span must
 * fit). The GIL released throughout; the file checked before and after like read_range's (through `fd`, its usual
 * descriptor, and `path`). Returns the bytes read (fewer where the file ended first), -1 where the file changed, -2
 * where the filesystem refuses O_DIRECT reads (nothing read: read it the usual way). A read error raises OSError. */

#define DIRECT_ALIGN 4096

static long long read_pieces(Reading *r, int *err) {
    long long done = 0, offset = r->offset, nbytes = r->nbytes, room = r->room, size = r->id.size;
    char *block = r->block.buf;
    Py_ssize_t at = 0, within = 0;
    while (done < nbytes) {
        long long first = offset + done, lo = first - first % DIRECT_ALIGN;
        long long hi = offset + nbytes < lo + room ? offset + nbytes : lo + room;
        long long span = (hi - lo + DIRECT_ALIGN - 1) / DIRECT_ALIGN * DIRECT_ALIGN;
        long long want = span < size - lo ? span : size - lo, got = 0;
        if (span > room || want <= 0)
            return done; /* (a block too small for the aligned span; past the end: the file ended) */
        while (got < want) {
            ssize_t n = pread(r->dfd, block + got, (size_t)(span - got), (off_t)(lo + got));
            if (n < 0) {
                if (errno == EINTR)
                    continue;
                if (done == 0 && got == 0 && (errno == EINVAL || errno == EOPNOTSUPP))
                    return -2;
                *err = errno;
                return -1;
            }
            if (n == 0)
                break;
            got += n;
        }
        long long have = lo + got < hi ? lo + got : hi; /* (the file's bytes this piece holds) */
        if (have <= first)
            return done;
        for (long long k = first - lo; k < have - lo && !r->in_block;) { /* into the buffers, on from the cursor */
            while (at < r->nbufs && within == r->bufs[at].len) {
                at++;
                within = 0;
            }
            if (at == r->nbufs)
                break;
            long long take = have - lo - k < (long long)r->bufs[at].len - within ? have - lo - k :
                             (long long)r->bufs[at].len - within;
            memcpy((char *)r->bufs[at].buf + within, block + k, (size_t)take);
            k += take;
            within += (Py_ssize_t)take;
        }
        done += have - first;
        if (have < hi)
            return done; /* the file ended */
    }
    return done;
}

PyObject *read_direct(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "read_direct(dfd, offset, nbytes, block, outs, identity, path, fd)");
        return NULL;
    }
    Reading r = {0};
    PyObject *result = NULL;
    r.dfd = (int)PyLong_AsLong(args[0]);
    r.offset = PyLong_AsLongLong(args[1]);
    r.nbytes = PyLong_AsLongLong(args[2]);
    r.in_block = args[4] == Py_None;
    if (PyErr_Occurred() || !reading_begin(&r, args[7], args[4], args[5], args[6], 1))
        goto done;
    if (PyObject_GetBuffer(args[3], &r.block, PyBUF_WRITABLE) < 0)
        goto done;
    r.has_block = 1;
    r.room = (long long)r.block.len;
    if (r.room == 0 || (uintptr_t)r.block.buf % DIRECT_ALIGN != 0 || (!r.in_block && r.total != r.nbytes)) {
        PyErr_SetString(PyExc_ValueError, "read_direct: an empty block, one not aligned to 4096, or outs not nbytes");
        goto done;
    }
    result = checked_read(&r, read_pieces);
done:
    reading_end(&r);
    return result;
}
