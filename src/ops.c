#include "internal.h"

/* ===========================================================================
 * Ops
 *
 * Each op validates its inputs (naming itself in the message), computes the
 * output through the backend, and records a node whose backward sits right
 * below it.  Shapes are in the comment at each op.
 * ======================================================================== */

/* The last two dims of x as a GEMM operand: row-major (t = 0) or
 * column-major (t = 1, a transposed view) with leading dimension ld. */
struct gemm_operand {
    const float *p;
    int64_t ld, batch_stride;
    int t;
};

/* Reports a NULL input unless an earlier op already failed (then its message
 * is the useful one). */
DT_PRIVATE int op_input_ok(dt_ctx *ctx, const char *op, const dt_tensor *x, const char *what)
{
    if (!ctx_ok(ctx))
        return 0;
    if (!x) {
        if (ctx->last_status == DT_OK)
            set_error(ctx, DT_EINVAL, "%s: %s is NULL", op, what);
        return 0;
    }
    if (x->ctx != ctx) {
        set_error(ctx, DT_EINVAL, "%s: %s belongs to another context", op, what);
        return 0;
    }
    /* a parameter held as a shard (zero 3) is gathered before it is read */
    if (ctx->hook_user && ctx->grad_hooks->param_use &&
        ctx->grad_hooks->param_use(ctx->hook_user, x->data, 0) != DT_OK)
        return 0;
    if (ctx->noted && (x->flags & T_PARAM))   /* a recompute segment's first run */
        ctx_note_param(ctx, x);
    return 1;
}

DT_PRIVATE int op_f32_ok(dt_ctx *ctx, const char *op, const dt_tensor *x, const char *what)
{
    if (!op_input_ok(ctx, op, x, what))
        return 0;
    if (x->dtype != DT_F32) {
        set_error(ctx, x->dtype == DT_BF16 || x->dtype == DT_F16 ? DT_ENOTSUP : DT_EINVAL,
                  "%s: %s is %s, this op computes in f32", op, what, dt_dtype_name(x->dtype));
        return 0;
    }
    return 1;
}

static int norm_dim(dt_ctx *ctx, const char *op, const dt_tensor *x, int *dim)
{
    int d = *dim < 0 ? *dim + x->ndim : *dim;
    if (d < 0 || d >= x->ndim) {
        set_error(ctx, DT_EINVAL, "%s: dim %d out of range for %d dimensions", op, *dim, x->ndim);
        return 0;
    }
    *dim = d;
    return 1;
}

DT_PRIVATE dt_tensor *op_like(dt_ctx *ctx, const dt_tensor *x)
{
    return tensor_step_new(ctx, x->dtype, x->ndim, x->shape);
}

DT_PRIVATE float *op_temp_floats(dt_ctx *ctx, int64_t n)
{
    float *p = arena_alloc(ctx, ctx->cur_dev, (size_t)n * sizeof(float));
    if (!p && !arena_refused_take(ctx))   /* else its message says why */
        set_error(ctx, DT_ENOMEM, "out of device memory for a %lld-float temporary", (long long)n);
    return p;
}

/* gx (+)= src, both contiguous over x's shape. */
DT_PRIVATE dt_status op_acc_grad(dt_ctx *ctx, dt_tensor *x, const float *src, float alpha)
{
    int acc;
    float *gx = grad_target(ctx, x, &acc);
    if (!gx)
        return ctx->last_status;
    BE(ctx)->axpby(BEI(ctx), shape_numel(x->ndim, x->shape), alpha, src, acc ? 1.0f : 0.0f, gx);
    return DT_OK;
}

/* --- views: reshape, transpose, slice, contiguous, concat ----------- */

static dt_status contiguous_backward(dt_ctx *ctx, dt_node *n)
{
    return op_acc_grad(ctx, n->in[0], FP(n->out->grad), 1.0f);
}

/* x any strides -> y contiguous copy */
dt_tensor *dt_contiguous(dt_ctx *ctx, dt_tensor *x)
{
    if (!op_input_ok(ctx, "contiguous", x, "input"))
        return NULL;
    if (dt_tensor_is_contiguous(x))
        return x;
    dt_tensor *y = op_like(ctx, x);
    if (!y)
        return NULL;
    tensor_materialize(x);
    BE(ctx)->copy_strided(BEI(ctx), x->ndim, x->shape, dt_dtype_size(x->dtype), y->data, y->stride,
                          x->data, x->stride, 0);
    if (tape_tracks(ctx, x) && !tape_record(ctx, "contiguous", contiguous_backward, y, x, NULL, NULL))
        return NULL;
    return y;
}

DT_PRIVATE dt_tensor *op_need_contig(dt_ctx *ctx, dt_tensor *x)
{
    return dt_tensor_is_contiguous(x) ? x : dt_contiguous(ctx, x);
}

static dt_status reshape_backward(dt_ctx *ctx, dt_node *n)
{
    return op_acc_grad(ctx, n->in[0], FP(n->out->grad), 1.0f);
}

/* x (any) -> y (shape) sharing data; copies first if x is not contiguous */
dt_tensor *dt_reshape(dt_ctx *ctx, dt_tensor *x, int ndim, const int64_t *shape)
{
    if (!op_input_ok(ctx, "reshape", x, "input"))
        return NULL;
    if (ndim < 0 || ndim > DT_MAX_DIMS || (ndim > 0 && !shape)) {
        set_error(ctx, DT_EINVAL, "reshape: bad target (%d dimensions)", ndim);
        return NULL;
    }
    int64_t want[DT_MAX_DIMS], known = 1, n = shape_numel(x->ndim, x->shape);
    int infer = -1;
    for (int i = 0; i < ndim; i++) {
        want[i] = shape[i];
        if (shape[i] == -1 && infer < 0) {
            infer = i;
            continue;
        }
        if (shape[i] < 0) {
            set_error(ctx, DT_EINVAL, "reshape: dimension %d is %lld", i, (long long)shape[i]);
            return NULL;
        }
        known *= shape[i];
    }
    if (infer >= 0) {
        if (known == 0 || n % known != 0) {
            set_error(ctx, DT_EINVAL, "reshape: cannot infer dimension %d for %lld elements",
                      infer, (long long)n);
            return NULL;
        }
        want[infer] = n / known;
        known *= want[infer];
    }
    if (known != n) {
        char sb[96];
        set_error(ctx, DT_EINVAL, "reshape: %s has %lld elements, target has %lld", SHAPE(x, sb),
                  (long long)n, (long long)known);
        return NULL;
    }
    dt_tensor *c = op_need_contig(ctx, x);
    if (!c)
        return NULL;
    int64_t stride[DT_MAX_DIMS];
    contiguous_strides(ndim, want, stride);
    dt_tensor *y = tensor_view_as(ctx, c, ndim, want, stride, NULL);
    if (!y)
        return NULL;
    if (tape_tracks(ctx, c) && !tape_record(ctx, "reshape", reshape_backward, y, c, NULL, NULL))
        return NULL;
    return y;
}

/* x (d0..d{k-1}, dk.., ) -> (d0..d{k-1}, prod(dk..)) */
dt_tensor *dt_flatten(dt_ctx *ctx, dt_tensor *x, int start_dim)
{
    if (!op_input_ok(ctx, "flatten", x, "input"))
        return NULL;
    if (x->ndim == 0)
        return dt_reshape(ctx, x, 1, (int64_t[]){1});
    if (!norm_dim(ctx, "flatten", x, &start_dim))
        return NULL;
    int64_t shape[DT_MAX_DIMS];
    for (int i = 0; i < start_dim; i++)
        shape[i] = x->shape[i];
    shape[start_dim] = shape_numel(x->ndim - start_dim, x->shape + start_dim);
    return dt_reshape(ctx, x, start_dim + 1, shape);
}

/* What each op keeps for its backward (its node's state, tape_record_op). */
typedef struct transpose_state { int d0, d1; } transpose_state;

static dt_status transpose_backward(dt_ctx *ctx, dt_node *n)
{
    dt_tensor *x = n->in[0], *y = n->out;
    const transpose_state *st = n->state;
    int d0 = st->d0, d1 = st->d1;
    int acc;
    float *gx = grad_target(ctx, x, &acc);
    if (!gx)
        return ctx->last_status;
    int64_t gs[DT_MAX_DIMS], xs[DT_MAX_DIMS];
    contiguous_strides(y->ndim, y->shape, gs);   /* gy is contiguous in y's shape */
    int64_t t = gs[d0];
    gs[d0] = gs[d1];
    gs[d1] = t;                                   /* ... read in x's index order */
    contiguous_strides(x->ndim, x->shape, xs);
    BE(ctx)->copy_strided(BEI(ctx), x->ndim, x->shape, 4, gx, xs, FP(y->grad), gs, acc);
    return DT_OK;
}

/* x (.., a, .., b, ..) -> view (.., b, .., a, ..) */
dt_tensor *dt_transpose(dt_ctx *ctx, dt_tensor *x, int d0, int d1)
{
    if (!op_input_ok(ctx, "transpose", x, "input"))
        return NULL;
    if (!norm_dim(ctx, "transpose", x, &d0) || !norm_dim(ctx, "transpose", x, &d1))
        return NULL;
    int64_t shape[DT_MAX_DIMS], stride[DT_MAX_DIMS];
    memcpy(shape, x->shape, sizeof shape);
    memcpy(stride, x->stride, sizeof stride);
    shape[d0] = x->shape[d1];
    shape[d1] = x->shape[d0];
    stride[d0] = x->stride[d1];
    stride[d1] = x->stride[d0];
    dt_tensor *y = tensor_view_as(ctx, x, x->ndim, shape, stride, NULL);
    if (!y)
        return NULL;
    if (tape_tracks(ctx, x) &&
        !tape_record_op(ctx, "transpose", transpose_backward, y, x, NULL, NULL,
                        &(transpose_state){d0, d1}, sizeof(transpose_state)))
        return NULL;
    return y;
}

typedef struct permute_state { int dims[DT_MAX_DIMS]; } permute_state;   /* y's dim i is x's dims[i] */

static dt_status permute_backward(dt_ctx *ctx, dt_node *n)
{
    const permute_state *st = n->state;
    dt_tensor *x = n->in[0], *y = n->out;
    int acc;
    float *gx = grad_target(ctx, x, &acc);
    if (!gx)
        return ctx->last_status;
    int64_t gy[DT_MAX_DIMS], gs[DT_MAX_DIMS], xs[DT_MAX_DIMS];
    contiguous_strides(y->ndim, y->shape, gy);   /* gy is contiguous in y's shape */
    for (int i = 0; i < y->ndim; i++)
        gs[st->dims[i]] = gy[i];                  /* x's dim dims[i] is y's dim i */
    contiguous_strides(x->ndim, x->shape, xs);
    BE(ctx)->copy_strided(BEI(ctx), x->ndim, x->shape, 4, gx, xs, FP(y->grad), gs, acc);
    return DT_OK;
}

/* x -> view with dim i = x's dim dims[i] (a permutation of 0..ndim-1) */
dt_tensor *dt_permute(dt_ctx *ctx, dt_tensor *x, int ndim, const int *dims)
{
    if (!op_input_ok(ctx, "permute", x, "input"))
        return NULL;
    int seen[DT_MAX_DIMS] = {0}, ok = dims && ndim == x->ndim;
    for (int i = 0; ok && i < ndim; i++) {
        ok = dims[i] >= 0 && dims[i] < ndim && !seen[dims[i]];
        if (ok)
            seen[dims[i]] = 1;
    }
    if (!ok) {
        char sx[96];
        set_error(ctx, DT_EINVAL, "permute: %d dims for input %s: need a permutation of its %d "
                  "dims", ndim, SHAPE(x, sx), x->ndim);
        return NULL;
    }
    permute_state st;
    memset(&st, 0, sizeof st);
    int64_t shape[DT_MAX_DIMS], stride[DT_MAX_DIMS];
    for (int i = 0; i < ndim; i++) {
        shape[i] = x->shape[dims[i]];
        stride[i] = x->stride[dims[i]];
        st.dims[i] = dims[i];
    }
    dt_tensor *y = tensor_view_as(ctx, x, ndim, shape, stride, NULL);
    if (!y)
        return NULL;
    if (tape_tracks(ctx, x) &&
        !tape_record_op(ctx, "permute", permute_backward, y, x, NULL, NULL, &st, sizeof st))
        return NULL;
    return y;
}

typedef struct slice_state { int dim; int64_t start; } slice_state;

static dt_status slice_backward(dt_ctx *ctx, dt_node *n)
{
    dt_tensor *x = n->in[0], *y = n->out;
    const slice_state *st = n->state;
    int dim = st->dim;
    float *gx = grad_target_zeroed(ctx, x);
    if (!gx)
        return ctx->last_status;
    int64_t xs[DT_MAX_DIMS], ys[DT_MAX_DIMS];
    contiguous_strides(x->ndim, x->shape, xs);
    contiguous_strides(y->ndim, y->shape, ys);
    BE(ctx)->copy_strided(BEI(ctx), y->ndim, y->shape, 4, gx + st->start * xs[dim], xs,
                          FP(y->grad), ys, 1);
    return DT_OK;
}

/* x (.., D, ..) -> view (.., end-start, ..) */
dt_tensor *dt_slice(dt_ctx *ctx, dt_tensor *x, int dim, int64_t start, int64_t end)
{
    if (!op_input_ok(ctx, "slice", x, "input") || !norm_dim(ctx, "slice", x, &dim))
        return NULL;
    if (start < 0 || end < start || end > x->shape[dim]) {
        set_error(ctx, DT_EINVAL, "slice: [%lld, %lld) is outside dimension %d of size %lld",
                  (long long)start, (long long)end, dim, (long long)x->shape[dim]);
        return NULL;
    }
    int64_t shape[DT_MAX_DIMS];
    memcpy(shape, x->shape, sizeof shape);
    shape[dim] = end - start;
    dt_tensor *y = tensor_view_as(ctx, x, x->ndim, shape, x->stride,
                                  (char *)x->data + (size_t)(start * x->stride[dim]) *
                                                        dt_dtype_size(x->dtype));
    if (!y)
        return NULL;
    if (tape_tracks(ctx, x) &&
        !tape_record_op(ctx, "slice", slice_backward, y, x, NULL, NULL,
                        &(slice_state){dim, start}, sizeof(slice_state)))
        return NULL;
    return y;
}

/* any number of inputs, kept aside (also the node's reads, tape_node_reads) */
typedef struct concat_state { dt_tensor **xs; int count, dim; } concat_state;

static dt_status op_concat_backward(dt_ctx *ctx, dt_node *n)
{
    const concat_state *st = n->state;
    dt_tensor *y = n->out, **xs = st->xs;
    int count = st->count, dim = st->dim;
    int64_t ys[DT_MAX_DIMS], off = 0;
    contiguous_strides(y->ndim, y->shape, ys);
    for (int i = 0; i < count; i++) {
        dt_tensor *x = xs[i];
        if (grad_needed(x)) {
            int acc;
            float *gx = grad_target(ctx, x, &acc);
            if (!gx)
                return ctx->last_status;
            int64_t cs[DT_MAX_DIMS];
            contiguous_strides(x->ndim, x->shape, cs);
            BE(ctx)->copy_strided(BEI(ctx), x->ndim, x->shape, 4, gx, cs,
                                  FP(y->grad) + off * ys[dim], ys, acc);
        }
        off += x->shape[dim];
    }
    return DT_OK;
}

/* xs[i] (.., d_i, ..) -> (.., sum d_i, ..) */
dt_tensor *dt_concat(dt_ctx *ctx, dt_tensor *const *xs, int n, int dim)
{
    if (!ctx_ok(ctx))
        return NULL;
    if (!xs || n < 1) {
        set_error(ctx, DT_EINVAL, "concat: needs at least one tensor");
        return NULL;
    }
    for (int i = 0; i < n; i++)
        if (!op_input_ok(ctx, "concat", xs[i], "an input"))
            return NULL;
    dt_tensor *x0 = xs[0];
    if (!norm_dim(ctx, "concat", x0, &dim))
        return NULL;
    int64_t shape[DT_MAX_DIMS];
    memcpy(shape, x0->shape, sizeof shape);
    shape[dim] = 0;
    int track = 0;
    for (int i = 0; i < n; i++) {
        dt_tensor *x = xs[i];
        int ok = x->ndim == x0->ndim && x->dtype == x0->dtype;
        for (int d = 0; ok && d < x->ndim; d++)
            ok = d == dim || x->shape[d] == x0->shape[d];
        if (!ok) {
            char s0[96], si[96];
            set_error(ctx, DT_EINVAL, "concat: input %d is %s %s, input 0 is %s %s (dim %d)", i,
                      dt_dtype_name(x->dtype), SHAPE(x, si), dt_dtype_name(x0->dtype),
                      SHAPE(x0, s0), dim);
            return NULL;
        }
        shape[dim] += x->shape[dim];
        track |= tape_tracks(ctx, x);
    }
    dt_tensor *y = tensor_step_new(ctx, x0->dtype, x0->ndim, shape);
    if (!y)
        return NULL;
    size_t es = dt_dtype_size(x0->dtype);
    int64_t off = 0;
    for (int i = 0; i < n; i++) {
        tensor_materialize(xs[i]);
        BE(ctx)->copy_strided(BEI(ctx), xs[i]->ndim, xs[i]->shape, es,
                              (char *)y->data + (size_t)(off * y->stride[dim]) * es, y->stride,
                              xs[i]->data, xs[i]->stride, 0);
        off += xs[i]->shape[dim];
    }
    if (track) {
        dt_tensor **saved = arena_alloc(ctx, ctx->cur_host, sizeof(dt_tensor *) * (size_t)n);
        if (!saved) {
            set_error(ctx, DT_ENOMEM, "concat: out of memory for the tape");
            return NULL;
        }
        memcpy(saved, xs, sizeof(dt_tensor *) * (size_t)n);
        dt_node *nd = tape_record_op(ctx, "concat", op_concat_backward, y, NULL, NULL, NULL,
                                     &(concat_state){saved, n, dim}, sizeof(concat_state));
        if (!nd)
            return NULL;
        tape_set_reads(nd, saved, n);
    }
    return y;
}

/* --- matmul and linear ---------------------------------------------- */

/* Floats an operand of `batch` GEMMs spans: op(X) is rows x cols, stored
 * (rows, cols) with leading dimension ld, or (cols, rows) when t. */
static int64_t operand_extent(int t, int64_t rows, int64_t cols, int64_t ld, int64_t batch,
                              int64_t stride)
{
    int64_t r = t ? cols : rows, c = t ? rows : cols;
    if (r < 1 || c < 1)
        return 0;
    return (r - 1) * ld + c + (batch > 1 ? (batch - 1) * stride : 0);
}

/* Every GEMM of the ops goes through here.  At a reduced precision
 * (autocast, dt_ctx_set_autocast) the backend's mixed-precision GEMM runs it; a backend
 * without one gets operands rounded into temporaries and its f32 GEMM,
 * which gives the same numbers: inputs at prec, products summed in f32. */
DT_PRIVATE dt_status op_gemm(dt_ctx *ctx, dt_precision prec, int64_t batch, int ta, int tb,
                             int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                             int64_t lda, int64_t stride_a, const float *b, int64_t ldb,
                             int64_t stride_b, float beta, float *c, int64_t ldc, int64_t stride_c)
{
    if (prec != DT_PREC_F32 && BE(ctx)->gemm_ex) {
        BE(ctx)->gemm_ex(BEI(ctx), prec, batch, ta, tb, m, n, k, alpha, a, lda, stride_a, b, ldb,
                         stride_b, beta, c, ldc, stride_c);
        return DT_OK;
    }
    dt_arena_mark mark = arena_mark(ctx->cur_dev);
    if (prec != DT_PREC_F32) {
        int64_t na = operand_extent(ta, m, k, lda, batch, stride_a);
        int64_t nb = operand_extent(tb, k, n, ldb, batch, stride_b);
        float *ra = op_temp_floats(ctx, na > 0 ? na : 1);
        float *rb = ra ? op_temp_floats(ctx, nb > 0 ? nb : 1) : NULL;
        if (!rb) {
            arena_release(ctx->cur_dev, mark);
            return ctx->last_status;
        }
        if (na > 0)
            BE(ctx)->round_prec(BEI(ctx), prec, na, a, ra);
        if (nb > 0)
            BE(ctx)->round_prec(BEI(ctx), prec, nb, b, rb);
        a = ra;
        b = rb;
    }
    if (batch > 1)
        BE(ctx)->gemm_batched(BEI(ctx), batch, ta, tb, m, n, k, alpha, a, lda, stride_a, b, ldb,
                              stride_b, beta, c, ldc, stride_c);
    else
        BE(ctx)->gemm(BEI(ctx), ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    arena_release(ctx->cur_dev, mark);   /* queued work is stream-ordered before reuse */
    return DT_OK;
}

static int gemm_operand_of(const dt_tensor *x, gemm_operand *g)
{
    int r = x->ndim - 2, c = x->ndim - 1;
    int64_t rows = x->shape[r], cols = x->shape[c], sr = x->stride[r], sc = x->stride[c];
    g->p = (const float *)x->data;
    g->batch_stride = x->ndim == 3 ? x->stride[0] : 0;
    if ((cols == 1 || sc == 1) && (rows == 1 || sr >= cols)) {
        g->t = 0;
        g->ld = rows == 1 ? (cols > 1 ? cols : 1) : sr;
        return g->ld >= 1;
    }
    if ((rows == 1 || sr == 1) && (cols == 1 || sc >= rows)) {
        g->t = 1;
        g->ld = cols == 1 ? (rows > 1 ? rows : 1) : sc;
        return g->ld >= 1;
    }
    return 0;
}

/* y (batch, m, n) = op(a) (batch, m, k) op(b) (batch, k, n) */
typedef struct matmul_state { int trans_a, trans_b; int64_t batch, m, k, n; } matmul_state;

static dt_status matmul_backward(dt_ctx *ctx, dt_node *n)
{
    dt_tensor *a = n->in[0], *b = n->in[1], *y = n->out;
    const matmul_state *st = n->state;
    int trans_a = st->trans_a, trans_b = st->trans_b;
    int64_t batch = st->batch, m = st->m, k = st->k, nn = st->n;
    gemm_operand A, B;
    gemm_operand_of(a, &A);
    gemm_operand_of(b, &B);
    int ta = trans_a ^ A.t, tb = trans_b ^ B.t;
    const float *dc = FP(y->grad);
    if (grad_needed(a)) {
        int acc;
        float *ga = grad_target(ctx, a, &acc);
        if (!ga)
            return ctx->last_status;
        int a_batched = a->ndim == 3;
        for (int64_t i = 0; i < batch; i++) {
            float beta = (acc || (!a_batched && i > 0)) ? 1.0f : 0.0f;
            float *gi = ga + (a_batched ? i * m * k : 0);
            const float *bi = B.p + i * B.batch_stride, *ci = dc + i * m * nn;
            if (!trans_a)  /* dA (M,K) = dC (M,N) op(b)^T */
                GEMM(ctx, n->prec, 0, !tb, m, k, nn, 1.0f, ci, nn, bi, B.ld, beta, gi, k);
            else           /* dA (K,M) = op(b) (K,N) dC^T */
                GEMM(ctx, n->prec, tb, 1, k, m, nn, 1.0f, bi, B.ld, ci, nn, beta, gi, m);
        }
    }
    if (grad_needed(b)) {
        int acc;
        float *gb = grad_target(ctx, b, &acc);
        if (!gb)
            return ctx->last_status;
        int b_batched = b->ndim == 3;
        for (int64_t i = 0; i < batch; i++) {
            float beta = (acc || (!b_batched && i > 0)) ? 1.0f : 0.0f;
            float *gi = gb + (b_batched ? i * k * nn : 0);
            const float *ai = A.p + i * A.batch_stride, *ci = dc + i * m * nn;
            if (!trans_b)  /* dB (K,N) = op(a)^T dC */
                GEMM(ctx, n->prec, !ta, 0, k, nn, m, 1.0f, ai, A.ld, ci, nn, beta, gi, nn);
            else           /* dB (N,K) = dC^T op(a) */
                GEMM(ctx, n->prec, 1, ta, nn, k, m, 1.0f, ci, nn, ai, A.ld, beta, gi, k);
        }
    }
    return DT_OK;
}

/* a (M,K) b (K,N) -> (M,N); a (B,M,K) with b (B,K,N) or (K,N) -> (B,M,N);
 * trans_* read that operand transposed. */
dt_tensor *dt_matmul(dt_ctx *ctx, dt_tensor *a, dt_tensor *b, int trans_a, int trans_b)
{
    if (!op_f32_ok(ctx, "matmul", a, "a") || !op_f32_ok(ctx, "matmul", b, "b"))
        return NULL;
    char sa[96], sb[96];
    if (a->ndim < 2 || a->ndim > 3 || b->ndim < 2 || b->ndim > 3 ||
        (a->ndim == 3 && b->ndim == 3 && a->shape[0] != b->shape[0])) {
        set_error(ctx, DT_EINVAL, "matmul: a %s and b %s: need 2-D or 3-D with equal batch",
                  SHAPE(a, sa), SHAPE(b, sb));
        return NULL;
    }
    int ra = a->ndim - 2, rb = b->ndim - 2;
    int64_t m = trans_a ? a->shape[ra + 1] : a->shape[ra];
    int64_t k = trans_a ? a->shape[ra] : a->shape[ra + 1];
    int64_t kb = trans_b ? b->shape[rb + 1] : b->shape[rb];
    int64_t nn = trans_b ? b->shape[rb] : b->shape[rb + 1];
    if (k != kb) {
        set_error(ctx, DT_EINVAL, "matmul: inner dimensions differ: a %s%s has %lld, b %s%s has %lld",
                  SHAPE(a, sa), trans_a ? "^T" : "", (long long)k, SHAPE(b, sb),
                  trans_b ? "^T" : "", (long long)kb);
        return NULL;
    }
    gemm_operand A, B;
    if (!gemm_operand_of(a, &A)) {
        if (!(a = dt_contiguous(ctx, a)))
            return NULL;
        gemm_operand_of(a, &A);
    }
    if (!gemm_operand_of(b, &B)) {
        if (!(b = dt_contiguous(ctx, b)))
            return NULL;
        gemm_operand_of(b, &B);
    }
    tensor_materialize(a);
    tensor_materialize(b);
    int64_t batch = a->ndim == 3 ? a->shape[0] : (b->ndim == 3 ? b->shape[0] : 1);
    int64_t shape[3] = {batch, m, nn};
    int batched = a->ndim == 3 || b->ndim == 3;
    dt_tensor *y = batched ? tensor_step_new(ctx, DT_F32, 3, shape)
                           : tensor_step_new(ctx, DT_F32, 2, shape + 1);
    if (!y)
        return NULL;
    int ta = trans_a ^ A.t, tb = trans_b ^ B.t;
    if (op_gemm(ctx, ctx->autocast, batched ? batch : 1, ta, tb, m, nn, k, 1.0f, A.p, A.ld,
                A.batch_stride, B.p, B.ld, B.batch_stride, 0.0f, FP(y), nn, m * nn) != DT_OK)
        return NULL;
    if ((tape_tracks(ctx, a) || tape_tracks(ctx, b)) &&
        !tape_record_op(ctx, "matmul", matmul_backward, y, a, b, NULL,
                        &(matmul_state){trans_a, trans_b, batch, m, k, nn}, sizeof(matmul_state)))
        return NULL;
    return y;
}

typedef struct linear_state { int64_t rows, in, out; } linear_state;

static dt_status linear_backward(dt_ctx *ctx, dt_node *n)
{
    dt_tensor *x = n->in[0], *w = n->in[1], *b = n->n_in > 2 ? n->in[2] : NULL;
    const linear_state *st = n->state;
    int64_t rows = st->rows, in = st->in, out = st->out;
    const float *dy = FP(n->out->grad);
    int acc;
    if (grad_needed(x)) {          /* dx (N,In) = dy (N,Out) w (Out,In) */
        float *gx = grad_target(ctx, x, &acc);
        if (!gx)
            return ctx->last_status;
        GEMM(ctx, n->prec, 0, 0, rows, in, out, 1.0f, dy, out, FP(w), in, acc ? 1.0f : 0.0f,
             gx, in);
    }
    /* Under DDP a large weight's gradient is made in row blocks, each sent
     * while the next computes (src/ddp.c); the bias goes first so it never holds
     * back the bucket it shares with the weight's first rows. */
    int64_t step = grad_needed(w) && ctx->hook_user ? ctx->grad_hooks->grad_chunk_rows(ctx->hook_user, w, out, in)
                                             : 0;
    if (b && grad_needed(b)) {     /* db (Out) = sum over N of dy */
        float *gb = grad_target(ctx, b, &acc);
        if (!gb)
            return ctx->last_status;
        BE(ctx)->bias_grad(BEI(ctx), rows, out, 1, dy, gb, acc);
        if (step > 0)
            ctx->grad_hooks->grad_rows_done(ctx->hook_user, b, out, 1);
    }
    if (grad_needed(w)) {          /* dw (Out,In) = dy^T (Out,N) x (N,In) */
        float *gw = grad_target(ctx, w, &acc);
        if (!gw)
            return ctx->last_status;
        for (int64_t r0 = 0; r0 < out; r0 += step > 0 ? step : out) {
            int64_t r1 = step > 0 && r0 + step < out ? r0 + step : out;
            GEMM(ctx, n->prec, 1, 0, r1 - r0, in, rows, 1.0f, dy + r0, out, FP(x), in,
                 acc ? 1.0f : 0.0f, gw + r0 * in, in);
            if (step > 0)
                ctx->grad_hooks->grad_rows_done(ctx->hook_user, w, r1, in);
        }
    }
    return DT_OK;
}

/* x (..., In), w (Out, In), b (Out) or NULL -> (..., Out) = x w^T + b */
dt_tensor *dt_linear(dt_ctx *ctx, dt_tensor *x, dt_tensor *w, dt_tensor *b)
{
    if (!op_f32_ok(ctx, "linear", x, "input") || !op_f32_ok(ctx, "linear", w, "weight"))
        return NULL;
    if (b && !op_f32_ok(ctx, "linear", b, "bias"))
        return NULL;
    char sx[96], sw[96];
    if (w->ndim != 2 || x->ndim < 1 || x->shape[x->ndim - 1] != w->shape[1]) {
        set_error(ctx, DT_EINVAL, "linear: input %s does not match weight %s (want (..., %lld))",
                  SHAPE(x, sx), SHAPE(w, sw), w->ndim == 2 ? (long long)w->shape[1] : -1LL);
        return NULL;
    }
    if (b && (b->ndim != 1 || b->shape[0] != w->shape[0])) {
        set_error(ctx, DT_EINVAL, "linear: bias %s does not match weight %s", SHAPE(b, sx),
                  SHAPE(w, sw));
        return NULL;
    }
    if (!(x = op_need_contig(ctx, x)) || !(w = op_need_contig(ctx, w)) || (b && !(b = op_need_contig(ctx, b))))
        return NULL;
    tensor_materialize(x);
    tensor_materialize(w);
    int64_t in = w->shape[1], out = w->shape[0];
    int64_t rows = shape_numel(x->ndim - 1, x->shape);
    int64_t shape[DT_MAX_DIMS];
    memcpy(shape, x->shape, sizeof shape);
    shape[x->ndim - 1] = out;
    dt_tensor *y = tensor_step_new(ctx, DT_F32, x->ndim, shape);
    if (!y)
        return NULL;
    if (op_gemm(ctx, ctx->autocast, 1, 0, 1, rows, out, in, 1.0f, FP(x), in, 0, FP(w), in, 0,
                0.0f, FP(y), out, 0) != DT_OK)
        return NULL;
    if (b) {
        tensor_materialize(b);
        BE(ctx)->bias_add(BEI(ctx), rows, out, 1, FP(b), FP(y));
    }
    if ((tape_tracks(ctx, x) || tape_tracks(ctx, w) || tape_tracks(ctx, b)) &&
        !tape_record_op(ctx, "linear", linear_backward, y, x, w, b,
                        &(linear_state){rows, in, out}, sizeof(linear_state)))
        return NULL;
    return y;
}

/* --- elementwise binary ops with broadcasting ----------------------- */

/* Broadcast a and b (aligned at the last dim).  Fills the output shape and
 * each input's strides in the output's index space (0 where broadcast). */
static int broadcast(const dt_tensor *a, const dt_tensor *b, int *ndim, int64_t *shape,
                     int64_t *sa, int64_t *sb)
{
    int nd = a->ndim > b->ndim ? a->ndim : b->ndim;
    for (int i = 0; i < nd; i++) {
        int ia = i - (nd - a->ndim), ib = i - (nd - b->ndim);
        int64_t da = ia >= 0 ? a->shape[ia] : 1, db = ib >= 0 ? b->shape[ib] : 1;
        if (da != db && da != 1 && db != 1)
            return 0;
        shape[i] = da == 1 ? db : da;
        sa[i] = (ia >= 0 && da == shape[i]) ? a->stride[ia] : 0;
        sb[i] = (ib >= 0 && db == shape[i]) ? b->stride[ib] : 0;
    }
    *ndim = nd;
    return 1;
}

/* gx (+)= alpha * (src reduced over the dims x was broadcast along); src is
 * contiguous over the output shape. */
static dt_status acc_reduced(dt_ctx *ctx, dt_tensor *x, int nd, const int64_t *shape,
                             const float *src, float alpha)
{
    int64_t nx = shape_numel(x->ndim, x->shape), ny = shape_numel(nd, shape);
    if (nx == ny)
        return op_acc_grad(ctx, x, src, alpha);
    int64_t xs[DT_MAX_DIMS], ds[DT_MAX_DIMS];
    contiguous_strides(x->ndim, x->shape, xs);
    for (int i = 0; i < nd; i++) {
        int ix = i - (nd - x->ndim);
        ds[i] = (ix >= 0 && x->shape[ix] == shape[i]) ? xs[ix] : 0;
    }
    int acc;
    float *gx = grad_target(ctx, x, &acc);
    if (!gx)
        return ctx->last_status;
    if (alpha == 1.0f) {
        BE(ctx)->sum_to(BEI(ctx), nd, shape, src, gx, ds, acc);
        return DT_OK;
    }
    float *tmp = op_temp_floats(ctx, nx);
    if (!tmp)
        return ctx->last_status;
    BE(ctx)->sum_to(BEI(ctx), nd, shape, src, tmp, ds, 0);
    BE(ctx)->axpby(BEI(ctx), nx, alpha, tmp, acc ? 1.0f : 0.0f, gx);
    return DT_OK;
}

/* y = a^b: da = dy b a^(b-1), db = dy y log(a), as torch.pow */
static dt_status pow_backward(dt_ctx *ctx, dt_node *n, int nd, const int64_t *shape,
                              const int64_t *sa, const int64_t *sb, const int64_t *sy, float *tmp)
{
    dt_tensor *a = n->in[0], *b = n->in[1], *y = n->out;
    const float *gy = FP(y->grad);
    dt_status s = DT_OK;
    if (grad_needed(a)) {
        int64_t nb = dt_tensor_numel(b), one_s[1] = {0}, flat[1] = {nb}, unit[1] = {1};
        float *bm1 = op_temp_floats(ctx, nb), *one = op_temp_floats(ctx, 1);
        if (!bm1 || !one)
            return ctx->last_status;
        BE(ctx)->fill(BEI(ctx), 1, 1.0f, one);
        BE(ctx)->binary(BEI(ctx), DT_BIN_SUB, 1, flat, FP(b), unit, one, one_s, bm1);   /* b - 1 */
        BE(ctx)->binary(BEI(ctx), DT_BIN_POW, nd, shape, FP(a), sa, bm1, sb, tmp);      /* a^(b-1) */
        BE(ctx)->binary(BEI(ctx), DT_BIN_MUL, nd, shape, tmp, sy, FP(b), sb, tmp);
        BE(ctx)->binary(BEI(ctx), DT_BIN_MUL, nd, shape, tmp, sy, gy, sy, tmp);
        if ((s = acc_reduced(ctx, a, nd, shape, tmp, 1.0f)) != DT_OK)
            return s;
    }
    if (grad_needed(b)) {
        int64_t na = dt_tensor_numel(a);
        float *la = op_temp_floats(ctx, na);
        if (!la)
            return ctx->last_status;
        BE(ctx)->unary(BEI(ctx), DT_UNARY_LOG, na, FP(a), la);                        /* log a */
        BE(ctx)->binary(BEI(ctx), DT_BIN_MUL, nd, shape, gy, sy, FP(y), sy, tmp);
        BE(ctx)->binary(BEI(ctx), DT_BIN_MUL, nd, shape, tmp, sy, la, sa, tmp);
        s = acc_reduced(ctx, b, nd, shape, tmp, 1.0f);
    }
    return s;
}

typedef struct binary_state { dt_binary_op op; } binary_state;

static dt_status binary_backward(dt_ctx *ctx, dt_node *n)
{
    dt_tensor *a = n->in[0], *b = n->in[1], *y = n->out;
    dt_binary_op op = ((const binary_state *)n->state)->op;
    int nd;
    int64_t shape[DT_MAX_DIMS], sa[DT_MAX_DIMS], sb[DT_MAX_DIMS], sy[DT_MAX_DIMS];
    broadcast(a, b, &nd, shape, sa, sb);
    contiguous_strides(nd, shape, sy);
    const float *gy = FP(y->grad);
    int64_t ny = shape_numel(nd, shape);
    dt_status s = DT_OK;
    if (op == DT_BIN_ADD || op == DT_BIN_SUB) {
        if (grad_needed(a))
            s = acc_reduced(ctx, a, nd, shape, gy, 1.0f);
        if (s == DT_OK && grad_needed(b))
            s = acc_reduced(ctx, b, nd, shape, gy, op == DT_BIN_SUB ? -1.0f : 1.0f);
        return s;
    }
    float *tmp = op_temp_floats(ctx, ny);
    if (!tmp)
        return ctx->last_status;
    if (op == DT_BIN_MUL) {
        if (grad_needed(a)) {   /* da = dy * b */
            BE(ctx)->binary(BEI(ctx), DT_BIN_MUL, nd, shape, gy, sy, FP(b), sb, tmp);
            if ((s = acc_reduced(ctx, a, nd, shape, tmp, 1.0f)) != DT_OK)
                return s;
        }
        if (grad_needed(b)) {   /* db = dy * a */
            BE(ctx)->binary(BEI(ctx), DT_BIN_MUL, nd, shape, gy, sy, FP(a), sa, tmp);
            s = acc_reduced(ctx, b, nd, shape, tmp, 1.0f);
        }
        return s;
    }
    if (op == DT_BIN_KEEP || op == DT_BIN_DROP) {   /* the mask b has no gradient */
        if (grad_needed(a)) {
            BE(ctx)->binary(BEI(ctx), op, nd, shape, gy, sy, FP(b), sb, tmp);
            s = acc_reduced(ctx, a, nd, shape, tmp, 1.0f);
        }
        return s;
    }
    if (op == DT_BIN_POW)
        return pow_backward(ctx, n, nd, shape, sa, sb, sy, tmp);
    /* DIV: da = dy / b, db = -dy * y / b */
    if (grad_needed(a)) {
        BE(ctx)->binary(BEI(ctx), DT_BIN_DIV, nd, shape, gy, sy, FP(b), sb, tmp);
        if ((s = acc_reduced(ctx, a, nd, shape, tmp, 1.0f)) != DT_OK)
            return s;
    }
    if (grad_needed(b)) {
        BE(ctx)->binary(BEI(ctx), DT_BIN_MUL, nd, shape, gy, sy, FP(y), sy, tmp);
        BE(ctx)->binary(BEI(ctx), DT_BIN_DIV, nd, shape, tmp, sy, FP(b), sb, tmp);
        s = acc_reduced(ctx, b, nd, shape, tmp, -1.0f);
    }
    return s;
}

static dt_tensor *binary_op(dt_ctx *ctx, const char *name, dt_binary_op op, dt_tensor *a,
                            dt_tensor *b)
{
    if (!op_f32_ok(ctx, name, a, "a") || !op_f32_ok(ctx, name, b, "b"))
        return NULL;
    int nd;
    int64_t shape[DT_MAX_DIMS], sa[DT_MAX_DIMS], sb[DT_MAX_DIMS];
    if (!broadcast(a, b, &nd, shape, sa, sb)) {
        char s1[96], s2[96];
        set_error(ctx, DT_EINVAL, "%s: shapes %s and %s do not broadcast", name, SHAPE(a, s1),
                  SHAPE(b, s2));
        return NULL;
    }
    tensor_materialize(a);
    tensor_materialize(b);
    dt_tensor *y = tensor_step_new(ctx, DT_F32, nd, shape);
    if (!y)
        return NULL;
    BE(ctx)->binary(BEI(ctx), op, nd, shape, FP(a), sa, FP(b), sb, FP(y));
    if ((tape_tracks(ctx, a) || tape_tracks(ctx, b)) &&
        !tape_record_op(ctx, name, binary_backward, y, a, b, NULL,
                        &(binary_state){op}, sizeof(binary_state)))
        return NULL;
    return y;
}

dt_tensor *dt_add(dt_ctx *ctx, dt_tensor *a, dt_tensor *b) { return binary_op(ctx, "add", DT_BIN_ADD, a, b); }

/* a, b made contiguous first: pow's backward takes log(a) and b - 1
 * elementwise in their own layouts */
dt_tensor *dt_pow(dt_ctx *ctx, dt_tensor *a, dt_tensor *b)
{
    if (!op_f32_ok(ctx, "pow", a, "a") || !op_f32_ok(ctx, "pow", b, "b") ||
        !(a = op_need_contig(ctx, a)) || !(b = op_need_contig(ctx, b)))
        return NULL;
    return binary_op(ctx, "pow", DT_BIN_POW, a, b);
}

/* a scalar as a (1) step tensor */
static dt_tensor *scalar_tensor(dt_ctx *ctx, float v)
{
    int64_t one[1] = {1};
    dt_tensor *t = tensor_step_new(ctx, DT_F32, 1, one);
    if (t)
        BE(ctx)->fill(BEI(ctx), 1, v, FP(t));
    return t;
}

dt_tensor *dt_pow_scalar(dt_ctx *ctx, dt_tensor *x, float p)
{
    dt_tensor *e = op_input_ok(ctx, "pow", x, "x") ? scalar_tensor(ctx, p) : NULL;
    return e ? dt_pow(ctx, x, e) : NULL;
}

/* cond != 0 ? a : b elementwise, broadcasting; selects, so an infinite
 * branch not taken leaves no NaN.  cond gets no gradient. */
dt_tensor *dt_where(dt_ctx *ctx, dt_tensor *cond, dt_tensor *a, dt_tensor *b)
{
    dt_tensor *ka = binary_op(ctx, "where", DT_BIN_KEEP, a, cond);
    dt_tensor *kb = ka ? binary_op(ctx, "where", DT_BIN_DROP, b, cond) : NULL;
    return kb ? dt_add(ctx, ka, kb) : NULL;
}

dt_tensor *dt_masked_fill(dt_ctx *ctx, dt_tensor *x, dt_tensor *mask, float value)
{
    dt_tensor *v = op_input_ok(ctx, "masked_fill", x, "x") ? scalar_tensor(ctx, value) : NULL;
    dt_tensor *kept = v ? binary_op(ctx, "masked_fill", DT_BIN_DROP, x, mask) : NULL;
    dt_tensor *filled = kept ? binary_op(ctx, "masked_fill", DT_BIN_KEEP, v, mask) : NULL;
    return filled ? dt_add(ctx, kept, filled) : NULL;
}
dt_tensor *dt_sub(dt_ctx *ctx, dt_tensor *a, dt_tensor *b) { return binary_op(ctx, "sub", DT_BIN_SUB, a, b); }
dt_tensor *dt_mul(dt_ctx *ctx, dt_tensor *a, dt_tensor *b) { return binary_op(ctx, "mul", DT_BIN_MUL, a, b); }
dt_tensor *dt_div(dt_ctx *ctx, dt_tensor *a, dt_tensor *b) { return binary_op(ctx, "div", DT_BIN_DIV, a, b); }

typedef struct scale_state { float alpha; } scale_state;

static dt_status scale_backward(dt_ctx *ctx, dt_node *n)
{
    float alpha = ((const scale_state *)n->state)->alpha;
    return op_acc_grad(ctx, n->in[0], FP(n->out->grad), alpha);
}

/* x -> s * x */
dt_tensor *dt_scale(dt_ctx *ctx, dt_tensor *x, float s)
{
    if (!op_f32_ok(ctx, "scale", x, "input") || !(x = op_need_contig(ctx, x)))
        return NULL;
    tensor_materialize(x);
    dt_tensor *y = op_like(ctx, x);
    if (!y)
        return NULL;
    BE(ctx)->axpby(BEI(ctx), shape_numel(x->ndim, x->shape), s, FP(x), 0.0f, FP(y));
    if (tape_tracks(ctx, x) &&
        !tape_record_op(ctx, "scale", scale_backward, y, x, NULL, NULL,
                        &(scale_state){s}, sizeof(scale_state)))
        return NULL;
    return y;
}

/* --- reductions ----------------------------------------------------- */

/* gx (+)= broadcast of the scalar g * scale over x */
static dt_status broadcast_scalar_grad(dt_ctx *ctx, dt_tensor *x, const float *g, float scale)
{
    int64_t nx = shape_numel(x->ndim, x->shape);
    const float *src = g;
    if (scale != 1.0f) {
        float *tmp = op_temp_floats(ctx, 1);
        if (!tmp)
            return ctx->last_status;
        BE(ctx)->axpby(BEI(ctx), 1, scale, g, 0.0f, tmp);
        src = tmp;
    }
    int acc;
    float *gx = grad_target(ctx, x, &acc);
    if (!gx)
        return ctx->last_status;
    int64_t one[1] = {nx}, ds[1] = {1}, ss[1] = {0};
    BE(ctx)->copy_strided(BEI(ctx), 1, one, 4, gx, ds, src, ss, acc);
    return DT_OK;
}

typedef struct sum_state { float scale; } sum_state;   /* 1, or 1/n for a mean */

static dt_status sum_backward(dt_ctx *ctx, dt_node *n)
{
    float scale = ((const sum_state *)n->state)->scale;
    return broadcast_scalar_grad(ctx, n->in[0], FP(n->out->grad), scale);
}

static dt_tensor *reduce_all(dt_ctx *ctx, const char *name, dt_tensor *x, int mean)
{
    if (!op_f32_ok(ctx, name, x, "input") || !(x = op_need_contig(ctx, x)))
        return NULL;
    tensor_materialize(x);
    dt_tensor *y = tensor_step_new(ctx, DT_F32, 0, NULL);
    if (!y)
        return NULL;
    int64_t nx = shape_numel(x->ndim, x->shape);
    float scale = mean ? 1.0f / (float)nx : 1.0f;
    BE(ctx)->sum(BEI(ctx), nx, FP(x), FP(y));
    if (mean)
        BE(ctx)->axpby(BEI(ctx), 1, scale, FP(y), 0.0f, FP(y));
    if (tape_tracks(ctx, x) &&
        !tape_record_op(ctx, name, sum_backward, y, x, NULL, NULL,
                        &(sum_state){scale}, sizeof(sum_state)))
        return NULL;
    return y;
}

/* x (any) -> scalar */
dt_tensor *dt_sum(dt_ctx *ctx, dt_tensor *x) { return reduce_all(ctx, "sum", x, 0); }
dt_tensor *dt_mean(dt_ctx *ctx, dt_tensor *x) { return reduce_all(ctx, "mean", x, 1); }

/* x seen as (outer, len, inner), reduced over len; scale 1, or 1/len for a mean */
typedef struct sum_dim_state { int64_t outer, len, inner; float scale; } sum_dim_state;

static dt_status sum_dim_backward(dt_ctx *ctx, dt_node *n)
{
    const sum_dim_state *st = n->state;
    int64_t outer = st->outer, len = st->len, inner = st->inner;
    const float *g = FP(n->out->grad);
    if (st->scale != 1.0f) {
        float *tmp = op_temp_floats(ctx, outer * inner);
        if (!tmp)
            return ctx->last_status;
        BE(ctx)->axpby(BEI(ctx), outer * inner, st->scale, g, 0.0f, tmp);
        g = tmp;
    }
    int acc;
    float *gx = grad_target(ctx, n->in[0], &acc);
    if (!gx)
        return ctx->last_status;
    int64_t shape[3] = {outer, len, inner}, ds[3] = {len * inner, inner, 1}, ss[3] = {inner, 0, 1};
    BE(ctx)->copy_strided(BEI(ctx), 3, shape, 4, gx, ds, g, ss, acc);
    return DT_OK;
}

static dt_tensor *reduce_dim(dt_ctx *ctx, const char *name, dt_tensor *x, int dim, int keepdim,
                             int mean)
{
    if (!op_f32_ok(ctx, name, x, "input") || !norm_dim(ctx, name, x, &dim) ||
        !(x = op_need_contig(ctx, x)))
        return NULL;
    tensor_materialize(x);
    int64_t outer = shape_numel(dim, x->shape), len = x->shape[dim];
    int64_t inner = shape_numel(x->ndim - dim - 1, x->shape + dim + 1);
    int64_t shape[DT_MAX_DIMS];
    int nd = 0;
    for (int i = 0; i < x->ndim; i++) {
        if (i != dim)
            shape[nd++] = x->shape[i];
        else if (keepdim)
            shape[nd++] = 1;
    }
    dt_tensor *y = tensor_step_new(ctx, DT_F32, nd, shape);
    if (!y)
        return NULL;
    BE(ctx)->reduce_axis(BEI(ctx), DT_RED_SUM, outer, len, inner, FP(x), FP(y));
    float scale = mean ? 1.0f / (float)len : 1.0f;
    if (mean)
        BE(ctx)->axpby(BEI(ctx), outer * inner, scale, FP(y), 0.0f, FP(y));
    if (tape_tracks(ctx, x) &&
        !tape_record_op(ctx, name, sum_dim_backward, y, x, NULL, NULL,
                        &(sum_dim_state){outer, len, inner, scale}, sizeof(sum_dim_state)))
        return NULL;
    return y;
}

dt_tensor *dt_sum_dim(dt_ctx *ctx, dt_tensor *x, int dim, int keepdim)
{
    return reduce_dim(ctx, "sum_dim", x, dim, keepdim, 0);
}

dt_tensor *dt_mean_dim(dt_ctx *ctx, dt_tensor *x, int dim, int keepdim)
{
    return reduce_dim(ctx, "mean_dim", x, dim, keepdim, 1);
}

/* --- activations and softmax ---------------------------------------- */

typedef struct unary_state { dt_unary_op op; } unary_state;

static dt_status unary_backward(dt_ctx *ctx, dt_node *n)
{
    dt_tensor *x = n->in[0], *y = n->out;
    int acc;
    float *gx = grad_target(ctx, x, &acc);
    if (!gx)
        return ctx->last_status;
    dt_unary_op op = ((const unary_state *)n->state)->op;
    BE(ctx)->unary_backward(BEI(ctx), op, shape_numel(x->ndim, x->shape), FP(x), FP(y), FP(y->grad),
                            gx, acc);
    return DT_OK;
}

/* x -> op(x), same shape */
static dt_tensor *unary_op(dt_ctx *ctx, const char *name, dt_unary_op op, dt_tensor *x)
{
    if (!op_f32_ok(ctx, name, x, "input") || !(x = op_need_contig(ctx, x)))
        return NULL;
    tensor_materialize(x);
    dt_tensor *y = op_like(ctx, x);
    if (!y)
        return NULL;
    BE(ctx)->unary(BEI(ctx), op, shape_numel(x->ndim, x->shape), FP(x), FP(y));
    if (tape_tracks(ctx, x) &&
        !tape_record_op(ctx, name, unary_backward, y, x, NULL, NULL,
                        &(unary_state){op}, sizeof(unary_state)))
        return NULL;
    return y;
}

dt_tensor *dt_relu(dt_ctx *ctx, dt_tensor *x) { return unary_op(ctx, "relu", DT_UNARY_RELU, x); }
dt_tensor *dt_gelu(dt_ctx *ctx, dt_tensor *x) { return unary_op(ctx, "gelu", DT_UNARY_GELU, x); }
dt_tensor *dt_tanh(dt_ctx *ctx, dt_tensor *x) { return unary_op(ctx, "tanh", DT_UNARY_TANH, x); }
dt_tensor *dt_sigmoid(dt_ctx *ctx, dt_tensor *x) { return unary_op(ctx, "sigmoid", DT_UNARY_SIGMOID, x); }
dt_tensor *dt_gelu_tanh(dt_ctx *ctx, dt_tensor *x)
{
    return unary_op(ctx, "gelu_tanh", DT_UNARY_GELU_TANH, x);
}
dt_tensor *dt_exp(dt_ctx *ctx, dt_tensor *x) { return unary_op(ctx, "exp", DT_UNARY_EXP, x); }
dt_tensor *dt_log(dt_ctx *ctx, dt_tensor *x) { return unary_op(ctx, "log", DT_UNARY_LOG, x); }
dt_tensor *dt_sqrt(dt_ctx *ctx, dt_tensor *x) { return unary_op(ctx, "sqrt", DT_UNARY_SQRT, x); }

/* x seen as (outer, len, inner), softmax over len; log: log_softmax */
typedef struct softmax_state { int64_t outer, len, inner; int log; } softmax_state;

static dt_status softmax_backward(dt_ctx *ctx, dt_node *n)
{
    int acc;
    float *gx = grad_target(ctx, n->in[0], &acc);
    if (!gx)
        return ctx->last_status;
    const softmax_state *st = n->state;
    int64_t outer = st->outer, len = st->len, inner = st->inner;
    int log = st->log;
    BE(ctx)->softmax_backward(BEI(ctx), outer, len, inner, FP(n->out), FP(n->out->grad), gx, log,
                              acc);
    return DT_OK;
}

/* x (.., L, ..) -> softmax along dim L */
static dt_tensor *softmax_op(dt_ctx *ctx, const char *name, dt_tensor *x, int dim, int log)
{
    if (!op_f32_ok(ctx, name, x, "input") || !norm_dim(ctx, name, x, &dim) ||
        !(x = op_need_contig(ctx, x)))
        return NULL;
    tensor_materialize(x);
    int64_t outer = shape_numel(dim, x->shape), len = x->shape[dim];
    int64_t inner = shape_numel(x->ndim - dim - 1, x->shape + dim + 1);
    dt_tensor *y = op_like(ctx, x);
    if (!y)
        return NULL;
    BE(ctx)->softmax(BEI(ctx), outer, len, inner, FP(x), FP(y), log);
    if (tape_tracks(ctx, x) &&
        !tape_record_op(ctx, name, softmax_backward, y, x, NULL, NULL,
                        &(softmax_state){outer, len, inner, log}, sizeof(softmax_state)))
        return NULL;
    return y;
}

dt_tensor *dt_softmax(dt_ctx *ctx, dt_tensor *x, int dim) { return softmax_op(ctx, "softmax", x, dim, 0); }
dt_tensor *dt_log_softmax(dt_ctx *ctx, dt_tensor *x, int dim) { return softmax_op(ctx, "log_softmax", x, dim, 1); }

/* --- losses ----------------------------------------------------------- */

/* row_stats: each row's max and 1/sum from the forward (2 floats a row,
 * not the (rows, classes) softmax: backward rebuilds it from the logits);
 * kept: the rows not ignored (the mean's divisor) */
typedef struct xent_state { int64_t rows, classes, ignore, kept; const float *row_stats; } xent_state;

static dt_status xent_backward(dt_ctx *ctx, dt_node *n)
{
    int acc;
    float *gx = grad_target(ctx, n->in[0], &acc);
    if (!gx)
        return ctx->last_status;
    const xent_state *st = n->state;
    int64_t rows = st->rows, classes = st->classes, ignore = st->ignore, kept = st->kept;
    BE(ctx)->xent_backward(BEI(ctx), rows, classes, FP(n->in[0]), st->row_stats, IP(n->in[1]),
                           ignore, kept, FP(n->out->grad), gx, acc);
    return DT_OK;
}

/* Labels that are not `ignore`: counted on the host (the backends divide
 * by it; a copy of n ints, where the label check already waits anyway). */
static int64_t xent_kept(dt_ctx *ctx, const dt_tensor *labels, int64_t n, int64_t ignore)
{
    if (ignore == DT_XENT_KEEP_ALL)
        return n;
    const int32_t *h = IP(labels);
    int32_t *copy = NULL;
    if (!BE(ctx)->host_visible) {
        if (!(copy = host_alloc(ctx, sizeof *copy * (size_t)n))) {
            set_error(ctx, DT_ENOMEM, "cross_entropy: out of memory");
            return -1;
        }
        BE(ctx)->to_host(BEI(ctx), copy, IP(labels), sizeof *copy * (size_t)n);
        h = copy;
    }
    int64_t kept = 0;
    for (int64_t i = 0; i < n; i++)
        kept += h[i] != ignore;
    host_free(ctx, copy);
    return kept;
}

/* logits (..., C) f32, labels (...) i32 of the same leading shape -> the
 * mean over the labels that are not `ignore` of -log softmax[label] */
static dt_tensor *xent_op(dt_ctx *ctx, dt_tensor *logits, dt_tensor *labels, int64_t ignore)
{
    if (!op_f32_ok(ctx, "cross_entropy", logits, "logits") ||
        !op_input_ok(ctx, "cross_entropy", labels, "labels"))
        return NULL;
    char s1[96], s2[96];
    if (labels->dtype != DT_I32) {
        set_error(ctx, DT_EINVAL, "cross_entropy: labels are %s, need i32",
                  dt_dtype_name(labels->dtype));
        return NULL;
    }
    int same = logits->ndim >= 2 && labels->ndim == logits->ndim - 1;
    for (int d = 0; same && d < labels->ndim; d++)
        same = labels->shape[d] == logits->shape[d];
    if (!same || dt_tensor_numel(logits) == 0) {
        set_error(ctx, DT_EINVAL, "cross_entropy: logits %s and labels %s: need (..., C) and (...), "
                  "not empty", SHAPE(logits, s1), SHAPE(labels, s2));
        return NULL;
    }
    if (!(logits = op_need_contig(ctx, logits)) || !(labels = op_need_contig(ctx, labels)))
        return NULL;
    tensor_materialize(logits);
    tensor_materialize(labels);
    int64_t c = logits->shape[logits->ndim - 1], n = dt_tensor_numel(labels);
    int64_t kept = xent_kept(ctx, labels, n, ignore);
    float *row_stats = kept >= 0 ? op_temp_floats(ctx, 2 * n) : NULL;
    dt_tensor *y = row_stats ? tensor_step_new(ctx, DT_F32, 0, NULL) : NULL;
    if (!y)
        return NULL;
    int64_t bad = BE(ctx)->xent_forward(BEI(ctx), n, c, FP(logits), IP(labels), ignore, kept,
                                        row_stats, FP(y));
    if (be_fault(ctx, "cross_entropy") != DT_OK)
        return NULL;
    if (bad >= 0) {
        int32_t v = 0;
        BE(ctx)->to_host(BEI(ctx), &v, IP(labels) + bad, sizeof v);
        set_error(ctx, DT_EINVAL, "cross_entropy: label %d at index %lld is outside [0, %lld)",
                  (int)v, (long long)bad, (long long)c);
        return NULL;
    }
    if (tape_tracks(ctx, logits) &&
        !tape_record_op(ctx, "cross_entropy", xent_backward, y, logits, labels, NULL,
                        &(xent_state){n, c, ignore, kept, row_stats}, sizeof(xent_state)))
        return NULL;
    return y;
}

dt_tensor *dt_cross_entropy(dt_ctx *ctx, dt_tensor *logits, dt_tensor *labels)
{
    return xent_op(ctx, logits, labels, DT_XENT_KEEP_ALL);
}

dt_tensor *dt_cross_entropy_ignore(dt_ctx *ctx, dt_tensor *logits, dt_tensor *labels,
                                   int ignore_index)
{
    return xent_op(ctx, logits, labels, ignore_index);
}

typedef struct mse_state { const float *diff; } mse_state;   /* pred - target, kept by the forward */

static dt_status mse_backward(dt_ctx *ctx, dt_node *n)
{
    dt_tensor *p = n->in[0], *t = n->in[1];
    int64_t cnt = shape_numel(p->ndim, p->shape);
    float *tmp = op_temp_floats(ctx, cnt);
    if (!tmp)
        return ctx->last_status;
    int64_t shape[1] = {cnt}, s1[1] = {1}, s0[1] = {0};
    /* tmp = diff * dloss; dpred = 2/n tmp, dtarget = -2/n tmp */
    const float *diff = ((const mse_state *)n->state)->diff;
    BE(ctx)->binary(BEI(ctx), DT_BIN_MUL, 1, shape, diff, s1, FP(n->out->grad), s0, tmp);
    float k = 2.0f / (float)cnt;
    dt_status s = DT_OK;
    if (grad_needed(p))
        s = op_acc_grad(ctx, p, tmp, k);
    if (s == DT_OK && grad_needed(t))
        s = op_acc_grad(ctx, t, tmp, -k);
    return s;
}

/* pred, target same shape -> scalar mean((pred - target)^2) */
dt_tensor *dt_mse(dt_ctx *ctx, dt_tensor *pred, dt_tensor *target)
{
    if (!op_f32_ok(ctx, "mse", pred, "pred") || !op_f32_ok(ctx, "mse", target, "target"))
        return NULL;
    int same = pred->ndim == target->ndim;
    for (int i = 0; same && i < pred->ndim; i++)
        same = pred->shape[i] == target->shape[i];
    int64_t cnt = shape_numel(pred->ndim, pred->shape);
    if (!same || cnt == 0) {
        char s1[96], s2[96];
        set_error(ctx, DT_EINVAL, "mse: pred %s and target %s must have the same non-empty shape",
                  SHAPE(pred, s1), SHAPE(target, s2));
        return NULL;
    }
    tensor_materialize(pred);
    tensor_materialize(target);
    float *diff = op_temp_floats(ctx, cnt), *sq = diff ? op_temp_floats(ctx, cnt) : NULL;
    dt_tensor *y = sq ? tensor_step_new(ctx, DT_F32, 0, NULL) : NULL;
    if (!y)
        return NULL;
    int64_t cs[DT_MAX_DIMS];
    contiguous_strides(pred->ndim, pred->shape, cs);
    BE(ctx)->binary(BEI(ctx), DT_BIN_SUB, pred->ndim, pred->shape, FP(pred), pred->stride,
                    FP(target), target->stride, diff);
    BE(ctx)->binary(BEI(ctx), DT_BIN_MUL, pred->ndim, pred->shape, diff, cs, diff, cs, sq);
    BE(ctx)->sum(BEI(ctx), cnt, sq, FP(y));
    BE(ctx)->axpby(BEI(ctx), 1, 1.0f / (float)cnt, FP(y), 0.0f, FP(y));
    if ((tape_tracks(ctx, pred) || tape_tracks(ctx, target)) &&
        !tape_record_op(ctx, "mse", mse_backward, y, pred, target, NULL,
                        &(mse_state){diff}, sizeof(mse_state)))
        return NULL;
    return y;
}

/* --- custom ops (dt_custom_op) ---------------------------------------------- */

typedef struct custom_state { dt_custom_backward_fn backward; void *user; } custom_state;

static dt_status custom_backward(dt_ctx *ctx, dt_node *n)
{
    const custom_state *st = n->state;
    dt_tensor *grads[NODE_MAX_IN] = {0};
    int grad = ctx_swap_grad_enabled(ctx, 0);
    uint64_t errors = ctx->errors;
    dt_status s = st->backward(ctx, n->in, n->n_in, n->out, n->out->grad, grads, st->user);
    ctx_swap_grad_enabled(ctx, grad);
    if (s != DT_OK)
        return ctx->errors != errors ? ctx->last_status
                                     : set_error(ctx, s, "%s: its backward returned %d", n->op, (int)s);
    for (int i = 0; s == DT_OK && i < n->n_in; i++) {
        dt_tensor *g = grads[i], *x = n->in[i];
        if (!g || !grad_needed(x))
            continue;
        char sg[96], sx[96];
        int same = g->dtype == DT_F32 && g->ndim == x->ndim;
        for (int d = 0; same && d < x->ndim; d++)
            same = g->shape[d] == x->shape[d];
        if (!same)
            return set_error(ctx, DT_EINVAL, "%s: its backward gave a gradient %s %s for input %d "
                             "%s", n->op, SHAPE(g, sg), dt_dtype_name(g->dtype), i, SHAPE(x, sx));
        if (!(g = op_need_contig(ctx, g)))
            return ctx->last_status;
        tensor_materialize(g);
        s = op_acc_grad(ctx, x, FP(g), 1.0f);
    }
    return s;
}

dt_tensor *dt_custom_op(dt_ctx *ctx, const char *name, dt_tensor *const *inputs, int n,
                        dt_custom_forward_fn forward, dt_custom_backward_fn backward, void *user)
{
    if (!ctx_ok(ctx))
        return NULL;
    if (!name || !inputs || n < 1 || n > 3 || !forward || !backward) {
        set_error(ctx, DT_EINVAL, "custom_op: a name, 1 to 3 inputs and both functions are "
                  "required");
        return NULL;
    }
    for (int i = 0; i < n; i++)
        if (!op_input_ok(ctx, name, inputs[i], "input"))
            return NULL;
    int tracks = 0;
    for (int i = 0; i < n; i++)
        tracks |= tape_tracks(ctx, inputs[i]);
    int grad = ctx_swap_grad_enabled(ctx, 0);
    uint64_t errors = ctx->errors;
    dt_tensor *out = forward(ctx, inputs, n, user);
    ctx_swap_grad_enabled(ctx, grad);
    int is_input = 0;
    for (int i = 0; out && i < n; i++)
        is_input |= out == inputs[i];
    if (!out || is_input) {
        if (!out && ctx->errors != errors)
            return NULL;
        set_error(ctx, DT_EINVAL, "%s: forward returned %s", name, out ? "one of its inputs"
                                                                      : "NULL");
        return NULL;
    }
    if (!tracks)
        return out;
    size_t len = strlen(name) + 1;
    char *copy = arena_alloc(ctx, ctx->cur_host, len);
    dt_node *nd = copy ? tape_record_op(ctx, copy, custom_backward, out, inputs[0],
                                        n > 1 ? inputs[1] : NULL, n > 2 ? inputs[2] : NULL,
                                        &(custom_state){backward, user}, sizeof(custom_state))
                       : NULL;
    if (!nd) {
        if (!copy)
            set_error(ctx, DT_ENOMEM, "%s: out of host memory for the tape", name);
        return NULL;
    }
    memcpy(copy, name, len);
    return out;
}
