#include "dist.h"

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

/* One dt_comm_send / dt_comm_recv / dt_comm_sendrecv: a send to dst and a receive from src
 * (either may be absent), posted together so an exchange cannot deadlock.
 * Tags: the check bits say "point to point" (no collective has them), the
 * sequence is the pair's message count, so the k-th send from a rank meets
 * the k-th receive posted for it; large messages go in max_msg chunks. */
struct p2p_call {
    const float *send;
    int64_t ns;
    int dst;
    float *recv;
    int64_t nr;
    int src;
    uint32_t sseq, rseq;
};

static const char *const coll_names[] = {"?", "allreduce", "broadcast", "allgather",
                                         "reduce_scatter", "barrier", "alltoall",
                                         "16-bit allreduce", "reduce_scatter of shards",
                                         "allgather of shards",
                                         "parameter-server request", "send/recv"};
_Static_assert(sizeof coll_names / sizeof coll_names[0] == COLL_P2P + 1,
               "coll_names: one name for each COLL_ kind, in the enum's order");

/* A collective's name for messages and traces ("allreduce"); "?" for a kind
 * outside the table. */
DT_PRIVATE const char *comm_coll_name(int kind)
{
    return kind >= 1 && kind < (int)(sizeof coll_names / sizeof coll_names[0]) ? coll_names[kind]
                                                                             : "?";
}

/* The algorithms' names, by COMM_ALG_*, for the trace and the report */
static const char *const coll_algs[] = {"?", "shared segment", "hierarchical", "recursive doubling",
                                        "ring", "binomial tree", "pairwise", "16-bit ring",
                                        "parameter server", "send/recv"};

DT_PRIVATE const char *comm_alg_name(int alg)
{
    return coll_algs[alg >= 0 && alg < (int)(sizeof coll_algs / sizeof coll_algs[0]) ? alg : 0];
}

/* Bytes over the busiest link per byte of a collective's buffer, for the
 * bus bandwidth that NCCL's tests report. */
DT_PRIVATE double comm_bus_factor(int kind, int P)
{
    if (P <= 1)
        return 0;
    switch (kind) {
    case COLL_ALLREDUCE: case COLL_ALLREDUCE16:
        return 2.0 * (P - 1) / P;
    case COLL_BROADCAST: return 1.0;
    case COLL_BARRIER: return 0.0;
    default: return (double)(P - 1) / P;
    }
}

static int64_t coll_bytes(const dt_work *w)
{
    return w->kind == COLL_BARRIER ? 0 : w->n * (w->kind == COLL_ALLREDUCE16 ? 2 : 4);
}

/* What the comm thread just ran, for the profiler (src/record.c). */
static void comm_record(dt_comm *c, const dt_work *w, double t0, double t1)
{
    if (w->kind == COLL_EXT) {
        prof_ext(c->ctx, t0, t1, w->ext_what, w->n, w->ext_stale, w->status == DT_OK);
        for (int r = 0; w->status == DT_OK && c->ext_done_at && r < c->world; r++)
            if (c->ext_done_at[r] >= t0)   /* that server's part of the request */
                prof_ext_server(c->ctx, r, c->world, c->ext_done_at[r] - t0);
        return;
    }
    int64_t bytes = coll_bytes(w);
    prof_coll(c->ctx, t0, t1, w->kind, w->alg, bytes, (double)bytes * comm_bus_factor(w->kind, c->world),
              c->world);
}

#define TAG_HEADER_STEP 0xFFFFu

DT_PRIVATE const dt_transport_iface *comm_find_transport(void)
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

DT_PRIVATE void comm_describe_call(char *out, size_t cap, int kind, int64_t n, int root, int op)
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
DT_PRIVATE dt_status comm_work_fail(dt_work *w, dt_status st, const char *fmt, ...)
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

/* The collective's deadline passed (dt_comm_config.collective_timeout_ms)
 * while rank `who` was alive: its heartbeat went on, it never came. */
DT_PRIVATE dt_status comm_blame_silent(dt_work *w, int who, int ms)
{
    dt_comm *c = w->comm;
    w->blame = who;
    w->blame_ms = ms;
    int said = c && c->hb_peer == who && c->hb_doing[0];
    return comm_work_fail(w, DT_ETIMEDOUT, "%s #%u: rank %d kept it waiting %d ms, the collective "
                          "timeout (dt_comm_config.collective_timeout_ms), though alive (its "
                          "heartbeat went on)%s%s", coll_names[w->kind], w->seq, who, ms,
                          said ? ": it was " : "", said ? c->hb_doing : "");
}

/* The rank this collective waits on is alive while its heartbeat
 * (src/join.c, join_heartbeat) keeps changing; one unchanged for
 * timeout_ms means its process is stopped, hung or cut off, however long
 * the collective itself may wait for a living rank.  Called every
 * DT_COMM_WATCH_S of a wait (comm_check_dead). */
static dt_status comm_check_heartbeat(dt_comm *c, dt_work *w)
{
    int peer = c->waiting_on;
    if (peer < 0 || !c->watch || store_silent_ms(c->watch) > 0)
        return DT_OK;   /* (a silent store is rank 0's silence: comm_check_dead says so) */
    double now = dt_now();
    if (peer != c->hb_peer) {   /* a new rank to watch: its clock starts now */
        c->hb_peer = peer;
        c->hb_beat = 0;
        c->hb_seen = now;
        c->hb_doing[0] = '\0';
    }
    char key[32], val[160] = "";
    size_t len = 0;
    snprintf(key, sizeof key, "/hb/%d", c->members ? c->members[peer] : peer);
    if (dt_store_get(c->watch, key, val, sizeof val - 1, &len, 1) == DT_OK) {
        val[len < sizeof val ? len : sizeof val - 1] = '\0';
        unsigned long long beat = 0;
        int used = 0;
        if (sscanf(val, "%llu %n", &beat, &used) >= 1 && used > 0) {
            if (beat != c->hb_beat) {
                c->hb_beat = beat;
                c->hb_seen = now;
            }
            snprintf(c->hb_doing, sizeof c->hb_doing, "%s", val + used);
        }
    }
    int ms = (int)((now - c->hb_seen) * 1000.0);
    if (ms <= c->timeout_ms)
        return DT_OK;
    w->blame = peer;
    w->blame_ms = ms;
    w->blame_gone = 1;
    return comm_work_fail(w, DT_ETIMEDOUT, "%s #%u: rank %d sent nothing for %d ms, not even its "
                          "heartbeat (stopped, hung or cut off?)%s%s", coll_names[w->kind], w->seq,
                          peer, ms, c->hb_doing[0] ? "; it last said it was " : "", c->hb_doing);
}

static int xfer_gone(const xfers *xs, int peer)
{
    return xs->gone && peer >= xs->gone_base && peer < xs->gone_base + xs->gone_n &&
           xs->gone[peer - xs->gone_base];
}

/* The rank a transfer is with: its transport peer, or the rank whose
 * other endpoint that peer is. */
DT_PRIVATE int comm_xfer_rank(const dt_comm *c, const dt_xfer *x)
{
    int p = x->peer;
    return p >= c->world && p - c->world < c->nalias ? c->alias[p - c->world] : p;
}

DT_PRIVATE dt_status comm_work_status(const dt_work *w) { return w->status; }

DT_PRIVATE const void *comm_work_request(const dt_work *w) { return w->aux; }

DT_PRIVATE void comm_work_forgive(dt_work *w)
{
    w->status = DT_OK;
    w->msg[0] = '\0';
}

DT_PRIVATE void comm_work_record_ext(dt_work *w, int what, int64_t stale)
{
    w->ext_what = what;
    w->ext_stale = stale;
}

DT_PRIVATE void comm_work_own(dt_work *w, void *owned) { w->owned = owned; }

DT_PRIVATE int comm_xfers_count(const xfers *xs) { return xs->n; }

DT_PRIVATE int comm_xfers_orphans(const xfers *xs) { return xs->orphans; }

DT_PRIVATE int comm_xfers_pending_with(const dt_comm *c, const xfers *xs, int rank)
{
    for (int i = 0; i < xs->n; i++)
        if (!xs->x[i].done && comm_xfer_rank(c, &xs->x[i]) == rank)
            return 1;
    return 0;
}

DT_PRIVATE void comm_xfers_survive(xfers *xs, const unsigned char *gone, int base, int n,
                                   int (*write_off)(dt_comm *c, void *arg, int peer),
                                   dt_status (*idle)(dt_comm *c, dt_work *w, xfers *xs, void *arg),
                                   void *arg)
{
    xs->gone = gone;
    xs->gone_base = base;
    xs->gone_n = n;
    xs->write_off = write_off;
    xs->write_off_arg = arg;
    xs->idle = idle;
}

DT_PRIVATE void comm_xfers_set_patience(xfers *xs, double patience) { xs->patience = patience; }

/* Rank `rank`'s endpoint at addr becomes transport peer *via (the caller
 * holds the transport). */
DT_PRIVATE dt_status comm_add_endpoint(dt_comm *c, int rank, const void *addr, size_t len,
                                       int *via, char *err, size_t err_len)
{
    int *alias = host_alloc(c->ctx, sizeof(int) * (size_t)(c->nalias + 1));
    if (!alias) {
        snprintf(err, err_len, "out of memory");
        return DT_ENOMEM;
    }
    dt_status s = c->tp_iface->add_peer(c->tp, addr, len, via, err, err_len);
    if (s == DT_OK && *via != c->world + c->nalias) {
        snprintf(err, err_len, "the transport numbered the endpoint %d, not %d", *via,
                 c->world + c->nalias);
        s = DT_ESTATE;
    }
    if (s != DT_OK) {
        host_free(c->ctx, alias);
        return s;
    }
    if (c->nalias)
        memcpy(alias, c->alias, sizeof(int) * (size_t)c->nalias);
    alias[c->nalias++] = rank;
    host_free(c->ctx, c->alias);
    c->alias = alias;
    return DT_OK;
}

/* --- the transport, watched ------------------------------------------- */

/* A transport call that never returns would hang every caller of this
 * communicator: libfabric 1.17's shm provider spins on a lock in shared
 * memory that a peer killed mid-send still holds (docs/RELIABILITY.md).
 * The comm thread stamps each call it makes (tp_enter, tp_leave); a caller
 * waiting in comm_work_finish gives up on one that outlasts comm_wedge_s. */
static void tp_enter(dt_comm *c, const char *call)
{
    double now = dt_now();
    __atomic_store_n(&c->tp_call, call, __ATOMIC_RELAXED);
    __atomic_store(&c->tp_since, &now, __ATOMIC_RELEASE);
}

/* The call returned: 1 if its callers gave up on it meanwhile (then the
 * work fails and run_work closes the transport: nothing more lands). */
static int tp_leave(dt_comm *c, char *err, size_t err_len)
{
    double none = 0;
    __atomic_store(&c->tp_since, &none, __ATOMIC_RELEASE);
    if (!__atomic_load_n(&c->wedged, __ATOMIC_ACQUIRE))
        return 0;
    if (err && err_len)
        snprintf(err, err_len, "the call returned after its callers gave up on it (wedged)");
    return 1;
}

DT_PRIVATE int comm_tp_poll(dt_comm *c, dt_xfer **done, int max, char *err, size_t err_len)
{
    tp_enter(c, "poll");
    int k = c->tp_iface->poll(c->tp, done, max, err, err_len);
    return tp_leave(c, err, err_len) ? -1 : k;
}

DT_PRIVATE void comm_tp_wait(dt_comm *c, int timeout_ms)
{
    tp_enter(c, "wait");
    c->tp_iface->wait(c->tp, timeout_ms);
    tp_leave(c, NULL, 0);   /* (the poll that follows says so) */
}

static dt_status tp_send(dt_comm *c, int peer, uint64_t tag, const void *buf, size_t len,
                         dt_xfer *x, char *err, size_t err_len)
{
    tp_enter(c, "send");
    dt_status st = c->tp_iface->send(c->tp, peer, tag, buf, len, x, err, err_len);
    return tp_leave(c, err, err_len) ? DT_EPEER : st;
}

static dt_status tp_recv(dt_comm *c, int peer, uint64_t tag, void *buf, size_t len, dt_xfer *x,
                         char *err, size_t err_len)
{
    tp_enter(c, "receive");
    dt_status st = c->tp_iface->recv(c->tp, peer, tag, 0, buf, len, x, err, err_len);
    return tp_leave(c, err, err_len) ? DT_EPEER : st;
}

/* How long one transport call may take before its callers give up: no
 * call blocks longer than a wait's 50 ms by design, so twice the peer
 * timeout (at least 5 s) is a wedge, not a slow peer or a starved host. */
static double comm_wedge_s(const dt_comm *c)
{
    double s = 2.0 * c->timeout_ms / 1000.0;
    return s > 5.0 ? s : 5.0;
}

/* Under c->mu: is the comm thread wedged in the transport (see tp_enter)?
 * Once it is, it stays so: c's transport is abandoned. */
static int comm_wedged(dt_comm *c)
{
    if (c->wedged || !c->running)
        return c->wedged;   /* (a thread that returned from a wedge stays abandoned) */
    double since;
    __atomic_load(&c->tp_since, &since, __ATOMIC_ACQUIRE);
    double stuck = since > 0 ? dt_now() - since : 0;
    if (stuck <= comm_wedge_s(c))
        return 0;
    snprintf(c->wedge_msg, sizeof c->wedge_msg, "the transport's %s (%s) has not returned for "
             "%d ms, past twice the %d ms timeout: wedged (libfabric's shm provider does this "
             "when a peer dies holding a lock in its shared memory); this communicator is "
             "abandoned", __atomic_load_n(&c->tp_call, __ATOMIC_RELAXED), c->provider,
             (int)(stuck * 1000.0), c->timeout_ms);
    __atomic_store_n(&c->wedged, 1, __ATOMIC_RELEASE);
    return 1;
}

/* Tests put a fault injector of their own between c and its transport
 * (tests/test_comm.c, test_wedged_transport); the one in use comes back.
 * Only between works. */
DT_PRIVATE const dt_transport_iface *comm_swap_transport(dt_comm *c, const dt_transport_iface *iface)
{
    pthread_mutex_lock(&c->mu);
    const dt_transport_iface *was = c->tp_iface;
    c->tp_iface = iface;
    pthread_mutex_unlock(&c->mu);
    return was;
}

/* Under c->mu: wait for the comm thread's news, or a second (to look
 * again whether it is wedged: comm_wedged). */
static void comm_wait_tick(dt_comm *c)
{
    struct timespec tick;
    clock_gettime(CLOCK_REALTIME, &tick);
    tick.tv_sec += 1;
    pthread_cond_timedwait(&c->cv, &c->mu, &tick);
}

/* dt_comm_free: does the comm thread stay inside a wedged transport call?
 * Waits while it runs a work that is not (yet) wedged. */
DT_PRIVATE int comm_thread_stuck(dt_comm *c)
{
    pthread_mutex_lock(&c->mu);
    while (c->running && !comm_wedged(c)) {
        comm_wait_tick(c);
    }
    int stuck = c->running;
    pthread_mutex_unlock(&c->mu);
    return stuck;
}

DT_PRIVATE dt_status comm_post(dt_comm *c, dt_work *w, xfers *xs, int sending, int peer, uint64_t tag,
                      void *buf, size_t bytes)
{
    return comm_post_via(c, w, xs, sending, peer, peer, tag, buf, bytes);
}

/* comm_post through the transport's peer `via`, another endpoint of rank
 * `peer` (a parameter server's answers to this worker come from one of
 * their own): deadlines, silence and blame stay with the rank. */
DT_PRIVATE dt_status comm_post_via(dt_comm *c, dt_work *w, xfers *xs, int sending, int peer, int via,
                                   uint64_t tag, void *buf, size_t bytes)
{
    char err[256] = "";
    dt_status st;
    if (xs->n == DT_COMM_MAX_XFERS)
        return comm_work_fail(w, DT_ENOTSUP, "%s: too many transfers in one step", coll_names[w->kind]);
    dt_xfer *x = &xs->x[xs->n];
    double deadline = dt_now() + c->collective_timeout_ms / 1000.0;
    for (;;) {
        memset(x, 0, sizeof *x);
        x->peer = via;
        st = sending ? tp_send(c, via, tag, buf, bytes, x, err, sizeof err)
                     : tp_recv(c, via, tag, buf, bytes, x, err, sizeof err);
        if (st != DT_ETIMEDOUT || dt_now() >= deadline)
            break;
        /* back-pressured: the peer takes no data; is it alive? */
        c->last_watch = 0;
        if (comm_check_dead(c, w, deadline) != DT_OK)
            return w->status;
        if (xfer_gone(xs, peer))   /* a dead server a parameter-server request can go without */
            return comm_work_fail(w, DT_EPEER, "%s #%u: rank %d died", coll_names[w->kind], w->seq, peer);
    }
    if (st != DT_OK)
        return comm_work_fail(w, st == DT_ETIMEDOUT ? st : DT_EPEER, "%s #%u: %s to rank %d failed: %s",
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
        dt_status st = comm_post(c, w, xs, sending, peer, make_tag(w, step, i++), (char *)buf + off, len);
        if (st != DT_OK)
            return st;
        off += len;
    } while (off < bytes);
    return DT_OK;
}

/* Whether the len bytes h that rank `left` sent as its header describe
 * call w of rank `me`; the failure goes into w.  Depends on its arguments
 * only (tests/fuzz/fuzz_comm.c drives it with any bytes). */
DT_PRIVATE dt_status comm_header_check(dt_work *w, int me, int left, const coll_header *h, size_t len)
{
    if (len != sizeof *h || h->magic != 0x44545243u)
        return comm_work_fail(w, DT_EPEER, "%s #%u: rank %d sent a malformed header",
                              coll_names[w->kind], w->seq, left);
    if (h->kind != (uint32_t)w->kind || h->n != w->n || h->root != (uint32_t)w->root ||
        h->op != (uint32_t)w->op) {
        char mine[96], theirs[96];
        comm_describe_call(mine, sizeof mine, w->kind, w->n, w->root, (int)w->op);
        comm_describe_call(theirs, sizeof theirs, h->kind > COLL_P2P ? -1 : (int)h->kind, h->n,
                           (int)h->root, h->op > 3 ? -1 : (int)h->op);
        return comm_work_fail(w, DT_EMISMATCH, "collective #%u: rank %d called %s, rank %d called %s",
                              w->seq, me, mine, left, theirs);
    }
    return DT_OK;
}

/* The left neighbour's header arrived: does it describe our call? */
static dt_status check_header(dt_comm *c, dt_work *w, xfers *xs)
{
    xs->hdr_checked = 1;
    int left = grp_rank(&xs->g, (xs->g.me - 1 + xs->g.size) % xs->g.size);
    if (xs->hdr_recv.status != DT_OK)
        return comm_work_fail(w, DT_EPEER, "%s #%u: rank %d: connection failed", coll_names[w->kind],
                              w->seq, left);
    return comm_header_check(w, c->rank, left, &xs->hdr_in, xs->hdr_recv.len);
}

/* How long rank 0's dt_comm_free waits for the others to leave (src/store.c). */

/* A failure reason as ranks publish it: "<status>|@<seq>|<message>", seq
 * the failed collective's number (older writers: "<status>|<message>").
 * *seq is set when the reason has one, else left as it is. */
static const char *comm_parse_reason(const char *why, dt_status *st, unsigned *seq)
{
    char *end;
    long code = strtol(why, &end, 10);
    *st = DT_EPEER;
    if (*end != '|' || code <= DT_OK || code > DT_EPEER)
        return why;
    *st = (dt_status)code;
    const char *text = end + 1;
    if (*text == '@') {
        unsigned long n = strtoul(text + 1, &end, 10);
        if (*end == '|' && end > text + 1) {
            *seq = (unsigned)n;
            text = end + 1;
        }
    }
    return text;
}

DT_PRIVATE dt_status comm_fail_with_reason(dt_work *w, const char *why)
{
    dt_status st;
    unsigned seq = 0;
    const char *text = comm_parse_reason(why, &st, &seq);
    if (!*text)   /* (the store holds whatever a rank wrote) */
        text = "another rank failed and gave no reason";
    return comm_work_fail(w, st, "%s", text);
}

/* The first rank to fail publishes why ("abort" in the store), so ranks
 * that only see its consequences (a closed connection, silence) report the
 * cause instead.  DT_OK: nobody has (within park_ms).  With only_ours, a
 * failure of a later collective than w's is not adopted: a slow rank still
 * in an earlier one (its peers finished their part of it, which is why they
 * could go on) would fail a collective that is completing well; its next
 * collective meets the failure. */
static dt_status published_failure(dt_comm *c, dt_work *w, int park_ms, int only_ours)
{
    char why[DT_MAX_ERROR + 24];
    size_t len = 0;
    if (!c->watch || dt_store_get(c->watch, "abort", why, sizeof why - 1, &len, park_ms) != DT_OK ||
        len < 3)
        return DT_OK;
    why[len < sizeof why ? len : sizeof why - 1] = '\0';
    dt_status st;
    unsigned seq = w->seq;
    comm_parse_reason(why, &st, &seq);
    if (only_ours && w->kind != COLL_P2P && seq > w->seq)
        return DT_OK;
    w->status = DT_OK;   /* replace a consequence by the cause */
    return comm_fail_with_reason(w, why);
}

/* A timed-out rank may have waited on a rank that was itself waiting on
 * another: a stalled collective publishes whom it waits for ("wait/<rank>",
 * every DT_COMM_WATCH_S, cleared when it ends well), so follow that chain
 * to the rank that is not waiting, in this collective or an earlier one it
 * is stuck in, and blame it instead of a bystander. */
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
        /* (an edge of an earlier collective: that rank is still stuck in it,
         * since a collective that ends well clears its edge) */
        if (sscanf(edge, "%u:%d", &seq, &next) != 2 || seq > w->seq || next < 0 ||
            next >= c->world || next == who)
            break;
        who = next;
    }
    if (who == w->blame)
        return;
    int waited_on = w->blame;
    char key[32], said[160] = "";
    size_t len = 0;
    unsigned long long beat;
    int used = 0;
    snprintf(key, sizeof key, "/hb/%d", c->members ? c->members[who] : who);
    if (dt_store_get(c->watch, key, said, sizeof said - 1, &len, 1) == DT_OK) {
        said[len < sizeof said ? len : sizeof said - 1] = '\0';
        if (sscanf(said, "%llu %n", &beat, &used) < 1 || used <= 0)
            used = (int)strlen(said);
    }
    w->status = DT_OK;
    comm_work_fail(w, DT_ETIMEDOUT, "%s #%u: rank %d kept it waiting %d ms, the collective timeout "
                   "(dt_comm_config.collective_timeout_ms), though alive (its heartbeat went on)%s%s;"
                   " rank %d was waiting on it", coll_names[w->kind], w->seq, who, w->blame_ms,
                   said[used] ? ": it was " : "", said + used, waited_on);
    w->blame = who;
}

static void publish_failure(dt_comm *c, const dt_work *w)
{
    char why[DT_MAX_ERROR + 24];
    size_t len = 0;
    if (!c->watch || dt_store_get(c->watch, "abort", why, sizeof why - 1, &len, 1) == DT_OK)
        return;   /* someone was first */
    int n = snprintf(why, sizeof why, "%d|@%u|%s", (int)w->status, w->seq, w->msg);
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
                   ? comm_work_fail(w, DT_EPEER, "%s #%u: job rank 0 is unreachable (dead?): %s",
                                    coll_names[w->kind], w->seq, c->watch_errors->err)
                   : DT_OK;
    if (g < 0 && c->waiting_on >= 0) {   /* the first death was not a member's: ours? */
        snprintf(key, sizeof key, "/dead/%d", c->members[c->waiting_on]);
        if (dt_store_get(c->watch, key, val, sizeof val - 1, &len, 1) == DT_OK)
            g = c->waiting_on;
    }
    if (g < 0)
        return comm_check_heartbeat(c, w);
    return comm_work_fail(w, DT_EPEER, "%s #%u: rank %d (job rank %d) died (its process exited "
                          "without leaving the job)", coll_names[w->kind], w->seq, g, c->members[g]);
}

/* A silent rank that an extension's work goes on without
 * (comm_ext_ops.write_off_silent): the failure comm_check_heartbeat gave
 * is taken back, as for a dead one (xfers.write_off). */
static dt_status ext_forgive_silent(dt_work *w)
{
    w->status = DT_OK;
    w->msg[0] = '\0';
    w->blame = -1;
    w->blame_ms = w->blame_gone = 0;
    return DT_OK;
}

static dt_status check_dead_in_store(dt_comm *c, dt_work *w)
{
    if (w->kind == COLL_EXT) {   /* other workers may come and go: only servers matter */
        dt_status st = c->ext_ops->check_dead(c, w);
        if (st == DT_OK)
            st = comm_check_heartbeat(c, w);   /* (the server waited on) */
        if (st != DT_OK && w->blame_gone && c->ext_ops->write_off_silent &&
            c->ext_ops->write_off_silent(c, w, w->blame))
            return ext_forgive_silent(w);
        return st;
    }
    char val[16] = "";
    size_t len = 0;
    /* a rank that failed published why: fail with its words */
    if (published_failure(c, w, 1, 1) != DT_OK)
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
            c->wait_published = 1;
        }
        return comm_check_heartbeat(c, w);
    }
    if (st == DT_OK)
        return comm_work_fail(w, DT_EPEER, "%s #%u: rank %s died (its process exited without "
                              "leaving the job)", coll_names[w->kind], w->seq, val);
    return comm_work_fail(w, DT_EPEER, "%s #%u: rank 0 is unreachable (dead?): %s",
                          coll_names[w->kind], w->seq, c->watch_errors->err);
}

/* Job rank 0 serves the store from its own process: when the store says
 * nothing for this long, rank 0 is silent (stopped or hung), whoever this
 * rank was waiting on. */
static double store_patience_s(const dt_comm *c)
{
    return c->timeout_ms / 2000.0 < 1.0 ? c->timeout_ms / 2000.0 : 1.0;
}

static dt_status rank0_silent(dt_comm *c, dt_work *w)
{
    int me0 = -1;   /* rank 0 of the job in this communicator's numbering */
    for (int i = 0; i < c->world; i++)
        if ((c->members ? c->members[i] : i) == 0)
            me0 = i;
    char waited[64] = "";
    if (c->waiting_on >= 0 && c->waiting_on != me0)
        snprintf(waited, sizeof waited, "; this rank was waiting on rank %d", c->waiting_on);
    int ms = store_silent_ms(c->watch);
    w->status = DT_OK;
    comm_work_fail(w, DT_ETIMEDOUT, "%s #%u: %s 0 is silent: it and the store it serves sent "
                   "nothing for %d ms (stopped or hung?)%s", coll_names[w->kind], w->seq,
                   c->members ? "job rank" : "rank", ms, waited);
    w->blame = me0;
    w->blame_ms = ms;
    return w->status;
}

/* Every DT_COMM_WATCH_S of a wait: has a rank died or published a failure,
 * or has the rank waited on fallen silent (comm_check_heartbeat)?  The
 * store's answers may take until the wait's deadline, but no longer than
 * the liveness timeout (and at least store_patience_s): a silent store
 * fails the work naming rank 0. */
DT_PRIVATE dt_status comm_check_dead(dt_comm *c, dt_work *w, double deadline)
{
    double now = dt_now();
    if (!c->watch || now - c->last_watch < DT_COMM_WATCH_S)
        return DT_OK;
    c->last_watch = now;
    double least = now + store_patience_s(c), alive = now + c->timeout_ms / 1000.0;
    double until = deadline < alive ? deadline : alive;
    store_limit(c->watch, until > least ? until : least);
    dt_status st = check_dead_in_store(c, w);
    store_limit(c->watch, 0);
    if (st == DT_OK && store_silent_ms(c->watch) > 0)
        return rank0_silent(c, w);
    return st;
}

/* A wait's loop, frozen past the timeout between two turns (this process
 * was stopped, or starved): the other ranks have given up on it by now, so
 * what it finishes would be half a collective.  Fail instead. */
DT_PRIVATE dt_status comm_check_stall(dt_comm *c, dt_work *w, double *last)
{
    double now = dt_now(), gap = now - *last;
    *last = now;
    if (gap * 1000.0 <= c->timeout_ms)
        return DT_OK;
    return comm_work_fail(w, DT_ETIMEDOUT, "%s #%u: this rank (%d) did not run for %d ms, past "
                          "the %d ms timeout (stopped or starved?): the others have given up on it",
                          coll_names[w->kind], w->seq, c->rank, (int)(gap * 1000.0), c->timeout_ms);
}

/* A failed work: the cause if another rank published one, the rank at the
 * end of a chain of waits, and ours published for the others.  The store's
 * answers get store_patience_s: a store silent that long means rank 0 is. */
static void explain_failure(dt_comm *c, dt_work *w)
{
    if (!c->watch)
        return;
    store_limit(c->watch, dt_now() + store_patience_s(c));
    int silent = store_silent_ms(c->watch) > 0;   /* already, in a wait's check */
    if (!silent && (w->status == DT_EPEER || w->status == DT_ETIMEDOUT))
        published_failure(c, w, 1, 0);
    silent = silent || store_silent_ms(c->watch) > 0;
    if (!silent && w->status == DT_ETIMEDOUT && w->blame >= 0 && !w->blame_gone)
        follow_waits(c, w);
    silent = silent || store_silent_ms(c->watch) > 0;
    if (!silent)
        publish_failure(c, w);
    silent = silent || store_silent_ms(c->watch) > 0;
    if (silent && w->status == DT_ETIMEDOUT && !strstr(w->msg, "0 is silent") &&
        !strstr(w->msg, "did not run for"))
        rank0_silent(c, w);
    store_limit(c->watch, 0);
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
        if (!xs->x[i].done && xfer_gone(xs, comm_xfer_rank(c, &xs->x[i]))) {
            if (!xs->cancelled[i])   /* at once: a provider may hold other peers' */
                c->tp_iface->cancel(c->tp, &xs->x[i]);   /* completions behind it */
            xs->cancelled[i] = 1;
            left = 1;
        }
    return left;
}

/* Is a transfer with a dead peer (or one cancelled, its peer since back)
 * still held by the transport? */
static int xfers_letting_go(const dt_comm *c, const xfers *xs)
{
    for (int i = 0; i < xs->n; i++)
        if (!xs->x[i].done && (xs->cancelled[i] || xfer_gone(xs, comm_xfer_rank(c, &xs->x[i]))))
            return 1;
    return 0;
}

/* Sends to a dead peer that neither complete nor cancel (a large message's
 * rendezvous on tcp;ofi_rxm, shm's answered sends) are orphaned: the
 * transport keeps them, and their records (this xfers) are kept until the
 * transport closes, so nothing it may still write is reused; the caller
 * (ps_run) goes on with a fresh record. */
static void drain_gone(dt_comm *c, xfers *xs)
{
    cancel_gone(c, xs);
    int left = xfers_letting_go(c, xs);
    for (double end = dt_now() + 1.0; left && dt_now() < end;) {
        dt_xfer *done[16];
        char err[256];
        if (comm_tp_poll(c, done, 16, err, sizeof err) <= 0)
            comm_tp_wait(c, 10);
        left = xfers_letting_go(c, xs);
    }
    xs->orphans = left;
}

/* Is x one of this record's transfers (not an orphan of an earlier one)? */
static int xfer_ours(const xfers *xs, const dt_xfer *x)
{
    return (x >= xs->x && x < xs->x + xs->n) || x == &xs->hdr_send || x == &xs->hdr_recv;
}

/* A wait that ended well after the peer timeout: a living rank kept this
 * one waiting, which the profile's report tells (prof_long_wait). */
DT_PRIVATE void comm_note_long_wait(dt_comm *c, const dt_work *w, double start)
{
    double waited = dt_now() - start;
    if (waited * 1000.0 <= c->timeout_ms || c->waiting_on < 0)
        return;
    char what[48];
    snprintf(what, sizeof what, "%s #%u", coll_names[w->kind], w->seq);
    prof_long_wait(c->ctx, waited, c->waiting_on, what,
                   c->hb_peer == c->waiting_on ? c->hb_doing : NULL);
}

DT_PRIVATE dt_status comm_wait_xfers(dt_comm *c, dt_work *w, xfers *xs)
{
    int limit_ms = (int)((xs->patience > 0 ? xs->patience : 1.0) * c->collective_timeout_ms);
    double start = dt_now(), deadline = start + limit_ms / 1000.0, turn = start;
    for (;;) {
        int pending = 0, silent_peer = -1;
        if (comm_check_stall(c, w, &turn) != DT_OK)
            break;
        for (int i = 0; i < xs->n; i++) {
            if (!xs->x[i].done && !xs->cancelled[i] && !xfer_gone(xs, comm_xfer_rank(c, &xs->x[i]))) {
                pending++;
                silent_peer = comm_xfer_rank(c, &xs->x[i]);
            }
        }
        int hdr_pending = xs->has_hdr && (!xs->hdr_recv.done || !xs->hdr_send.done);
        if (xs->has_hdr && xs->hdr_recv.done && !xs->hdr_checked && check_header(c, w, xs) != DT_OK)
            break;
        if (!pending && !hdr_pending)
            break;
        dt_xfer *done[16];
        char err[256] = "";
        int k = comm_tp_poll(c, done, 16, err, sizeof err);
        if (k < 0) {
            comm_work_fail(w, DT_EPEER, "%s #%u: transport failure: %s", coll_names[w->kind], w->seq, err);
            break;
        }
        if (k > 0)
            seg_heartbeat(c);
        int ours = 0;
        for (int i = 0; i < k; i++) {
            dt_xfer *x = done[i];
            if (!xfer_ours(xs, x))
                continue;   /* an orphaned send (drain_gone) let go at last */
            ours++;
            if (x >= xs->x && x < xs->x + xs->n && xs->cancelled[x - xs->x])
                continue;   /* with a dead process of a rank since restarted */
            int rank = comm_xfer_rank(c, x);
            if (w->kind == COLL_EXT && c->ext_done_at && rank >= 0 && rank < c->world)
                c->ext_done_at[rank] = dt_now();
            if (x->status != DT_OK && x != &xs->hdr_recv && !xfer_gone(xs, rank) &&
                !(xs->write_off && xs->write_off(c, xs->write_off_arg, rank)))
                comm_work_fail(w, x->status == DT_EMISMATCH ? DT_EMISMATCH : DT_EPEER,
                               "%s #%u: transfer with rank %d failed (%s)", coll_names[w->kind], w->seq,
                               rank, dt_strerror(x->status));
        }
        if (w->status != DT_OK)
            break;
        int who = xs->has_hdr && !xs->hdr_recv.done
                      ? grp_rank(&xs->g, (xs->g.me - 1 + xs->g.size) % xs->g.size)
                      : silent_peer;
        c->waiting_on = who;
        if (ours)
            continue;
        /* no progress of ours (the completions, if any, were others'): is
         * a rank dead or silent, is the deadline past? */
        if (comm_check_dead(c, w, deadline) != DT_OK)
            break;
        if (xs->gone)
            cancel_gone(c, xs);
        if (xs->idle && xs->idle(c, w, xs, xs->write_off_arg) != DT_OK)
            break;
        if (dt_now() >= deadline) {
            comm_blame_silent(w, who, limit_ms);
            break;
        }
        if (k == 0)
            comm_tp_wait(c, store_ms_left(deadline) < 50 ? store_ms_left(deadline) : 50);
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
    comm_note_long_wait(c, w, start);
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
    double deadline = dt_now() + c->collective_timeout_ms / 1000.0;
    dt_status st;
    if (tp_recv(c, left, tag, &xs->hdr_in, sizeof xs->hdr_in, &xs->hdr_recv, err, sizeof err) !=
        DT_OK)
        return comm_work_fail(w, DT_EPEER, "%s #%u: cannot post a receive from rank %d: %s",
                              coll_names[w->kind], w->seq, left, err);
    while ((st = tp_send(c, right, tag, &xs->hdr_out, sizeof xs->hdr_out, &xs->hdr_send, err,
                         sizeof err)) == DT_ETIMEDOUT &&
           dt_now() < deadline) {
        c->last_watch = 0;   /* back-pressured: is rank `right` alive? */
        if (comm_check_dead(c, w, deadline) != DT_OK)
            break;
    }
    if (w->status == DT_OK && st != DT_OK)
        comm_work_fail(w, st == DT_ETIMEDOUT ? st : DT_EPEER, "%s #%u: cannot send to rank %d: %s",
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
DT_PRIVATE void comm_reduce_into(float *restrict dst, const float *restrict src, int64_t n, dt_reduce_op op)
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
        comm_work_fail(w, DT_ENOMEM, "%s: out of memory for %lld floats", coll_names[w->kind],
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
    return comm_wait_xfers(c, w, xs);
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
        return comm_wait_xfers(c, w, xs);
    }
    if (r < extra) {
        if (post_chunked(c, w, xs, 0, grp_rank(g, r + p2), step, tmp, bytes) != DT_OK ||
            comm_wait_xfers(c, w, xs) != DT_OK)
            return w->status;
        comm_reduce_into(buf, tmp, n, w->op);
    }
    for (int mask = 1; mask < p2; mask <<= 1) {
        step++;
        if (exchange(c, w, xs, grp_rank(g, r ^ mask), step, buf, tmp, n) != DT_OK)
            return w->status;
        /* the same order on both sides keeps every rank's result identical */
        if (r < (r ^ mask)) {
            comm_reduce_into(buf, tmp, n, w->op);
        } else {
            comm_reduce_into(tmp, buf, n, w->op);
            memcpy(buf, tmp, bytes);
        }
    }
    if (r < extra) {
        if (post_chunked(c, w, xs, 1, grp_rank(g, r + p2), 1000, buf, bytes) != DT_OK)
            return w->status;
        return comm_wait_xfers(c, w, xs);
    }
    return DT_OK;
}

/* [lo, hi) of block b when n is cut into `parts` near-equal blocks */
DT_PRIVATE void comm_block_range(int64_t n, int parts, int b, int64_t *lo, int64_t *hi)
{
    *lo = n / parts * b + (b < n % parts ? b : n % parts);
    *hi = *lo + n / parts + (b < n % parts);
}

/* [lo, hi) of block b of w's n floats: the offsets a _V collective
 * carries (aux), else near-equal blocks. */
static void work_block(const dt_work *w, int64_t n, int parts, int b, int64_t *lo, int64_t *hi)
{
    if (w->kind == COLL_REDUCE_SCATTER_V || w->kind == COLL_ALLGATHER_V) {
        const int64_t *at = w->aux;
        *lo = at[b];
        *hi = at[b + 1];
        return;
    }
    comm_block_range(n, parts, b, lo, hi);
}

static int64_t work_biggest_block(const dt_work *w, int64_t n, int parts)
{
    int64_t most = 0;
    for (int b = 0; b < parts; b++) {
        int64_t lo, hi;
        work_block(w, n, parts, b, &lo, &hi);
        most = hi - lo > most ? hi - lo : most;
    }
    return most;
}

/* Ring reduce-scatter over buf cut into world blocks (work_block): afterwards
 * block (rank + 1) % world holds the full reduction. */
static dt_status ring_reduce_scatter(dt_comm *c, dt_work *w, xfers *xs, float *buf, int64_t n)
{
    int P = xs->g.size, r = xs->g.me;
    int right = grp_rank(&xs->g, (r + 1) % P), left = grp_rank(&xs->g, (r - 1 + P) % P);
    float *tmp = comm_scratch(c, w, work_biggest_block(w, n, P) + 1);
    if (!tmp)
        return w->status;
    for (int s = 0; s < P - 1; s++) {
        int send_b = (r - s + P) % P, recv_b = (r - s - 1 + 2 * P) % P;
        int64_t slo, shi, rlo, rhi;
        work_block(w, n, P, send_b, &slo, &shi);
        work_block(w, n, P, recv_b, &rlo, &rhi);
        if (post_chunked(c, w, xs, 0, left, (uint32_t)s, tmp, (size_t)(rhi - rlo) * sizeof(float)) != DT_OK ||
            post_chunked(c, w, xs, 1, right, (uint32_t)s, buf + slo, (size_t)(shi - slo) * sizeof(float)) != DT_OK ||
            comm_wait_xfers(c, w, xs) != DT_OK)
            return w->status;
        comm_reduce_into(buf + rlo, tmp, rhi - rlo, w->op);
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
        work_block(w, n, P, send_b, &slo, &shi);
        work_block(w, n, P, recv_b, &rlo, &rhi);
        if (post_chunked(c, w, xs, 0, left, step0 + (uint32_t)s, buf + rlo, (size_t)(rhi - rlo) * sizeof(float)) != DT_OK ||
            post_chunked(c, w, xs, 1, right, step0 + (uint32_t)s, buf + slo, (size_t)(shi - slo) * sizeof(float)) != DT_OK ||
            comm_wait_xfers(c, w, xs) != DT_OK)
            return w->status;
    }
    return DT_OK;
}

DT_PRIVATE void comm_finish_avg(dt_comm *c, dt_work *w, float *buf, int64_t n)
{
    if (w->op == DT_REDUCE_AVG) {
        float k = 1.0f / (float)c->world;
        for (int64_t i = 0; i < n; i++)
            buf[i] *= k;
    }
}

/* Does an allreduce of w over P ranks take recursive doubling (small
 * messages, a barrier) rather than the ring? */
static int allreduce_doubles(const dt_comm *c, const dt_work *w, int P)
{
    return w->kind == COLL_BARRIER || (size_t)w->n * sizeof(float) <= c->doubling_max || w->n < P;
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
    if (allreduce_doubles(c, w, P))
        return allreduce_doubling(c, w, xs, w->buf, w->n);
    if (ring_reduce_scatter(c, w, xs, w->buf, w->n) != DT_OK)
        return w->status;
    return ring_allgather(c, w, xs, w->buf, w->n, 1, (uint32_t)P);
}

static dt_status run_allreduce(dt_comm *c, dt_work *w, xfers *xs)
{
    if (allreduce_transport(c, w, xs) != DT_OK)
        return w->status;
    comm_finish_avg(c, w, w->buf, w->n);
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
                comm_wait_xfers(c, w, xs) != DT_OK)
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
    return comm_wait_xfers(c, w, xs);
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
        return comm_work_fail(w, DT_ENOMEM, "reduce_scatter: out of memory");
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
                comm_wait_xfers(c, w, xs);
            st = w->status;
        } else {
            memcpy(w->buf, work, (size_t)w->n * sizeof(float));
        }
        if (st == DT_OK)
            comm_finish_avg(c, w, w->buf, w->n);
    }
    c->ctx->al.free_fn(work, c->ctx->al.user);
    return st;
}

/* Reduce-scatter of uneven blocks, in place: the ring leaves block
 * (rank + 1) % world complete here; it goes to its owner, and ours comes
 * from the left (as run_reduce_scatter). */
static dt_status run_reduce_scatter_v(dt_comm *c, dt_work *w, xfers *xs)
{
    int P = c->world, r = c->rank;
    int64_t lo, hi;
    work_block(w, w->n, P, r, &lo, &hi);
    if (P > 1 && w->n > 0) {
        int have = (r + 1) % P, from = (r - 1 + P) % P;
        int64_t hlo, hhi;
        work_block(w, w->n, P, have, &hlo, &hhi);
        if (ring_reduce_scatter(c, w, xs, w->buf, w->n) != DT_OK ||
            post_chunked(c, w, xs, 0, from, 5000, w->buf + lo, (size_t)(hi - lo) * sizeof(float)) != DT_OK ||
            post_chunked(c, w, xs, 1, have, 5000, w->buf + hlo, (size_t)(hhi - hlo) * sizeof(float)) != DT_OK ||
            comm_wait_xfers(c, w, xs) != DT_OK)
            return w->status;
    }
    comm_finish_avg(c, w, w->buf + lo, hi - lo);
    return DT_OK;
}

/* Allgather of uneven blocks, in place: block rank is ours at the start. */
static dt_status run_allgather_v(dt_comm *c, dt_work *w, xfers *xs)
{
    if (c->world == 1 || w->n == 0)
        return DT_OK;
    return ring_allgather(c, w, xs, w->buf, w->n, 0, 0);
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
            comm_wait_xfers(c, w, xs) != DT_OK)
            return w->status;
    }
    return DT_OK;
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
        w->blame_gone = sub->blame_gone;
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
        return comm_work_fail(w, DT_ENOMEM, "16-bit allreduce: out of memory");
    memset(mem, 0, bytes);
    float *send = mem, *recv = mem + (int64_t)P * Bf, *acc = recv + (int64_t)P * Bf;
    for (int q = 0; q < P; q++) {
        int64_t lo = q * B < n ? q * B : n, hi = lo + B < n ? lo + B : n;
        enc16(codec, w->buf + lo, hi - lo, (uint16_t *)(send + (int64_t)q * Bf));
    }
    if (!on_segment && xs->has_hdr) {   /* the call's header first: the parts below have none */
        if (comm_wait_xfers(c, w, xs) != DT_OK)
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
    case COLL_REDUCE_SCATTER_V: return seg_reduce_scatter_v(c, w);
    case COLL_ALLGATHER_V: return seg_allgather_v(c, w);
    }
    return comm_work_fail(w, DT_EINVAL, "unknown collective %d", w->kind);
}

static dt_status run_flat(dt_comm *c, dt_work *w, xfers *xs)
{
    static const uint8_t algs[] = {[COLL_BROADCAST] = COMM_ALG_TREE, [COLL_ALLGATHER] = COMM_ALG_RING,
                                   [COLL_REDUCE_SCATTER] = COMM_ALG_RING,
                                   [COLL_ALLTOALL] = COMM_ALG_PAIRWISE,
                                   [COLL_ALLREDUCE16] = COMM_ALG_RING16,
                                   [COLL_REDUCE_SCATTER_V] = COMM_ALG_RING,
                                   [COLL_ALLGATHER_V] = COMM_ALG_RING};
    int reduce = w->kind == COLL_ALLREDUCE || w->kind == COLL_BARRIER;
    w->alg = !reduce ? algs[w->kind]
             : allreduce_doubles(c, w, xs->g.size) ? COMM_ALG_DOUBLING : COMM_ALG_RING;
    switch (w->kind) {
    case COLL_ALLREDUCE: case COLL_BARRIER: run_allreduce(c, w, xs); break;
    case COLL_BROADCAST: run_broadcast(c, w, xs); break;
    case COLL_ALLGATHER: run_allgather(c, w, xs); break;
    case COLL_REDUCE_SCATTER: run_reduce_scatter(c, w, xs); break;
    case COLL_ALLTOALL: run_alltoall(c, w, xs); break;
    case COLL_ALLREDUCE16: allreduce16(c, w, xs, 0); break;
    case COLL_REDUCE_SCATTER_V: run_reduce_scatter_v(c, w, xs); break;
    case COLL_ALLGATHER_V: run_allgather_v(c, w, xs); break;
    }
    if (w->status == DT_OK)
        comm_wait_xfers(c, w, xs);   /* the header, if the data finished first */
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
            comm_finish_avg(c, w, w->buf, w->n);
        if (w->status != DT_OK || comm_wait_xfers(c, w, xs) != DT_OK)
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
        if (comm_post(c, w, xs, 0, p->src, p2p_tag(p->rseq, (uint32_t)k), (char *)p->recv + off, len) !=
            DT_OK)
            return;
    }
    for (size_t off = 0, k = 0; p->dst >= 0 && (off < sb || k == 0); off += chunk, k++) {
        size_t len = sb - off < chunk ? sb - off : chunk;
        if (comm_post(c, w, xs, 1, p->dst, p2p_tag(p->sseq, (uint32_t)k), (char *)p->send + off, len) !=
            DT_OK)
            return;
    }
    if (comm_wait_xfers(c, w, xs) != DT_OK)
        return;
    size_t got = 0;   /* the receives came first in xs (comm_wait_xfers keeps them) */
    for (size_t i = 0; p->src >= 0 && i < rchunks; i++)
        got += xs->x[i].len;
    if (p->src >= 0 && got != rb)
        comm_work_fail(w, DT_EMISMATCH, "recv: rank %d sent %zu floats, %lld expected", p->src,
                       got / sizeof(float), (long long)p->nr);
}

/* A stalled collective that ended well says it waits no more, so no later
 * timeout follows its edge (follow_waits). */
static void clear_wait(dt_comm *c, const dt_work *w)
{
    char key[32], edge[32];
    snprintf(key, sizeof key, "wait/%d", c->rank);
    int n = snprintf(edge, sizeof edge, "%u:-1", w->seq);
    store_limit(c->watch, dt_now() + store_patience_s(c));
    dt_store_set(c->watch, key, edge, (size_t)n + 1);
    store_limit(c->watch, 0);
    c->wait_published = 0;
}

/* (the heartbeat thread, src/join.c, sets the fields: join_note_oversleep) */
DT_PRIVATE int comm_frozen_ms(dt_comm *c, double since)
{
    if (!c || !c->has_hb)
        return 0;
    double due, at, now = dt_now();
    __atomic_load(&c->hb_due, &due, __ATOMIC_ACQUIRE);
    __atomic_load(&c->frozen_at, &at, __ATOMIC_ACQUIRE);
    int live = due > 0 ? (int)((now - due) * 1000.0) + c->beat_ms : 0;   /* still asleep */
    int seen = at >= since ? __atomic_load_n(&c->frozen_ms, __ATOMIC_ACQUIRE) : 0;
    int ms = live > seen ? live : seen;
    return ms > c->timeout_ms ? ms : 0;
}

/* A failed work on a rank that was itself frozen meanwhile or just
 * before (stopped or starved past the timeout: comm_frozen_ms): whatever
 * it saw after (a
 * closed connection, the others' verdict) follows from the others having
 * given up on it, so its error says so first. */
static void comm_name_freeze(dt_comm *c, dt_work *w, double start)
{
    int ms = comm_frozen_ms(c, start - 2.0 * c->timeout_ms / 1000.0);   /* (a freeze just
                                          before: the others' timeouts run out in this work) */
    if (!ms || strstr(w->msg, "did not run for"))
        return;
    char saw[DT_MAX_ERROR];
    snprintf(saw, sizeof saw, "%s", w->msg);
    snprintf(w->msg, sizeof w->msg, "%s #%u: this rank (%d) did not run for %d ms, past the %d ms "
             "timeout (stopped or starved?): the others have given up on it (then: %.200s)",
             coll_names[w->kind], w->seq, c->rank, ms, c->timeout_ms, saw);
    w->status = DT_ETIMEDOUT;
}

static void run_work(dt_comm *c, dt_work *w)
{
    double start = dt_now();
    if (w->ticket)   /* its data is still on the way from the device (even if it won't go) */
        c->ctx->be_iface->copy_wait(c->ctx->be, w->ticket);
    if (c->broken) {
        comm_work_fail(w, DT_ESTATE, "%s #%u: communicator failed earlier: %s", coll_names[w->kind],
                       w->seq, c->broken_msg);
        return;
    }

    c->waiting_on = -1;
    c->wait_published = 0;
    xfers *xs = c->ctx->al.malloc_fn(sizeof *xs, c->ctx->al.user);
    if (!xs) {
        comm_work_fail(w, DT_ENOMEM, "%s: out of memory", coll_names[w->kind]);
    } else {
        memset(xs, 0, sizeof *xs);
        xs->g = (grp){c->rank, c->world, NULL};
        w->alg = w->kind == COLL_EXT ? COMM_ALG_EXT : w->kind == COLL_P2P ? COMM_ALG_P2P
                 : c->use_segment && c->nhosts == 1 ? COMM_ALG_SEGMENT
                 : c->use_segment ? COMM_ALG_HIERARCHICAL : COMM_ALG_NONE;   /* run_flat sets it */
        if (w->kind == COLL_EXT && !c->ext_done_at)
            c->ext_done_at = host_calloc(c->ctx, sizeof *c->ext_done_at * (size_t)c->world);
        for (int r = 0; w->kind == COLL_EXT && c->ext_done_at && r < c->world; r++)
            c->ext_done_at[r] = 0;
        if (w->kind == COLL_EXT)
            c->ext_ops->run(c, w, &xs);
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
    if (w->status != DT_OK)
        explain_failure(c, w);
    if (w->status != DT_OK)
        comm_name_freeze(c, w, start);
    if (w->status != DT_OK) {
        /* Close the endpoint now: a cancelled receive must not land in
         * this record or in the caller's buffer after the call returned.
         * The communicator refuses all later work anyway. */
        seg_abort(c, w);
        comm_break(c, w->msg);
    }
    if (w->status == DT_OK && c->wait_published)
        clear_wait(c, w);
    if (xs)
        c->ctx->al.free_fn(xs, c->ctx->al.user);
}

/* --- the comm thread and the caller's side --------------------------- */

static void comm_work_free(dt_work *w)
{
    host_free(w->comm->ctx, w->owned);
    host_free(w->comm->ctx, w);
}

DT_PRIVATE void *comm_main(void *arg)
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
        comm_record(c, w, t0, t1);
        pthread_mutex_lock(&c->mu);
        c->running = 0;
        w->done = 1;
        if (w->orphaned)   /* its waiter gave up on the wedged transport */
            comm_work_free(w);
        pthread_cond_broadcast(&c->cv);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* A restarted rank's communicator runs no collective: the others
 * are mid-job, and nothing would match. */
static dt_status rejoined_refuses(dt_comm *c, int kind)
{
    if (!c->inc || kind == COLL_EXT)
        return DT_OK;
    return set_error(c->ctx, DT_ESTATE, "%s: rank %d is a restarted process that rejoined a "
                     "running job; only parameter-server requests work on its communicator",
                     coll_names[kind], c->rank);
}

DT_PRIVATE dt_work *comm_enqueue_in(dt_comm *c, int kind, float *buf, const float *in, int64_t n, int root,
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
    if (comm_wedged(c)) {
        pthread_mutex_unlock(&c->mu);
        host_free(ctx, w);
        set_error(ctx, DT_ESTATE, "%s: %s%s", coll_names[kind], c->label, c->wedge_msg);
        return NULL;
    }
    /* collectives' order only: requests and point-to-point messages have their own */
    w->seq = kind == COLL_EXT ? c->ext_requests++ : kind == COLL_P2P ? 0 : c->next_seq++;
    if (c->tail)
        c->tail->next = w;
    else
        c->head = w;
    c->tail = w;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return w;
}

DT_PRIVATE dt_work *comm_enqueue(dt_comm *c, int kind, float *buf, const float *in, int64_t n, int root,
                        dt_reduce_op op)
{
    return comm_enqueue_in(c, kind, buf, in, n, root, op, NULL);
}

/* Wait for w, free it, and give the seconds it ran (run_s may be NULL).
 * The wait looks every second whether the comm thread is wedged in the
 * transport (comm_wedged): then w fails, and the thread frees it if it
 * ever gets that far. */
DT_PRIVATE dt_status comm_work_finish(dt_work *w, double *run_s)
{
    dt_comm *c = w->comm;
    pthread_mutex_lock(&c->mu);
    while (!w->done && !comm_wedged(c)) {
        comm_wait_tick(c);
    }
    if (!w->done) {
        w->orphaned = 1;
        pthread_mutex_unlock(&c->mu);
        return set_error(c->ctx, DT_EPEER, "%s%s #%u: %s", c->label, coll_names[w->kind], w->seq,
                         c->wedge_msg);
    }
    pthread_mutex_unlock(&c->mu);
    dt_status st = w->status;
    if (st != DT_OK)
        set_error(c->ctx, st, "%s%s", c->label, w->msg);
    if (run_s)
        *run_s = w->run_s;
    comm_work_free(w);
    return st;
}

/* Has w finished (comm_work_finish would not wait)?  A work behind a
 * wedged transport counts as finished: its wait fails at once. */
DT_PRIVATE int comm_work_done(dt_work *w)
{
    pthread_mutex_lock(&w->comm->mu);
    int done = w->done || comm_wedged(w->comm);
    pthread_mutex_unlock(&w->comm->mu);
    return done;
}

dt_status dt_work_wait(dt_work *w)
{
    if (!w)
        return DT_EINVAL;
    dt_ctx *ctx = w->comm->ctx;
    double t0 = prof_begin(ctx);
    int act = ctx_doing(ctx, ACT_COLLECTIVE);
    dt_status st = comm_work_finish(w, NULL);
    ctx_done(ctx, act);
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

dt_work *dt_comm_allreduce_async(dt_comm *c, float *buf, int64_t n, dt_reduce_op op)
{
    if (!coll_args_ok(c, "allreduce", buf, n) || !op_ok(c, "allreduce", op))
        return NULL;
    return comm_enqueue(c, COLL_ALLREDUCE, buf, NULL, n, 0, op);
}

/* A blocking collective with nothing queued ahead of it runs right here on
 * the caller's thread: handing it to the sleeping comm thread and being
 * woken back costs two kernel wake-ups, two thirds of a 4 KiB allreduce
 * (tests/bench/allreduce.sh profile).  `running` keeps the comm thread off
 * the transport meanwhile. */
/* A caller takes the transport from the comm thread for a while (a
 * parameter server serves on its own thread): once the thread is idle and
 * its queue empty, it runs nothing until comm_release_transport.  A
 * communicator that failed earlier is not taken: its message goes to why. */
DT_PRIVATE dt_status comm_take_transport(dt_comm *c, char *why, size_t why_len)
{
    pthread_mutex_lock(&c->mu);
    while ((c->running || c->head) && !comm_wedged(c))
        comm_wait_tick(c);
    int broken = c->broken || c->wedged;
    if (broken)
        snprintf(why, why_len, "%s", c->wedged ? c->wedge_msg : c->broken_msg);
    else
        c->running = 1;
    pthread_mutex_unlock(&c->mu);
    return broken ? DT_ESTATE : DT_OK;
}

DT_PRIVATE void comm_release_transport(dt_comm *c)
{
    pthread_mutex_lock(&c->mu);
    c->running = 0;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

/* The communicator fails for good with msg: the endpoint closes (nothing
 * may land in a caller's memory after this) and every later call is
 * refused with msg.  The caller holds the transport. */
DT_PRIVATE void comm_break(dt_comm *c, const char *msg)
{
    c->broken = 1;
    snprintf(c->broken_msg, sizeof c->broken_msg, "%s", msg);
    c->tp_iface->close(c->tp);
    c->tp = NULL;
}

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
    comm_record(c, &w, t0, dt_now());
    pthread_mutex_lock(&c->mu);
    c->running = 0;
    if (c->head)   /* the comm thread waits for us only when work is queued */
        pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    if (w.status != DT_OK)
        set_error(c->ctx, w.status, "%s%s", c->label, w.msg);
    return w.status;
}

DT_PRIVATE dt_status comm_run_wait(dt_comm *c, int kind, float *buf, const float *in,
                                     int64_t n, int root, dt_reduce_op op, const void *aux)
{
    if (rejoined_refuses(c, kind) != DT_OK)
        return DT_ESTATE;
    if (c->inline_small) {
        dt_status st = run_inline(c, kind, buf, in, n, root, op, aux);
        if (st != DT_ESTATE || c->broken)
            return st;
    }
    dt_work *w = comm_enqueue_in(c, kind, buf, in, n, root, op, aux);
    return w ? comm_work_finish(w, NULL) : c->ctx->last_status;
}

/* A blocking collective: the caller's wait is communication it sees. */
DT_PRIVATE dt_status comm_run_in(dt_comm *c, int kind, float *buf, const float *in, int64_t n,
                                   int root, dt_reduce_op op, const void *aux)
{
    double t0 = prof_begin(c->ctx);
    int act = ctx_doing(c->ctx, ACT_COLLECTIVE);
    dt_status st = comm_run_wait(c, kind, buf, in, n, root, op, aux);
    ctx_done(c->ctx, act);
    prof_end(c->ctx, PH_COMM_WAIT, t0);
    return st;
}

static dt_status run_collective(dt_comm *c, int kind, float *buf, const float *in, int64_t n,
                                int root, dt_reduce_op op)
{
    return comm_run_in(c, kind, buf, in, n, root, op, NULL);
}

dt_status dt_comm_allreduce(dt_comm *c, float *buf, int64_t n, dt_reduce_op op)
{
    if (!c)
        return DT_EINVAL;
    if (!coll_args_ok(c, "allreduce", buf, n) || !op_ok(c, "allreduce", op))
        return DT_EINVAL;
    return run_collective(c, COLL_ALLREDUCE, buf, NULL, n, 0, op);
}

dt_status dt_comm_broadcast(dt_comm *c, float *buf, int64_t n, int root)
{
    if (!coll_args_ok(c, "broadcast", buf, n))
        return DT_EINVAL;
    if (root < 0 || root >= c->world)
        return set_error(c->ctx, DT_EINVAL, "broadcast: root %d is not a rank of %d", root,
                         c->world);
    return run_collective(c, COLL_BROADCAST, buf, NULL, n, root, DT_REDUCE_SUM);
}

dt_status dt_comm_allgather(dt_comm *c, const float *in, int64_t n, float *out)
{
    if (!coll_args_ok(c, "allgather", in, n) || !coll_args_ok(c, "allgather", out, n))
        return DT_EINVAL;
    return run_collective(c, COLL_ALLGATHER, out, in, n, 0, DT_REDUCE_SUM);
}

dt_status dt_comm_reduce_scatter(dt_comm *c, const float *in, int64_t n, float *out, dt_reduce_op op)
{
    if (!coll_args_ok(c, "reduce_scatter", in, n) || !coll_args_ok(c, "reduce_scatter", out, n) ||
        !op_ok(c, "reduce_scatter", op))
        return DT_EINVAL;
    return run_collective(c, COLL_REDUCE_SCATTER, out, in, n, 0, op);
}

dt_status dt_comm_alltoall(dt_comm *c, const float *in, int64_t n, float *out)
{
    if (!coll_args_ok(c, "alltoall", in, n) || !coll_args_ok(c, "alltoall", out, n))
        return DT_EINVAL;
    return run_collective(c, COLL_ALLTOALL, out, in, n, 0, DT_REDUCE_SUM);
}

dt_status dt_comm_barrier(dt_comm *c)
{
    if (!c)
        return DT_EINVAL;
    float unused = 0;   /* n = 0: never read; the call blocks until done */
    return run_collective(c, COLL_BARRIER, &unused, NULL, 0, 0, DT_REDUCE_SUM);
}

DT_PRIVATE dt_status comm_p2p_run(dt_comm *c, const float *send, int64_t ns, int dst, float *recv,
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
    return comm_run_in(c, COLL_P2P, recv, send, dst >= 0 ? ns : nr, dst >= 0 ? dst : src,
                             DT_REDUCE_SUM, &call);
}

dt_status dt_comm_send(dt_comm *c, const float *buf, int64_t n, int dst)
{
    return comm_p2p_run(c, buf, n, dst < 0 ? INT32_MAX : dst, NULL, 0, -1);
}

dt_status dt_comm_recv(dt_comm *c, float *buf, int64_t n, int src)
{
    return comm_p2p_run(c, NULL, 0, -1, buf, n, src < 0 ? INT32_MAX : src);
}

dt_status dt_comm_sendrecv(dt_comm *c, const float *send, int64_t ns, int dst, float *recv, int64_t nr,
                      int src)
{
    return comm_p2p_run(c, send, ns, dst < 0 ? INT32_MAX : dst, recv, nr, src < 0 ? INT32_MAX : src);
}

/* --- what a communicator is (its owner's accessors; the higher modules,
 * join and preempt among them, ask here) -------------------------------- */

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

DT_PRIVATE int comm_serial(dt_comm *c, int kind) { return c->serials[kind]++; }

/* for the modules above (the parameter server runs its own loop on the
 * communicator's transport endpoint and watches deaths on its store) */
DT_PRIVATE dt_ctx *comm_ctx(const dt_comm *c) { return c->ctx; }
DT_PRIVATE int comm_timeout_ms(const dt_comm *c) { return c->timeout_ms; }
DT_PRIVATE int comm_collective_timeout_ms(const dt_comm *c) { return c->collective_timeout_ms; }
DT_PRIVATE uint32_t comm_incarnation(const dt_comm *c) { return c->inc; }
DT_PRIVATE size_t comm_max_msg(const dt_comm *c) { return c->max_msg; }
DT_PRIVATE const dt_transport_iface *comm_tp_iface(const dt_comm *c) { return c->tp_iface; }
DT_PRIVATE dt_transport *comm_tp(const dt_comm *c) { return c->tp; }
DT_PRIVATE dt_store *comm_watch(const dt_comm *c) { return c->watch; }
DT_PRIVATE const char *comm_label(const dt_comm *c) { return c->label; }
DT_PRIVATE int comm_local_size(const dt_comm *c) { return c->nlocal; }
DT_PRIVATE const char *comm_broken_msg(const dt_comm *c) { return c->broken ? c->broken_msg : NULL; }

DT_PRIVATE uint64_t comm_stage_next(dt_comm *c, uint64_t ticket)
{
    uint64_t was = c->stage_ticket;
    c->stage_ticket = ticket;
    return was;
}

DT_PRIVATE int comm_attach_ext(dt_comm *c, const comm_ext_ops *ops)
{
    c->ext_ops = ops;
    return c->ext_jobs++;
}

DT_PRIVATE dt_status comm_xfers_renew(dt_comm *c, dt_work *w, xfers **xsp)
{
    xfers *old = *xsp, *xs = c->ctx->al.malloc_fn(sizeof *xs, c->ctx->al.user);
    if (!xs)
        return comm_work_fail(w, DT_ENOMEM, "%s: out of memory", comm_coll_name(w->kind));
    memset(xs, 0, sizeof *xs);
    xs->g = old->g;
    xs->gone = old->gone;
    xs->gone_base = old->gone_base;
    xs->gone_n = old->gone_n;
    xs->write_off = old->write_off;
    xs->write_off_arg = old->write_off_arg;
    xs->idle = old->idle;
    old->next_dead = c->graveyard;
    c->graveyard = old;
    *xsp = xs;
    return DT_OK;
}

DT_PRIVATE void comm_xfers_free_buried(dt_comm *c)
{
    while (c->graveyard) {
        xfers *x = c->graveyard;
        c->graveyard = x->next_dead;
        c->ctx->al.free_fn(x, c->ctx->al.user);
    }
}
