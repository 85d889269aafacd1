#include "dist.h"

/* ===========================================================================
 * In-process data parallelism (replicas on threads)
 *
 * K replica contexts, each driven by its own thread (the caller drives
 * replica 0).  A step runs in three phases separated by barriers, so no
 * thread ever touches another replica's context while that one computes:
 *   1. each replica: zero its gradients, forward and backward on its rows;
 *   2. each replica: average slice k of the (flat) gradients straight from
 *      every replica's memory, in replica order; replica 0 also notes which
 *      parameters any replica used;
 *   3. each replica: copy the average into its gradients, optimizer step.
 * A replica that fails in phase 1 is seen by all after the barrier, and all
 * skip phases 2 and 3 together.
 * ======================================================================== */

/* --- src/replicas.c --- */

struct dt_dp {
    dt_ctx *ctx;               /* the caller's: errors */
    int K;
    dt_ctx **rc;               /* replica contexts */
    void **model;
    dt_optim **opt;
    dt_dp_loss_fn loss;
    dt_dp_free_fn free_model;
    void *user;
    pthread_t *thread;
    struct dp_arg { struct dt_dp *dp; int k; } *args;   /* each worker's */
    int threads_started, stop;
    pthread_barrier_t bar;
    int has_bar;
    pthread_mutex_t mu;        /* start-up: workers wait for go (1) or abort (-1) */
    pthread_cond_t cv;
    int go, has_mu;
    /* the step's inputs, staged on the host */
    float *xh;
    int32_t *yh;
    size_t x_cap;
    int64_t B, feat, xshape[DT_MAX_DIMS];
    int xndim;
    /* the flat gradient: parameter p at poff[p], G floats in all */
    int np;
    int64_t *poff, G;
    float *avg;
    unsigned char *used;
    float *losses;
    dt_status *status;
    char (*msg)[DT_MAX_ERROR];
};

void dt_dp_config_init(dt_dp_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->struct_size = sizeof *cfg;
    cfg->replicas = 2;
    dt_ctx_config_init(&cfg->replica);
    dt_optim_config_init(&cfg->optim, DT_SGD);
}

static int64_t dp_row(const dt_dp *dp, int k) { return dp->B * k / dp->K; }

/* Phase 1 on replica k: its rows, forward and backward. */
static dt_status dp_compute(dt_dp *dp, int k)
{
    dt_ctx *c = dp->rc[k];
    dt_ctx_zero_grad(c);
    dp->losses[k] = 0;
    int64_t r0 = dp_row(dp, k), n = dp_row(dp, k + 1) - r0;
    if (n == 0)
        return DT_OK;   /* more replicas than rows: this one sits the step out */
    int64_t shape[DT_MAX_DIMS];
    memcpy(shape, dp->xshape, sizeof shape);
    shape[0] = n;
    dt_tensor *x = dt_tensor_temp(c, DT_F32, dp->xndim, shape);
    dt_tensor *y = dt_tensor_temp(c, DT_I32, 1, &n);
    if (!x || !y || dt_tensor_set(x, dp->xh + r0 * dp->feat, n * dp->feat) != DT_OK ||
        dt_tensor_set(y, dp->yh + r0, n) != DT_OK)
        return c->last_status;
    dt_tensor *loss = dp->loss(c, dp->model[k], x, y, dp->user);
    if (!loss)
        return c->last_status != DT_OK ? c->last_status
                                       : set_error(c, DT_EINVAL, "dp_step: the loss function "
                                                   "returned NULL on replica %d", k);
    dt_status s = dt_backward(c, loss);
    if (s == DT_OK)
        dp->losses[k] = dt_tensor_item(loss) * (float)n / (float)dp->B;
    return s;
}

/* Phase 2 on replica k: slice k of the averaged gradients. */
static void dp_reduce(dt_dp *dp, int k)
{
    int64_t lo = dp->G * k / dp->K, hi = dp->G * (k + 1) / dp->K;
    for (int p = 0; p < dp->np; p++) {
        int64_t a = dp->poff[p], e = dp->poff[p + 1];
        a = a > lo ? a : lo;
        e = e < hi ? e : hi;
        if (e <= a)
            continue;
        float *out = dp->avg + a;
        memset(out, 0, (size_t)(e - a) * sizeof(float));
        for (int r = 0; r < dp->K; r++) {
            const dt_tensor *g = dp->rc[r]->params[p]->grad;
            int64_t rows = dp_row(dp, r + 1) - dp_row(dp, r);
            if ((g->flags & T_ZERO) || rows == 0)
                continue;
            float w = (float)rows / (float)dp->B;
            const float *src = (const float *)g->data + (a - dp->poff[p]);
            for (int64_t i = 0; i < e - a; i++)
                out[i] += w * src[i];
        }
    }
    if (k == 0)
        for (int p = 0; p < dp->np; p++) {
            dp->used[p] = 0;
            for (int r = 0; r < dp->K; r++)
                dp->used[p] |= !(dp->rc[r]->params[p]->grad->flags & T_ZERO);
        }
}

/* Phase 3 on replica k: take the average, step. */
static dt_status dp_apply(dt_dp *dp, int k)
{
    dt_ctx *c = dp->rc[k];
    for (int p = 0; p < dp->np; p++) {
        dt_tensor *g = c->params[p]->grad;
        if (!dp->used[p]) {
            tensor_mark_zero(g, 1);
            continue;
        }
        c->be_iface->copy(c->be, g->data, dp->avg + dp->poff[p],
                          (size_t)(dp->poff[p + 1] - dp->poff[p]) * sizeof(float));
        tensor_mark_zero(g, 0);
    }
    dt_status s = dt_optim_step(dp->opt[k]);
    dt_ctx_step_reset(c);
    return s;
}

/* Replica k's whole step; every replica passes the same barriers. */
static void dp_replica_step(dt_dp *dp, int k)
{
    dt_status s = dp_compute(dp, k);
    dp->status[k] = s;
    if (s != DT_OK)
        snprintf(dp->msg[k], DT_MAX_ERROR, "%s", dp->rc[k]->err);
    if (dp->K > 1)
        pthread_barrier_wait(&dp->bar);
    int failed = 0;
    for (int r = 0; r < dp->K; r++)
        failed |= dp->status[r] != DT_OK;
    if (!failed)
        dp_reduce(dp, k);
    if (dp->K > 1)
        pthread_barrier_wait(&dp->bar);
    if (failed) {
        dt_ctx_step_reset(dp->rc[k]);
        return;
    }
    s = dp_apply(dp, k);
    if (s != DT_OK) {
        dp->status[k] = s;
        snprintf(dp->msg[k], DT_MAX_ERROR, "%s", dp->rc[k]->err);
    }
}

static void *dp_worker(void *arg)
{
    dt_dp *dp = ((struct dp_arg *)arg)->dp;
    int k = ((struct dp_arg *)arg)->k;
    pthread_mutex_lock(&dp->mu);
    while (dp->go == 0)
        pthread_cond_wait(&dp->cv, &dp->mu);
    int go = dp->go;
    pthread_mutex_unlock(&dp->mu);
    if (go < 0)
        return NULL;   /* start-up failed */
    for (;;) {
        pthread_barrier_wait(&dp->bar);   /* a step (or stop) was posted */
        if (dp->stop)
            return NULL;
        dp_replica_step(dp, k);
        pthread_barrier_wait(&dp->bar);   /* the step is over */
    }
}

dt_status dt_dp_step(dt_dp *dp, const dt_tensor *x, const dt_tensor *y, float *loss_out)
{
    if (!dp)
        return DT_EINVAL;
    dt_ctx *ctx = dp->ctx;
    char s1[96], s2[96];
    if (!x || !y || x->dtype != DT_F32 || y->dtype != DT_I32 || x->ndim < 1 || y->ndim != 1 ||
        x->shape[0] != y->shape[0] || x->shape[0] < 1)
        return set_error(ctx, DT_EINVAL, "dp_step: need x (B, ...) f32 and y (B) i32 with B >= 1, "
                         "got %s and %s", x ? SHAPE(x, s1) : "NULL", y ? SHAPE(y, s2) : "NULL");
    int64_t B = x->shape[0], feat = shape_numel(x->ndim, x->shape) / B;
    size_t need = (size_t)(B * feat) * sizeof(float) + (size_t)B * sizeof(int32_t);
    if (need > dp->x_cap) {
        float *nx = ctx->al.realloc_fn(dp->xh, need, ctx->al.user);
        if (!nx)
            return set_error(ctx, DT_ENOMEM, "dp_step: out of memory for the batch");
        dp->xh = nx;
        dp->x_cap = need;
    }
    dp->yh = (int32_t *)(dp->xh + B * feat);
    dt_status s = dt_tensor_get(x, dp->xh, B * feat);
    if (s == DT_OK)
        s = dt_tensor_get(y, dp->yh, B);
    if (s != DT_OK)
        return s;
    dp->B = B;
    dp->feat = feat;
    dp->xndim = x->ndim;
    memcpy(dp->xshape, x->shape, sizeof dp->xshape);
    if (dp->K > 1)
        pthread_barrier_wait(&dp->bar);   /* start the workers */
    dp_replica_step(dp, 0);
    if (dp->K > 1)
        pthread_barrier_wait(&dp->bar);   /* wait for them */
    float loss = 0;
    for (int k = 0; k < dp->K; k++) {
        if (dp->status[k] != DT_OK)
            return set_error(ctx, dp->status[k], "dp_step: replica %d: %s", k, dp->msg[k]);
        loss += dp->losses[k];
    }
    if (loss_out)
        *loss_out = loss;
    return DT_OK;
}

int dt_dp_replicas(const dt_dp *dp) { return dp ? dp->K : 0; }
dt_ctx *dt_dp_replica(const dt_dp *dp, int k) { return dp && k >= 0 && k < dp->K ? dp->rc[k] : NULL; }
void *dt_dp_model(const dt_dp *dp, int k) { return dp && k >= 0 && k < dp->K ? dp->model[k] : NULL; }

void dt_dp_free(dt_dp *dp)
{
    if (!dp)
        return;
    dt_ctx *ctx = dp->ctx;
    if (dp->go > 0) {   /* running: release the workers from their barrier */
        dp->stop = 1;
        pthread_barrier_wait(&dp->bar);
    } else if (dp->has_mu) {   /* never started: tell the ones waiting to go */
        pthread_mutex_lock(&dp->mu);
        dp->go = -1;
        pthread_cond_broadcast(&dp->cv);
        pthread_mutex_unlock(&dp->mu);
    }
    for (int k = 1; k <= dp->threads_started; k++)
        pthread_join(dp->thread[k], NULL);
    if (dp->has_bar)
        pthread_barrier_destroy(&dp->bar);
    if (dp->has_mu) {
        pthread_mutex_destroy(&dp->mu);
        pthread_cond_destroy(&dp->cv);
    }
    for (int k = 0; dp->rc && k < dp->K; k++) {
        if (dp->opt)
            dt_optim_free(dp->opt[k]);
        if (dp->model && dp->model[k] && dp->free_model)
            dp->free_model(dp->model[k], dp->user);
        dt_ctx_free(dp->rc[k]);
    }
    host_free(ctx, dp->rc);
    host_free(ctx, dp->model);
    host_free(ctx, dp->opt);
    host_free(ctx, dp->thread);
    host_free(ctx, dp->args);
    host_free(ctx, dp->xh);
    host_free(ctx, dp->poff);
    host_free(ctx, dp->avg);
    host_free(ctx, dp->used);
    host_free(ctx, dp->losses);
    host_free(ctx, dp->status);
    host_free(ctx, dp->msg);
    host_free(ctx, dp);
}

/* The replicas' models must match replica 0's; then they take its weights. */
static dt_status dp_align(dt_dp *dp)
{
    dt_ctx *c0 = dp->rc[0];
    dp->np = c0->n_params;
    for (int k = 1; k < dp->K; k++) {
        dt_ctx *c = dp->rc[k];
        if (c->n_params != dp->np)
            return set_error(dp->ctx, DT_EMISMATCH, "dp_new: replica %d built %d parameters, "
                             "replica 0 built %d", k, c->n_params, dp->np);
        for (int p = 0; p < dp->np; p++) {
            dt_tensor *a = c0->params[p], *b = c->params[p];
            char s1[96], s2[96];
            int same = a->ndim == b->ndim;
            for (int i = 0; same && i < a->ndim; i++)
                same = a->shape[i] == b->shape[i];
            if (strcmp(a->name, b->name) || !same)
                return set_error(dp->ctx, DT_EMISMATCH, "dp_new: parameter %d is '%s' %s on "
                                 "replica 0 but '%s' %s on replica %d", p, a->name, SHAPE(a, s1),
                                 b->name, SHAPE(b, s2), k);
            c->be_iface->copy(c->be, b->data, a->data, tensor_bytes(a));
        }
    }
    dp->poff = host_calloc(dp->ctx, sizeof(int64_t) * (size_t)(dp->np + 1));
    if (!dp->poff)
        return DT_ENOMEM;
    for (int p = 0; p < dp->np; p++)
        dp->poff[p + 1] = dp->poff[p] + dt_tensor_numel(c0->params[p]);
    dp->G = dp->poff[dp->np];
    dp->avg = host_calloc(dp->ctx, sizeof(float) * (size_t)(dp->G ? dp->G : 1));
    dp->used = host_calloc(dp->ctx, (size_t)(dp->np ? dp->np : 1));
    return dp->avg && dp->used ? DT_OK : DT_ENOMEM;
}

/* Workers wait for go; only when all started is the barrier made and go
 * set, so a failed start never leaves a thread in a barrier that cannot fill. */
static dt_status dp_start_threads(dt_dp *dp)
{
    if (pthread_mutex_init(&dp->mu, NULL) != 0)
        return set_error(dp->ctx, DT_ENOMEM, "dp_new: cannot make a mutex");
    if (pthread_cond_init(&dp->cv, NULL) != 0) {
        pthread_mutex_destroy(&dp->mu);
        return set_error(dp->ctx, DT_ENOMEM, "dp_new: cannot make a condition variable");
    }
    dp->has_mu = 1;
    for (int k = 1; k < dp->K; k++) {
        dp->args[k] = (struct dp_arg){dp, k};
        if (pthread_create(&dp->thread[k], NULL, dp_worker, &dp->args[k]) != 0)
            return set_error(dp->ctx, DT_ENOMEM, "dp_new: cannot start replica thread %d", k);
        dp->threads_started = k;
    }
    if (pthread_barrier_init(&dp->bar, NULL, (unsigned)dp->K) != 0)
        return set_error(dp->ctx, DT_ENOMEM, "dp_new: cannot make a barrier");
    dp->has_bar = 1;
    pthread_mutex_lock(&dp->mu);
    dp->go = 1;
    pthread_cond_broadcast(&dp->cv);
    pthread_mutex_unlock(&dp->mu);
    return DT_OK;
}

dt_dp *dt_dp_new(dt_ctx *ctx, const dt_dp_config *cfg_in, dt_dp_build_fn build, dt_dp_loss_fn loss,
                 dt_dp_free_fn free_model, void *user)
{
    if (!ctx_ok(ctx))
        return NULL;
    dt_dp_config own, *cfg = cfg_in ? &own : NULL;
    dt_dp_config_init(&own);
    if (cfg_in && ctx_config_in(ctx, &own, sizeof own, cfg_in, "dp_new", "dt_dp_config") != DT_OK)
        return NULL;
    own.replica.struct_size = sizeof own.replica;   /* embedded: read whole (dtrain.h) */
    own.optim.struct_size = sizeof own.optim;
    if (!cfg || !build || !loss || cfg->replicas < 1 || cfg->replicas > 1024) {
        set_error(ctx, DT_EINVAL, "dp_new: need a config with 1..1024 replicas, a build and a loss "
                  "function");
        return NULL;
    }
    dt_dp *dp = host_calloc(ctx, sizeof *dp);
    if (!dp) {
        set_error(ctx, DT_ENOMEM, "dp_new: out of memory");
        return NULL;
    }
    int K = cfg->replicas;
    *dp = (dt_dp){.ctx = ctx, .K = K, .loss = loss, .free_model = free_model, .user = user};
    dp->rc = host_calloc(ctx, sizeof *dp->rc * (size_t)K);
    dp->model = host_calloc(ctx, sizeof *dp->model * (size_t)K);
    dp->opt = host_calloc(ctx, sizeof *dp->opt * (size_t)K);
    dp->thread = host_calloc(ctx, sizeof *dp->thread * (size_t)K);
    dp->args = host_calloc(ctx, sizeof *dp->args * (size_t)K);
    dp->losses = host_calloc(ctx, sizeof *dp->losses * (size_t)K);
    dp->status = host_calloc(ctx, sizeof *dp->status * (size_t)K);
    dp->msg = host_calloc(ctx, sizeof *dp->msg * (size_t)K);
    dt_status s = dp->rc && dp->model && dp->opt && dp->thread && dp->args && dp->losses &&
                          dp->status && dp->msg
                      ? DT_OK : set_error(ctx, DT_ENOMEM, "dp_new: out of memory");
    for (int k = 0; s == DT_OK && k < K; k++) {
        dt_ctx_config rcfg = cfg->replica;
        rcfg.seed += (uint64_t)k;
        rcfg.device += k;
        dp->rc[k] = dt_ctx_new(&rcfg);
        if (!dp->rc[k] || dt_ctx_status(dp->rc[k]) != DT_OK) {
            s = set_error(ctx, dp->rc[k] ? dt_ctx_status(dp->rc[k]) : DT_ENOMEM,
                          "dp_new: replica %d's context: %s", k,
                          dp->rc[k] ? dp->rc[k]->err : "out of memory");
            break;
        }
        if (!dp->rc[k]->be_iface->host_visible) {
            s = set_error(ctx, DT_ENOTSUP, "dp_new: the %s backend's memory is not host memory; "
                          "in-process data parallelism needs host-visible gradients in this build",
                          dp->rc[k]->be_iface->name);
            break;
        }
        dp->model[k] = build(dp->rc[k], k, user);
        if (!dp->model[k]) {
            s = set_error(ctx, dt_last_status(dp->rc[k]) != DT_OK ? dt_last_status(dp->rc[k]) : DT_EINVAL,
                          "dp_new: building replica %d failed: %s", k, dp->rc[k]->err);
            break;
        }
        dp->opt[k] = dt_optim_new(dp->rc[k], &cfg->optim, NULL, 0);
        if (!dp->opt[k])
            s = set_error(ctx, dt_last_status(dp->rc[k]), "dp_new: replica %d's optimizer: %s", k,
                          dp->rc[k]->err);
    }
    if (s == DT_OK)
        s = dp_align(dp);
    if (s == DT_OK && K > 1)
        s = dp_start_threads(dp);
    if (s != DT_OK) {
        dt_dp_free(dp);
        return NULL;
    }
    return dp;
}

