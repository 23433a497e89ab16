/* Native framing of a bulk JetStream read: the hot loop of spark_projections.source, in C.
 *
 * scan(buf, pos, sid, ack_prefix, subject_prefix) reads consecutive complete
 *
 *     HMSG <subject> <sid> <ack_prefix><delivered>.<sseq>.<dseq>.<ts>.<pending> <hlen> <tlen>\r\n
 *     <header block of hlen bytes><body>\r\n
 *
 * frames from buf[pos:], as written by jetsourcing (subjects <subject_prefix><Category>.<entity>, the
 * five required Es-* headers once each, correlation/causation ids optional), with consecutive
 * consumer sequences. It stops, without
 * taking it, at the first frame that is anything else (another subscription, a status message,
 * another reply layout, a malformed or incomplete frame, a gap): the caller's Python path deals
 * with that one frame and calls scan again. Nothing is copied: string columns come back as Arrow
 * binary-view structs pointing into buf (as the array's first data buffer).
 *
 * Returns (end, count, first_dseq, last_dseq, pending, several, positions, views, correlation, causation):
 *   several    1 if some commit holds several events (a comma in its Es-Type);
 *   end        where the first frame not taken starts;
 *   positions  count little-endian int64 stream sequences;
 *   views      COLUMNS blocks of count 16-byte views (subject, type, schema_version, event_id,
 *              version, recorded_at, correlation_id, causation_id, payload, category, entity);
 *   correlation, causation   count bytes each: 1 where the commit has that (optional) header.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum {
    SUBJECT, TYPE, SCHEMA_VERSION, EVENT_ID, VERSION, RECORDED_AT, CORRELATION_ID, CAUSATION_ID, PAYLOAD, CATEGORY,
    ENTITY, COLUMNS
};
#define REQUIRED 5 /* TYPE .. RECORDED_AT */
#define MAX_CONTROL_LINE 4096

typedef struct {
    int32_t length;
    union {
        uint8_t inline_data[12];
        struct {
            uint8_t prefix[4];
            int32_t buffer_index;
            int32_t offset;
        } ref;
    } u;
} View;

static const struct {
    const char *name;
    size_t length;
    int column;
} HEADERS[] = {
    {"Es-Type", 7, TYPE},
    {"Es-Schema-Version", 17, SCHEMA_VERSION},
    {"Es-Event-Id", 11, EVENT_ID},
    {"Es-Version", 10, VERSION},
    {"Es-Recorded-At", 14, RECORDED_AT},
    {"Es-Correlation-Id", 17, CORRELATION_ID},
    {"Es-Causation-Id", 15, CAUSATION_ID},
};

typedef struct {
    const uint8_t *at;
    Py_ssize_t length;
} Span;

/* A non-negative decimal without sign or spaces that fits an int64; -1 otherwise. */
static int64_t decimal(const uint8_t *at, Py_ssize_t length) {
    if (length < 1 || length > 19) return -1;
    /* Only 19 digits can overflow: compare with INT64_MAX as text (a non-digit fails below anyway). */
    if (length == 19 && memcmp(at, "9223372036854775807", 19) > 0) return -1;
    int64_t value = 0;
    for (Py_ssize_t i = 0; i < length; i++) {
        if (at[i] < '0' || at[i] > '9') return -1;
        value = value * 10 + (at[i] - '0');
    }
    return value;
}

/* Split [at, at + length) on sep into exactly n tokens; 0 if the count differs. */
static int split_exact(const uint8_t *at, Py_ssize_t length, uint8_t sep, Span *out, int n) {
    const uint8_t *end = at + length;
    for (int i = 0; i < n - 1; i++) {
        const uint8_t *next = memchr(at, sep, (size_t)(end - at));
        if (next == NULL) return 0;
        out[i].at = at;
        out[i].length = next - at;
        at = next + 1;
    }
    if (memchr(at, sep, (size_t)(end - at)) != NULL) return 0;
    out[n - 1].at = at;
    out[n - 1].length = end - at;
    return 1;
}

/* The header values of one block; 0 if a required one is missing or any known one repeats. */
static int header_values(const uint8_t *block, Py_ssize_t length, Span *values, int *seen) {
    static const char status_line[] = "NATS/1.0\r\n";
    const Py_ssize_t first = sizeof(status_line) - 1;
    if (length < first + 2 || memcmp(block, status_line, first) != 0) return 0;
    if (block[length - 2] != '\r' || block[length - 1] != '\n') return 0;
    memset(seen, 0, sizeof(int) * COLUMNS);
    Py_ssize_t line = first;
    while (line < length - 2) {
        const uint8_t *cr = memchr(block + line, '\r', (size_t)(length - line));
        if (cr == NULL) return 0;
        Py_ssize_t end = cr - block;
        const uint8_t *colon = memchr(block + line, ':', (size_t)(end - line));
        if (colon != NULL) {
            Py_ssize_t name_length = colon - (block + line);
            for (size_t h = 0; h < sizeof(HEADERS) / sizeof(HEADERS[0]); h++) {
                if ((size_t)name_length == HEADERS[h].length &&
                    memcmp(block + line, HEADERS[h].name, HEADERS[h].length) == 0) {
                    int column = HEADERS[h].column;
                    if (seen[column]) return 0;
                    seen[column] = 1;
                    const uint8_t *value = colon + 1;
                    while (value < cr && (*value == ' ' || *value == '\t')) value++;
                    values[column].at = value;
                    values[column].length = cr - value;
                    break;
                }
            }
        }
        line = end + 2;
    }
    for (int c = TYPE; c < TYPE + REQUIRED; c++) {
        if (!seen[c]) return 0;
    }
    return 1;
}

static void set_view(View *view, const uint8_t *base, Span span, int32_t data_index) {
    memset(view, 0, sizeof(View));
    view->length = (int32_t)span.length;
    if (span.length <= 12) {
        memcpy(view->u.inline_data, span.at, (size_t)span.length);
    } else {
        memcpy(view->u.ref.prefix, span.at, 4);
        view->u.ref.buffer_index = data_index;
        view->u.ref.offset = (int32_t)(span.at - base);
    }
}

/* Grow the output buffers to hold at least `needed` frames. */
static int reserve(Py_ssize_t needed, Py_ssize_t *capacity, int64_t **positions, View **views, uint8_t **present) {
    if (needed <= *capacity) return 1;
    Py_ssize_t grown = *capacity ? *capacity * 2 : 256;
    while (grown < needed) grown *= 2;
    int64_t *p = PyMem_Realloc(*positions, (size_t)grown * sizeof(int64_t));
    if (p == NULL) return 0;
    *positions = p;
    View *v = PyMem_Realloc(*views, (size_t)grown * COLUMNS * sizeof(View));
    if (v == NULL) return 0;
    /* Views are laid out column by column: move the columns apart for the new capacity. */
    for (int c = COLUMNS - 1; c > 0; c--) {
        memmove(v + c * grown, v + c * *capacity, (size_t)*capacity * sizeof(View));
    }
    *views = v;
    uint8_t *b = PyMem_Realloc(*present, (size_t)grown * 2);
    if (b == NULL) return 0;
    memmove(b + grown, b + *capacity, (size_t)*capacity);
    *present = b;
    *capacity = grown;
    return 1;
}

static PyObject *scan(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer buf, sid, prefix, subject_prefix;
    Py_ssize_t pos;
    const int32_t data_index = 0;
    if (!PyArg_ParseTuple(args, "y*ny*y*y*", &buf, &pos, &sid, &prefix, &subject_prefix)) return NULL;
    int several = 0;
    PyObject *result = NULL;
    const uint8_t *base = buf.buf;
    const Py_ssize_t size = buf.len;
    Py_ssize_t capacity = 0, count = 0;
    int64_t *positions = NULL;
    View *views = NULL;
    uint8_t *present = NULL; /* capacity bytes for correlation, then capacity for causation */
    int64_t first_dseq = 0, last_dseq = 0, pending = 0;
    if (pos < 0 || pos > size || size > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "scan: pos out of range, or a buffer over 2 GiB");
        goto done;
    }
    while (size - pos >= 5 && memcmp(base + pos, "HMSG ", 5) == 0) {
        Py_ssize_t line_start = pos + 5;
        Py_ssize_t window = size - line_start < MAX_CONTROL_LINE ? size - line_start : MAX_CONTROL_LINE;
        const uint8_t *cr = memchr(base + line_start, '\r', (size_t)window);
        if (cr == NULL || cr + 1 >= base + size || cr[1] != '\n') break;
        Span tokens[5];
        if (!split_exact(base + line_start, cr - (base + line_start), ' ', tokens, 5)) break;
        if (tokens[1].length != sid.len || memcmp(tokens[1].at, sid.buf, (size_t)sid.len) != 0) break;
        int64_t hlen = decimal(tokens[3].at, tokens[3].length);
        int64_t tlen = decimal(tokens[4].at, tokens[4].length);
        if (hlen < 0 || tlen < hlen) break;
        Py_ssize_t block = (cr - base) + 2;
        if (tlen > size - block - 2) break; /* incomplete */
        Py_ssize_t frame_end = block + (Py_ssize_t)tlen;
        if (base[frame_end] != '\r' || base[frame_end + 1] != '\n') break;
        Span reply = tokens[2];
        if (reply.length <= prefix.len || memcmp(reply.at, prefix.buf, (size_t)prefix.len) != 0) break;
        Span numbers[5];
        if (!split_exact(reply.at + prefix.len, reply.length - prefix.len, '.', numbers, 5)) break;
        int64_t sseq = decimal(numbers[1].at, numbers[1].length);
        int64_t dseq = decimal(numbers[2].at, numbers[2].length);
        int64_t left = decimal(numbers[4].at, numbers[4].length);
        if (sseq < 0 || dseq < 0 || left < 0 || decimal(numbers[0].at, numbers[0].length) < 0 ||
            decimal(numbers[3].at, numbers[3].length) < 0)
            break;
        if (count > 0 && dseq != last_dseq + 1) break;
        Span values[COLUMNS];
        int seen[COLUMNS];
        if (!header_values(base + block, (Py_ssize_t)hlen, values, seen)) break;
        if (!reserve(count + 1, &capacity, &positions, &views, &present)) {
            PyErr_NoMemory();
            goto done;
        }
        values[SUBJECT] = tokens[0];
        /* <subject_prefix><Category>.<entity>: exactly one dot after the prefix, neither part empty. */
        const Span subject = tokens[0];
        if (subject.length <= subject_prefix.len ||
            memcmp(subject.at, subject_prefix.buf, (size_t)subject_prefix.len) != 0)
            break;
        const uint8_t *category = subject.at + subject_prefix.len;
        const uint8_t *subject_end = subject.at + subject.length;
        const uint8_t *dot = memchr(category, '.', (size_t)(subject_end - category));
        if (dot == NULL || dot == category || dot + 1 == subject_end ||
            memchr(dot + 1, '.', (size_t)(subject_end - dot - 1)) != NULL)
            break;
        values[CATEGORY].at = category;
        values[CATEGORY].length = dot - category;
        values[ENTITY].at = dot + 1;
        values[ENTITY].length = subject_end - dot - 1;
        if (memchr(values[TYPE].at, ',', (size_t)values[TYPE].length) != NULL) several = 1;
        values[PAYLOAD].at = base + block + hlen;
        values[PAYLOAD].length = (Py_ssize_t)(tlen - hlen);
        for (int c = 0; c < COLUMNS; c++) {
            Span value = values[c];
            if ((c == CORRELATION_ID || c == CAUSATION_ID) && !seen[c]) {
                value.at = base;
                value.length = 0;
            }
            set_view(&views[(Py_ssize_t)c * capacity + count], base, value, data_index);
        }
        present[count] = (uint8_t)seen[CORRELATION_ID];
        present[capacity + count] = (uint8_t)seen[CAUSATION_ID];
        positions[count] = sseq;
        if (count == 0) first_dseq = dseq;
        last_dseq = dseq;
        pending = left;
        count++;
        pos = frame_end + 2;
    }
    PyObject *positions_out = PyBytes_FromStringAndSize((const char *)positions, count * (Py_ssize_t)sizeof(int64_t));
    PyObject *views_out = PyBytes_FromStringAndSize(NULL, count * COLUMNS * (Py_ssize_t)sizeof(View));
    PyObject *correlation = PyBytes_FromStringAndSize(count ? (const char *)present : NULL, count);
    PyObject *causation = PyBytes_FromStringAndSize(count ? (const char *)present + capacity : NULL, count);
    if (positions_out && views_out && correlation && causation) {
        char *out = PyBytes_AS_STRING(views_out);
        for (int c = 0; c < COLUMNS && count > 0; c++) {
            memcpy(out + (size_t)c * (size_t)count * sizeof(View), views + (Py_ssize_t)c * capacity,
                   (size_t)count * sizeof(View));
        }
        result = Py_BuildValue("(nnLLLiNNNN)", pos, count, (long long)first_dseq, (long long)last_dseq,
                               (long long)pending, several, positions_out, views_out, correlation, causation);
    } else {
        Py_XDECREF(positions_out);
        Py_XDECREF(views_out);
        Py_XDECREF(correlation);
        Py_XDECREF(causation);
    }
done:
    PyMem_Free(positions);
    PyMem_Free(views);
    PyMem_Free(present);
    PyBuffer_Release(&buf);
    PyBuffer_Release(&sid);
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&subject_prefix);
    return result;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS, "Frame a run of JetStream messages into Arrow views (see the module source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_frames", "Native framing of bulk JetStream reads.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__frames(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "COLUMNS", COLUMNS) < 0 || PyModule_AddIntConstant(m, "VIEW_SIZE", sizeof(View)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
