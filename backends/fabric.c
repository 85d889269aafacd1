/*
 * backends/fabric.c - the transport (backends/transport.h) on libfabric.
 *
 * One FI_EP_RDM endpoint per instance with tagged messaging and directed
 * receives (FI_TAGGED | FI_DIRECTED_RECV), an FI_AV_TABLE address vector
 * (peer i is fi_addr i, in insert_peers order) and one FI_CQ_FORMAT_TAGGED
 * completion queue for both directions.  Providers: "shm", "tcp" (libfabric
 * layers ofi_rxm over it) and "verbs" (verbs;ofi_rxm).  docs/TRANSPORT.md
 * has the measurements and the behaviour on peer death.
 *
 * How the pieces fit:
 *  - A dt_xfer's priv is the fi_context2 passed as the operation context, so
 *    a completion leads straight back to its dt_xfer.  Posted transfers are
 *    also kept in a small open-addressing table (xfer -> registration,
 *    length, deferred?), used to release registrations, to cancel everything
 *    on close and to make cancel() a no-op on transfers that are not posted.
 *  - Back-pressure never blocks the caller: a post that libfabric refuses
 *    with -FI_EAGAIN a few times in a row is queued (per peer, FIFO, so
 *    order between two ranks is kept) and retried inside poll() and wait();
 *    its parameters wait in its priv.  One still refused after
 *    dt_transport_params.post_timeout_ms (default DT_FABRIC_POST_TIMEOUT_MS)
 *    completes with DT_ETIMEDOUT.  (tcp;ofi_rxm
 *    refuses sends to a dead peer this way forever: see docs/TRANSPORT.md.)
 *  - Completions are read in poll(), wait() (fi_cq_sread consumes them) and
 *    while retrying a post.  All go through fab_progress(), which fills the
 *    result fields and appends the transfer to a FIFO of finished transfers
 *    (linked through priv[0]: the provider no longer owns it once it has
 *    reported the completion).  Only poll() hands transfers out, and it sets
 *    done = 1 as it does: done = 1 means "returned by poll; the transport
 *    will not touch it again".  close() sets done on everything it drops.
 *  - wait() spins on the CQ for DT_FABRIC_SPIN_US, then sleeps: in
 *    fi_cq_sread on the CQ's fd where the provider has one (tcp;ofi_rxm),
 *    else (shm) in short sleeps that grow with the time waited.
 *  - Memory registration only when the provider asks for it (FI_MR_LOCAL:
 *    verbs hardware; shm and tcp never do).  Registrations are cached by
 *    address range and reference-counted by the posted transfers using them;
 *    an unused entry is evicted, least recently used first, when the cache
 *    is full.  The environment variable DT_FABRIC_FORCE_MR=1 registers even
 *    where the provider does not need it (tests exercise the cache that way).
 *  - shm refuses receives with ignore bits (libfabric 1.17 matches them
 *    wrongly against early messages; see fab_post).
 *  - All our memory comes from the allocator in the params.  libfabric's own
 *    (fi_info, providers) comes from libc: it has no allocator hooks.
 *
 * Nothing here prints, aborts or changes the environment, with one exception
 * at load time: see "Signal handlers of libfabric's dependencies".
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE   /* dladdr */
#endif
#include "transport.h"

#include <dlfcn.h>
#include <errno.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>

/* ---------------------------------------------------------------------------
 * Signal handlers of libfabric's dependencies
 * ------------------------------------------------------------------------- */

/* Debian's libfabric links the PSM providers' libraries, and the
 * constructor of libinfinipath (and of libpsm2 in some builds) installs
 * handlers for SIGINT, SIGTERM, SIGSEGV, SIGBUS, SIGILL and SIGABRT in every
 * program that links libfabric, whether it uses PSM or not.  On SIGINT or
 * SIGTERM the handler calls exit(1) from inside the signal, so a launcher's
 * SIGTERM runs the exit handlers at whatever instruction the process was;
 * on a crash it writes a backtrace file into the working directory and calls
 * exit(1) again, which deadlocks when the crash happened during exit (a
 * rank that never dies, so its launcher never returns: CI saw exactly
 * that).  Dependencies' constructors run before ours, so here the default
 * action comes back for each of these signals whose handler lives in one of
 * those libraries.  Handlers anyone else installed, before or after, are
 * left alone.  (IPATH_NO_BACKTRACE=1 stops libinfinipath at the source;
 * dt_spawn sets it for the programs it starts.) */
static int handler_is_psm(const struct sigaction *sa)
{
    void *h = (sa->sa_flags & SA_SIGINFO) ? (void *)sa->sa_sigaction : (void *)sa->sa_handler;
    Dl_info di;
    if (sa->sa_handler == SIG_DFL || sa->sa_handler == SIG_IGN || !dladdr(h, &di) ||
        !di.dli_fname)
        return 0;
    return strstr(di.dli_fname, "libinfinipath") || strstr(di.dli_fname, "libpsm");
}

__attribute__((constructor)) static void fab_drop_psm_signal_handlers(void)
{
    static const int sigs[] = {SIGINT, SIGTERM, SIGSEGV, SIGBUS, SIGILL, SIGABRT};
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) {
        struct sigaction sa;
        if (sigaction(sigs[i], NULL, &sa) != 0 || !handler_is_psm(&sa))
            continue;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = SIG_DFL;
        sigemptyset(&sa.sa_mask);
        (void)sigaction(sigs[i], &sa, NULL);
    }
}

/* ---------------------------------------------------------------------------
 * Limits
 * ------------------------------------------------------------------------- */

/* Largest single message we hand the provider (its own limit may be lower;
 * tcp;ofi_rxm reports SIZE_MAX, shm 2^64-1).  The core chunks above it. */
#define DT_FABRIC_MAX_MESSAGE ((size_t)1 << 30)
/* A post refused with -FI_EAGAIN is retried this many times at once
 * (driving progress in between), then queued and retried by poll()/wait()
 * for up to DT_FABRIC_POST_TIMEOUT_MS, after which it completes with
 * DT_ETIMEDOUT.  A healthy peer drains a full queue in milliseconds; the
 * timeout fires only for a peer that stopped making progress or died. */
#define DT_FABRIC_POST_TRIES 16
#define DT_FABRIC_POST_TIMEOUT_MS 30000
/* How long close() drives progress to collect the cancelled transfers. */
#define DT_FABRIC_CLOSE_DRAIN_MS 200
/* Completions read per fi_cq_read call, and batches per progress call. */
#define DT_FABRIC_CQ_BATCH 32
#define DT_FABRIC_PROGRESS_BATCHES 8
/* Registration cache entries kept before evicting unused ones. */
#define DT_FABRIC_MR_CACHE 64
/* Completion queue and address vector sizes requested. */
#define DT_FABRIC_CQ_SIZE 1024
#define DT_FABRIC_AV_SIZE 1024
/* wait() polls without sleeping for this long first.  Measured (8-byte
 * round trips, 2-core VM): no spin 100 us on shm and tcp (a nanosleep costs
 * ~60 us with timer slack); 20-50 us spin: 2 us shm, 22 us tcp. */
#ifndef DT_FABRIC_SPIN_US
#ifndef DT_FABRIC_SPIN_US
#define DT_FABRIC_SPIN_US 50
#endif
#endif
/* wait() without a CQ wait object (shm): sleeps between progress calls
 * grow with the time waited, between these bounds.  On shm an idle 200 ms
 * wait then costs ~5 ms of CPU; a fixed 200 us sleep cost 17 ms. */
#define DT_FABRIC_NOWAIT_MIN_US 20
#define DT_FABRIC_NOWAIT_MAX_US 1000

_Static_assert(offsetof(dt_xfer, priv) == 0, "dt_xfer.priv must be first (it is the context)");
_Static_assert(sizeof(((dt_xfer *)0)->priv) >= sizeof(struct fi_context2),
               "dt_xfer.priv must hold a struct fi_context2");

/* ---------------------------------------------------------------------------
 * The instance
 * ------------------------------------------------------------------------- */

typedef struct fab_mr {       /* one registration cache entry */
    uintptr_t base;
    size_t len;
    struct fid_mr *mr;        /* NULL: free slot */
    void *desc;
    int refs;                 /* posted transfers using it */
    uint64_t used;            /* LRU stamp */
} fab_mr;

typedef struct fab_slot {     /* posted-transfer table entry */
    dt_xfer *x;               /* NULL: empty */
    int mr;                   /* index into mrs, or -1 */
    int deferred;             /* waiting in its peer's queue, not yet with libfabric */
    size_t len;               /* the buffer's length */
} fab_slot;

/* A post that met back-pressure waits in its peer's FIFO; its parameters
 * live in the dt_xfer's priv (not the provider's until it is posted). */
typedef struct fab_deferred {
    dt_xfer *next;            /* first: shares priv[0] with the finished list */
    void *buf;
    size_t len;
    uint64_t tag, ignore;
    double deadline;          /* ms, fab_now_ms() clock */
    int is_send;
} fab_deferred;

_Static_assert(sizeof(fab_deferred) <= sizeof(((dt_xfer *)0)->priv),
               "a deferred post's parameters must fit in dt_xfer.priv");

typedef struct fab_queue {
    dt_xfer *head, *tail;
} fab_queue;

struct dt_transport {
    dt_allocator a;
    int post_timeout_ms;       /* dt_transport_params.post_timeout_ms, or the default */
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_av *av;
    struct fid_cq *cq;
    struct fid_ep *ep;
    int cq_waitable;          /* the CQ has a wait object: wait() uses fi_cq_sread */
    int mr_needed;            /* FI_MR_LOCAL (or DT_FABRIC_FORCE_MR) */
    int exact_tags_only;      /* shm: receives with ignore bits refused (see fab_post) */
    size_t addr_len;          /* our own name's length */

    fi_addr_t *peers;         /* n_peers, after insert_peers */
    int n_peers;
    fab_queue *deferred;      /* n_peers FIFOs of posts waiting out -FI_EAGAIN */
    size_t n_deferred;

    fab_slot *posted;         /* open addressing, cap a power of two */
    size_t posted_cap, posted_n;

    fab_mr *mrs;
    int n_mrs, cap_mrs;
    uint64_t mr_clock, mr_key;

    dt_xfer *fin_head, *fin_tail;   /* finished, not yet returned by poll */
    size_t fin_n;

    char cq_msg[256];         /* the last error completion, for poll's err */
};

/* ---------------------------------------------------------------------------
 * Small helpers
 * ------------------------------------------------------------------------- */

static void fab_err(char *err, size_t len, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void fab_err(char *err, size_t len, const char *fmt, ...)
{
    if (!err || !len) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, len, fmt, ap);
    va_end(ap);
}

static void *fab_libc_malloc(size_t n, void *u) { (void)u; return malloc(n); }
static void *fab_libc_realloc(void *p, size_t n, void *u) { (void)u; return realloc(p, n); }
static void fab_libc_free(void *p, void *u) { (void)u; free(p); }

static void *fab_alloc(dt_transport *t, size_t n) { return t->a.malloc_fn(n, t->a.user); }
static void fab_free(dt_transport *t, void *p) { if (p) t->a.free_fn(p, t->a.user); }

static double fab_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static void fab_sleep_us(long us)
{
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

/* An error completion from libfabric -> dt_status. */
static dt_status fab_cq_status(int fi_err)
{
    switch (fi_err) {
    case FI_ETRUNC: return DT_EMISMATCH;
    case FI_ECANCELED: return DT_ESTATE;
    case FI_ECONNRESET: case FI_ECONNREFUSED: case FI_ECONNABORTED: case FI_ENOTCONN:
    case FI_EHOSTUNREACH: case FI_ENETUNREACH: case FI_ENETDOWN: case FI_ETIMEDOUT:
    case EPIPE: case FI_ESHUTDOWN: case FI_EHOSTDOWN: case FI_EADDRNOTAVAIL:
        return DT_EPEER;
    default: return DT_EIO;
    }
}

/* ---------------------------------------------------------------------------
 * Posted-transfer table: dt_xfer* -> registration index.  Linear probing,
 * backward-shift deletion, at most half full.
 * ------------------------------------------------------------------------- */

static size_t fab_hash(const dt_xfer *x, size_t cap)
{
    uint64_t h = (uint64_t)(uintptr_t)x;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return (size_t)h & (cap - 1);
}

static fab_slot *fab_posted_find(dt_transport *t, const dt_xfer *x)
{
    if (!t->posted_cap) return NULL;
    for (size_t i = fab_hash(x, t->posted_cap);; i = (i + 1) & (t->posted_cap - 1)) {
        if (t->posted[i].x == x) return &t->posted[i];
        if (!t->posted[i].x) return NULL;
    }
}

static fab_slot *fab_posted_put(dt_transport *t, const fab_slot *e)
{
    size_t i = fab_hash(e->x, t->posted_cap);
    while (t->posted[i].x) i = (i + 1) & (t->posted_cap - 1);
    t->posted[i] = *e;
    t->posted_n++;
    return &t->posted[i];
}

/* Room for one more entry (done before posting, so a completion never needs
 * to allocate). */
static dt_status fab_posted_reserve(dt_transport *t)
{
    if ((t->posted_n + 1) * 2 <= t->posted_cap) return DT_OK;
    size_t cap = t->posted_cap ? t->posted_cap * 2 : 64;
    fab_slot *old = t->posted;
    size_t old_cap = t->posted_cap;
    fab_slot *s = fab_alloc(t, cap * sizeof *s);
    if (!s) return DT_ENOMEM;
    memset(s, 0, cap * sizeof *s);
    t->posted = s;
    t->posted_cap = cap;
    t->posted_n = 0;
    for (size_t i = 0; i < old_cap; i++)
        if (old[i].x) fab_posted_put(t, &old[i]);
    fab_free(t, old);
    return DT_OK;
}

static void fab_posted_del(dt_transport *t, fab_slot *s)
{
    size_t mask = t->posted_cap - 1, i = (size_t)(s - t->posted), j = i;
    s->x = NULL;
    t->posted_n--;
    for (;;) {
        j = (j + 1) & mask;
        if (!t->posted[j].x) return;
        size_t h = fab_hash(t->posted[j].x, t->posted_cap);
        /* move j back to the hole at i unless its home lies in (i, j] */
        if ((j > i && (h <= i || h > j)) || (j < i && (h <= i && h > j))) {
            t->posted[i] = t->posted[j];
            t->posted[j].x = NULL;
            i = j;
        }
    }
}

/* ---------------------------------------------------------------------------
 * Registration cache (FI_MR_LOCAL providers only)
 * ------------------------------------------------------------------------- */

static void fab_mr_release(dt_transport *t, int i)
{
    if (i >= 0 && i < t->n_mrs && t->mrs[i].refs > 0) t->mrs[i].refs--;
}

/* A registration covering [buf, buf+len): its index, or -1 (message in err). */
static int fab_mr_get(dt_transport *t, const void *buf, size_t len, char *err, size_t err_len)
{
    uintptr_t b = (uintptr_t)buf;
    int slot = -1, victim = -1;
    for (int i = 0; i < t->n_mrs; i++) {
        fab_mr *m = &t->mrs[i];
        if (!m->mr) {
            if (slot < 0) slot = i;
            continue;
        }
        if (m->base <= b && b + len <= m->base + m->len) {
            m->refs++;
            m->used = ++t->mr_clock;
            return i;
        }
        if (m->refs == 0 && (victim < 0 || m->used < t->mrs[victim].used)) victim = i;
    }
    /* no free slot: append below the cache size, else evict the least
     * recently used idle entry, else (all busy) append, growing the array */
    if (slot < 0 && t->n_mrs < DT_FABRIC_MR_CACHE && t->n_mrs < t->cap_mrs) slot = t->n_mrs++;
    if (slot < 0 && victim >= 0) {
        fi_close(&t->mrs[victim].mr->fid);
        t->mrs[victim].mr = NULL;
        slot = victim;
    }
    if (slot < 0 && t->n_mrs < t->cap_mrs) slot = t->n_mrs++;
    if (slot < 0) {
        int cap = t->cap_mrs ? t->cap_mrs * 2 : DT_FABRIC_MR_CACHE;
        fab_mr *m = t->a.realloc_fn(t->mrs, (size_t)cap * sizeof *m, t->a.user);
        if (!m) {
            fab_err(err, err_len, "libfabric: out of memory growing the registration cache");
            return -1;
        }
        t->mrs = m;
        t->cap_mrs = cap;
        slot = t->n_mrs++;
    }
    fab_mr *m = &t->mrs[slot];
    memset(m, 0, sizeof *m);
    struct fid_mr *mr = NULL;
    int r = fi_mr_reg(t->domain, buf, len, FI_SEND | FI_RECV, 0, ++t->mr_key, 0, &mr, NULL);
    if (r == 0 && (t->info->domain_attr->mr_mode & FI_MR_ENDPOINT)) {
        r = fi_mr_bind(mr, &t->ep->fid, 0);
        if (r == 0) r = fi_mr_enable(mr);
    }
    if (r) {
        if (mr) fi_close(&mr->fid);
        fab_err(err, err_len, "libfabric: fi_mr_reg(%p, %zu bytes): %s", buf, len, fi_strerror(-r));
        return -1;
    }
    m->base = b;
    m->len = len;
    m->mr = mr;
    m->desc = fi_mr_desc(mr);
    m->refs = 1;
    m->used = ++t->mr_clock;
    return slot;
}

/* ---------------------------------------------------------------------------
 * Completions
 * ------------------------------------------------------------------------- */

/* A transfer finished (its result fields are written): forget it as posted
 * and queue it for poll(). */
static void fab_finish(dt_transport *t, dt_xfer *x)
{
    fab_slot *s = fab_posted_find(t, x);
    if (s) {
        fab_mr_release(t, s->mr);
        fab_posted_del(t, s);
    }
    x->priv[0] = NULL;
    if (t->fin_tail) t->fin_tail->priv[0] = x;
    else t->fin_head = x;
    t->fin_tail = x;
    t->fin_n++;
}

/* A receive's length, never more than its buffer (providers differ in what
 * they report for a truncated message: tcp;ofi_rxm gives the sent size). */
static size_t fab_recv_len(dt_transport *t, const dt_xfer *x, size_t len)
{
    const fab_slot *s = fab_posted_find(t, x);
    return s && len > s->len ? s->len : len;
}

static void fab_complete(dt_transport *t, const struct fi_cq_tagged_entry *e)
{
    dt_xfer *x = e->op_context;
    if (!x) return;
    if (e->flags & FI_RECV) {
        x->len = fab_recv_len(t, x, e->len);
        x->tag = e->tag;
    }
    x->status = DT_OK;
    fab_finish(t, x);
}

/* Read one error completion.  0: handled (or none there), -1: the CQ failed. */
static int fab_complete_error(dt_transport *t, char *err, size_t err_len)
{
    struct fi_cq_err_entry e;
    memset(&e, 0, sizeof e);
    ssize_t r = fi_cq_readerr(t->cq, &e, 0);
    if (r == -FI_EAGAIN) return 0;
    if (r < 0) {
        fab_err(err, err_len, "libfabric: fi_cq_readerr: %s", fi_strerror((int)-r));
        return -1;
    }
    dt_xfer *x = e.op_context;
    int code = e.err < 0 ? -e.err : e.err; /* shm 1.17 reports -FI_ETRUNC */
    char prov[128] = "";
    const char *ps = fi_cq_strerror(t->cq, e.prov_errno, e.err_data, prov, sizeof prov);
    if (ps && !strcmp(ps, fi_strerror(code))) ps = NULL; /* no news */
    int is_recv = (e.flags & FI_RECV) != 0;
    snprintf(t->cq_msg, sizeof t->cq_msg, "libfabric %s: %s peer %d failed: %s%s%s%s",
             t->info->fabric_attr->prov_name, is_recv ? "recv from" : "send to",
             x ? x->peer : -1, fi_strerror(code), ps && *ps ? " (" : "", ps ? ps : "",
             ps && *ps ? ")" : "");
    if (!x) return 0;
    if (is_recv) {
        x->len = fab_recv_len(t, x, e.len);
        x->tag = e.tag;
    }
    x->status = fab_cq_status(code);
    fab_finish(t, x);
    return 0;
}

/* One attempt to hand a transfer to libfabric. */
static ssize_t fab_post_once(dt_transport *t, dt_xfer *x, const fab_deferred *d, void *desc)
{
    fi_addr_t a = t->peers[x->peer];
    return d->is_send ? fi_tsend(t->ep, d->buf, d->len, desc, a, d->tag, x->priv)
                      : fi_trecv(t->ep, d->buf, d->len, desc, a, d->tag, d->ignore, x->priv);
}

static void fab_deferred_load(const dt_xfer *x, fab_deferred *d)
{
    memcpy(d, x->priv, sizeof *d);
}

/* Retry the deferred posts, oldest first per peer; one that stays refused
 * past its deadline, or fails outright, completes with an error. */
static void fab_flush_deferred(dt_transport *t)
{
    if (!t->n_deferred) return;
    double now = fab_now_ms();
    for (int p = 0; p < t->n_peers && t->n_deferred; p++) {
        fab_queue *q = &t->deferred[p];
        while (q->head) {
            dt_xfer *x = q->head;
            fab_deferred d;
            fab_deferred_load(x, &d);
            fab_slot *s = fab_posted_find(t, x);
            void *desc = s && s->mr >= 0 ? t->mrs[s->mr].desc : NULL;
            ssize_t r = now > d.deadline ? -FI_ETIMEDOUT : fab_post_once(t, x, &d, desc);
            if (r == -FI_EAGAIN) {
                memcpy(x->priv, &d, sizeof d); /* in case the provider touched it */
                break;
            }
            q->head = d.next;
            if (!q->head) q->tail = NULL;
            t->n_deferred--;
            if (r == 0) {
                if (s) s->deferred = 0;
                continue;
            }
            if (r == -FI_ETIMEDOUT) {
                x->status = DT_ETIMEDOUT;
                snprintf(t->cq_msg, sizeof t->cq_msg,
                         "libfabric %s: %s peer %d refused for %d ms (back-pressure, "
                         "-FI_EAGAIN); the peer is not making progress or is gone",
                         t->info->fabric_attr->prov_name, d.is_send ? "send to" : "recv from",
                         x->peer, t->post_timeout_ms);
            } else {
                x->status = r == -FI_ENOMEM ? DT_ENOMEM : DT_EIO;
                snprintf(t->cq_msg, sizeof t->cq_msg, "libfabric %s: fi_t%s peer %d: %s",
                         t->info->fabric_attr->prov_name, d.is_send ? "send" : "recv",
                         x->peer, fi_strerror((int)-r));
            }
            fab_finish(t, x);
        }
    }
}

/* Read what the CQ has (this is what moves data: progress is manual), then
 * retry deferred posts.  Returns the number of completions read, or -1
 * (message in err). */
static int fab_progress(dt_transport *t, char *err, size_t err_len)
{
    struct fi_cq_tagged_entry e[DT_FABRIC_CQ_BATCH];
    int total = 0;
    for (int b = 0; b < DT_FABRIC_PROGRESS_BATCHES; b++) {
        ssize_t n = fi_cq_read(t->cq, e, DT_FABRIC_CQ_BATCH);
        if (n == -FI_EAGAIN) break;
        if (n == -FI_EAVAIL) {
            if (fab_complete_error(t, err, err_len) < 0) return -1;
            total++;
            continue;
        }
        if (n < 0) {
            fab_err(err, err_len, "libfabric: fi_cq_read: %s", fi_strerror((int)-n));
            return -1;
        }
        for (ssize_t i = 0; i < n; i++) fab_complete(t, &e[i]);
        total += (int)n;
        if (n < DT_FABRIC_CQ_BATCH) break;
    }
    fab_flush_deferred(t);
    return total;
}

/* ---------------------------------------------------------------------------
 * Open / close
 * ------------------------------------------------------------------------- */

static void fab_close(dt_transport *t);

/* The IPv4 address of interface `name` into buf (for fi_getinfo's node). */
static int fab_iface_addr(const char *name, char *buf, size_t len)
{
    struct ifaddrs *ifs = NULL, *i;
    int found = -1;
    if (getifaddrs(&ifs) != 0) return -1;
    for (i = ifs; i; i = i->ifa_next) {
        if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || strcmp(i->ifa_name, name)) continue;
        const struct sockaddr_in *sa = (const struct sockaddr_in *)(const void *)i->ifa_addr;
        if (inet_ntop(AF_INET, &sa->sin_addr, buf, (socklen_t)len)) {
            found = 0;
            break;
        }
    }
    freeifaddrs(ifs);
    return found;
}

static dt_status fab_open(const dt_transport_params *p, dt_transport **out, char *err,
                          size_t err_len)
{
    if (out) *out = NULL;
    if (!p || !out || !p->provider) {
        fab_err(err, err_len, "libfabric: open needs params with a provider and an out pointer");
        return DT_EINVAL;
    }
    const char *prov;
    int is_tcp = 0, is_verbs = 0;
    if (!strcmp(p->provider, "shm")) {
        prov = "shm";
    } else if (!strcmp(p->provider, "tcp")) {
        prov = "tcp";
        is_tcp = 1;
    } else if (!strcmp(p->provider, "verbs")) {
        prov = "verbs;ofi_rxm";
        is_verbs = 1;
    } else {
        fab_err(err, err_len, "libfabric: unknown provider \"%s\" (expected shm, tcp or verbs)",
                p->provider);
        return DT_EINVAL;
    }

    /* tcp/verbs: bind the address given, or the interface's IPv4 address
     * (FI_TCP_IFACE would be process-wide, so the interface is resolved here). */
    char ifbuf[INET_ADDRSTRLEN];
    const char *node = NULL;
    if (is_tcp || is_verbs) {
        if (p->host && *p->host) {
            node = p->host;
        } else if (p->iface && *p->iface) {
            if (fab_iface_addr(p->iface, ifbuf, sizeof ifbuf)) {
                fab_err(err, err_len, "libfabric %s: interface \"%s\" has no IPv4 address",
                        p->provider, p->iface);
                return DT_EINVAL;
            }
            node = ifbuf;
        }
    }

    dt_allocator a = p->allocator;
    if (!a.malloc_fn || !a.realloc_fn || !a.free_fn) {
        a.malloc_fn = fab_libc_malloc;
        a.realloc_fn = fab_libc_realloc;
        a.free_fn = fab_libc_free;
        a.user = NULL;
    }
    dt_transport *t = a.malloc_fn(sizeof *t, a.user);
    if (!t) {
        fab_err(err, err_len, "libfabric: out of memory");
        return DT_ENOMEM;
    }
    memset(t, 0, sizeof *t);
    t->a = a;
    t->post_timeout_ms = p->post_timeout_ms > 0 ? p->post_timeout_ms : DT_FABRIC_POST_TIMEOUT_MS;

    dt_status st = DT_EIO;
    const char *what = "fi_allocinfo";
    int r = 0;
    struct fi_info *hints = fi_allocinfo();
    if (!hints) {
        st = DT_ENOMEM;
        fab_err(err, err_len, "libfabric: fi_allocinfo failed");
        goto fail;
    }
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_TAGGED | FI_DIRECTED_RECV;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED |
                                  FI_MR_PROV_KEY | FI_MR_ENDPOINT;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    /* Messages between two peers are matched in the order they were sent. */
    hints->tx_attr->msg_order = FI_ORDER_SAS;
    hints->rx_attr->msg_order = FI_ORDER_SAS;
    hints->fabric_attr->prov_name = strdup(prov); /* fi_freeinfo frees it */
    if (!hints->fabric_attr->prov_name) {
        st = DT_ENOMEM;
        fab_err(err, err_len, "libfabric: out of memory");
        goto fail;
    }
    r = fi_getinfo(FI_VERSION(1, 17), node, node ? "0" : NULL, node ? FI_SOURCE : 0, hints,
                   &t->info);
    if (r) {
        t->info = NULL;
        if (is_verbs) {
            st = DT_ENOTSUP;
            fab_err(err, err_len,
                    "libfabric verbs provider found no RDMA device (fi_getinfo: %s); "
                    "see docs/TRANSPORT.md", fi_strerror(-r));
        } else {
            /* no such provider in this libfabric, FI_PROVIDER excludes it,
             * or (tcp) it cannot use the address asked for */
            st = DT_ENOTSUP;
            fab_err(err, err_len, "libfabric %s provider unavailable%s%s (fi_getinfo: %s); "
                    "see docs/TRANSPORT.md", p->provider, node ? " for " : "",
                    node ? node : "", fi_strerror(-r));
        }
        goto fail;
    }
    t->mr_needed = (t->info->domain_attr->mr_mode & FI_MR_LOCAL) != 0;
    t->exact_tags_only = !strcmp(t->info->fabric_attr->prov_name, "shm");
    {
        const char *force = getenv("DT_FABRIC_FORCE_MR");
        if (force && *force == '1') t->mr_needed = 1;
    }

    what = "fi_fabric";
    if ((r = fi_fabric(t->info->fabric_attr, &t->fabric, NULL))) goto fail_fi;
    what = "fi_domain";
    if ((r = fi_domain(t->fabric, t->info, &t->domain, NULL))) goto fail_fi;

    /* A CQ that sleeps on an fd where the provider has one (tcp;ofi_rxm),
     * else none: wait() then polls and sleeps.  Not FI_WAIT_UNSPEC: shm
     * 1.17 gives FI_WAIT_YIELD for it, and its fi_cq_sread spins on
     * sched_yield and never returns on an idle CQ (timeout ignored). */
    {
        static const enum fi_wait_obj objs[] = {FI_WAIT_FD, FI_WAIT_NONE};
        r = -FI_ENOSYS;
        for (size_t i = 0; i < sizeof objs / sizeof objs[0] && r; i++) {
            struct fi_cq_attr cqa;
            memset(&cqa, 0, sizeof cqa);
            cqa.format = FI_CQ_FORMAT_TAGGED;
            cqa.size = DT_FABRIC_CQ_SIZE;
            cqa.wait_obj = objs[i];
            cqa.wait_cond = FI_CQ_COND_NONE;
            r = fi_cq_open(t->domain, &cqa, &t->cq, NULL);
            if (r == 0) t->cq_waitable = objs[i] != FI_WAIT_NONE;
            else t->cq = NULL;
        }
        what = "fi_cq_open";
        if (r) goto fail_fi;
    }
    {
        struct fi_av_attr ava;
        memset(&ava, 0, sizeof ava);
        ava.type = FI_AV_TABLE;
        ava.count = DT_FABRIC_AV_SIZE;
        what = "fi_av_open";
        r = fi_av_open(t->domain, &ava, &t->av, NULL);
        if (r) { /* shm caps its AV at 256 peers and refuses more */
            t->av = NULL;
            ava.count = 0;
            r = fi_av_open(t->domain, &ava, &t->av, NULL);
        }
        if (r) goto fail_fi;
    }
    what = "fi_endpoint";
    if ((r = fi_endpoint(t->domain, t->info, &t->ep, NULL))) goto fail_fi;
    what = "fi_ep_bind(av)";
    if ((r = fi_ep_bind(t->ep, &t->av->fid, 0))) goto fail_fi;
    what = "fi_ep_bind(cq)";
    if ((r = fi_ep_bind(t->ep, &t->cq->fid, FI_TRANSMIT | FI_RECV))) goto fail_fi;
    if (t->exact_tags_only) {
        /* shm names its region "<pid>:<domain>:<endpoint>" by default, and a
         * process killed before closing leaves that name in /dev/shm; a
         * later process given the same pid then fails fi_enable with EBUSY.
         * A name with the time and this transport's address cannot collide. */
        char name[96];
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        snprintf(name, sizeof name, "dtrain_%d_%lx_%lx%09ld", (int)getpid(), (unsigned long)(uintptr_t)t,
                 (unsigned long)ts.tv_sec, ts.tv_nsec);
        what = "fi_setname";
        if ((r = fi_setname(&t->ep->fid, name, strlen(name) + 1))) goto fail_fi;
    }
    what = "fi_enable";
    if ((r = fi_enable(t->ep))) goto fail_fi;
    {
        char name[256];
        size_t len = sizeof name;
        what = "fi_getname";
        if ((r = fi_getname(&t->ep->fid, name, &len))) goto fail_fi;
        t->addr_len = len;
    }
    fi_freeinfo(hints);
    *out = t;
    return DT_OK;

fail_fi:
    st = r == -FI_ENOMEM ? DT_ENOMEM : (r == -FI_EADDRNOTAVAIL && node) ? DT_EINVAL : DT_EIO;
    fab_err(err, err_len, "libfabric %s: %s: %s%s%s", p->provider, what, fi_strerror(-r),
            node ? " binding " : "", node ? node : "");
fail:
    if (hints) fi_freeinfo(hints);
    fab_close(t);
    return st;
}

static void fab_close(dt_transport *t)
{
    if (!t) return;
    /* Deferred posts are dropped (never handed to libfabric); what is
     * posted is cancelled and the cancellations collected for a moment;
     * whatever is left (tcp;ofi_rxm cannot cancel sends) dies with the
     * endpoint.  Every transfer still known ends done with DT_ESTATE. */
    for (int p = 0; p < t->n_peers; p++) t->deferred[p].head = t->deferred[p].tail = NULL;
    t->n_deferred = 0;
    size_t live = 0;
    for (size_t i = 0; i < t->posted_cap; i++)
        if (t->posted[i].x && !t->posted[i].deferred) {
            fi_cancel(&t->ep->fid, t->posted[i].x->priv);
            live++;
        }
    double end = fab_now_ms() + DT_FABRIC_CLOSE_DRAIN_MS;
    while (live && fab_now_ms() < end) {
        if (fab_progress(t, NULL, 0) < 0) break;
        live = 0;
        for (size_t i = 0; i < t->posted_cap; i++)
            live += t->posted[i].x && !t->posted[i].deferred;
        if (live) fab_sleep_us(100);
    }
    for (size_t i = 0; i < t->posted_cap; i++) {
        dt_xfer *x = t->posted[i].x;
        if (x) {
            x->status = DT_ESTATE;
            x->done = 1;
        }
    }
    while (t->fin_head) {
        dt_xfer *x = t->fin_head;
        t->fin_head = x->priv[0];
        x->priv[0] = NULL;
        x->done = 1;
    }
    if (t->ep) fi_close(&t->ep->fid);
    for (int i = 0; i < t->n_mrs; i++)
        if (t->mrs[i].mr) fi_close(&t->mrs[i].mr->fid);
    if (t->av) fi_close(&t->av->fid);
    if (t->cq) fi_close(&t->cq->fid);
    if (t->domain) fi_close(&t->domain->fid);
    if (t->fabric) fi_close(&t->fabric->fid);
    if (t->info) fi_freeinfo(t->info);
    fab_free(t, t->mrs);
    fab_free(t, t->posted);
    fab_free(t, t->peers);
    fab_free(t, t->deferred);
    fab_free(t, t);
}

static const char *fab_provider(const dt_transport *t)
{
    return t ? t->info->fabric_attr->prov_name : "";
}

static size_t fab_max_message(const dt_transport *t)
{
    if (!t) return 0;
    size_t m = t->info->ep_attr->max_msg_size;
    return m < DT_FABRIC_MAX_MESSAGE ? m : DT_FABRIC_MAX_MESSAGE;
}

/* ---------------------------------------------------------------------------
 * Addresses
 * ------------------------------------------------------------------------- */

static dt_status fab_get_addr(dt_transport *t, void *buf, size_t *len, char *err, size_t err_len)
{
    if (!t || !buf || !len) {
        fab_err(err, err_len, "libfabric: get_addr needs a transport, a buffer and a length");
        return DT_EINVAL;
    }
    size_t room = *len;
    int r = fi_getname(&t->ep->fid, buf, len);
    if (r == -FI_ETOOSMALL) {
        fab_err(err, err_len, "libfabric: address needs %zu bytes, buffer has %zu", *len, room);
        return DT_EINVAL;
    }
    if (r) {
        fab_err(err, err_len, "libfabric: fi_getname: %s", fi_strerror(-r));
        return DT_EIO;
    }
    return DT_OK;
}

/* A blob is a usable address of this provider: string formats terminated,
 * binary ones the length of ours (libfabric trusts what it is given). */
static int fab_addr_ok(const dt_transport *t, const void *addr, size_t len)
{
    if (!addr || len == 0)
        return 0;
    return t->info->addr_format == FI_ADDR_STR ? memchr(addr, 0, len) != NULL : len == t->addr_len;
}

/* Peers t->n_peers.. become addrs[0..n) (checked by the caller); the
 * tables are copied into larger ones (queued posts point at their dt_xfers,
 * not into the tables, so they may move). */
static dt_status fab_append_peers(dt_transport *t, int n, const void *const *addrs, char *err,
                                  size_t err_len)
{
    int old = t->n_peers, all = old + n;
    fi_addr_t *fa = fab_alloc(t, (size_t)all * sizeof *fa);
    fab_queue *dq = fab_alloc(t, (size_t)all * sizeof *dq);
    if (!fa || !dq) {
        fab_free(t, fa);
        fab_free(t, dq);
        fab_err(err, err_len, "libfabric: out of memory");
        return DT_ENOMEM;
    }
    memset(dq, 0, (size_t)all * sizeof *dq);
    for (int i = 0; i < n; i++) {
        int r = fi_av_insert(t->av, addrs[i], 1, &fa[old + i], 0, NULL);
        if (r != 1) {
            if (i) fi_av_remove(t->av, fa + old, (size_t)i, 0);
            fab_free(t, fa);
            fab_free(t, dq);
            fab_err(err, err_len, "libfabric: fi_av_insert(peer %d): %s", old + i,
                    r < 0 ? fi_strerror(-r) : "address rejected");
            return DT_EINVAL;
        }
    }
    if (old) {
        memcpy(fa, t->peers, (size_t)old * sizeof *fa);
        memcpy(dq, t->deferred, (size_t)old * sizeof *dq);
    }
    fab_free(t, t->peers);
    fab_free(t, t->deferred);
    t->peers = fa;
    t->deferred = dq;
    t->n_peers = all;
    return DT_OK;
}

static dt_status fab_insert_peers(dt_transport *t, int n, const void *const *addrs,
                                  const size_t *lens, char *err, size_t err_len)
{
    if (!t || n <= 0 || !addrs || !lens) {
        fab_err(err, err_len, "libfabric: insert_peers needs n > 0 addresses and lengths");
        return DT_EINVAL;
    }
    if (t->peers) {
        fab_err(err, err_len, "libfabric: insert_peers called twice");
        return DT_ESTATE;
    }
    /* Check every blob before handing it to libfabric, which trusts them:
     * string formats must be terminated, binary ones the length of ours. */
    for (int i = 0; i < n; i++) {
        if (!fab_addr_ok(t, addrs[i], lens[i])) {
            fab_err(err, err_len, "libfabric: peer %d's address (%zu bytes) is not a %s address",
                    i, lens[i], t->info->fabric_attr->prov_name);
            return DT_EINVAL;
        }
    }
    return fab_append_peers(t, n, addrs, err, err_len);
}

static void fab_cancel(dt_transport *t, dt_xfer *x);

/* The old entry stays in the AV: libfabric may still hold a send to it
 * (shm and tcp cannot cancel sends), and removing the address under it is
 * not safe; one stale entry per restart is cheap. */
static dt_status fab_replace_peer(dt_transport *t, int peer, const void *addr, size_t len,
                                  char *err, size_t err_len)
{
    if (!t || !t->peers || peer < 0 || peer >= t->n_peers || !fab_addr_ok(t, addr, len)) {
        fab_err(err, err_len, "libfabric: replace_peer(%d): no such peer, or not a %s address",
                peer, t && t->info ? t->info->fabric_attr->prov_name : "?");
        return DT_EINVAL;
    }
    /* posts for the old process that never went out (each cancel unlinks one) */
    for (size_t left = t->n_deferred; t->deferred[peer].head && left > 0; left--)
        fab_cancel(t, t->deferred[peer].head);
    fi_addr_t fa;
    int r = fi_av_insert(t->av, addr, 1, &fa, 0, NULL);
    if (r != 1) {
        fab_err(err, err_len, "libfabric: fi_av_insert(peer %d's new address): %s", peer,
                r < 0 ? fi_strerror(-r) : "address rejected");
        return DT_EINVAL;
    }
    t->peers[peer] = fa;
    return DT_OK;
}

/* One more peer (interface version 2). */
static dt_status fab_add_peer(dt_transport *t, const void *addr, size_t len, int *peer,
                              char *err, size_t err_len)
{
    if (!t || !t->peers || !peer || !fab_addr_ok(t, addr, len)) {
        fab_err(err, err_len, "libfabric: add_peer: no peers inserted yet, or not a %s address",
                t && t->info ? t->info->fabric_attr->prov_name : "?");
        return DT_EINVAL;
    }
    const void *addrs[1] = {addr};
    *peer = t->n_peers;
    return fab_append_peers(t, 1, addrs, err, err_len);
}

/* ---------------------------------------------------------------------------
 * Transfers
 * ------------------------------------------------------------------------- */

/* Post now if libfabric takes it within a few tries (driving progress in
 * between); otherwise queue it behind its peer's earlier deferred posts, so
 * a peer that stopped reading (or died: tcp;ofi_rxm then refuses sends to it
 * with -FI_EAGAIN for as long as it keeps failing to reconnect) never blocks
 * the caller.  Queued posts are retried by every poll() and wait(). */
static dt_status fab_post(dt_transport *t, int is_send, int peer, uint64_t tag, uint64_t ignore,
                          void *buf, size_t len, dt_xfer *x, char *err, size_t err_len)
{
    const char *op = is_send ? "send" : "recv";
    if (!t || !x || (!buf && len)) {
        fab_err(err, err_len, "libfabric: %s needs a transport, an xfer and a buffer", op);
        return DT_EINVAL;
    }
    if (!t->peers) {
        fab_err(err, err_len, "libfabric: %s before insert_peers", op);
        return DT_ESTATE;
    }
    if (peer < 0 || peer >= t->n_peers) {
        fab_err(err, err_len, "libfabric: %s: peer %d out of range (0..%d)", op, peer,
                t->n_peers - 1);
        return DT_EINVAL;
    }
    if (len > fab_max_message(t)) {
        fab_err(err, err_len, "libfabric: %s of %zu bytes exceeds max_message %zu", op, len,
                fab_max_message(t));
        return DT_EINVAL;
    }
    /* shm 1.17 matches a receive against messages that arrived before it
     * was posted with smr_match_tagged(), which applies the *message's*
     * ignore field (stale, from whichever receive last used that entry)
     * instead of the receive's: a receive with ignore bits never matches an
     * early message (it hangs), and once one has been posted, later exact
     * receives can match wrong tags.  Refused, so neither can happen. */
    if (ignore && t->exact_tags_only) {
        fab_err(err, err_len, "libfabric %s: recv with ignore bits (%#llx) is not supported: "
                "shm matches messages that arrive before the receive without the mask; "
                "post exact tags (see docs/TRANSPORT.md)", t->info->fabric_attr->prov_name,
                (unsigned long long)ignore);
        return DT_ENOTSUP;
    }
    if (fab_posted_find(t, x)) {
        fab_err(err, err_len, "libfabric: %s: this xfer is already posted", op);
        return DT_ESTATE;
    }
    if (fab_posted_reserve(t) != DT_OK) {
        fab_err(err, err_len, "libfabric: out of memory");
        return DT_ENOMEM;
    }
    fab_slot slot = {x, -1, 0, len};
    void *desc = NULL;
    if (t->mr_needed && len) {
        slot.mr = fab_mr_get(t, buf, len, err, err_len);
        if (slot.mr < 0) return DT_EIO;
        desc = t->mrs[slot.mr].desc;
    }
    x->done = 0;
    x->status = DT_OK;
    x->len = is_send ? len : 0;
    x->tag = tag;
    x->peer = peer;
    fab_deferred d = {NULL, buf, len, tag, ignore, 0, is_send};
    fab_queue *q = &t->deferred[peer];
    for (int tries = 0; !q->head && tries < DT_FABRIC_POST_TRIES; tries++) {
        ssize_t r = fab_post_once(t, x, &d, desc);
        if (r == 0) {
            fab_posted_put(t, &slot);
            return DT_OK;
        }
        if (r != -FI_EAGAIN) {
            fab_err(err, err_len, "libfabric %s: fi_t%s peer %d (%zu bytes): %s",
                    t->info->fabric_attr->prov_name, op, peer, len, fi_strerror((int)-r));
            fab_mr_release(t, slot.mr);
            return r == -FI_ENOMEM ? DT_ENOMEM : DT_EIO;
        }
        if (fab_progress(t, err, err_len) < 0) {
            fab_mr_release(t, slot.mr);
            return DT_EIO;
        }
    }
    d.deadline = fab_now_ms() + t->post_timeout_ms;
    memcpy(x->priv, &d, sizeof d);
    if (q->tail) q->tail->priv[0] = x;
    else q->head = x;
    q->tail = x;
    t->n_deferred++;
    slot.deferred = 1;
    fab_posted_put(t, &slot);
    return DT_OK;
}

static dt_status fab_send(dt_transport *t, int peer, uint64_t tag, const void *buf, size_t len,
                          dt_xfer *x, char *err, size_t err_len)
{
    return fab_post(t, 1, peer, tag, 0, (void *)(uintptr_t)buf, len, x, err, err_len);
}

static dt_status fab_recv(dt_transport *t, int peer, uint64_t tag, uint64_t ignore, void *buf,
                          size_t len, dt_xfer *x, char *err, size_t err_len)
{
    return fab_post(t, 0, peer, tag, ignore, buf, len, x, err, err_len);
}

static int fab_poll(dt_transport *t, dt_xfer **done, int max, char *err, size_t err_len)
{
    if (!t || (!done && max > 0)) {
        fab_err(err, err_len, "libfabric: poll needs a transport and an output array");
        return -1;
    }
    if (max <= 0) return 0;
    if (t->fin_n < (size_t)max && fab_progress(t, err, err_len) < 0) return -1;
    int n = 0, failed = 0;
    while (n < max && t->fin_head) {
        dt_xfer *x = t->fin_head;
        t->fin_head = x->priv[0];
        if (!t->fin_head) t->fin_tail = NULL;
        t->fin_n--;
        x->priv[0] = NULL;
        x->done = 1;
        if (x->status != DT_OK) failed = 1;
        done[n++] = x;
    }
    /* Not a failure of poll: the last error completion's text, for a
     * caller that wants to say why a transfer failed. */
    if (failed) fab_err(err, err_len, "%s", t->cq_msg);
    return n;
}

static dt_status fab_wait(dt_transport *t, int timeout_ms)
{
    if (!t) return DT_EINVAL;
    if (t->fin_n) return DT_OK;
    if (timeout_ms < 0) timeout_ms = 0;
    double start = fab_now_ms(), deadline = start + timeout_ms;
    /* Spin briefly first: an answer that is microseconds away is not
     * worth a sleep (a nanosleep costs ~60 us here, timer slack included). */
    double spin_end = start + DT_FABRIC_SPIN_US / 1e3;
    if (spin_end > deadline) spin_end = deadline;
    do {
        if (fab_progress(t, NULL, 0) < 0) return DT_EIO;
        if (t->fin_n) return DT_OK;
    } while (fab_now_ms() < spin_end);
    /* Sleep in the provider while nothing of ours is queued: a queued post
     * may become possible without any completion to wake us. */
    while (t->cq_waitable && !t->n_deferred) {
        double rem = deadline - fab_now_ms();
        if (rem < 1) break; /* the last check below */
        struct fi_cq_tagged_entry e[DT_FABRIC_CQ_BATCH];
        ssize_t n = fi_cq_sread(t->cq, e, DT_FABRIC_CQ_BATCH, NULL, (int)rem);
        if (n > 0) {
            for (ssize_t i = 0; i < n; i++) fab_complete(t, &e[i]);
            return DT_OK;
        }
        if (n == -FI_EAVAIL) {
            if (fab_complete_error(t, NULL, 0) < 0) return DT_EIO;
            return DT_OK;
        }
        if (n == -FI_EAGAIN || n == -FI_ETIMEDOUT || n == -FI_EINTR) continue;
        t->cq_waitable = 0; /* the wait object failed: poll and sleep from now on */
    }
    /* No wait object (shm) or posts queued: poll, then sleep a quarter of
     * the time we have been idle (20 us .. 1 ms), so a quick answer is seen
     * quickly and a long idle wait costs a few hundred cheap polls a second.
     * Idle time counts from the last progress call that did real work: shm
     * copies data inside progress, and counting that copy as waiting made
     * us sleep 1 ms right before the peer's completion (5 of 24 ms of a
     * 64 MiB allreduce, measured by tests/bench/allreduce.sh's profile). */
    double idle_since = fab_now_ms();
    for (;;) {
        double t0 = fab_now_ms();
        int n = fab_progress(t, NULL, 0);
        if (n < 0) return DT_EIO;
        if (t->fin_n) return DT_OK;
        double now = fab_now_ms(), rem = deadline - now;
        if (n > 0 || now - t0 > DT_FABRIC_NOWAIT_MIN_US / 1e3) idle_since = now;
        if (rem <= 0) return DT_ETIMEDOUT;
        double us = (now - idle_since) * 1000 / 4;
        if (us < DT_FABRIC_NOWAIT_MIN_US) us = DT_FABRIC_NOWAIT_MIN_US;
        if (us > DT_FABRIC_NOWAIT_MAX_US) us = DT_FABRIC_NOWAIT_MAX_US;
        if (us > rem * 1000) us = rem * 1000;
        fab_sleep_us((long)us);
    }
}

static void fab_cancel(dt_transport *t, dt_xfer *x)
{
    fab_slot *s = t && x ? fab_posted_find(t, x) : NULL;
    if (!s) return; /* not posted, or already finished */
    if (s->deferred) { /* still ours: unlink it from its peer's queue */
        fab_queue *q = &t->deferred[x->peer];
        dt_xfer *prev = NULL, *cur = q->head;
        while (cur && cur != x) {
            prev = cur;
            cur = cur->priv[0];
        }
        if (cur) {
            if (prev) prev->priv[0] = x->priv[0];
            else q->head = x->priv[0];
            if (q->tail == x) q->tail = prev;
            t->n_deferred--;
        }
        x->status = DT_ESTATE;
        fab_finish(t, x);
        return;
    }
    fi_cancel(&t->ep->fid, x->priv);
    fab_progress(t, NULL, 0); /* usually collects the cancellation right away */
}

/* ---------------------------------------------------------------------------
 * The table
 * ------------------------------------------------------------------------- */

const dt_transport_iface *dt_transport_fabric_iface(void)
{
    static const dt_transport_iface iface = {
        .version = DT_TRANSPORT_IFACE_VERSION,
        .name = "libfabric",
        .open = fab_open,
        .close = fab_close,
        .provider = fab_provider,
        .get_addr = fab_get_addr,
        .insert_peers = fab_insert_peers,
        .max_message = fab_max_message,
        .send = fab_send,
        .recv = fab_recv,
        .poll = fab_poll,
        .wait = fab_wait,
        .cancel = fab_cancel,
        .replace_peer = fab_replace_peer,
        .add_peer = fab_add_peer,
    };
    return &iface;
}
