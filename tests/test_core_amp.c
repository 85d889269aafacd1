/*
 * tests/test_core_amp.c - mixed precision and the staged backend.
 *
 * Autocast: products under DT_PREC_TF32 / BF16 / F16 must equal, within f32
 * summation error, a double-precision product of the inputs rounded by the
 * reference below.  The reference rounds with frexp/ldexp arithmetic, not
 * the bit tricks the library uses, so the two are independent.
 *
 * Loss scaling: gradients made exact (loss = sum(w * c), so dL/dw = c) show
 * the scale applied and removed bit for bit, overflow skipping the step, and
 * the scale's growth.
 *
 * cpu-staged: the CPU kernels behind device-memory semantics, whose
 * asynchronous copies happen only when waited for; here the copies' rules,
 * and tests/checks/staged.sh runs the core and DDP suites on it.
 */
#include "test_util.h"

#include <float.h>

#include "backends/backend.h"

#define RT 1e-5   /* f32 summation of a few dozen products, relative */

/* --- reference rounding -------------------------------------------------- */

/* x rounded to nearest even keeping `bits` mantissa bits after the leading
 * one; min_exp: smallest normal exponent (frexp convention) below which the
 * spacing stops shrinking (f16's subnormals), or INT_MIN for none. */
static double ref_round(double x, int bits, int min_exp, double max_finite)
{
    if (x == 0 || !isfinite(x))
        return x;
    int e;
    frexp(x, &e);                       /* x = m * 2^e, 0.5 <= |m| < 1 */
    if (e < min_exp)
        e = min_exp;
    double q = ldexp(nearbyint(ldexp(x, bits + 1 - e)), e - bits - 1);
    if (fabs(q) > max_finite)
        return copysign(INFINITY, x);
    return q;
}

static float ref_prec(float x, dt_precision p)
{
    switch (p) {
    case DT_PREC_TF32: return (float)ref_round(x, 10, -1000000, FLT_MAX);
    case DT_PREC_BF16: return (float)ref_round(x, 7, -1000000, FLT_MAX);
    case DT_PREC_F16: return (float)ref_round(x, 10, -13, 65504.0);
    default: return x;
    }
}

/* y (m,n) = a (m,k) b (k,n) in double from rounded inputs */
static void ref_matmul(const float *a, const float *b, int m, int k, int n, dt_precision p,
                       double *y)
{
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double s = 0;
            for (int t = 0; t < k; t++)
                s += (double)ref_prec(a[i * k + t], p) * ref_prec(b[t * n + j], p);
            y[i * n + j] = s;
        }
}

static void expect_close(const char *what, const float *got, const double *want, int n)
{
    for (int i = 0; i < n; i++)
        if (fabs(got[i] - want[i]) > RT * (1 + fabs(want[i])))
            fail_msg("%s[%d]: got %.9g, want %.9g", what, i, (double)got[i], want[i]);
}

/* The library's own rounding (backend round_prec) against the reference,
 * over edge cases: ties, carries into the next binade, f16 subnormals and
 * overflow, NaN and infinities. */
static void test_amp_rounding(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    tu_rng r = {7};
    enum { N = 4096 };
    static float x[N], y[N];
    const float edges[] = {1.0f, 1.0f + 0x1p-8f, 1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f,
                           0x1.fffffep0f, 65504.0f, 65519.0f, 65520.0f, 1e6f, 0x1p-14f,
                           0x1p-20f, 0x1.8p-24f, 0x1p-25f, 0x1p-26f, 3e-8f, -2.5f, 0.0f, -0.0f,
                           FLT_MAX, -FLT_MAX, 0x1.ffffp127f};
    int ne = TU_ARRAY_LEN(edges);
    for (int i = 0; i < N; i++) {
        if (i < ne)
            x[i] = edges[i];
        else
            x[i] = ldexpf(tu_uniform(&r, -1.0f, 1.0f), (int)(tu_next(&r) % 60) - 30);
    }
    for (dt_precision p = DT_PREC_TF32; p <= DT_PREC_F16; p++) {
        dt_tensor *t = tu_tensor(ctx, SHP(N), x);
        tu_check_status(ctx, dt_ctx_set_autocast(ctx, p), "set_autocast");
        /* y = x @ I under autocast rounds x (the identity is exact) */
        dt_tensor *eye = tu_tensor(ctx, SHP(1, 1), (const float[]){1.0f});
        dt_tensor *col = dt_reshape(ctx, t, 2, (const int64_t[]){N, 1});
        dt_tensor *out = dt_matmul(ctx, col, eye, 0, 0);
        tu_check(ctx, out, "matmul");
        tu_check_status(ctx, dt_tensor_get(out, y, N), "get");
        for (int i = 0; i < N; i++) {
            float want = ref_prec(x[i], p);
            /* == : the GEMM's sum of -0 is +0; NaN must stay NaN */
            if (!(want == y[i]) && !(isnan(want) && isnan(y[i])))
                fail_msg("precision %d: round(%a) = %a, want %a", (int)p, (double)x[i],
                         (double)y[i], (double)want);
        }
        dt_ctx_step_reset(ctx);
    }
    dt_ctx_free(ctx);
}

/* matmul and batched matmul under each precision: products of rounded
 * inputs; and the f32 result differs from the bf16 one (rounding happened). */
static void test_amp_matmul(void **state)
{
    (void)state;
    enum { M = 5, K = 37, N = 3, B = 2 };
    float a[B * M * K], bm[K * N], y[B * M * N];
    double want[M * N];
    tu_rng r = {11};
    tu_fill_uniform(&r, a, B * M * K, -2.0f, 2.0f);
    tu_fill_uniform(&r, bm, K * N, -2.0f, 2.0f);
    dt_ctx *ctx = tu_ctx_new();
    dt_tensor *ta = tu_tensor(ctx, SHP(B, M, K), a), *tb = tu_tensor(ctx, SHP(K, N), bm);
    float y32[B * M * N];
    for (dt_precision p = DT_PREC_F32; p <= DT_PREC_F16; p++) {
        tu_check_status(ctx, dt_ctx_set_autocast(ctx, p), "set_autocast");
        assert_int_equal(dt_ctx_autocast(ctx), p);
        dt_tensor *out = dt_matmul(ctx, ta, tb, 0, 0);
        tu_check(ctx, out, "matmul");
        tu_check_status(ctx, dt_tensor_get(out, y, B * M * N), "get");
        for (int i = 0; i < B; i++) {
            ref_matmul(a + i * M * K, bm, M, K, N, p, want);
            expect_close("matmul", y + i * M * N, want, M * N);
        }
        if (p == DT_PREC_F32)
            memcpy(y32, y, sizeof y32);
        if (p == DT_PREC_BF16) {
            double most = 0;
            for (int i = 0; i < B * M * N; i++)
                most = fmax(most, fabs(y[i] - y32[i]));
            assert_true(most > 1e-3);   /* bf16 keeps ~3 digits: visibly not f32 */
        }
        dt_ctx_step_reset(ctx);
    }
    dt_ctx_free(ctx);
}

/* Backward runs at the forward's precision even when autocast is off by
 * then (as torch.autocast does).  linear: y = x w^T + b, loss = sum(y * c)
 * with c exact in bf16, so dw = c^T round(x), dx = c round(w). */
static void test_amp_linear_backward(void **state)
{
    (void)state;
    enum { R = 4, IN = 19, OUT = 5 };
    float x[R * IN], w[OUT * IN], bias[OUT], c[R * OUT], gx[R * IN], gw[OUT * IN];
    tu_rng r = {3};
    tu_fill_uniform(&r, x, R * IN, -1.0f, 1.0f);
    tu_fill_uniform(&r, w, OUT * IN, -1.0f, 1.0f);
    tu_fill_uniform(&r, bias, OUT, -1.0f, 1.0f);
    for (int i = 0; i < R * OUT; i++)
        c[i] = (float)((int)(tu_next(&r) % 7) - 3) * 0.25f;   /* exact in bf16 */
    dt_ctx *ctx = tu_ctx_new();
    dt_tensor *tx = tu_param(ctx, "x", SHP(R, IN), x), *tw = tu_param(ctx, "w", SHP(OUT, IN), w);
    dt_tensor *tb = tu_param(ctx, "b", SHP(OUT), bias), *tc = tu_tensor(ctx, SHP(R, OUT), c);
    tu_check_status(ctx, dt_ctx_set_autocast(ctx, DT_PREC_BF16), "set_autocast");
    dt_tensor *y = dt_linear(ctx, tx, tw, tb);
    dt_tensor *loss = dt_sum(ctx, dt_mul(ctx, y, tc));
    tu_check(ctx, loss, "forward");
    tu_check_status(ctx, dt_ctx_set_autocast(ctx, DT_PREC_F32), "autocast off");
    tu_check_status(ctx, dt_backward(ctx, loss), "backward");
    tu_check_status(ctx, dt_tensor_get(dt_tensor_grad(tx), gx, R * IN), "gx");
    tu_check_status(ctx, dt_tensor_get(dt_tensor_grad(tw), gw, OUT * IN), "gw");
    double want_x[R * IN], want_w[OUT * IN];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < IN; j++) {
            double s = 0;
            for (int o = 0; o < OUT; o++)
                s += (double)c[i * OUT + o] * ref_prec(w[o * IN + j], DT_PREC_BF16);
            want_x[i * IN + j] = s;
        }
    for (int o = 0; o < OUT; o++)
        for (int j = 0; j < IN; j++) {
            double s = 0;
            for (int i = 0; i < R; i++)
                s += (double)c[i * OUT + o] * ref_prec(x[i * IN + j], DT_PREC_BF16);
            want_w[o * IN + j] = s;
        }
    expect_close("dx", gx, want_x, R * IN);
    expect_close("dw", gw, want_w, OUT * IN);
    dt_ctx_free(ctx);
}

/* A recomputed segment reruns at the precision its forward had, so its
 * gradients equal the plain bf16 run's bit for bit. */
static dt_tensor *amp_segment(dt_ctx *ctx, dt_tensor *const *in, int n, void *user)
{
    (void)n;
    return dt_relu(ctx, dt_linear(ctx, in[0], (dt_tensor *)user, NULL));
}

static void test_amp_recompute(void **state)
{
    (void)state;
    enum { R = 3, IN = 9, OUT = 4 };
    float x[R * IN], w[OUT * IN], g_plain[OUT * IN], g_re[OUT * IN];
    tu_rng r = {9};
    tu_fill_uniform(&r, x, R * IN, -1.0f, 1.0f);
    tu_fill_uniform(&r, w, OUT * IN, -1.0f, 1.0f);
    for (int pass = 0; pass < 2; pass++) {
        dt_ctx *ctx = tu_ctx_new();
        dt_tensor *tx = tu_tensor(ctx, SHP(R, IN), x), *tw = tu_param(ctx, "w", SHP(OUT, IN), w);
        tu_check_status(ctx, dt_ctx_set_autocast(ctx, DT_PREC_BF16), "set_autocast");
        dt_tensor *y = pass ? dt_recompute(ctx, amp_segment, &tx, 1, tw) : amp_segment(ctx, &tx, 1, tw);
        dt_tensor *loss = dt_sum(ctx, y);
        tu_check(ctx, loss, "forward");
        tu_check_status(ctx, dt_ctx_set_autocast(ctx, DT_PREC_F32), "autocast off");
        tu_check_status(ctx, dt_backward(ctx, loss), "backward");
        tu_check_status(ctx, dt_tensor_get(dt_tensor_grad(tw), pass ? g_re : g_plain, OUT * IN),
                        "grad");
        dt_ctx_free(ctx);
    }
    assert_memory_equal(g_plain, g_re, sizeof g_re);
}

/* conv2d under autocast = conv2d at f32 of pre-rounded inputs (the CPU's
 * fused convolution is bypassed for the composed GEMM path). */
static void test_amp_conv2d(void **state)
{
    (void)state;
    enum { NX = 2 * 3 * 9 * 9, NW = 4 * 3 * 3 * 3, NY = 2 * 4 * 5 * 5 };
    float x[NX], w[NW], xr[NX], wr[NW], y[NY], yr[NY];
    tu_rng r = {5};
    tu_fill_uniform(&r, x, NX, -1.0f, 1.0f);
    tu_fill_uniform(&r, w, NW, -1.0f, 1.0f);
    for (int i = 0; i < NX; i++) xr[i] = ref_prec(x[i], DT_PREC_F16);
    for (int i = 0; i < NW; i++) wr[i] = ref_prec(w[i], DT_PREC_F16);
    dt_ctx *ctx = tu_ctx_new();
    dt_tensor *tx = tu_tensor(ctx, SHP(2, 3, 9, 9), x), *tw = tu_tensor(ctx, SHP(4, 3, 3, 3), w);
    dt_tensor *txr = tu_tensor(ctx, SHP(2, 3, 9, 9), xr), *twr = tu_tensor(ctx, SHP(4, 3, 3, 3), wr);
    tu_check_status(ctx, dt_ctx_set_autocast(ctx, DT_PREC_F16), "set_autocast");
    dt_tensor *out = dt_conv2d(ctx, tx, tw, NULL, 2, 1);
    tu_check(ctx, out, "conv2d f16");
    tu_check_status(ctx, dt_tensor_get(out, y, NY), "get");
    tu_check_status(ctx, dt_ctx_set_autocast(ctx, DT_PREC_F32), "autocast off");
    out = dt_conv2d(ctx, txr, twr, NULL, 2, 1);
    tu_check(ctx, out, "conv2d f32");
    tu_check_status(ctx, dt_tensor_get(out, yr, NY), "get");
    double want[NY];
    for (int i = 0; i < NY; i++) want[i] = yr[i];
    expect_close("conv2d", y, want, NY);
    dt_ctx_free(ctx);
}

/* f16 overflows above 65504: the product is infinite, as on a GPU. */
static void test_amp_f16_overflow(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    dt_tensor *a = tu_tensor(ctx, SHP(1, 2), (const float[]){70000.0f, 1.0f});
    dt_tensor *b = tu_tensor(ctx, SHP(2, 1), (const float[]){1.0f, 1.0f});
    tu_check_status(ctx, dt_ctx_set_autocast(ctx, DT_PREC_F16), "set_autocast");
    float v = dt_tensor_item(dt_matmul(ctx, a, b, 0, 0));
    assert_true(isinf(v) && v > 0);
    tu_check_status(ctx, dt_ctx_set_autocast(ctx, DT_PREC_BF16), "set_autocast");
    v = dt_tensor_item(dt_matmul(ctx, a, b, 0, 0));
    assert_true(fabsf(v - 70001.0f) <= 512.0f);   /* bf16 keeps the range */
    assert_int_equal(dt_ctx_set_autocast(ctx, (dt_precision)9), DT_EINVAL);
    assert_int_equal(dt_ctx_autocast(ctx), DT_PREC_BF16);   /* unchanged by the refusal */
    dt_ctx_free(ctx);
}

/* --- loss scaling ----------------------------------------------------------- */

enum { NP = 6 };
static const float P0[NP] = {0.5f, -1.0f, 2.0f, 0.25f, -0.75f, 1.5f};
static const float C0[NP] = {0.1f, -0.2f, 0.3f, 1.0f, -0.5f, 0.05f};

typedef struct sfix {
    dt_ctx *ctx;
    dt_tensor *w, *c;
    dt_optim *opt;
} sfix;

static void sfix_init(sfix *f)
{
    f->ctx = tu_ctx_new();
    f->w = tu_param(f->ctx, "w", SHP(NP), P0);
    f->c = tu_tensor(f->ctx, SHP(NP), C0);
    dt_optim_config oc;
    dt_optim_config_init(&oc, DT_SGD);
    oc.lr = 0.5f;
    f->opt = dt_optim_new(f->ctx, &oc, NULL, 0);
    tu_check(f->ctx, f->opt, "optim_new");
}

static dt_tensor *sfix_loss(sfix *f) { return dt_sum(f->ctx, dt_mul(f->ctx, f->w, f->c)); }

static void test_loss_scaler_exact(void **state)
{
    (void)state;
    sfix f;
    sfix_init(&f);
    dt_loss_scale_config cfg;
    dt_loss_scale_config_init(&cfg);
    assert_true(cfg.init_scale == 65536.0f && cfg.growth_factor == 2.0f &&
                cfg.backoff_factor == 0.5f && cfg.growth_interval == 2000);
    cfg.init_scale = 1024.0f;
    dt_loss_scaler *sc = dt_loss_scaler_new(f.ctx, &cfg);
    tu_check(f.ctx, sc, "scaler_new");
    tu_check_status(f.ctx, dt_loss_scaler_backward(sc, sfix_loss(&f)), "scaled backward");
    float g[NP], w[NP];
    tu_check_status(f.ctx, dt_tensor_get(dt_tensor_grad(f.w), g, NP), "grad");
    for (int i = 0; i < NP; i++)
        assert_true(g[i] == C0[i] * 1024.0f);
    int inf = -1;
    tu_check_status(f.ctx, dt_loss_scaler_unscale(sc, &inf), "unscale");
    assert_int_equal(inf, 0);
    tu_check_status(f.ctx, dt_loss_scaler_unscale(sc, &inf), "unscale twice");   /* once per step */
    tu_check_status(f.ctx, dt_tensor_get(dt_tensor_grad(f.w), g, NP), "grad");
    for (int i = 0; i < NP; i++)
        assert_true(g[i] == C0[i]);
    int stepped = 0;
    tu_check_status(f.ctx, dt_loss_scaler_step(sc, f.opt, &stepped), "step");
    assert_int_equal(stepped, 1);
    tu_check_status(f.ctx, dt_tensor_get(f.w, w, NP), "w");
    for (int i = 0; i < NP; i++)
        assert_true(w[i] == P0[i] - 0.5f * C0[i]);
    assert_true(dt_loss_scaler_scale(sc) == 1024.0f);
    assert_int_equal(dt_loss_scaler_skipped(sc), 0);
    dt_loss_scaler_free(sc);
    dt_optim_free(f.opt);
    dt_ctx_free(f.ctx);
}

/* A scale so large that fp16 overflows in backward: the step is skipped,
 * the weights are untouched and the scale halves; good steps in a row grow
 * it again. */
static void test_loss_scaler_overflow_and_growth(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    dt_tensor *x = tu_tensor(ctx, SHP(2, 3), (const float[]){1, 2, 3, -1, 0.5f, 2});
    dt_tensor *w = tu_param(ctx, "w", SHP(2, 3), (const float[]){0.1f, 0.2f, 0.3f, -0.1f, 0, 1});
    dt_optim_config oc;
    dt_optim_config_init(&oc, DT_SGD);
    oc.lr = 0.1f;
    dt_optim *opt = dt_optim_new(ctx, &oc, NULL, 0);
    tu_check(ctx, opt, "optim_new");
    dt_loss_scale_config cfg;
    dt_loss_scale_config_init(&cfg);
    cfg.init_scale = 0x1p20f;   /* d(loss) = 2^20: above f16's 65504 */
    cfg.growth_interval = 2;
    dt_loss_scaler *sc = dt_loss_scaler_new(ctx, &cfg);
    tu_check(ctx, sc, "scaler_new");
    tu_check_status(ctx, dt_ctx_set_autocast(ctx, DT_PREC_F16), "set_autocast");
    float w0[6], w1[6];
    tu_check_status(ctx, dt_tensor_get(w, w0, 6), "w");
    float scales[8];
    int took[8];
    for (int s = 0; s < 8; s++) {
        dt_tensor *loss = dt_sum(ctx, dt_linear(ctx, x, w, NULL));
        tu_check_status(ctx, dt_loss_scaler_backward(sc, loss), "backward");
        tu_check_status(ctx, dt_loss_scaler_step(sc, opt, &took[s]), "step");
        scales[s] = dt_loss_scaler_scale(sc);
        if (s == 0) {   /* skipped: nothing moved */
            tu_check_status(ctx, dt_tensor_get(w, w1, 6), "w");
            assert_memory_equal(w0, w1, sizeof w0);
        }
        dt_ctx_zero_grad(ctx);
        dt_ctx_step_reset(ctx);
    }
    /* 2^20 -> 2^19 -> ... each overflow halves until 2^15 (32768 < 65504):
     * overflows at 2^20..2^16 (5 skips), then 2 good steps double it back to
     * 2^16, which overflows again, and so on */
    assert_int_equal(took[0], 0);
    assert_true(scales[0] == 0x1p19f);
    assert_true(scales[4] == 0x1p15f);
    assert_int_equal(took[5], 1);
    assert_int_equal(took[6], 1);
    assert_true(scales[6] == 0x1p16f);   /* grown after 2 good steps */
    assert_int_equal(took[7], 0);        /* 2^16 overflows f16 again */
    assert_true(scales[7] == 0x1p15f);
    assert_int_equal(dt_loss_scaler_skipped(sc), 6);
    tu_check_status(ctx, dt_tensor_get(w, w1, 6), "w");
    assert_true(memcmp(w0, w1, sizeof w0) != 0);   /* the good steps moved it */
    for (int i = 0; i < 6; i++)
        assert_true(isfinite(w1[i]));
    dt_loss_scaler_free(sc);
    dt_optim_free(opt);
    dt_ctx_free(ctx);
}

static void test_loss_scaler_misuse(void **state)
{
    (void)state;
    sfix f;
    sfix_init(&f);
    dt_loss_scale_config cfg;
    dt_loss_scale_config_init(&cfg);
    cfg.backoff_factor = 1.5f;
    assert_null(dt_loss_scaler_new(f.ctx, &cfg));
    assert_int_equal(dt_last_status(f.ctx), DT_EINVAL);
    assert_non_null(strstr(dt_last_error(f.ctx), "backoff"));
    dt_loss_scale_config_init(&cfg);
    cfg.init_scale = 0;
    assert_null(dt_loss_scaler_new(f.ctx, &cfg));
    dt_loss_scaler *sc = dt_loss_scaler_new(f.ctx, NULL);
    tu_check(f.ctx, sc, "scaler_new");
    assert_int_equal(dt_loss_scaler_step(sc, NULL, NULL), DT_EINVAL);
    /* a step needs a scaled backward since the last one (no double unscale) */
    int took = -1;
    assert_int_equal(dt_loss_scaler_step(sc, f.opt, &took), DT_ESTATE);
    assert_int_equal(took, 0);
    tu_check_status(f.ctx, dt_loss_scaler_backward(sc, sfix_loss(&f)), "backward");
    tu_check_status(f.ctx, dt_loss_scaler_unscale(sc, NULL), "unscale");
    dt_ctx_step_reset(f.ctx);
    assert_int_equal(dt_loss_scaler_backward(sc, sfix_loss(&f)), DT_ESTATE);   /* after unscale */
    tu_check_status(f.ctx, dt_loss_scaler_step(sc, f.opt, &took), "step");
    assert_int_equal(took, 1);
    assert_int_equal(dt_loss_scaler_step(sc, f.opt, &took), DT_ESTATE);   /* twice */
    assert_int_equal(dt_loss_scaler_unscale(sc, NULL), DT_ESTATE);
    assert_int_equal(dt_loss_scaler_backward(sc, NULL), DT_EINVAL);
    assert_int_equal(dt_loss_scaler_backward(NULL, NULL), DT_EINVAL);
    assert_int_equal(dt_loss_scaler_unscale(NULL, NULL), DT_EINVAL);
    assert_true(isnan(dt_loss_scaler_scale(NULL)));
    dt_loss_scaler_free(NULL);
    dt_loss_scaler_free(sc);
    dt_optim_free(f.opt);
    dt_ctx_free(f.ctx);
}

/* --- the staged backend ------------------------------------------------------ */

static void *amp_malloc(size_t n, void *u) { (void)u; return malloc(n); }
static void *amp_realloc(void *p, size_t n, void *u) { (void)u; return realloc(p, n); }
static void amp_free(void *p, void *u) { (void)u; free(p); }

static void test_staged_copies_deferred(void **state)
{
    (void)state;
    const dt_backend_iface *be = dt_backend_cpu_staged_iface();
    assert_int_equal(be->host_visible, 0);
    assert_non_null(be->copy_async);
    dt_ctx_config cfg;
    dt_ctx_config_init(&cfg);
    cfg.backend = "cpu-staged";
    dt_ctx *ctx = dt_ctx_new(&cfg);
    tu_check(ctx, ctx, "ctx");
    tu_check_status(ctx, dt_ctx_status(ctx), "cpu-staged context");
    /* the public API works the same on it */
    dt_tensor *t = tu_tensor(ctx, SHP(4), (const float[]){1, 2, 3, 4});
    float back[4];
    tu_check_status(ctx, dt_tensor_get(dt_scale(ctx, t, 2.0f), back, 4), "get");
    assert_true(back[0] == 2 && back[3] == 8);
    dt_ctx_free(ctx);

    dt_backend *b = NULL;
    char err[128] = "";
    dt_backend_params bp = {.threads = 1};
    bp.allocator = (dt_allocator){.malloc_fn = amp_malloc, .realloc_fn = amp_realloc,
                                  .free_fn = amp_free};
    if (be->init(&bp, &b, err, sizeof err) != DT_OK)
        fail_msg("cpu-staged init: %s", err);
    float *dev = be->alloc(b, 8 * sizeof(float)), *host = be->host_alloc(b, 8 * sizeof(float));
    assert_non_null(dev);
    assert_non_null(host);
    for (int i = 0; i < 8; i++) host[i] = (float)i;
    be->memset0(b, dev, 8 * sizeof(float));
    uint64_t t1 = be->copy_async(b, dev, host, 4 * sizeof(float), DT_COPY_H2D);
    uint64_t t2 = be->copy_async(b, dev + 4, host + 4, 4 * sizeof(float), DT_COPY_H2D);
    assert_true(t1 > 0 && t2 > t1);
    float got[8];
    be->to_host(b, got, dev, sizeof got);
    for (int i = 0; i < 8; i++) assert_true(got[i] == 0.0f);   /* not yet */
    be->copy_wait(b, t1);
    be->to_host(b, got, dev, sizeof got);
    assert_true(got[3] == 3.0f && got[4] == 0.0f);   /* t1 only */
    be->copy_join(b, t2);
    be->to_host(b, got, dev, sizeof got);
    for (int i = 0; i < 8; i++) assert_true(got[i] == (float)i);
    be->copy_wait(b, t2);   /* waiting again is harmless */
    be->host_free(b, host);
    be->free(b, dev);
    be->shutdown(b);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_amp_rounding),
    cmocka_unit_test(test_amp_matmul),
    cmocka_unit_test(test_amp_linear_backward),
    cmocka_unit_test(test_amp_recompute),
    cmocka_unit_test(test_amp_conv2d),
    cmocka_unit_test(test_amp_f16_overflow),
    cmocka_unit_test(test_loss_scaler_exact),
    cmocka_unit_test(test_loss_scaler_overflow_and_growth),
    cmocka_unit_test(test_loss_scaler_misuse),
    cmocka_unit_test(test_staged_copies_deferred),
};

DT_TEST_GROUP(core_amp, tests)
