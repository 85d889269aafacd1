#include "dist.h"

/* ===========================================================================
 * The parameter server's server side: its shard of the parameters, the
 * workers' requests as they arrive (dt_ps_serve), the consistency modes'
 * bookkeeping, replicas and checkpoints.  The workers' side, the layout
 * and joining are src/ps.c, whose banner describes the protocol.
 * ======================================================================== */

/* A sparse push kept until its step is applied (BSP). */
struct ps_sparse_msg {
    int table;
    int64_t k, clock;
    void *data;                /* k local row numbers (int64), then k * dim floats */
    struct ps_sparse_msg *next;
};

/* --- the server's side ----------------------------------------------- */

/* Optimizer state tensors a table row needs, by the servers' optimizer. */
static int ps_tab_states(const dt_optim_config *c)
{
    return c->kind == DT_SGD ? c->momentum != 0.0f : c->kind == DT_ADAGRAD ? 1 : 2;
}

/* This server's rows of a table, drawn as dt_ps_table says, with their
 * optimizer state and the buffers that sum pushed rows. */
static dt_status ps_make_table(dt_ps *ps, ps_tab *tb)
{
    dt_ctx *sx = ps->sctx;
    int64_t S = ps->L, s = ps->shard;
    tb->count = tb->rows > s ? (tb->rows - s + S - 1) / S : 0;
    int64_t shape[2] = {tb->count > 0 ? tb->count : 1, tb->dim};
    static const char *const suffix[3][2] = {{".momentum_buffer", ""}, {".exp_avg", ".exp_avg_sq"},
                                             {".sum", ""}};
    const dt_optim_config *oc = &ps->cfg.optim;
    int kind = oc->kind == DT_SGD ? 0 : oc->kind == DT_ADAGRAD ? 2 : 1;
    char name[DT_MAX_NAME];   /* (checkpoints name it; "table." keeps it off the pieces' names) */
    snprintf(name, sizeof name, "table.%s", tb->name);
    tb->w = tensor_owned_new(sx, 2, shape, name, "", 0);
    for (int j = 0; j < ps_tab_states(oc); j++)
        tb->state[j] = tensor_owned_new(sx, 2, shape, name, suffix[kind][j], 0);
    int64_t two = 2;
    tb->steps_t = tensor_owned_new(sx, 1, &two, name, ".steps", 0);
    size_t n = (size_t)(shape[0] * tb->dim);
    tb->acc = host_calloc(ps->ctx, n * sizeof(float));
    tb->slot = host_alloc(ps->ctx, (size_t)shape[0] * sizeof(int64_t));
    tb->touched = host_alloc(ps->ctx, (size_t)shape[0] * sizeof(int64_t));
    if (!tb->w || (ps_tab_states(oc) > 0 && !tb->state[0]) || (ps_tab_states(oc) > 1 && !tb->state[1]) ||
        !tb->steps_t || !tb->acc || !tb->slot || !tb->touched)
        return set_error(ps->ctx, DT_ENOMEM, "ps_new: out of memory for table '%s' (%lld x %lld "
                         "here)", tb->name, (long long)tb->count, (long long)tb->dim);
    float *w = tb->w->data;
    for (int64_t i = 0; i < tb->count; i++) {
        uint64_t r = (uint64_t)(i * S + s);   /* the global row */
        for (int64_t j = 0; j < tb->dim; j++) {
            uint64_t h = tb->seed ^ (0x9E3779B97F4A7C15ull * (r * (uint64_t)tb->dim + (uint64_t)j + 1));
            float u = (float)(param_splitmix64(&h) >> 40) * (1.0f / 16777216.0f);
            w[i * tb->dim + j] = tb->scale * (2.0f * u - 1.0f);
        }
    }
    for (int64_t i = 0; i < shape[0]; i++)
        tb->slot[i] = -1;
    return DT_OK;
}

/* Every server must start from the same step (or all fresh): files from
 * different steps (a crash between two servers' saves) would make a model
 * of two ages.  Each says its step in the store and reads the others'. */
static dt_status ps_agree_on_resume(dt_ps *ps)
{
    dt_comm *c = ps->comm;
    char key[64], mine[32], theirs[32];
    snprintf(mine, sizeof mine, "%lld", ps->resumed ? (long long)dt_optim_steps(ps->opt) : -1LL);
    snprintf(key, sizeof key, "ps%d/resume/%d", ps->job, ps->server);
    dt_status s = dt_store_set(join_store(c), key, mine, strlen(mine) + 1);
    for (int q = 0; s == DT_OK && q < ps->S; q++) {
        size_t len = 0;
        snprintf(key, sizeof key, "ps%d/resume/%d", ps->job, q);
        s = dt_store_get(join_store(c), key, theirs, sizeof theirs - 1, &len, comm_timeout_ms(c));
        theirs[s == DT_OK && len < sizeof theirs ? len : 0] = '\0';
        if (s == DT_OK && strcmp(theirs, mine) != 0)
            s = set_error(ps->ctx, DT_EMISMATCH, "ps_new: server %d starts from step %s, server %d "
                          "from step %s (-1: no checkpoint): their checkpoint files are from "
                          "different steps", ps->server, mine, q, theirs);
    }
    return s;
}

/* Checkpoints: the tables ride along with the pieces and the optimizer. */
static dt_status ps_resume(dt_ps *ps)
{
    dt_ctx *sx = ps->sctx;
    const char *dir = ps->cfg.checkpoint_dir;
    if (!dir || !*dir)
        return DT_OK;
    dt_tensor **list = host_calloc(ps->ctx, sizeof(dt_tensor *) * (size_t)(4 * ps->ntables + 1));
    size_t len = strlen(dir) + 48;
    ps->ckpt_tables = list;
    ps->ckpt_path = host_alloc(ps->ctx, len);
    if (!list || !ps->ckpt_path)
        return set_error(ps->ctx, DT_ENOMEM, "ps_new: out of memory");
    snprintf(ps->ckpt_path, len, "%s/ps-server-%d.safetensors", dir, ps->server);
    int n = 0;
    for (int t = 0; t < ps->ntables; t++) {
        list[n++] = ps->tabs[t].w;
        list[n++] = ps->tabs[t].steps_t;
        for (int j = 0; j < 2; j++)
            if (ps->tabs[t].state[j])
                list[n++] = ps->tabs[t].state[j];
    }
    ctx_set_ckpt_extra(sx, list, n);
    if (access(ps->ckpt_path, F_OK) == 0) {
        if (dt_checkpoint_load(sx, ps->opt, ps->ckpt_path, NULL, NULL, NULL) != DT_OK)
            return set_error(ps->ctx, dt_last_status(sx), "ps_new: server %d cannot resume: %s",
                             ps->server, dt_last_error(sx));
        for (int t = 0; t < ps->ntables; t++) {   /* (Adam's bias correction goes on) */
            const float *f = ps->tabs[t].steps_t->data;
            ps->tabs[t].steps = (int64_t)f[0] * 16777216 + (int64_t)f[1];
        }
        ps->resumed = ps->initialized = 1;
        ps->st.resumed = 1;
        ps->st.resumed_step = dt_optim_steps(ps->opt);
    }
    if (comm_incarnation(ps->comm))   /* rejoining a running job: the others started long ago */
        return ps->resumed ? DT_OK : set_error(ps->ctx, DT_ESTATE, "ps_new: server rank %d is a "
                                               "restarted process, and without its checkpoint "
                                               "(%s) it has nothing to rejoin with",
                                               dt_comm_rank(ps->comm), ps->ckpt_path);
    return ps_agree_on_resume(ps);
}

static dt_status ps_checkpoint(dt_ps *ps)
{
    if (!ps->ckpt_path)
        return DT_OK;
    for (int t = 0; t < ps->ntables; t++) {
        float *f = ps->tabs[t].steps_t->data;
        f[0] = (float)(ps->tabs[t].steps >> 24);
        f[1] = (float)(ps->tabs[t].steps & 0xFFFFFF);
    }
    if (dt_checkpoint_save(ps->sctx, ps->opt, ps->ckpt_path, dt_optim_steps(ps->opt), NULL) != DT_OK)
        return set_error(ps->ctx, dt_last_status(ps->sctx), "ps_serve: checkpoint: %s",
                         dt_last_error(ps->sctx));
    ps->st.checkpoints++;
    return DT_OK;
}

/* The pieces: every parameter cut to this server's keys, each a parameter
 * of the server's own context (named after it), with the optimizer over
 * them. */
DT_PRIVATE dt_status ps_make_pieces(dt_ps *ps)
{
    dt_ctx_config cc;
    dt_ctx_config_init(&cc);
    cc.allocator = ps->ctx->al;
    /* a server's shard is host memory whatever the workers compute on */
    cc.custom_backend = ctx_find_backend("cpu");
    if (!cc.custom_backend)
        return set_error(ps->ctx, DT_ENOTSUP, "ps_new: a parameter server needs the cpu backend "
                         "compiled in (-DDT_WITH_CPU)");
    ps->sctx = dt_ctx_new(&cc);
    if (!ps->sctx || dt_last_status(ps->sctx) != DT_OK)
        return set_error(ps->ctx, DT_ENOMEM, "ps_new: cannot make the server's context");
    int64_t lo = ps->range[ps->shard], hi = ps->range[ps->shard + 1];
    ps->piece = host_calloc(ps->ctx, sizeof *ps->piece * (size_t)(ps->nparams + 1));
    ps->piece_lo = host_calloc(ps->ctx, sizeof(int64_t) * (size_t)(ps->nparams + 1));
    ps->piece_param = host_calloc(ps->ctx, sizeof(int) * (size_t)(ps->nparams + 1));
    if (!ps->piece || !ps->piece_lo || !ps->piece_param)
        return set_error(ps->ctx, DT_ENOMEM, "ps_new: out of memory");
    for (int k = ps->nparams - 1; k >= 0; k--) {   /* key order: reverse registration */
        int64_t a = ps->offset[k] > lo ? ps->offset[k] : lo;
        int64_t b = ps->offset[k] + ps->numel[k] < hi ? ps->offset[k] + ps->numel[k] : hi;
        if (a >= b)
            continue;
        char name[48];
        snprintf(name, sizeof name, "p%d.%lld", k, (long long)(a - ps->offset[k]));
        int64_t len = b - a;
        dt_tensor *t = dt_param_new(ps->sctx, name, 1, &len);
        if (!t)
            return set_error(ps->ctx, dt_last_status(ps->sctx), "ps_new: %s", dt_last_error(ps->sctx));
        ps->piece[ps->npieces] = t;
        ps->piece_lo[ps->npieces] = a;
        ps->piece_param[ps->npieces++] = k;
    }
    ps->opt = dt_optim_new(ps->sctx, &ps->cfg.optim, NULL, 0);
    if (!ps->opt || (ps->cfg.schedule.kind != DT_SCHED_CONSTANT &&
                     dt_optim_set_schedule(ps->opt, &ps->cfg.schedule) != DT_OK))
        return set_error(ps->ctx, dt_last_status(ps->sctx), "ps_new: the servers' optimizer: %s",
                         dt_last_error(ps->sctx));
    for (int t = 0; t < ps->ntables; t++)
        if (ps_make_table(ps, &ps->tabs[t]) != DT_OK)
            return ps->ctx->last_status;
    if (comm_incarnation(ps->comm) && !(ps->cfg.checkpoint_dir && *ps->cfg.checkpoint_dir))
        return set_error(ps->ctx, DT_ESTATE, "ps_new: server rank %d is a restarted process; "
                         "it can rejoin only from a checkpoint (dt_ps_config.checkpoint_dir)",
                         dt_comm_rank(ps->comm));
    if (ps_resume(ps) != DT_OK)
        return ps->ctx->last_status;
    int64_t floats = hi - lo + ps->P;
    ps->initialized = ps->resumed || hi == lo;   /* resumed, or no keys here: nothing to wait for */
    ps->peers = host_calloc(ps->ctx, sizeof *ps->peers * (size_t)ps->W);
    ps->sum = host_alloc(ps->ctx, sizeof(float) * (size_t)(floats > 0 ? floats : 1));
    if (!ps->peers || !ps->sum)
        return set_error(ps->ctx, DT_ENOMEM, "ps_new: out of memory");
    for (int w = 0; w < ps->W; w++)
        if (!(ps->peers[w].push = host_calloc(ps->ctx, sizeof(float) * (size_t)(floats > 0 ? floats : 1))))
            return set_error(ps->ctx, DT_ENOMEM, "ps_new: out of memory for %d workers' pushes", ps->W);
    if (comm_incarnation(ps->comm)) {   /* a restarted server: each worker's step is learnt from its hello */
        ps->syncing = 1;
        ps->st.rejoined = 1;
        for (int w = 0; w < ps->W; w++)
            ps->peers[w].clock = -1;
    }
    return DT_OK;
}

static int64_t ps_my_floats(const dt_ps *ps)
{
    return ps->range[ps->shard + 1] - ps->range[ps->shard] + ps->P;
}

/* Where key k lands in a peer's push buffer (gradients, then flags). */
static int64_t ps_slot(const dt_ps *ps, int64_t k)
{
    return k >= ps->G ? ps->range[ps->shard + 1] - ps->range[ps->shard] + (k - ps->G)
                      : k - ps->range[ps->shard];
}

/* Step the pieces with grads = sum (G_s floats) * scale, flags after them. */
static dt_status ps_step(dt_ps *ps, float *sum, float scale)
{
    int64_t lo = ps->range[ps->shard], gs = ps->range[ps->shard + 1] - lo;
    const float *flags = sum + gs;
    for (int64_t i = 0; i < gs; i++)
        sum[i] *= scale;
    for (int p = 0; p < ps->npieces; p++) {
        dt_tensor *t = ps->piece[p], *g = t->grad;
        if (!(flags[ps->piece_param[p]] > 0)) {
            tensor_mark_zero(g, 1);
            continue;
        }
        ps->sctx->be_iface->copy(ps->sctx->be, g->data, sum + (ps->piece_lo[p] - lo), tensor_bytes(g));
        tensor_mark_zero(g, 0);
    }
    dt_status s = dt_optim_step(ps->opt);
    dt_ctx_zero_grad(ps->sctx);
    if (s != DT_OK)
        return set_error(ps->ctx, s, "ps_serve: optimizer step: %s", dt_last_error(ps->sctx));
    ps->st.steps++;
    return DT_OK;
}

/* After a whole step (its sparse rows too): a checkpoint when one is due. */
static dt_status ps_checkpoint_due(dt_ps *ps)
{
    int every = ps->cfg.checkpoint_every;
    return every > 0 && dt_optim_steps(ps->opt) % every == 0 ? ps_checkpoint(ps) : DT_OK;
}

/* Add k pushed rows (local row numbers ids, then k * dim floats) to the
 * table's sums. */
static void ps_tab_add(ps_tab *tb, int64_t k, const int64_t *ids)
{
    const float *g = (const float *)(ids + k);
    for (int64_t i = 0; i < k; i++) {
        int64_t r = ids[i];
        if (tb->slot[r] < 0) {
            tb->slot[r] = tb->ntouched;
            tb->touched[tb->ntouched++] = r;
        }
        float *a = tb->acc + r * tb->dim;
        for (int64_t j = 0; j < tb->dim; j++)
            a[j] += g[i * tb->dim + j];
    }
}

/* Step the summed rows (times scale) with the servers' optimizer, one row
 * at a time through the backend's update (lazily, as torch's sparse
 * gradients: rows not pushed and their state stay as they are). */
static void ps_tab_apply(dt_ps *ps, ps_tab *tb, float scale)
{
    if (!tb->ntouched)
        return;
    const dt_optim_config *c = optim_config(ps->opt);
    const dt_backend_iface *be = ps->sctx->be_iface;
    /* the rate the schedule gives now (ASP rows may arrive between dense steps) */
    float lr = optim_scheduled_lr(ps->opt, 0);   /* the servers' optimizer has one group */
    float bc1 = 0, bc2 = 0;
    int64_t d = tb->dim;
    tb->steps++;
    if (c->kind == DT_ADAM || c->kind == DT_ADAMW) {
        bc1 = 1.0f - powf(c->beta1, (float)tb->steps);
        bc2 = 1.0f - powf(c->beta2, (float)tb->steps);
    }
    float *w = tb->w->data, *s0 = tb->state[0] ? tb->state[0]->data : NULL;
    float *s1 = tb->state[1] ? tb->state[1]->data : NULL;
    for (int64_t i = 0; i < tb->ntouched; i++) {
        int64_t r = tb->touched[i], o = r * d;
        float *g = tb->acc + o;
        for (int64_t j = 0; j < d; j++)
            g[j] *= scale;
        if (c->kind == DT_SGD)   /* momentum buffers start at zero (first = 0) */
            be->sgd_update(ps->sctx->be, d, w + o, g, s0 ? s0 + o : NULL, lr, c->momentum,
                           c->dampening, c->nesterov, c->weight_decay, 0);
        else if (c->kind == DT_ADAGRAD)
            be->adagrad_update(ps->sctx->be, d, w + o, g, s0 + o, lr, c->eps, c->weight_decay);
        else
            be->adam_update(ps->sctx->be, d, w + o, g, s0 + o, s1 + o, lr, c->beta1, c->beta2,
                            c->eps, c->weight_decay, c->kind == DT_ADAMW, bc1, bc2);
        memset(g, 0, (size_t)d * sizeof(float));
        tb->slot[r] = -1;
    }
    ps->st.rows_updated += tb->ntouched;
    tb->ntouched = 0;
}

/* BSP: the sparse pushes of step `step`, summed in worker order, applied
 * with the step (scaled as its dense gradients are). */
static void ps_apply_sparse_step(dt_ps *ps, int64_t step, float scale)
{
    for (int w = 0; w < ps->W; w++) {
        ps_peer *p = &ps->peers[w];
        for (ps_sparse_msg **mm = &p->held; *mm;) {
            ps_sparse_msg *m = *mm;
            if (m->clock != step || p->state != 0) {
                mm = &m->next;
                continue;
            }
            ps_tab_add(&ps->tabs[m->table], m->k, m->data);
            *mm = m->next;
            host_free(ps->ctx, m->data);
            host_free(ps->ctx, m);
        }
    }
    for (int t = 0; t < ps->ntables; t++)
        ps_tab_apply(ps, &ps->tabs[t], scale);
}

DT_PRIVATE void ps_free_held(dt_ps *ps, ps_peer *p)
{
    while (p->held) {
        ps_sparse_msg *m = p->held;
        p->held = m->next;
        host_free(ps->ctx, m->data);
        host_free(ps->ctx, m);
    }
}

/* The slowest live worker's completed steps (INT64_MAX: none live; -1: a
 * rejoined server has not heard from every live worker yet). */
static int64_t ps_min_clock(const dt_ps *ps)
{
    int64_t m = INT64_MAX;
    for (int w = 0; w < ps->W; w++)
        if (ps->peers[w].state == 0 && ps->peers[w].clock < m)
            m = ps->peers[w].clock;
    return m;
}

/* BSP: apply every step all live workers have completed, summing their
 * gradients in worker order (as the allreduce sums ranks). */
static dt_status ps_post_header(dt_ps *ps, int w);

/* BSP: the step just applied stops the job when any live worker's push
 * of it, or this server, caught a pre-emption signal (the largest wins).
 * Its pulls' answers carry the verdict, so every worker learns it from the
 * same step (dt_preempt_agree), and dt_ps_serve saves this step's state
 * when the workers finish. */
static void ps_count_votes(dt_ps *ps)
{
    int v = preempt_local(ps->ctx);
    for (int w = 0; w < ps->W; w++) {
        if (ps->peers[w].state == 0 && ps->peers[w].vote > v)
            v = ps->peers[w].vote;
        ps->peers[w].vote = 0;
    }
    ps->vote = v;
    (void)preempt_decide(ps->ctx, ps->applied, v);   /* (its state was made by dt_ps_new) */
}

static dt_status ps_apply_bsp(dt_ps *ps)
{
    int64_t n = ps_my_floats(ps), gs = n - ps->P;
    while (ps_min_clock(ps) != INT64_MAX && ps_min_clock(ps) > ps->applied) {
        int first = 1, live = 0;
        for (int w = 0; w < ps->W; w++) {
            if (ps->peers[w].state != 0)
                continue;
            live++;
            const float *v = ps->peers[w].push;
            if (first)
                memcpy(ps->sum, v, (size_t)n * sizeof(float));
            else {
                for (int64_t i = 0; i < gs; i++)
                    ps->sum[i] += v[i];
                for (int64_t i = gs; i < n; i++)
                    ps->sum[i] = ps->sum[i] > 0 || v[i] > 0 ? 1.0f : 0.0f;
            }
            first = 0;
        }
        dt_status s = ps_step(ps, ps->sum, 1.0f / (float)live);
        if (s != DT_OK)
            return s;
        ps_apply_sparse_step(ps, ps->applied, 1.0f / (float)live);
        ps->applied++;
        ps_count_votes(ps);
        if ((s = ps_checkpoint_due(ps)) != DT_OK)
            return s;
        for (int w = 0; w < ps->W; w++)   /* their next requests may come in now */
            if (ps->peers[w].state == 0 && ps->peers[w].parked && ps->peers[w].clock <= ps->applied) {
                ps->peers[w].parked = 0;
                if (ps_post_header(ps, w) != DT_OK)
                    return ps->ctx->last_status;
            }
    }
    return DT_OK;
}

/* Send a pull's answer: the header, and the keys' current values. */
/* The values a pull asks for: dense keys [lo, lo+n) from the pieces, or a
 * table's rows ids. */
static void ps_gather(dt_ps *ps, const ps_msg *req, const int64_t *ids, float *out)
{
    if (req->op == PS_SPULL) {
        const ps_tab *tb = &ps->tabs[req->lo];
        for (int64_t i = 0; i < req->n; i++)
            memcpy(out + i * tb->dim, (const float *)tb->w->data + ids[i] * tb->dim,
                   (size_t)tb->dim * sizeof(float));
        return;
    }
    for (int p = 0; p < ps->npieces; p++) {   /* the pieces' values in [lo, lo+n) */
        int64_t plo = ps->piece_lo[p], phi = plo + dt_tensor_numel(ps->piece[p]);
        int64_t a = req->lo > plo ? req->lo : plo, b = req->lo + req->n < phi ? req->lo + req->n : phi;
        if (a < b)
            ps->sctx->be_iface->copy(ps->sctx->be, out + (a - req->lo),
                                     (const float *)ps->piece[p]->data + (a - plo),
                                     (size_t)(b - a) * sizeof(float));
    }
}

/* On shm, a send above the inject size completes only when its receiver
 * says so, and libfabric's shm (1.17) takes those words in the order the
 * sends went out of an endpoint: one to a worker that died holds back the
 * completion of every later one, until the endpoint's queue is full and
 * the other workers' answers stop.  So a server answers each worker out of
 * an endpoint of its own, published for it as ps<job>/ans/<rank>.<inc>/<w>
 * (ps_answers_from in src/ps.c); a dead worker stalls only its own, which
 * ps_drop closes.  tcp orphans a send to a dead process instead: one
 * endpoint serves. */
DT_PRIVATE dt_status ps_open_answer_endpoints(dt_ps *ps)
{
    dt_comm *c = ps->comm;
    dt_ctx *ctx = ps->ctx;
    if (strcmp(dt_comm_transport(c), "shm") != 0)
        return DT_OK;
    ps->ans = host_calloc(ctx, sizeof(dt_transport *) * (size_t)ps->W);
    if (!ps->ans)
        return set_error(ctx, DT_ENOMEM, "ps_new: out of memory");
    dt_transport_params tp = {"shm", NULL, NULL, ctx->al, comm_collective_timeout_ms(c)};
    for (int w = 0; w < ps->W; w++) {
        char key[64], err[256] = "";
        unsigned char addr[512];
        size_t len = 0, mine = sizeof addr;
        snprintf(key, sizeof key, "addr/%d", w);
        dt_status s = dt_store_get(join_store(c), key, addr, sizeof addr, &len, comm_timeout_ms(c));
        if (s != DT_OK)
            return s;
        const void *peer = addr;
        if ((s = comm_tp_iface(c)->open(&tp, &ps->ans[w], err, sizeof err)) == DT_OK &&
            (s = comm_tp_iface(c)->insert_peers(ps->ans[w], 1, &peer, &len, err, sizeof err)) == DT_OK)
            s = comm_tp_iface(c)->get_addr(ps->ans[w], addr, &mine, err, sizeof err);
        if (s != DT_OK)
            return set_error(ctx, s, "ps_new: server rank %d's endpoint for worker %d: %s", dt_comm_rank(c),
                             w, err);
        snprintf(key, sizeof key, "ps%d/ans/%d.%u/%d", ps->job, dt_comm_rank(c), comm_incarnation(c), w);
        if ((s = dt_store_set(join_store(c), key, addr, mine)) != DT_OK)
            return s;
    }
    return DT_OK;
}

/* Where answers to worker w go out of, and its number there. */
static dt_transport *ps_answer_tp(const dt_ps *ps, int w, int *peer)
{
    *peer = ps->ans ? 0 : w;
    return ps->ans ? ps->ans[w] : comm_tp(ps->comm);
}

/* Close worker w's answer endpoint: its sends end (done, DT_ESTATE). */
static void ps_close_answers(dt_ps *ps, int w)
{
    if (ps->ans && ps->ans[w]) {
        comm_tp_iface(ps->comm)->close(ps->ans[w]);
        ps->ans[w] = NULL;
    }
}

DT_PRIVATE void ps_close_answer_endpoints(dt_ps *ps)
{
    for (int w = 0; ps->ans && w < ps->W; w++)
        ps_close_answers(ps, w);
    host_free(ps->ctx, ps->ans);
    ps->ans = NULL;
}

/* Poll the answer endpoints too; their completions go to done[] after
 * the k already there (at most max in all). */
static int ps_poll_answers(dt_ps *ps, dt_xfer **done, int k, int max)
{
    char err[256];
    for (int w = 0; ps->ans && w < ps->W && k < max; w++) {
        if (!ps->ans[w])
            continue;
        int got = comm_tp_iface(ps->comm)->poll(ps->ans[w], done + k, max - k, err, sizeof err);
        k += got > 0 ? got : 0;   /* (a failing endpoint's answers fail as their worker's sends) */
    }
    return k;
}

/* Post the next pieces of answer r while it has free slots (none once
 * its worker was dropped: nobody will take them). */
static dt_status ps_reply_fill(dt_ps *ps, ps_reply *r)
{
    dt_comm *c = ps->comm;
    char err[256] = "";
    for (int i = 0; i < PS_WINDOW && r->posted < r->pieces && !r->stopped; i++) {
        if (r->busy[i])
            continue;
        dt_xfer *x = &r->data_x[i];
        memset(x, 0, sizeof *x);
        x->user = r;
        size_t len = r->bytes ? ps_piece_len(r->bytes, r->chunk, r->posted) : 0;
        char *buf = (char *)r->data + (r->bytes ? (size_t)r->posted * r->chunk : 0);
        int peer;
        dt_transport *tp = ps_answer_tp(ps, r->worker, &peer);
        if (!tp || comm_tp_iface(c)->send(tp, peer, ps_tag(PS_TAG_RDATA, r->hdr.seq, r->posted), buf,
                                     len, x, err, sizeof err) != DT_OK) {
            r->stopped = 1;
            return set_error(ps->ctx, DT_EPEER, "ps_serve: answering worker %d: %s", r->worker, err);
        }
        r->busy[i] = 1;
        r->posted++;
    }
    return DT_OK;
}

static dt_status ps_send_answer(dt_ps *ps, int worker, const ps_msg *req, const int64_t *ids,
                                dt_status status, const char *why)
{
    dt_comm *c = ps->comm;
    char err[256] = "";
    ps_reply *r = host_calloc(ps->ctx, sizeof *r);
    if (!r)
        return set_error(ps->ctx, DT_ENOMEM, "ps_serve: out of memory");
    r->hdr = (ps_msg){.magic = PS_MAGIC, .op = req->op, .seq = req->seq,
                      .status = (int32_t)status, .lo = req->lo, .n = req->n, .clock = req->clock,
                      .chunk = req->chunk, .vote = ps->vote};
    snprintf(r->hdr.err, sizeof r->hdr.err, "%s", why ? why : "");
    /* the worker waits for the pieces of what it asked for; a refusal sends
     * them empty (its header says why) */
    int64_t asked = req->op == PS_SPULL ? req->n * ps->tabs[req->lo].dim : req->n;
    asked = req->op == PS_SPULL || (asked >= 0 && asked <= ps->G + ps->P) ? asked : 1;
    int64_t n = status != DT_OK ? 0 : asked;
    r->worker = worker;
    r->chunk = req->chunk;
    r->bytes = (size_t)n * sizeof(float);
    r->pieces = (uint32_t)ps_pieces((size_t)asked * sizeof(float), req->chunk);
    r->data = host_alloc(ps->ctx, sizeof(float) * (size_t)(n > 0 ? n : 1));
    if (!r->data) {
        host_free(ps->ctx, r);
        return set_error(ps->ctx, DT_ENOMEM, "ps_serve: out of memory");
    }
    if (n > 0)
        ps_gather(ps, req, ids, r->data);
    r->hdr_x.user = r;
    int peer;
    dt_transport *tp = ps_answer_tp(ps, worker, &peer);
    dt_status s = !tp ? DT_ESTATE
                      : comm_tp_iface(c)->send(tp, peer, ps_tag(PS_TAG_RESP, req->seq, 0), &r->hdr,
                                          sizeof r->hdr, &r->hdr_x, err, sizeof err);
    if (s != DT_OK) {   /* nothing posted */
        host_free(ps->ctx, r->data);
        host_free(ps->ctx, r);
        return set_error(ps->ctx, DT_EPEER, "ps_serve: answering worker %d: %s", worker, err);
    }
    r->next = ps->replies;   /* the transport holds the header now: swept when it completes */
    ps->replies = r;
    if ((s = ps_reply_fill(ps, r)) != DT_OK)
        return s;
    ps->st.pulls++;
    if (req->op == PS_SPULL && status == DT_OK)
        ps->st.rows_pulled += req->n;
    return DT_OK;
}

/* Can worker w's pull (it has completed `clock` steps) be answered? */
static int ps_pull_ready(dt_ps *ps, int64_t clock)
{
    if (!ps->initialized)
        return 0;
    int64_t slowest = ps_min_clock(ps);
    if (slowest == INT64_MAX || ps->cfg.mode == DT_PS_ASP)
        return 1;
    int64_t s = ps->cfg.mode == DT_PS_SSP ? ps->cfg.staleness : 0;
    return slowest >= clock - s && (ps->cfg.mode != DT_PS_BSP || ps->applied >= clock);
}

static dt_status ps_answer(dt_ps *ps, int worker, const ps_msg *req, const int64_t *ids)
{
    int64_t slowest = ps_min_clock(ps);
    int64_t stale = slowest == INT64_MAX || slowest < 0 ? 0 : req->clock - slowest;
    stale = stale > 0 ? stale : 0;
    ps->stale_sum += (double)stale;
    ps->stale_n++;
    if (stale > ps->st.max_staleness)
        ps->st.max_staleness = stale;
    ps_msg r = *req;   /* the answer tells the worker how stale it is */
    r.clock = stale;
    return ps_send_answer(ps, worker, &r, ids, DT_OK, NULL);
}

/* Answer the waiting pulls that can be answered now. */
static dt_status ps_answer_waiting(dt_ps *ps)
{
    for (ps_wait **pp = &ps->waits; *pp;) {
        ps_wait *q = *pp;
        if (!ps_pull_ready(ps, q->req.clock)) {
            pp = &q->next;
            continue;
        }
        *pp = q->next;
        dt_status s = ps_answer(ps, q->worker, &q->req, q->ids);
        host_free(ps->ctx, q->ids);
        host_free(ps->ctx, q);
        if (s != DT_OK)
            return s;
    }
    return DT_OK;
}

static dt_status ps_post_header(dt_ps *ps, int w)
{
    dt_comm *c = ps->comm;
    char err[256] = "";
    ps_peer *p = &ps->peers[w];
    memset(&p->hdr_x, 0, sizeof p->hdr_x);
    p->hdr_x.user = p;
    if (comm_tp_iface(c)->recv(comm_tp(c), w, ps_tag(PS_TAG_REQ, p->seq, 0), 0, &p->hdr, sizeof p->hdr,
                          &p->hdr_x, err, sizeof err) != DT_OK)
        return set_error(ps->ctx, DT_EPEER, "ps_serve: receive from worker %d: %s", w, err);
    return DT_OK;
}

/* Queue a pull until the slow workers catch up (answered in arrival order);
 * ids (a sparse pull's, may be NULL) become the queue's. */
static dt_status ps_hold_pull(dt_ps *ps, int w, const ps_msg *h, int64_t *ids)
{
    ps_wait *q = host_calloc(ps->ctx, sizeof *q);
    if (!q) {
        host_free(ps->ctx, ids);
        return set_error(ps->ctx, DT_ENOMEM, "ps_serve: out of memory");
    }
    *q = (ps_wait){w, *h, ids, NULL};
    ps_wait **tail = &ps->waits;
    while (*tail)
        tail = &(*tail)->next;
    *tail = q;
    return DT_OK;
}

/* A sparse request's ids (and rows) from worker w arrived. */
static dt_status ps_on_sparse_data(dt_ps *ps, int w)
{
    ps_peer *p = &ps->peers[w];
    const ps_msg *h = &p->hdr;
    ps_tab *tb = &ps->tabs[h->lo];
    int64_t *ids = p->sdata;
    p->sdata = NULL;
    for (int64_t i = 0; i < h->n; i++)
        if (ids[i] < 0 || ids[i] >= tb->count) {
            host_free(ps->ctx, ids);
            return set_error(ps->ctx, DT_EPEER, "ps_serve: worker %d sent row %lld of table '%s', "
                             "which has %lld rows here", w, (long long)ids[i], tb->name,
                             (long long)tb->count);
        }
    if (h->op == PS_SPULL) {
        if (!ps_pull_ready(ps, h->clock))
            return ps_hold_pull(ps, w, h, ids);
        dt_status s = ps_answer(ps, w, h, ids);
        host_free(ps->ctx, ids);
        return s;
    }
    ps->st.pushes++;
    ps->st.rows_pushed += h->n;
    if (ps->cfg.mode != DT_PS_BSP) {   /* applied now, as the dense steps are */
        ps_tab_add(tb, h->n, ids);
        host_free(ps->ctx, ids);
        ps_tab_apply(ps, tb, 1.0f / (float)ps->W);
        return ps_answer_waiting(ps);
    }
    ps_sparse_msg *m = host_calloc(ps->ctx, sizeof *m);
    if (!m) {
        host_free(ps->ctx, ids);
        return set_error(ps->ctx, DT_ENOMEM, "ps_serve: out of memory");
    }
    *m = (ps_sparse_msg){(int)h->lo, h->n, h->clock, ids, NULL};
    ps_sparse_msg **tail = &p->held;   /* kept until its step is applied */
    while (*tail)
        tail = &(*tail)->next;
    *tail = m;
    return DT_OK;
}

/* Read worker w's next request, unless (BSP) its step waits for the others. */
static dt_status ps_next_request(dt_ps *ps, int w)
{
    ps_peer *p = &ps->peers[w];
    /* (a rejoined server that has not heard from everyone lets each finish
     * the step it was in: that may be what the others wait for) */
    if (ps->cfg.mode == DT_PS_BSP && p->clock > (ps->syncing ? p->base : ps->applied)) {
        p->parked = 1;
        return DT_OK;
    }
    return ps_post_header(ps, w);
}

/* Worker w's push (or init) data arrived. */
static dt_status ps_on_data(dt_ps *ps, int w)
{
    ps_peer *p = &ps->peers[w];
    if (p->op == PS_SPUSH || p->op == PS_SPULL)
        return ps_on_sparse_data(ps, w);
    ps->st.pushes++;
    int64_t n = ps_my_floats(ps), gs = n - ps->P;
    if (p->op == PS_CPUSH) {   /* decoded into its place */
        float *dst = p->push + ps_slot(ps, p->data_lo);
        memset(dst, 0, (size_t)p->data_n * sizeof(float));
        codec_decode_add((dt_compress)p->hdr.code, p->sdata, p->data_n, p->hdr.k, dst);
        host_free(ps->ctx, p->sdata);
        p->sdata = NULL;
    }
    if (p->op == PS_INIT) {   /* worker 0's starting values for our keys */
        for (int q = 0; q < ps->npieces && !ps->resumed; q++) {
            int64_t plo = ps->piece_lo[q], phi = plo + dt_tensor_numel(ps->piece[q]);
            int64_t a = p->data_lo > plo ? p->data_lo : plo;
            int64_t b = p->data_lo + p->data_n < phi ? p->data_lo + p->data_n : phi;
            if (a < b)
                ps->sctx->be_iface->copy(ps->sctx->be, (float *)ps->piece[q]->data + (a - plo),
                                         p->push + ps_slot(ps, a), (size_t)(b - a) * sizeof(float));
        }
        ps->init_got += p->data_n;
        ps->initialized = ps->resumed || ps->init_got >= gs;
        return ps_answer_waiting(ps);
    }
    p->got += p->data_n;
    if (p->got < n)
        return DT_OK;
    p->got = 0;
    p->clock++;
    dt_status s;
    if (ps->cfg.mode == DT_PS_BSP) {
        s = ps_apply_bsp(ps);
    } else {
        memcpy(ps->sum, p->push, (size_t)n * sizeof(float));
        s = ps_step(ps, ps->sum, 1.0f / (float)ps->W);
        if (s == DT_OK)
            s = ps_checkpoint_due(ps);
    }
    return s != DT_OK ? s : ps_answer_waiting(ps);
}

/* A sparse request's header arrived: receive its ids (and rows). */
static dt_status ps_recv_sdata(dt_ps *ps, int w, size_t bytes);

static dt_status ps_recv_sparse(dt_ps *ps, int w)
{
    ps_peer *p = &ps->peers[w];
    const ps_msg *h = &p->hdr;   /* (checked by ps_check_request) */
    size_t bytes = (size_t)h->n * (sizeof(int64_t) +
                   (h->op == PS_SPUSH ? (size_t)ps->tabs[h->lo].dim * sizeof(float) : 0));
    return ps_recv_sdata(ps, w, bytes);
}

/* A compressed push's header arrived: receive its code (decoded in
 * ps_on_data). */
static dt_status ps_recv_code(dt_ps *ps, int w)
{
    ps_peer *p = &ps->peers[w];
    const ps_msg *h = &p->hdr;   /* (checked by ps_check_request) */
    p->data_lo = h->lo;
    p->data_n = h->n;
    return ps_recv_sdata(ps, w, codec_bytes((dt_compress)h->code, h->n, h->k));
}

/* Post receives for the next pieces of worker w's request data while
 * slots are free. */
static dt_status ps_fill_recv(dt_ps *ps, int w)
{
    dt_comm *c = ps->comm;
    ps_peer *p = &ps->peers[w];
    char err[256] = "";
    for (int i = 0; i < PS_WINDOW && p->data_next < p->data_pieces; i++) {
        if (p->data_busy[i])
            continue;
        dt_xfer *x = &p->data_x[i];
        memset(x, 0, sizeof *x);
        x->user = p;
        size_t off = (size_t)p->data_next * p->hdr.chunk;
        if (comm_tp_iface(c)->recv(comm_tp(c), w, ps_tag(PS_TAG_DATA, p->hdr.seq, p->data_next), 0,
                              p->data_buf + off, ps_piece_len(p->data_bytes, p->hdr.chunk,
                                                              p->data_next),
                              x, err, sizeof err) != DT_OK)
            return set_error(ps->ctx, DT_EPEER, "ps_serve: receive from worker %d: %s", w, err);
        p->data_busy[i] = 1;
        p->data_piece[i] = p->data_next++;
    }
    return DT_OK;
}

/* Receive `bytes` of worker w's current request into buf, in pieces of
 * the request's chunk; ps_on_data runs when the last one is in. */
static dt_status ps_recv_pieces(dt_ps *ps, int w, void *buf, size_t bytes)
{
    ps_peer *p = &ps->peers[w];
    if (ps_pieces(bytes, p->hdr.chunk) > PS_MAX_PIECES)
        return set_error(ps->ctx, DT_EPEER, "ps_serve: worker %d sent a request of %zu bytes in "
                         "pieces of %u", w, bytes, p->hdr.chunk);
    p->data_buf = buf;
    p->data_bytes = bytes;
    p->data_pieces = (uint32_t)ps_pieces(bytes, p->hdr.chunk);
    p->data_next = p->data_got = 0;
    if (p->data_pieces == 0) {   /* nothing to wait for */
        dt_status s = ps_on_data(ps, w);
        return s != DT_OK ? s : ps_next_request(ps, w);
    }
    return ps_fill_recv(ps, w);
}

/* A piece of worker w's request data arrived in receive slot i. */
static dt_status ps_on_piece(dt_ps *ps, int w, int i)
{
    ps_peer *p = &ps->peers[w];
    size_t want = ps_piece_len(p->data_bytes, p->hdr.chunk, p->data_piece[i]);
    p->data_busy[i] = 0;
    if (p->data_x[i].len != want)
        return set_error(ps->ctx, DT_EPEER, "ps_serve: worker %d sent %zu bytes as piece %u of "
                         "its %s data, %zu expected", w, p->data_x[i].len, p->data_piece[i],
                         ps_op_name(p->op), want);
    if (++p->data_got < p->data_pieces)
        return ps_fill_recv(ps, w);
    dt_status s = ps_on_data(ps, w);
    return s != DT_OK ? s : ps_next_request(ps, w);
}

/* Receive `bytes` of worker w's current request into p->sdata. */
static dt_status ps_recv_sdata(dt_ps *ps, int w, size_t bytes)
{
    ps_peer *p = &ps->peers[w];
    if (!(p->sdata = host_alloc(ps->ctx, bytes)))
        return set_error(ps->ctx, DT_ENOMEM, "ps_serve: out of memory for %zu bytes", bytes);
    return ps_recv_pieces(ps, w, p->sdata, bytes);
}

/* A rejoined server has heard from every live worker: its steps
 * count from the slowest one's, and the job goes on. */
static dt_status ps_sync(dt_ps *ps)
{
    if (!ps->syncing || ps_min_clock(ps) < 0)
        return DT_OK;
    ps->syncing = 0;
    ps->applied = INT64_MAX;   /* the slowest step any live worker said hello at */
    for (int w = 0; w < ps->W; w++)
        if (ps->peers[w].state == 0 && ps->peers[w].base < ps->applied)
            ps->applied = ps->peers[w].base;
    ps->applied = ps->applied == INT64_MAX ? 0 : ps->applied;
    for (int w = 0; w < ps->W; w++)   /* parked while we waited: their steps are in */
        if (ps->peers[w].state == 0 && ps->peers[w].parked && ps->peers[w].clock <= ps->applied) {
            ps->peers[w].parked = 0;
            if (ps_post_header(ps, w) != DT_OK)
                return ps->ctx->last_status;
        }
    dt_status s = ps->cfg.mode == DT_PS_BSP ? ps_apply_bsp(ps) : DT_OK;
    return s != DT_OK ? s : ps_answer_waiting(ps);
}

/* A worker's first request to a restarted server: the steps it has
 * completed, and how many floats of the next one our predecessor got
 * (lost with it: they count as zeros). */
static dt_status ps_on_hello(dt_ps *ps, int w)
{
    ps_peer *p = &ps->peers[w];
    const ps_msg *h = &p->hdr;
    if (!comm_incarnation(ps->comm) || p->clock >= 0 || h->clock < 0 || h->n < 0 || h->n >= ps_my_floats(ps))
        return set_error(ps->ctx, DT_EPEER, "ps_serve: worker %d said hello (step %lld, %lld "
                         "floats in) to a server that %s", w, (long long)h->clock,
                         (long long)h->n, comm_incarnation(ps->comm) ? "knows it already" : "never restarted");
    p->clock = p->base = h->clock;
    p->got = h->n;
    dt_status s = ps_sync(ps);
    return s != DT_OK ? s : ps_next_request(ps, w);
}

/* Whether dense keys [h->lo, h->lo + h->n) are this server's; *flags: they
 * are step flags (keys from G on).  Overflow-safe: lo and n are a peer's. */
static int ps_dense_in_range(const dt_ps *ps, const ps_msg *h, int *flags)
{
    int64_t lo = ps->range[ps->shard], hi = ps->range[ps->shard + 1];
    *flags = h->lo >= ps->G;
    if (h->n < 0)
        return 0;
    if (*flags)
        return h->lo <= ps->G + ps->P && h->n <= ps->G + ps->P - h->lo;
    return h->lo >= lo && h->lo <= hi && h->n <= hi - h->lo;
}

/* The sizes a sparse or compressed request's fields give, checked. */
static dt_status ps_check_sparse(dt_ps *ps, int w, const ps_msg *h)
{
    if (h->lo < 0 || h->lo >= ps->ntables || h->n < 1 || h->n > ps->tabs[h->lo].count)
        return set_error(ps->ctx, DT_EPEER, "ps_serve: worker %d sent a %s of %lld rows of table "
                         "%lld (%d tables)", w, ps_op_name(h->op), (long long)h->n,
                         (long long)h->lo, ps->ntables);
    return DT_OK;
}

static dt_status ps_check_code(dt_ps *ps, int w, const ps_msg *h)
{
    int64_t lo = ps->range[ps->shard], hi = ps->range[ps->shard + 1];
    int kind = h->code;
    if (h->lo < lo || h->lo > hi || h->n < 1 || h->n > hi - h->lo || kind < DT_COMPRESS_BF16 ||
        kind > DT_COMPRESS_INT8 || (kind == DT_COMPRESS_TOPK ? h->k < 1 || h->k > h->n : h->k != 0))
        return set_error(ps->ctx, DT_EPEER, "ps_serve: worker %d sent a compressed push of keys "
                         "[%lld, +%lld) (code %d, %lld entries); this server holds [%lld, %lld)",
                         w, (long long)h->lo, (long long)h->n, kind, (long long)h->k,
                         (long long)lo, (long long)hi);
    return DT_OK;
}

/* The bytes a request's data (push) or its answer (pull) takes. */
static uint64_t ps_request_bytes(const dt_ps *ps, const ps_msg *h)
{
    switch (h->op) {
    case PS_SPUSH: return (uint64_t)h->n * (sizeof(int64_t) + (uint64_t)ps->tabs[h->lo].dim * 4);
    case PS_SPULL: return (uint64_t)h->n * (uint64_t)ps->tabs[h->lo].dim * 4;
    case PS_CPUSH: return codec_bytes((dt_compress)h->code, h->n, h->k);
    case PS_HELLO:
    case PS_FINISH: return 0;
    default: return h->n >= 0 && h->n <= ps->G + ps->P ? (uint64_t)h->n * 4 : 0;
    }
}

/* Whether worker w's request header h (len bytes arrived) is one this
 * server can act on: every field that a later step indexes or sizes with
 * is checked here, without overflow, so nothing after it trusts the peer
 * (a pull of keys not held is answered with a refusal, not an error).
 * Depends on the server's layout only (tests/fuzz/fuzz_ps.c drives it). */
DT_PRIVATE dt_status ps_check_request(dt_ps *ps, int w, const ps_msg *h, size_t len)
{
    const ps_peer *p = &ps->peers[w];
    if (len != sizeof *h || h->magic != PS_MAGIC || h->seq != p->seq || h->op < PS_INIT ||
        h->op > PS_CPUSH || (p->clock < 0 && h->op != PS_HELLO) || h->chunk < PS_MIN_CHUNK ||
        h->chunk > comm_max_msg(ps->comm))
        return set_error(ps->ctx, DT_EPEER, "ps_serve: worker %d sent a malformed request", w);
    dt_status s = DT_OK;
    int flags;
    if (h->op == PS_SPUSH || h->op == PS_SPULL)
        s = ps_check_sparse(ps, w, h);
    else if (h->op == PS_CPUSH)
        s = ps_check_code(ps, w, h);
    else if ((h->op == PS_PUSH || h->op == PS_INIT) &&
             (!ps_dense_in_range(ps, h, &flags) || (h->op == PS_INIT && (flags || w != 0))))
        s = set_error(ps->ctx, DT_EPEER, "ps_serve: worker %d sent %s of keys [%lld, +%lld), "
                      "not this server's", w, ps_op_name(h->op), (long long)h->lo,
                      (long long)h->n);
    if (s == DT_OK && ps_pieces(ps_request_bytes(ps, h), h->chunk) > PS_MAX_PIECES)
        s = set_error(ps->ctx, DT_EPEER, "ps_serve: worker %d sent a %s of %llu bytes in pieces "
                      "of %u", w, ps_op_name(h->op),
                      (unsigned long long)ps_request_bytes(ps, h), h->chunk);
    return s;
}

/* Worker w's request header arrived. */
static dt_status ps_on_header(dt_ps *ps, int w)
{
    ps_peer *p = &ps->peers[w];
    ps_msg *h = &p->hdr;
    if (p->hdr_x.status != DT_OK)
        return set_error(ps->ctx, DT_EPEER, "ps_serve: worker %d sent a malformed request", w);
    if (ps_check_request(ps, w, h, p->hdr_x.len) != DT_OK)
        return ps->ctx->last_status;
    p->seq++;
    p->op = (int)h->op;
    if ((h->op == PS_PUSH || h->op == PS_CPUSH || h->op == PS_SPUSH) && h->vote > p->vote)
        p->vote = h->vote;   /* (every push of a step carries it) */
    if (h->op == PS_HELLO)
        return ps_on_hello(ps, w);
    if (h->op == PS_FINISH) {
        p->state = 1;
        dt_status s = ps->cfg.mode == DT_PS_BSP ? ps_apply_bsp(ps) : DT_OK;
        if (s == DT_OK)
            s = ps_sync(ps);
        return s != DT_OK ? s : ps_answer_waiting(ps);
    }
    if (h->op == PS_SPUSH || h->op == PS_SPULL)
        return ps_recv_sparse(ps, w);
    if (h->op == PS_CPUSH)
        return ps_recv_code(ps, w);
    int flags, in_range = ps_dense_in_range(ps, h, &flags);
    if (h->op == PS_PULL) {
        dt_status s = DT_OK;
        if (!in_range || flags)
            s = ps_send_answer(ps, w, h, NULL, DT_EINVAL, "pull of keys this server does not hold");
        else if (ps_pull_ready(ps, h->clock))
            s = ps_answer(ps, w, h, NULL);
        else
            s = ps_hold_pull(ps, w, h, NULL);
        return s != DT_OK ? s : ps_post_header(ps, w);
    }
    p->data_lo = h->lo;
    p->data_n = h->n;
    return ps_recv_pieces(ps, w, p->push + ps_slot(ps, h->lo), (size_t)h->n * sizeof(float));
}

/* Cancel the receives posted for worker p. */
static void ps_cancel_peer(dt_ps *ps, ps_peer *p)
{
    dt_comm *c = ps->comm;
    comm_tp_iface(c)->cancel(comm_tp(c), &p->hdr_x);
    for (int i = 0; i < PS_WINDOW; i++)
        if (p->data_busy[i])
            comm_tp_iface(c)->cancel(comm_tp(c), &p->data_x[i]);
}

/* Worker w died, left without finishing, or stays silent while others
 * wait for it: serve without it. */
static dt_status ps_drop(dt_ps *ps, int w, const char *why)
{
    ps_peer *p = &ps->peers[w];
    if (p->state != 0)
        return DT_OK;
    p->state = 2;
    ps->st.dropped_workers++;
    int live = 0;
    for (int k = 0; k < ps->W; k++)
        live += ps->peers[k].state == 0;
    ctx_warn(ps->ctx, "parameter server %d (rank %d): dropped worker %d after %lld steps: %s; "
         "going on with %d worker%s", ps->server, dt_comm_rank(ps->comm), w, (long long)p->clock, why, live,
         live == 1 ? "" : "s");
    for (ps_wait **pp = &ps->waits; *pp;) {   /* its waiting pull goes unanswered */
        ps_wait *q = *pp;
        if (q->worker != w) {
            pp = &q->next;
            continue;
        }
        *pp = q->next;
        host_free(ps->ctx, q->ids);
        host_free(ps->ctx, q);
    }
    ps_free_held(ps, p);
    ps_cancel_peer(ps, p);
    for (ps_reply *r = ps->replies; r; r = r->next)   /* nobody takes their other pieces */
        r->stopped |= r->worker == w;
    ps_close_answers(ps, w);   /* (what it held is done now: swept) */
    dt_status s = ps->cfg.mode == DT_PS_BSP ? ps_apply_bsp(ps) : DT_OK;
    if (s == DT_OK)
        s = ps_sync(ps);
    return s != DT_OK ? s : ps_answer_waiting(ps);
}

/* Is another server dead and not yet back?  Workers wait for its restart
 *, silent here meanwhile: no reason to drop them. */
static int ps_server_down(dt_ps *ps)
{
    dt_comm *c = ps->comm;
    for (int q = 0; q < ps->S && comm_watch(c); q++) {
        char key[32], val[16];
        size_t len = 0;
        int rank = ps->W + q;
        if (q == ps->server)
            continue;
        store_dead_key(key, sizeof key, rank, ps_published_inc(c, rank, 1));
        if (dt_store_get(comm_watch(c), key, val, sizeof val, &len, 1) == DT_OK)
            return 1;
    }
    return 0;
}

/* Every DT_COMM_WATCH_S: drop workers the store reports dead, and, while a
 * pull waits, live workers silent for the communicator's timeout. */
/* Does rank 0's store hold key?  *lost is set when the store is gone
 * (a lost connection, not a late answer). */
static int ps_store_has(dt_comm *c, const char *key, int *lost)
{
    char val[16];
    size_t len = 0;
    if (!comm_watch(c))
        return 0;
    dt_status st = dt_store_get(comm_watch(c), key, val, sizeof val, &len, 1);
    *lost |= st != DT_OK && st != DT_ETIMEDOUT;
    return st == DT_OK;
}

/* Is silent worker w alive: has its heartbeat (src/join.c, join_heartbeat)
 * changed within the timeout?  A living worker may be kept waiting itself
 * (on a silent server it has yet to write off: ps_write_off_silent takes
 * the same timeout), so silence alone is not death.  A store that is gone
 * tells nothing: not alive. */
static int ps_worker_alive(dt_ps *ps, int w, double now, int lost)
{
    dt_comm *c = ps->comm;
    ps_peer *p = &ps->peers[w];
    char key[32], val[160];
    size_t len = 0;
    if (!p->hb_seen)
        p->hb_seen = now;   /* its clock starts when it first falls silent */
    snprintf(key, sizeof key, "/hb/%d", w);
    if (!lost && comm_watch(c) && dt_store_get(comm_watch(c), key, val, sizeof val - 1, &len, 1) == DT_OK) {
        val[len < sizeof val ? len : sizeof val - 1] = '\0';
        unsigned long long beat = strtoull(val, NULL, 10);
        if (beat != p->hb_beat) {
            p->hb_beat = beat;
            p->hb_seen = now;
        }
    }
    return !lost && now - p->hb_seen <= comm_timeout_ms(c) / 1000.0;
}

static dt_status ps_watch(dt_ps *ps, double *last_seen)
{
    dt_comm *c = ps->comm;
    double now = dt_now();
    int held = ps->waits != NULL;   /* does anyone wait for the others? */
    for (int w = 0; w < ps->W; w++)
        held |= ps->peers[w].state == 0 && ps->peers[w].parked;
    int lost = 0;   /* the store (rank 0) is gone: no death is told any more */
    char key[48];
    ps_fence_key(key, sizeof key, ps->job, dt_comm_rank(c), comm_incarnation(c));
    if (ps_store_has(c, key, &lost))
        return set_error(ps->ctx, DT_EPEER, "ps_serve: the workers wrote this server (rank %d) off "
                         "while it was silent for the %d ms timeout (stopped or hung?); its twin "
                         "serves on", dt_comm_rank(c), comm_timeout_ms(c));
    for (int w = 0; w < ps->W; w++) {
        if (ps->peers[w].state != 0)
            continue;
        snprintf(key, sizeof key, "dead/%d", w);
        int dead = ps_store_has(c, key, &lost);
        snprintf(key, sizeof key, "ps%d/gone/%d", ps->job, w);   /* left without finishing */
        dead = dead || ps_store_has(c, key, &lost);
        snprintf(key, sizeof key, "ps%d/done/%d", ps->job, w);   /* finished before we restarted */
        if (ps->peers[w].clock < 0 && ps_store_has(c, key, &lost)) {
            ps->peers[w].state = 1;
            comm_tp_iface(c)->cancel(comm_tp(c), &ps->peers[w].hdr_x);
            if (ps_sync(ps) != DT_OK)
                return ps->ctx->last_status;
            continue;
        }
        int waiting = ps->peers[w].parked;   /* one waiting for us is silent by design */
        for (const ps_wait *q = ps->waits; q && !waiting; q = q->next)
            waiting = q->worker == w;
        /* silent while others wait, or with the store gone (its death would
         * go untold); or, restarted, never heard from (else we would wait
         * forever); but not while it waits for a restarting server */
        double quiet = now - last_seen[w], limit = comm_timeout_ms(c) / 1000.0;
        int quiet_long = !waiting && (((held || lost) && quiet > limit) ||
                                      (ps->syncing && ps->peers[w].clock < 0 && quiet > 2 * limit)) &&
                         !ps_server_down(ps);
        if (!quiet_long)
            ps->peers[w].hb_seen = 0;   /* (its heartbeat's clock restarts next time) */
        /* alive: dropped only once it kept the others the collective timeout */
        int alive = quiet_long && !dead && ps_worker_alive(ps, w, now, lost);
        int silent = quiet_long && (!alive || quiet > comm_collective_timeout_ms(c) / 1000.0);
        char why[96];
        snprintf(why, sizeof why, "%s", dead ? "it died or left without finishing" : "");
        if (!dead)
            snprintf(why, sizeof why, "silent for %.1f s %s", now - last_seen[w],
                     alive ? "while others waited, though alive (its heartbeat went on)"
                     : held ? "while others waited, its heartbeat stopped"
                            : "with the store (rank 0) gone");
        if ((dead || silent) && ps_drop(ps, w, why) != DT_OK)
            return ps->ctx->last_status;
    }
    return DT_OK;
}

static int ps_is_peer(const dt_ps *ps, const void *user)
{
    return (const char *)user >= (const char *)ps->peers &&
           (const char *)user < (const char *)(ps->peers + ps->W);
}

/* Are sends of answer r still with the transport, or pieces left to go? */
static int ps_reply_busy(const ps_reply *r)
{
    if (!r->hdr_x.done || (r->posted < r->pieces && !r->stopped))
        return 1;
    for (int i = 0; i < PS_WINDOW; i++)
        if (r->busy[i] && !r->data_x[i].done)
            return 1;
    return 0;
}

/* Answers still on their way to a worker that can take them.  Those to a
 * dropped worker may never complete (tcp orphans a send to a dead process,
 * shm waits for its word), so they hold nothing up: dt_ps_serve closes the
 * transport under them. */
static int ps_replies_owed(const dt_ps *ps)
{
    for (const ps_reply *r = ps->replies; r; r = r->next)
        if (ps->peers[r->worker].state != 2 && ps_reply_busy(r))
            return 1;
    return 0;
}

/* A send of an answer completed: its slot takes the next piece.  (Only
 * ours: a cancelled transfer of an earlier collective may surface here.) */
static dt_status ps_on_sent(dt_ps *ps, dt_xfer *x)
{
    ps_reply *r = ps->replies;
    while (r && r != x->user)
        r = r->next;
    if (!r || x == &r->hdr_x)
        return DT_OK;
    r->busy[x - r->data_x] = 0;
    return ps_reply_fill(ps, r);
}

/* Free the answers whose sends all completed (after a poll's whole batch
 * was looked at: one batch may hold several of an answer's completions). */
static void ps_sweep_replies(dt_ps *ps)
{
    for (ps_reply **pp = &ps->replies; *pp;) {
        ps_reply *r = *pp;
        if (ps_reply_busy(r)) {
            pp = &r->next;
            continue;
        }
        *pp = r->next;
        host_free(ps->ctx, r->data);
        host_free(ps->ctx, r);
    }
}

/* What the loop measures of itself, for the report and the monitor
 * (prof_ps_serving): its time busy, and its time not running (a gap
 * between two turns beyond the 20 ms poll wait and 50 ms of slack: the
 * process was stopped, or its host starved it). */
typedef struct ps_meter {
    dt_profile_stats sv;   /* its ps_ fields */
    double t0, idle_from, published;
} ps_meter;

static void ps_meter_turn(ps_meter *mt, double now)
{
    double gap = now - mt->idle_from;
    if (gap > PS_POLL_S + PS_STALL_SLACK_S)
        mt->sv.ps_stalled_s += gap - PS_POLL_S;
}

static void ps_meter_publish(dt_ps *ps, ps_meter *mt, double now, int force)
{
    if (!force && now - mt->published < 0.1)
        return;
    int64_t waiting = 0;
    for (const ps_wait *q = ps->waits; q; q = q->next)
        waiting++;
    for (int w = 0; w < ps->W; w++)
        waiting += ps->peers[w].parked;
    mt->sv.ps_queue_max = waiting > mt->sv.ps_queue_max ? waiting : mt->sv.ps_queue_max;
    mt->sv.ps_serve_s = now - mt->t0;
    mt->sv.ps_served = ps->st.pushes + ps->st.pulls;
    mt->sv.ps_keys = ps_my_floats(ps);
    for (int t = 0; t < ps->ntables; t++)   /* and its rows of the sparse tables */
        mt->sv.ps_keys += ps->tabs[t].count * ps->tabs[t].dim;
    mt->published = now;
    prof_ps_serving(ps->ctx, &mt->sv);
}

static dt_status ps_serve_loop(dt_ps *ps, double *last_seen)
{
    dt_comm *c = ps->comm;
    ps_meter mt = {.t0 = dt_now()};
    mt.idle_from = mt.t0;
    for (int w = 0; w < ps->W; w++) {
        last_seen[w] = dt_now();
        if (ps_post_header(ps, w) != DT_OK)
            return ps->ctx->last_status;
    }
    if (join_announce_rejoin(c) != DT_OK)   /* a restarted server: workers may come now */
        return ps->ctx->last_status;
    double last_watch = dt_now();
    for (;;) {
        int live = 0;
        for (int w = 0; w < ps->W; w++)
            live += ps->peers[w].state == 0;
        if (!live && !ps_replies_owed(ps)) {
            ps_meter_publish(ps, &mt, dt_now(), 1);
            return DT_OK;
        }
        dt_xfer *done[16];
        char err[256] = "";
        double turn = dt_now();
        ps_meter_turn(&mt, turn);
        int k = comm_tp_iface(c)->poll(comm_tp(c), done, 16, err, sizeof err);
        if (k < 0)
            return set_error(ps->ctx, DT_EPEER, "ps_serve: transport failure: %s", err);
        k = ps_poll_answers(ps, done, k, 16);
        for (int i = 0; i < k; i++) {
            dt_xfer *x = done[i];
            *(ps_is_peer(ps, x->user) ? &mt.sv.ps_bytes_in : &mt.sv.ps_bytes_out) += (double)x->len;
            if (!ps_is_peer(ps, x->user)) {   /* a piece of an answer sent: the next one */
                if (ps_on_sent(ps, x) != DT_OK)
                    return ps->ctx->last_status;
                continue;   /* (answers are swept below) */
            }
            ps_peer *p = x->user;
            int w = (int)(p - ps->peers);
            last_seen[w] = dt_now();
            dt_status s = DT_OK;
            if (p->state != 0)
                continue;   /* a cancelled receive of a dropped worker */
            if (x->status != DT_OK)
                s = ps_drop(ps, w, "a transfer with it failed");
            else if (x == &p->hdr_x)
                s = ps_on_header(ps, w);
            else
                s = ps_on_piece(ps, w, (int)(x - p->data_x));
            if (s != DT_OK)
                return s;
        }
        ps_sweep_replies(ps);
        if (k > 0)
            mt.sv.ps_busy_s += dt_now() - turn;
        ps_meter_publish(ps, &mt, dt_now(), 0);
        /* (on every turn, not only idle ones: completions that never stop
         * coming must not keep a dead or silent worker from being seen) */
        if (dt_now() - last_watch > DT_COMM_WATCH_S) {
            last_watch = dt_now();
            if (ps_watch(ps, last_seen) != DT_OK)
                return ps->ctx->last_status;
        }
        if (k == 0) {
            mt.idle_from = dt_now();   /* (answers in flight complete on their own endpoints) */
            comm_tp_iface(c)->wait(comm_tp(c), ps->ans && ps_replies_owed(ps) ? 1 : (int)(PS_POLL_S * 1e3));
        } else {
            mt.idle_from = dt_now();
        }
    }
}

/* Transfers of ours the transport still holds (owed_only: leave out the
 * answers to dropped workers, which may never complete). */
static int ps_outstanding(const dt_ps *ps, int owed_only)
{
    for (int w = 0; w < ps->W; w++) {
        const ps_peer *p = &ps->peers[w];
        for (int i = 0; i < PS_WINDOW; i++)
            if (p->data_busy[i] && !p->data_x[i].done)
                return 1;
        if (!p->hdr_x.done)
            return 1;
    }
    return owed_only ? ps_replies_owed(ps) : ps->replies != NULL;
}

/* The workers stopped after the agreed step and finished; its state is
 * saved (ps_checkpoint, with a checkpoint_dir): say so, as a status the
 * server's program exits DT_EXIT_PREEMPTED on. */
static dt_status ps_preempted(dt_ps *ps)
{
    dt_ctx *ctx = ps->ctx;
    if (ps->ckpt_path)
        dt_preempt_saved(ctx, -1);
    char line[128];
    preempt_line(ctx, line, sizeof line);
    return set_error(ctx, DT_EPREEMPTED, "ps_serve: %s%s%s", line, ps->ckpt_path ? " in " : "",
                     ps->ckpt_path ? ps->ckpt_path : " (no dt_ps_config.checkpoint_dir)");
}

dt_status dt_ps_serve(dt_ps *ps)
{
    if (!ps)
        return DT_EINVAL;
    if (ps->server < 0)
        return set_error(ps->ctx, DT_ESTATE, "ps_serve: rank %d is a worker", dt_comm_rank(ps->comm));
    dt_comm *c = ps->comm;
    double *last_seen = host_calloc(ps->ctx, sizeof(double) * (size_t)ps->W);
    if (!last_seen)
        return set_error(ps->ctx, DT_ENOMEM, "ps_serve: out of memory");
    char why[DT_MAX_ERROR];
    int broken = comm_take_transport(c, why, sizeof why) != DT_OK;
    dt_status s = broken ? set_error(ps->ctx, DT_ESTATE, "ps_serve: communicator failed earlier: %s", why)
                         : ps_serve_loop(ps, last_seen);
    if (s == DT_OK)   /* the final state, for a job that starts again */
        s = ps_checkpoint(ps);
    if (s == DT_OK && preempt_stop_step(ps->ctx) >= 0)
        s = ps_preempted(ps);
    for (int w = 0; !broken && w < ps->W; w++)   /* nothing of ours stays posted */
        if (ps->peers[w].state == 0)
            ps_cancel_peer(ps, &ps->peers[w]);
    for (ps_reply *r = ps->replies; r; r = r->next)
        r->stopped = 1;
    /* Cancelled receives complete in a later poll, and after an error
     * answers may still be on their way: give them a second, then close the
     * transport rather than leave it holding what dt_ps_free frees. */
    for (double end = dt_now() + 1.0; !broken && ps_outstanding(ps, 1) && dt_now() < end;) {
        dt_xfer *done[16];
        char err[256];
        int k = comm_tp_iface(c)->poll(comm_tp(c), done, 16, err, sizeof err);
        k = ps_poll_answers(ps, done, k > 0 ? k : 0, 16);
        for (int i = 0; i < k; i++)
            if (!ps_is_peer(ps, done[i]->user))
                ps_on_sent(ps, done[i]);   /* (stopped: posts nothing) */
        ps_sweep_replies(ps);
        if (k <= 0)
            comm_tp_iface(c)->wait(comm_tp(c), 10);
    }
    ps_close_answer_endpoints(ps);   /* what they still held ends done */
    ps_sweep_replies(ps);
    if (!broken && ps_outstanding(ps, 0))
        comm_break(c, "ps_serve: sends to a dropped worker never completed; the transport was "
                      "closed under them");
    if (!broken)
        comm_release_transport(c);
    host_free(ps->ctx, last_seen);
    return s;
}

/* With a parameter server the workers alone wrap the model: the
 * servers' keys are the layout dt_ps_new agreed, which is this DDP's. */
DT_PRIVATE dt_status ps_ddp_check(dt_ctx *ctx, dt_comm *c, const dt_ddp_config *cfg, const dt_optim *opt)
{
    const dt_ps *ps = cfg->ps;
    if (ps->comm != c || ps->ctx != ctx)
        return set_error(ctx, DT_EINVAL, "ddp_new: the parameter server belongs to another "
                         "communicator or context");
    if (ps->server >= 0)
        return set_error(ctx, DT_EINVAL, "ddp_new: rank %d is a parameter server; workers wrap "
                         "the model, servers call dt_ps_serve", dt_comm_rank(c));
    if (ps->nparams != ctx->n_params)
        return set_error(ctx, DT_EMISMATCH, "ddp_new: %d parameters now, %d when dt_ps_new ran",
                         ctx->n_params, ps->nparams);
    if (opt)
        return set_error(ctx, DT_EINVAL, "ddp_new: with a parameter server the servers step "
                         "(dt_ps_config.optim); pass no optimizer");
    return DT_OK;
}
