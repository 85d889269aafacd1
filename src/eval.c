#include "dist.h"

/* ===========================================================================
 * Evaluation and inference over a dataset (dt_evaluate, dt_predict): alone,
 * or sharded over a communicator's ranks with the results combined.
 * ======================================================================== */

/* The evaluation's own types: nothing outside this file sees them. */

typedef struct eval_sums {
    double samples, correct, loss;
    double sum, count;         /* the metric's (LOSS, USER) */
    const dt_eval_config *cfg;
} eval_sums;

typedef struct predict_acc {
    float *local;              /* this rank's predictions, in its sample order */
} predict_acc;

void dt_eval_config_init(dt_eval_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->struct_size = sizeof *cfg;
    cfg->batch = 128;   /* as training's: 1000 took the CNN example's peak RSS to 491 MB, 128 to 118 */
    cfg->std = 1.0f;
}

/* The part of ds this rank evaluates: samples rank, rank + P, ..., each
 * sample on exactly one rank; in order, never shuffled. */
static dt_loader *eval_loader(dt_ctx *ctx, dt_comm *c, const dt_dataset *ds,
                              const dt_eval_config *cfg)
{
    dt_loader_config lc;
    dt_loader_config_init(&lc);
    lc.batch = cfg->batch > 0 ? cfg->batch : 128;
    lc.shuffle = 0;
    lc.mean = cfg->mean;
    lc.std = cfg->std;
    lc.shard_rank = c ? dt_comm_rank(c) : 0;
    lc.shard_count = c ? dt_comm_size(c) : 1;
    lc.shard_no_pad = 1;
    return dt_loader_new(ctx, ds, &lc);
}

static dt_status eval_loss(dt_ctx *ctx, dt_tensor *out, dt_tensor *y, int64_t first, void *acc);
static dt_status eval_user(dt_ctx *ctx, dt_tensor *out, dt_tensor *y, int64_t first, void *acc);

static dt_status eval_run(dt_ctx *ctx, dt_comm *c, const dt_dataset *ds, const dt_eval_config *cfg,
                          dt_forward_fn forward, void *user, eval_visit visit, void *acc)
{
    dt_eval_config defaults;
    dt_eval_config_init(&defaults);
    if (cfg && ctx_config_in(ctx, &defaults, sizeof defaults, cfg,
                             "evaluate", "dt_eval_config") != DT_OK)
        return ctx->last_status;
    cfg = &defaults;
    if (!ds || !forward)
        return set_error(ctx, DT_EINVAL, "evaluate: dataset and forward function are required");
    if (!(cfg->std > 0))
        return set_error(ctx, DT_EINVAL, "evaluate: std must be > 0, got %g", (double)cfg->std);
    int need_2d = visit != eval_loss && visit != eval_user;   /* classes: argmax, accuracy */
    /* evaluation batches may be larger than training's: the step arenas go
     * back to their size afterwards (arena_shrink) */
    size_t cap_dev = 0, cap_host = 0;
    ctx_step_arena_capacity(ctx, &cap_dev, &cap_host);
    dt_loader *ld = eval_loader(ctx, c, ds, cfg);
    if (!ld)
        return ctx->last_status;
    int grad = dt_ctx_grad_enabled(ctx), training = dt_ctx_training(ctx);
    dt_ctx_set_grad_enabled(ctx, 0);
    dt_ctx_set_training(ctx, 0);
    dt_status s;
    int64_t first = 0;
    dt_tensor *x, *y;
    while ((s = dt_loader_next(ld, &x, &y)) == DT_OK) {
        dt_tensor *logits = forward(ctx, x, user);
        char sb[96];
        if (!logits)
            s = ctx->last_status != DT_OK ? ctx->last_status
                                          : set_error(ctx, DT_EINVAL, "evaluate: forward returned NULL");
        else if (need_2d && (logits->ndim != 2 || logits->shape[0] != y->shape[0] ||
                             logits->dtype != DT_F32))
            s = set_error(ctx, DT_EINVAL, "evaluate: forward must return (%lld, classes) f32 "
                          "logits, got %s", (long long)y->shape[0], SHAPE(logits, sb));
        else if (!(logits = dt_contiguous(ctx, logits)))
            s = ctx->last_status;
        else
            s = visit(ctx, logits, y, first, acc);
        first += y->shape[0];
        dt_ctx_step_reset(ctx);
        if (s != DT_OK)
            break;
    }
    dt_ctx_set_grad_enabled(ctx, grad);
    dt_ctx_set_training(ctx, training);
    dt_loader_free(ld);
    ctx_shrink_step_arenas(ctx, cap_dev, cap_host);
    return s == DT_EOF ? DT_OK : s;
}

static dt_status eval_metrics(dt_ctx *ctx, dt_tensor *logits, dt_tensor *y, int64_t first, void *acc)
{
    (void)first;
    eval_sums *e = acc;
    int64_t correct = 0;
    dt_tensor *loss = dt_cross_entropy(ctx, logits, y);
    if (!loss || dt_count_correct(ctx, logits, y, &correct) != DT_OK)
        return ctx->last_status;
    e->samples += (double)y->shape[0];
    e->correct += (double)correct;
    e->loss += (double)dt_tensor_item(loss) * (double)y->shape[0];
    return DT_OK;
}

/* DT_METRIC_LOSS: the batch's mean loss times its target elements (those
 * not ignored) */
static dt_status eval_loss(dt_ctx *ctx, dt_tensor *out, dt_tensor *y, int64_t first, void *acc)
{
    (void)first;
    eval_sums *e = acc;
    int64_t n = dt_tensor_numel(y), kept = n;
    dt_tensor *loss;
    if (y->dtype == DT_I32) {
        int32_t *h = host_alloc(ctx, sizeof *h * (size_t)(n ? n : 1));
        if (!h)
            return set_error(ctx, DT_ENOMEM, "evaluate: out of memory");
        dt_status s = dt_tensor_get(y, h, n);
        for (int64_t i = 0; s == DT_OK && i < n; i++)
            kept -= h[i] == -100;
        host_free(ctx, h);
        if (s != DT_OK)
            return s;
        loss = dt_cross_entropy_ignore(ctx, out, y, -100);
    } else {
        loss = dt_mse(ctx, out, y);
    }
    if (!loss)
        return ctx->last_status;
    if (kept > 0)
        e->sum += (double)dt_tensor_item(loss) * (double)kept;
    e->count += (double)kept;
    e->samples += (double)y->shape[0];
    return DT_OK;
}

static dt_status eval_user(dt_ctx *ctx, dt_tensor *out, dt_tensor *y, int64_t first, void *acc)
{
    (void)first;
    eval_sums *e = acc;
    e->samples += (double)y->shape[0];
    dt_status s = e->cfg->metric_fn(ctx, out, y, e->cfg->metric_user, &e->sum, &e->count);
    return s == DT_OK ? DT_OK : ctx->last_status != DT_OK ? ctx->last_status
                      : set_error(ctx, s, "evaluate: the metric function returned %d", (int)s);
}

/* Counts travel as two floats, n / 4096 and n % 4096, so their sums stay
 * exact far beyond float's 2^24. */
static int64_t count_join(const float *hl) { return (int64_t)hl[0] * 4096 + (int64_t)hl[1]; }

static dt_status eval_evaluate_run(dt_ctx *ctx, dt_comm *c, const dt_dataset *ds, const dt_eval_config *cfg,
                      dt_forward_fn forward, void *user, dt_metrics *out)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (c && comm_ctx(c) != ctx)
        return set_error(ctx, DT_EINVAL, "evaluate: the communicator belongs to another context");
    dt_eval_config defaults;
    dt_eval_config_init(&defaults);
    dt_status s = cfg ? ctx_config_in(ctx, &defaults, sizeof defaults, cfg,
                                      "evaluate", "dt_eval_config")
                      : DT_OK;
    const dt_eval_config *ec = &defaults;
    eval_sums e = {0, 0, 0, 0, 0, ec};
    eval_visit visit = ec->metric == DT_METRIC_LOSS ? eval_loss
                       : ec->metric == DT_METRIC_USER ? eval_user : eval_metrics;
    if (s != DT_OK)
        ;   /* (said; it still joins the sum below) */
    else if (!out)
        s = set_error(ctx, DT_EINVAL, "evaluate: output is NULL");
    else if ((unsigned)ec->metric > DT_METRIC_USER || (ec->metric == DT_METRIC_USER && !ec->metric_fn))
        s = set_error(ctx, DT_EINVAL, "evaluate: metric %d unknown, or USER without metric_fn",
                      (int)ec->metric);
    else
        s = eval_run(ctx, c, ds, ec, forward, user, visit, &e);
    /* every rank joins the sum even after a local failure (the last float
     * counts failures), so a bad rank cannot leave the others waiting */
    int64_t n = (int64_t)e.samples, k = (int64_t)e.correct, m = (int64_t)e.count;
    float sums[9] = {(float)(n / 4096), (float)(n % 4096), (float)(k / 4096), (float)(k % 4096),
                     (float)e.loss, (float)e.sum, (float)(m / 4096), (float)(m % 4096),
                     s == DT_OK ? 0.0f : 1.0f};
    if (c) {
        dt_status cs = dt_comm_allreduce(c, sums, 9, DT_REDUCE_SUM);
        if (cs != DT_OK)
            return cs;
    }
    if (s != DT_OK)
        return s;
    if (sums[8] > 0)
        return set_error(ctx, DT_EPEER, "evaluate: %.0f other rank(s) failed to evaluate their "
                         "part", (double)sums[8]);
    double count = c ? (double)count_join(sums + 6) : e.count, sum = c ? (double)sums[5] : e.sum;
    out->samples = count_join(sums);
    out->correct = count_join(sums + 2);
    out->accuracy = out->samples > 0 ? (double)out->correct / (double)out->samples : 0;
    out->loss = out->samples > 0 ? (double)sums[4] / (double)out->samples : 0;
    if (ec->metric == DT_METRIC_CLASSIFY)
        out->value = out->accuracy;
    else
        out->value = out->loss = count > 0 ? sum / count : NAN;
    if (ec->metric == DT_METRIC_USER)
        out->loss = 0;
    return DT_OK;
}

/* (what peers waiting on this rank see: dt_ctx_activity) */
dt_status dt_evaluate(dt_ctx *ctx, dt_comm *c, const dt_dataset *ds, const dt_eval_config *cfg,
                      dt_forward_fn forward, void *user, dt_metrics *out)
{
    dt_ctx *actx = ctx_ok(ctx) ? ctx : NULL;
    int act = ctx_doing(actx, ACT_EVAL);
    dt_status s = eval_evaluate_run(ctx, c, ds, cfg, forward, user, out);
    ctx_done(actx, act);
    return s;
}

static dt_status eval_argmax(dt_ctx *ctx, dt_tensor *logits, dt_tensor *y, int64_t first, void *acc)
{
    predict_acc *p = acc;
    int64_t b = logits->shape[0], k = logits->shape[1];
    float *host = host_alloc(ctx, sizeof(float) * (size_t)(b * k));
    if (!host)
        return set_error(ctx, DT_ENOMEM, "predict: out of memory");
    (void)y;
    dt_status s = dt_tensor_get(logits, host, b * k);
    for (int64_t i = 0; s == DT_OK && i < b; i++) {
        int64_t best = 0;
        for (int64_t j = 1; j < k; j++)
            if (host[i * k + j] > host[i * k + best])
                best = j;
        p->local[first + i] = (float)best;
    }
    host_free(ctx, host);
    return s;
}

dt_status dt_predict(dt_ctx *ctx, dt_comm *c, const dt_dataset *ds, const dt_eval_config *cfg,
                     dt_forward_fn forward, void *user, int32_t *pred)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (c && comm_ctx(c) != ctx)
        return set_error(ctx, DT_EINVAL, "predict: the communicator belongs to another context");
    int P = c ? dt_comm_size(c) : 1, r = c ? dt_comm_rank(c) : 0;
    int64_t n = dt_dataset_size(ds), per = (n + P - 1) / P;
    /* per floats for each rank's predictions, then one for its status */
    float *mine = host_alloc(ctx, sizeof(float) * (size_t)(per + 1));
    float *all = host_alloc(ctx, sizeof(float) * (size_t)(per + 1) * (size_t)P);
    if (!mine || !all) {
        host_free(ctx, mine);
        host_free(ctx, all);
        return set_error(ctx, DT_ENOMEM, "predict: out of memory for %lld predictions", (long long)n);
    }
    for (int64_t i = 0; i <= per; i++)
        mine[i] = -1.0f;
    predict_acc acc = {mine};
    /* a missing output still joins the gather, so no rank waits */
    dt_status s = r == 0 && !pred ? set_error(ctx, DT_EINVAL, "predict: rank 0 needs an output array")
                                  : eval_run(ctx, c, ds, cfg, forward, user, eval_argmax, &acc);
    mine[per] = s == DT_OK ? 0.0f : 1.0f;
    dt_status cs = c ? dt_comm_allgather(c, mine, per + 1, all) : DT_OK;
    if (!c)
        memcpy(all, mine, sizeof(float) * (size_t)(per + 1));
    int failed = 0;
    for (int q = 0; cs == DT_OK && q < P; q++)
        failed += all[(size_t)q * (size_t)(per + 1) + (size_t)per] > 0;
    if (cs == DT_OK && s == DT_OK && failed == 0 && r == 0)
        for (int64_t i = 0; i < n; i++)   /* sample i was rank i % P's (i / P)-th */
            pred[i] = (int32_t)all[(size_t)(i % P) * (size_t)(per + 1) + (size_t)(i / P)];
    host_free(ctx, mine);
    host_free(ctx, all);
    if (cs != DT_OK || s != DT_OK)
        return cs != DT_OK ? cs : s;
    if (failed)
        return set_error(ctx, DT_EPEER, "predict: %d other rank(s) failed to predict their part",
                         failed);
    return DT_OK;
}
