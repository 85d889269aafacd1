#include "dist.h"

/* ===========================================================================
 * Data parallelism (DDP)
 *
 * The gradients of the wrapped parameters live in bucket memory: each
 * parameter's grad tensor points at its slot, so backward writes straight
 * into what the allreduce sends (no copy).  Buckets take parameters in
 * reverse registration order, the order backward finishes them.  Before a
 * backward, every parameter's uses on the tape are counted; as the walk
 * passes each node the count drops, and at zero the gradient is final.  A
 * bucket whose gradients are all final is handed to the comm thread, but
 * only after every lower-numbered bucket: all ranks then issue the same
 * allreduces in the same order even when their tapes differ.
 *
 * Each bucket carries one extra float per parameter, 1 when this rank
 * produced a gradient for it and 0 when not (its slot is zeroed then).
 * The allreduce averages them with the gradients, so afterwards a
 * parameter that no rank touched is marked gradient-less again and the
 * optimizer skips it, as it would in one process.
 *
 * Two sets of bucket memory alternate: a new step (every gradient zeroed)
 * repoints the gradients at the other set, so what the previous step's
 * allreduces left stays intact while the next backward writes.
 * ======================================================================== */

static const dt_grad_hooks ddp_grad_hooks;   /* at the end of this file */


/* The default bucket: about an eighth of the gradients, within these bounds
 * (measured in docs/PERFORMANCE.md: 256 KiB buckets hid the most on 1 Gbit/s
 * for the benchmark MLP and CNN; large models want fewer, larger calls). */
#define DT_DDP_MIN_BUCKET_BYTES ((size_t)256 << 10)
#define DT_DDP_MAX_BUCKET_BYTES ((size_t)25 << 20)
#define DT_DDP_DIFF 240            /* chars of a model difference, as floats */

void dt_ddp_config_init(dt_ddp_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->struct_size = sizeof *cfg;
    cfg->overlap = -1;
    cfg->broadcast_params = 1;
    cfg->error_feedback = 1;
    cfg->compress = DT_COMPRESS_AUTO;   /* the environment's to choose, unless the program does */
    cfg->topk_warmup_steps = -1;
}

static float *ddp_flags(dt_ddp *d, const ddp_bucket *b)
{
    return d->set + b->offset + b->numel;
}

/* Where the gradients live: the bucket memory, or its device twin. */
static float *ddp_grads(const dt_ddp *d) { return d->staged ? d->dset : d->set; }

static void ddp_point_grads(dt_ddp *d)
{
    for (int i = 0; i < d->nparams; i++)
        tensor_point_at(d->params[i]->grad, ddp_grads(d) + d->offset[i]);
}

/* Staged: start copying floats [off, off + n) of the current set's
 * gradients to host memory; the copy stream first waits for the backward
 * kernels queued so far.  Returns its ticket. */
static uint64_t ddp_stage_out(dt_ddp *d, int64_t off, int64_t n)
{
    if (!d->staged || n <= 0)
        return 0;
    uint64_t t = d->be_iface->copy_async(d->be, d->set + off, d->dset + off,
                                         (size_t)n * sizeof(float), DT_COPY_D2H);
    if (t > d->last_ticket)
        d->last_ticket = t;
    return t;
}

/* Staged: the reduced gradients back to the device, before any later
 * kernel (the optimizer) reads them. */
static void ddp_stage_in(dt_ddp *d)
{
    if (!d->staged)
        return;
    uint64_t t = d->be_iface->copy_async(d->be, d->dset, d->set,
                                         (size_t)d->grad_floats * sizeof(float), DT_COPY_H2D);
    if (t)
        d->be_iface->copy_join(d->be, t);
    if (t > d->last_ticket)
        d->last_ticket = t;
}

/* --- gradient compression (the codecs are src/codec.c) ------------------ */

static void ddp_encode(const dt_ddp *d, const ddp_bucket *b, const float *g, char *out, float *sent)
{
    codec_encode(d->cfg.compress, g, b->numel, b->pieces, b->npieces, b->topk, d->scratch,
                 d->picked, out, sent);
}

/* Encode bucket b (its gradients, plus what error feedback kept) and start
 * gathering every rank's encoding. */
/* Top-k's ratio at step t: during the warm-up it falls geometrically from
 * 25% to the configured ratio (DGC's warm-up), then stays there. */
static double ddp_topk_ratio(const dt_ddp *d, int64_t t)
{
    double r = d->cfg.topk_ratio > 0 ? d->cfg.topk_ratio : 0.01;
    int64_t w = d->cfg.topk_warmup_steps;
    if (w <= 0 || t >= w || r >= 0.25)
        return r;
    double q = (double)t / (double)w;
    return exp(log(0.25) * (1 - q) + log(r) * q);
}

/* This step's entries per piece and the payload's size. */
static void ddp_topk_size(const dt_ddp *d, ddp_bucket *b, double ratio)
{
    b->topk = 0;
    for (int p = 0; p < b->npieces; p++) {
        int64_t len = b->pieces[3 * p + 1] - b->pieces[3 * p];
        int64_t kp = (int64_t)ceil(ratio * (double)len);
        kp = kp < 1 ? 1 : kp > len ? len : kp;
        b->pieces[3 * p + 2] = kp;
        b->topk += kp;
    }
    b->code_bytes = codec_bytes(d->cfg.compress, b->numel, b->topk);
    b->payload_floats = (int64_t)((b->code_bytes + 3) / 4) + b->count;
}

static dt_work *ddp_launch_compressed(dt_ddp *d, ddp_bucket *b, float *grads, const float *flags)
{
    if (d->cfg.compress == DT_COMPRESS_TOPK) {
        if (b == d->buckets)
            d->topk_steps++;
        ddp_topk_size(d, b, ddp_topk_ratio(d, d->topk_steps - 1));
    }
    int ef = d->cfg.error_feedback &&
             (d->cfg.compress == DT_COMPRESS_TOPK || d->cfg.compress == DT_COMPRESS_INT8);
    /* Momentum correction (Deep Gradient Compression): with SGD momentum m
     * the momentum is kept here, u = m u + g, and the residual accumulates u
     * rather than g; what is sent leaves both (momentum factor masking), and
     * the optimizer steps without momentum. */
    if (b->velocity)
        for (int64_t i = 0; i < b->numel; i++) {
            b->velocity[i] = d->momentum * b->velocity[i] + grads[i];
            grads[i] = b->velocity[i];
        }
    if (ef)
        for (int64_t i = 0; i < b->numel; i++)
            grads[i] += b->residual[i];
    float *sent = ef ? b->residual : d->scratch + b->numel;
    ddp_encode(d, b, grads, (char *)b->payload, sent);
    if (ef)
        for (int64_t i = 0; i < b->numel; i++)
            b->residual[i] = grads[i] - sent[i];
    if (b->velocity)
        for (int64_t i = 0; i < b->numel; i++)
            if (d->picked[i])
                b->velocity[i] = 0;
    memcpy((char *)b->payload + (b->payload_floats - b->count) * 4, flags,
           (size_t)b->count * sizeof(float));
    d->st.payload_bytes += (uint64_t)b->payload_floats * 4;
    return comm_enqueue(d->comm, COLL_ALLGATHER, b->gathered, b->payload, b->payload_floats, 0,
                        DT_REDUCE_SUM);
}

/* A compressed push to the parameter servers: each server's part of the
 * bucket encoded on its own (src/ps.c), error feedback as above; the servers
 * decode, so nothing comes back to decode here. */
static void ddp_ps_encode(dt_ddp *d, ddp_bucket *b)
{
    int ef = d->cfg.error_feedback &&
             (d->cfg.compress == DT_COMPRESS_TOPK || d->cfg.compress == DT_COMPRESS_INT8);
    if (d->cfg.compress == DT_COMPRESS_TOPK && b == d->buckets)
        d->topk_steps++;
    size_t bytes = ps_encode_push(d->cfg.ps, &b->pcall, d->cfg.compress,
                                  ddp_topk_ratio(d, d->topk_steps - 1), ef ? b->residual : NULL,
                                  d->scratch, (char *)b->payload);
    d->st.payload_bytes += bytes + (uint64_t)b->count * sizeof(float);
}

/* Buffers for compressed pushes: a bucket's codes (at most 6 bytes a
 * float, TOPK keeping all), its residual, and encoding scratch. */
static dt_status ddp_alloc_ps_code(dt_ddp *d)
{
    int64_t biggest = 1;
    for (int j = 0; j < d->nbuckets; j++) {
        ddp_bucket *b = &d->buckets[j];
        biggest = b->numel > biggest ? b->numel : biggest;
        b->payload = host_alloc(d->ctx, (size_t)b->numel * 6 + 16 * PS_MAX_SERVERS);
        b->residual = host_calloc(d->ctx, (size_t)(b->numel ? b->numel : 1) * sizeof(float));
        if (!b->payload || !b->residual)
            return DT_ENOMEM;
    }
    d->scratch = host_calloc(d->ctx, (size_t)biggest * 2 * sizeof(float));
    return d->scratch ? DT_OK : DT_ENOMEM;
}

/* Every rank's encoding of bucket b, decoded and summed in rank order into
 * its gradients and flags, then averaged: the same on every rank. */
static void ddp_finish_compressed(dt_ddp *d, ddp_bucket *b)
{
    int P = dt_comm_size(d->comm);
    float *grads = d->set + b->offset, *flags = grads + b->numel;
    memset(grads, 0, (size_t)(b->numel + b->count) * sizeof(float));
    for (int r = 0; r < P; r++) {
        const float *pl = b->gathered + (int64_t)r * b->payload_floats;
        codec_decode_add(d->cfg.compress, (const char *)pl, b->numel, b->topk, grads);
        for (int k = 0; k < b->count; k++)
            flags[k] += pl[b->payload_floats - b->count + k];
    }
    float inv = 1.0f / (float)P;
    for (int64_t i = 0; i < b->numel; i++)
        grads[i] *= inv;
}

/* Top-k's pieces of bucket b: each parameter's part of it sends
 * ceil(ratio * its length) entries (at least one). */
static dt_status ddp_plan_topk(dt_ddp *d, ddp_bucket *b, double ratio)
{
    b->pieces = host_calloc(d->ctx, sizeof(int64_t) * 3 * (size_t)(d->nparams ? d->nparams : 1));
    if (!b->pieces)
        return DT_ENOMEM;
    b->topk = 0;
    for (int k = 0; k < d->nparams; k++) {
        int i = d->order[k];
        int64_t lo = d->offset[i], hi = lo + dt_tensor_numel(d->params[i]);
        lo = lo > b->offset ? lo : b->offset;
        hi = hi < b->offset + b->numel ? hi : b->offset + b->numel;
        if (hi <= lo)
            continue;
        int64_t *pc = &b->pieces[3 * b->npieces++];
        pc[0] = lo - b->offset;
        pc[1] = hi - b->offset;
    }
    ddp_topk_size(d, b, ratio);
    return DT_OK;
}

/* Buffers for compression, per bucket; error feedback starts at zero. */
static dt_status ddp_alloc_compression(dt_ddp *d)
{
    int P = dt_comm_size(d->comm);
    int64_t biggest = 1;
    /* buffers for the largest ratio: the warm-up's first step */
    double ratio = ddp_topk_ratio(d, 0);
    dt_optim_config oc;
    /* (one momentum for all: with parameter groups the optimizer applies its own) */
    if (d->cfg.compress == DT_COMPRESS_TOPK && d->cfg.error_feedback && d->opt &&
        dt_optim_group_count(d->opt) == 1 && dt_optim_group_config(d->opt, 0, &oc) == DT_OK &&
        oc.kind == DT_SGD && oc.momentum > 0 && !oc.nesterov && oc.dampening == 0)
        d->momentum = oc.momentum;
    for (int j = 0; j < d->nbuckets; j++) {
        ddp_bucket *b = &d->buckets[j];
        biggest = b->numel > biggest ? b->numel : biggest;
        if (d->cfg.compress == DT_COMPRESS_TOPK) {
            if (ddp_plan_topk(d, b, ratio) != DT_OK)
                return DT_ENOMEM;
        } else {
            b->code_bytes = codec_bytes(d->cfg.compress, b->numel, 0);
            b->payload_floats = (int64_t)((b->code_bytes + 3) / 4) + b->count;
        }
        b->payload = host_calloc(d->ctx, (size_t)b->payload_floats * sizeof(float));
        b->gathered = host_calloc(d->ctx, (size_t)b->payload_floats * (size_t)P * sizeof(float));
        b->residual = host_calloc(d->ctx, (size_t)(b->numel ? b->numel : 1) * sizeof(float));
        if (!b->payload || !b->gathered || !b->residual)
            return DT_ENOMEM;
        if (d->momentum > 0 &&
            !(b->velocity = host_calloc(d->ctx, (size_t)(b->numel ? b->numel : 1) * sizeof(float))))
            return DT_ENOMEM;
    }
    d->scratch = host_calloc(d->ctx, (size_t)biggest * 2 * sizeof(float));
    d->picked = host_calloc(d->ctx, (size_t)biggest);
    return d->scratch && d->picked ? DT_OK : DT_ENOMEM;
}

/* --- launching buckets during backward ------------------------------- */

/* Hand bucket b to the comm thread (the last one carries the used-flags)
 * and start the average. */
static void ddp_weigh(dt_ddp *d, int64_t offset, int64_t numel);

static void ddp_launch(dt_ddp *d, ddp_bucket *b)
{
    if (d->z) {   /* reduce-scattered instead (src/zero.c) */
        zero_launch(d, b);
        return;
    }
    ddp_weigh(d, b->offset, b->numel);
    float *flags = ddp_flags(d, b);   /* the last bucket's: all parameters' */
    for (int k = 0; k < b->count; k++)
        flags[k] = d->params[k]->grad->flags & T_ZERO ? 0.0f : 1.0f;
    /* Staged: the comm thread waits for the copy before it sends; encoders
     * read the gradients right here, so they wait now. */
    uint64_t ticket = ddp_stage_out(d, b->offset, b->numel);
    if (ticket && (d->cfg.compress == DT_COMPRESS_TOPK || d->cfg.compress == DT_COMPRESS_INT8 ||
                   (d->cfg.ps && d->cfg.compress != DT_COMPRESS_NONE)))
        d->be_iface->copy_wait(d->be, ticket);
    else
        comm_stage_next(d->comm, ticket);
    if (b == d->buckets) {   /* the step's first */
        d->sent_at_launch = dt_comm_bytes_sent(d->comm);
        d->zero_gen = d->ctx->zero_gen;
    }
    if (d->cfg.ps) {   /* pushed to the servers (src/ps.c); dt_ddp_sync pulls */
        float *buf = d->set + b->offset;
        int64_t n = b->numel + b->count;
        b->pcall = (ps_call){.ps = d->cfg.ps, .op = PS_PUSH, .lo = b->offset, .n = n, .buf = buf,
                             .clock = ps_clock(d->cfg.ps)};
        if (d->cfg.compress != DT_COMPRESS_NONE)
            ddp_ps_encode(d, b);
        else
            d->st.payload_bytes += (uint64_t)b->numel * sizeof(float);
        b->work = comm_enqueue_in(d->comm, COLL_EXT, buf, NULL, n, 0, DT_REDUCE_SUM, &b->pcall);
    } else if (d->cfg.compress == DT_COMPRESS_BF16 || d->cfg.compress == DT_COMPRESS_FP16) {
        /* reduced in 16 bits on the wire, in place (comm.c's allreduce16) */
        b->work = comm_enqueue(d->comm, COLL_ALLREDUCE16, d->set + b->offset, NULL,
                               b->numel + b->count, d->cfg.compress == DT_COMPRESS_BF16 ? 1 : 2,
                               DT_REDUCE_AVG);
        d->st.payload_bytes += (uint64_t)(b->numel + b->count) * 2;
    } else if (d->cfg.compress != DT_COMPRESS_NONE) {
        b->work = ddp_launch_compressed(d, b, d->set + b->offset, flags);
    } else {
        b->work = dt_comm_allreduce_async(d->comm, d->set + b->offset, b->numel + b->count,
                                     DT_REDUCE_AVG);
        d->st.payload_bytes += (uint64_t)b->numel * sizeof(float);
    }
    uint64_t unused = comm_stage_next(d->comm, 0);
    if (unused)   /* not consumed: the launch failed; let the copy land */
        d->be_iface->copy_wait(d->be, unused);
    if (!b->work && d->launch_status == DT_OK) {
        d->launch_status = d->ctx->last_status;
        snprintf(d->launch_msg, sizeof d->launch_msg, "%s", d->ctx->err);
    }
    d->st.grad_bytes += (uint64_t)b->numel * sizeof(float);
}

/* No overlap, no compression: every bucket is ready at once, and they are
 * contiguous; one allreduce of the whole set costs the host's ranks one
 * round of phases (or the transport one schedule) instead of one a bucket,
 * and it runs right here (the comm thread idle: no hand-over). */
static void ddp_reduce_whole(dt_ddp *d)
{
    ddp_bucket *last = &d->buckets[d->nbuckets - 1];
    float *flags = ddp_flags(d, last);
    for (int k = 0; k < last->count; k++)
        flags[k] = d->params[k]->grad->flags & T_ZERO ? 0.0f : 1.0f;
    d->sent_at_launch = dt_comm_bytes_sent(d->comm);
    d->zero_gen = d->ctx->zero_gen;
    ddp_weigh(d, 0, d->grad_floats);
    double t0 = dt_now();
    uint64_t ticket = ddp_stage_out(d, 0, d->grad_floats);
    if (ticket)
        d->be_iface->copy_wait(d->be, ticket);
    dt_status s = dt_comm_allreduce(d->comm, d->set, d->set_floats, DT_REDUCE_AVG);
    d->st.comm_s += dt_now() - t0;
    if (s != DT_OK && d->launch_status == DT_OK) {
        d->launch_status = s;
        snprintf(d->launch_msg, sizeof d->launch_msg, "%s", d->ctx->err);
    }
    d->st.grad_bytes += (uint64_t)d->grad_floats * sizeof(float);
    d->st.payload_bytes += (uint64_t)d->grad_floats * sizeof(float);
    d->next_launch = d->nbuckets;
}

/* Launch every ready bucket whose predecessors have all been launched. */
static void ddp_launch_ready(dt_ddp *d)
{
    while (d->next_launch < d->nbuckets && d->buckets[d->next_launch].pending == 0)
        ddp_launch(d, &d->buckets[d->next_launch++]);
}

/* The bucket holding flat gradient float `flat` (the last for one past
 * the end).  Buckets cut every bucket_floats, or (zero 2) at parameters. */
DT_PRIVATE int ddp_bucket_of(const dt_ddp *d, int64_t flat)
{
    int lo = 0, hi = d->nbuckets - 1;
    while (lo < hi) {   /* the last bucket starting at or before flat */
        int mid = (lo + hi + 1) / 2;
        if (d->buckets[mid].offset <= flat)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* Floats [done, upto) of parameter i's gradient are final: the buckets
 * they fall in have that many fewer to wait for. */
static void ddp_mark_final(dt_ddp *d, int i, int64_t upto)
{
    int64_t lo = d->offset[i] + d->done[i], hi = d->offset[i] + upto;
    if (hi <= lo)
        return;
    d->done[i] = upto;
    for (int64_t j = ddp_bucket_of(d, lo); j < d->nbuckets && d->buckets[j].offset < hi; j++) {
        ddp_bucket *b = &d->buckets[j];
        int64_t a = lo > b->offset ? lo : b->offset;
        int64_t e = hi < b->offset + b->numel ? hi : b->offset + b->numel;
        if (e > a)
            b->pending -= e - a;
    }
}

/* Parameter i's whole gradient is final; one that got none is zeroed in its
 * slot (the other ranks may have one: this rank adds nothing). */
static void ddp_param_final(dt_ddp *d, int i)
{
    dt_tensor *g = d->params[i]->grad;
    int64_t n = dt_tensor_numel(g);
    if (d->done[i] == n)
        return;
    dt_status s = g->flags & T_ZERO && d->z ? zero_grad_memory(d, i) : DT_OK;   /* its home first */
    if (s != DT_OK && d->launch_status == DT_OK) {
        d->launch_status = s;
        snprintf(d->launch_msg, sizeof d->launch_msg, "%s", d->ctx->err);
    }
    if (g->flags & T_ZERO && s == DT_OK)
        d->be_iface->memset0(d->be, (float *)g->data + d->done[i],
                             (size_t)(n - d->done[i]) * sizeof(float));
    ddp_mark_final(d, i, n);
}

/* For linear's backward (src/ops.c): rows of w's gradient to compute per block so
 * each finished block can travel while the next computes; 0: all at once.
 * Only for a large weight whose last use on the tape this is. */
#define DDP_CHUNK_MIN_FLOATS 65536
static int64_t ddp_grad_chunk_rows(void *user, const dt_tensor *w, int64_t rows, int64_t cols)
{
    dt_ddp *d = user;
    dt_ctx *ctx = d->ctx;
    if (!d || !d->hooks || !(w->flags & T_PARAM) || w->ctx != ctx || cols <= 0 ||
        d->uses[w->param_index] != 1 || recompute_in_backward(ctx) ||
        rows * cols < 2 * DDP_CHUNK_MIN_FLOATS)
        return 0;
    int64_t target = rows * cols / 4;   /* at least four blocks, at most a bucket each */
    target = target < d->bucket_floats ? target : d->bucket_floats;
    target = target > DDP_CHUNK_MIN_FLOATS / 2 ? target : DDP_CHUNK_MIN_FLOATS / 2;
    int64_t step = target / cols > 0 ? target / cols : 1;
    return step < rows ? step : 0;
}

static void ddp_grad_rows_done(void *user, const dt_tensor *w, int64_t rows_done, int64_t cols)
{
    dt_ddp *d = user;
    dt_ctx *ctx = d->ctx;
    if (!d || !d->hooks || !(w->flags & T_PARAM) || w->ctx != ctx ||
        d->uses[w->param_index] != 1 || recompute_in_backward(ctx))
        return;   /* not this op's to declare final (inside a segment it may read w again) */
    ddp_mark_final(d, w->param_index, rows_done * cols);
    int before = d->next_launch;
    ddp_launch_ready(d);
    d->st.block_launches += d->next_launch - before;
}

/* Every parameter with no uses left is final. */
static void ddp_finalize_unused(dt_ddp *d)
{
    for (int i = 0; i < d->nparams; i++)
        if (d->uses[i] == 0)
            ddp_param_final(d, i);
}

static dt_status ddp_finish(dt_ddp *d);

static dt_status ddp_backward_begin(dt_ddp *d)
{
    dt_ctx *ctx = d->ctx;
    if (ctx->n_params != d->nparams)
        return set_error(ctx, DT_ESTATE, "backward: %d parameters were registered after "
                         "dt_ddp_new wrapped %d; wrap the whole model", ctx->n_params - d->nparams,
                         d->nparams);
    /* A second backward before dt_ddp_sync: let the first one's allreduces
     * finish before touching the memory they reduce.  Compressed, the
     * averaged gradient would go through error feedback a second time. */
    if (d->pending_sync && d->cfg.compress != DT_COMPRESS_NONE)
        return set_error(ctx, DT_ESTATE, "backward: with gradient compression, call dt_ddp_sync "
                         "(or dt_ddp_step) before the next backward; accumulate with "
                         "dt_ddp_set_sync(ddp, 0) instead");
    if (d->pending_sync) {
        dt_status s = ddp_finish(d);
        if (s != DT_OK)
            return s;
    }
    d->t_backward = dt_now();
    d->hooks = 0;
    int fresh = 1;
    for (int i = 0; i < d->nparams && fresh; i++)
        fresh = (d->params[i]->grad->flags & T_ZERO) != 0;
    if (fresh && !d->z)   /* sharded: memory lent per bucket (src/zero.c) */
        ddp_point_grads(d);
    if (!d->sync)
        return DT_OK;
    d->pending_sync = 1;
    d->launch_status = DT_OK;
    d->next_launch = 0;
    /* dt_ddp_sync launches everything; zero 2 gives bucket memory back
     * during backward even so (src/zero.c) */
    if (!d->overlap && !(d->z && d->z->level >= 2))
        return DT_OK;
    memset(d->uses, 0, (size_t)d->nparams * sizeof *d->uses);
    memset(d->done, 0, (size_t)d->nparams * sizeof *d->done);
    tape_param_uses(ctx, d->uses, d->nparams);
    for (int b = 0; b < d->nbuckets; b++)
        d->buckets[b].pending = d->buckets[b].numel;
    ddp_finalize_unused(d);
    d->hooks = 1;
    ddp_launch_ready(d);
    return DT_OK;
}

static void ddp_node_done(dt_ddp *d, const dt_node *n)
{
    if (!d->hooks)
        return;
    int launch = 0;
    dt_tensor *const *in;
    int nin = tape_node_reads(n, &in);
    for (int k = 0; k < nin; k++) {
        const dt_tensor *t = in[k];
        if (t && (t->flags & T_PARAM) && t->ctx == d->ctx && --d->uses[t->param_index] == 0) {
            ddp_param_final(d, t->param_index);
            launch = 1;
        }
    }
    if (launch)
        ddp_launch_ready(d);
}

/* Whatever happened, every bucket is launched before backward returns (a
 * rank that stopped launching would leave the others waiting). */
static dt_status ddp_backward_end(dt_ddp *d, dt_status backward_status)
{
    if (d->hooks) {
        for (int i = 0; i < d->nparams; i++)
            ddp_param_final(d, i);
        ddp_launch_ready(d);
        d->hooks = 0;
    }
    d->st.backward_s += dt_now() - d->t_backward;
    return backward_status;
}

/* --- finishing a step ------------------------------------------------ */

/* Launch what is owed (no-overlap mode), wait for every bucket in order,
 * and mark the gradients no rank produced as absent again. */
static dt_status ddp_finish_run(dt_ddp *d);
static dt_status ddp_check_ranks(dt_ddp *d);

/* The wait for the step's buckets is exposed communication. */
static dt_status ddp_finish(dt_ddp *d)
{
    if (!d->pending_sync)
        return DT_OK;
    double t0 = prof_begin(d->ctx);
    int act = ctx_doing(d->ctx, ACT_COLLECTIVE);
    dt_status s = ddp_finish_run(d);
    if (s == DT_OK)
        s = ddp_check_ranks(d);
    if (s == DT_OK && !d->cfg.ps)   /* whether the job stops after this step (src/preempt.c) */
        s = preempt_vote(d->ctx, d->comm);
    ctx_done(d->ctx, act);
    prof_end(d->ctx, PH_COMM_WAIT, t0);
    return s;
}

static dt_status ddp_finish_run(dt_ddp *d)
{
    if (!d->pending_sync)
        return DT_OK;
    double t0 = dt_now();
    if (d->next_launch < d->nbuckets) {   /* no overlap: nothing was tracked */
        memset(d->done, 0, (size_t)d->nparams * sizeof *d->done);
        for (int i = 0; i < d->nparams; i++)
            ddp_param_final(d, i);
    }
    if (d->z) {   /* sharded: reduce-scattered (src/zero.c) */
        double exposed = 0;
        dt_status s = zero_finish(d, &exposed);
        d->st.exposed_s += exposed;
        d->pending_sync = 0;
        return s;
    }
    if (d->next_launch == 0 && d->cfg.compress == DT_COMPRESS_NONE && !d->cfg.ps)
        ddp_reduce_whole(d);
    while (d->next_launch < d->nbuckets)
        ddp_launch(d, &d->buckets[d->next_launch++]);
    dt_status first = d->launch_status;
    char msg[DT_MAX_ERROR];
    snprintf(msg, sizeof msg, "%s", d->launch_msg);
    for (int b = 0; b < d->nbuckets; b++) {
        if (!d->buckets[b].work)
            continue;
        double run = 0;
        dt_status s = comm_work_finish(d->buckets[b].work, &run);
        d->buckets[b].work = NULL;
        d->st.comm_s += run;
        if (s == DT_OK && !d->cfg.ps &&
            (d->cfg.compress == DT_COMPRESS_TOPK || d->cfg.compress == DT_COMPRESS_INT8))
            ddp_finish_compressed(d, &d->buckets[b]);
        if (s != DT_OK && first == DT_OK) {
            first = s;
            snprintf(msg, sizeof msg, "%s", d->ctx->err);
        }
    }
    if (first == DT_OK && d->cfg.ps) {   /* the step is pushed: the new parameters */
        ps_pushed(d->cfg.ps, d->nbuckets);
        if ((first = ps_step_pull(d->cfg.ps)) != DT_OK)
            snprintf(msg, sizeof msg, "%s", d->ctx->err);
    }
    d->st.exposed_s += dt_now() - t0;
    d->pending_sync = 0;
    if (first != DT_OK)
        return set_error(d->ctx, first, "ddp: gradient %s failed: %s",
                         d->cfg.ps ? "push or parameter pull" : "allreduce", msg);
    if (!d->cfg.ps)
        ddp_stage_in(d);
    /* a zero_grad since the buckets started discards what they reduced */
    int zeroed = d->ctx->zero_gen != d->zero_gen;
    const float *flags = d->set + d->grad_floats;
    for (int i = 0; i < d->nparams; i++) {
        dt_tensor *g = d->params[i]->grad;
        tensor_mark_zero(g, !(flags[i] > 0 && !zeroed));
    }
    d->st.steps++;
    d->st.bytes_sent += dt_comm_bytes_sent(d->comm) - d->sent_at_launch;
    return DT_OK;
}

/* The loss scaler (src/optim.c) over a DDP: refuse what it cannot serve; finish:
 * the step's reduction first, so it unscales and checks averages. */
static dt_status ddp_for_scaler(dt_ddp *d, int finish)
{
    if (d->cfg.ps)
        return set_error(d->ctx, DT_ENOTSUP, "loss_scaler: with a parameter server the servers "
                         "step on the pushed gradients before they could be unscaled or skipped");
    if (d->cfg.compress == DT_COMPRESS_TOPK || d->cfg.compress == DT_COMPRESS_INT8)
        return set_error(d->ctx, DT_ENOTSUP, "loss_scaler: top-k and int8 compression keep "
                         "scaled gradients in their error feedback");
    return finish ? ddp_finish(d) : DT_OK;
}

dt_status dt_ddp_sync(dt_ddp *d)
{
    if (!d || !d->ctx)
        return DT_EINVAL;
    return ddp_finish(d);
}

dt_status dt_ddp_step(dt_ddp *d)
{
    if (!d || !d->ctx)
        return DT_EINVAL;
    if (!d->opt && !d->cfg.ps)
        return set_error(d->ctx, DT_ESTATE, "ddp_step: this DDP was made without an optimizer");
    dt_status s = ddp_finish(d);
    return s != DT_OK || d->cfg.ps ? s : dt_optim_step(d->opt);   /* servers step for a PS */
}

dt_status dt_ddp_full_params(dt_ddp *d)
{
    if (!d || !d->ctx)
        return DT_EINVAL;
    return zero_full_params(d);
}

dt_status dt_ddp_set_sync(dt_ddp *d, int sync)
{
    if (!d || !d->ctx)
        return DT_EINVAL;
    d->sync = sync != 0;
    return DT_OK;
}

DT_PRIVATE int ddp_sync_of(const dt_ddp *d) { return d->sync; }

dt_status dt_ddp_stats_get(const dt_ddp *d, dt_ddp_stats *out)
{
    if (!d || !out)
        return DT_EINVAL;
    *out = d->st;
    return DT_OK;
}

/* --- the ranks' checks and load balancing -------------------------------
 * A balanced step's gradient is the global batch's: each rank's mean over
 * its slice, times world * slice / global, averaged over the ranks, is the
 * mean over the whole global batch. */
static void ddp_weigh(dt_ddp *d, int64_t offset, int64_t numel)
{
    if (!d->bal_ld || numel <= 0)
        return;
    int64_t count, global;
    dt_loader_batch_slice(d->bal_ld, NULL, &count, &global);
    float w = global > 0 ? (float)((double)count * dt_comm_size(d->comm) / (double)global) : 1.0f;
    if (w == 1.0f)
        return;
    float *g = ddp_grads(d) + offset;
    d->be_iface->axpby(d->be, numel, 0.0f, g, w, g);
}

/* After every `every` synchronised steps (the same step on every rank):
 * swap compute rates, name a straggler, and re-cut the global batch in
 * proportion to the rates when the shares move by more than 2 points
 * (smaller moves are noise, and each costs the loader a re-cut batch). */
static dt_status ddp_check_ranks(dt_ddp *d)
{
    int every = d->bal_ld ? d->bal_every : d->check_every;
    if (every <= 0 || d->cfg.ps || d->st.steps == 0 || d->st.steps % every)
        return DT_OK;
    int P = dt_comm_size(d->comm);
    double rates[64] = {0};
    if (P > 64)
        return DT_OK;
    dt_status s = prof_exchange(d->ctx, d->comm, rates);
    if (s != DT_OK || !d->bal_ld)
        return s;
    double sum = 0, old = 0, moved = 0;
    for (int r = 0; r < P; r++) {
        if (!(rates[r] > 0))
            return DT_OK;   /* a rank without a closed step yet: next time */
        sum += rates[r];
        old += d->bal_w[r];
    }
    for (int r = 0; r < P; r++) {
        double m = fabs(rates[r] / sum - d->bal_w[r] / old);
        moved = m > moved ? m : moved;
    }
    if (moved <= 0.02)
        return DT_OK;
    for (int r = 0; r < P; r++)
        d->bal_w[r] = rates[r] / sum;
    return dt_loader_set_split(d->bal_ld, d->bal_w, P);
}

dt_status dt_ddp_balance(dt_ddp *d, dt_loader *ld, int every)
{
    if (!d || !d->ctx)
        return DT_EINVAL;
    dt_ctx *ctx = d->ctx;
    int P = dt_comm_size(d->comm), me = dt_comm_rank(d->comm);
    if (every <= 0)
        every = 10;
    /* a bad call on one rank still joins the agreement below */
    const char *bad = !ld                             ? "the loader is NULL"
                      : loader_ctx(ld) != ctx          ? "the loader belongs to another context"
                      : d->cfg.ps                      ? "not with a parameter server (its workers "
                                                         "need not agree on a step)"
                      : !loader_config(ld)->global_batches ? "the loader needs global_batches"
                      : loader_config(ld)->shard_count != P || loader_config(ld)->shard_rank != me
                          ? "the loader's shards must be the ranks (shard_rank = rank, "
                            "shard_count = world)"
                      : P > 64                         ? "at most 64 ranks"
                      : d->bal_ld                      ? "already balancing"
                      : d->z                           ? "not with a sharded DDP (zero) yet"
                                                       : NULL;
    float mine[2] = {(float)every, bad ? 1.0f : 0.0f}, *all = host_alloc(ctx, sizeof(float) * 2 * (size_t)P);
    if (!all)
        return set_error(ctx, DT_ENOMEM, "ddp_balance: out of memory");
    dt_status s = comm_run_wait(d->comm, COLL_ALLGATHER, all, mine, 2, 0, DT_REDUCE_SUM, NULL);
    int differ = -1, failed = -1;
    for (int r = 0; s == DT_OK && r < P; r++) {
        if (all[2 * r] != mine[0] && differ < 0)
            differ = r;
        if (all[2 * r + 1] != 0 && failed < 0)
            failed = r;
    }
    float theirs = differ >= 0 ? all[2 * differ] : 0;
    host_free(ctx, all);
    if (s != DT_OK)
        return s;
    if (bad)
        return set_error(ctx, DT_EINVAL, "ddp_balance: %s", bad);
    if (failed >= 0)
        return set_error(ctx, DT_EINVAL, "ddp_balance: rank %d refused its call", failed);
    if (differ >= 0)
        return set_error(ctx, DT_EMISMATCH, "ddp_balance: rank %d balances every %g steps, this "
                         "rank every %d", differ, (double)theirs, every);
    if (!(d->bal_w = host_alloc(ctx, sizeof(double) * (size_t)P)))
        return set_error(ctx, DT_ENOMEM, "ddp_balance: out of memory");
    for (int r = 0; r < P; r++)
        d->bal_w[r] = 1.0 / P;
    d->bal_ld = ld;
    d->bal_every = every;
    prof_balancing(ctx, 1);
    return dt_loader_set_split(ld, d->bal_w, P);
}

double dt_ddp_balance_share(const dt_ddp *d)
{
    if (!d || !d->comm)
        return 0;
    int P = dt_comm_size(d->comm);
    return d->bal_w ? d->bal_w[dt_comm_rank(d->comm)] : 1.0 / P;
}

void dt_ddp_stats_reset(dt_ddp *d)
{
    if (!d)
        return;
    dt_ddp_stats keep = d->st;
    memset(&d->st, 0, sizeof d->st);
    d->st.buckets = keep.buckets;
    d->st.bucket_bytes = keep.bucket_bytes;
    d->st.overlap = keep.overlap;
    d->st.zero = keep.zero;
    d->st.shard_floats = keep.shard_floats;
    d->st.grad_bytes_peak = keep.grad_bytes_peak;
}

/* --- wrapping: the model check, buckets, rank 0's weights ------------ */

/* The DDP settings on line 0, then "name (d0, d1)" per parameter, in
 * registration order. */
static char *ddp_describe(dt_ctx *ctx, const char *settings, size_t *len_out)
{
    size_t cap = 64 + strlen(settings), len = 0;
    for (int i = 0; i < ctx->n_params; i++)
        cap += strlen(ctx->params[i]->name) + 24 * DT_MAX_DIMS + 8;
    char *s = host_alloc(ctx, cap);
    if (!s)
        return NULL;
    len = (size_t)snprintf(s, cap, "%s\n", settings);
    for (int i = 0; i < ctx->n_params; i++) {
        char sb[96];
        len += (size_t)snprintf(s + len, cap - len, "%s %s\n", ctx->params[i]->name,
                                SHAPE(ctx->params[i], sb));
    }
    *len_out = len;
    return s;
}

/* Line k of a description (without its newline) into out; "" past the end. */
static void ddp_line(const char *desc, int k, char *out, size_t cap)
{
    const char *p = desc;
    for (; k > 0 && p; k--) {
        p = strchr(p, '\n');
        if (p)
            p++;
    }
    size_t n = 0;
    while (p && p[n] && p[n] != '\n')
        n++;
    snprintf(out, cap, "%.*s", (int)(n < cap ? n : cap - 1), p ? p : "");
}

/* This rank's first difference from rank 0's description, or "". */
static void ddp_diff(const char *mine, const char *root, int rank, char *out, size_t cap)
{
    out[0] = '\0';
    for (int k = 0;; k++) {
        char a[DT_MAX_NAME + 128], b[DT_MAX_NAME + 128];
        ddp_line(root, k, a, sizeof a);
        ddp_line(mine, k, b, sizeof b);
        if (!a[0] && !b[0])
            return;
        if (strcmp(a, b) == 0)
            continue;
        if (k == 0) {
            snprintf(out, cap, "the DDP settings are '%.90s' on rank 0 but '%.90s' on rank %d",
                     a, b, rank);
            return;
        }
        k--;   /* parameters start on line 1 */
        if (!a[0])
            snprintf(out, cap, "rank %d has an extra parameter %d, '%.90s', that rank 0 lacks", rank,
                     k, b);
        else if (!b[0])
            snprintf(out, cap, "rank %d lacks parameter %d, '%.90s', that rank 0 has", rank, k, a);
        else
            snprintf(out, cap, "parameter %d is '%.90s' on rank 0 but '%.90s' on rank %d", k, a, b, rank);
        return;
    }
}

/* Every rank learns whether all models match rank 0's, and if not the
 * first difference (the lowest rank that has one), as an error. */
static dt_status ddp_check_models(dt_ctx *ctx, dt_comm *c, const char *settings)
{
    size_t len = 0;
    char *mine = ddp_describe(ctx, settings, &len);
    float *buf = NULL;
    char *root = NULL;
    dt_status s = DT_ENOMEM;
    int world = dt_comm_size(c), rank = dt_comm_rank(c);
    float flen = (float)len;
    if (!mine)
        goto out;
    if (len > (1u << 24))
        { s = set_error(ctx, DT_ENOTSUP, "ddp_new: model description too long"); goto out; }
    if ((s = dt_comm_broadcast(c, &flen, 1, 0)) != DT_OK)
        goto out;
    size_t rlen = (size_t)flen;
    size_t nf = rlen > (size_t)DT_DDP_DIFF * (size_t)world ? rlen : (size_t)DT_DDP_DIFF * (size_t)world;
    buf = host_alloc(ctx, (nf + DT_DDP_DIFF) * sizeof(float));
    root = host_alloc(ctx, rlen + 1);
    s = DT_ENOMEM;
    if (!buf || !root)
        goto out;
    for (size_t i = 0; i < rlen; i++)
        buf[i] = rank == 0 ? (float)(unsigned char)mine[i] : 0.0f;
    if ((s = dt_comm_broadcast(c, buf, (int64_t)rlen, 0)) != DT_OK)
        goto out;
    for (size_t i = 0; i < rlen; i++)
        root[i] = (char)(unsigned char)buf[i];
    root[rlen] = '\0';
    char diff[DT_DDP_DIFF];
    ddp_diff(mine, root, rank, diff, sizeof diff);
    float *my = buf + nf;
    for (int i = 0; i < DT_DDP_DIFF; i++)
        my[i] = (float)(unsigned char)diff[i];
    if ((s = dt_comm_allgather(c, my, DT_DDP_DIFF, buf)) != DT_OK)
        goto out;
    for (int r = 0; r < world; r++) {
        if (buf[(size_t)r * DT_DDP_DIFF] == 0.0f)
            continue;
        for (int i = 0; i < DT_DDP_DIFF; i++)
            diff[i] = (char)(unsigned char)buf[(size_t)r * DT_DDP_DIFF + i];
        diff[DT_DDP_DIFF - 1] = '\0';
        s = set_error(ctx, DT_EMISMATCH, "ddp_new: the ranks' models differ: %s", diff);
        goto out;
    }
    s = DT_OK;
out:
    if (s == DT_ENOMEM && ctx->last_status != DT_ENOMEM)
        set_error(ctx, DT_ENOMEM, "ddp_new: out of memory");
    host_free(ctx, mine);
    host_free(ctx, buf);
    host_free(ctx, root);
    return s;
}

/* DTRAIN_COMPRESS picks the compression when the program left it unset
 * (DT_COMPRESS_AUTO); else none.  A value the program set is kept. */
static dt_status ddp_compress_from_env(dt_ctx *ctx, dt_ddp_config *cfg)
{
    static const char *const names[] = {"none", "bf16", "fp16", "topk", "int8"};
    const char *e = getenv("DTRAIN_COMPRESS");
    if (cfg->compress != DT_COMPRESS_AUTO)
        return DT_OK;
    cfg->compress = DT_COMPRESS_NONE;
    if (!e || !*e)
        return DT_OK;
    for (int k = 0; k < 5; k++)
        if (!strcmp(e, names[k])) {
            cfg->compress = (dt_compress)k;
            return DT_OK;
        }
    return set_error(ctx, DT_EINVAL, "ddp_new: DTRAIN_COMPRESS='%s': expected none, bf16, fp16, "
                     "topk or int8", e);
}

static size_t ddp_bucket_cap(const dt_ddp_config *cfg, const dt_ctx *ctx)
{
    if (cfg->bucket_bytes)
        return cfg->bucket_bytes;
    const char *e = getenv("DTRAIN_BUCKET_BYTES");
    char *end;
    unsigned long long v = e ? strtoull(e, &end, 10) : 0;
    if (e && *e && !*end && v > 0)
        return (size_t)v;
    size_t total = 0;
    for (int i = 0; i < ctx->n_params; i++)
        total += tensor_bytes(ctx->params[i]);
    size_t cap = total / 8;
    return cap < DT_DDP_MIN_BUCKET_BYTES ? DT_DDP_MIN_BUCKET_BYTES
         : cap > DT_DDP_MAX_BUCKET_BYTES ? DT_DDP_MAX_BUCKET_BYTES : cap;
}

/* Zero 2: buckets of whole parameters, each closed before the parameter
 * that would take it past bucket_floats (a larger parameter alone), so a
 * bucket's lent memory is each of its gradients' contiguous home. */
static dt_status ddp_plan_whole(dt_ddp *d)
{
    int nb = 0;
    int64_t start = 0;
    for (int pass = 0; pass < 2; pass++) {
        int64_t fill = 0;
        nb = 0;
        start = 0;
        for (int k = 0; k < d->nparams; k++) {
            int64_t n = dt_tensor_numel(d->params[d->order[k]]);
            if (k > 0 && fill > 0 && fill + n > d->bucket_floats) {
                if (pass)
                    d->buckets[nb] = (ddp_bucket){.offset = start, .numel = fill};
                nb++;
                start += fill;
                fill = 0;
            }
            fill += n;
        }
        if (pass)
            d->buckets[nb] = (ddp_bucket){.offset = start, .numel = fill};
        nb++;
        if (!pass && !(d->buckets = host_calloc(d->ctx, sizeof *d->buckets * (size_t)nb)))
            return DT_ENOMEM;
    }
    d->nbuckets = nb;
    d->buckets[nb - 1].count = d->nparams;
    d->set_floats = d->grad_floats + d->nparams > 0 ? d->grad_floats + d->nparams : 1;
    return DT_OK;
}

/* Gradients lie contiguous in reverse registration order (the order
 * backward finishes them), then one flag per parameter; buckets cut that
 * every cap bytes, so a large parameter may span several (its row blocks
 * then travel as linear's backward makes them). */
static dt_status ddp_plan(dt_ddp *d, size_t cap)
{
    int64_t off = 0;
    for (int k = 0; k < d->nparams; k++) {
        int i = d->nparams - 1 - k;
        d->order[k] = i;
        d->offset[i] = off;
        off += dt_tensor_numel(d->params[i]);
    }
    d->grad_floats = off;
    d->bucket_floats = cap / sizeof(float) > 0 ? (int64_t)(cap / sizeof(float)) : 1;
    if (d->cfg.zero >= 2)
        return ddp_plan_whole(d);
    int64_t nb = off > 0 ? (off + d->bucket_floats - 1) / d->bucket_floats : 1;
    if (nb > INT32_MAX / 2)
        return set_error(d->ctx, DT_EINVAL, "ddp_new: bucket_bytes %zu makes %lld buckets",
                         cap, (long long)nb);
    d->buckets = host_calloc(d->ctx, sizeof *d->buckets * (size_t)nb);
    if (!d->buckets)
        return DT_ENOMEM;
    d->nbuckets = (int)nb;
    for (int j = 0; j < d->nbuckets; j++) {
        ddp_bucket *b = &d->buckets[j];
        b->offset = (int64_t)j * d->bucket_floats;
        b->numel = off - b->offset < d->bucket_floats ? off - b->offset : d->bucket_floats;
    }
    d->buckets[d->nbuckets - 1].count = d->nparams;
    d->set_floats = off + d->nparams > 0 ? off + d->nparams : 1;
    return DT_OK;
}

/* The gradient set: backend memory, or when staged host memory
 * (page-locked if the backend has it) plus a device twin.  Private memory
 * on every rank: on one host the allreduce goes through the segment's
 * fixed slots, whose chunks stay in cache while the other rank reads them
 * (docs/DATA_PARALLEL.md, "One gradient set"). */
static dt_status ddp_alloc_set(dt_ddp *d)
{
    size_t bytes = (size_t)d->set_floats * sizeof(float);
    float **mem = d->staged ? &d->dset : &d->set;
    if (!(*mem = d->be_iface->alloc(d->be, bytes)))
        return DT_ENOMEM;
    d->be_iface->memset0(d->be, *mem, bytes);
    if (!d->staged)
        return DT_OK;
    if (d->be_iface->host_alloc) {
        d->set = d->be_iface->host_alloc(d->be, bytes);
        d->pinned = d->set != NULL;
    }
    if (!d->set && !(d->set = host_alloc(d->ctx, bytes)))   /* no page-locked memory: ordinary */
        return DT_ENOMEM;
    memset(d->set, 0, bytes);
    return DT_OK;
}

/* overlap -1: does the allreduce have something to run on while backward
 * computes?  Across hosts the comm thread mostly waits on the network.  On
 * one host it copies memory, and needs a CPU the compute threads do not
 * use: more CPUs in this process's affinity than compute threads (an
 * unbound rank counts its share of the online CPUs). */
static int ddp_auto_overlap(const dt_ddp *d)
{
    if (dt_comm_hosts(d->comm) > 1 || d->staged)   /* staged: the host CPUs are idle */
        return 1;
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    cpu_set_t set;
    long cpus = online > 0 ? online : 1;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) < cpus)
        cpus = CPU_COUNT(&set);
    else if (comm_local_size(d->comm) > 1)
        cpus /= comm_local_size(d->comm);
    return cpus > d->ctx->threads;
}


/* The DDP attached to ctx, or NULL (for the layers above: a pipeline's
 * micro-batches decide which backward reduces) */
DT_PRIVATE struct dt_ddp *ddp_attached(dt_ctx *ctx)
{
    return ctx->grad_hooks == &ddp_grad_hooks ? ctx->hook_user : NULL;
}

/* Rank 0's f32 masters (param_dtype 16-bit, src/optim.c) to every rank,
 * one tensor at a time through stage (host memory as large as the largest
 * parameter, or NULL: the masters are host memory). */
static dt_status ddp_broadcast_masters(dt_ddp *d, float *stage)
{
    dt_optim *o = d->opt;
    dt_status s = DT_OK;
    for (int i = 0; s == DT_OK && o && optim_master_at(o, 0) && i < optim_param_count(o); i++) {
        dt_tensor *m = optim_master_at(o, i);
        float *buf = stage ? stage : FP(m);
        if (stage)
            be_to_host(d->ctx, stage, m->data, tensor_bytes(m));
        s = dt_comm_broadcast(d->comm, buf, dt_tensor_numel(m), 0);
        if (s == DT_OK && stage)
            be_to_device(d->ctx, m->data, stage, tensor_bytes(m));
    }
    return s;
}

/* Rank 0's parameters and masters to every rank, one tensor at a time
 * through a host stage as large as the largest (a sharded DDP on a device
 * backend, which has no set to pack them in). */
static dt_status ddp_broadcast_each(dt_ddp *d)
{
    size_t biggest = sizeof(float);
    for (int i = 0; i < d->nparams; i++)
        biggest = tensor_bytes(d->params[i]) > biggest ? tensor_bytes(d->params[i]) : biggest;
    float *stage = host_alloc(d->ctx, biggest);
    if (!stage)
        return set_error(d->ctx, DT_ENOMEM, "ddp_new: out of memory to broadcast the parameters");
    dt_status s = DT_OK;
    for (int i = 0; s == DT_OK && i < d->nparams; i++) {
        dt_tensor *p = d->params[i];
        be_to_host(d->ctx, stage, p->data, tensor_bytes(p));
        if ((s = dt_comm_broadcast(d->comm, stage, dt_tensor_numel(p), 0)) == DT_OK)
            be_to_device(d->ctx, p->data, stage, tensor_bytes(p));
    }
    if (s == DT_OK)
        s = ddp_broadcast_masters(d, stage);
    host_free(d->ctx, stage);
    return s;
}

/* Rank 0's parameter values to every rank, packed through set 0; and its
 * masters, so every rank steps the same f32 values. */
static dt_status ddp_broadcast_params(dt_ddp *d)
{
    float *stage = d->set;
    if (d->cfg.zero && !d->staged) {   /* no set yet: in place (host memory) */
        dt_status s = DT_OK;
        for (int i = 0; s == DT_OK && i < d->nparams; i++)
            s = dt_comm_broadcast(d->comm, FP(d->params[i]), dt_tensor_numel(d->params[i]), 0);
        return s == DT_OK ? ddp_broadcast_masters(d, NULL) : s;
    }
    if (d->cfg.zero)   /* staged, no set yet: one tensor at a time */
        return ddp_broadcast_each(d);
    for (int i = 0; i < d->nparams; i++)
        be_to_host(d->ctx, stage + d->offset[i], d->params[i]->data, tensor_bytes(d->params[i]));
    dt_status s = dt_comm_broadcast(d->comm, stage, d->set_floats, 0);
    if (s != DT_OK)
        return s;
    for (int i = 0; i < d->nparams; i++)
        be_to_device(d->ctx, d->params[i]->data, stage + d->offset[i], tensor_bytes(d->params[i]));
    return ddp_broadcast_masters(d, stage);
}

static void ddp_release(dt_ddp *d)
{
    zero_free(d);
    if (d->bal_ld && d->ctx) {
        prof_balancing(d->ctx, 0);
    }
    host_free(d->ctx, d->bal_w);
    d->bal_w = NULL;
    d->bal_ld = NULL;
    dt_ctx *ctx = d->ctx;
    if (d->last_ticket)   /* no copy may still read or write the sets */
        d->be_iface->copy_wait(d->be, d->last_ticket);
    if (d->dset)
        d->be_iface->free(d->be, d->dset);
    d->dset = NULL;
    if (d->set && !d->staged)
        d->be_iface->free(d->be, d->set);
    else if (d->set && d->pinned)
        d->be_iface->host_free(d->be, d->set);
    else if (d->set)
        host_free(ctx, d->set);
    host_free(ctx, d->order);
    host_free(ctx, d->offset);
    host_free(ctx, d->uses);
    host_free(ctx, d->done);
    host_free(ctx, d->own_grad);
    for (int b = 0; d->buckets && b < d->nbuckets; b++) {
        host_free(ctx, d->buckets[b].payload);
        host_free(ctx, d->buckets[b].gathered);
        host_free(ctx, d->buckets[b].residual);
        host_free(ctx, d->buckets[b].pieces);
        host_free(ctx, d->buckets[b].velocity);
    }
    host_free(ctx, d->scratch);
    host_free(ctx, d->picked);
    d->scratch = NULL;
    d->picked = NULL;
    host_free(ctx, d->buckets);
    host_free(ctx, d->params);
    d->params = NULL;
    d->set = NULL;
    d->order = NULL;
    d->offset = NULL;
    d->uses = NULL;
    d->done = NULL;
    d->own_grad = NULL;
    d->buckets = NULL;
}

dt_ddp *dt_ddp_new(dt_ctx *ctx, dt_comm *c, dt_optim *opt, const dt_ddp_config *cfg)
{
    if (!ctx_ok(ctx))
        return NULL;
    if (!c) {
        set_error(ctx, DT_EINVAL, "ddp_new: communicator is NULL");
        return NULL;
    }
    if (ctx->hook_user) {
        set_error(ctx, DT_ESTATE, "ddp_new: this context already has a DDP; free it first");
        return NULL;
    }
    if (comm_ctx(c) != ctx) {
        set_error(ctx, DT_EINVAL, "ddp_new: the communicator belongs to another context");
        return NULL;
    }
    if (!ctx->be_iface->host_visible && !be_stages(ctx->be_iface)) {
        set_error(ctx, DT_ENOTSUP, "ddp_new: the %s backend's memory is not host memory and it "
                  "has no asynchronous copies to stage gradients through", ctx->be_iface->name);
        return NULL;
    }
    if (opt && optim_ctx(opt) != ctx) {
        set_error(ctx, DT_EINVAL, "ddp_new: the optimizer belongs to another context");
        return NULL;
    }
    dt_ddp_config conf;
    dt_ddp_config_init(&conf);
    /* A bad setting on one rank still joins the model check, as a
     * difference, so no rank is left waiting in a collective. */
    dt_status local = cfg ? ctx_config_in(ctx, &conf, sizeof conf, cfg, "ddp_new", "dt_ddp_config")
                          : DT_OK;
    if (local == DT_OK)
        local = ddp_compress_from_env(ctx, &conf);
    if (local == DT_OK && (conf.compress < DT_COMPRESS_NONE || conf.compress > DT_COMPRESS_INT8 ||
                           conf.topk_ratio < 0 || conf.topk_ratio > 1))
        local = set_error(ctx, DT_EINVAL, "ddp_new: compress %d, topk_ratio %g: need a dt_compress "
                          "value and 0 <= topk_ratio <= 1", (int)conf.compress,
                          (double)conf.topk_ratio);
    dt_status zcode;
    const char *zwhy = local == DT_OK ? zero_refuses(&conf, opt, ctx, &zcode) : NULL;
    if (zwhy)
        local = set_error(ctx, zcode, "ddp_new: %s", zwhy);
    const char *wu = getenv("DTRAIN_TOPK_WARMUP");
    if (conf.topk_warmup_steps < 0)
        conf.topk_warmup_steps = wu && *wu && atoi(wu) > 0 ? atoi(wu) : 0;
    cfg = &conf;
    char settings[DT_MAX_ERROR + 64], local_msg[DT_MAX_ERROR];
    snprintf(local_msg, sizeof local_msg, "%s", ctx->err);
    if (local != DT_OK)
        snprintf(settings, sizeof settings, "invalid: %.200s", local_msg);
    else
        snprintf(settings, sizeof settings, "bucket_bytes %zu, overlap %d, compress %d, topk_ratio "
                 "%g, warmup %d, error_feedback %d, device memory %d, profiler checks every %d, "
                 "zero %d",
                 ddp_bucket_cap(cfg, ctx),
                 cfg->overlap < 0 ? -1 : cfg->overlap != 0, (int)cfg->compress,
                 (double)cfg->topk_ratio, cfg->topk_warmup_steps, cfg->error_feedback != 0,
                 !ctx->be_iface->host_visible, prof_check_every(ctx),
                 cfg->zero);
    if (conf.ps) {   /* dt_ps_new checked the workers' models; servers are not here */
        if (ps_ddp_check(ctx, c, &conf, opt) != DT_OK)
            return NULL;
    } else if (ddp_check_models(ctx, c, settings) != DT_OK) {
        return NULL;
    }
    if (local != DT_OK) {   /* every rank has the same bad setting */
        set_error(ctx, local, "%s", local_msg);
        return NULL;
    }
    dt_ddp *d = host_calloc(ctx, sizeof *d);
    if (!d) {
        set_error(ctx, DT_ENOMEM, "ddp_new: out of memory");
        return NULL;
    }
    *d = (dt_ddp){.ctx = ctx, .comm = c, .opt = opt, .cfg = *cfg, .al = ctx->al,
                  .be_iface = ctx->be_iface, .be = ctx->be, .nparams = ctx->n_params,
                  .sync = 1, .staged = !ctx->be_iface->host_visible};
    size_t np = (size_t)(d->nparams ? d->nparams : 1);
    d->params = host_calloc(ctx, np * sizeof *d->params);
    if (d->params)
        memcpy(d->params, ctx->params, (size_t)d->nparams * sizeof *d->params);
    d->order = host_calloc(ctx, np * sizeof *d->order);
    d->offset = host_calloc(ctx, np * sizeof *d->offset);
    d->uses = host_calloc(ctx, np * sizeof *d->uses);
    d->done = host_calloc(ctx, np * sizeof *d->done);
    d->own_grad = host_calloc(ctx, np * sizeof *d->own_grad);
    size_t cap = ddp_bucket_cap(cfg, ctx);
    dt_status s = DT_ENOMEM;
    if (d->params && d->order && d->offset && d->uses && d->done && d->own_grad)
        s = ddp_plan(d, cap);
    if (s == DT_OK && !d->cfg.zero)
        s = ddp_alloc_set(d);
    if (s == DT_OK && d->cfg.ps && d->cfg.compress != DT_COMPRESS_NONE)
        s = ddp_alloc_ps_code(d);
    else if (s == DT_OK &&
             (d->cfg.compress == DT_COMPRESS_TOPK || d->cfg.compress == DT_COMPRESS_INT8))
        s = ddp_alloc_compression(d);
    if (s == DT_ENOMEM) {
        set_error(ctx, DT_ENOMEM, "ddp_new: out of memory for %lld gradient floats",
                  (long long)d->set_floats);
    } else if (s == DT_OK && cfg->broadcast_params && !cfg->ps) {
        s = ddp_broadcast_params(d);
    }
    if (s == DT_OK && d->cfg.zero && (s = zero_new(d)) == DT_ENOMEM)
        set_error(ctx, DT_ENOMEM, "ddp_new: out of memory for the sharded state");
    if (s != DT_OK) {
        ddp_release(d);
        host_free(ctx, d);
        return NULL;
    }
    /* Gradients move into set 0 (what they hold so far comes along);
     * sharded, zero_new moved them. */
    for (int i = 0; i < d->nparams && !d->z; i++) {
        dt_tensor *g = d->params[i]->grad;
        d->own_grad[i] = g->data;
        if (!(g->flags & T_ZERO))
            d->be_iface->copy(d->be, ddp_grads(d) + d->offset[i], g->data, tensor_bytes(g));
    }
    if (!d->z)
        ddp_point_grads(d);
    if (!d->z)
        d->st.grad_bytes_peak = (size_t)d->set_floats * sizeof(float);
    if (d->momentum > 0)
        optim_momentum_elsewhere(d->opt, 1);
    d->overlap = cfg->overlap >= 0 ? cfg->overlap != 0 : ddp_auto_overlap(d);
    d->check_every = prof_check_every(ctx);
    d->st.overlap = d->overlap;
    d->st.buckets = d->nbuckets;
    d->st.bucket_bytes = cap;
    ctx_set_grad_hooks(ctx, &ddp_grad_hooks, d);
    return d;
}

static void ddp_forget_optim(dt_ddp *d, const dt_optim *opt)
{
    zero_forget_optim(d, opt);
    if (d->opt == opt)
        d->opt = NULL;   /* freed first: dt_ddp_step now refuses instead */
}

/* Give the gradients their own buffers back (current values copied) and
 * drop the bucket memory; the struct stays for dt_ddp_free. */
static void ddp_detach(dt_ddp *d)
{
    if (!d->ctx)
        return;
    if (d->pending_sync)
        ddp_finish_run(d);   /* no rank check: the others may be gone */
    for (int i = 0; i < d->nparams && !d->z; i++) {   /* sharded: zero_free gives them back */
        dt_tensor *g = d->params[i]->grad;
        if (!(g->flags & T_ZERO))
            d->be_iface->copy(d->be, d->own_grad[i], g->data, tensor_bytes(g));
        tensor_point_at(g, d->own_grad[i]);
    }
    if (d->momentum > 0 && d->opt)
        optim_momentum_elsewhere(d->opt, 0);
    ctx_set_grad_hooks(d->ctx, NULL, NULL);
    ddp_release(d);
    d->ctx = NULL;
}

void dt_ddp_free(dt_ddp *d)
{
    if (!d)
        return;
    ddp_detach(d);
    d->al.free_fn(d, d->al.user);
}

/* --- the hooks DDP registers with the lower layers (dt_grad_hooks) ------- */

static dt_status hook_backward_begin(void *u) { return ddp_backward_begin(u); }
static void hook_node_done(void *u, const dt_node *n) { ddp_node_done(u, n); }
static dt_status hook_backward_end(void *u, dt_status s) { return ddp_backward_end(u, s); }
static dt_status hook_before_unscale(void *u, int finish) { return ddp_for_scaler(u, finish); }
static void hook_optim_freed(void *u, const dt_optim *o) { ddp_forget_optim(u, o); }
static void hook_ctx_freed(void *u) { ddp_detach(u); }

/* Sharded (src/zero.c); for a plain DDP they do nothing. */
static dt_status hook_grad_memory(void *u, dt_tensor *p)
{
    dt_ddp *d = u;
    int i = p->param_index;
    return d->z && p->ctx == d->ctx && i >= 0 && i < d->nparams && d->params[i] == p
               ? zero_grad_memory(d, i) : DT_OK;
}
static int hook_grads_sharded(void *u) { return ((dt_ddp *)u)->z != NULL; }
static void hook_grad_scale(void *u, float k) { zero_grad_scale(u, k); }
static dt_status hook_grad_sumsq(void *u, double *total)
{
    dt_status s = ddp_finish(u);   /* the shards are this step's averages only once reduced */
    return s != DT_OK ? s : zero_grad_sumsq(u, total);
}
static dt_status hook_after_step(void *u, dt_optim *o)
{
    return ((dt_ddp *)u)->z ? zero_after_step(u, o) : DT_OK;
}
static dt_status hook_param_use(void *u, const void *data, int backward)
{
    return zero_param_use(u, data, backward);
}
static dt_status hook_node_params(void *u, const dt_node *n)
{
    dt_ddp *d = u;
    if (!d->z || d->z->level != 3)
        return DT_OK;
    dt_tensor *const *in;
    int nin = tape_node_reads(n, &in);
    dt_status s = DT_OK;
    for (int k = 0; k < nin && s == DT_OK; k++)
        if (in[k])
            s = zero_param_use(d, in[k]->data, 1);
    return s;
}
static int hook_param_whole(void *u, const void *data) { return zero_param_whole(u, data); }

static const dt_grad_hooks ddp_grad_hooks = {
    .backward_begin = hook_backward_begin,
    .node_done = hook_node_done,
    .backward_end = hook_backward_end,
    .grad_chunk_rows = ddp_grad_chunk_rows,
    .grad_rows_done = ddp_grad_rows_done,
    .before_unscale = hook_before_unscale,
    .optim_freed = hook_optim_freed,
    .ctx_freed = hook_ctx_freed,
    .grad_memory = hook_grad_memory,
    .grads_sharded = hook_grads_sharded,
    .grad_scale = hook_grad_scale,
    .grad_sumsq = hook_grad_sumsq,
    .after_step = hook_after_step,
    .param_use = hook_param_use,
    .node_params = hook_node_params,
    .param_whole = hook_param_whole,
};
