/*
 * tests/bench/bench_pipeline.c - pipeline parallelism: throughput of a
 * deep MLP split into stages against the unsplit model on one rank, and
 * the measured bubble against the ideal (p-1)/(m+p-1).  Written against
 * dtrain.h.
 *
 *   bench_pipeline [--ranks P] [--micro M] [--schedule 1f1b|gpipe]
 *                  [--layers L] [--width W] [--batch B] [--steps N] [--warmup K]
 *
 * --ranks 1 trains the whole model alone (no communicator); --ranks P > 1
 * forks P local ranks (dt_spawn, one thread each), splits the layers by
 * measured time (dt_profile_layer_times averaged over the ranks, then
 * dt_pipe_partition) and trains with dt_pipe_step.  Every step is a fixed
 * synthetic batch of B rows.  Rank 0 prints one line:
 *   pipe ranks=P micro=M schedule=S layers=L width=W batch=B split=a-b|c-d
 *        step_ms=<median> samples_per_s=<B/median> bubble=<mean over stages>
 *        bubble_max=<worst stage> ideal=<(P-1)/(M+P-1)> held0=<micro-batches stage 0
 *        held at once> act_kb0=<their memory> compute_ms=<each stage's forward and
 *        backward per step, a|b>
 */
#define _GNU_SOURCE
#include "bench_models.h"

typedef struct opts {
    int ranks, micro, layers, width, batch, steps, warmup;
    const char *schedule;
} opts;

typedef struct layer {
    dt_tensor *w, *b;
    int last;
} layer;

typedef struct stage {
    layer *l;
    int lo, hi, nl;
} stage;

static void usage(void)
{
    fprintf(stderr, "usage: bench_pipeline [--ranks P] [--micro M] [--schedule 1f1b|gpipe] "
                    "[--layers L] [--width W] [--batch B] [--steps N] [--warmup K]\n");
    exit(2);
}

static dt_tensor *layer_fn(dt_ctx *ctx, dt_tensor *x, void *user)
{
    layer *l = user;
    dt_tensor *y = dt_linear(ctx, x, l->w, l->b);
    return l->last ? y : dt_relu(ctx, y);
}

static dt_tensor *stage_fn(dt_ctx *ctx, dt_tensor *x, dt_tensor *y, void *user)
{
    stage *s = user;
    for (int i = s->lo; i < s->hi && x; i++)
        x = layer_fn(ctx, x, &s->l[i]);
    return s->hi == s->nl ? dt_cross_entropy(ctx, x, y) : x;
}

/* Every layer (the partition needs all their times); a stage trains only
 * its own, whose parameters are the optimizer's. */
static layer *make_layers(dt_ctx *ctx, const opts *o)
{
    layer *l = calloc((size_t)o->layers, sizeof *l);
    for (int i = 0; i < o->layers; i++) {
        char name[16];
        int64_t out = i == o->layers - 1 ? 10 : o->width;
        snprintf(name, sizeof name, "w%d", i);
        l[i].w = param(ctx, name, 2, (const int64_t[]){out, o->width}, o->width, 0);
        snprintf(name, sizeof name, "b%d", i);
        l[i].b = param(ctx, name, 1, (const int64_t[]){out}, o->width, 1);
        l[i].last = i == o->layers - 1;
    }
    return l;
}

static int run(const opts *o)
{
    dt_ctx *ctx = make_ctx(1, 7);
    dt_dist_env env;
    check(ctx, dt_dist_env_detect(ctx, &env), "dt_dist_env_detect");
    dt_comm *comm = NULL;
    if (env.world_size > 1 && !(comm = dt_comm_new(ctx, &env, NULL)))
        die_ctx(ctx, "dt_comm_new");
    int P = comm ? dt_comm_size(comm) : 1, rank = comm ? dt_comm_rank(comm) : 0;
    layer *l = make_layers(ctx, o);
    dt_tensor *x = random_input(ctx, 2, (const int64_t[]){o->batch, o->width});
    dt_tensor *y = random_labels(ctx, o->batch, 10);
    int first[65] = {0, o->layers};
    if (P > 1) {   /* split by measured time, the same on every rank */
        dt_layer_fn fns[64];
        void *users[64];
        double ms[64];
        for (int i = 0; i < o->layers; i++) {
            fns[i] = layer_fn;
            users[i] = &l[i];
        }
        dt_tensor *sample = random_input(ctx, 2, (const int64_t[]){o->batch / o->micro, o->width});
        check(ctx, dt_profile_layer_times(ctx, comm, fns, users, o->layers, sample, 5, ms), "layer_times");
        check(ctx, dt_pipe_partition(ms, o->layers, P, first) == DT_OK ? DT_OK : DT_EINVAL,
              "pipe_partition");
        dt_tensor_free(sample);
    }
    stage st = {l, first[rank], first[rank + 1], o->layers};
    dt_tensor *ps[128];
    int np = 0;
    for (int i = st.lo; i < st.hi; i++) {
        ps[np++] = l[i].w;
        ps[np++] = l[i].b;
    }
    dt_optim_config oc;
    dt_optim_config_init(&oc, DT_SGD);
    oc.lr = 0.01f;
    dt_optim *opt = dt_optim_new(ctx, &oc, ps, np);
    if (!opt)
        die_ctx(ctx, "dt_optim_new");
    dt_pipe *p = NULL;
    if (P > 1) {
        dt_pipe_config pc;
        dt_pipe_config_init(&pc);
        pc.micro_batches = o->micro;
        pc.schedule = strcmp(o->schedule, "gpipe") ? DT_PIPE_1F1B : DT_PIPE_GPIPE;
        if (!(p = dt_pipe_new(ctx, comm, &pc, stage_fn, &st)))
            die_ctx(ctx, "dt_pipe_new");
    }
    double *t = calloc((size_t)o->steps, sizeof *t);
    for (int k = 0; k < o->warmup + o->steps; k++) {
        if (k == o->warmup && p) {
            check(ctx, dt_comm_barrier(comm), "barrier");
            dt_pipe_stats_reset(p);
        }
        double t0 = now_s();
        if (p) {
            check(ctx, dt_pipe_step(p, x, y, NULL), "dt_pipe_step");
        } else {
            dt_tensor *loss = stage_fn(ctx, x, y, &st);
            check(ctx, loss ? dt_backward(ctx, loss) : dt_last_status(ctx), "backward");
        }
        check(ctx, dt_optim_step(opt), "optim_step");
        dt_ctx_zero_grad(ctx);
        dt_ctx_step_reset(ctx);
        if (k >= o->warmup)
            t[k - o->warmup] = now_s() - t0;
    }
    double step = median(t, o->steps);
    /* every stage's bubble, to rank 0 */
    float mine[5] = {0, 0, 0, 0, 0}, all[5 * 64];
    if (p) {
        dt_pipe_stats s;
        dt_pipe_stats_get(p, &s);
        mine[0] = (float)s.bubble;
        mine[1] = (float)s.bubble_ideal;
        mine[2] = (float)s.in_flight_peak;
        mine[3] = (float)s.act_bytes_peak / 1024.0f;
        mine[4] = (float)(s.compute_s / (double)(s.steps ? s.steps : 1));
        check(ctx, dt_comm_allgather(comm, mine, 5, all), "allgather");
        /* the pipeline's step time is its slowest stage's */
        float st_ms = (float)step;
        check(ctx, dt_comm_allreduce(comm, &st_ms, 1, DT_REDUCE_MAX), "allreduce");
        step = st_ms;
    } else {
        memcpy(all, mine, sizeof mine);
    }
    if (rank == 0) {
        double bmean = 0, bmax = 0;
        for (int r = 0; r < P; r++) {
            bmean += all[5 * r] / P;
            bmax = all[5 * r] > bmax ? all[5 * r] : bmax;
        }
        char split[256] = "", busy[256] = "";
        for (int r = 0; r < P; r++)
            snprintf(busy + strlen(busy), sizeof busy - strlen(busy), "%s%.2f", r ? "|" : "",
                     all[5 * r + 4] * 1e3);
        for (int r = 0; r < P; r++)
            snprintf(split + strlen(split), sizeof split - strlen(split), "%s%d-%d", r ? "|" : "",
                     first[r], first[r + 1] - 1);
        printf("pipe ranks=%d micro=%d schedule=%s layers=%d width=%d batch=%d split=%s "
               "step_ms=%.3f samples_per_s=%.1f bubble=%.4f bubble_max=%.4f ideal=%.4f held0=%d "
               "act_kb0=%.0f compute_ms=%s\n", P, P > 1 ? o->micro : 1, P > 1 ? o->schedule : "none", o->layers,
               o->width, o->batch, split, step * 1e3, o->batch / step, bmean, bmax,
               P > 1 ? all[1] : 0.0, (int)all[2], all[3], P > 1 ? busy : "-");
        fflush(stdout);
    }
    free(t);
    dt_pipe_free(p);
    dt_optim_free(opt);
    free(l);
    dt_comm_free(comm);
    dt_ctx_free(ctx);
    return 0;
}

int main(int argc, char **argv)
{
    opts o = {1, 4, 9, 512, 512, 20, 3, "1f1b"};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v)
            usage();
        if (!strcmp(a, "--ranks")) o.ranks = atoi(v);
        else if (!strcmp(a, "--micro")) o.micro = atoi(v);
        else if (!strcmp(a, "--schedule")) o.schedule = v;
        else if (!strcmp(a, "--layers")) o.layers = atoi(v);
        else if (!strcmp(a, "--width")) o.width = atoi(v);
        else if (!strcmp(a, "--batch")) o.batch = atoi(v);
        else if (!strcmp(a, "--steps")) o.steps = atoi(v);
        else if (!strcmp(a, "--warmup")) o.warmup = atoi(v);
        else usage();
        i++;
    }
    if (o.ranks < 1 || o.micro < 1 || o.layers < o.ranks || o.layers > 64 || o.width < 1 ||
        o.batch < o.micro || o.steps < 1 || o.warmup < 0)
        usage();
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
            fprintf(stderr, "bench_pipeline: %s\n", dt_last_error(sup));
        dt_ctx_free(sup);
        return s == DT_OK ? 0 : 1;
    }
    return run(&o);
}
