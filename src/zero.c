#include "dist.h"

/* ===========================================================================
 * Sharded data parallelism: ZeRO stages 1 and 2 (dt_ddp_config.zero)
 *
 * The sharded mode of src/ddp.c: the same buckets, hooks and order of
 * launches, with a different reduction and a different step.  The N
 * gradient floats, laid out as the buckets lay them (reverse registration
 * order), are cut into one contiguous shard per rank, balanced to within
 * one float (comm_block_range).  Each bucket is reduce-scattered (in place,
 * COLL_REDUCE_SCATTER_V: each rank's block of the bucket is its shard's
 * part of it), so afterwards a rank holds the average of its own shard
 * only, the same bytes on the wire as half an allreduce.  The optimizer
 * (src/optim.c, optim_shard) keeps state for and steps only that shard;
 * its after_step hook then all-gathers the parameters (COLL_ALLGATHER_V),
 * the other half of the allreduce's bytes.
 *
 * Level 1 keeps the gradients whole in one set (no second set: a step ends
 * with its reduction, so nothing is in flight when the next backward
 * writes).  Level 2 lends a bucket its memory when the first of its
 * gradients is written (the grad_memory hook that grad_target calls) and
 * takes it back once its reduce-scatter is collected, after copying this
 * rank's block into the shard: buckets hold whole parameters, so a lent
 * buffer is one parameter's contiguous home.  Taken-back memory goes to a
 * pool and is lent again, so the steady state allocates nothing.  Without
 * overlap the reduce-scatter runs on the spot, inline, so the memory still
 * comes back during backward.
 *
 * Gradients the step consumed point at `park` (never written unless a
 * caller reads a zeroed gradient), so nothing a caller does with them can
 * write into the shards.  Calls down only: comm, the backend, the
 * optimizer's shard table.
 * ======================================================================== */

/* --- src/zero.c --- */

struct zero_buf {
    float *mem;
    int64_t cap;               /* floats */
    int busy;                  /* lent to a bucket */
};

/* Why cfg cannot shard (NULL: it can, or it does not ask to); *code the
 * status to fail with. */
DT_PRIVATE const char *zero_refuses(const dt_ddp_config *cfg, const dt_optim *opt, const dt_ctx *ctx,
                                    dt_status *code)
{
    *code = DT_EINVAL;
    if (cfg->zero == 0)
        return NULL;
    if (cfg->zero < 0 || cfg->zero > 3)
        return "zero must be 0, 1, 2 or 3";
    *code = DT_ENOTSUP;
    if (!opt)
        return "zero needs the optimizer whose state it shards";
    if (optim_is_sharded(opt))
        return "zero: this optimizer's state is already sharded (by another DDP)";
    if (cfg->compress != DT_COMPRESS_NONE)
        return "zero: gradient compression does not combine with sharding";
    if (cfg->ps)
        return "zero: not with a parameter server (the servers hold the state)";
    if (cfg->zero == 3 && !ctx->be_iface->discard)
        return "zero 3: the backend cannot give memory back (no discard)";
    return NULL;
}

/* Zero 2 with overlap: buckets reduce-scattering at once, at most.  Memory
 * lent is then the shard, these, and the buckets backward is writing; more
 * in flight would hide little more on one host and hold a bucket each. */
#define ZERO_IN_FLIGHT 2
/* Pool buffers beyond one a bucket: zero 1-2's after-step gather, zero 3's
 * prefetch and its gather on demand. */
#define ZERO_STAGING 3
/* Zero 3: units (buckets) kept whole at most, besides those in hand: a
 * unit read within the last ZERO_RECENT parameter reads is never given
 * back, so an op's own inputs (at most NODE_MAX_IN) stay whole while it
 * computes. */
#define ZERO_RESIDENT 2
#define ZERO_RECENT 8
/* How far zero_predict looks: in the last step's trace, for the unit in
 * hand (units a layer's ops read alternate) and past it for the next one
 * to gather. */
#define ZERO_FIND 64
#define ZERO_AHEAD 32

static zero_state *Z(const dt_ddp *d) { return d->z; }
static dt_status zero_evict_all(dt_ddp *d);
static void zero_prefetch(dt_ddp *d, int j);
static void zero_trace_swap(zero_state *z);

/* All-gathers of parameters ran ran_s, exposed_s of it waited for: the
 * DDP's stats and the profile's (the end-of-job report).  A wait for a
 * prefetch also waits for what the comm thread ran before it (a bucket's
 * reduce-scatter): only the gather's own time counts as its exposure. */
static void zero_note_gather(dt_ddp *d, double ran_s, double exposed_s)
{
    exposed_s = exposed_s < ran_s ? exposed_s : ran_s;
    d->st.gather_s += ran_s;
    d->st.gather_exposed_s += exposed_s;
    prof_gather(d->ctx, ran_s, exposed_s);
}

/* Parameters k whose flat range meets [lo, hi): first..last in d->order
 * (the flat layout), via fn(d, k, a, e) with the meeting part [a, e). */
typedef void (*zero_part_fn)(dt_ddp *d, int k, int64_t a, int64_t e, void *arg);
static void zero_each_part(dt_ddp *d, int64_t lo, int64_t hi, zero_part_fn fn, void *arg)
{
    for (int j = 0; j < d->nparams; j++) {
        int k = d->order[j];
        int64_t off = d->offset[k], a = off > lo ? off : lo;
        int64_t e = off + dt_tensor_numel(d->params[k]);
        e = e < hi ? e : hi;
        if (e > a)
            fn(d, k, a, e, arg);
        if (off >= hi)
            break;
    }
}

/* --- staged (a device backend): the collectives run on host memory ------
 * The gradients stay device memory (zero 1: the set; zero 2: the lent
 * buckets and the shard); z->host mirrors the flat layout on the host, as
 * src/ddp.c's set mirrors its device twin.  A bucket travels out once its
 * gradients are final (the copy stream waits for backward's kernels, the
 * comm thread for the copy), is reduce-scattered there, and only this
 * rank's block comes back.  After the step the parameters' shards go out,
 * are all-gathered there, and come back whole. */

/* Device floats dev (flat floats [off, off + n)) start their way to
 * z->host; the ticket to wait for (0: none). */
static uint64_t zero_stage_out(dt_ddp *d, const float *dev, int64_t off, int64_t n)
{
    if (!d->staged || n <= 0)
        return 0;
    uint64_t t = d->be_iface->copy_async(d->be, Z(d)->host + off, dev, (size_t)n * sizeof(float),
                                         DT_COPY_D2H);
    d->last_ticket = t > d->last_ticket ? t : d->last_ticket;
    return t;
}

/* Flat floats [off, off + n) of z->host to device floats dev, before any
 * later kernel (the optimizer) reads them. */
static void zero_stage_in(dt_ddp *d, float *dev, int64_t off, int64_t n)
{
    if (n <= 0)
        return;
    uint64_t t = d->be_iface->copy_async(d->be, dev, Z(d)->host + off, (size_t)n * sizeof(float),
                                         DT_COPY_H2D);
    if (t)
        d->be_iface->copy_join(d->be, t);
    d->last_ticket = t > d->last_ticket ? t : d->last_ticket;
}

/* --- zero 2's pool of bucket memory --------------------------------- */

static void zero_note_lent(dt_ddp *d, int64_t floats)
{
    zero_state *z = Z(d);
    z->lent_bytes += (size_t)floats * sizeof(float);
    if (z->lent_bytes > d->st.grad_bytes_peak)
        d->st.grad_bytes_peak = z->lent_bytes;
}

/* A free pool buffer of n to 2n floats (the smallest), or a new one; with
 * the table full, the smallest free one that holds n, else the smallest
 * free one replaced by a new one (never a churn of allocations, never a
 * refusal while one is free); -1 when out of memory.  grads: lent to a
 * bucket's gradients (counted in grad_bytes_peak), else a gather's staging. */
static int zero_pool_take(dt_ddp *d, int64_t n, int grads)
{
    zero_state *z = Z(d);
    int best = -1;
    for (int k = 0; k < z->npool; k++)   /* at most twice the size: a large buffer stays for
                                              the large buckets (the tied embedding's) */
        if (!z->pool[k].busy && z->pool[k].cap >= n && z->pool[k].cap <= 2 * n &&
            (best < 0 || z->pool[k].cap < z->pool[best].cap))
            best = k;
    int full = z->npool == d->nbuckets + ZERO_STAGING, fit = -1;
    for (int k = 0; best < 0 && full && k < z->npool; k++)   /* the table full: any size that fits */
        if (!z->pool[k].busy && z->pool[k].cap >= n && (fit < 0 || z->pool[k].cap < z->pool[fit].cap))
            fit = k;
    best = best < 0 ? fit : best;
    if (best < 0) {   /* a new buffer; the table full, the smallest free one makes way */
        int slot = full ? -1 : z->npool;
        for (int k = 0; full && k < z->npool; k++)
            if (!z->pool[k].busy && (slot < 0 || z->pool[k].cap < z->pool[slot].cap))
                slot = k;
        if (slot < 0)
            return -1;   /* cannot happen: one a bucket, plus the gathers' */
        float *mem = d->be_iface->alloc(d->be, (size_t)(n ? n : 1) * sizeof(float));
        if (!mem)
            return -1;
        if (slot < z->npool)
            d->be_iface->free(d->be, z->pool[slot].mem);
        else
            z->npool++;
        best = slot;
        z->pool[best] = (zero_buf){.mem = mem, .cap = n};
    }
    z->pool[best].busy = grads ? 1 : 2;
    if (grads)
        zero_note_lent(d, z->pool[best].cap);
    return best;
}

static void zero_pool_give(dt_ddp *d, int k)
{
    zero_state *z = Z(d);
    if (z->pool[k].busy == 1)
        z->lent_bytes -= (size_t)z->pool[k].cap * sizeof(float);
    z->pool[k].busy = 0;
}

static void zero_point_at(dt_ddp *d, int k, int64_t a, int64_t e, void *arg)
{
    (void)a;
    (void)e;
    const ddp_bucket *b = arg;
    tensor_point_at(d->params[k]->grad, b->mem + (d->offset[k] - b->offset));
}

/* Parameter i's gradient is about to be written: give it its home (zero 1:
 * the set; zero 2: its bucket's lent memory, lent now if not yet). */
DT_PRIVATE dt_status zero_grad_memory(dt_ddp *d, int i)
{
    zero_state *z = Z(d);
    dt_tensor *g = d->params[i]->grad;
    if (z->level == 1) {
        tensor_point_at(g, z->flat + d->offset[i]);
        return DT_OK;
    }
    ddp_bucket *b = &d->buckets[ddp_bucket_of(d, d->offset[i])];
    if (!b->mem) {
        int k = zero_pool_take(d, b->numel, 1);
        if (k < 0)
            return set_error(d->ctx, DT_ENOMEM, "ddp: out of memory for a gradient bucket of %lld "
                             "floats", (long long)b->numel);
        b->lent = k;
        b->mem = z->pool[k].mem;
        zero_each_part(d, b->offset, b->offset + b->numel, zero_point_at, b);
    }
    return DT_OK;
}

/* --- reducing: buckets reduce-scattered -------------------------------- */

static void zero_park(dt_ddp *d, int k, int64_t a, int64_t e, void *arg)
{
    (void)a;
    (void)e;
    (void)arg;
    dt_tensor *g = d->params[k]->grad;
    tensor_point_at(g, Z(d)->park);
    tensor_mark_zero(g, 1);
}

/* Zero 2: bucket b's reduce-scatter is done: our block goes to the shard,
 * and its memory back to the pool. */
static void zero_collect(dt_ddp *d, ddp_bucket *b)
{
    zero_state *z = Z(d);
    int64_t lo = b->blocks[z->rank], hi = b->blocks[z->rank + 1];
    float *to = z->shard_grad + (b->offset + lo - z->lo);
    if (d->staged)   /* reduced on the host: our block back to the device */
        zero_stage_in(d, to, b->offset + lo, hi - lo);
    else if (hi > lo)
        memcpy(to, b->mem + lo, (size_t)(hi - lo) * sizeof(float));
    zero_each_part(d, b->offset, b->offset + b->numel, zero_park, NULL);
    zero_pool_give(d, b->lent);
    b->lent = -1;
    b->mem = NULL;
}

static void zero_note_failure(dt_ddp *d, dt_status s)
{
    if (s != DT_OK && d->launch_status == DT_OK) {
        d->launch_status = s;
        snprintf(d->launch_msg, sizeof d->launch_msg, "%s", d->ctx->err);
    }
}

/* Collect, in order, the buckets whose reduce-scatter has finished (zero 2,
 * during backward: their memory is free for the next ones); all: wait. */
static void zero_reap(dt_ddp *d, int all)
{
    zero_state *z = Z(d);
    while (z->reaped < d->next_launch) {
        ddp_bucket *b = &d->buckets[z->reaped];
        if (b->work && !all && !comm_work_done(b->work))
            return;
        if (b->work) {
            double run = 0;
            dt_status s = comm_work_finish(b->work, &run);
            b->work = NULL;
            d->st.comm_s += run;
            zero_note_failure(d, s);
        }
        if (b->mem && d->launch_status == DT_OK)
            zero_collect(d, b);
        z->reaped++;
    }
}

static void zero_mark_used(dt_ddp *d, int k, int64_t a, int64_t e, void *arg)
{
    (void)a;
    (void)e;
    (void)arg;
    Z(d)->used[k] = d->params[k]->grad->flags & T_ZERO ? 0.0f : 1.0f;
}

/* Bucket b is final on this rank: start its reduce-scatter (zero 2 without
 * overlap: run it here, so its memory comes back now). */
DT_PRIVATE void zero_launch(dt_ddp *d, ddp_bucket *b)
{
    zero_state *z = Z(d);
    if (b == d->buckets) {
        d->sent_at_launch = dt_comm_bytes_sent(d->comm);
        d->zero_gen = d->ctx->zero_gen;
    }
    zero_each_part(d, b->offset, b->offset + b->numel, zero_mark_used, NULL);
    float *mem = z->level == 1 ? z->flat + b->offset : b->mem;
    d->st.grad_bytes += (uint64_t)b->numel * sizeof(float);
    d->st.payload_bytes += (uint64_t)b->numel * sizeof(float);
    if (b->numel == 0 || !mem)
        return;
    uint64_t ticket = zero_stage_out(d, mem, b->offset, b->numel);
    float *buf = d->staged ? z->host + b->offset : mem;
    if (z->level >= 2 && !d->overlap) {
        double t0 = dt_now();
        if (ticket)
            d->be_iface->copy_wait(d->be, ticket);
        zero_note_failure(d, comm_run_wait(d->comm, COLL_REDUCE_SCATTER_V, buf, NULL, b->numel, 0,
                                           DT_REDUCE_AVG, b->blocks));
        d->st.comm_s += dt_now() - t0;
    } else {   /* staged: the comm thread waits for the copy before it sends */
        comm_stage_next(d->comm, ticket);
        b->work = comm_enqueue_in(d->comm, COLL_REDUCE_SCATTER_V, buf, NULL, b->numel, 0,
                                  DT_REDUCE_AVG, b->blocks);
        uint64_t unused = comm_stage_next(d->comm, 0);
        if (unused)   /* not consumed: the launch failed; let the copy land */
            d->be_iface->copy_wait(d->be, unused);
        if (!b->work)
            zero_note_failure(d, d->ctx->last_status);
    }
    if (z->level < 2)
        return;
    zero_reap(d, 0);   /* what is done gives its memory back, in order */
    while (d->next_launch - z->reaped > ZERO_IN_FLIGHT) {   /* and at most this many wait */
        int upto = d->next_launch;
        d->next_launch = z->reaped + 1;
        zero_reap(d, 1);
        d->next_launch = upto;
    }
}

/* Zero 1 without overlap: the whole set in one reduce-scatter, cut at the
 * shards (the comm's phases paid once). */
static void zero_reduce_whole(dt_ddp *d)
{
    zero_state *z = Z(d);
    d->sent_at_launch = dt_comm_bytes_sent(d->comm);
    d->zero_gen = d->ctx->zero_gen;
    for (int k = 0; k < d->nparams; k++)
        z->used[k] = d->params[k]->grad->flags & T_ZERO ? 0.0f : 1.0f;
    double t0 = dt_now();
    uint64_t ticket = zero_stage_out(d, z->flat, 0, d->grad_floats);
    if (ticket)
        d->be_iface->copy_wait(d->be, ticket);
    zero_note_failure(d, comm_run_wait(d->comm, COLL_REDUCE_SCATTER_V, d->staged ? z->host : z->flat,
                                       NULL, d->grad_floats, 0, DT_REDUCE_AVG, z->shard));
    d->st.comm_s += dt_now() - t0;
    d->st.grad_bytes += (uint64_t)d->grad_floats * sizeof(float);
    d->st.payload_bytes += (uint64_t)d->grad_floats * sizeof(float);
    d->next_launch = d->nbuckets;
}

/* Hand the optimizer this step's shard: which parameters got a gradient on
 * some rank (an allreduce of the flags), or none after a zero_grad. */
static dt_status zero_publish(dt_ddp *d)
{
    zero_state *z = Z(d);
    dt_status s = d->nparams ? comm_run_wait(d->comm, COLL_ALLREDUCE, z->used, NULL, d->nparams, 0,
                                             DT_REDUCE_SUM, NULL)
                             : DT_OK;
    if (s != DT_OK)
        return s;
    int zeroed = d->ctx->zero_gen != d->zero_gen;
    dt_optim *o = z->opt;
    for (int i = 0; o && i < optim_param_count(o); i++)
        optim_shard_used(o, i, !zeroed && z->used[optim_param_at(o, i)->param_index] > 0);
    /* the gradients are consumed: what a caller may read of them is zeros */
    zero_each_part(d, 0, d->grad_floats, zero_park, NULL);
    return DT_OK;
}

/* Launch what is owed, wait for every bucket, publish the shard. */
DT_PRIVATE dt_status zero_finish(dt_ddp *d, double *exposed)
{
    zero_state *z = Z(d);
    double t0 = dt_now();
    if (d->next_launch == 0 && z->level == 1)
        zero_reduce_whole(d);
    while (d->next_launch < d->nbuckets)
        zero_launch(d, &d->buckets[d->next_launch++]);
    if (z->level >= 2) {
        zero_reap(d, 1);
    } else {
        for (int b = 0; b < d->nbuckets; b++) {
            if (!d->buckets[b].work)
                continue;
            double run = 0;
            zero_note_failure(d, comm_work_finish(d->buckets[b].work, &run));
            d->buckets[b].work = NULL;
            d->st.comm_s += run;
        }
    }
    z->reaped = 0;
    if (z->level == 1 && d->staged && d->launch_status == DT_OK)   /* our shard, reduced, back */
        zero_stage_in(d, z->flat + z->lo, z->lo, z->hi - z->lo);
    dt_status s = d->launch_status;
    char msg[DT_MAX_ERROR];
    snprintf(msg, sizeof msg, "%s", d->launch_msg);
    if (s == DT_OK && (s = zero_publish(d)) != DT_OK)
        snprintf(msg, sizeof msg, "%s", d->ctx->err);
    *exposed = dt_now() - t0;
    if (s != DT_OK)
        return set_error(d->ctx, s, "ddp: gradient reduce-scatter failed: %s", msg);
    d->st.steps++;
    d->st.bytes_sent += dt_comm_bytes_sent(d->comm) - d->sent_at_launch;
    return DT_OK;
}

/* --- clipping and unscaling the shards ---------------------------------- */

static float *zero_shard_grads(const dt_ddp *d)
{
    const zero_state *z = Z(d);
    return z->level == 1 ? z->flat + z->lo : z->shard_grad;
}

DT_PRIVATE void zero_grad_scale(dt_ddp *d, float k)
{
    zero_state *z = Z(d);
    if (z->hi > z->lo)
        d->be_iface->axpby(d->be, z->hi - z->lo, k, zero_shard_grads(d), 0.0f, zero_shard_grads(d));
}

/* Every rank's sum of squares, as a double in two floats, summed in rank
 * order: the same total on every rank. */
DT_PRIVATE dt_status zero_grad_sumsq(dt_ddp *d, double *total)
{
    zero_state *z = Z(d);
    double mine = z->hi > z->lo ? d->be_iface->sumsq(d->be, z->hi - z->lo, zero_shard_grads(d)) : 0;
    float pair[2] = {(float)mine, 0}, *all = host_alloc(d->ctx, sizeof(float) * 2 * (size_t)z->world);
    if (!all)
        return set_error(d->ctx, DT_ENOMEM, "clip_grad_norm: out of memory");
    pair[1] = isfinite(mine) ? (float)(mine - (double)pair[0]) : 0.0f;
    dt_status s = comm_run_wait(d->comm, COLL_ALLGATHER, all, pair, 2, 0, DT_REDUCE_SUM, NULL);
    double sum = 0;
    for (int r = 0; r < z->world; r++)
        sum += (double)all[2 * r] + (double)all[2 * r + 1];
    host_free(d->ctx, all);
    *total = sum;
    return s;
}

/* --- after the step: the parameters all-gathered --------------------------- */

typedef struct zero_copy {
    float *flat;               /* where flat float 0 would be */
    int to_flat;
} zero_copy;

/* Parameter k's floats [a, e) of the flat layout to flat (to_flat) or
 * back.  To flat at zero 3 with masters (this rank's part of a gather):
 * the master, rounded to the parameters' precision. */
static void zero_copy_part(dt_ddp *d, int k, int64_t a, int64_t e, void *arg)
{
    const zero_copy *c = arg;
    zero_state *z = Z(d);
    float *p = FP(d->params[k]) + (a - d->offset[k]);
    int i = c->to_flat && z->opt_index ? z->opt_index[k] : -1;
    if (i >= 0) {   /* staged: rounded into the (committed) parameter, and out from there */
        dt_optim *o = z->opt;
        const float *m = FP(optim_master_at(o, i)) + (a - d->offset[k] - optim_shard_lo(o, i));
        dt_precision prec = optim_config(o)->param_dtype == DT_BF16 ? DT_PREC_BF16 : DT_PREC_F16;
        d->be_iface->round_prec(d->be, prec, e - a, m, d->staged ? p : c->flat + a);
        if (d->staged)
            be_to_host(d->ctx, c->flat + a, p, (size_t)(e - a) * sizeof(float));
    } else if (c->to_flat && c->flat + a != p) {   /* staged: flat is the host mirror */
        be_to_host(d->ctx, c->flat + a, p, (size_t)(e - a) * sizeof(float));
    } else if (!c->to_flat && c->flat + a != p) {
        be_to_device(d->ctx, p, c->flat + a, (size_t)(e - a) * sizeof(float));
    }
}

/* This rank's part of unit j into buf (which holds the unit's floats):
 * before its all-gather.  In place without masters it is there already. */
static void zero_own_in(dt_ddp *d, int j, float *buf)
{
    zero_state *z = Z(d);
    const ddp_bucket *b = &d->buckets[j];
    int64_t lo = b->offset + b->blocks[z->rank], hi = b->offset + b->blocks[z->rank + 1];
    zero_copy c = {buf - b->offset, 1};
    if (hi > lo)
        zero_each_part(d, lo, hi, zero_copy_part, &c);
}

/* Floats [lo, hi) of the flat layout: our shard's part of the parameters
 * into buf (which holds flat floats from base on), all-gathered, and back
 * into every parameter. */
static dt_status zero_gather_span(dt_ddp *d, float *buf, int64_t base, int64_t lo, int64_t hi,
                                  const int64_t *blocks)
{
    zero_state *z = Z(d);
    zero_copy c = {buf - base, 1};
    int64_t mlo = z->lo > lo ? z->lo : lo, mhi = z->hi < hi ? z->hi : hi;
    if (mhi > mlo)
        zero_each_part(d, mlo, mhi, zero_copy_part, &c);
    dt_status s = comm_run_in(d->comm, COLL_ALLGATHER_V, buf, NULL, hi - lo, 0, DT_REDUCE_SUM, blocks);
    if (s != DT_OK)
        return s;
    c.to_flat = 0;
    zero_each_part(d, lo, hi, zero_copy_part, &c);
    return DT_OK;
}

DT_PRIVATE dt_status zero_after_step(dt_ddp *d, dt_optim *o)
{
    zero_state *z = Z(d);
    if (o != z->opt)
        return DT_OK;
    double t0 = dt_now();
    dt_status s = DT_OK;
    if (z->level == 3) {   /* the shards moved: every other part is stale */
        s = zero_evict_all(d);
        for (int i = 0; i < optim_param_count(o); i++)
            optim_shard_used(o, i, 0);
        /* the next forward's first unit is the last one's (every rank runs
         * the same ops): its gather starts now, behind the caller's data
         * loading, instead of in front of the forward */
        if (s == DT_OK && z->first_unit >= 0)
            zero_prefetch(d, z->first_unit);
        z->step_ended = 1;
        zero_trace_swap(z);
        return s;
    }
    if (z->level == 1 || d->staged) {   /* staged: the host mirror, whole, at every level */
        s = zero_gather_span(d, d->staged ? z->host : z->flat, 0, 0, d->grad_floats, z->shard);
    } else {
        for (int j = 0; s == DT_OK && j < d->nbuckets; j++) {
            ddp_bucket *b = &d->buckets[j];
            if (b->numel == 0)
                continue;
            int k = zero_pool_take(d, b->numel, 0);
            if (k < 0)
                return set_error(d->ctx, DT_ENOMEM, "optim_step: out of memory to gather parameters");
            s = zero_gather_span(d, z->pool[k].mem, b->offset, b->offset, b->offset + b->numel,
                                 b->blocks);
            zero_pool_give(d, k);
        }
    }
    for (int i = 0; i < optim_param_count(o); i++)   /* stepped: a second step needs a new reduction */
        optim_shard_used(o, i, 0);
    zero_note_gather(d, dt_now() - t0, dt_now() - t0);   /* the caller waits for all of it */
    return s == DT_OK ? DT_OK
                      : set_error(d->ctx, s, "optim_step: parameter all-gather failed: %s", d->ctx->err);
}

/* --- zero 3: parameters held as shards ----------------------------------- */

/* The parameter whose memory holds data, or -1 (by_addr is sorted). */
static int zero_param_at(const dt_ddp *d, const void *data)
{
    const zero_state *z = Z(d);
    uintptr_t p = (uintptr_t)data;
    int lo = 0, hi = d->nparams - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2, k = z->by_addr[mid];
        uintptr_t base = (uintptr_t)d->params[k]->data;
        if (p < base)
            hi = mid - 1;
        else if (p >= base + tensor_bytes(d->params[k]))
            lo = mid + 1;
        else
            return k;
    }
    return -1;
}

/* Parameter k's pages outside this rank's shard go back to the system. */
static void zero_discard_part(dt_ddp *d, int k, int64_t a, int64_t e, void *arg)
{
    (void)a;
    (void)e;
    (void)arg;
    zero_state *z = Z(d);
    float *base = FP(d->params[k]);
    int64_t off = d->offset[k], n = dt_tensor_numel(d->params[k]);
    int64_t s0 = (z->lo > off ? z->lo : off) - off, s1 = (z->hi < off + n ? z->hi : off + n) - off;
    if (s1 <= s0 || (z->opt_index && z->opt_index[k] >= 0)) {   /* masters: none kept */
        d->be_iface->discard(d->be, base, (size_t)n * sizeof(float));
        return;
    }
    d->be_iface->discard(d->be, base, (size_t)s0 * sizeof(float));
    d->be_iface->discard(d->be, base + s1, (size_t)(n - s1) * sizeof(float));
}

static void zero_evict(dt_ddp *d, int j)
{
    zero_state *z = Z(d);
    const ddp_bucket *b = &d->buckets[j];
    zero_each_part(d, b->offset, b->offset + b->numel, zero_discard_part, NULL);
    z->resident[j] = 0;
    z->nresident--;
}

/* Memory for parameter k's floats [a, e) of the flat layout, which a
 * discard may have given back (a backend with commit: device memory that
 * comes back only when asked for; *(dt_status *)arg the first failure). */
static void zero_commit_part(dt_ddp *d, int k, int64_t a, int64_t e, void *arg)
{
    dt_status *s = arg;
    if (*s == DT_OK && d->be_iface->commit)
        *s = d->be_iface->commit(d->be, FP(d->params[k]) + (a - d->offset[k]),
                                 (size_t)(e - a) * sizeof(float));
}

/* Flat floats [lo, hi) of the parameters writable again (before a gather
 * writes them, or a load its shard). */
static dt_status zero_commit(dt_ddp *d, int64_t lo, int64_t hi)
{
    dt_status s = DT_OK;
    if (d->be_iface->commit)
        zero_each_part(d, lo, hi, zero_commit_part, &s);
    return s == DT_OK ? DT_OK
                      : set_error(d->ctx, s, "ddp: out of %s memory to gather parameters",
                                  d->be_iface->name);
}

static dt_status zero_commit_unit(dt_ddp *d, int j)
{
    const ddp_bucket *b = &d->buckets[j];
    return zero_commit(d, b->offset, b->offset + b->numel);
}

/* Wait for a gather in flight and put what it brought into the parameters
 * (keep) or drop it. */
static dt_status zero_prefetch_finish(dt_ddp *d, int keep)
{
    zero_state *z = Z(d);
    if (z->pre_unit < 0)
        return DT_OK;
    double run = 0, t0 = dt_now();
    dt_status s = comm_work_finish(z->pre_work, &run);
    zero_note_gather(d, run, dt_now() - t0);
    const ddp_bucket *b = &d->buckets[z->pre_unit];
    if (s == DT_OK && keep && !z->pre_inplace) {   /* from the staging buffer or the mirror */
        zero_copy c = {z->pre_mem - b->offset, 0};
        zero_each_part(d, b->offset, b->offset + b->numel, zero_copy_part, &c);
    }
    if (s == DT_OK && keep) {
        z->resident[z->pre_unit] = 1;
        z->nresident++;
        d->st.gathers++;
        prof_gather_unit(d->ctx, 0);
    } else if (z->pre_inplace || d->staged) {   /* its memory was written or committed: back */
        zero_each_part(d, b->offset, b->offset + b->numel, zero_discard_part, NULL);
    }
    if (z->pre_buf >= 0)
        zero_pool_give(d, z->pre_buf);
    z->pre_unit = -1;
    z->pre_work = NULL;
    return s;
}

/* Unit j's memory when it is one parameter (its shard already sits in
 * place: the gather fills the rest around it), else NULL.  Staged, never:
 * the collectives run on host memory. */
static float *zero_unit_home(const dt_ddp *d, int j)
{
    int k = Z(d)->alone[j];
    return k >= 0 && !d->staged ? FP(d->params[k]) : NULL;
}

/* Where unit j is gathered: in place (zero_unit_home), the host mirror
 * (staged), or a staging buffer of the pool (*k its index, else -1); NULL
 * when none can be had.  Staged, the unit's memory is committed first. */
static float *zero_gather_buf(dt_ddp *d, int j, int *k)
{
    zero_state *z = Z(d);
    const ddp_bucket *b = &d->buckets[j];
    *k = -1;
    if (d->staged)
        return zero_commit_unit(d, j) == DT_OK ? z->host + b->offset : NULL;
    float *home = zero_unit_home(d, j);
    if (home)
        return home;
    if ((*k = zero_pool_take(d, b->numel, 0)) < 0)
        return NULL;
    return z->pool[*k].mem;
}

/* Start gathering unit j (into a staging buffer, or in place) while the
 * caller computes. */
static void zero_prefetch(dt_ddp *d, int j)
{
    zero_state *z = Z(d);
    if (j < 0)
        return;
    const ddp_bucket *b = &d->buckets[j];
    if (z->pinned || z->resident[j] || z->pre_unit >= 0 || b->numel == 0)
        return;
    int k;
    float *buf = zero_gather_buf(d, j, &k);
    if (!buf)
        return;   /* no room: it will be gathered when needed */
    zero_own_in(d, j, buf);
    z->pre_work = comm_enqueue_in(d->comm, COLL_ALLGATHER_V, buf, NULL, b->numel, 0, DT_REDUCE_SUM,
                                  b->blocks);
    if (!z->pre_work) {
        if (k >= 0)
            zero_pool_give(d, k);
        if (d->staged)
            zero_each_part(d, b->offset, b->offset + b->numel, zero_discard_part, NULL);
        return;
    }
    z->pre_unit = j;
    z->pre_buf = k;
    z->pre_mem = buf;
    z->pre_inplace = buf == zero_unit_home(d, j);
}

/* Unit j whole now: from the gather in flight if it is j's, else gathered
 * here (any other gather in flight lands first: the comm's order). */
static dt_status zero_unit_load(dt_ddp *d, int j)
{
    zero_state *z = Z(d);
    if (z->pre_unit == j)
        return zero_prefetch_finish(d, 1);
    ddp_bucket *b = &d->buckets[j];
    float *home = zero_unit_home(d, j);
    int k;
    float *buf = zero_gather_buf(d, j, &k);
    if (!buf)
        return set_error(d->ctx, DT_ENOMEM, "ddp: out of memory to gather %lld parameter floats",
                         (long long)b->numel);
    double t0 = dt_now();
    if (home)
        zero_own_in(d, j, home);
    dt_status s = home ? comm_run_in(d->comm, COLL_ALLGATHER_V, home, NULL, b->numel, 0,
                                     DT_REDUCE_SUM, b->blocks)
                       : zero_gather_span(d, buf, b->offset, b->offset, b->offset + b->numel,
                                          b->blocks);
    zero_note_gather(d, dt_now() - t0, dt_now() - t0);
    if (k >= 0)
        zero_pool_give(d, k);
    if (s != DT_OK)
        return s;
    z->resident[j] = 1;
    z->nresident++;
    d->st.gathers++;
    d->st.gathers_on_demand++;
    prof_gather_unit(d->ctx, 1);
    return DT_OK;
}

/* Room for one more unit: the least recently used whole units go back,
 * none read within the last ZERO_RECENT reads (the op in hand's). */
static void zero_make_room(dt_ddp *d, int keep)
{
    zero_state *z = Z(d);
    while (!z->pinned && z->nresident >= ZERO_RESIDENT) {
        int old = -1;
        for (int u = 0; u < d->nbuckets; u++)
            if (z->resident[u] && u != keep && (old < 0 || z->last[u] < z->last[old]))
                old = u;
        if (old < 0 || z->tick - z->last[old] < ZERO_RECENT)
            return;
        zero_evict(d, old);
    }
}

/* A step ended: its trace is the one the next step predicts from. */
static void zero_trace_swap(zero_state *z)
{
    int *t = z->prev;
    z->prev = z->rec;
    z->prev_n = z->rec_n;
    z->rec = t;
    z->rec_n = 0;
    z->cursor = -1;
}

/* The unit to gather next, now that unit j is read (in backward: 1).
 * FSDP's way: the order of the last step, whose ops this step repeats.
 * Find this read in the last step's trace (near where the step was), then
 * the first unit after it that is neither j nor whole now (-1: none
 * within ZERO_AHEAD reads).  Without a
 * trace (the first step, or ops that changed), the walk's order: buckets
 * run in reverse registration order, the order backward needs them;
 * forward the other way. */
static int zero_predict(dt_ddp *d, int j, int backward)
{
    zero_state *z = Z(d);
    int e = 2 * j + backward, nb = d->nbuckets;
    if (z->rec_n == 0 || z->rec[z->rec_n - 1] != e) {
        if (z->rec_n < z->trace_cap)
            z->rec[z->rec_n++] = e;
        int from = z->cursor < 0 ? 0 : z->cursor, at = -1;
        for (int i = from; i < z->prev_n && i < from + ZERO_FIND && at < 0; i++)
            if (z->prev[i] == e)
                at = i;
        z->cursor = at;
    }
    for (int i = z->cursor + 1; z->cursor >= 0 && i < z->prev_n && i <= z->cursor + ZERO_AHEAD; i++) {
        int u = z->prev[i] / 2;
        if (u != j && !z->resident[u])
            return u;
    }
    if (z->cursor >= 0)   /* what the step reads next is whole already */
        return -1;
    return backward ? (j + 1) % nb : (j - 1 + nb) % nb;
}

/* An op (backward 0) or a node's backward (1) reads memory at data. */
DT_PRIVATE dt_status zero_param_use(dt_ddp *d, const void *data, int backward)
{
    zero_state *z = Z(d);
    if (!z || z->level != 3 || !data)
        return DT_OK;
    int k = zero_param_at(d, data);
    if (k < 0)
        return DT_OK;
    int j = z->unit_of[k];
    if (z->step_ended) {   /* the first unit a step reads (zero_after_step prefetches it) */
        z->first_unit = j;
        z->step_ended = 0;
    }
    z->last[j] = ++z->tick;
    if (!z->resident[j]) {
        zero_make_room(d, j);
        dt_status s = zero_unit_load(d, j);
        if (s != DT_OK)
            return set_error(d->ctx, s, "ddp: gathering the parameters of '%s' failed: %s",
                             d->params[k]->name, d->ctx->err);
    }
    zero_prefetch(d, zero_predict(d, j, backward));
    return DT_OK;
}

DT_PRIVATE int zero_param_whole(const dt_ddp *d, const void *data)
{
    const zero_state *z = Z(d);
    if (!z || z->level != 3)
        return 1;
    int k = zero_param_at(d, data);
    return k < 0 || z->resident[z->unit_of[k]];
}

/* Every unit gathered and kept until the next step. */
DT_PRIVATE dt_status zero_full_params(dt_ddp *d)
{
    zero_state *z = Z(d);
    if (!z || z->level != 3)
        return DT_OK;
    dt_status s = zero_prefetch_finish(d, 1);
    z->pinned = 1;
    for (int j = 0; s == DT_OK && j < d->nbuckets; j++)
        if (!z->resident[j] && d->buckets[j].numel > 0)
            s = zero_unit_load(d, j);
    return s;
}

/* After a step (and at the start): only the shards are current. */
static dt_status zero_evict_all(dt_ddp *d)
{
    zero_state *z = Z(d);
    dt_status s = zero_prefetch_finish(d, 0);
    for (int j = 0; j < d->nbuckets; j++)
        if (z->resident[j])
            zero_evict(d, j);
    z->pinned = 0;
    return s;
}

/* Parameter k's floats [*s0, *s1) that are current: all of them when its
 * unit is whole, else our shard's part (perhaps none). */
static void zero_current_part(const dt_ddp *d, int k, int64_t *s0, int64_t *s1)
{
    const zero_state *z = Z(d);
    int64_t n = dt_tensor_numel(d->params[k]), off = d->offset[k];
    *s0 = 0;
    *s1 = n;
    if (z->resident[z->unit_of[k]])
        return;
    int64_t a = z->lo - off, e = z->hi - off;
    *s0 = a < 0 ? 0 : a > n ? n : a;
    *s1 = e < *s0 ? *s0 : e > n ? n : e;
}

/* Floats [a, e) of parameter memory mem, given back, read as zero: host
 * memory's whole pages inside do already (the discard), and only the bytes
 * of the pages at the ends, which discard left, are written, so nothing
 * given back comes back; device memory (a backend with commit) is asked
 * back and zeroed. */
static void zero_clear(dt_ddp *d, float *mem, int64_t a, int64_t e)
{
    if (e <= a)
        return;
    if (d->be_iface->commit) {
        if (d->be_iface->commit(d->be, mem + a, (size_t)(e - a) * sizeof(float)) == DT_OK)
            d->be_iface->memset0(d->be, mem + a, (size_t)(e - a) * sizeof(float));
        return;   /* out of device memory: it stays given back */
    }
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t pg = page > 0 ? (uintptr_t)page : 4096, lo = (uintptr_t)(mem + a), hi = (uintptr_t)(mem + e);
    uintptr_t in0 = (lo + pg - 1) & ~(pg - 1), in1 = hi & ~(pg - 1);
    if (in1 <= in0) {
        d->be_iface->memset0(d->be, mem + a, (size_t)(e - a) * sizeof(float));
        return;
    }
    d->be_iface->memset0(d->be, mem + a, in0 - lo);
    d->be_iface->discard(d->be, (void *)in0, in1 - in0);
    d->be_iface->memset0(d->be, (void *)in1, hi - in1);
}

/* The DDP is going: what of each parameter is not current (zero_current_part)
 * reads as zero from now on, as given-back memory does on Linux, and on a
 * device is there to read (it would fault). */
static void zero_settle_params(dt_ddp *d)
{
    for (int k = 0; k < d->nparams; k++) {
        dt_tensor *p = d->params[k];
        int64_t n = dt_tensor_numel(p), s0, s1;
        if (d->be_iface->commit && d->be_iface->commit(d->be, p->data, tensor_bytes(p)) != DT_OK)
            continue;   /* out of device memory: it stays given back */
        zero_current_part(d, k, &s0, &s1);
        zero_clear(d, FP(p), 0, s0);
        zero_clear(d, FP(p), s1, n);
    }
}

/* Zero 3's tables: each parameter's unit, the parameters by address. */
static dt_status zero_units(dt_ddp *d)
{
    zero_state *z = Z(d);
    size_t np = (size_t)(d->nparams + 1), nb = (size_t)d->nbuckets;
    z->unit_of = host_calloc(d->ctx, sizeof(int) * np);
    z->by_addr = host_calloc(d->ctx, sizeof(int) * np);
    z->alone = host_calloc(d->ctx, sizeof(int) * (nb + 1));
    z->resident = host_calloc(d->ctx, nb);
    z->last = host_calloc(d->ctx, sizeof(uint64_t) * nb);
    z->trace_cap = 8 * (int)nb + 64;
    z->rec = host_calloc(d->ctx, sizeof(int) * (size_t)z->trace_cap);
    z->prev = host_calloc(d->ctx, sizeof(int) * (size_t)z->trace_cap);
    if (!z->unit_of || !z->by_addr || !z->resident || !z->last || !z->alone || !z->rec || !z->prev)
        return DT_ENOMEM;
    z->cursor = -1;
    z->pre_unit = -1;
    z->first_unit = -1;
    z->step_ended = 1;
    for (int j = 0; j < d->nbuckets; j++)
        z->alone[j] = -1;
    for (int k = 0; k < d->nparams; k++) {
        z->unit_of[k] = ddp_bucket_of(d, d->offset[k]);
        const ddp_bucket *b = &d->buckets[z->unit_of[k]];
        if (b->offset == d->offset[k] && b->numel == dt_tensor_numel(d->params[k]))
            z->alone[z->unit_of[k]] = k;
        int at = k;   /* insertion by address: a few hundred parameters at most, once */
        while (at > 0 && (uintptr_t)d->params[z->by_addr[at - 1]]->data > (uintptr_t)d->params[k]->data) {
            z->by_addr[at] = z->by_addr[at - 1];
            at--;
        }
        z->by_addr[at] = k;
    }
    for (int j = 0; j < d->nbuckets; j++)   /* whole now (after the broadcast) */
        z->resident[j] = 1;
    z->nresident = d->nbuckets;
    return zero_evict_all(d);
}

/* --- making and freeing --------------------------------------------------- */

typedef struct zero_optim_ranges {
    int64_t *lo, *n;
} zero_optim_ranges;

/* The optimizer keeps and steps only our shard of each of its parameters. */
static dt_status zero_shard_optim(dt_ddp *d)
{
    zero_state *z = Z(d);
    dt_optim *o = d->opt;
    int np = optim_param_count(o);
    int64_t *lo = host_calloc(d->ctx, sizeof(int64_t) * 2 * (size_t)(np + 1)), *n = lo + np + 1;
    if (!lo)
        return set_error(d->ctx, DT_ENOMEM, "ddp_new: out of memory");
    for (int i = 0; i < np; i++) {
        dt_tensor *p = optim_param_at(o, i);
        int k = p->param_index;
        if (k < 0 || k >= d->nparams || d->params[k] != p) {
            host_free(d->ctx, lo);
            return set_error(d->ctx, DT_EINVAL, "ddp_new: the optimizer's parameter '%s' is not "
                             "one this DDP wraps", p->name);
        }
        int64_t off = d->offset[k], a = off > z->lo ? off : z->lo;
        int64_t e = off + dt_tensor_numel(p);
        e = e < z->hi ? e : z->hi;
        lo[i] = e > a ? a - off : 0;
        n[i] = e > a ? e - a : 0;
    }
    dt_status s = optim_shard_state(o, lo, n);
    int masters = optim_master_at(o, 0) != NULL;
    for (int i = 0; s == DT_OK && i < np; i++) {
        int64_t a = d->offset[optim_param_at(o, i)->param_index] + lo[i];
        optim_shard_grad(o, i, z->level == 1 ? z->flat + a : z->shard_grad + (a - z->lo),
                         z->level == 3 && masters);
    }
    host_free(d->ctx, lo);
    if (s == DT_OK && z->level == 3 && masters) {
        if (!(z->opt_index = host_calloc(d->ctx, sizeof(int) * (size_t)(d->nparams + 1))))
            return set_error(d->ctx, DT_ENOMEM, "ddp_new: out of memory");
        for (int k = 0; k < d->nparams; k++)
            z->opt_index[k] = -1;
        for (int i = 0; i < np; i++)
            z->opt_index[optim_param_at(o, i)->param_index] = i;
    }
    if (s == DT_OK)
        z->opt = o;
    return s;
}

/* Every rank's shard, and each bucket's blocks of it. */
static dt_status zero_cut(dt_ddp *d)
{
    zero_state *z = Z(d);
    int P = z->world;
    z->shard = host_calloc(d->ctx, sizeof(int64_t) * (size_t)(P + 1));
    if (!z->shard)
        return DT_ENOMEM;
    for (int q = 0; q < P; q++) {
        int64_t hi;
        comm_block_range(d->grad_floats, P, q, &z->shard[q], &hi);
    }
    z->shard[P] = d->grad_floats;
    z->lo = z->shard[z->rank];
    z->hi = z->shard[z->rank + 1];
    for (int j = 0; j < d->nbuckets; j++) {
        ddp_bucket *b = &d->buckets[j];
        b->lent = -1;
        b->count = 0;   /* the used flags travel on their own (zero_publish) */
        if (!(b->blocks = host_calloc(d->ctx, sizeof(int64_t) * (size_t)(P + 1))))
            return DT_ENOMEM;
        for (int q = 0; q <= P; q++) {
            int64_t at = z->shard[q] - b->offset;
            b->blocks[q] = at < 0 ? 0 : at > b->numel ? b->numel : at;
        }
    }
    return DT_OK;
}

/* Staged: the host mirror of the flat layout (page-locked if the backend
 * has it, so the copies are truly asynchronous). */
static dt_status zero_alloc_host(dt_ddp *d)
{
    zero_state *z = Z(d);
    size_t bytes = (size_t)(d->grad_floats ? d->grad_floats : 1) * sizeof(float);
    if (d->be_iface->host_alloc)
        z->host_pinned = (z->host = d->be_iface->host_alloc(d->be, bytes)) != NULL;
    if (!z->host && !(z->host = host_alloc(d->ctx, bytes)))
        return DT_ENOMEM;
    memset(z->host, 0, bytes);
    return DT_OK;
}

/* Memory: zero 1 the set; zero 2 the shard and the pool's table; both a
 * parking place as large as the largest parameter (never touched unless a
 * consumed gradient is read). */
static dt_status zero_alloc(dt_ddp *d)
{
    zero_state *z = Z(d);
    int64_t biggest = 1;
    for (int k = 0; k < d->nparams; k++)
        biggest = dt_tensor_numel(d->params[k]) > biggest ? dt_tensor_numel(d->params[k]) : biggest;
    z->used = host_calloc(d->ctx, sizeof(float) * (size_t)(d->nparams + 1));
    z->park = d->be_iface->alloc(d->be, (size_t)biggest * sizeof(float));
    if (!z->used || !z->park)
        return DT_ENOMEM;
    if (d->staged && zero_alloc_host(d) != DT_OK)
        return DT_ENOMEM;
    if (z->level == 1) {
        size_t bytes = (size_t)(d->grad_floats ? d->grad_floats : 1) * sizeof(float);
        if (!(z->flat = d->be_iface->alloc(d->be, bytes)))
            return DT_ENOMEM;
        d->be_iface->memset0(d->be, z->flat, bytes);
        d->set = z->flat;
        d->st.grad_bytes_peak = bytes;
        return DT_OK;
    }
    size_t bytes = (size_t)(z->hi > z->lo ? z->hi - z->lo : 1) * sizeof(float);
    z->pool = host_calloc(d->ctx, sizeof *z->pool * (size_t)(d->nbuckets + ZERO_STAGING));
    if (!z->pool || !(z->shard_grad = d->be_iface->alloc(d->be, bytes)))
        return DT_ENOMEM;
    d->be_iface->memset0(d->be, z->shard_grad, bytes);
    z->lent_bytes = bytes;
    d->st.grad_bytes_peak = bytes;
    return DT_OK;
}

/* After ddp_plan: the shards, the memory, the optimizer's shard.  The
 * gradients' own buffers are given up (they come back in zero_free); what
 * they held moves to the set (zero 1) or a lent bucket (zero 2). */
DT_PRIVATE dt_status zero_new(dt_ddp *d)
{
    zero_state *z = host_calloc(d->ctx, sizeof *z);
    if (!z)
        return DT_ENOMEM;
    d->z = z;
    *z = (zero_state){.level = d->cfg.zero, .world = dt_comm_size(d->comm),
                      .rank = dt_comm_rank(d->comm)};
    for (int i = 0; i < d->nparams; i++)
        d->own_grad[i] = d->params[i]->grad->data;
    dt_status s = zero_cut(d);
    if (s == DT_OK)
        s = zero_alloc(d);
    if (s == DT_OK)
        s = zero_shard_optim(d);
    if (s == DT_OK && z->level == 3)
        s = zero_units(d);
    if (s != DT_OK)
        return s;
    d->st.zero = z->level;
    d->st.shard_floats = z->hi - z->lo;
    for (int i = 0; i < d->nparams; i++) {   /* not given up yet (zero_return_grads) */
        dt_tensor *g = d->params[i]->grad;
        void *own = g->data;
        if (g->flags & T_ZERO) {
            tensor_point_at(g, z->park);
        } else if ((s = zero_grad_memory(d, i)) != DT_OK) {
            return s;
        } else {
            d->be_iface->copy(d->be, g->data, own, tensor_bytes(g));
        }
        d->be_iface->free(d->be, own);
        tensor_count_persistent(d->ctx, -(int64_t)tensor_bytes(g));
        d->own_grad[i] = NULL;
    }
    host_give_back(d->ctx);
    return DT_OK;
}

/* Give every gradient a buffer of its own again (what it holds comes
 * along); a buffer that cannot be had leaves that gradient where it is,
 * and zero_free then keeps the DDP's memory it points into. */
static int zero_return_grads(dt_ddp *d)
{
    int kept = 0;
    for (int i = 0; i < d->nparams; i++) {
        dt_tensor *g = d->params[i]->grad;
        if (d->own_grad[i])
            continue;   /* zero_new did not get to it */
        size_t bytes = tensor_bytes(g);
        void *mem = d->be_iface->alloc(d->be, bytes ? bytes : DT_ARENA_ALIGN);
        if (!mem) {
            kept = 1;
            continue;
        }
        if (!(g->flags & T_ZERO))   /* a zero one stays unwritten, as tensor_attach_grad leaves it */
            d->be_iface->copy(d->be, mem, g->data, bytes);
        tensor_point_at(g, mem);
        d->own_grad[i] = mem;
        tensor_count_persistent(d->ctx, (int64_t)bytes);
    }
    return kept;
}

/* Undo zero_new (whatever of it happened); the optimizer, its state a
 * shard of a job that is gone, refuses to step from now on. */
DT_PRIVATE void zero_free(dt_ddp *d)
{
    zero_state *z = Z(d);
    if (!z)
        return;
    if (d->last_ticket)   /* no copy may still read or write the mirror or the buckets */
        d->be_iface->copy_wait(d->be, d->last_ticket);
    if (z->pre_unit >= 0 && z->pre_work)
        zero_prefetch_finish(d, 0);
    int kept = d->ctx && d->own_grad ? zero_return_grads(d) : 0;
    if (d->ctx && z->level == 3 && z->resident)
        zero_settle_params(d);
    if (z->opt)
        optim_orphan(z->opt);
    dt_ctx *ctx = d->ctx;
    for (int j = 0; d->buckets && j < d->nbuckets; j++) {
        host_free(ctx, d->buckets[j].blocks);
        d->buckets[j].blocks = NULL;
    }
    if (!kept) {   /* else a gradient still points into them: kept until the process ends */
        for (int k = 0; k < z->npool; k++)
            d->be_iface->free(d->be, z->pool[k].mem);
        if (z->flat)
            d->be_iface->free(d->be, z->flat);
        if (z->park)
            d->be_iface->free(d->be, z->park);
    }
    if (z->shard_grad)
        d->be_iface->free(d->be, z->shard_grad);
    if (z->host && z->host_pinned)
        d->be_iface->host_free(d->be, z->host);
    else
        host_free(ctx, z->host);
    host_free(ctx, z->pool);
    host_free(ctx, z->unit_of);
    host_free(ctx, z->by_addr);
    host_free(ctx, z->opt_index);
    host_free(ctx, z->alone);
    host_free(ctx, z->resident);
    host_free(ctx, z->last);
    host_free(ctx, z->rec);
    host_free(ctx, z->prev);
    host_free(ctx, z->shard);
    host_free(ctx, z->used);
    host_free(ctx, z);
    d->z = NULL;
    d->set = NULL;
}

/* The optimizer is being freed: nothing to mark later.  Zero 3 with
 * masters: the parameters' shards live only in them, so each master,
 * rounded, goes back into its parameter's own floats, kept from then on. */
DT_PRIVATE void zero_forget_optim(dt_ddp *d, const dt_optim *o)
{
    zero_state *z = d->z;
    if (!z || z->opt != o)
        return;
    for (int i = 0; z->opt_index && i < optim_param_count(o); i++) {
        int64_t lo = optim_shard_lo(o, i), n = optim_shard_count(o, i);
        dt_precision prec = optim_config(o)->param_dtype == DT_BF16 ? DT_PREC_BF16 : DT_PREC_F16;
        int k = optim_param_at(o, i)->param_index;
        if (n > 0 && zero_commit(d, d->offset[k] + lo, d->offset[k] + lo + n) == DT_OK)
            d->be_iface->round_prec(d->be, prec, n, FP(optim_master_at(o, i)),
                                    FP(optim_param_at(o, i)) + lo);
    }
    host_free(d->ctx, z->opt_index);
    z->opt_index = NULL;
    z->opt = NULL;
}

/* --- sharded checkpoints --------------------------------------------------- */

/* This rank's floats of each of the context's parameters in a sharded
 * checkpoint: its block of the flat layout (comm_block_range, the shard
 * zero keeps), at every level, so the ranks write disjoint pieces that
 * tile the model.  A parameter registered after the DDP: rank 0, whole. */
static int64_t *zero_ckpt_ranges(dt_ddp *d)
{
    dt_ctx *ctx = d->ctx;
    int P = dt_comm_size(d->comm), r = dt_comm_rank(d->comm), np = ctx->n_params;
    int64_t a0, a1, *lo = host_calloc(ctx, sizeof(int64_t) * 2 * (size_t)(np + 1)), *n = lo + np + 1;
    if (!lo)
        return NULL;
    comm_block_range(d->grad_floats, P, r, &a0, &a1);
    for (int k = 0; k < np; k++) {
        int64_t numel = dt_tensor_numel(ctx->params[k]);
        if (k >= d->nparams || d->params[k] != ctx->params[k]) {
            n[k] = r == 0 ? numel : 0;
            continue;
        }
        int64_t off = d->offset[k], a = off > a0 ? off : a0;
        int64_t e = off + numel < a1 ? off + numel : a1;
        lo[k] = e > a ? a - off : 0;
        n[k] = e > a ? e - a : 0;
    }
    return lo;
}

/* Every rank learns whether every rank got here with DT_OK; the first
 * that did not is named, with its own message on its own rank. */
static dt_status zero_ckpt_agree(dt_ddp *d, const char *op, dt_status mine)
{
    dt_ctx *ctx = d->ctx;
    int P = dt_comm_size(d->comm), me = dt_comm_rank(d->comm);
    float f = (float)mine, *all = host_alloc(ctx, sizeof(float) * (size_t)P);
    char why[sizeof ctx->err];
    snprintf(why, sizeof why, "%s", mine != DT_OK ? ctx->err : "");
    if (!all)
        return set_error(ctx, DT_ENOMEM, "%s: out of memory", op);
    dt_status s = comm_run_wait(d->comm, COLL_ALLGATHER, all, &f, 1, 0, DT_REDUCE_SUM, NULL);
    int bad = -1;
    for (int q = 0; s == DT_OK && q < P && bad < 0; q++)
        bad = all[q] != 0 ? q : -1;
    dt_status theirs = bad >= 0 ? (dt_status)(int)all[bad] : DT_OK;
    host_free(ctx, all);
    if (s != DT_OK)
        return s;
    if (bad == me)
        return set_error(ctx, theirs, "%s: rank %d: %s", op, me, why);
    if (bad >= 0)
        return set_error(ctx, theirs, "%s: rank %d failed (its own error says why); nothing was "
                         "%s", op, bad, strcmp(op, "ddp_checkpoint_load") == 0 ? "loaded" : "kept");
    return DT_OK;
}

/* opt (may be NULL) is one this DDP may save or load: its context's, and
 * if sharded, by this DDP. */
static dt_status zero_ckpt_optim_ok(dt_ddp *d, const dt_optim *opt, const char *op)
{
    if (opt && optim_ctx(opt) != d->ctx)
        return set_error(d->ctx, DT_EINVAL, "%s: the optimizer belongs to another context", op);
    if (opt && optim_is_orphaned(opt))
        return set_error(d->ctx, DT_EINVAL, "%s: the optimizer's shard belongs to a freed DDP", op);
    if (opt && optim_is_sharded(opt) && (!d->z || d->z->opt != opt))
        return set_error(d->ctx, DT_EINVAL, "%s: the optimizer is sharded by another DDP", op);
    return DT_OK;
}

static dt_status zero_ckpt_save_run(dt_ddp *d, const dt_optim *opt, const char *dir, int64_t step)
{
    if (!d || !d->ctx)
        return DT_EINVAL;
    dt_ctx *ctx = d->ctx;
    const char *op = "ddp_checkpoint_save";
    dt_status s = zero_ckpt_optim_ok(d, opt, op);
    if (s == DT_OK && ctx->n_ckpt_extra)
        s = set_error(ctx, DT_ENOTSUP, "%s: a parameter server's tables are not sharded", op);
    else if (s == DT_OK && (!dir || !dir[0]))
        s = set_error(ctx, DT_EINVAL, "%s: the directory is empty", op);
    if (s == DT_OK && d->z && d->z->level == 3)   /* only the shards count; nothing in flight */
        s = zero_prefetch_finish(d, 1);
    int64_t *lo = s == DT_OK ? zero_ckpt_ranges(d) : NULL;
    if (s == DT_OK && !lo)
        s = set_error(ctx, DT_ENOMEM, "%s: out of memory", op);
    int P = dt_comm_size(d->comm), me = dt_comm_rank(d->comm);
    if (s == DT_OK)
        s = ckpt_shard_save(ctx, opt, dir, step, me, P, lo, lo + ctx->n_params + 1);
    host_free(ctx, lo);
    if ((s = zero_ckpt_agree(d, op, s)) != DT_OK)
        return s;   /* every rank's: no index is written */
    if (me == 0)
        s = ckpt_shard_index_save(ctx, opt, dir, step, P, d->cfg.zero);
    return zero_ckpt_agree(d, op, s);
}

/* (what peers waiting on this rank see: dt_ctx_activity) */
dt_status dt_ddp_checkpoint_save(dt_ddp *d, const dt_optim *opt, const char *dir, int64_t step)
{
    dt_ctx *actx = d ? d->ctx : NULL;
    int act = ctx_doing(actx, ACT_CKPT_SAVE);
    dt_status s = zero_ckpt_save_run(d, opt, dir, step);
    ctx_done(actx, act);
    return s;
}

static dt_status zero_ckpt_load_run(dt_ddp *d, dt_optim *opt, const char *dir, int64_t *step_out)
{
    if (!d || !d->ctx)
        return DT_EINVAL;
    dt_ctx *ctx = d->ctx;
    const char *op = "ddp_checkpoint_load";
    dt_status s = zero_ckpt_optim_ok(d, opt, op);
    int level3 = d->z && d->z->level == 3;
    if (s == DT_OK && level3)
        s = zero_prefetch_finish(d, 1);
    int64_t *lo = s == DT_OK && level3 ? zero_ckpt_ranges(d) : NULL;
    if (s == DT_OK && level3 && !lo)
        s = set_error(ctx, DT_ENOMEM, "%s: out of memory", op);
    ckpt_plan *pl = NULL;
    if (s == DT_OK) {   /* zero 3: its shard of each parameter; else each whole */
        pl = ckpt_plan_make(ctx, opt, dir, lo, lo ? lo + ctx->n_params + 1 : NULL);
        s = pl ? DT_OK : ctx->last_status;
    }
    host_free(ctx, lo);
    if ((s = zero_ckpt_agree(d, op, s)) != DT_OK) {
        ckpt_plan_free(pl);
        return s;   /* refused by some rank: nothing copied anywhere */
    }
    if (level3)   /* with masters even our shard of the parameters was given back */
        s = zero_commit(d, d->z->lo, d->z->hi);
    if (s == DT_OK)
        s = ckpt_plan_apply(pl, step_out);
    ckpt_plan_free(pl);
    if (s == DT_OK)   /* the parameters got f32 values: the masters' now */
        optim_masters_from_params(opt, !level3);
    if (s == DT_OK && level3)   /* whole units now hold floats from before the load */
        s = zero_evict_all(d);
    return zero_ckpt_agree(d, op, s);
}

/* (what peers waiting on this rank see: dt_ctx_activity) */
dt_status dt_ddp_checkpoint_load(dt_ddp *d, dt_optim *opt, const char *dir, int64_t *step_out)
{
    dt_ctx *actx = d ? d->ctx : NULL;
    int act = ctx_doing(actx, ACT_CKPT_LOAD);
    dt_status s = zero_ckpt_load_run(d, opt, dir, step_out);
    ctx_done(actx, act);
    return s;
}
