/*
 * tests/test_core_grad.c - every op's backward against central finite
 * differences (tu_grad_check in test_util.h), plus the exact patterns that
 * finite differences cannot see: unused embedding rows get exactly zero,
 * dropout's gradient is its mask / (1 - p), recompute matches the plain run.
 */
#include "test_util.h"

/* Finite-difference settings for float32: step, relative and absolute
 * tolerance.  Smooth ops use EPS; ops with kinks get inputs spaced far wider
 * than 2 * EPS. */
#define EPS 1e-2
#define RTOL 1e-2
#define ATOL 2e-3

/* ---------------------------------------------------------------------------
 * Forward functions under test.  in[] are the differentiable inputs; user
 * carries the op's arguments.
 * ------------------------------------------------------------------------- */
typedef struct op_args {
    int i0, i1, i2;          /* op-specific integers (flags, dims, stride, pad) */
    float f0;                /* op-specific float */
    dt_tensor *aux;          /* a non-differentiable input (labels, indices) */
} op_args;

static dt_tensor *f_matmul(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    op_args *a = u;
    return dt_matmul(ctx, in[0], in[1], a->i0, a->i1);
}

/* a is stored transposed: matmul consumes the transposed view of in[0]
 * (last two dims swapped). */
static dt_tensor *f_matmul_tview(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    (void)u;
    int nd = dt_tensor_ndim(in[0]);
    dt_tensor *at = dt_transpose(ctx, in[0], nd - 2, nd - 1);
    return dt_matmul(ctx, at, in[1], 0, 0);
}

static dt_tensor *f_linear(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    op_args *a = u;
    return dt_linear(ctx, in[0], in[1], a->i0 ? in[2] : NULL);
}

static dt_tensor *f_binary(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    op_args *a = u;
    switch (a->i0) {
    case 0: return dt_add(ctx, in[0], in[1]);
    case 1: return dt_sub(ctx, in[0], in[1]);
    case 2: return dt_mul(ctx, in[0], in[1]);
    default: return dt_div(ctx, in[0], in[1]);
    }
}

static dt_tensor *f_scale(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    return dt_scale(ctx, in[0], ((op_args *)u)->f0);
}

static dt_tensor *f_sum(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    (void)u;
    return dt_sum(ctx, in[0]);
}

static dt_tensor *f_mean(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    (void)u;
    return dt_mean(ctx, in[0]);
}

static dt_tensor *f_sum_dim(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    op_args *a = u;
    return a->i2 ? dt_mean_dim(ctx, in[0], a->i0, a->i1) : dt_sum_dim(ctx, in[0], a->i0, a->i1);
}

static dt_tensor *f_unary(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    switch (((op_args *)u)->i0) {
    case 0: return dt_relu(ctx, in[0]);
    case 1: return dt_gelu(ctx, in[0]);
    case 2: return dt_tanh(ctx, in[0]);
    case 3: return dt_sigmoid(ctx, in[0]);
    case 4: return dt_gelu_tanh(ctx, in[0]);
    case 5: return dt_exp(ctx, in[0]);
    case 6: return dt_log(ctx, in[0]);
    default: return dt_sqrt(ctx, in[0]);
    }
}

static dt_tensor *f_softmax(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    op_args *a = u;
    return a->i1 ? dt_log_softmax(ctx, in[0], a->i0) : dt_softmax(ctx, in[0], a->i0);
}

static dt_tensor *f_xent(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    op_args *a = u;
    return a->i0 ? dt_cross_entropy_ignore(ctx, in[0], a->aux, a->i1)
                 : dt_cross_entropy(ctx, in[0], a->aux);
}

static dt_tensor *f_mse(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    (void)u;
    return dt_mse(ctx, in[0], in[1]);
}

static dt_tensor *f_conv(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    op_args *a = u;
    return dt_conv2d(ctx, in[0], in[1], a->i2 ? in[2] : NULL, a->i0, a->i1);
}

static dt_tensor *f_pool(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    op_args *a = u;
    int k = a->i0, s = a->i1, p = a->i2;
    return a->f0 != 0 ? dt_avg_pool2d(ctx, in[0], k, s, p) : dt_max_pool2d(ctx, in[0], k, s, p);
}

static dt_tensor *f_reshape(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    (void)u;
    return dt_reshape(ctx, in[0], SHP(4, -1));
}

static dt_tensor *f_flatten(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    (void)u;
    return dt_flatten(ctx, in[0], 1);
}

static dt_tensor *f_transpose(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    (void)u;
    return dt_transpose(ctx, in[0], 0, 2);
}

static dt_tensor *f_transpose_contig(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    (void)u;
    return dt_contiguous(ctx, dt_transpose(ctx, in[0], 0, 1));
}

static dt_tensor *f_slice(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    op_args *a = u;
    return dt_slice(ctx, in[0], a->i0, a->i1, a->i2);
}

/* A slice feeding another op (so the view's gradient flows through it). */
static dt_tensor *f_slice_tanh(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    op_args *a = u;
    return dt_tanh(ctx, dt_slice(ctx, in[0], a->i0, a->i1, a->i2));
}

static dt_tensor *f_concat(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    return dt_concat(ctx, in, 2, ((op_args *)u)->i0);
}

static dt_tensor *f_embedding(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    return dt_embedding(ctx, in[0], ((op_args *)u)->aux);
}

static dt_tensor *f_layer_norm(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    op_args *a = u;
    return dt_layer_norm(ctx, in[0], a->i0 ? in[1] : NULL, a->i0 ? in[2] : NULL, 1e-5f);
}

/* ---------------------------------------------------------------------------
 * Linear algebra
 * ------------------------------------------------------------------------- */
static void run_matmul(int ba, int bb, int ta, int tb, uint64_t seed)
{
    /* M=3, K=4, N=5; ba/bb: batch dim (2) on a / b. */
    int64_t as[3], bs[3];
    int an = 0, bn = 0;
    if (ba) as[an++] = 2;
    as[an++] = ta ? 4 : 3;
    as[an++] = ta ? 3 : 4;
    if (bb) bs[bn++] = 2;
    bs[bn++] = tb ? 5 : 4;
    bs[bn++] = tb ? 4 : 5;

    dt_ctx *ctx = tu_ctx_new();
    tu_rng r = {seed};
    dt_tensor *in[2] = {tu_param_rand(ctx, &r, "a", an, as, -1, 1),
                        tu_param_rand(ctx, &r, "b", bn, bs, -1, 1)};
    op_args a = {.i0 = ta, .i1 = tb};
    char what[64];
    snprintf(what, sizeof what, "matmul a%dD b%dD ta=%d tb=%d", an, bn, ta, tb);
    tu_grad_check(ctx, what, f_matmul, &a, in, 2, EPS, RTOL, ATOL);
    dt_ctx_free(ctx);
}

static void test_grad_matmul_2d(void **state)
{
    (void)state;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) run_matmul(0, 0, ta, tb, 10 + ta * 2 + tb);
}

static void test_grad_matmul_batched(void **state)
{
    (void)state;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) run_matmul(1, 1, ta, tb, 20 + ta * 2 + tb);
}

static void test_grad_matmul_batched_shared_b(void **state)
{
    (void)state;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) run_matmul(1, 0, ta, tb, 30 + ta * 2 + tb);
}

static void test_grad_matmul_transposed_view(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    tu_rng r = {40};
    /* 2D: stored (4,3), used as its (3,4) transpose. */
    dt_tensor *in[2] = {tu_param_rand(ctx, &r, "a", SHP(4, 3), -1, 1),
                        tu_param_rand(ctx, &r, "b", SHP(4, 5), -1, 1)};
    tu_grad_check(ctx, "matmul(transpose(a), b)", f_matmul_tview, NULL, in, 2, EPS, RTOL, ATOL);
    /* 3D: stored (2,4,3), used as (2,3,4). */
    dt_tensor *in3[2] = {tu_param_rand(ctx, &r, "a3", SHP(2, 4, 3), -1, 1),
                         tu_param_rand(ctx, &r, "b3", SHP(2, 4, 5), -1, 1)};
    tu_grad_check(ctx, "batched matmul(transpose(a), b)", f_matmul_tview, NULL, in3, 2, EPS,
                  RTOL, ATOL);
    dt_ctx_free(ctx);
}

/* A leaf made with dt_tensor_new + dt_tensor_set_requires_grad (not a
 * param) gets its gradient too; a tensor that does not require grad gets
 * none. */
static void test_grad_leaf_tensor(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    tu_rng r = {41};
    float av[12];
    tu_fill_uniform(&r, av, 12, -1, 1);
    dt_tensor *leaf = tu_tensor(ctx, SHP(3, 4), av);
    assert_int_equal(dt_tensor_requires_grad(leaf), 0);
    assert_int_equal(dt_tensor_set_requires_grad(leaf, 1), DT_OK);
    assert_int_equal(dt_tensor_requires_grad(leaf), 1);
    dt_tensor *in[2] = {leaf, tu_param_rand(ctx, &r, "b", SHP(4, 5), -1, 1)};
    op_args a = {0};
    tu_grad_check(ctx, "matmul with a leaf tensor", f_matmul, &a, in, 2, EPS, RTOL, ATOL);

    /* A constant operand: no gradient. */
    dt_tensor *c = tu_tensor(ctx, SHP(4, 5), NULL);
    dt_tensor *loss = dt_sum(ctx, dt_matmul(ctx, leaf, c, 0, 0));
    tu_check(ctx, loss, "loss");
    tu_check_status(ctx, dt_backward(ctx, loss), "dt_backward");
    assert_null(dt_tensor_grad(c));
    dt_ctx_step_reset(ctx);
    dt_tensor_free(leaf);
    dt_tensor_free(c);
    dt_ctx_free(ctx);
}

static void test_grad_linear(void **state)
{
    (void)state;
    for (int bias = 0; bias < 2; bias++) {
        dt_ctx *ctx = tu_ctx_new();
        tu_rng r = {50 + (uint64_t)bias};
        dt_tensor *in[3] = {tu_param_rand(ctx, &r, "x", SHP(3, 4), -1, 1),
                            tu_param_rand(ctx, &r, "w", SHP(5, 4), -1, 1),
                            tu_param_rand(ctx, &r, "b", SHP(5), -1, 1)};
        op_args a = {.i0 = bias};
        tu_grad_check(ctx, bias ? "linear with bias" : "linear without bias", f_linear, &a, in,
                      bias ? 3 : 2, EPS, RTOL, ATOL);
        /* over (..., In): a transformer's (B, T, C) without reshaping */
        dt_tensor *in3[3] = {tu_param_rand(ctx, &r, "x3", SHP(2, 3, 4), -1, 1), in[1], in[2]};
        tu_grad_check(ctx, bias ? "linear (B,T,In) with bias" : "linear (B,T,In)", f_linear, &a,
                      in3, bias ? 3 : 2, EPS, RTOL, ATOL);
        dt_tensor *y3 = dt_linear(ctx, in3[0], in[1], bias ? in[2] : NULL);
        tu_check(ctx, y3, "linear (2, 3, 4)");
        tu_assert_shape(y3, SHP(2, 3, 5));
        dt_ctx_free(ctx);
    }
}

/* ---------------------------------------------------------------------------
 * Elementwise with broadcasting
 * ------------------------------------------------------------------------- */
static const char *bin_name[4] = {"add", "sub", "mul", "div"};

static void run_binary(int op, int an, const int64_t *as, int bn, const int64_t *bs, uint64_t seed)
{
    dt_ctx *ctx = tu_ctx_new();
    tu_rng r = {seed};
    dt_tensor *in[2];
    in[0] = tu_param_rand(ctx, &r, "a", an, as, -1, 1);
    /* Divisors stay in [0.5, 1.5]. */
    in[1] = op == 3 ? tu_param_rand(ctx, &r, "b", bn, bs, 0.5f, 1.5f)
                    : tu_param_rand(ctx, &r, "b", bn, bs, -1, 1);
    op_args a = {.i0 = op};
    char what[96];
    snprintf(what, sizeof what, "%s a%dD b%dD", bin_name[op], an, bn);
    tu_grad_check(ctx, what, f_binary, &a, in, 2, op == 3 ? 3e-3 : EPS, RTOL, ATOL);
    dt_ctx_free(ctx);
}

static void test_grad_binary_same_shape(void **state)
{
    (void)state;
    for (int op = 0; op < 4; op++) run_binary(op, SHP(3, 4), SHP(3, 4), 60 + (uint64_t)op);
}

static void test_grad_binary_broadcast_3d_by_col(void **state)
{
    (void)state;
    /* (2,3,4) op (3,1) -> (2,3,4) */
    for (int op = 0; op < 4; op++) run_binary(op, SHP(2, 3, 4), SHP(3, 1), 70 + (uint64_t)op);
}

static void test_grad_binary_broadcast_vec_by_3d(void **state)
{
    (void)state;
    /* (4) op (2,3,4) -> (2,3,4) */
    for (int op = 0; op < 4; op++) run_binary(op, SHP(4), SHP(2, 3, 4), 80 + (uint64_t)op);
}

static void test_grad_binary_broadcast_both(void **state)
{
    (void)state;
    /* (2,1,4) op (3,1) -> (2,3,4): both operands broadcast. */
    for (int op = 0; op < 4; op++) run_binary(op, SHP(2, 1, 4), SHP(3, 1), 90 + (uint64_t)op);
}

static void test_grad_scale(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    tu_rng r = {100};
    dt_tensor *in[1] = {tu_param_rand(ctx, &r, "x", SHP(3, 4), -1, 1)};
    op_args a = {.f0 = -2.5f};
    tu_grad_check(ctx, "scale", f_scale, &a, in, 1, EPS, RTOL, ATOL);
    dt_ctx_free(ctx);
}

/* ---------------------------------------------------------------------------
 * Reductions
 * ------------------------------------------------------------------------- */
static void test_grad_sum_mean(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    tu_rng r = {110};
    dt_tensor *in[1] = {tu_param_rand(ctx, &r, "x", SHP(2, 3, 4), -1, 1)};
    tu_grad_check(ctx, "sum", f_sum, NULL, in, 1, EPS, RTOL, ATOL);
    tu_grad_check(ctx, "mean", f_mean, NULL, in, 1, EPS, RTOL, 2e-4);
    dt_ctx_free(ctx);
}

static void test_grad_sum_mean_dim(void **state)
{
    (void)state;
    static const int dims[] = {0, 1, -1};
    dt_ctx *ctx = tu_ctx_new();
    tu_rng r = {120};
    dt_tensor *in[1] = {tu_param_rand(ctx, &r, "x", SHP(2, 3, 4), -1, 1)};
    for (int mean = 0; mean < 2; mean++)
        for (int d = 0; d < 3; d++)
            for (int keep = 0; keep < 2; keep++) {
                op_args a = {.i0 = dims[d], .i1 = keep, .i2 = mean};
                char what[64];
                snprintf(what, sizeof what, "%s dim=%d keepdim=%d", mean ? "mean_dim" : "sum_dim",
                         dims[d], keep);
                tu_grad_check(ctx, what, f_sum_dim, &a, in, 1, EPS, RTOL, ATOL);
            }
    dt_ctx_free(ctx);
}

/* ---------------------------------------------------------------------------
 * Activations, softmax, losses
 * ------------------------------------------------------------------------- */
static void test_grad_activations(void **state)
{
    (void)state;
    static const char *names[8] = {"relu", "gelu", "tanh", "sigmoid", "gelu_tanh", "exp", "log",
                                   "sqrt"};
    for (int op = 0; op < 8; op++) {
        dt_ctx *ctx = tu_ctx_new();
        tu_rng r = {130 + (uint64_t)op};
        float v[15];
        if (op == 0) {
            tu_fill_away_from_zero(&r, v, 15);
        } else if (op >= 6) {   /* log, sqrt: their domain, away from 0 */
            tu_fill_uniform(&r, v, 15, 0.5f, 3.0f);
        } else {
            tu_fill_uniform(&r, v, 15, -2, 2);
        }
        dt_tensor *in[1] = {tu_param(ctx, "x", SHP(3, 5), v)};
        op_args a = {.i0 = op};
        tu_grad_check(ctx, names[op], f_unary, &a, in, 1, EPS, RTOL, ATOL);
        dt_ctx_free(ctx);
    }
}

static void test_grad_softmax(void **state)
{
    (void)state;
    static const int dims[] = {0, 1, -1, 2};
    dt_ctx *ctx = tu_ctx_new();
    tu_rng r = {140};
    dt_tensor *in[1] = {tu_param_rand(ctx, &r, "x", SHP(2, 3, 4), -2, 2)};
    for (int log = 0; log < 2; log++)
        for (int d = 0; d < 4; d++) {
            op_args a = {.i0 = dims[d], .i1 = log};
            char what[64];
            snprintf(what, sizeof what, "%s dim=%d", log ? "log_softmax" : "softmax", dims[d]);
            tu_grad_check(ctx, what, f_softmax, &a, in, 1, EPS, RTOL, ATOL);
        }
    dt_ctx_free(ctx);
}

static void test_grad_cross_entropy(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    tu_rng r = {150};
    dt_tensor *in[1] = {tu_param_rand(ctx, &r, "logits", SHP(4, 5), -2, 2)};
    const int32_t labels[4] = {1, 0, 4, 2};
    op_args a = {.aux = tu_tensor_i32(ctx, SHP(4), labels)};
    tu_grad_check(ctx, "cross_entropy", f_xent, &a, in, 1, EPS, RTOL, 5e-4);
    dt_tensor_free(a.aux);
    dt_ctx_free(ctx);
}

/* A language model's loss: logits (B, T, V), labels (B, T) with ignored
 * positions; the value against the mean over the kept positions computed
 * here, and the gradient (zero on the ignored rows) by differences. */
static void test_grad_cross_entropy_sequence(void **state)
{
    (void)state;
    enum { B = 2, T = 3, V = 5 };
    for (int ignore = 0; ignore < 2; ignore++) {
        dt_ctx *ctx = tu_ctx_new();
        tu_rng r = {151 + (uint64_t)ignore};
        float lv[B * T * V];
        tu_fill_uniform(&r, lv, B * T * V, -2, 2);
        dt_tensor *in[1] = {tu_param(ctx, "logits", SHP(B, T, V), lv)};
        const int32_t labels[B * T] = {1, -100, 4, 0, 3, -100};
        const int32_t plain[B * T] = {1, 2, 4, 0, 3, 0};
        const int32_t *lab = ignore ? labels : plain;
        op_args a = {.i0 = ignore, .i1 = -100, .aux = tu_tensor_i32(ctx, SHP(B, T), lab)};
        double want = 0;
        int kept = 0;
        for (int i = 0; i < B * T; i++) {
            if (lab[i] == -100)
                continue;
            double m = -1e30, se = 0;
            for (int c = 0; c < V; c++)
                m = lv[i * V + c] > m ? lv[i * V + c] : m;
            for (int c = 0; c < V; c++)
                se += exp(lv[i * V + c] - m);
            want += log(se) + m - lv[i * V + lab[i]];
            kept++;
        }
        dt_tensor *loss = f_xent(ctx, in, &a);
        tu_check(ctx, loss, "cross_entropy (B,T,V)");
        assert_true(tu_close(dt_tensor_item(loss), want / kept, 1e-5, 1e-6));
        tu_grad_check(ctx, ignore ? "cross_entropy_ignore (B,T,V)" : "cross_entropy (B,T,V)",
                      f_xent, &a, in, 1, EPS, RTOL, 5e-4);
        if (ignore) {   /* the ignored rows got exactly nothing */
            float *g = tu_read(ctx, dt_tensor_grad(in[0]), NULL);
            for (int c = 0; c < V; c++)
                assert_true(g[1 * V + c] == 0.0f && g[5 * V + c] == 0.0f);
            free(g);
        }
        dt_ctx_free(ctx);
    }
}

static void test_grad_mse(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    tu_rng r = {160};
    dt_tensor *in[2] = {tu_param_rand(ctx, &r, "pred", SHP(3, 4), -1, 1),
                        tu_param_rand(ctx, &r, "target", SHP(3, 4), -1, 1)};
    tu_grad_check(ctx, "mse", f_mse, NULL, in, 2, EPS, RTOL, 5e-4);
    dt_ctx_free(ctx);
}

/* ---------------------------------------------------------------------------
 * Convolution and pooling
 * ------------------------------------------------------------------------- */
static void test_grad_conv2d(void **state)
{
    (void)state;
    static const int cfg[4][3] = {{1, 1, 1}, {1, 1, 0}, {2, 0, 1}, {2, 0, 0}}; /* stride, pad, bias */
    for (int c = 0; c < 4; c++) {
        dt_ctx *ctx = tu_ctx_new();
        tu_rng r = {170 + (uint64_t)c};
        dt_tensor *in[3] = {tu_param_rand(ctx, &r, "x", SHP(2, 2, 5, 5), -1, 1),
                            tu_param_rand(ctx, &r, "w", SHP(3, 2, 3, 3), -0.5f, 0.5f),
                            tu_param_rand(ctx, &r, "b", SHP(3), -0.5f, 0.5f)};
        op_args a = {.i0 = cfg[c][0], .i1 = cfg[c][1], .i2 = cfg[c][2]};
        char what[64];
        snprintf(what, sizeof what, "conv2d stride=%d pad=%d bias=%d", cfg[c][0], cfg[c][1],
                 cfg[c][2]);
        tu_grad_check(ctx, what, f_conv, &a, in, cfg[c][2] ? 3 : 2, EPS, RTOL, ATOL);
        dt_ctx_free(ctx);
    }
}

static void run_pool(int avg, int ndim, const int64_t *shape, int k, int s, int p, uint64_t seed)
{
    dt_ctx *ctx = tu_ctx_new();
    tu_rng r = {seed};
    int64_t n = tu_numel(ndim, shape);
    float *v = malloc(sizeof(float) * (size_t)n);
    assert_non_null(v);
    /* Distinct values 0.05 apart: each max-pool window has a unique maximum
     * with a margin of 0.05, ten times the step below. */
    tu_fill_distinct(&r, v, n, 0.05f);
    dt_tensor *in[1] = {tu_param(ctx, "x", ndim, shape, v)};
    free(v);
    op_args a = {.i0 = k, .i1 = s, .i2 = p, .f0 = (float)avg};
    char what[64];
    snprintf(what, sizeof what, "%s k=%d s=%d p=%d", avg ? "avg_pool2d" : "max_pool2d", k, s, p);
    tu_grad_check(ctx, what, f_pool, &a, in, 1, 5e-3, RTOL, ATOL);
    dt_ctx_free(ctx);
}

static void test_grad_max_pool2d(void **state)
{
    (void)state;
    run_pool(0, SHP(2, 2, 4, 4), 2, 2, 0, 180);
    run_pool(0, SHP(1, 2, 5, 5), 3, 1, 1, 181); /* overlapping windows, padding */
    run_pool(0, SHP(1, 1, 5, 5), 3, 2, 1, 182);
}

static void test_grad_avg_pool2d(void **state)
{
    (void)state;
    run_pool(1, SHP(2, 2, 4, 4), 2, 2, 0, 190);
    run_pool(1, SHP(1, 2, 5, 5), 3, 1, 1, 191);
    run_pool(1, SHP(1, 1, 5, 5), 3, 2, 1, 192);
}

/* ---------------------------------------------------------------------------
 * Views, concat, embedding, layer_norm
 * ------------------------------------------------------------------------- */
static void test_grad_views(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    tu_rng r = {200};
    dt_tensor *x3[1] = {tu_param_rand(ctx, &r, "x3", SHP(2, 3, 4), -1, 1)};
    tu_grad_check(ctx, "reshape (4,-1)", f_reshape, NULL, x3, 1, EPS, RTOL, ATOL);
    tu_grad_check(ctx, "transpose(0,2)", f_transpose, NULL, x3, 1, EPS, RTOL, ATOL);
    dt_tensor *x4[1] = {tu_param_rand(ctx, &r, "x4", SHP(2, 3, 2, 2), -1, 1)};
    tu_grad_check(ctx, "flatten(1)", f_flatten, NULL, x4, 1, EPS, RTOL, ATOL);
    dt_tensor *x2[1] = {tu_param_rand(ctx, &r, "x2", SHP(3, 5), -1, 1)};
    tu_grad_check(ctx, "contiguous(transpose)", f_transpose_contig, NULL, x2, 1, EPS, RTOL, ATOL);
    dt_ctx_free(ctx);
}

static void test_grad_slice(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    tu_rng r = {210};
    dt_tensor *x[1] = {tu_param_rand(ctx, &r, "x", SHP(3, 5), -1, 1)};
    op_args d1 = {.i0 = 1, .i1 = 1, .i2 = 4};
    tu_grad_check(ctx, "slice dim=1 [1,4)", f_slice, &d1, x, 1, EPS, RTOL, ATOL);
    tu_grad_check(ctx, "tanh(slice dim=1 [1,4))", f_slice_tanh, &d1, x, 1, EPS, RTOL, ATOL);
    op_args d0 = {.i0 = 0, .i1 = 1, .i2 = 3};
    tu_grad_check(ctx, "slice dim=0 [1,3)", f_slice, &d0, x, 1, EPS, RTOL, ATOL);
    dt_tensor *y[1] = {tu_param_rand(ctx, &r, "y", SHP(2, 4, 3), -1, 1)};
    op_args dm = {.i0 = -2, .i1 = 2, .i2 = 4};
    tu_grad_check(ctx, "slice dim=-2 [2,4) of 3D", f_slice_tanh, &dm, y, 1, EPS, RTOL, ATOL);
    dt_ctx_free(ctx);
}

static void test_grad_concat(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    tu_rng r = {220};
    dt_tensor *a0[2] = {tu_param_rand(ctx, &r, "a", SHP(2, 3), -1, 1),
                        tu_param_rand(ctx, &r, "b", SHP(1, 3), -1, 1)};
    op_args d0 = {.i0 = 0};
    tu_grad_check(ctx, "concat dim=0", f_concat, &d0, a0, 2, EPS, RTOL, ATOL);
    dt_tensor *a1[2] = {tu_param_rand(ctx, &r, "c", SHP(2, 3), -1, 1),
                        tu_param_rand(ctx, &r, "d", SHP(2, 2), -1, 1)};
    op_args d1 = {.i0 = 1};
    tu_grad_check(ctx, "concat dim=1", f_concat, &d1, a1, 2, EPS, RTOL, ATOL);
    dt_ctx_free(ctx);
}

static void test_grad_embedding(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    tu_rng r = {230};
    dt_tensor *w[1] = {tu_param_rand(ctx, &r, "emb", SHP(6, 3), -1, 1)};
    const int32_t idx[4] = {1, 4, 4, 0}; /* row 4 twice; rows 2, 3, 5 unused */
    op_args a = {.aux = tu_tensor_i32(ctx, SHP(2, 2), idx)};
    tu_grad_check(ctx, "embedding", f_embedding, &a, w, 1, EPS, RTOL, ATOL);

    /* Exact zeros in the unused rows (finite differences only see ~0). */
    dt_ctx_zero_grad(ctx);
    dt_tensor *y = dt_embedding(ctx, w[0], a.aux);
    tu_check(ctx, y, "embedding");
    tu_assert_shape(y, SHP(2, 2, 3));
    tu_check_status(ctx, dt_backward(ctx, dt_sum(ctx, y)), "dt_backward");
    int64_t n;
    float *g = tu_read(ctx, dt_tensor_grad(w[0]), &n);
    static const float count[6] = {1, 1, 0, 0, 2, 0};
    for (int row = 0; row < 6; row++)
        for (int j = 0; j < 3; j++)
            if (g[row * 3 + j] != count[row])
                fail_msg("embedding grad row %d col %d: expected exactly %g, got %.9g", row, j,
                         (double)count[row], (double)g[row * 3 + j]);
    free(g);
    dt_ctx_step_reset(ctx);
    dt_tensor_free(a.aux);
    dt_ctx_free(ctx);
}

static void test_grad_layer_norm(void **state)
{
    (void)state;
    for (int affine = 0; affine < 2; affine++) {
        dt_ctx *ctx = tu_ctx_new();
        tu_rng r = {240 + (uint64_t)affine};
        dt_tensor *in[3] = {tu_param_rand(ctx, &r, "x", SHP(3, 5), -1, 1),
                            tu_param_rand(ctx, &r, "w", SHP(5), 0.5f, 1.5f),
                            tu_param_rand(ctx, &r, "b", SHP(5), -0.5f, 0.5f)};
        op_args a = {.i0 = affine};
        tu_grad_check(ctx, affine ? "layer_norm with w, b" : "layer_norm without w, b",
                      f_layer_norm, &a, in, affine ? 3 : 1, 3e-3, RTOL, ATOL);
        dt_ctx_free(ctx);
    }
}

/* ---------------------------------------------------------------------------
 * A custom op from outside the library: y = x * w * w elementwise, its
 * forward on the host, its backward with ops: dx = dy w^2, dw = 2 dy x w
 * ------------------------------------------------------------------------- */

static dt_tensor *xw2_forward(dt_ctx *ctx, dt_tensor *const *in, int n, void *user)
{
    (void)n;
    (*(int *)user)++;
    int64_t cnt = dt_tensor_numel(in[0]);
    float x[64], w[64];
    if (cnt > 64 || dt_tensor_get(in[0], x, cnt) != DT_OK || dt_tensor_get(in[1], w, cnt) != DT_OK)
        return NULL;
    for (int64_t i = 0; i < cnt; i++)
        x[i] *= w[i] * w[i];
    int64_t shape[DT_MAX_DIMS];
    for (int d = 0; d < dt_tensor_ndim(in[0]); d++)
        shape[d] = dt_tensor_dim(in[0], d);
    dt_tensor *y = dt_tensor_temp(ctx, DT_F32, dt_tensor_ndim(in[0]), shape);
    return y && dt_tensor_set(y, x, cnt) == DT_OK ? y : NULL;
}

static dt_status xw2_backward(dt_ctx *ctx, dt_tensor *const *in, int n, dt_tensor *out,
                              dt_tensor *dout, dt_tensor **grads, void *user)
{
    (void)n;
    (void)out;
    (void)user;
    dt_tensor *x = in[0], *w = in[1];
    grads[0] = dt_mul(ctx, dout, dt_mul(ctx, w, w));
    grads[1] = dt_scale(ctx, dt_mul(ctx, dt_mul(ctx, dout, x), w), 2.0f);
    return grads[0] && grads[1] ? DT_OK : dt_last_status(ctx);
}

/* a backward that gives a gradient of the wrong shape */
static dt_status bad_backward(dt_ctx *ctx, dt_tensor *const *in, int n, dt_tensor *out,
                              dt_tensor *dout, dt_tensor **grads, void *user)
{
    (void)in;
    (void)n;
    (void)out;
    (void)dout;
    (void)user;
    grads[0] = dt_tensor_temp(ctx, DT_F32, SHP(2));
    return DT_OK;
}

static dt_tensor *f_custom(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    /* used twice, so its gradients add up with another op's */
    dt_tensor *y = dt_custom_op(ctx, "xw2", in, 2, xw2_forward, xw2_backward, u);
    return y ? dt_add(ctx, y, dt_mul(ctx, in[0], in[1])) : NULL;
}

static dt_tensor *f_permute(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    (void)u;
    static const int dims[3] = {2, 0, 1};
    return dt_permute(ctx, in[0], 3, dims);
}

static dt_tensor *f_pow(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    return ((op_args *)u)->i0 ? dt_pow_scalar(ctx, in[0], 2.5f) : dt_pow(ctx, in[0], in[1]);
}

/* where and masked_fill, with a finite x so that the finite differences see
 * only the selected branch */
static dt_tensor *f_where(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    op_args *a = u;
    return a->i0 ? dt_masked_fill(ctx, in[0], a->aux, -3.5f) : dt_where(ctx, a->aux, in[0], in[1]);
}

/* permute, pow, where and masked_fill: values against their definitions,
 * gradients by differences; -inf filled without a NaN */
static void test_grad_tensor_ops(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    tu_rng r = {290};
    dt_tensor *x = tu_param_rand(ctx, &r, "x", SHP(2, 3, 4), -1, 1);
    float *xv = tu_read(ctx, x, NULL), *pv = tu_read(ctx, f_permute(ctx, &x, NULL), NULL);
    for (int i = 0; i < 2; i++)   /* y[k][i][j] = x[i][j][k] */
        for (int j = 0; j < 3; j++)
            for (int k = 0; k < 4; k++)
                assert_true(pv[(k * 2 + i) * 3 + j] == xv[(i * 3 + j) * 4 + k]);
    free(xv);
    free(pv);
    tu_grad_check(ctx, "permute", f_permute, NULL, &x, 1, EPS, RTOL, ATOL);
    dt_tensor *pin[2] = {tu_param_rand(ctx, &r, "a", SHP(3, 4), 0.5f, 2),
                         tu_param_rand(ctx, &r, "b", SHP(4), -1.5f, 1.5f)};
    op_args pa = {.i0 = 0};
    tu_grad_check(ctx, "pow", f_pow, &pa, pin, 2, EPS, RTOL, ATOL);
    pa.i0 = 1;
    tu_grad_check(ctx, "pow_scalar", f_pow, &pa, pin, 1, EPS, RTOL, ATOL);
    float cv[4] = {1, 0, 0, 1};
    dt_tensor *win[2] = {tu_param_rand(ctx, &r, "wa", SHP(3, 4), -1, 1),
                         tu_param_rand(ctx, &r, "wb", SHP(3, 4), -1, 1)};
    op_args wa = {.i0 = 0, .aux = tu_tensor(ctx, SHP(4), cv)};
    tu_grad_check(ctx, "where", f_where, &wa, win, 2, EPS, RTOL, ATOL);
    wa.i0 = 1;
    tu_grad_check(ctx, "masked_fill", f_where, &wa, win, 1, EPS, RTOL, ATOL);
    float *a = tu_read(ctx, win[0], NULL), *b = tu_read(ctx, win[1], NULL);
    float *w = tu_read(ctx, dt_where(ctx, wa.aux, win[0], win[1]), NULL);
    for (int i = 0; i < 12; i++)
        assert_true(w[i] == (cv[i % 4] != 0 ? a[i] : b[i]));
    free(w);
    w = tu_read(ctx, dt_masked_fill(ctx, win[0], wa.aux, -INFINITY), NULL);
    for (int i = 0; i < 12; i++)
        assert_true(cv[i % 4] != 0 ? w[i] == -INFINITY : w[i] == a[i]);
    free(w);
    free(a);
    free(b);
    static const int bad[3] = {0, 0, 1};
    assert_null(dt_permute(ctx, x, 3, bad));
    tu_assert_error_mentions(ctx, "permutation");
    dt_ctx_free(ctx);
}

static void test_grad_custom_op(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    tu_rng r = {280};
    dt_tensor *in[2] = {tu_param_rand(ctx, &r, "x", SHP(3, 4), -1, 1),
                        tu_param_rand(ctx, &r, "w", SHP(3, 4), -1, 1)};
    int calls = 0;
    tu_grad_check(ctx, "custom op", f_custom, &calls, in, 2, EPS, RTOL, ATOL);
    assert_true(calls > 0);
    /* no inputs; a gradient of another shape stops backward, naming the op */
    assert_null(dt_custom_op(ctx, "bad", in, 0, xw2_forward, xw2_backward, &calls));
    tu_assert_error_mentions(ctx, "custom_op");
    dt_tensor *y = dt_custom_op(ctx, "misshapen", in, 2, xw2_forward, bad_backward, &calls);
    tu_check(ctx, y, "custom op");
    assert_int_equal(dt_backward(ctx, dt_sum(ctx, y)), DT_EINVAL);
    tu_assert_error_mentions(ctx, "misshapen");
    dt_ctx_free(ctx);
}

/* ---------------------------------------------------------------------------
 * Attention: the forward against softmax(scale q k^T + mask) v computed here
 * in double, and the gradient of q, k and v by finite differences
 * ------------------------------------------------------------------------- */

static dt_tensor *f_attention(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    op_args *a = u;
    return dt_attention(ctx, in[0], in[1], in[2], a->aux, a->i0, a->f0);
}

/* The reference for one (..., T, D) problem of `heads` heads. */
static void attention_ref(const float *q, const float *k, const float *v, const float *mask,
                          int causal, double scale, int heads, int t, int d, double *out)
{
    for (int h = 0; h < heads; h++)
        for (int i = 0; i < t; i++) {
            double s[16], m = -INFINITY, sum = 0;
            for (int j = 0; j < t; j++) {
                s[j] = 0;
                for (int e = 0; e < d; e++)
                    s[j] += (double)q[(h * t + i) * d + e] * k[(h * t + j) * d + e];
                s[j] = s[j] * scale + (mask ? mask[i * t + j] : 0.0);
                if (causal && j > i)
                    s[j] = -INFINITY;
                m = s[j] > m ? s[j] : m;
            }
            for (int j = 0; j < t; j++)
                sum += exp(s[j] - m);
            for (int e = 0; e < d; e++) {
                double acc = 0;
                for (int j = 0; j < t; j++)
                    acc += exp(s[j] - m) / sum * v[(h * t + j) * d + e];
                out[(h * t + i) * d + e] = acc;
            }
        }
}

static void test_grad_attention(void **state)
{
    (void)state;
    enum { B = 2, H = 2, T = 5, D = 3, N = B * H * T * D };
    for (int variant = 0; variant < 3; variant++) {   /* plain, causal, causal + mask */
        dt_ctx *ctx = tu_ctx_new();
        tu_rng r = {260 + (uint64_t)variant};
        float qv[N], kv[N], vv[N], mv[T * T];
        tu_fill_uniform(&r, qv, N, -1, 1);
        tu_fill_uniform(&r, kv, N, -1, 1);
        tu_fill_uniform(&r, vv, N, -1, 1);
        tu_fill_uniform(&r, mv, T * T, -1, 1);
        mv[2 * T + 1] = -INFINITY;   /* a blocked pair */
        dt_tensor *in[3] = {tu_param(ctx, "q", SHP(B, H, T, D), qv),
                            tu_param(ctx, "k", SHP(B, H, T, D), kv),
                            tu_param(ctx, "v", SHP(B, H, T, D), vv)};
        op_args a = {.i0 = variant > 0, .f0 = variant == 1 ? 0.7f : 0.0f,
                     .aux = variant == 2 ? tu_tensor(ctx, SHP(T, T), mv) : NULL};
        double scale = variant == 1 ? 0.7 : 1.0 / sqrt((double)D), want[N];
        attention_ref(qv, kv, vv, variant == 2 ? mv : NULL, variant > 0, scale, B * H, T, D, want);
        float *got = tu_read(ctx, f_attention(ctx, in, &a), NULL);
        tu_assert_close_arr("attention forward", got, want, N, 1e-5, 1e-6);
        free(got);
        tu_grad_check(ctx, "attention", f_attention, &a, in, 3, EPS, RTOL, ATOL);
        dt_ctx_free(ctx);
    }
    /* one head per task: the same bits with 1 and 3 threads */
    float *bits[2];
    for (int th = 0; th < 2; th++) {
        dt_ctx *c = tu_ctx_new_with(5, th ? 3 : 1);
        tu_rng r = {270};
        dt_tensor *in[3];
        for (int i = 0; i < 3; i++)
            in[i] = tu_param_rand(c, &r, i == 0 ? "q" : i == 1 ? "k" : "v", SHP(3, 4, 33, 8), -1, 1);
        op_args a = {.i0 = 1};
        bits[th] = tu_read(c, f_attention(c, in, &a), NULL);
        dt_ctx_free(c);
    }
    assert_memory_equal(bits[0], bits[1], sizeof(float) * 3 * 4 * 33 * 8);
    free(bits[0]);
    free(bits[1]);

    /* shapes that differ, and a mask of the wrong size */
    dt_ctx *ctx = tu_ctx_new();
    dt_tensor *q = dt_tensor_new(ctx, DT_F32, SHP(2, 4, 3)), *k = dt_tensor_new(ctx, DT_F32, SHP(2, 5, 3));
    assert_null(dt_attention(ctx, q, k, q, NULL, 1, 0));
    tu_assert_error_mentions(ctx, "attention");
    dt_tensor *m = dt_tensor_new(ctx, DT_F32, SHP(3, 3));
    assert_null(dt_attention(ctx, q, q, q, m, 0, 0));
    tu_assert_error_mentions(ctx, "mask");
    dt_ctx_free(ctx);
}

/* ---------------------------------------------------------------------------
 * Dropout and recompute
 * ------------------------------------------------------------------------- */

/* y = dropout(x): every y/x is 0 or 1/(1-p), and dL/dx = R * y/x. */
static void check_dropout_grad(dt_ctx *ctx, dt_tensor *x, dt_tensor *y, const float *R,
                               int64_t n, float p, double want_zero_frac)
{
    float *xv = tu_read(ctx, x, NULL);
    float *yv = tu_read(ctx, y, NULL);
    float *g = tu_read(ctx, dt_tensor_grad(x), NULL);
    double keep = 1.0 / (1.0 - p);
    int64_t zeros = 0;
    for (int64_t i = 0; i < n; i++) {
        double ratio = (double)yv[i] / (double)xv[i];
        if (ratio == 0) {
            zeros++;
        } else if (fabs(ratio - keep) > 1e-5 * keep) {
            fail_msg("dropout: y/x at %lld is %.9g, expected 0 or %.9g", (long long)i, ratio, keep);
        }
        double want = (double)R[i] * ratio;
        if (!tu_close(g[i], want, 1e-5, 1e-7))
            fail_msg("dropout grad at %lld: expected R*y/x = %.9g, got %.9g", (long long)i, want,
                     (double)g[i]);
    }
    double frac = (double)zeros / (double)n;
    if (fabs(frac - want_zero_frac) > 0.06)
        fail_msg("dropout p=%g dropped a fraction %.3f of %lld elements", (double)p, frac,
                 (long long)n);
    free(xv);
    free(yv);
    free(g);
}

static void test_grad_dropout(void **state)
{
    (void)state;
    enum { N = 2000 };
    static float xv[N], R[N];
    tu_rng r = {250};
    tu_fill_away_from_zero(&r, xv, N);
    tu_fill_uniform(&r, R, N, -1, 1);
    const float ps[3] = {0.3f, 0.5f, 0.0f};
    for (int k = 0; k < 3; k++) {
        dt_ctx *ctx = tu_ctx_new();
        dt_tensor *x = tu_param(ctx, "x", SHP(N), xv);
        dt_tensor *Rt = tu_tensor(ctx, SHP(N), R);
        dt_tensor *y = dt_dropout(ctx, x, ps[k]);
        tu_check(ctx, y, "dropout");
        tu_check_status(ctx, dt_backward(ctx, dt_sum(ctx, dt_mul(ctx, y, Rt))), "dt_backward");
        check_dropout_grad(ctx, x, y, R, N, ps[k], ps[k]);
        dt_ctx_step_reset(ctx);

        /* Not training: identity, gradient R. */
        dt_ctx_set_training(ctx, 0);
        assert_int_equal(dt_ctx_training(ctx), 0);
        dt_ctx_zero_grad(ctx);
        y = dt_dropout(ctx, x, 0.5f);
        tu_check(ctx, y, "dropout (eval)");
        tu_check_status(ctx, dt_backward(ctx, dt_sum(ctx, dt_mul(ctx, y, Rt))), "dt_backward");
        check_dropout_grad(ctx, x, y, R, N, 0.0f, 0.0);
        dt_ctx_step_reset(ctx);
        dt_tensor_free(Rt);
        dt_ctx_free(ctx);
    }
}

typedef struct mlp_seg {
    dt_tensor *w1, *b1, *w2, *b2;
    int with_dropout;
} mlp_seg;

/* x (N,4) -> linear(4->6) -> gelu -> linear(6->4) -> tanh -> (N,4) */
static dt_tensor *seg_mlp(dt_ctx *ctx, dt_tensor *const *inputs, int n, void *user)
{
    mlp_seg *s = user;
    (void)n;
    dt_tensor *h = dt_gelu(ctx, dt_linear(ctx, inputs[0], s->w1, s->b1));
    return dt_tanh(ctx, dt_linear(ctx, h, s->w2, s->b2));
}

static dt_tensor *f_recompute(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    mlp_seg *s = u;
    s->w1 = in[1];
    s->b1 = in[2];
    s->w2 = in[3];
    s->b2 = in[4];
    dt_tensor *h = dt_recompute(ctx, seg_mlp, in, 1, s);
    return dt_sigmoid(ctx, h);
}

static dt_tensor *f_plain(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    mlp_seg *s = u;
    s->w1 = in[1];
    s->b1 = in[2];
    s->w2 = in[3];
    s->b2 = in[4];
    return dt_sigmoid(ctx, seg_mlp(ctx, in, 1, s));
}

static void make_seg_params(dt_ctx *ctx, dt_tensor **in)
{
    tu_rng r = {260};
    in[0] = tu_param_rand(ctx, &r, "x", SHP(3, 4), -1, 1);
    in[1] = tu_param_rand(ctx, &r, "w1", SHP(6, 4), -1, 1);
    in[2] = tu_param_rand(ctx, &r, "b1", SHP(6), -0.5f, 0.5f);
    in[3] = tu_param_rand(ctx, &r, "w2", SHP(4, 6), -1, 1);
    in[4] = tu_param_rand(ctx, &r, "b2", SHP(4), -0.5f, 0.5f);
}

static void test_grad_recompute(void **state)
{
    (void)state;
    mlp_seg s = {0};
    float *g_re[5], *g_plain[5];
    for (int re = 0; re < 2; re++) {
        dt_ctx *ctx = tu_ctx_new();
        dt_tensor *in[5];
        make_seg_params(ctx, in);
        if (re) tu_grad_check(ctx, "recompute segment", f_recompute, &s, in, 5, EPS, RTOL, ATOL);
        /* The same loss with and without recompute. */
        dt_ctx_zero_grad(ctx);
        dt_tensor *y = re ? f_recompute(ctx, in, &s) : f_plain(ctx, in, &s);
        tu_check(ctx, y, "segment output");
        tu_check_status(ctx, dt_backward(ctx, dt_sum(ctx, y)), "dt_backward");
        for (int i = 0; i < 5; i++) (re ? g_re : g_plain)[i] = tu_read(ctx, dt_tensor_grad(in[i]), NULL);
        dt_ctx_step_reset(ctx);
        dt_ctx_free(ctx);
    }
    static const int64_t sizes[5] = {12, 24, 6, 24, 4};
    for (int i = 0; i < 5; i++) {
        for (int64_t j = 0; j < sizes[i]; j++)
            if (!tu_close(g_re[i][j], g_plain[i][j], 1e-6, 1e-7))
                fail_msg("recompute grad of input %d [%lld]: plain %.9g, recomputed %.9g", i,
                         (long long)j, (double)g_plain[i][j], (double)g_re[i][j]);
        free(g_re[i]);
        free(g_plain[i]);
    }
}

/* y = dropout(x * w) inside a recomputed segment: the mask replayed in
 * backward is the one the forward used, so dL/dx = R * y / x exactly as for
 * a plain dropout with w = 1. */
static dt_tensor *seg_dropout(dt_ctx *ctx, dt_tensor *const *inputs, int n, void *user)
{
    (void)n;
    (void)user;
    return dt_dropout(ctx, dt_mul(ctx, inputs[0], inputs[1]), 0.5f);
}

static void test_grad_recompute_dropout(void **state)
{
    (void)state;
    enum { N = 1000 };
    static float xv[N], ones[N], R[N];
    tu_rng r = {270};
    tu_fill_away_from_zero(&r, xv, N);
    tu_fill_uniform(&r, R, N, -1, 1);
    for (int i = 0; i < N; i++) ones[i] = 1.0f;
    dt_ctx *ctx = tu_ctx_new();
    dt_tensor *in[2] = {tu_param(ctx, "x", SHP(N), xv), tu_param(ctx, "w", SHP(N), ones)};
    dt_tensor *Rt = tu_tensor(ctx, SHP(N), R);
    dt_tensor *y = dt_recompute(ctx, seg_dropout, in, 2, NULL);
    tu_check(ctx, y, "recompute(dropout)");
    tu_check_status(ctx, dt_backward(ctx, dt_sum(ctx, dt_mul(ctx, y, Rt))), "dt_backward");
    check_dropout_grad(ctx, in[0], y, R, N, 0.5f, 0.5);
    dt_ctx_step_reset(ctx);
    dt_tensor_free(Rt);
    dt_ctx_free(ctx);
}

/* ---------------------------------------------------------------------------
 * A whole small network end to end.
 * ------------------------------------------------------------------------- */
static dt_tensor *f_net(dt_ctx *ctx, dt_tensor *const *in, void *u)
{
    op_args *a = u;
    /* x (2,1,4,4) -> conv 2x3x3 pad 1 -> tanh -> avgpool 2 -> flatten (2,8)
     * -> linear(8->3) -> cross_entropy */
    dt_tensor *h = dt_tanh(ctx, dt_conv2d(ctx, in[0], in[1], in[2], 1, 1));
    h = dt_flatten(ctx, dt_avg_pool2d(ctx, h, 2, 2, 0), 1);
    return dt_cross_entropy(ctx, dt_linear(ctx, h, in[3], in[4]), a->aux);
}

static void test_grad_small_network(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    tu_rng r = {280};
    dt_tensor *in[5] = {tu_param_rand(ctx, &r, "x", SHP(2, 1, 4, 4), -1, 1),
                        tu_param_rand(ctx, &r, "cw", SHP(2, 1, 3, 3), -0.5f, 0.5f),
                        tu_param_rand(ctx, &r, "cb", SHP(2), -0.5f, 0.5f),
                        tu_param_rand(ctx, &r, "fw", SHP(3, 8), -1, 1),
                        tu_param_rand(ctx, &r, "fb", SHP(3), -0.5f, 0.5f)};
    const int32_t labels[2] = {2, 0};
    op_args a = {.aux = tu_tensor_i32(ctx, SHP(2), labels)};
    tu_grad_check(ctx, "conv-pool-linear-xent network", f_net, &a, in, 5, EPS, RTOL, 5e-4);
    dt_tensor_free(a.aux);
    dt_ctx_free(ctx);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_grad_matmul_2d),
    cmocka_unit_test(test_grad_matmul_batched),
    cmocka_unit_test(test_grad_matmul_batched_shared_b),
    cmocka_unit_test(test_grad_matmul_transposed_view),
    cmocka_unit_test(test_grad_leaf_tensor),
    cmocka_unit_test(test_grad_linear),
    cmocka_unit_test(test_grad_binary_same_shape),
    cmocka_unit_test(test_grad_binary_broadcast_3d_by_col),
    cmocka_unit_test(test_grad_binary_broadcast_vec_by_3d),
    cmocka_unit_test(test_grad_binary_broadcast_both),
    cmocka_unit_test(test_grad_scale),
    cmocka_unit_test(test_grad_sum_mean),
    cmocka_unit_test(test_grad_sum_mean_dim),
    cmocka_unit_test(test_grad_activations),
    cmocka_unit_test(test_grad_softmax),
    cmocka_unit_test(test_grad_cross_entropy),
    cmocka_unit_test(test_grad_mse),
    cmocka_unit_test(test_grad_conv2d),
    cmocka_unit_test(test_grad_max_pool2d),
    cmocka_unit_test(test_grad_avg_pool2d),
    cmocka_unit_test(test_grad_views),
    cmocka_unit_test(test_grad_slice),
    cmocka_unit_test(test_grad_concat),
    cmocka_unit_test(test_grad_embedding),
    cmocka_unit_test(test_grad_layer_norm),
    cmocka_unit_test(test_grad_attention),
    cmocka_unit_test(test_grad_custom_op),
    cmocka_unit_test(test_grad_tensor_ops),
    cmocka_unit_test(test_grad_cross_entropy_sequence),
    cmocka_unit_test(test_grad_dropout),
    cmocka_unit_test(test_grad_recompute),
    cmocka_unit_test(test_grad_recompute_dropout),
    cmocka_unit_test(test_grad_small_network),
};

DT_TEST_GROUP(core_grad, tests)
