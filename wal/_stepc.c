/* The batched-decode step of the WAL in one C call: check a step, encode its STEP frame, copy it into
 * the step group's rows; and the group's dissolve, its columns appended to the trajectories. The Python version (wal/stepgroup.py, StepGroup._encode_row_py) does the same
 * in about fifteen numpy and bytes operations; at B = 512 that Python is a tenth of a commit's time on a
 * disk that flushes in ~100 us, and a decode loop pays it on every step.
 *
 * encode_row(tokens, logprobs, positions, next_B, tok_RB, lp_RB, row, lens, ids_blob, version, lsn, mark,
 *            kind, crc32c) -> bytes | None
 *
 *   tokens     int32 buffer of n (n = len(next_B)), each >= 0; or a list of n ints (exactly int) in 0..2^31-1
 *   logprobs   float64 buffer of n, no NaN; or a list of n floats (exactly float), no NaN
 *   positions  int64 buffer of n, equal to next_B (each trajectory's next position); or a list of n ints
 *              (exactly int) equal to it. Lists are what the rollout's committer hands over (one Python int
 *              or float per draw); anything else in them (bool, numpy scalars, ...) is the general path's.
 *   next_B     writable int64 buffer of n: incremented by one when the frame is returned
 *   tok_RB     writable int32 rows (capacity x n): row `row` receives the tokens
 *   lp_RB      writable float64 rows (capacity x n): row `row` receives the log-probs
 *   lens       bytes: n little-endian u16 id lengths;  ids_blob: bytes, the ids joined
 *   version    the policy version (>= 0);  lsn: the record's lsn;  mark: XORed into the checksum
 *   kind       the STEP record type byte;  crc32c: the checksum function (a buffer -> int)
 *
 * Returns the frame (u32 body_len | u32 crc32c(body) ^ mark | body, body = u64 lsn | u8 kind | u64 version |
 * u32 n | lens | positions | tokens | logprobs | ids_blob), byte for byte what codec.encode_step_blob
 * writes, after copying the row and advancing next_B. Returns None, with nothing changed, when the step
 * is not this fast path's: a buffer of another format, length or layout, a negative token, a NaN, a
 * position that is not the next one, a row past the capacity, a body past max_body. Raises only when
 * memory or the checksum function fails (then nothing is changed either).
 *
 * Little-endian hosts only: setup.py builds it there, and stepgroup.py falls back to the Python version
 * wherever the module is missing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "wal._stepc writes little-endian frames with memcpy: build it on little-endian hosts only"
#endif

#define MAX_BODY_BYTES (64ll << 20) /* codec.MAX_BODY_BYTES */

/* A buffer format is one native or little-endian code of the given size ("i", "<i", "=i", "@i"). */
static int format_is(const char *fmt, Py_ssize_t itemsize, char kind, Py_ssize_t want_size) {
    if (fmt == NULL || itemsize != want_size)
        return 0;
    if (fmt[0] == '<' || fmt[0] == '=' || fmt[0] == '@')
        fmt++;
    if (fmt[0] == '\0' || fmt[1] != '\0')
        return 0;
    switch (kind) {
    case 'i': /* a signed integer of want_size bytes (4: 'i' or 'l'; 8: 'l' or 'q', by platform) */
        return fmt[0] == 'i' || fmt[0] == 'l' || fmt[0] == 'q';
    case 'f': /* an IEEE double */
        return fmt[0] == 'd';
    }
    return 0;
}

/* A 1-D, C-contiguous buffer of n items of the given kind and size; 0 (and released) when it is not. */
static int get_vector(PyObject *obj, Py_buffer *view, int writable, char kind, Py_ssize_t size, Py_ssize_t n) {
    int flags = PyBUF_FORMAT | PyBUF_ND | PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) != 0) {
        PyErr_Clear();
        return 0;
    }
    if (view->ndim != 1 || view->shape[0] != n || !format_is(view->format, view->itemsize, kind, size)) {
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

/* Rows of a group: a C-contiguous buffer of at least (row + 1) * n items of the given kind and size. */
static int get_rows(PyObject *obj, Py_buffer *view, char kind, Py_ssize_t size, Py_ssize_t n, Py_ssize_t row) {
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_ND | PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) {
        PyErr_Clear();
        return 0;
    }
    if (view->ndim < 1 || view->shape[view->ndim - 1] != n || !format_is(view->format, view->itemsize, kind, size)
        || row < 0 || view->len < (row + 1) * n * size) {
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

/* Whether `obj` is a list of exactly n items. */
static int list_of(PyObject *obj, Py_ssize_t n) {
    return PyList_CheckExact(obj) && PyList_GET_SIZE(obj) == n;
}

/* The value of an exact int that fits 64 bits into *v; 0 when `x` is not one (no error set). */
static int exact_int(PyObject *x, long long *v) {
    int overflow;
    if (!PyLong_CheckExact(x))
        return 0;
    *v = PyLong_AsLongLongAndOverflow(x, &overflow);
    return !overflow;
}

/* A list of n exact ints in 0..2^31-1 converted into out; 0 when `obj` is not one. */
static int list_tokens(PyObject *obj, Py_ssize_t n, int32_t *out) {
    long long v;
    if (!list_of(obj, n))
        return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!exact_int(PyList_GET_ITEM(obj, i), &v) || v < 0 || v > INT32_MAX)
            return 0;
        out[i] = (int32_t)v;
    }
    return 1;
}

/* A list of n exact floats, none NaN, converted into out; 0 when `obj` is not one. */
static int list_logprobs(PyObject *obj, Py_ssize_t n, double *out) {
    if (!list_of(obj, n))
        return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyList_GET_ITEM(obj, i);
        if (!PyFloat_CheckExact(x) || PyFloat_AS_DOUBLE(x) != PyFloat_AS_DOUBLE(x))
            return 0;
        out[i] = PyFloat_AS_DOUBLE(x);
    }
    return 1;
}

/* Whether `obj` is a list of n exact ints equal to next[0..n). */
static int list_is_next(PyObject *obj, Py_ssize_t n, const int64_t *next) {
    long long v;
    if (!list_of(obj, n))
        return 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!exact_int(PyList_GET_ITEM(obj, i), &v) || v != next[i])
            return 0;
    return 1;
}

static PyObject *encode_row(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 14) {
        PyErr_Format(PyExc_TypeError, "encode_row takes 14 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *lens_o = args[7], *ids_o = args[8], *crc_fn = args[13];
    if (!PyBytes_CheckExact(lens_o) || !PyBytes_CheckExact(ids_o)) {
        PyErr_SetString(PyExc_TypeError, "encode_row: lens and ids_blob must be bytes");
        return NULL;
    }
    Py_ssize_t row = PyLong_AsSsize_t(args[6]);
    unsigned long long version = PyLong_AsUnsignedLongLong(args[9]);
    unsigned long long lsn = PyLong_AsUnsignedLongLong(args[10]);
    unsigned long mark = PyLong_AsUnsignedLong(args[11]);
    long kind = PyLong_AsLong(args[12]);
    if (PyErr_Occurred()) {
        /* a negative or oversized version is not the fast path's; a bad lsn, row, mark or kind is a bug */
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        return NULL;
    }
    if (mark > 0xFFFFFFFFul || kind < 0 || kind > 255) {
        PyErr_SetString(PyExc_ValueError, "encode_row: mark must be a u32 and kind a u8");
        return NULL;
    }

    Py_buffer nb;
    if (PyObject_GetBuffer(args[3], &nb, PyBUF_FORMAT | PyBUF_ND | PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0)
        return NULL; /* next_B is the group's own array: anything else is a bug */
    if (nb.ndim != 1 || !format_is(nb.format, nb.itemsize, 'i', 8)) {
        PyBuffer_Release(&nb);
        PyErr_SetString(PyExc_TypeError, "encode_row: next_B must be a 1-D int64 array");
        return NULL;
    }
    Py_ssize_t n = nb.shape[0];
    if (PyBytes_GET_SIZE(lens_o) != 2 * n) {
        PyBuffer_Release(&nb);
        PyErr_SetString(PyExc_ValueError, "encode_row: lens must hold one u16 per trajectory");
        return NULL;
    }

    Py_buffer tb, lb, pb, tr, lr;
    int have_t = 0, have_l = 0, have_p = 0, have_tr = 0, have_lr = 0;
    int32_t *tok_list = NULL; /* the tokens / log-probs converted from lists */
    double *lp_list = NULL;
    const int32_t *tok;
    const double *lp;
    int64_t *next = (int64_t *)nb.buf;
    PyObject *frame = NULL, *result = Py_None;
    Py_INCREF(Py_None);
    if (!(have_tr = get_rows(args[4], &tr, 'i', 4, n, row)) || !(have_lr = get_rows(args[5], &lr, 'f', 8, n, row)))
        goto done;

    if (PyList_CheckExact(args[0])) {
        if ((tok_list = PyMem_Malloc((size_t)n * 4 + 1)) == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        if (!list_tokens(args[0], n, tok_list))
            goto done;
        tok = tok_list;
    } else {
        if (!(have_t = get_vector(args[0], &tb, 0, 'i', 4, n)))
            goto done;
        tok = (const int32_t *)tb.buf;
        int32_t neg = 0;
        for (Py_ssize_t i = 0; i < n; i++)
            neg |= tok[i];
        if (neg < 0)
            goto done; /* a negative token (codec.pack_tokens refuses it) */
    }
    if (PyList_CheckExact(args[1])) {
        if ((lp_list = PyMem_Malloc((size_t)n * 8 + 1)) == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        if (!list_logprobs(args[1], n, lp_list))
            goto done;
        lp = lp_list;
    } else {
        if (!(have_l = get_vector(args[1], &lb, 0, 'f', 8, n)))
            goto done;
        lp = (const double *)lb.buf;
        int nan = 0;
        for (Py_ssize_t i = 0; i < n; i++)
            nan |= lp[i] != lp[i];
        if (nan)
            goto done; /* a NaN log-prob (codec.pack_logprobs refuses it) */
    }
    if (PyList_CheckExact(args[2])) {
        if (!list_is_next(args[2], n, next))
            goto done; /* not each trajectory's next position (or not plain ints) */
    } else {
        if (!(have_p = get_vector(args[2], &pb, 0, 'i', 8, n)))
            goto done;
        if (memcmp(pb.buf, next, (size_t)n * 8) != 0)
            goto done; /* not each trajectory's next position */
    }

    Py_ssize_t ids_len = PyBytes_GET_SIZE(ids_o);
    long long body = 9 + 12 + 22ll * n + ids_len;
    if (body > MAX_BODY_BYTES)
        goto done; /* the Python path raises the codec's error */
    frame = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(8 + body));
    if (frame == NULL)
        goto fail;
    char *p = PyBytes_AS_STRING(frame);
    uint32_t body_len = (uint32_t)body, n32 = (uint32_t)n;
    uint64_t lsn64 = lsn, version64 = version;
    uint8_t kind8 = (uint8_t)kind;
    memcpy(p, &body_len, 4);
    char *b = p + 8;
    memcpy(b, &lsn64, 8);
    b[8] = (char)kind8;
    memcpy(b + 9, &version64, 8);
    memcpy(b + 17, &n32, 4);
    char *q = b + 21;
    memcpy(q, PyBytes_AS_STRING(lens_o), (size_t)(2 * n));
    q += 2 * n;
    memcpy(q, next, (size_t)(8 * n)); /* the positions, equal to next_B (checked above) */
    q += 8 * n;
    memcpy(q, tok, (size_t)(4 * n));
    q += 4 * n;
    memcpy(q, lp, (size_t)(8 * n));
    q += 8 * n;
    memcpy(q, PyBytes_AS_STRING(ids_o), (size_t)ids_len);

    PyObject *view = PyMemoryView_FromMemory(b, (Py_ssize_t)body, PyBUF_READ);
    if (view == NULL)
        goto fail;
    PyObject *crc_o = PyObject_CallOneArg(crc_fn, view);
    Py_DECREF(view);
    if (crc_o == NULL)
        goto fail;
    unsigned long crc = PyLong_AsUnsignedLong(crc_o);
    Py_DECREF(crc_o);
    if (PyErr_Occurred() || crc > 0xFFFFFFFFul) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "encode_row: the checksum function returned more than 32 bits");
        goto fail;
    }
    uint32_t stored = (uint32_t)(crc ^ mark);
    memcpy(p + 4, &stored, 4);

    /* everything checked and encoded: now change the group */
    memmove((char *)tr.buf + row * n * 4, tok, (size_t)(4 * n)); /* memmove: the step may be a view of the rows */
    memmove((char *)lr.buf + row * n * 8, lp, (size_t)(8 * n));
    for (Py_ssize_t i = 0; i < n; i++)
        next[i] += 1;
    Py_DECREF(result);
    result = frame;
    frame = NULL;
    goto done;

fail:
    Py_DECREF(result);
    result = NULL;
done:
    Py_XDECREF(frame);
    PyMem_Free(tok_list);
    PyMem_Free(lp_list);
    if (have_t)
        PyBuffer_Release(&tb);
    if (have_l)
        PyBuffer_Release(&lb);
    if (have_p)
        PyBuffer_Release(&pb);
    if (have_tr)
        PyBuffer_Release(&tr);
    if (have_lr)
        PyBuffer_Release(&lr);
    PyBuffer_Release(&nb);
    return result;
}

/* append_columns(rows, nrows, outs): column j of the first nrows rows of `rows` (a C-contiguous 2-D
 * buffer, n columns) appended to bytearray outs[j], for every j; a step group's dissolve. Columns go in
 * blocks of COLUMN_BLOCK so that a row's piece of a block is one or two cache lines and the block's outputs
 * stream: a whole strided transpose of a 4,096 x 512 float64 group (32 KiB between a column's elements
 * in the transposed copy) spent 30-90 ms in cache and TLB misses, this about a tenth of that. */
#define COLUMN_BLOCK 16

static PyObject *append_columns(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "append_columns takes 3 arguments, got %zd", nargs);
        return NULL;
    }
    Py_ssize_t nrows = PyLong_AsSsize_t(args[1]);
    if (nrows == -1 && PyErr_Occurred())
        return NULL;
    PyObject *outs = args[2];
    if (!PyList_CheckExact(outs)) {
        PyErr_SetString(PyExc_TypeError, "append_columns: outs must be a list of bytearrays");
        return NULL;
    }
    Py_buffer rb;
    if (PyObject_GetBuffer(args[0], &rb, PyBUF_ND | PyBUF_C_CONTIGUOUS) != 0)
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = rb.ndim == 2 ? rb.shape[1] : -1, size = rb.itemsize;
    if (n != PyList_GET_SIZE(outs) || nrows < 0 || nrows > rb.shape[0] || (size != 4 && size != 8)) {
        PyErr_SetString(PyExc_ValueError, "append_columns: rows must be 2-D with one column per output, 4- or 8-byte "
                                          "items, and nrows within its rows");
        goto done;
    }
    for (Py_ssize_t j = 0; j < n; j++)
        if (!PyByteArray_CheckExact(PyList_GET_ITEM(outs, j))) {
            PyErr_SetString(PyExc_TypeError, "append_columns: outs must be a list of bytearrays");
            goto done;
        }
    /* grow every output first: a failure leaves them as they were (those grown are cut back) */
    Py_ssize_t add = nrows * size;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *o = PyList_GET_ITEM(outs, j);
        if (PyByteArray_Resize(o, PyByteArray_GET_SIZE(o) + add) != 0) {
            for (Py_ssize_t k = 0; k < j; k++) {
                PyObject *g = PyList_GET_ITEM(outs, k);
                PyByteArray_Resize(g, PyByteArray_GET_SIZE(g) - add);
            }
            goto done;
        }
    }
    char *dst[COLUMN_BLOCK];
    const char *src = (const char *)rb.buf;
    Py_ssize_t stride = n * size;
    for (Py_ssize_t j0 = 0; j0 < n; j0 += COLUMN_BLOCK) {
        Py_ssize_t w = n - j0 < COLUMN_BLOCK ? n - j0 : COLUMN_BLOCK;
        for (Py_ssize_t k = 0; k < w; k++) {
            PyObject *o = PyList_GET_ITEM(outs, j0 + k);
            dst[k] = PyByteArray_AS_STRING(o) + PyByteArray_GET_SIZE(o) - add;
        }
        if (size == 8) {
            for (Py_ssize_t r = 0; r < nrows; r++) {
                const uint64_t *row = (const uint64_t *)(src + r * stride) + j0;
                for (Py_ssize_t k = 0; k < w; k++)
                    memcpy(dst[k] + r * 8, row + k, 8);
            }
        } else {
            for (Py_ssize_t r = 0; r < nrows; r++) {
                const uint32_t *row = (const uint32_t *)(src + r * stride) + j0;
                for (Py_ssize_t k = 0; k < w; k++)
                    memcpy(dst[k] + r * 4, row + k, 4);
            }
        }
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&rb);
    return result;
}

/* step(store, traj_ids, positions, tokens, logprobs, version) -> 0 | 1 | 2
 *
 * Store._step_fast (wal/store.py) in one call, for TokenWAL.append_step: a decode loop's step that is the
 * step group's next row is checked, encoded (encode_row) and added to the log's batch under the store's
 * mutex, with no Python frame between the caller and the frame's bytes. After each wait in fdatasync the
 * interpreter runs its bytecode several times slower than in a tight loop (measured 3.3 -> 13-17 us a
 * step at B = 512 on a 2-core VM, while this C ran at the same speed), so the common step keeps to C.
 *
 * It reads and writes, by name, what the Python path does: store.tokens.group (a StepGroup: ids, rows,
 * capacity, next_B, tok_RB, lp_RB, lens, ids_blob, version_R, lsn_R), store.mutex, store.log (_error,
 * _closed, _next_lsn, _batch, _batch_bytes) and store.config.max_batch_bytes. Returns 1 when the step is
 * logged, 2 when it is logged and the batch has passed max_batch_bytes (the caller commits, as
 * _step_fast does), and 0, with nothing changed, for any step the Python path must take: ids not a list
 * or not the group's, a version that is not an int in 0..2^64-1, no group, a full group, a failed or
 * closed log, and whatever encode_row declines. configure(flush_mark, step_kind, crc32c) gives it the
 * codec's constants first (stepgroup.py does, on import). */
static PyObject *c_flush_mark, *c_step_kind, *c_crc32c, *c_zero, *c_one;
static PyObject *s_tokens, *s_group, *s_mutex, *s_log, *s_error, *s_closed, *s_ids, *s_rows, *s_capacity,
    *s_next_lsn, *s_batch, *s_batch_bytes, *s_next_B, *s_tok_RB, *s_lp_RB, *s_lens, *s_ids_blob, *s_version_R,
    *s_lsn_R, *s_config, *s_max_batch_bytes, *s_acquire, *s_release;

static PyObject *configure(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "configure(flush_mark, step_kind, crc32c)");
        return NULL;
    }
    Py_XDECREF(c_flush_mark);
    Py_XDECREF(c_step_kind);
    Py_XDECREF(c_crc32c);
    c_flush_mark = Py_NewRef(args[0]);
    c_step_kind = Py_NewRef(args[1]);
    c_crc32c = Py_NewRef(args[2]);
    Py_RETURN_NONE;
}

/* The attribute `name` of `obj` as a Py_ssize_t into *v; 0 with an exception set when it is not an int. */
static int attr_ssize(PyObject *obj, PyObject *name, Py_ssize_t *v) {
    PyObject *x = PyObject_GetAttr(obj, name);
    if (x == NULL)
        return 0;
    *v = PyLong_AsSsize_t(x);
    Py_DECREF(x);
    return !(*v == -1 && PyErr_Occurred());
}

static PyObject *step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "step(store, traj_ids, positions, tokens, logprobs, version)");
        return NULL;
    }
    if (c_crc32c == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "wal._stepc.step: configure() was not called");
        return NULL;
    }
    PyObject *store = args[0], *ids = args[1], *version = args[5];
    if (!PyList_CheckExact(ids) || !PyLong_CheckExact(version))
        return PyLong_FromLong(0);
    PyLong_AsUnsignedLongLong(version); /* 0 <= version < 2^64, as codec.check_u64 */
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return PyLong_FromLong(0);
    }
    PyObject *mutex = NULL, *index = NULL, *g = NULL, *log = NULL, *x = NULL, *gids = NULL, *lsn = NULL,
             *batch = NULL, *frame = NULL, *row = NULL, *ret = NULL, *argv[14] = {NULL};
    long result = 0;
    int locked = 0;
    Py_ssize_t rows, capacity, batch_bytes, max_batch;

    if ((mutex = PyObject_GetAttr(store, s_mutex)) == NULL)
        goto fail;
    if ((x = PyObject_CallMethodNoArgs(mutex, s_acquire)) == NULL)
        goto fail;
    Py_CLEAR(x);
    locked = 1;
    if ((index = PyObject_GetAttr(store, s_tokens)) == NULL || (g = PyObject_GetAttr(index, s_group)) == NULL)
        goto fail;
    if (g == Py_None)
        goto out;
    if ((log = PyObject_GetAttr(store, s_log)) == NULL || (x = PyObject_GetAttr(log, s_error)) == NULL)
        goto fail;
    if (x != Py_None)
        goto out; /* a poisoned log: the Python path raises */
    Py_CLEAR(x);
    if ((x = PyObject_GetAttr(log, s_closed)) == NULL)
        goto fail;
    int closed = PyObject_IsTrue(x);
    Py_CLEAR(x);
    if (closed != 0) {
        if (closed < 0)
            goto fail;
        goto out;
    }
    if ((gids = PyObject_GetAttr(g, s_ids)) == NULL)
        goto fail;
    if (!PyList_CheckExact(gids) || PyList_GET_SIZE(gids) != PyList_GET_SIZE(ids))
        goto out;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ids) && i < PyList_GET_SIZE(gids); i++) { /* StepGroup.same_ids */
        PyObject *a = PyList_GET_ITEM(ids, i), *b = PyList_GET_ITEM(gids, i);
        if (a == b)
            continue;
        Py_INCREF(a); /* an __eq__ may change the lists (as in list_richcompare) */
        Py_INCREF(b);
        int eq = PyObject_RichCompareBool(a, b, Py_EQ);
        Py_DECREF(a);
        Py_DECREF(b);
        if (eq < 0)
            goto fail;
        if (!eq)
            goto out;
    }
    if (PyList_GET_SIZE(gids) != PyList_GET_SIZE(ids))
        goto out;
    if (!attr_ssize(g, s_rows, &rows) || !attr_ssize(g, s_capacity, &capacity))
        goto fail;
    if (rows >= capacity)
        goto out;
    if ((lsn = PyObject_GetAttr(log, s_next_lsn)) == NULL || (batch = PyObject_GetAttr(log, s_batch)) == NULL)
        goto fail;
    if (!PyList_CheckExact(batch))
        goto out;
    /* StepGroup.encode_row inside Log.append_locked: the mark is for a flush's first frame */
    argv[0] = Py_NewRef(args[3]);
    argv[1] = Py_NewRef(args[4]);
    argv[2] = Py_NewRef(args[2]);
    if ((argv[3] = PyObject_GetAttr(g, s_next_B)) == NULL || (argv[4] = PyObject_GetAttr(g, s_tok_RB)) == NULL
        || (argv[5] = PyObject_GetAttr(g, s_lp_RB)) == NULL || (argv[6] = PyLong_FromSsize_t(rows)) == NULL
        || (argv[7] = PyObject_GetAttr(g, s_lens)) == NULL || (argv[8] = PyObject_GetAttr(g, s_ids_blob)) == NULL)
        goto fail;
    argv[9] = Py_NewRef(version);
    argv[10] = Py_NewRef(lsn);
    argv[11] = Py_NewRef(PyList_GET_SIZE(batch) ? c_zero : c_flush_mark);
    argv[12] = Py_NewRef(c_step_kind);
    argv[13] = Py_NewRef(c_crc32c);
    if ((frame = encode_row(NULL, argv, 14)) == NULL)
        goto fail;
    if (frame == Py_None)
        goto out;
    /* the row is in: record it as StepGroup.encode_row and Log.append_locked do */
    if ((x = PyObject_GetAttr(g, s_version_R)) == NULL || PyList_Append(x, version) < 0)
        goto fail;
    Py_CLEAR(x);
    if ((x = PyObject_GetAttr(g, s_lsn_R)) == NULL || PyList_Append(x, lsn) < 0)
        goto fail;
    Py_CLEAR(x);
    if ((row = PyLong_FromSsize_t(rows + 1)) == NULL || PyObject_SetAttr(g, s_rows, row) < 0)
        goto fail;
    if (PyList_Append(batch, frame) < 0 || !attr_ssize(log, s_batch_bytes, &batch_bytes))
        goto fail;
    batch_bytes += PyBytes_GET_SIZE(frame);
    if ((x = PyLong_FromSsize_t(batch_bytes)) == NULL || PyObject_SetAttr(log, s_batch_bytes, x) < 0)
        goto fail;
    Py_CLEAR(x);
    if ((x = PyNumber_Add(lsn, c_one)) == NULL || PyObject_SetAttr(log, s_next_lsn, x) < 0)
        goto fail;
    Py_CLEAR(x);
    result = 1;
    if ((x = PyObject_GetAttr(store, s_config)) == NULL || !attr_ssize(x, s_max_batch_bytes, &max_batch))
        goto fail;
    if (batch_bytes > max_batch)
        result = 2;

out:
    if (locked) {
        locked = 0;
        PyObject *r = PyObject_CallMethodNoArgs(mutex, s_release);
        if (r == NULL)
            goto fail;
        Py_DECREF(r);
    }
    ret = PyLong_FromLong(result);
    goto done;

fail:
    if (locked) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        PyObject *r = PyObject_CallMethodNoArgs(mutex, s_release);
        Py_XDECREF(r);
        if (r == NULL) /* keep the first error */
            PyErr_Clear();
        PyErr_Restore(et, ev, tb);
    }
done:
    Py_XDECREF(x);
    Py_XDECREF(mutex);
    Py_XDECREF(index);
    Py_XDECREF(g);
    Py_XDECREF(log);
    Py_XDECREF(gids);
    Py_XDECREF(lsn);
    Py_XDECREF(batch);
    Py_XDECREF(frame);
    Py_XDECREF(row);
    for (int i = 0; i < 14; i++)
        Py_XDECREF(argv[i]);
    return ret;
}

static PyMethodDef methods[] = {
    {"encode_row", (PyCFunction)(void (*)(void))encode_row, METH_FASTCALL,
     "Check a decode step, encode its STEP frame and copy it into the group's rows (see the module source)."},
    {"append_columns", (PyCFunction)(void (*)(void))append_columns, METH_FASTCALL,
     "Append column j of a group's first rows to bytearray j, for every j (see the module source)."},
    {"configure", (PyCFunction)(void (*)(void))configure, METH_FASTCALL,
     "configure(flush_mark, step_kind, crc32c): the codec's constants for step()."},
    {"step", (PyCFunction)(void (*)(void))step, METH_FASTCALL,
     "Store._step_fast in one call: 0 (not taken), 1 (logged) or 2 (logged, the batch is full) (see the module source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "wal._stepc", "The WAL's batched-decode step in C.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__stepc(void) {
    static const char *names[] = {"tokens", "group", "mutex", "log", "_error", "_closed", "ids", "rows", "capacity",
                                  "_next_lsn", "_batch", "_batch_bytes", "next_B", "tok_RB", "lp_RB", "lens", "ids_blob",
                                  "version_R", "lsn_R", "config", "max_batch_bytes", "acquire", "release"};
    PyObject **slots[] = {&s_tokens, &s_group, &s_mutex, &s_log, &s_error, &s_closed, &s_ids, &s_rows, &s_capacity,
                          &s_next_lsn, &s_batch, &s_batch_bytes, &s_next_B, &s_tok_RB, &s_lp_RB, &s_lens, &s_ids_blob,
                          &s_version_R, &s_lsn_R, &s_config, &s_max_batch_bytes, &s_acquire, &s_release};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if ((*slots[i] = PyUnicode_InternFromString(names[i])) == NULL)
            return NULL;
    if ((c_zero = PyLong_FromLong(0)) == NULL || (c_one = PyLong_FromLong(1)) == NULL)
        return NULL;
    return PyModule_Create(&module);
}
