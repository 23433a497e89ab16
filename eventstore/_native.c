/* The native accelerator of bulk reads (eventstore._native): the hot loops of a replay, in C.
 *
 * Built for CPython's stable ABI (Py_LIMITED_API 3.11: one wheel for every CPython from 3.11 on), optional:
 * every function has a Python twin the readers fall back to (see eventstore/native.py).
 *
 * headers(type, schema_version, event_id, version, recorded_at, correlation_id, causation_id)
 * sets the header names the scanner looks for; eventstore.native passes eventstore.wire.Header's at import,
 * so the names are defined once. names() returns them back, for a test.
 *
 * parse_headers(block) parses a NATS header block ("NATS/1.0\r\nName: value\r\n...") into a dict exactly
 * as nats-py does; None for a block that is not ASCII (the Python twin handles those).
 *
 * events(buf, pos, sid, ack_prefix, ...) frames a run of the consumer's messages as scan does, for any writer's
 * headers and subjects, and turns each plain commit into its RecordedEvent: every replay's path.
 *
 * scan(buf, pos, sid, ack_prefix, subject_prefix) reads consecutive complete
 *
 *     HMSG <subject> <sid> <ack_prefix><delivered>.<sseq>.<dseq>.<ts>.<pending> <hlen> <tlen>\r\n
 *     <header block of hlen bytes><body>\r\n
 *
 * frames from buf[pos:], as written by jetsourcing (subjects <subject_prefix><Category>.<entity>, the
 * five required headers once each, correlation/causation ids optional), with consecutive
 * consumer sequences. It stops, without
 * taking it, at the first frame that is anything else (another subscription, a status message,
 * another reply layout, a malformed or incomplete frame, a gap): the caller's Python path deals
 * with that one frame and calls scan again. Nothing is copied: string columns come back as Arrow
 * binary-view structs pointing into buf (as the array's first data buffer).
 *
 * Returns (end, count, first_dseq, last_dseq, pending, several, positions, views, correlation, causation):
 *   end        where the first frame not taken starts;
 *   count      frames taken; first_dseq, last_dseq their consumer sequences; pending the last one's;
 *   several    1 if some commit holds several events (a comma in its Es-Type);
 *   positions  count little-endian int64 stream sequences;
 *   views      a tuple of COLUMNS items (subject, type, schema_version, event_id, version, recorded_at,
 *              correlation_id, causation_id, payload, category, entity): count 16-byte views each;
 *   correlation, causation   count bytes each: 1 where the commit has that (optional) header.
 *
 * The loop runs once per message of a bulk read, so it searches bytes with SSE2 where the
 * compiler offers it (16 bytes a step, no call per search) and writes every output straight
 * into the bytearrays it returns, sized at the first frame taken for the most frames the rest
 * of the input can hold (and shrunk to what was taken).
 */

#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

enum {
    SUBJECT, TYPE, SCHEMA_VERSION, EVENT_ID, VERSION, RECORDED_AT, CORRELATION_ID, CAUSATION_ID, PAYLOAD, CATEGORY,
    ENTITY, COLUMNS
};
#define REQUIRED 5 /* TYPE .. RECORDED_AT */
#define MAX_CONTROL_LINE 4096
/* No frame the scanner takes is shorter (the smallest is 113 bytes): "HMSG " and four separators,
 * a subject of at least three bytes after its prefix, a sid, a reply of at least nine bytes after
 * its prefix, two lengths, a line end, the status line and the five required headers with empty
 * values (84 bytes), the closing line end. Only a bound on the outputs' size: they grow if needed. */
#define MIN_FRAME 100

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

/* The first byte c in [at, end), or NULL: inline, as the spans searched are mostly short. */
static inline const uint8_t *find(const uint8_t *at, const uint8_t *end, uint8_t c) {
#if defined(__SSE2__)
    const __m128i needle = _mm_set1_epi8((char)c);
    while (end - at >= 16) {
        int hits = _mm_movemask_epi8(_mm_cmpeq_epi8(_mm_loadu_si128((const __m128i *)at), needle));
        if (hits) return at + __builtin_ctz((unsigned)hits);
        at += 16;
    }
#endif
    for (; at < end; at++) {
        if (*at == c) return at;
    }
    return NULL;
}

/* Split [at, at + length) on sep into exactly n tokens; 0 if the count differs. */
static int split_exact(const uint8_t *at, Py_ssize_t length, uint8_t sep, Span *out, int n) {
    const uint8_t *end = at + length;
    for (int i = 0; i < n - 1; i++) {
        const uint8_t *next = find(at, end, sep);
        if (next == NULL) return 0;
        out[i].at = at;
        out[i].length = next - at;
        at = next + 1;
    }
    if (find(at, end, sep) != NULL) return 0;
    out[n - 1].at = at;
    out[n - 1].length = end - at;
    return 1;
}

/* The header names of the columns TYPE .. CAUSATION_ID, then of the idempotency key and the atomic batch id
 * (slots past the columns, read by events() only), as headers() set them (eventstore.wire.Header). */
#define COLUMN_NAMED (CAUSATION_ID - TYPE + 1)
#define NAMED (COLUMN_NAMED + 2)
enum { KEY = COLUMNS, BATCH, SLOTS };
static char names[NAMED][64];
static Py_ssize_t name_length[NAMED];
static int named = 0;

/* Which known header a name is (its slot), or -1. */
static inline int header_column(const uint8_t *name, Py_ssize_t length) {
    for (int i = 0; i < NAMED; i++) {
        if (name_length[i] == length && memcmp(name, names[i], (size_t)length) == 0) {
            return i < COLUMN_NAMED ? TYPE + i : COLUMNS + (i - COLUMN_NAMED);
        }
    }
    return -1;
}

/* The header values of one block; 0 if a required one is missing or any known one repeats. */
static int header_values(const uint8_t *block, Py_ssize_t length, Span *values, int *seen) {
    static const char status_line[] = "NATS/1.0\r\n";
    const Py_ssize_t first = sizeof(status_line) - 1;
    if (length < first + 2 || memcmp(block, status_line, first) != 0) return 0;
    if (block[length - 2] != '\r' || block[length - 1] != '\n') return 0;
    memset(seen, 0, sizeof(int) * SLOTS);
    const uint8_t *end = block + length;
    const uint8_t *line = block + first;
    while (line < end - 2) {
        const uint8_t *cr = find(line, end, '\r');
        if (cr == NULL) return 0;
        const uint8_t *colon = find(line, cr, ':');
        if (colon != NULL) {
            int column = header_column(line, colon - line);
            if (column >= 0) {
                if (seen[column]) return 0;
                seen[column] = 1;
                const uint8_t *value = colon + 1;
                while (value < cr && (*value == ' ' || *value == '\t')) value++;
                values[column].at = value;
                values[column].length = cr - value;
            }
        }
        line = cr + 2;
    }
    for (int c = TYPE; c < TYPE + REQUIRED; c++) {
        if (!seen[c]) return 0;
    }
    return 1;
}

/* One complete HMSG frame at buf[pos:] of subscription `sid` whose reply subject is `prefix` and five numbers
 * (a consumer's delivery): where its parts are. */
typedef struct {
    Span subject;
    Py_ssize_t block;   /* where the header block starts */
    int64_t hlen, tlen; /* header bytes, header and body bytes */
    int64_t sseq, dseq, pending;
    Py_ssize_t end;     /* where the next frame starts */
} Frame;

/* 1 and *f filled if buf[pos:] starts with such a frame; 0 if it does not (another kind of frame, a malformed
 * or incomplete one). */
static int next_frame(const uint8_t *base, Py_ssize_t size, Py_ssize_t pos, const Py_buffer *sid,
                      const Py_buffer *prefix, Frame *f) {
    if (size - pos < 5 || memcmp(base + pos, "HMSG ", 5) != 0) return 0;
    Py_ssize_t line_start = pos + 5;
    Py_ssize_t window = size - line_start < MAX_CONTROL_LINE ? size - line_start : MAX_CONTROL_LINE;
    const uint8_t *cr = find(base + line_start, base + line_start + window, '\r');
    if (cr == NULL || cr + 1 >= base + size || cr[1] != '\n') return 0;
    Span tokens[5];
    if (!split_exact(base + line_start, cr - (base + line_start), ' ', tokens, 5)) return 0;
    if (tokens[1].length != sid->len || memcmp(tokens[1].at, sid->buf, (size_t)sid->len) != 0) return 0;
    f->hlen = decimal(tokens[3].at, tokens[3].length);
    f->tlen = decimal(tokens[4].at, tokens[4].length);
    if (f->hlen < 0 || f->tlen < f->hlen) return 0;
    f->block = (cr - base) + 2;
    if (f->tlen > size - f->block - 2) return 0; /* incomplete */
    Py_ssize_t frame_end = f->block + (Py_ssize_t)f->tlen;
    if (base[frame_end] != '\r' || base[frame_end + 1] != '\n') return 0;
    Span reply = tokens[2];
    if (reply.length <= prefix->len || memcmp(reply.at, prefix->buf, (size_t)prefix->len) != 0) return 0;
    Span numbers[5];
    if (!split_exact(reply.at + prefix->len, reply.length - prefix->len, '.', numbers, 5)) return 0;
    f->sseq = decimal(numbers[1].at, numbers[1].length);
    f->dseq = decimal(numbers[2].at, numbers[2].length);
    f->pending = decimal(numbers[4].at, numbers[4].length);
    if (f->sseq < 0 || f->dseq < 0 || f->pending < 0 || decimal(numbers[0].at, numbers[0].length) < 0 ||
        decimal(numbers[3].at, numbers[3].length) < 0)
        return 0;
    f->subject = tokens[0];
    f->end = frame_end + 2;
    return 1;
}

static inline void set_view(View *view, const uint8_t *base, Span span, int32_t data_index) {
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

/* The scan's outputs, written in place into the bytes objects it returns. */
typedef struct {
    Py_ssize_t capacity;
    PyObject *positions;        /* bytearrays: capacity int64 */
    PyObject *views[COLUMNS];   /* capacity views each */
    PyObject *present[2];       /* capacity flags each: correlation, causation */
    int64_t *position_at;       /* where the above are written, valid until the next resize */
    View *view_at[COLUMNS];
    uint8_t *present_at[2];
} Outputs;

static void release(Outputs *out) {
    Py_CLEAR(out->positions);
    for (int c = 0; c < COLUMNS; c++) Py_CLEAR(out->views[c]);
    Py_CLEAR(out->present[0]);
    Py_CLEAR(out->present[1]);
}

/* (Re)size every output to `capacity` frames, keeping what is written; 0 with an exception on failure. */
static int resize(Outputs *out, Py_ssize_t capacity) {
    PyObject **all[COLUMNS + 3];
    Py_ssize_t width[COLUMNS + 3];
    int n = 0;
    all[n] = &out->positions, width[n++] = sizeof(int64_t);
    for (int c = 0; c < COLUMNS; c++) all[n] = &out->views[c], width[n++] = sizeof(View);
    all[n] = &out->present[0], width[n++] = 1;
    all[n] = &out->present[1], width[n++] = 1;
    for (int i = 0; i < n; i++) {
        Py_ssize_t size = capacity * width[i];
        if (*all[i] == NULL) {
            *all[i] = PyByteArray_FromStringAndSize(NULL, size);
            if (*all[i] == NULL) return 0;
        } else if (PyByteArray_Resize(*all[i], size) < 0) {
            return 0;
        }
    }
    out->capacity = capacity;
    out->position_at = (int64_t *)PyByteArray_AsString(out->positions);
    for (int c = 0; c < COLUMNS; c++) out->view_at[c] = (View *)PyByteArray_AsString(out->views[c]);
    out->present_at[0] = (uint8_t *)PyByteArray_AsString(out->present[0]);
    out->present_at[1] = (uint8_t *)PyByteArray_AsString(out->present[1]);
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
    Outputs out = {0};
    Py_ssize_t count = 0;
    int64_t first_dseq = 0, last_dseq = 0, pending = 0;
    if (!named) {
        PyErr_SetString(PyExc_RuntimeError, "scan: headers() was not called (import eventstore.native)");
        goto done;
    }
    if (pos < 0 || pos > size || size > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "scan: pos out of range, or a buffer over 2 GiB");
        goto done;
    }
    Frame f;
    while (next_frame(base, size, pos, &sid, &prefix, &f)) {
        if (count > 0 && f.dseq != last_dseq + 1) break;
        Span values[SLOTS];
        int seen[SLOTS];
        if (!header_values(base + f.block, (Py_ssize_t)f.hlen, values, seen)) break;
        values[SUBJECT] = f.subject;
        /* <subject_prefix><Category>.<entity>: exactly one dot after the prefix, neither part empty. */
        const Span subject = f.subject;
        if (subject.length <= subject_prefix.len ||
            memcmp(subject.at, subject_prefix.buf, (size_t)subject_prefix.len) != 0)
            break;
        const uint8_t *category = subject.at + subject_prefix.len;
        const uint8_t *subject_end = subject.at + subject.length;
        const uint8_t *dot = find(category, subject_end, '.');
        if (dot == NULL || dot == category || dot + 1 == subject_end || find(dot + 1, subject_end, '.') != NULL)
            break;
        /* Allocated at the first frame taken, so a call that takes none (the caller tries one before
         * each frame it frames in Python) costs nothing; grown only if MIN_FRAME were wrong. */
        if (count == out.capacity &&
            !resize(&out, count == 0 ? (size - pos) / MIN_FRAME + 1 : out.capacity * 2))
            goto done;
        values[CATEGORY].at = category;
        values[CATEGORY].length = dot - category;
        values[ENTITY].at = dot + 1;
        values[ENTITY].length = subject_end - dot - 1;
        if (find(values[TYPE].at, values[TYPE].at + values[TYPE].length, ',') != NULL) several = 1;
        values[PAYLOAD].at = base + f.block + f.hlen;
        values[PAYLOAD].length = (Py_ssize_t)(f.tlen - f.hlen);
        for (int c = 0; c < COLUMNS; c++) {
            Span value = values[c];
            if ((c == CORRELATION_ID || c == CAUSATION_ID) && !seen[c]) {
                value.at = base;
                value.length = 0;
            }
            set_view(out.view_at[c] + count, base, value, data_index);
        }
        out.present_at[0][count] = (uint8_t)seen[CORRELATION_ID];
        out.present_at[1][count] = (uint8_t)seen[CAUSATION_ID];
        out.position_at[count] = f.sseq;
        if (count == 0) first_dseq = f.dseq;
        last_dseq = f.dseq;
        pending = f.pending;
        count++;
        pos = f.end;
    }
    if (!resize(&out, count)) goto done;
    PyObject *views = PyTuple_New(COLUMNS);
    if (views == NULL) goto done;
    for (int c = 0; c < COLUMNS; c++) {
        PyTuple_SetItem(views, c, out.views[c]); /* the tuple takes the reference */
        out.views[c] = NULL;
    }
    /* N hands over the references (released by Py_BuildValue itself should it fail). */
    result = Py_BuildValue("(nnLLLiNNNN)", pos, count, (long long)first_dseq, (long long)last_dseq, (long long)pending,
                           several, out.positions, views, out.present[0], out.present[1]);
    out.positions = out.present[0] = out.present[1] = NULL;
done:
    release(&out);
    PyBuffer_Release(&buf);
    PyBuffer_Release(&sid);
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&subject_prefix);
    return result;
}

/* ASCII whitespace as bytes.strip() strips it, and as str.isspace() sees it (which adds \x1c-\x1f). */
static inline int strip_space(uint8_t c) { return c == ' ' || (c >= '\t' && c <= '\r'); }
static inline int any_space(uint8_t c) { return strip_space(c) || (c >= 0x1c && c <= 0x1f); }

/* Header names as str objects, made once each: a replay parses the same dozen names in every message, and a
 * dict lookup by an identical object skips the string compare. A new reference; NULL with an exception. */
#define NAME_CACHE 64
#define NAME_MAX_LENGTH 64
static struct {
    Py_ssize_t length;
    char bytes[NAME_MAX_LENGTH];
    PyObject *name;
} name_cache[NAME_CACHE];
static int names_cached = 0;

static PyObject *header_name(const uint8_t *at, Py_ssize_t length) {
    for (int i = 0; i < names_cached; i++) {
        if (name_cache[i].length == length && memcmp(name_cache[i].bytes, at, (size_t)length) == 0) {
            Py_INCREF(name_cache[i].name);
            return name_cache[i].name;
        }
    }
    PyObject *name = PyUnicode_DecodeASCII((const char *)at, length, NULL);
    if (name != NULL && names_cached < NAME_CACHE && length <= NAME_MAX_LENGTH) {
        name_cache[names_cached].length = length;
        memcpy(name_cache[names_cached].bytes, at, (size_t)length);
        Py_INCREF(name);
        name_cache[names_cached++].name = name; /* kept for the life of the process */
    }
    return name;
}

/* A header block's fields as nats-py parses them: a new dict; Py_None (a new reference) when the block is not
 * ASCII; NULL with an exception on failure. */
static PyObject *header_dict(const uint8_t *at, Py_ssize_t length) {
    const uint8_t *end = at + length;
    for (const uint8_t *p = at; p < end; p++) {
        if (*p & 0x80) {
            Py_INCREF(Py_None);
            return Py_None;
        }
    }
    PyObject *fields = PyDict_New();
    if (fields == NULL) return NULL;
    const uint8_t *line = at;
    for (;;) {
        /* The line ends at the next CRLF (a lone CR or LF stays inside it, as in nats-py). */
        const uint8_t *eol = line;
        while (eol < end && !(eol[0] == '\r' && eol + 1 < end && eol[1] == '\n')) eol++;
        const uint8_t *colon = memchr(line, ':', (size_t)(eol - line));
        if (colon != NULL) {
            const uint8_t *ls = line, *le = colon;
            while (ls < le && strip_space(*ls)) ls++;
            while (le > ls && strip_space(le[-1])) le--;
            int inner_space = 0;
            for (const uint8_t *p = ls; p < le; p++) {
                if (any_space(*p)) {
                    inner_space = 1;
                    break;
                }
            }
            if (!inner_space) {
                const uint8_t *vs = colon + 1, *ve = eol;
                while (vs < ve && strip_space(*vs)) vs++;
                while (ve > vs && strip_space(ve[-1])) ve--;
                PyObject *key = header_name(ls, le - ls);
                PyObject *value = key == NULL ? NULL : PyUnicode_DecodeASCII((const char *)vs, ve - vs, NULL);
                int failed = value == NULL || PyDict_SetItem(fields, key, value) < 0;
                Py_XDECREF(key);
                Py_XDECREF(value);
                if (failed) {
                    Py_DECREF(fields);
                    return NULL;
                }
            }
        }
        if (eol >= end) break;
        line = eol + 2;
    }
    return fields;
}

static PyObject *parse_headers(PyObject *Py_UNUSED(self), PyObject *arg) {
    char *data;
    Py_ssize_t length;
    if (PyBytes_AsStringAndSize(arg, &data, &length) < 0) return NULL;
    return header_dict((const uint8_t *)data, length);
}

/* Whether nats-py would read the known headers of this block exactly as header_values() does: ASCII, every CR
 * followed by LF (nats-py splits lines on CRLF only), no whitespace in or around any header name, and no
 * whitespace at either end of a value past the spaces and tabs after its colon. */
static int clean_block(const uint8_t *at, Py_ssize_t length) {
    const uint8_t *end = at + length;
    for (const uint8_t *p = at; p < end; p++) {
        if ((*p & 0x80) || (*p == '\r' && (p + 1 >= end || p[1] != '\n'))) return 0;
    }
    const uint8_t *line = at;
    while (line < end) {
        const uint8_t *eol = find(line, end, '\r');
        if (eol == NULL) eol = end;
        const uint8_t *colon = memchr(line, ':', (size_t)(eol - line));
        if (colon != NULL) {
            for (const uint8_t *p = line; p < colon; p++) {
                if (any_space(*p)) return 0;
            }
            const uint8_t *value = colon + 1;
            while (value < eol && (*value == ' ' || *value == '\t')) value++;
            if (value < eol && (strip_space(*value) || strip_space(eol[-1]))) return 0;
        }
        line = eol + 2;
    }
    return 1;
}

/* A span's ASCII text as str; NULL with an exception. */
static PyObject *text(Span span) { return PyUnicode_DecodeASCII((const char *)span.at, span.length, NULL); }

/* events(buf, pos, sid, ack_prefix, streams, make_stream, registry, new_event, handled): a run of consecutive
 * HMSG frames of the consumer, as scan() takes them but for any writer's headers and subjects. Each commit
 * that is plain (one event, the required headers once each, no atomic batch header, an
 * idempotency key without escapes, a clean header block) becomes its RecordedEvent here, built with
 * new_event(values) (a tuple of the 14 fields); its stream id is streams[subject], or make_stream(subject).
 * With handled (a set of type names, or None) a plain commit of another type is skipped. Returns (end, count,
 * first_dseq, last_dseq, pending, positions, subjects, headers, bodies, events): per commit, the event (headers
 * None), or None with headers None (skipped), or None with its header dict (for the Python decoder). With
 * new_event None nothing is decoded: every commit comes with its header dict. */
static PyObject *events(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer buf, sid, prefix;
    Py_ssize_t pos;
    PyObject *streams, *make_stream, *registry, *new_event, *handled;
    if (!PyArg_ParseTuple(args, "y*ny*y*O!OOOO", &buf, &pos, &sid, &prefix, &PyDict_Type, &streams, &make_stream,
                          &registry, &new_event, &handled))
        return NULL;
    PyObject *result = NULL, *lists[5] = {NULL, NULL, NULL, NULL, NULL};
    const uint8_t *base = buf.buf;
    const Py_ssize_t size = buf.len;
    Py_ssize_t count = 0;
    int64_t first_dseq = 0, last_dseq = 0, pending = 0;
    if (!named || pos < 0 || pos > size) {
        PyErr_SetString(PyExc_ValueError, "events: pos out of range, or headers() was not called");
        goto done;
    }
    for (int i = 0; i < 5; i++) {
        if ((lists[i] = PyList_New(0)) == NULL) goto done;
    }
    Frame f;
    while (next_frame(base, size, pos, &sid, &prefix, &f)) {
        if (count > 0 && f.dseq != last_dseq + 1) break;
        const uint8_t *block = base + f.block;
        Span values[SLOTS];
        int seen[SLOTS];
        int plain = new_event != Py_None && clean_block(block, (Py_ssize_t)f.hlen) &&
                    header_values(block, (Py_ssize_t)f.hlen, values, seen) &&
                    !seen[BATCH] && find(values[TYPE].at, values[TYPE].at + values[TYPE].length, ',') == NULL &&
                    (!seen[KEY] || find(values[KEY].at, values[KEY].at + values[KEY].length, '%') == NULL);
        int64_t version = plain ? decimal(values[VERSION].at, values[VERSION].length) : -1;
        int64_t schema = plain ? decimal(values[SCHEMA_VERSION].at, values[SCHEMA_VERSION].length) : -1;
        PyObject *subject = PyBytes_FromStringAndSize((const char *)f.subject.at, f.subject.length);
        PyObject *body = PyBytes_FromStringAndSize((const char *)(block + f.hlen), (Py_ssize_t)(f.tlen - f.hlen));
        PyObject *position = PyLong_FromLongLong((long long)f.sseq);
        PyObject *headers = NULL, *event = NULL;
        int failed = subject == NULL || body == NULL || position == NULL;
        if (!failed && (version < 0 || schema < 0 || version > INT32_MAX || schema > INT32_MAX)) {
            headers = header_dict(block, (Py_ssize_t)f.hlen); /* the Python decoder says what is wrong, if anything */
            failed = headers == NULL;
            if (!failed && headers == Py_None) {
                Py_DECREF(headers);
                Py_XDECREF(subject);
                Py_XDECREF(body);
                Py_XDECREF(position);
                break; /* not ASCII: the Python framing takes it */
            }
        } else if (!failed) {
            int fallback = 0;
            PyObject *type = text(values[TYPE]);
            int wanted = type == NULL ? -1 : handled == Py_None ? 1 : PySet_Contains(handled, type);
            failed = wanted < 0;
            if (wanted == 1) {
                PyObject *stream_id = PyDict_GetItemWithError(streams, subject); /* borrowed */
                if (stream_id != NULL) {
                    Py_INCREF(stream_id);
                } else if (!PyErr_Occurred()) {
                    stream_id = PyObject_CallFunctionObjArgs(make_stream, subject, NULL);
                    if (stream_id == NULL) {
                        /* Not an event subject: the Python decoder raises about it where the reader sees it. */
                        PyErr_Clear();
                        fallback = 1;
                    }
                }
                PyObject *fields = stream_id == NULL ? NULL : Py_BuildValue(
                    "(OiOLOLNONNNONN)", position, 0, stream_id, (long long)version, type, (long long)schema,
                    text(values[EVENT_ID]), body, seen[RECORDED_AT] ? text(values[RECORDED_AT]) : PyUnicode_FromString(""),
                    seen[CORRELATION_ID] ? text(values[CORRELATION_ID]) : Py_NewRef(Py_None),
                    seen[CAUSATION_ID] ? text(values[CAUSATION_ID]) : Py_NewRef(Py_None), registry, PyList_New(0),
                    seen[KEY] ? text(values[KEY]) : Py_NewRef(Py_None));
                Py_XDECREF(stream_id);
                event = fields == NULL ? NULL : PyObject_CallFunctionObjArgs(new_event, fields, NULL);
                Py_XDECREF(fields);
                failed = event == NULL && !fallback;
            }
            Py_XDECREF(type);
            if (fallback && !failed) {
                headers = header_dict(block, (Py_ssize_t)f.hlen); /* clean, so ASCII: a dict */
                failed = headers == NULL;
            }
        }
        PyObject *items[5] = {position, subject, headers ? headers : Py_NewRef(Py_None), body,
                              event ? event : Py_NewRef(Py_None)};
        for (int i = 0; i < 5; i++) {
            failed = failed || items[i] == NULL || PyList_Append(lists[i], items[i]) < 0;
            Py_XDECREF(items[i]);
        }
        if (failed) goto done;
        if (count == 0) first_dseq = f.dseq;
        last_dseq = f.dseq;
        pending = f.pending;
        count++;
        pos = f.end;
    }
    result = Py_BuildValue("(nnLLLNNNNN)", pos, count, (long long)first_dseq, (long long)last_dseq,
                           (long long)pending, lists[0], lists[1], lists[2], lists[3], lists[4]);
    for (int i = 0; i < 5; i++) lists[i] = NULL; /* N handed the references over */
done:
    for (int i = 0; i < 5; i++) Py_XDECREF(lists[i]);
    PyBuffer_Release(&buf);
    PyBuffer_Release(&sid);
    PyBuffer_Release(&prefix);
    return result;
}

static PyObject *set_headers(PyObject *Py_UNUSED(self), PyObject *args) {
    if (!PyTuple_Check(args) || PyTuple_Size(args) != NAMED) {
        PyErr_Format(PyExc_TypeError, "headers() takes the %d header names as bytes", NAMED);
        return NULL;
    }
    char given[NAMED][64];
    Py_ssize_t lengths[NAMED];
    for (int i = 0; i < NAMED; i++) {
        char *name;
        if (PyBytes_AsStringAndSize(PyTuple_GetItem(args, i), &name, &lengths[i]) < 0) return NULL;
        if (lengths[i] < 1 || lengths[i] >= 64) {
            PyErr_SetString(PyExc_ValueError, "headers(): a header name must have 1 to 63 bytes");
            return NULL;
        }
        memcpy(given[i], name, (size_t)lengths[i]);
    }
    memcpy(names, given, sizeof(names));
    memcpy(name_length, lengths, sizeof(name_length));
    named = 1;
    Py_RETURN_NONE;
}

static PyObject *get_names(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyTuple_New(NAMED);
    if (out == NULL) return NULL;
    for (int i = 0; i < NAMED; i++) {
        PyObject *name = PyBytes_FromStringAndSize(names[i], named ? name_length[i] : 0);
        if (name == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SetItem(out, i, name);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS, "Frame a run of JetStream messages into Arrow views (see the module source)."},
    {"parse_headers", parse_headers, METH_O, "A NATS header block as nats-py parses it; None if it is not ASCII."},
    {"events", events, METH_VARARGS, "Frame a run of JetStream messages into events (see the module source)."},
    {"headers", set_headers, METH_VARARGS, "Set the header names of the scanner's columns, from eventstore.wire."},
    {"names", get_names, METH_NOARGS, "The header names headers() set, in its order."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native", "The native accelerator of bulk reads.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "COLUMNS", COLUMNS) < 0 || PyModule_AddIntConstant(m, "VIEW_SIZE", sizeof(View)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
