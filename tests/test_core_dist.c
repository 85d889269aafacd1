/*
 * tests/test_core_dist.c - the launcher environment and the rendezvous
 * store: variables of each launcher, malformed values, the store across
 * forked processes, job tokens, malformed clients and timeouts.
 */
#include "test_util.h"
#include "test_ranks.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const char *const all_vars[] = {
    "DTRAIN_RANK", "DTRAIN_WORLD_SIZE", "DTRAIN_LOCAL_RANK", "DTRAIN_LOCAL_WORLD_SIZE",
    "DTRAIN_MASTER", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
    "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
    "SLURM_NTASKS_PER_NODE", "DTRAIN_JOB_TOKEN", "DTRAIN_STORE_BIND"};

static void clear_env(void)
{
    for (size_t i = 0; i < sizeof all_vars / sizeof all_vars[0]; i++)
        unsetenv(all_vars[i]);
}

static dt_ctx *new_ctx(void)
{
    dt_ctx *ctx = dt_ctx_new(NULL);
    assert_non_null(ctx);
    assert_int_equal(dt_ctx_status(ctx), DT_OK);
    return ctx;
}

static void test_env_default(void **state)
{
    (void)state;
    clear_env();
    dt_ctx *ctx = new_ctx();
    dt_dist_env e;
    assert_int_equal(dt_dist_env_detect(ctx, &e), DT_OK);
    assert_int_equal(e.rank, 0);
    assert_int_equal(e.world_size, 1);
    assert_int_equal(e.local_rank, -1);
    assert_string_equal(e.launcher, "none");
    assert_string_equal(e.master_addr, "127.0.0.1");
    assert_int_equal(e.master_port, 29500);
    dt_ctx_free(ctx);
}

static void test_env_launchers(void **state)
{
    (void)state;
    dt_ctx *ctx = new_ctx();
    dt_dist_env e;
    clear_env();   /* torchrun */
    setenv("RANK", "3", 1);
    setenv("WORLD_SIZE", "8", 1);
    setenv("LOCAL_RANK", "1", 1);
    setenv("LOCAL_WORLD_SIZE", "2", 1);
    setenv("MASTER_ADDR", "node7", 1);
    setenv("MASTER_PORT", "1234", 1);
    assert_int_equal(dt_dist_env_detect(ctx, &e), DT_OK);
    assert_string_equal(e.launcher, "torchrun");
    assert_int_equal(e.rank, 3);
    assert_int_equal(e.world_size, 8);
    assert_int_equal(e.local_rank, 1);
    assert_int_equal(e.local_world_size, 2);
    assert_string_equal(e.master_addr, "node7");
    assert_int_equal(e.master_port, 1234);
    setenv("DTRAIN_RANK", "5", 1);   /* dtrain's own variables win */
    setenv("DTRAIN_WORLD_SIZE", "6", 1);
    setenv("DTRAIN_MASTER", "10.1.2.3:4000", 1);
    assert_int_equal(dt_dist_env_detect(ctx, &e), DT_OK);
    assert_string_equal(e.launcher, "dtrain");
    assert_int_equal(e.rank, 5);
    assert_int_equal(e.world_size, 6);
    assert_string_equal(e.master_addr, "10.1.2.3");
    assert_int_equal(e.master_port, 4000);
    clear_env();   /* OpenMPI */
    setenv("OMPI_COMM_WORLD_RANK", "2", 1);
    setenv("OMPI_COMM_WORLD_SIZE", "3", 1);
    setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0", 1);
    setenv("DTRAIN_MASTER", "hostA:29600", 1);
    assert_int_equal(dt_dist_env_detect(ctx, &e), DT_OK);
    assert_string_equal(e.launcher, "openmpi");
    assert_int_equal(e.rank, 2);
    assert_int_equal(e.world_size, 3);
    assert_int_equal(e.local_rank, 0);
    assert_string_equal(e.master_addr, "hostA");
    clear_env();   /* Slurm */
    setenv("SLURM_PROCID", "7", 1);
    setenv("SLURM_NTASKS", "16", 1);
    setenv("SLURM_LOCALID", "3", 1);
    setenv("SLURM_NTASKS_PER_NODE", "4(x4)", 1);
    setenv("MASTER_ADDR", "n001", 1);
    assert_int_equal(dt_dist_env_detect(ctx, &e), DT_OK);
    assert_string_equal(e.launcher, "slurm");
    assert_int_equal(e.rank, 7);
    assert_int_equal(e.world_size, 16);
    assert_int_equal(e.local_rank, 3);
    assert_string_equal(e.master_addr, "n001");
    assert_int_equal(e.master_port, 29500);
    clear_env();
    dt_ctx_free(ctx);
}

static void expect_env_error(dt_ctx *ctx, const char *needle)
{
    dt_dist_env e;
    assert_int_equal(dt_dist_env_detect(ctx, &e), DT_EINVAL);
    if (!strstr(dt_last_error(ctx), needle))
        fail_msg("message '%s' does not name %s", dt_last_error(ctx), needle);
}

static void test_env_malformed(void **state)
{
    (void)state;
    dt_ctx *ctx = new_ctx();
    clear_env();
    setenv("RANK", "abc", 1);
    setenv("WORLD_SIZE", "2", 1);
    expect_env_error(ctx, "RANK");
    setenv("RANK", "2", 1);
    expect_env_error(ctx, "WORLD_SIZE=2");   /* rank not below world */
    unsetenv("WORLD_SIZE");
    setenv("RANK", "0", 1);
    expect_env_error(ctx, "WORLD_SIZE");     /* one without the other */
    clear_env();
    setenv("DTRAIN_RANK", "0", 1);
    setenv("DTRAIN_WORLD_SIZE", "1", 1);
    setenv("DTRAIN_MASTER", "nohostport", 1);
    expect_env_error(ctx, "DTRAIN_MASTER");
    setenv("DTRAIN_MASTER", "h:70000", 1);
    expect_env_error(ctx, "DTRAIN_MASTER");
    clear_env();
    setenv("MASTER_PORT", "0", 1);
    expect_env_error(ctx, "MASTER_PORT");
    clear_env();
    assert_int_equal(dt_dist_env_detect(NULL, NULL), DT_EINVAL);
    assert_int_equal(dt_dist_env_detect(ctx, NULL), DT_EINVAL);
    dt_ctx_free(ctx);
}

static void test_store_single(void **state)
{
    (void)state;
    clear_env();
    dt_ctx *ctx = new_ctx();
    dt_dist_env e = tr_env(0, 1, 0);
    dt_store *s = dt_store_new(ctx, &e, NULL);
    if (!s)
        fail_msg("%s", dt_last_error(ctx));
    assert_true(dt_store_port(s) > 0);
    assert_int_equal(dt_store_set(s, "k", "hello", 5), DT_OK);
    assert_int_equal(dt_store_set(s, "k", "world!", 6), DT_OK);   /* replaced */
    char buf[16] = {0};
    size_t len = 0;
    assert_int_equal(dt_store_get(s, "k", buf, sizeof buf, &len, 0), DT_OK);
    assert_int_equal(len, 6);
    assert_memory_equal(buf, "world!", 6);
    assert_int_equal(dt_store_get(s, "k", buf, 2, &len, 0), DT_OK);   /* short buffer */
    assert_int_equal(len, 6);
    assert_memory_equal(buf, "wo", 2);
    assert_int_equal(dt_store_set(s, "empty", NULL, 0), DT_OK);
    assert_int_equal(dt_store_get(s, "empty", buf, sizeof buf, &len, 0), DT_OK);
    assert_int_equal(len, 0);
    double t0 = dt_now();
    assert_int_equal(dt_store_get(s, "missing", buf, sizeof buf, &len, 200), DT_ETIMEDOUT);
    double dt = dt_now() - t0;
    assert_true(dt >= 0.18 && dt < 2.0);
    assert_non_null(strstr(dt_last_error(ctx), "missing"));
    assert_int_equal(dt_store_set(s, "", "x", 1), DT_EINVAL);
    assert_int_equal(dt_store_get(s, NULL, buf, 1, &len, 0), DT_EINVAL);
    dt_store_free(s);
    dt_ctx_free(ctx);
}

/* Child rank: connect, publish "addr/<rank>", read everyone's; exit code
 * 0 on success, 10 + step on failure.  Never returns. */
static void child_rank(int rank, int world, int port, const char *token)
{
    dt_ctx *ctx = dt_ctx_new(NULL);
    dt_dist_env e = tr_env(rank, world, port);
    dt_store_config cfg;
    dt_store_config_init(&cfg);
    cfg.token = token;
    cfg.timeout_ms = 5000;
    dt_store *s = ctx ? dt_store_new(ctx, &e, &cfg) : NULL;
    if (!s)
        _exit(strstr(dt_last_error(ctx), "job token") ? 3 : 10);
    char key[32], val[32], got[32];
    snprintf(key, sizeof key, "addr/%d", rank);
    snprintf(val, sizeof val, "endpoint-of-%d", rank);
    if (dt_store_set(s, key, val, strlen(val) + 1) != DT_OK)
        _exit(11);
    for (int r = 0; r < world; r++) {
        size_t len = 0;
        snprintf(key, sizeof key, "addr/%d", r);
        snprintf(val, sizeof val, "endpoint-of-%d", r);
        if (dt_store_get(s, key, got, sizeof got, &len, 5000) != DT_OK)
            _exit(12);
        if (len != strlen(val) + 1 || memcmp(got, val, len) != 0)
            _exit(13);
    }
    dt_store_free(s);
    dt_ctx_free(ctx);
    _exit(0);
}

static pid_t spawn_rank(int rank, int world, int port, const char *token)
{
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        alarm(20);   /* a hung child dies instead of hanging the suite */
        child_rank(rank, world, port, token);
    }
    return pid;
}

/* Wait for pid with a deadline; kill it if it overstays.  Returns the exit code. */
static int reap(pid_t pid, double seconds)
{
    double deadline = dt_now() + seconds;
    int status = 0;
    for (;;) {
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid)
            return WIFEXITED(status) ? WEXITSTATUS(status) : 100 + WTERMSIG(status);
        if (dt_now() > deadline) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            return -1;
        }
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

static void test_store_many_ranks(void **state)
{
    (void)state;
    clear_env();
    enum { WORLD = 5 };
    dt_ctx *ctx = new_ctx();
    dt_dist_env e = tr_env(0, WORLD, 0);
    dt_store_config cfg;
    dt_store_config_init(&cfg);
    cfg.token = "s3cret";
    dt_store *s = dt_store_new(ctx, &e, &cfg);
    if (!s)
        fail_msg("%s", dt_last_error(ctx));
    pid_t kids[WORLD];
    for (int r = 1; r < WORLD; r++)
        kids[r] = spawn_rank(r, WORLD, dt_store_port(s), "s3cret");
    assert_int_equal(dt_store_set(s, "addr/0", "endpoint-of-0", 14), DT_OK);
    for (int r = 1; r < WORLD; r++) {
        int code = reap(kids[r], 15.0);
        if (code != 0)
            fail_msg("rank %d exited with %d", r, code);
    }
    dt_store_free(s);
    dt_ctx_free(ctx);
}

static void test_store_token_refused(void **state)
{
    (void)state;
    clear_env();
    dt_ctx *ctx = new_ctx();
    dt_dist_env e = tr_env(0, 3, 0);
    dt_store_config cfg;
    dt_store_config_init(&cfg);
    cfg.token = "right-token";
    dt_store *s = dt_store_new(ctx, &e, &cfg);
    if (!s)
        fail_msg("%s", dt_last_error(ctx));
    /* in-process clients: wrong token, missing token, rank out of range */
    dt_ctx *c2 = new_ctx();
    dt_dist_env e1 = tr_env(1, 3, dt_store_port(s));
    dt_store_config bad;
    dt_store_config_init(&bad);
    bad.token = "wrong-token";
    assert_null(dt_store_new(c2, &e1, &bad));
    assert_int_equal(dt_last_status(c2), DT_EPEER);
    assert_non_null(strstr(dt_last_error(c2), "job token"));
    bad.token = "";
    assert_null(dt_store_new(c2, &e1, &bad));
    assert_non_null(strstr(dt_last_error(c2), "job token"));
    dt_dist_env e9 = tr_env(2, 9, dt_store_port(s));   /* claims a bigger job */
    bad.token = "right-token";
    dt_store *s9 = dt_store_new(c2, &e9, &bad);
    dt_store_free(s9);
    /* world 9 passes the client's check; rank 2 < 3 passes the server's */
    assert_non_null(s9);
    dt_dist_env e5 = tr_env(5, 9, dt_store_port(s));
    assert_null(dt_store_new(c2, &e5, &bad));
    assert_non_null(strstr(dt_last_error(c2), "rank out of range"));
    /* a forked child with the wrong token is refused too (exit 3) */
    assert_int_equal(reap(spawn_rank(1, 3, dt_store_port(s), "nope"), 15.0), 3);
    /* and the store still serves a good client */
    assert_int_equal(dt_store_set(s, "still", "ok", 2), DT_OK);
    dt_ctx_free(c2);
    dt_store_free(s);
    dt_ctx_free(ctx);
}

static int raw_connect(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    return fd;
}

/* garbage, an oversized frame and a request before hello are each answered
 * and disconnected; the server keeps serving */
static void test_store_malformed_clients(void **state)
{
    (void)state;
    clear_env();
    dt_ctx *ctx = new_ctx();
    dt_dist_env e = tr_env(0, 2, 0);
    dt_store *s = dt_store_new(ctx, &e, NULL);
    if (!s)
        fail_msg("%s", dt_last_error(ctx));
    const unsigned char garbage[] = {5, 0, 0, 0, 0x42, 1, 2, 3, 4};
    const unsigned char huge[] = {0xff, 0xff, 0xff, 0x7f, 1};
    const unsigned char early_get[] = {4, 0, 0, 0, 3, 1, 0, 'k'};
    const unsigned char *msgs[] = {garbage, huge, early_get};
    size_t lens[] = {sizeof garbage, sizeof huge, sizeof early_get};
    for (int i = 0; i < 3; i++) {
        int fd = raw_connect(dt_store_port(s));
        assert_int_equal(send(fd, msgs[i], lens[i], MSG_NOSIGNAL), (ssize_t)lens[i]);
        char buf[256];
        struct timeval tv = {5, 0};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        ssize_t total = 0, k;
        while ((k = recv(fd, buf, sizeof buf, 0)) > 0)   /* until the server closes */
            total += k;
        assert_int_equal(k, 0);   /* closed, not timed out */
        assert_true(total >= 10); /* an error reply came first */
        close(fd);
    }
    assert_int_equal(dt_store_set(s, "after", "fine", 4), DT_OK);
    dt_store_free(s);
    dt_ctx_free(ctx);
}

static void test_store_unreachable(void **state)
{
    (void)state;
    clear_env();
    int port = tr_free_port();   /* a port nobody listens on */
    dt_ctx *ctx = new_ctx();
    dt_dist_env e = tr_env(1, 2, port);
    dt_store_config cfg;
    dt_store_config_init(&cfg);
    cfg.timeout_ms = 300;
    double t0 = dt_now();
    assert_null(dt_store_new(ctx, &e, &cfg));
    double dt = dt_now() - t0;
    assert_int_equal(dt_last_status(ctx), DT_ETIMEDOUT);
    assert_non_null(strstr(dt_last_error(ctx), "127.0.0.1"));
    assert_true(dt >= 0.25 && dt < 3.0);
    dt_ctx_free(ctx);
}

/* A client that sends requests but never reads the replies must not stall
 * the server for anyone else: its replies queue (and it is dropped past the
 * queue's limit) while another rank's calls are answered at once. */
static void test_store_slow_reader(void **state)
{
    (void)state;
    clear_env();
    dt_ctx *ctx = new_ctx();
    dt_dist_env e = tr_env(0, 3, 0);
    dt_store *s = dt_store_new(ctx, &e, NULL);
    if (!s)
        fail_msg("%s", dt_last_error(ctx));
    size_t big = (size_t)1 << 20;
    unsigned char *val = calloc(1, big);
    assert_non_null(val);
    assert_int_equal(dt_store_set(s, "big", val, big), DT_OK);
    int fd = raw_connect(dt_store_port(s));
    int small = 4096;   /* a small receive buffer fills at once */
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    /* hello as rank 2 (no token in this test), then 32 GETs of 1 MiB */
    const unsigned char hello[] = {11, 0, 0, 0, 1, 0x54, 0x44, 1, 0, 2, 0, 0, 0, 0, 0};
    const unsigned char get[] = {10, 0, 0, 0, 3, 3, 0, 'b', 'i', 'g', 0, 0, 0, 0};   /* wait 0 ms */
    assert_int_equal(send(fd, hello, sizeof hello, MSG_NOSIGNAL), (ssize_t)sizeof hello);
    for (int i = 0; i < 32; i++)
        assert_int_equal(send(fd, get, sizeof get, MSG_NOSIGNAL), (ssize_t)sizeof get);
    /* meanwhile another rank's requests are answered promptly */
    dt_ctx *c1 = new_ctx();
    dt_dist_env e1 = tr_env(1, 3, dt_store_port(s));
    double t_open = dt_now();
    dt_store *s1 = dt_store_new(c1, &e1, NULL);
    if (!s1)
        fail_msg("%s", dt_last_error(c1));
    double worst = dt_now() - t_open;
    for (int i = 0; i < 20; i++) {
        double t0 = dt_now();
        char v[8];
        size_t len = 0;
        assert_int_equal(dt_store_set(s1, "k", "v", 1), DT_OK);
        assert_int_equal(dt_store_get(s1, "k", v, sizeof v, &len, 0), DT_OK);
        double took = dt_now() - t0;
        worst = took > worst ? took : worst;
    }
    if (worst > 1.0)
        fail_msg("another rank waited %.2f s behind a client that does not read", worst);
    close(fd);
    dt_store_free(s1);
    dt_ctx_free(c1);
    dt_store_free(s);
    dt_ctx_free(ctx);
    free(val);
}

/* src/store.c's internal bound on one call's patience (extern in the
 * development build the tests link; src/dist.h would clash with names
 * here). */
void store_limit(dt_store *s, double until);

/* A store answer that comes after its call gave up is skipped by the next
 * call, never taken for that call's answer: rank 0 (a child holding
 * "a" = "AAAA" and "b" = "BBBB") is stopped while rank 1 asks for "a",
 * which times out; resumed, it answers "a" late; rank 1's next call, for
 * "b", must get "BBBB". */
static void store_holder(int port)
{
    dt_ctx *ctx = dt_ctx_new(NULL);
    dt_dist_env e = tr_env(0, 2, port);
    dt_store *s = ctx ? dt_store_new(ctx, &e, NULL) : NULL;
    char buf[8];
    size_t len = 0;
    if (!s || dt_store_set(s, "a", "AAAA", 4) != DT_OK || dt_store_set(s, "b", "BBBB", 4) != DT_OK)
        _exit(10);
    int code = dt_store_get(s, "done", buf, sizeof buf, &len, 15000) == DT_OK ? 0 : 11;
    dt_store_free(s);
    dt_ctx_free(ctx);
    _exit(code);
}

static void test_store_late_answer_skipped(void **state)
{
    (void)state;
    clear_env();
    int port = tr_free_port();
    fflush(NULL);
    pid_t holder = fork();
    assert_true(holder >= 0);
    if (holder == 0) {
        alarm(20);
        store_holder(port);
    }
    dt_ctx *ctx = new_ctx();
    dt_dist_env e = tr_env(1, 2, port);
    dt_store_config cfg;
    dt_store_config_init(&cfg);
    cfg.timeout_ms = 5000;
    dt_store *s = dt_store_new(ctx, &e, &cfg);
    if (!s)
        fail_msg("%s", dt_last_error(ctx));
    char buf[8] = {0};
    size_t len = 0;
    tu_check_status(ctx, dt_store_get(s, "b", buf, sizeof buf, &len, 5000), "b, awake");
    assert_memory_equal(buf, "BBBB", 4);
    store_limit(s, dt_now() + 0.3);   /* this call's patience: 300 ms (src/store.c) */
    kill(holder, SIGSTOP);
    int wst = 0;   /* stopped for sure (kill only sends it): else it may answer at once */
    int stopped = waitpid(holder, &wst, WUNTRACED) == holder && WIFSTOPPED(wst);
    dt_status late = stopped ? dt_store_get(s, "a", buf, sizeof buf, &len, 0) : DT_OK;
    kill(holder, SIGCONT);   /* (before any assertion: a failed one must not leave it stopped) */
    assert_true(stopped);
    assert_int_equal(late, DT_ETIMEDOUT);
    usleep(200 * 1000);   /* its answer to "a" arrives now, late */
    store_limit(s, 0);
    memset(buf, 0, sizeof buf);
    tu_check_status(ctx, dt_store_get(s, "b", buf, sizeof buf, &len, 5000), "b, after the late answer");
    if (len != 4 || memcmp(buf, "BBBB", 4) != 0)
        fail_msg("the call for b got '%.*s' (%zu bytes): the late answer to a", (int)len, buf, len);
    tu_check_status(ctx, dt_store_set(s, "done", "1", 1), "done");
    assert_int_equal(reap(holder, 10.0), 0);
    dt_store_free(s);
    dt_ctx_free(ctx);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_store_slow_reader),
    cmocka_unit_test(test_env_default),
    cmocka_unit_test(test_env_launchers),
    cmocka_unit_test(test_env_malformed),
    cmocka_unit_test(test_store_single),
    cmocka_unit_test(test_store_many_ranks),
    cmocka_unit_test(test_store_token_refused),
    cmocka_unit_test(test_store_malformed_clients),
    cmocka_unit_test(test_store_unreachable),
    cmocka_unit_test(test_store_late_answer_skipped),
};

DT_TEST_GROUP(core_dist, tests)
