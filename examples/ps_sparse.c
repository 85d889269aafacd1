/*
 * examples/ps_sparse.c - a click-through model over hashed categorical
 * features, trained on parameter servers with sparse push/pull.
 *
 *   build/ps_sparse --ranks 3 --servers 1          (2 workers + 1 server)
 *   build/ps_sparse --ranks 4 --servers 2 --mode asp --prefetch
 *   build/ps_sparse --dump /tmp/clicks.bin         (write the data, for bench_sparse_torch.py)
 *
 * The data is generated: each sample has F = 8 categorical fields whose
 * values follow a skewed (cubic) law over 200,000 categories per field; a
 * value is hashed into one table of --rows rows (default 2^20).  A hidden
 * additive model of the categories decides the click probability.
 *
 * The model: the sample's 8 embedding rows (dim 16), concatenated, then
 * Linear(128, 64), ReLU, Linear(64, 2), cross-entropy.  The table lives
 * only on the servers (dt_ps_table); a worker pulls the distinct rows of
 * its batch into a small leaf tensor, runs the model on it, and pushes
 * that tensor's gradient rows back (dt_ps_sparse_push).  The dense layers
 * go through dt_ps_push_pull.  AdaGrad on the servers for both.
 *
 * Worker 0 prints; the last line is "test auc: 0.NNNN".
 */
#include "dtrain.h"
#include "args.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { FIELDS = 8, VOCAB = 200000, HIDDEN = 64 };

typedef struct options {
    int ranks, servers, staleness, batch, epochs, dim, prefetch;
    long long samples, test, rows;
    float lr;
    unsigned long long seed;
    const char *mode, *dump;
} options;

/* --- the data ---------------------------------------------------------------- */

static uint64_t mix(uint64_t x)   /* splitmix64's finalizer */
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static double unit(uint64_t h) { return (double)(h >> 11) * (1.0 / 9007199254740992.0); }

/* Sample i (train: i >= 0 from seed, test: its own stream): its hashed
 * feature ids and its label. */
static int sample_p(const options *o, int test, int64_t i, int64_t *ids, double *prob)
{
    uint64_t base = mix(o->seed * 1000003ull + (uint64_t)test * 0x5DEECE66Dull) + (uint64_t)i * FIELDS;
    double logit = -1.0;
    for (int f = 0; f < FIELDS; f++) {
        double u = unit(mix(base + (uint64_t)f));
        uint64_t cat = (uint64_t)(VOCAB * u * u * u);
        ids[f] = (int64_t)(mix((uint64_t)f << 40 | cat) % (uint64_t)o->rows);
        logit += 3.0 * (unit(mix(cat * 31 + (uint64_t)f + 77777)) - 0.5);
    }
    double p = 1.0 / (1.0 + exp(-logit));
    if (prob)
        *prob = p;
    return unit(mix(base ^ 0xC1C1C1C1ull)) < p;
}

static int sample(const options *o, int test, int64_t i, int64_t *ids)
{
    return sample_p(o, test, i, ids, NULL);
}

/* The data as bench_sparse_torch.py reads it: "DTCLICK1", int64 n_train,
 * n_test, fields, rows; then per split int32 ids (n x fields) and uint8
 * labels. */
static int dump(const options *o)
{
    FILE *f = fopen(o->dump, "wb");
    if (!f) {
        perror(o->dump);
        return 0;
    }
    int64_t head[4] = {o->samples, o->test, FIELDS, o->rows};
    int ok = fwrite("DTCLICK1", 8, 1, f) == 1 && fwrite(head, sizeof head, 1, f) == 1;
    for (int test = 0; ok && test < 2; test++) {
        int64_t n = test ? o->test : o->samples, ids[FIELDS];
        uint8_t *labels = malloc((size_t)n);
        ok = labels != NULL;
        for (int64_t i = 0; ok && i < n; i++) {
            labels[i] = (uint8_t)sample(o, test, i, ids);
            int32_t v[FIELDS];
            for (int k = 0; k < FIELDS; k++)
                v[k] = (int32_t)ids[k];
            ok = fwrite(v, sizeof v, 1, f) == 1;
        }
        ok = ok && fwrite(labels, 1, (size_t)n, f) == (size_t)n;
        free(labels);
    }
    ok = fclose(f) == 0 && ok;
    if (!ok)
        fprintf(stderr, "ps_sparse: writing %s failed\n", o->dump);
    return ok;
}

/* --- one batch ---------------------------------------------------------------- */

typedef struct batch {
    int64_t n;                 /* samples */
    int64_t *ids;              /* n x FIELDS hashed ids */
    int64_t *uniq, nuniq;      /* its distinct ids, sorted */
    int32_t *local;            /* n x FIELDS: each id's place in uniq */
    int32_t *labels;
    float *rows;               /* nuniq x dim: pulled rows, then their gradients */
    dt_work *pull;             /* the rows' pull, when in the background */
} batch;

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Samples [lo, lo + n) of a split, their distinct ids and local places. */
static void batch_fill(const options *o, batch *b, int test, int64_t lo, int64_t n)
{
    b->n = n;
    for (int64_t i = 0; i < n; i++)
        b->labels[i] = sample(o, test, lo + i, b->ids + i * FIELDS);
    memcpy(b->uniq, b->ids, sizeof(int64_t) * (size_t)(n * FIELDS));
    qsort(b->uniq, (size_t)(n * FIELDS), sizeof(int64_t), cmp_i64);
    b->nuniq = 0;
    for (int64_t i = 0; i < n * FIELDS; i++)
        if (i == 0 || b->uniq[i] != b->uniq[b->nuniq - 1])
            b->uniq[b->nuniq++] = b->uniq[i];
    for (int64_t i = 0; i < n * FIELDS; i++) {
        const int64_t *at = bsearch(&b->ids[i], b->uniq, (size_t)b->nuniq, sizeof(int64_t), cmp_i64);
        b->local[i] = (int32_t)(at - b->uniq);
    }
}

static int batch_alloc(batch *b, int64_t n, int dim)
{
    memset(b, 0, sizeof *b);
    b->ids = malloc(sizeof(int64_t) * (size_t)(n * FIELDS));
    b->uniq = malloc(sizeof(int64_t) * (size_t)(n * FIELDS));
    b->local = malloc(sizeof(int32_t) * (size_t)(n * FIELDS));
    b->labels = malloc(sizeof(int32_t) * (size_t)n);
    b->rows = malloc(sizeof(float) * (size_t)(n * FIELDS * dim));
    return b->ids && b->uniq && b->local && b->labels && b->rows;
}

static void batch_free(batch *b)
{
    if (b->pull)
        dt_work_wait(b->pull);
    free(b->ids);
    free(b->uniq);
    free(b->local);
    free(b->labels);
    free(b->rows);
}

/* --- the model ------------------------------------------------------------------ */

typedef struct model {
    dt_tensor *w1, *b1, *w2, *b2;
    dt_tensor *rows;           /* this step's embedding rows (a leaf with a gradient) */
} model;

static int model_build(dt_ctx *ctx, model *m, int dim)
{
    int64_t in = FIELDS * dim;
    m->rows = NULL;
    m->w1 = dt_param_new(ctx, "fc1.weight", 2, (int64_t[]){HIDDEN, in});
    m->b1 = dt_param_new(ctx, "fc1.bias", 1, (int64_t[]){HIDDEN});
    m->w2 = dt_param_new(ctx, "fc2.weight", 2, (int64_t[]){2, HIDDEN});
    m->b2 = dt_param_new(ctx, "fc2.bias", 1, (int64_t[]){2});
    return m->w1 && m->b1 && m->w2 && m->b2 && dt_tensor_init_kaiming_uniform(ctx, m->w1, sqrtf(5)) == DT_OK &&
           dt_tensor_init_bias(ctx, m->b1, in) == DT_OK && dt_tensor_init_kaiming_uniform(ctx, m->w2, sqrtf(5)) == DT_OK &&
           dt_tensor_init_bias(ctx, m->b2, HIDDEN) == DT_OK;
}

/* Logits (n, 2) of a batch whose rows are in b->rows. */
static dt_tensor *model_forward(dt_ctx *ctx, model *m, const batch *b, int dim, int grad)
{
    dt_tensor_free(m->rows);   /* a leaf with a gradient must be persistent: one per batch */
    m->rows = dt_tensor_new(ctx, DT_F32, 2, (int64_t[]){b->nuniq, dim});
    dt_tensor *idx = dt_tensor_temp(ctx, DT_I32, 2, (int64_t[]){b->n, FIELDS});
    if (!m->rows || !idx || dt_tensor_set(m->rows, b->rows, b->nuniq * dim) != DT_OK ||
        dt_tensor_set(idx, b->local, b->n * FIELDS) != DT_OK ||
        (grad && dt_tensor_set_requires_grad(m->rows, 1) != DT_OK))
        return NULL;
    dt_tensor *e = dt_reshape(ctx, dt_embedding(ctx, m->rows, idx), 2, (int64_t[]){b->n, FIELDS * dim});
    return dt_linear(ctx, dt_relu(ctx, dt_linear(ctx, e, m->w1, m->b1)), m->w2, m->b2);
}

/* --- training ---------------------------------------------------------------------- */

static int fail(dt_ctx *ctx, int rank, const char *what)
{
    fprintf(stderr, "ps_sparse: rank %d: %s: %s\n", rank, what, dt_last_error(ctx));
    return 0;
}

/* Start (or do) the pull of a batch's rows. */
static dt_status pull_rows(dt_ps *ps, batch *b, int background)
{
    if (background) {
        b->pull = dt_ps_sparse_pull_async(ps, 0, b->uniq, b->nuniq, b->rows);
        return b->pull ? DT_OK : DT_EPEER;
    }
    return dt_ps_sparse_pull(ps, 0, b->uniq, b->nuniq, b->rows);
}

static dt_status rows_ready(batch *b)
{
    dt_status s = b->pull ? dt_work_wait(b->pull) : DT_OK;
    b->pull = NULL;
    return s;
}

typedef struct pred {
    float p;
    int y;
} pred;

static int cmp_pred(const void *a, const void *b)
{
    float x = ((const pred *)a)->p, y = ((const pred *)b)->p;
    return (x > y) - (x < y);
}

/* The area under the ROC curve of n predictions (rank-sum; ties share
 * their mean rank); sorts pr. */
static double auc(pred *pr, int64_t n)
{
    qsort(pr, (size_t)n, sizeof *pr, cmp_pred);
    double pos = 0, rank_sum = 0;
    for (int64_t i = 0; i < n;) {
        int64_t j = i;
        while (j < n && pr[j].p == pr[i].p)
            j++;
        for (int64_t k = i; k < j; k++)
            if (pr[k].y) {
                pos++;
                rank_sum += (double)(i + j + 1) / 2.0;
            }
        i = j;
    }
    double neg = (double)n - pos;
    return pos > 0 && neg > 0 ? (rank_sum - pos * (pos + 1) / 2) / (pos * neg) : 0.5;
}

/* Test log loss, accuracy and AUC (rank-sum), worker-local; out[3]: the
 * AUC of the hidden model that made the labels (the most any model can
 * reach on them). */
static int evaluate(const options *o, dt_ctx *ctx, dt_ps *ps, model *m, batch *b, double *out)
{
    pred *pr = malloc(sizeof *pr * (size_t)o->test);
    double loss = 0;
    int64_t correct = 0;
    if (!pr)
        return 0;
    for (int64_t lo = 0; lo < o->test; lo += o->batch) {
        int64_t n = o->test - lo < o->batch ? o->test - lo : o->batch;
        batch_fill(o, b, 1, lo, n);
        if (pull_rows(ps, b, 0) != DT_OK) {
            free(pr);
            return 0;
        }
        dt_tensor *logits = model_forward(ctx, m, b, o->dim, 0);
        float lg[2 * 4096];
        if (!logits || n > 4096 || dt_tensor_get(logits, lg, 2 * n) != DT_OK) {
            free(pr);
            return 0;
        }
        for (int64_t i = 0; i < n; i++) {
            double z = (double)lg[2 * i + 1] - lg[2 * i], p = 1.0 / (1.0 + exp(-z));
            int y = b->labels[i];
            loss -= log(y ? fmax(p, 1e-12) : fmax(1 - p, 1e-12));
            correct += (p > 0.5) == y;
            pr[lo + i] = (pred){(float)p, y};
        }
        dt_ctx_step_reset(ctx);
    }
    out[0] = loss / (double)o->test;
    out[1] = (double)correct / (double)o->test;
    out[2] = auc(pr, o->test);
    for (int64_t i = 0; i < o->test; i++) {   /* the hidden model's own probabilities */
        double p;
        int64_t ids[FIELDS];
        pr[i].y = sample_p(o, 1, i, ids, &p);
        pr[i].p = (float)p;
    }
    out[3] = auc(pr, o->test);
    free(pr);
    return 1;
}

static int train_worker(const options *o, dt_ctx *ctx, dt_ps *ps, model *m, int rank)
{
    int W = dt_ps_workers(ps), ok = 0;
    batch cur, next;
    if (!batch_alloc(&cur, o->batch, o->dim) || !batch_alloc(&next, o->batch, o->dim)) {
        fprintf(stderr, "ps_sparse: out of memory\n");
        goto out;
    }
    /* worker w trains on samples [w N / W, (w + 1) N / W), in batches */
    int64_t lo = o->samples * rank / W, hi = o->samples * (rank + 1) / W;
    int64_t per_epoch = (hi - lo + o->batch - 1) / o->batch, steps = per_epoch * o->epochs;
    double t0 = dt_now(), loss_sum = 0;
    int64_t seen = 0;
    float *grads = malloc(sizeof(float) * (size_t)(o->batch * FIELDS * o->dim));
    if (!grads)
        goto out;
    batch_fill(o, &cur, 0, lo, lo + o->batch < hi ? o->batch : hi - lo);
    if (pull_rows(ps, &cur, o->prefetch) != DT_OK)
        goto fail_ctx;
    for (int64_t s = 0; s < steps; s++) {
        int64_t at = lo + ((s + 1) % per_epoch) * o->batch;
        int have_next = s + 1 < steps;
        if (have_next)   /* the next batch's ids, and (prefetch) its rows on their way */
            batch_fill(o, &next, 0, at, at + o->batch < hi ? o->batch : hi - at);
        if (rows_ready(&cur) != DT_OK || (have_next && o->prefetch && pull_rows(ps, &next, 1) != DT_OK))
            goto fail_ctx;
        dt_tensor *labels = dt_tensor_temp(ctx, DT_I32, 1, (int64_t[]){cur.n});
        dt_tensor *logits = model_forward(ctx, m, &cur, o->dim, 1);
        if (!labels || dt_tensor_set(labels, cur.labels, cur.n) != DT_OK || !logits)
            goto fail_ctx;
        dt_tensor *loss = dt_cross_entropy(ctx, logits, labels);
        if (!loss || dt_backward(ctx, loss) != DT_OK ||
            dt_tensor_get(dt_tensor_grad(m->rows), grads, cur.nuniq * o->dim) != DT_OK ||
            dt_ps_sparse_push(ps, 0, cur.uniq, cur.nuniq, grads) != DT_OK ||
            dt_ps_push_pull(ps) != DT_OK)
            goto fail_ctx;
        loss_sum += dt_tensor_item(loss);
        seen += cur.n;
        dt_ctx_zero_grad(ctx);
        dt_ctx_step_reset(ctx);
        if (have_next && !o->prefetch && pull_rows(ps, &next, 0) != DT_OK)
            goto fail_ctx;
        batch t = cur;
        cur = next;
        next = t;
        if (rank == 0 && (s + 1) % per_epoch == 0)
            printf("epoch %lld: train loss %.4f, %.0f samples/s on this worker\n",
                   (long long)((s + 1) / per_epoch), loss_sum / (double)(s + 1),
                   (double)seen / (dt_now() - t0));
    }
    double secs = dt_now() - t0;
    dt_ps_stats st;
    dt_ps_stats_get(ps, &st);
    if (rank == 0) {
        printf("trained %lld samples in %.2f s: %.0f samples/s on this worker (x %d workers); "
               "%.1f rows pulled and %.1f pushed per step, pull wait %.2f s\n",
               (long long)seen, secs, (double)seen / secs, W, (double)st.rows_pulled / (double)steps,
               (double)st.rows_pushed / (double)steps, st.wait_s);
        double r[4];
        if (!evaluate(o, ctx, ps, m, &cur, r))
            goto fail_ctx;
        printf("test log loss %.4f, accuracy %.2f%%; the hidden model's own auc: %.4f\n", r[0],
               100 * r[1], r[3]);
        printf("test auc: %.4f\n", r[2]);
    }
    ok = dt_ps_finish(ps) == DT_OK;
    if (!ok)
        fail(ctx, rank, "finishing");
    free(grads);
    goto out;
fail_ctx:
    free(grads);
    fail(ctx, rank, "training");
out:
    batch_free(&cur);
    batch_free(&next);
    return ok;
}

static int run_rank(const options *o)
{
    dt_ctx_config cfg;
    dt_ctx_config_init(&cfg);
    cfg.seed = o->seed;
    dt_ctx *ctx = dt_ctx_new(&cfg);
    dt_dist_env env;
    dt_comm *comm = NULL;
    dt_ps *ps = NULL;
    model m;
    int ok = ctx && dt_ctx_status(ctx) == DT_OK && dt_dist_env_detect(ctx, &env) == DT_OK;
    if (ok && env.world_size < 2) {
        fprintf(stderr, "ps_sparse: needs at least 2 ranks (--ranks, or a launcher)\n");
        ok = 0;
    }
    if (ok && !(comm = dt_comm_new(ctx, &env, NULL)))
        ok = fail(ctx, env.rank, "joining the job");
    int W = ok ? env.world_size - o->servers : 0;
    if (ok && env.rank < W && !model_build(ctx, &m, o->dim))
        ok = fail(ctx, env.rank, "building the model");
    if (ok) {
        dt_ps_table tb = {.name = "features", .rows = o->rows, .dim = o->dim, .init_scale = 0.05f,
                          .seed = o->seed};
        dt_ps_config pc;
        dt_ps_config_init(&pc);
        pc.servers = o->servers;
        pc.mode = !strcmp(o->mode, "asp") ? DT_PS_ASP : !strcmp(o->mode, "ssp") ? DT_PS_SSP : DT_PS_BSP;
        pc.staleness = o->staleness;
        pc.prefetch = o->prefetch;
        dt_optim_config_init(&pc.optim, DT_ADAGRAD);
        pc.optim.lr = o->lr;
        pc.tables = &tb;
        pc.ntables = 1;
        if (!(ps = dt_ps_new(ctx, comm, &pc)))
            ok = fail(ctx, env.rank, "joining the parameter servers");
    }
    if (ok && env.rank == 0)
        printf("%d workers, %d servers (%s%s), table %lld x %d, batch %d, %lld samples x %d epochs\n",
               W, o->servers, o->mode, o->prefetch ? ", prefetch" : "", o->rows, o->dim, o->batch,
               o->samples, o->epochs);
    if (ok && dt_ps_is_server(ps)) {
        if (dt_ps_serve(ps) != DT_OK)
            ok = fail(ctx, env.rank, "serving");
    } else if (ok) {
        ok = train_worker(o, ctx, ps, &m, env.rank);
        dt_tensor_free(m.rows);
    }
    dt_ps_free(ps);
    if (comm && ok && dt_comm_barrier(comm) != DT_OK)   /* rank 0 hosts the store: leave together */
        ok = fail(ctx, env.rank, "leaving");
    dt_comm_free(comm);
    dt_ctx_free(ctx);
    return ok;
}

/* --- command line -------------------------------------------------------------------- */

static void usage(FILE *f)
{
    fprintf(f, "usage: ps_sparse [options]\n"
               "  --ranks N          local processes (default 3); under a launcher, its world\n"
               "  --servers N        of which servers (default 1); the rest are workers\n"
               "  --mode bsp|asp|ssp consistency (default bsp); --staleness S for ssp (default 2)\n"
               "  --prefetch         pull the next batch's rows and parameters in the background\n"
               "  --samples N        training samples (default 1000000); --test N (default 100000)\n"
               "  --rows N           embedding table rows (default 1048576); --dim N (default 16)\n"
               "  --batch N          samples per step per worker (default 512); --epochs N (1)\n"
               "  --lr X             AdaGrad learning rate (default 0.05); --seed N (default 1)\n"
               "  --dump FILE        write the data set for bench_sparse_torch.py and exit\n"
               "  --help             this text\n");
}

static int parse_args(int argc, char **argv, options *o)
{
    *o = (options){.ranks = 3, .servers = 1, .staleness = 2, .batch = 512, .epochs = 1, .dim = 16,
                   .samples = 1000000, .test = 100000, .rows = 1 << 20, .lr = 0.05f, .seed = 1,
                   .mode = "bsp"};
    const args_opt opts[] = {
        ARG_INT("ranks", &o->ranks, 2, 4096),
        ARG_INT("servers", &o->servers, 1, 4095),
        ARG_CHOICE("mode", &o->mode, "bsp|asp|ssp"),
        ARG_INT("staleness", &o->staleness, 0, 1 << 20),
        ARG_FLAG("prefetch", &o->prefetch),
        ARG_LLONG("samples", &o->samples, 1, 1e12),
        ARG_LLONG("test", &o->test, 1, 1e9),
        ARG_LLONG("rows", &o->rows, 1, INT32_MAX - 1),
        ARG_INT("dim", &o->dim, 1, 256),
        ARG_INT("batch", &o->batch, 1, 4096),
        ARG_INT("epochs", &o->epochs, 1, 1000000),
        ARG_RATE("lr", &o->lr, 1000),
        ARG_U64("seed", &o->seed),
        ARG_STR("dump", &o->dump),
    };
    return args_parse("ps_sparse", argc, argv, opts, sizeof opts / sizeof opts[0],
                      ARGS_NO_OPERANDS, usage) >= 0;
}

int main(int argc, char **argv)
{
    options o;
    if (!parse_args(argc, argv, &o))
        return 2;
    if (o.dump)
        return dump(&o) ? 0 : 1;
    if (!getenv("DTRAIN_RANK")) {   /* fork the ranks here */
        dt_ctx *sup = dt_ctx_new(NULL);
        dt_spawn_config sc;
        dt_spawn_config_init(&sc);
        sc.nranks = o.ranks;
        sc.prefix_output = 0;
        int rank = -1;
        dt_status st = sup ? dt_spawn(sup, &sc, &rank) : DT_ENOMEM;
        if (st == DT_OK && rank >= 0) {
            dt_ctx_free(sup);
            return run_rank(&o) ? 0 : 1;
        }
        if (st != DT_OK)
            fprintf(stderr, "ps_sparse: %s\n", sup ? dt_last_error(sup) : "out of memory");
        dt_ctx_free(sup);
        return st == DT_OK ? 0 : 1;
    }
    return run_rank(&o) ? 0 : 1;
}
