/* The KV snapshot's checked read in C: pread each request into its place in a buffer and crc32c its pieces,
 * on threads of its own, without the GIL from the first read to the last check.
 *
 * A resume reads a snapshot's tail while its head is prefilled on the same process's main thread. Python
 * readers take the GIL back after every pread and checksum, and the main thread launching the prefill's
 * kernels waits for it; here the readers never touch Python objects.
 *
 * read_checked(fd, buffer, requests, checks, threads) -> 0 ok, 1 short file, 2 checksum mismatch;
 * OSError on a failed read.
 *   requests: packed int64 (file offset, buffer offset, length, first check, end check) per request
 *   checks:   packed int64 (begin, end, crc32c) per piece, as buffer offsets
 * Every offset is checked against the buffer before any thread starts (ValueError). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* CRC-32C here: the crc32c package the Python readers use has no C interface to call without the GIL.
 * SSE4.2's instruction where the CPU has it, slice-by-8 tables elsewhere; tests check both against it. */
static uint32_t table[8][256];
static int have_hw;

static void init_tables(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
        table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) table[t][i] = (table[t - 1][i] >> 8) ^ table[0][table[t - 1][i] & 0xff];
#if defined(__x86_64__)
    __builtin_cpu_init();
    have_hw = __builtin_cpu_supports("sse4.2");
#endif
}

static uint32_t crc_sw(uint32_t c, const uint8_t *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) { c = table[0][(c ^ *p++) & 0xff] ^ (c >> 8); n--; }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= c;
        c = table[7][w & 0xff] ^ table[6][(w >> 8) & 0xff] ^ table[5][(w >> 16) & 0xff] ^ table[4][(w >> 24) & 0xff]
            ^ table[3][(w >> 32) & 0xff] ^ table[2][(w >> 40) & 0xff] ^ table[1][(w >> 48) & 0xff] ^ table[0][w >> 56];
        p += 8; n -= 8;
    }
    while (n--) c = table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t c, const uint8_t *p, size_t n) {
    uint64_t c64;
    while (n && ((uintptr_t)p & 7)) { c = __builtin_ia32_crc32qi(c, *p++); n--; }
    c64 = c;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c64 = __builtin_ia32_crc32di(c64, w);
        p += 8; n -= 8;
    }
    c = (uint32_t)c64;
    while (n--) c = __builtin_ia32_crc32qi(c, *p++);
    return c;
}
#endif

static uint32_t crc32c(const uint8_t *p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
#if defined(__x86_64__)
    if (have_hw) return ~crc_hw(c, p, n);
#endif
    return ~crc_sw(c, p, n);
}

typedef struct {
    int fd;
    uint8_t *buf;
    const int64_t *reqs, *checks;
    Py_ssize_t nreqs;
    Py_ssize_t next;  /* the next request a thread takes (atomic) */
    int status;       /* 0, 1 short, 2 mismatch, 3 errno set (atomic, first one wins) */
    int err;
} job_t;

static void fail(job_t *j, int status, int err) {
    int zero = 0;
    if (__atomic_compare_exchange_n(&j->status, &zero, status, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) j->err = err;
}

static void *worker(void *arg) {
    job_t *j = arg;
    for (;;) {
        Py_ssize_t i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (i >= j->nreqs || __atomic_load_n(&j->status, __ATOMIC_RELAXED)) return NULL;
        const int64_t *r = j->reqs + 5 * i;
        int64_t off = r[0], got = 0, want = r[2];
        uint8_t *dst = j->buf + r[1];
        while (got < want) {
            ssize_t n = pread(j->fd, dst + got, (size_t)(want - got), off + got);
            if (n < 0 && errno == EINTR) continue;
            if (n < 0) { fail(j, 3, errno); return NULL; }
            if (n == 0) { fail(j, 1, 0); return NULL; }
            got += n;
        }
        for (int64_t k = r[3]; k < r[4]; k++) {
            const int64_t *c = j->checks + 3 * k;
            if (crc32c(j->buf + c[0], (size_t)(c[1] - c[0])) != (uint32_t)c[2]) { fail(j, 2, 0); return NULL; }
        }
    }
}

static PyObject *read_checked(PyObject *self, PyObject *args) {
    int fd, threads;
    Py_buffer buf, rq, ck;
    if (!PyArg_ParseTuple(args, "iw*y*y*i", &fd, &buf, &rq, &ck, &threads)) return NULL;
    PyObject *out = NULL;
    Py_ssize_t nreqs = rq.len / 40, nchecks = ck.len / 24;
    const int64_t *reqs = rq.buf, *checks = ck.buf;
    if (rq.len % 40 || ck.len % 24) {
        PyErr_SetString(PyExc_ValueError, "requests are 5 int64 each, checks 3");
        goto done;
    }
    for (Py_ssize_t i = 0; i < nreqs; i++) {
        const int64_t *r = reqs + 5 * i;
        if (r[0] < 0 || r[1] < 0 || r[2] < 0 || r[1] > buf.len || r[2] > buf.len - r[1] || r[3] < 0 || r[3] > r[4]
            || r[4] > nchecks) {
            PyErr_Format(PyExc_ValueError, "read request %zd out of the buffer or the checks", i);
            goto done;
        }
        for (int64_t k = r[3]; k < r[4]; k++) {
            const int64_t *c = checks + 3 * k;
            if (c[0] < r[1] || c[0] > c[1] || c[1] > r[1] + r[2] || c[2] < 0 || c[2] > 0xFFFFFFFFll) {
                PyErr_Format(PyExc_ValueError, "check %lld outside its read request", (long long)k);
                goto done;
            }
        }
    }
    job_t j = {fd, buf.buf, reqs, checks, nreqs, 0, 0, 0};
    if (threads < 1) threads = 1;
    if (threads > nreqs) threads = nreqs > 0 ? (int)nreqs : 1;
    pthread_t tids[256];
    if (threads > 256) threads = 256;
    int started = 0;
    Py_BEGIN_ALLOW_THREADS
    for (; started < threads; started++)
        if (pthread_create(&tids[started], NULL, worker, &j)) break;
    if (started == 0) worker(&j);  /* no thread could start: read here */
    for (int t = 0; t < started; t++) pthread_join(tids[t], NULL);
    Py_END_ALLOW_THREADS
    if (j.status == 3) {
        errno = j.err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    out = PyLong_FromLong(j.status);
done:
    PyBuffer_Release(&buf);
    PyBuffer_Release(&rq);
    PyBuffer_Release(&ck);
    return out;
}

static PyObject *crc(PyObject *self, PyObject *args) {
    Py_buffer b;
    int sw = 0;
    if (!PyArg_ParseTuple(args, "y*|p", &b, &sw)) return NULL;
    uint32_t c;
    Py_BEGIN_ALLOW_THREADS
    c = sw ? ~crc_sw(0xFFFFFFFFu, b.buf, (size_t)b.len) : crc32c(b.buf, (size_t)b.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(c);
}

/* resident(fd, size) -> pages of the file's first `size` bytes in the page cache, and how many there are:
 * mincore over a mapping that is never touched, so asking reads nothing in. */
static PyObject *resident(PyObject *self, PyObject *args) {
    int fd;
    long long size;
    if (!PyArg_ParseTuple(args, "iL", &fd, &size)) return NULL;
    if (size <= 0) return Py_BuildValue("(LL)", 0LL, 0LL);
    long page = sysconf(_SC_PAGESIZE);
    size_t pages = (size_t)((size + page - 1) / page);
    unsigned char *vec = PyMem_RawMalloc(pages);
    if (!vec) return PyErr_NoMemory();
    long long in = 0;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    void *map = mmap(NULL, (size_t)size, PROT_READ, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) err = errno;
    else {
        if (mincore(map, (size_t)size, vec)) err = errno;
        else for (size_t i = 0; i < pages; i++) in += vec[i] & 1;
        munmap(map, (size_t)size);
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(vec);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("(LL)", in, (long long)pages);
}

static PyMethodDef methods[] = {
    {"resident", resident, METH_VARARGS, "resident(fd, size) -> (pages in the page cache, pages)."},
    {"read_checked", read_checked, METH_VARARGS, "Read and check a snapshot's requests on threads of their own."},
    {"crc32c", crc, METH_VARARGS, "crc32c(buffer, software=False): CRC-32C as the reader computes it (tests)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "rollout._kvread", "The KV snapshot's checked read in C.",
                                    -1, methods};

PyMODINIT_FUNC PyInit__kvread(void) {
    init_tables();
    return PyModule_Create(&module);
}
