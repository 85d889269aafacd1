#include "internal.h"

/* ===========================================================================
 * Datasets: n samples, each an input and a target of fixed shape and type
 *
 * Kinds: arrays (the caller's memory, a copy, a memory-mapped raw or .npy
 * file, IDX or CSV read into memory), a token stream (windows of a token
 * array), a callback, and a subset (a view of another dataset).  The
 * loader (src/data.c) and evaluation read samples only through
 * dataset_read, which converts a sample to the batch's element types (f32
 * or i32, 4 bytes either way) and applies the normalisation
 * (dataset_xform_init): u8 values over 255 when asked, then the dataset's
 * mean and std per channel or feature, then the loader's own mean and std.
 * Files are mapped, not read: a dataset larger than memory pages in as the
 * loader reaches it.
 * ======================================================================== */

#define DS_LUT_MAX_STATS 64   /* u8 inputs: a 256-entry table per stat up to this many */

DT_PRIVATE size_t dataset_dtype_size(dt_dtype t)
{
    return t == DT_U8 ? 1 : t == DT_BF16 || t == DT_F16 ? 2 : 4;
}

/* The field checked and measured: elements and bytes per sample. */
static dt_status field_init(dt_ctx *ctx, const char *what, const char *side,
                            const dt_sample_field *f, ds_field *out)
{
    if (!f)
        return set_error(ctx, DT_EINVAL, "%s: the %s field is NULL", what, side);
    if (f->dtype != DT_F32 && f->dtype != DT_I32 && f->dtype != DT_U8 && f->dtype != DT_BF16 &&
        f->dtype != DT_F16)
        return set_error(ctx, DT_EINVAL, "%s: the %s dtype %d is not one of f32, i32, u8, bf16, "
                         "f16", what, side, (int)f->dtype);
    if (f->ndim < 0 || f->ndim > DT_MAX_DIMS - 1)
        return set_error(ctx, DT_EINVAL, "%s: the %s has %d dims; a sample has 0 to %d", what,
                         side, f->ndim, DT_MAX_DIMS - 1);
    int64_t elems = 1;
    for (int d = 0; d < f->ndim; d++) {
        if (f->shape[d] < 1 || elems > ((int64_t)1 << 40) / f->shape[d])
            return set_error(ctx, DT_EINVAL, "%s: the %s's dim %d is %lld", what, side, d,
                             (long long)f->shape[d]);
        elems *= f->shape[d];
    }
    memset(out, 0, sizeof *out);
    out->f = *f;
    for (int d = f->ndim; d < DT_MAX_DIMS - 1; d++)
        out->f.shape[d] = 0;
    out->elems = elems;
    out->esize = dataset_dtype_size(f->dtype);
    out->bytes = (size_t)elems * out->esize;
    return DT_OK;
}

static dt_dataset *dataset_alloc(dt_ctx *ctx, const char *what, int kind)
{
    if (!ctx_ok(ctx))
        return NULL;
    dt_dataset *ds = host_calloc(ctx, sizeof *ds);
    if (!ds) {
        set_error(ctx, DT_ENOMEM, "%s: out of memory", what);
        return NULL;
    }
    ds->ctx = ctx;
    ds->kind = kind;
    return ds;
}

/* Scalar integer targets: the largest + 1, the classes of a classifier. */
static void count_classes(dt_dataset *ds)
{
    if (ds->kind != DS_ARRAYS || ds->tgt.f.ndim != 0 ||
        (ds->tgt.f.dtype != DT_U8 && ds->tgt.f.dtype != DT_I32))
        return;
    for (int64_t i = 0; i < ds->n; i++) {
        int64_t v = ds->tgt.f.dtype == DT_U8 ? ds->y[i] : ((const int32_t *)(const void *)ds->y)[i];
        if (v + 1 > ds->classes && v < INT32_MAX)
            ds->classes = (int)(v + 1);
    }
}

DT_PRIVATE dt_dataset *dataset_arrays(dt_ctx *ctx, const char *what, int64_t n,
                                      const dt_sample_field *input, const void *x,
                                      const dt_sample_field *target, const void *y)
{
    dt_dataset *ds = dataset_alloc(ctx, what, DS_ARRAYS);
    if (!ds)
        return NULL;
    if (field_init(ctx, what, "input", input, &ds->in) != DT_OK ||
        field_init(ctx, what, "target", target, &ds->tgt) != DT_OK) {
        host_free(ctx, ds);
        return NULL;
    }
    ds->n = n;
    ds->x = x;
    ds->y = y;
    return ds;
}

dt_dataset *dt_dataset_from_memory(dt_ctx *ctx, int64_t n, const dt_sample_field *input,
                                   const void *inputs, const dt_sample_field *target,
                                   const void *targets, int copy)
{
    if (!ctx_ok(ctx))
        return NULL;
    if (n < 1 || !inputs || !targets) {
        set_error(ctx, DT_EINVAL, "dataset_from_memory: need n >= 1 (got %lld) and both arrays",
                  (long long)n);
        return NULL;
    }
    dt_dataset *ds = dataset_arrays(ctx, "dataset_from_memory", n, input, inputs, target, targets);
    if (!ds)
        return NULL;
    if (copy) {
        size_t xb = ds->in.bytes * (size_t)n, yb = ds->tgt.bytes * (size_t)n;
        ds->own[0] = host_alloc(ctx, xb ? xb : 1);
        ds->own[1] = host_alloc(ctx, yb ? yb : 1);
        if (!ds->own[0] || !ds->own[1]) {
            set_error(ctx, DT_ENOMEM, "dataset_from_memory: out of memory for a copy of %zu bytes",
                      xb + yb);
            dt_dataset_free(ds);
            return NULL;
        }
        memcpy(ds->own[0], inputs, xb);
        memcpy(ds->own[1], targets, yb);
        ds->x = ds->own[0];
        ds->y = ds->own[1];
    }
    count_classes(ds);
    return ds;
}

/* --- files ------------------------------------------------------------ */

/* Map path read-only; *len its size.  An empty file maps nothing. */
DT_PRIVATE dt_status dataset_map(dt_ctx *ctx, const char *what, const char *path, void **p,
                                 size_t *len)
{
    *p = NULL;
    *len = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return set_error(ctx, DT_EIO, "%s: cannot open %s: %s", what, path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        close(fd);
        return set_error(ctx, DT_EIO, "%s: cannot stat %s: %s", what, path, strerror(errno));
    }
    *len = (size_t)st.st_size;
    if (*len > 0) {
        void *m = mmap(NULL, *len, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) {
            close(fd);
            *len = 0;
            return set_error(ctx, DT_EIO, "%s: cannot map %s: %s", what, path, strerror(errno));
        }
        *p = m;
    }
    close(fd);
    return DT_OK;
}

dt_dataset *dt_dataset_load_raw(dt_ctx *ctx, const char *inputs_path, const dt_sample_field *input,
                                const char *targets_path, const dt_sample_field *target)
{
    const char *what = "dataset_load_raw";
    if (!ctx_ok(ctx))
        return NULL;
    if (!inputs_path || !targets_path) {
        set_error(ctx, DT_EINVAL, "%s: both paths are required", what);
        return NULL;
    }
    dt_dataset *ds = dataset_arrays(ctx, what, 0, input, NULL, target, NULL);
    if (!ds)
        return NULL;
    const char *paths[2] = {inputs_path, targets_path};
    const ds_field *fields[2] = {&ds->in, &ds->tgt};
    int64_t counts[2];
    for (int k = 0; k < 2; k++) {
        if (dataset_map(ctx, what, paths[k], &ds->map[k], &ds->map_len[k]) != DT_OK)
            goto fail;
        size_t b = fields[k]->bytes;
        if (ds->map_len[k] == 0 || b == 0 || ds->map_len[k] % b != 0) {
            set_error(ctx, DT_ECORRUPT, "%s: %s has %zu bytes, not a whole number of %zu-byte "
                      "samples", what, paths[k], ds->map_len[k], b);
            goto fail;
        }
        counts[k] = (int64_t)(ds->map_len[k] / b);
    }
    if (counts[0] != counts[1]) {
        set_error(ctx, DT_ECORRUPT, "%s: %s holds %lld inputs but %s %lld targets", what,
                  inputs_path, (long long)counts[0], targets_path, (long long)counts[1]);
        goto fail;
    }
    ds->n = counts[0];
    ds->x = ds->map[0];
    ds->y = ds->map[1];
    count_classes(ds);
    return ds;
fail:
    dt_dataset_free(ds);
    return NULL;
}

/* --- a subset ------------------------------------------------------------ */

dt_dataset *dt_dataset_subset(dt_ctx *ctx, const dt_dataset *ds, int64_t first, int64_t count)
{
    if (!ctx_ok(ctx))
        return NULL;
    if (!ds || first < 0 || count < 1 || first > ds->n - count) {
        set_error(ctx, DT_EINVAL, "dataset_subset: samples [%lld, %lld) are not inside a dataset "
                  "of %lld", (long long)first, (long long)(first + count),
                  (long long)(ds ? ds->n : 0));
        return NULL;
    }
    dt_dataset *sub = dataset_alloc(ctx, "dataset_subset", DS_SUBSET);
    if (!sub)
        return NULL;
    sub->n = count;
    sub->in = ds->in;
    sub->tgt = ds->tgt;
    sub->parent = ds;
    sub->offset = first;
    sub->classes = ds->classes;
    sub->scale_u8 = ds->scale_u8;
    if (ds->nstat && dt_dataset_normalize(sub, ds->scale_u8, ds->nstat, ds->mean, ds->std) != DT_OK) {
        dt_dataset_free(sub);
        return NULL;
    }
    return sub;
}

/* --- a callback ---------------------------------------------------------- */

dt_dataset *dt_dataset_from_callback(dt_ctx *ctx, int64_t n, const dt_sample_field *input,
                                     const dt_sample_field *target, dt_sample_fn fill, void *user)
{
    if (!ctx_ok(ctx))
        return NULL;
    if (n < 1 || !fill) {
        set_error(ctx, DT_EINVAL, "dataset_from_callback: need n >= 1 (got %lld) and a function",
                  (long long)n);
        return NULL;
    }
    dt_dataset *ds = dataset_arrays(ctx, "dataset_from_callback", n, input, NULL, target, NULL);
    if (!ds)
        return NULL;
    ds->kind = DS_CALLBACK;
    ds->fill = fill;
    ds->user = user;
    return ds;
}

/* --- the common calls ---------------------------------------------------- */

void dt_dataset_free(dt_dataset *ds)
{
    if (!ds)
        return;
    for (int k = 0; k < 2; k++) {
        host_free(ds->ctx, ds->own[k]);
        if (ds->map[k])
            munmap(ds->map[k], ds->map_len[k]);
    }
    host_free(ds->ctx, ds->mean);
    host_free(ds->ctx, ds->std);
    host_free(ds->ctx, ds);
}

int64_t dt_dataset_size(const dt_dataset *ds) { return ds ? ds->n : 0; }
int dt_dataset_classes(const dt_dataset *ds) { return ds ? ds->classes : 0; }

int dt_dataset_sample_shape(const dt_dataset *ds, int64_t *shape)
{
    if (!ds)
        return 0;
    for (int d = 0; shape && d < ds->in.f.ndim; d++)
        shape[d] = ds->in.f.shape[d];
    return ds->in.f.ndim;
}

dt_status dt_dataset_fields(const dt_dataset *ds, dt_sample_field *input, dt_sample_field *target)
{
    if (!ds)
        return DT_EINVAL;
    if (input)
        *input = ds->in.f;
    if (target)
        *target = ds->tgt.f;
    return DT_OK;
}

/* The dataset that holds sample i's bytes, and i there (through subsets). */
static const dt_dataset *dataset_root(const dt_dataset *ds, int64_t *i)
{
    while (ds->kind == DS_SUBSET) {
        *i += ds->offset;
        ds = ds->parent;
    }
    return ds;
}

const uint8_t *dt_dataset_image(const dt_dataset *ds, int64_t i)
{
    if (!ds || i < 0 || i >= ds->n || ds->in.f.dtype != DT_U8)
        return NULL;
    const dt_dataset *r = dataset_root(ds, &i);
    return r->kind == DS_ARRAYS ? r->x + (size_t)i * r->in.bytes : NULL;
}

int dt_dataset_label(const dt_dataset *ds, int64_t i)
{
    if (!ds || i < 0 || i >= ds->n || ds->tgt.f.ndim != 0 ||
        (ds->tgt.f.dtype != DT_U8 && ds->tgt.f.dtype != DT_I32))
        return -1;
    const dt_dataset *r = dataset_root(ds, &i);
    if (r->kind != DS_ARRAYS)
        return -1;
    if (r->tgt.f.dtype == DT_U8)
        return r->y[i];
    int32_t v;
    memcpy(&v, r->y + (size_t)i * 4, 4);
    return v;
}

/* Sample i's raw bytes (either output may be NULL); a callback's failure
 * is DT_EIO with its message in err. */
DT_PRIVATE dt_status dataset_raw(const dt_dataset *ds, int64_t i, void *x, void *y, char *err,
                                 size_t err_len)
{
    const dt_dataset *r = dataset_root(ds, &i);
    if (r->kind == DS_TOKENS) {
        dataset_token_window(r, i, x, y);
        return DT_OK;
    }
    if (r->kind == DS_CALLBACK) {
        int rc = r->fill(r->user, i, x, y);
        if (rc != 0) {
            snprintf(err, err_len, "dataset: the sample callback failed on sample %lld (returned "
                     "%d)", (long long)i, rc);
            return DT_EIO;
        }
        return DT_OK;
    }
    if (x)
        memcpy(x, r->x + (size_t)i * r->in.bytes, r->in.bytes);
    if (y)
        memcpy(y, r->y + (size_t)i * r->tgt.bytes, r->tgt.bytes);
    return DT_OK;
}

dt_status dt_dataset_sample(const dt_dataset *ds, int64_t i, void *input, void *target)
{
    if (!ds)
        return DT_EINVAL;
    if (i < 0 || i >= ds->n)
        return set_error(ds->ctx, DT_EINVAL, "dataset_sample: sample %lld of %lld", (long long)i,
                         (long long)ds->n);
    char err[DT_MAX_ERROR];
    dt_status s = dataset_raw(ds, i, input, target, err, sizeof err);
    return s == DT_OK ? DT_OK : set_error(ds->ctx, s, "%s", err);
}

/* --- normalisation and conversion ------------------------------------------ */

/* n as a stat count for this input: 1, its channels, its elements */
static int stat_count_ok(const dt_dataset *ds, int n)
{
    return n == 1 || (ds->in.f.ndim >= 1 && n == ds->in.f.shape[0]) || n == ds->in.elems;
}

dt_status dt_dataset_normalize(dt_dataset *ds, int scale_u8, int n, const float *mean,
                               const float *std)
{
    if (!ds)
        return DT_EINVAL;
    dt_ctx *ctx = ds->ctx;
    if (ds->in.f.dtype == DT_I32)
        return set_error(ctx, DT_ENOTSUP, "dataset_normalize: the inputs are i32 (token ids)");
    if (n < 0 || (n > 0 && (!stat_count_ok(ds, n) || !mean || !std)))
        return set_error(ctx, DT_EINVAL, "dataset_normalize: %d means and stds for inputs of %lld "
                         "elements: give 1, one per channel (the first dim) or one per element",
                         n, (long long)ds->in.elems);
    for (int k = 0; k < n; k++)
        if (!(std[k] > 0) || !isfinite(mean[k]))
            return set_error(ctx, DT_EINVAL, "dataset_normalize: std[%d] %g, mean[%d] %g: need a "
                             "finite mean and std > 0", k, (double)std[k], k, (double)mean[k]);
    float *m = n ? host_alloc(ctx, sizeof *m * (size_t)n) : NULL;
    float *s = n ? host_alloc(ctx, sizeof *s * (size_t)n) : NULL;
    if (n && (!m || !s)) {
        host_free(ctx, m);
        host_free(ctx, s);
        return set_error(ctx, DT_ENOMEM, "dataset_normalize: out of memory");
    }
    if (n) {
        memcpy(m, mean, sizeof *m * (size_t)n);
        memcpy(s, std, sizeof *s * (size_t)n);
    }
    host_free(ctx, ds->mean);
    host_free(ctx, ds->std);
    ds->mean = m;
    ds->std = s;
    ds->nstat = n;
    ds->scale_u8 = scale_u8 != 0;
    return DT_OK;
}

/* One element of a raw input as f32, before mean and std. */
static float raw_to_f32(const ds_field *f, const uint8_t *p, int64_t e, int scale_u8)
{
    switch (f->f.dtype) {
    case DT_U8: return scale_u8 ? (float)p[e] / 255.0f : (float)p[e];
    case DT_BF16: case DT_F16: {
        uint16_t h;
        memcpy(&h, p + 2 * e, 2);
        return f->f.dtype == DT_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
    }
    case DT_I32: {
        int32_t v;
        memcpy(&v, p + 4 * e, 4);
        return (float)v;
    }
    default: {
        float v;
        memcpy(&v, p + 4 * e, 4);
        return v;
    }
    }
}

DT_PRIVATE dt_status dataset_xform_init(const dt_dataset *ds, float mean, float std, ds_xform *xf)
{
    dt_ctx *ctx = ds->ctx;
    memset(xf, 0, sizeof *xf);
    xf->mean = mean;
    xf->std = std;
    xf->group = ds->nstat ? ds->in.elems / ds->nstat : ds->in.elems;
    xf->raw = host_alloc(ctx, ds->in.bytes + ds->tgt.bytes + 8);
    if (!xf->raw)
        return set_error(ctx, DT_ENOMEM, "loader: out of memory");
    int tables = ds->nstat ? ds->nstat : 1;
    if (ds->in.f.dtype != DT_U8 || tables > DS_LUT_MAX_STATS)
        return DT_OK;
    xf->lut = host_alloc(ctx, sizeof(float) * 256 * (size_t)tables);
    if (!xf->lut)
        return set_error(ctx, DT_ENOMEM, "loader: out of memory");
    for (int k = 0; k < tables; k++)
        for (int v = 0; v < 256; v++) {
            float x = ds->scale_u8 ? (float)v / 255.0f : (float)v;   /* as raw_to_f32 */
            if (ds->nstat)
                x = (x - ds->mean[k]) / ds->std[k];
            xf->lut[k * 256 + v] = (x - mean) / std;
        }
    return DT_OK;
}

DT_PRIVATE void dataset_xform_free(dt_ctx *ctx, ds_xform *xf)
{
    host_free(ctx, xf->lut);
    host_free(ctx, xf->raw);
    memset(xf, 0, sizeof *xf);
}

/* A raw input as the batch's elements: i32 ids as they are, the rest f32
 * normalised. */
static void convert_input(const dt_dataset *ds, const ds_xform *xf, const uint8_t *p, void *out)
{
    int64_t e = ds->in.elems;
    if (ds->in.f.dtype == DT_I32) {
        memcpy(out, p, (size_t)e * 4);
        return;
    }
    float *dst = out;
    if (xf->lut) {
        for (int64_t k = 0; k < e; k++)
            dst[k] = xf->lut[(k / xf->group) * 256 + p[k]];
        return;
    }
    for (int64_t k = 0; k < e; k++) {
        float x = raw_to_f32(&ds->in, p, k, ds->scale_u8);
        if (ds->nstat)
            x = (x - ds->mean[k / xf->group]) / ds->std[k / xf->group];
        dst[k] = (x - xf->mean) / xf->std;
    }
}

/* A raw target as the batch's elements: u8 and i32 as i32, the rest f32. */
static void convert_target(const ds_field *f, const uint8_t *p, void *out)
{
    int64_t e = f->elems;
    if (f->f.dtype == DT_I32 || f->f.dtype == DT_F32) {
        memcpy(out, p, (size_t)e * 4);
    } else if (f->f.dtype == DT_U8) {
        for (int64_t k = 0; k < e; k++)
            ((int32_t *)out)[k] = p[k];
    } else {
        for (int64_t k = 0; k < e; k++)
            ((float *)out)[k] = raw_to_f32(f, p, k, 0);
    }
}

DT_PRIVATE dt_dtype dataset_batch_dtype(const dt_sample_field *f, int target)
{
    if (target)
        return f->dtype == DT_I32 || f->dtype == DT_U8 ? DT_I32 : DT_F32;
    return f->dtype == DT_I32 ? DT_I32 : DT_F32;
}

DT_PRIVATE dt_status dataset_read(const dt_dataset *ds, const ds_xform *xf, int64_t i, void *x,
                                  void *y, char *err, size_t err_len)
{
    const dt_dataset *r = dataset_root(ds, &i);
    const uint8_t *px, *py;
    if (r->kind == DS_ARRAYS) {   /* straight from the arrays, no copy */
        px = r->x + (size_t)i * r->in.bytes;
        py = r->y + (size_t)i * r->tgt.bytes;
    } else {
        uint8_t *raw = xf->raw;
        dt_status s = dataset_raw(r, i, raw, raw + r->in.bytes, err, err_len);
        if (s != DT_OK)
            return s;
        px = raw;
        py = raw + r->in.bytes;
    }
    convert_input(ds, xf, px, x);
    convert_target(&ds->tgt, py, y);
    return DT_OK;
}

dt_status dt_dataset_stats(const dt_dataset *ds, int n, float *mean, float *std)
{
    if (!ds)
        return DT_EINVAL;
    dt_ctx *ctx = ds->ctx;
    if (ds->in.f.dtype == DT_I32)
        return set_error(ctx, DT_ENOTSUP, "dataset_stats: the inputs are i32 (token ids)");
    if (n < 1 || !stat_count_ok(ds, n) || !mean || !std)
        return set_error(ctx, DT_EINVAL, "dataset_stats: %d stats for inputs of %lld elements: "
                         "give 1, one per channel or one per element", n, (long long)ds->in.elems);
    int64_t e = ds->in.elems, group = e / n;
    double *acc = host_calloc(ctx, sizeof *acc * 2 * (size_t)n);
    uint8_t *raw = host_alloc(ctx, ds->in.bytes + ds->tgt.bytes + 8);
    dt_status s = acc && raw ? DT_OK : set_error(ctx, DT_ENOMEM, "dataset_stats: out of memory");
    char err[DT_MAX_ERROR];
    for (int64_t i = 0; s == DT_OK && i < ds->n; i++) {
        if ((s = dataset_raw(ds, i, raw, raw + ds->in.bytes, err, sizeof err)) != DT_OK) {
            set_error(ctx, s, "%s", err);
            break;
        }
        for (int64_t k = 0; k < e; k++) {
            double v = raw_to_f32(&ds->in, raw, k, ds->scale_u8);
            acc[2 * (k / group)] += v;
            acc[2 * (k / group) + 1] += v * v;
        }
    }
    double count = (double)ds->n * (double)group;
    for (int k = 0; s == DT_OK && k < n; k++) {
        double m = acc[2 * k] / count, var = acc[2 * k + 1] / count - m * m;
        mean[k] = (float)m;
        /* a constant feature (its spread below f32's resolution of its
         * mean, or none) gets std 1, as sklearn's StandardScaler gives it
         * scale 1: it normalises to 0 instead of being refused */
        std[k] = var > 1e-12 * m * m && var > 0 ? (float)sqrt(var) : 1.0f;
    }
    host_free(ctx, acc);
    host_free(ctx, raw);
    return s;
}
