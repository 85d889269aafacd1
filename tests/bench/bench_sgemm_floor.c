/* bench_sgemm_floor.c - the machine's raw cblas_sgemm rate on the matrix
 * products of one GPT training step (examples/gpt.c's model), for the
 * "within 1.3x of the sgemm floor" target of tests/bench/gpt.sh.
 *
 * One step of a GPT with P parameters over N tokens costs about 6 P N FLOPs
 * (2 P N forward, 4 P N backward), almost all of it in linear layers.  This
 * program runs exactly those products with OpenBLAS alone (its own threads,
 * nothing else on the step): for each linear layer (in -> out) the forward
 * N x in @ in x out, the input gradient N x out @ out x in, and the weight
 * gradient in x N @ N x out, plus the tied output head (embd -> vocab).  Their
 * FLOPs over their best time is the rate; the floor of a step is 6 P N over
 * that rate.
 *
 *   bench_sgemm_floor LAYERS EMBD VOCAB TOKENS THREADS [REPEATS]
 * prints one line:  sgemm gflops=R floor_ms=F params=P tokens=N
 */
#include <cblas.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

void openblas_set_num_threads(int n);

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Buffers for the products: inputs x, w, g are only read, so no value
 * grows or shrinks towards denormals from one product to the next. */
typedef struct bufs { float *x, *w, *g, *y, *dx, *dw; } bufs;

/* The three products of one linear layer in -> out over n rows; returns FLOPs. */
static double linear_products(int64_t n, int64_t in, int64_t out, const bufs *m)
{
    /* forward: y[n,out] = x[n,in] @ W^T, W stored [out,in] as PyTorch's */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)out, (int)in, 1.f, m->x,
                (int)in, m->w, (int)in, 0.f, m->y, (int)out);
    /* input gradient: dx[n,in] = dy[n,out] @ W[out,in] */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)n, (int)in, (int)out, 1.f, m->g,
                (int)out, m->w, (int)in, 0.f, m->dx, (int)in);
    /* weight gradient: dW[out,in] += dy^T[out,n] @ x[n,in] */
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)out, (int)in, (int)n, 1.f, m->g,
                (int)out, m->x, (int)in, 1.f, m->dw, (int)in);
    return 3.0 * 2.0 * (double)n * (double)in * (double)out;
}

static float *filled(int64_t count, int64_t prime, float scale)
{
    float *p = malloc((size_t)count * sizeof(float));
    for (int64_t i = 0; p && i < count; i++)
        p[i] = ((float)((i * prime) % 1000) * 1e-3f - 0.5f) * scale;
    return p;
}

int main(int argc, char **argv)
{
    if (argc < 6) {
        fprintf(stderr, "usage: %s LAYERS EMBD VOCAB TOKENS THREADS [REPEATS]\n", argv[0]);
        return 2;
    }
    int64_t layers = atoll(argv[1]), embd = atoll(argv[2]), vocab = atoll(argv[3]);
    int64_t n = atoll(argv[4]);
    int threads = atoi(argv[5]), repeats = argc > 6 ? atoi(argv[6]) : 5;
    if (layers < 1 || embd < 1 || vocab < 1 || n < 1 || threads < 1 || repeats < 1) {
        fprintf(stderr, "bench_sgemm_floor: every argument must be positive\n");
        return 2;
    }
    openblas_set_num_threads(threads);
    int64_t widest = vocab > 4 * embd ? vocab : 4 * embd;
    bufs m = {filled(n * widest, 7919, 1.f), filled(embd * widest, 104729, 0.1f),
              filled(n * widest, 15485863, 1.f), filled(n * widest, 1, 0.f),
              filled(n * widest, 1, 0.f), filled(embd * widest, 1, 0.f)};
    if (!m.x || !m.w || !m.g || !m.y || !m.dx || !m.dw) {
        fprintf(stderr, "bench_sgemm_floor: out of memory\n");
        return 1;
    }
    double best = 1e30, flops = 0;
    for (int r = 0; r <= repeats; r++) {   /* r == 0 warms up */
        double t0 = now_s();
        flops = 0;
        for (int64_t l = 0; l < layers; l++) {
            flops += linear_products(n, embd, 3 * embd, &m);   /* q, k, v */
            flops += linear_products(n, embd, embd, &m);       /* attention out */
            flops += linear_products(n, embd, 4 * embd, &m);   /* MLP up */
            flops += linear_products(n, 4 * embd, embd, &m);   /* MLP down */
        }
        flops += linear_products(n, embd, vocab, &m);          /* tied head */
        double t = now_s() - t0;
        if (r > 0 && t < best)
            best = t;
    }
    /* P as the model counts it: 12 embd^2 per layer (+ biases, layer norms),
     * the token table (vocab x embd); the position table adds context x embd,
     * a lookup, left out of the products and of P here. */
    double p = (double)layers * (12.0 * embd * embd + 13.0 * embd) + (double)vocab * embd;
    double rate = flops / best;
    printf("sgemm gflops=%.1f floor_ms=%.2f params=%.0f tokens=%lld products_ms=%.2f\n",
           rate * 1e-9, 6.0 * p * n / rate * 1e3, p, (long long)n, best * 1e3);
    float *all[] = {m.x, m.w, m.g, m.y, m.dx, m.dw};
    for (int i = 0; i < 6; i++)
        free(all[i]);
    return 0;
}
