#include "internal.h"

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
 * kind COLL_PS, like a bucket's allreduce; a server runs dt_ps_serve on
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

#define PS_MAGIC 0x44545053u
static const char *const ps_op_names[] = {"?", "init", "push", "pull", "finish", "sparse push",
                                          "sparse pull", "hello", "compressed push"};

/* Bits 52-63 all ones, 48-51 the type, 24-47 the piece, 0-23 the request's
 * number (it wraps; a pair never has 2^24 requests in flight). */
static uint64_t ps_tag(int type, uint32_t seq, uint32_t piece)
{
    return (uint64_t)0xFFF << 52 | (uint64_t)type << 48 | (uint64_t)(piece & 0xFFFFFF) << 24 |
           (seq & 0xFFFFFF);
}

/* Pieces.  A message of `bytes` is ceil(bytes / chunk) messages.  With
 * libfabric's shm provider a send of more than its inject size (4 KiB)
 * completes only when the receiver answers, and the sender handles those
 * answers in order, so one such send to a process that died holds back
 * every later one, to anyone: where a death must not stop the job
 * (replicated or checkpointing servers) pieces on shm are PS_SHM_CHUNK. */
#define PS_SHM_CHUNK ((size_t)4096)
#define PS_MIN_CHUNK ((size_t)64)
#define PS_MAX_PIECES ((uint32_t)1 << 24)

static uint64_t ps_pieces(size_t bytes, size_t chunk)
{
    return ((uint64_t)bytes + chunk - 1) / chunk;
}

static size_t ps_piece_len(size_t bytes, size_t chunk, uint32_t i)
{
    size_t off = (size_t)i * chunk;
    return bytes - off < chunk ? bytes - off : chunk;
}

void dt_ps_config_init(dt_ps_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->mode = DT_PS_BSP;
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
    if (*e != ' ' || e >= nl || tb->rows < 1 || tb->dim < 1 || tb->rows > INT64_MAX / 8 / tb->dim)
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
                         "%d; worker 0 has %d, %d, %d", ps->comm->rank, ps->S,
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
        if (ok && i < n)
            ok = (ps->numel[i] = strtoll(sp + 1, NULL, 10)) >= 0;
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
    if ((!twin && ps->cfg.rejoin_ms < 0) || !c->watch)
        return 0;
    if (!known) {   /* the death is usually published a moment after it shows */
        char key[32], val[16];
        size_t len = 0;
        dead_key(key, sizeof key, ps->W + s, ps->inc[s]);
        if (dt_store_get(c->watch, key, val, sizeof val, &len, c->timeout_ms / 2) != DT_OK)
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
        return w->status;
    w->status = DT_OK;
    w->msg[0] = '\0';
    return DT_OK;
}

/* wait_xfers' hook: a transfer with a server failed. */
static int ps_write_off(dt_comm *c, void *arg, int peer)
{
    dt_ps *ps = arg;
    return peer >= ps->W && peer < ps->W + ps->S && ps_write_off_server(c, ps, peer - ps->W, 0);
}

/* A message's data, to go out (or come in) in pieces as ps_pump finds
 * room for them. */
static dt_status ps_add_stream(dt_work *w, ps_call *pc, int sending, int peer, int type,
                               uint32_t seq, void *buf, size_t bytes)
{
    size_t chunk = pc->ps->chunk;
    if (bytes == 0)
        return DT_OK;
    if (ps_pieces(bytes, chunk) > PS_MAX_PIECES || pc->nstreams == 3 * PS_MAX_SERVERS)
        return work_fail(w, DT_ENOTSUP, "parameter server: a message of %zu bytes is more than "
                         "%u pieces of %zu bytes (raise dt_ps_config.chunk_bytes)", bytes,
                         PS_MAX_PIECES, chunk);
    pc->streams[pc->nstreams++] = (ps_stream){.peer = peer, .sending = sending, .type = type,
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
    int peer = ps->W + s;
    if (post(c, w, xs, 1, peer, ps_tag(PS_TAG_REQ, seq, 0), hdr, sizeof *hdr) != DT_OK)
        return ps_forgive(c, w, ps, s);
    return data ? ps_add_stream(w, pc, 1, peer, PS_TAG_DATA, seq, data, bytes) : DT_OK;
}

/* Post the receive of server s's answer header to the request about to go
 * out; its data becomes a stream. */
static dt_status ps_post_answer(dt_comm *c, dt_work *w, xfers *xs, ps_call *pc, int s,
                                ps_msg *in, void *data, size_t bytes)
{
    dt_ps *ps = pc->ps;
    uint32_t seq = ps->seq[s];
    if (post(c, w, xs, 0, ps->W + s, ps_tag(PS_TAG_RESP, seq, 0), in, sizeof *in) != DT_OK)
        return ps_forgive(c, w, ps, s);
    return ps_add_stream(w, pc, 0, ps->W + s, PS_TAG_RDATA, seq, data, bytes);
}

/* Post the streams' next pieces, taking turns, while the transfer list
 * has room (a round's wait then sees them through); streams of servers
 * written off are dropped. */
static dt_status ps_pump(dt_comm *c, dt_work *w, xfers *xs, ps_call *pc)
{
    dt_ps *ps = pc->ps;
    for (int more = 1; more && xs->n < DT_COMM_MAX_XFERS;) {
        more = 0;
        for (int i = 0; i < pc->nstreams && xs->n < DT_COMM_MAX_XFERS; i++) {
            ps_stream *st = &pc->streams[i];
            int s = st->peer - ps->W;
            if (st->next == st->pieces || ps->gone[s])
                continue;
            size_t len = ps_piece_len(st->bytes, ps->chunk, st->next);
            if (post(c, w, xs, st->sending, st->peer, ps_tag(st->type, st->seq, st->next),
                     st->buf + (size_t)st->next * ps->chunk, len) != DT_OK &&
                ps_forgive(c, w, ps, s) != DT_OK)
                return w->status;
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
                return w->status;
            continue;
        }
        if (pc->op == PS_PULL) {
            if (a >= b || ps_reader(ps, j) != s)
                continue;
            if (ps_post_answer(c, w, xs, pc, s, &pc->in[s], pc->buf + (a - pc->lo),
                               (size_t)(b - a) * sizeof(float)) ||
                (!ps->gone[s] &&
                 ps_post_request(c, w, xs, pc, s, PS_PULL, a, b - a, NULL, 0, &pc->out[(*nout)++])))
                return w->status;
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
            return w->status;
        pc->posted[s] += a < b ? b - a : 0;
        int64_t flo = pc->lo > ps->G ? pc->lo : ps->G;
        if ((pc->op == PS_PUSH || pc->op == PS_CPUSH) && hi > flo && !ps->gone[s] &&
            ps_post_request(c, w, xs, pc, s, PS_PUSH, flo, hi - flo, pc->buf + (flo - pc->lo),
                            (size_t)(hi - flo) * sizeof(float), &pc->out[(*nout)++]))
            return w->status;
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
        grad_encode((dt_compress)kind, g + (a - lo), n, piece, 1, k, scratch, NULL, out + used,
                    sent + (a - lo));
        pc->msg[j] = out + used;
        pc->cnt[j] = k;
        pc->bytes[j] = grad_code_bytes((dt_compress)kind, n, k);
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
            return w->status;
        if (ps->gone[s])
            continue;
        pc->asked[s] = pc->op == PS_SPULL;
        if (ps_post_request(c, w, xs, pc, s, pc->op, pc->lo, k, pc->msg[j],
                            pc->op == PS_SPUSH ? idb + rowb : idb, &pc->out[(*nout)++]) != DT_OK)
            return w->status;
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
static uint32_t ps_published_inc(dt_comm *c, int rank, int wait_ms)
{
    char key[32], val[16];
    size_t len = 0;
    snprintf(key, sizeof key, "inc/%d", rank);
    if (dt_store_get(c->watch, key, val, sizeof val - 1, &len, wait_ms) != DT_OK)
        return 0;
    val[len < sizeof val ? len : sizeof val - 1] = '\0';
    return (uint32_t)strtoul(val, NULL, 10);
}

/* Servers found dead without a twin (gone 2): wait until a restarted
 * process of each has rejoined (src/comm.c), swap its address in, and say hello
 * (our step, and how much of it its predecessor had); the request then
 * goes again to those servers `only` (their part of it was lost). */
static dt_status ps_await_rejoins(dt_comm *c, dt_work *w, xfers *xs, ps_call *pc)
{
    dt_ps *ps = pc->ps;
    pc->use_only = 0;
    memset(pc->only, 0, sizeof pc->only);
    for (int s = 0; s < ps->S; s++) {
        if (ps->gone[s] != 2)
            continue;
        int rank = ps->W + s;
        uint32_t inc;
        while ((inc = ps_published_inc(c, rank, 200)) <= ps->inc[s]) {
            if (dt_now() - ps->down_since[s] > ps_rejoin_ms(ps) / 1000.0)
                return work_fail(w, DT_EPEER, "parameter server: server rank %d died and no "
                                 "restarted process rejoined within %d ms (dt_ps_config.rejoin_ms)",
                                 rank, ps_rejoin_ms(ps));
            c->tp_iface->wait(c->tp, 50);   /* (the key may hold an older restart's number) */
        }
        char err[256] = "";
        if (comm_replace_peer(c, rank, inc, err, sizeof err) != DT_OK)
            return work_fail(w, DT_EPEER, "parameter server: server rank %d restarted, but: %s",
                             rank, err);
        ps->inc[s] = inc;
        ps->gone[s] = 0;
        ps->seq[s] = 0;   /* the new process numbers our requests from 0 */
        ps->st.rejoins++;
        int64_t had = ps->sent_clock[s] == pc->clock ? ps->sent[s] : 0;
        if (ps_post_request(c, w, xs, pc, s, PS_HELLO, 0, had, NULL, 0, &pc->hello[s]) != DT_OK)
            return w->status;
        pc->only[s] = 1;
        pc->use_only = 1;
        pc->posted[s] = 0;
        pc->asked[s] = 0;
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
/* The record after one that holds orphaned sends (drain_gone): a fresh
 * one with the same settings; the old one waits in the graveyard. */
static dt_status ps_fresh_xfers(dt_comm *c, dt_work *w, xfers **xsp)
{
    xfers *old = *xsp, *xs = c->ctx->al.malloc_fn(sizeof *xs, c->ctx->al.user);
    if (!xs)
        return work_fail(w, DT_ENOMEM, "%s: out of memory", comm_coll_name(w->kind));
    memset(xs, 0, sizeof *xs);
    xs->g = old->g;
    xs->gone = old->gone;
    xs->gone_base = old->gone_base;
    xs->gone_n = old->gone_n;
    xs->write_off = old->write_off;
    xs->write_off_arg = old->write_off_arg;
    old->next_dead = c->graveyard;
    c->graveyard = old;
    *xsp = xs;
    return DT_OK;
}

static dt_status ps_run(dt_comm *c, dt_work *w, xfers **xsp)
{
    xfers *xs = *xsp;
    ps_call *pc = (ps_call *)w->aux;
    dt_ps *ps = pc->ps;
    int nout = 0, sparse = pc->op == PS_SPUSH || pc->op == PS_SPULL;
    int pull = pc->op == PS_PULL || pc->op == PS_SPULL;
    if (ps->S > PS_MAX_SERVERS)
        return work_fail(w, DT_ENOTSUP, "parameter server: at most %d servers in this build",
                         PS_MAX_SERVERS);
    xs->gone = ps->gone;
    xs->gone_base = ps->W;
    xs->gone_n = ps->S;
    xs->write_off = ps_write_off;
    xs->write_off_arg = ps;
    memset(pc->asked, 0, sizeof pc->asked);
    memset(pc->posted, 0, sizeof pc->posted);
    pc->use_only = 0;
    unsigned char before[PS_MAX_SERVERS];   /* the servers gone when the pulls went out */
    memcpy(before, ps->gone, (size_t)ps->S);
    for (int round = 0, lost = 0;; round++) {
        nout = 0;
        if ((sparse ? ps_post_sparse : ps_post_dense)(c, w, xs, pc, &nout) != DT_OK)
            return w->status;
        do {   /* the data's pieces, as many at a time as the transfer list holds */
            if (ps_pump(c, w, xs, pc) != DT_OK)
                return w->status;
            /* a BSP pull waits for the slowest worker, and so may a parked push: the
             * server drops a silent worker after 1x, so we must outlast that */
            xs->patience = 2.0;
            if (wait_xfers(c, w, xs) != DT_OK)
                return w->status;
            if (xs->orphans) {
                if (ps_fresh_xfers(c, w, xsp) != DT_OK)
                    return w->status;
                xs = *xsp;
            }
        } while (ps_streams_left(pc));
        if (ps_await_rejoins(c, w, xs, pc) != DT_OK)
            return w->status;
        if (pc->use_only) {
            if (round > 16 * ps->S)
                return work_fail(w, DT_EPEER, "parameter server: servers keep dying");
            continue;
        }
        if (!pull || !ps_lost_reader(ps, before))
            break;
        if (++lost > ps->S)
            return work_fail(w, DT_EPEER, "parameter server: every server of a shard died");
        memset(pc->asked, 0, sizeof pc->asked);   /* every pull goes again */
        memcpy(before, ps->gone, (size_t)ps->S);
    }
    for (int s = 0; s < ps->S; s++) {
        if (!pc->asked[s])
            continue;
        pc->in[s].err[sizeof pc->in[s].err - 1] = '\0';   /* (a peer's text) */
        if (pc->in[s].magic != PS_MAGIC || pc->in[s].status != DT_OK)
            return work_fail(w, pc->in[s].magic != PS_MAGIC ? DT_EPEER : (dt_status)pc->in[s].status,
                             "parameter server: %s", pc->in[s].magic != PS_MAGIC
                                 ? "a server sent a malformed answer" : pc->in[s].err);
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

/* A worker's request stalls: is one of the servers dead? */
static dt_status ps_check_servers(dt_comm *c, dt_work *w)
{
    const ps_call *pc = w->aux;
    dt_ps *ps = pc->ps;
    for (int s = 0; s < ps->S; s++) {
        char key[32], val[16];
        size_t len = 0;
        dead_key(key, sizeof key, ps->W + s, ps->inc[s]);
        if (ps->gone[s] || dt_store_get(c->watch, key, val, sizeof val, &len, 1) != DT_OK)
            continue;
        if (!ps_write_off_server(c, ps, s, 1))   /* a twin serves on, or a restart is awaited */
            return work_fail(w, DT_EPEER, "parameter server: server rank %d died", ps->W + s);
    }
    return DT_OK;
}

static const comm_ext_ops ps_comm_ops = {.run = ps_run, .check_dead = ps_check_servers};

/* Run one request on the comm thread and wait for it. */
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
    dt_work *w = enqueue_in(ps->comm, COLL_PS, buf, NULL, n, 0, DT_REDUCE_SUM, &pc);
    dt_status s = w ? dt_work_wait(w) : ps->ctx->last_status;
    if (s == DT_OK && op == PS_PULL)
        ps_note_stale(ps, pc.stale);
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
        set_error(ps->ctx, DT_ESTATE, "%s: rank %d is a server (dt_ps_serve)", what, ps->comm->rank);
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
    ps->prefetch = enqueue_in(ps->comm, COLL_PS, ps->stage2, NULL, ps->G, 0, DT_REDUCE_SUM,
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
        snprintf(key, sizeof key, "ps%d/done/%d", ps->job, ps->comm->rank);
        s = dt_store_set(ps->comm->store, key, "1", 2);
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
    dt_work *w = enqueue_in(ps->comm, COLL_PS, NULL, NULL, n, 0, DT_REDUCE_SUM, pc);
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
    dt_work *w = enqueue_in(ps->comm, COLL_PS, rows_out, NULL, n, 0, DT_REDUCE_SUM, pc);
    if (!w) {
        host_free(ps->ctx, pc);
        return NULL;
    }
    w->owned = pc;   /* freed by dt_work_wait */
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
    tb->w = owned_tensor(sx, 2, shape, name, "");
    for (int j = 0; j < ps_tab_states(oc); j++)
        tb->state[j] = owned_tensor(sx, 2, shape, name, suffix[kind][j]);
    int64_t two = 2;
    tb->steps_t = owned_tensor(sx, 1, &two, name, ".steps");
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
            float u = (float)(splitmix64(&h) >> 40) * (1.0f / 16777216.0f);
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
    snprintf(mine, sizeof mine, "%lld", ps->resumed ? (long long)ps->opt->steps : -1LL);
    snprintf(key, sizeof key, "ps%d/resume/%d", ps->job, ps->server);
    dt_status s = dt_store_set(c->store, key, mine, strlen(mine) + 1);
    for (int q = 0; s == DT_OK && q < ps->S; q++) {
        size_t len = 0;
        snprintf(key, sizeof key, "ps%d/resume/%d", ps->job, q);
        s = dt_store_get(c->store, key, theirs, sizeof theirs - 1, &len, c->timeout_ms);
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
    sx->ckpt_extra = host_calloc(ps->ctx, sizeof(dt_tensor *) * (size_t)(4 * ps->ntables + 1));
    size_t len = strlen(dir) + 48;
    ps->ckpt_path = host_alloc(ps->ctx, len);
    if (!sx->ckpt_extra || !ps->ckpt_path)
        return set_error(ps->ctx, DT_ENOMEM, "ps_new: out of memory");
    snprintf(ps->ckpt_path, len, "%s/ps-server-%d.safetensors", dir, ps->server);
    for (int t = 0; t < ps->ntables; t++) {
        sx->ckpt_extra[sx->n_ckpt_extra++] = ps->tabs[t].w;
        sx->ckpt_extra[sx->n_ckpt_extra++] = ps->tabs[t].steps_t;
        for (int j = 0; j < 2; j++)
            if (ps->tabs[t].state[j])
                sx->ckpt_extra[sx->n_ckpt_extra++] = ps->tabs[t].state[j];
    }
    if (access(ps->ckpt_path, F_OK) == 0) {
        if (dt_checkpoint_load(sx, ps->opt, ps->ckpt_path, NULL) != DT_OK)
            return set_error(ps->ctx, dt_last_status(sx), "ps_new: server %d cannot resume: %s",
                             ps->server, dt_last_error(sx));
        for (int t = 0; t < ps->ntables; t++) {   /* (Adam's bias correction goes on) */
            const float *f = ps->tabs[t].steps_t->data;
            ps->tabs[t].steps = (int64_t)f[0] * 16777216 + (int64_t)f[1];
        }
        ps->resumed = ps->initialized = 1;
        ps->st.resumed = 1;
        ps->st.resumed_step = ps->opt->steps;
    }
    if (ps->comm->inc)   /* rejoining a running job: the others started long ago */
        return ps->resumed ? DT_OK : set_error(ps->ctx, DT_ESTATE, "ps_new: server rank %d is a "
                                               "restarted process, and without its checkpoint "
                                               "(%s) it has nothing to rejoin with",
                                               ps->comm->rank, ps->ckpt_path);
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
    if (dt_checkpoint_save(ps->sctx, ps->opt, ps->ckpt_path, ps->opt->steps) != DT_OK)
        return set_error(ps->ctx, dt_last_status(ps->sctx), "ps_serve: checkpoint: %s",
                         dt_last_error(ps->sctx));
    ps->st.checkpoints++;
    return DT_OK;
}

/* The pieces: every parameter cut to this server's keys, each a parameter
 * of the server's own context (named after it), with the optimizer over
 * them. */
static dt_status ps_make_pieces(dt_ps *ps)
{
    dt_config cc;
    dt_config_init(&cc);
    cc.allocator = ps->ctx->al;
    /* a server's shard is host memory whatever the workers compute on */
    cc.custom_backend = find_backend("cpu");
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
    if (ps->comm->inc && !(ps->cfg.checkpoint_dir && *ps->cfg.checkpoint_dir))
        return set_error(ps->ctx, DT_ESTATE, "ps_new: server rank %d is a restarted process; "
                         "it can rejoin only from a checkpoint (dt_ps_config.checkpoint_dir)",
                         ps->comm->rank);
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
    if (ps->comm->inc) {   /* 18.6: each worker's step is learnt from its hello */
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
            g->flags |= T_ZERO;
            continue;
        }
        ps->sctx->be_iface->copy(ps->sctx->be, g->data, sum + (ps->piece_lo[p] - lo), tensor_bytes(g));
        g->flags &= ~(unsigned)T_ZERO;
    }
    dt_status s = dt_optim_step(ps->opt);
    dt_zero_grad(ps->sctx);
    if (s != DT_OK)
        return set_error(ps->ctx, s, "ps_serve: optimizer step: %s", dt_last_error(ps->sctx));
    ps->st.steps++;
    return DT_OK;
}

/* After a whole step (its sparse rows too): a checkpoint when one is due. */
static dt_status ps_checkpoint_due(dt_ps *ps)
{
    int every = ps->cfg.checkpoint_every;
    return every > 0 && ps->opt->steps % every == 0 ? ps_checkpoint(ps) : DT_OK;
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
    const dt_optim_config *c = &ps->opt->cfg;
    const dt_backend_iface *be = ps->sctx->be_iface;
    /* the rate the schedule gives now (ASP rows may arrive between dense steps) */
    float lr = ps->opt->has_sched ? dt_schedule_lr(&ps->opt->sched, ps->opt->base_lr, ps->opt->steps)
                                  : ps->opt->lr;
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

static void ps_free_held(dt_ps *ps, ps_peer *p)
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
        if (c->tp_iface->send(c->tp, r->worker, ps_tag(PS_TAG_RDATA, r->hdr.seq, r->posted), buf,
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
                      .chunk = req->chunk};
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
    dt_status s = c->tp_iface->send(c->tp, worker, ps_tag(PS_TAG_RESP, req->seq, 0), &r->hdr,
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
    if (c->tp_iface->recv(c->tp, w, ps_tag(PS_TAG_REQ, p->seq, 0), 0, &p->hdr, sizeof p->hdr,
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
        grad_decode_add((dt_compress)p->hdr.code, p->sdata, p->data_n, p->hdr.k, dst);
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
    const ps_msg *h = &p->hdr;
    if (h->lo < 0 || h->lo >= ps->ntables || h->n < 1 || h->n > ps->tabs[h->lo].count)
        return set_error(ps->ctx, DT_EPEER, "ps_serve: worker %d sent a %s of %lld rows of table "
                         "%lld (%d tables)", w, ps_op_names[h->op], (long long)h->n,
                         (long long)h->lo, ps->ntables);
    size_t bytes = (size_t)h->n * (sizeof(int64_t) +
                   (h->op == PS_SPUSH ? (size_t)ps->tabs[h->lo].dim * sizeof(float) : 0));
    return ps_recv_sdata(ps, w, bytes);
}

/* A compressed push's header arrived: receive its code (decoded in
 * ps_on_data). */
static dt_status ps_recv_code(dt_ps *ps, int w)
{
    ps_peer *p = &ps->peers[w];
    const ps_msg *h = &p->hdr;
    int64_t lo = ps->range[ps->shard], hi = ps->range[ps->shard + 1];
    int kind = h->code;
    if (h->lo < lo || h->n < 1 || h->n > hi - h->lo || kind < DT_COMPRESS_BF16 ||
        kind > DT_COMPRESS_INT8 || (kind == DT_COMPRESS_TOPK ? h->k < 1 || h->k > h->n : h->k != 0))
        return set_error(ps->ctx, DT_EPEER, "ps_serve: worker %d sent a compressed push of keys "
                         "[%lld, +%lld) (code %d, %lld entries); this server holds [%lld, %lld)",
                         w, (long long)h->lo, (long long)h->n, kind, (long long)h->k,
                         (long long)lo, (long long)hi);
    p->data_lo = h->lo;
    p->data_n = h->n;
    return ps_recv_sdata(ps, w, grad_code_bytes((dt_compress)kind, h->n, h->k));
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
        if (c->tp_iface->recv(c->tp, w, ps_tag(PS_TAG_DATA, p->hdr.seq, p->data_next), 0,
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
                         ps_op_names[p->op], want);
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
    if (!ps->comm->inc || p->clock >= 0 || h->clock < 0 || h->n < 0 || h->n >= ps_my_floats(ps))
        return set_error(ps->ctx, DT_EPEER, "ps_serve: worker %d said hello (step %lld, %lld "
                         "floats in) to a server that %s", w, (long long)h->clock,
                         (long long)h->n, ps->comm->inc ? "knows it already" : "never restarted");
    p->clock = p->base = h->clock;
    p->got = h->n;
    dt_status s = ps_sync(ps);
    return s != DT_OK ? s : ps_next_request(ps, w);
}

/* Worker w's request header arrived. */
static dt_status ps_on_header(dt_ps *ps, int w)
{
    ps_peer *p = &ps->peers[w];
    ps_msg *h = &p->hdr;
    if (p->hdr_x.status != DT_OK || p->hdr_x.len != sizeof *h || h->magic != PS_MAGIC ||
        h->seq != p->seq || h->op < PS_INIT || h->op > PS_CPUSH ||
        (p->clock < 0 && h->op != PS_HELLO) || h->chunk < PS_MIN_CHUNK ||
        h->chunk > ps->comm->max_msg)
        return set_error(ps->ctx, DT_EPEER, "ps_serve: worker %d sent a malformed request", w);
    p->seq++;
    p->op = (int)h->op;
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
    int64_t lo = ps->range[ps->shard], hi = ps->range[ps->shard + 1];
    int flags = h->lo >= ps->G;
    int in_range = h->n >= 0 && (flags ? h->lo + h->n <= ps->G + ps->P
                                       : h->lo >= lo && h->lo + h->n <= hi);
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
    if (!in_range || (h->op == PS_INIT && (flags || w != 0)))
        return set_error(ps->ctx, DT_EPEER, "ps_serve: worker %d sent %s of keys [%lld, %lld), "
                         "not this server's", w, ps_op_names[h->op], (long long)h->lo,
                         (long long)(h->lo + h->n));
    p->data_lo = h->lo;
    p->data_n = h->n;
    return ps_recv_pieces(ps, w, p->push + ps_slot(ps, h->lo), (size_t)h->n * sizeof(float));
}

/* Cancel the receives posted for worker p. */
static void ps_cancel_peer(dt_ps *ps, ps_peer *p)
{
    dt_comm *c = ps->comm;
    c->tp_iface->cancel(c->tp, &p->hdr_x);
    for (int i = 0; i < PS_WINDOW; i++)
        if (p->data_busy[i])
            c->tp_iface->cancel(c->tp, &p->data_x[i]);
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
    warn(ps->ctx, "parameter server %d (rank %d): dropped worker %d after %lld steps: %s; "
         "going on with %d worker%s", ps->server, ps->comm->rank, w, (long long)p->clock, why, live,
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
    for (int q = 0; q < ps->S && c->watch; q++) {
        char key[32], val[16];
        size_t len = 0;
        int rank = ps->W + q;
        if (q == ps->server)
            continue;
        dead_key(key, sizeof key, rank, ps_published_inc(c, rank, 1));
        if (dt_store_get(c->watch, key, val, sizeof val, &len, 1) == DT_OK)
            return 1;
    }
    return 0;
}

/* Every DT_COMM_WATCH_S: drop workers the store reports dead, and, while a
 * pull waits, live workers silent for the communicator's timeout. */
static dt_status ps_watch(dt_ps *ps, double *last_seen)
{
    dt_comm *c = ps->comm;
    double now = dt_now();
    int held = ps->waits != NULL;   /* does anyone wait for the others? */
    for (int w = 0; w < ps->W; w++)
        held |= ps->peers[w].state == 0 && ps->peers[w].parked;
    for (int w = 0; w < ps->W; w++) {
        if (ps->peers[w].state != 0)
            continue;
        char key[32], val[16];
        size_t len = 0;
        snprintf(key, sizeof key, "dead/%d", w);
        int dead = c->watch && dt_store_get(c->watch, key, val, sizeof val, &len, 1) == DT_OK;
        snprintf(key, sizeof key, "ps%d/gone/%d", ps->job, w);   /* left without finishing */
        dead = dead || (c->watch && dt_store_get(c->watch, key, val, sizeof val, &len, 1) == DT_OK);
        snprintf(key, sizeof key, "ps%d/done/%d", ps->job, w);   /* finished before we restarted */
        if (ps->peers[w].clock < 0 && c->watch &&
            dt_store_get(c->watch, key, val, sizeof val, &len, 1) == DT_OK) {
            ps->peers[w].state = 1;
            c->tp_iface->cancel(c->tp, &ps->peers[w].hdr_x);
            if (ps_sync(ps) != DT_OK)
                return ps->ctx->last_status;
            continue;
        }
        int waiting = ps->peers[w].parked;   /* one waiting for us is silent by design */
        for (const ps_wait *q = ps->waits; q && !waiting; q = q->next)
            waiting = q->worker == w;
        /* silent while others wait; or, restarted, never heard from (else we
         * would wait forever); but not while it waits for a restarting server */
        double quiet = now - last_seen[w], limit = c->timeout_ms / 1000.0;
        int silent = !waiting && ((held && quiet > limit) ||
                                  (ps->syncing && ps->peers[w].clock < 0 && quiet > 2 * limit)) &&
                     !ps_server_down(ps);
        char why[64];
        snprintf(why, sizeof why, "%s", dead ? "it died or left without finishing" : "");
        if (!dead)
            snprintf(why, sizeof why, "silent for %.1f s while others waited", now - last_seen[w]);
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

static dt_status ps_serve_loop(dt_ps *ps, double *last_seen)
{
    dt_comm *c = ps->comm;
    for (int w = 0; w < ps->W; w++) {
        last_seen[w] = dt_now();
        if (ps_post_header(ps, w) != DT_OK)
            return ps->ctx->last_status;
    }
    if (announce_rejoin(c) != DT_OK)   /* a restarted server: workers may come now */
        return ps->ctx->last_status;
    double last_watch = dt_now();
    for (;;) {
        int live = 0;
        for (int w = 0; w < ps->W; w++)
            live += ps->peers[w].state == 0;
        if (!live && !ps->replies)
            return DT_OK;
        dt_xfer *done[16];
        char err[256] = "";
        int k = c->tp_iface->poll(c->tp, done, 16, err, sizeof err);
        if (k < 0)
            return set_error(ps->ctx, DT_EPEER, "ps_serve: transport failure: %s", err);
        for (int i = 0; i < k; i++) {
            dt_xfer *x = done[i];
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
        if (k == 0) {
            if (dt_now() - last_watch > DT_COMM_WATCH_S) {
                last_watch = dt_now();
                if (ps_watch(ps, last_seen) != DT_OK)
                    return ps->ctx->last_status;
            }
            c->tp_iface->wait(c->tp, 20);
        }
    }
}

/* Transfers of ours the transport still holds. */
static int ps_outstanding(const dt_ps *ps)
{
    for (int w = 0; w < ps->W; w++) {
        const ps_peer *p = &ps->peers[w];
        for (int i = 0; i < PS_WINDOW; i++)
            if (p->data_busy[i] && !p->data_x[i].done)
                return 1;
        if (!p->hdr_x.done)
            return 1;
    }
    return ps->replies != NULL;
}

dt_status dt_ps_serve(dt_ps *ps)
{
    if (!ps)
        return DT_EINVAL;
    if (ps->server < 0)
        return set_error(ps->ctx, DT_ESTATE, "ps_serve: rank %d is a worker", ps->comm->rank);
    dt_comm *c = ps->comm;
    double *last_seen = host_calloc(ps->ctx, sizeof(double) * (size_t)ps->W);
    if (!last_seen)
        return set_error(ps->ctx, DT_ENOMEM, "ps_serve: out of memory");
    pthread_mutex_lock(&c->mu);   /* take the transport from the comm thread */
    while (c->running || c->head)
        pthread_cond_wait(&c->cv, &c->mu);
    int broken = c->broken;
    c->running = !broken;
    pthread_mutex_unlock(&c->mu);
    dt_status s = broken ? set_error(ps->ctx, DT_ESTATE, "ps_serve: communicator failed earlier: %s",
                                     c->broken_msg)
                         : ps_serve_loop(ps, last_seen);
    if (s == DT_OK)   /* the final state, for a job that starts again */
        s = ps_checkpoint(ps);
    for (int w = 0; !broken && w < ps->W; w++)   /* nothing of ours stays posted */
        if (ps->peers[w].state == 0)
            ps_cancel_peer(ps, &ps->peers[w]);
    for (ps_reply *r = ps->replies; r; r = r->next)
        r->stopped = 1;
    /* Cancelled receives complete in a later poll, and after an error
     * answers may still be on their way: give them a second, then close the
     * transport rather than leave it holding what dt_ps_free frees. */
    for (double end = dt_now() + 1.0; !broken && ps_outstanding(ps) && dt_now() < end;) {
        dt_xfer *done[16];
        char err[256];
        int k = c->tp_iface->poll(c->tp, done, 16, err, sizeof err);
        for (int i = 0; i < k; i++)
            if (!ps_is_peer(ps, done[i]->user))
                ps_on_sent(ps, done[i]);   /* (stopped: posts nothing) */
        ps_sweep_replies(ps);
        if (k <= 0)
            c->tp_iface->wait(c->tp, 10);
    }
    if (!broken && ps_outstanding(ps)) {
        c->broken = 1;
        snprintf(c->broken_msg, sizeof c->broken_msg, "%s", ps->ctx->err);
        c->tp_iface->close(c->tp);
        c->tp = NULL;
    }
    pthread_mutex_lock(&c->mu);
    c->running = 0;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    host_free(ps->ctx, last_seen);
    return s;
}

/* With a parameter server the workers alone wrap the model: the
 * servers' keys are the layout dt_ps_new agreed, which is this DDP's. */
DT_PRIVATE dt_status ddp_ps_check(dt_ctx *ctx, dt_comm *c, const dt_ddp_config *cfg, const dt_optim *opt)
{
    const dt_ps *ps = cfg->ps;
    if (ps->comm != c || ps->ctx != ctx)
        return set_error(ctx, DT_EINVAL, "ddp_new: the parameter server belongs to another "
                         "communicator or context");
    if (ps->server >= 0)
        return set_error(ctx, DT_EINVAL, "ddp_new: rank %d is a parameter server; workers wrap "
                         "the model, servers call dt_ps_serve", c->rank);
    if (ps->nparams != ctx->n_params)
        return set_error(ctx, DT_EMISMATCH, "ddp_new: %d parameters now, %d when dt_ps_new ran",
                         ctx->n_params, ps->nparams);
    if (opt)
        return set_error(ctx, DT_EINVAL, "ddp_new: with a parameter server the servers step "
                         "(dt_ps_config.optim); pass no optimizer");
    return DT_OK;
}

/* --- joining and leaving ---------------------------------------------- */

static dt_status ps_settings(dt_ctx *ctx, dt_comm *c, dt_ps_config *cfg, int *W, int *S)
{
    const char *e = getenv("DTRAIN_NUM_SERVERS");
    if (cfg->servers <= 0)
        cfg->servers = e && atoi(e) > 0 ? atoi(e) : 1;
    const char *m = getenv("DTRAIN_PS_MODE");
    if (cfg->mode == DT_PS_BSP && m && *m) {
        if (!strcmp(m, "asp"))
            cfg->mode = DT_PS_ASP;
        else if (!strcmp(m, "ssp"))
            cfg->mode = DT_PS_SSP;
        else if (strcmp(m, "bsp"))
            return set_error(ctx, DT_EINVAL, "ps_new: DTRAIN_PS_MODE='%s' is not bsp, asp or ssp", m);
    }
    const char *st = getenv("DTRAIN_PS_STALENESS");
    if (cfg->staleness == 0 && st && *st)
        cfg->staleness = atoi(st);
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
    *W = c->world - *S;
    if (cfg->replicate && (*S < 2 || *S % 2))
        return set_error(ctx, DT_EINVAL, "ps_new: replication pairs the servers: %d servers is not "
                         "an even number >= 2", *S);
    if (*W < 1 || *S > 8)
        return set_error(ctx, *S > 8 ? DT_ENOTSUP : DT_EINVAL, "ps_new: %d servers among %d ranks: "
                         "need at least one worker and at most 8 servers", *S, c->world);
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
        chunk = !strcmp(c->provider, "shm") && (ps->cfg.replicate || ps->cfg.checkpoint_dir)
                    ? PS_SHM_CHUNK : c->max_msg;
    chunk = chunk < c->max_msg ? chunk : c->max_msg;
    ps->chunk = chunk < UINT32_MAX ? chunk : (size_t)1 << 31;   /* (the header's field) */
}

static dt_status ps_join_worker(dt_ps *ps, int job)
{
    dt_ctx *ctx = ps->ctx;
    dt_comm *c = ps->comm;
    char key[64];
    if (ctx->n_params < 1)
        return set_error(ctx, DT_EINVAL, "ps_new: worker %d has no parameters (a step is "
                         "counted by its dense push)", c->rank);
    ps->layout = ps_describe(ctx, &ps->cfg);
    if (!ps->layout)
        return ctx->last_status;
    snprintf(key, sizeof key, "ps%d/layout/%d", job, c->rank);
    dt_status s = dt_store_set(c->store, key, ps->layout, strlen(ps->layout) + 1);
    if (s == DT_OK && c->rank != 0) {
        size_t len = 0;
        char *ref = host_alloc(ctx, DT_STORE_MAX_VALUE);
        snprintf(key, sizeof key, "ps%d/layout/0", job);
        s = ref ? dt_store_get(c->store, key, ref, DT_STORE_MAX_VALUE - 1, &len, c->timeout_ms)
                : set_error(ctx, DT_ENOMEM, "ps_new: out of memory");
        if (s == DT_OK) {
            ref[len < DT_STORE_MAX_VALUE ? len : DT_STORE_MAX_VALUE - 1] = '\0';
            if (strcmp(ref, ps->layout) != 0) {
                char diff[240];
                ps_first_difference(ps->layout, ref, diff, sizeof diff);
                s = set_error(ctx, DT_EMISMATCH, "ps_new: worker %d's model differs from worker "
                              "0's: %s", c->rank, diff);
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
    if (c->rank == 0) {   /* our values are where everyone starts */
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
    dt_status s = dt_store_get(ps->comm->store, key, ps->layout, DT_STORE_MAX_VALUE - 1, &len,
                               ps->comm->timeout_ms);
    if (s != DT_OK)
        return s;
    ps->layout[len < DT_STORE_MAX_VALUE ? len : DT_STORE_MAX_VALUE - 1] = '\0';
    if ((s = ps_plan(ps, ps->layout)) != DT_OK)
        return s;
    return ps_make_pieces(ps);
}

dt_ps *dt_ps_new(dt_ctx *ctx, dt_comm *c, const dt_ps_config *cfg)
{
    if (!ctx_ok(ctx))
        return NULL;
    if (!c || c->ctx != ctx) {
        set_error(ctx, DT_EINVAL, "ps_new: %s", c ? "the communicator belongs to another context"
                                                  : "communicator is NULL");
        return NULL;
    }
    dt_ps_config conf;
    dt_ps_config_init(&conf);
    if (cfg)
        conf = *cfg;
    int W = 0, S = 0;
    if (ps_settings(ctx, c, &conf, &W, &S) != DT_OK)
        return NULL;
    dt_ps *ps = host_calloc(ctx, sizeof *ps);
    if (!ps) {
        set_error(ctx, DT_ENOMEM, "ps_new: out of memory");
        return NULL;
    }
    int job = c->ps_made++;
    c->ps_ops = &ps_comm_ops;   /* before any request reaches the comm thread */
    int L = conf.replicate ? S / 2 : S;
    *ps = (dt_ps){.ctx = ctx, .comm = c, .cfg = conf, .W = W, .S = S, .job = job, .L = L,
                  .server = c->rank >= W ? c->rank - W : -1,
                  .shard = c->rank >= W ? (c->rank - W) % L : -1};
    dt_status s = DT_OK;
    if (c->inc && (ps->server < 0 || conf.replicate))   /* 18.6 */
        s = set_error(ctx, DT_ENOTSUP, "ps_new: rank %d is a restarted process; only a server "
                      "without a replica can rejoin a running job (%s)", c->rank,
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
        snprintf(key, sizeof key, "ps%d/gone/%d", ps->job, ps->comm->rank);
        dt_store_set(ps->comm->store, key, "1", 2);
    }
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
    if (ps->sctx) {
        host_free(ctx, ps->sctx->ckpt_extra);
        ps->sctx->ckpt_extra = NULL;
        ps->sctx->n_ckpt_extra = 0;
    }
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

