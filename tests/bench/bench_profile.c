/*
 * tests/bench/bench_profile.c - what dtrain's profiler (dtrain.h section 13)
 * costs a training step.  Written against dtrain.h only.
 *
 *   bench_profile [--model mlp|cnn] [--pairs P] [--block-steps S]
 *                 [--warmup W] [--threads N] [--data DIR]
 *
 * One process, one context, the benchmark models of bench_models.h (MLP
 * 784-512-512-10 at batch 128, the 2-conv CNN at batch 64) trained on
 * Fashion-MNIST through dtrain's loader (prefetching, so the profiler's
 * loader hooks run too).  The steps are timed in blocks of S steps, the
 * profiler off in one block of a pair and on (dt_profile_start ...
 * dt_profile_stop) in the other, the order alternating from pair to pair
 * so a drift of the machine's speed falls on both sides alike.  Starting
 * and finishing the profiler happen outside the timed steps: the number is
 * the steady cost per step.  A step is everything from dt_loader_next to
 * dt_ctx_step_reset.
 *
 * One result line, key=value separated by spaces:
 *   profile impl=dtrain model=mlp off_ms=.. on_ms=.. ratio=.. pooled_ratio=..
 *           steps=.. prof_steps=.. events=.. dropped=..
 * (off_ms, on_ms: medians of all per-step times of each side; ratio: the
 * median over the pairs of (median step on) / (median step off) within the
 * pair, which cancels the machine's slow drifts; pooled_ratio = on_ms /
 * off_ms; steps: steps timed per side; prof_steps: steps
 * the profiler counted over the "on" blocks, which must equal the steps
 * timed with it on).  Other lines start with '#'.
 */
#define _GNU_SOURCE

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dtrain.h"

#include "bench_models.h"
#include "../../examples/fmnist.h"

enum { MODEL_MLP, MODEL_CNN };

typedef struct bench {
    dt_ctx *ctx;
    dt_loader *ld;
    dt_optim *opt;
    int model;
    mlp mm;
    cnn cm;
    int64_t epoch;
    float last;
} bench;

static void step(bench *b)
{
    dt_tensor *x, *y;
    dt_status s = dt_loader_next(b->ld, &x, &y);
    if (s == DT_EOF) { /* next epoch */
        check(b->ctx, dt_loader_start_epoch(b->ld, ++b->epoch), "dt_loader_start_epoch");
        s = dt_loader_next(b->ld, &x, &y);
    }
    check(b->ctx, s, "dt_loader_next");
    dt_optim_zero_grad(b->opt);
    dt_tensor *logits = b->model == MODEL_MLP ? mlp_forward(b->ctx, &b->mm, dt_flatten(b->ctx, x, 1))
                                              : cnn_forward(b->ctx, &b->cm, x);
    dt_tensor *loss = dt_cross_entropy(b->ctx, logits, y);
    if (!loss) die_ctx(b->ctx, "forward");
    check(b->ctx, dt_backward(b->ctx, loss), "dt_backward");
    check(b->ctx, dt_optim_step(b->opt), "dt_optim_step");
    b->last = dt_tensor_item(loss);
    dt_ctx_step_reset(b->ctx);
}

/* S timed steps into t[0..S); with the profiler on when prof, adding the
 * steps it counted to *prof_steps and its events to *events, *dropped. */
static void block(bench *b, int S, int prof, double *t, int64_t *prof_steps, int64_t *events,
                  int64_t *dropped)
{
    if (prof) check(b->ctx, dt_profile_start(b->ctx, NULL), "dt_profile_start");
    for (int i = 0; i < S; i++) {
        double t0 = now_s();
        step(b);
        t[i] = now_s() - t0;
    }
    if (prof) {
        dt_profile_stats ps;
        check(b->ctx, dt_profile_stats_get(b->ctx, &ps), "dt_profile_stats_get");
        if (prof_steps) *prof_steps += ps.steps;
        if (events) *events += ps.events;
        if (dropped) *dropped += ps.dropped;
        check(b->ctx, dt_profile_stop(b->ctx, NULL, NULL), "dt_profile_stop");
        if (dt_profile_active(b->ctx)) {
            fprintf(stderr, "bench_profile: still profiling after dt_profile_stop\n");
            exit(1);
        }
    }
}

static void usage(void)
{
    fprintf(stderr, "usage: bench_profile [--model mlp|cnn] [--pairs P] [--block-steps S]\n"
                    "                     [--warmup W] [--threads N] [--data DIR]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    const char *model = "mlp", *data = NULL;
    int pairs = 0, S = 0, warmup = -1, threads = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) usage();
        if (!strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "--pairs")) pairs = atoi(v);
        else if (!strcmp(a, "--block-steps")) S = atoi(v);
        else if (!strcmp(a, "--warmup")) warmup = atoi(v);
        else if (!strcmp(a, "--threads")) threads = atoi(v);
        else if (!strcmp(a, "--data")) data = v;
        else usage();
        i++;
    }
    bench b = {0};
    if (!strcmp(model, "mlp")) b.model = MODEL_MLP;
    else if (!strcmp(model, "cnn")) b.model = MODEL_CNN;
    else usage();
    /* ~0.1-0.2 s blocks, ~5 s in all */
    if (pairs <= 0) pairs = b.model == MODEL_MLP ? 20 : 12;
    if (S <= 0) S = b.model == MODEL_MLP ? 20 : 4;
    if (warmup < 0) warmup = b.model == MODEL_MLP ? 30 : 6;
    if (threads < 1) usage();
    if (getenv("DTRAIN_PROFILE")) {
        fprintf(stderr, "bench_profile: unset DTRAIN_PROFILE (the 'off' blocks must be off)\n");
        return 2;
    }

    b.ctx = make_ctx(threads, 1234);
    dt_dataset *ds = fmnist_load(b.ctx, data, 0);
    if (!ds) die_ctx(b.ctx, "loading Fashion-MNIST");
    dt_loader_config lc;
    dt_loader_config_init(&lc);
    lc.batch = b.model == MODEL_MLP ? 128 : 64;
    lc.shuffle = 1;
    lc.drop_last = 1;
    lc.seed = 1;
    lc.mean = 0.2860f;
    lc.std = 0.3530f;
    lc.prefetch = 1;
    b.ld = dt_loader_new(b.ctx, ds, &lc);
    if (!b.ld) die_ctx(b.ctx, "dt_loader_new");
    if (b.model == MODEL_MLP) mlp_init(b.ctx, &b.mm);
    else cnn_init(b.ctx, &b.cm);
    b.opt = make_sgd(b.ctx);
    check(b.ctx, dt_loader_start_epoch(b.ld, 0), "dt_loader_start_epoch");

    double *scratch = malloc((size_t)(S > warmup ? S : warmup) * sizeof *scratch);
    double *off = malloc((size_t)pairs * (size_t)S * sizeof *off);
    double *on = malloc((size_t)pairs * (size_t)S * sizeof *on);
    if (!scratch || !off || !on) return 1;
    /* warm-up: the arena, BLAS, the loader, and one on and one off block
     * (the profiler's first start allocates and touches its event buffer) */
    block(&b, warmup, 0, scratch, NULL, NULL, NULL);
    block(&b, S, 1, scratch, NULL, NULL, NULL);
    block(&b, S, 0, scratch, NULL, NULL, NULL);
    float first = b.last;

    int64_t prof_steps = 0, events = 0, dropped = 0;
    double *pr = malloc((size_t)pairs * sizeof *pr), *tmp = malloc((size_t)S * sizeof *tmp);
    if (!pr || !tmp) return 1;
    for (int p = 0; p < pairs; p++) {
        int on_first = p & 1;
        block(&b, S, on_first, on_first ? on + p * S : off + p * S, &prof_steps, &events, &dropped);
        block(&b, S, !on_first, on_first ? off + p * S : on + p * S, &prof_steps, &events,
              &dropped);
        /* this pair's ratio of block medians (median() sorts: copy first) */
        memcpy(tmp, on + p * S, (size_t)S * sizeof *tmp);
        double mon = median(tmp, S);
        memcpy(tmp, off + p * S, (size_t)S * sizeof *tmp);
        pr[p] = mon / median(tmp, S);
    }
    if (!isfinite(b.last)) {
        fprintf(stderr, "bench_profile: loss is %f\n", b.last);
        return 1;
    }
    int n = pairs * S;
    double m_off = median(off, n), m_on = median(on, n), ratio = median(pr, pairs);
    printf("# %s: loss %.4f -> %.4f over %d timed steps (%lld epochs started)\n", model, first,
           b.last, 2 * n, (long long)b.epoch + 1);
    printf("profile impl=dtrain model=%s off_ms=%.4f on_ms=%.4f ratio=%.4f pooled_ratio=%.4f "
           "steps=%d prof_steps=%lld events=%lld dropped=%lld\n",
           model, m_off * 1e3, m_on * 1e3, ratio, m_on / m_off, n, (long long)prof_steps,
           (long long)events, (long long)dropped);
    fflush(stdout);
    free(pr);
    free(tmp);
    free(scratch);
    free(off);
    free(on);
    dt_optim_free(b.opt);
    dt_loader_free(b.ld);
    dt_dataset_free(ds);
    dt_ctx_free(b.ctx);
    return 0;
}
