/*
 * tests/bench/bench_ps.c - the parameter server's rates: dense push/pull,
 * sparse rows, and training throughput with a slowed worker.  Written
 * against dtrain.h; tests/bench/ps.sh runs it next to the Gloo peer.
 *
 *   bench_ps dense  --bytes B [--iters N]      1 worker + 1 server
 *       ps_dense bytes=B pushes_per_s=X pull_us=<median round trip>
 *   bench_ps sparse [--rows R] [--k K] [--iters N]   1 worker + 1 server
 *       ps_sparse rows=R k=K pull_rows_per_s=X push_rows_per_s=Y
 *   bench_ps train --workers W [--mode bsp|asp] [--slow K] [--steps N] [--batch B]
 *       W workers + 1 server train the benchmark MLP on fixed synthetic
 *       batches; worker K (if given) sleeps after each step as long as the
 *       step's compute took (half speed).  Each worker prints
 *       ps_train worker=w mode=.. slow=K samples_per_s=X
 *
 * Ranks are forked here (dt_spawn) unless DTRAIN_RANK is set.
 */
#define _GNU_SOURCE
#include "bench_models.h"

#include <time.h>

typedef struct bopts {
    const char *what, *mode;
    long long bytes, rows;
    int iters, k, workers, slow, steps, batch;
} bopts;

static void fail(dt_ctx *ctx, const char *what)
{
    fprintf(stderr, "bench_ps: %s: %s\n", what, dt_last_error(ctx));
    exit(1);
}

static void nap(double s)
{
    struct timespec t = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&t, NULL);
}

/* --- dense: one parameter of B bytes ---------------------------------------- */

static void bench_dense(const bopts *o, dt_ctx *ctx, dt_ps *ps, dt_tensor *p)
{
    /* a gradient to push: the parameter's own gradient, set once */
    dt_tensor *x = dt_tensor_temp(ctx, DT_F32, 1, (int64_t[]){dt_tensor_numel(p)});
    if (!x || dt_tensor_fill(x, 1e-6f) != DT_OK ||
        dt_backward(ctx, dt_sum(ctx, dt_mul(ctx, p, x))) != DT_OK)
        fail(ctx, "gradient");
    int warm = o->iters / 10 + 2;
    for (int i = 0; i < warm; i++)
        if (dt_ps_push(ps) != DT_OK || dt_ps_pull(ps) != DT_OK)
            fail(ctx, "warm-up");
    double t0 = now_s();
    for (int i = 0; i < o->iters; i++)
        if (dt_ps_push(ps) != DT_OK)
            fail(ctx, "push");
    double push_s = now_s() - t0;
    double *lat = malloc(sizeof(double) * (size_t)o->iters);
    for (int i = 0; i < o->iters; i++) {
        double a = now_s();
        if (dt_ps_pull(ps) != DT_OK)
            fail(ctx, "pull");
        lat[i] = now_s() - a;
    }
    printf("ps_dense bytes=%lld pushes_per_s=%.1f pull_us=%.1f\n", o->bytes,
           o->iters / push_s, 1e6 * median(lat, o->iters));
    free(lat);
}

/* --- sparse: K distinct random rows of a table per request ---------------------- */

static void bench_sparse(const bopts *o, dt_ctx *ctx, dt_ps *ps)
{
    int64_t k = o->k, *ids = malloc(sizeof(int64_t) * (size_t)k);
    float *rows = malloc(sizeof(float) * (size_t)(k * 16));
    for (int64_t i = 0; i < k * 16; i++)
        rows[i] = 1e-4f;
    double pull_s = 0, push_s = 0;
    int warm = o->iters / 10 + 2;
    for (int it = -warm; it < o->iters; it++) {
        for (int64_t i = 0; i < k; i++)   /* distinct: a random stride walk */
            ids[i] = (int64_t)((rng_next() % (uint64_t)(o->rows / k)) * (uint64_t)k + (uint64_t)i) % o->rows;
        double a = now_s();
        if (dt_ps_sparse_pull(ps, 0, ids, k, rows) != DT_OK)
            fail(ctx, "sparse pull");
        double b = now_s();
        if (dt_ps_sparse_push(ps, 0, ids, k, rows) != DT_OK || dt_ps_push(ps) != DT_OK)
            fail(ctx, "sparse push");
        if (it >= 0) {
            pull_s += b - a;
            push_s += now_s() - b;
        }
    }
    printf("ps_sparse rows=%lld k=%d pull_rows_per_s=%.0f push_rows_per_s=%.0f\n", o->rows, o->k,
           (double)k * o->iters / pull_s, (double)k * o->iters / push_s);
    free(ids);
    free(rows);
}

/* --- train: the benchmark MLP, one worker possibly at half speed ------------------ */

static void bench_train(const bopts *o, dt_ctx *ctx, dt_ps *ps, mlp *m, int rank)
{
    int64_t xs[2] = {o->batch, 784};
    dt_tensor *x = random_input(ctx, 2, xs), *y = random_labels(ctx, o->batch, 10);
    int warm = 3;
    double t0 = 0;
    for (int s = -warm; s < o->steps; s++) {
        if (s == 0)
            t0 = now_s();
        double a = now_s();
        if (dt_backward(ctx, dt_cross_entropy(ctx, mlp_forward(ctx, m, x), y)) != DT_OK)
            fail(ctx, "backward");
        double compute = now_s() - a;
        if (rank == o->slow)
            nap(compute);
        if (dt_ps_push_pull(ps) != DT_OK)
            fail(ctx, "push_pull");
        dt_ctx_zero_grad(ctx);
        dt_ctx_step_reset(ctx);
    }
    double secs = now_s() - t0;
    printf("ps_train worker=%d mode=%s slow=%d samples_per_s=%.1f\n", rank, o->mode, o->slow,
           (double)o->batch * o->steps / secs);
    fflush(stdout);
}

static int run_rank(const bopts *o)
{
    dt_ctx *ctx = make_ctx(1, 1);
    dt_dist_env env;
    if (dt_dist_env_detect(ctx, &env) != DT_OK)
        fail(ctx, "launcher environment");
    dt_comm *comm = dt_comm_new(ctx, &env, NULL);
    if (!comm)
        fail(ctx, "dt_comm_new");
    int worker = env.rank < env.world_size - 1;
    dt_tensor *p = NULL;
    mlp m = {0};
    dt_ps_table tb = {.name = "table", .rows = o->rows, .dim = 16, .init_scale = 0.01f, .seed = 1};
    dt_ps_config pc;
    dt_ps_config_init(&pc);
    pc.servers = 1;
    pc.mode = !strcmp(o->mode, "asp") ? DT_PS_ASP : DT_PS_BSP;
    pc.optim.lr = 0.01f;
    if (!strcmp(o->what, "dense") && worker)
        p = dt_param_new(ctx, "p", 1, (int64_t[]){o->bytes / 4});
    if (!strcmp(o->what, "sparse")) {
        if (worker)
            p = dt_param_new(ctx, "bias", 1, (int64_t[]){1});
        pc.tables = &tb;
        pc.ntables = 1;
    }
    if (!strcmp(o->what, "train") && worker)
        mlp_init(ctx, &m);
    if (worker && !p && strcmp(o->what, "train"))
        fail(ctx, "parameter");
    dt_ps *ps = dt_ps_new(ctx, comm, &pc);
    if (!ps)
        fail(ctx, "dt_ps_new");
    if (dt_ps_is_server(ps)) {
        if (dt_ps_serve(ps) != DT_OK)
            fail(ctx, "serve");
    } else {
        if (!strcmp(o->what, "dense"))
            bench_dense(o, ctx, ps, p);
        else if (!strcmp(o->what, "sparse"))
            bench_sparse(o, ctx, ps);
        else
            bench_train(o, ctx, ps, &m, env.rank);
        if (dt_ps_finish(ps) != DT_OK)
            fail(ctx, "finish");
    }
    dt_ps_free(ps);
    if (dt_comm_barrier(comm) != DT_OK)   /* rank 0 hosts the store */
        fail(ctx, "barrier");
    dt_comm_free(comm);
    dt_ctx_free(ctx);
    return 0;
}

int main(int argc, char **argv)
{
    bopts o = {.what = argc > 1 ? argv[1] : "", .mode = "bsp", .bytes = 4096, .rows = 1 << 20,
               .iters = 200, .k = 4096, .workers = 2, .slow = -1, .steps = 60, .batch = 64};
    if (strcmp(o.what, "dense") && strcmp(o.what, "sparse") && strcmp(o.what, "train")) {
        fprintf(stderr, "usage: bench_ps dense|sparse|train [options] (see the source)\n");
        return 2;
    }
    for (int i = 2; i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        if (!strcmp(a, "--bytes")) o.bytes = atoll(v);
        else if (!strcmp(a, "--rows")) o.rows = atoll(v);
        else if (!strcmp(a, "--iters")) o.iters = atoi(v);
        else if (!strcmp(a, "--k")) o.k = atoi(v);
        else if (!strcmp(a, "--workers")) o.workers = atoi(v);
        else if (!strcmp(a, "--slow")) o.slow = atoi(v);
        else if (!strcmp(a, "--steps")) o.steps = atoi(v);
        else if (!strcmp(a, "--batch")) o.batch = atoi(v);
        else if (!strcmp(a, "--mode")) o.mode = v;
        else {
            fprintf(stderr, "bench_ps: unknown option %s\n", a);
            return 2;
        }
    }
    if (o.bytes < 4 || o.iters < 1 || o.k < 1 || o.k > o.rows || o.workers < 1 || o.steps < 1 ||
        o.batch < 1) {
        fprintf(stderr, "bench_ps: an option is out of range\n");
        return 2;
    }
    if (!getenv("DTRAIN_RANK")) {
        dt_ctx *sup = dt_ctx_new(NULL);
        dt_spawn_config sc;
        dt_spawn_config_init(&sc);
        sc.nranks = strcmp(o.what, "train") ? 2 : o.workers + 1;
        sc.prefix_output = 0;
        int rank = -1;
        dt_status st = sup ? dt_spawn(sup, &sc, &rank) : DT_ENOMEM;
        if (st == DT_OK && rank >= 0) {
            dt_ctx_free(sup);
            return run_rank(&o);
        }
        if (st != DT_OK)
            fprintf(stderr, "bench_ps: %s\n", sup ? dt_last_error(sup) : "out of memory");
        dt_ctx_free(sup);
        return st == DT_OK ? 0 : 1;
    }
    return run_rank(&o);
}
