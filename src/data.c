#include "internal.h"

/* ===========================================================================
 * The prefetching loader (datasets: src/dataset.c, src/dataset_io.c)
 *
 * The loader's background thread converts batch k+1 into the spare half of
 * a double buffer while the caller computes on batch k.  On a host-visible
 * backend the halves are the batch tensors themselves (no copy); otherwise
 * the main thread copies the finished half to the device.
 * ======================================================================== */

void dt_loader_config_init(dt_loader_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->struct_size = sizeof *cfg;
    cfg->batch = 64;
    cfg->shuffle = 1;
    cfg->mean = 0.0f;
    cfg->std = 1.0f;
    cfg->prefetch = 1;
}

/* Double buffering on a device: the thread that fills a slot's (pinned)
 * host buffers also starts their copy to the device, on the backend's copy
 * stream, while the current step computes; dt_loader_next makes the compute
 * stream wait for it.  Before a slot is filled again, its last copy must
 * have left the host buffers. */
static void upload_batch(dt_loader *ld, loader_slot *s)
{
    const dt_backend_iface *be = BE(ld->ctx);
    size_t xb = (size_t)(s->count * ld->x_elems) * 4, yb = (size_t)(s->count * ld->y_elems) * 4;
    be->copy_async(BEI(ld->ctx), s->x->data, s->hx, xb, DT_COPY_H2D);
    s->ticket = be->copy_async(BEI(ld->ctx), s->y->data, s->hy, yb, DT_COPY_H2D);
}

static void upload_wait(dt_loader *ld, loader_slot *s)
{
    if (s->ticket)
        BE(ld->ctx)->copy_wait(BEI(ld->ctx), s->ticket);
    s->ticket = 0;
}

static int uploads_async(const dt_loader *ld)
{
    return !ld->host_visible && be_stages(BE(ld->ctx));
}

/* Cut `total` samples into P slices in proportion to w (largest
 * remainders; each slice at least one sample when total >= P). */
static void split_counts(const double *w, int P, int64_t total, int64_t *counts)
{
    double sum = 0;
    for (int r = 0; r < P; r++)
        sum += w[r];
    int64_t given = 0;
    for (int r = 0; r < P; r++) {
        counts[r] = (int64_t)((double)total * w[r] / sum);
        given += counts[r];
    }
    while (given < total) {   /* the largest remainders, lower ranks first on ties */
        int best = 0;
        double br = -1;
        for (int r = 0; r < P; r++) {
            double rem = (double)total * w[r] / sum - (double)counts[r];
            if (rem > br + 1e-12) {
                br = rem;
                best = r;
            }
        }
        counts[best]++;
        given++;
    }
    for (int r = 0; r < P && total >= P; r++)
        while (counts[r] < 1) {   /* from the largest slice */
            int big = 0;
            for (int q = 1; q < P; q++)
                big = counts[q] > counts[big] ? q : big;
            counts[big]--;
            counts[r]++;
        }
}

/* Global batches: this shard's slice of global batch b, cut by the split
 * now in force (read under mu: dt_loader_set_split may be changing it). */
static void global_slice(dt_loader *ld, int64_t b, int64_t *start, int64_t *count,
                         int64_t *offset, int64_t *global, uint64_t *gen)
{
    int P = ld->cfg.shard_count, me = ld->cfg.shard_rank;
    int64_t G = (int64_t)ld->cfg.batch * P, n = dt_dataset_size(ld->ds);
    int64_t total = n - b * G < G ? n - b * G : G, counts[64];
    if (ld->has_thread)
        pthread_mutex_lock(&ld->mu);
    split_counts(ld->split, P, total, counts);
    *gen = ld->split_gen;
    if (ld->has_thread)
        pthread_mutex_unlock(&ld->mu);
    int64_t off = 0;
    for (int r = 0; r < me; r++)
        off += counts[r];
    *start = b * G + off;
    *count = counts[me];
    *offset = off;
    *global = total;
}

static void fill_batch(dt_loader *ld, loader_slot *s, int64_t b)
{
    double t0 = dt_now();
    int64_t start = b * ld->cfg.batch, count = ld->n_local - start, stride = 1;
    s->offset = 0;
    s->stolen = 0;
    if (ld->cfg.global_batches) {
        global_slice(ld, b, &start, &count, &s->offset, &s->global, &s->gen);
    } else if (ld->source) {   /* the batch a claimed chunk gives; -1: none left anywhere */
        int shard = 0;
        int64_t j = ld->source->next(ld, &shard, &s->stolen);
        if (j < 0) {
            s->count = -1;
            s->batch_index = b;
            return;
        }
        /* shard v's samples are perm[v], perm[v + W], ... (DistributedSampler's) */
        start = shard + j * ld->cfg.batch * ld->cfg.shard_count;
        stride = ld->cfg.shard_count;
        count = ld->n_local - j * ld->cfg.batch;
    }
    if (count > ld->cap)
        count = ld->cap;
    if (!ld->cfg.global_batches)
        s->global = count;
    upload_wait(ld, s);
    s->status = DT_OK;
    for (int64_t i = 0; i < count && s->status == DT_OK; i++)
        s->status = dataset_read(ld->ds, &ld->xf, ld->order[start + i * stride],
                                 (char *)s->hx + 4 * i * ld->x_elems,
                                 (char *)s->hy + 4 * i * ld->y_elems, s->msg, sizeof s->msg);
    s->batch_index = b;
    s->count = (int)count;
    if (uploads_async(ld))
        upload_batch(ld, s);
    prof_batch(ld->ctx, count, t0, dt_now(), ld->has_thread);
}

static void *loader_main(void *arg)
{
    dt_loader *ld = arg;
    pthread_mutex_lock(&ld->mu);
    for (;;) {
        while (!ld->stop && ld->request < 0)
            pthread_cond_wait(&ld->cv, &ld->mu);
        if (ld->stop)
            break;
        int64_t b = ld->request;
        loader_slot *s = &ld->slot[ld->request_slot];
        ld->request = -1;
        ld->busy = 1;
        pthread_mutex_unlock(&ld->mu);
        fill_batch(ld, s, b);
        pthread_mutex_lock(&ld->mu);
        s->ready = 1;
        ld->busy = 0;
        pthread_cond_broadcast(&ld->cv);
    }
    pthread_mutex_unlock(&ld->mu);
    return NULL;
}

/* Ask for batch b in slot si: the worker if there is one, else right now. */
static void loader_request(dt_loader *ld, int si, int64_t b)
{
    loader_slot *s = &ld->slot[si];
    if (!ld->has_thread) {
        fill_batch(ld, s, b);
        s->ready = 1;
        return;
    }
    pthread_mutex_lock(&ld->mu);
    s->ready = 0;
    ld->request = b;
    ld->request_slot = si;
    pthread_cond_broadcast(&ld->cv);
    pthread_mutex_unlock(&ld->mu);
}

DT_PRIVATE void loader_quiesce(dt_loader *ld)
{
    if (!ld->has_thread)
        return;
    pthread_mutex_lock(&ld->mu);
    ld->request = -1;
    while (ld->busy)
        pthread_cond_wait(&ld->cv, &ld->mu);
    pthread_mutex_unlock(&ld->mu);
}

void dt_loader_free(dt_loader *ld)
{
    if (!ld)
        return;
    dt_ctx *ctx = ld->ctx;
    if (ld->has_thread) {
        pthread_mutex_lock(&ld->mu);
        ld->stop = 1;
        pthread_cond_broadcast(&ld->cv);
        pthread_mutex_unlock(&ld->mu);
        pthread_join(ld->thread, NULL);
    }
    if (ld->has_thread || ld->stop) {
        pthread_mutex_destroy(&ld->mu);
        pthread_cond_destroy(&ld->cv);
    }
    for (int i = 0; i < 2; i++) {
        loader_slot *s = &ld->slot[i];
        upload_wait(ld, s);
        if (s->pinned) {
            BE(ctx)->host_free(BEI(ctx), s->hx);
            BE(ctx)->host_free(BEI(ctx), s->hy);
        } else if (!ld->host_visible) {
            host_free(ctx, s->hx);
            host_free(ctx, s->hy);
        }
        dt_tensor_free(s->x);
        dt_tensor_free(s->y);
    }
    host_free(ctx, ld->order);
    host_free(ctx, ld->split);
    dataset_xform_free(ctx, &ld->xf);
    if (ld->source)
        ld->source->release(ld);
    host_free(ctx, ld);
}

/* Page-locked staging where the backend has it (copies from pageable
 * memory are not asynchronous); 0: use the allocator instead. */
static int loader_pin_slot(dt_loader *ld, loader_slot *s)
{
    dt_ctx *ctx = ld->ctx;
    if (!BE(ctx)->host_alloc)
        return 0;
    int64_t b = ld->cap;
    s->hx = BE(ctx)->host_alloc(BEI(ctx), (size_t)(b * ld->x_elems) * 4);
    s->hy = BE(ctx)->host_alloc(BEI(ctx), (size_t)(b * ld->y_elems) * 4);
    if (s->hx && s->hy)
        return s->pinned = 1;
    if (s->hx)
        BE(ctx)->host_free(BEI(ctx), s->hx);
    if (s->hy)
        BE(ctx)->host_free(BEI(ctx), s->hy);
    s->hx = NULL;
    s->hy = NULL;
    return 0;
}

static dt_status loader_alloc_slots(dt_loader *ld)
{
    dt_ctx *ctx = ld->ctx;
    int64_t b = ld->cap, xs[DT_MAX_DIMS] = {b}, ys[DT_MAX_DIMS] = {b};
    dt_sample_field in = {0}, tgt = {0};   /* (dt_dataset_fields fills both for a dataset) */
    dt_dataset_fields(ld->ds, &in, &tgt);
    for (int d = 0; d < in.ndim; d++)
        xs[d + 1] = in.shape[d];
    for (int d = 0; d < tgt.ndim; d++)
        ys[d + 1] = tgt.shape[d];
    for (int i = 0; i < 2; i++) {
        loader_slot *s = &ld->slot[i];
        s->batch_index = -1;
        if (!(s->x = dt_tensor_new(ctx, ld->x_dtype, in.ndim + 1, xs)) ||
            !(s->y = dt_tensor_new(ctx, ld->y_dtype, tgt.ndim + 1, ys)))
            return ctx->last_status;
        if (ld->host_visible) {
            s->hx = s->x->data;
            s->hy = s->y->data;
        } else if (!loader_pin_slot(ld, s)) {
            s->hx = host_alloc(ctx, (size_t)(b * ld->x_elems) * 4);
            s->hy = host_alloc(ctx, (size_t)(b * ld->y_elems) * 4);
            if (!s->hx || !s->hy)
                return set_error(ctx, DT_ENOMEM, "loader: out of memory");
        }
    }
    return DT_OK;
}

dt_loader *dt_loader_new(dt_ctx *ctx, const dt_dataset *ds, const dt_loader_config *cfg)
{
    if (!ctx_ok(ctx))
        return NULL;
    if (!ds || !cfg) {
        set_error(ctx, DT_EINVAL, "loader: dataset and config are required");
        return NULL;
    }
    dt_loader_config own;
    dt_loader_config_init(&own);
    if (ctx_config_in(ctx, &own, sizeof own, cfg, "loader", "dt_loader_config") != DT_OK)
        return NULL;
    cfg = &own;
    int shards = cfg->shard_count > 1 ? cfg->shard_count : 1;
    if (cfg->batch < 1 || !(cfg->std > 0) || cfg->shard_rank < 0 || cfg->shard_rank >= shards) {
        set_error(ctx, DT_EINVAL, "loader: batch %d, std %g, shard %d of %d: need batch >= 1, "
                  "std > 0, 0 <= shard_rank < shard_count", cfg->batch, (double)cfg->std,
                  cfg->shard_rank, cfg->shard_count);
        return NULL;
    }
    dt_sample_field in = {0}, tgt = {0};   /* (dt_dataset_fields fills both for a dataset) */
    dt_dataset_fields(ds, &in, &tgt);
    if (in.dtype == DT_I32 && (cfg->mean != 0.0f || cfg->std != 1.0f)) {
        set_error(ctx, DT_EINVAL, "loader: mean %g and std %g apply to f32 inputs; this dataset's "
                  "inputs are i32 (token ids)", (double)cfg->mean, (double)cfg->std);
        return NULL;
    }
    dt_loader *ld = host_calloc(ctx, sizeof *ld);
    if (!ld) {
        set_error(ctx, DT_ENOMEM, "loader: out of memory");
        return NULL;
    }
    ld->ctx = ctx;
    ld->ds = ds;
    ld->cfg = *cfg;
    ld->cfg.shard_count = shards;
    ld->x_elems = shape_numel(in.ndim, in.shape);
    ld->y_elems = shape_numel(tgt.ndim, tgt.shape);
    ld->x_dtype = dataset_batch_dtype(&in, 0);
    ld->y_dtype = dataset_batch_dtype(&tgt, 1);
    ld->host_visible = BE(ctx)->host_visible;
    ld->request = -1;
    ld->cap = cfg->batch;
    if (cfg->global_batches) {   /* a slice may grow to the whole global batch */
        if (shards > 64) {
            set_error(ctx, DT_EINVAL, "loader: global_batches supports at most 64 shards, "
                      "got %d", shards);
            host_free(ctx, ld);
            return NULL;
        }
        ld->cap = (int64_t)cfg->batch * shards;
        ld->split = host_alloc(ctx, sizeof(double) * (size_t)shards);
        if (!ld->split) {
            set_error(ctx, DT_ENOMEM, "loader: out of memory");
            host_free(ctx, ld);
            return NULL;
        }
        for (int r = 0; r < shards; r++)
            ld->split[r] = 1.0;
    }
    /* shards as torch's DistributedSampler: pad to a multiple of the count
     * (every rank runs as many batches), or for evaluation each sample once */
    ld->n_local = (dt_dataset_size(ds) + shards - 1) / shards;
    if (cfg->shard_no_pad)
        ld->n_local = (dt_dataset_size(ds) - cfg->shard_rank + shards - 1) / shards;
    ld->order = host_alloc(ctx, sizeof(int64_t) * (size_t)(dt_dataset_size(ds) + shards));
    if (!ld->order || dataset_xform_init(ds, cfg->mean, cfg->std, &ld->xf) != DT_OK ||
        loader_alloc_slots(ld) != DT_OK) {
        if (ctx->last_status == DT_OK)
            set_error(ctx, DT_ENOMEM, "loader: out of memory");
        dt_loader_free(ld);
        return NULL;
    }
    ld->n_batches = cfg->drop_last ? ld->n_local / cfg->batch
                                   : (ld->n_local + cfg->batch - 1) / cfg->batch;
    if (cfg->global_batches) {   /* whole global batches, and a last one with a sample a shard */
        int64_t G = ld->cap, rest = dt_dataset_size(ds) % G;
        ld->n_batches = dt_dataset_size(ds) / G + (!cfg->drop_last && rest >= shards ? 1 : 0);
    }
    if (cfg->prefetch) {
        if (pthread_mutex_init(&ld->mu, NULL) != 0 || pthread_cond_init(&ld->cv, NULL) != 0 ||
            pthread_create(&ld->thread, NULL, loader_main, ld) != 0) {
            set_error(ctx, DT_ENOMEM, "loader: cannot start the prefetch thread");
            ld->stop = 1;
            dt_loader_free(ld);
            return NULL;
        }
        ld->has_thread = 1;
    }
    if (dt_loader_start_epoch(ld, 0) != DT_OK) {
        dt_loader_free(ld);
        return NULL;
    }
    return ld;
}

/* Starting the epoch that was just started, before a batch was given out,
 * keeps the batch already read: dt_loader_new starts epoch 0 and a caller's
 * loop starts it again, and a callback dataset must not see its first batch
 * twice.  Not when that batch failed (a callback may succeed the next time)
 * or with work stealing (its start is a collective step with the others). */
static int loader_keeps_epoch(dt_loader *ld, int64_t epoch)
{
    if (!ld->untouched || ld->epoch != epoch || ld->source)
        return 0;
    if (ld->has_thread)
        pthread_mutex_lock(&ld->mu);
    int failed = ld->slot[0].ready && ld->slot[0].status != DT_OK;
    if (ld->has_thread)
        pthread_mutex_unlock(&ld->mu);
    return !failed;
}

dt_status dt_loader_start_epoch(dt_loader *ld, int64_t epoch)
{
    if (!ld)
        return DT_EINVAL;
    if (loader_keeps_epoch(ld, epoch)) {
        ld->wait_s = 0;
        return DT_OK;
    }
    loader_quiesce(ld);
    int64_t n = dt_dataset_size(ld->ds), shards = ld->cfg.shard_count;
    int64_t total = (n + shards - 1) / shards * shards;
    int64_t *perm = ld->order;   /* build the global order in place, then keep our shard */
    for (int64_t i = 0; i < n; i++)
        perm[i] = i;
    if (ld->cfg.shuffle) {
        uint64_t s[4];
        param_rng_seed(s, ld->cfg.seed ^ (0x9E3779B97F4A7C15ull * (uint64_t)(epoch + 1)));
        for (int64_t i = n - 1; i > 0; i--) {
            int64_t j = (int64_t)(param_rng_next(s) % (uint64_t)(i + 1));
            int64_t t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
    }
    for (int64_t i = n; i < total; i++)
        perm[i] = perm[i - n];
    /* global batches and work stealing read the whole order */
    for (int64_t i = 0; i < ld->n_local && !ld->cfg.global_batches && !ld->source; i++)
        perm[i] = perm[ld->cfg.shard_rank + i * shards];
    if (ld->source) {
        ld->source->start_epoch(ld, epoch);
        ld->source_done = ld->source_stolen = 0;
        ld->n_batches = INT64_MAX;   /* until the source has no batch left */
    }
    ld->next = 0;
    ld->epoch = epoch;
    ld->untouched = 1;
    ld->wait_s = 0;
    ld->slot[0].ready = ld->slot[1].ready = 0;
    if (ld->n_batches > 0)
        loader_request(ld, 0, 0);
    return DT_OK;
}

static dt_status loader_next_run(dt_loader *ld, dt_tensor **x, dt_tensor **y);

dt_status dt_loader_next(dt_loader *ld, dt_tensor **x, dt_tensor **y)
{
    if (!ld)
        return DT_EINVAL;
    double t0 = prof_begin(ld->ctx);
    int act = ctx_doing(ld->ctx, ACT_DATA);
    dt_status s = loader_next_run(ld, x, y);
    ctx_done(ld->ctx, act);
    if (s == DT_OK)
        prof_samples(ld->ctx, dt_tensor_dim(*x, 0));
    prof_end(ld->ctx, PH_DATA, t0);
    return s;
}

static dt_status loader_next_run(dt_loader *ld, dt_tensor **x, dt_tensor **y)
{
    dt_ctx *ctx = ld->ctx;
    if (!x || !y)
        return set_error(ctx, DT_EINVAL, "loader_next: output pointers are NULL");
    ld->untouched = 0;
    if (ld->next >= ld->n_batches)   /* (work stealing: set when no chunk was left) */
        return DT_EOF;
    int si = (int)(ld->next % 2);
    loader_slot *s = &ld->slot[si];
    double t0 = dt_now();
    if (ld->has_thread) {
        pthread_mutex_lock(&ld->mu);
        while (!s->ready)
            pthread_cond_wait(&ld->cv, &ld->mu);
        pthread_mutex_unlock(&ld->mu);
    }
    ld->wait_s += dt_now() - t0;
    if (s->count < 0) {   /* work stealing: no chunk left anywhere */
        ld->next = ld->n_batches;
        const char *msg = "";
        dt_status st = ld->source->failed(ld, &msg);
        if (st != DT_OK)
            return set_error(ctx, st, "%s", msg);
        return DT_EOF;
    }
    if (ld->cfg.global_batches && s->gen != ld->split_gen)
        fill_batch(ld, s, s->batch_index);   /* cut before the split changed: again */
    if (s->status != DT_OK) {   /* a sample could not be read: this epoch ends here */
        ld->next = ld->n_batches;
        return set_error(ctx, s->status, "%s", s->msg);
    }
    ld->cur_offset = s->offset;
    ld->cur_count = s->count;
    ld->cur_global = s->global;
    if (ld->source) {
        ld->source_done++;
        ld->source_stolen += s->stolen;
    }
    if (uploads_async(ld)) {   /* started by the filler: kernels from here on wait */
        BE(ctx)->copy_join(BEI(ctx), s->ticket);
    } else if (!ld->host_visible) {
        BE(ctx)->to_device(BEI(ctx), s->x->data, s->hx, (size_t)(s->count * ld->x_elems) * 4);
        BE(ctx)->to_device(BEI(ctx), s->y->data, s->hy, (size_t)(s->count * ld->y_elems) * 4);
    }
    ld->next++;
    if (ld->next < ld->n_batches)    /* the other half fills while the caller computes */
        loader_request(ld, 1 - si, ld->next);
    if (s->count == ld->cap) {
        *x = s->x;
        *y = s->y;
    } else {
        tensor_batch_view(&s->xv, s->x, s->count);
        tensor_batch_view(&s->yv, s->y, s->count);
        *x = &s->xv;
        *y = &s->yv;
    }
    return DT_OK;
}

int64_t dt_loader_batches(const dt_loader *ld)
{
    if (ld && ld->source)   /* its own shard's; stealing changes how many it runs */
        return ld->cfg.drop_last ? ld->n_local / ld->cfg.batch
                                 : (ld->n_local + ld->cfg.batch - 1) / ld->cfg.batch;
    return ld ? ld->n_batches : 0;
}

dt_status dt_loader_set_split(dt_loader *ld, const double *weights, int n)
{
    if (!ld)
        return DT_EINVAL;
    if (!ld->cfg.global_batches)
        return set_error(ld->ctx, DT_ESTATE, "loader_set_split: the loader was made without "
                         "global_batches");
    if (!weights || n != ld->cfg.shard_count)
        return set_error(ld->ctx, DT_EINVAL, "loader_set_split: need %d weights, got %d%s",
                         ld->cfg.shard_count, n, weights ? "" : " (NULL)");
    for (int r = 0; r < n; r++)
        if (!(weights[r] > 0) || !isfinite(weights[r]))
            return set_error(ld->ctx, DT_EINVAL, "loader_set_split: weight %d is %g; each must "
                             "be finite and > 0", r, weights[r]);
    if (ld->has_thread)
        pthread_mutex_lock(&ld->mu);
    memcpy(ld->split, weights, sizeof(double) * (size_t)n);
    ld->split_gen++;
    if (ld->has_thread)
        pthread_mutex_unlock(&ld->mu);
    return DT_OK;
}

void dt_loader_batch_slice(const dt_loader *ld, int64_t *offset, int64_t *count, int64_t *global)
{
    if (offset)
        *offset = ld ? ld->cur_offset : 0;
    if (count)
        *count = ld ? ld->cur_count : 0;
    if (global)
        *global = ld ? ld->cur_global : 0;
}

int64_t dt_loader_batches_done(const dt_loader *ld)
{
    return !ld ? 0 : ld->source ? ld->source_done : ld->next;
}

int64_t dt_loader_batches_stolen(const dt_loader *ld) { return ld && ld->source ? ld->source_stolen : 0; }

DT_PRIVATE void loader_set_source(dt_loader *ld, const loader_source *src, void *state)
{
    ld->source = src;
    ld->source_state = state;
}

DT_PRIVATE void *loader_source_state(const dt_loader *ld) { return ld->source_state; }
DT_PRIVATE dt_ctx *loader_ctx(const dt_loader *ld) { return ld->ctx; }
DT_PRIVATE const dt_loader_config *loader_config(const dt_loader *ld) { return &ld->cfg; }
DT_PRIVATE int64_t loader_local_samples(const dt_loader *ld) { return ld->n_local; }

double dt_loader_wait_seconds(const dt_loader *ld) { return ld ? ld->wait_s : 0.0; }

