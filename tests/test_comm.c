/*
 * tests/test_comm.c - collectives across forked processes on the real
 * transports (libfabric shm and tcp): 1, 2, 3, 4 and 7 ranks, sizes 0, 1,
 * odd lengths and 64 MiB, integer-valued data compared exactly with the
 * closed-form answer; mismatched calls; a rank killed mid-job.
 */
#include "test_util.h"
#include "test_ranks.h"
#include "backends/transport.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <pthread.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef int (*rank_fn)(dt_comm *c, int rank, int world);

static dt_ctx *rank_ctx;   /* this process's context (one rank per process) */
/* how the next run_job's ranks join (set before forking, so inherited) */
static const char *intra_mode = "transport";   /* dt_comm_config.intra_host */
static int host_groups;    /* > 0: rank r claims host "h<r % host_groups>" */
static int job_port;       /* the running job's store port (in its ranks) */
static int collective_ms;  /* dt_comm_config.collective_timeout_ms (0: the default) */
static dt_ctx *dt_comm_ctx_for_test(dt_comm *c) { (void)c; return rank_ctx; }

/* One rank's process: join, run fn, leave.  Exit codes: 0 ok, 90 could not
 * join, else fn's code.  Never returns. */
static void rank_main(int rank, int world, int port, const char *prov, int timeout_ms, rank_fn fn)
{
    alarm(60);   /* a hung rank dies instead of hanging the suite */
    dt_ctx *ctx = dt_ctx_new(NULL);
    rank_ctx = ctx;
    dt_dist_env e = tr_env(rank, world, port);
    dt_comm_config cfg;
    dt_comm_config_init(&cfg);
    cfg.transport = prov;
    cfg.host = "127.0.0.1";
    cfg.timeout_ms = timeout_ms;
    cfg.collective_timeout_ms = collective_ms;
    cfg.store.timeout_ms = 20000;
    cfg.intra_host = intra_mode;
    char host_id[16];
    if (host_groups > 0) {
        snprintf(host_id, sizeof host_id, "h%d", rank % host_groups);
        cfg.host_id = host_id;
    }
    job_port = port;
    dt_comm *c = ctx ? dt_comm_new(ctx, &e, &cfg) : NULL;
    if (!c) {
        fprintf(stderr, "rank %d: %s\n", rank, ctx ? dt_last_error(ctx) : "no ctx");
        _exit(90);
    }
    int code = fn(c, rank, world);
    /* linger so rank 0's store outlives the others' last questions */
    struct timespec linger = {1, 0};
    nanosleep(&linger, NULL);
    if (code)
        fprintf(stderr, "rank %d: check %d failed: %s\n", rank, code, dt_last_error(ctx));
    dt_comm_free(c);
    dt_ctx_free(ctx);
    _exit(code);
}

/* Run a job; codes[r] gets each rank's exit code (-1: killed by the deadline). */
static void run_job(int world, const char *prov, int timeout_ms, rank_fn fn, int *codes,
                    double seconds)
{
    int port = tr_free_port();
    pid_t pids[16];
    fflush(NULL);
    for (int r = 0; r < world; r++) {
        pids[r] = fork();
        assert_true(pids[r] >= 0);
        if (pids[r] == 0)
            rank_main(r, world, port, prov, timeout_ms, fn);
    }
    tr_reap(pids, world, codes, seconds);
}

/* --- correctness ------------------------------------------------------- */

static int check_allreduce(dt_comm *c, int rank, int world, int64_t n)
{
    float *buf = malloc(sizeof(float) * (size_t)(n ? n : 1));
    if (!buf)
        return 1;
    static const dt_reduce_op ops[] = {DT_REDUCE_SUM, DT_REDUCE_MAX, DT_REDUCE_MIN, DT_REDUCE_AVG};
    for (int k = 0; k < 4; k++) {
        if (n > 300000 && k > 0)
            break;   /* 64 MiB: sum only, to keep the suite quick */
        for (int64_t i = 0; i < n; i++)
            buf[i] = (float)((rank + 1) * (int)(i % 97));
        if (dt_comm_allreduce(c, buf, n, ops[k]) != DT_OK) {
            free(buf);
            return 2 + k;
        }
        for (int64_t i = 0; i < n; i++) {
            double v = (double)(i % 97), want = ops[k] == DT_REDUCE_SUM   ? v * world * (world + 1) / 2
                                                : ops[k] == DT_REDUCE_MAX ? v * world
                                                : ops[k] == DT_REDUCE_MIN ? v
                                                                          : v * (world + 1) / 2.0;
            double tol = ops[k] == DT_REDUCE_AVG ? 1e-5 * (want + 1) : 0;
            if (fabs((double)buf[i] - want) > tol) {
                fprintf(stderr, "rank %d: op %d n %lld: [%lld] = %g, want %g\n", rank, k,
                        (long long)n, (long long)i, (double)buf[i], want);
                free(buf);
                return 10 + k;
            }
        }
    }
    free(buf);
    return 0;
}

static int check_others(dt_comm *c, int rank, int world)
{
    float b[1001];
    for (int i = 0; i < 1001; i++)   /* broadcast from the last rank */
        b[i] = rank == world - 1 ? (float)i + 0.5f : -1.0f;
    if (dt_comm_broadcast(c, b, 1001, world - 1) != DT_OK)
        return 20;
    for (int i = 0; i < 1001; i++)
        if (b[i] != (float)i + 0.5f)
            return 21;
    float in[5], out[16 * 5];
    for (int i = 0; i < 5; i++)
        in[i] = (float)(rank * 10 + i);
    if (dt_comm_allgather(c, in, 5, out) != DT_OK)
        return 22;
    for (int r = 0; r < world; r++)
        for (int i = 0; i < 5; i++)
            if (out[r * 5 + i] != (float)(r * 10 + i))
                return 23;
    float rin[16 * 6], rout[6];
    for (int j = 0; j < world * 6; j++)
        rin[j] = (float)(rank + j);
    if (dt_comm_reduce_scatter(c, rin, 6, rout, DT_REDUCE_SUM) != DT_OK)
        return 24;
    for (int i = 0; i < 6; i++)
        if (rout[i] != (float)(world * (world - 1) / 2 + world * (rank * 6 + i)))
            return 25;
    /* alltoall: rank r sends 100 r + q + i / 8 to rank q */
    float ain[16 * 3], aout[16 * 3];
    for (int q = 0; q < world; q++)
        for (int i = 0; i < 3; i++)
            ain[q * 3 + i] = (float)(100 * rank + q) + (float)i / 8;
    if (dt_comm_alltoall(c, ain, 3, aout) != DT_OK)
        return 29;
    for (int p = 0; p < world; p++)
        for (int i = 0; i < 3; i++)
            if (aout[p * 3 + i] != (float)(100 * p + rank) + (float)i / 8)
                return 30;
    if (dt_comm_alltoall(c, ain, 0, aout) != DT_OK)
        return 31;
    if (dt_comm_barrier(c) != DT_OK)
        return 26;
    /* two allreduces in flight at once, kept apart by their tags */
    float x[3] = {1, 2, 3}, y[2] = {10, 20};
    dt_work *w1 = dt_comm_allreduce_async(c, x, 3, DT_REDUCE_SUM);
    dt_work *w2 = dt_comm_allreduce_async(c, y, 2, DT_REDUCE_MAX);
    if (!w1 || !w2 || dt_work_wait(w1) != DT_OK || dt_work_wait(w2) != DT_OK)
        return 27;
    if (x[0] != (float)world || x[2] != 3.0f * world || y[1] != 20.0f)
        return 28;
    return 0;
}

static int job_small(dt_comm *c, int rank, int world)
{
    static const int64_t sizes[] = {0, 1, 7, 1001, 70001};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        int code = check_allreduce(c, rank, world, sizes[i]);
        if (code)
            return code;
    }
    return check_others(c, rank, world);
}

static int job_with_64mib(dt_comm *c, int rank, int world)
{
    int code = job_small(c, rank, world);
    return code ? code : check_allreduce(c, rank, world, (int64_t)16 << 20);
}

static void expect_all_zero(int world, const int *codes, const char *what)
{
    for (int r = 0; r < world; r++)
        if (codes[r] != 0)
            fail_msg("%s: rank %d of %d exited with %d", what, r, world, codes[r]);
}

/* The ranks took the path the test asked for: segment or transport, and
 * as many hosts as host_groups makes. */
static int check_path(dt_comm *c, int world)
{
    int want_hosts = host_groups > 0 ? (host_groups < world ? host_groups : world) : 1;
    if (dt_comm_hosts(c) != want_hosts)
        return 50;
    int seg = world > 1 && strcmp(intra_mode, "segment") == 0;
    if (seg != (strcmp(dt_comm_intra_host(c), "segment") == 0))
        return 51;
    return 0;
}

static int job_small_on_path(dt_comm *c, int rank, int world)
{
    int code = check_path(c, world);
    return code ? code : job_small(c, rank, world);
}

static int job_64mib_on_path(dt_comm *c, int rank, int world)
{
    int code = check_path(c, world);
    return code ? code : job_with_64mib(c, rank, world);
}

static void run_worlds(const char *prov, const char *intra, int groups)
{
    static const int worlds[] = {1, 2, 3, 4, 7};
    int codes[16];
    intra_mode = intra;
    host_groups = groups;
    for (size_t i = 0; i < sizeof worlds / sizeof worlds[0]; i++) {
        int w = worlds[i];
        char what[96];
        snprintf(what, sizeof what, "%s, %s, %d host groups, %d ranks", prov, intra, groups, w);
        run_job(w, prov, 30000, (w == 2 || w == 4) ? job_64mib_on_path : job_small_on_path, codes,
                120);
        expect_all_zero(w, codes, what);
    }
    intra_mode = "transport";
    host_groups = 0;
}

/* the transports alone (no host segment) */
static void test_collectives_shm(void **state)
{
    (void)state;
    run_worlds("shm", "transport", 0);
}

static void test_collectives_tcp(void **state)
{
    (void)state;
    run_worlds("tcp", "transport", 0);
}

/* every rank on one host: collectives over the shared segment */
static void test_collectives_segment(void **state)
{
    (void)state;
    run_worlds("shm", "segment", 0);
}

/* ranks claim 2 or 3 hosts (non-contiguous ranks, uneven counts):
 * allreduce is hierarchical (segment inside, tcp between leaders) */
static void test_collectives_hierarchical(void **state)
{
    (void)state;
    run_worlds("tcp", "segment", 2);
    run_worlds("tcp", "segment", 3);
}

/* A barrier holds every rank until the last arrives: the last rank comes
 * 500 ms late, and nobody may leave within 300 ms. */
static int job_barrier_waits(dt_comm *c, int rank, int world)
{
    /* Every rank runs on this host, so dt_now() is one clock: after each
     * barrier the late rank sends the time it entered (as two floats, hi
     * and lo, summed with zeros so they arrive exact), and every rank must
     * have left after it.  No margins: a loaded machine cannot fail this,
     * a barrier that lets a rank through early always does. */
    if (dt_comm_barrier(c) != DT_OK)
        return 62;
    for (int round = 0; round < 2; round++) {
        double entered = 0;
        if (rank == world - 1) {
            struct timespec ts = {0, 200 * 1000 * 1000};
            nanosleep(&ts, NULL);
            entered = dt_now();
        }
        if (dt_comm_barrier(c) != DT_OK)
            return 60;
        double left = dt_now();
        float t[2] = {(float)entered, 0};
        t[1] = (float)(entered - (double)t[0]);
        if (dt_comm_allreduce(c, t, 2, DT_REDUCE_SUM) != DT_OK)
            return 63;
        double last_in = (double)t[0] + (double)t[1];
        if (left < last_in) {
            fprintf(stderr, "rank %d left the barrier %.6f s before rank %d entered it\n", rank,
                    last_in - left, world - 1);
            return 61;
        }
    }
    return 0;
}

static void test_barrier_waits_for_all(void **state)
{
    (void)state;
    int codes[4];
    static const char *const provs[] = {"tcp", "shm", "tcp", "tcp"};
    static const char *const intra[] = {"transport", "segment", "segment", "segment"};
    static const int groups[] = {0, 0, 3, 2}, worlds[] = {3, 3, 3, 4};
    for (int k = 0; k < 4; k++) {
        intra_mode = intra[k];
        host_groups = groups[k];
        run_job(worlds[k], provs[k], 10000, job_barrier_waits, codes, 40);
        intra_mode = "transport";
        host_groups = 0;
        char what[96];
        snprintf(what, sizeof what, "barrier, %s/%s, %d host groups", provs[k], intra[k], groups[k]);
        expect_all_zero(worlds[k], codes, what);
    }
}

/* --- mismatch and failure ----------------------------------------------- */

static int job_mismatch(dt_comm *c, int rank, int world)
{
    (void)world;
    float b[10] = {0};
    dt_status st = rank == 0 ? dt_comm_allreduce(c, b, 10, DT_REDUCE_SUM) : dt_comm_broadcast(c, b, 10, 0);
    if (st != DT_EMISMATCH)
        return 30;
    const char *m = dt_last_error(dt_comm_ctx_for_test(c));
    if (!strstr(m, "allreduce") || !strstr(m, "broadcast"))
        return 34;
    return 0;
}

static int job_mismatch_msg(dt_comm *c, int rank, int world)
{
    (void)world;
    float b[11] = {0};
    dt_status st = dt_comm_allreduce(c, b, rank == 0 ? 10 : 11, DT_REDUCE_SUM);
    if (st != DT_EMISMATCH)
        return 31;
    /* every rank names both calls, the one whose neighbours agreed included */
    const char *m = dt_last_error(dt_comm_ctx_for_test(c));
    if (!strstr(m, "n=10") || !strstr(m, "n=11"))
        return 33;
    /* after a failure the communicator refuses work instead of hanging */
    if (dt_comm_allreduce(c, b, 10, DT_REDUCE_SUM) != DT_ESTATE)
        return 32;
    return 0;
}

/* ranks 1 and 3 (one whole host of two) call n=11, the others n=10: only
 * the leaders' headers can see it */
static int job_mismatch_hosts(dt_comm *c, int rank, int world)
{
    (void)world;
    float b[11] = {0};
    if (dt_comm_allreduce(c, b, rank % 2 ? 11 : 10, DT_REDUCE_SUM) != DT_EMISMATCH)
        return 35;
    const char *m = dt_last_error(dt_comm_ctx_for_test(c));
    return strstr(m, "n=10") && strstr(m, "n=11") ? 0 : 36;
}

static void test_mismatch(void **state)
{
    (void)state;
    int codes[4];
    run_job(2, "shm", 10000, job_mismatch, codes, 30);
    expect_all_zero(2, codes, "allreduce vs broadcast");
    run_job(3, "tcp", 10000, job_mismatch_msg, codes, 30);
    expect_all_zero(3, codes, "allreduce n=10 vs n=11");
    intra_mode = "segment";
    run_job(2, "shm", 10000, job_mismatch, codes, 30);
    expect_all_zero(2, codes, "segment: allreduce vs broadcast");
    run_job(3, "shm", 10000, job_mismatch_msg, codes, 30);
    expect_all_zero(3, codes, "segment: allreduce n=10 vs n=11");
    host_groups = 2;
    run_job(4, "tcp", 10000, job_mismatch_msg, codes, 30);
    expect_all_zero(4, codes, "hierarchical: allreduce n=10 vs n=11 inside a host");
    run_job(4, "tcp", 10000, job_mismatch_hosts, codes, 30);
    expect_all_zero(4, codes, "hierarchical: allreduce n=10 vs n=11 between hosts");
    intra_mode = "transport";
    host_groups = 0;
}

/* A failure published for a later collective ("abort", as publish_failure
 * writes it: status|@seq|message) must not fail a rank still in an earlier
 * one: its peers finished their part of that (the hierarchical mismatch
 * case's slow rank, still in dt_comm_new's barrier, once adopted its
 * leader's failure of the next call and could not join).  Rank 0 plants
 * the failure of collective #2 and is late to #1, so rank 1 watches the
 * store throughout #1 (and must finish it), then is late to #2 as well,
 * where both must fail with the planted words. */
static int job_later_failure(dt_comm *c, int rank, int world)
{
    if (rank == 0) {
        dt_ctx *ctx = dt_ctx_new(NULL);
        dt_dist_env e = tr_env(1, world, job_port);   /* (rank 0's would serve a store) */
        dt_store_config sc;
        dt_store_config_init(&sc);
        dt_store *st = ctx ? dt_store_new(ctx, &e, &sc) : NULL;
        char why[64];
        int n = snprintf(why, sizeof why, "%d|@2|planted failure of collective #2", (int)DT_EMISMATCH);
        if (!st || dt_store_set(st, "abort", why, (size_t)n + 1) != DT_OK)
            return 60;
        dt_store_free(st);
        dt_ctx_free(ctx);
        usleep(1500 * 1000);   /* three of rank 1's store checks (DT_COMM_WATCH_S) */
    }
    if (dt_comm_barrier(c) != DT_OK) {
        fprintf(stderr, "rank %d: barrier #1: %s\n", rank, dt_last_error(dt_comm_ctx_for_test(c)));
        return 61;
    }
    if (rank == 0)
        usleep(1500 * 1000);
    float x = 1.0f;
    if (dt_comm_allreduce(c, &x, 1, DT_REDUCE_SUM) != DT_EMISMATCH)
        return 62;
    return strstr(dt_last_error(dt_comm_ctx_for_test(c)), "planted failure") ? 0 : 63;
}

static void test_later_failure_spares_earlier_call(void **state)
{
    (void)state;
    int codes[2];
    run_job(2, "tcp", 10000, job_later_failure, codes, 60);
    expect_all_zero(2, codes, "a later collective's published failure, during an earlier one");
}

/* rank 2 dies (SIGKILL) between two allreduces; the others must fail
 * naming it, well within the timeout */
static int job_kill(dt_comm *c, int rank, int world)
{
    (void)world;
    float b[1000];
    for (int i = 0; i < 1000; i++)
        b[i] = 1;
    if (dt_comm_allreduce(c, b, 1000, DT_REDUCE_SUM) != DT_OK)
        return 40;
    if (rank == 2)
        kill(getpid(), SIGKILL);
    double t0 = dt_now();
    dt_status st = dt_comm_allreduce(c, b, 1000, DT_REDUCE_SUM);
    double took = dt_now() - t0;
    if (st == DT_OK)
        return 41;
    const char *m = dt_last_error(dt_comm_ctx_for_test(c));
    fprintf(stderr, "rank %d noticed in %.2f s: %s\n", rank, took, m);
    if (!strstr(m, "rank 2"))
        return 43;   /* the error must name the dead rank */
    return took < 10.0 ? 0 : 42;
}

static void test_killed_rank(void **state)
{
    (void)state;
    int codes[4];
    static const char *const provs[] = {"tcp", "shm", "shm", "tcp"};
    static const char *const intra[] = {"transport", "transport", "segment", "segment"};
    for (int p = 0; p < 4; p++) {
        int world = p == 3 ? 4 : 3;   /* last: 2 hosts, rank 2 a non-leader on the first */
        intra_mode = intra[p];
        host_groups = p == 3 ? 2 : 0;
        run_job(world, provs[p], 20000, job_kill, codes, 40);
        intra_mode = "transport";
        host_groups = 0;
        for (int r = 0; r < world; r++)
            if (r != 2 && codes[r] != 0)
                fail_msg("%s/%s: survivor rank %d exited with %d", provs[p], intra[p], r, codes[r]);
        assert_int_equal(codes[2], 200 + SIGKILL);
    }
}


/* --- forged and malformed messages ----------------------------------------- */

static void *fm_malloc(size_t n, void *u) { (void)u; return malloc(n); }
static void *fm_realloc(void *p, size_t n, void *u) { (void)u; return realloc(p, n); }
static void fm_free(void *p, void *u) { (void)u; free(p); }

/* A fake rank 1: joins the store and the tcp fabric by hand, like a buggy or
 * hostile peer, and sends `bad` (len bytes) where rank 0 expects the header
 * of collective #0 (dt_comm_new's barrier).  The tag layout is the wire
 * format of dtrain.c 14.1: sequence << 28 | step << 12, the header's step
 * 0xFFFF.  Exits 0 when it delivered the message. */
static void forger_main(int port, const void *bad, size_t len)
{
    alarm(30);
    dt_ctx *ctx = dt_ctx_new(NULL);
    dt_dist_env e = tr_env(1, 2, port);
    dt_store_config sc;
    dt_store_config_init(&sc);
    sc.timeout_ms = 10000;
    dt_store *st = ctx ? dt_store_new(ctx, &e, &sc) : NULL;
    if (!st)
        _exit(80);
    const dt_transport_iface *f = dt_transport_fabric_iface();
    dt_transport_params p;
    memset(&p, 0, sizeof p);
    p.provider = "tcp";
    p.host = "127.0.0.1";
    p.allocator = (dt_allocator){fm_malloc, fm_realloc, fm_free, NULL};
    dt_transport *t = NULL;
    char err[256], addr[2][512];
    size_t alen[2] = {sizeof addr[1], 0};
    if (f->open(&p, &t, err, sizeof err) != DT_OK || f->get_addr(t, addr[1], &alen[0], err, sizeof err) != DT_OK)
        _exit(81);
    alen[1] = alen[0];
    memcpy(addr[0], addr[1], alen[0]);   /* addr[1]: ours; addr[0]: rank 0's, below */
    if (dt_store_set(st, "host/1", "forger-host", 12) != DT_OK ||
        dt_store_set(st, "addr/1", addr[1], alen[1]) != DT_OK ||
        dt_store_set(st, "segok/1", "0", 2) != DT_OK ||
        dt_store_get(st, "addr/0", addr[0], sizeof addr[0], &alen[0], 0) != DT_OK)
        _exit(82);
    const void *ptrs[2] = {addr[0], addr[1]};
    if (f->insert_peers(t, 2, ptrs, alen, err, sizeof err) != DT_OK)
        _exit(83);
    uint64_t tag = (uint64_t)0 << 28 | (uint64_t)0xFFFF << 12;
    dt_xfer x;
    memset(&x, 0, sizeof x);
    if (f->send(t, 0, tag, bad, len, &x, err, sizeof err) != DT_OK)
        _exit(84);
    double until = dt_now() + 5;
    while (!x.done && dt_now() < until) {
        dt_xfer *done[4];
        if (f->poll(t, done, 4, err, sizeof err) == 0)
            f->wait(t, 10);
    }
    int code = x.done && x.status == DT_OK ? 0 : 85;
    /* stay until rank 0 has judged the message, then leave */
    struct timespec ts = {2, 0};
    nanosleep(&ts, NULL);
    f->close(t);
    dt_store_free(st);
    dt_ctx_free(ctx);
    _exit(code);
}

/* Rank 0 joins normally: its join barrier must fail naming rank 1 and the
 * reason (`want`), not hang, crash or accept the message. */
static void expect_rejected(const void *bad, size_t len, const char *want)
{
    int port = tr_free_port();
    fflush(NULL);
    pid_t forger = fork();
    assert_true(forger >= 0);
    if (forger == 0)
        forger_main(port, bad, len);
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    pid_t r0 = fork();
    assert_true(r0 >= 0);
    if (r0 == 0) {
        alarm(30);
        close(fds[0]);
        dt_ctx *ctx = dt_ctx_new(NULL);
        dt_dist_env e = tr_env(0, 2, port);
        dt_comm_config cfg;
        dt_comm_config_init(&cfg);
        cfg.transport = "tcp";
        cfg.host = "127.0.0.1";
        cfg.timeout_ms = 10000;
        dt_comm *c = dt_comm_new(ctx, &e, &cfg);
        const char *m = c ? "joined" : dt_last_error(ctx);
        if (write(fds[1], m, strlen(m) + 1) < 0)
            _exit(3);
        /* linger: the forger still asks the store */
        struct timespec ts = {3, 0};
        nanosleep(&ts, NULL);
        _exit(c ? 1 : 0);
    }
    close(fds[1]);
    double t0 = dt_now(), answered = 0;
    char msg[600] = "";
    ssize_t got = 0, k;
    while ((k = read(fds[0], msg + got, sizeof msg - 1 - (size_t)got)) > 0) {
        got += k;
        if (!answered)
            answered = dt_now() - t0;
    }
    close(fds[0]);
    int st0 = 0, st1 = 0;
    waitpid(r0, &st0, 0);
    waitpid(forger, &st1, 0);
    if (!WIFEXITED(st0) || WEXITSTATUS(st0) != 0)
        fail_msg("rank 0 accepted a forged message (or died): status %d, '%s'", st0, msg);
    if (!strstr(msg, "rank 1") || !strstr(msg, want))
        fail_msg("rank 0's error '%s' should name rank 1 and say '%s'", msg, want);
    /* refused on sight: well before the 10 s timeout (a timeout would also name rank 1) */
    if (answered > 5.0)
        fail_msg("rank 0 took %.1f s to refuse: a timeout, not a check", answered);
    if (!WIFEXITED(st1) || WEXITSTATUS(st1) != 0)
        fail_msg("the forger could not deliver its message (status %d)", st1);
}

static void test_forged_messages(void **state)
{
    (void)state;
    unsigned char junk[32];
    for (size_t i = 0; i < sizeof junk; i++)
        junk[i] = (unsigned char)(i * 37 + 11);   /* right size, wrong magic */
    expect_rejected(junk, sizeof junk, "malformed header");
    expect_rejected(junk, 7, "malformed header");   /* truncated: refused, not timed out */
    uint32_t hdr[8] = {0x44545243u, 3, 0, 0, 0, 0, 5, 0};   /* allgather(n=5) */
    expect_rejected(hdr, sizeof hdr, "allgather(n=5)");
    expect_rejected(hdr, 7, "malformed header");   /* the right magic, cut short */
}

/* rank 2 stops (SIGSTOP: alive but silent) before the second allreduce;
 * on 2 hosts it is a non-leader, so host 1 only sees its leader go quiet.
 * Every survivor must fail within a few timeouts naming rank 2. */
static int job_hang(dt_comm *c, int rank, int world)
{
    (void)world;
    float b[1000];
    for (int i = 0; i < 1000; i++)
        b[i] = 1;
    if (dt_comm_allreduce(c, b, 1000, DT_REDUCE_SUM) != DT_OK)
        return 70;
    if (rank == 2)
        raise(SIGSTOP);
    double t0 = dt_now();
    dt_status st = dt_comm_allreduce(c, b, 1000, DT_REDUCE_SUM);
    double took = dt_now() - t0;
    const char *m = dt_last_error(dt_comm_ctx_for_test(c));
    fprintf(stderr, "rank %d noticed in %.2f s: %s\n", rank, took, m);
    if (st == DT_OK)
        return 71;
    if (!strstr(m, "rank 2"))
        return 72;
    return took < 8.0 ? 0 : 73;   /* timeout 2 s; the inter-host step allows 1.5x */
}

static void test_hung_rank(void **state)
{
    (void)state;
    int codes[4];
    static const char *const intra[] = {"transport", "segment", "segment"};
    static const int groups[] = {0, 0, 2};
    for (int k = 0; k < 3; k++) {
        intra_mode = intra[k];
        host_groups = groups[k];
        run_job(4, "tcp", 2000, job_hang, codes, 12);
        intra_mode = "transport";
        host_groups = 0;
        for (int r = 0; r < 4; r++)
            if (r != 2 && codes[r] != 0)
                fail_msg("%s, %d host groups: survivor rank %d exited with %d", intra[k], groups[k],
                         r, codes[r]);
    }
}

/* --- a silent rank, whichever it is ---------------------------------------
 * The victim's second allreduce starts at once; a thread of its own stops
 * the whole process (SIGSTOP) 100 ms in, so it freezes inside the wait.
 * The others join 300 ms late and wait on it.  Every survivor must fail
 * within the timeout (+ margin) naming the victim; then, the survivors
 * still alive (each waits on the harness once it has failed), the harness
 * sends SIGCONT and the victim must fail too, saying it did not run past
 * the timeout: what it would finish is half a collective, the others
 * having given up. */
static int silent_victim;
static int silent_failed[2], silent_go[2];   /* pipes: survivors -> harness, harness -> them */

static void *stop_me_soon(void *arg)
{
    (void)arg;
    struct timespec ts = {0, 100 * 1000 * 1000};
    nanosleep(&ts, NULL);
    raise(SIGSTOP);
    return NULL;
}

static int job_silent(dt_comm *c, int rank, int world)
{
    float b[1000];
    for (int i = 0; i < 1000; i++)
        b[i] = 1;
    if (dt_comm_allreduce(c, b, 1000, DT_REDUCE_SUM) != DT_OK || b[0] != (float)world)
        return 70;
    pthread_t th;
    if (rank == silent_victim) {
        if (pthread_create(&th, NULL, stop_me_soon, NULL) != 0)
            return 75;
    } else {
        struct timespec late = {0, 300 * 1000 * 1000};
        nanosleep(&late, NULL);
    }
    /* A rank whose part of a collective was done before the victim froze
     * may finish it (its data is whole): the next one needs the victim. */
    double t0 = dt_now(), t1 = t0;
    dt_status st = DT_OK;
    int k;
    for (k = 2; k < 6 && st == DT_OK; k++) {
        t1 = dt_now();
        st = dt_comm_allreduce(c, b, 1000, DT_REDUCE_SUM);
    }
    double now = dt_now();
    const char *m = dt_last_error(dt_comm_ctx_for_test(c));
    fprintf(stderr, "rank %d%s: allreduce #%d %s after %.2f s (%.2f s since #2): %s\n", rank,
            rank == silent_victim ? " (the stopped one)" : "", k - 1,
            st == DT_OK ? "ok" : "failed", now - t1, now - t0, st == DT_OK ? "" : m);
    if (rank == silent_victim) {   /* resumed while the others live: its own stall */
        pthread_join(th, NULL);
        return st == DT_OK ? 74 : !strstr(m, "did not run for") ? 76 : 0;
    }
    char want[32];
    snprintf(want, sizeof want, "rank %d", silent_victim);
    int code = st == DT_OK ? 71
             : !strstr(m, want) || !strstr(m, silent_victim == 0 ? "silent" : "sent nothing") ||
                       strstr(m, "malformed") ? 72
             : now - t1 < 2 * 2.0 + 1.0 ? 0   /* 2 s timeout: within 2 T (the waits on a
                                                leader allow 1.5 T) + 1 s */
                                        : 73;
    char byte = 1;   /* failed; alive until the victim has failed too */
    struct pollfd go = {.fd = silent_go[0], .events = POLLIN};
    if (write(silent_failed[1], &byte, 1) != 1 || poll(&go, 1, 15000) != 1)
        return 77;
    return code;
}

/* Fork the ranks; once every survivor has failed (a byte each on
 * silent_failed), SIGCONT the victim while they live; once it has exited,
 * let them go (silent_go closed). */
static void run_silent_job(int world, const char *prov, int victim, int *codes)
{
    int port = tr_free_port();
    pid_t pids[16];
    silent_victim = victim;
    assert_int_equal(pipe(silent_failed), 0);
    assert_int_equal(pipe(silent_go), 0);
    fflush(NULL);
    for (int r = 0; r < world; r++) {
        pids[r] = fork();
        assert_true(pids[r] >= 0);
        if (pids[r] == 0) {
            close(silent_failed[0]);
            close(silent_go[1]);
            rank_main(r, world, port, prov, 2000, job_silent);
        }
    }
    close(silent_failed[1]);
    close(silent_go[0]);
    int failed = 0;
    for (char byte; failed < world - 1; failed++) {   /* (EOF: a survivor exited early) */
        struct pollfd in = {.fd = silent_failed[0], .events = POLLIN};
        if (poll(&in, 1, 20000) != 1 || read(silent_failed[0], &byte, 1) != 1)
            break;
    }
    if (failed < world - 1)
        fprintf(stderr, "silent job: %d of %d survivors said they failed\n", failed, world - 1);
    kill(pids[victim], SIGCONT);
    tr_reap(&pids[victim], 1, &codes[victim], 15);
    close(silent_go[1]);   /* the survivors' poll sees the end of the pipe */
    pid_t others[16];
    int oc[16], n = 0;
    for (int r = 0; r < world; r++)
        if (r != victim)
            others[n++] = pids[r];
    tr_reap(others, n, oc, 20);
    for (int r = 0, k = 0; r < world; r++)
        if (r != victim)
            codes[r] = oc[k++];
    close(silent_failed[0]);
}

/* The cases in three tests (on shm, tcp and host segments), so the suite's
 * shards (DT_TEST_SHARD) run them at once: each waits out timeouts. */
static void silent_cases(int first, int last)
{
    struct {
        int world, victim, groups;
        const char *prov, *intra, *what;
    } cases[] = {
        {2, 0, 0, "shm", "transport", "rank 0 of 2, shm"},
        {2, 1, 0, "shm", "transport", "rank 1 of 2, shm"},
        {2, 0, 0, "tcp", "transport", "rank 0 of 2, tcp"},
        {3, 0, 0, "tcp", "transport", "rank 0 of 3, tcp"},
        {3, 1, 0, "shm", "transport", "rank 1 (middle) of 3, shm"},
        {4, 0, 0, "shm", "transport", "rank 0 of 4, shm"},
        {4, 2, 0, "tcp", "transport", "rank 2 (middle) of 4, tcp"},
        {2, 0, 0, "tcp", "segment", "rank 0 of 2, host segment"},
        {3, 1, 0, "tcp", "segment", "rank 1 of 3, host segment"},
        {4, 0, 2, "tcp", "segment", "rank 0 of 4 (host 0's leader), 2 hosts"},
        {4, 1, 2, "tcp", "segment", "rank 1 of 4 (host 1's leader), 2 hosts"},
    };
    int bad = 0;
    assert_true(first >= 0 && last < TU_ARRAY_LEN(cases));
    for (int k = first; k <= last; k++) {
        int codes[16];
        intra_mode = cases[k].intra;
        host_groups = cases[k].groups;
        fprintf(stderr, "-- silent %s\n", cases[k].what);
        run_silent_job(cases[k].world, cases[k].prov, cases[k].victim, codes);
        intra_mode = "transport";
        host_groups = 0;
        for (int r = 0; r < cases[k].world; r++)
            if (codes[r] != 0) {
                fprintf(stderr, "silent %s: rank %d exited with %d\n", cases[k].what, r, codes[r]);
                bad++;
            }
    }
    if (bad) fail_msg("%d ranks did not end as they should", bad);
}

static void test_silent_rank_any_shm(void **state) { (void)state; silent_cases(0, 1); }
static void test_silent_rank_any_tcp(void **state) { (void)state; silent_cases(2, 6); }
static void test_silent_rank_any_segment(void **state) { (void)state; silent_cases(7, 10); }

/* --- slow is not dead -------------------------------------------------------
 * Rank 1 is busy for late_ms before the second allreduce (a checkpoint it
 * writes, saying so with dt_ctx_set_activity): 3 peer timeouts, which its
 * heartbeat covers, so the others wait and the allreduce is whole.  With a
 * collective timeout below late_ms, the others fail after it, naming rank
 * 1 (at the end of the ring's waits) and what it said it was doing. */
static int late_ms, late_expect_ok;

static int job_late(dt_comm *c, int rank, int world)
{
    if (late_expect_ok && dt_profile_start(rank_ctx, NULL) != DT_OK)
        return 76;
    float b[1000];
    for (int i = 0; i < 1000; i++)
        b[i] = 1;
    if (dt_comm_allreduce(c, b, 1000, DT_REDUCE_SUM) != DT_OK)
        return 70;
    if (rank == 1) {
        dt_ctx_set_activity(rank_ctx, "writing a checkpoint");
        usleep((useconds_t)late_ms * 1000);
        dt_ctx_set_activity(rank_ctx, NULL);
    }
    for (int i = 0; i < 1000; i++)
        b[i] = (float)(rank + 1);
    double t0 = dt_now();
    dt_status st = dt_comm_allreduce(c, b, 1000, DT_REDUCE_SUM);
    double took = dt_now() - t0;
    const char *m = dt_last_error(rank_ctx);
    fprintf(stderr, "rank %d: %s after %.2f s%s%s\n", rank, st == DT_OK ? "ok" : "failed", took,
            st == DT_OK ? "" : ": ", st == DT_OK ? "" : m);
    if (late_expect_ok) {
        if (st != DT_OK)
            return 71;
        if (b[0] != (float)(world * (world + 1) / 2))
            return 72;
        /* the wait is named: rank 0's report has the others' longest waits */
        dt_profile_stats ps;
        dt_profile_stats_get(rank_ctx, &ps);
        if (rank != 1 && (ps.longest_wait_s < late_ms / 2000.0 || ps.longest_wait_rank < 0))
            return 77;
        if (dt_profile_stop(rank_ctx, c, NULL) != DT_OK)
            return 78;
        const char *rep = dt_profile_report(rank_ctx);
        if (rank == 0 && (!strstr(rep, "long wait, rank 0: allreduce #2 waited") ||
                          !strstr(rep, "writing a checkpoint"))) {
            fprintf(stderr, "report:\n%s\n", rep);
            return 79;
        }
        return 0;
    }
    if (rank == 1)   /* the others gave up on it: this one (its data may have been whole) or
                        the next fails with their reason */
        return st != DT_OK || dt_comm_allreduce(c, b, 1000, DT_REDUCE_SUM) != DT_OK ? 0 : 73;
    if (st == DT_OK || !strstr(m, "rank 1 ") || !strstr(m, "writing a checkpoint") ||
        !strstr(m, "collective timeout"))
        return 74;
    return took < collective_ms / 1000.0 + 2.0 ? 0 : 75;
}

static void test_late_rank_is_waited_on(void **state)
{
    (void)state;
    int codes[3];
    static const char *const intra[] = {"transport", "segment"};
    for (int k = 0; k < 2; k++) {
        intra_mode = intra[k];
        late_ms = 3000, late_expect_ok = 1;   /* 3 peer timeouts, the collective's default */
        run_job(3, "tcp", 1000, job_late, codes, 30);
        expect_all_zero(3, codes, "a rank busy 3 peer timeouts");
        collective_ms = 2000, late_ms = 5000, late_expect_ok = 0;
        run_job(3, "tcp", 1000, job_late, codes, 30);
        collective_ms = 0;
        expect_all_zero(3, codes, "a rank busy past the collective timeout");
    }
    intra_mode = "transport";
}

/* A second process claiming a live rank is refused (a restart is only
 * accepted once the store has seen the first one die), and the job goes
 * on. */
static int job_duplicate_rank(dt_comm *c, int rank, int world)
{
    if (rank == 1) {
        dt_ctx *ctx = dt_ctx_new(NULL);
        dt_dist_env e = tr_env(1, world, job_port);
        dt_comm_config cfg;
        dt_comm_config_init(&cfg);
        cfg.transport = "shm";
        cfg.timeout_ms = 300;
        dt_comm *twin = ctx ? dt_comm_new(ctx, &e, &cfg) : NULL;
        int bad = !ctx || twin || dt_last_status(ctx) != DT_ESTATE ||
                  !strstr(dt_last_error(ctx), "already in the job and alive");
        if (bad && ctx)
            fprintf(stderr, "duplicate rank: %s\n", dt_last_error(ctx));
        dt_comm_free(twin);
        dt_ctx_free(ctx);
        if (bad)
            return 1;
    }
    float x = 1.0f;
    return dt_comm_allreduce(c, &x, 1, DT_REDUCE_SUM) != DT_OK || x != 2.0f ? 2 : 0;
}

static void test_duplicate_rank(void **state)
{
    (void)state;
    int codes[2];
    run_job(2, "shm", 5000, job_duplicate_rank, codes, 40);
    expect_all_zero(2, codes, "duplicate rank");
}

/* --- point to point ---------------------------------------------------- */

/* 3 ranks: a ring exchange by dt_comm_sendrecv (a large message, in chunks, and
 * an empty one), ordered sends of several sizes from rank 0 to rank 1,
 * then a receive expecting more than was sent fails with DT_EMISMATCH.
 * That failure poisons the communicator on every rank (rank 0 publishes
 * it), so the others' checks end at a barrier before it: else a rank slow
 * in its own receives fails them with rank 0's cause (seen under load). */
static int job_p2p(dt_comm *c, int rank, int world)
{
    dt_ctx *ctx = dt_comm_ctx_for_test(c);
    int64_t big = (int64_t)3 << 20;   /* 12 MiB: several of any transport's messages */
    float *out = malloc((size_t)big * sizeof *out), *in = malloc((size_t)big * sizeof *in);
    if (!out || !in)
        return 90;
    for (int64_t i = 0; i < big; i++)
        out[i] = (float)(rank * 1000 + i % 997);
    int right = (rank + 1) % world, left = (rank + world - 1) % world;
    if (dt_comm_sendrecv(c, out, big, right, in, big, left) != DT_OK)
        return 91;
    for (int64_t i = 0; i < big; i += 4099)
        if (in[i] != (float)(left * 1000 + i % 997))
            return 92;
    if (dt_comm_sendrecv(c, out, 0, right, in, 0, left) != DT_OK)
        return 93;
    float v[4];
    if (rank == 0) {
        for (int k = 1; k <= 3; k++) {
            for (int i = 0; i < k; i++)
                v[i] = (float)(10 * k + i);
            if (dt_comm_send(c, v, k, 1) != DT_OK)
                return 94;
        }
    } else if (rank == 1) {
        for (int k = 1; k <= 3; k++)
            if (dt_comm_recv(c, v, k, 0) != DT_OK || v[0] != (float)(10 * k) ||
                v[k - 1] != (float)(10 * k + k - 1))
                return 95;
    }
    if (dt_comm_send(c, v, 1, rank) != DT_EINVAL || dt_comm_recv(c, v, 1, world) != DT_EINVAL)
        return 96;
    if (dt_comm_barrier(c) != DT_OK)
        return 100;
    int code = 0;
    if (rank == 2 && dt_comm_send(c, v, 2, 0) != DT_OK)
        code = 97;
    if (rank == 0) {
        dt_status st = dt_comm_recv(c, v, 3, 2);
        if (st != DT_EMISMATCH && st != DT_EPEER)
            code = 98;
        else if (!strstr(dt_last_error(ctx), "rank 2"))
            code = 99;
        fprintf(stderr, "rank 0: a short message: %s\n", dt_last_error(ctx));
    }
    free(out);
    free(in);
    return code;
}

static void test_point_to_point(void **state)
{
    (void)state;
    int codes[3];
    static const char *const provs[] = {"shm", "tcp"};
    for (int k = 0; k < 2; k++) {
        run_job(3, provs[k], 20000, job_p2p, codes, 60);
        char what[64];
        snprintf(what, sizeof what, "point to point over %s", provs[k]);
        expect_all_zero(3, codes, what);
    }
}

/* --- process groups --------------------------------------------------- */

/* 4 ranks split by parity with key -rank (so in reverse order); each
 * group's collectives interleave with the job's; a group split again gives
 * singletons; a negative color is refused. */
static int job_split(dt_comm *c, int rank, int world)
{
    dt_ctx *ctx = dt_comm_ctx_for_test(c);
    dt_comm *g = dt_comm_split(c, rank % 2, -rank, NULL);
    if (!g)
        return 70;
    int gr = dt_comm_rank(g);
    if (dt_comm_size(g) != 2 || gr != (rank < 2 ? 1 : 0))
        return 71;
    if (dt_comm_job_rank(g, gr) != rank || dt_comm_job_rank(g, 2) != -1 ||
        dt_comm_job_rank(c, 3) != 3)
        return 72;
    for (int round = 0; round < 3; round++) {
        float x = (float)(rank + 1), y = 1;
        if (dt_comm_allreduce(g, &x, 1, DT_REDUCE_SUM) != DT_OK || x != (rank % 2 ? 6.0f : 4.0f))
            return 73;
        if (dt_comm_allreduce(c, &y, 1, DT_REDUCE_SUM) != DT_OK || y != (float)world)
            return 74;
    }
    float b[3] = {(float)rank, (float)rank, (float)rank};   /* group rank 0: job rank 2 or 3 */
    if (dt_comm_broadcast(g, b, 3, 0) != DT_OK || b[2] != (rank % 2 ? 3.0f : 2.0f))
        return 75;
    float mine[2] = {(float)rank, 1}, theirs[2] = {-1, -1};   /* the partner: rank ^ 2 */
    if (dt_comm_sendrecv(g, mine, 2, 1 - gr, theirs, 2, 1 - gr) != DT_OK || theirs[0] != (float)(rank ^ 2))
        return 79;
    dt_comm *h = dt_comm_split(g, gr, 0, NULL);
    float z = 5;
    if (!h || dt_comm_size(h) != 1 || dt_comm_job_rank(h, 0) != rank ||
        dt_comm_allreduce(h, &z, 1, DT_REDUCE_SUM) != DT_OK || z != 5)
        return 76;
    dt_comm_free(h);
    if (dt_comm_split(c, -1, 0, NULL) || dt_last_status(ctx) != DT_EINVAL)
        return 77;
    if (dt_comm_barrier(g) != DT_OK)
        return 78;
    dt_comm_free(g);
    return 0;
}

static void test_process_groups(void **state)
{
    (void)state;
    int codes[4];
    static const char *const provs[] = {"shm", "tcp"};
    static const char *const intra[] = {"segment", "transport"};
    for (int k = 0; k < 2; k++) {
        intra_mode = intra[k];
        run_job(4, provs[k], 20000, job_split, codes, 60);
        intra_mode = "transport";
        char what[64];
        snprintf(what, sizeof what, "process groups over %s/%s", provs[k], intra[k]);
        expect_all_zero(4, codes, what);
    }
}

/* Job rank 3 dies: its group partner (job rank 1) fails naming it, while
 * the other group goes on working. */
static int job_group_death(dt_comm *c, int rank, int world)
{
    (void)world;
    dt_comm *g = dt_comm_split(c, rank % 2, rank, NULL);
    float x = 1;
    if (!g || dt_comm_allreduce(g, &x, 1, DT_REDUCE_SUM) != DT_OK)
        return 80;
    if (rank == 3)
        kill(getpid(), SIGKILL);
    double t0 = dt_now();
    dt_status st = dt_comm_allreduce(g, &x, 1, DT_REDUCE_SUM);
    const char *m = dt_last_error(dt_comm_ctx_for_test(c));
    if (rank == 1) {
        fprintf(stderr, "rank 1 noticed in %.2f s: %s\n", dt_now() - t0, m);
        if (st == DT_OK)
            return 81;
        if (!strstr(m, "job rank 3") || !strstr(m, "group [1 3]"))
            return 82;
        return dt_now() - t0 < 10.0 ? 0 : 83;
    }
    if (st != DT_OK || x != 4)   /* the other group: unaffected */
        return 84;
    dt_comm_free(g);
    return 0;
}

static void test_process_group_death(void **state)
{
    (void)state;
    int codes[4];
    intra_mode = "segment";
    run_job(4, "shm", 20000, job_group_death, codes, 60);
    intra_mode = "transport";
    for (int r = 0; r < 3; r++)
        if (codes[r] != 0)
            fail_msg("survivor rank %d exited with %d", r, codes[r]);
    assert_int_equal(codes[3], 200 + SIGKILL);
}

/* (the slow ones first, in a row: DT_TEST_SHARD deals them to different shards) */

/* --- a wedged transport ---------------------------------------------------
 * Rank 1's transport stops returning from poll, as libfabric 1.17's shm
 * provider does when a peer died holding a lock in shared memory.  Its
 * caller's wait must fail once the call outlasts twice the 2 s timeout
 * (5 s at least; looked at every second), naming the wedge; a later call
 * fails at once; released, the thread leaves and dt_comm_free returns.
 * Rank 0, waiting on rank 1 (in that allreduce or the next), fails once
 * rank 1 has left. */
const dt_transport_iface *comm_swap_transport(dt_comm *c, const dt_transport_iface *iface);

static dt_transport_iface wedge_iface;
static int wedge_on, wedge_released;   /* atomic */

static int wedging_poll(dt_transport *t, dt_xfer **done, int max, char *err, size_t err_len)
{
    struct timespec ms = {0, 10 * 1000 * 1000};
    while (__atomic_load_n(&wedge_on, __ATOMIC_ACQUIRE) &&
           !__atomic_load_n(&wedge_released, __ATOMIC_ACQUIRE))
        nanosleep(&ms, NULL);
    return dt_transport_fabric_iface()->poll(t, done, max, err, err_len);
}

static int job_wedge(dt_comm *c, int rank, int world)
{
    float b[1000];
    for (int i = 0; i < 1000; i++)
        b[i] = 1;
    if (dt_comm_allreduce(c, b, 1000, DT_REDUCE_SUM) != DT_OK || b[0] != (float)world)
        return 70;
    if (rank == 1) {
        wedge_iface = *dt_transport_fabric_iface();
        wedge_iface.poll = wedging_poll;
        if (comm_swap_transport(c, &wedge_iface) != dt_transport_fabric_iface())
            return 75;
        __atomic_store_n(&wedge_on, 1, __ATOMIC_RELEASE);
    }
    double t0 = dt_now();
    dt_status st = dt_work_wait(dt_comm_allreduce_async(c, b, 1000, DT_REDUCE_SUM));
    double took = dt_now() - t0;
    if (rank == 0) {   /* (its part of a small allreduce may well have come before the wedge) */
        if (st == DT_OK)
            st = dt_comm_allreduce(c, b, 1000, DT_REDUCE_SUM);
        return st == DT_EPEER && dt_now() - t0 < 15.0 ? 0 : 71;
    }
    const char *err = dt_last_error(rank_ctx);
    if (st != DT_EPEER || !strstr(err, "has not returned") || !strstr(err, "wedged")) {
        fprintf(stderr, "rank 1: %s, %.1f s: %s\n", dt_strerror(st), took, err);
        return 72;
    }
    if (took < 4.5 || took > 8.0) {
        fprintf(stderr, "rank 1: the wedge was found after %.1f s (want 5 s + the 1 s tick)\n", took);
        return 73;
    }
    t0 = dt_now();
    st = dt_comm_allreduce(c, b, 1000, DT_REDUCE_SUM);
    if (st == DT_OK || !strstr(dt_last_error(rank_ctx), "wedged") || dt_now() - t0 > 1.0)
        return 74;
    __atomic_store_n(&wedge_released, 1, __ATOMIC_RELEASE);
    return 0;
}

static void test_wedged_transport(void **state)
{
    (void)state;
    int codes[2];
    collective_ms = 20000;   /* rank 0 fails on rank 1's exit, not its own deadline */
    run_job(2, "shm", 2000, job_wedge, codes, 40);
    collective_ms = 0;
    for (int r = 0; r < 2; r++)
        if (codes[r] != 0)
            fail_msg("rank %d exited with %d", r, codes[r]);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_collectives_shm),
    cmocka_unit_test(test_collectives_tcp),
    cmocka_unit_test(test_collectives_segment),
    cmocka_unit_test(test_collectives_hierarchical),
    cmocka_unit_test(test_hung_rank),
    cmocka_unit_test(test_silent_rank_any_tcp),
    cmocka_unit_test(test_late_rank_is_waited_on),
    cmocka_unit_test(test_forged_messages),
    cmocka_unit_test(test_silent_rank_any_segment),
    cmocka_unit_test(test_silent_rank_any_shm),
    cmocka_unit_test(test_barrier_waits_for_all),
    cmocka_unit_test(test_mismatch),
    cmocka_unit_test(test_later_failure_spares_earlier_call),
    cmocka_unit_test(test_killed_rank),
    cmocka_unit_test(test_duplicate_rank),
    cmocka_unit_test(test_point_to_point),
    cmocka_unit_test(test_process_groups),
    cmocka_unit_test(test_process_group_death),
    cmocka_unit_test(test_wedged_transport),
};

DT_TEST_GROUP(comm, tests)
