/*
 * tests/test_ranks.h - running a job of forked ranks inside a test: a free
 * port for the store, the environment a launcher would give each rank, and
 * reaping the ranks with a deadline.  Include after test_util.h.
 */
#ifndef DT_TEST_RANKS_H
#define DT_TEST_RANKS_H

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* A TCP port on loopback that was free a moment ago. */
static inline int tr_free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t sl = sizeof sa;
    assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    assert_int_equal(getsockname(fd, (struct sockaddr *)&sa, &sl), 0);
    close(fd);
    return ntohs(sa.sin_port);
}

/* The environment a launcher would give rank `rank` of `world`. */
static inline dt_dist_env tr_env(int rank, int world, int port)
{
    dt_dist_env e;
    memset(&e, 0, sizeof e);
    e.rank = rank;
    e.world_size = world;
    e.local_rank = e.local_world_size = -1;
    e.launcher = "test";
    snprintf(e.master_addr, sizeof e.master_addr, "127.0.0.1");
    e.master_port = port;
    return e;
}

/* A rank that died without closing (killed, or _exit mid-job on purpose)
 * leaves its shm endpoints' regions ("dtrain_<pid>_...", backends/fabric.c)
 * and maybe a host segment ("dtrain-<pid>-..."): remove them, or a long
 * suite fills /dev/shm. */
static inline void tr_remove_shm_of(pid_t pid)
{
    DIR *d = opendir("/dev/shm");
    if (!d)
        return;
    char fab[40], seg[40], path[300];
    int nf = snprintf(fab, sizeof fab, "dtrain_%d_", (int)pid);
    int ns = snprintf(seg, sizeof seg, "dtrain-%d-", (int)pid);
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (strncmp(e->d_name, fab, (size_t)nf) == 0 || strncmp(e->d_name, seg, (size_t)ns) == 0) {
            snprintf(path, sizeof path, "/dev/shm/%.250s", e->d_name);
            unlink(path);
        }
    closedir(d);
}

/* Reap pids[0..world): codes[r] = exit code, 200 + signal when killed, or
 * -1 when it was still running at the deadline (it is killed then). */
static inline void tr_reap(const pid_t *pids, int world, int *codes, double seconds)
{
    double deadline = dt_now() + seconds;
    for (int r = 0; r < world; r++) {
        int status = 0;
        for (;;) {
            pid_t got = waitpid(pids[r], &status, WNOHANG);
            if (got == pids[r]) {
                codes[r] = WIFEXITED(status) ? WEXITSTATUS(status) : 200 + WTERMSIG(status);
                tr_remove_shm_of(pids[r]);
                break;
            }
            if (dt_now() > deadline) {
                kill(pids[r], SIGKILL);
                waitpid(pids[r], &status, 0);
                codes[r] = -1;
                tr_remove_shm_of(pids[r]);
                break;
            }
            struct timespec ts = {0, 5 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
    }
}

#endif
