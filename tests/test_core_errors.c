/*
 * tests/test_core_errors.c - bad input through the public API gives a
 * status and a message naming the op, never an abort: NULL everywhere,
 * wrong shapes, wrong dtypes, out-of-range values, misuse.
 */
#include "test_util.h"

/* y must be NULL with an error status and a message naming op; clears
 * the error for the next case. */
#define EXPECT_OP_ERROR(ctx, expr, op)                                        \
    do {                                                                      \
        dt_clear_error(ctx);                                                  \
        dt_tensor *y_ = (expr);                                               \
        if (y_ != NULL) fail_msg("%s: expected NULL", #expr);                 \
        if (dt_last_status(ctx) == DT_OK)                                     \
            fail_msg("%s: returned NULL but the status is DT_OK", #expr);    \
        tu_assert_error_mentions(ctx, op);                                    \
        dt_clear_error(ctx);                                                  \
    } while (0)

/* A status-returning call must fail with a message. */
#define EXPECT_STATUS_ERROR(ctx, expr)                                        \
    do {                                                                      \
        dt_clear_error(ctx);                                                  \
        dt_status s_ = (expr);                                                \
        if (s_ == DT_OK) fail_msg("%s: expected an error status", #expr);     \
        if (dt_last_error(ctx)[0] == '\0') fail_msg("%s: no message", #expr); \
        dt_clear_error(ctx);                                                  \
    } while (0)

/* NULL tensor input: NULL out, and the error of the op that failed first
 * stays (so a chain is checked once, at its end).  `first` is that earlier
 * failure, made here by a bad matmul. */
#define EXPECT_NULL_PASSTHROUGH(ctx, expr)                                    \
    do {                                                                      \
        dt_clear_error(ctx);                                                  \
        assert_null(dt_matmul(ctx, first_a, first_a, 0, 0));                  \
        char before_[DT_MAX_ERROR];                                           \
        snprintf(before_, sizeof before_, "%s", dt_last_error(ctx));          \
        dt_status st_ = dt_last_status(ctx);                                  \
        assert_true(st_ != DT_OK && strstr(before_, "matmul"));               \
        if ((expr) != NULL) fail_msg("%s: expected NULL", #expr);             \
        if (dt_last_status(ctx) != st_ || strcmp(dt_last_error(ctx), before_)) \
            fail_msg("%s: a NULL input replaced the first error (\"%s\") with \"%s\"", \
                     #expr, before_, dt_last_error(ctx));                     \
        /* with no earlier failure: still NULL, and no crash */              \
        dt_clear_error(ctx);                                                  \
        if ((expr) != NULL) fail_msg("%s: expected NULL", #expr);             \
    } while (0)

static void test_err_strerror(void **state)
{
    (void)state;
    for (int s = DT_OK; s <= DT_EOF; s++) {
        const char *m = dt_strerror((dt_status)s);
        assert_non_null(m);
        assert_true(m[0] != '\0');
    }
    assert_non_null(dt_strerror((dt_status)999));
    assert_non_null(dt_strerror((dt_status)-1));
    /* the library's version is the header's (one build); its string says the same */
    assert_int_equal(dt_version(), DTRAIN_VERSION_MAJOR * 10000 + DTRAIN_VERSION_MINOR * 100 +
                                       DTRAIN_VERSION_PATCH);
    assert_string_equal(dt_version_string(), DTRAIN_VERSION_STRING);
    char v[32];
    snprintf(v, sizeof v, "%d.%d.%d", dt_version() / 10000, dt_version() / 100 % 100,
             dt_version() % 100);
    assert_string_equal(v, dt_version_string());
    /* the library's struct sizes are this header's (one build); unknown: 0 */
    assert_int_equal(dt_struct_size("dt_ctx_config"), sizeof(dt_ctx_config));
    assert_int_equal(dt_struct_size("dt_profile_stats"), sizeof(dt_profile_stats));
    assert_int_equal(dt_struct_size("dt_monitor_config"), sizeof(dt_monitor_config));
    assert_int_equal(dt_struct_size("dt_nothing"), 0);
    assert_int_equal(dt_struct_size(NULL), 0);
    assert_non_null(dt_dtype_name(DT_F32));
    assert_non_null(dt_dtype_name((dt_dtype)999));
}

static void test_err_null_ctx(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    dt_tensor *t = tu_tensor(ctx, SHP(2, 2), NULL);
    dt_tensor *p = tu_param(ctx, "p", SHP(2, 2), NULL);
    dt_tensor *lab = tu_tensor_i32(ctx, SHP(2), NULL);
    float buf[4] = {0};

    /* context */
    assert_int_not_equal(dt_ctx_status(NULL), DT_OK);
    assert_non_null(dt_last_error(NULL));
    assert_string_equal(dt_last_warning(NULL), "");
    dt_ctx_set_log(NULL, NULL, NULL);   /* ignored */
    (void)dt_last_status(NULL);
    dt_clear_error(NULL);
    (void)dt_backend_name(NULL);
    (void)dt_ctx_threads(NULL);
    dt_ctx_set_grad_enabled(NULL, 1);
    (void)dt_ctx_grad_enabled(NULL);
    dt_ctx_set_training(NULL, 1);
    (void)dt_ctx_training(NULL);
    dt_mem_stats st;
    dt_mem_stats_get(NULL, &st);
    dt_mem_stats_get(ctx, NULL);
    dt_mem_peak_reset(NULL);
    dt_ctx_step_reset(NULL);
    dt_ctx_zero_grad(NULL);
    dt_ctx_seed(NULL, 1);
    dt_ctx_config_init(NULL);

    /* tensors */
    assert_null(dt_tensor_new(NULL, DT_F32, SHP(2)));
    assert_null(dt_tensor_temp(NULL, DT_F32, SHP(2)));
    assert_int_not_equal(dt_tensor_set(NULL, buf, 4), DT_OK);
    assert_int_not_equal(dt_tensor_get(NULL, buf, 4), DT_OK);
    EXPECT_STATUS_ERROR(ctx, dt_tensor_set(t, NULL, 4));
    EXPECT_STATUS_ERROR(ctx, dt_tensor_get(t, NULL, 4));
    assert_int_not_equal(dt_tensor_fill(NULL, 1), DT_OK);
    assert_true(isnan(dt_tensor_item(NULL)));
    (void)dt_tensor_ndim(NULL);
    (void)dt_tensor_dim(NULL, 0);
    (void)dt_tensor_numel(NULL);
    (void)dt_tensor_dtype(NULL);
    (void)dt_tensor_is_contiguous(NULL);
    assert_non_null(dt_tensor_name(NULL));
    assert_int_not_equal(dt_tensor_set_name(NULL, "x"), DT_OK);
    EXPECT_STATUS_ERROR(ctx, dt_tensor_set_name(t, NULL));
    assert_null(dt_tensor_grad(NULL));
    assert_int_equal(dt_tensor_requires_grad(NULL), 0);
    assert_int_not_equal(dt_tensor_set_requires_grad(NULL, 1), DT_OK);

    /* params and init */
    assert_null(dt_param_new(NULL, "x", SHP(2)));
    assert_int_equal(dt_param_count(NULL), 0);
    assert_null(dt_param_at(NULL, 0));
    assert_null(dt_param_find(NULL, "p"));
    assert_null(dt_param_find(ctx, NULL));
    assert_null(dt_param_at(ctx, -1));
    assert_null(dt_param_at(ctx, 99));
    assert_int_not_equal(dt_tensor_init_uniform(NULL, p, 0, 1), DT_OK);
    assert_int_not_equal(dt_tensor_init_normal(NULL, p, 0, 1), DT_OK);
    assert_int_not_equal(dt_tensor_init_kaiming_uniform(NULL, p, 0), DT_OK);
    assert_int_not_equal(dt_tensor_init_kaiming_normal(NULL, p, 0), DT_OK);
    assert_int_not_equal(dt_tensor_init_xavier_uniform(NULL, p, 1), DT_OK);
    assert_int_not_equal(dt_tensor_init_xavier_normal(NULL, p, 1), DT_OK);
    assert_int_not_equal(dt_tensor_init_bias(NULL, p, 4), DT_OK);
    EXPECT_STATUS_ERROR(ctx, dt_tensor_init_uniform(ctx, NULL, 0, 1));
    EXPECT_STATUS_ERROR(ctx, dt_tensor_init_kaiming_uniform(ctx, NULL, 0));
    EXPECT_STATUS_ERROR(ctx, dt_tensor_init_bias(ctx, NULL, 4));

    /* ops with a NULL context */
    assert_null(dt_relu(NULL, t));
    assert_null(dt_matmul(NULL, t, t, 0, 0));
    assert_null(dt_add(NULL, t, t));
    assert_null(dt_sum(NULL, t));
    assert_null(dt_reshape(NULL, t, SHP(4)));
    assert_null(dt_cross_entropy(NULL, t, lab));
    assert_null(dt_conv2d(NULL, t, t, NULL, 1, 0));
    assert_null(dt_dropout(NULL, t, 0.5f));
    assert_null(dt_recompute(NULL, NULL, &t, 1, NULL));

    /* autograd */
    dt_tensor *loss = dt_sum(ctx, dt_mul(ctx, p, t));
    tu_check(ctx, loss, "loss");
    assert_int_not_equal(dt_backward(NULL, loss), DT_OK);
    EXPECT_STATUS_ERROR(ctx, dt_backward(ctx, NULL));
    dt_ctx_step_reset(ctx);

    /* optimizers */
    dt_optim_config oc;
    dt_optim_config_init(&oc, DT_SGD);
    dt_optim_config_init(NULL, DT_SGD);
    assert_null(dt_optim_new(NULL, &oc, NULL, 0));
    dt_clear_error(ctx);
    assert_null(dt_optim_new(ctx, NULL, NULL, 0));
    assert_true(dt_last_error(ctx)[0] != '\0');
    dt_tensor *nullp[1] = {NULL};
    assert_null(dt_optim_new(ctx, &oc, nullp, 1));
    assert_int_not_equal(dt_optim_step(NULL), DT_OK);
    dt_optim_zero_grad(NULL);
    (void)dt_optim_lr(NULL);
    assert_int_not_equal(dt_optim_set_lr(NULL, 0.1f), DT_OK);
    (void)dt_optim_steps(NULL);
    assert_int_equal(dt_optim_state_count(NULL), 0);
    assert_null(dt_optim_state_at(NULL, 0));
    dt_schedule sch = {.kind = DT_SCHED_CONSTANT};
    assert_int_not_equal(dt_optim_set_schedule(NULL, &sch), DT_OK);
    (void)dt_schedule_lr(NULL, 0.1f, 0);
    assert_int_not_equal(dt_ctx_clip_grad_norm(NULL, 1.0f, NULL), DT_OK);
    dt_optim *opt = dt_optim_new(ctx, &oc, NULL, 0);
    tu_check(ctx, opt, "optim");
    assert_int_not_equal(dt_optim_set_schedule(opt, NULL), DT_OK);
    assert_null(dt_optim_state_at(opt, -1));
    assert_null(dt_optim_state_at(opt, 1000));

    /* checkpoints */
    assert_int_not_equal(dt_checkpoint_save(NULL, NULL, "/tmp/x", 0, NULL), DT_OK);
    assert_int_not_equal(dt_checkpoint_load(NULL, NULL, "/tmp/x", NULL, NULL, NULL), DT_OK);
    EXPECT_STATUS_ERROR(ctx, dt_checkpoint_save(ctx, opt, NULL, 0, NULL));
    EXPECT_STATUS_ERROR(ctx, dt_checkpoint_load(ctx, opt, NULL, NULL, NULL, NULL));

    /* data */
    assert_null(dt_dataset_load_idx(NULL, "a", "b"));
    dt_clear_error(ctx);
    assert_null(dt_dataset_load_idx(ctx, NULL, NULL));
    assert_true(dt_last_error(ctx)[0] != '\0');
    dt_dataset_free(NULL);
    (void)dt_dataset_size(NULL);
    int64_t shp[DT_MAX_DIMS];
    (void)dt_dataset_sample_shape(NULL, shp);
    (void)dt_dataset_classes(NULL);
    assert_null(dt_dataset_image(NULL, 0));
    (void)dt_dataset_label(NULL, 0);
    dt_loader_config lc;
    dt_loader_config_init(&lc);
    dt_loader_config_init(NULL);
    assert_null(dt_loader_new(NULL, NULL, &lc));
    dt_clear_error(ctx);
    assert_null(dt_loader_new(ctx, NULL, &lc));
    assert_true(dt_last_error(ctx)[0] != '\0');
    dt_loader_free(NULL);
    assert_int_not_equal(dt_loader_start_epoch(NULL, 0), DT_OK);
    dt_tensor *x, *y;
    dt_status s = dt_loader_next(NULL, &x, &y);
    assert_int_not_equal(s, DT_OK);
    assert_int_not_equal(s, DT_EOF);
    (void)dt_loader_batches(NULL);
    (void)dt_loader_wait_seconds(NULL);

    /* utilities */
    int64_t correct;
    assert_int_not_equal(dt_count_correct(NULL, t, lab, &correct), DT_OK);
    EXPECT_STATUS_ERROR(ctx, dt_count_correct(ctx, NULL, lab, &correct));
    EXPECT_STATUS_ERROR(ctx, dt_count_correct(ctx, t, NULL, &correct));
    EXPECT_STATUS_ERROR(ctx, dt_count_correct(ctx, t, lab, NULL));
    assert_true(dt_now() > 0);

    dt_optim_free(opt);
    dt_tensor_free(t);
    dt_tensor_free(lab);
    dt_ctx_free(ctx);
}

static dt_tensor *seg_id(dt_ctx *ctx, dt_tensor *const *in, int n, void *u)
{
    (void)n;
    (void)u;
    return dt_relu(ctx, in[0]);
}

static dt_tensor *seg_null(dt_ctx *ctx, dt_tensor *const *in, int n, void *u)
{
    (void)ctx;
    (void)in;
    (void)n;
    (void)u;
    return NULL;
}

/* Every op given a NULL tensor returns NULL and leaves the error alone, so
 * the first failure of a chain is the one reported. */
static void test_err_null_inputs_chain(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    dt_tensor *a = tu_tensor(ctx, SHP(2, 3), NULL);
    dt_tensor *w = tu_tensor(ctx, SHP(4, 3), NULL);
    dt_tensor *img = tu_tensor(ctx, SHP(1, 1, 4, 4), NULL);
    dt_tensor *k = tu_tensor(ctx, SHP(1, 1, 3, 3), NULL);
    dt_tensor *lab = tu_tensor_i32(ctx, SHP(2), NULL);
    dt_tensor *n = NULL;
    dt_tensor *pair[2] = {a, NULL};
    dt_tensor *first_a = a; /* (2,3) x (2,3): the earlier failure */

    EXPECT_NULL_PASSTHROUGH(ctx, dt_reshape(ctx, n, SHP(6)));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_flatten(ctx, n, 0));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_transpose(ctx, n, 0, 1));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_slice(ctx, n, 0, 0, 1));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_contiguous(ctx, n));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_concat(ctx, pair, 2, 0));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_matmul(ctx, n, w, 0, 1));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_matmul(ctx, a, n, 0, 1));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_linear(ctx, n, w, NULL));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_linear(ctx, a, n, NULL));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_add(ctx, n, a));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_sub(ctx, a, n));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_mul(ctx, n, a));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_div(ctx, a, n));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_scale(ctx, n, 2));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_sum(ctx, n));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_mean(ctx, n));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_sum_dim(ctx, n, 0, 0));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_mean_dim(ctx, n, 0, 1));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_relu(ctx, n));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_gelu(ctx, n));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_tanh(ctx, n));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_sigmoid(ctx, n));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_softmax(ctx, n, 0));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_log_softmax(ctx, n, 0));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_cross_entropy(ctx, n, lab));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_cross_entropy(ctx, a, n));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_mse(ctx, n, a));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_mse(ctx, a, n));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_conv2d(ctx, n, k, NULL, 1, 0));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_conv2d(ctx, img, n, NULL, 1, 0));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_max_pool2d(ctx, n, 2, 2, 0));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_avg_pool2d(ctx, n, 2, 2, 0));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_embedding(ctx, n, lab));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_embedding(ctx, w, n));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_layer_norm(ctx, n, NULL, NULL, 1e-5f));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_dropout(ctx, n, 0.5f));
    EXPECT_NULL_PASSTHROUGH(ctx, dt_recompute(ctx, seg_id, &n, 1, NULL));

    /* A chain: the first error (matmul's) is the one reported. */
    dt_clear_error(ctx);
    dt_tensor *out = dt_sum(ctx, dt_relu(ctx, dt_add(ctx, dt_matmul(ctx, a, a, 0, 0), a)));
    assert_null(out);
    assert_int_not_equal(dt_last_status(ctx), DT_OK);
    tu_assert_error_mentions(ctx, "matmul");
    assert_int_not_equal(dt_backward(ctx, out), DT_OK);

    /* clear_error */
    dt_clear_error(ctx);
    assert_string_equal(dt_last_error(ctx), "");
    assert_int_equal(dt_last_status(ctx), DT_OK);
    dt_ctx_step_reset(ctx);
    dt_tensor_free(a);
    dt_tensor_free(w);
    dt_tensor_free(img);
    dt_tensor_free(k);
    dt_tensor_free(lab);
    dt_ctx_free(ctx);
}

/* recompute without a function, with a function that returns NULL (and
 * sets no error), with a negative input count: NULL and a message. */
static void test_err_recompute_misuse(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    dt_tensor *a = tu_param(ctx, "a", SHP(2, 3), NULL);
    EXPECT_OP_ERROR(ctx, dt_recompute(ctx, NULL, &a, 1, NULL), "recompute");
    EXPECT_OP_ERROR(ctx, dt_recompute(ctx, seg_id, &a, -1, NULL), "recompute");
    EXPECT_OP_ERROR(ctx, dt_recompute(ctx, seg_null, &a, 1, NULL), "recompute");
    dt_ctx_step_reset(ctx);
    dt_ctx_free(ctx);
}

static void test_err_shapes(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    dt_tensor *a23 = tu_tensor(ctx, SHP(2, 3), NULL);
    dt_tensor *a45 = tu_tensor(ctx, SHP(4, 5), NULL);
    dt_tensor *a32 = tu_tensor(ctx, SHP(3, 2), NULL);
    dt_tensor *a234 = tu_tensor(ctx, SHP(2, 3, 4), NULL);
    dt_tensor *a345 = tu_tensor(ctx, SHP(3, 4, 5), NULL);
    dt_tensor *v3 = tu_tensor(ctx, SHP(3), NULL);
    dt_tensor *v4 = tu_tensor(ctx, SHP(4), NULL);

    /* matmul */
    EXPECT_OP_ERROR(ctx, dt_matmul(ctx, a23, a45, 0, 0), "matmul");
    EXPECT_OP_ERROR(ctx, dt_matmul(ctx, a23, a23, 0, 0), "matmul");
    EXPECT_OP_ERROR(ctx, dt_matmul(ctx, a32, a32, 0, 0), "matmul");
    EXPECT_OP_ERROR(ctx, dt_matmul(ctx, a23, a23, 1, 1), "matmul"); /* (3,2) x (3,2) */
    EXPECT_OP_ERROR(ctx, dt_matmul(ctx, a234, a345, 0, 0), "matmul");
    EXPECT_OP_ERROR(ctx, dt_matmul(ctx, v3, a32, 0, 0), "matmul");
    /* linear */
    dt_tensor *w43 = tu_tensor(ctx, SHP(4, 3), NULL);
    EXPECT_OP_ERROR(ctx, dt_linear(ctx, a23, a45, NULL), "linear");
    EXPECT_OP_ERROR(ctx, dt_linear(ctx, a23, w43, v3), "linear");
    /* broadcasting */
    EXPECT_OP_ERROR(ctx, dt_add(ctx, a23, v4), "add");
    EXPECT_OP_ERROR(ctx, dt_sub(ctx, a23, a32), "sub");
    EXPECT_OP_ERROR(ctx, dt_mul(ctx, a234, a32), "mul");
    EXPECT_OP_ERROR(ctx, dt_div(ctx, v4, a23), "div");
    /* reductions and softmax dims */
    EXPECT_OP_ERROR(ctx, dt_sum_dim(ctx, a23, 2, 0), "sum_dim");
    EXPECT_OP_ERROR(ctx, dt_sum_dim(ctx, a23, -3, 0), "sum_dim");
    EXPECT_OP_ERROR(ctx, dt_mean_dim(ctx, a23, 5, 1), "mean_dim");
    EXPECT_OP_ERROR(ctx, dt_softmax(ctx, a23, 2), "softmax");
    EXPECT_OP_ERROR(ctx, dt_log_softmax(ctx, a23, -3), "log_softmax");
    /* losses */
    dt_tensor *lab2 = tu_tensor_i32(ctx, SHP(2), (const int32_t[]){0, 2});
    dt_tensor *lab3 = tu_tensor_i32(ctx, SHP(3), (const int32_t[]){0, 1, 2});
    dt_tensor *labf = tu_tensor(ctx, SHP(2), (const float[]){0, 1});
    dt_tensor *lab_hi = tu_tensor_i32(ctx, SHP(2), (const int32_t[]){0, 3});
    dt_tensor *lab_neg = tu_tensor_i32(ctx, SHP(2), (const int32_t[]){-1, 0});
    dt_tensor *lab22 = tu_tensor_i32(ctx, SHP(2, 1), (const int32_t[]){0, 1});
    EXPECT_OP_ERROR(ctx, dt_cross_entropy(ctx, a23, labf), "cross_entropy");
    EXPECT_OP_ERROR(ctx, dt_cross_entropy(ctx, a23, lab3), "cross_entropy");
    EXPECT_OP_ERROR(ctx, dt_cross_entropy(ctx, a23, lab22), "cross_entropy");
    EXPECT_OP_ERROR(ctx, dt_cross_entropy(ctx, v3, lab2), "cross_entropy");
    dt_clear_error(ctx);
    assert_null(dt_cross_entropy(ctx, a23, lab_hi));
    assert_int_equal(dt_last_status(ctx), DT_EINVAL);
    tu_assert_error_mentions(ctx, "cross_entropy");
    dt_clear_error(ctx);
    assert_null(dt_cross_entropy(ctx, a23, lab_neg));
    assert_int_equal(dt_last_status(ctx), DT_EINVAL);
    tu_assert_error_mentions(ctx, "cross_entropy");
    EXPECT_OP_ERROR(ctx, dt_mse(ctx, a23, a32), "mse");
    /* conv and pooling */
    dt_tensor *x3 = tu_tensor(ctx, SHP(1, 3, 5, 5), NULL);
    dt_tensor *w1 = tu_tensor(ctx, SHP(2, 1, 3, 3), NULL);
    dt_tensor *w3 = tu_tensor(ctx, SHP(2, 3, 3, 3), NULL);
    dt_tensor *big = tu_tensor(ctx, SHP(2, 3, 7, 7), NULL);
    EXPECT_OP_ERROR(ctx, dt_conv2d(ctx, x3, w1, NULL, 1, 0), "conv2d");
    EXPECT_OP_ERROR(ctx, dt_conv2d(ctx, x3, w3, v3, 1, 0), "conv2d"); /* bias 3 for 2 outputs */
    EXPECT_OP_ERROR(ctx, dt_conv2d(ctx, a234, w3, NULL, 1, 0), "conv2d");
    EXPECT_OP_ERROR(ctx, dt_conv2d(ctx, x3, w3, NULL, 0, 0), "conv2d");
    EXPECT_OP_ERROR(ctx, dt_conv2d(ctx, x3, w3, NULL, 1, -1), "conv2d");
    EXPECT_OP_ERROR(ctx, dt_conv2d(ctx, x3, big, NULL, 1, 0), "conv2d"); /* kernel > input */
    EXPECT_OP_ERROR(ctx, dt_max_pool2d(ctx, x3, 0, 1, 0), "max_pool2d");
    EXPECT_OP_ERROR(ctx, dt_max_pool2d(ctx, x3, 2, -2, 0), "max_pool2d");
    EXPECT_OP_ERROR(ctx, dt_max_pool2d(ctx, x3, 2, 2, 2), "max_pool2d"); /* pad > kernel/2 */
    EXPECT_OP_ERROR(ctx, dt_max_pool2d(ctx, x3, 6, 1, 0), "max_pool2d");
    EXPECT_OP_ERROR(ctx, dt_max_pool2d(ctx, a234, 2, 2, 0), "max_pool2d");
    EXPECT_OP_ERROR(ctx, dt_avg_pool2d(ctx, x3, 0, 1, 0), "avg_pool2d");
    EXPECT_OP_ERROR(ctx, dt_avg_pool2d(ctx, x3, 2, -1, 0), "avg_pool2d");
    EXPECT_OP_ERROR(ctx, dt_avg_pool2d(ctx, a23, 2, 2, 0), "avg_pool2d");
    /* embedding and layer_norm */
    dt_tensor *emb = tu_tensor(ctx, SHP(6, 3), NULL);
    dt_tensor *idx_hi = tu_tensor_i32(ctx, SHP(2), (const int32_t[]){0, 6});
    dt_tensor *idx_neg = tu_tensor_i32(ctx, SHP(2), (const int32_t[]){-1, 0});
    EXPECT_OP_ERROR(ctx, dt_embedding(ctx, emb, labf), "embedding");
    EXPECT_OP_ERROR(ctx, dt_embedding(ctx, v3, lab2), "embedding");
    EXPECT_OP_ERROR(ctx, dt_embedding(ctx, emb, idx_hi), "embedding");
    EXPECT_OP_ERROR(ctx, dt_embedding(ctx, emb, idx_neg), "embedding");
    EXPECT_OP_ERROR(ctx, dt_layer_norm(ctx, a23, v4, NULL, 1e-5f), "layer_norm");
    EXPECT_OP_ERROR(ctx, dt_layer_norm(ctx, a23, v3, v4, 1e-5f), "layer_norm");
    EXPECT_OP_ERROR(ctx, dt_dropout(ctx, a23, -0.1f), "dropout");
    EXPECT_OP_ERROR(ctx, dt_dropout(ctx, a23, 1.5f), "dropout");
    /* views */
    EXPECT_OP_ERROR(ctx, dt_reshape(ctx, a23, SHP(4, 2)), "reshape");
    EXPECT_OP_ERROR(ctx, dt_reshape(ctx, a23, SHP(-1, -1)), "reshape");
    EXPECT_OP_ERROR(ctx, dt_reshape(ctx, a23, SHP(4, -1)), "reshape");
    EXPECT_OP_ERROR(ctx, dt_reshape(ctx, a23, SHP(-2, -3)), "reshape");
    EXPECT_OP_ERROR(ctx, dt_reshape(ctx, a23, SHP(1, 1, 1, 1, 1, 1, 6)), "reshape");
    EXPECT_OP_ERROR(ctx, dt_flatten(ctx, a23, 2), "flatten");
    EXPECT_OP_ERROR(ctx, dt_transpose(ctx, a23, 0, 2), "transpose");
    EXPECT_OP_ERROR(ctx, dt_transpose(ctx, a23, -3, 0), "transpose");
    EXPECT_OP_ERROR(ctx, dt_slice(ctx, a23, 1, 0, 4), "slice");
    EXPECT_OP_ERROR(ctx, dt_slice(ctx, a23, 1, 2, 1), "slice");
    EXPECT_OP_ERROR(ctx, dt_slice(ctx, a23, 2, 0, 1), "slice");
    EXPECT_OP_ERROR(ctx, dt_slice(ctx, a23, 0, 5, 6), "slice");
    dt_tensor *c24 = tu_tensor(ctx, SHP(2, 4), NULL);
    dt_tensor *mis[2] = {a23, c24}, *mis_nd[2] = {a23, v3}, *ok2[2] = {a23, a23};
    EXPECT_OP_ERROR(ctx, dt_concat(ctx, mis, 2, 0), "concat");
    EXPECT_OP_ERROR(ctx, dt_concat(ctx, mis_nd, 2, 0), "concat");
    EXPECT_OP_ERROR(ctx, dt_concat(ctx, ok2, 2, 2), "concat");
    EXPECT_OP_ERROR(ctx, dt_concat(ctx, ok2, 0, 0), "concat");
    EXPECT_OP_ERROR(ctx, dt_concat(ctx, NULL, 2, 0), "concat");

    /* The context still works after all that. */
    dt_clear_error(ctx);
    dt_tensor *fine = dt_matmul(ctx, a23, a32, 0, 0);
    tu_check(ctx, fine, "matmul after errors");
    tu_assert_shape(fine, SHP(2, 2));
    dt_ctx_step_reset(ctx);
    dt_ctx_free(ctx);
}

static void test_err_dtypes(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    dt_tensor *i = tu_tensor_i32(ctx, SHP(2, 3), NULL);
    dt_tensor *f = tu_tensor(ctx, SHP(2, 3), NULL);
    dt_tensor *u8 = dt_tensor_new(ctx, DT_U8, SHP(2, 3));
    dt_tensor *bf = dt_tensor_new(ctx, DT_BF16, SHP(2, 3));
    tu_check(ctx, u8, "u8 tensor");
    tu_check(ctx, bf, "bf16 tensor");
    EXPECT_OP_ERROR(ctx, dt_relu(ctx, i), "relu");
    EXPECT_OP_ERROR(ctx, dt_gelu(ctx, u8), "gelu");
    EXPECT_OP_ERROR(ctx, dt_matmul(ctx, i, i, 0, 1), "matmul");
    EXPECT_OP_ERROR(ctx, dt_add(ctx, f, i), "add");
    EXPECT_OP_ERROR(ctx, dt_sum(ctx, i), "sum");
    EXPECT_OP_ERROR(ctx, dt_softmax(ctx, i, 0), "softmax");
    EXPECT_OP_ERROR(ctx, dt_cross_entropy(ctx, i, i), "cross_entropy");
    /* bf16 is storage only: DT_ENOTSUP */
    dt_clear_error(ctx);
    assert_null(dt_relu(ctx, bf));
    assert_int_equal(dt_last_status(ctx), DT_ENOTSUP);
    tu_assert_error_mentions(ctx, "relu");
    dt_clear_error(ctx);
    /* initialisers fill f32 tensors only */
    EXPECT_STATUS_ERROR(ctx, dt_tensor_init_uniform(ctx, i, 0, 1));
    dt_ctx_step_reset(ctx);
    dt_tensor_free(i);
    dt_tensor_free(f);
    dt_tensor_free(u8);
    dt_tensor_free(bf);
    dt_ctx_free(ctx);
}

static void test_err_tensor_misuse(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    /* creation */
    EXPECT_STATUS_ERROR(ctx, dt_tensor_new(ctx, DT_F32, 7, (const int64_t[]){1, 1, 1, 1, 1, 1, 1}) ? DT_OK : dt_last_status(ctx));
    EXPECT_STATUS_ERROR(ctx, dt_tensor_new(ctx, DT_F32, -1, (const int64_t[]){1}) ? DT_OK : dt_last_status(ctx));
    EXPECT_STATUS_ERROR(ctx, dt_tensor_new(ctx, DT_F32, SHP(2, -3)) ? DT_OK : dt_last_status(ctx));
    EXPECT_STATUS_ERROR(ctx, dt_tensor_new(ctx, DT_F32, 2, NULL) ? DT_OK : dt_last_status(ctx));
    EXPECT_STATUS_ERROR(ctx, dt_tensor_new(ctx, (dt_dtype)42, SHP(2)) ? DT_OK : dt_last_status(ctx));
    EXPECT_STATUS_ERROR(ctx, dt_tensor_temp(ctx, DT_F32, SHP(-1)) ? DT_OK : dt_last_status(ctx));
    /* absurd size: an error, not an abort */
    dt_clear_error(ctx);
    assert_null(dt_tensor_new(ctx, DT_F32, SHP((int64_t)1 << 40, (int64_t)1 << 40)));
    assert_int_not_equal(dt_last_status(ctx), DT_OK);

    /* set / get with the wrong count leave the data alone */
    dt_tensor *t = tu_tensor(ctx, SHP(2, 3), (const float[]){1, 2, 3, 4, 5, 6});
    float buf[8] = {9, 9, 9, 9, 9, 9, 9, 9};
    dt_clear_error(ctx);
    assert_int_equal(dt_tensor_set(t, buf, 5), DT_EINVAL);
    assert_int_equal(dt_tensor_set(t, buf, 7), DT_EINVAL);
    assert_int_equal(dt_tensor_set(t, buf, -1), DT_EINVAL);
    assert_int_equal(dt_tensor_get(t, buf, 5), DT_EINVAL);
    assert_true(buf[0] == 9);
    TU_EXPECT(ctx, t, 0, 0, 1, 2, 3, 4, 5, 6);
    /* long names are refused (DT_MAX_NAME includes the NUL) */
    char longname[DT_MAX_NAME + 10];
    memset(longname, 'x', sizeof longname - 1);
    longname[sizeof longname - 1] = 0;
    EXPECT_STATUS_ERROR(ctx, dt_tensor_set_name(t, longname));

    /* params: duplicate, long and missing names */
    dt_tensor *p = tu_param(ctx, "fc.weight", SHP(2), NULL);
    dt_clear_error(ctx);
    assert_null(dt_param_new(ctx, "fc.weight", SHP(3)));
    assert_int_not_equal(dt_last_status(ctx), DT_OK);
    tu_assert_error_mentions(ctx, "fc.weight");
    assert_int_equal(dt_param_count(ctx), 1);
    assert_ptr_equal(dt_param_find(ctx, "fc.weight"), p);
    dt_clear_error(ctx);
    assert_null(dt_param_new(ctx, longname, SHP(3)));
    assert_int_not_equal(dt_last_status(ctx), DT_OK);
    dt_clear_error(ctx);
    assert_null(dt_param_new(ctx, NULL, SHP(3)));
    assert_int_not_equal(dt_last_status(ctx), DT_OK);
    dt_clear_error(ctx);
    assert_null(dt_param_new(ctx, "neg", SHP(-3)));
    assert_int_not_equal(dt_last_status(ctx), DT_OK);
    assert_int_equal(dt_param_count(ctx), 1);

    /* backward on a non-scalar */
    dt_tensor *y = dt_mul(ctx, p, p);
    tu_check(ctx, y, "mul");
    dt_clear_error(ctx);
    assert_int_not_equal(dt_backward(ctx, y), DT_OK);
    tu_assert_error_mentions(ctx, "backward");
    dt_ctx_step_reset(ctx);
    dt_tensor_free(t);
    dt_ctx_free(ctx);
}

static void test_err_optim_and_sched(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    tu_param(ctx, "w", SHP(3), NULL);
    dt_optim_config c;
    dt_optim_config_init(&c, DT_ADAM);
    c.lr = -1.0f;
    EXPECT_STATUS_ERROR(ctx, dt_optim_new(ctx, &c, NULL, 0) ? DT_OK : dt_last_status(ctx));
    dt_optim_config_init(&c, DT_ADAM);
    c.beta1 = 1.5f;
    EXPECT_STATUS_ERROR(ctx, dt_optim_new(ctx, &c, NULL, 0) ? DT_OK : dt_last_status(ctx));
    dt_optim_config_init(&c, DT_ADAM);
    c.eps = -1e-8f;
    EXPECT_STATUS_ERROR(ctx, dt_optim_new(ctx, &c, NULL, 0) ? DT_OK : dt_last_status(ctx));
    dt_optim_config_init(&c, DT_SGD);
    c.kind = (dt_optim_kind)77;
    EXPECT_STATUS_ERROR(ctx, dt_optim_new(ctx, &c, NULL, 0) ? DT_OK : dt_last_status(ctx));
    dt_optim_config_init(&c, DT_SGD);
    dt_tensor *w = dt_param_find(ctx, "w");
    EXPECT_STATUS_ERROR(ctx, dt_optim_new(ctx, &c, &w, -1) ? DT_OK : dt_last_status(ctx));

    dt_optim *opt = dt_optim_new(ctx, &c, NULL, 0);
    tu_check(ctx, opt, "optim");
    EXPECT_STATUS_ERROR(ctx, dt_optim_set_lr(opt, -0.1f));
    EXPECT_STATUS_ERROR(ctx, dt_optim_set_lr(opt, NAN));
    assert_float_equal(dt_optim_lr(opt), 0.01f, 0);
    dt_schedule s = {.kind = DT_SCHED_STEP, .step_size = 0, .gamma = 0.5f};
    EXPECT_STATUS_ERROR(ctx, dt_optim_set_schedule(opt, &s));
    (void)dt_schedule_lr(&s, 0.1f, 5); /* a pure function: no crash */
    dt_schedule cs = {.kind = DT_SCHED_COSINE, .warmup_steps = 10, .total_steps = 5};
    EXPECT_STATUS_ERROR(ctx, dt_optim_set_schedule(opt, &cs));
    (void)dt_schedule_lr(&cs, 0.1f, 7);
    dt_schedule cz = {.kind = DT_SCHED_COSINE, .warmup_steps = 0, .total_steps = 0};
    float lr0 = dt_schedule_lr(&cz, 0.1f, 0);
    assert_false(isnan(lr0));
    EXPECT_STATUS_ERROR(ctx, dt_optim_set_schedule(opt, &cz));   /* would train at min_lr */
    dt_schedule bad = {.kind = (dt_sched_kind)9};
    EXPECT_STATUS_ERROR(ctx, dt_optim_set_schedule(opt, &bad));
    EXPECT_STATUS_ERROR(ctx, dt_ctx_clip_grad_norm(ctx, -1.0f, NULL));
    EXPECT_STATUS_ERROR(ctx, dt_ctx_clip_grad_norm(ctx, NAN, NULL));
    dt_optim_free(opt);
    dt_ctx_free(ctx);
}

static void test_err_data_misuse(void **state)
{
    (void)state;
    char dir[64], img[128], lab[128];
    tu_tmpdir(dir, sizeof dir);
    snprintf(img, sizeof img, "%s/img", dir);
    snprintf(lab, sizeof lab, "%s/lab", dir);
    /* 4 samples of 2x2 */
    const uint8_t ib[16 + 16] = {0, 0, 8, 3, 0, 0, 0, 4, 0, 0, 0, 2, 0, 0, 0, 2};
    const uint8_t lb[8 + 4] = {0, 0, 8, 1, 0, 0, 0, 4, 0, 1, 2, 1};
    tu_write_file(img, ib, sizeof ib);
    tu_write_file(lab, lb, sizeof lb);
    dt_ctx *ctx = tu_ctx_new();
    dt_dataset *ds = dt_dataset_load_idx(ctx, img, lab);
    tu_check(ctx, ds, "dataset");
    assert_null(dt_dataset_image(ds, -1));
    assert_null(dt_dataset_image(ds, 4));
    assert_true(dt_dataset_label(ds, 4) < 0);
    assert_true(dt_dataset_label(ds, -1) < 0);

    dt_loader_config c;
    dt_loader_config_init(&c);
    c.batch = 0;
    EXPECT_STATUS_ERROR(ctx, dt_loader_new(ctx, ds, &c) ? DT_OK : dt_last_status(ctx));
    c.batch = -2;
    EXPECT_STATUS_ERROR(ctx, dt_loader_new(ctx, ds, &c) ? DT_OK : dt_last_status(ctx));
    c.batch = 2;
    c.shard_count = 2;
    c.shard_rank = 2;
    EXPECT_STATUS_ERROR(ctx, dt_loader_new(ctx, ds, &c) ? DT_OK : dt_last_status(ctx));
    c.shard_rank = -1;
    EXPECT_STATUS_ERROR(ctx, dt_loader_new(ctx, ds, &c) ? DT_OK : dt_last_status(ctx));
    c.shard_rank = 0;
    c.shard_count = 0;
    c.std = 0;
    EXPECT_STATUS_ERROR(ctx, dt_loader_new(ctx, ds, &c) ? DT_OK : dt_last_status(ctx));
    c.std = 1;
    dt_loader *ld = dt_loader_new(ctx, ds, &c);
    tu_check(ctx, ld, "loader");
    tu_check_status(ctx, dt_loader_start_epoch(ld, 0), "start");
    dt_tensor *x, *y;
    EXPECT_STATUS_ERROR(ctx, dt_loader_next(ld, NULL, &y));
    EXPECT_STATUS_ERROR(ctx, dt_loader_next(ld, &x, NULL));
    dt_loader_free(ld);
    dt_dataset_free(ds);
    dt_ctx_free(ctx);
    tu_rmdir(dir);
}

/* A context whose backend did not start keeps the message and refuses
 * every other call. */
static void test_err_bad_backend(void **state)
{
    (void)state;
    dt_ctx_config cfg;
    dt_ctx_config_init(&cfg);
    cfg.backend = "no-such-backend";
    char *env = getenv("DTRAIN_BACKEND") ? strdup(getenv("DTRAIN_BACKEND")) : NULL;
    unsetenv("DTRAIN_BACKEND");   /* it would replace the bad name */
    dt_ctx *ctx = dt_ctx_new(&cfg);
    assert_non_null(ctx);
    assert_int_not_equal(dt_ctx_status(ctx), DT_OK);
    assert_true(dt_last_error(ctx)[0] != '\0');
    assert_null(dt_tensor_new(ctx, DT_F32, SHP(2)));
    assert_null(dt_param_new(ctx, "w", SHP(2)));
    dt_optim_config oc;
    dt_optim_config_init(&oc, DT_SGD);
    assert_null(dt_optim_new(ctx, &oc, NULL, 0));
    assert_int_not_equal(dt_checkpoint_save(ctx, NULL, "/tmp/dtrain-never-written", 0, NULL), DT_OK);
    assert_int_not_equal(access("/tmp/dtrain-never-written", F_OK), 0);
    /* every call that reaches the backend checks first: none may crash */
    assert_int_not_equal(dt_ctx_set_autocast(ctx, DT_PREC_BF16), DT_OK);
    float buf[2] = {0, 0};
    assert_null(dt_tensor_wrap(ctx, DT_F32, SHP(2), buf));
    assert_null(dt_tensor_temp(ctx, DT_F32, SHP(2)));
    assert_null(dt_dataset_load_idx(ctx, "a", "b"));
    assert_null(dt_loss_scaler_new(ctx, NULL));
    assert_int_not_equal(dt_profile_start(ctx, NULL), DT_OK);
    assert_int_not_equal(dt_ctx_clip_grad_norm(ctx, 1.0f, NULL), DT_OK);
    assert_int_not_equal(dt_backward(ctx, NULL), DT_OK);
    int64_t correct = 0;
    assert_int_not_equal(dt_count_correct(ctx, NULL, NULL, &correct), DT_OK);
    dt_mem_stats ms;
    dt_mem_stats_get(ctx, &ms);
    dt_ctx_zero_grad(ctx);
    dt_ctx_seed(ctx, 3);
    dt_ctx_set_grad_enabled(ctx, 0);
    dt_ctx_set_training(ctx, 0);
    dt_ctx_step_reset(ctx);
    dt_ctx_free(ctx);

    cfg.backend = NULL;
    ctx = dt_ctx_new(&cfg);
    assert_non_null(ctx);
    /* NULL backend name: either the default or a clean refusal */
    if (dt_ctx_status(ctx) != DT_OK) assert_true(dt_last_error(ctx)[0] != '\0');
    dt_ctx_free(ctx);
    if (env)
        setenv("DTRAIN_BACKEND", env, 1);
    free(env);
}

/* Config structs by dtrain.h's rule ("Config structs"): a caller built
 * against an older header (a shorter struct_size) gets the *_init defaults
 * for the fields it does not have, whatever bytes lie past its struct; one
 * that skipped *_init (struct_size 0) or comes from a newer header with a
 * field set past this library's struct is refused, naming the struct. */
static void test_err_config_struct_sizes(void **state)
{
    (void)state;
    /* an older dt_ctx_config: only backend; threads and seed past it are junk */
    dt_ctx_config old;
    dt_ctx_config_init(&old);
    old.struct_size = offsetof(dt_ctx_config, threads);
    old.threads = 77;
    dt_ctx *ctx = dt_ctx_new(&old);
    assert_int_equal(dt_ctx_status(ctx), DT_OK);
    assert_int_equal(dt_ctx_threads(ctx), 1);   /* the default, not 77 */
    dt_ctx_free(ctx);
    dt_ctx_config none;
    memset(&none, 0, sizeof none);   /* never initialised */
    ctx = dt_ctx_new(&none);
    assert_int_equal(dt_ctx_status(ctx), DT_EINVAL);
    assert_non_null(strstr(dt_last_error(ctx), 
                           "dt_ctx_config's struct_size is 0: fill it with dt_ctx_config_init"));
    dt_ctx_free(ctx);

    ctx = dt_ctx_new(NULL);
    float x[10] = {0};
    int32_t y[10] = {0};
    dt_sample_field in = {DT_F32, 1, {1}}, tg = {DT_I32, 0, {0}};
    dt_dataset *ds = dt_dataset_from_memory(ctx, 10, &in, x, &tg, y, 0);
    assert_non_null(ds);
    /* an older dt_loader_config that ends before prefetch: the shard fields
     * past it (junk here: shard 5 of 7) take their defaults, one shard */
    dt_loader_config lc;
    dt_loader_config_init(&lc);
    lc.batch = 3;
    lc.struct_size = offsetof(dt_loader_config, prefetch);
    lc.shard_rank = 5;
    lc.shard_count = 7;
    dt_loader *ld = dt_loader_new(ctx, ds, &lc);
    assert_non_null(ld);
    assert_int_equal(dt_loader_batches(ld), 4);   /* 10 samples in 3s, all of them: no shards */
    dt_loader_free(ld);
    /* a newer header's struct, 16 bytes longer: all zero past ours is fine */
    unsigned char big[sizeof(dt_loader_config) + 16] = {0};
    dt_loader_config_init((dt_loader_config *)big);
    ((dt_loader_config *)big)->batch = 5;
    ((dt_loader_config *)big)->struct_size = sizeof big;
    ld = dt_loader_new(ctx, ds, (dt_loader_config *)big);
    assert_non_null(ld);
    assert_int_equal(dt_loader_batches(ld), 2);
    dt_loader_free(ld);
    big[sizeof(dt_loader_config) + 3] = 1;   /* a field this library does not know, set */
    assert_null(dt_loader_new(ctx, ds, (dt_loader_config *)big));
    assert_int_equal(dt_last_status(ctx), DT_EINVAL);
    assert_non_null(strstr(dt_last_error(ctx), "built against a newer dtrain.h"));
    /* struct_size beyond any header: refused without reading past ours */
    lc.struct_size = (size_t)1 << 40;
    assert_null(dt_loader_new(ctx, ds, &lc));
    assert_non_null(strstr(dt_last_error(ctx), "dt_loader_config's struct_size is 1099511627776"));
    /* an older dt_optim_config that ends after lr: Adam's defaults for the rest */
    float w0 = 0;
    int64_t one = 1;
    dt_tensor *w = dt_param_new(ctx, "w", 1, &one);
    dt_tensor_set(w, &w0, 1);
    dt_optim_config oc;
    dt_optim_config_init(&oc, DT_ADAM);
    oc.struct_size = offsetof(dt_optim_config, momentum);
    oc.lr = 0.5f;
    oc.beta1 = oc.beta2 = oc.eps = -3.0f;   /* junk past the caller's struct */
    dt_optim *opt = dt_optim_new(ctx, &oc, NULL, 0);
    assert_non_null(opt);
    assert_true(dt_optim_lr(opt) == 0.5f);
    dt_optim_free(opt);
    oc.struct_size = 0;
    assert_null(dt_optim_new(ctx, &oc, NULL, 0));
    assert_non_null(strstr(dt_last_error(ctx), 
                           "optim_new: the dt_optim_config's struct_size is 0"));
    dt_dataset_free(ds);
    dt_ctx_free(ctx);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_err_strerror),
    cmocka_unit_test(test_err_null_ctx),
    cmocka_unit_test(test_err_null_inputs_chain),
    cmocka_unit_test(test_err_recompute_misuse),
    cmocka_unit_test(test_err_shapes),
    cmocka_unit_test(test_err_dtypes),
    cmocka_unit_test(test_err_tensor_misuse),
    cmocka_unit_test(test_err_optim_and_sched),
    cmocka_unit_test(test_err_data_misuse),
    cmocka_unit_test(test_err_bad_backend),
    cmocka_unit_test(test_err_config_struct_sizes),
};

DT_TEST_GROUP(core_errors, tests)
