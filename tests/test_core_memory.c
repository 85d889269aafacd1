/*
 * tests/test_core_memory.c - memory and determinism:
 *  - a counting allocator sees every host allocation, and a warm training
 *    step makes none;
 *  - activation checkpointing (dt_recompute) lowers the step arena's peak
 *    and leaves the gradients unchanged;
 *  - backward gives op outputs' gradients back to the arena (a chain of k
 *    ops holds a few, not k), and dt_tensor_retain_grad keeps one;
 *  - the same seed and thread count give bit-identical training.
 */
#include "test_util.h"

typedef struct counts {
    long mallocs, reallocs, frees, live;
} counts;

static void *c_malloc(size_t n, void *u)
{
    counts *c = u;
    c->mallocs++;
    void *p = malloc(n);
    if (p) c->live++;
    return p;
}

static void *c_realloc(void *p, size_t n, void *u)
{
    counts *c = u;
    c->reallocs++;
    void *q = realloc(p, n);
    if (!p && q) c->live++;
    return q;
}

static void c_free(void *p, void *u)
{
    counts *c = u;
    if (p) {
        c->frees++;
        c->live--;
    }
    free(p);
}

/* A small MLP classifier on fixed synthetic data. */
typedef struct mlp {
    dt_tensor *w1, *b1, *w2, *b2, *x, *y;
    dt_optim *opt;
    float dropout;
} mlp;

enum { BATCH = 16, IN = 20, HID = 32, OUT = 10 };

static void mlp_init(dt_ctx *ctx, mlp *m, dt_optim_kind kind, float dropout)
{
    m->w1 = tu_param(ctx, "fc1.weight", SHP(HID, IN), NULL);
    m->b1 = tu_param(ctx, "fc1.bias", SHP(HID), NULL);
    m->w2 = tu_param(ctx, "fc2.weight", SHP(OUT, HID), NULL);
    m->b2 = tu_param(ctx, "fc2.bias", SHP(OUT), NULL);
    tu_check_status(ctx, dt_tensor_init_kaiming_uniform(ctx, m->w1, sqrtf(5.0f)), "init w1");
    tu_check_status(ctx, dt_tensor_init_bias(ctx, m->b1, IN), "init b1");
    tu_check_status(ctx, dt_tensor_init_kaiming_uniform(ctx, m->w2, sqrtf(5.0f)), "init w2");
    tu_check_status(ctx, dt_tensor_init_bias(ctx, m->b2, HID), "init b2");
    tu_rng r = {777};
    float xv[BATCH * IN];
    int32_t yv[BATCH];
    tu_fill_uniform(&r, xv, BATCH * IN, -1, 1);
    for (int i = 0; i < BATCH; i++) yv[i] = (int32_t)(tu_next(&r) % OUT);
    m->x = tu_tensor(ctx, SHP(BATCH, IN), xv);
    m->y = tu_tensor_i32(ctx, SHP(BATCH), yv);
    dt_optim_config c;
    dt_optim_config_init(&c, kind);
    c.lr = 0.01f;
    if (kind == DT_SGD) {
        c.lr = 0.05f;
        c.momentum = 0.9f;
    }
    m->opt = dt_optim_new(ctx, &c, NULL, 0);
    tu_check(ctx, m->opt, "dt_optim_new");
    m->dropout = dropout;
}

static float mlp_step(dt_ctx *ctx, mlp *m)
{
    dt_optim_zero_grad(m->opt);
    dt_tensor *h = dt_relu(ctx, dt_linear(ctx, m->x, m->w1, m->b1));
    if (m->dropout > 0) h = dt_dropout(ctx, h, m->dropout);
    dt_tensor *loss = dt_cross_entropy(ctx, dt_linear(ctx, h, m->w2, m->b2), m->y);
    tu_check(ctx, loss, "mlp loss");
    float l = dt_tensor_item(loss);
    tu_check_status(ctx, dt_backward(ctx, loss), "dt_backward");
    tu_check_status(ctx, dt_ctx_clip_grad_norm(ctx, 1.0f, NULL), "clip");
    tu_check_status(ctx, dt_optim_step(m->opt), "dt_optim_step");
    dt_ctx_step_reset(ctx);
    return l;
}

static void mlp_free(mlp *m)
{
    dt_optim_free(m->opt);
    dt_tensor_free(m->x);
    dt_tensor_free(m->y);
}

static void run_no_alloc(int threads, dt_optim_kind kind, float dropout)
{
    counts c = {0};
    dt_ctx_config cfg;
    dt_ctx_config_init(&cfg);
    cfg.threads = threads;
    cfg.allocator.malloc_fn = c_malloc;
    cfg.allocator.realloc_fn = c_realloc;
    cfg.allocator.free_fn = c_free;
    cfg.allocator.user = &c;
    dt_ctx *ctx = dt_ctx_new(&cfg);
    assert_non_null(ctx);
    assert_int_equal(dt_ctx_status(ctx), DT_OK);
    assert_true(c.mallocs + c.reallocs > 0); /* the hooks are used at all */

    mlp m;
    mlp_init(ctx, &m, kind, dropout);
    float first = 0, last = 0;
    for (int i = 0; i < 5; i++) {
        float l = mlp_step(ctx, &m);
        if (i == 0) first = l;
    }
    long before = c.mallocs + c.reallocs;
    dt_mem_stats s0, s1;
    dt_mem_stats_get(ctx, &s0);
    for (int i = 0; i < 10; i++) last = mlp_step(ctx, &m);
    long after = c.mallocs + c.reallocs;
    dt_mem_stats_get(ctx, &s1);
    if (after != before)
        fail_msg("threads=%d optim=%d: 10 warm steps made %ld allocator calls (malloc %ld, realloc %ld "
                 "in total)", threads, (int)kind, after - before, c.mallocs, c.reallocs);
    assert_int_equal(s1.arena_grows, s0.arena_grows);
    assert_int_equal(s1.arena_capacity, s0.arena_capacity);
    assert_true(isfinite(first) && isfinite(last));
    assert_true(last < first); /* it trains */

    mlp_free(&m);
    dt_ctx_free(ctx);
    /* everything taken through the hooks was given back */
    assert_int_equal(c.live, 0);
}

static void test_mem_warm_step_allocates_nothing(void **state)
{
    (void)state;
    run_no_alloc(1, DT_ADAM, 0.0f);
    run_no_alloc(1, DT_SGD, 0.2f);
    run_no_alloc(2, DT_ADAMW, 0.2f);
}

static void test_mem_stats(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    dt_mem_stats s0, s1, s2, s3;
    dt_mem_stats_get(ctx, &s0);
    dt_tensor *w = tu_param(ctx, "w", SHP(100, 100), NULL);
    dt_mem_stats_get(ctx, &s1);
    /* a parameter and its gradient: at least 2 x 40000 bytes */
    assert_true(s1.persistent_bytes >= s0.persistent_bytes + 2 * 40000);
    dt_mem_peak_reset(ctx);
    dt_tensor *y = dt_relu(ctx, dt_matmul(ctx, w, w, 0, 0));
    tu_check(ctx, y, "ops");
    dt_mem_stats_get(ctx, &s2);
    assert_true(s2.arena_used >= 2 * 40000); /* two (100,100) step tensors */
    assert_true(s2.arena_peak >= s2.arena_used);
    assert_true(s2.arena_capacity >= s2.arena_used);
    dt_ctx_step_reset(ctx);
    dt_mem_stats_get(ctx, &s3);
    assert_int_equal(s3.arena_used, 0);
    assert_true(s3.arena_peak >= s2.arena_used); /* the peak survives the reset */
    dt_mem_peak_reset(ctx);
    dt_mem_stats_get(ctx, &s3);
    assert_true(s3.arena_peak < s2.arena_used);
    dt_ctx_free(ctx);
}

/* A training loop that forgets dt_ctx_step_reset (issue 35: 3 GiB after 3,000
 * steps, no word).  After DT_ARENA_WARN_BACKWARDS backward passes the
 * arena's next growth is a warning naming dt_ctx_step_reset; at the cap
 * (dt_ctx_config.arena_max_bytes, 8 MiB here) the step tensor is refused with
 * DT_ENOMEM saying the same, and after a dt_ctx_step_reset training goes on. */
static void test_mem_arena_cap(void **state)
{
    (void)state;
    dt_ctx_config cfg;
    dt_ctx_config_init(&cfg);
    cfg.backend = getenv("DTRAIN_BACKEND") ? getenv("DTRAIN_BACKEND") : "cpu";
    cfg.arena_bytes = (size_t)256 << 10;
    cfg.arena_max_bytes = (size_t)8 << 20;
    dt_ctx *ctx = dt_ctx_new(&cfg);
    tu_check_status(ctx, dt_ctx_status(ctx), "context");
    dt_tensor *w = tu_param(ctx, "w", SHP(64, 64), NULL);
    dt_status s = DT_OK;
    int steps = 0;
    for (; steps < 1000 && s == DT_OK; steps++) {   /* 64 KiB and more a step, never reset */
        dt_tensor *loss = dt_sum(ctx, dt_relu(ctx, dt_matmul(ctx, w, w, 0, 0)));
        s = loss ? dt_backward(ctx, loss) : dt_last_status(ctx);
        if (steps == DT_ARENA_WARN_BACKWARDS - 2)   /* not yet: a few passes are normal */
            assert_string_equal(dt_last_warning(ctx), "");
    }
    assert_int_equal(s, DT_ENOMEM);
    assert_true(steps > DT_ARENA_WARN_BACKWARDS && steps < 1000);
    tu_assert_error_mentions(ctx, "arena_max_bytes");
    tu_assert_error_mentions(ctx, "dt_ctx_step_reset");
    assert_non_null(strstr(dt_last_warning(ctx), "without dt_ctx_step_reset"));
    dt_mem_stats st;
    dt_mem_stats_get(ctx, &st);
    assert_true(st.arena_capacity <= cfg.arena_max_bytes);
    dt_ctx_step_reset(ctx);
    dt_tensor *loss = dt_sum(ctx, dt_relu(ctx, dt_matmul(ctx, w, w, 0, 0)));
    tu_check(ctx, loss, "a step after the reset");
    tu_check_status(ctx, dt_backward(ctx, loss), "its backward");
    dt_ctx_step_reset(ctx);
    dt_ctx_free(ctx);
}

/* A chain of K elementwise ops over an (R, R) leaf: forward holds K step
 * tensors; backward without reuse would add K gradients, with it it holds
 * about two at a time. */
enum { CHAIN_K = 24, CHAIN_R = 128 };

static dt_tensor *chain_forward(dt_ctx *ctx, dt_tensor *x, dt_tensor **mid)
{
    dt_tensor *h = x;
    for (int i = 0; i < CHAIN_K; i++) {
        h = i % 2 ? dt_tanh(ctx, h) : dt_scale(ctx, h, 0.9f);
        if (i == CHAIN_K / 2)
            *mid = h;
    }
    return dt_sum(ctx, dt_mul(ctx, h, h));
}

static void test_mem_backward_reuses_grads(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    tu_rng r = {7};
    float *v = malloc(CHAIN_R * CHAIN_R * sizeof *v);
    tu_fill_uniform(&r, v, CHAIN_R * CHAIN_R, -1, 1);
    dt_tensor *x = tu_param(ctx, "x", SHP(CHAIN_R, CHAIN_R), v);
    size_t one = CHAIN_R * CHAIN_R * sizeof(float);
    dt_mem_stats fwd, bwd;
    for (int retain = 0; retain < 2; retain++) {
        dt_mem_peak_reset(ctx);
        dt_tensor *mid = NULL, *loss = chain_forward(ctx, x, &mid);
        tu_check(ctx, loss, "chain");
        if (retain)
            tu_check_status(ctx, dt_tensor_retain_grad(mid), "retain_grad");
        dt_mem_stats_get(ctx, &fwd);
        tu_check_status(ctx, dt_backward(ctx, loss), "backward");
        dt_mem_stats_get(ctx, &bwd);
        /* CHAIN_K op outputs' gradients at most 3 at a time (+1 kept) */
        assert_true(bwd.arena_peak - fwd.arena_used <= (size_t)(3 + retain) * one + 4096);
        assert_non_null(dt_tensor_grad(x));            /* a leaf keeps its gradient */
        if (!retain) {
            assert_null(dt_tensor_grad(mid));          /* given back, as PyTorch */
        } else {
            /* d loss / d mid, by the chain rule from mid onwards, in doubles */
            int64_t n;
            float *m = tu_read(ctx, mid, &n), *g = tu_read(ctx, dt_tensor_grad(mid), &n);
            for (int64_t e = 0; e < n; e += 97) {
                double h = m[e], d = 1;
                for (int i = CHAIN_K / 2 + 1; i < CHAIN_K; i++) {
                    if (i % 2) {
                        h = tanh(h);
                        d *= 1 - h * h;
                    } else {
                        h *= 0.9f;
                        d *= 0.9f;
                    }
                }
                assert_true(tu_close(g[e], 2 * h * d, 1e-4, 1e-6));
            }
            free(m);
            free(g);
        }
        dt_ctx_zero_grad(ctx);
        dt_ctx_step_reset(ctx);
    }
    free(v);
    dt_ctx_free(ctx);
}

/* ---------------------------------------------------------------------------
 * Activation checkpointing
 * ------------------------------------------------------------------------- */
enum { RB = 64, RD = 256, NSEG = 4 };

typedef struct seg_w {
    dt_tensor *wa, *ba, *wb, *bb;
} seg_w;

typedef struct deep {
    dt_tensor *x, *win, *bin, *wa[NSEG], *ba[NSEG], *wb[NSEG], *bb[NSEG], *wout;
    seg_w sw[NSEG]; /* segment user data: must live until backward */
} deep;

/* h (RB,RD) -> gelu(linear) -> gelu(linear) -> (RB,RD) */
static dt_tensor *block(dt_ctx *ctx, dt_tensor *const *in, int n, void *user)
{
    seg_w *s = user;
    (void)n;
    dt_tensor *h = dt_gelu(ctx, dt_linear(ctx, in[0], s->wa, s->ba));
    return dt_tanh(ctx, dt_linear(ctx, h, s->wb, s->bb));
}

static dt_tensor *deep_loss(dt_ctx *ctx, deep *d, int recompute)
{
    dt_tensor *h = dt_gelu(ctx, dt_linear(ctx, d->x, d->win, d->bin));
    for (int i = 0; i < NSEG; i++) {
        d->sw[i] = (seg_w){d->wa[i], d->ba[i], d->wb[i], d->bb[i]};
        h = recompute ? dt_recompute(ctx, block, &h, 1, &d->sw[i]) : block(ctx, &h, 1, &d->sw[i]);
    }
    dt_tensor *out = dt_linear(ctx, h, d->wout, NULL);
    return dt_mean(ctx, dt_mul(ctx, out, out));
}

static void test_mem_recompute_lowers_peak(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    deep d;
    tu_rng r = {900};
    float *xv = malloc(sizeof(float) * RB * RD);
    assert_non_null(xv);
    tu_fill_uniform(&r, xv, RB * RD, -1, 1);
    d.x = tu_tensor(ctx, SHP(RB, RD), xv);
    free(xv);
    const float s = 1.0f / 16; /* 1/sqrt(RD) */
    d.win = tu_param_rand(ctx, &r, "in.w", SHP(RD, RD), -s, s);
    d.bin = tu_param_rand(ctx, &r, "in.b", SHP(RD), -s, s);
    for (int i = 0; i < NSEG; i++) {
        char name[32];
        snprintf(name, sizeof name, "s%d.wa", i);
        d.wa[i] = tu_param_rand(ctx, &r, name, SHP(RD, RD), -2 * s, 2 * s);
        snprintf(name, sizeof name, "s%d.ba", i);
        d.ba[i] = tu_param_rand(ctx, &r, name, SHP(RD), -s, s);
        snprintf(name, sizeof name, "s%d.wb", i);
        d.wb[i] = tu_param_rand(ctx, &r, name, SHP(RD, RD), -2 * s, 2 * s);
        snprintf(name, sizeof name, "s%d.bb", i);
        d.bb[i] = tu_param_rand(ctx, &r, name, SHP(RD), -s, s);
    }
    d.wout = tu_param_rand(ctx, &r, "out.w", SHP(8, RD), -s, s);

    size_t peak[2];
    float *grads[2][64];
    int np = dt_param_count(ctx);
    assert_true(np <= 64);
    /* run each variant twice; measure the second (the arena is warm) */
    for (int rep = 0; rep < 2; rep++) {
        for (int re = 0; re < 2; re++) {
            dt_ctx_zero_grad(ctx);
            dt_mem_peak_reset(ctx);
            dt_tensor *loss = deep_loss(ctx, &d, re);
            tu_check(ctx, loss, re ? "loss with recompute" : "loss");
            tu_check_status(ctx, dt_backward(ctx, loss), "dt_backward");
            dt_mem_stats st;
            dt_mem_stats_get(ctx, &st);
            peak[re] = st.arena_peak;
            if (rep == 1)
                for (int i = 0; i < np; i++) grads[re][i] = tu_read(ctx, dt_tensor_grad(dt_param_at(ctx, i)), NULL);
            dt_ctx_step_reset(ctx);
        }
    }
    print_message("[   INFO   ] arena peak: %zu bytes plain, %zu bytes with recompute\n", peak[0], peak[1]);
    if (!(peak[1] < peak[0]))
        fail_msg("recompute did not lower the arena peak: %zu plain, %zu with recompute", peak[0],
                 peak[1]);
    for (int i = 0; i < np; i++) {
        int64_t n = dt_tensor_numel(dt_param_at(ctx, i));
        for (int64_t j = 0; j < n; j++)
            if (!tu_close(grads[1][i][j], grads[0][i][j], 1e-6, 1e-9))
                fail_msg("grad of %s [%lld]: plain %.9g, recompute %.9g",
                         dt_tensor_name(dt_param_at(ctx, i)), (long long)j, (double)grads[0][i][j],
                         (double)grads[1][i][j]);
        free(grads[0][i]);
        free(grads[1][i]);
    }
    dt_tensor_free(d.x);
    dt_ctx_free(ctx);
}

/* ---------------------------------------------------------------------------
 * Determinism
 * ------------------------------------------------------------------------- */
typedef struct snapshot {
    float v[HID * IN + HID + OUT * HID + OUT];
    float loss;
} snapshot;

static void train(uint64_t seed, int threads, snapshot *out)
{
    dt_ctx *ctx = tu_ctx_new_with(seed, threads);
    mlp m;
    mlp_init(ctx, &m, DT_ADAM, 0.25f);
    for (int i = 0; i < 6; i++) out->loss = mlp_step(ctx, &m);
    float *p = out->v;
    dt_tensor *ps[4] = {m.w1, m.b1, m.w2, m.b2};
    for (int i = 0; i < 4; i++) {
        int64_t n = dt_tensor_numel(ps[i]);
        assert_int_equal(dt_tensor_get(ps[i], p, n), DT_OK);
        p += n;
    }
    mlp_free(&m);
    dt_ctx_free(ctx);
}

static void test_determinism(void **state)
{
    (void)state;
    static snapshot a, b, c, d, e;
    train(5, 1, &a);
    train(5, 1, &b);
    if (memcmp(&a, &b, sizeof a) != 0) fail_msg("same seed, 1 thread: parameters differ");
    train(6, 1, &c);
    if (memcmp(a.v, c.v, sizeof a.v) == 0) fail_msg("seeds 5 and 6 gave identical parameters");
    train(5, 2, &d);
    train(5, 2, &e);
    if (memcmp(&d, &e, sizeof d) != 0) fail_msg("same seed, 2 threads: parameters differ");
}

/* Zero-copy (for bindings): a wrapped buffer is the tensor's memory both
 * ways, dt_tensor_data with the strides reads views in place, and backends
 * without host memory refuse with a message. */
static void test_zero_copy(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    float buf[6] = {1, 2, 3, 4, 5, 6};
    if (strcmp(dt_backend_name(ctx), "cpu") != 0) {   /* DTRAIN_BACKEND: no host memory */
        assert_null(dt_tensor_wrap(ctx, DT_F32, 2, (int64_t[]){2, 3}, buf));
        assert_int_equal(dt_last_status(ctx), DT_ENOTSUP);
        dt_ctx_free(ctx);
        return;
    }
    dt_tensor *a = dt_tensor_wrap(ctx, DT_F32, 2, (int64_t[]){2, 3}, buf);
    tu_check(ctx, a, "wrap");
    assert_ptr_equal(dt_tensor_data(a), buf);
    float s = dt_tensor_item(dt_sum(ctx, a));
    assert_true(s == 21.0f);
    buf[0] = 101;   /* the caller's writes are the tensor's contents */
    assert_true(dt_tensor_item(dt_sum(ctx, a)) == 121.0f);
    assert_int_equal(dt_tensor_fill(a, 0.5f), DT_OK);   /* and the other way */
    assert_true(buf[5] == 0.5f);
    /* a transposed view: same memory, strides (1, 3) */
    dt_tensor *t = dt_transpose(ctx, a, 0, 1);
    assert_ptr_equal(dt_tensor_data(t), buf);
    assert_int_equal(dt_tensor_stride(t, 0), 1);
    assert_int_equal(dt_tensor_stride(t, -1), 3);
    assert_int_equal(dt_tensor_stride(t, 2), 0);
    dt_ctx_step_reset(ctx);
    dt_tensor_free(a);   /* leaves buf alone (ASan would see a bad free) */
    buf[1] = 7;
    /* a lazily zeroed gradient reads as zeros through its pointer */
    dt_tensor *w = dt_param_new(ctx, "w", 1, (int64_t[]){4});
    tu_check(ctx, w, "param");
    assert_int_equal(dt_tensor_fill(w, 1), DT_OK);
    dt_tensor *loss = dt_sum(ctx, dt_mul(ctx, w, w));
    assert_int_equal(dt_backward(ctx, loss), DT_OK);
    float *g = dt_tensor_data(dt_tensor_grad(w));
    assert_true(g[0] == 2.0f && g[3] == 2.0f);
    dt_ctx_step_reset(ctx);
    dt_ctx_zero_grad(ctx);
    g = dt_tensor_data(dt_tensor_grad(w));
    assert_true(g[0] == 0.0f && g[3] == 0.0f);
    /* refused: misaligned, NULL */
    char raw[16];
    assert_null(dt_tensor_wrap(ctx, DT_F32, 1, (int64_t[]){2}, raw + 1));
    assert_int_equal(dt_last_status(ctx), DT_EINVAL);
    assert_non_null(strstr(dt_last_error(ctx), "misaligned"));
    assert_null(dt_tensor_wrap(ctx, DT_F32, 1, (int64_t[]){2}, NULL));
    assert_null(dt_tensor_data(NULL));
    dt_ctx_free(ctx);
    /* a backend whose memory is not the host's */
    dt_ctx_config cfg;
    dt_ctx_config_init(&cfg);
    cfg.backend = "cpu-staged";
    ctx = dt_ctx_new(&cfg);
    assert_int_equal(dt_ctx_status(ctx), DT_OK);
    assert_null(dt_tensor_wrap(ctx, DT_F32, 2, (int64_t[]){2, 3}, buf));
    assert_int_equal(dt_last_status(ctx), DT_ENOTSUP);
    assert_non_null(strstr(dt_last_error(ctx), "cpu-staged"));
    dt_tensor *d = dt_tensor_new(ctx, DT_F32, 1, (int64_t[]){3});
    assert_non_null(d);
    assert_null(dt_tensor_data(d));
    assert_int_equal(dt_last_status(ctx), DT_ENOTSUP);
    dt_ctx_free(ctx);
}

/* A persistent tensor freed while the step's tape still reads it (before
 * backward): its memory stays until dt_ctx_step_reset, so backward computes
 * from the right values (ASan would report a use after free otherwise). */
static void test_free_during_step(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    const float xv[6] = {1, 2, 3, 4, 5, 6}, wv[6] = {0.5f, -1, 2, 0.25f, 1, -0.5f};
    dt_tensor *x = tu_tensor(ctx, SHP(2, 3), xv);
    dt_tensor *w = tu_param(ctx, "w", SHP(3, 2), wv);
    dt_tensor *y = dt_matmul(ctx, x, w, 0, 0);
    dt_tensor *loss = dt_sum(ctx, y);
    tu_check(ctx, loss, "loss");
    dt_tensor_free(x);   /* the tape's matmul node still needs x for dw */
    dt_tensor *extra = tu_tensor(ctx, SHP(4), NULL);
    dt_tensor_free(extra);
    tu_check_status(ctx, dt_backward(ctx, loss), "backward");
    float g[6];
    tu_check_status(ctx, dt_tensor_get(dt_tensor_grad(w), g, 6), "grad");
    /* d sum(x w) / dw[i][j] = sum over rows of x[r][i] */
    const float want[6] = {5, 5, 7, 7, 9, 9};
    for (int i = 0; i < 6; i++)
        assert_float_equal(g[i], want[i], 0);
    dt_tensor *after = tu_tensor(ctx, SHP(2), NULL);
    dt_tensor_free(after);   /* no tape now: freed at once */
    dt_ctx_step_reset(ctx);      /* the kept ones go here (LeakSanitizer checks) */
    dt_ctx_free(ctx);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_mem_warm_step_allocates_nothing),
    cmocka_unit_test(test_mem_stats),
    cmocka_unit_test(test_mem_arena_cap),
    cmocka_unit_test(test_mem_backward_reuses_grads),
    cmocka_unit_test(test_mem_recompute_lowers_peak),
    cmocka_unit_test(test_determinism),
    cmocka_unit_test(test_zero_copy),
    cmocka_unit_test(test_free_during_step),
};

DT_TEST_GROUP(core_memory, tests)
