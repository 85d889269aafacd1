/*
 * tests/bench/bench_kernels.c - the CPU backend's kernels one by one: the
 * best of 5 timings of REPS calls each, in microseconds per call, 1 thread.
 * It includes backends/cpu.c to call the kernels directly; compiled with
 * the portable library's flags and run with DTRAIN_CPU_KERNELS=baseline,
 * avx2 and avx512 (tests/bench/portable.sh), it shows which kernels the
 * per-level copies speed up, and by how much.
 *   gcc -std=c11 -D_GNU_SOURCE -O3 -march=x86-64 -fno-math-errno \
 *       -ffp-contract=off -fno-trapping-math -DDT_WITH_CPU -I. \
 *       tests/bench/bench_kernels.c -lopenblas -lm -lpthread
 */
#include "backends/cpu.c"

#include <time.h>

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void *hook_malloc(size_t n, void *u)
{
    (void)u;
    return malloc(n);
}
static void *hook_realloc(void *p, size_t n, void *u)
{
    (void)u;
    return realloc(p, n);
}
static void hook_free(void *p, void *u)
{
    (void)u;
    free(p);
}

/* n floats spread over [lo, hi) by a fixed hash: the same inputs every run */
static float *data(int64_t n, float lo, float hi)
{
    float *x = malloc((size_t)n * sizeof *x);
    if (!x) exit(1);
    for (int64_t i = 0; i < n; i++)
        x[i] = lo + (hi - lo) * (float)((uint64_t)i * 2654435761u % 1000003) / 1000003.0f;
    return x;
}

#define TIME(name, reps, call)                                                \
    do {                                                                      \
        double best_ = 1e30;                                                  \
        for (int try_ = 0; try_ < 5; try_++) {                                \
            double t0_ = now();                                               \
            for (int rep_ = 0; rep_ < (reps); rep_++) call;                   \
            double t_ = (now() - t0_) / (reps);                               \
            best_ = t_ < best_ ? t_ : best_;                                  \
        }                                                                     \
        printf("%s\t%.1f\n", name, best_ * 1e6);                              \
    } while (0)

static void elementwise(dt_backend *be)
{
    int64_t n = 1 << 20;
    float *x = data(n, -4, 4), *y = data(n, 0, 1), *dy = data(n, -1, 1), *dx = data(n, 0, 1);
    TIME("gelu_tanh 1M", 20, cpu_unary(be, DT_UNARY_GELU_TANH, n, x, y));
    TIME("gelu_tanh backward 1M", 20, cpu_unary_backward(be, DT_UNARY_GELU_TANH, n, x, y, dy, dx, 0));
    TIME("gelu 1M", 20, cpu_unary(be, DT_UNARY_GELU, n, x, y));
    TIME("relu 1M", 20, cpu_unary(be, DT_UNARY_RELU, n, x, y));
    TIME("relu backward 1M", 20, cpu_unary_backward(be, DT_UNARY_RELU, n, x, y, dy, dx, 0));
    TIME("axpby 1M", 20, cpu_axpby(be, n, 0.5f, x, 0.9f, dx));
    TIME("softmax 8192x128", 20, cpu_softmax(be, 8192, 128, 1, x, y, 0));
    TIME("softmax backward 8192x128", 20, cpu_softmax_backward(be, 8192, 128, 1, y, dy, dx, 0, 0));
    TIME("bias_grad 8192x128", 20, cpu_bias_grad(be, 8192, 128, 1, dy, y, 0));
    free(x), free(y), free(dy), free(dx);
}

static void rows(dt_backend *be)
{
    int64_t r = 768, d = 128, c = 256;
    float *x = data(r * c, -4, 4), *y = data(r * c, 0, 1), *dy = data(r * d, -1, 1);
    float *dx = data(r * d, 0, 1), *mean = data(r, 0, 0), *rstd = data(r, 0, 0);
    float *w = data(d, 0, 2), *b = data(d, -1, 1), *dw = data(d, 0, 0), *db = data(d, 0, 0);
    TIME("layernorm 768x128", 50, cpu_layernorm_forward(be, r, d, x, w, b, 1e-5f, y, mean, rstd));
    TIME("layernorm backward 768x128", 50,
         cpu_layernorm_backward(be, r, d, x, w, mean, rstd, dy, dx, dw, db, 0));
    int32_t *labels = malloc((size_t)r * sizeof *labels);
    if (!labels) exit(1);
    for (int64_t i = 0; i < r; i++) labels[i] = (int32_t)(i % c);
    float loss;
    TIME("cross entropy 768x256", 50,
         cpu_xent_forward(be, r, c, x, labels, DT_XENT_KEEP_ALL, r, y, &loss));
    free(x), free(y), free(dy), free(dx), free(mean), free(rstd), free(w), free(b), free(dw);
    free(db), free(labels);
}

static void attention_and_adamw(dt_backend *be)
{
    int64_t bh = 48, t = 64, d = 32, n = 8 << 20;
    float *q = data(bh * t * d, -1, 1), *k = data(bh * t * d, -1, 1), *v = data(bh * t * d, -1, 1);
    float *o = data(bh * t * d, 0, 1), *lse = data(bh * t, 0, 1);
    TIME("attention 48x64x32", 50,
         cpu_attention_forward(be, bh, t, d, 0.17f, 1, NULL, q, k, v, o, lse));
    float *w = data(n, -1, 1), *g = data(n, -1, 1), *m = data(n, -1, 1), *s = data(n, 0, 1);
    TIME("adamw 8M", 3, cpu_adam_update(be, n, w, g, m, s, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.1f, 1,
                                        0.5f, 0.4f));
    free(q), free(k), free(v), free(o), free(lse), free(w), free(g), free(m), free(s);
}

int main(void)
{
    dt_backend_params p = {.threads = 1,
                           .allocator = {.malloc_fn = hook_malloc, .realloc_fn = hook_realloc,
                                         .free_fn = hook_free}};
    dt_backend *be;
    char err[128];
    if (cpu_init(&p, &be, err, sizeof err) != DT_OK) {
        fprintf(stderr, "bench_kernels: %s\n", err);
        return 1;
    }
    elementwise(be);
    rows(be);
    attention_and_adamw(be);
    cpu_shutdown(be);
    return 0;
}
