/*
 * tests/test_core_launch.c - dt_spawn / dt_launch: the ranks' environment,
 * prefixed output, and a failed rank stopping the job with its name.
 */
#include "test_util.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static dt_ctx *new_ctx(void)
{
    dt_ctx *ctx = dt_ctx_new(NULL);
    assert_non_null(ctx);
    return ctx;
}

/* Run fn with stdout going to a temp file; returns the captured text (malloc). */
static char *capture_stdout(dt_status (*fn)(dt_ctx *, void *), dt_ctx *ctx, void *arg,
                            dt_status *st)
{
    char path[] = "/tmp/dtrain_launch_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    fflush(stdout);
    int saved = dup(STDOUT_FILENO);
    dup2(fd, STDOUT_FILENO);
    *st = fn(ctx, arg);
    fflush(stdout);
    dup2(saved, STDOUT_FILENO);
    close(saved);
    off_t len = lseek(fd, 0, SEEK_END);
    char *text = calloc(1, (size_t)len + 1);
    pread(fd, text, (size_t)len, 0);
    close(fd);
    unlink(path);
    return text;
}

static dt_status spawn_three(dt_ctx *ctx, void *arg)
{
    (void)arg;
    dt_spawn_config cfg;
    dt_spawn_config_init(&cfg);
    cfg.nranks = 3;
    cfg.transport = "tcp";
    int rank = -2;
    dt_status st = dt_spawn(ctx, &cfg, &rank);
    if (rank >= 0) {   /* a worker: check its environment, say hello, leave */
        const char *r = getenv("DTRAIN_RANK"), *w = getenv("DTRAIN_WORLD_SIZE");
        const char *m = getenv("DTRAIN_MASTER"), *t = getenv("DTRAIN_JOB_TOKEN");
        const char *tp = getenv("DTRAIN_TRANSPORT");
        int ok = st == DT_OK && r && atoi(r) == rank && w && !strcmp(w, "3") && m &&
                 !strncmp(m, "127.0.0.1:", 10) && t && strlen(t) >= 16 && tp && !strcmp(tp, "tcp");
        printf("hello from %d %s\n", rank, ok ? "env-ok" : "env-bad");
        printf("partial line without newline");
        fflush(stdout);
        _exit(ok ? 0 : 1);
    }
    assert_int_equal(rank, -1);
    return st;
}

static void test_spawn_env_and_prefix(void **state)
{
    (void)state;
    dt_ctx *ctx = new_ctx();
    dt_status st;
    char *out = capture_stdout(spawn_three, ctx, NULL, &st);
    if (st != DT_OK)
        fail_msg("spawn failed: %s\noutput:\n%s", dt_last_error(ctx), out);
    for (int r = 0; r < 3; r++) {
        char want[64];
        snprintf(want, sizeof want, "[%d] hello from %d env-ok\n", r, r);
        if (!strstr(out, want))
            fail_msg("missing '%s' in:\n%s", want, out);
        snprintf(want, sizeof want, "[%d] partial line without newline\n", r);
        if (!strstr(out, want))
            fail_msg("missing '%s' in:\n%s", want, out);
    }
    free(out);
    dt_ctx_free(ctx);
}

static void test_launch_failure_stops_others(void **state)
{
    (void)state;
    dt_ctx *ctx = new_ctx();
    dt_spawn_config cfg;
    dt_spawn_config_init(&cfg);
    cfg.nranks = 3;
    cfg.grace_ms = 500;
    cfg.prefix_output = 0;
    /* rank 1 fails at once; ranks 0 and 2 would sleep for 30 s */
    char *const argv[] = {"/bin/sh", "-c", "[ \"$DTRAIN_RANK\" = 1 ] && exit 7; exec sleep 30", NULL};
    int failed = -2;
    double t0 = dt_now();
    dt_status st = dt_launch(ctx, &cfg, argv, &failed);
    double took = dt_now() - t0;
    assert_int_equal(st, DT_EPEER);
    assert_int_equal(failed, 1);
    assert_non_null(strstr(dt_last_error(ctx), "rank 1 exited with code 7"));
    assert_true(took < 10.0);
    /* a rank killed by a signal is named with the signal, and the launcher
     * removes the shared-memory files it could not (made here the way
     * backends/fabric.c names its shm regions and a joining host segment
     * names itself) */
    char pidfile[] = "/tmp/dtrain_killed_XXXXXX";
    int pfd = mkstemp(pidfile);
    assert_true(pfd >= 0);
    close(pfd);
    char script[256];
    snprintf(script, sizeof script,
             "[ \"$DTRAIN_RANK\" = 2 ] && { echo $$ > %s; : > /dev/shm/dtrain_$$_1; "
             ": > /dev/shm/dtrain-$$-1; kill -9 $$; }; exec sleep 30", pidfile);
    char *const killer[] = {"/bin/sh", "-c", script, NULL};
    st = dt_launch(ctx, &cfg, killer, &failed);
    assert_int_equal(st, DT_EPEER);
    assert_int_equal(failed, 2);
    assert_non_null(strstr(dt_last_error(ctx), "rank 2 was killed by signal 9"));
    FILE *pf = fopen(pidfile, "r");
    int killed_pid = 0;
    assert_non_null(pf);
    assert_int_equal(fscanf(pf, "%d", &killed_pid), 1);
    fclose(pf);
    unlink(pidfile);
    char left[64];
    struct stat sb;
    snprintf(left, sizeof left, "/dev/shm/dtrain_%d_1", killed_pid);
    assert_int_not_equal(stat(left, &sb), 0);
    snprintf(left, sizeof left, "/dev/shm/dtrain-%d-1", killed_pid);
    assert_int_not_equal(stat(left, &sb), 0);
    /* all succeed */
    char *const good[] = {"/bin/sh", "-c", "exit 0", NULL};
    assert_int_equal(dt_launch(ctx, &cfg, good, &failed), DT_OK);
    assert_int_equal(failed, -1);
    /* a program that does not exist */
    char *const missing[] = {"/nonexistent/prog", NULL};
    assert_int_equal(dt_launch(ctx, &cfg, missing, &failed), DT_EIO);
    assert_non_null(strstr(dt_last_error(ctx), "cannot run /nonexistent/prog: No such file"));
    assert_int_equal(failed, 0);
    /* bad arguments */
    cfg.nranks = 0;
    assert_int_equal(dt_launch(ctx, &cfg, good, &failed), DT_EINVAL);
    assert_int_equal(dt_launch(ctx, &cfg, NULL, &failed), DT_EINVAL);
    dt_ctx_free(ctx);
}

/* Whether pid is gone within `wait_s` seconds (reparented children are
 * reaped by init, so kill(pid, 0) ends with ESRCH). */
static int gone_within(int pid, double wait_s)
{
    double t0 = dt_now();
    while (dt_now() - t0 < wait_s) {
        if (kill(pid, 0) != 0 && errno == ESRCH)
            return 1;
        usleep(20000);
    }
    return 0;
}

static int read_pid(const char *path)
{
    FILE *f = fopen(path, "r");
    int pid = 0;
    if (f && fscanf(f, "%d", &pid) != 1)
        pid = 0;
    if (f)
        fclose(f);
    return pid;
}

/* Ranks that are shell wrappers: their children (which hold the output
 * pipes) stop with them, and the launcher returns at once. */
static void test_launch_stops_whole_ranks(void **state)
{
    (void)state;
    dt_ctx *ctx = new_ctx();
    dt_spawn_config cfg;
    dt_spawn_config_init(&cfg);
    cfg.nranks = 3;
    cfg.grace_ms = 500;
    cfg.prefix_output = 1;   /* pipes: a leftover child would keep them open */
    char dir[64], script[512];
    tu_tmpdir(dir, sizeof dir);
    /* every rank starts a child that would sleep 30 s; rank 1 then fails */
    snprintf(script, sizeof script,
             "sleep 30 & echo $! > %s/child.$DTRAIN_RANK; "
             "[ \"$DTRAIN_RANK\" = 1 ] && { sleep 0.3; exit 5; }; wait", dir);
    char *const argv[] = {"/bin/sh", "-c", script, NULL};
    int failed = -2;
    double t0 = dt_now();
    dt_status st = dt_launch(ctx, &cfg, argv, &failed);
    double took = dt_now() - t0;
    assert_int_equal(st, DT_EPEER);
    assert_int_equal(failed, 1);
    print_message("launch with shell wrappers: rank 1 failed, returned after %.2f s\n", took);
    assert_true(took < 3.0);   /* not the children's 30 s */
    for (int r = 0; r < 3; r++) {
        char path[128];
        snprintf(path, sizeof path, "%s/child.%d", dir, r);
        int pid = read_pid(path);
        assert_true(pid > 0);
        if (!gone_within(pid, 2.0)) {
            kill(pid, SIGKILL);
            fail_msg("rank %d's child %d outlived the job", r, pid);
        }
    }
    /* all ranks succeed but each leaves a child holding its output pipe:
     * the drain is bounded, the job's result is success */
    snprintf(script, sizeof script, "sleep 30 & echo $! > %s/bg.$DTRAIN_RANK; exit 0", dir);
    char *const bg[] = {"/bin/sh", "-c", script, NULL};
    t0 = dt_now();
    assert_int_equal(dt_launch(ctx, &cfg, bg, &failed), DT_OK);
    took = dt_now() - t0;
    print_message("launch, children left holding the pipes: returned after %.2f s\n", took);
    assert_true(took < 6.0);
    for (int r = 0; r < 3; r++) {   /* (not the launcher's to stop: a success) */
        char path[128];
        snprintf(path, sizeof path, "%s/bg.%d", dir, r);
        int pid = read_pid(path);
        if (pid > 0)
            kill(pid, SIGKILL);
    }
    tu_rmdir(dir);
    dt_ctx_free(ctx);
}

/* The launcher's notes, one per line. */
static void keep_notes(void *user, const char *msg)
{
    char *buf = user;
    size_t l = strlen(buf);
    snprintf(buf + l, 4096 - l, "%s\n", msg);
}

static int count_of(const char *hay, const char *needle)
{
    int n = 0;
    for (const char *p = strstr(hay, needle); p; p = strstr(p + 1, needle))
        n++;
    return n;
}

/* max_restarts: a rank that fails on the first run only is restarted with
 * the whole job (DTRAIN_RESTART counts the runs); one that always fails ends
 * the job after the restarts, and each restart is told. */
static void test_launch_restarts(void **state)
{
    (void)state;
    dt_ctx *ctx = new_ctx();
    char notes[4096] = "";
    dt_ctx_set_log(ctx, keep_notes, notes);
    dt_spawn_config cfg;
    dt_spawn_config_init(&cfg);
    cfg.nranks = 3;
    cfg.grace_ms = 500;
    cfg.prefix_output = 0;
    cfg.max_restarts = 2;
    /* first run: rank 1 fails, the others would sleep (they are stopped);
     * second run (DTRAIN_RESTART=1): all succeed */
    char *const once[] = {"/bin/sh", "-c",
                          "if [ \"$DTRAIN_RESTART\" = 0 ]; then [ \"$DTRAIN_RANK\" = 1 ] && "
                          "{ sleep 0.2; exit 3; }; exec sleep 30; fi; "
                          "[ \"$DTRAIN_RESTART\" = 1 ] || exit 4; exit 0", NULL};
    int failed = -2;
    assert_int_equal(dt_launch(ctx, &cfg, once, &failed), DT_OK);
    assert_int_equal(failed, -1);
    if (count_of(notes, "restarting the job (restart 1 of 2)") != 1 ||
        !strstr(notes, "rank 1 exited with code 3") || count_of(notes, "restart 2") != 0)
        fail_msg("notes:\n%s", notes);
    notes[0] = '\0';
    char *const always[] = {"/bin/sh", "-c", "[ \"$DTRAIN_RANK\" = 2 ] && exit 5; exec sleep 30",
                            NULL};
    double t0 = dt_now();
    assert_int_equal(dt_launch(ctx, &cfg, always, &failed), DT_EPEER);
    assert_int_equal(failed, 2);
    assert_true(dt_now() - t0 < 10.0);
    assert_non_null(strstr(dt_last_error(ctx), "rank 2 exited with code 5"));
    if (count_of(notes, "restarting the job") != 2) fail_msg("notes:\n%s", notes);
    /* not restarted: a program that cannot run; bad settings */
    notes[0] = '\0';
    char *const missing[] = {"/nonexistent/prog", NULL};
    assert_int_equal(dt_launch(ctx, &cfg, missing, &failed), DT_EIO);
    assert_int_equal(count_of(notes, "restarting"), 0);
    cfg.max_restarts = -1;
    assert_int_equal(dt_launch(ctx, &cfg, once, &failed), DT_EINVAL);
    dt_ctx_free(ctx);
}

/* the lowest CPU in a set, -1 if none */
static int first_cpu(const cpu_set_t *s)
{
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, s))
            return c;
    return -1;
}

static dt_status spawn_two_bound(dt_ctx *ctx, void *arg)
{
    (void)arg;
    dt_spawn_config cfg;
    dt_spawn_config_init(&cfg);   /* bind_cpus is on by default */
    cfg.nranks = 2;
    int rank = -2;
    dt_status st = dt_spawn(ctx, &cfg, &rank);
    if (rank >= 0) {
        cpu_set_t s;
        sched_getaffinity(0, sizeof s, &s);
        printf("cpus %d first %d\n", CPU_COUNT(&s), first_cpu(&s));
        fflush(stdout);
        _exit(0);
    }
    return st;
}

/* With m CPUs allowed and 2 ranks, rank r gets the r-th half of them. */
static void test_spawn_binds_cpus(void **state)
{
    (void)state;
    cpu_set_t all;
    assert_int_equal(sched_getaffinity(0, sizeof all, &all), 0);
    int m = CPU_COUNT(&all);
    dt_ctx *ctx = new_ctx();
    dt_status st;
    char *out = capture_stdout(spawn_two_bound, ctx, NULL, &st);
    assert_int_equal(st, DT_OK);
    for (int r = 0; r < 2; r++) {
        char want[64];
        int share = m >= 2 ? m / 2 : m, seen = 0, first = -1;
        for (int c = 0; c < CPU_SETSIZE && first < 0; c++)
            if (CPU_ISSET(c, &all) && seen++ == (m >= 2 ? r * share : 0))
                first = c;
        snprintf(want, sizeof want, "[%d] cpus %d first %d\n", r, share, first);
        if (!strstr(out, want))
            fail_msg("missing '%s' in:\n%s", want, out);
    }
    free(out);
    dt_ctx_free(ctx);
}

/* Debian's libfabric links libinfinipath, whose constructor installs
 * handlers that call exit() inside SIGTERM (exit handlers at any
 * instruction) and deadlock on a crash during exit.  backends/fabric.c puts
 * the default actions back as it loads: no handler may live in a PSM
 * library, and a process sent SIGTERM dies of it instead of exiting 1. */
static void test_no_psm_signal_handlers(void **state)
{
    (void)state;
    const int sigs[] = {SIGINT, SIGTERM, SIGSEGV, SIGBUS, SIGILL, SIGABRT};
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) {
        struct sigaction sa;
        assert_int_equal(sigaction(sigs[i], NULL, &sa), 0);
        if (sa.sa_handler == SIG_DFL || sa.sa_handler == SIG_IGN)
            continue;
        Dl_info di;
        void *h = (sa.sa_flags & SA_SIGINFO) ? (void *)sa.sa_sigaction : (void *)sa.sa_handler;
        if (dladdr(h, &di) && di.dli_fname &&
            (strstr(di.dli_fname, "infinipath") || strstr(di.dli_fname, "libpsm")))
            fail_msg("signal %d is handled by %s", sigs[i], di.dli_fname);
    }
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0)
        for (;;)
            pause();
    assert_int_equal(kill(pid, SIGTERM), 0);
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    if (!WIFSIGNALED(status) || WTERMSIG(status) != SIGTERM)
        fail_msg("SIGTERM: the process %s %d", WIFEXITED(status) ? "exited with" : "died of signal",
                 WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
}

/* --- pre-empted ranks (dt_preempt_enable's DT_EXIT_PREEMPTED) -------------
 * Ranks that exit 75 have saved their part: the job is pre-empted (not
 * failed), restarted with max_restarts, and a rank that stays past the
 * grace period is killed and named.  A signal to the supervisor is passed
 * on; its ranks' 75 then means no restart. */
/* The supervisor's stop, sent once every rank has set its trap (each
 * touches DIR/ready.RANK after its `trap`): a fixed delay was too short for
 * /bin/sh to start under load, and the untrapped rank died of the signal. */
typedef struct term_when_ready {
    pthread_t main;
    const char *dir;
    int nranks;
    double sent;   /* dt_now() when the signal went */
} term_when_ready;

static void *term_main_soon(void *arg)
{
    term_when_ready *t = arg;
    for (int waited = 0; waited < 30000; waited += 10) {
        int ready = 0;
        for (int r = 0; r < t->nranks; r++) {
            char path[512];
            snprintf(path, sizeof path, "%s/ready.%d", t->dir, r);
            ready += access(path, F_OK) == 0;
        }
        if (ready == t->nranks)
            break;
        usleep(10 * 1000);
    }
    usleep(100 * 1000);   /* (the ranks are in their `wait`) */
    t->sent = dt_now();
    pthread_kill(t->main, SIGTERM);   /* read by dt_launch's signalfd */
    return NULL;
}

static void test_launch_preempted(void **state)
{
    (void)state;
    dt_ctx *ctx = new_ctx();
    dt_spawn_config cfg;
    dt_spawn_config_init(&cfg);
    cfg.nranks = 3;
    cfg.grace_ms = 500;
    int failed = -2;
    char *const all75[] = {"/bin/sh", "-c", "sleep 0.$DTRAIN_RANK; exit 75", NULL};
    assert_int_equal(dt_launch(ctx, &cfg, all75, &failed), DT_EPREEMPTED);
    assert_int_equal(failed, -1);
    assert_non_null(strstr(dt_last_error(ctx), "pre-empted: 3 of 3 ranks"));
    /* restarted (DTRAIN_RESTART=1), as after a failure, and then done */
    cfg.max_restarts = 1;
    char *const once[] = {"/bin/sh", "-c", "[ \"${DTRAIN_RESTART:-0}\" != 0 ] || exit 75", NULL};
    assert_int_equal(dt_launch(ctx, &cfg, once, &failed), DT_OK);
    cfg.max_restarts = 0;
    /* rank 1 ignores the stop: killed after the grace period, and named */
    char *const stuck[] = {"/bin/sh", "-c",
                           "if [ $DTRAIN_RANK = 1 ]; then trap '' TERM; sleep 30; fi; exit 75",
                           NULL};
    double t0 = dt_now();
    dt_status st = dt_launch(ctx, &cfg, stuck, &failed);
    double took = dt_now() - t0;
    print_message("a rank past the grace period: %s (%.2f s)\n", dt_last_error(ctx), took);
    assert_int_equal(st, DT_EPEER);
    assert_int_equal(failed, 1);
    assert_non_null(strstr(dt_last_error(ctx), "rank 1 did not exit within the 500 ms grace"));
    assert_true(took >= 0.45 && took < 4.0);
    /* the supervisor is signalled: passed on; the ranks' 75 ends the job, no
     * restart (the scheduler's stop), and the rank that ignored it is named */
    cfg.max_restarts = 2;
    char dir[64];
    tu_tmpdir(dir, sizeof dir);
    setenv("READY_DIR", dir, 1);
    char *const trap75[] = {"/bin/sh", "-c",
                            "if [ $DTRAIN_RANK = 2 ]; then trap '' TERM; touch $READY_DIR/ready.2; "
                            "sleep 30; exit 0; fi; "
                            "trap 'exit 75' TERM; touch $READY_DIR/ready.$DTRAIN_RANK; "
                            "sleep 30 & wait; exit 1", NULL};
    term_when_ready when = {pthread_self(), dir, 3, 0};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, term_main_soon, &when), 0);
    st = dt_launch(ctx, &cfg, trap75, &failed);
    pthread_join(th, NULL);
    assert_int_equal(st, DT_EPEER);
    assert_int_equal(failed, 2);
    assert_non_null(strstr(dt_last_error(ctx), "rank 2 did not exit within the 500 ms grace period "
                                                "after the job agreed to stop"));
    char *const trap75all[] = {"/bin/sh", "-c", "trap 'exit 75' TERM; touch $READY_DIR/ready.$DTRAIN_RANK; "
                               "sleep 30 & wait; exit 1", NULL};
    tu_rmdir(dir);
    tu_tmpdir(dir, sizeof dir);
    setenv("READY_DIR", dir, 1);
    assert_int_equal(pthread_create(&th, NULL, term_main_soon, &when), 0);
    st = dt_launch(ctx, &cfg, trap75all, &failed);
    took = dt_now();
    pthread_join(th, NULL);
    assert_int_equal(st, DT_EPREEMPTED);   /* not restarted: it returned at once */
    assert_true(took - when.sent < 3.0);
    tu_rmdir(dir);
    unsetenv("READY_DIR");
    dt_ctx_free(ctx);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_no_psm_signal_handlers),
    cmocka_unit_test(test_spawn_binds_cpus),
    cmocka_unit_test(test_spawn_env_and_prefix),
    cmocka_unit_test(test_launch_failure_stops_others),
    cmocka_unit_test(test_launch_stops_whole_ranks),
    cmocka_unit_test(test_launch_restarts),
    cmocka_unit_test(test_launch_preempted),
};

DT_TEST_GROUP(core_launch, tests)
