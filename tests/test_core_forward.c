/*
 * tests/test_core_forward.c - forward values against hand-worked numbers
 * (worked out in the comments, or by a naive double-precision loop here).
 */
#include "test_util.h"

#define RT 1e-5
#define AT 1e-6

static void test_fwd_context_basics(void **state)
{
    (void)state;
    dt_ctx_config cfg;
    dt_ctx_config_init(&cfg);
    assert_string_equal(cfg.backend, "cpu");
    assert_int_equal(cfg.seed, 0);
    dt_ctx *ctx = dt_ctx_new(NULL);
    assert_non_null(ctx);
    assert_int_equal(dt_ctx_status(ctx), DT_OK);
    /* DTRAIN_BACKEND (the suite run on cpu-staged) picks the backend */
    const char *env = getenv("DTRAIN_BACKEND");
    assert_string_equal(dt_backend_name(ctx), env && *env ? env : "cpu");
    assert_int_equal(dt_ctx_threads(ctx), 1);
    assert_string_equal(dt_last_error(ctx), "");
    assert_int_equal(dt_last_status(ctx), DT_OK);
    assert_int_equal(dt_ctx_grad_enabled(ctx), 1);
    assert_int_equal(dt_ctx_training(ctx), 1);
    dt_ctx_set_grad_enabled(ctx, 0);
    assert_int_equal(dt_ctx_grad_enabled(ctx), 0);
    dt_ctx_free(ctx);

    cfg.threads = 2;
    ctx = dt_ctx_new(&cfg);
    assert_non_null(ctx);
    assert_int_equal(dt_ctx_threads(ctx), 2);
    dt_ctx_free(ctx);
    dt_ctx_free(NULL);
}

static void test_fwd_tensor_basics(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    assert_int_equal(dt_dtype_size(DT_F32), 4);
    assert_int_equal(dt_dtype_size(DT_I32), 4);
    assert_int_equal(dt_dtype_size(DT_U8), 1);
    assert_int_equal(dt_dtype_size(DT_BF16), 2);
    assert_int_equal(dt_dtype_size(DT_F16), 2);
    dt_tensor *t = dt_tensor_new(ctx, DT_F32, SHP(2, 3, 4));
    tu_check(ctx, t, "dt_tensor_new");
    assert_int_equal(dt_tensor_ndim(t), 3);
    assert_int_equal(dt_tensor_numel(t), 24);
    assert_int_equal(dt_tensor_dim(t, 0), 2);
    assert_int_equal(dt_tensor_dim(t, -1), 4);
    assert_int_equal(dt_tensor_dim(t, -3), 2);
    assert_int_equal(dt_tensor_dtype(t), DT_F32);
    assert_int_equal(dt_tensor_is_contiguous(t), 1);
    assert_string_equal(dt_tensor_name(t), "");
    assert_int_equal(dt_tensor_set_name(t, "hello"), DT_OK);
    assert_string_equal(dt_tensor_name(t), "hello");
    /* zero-filled */
    float v[24];
    assert_int_equal(dt_tensor_get(t, v, 24), DT_OK);
    for (int i = 0; i < 24; i++) assert_true(v[i] == 0.0f);
    assert_int_equal(dt_tensor_fill(t, 2.5f), DT_OK);
    assert_int_equal(dt_tensor_get(t, v, 24), DT_OK);
    for (int i = 0; i < 24; i++) assert_true(v[i] == 2.5f);
    assert_true(dt_tensor_item(t) == 2.5f);
    for (int i = 0; i < 24; i++) v[i] = (float)i;
    assert_int_equal(dt_tensor_set(t, v, 24), DT_OK);
    float w[24];
    assert_int_equal(dt_tensor_get(t, w, 24), DT_OK);
    assert_memory_equal(v, w, sizeof v);

    int32_t iv[3] = {7, -1, 3}, iw[3];
    dt_tensor *ti = tu_tensor_i32(ctx, SHP(3), iv);
    assert_int_equal(dt_tensor_dtype(ti), DT_I32);
    assert_int_equal(dt_tensor_get(ti, iw, 3), DT_OK);
    assert_memory_equal(iv, iw, sizeof iv);

    /* A 0-dim tensor holds one element. */
    dt_tensor *s = dt_tensor_new(ctx, DT_F32, 0, (const int64_t[]){1});
    tu_check(ctx, s, "scalar tensor");
    assert_int_equal(dt_tensor_numel(s), 1);
    float one = 4.0f;
    assert_int_equal(dt_tensor_set(s, &one, 1), DT_OK);
    assert_true(dt_tensor_item(s) == 4.0f);

    /* Step tensors: zero-filled, gone after reset (only checked by ASan). */
    dt_tensor *tmp = dt_tensor_temp(ctx, DT_F32, SHP(5));
    tu_check(ctx, tmp, "dt_tensor_temp");
    TU_EXPECT(ctx, tmp, 0, 0, 0, 0, 0, 0, 0);
    dt_ctx_step_reset(ctx);

    dt_tensor_free(t);
    dt_tensor_free(ti);
    dt_tensor_free(s);
    dt_tensor_free(NULL);
    dt_ctx_free(ctx);
}

static void test_fwd_params(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    dt_tensor *a = tu_param(ctx, "fc1.weight", SHP(3, 2), NULL);
    dt_tensor *b = tu_param(ctx, "fc1.bias", SHP(3), NULL);
    assert_int_equal(dt_param_count(ctx), 2);
    assert_ptr_equal(dt_param_at(ctx, 0), a);
    assert_ptr_equal(dt_param_at(ctx, 1), b);
    assert_ptr_equal(dt_param_find(ctx, "fc1.bias"), b);
    assert_null(dt_param_find(ctx, "nope"));
    assert_string_equal(dt_tensor_name(a), "fc1.weight");
    assert_int_equal(dt_tensor_requires_grad(a), 1);
    TU_EXPECT(ctx, a, 0, 0, 0, 0, 0, 0, 0, 0);
    dt_ctx_free(ctx);
}

/* max |v| and mean v^2 over n values */
static void moments(const float *v, int64_t n, double *mx, double *ms)
{
    *mx = 0;
    *ms = 0;
    for (int64_t i = 0; i < n; i++) {
        *mx = fmax(*mx, fabs(v[i]));
        *ms += (double)v[i] * v[i] / (double)n;
    }
}

/* Layers: PyTorch's names, shapes and default initialisation. */
static void test_fwd_layer_params(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new_with(3, 1);
    dt_tensor *w, *b;
    double mx, ms;
    int64_t n;
    /* linear 300 -> 400: weight bound 1/sqrt(300) (kaiming a = sqrt 5), bias the same */
    tu_check_status(ctx, dt_linear_params(ctx, "fc", 300, 400, 1, &w, &b), "linear_params");
    assert_ptr_equal(dt_param_find(ctx, "fc.weight"), w);
    assert_ptr_equal(dt_param_find(ctx, "fc.bias"), b);
    tu_assert_shape(w, SHP(400, 300));
    tu_assert_shape(b, SHP(400));
    float *v = tu_read(ctx, w, &n);
    moments(v, n, &mx, &ms);
    double bound = 1.0 / sqrt(300.0);
    assert_true(mx <= bound * (1 + 1e-6) && mx > 0.99 * bound);
    assert_true(fabs(ms - bound * bound / 3) < 0.05 * bound * bound / 3);
    free(v);
    v = tu_read(ctx, b, &n);
    moments(v, n, &mx, &ms);
    assert_true(mx <= bound * (1 + 1e-6) && mx > 0.9 * bound);
    free(v);
    /* conv2d 3 -> 8, k 5: fan_in 75 */
    tu_check_status(ctx, dt_conv2d_params(ctx, "conv", 3, 8, 5, 0, &w, &b), "conv2d_params");
    assert_null(b);
    assert_null(dt_param_find(ctx, "conv.bias"));
    tu_assert_shape(w, SHP(8, 3, 5, 5));
    v = tu_read(ctx, w, &n);
    moments(v, n, &mx, &ms);
    bound = 1.0 / sqrt(75.0);   /* uniform in +-bound: max near it, mean square bound^2 / 3 */
    assert_true(mx <= bound * (1 + 1e-6) && mx > 0.95 * bound);
    assert_true(fabs(ms - bound * bound / 3) < 0.15 * bound * bound / 3);   /* 4 sigma at 600 */
    free(v);
    /* embedding: N(0, 1) */
    w = dt_embedding_params(ctx, "wte", 500, 40);
    tu_check(ctx, w, "embedding_params");
    v = tu_read(ctx, w, &n);
    moments(v, n, &mx, &ms);
    assert_true(fabs(ms - 1.0) < 0.05 && mx > 3.0);
    free(v);
    /* layer norm: ones and zeros */
    tu_check_status(ctx, dt_layer_norm_params(ctx, "ln", 6, 1, &w, &b), "layer_norm_params");
    TU_EXPECT(ctx, w, 0, 0, 1, 1, 1, 1, 1, 1);
    TU_EXPECT(ctx, b, 0, 0, 0, 0, 0, 0, 0, 0);
    /* a name taken, an empty one, sizes */
    assert_int_equal(dt_linear_params(ctx, "fc", 3, 4, 1, &w, &b), DT_EINVAL);
    tu_assert_error_mentions(ctx, "fc.weight");
    assert_int_equal(dt_linear_params(ctx, "", 3, 4, 1, &w, &b), DT_EINVAL);
    assert_int_equal(dt_linear_params(ctx, "x", 0, 4, 1, &w, &b), DT_EINVAL);
    assert_null(dt_embedding_params(ctx, "e", 0, 4));
    dt_ctx_free(ctx);
}

/* Initialisers: bounds and moments against the formulas in the header. */
static void test_fwd_init(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new_with(7, 1);
    enum { O = 200, I = 50 };
    dt_tensor *w = tu_param(ctx, "w", SHP(O, I), NULL);
    int64_t n;

    /* kaiming_uniform a=0: bound = sqrt(2) * sqrt(3 / fan_in) */
    tu_check_status(ctx, dt_tensor_init_kaiming_uniform(ctx, w, 0.0f), "kaiming_uniform");
    float *v = tu_read(ctx, w, &n);
    double bound = sqrt(2.0) * sqrt(3.0 / I), mx = 0, s2 = 0;
    for (int64_t i = 0; i < n; i++) {
        mx = fmax(mx, fabs(v[i]));
        s2 += (double)v[i] * v[i];
    }
    assert_true(mx <= bound * (1 + 1e-6));
    assert_true(mx > 0.95 * bound);
    /* var of U(-b,b) = b^2/3 = 2/fan_in */
    assert_true(fabs(s2 / n - 2.0 / I) < 0.1 * (2.0 / I));
    free(v);

    /* kaiming_normal a=sqrt(5): std = sqrt(2/6)/sqrt(fan_in) */
    tu_check_status(ctx, dt_tensor_init_kaiming_normal(ctx, w, sqrtf(5.0f)), "kaiming_normal");
    v = tu_read(ctx, w, &n);
    double m = 0;
    s2 = 0;
    for (int64_t i = 0; i < n; i++) {
        m += v[i];
        s2 += (double)v[i] * v[i];
    }
    m /= n;
    double want_var = (2.0 / 6.0) / I;
    assert_true(fabs(m) < 0.01);
    assert_true(fabs(s2 / n - want_var) < 0.1 * want_var);
    free(v);

    /* xavier_uniform gain 1: bound = sqrt(6/(fan_in+fan_out)) */
    tu_check_status(ctx, dt_tensor_init_xavier_uniform(ctx, w, 1.0f), "xavier_uniform");
    v = tu_read(ctx, w, &n);
    bound = sqrt(6.0 / (I + O));
    mx = 0;
    for (int64_t i = 0; i < n; i++) mx = fmax(mx, fabs(v[i]));
    assert_true(mx <= bound * (1 + 1e-6) && mx > 0.95 * bound);
    free(v);

    /* xavier_normal gain 2: std = 2 sqrt(2/(fan_in+fan_out)) */
    tu_check_status(ctx, dt_tensor_init_xavier_normal(ctx, w, 2.0f), "xavier_normal");
    v = tu_read(ctx, w, &n);
    s2 = 0;
    for (int64_t i = 0; i < n; i++) s2 += (double)v[i] * v[i];
    want_var = 4.0 * 2.0 / (I + O);
    assert_true(fabs(s2 / n - want_var) < 0.1 * want_var);
    free(v);

    /* uniform and normal */
    tu_check_status(ctx, dt_tensor_init_uniform(ctx, w, 2.0f, 3.0f), "uniform");
    v = tu_read(ctx, w, &n);
    for (int64_t i = 0; i < n; i++) assert_true(v[i] >= 2.0f && v[i] <= 3.0f);
    free(v);
    tu_check_status(ctx, dt_tensor_init_normal(ctx, w, 1.0f, 0.5f), "normal");
    v = tu_read(ctx, w, &n);
    m = 0;
    s2 = 0;
    for (int64_t i = 0; i < n; i++) m += v[i];
    m /= n;
    for (int64_t i = 0; i < n; i++) s2 += (v[i] - m) * (v[i] - m);
    assert_true(fabs(m - 1.0) < 0.02);
    assert_true(fabs(sqrt(s2 / n) - 0.5) < 0.02);
    free(v);

    /* bias: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) */
    dt_tensor *b = tu_param(ctx, "b", SHP(O), NULL);
    tu_check_status(ctx, dt_tensor_init_bias(ctx, b, 16), "init_bias");
    v = tu_read(ctx, b, &n);
    mx = 0;
    for (int64_t i = 0; i < n; i++) mx = fmax(mx, fabs(v[i]));
    assert_true(mx <= 0.25 * (1 + 1e-6) && mx > 0.2);
    free(v);

    /* Reseeding reproduces the draw. */
    dt_ctx_seed(ctx, 99);
    dt_tensor_init_uniform(ctx, b, -1, 1);
    float *v1 = tu_read(ctx, b, NULL);
    dt_ctx_seed(ctx, 99);
    dt_tensor_init_uniform(ctx, b, -1, 1);
    float *v2 = tu_read(ctx, b, NULL);
    assert_memory_equal(v1, v2, sizeof(float) * O);
    free(v1);
    free(v2);
    dt_ctx_free(ctx);
}

static void test_fwd_matmul(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    /* [[1,2,3],[4,5,6]] [[7,8],[9,10],[11,12]] = [[58,64],[139,154]] */
    dt_tensor *a = tu_tensor(ctx, SHP(2, 3), (const float[]){1, 2, 3, 4, 5, 6});
    dt_tensor *b = tu_tensor(ctx, SHP(3, 2), (const float[]){7, 8, 9, 10, 11, 12});
    dt_tensor *y = dt_matmul(ctx, a, b, 0, 0);
    tu_assert_shape(y, SHP(2, 2));
    TU_EXPECT(ctx, y, RT, AT, 58, 64, 139, 154);
    /* a^T a (3,3): [[17,22,27],[22,29,36],[27,36,45]] */
    y = dt_matmul(ctx, a, a, 1, 0);
    tu_assert_shape(y, SHP(3, 3));
    TU_EXPECT(ctx, y, RT, AT, 17, 22, 27, 22, 29, 36, 27, 36, 45);
    /* a a^T (2,2): [[14,32],[32,77]] */
    y = dt_matmul(ctx, a, a, 0, 1);
    TU_EXPECT(ctx, y, RT, AT, 14, 32, 32, 77);
    /* b^T a^T = (ab)^T = [[58,139],[64,154]] */
    y = dt_matmul(ctx, b, a, 1, 1);
    TU_EXPECT(ctx, y, RT, AT, 58, 139, 64, 154);

    /* batched (2,2,3) x shared (3,2): second batch is 2*a */
    dt_tensor *a3 = tu_tensor(ctx, SHP(2, 2, 3), (const float[]){1, 2, 3, 4, 5, 6, 2, 4, 6, 8, 10, 12});
    y = dt_matmul(ctx, a3, b, 0, 0);
    tu_assert_shape(y, SHP(2, 2, 2));
    TU_EXPECT(ctx, y, RT, AT, 58, 64, 139, 154, 116, 128, 278, 308);
    /* batched x batched: b3[1] = identity-ish [[1,0],[0,1],[0,0]] */
    dt_tensor *b3 = tu_tensor(ctx, SHP(2, 3, 2), (const float[]){7, 8, 9, 10, 11, 12, 1, 0, 0, 1, 0, 0});
    y = dt_matmul(ctx, a3, b3, 0, 0);
    TU_EXPECT(ctx, y, RT, AT, 58, 64, 139, 154, 2, 4, 8, 10);

    /* A transposed view as operand: transpose(b) (2,3) x transpose(a) (3,2)
     * = (ab)^T */
    y = dt_matmul(ctx, dt_transpose(ctx, b, 0, 1), dt_transpose(ctx, a, 0, 1), 0, 0);
    TU_EXPECT(ctx, y, RT, AT, 58, 139, 64, 154);

    /* linear: x (2,3) w (2,3) b (2) -> x w^T + b.  w = [[1,0,-1],[0.5,0.5,0.5]]
     * row 0: 1-3 = -2, 3; row 1: 4-6 = -2, 7.5; plus b = [10, 20]. */
    dt_tensor *w = tu_tensor(ctx, SHP(2, 3), (const float[]){1, 0, -1, 0.5f, 0.5f, 0.5f});
    dt_tensor *bias = tu_tensor(ctx, SHP(2), (const float[]){10, 20});
    y = dt_linear(ctx, a, w, bias);
    tu_assert_shape(y, SHP(2, 2));
    TU_EXPECT(ctx, y, RT, AT, 8, 23, 8, 27.5);
    y = dt_linear(ctx, a, w, NULL);
    TU_EXPECT(ctx, y, RT, AT, -2, 3, -2, 7.5);
    dt_ctx_step_reset(ctx);
    dt_ctx_free(ctx);
}

static void test_fwd_broadcast(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    dt_tensor *a = tu_tensor(ctx, SHP(2, 3), (const float[]){1, 2, 3, 4, 5, 6});
    dt_tensor *row = tu_tensor(ctx, SHP(3), (const float[]){10, 20, 30});
    dt_tensor *col = tu_tensor(ctx, SHP(2, 1), (const float[]){100, 200});
    dt_tensor *y = dt_add(ctx, a, row);
    tu_assert_shape(y, SHP(2, 3));
    TU_EXPECT(ctx, y, RT, AT, 11, 22, 33, 14, 25, 36);
    y = dt_add(ctx, row, a); /* broadcast on the left operand */
    TU_EXPECT(ctx, y, RT, AT, 11, 22, 33, 14, 25, 36);
    y = dt_add(ctx, a, col);
    TU_EXPECT(ctx, y, RT, AT, 101, 102, 103, 204, 205, 206);
    /* (2,1) + (3) -> (2,3) outer sum */
    y = dt_add(ctx, col, row);
    tu_assert_shape(y, SHP(2, 3));
    TU_EXPECT(ctx, y, RT, AT, 110, 120, 130, 210, 220, 230);
    y = dt_sub(ctx, a, row);
    TU_EXPECT(ctx, y, RT, AT, -9, -18, -27, -6, -15, -24);
    y = dt_sub(ctx, col, a);
    TU_EXPECT(ctx, y, RT, AT, 99, 98, 97, 196, 195, 194);
    y = dt_mul(ctx, a, col);
    TU_EXPECT(ctx, y, RT, AT, 100, 200, 300, 800, 1000, 1200);
    y = dt_div(ctx, row, a);
    TU_EXPECT(ctx, y, RT, AT, 10, 10, 10, 2.5, 4, 5);
    y = dt_scale(ctx, a, -0.5f);
    TU_EXPECT(ctx, y, RT, AT, -0.5, -1, -1.5, -2, -2.5, -3);
    /* (2,3,4) + (3,1): each [b][i][:] gets col3[i] */
    float v24[24];
    for (int i = 0; i < 24; i++) v24[i] = (float)i;
    dt_tensor *x3 = tu_tensor(ctx, SHP(2, 3, 4), v24);
    dt_tensor *c3 = tu_tensor(ctx, SHP(3, 1), (const float[]){1000, 2000, 3000});
    y = dt_add(ctx, x3, c3);
    tu_assert_shape(y, SHP(2, 3, 4));
    float *got = tu_read(ctx, y, NULL);
    double want[24];
    for (int b = 0; b < 2; b++)
        for (int i = 0; i < 3; i++)
            for (int j = 0; j < 4; j++) want[b * 12 + i * 4 + j] = b * 12 + i * 4 + j + 1000.0 * (i + 1);
    tu_assert_close_arr("(2,3,4)+(3,1)", got, want, 24, RT, AT);
    free(got);
    dt_ctx_step_reset(ctx);
    dt_ctx_free(ctx);
}

static void test_fwd_reductions(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    /* x (2,3) = [[1,2,3],[4,5,6]] */
    dt_tensor *x = tu_tensor(ctx, SHP(2, 3), (const float[]){1, 2, 3, 4, 5, 6});
    dt_tensor *y = dt_sum(ctx, x);
    assert_int_equal(dt_tensor_ndim(y), 0);
    assert_float_equal(dt_tensor_item(y), 21.0f, 1e-6);
    y = dt_mean(ctx, x);
    assert_int_equal(dt_tensor_ndim(y), 0);
    assert_float_equal(dt_tensor_item(y), 3.5f, 1e-6);
    y = dt_sum_dim(ctx, x, 0, 0);
    tu_assert_shape(y, SHP(3));
    TU_EXPECT(ctx, y, RT, AT, 5, 7, 9);
    y = dt_sum_dim(ctx, x, 1, 1);
    tu_assert_shape(y, SHP(2, 1));
    TU_EXPECT(ctx, y, RT, AT, 6, 15);
    y = dt_sum_dim(ctx, x, -1, 0);
    tu_assert_shape(y, SHP(2));
    TU_EXPECT(ctx, y, RT, AT, 6, 15);
    y = dt_mean_dim(ctx, x, 0, 1);
    tu_assert_shape(y, SHP(1, 3));
    TU_EXPECT(ctx, y, RT, AT, 2.5, 3.5, 4.5);
    y = dt_mean_dim(ctx, x, -1, 0);
    TU_EXPECT(ctx, y, RT, AT, 2, 5);
    /* middle dim of (2,3,2): x3[b][i][j] = 6b + 2i + j */
    float v[12];
    for (int i = 0; i < 12; i++) v[i] = (float)i;
    dt_tensor *x3 = tu_tensor(ctx, SHP(2, 3, 2), v);
    y = dt_sum_dim(ctx, x3, 1, 0);
    tu_assert_shape(y, SHP(2, 2));
    TU_EXPECT(ctx, y, RT, AT, 6, 9, 24, 27);
    y = dt_mean_dim(ctx, x3, 1, 1);
    tu_assert_shape(y, SHP(2, 1, 2));
    TU_EXPECT(ctx, y, RT, AT, 2, 3, 8, 9);
    dt_ctx_step_reset(ctx);
    dt_ctx_free(ctx);
}

static void test_fwd_activations(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    dt_tensor *x = tu_tensor(ctx, SHP(5), (const float[]){-2, -1, 0, 1, 2});
    TU_EXPECT(ctx, dt_relu(ctx, x), RT, AT, 0, 0, 0, 1, 2);
    /* gelu(x) = x * Phi(x): Phi(1) = 0.841344746, Phi(2) = 0.977249868 */
    TU_EXPECT(ctx, dt_gelu(ctx, x), RT, AT, -0.045500264, -0.158655254, 0, 0.841344746,
              1.954499736);
    TU_EXPECT(ctx, dt_tanh(ctx, x), RT, AT, -0.964027580, -0.761594156, 0, 0.761594156,
              0.964027580);
    TU_EXPECT(ctx, dt_sigmoid(ctx, x), RT, AT, 0.119202922, 0.268941421, 0.5, 0.731058579,
              0.880797078);
    /* Large magnitudes stay finite. */
    dt_tensor *big = tu_tensor(ctx, SHP(2), (const float[]){-100, 100});
    TU_EXPECT(ctx, dt_sigmoid(ctx, big), RT, AT, 0, 1);
    TU_EXPECT(ctx, dt_tanh(ctx, big), RT, AT, -1, 1);
    dt_ctx_step_reset(ctx);
    dt_ctx_free(ctx);
}

static void test_fwd_softmax(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    /* softmax([1,2,3]) = e^k / (e + e^2 + e^3) */
    dt_tensor *x = tu_tensor(ctx, SHP(1, 3), (const float[]){1, 2, 3});
    TU_EXPECT(ctx, dt_softmax(ctx, x, -1), RT, AT, 0.090030573, 0.244728471, 0.665240956);
    TU_EXPECT(ctx, dt_log_softmax(ctx, x, 1), RT, AT, -2.407605964, -1.407605964, -0.407605964);
    /* along dim 0 of (1,3): every entry is alone -> 1 and 0 */
    TU_EXPECT(ctx, dt_softmax(ctx, x, 0), RT, AT, 1, 1, 1);
    TU_EXPECT(ctx, dt_log_softmax(ctx, x, 0), RT, AT, 0, 0, 0);
    /* dim 0 of (3,2): columns [1,2,3] and [0,0,0] */
    dt_tensor *c = tu_tensor(ctx, SHP(3, 2), (const float[]){1, 0, 2, 0, 3, 0});
    TU_EXPECT(ctx, dt_softmax(ctx, c, 0), RT, AT, 0.090030573, 1.0 / 3, 0.244728471, 1.0 / 3,
              0.665240956, 1.0 / 3);
    /* Shift invariance with huge logits: no overflow. */
    dt_tensor *h = tu_tensor(ctx, SHP(3), (const float[]){1001, 1002, 1003});
    TU_EXPECT(ctx, dt_softmax(ctx, h, 0), 1e-4, 1e-6, 0.090030573, 0.244728471, 0.665240956);
    TU_EXPECT(ctx, dt_log_softmax(ctx, h, -1), 1e-4, 1e-5, -2.407605964, -1.407605964,
              -0.407605964);
    dt_ctx_step_reset(ctx);
    dt_ctx_free(ctx);
}

static void test_fwd_losses(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    /* row 0: -log softmax([1,2,3])[2] = 0.407605964;
     * row 1: uniform over 3 classes -> log 3 = 1.098612289.  mean 0.753109126 */
    dt_tensor *logits = tu_tensor(ctx, SHP(2, 3), (const float[]){1, 2, 3, 1, 1, 1});
    dt_tensor *labels = tu_tensor_i32(ctx, SHP(2), (const int32_t[]){2, 0});
    dt_tensor *l = dt_cross_entropy(ctx, logits, labels);
    tu_check(ctx, l, "cross_entropy");
    assert_int_equal(dt_tensor_ndim(l), 0);
    assert_true(tu_close(dt_tensor_item(l), 0.753109126, 1e-5, 0));
    dt_tensor *one = tu_tensor(ctx, SHP(1, 3), (const float[]){1, 2, 3});
    dt_tensor *lab0 = tu_tensor_i32(ctx, SHP(1), (const int32_t[]){0});
    l = dt_cross_entropy(ctx, one, lab0);
    assert_true(tu_close(dt_tensor_item(l), 2.407605964, 1e-5, 0));
    /* mse: mean of (1-0)^2, (2-4)^2, (3-3)^2, (0-(-2))^2 = (1+4+0+4)/4 */
    dt_tensor *p = tu_tensor(ctx, SHP(2, 2), (const float[]){1, 2, 3, 0});
    dt_tensor *t = tu_tensor(ctx, SHP(2, 2), (const float[]){0, 4, 3, -2});
    l = dt_mse(ctx, p, t);
    tu_check(ctx, l, "mse");
    assert_int_equal(dt_tensor_ndim(l), 0);
    assert_true(tu_close(dt_tensor_item(l), 2.25, 1e-6, 0));
    /* dt_count_correct: the rows' argmaxes are 2 and 0 */
    dt_tensor *lg = tu_tensor(ctx, SHP(2, 3), (const float[]){1, 2, 3, 5, 1, 2});
    int64_t correct = -1;
    assert_int_equal(dt_count_correct(ctx, lg, labels, &correct), DT_OK);
    assert_int_equal(correct, 2);
    dt_tensor *lab2 = tu_tensor_i32(ctx, SHP(2), (const int32_t[]){1, 0});
    assert_int_equal(dt_count_correct(ctx, lg, lab2, &correct), DT_OK);
    assert_int_equal(correct, 1);
    dt_ctx_step_reset(ctx);
    dt_tensor_free(labels);
    dt_tensor_free(lab0);
    dt_tensor_free(lab2);
    dt_ctx_free(ctx);
}

/* Naive direct convolution in double. */
static void ref_conv(const float *x, const float *w, const float *b, int n, int c, int h, int wd,
                     int o, int k, int stride, int pad, double *y, int *oh_out, int *ow_out)
{
    int oh = (h + 2 * pad - k) / stride + 1, ow = (wd + 2 * pad - k) / stride + 1;
    for (int in = 0; in < n; in++)
        for (int io = 0; io < o; io++)
            for (int i = 0; i < oh; i++)
                for (int j = 0; j < ow; j++) {
                    double s = b ? b[io] : 0;
                    for (int ic = 0; ic < c; ic++)
                        for (int ki = 0; ki < k; ki++)
                            for (int kj = 0; kj < k; kj++) {
                                int yy = i * stride - pad + ki, xx = j * stride - pad + kj;
                                if (yy < 0 || yy >= h || xx < 0 || xx >= wd) continue;
                                s += (double)x[((in * c + ic) * h + yy) * wd + xx] *
                                     w[((io * c + ic) * k + ki) * k + kj];
                            }
                    y[((in * o + io) * oh + i) * ow + j] = s;
                }
    *oh_out = oh;
    *ow_out = ow;
}

static void test_fwd_conv2d(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    /* x = 1..9 in a 3x3 grid; kernel [[1,2],[3,4]], stride 1, pad 0:
     * 1+4+12+20 = 37, 2+6+15+24 = 47, 4+10+21+32 = 67, 5+12+24+36 = 77 */
    dt_tensor *x = tu_tensor(ctx, SHP(1, 1, 3, 3), (const float[]){1, 2, 3, 4, 5, 6, 7, 8, 9});
    dt_tensor *w = tu_tensor(ctx, SHP(1, 1, 2, 2), (const float[]){1, 2, 3, 4});
    dt_tensor *b = tu_tensor(ctx, SHP(1), (const float[]){0.5f});
    dt_tensor *y = dt_conv2d(ctx, x, w, NULL, 1, 0);
    tu_assert_shape(y, SHP(1, 1, 2, 2));
    TU_EXPECT(ctx, y, RT, AT, 37, 47, 67, 77);
    y = dt_conv2d(ctx, x, w, b, 1, 0);
    TU_EXPECT(ctx, y, RT, AT, 37.5, 47.5, 67.5, 77.5);
    /* all-ones 3x3 kernel, pad 1: sums of each 3x3 neighbourhood */
    dt_tensor *ones = tu_tensor(ctx, SHP(1, 1, 3, 3), (const float[]){1, 1, 1, 1, 1, 1, 1, 1, 1});
    y = dt_conv2d(ctx, x, ones, NULL, 1, 1);
    tu_assert_shape(y, SHP(1, 1, 3, 3));
    TU_EXPECT(ctx, y, RT, AT, 12, 21, 16, 27, 45, 33, 24, 39, 28);
    /* stride 2, pad 1: corners of the previous result */
    y = dt_conv2d(ctx, x, ones, NULL, 2, 1);
    tu_assert_shape(y, SHP(1, 1, 2, 2));
    TU_EXPECT(ctx, y, RT, AT, 12, 16, 24, 28);

    /* A bigger case against the naive loop: x (2,3,6,5), w (4,3,3,3). */
    tu_rng r = {300};
    float xv[2 * 3 * 6 * 5], wv[4 * 3 * 3 * 3], bv[4];
    tu_fill_uniform(&r, xv, TU_ARRAY_LEN(xv), -1, 1);
    tu_fill_uniform(&r, wv, TU_ARRAY_LEN(wv), -1, 1);
    tu_fill_uniform(&r, bv, 4, -1, 1);
    dt_tensor *X = tu_tensor(ctx, SHP(2, 3, 6, 5), xv);
    dt_tensor *W = tu_tensor(ctx, SHP(4, 3, 3, 3), wv);
    dt_tensor *B = tu_tensor(ctx, SHP(4), bv);
    static const int sp[3][2] = {{1, 1}, {2, 0}, {2, 1}};
    for (int c = 0; c < 3; c++) {
        double ref[2 * 4 * 6 * 5];
        int oh, ow;
        ref_conv(xv, wv, bv, 2, 3, 6, 5, 4, 3, sp[c][0], sp[c][1], ref, &oh, &ow);
        y = dt_conv2d(ctx, X, W, B, sp[c][0], sp[c][1]);
        tu_assert_shape(y, SHP(2, 4, oh, ow));
        float *got = tu_read(ctx, y, NULL);
        tu_assert_close_arr("conv2d vs naive loop", got, ref, 2 * 4 * oh * ow, 1e-5, 1e-5);
        free(got);
    }
    dt_ctx_step_reset(ctx);
    dt_ctx_free(ctx);
}

static void test_fwd_pool(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    float v[16];
    for (int i = 0; i < 16; i++) v[i] = (float)(i + 1);
    /* 4x4 grid 1..16:
     *   1  2  3  4
     *   5  6  7  8
     *   9 10 11 12
     *  13 14 15 16 */
    dt_tensor *x = tu_tensor(ctx, SHP(1, 1, 4, 4), v);
    dt_tensor *y = dt_max_pool2d(ctx, x, 2, 2, 0);
    tu_assert_shape(y, SHP(1, 1, 2, 2));
    TU_EXPECT(ctx, y, RT, AT, 6, 8, 14, 16);
    y = dt_avg_pool2d(ctx, x, 2, 2, 0);
    TU_EXPECT(ctx, y, RT, AT, 3.5, 5.5, 11.5, 13.5);
    /* kernel 3 stride 1: 2x2 of window max / mean */
    y = dt_max_pool2d(ctx, x, 3, 1, 0);
    tu_assert_shape(y, SHP(1, 1, 2, 2));
    TU_EXPECT(ctx, y, RT, AT, 11, 12, 15, 16);
    y = dt_avg_pool2d(ctx, x, 3, 1, 0);
    TU_EXPECT(ctx, y, RT, AT, 6, 7, 10, 11);
    /* max with pad 1, kernel 2, stride 2 -> 3x3: padding never wins, even
     * with negative inputs */
    for (int i = 0; i < 16; i++) v[i] = -(float)(i + 1);
    dt_tensor *neg = tu_tensor(ctx, SHP(1, 1, 4, 4), v);
    y = dt_max_pool2d(ctx, neg, 2, 2, 1);
    tu_assert_shape(y, SHP(1, 1, 3, 3));
    TU_EXPECT(ctx, y, RT, AT, -1, -2, -4, -5, -6, -8, -13, -14, -16);
    dt_ctx_step_reset(ctx);
    dt_ctx_free(ctx);
}

static void test_fwd_layer_norm(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    /* [1,2,3,4]: mean 2.5, biased var 1.25 -> (x - 2.5)/sqrt(1.25 + eps) */
    dt_tensor *x = tu_tensor(ctx, SHP(2, 4), (const float[]){1, 2, 3, 4, 10, 10, 10, 10});
    double s = 1.0 / sqrt(1.25 + 1e-5);
    dt_tensor *y = dt_layer_norm(ctx, x, NULL, NULL, 1e-5f);
    tu_assert_shape(y, SHP(2, 4));
    float *got = tu_read(ctx, y, NULL);
    double want[8] = {-1.5 * s, -0.5 * s, 0.5 * s, 1.5 * s, 0, 0, 0, 0};
    tu_assert_close_arr("layer_norm", got, want, 8, 1e-5, 1e-5);
    free(got);
    dt_tensor *w = tu_tensor(ctx, SHP(4), (const float[]){1, 2, 3, 4});
    dt_tensor *b = tu_tensor(ctx, SHP(4), (const float[]){0, 1, 0, -1});
    y = dt_layer_norm(ctx, x, w, b, 1e-5f);
    got = tu_read(ctx, y, NULL);
    double want2[8] = {-1.5 * s, -1.0 * s + 1, 1.5 * s, 6 * s - 1, 0, 1, 0, -1};
    tu_assert_close_arr("layer_norm w,b", got, want2, 8, 1e-5, 1e-5);
    free(got);
    dt_ctx_step_reset(ctx);
    dt_ctx_free(ctx);
}

static void test_fwd_views(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    float v[24];
    for (int i = 0; i < 24; i++) v[i] = (float)i;
    dt_tensor *x = tu_tensor(ctx, SHP(2, 3, 4), v);
    dt_tensor *y = dt_reshape(ctx, x, SHP(4, -1));
    tu_assert_shape(y, SHP(4, 6));
    float *got = tu_read(ctx, y, NULL);
    assert_memory_equal(got, v, sizeof v);
    free(got);
    y = dt_flatten(ctx, x, 1);
    tu_assert_shape(y, SHP(2, 12));
    y = dt_flatten(ctx, x, 0);
    tu_assert_shape(y, SHP(24));
    /* transpose(0,2): y[k][j][i] = x[i][j][k] = 12i + 4j + k */
    y = dt_transpose(ctx, x, 0, 2);
    tu_assert_shape(y, SHP(4, 3, 2));
    got = tu_read(ctx, y, NULL);
    for (int k = 0; k < 4; k++)
        for (int j = 0; j < 3; j++)
            for (int i = 0; i < 2; i++)
                if (got[(k * 3 + j) * 2 + i] != (float)(12 * i + 4 * j + k))
                    fail_msg("transpose[%d][%d][%d]: expected %d, got %g", k, j, i,
                             12 * i + 4 * j + k, (double)got[(k * 3 + j) * 2 + i]);
    free(got);
    /* contiguous of the transposed view gives the same values */
    dt_tensor *c = dt_contiguous(ctx, y);
    tu_check(ctx, c, "contiguous");
    assert_int_equal(dt_tensor_is_contiguous(c), 1);
    assert_ptr_equal(dt_contiguous(ctx, x), x);
    /* slice dim 1 [1,3) of (2,3,4): rows 1..2 of each batch */
    y = dt_slice(ctx, x, 1, 1, 3);
    tu_assert_shape(y, SHP(2, 2, 4));
    TU_EXPECT(ctx, y, 0, 0, 4, 5, 6, 7, 8, 9, 10, 11, 16, 17, 18, 19, 20, 21, 22, 23);
    /* slice last dim [2,4) */
    y = dt_slice(ctx, x, -1, 2, 4);
    tu_assert_shape(y, SHP(2, 3, 2));
    TU_EXPECT(ctx, y, 0, 0, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23);
    /* concat */
    dt_tensor *a = tu_tensor(ctx, SHP(2, 2), (const float[]){1, 2, 3, 4});
    dt_tensor *b = tu_tensor(ctx, SHP(1, 2), (const float[]){5, 6});
    dt_tensor *cc = tu_tensor(ctx, SHP(2, 1), (const float[]){7, 8});
    dt_tensor *ab[2] = {a, b}, *ac[2] = {a, cc};
    y = dt_concat(ctx, ab, 2, 0);
    tu_assert_shape(y, SHP(3, 2));
    TU_EXPECT(ctx, y, 0, 0, 1, 2, 3, 4, 5, 6);
    y = dt_concat(ctx, ac, 2, 1);
    tu_assert_shape(y, SHP(2, 3));
    TU_EXPECT(ctx, y, 0, 0, 1, 2, 7, 3, 4, 8);
    y = dt_concat(ctx, ac, 2, -1);
    TU_EXPECT(ctx, y, 0, 0, 1, 2, 7, 3, 4, 8);
    dt_ctx_step_reset(ctx);
    dt_ctx_free(ctx);
}

static void test_fwd_embedding(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    dt_tensor *w = tu_tensor(ctx, SHP(4, 2), (const float[]){0, 1, 10, 11, 20, 21, 30, 31});
    dt_tensor *idx = tu_tensor_i32(ctx, SHP(2, 2), (const int32_t[]){3, 0, 1, 3});
    dt_tensor *y = dt_embedding(ctx, w, idx);
    tu_assert_shape(y, SHP(2, 2, 2));
    TU_EXPECT(ctx, y, 0, 0, 30, 31, 0, 1, 10, 11, 30, 31);
    dt_ctx_step_reset(ctx);
    dt_tensor_free(idx);
    dt_ctx_free(ctx);
}

static void test_fwd_dropout(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    float v[100];
    for (int i = 0; i < 100; i++) v[i] = (float)(i + 1);
    dt_tensor *x = tu_tensor(ctx, SHP(100), v);
    /* p = 0 and eval mode are the identity */
    dt_tensor *y = dt_dropout(ctx, x, 0.0f);
    float *got = tu_read(ctx, y, NULL);
    assert_memory_equal(got, v, sizeof v);
    free(got);
    dt_ctx_set_training(ctx, 0);
    y = dt_dropout(ctx, x, 0.9f);
    got = tu_read(ctx, y, NULL);
    assert_memory_equal(got, v, sizeof v);
    free(got);
    dt_ctx_set_training(ctx, 1);
    /* two calls in one step draw different masks */
    float *m1 = tu_read(ctx, dt_dropout(ctx, x, 0.5f), NULL);
    float *m2 = tu_read(ctx, dt_dropout(ctx, x, 0.5f), NULL);
    int same = 1;
    for (int i = 0; i < 100; i++) same &= ((m1[i] == 0) == (m2[i] == 0));
    assert_false(same);
    free(m1);
    free(m2);
    dt_ctx_step_reset(ctx);
    dt_ctx_free(ctx);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_fwd_context_basics),
    cmocka_unit_test(test_fwd_tensor_basics),
    cmocka_unit_test(test_fwd_params),
    cmocka_unit_test(test_fwd_init),
    cmocka_unit_test(test_fwd_layer_params),
    cmocka_unit_test(test_fwd_matmul),
    cmocka_unit_test(test_fwd_broadcast),
    cmocka_unit_test(test_fwd_reductions),
    cmocka_unit_test(test_fwd_activations),
    cmocka_unit_test(test_fwd_softmax),
    cmocka_unit_test(test_fwd_losses),
    cmocka_unit_test(test_fwd_conv2d),
    cmocka_unit_test(test_fwd_pool),
    cmocka_unit_test(test_fwd_layer_norm),
    cmocka_unit_test(test_fwd_views),
    cmocka_unit_test(test_fwd_embedding),
    cmocka_unit_test(test_fwd_dropout),
};

DT_TEST_GROUP(core_forward, tests)
