/*
 * tests/bench/bench_ddp.c - data-parallel training throughput and how much
 * of the gradient communication backward hides.  Written against dtrain.h.
 *
 *   bench_ddp [--model mlp|cnn] [--batch B] [--steps N] [--warmup W]
 *             [--threads T] [--overlap -1|0|1] [--bucket BYTES]
 *             [--compress none|bf16|fp16|topk|int8] [--ranks R] [--dp K]
 *
 * Ranks: under a launcher (DTRAIN_RANK set, e.g. build/dtrun or the
 * multi-host scripts) this process is one rank; else --ranks R > 1 forks R
 * local ranks (dt_spawn, bound to CPUs); else one process trains alone
 * with no communicator (the single-process baseline).  --dp K: one process
 * with K in-process replicas (dt_dp), --threads each, batch B per replica.
 * Every rank trains the benchmark MLP or CNN (bench_models.h) on its own
 * fixed synthetic batch of B samples; rank 0 prints one line
 *   ddp model=mlp ranks=2 threads=1 batch=128 overlap=<in use> bucket=.. compress=none
 *       step_ms=<median> samples_per_s=<ranks*B/step> comm_ms=<per step>
 *       exposed_ms=<per step> exposed_frac=<exposed/comm> sent_kb=<per step>
 *       buckets=<n> shared=<1: buckets in shared memory>
 * (one line; comm_ms is the time the allreduces ran on the comm thread,
 * exposed_ms the time the step waited for them after backward).
 */
#define _GNU_SOURCE
#include "bench_models.h"

typedef struct bopts {
    const char *model, *compress;
    int batch, steps, warmup, threads, overlap, ranks, dp;
    long bucket;
} bopts;

/* dt_dp's replicas: the benchmark model in each, cross-entropy loss */
typedef struct replica_model {
    int cnn;
    mlp m1;
    cnn m2;
} replica_model;

static void *dp_build(dt_ctx *ctx, int replica, void *user)
{
    (void)replica;
    replica_model *rm = calloc(1, sizeof *rm);
    if (!rm)
        return NULL;
    rm->cnn = *(const int *)user;
    if (rm->cnn)
        cnn_init(ctx, &rm->m2);
    else
        mlp_init(ctx, &rm->m1);
    return rm;
}

static dt_tensor *dp_loss(dt_ctx *ctx, void *model, dt_tensor *x, dt_tensor *y, void *user)
{
    (void)user;
    replica_model *rm = model;
    return dt_cross_entropy(ctx, rm->cnn ? cnn_forward(ctx, &rm->m2, x) : mlp_forward(ctx, &rm->m1, x), y);
}

static void dp_free(void *model, void *user)
{
    (void)user;
    free(model);
}

/* One process, o->dp replicas: samples per second of dt_dp_step. */
static int run_dp(const bopts *o)
{
    dt_ctx *ctx = make_ctx(1, 1);
    int cnn_model = !strcmp(o->model, "cnn");
    int64_t rows = (int64_t)o->batch * o->dp;
    int64_t xs_mlp[2] = {rows, 784}, xs_cnn[4] = {rows, 1, 28, 28};
    dt_tensor *x = cnn_model ? random_input(ctx, 4, xs_cnn) : random_input(ctx, 2, xs_mlp);
    dt_tensor *y = random_labels(ctx, rows, 10);
    dt_dp_config cfg;
    dt_dp_config_init(&cfg);
    cfg.replicas = o->dp;
    cfg.replica.threads = o->threads;
    cfg.replica.seed = 1;
    cfg.optim.lr = 0.01f;
    cfg.optim.momentum = 0.9f;
    dt_dp *dp = dt_dp_new(ctx, &cfg, dp_build, dp_loss, dp_free, &cnn_model);
    if (!dp)
        die_ctx(ctx, "dt_dp_new");
    double *t = malloc(sizeof(double) * (size_t)o->steps);
    if (!t)
        return 1;
    for (int s = -o->warmup; s < o->steps; s++) {
        double t0 = now_s();
        check(ctx, dt_dp_step(dp, x, y, NULL), "dt_dp_step");
        if (s >= 0)
            t[s] = now_s() - t0;
    }
    double step = median(t, o->steps);
    printf("dp model=%s replicas=%d threads=%d batch=%d step_ms=%.3f samples_per_s=%.0f\n", o->model,
           o->dp, o->threads, o->batch, 1e3 * step, (double)rows / step);
    free(t);
    dt_dp_free(dp);
    dt_ctx_free(ctx);
    return 0;
}

static void usage(void)
{
    fprintf(stderr, "usage: bench_ddp [--model mlp|cnn] [--batch B] [--steps N] [--warmup W] "
                    "[--threads T] [--overlap -1|0|1] [--bucket BYTES] "
                    "[--compress none|bf16|fp16|topk|int8] [--ranks R]\n");
    exit(2);
}

static dt_compress compress_kind(const char *s)
{
    static const char *const names[] = {"none", "bf16", "fp16", "topk", "int8"};
    for (int k = 0; k < 5; k++)
        if (!strcmp(s, names[k]))
            return (dt_compress)k;
    usage();
    return DT_COMPRESS_NONE;
}

static int run(const bopts *o)
{
    dt_ctx *ctx = make_ctx(o->threads, 1);
    dt_dist_env env;
    check(ctx, dt_dist_env_detect(ctx, &env), "dt_dist_env_detect");
    dt_comm *comm = NULL;
    if (env.world_size > 1 && !(comm = dt_comm_new(ctx, &env, NULL)))
        die_ctx(ctx, "dt_comm_new");
    int cnn_model = !strcmp(o->model, "cnn");
    mlp m1 = {0};
    cnn m2 = {0};
    if (cnn_model)
        cnn_init(ctx, &m2);
    else
        mlp_init(ctx, &m1);
    rng_state += (uint64_t)env.rank * 7919;   /* each rank its own data */
    int64_t xs_mlp[2] = {o->batch, 784}, xs_cnn[4] = {o->batch, 1, 28, 28};
    dt_tensor *x = cnn_model ? random_input(ctx, 4, xs_cnn) : random_input(ctx, 2, xs_mlp);
    dt_tensor *y = random_labels(ctx, o->batch, 10);
    dt_optim *opt = make_sgd(ctx);
    dt_ddp *ddp = NULL;
    dt_ddp_config dc;
    dt_ddp_config_init(&dc);
    dc.overlap = o->overlap;
    dc.bucket_bytes = o->bucket > 0 ? (size_t)o->bucket : 0;
    dc.compress = compress_kind(o->compress);
    if (comm && !(ddp = dt_ddp_new(ctx, comm, opt, &dc)))
        die_ctx(ctx, "dt_ddp_new");
    double *t = malloc(sizeof(double) * (size_t)o->steps);
    if (!t)
        return 1;
    dt_ddp_stats st = {0};
    uint64_t sent0 = 0;
    for (int s = -o->warmup; s < o->steps; s++) {
        if (s == 0) {
            if (ddp)
                dt_ddp_stats_reset(ddp);
            sent0 = comm ? dt_comm_bytes_sent(comm) : 0;
        }
        double t0 = now_s();
        dt_tensor *logits = cnn_model ? cnn_forward(ctx, &m2, x) : mlp_forward(ctx, &m1, x);
        dt_tensor *loss = dt_cross_entropy(ctx, logits, y);
        if (!loss)
            die_ctx(ctx, "forward");
        check(ctx, dt_backward(ctx, loss), "dt_backward");
        check(ctx, ddp ? dt_ddp_step(ddp) : dt_optim_step(opt), "step");
        dt_optim_zero_grad(opt);
        dt_ctx_step_reset(ctx);
        if (s >= 0)
            t[s] = now_s() - t0;
    }
    if (ddp)
        dt_ddp_stats_get(ddp, &st);
    uint64_t sent = comm ? dt_comm_bytes_sent(comm) - sent0 : 0;
    int ranks = comm ? dt_comm_size(comm) : 1;
    double step = median(t, o->steps);
    if (env.rank == 0) {
        double comm_ms = 1e3 * st.comm_s / o->steps, exp_ms = 1e3 * st.exposed_s / o->steps;
        printf("ddp model=%s ranks=%d threads=%d batch=%d overlap=%d bucket=%zu compress=%s "
               "step_ms=%.3f samples_per_s=%.0f comm_ms=%.3f exposed_ms=%.3f exposed_frac=%.3f "
               "sent_kb=%.1f buckets=%d\n",
               o->model, ranks, o->threads, o->batch, ddp ? st.overlap : 0, ddp ? st.bucket_bytes : 0,
               o->compress, 1e3 * step, (double)ranks * o->batch / step, comm_ms, exp_ms,
               comm_ms > 0 ? exp_ms / comm_ms : 0, (double)sent / 1024.0 / o->steps,
               ddp ? st.buckets : 0);
        fflush(stdout);
    }
    free(t);
    dt_ddp_free(ddp);
    dt_optim_free(opt);
    dt_comm_free(comm);
    dt_ctx_free(ctx);
    return 0;
}

int main(int argc, char **argv)
{
    bopts o = {"mlp", "none", 128, 100, 10, 1, -1, 1, 0, 0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v)
            usage();
        if (!strcmp(a, "--model")) o.model = v;
        else if (!strcmp(a, "--compress")) o.compress = v;
        else if (!strcmp(a, "--batch")) o.batch = atoi(v);
        else if (!strcmp(a, "--steps")) o.steps = atoi(v);
        else if (!strcmp(a, "--warmup")) o.warmup = atoi(v);
        else if (!strcmp(a, "--threads")) o.threads = atoi(v);
        else if (!strcmp(a, "--overlap")) o.overlap = atoi(v);
        else if (!strcmp(a, "--ranks")) o.ranks = atoi(v);
        else if (!strcmp(a, "--dp")) o.dp = atoi(v);
        else if (!strcmp(a, "--bucket")) o.bucket = atol(v);
        else usage();
        i++;
    }
    if ((strcmp(o.model, "mlp") && strcmp(o.model, "cnn")) || o.batch < 1 || o.steps < 1 ||
        o.warmup < 0 || o.threads < 1 || o.ranks < 1)
        usage();
    compress_kind(o.compress);
    if (o.dp > 0)
        return run_dp(&o);
    if (o.ranks > 1 && !getenv("DTRAIN_RANK")) {
        dt_ctx *sup = make_ctx(1, 1);
        dt_spawn_config sc;
        dt_spawn_config_init(&sc);
        sc.nranks = o.ranks;
        sc.prefix_output = 0;
        int rank = -1;
        dt_status s = dt_spawn(sup, &sc, &rank);
        if (s == DT_OK && rank >= 0) {
            dt_ctx_free(sup);
            return run(&o);
        }
        if (s != DT_OK)
            fprintf(stderr, "bench_ddp: %s\n", dt_last_error(sup));
        dt_ctx_free(sup);
        return s == DT_OK ? 0 : 1;
    }
    return run(&o);
}
