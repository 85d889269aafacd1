#include "internal.h"

/* ===========================================================================
 * Optimizers, schedules, gradient clipping
 *
 * Updates follow torch.optim exactly (the backend kernels implement the
 * formulas).  State tensors are named after their parameter so checkpoints
 * can store them.  A parameter whose gradient is still logically zero since
 * the last zero_grad got no gradient this step and is skipped, as PyTorch
 * skips parameters whose .grad is None.
 * ======================================================================== */

/* One parameter's part of a sharded optimizer step (src/zero.c sets them):
 * elements [lo, lo + n) of it, whose averaged gradient is at grad, stepped
 * when used (some rank produced a gradient for it this step). */
struct optim_shard {
    int64_t lo, n;
    const float *grad;
    int used;
    int master_only;           /* zero 3 with masters: the step updates the master alone (the
                                  parameter's memory is not kept; its gathers round it) */
};

/* A parameter group (dt_param_group): the optimizer's config with the
 * group's values in, and its lr (what the last step used) and the base a
 * schedule scales. */
struct optim_group {
    dt_optim_config cfg;
    float base_lr, lr;
};

/* --- dynamic loss scaling (fp16) ------------------------------------------
 * As torch.cuda.amp.GradScaler.  The check for inf/NaN is the sum of
 * squares the backend already has (in double, so no finite f32 gradient
 * can overflow it; an inf or NaN anywhere makes it non-finite). */

struct dt_loss_scaler {
    dt_ctx *ctx;
    dt_loss_scale_config cfg;
    float scale;
    int good_steps;            /* in a row since the last overflow or growth */
    int pending;               /* a scaled backward ran since the last step */
    int unscaled, found_inf;   /* this step's gradients were divided by scale */
    int64_t skipped;
};

void dt_optim_config_init(dt_optim_config *cfg, dt_optim_kind kind)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->struct_size = sizeof *cfg;
    cfg->kind = kind;
    cfg->lr = kind == DT_SGD || kind == DT_ADAGRAD ? 0.01f : 1e-3f;   /* torch's defaults */
    cfg->beta1 = 0.9f;
    cfg->beta2 = 0.999f;
    cfg->eps = kind == DT_ADAGRAD ? 1e-10f : 1e-8f;
    cfg->weight_decay = kind == DT_ADAMW ? 0.01f : 0.0f;
}

/* param_dtype and state_dtype: the precisions named, and the backend
 * entries they need. */
static dt_status check_optim_dtypes(dt_ctx *ctx, const dt_optim_config *c)
{
    if (c->param_dtype != DT_F32 && c->param_dtype != DT_BF16 && c->param_dtype != DT_F16)
        return set_error(ctx, DT_EINVAL, "optim: param_dtype %d must be DT_F32, DT_BF16 or DT_F16",
                         (int)c->param_dtype);
    if (c->state_dtype == DT_F16)
        return set_error(ctx, DT_ENOTSUP, "optim: state_dtype DT_F16 is refused: f16's range "
                         "flushes a squared gradient below 2^-24 to zero (use DT_BF16)");
    if (c->state_dtype != DT_F32 && c->state_dtype != DT_BF16)
        return set_error(ctx, DT_EINVAL, "optim: state_dtype %d must be DT_F32 or DT_BF16",
                         (int)c->state_dtype);
    if (c->param_dtype != DT_F32 && !BE(ctx)->round_prec)
        return set_error(ctx, DT_ENOTSUP, "optim: the %s backend cannot round to 16 bits "
                         "(no round_prec) for param_dtype", ctx->be_iface->name);
    if (c->state_dtype != DT_F32 && (!BE(ctx)->to_half || !BE(ctx)->from_half))
        return set_error(ctx, DT_ENOTSUP, "optim: the %s backend has no 16-bit storage "
                         "(to_half, from_half) for state_dtype", ctx->be_iface->name);
    return DT_OK;
}

static dt_status check_optim_config(dt_ctx *ctx, const dt_optim_config *c)
{
    if (check_optim_dtypes(ctx, c) != DT_OK)
        return ctx->last_status;
    if (c->kind != DT_SGD && c->kind != DT_ADAM && c->kind != DT_ADAMW && c->kind != DT_ADAGRAD)
        return set_error(ctx, DT_EINVAL, "optim: unknown kind %d", (int)c->kind);
    if (!(c->lr >= 0) || !(c->weight_decay >= 0))
        return set_error(ctx, DT_EINVAL, "optim: lr (%g) and weight_decay (%g) must be >= 0",
                         (double)c->lr, (double)c->weight_decay);
    if (c->kind == DT_SGD) {
        if (!(c->momentum >= 0) || !(c->dampening >= 0 && c->dampening <= 1))
            return set_error(ctx, DT_EINVAL, "optim: sgd momentum %g / dampening %g out of range",
                             (double)c->momentum, (double)c->dampening);
        if (c->nesterov && (c->momentum <= 0 || c->dampening != 0))
            return set_error(ctx, DT_EINVAL, "optim: nesterov needs momentum > 0 and dampening 0");
        return DT_OK;
    }
    if (c->kind == DT_ADAGRAD) {
        if (!(c->eps >= 0))
            return set_error(ctx, DT_EINVAL, "optim: adagrad eps %g must be >= 0", (double)c->eps);
        if (!BE(ctx)->adagrad_update)
            return set_error(ctx, DT_ENOTSUP, "optim: the %s backend has no AdaGrad",
                             ctx->be_iface->name);
        return DT_OK;
    }
    if (!(c->beta1 >= 0 && c->beta1 < 1) || !(c->beta2 >= 0 && c->beta2 < 1) || !(c->eps >= 0))
        return set_error(ctx, DT_EINVAL, "optim: adam betas (%g, %g) must be in [0,1), eps >= 0",
                         (double)c->beta1, (double)c->beta2);
    return DT_OK;
}

/* Optimizer state: zero until the first step that uses it, but written
 * only then (T_ZERO: tensor_materialize), so state that a sharded DDP
 * replaces at once, or that a checkpoint load overwrites, never costs its
 * memory (PyTorch too creates its state at the first step). */
static dt_tensor *optim_state_tensor(const dt_optim *o, int ndim, const int64_t *shape,
                                     const char *name, const char *suffix)
{
    return tensor_owned_new_as(o->ctx, o->cfg.state_dtype, ndim, shape, name, suffix, 1);
}

/* The scratch's chunks: one a state tensor with 16-bit state, then one for
 * optim_master_adopt; the first of the latter. */
static int optim_master_scratch_at(const dt_optim *o)
{
    return o->cfg.state_dtype != DT_F32 ? o->per : 0;
}

/* The precision a 16-bit dtype rounds to. */
static dt_precision optim_prec(dt_dtype t)
{
    return t == DT_BF16 ? DT_PREC_BF16 : t == DT_F16 ? DT_PREC_F16 : DT_PREC_F32;
}

/* param_dtype 16-bit: each parameter's f32 value becomes its master and
 * the parameter holds it rounded; state_dtype 16-bit: the scratch the
 * moments are widened into, OPTIM_CHUNK floats per state tensor. */
static dt_status optim_make_masters(dt_optim *o)
{
    dt_ctx *ctx = o->ctx;
    size_t chunks = (size_t)optim_master_scratch_at(o) + (o->cfg.param_dtype != DT_F32);
    if (chunks && !(o->scratch = ctx->be_iface->alloc(ctx->be, sizeof(float) * OPTIM_CHUNK * chunks)))
        return DT_ENOMEM;
    if (o->cfg.param_dtype == DT_F32)
        return DT_OK;
    if (!(o->master = host_calloc(ctx, sizeof(dt_tensor *) * (size_t)(o->n + 1))))
        return DT_ENOMEM;
    for (int i = 0; i < o->n; i++) {
        dt_tensor *p = o->params[i];
        if (!(o->master[i] = tensor_owned_new(ctx, p->ndim, p->shape, p->name, ".master", 1)))
            return DT_ENOMEM;
        tensor_materialize(p);
        tensor_materialize(o->master[i]);
        tensor_mark_zero(o->master[i], 0);
        ctx->be_iface->copy(ctx->be, o->master[i]->data, p->data, tensor_bytes(p));
        BE(ctx)->round_prec(BEI(ctx), optim_prec(o->cfg.param_dtype), dt_tensor_numel(p), FP(p),
                            FP(p));
    }
    return DT_OK;
}

void dt_param_group_init(dt_param_group *g, dt_tensor *const *params, int n)
{
    if (!g)
        return;
    memset(g, 0, sizeof *g);
    g->struct_size = sizeof *g;
    g->params = params;
    g->n = n;
    g->lr = g->momentum = g->dampening = g->weight_decay = NAN;
    g->beta1 = g->beta2 = g->eps = NAN;
    g->nesterov = -1;
}

/* The caller's config (struct_size-checked) with the defaults of its kind
 * where its struct ends before them. */
static dt_status optim_config_read(dt_ctx *ctx, const dt_optim_config *cfg, dt_optim_config *own)
{
    if (!cfg)
        return set_error(ctx, DT_EINVAL, "optim_new: config is NULL");
    int has_kind = cfg->struct_size >= offsetof(dt_optim_config, kind) + sizeof cfg->kind;
    dt_optim_config_init(own, has_kind ? cfg->kind : DT_SGD);
    if (ctx_config_in(ctx, own, sizeof *own, cfg, "optim_new", "dt_optim_config") != DT_OK)
        return ctx->last_status;
    return check_optim_config(ctx, own);
}

/* Group g's config: the optimizer's with the group's set (not NaN, nesterov
 * not -1) values in, checked as a config is. */
static dt_status optim_group_read(dt_ctx *ctx, const dt_optim_config *base, const dt_param_group *in,
                                  int g, optim_group *out)
{
    dt_param_group own;
    dt_param_group_init(&own, NULL, 0);
    if (ctx_config_in(ctx, &own, sizeof own, in, "optim_new_groups", "dt_param_group") != DT_OK)
        return ctx->last_status;
    dt_optim_config c = *base;
    float *dst[] = {&c.lr, &c.momentum, &c.dampening, &c.weight_decay, &c.beta1, &c.beta2, &c.eps};
    const float src[] = {own.lr, own.momentum, own.dampening, own.weight_decay, own.beta1,
                         own.beta2, own.eps};
    for (size_t k = 0; k < sizeof src / sizeof src[0]; k++)
        if (!isnan(src[k]))
            *dst[k] = src[k];
    if (own.nesterov != -1)
        c.nesterov = own.nesterov;
    if (own.n < 0 || (own.n > 0 && !own.params))
        return set_error(ctx, DT_EINVAL, "optim_new_groups: group %d has %d parameters%s", g, own.n,
                         own.n > 0 ? " and a NULL list" : "");
    if (check_optim_config(ctx, &c) != DT_OK) {
        char why[sizeof ctx->err];
        snprintf(why, sizeof why, "%s", ctx->err);
        return set_error(ctx, ctx->last_status, "optim_new_groups: group %d: %s", g, why);
    }
    *out = (optim_group){.cfg = c, .base_lr = c.lr, .lr = c.lr};
    return DT_OK;
}

/* Every entry a parameter of ctx, none twice (a parameter in two groups
 * would be stepped twice). */
static dt_status optim_check_params(dt_ctx *ctx, dt_tensor *const *src, int count)
{
    for (int i = 0; i < count; i++) {
        if (!src[i] || src[i]->ctx != ctx || !(src[i]->flags & T_PARAM))
            return set_error(ctx, DT_EINVAL, "optim_new: entry %d is not a parameter of this "
                             "context", i);
        for (int j = 0; j < i; j++)
            if (src[j] == src[i])
                return set_error(ctx, DT_EINVAL, "optim_new: parameter '%s' is given twice (in "
                                 "two groups, or twice in one)", src[i]->name);
    }
    return DT_OK;
}

/* The state tensors of parameter i: zero until written (optim_state_tensor). */
static dt_status optim_make_state(dt_optim *o, int i)
{
    static const char *const suffix[3][2] = {{".momentum_buffer", ""}, {".exp_avg", ".exp_avg_sq"},
                                             {".sum", ""}};   /* torch's state names */
    int row = o->cfg.kind == DT_SGD ? 0 : o->cfg.kind == DT_ADAGRAD ? 2 : 1;
    dt_tensor *p = o->params[i];
    for (int j = 0; j < o->per; j++)
        if (!(o->state[i * o->per + j] = optim_state_tensor(o, p->ndim, p->shape, p->name,
                                                            suffix[row][j])))
            return DT_ENOMEM;
    return DT_OK;
}

/* State tensors per parameter: SGD keeps a momentum buffer when any group
 * has momentum (a group without leaves its buffers unwritten). */
static int optim_state_per_of(const dt_optim *o)
{
    if (o->cfg.kind == DT_ADAGRAD)
        return 1;
    if (o->cfg.kind != DT_SGD)
        return 2;
    for (int g = 0; g < o->ngroups; g++)
        if (o->groups[g].cfg.momentum != 0.0f)
            return 1;
    return 0;
}

static dt_optim *optim_create(dt_ctx *ctx, const dt_optim_config *cfg, dt_tensor *const *src,
                              const int *group_of, int count, const optim_group *groups, int ngroups)
{
    dt_optim *o = host_calloc(ctx, sizeof *o);
    if (!o) {
        set_error(ctx, DT_ENOMEM, "optim_new: out of memory");
        return NULL;
    }
    o->ctx = ctx;
    o->cfg = *cfg;
    o->n = count;
    o->ngroups = ngroups;
    o->groups = host_calloc(ctx, sizeof *o->groups * (size_t)ngroups);
    o->group_of = host_calloc(ctx, sizeof *o->group_of * (size_t)(count ? count : 1));
    o->params = host_calloc(ctx, sizeof(dt_tensor *) * (size_t)(count ? count : 1));
    o->param_steps = host_calloc(ctx, sizeof(int64_t) * (size_t)(count ? count : 1));
    if (!o->groups || !o->group_of || !o->params || !o->param_steps)
        goto fail;
    memcpy(o->groups, groups, sizeof *groups * (size_t)ngroups);
    o->per = optim_state_per_of(o);
    if (!(o->state = host_calloc(ctx, sizeof(dt_tensor *) * (size_t)(count * o->per + 1))))
        goto fail;
    for (int i = 0; i < count; i++) {
        o->params[i] = src[i];
        o->group_of[i] = group_of ? group_of[i] : 0;
        if (optim_make_state(o, i) != DT_OK)
            goto fail;
    }
    if (optim_make_masters(o) != DT_OK)
        goto fail;
    return o;
fail:
    dt_optim_free(o);
    set_error(ctx, DT_ENOMEM, "optim_new: out of memory for optimizer state");
    return NULL;
}

dt_optim *dt_optim_new(dt_ctx *ctx, const dt_optim_config *cfg, dt_tensor *const *params, int n)
{
    if (!ctx_ok(ctx))
        return NULL;
    dt_optim_config own;
    if (optim_config_read(ctx, cfg, &own) != DT_OK)
        return NULL;
    dt_tensor *const *src = params ? params : ctx->params;
    int count = params ? n : ctx->n_params;
    if (count < 0 || (params && n < 1)) {
        set_error(ctx, DT_EINVAL, "optim_new: %d parameters", n);
        return NULL;
    }
    if (optim_check_params(ctx, src, count) != DT_OK)
        return NULL;
    optim_group g = {.cfg = own, .base_lr = own.lr, .lr = own.lr};
    return optim_create(ctx, &own, src, NULL, count, &g, 1);
}

dt_optim *dt_optim_new_groups(dt_ctx *ctx, const dt_optim_config *cfg, const dt_param_group *groups,
                              int n_groups)
{
    if (!ctx_ok(ctx))
        return NULL;
    dt_optim_config own;
    if (optim_config_read(ctx, cfg, &own) != DT_OK)
        return NULL;
    if (!groups || n_groups < 1 || n_groups > DT_OPTIM_MAX_GROUPS) {
        set_error(ctx, DT_EINVAL, "optim_new_groups: %d groups%s (1 to %d)", n_groups,
                  groups ? "" : " at NULL", DT_OPTIM_MAX_GROUPS);
        return NULL;
    }
    optim_group gs[DT_OPTIM_MAX_GROUPS];
    int64_t total = 0;
    for (int g = 0; g < n_groups; g++) {
        if (optim_group_read(ctx, &own, &groups[g], g, &gs[g]) != DT_OK)
            return NULL;
        total += groups[g].n;
    }
    if (total < 1 || total > INT_MAX / 2) {
        set_error(ctx, DT_EINVAL, "optim_new_groups: %lld parameters in all (at least 1)",
                  (long long)total);
        return NULL;
    }
    dt_tensor **src = host_alloc(ctx, sizeof *src * (size_t)total);
    int *group_of = host_alloc(ctx, sizeof *group_of * (size_t)total);
    dt_optim *o = NULL;
    if (!src || !group_of) {
        set_error(ctx, DT_ENOMEM, "optim_new_groups: out of memory");
    } else {
        int at = 0;
        for (int g = 0; g < n_groups; g++)
            for (int i = 0; i < groups[g].n; i++, at++)
                src[at] = groups[g].params[i], group_of[at] = g;
        if (optim_check_params(ctx, src, at) == DT_OK)
            o = optim_create(ctx, &own, src, group_of, at, gs, n_groups);
    }
    host_free(ctx, src);
    host_free(ctx, group_of);
    return o;
}

void dt_optim_free(dt_optim *o)
{
    if (!o)
        return;
    dt_ctx *ctx = o->ctx;
    if (ctx->hook_user)   /* first: a zero 3 DDP takes the parameters back from the masters */
        ctx->grad_hooks->optim_freed(ctx->hook_user, o);
    if (o->state)
        for (int i = 0; i < o->n * o->per; i++)
            if (o->state[i])
                tensor_destroy(ctx, o->state[i]);
    host_free(ctx, o->state);
    for (int i = 0; o->master && i < o->n; i++)
        if (o->master[i])
            tensor_destroy(ctx, o->master[i]);
    host_free(ctx, o->master);
    if (o->scratch)
        ctx->be_iface->free(ctx->be, o->scratch);
    host_free(ctx, o->params);
    host_free(ctx, o->groups);
    host_free(ctx, o->group_of);
    host_free(ctx, o->param_steps);
    host_free(ctx, o->shard);
    host_free(ctx, o);
}

float dt_schedule_lr(const dt_schedule *s, float base, int64_t step)
{
    if (!s || step < 0)
        return base;
    switch (s->kind) {
    case DT_SCHED_STEP:
        if (s->step_size <= 0)
            return base;
        return base * powf(s->gamma, (float)(step / s->step_size));
    case DT_SCHED_COSINE: {
        if (step < s->warmup_steps)
            return base * (float)(step + 1) / (float)s->warmup_steps;
        int64_t span = s->total_steps - s->warmup_steps;
        double q = span > 0 ? (double)(step - s->warmup_steps) / (double)span : 1.0;
        if (q > 1)
            q = 1;
        return (float)(s->min_lr + (base - s->min_lr) * 0.5 * (1.0 + cos(M_PI * q)));
    }
    case DT_SCHED_CONSTANT:
        break;
    }
    return base;
}

dt_status dt_optim_set_schedule(dt_optim *o, const dt_schedule *s)
{
    if (!o)
        return DT_EINVAL;
    if (!s)
        return set_error(o->ctx, DT_EINVAL, "optim_set_schedule: schedule is NULL");
    if (s->kind == DT_SCHED_STEP && (s->step_size <= 0 || !(s->gamma > 0)))
        return set_error(o->ctx, DT_EINVAL, "optim_set_schedule: step schedule needs step_size > 0 "
                                            "and gamma > 0");
    /* total_steps 0 would train at min_lr from the first step: silently nothing */
    if (s->kind == DT_SCHED_COSINE &&
        (s->warmup_steps < 0 || s->total_steps <= 0 || s->total_steps < s->warmup_steps))
        return set_error(o->ctx, DT_EINVAL, "optim_set_schedule: cosine needs total_steps > 0 "
                                            "and 0 <= warmup_steps <= total_steps");
    if (s->kind < DT_SCHED_CONSTANT || s->kind > DT_SCHED_COSINE)
        return set_error(o->ctx, DT_EINVAL, "optim_set_schedule: unknown kind %d", (int)s->kind);
    o->sched = *s;
    o->has_sched = 1;
    for (int g = 0; g < o->ngroups; g++)
        o->groups[g].base_lr = o->groups[g].lr;
    return DT_OK;
}

static dt_status optim_step_run(dt_optim *o);

dt_status dt_optim_step(dt_optim *o)
{
    if (!o)
        return DT_EINVAL;
    double t0 = prof_begin(o->ctx);
    int act = ctx_doing(o->ctx, ACT_OPTIM);
    dt_status s = optim_step_run(o);
    ctx_done(o->ctx, act);
    if (s == DT_OK)
        s = be_fault(o->ctx, "optim_step");
    prof_end(o->ctx, PH_OPTIM, t0);
    return s;
}

/* The kernel of one update over cnt elements of p and g with f32 state s0,
 * s1 (NULL where the kind has fewer). */
static void optim_kernel(dt_optim *o, const optim_group *gr, int64_t cnt, float *p, const float *g,
                         float *s0, float *s1, int64_t t)
{
    dt_ctx *ctx = o->ctx;
    const dt_optim_config *c = &gr->cfg;
    if (c->kind == DT_SGD) {
        BE(ctx)->sgd_update(BEI(ctx), cnt, p, g, s0, gr->lr, o->momentum_by_ddp ? 0.0f : c->momentum,
                            c->dampening, c->nesterov, c->weight_decay, t == 1);
    } else if (c->kind == DT_ADAGRAD) {
        BE(ctx)->adagrad_update(BEI(ctx), cnt, p, g, s0, gr->lr, c->eps, c->weight_decay);
    } else {
        float bc1 = 1.0f - powf(c->beta1, (float)t), bc2 = 1.0f - powf(c->beta2, (float)t);
        BE(ctx)->adam_update(BEI(ctx), cnt, p, g, s0, s1, gr->lr, c->beta1, c->beta2, c->eps,
                             c->weight_decay, c->kind == DT_ADAMW, bc1, bc2);
    }
}

/* Does parameter i keep state?  Not an SGD group without momentum. */
static int optim_has_state(const dt_optim *o, int i)
{
    return o->per > 0 && !(o->cfg.kind == DT_SGD && o->groups[o->group_of[i]].cfg.momentum == 0.0f);
}

/* One parameter's update: cnt elements from p, g and the state tensors'
 * own first element (the whole parameter, or a shard of it).  bf16 state
 * is widened OPTIM_CHUNK floats at a time into the scratch, updated in
 * f32 by the same kernel, and rounded back (to nearest even). */
static void optim_update(dt_optim *o, int i, int64_t cnt, float *p, const float *g, int64_t t)
{
    dt_ctx *ctx = o->ctx;
    const optim_group *gr = &o->groups[o->group_of[i]];
    int has = optim_has_state(o, i);
    dt_tensor *t0 = has ? o->state[i * o->per] : NULL;
    dt_tensor *t1 = has && o->per > 1 ? o->state[i * o->per + 1] : NULL;
    if (o->cfg.state_dtype == DT_F32 || !t0) {
        optim_kernel(o, gr, cnt, p, g, t0 ? FP(t0) : NULL, t1 ? FP(t1) : NULL, t);
        return;
    }
    uint16_t *h0 = t0->data, *h1 = t1 ? t1->data : NULL;
    float *w0 = o->scratch, *w1 = t1 ? o->scratch + OPTIM_CHUNK : NULL;
    for (int64_t a = 0; a < cnt; a += OPTIM_CHUNK) {
        int64_t m = cnt - a < OPTIM_CHUNK ? cnt - a : OPTIM_CHUNK;
        BE(ctx)->from_half(BEI(ctx), DT_PREC_BF16, m, h0 + a, w0);
        if (h1)
            BE(ctx)->from_half(BEI(ctx), DT_PREC_BF16, m, h1 + a, w1);
        optim_kernel(o, gr, m, p + a, g + a, w0, w1, t);
        BE(ctx)->to_half(BEI(ctx), DT_PREC_BF16, m, w0, h0 + a);
        if (h1)
            BE(ctx)->to_half(BEI(ctx), DT_PREC_BF16, m, w1, h1 + a);
    }
}

/* A parameter written since the last step (its value is no longer its
 * master rounded: a checkpoint loaded without the optimizer, dt_tensor_set)
 * gives its master that value, element by element, so the step never
 * undoes the caller's write. */
static void optim_master_adopt(dt_optim *o, float *m, const float *p, int64_t n)
{
    dt_ctx *ctx = o->ctx;
    float *d = o->scratch + (size_t)optim_master_scratch_at(o) * OPTIM_CHUNK;
    static const int64_t one = 1;
    for (int64_t a = 0; a < n; a += OPTIM_CHUNK) {   /* in backend ops: device memory too */
        int64_t c = n - a < OPTIM_CHUNK ? n - a : OPTIM_CHUNK;
        BE(ctx)->round_prec(BEI(ctx), optim_prec(o->cfg.param_dtype), c, m + a, d);
        BE(ctx)->binary(BEI(ctx), DT_BIN_SUB, 1, &c, p + a, &one, d, &one, d);   /* d = p - r */
        BE(ctx)->binary(BEI(ctx), DT_BIN_DROP, 1, &c, m + a, &one, d, &one, m + a);
        BE(ctx)->binary(BEI(ctx), DT_BIN_KEEP, 1, &c, p + a, &one, d, &one, d);
        BE(ctx)->axpby(BEI(ctx), c, 1.0f, d, 1.0f, m + a);   /* m where d == 0, else p */
    }
}

/* Parameter i's update, of its master when it has one (then rounded into
 * the parameter): the shard [lo, lo + n) when sharded, else the whole. */
static void optim_update_param(dt_optim *o, int i, const float *g, int64_t t)
{
    dt_ctx *ctx = o->ctx;
    dt_tensor *p = o->params[i];
    const optim_shard *sh = o->shard ? &o->shard[i] : NULL;
    int64_t lo = sh ? sh->lo : 0, n = sh ? sh->n : dt_tensor_numel(p);
    if (n <= 0)
        return;
    if (!o->master) {
        optim_update(o, i, n, FP(p) + lo, g, t);
        return;
    }
    float *m = FP(o->master[i]);
    if (sh && sh->master_only) {
        optim_update(o, i, n, m, g, t);
        return;
    }
    optim_master_adopt(o, m, FP(p) + lo, n);
    optim_update(o, i, n, m, g, t);
    BE(ctx)->round_prec(BEI(ctx), optim_prec(o->cfg.param_dtype), n, m, FP(p) + lo);
}

static dt_status optim_step_run(dt_optim *o)
{
    dt_ctx *ctx = o->ctx;
    if (o->orphaned)
        return set_error(ctx, DT_ESTATE, "optim_step: this optimizer's state was sharded across "
                         "the ranks by a DDP (dt_ddp_config.zero) that has been freed; make a "
                         "new optimizer");
    for (int g = 0; o->has_sched && g < o->ngroups; g++)
        o->groups[g].lr = dt_schedule_lr(&o->sched, o->groups[g].base_lr, o->steps);
    o->steps++;
    for (int i = 0; i < o->n; i++) {
        dt_tensor *p = o->params[i], *g = p->grad;
        const optim_shard *sh = o->shard ? &o->shard[i] : NULL;
        if (sh ? !sh->used : !g || (g->flags & T_ZERO))
            continue;
        int64_t t = ++o->param_steps[i];
        for (int j = 0; optim_has_state(o, i) && j < o->per; j++)   /* zero it now, if never written */
            tensor_materialize(o->state[i * o->per + j]);
        optim_update_param(o, i, sh ? sh->grad : FP(g), t);
    }
    /* the ranks swap the shards they stepped (src/zero.c) */
    if (o->shard && ctx->hook_user && ctx->grad_hooks->after_step)
        return ctx->grad_hooks->after_step(ctx->hook_user, o);
    return DT_OK;
}

/* Parameter p's f32 master in o, or NULL (o NULL, or no masters). */
DT_PRIVATE void optim_momentum_elsewhere(dt_optim *o, int on) { o->momentum_by_ddp = on; }

DT_PRIVATE int optim_param_count(const dt_optim *o) { return o->n; }
DT_PRIVATE const dt_optim_config *optim_config(const dt_optim *o) { return &o->cfg; }

DT_PRIVATE float optim_scheduled_lr(const dt_optim *o, int group)
{
    const optim_group *g = &o->groups[group];
    return o->has_sched ? dt_schedule_lr(&o->sched, g->base_lr, o->steps) : g->lr;
}
DT_PRIVATE dt_tensor *optim_param_at(const dt_optim *o, int i) { return o->params[i]; }
DT_PRIVATE int optim_state_per(const dt_optim *o) { return o->per; }
DT_PRIVATE const int64_t *optim_param_steps(const dt_optim *o) { return o->param_steps; }
DT_PRIVATE int optim_kind(const dt_optim *o) { return (int)o->cfg.kind; }
DT_PRIVATE float optim_base_lr(const dt_optim *o, int group) { return o->groups[group].base_lr; }
/* sharded by ZeRO, or its shards' job is gone (orphaned): not whole here */
DT_PRIVATE int optim_is_sharded(const dt_optim *o) { return o->shard || o->orphaned; }
DT_PRIVATE int64_t optim_shard_lo(const dt_optim *o, int i) { return o->shard ? o->shard[i].lo : 0; }
DT_PRIVATE int64_t optim_shard_count(const dt_optim *o, int i) { return o->shard ? o->shard[i].n : 0; }

DT_PRIVATE void optim_shard_grad(dt_optim *o, int i, const float *grad, int master_only)
{
    o->shard[i].grad = grad;
    o->shard[i].master_only = master_only;
}

DT_PRIVATE void optim_shard_used(dt_optim *o, int i, int used) { o->shard[i].used = used; }
DT_PRIVATE void optim_orphan(dt_optim *o) { o->orphaned = 1; }
DT_PRIVATE int optim_is_orphaned(const dt_optim *o) { return o->orphaned; }
DT_PRIVATE dt_ctx *optim_ctx(const dt_optim *o) { return o->ctx; }

DT_PRIVATE void optim_restore_steps(dt_optim *o, int64_t steps, const int64_t *param_steps)
{
    o->steps = steps;
    memcpy(o->param_steps, param_steps, sizeof *param_steps * (size_t)o->n);
}

DT_PRIVATE dt_tensor *optim_master_at(const dt_optim *o, int i)
{
    return o->master && i < o->n ? o->master[i] : NULL;
}

DT_PRIVATE dt_tensor *optim_master_of(const dt_optim *o, const dt_tensor *p)
{
    for (int i = 0; o && o->master && i < o->n; i++)
        if (o->params[i] == p)
            return o->master[i];
    return NULL;
}

/* After a checkpoint load wrote f32 values into the parameters: the
 * masters take them (their shard's part), and the parameters hold them
 * rounded: whole, or (whole 0: zero 3, the rest given back) the shard. */
DT_PRIVATE void optim_masters_from_params(dt_optim *o, int whole)
{
    dt_ctx *ctx = o ? o->ctx : NULL;
    for (int i = 0; o && o->master && i < o->n; i++) {
        dt_tensor *p = o->params[i];
        int64_t lo = o->shard ? o->shard[i].lo : 0, n = dt_tensor_numel(o->master[i]);
        if (n > 0)
            ctx->be_iface->copy(ctx->be, o->master[i]->data, FP(p) + lo, (size_t)n * sizeof(float));
        int64_t a = whole ? 0 : lo, e = whole ? dt_tensor_numel(p) : lo + n;
        if (e > a)
            BE(ctx)->round_prec(BEI(ctx), optim_prec(o->cfg.param_dtype), e - a, FP(p) + a,
                                FP(p) + a);
    }
}

/* The masters cut to [lo[i], lo[i] + n[i]) of each parameter (1-D, their
 * values kept); all or nothing. */
static dt_status optim_shard_masters(dt_optim *o, const int64_t *lo, const int64_t *n)
{
    dt_ctx *ctx = o->ctx;
    if (!o->master)
        return DT_OK;
    dt_tensor **cut = host_calloc(ctx, sizeof *cut * (size_t)(o->n + 1));
    int ok = cut != NULL;
    for (int i = 0; ok && i < o->n; i++)
        ok = (cut[i] = tensor_owned_new(ctx, 1, &n[i], o->master[i]->name, "", 0)) != NULL;
    for (int i = 0; cut && i < o->n; i++) {
        if (ok && n[i] > 0)
            ctx->be_iface->copy(ctx->be, cut[i]->data, FP(o->master[i]) + lo[i],
                                (size_t)n[i] * sizeof(float));
        if (cut[i])
            tensor_destroy(ctx, ok ? o->master[i] : cut[i]);
        if (ok)
            o->master[i] = cut[i];
    }
    host_free(ctx, cut);
    return ok ? DT_OK : DT_ENOMEM;
}

/* A sharded DDP (src/zero.c) keeps only elements [lo[i], lo[i] + n[i]) of
 * parameter i's state here: each state tensor becomes that long (1-D, its
 * name kept), holding its part of what the whole one held (zero if it was
 * never written).  All or nothing. */
DT_PRIVATE dt_status optim_shard_state(dt_optim *o, const int64_t *lo, const int64_t *n)
{
    dt_ctx *ctx = o->ctx;
    int total = o->n * o->per;
    dt_tensor **fresh = host_calloc(ctx, sizeof *fresh * (size_t)(total + 1));
    optim_shard *sh = host_calloc(ctx, sizeof *sh * (size_t)(o->n + 1));
    int ok = fresh && sh;
    for (int k = 0; ok && k < total; k++) {
        int64_t len = n[k / o->per];
        fresh[k] = optim_state_tensor(o, 1, &len, o->state[k]->name, "");
        ok = fresh[k] != NULL;
    }
    if (ok && optim_shard_masters(o, lo, n) != DT_OK)
        ok = 0;
    if (!ok) {
        for (int k = 0; fresh && k < total; k++)
            if (fresh[k])
                tensor_destroy(ctx, fresh[k]);
        host_free(ctx, fresh);
        host_free(ctx, sh);
        return set_error(ctx, DT_ENOMEM, "ddp_new: out of memory for the optimizer's shard");
    }
    size_t es = dt_dtype_size(o->cfg.state_dtype);
    for (int k = 0; k < total; k++) {   /* state already written (a loaded checkpoint) stays */
        if (!(o->state[k]->flags & T_ZERO) && n[k / o->per] > 0) {
            tensor_materialize(fresh[k]);
            tensor_mark_zero(fresh[k], 0);
            ctx->be_iface->copy(ctx->be, fresh[k]->data,
                                (char *)o->state[k]->data + (size_t)lo[k / o->per] * es,
                                (size_t)n[k / o->per] * es);
        }
        tensor_destroy(ctx, o->state[k]);
        o->state[k] = fresh[k];
    }
    host_free(ctx, fresh);
    for (int i = 0; i < o->n; i++)
        sh[i] = (optim_shard){.lo = lo[i], .n = n[i]};
    o->shard = sh;
    return DT_OK;
}

void dt_optim_zero_grad(dt_optim *o)
{
    if (!o)
        return;
    for (int i = 0; i < o->n; i++)
        if (o->params[i]->grad)
            tensor_mark_zero(o->params[i]->grad, 1);
    param_grads_zeroed(o->ctx);
}

float dt_optim_lr(const dt_optim *o) { return o ? o->groups[0].lr : 0.0f; }
int dt_optim_group_count(const dt_optim *o) { return o ? o->ngroups : 0; }

int dt_optim_group_of(const dt_optim *o, const dt_tensor *param)
{
    for (int i = 0; o && param && i < o->n; i++)
        if (o->params[i] == param)
            return o->group_of[i];
    return -1;
}

dt_status dt_optim_group_config(const dt_optim *o, int group, dt_optim_config *out)
{
    if (!o)
        return DT_EINVAL;
    if (!out || group < 0 || group >= o->ngroups)
        return set_error(o->ctx, DT_EINVAL, "optim_group_config: group %d of %d%s", group,
                         o->ngroups, out ? "" : ", out NULL");
    *out = o->groups[group].cfg;
    out->lr = o->groups[group].lr;
    return DT_OK;
}

dt_status dt_optim_set_group_lr(dt_optim *o, int group, float lr)
{
    if (!o)
        return DT_EINVAL;
    if (group < 0 || group >= o->ngroups)
        return set_error(o->ctx, DT_EINVAL, "optim_set_group_lr: group %d of %d", group, o->ngroups);
    if (!(lr >= 0))
        return set_error(o->ctx, DT_EINVAL, "optim_set_group_lr: lr %g must be >= 0", (double)lr);
    o->groups[group].lr = o->groups[group].base_lr = lr;
    return DT_OK;
}
int64_t dt_optim_steps(const dt_optim *o) { return o ? o->steps : 0; }
int dt_optim_state_count(const dt_optim *o) { return o ? o->n * o->per : 0; }

dt_tensor *dt_optim_state_at(const dt_optim *o, int i)
{
    return o && i >= 0 && i < o->n * o->per ? o->state[i] : NULL;
}

dt_status dt_optim_set_lr(dt_optim *o, float lr)
{
    if (!o)
        return DT_EINVAL;
    if (!(lr >= 0))
        return set_error(o->ctx, DT_EINVAL, "optim_set_lr: lr %g must be >= 0", (double)lr);
    for (int g = 0; g < o->ngroups; g++)
        o->groups[g].lr = o->groups[g].base_lr = lr;
    return DT_OK;
}

DT_PRIVATE dt_status optim_check_lrs(dt_optim *o, int n, const char *path)
{
    if (n == o->ngroups)
        return DT_OK;
    return set_error(o->ctx, DT_EMISMATCH, "checkpoint_load: %s's optimizer has %d parameter "
                     "group%s, this one %d (give dt_optim_new_groups the groups it was saved with)",
                     path, n, n == 1 ? "" : "s", o->ngroups);
}

DT_PRIVATE void optim_set_lrs(dt_optim *o, const float *lrs)
{
    for (int g = 0; g < o->ngroups; g++)
        o->groups[g].lr = o->groups[g].base_lr = lrs[g];
}

/* Are the gradients sharded across the ranks (src/zero.c)? */
static int optim_grads_sharded(dt_ctx *ctx)
{
    return ctx->hook_user && ctx->grad_hooks->grads_sharded &&
           ctx->grad_hooks->grads_sharded(ctx->hook_user);
}

/* Clipping by the global norm of sharded gradients: every rank's shard
 * adds to the norm (a collective), and each rank scales its own. */
static dt_status optim_clip_shards(dt_ctx *ctx, float max_norm, float *norm_out)
{
    double total = 0;
    dt_status s = ctx->grad_hooks->grad_sumsq(ctx->hook_user, &total);
    if (s != DT_OK)
        return s;
    double norm = sqrt(total), coef = max_norm / (norm + 1e-6);
    if (norm_out)
        *norm_out = (float)norm;
    if (coef < 1.0)
        ctx->grad_hooks->grad_scale(ctx->hook_user, (float)coef);
    return be_fault(ctx, "clip_grad_norm");
}

dt_status dt_ctx_clip_grad_norm(dt_ctx *ctx, float max_norm, float *norm_out)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (!(max_norm > 0))
        return set_error(ctx, DT_EINVAL, "clip_grad_norm: max_norm %g must be > 0", (double)max_norm);
    if (optim_grads_sharded(ctx))
        return optim_clip_shards(ctx, max_norm, norm_out);
    double total = 0;
    for (int i = 0; i < ctx->n_params; i++) {
        dt_tensor *g = ctx->params[i]->grad;
        if (g && !(g->flags & T_ZERO))
            total += BE(ctx)->sumsq(BEI(ctx), shape_numel(g->ndim, g->shape), FP(g));
    }
    dt_status fs = be_fault(ctx, "clip_grad_norm");
    if (fs != DT_OK)
        return fs;
    double norm = sqrt(total);
    if (norm_out)
        *norm_out = (float)norm;
    double coef = max_norm / (norm + 1e-6);
    if (coef < 1.0) {
        for (int i = 0; i < ctx->n_params; i++) {
            dt_tensor *g = ctx->params[i]->grad;
            if (g && !(g->flags & T_ZERO))
                BE(ctx)->axpby(BEI(ctx), shape_numel(g->ndim, g->shape), (float)coef, FP(g), 0.0f,
                               FP(g));
        }
    }
    return DT_OK;
}

void dt_loss_scale_config_init(dt_loss_scale_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->struct_size = sizeof *cfg;
    cfg->init_scale = 65536.0f;
    cfg->growth_factor = 2.0f;
    cfg->backoff_factor = 0.5f;
    cfg->growth_interval = 2000;
}

dt_loss_scaler *dt_loss_scaler_new(dt_ctx *ctx, const dt_loss_scale_config *cfg)
{
    if (!ctx_ok(ctx))
        return NULL;
    dt_loss_scale_config c;
    dt_loss_scale_config_init(&c);
    if (cfg && ctx_config_in(ctx, &c, sizeof c, cfg,
                             "loss_scaler", "dt_loss_scale_config") != DT_OK)
        return NULL;
    if (!(c.init_scale > 0) || !isfinite(c.init_scale) || !(c.growth_factor >= 1) ||
        !(c.backoff_factor > 0 && c.backoff_factor < 1) || c.growth_interval < 1) {
        set_error(ctx, DT_EINVAL, "loss_scaler: init_scale %g, growth %g, backoff %g, interval %d: "
                  "need scale > 0, growth >= 1, 0 < backoff < 1, interval >= 1",
                  (double)c.init_scale, (double)c.growth_factor, (double)c.backoff_factor,
                  c.growth_interval);
        return NULL;
    }
    dt_loss_scaler *sc = host_calloc(ctx, sizeof *sc);
    if (!sc) {
        set_error(ctx, DT_ENOMEM, "loss_scaler: out of memory");
        return NULL;
    }
    sc->ctx = ctx;
    sc->cfg = c;
    sc->scale = c.init_scale;
    return sc;
}

void dt_loss_scaler_free(dt_loss_scaler *sc)
{
    if (sc)
        host_free(sc->ctx, sc);
}

float dt_loss_scaler_scale(const dt_loss_scaler *sc) { return sc ? sc->scale : NAN; }
int64_t dt_loss_scaler_skipped(const dt_loss_scaler *sc) { return sc ? sc->skipped : -1; }

dt_status dt_loss_scaler_backward(dt_loss_scaler *sc, dt_tensor *loss)
{
    if (!sc || !ctx_ok(sc->ctx))
        return DT_EINVAL;
    if (sc->unscaled)
        return set_error(sc->ctx, DT_ESTATE, "loss_scaler_backward: this step's gradients are "
                         "already unscaled; step first (scaled ones would be added to them)");
    dt_status s = sc->ctx->hook_user ? sc->ctx->grad_hooks->before_unscale(sc->ctx->hook_user, 0) : DT_OK;
    if (s != DT_OK)
        return s;
    if ((s = tape_backward_seeded(sc->ctx, loss, sc->scale)) == DT_OK)
        sc->pending = 1;
    return s;
}

dt_status dt_loss_scaler_unscale(dt_loss_scaler *sc, int *found_inf)
{
    if (!sc || !ctx_ok(sc->ctx))
        return DT_EINVAL;
    dt_ctx *ctx = sc->ctx;
    if (!sc->pending)
        return set_error(ctx, DT_ESTATE, "loss_scaler: no dt_loss_scaler_backward since the last "
                         "step");
    dt_status s = ctx->hook_user ? ctx->grad_hooks->before_unscale(ctx->hook_user, 1) : DT_OK;   /* reduced first */
    if (s != DT_OK)
        return s;
    if (!sc->unscaled && optim_grads_sharded(ctx)) {   /* each rank its shard; the check is global */
        double total = 0;
        ctx->grad_hooks->grad_scale(ctx->hook_user, 1.0f / sc->scale);
        if ((s = ctx->grad_hooks->grad_sumsq(ctx->hook_user, &total)) != DT_OK)
            return s;
        sc->found_inf = !isfinite(total);
        sc->unscaled = 1;
    }
    if (!sc->unscaled) {
        double total = 0;
        for (int i = 0; i < ctx->n_params; i++) {
            dt_tensor *g = ctx->params[i]->grad;
            if (!g || (g->flags & T_ZERO))
                continue;
            int64_t n = shape_numel(g->ndim, g->shape);
            BE(ctx)->axpby(BEI(ctx), n, 1.0f / sc->scale, FP(g), 0.0f, FP(g));
            total += BE(ctx)->sumsq(BEI(ctx), n, FP(g));
        }
        dt_status fs = be_fault(ctx, "loss_scaler");
        if (fs != DT_OK)
            return fs;
        sc->found_inf = !isfinite(total);
        sc->unscaled = 1;
    }
    if (found_inf)
        *found_inf = sc->found_inf;
    return DT_OK;
}

dt_status dt_loss_scaler_step(dt_loss_scaler *sc, dt_optim *opt, int *stepped)
{
    if (stepped)
        *stepped = 0;
    if (!sc || !ctx_ok(sc->ctx))
        return DT_EINVAL;
    if (!opt || opt->ctx != sc->ctx)
        return set_error(sc->ctx, DT_EINVAL, "loss_scaler_step: %s",
                         opt ? "the optimizer belongs to another context" : "optimizer is NULL");
    int inf;
    dt_status s = dt_loss_scaler_unscale(sc, &inf);
    if (s != DT_OK)
        return s;
    sc->unscaled = sc->pending = 0;
    if (inf) {   /* skip: these gradients are garbage; a smaller scale next time */
        sc->scale *= sc->cfg.backoff_factor;
        sc->good_steps = 0;
        sc->skipped++;
        return DT_OK;
    }
    if ((s = dt_optim_step(opt)) != DT_OK)
        return s;
    if (stepped)
        *stepped = 1;
    if (++sc->good_steps >= sc->cfg.growth_interval) {
        float grown = sc->scale * sc->cfg.growth_factor;
        if (isfinite(grown))
            sc->scale = grown;
        sc->good_steps = 0;
    }
    return DT_OK;
}

