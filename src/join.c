#include "dist.h"

/* ===========================================================================
 * Joining the job: a communicator's rendezvous (the store, the transport's
 * addresses, the host segment, a restarted rank's rejoin), its end, and
 * process groups (dt_comm_split).  The comm thread and the collectives it
 * runs are src/comm.c; the host segment's collectives src/seg.c.
 * ======================================================================== */

/* What join keeps of a communicator besides comm's part: the store, the
 * job, the comm thread, the heartbeat, the host segment's name and the
 * clock.  join allocates every communicator (dt_comm_new, dt_comm_split),
 * so a dt_comm is the first member of its join_comm; comm never sees this. */
typedef struct join_comm {
    dt_comm c;                 /* first: JC converts */
    dt_store *store;
    dt_dist_env job;           /* this process in the whole job (rank, world, the store) */
    pthread_t thread;          /* the comm thread (comm_main) */
    int has_thread;
    int announced;             /* a restarted process told its peers it serves */
    double clock_offset;       /* rank 0's clock minus ours, measured at rendezvous (src/profile.c) */
    double clock_rtt;          /* the round trip that measured it (its uncertainty x2) */
    /* the host segment this rank created or opened (src/seg.c runs it) */
    size_t seg_bytes;
    char seg_name[64];
    int seg_linked;            /* we created it and its name still exists */
    /* the heartbeat thread (join_heartbeat): its own store connection */
    dt_store *hb;
    dt_ctx *hb_errors;
    pthread_t hb_thread;
    int hb_stop;
    pthread_mutex_t hb_mu;
    pthread_cond_t hb_cv;
} join_comm;

static join_comm *JC(const dt_comm *c) { return (join_comm *)(uintptr_t)c; }

DT_PRIVATE dt_store *join_store(const dt_comm *c) { return JC(c)->store; }
DT_PRIVATE double join_clock_offset(const dt_comm *c) { return JC(c)->clock_offset; }

/* --- joining the job ------------------------------------------------- */

void dt_comm_config_init(dt_comm_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->struct_size = sizeof *cfg;
    dt_store_config_init(&cfg->store);
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
    dt_status st = dt_store_get(JC(c)->store, key, addr, sizeof addr, &len, 1);
    if (st == DT_ETIMEDOUT) {   /* the first process of this rank (the usual case) */
        dt_clear_error(ctx);
        return DT_OK;
    }
    if (st != DT_OK)
        return st;
    uint32_t before = 0;   /* the last process started for this rank (0: the first) */
    snprintf(key, sizeof key, "tries/%d", c->rank);
    if (dt_store_get(JC(c)->store, key, val, sizeof val - 1, &len, 1) == DT_OK) {
        val[len < sizeof val ? len : sizeof val - 1] = '\0';
        before = (uint32_t)strtoul(val, NULL, 10);
    }
    dt_clear_error(ctx);
    store_dead_key(key, sizeof key, c->rank, before);
    st = dt_store_get(JC(c)->store, key, val, sizeof val, &len, c->timeout_ms);
    if (st == DT_ETIMEDOUT)
        return set_error(ctx, DT_ESTATE, "comm: rank %d is already in the job and alive (its "
                         "address is registered, its process has not died): two processes "
                         "started with one rank?", c->rank);
    if (st != DT_OK)
        return st;
    dt_dist_env e = *env;
    e.master_port = dt_store_port(JC(c)->store);
    dt_store *again = store_open(ctx, &e, &cfg->store, 0, before + 1);
    if (!again)
        return ctx->last_status;
    dt_store_free(JC(c)->store);
    JC(c)->store = again;
    c->inc = before + 1;
    /* counted once our hellos say who we are (so our end is recorded):
     * a number is never handed out twice */
    snprintf(key, sizeof key, "tries/%d", c->rank);
    snprintf(val, sizeof val, "%u", c->inc);
    return dt_store_set(JC(c)->store, key, val, strlen(val) + 1);
}

/* The rejoined process is ready (its receives are posted: dt_ps_new calls
 * this when a restarted server starts serving): tell its peers. */
DT_PRIVATE dt_status join_announce_rejoin(dt_comm *c)
{
    char key[32], val[16];
    if (!c->inc || JC(c)->announced)
        return DT_OK;
    JC(c)->announced = 1;
    snprintf(key, sizeof key, "inc/%d", c->rank);
    snprintf(val, sizeof val, "%u", c->inc);
    return dt_store_set(JC(c)->store, key, val, strlen(val) + 1);
}

/* Comm thread: rank `peer` restarted as incarnation inc; send to and
 * receive from its address (read from the store) from now on.  The caller has cancelled or
 * drained every transfer with the old one. */
DT_PRIVATE dt_status join_replace_peer(dt_comm *c, int peer, uint32_t inc, char *err, size_t err_len)
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
    if (c->hb_peer == peer)   /* a new process: its silence counts from now (comm_check_heartbeat) */
        c->hb_peer = -1;
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
    dt_status st = dt_store_set(JC(c)->store, key, me, strlen(me) + 1);
    char (*names)[DT_MAX_HOST] = host_calloc(ctx, sizeof *names * (size_t)c->world);
    c->local_ranks = host_alloc(ctx, sizeof(int) * (size_t)c->world);
    c->leaders = host_alloc(ctx, sizeof(int) * (size_t)c->world);
    if (st == DT_OK && (!names || !c->local_ranks || !c->leaders))
        st = set_error(ctx, DT_ENOMEM, "comm: out of memory");
    for (int r = 0; st == DT_OK && r < c->world; r++) {
        size_t len = 0;
        snprintf(key, sizeof key, "host/%d", r);
        st = dt_store_get(JC(c)->store, key, names[r], DT_MAX_HOST - 1, &len, 0);
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
    JC(c)->seg_bytes = seg_data_offset(L) + (size_t)L * 2 * c->seg_slot;
    long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);   /* the same on every rank of the host */
    size_t chunk = l2 > 0 ? (size_t)l2 / 4 : SEG_CHUNK_LARGE;
    chunk = chunk < ((size_t)64 << 10) ? (size_t)64 << 10 : chunk & ~(size_t)4095;
    c->seg_chunk_small = chunk < c->seg_slot ? chunk : c->seg_slot;
    snprintf(key, sizeof key, "seg/%d", leader);
    if (c->local_index == 0) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        snprintf(JC(c)->seg_name, sizeof JC(c)->seg_name, "/dtrain-%d-%lx", (int)getpid(),
                 (unsigned long)ts.tv_nsec ^ (unsigned long)ts.tv_sec << 20);
        fd = shm_open(JC(c)->seg_name, O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd >= 0)
            JC(c)->seg_linked = 1;
        /* reserve the pages now: a full /dev/shm is an error here, not a
         * SIGBUS in the middle of a collective */
        int err = fd < 0 ? errno : posix_fallocate(fd, 0, (off_t)JC(c)->seg_bytes);
        if (err)
            snprintf(why, sizeof why, "%s", strerror(err));
        const char *val = err ? "" : JC(c)->seg_name;
        dt_status st = dt_store_set(JC(c)->store, key, val, strlen(val) + 1);
        if ((st != DT_OK || err) && fd >= 0) {
            close(fd);
            fd = -1;
        }
        if (st != DT_OK)
            return st;
    } else {
        size_t len = 0;
        dt_status st = dt_store_get(JC(c)->store, key, JC(c)->seg_name, sizeof JC(c)->seg_name - 1, &len, 0);
        if (st != DT_OK)
            return st;
        JC(c)->seg_name[len < sizeof JC(c)->seg_name ? len : sizeof JC(c)->seg_name - 1] = '\0';
        if (JC(c)->seg_name[0] && (fd = shm_open(JC(c)->seg_name, O_RDWR, 0)) < 0)
            snprintf(why, sizeof why, "%s", strerror(errno));
    }
    struct stat sb;
    if (fd >= 0 && (fstat(fd, &sb) != 0 || (size_t)sb.st_size != JC(c)->seg_bytes)) {
        if (!why[0])
            snprintf(why, sizeof why, "its size is not %zu bytes (ranks disagree on "
                     "DTRAIN_SEGMENT_SLOT_KIB?)", JC(c)->seg_bytes);
        close(fd);
        fd = -1;
    }
    if (fd >= 0) {
        void *p = mmap(NULL, JC(c)->seg_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
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
        c->seg->total_bytes = JC(c)->seg_bytes;
    }
    *ok = 1;
    return DT_OK;
}

static void unmap_segment(dt_comm *c)
{
    if (c->seg)
        munmap(c->seg, JC(c)->seg_bytes);
    c->seg = NULL;
    if (JC(c)->seg_linked)
        shm_unlink(JC(c)->seg_name);
    JC(c)->seg_linked = 0;
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
    dt_status st = dt_store_set(JC(c)->store, key, ok ? "1" : "0", 2);
    c->use_segment = 1;
    for (int r = 0; st == DT_OK && r < c->world; r++) {
        size_t len = 0;
        snprintf(key, sizeof key, "segok/%d", r);
        st = dt_store_get(JC(c)->store, key, val, sizeof val, &len, 0);
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
    dt_status st = dt_store_set(JC(c)->store, key, mine, len);
    snprintf(key, sizeof key, "addr/%d.%u", c->rank, c->inc);   /* (a restart's: find_rejoin) */
    if (st == DT_OK && c->inc)
        st = dt_store_set(JC(c)->store, key, mine, len);
    unsigned char *all = host_alloc(ctx, (size_t)c->world * sizeof mine);
    const void **ptrs = host_alloc(ctx, sizeof *ptrs * (size_t)c->world);
    size_t *lens = host_alloc(ctx, sizeof *lens * (size_t)c->world);
    if (st == DT_OK && (!all || !ptrs || !lens))
        st = set_error(ctx, DT_ENOMEM, "comm: out of memory");
    for (int r = 0; st == DT_OK && r < c->world; r++) {
        snprintf(key, sizeof key, "addr/%d", r);
        ptrs[r] = all + (size_t)r * sizeof mine;
        st = dt_store_get(JC(c)->store, key, all + (size_t)r * sizeof mine, sizeof mine, &lens[r], 0);
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

/* Another connection to c's store, for a thread of a module above (work
 * stealing's loader thread, the monitor's) that must not share c's:
 * the same job, token, timeout and namespace.  Errors go to `errors`, a
 * sink of that thread's own (ctx's state belongs to the caller's thread). */
DT_PRIVATE dt_store *join_own_store(dt_comm *c, dt_ctx *errors)
{
    dt_dist_env e = {.rank = c->rank, .world_size = c->world, .local_rank = -1,
                     .local_world_size = -1, .master_port = dt_store_port(JC(c)->store),
                     .launcher = "dtrain"};
    snprintf(e.master_addr, sizeof e.master_addr, "%s", JC(c)->store->addr);
    dt_store_config sc;
    dt_store_config_init(&sc);
    sc.token = JC(c)->store->token;
    sc.timeout_ms = JC(c)->store->timeout_ms;
    dt_store *s = store_open(errors, &e, &sc, 0, c->inc);
    if (s)
        snprintf(s->prefix, sizeof s->prefix, "%s", JC(c)->store->prefix);
    return s;
}

static dt_status open_transport(dt_comm *c, const dt_comm_config *cfg)
{
    dt_ctx *ctx = c->ctx;
    c->tp_iface = comm_find_transport();
    if (!c->tp_iface)
        return set_error(ctx, DT_ENOTSUP, "comm: no transport compiled in (build with "
                                          "backends/fabric.c, -DDT_WITH_FABRIC and -lfabric)");
    const char *prov = cfg->transport ? cfg->transport : getenv("DTRAIN_TRANSPORT");
    if (!prov)
        prov = c->nhosts <= 1 ? "shm" : "tcp";
    dt_transport_params tp = {prov, cfg->host ? cfg->host : getenv("DTRAIN_HOST"), NULL, ctx->al,
                              c->collective_timeout_ms};
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
    c->watch_errors = ctx_new_sink(ctx);
    if (!c->watch_errors)
        return set_error(ctx, DT_ENOMEM, "comm: out of memory");
    dt_store_config sc = cfg->store;
    sc.token = JC(c)->store->token;   /* (a group's cfg may not carry the job's) */
    c->watch = store_open(c->watch_errors, &JC(c)->job, &sc, 0, c->inc);
    if (!c->watch)
        return set_error(ctx, c->watch_errors->last_status, "%s", c->watch_errors->err);
    snprintf(c->watch->prefix, sizeof c->watch->prefix, "%s", JC(c)->store->prefix);
    /* a hung rank 0 must not hold a collective longer than its own timeout */
    if (c->watch->timeout_ms > c->timeout_ms)
        c->watch->timeout_ms = c->timeout_ms;
    return DT_OK;
}

/* The heartbeat: "<beat> <what this rank is doing>" under "/hb/<job
 * rank>" every beat_ms, from a thread of its own that never waits on the
 * training thread or on a collective, so a rank busy for minutes (a slow
 * loader, a checkpoint) stays alive to its peers, while a stopped, hung or
 * cut-off process falls silent (comm_check_heartbeat).  A failed beat
 * (rank 0's store slow) is retried at the next. */
static void join_note_oversleep(dt_comm *c, double due);

static void *join_heartbeat(void *arg)
{
    dt_comm *c = arg;
    char key[32], val[160], doing[96];
    snprintf(key, sizeof key, "/hb/%d", JC(c)->job.rank);
    unsigned long long beat = 0;
    pthread_mutex_lock(&JC(c)->hb_mu);
    while (!JC(c)->hb_stop) {
        pthread_mutex_unlock(&JC(c)->hb_mu);
        ctx_activity_copy(c->ctx, doing, sizeof doing);
        int waiting = __atomic_load_n(&c->waiting_on, __ATOMIC_RELAXED);
        int n = waiting >= 0 && !strncmp(doing, "in a collective", 15)
                    ? snprintf(val, sizeof val, "%llu %s, waiting for rank %d", ++beat, doing, waiting)
                    : snprintf(val, sizeof val, "%llu %s", ++beat, doing);
        dt_store_set(JC(c)->hb, key, val, (size_t)n + 1);
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        long ns = until.tv_nsec + (long)c->beat_ms * 1000000L;
        until.tv_sec += ns / 1000000000L;
        until.tv_nsec = ns % 1000000000L;
        double due = dt_now() + c->beat_ms / 1000.0;
        __atomic_store(&c->hb_due, &due, __ATOMIC_RELEASE);
        pthread_mutex_lock(&JC(c)->hb_mu);
        if (!JC(c)->hb_stop)
            pthread_cond_timedwait(&JC(c)->hb_cv, &JC(c)->hb_mu, &until);
        join_note_oversleep(c, due);
    }
    pthread_mutex_unlock(&JC(c)->hb_mu);
    return NULL;
}

/* The heartbeat thread, awake: a sleep that ended past the timeout after
 * it began (a process stopped with SIGSTOP, or starved of CPU) is a
 * freeze, which this rank's failing collective then names (run_work). */
static void join_note_oversleep(dt_comm *c, double due)
{
    double now = dt_now(), zero = 0;
    int ms = (int)((now - due) * 1000.0) + c->beat_ms;
    __atomic_store(&c->hb_due, &zero, __ATOMIC_RELEASE);
    if (ms > c->timeout_ms) {
        __atomic_store_n(&c->frozen_ms, ms, __ATOMIC_RELEASE);
        __atomic_store(&c->frozen_at, &now, __ATOMIC_RELEASE);
    }
}

/* The job communicator's heartbeat (a group's ranks beat through it). */
static dt_status join_start_heartbeat(dt_comm *c)
{
    dt_ctx *ctx = c->ctx;
    if (c->world == 1 || c->members)
        return DT_OK;
    if (!(JC(c)->hb_errors = ctx_new_sink(ctx)))
        return set_error(ctx, DT_ENOMEM, "comm: out of memory");
    if (!(JC(c)->hb = join_own_store(c, JC(c)->hb_errors)))
        return set_error(ctx, JC(c)->hb_errors->last_status, "comm: the heartbeat's store "
                         "connection: %s", JC(c)->hb_errors->err);
    JC(c)->hb->timeout_ms = 2 * c->beat_ms > 200 ? 2 * c->beat_ms : 200;   /* a slow beat is skipped */
    if (pthread_mutex_init(&JC(c)->hb_mu, NULL) != 0 || pthread_cond_init(&JC(c)->hb_cv, NULL) != 0 ||
        pthread_create(&JC(c)->hb_thread, NULL, join_heartbeat, c) != 0)
        return set_error(ctx, DT_ENOMEM, "comm: cannot start the heartbeat thread");
    pthread_setname_np(JC(c)->hb_thread, "dtrain-beat");
    c->has_hb = 1;
    return DT_OK;
}

static void join_stop_heartbeat(dt_comm *c)
{
    if (c->has_hb) {
        pthread_mutex_lock(&JC(c)->hb_mu);
        JC(c)->hb_stop = 1;
        pthread_cond_broadcast(&JC(c)->hb_cv);
        pthread_mutex_unlock(&JC(c)->hb_mu);
        pthread_join(JC(c)->hb_thread, NULL);
        pthread_mutex_destroy(&JC(c)->hb_mu);
        pthread_cond_destroy(&JC(c)->hb_cv);
        c->has_hb = 0;
    }
    dt_store_free(JC(c)->hb);
    JC(c)->hb = NULL;
    host_free(c->ctx, JC(c)->hb_errors);
    JC(c)->hb_errors = NULL;
}

/* A communicator's memory and lock, before it connects. */
static dt_comm *comm_alloc(dt_ctx *ctx, int rank, int world, const dt_comm_config *cfg)
{
    dt_comm *c = host_calloc(ctx, sizeof(join_comm));   /* JC */
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
    int ct = cfg->collective_timeout_ms;
    const char *cte = getenv("DTRAIN_COLLECTIVE_TIMEOUT_MS");
    if (ct <= 0 && cte)
        ct = atoi(cte);
    c->collective_timeout_ms = ct > 0 ? ct : DT_COMM_DEFAULT_COLLECTIVE_TIMEOUT_MS;
    if (c->collective_timeout_ms < c->timeout_ms)
        c->collective_timeout_ms = c->timeout_ms;
    c->beat_ms = c->timeout_ms / 4 < DT_COMM_BEAT_MAX_MS ? c->timeout_ms / 4 : DT_COMM_BEAT_MAX_MS;
    if (c->beat_ms < 10)
        c->beat_ms = 10;
    c->hb_peer = -1;
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
    if (join_start_heartbeat(c) != DT_OK)
        return ctx->last_status;
    if (pthread_create(&JC(c)->thread, NULL, comm_main, c) != 0)
        return set_error(ctx, DT_ENOMEM, "comm: cannot start the comm thread");
    pthread_setname_np(JC(c)->thread, "dtrain-comm");   /* for top -H, gdb, perf, renice */
    JC(c)->has_thread = 1;
    /* everyone's endpoint is ready before anyone sends (a rejoined rank's
     * peers are mid-job: it tells them when it serves, join_announce_rejoin) */
    if (!c->inc && dt_comm_barrier(c) != DT_OK)
        return ctx->last_status;
    /* the profiler's offset to rank 0's clock (src/profile.c), while the job is quiet */
    if (!c->members && store_clock_offset(JC(c)->store, 8, &JC(c)->clock_offset, &JC(c)->clock_rtt) != DT_OK)
        return ctx->last_status;
    /* every local rank has mapped the segment: its name can go, so no
     * file is left behind in /dev/shm whatever happens later */
    if (JC(c)->seg_linked) {
        shm_unlink(JC(c)->seg_name);
        JC(c)->seg_linked = 0;
    }
    return DT_OK;
}

dt_comm *dt_comm_new(dt_ctx *ctx, const dt_dist_env *env_in, const dt_comm_config *cfg_in)
{
    if (!ctx_ok(ctx))
        return NULL;
    dt_comm_config cfg;
    dt_comm_config_init(&cfg);
    if (cfg_in && ctx_config_in(ctx, &cfg, sizeof cfg, cfg_in,
                                "comm_new", "dt_comm_config") != DT_OK)
        return NULL;
    cfg.store.struct_size = sizeof cfg.store;   /* embedded: read whole (dtrain.h) */
    dt_dist_env env;
    if (env_in)
        env = *env_in;
    else if (dt_dist_env_detect(ctx, &env) != DT_OK)
        return NULL;
    dt_comm *c = comm_alloc(ctx, env.rank, env.world_size, &cfg);
    if (!c)
        return NULL;
    if (!(JC(c)->store = dt_store_new(ctx, &env, &cfg.store)) || find_rejoin(c, &env, &cfg) != DT_OK)
        goto fail;
    JC(c)->job = env;
    JC(c)->job.master_port = dt_store_port(JC(c)->store);
    if (comm_connect(c, &cfg) != DT_OK)
        goto fail;
    preempt_reclaim(ctx);   /* the transport's libraries may have taken the signals */
    return c;
fail:
    return comm_abandon(c, "");
}

void dt_comm_free(dt_comm *c)
{
    if (!c)
        return;
    join_stop_heartbeat(c);
    if (JC(c)->has_thread && comm_thread_stuck(c)) {
        /* its thread is inside the transport for good and may touch c if it
         * ever returns: c, its transport and memory are left to the process's
         * exit; only the store closes (rank 0's serves the others) */
        pthread_detach(JC(c)->thread);
        store_close(JC(c)->store, 0);
        return;
    }
    if (JC(c)->has_thread) {
        pthread_mutex_lock(&c->mu);
        c->stop = 1;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
        pthread_join(JC(c)->thread, NULL);
    }
    if (c->tp)
        c->tp_iface->close(c->tp);
    comm_xfers_free_buried(c);   /* (the transport that held their sends is closed) */
    dt_store_free(c->watch);
    host_free(c->ctx, c->watch_errors);
    host_free(c->ctx, c->ext_done_at);
    host_free(c->ctx, c->alias);
    /* Rank 0 leaves its last collective as soon as its own part is done,
     * while others may still wait for each other's last messages and ask
     * the store about the dead meanwhile: a store gone then would read as
     * rank 0's death.  So the store stays until they have left (bounded). */
    store_close(JC(c)->store, c->timeout_ms < DT_COMM_DRAIN_MS ? c->timeout_ms : DT_COMM_DRAIN_MS);
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
static dt_status split_members(dt_comm *p, int id, int color, int key, int *members, int *n, int *me)
{
    dt_ctx *ctx = p->ctx;
    char k[48], v[32];
    snprintf(k, sizeof k, "split/%d/%d", id, p->rank);
    int vl = snprintf(v, sizeof v, "%d %d", color, key);
    dt_status st = dt_store_set(JC(p)->store, k, v, (size_t)vl + 1);
    int *keys = host_alloc(ctx, sizeof *keys * (size_t)p->world);
    if (st == DT_OK && !keys)
        st = set_error(ctx, DT_ENOMEM, "comm_split: out of memory");
    *n = 0;
    for (int r = 0; st == DT_OK && r < p->world; r++) {
        size_t len = 0;
        int col = 0, ky = 0;
        snprintf(k, sizeof k, "split/%d/%d", id, r);
        st = dt_store_get(JC(p)->store, k, v, sizeof v - 1, &len, 0);
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
    dt_comm_config_init(&cfg);
    if (cfg_in && ctx_config_in(ctx, &cfg, sizeof cfg, cfg_in,
                                "comm_split", "dt_comm_config") != DT_OK)
        return NULL;
    if (!cfg.timeout_ms)
        cfg.timeout_ms = parent->timeout_ms;
    if (!cfg.collective_timeout_ms)
        cfg.collective_timeout_ms = parent->collective_timeout_ms;
    int id = comm_serial(parent, COMM_SERIAL_SPLIT), n = 0, me = 0;
    int *members = host_alloc(ctx, sizeof *members * (size_t)parent->world);
    if (!members) {
        set_error(ctx, DT_ENOMEM, "comm_split: out of memory");
        return NULL;
    }
    if (split_members(parent, id, color, key, members, &n, &me) != DT_OK) {
        host_free(ctx, members);
        return NULL;
    }
    dt_comm *c = comm_alloc(ctx, me, n, &cfg);
    if (!c) {
        host_free(ctx, members);
        return NULL;
    }
    c->members = members;
    JC(c)->job = JC(parent)->job;
    JC(c)->clock_offset = JC(parent)->clock_offset;
    JC(c)->clock_rtt = JC(parent)->clock_rtt;
    group_label(c);
    cfg.store.token = JC(parent)->store->token;
    if (!(JC(c)->store = store_open(ctx, &JC(c)->job, &cfg.store, 0, 0)))
        goto fail;
    if ((size_t)snprintf(JC(c)->store->prefix, sizeof JC(c)->store->prefix, "%sg%d.%d/",
                         JC(parent)->store->prefix, id, color) >= sizeof JC(c)->store->prefix) {
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
