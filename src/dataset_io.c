#include "internal.h"

/* ===========================================================================
 * Datasets from files: IDX, NumPy .npy, CSV and token streams
 *
 * IDX files are read through zlib's gzread, which also reads uncompressed
 * files, so .gz and plain files take one path.  Images stay uint8 (47 MB for
 * Fashion-MNIST's training set instead of 188 MB as floats) and are
 * converted per batch through a 256-entry table (dataset_xform_init).
 * .npy, raw and token files are memory-mapped and checked against their
 * headers and sizes before anything is read; CSV is parsed into memory.
 * ======================================================================== */

#define DT_IDX_MAX_BYTES ((uint64_t)1 << 32)   /* refuse absurd headers */

static dt_status gz_read_all(dt_ctx *ctx, gzFile gz, void *dst, uint64_t n, const char *path)
{
    uint8_t *p = dst;
    while (n > 0) {
        unsigned chunk = n > (1u << 30) ? (1u << 30) : (unsigned)n;
        int got = gzread(gz, p, chunk);
        if (got <= 0 || (unsigned)got != chunk) {
            int zerr = 0;
            const char *msg = gzerror(gz, &zerr);
            return set_error(ctx, DT_ECORRUPT, "dataset: %s is truncated or corrupt (%s)", path,
                             zerr ? msg : "unexpected end of file");
        }
        p += chunk;
        n -= chunk;
    }
    return DT_OK;
}

/* Read an IDX header: magic 0x0000 08 ndim, then ndim big-endian u32 dims. */
static dt_status idx_header(dt_ctx *ctx, gzFile gz, const char *path, int want_ndim,
                            uint64_t *dims)
{
    unsigned char h[4];
    dt_status s = gz_read_all(ctx, gz, h, 4, path);
    if (s != DT_OK)
        return s;
    if (h[0] != 0 || h[1] != 0 || h[2] != 0x08 || h[3] != want_ndim)
        return set_error(ctx, DT_ECORRUPT, "dataset: %s is not a uint8 IDX file with %d dims "
                         "(magic %02x %02x %02x %02x)", path, want_ndim, h[0], h[1], h[2], h[3]);
    uint64_t total = 1;
    for (int i = 0; i < want_ndim; i++) {
        unsigned char d[4];
        if ((s = gz_read_all(ctx, gz, d, 4, path)) != DT_OK)
            return s;
        dims[i] = (uint64_t)d[0] << 24 | (uint64_t)d[1] << 16 | (uint64_t)d[2] << 8 | d[3];
        total *= dims[i] ? dims[i] : 1;
        if (dims[i] == 0 || total > DT_IDX_MAX_BYTES)
            return set_error(ctx, DT_ECORRUPT, "dataset: %s has an impossible dimension %d = %llu",
                             path, i, (unsigned long long)dims[i]);
    }
    return DT_OK;
}

/* The n bytes after the header, into memory that grows with what the file
 * really holds (at most twice it): a header may claim gigabytes of a tiny or
 * compressed file, and must not get them allocated (found by fuzz_idx). */
static dt_status idx_read_body(dt_ctx *ctx, gzFile gz, uint64_t n, const char *path, uint8_t **out)
{
    uint64_t have = 0, cap = n < ((uint64_t)1 << 20) ? n : ((uint64_t)1 << 20);
    uint8_t *buf = host_alloc(ctx, (size_t)cap);
    dt_status s = buf ? DT_OK : set_error(ctx, DT_ENOMEM, "dataset: out of memory for %s", path);
    while (s == DT_OK && have < n) {
        if (have == cap) {
            uint64_t more = cap * 2 < n ? cap * 2 : n;
            uint8_t *b = ctx->al.realloc_fn(buf, (size_t)more, ctx->al.user);
            if (!b) {
                s = set_error(ctx, DT_ENOMEM, "dataset: out of memory for %s", path);
                break;
            }
            buf = b;
            cap = more;
        }
        s = gz_read_all(ctx, gz, buf + have, cap - have, path);
        have = cap;
    }
    if (s != DT_OK) {
        host_free(ctx, buf);
        return s;
    }
    *out = buf;
    return DT_OK;
}

static dt_status idx_load(dt_ctx *ctx, const char *path, int ndim, uint64_t *dims, uint8_t **out)
{
    gzFile gz = gzopen(path, "rb");
    if (!gz)
        return set_error(ctx, DT_EIO, "dataset: cannot open %s: %s", path, strerror(errno));
    dt_status s = idx_header(ctx, gz, path, ndim, dims);
    uint64_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= dims[i];
    uint8_t *buf = NULL;
    if (s == DT_OK)
        s = idx_read_body(ctx, gz, n, path, &buf);
    gzclose(gz);
    if (s != DT_OK) {
        host_free(ctx, buf);
        return s;
    }
    *out = buf;
    return DT_OK;
}

dt_dataset *dt_dataset_load_idx(dt_ctx *ctx, const char *images_path, const char *labels_path)
{
    if (!ctx_ok(ctx))
        return NULL;
    if (!images_path || !labels_path) {
        set_error(ctx, DT_EINVAL, "dataset: image and label paths are required");
        return NULL;
    }
    uint64_t idim[3], ldim[1];
    uint8_t *images = NULL, *labels = NULL;
    if (idx_load(ctx, images_path, 3, idim, &images) != DT_OK ||
        idx_load(ctx, labels_path, 1, ldim, &labels) != DT_OK)
        goto fail;
    if (idim[0] != ldim[0]) {
        set_error(ctx, DT_EMISMATCH, "dataset: %s has %llu images but %s has %llu labels",
                  images_path, (unsigned long long)idim[0], labels_path,
                  (unsigned long long)ldim[0]);
        goto fail;
    }
    dt_sample_field in = {DT_U8, 3, {1, (int64_t)idim[1], (int64_t)idim[2]}}, tgt = {DT_U8, 0, {0}};
    dt_dataset *ds = dt_dataset_from_memory(ctx, (int64_t)idim[0], &in, images, &tgt, labels, 0);
    if (!ds)
        goto fail;
    ds->own[0] = images;   /* the dataset frees them */
    ds->own[1] = labels;
    ds->scale_u8 = 1;      /* pixels as value/255, as torchvision's ToTensor */
    return ds;
fail:
    host_free(ctx, images);
    host_free(ctx, labels);
    return NULL;
}

/* --- NumPy .npy ------------------------------------------------------------ */

#define NPY_MAX_HEADER ((size_t)1 << 20)

typedef struct npy_array {
    dt_dtype dtype;            /* what the dataset holds */
    int wide;                  /* <f8 or <i8: 8-byte elements converted on load */
    int ndim;
    int64_t shape[DT_MAX_DIMS];
    const uint8_t *data;
    int64_t count;             /* elements */
} npy_array;

/* The quoted value after 'key': in the header dict, or NULL. */
static const char *npy_value(const char *h, const char *key)
{
    char pat[32];
    snprintf(pat, sizeof pat, "'%s':", key);
    const char *p = strstr(h, pat);
    if (!p)
        return NULL;
    p += strlen(pat);
    while (*p == ' ')
        p++;
    return p;
}

static dt_status npy_descr(dt_ctx *ctx, const char *path, const char *v, npy_array *a)
{
    static const struct { const char *descr; dt_dtype dtype; int wide; } kinds[] = {
        {"'<f4'", DT_F32, 0}, {"'<i4'", DT_I32, 0}, {"'|u1'", DT_U8, 0}, {"'<u1'", DT_U8, 0},
        {"'<f2'", DT_F16, 0}, {"'<f8'", DT_F32, 1}, {"'<i8'", DT_I32, 1}};
    for (size_t k = 0; v && k < sizeof kinds / sizeof kinds[0]; k++)
        if (strncmp(v, kinds[k].descr, strlen(kinds[k].descr)) == 0) {
            a->dtype = kinds[k].dtype;
            a->wide = kinds[k].wide;
            return DT_OK;
        }
    char got[16] = "missing";
    if (v)
        snprintf(got, sizeof got, "%.*s", (int)strcspn(v, ",}"), v);
    return set_error(ctx, DT_ECORRUPT, "dataset_load_npy: %s: descr %s is not one of <f4 <i4 |u1 "
                     "<f2 <f8 <i8 (little-endian)", path, got);
}

static dt_status npy_shape(dt_ctx *ctx, const char *path, const char *v, npy_array *a)
{
    if (!v || *v != '(')
        return set_error(ctx, DT_ECORRUPT, "dataset_load_npy: %s: shape is %s, not a tuple", path,
                         v ? "something else" : "missing");
    const char *p = v + 1;
    a->ndim = 0;
    a->count = 1;
    for (;;) {
        while (*p == ' ')
            p++;
        if (*p == ')')
            break;
        char *end;
        errno = 0;
        long long d = strtoll(p, &end, 10);
        if (end == p || d < 0 || errno || a->ndim == DT_MAX_DIMS ||
            (d > 0 && a->count > ((int64_t)1 << 40) / d))
            return set_error(ctx, DT_ECORRUPT, "dataset_load_npy: %s: shape has a dim that is not "
                             "a size, or more than %d dims", path, DT_MAX_DIMS);
        a->shape[a->ndim++] = d;
        a->count *= d;
        p = end;
        while (*p == ' ')
            p++;
        if (*p == ',')
            p++;
        else if (*p != ')')
            return set_error(ctx, DT_ECORRUPT, "dataset_load_npy: %s: shape tuple is malformed",
                             path);
    }
    if (a->ndim < 1 || a->shape[0] < 1)
        return set_error(ctx, DT_ECORRUPT, "dataset_load_npy: %s: shape needs a first dim >= 1 "
                         "(the samples)", path);
    return DT_OK;
}

/* Parse a mapped .npy file: magic, version, the header dict, the data's size. */
static dt_status npy_parse(dt_ctx *ctx, const char *path, const uint8_t *m, size_t len,
                           npy_array *a)
{
    const char *what = "dataset_load_npy";
    if (len < 10 || memcmp(m, "\x93NUMPY", 6) != 0)
        return set_error(ctx, DT_ECORRUPT, "%s: %s: not a .npy file (bad magic)", what, path);
    int major = m[6];
    if (major < 1 || major > 3)
        return set_error(ctx, DT_ECORRUPT, "%s: %s: .npy version %d.%d is not 1.0 to 3.0", what,
                         path, major, m[7]);
    size_t hlen, at = major == 1 ? 10 : 12;
    if (len < at)
        return set_error(ctx, DT_ECORRUPT, "%s: %s: truncated header", what, path);
    hlen = major == 1 ? (size_t)m[8] | (size_t)m[9] << 8
                      : (size_t)m[8] | (size_t)m[9] << 8 | (size_t)m[10] << 16 | (size_t)m[11] << 24;
    if (hlen > NPY_MAX_HEADER || at + hlen > len)
        return set_error(ctx, DT_ECORRUPT, "%s: %s: header length %zu is past the end of the file",
                         what, path, hlen);
    char *h = host_alloc(ctx, hlen + 1);
    if (!h)
        return set_error(ctx, DT_ENOMEM, "%s: out of memory", what);
    memcpy(h, m + at, hlen);
    h[hlen] = '\0';
    dt_status s = DT_OK;
    const char *fo = npy_value(h, "fortran_order");
    if (h[0] != '{' || !strchr(h, '}'))
        s = set_error(ctx, DT_ECORRUPT, "%s: %s: the header is not a dict", what, path);
    else if ((s = npy_descr(ctx, path, npy_value(h, "descr"), a)) != DT_OK)
        ;
    else if (!fo || strncmp(fo, "False", 5) != 0)
        s = set_error(ctx, DT_ECORRUPT, "%s: %s: fortran_order is %s; only C order is read", what,
                      path, fo && strncmp(fo, "True", 4) == 0 ? "True" : "missing or not a bool");
    else
        s = npy_shape(ctx, path, npy_value(h, "shape"), a);
    host_free(ctx, h);
    if (s != DT_OK)
        return s;
    size_t esize = a->wide ? 8 : dataset_dtype_size(a->dtype), want = (size_t)a->count * esize;
    if (len - at - hlen != want)
        return set_error(ctx, DT_ECORRUPT, "%s: %s: %zu bytes of data, but shape and descr say %zu",
                         what, path, len - at - hlen, want);
    a->data = m + at + hlen;
    return DT_OK;
}

/* <f8 and <i8 data as f32 and i32, in memory the dataset owns. */
static dt_status npy_narrow(dt_ctx *ctx, const char *path, npy_array *a, void **own)
{
    if (!a->wide)
        return DT_OK;
    void *out = host_alloc(ctx, (size_t)a->count * 4 + 1);
    if (!out)
        return set_error(ctx, DT_ENOMEM, "dataset_load_npy: out of memory");
    for (int64_t i = 0; i < a->count; i++) {
        if (a->dtype == DT_F32) {
            double v;
            memcpy(&v, a->data + 8 * i, 8);
            ((float *)out)[i] = (float)v;
        } else {
            int64_t v;
            memcpy(&v, a->data + 8 * i, 8);
            if (v < INT32_MIN || v > INT32_MAX) {
                host_free(ctx, out);
                return set_error(ctx, DT_EINVAL, "dataset_load_npy: %s: element %lld is %lld, "
                                 "outside i32", path, (long long)i, (long long)v);
            }
            ((int32_t *)out)[i] = (int32_t)v;
        }
    }
    *own = out;
    a->data = out;
    return DT_OK;
}

dt_dataset *dt_dataset_load_npy(dt_ctx *ctx, const char *inputs_path, const char *targets_path)
{
    const char *what = "dataset_load_npy";
    if (!ctx_ok(ctx))
        return NULL;
    if (!inputs_path || !targets_path) {
        set_error(ctx, DT_EINVAL, "%s: both paths are required", what);
        return NULL;
    }
    const char *paths[2] = {inputs_path, targets_path};
    void *map[2] = {NULL, NULL}, *own[2] = {NULL, NULL};
    size_t len[2] = {0, 0};
    npy_array a[2];
    dt_dataset *ds = NULL;
    for (int k = 0; k < 2; k++)
        if (dataset_map(ctx, what, paths[k], &map[k], &len[k]) != DT_OK ||
            npy_parse(ctx, paths[k], map[k], len[k], &a[k]) != DT_OK ||
            npy_narrow(ctx, paths[k], &a[k], &own[k]) != DT_OK)
            goto fail;
    if (a[0].shape[0] != a[1].shape[0]) {
        set_error(ctx, DT_ECORRUPT, "%s: %s holds %lld samples but %s %lld", what, inputs_path,
                  (long long)a[0].shape[0], targets_path, (long long)a[1].shape[0]);
        goto fail;
    }
    dt_sample_field f[2];
    for (int k = 0; k < 2; k++) {
        f[k] = (dt_sample_field){.dtype = a[k].dtype, .ndim = a[k].ndim - 1};
        for (int d = 1; d < a[k].ndim; d++)
            f[k].shape[d - 1] = a[k].shape[d];
    }
    if (!(ds = dt_dataset_from_memory(ctx, a[0].shape[0], &f[0], a[0].data, &f[1], a[1].data, 0)))
        goto fail;
    for (int k = 0; k < 2; k++) {
        ds->map[k] = map[k];
        ds->map_len[k] = len[k];
        ds->own[k] = own[k];
    }
    return ds;
fail:
    for (int k = 0; k < 2; k++) {
        if (map[k])
            munmap(map[k], len[k]);
        host_free(ctx, own[k]);
    }
    return NULL;
}

/* --- CSV ------------------------------------------------------------------ */

void dt_csv_config_init(dt_csv_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->struct_size = sizeof *cfg;
    cfg->delimiter = ',';
    cfg->header = -1;
    cfg->target_column = -1;
    cfg->classify = 1;
}

/* One line's fields, cut in place at the delimiter (spaces and quotes
 * around a field dropped); returns the count, at most max. */
static int csv_split(char *line, char delim, char **fields, int max)
{
    int n = 0;
    for (char *p = line;;) {
        char *end = strchr(p, delim);
        if (end)
            *end = '\0';
        while (*p == ' ' || *p == '\t')
            p++;
        size_t l = strlen(p);
        while (l > 0 && (p[l - 1] == ' ' || p[l - 1] == '\t' || p[l - 1] == '\r'))
            p[--l] = '\0';
        if (l >= 2 && p[0] == '"' && p[l - 1] == '"') {
            p[l - 1] = '\0';
            p++;
        }
        if (n < max)
            fields[n] = p;
        n++;
        if (!end)
            return n;
        p = end + 1;
    }
}

static int csv_number(const char *f, double *v)
{
    char *end;
    if (!*f)
        return 0;
    *v = strtod(f, &end);
    return *end == '\0' && isfinite(*v);
}

typedef struct csv_table {
    char *text;                /* the file, NUL-terminated, cut into lines and fields */
    char **lines;              /* the lines that are not blank */
    int64_t *lineno;           /* each one's line in the file, from 1 (what errors name) */
    int64_t nlines;
    int cols;
    char *head;                /* a copy of line 0, cut into names */
    char **names;              /* the header's fields, or NULL */
} csv_table;

static dt_status csv_read(dt_ctx *ctx, const char *path, csv_table *t)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return set_error(ctx, DT_EIO, "dataset_load_csv: cannot open %s: %s", path, strerror(errno));
    size_t cap = 1 << 16, len = 0, got;
    char *buf = host_alloc(ctx, cap);
    while (buf && (got = fread(buf + len, 1, cap - len - 1, f)) > 0) {
        len += got;
        if (len + 1 == cap) {
            char *more = ctx->al.realloc_fn(buf, cap * 2, ctx->al.user);
            if (!more) {
                host_free(ctx, buf);
                buf = NULL;
                break;
            }
            buf = more;
            cap *= 2;
        }
    }
    int bad = ferror(f);
    fclose(f);
    if (!buf)
        return set_error(ctx, DT_ENOMEM, "dataset_load_csv: out of memory for %s", path);
    if (bad) {
        host_free(ctx, buf);
        return set_error(ctx, DT_EIO, "dataset_load_csv: cannot read %s", path);
    }
    buf[len] = '\0';
    t->text = buf;
    const char *nul = memchr(buf, '\0', len);
    if (nul)   /* a CSV file is text: this one is something else (it read as garbage rows) */
        return set_error(ctx, DT_ECORRUPT, "dataset_load_csv: %s is not text (a NUL byte at offset "
                         "%zu): give a CSV file", path, (size_t)(nul - buf));
    int64_t lines = 1;
    for (size_t i = 0; i < len; i++)
        lines += buf[i] == '\n';
    t->lines = host_alloc(ctx, sizeof *t->lines * (size_t)lines);
    t->lineno = host_alloc(ctx, sizeof *t->lineno * (size_t)lines);
    if (!t->lines || !t->lineno)
        return set_error(ctx, DT_ENOMEM, "dataset_load_csv: out of memory for %s", path);
    t->nlines = 0;
    /* a UTF-8 byte-order mark (Excel writes one) is not part of the first field */
    char *p = len >= 3 && memcmp(buf, "\xEF\xBB\xBF", 3) == 0 ? buf + 3 : buf;
    for (int64_t line = 1; p && *p; line++) {
        char *nl = strchr(p, '\n');
        if (nl)
            *nl = '\0';
        if (p[strspn(p, " \t\r")] != '\0') {   /* blank lines are skipped */
            t->lineno[t->nlines] = line;
            t->lines[t->nlines++] = p;
        }
        p = nl ? nl + 1 : NULL;
    }
    return DT_OK;
}

static void csv_free(dt_ctx *ctx, csv_table *t)
{
    host_free(ctx, t->text);
    host_free(ctx, t->lines);
    host_free(ctx, t->lineno);
    host_free(ctx, t->head);
    host_free(ctx, t->names);
}

/* The target's column: by name in the header, or by number. */
static int csv_target(dt_ctx *ctx, const char *path, const csv_table *t, const dt_csv_config *cfg)
{
    if (cfg->target_name) {
        for (int c = 0; t->names && c < t->cols; c++)
            if (strcmp(t->names[c], cfg->target_name) == 0)
                return c;
        set_error(ctx, DT_EINVAL, "dataset_load_csv: %s has no column named '%s'%s", path,
                  cfg->target_name, t->names ? "" : " (it has no header)");
        return -1;
    }
    int c = cfg->target_column < 0 ? t->cols + cfg->target_column : cfg->target_column;
    if (c < 0 || c >= t->cols)
        set_error(ctx, DT_EINVAL, "dataset_load_csv: target column %d, but %s has %d columns",
                  cfg->target_column, path, t->cols);
    return c >= 0 && c < t->cols ? c : -1;
}

/* The data rows into x (rows x (cols-1) f32) and y (i32 or f32). */
static dt_status csv_rows(dt_ctx *ctx, const char *path, csv_table *t, int64_t first, int target,
                          const dt_csv_config *cfg, float *x, void *y)
{
    char **fields = host_alloc(ctx, sizeof *fields * (size_t)t->cols);
    if (!fields)
        return set_error(ctx, DT_ENOMEM, "dataset_load_csv: out of memory");
    dt_status s = DT_OK;
    for (int64_t r = first; s == DT_OK && r < t->nlines; r++) {
        int64_t i = r - first, lineno = t->lineno[r];
        int n = csv_split(t->lines[r], cfg->delimiter, fields, t->cols);
        if (n != t->cols) {
            s = set_error(ctx, DT_ECORRUPT, "dataset_load_csv: %s: line %lld has %d fields, the "
                          "first %d", path, (long long)lineno, n, t->cols);
            break;
        }
        for (int c = 0, k = 0; s == DT_OK && c < t->cols; c++) {
            double v;
            if (!csv_number(fields[c], &v)) {
                s = set_error(ctx, DT_ECORRUPT, "dataset_load_csv: %s: line %lld, column %d: "
                              "'%.40s' is not a number", path, (long long)lineno, c + 1, fields[c]);
            } else if (c != target) {
                x[i * (t->cols - 1) + k++] = (float)v;
            } else if (!cfg->classify) {
                ((float *)y)[i] = (float)v;
            } else if (v < 0 || v > INT32_MAX || v != floor(v)) {
                s = set_error(ctx, DT_ECORRUPT, "dataset_load_csv: %s: line %lld: label %g is not "
                              "a whole number >= 0", path, (long long)lineno, v);
            } else {
                ((int32_t *)y)[i] = (int32_t)v;
            }
        }
    }
    host_free(ctx, fields);
    return s;
}

/* The first line decides the columns; with header -1 it is a header when
 * one of its fields is not a number. */
static dt_status csv_columns(dt_ctx *ctx, const char *path, csv_table *t, const dt_csv_config *cfg,
                             int64_t *first)
{
    if (t->nlines == 0)
        return set_error(ctx, DT_ECORRUPT, "dataset_load_csv: %s has no rows", path);
    /* a copy of line 0 is cut into fields: the line itself may be data */
    char *one[1];
    if (!(t->head = host_strdup(ctx, t->lines[0])))
        return set_error(ctx, DT_ENOMEM, "dataset_load_csv: out of memory");
    t->cols = csv_split(t->head, cfg->delimiter, one, 1);
    host_free(ctx, t->head);
    t->head = host_strdup(ctx, t->lines[0]);
    t->names = host_alloc(ctx, sizeof *t->names * (size_t)t->cols);
    if (!t->head || !t->names)
        return set_error(ctx, DT_ENOMEM, "dataset_load_csv: out of memory");
    csv_split(t->head, cfg->delimiter, t->names, t->cols);
    int header = cfg->header;
    for (int c = 0; header < 0 && c < t->cols; c++) {
        double v;
        header = csv_number(t->names[c], &v) ? -1 : 1;
    }
    *first = header == 1;
    if (header != 1) {
        host_free(ctx, t->names);
        t->names = NULL;
    } else if (t->nlines < 2) {
        return set_error(ctx, DT_ECORRUPT, "dataset_load_csv: %s has a header and no data rows",
                         path);
    }
    return DT_OK;
}

dt_dataset *dt_dataset_load_csv(dt_ctx *ctx, const char *path, const dt_csv_config *cfg)
{
    if (!ctx_ok(ctx))
        return NULL;
    dt_csv_config def;
    dt_csv_config_init(&def);
    if (cfg && ctx_config_in(ctx, &def, sizeof def, cfg,
                             "dataset_load_csv", "dt_csv_config") != DT_OK)
        return NULL;
    cfg = &def;
    if (!path || !cfg->delimiter || cfg->delimiter == '"' || cfg->delimiter == '\n') {
        set_error(ctx, DT_EINVAL, "dataset_load_csv: a path and a delimiter are required");
        return NULL;
    }
    csv_table t = {0};
    int64_t first = 0;
    float *x = NULL;
    void *y = NULL;
    dt_dataset *ds = NULL;
    if (csv_read(ctx, path, &t) != DT_OK || csv_columns(ctx, path, &t, cfg, &first) != DT_OK)
        goto done;
    if (t.cols < 2) {
        set_error(ctx, DT_EINVAL, "dataset_load_csv: %s has %d column; a sample needs an input "
                  "and a target", path, t.cols);
        goto done;
    }
    int target = csv_target(ctx, path, &t, cfg);
    if (target < 0)
        goto done;
    int64_t n = t.nlines - first;
    x = host_alloc(ctx, sizeof *x * (size_t)(n * (t.cols - 1)));
    y = host_alloc(ctx, 4 * (size_t)n);
    if (!x || !y) {
        set_error(ctx, DT_ENOMEM, "dataset_load_csv: out of memory for %lld rows", (long long)n);
        goto done;
    }
    if (csv_rows(ctx, path, &t, first, target, cfg, x, y) != DT_OK)
        goto done;
    dt_sample_field in = {DT_F32, 1, {t.cols - 1}};
    dt_sample_field tgt = {cfg->classify ? DT_I32 : DT_F32, 0, {0}};
    if ((ds = dt_dataset_from_memory(ctx, n, &in, x, &tgt, y, 0))) {
        ds->own[0] = x;
        ds->own[1] = y;
        x = NULL;
        y = NULL;
    }
done:
    host_free(ctx, x);
    host_free(ctx, y);
    csv_free(ctx, &t);
    return ds;
}

/* --- token streams ---------------------------------------------------------- */

void dt_token_config_init(dt_token_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->struct_size = sizeof *cfg;
    cfg->context = 64;
    cfg->stride = 64;
    cfg->count = -1;
}

static int32_t token_at(const dt_dataset *ds, int64_t j)
{
    const uint8_t *p = ds->tok + (size_t)j * (size_t)ds->tok_bytes;
    if (ds->tok_bytes == 1)
        return p[0];
    if (ds->tok_bytes == 2)
        return (int32_t)(p[0] | (uint32_t)p[1] << 8);
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Window i: its first token.  Random windows hash (seed, i), so a sample
 * is the same whichever loader or rank reads it. */
static int64_t window_start(const dt_dataset *ds, int64_t i)
{
    if (ds->stride > 0)
        return ds->first + i * ds->stride;
    uint64_t h = ds->seed + 0x9E3779B97F4A7C15ull * (uint64_t)(i + 1);
    return ds->first + (int64_t)(param_splitmix64(&h) % (uint64_t)(ds->count - ds->context));
}

DT_PRIVATE void dataset_token_window(const dt_dataset *ds, int64_t i, void *x, void *y)
{
    int64_t o = window_start(ds, i), T = ds->context;
    for (int64_t t = 0; t < T; t++) {
        int32_t a = token_at(ds, o + t), b = token_at(ds, o + t + 1);
        if (x)
            memcpy((int32_t *)x + t, &a, 4);
        if (y)
            memcpy((int32_t *)y + t, &b, 4);
    }
}

/* The windows over tokens[first, first + count) as cfg asks; tok is kept
 * as given (the caller has made it borrowed, owned or mapped). */
static dt_dataset *token_dataset(dt_ctx *ctx, const char *what, const uint8_t *tok,
                                 int64_t ntokens, int token_bytes, const dt_token_config *cfg)
{
    dt_token_config def;
    dt_token_config_init(&def);
    if (cfg && ctx_config_in(ctx, &def, sizeof def, cfg, what, "dt_token_config") != DT_OK)
        return NULL;
    cfg = &def;
    int64_t first = cfg->first, count = cfg->count < 0 ? ntokens - cfg->first : cfg->count;
    if (token_bytes != 1 && token_bytes != 2 && token_bytes != 4) {
        set_error(ctx, DT_EINVAL, "%s: token_bytes %d is not 1, 2 or 4", what, token_bytes);
        return NULL;
    }
    if (cfg->context < 1 || cfg->context >= ((int64_t)1 << 30) || first < 0 || count < 0 ||
        first > ntokens - count || count < cfg->context + 1) {
        set_error(ctx, DT_EINVAL, "%s: tokens [%lld, %lld) of %lld with context %lld: need context "
                  ">= 1 and at least context + 1 tokens in range", what, (long long)first,
                  (long long)(first + count), (long long)ntokens, (long long)cfg->context);
        return NULL;
    }
    if (cfg->stride < 0 || (cfg->stride == 0 && cfg->samples < 1)) {
        set_error(ctx, DT_EINVAL, "%s: stride %lld, samples %lld: need stride >= 1, or stride 0 "
                  "(random windows) and samples >= 1", what, (long long)cfg->stride,
                  (long long)cfg->samples);
        return NULL;
    }
    for (int64_t j = 0; token_bytes == 4 && j < ntokens; j++) {
        int32_t v;
        memcpy(&v, tok + 4 * j, 4);
        if (v < 0) {
            set_error(ctx, DT_EINVAL, "%s: token %lld is %d; ids are >= 0", what, (long long)j, v);
            return NULL;
        }
    }
    dt_sample_field f = {DT_I32, 1, {cfg->context}};
    dt_dataset *ds = dataset_arrays(ctx, what, 0, &f, NULL, &f, NULL);
    if (!ds)
        return NULL;
    ds->kind = DS_TOKENS;
    ds->tok = tok;
    ds->tok_bytes = token_bytes;
    ds->first = first;
    ds->count = count;
    ds->context = cfg->context;
    ds->stride = cfg->stride;
    ds->seed = cfg->seed;
    ds->n = cfg->stride > 0 ? (count - cfg->context - 1) / cfg->stride + 1 : cfg->samples;
    return ds;
}

dt_dataset *dt_dataset_from_tokens(dt_ctx *ctx, const void *tokens, int64_t ntokens,
                                   int token_bytes, int copy, const dt_token_config *cfg)
{
    const char *what = "dataset_from_tokens";
    if (!ctx_ok(ctx))
        return NULL;
    if (!tokens || ntokens < 1) {
        set_error(ctx, DT_EINVAL, "%s: no tokens", what);
        return NULL;
    }
    void *own = NULL;
    if (copy) {
        size_t bytes = (size_t)ntokens * (size_t)(token_bytes > 0 && token_bytes <= 4 ? token_bytes : 1);
        if (!(own = host_alloc(ctx, bytes))) {
            set_error(ctx, DT_ENOMEM, "%s: out of memory for a copy of %zu bytes", what, bytes);
            return NULL;
        }
        memcpy(own, tokens, bytes);
        tokens = own;
    }
    dt_dataset *ds = token_dataset(ctx, what, tokens, ntokens, token_bytes, cfg);
    if (!ds)
        host_free(ctx, own);
    else
        ds->own[0] = own;
    return ds;
}

dt_dataset *dt_dataset_load_tokens(dt_ctx *ctx, const char *path, int token_bytes,
                                   const dt_token_config *cfg)
{
    const char *what = "dataset_load_tokens";
    if (!ctx_ok(ctx))
        return NULL;
    if (!path || (token_bytes != 1 && token_bytes != 2 && token_bytes != 4)) {
        set_error(ctx, DT_EINVAL, "%s: a path and token_bytes 1, 2 or 4 are required", what);
        return NULL;
    }
    void *m;
    size_t len;
    if (dataset_map(ctx, what, path, &m, &len) != DT_OK)
        return NULL;
    if (len == 0 || len % (size_t)token_bytes != 0) {
        set_error(ctx, DT_ECORRUPT, "%s: %s has %zu bytes, not a whole number of %d-byte ids", what,
                  path, len, token_bytes);
        if (m)
            munmap(m, len);
        return NULL;
    }
    dt_dataset *ds = token_dataset(ctx, what, m, (int64_t)(len / (size_t)token_bytes), token_bytes,
                                   cfg);
    if (!ds) {
        munmap(m, len);
        return NULL;
    }
    ds->map[0] = m;
    ds->map_len[0] = len;
    return ds;
}
