#include "dist.h"

/* ===========================================================================
 * Hogwild!
 *
 * Niu, Recht, Re and Wright's lock-free SGD: K threads, each with its own
 * context (tape, activations, gradients) whose parameters point at the
 * caller's, step the shared parameters with no locks.  Races are the
 * algorithm: on a sparse problem two steps rarely touch the same rows.
 * 2-D parameters get a row log (src/autograd.c's embedding backward writes it):
 * while only dt_embedding writes their gradient, a step updates and clears
 * just the rows it used, so a step over a table of millions of rows costs
 * the rows it touches.  Any other op's gradient makes the step dense.
 * ======================================================================== */

/* --- src/hogwild.c --- */

struct hw_thread {
    struct hogwild *hw;
    int k;
    dt_ctx *ctx;
    void *model;
    pthread_t tid;
    int started;
    double loss_sum;
    int64_t steps, rows, dense;
};

struct hogwild {
    dt_ctx *ctx;
    dt_hogwild_config cfg;
    dt_hogwild_loss_fn loss;
    void *user;
    hw_thread *t;
    int stop;                  /* atomic: a thread failed */
    pthread_mutex_t mu;
    dt_status status;
    char msg[DT_MAX_ERROR];
};

void dt_hogwild_config_init(dt_hogwild_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->struct_size = sizeof *cfg;
    cfg->threads = 2;
    cfg->steps = 1000;
    cfg->lr = 0.01f;
    dt_ctx_config_init(&cfg->thread);
    cfg->thread.threads = 1;
}

/* Thread k's parameters become the caller's: same names and shapes, their
 * memory replaced by the shared one; gradients start at zero. */
static dt_status hw_share(hogwild *hw, hw_thread *t)
{
    dt_ctx *ctx = hw->ctx, *tc = t->ctx;
    if (tc->n_params != ctx->n_params)
        return set_error(ctx, DT_EMISMATCH, "hogwild: thread %d's model has %d parameters, the "
                         "context %d", t->k, tc->n_params, ctx->n_params);
    for (int i = 0; i < ctx->n_params; i++) {
        dt_tensor *p = tc->params[i], *m = ctx->params[i];
        if (strcmp(p->name, m->name) || p->ndim != m->ndim ||
            memcmp(p->shape, m->shape, sizeof(int64_t) * (size_t)p->ndim))
            return set_error(ctx, DT_EMISMATCH, "hogwild: thread %d's parameter %d is '%s', the "
                             "context's '%s' (or the shapes differ)", t->k, i, p->name, m->name);
        tensor_share_data(tc, p, m);
        tc->be_iface->memset0(tc->be, p->grad->data, tensor_bytes(p->grad));
        tensor_mark_zero(p->grad, 1);
        if (tensor_rows_log_start(tc, p) != DT_OK)
            return set_error(ctx, DT_ENOMEM, "hogwild: out of memory");
    }
    return DT_OK;
}

/* SGD on the shared parameters with this step's gradients, then the
 * gradients back to zero: the logged rows only, or everything. */
static dt_status hw_apply(hogwild *hw, hw_thread *t)
{
    dt_ctx *tc = t->ctx;
    const dt_backend_iface *be = tc->be_iface;
    float lr = hw->cfg.lr;
    for (int i = 0; i < tc->n_params; i++) {
        dt_tensor *p = tc->params[i], *g = p->grad;
        if (g->flags & T_ZERO) {
            tensor_rows_reset(p);   /* (an op that wrote nothing) */
            continue;
        }
        const int64_t *rows = NULL;
        int64_t nrows = 0;
        dt_status st = DT_OK;
        /* (an error goes in the worker's own ctx: hw_fail reads it from
         * there, and the caller's ctx belongs to the caller's thread) */
        if (tensor_rows_logged(tc, p, &rows, &nrows, &st)) {
            if (st != DT_OK)
                return st;
            int64_t d = p->shape[1];
            for (int64_t j = 0; j < nrows; j++) {
                int64_t r = rows[j];
                be->sgd_update(tc->be, d, FP(p) + r * d, FP(g) + r * d, NULL, lr, 0, 0, 0, 0, 0);
                memset(FP(g) + r * d, 0, (size_t)d * sizeof(float));
                t->rows++;
            }
        } else {
            int64_t n = shape_numel(p->ndim, p->shape);
            be->sgd_update(tc->be, n, FP(p), FP(g), NULL, lr, 0, 0, 0, 0, 0);
            be->memset0(tc->be, g->data, tensor_bytes(g));
            t->dense++;
        }
        tensor_rows_reset(p);
        tensor_mark_zero(g, 1);
    }
    return DT_OK;
}

static void hw_fail(hogwild *hw, hw_thread *t, int64_t step)
{
    pthread_mutex_lock(&hw->mu);
    if (hw->status == DT_OK) {
        hw->status = dt_last_status(t->ctx) != DT_OK ? dt_last_status(t->ctx) : DT_EINVAL;
        snprintf(hw->msg, sizeof hw->msg, "hogwild: thread %d, step %lld: %.400s", t->k,
                 (long long)step, t->ctx->err[0] ? t->ctx->err : "the loss function returned NULL");
    }
    pthread_mutex_unlock(&hw->mu);
    __atomic_store_n(&hw->stop, 1, __ATOMIC_RELAXED);
}

static void *hw_main(void *arg)
{
    hw_thread *t = arg;
    hogwild *hw = t->hw;
    int K = hw->cfg.threads;
    for (int64_t s = t->k; s < hw->cfg.steps; s += K) {
        if (__atomic_load_n(&hw->stop, __ATOMIC_RELAXED))
            break;
        dt_tensor *loss = hw->loss(t->ctx, t->model, t->k, s, hw->user);
        if (!loss || dt_backward(t->ctx, loss) != DT_OK || hw_apply(hw, t) != DT_OK) {
            hw_fail(hw, t, s);
            break;
        }
        t->loss_sum += dt_tensor_item(loss);
        t->steps++;
        dt_ctx_step_reset(t->ctx);
    }
    return NULL;
}

static void hw_cleanup(hogwild *hw, dt_dp_free_fn free_model)
{
    for (int k = 0; hw->t && k < hw->cfg.threads; k++) {
        if (hw->t[k].model && free_model)
            free_model(hw->t[k].model, hw->user);
        dt_ctx_free(hw->t[k].ctx);
    }
    host_free(hw->ctx, hw->t);
    pthread_mutex_destroy(&hw->mu);
}

dt_status dt_hogwild_run(dt_ctx *ctx, const dt_hogwild_config *cfg, dt_dp_build_fn build,
                         dt_hogwild_loss_fn loss, dt_dp_free_fn free_model, void *user,
                         dt_hogwild_stats *out)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    dt_hogwild_config own;
    dt_hogwild_config_init(&own);
    if (cfg && ctx_config_in(ctx, &own, sizeof own, cfg, "hogwild", "dt_hogwild_config") != DT_OK)
        return ctx->last_status;
    own.thread.struct_size = sizeof own.thread;   /* embedded: read whole (dtrain.h) */
    cfg = cfg ? &own : NULL;
    if (!cfg || !build || !loss || cfg->threads < 1 || cfg->threads > 1024 || cfg->steps < 0 ||
        !(cfg->lr >= 0))
        return set_error(ctx, DT_EINVAL, "hogwild: need a config with 1..1024 threads, steps >= 0, "
                         "lr >= 0, a build and a loss function");
    if (!ctx->be_iface->host_visible || ctx->n_params < 1)
        return set_error(ctx, ctx->n_params < 1 ? DT_EINVAL : DT_ENOTSUP, "hogwild: %s",
                         ctx->n_params < 1 ? "the context has no parameters to train"
                                           : "the parameters must be in host memory");
    hogwild hw = {.ctx = ctx, .cfg = *cfg, .loss = loss, .user = user};
    pthread_mutex_init(&hw.mu, NULL);
    int K = cfg->threads;
    hw.t = host_calloc(ctx, sizeof *hw.t * (size_t)K);
    dt_status s = hw.t ? DT_OK : set_error(ctx, DT_ENOMEM, "hogwild: out of memory");
    for (int k = 0; s == DT_OK && k < K; k++) {
        dt_ctx_config tcfg = cfg->thread;
        tcfg.seed += (uint64_t)k;
        hw_thread *t = &hw.t[k];
        *t = (hw_thread){.hw = &hw, .k = k, .ctx = dt_ctx_new(&tcfg)};
        if (!t->ctx || dt_ctx_status(t->ctx) != DT_OK || !t->ctx->be_iface->host_visible) {
            s = set_error(ctx, DT_EINVAL, "hogwild: thread %d's context: %s", k,
                          t->ctx ? (t->ctx->err[0] ? t->ctx->err : "memory not host-visible")
                                 : "out of memory");
            break;
        }
        if (!(t->model = build(t->ctx, k, user))) {
            s = set_error(ctx, dt_last_status(t->ctx) != DT_OK ? dt_last_status(t->ctx) : DT_EINVAL,
                          "hogwild: building thread %d's model failed: %s", k, t->ctx->err);
            break;
        }
        s = hw_share(&hw, t);
    }
    for (int k = 1; s == DT_OK && k < K; k++) {   /* thread 0 is the caller */
        if (pthread_create(&hw.t[k].tid, NULL, hw_main, &hw.t[k]) != 0) {
            s = set_error(ctx, DT_ENOMEM, "hogwild: cannot start thread %d", k);
            __atomic_store_n(&hw.stop, 1, __ATOMIC_RELAXED);
            break;
        }
        hw.t[k].started = 1;
    }
    if (s == DT_OK)
        hw_main(&hw.t[0]);
    double sum = 0;
    dt_hogwild_stats st = {0};
    for (int k = 0; hw.t && k < K; k++) {
        if (hw.t[k].started)
            pthread_join(hw.t[k].tid, NULL);
        sum += hw.t[k].loss_sum;
        st.steps += hw.t[k].steps;
        st.rows_updated += hw.t[k].rows;
        st.dense_updates += hw.t[k].dense;
    }
    if (s == DT_OK && hw.status != DT_OK)
        s = set_error(ctx, hw.status, "%s", hw.msg);
    st.mean_loss = st.steps ? sum / (double)st.steps : 0.0;
    if (out)
        *out = st;
    hw_cleanup(&hw, free_model);
    return s;
}

