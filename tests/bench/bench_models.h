/*
 * tests/bench/bench_models.h - what the dtrain benchmarks share: timing and
 * statistics helpers, fixed-seed synthetic data, and the MLP and CNN of the
 * PyTorch comparison (bench_torch.py, bench_ddp_torch.py build the same).
 * Written against dtrain.h only; include it once, from one .c file.
 */
#ifndef DT_BENCH_MODELS_H
#define DT_BENCH_MODELS_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "dtrain.h"

/* ------------------------------------------------------------------------ */
/* helpers                                                                   */
/* ------------------------------------------------------------------------ */

static inline double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline void die_ctx(dt_ctx *ctx, const char *what)
{
    fprintf(stderr, "bench: %s failed: %s\n", what,
            ctx ? dt_last_error(ctx) : "(no context)");
    exit(1);
}

static inline void check(dt_ctx *ctx, dt_status s, const char *what)
{
    if (s != DT_OK) {
        fprintf(stderr, "bench: %s failed: %s (%s)\n", what, dt_strerror(s),
                dt_last_error(ctx));
        exit(1);
    }
}

/* splitmix64: fixed-seed synthetic data independent of the library's RNG */
static uint64_t rng_state = 0x5eed1234abcdULL;
static inline uint64_t rng_next(void)
{
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}
static inline float rng_uniform(void) /* [0,1) */
{
    return (float)(rng_next() >> 40) * (1.0f / 16777216.0f);
}
static inline float rng_normal(void)
{
    float u1 = rng_uniform(), u2 = rng_uniform();
    if (u1 < 1e-7f) u1 = 1e-7f;
    return sqrtf(-2.0f * logf(u1)) * cosf(6.28318530718f * u2);
}

static inline int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static inline double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return (n % 2) ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static inline double mean(const double *v, int n)
{
    double s = 0;
    for (int i = 0; i < n; i++) s += v[i];
    return n ? s / n : 0;
}

static inline long maxrss_kb(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return -1;
    return ru.ru_maxrss; /* kilobytes on Linux */
}

static inline dt_ctx *make_ctx(int threads, uint64_t seed)
{
    dt_ctx_config cfg;
    dt_ctx_config_init(&cfg);
    cfg.threads = threads;
    cfg.seed = seed;
    dt_ctx *ctx = dt_ctx_new(&cfg);
    if (!ctx) {
        fprintf(stderr, "bench: dt_ctx_new: out of memory\n");
        exit(1);
    }
    if (dt_ctx_status(ctx) != DT_OK) die_ctx(ctx, "dt_ctx_new");
    return ctx;
}

/* Persistent tensor filled with N(0,1) (f32) or uniform labels (i32). */
static inline dt_tensor *random_input(dt_ctx *ctx, int ndim, const int64_t *shape)
{
    dt_tensor *t = dt_tensor_new(ctx, DT_F32, ndim, shape);
    if (!t) die_ctx(ctx, "dt_tensor_new(input)");
    int64_t n = dt_tensor_numel(t);
    float *h = malloc((size_t)n * sizeof *h);
    if (!h) exit(1);
    for (int64_t i = 0; i < n; i++) h[i] = rng_normal();
    check(ctx, dt_tensor_set(t, h, n), "dt_tensor_set(input)");
    free(h);
    return t;
}

static inline dt_tensor *random_labels(dt_ctx *ctx, int64_t n, int classes)
{
    dt_tensor *t = dt_tensor_new(ctx, DT_I32, 1, &n);
    if (!t) die_ctx(ctx, "dt_tensor_new(labels)");
    int32_t *h = malloc((size_t)n * sizeof *h);
    if (!h) exit(1);
    for (int64_t i = 0; i < n; i++) h[i] = (int32_t)(rng_next() % (uint64_t)classes);
    check(ctx, dt_tensor_set(t, h, n), "dt_tensor_set(labels)");
    free(h);
    return t;
}

/* PyTorch-default init: kaiming_uniform(a=sqrt(5)) + bias U(+-1/sqrt(fan_in)) */
static inline dt_tensor *param(dt_ctx *ctx, const char *name, int ndim, const int64_t *shape,
                        int64_t fan_in, int is_bias)
{
    dt_tensor *p = dt_param_new(ctx, name, ndim, shape);
    if (!p) die_ctx(ctx, name);
    if (is_bias)
        check(ctx, dt_tensor_init_bias(ctx, p, fan_in), name);
    else
        check(ctx, dt_tensor_init_kaiming_uniform(ctx, p, sqrtf(5.0f)), name);
    return p;
}

static inline dt_optim *make_sgd(dt_ctx *ctx)
{
    dt_optim_config oc;
    dt_optim_config_init(&oc, DT_SGD);
    oc.lr = 0.01f;
    oc.momentum = 0.9f;
    dt_optim *opt = dt_optim_new(ctx, &oc, NULL, 0);
    if (!opt) die_ctx(ctx, "dt_optim_new");
    return opt;
}

/* ------------------------------------------------------------------------ */
/* models                                                                    */
/* ------------------------------------------------------------------------ */

typedef struct mlp {
    dt_tensor *w1, *b1, *w2, *b2, *w3, *b3;
} mlp;

static inline void mlp_init(dt_ctx *ctx, mlp *m)
{
    int64_t s1[2] = {512, 784}, s2[2] = {512, 512}, s3[2] = {10, 512};
    int64_t b1 = 512, b2 = 512, b3 = 10;
    m->w1 = param(ctx, "fc1.weight", 2, s1, 784, 0);
    m->b1 = param(ctx, "fc1.bias", 1, &b1, 784, 1);
    m->w2 = param(ctx, "fc2.weight", 2, s2, 512, 0);
    m->b2 = param(ctx, "fc2.bias", 1, &b2, 512, 1);
    m->w3 = param(ctx, "fc3.weight", 2, s3, 512, 0);
    m->b3 = param(ctx, "fc3.bias", 1, &b3, 512, 1);
}

/* x (N,784) -> logits (N,10) */
static inline dt_tensor *mlp_forward(dt_ctx *ctx, const mlp *m, dt_tensor *x)
{
    dt_tensor *h = dt_relu(ctx, dt_linear(ctx, x, m->w1, m->b1));
    h = dt_relu(ctx, dt_linear(ctx, h, m->w2, m->b2));
    return dt_linear(ctx, h, m->w3, m->b3);
}

typedef struct cnn {
    dt_tensor *c1w, *c1b, *c2w, *c2b, *f1w, *f1b, *f2w, *f2b;
} cnn;

static inline void cnn_init(dt_ctx *ctx, cnn *m)
{
    int64_t c1[4] = {32, 1, 3, 3}, c2[4] = {64, 32, 3, 3};
    int64_t f1[2] = {128, 3136}, f2[2] = {10, 128};
    int64_t n32 = 32, n64 = 64, n128 = 128, n10 = 10;
    m->c1w = param(ctx, "conv1.weight", 4, c1, 9, 0);
    m->c1b = param(ctx, "conv1.bias", 1, &n32, 9, 1);
    m->c2w = param(ctx, "conv2.weight", 4, c2, 288, 0);
    m->c2b = param(ctx, "conv2.bias", 1, &n64, 288, 1);
    m->f1w = param(ctx, "fc1.weight", 2, f1, 3136, 0);
    m->f1b = param(ctx, "fc1.bias", 1, &n128, 3136, 1);
    m->f2w = param(ctx, "fc2.weight", 2, f2, 128, 0);
    m->f2b = param(ctx, "fc2.bias", 1, &n10, 128, 1);
}

/* x (N,1,28,28) -> logits (N,10) */
static inline dt_tensor *cnn_forward(dt_ctx *ctx, const cnn *m, dt_tensor *x)
{
    dt_tensor *h = dt_relu(ctx, dt_conv2d(ctx, x, m->c1w, m->c1b, 1, 1));
    h = dt_max_pool2d(ctx, h, 2, 2, 0);
    h = dt_relu(ctx, dt_conv2d(ctx, h, m->c2w, m->c2b, 1, 1));
    h = dt_max_pool2d(ctx, h, 2, 2, 0);
    h = dt_flatten(ctx, h, 1);
    h = dt_relu(ctx, dt_linear(ctx, h, m->f1w, m->f1b));
    return dt_linear(ctx, h, m->f2w, m->f2b);
}

#endif
