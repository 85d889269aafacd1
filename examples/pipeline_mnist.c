/*
 * examples/pipeline_mnist.c - the 784-512-512-10 MLP on Fashion-MNIST as a
 * pipeline of stages, optionally replicated data-parallel (a hybrid).
 *
 *   build/pipeline_mnist --stages 2                  (2 local ranks, 1F1B)
 *   build/pipeline_mnist --stages 3 --micro 8 --schedule gpipe
 *   build/pipeline_mnist --stages 2 --replicas 2     (4 ranks: 2 stages x 2 replicas)
 *   build/dtrun -n 4 build/pipeline_mnist --stages 2 --replicas 2   (any launcher)
 *   build/pipeline_mnist --stages 1                  (one process: the unsplit model)
 *
 * The layers are split between the stages by measured time (dt_profile_layer_times,
 * dt_pipe_partition), not by count.  Every rank starts from the same seeded
 * weights and keeps only its stage's layers.  Job rank r is stage r % S of
 * replica r / S.  Each replica trains on its shard of every epoch, and the
 * replicas of a stage average their gradients (dt_ddp over a group).
 * Evaluation also runs through the stages, forward only, with dt_comm_send and
 * dt_comm_recv.  Rank 0 prints the split, the loss, each stage's bubble, and last
 * "test accuracy: NN.NN%".
 */
#include "dtrain.h"
#include "args.h"
#include "fmnist.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NL 3
static const int64_t width[NL + 1] = {784, 512, 512, 10};

typedef struct options {
    int stages, replicas, micro, epochs, batch, limit;
    const char *schedule, *data;
    unsigned long long seed;
} options;

typedef struct stage {
    dt_tensor *w[NL], *b[NL];
    int lo, hi;                /* its layers: [lo, hi) */
} stage;

static dt_tensor *layer(dt_ctx *ctx, const stage *s, int i, dt_tensor *x)
{
    if (i == 0)
        x = dt_flatten(ctx, x, 1);
    x = dt_linear(ctx, x, s->w[i], s->b[i]);
    return i < NL - 1 ? dt_relu(ctx, x) : x;
}

static dt_tensor *stage_forward(dt_ctx *ctx, const stage *s, dt_tensor *x)
{
    for (int i = s->lo; i < s->hi && x; i++)
        x = layer(ctx, s, i, x);
    return x;
}

/* The pipeline's per-micro-batch function: the loss on the last stage. */
static dt_tensor *stage_fn(dt_ctx *ctx, dt_tensor *x, dt_tensor *y, void *user)
{
    const stage *s = user;
    dt_tensor *h = stage_forward(ctx, s, x);
    return s->hi == NL ? dt_cross_entropy(ctx, h, y) : h;
}

/* For dt_profile_layer_times: layer i alone. */
typedef struct one_layer { const stage *s; int i; } one_layer;
static dt_tensor *layer_fn(dt_ctx *ctx, dt_tensor *x, void *user)
{
    const one_layer *l = user;
    return layer(ctx, l->s, l->i, x);
}

/* Every layer, seeded (the same on every rank). */
static int make_layers(dt_ctx *ctx, stage *s, int lo, int hi, const stage *from)
{
    s->lo = lo;
    s->hi = hi;
    for (int i = lo; i < hi; i++) {
        char name[32];
        snprintf(name, sizeof name, "fc%d.weight", i);
        s->w[i] = dt_param_new(ctx, name, 2, (const int64_t[]){width[i + 1], width[i]});
        snprintf(name, sizeof name, "fc%d.bias", i);
        s->b[i] = dt_param_new(ctx, name, 1, (const int64_t[]){width[i + 1]});
        if (!s->w[i] || !s->b[i])
            return 0;
        if (!from) {
            if (dt_tensor_init_kaiming_uniform(ctx, s->w[i], 2.2360680f) != DT_OK ||
                dt_tensor_init_bias(ctx, s->b[i], width[i]) != DT_OK)
                return 0;
            continue;
        }
        float *buf = malloc(sizeof(float) * (size_t)(width[i] * width[i + 1]));
        int ok = buf && dt_tensor_get(from->w[i], buf, width[i] * width[i + 1]) == DT_OK &&
                 dt_tensor_set(s->w[i], buf, width[i] * width[i + 1]) == DT_OK &&
                 dt_tensor_get(from->b[i], buf, width[i + 1]) == DT_OK &&
                 dt_tensor_set(s->b[i], buf, width[i + 1]) == DT_OK;
        free(buf);
        if (!ok)
            return 0;
    }
    return 1;
}

/* The split by measured time: every rank times the layers on a batch of
 * one micro-batch's size; the job averages them, so all agree. */
static int split_layers(const options *o, dt_ctx *ctx, dt_comm *job, const stage *full,
                        const dt_tensor *sample, int *first)
{
    dt_layer_fn fns[NL];
    one_layer ls[NL];
    void *users[NL];
    double ms[NL];
    for (int i = 0; i < NL; i++) {
        ls[i] = (one_layer){full, i};
        fns[i] = layer_fn;
        users[i] = &ls[i];
    }
    if (dt_profile_layer_times(ctx, NULL, fns, users, NL, sample, 5, ms) != DT_OK)
        return 0;
    float f[NL];
    for (int i = 0; i < NL; i++)
        f[i] = (float)ms[i];
    if (job && dt_comm_allreduce(job, f, NL, DT_REDUCE_AVG) != DT_OK)
        return 0;
    for (int i = 0; i < NL; i++)
        ms[i] = f[i];
    if (dt_pipe_partition(ms, NL, o->stages, first) != DT_OK)
        return 0;
    return 1;
}

/* Forward only through the stages: stage s receives its input from s-1,
 * sends its output to s+1; the last counts correct predictions. */
static int evaluate(const options *o, dt_ctx *ctx, dt_comm *pipe, const stage *s,
                    const dt_dataset *test, int replica, int64_t *correct)
{
    dt_loader_config lc;
    dt_loader_config_init(&lc);
    lc.batch = 500;
    lc.shuffle = 0;
    lc.mean = 0.2860f;
    lc.std = 0.3530f;
    lc.shard_rank = replica;
    lc.shard_count = o->replicas;
    lc.shard_no_pad = 1;
    dt_loader *ld = dt_loader_new(ctx, test, &lc);
    int st = pipe ? dt_comm_rank(pipe) : 0, last = s->hi == NL, ok = ld != NULL;
    float *buf = malloc(sizeof(float) * 500 * 512);
    dt_tensor *x, *y;
    dt_ctx_set_grad_enabled(ctx, 0);
    while (ok && buf && dt_loader_next(ld, &x, &y) == DT_OK) {
        int64_t rows = dt_tensor_dim(x, 0), in = width[s->lo], out = width[s->hi];
        dt_tensor *h = x;
        if (st > 0) {   /* the previous stage's activations */
            h = dt_tensor_temp(ctx, DT_F32, 2, (const int64_t[]){rows, in});
            ok = h && dt_comm_recv(pipe, buf, rows * in, st - 1) == DT_OK &&
                 dt_tensor_set(h, buf, rows * in) == DT_OK;
        }
        h = ok ? stage_forward(ctx, s, h) : NULL;
        int64_t c = 0;
        if (!h)
            ok = 0;
        else if (last)
            ok = dt_count_correct(ctx, h, y, &c) == DT_OK;
        else
            ok = dt_tensor_get(h, buf, rows * out) == DT_OK &&
                 dt_comm_send(pipe, buf, rows * out, st + 1) == DT_OK;
        *correct += c;
        dt_ctx_step_reset(ctx);
    }
    dt_ctx_set_grad_enabled(ctx, 1);
    free(buf);
    dt_loader_free(ld);
    return ok;
}

static int fail(dt_ctx *ctx, int rank, const char *what)
{
    fprintf(stderr, "pipeline_mnist: rank %d: %s: %s\n", rank, what, dt_last_error(ctx));
    return 0;
}

static int train(const options *o, dt_ctx *ctx, dt_comm *job)
{
    int rank = job ? dt_comm_rank(job) : 0, S = o->stages;
    int st = rank % S, replica = rank / S;
    dt_comm *pipe = NULL, *dp = NULL;
    if (job && S > 1 && !(pipe = dt_comm_split(job, replica, st, NULL)))
        return fail(ctx, rank, "making the pipeline's group");
    if (job && o->replicas > 1 && !(dp = dt_comm_split(job, st, replica, NULL)))
        return fail(ctx, rank, "making the replicas' group");
    dt_dataset *train_ds = fmnist_load(ctx, o->data, 0);
    dt_dataset *test_ds = train_ds ? fmnist_load(ctx, o->data, 1) : NULL;
    if (!test_ds)
        return fail(ctx, rank, "loading the dataset");
    /* the whole model, seeded, in a context of its own: to time the layers
     * and to copy this stage's starting weights from */
    dt_ctx_config pc;
    dt_ctx_config_init(&pc);
    pc.seed = o->seed;
    dt_ctx *probe = dt_ctx_new(&pc);
    stage full = {0}, mine = {0};
    int first[NL + 1] = {0, NL};
    dt_tensor *sample = probe ? dt_tensor_new(probe, DT_F32, 4,
                                              (const int64_t[]){o->batch / o->micro, 1, 28, 28})
                              : NULL;
    int ok = sample && make_layers(probe, &full, 0, NL, NULL) &&
             dt_tensor_init_normal(probe, sample, 0, 1) == DT_OK &&
             (S == 1 || split_layers(o, probe, job, &full, sample, first)) &&
             make_layers(ctx, &mine, first[st], first[st + 1], &full);
    if (!ok) {
        fail(probe ? probe : ctx, rank, "building the model");
        dt_ctx_free(probe);
        return 0;
    }
    dt_ctx_free(probe);
    if (rank == 0) {
        printf("pipeline_mnist: %d stage(s) x %d replica(s), %d micro-batches (%s); layers",
               S, o->replicas, o->micro, o->schedule);
        for (int s = 0; s < S; s++)
            printf(" %s%d-%d", s ? "| " : "", first[s], first[s + 1] - 1);
        printf(" by measured time\n");
    }
    dt_loader_config lc;
    dt_loader_config_init(&lc);
    lc.batch = o->batch;
    lc.seed = o->seed;   /* a replica's stages see the same batches */
    lc.mean = 0.2860f;
    lc.std = 0.3530f;
    lc.shard_rank = replica;
    lc.shard_count = o->replicas;
    dt_loader *ld = dt_loader_new(ctx, train_ds, &lc);
    dt_optim_config oc;
    dt_optim_config_init(&oc, DT_SGD);
    oc.lr = 0.05f;
    oc.momentum = 0.9f;
    dt_optim *opt = ld ? dt_optim_new(ctx, &oc, NULL, 0) : NULL;
    dt_pipe_config cfg;
    dt_pipe_config_init(&cfg);
    cfg.micro_batches = o->micro;
    cfg.schedule = strcmp(o->schedule, "gpipe") ? DT_PIPE_1F1B : DT_PIPE_GPIPE;
    dt_pipe *p = opt && pipe ? dt_pipe_new(ctx, pipe, &cfg, stage_fn, &mine) : NULL;
    dt_ddp *ddp = opt && dp ? dt_ddp_new(ctx, dp, opt, NULL) : NULL;
    if (!opt || (pipe && !p) || (dp && !ddp))
        ok = fail(ctx, rank, "setting up training");
    int64_t per_epoch = ld ? dt_loader_batches(ld) : 0;
    if (o->limit && o->limit < per_epoch)
        per_epoch = o->limit;
    for (int e = 0; ok && e < o->epochs; e++) {
        dt_loader_start_epoch(ld, e);
        double loss_sum = 0;
        int64_t b = 0;
        dt_tensor *x, *y;
        for (; ok && b < per_epoch && dt_loader_next(ld, &x, &y) == DT_OK; b++) {
            float loss = 0;
            if (p) {
                ok = dt_pipe_step(p, st == 0 ? x : NULL, st == S - 1 ? y : NULL, &loss) == DT_OK;
            } else {   /* one stage: the plain loop */
                dt_tensor *l = stage_fn(ctx, x, y, &mine);
                ok = l && dt_backward(ctx, l) == DT_OK;
                loss = ok ? dt_tensor_item(l) : 0;
            }
            ok = ok && (ddp ? dt_ddp_step(ddp) : dt_optim_step(opt)) == DT_OK;
            loss_sum += loss;
            dt_ctx_zero_grad(ctx);
            dt_ctx_step_reset(ctx);
        }
        if (!ok)
            fail(ctx, rank, "training");
        else if (rank == S - 1)   /* replica 0's last stage has the loss */
            printf("epoch %d: train loss %.4f over %lld batches\n", e + 1,
                   loss_sum / (double)(b ? b : 1), (long long)b);
        fflush(stdout);   /* before rank 0's lines: a pipe would hold it to exit */
    }
    int64_t correct = 0;
    if (ok && !evaluate(o, ctx, pipe, &mine, test_ds, replica, &correct))
        ok = fail(ctx, rank, "evaluating");
    /* one allreduce gathers the test results and every stage's bubble, so
     * that rank 0 prints them all in order (the ranks share one terminal) */
    int n = job ? dt_comm_size(job) : 1;
    float *tot = calloc((size_t)(2 + 3 * n), sizeof *tot);
    if (!tot)
        return fail(ctx, rank, "allocating the results");
    tot[0] = (float)correct;
    tot[1] = ok ? 0.0f : 1.0f;
    if (p) {
        dt_pipe_stats ps;
        dt_pipe_stats_get(p, &ps);
        tot[2 + 3 * rank] = (float)ps.bubble;
        tot[3 + 3 * rank] = (float)ps.bubble_ideal;
        tot[4 + 3 * rank] = (float)ps.in_flight_peak;
    }
    if (job && dt_comm_allreduce(job, tot, 2 + 3 * n, DT_REDUCE_SUM) != DT_OK)
        ok = fail(ctx, rank, "summing the test results");
    for (int r = 0; ok && p && rank == 0 && r < n; r++)
        printf("stage %d of replica %d: bubble %.1f%% of the step (ideal %.1f%%), held at most "
               "%d micro-batches\n", r % S, r / S, 100 * tot[2 + 3 * r], 100 * tot[3 + 3 * r],
               (int)tot[4 + 3 * r]);
    int passed = ok && tot[1] == 0;
    if (passed && rank == 0)
        printf("test accuracy: %.2f%%\n", 100.0 * tot[0] / (double)dt_dataset_size(test_ds));
    free(tot);
    dt_ddp_free(ddp);
    dt_pipe_free(p);
    dt_optim_free(opt);
    dt_loader_free(ld);
    dt_dataset_free(test_ds);
    dt_dataset_free(train_ds);
    dt_comm_free(dp);
    dt_comm_free(pipe);
    return passed;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: pipeline_mnist [--stages 1-3] [--replicas R] [--micro M] "
               "[--schedule 1f1b|gpipe] [--epochs N] [--batch B] [--limit-batches N] "
               "[--seed S] [--data DIR] [--help]\n");
}

static int parse(int argc, char **argv, options *o)
{
    *o = (options){2, 1, 4, 1, 128, 0, "1f1b", "/usr/share/datasets/fashion-mnist", 1};
    const args_opt opts[] = {
        ARG_INT("stages", &o->stages, 1, NL),
        ARG_INT("replicas", &o->replicas, 1, 1024),
        ARG_INT("micro", &o->micro, 1, 1 << 20),
        ARG_CHOICE("schedule", &o->schedule, "1f1b|gpipe"),
        ARG_INT("epochs", &o->epochs, 1, 1000000),
        ARG_INT("batch", &o->batch, 1, 1 << 20),
        ARG_INT("limit-batches", &o->limit, 0, 1 << 30),   /* 0: the whole epoch */
        ARG_U64("seed", &o->seed),
        ARG_STR("data", &o->data),
    };
    if (args_parse("pipeline_mnist", argc, argv, opts, sizeof opts / sizeof opts[0],
                   ARGS_NO_OPERANDS, usage) < 0)
        return 0;
    if (o->batch < o->micro) {   /* each micro-batch needs a sample at least */
        fprintf(stderr, "pipeline_mnist: --batch %d is less than --micro %d\n", o->batch, o->micro);
        return 0;
    }
    return 1;
}

int main(int argc, char **argv)
{
    options o;
    if (!parse(argc, argv, &o))
        return 2;
    int ranks = o.stages * o.replicas;
    dt_ctx *ctx = dt_ctx_new(NULL);
    if (!ctx)
        return 1;
    if (ranks > 1 && !getenv("DTRAIN_RANK")) {   /* fork the ranks here */
        dt_spawn_config sc;
        dt_spawn_config_init(&sc);
        sc.nranks = ranks;
        sc.prefix_output = 0;
        int rank = -1;
        dt_status s = dt_spawn(ctx, &sc, &rank);
        if (s != DT_OK || rank < 0) {   /* the supervisor: the ranks are done */
            if (s != DT_OK)
                fprintf(stderr, "pipeline_mnist: %s\n", dt_last_error(ctx));
            dt_ctx_free(ctx);
            return s == DT_OK ? 0 : 1;
        }
    }
    dt_dist_env env;
    dt_comm *job = NULL;
    int ok = dt_dist_env_detect(ctx, &env) == DT_OK;
    if (ok && env.world_size != ranks && env.world_size > 1) {
        fprintf(stderr, "pipeline_mnist: %d ranks for %d stages x %d replicas\n",
                env.world_size, o.stages, o.replicas);
        ok = 0;
    }
    if (ok && env.world_size > 1 && !(job = dt_comm_new(ctx, &env, NULL)))
        ok = fail(ctx, env.rank, "joining the job");
    if (ok)
        ok = train(&o, ctx, job);
    dt_comm_free(job);
    dt_ctx_free(ctx);
    return ok ? 0 : 1;
}
