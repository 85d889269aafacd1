/*
 * examples/fashion_mnist.c - train an MLP or a CNN on Fashion-MNIST, on one
 * process or data-parallel on several.
 *
 *   build/fashion_mnist --model cnn --epochs 6 --threads 2
 *   build/fashion_mnist --model mlp --epochs 10 --save mlp.safetensors
 *   build/fashion_mnist --model cnn --ranks 2      (2 local ranks, DDP over shm)
 *   build/dtrun -n 2 build/fashion_mnist --model cnn    (the same, any launcher)
 *   build/fashion_mnist --ranks 3 --servers 1 --ps-mode asp   (parameter server:
 *                                    2 workers + 1 server, Downpour-style ASP)
 *   build/fashion_mnist --model cnn --backend cuda --amp bf16   (GPU, mixed precision)
 *   build/fashion_mnist --ranks 2 --profile --trace t.json   (step breakdown per rank,
 *                                    report and a timeline for chrome://tracing)
 *   build/fashion_mnist --ranks 2 --slow 1:2 --balance   (rank 1 twice as slow; batches
 *                                    cut by measured speed)
 *
 * With more than one rank every rank trains on its own shard of each epoch
 * (batch = --batch per rank) and gradients are averaged with dt_ddp; the
 * test set is evaluated in parts and the metrics summed.  Rank 0 prints.
 * With --servers S the last S ranks are parameter servers holding the
 * weights and the optimizer (dt_ps); the workers push their gradients
 * through dt_ddp's buckets and pull the weights back, in the consistency
 * model --ps-mode says (bsp, asp, or ssp with --staleness).  Worker 0
 * prints and evaluates.
 *
 * The data comes from Debian's dataset-fashion-mnist
 * (/usr/share/datasets/fashion-mnist).  The last line printed is
 * "test accuracy: NN.NN%".
 */
#include "dtrain.h"
#include "args.h"
#include "fmnist.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define FMNIST_MEAN 0.2860f   /* pixel statistics of the training set */
#define FMNIST_STD 0.3530f

typedef struct options {
    const char *model, *data, *save, *resume, *optim, *ps_mode, *backend, *amp;
    const char *trace, *loss_log, *monitor;
    int epochs, batch, threads, limit_batches, ranks, servers, staleness, device;
    int profile, balance, steal, slow_rank, global_batch, zero;
    float lr, slow_factor;
    unsigned long long seed;
} options;

/* The live monitor (--monitor), when on: the training loops log to it. */
static dt_monitor *monitor;

typedef struct model {
    int cnn;
    dt_tensor *c1w, *c1b, *c2w, *c2b;        /* CNN convolutions */
    dt_tensor *f1w, *f1b, *f2w, *f2b, *f3w, *f3b;
} model;

static void usage(FILE *f)
{
    fprintf(f,
            "usage: fashion_mnist [options]\n"
            "  --model mlp|cnn     784-512-512-10 MLP or the 2-conv CNN (default mlp)\n"
            "  --epochs N          training epochs (default 10)\n"
            "  --batch N           batch size (default 128 for mlp, 64 for cnn)\n"
            "  --global-batch G    G samples a step over all ranks (each G / ranks), in the\n"
            "                      order one process would take them: the same training\n"
            "                      on any number of ranks (dtrun --min-ranks)\n"
            "  --lr X              learning rate (default 1e-3, Adam with cosine decay)\n"
            "  --optim adam|sgd    optimizer (sgd uses momentum 0.9; default adam)\n"
            "  --threads N         compute threads per rank (default 1)\n"
            "  --backend NAME      cpu (default) or cuda\n"
            "  --device N          GPU index (with several ranks: N + local rank)\n"
            "  --amp P             mixed precision: bf16, fp16 (with dynamic loss\n"
            "                      scaling) or tf32; default off (fp32)\n"
            "  --ranks N           train data-parallel on N local processes (default 1;\n"
            "                      under a launcher such as build/dtrun, its world size)\n"
            "  --zero L            shard the training state across the ranks (ZeRO): 1 the\n"
            "                      optimizer state, 2 also the gradients, 3 also the\n"
            "                      parameters (default 0: none)\n"
            "  --servers N         of the ranks, N are parameter servers (default 0: DDP)\n"
            "  --ps-mode M         bsp, asp or ssp, with --servers (default bsp)\n"
            "  --staleness S       ssp's bound (default 2)\n"
            "  --seed N            seed for init and shuffling (default 1)\n"
            "  --save PATH         write a checkpoint after every epoch (PATH ending in '/':\n"
            "                      a directory, one file per epoch, DIR/step-N.safetensors;\n"
            "                      with --zero each rank writes its shard: PATH, or\n"
            "                      DIR/step-N, is a sharded checkpoint's directory).  Also\n"
            "                      on SIGTERM, SIGUSR1 or SIGUSR2: every rank finishes its\n"
            "                      step, the checkpoint of that step is written, and the\n"
            "                      program exits 75 (pre-empted; --resume auto goes on)\n"
            "  --resume PATH|auto  continue from a checkpoint; auto: the newest complete one\n"
            "                      --save wrote, if any (what dtrun --max-restarts needs)\n"
            "  --data DIR          dataset directory (default /usr/share/datasets/fashion-mnist)\n"
            "  --limit-batches N   stop each epoch after N batches (quick runs)\n"
            "  --profile           profile every rank; rank 0 prints the report at the end\n"
            "                      (DTRAIN_PROFILE=1 does the same)\n"
            "  --trace PATH        with --profile: the merged timeline (Chrome trace JSON)\n"
            "  --slow R:F          make rank R F times slower (it burns F-1 times its forward\n"
            "                      and backward CPU time, on its own thread): a straggler\n"
            "  --balance           cut each global batch between the ranks by measured speed\n"
            "                      (dt_ddp_balance; batch = per rank at equal speed)\n"
            "  --steal N           with --servers in asp/ssp: idle workers take chunks of N\n"
            "                      batches from slow ones (dt_loader_steal)\n"
            "  --loss-log PATH     rank 0 appends 'seconds,loss' every 10 steps (a plot)\n"
            "  --monitor [H:]PORT  rank 0 serves a live page and Prometheus metrics there\n"
            "                      (DTRAIN_MONITOR does the same; 0: any free port)\n"
            "  --help              this text\n");
}

/* --slow R:F: rank R (0..4095) made F (1..1000) times slower. */
static int parse_slow(const char *text, options *o)
{
    const char *colon = strchr(text, ':');
    char rank[16];
    double f;
    if (!colon || colon - text >= (long)sizeof rank) {
        fprintf(stderr, "fashion_mnist: --slow '%s': expected R:F, a rank and a factor\n", text);
        return 0;
    }
    snprintf(rank, sizeof rank, "%.*s", (int)(colon - text), text);
    if (!args_int("fashion_mnist", "slow", rank, 0, 4095, &o->slow_rank) ||
        !args_double("fashion_mnist", "slow", colon + 1, 1, 1000, &f))
        return 0;
    o->slow_factor = (float)f;
    return 1;
}

static int parse_args(int argc, char **argv, options *o)
{
    *o = (options){.model = "mlp", .optim = "adam", .ps_mode = "bsp", .epochs = 10, .threads = 1,
                   .ranks = 1, .staleness = 2, .lr = 1e-3f, .seed = 1, .slow_rank = -1};
    const char *slow = NULL;
    const args_opt opts[] = {
        ARG_CHOICE("model", &o->model, "mlp|cnn"),
        ARG_INT("epochs", &o->epochs, 1, 1000000),
        ARG_INT("batch", &o->batch, 1, 1 << 20),
        ARG_INT("global-batch", &o->global_batch, 1, 1 << 30),
        ARG_RATE("lr", &o->lr, 1000),
        ARG_CHOICE("optim", &o->optim, "adam|sgd"),
        ARG_INT("threads", &o->threads, 1, 1024),
        ARG_STR("backend", &o->backend),
        ARG_INT("device", &o->device, 0, 1023),
        ARG_CHOICE("amp", &o->amp, "bf16|fp16|tf32|off"),
        ARG_INT("ranks", &o->ranks, 1, 4096),
        ARG_INT("servers", &o->servers, 0, 4095),
        ARG_INT("zero", &o->zero, 0, 3),
        ARG_CHOICE("ps-mode", &o->ps_mode, "bsp|asp|ssp"),
        ARG_INT("staleness", &o->staleness, 0, 1 << 20),
        ARG_U64("seed", &o->seed),
        ARG_STR("save", &o->save),
        ARG_STR("resume", &o->resume),
        ARG_STR("data", &o->data),
        ARG_INT("limit-batches", &o->limit_batches, 1, 1 << 30),
        ARG_FLAG("profile", &o->profile),
        ARG_STR("trace", &o->trace),
        ARG_STR("slow", &slow),
        ARG_FLAG("balance", &o->balance),
        ARG_INT("steal", &o->steal, 1, 1 << 20),
        ARG_STR("loss-log", &o->loss_log),
        ARG_STR("monitor", &o->monitor),
    };
    if (args_parse("fashion_mnist", argc, argv, opts, sizeof opts / sizeof opts[0],
                   ARGS_NO_OPERANDS, usage) < 0 ||
        (slow && !parse_slow(slow, o)))
        return 0;
    if (o->resume && !strcmp(o->resume, "auto") && !o->save) {
        fprintf(stderr, "fashion_mnist: --resume auto needs --save (where to look)\n");
        return 0;
    }
    if (o->servers && (o->ranks <= o->servers || o->resume || o->global_batch)) {
        fprintf(stderr, "fashion_mnist: --servers needs more --ranks than servers (and no "
                        "--resume or --global-batch)\n");
        return 0;
    }
    if (o->zero && (o->servers || o->balance)) {
        fprintf(stderr, "fashion_mnist: --zero does not combine with --servers or --balance "
                        "yet\n");
        return 0;
    }
    if (!o->batch)
        o->batch = strcmp(o->model, "cnn") ? 128 : 64;
    return 1;
}

/* A linear layer initialised as torch.nn.Linear: kaiming_uniform(a=sqrt(5)). */
static int linear_params(dt_ctx *ctx, const char *name, int64_t in, int64_t out, dt_tensor **w,
                         dt_tensor **b)
{
    char n[64];
    snprintf(n, sizeof n, "%s.weight", name);
    *w = dt_param_new(ctx, n, 2, (int64_t[]){out, in});
    snprintf(n, sizeof n, "%s.bias", name);
    *b = dt_param_new(ctx, n, 1, (int64_t[]){out});
    return *w && *b && dt_tensor_init_kaiming_uniform(ctx, *w, 2.2360679775f) == DT_OK &&
           dt_tensor_init_bias(ctx, *b, in) == DT_OK;
}

static int conv_params(dt_ctx *ctx, const char *name, int64_t cin, int64_t cout, dt_tensor **w,
                       dt_tensor **b)
{
    char n[64];
    snprintf(n, sizeof n, "%s.weight", name);
    *w = dt_param_new(ctx, n, 4, (int64_t[]){cout, cin, 3, 3});
    snprintf(n, sizeof n, "%s.bias", name);
    *b = dt_param_new(ctx, n, 1, (int64_t[]){cout});
    return *w && *b && dt_tensor_init_kaiming_uniform(ctx, *w, 2.2360679775f) == DT_OK &&
           dt_tensor_init_bias(ctx, *b, cin * 9) == DT_OK;
}

static int model_build(dt_ctx *ctx, model *m, int cnn)
{
    memset(m, 0, sizeof *m);
    m->cnn = cnn;
    if (!cnn)
        return linear_params(ctx, "fc1", 784, 512, &m->f1w, &m->f1b) &&
               linear_params(ctx, "fc2", 512, 512, &m->f2w, &m->f2b) &&
               linear_params(ctx, "fc3", 512, 10, &m->f3w, &m->f3b);
    return conv_params(ctx, "conv1", 1, 32, &m->c1w, &m->c1b) &&
           conv_params(ctx, "conv2", 32, 64, &m->c2w, &m->c2b) &&
           linear_params(ctx, "fc1", 3136, 128, &m->f1w, &m->f1b) &&
           linear_params(ctx, "fc2", 128, 10, &m->f2w, &m->f2b);
}

/* x (B,1,28,28) -> logits (B,10) */
static dt_tensor *model_forward(dt_ctx *ctx, const model *m, dt_tensor *x)
{
    if (!m->cnn) {
        dt_tensor *h = dt_flatten(ctx, x, 1);
        h = dt_relu(ctx, dt_linear(ctx, h, m->f1w, m->f1b));
        h = dt_relu(ctx, dt_linear(ctx, h, m->f2w, m->f2b));
        return dt_linear(ctx, h, m->f3w, m->f3b);
    }
    dt_tensor *h = dt_relu(ctx, dt_conv2d(ctx, x, m->c1w, m->c1b, 1, 1));
    h = dt_max_pool2d(ctx, h, 2, 2, 0);
    h = dt_relu(ctx, dt_conv2d(ctx, h, m->c2w, m->c2b, 1, 1));
    h = dt_max_pool2d(ctx, h, 2, 2, 0);
    h = dt_relu(ctx, dt_linear(ctx, dt_flatten(ctx, h, 1), m->f1w, m->f1b));
    return dt_linear(ctx, h, m->f2w, m->f2b);
}

/* --save PATH: a file, replaced every epoch; PATH ending in '/': a
 * directory (made if missing) of one file per epoch.  With --zero every
 * rank writes its shard: PATH (or PATH/step-N) is then a sharded
 * checkpoint's directory, and no rank gathers the model to save it. */
static int save_epoch(dt_ctx *ctx, dt_ddp *sharded, dt_optim *opt, const char *save, int64_t step)
{
    size_t l = strlen(save);
    char path[4096];
    if (l && save[l - 1] == '/') {
        mkdir(save, 0755);   /* (an error shows in the save) */
        snprintf(path, sizeof path, sharded ? "%sstep-%lld" : "%sstep-%lld.safetensors", save,
                 (long long)step);
    } else {
        snprintf(path, sizeof path, "%s", save);
    }
    return (sharded ? dt_ddp_checkpoint_save(sharded, opt, path, step)
                    : dt_checkpoint_save(ctx, opt, path, step, NULL)) == DT_OK;
}

/* Where to resume from: --resume PATH, or with "auto" the newest complete
 * checkpoint --save wrote ("" when there is none yet: a fresh start). */
static int resume_path(dt_ctx *ctx, const options *o, char *path, size_t cap)
{
    path[0] = '\0';
    if (!o->resume)
        return 1;
    if (strcmp(o->resume, "auto") != 0) {
        snprintf(path, cap, "%s", o->resume);
        return 1;
    }
    size_t l = strlen(o->save);
    if (l && o->save[l - 1] == '/') {
        struct stat st;
        return stat(o->save, &st) != 0 ||
               dt_checkpoint_latest(ctx, o->save, path, cap, NULL) == DT_OK;
    }
    char index[4200];   /* --zero: a sharded checkpoint is whole once its index is there */
    snprintf(index, sizeof index, "%s/index.json", o->save);
    if (access(o->zero ? index : o->save, F_OK) == 0)
        snprintf(path, cap, "%s", o->save);
    return 1;
}

static void progress(int tty, int epoch, int epochs, int64_t done, int64_t total, double loss,
                     double rate)
{
    if (tty) {
        int width = 30, fill = (int)(width * done / (total ? total : 1));
        printf("\repoch %d/%d [", epoch, epochs);
        for (int i = 0; i < width; i++)
            putchar(i < fill ? '=' : (i == fill ? '>' : ' '));
        printf("] %3d%% loss %.4f %6.0f samples/s ", (int)(100 * done / (total ? total : 1)), loss,
               rate);
        fflush(stdout);
    } else if (done == total || done % 100 == 0) {
        printf("epoch %d/%d batch %lld/%lld loss %.4f %.0f samples/s\n", epoch, epochs,
               (long long)done, (long long)total, loss, rate);
    }
}

/* dt_evaluate's forward: the model's logits for a test batch */
static dt_tensor *eval_forward(dt_ctx *ctx, dt_tensor *x, void *user)
{
    return model_forward(ctx, user, x);
}

static int fail(dt_ctx *ctx, int rank, const char *what)
{
    fprintf(stderr, "fashion_mnist: rank %d: %s: %s\n", rank, what, dt_last_error(ctx));
    return 0;
}

/* Where one epoch's time went on this rank. */
typedef struct breakdown {
    double total, data, exposed, comm;
    double sent, grad, steps;   /* gradient bytes sent and their fp32 size, steps */
} breakdown;

/* The same DDP statistics for both engines; pull_wait < 0: allreduce,
 * else a parameter-server worker's seconds waiting for pulls (exposed
 * communication holds them, and the pushes' exposed part). */
static void print_breakdown(const breakdown *b, int ranks, double pull_wait)
{
    double compute = b->total - b->data - b->exposed;
    printf("step time: %.1f s = compute %.1f s (%.0f%%) + exposed communication %.2f s (%.0f%%) "
           "+ data wait %.2f s (%.0f%%)",
           b->total, compute, 100 * compute / b->total, b->exposed, 100 * b->exposed / b->total,
           b->data, 100 * b->data / b->total);
    if (pull_wait >= 0)
        printf("; pushes ran %.2f s on the comm thread, pulls waited %.2f s", b->comm, pull_wait);
    else if (ranks > 1)   /* the wait can exceed the run (waiting to start): none hidden */
        printf("; allreduce ran %.2f s, %.0f%% of it hidden behind backward",
               b->comm, b->comm > b->exposed ? 100 * (1 - b->exposed / b->comm) : 0.0);
    printf("\n");
    if (ranks > 1 && b->steps > 0 && b->sent > 0)
        printf("gradient traffic: %.1f KiB sent per step per rank, %.3gx the %.1f KiB of fp32 "
               "gradients\n", b->sent / b->steps / 1024, b->sent / b->grad,
               b->grad / b->steps / 1024);
}

/* --slow works in this thread's CPU time, so "F times slower" holds even
 * when the machine is oversubscribed (wall time would count the waits). */
static double cpu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Burn s seconds of this thread's CPU (a slower machine, as dtrain sees it). */
static void spin(double s)
{
    double end = cpu_now() + s;
    volatile double x = 0;
    while (cpu_now() < end)
        x += 1.0;
}

/* --loss-log: one "seconds,loss" line (rank 0). */
static void log_loss(FILE *f, double t, double loss)
{
    if (f)
        fprintf(f, "%.3f,%.5f\n", t, loss);
}

/* The profiler's end: every rank joins; rank 0 prints the report. */
static int finish_profile(const options *o, dt_ctx *ctx, dt_comm *comm, int talk)
{
    if (!dt_profile_active(ctx))
        return 1;
    if (dt_profile_stop(ctx, comm, o->trace) != DT_OK)
        return 0;
    if (talk)
        printf("%s", dt_profile_report(ctx));
    return 1;
}

/* Train on this rank; comm is NULL for a single process. */
static int train(const options *o, dt_ctx *ctx, dt_comm *comm)
{
    int ok = 0, rank = comm ? dt_comm_rank(comm) : 0, ranks = comm ? dt_comm_size(comm) : 1;
    int tty = rank == 0 && isatty(STDOUT_FILENO), talk = rank == 0;
    model m;
    dt_dataset *train_ds = NULL, *test_ds = NULL;
    dt_loader *train_ld = NULL;
    dt_optim *opt = NULL;
    dt_ddp *ddp = NULL;
    dt_loss_scaler *scaler = NULL;
    if (!model_build(ctx, &m, !strcmp(o->model, "cnn")))
        return fail(ctx, rank, "building the model");
    if (o->profile && !dt_profile_active(ctx) && dt_profile_start(ctx, NULL) != DT_OK)
        return fail(ctx, rank, "starting the profiler");
    FILE *loss_log = talk && o->loss_log ? fopen(o->loss_log, "w") : NULL;
    if (loss_log)
        fprintf(loss_log, "seconds,loss\n");
    /* mixed precision: the products in bf16/fp16/tf32, weights stay f32;
     * fp16's narrow range needs the loss scaled */
    dt_precision amp = !o->amp                   ? DT_PREC_F32
                       : !strcmp(o->amp, "bf16") ? DT_PREC_BF16
                       : !strcmp(o->amp, "fp16") ? DT_PREC_F16
                       : !strcmp(o->amp, "tf32") ? DT_PREC_TF32 : DT_PREC_F32;
    if (dt_ctx_set_autocast(ctx, amp) != DT_OK ||
        (amp == DT_PREC_F16 && !(scaler = dt_loss_scaler_new(ctx, NULL))))
        return fail(ctx, rank, "setting up mixed precision");
    if (!(train_ds = fmnist_load(ctx, o->data, 0)) ||
        !(test_ds = fmnist_load(ctx, o->data, 1))) {
        fail(ctx, rank, "loading the dataset");
        goto done;
    }
    dt_loader_config lc;
    dt_loader_config_init(&lc);
    lc.batch = o->batch;
    if (o->global_batch && o->global_batch % ranks) {
        fprintf(stderr, "fashion_mnist: --global-batch %d is not a multiple of %d ranks\n",
                o->global_batch, ranks);
        goto done;
    }
    if (o->global_batch)
        lc.batch = o->global_batch / ranks;
    lc.seed = o->seed;
    lc.mean = FMNIST_MEAN;
    lc.std = FMNIST_STD;
    lc.prefetch = 1;
    lc.shard_rank = rank;    /* each rank its own shard, reshuffled every epoch */
    lc.shard_count = ranks;
    /* slices of global batches: cut by speed (--balance), or evenly (--global-batch) */
    lc.global_batches = (o->balance || o->global_batch) && ranks > 1;
    if (!(train_ld = dt_loader_new(ctx, train_ds, &lc)))
        goto fail_ctx;
    dt_eval_config ec;
    dt_eval_config_init(&ec);
    ec.mean = FMNIST_MEAN;
    ec.std = FMNIST_STD;
    int64_t per_epoch = dt_loader_batches(train_ld);
    if (o->limit_batches && o->limit_batches < per_epoch)
        per_epoch = o->limit_batches;
    dt_optim_config oc;
    dt_optim_config_init(&oc, strcmp(o->optim, "sgd") ? DT_ADAM : DT_SGD);
    oc.lr = o->lr;
    if (oc.kind == DT_SGD)
        oc.momentum = 0.9f;
    if (!(opt = dt_optim_new(ctx, &oc, NULL, 0)))
        goto fail_ctx;
    dt_schedule sched = {.kind = DT_SCHED_COSINE, .total_steps = per_epoch * o->epochs};
    if (dt_optim_set_schedule(opt, &sched) != DT_OK)
        goto fail_ctx;
    int64_t step = 0;
    char from[4096];
    if (!resume_path(ctx, o, from, sizeof from))
        goto fail_ctx;
    /* a sharded checkpoint (a directory) goes to the DDP once it exists:
     * each rank then reads only its part */
    struct stat from_st;
    int from_dir = from[0] && stat(from, &from_st) == 0 && S_ISDIR(from_st.st_mode) && comm;
    if (from[0] && !from_dir && dt_checkpoint_load(ctx, opt, from, NULL, &step, NULL) != DT_OK)
        goto fail_ctx;
    if (!from[0] && talk && o->resume) {
        printf("resumed from nothing: no checkpoint yet, starting at step 0 (restart %s)\n",
               getenv("DTRAIN_RESTART") ? getenv("DTRAIN_RESTART") : "0");
    }
    /* after a resume every rank holds the same weights anyway; otherwise
     * rank 0's initialisation goes to all */
    dt_ddp_config dcfg;
    dt_ddp_config_init(&dcfg);
    dcfg.zero = o->zero;
    if (comm && !(ddp = dt_ddp_new(ctx, comm, opt, &dcfg)))
        goto fail_ctx;
    if (ddp && o->balance && dt_ddp_balance(ddp, train_ld, 10) != DT_OK)
        goto fail_ctx;
    if (from_dir && dt_ddp_checkpoint_load(ddp, opt, from, &step) != DT_OK)
        goto fail_ctx;
    if (from[0] && talk)
        printf("resumed from %s at step %lld (restart %s)\n", from, (long long)step,
               getenv("DTRAIN_RESTART") ? getenv("DTRAIN_RESTART") : "0");
    if (talk) {
        printf("model %s, %d epochs, batch %d", o->model, o->epochs, (int)lc.batch);
        if (ranks > 1)
            printf(" per rank x %d ranks (DDP%s over %s)", ranks,
                   o->zero == 1 ? ", zero 1" : o->zero == 2 ? ", zero 2" : o->zero == 3 ? ", zero 3" : "",
                   dt_comm_transport(comm));
        printf(", lr %g, %s backend, %d threads, %d parameter tensors", (double)o->lr,
               dt_backend_name(ctx), dt_ctx_threads(ctx), dt_param_count(ctx));
        printf("%s%s\n", o->amp ? ", autocast " : "", o->amp ? o->amp : "");
        fflush(stdout);   /* training starts: a log read while it runs says so */
    }
    breakdown all = {0, 0, 0, 0, 0, 0, 0};
    double t_start = dt_now(), last_bwd = 0;
    for (int epoch = (int)(step / per_epoch); epoch < o->epochs; epoch++) {
        dt_loader_start_epoch(train_ld, epoch);
        if (ddp)
            dt_ddp_stats_reset(ddp);
        double t0 = dt_now(), loss_sum = 0;
        int64_t correct = 0, seen = 0;
        dt_tensor *x, *y;
        int64_t b = 0;
        if (epoch == (int)(step / per_epoch))   /* resumed mid-epoch: its first batches are done */
            for (; b < step % per_epoch && dt_loader_next(train_ld, &x, &y) == DT_OK; b++)
                dt_ctx_step_reset(ctx);
        for (; b < per_epoch && dt_loader_next(train_ld, &x, &y) == DT_OK; b++) {
            double tf = cpu_now();
            dt_tensor *logits = model_forward(ctx, &m, x);
            dt_tensor *loss = dt_cross_entropy(ctx, logits, y);
            int64_t c = 0;
            if (!loss || dt_count_correct(ctx, logits, y, &c) != DT_OK)
                goto fail_ctx;
            if (rank == o->slow_rank)   /* F times slower: F - 1 more forwards and backwards */
                spin((o->slow_factor - 1) * (cpu_now() - tf + last_bwd));
            double tb = cpu_now();
            if (scaler) {   /* reduced first, so every rank skips the same steps */
                if (dt_loss_scaler_backward(scaler, loss) != DT_OK ||
                    (ddp && dt_ddp_sync(ddp) != DT_OK) ||
                    dt_loss_scaler_step(scaler, opt, NULL) != DT_OK)
                    goto fail_ctx;
            } else {
                if (dt_backward(ctx, loss) != DT_OK)
                    goto fail_ctx;
                last_bwd = cpu_now() - tb;   /* backward alone, for --slow */
                if ((ddp ? dt_ddp_step(ddp) : dt_optim_step(opt)) != DT_OK)
                    goto fail_ctx;
            }
            dt_optim_zero_grad(opt);
            loss_sum += dt_tensor_item(loss);
            if (monitor)
                dt_monitor_log(monitor, "loss", step, dt_tensor_item(loss));
            if (loss_log && step % 10 == 0)
                log_loss(loss_log, dt_now() - t_start, dt_tensor_item(loss));
            correct += c;
            seen += dt_tensor_dim(x, 0);
            dt_ctx_step_reset(ctx);
            step++;
            if (talk)
                progress(tty, epoch + 1, o->epochs, b + 1, per_epoch, loss_sum / (double)(b + 1),
                         (double)(seen * ranks) / (dt_now() - t0));
            int stop = 0;   /* pre-empted (with --save): every rank saves after this step */
            if (dt_preempt_agree(ctx, comm, step, &stop) != DT_OK)
                goto fail_ctx;
            if (stop) {
                dt_ddp *sharded = o->zero ? ddp : NULL;
                if ((rank == 0 || sharded) && !save_epoch(ctx, sharded, opt, o->save, step))
                    goto fail_ctx;
                dt_preempt_saved(ctx, -1);
                if (talk)
                    printf("%s%s\n", tty ? "\n" : "", dt_preempt_report(ctx));
                ok = 2;
                goto done;
            }
        }
        breakdown bd = {dt_now() - t0, dt_loader_wait_seconds(train_ld), 0, 0, 0, 0, 0};
        if (ddp) {
            dt_ddp_stats st;
            dt_ddp_stats_get(ddp, &st);
            bd.exposed = st.exposed_s;
            bd.comm = st.comm_s;
            all.sent += (double)st.bytes_sent;
            all.grad += (double)st.grad_bytes;
            all.steps += (double)st.steps;
        }
        all.total += bd.total;
        all.data += bd.data;
        all.exposed += bd.exposed;
        all.comm += bd.comm;
        /* the epoch's training numbers over all ranks */
        float sums[3] = {(float)loss_sum, (float)correct, (float)seen};
        if (comm && dt_comm_allreduce(comm, sums, 3, DT_REDUCE_SUM) != DT_OK)
            goto fail_ctx;
        dt_metrics tm;
        /* zero 3: evaluation on whole parameters (each rank runs its own
         * number of batches: no gathers may happen inside it) */
        if ((ddp && dt_ddp_full_params(ddp) != DT_OK) ||
            dt_evaluate(ctx, comm, test_ds, &ec, eval_forward, &m, &tm) != DT_OK)
            goto fail_ctx;
        if (monitor) {
            dt_monitor_log(monitor, "val_loss", step, tm.loss);
            dt_monitor_log(monitor, "test_accuracy", step, tm.accuracy);
        }
        if (talk)
            printf("%sepoch %d: loss %.4f, train accuracy %.2f%%, test accuracy %.2f%%, "
                   "%.0f samples/s, %.1f s (data wait %.2f s, exposed comm %.2f s)\n",
                   tty ? "\n" : "", epoch + 1, sums[0] / (double)(per_epoch * ranks),
                   100.0 * sums[1] / (double)(sums[2] > 0 ? sums[2] : 1), 100 * tm.accuracy,
                   (double)sums[2] / bd.total, bd.total, bd.data, bd.exposed);
        dt_ddp *sharded = o->zero ? ddp : NULL;
        if (o->save && (rank == 0 || sharded) && !save_epoch(ctx, sharded, opt, o->save, step))
            goto fail_ctx;
    }
    dt_metrics tm;
    if ((ddp && dt_ddp_full_params(ddp) != DT_OK) ||
        dt_evaluate(ctx, comm, test_ds, &ec, eval_forward, &m, &tm) != DT_OK)
        goto fail_ctx;
    if (talk && all.total > 0)
        print_breakdown(&all, ranks, -1.0);
    if (talk && ddp && o->balance)
        printf("load balancing: rank 0's share of each global batch %.1f%%\n",
               100 * dt_ddp_balance_share(ddp));
    if (!finish_profile(o, ctx, comm, talk))
        goto fail_ctx;
    if (talk && scaler)
        printf("loss scale %g, %lld steps skipped for overflow\n",
               (double)dt_loss_scaler_scale(scaler), (long long)dt_loss_scaler_skipped(scaler));
    if (talk)
        printf("test accuracy: %.2f%%\n", 100 * tm.accuracy);
    ok = 1;
    goto done;
fail_ctx:
    if (tty)
        printf("\n");
    fail(ctx, rank, "training");
done:
    if (loss_log)
        fclose(loss_log);
    dt_loss_scaler_free(scaler);
    dt_ddp_free(ddp);
    dt_optim_free(opt);
    dt_loader_free(train_ld);
    dt_dataset_free(train_ds);
    dt_dataset_free(test_ds);
    return ok;
}

/* Parameter-server training: the servers hold the weights and step them;
 * each worker trains on its shard, its gradients pushed through dt_ddp's
 * buckets and the weights pulled back.  Worker 0 evaluates and prints. */
static int train_ps(const options *o, dt_ctx *ctx, dt_comm *comm)
{
    int rank = dt_comm_rank(comm), W = dt_comm_size(comm) - o->servers, ok = 0;
    int tty = rank == 0 && isatty(STDOUT_FILENO), talk = rank == 0;
    model m;
    dt_dataset *train_ds = NULL, *test_ds = NULL;
    dt_loader *ld = NULL;
    dt_ddp *ddp = NULL;
    if (rank < W && !model_build(ctx, &m, !strcmp(o->model, "cnn")))
        return fail(ctx, rank, "building the model");
    if (o->profile && !dt_profile_active(ctx) && dt_profile_start(ctx, NULL) != DT_OK)
        return fail(ctx, rank, "starting the profiler");
    dt_ps_config pc;
    dt_ps_config_init(&pc);
    pc.servers = o->servers;
    pc.mode = !strcmp(o->ps_mode, "asp") ? DT_PS_ASP : !strcmp(o->ps_mode, "ssp") ? DT_PS_SSP : DT_PS_BSP;
    pc.staleness = o->staleness;
    dt_optim_config_init(&pc.optim, strcmp(o->optim, "sgd") ? DT_ADAM : DT_SGD);
    pc.optim.lr = o->lr;
    if (pc.optim.kind == DT_SGD)
        pc.optim.momentum = 0.9f;
    dt_loader_config lc;
    dt_loader_config_init(&lc);
    lc.batch = o->batch;
    lc.seed = o->seed;
    lc.mean = FMNIST_MEAN;
    lc.std = FMNIST_STD;
    lc.prefetch = 1;
    lc.shard_rank = rank;
    lc.shard_count = W;
    /* cosine decay over the run, counted in server steps (ASP/SSP: one per push) */
    int64_t per_epoch = (60000 / W + o->batch - 1) / o->batch;
    if (o->limit_batches && o->limit_batches < per_epoch)
        per_epoch = o->limit_batches;
    pc.schedule = (dt_schedule){.kind = DT_SCHED_COSINE,
                                .total_steps = per_epoch * o->epochs * (pc.mode == DT_PS_BSP ? 1 : W)};
    dt_ps *ps = dt_ps_new(ctx, comm, &pc);
    if (!ps)
        return fail(ctx, rank, "joining the parameter servers");
    if (dt_ps_is_server(ps)) {
        if (!(ok = dt_ps_serve(ps) == DT_OK))
            fail(ctx, rank, "serving");
        goto done;
    }
    if (!(train_ds = fmnist_load(ctx, o->data, 0)) ||
        !(test_ds = fmnist_load(ctx, o->data, 1)))
        goto fail_ctx;
    dt_ddp_config dc;
    dt_ddp_config_init(&dc);
    dc.ps = ps;
    if (!(ld = dt_loader_new(ctx, train_ds, &lc)) || !(ddp = dt_ddp_new(ctx, comm, NULL, &dc)))
        goto fail_ctx;
    if (o->steal && pc.mode != DT_PS_BSP) {   /* workers need not run as many steps */
        if (dt_loader_steal(ld, comm, o->steal) != DT_OK)
            goto fail_ctx;
        if (!o->limit_batches)
            per_epoch = INT64_MAX;   /* until no chunk is left */
    }
    dt_eval_config ec;
    dt_eval_config_init(&ec);
    ec.mean = FMNIST_MEAN;
    ec.std = FMNIST_STD;
    if (per_epoch > dt_loader_batches(ld) && !(o->steal && pc.mode != DT_PS_BSP))
        per_epoch = dt_loader_batches(ld);
    if (talk)
        printf("model %s, %d epochs, batch %d per worker x %d workers, %d servers (%s), %s lr %g\n",
               o->model, o->epochs, o->batch, W, o->servers, o->ps_mode, o->optim, (double)o->lr);
    dt_metrics tm;
    double t_all = dt_now();
    breakdown all = {0};
    for (int epoch = 0; epoch < o->epochs; epoch++) {
        dt_loader_start_epoch(ld, epoch);
        double t0 = dt_now(), loss_sum = 0;
        dt_tensor *x, *y;
        int64_t b = 0;
        for (; b < per_epoch && dt_loader_next(ld, &x, &y) == DT_OK; b++) {
            double tf = cpu_now();
            dt_tensor *loss = dt_cross_entropy(ctx, model_forward(ctx, &m, x), y);
            if (rank == o->slow_rank && loss)   /* backward costs about twice the forward */
                spin((o->slow_factor - 1) * 3 * (cpu_now() - tf));
            if (!loss || dt_backward(ctx, loss) != DT_OK || dt_ddp_step(ddp) != DT_OK)
                goto fail_ctx;
            loss_sum += dt_tensor_item(loss);
            dt_ctx_zero_grad(ctx);
            dt_ctx_step_reset(ctx);
            if (talk && per_epoch < INT64_MAX)
                progress(tty, epoch + 1, o->epochs, b + 1, per_epoch, loss_sum / (double)(b + 1),
                         (double)((b + 1) * o->batch) / (dt_now() - t0));
        }
        if (talk && o->steal && pc.mode != DT_PS_BSP)
            printf("epoch %d: worker 0 ran %lld batches, %lld of them taken from other "
                   "workers' shards\n", epoch + 1, (long long)b,
                   (long long)dt_loader_batches_stolen(ld));
        all.total += dt_now() - t0;
        all.data += dt_loader_wait_seconds(ld);
        if (talk) {
            if (dt_evaluate(ctx, NULL, test_ds, &ec, eval_forward, &m, &tm) != DT_OK)
                goto fail_ctx;
            printf("%sepoch %d: loss %.4f, test accuracy %.2f%%, %.0f samples/s on worker 0\n",
                   tty ? "\n" : "", epoch + 1, loss_sum / (double)(b ? b : 1), 100 * tm.accuracy,
                   (double)(b * o->batch) / (dt_now() - t0));
        }
    }
    if (talk) {   /* the servers' weights as they are now */
        if (dt_ps_pull(ps) != DT_OK ||
            dt_evaluate(ctx, NULL, test_ds, &ec, eval_forward, &m, &tm) != DT_OK)
            goto fail_ctx;
        dt_ps_stats st;
        dt_ps_stats_get(ps, &st);
        printf("%.1f s; pulls waited %.2f s; staleness of the answered pulls: mean %.2f, max %lld\n",
               dt_now() - t_all, st.wait_s, st.mean_staleness, (long long)st.max_staleness);
        dt_ddp_stats ds;   /* worker 0's steps, from the DDP engine's statistics */
        dt_ddp_stats_get(ddp, &ds);
        all.exposed = ds.exposed_s;
        all.comm = ds.comm_s;
        all.sent = (double)ds.bytes_sent;
        all.grad = (double)ds.grad_bytes;
        all.steps = (double)ds.steps;
        print_breakdown(&all, 2, st.wait_s);
        printf("test accuracy: %.2f%%\n", 100 * tm.accuracy);
    }
    ok = dt_ps_finish(ps) == DT_OK;
    if (ok)
        goto done;
fail_ctx:
    ok = fail(ctx, rank, "training");
done:
    if (ok && !finish_profile(o, ctx, comm, talk))   /* servers too: it is collective */
        ok = fail(ctx, rank, "finishing the profile");
    dt_ddp_free(ddp);
    dt_ps_free(ps);
    dt_loader_free(ld);
    dt_dataset_free(train_ds);
    dt_dataset_free(test_ds);
    if (ok && dt_comm_barrier(comm) != DT_OK)   /* rank 0 hosts the store: leave together */
        ok = fail(ctx, rank, "leaving");
    return ok;
}

/* This process's part: one rank of a job (world > 1) or the whole run. */
static int run_rank(const options *o)
{
    dt_ctx_config cfg;
    dt_ctx_config_init(&cfg);
    cfg.threads = o->threads;
    cfg.seed = o->seed;
    if (o->backend)
        cfg.backend = o->backend;
    const char *lr = getenv("DTRAIN_LOCAL_RANK");   /* one GPU per local rank */
    cfg.device = o->device + (lr ? atoi(lr) : 0);
    dt_ctx *ctx = dt_ctx_new(&cfg);
    if (!ctx || dt_ctx_status(ctx) != DT_OK) {
        fprintf(stderr, "fashion_mnist: %s\n", ctx ? dt_last_error(ctx) : "out of memory");
        dt_ctx_free(ctx);
        return 0;
    }
    dt_dist_env env;
    dt_comm *comm = NULL;
    int ok = dt_dist_env_detect(ctx, &env) == DT_OK;
    if (!ok)
        fail(ctx, 0, "reading the launcher's environment");
    else if (o->save && !o->servers && dt_preempt_enable(ctx, NULL) != DT_OK)
        ok = fail(ctx, env.rank, "catching the pre-emption signals");
    else if (env.world_size > 1 && !(comm = dt_comm_new(ctx, &env, NULL)))
        ok = fail(ctx, env.rank, "joining the job");
    if (ok && (o->monitor || getenv("DTRAIN_MONITOR"))) {
        dt_monitor_config mc;
        dt_monitor_config_init(&mc);
        mc.listen = o->monitor;
        if (!(monitor = dt_monitor_new(ctx, comm, &mc)))
            ok = fail(ctx, comm ? dt_comm_rank(comm) : 0, "starting the monitor");
        else if (dt_monitor_port(monitor) >= 0)
            printf("monitor: http://127.0.0.1:%d/ (metrics at /metrics)\n", dt_monitor_port(monitor));
        fflush(stdout);
    }
    if (ok && o->servers && !comm)
        ok = fail(ctx, 0, "--servers needs a job of several ranks");
    else if (ok)
        ok = o->servers ? train_ps(o, ctx, comm) : train(o, ctx, comm);
    dt_monitor_free(monitor);
    monitor = NULL;
    dt_comm_free(comm);
    dt_ctx_free(ctx);
    return ok;
}

/* run_rank's 1 (done), 2 (pre-empted, saved) or 0 (failed) as the exit status */
static int exit_code(int ok)
{
    return ok == 1 ? 0 : ok == 2 ? DT_EXIT_PREEMPTED : 1;
}

int main(int argc, char **argv)
{
    options o;
    if (!parse_args(argc, argv, &o))
        return 2;
    if (o.ranks > 1 && !getenv("DTRAIN_RANK")) {
        /* fork the ranks here; rank 0's output goes straight to the
         * terminal so its progress bar works */
        dt_ctx *sup = dt_ctx_new(NULL);
        dt_spawn_config sc;
        dt_spawn_config_init(&sc);
        sc.nranks = o.ranks;
        sc.prefix_output = 0;
        int rank = -1;
        dt_status st = sup ? dt_spawn(sup, &sc, &rank) : DT_ENOMEM;
        if (st == DT_OK && rank >= 0) {   /* a worker */
            dt_ctx_free(sup);
            return exit_code(run_rank(&o));
        }
        if (st != DT_OK)
            fprintf(stderr, "fashion_mnist: %s\n", sup ? dt_last_error(sup) : "out of memory");
        dt_ctx_free(sup);
        return st == DT_OK ? 0 : st == DT_EPREEMPTED ? DT_EXIT_PREEMPTED : 1;
    }
    return exit_code(run_rank(&o));
}
