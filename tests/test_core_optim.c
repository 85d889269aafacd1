/*
 * tests/test_core_optim.c - optimizer updates against hand-computed steps
 * (torch.optim's formulas, worked in double precision below), learning-rate
 * schedules against their closed forms, gradient clipping and gradient
 * accumulation.
 *
 * Gradients are made exact: loss = sum_i sum(p_i * c_i) gives dL/dp_i = c_i
 * bit for bit, so each step's gradient is known without trusting backward.
 */
#include "test_util.h"

#define RT 1e-5
#define AT 1e-6

enum { NW = 4, NB = 3, NSTEP = 3 };

static const float W0[NW] = {0.5f, -1.0f, 2.0f, 0.1f};
static const float B0[NB] = {-0.3f, 0.0f, 0.7f};
/* gradients of w and b at steps 1..3 */
static const float GW[NSTEP][NW] = {
    {0.1f, -0.2f, 0.3f, 1.0f}, {-0.5f, 0.4f, 0.05f, 0.2f}, {0.25f, 0.25f, -1.0f, 0.0f}};
static const float GB[NSTEP][NB] = {{1.0f, -1.0f, 0.5f}, {0.3f, 0.0f, -0.2f}, {-0.1f, 0.6f, 0.6f}};

typedef struct fixture {
    dt_ctx *ctx;
    dt_tensor *w, *b;     /* params "w" (2,2) and "b" (3) */
    dt_tensor *cw, *cb;   /* gradient constants */
} fixture;

static void fx_init(fixture *f)
{
    f->ctx = tu_ctx_new();
    f->w = tu_param(f->ctx, "w", SHP(2, 2), W0);
    f->b = tu_param(f->ctx, "b", SHP(NB), B0);
    f->cw = tu_tensor(f->ctx, SHP(2, 2), NULL);
    f->cb = tu_tensor(f->ctx, SHP(NB), NULL);
}

static void fx_free(fixture *f)
{
    dt_tensor_free(f->cw);
    dt_tensor_free(f->cb);
    dt_ctx_free(f->ctx);
}

/* Backward of sum(w * gw) + sum(b * gb): grads become exactly gw, gb
 * (accumulated onto whatever is there). */
static void fx_backward(fixture *f, const float *gw, const float *gb)
{
    dt_ctx *ctx = f->ctx;
    tu_check_status(ctx, dt_tensor_set(f->cw, gw, NW), "set cw");
    tu_check_status(ctx, dt_tensor_set(f->cb, gb, NB), "set cb");
    dt_tensor *loss = dt_add(ctx, dt_sum(ctx, dt_mul(ctx, f->w, f->cw)),
                             dt_sum(ctx, dt_mul(ctx, f->b, f->cb)));
    tu_check(ctx, loss, "loss");
    tu_check_status(ctx, dt_backward(ctx, loss), "dt_backward");
    dt_ctx_step_reset(ctx);
}

/* Hand-computed reference, one parameter element at a time. */
typedef struct ref_state {
    double w, buf, m, v;
} ref_state;

static void ref_sgd(ref_state *s, double g, int t, const dt_optim_config *c)
{
    g += c->weight_decay * s->w;
    if (c->momentum != 0) {
        s->buf = t == 1 ? g : c->momentum * s->buf + (1 - c->dampening) * g;
        g = c->nesterov ? g + c->momentum * s->buf : s->buf;
    }
    s->w -= c->lr * g;
}

static void ref_adam(ref_state *s, double g, int t, const dt_optim_config *c)
{
    if (c->kind == DT_ADAMW)
        s->w *= 1 - (double)c->lr * c->weight_decay;
    else
        g += c->weight_decay * s->w;
    s->m = c->beta1 * s->m + (1 - (double)c->beta1) * g;
    s->v = c->beta2 * s->v + (1 - (double)c->beta2) * g * g;
    double bc1 = 1 - pow(c->beta1, t), bc2 = 1 - pow(c->beta2, t);
    double denom = sqrt(s->v) / sqrt(bc2) + c->eps;
    s->w -= c->lr / bc1 * s->m / denom;
}

/* torch.optim.Adagrad (lr_decay 0, initial accumulator 0). */
static void ref_adagrad(ref_state *s, double g, int t, const dt_optim_config *c)
{
    (void)t;
    g += c->weight_decay * s->w;
    s->v += g * g;
    s->w -= c->lr * g / (sqrt(s->v) + c->eps);
}

typedef void (*ref_fn)(ref_state *, double, int, const dt_optim_config *);
static ref_fn ref_for(const dt_optim_config *c)
{
    return c->kind == DT_SGD ? ref_sgd : c->kind == DT_ADAGRAD ? ref_adagrad : ref_adam;
}

/* Run `steps` optimizer steps with the library and with the reference;
 * compare parameters after every step. */
static void run_optim(const dt_optim_config *cfg, int steps, const char *what)
{
    fixture f;
    fx_init(&f);
    dt_optim *opt = dt_optim_new(f.ctx, cfg, NULL, 0);
    tu_check(f.ctx, opt, "dt_optim_new");
    ref_state rw[NW] = {{0}}, rb[NB] = {{0}};
    for (int i = 0; i < NW; i++) rw[i].w = W0[i];
    for (int i = 0; i < NB; i++) rb[i].w = B0[i];

    for (int t = 1; t <= steps; t++) {
        dt_optim_zero_grad(opt);
        fx_backward(&f, GW[t - 1], GB[t - 1]);
        tu_check_status(f.ctx, dt_optim_step(opt), "dt_optim_step");
        assert_int_equal(dt_optim_steps(opt), t);
        double ew[NW], eb[NB];
        for (int i = 0; i < NW; i++) {
            ref_for(cfg)(&rw[i], GW[t - 1][i], t, cfg);
            ew[i] = rw[i].w;
        }
        for (int i = 0; i < NB; i++) {
            ref_for(cfg)(&rb[i], GB[t - 1][i], t, cfg);
            eb[i] = rb[i].w;
        }
        char name[96];
        float *gw = tu_read(f.ctx, f.w, NULL), *gb = tu_read(f.ctx, f.b, NULL);
        snprintf(name, sizeof name, "%s: w after step %d", what, t);
        tu_assert_close_arr(name, gw, ew, NW, RT, AT);
        snprintf(name, sizeof name, "%s: b after step %d", what, t);
        tu_assert_close_arr(name, gb, eb, NB, RT, AT);
        free(gw);
        free(gb);
    }

    /* Named state, where the header names it. */
    const char *want = NULL;
    double want_v[NW];
    if (cfg->kind == DT_SGD && cfg->momentum != 0) {
        want = "w.momentum_buffer";
        for (int i = 0; i < NW; i++) want_v[i] = rw[i].buf;
    } else if (cfg->kind == DT_ADAGRAD) {
        want = "w.sum";
        for (int i = 0; i < NW; i++) want_v[i] = rw[i].v;
    } else if (cfg->kind != DT_SGD) {
        want = "w.exp_avg";
        for (int i = 0; i < NW; i++) want_v[i] = rw[i].m;
    }
    if (want) {
        dt_tensor *st = NULL;
        for (int i = 0; i < dt_optim_state_count(opt); i++)
            if (strcmp(dt_tensor_name(dt_optim_state_at(opt, i)), want) == 0)
                st = dt_optim_state_at(opt, i);
        if (!st) fail_msg("%s: no optimizer state named %s", what, want);
        float *sv = tu_read(f.ctx, st, NULL);
        tu_assert_close_arr(want, sv, want_v, NW, RT, AT);
        free(sv);
    }
    dt_optim_free(opt);
    fx_free(&f);
}

static void test_optim_defaults(void **state)
{
    (void)state;
    dt_optim_config c;
    dt_optim_config_init(&c, DT_SGD);
    assert_int_equal(c.kind, DT_SGD);
    assert_float_equal(c.lr, 0.01f, 0);
    assert_float_equal(c.momentum, 0, 0);
    assert_float_equal(c.dampening, 0, 0);
    assert_int_equal(c.nesterov, 0);
    assert_float_equal(c.weight_decay, 0, 0);
    dt_optim_config_init(&c, DT_ADAM);
    assert_int_equal(c.kind, DT_ADAM);
    assert_float_equal(c.lr, 1e-3f, 0);
    assert_float_equal(c.beta1, 0.9f, 0);
    assert_float_equal(c.beta2, 0.999f, 0);
    assert_float_equal(c.eps, 1e-8f, 0);
    assert_float_equal(c.weight_decay, 0, 0);
    dt_optim_config_init(&c, DT_ADAMW);
    assert_int_equal(c.kind, DT_ADAMW);
    assert_float_equal(c.lr, 1e-3f, 0);
    assert_float_equal(c.weight_decay, 0.01f, 0);
    assert_float_equal(c.beta1, 0.9f, 0);
    assert_float_equal(c.beta2, 0.999f, 0);
}

static void test_optim_sgd_plain(void **state)
{
    (void)state;
    dt_optim_config c;
    dt_optim_config_init(&c, DT_SGD);
    c.lr = 0.1f;
    run_optim(&c, 2, "sgd");
}

static void test_optim_sgd_momentum(void **state)
{
    (void)state;
    dt_optim_config c;
    dt_optim_config_init(&c, DT_SGD);
    c.lr = 0.1f;
    c.momentum = 0.9f;
    run_optim(&c, 3, "sgd momentum 0.9");
    c.dampening = 0.5f;
    run_optim(&c, 3, "sgd momentum 0.9 dampening 0.5");
}

static void test_optim_sgd_nesterov(void **state)
{
    (void)state;
    dt_optim_config c;
    dt_optim_config_init(&c, DT_SGD);
    c.lr = 0.1f;
    c.momentum = 0.9f;
    c.nesterov = 1;
    run_optim(&c, 3, "sgd nesterov");
}

static void test_optim_sgd_weight_decay(void **state)
{
    (void)state;
    dt_optim_config c;
    dt_optim_config_init(&c, DT_SGD);
    c.lr = 0.1f;
    c.weight_decay = 0.1f;
    run_optim(&c, 2, "sgd weight decay");
    c.momentum = 0.9f;
    run_optim(&c, 3, "sgd momentum + weight decay");
}

static void test_optim_adam(void **state)
{
    (void)state;
    dt_optim_config c;
    dt_optim_config_init(&c, DT_ADAM);
    c.lr = 0.1f;
    run_optim(&c, 2, "adam");
    run_optim(&c, 3, "adam 3 steps");
    c.weight_decay = 0.1f;
    run_optim(&c, 2, "adam L2 weight decay");
}

static void test_optim_adamw(void **state)
{
    (void)state;
    dt_optim_config c;
    dt_optim_config_init(&c, DT_ADAMW);
    c.lr = 0.1f;
    c.weight_decay = 0.1f;
    run_optim(&c, 1, "adamw");
    run_optim(&c, 3, "adamw 3 steps");
}

static void test_optim_adagrad(void **state)
{
    (void)state;
    dt_optim_config c;
    dt_optim_config_init(&c, DT_ADAGRAD);
    assert_float_equal(c.lr, 0.01f, 0);
    assert_float_equal(c.eps, 1e-10f, 0);
    c.lr = 0.1f;
    run_optim(&c, 3, "adagrad");
    c.weight_decay = 0.1f;
    run_optim(&c, 2, "adagrad L2 weight decay");
    /* by hand: w 0.5, g 0.1, lr 0.1: sum = 0.01, w = 0.5 - 0.1 * 0.1 / 0.1 */
    ref_state r = {.w = 0.5};
    c.weight_decay = 0;
    ref_adagrad(&r, 0.1, 1, &c);
    assert_true(fabs(r.w - 0.4) < 1e-7);
    c.eps = -1;
    fixture f;
    fx_init(&f);
    assert_null(dt_optim_new(f.ctx, &c, NULL, 0));
    assert_int_equal(dt_last_status(f.ctx), DT_EINVAL);
    fx_free(&f);
}

/* One hand-worked number, so the reference itself is checked too:
 * Adam, lr 0.1, g = 0.1 on the first step: m = 0.01, v = 1e-5,
 * m_hat = 0.1, sqrt(v_hat) = 0.1 -> w = 0.5 - 0.1 * 0.1 / (0.1 + 1e-8). */
static void test_optim_adam_by_hand(void **state)
{
    (void)state;
    dt_optim_config c;
    dt_optim_config_init(&c, DT_ADAM);
    c.lr = 0.1f;
    ref_state s = {.w = 0.5};
    ref_adam(&s, 0.1, 1, &c);
    /* (lr and betas are floats: agreement to float precision) */
    assert_true(fabs(s.w - (0.5 - 0.1 * 0.1 / (0.1 + 1e-8))) < 1e-7);
    /* AdamW wd 0.1: 0.5 * (1 - 0.01) = 0.495, then the same Adam step */
    c.kind = DT_ADAMW;
    c.weight_decay = 0.1f;
    s = (ref_state){.w = 0.5};
    ref_adam(&s, 0.1, 1, &c);
    assert_true(fabs(s.w - (0.495 - 0.1 * 0.1 / (0.1 + 1e-8))) < 1e-7);

    fixture f;
    fx_init(&f);
    dt_optim *opt = dt_optim_new(f.ctx, &c, NULL, 0);
    tu_check(f.ctx, opt, "dt_optim_new");
    fx_backward(&f, GW[0], GB[0]);
    tu_check_status(f.ctx, dt_optim_step(opt), "step");
    float w[NW];
    dt_tensor_get(f.w, w, NW);
    assert_true(tu_close(w[0], 0.495 - 0.1 * 0.1 / (0.1 + 1e-8), 1e-6, 0));
    dt_optim_free(opt);
    fx_free(&f);
}

/* An optimizer over a subset of the parameters leaves the others alone;
 * lr accessors; dt_optim_zero_grad clears the gradients. */
static void test_optim_subset_and_accessors(void **state)
{
    (void)state;
    fixture f;
    fx_init(&f);
    dt_optim_config c;
    dt_optim_config_init(&c, DT_SGD);
    c.lr = 0.5f;
    dt_tensor *only[1] = {f.b};
    dt_optim *opt = dt_optim_new(f.ctx, &c, only, 1);
    tu_check(f.ctx, opt, "dt_optim_new");
    assert_float_equal(dt_optim_lr(opt), 0.5f, 0);
    assert_int_equal(dt_optim_set_lr(opt, 0.25f), DT_OK);
    assert_float_equal(dt_optim_lr(opt), 0.25f, 0);
    assert_int_equal(dt_optim_steps(opt), 0);
    fx_backward(&f, GW[0], GB[0]);
    tu_check_status(f.ctx, dt_optim_step(opt), "step");
    TU_EXPECT(f.ctx, f.w, 1e-7, 0, 0.5, -1.0, 2.0, 0.1);
    float *bv = tu_read(f.ctx, f.b, NULL);
    double eb[NB];
    for (int i = 0; i < NB; i++) eb[i] = B0[i] - 0.25 * GB[0][i];
    tu_assert_close_arr("b", bv, eb, NB, RT, AT);
    free(bv);
    dt_optim_zero_grad(opt);
    TU_EXPECT(f.ctx, dt_tensor_grad(f.b), 0, 0, 0, 0, 0);
    /* dt_ctx_zero_grad clears every parameter's gradient */
    TU_EXPECT(f.ctx, dt_tensor_grad(f.w), RT, AT, 0.1, -0.2, 0.3, 1.0);
    dt_ctx_zero_grad(f.ctx);
    TU_EXPECT(f.ctx, dt_tensor_grad(f.w), 0, 0, 0, 0, 0, 0);
    dt_optim_free(opt);
    dt_optim_free(NULL);
    fx_free(&f);
}

/* ---------------------------------------------------------------------------
 * Schedules
 * ------------------------------------------------------------------------- */
static void test_schedule_step(void **state)
{
    (void)state;
    dt_schedule s = {.kind = DT_SCHED_STEP, .step_size = 3, .gamma = 0.5f};
    /* lr = base * gamma^floor(step / step_size) */
    static const int64_t steps[] = {0, 1, 2, 3, 5, 6, 10, 30};
    for (int i = 0; i < TU_ARRAY_LEN(steps); i++) {
        double want = 0.1 * pow(0.5, (double)(steps[i] / 3));
        float got = dt_schedule_lr(&s, 0.1f, steps[i]);
        if (!tu_close(got, want, 1e-6, 0))
            fail_msg("STEP lr at step %lld: expected %.9g, got %.9g", (long long)steps[i], want,
                     (double)got);
    }
    dt_schedule k = {.kind = DT_SCHED_CONSTANT};
    assert_float_equal(dt_schedule_lr(&k, 0.3f, 0), 0.3f, 0);
    assert_float_equal(dt_schedule_lr(&k, 0.3f, 12345), 0.3f, 0);
}

/* base 1, warmup 10, total 110, min 0.1:
 *   10..110:    lr = 0.1 + 0.45 (1 + cos(pi (step - 10) / 100))
 *   >= 110:     lr = 0.1 */
static void test_schedule_cosine(void **state)
{
    (void)state;
    dt_schedule s = {.kind = DT_SCHED_COSINE, .warmup_steps = 10, .total_steps = 110,
                     .min_lr = 0.1f};
    static const int64_t steps[] = {10, 11, 35, 60, 85, 109, 110, 111, 500};
    for (int i = 0; i < TU_ARRAY_LEN(steps); i++) {
        int64_t t = steps[i];
        double want = t < 110 ? 0.1 + 0.45 * (1 + cos(M_PI * (double)(t - 10) / 100.0)) : 0.1;
        float got = dt_schedule_lr(&s, 1.0f, t);
        if (!tu_close(got, want, 1e-5, 1e-6))
            fail_msg("COSINE lr at step %lld: expected %.9g, got %.9g", (long long)t, want,
                     (double)got);
    }
    /* spot values worked by hand: 35 -> 0.1 + 0.45 (1 + 0.70710678) */
    assert_true(tu_close(dt_schedule_lr(&s, 1.0f, 35), 0.868198052, 1e-5, 0));
    assert_true(tu_close(dt_schedule_lr(&s, 1.0f, 60), 0.55, 1e-5, 0));
    /* no warm-up: starts at base */
    dt_schedule n = {.kind = DT_SCHED_COSINE, .warmup_steps = 0, .total_steps = 100, .min_lr = 0};
    assert_true(tu_close(dt_schedule_lr(&n, 0.2f, 0), 0.2, 1e-6, 0));
    assert_true(tu_close(dt_schedule_lr(&n, 0.2f, 50), 0.1, 1e-5, 0));
    assert_true(tu_close(dt_schedule_lr(&n, 0.2f, 100), 0.0, 0, 1e-7));
}

/* "linear warm-up from 0" (dtrain.h): lr = base * step / warmup for
 * step < warmup, so step 0 has lr 0 and step warmup/2 has base/2 (as in
 * transformers' get_cosine_schedule_with_warmup). */
static void test_schedule_cosine_warmup_linear(void **state)
{
    (void)state;
    dt_schedule s = {.kind = DT_SCHED_COSINE, .warmup_steps = 10, .total_steps = 110,
                     .min_lr = 0.1f};
    static const int64_t steps[] = {0, 1, 5, 9};
    for (int i = 0; i < TU_ARRAY_LEN(steps); i++) {
        double want = (double)(steps[i] + 1) / 10.0;   /* header: base*(step+1)/warmup */
        float got = dt_schedule_lr(&s, 1.0f, steps[i]);
        if (!tu_close(got, want, 1e-5, 1e-6))
            fail_msg("COSINE warm-up lr at step %lld: expected %.9g, got %.9g",
                     (long long)steps[i], want, (double)got);
    }
}

/* With a schedule attached, update t (0-based, t = dt_optim_steps() before
 * the step) uses dt_schedule_lr(base, t): STEP with step_size 1, gamma 0.5
 * and base 1 gives lrs 1, 0.5, 0.25 for a constant gradient of 1. */
static void test_schedule_drives_optimizer(void **state)
{
    (void)state;
    fixture f;
    fx_init(&f);
    dt_optim_config c;
    dt_optim_config_init(&c, DT_SGD);
    c.lr = 1.0f;
    dt_tensor *only[1] = {f.w};
    dt_optim *opt = dt_optim_new(f.ctx, &c, only, 1);
    tu_check(f.ctx, opt, "dt_optim_new");
    dt_schedule s = {.kind = DT_SCHED_STEP, .step_size = 1, .gamma = 0.5f};
    assert_int_equal(dt_optim_set_schedule(opt, &s), DT_OK);
    static const float ones[NW] = {1, 1, 1, 1};
    double lr_sum = 0;
    for (int t = 0; t < 3; t++) {
        dt_optim_zero_grad(opt);
        fx_backward(&f, ones, GB[0]);
        tu_check_status(f.ctx, dt_optim_step(opt), "step");
        lr_sum += pow(0.5, t);
        assert_true(tu_close(dt_optim_lr(opt), pow(0.5, t), 1e-6, 0));
    }
    double want[NW];
    for (int i = 0; i < NW; i++) want[i] = W0[i] - lr_sum;
    float *w = tu_read(f.ctx, f.w, NULL);
    tu_assert_close_arr("w after scheduled steps", w, want, NW, RT, AT);
    free(w);
    dt_optim_free(opt);
    fx_free(&f);
}

/* ---------------------------------------------------------------------------
 * Gradient clipping and accumulation
 * ------------------------------------------------------------------------- */
static void test_clip_grad_norm(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    dt_tensor *a = tu_param(ctx, "a", SHP(2), (const float[]){1, 1});
    dt_tensor *b = tu_param(ctx, "b", SHP(1), (const float[]){1});
    dt_tensor *ca = tu_tensor(ctx, SHP(2), (const float[]){3, 4});
    dt_tensor *cb = tu_tensor(ctx, SHP(1), (const float[]){12});
    for (int round = 0; round < 2; round++) {
        dt_ctx_zero_grad(ctx);
        dt_tensor *loss = dt_add(ctx, dt_sum(ctx, dt_mul(ctx, a, ca)), dt_sum(ctx, dt_mul(ctx, b, cb)));
        tu_check_status(ctx, dt_backward(ctx, loss), "backward");
        dt_ctx_step_reset(ctx);
        /* global norm sqrt(9 + 16 + 144) = 13 */
        float norm = -1;
        if (round == 0) {
            /* max 6.5: scale by 6.5 / 13 = 0.5 */
            assert_int_equal(dt_ctx_clip_grad_norm(ctx, 6.5f, &norm), DT_OK);
            assert_true(tu_close(norm, 13.0, 1e-6, 0));
            TU_EXPECT(ctx, dt_tensor_grad(a), 1e-5, 0, 1.5, 2.0);
            TU_EXPECT(ctx, dt_tensor_grad(b), 1e-5, 0, 6.0);
        } else {
            /* max above the norm: unchanged */
            assert_int_equal(dt_ctx_clip_grad_norm(ctx, 100.0f, &norm), DT_OK);
            assert_true(tu_close(norm, 13.0, 1e-6, 0));
            TU_EXPECT(ctx, dt_tensor_grad(a), 0, 0, 3, 4);
            TU_EXPECT(ctx, dt_tensor_grad(b), 0, 0, 12);
            assert_int_equal(dt_ctx_clip_grad_norm(ctx, 100.0f, NULL), DT_OK);
        }
    }
    dt_tensor_free(ca);
    dt_tensor_free(cb);
    dt_ctx_free(ctx);
}

/* Two micro-batches' backward calls sum: the gradient is twice one's. */
static void test_grad_accumulation(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    tu_rng r = {400};
    dt_tensor *w1 = tu_param_rand(ctx, &r, "w1", SHP(5, 3), -1, 1);
    dt_tensor *b1 = tu_param_rand(ctx, &r, "b1", SHP(5), -1, 1);
    dt_tensor *w2 = tu_param_rand(ctx, &r, "w2", SHP(2, 5), -1, 1);
    float xv[12];
    tu_fill_uniform(&r, xv, 12, -1, 1);
    dt_tensor *x = tu_tensor(ctx, SHP(4, 3), xv);
    dt_tensor *y = tu_tensor_i32(ctx, SHP(4), (const int32_t[]){0, 1, 1, 0});
    dt_tensor *ps[3] = {w1, b1, w2};
    static const int64_t n[3] = {15, 5, 10};
    float *one[3], *two[3];
    for (int k = 1; k <= 2; k++) {
        dt_ctx_zero_grad(ctx);
        for (int rep = 0; rep < k; rep++) {
            dt_tensor *h = dt_gelu(ctx, dt_linear(ctx, x, w1, b1));
            dt_tensor *loss = dt_cross_entropy(ctx, dt_linear(ctx, h, w2, NULL), y);
            tu_check_status(ctx, dt_backward(ctx, loss), "backward");
            dt_ctx_step_reset(ctx);
        }
        for (int i = 0; i < 3; i++) (k == 1 ? one : two)[i] = tu_read(ctx, dt_tensor_grad(ps[i]), NULL);
    }
    for (int i = 0; i < 3; i++) {
        for (int64_t j = 0; j < n[i]; j++) {
            if (one[i][j] == 0) fail_msg("param %d grad %lld is zero: test is vacuous", i, (long long)j);
            if (!tu_close(two[i][j], 2.0 * one[i][j], 1e-6, 0))
                fail_msg("accumulated grad of param %d [%lld]: expected 2 x %.9g, got %.9g", i,
                         (long long)j, (double)one[i][j], (double)two[i][j]);
        }
        free(one[i]);
        free(two[i]);
    }
    dt_tensor_free(x);
    dt_tensor_free(y);
    dt_ctx_free(ctx);
}

/* --- 16-bit parameters with f32 masters, 16-bit state ------------------------ */

/* bf16 rounding (nearest even), as the library's (backends/half.h) */
static float bf16_round(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    u += 0x7fffu + ((u >> 16) & 1);
    u &= 0xffff0000u;
    memcpy(&x, &u, 4);
    return x;
}

static int is_bf16(float x) { return bf16_round(x) == x; }

/* param_dtype bf16: the parameters hold their f32 masters rounded, after
 * dt_optim_new and after every step, while the masters (which a checkpoint
 * saves in the parameters' place) follow the f32 reference: the updates
 * far below a bf16 step are not lost. */
static void test_optim_master_weights(void **state)
{
    (void)state;
    char dir[64], path[512];
    tu_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/master.safetensors", dir);
    dt_optim_config c;
    dt_optim_config_init(&c, DT_ADAMW);
    c.lr = 1e-4f;   /* each step moves w by ~1e-4: below bf16's spacing at 0.5 (2^-9) */
    c.param_dtype = DT_BF16;
    fixture f;
    fx_init(&f);
    dt_optim *opt = dt_optim_new(f.ctx, &c, NULL, 0);
    tu_check(f.ctx, opt, "dt_optim_new bf16 params");
    float w[NW];
    dt_tensor_get(f.w, w, NW);
    assert_float_equal(w[3], bf16_round(0.1f), 0);   /* rounded at once */
    ref_state rw[NW] = {{0}};
    for (int i = 0; i < NW; i++) rw[i].w = W0[i];
    for (int t = 1; t <= NSTEP; t++) {
        dt_optim_zero_grad(opt);
        fx_backward(&f, GW[t - 1], GB[t - 1]);
        tu_check_status(f.ctx, dt_optim_step(opt), "step");
        for (int i = 0; i < NW; i++) ref_adam(&rw[i], GW[t - 1][i], t, &c);
    }
    dt_tensor_get(f.w, w, NW);
    for (int i = 0; i < NW; i++) {
        if (!is_bf16(w[i]) || fabs(w[i] - rw[i].w) > fabs(rw[i].w) / 256)
            fail_msg("w[%d] = %.9g: not the master %.9g rounded to bf16", i, (double)w[i], rw[i].w);
    }
    assert_float_equal(w[0], 0.5f, 0);   /* 3e-4 below 0.5: still 0.5 in bf16 */
    tu_check_status(f.ctx, dt_checkpoint_save(f.ctx, opt, path, 3, NULL), "save");
    /* the file holds the masters: f32 values the steps moved */
    fixture g;
    fx_init(&g);
    tu_check_status(g.ctx, dt_checkpoint_load(g.ctx, NULL, path, NULL, NULL, NULL), "load plain");
    float mw[NW];
    dt_tensor_get(g.w, mw, NW);
    for (int i = 0; i < NW; i++)
        if (!tu_close(mw[i], rw[i].w, RT, AT))
            fail_msg("saved w[%d] = %.9g, the f32 reference %.9g", i, (double)mw[i], rw[i].w);
    assert_true(mw[0] < 0.5f && !is_bf16(mw[0]));
    fx_free(&g);

    /* the caller writes a parameter: the next step starts from that value */
    const float nw[NW] = {4.0f, 4.0f, 4.0f, 4.0f};
    tu_check_status(f.ctx, dt_tensor_set(f.w, nw, NW), "set w");
    dt_optim_zero_grad(opt);
    fx_backward(&f, GW[0], GB[0]);
    tu_check_status(f.ctx, dt_optim_step(opt), "step after set");
    dt_tensor_get(f.w, w, NW);
    for (int i = 0; i < NW; i++)
        if (fabs(w[i] - 4.0f) > 0.04f)
            fail_msg("w[%d] = %g after the caller set 4", i, (double)w[i]);
    dt_optim_free(opt);
    fx_free(&f);

    /* resumed from the checkpoint, the run goes on bit for bit */
    float want[NW], got[NW];
    for (int run = 0; run < 2; run++) {
        fixture h;
        fx_init(&h);
        c.state_dtype = DT_BF16;
        opt = dt_optim_new(h.ctx, &c, NULL, 0);
        tu_check(h.ctx, opt, "optim");
        for (int t = 1; t <= 4; t++) {
            if (t == 3 && run == 0)
                tu_check_status(h.ctx, dt_checkpoint_save(h.ctx, opt, path, 2, NULL), "save at 2");
            if (t == 3 && run == 1) {
                dt_optim_free(opt);
                fx_free(&h);
                fx_init(&h);
                opt = dt_optim_new(h.ctx, &c, NULL, 0);
                tu_check_status(h.ctx, dt_checkpoint_load(h.ctx, opt, path, NULL, NULL, NULL), "resume");
            }
            dt_optim_zero_grad(opt);
            fx_backward(&h, GW[t % NSTEP], GB[t % NSTEP]);
            tu_check_status(h.ctx, dt_optim_step(opt), "step");
        }
        dt_tensor_get(h.w, run ? got : want, NW);
        dt_optim_free(opt);
        fx_free(&h);
    }
    assert_memory_equal(want, got, sizeof want);
    tu_rmdir(dir);
}

/* Optimizer state in bf16: 2 bytes an element, each kind's update within
 * bf16's precision of the f32 state's; f16 state and unknown dtypes are
 * refused. */
static void test_optim_bf16_state(void **state)
{
    (void)state;
    const dt_optim_kind kinds[] = {DT_ADAMW, DT_SGD, DT_ADAGRAD};
    for (int k = 0; k < 3; k++) {
        float w[2][NW];
        size_t bytes[2];
        for (int half = 0; half < 2; half++) {
            dt_optim_config c;
            dt_optim_config_init(&c, kinds[k]);
            c.momentum = kinds[k] == DT_SGD ? 0.9f : 0.0f;
            c.state_dtype = half ? DT_BF16 : DT_F32;
            fixture f;
            fx_init(&f);
            dt_mem_stats m0, m1;
            dt_mem_stats_get(f.ctx, &m0);
            dt_optim *opt = dt_optim_new(f.ctx, &c, NULL, 0);
            tu_check(f.ctx, opt, "optim");
            dt_mem_stats_get(f.ctx, &m1);
            bytes[half] = m1.persistent_bytes - m0.persistent_bytes;
            assert_int_equal(dt_tensor_dtype(dt_optim_state_at(opt, 0)), half ? DT_BF16 : DT_F32);
            for (int t = 1; t <= NSTEP; t++) {
                dt_optim_zero_grad(opt);
                fx_backward(&f, GW[t - 1], GB[t - 1]);
                tu_check_status(f.ctx, dt_optim_step(opt), "step");
            }
            dt_tensor_get(f.w, w[half], NW);
            if (half) {   /* the state as stored: bf16 bits */
                uint16_t h[NW];
                dt_tensor_get(dt_optim_state_at(opt, 0), h, NW);
                int nonzero = 0;
                for (int i = 0; i < NW; i++) nonzero += h[i] != 0;
                assert_true(nonzero >= NW - 1);
            }
            dt_optim_free(opt);
            fx_free(&f);
        }
        int per = kinds[k] == DT_ADAMW ? 2 : 1;
        assert_int_equal(bytes[0] - bytes[1], (size_t)per * (NW + NB) * 2);
        for (int i = 0; i < NW; i++)
            if (fabs(w[1][i] - w[0][i]) > 0.02 * fabs(w[0][i]) + 1e-6)
                fail_msg("kind %d: w[%d] %g with bf16 state, %g with f32", k, i, (double)w[1][i],
                         (double)w[0][i]);
    }
    fixture f;
    fx_init(&f);
    dt_optim_config c;
    dt_optim_config_init(&c, DT_ADAM);
    c.state_dtype = DT_F16;
    assert_null(dt_optim_new(f.ctx, &c, NULL, 0));
    assert_int_equal(dt_last_status(f.ctx), DT_ENOTSUP);
    assert_non_null(strstr(dt_last_error(f.ctx), "DT_BF16"));
    c.state_dtype = DT_F32;
    c.param_dtype = DT_I32;
    assert_null(dt_optim_new(f.ctx, &c, NULL, 0));
    assert_int_equal(dt_last_status(f.ctx), DT_EINVAL);
    fx_free(&f);
}

/* ---------------------------------------------------------------------------
 * Parameter groups (torch.optim's param_groups)
 * ------------------------------------------------------------------------- */

/* w in group 0 with cfg's values, b in group 1 with its own (bcfg: cfg
 * with b's values in, what the reference steps b with). */
static void run_groups(const dt_optim_config *cfg, const dt_param_group *gb,
                       const dt_optim_config *bcfg, const char *what)
{
    fixture f;
    fx_init(&f);
    dt_param_group g[2];
    dt_param_group_init(&g[0], &f.w, 1);
    g[1] = *gb;
    g[1].params = &f.b;
    g[1].n = 1;
    dt_optim *opt = dt_optim_new_groups(f.ctx, cfg, g, 2);
    tu_check(f.ctx, opt, "dt_optim_new_groups");
    assert_int_equal(dt_optim_group_count(opt), 2);
    assert_int_equal(dt_optim_group_of(opt, f.w), 0);
    assert_int_equal(dt_optim_group_of(opt, f.b), 1);
    assert_int_equal(dt_optim_group_of(opt, f.cw), -1);
    ref_state rw[NW] = {{0}}, rb[NB] = {{0}};
    for (int i = 0; i < NW; i++) rw[i].w = W0[i];
    for (int i = 0; i < NB; i++) rb[i].w = B0[i];
    for (int t = 1; t <= NSTEP; t++) {
        dt_optim_zero_grad(opt);
        fx_backward(&f, GW[t - 1], GB[t - 1]);
        tu_check_status(f.ctx, dt_optim_step(opt), "dt_optim_step");
        double ew[NW], eb[NB];
        for (int i = 0; i < NW; i++) {
            ref_for(cfg)(&rw[i], GW[t - 1][i], t, cfg);
            ew[i] = rw[i].w;
        }
        for (int i = 0; i < NB; i++) {
            ref_for(bcfg)(&rb[i], GB[t - 1][i], t, bcfg);
            eb[i] = rb[i].w;
        }
        char name[96];
        float *w = tu_read(f.ctx, f.w, NULL), *b = tu_read(f.ctx, f.b, NULL);
        snprintf(name, sizeof name, "%s: w (group 0) after step %d", what, t);
        tu_assert_close_arr(name, w, ew, NW, RT, AT);
        snprintf(name, sizeof name, "%s: b (group 1) after step %d", what, t);
        tu_assert_close_arr(name, b, eb, NB, RT, AT);
        free(w);
        free(b);
    }
    dt_optim_config got;
    assert_int_equal(dt_optim_group_config(opt, 1, &got), DT_OK);
    if (!(got.lr == bcfg->lr && got.weight_decay == bcfg->weight_decay &&
          got.momentum == bcfg->momentum && got.beta1 == bcfg->beta1 && got.eps == bcfg->eps))
        fail_msg("%s: group 1's config: lr %g wd %g momentum %g beta1 %g eps %g", what,
                 (double)got.lr, (double)got.weight_decay, (double)got.momentum, (double)got.beta1,
                 (double)got.eps);
    assert_int_equal(dt_optim_group_config(opt, 0, &got), DT_OK);
    assert_true(got.lr == cfg->lr && got.weight_decay == cfg->weight_decay);
    dt_optim_free(opt);
    fx_free(&f);
}

static void test_optim_param_groups(void **state)
{
    (void)state;
    static const dt_optim_kind kinds[] = {DT_SGD, DT_ADAM, DT_ADAMW, DT_ADAGRAD};
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        dt_optim_config c, bc;
        dt_optim_config_init(&c, kinds[k]);
        c.lr = 0.1f;
        c.weight_decay = 0.05f;
        if (kinds[k] == DT_SGD)
            c.momentum = 0.9f;
        dt_param_group gb;
        dt_param_group_init(&gb, NULL, 0);
        gb.lr = 0.03f;                 /* per-group lr, no decay: the usual recipe */
        gb.weight_decay = 0.0f;
        if (kinds[k] == DT_SGD)
            gb.momentum = 0.5f, gb.dampening = 0.1f;
        else
            gb.beta1 = 0.8f, gb.beta2 = 0.99f, gb.eps = 1e-6f;
        bc = c;
        bc.lr = gb.lr;
        bc.weight_decay = gb.weight_decay;
        if (kinds[k] == DT_SGD)
            bc.momentum = gb.momentum, bc.dampening = gb.dampening;
        else   /* (AdaGrad reads eps only; the betas are kept as given) */
            bc.beta1 = gb.beta1, bc.beta2 = gb.beta2, bc.eps = gb.eps;
        char what[32];
        snprintf(what, sizeof what, "groups, kind %d", (int)kinds[k]);
        run_groups(&c, &gb, &bc, what);
    }
    /* SGD: momentum in one group only; the other keeps no buffer */
    dt_optim_config c, bc;
    dt_optim_config_init(&c, DT_SGD);
    c.lr = 0.2f;
    dt_param_group gb;
    dt_param_group_init(&gb, NULL, 0);
    gb.momentum = 0.9f;
    gb.nesterov = 1;
    bc = c;
    bc.momentum = 0.9f;
    bc.nesterov = 1;
    run_groups(&c, &gb, &bc, "sgd momentum in group 1 only");
}

static void test_optim_param_groups_schedule_and_lr(void **state)
{
    (void)state;
    fixture f;
    fx_init(&f);
    dt_optim_config c;
    dt_optim_config_init(&c, DT_SGD);
    c.lr = 1.0f;
    dt_param_group g[2];
    dt_param_group_init(&g[0], &f.w, 1);
    dt_param_group_init(&g[1], &f.b, 1);
    g[1].lr = 0.25f;
    dt_optim *opt = dt_optim_new_groups(f.ctx, &c, g, 2);
    tu_check(f.ctx, opt, "dt_optim_new_groups");
    dt_schedule s = {.kind = DT_SCHED_STEP, .step_size = 1, .gamma = 0.5f};
    assert_int_equal(dt_optim_set_schedule(opt, &s), DT_OK);
    static const float ones_w[NW] = {1, 1, 1, 1}, ones_b[NB] = {1, 1, 1};
    for (int t = 0; t < 3; t++) {
        dt_optim_zero_grad(opt);
        fx_backward(&f, ones_w, ones_b);
        tu_check_status(f.ctx, dt_optim_step(opt), "step");
        dt_optim_config got;
        assert_int_equal(dt_optim_group_config(opt, 1, &got), DT_OK);
        assert_true(tu_close(got.lr, 0.25 * pow(0.5, t), 1e-6, 0));   /* each its own base */
        assert_true(tu_close(dt_optim_lr(opt), pow(0.5, t), 1e-6, 0));
    }
    float *b = tu_read(f.ctx, f.b, NULL);
    double want[NB];
    for (int i = 0; i < NB; i++) want[i] = B0[i] - 0.25 * (1 + 0.5 + 0.25);
    tu_assert_close_arr("b after scheduled group steps", b, want, NB, RT, AT);
    free(b);
    assert_int_equal(dt_optim_set_group_lr(opt, 1, 0.125f), DT_OK);
    dt_optim_config got;
    assert_int_equal(dt_optim_group_config(opt, 1, &got), DT_OK);
    assert_true(got.lr == 0.125f);
    assert_int_equal(dt_optim_group_config(opt, 0, &got), DT_OK);
    assert_true(got.lr == 0.25f);                               /* the other kept */
    assert_int_equal(dt_optim_set_group_lr(opt, 2, 0.1f), DT_EINVAL);
    assert_non_null(strstr(dt_last_error(f.ctx), "group 2 of 2"));
    assert_int_equal(dt_optim_set_group_lr(opt, 0, -1.0f), DT_EINVAL);
    assert_int_equal(dt_optim_group_config(opt, -1, &got), DT_EINVAL);
    assert_int_equal(dt_optim_set_lr(opt, 0.5f), DT_OK);       /* every group */
    assert_int_equal(dt_optim_group_config(opt, 1, &got), DT_OK);
    assert_true(got.lr == 0.5f);
    dt_optim_free(opt);
    fx_free(&f);
}

static void test_optim_param_groups_refused(void **state)
{
    (void)state;
    fixture f;
    fx_init(&f);
    dt_optim_config c;
    dt_optim_config_init(&c, DT_ADAMW);
    dt_param_group g[2];
    dt_param_group_init(&g[0], &f.w, 1);
    dt_param_group_init(&g[1], &f.w, 1);
    assert_null(dt_optim_new_groups(f.ctx, &c, g, 2));          /* w in both */
    assert_int_equal(dt_last_status(f.ctx), DT_EINVAL);
    assert_non_null(strstr(dt_last_error(f.ctx), "'w' is given twice"));
    dt_param_group_init(&g[1], &f.b, 1);
    g[1].beta1 = 1.5f;
    assert_null(dt_optim_new_groups(f.ctx, &c, g, 2));
    assert_int_equal(dt_last_status(f.ctx), DT_EINVAL);
    assert_non_null(strstr(dt_last_error(f.ctx), "group 1"));
    dt_param_group_init(&g[1], &f.cw, 1);                       /* not a parameter */
    assert_null(dt_optim_new_groups(f.ctx, &c, g, 2));
    assert_int_equal(dt_last_status(f.ctx), DT_EINVAL);
    dt_param_group_init(&g[0], NULL, 0);
    dt_param_group_init(&g[1], NULL, 0);
    assert_null(dt_optim_new_groups(f.ctx, &c, g, 2));          /* nothing to step */
    assert_int_equal(dt_last_status(f.ctx), DT_EINVAL);
    dt_param_group_init(&g[1], NULL, -1);
    assert_null(dt_optim_new_groups(f.ctx, &c, g, 2));
    assert_null(dt_optim_new_groups(f.ctx, &c, g, 0));
    assert_null(dt_optim_new_groups(f.ctx, &c, NULL, 1));
    assert_null(dt_optim_new_groups(f.ctx, &c, g, DT_OPTIM_MAX_GROUPS + 1));
    dt_param_group_init(&g[0], &f.w, 1);                        /* an empty group is fine */
    dt_param_group_init(&g[1], NULL, 0);
    dt_optim *o = dt_optim_new_groups(f.ctx, &c, g, 2);
    tu_check(f.ctx, o, "an empty group");
    dt_optim_free(o);
    fx_free(&f);
}

/* The groups' lrs go into the checkpoint and come back; another number of
 * groups is refused and changes nothing. */
static void test_optim_param_groups_checkpoint(void **state)
{
    (void)state;
    char dir[64], path[96];
    tu_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/groups.safetensors", dir);
    fixture f;
    fx_init(&f);
    dt_optim_config c;
    dt_optim_config_init(&c, DT_ADAMW);
    c.lr = 0.01f;
    dt_param_group g[2];
    dt_param_group_init(&g[0], &f.w, 1);
    dt_param_group_init(&g[1], &f.b, 1);
    g[1].lr = 0.004f;
    g[1].weight_decay = 0.0f;
    dt_optim *a = dt_optim_new_groups(f.ctx, &c, g, 2);
    tu_check(f.ctx, a, "groups");
    fx_backward(&f, GW[0], GB[0]);
    tu_check_status(f.ctx, dt_optim_step(a), "step");
    assert_int_equal(dt_optim_set_group_lr(a, 1, 0.002f), DT_OK);
    tu_check_status(f.ctx, dt_checkpoint_save(f.ctx, a, path, 1, NULL), "save");
    dt_optim *b = dt_optim_new_groups(f.ctx, &c, g, 2);
    tu_check(f.ctx, b, "groups again");
    tu_check_status(f.ctx, dt_checkpoint_load(f.ctx, b, path, NULL, NULL, NULL), "load");
    dt_optim_config got;
    assert_int_equal(dt_optim_group_config(b, 1, &got), DT_OK);
    assert_true(got.lr == 0.002f);
    assert_true(got.weight_decay == 0.0f);
    assert_int_equal(dt_optim_group_config(b, 0, &got), DT_OK);
    assert_true(got.lr == 0.01f);
    assert_int_equal(dt_optim_steps(b), 1);
    dt_optim *one = dt_optim_new(f.ctx, &c, NULL, 0);
    tu_check(f.ctx, one, "one group");
    assert_int_equal(dt_checkpoint_load(f.ctx, one, path, NULL, NULL, NULL), DT_EMISMATCH);
    assert_non_null(strstr(dt_last_error(f.ctx), "2 parameter groups, this one 1"));
    assert_int_equal(dt_optim_steps(one), 0);
    assert_true(dt_optim_lr(one) == 0.01f);
    dt_optim_free(one);
    dt_optim_free(b);
    dt_optim_free(a);
    fx_free(&f);
    unlink(path);
    rmdir(dir);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_optim_defaults),
    cmocka_unit_test(test_optim_sgd_plain),
    cmocka_unit_test(test_optim_sgd_momentum),
    cmocka_unit_test(test_optim_sgd_nesterov),
    cmocka_unit_test(test_optim_sgd_weight_decay),
    cmocka_unit_test(test_optim_adam),
    cmocka_unit_test(test_optim_adamw),
    cmocka_unit_test(test_optim_adagrad),
    cmocka_unit_test(test_optim_adam_by_hand),
    cmocka_unit_test(test_optim_subset_and_accessors),
    cmocka_unit_test(test_schedule_step),
    cmocka_unit_test(test_schedule_cosine),
    cmocka_unit_test(test_schedule_cosine_warmup_linear),
    cmocka_unit_test(test_schedule_drives_optimizer),
    cmocka_unit_test(test_clip_grad_norm),
    cmocka_unit_test(test_grad_accumulation),
    cmocka_unit_test(test_optim_master_weights),
    cmocka_unit_test(test_optim_bf16_state),
    cmocka_unit_test(test_optim_param_groups),
    cmocka_unit_test(test_optim_param_groups_schedule_and_lr),
    cmocka_unit_test(test_optim_param_groups_refused),
    cmocka_unit_test(test_optim_param_groups_checkpoint),
};

DT_TEST_GROUP(core_optim, tests)
