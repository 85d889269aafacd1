#include "internal.h"

/* ===========================================================================
 * The ops of convolutional and sequence models: convolution and pooling
 * (NCHW), embedding, layer norm, dropout.  Each op's forward and backward
 * side by side, as in src/ops.c (the tensor ops: views, matmul and
 * linear, elementwise, reductions, activations, losses).
 * ======================================================================== */

/* --- convolution and pooling (NCHW) --------------------------------- */

/* What each op keeps for its backward (its node's state, tape_record_op).
 * A convolution: its geometry, and im2col's columns (NULL: the backend's
 * fused convolution keeps none); a pooling: its geometry and max's argmax. */
typedef struct conv_state { const float *col; const dt_conv_geom *g; } conv_state;
typedef struct pool_state { const int32_t *argmax; const dt_conv_geom *g; } pool_state;

static dt_status conv2d_backward(dt_ctx *ctx, dt_node *n)
{
    dt_tensor *x = n->in[0], *w = n->in[1], *b = n->n_in > 2 ? n->in[2] : NULL, *y = n->out;
    const conv_state *st = n->state;
    const dt_conv_geom *g = st->g;
    const float *col = st->col;
    int64_t o = w->shape[0], ckk = g->c * g->kh * g->kw, p = g->oh * g->ow, np = g->n * p;
    const float *gy = FP(y->grad), *dyt = gy;   /* dY' (O, N*P) */
    if (g->n > 1) {
        float *t = op_temp_floats(ctx, o * np);
        if (!t)
            return ctx->last_status;
        BE(ctx)->ncp_to_cnp(BEI(ctx), g->n, o, p, gy, t);
        dyt = t;
    }
    int acc;
    if (grad_needed(w)) {   /* dW (O, CKK) = dY' col^T */
        float *gw = grad_target(ctx, w, &acc);
        if (!gw)
            return ctx->last_status;
        GEMM(ctx, n->prec, 0, 1, o, ckk, np, 1.0f, dyt, np, col, np, acc ? 1.0f : 0.0f, gw, ckk);
    }
    if (b && grad_needed(b)) {
        float *gb = grad_target(ctx, b, &acc);
        if (!gb)
            return ctx->last_status;
        BE(ctx)->bias_grad(BEI(ctx), g->n, o, p, gy, gb, acc);
    }
    if (grad_needed(x)) {   /* dcol (CKK, N*P) = W^T dY', then fold */
        float *dcol = op_temp_floats(ctx, ckk * np);
        float *gx = dcol ? grad_target(ctx, x, &acc) : NULL;
        if (!gx)
            return ctx->last_status;
        GEMM(ctx, n->prec, 1, 0, ckk, np, o, 1.0f, FP(w), ckk, dyt, np, 0.0f, dcol, np);
        BE(ctx)->col2im(BEI(ctx), g, dcol, gx, acc);
    }
    return DT_OK;
}

static dt_status conv2d_fused_backward(dt_ctx *ctx, dt_node *n)
{
    dt_tensor *x = n->in[0], *w = n->in[1], *b = n->n_in > 2 ? n->in[2] : NULL;
    int ax = 0, aw = 0, ab = 0;
    float *gx = grad_needed(x) ? grad_target(ctx, x, &ax) : NULL;
    float *gw = grad_needed(w) ? grad_target(ctx, w, &aw) : NULL;
    float *gb = b && grad_needed(b) ? grad_target(ctx, b, &ab) : NULL;
    if ((grad_needed(x) && !gx) || (grad_needed(w) && !gw) || (b && grad_needed(b) && !gb))
        return ctx->last_status;
    dt_status s = BE(ctx)->conv2d_backward(BEI(ctx), ((const conv_state *)n->state)->g, w->shape[0], FP(x), FP(w),
                                           FP(n->out->grad), gx, ax, gw, aw, gb, ab);
    return s == DT_OK ? s : set_error(ctx, s, "conv2d: backend out of scratch memory");
}

/* The backend's own convolution: nothing is kept for backward but x and w. */
static dt_tensor *conv2d_fused(dt_ctx *ctx, const dt_conv_geom *geom, dt_tensor *x, dt_tensor *w,
                               dt_tensor *b, dt_tensor *y, int track)
{
    if (b)
        tensor_materialize(b);
    dt_status s = BE(ctx)->conv2d_forward(BEI(ctx), geom, w->shape[0], FP(x), FP(w),
                                          b ? FP(b) : NULL, FP(y));
    if (s != DT_OK) {
        set_error(ctx, s, "conv2d: backend out of scratch memory");
        return NULL;
    }
    if (!track)
        return y;
    dt_conv_geom *g = arena_alloc(ctx, ctx->cur_host, sizeof *g);
    if (!g) {
        set_error(ctx, DT_ENOMEM, "conv2d: out of memory for the tape");
        return NULL;
    }
    *g = *geom;
    if (!tape_record_op(ctx, "conv2d", conv2d_fused_backward, y, x, w, b, &(conv_state){NULL, g},
                        sizeof(conv_state)))
        return NULL;
    return y;
}

static int pool_geom(dt_ctx *ctx, const char *op, const dt_tensor *x, int64_t kh, int64_t kw,
                     int stride, int pad, dt_conv_geom *g)
{
    char sx[96];
    if (x->ndim != 4) {
        set_error(ctx, DT_EINVAL, "%s: input %s must be (N,C,H,W)", op, SHAPE(x, sx));
        return 0;
    }
    if (stride < 1 || pad < 0 || kh < 1 || kw < 1) {
        set_error(ctx, DT_EINVAL, "%s: kernel %lldx%lld, stride %d, pad %d: need kernel, stride >= 1 "
                  "and pad >= 0", op, (long long)kh, (long long)kw, stride, pad);
        return 0;
    }
    g->n = x->shape[0];
    g->c = x->shape[1];
    g->h = x->shape[2];
    g->w = x->shape[3];
    g->kh = kh;
    g->kw = kw;
    g->stride = stride;
    g->pad = pad;
    if (g->h + 2 * pad < kh || g->w + 2 * pad < kw) {
        set_error(ctx, DT_EINVAL, "%s: kernel %lldx%lld larger than padded input %s", op,
                  (long long)kh, (long long)kw, SHAPE(x, sx));
        return 0;
    }
    g->oh = (g->h + 2 * pad - kh) / stride + 1;
    g->ow = (g->w + 2 * pad - kw) / stride + 1;
    return 1;
}

/* x (N,C,H,W), w (O,C,KH,KW), b (O) -> (N,O,OH,OW) by im2col + one GEMM */
dt_tensor *dt_conv2d(dt_ctx *ctx, dt_tensor *x, dt_tensor *w, dt_tensor *b, int stride, int pad)
{
    if (!op_f32_ok(ctx, "conv2d", x, "input") || !op_f32_ok(ctx, "conv2d", w, "weight") ||
        (b && !op_f32_ok(ctx, "conv2d", b, "bias")))
        return NULL;
    char sx[96], sw[96];
    if (w->ndim != 4) {
        set_error(ctx, DT_EINVAL, "conv2d: weight %s must be (O,C,KH,KW)", SHAPE(w, sw));
        return NULL;
    }
    dt_conv_geom geom;
    if (!pool_geom(ctx, "conv2d", x, w->shape[2], w->shape[3], stride, pad, &geom))
        return NULL;
    if (x->shape[1] != w->shape[1]) {
        set_error(ctx, DT_EINVAL, "conv2d: input %s has %lld channels, weight %s expects %lld",
                  SHAPE(x, sx), (long long)x->shape[1], SHAPE(w, sw), (long long)w->shape[1]);
        return NULL;
    }
    if (b && (b->ndim != 1 || b->shape[0] != w->shape[0])) {
        set_error(ctx, DT_EINVAL, "conv2d: bias %s does not match %lld output channels",
                  SHAPE(b, sx), (long long)w->shape[0]);
        return NULL;
    }
    if (!(x = op_need_contig(ctx, x)) || !(w = op_need_contig(ctx, w)) || (b && !(b = op_need_contig(ctx, b))))
        return NULL;
    tensor_materialize(x);
    tensor_materialize(w);
    int64_t o = w->shape[0], ckk = geom.c * geom.kh * geom.kw, p = geom.oh * geom.ow;
    int64_t np = geom.n * p;
    int64_t shape[4] = {geom.n, o, geom.oh, geom.ow};
    dt_tensor *y = tensor_step_new(ctx, DT_F32, 4, shape);
    if (!y)
        return NULL;
    int track = tape_tracks(ctx, x) || tape_tracks(ctx, w) || tape_tracks(ctx, b);
    /* autocast: the composed path, whose GEMMs run at the reduced precision */
    if (BE(ctx)->conv2d_forward && ctx->autocast == DT_PREC_F32)
        return conv2d_fused(ctx, &geom, x, w, b, y, track);
    dt_arena_mark mark = arena_mark(ctx->cur_dev);   /* temporaries, freed if no backward */
    dt_conv_geom *g = track ? arena_alloc(ctx, ctx->cur_host, sizeof *g) : &geom;
    float *col = g ? op_temp_floats(ctx, ckk * np) : NULL;
    float *yt = (col && geom.n > 1) ? op_temp_floats(ctx, o * np) : FP(y);
    if (!g || !col || !yt)
        return NULL;
    *g = geom;
    BE(ctx)->im2col(BEI(ctx), g, FP(x), col);
    if (op_gemm(ctx, ctx->autocast, 1, 0, 0, o, np, ckk, 1.0f, FP(w), ckk, 0, col, np, 0, 0.0f,
                yt, np, 0) != DT_OK)
        return NULL;
    if (geom.n > 1)
        BE(ctx)->cnp_to_ncp(BEI(ctx), o, geom.n, p, yt, FP(y));
    if (b) {
        tensor_materialize(b);
        BE(ctx)->bias_add(BEI(ctx), geom.n, o, p, FP(b), FP(y));
    }
    if (!track) {
        arena_release(ctx->cur_dev, mark);
        return y;
    }
    if (!tape_record_op(ctx, "conv2d", conv2d_backward, y, x, w, b, &(conv_state){col, g},
                        sizeof(conv_state)))
        return NULL;
    return y;
}

static dt_status maxpool_backward(dt_ctx *ctx, dt_node *n)
{
    int acc;
    float *gx = grad_target(ctx, n->in[0], &acc);
    if (!gx)
        return ctx->last_status;
    const pool_state *st = n->state;
    const int32_t *argmax = st->argmax;
    const dt_conv_geom *g = st->g;
    BE(ctx)->maxpool_backward(BEI(ctx), g, FP(n->out->grad), argmax, gx, acc);
    return DT_OK;
}

static dt_status avgpool_backward(dt_ctx *ctx, dt_node *n)
{
    int acc;
    float *gx = grad_target(ctx, n->in[0], &acc);
    if (!gx)
        return ctx->last_status;
    const dt_conv_geom *g = ((const pool_state *)n->state)->g;
    BE(ctx)->avgpool_backward(BEI(ctx), g, FP(n->out->grad), gx, acc);
    return DT_OK;
}

/* x (N,C,H,W) -> (N,C,OH,OW); stride 0 means stride = kernel */
static dt_tensor *pool_op(dt_ctx *ctx, const char *name, dt_tensor *x, int kernel, int stride,
                          int pad, int is_max)
{
    if (!op_f32_ok(ctx, name, x, "input"))
        return NULL;
    if (stride == 0)
        stride = kernel;
    dt_conv_geom geom;
    if (!pool_geom(ctx, name, x, kernel, kernel, stride, pad, &geom))
        return NULL;
    if (pad > kernel / 2) {
        set_error(ctx, DT_EINVAL, "%s: pad %d must be at most half the kernel (%d)", name, pad,
                  kernel);
        return NULL;
    }
    if (!(x = op_need_contig(ctx, x)))
        return NULL;
    tensor_materialize(x);
    int64_t shape[4] = {geom.n, geom.c, geom.oh, geom.ow};
    dt_tensor *y = tensor_step_new(ctx, DT_F32, 4, shape);
    dt_conv_geom *g = y ? arena_alloc(ctx, ctx->cur_host, sizeof *g) : NULL;
    int32_t *argmax = NULL;
    if (!g)
        return NULL;
    *g = geom;
    if (is_max) {
        argmax = arena_alloc(ctx, ctx->cur_dev, (size_t)shape_numel(4, shape) * sizeof(int32_t));
        if (!argmax) {
            set_error(ctx, DT_ENOMEM, "%s: out of memory", name);
            return NULL;
        }
        BE(ctx)->maxpool_forward(BEI(ctx), g, FP(x), FP(y), argmax);
    } else {
        BE(ctx)->avgpool_forward(BEI(ctx), g, FP(x), FP(y));
    }
    if (tape_tracks(ctx, x) &&
        !tape_record_op(ctx, name, is_max ? maxpool_backward : avgpool_backward, y, x, NULL, NULL,
                        &(pool_state){argmax, g}, sizeof(pool_state)))
        return NULL;
    return y;
}

dt_tensor *dt_max_pool2d(dt_ctx *ctx, dt_tensor *x, int kernel, int stride, int pad)
{
    return pool_op(ctx, "max_pool2d", x, kernel, stride, pad, 1);
}

dt_tensor *dt_avg_pool2d(dt_ctx *ctx, dt_tensor *x, int kernel, int stride, int pad)
{
    return pool_op(ctx, "avg_pool2d", x, kernel, stride, pad, 0);
}

/* --- embedding, layer norm, dropout ----------------------------------- */

static dt_status embedding_backward(dt_ctx *ctx, dt_node *n)
{
    dt_tensor *w = n->in[0], *idx = n->in[1];
    int64_t count = shape_numel(idx->ndim, idx->shape);
    float *gw;
    /* Hogwild!: log the rows idx uses instead of zeroing the whole gradient
     * (its memory is zero outside the logged rows), so a step costs the
     * rows it touches */
    if (w->grad && ctx->be_iface->host_visible && tensor_rows_log(ctx, w, IP(idx), count)) {
        tensor_mark_zero(w->grad, 0);   /* zero already, outside the logged rows */
        gw = FP(w->grad);
    } else {
        gw = grad_target_zeroed(ctx, w);
    }
    if (!gw)
        return ctx->last_status;
    BE(ctx)->embedding_backward(BEI(ctx), shape_numel(idx->ndim, idx->shape), w->shape[1],
                                IP(idx), FP(n->out->grad), gw);
    return DT_OK;
}

/* weight (V,D), idx i32 (...) -> (..., D) */
dt_tensor *dt_embedding(dt_ctx *ctx, dt_tensor *weight, dt_tensor *idx)
{
    if (!op_f32_ok(ctx, "embedding", weight, "weight") || !op_input_ok(ctx, "embedding", idx, "indices"))
        return NULL;
    char sw[96];
    if (weight->ndim != 2 || idx->dtype != DT_I32 || idx->ndim + 1 > DT_MAX_DIMS) {
        set_error(ctx, DT_EINVAL, "embedding: weight %s must be (V,D) and indices i32 (got %s)",
                  SHAPE(weight, sw), dt_dtype_name(idx->dtype));
        return NULL;
    }
    if (!(weight = op_need_contig(ctx, weight)) || !(idx = op_need_contig(ctx, idx)))
        return NULL;
    tensor_materialize(weight);
    tensor_materialize(idx);
    int64_t n = shape_numel(idx->ndim, idx->shape), d = weight->shape[1];
    int64_t bad = BE(ctx)->index_check(BEI(ctx), n, IP(idx), weight->shape[0]);
    if (be_fault(ctx, "embedding") != DT_OK)
        return NULL;
    if (bad >= 0) {
        int32_t v = 0;
        BE(ctx)->to_host(BEI(ctx), &v, IP(idx) + bad, sizeof v);
        set_error(ctx, DT_EINVAL, "embedding: index %d at position %lld is outside [0, %lld)",
                  (int)v, (long long)bad, (long long)weight->shape[0]);
        return NULL;
    }
    int64_t shape[DT_MAX_DIMS];
    memcpy(shape, idx->shape, sizeof(int64_t) * (size_t)idx->ndim);
    shape[idx->ndim] = d;
    dt_tensor *y = tensor_step_new(ctx, DT_F32, idx->ndim + 1, shape);
    if (!y)
        return NULL;
    BE(ctx)->embedding_forward(BEI(ctx), n, d, FP(weight), IP(idx), FP(y));
    if (tape_tracks(ctx, weight) && !tape_record(ctx, "embedding", embedding_backward, y, weight, idx, NULL))
        return NULL;
    return y;
}

/* x seen as (rows, d); mean and rstd per row, kept by the forward; w and
 * b as given (either may be NULL, so in[] cannot say which is which) */
typedef struct layer_norm_state {
    int64_t rows, d;
    const float *mean, *rstd;
    dt_tensor *w, *b;
} layer_norm_state;

static dt_status layer_norm_backward(dt_ctx *ctx, dt_node *n)
{
    const layer_norm_state *st = n->state;
    dt_tensor *x = n->in[0], *w = st->w, *b = st->b;
    int64_t rows = st->rows, d = st->d;
    int acc = 0;
    float *gx = grad_needed(x) ? grad_target(ctx, x, &acc) : op_temp_floats(ctx, rows * d);
    float *gw = w && grad_needed(w) ? grad_target_zeroed(ctx, w) : NULL;
    float *gb = b && grad_needed(b) ? grad_target_zeroed(ctx, b) : NULL;
    if (!gx || (w && grad_needed(w) && !gw) || (b && grad_needed(b) && !gb))
        return ctx->last_status;
    const float *mean = st->mean, *rstd = st->rstd;
    BE(ctx)->layernorm_backward(BEI(ctx), rows, d, FP(x), w ? FP(w) : NULL, mean, rstd,
                                FP(n->out->grad), gx, gw, gb, acc);
    return DT_OK;
}

/* x (..., D), w (D), b (D) -> (..., D) normalised over the last dim */
dt_tensor *dt_layer_norm(dt_ctx *ctx, dt_tensor *x, dt_tensor *w, dt_tensor *b, float eps)
{
    if (!op_f32_ok(ctx, "layer_norm", x, "input") || (w && !op_f32_ok(ctx, "layer_norm", w, "weight")) ||
        (b && !op_f32_ok(ctx, "layer_norm", b, "bias")))
        return NULL;
    char sx[96];
    if (x->ndim < 1 || x->shape[x->ndim - 1] == 0) {
        set_error(ctx, DT_EINVAL, "layer_norm: input %s needs a non-empty last dim", SHAPE(x, sx));
        return NULL;
    }
    int64_t d = x->shape[x->ndim - 1], rows = shape_numel(x->ndim - 1, x->shape);
    if ((w && (w->ndim != 1 || w->shape[0] != d)) || (b && (b->ndim != 1 || b->shape[0] != d))) {
        set_error(ctx, DT_EINVAL, "layer_norm: weight and bias must be (%lld) for input %s",
                  (long long)d, SHAPE(x, sx));
        return NULL;
    }
    if (!(x = op_need_contig(ctx, x)) || (w && !(w = op_need_contig(ctx, w))) ||
        (b && !(b = op_need_contig(ctx, b))))
        return NULL;
    tensor_materialize(x);
    tensor_materialize(w);
    tensor_materialize(b);
    dt_tensor *y = op_like(ctx, x);
    float *mean = y ? op_temp_floats(ctx, rows) : NULL, *rstd = mean ? op_temp_floats(ctx, rows) : NULL;
    if (!rstd)
        return NULL;
    BE(ctx)->layernorm_forward(BEI(ctx), rows, d, FP(x), w ? FP(w) : NULL, b ? FP(b) : NULL, eps,
                               FP(y), mean, rstd);
    if ((tape_tracks(ctx, x) || tape_tracks(ctx, w) || tape_tracks(ctx, b)) &&
        !tape_record_op(ctx, "layer_norm", layer_norm_backward, y, x, w, b,
                        &(layer_norm_state){rows, d, mean, rstd, w, b}, sizeof(layer_norm_state)))
        return NULL;
    return y;
}

typedef struct dropout_state { const float *mask; } dropout_state;   /* 0 or 1/(1-p) per element */

static dt_status dropout_backward(dt_ctx *ctx, dt_node *n)
{
    dt_tensor *x = n->in[0];
    int64_t cnt = shape_numel(x->ndim, x->shape), shape[1] = {cnt}, s1[1] = {1};
    int acc;
    float *gx = grad_target(ctx, x, &acc);
    if (!gx)
        return ctx->last_status;
    float *dst = acc ? op_temp_floats(ctx, cnt) : gx;
    if (!dst)
        return ctx->last_status;
    const float *mask = ((const dropout_state *)n->state)->mask;   /* kept by the forward */
    BE(ctx)->binary(BEI(ctx), DT_BIN_MUL, 1, shape, FP(n->out->grad), s1, mask, s1, dst);
    if (acc)
        BE(ctx)->axpby(BEI(ctx), cnt, 1.0f, dst, 1.0f, gx);
    return DT_OK;
}

/* x -> x * mask / (1-p) while training; x itself otherwise */
dt_tensor *dt_dropout(dt_ctx *ctx, dt_tensor *x, float p)
{
    if (!op_f32_ok(ctx, "dropout", x, "input"))
        return NULL;
    if (!(p >= 0.0f && p < 1.0f)) {
        set_error(ctx, DT_EINVAL, "dropout: p = %g must be in [0, 1)", (double)p);
        return NULL;
    }
    if (!ctx->training || p == 0.0f)
        return x;
    if (!(x = op_need_contig(ctx, x)))
        return NULL;
    tensor_materialize(x);
    uint64_t sm = ctx->seed ^ 0xD1B54A32D192ED03ull;
    sm += 0x9E3779B97F4A7C15ull * (ctx_dropout_next(ctx) + 1);
    uint64_t seed = param_splitmix64(&sm);
    int64_t cnt = shape_numel(x->ndim, x->shape);
    dt_tensor *y = op_like(ctx, x);
    float *mask = y ? op_temp_floats(ctx, cnt) : NULL;
    if (!mask)
        return NULL;
    BE(ctx)->dropout_forward(BEI(ctx), cnt, p, seed, FP(x), FP(y), mask);
    if (tape_tracks(ctx, x) &&
        !tape_record_op(ctx, "dropout", dropout_backward, y, x, NULL, NULL,
                        &(dropout_state){mask}, sizeof(dropout_state)))
        return NULL;
    return y;
}

/* --- attention ----------------------------------------------------------- */

/* q, k, v seen as (bh, t, d); lse: each query row's log-sum-exp, kept by
 * the forward; mask: the caller's additive mask or NULL */
typedef struct attention_state {
    int64_t bh, t, d;
    int causal;
    float scale;
    const float *lse, *mask;
} attention_state;

static dt_status attention_backward(dt_ctx *ctx, dt_node *n)
{
    dt_tensor *q = n->in[0], *k = n->in[1], *v = n->in[2], *o = n->out;
    const attention_state *st = n->state;
    int64_t bh = st->bh, t = st->t, d = st->d;
    int causal = st->causal;
    float scale = st->scale;
    const float *lse = st->lse, *mask = st->mask;
    int64_t cnt = bh * t * d;
    float *tmp = op_temp_floats(ctx, 3 * cnt);
    if (!tmp)
        return ctx->last_status;
    dt_status s = BE(ctx)->attention_backward(BEI(ctx), bh, t, d, scale, causal, mask, FP(q),
                                              FP(k), FP(v), FP(o), lse, FP(o->grad), tmp,
                                              tmp + cnt, tmp + 2 * cnt);
    if (s != DT_OK)
        return set_error(ctx, s, "attention: out of memory for the backward's scratch");
    dt_tensor *in[3] = {q, k, v};
    for (int i = 0; i < 3 && s == DT_OK; i++)
        if (grad_needed(in[i]))
            s = op_acc_grad(ctx, in[i], tmp + i * cnt, 1.0f);
    return s;
}

/* q, k, v checked: f32, one shape (..., T, D) of at least 2 dims; mask
 * (T, T) f32 or NULL. */
static int attention_args_ok(dt_ctx *ctx, dt_tensor *q, dt_tensor *k, dt_tensor *v,
                             dt_tensor *mask)
{
    if (!op_f32_ok(ctx, "attention", q, "q") || !op_f32_ok(ctx, "attention", k, "k") ||
        !op_f32_ok(ctx, "attention", v, "v") || (mask && !op_f32_ok(ctx, "attention", mask, "mask")))
        return 0;
    char sq[96], sk[96], sv[96];
    int same = q->ndim == k->ndim && q->ndim == v->ndim;
    for (int i = 0; same && i < q->ndim; i++)
        same = q->shape[i] == k->shape[i] && q->shape[i] == v->shape[i];
    if (q->ndim < 2 || !same || dt_tensor_numel(q) == 0) {
        set_error(ctx, DT_EINVAL, "attention: q %s, k %s, v %s must have one shape (..., T, D)",
                  SHAPE(q, sq), SHAPE(k, sk), SHAPE(v, sv));
        return 0;
    }
    int64_t t = q->shape[q->ndim - 2];
    if (mask && (mask->ndim != 2 || mask->shape[0] != t || mask->shape[1] != t)) {
        set_error(ctx, DT_EINVAL, "attention: mask %s must be (%lld, %lld)", SHAPE(mask, sq),
                  (long long)t, (long long)t);
        return 0;
    }
    if (!BE(ctx)->attention_forward || !BE(ctx)->attention_backward) {
        set_error(ctx, DT_ENOTSUP, "attention: the %s backend has no attention",
                  ctx->be_iface->name);
        return 0;
    }
    return 1;
}

dt_tensor *dt_attention(dt_ctx *ctx, dt_tensor *q, dt_tensor *k, dt_tensor *v, dt_tensor *mask,
                        int causal, float scale)
{
    if (!attention_args_ok(ctx, q, k, v, mask))
        return NULL;
    int64_t t = q->shape[q->ndim - 2], d = q->shape[q->ndim - 1];
    int64_t bh = shape_numel(q->ndim - 2, q->shape);
    if (scale == 0.0f)
        scale = 1.0f / sqrtf((float)d);
    if (!(q = op_need_contig(ctx, q)) || !(k = op_need_contig(ctx, k)) ||
        !(v = op_need_contig(ctx, v)) || (mask && !(mask = op_need_contig(ctx, mask))))
        return NULL;
    tensor_materialize(q);
    tensor_materialize(k);
    tensor_materialize(v);
    tensor_materialize(mask);
    dt_tensor *o = op_like(ctx, q);
    float *lse = o ? op_temp_floats(ctx, bh * t) : NULL;
    if (!lse)
        return NULL;
    const float *m = mask ? FP(mask) : NULL;
    dt_status s = BE(ctx)->attention_forward(BEI(ctx), bh, t, d, scale, causal != 0, m, FP(q),
                                             FP(k), FP(v), FP(o), lse);
    if (s != DT_OK) {
        set_error(ctx, s, "attention: out of memory for the scores' scratch");
        return NULL;
    }
    if ((tape_tracks(ctx, q) || tape_tracks(ctx, k) || tape_tracks(ctx, v)) &&
        !tape_record_op(ctx, "attention", attention_backward, o, q, k, v,
                        &(attention_state){bh, t, d, causal != 0, scale, lse, m},
                        sizeof(attention_state)))
        return NULL;
    return o;
}
