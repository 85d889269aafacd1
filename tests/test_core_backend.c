/*
 * tests/test_core_backend.c - one op, two backends.
 *
 * The CPU backend has a fused per-image convolution; a backend without one
 * (conv2d_forward == NULL) gets the core's composed path: im2col of the
 * whole batch, one GEMM, a permute.  Both must agree.  The second backend is
 * the CPU backend's interface with the fused entries removed, plugged in
 * through dt_ctx_config.custom_backend, which also tests that hook.
 */
#include "test_util.h"

#include "backends/backend.h"

typedef struct conv_case {
    int64_t n, c, h, w, o, k;
    int stride, pad, bias;
} conv_case;

typedef struct conv_result {
    float *y, *dx, *dw, *db;
    int64_t ny, nx, nw, nb;
} conv_result;

static float *rand_buf(uint64_t *seed, int64_t n)
{
    float *p = malloc(sizeof(float) * (size_t)n);
    assert_non_null(p);
    for (int64_t i = 0; i < n; i++) {
        *seed = *seed * 6364136223846793005ull + 1442695040888963407ull;
        p[i] = (float)((double)(*seed >> 40) / (double)(1ull << 24)) * 2.0f - 1.0f;
    }
    return p;
}

static float *fetch(dt_tensor *t, int64_t *n)
{
    *n = dt_tensor_numel(t);
    float *p = malloc(sizeof(float) * (size_t)*n);
    assert_non_null(p);
    assert_int_equal(dt_tensor_get(t, p, *n), DT_OK);
    return p;
}

/* conv forward + backward of sum(y * r) on a context using `iface` */
static conv_result run_conv(const dt_backend_iface *iface, const conv_case *cc, int threads)
{
    dt_ctx_config cfg;
    dt_ctx_config_init(&cfg);
    cfg.threads = threads;
    cfg.custom_backend = iface;
    dt_ctx *ctx = dt_ctx_new(&cfg);
    assert_non_null(ctx);
    assert_int_equal(dt_ctx_status(ctx), DT_OK);
    uint64_t seed = 12345;
    int64_t xs[4] = {cc->n, cc->c, cc->h, cc->w}, ws[4] = {cc->o, cc->c, cc->k, cc->k};
    dt_tensor *x = dt_tensor_new(ctx, DT_F32, 4, xs);
    dt_tensor *w = dt_param_new(ctx, "w", 4, ws);
    dt_tensor *b = cc->bias ? dt_param_new(ctx, "b", 1, (int64_t[]){cc->o}) : NULL;
    assert_non_null(x);
    assert_non_null(w);
    assert_int_equal(dt_tensor_set_requires_grad(x, 1), DT_OK);
    float *hx = rand_buf(&seed, dt_tensor_numel(x)), *hw = rand_buf(&seed, dt_tensor_numel(w));
    dt_tensor_set(x, hx, dt_tensor_numel(x));
    dt_tensor_set(w, hw, dt_tensor_numel(w));
    if (b) {
        float *hb = rand_buf(&seed, cc->o);
        dt_tensor_set(b, hb, cc->o);
        free(hb);
    }
    dt_tensor *y = dt_conv2d(ctx, x, w, b, cc->stride, cc->pad);
    assert_non_null(y);
    dt_tensor *r = dt_tensor_temp(ctx, DT_F32, 4, (int64_t[]){dt_tensor_dim(y, 0), dt_tensor_dim(y, 1),
                                                            dt_tensor_dim(y, 2), dt_tensor_dim(y, 3)});
    float *hr = rand_buf(&seed, dt_tensor_numel(r));
    dt_tensor_set(r, hr, dt_tensor_numel(r));
    dt_tensor *loss = dt_sum(ctx, dt_mul(ctx, y, r));
    assert_non_null(loss);
    assert_int_equal(dt_backward(ctx, loss), DT_OK);
    conv_result out = {0};
    out.y = fetch(y, &out.ny);
    out.dx = fetch(dt_tensor_grad(x), &out.nx);
    out.dw = fetch(dt_tensor_grad(w), &out.nw);
    if (b)
        out.db = fetch(dt_tensor_grad(b), &out.nb);
    free(hx);
    free(hw);
    free(hr);
    dt_ctx_free(ctx);
    return out;
}

static void assert_close_bufs(const char *what, const float *a, const float *b, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]), m = fabs((double)b[i]);
        if (d > 1e-4 * (m + 1.0))
            fail_msg("%s[%lld]: fused %.9g vs composed %.9g", what, (long long)i, (double)a[i],
                     (double)b[i]);
    }
}

static void free_result(conv_result *r)
{
    free(r->y);
    free(r->dx);
    free(r->dw);
    free(r->db);
}

static void compare_case(const conv_case *cc, int threads)
{
    dt_backend_iface composed = *dt_backend_cpu_iface();
    composed.name = "cpu-composed-conv";
    composed.conv2d_forward = NULL;
    composed.conv2d_backward = NULL;
    assert_non_null(dt_backend_cpu_iface()->conv2d_forward);
    conv_result f = run_conv(dt_backend_cpu_iface(), cc, threads);
    conv_result c = run_conv(&composed, cc, threads);
    assert_int_equal(f.ny, c.ny);
    assert_close_bufs("y", f.y, c.y, f.ny);
    assert_close_bufs("dx", f.dx, c.dx, f.nx);
    assert_close_bufs("dw", f.dw, c.dw, f.nw);
    if (cc->bias)
        assert_close_bufs("db", f.db, c.db, f.nb);
    free_result(&f);
    free_result(&c);
}

/* "same" 3x3 (the CNN's shape, whole-plane lowering), batch > threads */
static void test_conv_same_3x3(void **state)
{
    (void)state;
    conv_case cc = {5, 3, 9, 7, 4, 3, 1, 1, 1};
    compare_case(&cc, 1);
    compare_case(&cc, 2);
}

/* strided, unpadded, no bias: the general per-image im2col */
static void test_conv_strided(void **state)
{
    (void)state;
    conv_case cc = {3, 2, 8, 9, 5, 3, 2, 0, 0};
    compare_case(&cc, 2);
    conv_case padded = {2, 3, 7, 7, 2, 5, 2, 2, 1};
    compare_case(&padded, 3);
}

/* 1x1 convolutions skip im2col; batch of one skips the permute */
static void test_conv_pointwise_and_single_image(void **state)
{
    (void)state;
    conv_case pw = {4, 6, 5, 5, 3, 1, 1, 0, 1};
    compare_case(&pw, 2);
    conv_case one = {1, 2, 6, 6, 3, 3, 1, 1, 1};
    compare_case(&one, 1);
}

/* a custom backend with the wrong interface version is refused, clearly */
static void test_custom_backend_version(void **state)
{
    (void)state;
    dt_backend_iface old = *dt_backend_cpu_iface();
    old.version = DT_BACKEND_IFACE_VERSION + 1;
    dt_ctx_config cfg;
    dt_ctx_config_init(&cfg);
    cfg.custom_backend = &old;
    dt_ctx *ctx = dt_ctx_new(&cfg);
    assert_non_null(ctx);
    assert_int_equal(dt_ctx_status(ctx), DT_ENOTSUP);
    assert_non_null(strstr(dt_last_error(ctx), "interface version"));
    assert_null(dt_tensor_new(ctx, DT_F32, 1, (int64_t[]){3}));
    dt_ctx_free(ctx);
}

/* A backend whose device fails underneath (backend.h, fault): the CPU
 * backend with a fault() that reports a lost device once fault_on is set.
 * Every call that hands a result to the user must then fail with the
 * backend's message instead of returning what the dead device left:
 * today's CUDA failure modes, caught here without a GPU. */
static int fault_on;

static dt_status fault_report(dt_backend *be, char *err, size_t err_len)
{
    (void)be;
    if (!fault_on)
        return DT_OK;
    snprintf(err, err_len, "test: an illegal memory access was encountered");
    return DT_EIO;
}

static void assert_device_failure(dt_ctx *ctx, dt_status s)
{
    assert_int_equal(s, DT_EIO);
    assert_non_null(strstr(dt_last_error(ctx), "device failure: test: an illegal memory access"));
}

static void test_backend_fault_reaches_the_user(void **state)
{
    (void)state;
    dt_backend_iface faulty = *dt_backend_cpu_iface();
    faulty.fault = fault_report;
    dt_ctx_config cfg;
    dt_ctx_config_init(&cfg);
    cfg.custom_backend = &faulty;
    dt_ctx *ctx = dt_ctx_new(&cfg);
    assert_int_equal(dt_ctx_status(ctx), DT_OK);
    fault_on = 0;
    dt_tensor *w = dt_param_new(ctx, "w", 2, (int64_t[]){3, 4});
    dt_tensor *x = dt_tensor_new(ctx, DT_F32, 2, (int64_t[]){2, 4});
    dt_tensor *y = dt_tensor_new(ctx, DT_I32, 1, (int64_t[]){2});
    assert_non_null(w);
    assert_non_null(x);
    assert_non_null(y);
    float xv[8] = {1, 2, 3, 4, -1, 0.5f, 2, 0};
    int32_t yv[2] = {0, 2};
    assert_int_equal(dt_tensor_set(x, xv, 8), DT_OK);
    assert_int_equal(dt_tensor_set(y, yv, 2), DT_OK);
    dt_optim_config oc;
    dt_optim_config_init(&oc, DT_SGD);
    dt_optim *opt = dt_optim_new(ctx, &oc, NULL, 0);
    assert_non_null(opt);

    /* healthy: the same calls succeed */
    dt_tensor *logits = dt_linear(ctx, x, w, NULL);
    dt_tensor *loss = dt_cross_entropy(ctx, logits, y);
    assert_non_null(loss);
    assert_int_equal(dt_backward(ctx, loss), DT_OK);
    assert_int_equal(dt_optim_step(opt), DT_OK);
    dt_ctx_step_reset(ctx);

    /* the device dies between the forward and each result */
    logits = dt_linear(ctx, x, w, NULL);
    assert_non_null(logits);
    fault_on = 1;
    assert_null(dt_cross_entropy(ctx, logits, y));
    assert_device_failure(ctx, DT_EIO);
    float out[8];
    assert_device_failure(ctx, dt_tensor_get(x, out, 8));
    assert_true(isnan(dt_tensor_item(x)));
    int64_t correct = 12345;
    assert_device_failure(ctx, dt_count_correct(ctx, logits, y, &correct));
    assert_int_equal(correct, 12345);   /* not overwritten with a made-up count */
    dt_ctx_step_reset(ctx);

    fault_on = 0;
    logits = dt_linear(ctx, x, w, NULL);
    loss = dt_cross_entropy(ctx, logits, y);
    assert_non_null(loss);
    fault_on = 1;
    assert_device_failure(ctx, dt_backward(ctx, loss));
    float norm = -1;
    assert_device_failure(ctx, dt_ctx_clip_grad_norm(ctx, 1.0f, &norm));
    assert_device_failure(ctx, dt_optim_step(opt));
    fault_on = 0;
    dt_ctx_step_reset(ctx);
    dt_optim_free(opt);
    dt_ctx_free(ctx);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_conv_same_3x3),
    cmocka_unit_test(test_conv_strided),
    cmocka_unit_test(test_conv_pointwise_and_single_image),
    cmocka_unit_test(test_custom_backend_version),
    cmocka_unit_test(test_backend_fault_reaches_the_user),
};

DT_TEST_GROUP(core_backend, tests)
