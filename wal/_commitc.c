/* The log's commit in one C call: Log.commit (wal/log.py) for its common case, a batch that goes direct
 * (wal/direct.py) into blocks of the active segment that are preallocated and durable, with no roll
 * before or after it. The Python commit walks the same steps through four method calls and a few
 * hundred bytecodes; on a disk that flushes in ~90 us a decode loop paid them on every step (~10 us of
 * the step once the write's wait has cooled the caches).
 *
 * commit(log, pwrite_sync) -> int | None
 *
 *   log          a wal.log.Log
 *   pwrite_sync  the write: core.fileio.pwrite_sync as Log.commit looks it up at call time, so that a
 *                backend installed with fileio.using (core.powercut's recorder) sees it as it sees the
 *                Python path's
 *
 * Returns the durable lsn, everything appended before the call durable, as Log.commit() does. Returns
 * None, with nothing changed, where Log.commit's Python must run: a closed or poisoned log (it raises),
 * attributes of unexpected types. Takes the flush lock, then the mutex, as Log.commit does. A batch
 * that is not the fast case (no direct writer, a write past the reserve or to the segment's end, a
 * staging buffer too small, a frame that is not bytes) goes to Log._flush(frames, last) with the flush
 * lock held, as Log.commit would send it. A direct write refused with EINVAL is handed to
 * Log._stop_direct() and Log._flush (the page cache from then on, as DirectWriter.write's False does);
 * any other failure of the write, or a short write, goes to Log._flush_failed(exc), which poisons the
 * log and raises LogClosedError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 4096 /* wal.direct.BLOCK */

static PyObject *s_next_lsn, *s_durable_lsn, *s_flush_lock, *s_mutex, *s_acquire, *s_release, *s_error, *s_closed,
    *s_batch, *s_batch_bytes, *s_direct, *s_pos, *s_alloc, *s_segment_bytes, *s_tail, *s_buf, *s_fd,
    *s_flush, *s_stop_direct, *s_flush_failed, *s_direct_writes, *s_fsyncs, *s_bytes_written;
static PyObject *c_zero;

static int call_noargs(PyObject *obj, PyObject *name) {
    PyObject *r = PyObject_CallMethodNoArgs(obj, name);
    Py_XDECREF(r);
    return r != NULL;
}

/* Release `lock`, keeping an exception that is set (the first error wins). */
static void release_keep(PyObject *lock) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    if (!call_noargs(lock, s_release) && et != NULL)
        PyErr_Clear();
    if (et != NULL)
        PyErr_Restore(et, ev, tb);
}

/* An int attribute as long long; 0 (an exception set, or not an int: *ok = 0 without one) on failure. */
static int attr_ll(PyObject *obj, PyObject *name, long long *v, int *unexpected) {
    PyObject *x = PyObject_GetAttr(obj, name);
    if (x == NULL)
        return 0;
    if (!PyLong_CheckExact(x)) {
        Py_DECREF(x);
        *unexpected = 1;
        return 0;
    }
    int overflow;
    *v = PyLong_AsLongLongAndOverflow(x, &overflow);
    Py_DECREF(x);
    if (overflow) {
        *unexpected = 1;
        return 0;
    }
    return 1;
}

static int set_ll(PyObject *obj, PyObject *name, long long v) {
    PyObject *x = PyLong_FromLongLong(v);
    if (x == NULL)
        return 0;
    int r = PyObject_SetAttr(obj, name, x);
    Py_DECREF(x);
    return r == 0;
}

/* obj.name += d */
static int add_ll(PyObject *obj, PyObject *name, long long d) {
    long long v;
    int unexpected = 0;
    if (!attr_ll(obj, name, &v, &unexpected)) {
        if (unexpected)
            PyErr_Format(PyExc_TypeError, "wal._commitc: %U is not an int", name);
        return 0;
    }
    return set_ll(obj, name, v + d);
}

/* The slow and failure paths: log.method(*args), whose result (or exception) the commit returns. */
static PyObject *flush_py(PyObject *log, PyObject *frames, long long last) {
    PyObject *l = PyLong_FromLongLong(last);
    if (l == NULL)
        return NULL;
    PyObject *r = PyObject_CallMethodObjArgs(log, s_flush, frames, l, NULL);
    if (r == NULL) {
        Py_DECREF(l);
        return NULL;
    }
    Py_DECREF(r);
    return l;
}

/* The write failed with the exception set: EINVAL goes back to the page cache, anything else poisons. */
static PyObject *write_failed(PyObject *log, PyObject *frames, long long last) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyErr_NormalizeException(&et, &ev, &tb);
    if (tb != NULL && ev != NULL)
        PyException_SetTraceback(ev, tb);
    int einval = 0;
    if (ev != NULL && PyErr_GivenExceptionMatches(ev, PyExc_OSError)) {
        PyObject *no = PyObject_GetAttrString(ev, "errno");
        if (no == NULL)
            PyErr_Clear();
        else {
            einval = PyLong_Check(no) && PyLong_AsLong(no) == EINVAL;
            Py_DECREF(no);
            if (PyErr_Occurred())
                PyErr_Clear();
        }
    }
    PyObject *ret = NULL;
    if (einval) { /* refused before any byte moved (DirectWriter.write's False) */
        if (call_noargs(log, s_stop_direct))
            ret = flush_py(log, frames, last);
    } else if (ev != NULL) {
        PyObject *r = PyObject_CallMethodOneArg(log, s_flush_failed, ev); /* raises LogClosedError */
        Py_XDECREF(r);
        if (r != NULL)
            PyErr_SetString(PyExc_RuntimeError, "wal._commitc: Log._flush_failed returned");
    }
    Py_XDECREF(et);
    Py_XDECREF(ev);
    Py_XDECREF(tb);
    return ret;
}

/* With the flush lock held and the batch taken: write it, durable on return. */
static PyObject *flush(PyObject *log, PyObject *pw, PyObject *frames, long long last) {
    PyObject *direct = NULL, *tail = NULL, *buf = NULL, *fd = NULL, *mv = NULL, *off = NULL,
             *done = NULL, *ntail = NULL, *ret = NULL;
    Py_buffer view = {0};
    int unexpected = 0, handled = 0; /* handled: the Python path took the batch, or poisoned the log */
    long long pos, alloc, seg;
    Py_ssize_t n = 0, nf = PyList_GET_SIZE(frames);

    if ((direct = PyObject_GetAttr(log, s_direct)) == NULL)
        goto out;
    if (direct == Py_None)
        goto slow;
    if (!attr_ll(log, s_pos, &pos, &unexpected) || !attr_ll(log, s_alloc, &alloc, &unexpected)
        || !attr_ll(log, s_segment_bytes, &seg, &unexpected))
        goto check;
    for (Py_ssize_t i = 0; i < nf; i++) {
        PyObject *f = PyList_GET_ITEM(frames, i);
        if (!PyBytes_CheckExact(f))
            goto slow;
        n += PyBytes_GET_SIZE(f);
    }
    long long end = pos + n, rounded = (end + BLOCK - 1) / BLOCK * BLOCK;
    if (n == 0 || rounded > alloc || end >= seg) /* DirectWriter.fits, and no roll before or after */
        goto slow;
    if ((tail = PyObject_GetAttr(direct, s_tail)) == NULL)
        goto out;
    if (!PyBytes_CheckExact(tail) || PyBytes_GET_SIZE(tail) != pos % BLOCK)
        goto slow; /* the Python path raises what it raises */
    Py_ssize_t t = PyBytes_GET_SIZE(tail), stop = t + n, total = (stop + BLOCK - 1) / BLOCK * BLOCK;
    if ((buf = PyObject_GetAttr(direct, s_buf)) == NULL)
        goto out;
    if (PyObject_GetBuffer(buf, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_Clear();
        goto slow;
    }
    if (view.len < total) /* DirectWriter.write grows it */
        goto slow;
    char *p = view.buf;
    memcpy(p, PyBytes_AS_STRING(tail), t);
    for (Py_ssize_t i = 0, at = t; i < nf; i++) {
        PyObject *f = PyList_GET_ITEM(frames, i);
        memcpy(p + at, PyBytes_AS_STRING(f), PyBytes_GET_SIZE(f));
        at += PyBytes_GET_SIZE(f);
    }
    memset(p + stop, 0, total - stop);
    if ((fd = PyObject_GetAttr(direct, s_fd)) == NULL
        || (mv = PyMemoryView_FromObject(buf)) == NULL || (off = PyLong_FromLongLong(pos - t)) == NULL)
        goto out;
    { /* buf[:total] as DirectWriter.write hands it over: a view that holds the mapping, whoever keeps it */
        PyObject *whole = mv;
        mv = PySequence_GetSlice(whole, 0, total);
        Py_DECREF(whole);
        if (mv == NULL)
            goto out;
    }
    {
        PyObject *argv[3] = {fd, mv, off};
        done = PyObject_Vectorcall(pw, argv, 3, NULL);
    }
    PyBuffer_Release(&view); /* the write has returned: the buffer may be grown or closed again */
    if (done == NULL) {
        ret = write_failed(log, frames, last);
        handled = 1;
        goto out;
    }
    Py_ssize_t wrote = PyLong_Check(done) ? PyLong_AsSsize_t(done) : -1;
    if (wrote != total) { /* a direct write is not expected to come back short; nothing past it is promised */
        PyErr_Clear();
        PyObject *eio = PyObject_CallFunction(PyExc_OSError, "is", EIO, "direct write came back short");
        if (eio == NULL)
            goto out;
        PyErr_SetObject(PyExc_OSError, eio);
        Py_DECREF(eio);
        ret = write_failed(log, frames, last);
        handled = 1;
        goto out;
    }
    Py_ssize_t keep = (Py_ssize_t)((pos + n) % BLOCK);
    if ((ntail = PyBytes_FromStringAndSize(p + stop - keep, keep)) == NULL
        || PyObject_SetAttr(direct, s_tail, ntail) < 0 || !add_ll(log, s_direct_writes, 1) || !set_ll(log, s_pos, end))
        goto out;
    {
        PyObject *mutex = PyObject_GetAttr(log, s_mutex);
        if (mutex == NULL)
            goto out;
        if (!call_noargs(mutex, s_acquire)) {
            Py_DECREF(mutex);
            goto out;
        }
        int ok = add_ll(log, s_fsyncs, 1) && add_ll(log, s_bytes_written, n) && set_ll(log, s_durable_lsn, last);
        release_keep(mutex);
        Py_DECREF(mutex);
        if (!ok || PyErr_Occurred())
            goto out;
    }
    ret = PyLong_FromLongLong(last);
    goto out;

check:
    if (!unexpected)
        goto out;
    PyErr_Clear();
slow:
    if (view.obj != NULL)
        PyBuffer_Release(&view);
    ret = flush_py(log, frames, last);
    handled = 1;
out:
    if (view.obj != NULL)
        PyBuffer_Release(&view);
    if (ret == NULL && !handled) /* the batch is taken and its state unknown: poison, as a failed flush does */
        ret = write_failed(log, frames, last);
    Py_XDECREF(direct);
    Py_XDECREF(tail);
    Py_XDECREF(buf);
    Py_XDECREF(fd);
    Py_XDECREF(mv);
    Py_XDECREF(off);
    Py_XDECREF(done);
    Py_XDECREF(ntail);
    return ret;
}

static PyObject *commit(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "commit(log, pwrite_sync)");
        return NULL;
    }
    PyObject *log = args[0], *pw = args[1];
    PyObject *flush_lock = NULL, *mutex = NULL, *x = NULL, *frames = NULL, *ret = NULL;
    long long next, durable, target, last;
    int unexpected = 0, flushing = 0, locked = 0;

    /* read without the mutex, as Log.commit does: each read is of one int and the durable lsn only grows */
    if (!attr_ll(log, s_next_lsn, &next, &unexpected) || !attr_ll(log, s_durable_lsn, &durable, &unexpected))
        goto check;
    target = next - 1;
    if (durable >= target)
        return PyLong_FromLongLong(durable);
    if ((flush_lock = PyObject_GetAttr(log, s_flush_lock)) == NULL || (mutex = PyObject_GetAttr(log, s_mutex)) == NULL)
        goto out;
    if (!call_noargs(flush_lock, s_acquire))
        goto out;
    flushing = 1;
    if (!call_noargs(mutex, s_acquire))
        goto out;
    locked = 1;
    if (!attr_ll(log, s_durable_lsn, &durable, &unexpected))
        goto check;
    if (durable >= target) { /* the flush before ours took our records */
        ret = PyLong_FromLongLong(durable);
        goto out;
    }
    if ((x = PyObject_GetAttr(log, s_error)) == NULL)
        goto out;
    int failed = x != Py_None;
    Py_CLEAR(x);
    if ((x = PyObject_GetAttr(log, s_closed)) == NULL)
        goto out;
    int closed = PyObject_IsTrue(x);
    Py_CLEAR(x);
    if (closed < 0)
        goto out;
    if (failed || closed) { /* Log.commit raises */
        ret = Py_NewRef(Py_None);
        goto out;
    }
    if ((frames = PyObject_GetAttr(log, s_batch)) == NULL)
        goto out;
    if (!PyList_CheckExact(frames)) {
        ret = Py_NewRef(Py_None);
        goto out;
    }
    if (!attr_ll(log, s_next_lsn, &next, &unexpected))
        goto check;
    last = next - 1;
    if ((x = PyList_New(0)) == NULL || PyObject_SetAttr(log, s_batch, x) < 0
        || PyObject_SetAttr(log, s_batch_bytes, c_zero) < 0)
        goto out;
    Py_CLEAR(x);
    locked = 0;
    if (!call_noargs(mutex, s_release))
        goto out;
    ret = flush(log, pw, frames, last); /* appends go on meanwhile */
    goto out;

check:
    if (unexpected && !PyErr_Occurred())
        ret = Py_NewRef(Py_None);
out:
    if (locked)
        release_keep(mutex);
    if (flushing)
        release_keep(flush_lock);
    if (ret == NULL && !PyErr_Occurred())
        ret = Py_NewRef(Py_None);
    Py_XDECREF(x);
    Py_XDECREF(frames);
    Py_XDECREF(flush_lock);
    Py_XDECREF(mutex);
    return ret;
}

static PyMethodDef methods[] = {
    {"commit", (PyCFunction)(void (*)(void))commit, METH_FASTCALL,
     "Log.commit() in one call: the durable lsn, or None where the Python commit must run (see the module source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "wal._commitc", "The WAL's commit in C.", -1, methods};

PyMODINIT_FUNC PyInit__commitc(void) {
    struct {
        PyObject **slot;
        const char *name;
    } names[] = {
        {&s_next_lsn, "_next_lsn"}, {&s_durable_lsn, "_durable_lsn"}, {&s_flush_lock, "_flush_lock"},
        {&s_mutex, "mutex"}, {&s_acquire, "acquire"}, {&s_release, "release"}, {&s_error, "_error"},
        {&s_closed, "_closed"}, {&s_batch, "_batch"}, {&s_batch_bytes, "_batch_bytes"}, {&s_direct, "_direct"},
        {&s_pos, "_pos"}, {&s_alloc, "_alloc"}, {&s_segment_bytes, "segment_bytes"}, {&s_tail, "tail"},
        {&s_buf, "_buf"}, {&s_fd, "fd"}, {&s_flush, "_flush"},
        {&s_stop_direct, "_stop_direct"}, {&s_flush_failed, "_flush_failed"}, {&s_direct_writes, "direct_writes"},
        {&s_fsyncs, "fsyncs"}, {&s_bytes_written, "bytes_written"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if ((*names[i].slot = PyUnicode_InternFromString(names[i].name)) == NULL)
            return NULL;
    if ((c_zero = PyLong_FromLong(0)) == NULL)
        return NULL;
    return PyModule_Create(&module);
}
