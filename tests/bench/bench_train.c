/*
 * tests/bench/bench_train.c - training-step, matmul and peak-RSS benchmarks
 * for dtrain.  Written against dtrain.h only.
 *
 *   bench_train [--threads N] [--mode all|mlp|cnn|matmul] [--warmup W]
 *               [--mlp-steps S] [--cnn-steps S] [--max-seconds T]
 *   bench_train --rss-epoch [--threads N] [--data DIR]
 *
 * Every result is one machine-readable line, "key=value" separated by
 * spaces, e.g.
 *   mlp threads=1 ms=4.12 mean=4.20 steps=200
 *   cnn threads=1 ms=31.0 mean=31.4 steps=50
 *   matmul threads=1 shape=128x784x512 dtrain_gflops=.. blas_gflops=.. frac=..
 *     (shape is MxKxN: A (M,K) times B (K,N))
 *   rss_epoch impl=dtrain threads=1 batches=469 loss=.. seconds=.. maxrss_kb=..
 * Anything else printed starts with '#'.  Exit status 0 only on success.
 */
#define _GNU_SOURCE /* cblas.h (OpenBLAS) uses cpu_set_t; clock_gettime */

#include <cblas.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "dtrain.h"

#include "bench_models.h"
#include "../../examples/fmnist.h"

/* ------------------------------------------------------------------------ */
/* training-step benchmark                                                   */
/* ------------------------------------------------------------------------ */

typedef struct opts {
    int threads;
    int warmup;
    int mlp_steps;
    int cnn_steps;
    double max_seconds; /* per model, timed phase */
    const char *mode;
    const char *data_dir;
    int rss_epoch;
} opts;

enum { MODEL_MLP, MODEL_CNN };

/* One full training step; returns the loss value. */
static float train_step(dt_ctx *ctx, dt_optim *opt, int model, const void *m, dt_tensor *x,
                        dt_tensor *y)
{
    dt_optim_zero_grad(opt);
    dt_tensor *logits = model == MODEL_MLP ? mlp_forward(ctx, (const mlp *)m, x)
                                           : cnn_forward(ctx, (const cnn *)m, x);
    dt_tensor *loss = dt_cross_entropy(ctx, logits, y);
    if (!loss) die_ctx(ctx, model == MODEL_MLP ? "mlp forward" : "cnn forward");
    check(ctx, dt_backward(ctx, loss), "dt_backward");
    check(ctx, dt_optim_step(opt), "dt_optim_step");
    /* Read the loss before the reset frees it; this is also the sync point
     * (a no-op copy of one float on the CPU backend). */
    float l = dt_tensor_item(loss);
    dt_ctx_step_reset(ctx);
    return l;
}

static void bench_model(const opts *o, int model)
{
    const char *name = model == MODEL_MLP ? "mlp" : "cnn";
    dt_ctx *ctx = make_ctx(o->threads, 1234);
    mlp mm;
    cnn cm;
    const void *m;
    dt_tensor *x, *y;
    int64_t batch;
    if (model == MODEL_MLP) {
        batch = 128;
        mlp_init(ctx, &mm);
        m = &mm;
        int64_t xs[2] = {batch, 784};
        x = random_input(ctx, 2, xs);
    } else {
        batch = 64;
        cnn_init(ctx, &cm);
        m = &cm;
        int64_t xs[4] = {batch, 1, 28, 28};
        x = random_input(ctx, 4, xs);
    }
    y = random_labels(ctx, batch, 10);
    dt_optim *opt = make_sgd(ctx);

    float first = 0, last = 0;
    for (int i = 0; i < o->warmup; i++) {
        last = train_step(ctx, opt, model, m, x, y);
        if (i == 0) first = last;
        if (!isfinite(last)) {
            fprintf(stderr, "bench_train: %s loss is %f at warm-up step %d\n", name, last, i);
            exit(1);
        }
    }
    dt_mem_stats ms0;
    dt_mem_stats_get(ctx, &ms0);

    int steps = model == MODEL_MLP ? o->mlp_steps : o->cnn_steps;
    double *t = malloc((size_t)steps * sizeof *t);
    if (!t) exit(1);
    int n = 0;
    double t_start = now_s();
    while (n < steps) {
        double t0 = now_s();
        last = train_step(ctx, opt, model, m, x, y);
        t[n++] = now_s() - t0;
        if (n >= 5 && now_s() - t_start > o->max_seconds) break;
    }
    if (!isfinite(last)) {
        fprintf(stderr, "bench_train: %s loss is %f after timing\n", name, last);
        exit(1);
    }
    dt_mem_stats ms1;
    dt_mem_stats_get(ctx, &ms1);
    double avg = mean(t, n);
    double med = median(t, n);
    printf("# %s: loss %.4f -> %.4f (same batch each step); arena cap %.1f MB peak %.1f MB, "
           "persistent %.1f MB, arena grows during timing %llu\n",
           name, first, last, ms1.arena_capacity / 1e6, ms1.arena_peak / 1e6,
           ms1.persistent_bytes / 1e6, (unsigned long long)(ms1.arena_grows - ms0.arena_grows));
    printf("%s threads=%d ms=%.4f mean=%.4f min=%.4f steps=%d\n", name, o->threads, med * 1e3,
           avg * 1e3, t[0] * 1e3, n);
    fflush(stdout);
    free(t);
    dt_optim_free(opt);
    dt_ctx_free(ctx);
}

/* ------------------------------------------------------------------------ */
/* matmul: dt_matmul forward vs raw cblas_sgemm, same process and threads   */
/* ------------------------------------------------------------------------ */

static float *alloc64(size_t bytes)
{
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

static void bench_matmul_shape(const opts *o, dt_ctx *ctx, int64_t M, int64_t K, int64_t N)
{
    int64_t as[2] = {M, K}, bs[2] = {K, N};
    dt_tensor *a = random_input(ctx, 2, as);
    dt_tensor *b = random_input(ctx, 2, bs);
    /* 64-byte aligned like dtrain's tensors, so sgemm gets the same start */
    float *ha = alloc64((size_t)(M * K) * sizeof(float));
    float *hb = alloc64((size_t)(K * N) * sizeof(float));
    float *hc = alloc64((size_t)(M * N) * sizeof(float));
    float *hd = alloc64((size_t)(M * N) * sizeof(float));
    if (!ha || !hb || !hc || !hd) exit(1);
    check(ctx, dt_tensor_get(a, ha, M * K), "dt_tensor_get(a)");
    check(ctx, dt_tensor_get(b, hb, K * N), "dt_tensor_get(b)");

    /* dtrain's backend may size OpenBLAS's pool itself (e.g. to 1 if it
     * splits work over its own threads); keep its setting for dtrain's
     * rounds and use `threads` for the raw sgemm rounds. */
    int dt_blas_threads = openblas_get_num_threads();

    double flop = 2.0 * (double)M * (double)N * (double)K;
    /* calls per timed round: ~20 ms of work at ~50 GFLOP/s, at least 1 */
    int per = (int)(0.02 * 50e9 / flop);
    if (per < 1) per = 1;
    if (per > 200) per = 200;

    /* correctness check + warm-up */
    dt_tensor *c = NULL;
    for (int i = 0; i < 3; i++) {
        c = dt_matmul(ctx, a, b, 0, 0);
        if (!c) die_ctx(ctx, "dt_matmul");
        if (i < 2) dt_ctx_step_reset(ctx);
    }
    check(ctx, dt_tensor_get(c, hd, M * N), "dt_tensor_get(c)");
    dt_ctx_step_reset(ctx);
    openblas_set_num_threads(o->threads);
    for (int i = 0; i < 3; i++)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)M, (int)N, (int)K, 1.0f, ha,
                    (int)K, hb, (int)N, 0.0f, hc, (int)N);
    double maxdiff = 0, maxref = 0;
    for (int64_t i = 0; i < M * N; i++) {
        double d = fabs((double)hc[i] - (double)hd[i]);
        if (d > maxdiff) maxdiff = d;
        if (fabs(hc[i]) > maxref) maxref = fabs(hc[i]);
    }
    if (!(maxdiff <= 1e-3 * (maxref + 1.0))) {
        fprintf(stderr, "bench_train: dt_matmul %lldx%lldx%lld differs from sgemm: maxdiff %g\n",
                (long long)M, (long long)K, (long long)N, maxdiff);
        exit(1);
    }

    enum { ROUNDS_MAX = 64 };
    double td[ROUNDS_MAX], tb[ROUNDS_MAX];
    int rounds = 0;
    double t_start = now_s();
    /* dtrain's rounds first, then raw sgemm's.  Interleaving them measured
     * interference, not speed: after a raw round OpenBLAS's own pool threads
     * keep busy-waiting (sched_yield) for ~0.1 s and take a core from
     * dtrain's workers, which drive OpenBLAS single-threaded. */
    openblas_set_num_threads(dt_blas_threads);
    while (rounds < ROUNDS_MAX) {
        double t0 = now_s();
        for (int i = 0; i < per; i++) {
            dt_tensor *r = dt_matmul(ctx, a, b, 0, 0);
            if (!r) die_ctx(ctx, "dt_matmul");
            dt_ctx_step_reset(ctx);
        }
        td[rounds++] = (now_s() - t0) / per;
        if (rounds >= 7 && now_s() - t_start > 1.0) break;
    }
    int dt_rounds = rounds;
    openblas_set_num_threads(o->threads);
    t_start = now_s();
    for (rounds = 0; rounds < dt_rounds; rounds++) {
        double t0 = now_s();
        for (int i = 0; i < per; i++)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)M, (int)N, (int)K, 1.0f,
                        ha, (int)K, hb, (int)N, 0.0f, hc, (int)N);
        tb[rounds] = (now_s() - t0) / per;
    }
    openblas_set_num_threads(dt_blas_threads);
    double gd = flop / median(td, rounds) / 1e9;
    double gb = flop / median(tb, rounds) / 1e9;
    printf("matmul threads=%d shape=%lldx%lldx%lld dtrain_gflops=%.2f blas_gflops=%.2f "
           "frac=%.4f maxdiff=%.3g rounds=%d per=%d dt_blas_threads=%d\n",
           o->threads, (long long)M, (long long)K, (long long)N, gd, gb, gd / gb, maxdiff, rounds,
           per, dt_blas_threads);
    fflush(stdout);
    free(ha);
    free(hb);
    free(hc);
    free(hd);
    dt_tensor_free(a);
    dt_tensor_free(b);
}

static void bench_matmul(const opts *o)
{
    dt_ctx *ctx = make_ctx(o->threads, 99);
    dt_ctx_set_grad_enabled(ctx, 0);
    static const int64_t shapes[][3] = {{128, 784, 512}, {512, 512, 512}, {1024, 1024, 1024}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        bench_matmul_shape(o, ctx, shapes[i][0], shapes[i][1], shapes[i][2]);
    dt_ctx_free(ctx);
}

/* ------------------------------------------------------------------------ */
/* one epoch of MLP training on Fashion-MNIST, for the peak-RSS comparison   */
/* ------------------------------------------------------------------------ */

static void rss_epoch(const opts *o)
{
    dt_ctx *ctx = make_ctx(o->threads, 1);
    dt_dataset *ds = fmnist_load(ctx, o->data_dir, 0);
    if (!ds) die_ctx(ctx, "loading Fashion-MNIST");
    dt_loader_config lc;
    dt_loader_config_init(&lc);
    lc.batch = 128;
    lc.shuffle = 1;
    lc.drop_last = 0;
    lc.seed = 1;
    lc.mean = 0.2860f;
    lc.std = 0.3530f;
    dt_loader *ld = dt_loader_new(ctx, ds, &lc);
    if (!ld) die_ctx(ctx, "dt_loader_new");
    mlp m;
    mlp_init(ctx, &m);
    dt_optim *opt = make_sgd(ctx);

    double t0 = now_s();
    check(ctx, dt_loader_start_epoch(ld, 0), "dt_loader_start_epoch");
    int64_t batches = 0;
    double loss_sum = 0, last = 0;
    for (;;) {
        dt_tensor *x, *y;
        dt_status s = dt_loader_next(ld, &x, &y);
        if (s == DT_EOF) break;
        check(ctx, s, "dt_loader_next");
        dt_optim_zero_grad(opt);
        dt_tensor *loss = dt_cross_entropy(ctx, mlp_forward(ctx, &m, dt_flatten(ctx, x, 1)), y);
        if (!loss) die_ctx(ctx, "rss-epoch forward");
        check(ctx, dt_backward(ctx, loss), "dt_backward");
        check(ctx, dt_optim_step(opt), "dt_optim_step");
        last = dt_tensor_item(loss);
        loss_sum += last;
        dt_ctx_step_reset(ctx);
        batches++;
    }
    double secs = now_s() - t0;
    if (batches == 0 || !isfinite(loss_sum)) {
        fprintf(stderr, "bench_train: rss-epoch: %lld batches, loss sum %f\n",
                (long long)batches, loss_sum);
        exit(1);
    }
    dt_mem_stats ms;
    dt_mem_stats_get(ctx, &ms);
    printf("# rss-epoch: arena cap %.1f MB, persistent %.1f MB, loader wait %.3f s\n",
           ms.arena_capacity / 1e6, ms.persistent_bytes / 1e6, dt_loader_wait_seconds(ld));
    printf("rss_epoch impl=dtrain threads=%d batches=%lld loss=%.4f last=%.4f seconds=%.3f "
           "maxrss_kb=%ld\n",
           o->threads, (long long)batches, loss_sum / (double)batches, last, secs, maxrss_kb());
    fflush(stdout);
    dt_loader_free(ld);
    dt_optim_free(opt);
    dt_dataset_free(ds);
    dt_ctx_free(ctx);
}

/* ------------------------------------------------------------------------ */

static void usage(void)
{
    fprintf(stderr,
            "usage: bench_train [--threads N] [--mode all|mlp|cnn|matmul|train] [--warmup W]\n"
            "                   [--mlp-steps S] [--cnn-steps S] [--max-seconds T]\n"
            "       bench_train --rss-epoch [--threads N] [--data DIR]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    opts o = {.threads = 1,
              .warmup = 20,
              .mlp_steps = 200,
              .cnn_steps = 50,
              .max_seconds = 20.0,
              .mode = "all",
              .data_dir = NULL,
              .rss_epoch = 0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--rss-epoch")) {
            o.rss_epoch = 1;
            continue;
        }
        if (!v) usage();
        if (!strcmp(a, "--threads")) o.threads = atoi(v);
        else if (!strcmp(a, "--mode")) o.mode = v;
        else if (!strcmp(a, "--warmup")) o.warmup = atoi(v);
        else if (!strcmp(a, "--mlp-steps")) o.mlp_steps = atoi(v);
        else if (!strcmp(a, "--cnn-steps")) o.cnn_steps = atoi(v);
        else if (!strcmp(a, "--max-seconds")) o.max_seconds = atof(v);
        else if (!strcmp(a, "--data")) o.data_dir = v;
        else usage();
        i++;
    }
    if (o.threads < 1 || o.warmup < 1 || o.mlp_steps < 1 || o.cnn_steps < 1) usage();

    if (o.rss_epoch) {
        rss_epoch(&o);
        return 0;
    }
    int all = !strcmp(o.mode, "all"), train = !strcmp(o.mode, "train");
    int any = 0;
    if (all || train || !strcmp(o.mode, "mlp")) bench_model(&o, MODEL_MLP), any = 1;
    if (all || train || !strcmp(o.mode, "cnn")) bench_model(&o, MODEL_CNN), any = 1;
    if (all || !strcmp(o.mode, "matmul")) bench_matmul(&o), any = 1;
    if (!any) usage();
    return 0;
}
