#include "dist.h"

/* ===========================================================================
 * Parameter server
 *
 * Workers are ranks 0..W-1, servers the last S ranks.  The key space is
 * DDP's flat layout: every parameter's floats in reverse registration
 * order (G floats), then one "used" flag per parameter (P floats).  Server
 * s owns the gradient keys [range[s], range[s+1]) (contiguous, balanced by
 * bytes) and receives every flag.  A server keeps its keys as pieces (a
 * parameter cut to its range), each a parameter of the server's own
 * context, so the same dt_optim that steps a model steps the shard: as in
 * one process, a parameter no worker used is skipped.
 *
 * Messages go over the communicator's transport, each request a ps_msg
 * header (tag PS_TAG_REQ) and, for pushes, the floats (PS_TAG_DATA); a pull
 * is answered with a header (PS_TAG_RESP) and the floats (PS_TAG_RDATA).
 * Data travels in pieces of at most the header's `chunk` bytes, a few in
 * flight at a time, so no message exceeds the transport's limit and, on
 * shm, none needs the receiver's answer to complete.  Tags carry a
 * per (worker, server) sequence number and the piece's index, so every
 * message is matched exactly; their top 12 bits are all ones, which no
 * collective's tag has (src/comm.c).  A worker's requests run on its comm thread as work of
 * kind COLL_EXT, like a bucket's allreduce; a server runs dt_ps_serve on
 * its own thread, owning the transport meanwhile (as run_inline does).
 *
 * A worker's step on a server completes when all of its G_s gradient
 * floats and the P flags have arrived (whatever the buckets were).  BSP:
 * when every live worker has completed step t, the server sums their
 * gradients in worker order, averages, and steps (bit-identical to DDP's
 * allreduce and step).  ASP/SSP: each worker's completed step is applied
 * on its own, scaled by 1/W.  A pull from a worker that has completed c
 * steps is answered once the slowest live worker has completed c - s
 * (BSP: s = 0; ASP: always).
 * ======================================================================== */

/* Sparse requests.  The asked ids are sorted (by id, then position) so
 * each distinct row moves once and repeated rows' gradients are summed in
 * the caller's order: the same request gives the same bits. */
struct ps_idpos {
    int64_t id, pos;
};


static const char *const ps_op_names[] = {"?", "init", "push", "pull", "finish", "sparse push",
                                          "sparse pull", "hello", "compressed push"};

/* A request's name for messages ("push"); "?" outside the table */
DT_PRIVATE const char *ps_op_name(int op)
{
    return op >= 0 && op < (int)(sizeof ps_op_names / sizeof ps_op_names[0]) ? ps_op_names[op] : "?";
}

/* Bits 52-63 all ones, 48-51 the type, 24-47 the piece, 0-23 the request's
 * number (it wraps; a pair never has 2^24 requests in flight). */
DT_PRIVATE uint64_t ps_tag(int type, uint32_t seq, uint32_t piece)
{
    return (uint64_t)0xFFF << 52 | (uint64_t)type << 48 | (uint64_t)(piece & 0xFFFFFF) << 24 |
           (seq & 0xFFFFFF);
}


DT_PRIVATE uint64_t ps_pieces(size_t bytes, size_t chunk)
{
    return ((uint64_t)bytes + chunk - 1) / chunk;
}

DT_PRIVATE size_t ps_piece_len(size_t bytes, size_t chunk, uint32_t i)
{
    size_t off = (size_t)i * chunk;
    return bytes - off < chunk ? bytes - off : chunk;
}

void dt_ps_config_init(dt_ps_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->struct_size = sizeof *cfg;
    cfg->mode = DT_PS_MODE_AUTO;   /* the environment's to choose, unless the program does */
    cfg->staleness = -1;
    dt_optim_config_init(&cfg->optim, DT_SGD);
}

int dt_ps_is_server(const dt_ps *ps) { return ps && ps->server >= 0; }
int dt_ps_workers(const dt_ps *ps) { return ps ? ps->W : 0; }
int dt_ps_servers(const dt_ps *ps) { return ps ? ps->S : 0; }

dt_status dt_ps_stats_get(const dt_ps *ps, dt_ps_stats *out)
{
    if (!ps || !out)
        return DT_EINVAL;
    *out = ps->st;
    out->mean_staleness = ps->stale_n ? ps->stale_sum / (double)ps->stale_n : 0.0;
    return DT_OK;
}

/* --- layout and sharding --------------------------------------------- */

/* The model as the servers see it: "dtrain-ps P T", every parameter's
 * "name numel" line in registration order, then every table's "rows dim
 * scale seed name" line (names last: they may hold spaces).  NULL: out of
 * memory, or a table is unusable (said in ctx). */
static char *ps_describe(dt_ctx *ctx, const dt_ps_config *cfg)
{
    if (cfg->ntables < 0 || (cfg->ntables > 0 && !cfg->tables)) {
        set_error(ctx, DT_EINVAL, "ps_new: %d tables at %p", cfg->ntables, (const void *)cfg->tables);
        return NULL;
    }
    size_t cap = 64;
    for (int i = 0; i < ctx->n_params; i++)
        cap += strlen(ctx->params[i]->name) + 24;
    for (int t = 0; t < cfg->ntables; t++) {
        const dt_ps_table *tb = &cfg->tables[t];
        static const char *const reserved[] = {".sum", ".exp_avg", ".exp_avg_sq", ".momentum_buffer",
                                               ".steps"};
        size_t nl = tb->name ? strlen(tb->name) : 0;
        int clash = 0;   /* a name ending like an optimizer state's would collide in checkpoints */
        for (int r = 0; r < 5; r++)
            clash |= nl >= strlen(reserved[r]) && !strcmp(tb->name + nl - strlen(reserved[r]), reserved[r]);
        int bad = !tb->name || !*tb->name || nl > DT_MAX_NAME - 32 || clash || strchr(tb->name, '\n') || tb->rows < 1 ||
                  tb->dim < 1 || tb->rows > INT64_MAX / 8 / tb->dim || !(tb->init_scale >= 0) ||
                  isinf(tb->init_scale);
        for (int u = 0; !bad && u < t; u++)
            bad = !strcmp(cfg->tables[u].name, tb->name);
        if (bad) {
            set_error(ctx, DT_EINVAL, "ps_new: table %d ('%.60s', %lld x %lld, scale %g): need a "
                      "unique name of at most %d characters, without newlines or an optimizer "
                      "state's suffix, rows and dim >= 1, a finite scale >= 0", t,
                      tb->name ? tb->name : "(null)", (long long)tb->rows, (long long)tb->dim,
                      (double)tb->init_scale, DT_MAX_NAME - 32);
            return NULL;
        }
        cap += strlen(tb->name) + 96;
    }
    char *s = host_alloc(ctx, cap), *p = s;
    if (!s) {
        set_error(ctx, DT_ENOMEM, "ps_new: out of memory");
        return NULL;
    }
    p += snprintf(p, cap, "dtrain-ps %d %d %d %d %d\n", ctx->n_params, cfg->ntables, cfg->servers,
                  cfg->replicate != 0, (int)cfg->mode);
    for (int i = 0; i < ctx->n_params; i++)
        p += snprintf(p, cap - (size_t)(p - s), "%s %lld\n", ctx->params[i]->name,
                      (long long)dt_tensor_numel(ctx->params[i]));
    for (int t = 0; t < cfg->ntables; t++) {
        const dt_ps_table *tb = &cfg->tables[t];
        p += snprintf(p, cap - (size_t)(p - s), "%lld %lld %a %llu %s\n", (long long)tb->rows,
                      (long long)tb->dim, (double)tb->init_scale, (unsigned long long)tb->seed,
                      tb->name);
    }
    return s;
}

/* One table line of the layout. */
static int ps_parse_table(dt_ctx *ctx, const char *line, const char *nl, ps_tab *tb)
{
    char *e;
    tb->rows = strtoll(line, &e, 10);
    tb->dim = strtoll(e, &e, 10);
    tb->scale = strtof(e, &e);
    tb->seed = strtoull(e, &e, 10);
    if (*e != ' ' || e >= nl || tb->rows < 1 || tb->dim < 1 || tb->rows > INT64_MAX / 8 / tb->dim ||
        !isfinite(tb->scale) || tb->scale < 0)
        return 0;
    size_t len = (size_t)(nl - e - 1);
    if (!(tb->name = host_alloc(ctx, len + 1)))
        return 0;
    memcpy(tb->name, e + 1, len);
    tb->name[len] = '\0';
    return 1;
}

/* Sizes from a layout description; offsets in DDP's order (reverse
 * registration), ranges cut by bytes. */
static dt_status ps_plan(dt_ps *ps, const char *layout)
{
    dt_ctx *ctx = ps->ctx;
    int n = -1, nt = -1, servers = 0, repl = 0, mode = 0, used = 0;
    if (sscanf(layout, "dtrain-ps %d %d %d %d %d\n%n", &n, &nt, &servers, &repl, &mode, &used) != 5 ||
        used == 0 || n < 0 || nt < 0 || n > 1 << 24 || nt > 1 << 16)
        return set_error(ctx, DT_EPEER, "ps_new: worker 0's model layout is malformed");
    if (servers != ps->S || repl != (ps->cfg.replicate != 0) || mode != (int)ps->cfg.mode)
        return set_error(ctx, DT_EMISMATCH, "ps_new: rank %d has %d servers, replication %d, mode "
                         "%d; worker 0 has %d, %d, %d", dt_comm_rank(ps->comm), ps->S,
                         ps->cfg.replicate != 0, (int)ps->cfg.mode, servers, repl, mode);
    ps->nparams = n;
    ps->ntables = nt;
    ps->numel = host_calloc(ctx, sizeof(int64_t) * (size_t)(n + 1));
    ps->offset = host_calloc(ctx, sizeof(int64_t) * (size_t)(n + 1));
    ps->range = host_calloc(ctx, sizeof(int64_t) * (size_t)(ps->S + 1));
    ps->tabs = host_calloc(ctx, sizeof(ps_tab) * (size_t)(nt + 1));
    if (!ps->numel || !ps->offset || !ps->range || !ps->tabs)
        return set_error(ctx, DT_ENOMEM, "ps_new: out of memory");
    const char *p = layout + used;
    for (int i = 0; i < n + nt; i++) {
        const char *nl = strchr(p, '\n'), *sp = nl;
        while (sp && sp > p && *sp != ' ')   /* the number after the line's last space */
            sp--;
        int ok = nl && sp && *sp == ' ';
        if (ok && i < n)   /* (a bound that keeps every sum of them, in bytes, in range) */
            ok = (ps->numel[i] = strtoll(sp + 1, NULL, 10)) >= 0 && ps->numel[i] <= PS_MAX_KEYS;
        else if (ok)
            ok = ps_parse_table(ctx, p, nl, &ps->tabs[i - n]);
        if (!ok)
            return set_error(ctx, DT_EPEER, "ps_new: worker 0's model layout is malformed "
                             "(line %d)", i + 2);
        p = nl + 1;
    }
    int64_t off = 0;
    for (int i = n - 1; i >= 0; i--) {
        ps->offset[i] = off;
        off += ps->numel[i];
        if (off > PS_MAX_KEYS)
            return set_error(ctx, DT_EPEER, "ps_new: worker 0's model layout has more than %lld "
                             "parameters", (long long)PS_MAX_KEYS);
    }
    ps->G = off;
    ps->P = n;
    for (int s = 0; s <= ps->L; s++)
        ps->range[s] = ps->G * s / ps->L;
    return DT_OK;
}

/* --- the worker's side ----------------------------------------------- */

/* Replicated jobs: server s failed; if its shard's other server is alive,
 * s is written off and the request goes on without it. */
/* Write server s off: only in a replicated job whose twin of s is alive,
 * and only once the store says s died (a failed transfer alone may be a
 * live server's hiccup: writing it off would let the twins drift apart).
 * `known`: the caller saw the store say so. */
static int ps_write_off_server(dt_comm *c, dt_ps *ps, int s, int known)
{
    int twin = ps->L != ps->S && !ps->gone[(s + ps->L) % ps->S];
    if ((!twin && ps->cfg.rejoin_ms < 0) || !comm_watch(c))
        return 0;
    if (!known) {   /* the death is usually published a moment after it shows */
        char key[32], val[16];
        size_t len = 0;
        store_dead_key(key, sizeof key, ps->W + s, ps->inc[s]);
        if (dt_store_get(comm_watch(c), key, val, sizeof val, &len, comm_timeout_ms(c) / 2) != DT_OK)
            return 0;
    }
    ps->gone[s] = twin ? 1 : 2;   /* no twin: wait for a restarted process */
    ps->down_since[s] = dt_now();
    return 1;
}

/* A post to server s failed (the work's first failure): go on without s
 * if it can be written off (or waited for). */
static dt_status ps_forgive(dt_comm *c, dt_work *w, dt_ps *ps, int s)
{
    if (!ps_write_off_server(c, ps, s, 0))
        return comm_work_status(w);
    comm_work_forgive(w);
    return DT_OK;
}

/* comm_wait_xfers' hook: a transfer with a server failed. */
static int ps_write_off(dt_comm *c, void *arg, int peer)
{
    dt_ps *ps = arg;
    return peer >= ps->W && peer < ps->W + ps->S && ps_write_off_server(c, ps, peer - ps->W, 0);
}

/* A message's data, to go out (or come in) in pieces as ps_pump finds
 * room for them. */
static dt_status ps_add_stream(dt_work *w, ps_call *pc, int sending, int peer, int via, int type,
                               uint32_t seq, void *buf, size_t bytes)
{
    size_t chunk = pc->ps->chunk;
    if (bytes == 0)
        return DT_OK;
    if (ps_pieces(bytes, chunk) > PS_MAX_PIECES || pc->nstreams == 3 * PS_MAX_SERVERS)
        return comm_work_fail(w, DT_ENOTSUP, "parameter server: a message of %zu bytes is more than "
                              "%u pieces of %zu bytes (raise dt_ps_config.chunk_bytes)", bytes,
                              PS_MAX_PIECES, chunk);
    pc->streams[pc->nstreams++] = (ps_stream){.peer = peer, .via = via, .sending = sending, .type = type,
                                              .seq = seq, .pieces = (uint32_t)ps_pieces(bytes, chunk),
                                              .buf = buf, .bytes = bytes};
    return DT_OK;
}

/* Post the header of one request to server s; its `bytes` of data (if
 * any) become a stream. */
static dt_status ps_post_request(dt_comm *c, dt_work *w, xfers *xs, ps_call *pc, int s,
                                 int op, int64_t lo, int64_t n, void *data, size_t bytes,
                                 ps_msg *hdr)
{
    dt_ps *ps = pc->ps;
    uint32_t seq = ps->seq[s]++;
    *hdr = (ps_msg){.magic = PS_MAGIC, .op = (uint32_t)op, .seq = seq, .lo = lo, .n = n,
                    .clock = pc->clock, .chunk = (uint32_t)ps->chunk};
    if (op == PS_CPUSH) {
        hdr->code = pc->code;
        hdr->k = pc->cnt[s % ps->L];
    }
    if (op == PS_PUSH || op == PS_CPUSH || op == PS_SPUSH)
        hdr->vote = preempt_local(ps->ctx);   /* (src/ps_server.c, ps_count_votes) */
    int peer = ps->W + s;
    if (comm_post(c, w, xs, 1, peer, ps_tag(PS_TAG_REQ, seq, 0), hdr, sizeof *hdr) != DT_OK)
        return ps_forgive(c, w, ps, s);
    return data ? ps_add_stream(w, pc, 1, peer, peer, PS_TAG_DATA, seq, data, bytes) : DT_OK;
}

/* Post the receive of server s's answer header to the request about to go
 * out; its data becomes a stream. */
static dt_status ps_post_answer(dt_comm *c, dt_work *w, xfers *xs, ps_call *pc, int s,
                                ps_msg *in, void *data, size_t bytes)
{
    dt_ps *ps = pc->ps;
    uint32_t seq = ps->seq[s];
    if (comm_post_via(c, w, xs, 0, ps->W + s, ps->ans_via[s], ps_tag(PS_TAG_RESP, seq, 0), in,
                      sizeof *in) != DT_OK)
        return ps_forgive(c, w, ps, s);
    return ps_add_stream(w, pc, 0, ps->W + s, ps->ans_via[s], PS_TAG_RDATA, seq, data, bytes);
}

/* Post the streams' next pieces, taking turns, while the transfer list
 * has room (a round's wait then sees them through); streams of servers
 * written off are dropped. */
static dt_status ps_pump(dt_comm *c, dt_work *w, xfers *xs, ps_call *pc)
{
    dt_ps *ps = pc->ps;
    const int room = DT_COMM_MAX_XFERS - PS_MAX_SERVERS;   /* (the rest: ps_greet_restarted's) */
    for (int more = 1; more && comm_xfers_count(xs) < room;) {
        more = 0;
        for (int i = 0; i < pc->nstreams && comm_xfers_count(xs) < room; i++) {
            ps_stream *st = &pc->streams[i];
            int s = st->peer - ps->W;
            if (st->next == st->pieces || ps->gone[s])
                continue;
            size_t len = ps_piece_len(st->bytes, ps->chunk, st->next);
            if (comm_post_via(c, w, xs, st->sending, st->peer, st->via,
                              ps_tag(st->type, st->seq, st->next),
                              st->buf + (size_t)st->next * ps->chunk, len) != DT_OK &&
                ps_forgive(c, w, ps, s) != DT_OK)
                return comm_work_status(w);
            st->next++;
            more = 1;
        }
    }
    return DT_OK;
}

/* Are pieces left to post (to servers not written off)? */
static int ps_streams_left(const ps_call *pc)
{
    for (int i = 0; i < pc->nstreams; i++)
        if (pc->streams[i].next < pc->streams[i].pieces &&
            !pc->ps->gone[pc->streams[i].peer - pc->ps->W])
            return 1;
    return 0;
}

/* The server shard j's pulls go to: the first of its servers alive. */
static int ps_reader(const dt_ps *ps, int j)
{
    return ps->L != ps->S && ps->gone[j] ? j + ps->L : j;
}

/* Post a dense request: every live server its shard's part (pushes go to
 * both servers of a replicated shard, pulls to one). */
static dt_status ps_post_dense(dt_comm *c, dt_work *w, xfers *xs, ps_call *pc, int *nout)
{
    dt_ps *ps = pc->ps;
    int64_t hi = pc->lo + pc->n, glo = pc->lo, ghi = hi < ps->G ? hi : ps->G;
    pc->nstreams = 0;
    for (int s = 0; s < ps->S; s++) {
        int j = s % ps->L;
        int64_t a = glo > ps->range[j] ? glo : ps->range[j];
        int64_t b = ghi < ps->range[j + 1] ? ghi : ps->range[j + 1];
        if (ps->gone[s] || (pc->use_only && !pc->only[s]))
            continue;
        if (pc->op == PS_FINISH) {
            if (ps_post_request(c, w, xs, pc, s, PS_FINISH, 0, 0, NULL, 0, &pc->out[(*nout)++]))
                return comm_work_status(w);
            continue;
        }
        if (pc->op == PS_PULL) {
            if (a >= b || ps_reader(ps, j) != s)
                continue;
            if (ps_post_answer(c, w, xs, pc, s, &pc->in[s], pc->buf + (a - pc->lo),
                               (size_t)(b - a) * sizeof(float)) ||
                (!ps->gone[s] &&
                 ps_post_request(c, w, xs, pc, s, PS_PULL, a, b - a, NULL, 0, &pc->out[(*nout)++])))
                return comm_work_status(w);
            pc->asked[s] = !ps->gone[s];
            continue;
        }
        /* init, push: this server's gradient keys (a compressed push: their
         * code), and every flag */
        if (pc->op == PS_CPUSH ? a < b && ps_post_request(c, w, xs, pc, s, PS_CPUSH, a, b - a,
                                                          pc->msg[j], pc->bytes[j],
                                                          &pc->out[(*nout)++])
                               : a < b && ps_post_request(c, w, xs, pc, s, pc->op, a, b - a,
                                                          pc->buf + (a - pc->lo),
                                                          (size_t)(b - a) * sizeof(float),
                                                          &pc->out[(*nout)++]))
            return comm_work_status(w);
        pc->posted[s] += a < b ? b - a : 0;
        int64_t flo = pc->lo > ps->G ? pc->lo : ps->G;
        if ((pc->op == PS_PUSH || pc->op == PS_CPUSH) && hi > flo && !ps->gone[s] &&
            ps_post_request(c, w, xs, pc, s, PS_PUSH, flo, hi - flo, pc->buf + (flo - pc->lo),
                            (size_t)(hi - flo) * sizeof(float), &pc->out[(*nout)++]))
            return comm_work_status(w);
        pc->posted[s] += (pc->op == PS_PUSH || pc->op == PS_CPUSH) && hi > flo ? hi - flo : 0;
    }
    return DT_OK;
}

/* Make pc (a push of gradients pc->buf, keys [lo, lo + n)) a compressed
 * one: each shard's part encoded on its own as `kind` (TOPK keeps `ratio`
 * of it), with error feedback when residual is given (g + residual is
 * sent, what was not stays in residual).  scratch: 2 n floats.  Returns
 * the code's bytes. */
DT_PRIVATE size_t ps_encode_push(const dt_ps *ps, ps_call *pc, int kind, double ratio,
                             float *residual, float *scratch, char *out)
{
    int64_t lo = pc->lo, hi = pc->lo + pc->n < ps->G ? pc->lo + pc->n : ps->G;
    float *g = pc->buf, *sent = residual ? residual : scratch + (hi - lo);
    size_t used = 0;
    for (int64_t i = 0; residual && i < hi - lo; i++)
        g[i] += residual[i];
    for (int j = 0; j < ps->L; j++) {
        int64_t a = lo > ps->range[j] ? lo : ps->range[j];
        int64_t b = hi < ps->range[j + 1] ? hi : ps->range[j + 1];
        pc->msg[j] = NULL;
        pc->cnt[j] = 0;
        pc->bytes[j] = 0;
        if (a >= b)
            continue;
        int64_t n = b - a, k = (int64_t)ceil(ratio * (double)n);
        k = kind != DT_COMPRESS_TOPK ? 0 : k < 1 ? 1 : k > n ? n : k;
        int64_t piece[3] = {0, n, k};
        codec_encode((dt_compress)kind, g + (a - lo), n, piece, 1, k, scratch, NULL, out + used,
                     sent + (a - lo));
        pc->msg[j] = out + used;
        pc->cnt[j] = k;
        pc->bytes[j] = codec_bytes((dt_compress)kind, n, k);
        used += (pc->bytes[j] + 7) & ~(size_t)7;
    }
    for (int64_t i = 0; residual && i < hi - lo; i++)
        residual[i] = g[i] - sent[i];
    pc->op = PS_CPUSH;
    pc->code = kind;
    return used;
}

/* Post a sparse request: each live server its shard's distinct rows. */
static dt_status ps_post_sparse(dt_comm *c, dt_work *w, xfers *xs, ps_call *pc, int *nout)
{
    dt_ps *ps = pc->ps;
    int64_t dim = ps->tabs[pc->lo].dim;
    pc->nstreams = 0;
    for (int s = 0; s < ps->S; s++) {
        int j = s % ps->L;
        int64_t k = pc->cnt[j];
        if (k == 0 || ps->gone[s] || (pc->op == PS_SPULL && ps_reader(ps, j) != s) ||
            (pc->use_only && !pc->only[s]))
            continue;
        size_t idb = (size_t)k * sizeof(int64_t), rowb = (size_t)(k * dim) * sizeof(float);
        if (pc->op == PS_SPULL &&
            ps_post_answer(c, w, xs, pc, s, &pc->in[s], pc->rows[j], rowb) != DT_OK)
            return comm_work_status(w);
        if (ps->gone[s])
            continue;
        pc->asked[s] = pc->op == PS_SPULL;
        if (ps_post_request(c, w, xs, pc, s, pc->op, pc->lo, k, pc->msg[j],
                            pc->op == PS_SPUSH ? idb + rowb : idb, &pc->out[(*nout)++]) != DT_OK)
            return comm_work_status(w);
    }
    return DT_OK;
}

/* Did a server a pull of this round was answered from die? */
static int ps_lost_reader(const dt_ps *ps, const unsigned char *before)
{
    for (int s = 0; s < ps->S; s++)
        if (ps->gone[s] == 1 && !before[s])
            return 1;
    return 0;
}

/* How long workers wait for a dead server's restart (dt_ps_config.rejoin_ms). */
static int ps_rejoin_ms(const dt_ps *ps)
{
    return ps->cfg.rejoin_ms > 0 ? ps->cfg.rejoin_ms : 60000;
}

/* The incarnation rank's latest process published (0: none restarted). */
/* The store key that fences off server `rank`'s incarnation inc, which
 * the workers wrote off while it was silent (ps_write_off_silent) */
DT_PRIVATE void ps_fence_key(char *key, size_t cap, int job, int rank, uint32_t inc)
{
    snprintf(key, cap, "ps%d/fenced/%d.%u", job, rank, inc);
}

DT_PRIVATE uint32_t ps_published_inc(dt_comm *c, int rank, int wait_ms)
{
    char key[32], val[16];
    size_t len = 0;
    snprintf(key, sizeof key, "inc/%d", rank);
    if (dt_store_get(comm_watch(c), key, val, sizeof val - 1, &len, wait_ms) != DT_OK)
        return 0;
    val[len < sizeof val ? len : sizeof val - 1] = '\0';
    return (uint32_t)strtoul(val, NULL, 10);
}

/* Where server s's answers to us come from: on shm its endpoint for us,
 * published as ps<job>/ans/<rank>.<inc>/<worker> (ps_open_answer_endpoints in
 * src/ps_server.c); a later incarnation's replaces the earlier one's.  The
 * caller holds the transport. */
static dt_status ps_answers_from(dt_ps *ps, dt_store *st, int s, uint32_t inc, char *err,
                                 size_t err_len)
{
    dt_comm *c = ps->comm;
    int rank = ps->W + s;
    if (strcmp(dt_comm_transport(c), "shm") != 0) {
        ps->ans_via[s] = rank;
        return DT_OK;
    }
    char key[64];
    unsigned char addr[512];
    size_t len = 0;
    snprintf(key, sizeof key, "ps%d/ans/%d.%u/%d", ps->job, rank, inc, dt_comm_rank(c));
    if (!st || dt_store_get(st, key, addr, sizeof addr, &len, comm_timeout_ms(c)) != DT_OK ||
        len > sizeof addr) {
        snprintf(err, err_len, "server rank %d published no endpoint for worker %d's answers "
                 "within %d ms", rank, dt_comm_rank(c), comm_timeout_ms(c));
        return DT_EPEER;
    }
    if (ps->ans_via[s] >= dt_comm_size(c))   /* its restart: the same peer number, the new address */
        return comm_tp_iface(c)->replace_peer(comm_tp(c), ps->ans_via[s], addr, len, err, err_len);
    return comm_add_endpoint(c, rank, addr, len, &ps->ans_via[s], err, err_len);
}

/* Server s (gone 2) restarted as incarnation inc: swap its addresses in
 * and say hello (our step, and how much of it its predecessor had); what
 * this call still had for its predecessor is dropped, and the request goes
 * again to the servers `only` (their part of it was lost).  The caller has
 * cancelled every transfer with the predecessor. */
static dt_status ps_greet(dt_comm *c, dt_work *w, xfers *xs, ps_call *pc, int s, uint32_t inc)
{
    dt_ps *ps = pc->ps;
    int rank = ps->W + s;
    char err[256] = "";
    if (join_replace_peer(c, rank, inc, err, sizeof err) != DT_OK ||
        ps_answers_from(ps, comm_watch(c), s, inc, err, sizeof err) != DT_OK)
        return comm_work_fail(w, DT_EPEER, "parameter server: server rank %d restarted, but: %s",
                              rank, err);
    for (int i = 0; i < pc->nstreams; i++)   /* (numbered for the predecessor) */
        if (pc->streams[i].peer == rank)
            pc->streams[i].next = pc->streams[i].pieces;
    ps->inc[s] = inc;
    ps->gone[s] = 0;
    ps->seq[s] = 0;   /* the new process numbers our requests from 0 */
    ps->st.rejoins++;
    int64_t had = ps->sent_clock[s] == pc->clock ? ps->sent[s] : 0;
    if (ps_post_request(c, w, xs, pc, s, PS_HELLO, 0, had, NULL, 0, &pc->hello[s]) != DT_OK)
        return comm_work_status(w);
    pc->only[s] = 1;
    pc->use_only = 1;
    pc->posted[s] = 0;
    pc->asked[s] = 0;
    return DT_OK;
}

/* xfers.idle while a request waits: a server awaited (gone 2) whose
 * restarted process has come is greeted now, not when the rest of the
 * request is done.  The rest may wait for it: a pull from a live server
 * waits for another worker's push, and that worker for the restarted
 * server, which serves nobody before every live worker said hello (a
 * deadlock, once until the timeout, test_ps_rejoin).  Only once the
 * predecessor's transfers were let go of, or a second after it was found
 * dead (those left are orphans, drain_gone). */
static dt_status ps_greet_restarted(dt_comm *c, dt_work *w, xfers *xs, void *arg)
{
    dt_ps *ps = arg;
    ps_call *pc = (ps_call *)comm_work_request(w);
    for (int s = 0; s < ps->S; s++) {
        if (ps->gone[s] != 2 || comm_xfers_count(xs) >= DT_COMM_MAX_XFERS)
            continue;
        int held = comm_xfers_pending_with(c, xs, ps->W + s);
        if (held && dt_now() - ps->down_since[s] < 1.0)
            continue;
        uint32_t inc = ps_published_inc(c, ps->W + s, 1);
        if (inc > ps->inc[s] && ps_greet(c, w, xs, pc, s, inc) != DT_OK)
            return comm_work_status(w);
    }
    return DT_OK;
}

/* Servers still awaited (gone 2) once the rest of the request is done:
 * wait until a restarted process of each has rejoined (src/join.c), and
 * greet it (ps_greet). */
static dt_status ps_await_rejoins(dt_comm *c, dt_work *w, xfers *xs, ps_call *pc)
{
    dt_ps *ps = pc->ps;
    for (int s = 0; s < ps->S; s++) {
        if (ps->gone[s] != 2)
            continue;
        int rank = ps->W + s;
        uint32_t inc;
        while ((inc = ps_published_inc(c, rank, 200)) <= ps->inc[s]) {
            if (dt_now() - ps->down_since[s] > ps_rejoin_ms(ps) / 1000.0)
                return comm_work_fail(w, DT_EPEER, "parameter server: server rank %d died and no "
                                      "restarted process rejoined within %d ms (dt_ps_config.rejoin_ms)",
                                      rank, ps_rejoin_ms(ps));
            comm_tp_wait(c, 50);   /* (the key may hold an older restart's number) */
        }
        if (ps_greet(c, w, xs, pc, s, inc) != DT_OK)
            return comm_work_status(w);
    }
    return DT_OK;
}

/* A push went out whole: what each server now has of this step. */
static void ps_note_sent(dt_ps *ps, const ps_call *pc)
{
    for (int s = 0; (pc->op == PS_PUSH || pc->op == PS_CPUSH) && s < ps->S; s++) {
        if (!pc->posted[s])
            continue;
        if (ps->sent_clock[s] != pc->clock) {
            ps->sent_clock[s] = pc->clock;
            ps->sent[s] = 0;
        }
        ps->sent[s] += pc->posted[s];
    }
}

/* The comm thread runs a worker's request: split over the servers, post,
 * wait (within the communicator's timeout), check the answers; a sparse
 * pull's rows go where the caller asked.  Replicated: a server found dead
 * is written off, and a pull that was asking it asks again (pulls are
 * idempotent; pushes already went to both servers of the shard).  A dead
 * server without a twin is waited for and asked again. */
static dt_status ps_run_call(dt_comm *c, dt_work *w, xfers **xsp)
{
    xfers *xs = *xsp;
    ps_call *pc = (ps_call *)comm_work_request(w);
    dt_ps *ps = pc->ps;
    int nout = 0, sparse = pc->op == PS_SPUSH || pc->op == PS_SPULL;
    int pull = pc->op == PS_PULL || pc->op == PS_SPULL;
    if (ps->S > PS_MAX_SERVERS)
        return comm_work_fail(w, DT_ENOTSUP, "parameter server: at most %d servers in this build",
                              PS_MAX_SERVERS);
    comm_xfers_survive(xs, ps->gone, ps->W, ps->S, ps_write_off, ps_greet_restarted, ps);
    memset(pc->asked, 0, sizeof pc->asked);
    memset(pc->posted, 0, sizeof pc->posted);
    pc->use_only = 0;
    unsigned char before[PS_MAX_SERVERS];   /* the servers gone when the pulls went out */
    memcpy(before, ps->gone, (size_t)ps->S);
    for (int round = 0, lost = 0;; round++) {
        nout = 0;
        if ((sparse ? ps_post_sparse : ps_post_dense)(c, w, xs, pc, &nout) != DT_OK)
            return comm_work_status(w);
        pc->use_only = 0;   /* (set again by the greetings of restarted servers: ps_greet) */
        memset(pc->only, 0, sizeof pc->only);
        do {   /* the data's pieces, as many at a time as the transfer list holds */
            if (ps_pump(c, w, xs, pc) != DT_OK)
                return comm_work_status(w);
            /* a BSP pull waits for the slowest worker, and so may a parked push: the
             * server drops a silent worker after 1x, so we must outlast that */
            comm_xfers_set_patience(xs, 2.0);
            if (comm_wait_xfers(c, w, xs) != DT_OK)
                return comm_work_status(w);
            if (comm_xfers_orphans(xs)) {
                if (comm_xfers_renew(c, w, xsp) != DT_OK)
                    return comm_work_status(w);
                xs = *xsp;
            }
        } while (ps_streams_left(pc));
        if (ps_await_rejoins(c, w, xs, pc) != DT_OK)
            return comm_work_status(w);
        if (pc->use_only) {
            if (round > 16 * ps->S)
                return comm_work_fail(w, DT_EPEER, "parameter server: servers keep dying");
            continue;
        }
        if (!pull || !ps_lost_reader(ps, before))
            break;
        if (++lost > ps->S)
            return comm_work_fail(w, DT_EPEER, "parameter server: every server of a shard died");
        memset(pc->asked, 0, sizeof pc->asked);   /* every pull goes again */
        memcpy(before, ps->gone, (size_t)ps->S);
    }
    for (int s = 0; s < ps->S; s++) {
        if (!pc->asked[s])
            continue;
        if (ps_answer_check(w, &pc->in[s]) != DT_OK)
            return comm_work_status(w);
        pc->stale = pc->in[s].clock > pc->stale ? pc->in[s].clock : pc->stale;
    }
    ps_note_sent(ps, pc);
    if (pc->op == PS_SPULL) {
        int64_t dim = ps->tabs[pc->lo].dim;
        for (int64_t i = 0; i < pc->n; i++)
            memcpy(pc->buf + i * dim, pc->rows[pc->where[i] % 8] + (pc->where[i] / 8) * dim,
                   (size_t)dim * sizeof(float));
    }
    return DT_OK;
}

/* What a server's answer header says: DT_OK, or its refusal (a status in
 * range, with the server's text), or that it is malformed; in w.  in->err
 * is terminated here (a peer's text).  tests/fuzz/fuzz_ps.c drives it. */
DT_PRIVATE dt_status ps_answer_check(dt_work *w, ps_msg *in)
{
    in->err[sizeof in->err - 1] = '\0';
    if (in->magic != PS_MAGIC || in->status < DT_OK || in->status > DT_EPEER ||
        (in->status != DT_OK && !in->err[0]))
        return comm_work_fail(w, DT_EPEER, "parameter server: a server sent a malformed answer");
    if (in->status != DT_OK)
        return comm_work_fail(w, (dt_status)in->status, "parameter server: %s", in->err);
    return DT_OK;
}

/* A worker's request stalls: is one of the servers dead? */
static dt_status ps_check_servers(dt_comm *c, dt_work *w)
{
    const ps_call *pc = comm_work_request(w);
    dt_ps *ps = pc->ps;
    for (int s = 0; s < ps->S; s++) {
        char key[32], val[16];
        size_t len = 0;
        if (ps->gone[s])
            continue;
        store_dead_key(key, sizeof key, ps->W + s, ps->inc[s]);
        char fence[48];   /* written off by another worker while silent (ps_write_off_silent) */
        ps_fence_key(fence, sizeof fence, ps->job, ps->W + s, ps->inc[s]);
        if (dt_store_get(comm_watch(c), key, val, sizeof val, &len, 1) != DT_OK &&
            dt_store_get(comm_watch(c), fence, val, sizeof val, &len, 1) != DT_OK)
            continue;
        if (!ps_write_off_server(c, ps, s, 1))   /* a twin serves on, or a restart is awaited */
            return comm_work_fail(w, DT_EPEER, "parameter server: server rank %d died", ps->W + s);
    }
    return DT_OK;
}

/* comm_ext_ops.run: one request, then its record for the profiler
 * (prof_coll reads what it was and how stale a pull's answer came) */
static dt_status ps_run(dt_comm *c, dt_work *w, xfers **xsp)
{
    const ps_call *pc = comm_work_request(w);
    dt_status s = ps_run_call(c, w, xsp);
    comm_work_record_ext(w, pc->op, pc->op == PS_PULL || pc->op == PS_SPULL ? pc->stale : -1);
    return s;
}

/* comm_ext_ops.write_off_silent: server `rank` is silent (stopped, hung,
 * cut off: no heartbeat for the timeout) while this request waits on it.
 * A live twin serves for it as for a dead one; without one the request
 * fails (a restarted process cannot take a living one's place). */
static int ps_write_off_silent(dt_comm *c, dt_work *w, int rank)
{
    dt_ps *ps = ((const ps_call *)comm_work_request(w))->ps;
    int s = rank - ps->W;
    if (s < 0 || s >= ps->S)
        return 0;
    if (ps->gone[s])
        return 1;   /* written off already, this very check (ps_check_servers) */
    if (ps->L == ps->S || ps->gone[(s + ps->L) % ps->S])
        return 0;
    /* Fenced for good, for every worker: one that still pulled from it
     * would read a state the others no longer push to (ps_check_servers
     * reads the fence, and the server stops when it wakes: ps_watch). */
    char key[48];
    ps_fence_key(key, sizeof key, ps->job, rank, ps->inc[s]);
    if (dt_store_set(comm_watch(c), key, "1", 2) != DT_OK)
        return 0;
    ps->gone[s] = 1;
    ps->down_since[s] = dt_now();
    return 1;
}

static const comm_ext_ops ps_comm_ops = {.run = ps_run, .check_dead = ps_check_servers,
                                         .write_off_silent = ps_write_off_silent};

/* A pull's answer was this many steps stale: the worker's statistics. */
static void ps_note_stale(dt_ps *ps, int64_t stale)
{
    ps->stale_sum += (double)stale;
    ps->stale_n++;
    if (stale > ps->st.max_staleness)
        ps->st.max_staleness = stale;
}

static dt_status ps_call_run(dt_ps *ps, int op, int64_t lo, int64_t n, float *buf)
{
    ps_call pc = {.ps = ps, .op = op, .lo = lo, .n = n, .buf = buf, .clock = ps->clock};
    dt_work *w = comm_enqueue_in(ps->comm, COLL_EXT, buf, NULL, n, 0, DT_REDUCE_SUM, &pc);
    dt_status s = w ? dt_work_wait(w) : ps->ctx->last_status;
    if (s == DT_OK && op == PS_PULL)
        ps_note_stale(ps, pc.stale);
    if (s == DT_OK && op == PS_PULL && ps->cfg.mode == DT_PS_BSP && !ps->cfg.prefetch) {
        int v = 0;   /* BSP: the step just applied everywhere; its verdict (ps_count_votes) */
        for (int k = 0; k < ps->S; k++)
            v = pc.in[k].vote > v ? pc.in[k].vote : v;
        preempt_take(ps->ctx, v);
    }
    return s;
}

/* Pack every parameter's gradient (zeros where absent) and used flag into
 * stage, in the flat layout. */
static void ps_pack_grads(dt_ps *ps, float *stage)
{
    dt_ctx *ctx = ps->ctx;
    for (int i = 0; i < ps->nparams; i++) {
        dt_tensor *g = ctx->params[i]->grad;
        int used = g && !(g->flags & T_ZERO);
        if (used)
            be_to_host(ctx, stage + ps->offset[i], g->data, (size_t)ps->numel[i] * 4);
        else
            memset(stage + ps->offset[i], 0, (size_t)ps->numel[i] * sizeof(float));
        stage[ps->G + i] = used ? 1.0f : 0.0f;
    }
}

static void ps_unpack_params(dt_ps *ps, const float *stage)
{
    dt_ctx *ctx = ps->ctx;
    for (int i = 0; i < ps->nparams; i++)
        be_to_device(ctx, ctx->params[i]->data, stage + ps->offset[i],
                     (size_t)ps->numel[i] * sizeof(float));
}

static int ps_worker_ok(dt_ps *ps, const char *what)
{
    if (!ps)
        return 0;
    if (ps->server >= 0) {
        set_error(ps->ctx, DT_ESTATE, "%s: rank %d is a server (dt_ps_serve)", what, dt_comm_rank(ps->comm));
        return 0;
    }
    return 1;
}

dt_status dt_ps_pull(dt_ps *ps)
{
    if (!ps_worker_ok(ps, "ps_pull"))
        return ps ? DT_ESTATE : DT_EINVAL;
    double t0 = dt_now();
    dt_status s = ps_call_run(ps, PS_PULL, 0, ps->G, ps->stage);
    ps->st.wait_s += dt_now() - t0;
    if (s != DT_OK)
        return s;
    ps->st.pulls++;
    ps_unpack_params(ps, ps->stage);
    return DT_OK;
}

/* A step's parameters.  With prefetch, those of the pull started after the
 * previous step's push (the step computes while this step's pull runs in
 * the background, one step stale); else pulled now. */
DT_PRIVATE dt_status ps_step_pull(dt_ps *ps)
{
    if (!ps->cfg.prefetch)
        return dt_ps_pull(ps);
    if (ps->prefetch) {
        double t0 = dt_now();
        dt_status s = dt_work_wait(ps->prefetch);
        ps->prefetch = NULL;
        ps->st.wait_s += dt_now() - t0;
        if (s != DT_OK)
            return s;
        ps->st.pulls++;
        ps_note_stale(ps, ps->prefetch_call.stale);
        ps_unpack_params(ps, ps->stage2);
    }
    ps->prefetch_call = (ps_call){.ps = ps, .op = PS_PULL, .lo = 0, .n = ps->G, .buf = ps->stage2,
                                  .clock = ps->clock};
    ps->prefetch = comm_enqueue_in(ps->comm, COLL_EXT, ps->stage2, NULL, ps->G, 0, DT_REDUCE_SUM,
                                   &ps->prefetch_call);
    return ps->prefetch ? DT_OK : ps->ctx->last_status;
}

/* Wait out a prefetch; `keep`: its weights (the servers' last) go into the
 * model, so a worker ends with every update. */
static dt_status ps_end_prefetch(dt_ps *ps, int keep)
{
    dt_status s = ps->prefetch ? dt_work_wait(ps->prefetch) : DT_OK;
    if (ps->prefetch && s == DT_OK && keep) {
        ps->st.pulls++;
        ps_unpack_params(ps, ps->stage2);
    }
    ps->prefetch = NULL;
    return s;
}

DT_PRIVATE int64_t ps_clock(const dt_ps *ps) { return ps->clock; }

/* A step's pushes all went out (DDP's buckets, or push_pull's one). */
DT_PRIVATE void ps_pushed(dt_ps *ps, int requests)
{
    ps->st.pushes += requests;
    ps->st.steps++;
    ps->clock++;
}

dt_status dt_ps_push(dt_ps *ps)
{
    if (!ps_worker_ok(ps, "ps_push"))
        return ps ? DT_ESTATE : DT_EINVAL;
    ps_pack_grads(ps, ps->stage);
    dt_status s = ps_call_run(ps, PS_PUSH, 0, ps->G + ps->P, ps->stage);
    if (s == DT_OK)
        ps_pushed(ps, 1);
    return s;
}

dt_status dt_ps_push_pull(dt_ps *ps)
{
    if (!ps_worker_ok(ps, "ps_push_pull"))
        return ps ? DT_ESTATE : DT_EINVAL;
    dt_status s = dt_ps_push(ps);
    return s != DT_OK ? s : ps_step_pull(ps);
}

dt_status dt_ps_finish(dt_ps *ps)
{
    if (!ps_worker_ok(ps, "ps_finish"))
        return ps ? DT_ESTATE : DT_EINVAL;
    dt_status s = ps_end_prefetch(ps, 1);
    if (s != DT_OK)
        return s;
    s = ps_call_run(ps, PS_FINISH, 0, 0, NULL);
    ps->finished = s == DT_OK;
    if (s == DT_OK) {   /* a server restarted later must not wait for our hello */
        char key[64];
        snprintf(key, sizeof key, "ps%d/done/%d", ps->job, dt_comm_rank(ps->comm));
        s = dt_store_set(join_store(ps->comm), key, "1", 2);
    }
    return s;
}

static int ps_idpos_cmp(const void *a, const void *b)
{
    const ps_idpos *x = a, *y = b;
    return x->id != y->id ? (x->id < y->id ? -1 : 1) : (x->pos > y->pos) - (x->pos < y->pos);
}

/* One block holding the call and everything it sends and receives; the
 * caller frees it (host_free) once the call is done. */
static ps_call *ps_sparse_prepare(dt_ps *ps, const char *what, int op, int table,
                                  const int64_t *ids, int64_t n, const float *grads, float *out)
{
    dt_ctx *ctx = ps->ctx;
    if (!ps_worker_ok(ps, what))
        return NULL;
    if (table < 0 || table >= ps->ntables || n < 0 || (n > 0 && (!ids || (!grads && !out)))) {
        set_error(ctx, DT_EINVAL, "%s: table %d of %d, %lld ids at %p", what, table, ps->ntables,
                  (long long)n, (const void *)ids);
        return NULL;
    }
    const ps_tab *tb = &ps->tabs[table];
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= tb->rows) {
            set_error(ctx, DT_EINVAL, "%s: id %lld (entry %lld) is not a row of table '%s' "
                      "(%lld rows)", what, (long long)ids[i], (long long)i, tb->name,
                      (long long)tb->rows);
            return NULL;
        }
    ps_idpos *ip = host_alloc(ctx, sizeof *ip * (size_t)(n > 0 ? n : 1));
    if (!ip) {
        set_error(ctx, DT_ENOMEM, "%s: out of memory for %lld ids", what, (long long)n);
        return NULL;
    }
    for (int64_t i = 0; i < n; i++)
        ip[i] = (ps_idpos){ids[i], i};
    qsort(ip, (size_t)n, sizeof *ip, ps_idpos_cmp);
    int64_t cnt[PS_MAX_SERVERS] = {0}, S = ps->L, dim = tb->dim;
    for (int64_t i = 0; i < n; i++)
        if (i == 0 || ip[i].id != ip[i - 1].id)
            cnt[ip[i].id % S]++;
    /* the block: the call, each server's message (and answer rows), where[] */
    size_t bytes = sizeof(ps_call), at[PS_MAX_SERVERS], rat[PS_MAX_SERVERS];
    for (int s = 0; s < S; s++) {   /* (s: a shard; every part 8-byte aligned) */
        at[s] = bytes = (bytes + 7) & ~(size_t)7;
        bytes += (size_t)cnt[s] * (sizeof(int64_t) + (op == PS_SPUSH ? (size_t)dim * 4 : 0));
        rat[s] = bytes;
        bytes += op == PS_SPULL ? (size_t)(cnt[s] * dim) * sizeof(float) : 0;
    }
    size_t wat = bytes = (bytes + 7) & ~(size_t)7;
    bytes += op == PS_SPULL ? (size_t)n * sizeof(int64_t) : 0;
    char *blk = host_calloc(ctx, bytes);
    if (!blk) {
        host_free(ctx, ip);
        set_error(ctx, DT_ENOMEM, "%s: out of memory for %lld ids", what, (long long)n);
        return NULL;
    }
    ps_call *pc = (ps_call *)blk;
    *pc = (ps_call){.ps = ps, .op = op, .lo = table, .n = n, .buf = out, .clock = ps->clock,
                    .where = op == PS_SPULL ? (int64_t *)(blk + wat) : NULL};
    for (int s = 0; s < S; s++) {
        pc->msg[s] = blk + at[s];
        pc->rows[s] = (float *)(blk + rat[s]);
    }
    int64_t k[PS_MAX_SERVERS] = {0};
    for (int64_t i = 0; i < n; i++) {
        int s = (int)(ip[i].id % S);
        int fresh = i == 0 || ip[i].id != ip[i - 1].id;
        if (fresh)
            ((int64_t *)pc->msg[s])[k[s]++] = ip[i].id / S;
        int64_t row = k[s] - 1;
        if (op == PS_SPULL) {
            pc->where[ip[i].pos] = row * 8 + s;
            continue;
        }
        float *g = (float *)((int64_t *)pc->msg[s] + cnt[s]) + row * dim;
        const float *src = grads + ip[i].pos * dim;
        for (int64_t j = 0; j < dim; j++)
            g[j] = fresh ? src[j] : g[j] + src[j];
    }
    memcpy(pc->cnt, cnt, sizeof cnt);
    host_free(ctx, ip);
    return pc;
}

static int64_t ps_rows_in(const ps_call *pc)
{
    int64_t rows = 0;
    for (int s = 0; s < pc->ps->L; s++)
        rows += pc->cnt[s];
    return rows;
}

dt_status dt_ps_sparse_push(dt_ps *ps, int table, const int64_t *ids, int64_t n, const float *grads)
{
    if (!ps)
        return DT_EINVAL;
    ps_call *pc = ps_sparse_prepare(ps, "ps_sparse_push", PS_SPUSH, table, ids, n, grads, NULL);
    if (!pc)
        return ps->ctx->last_status;
    dt_work *w = comm_enqueue_in(ps->comm, COLL_EXT, NULL, NULL, n, 0, DT_REDUCE_SUM, pc);
    dt_status s = w ? dt_work_wait(w) : ps->ctx->last_status;
    if (s == DT_OK)
        ps->st.rows_pushed += ps_rows_in(pc);
    host_free(ps->ctx, pc);
    return s;
}

dt_work *dt_ps_sparse_pull_async(dt_ps *ps, int table, const int64_t *ids, int64_t n,
                                 float *rows_out)
{
    if (!ps)
        return NULL;
    ps_call *pc = ps_sparse_prepare(ps, "ps_sparse_pull", PS_SPULL, table, ids, n, NULL, rows_out);
    if (!pc)
        return NULL;
    dt_work *w = comm_enqueue_in(ps->comm, COLL_EXT, rows_out, NULL, n, 0, DT_REDUCE_SUM, pc);
    if (!w) {
        host_free(ps->ctx, pc);
        return NULL;
    }
    comm_work_own(w, pc);   /* freed by dt_work_wait */
    ps->st.pulls++;
    ps->st.rows_pulled += ps_rows_in(pc);
    return w;
}

dt_status dt_ps_sparse_pull(dt_ps *ps, int table, const int64_t *ids, int64_t n, float *rows_out)
{
    double t0 = dt_now();
    dt_work *w = dt_ps_sparse_pull_async(ps, table, ids, n, rows_out);
    dt_status s = w ? dt_work_wait(w) : ps ? ps->ctx->last_status : DT_EINVAL;
    if (ps)
        ps->st.wait_s += dt_now() - t0;
    return s;
}

/* --- joining and leaving ---------------------------------------------- */

static dt_status ps_settings(dt_ctx *ctx, dt_comm *c, dt_ps_config *cfg, int *W, int *S)
{
    const char *e = getenv("DTRAIN_NUM_SERVERS");
    if (cfg->servers <= 0)
        cfg->servers = e && atoi(e) > 0 ? atoi(e) : 1;
    const char *m = getenv("DTRAIN_PS_MODE");
    if (cfg->mode == DT_PS_MODE_AUTO) {   /* unset: the environment's, else BSP */
        cfg->mode = DT_PS_BSP;
        if (m && *m && !strcmp(m, "asp"))
            cfg->mode = DT_PS_ASP;
        else if (m && *m && !strcmp(m, "ssp"))
            cfg->mode = DT_PS_SSP;
        else if (m && *m && strcmp(m, "bsp"))
            return set_error(ctx, DT_EINVAL, "ps_new: DTRAIN_PS_MODE='%s' is not bsp, asp or ssp", m);
    }
    const char *st = getenv("DTRAIN_PS_STALENESS");
    if (cfg->staleness < 0 && cfg->staleness != -1)
        return set_error(ctx, DT_EINVAL, "ps_new: staleness %d: need >= 0 (or -1: unset)",
                         cfg->staleness);
    if (cfg->staleness == -1)
        cfg->staleness = st && *st && atoi(st) > 0 ? atoi(st) : 0;
    const char *ch = getenv("DTRAIN_PS_CHUNK");
    if (cfg->chunk_bytes == 0 && ch && *ch) {
        char *end;
        unsigned long long v = strtoull(ch, &end, 10);
        if (*end || ch[0] == '-')
            return set_error(ctx, DT_EINVAL, "ps_new: DTRAIN_PS_CHUNK='%s' is not a byte count", ch);
        cfg->chunk_bytes = (size_t)v;
    }
    if (cfg->chunk_bytes != 0 && cfg->chunk_bytes < PS_MIN_CHUNK)
        return set_error(ctx, DT_EINVAL, "ps_new: chunk_bytes %zu is below %zu", cfg->chunk_bytes,
                         PS_MIN_CHUNK);
    if (cfg->mode < DT_PS_BSP || cfg->mode > DT_PS_SSP || cfg->staleness < 0)
        return set_error(ctx, DT_EINVAL, "ps_new: mode %d, staleness %d: need a dt_ps_mode and "
                         "staleness >= 0", (int)cfg->mode, cfg->staleness);
    *S = cfg->servers;
    *W = dt_comm_size(c) - *S;
    if (cfg->replicate && (*S < 2 || *S % 2))
        return set_error(ctx, DT_EINVAL, "ps_new: replication pairs the servers: %d servers is not "
                         "an even number >= 2", *S);
    if (*W < 1 || *S > 8)
        return set_error(ctx, *S > 8 ? DT_ENOTSUP : DT_EINVAL, "ps_new: %d servers among %d ranks: "
                         "need at least one worker and at most 8 servers", *S, dt_comm_size(c));
    return DT_OK;
}

/* The first line where two layouts differ, for the error. */
static void ps_first_difference(const char *a, const char *b, char *out, size_t cap)
{
    int line = 0;
    while (*a && *b) {
        const char *ea = strchr(a, '\n'), *eb = strchr(b, '\n');
        if (!ea || !eb || ea - a != eb - b || memcmp(a, b, (size_t)(ea - a)) != 0)
            break;
        a = ea + 1;
        b = eb + 1;
        line++;
    }
    int la = (int)strcspn(a, "\n"), lb = (int)strcspn(b, "\n");
    snprintf(out, cap, "model line %d is '%.*s' here but '%.*s' on worker 0", line + 1,
             la > 80 ? 80 : la, *a ? a : "(none)", lb > 80 ? 80 : lb, *b ? b : "(none)");
}

/* The pieces our messages travel in (dt_ps_config.chunk_bytes, checked
 * by ps_settings): by default the transport's limit, or on shm, where a
 * death must not stop the job, its inject size (18, "Pieces"). */
static void ps_choose_chunk(dt_ps *ps)
{
    dt_comm *c = ps->comm;
    size_t chunk = ps->cfg.chunk_bytes;
    if (chunk == 0)
        chunk = !strcmp(dt_comm_transport(c), "shm") && (ps->cfg.replicate || ps->cfg.checkpoint_dir)
                    ? PS_SHM_CHUNK : comm_max_msg(c);
    chunk = chunk < comm_max_msg(c) ? chunk : comm_max_msg(c);
    ps->chunk = chunk < UINT32_MAX ? chunk : (size_t)1 << 31;   /* (the header's field) */
}

static dt_status ps_join_worker(dt_ps *ps, int job)
{
    dt_ctx *ctx = ps->ctx;
    dt_comm *c = ps->comm;
    char key[64];
    if (ctx->n_params < 1)
        return set_error(ctx, DT_EINVAL, "ps_new: worker %d has no parameters (a step is "
                         "counted by its dense push)", dt_comm_rank(c));
    ps->layout = ps_describe(ctx, &ps->cfg);
    if (!ps->layout)
        return ctx->last_status;
    snprintf(key, sizeof key, "ps%d/layout/%d", job, dt_comm_rank(c));
    dt_status s = dt_store_set(join_store(c), key, ps->layout, strlen(ps->layout) + 1);
    if (s == DT_OK && dt_comm_rank(c) != 0) {
        size_t len = 0;
        char *ref = host_alloc(ctx, DT_STORE_MAX_VALUE);
        snprintf(key, sizeof key, "ps%d/layout/0", job);
        s = ref ? dt_store_get(join_store(c), key, ref, DT_STORE_MAX_VALUE - 1, &len, comm_timeout_ms(c))
                : set_error(ctx, DT_ENOMEM, "ps_new: out of memory");
        if (s == DT_OK) {
            ref[len < DT_STORE_MAX_VALUE ? len : DT_STORE_MAX_VALUE - 1] = '\0';
            if (strcmp(ref, ps->layout) != 0) {
                char diff[240];
                ps_first_difference(ps->layout, ref, diff, sizeof diff);
                s = set_error(ctx, DT_EMISMATCH, "ps_new: worker %d's model differs from worker "
                              "0's: %s", dt_comm_rank(c), diff);
            }
        }
        host_free(ctx, ref);
    }
    if (s == DT_OK)
        s = ps_plan(ps, ps->layout);
    for (int i = 0; s == DT_OK && i < ps->nparams; i++)   /* e.g. a newline in a name */
        if (i >= ctx->n_params || ps->numel[i] != dt_tensor_numel(ctx->params[i]))
            s = set_error(ctx, DT_EINVAL, "ps_new: parameter %d's name cannot be carried in the "
                          "layout (no newlines, please)", i);
    if (s == DT_OK && ps->nparams != ctx->n_params)
        s = set_error(ctx, DT_EINVAL, "ps_new: a parameter name holds a newline");
    if (s != DT_OK)
        return s;
    ps_choose_chunk(ps);
    ps->seq = host_calloc(ctx, sizeof(uint32_t) * (size_t)ps->S);
    ps->gone = host_calloc(ctx, (size_t)ps->S);
    ps->inc = host_calloc(ctx, sizeof(uint32_t) * (size_t)ps->S);
    ps->down_since = host_calloc(ctx, sizeof(double) * (size_t)ps->S);
    ps->sent = host_calloc(ctx, sizeof(int64_t) * (size_t)ps->S);
    ps->sent_clock = host_calloc(ctx, sizeof(int64_t) * (size_t)ps->S);
    ps->stage = host_alloc(ctx, sizeof(float) * (size_t)(ps->G + ps->P + 1));
    if (ps->cfg.prefetch)
        ps->stage2 = host_alloc(ctx, sizeof(float) * (size_t)(ps->G + 1));
    if (!ps->seq || !ps->gone || !ps->inc || !ps->down_since || !ps->sent || !ps->sent_clock ||
        !ps->stage || (ps->cfg.prefetch && !ps->stage2))
        return set_error(ctx, DT_ENOMEM, "ps_new: out of memory for %lld floats",
                         (long long)(ps->G + ps->P));
    if (preempt_set_via_ps(ctx, 1) != DT_OK)   /* the servers count the pre-emption vote */
        return ctx->last_status;
    char why[DT_MAX_ERROR], err[256] = "";
    if (comm_take_transport(c, why, sizeof why) != DT_OK)
        return set_error(ctx, DT_ESTATE, "ps_new: communicator failed earlier: %s", why);
    for (int k = 0; s == DT_OK && k < ps->S; k++)
        if ((s = ps_answers_from(ps, join_store(c), k, 0, err, sizeof err)) != DT_OK)
            s = set_error(ctx, s, "ps_new: %s", err);
    comm_release_transport(c);
    if (s != DT_OK)
        return s;
    if (dt_comm_rank(c) == 0) {   /* our values are where everyone starts */
        for (int i = 0; i < ps->nparams; i++)
            be_to_host(ctx, ps->stage + ps->offset[i], ctx->params[i]->data,
                       (size_t)ps->numel[i] * sizeof(float));
        if ((s = ps_call_run(ps, PS_INIT, 0, ps->G, ps->stage)) != DT_OK)
            return s;
    }
    return dt_ps_pull(ps);
}

static dt_status ps_join_server(dt_ps *ps, int job)
{
    dt_ctx *ctx = ps->ctx;
    char key[64];
    size_t len = 0;
    ps->layout = host_alloc(ctx, DT_STORE_MAX_VALUE);
    if (!ps->layout)
        return set_error(ctx, DT_ENOMEM, "ps_new: out of memory");
    snprintf(key, sizeof key, "ps%d/layout/0", job);
    dt_status s = dt_store_get(join_store(ps->comm), key, ps->layout, DT_STORE_MAX_VALUE - 1, &len,
                               comm_timeout_ms(ps->comm));
    if (s != DT_OK)
        return s;
    ps->layout[len < DT_STORE_MAX_VALUE ? len : DT_STORE_MAX_VALUE - 1] = '\0';
    if ((s = ps_plan(ps, ps->layout)) != DT_OK)
        return s;
    if ((s = ps_make_pieces(ps)) != DT_OK)
        return s;
    return ps_open_answer_endpoints(ps);
}

dt_ps *dt_ps_new(dt_ctx *ctx, dt_comm *c, const dt_ps_config *cfg)
{
    if (!ctx_ok(ctx))
        return NULL;
    if (!c || comm_ctx(c) != ctx) {
        set_error(ctx, DT_EINVAL, "ps_new: %s", c ? "the communicator belongs to another context"
                                                  : "communicator is NULL");
        return NULL;
    }
    dt_ps_config conf;
    dt_ps_config_init(&conf);
    if (cfg && ctx_config_in(ctx, &conf, sizeof conf, cfg, "ps_new", "dt_ps_config") != DT_OK)
        return NULL;
    conf.optim.struct_size = sizeof conf.optim;   /* embedded: read whole (dtrain.h) */
    int W = 0, S = 0;
    if (ps_settings(ctx, c, &conf, &W, &S) != DT_OK)
        return NULL;
    dt_ps *ps = host_calloc(ctx, sizeof *ps);
    if (!ps) {
        set_error(ctx, DT_ENOMEM, "ps_new: out of memory");
        return NULL;
    }
    int job = comm_attach_ext(c, &ps_comm_ops);   /* before any request reaches the comm thread */
    int L = conf.replicate ? S / 2 : S;
    *ps = (dt_ps){.ctx = ctx, .comm = c, .cfg = conf, .W = W, .S = S, .job = job, .L = L,
                  .server = dt_comm_rank(c) >= W ? dt_comm_rank(c) - W : -1,
                  .shard = dt_comm_rank(c) >= W ? (dt_comm_rank(c) - W) % L : -1};
    dt_status s = DT_OK;
    if (comm_incarnation(c) && (ps->server < 0 || conf.replicate))   /* only a server restarts */
        s = set_error(ctx, DT_ENOTSUP, "ps_new: rank %d is a restarted process; only a server "
                      "without a replica can rejoin a running job (%s)", dt_comm_rank(c),
                      ps->server < 0 ? "a worker's restart is not supported"
                                     : "its twin serves on in its place");
    else
        s = ps->server >= 0 ? ps_join_server(ps, job) : ps_join_worker(ps, job);
    ps->cfg.tables = NULL;   /* borrowed until now */
    ps->cfg.checkpoint_dir = NULL;
    if (s != DT_OK) {
        dt_ps_free(ps);
        return NULL;
    }
    return ps;
}

void dt_ps_free(dt_ps *ps)
{
    if (!ps)
        return;
    dt_ctx *ctx = ps->ctx;
    ps_end_prefetch(ps, 0);
    if (ps->server < 0 && !ps->finished) {   /* (also a worker whose dt_ps_new failed) */
        char key[64];
        snprintf(key, sizeof key, "ps%d/gone/%d", ps->job, dt_comm_rank(ps->comm));
        dt_store_set(join_store(ps->comm), key, "1", 2);
    }
    ps_close_answer_endpoints(ps);   /* (dt_ps_serve closed them, unless it never ran) */
    if (ps->server < 0)
        (void)preempt_set_via_ps(ctx, 0);   /* (never fails: it makes nothing) */
    for (int w = 0; ps->peers && w < ps->W; w++) {
        host_free(ctx, ps->peers[w].push);
        host_free(ctx, ps->peers[w].sdata);
        ps_free_held(ps, &ps->peers[w]);
    }
    for (int t = 0; ps->tabs && t < ps->ntables; t++) {
        ps_tab *tb = &ps->tabs[t];
        if (tb->w)
            tensor_destroy(ps->sctx, tb->w);
        if (tb->steps_t)
            tensor_destroy(ps->sctx, tb->steps_t);
        for (int j = 0; j < 2; j++)
            if (tb->state[j])
                tensor_destroy(ps->sctx, tb->state[j]);
        host_free(ctx, tb->name);
        host_free(ctx, tb->acc);
        host_free(ctx, tb->slot);
        host_free(ctx, tb->touched);
    }
    host_free(ctx, ps->tabs);
    while (ps->replies) {   /* sends still pending belong to a transport being closed */
        ps_reply *r = ps->replies;
        ps->replies = r->next;
        host_free(ctx, r->data);
        host_free(ctx, r);
    }
    while (ps->waits) {
        ps_wait *q = ps->waits;
        ps->waits = q->next;
        host_free(ctx, q->ids);
        host_free(ctx, q);
    }
    dt_optim_free(ps->opt);
    if (ps->sctx)
        ctx_set_ckpt_extra(ps->sctx, NULL, 0);
    host_free(ctx, ps->ckpt_tables);
    dt_ctx_free(ps->sctx);
    host_free(ctx, ps->ckpt_path);
    host_free(ctx, ps->peers);
    host_free(ctx, ps->sum);
    host_free(ctx, ps->piece);
    host_free(ctx, ps->piece_lo);
    host_free(ctx, ps->piece_param);
    host_free(ctx, ps->numel);
    host_free(ctx, ps->offset);
    host_free(ctx, ps->range);
    host_free(ctx, ps->layout);
    host_free(ctx, ps->seq);
    host_free(ctx, ps->gone);
    host_free(ctx, ps->inc);
    host_free(ctx, ps->down_since);
    host_free(ctx, ps->sent);
    host_free(ctx, ps->sent_clock);
    host_free(ctx, ps->stage);
    host_free(ctx, ps->stage2);
    host_free(ctx, ps);
}
