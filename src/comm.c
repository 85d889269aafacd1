#include "internal.h"

/* ===========================================================================
 * Communicators and collectives
 *
 * A communicator owns one transport endpoint and one comm thread.  Callers
 * enqueue work items and wait on them; the thread runs them one after the
 * other with non-blocking sends and receives, driving the transport's
 * progress and sleeping on its completion queue.
 *
 * Every message's tag carries the collective's sequence number, the step and
 * the chunk; the top 12 bits of data tags carry the collective's kind and a
 * hash of its size, so mismatched data never matches a receive.  Each
 * collective also starts by sending a 32-byte header (kind, size, root, op)
 * to the right ring neighbour and receiving the left one's: ranks that call
 * different collectives see each other's header within one message latency
 * and fail with a message naming both calls, instead of hanging or mixing
 * data.  A peer silent for timeout_ms fails the call naming it.
 *
 * Algorithms: allreduce is recursive doubling (with the non-power-of-two
 * fold) up to doubling_max bytes and a ring (reduce-scatter, allgather)
 * above; broadcast is a binomial tree; allgather and reduce-scatter are the
 * ring's halves.  Messages above DT_COMM_CHUNK bytes go in chunks.
 * ======================================================================== */

/* allreduce: recursive doubling up to this many bytes, ring above.  On tcp
 * one round of whole-buffer exchange beats the ring's two rounds up to
 * 256 KiB (bench_allreduce, 2 ranks, 256 KiB: 2.0-2.4 GB/s against 1.8);
 * on libfabric shm the ring wins from 64 KiB on. */
#define DT_COMM_SMALL ((size_t)64 << 10)
#define DT_COMM_SMALL_TCP ((size_t)256 << 10)
#define DT_COMM_CHUNK ((size_t)4 << 20)    /* largest single message */
#define DT_COMM_DEFAULT_TIMEOUT_MS 30000
static const char *const coll_names[] = {"?", "allreduce", "broadcast", "allgather",
                                         "reduce_scatter", "barrier", "alltoall",
                                         "16-bit allreduce", "allreduce in shared memory",
                                         "parameter-server request", "send/recv"};

/* A collective's name for messages and traces ("allreduce"); "?" for a kind
 * outside the table. */
DT_PRIVATE const char *comm_coll_name(int kind)
{
    return kind >= 1 && kind < (int)(sizeof coll_names / sizeof coll_names[0]) ? coll_names[kind]
                                                                             : "?";
}

#define TAG_HEADER_STEP 0xFFFFu
#define TAG_CHECK_SHIFT 52

static const dt_transport_iface *find_transport(void)
{
#ifdef DT_WITH_FABRIC
    return dt_transport_fabric_iface();
#else
    return NULL;
#endif
}

/* --- tags and the header --------------------------------------------- */

static uint32_t size_hash(int kind, int64_t n, int root, int op)
{
    uint64_t h = (uint64_t)n * 0x9E3779B97F4A7C15ull ^ (uint64_t)(root + 1) * 0xC2B2AE3D27D4EB4Full ^
                 (uint64_t)(op + 1) * 0x165667B19E3779F9ull;
    h ^= h >> 29;
    return (uint32_t)(((uint32_t)kind << 8) | (uint32_t)(h & 0xFF));
}

/* Receives match tags exactly: libfabric 1.17's shm provider ignores the
 * ignore mask for messages that arrive before their receive is posted.  The
 * header's tag therefore leaves the kind/size bits out, so a neighbour's
 * header always matches and its contents reveal a mismatch; data tags keep
 * them, so mismatched data can never be taken for ours. */
static uint64_t make_tag(const dt_work *w, uint32_t step, uint32_t chunk)
{
    uint64_t check = step == TAG_HEADER_STEP ? 0 : size_hash(w->kind, w->n, w->root, w->op) & 0xFFF;
    return check << TAG_CHECK_SHIFT | (uint64_t)(w->seq & 0xFFFFFF) << 28 |
           (uint64_t)(step & 0xFFFF) << 12 | (chunk & 0xFFF);
}

static void describe_call(char *out, size_t cap, int kind, int64_t n, int root, int op)
{
    static const char *const ops[] = {"sum", "avg", "max", "min"};
    const char *name = kind >= 1 && kind <= COLL_P2P ? coll_names[kind] : "an unknown call";
    if (kind == COLL_BROADCAST)
        snprintf(out, cap, "%s(n=%lld, root=%d)", name, (long long)n, root);
    else if (kind == COLL_ALLREDUCE || kind == COLL_REDUCE_SCATTER)
        snprintf(out, cap, "%s(n=%lld, %s)", name, (long long)n, op >= 0 && op < 4 ? ops[op] : "?");
    else
        snprintf(out, cap, "%s(n=%lld)", name, (long long)n);
}
DT_PRIVATE dt_status work_fail(dt_work *w, dt_status st, const char *fmt, ...)
{
    if (w->status != DT_OK)
        return w->status;   /* keep the first cause */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->msg, sizeof w->msg, fmt, ap);
    va_end(ap);
    w->status = st;
    return st;
}

static int grp_rank(const grp *g, int i) { return g->rank ? g->rank[i] : i; }

static dt_status blame_silent(dt_work *w, int who, int ms)
{
    w->blame = who;
    w->blame_ms = ms;
    return work_fail(w, DT_ETIMEDOUT, "%s #%u: rank %d sent nothing for %d ms (dead or hung?)",
                     coll_names[w->kind], w->seq, who, ms);
}

static int xfer_gone(const xfers *xs, int peer)
{
    return xs->gone && peer >= xs->gone_base && peer < xs->gone_base + xs->gone_n &&
           xs->gone[peer - xs->gone_base];
}

static dt_status check_dead(dt_comm *c, dt_work *w);
static void seg_heartbeat(dt_comm *c);

DT_PRIVATE dt_status post(dt_comm *c, dt_work *w, xfers *xs, int sending, int peer, uint64_t tag,
                      void *buf, size_t bytes)
{
    char err[256] = "";
    dt_status st;
    if (xs->n == DT_COMM_MAX_XFERS)
        return work_fail(w, DT_ENOTSUP, "%s: too many transfers in one step", coll_names[w->kind]);
    dt_xfer *x = &xs->x[xs->n];
    double deadline = dt_now() + c->timeout_ms / 1000.0;
    for (;;) {
        memset(x, 0, sizeof *x);
        x->peer = peer;
        st = sending ? c->tp_iface->send(c->tp, peer, tag, buf, bytes, x, err, sizeof err)
                     : c->tp_iface->recv(c->tp, peer, tag, 0, buf, bytes, x, err, sizeof err);
        if (st != DT_ETIMEDOUT || dt_now() >= deadline)
            break;
        /* back-pressured: the peer takes no data; is it alive? */
        c->last_watch = 0;
        if (check_dead(c, w) != DT_OK)
            return w->status;
        if (xfer_gone(xs, peer))   /* a dead server a parameter-server request can go without */
            return work_fail(w, DT_EPEER, "%s #%u: rank %d died", coll_names[w->kind], w->seq, peer);
    }
    if (st != DT_OK)
        return work_fail(w, st == DT_ETIMEDOUT ? st : DT_EPEER, "%s #%u: %s to rank %d failed: %s",
                         coll_names[w->kind], w->seq, sending ? "send" : "receive", peer, err);
    if (sending)
        __atomic_fetch_add(&c->bytes_sent, (uint64_t)bytes, __ATOMIC_RELAXED);
    xs->n++;
    return DT_OK;
}

/* Post a buffer in chunks of DT_COMM_CHUNK bytes, or larger where that
 * would need more than 24 (the transfer list holds DT_COMM_MAX_XFERS), and
 * never above the transport's max_msg. */
static dt_status post_chunked(dt_comm *c, dt_work *w, xfers *xs, int sending, int peer,
                              uint32_t step, void *buf, size_t bytes)
{
    size_t chunk = bytes / 24 + 1 > DT_COMM_CHUNK ? (bytes / 24 + 4) & ~(size_t)3 : DT_COMM_CHUNK;
    chunk = c->max_msg < chunk ? c->max_msg : chunk;
    uint32_t i = 0;
    size_t off = 0;
    do {
        size_t len = bytes - off < chunk ? bytes - off : chunk;
        dt_status st = post(c, w, xs, sending, peer, make_tag(w, step, i++), (char *)buf + off, len);
        if (st != DT_OK)
            return st;
        off += len;
    } while (off < bytes);
    return DT_OK;
}

/* The left neighbour's header arrived: does it describe our call? */
static dt_status check_header(dt_comm *c, dt_work *w, xfers *xs)
{
    xs->hdr_checked = 1;
    const coll_header *h = &xs->hdr_in;
    int left = grp_rank(&xs->g, (xs->g.me - 1 + xs->g.size) % xs->g.size);
    if (xs->hdr_recv.status != DT_OK)
        return work_fail(w, DT_EPEER, "%s #%u: rank %d: connection failed", coll_names[w->kind],
                         w->seq, left);
    if (xs->hdr_recv.len != sizeof *h || h->magic != 0x44545243u)
        return work_fail(w, DT_EPEER, "%s #%u: rank %d sent a malformed header",
                         coll_names[w->kind], w->seq, left);
    if ((int)h->kind != w->kind || h->n != w->n || (int)h->root != w->root || (int)h->op != (int)w->op) {
        char mine[96], theirs[96];
        describe_call(mine, sizeof mine, w->kind, w->n, w->root, (int)w->op);
        describe_call(theirs, sizeof theirs, (int)h->kind, h->n, (int)h->root, (int)h->op);
        return work_fail(w, DT_EMISMATCH, "collective #%u: rank %d called %s, rank %d called %s",
                         w->seq, c->rank, mine, left, theirs);
    }
    return DT_OK;
}

/* How long rank 0's dt_comm_free waits for the others to leave (src/store.c). */
#define DT_COMM_DRAIN_MS 10000

/* A failure reason as ranks publish it: "<status>|<message>". */
static dt_status fail_with_reason(dt_work *w, const char *why)
{
    char *end;
    long st = strtol(why, &end, 10);
    if (*end != '|' || st <= DT_OK || st > DT_EPEER)
        return work_fail(w, DT_EPEER, "%s", why);
    return work_fail(w, (dt_status)st, "%s", end + 1);
}

/* The first rank to fail publishes why ("abort" in the store), so ranks
 * that only see its consequences (a closed connection, silence) report the
 * cause instead.  DT_OK: nobody has. */
static dt_status published_failure(dt_comm *c, dt_work *w)
{
    char why[DT_MAX_ERROR + 8];
    size_t len = 0;
    if (!c->watch || dt_store_get(c->watch, "abort", why, sizeof why - 1, &len, 1) != DT_OK ||
        len < 3)
        return DT_OK;
    why[len < sizeof why ? len : sizeof why - 1] = '\0';
    w->status = DT_OK;   /* replace a consequence by the cause */
    return fail_with_reason(w, why);
}

/* A timed-out rank may have waited on a rank that was itself waiting on
 * another: a stalled collective publishes whom it waits for ("wait/<rank>",
 * every DT_COMM_WATCH_S), so follow that chain to the rank that is not
 * waiting in this collective, and blame it instead of a bystander. */
static void follow_waits(dt_comm *c, dt_work *w)
{
    int who = w->blame;
    for (int hops = 0; c->watch && hops < c->world; hops++) {
        char key[32], edge[32];
        size_t len = 0;
        snprintf(key, sizeof key, "wait/%d", who);
        if (dt_store_get(c->watch, key, edge, sizeof edge - 1, &len, 1) != DT_OK)
            break;
        edge[len < sizeof edge ? len : sizeof edge - 1] = '\0';
        unsigned seq;
        int next;
        if (sscanf(edge, "%u:%d", &seq, &next) != 2 || seq != w->seq || next < 0 ||
            next >= c->world || next == who)
            break;
        who = next;
    }
    if (who == w->blame)
        return;
    int waited_on = w->blame;
    w->status = DT_OK;
    work_fail(w, DT_ETIMEDOUT, "%s #%u: rank %d sent nothing for %d ms (dead or hung?); "
              "rank %d was waiting on it", coll_names[w->kind], w->seq, who, w->blame_ms, waited_on);
    w->blame = who;
}

static void publish_failure(dt_comm *c, const dt_work *w)
{
    char why[DT_MAX_ERROR + 8];
    size_t len = 0;
    if (!c->watch || dt_store_get(c->watch, "abort", why, sizeof why - 1, &len, 1) == DT_OK)
        return;   /* someone was first */
    int n = snprintf(why, sizeof why, "%d|%s", (int)w->status, w->msg);
    dt_store_set(c->watch, "abort", why, (size_t)(n < (int)sizeof why ? n : (int)sizeof why - 1) + 1);
}

/* A process group's check: deaths are recorded in the job's namespace
 * under job ranks ("/dead" the first, "/dead/<rank>" each); only a member's
 * death fails the group's work (others' the deadline still covers). */
static dt_status group_check_dead(dt_comm *c, dt_work *w)
{
    char val[16] = "", key[40];
    size_t len = 0;
    int dead = -1;
    dt_status st = dt_store_get(c->watch, "/dead", val, sizeof val - 1, &len, 1);
    if (st == DT_OK)
        dead = atoi(val);
    int g = -1;
    for (int i = 0; dead >= 0 && i < c->world; i++)
        if (c->members[i] == dead)
            g = i;
    if (g < 0 && st != DT_ETIMEDOUT && st != DT_OK)
        return c->waiting_on >= 0 && c->members[c->waiting_on] == 0
                   ? work_fail(w, DT_EPEER, "%s #%u: job rank 0 is unreachable (dead?): %s",
                               coll_names[w->kind], w->seq, c->watch_errors->err)
                   : DT_OK;
    if (g < 0 && c->waiting_on >= 0) {   /* the first death was not a member's: ours? */
        snprintf(key, sizeof key, "/dead/%d", c->members[c->waiting_on]);
        if (dt_store_get(c->watch, key, val, sizeof val - 1, &len, 1) == DT_OK)
            g = c->waiting_on;
    }
    if (g < 0)
        return DT_OK;
    return work_fail(w, DT_EPEER, "%s #%u: rank %d (job rank %d) died (its process exited "
                     "without leaving the job)", coll_names[w->kind], w->seq, g, c->members[g]);
}

static dt_status check_dead(dt_comm *c, dt_work *w)
{
    double now = dt_now();
    if (!c->watch || now - c->last_watch < DT_COMM_WATCH_S)
        return DT_OK;
    c->last_watch = now;
    if (w->kind == COLL_PS)   /* other workers may come and go: only servers matter */
        return c->ps_ops->check_dead(c, w);
    char val[16] = "";
    size_t len = 0;
    /* a rank that failed published why: fail with its words */
    if (published_failure(c, w) != DT_OK)
        return w->status;
    dt_status st;
    if (c->members)
        return group_check_dead(c, w);
    st = dt_store_get(c->watch, "dead", val, sizeof val - 1, &len, 1);
    if (st == DT_ETIMEDOUT) {   /* nobody died: say whom we wait for (see follow_waits) */
        if (c->waiting_on >= 0) {
            char key[32], edge[32];
            snprintf(key, sizeof key, "wait/%d", c->rank);
            int n = snprintf(edge, sizeof edge, "%u:%d", w->seq, c->waiting_on);
            dt_store_set(c->watch, key, edge, (size_t)n + 1);
        }
        return DT_OK;
    }
    if (st == DT_OK)
        return work_fail(w, DT_EPEER, "%s #%u: rank %s died (its process exited without "
                         "leaving the job)", coll_names[w->kind], w->seq, val);
    return work_fail(w, DT_EPEER, "%s #%u: rank 0 is unreachable (dead?): %s",
                     coll_names[w->kind], w->seq, c->watch_errors->err);
}

/* Wait for every posted transfer (and the header), checking tags, until
 * the deadline; on failure cancel what is left so no buffer stays posted. */
/* Cancel the transfers to dead peers and wait (a second) until the
 * transport lets go of them; else fail, and the communicator closes its
 * endpoint rather than leave them pointing at freed memory. */
static int cancel_gone(dt_comm *c, xfers *xs)
{
    int left = 0;
    for (int i = 0; i < xs->n; i++)
        if (!xs->x[i].done && xfer_gone(xs, xs->x[i].peer)) {
            if (!xs->cancelled[i])   /* at once: a provider may hold other peers' */
                c->tp_iface->cancel(c->tp, &xs->x[i]);   /* completions behind it */
            xs->cancelled[i] = 1;
            left = 1;
        }
    return left;
}

/* Sends to a dead peer that neither complete nor cancel (a large message's
 * rendezvous on tcp;ofi_rxm, shm's answered sends) are orphaned: the
 * transport keeps them, and their records (this xfers) are kept until the
 * transport closes, so nothing it may still write is reused; the caller
 * (ps_run) goes on with a fresh record. */
static void drain_gone(dt_comm *c, xfers *xs)
{
    int left = cancel_gone(c, xs);
    for (double end = dt_now() + 1.0; left && dt_now() < end;) {
        dt_xfer *done[16];
        char err[256];
        if (c->tp_iface->poll(c->tp, done, 16, err, sizeof err) <= 0)
            c->tp_iface->wait(c->tp, 10);
        left = 0;
        for (int i = 0; i < xs->n; i++)
            left |= !xs->x[i].done && xfer_gone(xs, xs->x[i].peer);
    }
    xs->orphans = left;
}

/* Is x one of this record's transfers (not an orphan of an earlier one)? */
static int xfer_ours(const xfers *xs, const dt_xfer *x)
{
    return (x >= xs->x && x < xs->x + xs->n) || x == &xs->hdr_send || x == &xs->hdr_recv;
}

DT_PRIVATE dt_status wait_xfers(dt_comm *c, dt_work *w, xfers *xs)
{
    int limit_ms = (int)((xs->patience > 0 ? xs->patience : 1.0) * c->timeout_ms);
    double deadline = dt_now() + limit_ms / 1000.0;
    for (;;) {
        int pending = 0, silent_peer = -1;
        for (int i = 0; i < xs->n; i++) {
            if (!xs->x[i].done && !xfer_gone(xs, xs->x[i].peer)) {
                pending++;
                silent_peer = xs->x[i].peer;
            }
        }
        int hdr_pending = xs->has_hdr && (!xs->hdr_recv.done || !xs->hdr_send.done);
        if (xs->has_hdr && xs->hdr_recv.done && !xs->hdr_checked && check_header(c, w, xs) != DT_OK)
            break;
        if (!pending && !hdr_pending)
            break;
        dt_xfer *done[16];
        char err[256] = "";
        int k = c->tp_iface->poll(c->tp, done, 16, err, sizeof err);
        if (k < 0) {
            work_fail(w, DT_EPEER, "%s #%u: transport failure: %s", coll_names[w->kind], w->seq, err);
            break;
        }
        if (k > 0)
            seg_heartbeat(c);
        for (int i = 0; i < k; i++) {
            dt_xfer *x = done[i];
            if (!xfer_ours(xs, x))
                continue;   /* an orphaned send (drain_gone) let go at last */
            if (x->status != DT_OK && x != &xs->hdr_recv && !xfer_gone(xs, x->peer) &&
                !(xs->write_off && xs->write_off(c, xs->write_off_arg, x->peer)))
                work_fail(w, x->status == DT_EMISMATCH ? DT_EMISMATCH : DT_EPEER,
                          "%s #%u: transfer with rank %d failed (%s)", coll_names[w->kind], w->seq,
                          x->peer, dt_strerror(x->status));
        }
        if (w->status != DT_OK)
            break;
        int who = xs->has_hdr && !xs->hdr_recv.done
                      ? grp_rank(&xs->g, (xs->g.me - 1 + xs->g.size) % xs->g.size)
                      : silent_peer;
        c->waiting_on = who;
        if (k == 0 && check_dead(c, w) != DT_OK)
            break;
        if (k == 0 && xs->gone)
            cancel_gone(c, xs);
        if (k == 0) {
            if (dt_now() >= deadline) {
                blame_silent(w, who, limit_ms);
                break;
            }
            c->tp_iface->wait(c->tp, ms_left(deadline) < 50 ? ms_left(deadline) : 50);
        }
    }
    if (w->status != DT_OK) {
        for (int i = 0; i < xs->n; i++)
            if (!xs->x[i].done)
                c->tp_iface->cancel(c->tp, &xs->x[i]);
        if (xs->has_hdr && !xs->hdr_recv.done)
            c->tp_iface->cancel(c->tp, &xs->hdr_recv);
        if (xs->has_hdr && !xs->hdr_send.done)
            c->tp_iface->cancel(c->tp, &xs->hdr_send);
        return w->status;
    }
    if (xs->gone)
        drain_gone(c, xs);
    if (xs->orphans)
        return DT_OK;   /* the caller moves to a fresh record */
    memset(xs->cancelled, 0, (size_t)xs->n);
    xs->n = 0;
    return DT_OK;
}

/* Send our header right and receive the left one's; checked while the
 * collective's data moves. */
static dt_status start_header(dt_comm *c, dt_work *w, xfers *xs)
{
    grp g = xs->g;
    double patience = xs->patience;
    memset(xs, 0, sizeof *xs);
    xs->g = g;
    xs->patience = patience;
    if (g.size == 1)
        return DT_OK;
    xs->has_hdr = 1;
    xs->hdr_out = (coll_header){0x44545243u, (uint32_t)w->kind, w->seq, (uint32_t)w->root,
                                (uint32_t)w->op, 0, w->n};
    int right = grp_rank(&g, (g.me + 1) % g.size), left = grp_rank(&g, (g.me - 1 + g.size) % g.size);
    char err[256] = "";
    uint64_t tag = make_tag(w, TAG_HEADER_STEP, 0);
    double deadline = dt_now() + c->timeout_ms / 1000.0;
    dt_status st;
    if (c->tp_iface->recv(c->tp, left, tag, 0, &xs->hdr_in, sizeof xs->hdr_in,
                          &xs->hdr_recv, err, sizeof err) != DT_OK)
        return work_fail(w, DT_EPEER, "%s #%u: cannot post a receive from rank %d: %s",
                         coll_names[w->kind], w->seq, left, err);
    while ((st = c->tp_iface->send(c->tp, right, tag, &xs->hdr_out, sizeof xs->hdr_out,
                                   &xs->hdr_send, err, sizeof err)) == DT_ETIMEDOUT &&
           dt_now() < deadline) {
        c->last_watch = 0;   /* back-pressured: is rank `right` alive? */
        if (check_dead(c, w) != DT_OK)
            break;
    }
    if (w->status == DT_OK && st != DT_OK)
        work_fail(w, st == DT_ETIMEDOUT ? st : DT_EPEER, "%s #%u: cannot send to rank %d: %s",
                  coll_names[w->kind], w->seq, right, err);
    if (w->status != DT_OK) {
        c->tp_iface->cancel(c->tp, &xs->hdr_recv);
        xs->has_hdr = 0;
        return w->status;
    }
    return DT_OK;
}

/* --- the algorithms ----------------------------------------------------- */

/* dst op= src; the two never overlap (restrict lets the loops vectorise) */
static void reduce_into(float *restrict dst, const float *restrict src, int64_t n, dt_reduce_op op)
{
    if (op == DT_REDUCE_MAX)
        for (int64_t i = 0; i < n; i++)
            dst[i] = src[i] > dst[i] ? src[i] : dst[i];
    else if (op == DT_REDUCE_MIN)
        for (int64_t i = 0; i < n; i++)
            dst[i] = src[i] < dst[i] ? src[i] : dst[i];
    else
        for (int64_t i = 0; i < n; i++)
            dst[i] += src[i];
}

static float *comm_scratch(dt_comm *c, dt_work *w, int64_t n)
{
    if ((size_t)n <= c->scratch_floats)
        return c->scratch;
    float *p = c->ctx->al.realloc_fn(c->scratch, (size_t)n * sizeof(float), c->ctx->al.user);
    if (!p) {
        work_fail(w, DT_ENOMEM, "%s: out of memory for %lld floats", coll_names[w->kind],
                  (long long)n);
        return NULL;
    }
    c->scratch = p;
    c->scratch_floats = (size_t)n;
    return p;
}

/* Exchange with one peer: send `out`, receive into `in`, same size. */
static dt_status exchange(dt_comm *c, dt_work *w, xfers *xs, int peer, uint32_t step, float *out,
                          float *in, int64_t n)
{
    size_t bytes = (size_t)n * sizeof(float);
    if (post_chunked(c, w, xs, 0, peer, step, in, bytes) != DT_OK ||
        post_chunked(c, w, xs, 1, peer, step, out, bytes) != DT_OK)
        return w->status;
    return wait_xfers(c, w, xs);
}

/* Recursive doubling; ranks beyond the largest power of two fold into it
 * first and get the result back at the end. */
static dt_status allreduce_doubling(dt_comm *c, dt_work *w, xfers *xs, float *buf, int64_t n)
{
    const grp *g = &xs->g;
    int p2 = 1;
    while (p2 * 2 <= g->size)
        p2 *= 2;
    int r = g->me, extra = g->size - p2;
    float *tmp = comm_scratch(c, w, n);
    if (!tmp)
        return w->status;
    size_t bytes = (size_t)n * sizeof(float);
    uint32_t step = 0;
    if (r >= p2) {          /* fold into r - p2, then wait for the answer */
        if (post_chunked(c, w, xs, 1, grp_rank(g, r - p2), step, buf, bytes) != DT_OK ||
            post_chunked(c, w, xs, 0, grp_rank(g, r - p2), step + 1000, buf, bytes) != DT_OK)
            return w->status;
        return wait_xfers(c, w, xs);
    }
    if (r < extra) {
        if (post_chunked(c, w, xs, 0, grp_rank(g, r + p2), step, tmp, bytes) != DT_OK ||
            wait_xfers(c, w, xs) != DT_OK)
            return w->status;
        reduce_into(buf, tmp, n, w->op);
    }
    for (int mask = 1; mask < p2; mask <<= 1) {
        step++;
        if (exchange(c, w, xs, grp_rank(g, r ^ mask), step, buf, tmp, n) != DT_OK)
            return w->status;
        /* the same order on both sides keeps every rank's result identical */
        if (r < (r ^ mask)) {
            reduce_into(buf, tmp, n, w->op);
        } else {
            reduce_into(tmp, buf, n, w->op);
            memcpy(buf, tmp, bytes);
        }
    }
    if (r < extra) {
        if (post_chunked(c, w, xs, 1, grp_rank(g, r + p2), 1000, buf, bytes) != DT_OK)
            return w->status;
        return wait_xfers(c, w, xs);
    }
    return DT_OK;
}

/* [lo, hi) of block b when n is cut into `parts` near-equal blocks */
static void block_range(int64_t n, int parts, int b, int64_t *lo, int64_t *hi)
{
    *lo = n / parts * b + (b < n % parts ? b : n % parts);
    *hi = *lo + n / parts + (b < n % parts);
}

/* Ring reduce-scatter over buf cut into world blocks: afterwards block
 * (rank + 1) % world holds the full reduction. */
static dt_status ring_reduce_scatter(dt_comm *c, dt_work *w, xfers *xs, float *buf, int64_t n)
{
    int P = xs->g.size, r = xs->g.me;
    int right = grp_rank(&xs->g, (r + 1) % P), left = grp_rank(&xs->g, (r - 1 + P) % P);
    int64_t blo, bhi;
    block_range(n, P, 0, &blo, &bhi);
    float *tmp = comm_scratch(c, w, bhi - blo + 1);
    if (!tmp)
        return w->status;
    for (int s = 0; s < P - 1; s++) {
        int send_b = (r - s + P) % P, recv_b = (r - s - 1 + 2 * P) % P;
        int64_t slo, shi, rlo, rhi;
        block_range(n, P, send_b, &slo, &shi);
        block_range(n, P, recv_b, &rlo, &rhi);
        if (post_chunked(c, w, xs, 0, left, (uint32_t)s, tmp, (size_t)(rhi - rlo) * sizeof(float)) != DT_OK ||
            post_chunked(c, w, xs, 1, right, (uint32_t)s, buf + slo, (size_t)(shi - slo) * sizeof(float)) != DT_OK ||
            wait_xfers(c, w, xs) != DT_OK)
            return w->status;
        reduce_into(buf + rlo, tmp, rhi - rlo, w->op);
    }
    return DT_OK;
}

/* Ring allgather: block (rank + 1 - first) % world is complete here at the
 * start; after P-1 steps every block is. */
static dt_status ring_allgather(dt_comm *c, dt_work *w, xfers *xs, float *buf, int64_t n, int first,
                                uint32_t step0)
{
    int P = xs->g.size, r = xs->g.me;
    int right = grp_rank(&xs->g, (r + 1) % P), left = grp_rank(&xs->g, (r - 1 + P) % P);
    for (int s = 0; s < P - 1; s++) {
        int send_b = (r + first - s + P) % P, recv_b = (r + first - s - 1 + 2 * P) % P;
        int64_t slo, shi, rlo, rhi;
        block_range(n, P, send_b, &slo, &shi);
        block_range(n, P, recv_b, &rlo, &rhi);
        if (post_chunked(c, w, xs, 0, left, step0 + (uint32_t)s, buf + rlo, (size_t)(rhi - rlo) * sizeof(float)) != DT_OK ||
            post_chunked(c, w, xs, 1, right, step0 + (uint32_t)s, buf + slo, (size_t)(shi - slo) * sizeof(float)) != DT_OK ||
            wait_xfers(c, w, xs) != DT_OK)
            return w->status;
    }
    return DT_OK;
}

static void finish_avg(dt_comm *c, dt_work *w, float *buf, int64_t n)
{
    if (w->op == DT_REDUCE_AVG) {
        float k = 1.0f / (float)c->world;
        for (int64_t i = 0; i < n; i++)
            buf[i] *= k;
    }
}

/* Allreduce over the group in xs, without the average's final scaling. */
static dt_status allreduce_transport(dt_comm *c, dt_work *w, xfers *xs)
{
    int P = xs->g.size;
    if (w->kind == COLL_BARRIER && P > 2) {
        /* The header ring only proves the left neighbour arrived; an
         * allreduce of one float proves everyone did. */
        float one = 0;
        return allreduce_doubling(c, w, xs, &one, 1);
    }
    if (P == 1 || w->n == 0)
        return DT_OK;
    if ((size_t)w->n * sizeof(float) <= c->doubling_max || w->n < P)
        return allreduce_doubling(c, w, xs, w->buf, w->n);
    if (ring_reduce_scatter(c, w, xs, w->buf, w->n) != DT_OK)
        return w->status;
    return ring_allgather(c, w, xs, w->buf, w->n, 1, (uint32_t)P);
}

static dt_status run_allreduce(dt_comm *c, dt_work *w, xfers *xs)
{
    if (allreduce_transport(c, w, xs) != DT_OK)
        return w->status;
    finish_avg(c, w, w->buf, w->n);
    return DT_OK;
}

/* binomial tree from root */
static dt_status run_broadcast(dt_comm *c, dt_work *w, xfers *xs)
{
    int P = c->world, vr = (c->rank - w->root + P) % P;
    size_t bytes = (size_t)w->n * sizeof(float);
    int mask = 1;
    while (mask < P) {                 /* receive from the parent */
        if (vr & mask) {
            int parent = (vr - mask + w->root) % P;
            if (post_chunked(c, w, xs, 0, parent, (uint32_t)mask, w->buf, bytes) != DT_OK ||
                wait_xfers(c, w, xs) != DT_OK)
                return w->status;
            break;
        }
        mask <<= 1;
    }
    for (mask >>= 1; mask > 0; mask >>= 1) {   /* send to the children */
        if (vr + mask < P && post_chunked(c, w, xs, 1, (vr + mask + w->root) % P, (uint32_t)mask,
                                          w->buf, bytes) != DT_OK)
            return w->status;
    }
    return wait_xfers(c, w, xs);
}

static dt_status run_allgather(dt_comm *c, dt_work *w, xfers *xs)
{
    if (w->n == 0)
        return DT_OK;
    memcpy(w->buf + (int64_t)c->rank * w->n, w->in, (size_t)w->n * sizeof(float));
    if (c->world == 1)
        return DT_OK;
    /* blocks are exactly n each: total world*n cut into world blocks */
    return ring_allgather(c, w, xs, w->buf, w->n * c->world, 0, 0);
}

static dt_status run_reduce_scatter(dt_comm *c, dt_work *w, xfers *xs)
{
    int64_t total = w->n * c->world;
    float *work = c->ctx->al.malloc_fn((size_t)(total ? total : 1) * sizeof(float), c->ctx->al.user);
    if (!work)
        return work_fail(w, DT_ENOMEM, "reduce_scatter: out of memory");
    memcpy(work, w->in, (size_t)total * sizeof(float));
    dt_status st = c->world > 1 && w->n > 0 ? ring_reduce_scatter(c, w, xs, work, total) : DT_OK;
    if (st == DT_OK) {
        /* the complete block here is (rank + 1) % world; one more ring step
         * would move it, so send it to its owner instead */
        int P = c->world, have = (c->rank + 1) % P, want_from = (c->rank - 1 + P) % P;
        if (P > 1 && w->n > 0) {
            if (post_chunked(c, w, xs, 0, want_from, 5000, w->buf, (size_t)w->n * sizeof(float)) == DT_OK &&
                post_chunked(c, w, xs, 1, have, 5000, work + (int64_t)have * w->n,
                             (size_t)w->n * sizeof(float)) == DT_OK)
                wait_xfers(c, w, xs);
            st = w->status;
        } else {
            memcpy(w->buf, work, (size_t)w->n * sizeof(float));
        }
        if (st == DT_OK)
            finish_avg(c, w, w->buf, w->n);
    }
    c->ctx->al.free_fn(work, c->ctx->al.user);
    return st;
}

/* Alltoall: block q of in goes to rank q, block p of buf comes from rank p.
 * Step s sends to rank + s and receives from rank - s, so every pair of
 * ranks exchanges once and no rank waits on two peers at a time. */
static dt_status run_alltoall(dt_comm *c, dt_work *w, xfers *xs)
{
    int P = c->world, r = c->rank;
    size_t bytes = (size_t)w->n * sizeof(float);
    if (w->n == 0)
        return DT_OK;
    memcpy(w->buf + (int64_t)r * w->n, w->in + (int64_t)r * w->n, bytes);
    for (int s = 1; s < P; s++) {
        int to = (r + s) % P, from = (r - s + P) % P;
        if (post_chunked(c, w, xs, 0, from, (uint32_t)s, w->buf + (int64_t)from * w->n, bytes) != DT_OK ||
            post_chunked(c, w, xs, 1, to, (uint32_t)s, (void *)(w->in + (int64_t)to * w->n), bytes) != DT_OK ||
            wait_xfers(c, w, xs) != DT_OK)
            return w->status;
    }
    return DT_OK;
}

/* --- the host segment ------------------------------------------------ */
/*
 * Ranks on one host share a segment of POSIX shared memory, the way MPI's
 * vader and NCCL's SHM transport do.  Every local rank owns two slots of
 * seg_slot bytes; a collective copies a chunk into its slot, publishes a
 * phase counter, and reduces straight from the other ranks' slots.  A phase
 * costs one store and one cache-line read instead of a libfabric message.
 * A waiter spins for SEG_SPIN_S and then sleeps on a futex on the counter,
 * so an idle rank gives its core back to compute.  A collective run on the
 * caller's own thread (run_inline) spins up to SEG_SPIN_INLINE_S when the
 * host has a CPU for every local rank, as MPI's vader and NCCL busy-poll:
 * that thread has nothing else to do, and being woken from a futex costs
 * more than the typical wait for the other ranks (DDP's one allreduce a
 * step, 2 ranks of the benchmark MLP, medians of 8 interleaved runs: 6.71
 * ms a step with a 1 ms spin, 6.20 with 20 ms).  It still yields the CPU
 * every few iterations, and sleeps once the spin is over.
 *
 * Block k of a chunk is reduced by local rank k alone, always in local-rank
 * order, so every rank gets bit-identical results.  Slot reuse needs no
 * extra phase: a rank writes slot (g & 1) for chunk g only after passing
 * chunk g-1's first wait, and every rank publishes chunk g-1's first phase
 * after it finished reading chunk g-2.
 *
 * Mismatch detection: each rank writes a descriptor of its call next to its
 * counter before the call's first phase; after the first wait every rank
 * compares the others' with its own.  Failure: a rank that fails sets the
 * segment's abort word (with its message), which every waiter checks, and
 * waiters ask the store who died every DT_COMM_WATCH_S, as transfers do.
 */
#define SEG_MAGIC 0x44545347u
#define SEG_SLOT_DEFAULT ((size_t)1 << 20)
#define SEG_CHUNK_LARGE ((size_t)256 << 10)   /* chunk of buffers above SEG_LARGE */
#define SEG_LARGE ((size_t)4 << 20)
#define SEG_ONE_PHASE ((size_t)16 << 10)   /* allreduce: one phase, every rank reduces all */
#define SEG_SPIN_S 50e-6                   /* spin this long before sleeping */
#define SEG_SPIN_INLINE_S 20e-3

static size_t seg_ranks_offset(void) { return (sizeof(seg_head) + 127) & ~(size_t)127; }
static size_t seg_data_offset(int nlocal)
{
    return (seg_ranks_offset() + (size_t)nlocal * sizeof(seg_rank) + 4095) & ~(size_t)4095;
}

static void futex_wait_ms(_Atomic uint32_t *addr, uint32_t val, int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT, val, &ts, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *addr)
{
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int phase_reached(uint32_t have, uint32_t want) { return (int32_t)(have - want) >= 0; }

DT_PRIVATE float *seg_slot(dt_comm *c, int q, uint32_t chunk)
{
    return (float *)(c->seg_data + ((size_t)q * 2 + (chunk & 1)) * c->seg_slot);
}

/* A leader's transfers between hosts completed: the host's other ranks,
 * waiting for its result, see it alive. */
static void seg_heartbeat(dt_comm *c)
{
    if (c->seg && c->local_index == 0)
        atomic_fetch_add_explicit(&c->seg_ranks[0].progress, 1, memory_order_relaxed);
}

/* Tell the other local ranks this call failed, and why. */
static void seg_abort(dt_comm *c, const dt_work *w)
{
    seg_head *h = c->seg;
    uint32_t none = 0;
    if (!h || !atomic_compare_exchange_strong(&h->aborted, &none, 2))
        return;   /* another rank's reason is there (or being written) */
    snprintf(h->why, sizeof h->why, "%d|%s", (int)w->status, w->msg);
    atomic_store(&h->aborted, 1);   /* 1: the reason is complete */
    for (int q = 0; q < c->nlocal; q++)
        futex_wake_all(&c->seg_ranks[q].phase);
}

static dt_status seg_aborted(dt_comm *c, dt_work *w)
{
    for (int i = 0; i < 100000 && atomic_load(&c->seg->aborted) == 2; i++)
        cpu_relax();   /* its writer is a few instructions from done */
    if (atomic_load(&c->seg->aborted) != 1)
        return work_fail(w, DT_EPEER, "%s #%u: a rank on this host failed", coll_names[w->kind],
                         w->seq);
    return fail_with_reason(w, c->seg->why);
}

/* Wait until local rank q has published phase `want`.  The timeout counts
 * from q's last sign of life: a phase, or (a leader busy between hosts) a
 * completed transfer.  `patience` scales it: a rank waiting on its leader's
 * inter-host step allows more, so the leader's own, more precise error
 * comes first. */
static dt_status seg_wait(dt_comm *c, dt_work *w, int q, uint32_t want, double patience)
{
    seg_rank *r = &c->seg_ranks[q];
    double start = dt_now(), deadline = start + patience * c->timeout_ms / 1000.0;
    uint32_t seen = atomic_load_explicit(&r->progress, memory_order_relaxed);
    for (unsigned spin = 1;; spin++) {
        if (phase_reached(atomic_load_explicit(&r->phase, memory_order_acquire), want))
            return DT_OK;
        if (atomic_load_explicit(&c->seg->aborted, memory_order_acquire))
            return seg_aborted(c, w);
        if (spin % 16) {
            cpu_relax();
            continue;
        }
        double now = dt_now();
        if (now - start < (w->spin_s > 0 ? w->spin_s : SEG_SPIN_S)) {
            sched_yield();   /* several ranks per core: let the one we wait for run */
            continue;
        }
        c->waiting_on = c->local_ranks[q];
        if (check_dead(c, w) != DT_OK) {
            /* A rank that finished this phase and then died (or we were
             * descheduled past its death) does not spoil a phase we have:
             * the next wait that needs it will fail. */
            if (phase_reached(atomic_load_explicit(&r->phase, memory_order_acquire), want) &&
                !atomic_load_explicit(&c->seg->aborted, memory_order_acquire) &&
                w->status == DT_EPEER && strstr(w->msg, "died")) {
                w->status = DT_OK;
                w->msg[0] = '\0';
                return DT_OK;
            }
            return w->status;
        }
        uint32_t prog = atomic_load_explicit(&r->progress, memory_order_relaxed);
        if (prog != seen) {
            seen = prog;
            deadline = now + patience * c->timeout_ms / 1000.0;
        }
        if (now >= deadline)
            return blame_silent(w, c->local_ranks[q], (int)(patience * c->timeout_ms));
        atomic_fetch_add(&r->sleepers, 1);
        uint32_t v = atomic_load(&r->phase);
        if (!phase_reached(v, want) && !atomic_load(&c->seg->aborted))
            futex_wait_ms(&r->phase, v, 20);
        atomic_fetch_sub(&r->sleepers, 1);
    }
}

/* Describe this rank's call next to its counter, before its first phase.
 * call_phase 0 means "being written", so a call never starts at phase 0:
 * every rank skips it the same way, their counters being in step. */
static uint32_t seg_announce(dt_comm *c, const dt_work *w)
{
    seg_rank *me = &c->seg_ranks[c->local_index];
    if (c->seg_phase + 1 == 0)
        atomic_store(&me->phase, ++c->seg_phase);
    uint32_t p0 = c->seg_phase + 1;
    atomic_store_explicit(&me->call_phase, 0, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);   /* 0 ("being written") before the fields */
    atomic_store_explicit(&me->kind, (uint32_t)w->kind, memory_order_relaxed);
    atomic_store_explicit(&me->seq, w->seq, memory_order_relaxed);
    atomic_store_explicit(&me->root, (uint32_t)w->root, memory_order_relaxed);
    atomic_store_explicit(&me->op, (uint32_t)w->op, memory_order_relaxed);
    atomic_store_explicit(&me->n, w->n, memory_order_relaxed);
    atomic_store_explicit(&me->call_phase, p0, memory_order_release);
    return p0;
}

/* After the first wait: does every local rank's call match ours?  A rank
 * whose descriptor is already newer found us consistent and moved on. */
static dt_status seg_check(dt_comm *c, dt_work *w, uint32_t p0)
{
    for (int q = 0; q < c->nlocal; q++) {
        seg_rank *r = &c->seg_ranks[q];
        if (q == c->local_index || atomic_load_explicit(&r->call_phase, memory_order_acquire) != p0)
            continue;
        int kind = (int)atomic_load_explicit(&r->kind, memory_order_relaxed);
        uint32_t seq = atomic_load_explicit(&r->seq, memory_order_relaxed);
        int root = (int)atomic_load_explicit(&r->root, memory_order_relaxed);
        int op = (int)atomic_load_explicit(&r->op, memory_order_relaxed);
        int64_t n = atomic_load_explicit(&r->n, memory_order_relaxed);
        atomic_thread_fence(memory_order_acquire);   /* the fields before the re-check */
        if (atomic_load_explicit(&r->call_phase, memory_order_relaxed) != p0)
            continue;
        if (kind != w->kind || seq != w->seq || n != w->n || root != w->root || op != (int)w->op) {
            char mine[96], theirs[96];
            describe_call(mine, sizeof mine, w->kind, w->n, w->root, (int)w->op);
            describe_call(theirs, sizeof theirs, kind, n, root, op);
            if (seq != w->seq)
                return work_fail(w, DT_EMISMATCH, "collective #%u: rank %d called %s, rank %d is "
                                 "at collective #%u, %s", w->seq, c->rank, mine,
                                 c->local_ranks[q], seq, theirs);
            return work_fail(w, DT_EMISMATCH, "collective #%u: rank %d called %s, rank %d called %s",
                             w->seq, c->rank, mine, c->local_ranks[q], theirs);
        }
    }
    return DT_OK;
}

/* Publish our next phase and wait for every local rank to reach it; p0
 * nonzero: this is the call's first phase (seg_announce never returns 0),
 * check the descriptors. */
static dt_status seg_sync(dt_comm *c, dt_work *w, uint32_t p0, double patience)
{
    seg_rank *me = &c->seg_ranks[c->local_index];
    uint32_t ph = ++c->seg_phase;
    atomic_store_explicit(&me->phase, ph, memory_order_seq_cst);
    if (atomic_load_explicit(&me->sleepers, memory_order_seq_cst))
        futex_wake_all(&me->phase);
    for (int q = 0; q < c->nlocal; q++)
        if (q != c->local_index && seg_wait(c, w, q, ph, patience) != DT_OK)
            return w->status;
    return p0 ? seg_check(c, w, p0) : DT_OK;
}

/* dst = a op b, elementwise; nothing aliases. */
static void reduce2(float *restrict dst, const float *restrict a, const float *restrict b, int64_t n,
                    dt_reduce_op op)
{
    if (op == DT_REDUCE_MAX)
        for (int64_t i = 0; i < n; i++)
            dst[i] = b[i] > a[i] ? b[i] : a[i];
    else if (op == DT_REDUCE_MIN)
        for (int64_t i = 0; i < n; i++)
            dst[i] = b[i] < a[i] ? b[i] : a[i];
    else
        for (int64_t i = 0; i < n; i++)
            dst[i] = a[i] + b[i];
}

/* Floats per chunk for a buffer of n floats.  Up to 4 MiB, whole slots:
 * fewer phases.  Above, 256 KiB chunks: every rank's two slots stay in
 * cache while the user buffers stream (bench_allreduce, 2 ranks: 1 MiB
 * chunks ran 16 MiB at 5.7 GB/s and 256 KiB chunks at 9).  Chunking never
 * changes the arithmetic, only where the phases fall. */
static int64_t seg_chunk_floats(const dt_comm *c, int64_t n)
{
    size_t bytes = (size_t)n * sizeof(float) > SEG_LARGE && c->seg_slot > SEG_CHUNK_LARGE
                       ? SEG_CHUNK_LARGE : c->seg_slot;
    return (int64_t)(bytes / sizeof(float));
}

/* dst (outside the segment) = every local rank's [lo, lo+cnt) of chunk g,
 * reduced in local-rank order. */
static void seg_reduce_block(dt_comm *c, float *dst, uint32_t g, int64_t lo, int64_t cnt,
                             dt_reduce_op op)
{
    reduce2(dst, seg_slot(c, 0, g) + lo, seg_slot(c, 1, g) + lo, cnt, op);
    for (int q = 2; q < c->nlocal; q++)
        reduce_into(dst, seg_slot(c, q, g) + lo, cnt, op);
}

/* Copy into our own slot for the other local ranks to read, counting the
 * bytes as sent (dt_comm_bytes_sent). */
static void seg_put(dt_comm *c, void *slot, const void *src, size_t bytes)
{
    memcpy(slot, src, bytes);
    __atomic_fetch_add(&c->bytes_sent, (uint64_t)bytes, __ATOMIC_RELAXED);
}

/* Allreduce over the host's ranks (to_all) or reduce to local rank 0 (the
 * leader, for the hierarchical allreduce); scale: apply the average. */
static dt_status seg_allreduce(dt_comm *c, dt_work *w, int to_all, int scale)
{
    int L = c->nlocal, me = c->local_index;
    size_t bytes = (size_t)w->n * sizeof(float);
    uint32_t p0 = seg_announce(c, w);
    if (bytes <= SEG_ONE_PHASE && bytes <= c->seg_slot) {   /* every rank (or the leader) reduces it all */
        uint32_t g = c->seg_chunk++;
        if (bytes)
            seg_put(c, seg_slot(c, me, g), w->buf, bytes);
        if (seg_sync(c, w, p0, 1.0) != DT_OK)
            return w->status;
        if (w->n > 0 && (to_all || me == 0))
            seg_reduce_block(c, w->buf, g, 0, w->n, w->op);
        if (scale)
            finish_avg(c, w, w->buf, w->n);
        return DT_OK;
    }
    int64_t per = seg_chunk_floats(c, w->n);
    for (int64_t off = 0; off < w->n; off += per) {
        int64_t cnt = w->n - off < per ? w->n - off : per, lo, hi;
        uint32_t g = c->seg_chunk++;
        float *mine = seg_slot(c, me, g), *out = w->buf + off;
        seg_put(c, mine, out, (size_t)cnt * sizeof(float));
        if (seg_sync(c, w, off == 0 ? p0 : 0, 1.0) != DT_OK)
            return w->status;
        block_range(cnt, L, me, &lo, &hi);
        seg_reduce_block(c, out + lo, g, lo, hi - lo, w->op);
        if (scale)
            finish_avg(c, w, out + lo, hi - lo);
        seg_put(c, mine + lo, out + lo, (size_t)(hi - lo) * sizeof(float));
        if (seg_sync(c, w, 0, 1.0) != DT_OK)
            return w->status;
        for (int q = 0; q < L && (to_all || me == 0); q++) {
            if (q == me)
                continue;
            block_range(cnt, L, q, &lo, &hi);
            memcpy(out + lo, seg_slot(c, q, g) + lo, (size_t)(hi - lo) * sizeof(float));
        }
    }
    return DT_OK;
}

/* Local rank `from` gives buf to the host's other ranks.  p0 nonzero: the
 * call's first phase (announced); patience: see seg_wait. */
static dt_status seg_broadcast(dt_comm *c, dt_work *w, int from, float *buf, int64_t n, uint32_t p0,
                               double patience)
{
    int64_t per = seg_chunk_floats(c, n), off = 0;
    do {
        int64_t cnt = n - off < per ? n - off : per;
        uint32_t g = c->seg_chunk++;
        if (c->local_index == from && cnt > 0)
            seg_put(c, seg_slot(c, from, g), buf + off, (size_t)cnt * sizeof(float));
        if (seg_sync(c, w, off == 0 ? p0 : 0, patience) != DT_OK)
            return w->status;
        if (c->local_index != from && cnt > 0)
            memcpy(buf + off, seg_slot(c, from, g), (size_t)cnt * sizeof(float));
        off += cnt;
    } while (off < n);
    return DT_OK;
}

/* Every rank's n floats into out[rank * n], ranks all on this host. */
static dt_status seg_allgather(dt_comm *c, dt_work *w)
{
    int64_t per = seg_chunk_floats(c, w->n), off = 0, n = w->n;
    uint32_t p0 = seg_announce(c, w);
    do {
        int64_t cnt = n - off < per ? n - off : per;
        uint32_t g = c->seg_chunk++;
        if (cnt > 0)
            seg_put(c, seg_slot(c, c->local_index, g), w->in + off, (size_t)cnt * sizeof(float));
        if (seg_sync(c, w, off == 0 ? p0 : 0, 1.0) != DT_OK)
            return w->status;
        for (int q = 0; q < c->nlocal && cnt > 0; q++)
            memcpy(w->buf + (int64_t)c->local_ranks[q] * n + off, seg_slot(c, q, g),
                   (size_t)cnt * sizeof(float));
        off += cnt;
    } while (off < n);
    return DT_OK;
}

/* out = block `rank` of every rank's in (world blocks of n), reduced. */
static dt_status seg_reduce_scatter(dt_comm *c, dt_work *w)
{
    int L = c->nlocal, me = c->local_index;
    int64_t per = seg_chunk_floats(c, w->n * L) / L, off = 0, n = w->n;
    per = per > 0 ? per : 1;
    uint32_t p0 = seg_announce(c, w);
    do {
        int64_t cnt = n - off < per ? n - off : per;
        uint32_t g = c->seg_chunk++;
        float *mine = seg_slot(c, me, g);
        for (int q = 0; q < L && cnt > 0; q++)   /* block of local rank q, at q * cnt */
            seg_put(c, mine + q * cnt, w->in + (int64_t)c->local_ranks[q] * n + off,
                   (size_t)cnt * sizeof(float));
        if (seg_sync(c, w, off == 0 ? p0 : 0, 1.0) != DT_OK)
            return w->status;
        if (cnt > 0)
            seg_reduce_block(c, w->buf + off, g, me * cnt, cnt, w->op);
        off += cnt;
    } while (off < n);
    finish_avg(c, w, w->buf, n);
    return DT_OK;
}

/* Alltoall inside the host: each rank puts the blocks meant for the others
 * in its slot; each reads its own block from every slot. */
static dt_status seg_alltoall(dt_comm *c, dt_work *w)
{
    int L = c->nlocal, me = c->local_index;
    int64_t per = seg_chunk_floats(c, w->n * L) / L, off = 0, n = w->n;
    per = per > 0 ? per : 1;
    uint32_t p0 = seg_announce(c, w);
    int64_t mine_at = (int64_t)c->local_ranks[me] * n;
    if (n > 0)
        memcpy(w->buf + mine_at, w->in + mine_at, (size_t)n * sizeof(float));
    do {
        int64_t cnt = n - off < per ? n - off : per;
        uint32_t g = c->seg_chunk++;
        float *slot = seg_slot(c, me, g);
        for (int q = 0; q < L && cnt > 0; q++)   /* the block for local rank q, at q * cnt */
            if (q != me)
                seg_put(c, slot + q * cnt, w->in + (int64_t)c->local_ranks[q] * n + off,
                        (size_t)cnt * sizeof(float));
        if (seg_sync(c, w, off == 0 ? p0 : 0, 1.0) != DT_OK)
            return w->status;
        for (int q = 0; q < L && cnt > 0; q++)
            if (q != me)
                memcpy(w->buf + (int64_t)c->local_ranks[q] * n + off, seg_slot(c, q, g) + me * cnt,
                       (size_t)cnt * sizeof(float));
        off += cnt;
    } while (off < n);
    return DT_OK;
}

/* Allreduce of a buffer in a shared region (DDP's buckets): no copy into
 * slots.  Once every rank's buffer is final, local rank k reduces block k
 * of all of them, in local-rank order as seg_reduce_block does (so results
 * are bit-identical to the slot path), into its own buffer; then each rank
 * copies the other blocks from their owners' buffers.  A last phase keeps
 * every buffer unwritten until nobody reads it.  Per rank that moves
 * about 2(L-1)/L of the buffer, against 3 + (L-1)/L through the slots. */
static dt_status seg_allreduce_shared(dt_comm *c, dt_work *w)
{
    const shm_region *r = w->aux;
    int L = c->nlocal, me = c->local_index;
    size_t off = (size_t)((char *)w->buf - (r->base + (size_t)me * r->part));
    int64_t lo, hi, n = w->n;
    uint32_t p0 = seg_announce(c, w);
    if (seg_sync(c, w, p0, 1.0) != DT_OK)
        return w->status;
    block_range(n, L, me, &lo, &hi);
    float tile[2048];
    for (int64_t i = lo; i < hi; i += 2048) {
        int64_t cnt = hi - i < 2048 ? hi - i : 2048;
        const float *part0 = (const float *)(r->base + off) + i;
        reduce2(tile, part0, (const float *)(r->base + r->part + off) + i, cnt, w->op);
        for (int q = 2; q < L; q++)
            reduce_into(tile, (const float *)(r->base + (size_t)q * r->part + off) + i, cnt, w->op);
        finish_avg(c, w, tile, cnt);
        memcpy(w->buf + i, tile, (size_t)cnt * sizeof(float));
    }
    if (seg_sync(c, w, 0, 1.0) != DT_OK)
        return w->status;
    for (int q = 0; q < L; q++) {
        if (q == me)
            continue;
        int64_t qlo, qhi;
        block_range(n, L, q, &qlo, &qhi);
        memcpy(w->buf + qlo, (const float *)(r->base + (size_t)q * r->part + off) + qlo,
               (size_t)(qhi - qlo) * sizeof(float));
    }
    /* what the other ranks read of ours: our part of their blocks, and our block */
    uint64_t read_by_others = (uint64_t)(n - (hi - lo)) + (uint64_t)(L - 1) * (uint64_t)(hi - lo);
    __atomic_fetch_add(&c->bytes_sent, read_by_others * sizeof(float), __ATOMIC_RELAXED);
    return seg_sync(c, w, 0, 1.0);
}

/* --- 16-bit allreduce: bf16 or fp16 on the wire ---------------------------
 * root says which (1 bf16, 2 fp16).  Each rank encodes its buffer in
 * P blocks; an alltoall gives rank r every rank's block r; rank r sums them
 * in rank order in fp32 (and averages), encodes its block again, and an
 * allgather gives everyone every block.  All ranks decode the same bytes,
 * so all get the same values; each rank sends 2 x (P-1)/P x 2 bytes per
 * value, half of the fp32 ring's, at any P. */
static void enc16(int codec, const float *x, int64_t n, uint16_t *out)
{
    for (int64_t i = 0; i < n; i++)
        out[i] = codec == 1 ? f32_to_bf16(x[i]) : f32_to_f16(x[i]);
}

static float dec16(int codec, uint16_t h) { return codec == 1 ? bf16_to_f32(h) : f16_to_f32(h); }

/* A part of w run as its own kind of collective, same sequence number. */
static dt_work sub_work(const dt_work *w, int kind, const float *in, float *buf, int64_t n)
{
    dt_work sub = *w;
    sub.kind = kind;
    sub.in = in;
    sub.buf = buf;
    sub.n = n;
    return sub;
}

static dt_status sub_result(dt_work *w, const dt_work *sub)
{
    if (sub->status != DT_OK && w->status == DT_OK) {
        w->status = sub->status;
        snprintf(w->msg, sizeof w->msg, "%s", sub->msg);
        w->blame = sub->blame;
        w->blame_ms = sub->blame_ms;
    }
    return w->status;
}

static dt_status allreduce16(dt_comm *c, dt_work *w, xfers *xs, int on_segment)
{
    int P = c->world, r = c->rank, codec = w->root;
    int64_t n = w->n, B = (n + P - 1) / P, Bf = (B + 1) / 2;   /* Bf floats hold B halves */
    if (n == 0)
        return DT_OK;
    size_t bytes = (size_t)(2 * P * Bf + B) * sizeof(float);
    float *mem = c->ctx->al.malloc_fn(bytes, c->ctx->al.user);
    if (!mem)
        return work_fail(w, DT_ENOMEM, "16-bit allreduce: out of memory");
    memset(mem, 0, bytes);
    float *send = mem, *recv = mem + (int64_t)P * Bf, *acc = recv + (int64_t)P * Bf;
    for (int q = 0; q < P; q++) {
        int64_t lo = q * B < n ? q * B : n, hi = lo + B < n ? lo + B : n;
        enc16(codec, w->buf + lo, hi - lo, (uint16_t *)(send + (int64_t)q * Bf));
    }
    if (!on_segment && xs->has_hdr) {   /* the call's header first: the parts below have none */
        if (wait_xfers(c, w, xs) != DT_OK)
            goto out;
        xs->has_hdr = 0;
    }
    dt_work sub = sub_work(w, COLL_ALLTOALL, send, recv, Bf);
    if (sub_result(w, (on_segment ? seg_alltoall(c, &sub) : run_alltoall(c, &sub, xs), &sub)) != DT_OK)
        goto out;
    int64_t mlo = r * B < n ? r * B : n, mn = (mlo + B < n ? mlo + B : n) - mlo;
    for (int p = 0; p < P; p++) {   /* rank order: the same sum everywhere */
        const uint16_t *h = (const uint16_t *)(recv + (int64_t)p * Bf);
        for (int64_t i = 0; i < mn; i++)
            acc[i] += dec16(codec, h[i]);
    }
    if (w->op == DT_REDUCE_AVG)
        for (int64_t i = 0; i < mn; i++)
            acc[i] /= (float)P;
    memset(send, 0, (size_t)Bf * sizeof(float));
    enc16(codec, acc, mn, (uint16_t *)send);
    dt_work sub2 = sub_work(w, COLL_ALLGATHER, send, recv, Bf);
    if (sub_result(w, (on_segment ? seg_allgather(c, &sub2) : run_allgather(c, &sub2, xs), &sub2)) != DT_OK)
        goto out;
    for (int q = 0; q < P; q++) {
        int64_t lo = q * B < n ? q * B : n, hi = lo + B < n ? lo + B : n;
        const uint16_t *h = (const uint16_t *)(recv + (int64_t)q * Bf);
        for (int64_t i = lo; i < hi; i++)
            w->buf[i] = dec16(codec, h[i - lo]);
    }
out:
    c->ctx->al.free_fn(mem, c->ctx->al.user);
    return w->status;
}

/* Every rank on this host: the collective over the segment alone. */
static dt_status run_on_segment(dt_comm *c, dt_work *w)
{
    switch (w->kind) {
    case COLL_ALLREDUCE: case COLL_BARRIER: return seg_allreduce(c, w, 1, 1);
    case COLL_BROADCAST: {
        int from = 0;
        while (c->local_ranks[from] != w->root)
            from++;
        uint32_t p0 = seg_announce(c, w);
        return seg_broadcast(c, w, from, w->buf, w->n, p0, 1.0);
    }
    case COLL_ALLGATHER: return seg_allgather(c, w);
    case COLL_REDUCE_SCATTER: return seg_reduce_scatter(c, w);
    case COLL_ALLTOALL: return seg_alltoall(c, w);
    case COLL_ALLREDUCE16: return allreduce16(c, w, NULL, 1);
    case COLL_ALLREDUCE_SHARED: return seg_allreduce_shared(c, w);
    }
    return work_fail(w, DT_EINVAL, "unknown collective %d", w->kind);
}

static dt_status run_flat(dt_comm *c, dt_work *w, xfers *xs)
{
    switch (w->kind) {
    case COLL_ALLREDUCE: case COLL_BARRIER: case COLL_ALLREDUCE_SHARED: run_allreduce(c, w, xs); break;
    case COLL_BROADCAST: run_broadcast(c, w, xs); break;
    case COLL_ALLGATHER: run_allgather(c, w, xs); break;
    case COLL_REDUCE_SCATTER: run_reduce_scatter(c, w, xs); break;
    case COLL_ALLTOALL: run_alltoall(c, w, xs); break;
    case COLL_ALLREDUCE16: allreduce16(c, w, xs, 0); break;
    }
    if (w->status == DT_OK)
        wait_xfers(c, w, xs);   /* the header, if the data finished first */
    return w->status;
}

/* Ranks on several hosts.  Allreduce (and barrier): reduce inside the host
 * to its leader over the segment, allreduce between leaders over the
 * transport, give the result back over the segment.  The other collectives
 * run over the transport between all ranks; the segment and the leaders'
 * headers still check that every rank called the same thing. */
static dt_status run_hierarchical(dt_comm *c, dt_work *w, xfers *xs)
{
    int reduce = w->kind == COLL_ALLREDUCE || w->kind == COLL_BARRIER;
    if (c->seg) {
        if (reduce ? seg_allreduce(c, w, 0, 0) : seg_sync(c, w, seg_announce(c, w), 1.0))
            return w->status;
    }
    if (c->local_index == 0) {
        /* more patient than the waits inside a host, so a rank hung there is
         * named by its own leader before the other hosts blame the leader */
        xs->g = (grp){c->leader_index, c->nhosts, c->leaders};
        xs->patience = 1.5;
        if (start_header(c, w, xs) != DT_OK)
            return w->status;
        if (reduce && allreduce_transport(c, w, xs) == DT_OK)
            finish_avg(c, w, w->buf, w->n);
        if (w->status != DT_OK || wait_xfers(c, w, xs) != DT_OK)
            return w->status;
    }
    if (reduce)
        return c->seg ? seg_broadcast(c, w, 0, w->buf, w->n, 0, 2.0) : DT_OK;
    xs->g = (grp){c->rank, c->world, NULL};
    xs->has_hdr = 0;   /* checked above */
    xs->patience = 1.0;
    return run_flat(c, w, xs);
}

static uint64_t p2p_tag(uint32_t seq, uint32_t chunk)
{
    return (uint64_t)(COLL_P2P << 8) << TAG_CHECK_SHIFT | (uint64_t)(seq & 0xFFFFFF) << 28 |
           (uint64_t)(chunk & 0xFFFFFFu);
}

static void run_p2p(dt_comm *c, dt_work *w, xfers *xs)
{
    const p2p_call *p = w->aux;
    size_t chunk = c->max_msg, sb = (size_t)p->ns * sizeof(float), rb = (size_t)p->nr * sizeof(float);
    size_t rchunks = 0;
    for (size_t off = 0, k = 0; p->nr >= 0 && p->src >= 0 && (off < rb || k == 0); off += chunk, k++) {
        size_t len = rb - off < chunk ? rb - off : chunk;
        rchunks++;
        if (post(c, w, xs, 0, p->src, p2p_tag(p->rseq, (uint32_t)k), (char *)p->recv + off, len) !=
            DT_OK)
            return;
    }
    for (size_t off = 0, k = 0; p->dst >= 0 && (off < sb || k == 0); off += chunk, k++) {
        size_t len = sb - off < chunk ? sb - off : chunk;
        if (post(c, w, xs, 1, p->dst, p2p_tag(p->sseq, (uint32_t)k), (char *)p->send + off, len) !=
            DT_OK)
            return;
    }
    if (wait_xfers(c, w, xs) != DT_OK)
        return;
    size_t got = 0;   /* the receives came first in xs (wait_xfers keeps them) */
    for (size_t i = 0; p->src >= 0 && i < rchunks; i++)
        got += xs->x[i].len;
    if (p->src >= 0 && got != rb)
        work_fail(w, DT_EMISMATCH, "recv: rank %d sent %zu floats, %lld expected", p->src,
                  got / sizeof(float), (long long)p->nr);
}

static void run_work(dt_comm *c, dt_work *w)
{
    if (w->ticket)   /* its data is still on the way from the device (even if it won't go) */
        c->ctx->be_iface->copy_wait(c->ctx->be, w->ticket);
    if (c->broken) {
        work_fail(w, DT_ESTATE, "%s #%u: communicator failed earlier: %s", coll_names[w->kind],
                  w->seq, c->broken_msg);
        return;
    }

    c->waiting_on = -1;
    xfers *xs = c->ctx->al.malloc_fn(sizeof *xs, c->ctx->al.user);
    if (!xs) {
        work_fail(w, DT_ENOMEM, "%s: out of memory", coll_names[w->kind]);
    } else {
        memset(xs, 0, sizeof *xs);
        xs->g = (grp){c->rank, c->world, NULL};
        if (w->kind == COLL_PS)
            c->ps_ops->run(c, w, &xs);
        else if (w->kind == COLL_P2P)
            run_p2p(c, w, xs);
        else if (c->use_segment && c->nhosts == 1)
            run_on_segment(c, w);
        else if (c->use_segment)
            run_hierarchical(c, w, xs);
        else if (start_header(c, w, xs) == DT_OK)
            run_flat(c, w, xs);
    }
    /* A lost connection or a silent peer is usually the consequence of
     * another rank's failure: report the cause if one was published, else
     * publish ours, so every rank of every host fails with the same words. */
    if (w->status == DT_EPEER || w->status == DT_ETIMEDOUT)
        published_failure(c, w);
    if (w->status == DT_ETIMEDOUT && w->blame >= 0)
        follow_waits(c, w);
    if (w->status != DT_OK)
        publish_failure(c, w);
    if (w->status != DT_OK) {
        /* Close the endpoint now: a cancelled receive must not land in
         * this record or in the caller's buffer after the call returned.
         * The communicator refuses all later work anyway. */
        c->broken = 1;
        snprintf(c->broken_msg, sizeof c->broken_msg, "%s", w->msg);
        seg_abort(c, w);
        c->tp_iface->close(c->tp);
        c->tp = NULL;
    }
    if (xs)
        c->ctx->al.free_fn(xs, c->ctx->al.user);
}

/* --- the comm thread and the caller's side --------------------------- */

static void *comm_main(void *arg)
{
    dt_comm *c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->stop && !c->head)
            pthread_cond_wait(&c->cv, &c->mu);
        if (!c->head)
            break;   /* stop requested and the queue is drained */
        if (c->running) {   /* the caller runs one inline; wait for it to finish */
            pthread_cond_wait(&c->cv, &c->mu);
            continue;
        }
        dt_work *w = c->head;
        c->head = w->next;
        if (!c->head)
            c->tail = NULL;
        c->running = 1;
        pthread_mutex_unlock(&c->mu);
        double t0 = dt_now();
        run_work(c, w);
        double t1 = dt_now();
        w->run_s = t1 - t0;
        prof_coll(c, w, t0, t1);
        pthread_mutex_lock(&c->mu);
        c->running = 0;
        w->done = 1;
        pthread_cond_broadcast(&c->cv);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* A restarted rank's communicator runs no collective: the others
 * are mid-job, and nothing would match. */
static dt_status rejoined_refuses(dt_comm *c, int kind)
{
    if (!c->inc || kind == COLL_PS)
        return DT_OK;
    return set_error(c->ctx, DT_ESTATE, "%s: rank %d is a restarted process that rejoined a "
                     "running job; only parameter-server requests work on its communicator",
                     coll_names[kind], c->rank);
}

DT_PRIVATE dt_work *enqueue_in(dt_comm *c, int kind, float *buf, const float *in, int64_t n, int root,
                           dt_reduce_op op, const void *aux)
{
    dt_ctx *ctx = c->ctx;
    if (rejoined_refuses(c, kind) != DT_OK)
        return NULL;
    dt_work *w = host_calloc(ctx, sizeof *w);
    if (!w) {
        set_error(ctx, DT_ENOMEM, "%s: out of memory", coll_names[kind]);
        return NULL;
    }
    *w = (dt_work){.comm = c, .kind = kind, .root = root, .op = op, .buf = buf, .in = in, .n = n,
                   .aux = aux, .blame = -1, .ticket = c->stage_ticket};
    c->stage_ticket = 0;
    pthread_mutex_lock(&c->mu);
    /* collectives' order only: requests and point-to-point messages have their own */
    w->seq = kind == COLL_PS ? c->ps_requests++ : kind == COLL_P2P ? 0 : c->next_seq++;
    if (c->tail)
        c->tail->next = w;
    else
        c->head = w;
    c->tail = w;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return w;
}

DT_PRIVATE dt_work *enqueue(dt_comm *c, int kind, float *buf, const float *in, int64_t n, int root,
                        dt_reduce_op op)
{
    return enqueue_in(c, kind, buf, in, n, root, op, NULL);
}

/* Wait for w, free it, and give the seconds it ran (run_s may be NULL). */
DT_PRIVATE dt_status work_finish(dt_work *w, double *run_s)
{
    dt_comm *c = w->comm;
    pthread_mutex_lock(&c->mu);
    while (!w->done)
        pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
    dt_status st = w->status;
    if (st != DT_OK)
        set_error(c->ctx, st, "%s%s", c->label, w->msg);
    if (run_s)
        *run_s = w->run_s;
    host_free(c->ctx, w->owned);
    host_free(c->ctx, w);
    return st;
}

dt_status dt_work_wait(dt_work *w)
{
    if (!w)
        return DT_EINVAL;
    dt_ctx *ctx = w->comm->ctx;
    double t0 = prof_begin(ctx);
    dt_status st = work_finish(w, NULL);
    prof_end(ctx, PH_COMM_WAIT, t0);
    return st;
}

static int coll_args_ok(dt_comm *c, const char *op, const void *buf, int64_t n)
{
    if (!c)
        return 0;
    if (n < 0 || (n > 0 && !buf) || n > INT64_MAX / 4 / (c->world ? c->world : 1)) {
        set_error(c->ctx, DT_EINVAL, "%s: buffer is NULL or n = %lld is out of range", op,
                  (long long)n);
        return 0;
    }
    return 1;
}

static int op_ok(dt_comm *c, const char *name, dt_reduce_op op)
{
    if (op < DT_REDUCE_SUM || op > DT_REDUCE_MIN) {
        set_error(c->ctx, DT_EINVAL, "%s: unknown reduction %d", name, (int)op);
        return 0;
    }
    return 1;
}

dt_work *dt_allreduce_async(dt_comm *c, float *buf, int64_t n, dt_reduce_op op)
{
    if (!coll_args_ok(c, "allreduce", buf, n) || !op_ok(c, "allreduce", op))
        return NULL;
    return enqueue(c, COLL_ALLREDUCE, buf, NULL, n, 0, op);
}

/* A blocking collective with nothing queued ahead of it runs right here on
 * the caller's thread: handing it to the sleeping comm thread and being
 * woken back costs two kernel wake-ups, two thirds of a 4 KiB allreduce
 * (tests/bench/allreduce.sh profile).  `running` keeps the comm thread off
 * the transport meanwhile. */
static dt_status run_inline(dt_comm *c, int kind, float *buf, const float *in, int64_t n,
                            int root, dt_reduce_op op, const void *aux)
{
    pthread_mutex_lock(&c->mu);
    if (c->head || c->running) {
        pthread_mutex_unlock(&c->mu);
        return DT_ESTATE;   /* busy: queue it instead */
    }
    c->running = 1;
    dt_work w = {.comm = c, .kind = kind, .root = root, .op = op, .buf = buf, .in = in, .n = n,
                 .aux = aux, .spin_s = c->inline_spin_s, .blame = -1};
    w.seq = kind == COLL_P2P ? 0 : c->next_seq++;
    pthread_mutex_unlock(&c->mu);
    double t0 = dt_now();
    run_work(c, &w);
    prof_coll(c, &w, t0, dt_now());
    pthread_mutex_lock(&c->mu);
    c->running = 0;
    if (c->head)   /* the comm thread waits for us only when work is queued */
        pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    if (w.status != DT_OK)
        set_error(c->ctx, w.status, "%s%s", c->label, w.msg);
    return w.status;
}

DT_PRIVATE dt_status run_collective_wait(dt_comm *c, int kind, float *buf, const float *in,
                                     int64_t n, int root, dt_reduce_op op, const void *aux)
{
    if (rejoined_refuses(c, kind) != DT_OK)
        return DT_ESTATE;
    if (c->inline_small) {
        dt_status st = run_inline(c, kind, buf, in, n, root, op, aux);
        if (st != DT_ESTATE || c->broken)
            return st;
    }
    dt_work *w = enqueue_in(c, kind, buf, in, n, root, op, aux);
    return w ? work_finish(w, NULL) : c->ctx->last_status;
}

/* A blocking collective: the caller's wait is communication it sees. */
DT_PRIVATE dt_status run_collective_in(dt_comm *c, int kind, float *buf, const float *in, int64_t n,
                                   int root, dt_reduce_op op, const void *aux)
{
    double t0 = prof_begin(c->ctx);
    dt_status st = run_collective_wait(c, kind, buf, in, n, root, op, aux);
    prof_end(c->ctx, PH_COMM_WAIT, t0);
    return st;
}

static dt_status run_collective(dt_comm *c, int kind, float *buf, const float *in, int64_t n,
                                int root, dt_reduce_op op)
{
    return run_collective_in(c, kind, buf, in, n, root, op, NULL);
}

dt_status dt_allreduce(dt_comm *c, float *buf, int64_t n, dt_reduce_op op)
{
    if (!c)
        return DT_EINVAL;
    if (!coll_args_ok(c, "allreduce", buf, n) || !op_ok(c, "allreduce", op))
        return DT_EINVAL;
    return run_collective(c, COLL_ALLREDUCE, buf, NULL, n, 0, op);
}

dt_status dt_broadcast(dt_comm *c, float *buf, int64_t n, int root)
{
    if (!coll_args_ok(c, "broadcast", buf, n))
        return DT_EINVAL;
    if (root < 0 || root >= c->world)
        return set_error(c->ctx, DT_EINVAL, "broadcast: root %d is not a rank of %d", root,
                         c->world);
    return run_collective(c, COLL_BROADCAST, buf, NULL, n, root, DT_REDUCE_SUM);
}

dt_status dt_allgather(dt_comm *c, const float *in, int64_t n, float *out)
{
    if (!coll_args_ok(c, "allgather", in, n) || !coll_args_ok(c, "allgather", out, n))
        return DT_EINVAL;
    return run_collective(c, COLL_ALLGATHER, out, in, n, 0, DT_REDUCE_SUM);
}

dt_status dt_reduce_scatter(dt_comm *c, const float *in, int64_t n, float *out, dt_reduce_op op)
{
    if (!coll_args_ok(c, "reduce_scatter", in, n) || !coll_args_ok(c, "reduce_scatter", out, n) ||
        !op_ok(c, "reduce_scatter", op))
        return DT_EINVAL;
    return run_collective(c, COLL_REDUCE_SCATTER, out, in, n, 0, op);
}

dt_status dt_alltoall(dt_comm *c, const float *in, int64_t n, float *out)
{
    if (!coll_args_ok(c, "alltoall", in, n) || !coll_args_ok(c, "alltoall", out, n))
        return DT_EINVAL;
    return run_collective(c, COLL_ALLTOALL, out, in, n, 0, DT_REDUCE_SUM);
}

dt_status dt_barrier(dt_comm *c)
{
    if (!c)
        return DT_EINVAL;
    float unused = 0;   /* n = 0: never read; the call blocks until done */
    return run_collective(c, COLL_BARRIER, &unused, NULL, 0, 0, DT_REDUCE_SUM);
}

DT_PRIVATE dt_status p2p_run(dt_comm *c, const float *send, int64_t ns, int dst, float *recv,
                         int64_t nr, int src)
{
    if (!c)
        return DT_EINVAL;
    const char *op = dst >= 0 && src >= 0 ? "sendrecv" : dst >= 0 ? "send" : "recv";
    if ((dst >= 0 && !coll_args_ok(c, op, send, ns)) || (src >= 0 && !coll_args_ok(c, op, recv, nr)))
        return DT_EINVAL;
    if (dst >= c->world || src >= c->world || dst == c->rank || src == c->rank)
        return set_error(c->ctx, DT_EINVAL, "%s: peer %d: must be another rank of 0..%d", op,
                         dst == c->rank || dst >= c->world ? dst : src, c->world - 1);
    if ((size_t)(ns > nr ? ns : nr) * sizeof(float) / (c->max_msg ? c->max_msg : 1) >= 0xFFFFFF)
        return set_error(c->ctx, DT_EINVAL, "%s: message too large", op);
    p2p_call call = {send, ns, dst, recv, nr, src, 0, 0};
    pthread_mutex_lock(&c->mu);   /* counted in call order, like the peer's */
    if (dst >= 0)
        call.sseq = c->p2p_sent[dst]++;
    if (src >= 0)
        call.rseq = c->p2p_recvd[src]++;
    pthread_mutex_unlock(&c->mu);
    return run_collective_in(c, COLL_P2P, recv, send, dst >= 0 ? ns : nr, dst >= 0 ? dst : src,
                             DT_REDUCE_SUM, &call);
}

dt_status dt_send(dt_comm *c, const float *buf, int64_t n, int dst)
{
    return p2p_run(c, buf, n, dst < 0 ? INT32_MAX : dst, NULL, 0, -1);
}

dt_status dt_recv(dt_comm *c, float *buf, int64_t n, int src)
{
    return p2p_run(c, NULL, 0, -1, buf, n, src < 0 ? INT32_MAX : src);
}

dt_status dt_sendrecv(dt_comm *c, const float *send, int64_t ns, int dst, float *recv, int64_t nr,
                      int src)
{
    return p2p_run(c, send, ns, dst < 0 ? INT32_MAX : dst, recv, nr, src < 0 ? INT32_MAX : src);
}

/* --- joining the job ------------------------------------------------- */

void dt_comm_config_init(dt_comm_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    dt_store_config_init(&cfg->store);
}

int dt_comm_rank(const dt_comm *c) { return c ? c->rank : -1; }
int dt_comm_size(const dt_comm *c) { return c ? c->world : 0; }
const char *dt_comm_transport(const dt_comm *c) { return c ? c->provider : ""; }
int dt_comm_hosts(const dt_comm *c) { return c ? (c->nhosts > 0 ? c->nhosts : 1) : 0; }
uint64_t dt_comm_bytes_sent(const dt_comm *c)
{
    return c ? __atomic_load_n(&c->bytes_sent, __ATOMIC_RELAXED) : 0;
}

const char *dt_comm_intra_host(const dt_comm *c)
{
    return !c ? "" : c->use_segment ? "segment" : c->seg_why[0] ? c->seg_why : "transport";
}

/* A rank whose address is already in the store is a restarted process
 * whose predecessor died (a launcher restarting a failed parameter server):
 * it becomes incarnation n + 1 of its rank, says so in its store hellos
 * (so its own death is told apart from its predecessor's), swaps its new
 * address in without the collectives the first start runs (the others
 * are mid-job), and publishes "inc/<rank>" last, when it can be reached.
 * Peers that talk to it (src/ps.c) read that key and swap the address in. */
static dt_status find_rejoin(dt_comm *c, const dt_dist_env *env, const dt_comm_config *cfg)
{
    dt_ctx *ctx = c->ctx;
    char key[48], val[16];
    unsigned char addr[512];
    size_t len = 0;
    if (c->world == 1)
        return DT_OK;
    snprintf(key, sizeof key, "addr/%d", c->rank);
    dt_status st = dt_store_get(c->store, key, addr, sizeof addr, &len, 1);
    if (st == DT_ETIMEDOUT) {   /* the first process of this rank (the usual case) */
        dt_clear_error(ctx);
        return DT_OK;
    }
    if (st != DT_OK)
        return st;
    uint32_t before = 0;   /* the last process started for this rank (0: the first) */
    snprintf(key, sizeof key, "tries/%d", c->rank);
    if (dt_store_get(c->store, key, val, sizeof val - 1, &len, 1) == DT_OK) {
        val[len < sizeof val ? len : sizeof val - 1] = '\0';
        before = (uint32_t)strtoul(val, NULL, 10);
    }
    dt_clear_error(ctx);
    dead_key(key, sizeof key, c->rank, before);
    st = dt_store_get(c->store, key, val, sizeof val, &len, c->timeout_ms);
    if (st == DT_ETIMEDOUT)
        return set_error(ctx, DT_ESTATE, "comm: rank %d is already in the job and alive (its "
                         "address is registered, its process has not died): two processes "
                         "started with one rank?", c->rank);
    if (st != DT_OK)
        return st;
    dt_dist_env e = *env;
    e.master_port = dt_store_port(c->store);
    dt_store *again = store_open(ctx, &e, &cfg->store, 0, before + 1);
    if (!again)
        return ctx->last_status;
    dt_store_close(c->store);
    c->store = again;
    c->inc = before + 1;
    /* counted once our hellos say who we are (so our end is recorded):
     * a number is never handed out twice */
    snprintf(key, sizeof key, "tries/%d", c->rank);
    snprintf(val, sizeof val, "%u", c->inc);
    return dt_store_set(c->store, key, val, strlen(val) + 1);
}

/* The rejoined process is ready (its receives are posted: 18.6 calls this
 * when it starts serving): tell its peers. */
DT_PRIVATE dt_status announce_rejoin(dt_comm *c)
{
    char key[32], val[16];
    if (!c->inc || c->announced)
        return DT_OK;
    c->announced = 1;
    snprintf(key, sizeof key, "inc/%d", c->rank);
    snprintf(val, sizeof val, "%u", c->inc);
    return dt_store_set(c->store, key, val, strlen(val) + 1);
}

/* Comm thread: rank `peer` restarted as incarnation inc; send to and
 * receive from its address (read from the store) from now on.  The caller has cancelled or
 * drained every transfer with the old one. */
DT_PRIVATE dt_status comm_replace_peer(dt_comm *c, int peer, uint32_t inc, char *err, size_t err_len)
{
    char key[32];
    unsigned char addr[512];
    size_t len = 0;
    snprintf(key, sizeof key, "addr/%d.%u", peer, inc);   /* that process's, not a later one's */
    if (!c->watch || dt_store_get(c->watch, key, addr, sizeof addr, &len, c->timeout_ms) != DT_OK) {
        snprintf(err, err_len, "rank %d's new address: %.200s", peer,
                 c->watch ? c->watch_errors->err : "no store");
        return DT_EPEER;
    }
    if (len > sizeof addr) {
        snprintf(err, err_len, "rank %d's new address is too long", peer);
        return DT_EPEER;
    }
    return c->tp_iface->replace_peer(c->tp, peer, addr, len, err, err_len);
}

/* Publish this rank's host name and read everyone's: ranks with the same
 * name share a host (its segment, and one leader in the hierarchy). */
static dt_status find_hosts(dt_comm *c, const dt_comm_config *cfg)
{
    dt_ctx *ctx = c->ctx;
    char me[DT_MAX_HOST] = "", key[32];
    const char *id = cfg->host_id ? cfg->host_id : getenv("DTRAIN_HOST_ID");
    if (id && *id)
        snprintf(me, sizeof me, "%s", id);
    else
        gethostname(me, sizeof me - 1);
    snprintf(key, sizeof key, "host/%d", c->rank);
    dt_status st = dt_store_set(c->store, key, me, strlen(me) + 1);
    char (*names)[DT_MAX_HOST] = host_calloc(ctx, sizeof *names * (size_t)c->world);
    c->local_ranks = host_alloc(ctx, sizeof(int) * (size_t)c->world);
    c->leaders = host_alloc(ctx, sizeof(int) * (size_t)c->world);
    if (st == DT_OK && (!names || !c->local_ranks || !c->leaders))
        st = set_error(ctx, DT_ENOMEM, "comm: out of memory");
    for (int r = 0; st == DT_OK && r < c->world; r++) {
        size_t len = 0;
        snprintf(key, sizeof key, "host/%d", r);
        st = dt_store_get(c->store, key, names[r], DT_MAX_HOST - 1, &len, 0);
        names[r][len < DT_MAX_HOST ? len : DT_MAX_HOST - 1] = '\0';
    }
    c->leader_index = -1;
    for (int r = 0; st == DT_OK && r < c->world; r++) {
        int first = 1;   /* lowest rank with this name: the host's leader */
        for (int q = 0; q < r && first; q++)
            first = strcmp(names[q], names[r]) != 0;
        if (first) {
            if (r == c->rank)
                c->leader_index = c->nhosts;
            c->leaders[c->nhosts++] = r;
        }
        if (strcmp(names[r], me) == 0) {
            if (r == c->rank)
                c->local_index = c->nlocal;
            c->local_ranks[c->nlocal++] = r;
        }
    }
    host_free(ctx, names);
    return st;
}

/* The host's leader creates the segment and publishes its name; the other
 * local ranks map it.  *ok: this rank has it (or needs none). */
static dt_status map_segment(dt_comm *c, int *ok)
{
    char key[32], why[160] = "";
    int L = c->nlocal, leader = c->local_ranks[0], fd = -1;
    *ok = 0;
    const char *sl = getenv("DTRAIN_SEGMENT_SLOT_KIB");
    c->seg_slot = sl && atoi(sl) >= 64 ? (size_t)atoi(sl) << 10 : SEG_SLOT_DEFAULT;
    c->seg_bytes = seg_data_offset(L) + (size_t)L * 2 * c->seg_slot;
    snprintf(key, sizeof key, "seg/%d", leader);
    if (c->local_index == 0) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        snprintf(c->seg_name, sizeof c->seg_name, "/dtrain-%d-%lx", (int)getpid(),
                 (unsigned long)ts.tv_nsec ^ (unsigned long)ts.tv_sec << 20);
        fd = shm_open(c->seg_name, O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd >= 0)
            c->seg_linked = 1;
        /* reserve the pages now: a full /dev/shm is an error here, not a
         * SIGBUS in the middle of a collective */
        int err = fd < 0 ? errno : posix_fallocate(fd, 0, (off_t)c->seg_bytes);
        if (err)
            snprintf(why, sizeof why, "%s", strerror(err));
        const char *val = err ? "" : c->seg_name;
        dt_status st = dt_store_set(c->store, key, val, strlen(val) + 1);
        if ((st != DT_OK || err) && fd >= 0) {
            close(fd);
            fd = -1;
        }
        if (st != DT_OK)
            return st;
    } else {
        size_t len = 0;
        dt_status st = dt_store_get(c->store, key, c->seg_name, sizeof c->seg_name - 1, &len, 0);
        if (st != DT_OK)
            return st;
        c->seg_name[len < sizeof c->seg_name ? len : sizeof c->seg_name - 1] = '\0';
        if (c->seg_name[0] && (fd = shm_open(c->seg_name, O_RDWR, 0)) < 0)
            snprintf(why, sizeof why, "%s", strerror(errno));
    }
    struct stat sb;
    if (fd >= 0 && (fstat(fd, &sb) != 0 || (size_t)sb.st_size != c->seg_bytes)) {
        if (!why[0])
            snprintf(why, sizeof why, "its size is not %zu bytes (ranks disagree on "
                     "DTRAIN_SEGMENT_SLOT_KIB?)", c->seg_bytes);
        close(fd);
        fd = -1;
    }
    if (fd >= 0) {
        void *p = mmap(NULL, c->seg_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        if (p == MAP_FAILED)
            snprintf(why, sizeof why, "mmap: %s", strerror(errno));
        else
            c->seg = p;
    }
    if (!c->seg) {   /* not an error: every rank falls back to the transport */
        snprintf(c->seg_why, sizeof c->seg_why, "no host segment: %s",
                 why[0] ? why : "the host's leader could not create one");
        return DT_OK;
    }
    c->seg_ranks = (seg_rank *)((char *)c->seg + seg_ranks_offset());
    c->seg_data = (char *)c->seg + seg_data_offset(L);
    if (c->local_index == 0) {
        c->seg->magic = SEG_MAGIC;
        c->seg->nlocal = (uint32_t)L;
        c->seg->slot_bytes = c->seg_slot;
        c->seg->total_bytes = c->seg_bytes;
    }
    *ok = 1;
    return DT_OK;
}

static void unmap_segment(dt_comm *c)
{
    if (c->seg)
        munmap(c->seg, c->seg_bytes);
    c->seg = NULL;
    if (c->seg_linked)
        shm_unlink(c->seg_name);
    c->seg_linked = 0;
}
DT_PRIVATE dt_status shared_region_map(dt_comm *c, size_t part_bytes, shm_region *r, int *ok)
{
    *ok = 0;
    memset(r, 0, sizeof *r);
    if (!c->use_segment || !c->seg || c->nhosts != 1)
        return DT_OK;
    int L = c->nlocal, fd = -1, created = 0;
    size_t part = (part_bytes + 4095) & ~(size_t)4095, total = part * (size_t)L;
    char key[DT_STORE_MAX_KEY], name[80] = "";
    snprintf(key, sizeof key, "shared%s/%d", c->seg_name, c->regions_made++);
    dt_status st = DT_OK;
    if (c->local_index == 0) {
        snprintf(name, sizeof name, "%s-r%d", c->seg_name, c->regions_made);
        fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
        created = fd >= 0;
        if (fd >= 0 && posix_fallocate(fd, 0, (off_t)total) != 0) {   /* see map_segment */
            close(fd);
            fd = -1;
        }
        st = dt_store_set(c->store, key, fd >= 0 ? name : "", fd >= 0 ? strlen(name) + 1 : 1);
    } else {
        size_t len = 0;
        st = dt_store_get(c->store, key, name, sizeof name - 1, &len, c->timeout_ms);
        name[len < sizeof name ? len : sizeof name - 1] = '\0';
        if (st == DT_OK && name[0])
            fd = shm_open(name, O_RDWR, 0);
    }
    struct stat sb;
    if (fd >= 0 && fstat(fd, &sb) == 0 && (size_t)sb.st_size == total) {
        void *p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p != MAP_FAILED)
            *r = (shm_region){.base = p, .part = part, .total = total, .nlocal = L,
                              .me = c->local_index};
    }
    if (fd >= 0)
        close(fd);
    const char *env = getenv("DTRAIN_SHARED_BUCKETS");
    float agree = r->base && !(env && strcmp(env, "0") == 0) ? 1.0f : 0.0f;
    if (st == DT_OK)
        st = dt_allreduce(c, &agree, 1, DT_REDUCE_MIN);   /* also: every rank has it open */
    if (created)
        shm_unlink(name);
    if (st != DT_OK || agree < 1.0f)
        shared_region_free(r);
    *ok = st == DT_OK && r->base;
    return st;
}

DT_PRIVATE void shared_region_free(shm_region *r)
{
    if (r->base)
        munmap(r->base, r->total);
    memset(r, 0, sizeof *r);
}

/* Segments are used only if every rank wants them and got one: a rank that
 * could not map its host's would otherwise wait on the others forever. */
static dt_status setup_segments(dt_comm *c, const dt_comm_config *cfg)
{
    dt_ctx *ctx = c->ctx;
    const char *mode = cfg->intra_host ? cfg->intra_host : getenv("DTRAIN_INTRA_HOST");
    int want = 1;
    if (mode && strcmp(mode, "transport") == 0)
        want = 0;
    else if (mode && *mode && strcmp(mode, "segment") != 0)
        return set_error(ctx, DT_EINVAL, "comm: intra-host mode '%s' is neither 'segment' nor "
                         "'transport'", mode);
    if (c->world == 1)
        return DT_OK;
    int ok = want;
    if (want && c->nlocal > 1 && map_segment(c, &ok) != DT_OK)
        return ctx->last_status;
    char key[32], val[4];
    snprintf(key, sizeof key, "segok/%d", c->rank);
    dt_status st = dt_store_set(c->store, key, ok ? "1" : "0", 2);
    c->use_segment = 1;
    for (int r = 0; st == DT_OK && r < c->world; r++) {
        size_t len = 0;
        snprintf(key, sizeof key, "segok/%d", r);
        st = dt_store_get(c->store, key, val, sizeof val, &len, 0);
        if (st == DT_OK && val[0] != '1')
            c->use_segment = 0;
    }
    if (st == DT_OK && !c->use_segment)
        unmap_segment(c);
    return st;
}

static dt_status exchange_addresses(dt_comm *c)
{
    dt_ctx *ctx = c->ctx;
    char err[256] = "", key[32];
    unsigned char mine[512];
    size_t len = sizeof mine;
    if (c->tp_iface->get_addr(c->tp, mine, &len, err, sizeof err) != DT_OK)
        return set_error(ctx, DT_EIO, "comm: transport address: %s", err);
    snprintf(key, sizeof key, "addr/%d", c->rank);
    dt_status st = dt_store_set(c->store, key, mine, len);
    snprintf(key, sizeof key, "addr/%d.%u", c->rank, c->inc);   /* (a restart's, for 14.6) */
    if (st == DT_OK && c->inc)
        st = dt_store_set(c->store, key, mine, len);
    unsigned char *all = host_alloc(ctx, (size_t)c->world * sizeof mine);
    const void **ptrs = host_alloc(ctx, sizeof *ptrs * (size_t)c->world);
    size_t *lens = host_alloc(ctx, sizeof *lens * (size_t)c->world);
    if (st == DT_OK && (!all || !ptrs || !lens))
        st = set_error(ctx, DT_ENOMEM, "comm: out of memory");
    for (int r = 0; st == DT_OK && r < c->world; r++) {
        snprintf(key, sizeof key, "addr/%d", r);
        ptrs[r] = all + (size_t)r * sizeof mine;
        st = dt_store_get(c->store, key, all + (size_t)r * sizeof mine, sizeof mine, &lens[r], 0);
        if (st == DT_OK && lens[r] > sizeof mine)
            st = set_error(ctx, DT_EPEER, "comm: rank %d's address is too long", r);
    }
    if (st == DT_OK && c->tp_iface->insert_peers(c->tp, c->world, ptrs, lens, err, sizeof err) != DT_OK)
        st = set_error(ctx, DT_EIO, "comm: inserting peer addresses: %s", err);
    host_free(ctx, all);
    host_free(ctx, ptrs);
    host_free(ctx, lens);
    return st;
}

static dt_status open_transport(dt_comm *c, const dt_comm_config *cfg)
{
    dt_ctx *ctx = c->ctx;
    c->tp_iface = find_transport();
    if (!c->tp_iface)
        return set_error(ctx, DT_ENOTSUP, "comm: no transport compiled in (build with "
                                          "backends/fabric.c, -DDT_WITH_FABRIC and -lfabric)");
    const char *prov = cfg->transport ? cfg->transport : getenv("DTRAIN_TRANSPORT");
    if (!prov)
        prov = c->nhosts <= 1 ? "shm" : "tcp";
    dt_transport_params tp = {prov, cfg->host ? cfg->host : getenv("DTRAIN_HOST"), NULL, ctx->al};
    char err[256] = "";
    dt_status st = c->tp_iface->open(&tp, &c->tp, err, sizeof err);
    if (st != DT_OK)
        return set_error(ctx, st, "comm: transport '%s': %s", prov, err);
    snprintf(c->provider, sizeof c->provider, "%s", c->tp_iface->provider(c->tp));
    c->doubling_max = strncmp(c->provider, "tcp", 3) == 0 ? DT_COMM_SMALL_TCP : DT_COMM_SMALL;
    c->max_msg = c->tp_iface->max_message(c->tp);
    if (c->max_msg == 0)
        c->max_msg = DT_COMM_CHUNK;
    return DT_OK;
}

/* The comm thread's own connection to the store, with its own error sink
 * (a bare context that only holds the allocator and messages). */
static dt_status open_watch(dt_comm *c, const dt_comm_config *cfg)
{
    dt_ctx *ctx = c->ctx;
    if (c->world == 1)
        return DT_OK;
    c->watch_errors = host_calloc(ctx, sizeof *c->watch_errors);
    if (!c->watch_errors)
        return set_error(ctx, DT_ENOMEM, "comm: out of memory");
    c->watch_errors->al = ctx->al;
    dt_store_config sc = cfg->store;
    sc.token = c->store->token;   /* (a group's cfg may not carry the job's) */
    c->watch = store_open(c->watch_errors, &c->job, &sc, 0, c->inc);
    if (!c->watch)
        return set_error(ctx, c->watch_errors->last_status, "%s", c->watch_errors->err);
    snprintf(c->watch->prefix, sizeof c->watch->prefix, "%s", c->store->prefix);
    /* a hung rank 0 must not hold a collective longer than its own timeout */
    if (c->watch->timeout_ms > c->timeout_ms)
        c->watch->timeout_ms = c->timeout_ms;
    return DT_OK;
}

/* A communicator's memory and lock, before it connects. */
static dt_comm *comm_alloc(dt_ctx *ctx, int rank, int world, const dt_comm_config *cfg)
{
    dt_comm *c = host_calloc(ctx, sizeof *c);
    if (!c) {
        set_error(ctx, DT_ENOMEM, "comm: out of memory");
        return NULL;
    }
    c->ctx = ctx;
    c->rank = rank;
    c->world = world;
    c->inline_small = 1;
    c->waiting_on = -1;
    int t = cfg->timeout_ms;
    const char *te = getenv("DTRAIN_TIMEOUT_MS");
    if (t <= 0 && te)
        t = atoi(te);
    c->timeout_ms = t > 0 ? t : DT_COMM_DEFAULT_TIMEOUT_MS;
    if (pthread_mutex_init(&c->mu, NULL) != 0 || pthread_cond_init(&c->cv, NULL) != 0) {
        host_free(ctx, c);
        set_error(ctx, DT_ENOMEM, "comm: cannot create a mutex");
        return NULL;
    }
    return c;
}

/* Free a communicator that failed to connect, keeping the failure's message
 * (freeing it may set others); NULL. */
static dt_comm *comm_abandon(dt_comm *c, const char *what)
{
    dt_ctx *ctx = c->ctx;
    dt_status st = ctx->last_status;
    char msg[DT_MAX_ERROR];
    snprintf(msg, sizeof msg, "%s", ctx->err);
    dt_comm_free(c);
    set_error(ctx, st, "%s%.480s", what, msg);
    return NULL;
}

/* Everything after the store: hosts, the transport and its addresses, the
 * watch connection, the host segment, the comm thread; collective over the
 * communicator's ranks (the job's, or a group's through its namespace). */
static dt_status comm_connect(dt_comm *c, const dt_comm_config *cfg)
{
    dt_ctx *ctx = c->ctx;
    if (find_hosts(c, cfg) != DT_OK || open_transport(c, cfg) != DT_OK ||
        exchange_addresses(c) != DT_OK || open_watch(c, cfg) != DT_OK ||
        (!c->inc && setup_segments(c, cfg) != DT_OK))   /* (a collective) */
        return ctx->last_status;
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    c->inline_spin_s = online > 0 && c->nlocal <= online ? SEG_SPIN_INLINE_S : SEG_SPIN_S;
    c->p2p_sent = host_calloc(ctx, sizeof *c->p2p_sent * (size_t)c->world);
    c->p2p_recvd = host_calloc(ctx, sizeof *c->p2p_recvd * (size_t)c->world);
    if (!c->p2p_sent || !c->p2p_recvd)
        return set_error(ctx, DT_ENOMEM, "comm: out of memory");
    if (pthread_create(&c->thread, NULL, comm_main, c) != 0)
        return set_error(ctx, DT_ENOMEM, "comm: cannot start the comm thread");
    c->has_thread = 1;
    /* everyone's endpoint is ready before anyone sends (a rejoined rank's
     * peers are mid-job: it tells them when it serves, announce_rejoin) */
    if (!c->inc && dt_barrier(c) != DT_OK)
        return ctx->last_status;
    /* the profiler's offset to rank 0's clock (src/profile.c), while the job is quiet */
    if (!c->members && store_clock_offset(c->store, 8, &c->clock_offset, &c->clock_rtt) != DT_OK)
        return ctx->last_status;
    /* every local rank has mapped the segment: its name can go, so no
     * file is left behind in /dev/shm whatever happens later */
    if (c->seg_linked) {
        shm_unlink(c->seg_name);
        c->seg_linked = 0;
    }
    return DT_OK;
}

dt_comm *dt_comm_new(dt_ctx *ctx, const dt_dist_env *env_in, const dt_comm_config *cfg_in)
{
    if (!ctx_ok(ctx))
        return NULL;
    dt_comm_config cfg;
    if (cfg_in)
        cfg = *cfg_in;
    else
        dt_comm_config_init(&cfg);
    dt_dist_env env;
    if (env_in)
        env = *env_in;
    else if (dt_dist_env_detect(ctx, &env) != DT_OK)
        return NULL;
    dt_comm *c = comm_alloc(ctx, env.rank, env.world_size, &cfg);
    if (!c)
        return NULL;
    if (!(c->store = dt_store_open(ctx, &env, &cfg.store)) || find_rejoin(c, &env, &cfg) != DT_OK)
        goto fail;
    c->job = env;
    c->job.master_port = dt_store_port(c->store);
    if (comm_connect(c, &cfg) != DT_OK)
        goto fail;
    return c;
fail:
    return comm_abandon(c, "");
}

void dt_comm_free(dt_comm *c)
{
    if (!c)
        return;
    if (c->has_thread) {
        pthread_mutex_lock(&c->mu);
        c->stop = 1;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->thread, NULL);
    }
    if (c->tp)
        c->tp_iface->close(c->tp);
    while (c->graveyard) {   /* (the transport that held their sends is closed) */
        xfers *x = c->graveyard;
        c->graveyard = x->next_dead;
        c->ctx->al.free_fn(x, c->ctx->al.user);
    }
    dt_store_close(c->watch);
    host_free(c->ctx, c->watch_errors);
    /* Rank 0 leaves its last collective as soon as its own part is done,
     * while others may still wait for each other's last messages and ask
     * the store about the dead meanwhile: a store gone then would read as
     * rank 0's death.  So the store stays until they have left (bounded). */
    store_close(c->store, c->timeout_ms < DT_COMM_DRAIN_MS ? c->timeout_ms : DT_COMM_DRAIN_MS);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    if (c->scratch)
        c->ctx->al.free_fn(c->scratch, c->ctx->al.user);
    unmap_segment(c);
    host_free(c->ctx, c->local_ranks);
    host_free(c->ctx, c->leaders);
    host_free(c->ctx, c->members);
    host_free(c->ctx, c->p2p_sent);
    host_free(c->ctx, c->p2p_recvd);
    host_free(c->ctx, c);
}

/* --- process groups ------------------------------------------------- */

/* Every rank's (color, key) through the parent's store; the ranks of our
 * color in (key, parent rank) order, as job ranks, into members (n of them;
 * *me: our index). */
static dt_status split_members(dt_comm *p, int color, int key, int *members, int *n, int *me)
{
    dt_ctx *ctx = p->ctx;
    char k[48], v[32];
    int id = p->splits_made++;
    snprintf(k, sizeof k, "split/%d/%d", id, p->rank);
    int vl = snprintf(v, sizeof v, "%d %d", color, key);
    dt_status st = dt_store_set(p->store, k, v, (size_t)vl + 1);
    int *keys = host_alloc(ctx, sizeof *keys * (size_t)p->world);
    if (st == DT_OK && !keys)
        st = set_error(ctx, DT_ENOMEM, "comm_split: out of memory");
    *n = 0;
    for (int r = 0; st == DT_OK && r < p->world; r++) {
        size_t len = 0;
        int col = 0, ky = 0;
        snprintf(k, sizeof k, "split/%d/%d", id, r);
        st = dt_store_get(p->store, k, v, sizeof v - 1, &len, 0);
        v[len < sizeof v ? len : sizeof v - 1] = '\0';
        if (st == DT_OK && sscanf(v, "%d %d", &col, &ky) != 2)
            st = set_error(ctx, DT_EPEER, "comm_split: rank %d sent '%s'", r, v);
        if (st != DT_OK || col != color)
            continue;
        int i = (*n)++;   /* insertion sort by (key, rank): groups are small */
        while (i > 0 && keys[i - 1] > ky)
            keys[i] = keys[i - 1], members[i] = members[i - 1], i--;
        keys[i] = ky;
        members[i] = r;
    }
    for (int i = 0; st == DT_OK && i < *n; i++) {
        if (members[i] == p->rank)
            *me = i;
        members[i] = p->members ? p->members[members[i]] : members[i];   /* job ranks */
    }
    host_free(ctx, keys);
    return st;
}

static void group_label(dt_comm *c)
{
    int off = snprintf(c->label, sizeof c->label, "group [");
    for (int i = 0; i < c->world && off < (int)sizeof c->label - 24; i++)
        off += snprintf(c->label + off, sizeof c->label - (size_t)off, i ? " %d" : "%d",
                        c->members[i]);
    snprintf(c->label + off, sizeof c->label - (size_t)off, "%s]: ",
             off >= (int)sizeof c->label - 24 ? " ..." : "");
}

dt_comm *dt_comm_split(dt_comm *parent, int color, int key, const dt_comm_config *cfg_in)
{
    if (!parent)
        return NULL;
    dt_ctx *ctx = parent->ctx;
    if (color < 0) {
        set_error(ctx, DT_EINVAL, "comm_split: color %d: must be >= 0", color);
        return NULL;
    }
    if (parent->broken || parent->inc) {
        set_error(ctx, DT_ESTATE, "comm_split: %s", parent->broken ? parent->broken_msg :
                  "a restarted process's communicator makes no groups");
        return NULL;
    }
    dt_comm_config cfg;
    if (cfg_in)
        cfg = *cfg_in;
    else
        dt_comm_config_init(&cfg);
    if (!cfg.timeout_ms)
        cfg.timeout_ms = parent->timeout_ms;
    int id = parent->splits_made, n = 0, me = 0;
    int *members = host_alloc(ctx, sizeof *members * (size_t)parent->world);
    if (!members) {
        set_error(ctx, DT_ENOMEM, "comm_split: out of memory");
        return NULL;
    }
    if (split_members(parent, color, key, members, &n, &me) != DT_OK) {
        host_free(ctx, members);
        return NULL;
    }
    dt_comm *c = comm_alloc(ctx, me, n, &cfg);
    if (!c) {
        host_free(ctx, members);
        return NULL;
    }
    c->members = members;
    c->job = parent->job;
    c->clock_offset = parent->clock_offset;
    c->clock_rtt = parent->clock_rtt;
    group_label(c);
    cfg.store.token = parent->store->token;
    if (!(c->store = store_open(ctx, &c->job, &cfg.store, 0, 0)))
        goto fail;
    if ((size_t)snprintf(c->store->prefix, sizeof c->store->prefix, "%sg%d.%d/",
                         parent->store->prefix, id, color) >= sizeof c->store->prefix) {
        set_error(ctx, DT_ENOTSUP, "comm_split: groups nested too deep");
        goto fail;
    }
    if (comm_connect(c, &cfg) != DT_OK)
        goto fail;
    return c;
fail:
    return comm_abandon(c, "comm_split: ");
}

int dt_comm_job_rank(const dt_comm *c, int rank)
{
    if (!c || rank < 0 || rank >= c->world)
        return -1;
    return c->members ? c->members[rank] : rank;
}

