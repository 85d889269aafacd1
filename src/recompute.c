#include "internal.h"

/* ===========================================================================
 * Activation checkpointing (recompute)
 *
 * The segment runs once with grad off and its intermediates in a scratch
 * arena that is emptied right after; only the output is copied to the step
 * arena.  Backward runs the segment again with grad on (the same dropout
 * masks, from the saved counter), back-propagates through that sub-tape, and
 * empties the scratch arena again.  Peak memory drops by the segment's
 * activations; the cost is one more forward of the segment.
 * ======================================================================== */

/* --- src/recompute.c --- */

struct arena_switch {
    dt_arena *dev, *host;
    dt_arena_mark dev_mark, host_mark;
};

static arena_switch enter_scratch(dt_ctx *ctx)
{
    arena_switch sw = {ctx->cur_dev, ctx->cur_host, arena_mark(&ctx->scratch_dev),
                       arena_mark(&ctx->scratch_host)};
    ctx->cur_dev = &ctx->scratch_dev;
    ctx->cur_host = &ctx->scratch_host;
    return sw;
}

static void leave_scratch(dt_ctx *ctx, arena_switch sw, int release)
{
    ctx->cur_dev = sw.dev;
    ctx->cur_host = sw.host;
    if (release) {
        arena_release(&ctx->scratch_dev, sw.dev_mark);
        arena_release(&ctx->scratch_host, sw.host_mark);
    }
}

/* A segment's node state: its inputs as given, the dropout counter it
 * started from, and its function with the user's pointer (the parameters
 * its ops read are the node's reads: its backward finishes them all). */
typedef struct recompute_state {
    dt_tensor **inputs;
    int n;
    uint64_t counter;
    dt_segment_fn fn;
    void *user;
} recompute_state;

static dt_status recompute_backward(dt_ctx *ctx, dt_node *nd)
{
    const recompute_state *st = nd->state;
    dt_tensor **orig = st->inputs, *y = nd->out;
    int n = st->n;
    arena_switch sw = enter_scratch(ctx);
    dt_node *saved_tape = ctx->tape;
    uint64_t saved_counter = ctx->dropout_counter;
    int saved_grad = ctx->grad_enabled;
    dt_status s = DT_OK;
    dt_tensor **leaf = arena_alloc(ctx, ctx->cur_host, sizeof(dt_tensor *) * (size_t)(n ? n : 1));
    if (!leaf) {
        s = set_error(ctx, DT_ENOMEM, "recompute: out of memory");
        goto done;
    }
    for (int i = 0; i < n; i++) {
        /* leaves sharing the inputs' data, so the sub-tape stops at them */
        if (!(leaf[i] = tensor_view_header(ctx, orig[i]))) {
            s = ctx->last_status;
            goto done;
        }
        if (grad_needed(orig[i]))
            leaf[i]->flags |= T_REQGRAD;
    }
    ctx->tape = NULL;
    ctx->dropout_counter = st->counter;
    ctx->grad_enabled = 1;
    ctx->in_recompute = 1;
    dt_precision saved_prec = ctx->autocast;   /* rerun as the forward ran */
    ctx->autocast = nd->prec;
    dt_tensor *y2 = st->fn(ctx, leaf, n, st->user);
    ctx->autocast = saved_prec;
    ctx->in_recompute = 0;
    ctx->grad_enabled = saved_grad;
    ctx->dropout_counter = saved_counter;
    if (!y2 || y2->ndim != y->ndim || memcmp(y2->shape, y->shape, sizeof(int64_t) * (size_t)y->ndim)) {
        s = y2 ? set_error(ctx, DT_ESTATE, "recompute: the segment returned a different shape "
                                           "when run again (it must be deterministic)")
               : ctx->last_status;
        goto done;
    }
    y2->grad = y->grad;                    /* seed with the segment output's gradient */
    ctx->seg_backward++;
    s = tape_run(ctx, ctx->tape, NULL, 0);
    ctx->seg_backward--;
    ctx->cur_dev = sw.dev;                 /* input gradients go to the step arena */
    ctx->cur_host = sw.host;
    for (int i = 0; s == DT_OK && i < n; i++) {
        dt_tensor *g = leaf[i]->grad;
        if (grad_needed(orig[i]) && g && !(g->flags & T_ZERO) && leaf[i] != y2)
            s = op_acc_grad(ctx, orig[i], FP(g), 1.0f);
        else if (grad_needed(orig[i]) && leaf[i] == y2)
            s = op_acc_grad(ctx, orig[i], FP(y->grad), 1.0f);
    }
done:
    ctx->tape = saved_tape;
    leave_scratch(ctx, sw, 1);
    return s;
}

dt_tensor *dt_recompute(dt_ctx *ctx, dt_segment_fn fn, dt_tensor *const *inputs, int n, void *user)
{
    if (!ctx_ok(ctx))
        return NULL;
    if (!fn || n < 0 || (n > 0 && !inputs)) {
        set_error(ctx, DT_EINVAL, "recompute: needs a function and %d inputs", n);
        return NULL;
    }
    if (!ctx->grad_enabled || ctx->in_recompute) {
        dt_tensor *y = fn(ctx, inputs, n, user);
        if (!y && ctx->last_status == DT_OK)
            set_error(ctx, DT_EINVAL, "recompute: the segment function returned NULL");
        return y;
    }
    int track = 0;
    for (int i = 0; i < n; i++) {
        if (!op_input_ok(ctx, "recompute", inputs[i], "an input"))
            return NULL;
        track |= tape_tracks(ctx, inputs[i]);
    }
    uint64_t counter = ctx->dropout_counter;
    dt_precision prec = ctx->autocast;   /* the rerun starts as this run did */
    /* the parameters fn reads (op_input_ok notes them): what its node's
     * backward finishes, for a DDP to know (node_params in its node) */
    dt_tensor **params = arena_alloc(ctx, ctx->cur_host,
                                     sizeof(dt_tensor *) * (size_t)(ctx->n_params ? ctx->n_params : 1));
    if (!params) {
        set_error(ctx, DT_ENOMEM, "recompute: out of memory");
        return NULL;
    }
    arena_switch sw = enter_scratch(ctx);
    ctx->grad_enabled = 0;
    ctx->seg_params = params;
    ctx->seg_nparams = 0;
    dt_tensor *out = fn(ctx, inputs, n, user);
    int nparams = ctx->seg_nparams;
    ctx->seg_params = NULL;
    ctx->grad_enabled = 1;
    ctx->cur_dev = sw.dev;
    ctx->cur_host = sw.host;
    if (!out && ctx->last_status == DT_OK)
        set_error(ctx, DT_EINVAL, "recompute: the segment function returned NULL");
    dt_tensor *y = out ? op_like(ctx, out) : NULL;
    if (y)
        BE(ctx)->copy_strided(BEI(ctx), out->ndim, out->shape, dt_dtype_size(out->dtype), y->data,
                              y->stride, out->data, out->stride, 0);
    leave_scratch(ctx, sw, 1);
    if (!y || y->dtype != DT_F32)
        return y;
    (void)track;   /* parameters inside fn may need grads even if no input does */
    dt_tensor **saved = arena_alloc(ctx, ctx->cur_host, sizeof(dt_tensor *) * (size_t)(n ? n : 1));
    if (!saved) {
        set_error(ctx, DT_ENOMEM, "recompute: out of memory for the tape");
        return NULL;
    }
    if (n)
        memcpy(saved, inputs, sizeof(dt_tensor *) * (size_t)n);
    dt_node *nd = tape_record_op(ctx, "recompute", recompute_backward, y, NULL, NULL, NULL,
                                 &(recompute_state){saved, n, counter, fn, user},
                                 sizeof(recompute_state));
    if (!nd)
        return NULL;
    tape_set_prec(nd, prec);
    tape_set_reads(nd, params, nparams);   /* its backward finishes them all */
    return y;
}

