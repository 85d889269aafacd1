#include "internal.h"

/* ===========================================================================
 * Parameters, random numbers and initialisation
 *
 * Parameters are persistent tensors with a name and a persistent gradient,
 * kept in registration order.  Random numbers come from the context's
 * xoshiro256** generator (seeded through splitmix64), drawn on the host so
 * every backend initialises identically.
 * ======================================================================== */

DT_PRIVATE uint64_t param_splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint64_t rotl64(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

DT_PRIVATE uint64_t param_rng_next(uint64_t s[4])
{
    uint64_t r = rotl64(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl64(s[3], 45);
    return r;
}

DT_PRIVATE void param_rng_seed(uint64_t s[4], uint64_t seed)
{
    uint64_t sm = seed;
    for (int i = 0; i < 4; i++)
        s[i] = param_splitmix64(&sm);
}

/* uniform in [0, 1) with 24 random bits (exact in float) */
static float rng_uniform(uint64_t s[4]) { return (float)(param_rng_next(s) >> 40) * 0x1.0p-24f; }

void dt_ctx_seed(dt_ctx *ctx, uint64_t seed)
{
    if (!ctx)
        return;
    ctx->seed = seed;
    param_rng_seed(ctx->rng, seed);
    ctx->dropout_counter = 0;
}

dt_tensor *dt_param_new(dt_ctx *ctx, const char *name, int ndim, const int64_t *shape)
{
    if (!ctx_ok(ctx))
        return NULL;
    if (!name || !name[0] || strlen(name) >= DT_MAX_NAME) {
        set_error(ctx, DT_EINVAL, "param_new: name must be 1..%d characters", DT_MAX_NAME - 1);
        return NULL;
    }
    if (dt_param_find(ctx, name)) {
        set_error(ctx, DT_EINVAL, "param_new: a parameter named '%s' already exists", name);
        return NULL;
    }
    if (tensor_check_shape(ctx, "param_new", ndim, shape) != DT_OK)
        return NULL;
    if (ctx->n_params == ctx->cap_params) {
        int cap = ctx->cap_params ? ctx->cap_params * 2 : 16;
        dt_tensor **p = ctx->al.realloc_fn(ctx->params, (size_t)cap * sizeof *p, ctx->al.user);
        if (!p) {
            set_error(ctx, DT_ENOMEM, "param_new: out of memory");
            return NULL;
        }
        ctx->params = p;
        ctx->cap_params = cap;
    }
    dt_tensor *t = tensor_persistent_new(ctx, DT_F32, ndim, shape);
    if (!t)
        return NULL;
    t->name = host_strdup(ctx, name);
    if (!t->name || tensor_attach_grad(ctx, t) != DT_OK) {
        dt_tensor_free(t);
        set_error(ctx, DT_ENOMEM, "param_new: out of memory for '%s'", name);
        return NULL;
    }
    t->flags |= T_PARAM | T_REQGRAD;
    t->param_index = ctx->n_params;
    ctx->params[ctx->n_params++] = t;
    return t;
}

int dt_param_count(const dt_ctx *ctx) { return ctx ? ctx->n_params : 0; }

dt_tensor *dt_param_at(const dt_ctx *ctx, int i)
{
    return ctx && i >= 0 && i < ctx->n_params ? ctx->params[i] : NULL;
}

dt_tensor *dt_param_find(const dt_ctx *ctx, const char *name)
{
    if (!ctx || !name)
        return NULL;
    for (int i = 0; i < ctx->n_params; i++)
        if (strcmp(ctx->params[i]->name, name) == 0)
            return ctx->params[i];
    return NULL;
}

void dt_ctx_zero_grad(dt_ctx *ctx)
{
    if (!ctx)
        return;
    for (int i = 0; i < ctx->n_params; i++)
        if (ctx->params[i]->grad)
            ctx->params[i]->grad->flags |= T_ZERO;   /* written lazily */
    param_grads_zeroed(ctx);
}

DT_PRIVATE void param_grads_zeroed(dt_ctx *ctx) { ctx->zero_gen++; }

static float sample_uniform(uint64_t s[4], float lo, float hi)
{
    return lo + (hi - lo) * rng_uniform(s);
}

static float sample_normal(uint64_t s[4], float mean, float std)
{
    /* Box-Muller; u1 in (0, 1] so log is finite */
    float u1 = 1.0f - rng_uniform(s), u2 = rng_uniform(s);
    return mean + std * sqrtf(-2.0f * logf(u1)) * cosf(6.28318530717958647692f * u2);
}

static dt_status init_fill(dt_ctx *ctx, dt_tensor *t, const char *op, sample_fn f, float a, float b)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (tensor_check(ctx, op, t, "tensor") != DT_OK)
        return DT_EINVAL;
    if (t->dtype != DT_F32)
        return set_error(ctx, DT_EINVAL, "%s: tensor is %s, needs f32", op, dt_dtype_name(t->dtype));
    int64_t n = shape_numel(t->ndim, t->shape);
    float *host = host_alloc(ctx, (size_t)n * sizeof(float));
    if (!host)
        return set_error(ctx, DT_ENOMEM, "%s: out of memory", op);
    for (int64_t i = 0; i < n; i++)
        host[i] = f(ctx->rng, a, b);
    dt_status s = dt_tensor_set(t, host, n);
    host_free(ctx, host);
    return s;
}

dt_status dt_tensor_init_uniform(dt_ctx *ctx, dt_tensor *t, float lo, float hi)
{
    return init_fill(ctx, t, "init_uniform", sample_uniform, lo, hi);
}

dt_status dt_tensor_init_normal(dt_ctx *ctx, dt_tensor *t, float mean, float std)
{
    return init_fill(ctx, t, "init_normal", sample_normal, mean, std);
}

/* fan_in = shape[1] * receptive field, fan_out = shape[0] * receptive field */
static dt_status fans(dt_ctx *ctx, const char *op, const dt_tensor *t, double *fin, double *fout)
{
    if (!t)
        return set_error(ctx, DT_EINVAL, "%s: tensor is NULL", op);
    if (t->ndim < 2)
        return set_error(ctx, DT_EINVAL, "%s: needs at least 2 dimensions, tensor has %d", op,
                         t->ndim);
    double rf = 1;
    for (int i = 2; i < t->ndim; i++)
        rf *= (double)t->shape[i];
    *fin = (double)t->shape[1] * rf;
    *fout = (double)t->shape[0] * rf;
    if (*fin <= 0 || *fout <= 0)
        return set_error(ctx, DT_EINVAL, "%s: tensor has a zero dimension", op);
    return DT_OK;
}

dt_status dt_tensor_init_kaiming_uniform(dt_ctx *ctx, dt_tensor *t, float a)
{
    double fin = 0, fout = 0;
    if (!ctx_ok(ctx) || fans(ctx, "init_kaiming_uniform", t, &fin, &fout) != DT_OK)
        return DT_EINVAL;
    double bound = sqrt(3.0) * sqrt(2.0 / (1.0 + (double)a * a)) / sqrt(fin);
    return init_fill(ctx, t, "init_kaiming_uniform", sample_uniform, (float)-bound, (float)bound);
}

dt_status dt_tensor_init_kaiming_normal(dt_ctx *ctx, dt_tensor *t, float a)
{
    double fin = 0, fout = 0;
    if (!ctx_ok(ctx) || fans(ctx, "init_kaiming_normal", t, &fin, &fout) != DT_OK)
        return DT_EINVAL;
    double std = sqrt(2.0 / (1.0 + (double)a * a)) / sqrt(fin);
    return init_fill(ctx, t, "init_kaiming_normal", sample_normal, 0.0f, (float)std);
}

dt_status dt_tensor_init_xavier_uniform(dt_ctx *ctx, dt_tensor *t, float gain)
{
    double fin = 0, fout = 0;
    if (!ctx_ok(ctx) || fans(ctx, "init_xavier_uniform", t, &fin, &fout) != DT_OK)
        return DT_EINVAL;
    double bound = gain * sqrt(6.0 / (fin + fout));
    return init_fill(ctx, t, "init_xavier_uniform", sample_uniform, (float)-bound, (float)bound);
}

dt_status dt_tensor_init_xavier_normal(dt_ctx *ctx, dt_tensor *t, float gain)
{
    double fin = 0, fout = 0;
    if (!ctx_ok(ctx) || fans(ctx, "init_xavier_normal", t, &fin, &fout) != DT_OK)
        return DT_EINVAL;
    double std = gain * sqrt(2.0 / (fin + fout));
    return init_fill(ctx, t, "init_xavier_normal", sample_normal, 0.0f, (float)std);
}

dt_status dt_tensor_init_bias(dt_ctx *ctx, dt_tensor *bias, int64_t fan_in)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (fan_in <= 0)
        return set_error(ctx, DT_EINVAL, "init_bias: fan_in must be positive, got %lld",
                         (long long)fan_in);
    float bound = (float)(1.0 / sqrt((double)fan_in));
    return init_fill(ctx, bias, "init_bias", sample_uniform, -bound, bound);
}


/* --- layers: parameters with PyTorch's default initialisation ---------- */

/* "<name>.<what>" as a new parameter of ndim dims; NULL with the error set */
static dt_tensor *layer_param(dt_ctx *ctx, const char *fn, const char *name, const char *what,
                              int ndim, const int64_t *shape)
{
    char full[DT_MAX_NAME];
    if (!name || !*name || (size_t)snprintf(full, sizeof full, "%s.%s", name, what) >= sizeof full) {
        set_error(ctx, DT_EINVAL, "%s: the name must be non-empty and shorter than %d bytes with "
                  "\".%s\"", fn, DT_MAX_NAME, what);
        return NULL;
    }
    return dt_param_new(ctx, full, ndim, shape);
}

/* weight kaiming_uniform(a = sqrt 5), bias U(+-1/sqrt(fan_in)), as
 * torch.nn.Linear and Conv2d's reset_parameters */
static dt_status layer_weight_bias(dt_ctx *ctx, const char *fn, const char *name, int ndim,
                                   const int64_t *wshape, int64_t fan_in, int bias,
                                   dt_tensor **w, dt_tensor **b)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (!w || (bias && !b))
        return set_error(ctx, DT_EINVAL, "%s: output pointers are NULL", fn);
    for (int d = 0; d < ndim; d++)
        if (wshape[d] < 1)
            return set_error(ctx, DT_EINVAL, "%s: sizes must be >= 1", fn);
    dt_tensor *wt = layer_param(ctx, fn, name, "weight", ndim, wshape);
    if (!wt || dt_tensor_init_kaiming_uniform(ctx, wt, sqrtf(5.0f)) != DT_OK)
        return ctx->last_status;
    *w = wt;
    if (!bias) {
        if (b)
            *b = NULL;
        return DT_OK;
    }
    dt_tensor *bt = layer_param(ctx, fn, name, "bias", 1, wshape);
    if (!bt || dt_tensor_init_bias(ctx, bt, fan_in) != DT_OK)
        return ctx->last_status;
    *b = bt;
    return DT_OK;
}

dt_status dt_linear_params(dt_ctx *ctx, const char *name, int64_t in, int64_t out, int bias,
                           dt_tensor **w, dt_tensor **b)
{
    int64_t shape[2] = {out, in};
    return layer_weight_bias(ctx, "linear_params", name, 2, shape, in, bias, w, b);
}

dt_status dt_conv2d_params(dt_ctx *ctx, const char *name, int64_t in_channels,
                           int64_t out_channels, int kernel, int bias, dt_tensor **w, dt_tensor **b)
{
    int64_t shape[4] = {out_channels, in_channels, kernel, kernel};
    return layer_weight_bias(ctx, "conv2d_params", name, 4, shape,
                             in_channels * (int64_t)kernel * kernel, bias, w, b);
}

dt_tensor *dt_embedding_params(dt_ctx *ctx, const char *name, int64_t num, int64_t dim)
{
    if (!ctx_ok(ctx))
        return NULL;
    if (num < 1 || dim < 1) {
        set_error(ctx, DT_EINVAL, "embedding_params: sizes must be >= 1, got %lld x %lld",
                  (long long)num, (long long)dim);
        return NULL;
    }
    int64_t shape[2] = {num, dim};
    dt_tensor *w = layer_param(ctx, "embedding_params", name, "weight", 2, shape);
    return w && dt_tensor_init_normal(ctx, w, 0.0f, 1.0f) == DT_OK ? w : NULL;   /* as nn.Embedding */
}

dt_status dt_layer_norm_params(dt_ctx *ctx, const char *name, int64_t dim, int bias,
                               dt_tensor **w, dt_tensor **b)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (!w || (bias && !b) || dim < 1)
        return set_error(ctx, DT_EINVAL, "layer_norm_params: need dim >= 1 and output pointers");
    int64_t shape[1] = {dim};
    dt_tensor *wt = layer_param(ctx, "layer_norm_params", name, "weight", 1, shape);
    if (!wt || dt_tensor_fill(wt, 1.0f) != DT_OK)   /* ones and zeros: no draw */
        return ctx->last_status;
    *w = wt;
    if (b)
        *b = NULL;
    if (bias && !(*b = layer_param(ctx, "layer_norm_params", name, "bias", 1, shape)))
        return ctx->last_status;
    return DT_OK;
}
