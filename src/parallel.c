#include "dist.h"

/* ===========================================================================
 * Model parallelism: pipelines and tensor-parallel layers
 *
 * A pipeline stage runs each micro-batch's forward on an empty tape of its
 * own and in arenas of its own: one slot per micro-batch it may hold at once
 * (all m for GPipe, stages - stage for 1F1B), so a micro-batch's backward
 * runs its tape alone, and its memory is reused by a later micro-batch once
 * that backward is done.  Activations and gradients travel through two host
 * buffers of the pipeline's; a step's first activation is preceded by a
 * header (the batch, m, the schedule, the output's shape) so the next stage
 * knows what to receive.  Tensor-parallel ops are autograd ops whose forward
 * or backward is a collective on a host copy.
 * ======================================================================== */

/* --- src/parallel.c --- */

struct pipe_slot {
    dt_arena dev, host;
    int busy;                  /* holds a micro-batch whose backward has not run */
};

struct pipe_mb {
    int64_t off, rows;         /* its rows of the batch */
    dt_tensor *in;             /* stage > 0: the received activation (a leaf) */
    dt_tensor *out;            /* the stage's output, or the loss on the last stage */
    dt_node *tape;             /* its forward's tape, until its backward */
};

/* --- a pipeline's micro-batch forward and backward ------------------------------ */

struct pipe_arenas {
    dt_arena *dev, *host;
    dt_node *tape;
};

struct dt_pipe {
    dt_ctx *ctx;
    dt_comm *comm;
    dt_pipe_config cfg;
    dt_stage_fn fn;
    void *user;
    int stage, stages;
    pipe_slot *slots;
    int nslots;
    pipe_mb *mb;
    int failed;                /* a step failed: the neighbours were told, no more steps */
    /* the step under way */
    int64_t batch;
    int in_ndim, out_ndim;     /* the input's (stage > 0) and output's (not last) shapes, */
    int64_t in_shape[DT_MAX_DIMS], out_shape[DT_MAX_DIMS];   /* dim 0: micro-batch 0's rows */
    int header_sent, header_recvd;
    float *sbuf, *rbuf;        /* host staging of what is sent and received */
    int64_t sbuf_n, rbuf_n;
    double loss, wait_s, compute_s;
    uint64_t bytes;
    dt_pipe_stats st;
};

/* --- the pipeline's state ----------------------------------------------- */

#define PIPE_MAGIC 7919.0f
#define PIPE_HEADER (5 + DT_MAX_DIMS)   /* magic, B, m, schedule, ndim, shape */

void dt_pipe_config_init(dt_pipe_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->struct_size = sizeof *cfg;
    cfg->micro_batches = 4;
    cfg->schedule = DT_PIPE_1F1B;
}

static int pipe_last(const dt_pipe *p) { return p->stage == p->stages - 1; }

dt_pipe *dt_pipe_new(dt_ctx *ctx, dt_comm *c, const dt_pipe_config *cfg_in, dt_stage_fn fn,
                     void *user)
{
    if (!ctx_ok(ctx))
        return NULL;
    dt_pipe_config cfg;
    dt_pipe_config_init(&cfg);
    if (cfg_in && ctx_config_in(ctx, &cfg, sizeof cfg, cfg_in,
                                "pipe_new", "dt_pipe_config") != DT_OK)
        return NULL;
    if (!c || !fn || comm_ctx(c) != ctx) {
        set_error(ctx, DT_EINVAL, "pipe_new: %s", !c ? "communicator is NULL" : !fn
                  ? "stage function is NULL" : "the communicator belongs to another context");
        return NULL;
    }
    if (cfg.micro_batches < 1 || (cfg.schedule != DT_PIPE_GPIPE && cfg.schedule != DT_PIPE_1F1B)) {
        set_error(ctx, DT_EINVAL, "pipe_new: micro_batches %d (must be >= 1) or schedule %d "
                  "unknown", cfg.micro_batches, (int)cfg.schedule);
        return NULL;
    }
    dt_pipe *p = host_calloc(ctx, sizeof *p);
    if (!p) {
        set_error(ctx, DT_ENOMEM, "pipe_new: out of memory");
        return NULL;
    }
    p->ctx = ctx;
    p->comm = c;
    p->cfg = cfg;
    p->fn = fn;
    p->user = user;
    p->stage = dt_comm_rank(c);
    p->stages = dt_comm_size(c);
    int m = cfg.micro_batches, hold = p->stages - p->stage;
    p->nslots = cfg.schedule == DT_PIPE_GPIPE || m < hold ? m : hold;
    p->slots = host_calloc(ctx, sizeof *p->slots * (size_t)p->nslots);
    p->mb = host_calloc(ctx, sizeof *p->mb * (size_t)m);
    if (!p->slots || !p->mb) {
        dt_pipe_free(p);
        set_error(ctx, DT_ENOMEM, "pipe_new: out of memory");
        return NULL;
    }
    for (int i = 0; i < p->nslots; i++) {
        ctx_arena_init(&p->slots[i].dev, 1, (size_t)1 << 20);
        ctx_arena_init(&p->slots[i].host, 0, (size_t)64 << 10);
    }
    return p;
}

void dt_pipe_free(dt_pipe *p)
{
    if (!p)
        return;
    dt_ctx *ctx = p->ctx;
    for (int i = 0; p->slots && i < p->nslots; i++) {
        arena_destroy(ctx, &p->slots[i].dev);
        arena_destroy(ctx, &p->slots[i].host);
    }
    host_free(ctx, p->slots);
    host_free(ctx, p->mb);
    host_free(ctx, p->sbuf);
    host_free(ctx, p->rbuf);
    host_free(ctx, p);
}

int dt_pipe_stage(const dt_pipe *p) { return p ? p->stage : -1; }
int dt_pipe_stages(const dt_pipe *p) { return p ? p->stages : 0; }

dt_status dt_pipe_stats_get(const dt_pipe *p, dt_pipe_stats *out)
{
    if (!p || !out)
        return DT_EINVAL;
    *out = p->st;
    out->bubble = p->st.step_s > 0 ? p->st.wait_s / p->st.step_s : 0;
    int m = p->cfg.micro_batches;
    out->bubble_ideal = (double)(p->stages - 1) / (double)(m + p->stages - 1);
    return DT_OK;
}

void dt_pipe_stats_reset(dt_pipe *p)
{
    if (p)
        memset(&p->st, 0, sizeof p->st);
}

/* --- messages between stages --------------------------------------------- */

static dt_status pipe_reserve(dt_pipe *p, float **buf, int64_t *cap, int64_t n)
{
    if (n <= *cap)
        return DT_OK;
    float *fresh = host_alloc(p->ctx, (size_t)n * sizeof(float));
    if (!fresh)
        return set_error(p->ctx, DT_ENOMEM, "pipe_step: out of host memory for a %lld-float "
                         "message", (long long)n);
    host_free(p->ctx, *buf);
    *buf = fresh;
    *cap = n;
    return DT_OK;
}

static int64_t shape_tail(int ndim, const int64_t *shape)   /* floats per row */
{
    return ndim > 1 ? shape_numel(ndim - 1, shape + 1) : 1;
}

/* Send ns floats of sbuf to dst and/or receive nr into rbuf from src (-1:
 * none), timed as waiting on a neighbour: the bubble. */
static dt_status pipe_p2p(dt_pipe *p, const float *send, int64_t ns, int dst, float *recv,
                          int64_t nr, int src)
{
    dt_ctx *ctx = p->ctx;
    double t0 = prof_begin(ctx), w0 = dt_now();
    dt_status s = comm_p2p_run(p->comm, send, ns, dst, recv, nr, src);
    double w = dt_now() - w0;
    p->wait_s += w;
    prof_pipe_wait(ctx, t0);   /* (a wait before the first step opens counts nowhere) */
    prof_end(ctx, PH_COMM_WAIT, t0);
    if (dst >= 0)
        p->bytes += (uint64_t)ns * sizeof(float);
    return s;
}

static dt_status pipe_xfer(dt_pipe *p, int64_t ns, int dst, int64_t nr, int src)
{
    if (src >= 0 && pipe_reserve(p, &p->rbuf, &p->rbuf_n, nr) != DT_OK)
        return p->ctx->last_status;
    return pipe_p2p(p, dst >= 0 ? p->sbuf : NULL, dst >= 0 ? ns : 0, dst,
                    src >= 0 ? p->rbuf : NULL, src >= 0 ? nr : 0, src);
}

static int64_t pipe_in_floats(const dt_pipe *p, int i)
{
    return p->mb[i].rows * shape_tail(p->in_ndim, p->in_shape);
}

static int64_t pipe_out_floats(const dt_pipe *p, int i)
{
    return p->mb[i].rows * shape_tail(p->out_ndim, p->out_shape);
}

/* The step's header, before its first activation: what follows. */
static dt_status pipe_send_header(dt_pipe *p)
{
    float h[PIPE_HEADER] = {PIPE_MAGIC, (float)p->batch, (float)p->cfg.micro_batches,
                            (float)p->cfg.schedule, (float)p->out_ndim};
    for (int d = 0; d < p->out_ndim; d++)
        h[5 + d] = (float)p->out_shape[d];
    p->header_sent = 1;
    return pipe_p2p(p, h, PIPE_HEADER, p->stage + 1, NULL, 0, -1);
}

static dt_status pipe_recv_header(dt_pipe *p)
{
    dt_ctx *ctx = p->ctx;
    float h[PIPE_HEADER];
    dt_status s = pipe_p2p(p, NULL, 0, -1, h, PIPE_HEADER, p->stage - 1);
    if (s != DT_OK)
        return s;
    p->header_recvd = 1;
    int ndim = (int)h[4];
    if (h[0] != PIPE_MAGIC || ndim < 1 || ndim > DT_MAX_DIMS || !(h[1] >= 1) || h[1] > 16777216.0f)
        return set_error(ctx, DT_EPEER, "pipe_step: stage %d sent a malformed header",
                         p->stage - 1);
    if ((int)h[2] != p->cfg.micro_batches || (int)h[3] != (int)p->cfg.schedule)
        return set_error(ctx, DT_EMISMATCH, "pipe_step: stage %d runs %d micro-batches (%s), "
                         "stage %d %d (%s)", p->stage - 1, (int)h[2], (int)h[3] ? "1F1B" : "GPipe",
                         p->stage, p->cfg.micro_batches, p->cfg.schedule ? "1F1B" : "GPipe");
    if (p->batch > 0 && (int64_t)h[1] != p->batch)
        return set_error(ctx, DT_EMISMATCH, "pipe_step: stage 0's batch has %lld rows, the "
                         "targets here %lld", (long long)h[1], (long long)p->batch);
    p->batch = (int64_t)h[1];
    p->in_ndim = ndim;
    for (int d = 0; d < ndim; d++)
        p->in_shape[d] = (int64_t)h[5 + d];
    return DT_OK;
}

/* Run on micro-batch i's slot and tape (its forward's, or a fresh one). */
static pipe_arenas pipe_enter(dt_pipe *p, int i, dt_node *tape)
{
    pipe_slot *sl = &p->slots[i % p->nslots];
    pipe_arenas saved = {&sl->dev, &sl->host, NULL};
    ctx_swap_arenas(p->ctx, &saved.dev, &saved.host);
    saved.tape = ctx_swap_tape(p->ctx, tape);
    return saved;
}

static void pipe_leave(dt_pipe *p, pipe_arenas saved)
{
    ctx_swap_arenas(p->ctx, &saved.dev, &saved.host);
    ctx_swap_tape(p->ctx, saved.tape);
}

static dt_status pipe_output_ok(dt_pipe *p, int i, dt_tensor *out, uint64_t errors_before)
{
    dt_ctx *ctx = p->ctx;
    char sb[96];
    if (!out)
        return ctx->errors != errors_before ? ctx->last_status
               : set_error(ctx, DT_EINVAL, "pipe_step: stage %d's function returned NULL for "
                           "micro-batch %d", p->stage, i);
    if (out->ctx != ctx || out->dtype != DT_F32 || !(out->flags & T_REQGRAD))
        return set_error(ctx, DT_EINVAL, "pipe_step: stage %d's output for micro-batch %d %s",
                         p->stage, i, out->ctx != ctx ? "belongs to another context"
                         : out->dtype != DT_F32 ? "is not f32"
                         : "does not require grad (no parameter or input reached it)");
    if (pipe_last(p)) {
        if (shape_numel(out->ndim, out->shape) != 1)
            return set_error(ctx, DT_EINVAL, "pipe_step: the last stage must return the "
                             "micro-batch's loss (one value), got %s", SHAPE(out, sb));
        return DT_OK;
    }
    int same = out->ndim >= 1 && out->shape[0] == p->mb[i].rows;
    if (same && i > 0)
        same = out->ndim == p->out_ndim && !memcmp(out->shape + 1, p->out_shape + 1,
                                                   sizeof(int64_t) * (size_t)(out->ndim - 1));
    if (!same)
        return set_error(ctx, DT_EINVAL, "pipe_step: stage %d's output for micro-batch %d is %s: "
                         "it must have the micro-batch's %lld rows in dim 0%s", p->stage, i,
                         SHAPE(out, sb), (long long)p->mb[i].rows,
                         i > 0 ? " and micro-batch 0's other dims" : "");
    if (i == 0) {
        p->out_ndim = out->ndim;
        memcpy(p->out_shape, out->shape, sizeof(int64_t) * (size_t)out->ndim);
    }
    return DT_OK;
}

static dt_status pipe_forward_run(dt_pipe *p, int i, const dt_tensor *x, const dt_tensor *y)
{
    dt_ctx *ctx = p->ctx;
    pipe_mb *mb = &p->mb[i];
    dt_tensor *xi, *yi = NULL;
    if (p->stage == 0) {
        xi = dt_slice(ctx, (dt_tensor *)x, 0, mb->off, mb->off + mb->rows);
    } else {
        int64_t shape[DT_MAX_DIMS];
        memcpy(shape, p->in_shape, sizeof shape);
        shape[0] = mb->rows;
        if ((xi = tensor_step_new(ctx, DT_F32, p->in_ndim, shape))) {
            be_to_device(ctx, xi->data, p->rbuf, tensor_bytes(xi));
            tensor_require_grad(xi);
        }
    }
    if (xi && pipe_last(p))
        yi = dt_slice(ctx, (dt_tensor *)y, 0, mb->off, mb->off + mb->rows);
    if (!xi || (pipe_last(p) && !yi))
        return ctx->last_status;
    mb->in = xi;
    double t0 = prof_begin(ctx), w0 = dt_now();
    uint64_t errors = ctx->errors;
    dt_tensor *out = p->fn(ctx, xi, yi, p->user);
    p->compute_s += dt_now() - w0;
    prof_end(ctx, PH_FORWARD, t0);
    dt_status s = pipe_output_ok(p, i, out, errors);
    if (s != DT_OK)
        return s;
    if (pipe_last(p)) {
        mb->out = out;
        p->loss += (double)dt_tensor_item(out) * (double)mb->rows / (double)p->batch;
        return DT_OK;
    }
    if (!(out = dt_contiguous(ctx, out)))
        return ctx->last_status;
    mb->out = out;
    tensor_materialize(out);
    if (pipe_reserve(p, &p->sbuf, &p->sbuf_n, pipe_out_floats(p, i)) != DT_OK)
        return ctx->last_status;
    be_to_host(ctx, p->sbuf, out->data, tensor_bytes(out));
    return DT_OK;
}

/* Account what the slots hold once a forward has added a micro-batch. */
static void pipe_count_held(dt_pipe *p)
{
    int held = 0;
    size_t bytes = 0;
    for (int k = 0; k < p->nslots; k++)
        if (p->slots[k].busy) {
            held++;
            bytes += arena_used(&p->slots[k].dev);
        }
    if (held > p->st.in_flight_peak)
        p->st.in_flight_peak = held;
    if (bytes > p->st.act_bytes_peak)
        p->st.act_bytes_peak = bytes;
}

/* Micro-batch i's forward; the input is in rbuf (stage > 0), the output
 * goes to sbuf (not the last stage). */
static dt_status pipe_forward(dt_pipe *p, int i, const dt_tensor *x, const dt_tensor *y)
{
    pipe_slot *sl = &p->slots[i % p->nslots];
    arena_reset(p->ctx, &sl->dev);
    arena_reset(p->ctx, &sl->host);
    sl->busy = 1;
    pipe_arenas saved = pipe_enter(p, i, NULL);
    dt_status s = pipe_forward_run(p, i, x, y);
    p->mb[i].tape = p->ctx->tape;
    pipe_leave(p, saved);
    pipe_count_held(p);
    return s;
}

/* Micro-batch i's backward from the gradient in rbuf (the last stage: from
 * its loss, weighted by its share of the batch); the input's gradient goes
 * to sbuf (stage > 0).  A DDP on the context reduces during the last one. */
static dt_status pipe_backward(dt_pipe *p, int i, int last_mb)
{
    dt_ctx *ctx = p->ctx;
    pipe_mb *mb = &p->mb[i];
    pipe_arenas saved = pipe_enter(p, i, mb->tape);
    const float *seed = NULL;
    dt_status s = DT_OK;
    if (!pipe_last(p)) {
        dt_tensor *g = op_like(ctx, mb->out);
        if (!g)
            s = ctx->last_status;
        else
            be_to_device(ctx, g->data, p->rbuf, tensor_bytes(g));
        seed = g ? FP(g) : NULL;
    }
    struct dt_ddp *d = ddp_attached(ctx);
    int sync = d ? ddp_sync_of(d) : 0;
    if (d)
        dt_ddp_set_sync(d, sync && last_mb);
    double t0 = prof_begin(ctx), w0 = dt_now();
    if (s == DT_OK)
        s = tape_backward(ctx, mb->out, seed, (float)((double)mb->rows / (double)p->batch));
    p->compute_s += dt_now() - w0;
    prof_end(ctx, PH_BACKWARD, t0);
    if (d)
        dt_ddp_set_sync(d, sync);
    mb->tape = NULL;
    if (s == DT_OK && p->stage > 0) {
        int64_t n = pipe_in_floats(p, i);
        dt_tensor *gx = mb->in->grad;
        if (pipe_reserve(p, &p->sbuf, &p->sbuf_n, n) != DT_OK)
            s = ctx->last_status;
        else if (!gx || (gx->flags & T_ZERO))   /* the output did not depend on the input */
            memset(p->sbuf, 0, (size_t)n * sizeof(float));
        else
            be_to_host(ctx, p->sbuf, gx->data, (size_t)n * sizeof(float));
    }
    pipe_leave(p, saved);
    p->slots[i % p->nslots].busy = 0;
    return s;
}

/* --- the schedules ------------------------------------------------------ */

static dt_status pipe_recv_fwd(dt_pipe *p, int i)
{
    if (p->stage == 0)
        return DT_OK;
    if (!p->header_recvd) {
        dt_status s = pipe_recv_header(p);
        if (s != DT_OK)
            return s;
    }
    return pipe_xfer(p, 0, -1, pipe_in_floats(p, i), p->stage - 1);
}

static dt_status pipe_send_fwd(dt_pipe *p, int i)
{
    if (pipe_last(p))
        return DT_OK;
    if (!p->header_sent) {
        dt_status s = pipe_send_header(p);
        if (s != DT_OK)
            return s;
    }
    return pipe_xfer(p, pipe_out_floats(p, i), p->stage + 1, 0, -1);
}

static dt_status pipe_recv_bwd(dt_pipe *p, int i)
{
    return pipe_last(p) ? DT_OK : pipe_xfer(p, 0, -1, pipe_out_floats(p, i), p->stage + 1);
}

static dt_status pipe_send_bwd(dt_pipe *p, int i)
{
    return p->stage == 0 ? DT_OK : pipe_xfer(p, pipe_in_floats(p, i), p->stage - 1, 0, -1);
}

/* 1F1B's steady state exchanges with one neighbour in one call (Megatron's
 * send_forward_recv_backward, send_backward_recv_forward): two stages
 * sending to each other at once cannot wait on each other. */
static dt_status pipe_send_fwd_recv_bwd(dt_pipe *p, int f, int b)
{
    return pipe_last(p) ? DT_OK : pipe_xfer(p, pipe_out_floats(p, f), p->stage + 1,
                                            pipe_out_floats(p, b), p->stage + 1);
}

static dt_status pipe_send_bwd_recv_fwd(dt_pipe *p, int b, int f)
{
    return p->stage == 0 ? DT_OK : pipe_xfer(p, pipe_in_floats(p, b), p->stage - 1,
                                             pipe_in_floats(p, f), p->stage - 1);
}

#define PIPE_TRY(call)             \
    do {                           \
        dt_status s_ = (call);     \
        if (s_ != DT_OK)           \
            return s_;             \
    } while (0)

/* GPipe: every forward, then every backward (in the same order, so both
 * schedules add the micro-batches' gradients alike). */
static dt_status pipe_run_gpipe(dt_pipe *p, const dt_tensor *x, const dt_tensor *y)
{
    int m = p->cfg.micro_batches;
    for (int i = 0; i < m; i++) {
        PIPE_TRY(pipe_recv_fwd(p, i));
        PIPE_TRY(pipe_forward(p, i, x, y));
        PIPE_TRY(pipe_send_fwd(p, i));
    }
    for (int i = 0; i < m; i++) {
        PIPE_TRY(pipe_recv_bwd(p, i));
        PIPE_TRY(pipe_backward(p, i, i == m - 1));
        PIPE_TRY(pipe_send_bwd(p, i));
    }
    return DT_OK;
}

/* 1F1B: stage s runs stages-s-1 forwards to fill the pipe, then alternates
 * one forward and one backward, then drains the backwards left. */
static dt_status pipe_run_1f1b(dt_pipe *p, const dt_tensor *x, const dt_tensor *y)
{
    int m = p->cfg.micro_batches, warm = p->stages - p->stage - 1;
    if (warm > m)
        warm = m;
    int rem = m - warm;
    for (int i = 0; i < warm; i++) {
        PIPE_TRY(pipe_recv_fwd(p, i));
        PIPE_TRY(pipe_forward(p, i, x, y));
        PIPE_TRY(pipe_send_fwd(p, i));
    }
    if (rem > 0)
        PIPE_TRY(pipe_recv_fwd(p, warm));
    for (int k = 0; k < rem; k++) {
        int f = warm + k;
        PIPE_TRY(pipe_forward(p, f, x, y));
        PIPE_TRY(p->header_sent || pipe_last(p) ? pipe_send_fwd_recv_bwd(p, f, k)
                                                : DT_ESTATE);   /* warm >= 1 sent it */
        PIPE_TRY(pipe_backward(p, k, k == m - 1));
        if (k == rem - 1)
            PIPE_TRY(pipe_send_bwd(p, k));
        else
            PIPE_TRY(pipe_send_bwd_recv_fwd(p, k, f + 1));
    }
    for (int k = rem; k < m; k++) {
        PIPE_TRY(pipe_recv_bwd(p, k));
        PIPE_TRY(pipe_backward(p, k, k == m - 1));
        PIPE_TRY(pipe_send_bwd(p, k));
    }
    return DT_OK;
}

/* --- a step ------------------------------------------------------------ */

static dt_status pipe_args_ok(dt_pipe *p, const dt_tensor *x, const dt_tensor *y)
{
    dt_ctx *ctx = p->ctx;
    if (!ctx->grad_enabled)
        return set_error(ctx, DT_ESTATE, "pipe_step: grad is disabled (a pipeline step trains)");
    p->batch = 0;
    if (p->stage == 0 && (!x || x->ctx != ctx || x->ndim < 1))
        return set_error(ctx, DT_EINVAL, "pipe_step: stage 0 needs the batch's inputs x%s",
                         x ? " (of this context, rows in dim 0)" : "");
    if (pipe_last(p) && (!y || y->ctx != ctx || y->ndim < 1))
        return set_error(ctx, DT_EINVAL, "pipe_step: the last stage needs the batch's targets y%s",
                         y ? " (of this context, rows in dim 0)" : "");
    if (p->stage == 0)
        p->batch = x->shape[0];
    if (pipe_last(p)) {
        if (p->batch && y->shape[0] != p->batch)
            return set_error(ctx, DT_EINVAL, "pipe_step: x has %lld rows, y %lld",
                             (long long)x->shape[0], (long long)y->shape[0]);
        p->batch = y->shape[0];
    }
    if (p->batch && (p->batch < p->cfg.micro_batches || p->batch > 16777216))
        return set_error(ctx, DT_EINVAL, "pipe_step: a batch of %lld rows cannot split into %d "
                         "micro-batches", (long long)p->batch, p->cfg.micro_batches);
    return DT_OK;
}

/* The micro-batches' rows, once the batch is known (stage 0 and the last
 * from their arguments, the others from the header). */
static void pipe_split_rows(dt_pipe *p)
{
    int m = p->cfg.micro_batches;
    int64_t base = p->batch / m, extra = p->batch % m, off = 0;
    for (int i = 0; i < m; i++) {
        p->mb[i].off = off;
        p->mb[i].rows = base + (i < extra);
        off += p->mb[i].rows;
    }
}

/* A failed stage tells the pipeline (as a failed collective does), so its
 * neighbours fail with its words within a watch period, not at the timeout. */
static void pipe_fail(dt_pipe *p, dt_status s)
{
    dt_comm *c = p->comm;
    dt_ctx *ctx = p->ctx;
    p->failed = 1;
    char why[DT_MAX_ERROR + 8], err[DT_MAX_ERROR];
    size_t len = 0;
    snprintf(err, sizeof err, "%s", ctx->err);   /* the store's calls report to ctx too */
    if (join_store(c) && dt_store_get(join_store(c), "abort", why, sizeof why - 1, &len, 1) != DT_OK) {
        int n = snprintf(why, sizeof why, "%d|%spipeline stage %d failed: %s", (int)s, comm_label(c),
                         p->stage, err);
        dt_store_set(join_store(c), "abort", why,
                     (size_t)(n < (int)sizeof why ? n : (int)sizeof why - 1) + 1);
    }
    set_error(ctx, s, "%s", err);
}

dt_status dt_pipe_step(dt_pipe *p, const dt_tensor *x, const dt_tensor *y, float *loss_out)
{
    if (loss_out)
        *loss_out = NAN;
    if (!p)
        return DT_EINVAL;
    dt_ctx *ctx = p->ctx;
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (p->failed)
        return set_error(ctx, DT_ESTATE, "pipe_step: an earlier step failed; make a new "
                         "communicator and pipeline");
    double t0 = dt_now();
    p->header_sent = p->header_recvd = 0;
    p->loss = p->wait_s = p->compute_s = 0;
    p->bytes = 0;
    for (int k = 0; k < p->nslots; k++)
        p->slots[k].busy = 0;
    dt_status s = pipe_args_ok(p, x, y);
    if (s == DT_OK && p->stage > 0) {   /* what stage 0 sends: the batch, the first shape */
        s = pipe_recv_header(p);
        if (s == DT_OK && (p->batch < p->cfg.micro_batches))
            s = set_error(ctx, DT_EINVAL, "pipe_step: a batch of %lld rows cannot split into %d "
                          "micro-batches", (long long)p->batch, p->cfg.micro_batches);
    }
    if (s == DT_OK) {
        pipe_split_rows(p);
        if (p->stage > 0 && p->in_shape[0] != p->mb[0].rows)
            s = set_error(ctx, DT_EPEER, "pipe_step: stage %d sent %lld rows for micro-batch 0, "
                          "%lld expected", p->stage - 1, (long long)p->in_shape[0],
                          (long long)p->mb[0].rows);
    }
    if (s == DT_OK)
        s = p->cfg.schedule == DT_PIPE_GPIPE ? pipe_run_gpipe(p, x, y) : pipe_run_1f1b(p, x, y);
    for (int i = 0; i < p->cfg.micro_batches; i++)   /* a failed step's tapes are gone */
        p->mb[i].tape = NULL;
    if (s != DT_OK) {
        pipe_fail(p, s);
        return s;
    }
    double step = dt_now() - t0;
    p->st.steps++;
    p->st.micro_batches += p->cfg.micro_batches;
    p->st.step_s += step;
    p->st.wait_s += p->wait_s;
    p->st.compute_s += p->compute_s;
    p->st.bytes_sent += p->bytes;
    int m = p->cfg.micro_batches;
    prof_pipe_bubble(ctx, (double)(p->stages - 1) / (double)(m + p->stages - 1));
    if (loss_out && pipe_last(p))
        *loss_out = (float)p->loss;
    return DT_OK;
}

/* --- balanced partitioning ------------------------------------------------ */

/* Layer fn alone, forward and backward once, on a copy of its input that
 * requires grad; in seconds. */
static dt_status layer_time(dt_ctx *ctx, dt_layer_fn fn, void *user, dt_tensor *in, double *out_s)
{
    double t0 = dt_now();
    uint64_t errors = ctx->errors;
    dt_tensor *y = fn(ctx, in, user);
    dt_tensor *loss = y ? dt_sum(ctx, y) : NULL;
    dt_status s = loss ? dt_backward(ctx, loss) : DT_OK;
    if (!loss || s != DT_OK)
        return ctx->errors != errors ? ctx->last_status
               : set_error(ctx, DT_EINVAL, "layer_times: a layer returned NULL");
    float probe;   /* wait for an asynchronous backend's work */
    if (in->grad)
        BE(ctx)->to_host(BEI(ctx), &probe, in->grad->data, sizeof probe);
    else
        (void)dt_tensor_item(loss);
    *out_s = dt_now() - t0;
    dt_ctx_step_reset(ctx);
    return DT_OK;
}

static int cmp_double_asc(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Every layer's input, kept as persistent copies (each layer's is the
 * previous one's output, computed without grad). */
static dt_status layer_inputs(dt_ctx *ctx, dt_layer_fn const *layers, void *const *users, int n,
                              const dt_tensor *sample, dt_tensor **in)
{
    int grad = ctx_swap_grad_enabled(ctx, 0);
    dt_tensor *x = (dt_tensor *)sample;
    dt_status s = DT_OK;
    for (int i = 0; i < n && s == DT_OK; i++) {
        if (!(x = dt_contiguous(ctx, x)) ||
            !(in[i] = dt_tensor_new(ctx, x->dtype, x->ndim, x->shape))) {
            s = ctx->last_status;
            break;
        }
        tensor_materialize(x);
        BE(ctx)->copy(BEI(ctx), in[i]->data, x->data, tensor_bytes(x));
        if (x->dtype == DT_F32 && (s = dt_tensor_set_requires_grad(in[i], 1)) != DT_OK)
            break;
        uint64_t errors = ctx->errors;
        if (i + 1 < n && !(x = layers[i](ctx, in[i], users ? users[i] : NULL)))
            s = ctx->errors != errors ? ctx->last_status
                : set_error(ctx, DT_EINVAL, "layer_times: layer %d returned NULL", i);
    }
    ctx_swap_grad_enabled(ctx, grad);
    return s;
}

dt_status dt_profile_layer_times(dt_ctx *ctx, dt_comm *c, dt_layer_fn const *layers, void *const *users,
                         int n, const dt_tensor *sample, int reps, double *ms_out)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (!layers || !sample || !ms_out || n < 1 || reps < 1 || sample->ctx != ctx ||
        (c && comm_ctx(c) != ctx))
        return set_error(ctx, DT_EINVAL, "layer_times: needs layers, a sample of this context, "
                         "n >= 1, reps >= 1 and ms_out (%d layers, %d reps)", n, reps);
    for (int i = 0; i < n; i++)
        if (!layers[i])
            return set_error(ctx, DT_EINVAL, "layer_times: layer %d is NULL", i);
    dt_tensor **in = host_calloc(ctx, sizeof *in * (size_t)n);
    if (!in)
        return set_error(ctx, DT_ENOMEM, "layer_times: out of memory");
    int measure = prof_pause(ctx);     /* these are not training steps */
    void *hook_user = ctx_swap_hook_user(ctx, NULL);   /* nor are their backwards a DDP's */
    dt_ctx_step_reset(ctx);
    dt_status s = layer_inputs(ctx, layers, users, n, sample, in);
    /* round robin over the layers, one warm-up round: a machine's slow
     * spells then touch every layer alike instead of one layer's runs */
    double *t = s == DT_OK ? host_alloc(ctx, sizeof *t * (size_t)n * (size_t)reps) : NULL;
    if (s == DT_OK && !t)
        s = set_error(ctx, DT_ENOMEM, "layer_times: out of memory");
    for (int r = 0; s == DT_OK && r <= reps; r++)
        for (int i = 0; s == DT_OK && i < n; i++) {
            double sec = 0;
            s = layer_time(ctx, layers[i], users ? users[i] : NULL, in[i], &sec);
            if (r > 0)
                t[(size_t)i * (size_t)reps + (size_t)(r - 1)] = sec;
        }
    for (int i = 0; s == DT_OK && i < n; i++) {
        double *ti = t + (size_t)i * (size_t)reps;
        qsort(ti, (size_t)reps, sizeof *ti, cmp_double_asc);
        ms_out[i] = (reps % 2 ? ti[reps / 2] : (ti[reps / 2 - 1] + ti[reps / 2]) / 2) * 1e3;
    }
    host_free(ctx, t);
    dt_ctx_step_reset(ctx);
    dt_ctx_zero_grad(ctx);
    for (int i = 0; i < n; i++)
        dt_tensor_free(in[i]);
    host_free(ctx, in);
    prof_resume(ctx, measure);
    ctx_swap_hook_user(ctx, hook_user);
    if (s == DT_OK && c) {   /* the ranks' mean, the same on every rank */
        float *f = host_alloc(ctx, sizeof *f * (size_t)n);
        if (!f)
            return set_error(ctx, DT_ENOMEM, "layer_times: out of memory");
        for (int i = 0; i < n; i++)
            f[i] = (float)ms_out[i];
        s = dt_comm_allreduce(c, f, n, DT_REDUCE_AVG);
        for (int i = 0; s == DT_OK && i < n; i++)
            ms_out[i] = f[i];
        host_free(ctx, f);
    }
    return s;
}

/* The fewest consecutive runs of cost, each totalling at most cap (summed
 * left to right, as everywhere here), starting at layer a. */
static int runs_needed(const double *cost, int a, int n, double cap)
{
    int runs = 0;
    for (int i = a; i < n;) {
        double sum = 0;
        int j = i;
        while (j < n && sum + cost[j] <= cap)
            sum += cost[j++];
        if (j == i)
            return INT_MAX;   /* one layer alone exceeds cap */
        runs++;
        i = j;
    }
    return runs;
}

dt_status dt_pipe_partition(const double *cost, int n, int stages, int *first)
{
    if (!cost || !first || stages < 1 || n < stages)
        return DT_EINVAL;
    double total = 0, big = 0;
    for (int i = 0; i < n; i++) {
        if (!(cost[i] >= 0) || !isfinite(cost[i]))
            return DT_EINVAL;
        total += cost[i];
        big = cost[i] > big ? cost[i] : big;
    }
    /* the least cap that `stages` runs can meet: bisect on doubles until
     * lo (infeasible) and hi (feasible) are neighbours */
    double lo = big, hi = total;
    if (runs_needed(cost, 0, n, lo) <= stages) {
        hi = lo;
    } else {
        for (;;) {
            double mid = lo + (hi - lo) / 2;
            if (!(mid > lo && mid < hi))
                break;
            if (runs_needed(cost, 0, n, mid) <= stages)
                hi = mid;
            else
                lo = mid;
        }
    }
    /* the earliest boundaries that keep every run within hi and leave
     * enough layers and capacity for the stages after */
    first[0] = 0;
    for (int s = 1; s < stages; s++) {
        int j = first[s - 1] + 1;
        while (n - j > stages - s && runs_needed(cost, j, n, hi) > stages - s)
            j++;
        first[s] = j;
    }
    first[stages] = n;
    return DT_OK;
}

/* --- tensor parallelism -------------------------------------------------- */

static int tp_ok(dt_ctx *ctx, const char *op, dt_comm *c, const dt_tensor *x)
{
    if (!op_f32_ok(ctx, op, x, "input"))
        return 0;
    if (!c || comm_ctx(c) != ctx) {
        set_error(ctx, DT_EINVAL, "%s: %s", op, c ? "the communicator belongs to another context"
                                                  : "communicator is NULL");
        return 0;
    }
    return 1;
}

/* A host copy of contiguous f32 data (n floats), in the step's host arena. */
static float *tp_to_host(dt_ctx *ctx, const float *dev, int64_t n)
{
    float *h = arena_alloc(ctx, ctx->cur_host, (size_t)(n ? n : 1) * sizeof(float));
    if (!h)
        set_error(ctx, DT_ENOMEM, "out of host memory for a %lld-float message", (long long)n);
    else
        be_to_host(ctx, h, dev, (size_t)n * sizeof(float));
    return h;
}

/* Rows of width k from each of p ranks (rank-major, as allgather gives
 * them) side by side: (p, R, k) -> (R, p*k). */
static void tp_interleave(const float *in, float *out, int p, int64_t rows, int64_t k)
{
    for (int r = 0; r < p; r++)
        for (int64_t i = 0; i < rows; i++)
            memcpy(out + (i * p + r) * k, in + ((int64_t)r * rows + i) * k, (size_t)k * sizeof(float));
}

/* An allgather along the last dim of a (R, k) host matrix into a new step
 * tensor of shape `shape` (last dim p*k). */
static dt_tensor *tp_gather_rows(dt_ctx *ctx, dt_comm *c, const float *h, int64_t rows, int64_t k,
                                 int ndim, const int64_t *shape)
{
    int p = dt_comm_size(c);
    float *all = arena_alloc(ctx, ctx->cur_host, (size_t)(rows * k * p + 1) * sizeof(float));
    float *side = arena_alloc(ctx, ctx->cur_host, (size_t)(rows * k * p + 1) * sizeof(float));
    dt_tensor *y = tensor_step_new(ctx, DT_F32, ndim, shape);
    if (!all || !side || !y) {
        set_error(ctx, DT_ENOMEM, "tensor parallel: out of memory for a gather");
        return NULL;
    }
    if (dt_comm_allgather(c, h, rows * k, all) != DT_OK)
        return NULL;
    tp_interleave(all, side, p, rows, k);
    be_to_device(ctx, y->data, side, (size_t)(rows * k * p) * sizeof(float));
    return y;
}

/* The tensor-parallel ops keep their communicator for the backward. */
typedef struct tp_state { dt_comm *c; } tp_state;

static dt_status tp_copy_backward(dt_ctx *ctx, dt_node *n)
{
    int64_t cnt = shape_numel(n->out->ndim, n->out->shape);
    float *h = tp_to_host(ctx, FP(n->out->grad), cnt);
    float *sum = h ? op_temp_floats(ctx, cnt) : NULL;
    if (!sum)
        return ctx->last_status;
    dt_status s = dt_comm_allreduce(((const tp_state *)n->state)->c, h, cnt, DT_REDUCE_SUM);
    if (s != DT_OK)
        return s;
    be_to_device(ctx, sum, h, (size_t)cnt * sizeof(float));
    return op_acc_grad(ctx, n->in[0], sum, 1.0f);
}

dt_tensor *dt_tp_copy(dt_ctx *ctx, dt_comm *c, dt_tensor *x)
{
    if (!tp_ok(ctx, "tp_copy", c, x))
        return NULL;
    dt_tensor *y = tensor_view_header(ctx, x);
    if (y && tape_tracks(ctx, x)) {
        if (!tape_record_op(ctx, "tp_copy", tp_copy_backward, y, x, NULL, NULL, &(tp_state){c},
                            sizeof(tp_state)))
            return NULL;
    }
    return y;
}

static dt_status tp_reduce_backward(dt_ctx *ctx, dt_node *n)
{
    return op_acc_grad(ctx, n->in[0], FP(n->out->grad), 1.0f);
}

dt_tensor *dt_tp_reduce(dt_ctx *ctx, dt_comm *c, dt_tensor *x)
{
    if (!tp_ok(ctx, "tp_reduce", c, x) || !(x = op_need_contig(ctx, x)))
        return NULL;
    tensor_materialize(x);
    int64_t cnt = shape_numel(x->ndim, x->shape);
    float *h = tp_to_host(ctx, FP(x), cnt);
    dt_tensor *y = h ? op_like(ctx, x) : NULL;
    if (!y || dt_comm_allreduce(c, h, cnt, DT_REDUCE_SUM) != DT_OK)
        return NULL;
    be_to_device(ctx, y->data, h, (size_t)cnt * sizeof(float));
    if (tape_tracks(ctx, x) && !tape_record(ctx, "tp_reduce", tp_reduce_backward, y, x, NULL, NULL))
        return NULL;
    return y;
}

/* The gradient's columns [rank*k, (rank+1)*k) of its last dim, added to x's. */
static dt_status tp_take_columns(dt_ctx *ctx, dt_tensor *x, const float *g, int rank, int p)
{
    int64_t k = x->shape[x->ndim - 1], rows = shape_numel(x->ndim, x->shape) / (k ? k : 1);
    int acc;
    float *gx = grad_target(ctx, x, &acc);
    if (!gx)
        return ctx->last_status;
    int64_t shape[2] = {rows, k}, ds[2] = {k, 1}, ss[2] = {k * p, 1};
    BE(ctx)->copy_strided(BEI(ctx), 2, shape, 4, gx, ds, g + (int64_t)rank * k, ss, acc);
    return DT_OK;
}

static dt_status tp_gather_backward(dt_ctx *ctx, dt_node *n)
{
    dt_comm *c = ((const tp_state *)n->state)->c;
    return tp_take_columns(ctx, n->in[0], FP(n->out->grad), dt_comm_rank(c), dt_comm_size(c));
}

dt_tensor *dt_tp_gather(dt_ctx *ctx, dt_comm *c, dt_tensor *x)
{
    if (!tp_ok(ctx, "tp_gather", c, x) || !(x = op_need_contig(ctx, x)))
        return NULL;
    if (x->ndim < 1) {
        set_error(ctx, DT_EINVAL, "tp_gather: needs at least one dimension");
        return NULL;
    }
    tensor_materialize(x);
    int64_t k = x->shape[x->ndim - 1], cnt = shape_numel(x->ndim, x->shape);
    int64_t shape[DT_MAX_DIMS];
    memcpy(shape, x->shape, sizeof shape);
    shape[x->ndim - 1] = k * dt_comm_size(c);
    float *h = tp_to_host(ctx, FP(x), cnt);
    dt_tensor *y = h ? tp_gather_rows(ctx, c, h, k ? cnt / k : 0, k, x->ndim, shape) : NULL;
    if (!y)
        return NULL;
    if (tape_tracks(ctx, x)) {
        if (!tape_record_op(ctx, "tp_gather", tp_gather_backward, y, x, NULL, NULL, &(tp_state){c},
                            sizeof(tp_state)))
            return NULL;
    }
    return y;
}

static dt_status tp_split_backward(dt_ctx *ctx, dt_node *n)
{
    dt_comm *c = ((const tp_state *)n->state)->c;
    dt_tensor *y = n->out, *x = n->in[0];
    int64_t k = y->shape[y->ndim - 1], cnt = shape_numel(y->ndim, y->shape);
    float *h = tp_to_host(ctx, FP(y->grad), cnt);
    dt_tensor *g = h ? tp_gather_rows(ctx, c, h, k ? cnt / k : 0, k, x->ndim, x->shape) : NULL;
    return g ? op_acc_grad(ctx, x, FP(g), 1.0f) : ctx->last_status;
}

dt_tensor *dt_tp_split(dt_ctx *ctx, dt_comm *c, dt_tensor *x)
{
    if (!tp_ok(ctx, "tp_split", c, x))
        return NULL;
    int64_t last = x->ndim ? x->shape[x->ndim - 1] : 0;
    if (x->ndim < 1 || last % dt_comm_size(c)) {
        set_error(ctx, DT_EINVAL, "tp_split: the last dim (%lld) must split evenly over %d ranks",
                  (long long)last, dt_comm_size(c));
        return NULL;
    }
    int64_t k = last / dt_comm_size(c), shape[DT_MAX_DIMS];
    memcpy(shape, x->shape, sizeof shape);
    shape[x->ndim - 1] = k;   /* this rank's columns, then a contiguous copy */
    dt_tensor *v = tensor_view_as(ctx, x, x->ndim, shape, x->stride,
                                  FP(x) + (int64_t)dt_comm_rank(c) * k * x->stride[x->ndim - 1]);
    if (!v)
        return NULL;
    tensor_materialize(x);
    dt_tensor *y = op_like(ctx, v);
    if (!y)
        return NULL;
    BE(ctx)->copy_strided(BEI(ctx), v->ndim, v->shape, 4, y->data, y->stride, v->data, v->stride, 0);
    if (tape_tracks(ctx, x)) {
        if (!tape_record_op(ctx, "tp_split", tp_split_backward, y, x, NULL, NULL, &(tp_state){c},
                            sizeof(tp_state)))
            return NULL;
    }
    return y;
}

dt_tensor *dt_tp_linear_col(dt_ctx *ctx, dt_comm *c, dt_tensor *x, dt_tensor *w, dt_tensor *b,
                            int gather_output)
{
    dt_tensor *y = dt_linear(ctx, dt_tp_copy(ctx, c, x), w, b);
    return y && gather_output ? dt_tp_gather(ctx, c, y) : y;
}

dt_tensor *dt_tp_linear_row(dt_ctx *ctx, dt_comm *c, dt_tensor *x, dt_tensor *w, dt_tensor *b,
                            int input_is_split)
{
    if (x && !input_is_split)
        x = dt_tp_split(ctx, c, x);
    dt_tensor *y = dt_tp_reduce(ctx, c, dt_linear(ctx, x, w, NULL));
    return y && b ? dt_add(ctx, y, b) : y;
}

dt_status dt_tp_shard(const dt_comm *c, const dt_tensor *full, int dim, dt_tensor *shard)
{
    if (!shard)
        return DT_EINVAL;
    dt_ctx *ctx = shard->ctx;
    if (!c || !full || full->dtype != shard->dtype || full->ndim != shard->ndim || dim < 0 ||
        dim >= full->ndim || full->shape[dim] % dt_comm_size(c))
        return set_error(ctx, DT_EINVAL, "tp_shard: needs a communicator, and a full tensor of "
                         "shard's dtype whose dim %d splits evenly over the ranks", dim);
    int64_t blk = full->shape[dim] / dt_comm_size(c);
    for (int d = 0; d < full->ndim; d++)
        if (shard->shape[d] != (d == dim ? blk : full->shape[d])) {
            char a[96], b[96];
            return set_error(ctx, DT_EINVAL, "tp_shard: shard is %s, rank %d's block of %s "
                             "along dim %d is not", SHAPE(shard, a), dt_comm_rank(c), SHAPE(full, b), dim);
        }
    size_t es = dt_dtype_size(full->dtype);
    int64_t outer = shape_numel(dim, full->shape);
    int64_t inner = shape_numel(full->ndim - dim - 1, full->shape + dim + 1);
    char *src = host_alloc(ctx, tensor_bytes(full) + 1), *dst = host_alloc(ctx, tensor_bytes(shard) + 1);
    dt_status s = src && dst ? dt_tensor_get(full, src, shape_numel(full->ndim, full->shape))
                             : set_error(ctx, DT_ENOMEM, "tp_shard: out of memory");
    if (s == DT_OK) {
        for (int64_t o = 0; o < outer; o++)
            memcpy(dst + (size_t)(o * blk * inner) * es,
                   src + (size_t)((o * full->shape[dim] + dt_comm_rank(c) * blk) * inner) * es,
                   (size_t)(blk * inner) * es);
        s = dt_tensor_set(shard, dst, shape_numel(shard->ndim, shard->shape));
    } else if (src && dst) {
        s = set_error(ctx, s, "tp_shard: cannot read the full tensor: %s", dt_last_error(full->ctx));
    }
    host_free(ctx, src);
    host_free(ctx, dst);
    return s;
}
