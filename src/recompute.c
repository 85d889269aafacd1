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

/* Which run of a segment is in progress (the context's CTX_EXT_RECOMPUTE
 * slot, made by the first dt_recompute that records). */
typedef struct recompute_runs {
    int rerun;      /* a backward is running a segment's function again */
    int backward;   /* a segment's own backward (its sub-tape) is running */
} recompute_runs;

DT_PRIVATE int recompute_in_backward(const dt_ctx *ctx)
{
    const recompute_runs *r = ctx_ext(ctx, CTX_EXT_RECOMPUTE);
    return r && r->backward;
}

struct arena_switch {
    dt_arena *dev, *host;              /* where step tensors came from before */
    dt_arena *sdev, *shost;            /* the scratch arenas, and where they stood */
    dt_arena_mark dev_mark, host_mark;
};

static arena_switch enter_scratch(dt_ctx *ctx)
{
    arena_switch sw;
    ctx_scratch_arenas(ctx, &sw.sdev, &sw.shost);
    sw.dev_mark = arena_mark(sw.sdev);
    sw.host_mark = arena_mark(sw.shost);
    sw.dev = sw.sdev;
    sw.host = sw.shost;
    ctx_swap_arenas(ctx, &sw.dev, &sw.host);
    return sw;
}

/* Step tensors from the arenas of before again (the scratch ones keep
 * what is in them until leave_scratch). */
static void scratch_pause(dt_ctx *ctx, const arena_switch *sw)
{
    dt_arena *dev = sw->dev, *host = sw->host;
    ctx_swap_arenas(ctx, &dev, &host);
}

static void leave_scratch(dt_ctx *ctx, arena_switch sw, int release)
{
    scratch_pause(ctx, &sw);
    if (release) {
        arena_release(sw.sdev, sw.dev_mark);
        arena_release(sw.shost, sw.host_mark);
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
    recompute_runs *runs = ctx_ext(ctx, CTX_EXT_RECOMPUTE);   /* (made when nd was recorded) */
    arena_switch sw = enter_scratch(ctx);
    dt_node *saved_tape = ctx->tape;
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
            tensor_require_grad(leaf[i]);
    }
    ctx_swap_tape(ctx, NULL);
    uint64_t saved_counter = ctx_swap_dropout_counter(ctx, st->counter);
    int saved_grad = ctx_swap_grad_enabled(ctx, 1);
    runs->rerun = 1;
    dt_precision saved_prec = ctx_swap_autocast(ctx, nd->prec);   /* rerun as the forward ran */
    dt_tensor *y2 = st->fn(ctx, leaf, n, st->user);
    ctx_swap_autocast(ctx, saved_prec);
    runs->rerun = 0;
    ctx_swap_grad_enabled(ctx, saved_grad);
    ctx_swap_dropout_counter(ctx, saved_counter);
    if (!y2 || y2->ndim != y->ndim || memcmp(y2->shape, y->shape, sizeof(int64_t) * (size_t)y->ndim)) {
        s = y2 ? set_error(ctx, DT_ESTATE, "recompute: the segment returned a different shape "
                                           "when run again (it must be deterministic)")
               : ctx->last_status;
        goto done;
    }
    tensor_set_grad(y2, y->grad);          /* seed with the segment output's gradient */
    runs->backward++;
    s = tape_run(ctx, ctx->tape, NULL, 0);
    runs->backward--;
    scratch_pause(ctx, &sw);               /* input gradients go to the step arena */
    for (int i = 0; s == DT_OK && i < n; i++) {
        dt_tensor *g = leaf[i]->grad;
        if (grad_needed(orig[i]) && g && !(g->flags & T_ZERO) && leaf[i] != y2)
            s = op_acc_grad(ctx, orig[i], FP(g), 1.0f);
        else if (grad_needed(orig[i]) && leaf[i] == y2)
            s = op_acc_grad(ctx, orig[i], FP(y->grad), 1.0f);
    }
done:
    ctx_swap_tape(ctx, saved_tape);
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
    const recompute_runs *r = ctx_ext(ctx, CTX_EXT_RECOMPUTE);
    if (!ctx->grad_enabled || (r && r->rerun)) {
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
    if (!ctx_ext_make(ctx, CTX_EXT_RECOMPUTE, sizeof(recompute_runs), NULL))
        return NULL;
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
    ctx_swap_grad_enabled(ctx, 0);
    ctx_note_params(ctx, params);
    dt_tensor *out = fn(ctx, inputs, n, user);
    int nparams = ctx_note_params(ctx, NULL);
    ctx_swap_grad_enabled(ctx, 1);
    scratch_pause(ctx, &sw);
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

