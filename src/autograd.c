#include "internal.h"

/* ===========================================================================
 * The autograd tape and backward
 *
 * Define-by-run: each op that has an input requiring grad appends a node to
 * the tape.  Creation order is a topological order, so backward walks the
 * tape newest-first and runs each node whose output received a gradient.
 * Gradient buffers are written on first touch (acc = 0) and added to after
 * (acc = 1), so nothing needs zeroing up front.
 * ======================================================================== */

DT_PRIVATE int tape_tracks(const dt_ctx *ctx, const dt_tensor *t)
{
    return ctx->grad_enabled && t && (t->flags & T_REQGRAD);
}

DT_PRIVATE int tape_node_reads(const dt_node *n, dt_tensor *const **out)
{
    if (n->reads_aside) {
        *out = n->reads;
        return n->n_reads;
    }
    *out = n->in;
    return n->n_in;
}

DT_PRIVATE void tape_set_reads(dt_node *n, dt_tensor *const *reads, int count)
{
    n->reads = reads;
    n->n_reads = count;
    n->reads_aside = 1;
}

DT_PRIVATE void tape_set_prec(dt_node *n, dt_precision prec) { n->prec = prec; }

DT_PRIVATE void tape_param_uses(const dt_ctx *ctx, int *uses, int nparams)
{
    for (const dt_node *n = ctx->tape; n; n = n->prev) {
        dt_tensor *const *in;
        int nin = tape_node_reads(n, &in);
        for (int k = 0; k < nin; k++)
            if (in[k] && (in[k]->flags & T_PARAM) && in[k]->ctx == ctx && in[k]->param_index < nparams)
                uses[in[k]->param_index]++;
    }
}

DT_PRIVATE dt_node *tape_record(dt_ctx *ctx, const char *op, dt_backward_fn bw, dt_tensor *out,
                       dt_tensor *a, dt_tensor *b, dt_tensor *c)
{
    dt_node *n = arena_alloc(ctx, ctx->cur_host, sizeof *n);
    if (!n) {
        set_error(ctx, DT_ENOMEM, "%s: out of host memory for the tape", op);
        return NULL;
    }
    memset(n, 0, sizeof *n);
    n->op = op;
    n->backward = bw;
    n->prec = ctx->autocast;
    n->out = out;
    dt_tensor *ins[3] = {a, b, c};
    for (int i = 0; i < 3; i++)
        if (ins[i])
            n->in[n->n_in++] = ins[i];
    n->prev = ctx_swap_tape(ctx, n);
    tensor_set_node(out, n);
    tensor_require_grad(out);
    return n;
}

DT_PRIVATE dt_node *tape_record_op(dt_ctx *ctx, const char *op, dt_backward_fn bw, dt_tensor *out,
                           dt_tensor *a, dt_tensor *b, dt_tensor *c, const void *state,
                           size_t size)
{
    void *st = arena_alloc(ctx, ctx->cur_host, size);
    if (!st) {
        set_error(ctx, DT_ENOMEM, "%s: out of host memory for the tape", op);
        return NULL;
    }
    memcpy(st, state, size);
    dt_node *n = tape_record(ctx, op, bw, out, a, b, c);
    if (n)
        n->state = st;
    return n;
}

/* The gradient buffer of t for a backward to write; *acc says whether it
 * already holds values to add to. */
DT_PRIVATE float *grad_target(dt_ctx *ctx, dt_tensor *t, int *acc)
{
    tensor_rows_all(t);   /* this op may write every row */
    if (!t->grad) {
        dt_tensor *g = tensor_step_new_reusing(ctx, DT_F32, t->ndim, t->shape);
        if (!g)
            return NULL;
        tensor_mark_zero(g, 1);
        tensor_set_grad(t, g);
    }
    /* a sharded DDP lends a parameter's gradient memory only from its
     * first write of the step (src/zero.c) */
    if ((t->flags & T_PARAM) && (t->grad->flags & T_ZERO) && ctx->hook_user &&
        ctx->grad_hooks->grad_memory && ctx->grad_hooks->grad_memory(ctx->hook_user, t) != DT_OK)
        return NULL;
    *acc = !(t->grad->flags & T_ZERO);
    tensor_mark_zero(t->grad, 0);
    return FP(t->grad);
}

/* Same, for kernels that can only add: the buffer is zeroed first if new. */
DT_PRIVATE float *grad_target_zeroed(dt_ctx *ctx, dt_tensor *t)
{
    int acc;
    float *g = grad_target(ctx, t, &acc);
    if (g && !acc)
        BE(ctx)->memset0(BEI(ctx), g, tensor_bytes(t->grad));
    return g;
}

DT_PRIVATE int grad_needed(const dt_tensor *t) { return t && (t->flags & T_REQGRAD); }

/* Once node n has run, nobody reads its output's gradient again (the tape
 * runs newest first and every reader of n->out comes after n), so its
 * memory goes back to the arena for the gradients still to come, as
 * PyTorch frees a non-leaf's grad.  Kept: leaves, persistent tensors,
 * outputs a later node re-recorded, and dt_tensor_retain_grad's. */
static void grad_release(dt_ctx *ctx, dt_node *n)
{
    dt_tensor *t = n->out, *g = t->grad;
    if (!g || t->node != n || (t->flags & (T_PERSIST | T_RETAIN)) || (g->flags & T_PERSIST))
        return;
    size_t bytes = tensor_bytes(g);
    if (arena_step_give_back(ctx, g->data, bytes))
        tensor_set_grad(t, NULL);
}

/* With hooked (the top-level walk only), the attached DDP hears of every
 * node once it is done, so it can start a bucket's allreduce when its
 * gradients are final (dt_grad_hooks). */
DT_PRIVATE dt_status tape_run(dt_ctx *ctx, dt_node *tail, dt_node *stop, int hooked)
{
    for (dt_node *n = tail; n && n != stop; n = n->prev) {
        dt_tensor *g = n->out->grad;
        if (g && !(g->flags & T_ZERO)) {   /* else no gradient reached this op */
            /* parameters held as shards (zero 3) are gathered for it first */
            dt_status s = ctx->hook_user && ctx->grad_hooks->node_params
                              ? ctx->grad_hooks->node_params(ctx->hook_user, n) : DT_OK;
            if (s == DT_OK)
                s = n->backward(ctx, n);
            if (s != DT_OK)
                return s;
        }
        if (hooked && ctx->hook_user)
            ctx->grad_hooks->node_done(ctx->hook_user, n);
        grad_release(ctx, n);
    }
    return DT_OK;
}

dt_status dt_backward(dt_ctx *ctx, dt_tensor *loss) { return tape_backward_seeded(ctx, loss, 1.0f); }

static dt_status backward_run(dt_ctx *ctx, dt_tensor *loss, float seed);

/* Backward from loss with d(loss) = seed (1, or a loss scale). */
DT_PRIVATE dt_status tape_backward_seeded(dt_ctx *ctx, dt_tensor *loss, float seed)
{
    if (ctx)
        ctx_backward_begun(ctx);   /* arena_grew's count */
    double t0 = ctx && ctx_ok(ctx) ? prof_begin(ctx) : 0;
    int act = ctx_doing(ctx, ACT_BACKWARD);
    dt_status s = backward_run(ctx, loss, seed);
    ctx_done(ctx, act);
    if (s == DT_OK && ctx)
        s = be_fault(ctx, "backward");
    if (t0 != 0)
        prof_end(ctx, PH_BACKWARD, t0);
    return s;
}

static dt_status backward_run(dt_ctx *ctx, dt_tensor *loss, float seed)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (!loss)
        return set_error(ctx, DT_EINVAL, "backward: loss is NULL");
    if (loss->ctx != ctx)
        return set_error(ctx, DT_EINVAL, "backward: loss belongs to another context");
    if (shape_numel(loss->ndim, loss->shape) != 1 || loss->dtype != DT_F32) {
        char sb[96];
        return set_error(ctx, DT_EINVAL, "backward: loss must be one f32 value, got %s %s",
                         dt_dtype_name(loss->dtype), SHAPE(loss, sb));
    }
    if (!(loss->flags & T_REQGRAD))
        return set_error(ctx, DT_EINVAL, "backward: loss does not require grad "
                                         "(no parameter reached it, or grad was disabled)");
    if (!loss->node && !(loss->flags & T_PERSIST))
        return set_error(ctx, DT_ESTATE, "backward: this loss's graph was already used by "
                                         "dt_backward; run the forward again");
    return tape_backward(ctx, loss, NULL, seed);
}

/* A backward ended with s: what to report (the attached DDP's say). */
static dt_status backward_ended(dt_ctx *ctx, dt_status s)
{
    return ctx->hook_user ? ctx->grad_hooks->backward_end(ctx->hook_user, s) : s;
}

/* Run ctx->tape backward from out, whose gradient is seed_grad (device
 * memory, out's shape, contiguous) or else the constant seed, and consume
 * the tape.  A pipeline (src/parallel.c) calls it with one micro-batch's tape. */
DT_PRIVATE dt_status tape_backward(dt_ctx *ctx, dt_tensor *out, const float *seed_grad, float seed)
{
    if (ctx->hook_user) {
        dt_status s = ctx->grad_hooks->backward_begin(ctx->hook_user);
        if (s != DT_OK)
            return s;
    }
    int acc;
    float *g = grad_target(ctx, out, &acc);
    if (!g)
        return backward_ended(ctx, ctx->last_status);
    int64_t n = shape_numel(out->ndim, out->shape);
    if (seed_grad) {
        BE(ctx)->axpby(BEI(ctx), n, 1.0f, seed_grad, acc ? 1.0f : 0.0f, g);
    } else if (acc) {
        float one = 1.0f;
        float *tmp = arena_alloc(ctx, ctx->cur_dev, sizeof one);
        if (!tmp) {
            set_error(ctx, DT_ENOMEM, "backward: out of memory");
            return backward_ended(ctx, DT_ENOMEM);
        }
        BE(ctx)->to_device(BEI(ctx), tmp, &one, sizeof one);
        BE(ctx)->axpby(BEI(ctx), 1, seed, tmp, 1.0f, g);
    } else {
        BE(ctx)->fill(BEI(ctx), 1, seed, g);
    }
    dt_status s = tape_run(ctx, ctx->tape, NULL, 1);
    /* The tape is consumed: its outputs become plain tensors, so a second
     * backward through the same graph is refused instead of double-counting. */
    for (dt_node *n = ctx->tape; n; n = n->prev)
        tensor_set_node(n->out, NULL);
    ctx_swap_tape(ctx, NULL);
    return backward_ended(ctx, s);
}

