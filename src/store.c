#include "dist.h"

/* ===========================================================================
 * Processes: launcher environment and the rendezvous store
 *
 * Rank, world size and the master address come from whichever launcher
 * started us (dtrain's own, torchrun, mpirun, srun).  Rank 0 then serves a
 * tiny key-value store over TCP on its own thread; every rank (0 included)
 * connects, presents the job token, and swaps addresses through it.
 *
 * Wire format: frames of u32 little-endian length + payload; payload byte 0
 * is the operation.  HELLO (version, rank, token), SET (key, value), GET
 * (key, timeout), ADD (key, i64: the key's 8-byte counter plus it, answered
 * with the sum; work stealing's claims), TIME (answered with the server's
 * clock: the profiler's offsets, 20).  The server answers every request with one frame; a GET
 * for a missing key is parked until the key is set or its deadline passes.
 * A client that sends anything malformed, or anything before a good HELLO,
 * is answered with an error and disconnected; the server keeps serving the
 * others.
 * ======================================================================== */

/* The store's own types: the rest of the core sees a store_server only by pointer. */

typedef struct launcher_vars {
    const char *name, *rank, *world, *local_rank, *local_world;
} launcher_vars;

/* --- the store's server (rank 0, its own thread) ------------------------- */

typedef struct kv_entry {
    char *key;
    unsigned char *val;
    uint32_t len;
} kv_entry;

typedef struct store_client {
    int fd;
    int hello;                 /* 1 once the token was accepted */
    int rank;                  /* from the hello */
    int bye;                   /* left cleanly: its close is not a death */
    uint32_t inc;              /* its process's incarnation (0: the first; see find_rejoin) */
    unsigned char *buf;        /* partial incoming frame */
    size_t have, cap;
    unsigned char *out;        /* replies the socket has not taken yet */
    size_t out_off, out_len, out_cap;
    char wait_key[DT_STORE_MAX_KEY + 1];   /* parked GET */
    double wait_deadline;
    int waiting;
} store_client;

struct store_server {
    dt_allocator al;
    int listen_fd, port, world;
    int stop_pipe[2];
    char token[DT_STORE_MAX_TOKEN + 1];
    size_t token_len;
    kv_entry *kv;
    int nkv, cap_kv;
    store_client *cl;
    int ncl, cap_cl;
    double drain_until;        /* stopping: serve until the others leave or then */
    pthread_t thread;
};

#define DT_STORE_MAGIC 0x4454u          /* "DT" */
#define DT_STORE_VERSION 1
#define DT_STORE_MAX_FRAME (DT_STORE_MAX_VALUE + DT_STORE_MAX_KEY + 64)
#define DT_STORE_MAX_CLIENTS 4096
#define DT_STORE_MAX_QUEUED ((size_t)8 << 20)   /* unsent replies before a client is dropped */
#define DT_DEFAULT_MASTER_PORT 29500
#define DT_STORE_DEFAULT_TIMEOUT_MS 30000

/* The key a dead rank's process is recorded under: "dead/<rank>" for the
 * first, "dead/<rank>.<n>" for the n-th restart (src/join.c), so a restarted
 * rank is not taken for dead by its predecessor's record. */
DT_PRIVATE void store_dead_key(char *key, size_t cap, int rank, uint32_t inc)
{
    if (inc)
        snprintf(key, cap, "dead/%d.%u", rank, inc);
    else
        snprintf(key, cap, "dead/%d", rank);
}

/* --- the launcher's environment ---------------------------------- */

static int env_int(dt_ctx *ctx, const char *name, int lo, int hi, int *out, dt_status *st)
{
    const char *v = getenv(name);
    if (!v)
        return 0;
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (!*v || *end || errno || x < lo || x > hi) {
        *st = set_error(ctx, DT_EINVAL, "dist_env: %s='%s' is not an integer in [%d, %d]", name, v,
                        lo, hi);
        return 0;
    }
    *out = (int)x;
    return 1;
}

/* "host:port" (the last colon splits, so "[::1]:p" style is not supported) */
static dt_status parse_master(dt_ctx *ctx, const char *var, const char *v, dt_dist_env *e)
{
    const char *colon = strrchr(v, ':');
    char *end;
    long port = colon ? strtol(colon + 1, &end, 10) : -1;
    if (!colon || colon == v || (size_t)(colon - v) >= sizeof e->master_addr || !colon[1] ||
        *end || port < 1 || port > 65535)
        return set_error(ctx, DT_EINVAL, "dist_env: %s='%s' must be host:port", var, v);
    snprintf(e->master_addr, sizeof e->master_addr, "%.*s", (int)(colon - v), v);
    e->master_port = (int)port;
    return DT_OK;
}

/* MASTER_ADDR / MASTER_PORT, or DTRAIN_MASTER, or the defaults */
static dt_status detect_master(dt_ctx *ctx, dt_dist_env *e)
{
    dt_status st = DT_OK;
    const char *dm = getenv("DTRAIN_MASTER");
    if (dm)
        return parse_master(ctx, "DTRAIN_MASTER", dm, e);
    const char *addr = getenv("MASTER_ADDR");
    if (addr) {
        if (!*addr || strlen(addr) >= sizeof e->master_addr)
            return set_error(ctx, DT_EINVAL, "dist_env: MASTER_ADDR is empty or too long");
        snprintf(e->master_addr, sizeof e->master_addr, "%s", addr);
    }
    env_int(ctx, "MASTER_PORT", 1, 65535, &e->master_port, &st);
    return st;
}

static const launcher_vars launchers[] = {
    {"dtrain", "DTRAIN_RANK", "DTRAIN_WORLD_SIZE", "DTRAIN_LOCAL_RANK", "DTRAIN_LOCAL_WORLD_SIZE"},
    {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
    {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
};

dt_status dt_dist_env_detect(dt_ctx *ctx, dt_dist_env *e)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (!e)
        return set_error(ctx, DT_EINVAL, "dist_env: output is NULL");
    memset(e, 0, sizeof *e);
    e->world_size = 1;
    e->local_rank = e->local_world_size = -1;
    e->launcher = "none";
    snprintf(e->master_addr, sizeof e->master_addr, "127.0.0.1");
    e->master_port = DT_DEFAULT_MASTER_PORT;
    dt_status st = DT_OK;
    for (size_t i = 0; i < sizeof launchers / sizeof launchers[0]; i++) {
        const launcher_vars *l = &launchers[i];
        int have_rank = env_int(ctx, l->rank, 0, INT_MAX - 1, &e->rank, &st);
        int have_world = st == DT_OK && env_int(ctx, l->world, 1, INT_MAX, &e->world_size, &st);
        if (st != DT_OK)
            return st;
        if (!have_rank && !have_world)
            continue;
        if (!have_rank || !have_world)
            return set_error(ctx, DT_EINVAL, "dist_env: %s is set but %s is not", 
                             have_rank ? l->rank : l->world, have_rank ? l->world : l->rank);
        if (e->rank >= e->world_size)
            return set_error(ctx, DT_EINVAL, "dist_env: %s=%d is not below %s=%d", l->rank,
                             e->rank, l->world, e->world_size);
        env_int(ctx, l->local_rank, 0, INT_MAX - 1, &e->local_rank, &st);
        if (st == DT_OK && strcmp(l->name, "slurm") != 0)   /* Slurm's may be "2(x3)" */
            env_int(ctx, l->local_world, 1, INT_MAX, &e->local_world_size, &st);
        if (st != DT_OK)
            return st;
        e->launcher = l->name;
        break;
    }
    return detect_master(ctx, e);
}

/* --- framing over blocking sockets with deadlines ------------------- */

DT_PRIVATE int store_ms_left(double deadline)
{
    double left = (deadline - dt_now()) * 1000.0;
    return left <= 0 ? 0 : left > INT_MAX ? INT_MAX : (int)left;
}

/* Move exactly n bytes, or fail at the deadline (-2) / on a closed socket
 * (-1); *moved: how many did move. */
static int sock_io(int fd, void *buf, size_t n, int writing, double deadline, size_t *moved)
{
    char *p = buf;
    size_t dummy;
    if (!moved)
        moved = &dummy;
    *moved = 0;
    while (n > 0) {
        struct pollfd pf = {fd, (short)(writing ? POLLOUT : POLLIN), 0};
        int r = poll(&pf, 1, store_ms_left(deadline));
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return r == 0 ? -2 : -1;   /* -2: timed out */
        ssize_t k = writing ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
        if (k < 0 && (errno == EINTR || errno == EAGAIN))
            continue;
        if (k <= 0)
            return -1;
        p += k;
        n -= (size_t)k;
        *moved += (size_t)k;
    }
    return 0;
}

static void put_u16(unsigned char *p, uint32_t v) { p[0] = (unsigned char)v; p[1] = (unsigned char)(v >> 8); }
static void put_u32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}
static uint32_t get_u16(const unsigned char *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8; }
static uint32_t get_u32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void *sv_alloc(store_server *sv, size_t n) { return sv->al.malloc_fn(n ? n : 1, sv->al.user); }
static void sv_free(store_server *sv, void *p) { if (p) sv->al.free_fn(p, sv->al.user); }

static int token_equal(const char *a, size_t alen, const char *b, size_t blen)
{
    /* constant time in the token's length: no early exit on a mismatch */
    unsigned diff = alen != blen;
    for (size_t i = 0; i < alen && i < blen; i++)
        diff |= (unsigned char)a[i] ^ (unsigned char)b[i];
    return diff == 0;
}

static kv_entry *kv_find(store_server *sv, const char *key)
{
    for (int i = 0; i < sv->nkv; i++)
        if (strcmp(sv->kv[i].key, key) == 0)
            return &sv->kv[i];
    return NULL;
}

/* Send what the client's socket takes now, without blocking; the server
 * loop polls for room for the rest.  -1: the connection failed. */
static int sv_flush(store_client *c)
{
    while (c->out_off < c->out_len) {
        ssize_t k = send(c->fd, c->out + c->out_off, c->out_len - c->out_off,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return 0;
        if (k <= 0)
            return -1;
        c->out_off += (size_t)k;
    }
    c->out_off = c->out_len = 0;
    return 0;
}

/* Queue one reply frame (op | status byte | u32 len | bytes) and send what
 * fits.  Replies never block the server: a client that stops reading only
 * grows its own queue, and is dropped past DT_STORE_MAX_QUEUED, so the
 * other ranks' requests (and the failure detector) keep being served. */
static int sv_reply(store_server *sv, store_client *c, int op, int ok, const void *data, uint32_t len)
{
    size_t pending = c->out_len - c->out_off;
    if (pending + 10 + len > DT_STORE_MAX_QUEUED)
        return -1;
    if (c->out_off) {
        memmove(c->out, c->out + c->out_off, pending);
        c->out_off = 0;
        c->out_len = pending;
    }
    if (c->out_cap < pending + 10 + len) {
        size_t cap = pending + 10 + len + 4096;
        unsigned char *p = sv->al.realloc_fn(c->out, cap, sv->al.user);
        if (!p)
            return -1;
        c->out = p;
        c->out_cap = cap;
    }
    unsigned char *h = c->out + c->out_len;
    put_u32(h, 6 + len);
    h[4] = (unsigned char)(OP_REPLY | op);
    h[5] = (unsigned char)ok;
    put_u32(h + 6, len);
    if (len)
        memcpy(h + 10, data, len);
    c->out_len += 10 + (size_t)len;
    return sv_flush(c);
}

static int sv_error(store_server *sv, store_client *c, int op, const char *msg)
{
    sv_reply(sv, c, op, 0, msg, (uint32_t)strlen(msg));
    return -1;   /* the caller drops the client (the message is small: it fits the socket) */
}

static int kv_set(store_server *sv, const char *key, const unsigned char *val, uint32_t len)
{
    unsigned char *copy = sv_alloc(sv, len);
    if (!copy)
        return -1;
    memcpy(copy, val, len);
    kv_entry *e = kv_find(sv, key);
    if (e) {
        sv_free(sv, e->val);
        e->val = copy;
        e->len = len;
        return 0;
    }
    if (sv->nkv == sv->cap_kv) {
        int cap = sv->cap_kv ? sv->cap_kv * 2 : 64;
        kv_entry *k = sv->al.realloc_fn(sv->kv, sizeof *k * (size_t)cap, sv->al.user);
        if (!k) {
            sv_free(sv, copy);
            return -1;
        }
        sv->kv = k;
        sv->cap_kv = cap;
    }
    size_t kl = strlen(key) + 1;
    char *kc = sv_alloc(sv, kl);
    if (!kc) {
        sv_free(sv, copy);
        return -1;
    }
    memcpy(kc, key, kl);
    sv->kv[sv->nkv++] = (kv_entry){kc, copy, len};
    return 0;
}

/* Answer parked GETs whose key arrived or whose deadline passed. */
static void sv_serve_waiters(store_server *sv)
{
    double now = dt_now();
    for (int i = 0; i < sv->ncl; i++) {
        store_client *c = &sv->cl[i];
        if (!c->waiting)
            continue;
        kv_entry *e = kv_find(sv, c->wait_key);
        if (e || now >= c->wait_deadline) {
            c->waiting = 0;
            if (sv_reply(sv, c, OP_GET, e != NULL, e ? e->val : NULL, e ? e->len : 0) != 0) {
                close(c->fd);
                c->fd = -1;
            }
        }
    }
}

/* A key field: u16 length + bytes, NUL-free, 1..DT_STORE_MAX_KEY. */
static int take_key(const unsigned char **p, const unsigned char *end, char *key)
{
    if (end - *p < 2)
        return -1;
    uint32_t kl = get_u16(*p);
    *p += 2;
    if (kl == 0 || kl > DT_STORE_MAX_KEY || (uint32_t)(end - *p) < kl || memchr(*p, 0, kl))
        return -1;
    memcpy(key, *p, kl);
    key[kl] = '\0';
    *p += kl;
    return 0;
}

/* Handle one whole frame; -1 drops the client. */
static int sv_frame(store_server *sv, store_client *c, const unsigned char *f, size_t n)
{
    const unsigned char *p = f + 1, *end = f + n;
    char key[DT_STORE_MAX_KEY + 1];
    int op = n ? f[0] : 0;
    if (op == OP_HELLO) {
        if (n < 11 || get_u16(p) != DT_STORE_MAGIC || get_u16(p + 2) != DT_STORE_VERSION)
            return sv_error(sv, c, op, "not a dtrain rendezvous client of this version");
        uint32_t rank = get_u32(p + 4), tl = get_u16(p + 8);
        size_t rest = (size_t)(end - (p + 10));   /* the token, then maybe an incarnation */
        if (rest != tl && rest != (size_t)tl + 4)
            return sv_error(sv, c, op, "malformed hello");
        c->inc = rest == (size_t)tl + 4 ? get_u32(p + 10 + tl) : 0;
        if (!token_equal((const char *)p + 10, tl, sv->token, sv->token_len))
            return sv_error(sv, c, op, "wrong or missing job token (DTRAIN_JOB_TOKEN)");
        if (rank >= (uint32_t)sv->world)
            return sv_error(sv, c, op, "rank out of range for this job");
        c->hello = 1;
        c->rank = (int)rank;
        return sv_reply(sv, c, op, 1, NULL, 0);
    }
    if (op == OP_BYE) {
        c->bye = 1;
        return sv_reply(sv, c, op, 1, NULL, 0);
    }
    if (!c->hello)
        return sv_error(sv, c, op, "hello with the job token first");
    if (op == OP_SET) {
        if (take_key(&p, end, key) != 0 || end - p < 4)
            return sv_error(sv, c, op, "malformed set");
        uint32_t vl = get_u32(p);
        p += 4;
        if (vl > DT_STORE_MAX_VALUE || (uint32_t)(end - p) != vl)
            return sv_error(sv, c, op, "malformed set");
        if (kv_set(sv, key, p, vl) != 0)
            return sv_error(sv, c, op, "store out of memory");
        if (sv_reply(sv, c, op, 1, NULL, 0) != 0)
            return -1;
        sv_serve_waiters(sv);
        return 0;
    }
    if (op == OP_TIME) {   /* rank 0's clock, for the others' offsets (src/profile.c) */
        if (n != 1)
            return sv_error(sv, c, op, "malformed time");
        double now = dt_now();
        unsigned char b[8];
        memcpy(b, &now, sizeof b);
        return sv_reply(sv, c, op, 1, b, sizeof b);
    }
    if (op == OP_ADD) {   /* an atomic counter: the server handles one frame at a time */
        if (take_key(&p, end, key) != 0 || end - p != 8)
            return sv_error(sv, c, op, "malformed add");
        int64_t delta, v = 0;
        memcpy(&delta, p, sizeof delta);
        kv_entry *e = kv_find(sv, key);
        if (e && e->len != sizeof v) {   /* the caller's mistake: refused, not dropped */
            const char *why = "the key holds a value that is not a counter";
            return sv_reply(sv, c, op, 0, why, (uint32_t)strlen(why));
        }
        if (e)
            memcpy(&v, e->val, sizeof v);
        v = (int64_t)((uint64_t)v + (uint64_t)delta);
        unsigned char b[8];
        memcpy(b, &v, sizeof b);
        if (kv_set(sv, key, b, sizeof b) != 0)
            return sv_error(sv, c, op, "store out of memory");
        if (sv_reply(sv, c, op, 1, b, sizeof b) != 0)
            return -1;
        sv_serve_waiters(sv);
        return 0;
    }
    if (op == OP_GET) {
        if (take_key(&p, end, key) != 0 || end - p != 4)
            return sv_error(sv, c, op, "malformed get");
        uint32_t timeout_ms = get_u32(p);
        kv_entry *e = kv_find(sv, key);
        if (e || timeout_ms <= 1)   /* <= 1 ms: a poll, answered at once */
            return sv_reply(sv, c, op, e != NULL, e ? e->val : NULL, e ? e->len : 0);
        snprintf(c->wait_key, sizeof c->wait_key, "%s", key);
        c->wait_deadline = dt_now() + timeout_ms / 1000.0;
        c->waiting = 1;
        return 0;
    }
    return sv_error(sv, c, op, "unknown operation");
}

/* Read what the client sent; handle every whole frame in it. */
static int sv_readable(store_server *sv, store_client *c)
{
    if (c->cap - c->have < 4096) {
        size_t cap = c->cap ? c->cap * 2 : 8192;
        if (cap > DT_STORE_MAX_FRAME + 8)
            cap = DT_STORE_MAX_FRAME + 8;
        if (cap <= c->have)
            return -1;
        unsigned char *b = sv->al.realloc_fn(c->buf, cap, sv->al.user);
        if (!b)
            return -1;
        c->buf = b;
        c->cap = cap;
    }
    ssize_t k = recv(c->fd, c->buf + c->have, c->cap - c->have, MSG_DONTWAIT);
    if (k < 0 && (errno == EAGAIN || errno == EINTR))
        return 0;
    if (k <= 0)
        return -1;
    c->have += (size_t)k;
    while (c->have >= 4) {
        uint32_t len = get_u32(c->buf);
        if (len == 0 || len > DT_STORE_MAX_FRAME)
            return sv_error(sv, c, 0, "frame too large");
        if (c->have < 4 + (size_t)len)
            break;
        if (c->waiting)
            return sv_error(sv, c, 0, "request while a get is pending");
        if (sv_frame(sv, c, c->buf + 4, len) != 0)
            return -1;
        memmove(c->buf, c->buf + 4 + len, c->have - 4 - len);
        c->have -= 4 + len;
    }
    return 0;
}

static void sv_accept(store_server *sv)
{
    int fd = accept(sv->listen_fd, NULL, NULL);
    if (fd < 0)
        return;
    if (sv->ncl == sv->cap_cl) {
        int cap = sv->cap_cl ? sv->cap_cl * 2 : 16;
        store_client *c = cap <= DT_STORE_MAX_CLIENTS
                              ? sv->al.realloc_fn(sv->cl, sizeof *c * (size_t)cap, sv->al.user)
                              : NULL;
        if (!c) {
            close(fd);
            return;
        }
        sv->cl = c;
        sv->cap_cl = cap;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    memset(&sv->cl[sv->ncl], 0, sizeof sv->cl[0]);
    sv->cl[sv->ncl++].fd = fd;
}

/* A rank whose connection closed without a goodbye died (its process
 * exited or was killed: the kernel closes its sockets).  Record it under
 * "dead/<rank>" ("dead/<rank>.<n>" for its n-th restarted process: find_rejoin)
 * and, first death only, "dead", which stalled collectives read to name
 * the rank that failed. */
static void sv_record_death(store_server *sv, int rank, uint32_t inc)
{
    char key[32], val[16];
    store_dead_key(key, sizeof key, rank, inc);
    snprintf(val, sizeof val, "%d", rank);
    kv_set(sv, key, (const unsigned char *)val, (uint32_t)strlen(val) + 1);
    if (!kv_find(sv, "dead"))
        kv_set(sv, "dead", (const unsigned char *)val, (uint32_t)strlen(val) + 1);
}

static void sv_drop_closed(store_server *sv)
{
    int j = 0, died = 0;
    for (int i = 0; i < sv->ncl; i++) {
        if (sv->cl[i].fd >= 0) {
            sv->cl[j++] = sv->cl[i];
        } else {
            /* (a restarted process that leaves, even saying goodbye, is gone
             * too: the next restart of its rank waits for this record) */
            if (sv->cl[i].hello && (!sv->cl[i].bye || sv->cl[i].inc > 0)) {
                sv_record_death(sv, sv->cl[i].rank, sv->cl[i].inc);
                died = 1;
            }
            sv_free(sv, sv->cl[i].buf);
            sv_free(sv, sv->cl[i].out);
        }
    }
    sv->ncl = j;
    if (died)
        sv_serve_waiters(sv);
}

/* Other ranks still connected (said hello, not goodbye)?  Rank 0's own
 * connections do not count: they are its own, closing. */
static int sv_others_connected(const store_server *sv)
{
    for (int i = 0; i < sv->ncl; i++)
        if (sv->cl[i].fd >= 0 && sv->cl[i].hello && !sv->cl[i].bye && sv->cl[i].rank != 0)
            return 1;
    return 0;
}

/* Asked to stop: at once, or (drain_until set) once the other ranks left. */
static int sv_done_draining(const store_server *sv)
{
    double until;
    __atomic_load(&sv->drain_until, &until, __ATOMIC_ACQUIRE);
    return until <= 0 || dt_now() >= until || !sv_others_connected(sv);
}

static void *store_server_main(void *arg)
{
    store_server *sv = arg;
    struct pollfd *pf = NULL;
    int cap_pf = 0, stopping = 0;
    for (;;) {
        if (cap_pf < sv->ncl + 2) {
            cap_pf = sv->ncl + 16;
            struct pollfd *n = sv->al.realloc_fn(pf, sizeof *pf * (size_t)cap_pf, sv->al.user);
            if (!n)
                break;
            pf = n;
        }
        pf[0] = (struct pollfd){sv->stop_pipe[0], POLLIN, 0};
        pf[1] = (struct pollfd){sv->listen_fd, POLLIN, 0};
        for (int i = 0; i < sv->ncl; i++)
            pf[i + 2] = (struct pollfd){sv->cl[i].fd,
                                        (short)(POLLIN | (sv->cl[i].out_len ? POLLOUT : 0)), 0};
        int r = poll(pf, (nfds_t)sv->ncl + 2, 50);   /* 50 ms: parked GET deadlines */
        if (r < 0 && errno != EINTR)
            break;
        if (pf[0].revents) {
            char x;
            stopping = 1;
            ssize_t k = read(sv->stop_pipe[0], &x, 1);
            (void)k;
        }
        if (stopping && sv_done_draining(sv))
            break;
        int n = sv->ncl;
        for (int i = 0; r > 0 && i < n; i++) {
            short ev = pf[i + 2].revents;
            if (!ev)
                continue;
            int bad = (ev & POLLOUT) && sv_flush(&sv->cl[i]) != 0;
            if (!bad && (ev & ~POLLOUT))
                bad = sv_readable(sv, &sv->cl[i]) != 0;
            if (bad) {
                close(sv->cl[i].fd);
                sv->cl[i].fd = -1;
            }
        }
        if (r > 0 && pf[1].revents)
            sv_accept(sv);
        sv_serve_waiters(sv);
        sv_drop_closed(sv);
    }
    sv_free(sv, pf);
    return NULL;
}

static void store_server_free(store_server *sv)
{
    if (!sv)
        return;
    for (int i = 0; i < sv->ncl; i++) {
        if (sv->cl[i].fd >= 0)
            close(sv->cl[i].fd);
        sv_free(sv, sv->cl[i].buf);
        sv_free(sv, sv->cl[i].out);
    }
    for (int i = 0; i < sv->nkv; i++) {
        sv_free(sv, sv->kv[i].key);
        sv_free(sv, sv->kv[i].val);
    }
    sv_free(sv, sv->cl);
    sv_free(sv, sv->kv);
    if (sv->listen_fd >= 0)
        close(sv->listen_fd);
    if (sv->stop_pipe[0] >= 0)
        close(sv->stop_pipe[0]);
    if (sv->stop_pipe[1] >= 0)
        close(sv->stop_pipe[1]);
    sv_free(sv, sv);
}

static dt_status store_server_start(dt_ctx *ctx, const char *bind_addr, int port, int world,
                                    const char *token, store_server **out)
{
    store_server *sv = host_calloc(ctx, sizeof *sv);
    if (!sv)
        return set_error(ctx, DT_ENOMEM, "store: out of memory");
    sv->al = ctx->al;
    sv->listen_fd = sv->stop_pipe[0] = sv->stop_pipe[1] = -1;
    sv->world = world;
    sv->token_len = strlen(token);
    memcpy(sv->token, token, sv->token_len + 1);
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    dt_status st = DT_OK;
    int one = 1;
    socklen_t sl = sizeof sa;
    if (inet_pton(AF_INET, bind_addr, &sa.sin_addr) != 1)
        st = set_error(ctx, DT_EINVAL, "store: bind address '%s' is not an IPv4 address", bind_addr);
    else if ((sv->listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) < 0 ||
             setsockopt(sv->listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
             bind(sv->listen_fd, (struct sockaddr *)&sa, sizeof sa) != 0 ||
             listen(sv->listen_fd, 1024) != 0 ||
             getsockname(sv->listen_fd, (struct sockaddr *)&sa, &sl) != 0)
        st = set_error(ctx, DT_EIO, "store: cannot listen on %s:%d: %s", bind_addr, port,
                       strerror(errno));
    else if (pipe(sv->stop_pipe) != 0)
        st = set_error(ctx, DT_EIO, "store: pipe: %s", strerror(errno));
    else if (pthread_create(&sv->thread, NULL, store_server_main, sv) != 0)
        st = set_error(ctx, DT_ENOMEM, "store: cannot start the server thread");
    if (st != DT_OK) {
        store_server_free(sv);
        return st;
    }
    sv->port = ntohs(sa.sin_port);
    *out = sv;
    return DT_OK;
}

/* drain_ms > 0: keep serving until every other rank has closed its
 * connections, up to drain_ms (see dt_comm_free for why). */
static void store_server_stop(store_server *sv, int drain_ms)
{
    if (!sv)
        return;
    if (drain_ms > 0) {
        double until = dt_now() + drain_ms / 1000.0;
        __atomic_store(&sv->drain_until, &until, __ATOMIC_RELEASE);
    }
    ssize_t w = write(sv->stop_pipe[1], "x", 1);
    (void)w;
    pthread_join(sv->thread, NULL);
    store_server_free(sv);
}

/* --- the client (every rank) ---------------------------------------- */

void dt_store_config_init(dt_store_config *cfg)
{
    if (cfg)
        memset(cfg, 0, sizeof *cfg);
    cfg->struct_size = sizeof *cfg;
}

/* Connect to host:port, retrying until the deadline (rank 0 may be late). */
static int store_connect(const char *host, int port, double deadline, char *why, size_t wl)
{
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    struct addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    int gai = getaddrinfo(host, ps, &hints, &ai);
    if (gai != 0) {
        snprintf(why, wl, "cannot resolve '%s': %s", host, gai_strerror(gai));
        return -1;
    }
    int fd = -1;
    snprintf(why, wl, "no answer");
    do {
        fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) {
            snprintf(why, wl, "socket: %s", strerror(errno));
            break;
        }
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0)
            break;
        snprintf(why, wl, "%s", strerror(errno));
        close(fd);
        fd = -1;
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    } while (dt_now() < deadline);
    freeaddrinfo(ai);
    if (fd >= 0) {
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    }
    return fd;
}

/* No call of s waits past `until` (0: each its own deadline).  The
 * communicator bounds its watch's calls by the collective's deadline, so a
 * silent rank 0 cannot hold a survivor past it. */
DT_PRIVATE void store_limit(dt_store *s, double until)
{
    if (s)
        s->until = until;
}

/* > 0: the last call heard nothing from rank 0 for that many ms (rank 0,
 * whose process serves the store, is stopped or hung); 0: it answered. */
DT_PRIVATE int store_silent_ms(const dt_store *s) { return s ? s->silent_ms : 0; }

static dt_status store_gone_silent(dt_store *s)
{
    s->silent_ms = (int)((dt_now() - s->last_answer) * 1000.0) + 1;
    return set_error(s->ctx, DT_ETIMEDOUT, "store: rank 0 (%s:%d, which serves the store) sent "
                     "nothing for %d ms: it is silent (stopped or hung?)", s->addr, s->port,
                     s->silent_ms);
}

/* Read (into buf, up to cap; the rest drained) the payload of a reply
 * whose header said vlen bytes. */
static int read_payload(dt_store *s, uint32_t vlen, void *buf, size_t cap, double deadline)
{
    unsigned char tmp[256];
    for (uint32_t got = 0; got < vlen;) {
        uint32_t chunk = vlen - got;
        unsigned char *dst = tmp;
        if (buf && got < cap) {
            dst = (unsigned char *)buf + got;
            if (chunk > cap - got)
                chunk = (uint32_t)(cap - got);
        } else if (chunk > sizeof tmp) {
            chunk = sizeof tmp;
        }
        int r = sock_io(s->fd, dst, chunk, 0, deadline, NULL);
        if (r != 0)
            return r;
        got += chunk;
    }
    return 0;
}

/* One reply frame's header; 0, -1 (closed or malformed), -2 (nothing came
 * by the deadline: the stream is still whole), -3 (cut off mid-frame). */
static int read_reply_header(dt_store *s, unsigned char hdr[10], double deadline)
{
    size_t moved = 0;
    int r = sock_io(s->fd, hdr, 10, 0, deadline, &moved);
    if (r == -2 && moved > 0)
        return -3;
    if (r != 0)
        return r;
    uint32_t flen = get_u32(hdr), vlen = get_u32(hdr + 6);
    return flen != 6 + vlen || vlen > DT_STORE_MAX_FRAME ? -1 : 0;
}

/* Replies that earlier calls gave up on, read and dropped. */
static int skip_owed(dt_store *s, double deadline)
{
    while (s->owed > 0) {
        unsigned char hdr[10];
        int r = read_reply_header(s, hdr, deadline);
        if (r == 0 && (r = read_payload(s, get_u32(hdr + 6), NULL, 0, deadline)) == -2)
            r = -3;
        if (r != 0)
            return r;
        s->owed--;
    }
    return 0;
}

/* Send one request frame and read its reply into buf (up to cap bytes).
 * Returns DT_OK with *ok and *len set, or a status with the ctx message:
 * DT_ETIMEDOUT when rank 0 stayed silent (store_silent_ms says how long),
 * DT_EPEER when the connection failed.  A reply that does not come in time
 * stays owed and is skipped by the next call. */
static dt_status store_call(dt_store *s, const unsigned char *req, size_t n, int op,
                            double deadline, void *buf, size_t cap, int *ok, size_t *len)
{
    dt_ctx *ctx = s->ctx;
    if (s->until > 0 && s->until < deadline)
        deadline = s->until;
    if (s->broken)
        return set_error(ctx, DT_EPEER, "store: the connection to rank 0 (%s:%d) broke after it "
                         "went silent", s->addr, s->port);
    int r = skip_owed(s, deadline);
    if (r == -2)
        return store_gone_silent(s);
    if (r != 0) {
        s->broken = r == -3;
        return r == -3 ? store_gone_silent(s)
                       : set_error(ctx, DT_EPEER, "store: lost the connection to rank 0 (%s:%d)",
                                   s->addr, s->port);
    }
    unsigned char hdr[10];
    size_t moved = 0, moved2 = 0;
    put_u32(hdr, (uint32_t)n);
    r = sock_io(s->fd, hdr, 4, 1, deadline, &moved);
    if (r == 0)
        r = sock_io(s->fd, (void *)req, n, 1, deadline, &moved2);
    if (r != 0) {
        s->broken = r == -2 && moved + moved2 > 0;   /* half a request sent */
        return r == -2 ? store_gone_silent(s)
                       : set_error(ctx, DT_EPEER, "store: lost the connection to rank 0 (%s:%d)",
                                   s->addr, s->port);
    }
    r = read_reply_header(s, hdr, deadline);
    if (r == -2) {
        s->owed++;   /* the answer may still come: the next call skips it */
        return store_gone_silent(s);
    }
    if (r == -3) {
        s->broken = 1;
        return store_gone_silent(s);
    }
    if (r != 0 || hdr[4] != (OP_REPLY | op))
        return set_error(ctx, DT_EPEER, r ? "store: rank 0 (%s:%d) closed the connection"
                                          : "store: malformed reply from rank 0 (%s:%d)",
                         s->addr, s->port);
    uint32_t vlen = get_u32(hdr + 6);
    *ok = hdr[5];
    *len = vlen;
    r = read_payload(s, vlen, buf, cap, deadline);
    if (r != 0) {
        s->broken = r == -2;
        return r == -2 ? store_gone_silent(s)
                       : set_error(ctx, DT_EPEER, "store: reply from rank 0 cut short");
    }
    s->silent_ms = 0;
    s->last_answer = dt_now();
    return DT_OK;
}

static const char *store_token(const dt_store_config *cfg)
{
    if (cfg && cfg->token)
        return cfg->token;
    const char *t = getenv("DTRAIN_JOB_TOKEN");
    return t ? t : "";
}

static dt_status store_hello(dt_store *s, const char *token)
{
    size_t tl = strlen(token);
    unsigned char req[15 + DT_STORE_MAX_TOKEN];
    req[0] = OP_HELLO;
    put_u16(req + 1, DT_STORE_MAGIC);
    put_u16(req + 3, DT_STORE_VERSION);
    put_u32(req + 5, (uint32_t)s->rank);
    put_u16(req + 9, (uint32_t)tl);
    memcpy(req + 11, token, tl);
    if (s->inc)   /* a restarted rank's process (src/join.c): its death has its own key */
        put_u32(req + 11 + tl, s->inc);
    char msg[256];
    size_t len = 0;
    int ok = 0;
    dt_status st = store_call(s, req, 11 + tl + (s->inc ? 4 : 0), OP_HELLO, dt_now() + s->timeout_ms / 1000.0, msg,
                              sizeof msg - 1, &ok, &len);
    if (st != DT_OK)
        return st;
    if (!ok) {
        msg[len < sizeof msg - 1 ? len : sizeof msg - 1] = '\0';
        return set_error(s->ctx, DT_EPEER, "store: rank 0 (%s:%d) refused rank %d: %s", s->addr,
                         s->port, s->rank, msg);
    }
    return DT_OK;
}

dt_store *dt_store_new(dt_ctx *ctx, const dt_dist_env *env, const dt_store_config *cfg)
{
    dt_store_config own;
    dt_store_config_init(&own);
    if (cfg && ctx_ok(ctx) &&
        ctx_config_in(ctx, &own, sizeof own, cfg, "store_open", "dt_store_config") != DT_OK)
        return NULL;
    return store_open(ctx, env, &own, 1, 0);
}

/* serve: rank 0 starts the store; inc: this process's incarnation (src/join.c) */
DT_PRIVATE dt_store *store_open(dt_ctx *ctx, const dt_dist_env *env, const dt_store_config *cfg,
                            int serve, uint32_t inc)
{
    if (!ctx_ok(ctx))
        return NULL;
    if (!env || env->world_size < 1 || env->rank < 0 || env->rank >= env->world_size ||
        env->master_port < 0 || env->master_port > 65535) {
        set_error(ctx, DT_EINVAL, "store: needs a valid dt_dist_env (rank < world size, port)");
        return NULL;
    }
    const char *token = store_token(cfg);
    if (strlen(token) > DT_STORE_MAX_TOKEN) {
        set_error(ctx, DT_EINVAL, "store: job token longer than %d bytes", DT_STORE_MAX_TOKEN);
        return NULL;
    }
    dt_store *s = host_calloc(ctx, sizeof *s);
    if (!s) {
        set_error(ctx, DT_ENOMEM, "store: out of memory");
        return NULL;
    }
    s->ctx = ctx;
    s->fd = -1;
    s->rank = env->rank;
    s->inc = inc;
    snprintf(s->token, sizeof s->token, "%s", token);
    s->timeout_ms = cfg && cfg->timeout_ms > 0 ? cfg->timeout_ms : DT_STORE_DEFAULT_TIMEOUT_MS;
    snprintf(s->addr, sizeof s->addr, "%s", env->master_addr);
    s->port = env->master_port;
    if (env->rank == 0 && serve) {
        const char *bind = cfg && cfg->bind_addr ? cfg->bind_addr : getenv("DTRAIN_STORE_BIND");
        if (store_server_start(ctx, bind ? bind : "127.0.0.1", env->master_port, env->world_size,
                               token, &s->server) != DT_OK) {
            host_free(ctx, s);
            return NULL;
        }
        s->port = s->server->port;
    }
    char why[DT_MAX_HOST + 128];
    s->fd = store_connect(s->addr, s->port, dt_now() + s->timeout_ms / 1000.0, why, sizeof why);
    s->last_answer = dt_now();
    if (s->fd < 0) {
        set_error(ctx, DT_ETIMEDOUT, "store: rank %d cannot reach rank 0 at %s:%d within %d ms: %s",
                  s->rank, s->addr, s->port, s->timeout_ms, why);
        dt_store_free(s);
        return NULL;
    }
    if (store_hello(s, token) != DT_OK) {
        dt_store_free(s);
        return NULL;
    }
    return s;
}

/* drain_ms: on rank 0, see store_server_stop. */
DT_PRIVATE void store_close(dt_store *s, int drain_ms)
{
    if (!s)
        return;
    if (s->fd >= 0) {
        unsigned char bye = OP_BYE, msg[64];
        int ok = 0;
        size_t len = 0;
        dt_status keep = s->ctx->last_status;
        char keep_msg[DT_MAX_ERROR];
        snprintf(keep_msg, sizeof keep_msg, "%s", s->ctx->err);
        store_call(s, &bye, 1, OP_BYE, dt_now() + 1.0, msg, sizeof msg, &ok, &len);
        set_error(s->ctx, keep, "%s", keep_msg);   /* closing leaves the last error alone */
        close(s->fd);
    }
    store_server_stop(s->server, drain_ms);
    host_free(s->ctx, s);
}

void dt_store_free(dt_store *s) { store_close(s, 0); }

int dt_store_port(const dt_store *s) { return s ? s->port : -1; }

static int store_key_ok(dt_store *s, const char *op, const char *key)
{
    size_t kl = key ? strlen(key) : 0;
    if (kl == 0 || kl > DT_STORE_MAX_KEY) {
        set_error(s->ctx, DT_EINVAL, "store_%s: key must be 1..%d bytes", op, DT_STORE_MAX_KEY);
        return 0;
    }
    return 1;
}

/* The key as the server stores it: in the store's namespace (a process
 * group's), or "/key": the job's.  NULL when too long (error set). */
static const char *store_wire_key(dt_store *s, const char *op, const char *key,
                                  char out[DT_STORE_MAX_KEY + 1])
{
    if (!store_key_ok(s, op, key))
        return NULL;
    if (key[0] == '/')
        return key + 1;
    if (!s->prefix[0])
        return key;
    if ((size_t)snprintf(out, DT_STORE_MAX_KEY + 1, "%s%s", s->prefix, key) > DT_STORE_MAX_KEY) {
        set_error(s->ctx, DT_EINVAL, "store_%s: key '%s' is too long in namespace '%s'", op, key,
                  s->prefix);
        return NULL;
    }
    return out;
}

dt_status dt_store_set(dt_store *s, const char *key_in, const void *value, size_t len)
{
    char full[DT_STORE_MAX_KEY + 1];
    if (!s)
        return DT_EINVAL;
    const char *key = store_wire_key(s, "set", key_in, full);
    if (!key)
        return DT_EINVAL;
    if (len > DT_STORE_MAX_VALUE || (len && !value))
        return set_error(s->ctx, DT_EINVAL, "store_set: value must be at most %zu bytes",
                         DT_STORE_MAX_VALUE);
    size_t kl = strlen(key), n = 1 + 2 + kl + 4 + len;
    unsigned char *req = host_alloc(s->ctx, n);
    if (!req)
        return set_error(s->ctx, DT_ENOMEM, "store_set: out of memory");
    req[0] = OP_SET;
    put_u16(req + 1, (uint32_t)kl);
    memcpy(req + 3, key, kl);
    put_u32(req + 3 + kl, (uint32_t)len);
    if (len)
        memcpy(req + 7 + kl, value, len);
    int ok = 0;
    size_t rl = 0;
    char msg[128];
    dt_status st = store_call(s, req, n, OP_SET, dt_now() + s->timeout_ms / 1000.0, msg,
                              sizeof msg, &ok, &rl);
    host_free(s->ctx, req);
    if (st == DT_OK && !ok)
        st = set_error(s->ctx, DT_EPEER, "store_set: rank 0 refused '%s'", key);
    return st;
}

dt_status dt_store_add(dt_store *s, const char *key_in, int64_t delta, int64_t *value)
{
    char full[DT_STORE_MAX_KEY + 1];
    if (!s)
        return DT_EINVAL;
    const char *key = store_wire_key(s, "add", key_in, full);
    if (!key)
        return DT_EINVAL;
    size_t kl = strlen(key);
    unsigned char req[1 + 2 + DT_STORE_MAX_KEY + 8], out[64];
    req[0] = OP_ADD;
    put_u16(req + 1, (uint32_t)kl);
    memcpy(req + 3, key, kl);
    memcpy(req + 3 + kl, &delta, sizeof delta);
    int ok = 0;
    size_t len = 0;
    dt_status st = store_call(s, req, 11 + kl, OP_ADD, dt_now() + s->timeout_ms / 1000.0, out,
                              sizeof out, &ok, &len);
    if (st != DT_OK)
        return st;
    if (!ok || len != 8)
        return set_error(s->ctx, DT_EINVAL, "store_add: rank 0 refused '%s': %.*s", key,
                         (int)(len < sizeof out ? len : sizeof out), (const char *)out);
    if (value)
        memcpy(value, out, sizeof *value);
    return DT_OK;
}

/* Rank 0's clock minus ours, by Cristian's method: the best of `rounds`
 * round trips (the least delay leaves the least doubt); *rtt its time. */
DT_PRIVATE dt_status store_clock_offset(dt_store *s, int rounds, double *offset, double *rtt)
{
    *offset = 0;
    *rtt = INFINITY;
    for (int i = 0; i < rounds; i++) {
        unsigned char req[1] = {OP_TIME}, out[64];
        int ok = 0;
        size_t len = 0;
        double t0 = dt_now();
        dt_status st = store_call(s, req, 1, OP_TIME, t0 + s->timeout_ms / 1000.0, out,
                                  sizeof out, &ok, &len);
        double t1 = dt_now();
        if (st != DT_OK)
            return st;
        if (!ok || len != 8)
            return set_error(s->ctx, DT_EPEER, "store: rank 0 did not answer the clock request");
        double server;
        memcpy(&server, out, sizeof server);
        if (t1 - t0 < *rtt) {
            *rtt = t1 - t0;
            *offset = server - (t0 + t1) / 2;
        }
    }
    return DT_OK;
}

dt_status dt_store_get(dt_store *s, const char *key_in, void *buf, size_t cap, size_t *len,
                       int timeout_ms)
{
    char full[DT_STORE_MAX_KEY + 1];
    if (!s)
        return DT_EINVAL;
    const char *key = store_wire_key(s, "get", key_in, full);
    if (!key)
        return DT_EINVAL;
    if ((cap && !buf) || !len)
        return set_error(s->ctx, DT_EINVAL, "store_get: buffer and length are required");
    if (timeout_ms <= 0)
        timeout_ms = s->timeout_ms;
    size_t kl = strlen(key);
    unsigned char req[1 + 2 + DT_STORE_MAX_KEY + 4];
    req[0] = OP_GET;
    put_u16(req + 1, (uint32_t)kl);
    memcpy(req + 3, key, kl);
    put_u32(req + 3 + kl, (uint32_t)timeout_ms);
    int ok = 0;
    /* the server parks the get up to timeout_ms; allow it 10 s more to answer */
    dt_status st = store_call(s, req, 7 + kl, OP_GET, dt_now() + (timeout_ms + 10000) / 1000.0,
                              buf, cap, &ok, len);
    if (st == DT_OK && !ok)
        st = set_error(s->ctx, DT_ETIMEDOUT, "store_get: '%s' was not set within %d ms", key,
                       timeout_ms);
    return st;
}

