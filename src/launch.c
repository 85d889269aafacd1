#include "dist.h"

/* ===========================================================================
 * Launching ranks on one host
 *
 * The supervisor forks the ranks with their stdout and stderr on pipes,
 * then loops on poll(): copy complete lines out with a "[rank] " prefix,
 * reap exited ranks, forward SIGINT/SIGTERM (read from a signalfd while
 * those signals are blocked, so no handler and no global state), and after
 * the first failure terminate the others, then kill them after grace_ms.
 *
 * Each rank leads its own process group, and signals go to the group, so a
 * rank that is a shell wrapper stops with its children (whose open pipes
 * would otherwise keep the drain waiting).  Once every rank has exited the
 * drain is bounded (DT_SPAWN_DRAIN_S).
 * ======================================================================== */

/* The launcher's own types: nothing outside this file sees them. */

#define DT_SPAWN_LINE 4096

typedef struct spawn_stream {
    int fd;                    /* read end, -1 once closed */
    int out;                   /* 1 or 2 */
    char buf[DT_SPAWN_LINE];
    size_t have;
} spawn_stream;

typedef struct spawn_rank {
    pid_t pid;
    int exited, status;
    int killed_late;           /* still running at the grace period's end: SIGKILLed */
    spawn_stream s[2];
} spawn_rank;

#define DT_SPAWN_MAX_RANKS 1024
#define DT_SPAWN_DRAIN_S 2.0   /* output still read after the last rank exited */

void dt_spawn_config_init(dt_spawn_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->struct_size = sizeof *cfg;
    cfg->nranks = 1;
    cfg->prefix_output = 1;
    cfg->bind_cpus = 1;
}

/* Rank `rank` of `nranks` keeps its share of the CPUs it may use.  Why:
 * unbound, the scheduler's wake-up affinity tends to stack two ranks that
 * wake each other on one CPU, and a host-segment allreduce then runs 3-4x
 * slower for as long as they stay there (tests/bench/allreduce.sh). */
static void bind_rank(int rank, int nranks)
{
    cpu_set_t all, mine;
    if (sched_getaffinity(0, sizeof all, &all) != 0)
        return;
    int m = CPU_COUNT(&all);
    if (m < nranks)
        return;
    int share = m / nranks, seen = 0;
    CPU_ZERO(&mine);
    for (int cpu = 0; cpu < CPU_SETSIZE && seen < (rank + 1) * share; cpu++) {
        if (!CPU_ISSET(cpu, &all))
            continue;
        if (seen >= rank * share)
            CPU_SET(cpu, &mine);
        seen++;
    }
    sched_setaffinity(0, sizeof mine, &mine);
}

static int free_local_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t sl = sizeof sa;
    int port = -1;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0 &&
        getsockname(fd, (struct sockaddr *)&sa, &sl) == 0)
        port = ntohs(sa.sin_port);
    if (fd >= 0)
        close(fd);
    return port;
}

static void random_token(char *out, size_t cap)
{
    unsigned char r[16] = {0};
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0 || read(fd, r, sizeof r) != (ssize_t)sizeof r) {
        uint64_t s = (uint64_t)getpid() ^ (uint64_t)(dt_now() * 1e9);
        for (size_t i = 0; i < sizeof r; i++)
            r[i] = (unsigned char)param_splitmix64(&s);
    }
    if (fd >= 0)
        close(fd);
    for (size_t i = 0; i < sizeof r && 2 * i + 2 < cap; i++)
        snprintf(out + 2 * i, 3, "%02x", r[i]);
}

/* A rank killed by a signal cannot remove its shared-memory files: its
 * shm endpoints' regions ("dtrain_<pid>_<...>", named in backends/fabric.c)
 * and, if it died while joining, a host segment ("dtrain-<pid>-<...>").
 * Its launcher does. */
static void remove_shm_of(pid_t pid)
{
    DIR *d = opendir("/dev/shm");
    if (!d)
        return;
    char fab[40], seg[40], path[300];
    int nf = snprintf(fab, sizeof fab, "dtrain_%d_", (int)pid);
    int ns = snprintf(seg, sizeof seg, "dtrain-%d-", (int)pid);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, fab, (size_t)nf) == 0 || strncmp(e->d_name, seg, (size_t)ns) == 0) {
            snprintf(path, sizeof path, "/dev/shm/%.250s", e->d_name);
            unlink(path);
        }
    }
    closedir(d);
}

/* In a freshly forked rank: its environment, its output on the pipes. */
static void rank_setup(const dt_spawn_config *cfg, int rank, int port, const char *token,
                       int attempt, int out_fd, int err_fd)
{
    char v[64];
    snprintf(v, sizeof v, "%d", attempt);
    setenv("DTRAIN_RESTART", v, 1);   /* 0, then 1, 2, ... after each restart */
    snprintf(v, sizeof v, "%d", rank);
    setenv("DTRAIN_RANK", v, 1);
    setenv("DTRAIN_LOCAL_RANK", v, 1);
    snprintf(v, sizeof v, "%d", cfg->nranks);
    setenv("DTRAIN_WORLD_SIZE", v, 1);
    setenv("DTRAIN_LOCAL_WORLD_SIZE", v, 1);
    snprintf(v, sizeof v, "127.0.0.1:%d", port);
    setenv("DTRAIN_MASTER", v, 1);
    setenv("DTRAIN_JOB_TOKEN", token, 1);
    if (cfg->transport)
        setenv("DTRAIN_TRANSPORT", cfg->transport, 1);
    /* keeps the PSM libraries under libfabric from installing signal
     * handlers that end the process from inside a signal (backends/fabric.c
     * says more) */
    setenv("IPATH_NO_BACKTRACE", "1", 0);
    setenv("HFI_NO_BACKTRACE", "1", 0);
    if (cfg->bind_cpus)
        bind_rank(rank, cfg->nranks);
    if (out_fd >= 0) {
        dup2(out_fd, STDOUT_FILENO);
        dup2(err_fd, STDERR_FILENO);
        close(out_fd);
        close(err_fd);
    }
}

static void write_all_fd(int fd, const char *p, size_t n)
{
    while (n > 0) {
        ssize_t k = write(fd, p, n);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return;
        p += k;
        n -= (size_t)k;
    }
}

/* Copy complete lines (or a full buffer, or the tail at EOF) with a prefix. */
static void stream_flush(spawn_stream *st, int rank, int at_eof)
{
    char prefix[24];
    int pl = snprintf(prefix, sizeof prefix, "[%d] ", rank);
    size_t start = 0;
    for (size_t i = 0; i < st->have; i++) {
        if (st->buf[i] == '\n') {
            write_all_fd(st->out, prefix, (size_t)pl);
            write_all_fd(st->out, st->buf + start, i + 1 - start);
            start = i + 1;
        }
    }
    if (start < st->have && (at_eof || (start == 0 && st->have == sizeof st->buf))) {
        write_all_fd(st->out, prefix, (size_t)pl);
        write_all_fd(st->out, st->buf + start, st->have - start);
        write_all_fd(st->out, "\n", 1);
        start = st->have;
    }
    memmove(st->buf, st->buf + start, st->have - start);
    st->have -= start;
}

static void stream_read(spawn_stream *st, int rank)
{
    ssize_t k = read(st->fd, st->buf + st->have, sizeof st->buf - st->have);
    if (k < 0 && (errno == EINTR || errno == EAGAIN))
        return;
    if (k <= 0) {
        stream_flush(st, rank, 1);
        close(st->fd);
        st->fd = -1;
        return;
    }
    st->have += (size_t)k;
    stream_flush(st, rank, 0);
}

/* sig to each rank's process group: the live ranks', and with exited_too
 * also what remains of the exited ranks' (their children). */
static void signal_ranks(spawn_rank *r, int n, int sig, int exited_too)
{
    for (int i = 0; i < n; i++) {
        if (r[i].pid <= 0 || (r[i].exited && !exited_too))
            continue;
        if (kill(-r[i].pid, sig) != 0 && !r[i].exited)
            kill(r[i].pid, sig);   /* not a group leader (setpgid failed): the rank alone */
    }
}

/* After the drain's deadline: what the streams still hold, then close them. */
static void streams_close(spawn_rank *r, int n)
{
    for (int i = 0; i < n; i++)
        for (int j = 0; j < 2; j++)
            if (r[i].s[j].fd >= 0) {
                stream_flush(&r[i].s[j], i, 1);
                close(r[i].s[j].fd);
                r[i].s[j].fd = -1;
            }
}

/* Supervise until every rank exited and every pipe drained. */
static int supervise(dt_ctx *ctx, const dt_spawn_config *cfg, spawn_rank *r, int sfd,
                     int *first_failed, int *interrupted)
{
    int n = cfg->nranks, live = 0, grace = cfg->grace_ms > 0 ? cfg->grace_ms : 5000;
    for (int i = 0; i < n; i++)   /* ranks that never started count as exited */
        live += !r[i].exited;
    double kill_at = 0, drain_until = 0;
    struct pollfd *pf = host_alloc(ctx, sizeof *pf * (size_t)(2 * n + 1));
    int *owner = host_alloc(ctx, sizeof *owner * (size_t)(2 * n + 1));
    if (!pf || !owner) {
        signal_ranks(r, n, SIGKILL, 1);
        host_free(ctx, pf);
        host_free(ctx, owner);
        return -1;
    }
    for (;;) {
        int k = 0, open_streams = 0;
        pf[k++] = (struct pollfd){sfd, POLLIN, 0};
        for (int i = 0; i < n; i++)
            for (int j = 0; j < 2; j++)
                if (r[i].s[j].fd >= 0) {
                    owner[k] = i * 2 + j;
                    pf[k++] = (struct pollfd){r[i].s[j].fd, POLLIN, 0};
                    open_streams++;
                }
        if (live == 0 && open_streams == 0)
            break;
        if (live == 0 && drain_until == 0)
            drain_until = dt_now() + DT_SPAWN_DRAIN_S;
        if (live == 0 && dt_now() >= drain_until) {   /* a rank's leftover child holds a pipe */
            streams_close(r, n);
            break;
        }
        poll(pf, (nfds_t)k, 50);
        for (int i = 1; i < k; i++)
            if (pf[i].revents)
                stream_read(&r[owner[i] / 2].s[owner[i] % 2], owner[i] / 2);
        if (sfd >= 0 && (pf[0].revents & POLLIN)) {
            struct signalfd_siginfo si;
            if (read(sfd, &si, sizeof si) == (ssize_t)sizeof si) {
                signal_ranks(r, n, (int)si.ssi_signo, 1);   /* forward Ctrl-C / TERM */
                *interrupted = (int)si.ssi_signo;   /* the user's stop: no restart */
                if (kill_at == 0)   /* they save and leave (dt_preempt_enable) in grace_ms */
                    kill_at = dt_now() + grace / 1000.0;
            }
        }
        for (int i = 0; i < n; i++) {
            if (r[i].exited)
                continue;
            int status;
            if (waitpid(r[i].pid, &status, WNOHANG) == r[i].pid) {
                r[i].exited = 1;
                r[i].status = status;
                live--;
                if (WIFSIGNALED(status))
                    remove_shm_of(r[i].pid);
                int ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
                if (WIFEXITED(status) && WEXITSTATUS(status) == DT_EXIT_PREEMPTED) {
                    /* saved at the step the ranks agreed on: the others are
                     * saving too (a signal now would end one mid-write) */
                    if (kill_at == 0)
                        kill_at = dt_now() + grace / 1000.0;
                } else if (!ok && *first_failed < 0) {
                    *first_failed = i;
                    signal_ranks(r, n, SIGTERM, 1);
                    kill_at = dt_now() + grace / 1000.0;
                }
            }
        }
        if (kill_at > 0 && dt_now() >= kill_at) {   /* ranks or their children left */
            for (int i = 0; i < n; i++)
                if (!r[i].exited) {
                    r[i].killed_late = 1;
                    ctx_warn(ctx, "launch: rank %d did not exit within the %d ms grace period: "
                             "killed", i, grace);
                }
            signal_ranks(r, n, SIGKILL, 1);
            kill_at = 0;
        }
    }
    host_free(ctx, pf);
    host_free(ctx, owner);
    return 0;
}

/* One run of the whole job (attempt 0, or a restart). */
static dt_status spawn_once(dt_ctx *ctx, const dt_spawn_config *cfg, char *const argv[],
                            const char *token, int attempt, int *rank_out, int *failed_out,
                            int *interrupted)
{
    int port = free_local_port();
    if (port < 0)
        return set_error(ctx, DT_EIO, "spawn: no free local port for the rendezvous");
    int n = cfg->nranks, first_failed = -1;
    spawn_rank *r = host_calloc(ctx, sizeof *r * (size_t)n);
    if (!r)
        return set_error(ctx, DT_ENOMEM, "spawn: out of memory");
    /* block the signals we forward; they are read from a signalfd */
    sigset_t fwd, old;
    sigemptyset(&fwd);
    sigaddset(&fwd, SIGINT);
    sigaddset(&fwd, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &fwd, &old);
    int sfd = signalfd(-1, &fwd, SFD_CLOEXEC | SFD_NONBLOCK);
    dt_status st = DT_OK;
    fflush(NULL);
    for (int i = 0; i < n && st == DT_OK; i++) {
        int po[2] = {-1, -1}, pe[2] = {-1, -1}, ep[2] = {-1, -1};
        if ((cfg->prefix_output && (pipe2(po, O_CLOEXEC) != 0 || pipe2(pe, O_CLOEXEC) != 0)) ||
            (argv && pipe2(ep, O_CLOEXEC) != 0)) {
            st = set_error(ctx, DT_EIO, "spawn: pipe: %s", strerror(errno));
            break;
        }
        pid_t pid = fork();
        if (pid < 0) {
            st = set_error(ctx, DT_EIO, "spawn: fork: %s", strerror(errno));
            break;
        }
        if (pid == 0) {
            setpgid(0, 0);   /* its own process group: signals reach its children too */
            pthread_sigmask(SIG_SETMASK, &old, NULL);
            if (sfd >= 0)
                close(sfd);
            rank_setup(cfg, i, port, token, attempt, po[1], pe[1]);
            if (argv) {   /* a failed exec's errno goes back through ep (closed by a good one) */
                close(ep[0]);
                execvp(argv[0], argv);
                int e = errno;
                ssize_t w = write(ep[1], &e, sizeof e);
                _exit(w == (ssize_t)sizeof e ? 127 : 126);
            }
            host_free(ctx, r);
            *rank_out = i;
            return DT_OK;   /* this process is rank i now */
        }
        setpgid(pid, pid);   /* also here, so no signal can come before the child's own call */
        if (argv) {
            int e = 0;
            close(ep[1]);
            ssize_t got;
            while ((got = read(ep[0], &e, sizeof e)) < 0 && errno == EINTR) {
            }
            close(ep[0]);
            if (got == (ssize_t)sizeof e) {   /* nothing ran: no rank to supervise */
                waitpid(pid, NULL, 0);
                pid = -1;
                for (int k = 0; k < 2; k++)
                    if ((k ? pe[0] : po[0]) >= 0)
                        close(k ? pe[0] : po[0]);
                po[0] = pe[0] = -1;
                first_failed = i;
                st = set_error(ctx, DT_EIO, "launch: cannot run %s: %s", argv[0], strerror(e));
            }
        }
        r[i].pid = pid;
        r[i].s[0] = (spawn_stream){.fd = po[0], .out = STDOUT_FILENO};
        r[i].s[1] = (spawn_stream){.fd = pe[0], .out = STDERR_FILENO};
        if (po[1] >= 0)
            close(po[1]);
        if (pe[1] >= 0)
            close(pe[1]);
    }
    if (st != DT_OK)   /* could not start them all: stop the ones that run */
        signal_ranks(r, n, SIGKILL, 1);
    for (int i = 0; i < n; i++)
        if (r[i].pid <= 0) {
            r[i].exited = 1;
            r[i].s[0].fd = r[i].s[1].fd = -1;
        }
    if (supervise(ctx, cfg, r, sfd, &first_failed, interrupted) != 0 && st == DT_OK)
        st = set_error(ctx, DT_ENOMEM, "spawn: out of memory while supervising");
    if (sfd >= 0)
        close(sfd);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    int preempted = 0, late = -1;
    for (int i = 0; i < n; i++) {
        preempted += WIFEXITED(r[i].status) && WEXITSTATUS(r[i].status) == DT_EXIT_PREEMPTED;
        if (r[i].killed_late && late < 0)
            late = i;
    }
    if (st == DT_OK && first_failed >= 0 && late >= 0 && (preempted || *interrupted)) {
        first_failed = late;   /* the rank that ignored the stop, not the first reaped */
        st = set_error(ctx, DT_EPEER, "spawn: rank %d did not exit within the %d ms grace period "
                       "after %s and was killed", late, cfg->grace_ms > 0 ? cfg->grace_ms : 5000,
                       preempted ? "the job agreed to stop" : "the signal");
    } else if (st == DT_OK && first_failed < 0 && preempted) {
        st = set_error(ctx, DT_EPREEMPTED, "spawn: the job was pre-empted: %d of %d ranks saved "
                       "their part and exited %d", preempted, n, DT_EXIT_PREEMPTED);
    } else if (st == DT_OK && first_failed >= 0) {
        int s = r[first_failed].status;
        if (WIFEXITED(s))
            st = set_error(ctx, DT_EPEER, "spawn: rank %d exited with code %d; the other ranks "
                           "were stopped", first_failed, WEXITSTATUS(s));
        else
            st = set_error(ctx, DT_EPEER, "spawn: rank %d was killed by signal %d (%s); the other "
                           "ranks were stopped", first_failed, WTERMSIG(s), strsignal(WTERMSIG(s)));
    }
    host_free(ctx, r);
    if (failed_out)
        *failed_out = first_failed;
    if (rank_out)
        *rank_out = -1;
    return st;
}

/* The job, started again after a failure up to cfg->max_restarts times
 * (a program that cannot be started at all is not retried).  With
 * min_ranks, a rank that failed first in two runs in a row is taken for
 * one that cannot run again: the next run has one rank fewer (the others
 * renumbered), as long as min_ranks are left. */
static dt_status spawn_impl(dt_ctx *ctx, const dt_spawn_config *cfg_in, char *const argv[],
                            int *rank_out, int *failed_out)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    dt_spawn_config own, *cfg = cfg_in ? &own : NULL;
    dt_spawn_config_init(&own);
    if (cfg_in && ctx_config_in(ctx, &own, sizeof own, cfg_in, "spawn", "dt_spawn_config") != DT_OK)
        return ctx->last_status;
    if (!cfg || cfg->nranks < 1 || cfg->nranks > DT_SPAWN_MAX_RANKS || cfg->max_restarts < 0 ||
        cfg->min_ranks < 0 || cfg->min_ranks > cfg->nranks)
        return set_error(ctx, DT_EINVAL, "spawn: nranks must be 1..%d, max_restarts >= 0 and "
                         "min_ranks 0..nranks", DT_SPAWN_MAX_RANKS);
    char token[40];
    const char *env_token = getenv("DTRAIN_JOB_TOKEN");
    if (env_token && strlen(env_token) < sizeof token)
        snprintf(token, sizeof token, "%s", env_token);
    else
        random_token(token, sizeof token);
    dt_spawn_config run = *cfg;
    int last_failed = -1;
    for (int attempt = 0;; attempt++) {
        int failed = -1, interrupted = 0;
        dt_status st = spawn_once(ctx, &run, argv, token, attempt, rank_out, &failed, &interrupted);
        if (*rank_out >= 0)
            return DT_OK;   /* a rank (dt_spawn): this process runs it */
        if (failed_out)
            *failed_out = failed;
        if ((st != DT_EPEER && st != DT_EPREEMPTED) || interrupted || attempt >= cfg->max_restarts)
            return st;
        /* pre-empted ranks saved and left: none of them is a failing rank */
        int drop = st == DT_EPEER && cfg->min_ranks > 0 && failed == last_failed &&
                   run.nranks > cfg->min_ranks;
        if (st == DT_EPREEMPTED) {   /* taken back, not broken: all -n ranks again */
            failed = -1;
            run.nranks = cfg->nranks;
        }
        ctx_warn(ctx, "launch: %s; restarting the job (restart %d of %d)%s", dt_last_error(ctx),
             attempt + 1, cfg->max_restarts,
             drop ? " with one rank fewer: this rank failed first twice in a row" : "");
        if (drop) {
            run.nranks--;
            last_failed = -1;
        } else {
            last_failed = failed;
        }
        dt_clear_error(ctx);
    }
}

dt_status dt_spawn(dt_ctx *ctx, const dt_spawn_config *cfg, int *rank)
{
    if (!rank)
        return ctx ? set_error(ctx, DT_EINVAL, "spawn: rank output is NULL") : DT_EINVAL;
    return spawn_impl(ctx, cfg, NULL, rank, NULL);
}

dt_status dt_launch(dt_ctx *ctx, const dt_spawn_config *cfg, char *const argv[], int *failed_rank)
{
    if (!argv || !argv[0])
        return ctx ? set_error(ctx, DT_EINVAL, "launch: no program given") : DT_EINVAL;
    int unused;
    return spawn_impl(ctx, cfg, argv, &unused, failed_rank);
}

