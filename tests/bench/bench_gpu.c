/*
 * tests/bench/bench_gpu.c - training-step time of the benchmark MLP and CNN
 * (bench_models.h) on dtrain's CUDA backend.  bench_gpu_torch.py runs the
 * same models, optimizer, data and timing in PyTorch eager; gpu.sh runs both
 * and prints the ratios.  Written against dtrain.h only.
 *
 *   bench_gpu [--backend cuda] [--device D] [--configs mlp:128,mlp:1024,cnn:128]
 *             [--precs fp32,bf16] [--feeds device,host] [--warmup W]
 *             [--sync-steps S] [--rounds R] [--round-ms T] [--max-seconds T]
 *             [--no-fork]
 *
 * A configuration is model x batch x precision x feed:
 *   precision  fp32: plain f32 (no TF32); tf32, bf16: dt_ctx_set_autocast with
 *              DT_PREC_TF32 / DT_PREC_BF16 (matmul, linear, conv2d inputs
 *              rounded, f32 accumulation; parameters and SGD stay f32)
 *   feed       device: x and y filled once before timing, so no input copy
 *              is timed; host: every step first copies the next of 4 host
 *              batches in with dt_tensor_set (the copy cost)
 * A step is zero_grad, forward, cross entropy, backward, SGD (momentum 0.9,
 * lr 0.01), dt_ctx_step_reset.
 *
 * Output: one line per configuration, the identifying fields first, then
 * "key value" pairs:
 *   dtrain mlp b128 fp32 device step_ms 0.4123 sync_ms 0.4501 min_ms 0.4011 per 60 rounds 20 loss 2.2871
 *   step_ms  median over rounds of (round time / per): a round queues `per`
 *            steps back to back and reads the loss (dt_tensor_item, which
 *            waits for the device) only after the last one: steady-state
 *            throughput, the device never idles for the host
 *   sync_ms  median of sync-steps single steps, each ending with the loss
 *            read: what a loop that prints every step's loss pays
 *   min_ms   the fastest round, per step
 * A configuration that fails prints "dtrain mlp b128 fp32 device error WHY"
 * (each runs in a child process, so one failure, crash or hang leaves the
 * others' results).  Other lines start with '#'.  Exit status 0 when every
 * configuration gave a result.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* fork, alarm, clock_gettime */
#endif

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "dtrain.h"

#include "bench_models.h"

enum { MODEL_MLP, MODEL_CNN };
enum { FEED_DEVICE, FEED_HOST };
enum { NHOST = 4 };           /* distinct host batches cycled by the host feed */
enum { MAX_CONFIGS = 64 };   /* model x batch x precision x feed combinations */
enum { MAX_ROUNDS = 1000 };

typedef struct opts {
    const char *backend;
    int device;
    const char *configs;      /* "mlp:128,mlp:1024,cnn:128" */
    const char *precs;        /* "fp32,bf16" */
    const char *feeds;        /* "device,host" */
    int warmup;
    int sync_steps;
    int rounds;
    double round_ms;          /* target length of one timed round */
    double max_seconds;       /* per configuration, the timed rounds */
    int fork;
} opts;

typedef struct config {
    int model;                /* MODEL_* */
    int64_t batch;
    const char *prec;         /* "fp32", "tf32", "bf16" */
    int feed;                 /* FEED_* */
} config;

/* Everything one configuration's steps touch. */
typedef struct bench {
    dt_ctx *ctx;
    int model;
    mlp mm;
    cnn cm;
    dt_tensor *x, *y;         /* persistent inputs on the device */
    dt_optim *opt;
    int feed;
    float *hx[NHOST];         /* host feed: batches in host memory */
    int32_t *hy[NHOST];
    int64_t nx, ny;
    int64_t next;             /* host feed: the batch the next step copies in */
} bench;

static const char *model_name(int m) { return m == MODEL_MLP ? "mlp" : "cnn"; }
static const char *feed_name(int f) { return f == FEED_DEVICE ? "device" : "host"; }

static int prec_parse(const char *s, dt_precision *out)
{
    if (!strcmp(s, "fp32")) *out = DT_PREC_F32;
    else if (!strcmp(s, "tf32")) *out = DT_PREC_TF32;
    else if (!strcmp(s, "bf16")) *out = DT_PREC_BF16;
    else return -1;
    return 0;
}

/* The id fields every output line of a configuration starts with. */
static void print_id(const config *c)
{
    printf("dtrain %s b%lld %s %s", model_name(c->model), (long long)c->batch, c->prec,
           feed_name(c->feed));
}

/* ------------------------------------------------------------------------ */
/* one configuration                                                         */
/* ------------------------------------------------------------------------ */

static dt_ctx *make_backend_ctx(const opts *o, uint64_t seed)
{
    dt_ctx_config cfg;
    dt_ctx_config_init(&cfg);
    cfg.backend = o->backend;
    cfg.device = o->device;
    cfg.threads = 1;
    cfg.seed = seed;
    dt_ctx *ctx = dt_ctx_new(&cfg);
    if (!ctx) {
        fprintf(stderr, "bench_gpu: dt_ctx_new: out of memory\n");
        exit(1);
    }
    if (dt_ctx_status(ctx) != DT_OK) die_ctx(ctx, "dt_ctx_new");
    return ctx;
}

static void bench_init(bench *b, const opts *o, const config *c)
{
    memset(b, 0, sizeof *b);
    b->ctx = make_backend_ctx(o, 1234);
    b->model = c->model;
    b->feed = c->feed;
    dt_precision p = DT_PREC_F32;
    if (prec_parse(c->prec, &p) != 0) {
        fprintf(stderr, "bench_gpu: unknown precision '%s'\n", c->prec);
        exit(1);
    }
    check(b->ctx, dt_ctx_set_autocast(b->ctx, p), "dt_ctx_set_autocast");

    int64_t xs[4] = {c->batch, 1, 28, 28};
    if (c->model == MODEL_MLP) {
        mlp_init(b->ctx, &b->mm);
        xs[1] = 784;
        b->x = random_input(b->ctx, 2, xs);
    } else {
        cnn_init(b->ctx, &b->cm);
        b->x = random_input(b->ctx, 4, xs);
    }
    b->y = random_labels(b->ctx, c->batch, 10);
    b->nx = dt_tensor_numel(b->x);
    b->ny = c->batch;
    b->opt = make_sgd(b->ctx);
    if (b->feed == FEED_HOST) {
        for (int i = 0; i < NHOST; i++) {
            b->hx[i] = malloc((size_t)b->nx * sizeof(float));
            b->hy[i] = malloc((size_t)b->ny * sizeof(int32_t));
            if (!b->hx[i] || !b->hy[i]) {
                fprintf(stderr, "bench_gpu: out of host memory\n");
                exit(1);
            }
            for (int64_t j = 0; j < b->nx; j++) b->hx[i][j] = rng_normal();
            for (int64_t j = 0; j < b->ny; j++) b->hy[i][j] = (int32_t)(rng_next() % 10);
        }
    }
}

static void bench_free(bench *b)
{
    for (int i = 0; i < NHOST; i++) {
        free(b->hx[i]);
        free(b->hy[i]);
    }
    dt_optim_free(b->opt);
    dt_tensor_free(b->x);
    dt_tensor_free(b->y);
    dt_ctx_free(b->ctx);
}

/* One training step.  read_loss: read the loss back (waits for the device)
 * and return it; otherwise the step is only queued and 0 is returned. */
static float train_step(bench *b, int read_loss)
{
    dt_ctx *ctx = b->ctx;
    if (b->feed == FEED_HOST) {
        int k = (int)(b->next++ % NHOST);
        check(ctx, dt_tensor_set(b->x, b->hx[k], b->nx), "dt_tensor_set(x)");
        check(ctx, dt_tensor_set(b->y, b->hy[k], b->ny), "dt_tensor_set(y)");
    }
    dt_optim_zero_grad(b->opt);
    dt_tensor *logits = b->model == MODEL_MLP ? mlp_forward(ctx, &b->mm, b->x)
                                              : cnn_forward(ctx, &b->cm, b->x);
    dt_tensor *loss = dt_cross_entropy(ctx, logits, b->y);
    if (!loss) die_ctx(ctx, "forward");
    check(ctx, dt_backward(ctx, loss), "dt_backward");
    check(ctx, dt_optim_step(b->opt), "dt_optim_step");
    float l = read_loss ? dt_tensor_item(loss) : 0.0f;
    dt_ctx_step_reset(ctx);
    return l;
}

static void run_config(const opts *o, const config *c)
{
    bench b;
    bench_init(&b, o, c);

    float first = 0, last = 0;
    for (int i = 0; i < o->warmup; i++) {
        last = train_step(&b, 1);
        if (i == 0) first = last;
        if (!isfinite(last)) {
            fprintf(stderr, "bench_gpu: loss is %f at warm-up step %d (%s)\n", last, i,
                    dt_last_error(b.ctx));
            exit(1);
        }
    }
    dt_mem_stats ms0;
    dt_mem_stats_get(b.ctx, &ms0);

    /* single steps, each waited for */
    double *ts = malloc((size_t)o->sync_steps * sizeof *ts);
    double *tr = malloc(MAX_ROUNDS * sizeof *tr);
    if (!ts || !tr) exit(1);
    for (int i = 0; i < o->sync_steps; i++) {
        double t0 = now_s();
        last = train_step(&b, 1);
        ts[i] = now_s() - t0;
    }
    double sync_s = median(ts, o->sync_steps);

    /* rounds of `per` queued steps, about round_ms each */
    int per = (int)ceil(o->round_ms * 1e-3 / (sync_s > 1e-6 ? sync_s : 1e-6));
    if (per < 5) per = 5;
    if (per > 2000) per = 2000;
    int rounds = 0;
    double t_start = now_s();
    while (rounds < o->rounds && rounds < MAX_ROUNDS) {
        double t0 = now_s();
        for (int i = 0; i < per - 1; i++) train_step(&b, 0);
        last = train_step(&b, 1);
        tr[rounds++] = (now_s() - t0) / per;
        if (!isfinite(last)) {
            fprintf(stderr, "bench_gpu: loss is %f after round %d (%s)\n", last, rounds,
                    dt_last_error(b.ctx));
            exit(1);
        }
        if (rounds >= 5 && now_s() - t_start > o->max_seconds) break;
    }
    double step_s = median(tr, rounds); /* sorts tr: tr[0] is the fastest */

    dt_mem_stats ms1;
    dt_mem_stats_get(b.ctx, &ms1);
    printf("# dtrain %s b%lld %s %s: backend %s; loss %.4f -> %.4f; arena cap %.1f MB peak "
           "%.1f MB, persistent %.1f MB, arena grows during timing %llu\n",
           model_name(c->model), (long long)c->batch, c->prec, feed_name(c->feed),
           dt_backend_name(b.ctx), first, last,
           ms1.arena_capacity / 1e6, ms1.arena_peak / 1e6, ms1.persistent_bytes / 1e6,
           (unsigned long long)(ms1.arena_grows - ms0.arena_grows));
    print_id(c);
    printf(" step_ms %.4f sync_ms %.4f min_ms %.4f per %d rounds %d loss %.4f\n", step_s * 1e3,
           sync_s * 1e3, tr[0] * 1e3, per, rounds, last);
    fflush(stdout);
    free(ts);
    free(tr);
    bench_free(&b);
}

/* Run c in a child process (unless --no-fork): a failure, crash or hang of
 * one configuration leaves the others' results.  The parent never touches
 * the device, so forking is safe.  Returns 0 when the child gave a result. */
static int run_isolated(const opts *o, const config *c)
{
    if (!o->fork) {
        run_config(o, c);
        return 0;
    }
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) {
        perror("bench_gpu: fork");
        return -1;
    }
    if (pid == 0) {
        /* a hung device or a deadlock ends here instead of stalling gpu.sh */
        alarm((unsigned)(o->max_seconds * 4 + 120));
        run_config(o, c);
        fflush(stdout);
        exit(0);
    }
    int st = 0;
    while (waitpid(pid, &st, 0) < 0) {
        if (errno == EINTR) continue;
        perror("bench_gpu: waitpid");
        return -1;
    }
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0) return 0;
    print_id(c);
    if (WIFSIGNALED(st))
        printf(" error signal_%d%s\n", WTERMSIG(st), WTERMSIG(st) == SIGALRM ? "_timeout" : "");
    else
        printf(" error exit_%d\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    fflush(stdout);
    return -1;
}

/* ------------------------------------------------------------------------ */
/* command line                                                              */
/* ------------------------------------------------------------------------ */

static _Noreturn void usage(void)
{
    fprintf(stderr,
            "usage: bench_gpu [--backend cuda] [--device D] [--configs mlp:128,mlp:1024,cnn:128]\n"
            "                 [--precs fp32,bf16] [--feeds device,host] [--warmup W]\n"
            "                 [--sync-steps S] [--rounds R] [--round-ms T] [--max-seconds T]\n"
            "                 [--no-fork]\n"
            "  precisions: fp32, tf32, bf16; feeds: device, host\n");
    exit(2);
}

/* Split a comma-separated list into out[0..max) (pointers into a copy). */
static int split_list(const char *s, char **out, int max)
{
    char *copy = strdup(s);
    if (!copy) exit(1);
    int n = 0;
    for (char *save = NULL, *t = strtok_r(copy, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (n == max) usage();
        out[n++] = t;
    }
    return n; /* copy is kept: out points into it until exit */
}

int main(int argc, char **argv)
{
    opts o = {.backend = "cuda",
              .device = 0,
              .configs = "mlp:128,mlp:1024,cnn:128",
              .precs = "fp32,bf16",
              .feeds = "device,host",
              .warmup = 20,
              .sync_steps = 30,
              .rounds = 20,
              .round_ms = 25.0,
              .max_seconds = 3.0,
              .fork = 1};
    for (int i = 1; i < argc; i += 2) {
        const char *a = argv[i];
        if (!strcmp(a, "--no-fork")) {
            o.fork = 0;
            i--; /* a flag without a value */
            continue;
        }
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) usage();
        if (!strcmp(a, "--backend")) o.backend = v;
        else if (!strcmp(a, "--device")) o.device = atoi(v);
        else if (!strcmp(a, "--configs")) o.configs = v;
        else if (!strcmp(a, "--precs")) o.precs = v;
        else if (!strcmp(a, "--feeds")) o.feeds = v;
        else if (!strcmp(a, "--warmup")) o.warmup = atoi(v);
        else if (!strcmp(a, "--sync-steps")) o.sync_steps = atoi(v);
        else if (!strcmp(a, "--rounds")) o.rounds = atoi(v);
        else if (!strcmp(a, "--round-ms")) o.round_ms = atof(v);
        else if (!strcmp(a, "--max-seconds")) o.max_seconds = atof(v);
        else usage();
    }
    if (o.warmup < 1 || o.sync_steps < 1 || o.rounds < 1 || o.round_ms <= 0 || o.max_seconds <= 0)
        usage();

    char *ms[MAX_CONFIGS], *ps[8], *fs[4];
    int nm = split_list(o.configs, ms, MAX_CONFIGS);
    int np = split_list(o.precs, ps, 8);
    int nf = split_list(o.feeds, fs, 4);
    config cs[MAX_CONFIGS];
    int nc = 0;
    for (int i = 0; i < nm; i++) {
        char *colon = strchr(ms[i], ':');
        if (!colon) usage();
        *colon = '\0';
        int model = !strcmp(ms[i], "mlp") ? MODEL_MLP : !strcmp(ms[i], "cnn") ? MODEL_CNN : -1;
        long long batch = atoll(colon + 1);
        if (model < 0 || batch < 1) usage();
        for (int f = 0; f < nf; f++)
            for (int p = 0; p < np; p++) {
                dt_precision dummy;
                if (prec_parse(ps[p], &dummy) != 0) usage();
                int feed = !strcmp(fs[f], "device") ? FEED_DEVICE
                           : !strcmp(fs[f], "host") ? FEED_HOST : -1;
                if (feed < 0 || nc == MAX_CONFIGS) usage();
                cs[nc++] = (config){model, (int64_t)batch, ps[p], feed};
            }
    }

    printf("# bench_gpu: dtrain %s, backend %s, device %d, warm-up %d, %d synced steps, "
           "rounds of ~%.0f ms (at most %d, %.1f s)\n",
           DTRAIN_VERSION_STRING, o.backend, o.device, o.warmup, o.sync_steps, o.round_ms,
           o.rounds, o.max_seconds);
    int failed = 0;
    for (int i = 0; i < nc; i++)
        if (run_isolated(&o, &cs[i]) != 0) failed++;
    if (failed) printf("# %d of %d configurations failed\n", failed, nc);
    return failed ? 1 : 0;
}
