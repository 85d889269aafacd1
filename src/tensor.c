#include "internal.h"

/* ===========================================================================
 * Tensors
 *
 * Shapes are row-major with element strides.  Views (reshape, transpose,
 * slice) share data and only change the header.  Kernels want contiguous
 * data, so ops pass non-contiguous inputs through dt_contiguous first.
 * Gradient buffers are always contiguous in the tensor's logical shape.
 * ======================================================================== */

/* The rows of a 2-D parameter's gradient that backward wrote through
 * dt_embedding, while the gradient's memory is known to be zero elsewhere;
 * dense: another op wrote all of it this step. */
struct row_log {
    int64_t *rows, n, cap;
    int dense;
    unsigned char *mark;       /* per row: already in rows (while applying) */
};

size_t dt_dtype_size(dt_dtype t)
{
    switch (t) {
    case DT_F32: case DT_I32: return 4;
    case DT_U8: return 1;
    case DT_BF16: case DT_F16: return 2;
    }
    return 0;
}

const char *dt_dtype_name(dt_dtype t)
{
    switch (t) {
    case DT_F32: return "f32";
    case DT_I32: return "i32";
    case DT_U8: return "u8";
    case DT_BF16: return "bf16";
    case DT_F16: return "f16";
    }
    return "?";
}

/* "(2, 3, 4)" into buf, for error messages. */
DT_PRIVATE const char *tensor_shape_str(const dt_tensor *t, char *buf, size_t len)
{
    size_t o = 0;
    o += (size_t)snprintf(buf + o, len - o, "(");
    for (int i = 0; i < t->ndim && o < len; i++)
        o += (size_t)snprintf(buf + o, len - o, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    if (o < len)
        snprintf(buf + o, len - o, ")");
    return buf;
}

DT_PRIVATE dt_status tensor_check_shape(dt_ctx *ctx, const char *op, int ndim, const int64_t *shape)
{
    if (ndim < 0 || ndim > DT_MAX_DIMS)
        return set_error(ctx, DT_EINVAL, "%s: %d dimensions (at most %d)", op, ndim, DT_MAX_DIMS);
    if (ndim > 0 && !shape)
        return set_error(ctx, DT_EINVAL, "%s: shape is NULL", op);
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return set_error(ctx, DT_EINVAL, "%s: dimension %d is negative (%lld)", op, i,
                             (long long)shape[i]);
        if (shape[i] > 0 && n > INT64_MAX / 8 / shape[i])
            return set_error(ctx, DT_EINVAL, "%s: shape too large", op);
        n *= shape[i];
    }
    return DT_OK;
}

DT_PRIVATE void tensor_header_init(dt_tensor *t, dt_ctx *ctx, dt_dtype dtype, int ndim, const int64_t *shape)
{
    memset(t, 0, sizeof *t);
    t->ctx = ctx;
    t->dtype = dtype;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++)
        t->shape[i] = shape[i];
    contiguous_strides(ndim, t->shape, t->stride);
}

DT_PRIVATE size_t tensor_bytes(const dt_tensor *t)
{
    return (size_t)shape_numel(t->ndim, t->shape) * dt_dtype_size(t->dtype);
}

static dt_tensor *step_new(dt_ctx *ctx, dt_dtype dtype, int ndim, const int64_t *shape,
                           int reuse)
{
    dt_tensor *t = arena_alloc(ctx, ctx->cur_host, sizeof *t);
    if (!t) {
        if (!arena_refused_take(ctx))   /* else its message says why */
            set_error(ctx, DT_ENOMEM, "out of host memory for a tensor header");
        return NULL;
    }
    tensor_header_init(t, ctx, dtype, ndim, shape);
    t->data = reuse ? arena_alloc_reuse(ctx, ctx->cur_dev, tensor_bytes(t))
                    : arena_alloc(ctx, ctx->cur_dev, tensor_bytes(t));
    if (!t->data) {
        if (!arena_refused_take(ctx))
            set_error(ctx, DT_ENOMEM, "out of device memory: step tensor of %zu bytes",
                      tensor_bytes(t));
        return NULL;
    }
    return t;
}

/* A step tensor with uninitialised data, in the current arenas. */
DT_PRIVATE dt_tensor *tensor_step_new(dt_ctx *ctx, dt_dtype dtype, int ndim, const int64_t *shape)
{
    return step_new(ctx, dtype, ndim, shape, 0);
}

/* The same, in memory a backward gave back if some fits (gradients:
 * grad_target); such memory must not be held past its step. */
DT_PRIVATE dt_tensor *tensor_step_new_reusing(dt_ctx *ctx, dt_dtype dtype, int ndim,
                                              const int64_t *shape)
{
    return step_new(ctx, dtype, ndim, shape, 1);
}

/* A header sharing x's data (for views), in the step arena. */
DT_PRIVATE dt_tensor *tensor_view_header(dt_ctx *ctx, const dt_tensor *x)
{
    dt_tensor *t = arena_alloc(ctx, ctx->cur_host, sizeof *t);
    if (!t) {
        set_error(ctx, DT_ENOMEM, "out of host memory for a view header");
        return NULL;
    }
    tensor_header_init(t, ctx, x->dtype, x->ndim, x->shape);
    memcpy(t->stride, x->stride, sizeof t->stride);
    t->data = x->data;
    return t;
}

DT_PRIVATE dt_tensor *tensor_view_as(dt_ctx *ctx, const dt_tensor *x, int ndim, const int64_t *shape,
                                     const int64_t *stride, void *data)
{
    dt_tensor *t = tensor_view_header(ctx, x);
    if (!t)
        return NULL;
    t->ndim = ndim;
    memcpy(t->shape, shape, sizeof(int64_t) * (size_t)ndim);
    memcpy(t->stride, stride, sizeof(int64_t) * (size_t)ndim);
    if (data)
        t->data = data;
    return t;
}

DT_PRIVATE void tensor_batch_view(dt_tensor *view, const dt_tensor *full, int64_t count)
{
    *view = *full;
    view->shape[0] = count;
    view->flags = T_EXTERNAL;
    view->next = view->prev = NULL;
}

DT_PRIVATE void tensor_set_grad(dt_tensor *t, dt_tensor *grad) { t->grad = grad; }

DT_PRIVATE void tensor_set_node(dt_tensor *t, dt_node *n) { t->node = n; }

DT_PRIVATE void tensor_require_grad(dt_tensor *t) { t->flags |= T_REQGRAD; }

DT_PRIVATE dt_tensor *tensor_persistent_new(dt_ctx *ctx, dt_dtype dtype, int ndim, const int64_t *shape)
{
    dt_tensor *t = host_alloc(ctx, sizeof *t);
    if (!t) {
        set_error(ctx, DT_ENOMEM, "tensor_new: out of host memory");
        return NULL;
    }
    tensor_header_init(t, ctx, dtype, ndim, shape);
    size_t bytes = tensor_bytes(t);
    t->data = ctx->be_iface->alloc(ctx->be, bytes ? bytes : DT_ARENA_ALIGN);
    if (!t->data) {
        host_free(ctx, t);
        set_error(ctx, DT_ENOMEM, "tensor_new: out of device memory (%zu bytes)", bytes);
        return NULL;
    }
    ctx->be_iface->memset0(ctx->be, t->data, bytes);
    t->flags = T_PERSIST | T_OWNS_DATA;
    t->next = ctx->persist;
    if (ctx->persist)
        ctx->persist->prev = t;
    ctx->persist = t;
    ctx->persistent_bytes += bytes;
    return t;
}

static int dtype_ok(dt_dtype d) { return d >= DT_F32 && d <= DT_F16; }

/* The checks every tensor constructor makes; 1: go on. */
static int new_tensor_ok(dt_ctx *ctx, const char *op, dt_dtype dtype, int ndim,
                         const int64_t *shape)
{
    if (!ctx_ok(ctx))
        return 0;
    if (!dtype_ok(dtype)) {
        set_error(ctx, DT_EINVAL, "%s: unknown dtype %d", op, (int)dtype);
        return 0;
    }
    return tensor_check_shape(ctx, op, ndim, shape) == DT_OK;
}

dt_tensor *dt_tensor_new(dt_ctx *ctx, dt_dtype dtype, int ndim, const int64_t *shape)
{
    if (!new_tensor_ok(ctx, "tensor_new", dtype, ndim, shape))
        return NULL;
    return tensor_persistent_new(ctx, dtype, ndim, shape);
}

dt_tensor *dt_tensor_temp(dt_ctx *ctx, dt_dtype dtype, int ndim, const int64_t *shape)
{
    if (!new_tensor_ok(ctx, "tensor_temp", dtype, ndim, shape))
        return NULL;
    dt_tensor *t = tensor_step_new(ctx, dtype, ndim, shape);
    if (t)
        ctx->be_iface->memset0(ctx->be, t->data, tensor_bytes(t));
    return t;
}

/* --- row logs (Hogwild!, src/hogwild.c): the rows of a 2-D parameter's
 * gradient that the embedding's backward wrote, so a step updates those
 * alone; dense once any other op wrote the gradient ------------------- */

DT_PRIVATE dt_status tensor_rows_log_start(dt_ctx *ctx, dt_tensor *t)
{
    if (t->ndim == 2 && !t->rowlog && !(t->rowlog = host_calloc(ctx, sizeof *t->rowlog)))
        return DT_ENOMEM;
    return DT_OK;
}

DT_PRIVATE int tensor_rows_log(dt_ctx *ctx, dt_tensor *t, const int32_t *idx, int64_t n)
{
    row_log *l = t->rowlog;
    if (!l || l->dense)
        return 0;
    if (l->n + n > l->cap) {
        int64_t cap = (l->n + n) * 2;
        int64_t *r = ctx->al.realloc_fn(l->rows, (size_t)cap * sizeof *r, ctx->al.user);
        if (!r)
            return 0;
        l->rows = r;
        l->cap = cap;
    }
    for (int64_t i = 0; i < n; i++)
        l->rows[l->n++] = idx[i];
    return 1;
}

DT_PRIVATE void tensor_rows_all(dt_tensor *t)
{
    if (t->rowlog)
        t->rowlog->dense = 1;
}

DT_PRIVATE int tensor_rows_logged(dt_ctx *ctx, dt_tensor *t, const int64_t **rows, int64_t *n,
                                  dt_status *st)
{
    row_log *l = t->rowlog;
    *st = DT_OK;
    *rows = NULL;
    *n = 0;
    if (!l || l->dense)
        return 0;
    /* each row once, in the order first logged (marks: per row, seen) */
    if (!l->mark && !(l->mark = host_calloc(ctx, (size_t)t->shape[0]))) {
        *st = set_error(ctx, DT_ENOMEM, "out of memory for a row log's marks");
        return 1;
    }
    int64_t k = 0;
    for (int64_t j = 0; j < l->n; j++)
        if (!l->mark[l->rows[j]]) {
            l->mark[l->rows[j]] = 1;
            l->rows[k++] = l->rows[j];
        }
    for (int64_t j = 0; j < k; j++)
        l->mark[l->rows[j]] = 0;
    l->n = k;
    *rows = l->rows;
    *n = k;
    return 1;
}

DT_PRIVATE void tensor_rows_reset(dt_tensor *t)
{
    if (t->rowlog)
        t->rowlog->n = 0, t->rowlog->dense = 0;
}

DT_PRIVATE void tensor_share_data(dt_ctx *ctx, dt_tensor *t, const dt_tensor *with)
{
    if (t->flags & T_OWNS_DATA) {
        ctx->persistent_bytes -= tensor_bytes(t);
        ctx->be_iface->free(ctx->be, t->data);
    }
    t->data = with->data;
    t->flags &= ~(unsigned)T_OWNS_DATA;
}

static void row_log_free(dt_ctx *ctx, row_log *l)
{
    if (!l)
        return;
    host_free(ctx, l->rows);
    host_free(ctx, l->mark);
    host_free(ctx, l);
}

DT_PRIVATE void tensor_destroy(dt_ctx *ctx, dt_tensor *t)
{
    row_log_free(ctx, t->rowlog);
    if (t->flags & T_OWNS_DATA) {
        ctx->persistent_bytes -= tensor_bytes(t);
        ctx->be_iface->free(ctx->be, t->data);
    }
    host_free(ctx, t->name);
    host_free(ctx, t);
}

/* A persistent gradient buffer for t: not on the persistent list, freed with
 * t, logically zero until first written. */
DT_PRIVATE dt_status tensor_attach_grad(dt_ctx *ctx, dt_tensor *t)
{
    if (t->grad)
        return DT_OK;
    dt_tensor *g = host_alloc(ctx, sizeof *g);
    if (!g)
        return set_error(ctx, DT_ENOMEM, "out of host memory for a gradient");
    tensor_header_init(g, ctx, DT_F32, t->ndim, t->shape);
    size_t bytes = tensor_bytes(g);
    g->data = ctx->be_iface->alloc(ctx->be, bytes ? bytes : DT_ARENA_ALIGN);
    if (!g->data) {
        host_free(ctx, g);
        return set_error(ctx, DT_ENOMEM, "out of device memory for a gradient (%zu bytes)", bytes);
    }
    /* not written: T_ZERO says it is zero until a backward writes it (or a
     * reader materializes it), so a gradient that a sharded DDP takes over
     * at once never costs its memory */
    g->flags = T_OWNS_DATA | T_GRADBUF | T_ZERO;
    ctx->persistent_bytes += bytes;
    t->grad = g;
    return DT_OK;
}

static void persistent_destroy(dt_ctx *ctx, dt_tensor *t)
{
    if (t->grad && (t->grad->flags & T_GRADBUF))
        tensor_destroy(ctx, t->grad);
    tensor_destroy(ctx, t);
}

void dt_tensor_free(dt_tensor *t)
{
    if (!t || !(t->flags & T_PERSIST) || (t->flags & (T_PARAM | T_EXTERNAL)))
        return;   /* step tensors die at dt_ctx_step_reset; params with the ctx */
    dt_ctx *ctx = t->ctx;
    if (t->prev)
        t->prev->next = t->next;
    else
        ctx->persist = t->next;
    if (t->next)
        t->next->prev = t->prev;
    if (ctx->tape) {   /* a recorded op may read it in backward: keep it to the step's end */
        t->prev = NULL;
        t->next = ctx->doomed;
        ctx->doomed = t;
        return;
    }
    persistent_destroy(ctx, t);
}

DT_PRIVATE void tensor_free_doomed(dt_ctx *ctx)
{
    while (ctx->doomed) {
        dt_tensor *t = ctx->doomed;
        ctx->doomed = t->next;
        persistent_destroy(ctx, t);
    }
}

int dt_tensor_is_contiguous(const dt_tensor *t)
{
    if (!t)
        return 0;
    int64_t s = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->stride[i] != s)
            return 0;
        s *= t->shape[i];
    }
    return 1;
}

/* Write zeros into a tensor whose contents are only logically zero. */
DT_PRIVATE dt_tensor *tensor_owned_new(dt_ctx *ctx, int ndim, const int64_t *shape, const char *name,
                               const char *suffix, int lazy)
{
    return tensor_owned_new_as(ctx, DT_F32, ndim, shape, name, suffix, lazy);
}

/* A persistent tensor of dtype owned by an object other than the context
 * (lazy: left unwritten, logically zero). */
DT_PRIVATE dt_tensor *tensor_owned_new_as(dt_ctx *ctx, dt_dtype dtype, int ndim,
                                        const int64_t *shape, const char *name,
                                        const char *suffix, int lazy)
{
    dt_tensor *t = host_alloc(ctx, sizeof *t);
    if (!t)
        return NULL;
    tensor_header_init(t, ctx, dtype, ndim, shape);
    size_t bytes = tensor_bytes(t), nl = strlen(name) + strlen(suffix) + 1;
    t->data = ctx->be_iface->alloc(ctx->be, bytes ? bytes : DT_ARENA_ALIGN);
    t->name = host_alloc(ctx, nl);
    if (!t->data || !t->name) {
        if (t->data)
            ctx->be_iface->free(ctx->be, t->data);
        host_free(ctx, t->name);
        host_free(ctx, t);
        return NULL;
    }
    snprintf(t->name, nl, "%s%s", name, suffix);
    if (!lazy)
        ctx->be_iface->memset0(ctx->be, t->data, bytes);
    t->flags = T_OWNS_DATA | T_EXTERNAL | (lazy ? T_ZERO : 0u);
    ctx->persistent_bytes += bytes;
    return t;
}

DT_PRIVATE void tensor_mark_zero(dt_tensor *t, int zero)
{
    if (zero)
        t->flags |= T_ZERO;
    else
        t->flags &= ~(unsigned)T_ZERO;
}

DT_PRIVATE void tensor_point_at(dt_tensor *t, void *data) { t->data = data; }

DT_PRIVATE void tensor_count_persistent(dt_ctx *ctx, int64_t bytes)
{
    ctx->persistent_bytes = (size_t)((int64_t)ctx->persistent_bytes + bytes);
}

DT_PRIVATE void tensor_materialize(dt_tensor *t)
{
    if (t && (t->flags & T_ZERO)) {
        t->ctx->be_iface->memset0(t->ctx->be, t->data, tensor_bytes(t));
        t->flags &= ~(unsigned)T_ZERO;
    }
}

/* A persistent tensor over the caller's memory (no T_OWNS_DATA: freeing
 * it leaves the memory alone).  Only where the backend computes on host
 * memory: a device backend would read a host pointer as its own. */
dt_tensor *dt_tensor_wrap(dt_ctx *ctx, dt_dtype dtype, int ndim, const int64_t *shape,
                          void *host)
{
    if (!new_tensor_ok(ctx, "tensor_wrap", dtype, ndim, shape))
        return NULL;
    if (!host || (uintptr_t)host % dt_dtype_size(dtype)) {
        set_error(ctx, DT_EINVAL, "tensor_wrap: host memory is %s", host ? "misaligned for its "
                  "dtype" : "NULL");
        return NULL;
    }
    if (!ctx->be_iface->host_visible) {
        set_error(ctx, DT_ENOTSUP, "tensor_wrap: the %s backend does not compute on host memory "
                  "(copy in with dt_tensor_set)", dt_backend_name(ctx));
        return NULL;
    }
    dt_tensor *t = host_alloc(ctx, sizeof *t);
    if (!t) {
        set_error(ctx, DT_ENOMEM, "tensor_wrap: out of host memory");
        return NULL;
    }
    tensor_header_init(t, ctx, dtype, ndim, shape);
    t->data = host;
    t->flags = T_PERSIST;
    t->next = ctx->persist;
    if (ctx->persist)
        ctx->persist->prev = t;
    ctx->persist = t;
    return t;
}

/* A parameter held as a shard (a sharded DDP, zero 3) is not whole
 * between its uses: reading it then is refused, not answered with zeros. */
DT_PRIVATE dt_status tensor_readable(const dt_tensor *t, const char *op)
{
    dt_ctx *ctx = t->ctx;
    if (ctx->hook_user && ctx->grad_hooks->param_whole &&
        !ctx->grad_hooks->param_whole(ctx->hook_user, t->data))
        return set_error(ctx, DT_ESTATE, "%s: '%s' is a parameter held as a shard on each rank "
                         "(dt_ddp_config.zero 3): call dt_ddp_full_params first",
                         op, t->name ? t->name : "tensor");
    return DT_OK;
}

void *dt_tensor_data(dt_tensor *t)
{
    if (!t)
        return NULL;
    dt_ctx *ctx = t->ctx;
    if (tensor_readable(t, "tensor_data") != DT_OK)
        return NULL;
    if (!ctx->be_iface->host_visible) {
        set_error(ctx, DT_ENOTSUP, "tensor_data: the %s backend's memory is not host memory "
                  "(copy out with dt_tensor_get)", dt_backend_name(ctx));
        return NULL;
    }
    tensor_materialize(t);   /* a lazily zeroed gradient: the memory must say so */
    return t->data;
}

int64_t dt_tensor_stride(const dt_tensor *t, int i)
{
    if (!t)
        return 0;
    if (i < 0)
        i += t->ndim;
    return i >= 0 && i < t->ndim ? t->stride[i] : 0;
}

DT_PRIVATE dt_status tensor_check(dt_ctx *ctx, const char *op, const dt_tensor *t, const char *what)
{
    if (!t)
        return set_error(ctx, DT_EINVAL, "%s: %s is NULL", op, what);
    if (t->ctx != ctx)
        return set_error(ctx, DT_EINVAL, "%s: %s belongs to another context", op, what);
    return DT_OK;
}

/* Host <-> tensor copies handle strided views through a contiguous temp. */
dt_status dt_tensor_set(dt_tensor *t, const void *host, int64_t count)
{
    if (!t)
        return DT_EINVAL;
    dt_ctx *ctx = t->ctx;
    if (!host)
        return set_error(ctx, DT_EINVAL, "tensor_set: host buffer is NULL");
    int64_t n = shape_numel(t->ndim, t->shape);
    if (count != n)
        return set_error(ctx, DT_EINVAL, "tensor_set: %lld values given, tensor has %lld",
                         (long long)count, (long long)n);
    const dt_backend_iface *be = ctx->be_iface;
    size_t bytes = (size_t)n * dt_dtype_size(t->dtype);
    t->flags &= ~(unsigned)T_ZERO;
    if (dt_tensor_is_contiguous(t)) {
        be->to_device(ctx->be, t->data, host, bytes);
        return DT_OK;
    }
    dt_arena_mark m = arena_mark(ctx->cur_dev);
    void *tmp = arena_alloc(ctx, ctx->cur_dev, bytes);
    if (!tmp)
        return set_error(ctx, DT_ENOMEM, "tensor_set: out of memory");
    int64_t cs[DT_MAX_DIMS];
    contiguous_strides(t->ndim, t->shape, cs);
    be->to_device(ctx->be, tmp, host, bytes);
    be->copy_strided(ctx->be, t->ndim, t->shape, dt_dtype_size(t->dtype), t->data, t->stride, tmp,
                     cs, 0);
    arena_release(ctx->cur_dev, m);
    return DT_OK;
}

dt_status dt_tensor_get(const dt_tensor *tc, void *host, int64_t count)
{
    if (!tc)
        return DT_EINVAL;
    dt_tensor *t = (dt_tensor *)tc;
    dt_ctx *ctx = t->ctx;
    if (!host)
        return set_error(ctx, DT_EINVAL, "tensor_get: host buffer is NULL");
    int64_t n = shape_numel(t->ndim, t->shape);
    if (count != n)
        return set_error(ctx, DT_EINVAL, "tensor_get: room for %lld values, tensor has %lld",
                         (long long)count, (long long)n);
    if (tensor_readable(t, "tensor_get") != DT_OK)
        return ctx->last_status;
    tensor_materialize(t);
    const dt_backend_iface *be = ctx->be_iface;
    size_t bytes = (size_t)n * dt_dtype_size(t->dtype);
    if (dt_tensor_is_contiguous(t)) {
        be->to_host(ctx->be, host, t->data, bytes);
        return be_fault(ctx, "tensor_get");
    }
    dt_arena_mark m = arena_mark(ctx->cur_dev);
    void *tmp = arena_alloc(ctx, ctx->cur_dev, bytes);
    if (!tmp)
        return set_error(ctx, DT_ENOMEM, "tensor_get: out of memory");
    int64_t cs[DT_MAX_DIMS];
    contiguous_strides(t->ndim, t->shape, cs);
    be->copy_strided(ctx->be, t->ndim, t->shape, dt_dtype_size(t->dtype), tmp, cs, t->data,
                     t->stride, 0);
    be->to_host(ctx->be, host, tmp, bytes);
    arena_release(ctx->cur_dev, m);
    return be_fault(ctx, "tensor_get");
}

dt_status dt_tensor_fill(dt_tensor *t, float value)
{
    if (!t)
        return DT_EINVAL;
    dt_ctx *ctx = t->ctx;
    if (t->dtype != DT_F32)
        return set_error(ctx, DT_EINVAL, "tensor_fill: tensor is %s, fill needs f32",
                         dt_dtype_name(t->dtype));
    if (!dt_tensor_is_contiguous(t))
        return set_error(ctx, DT_EINVAL, "tensor_fill: tensor is a non-contiguous view");
    t->flags &= ~(unsigned)T_ZERO;
    ctx->be_iface->fill(ctx->be, shape_numel(t->ndim, t->shape), value, t->data);
    return DT_OK;
}

float dt_tensor_item(const dt_tensor *t)
{
    if (!t || shape_numel(t->ndim, t->shape) < 1 || tensor_readable(t, "tensor_item") != DT_OK)
        return NAN;
    tensor_materialize((dt_tensor *)t);
    if (t->dtype == DT_F32) {
        float v;
        t->ctx->be_iface->to_host(t->ctx->be, &v, t->data, sizeof v);
        return be_fault(t->ctx, "tensor_item") == DT_OK ? v : NAN;
    }
    if (t->dtype == DT_I32) {
        int32_t v;
        t->ctx->be_iface->to_host(t->ctx->be, &v, t->data, sizeof v);
        return be_fault(t->ctx, "tensor_item") == DT_OK ? (float)v : NAN;
    }
    return NAN;
}

int dt_tensor_ndim(const dt_tensor *t) { return t ? t->ndim : -1; }

int64_t dt_tensor_dim(const dt_tensor *t, int i)
{
    if (!t)
        return -1;
    if (i < 0)
        i += t->ndim;
    return (i >= 0 && i < t->ndim) ? t->shape[i] : -1;
}

int64_t dt_tensor_numel(const dt_tensor *t) { return t ? shape_numel(t->ndim, t->shape) : -1; }
dt_dtype dt_tensor_dtype(const dt_tensor *t) { return t ? t->dtype : DT_F32; }
const char *dt_tensor_name(const dt_tensor *t) { return t && t->name ? t->name : ""; }

dt_status dt_tensor_set_name(dt_tensor *t, const char *name)
{
    if (!t)
        return DT_EINVAL;
    dt_ctx *ctx = t->ctx;
    if (!name || strlen(name) >= DT_MAX_NAME)
        return set_error(ctx, DT_EINVAL, "tensor_set_name: name is NULL or longer than %d",
                         DT_MAX_NAME - 1);
    if (!(t->flags & T_PERSIST))
        return set_error(ctx, DT_EINVAL, "tensor_set_name: only persistent tensors have names");
    if ((t->flags & T_PARAM) && dt_param_find(ctx, name) && dt_param_find(ctx, name) != t)
        return set_error(ctx, DT_EINVAL, "tensor_set_name: a parameter named '%s' exists", name);
    char *copy = host_strdup(ctx, name);
    if (!copy)
        return set_error(ctx, DT_ENOMEM, "tensor_set_name: out of memory");
    host_free(ctx, t->name);
    t->name = copy;
    return DT_OK;
}

dt_tensor *dt_tensor_grad(const dt_tensor *t)
{
    if (!t || !t->grad)
        return NULL;
    tensor_materialize(t->grad);
    return t->grad;
}

dt_status dt_tensor_retain_grad(dt_tensor *t)
{
    if (!t)
        return DT_EINVAL;
    t->flags |= T_RETAIN;
    return DT_OK;
}

int dt_tensor_requires_grad(const dt_tensor *t) { return t && (t->flags & T_REQGRAD) ? 1 : 0; }

dt_status dt_tensor_set_requires_grad(dt_tensor *t, int requires)
{
    if (!t)
        return DT_EINVAL;
    if (requires && t->dtype != DT_F32)
        return set_error(t->ctx, DT_EINVAL, "set_requires_grad: only f32 tensors have gradients");
    if (requires && t->node == NULL && !(t->flags & T_PERSIST))
        return set_error(t->ctx, DT_EINVAL,
                         "set_requires_grad: only leaves made by dt_tensor_new can require grad");
    if (requires && (t->flags & T_PERSIST) && tensor_attach_grad(t->ctx, t) != DT_OK)
        return t->ctx->last_status;
    if (requires)
        t->flags |= T_REQGRAD;
    else
        t->flags &= ~(unsigned)T_REQGRAD;
    return DT_OK;
}

