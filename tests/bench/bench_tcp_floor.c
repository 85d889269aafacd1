/* tests/bench/bench_tcp_floor.c - what a 2-rank float allreduce costs over
 * raw TCP sockets on loopback, with nothing in between: no library, no
 * matching, no comm thread. Two processes (one per CPU), one connection,
 * non-blocking send/recv driven by poll. Two schemes, both moving the
 * minimum bytes (each rank sends and receives n floats in all):
 *   ring:     exchange halves, reduce own half, exchange reduced halves
 *   exchange: swap whole buffers, reduce all (recursive doubling at P=2)
 * A reference for what the kernel's TCP path costs here: it is not a
 * proven floor (MPI's tcp BTL beats it at some sizes), but it shows how much
 * of a TCP allreduce is the kernel's copies and stack rather than the
 * library on top. allreduce.sh prints it next to MPI tcp and dtrain tcp.
 *
 *   bench_tcp_floor [--min-time S] [--port P]
 * prints, per size, the faster of the two schemes, in bench_allreduce's
 * format: "<bytes> <calls> <median_us> <busbw_GBps> ok" (busbw = bytes at
 * P=2), and checks every result. SOBUF=<bytes> sets both socket buffers.
 */
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void die(const char *what) {
    perror(what);
    exit(2);
}

/* Sends sb[0..sn) and receives into rb[0..rn) at once, so neither side's
 * socket buffer fills while the other waits. */
static void swap_bytes(int fd, const char *sb, size_t sn, char *rb, size_t rn) {
    size_t so = 0, ro = 0;
    while (so < sn || ro < rn) {
        struct pollfd p = {fd, (short)((so < sn ? POLLOUT : 0) | (ro < rn ? POLLIN : 0)), 0};
        if (poll(&p, 1, -1) < 0 && errno != EINTR) die("poll");
        if (so < sn && (p.revents & POLLOUT)) {
            ssize_t k = send(fd, sb + so, sn - so, MSG_DONTWAIT | MSG_NOSIGNAL);
            if (k > 0) so += (size_t)k;
            else if (k < 0 && errno != EAGAIN) die("send");
        }
        if (ro < rn && (p.revents & POLLIN)) {
            ssize_t k = recv(fd, rb + ro, rn - ro, MSG_DONTWAIT);
            if (k > 0) ro += (size_t)k;
            else if (k == 0) { fprintf(stderr, "peer closed\n"); exit(2); }
            else if (errno != EAGAIN) die("recv");
        }
    }
}

static void add(float *d, const float *s, size_t n) {
    for (size_t i = 0; i < n; i++) d[i] += s[i];
}

static void ring(int fd, int rank, float *x, float *tmp, size_t n) {
    size_t h = n / 2, mine = rank ? h : 0, other = rank ? 0 : h;
    size_t mn = rank ? n - h : h, on = rank ? h : n - h;
    swap_bytes(fd, (char *)(x + other), on * 4, (char *)tmp, mn * 4);
    add(x + mine, tmp, mn);
    swap_bytes(fd, (char *)(x + mine), mn * 4, (char *)(x + other), on * 4);
}

static void exchange(int fd, float *x, float *tmp, size_t n) {
    swap_bytes(fd, (char *)x, n * 4, (char *)tmp, n * 4);
    add(x, tmp, n);
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    double min_time = 0.5;
    int port = 29611;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--min-time") && i + 1 < argc) min_time = atof(argv[++i]);
        else if (!strcmp(argv[i], "--port") && i + 1 < argc) port = atoi(argv[++i]);
        else { fprintf(stderr, "usage: %s [--min-time S] [--port P]\n", argv[0]); return 2; }
    }
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(lfd, (struct sockaddr *)&a, sizeof a) || listen(lfd, 1)) die("bind/listen");
    pid_t child = fork();
    int rank = child == 0 ? 1 : 0, fd;
    cpu_set_t cs;
    CPU_ZERO(&cs);
    CPU_SET(rank % (int)sysconf(_SC_NPROCESSORS_ONLN), &cs);
    sched_setaffinity(0, sizeof cs, &cs);
    if (rank == 1) {
        close(lfd);
        fd = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(fd, (struct sockaddr *)&a, sizeof a)) die("connect");
    } else {
        fd = accept(lfd, NULL, NULL);
        if (fd < 0) die("accept");
        close(lfd);
    }
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (getenv("SOBUF")) {
        int b = atoi(getenv("SOBUF"));
        setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &b, sizeof b);
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &b, sizeof b);
    }
    size_t maxn = (64u << 20) / 4;
    float *x = malloc(maxn * 4), *tmp = malloc(maxn * 4);
    double *ts = malloc(100000 * sizeof *ts);
    if (!x || !tmp || !ts) die("malloc");
    memset(x, 0, maxn * 4);
    memset(tmp, 0, maxn * 4);
    if (rank == 0)
        printf("# raw TCP sockets on loopback, 2 processes: best of ring/exchange\n"
               "# %10s %8s %12s %12s %s\n", "bytes", "iters", "median_us", "busbw_GBps", "check");
    for (size_t bytes = 4096; bytes <= (64u << 20); bytes *= 4) {
        size_t n = bytes / 4;
        double res[2];
        int ncalls[2];
        for (int scheme = 0; scheme < 2; scheme++) {
            /* rank 0 picks the call count from a 50 ms warm-up and tells rank 1 */
            int calls = 0;
            if (rank == 0) {
                double t0 = now_s();
                int k = 0;
                int go = 1, ack;
                do {
                    swap_bytes(fd, (char *)&go, sizeof go, (char *)&ack, sizeof ack);
                    for (size_t i = 0; i < n; i++) x[i] = 1.0f;
                    scheme ? exchange(fd, x, tmp, n) : ring(fd, rank, x, tmp, n);
                    k++;
                } while (now_s() - t0 < 0.05);
                go = 0;
                swap_bytes(fd, (char *)&go, sizeof go, (char *)&ack, sizeof ack);
                calls = (int)(min_time / ((now_s() - t0) / k)) + 5;
                if (calls > 100000) calls = 100000;
                swap_bytes(fd, (char *)&calls, sizeof calls, (char *)&ack, sizeof ack);
            } else {
                int go, ack = 0;
                for (;;) {
                    swap_bytes(fd, (char *)&ack, sizeof ack, (char *)&go, sizeof go);
                    if (!go) break;
                    for (size_t i = 0; i < n; i++) x[i] = 1.0f;
                    scheme ? exchange(fd, x, tmp, n) : ring(fd, rank, x, tmp, n);
                }
                swap_bytes(fd, (char *)&ack, sizeof ack, (char *)&calls, sizeof calls);
            }
            for (int c = 0; c < calls; c++) {
                for (size_t i = 0; i < n; i++) x[i] = (float)(rank + 1);
                double t0 = now_s();
                scheme ? exchange(fd, x, tmp, n) : ring(fd, rank, x, tmp, n);
                ts[c] = now_s() - t0;
                if (x[0] != 3.0f || x[n - 1] != 3.0f || x[n / 2] != 3.0f) {
                    fprintf(stderr, "rank %d: wrong result %g\n", rank, (double)x[0]);
                    return 1;
                }
            }
            qsort(ts, (size_t)calls, sizeof *ts, cmp_d);
            res[scheme] = ts[calls / 2];
            ncalls[scheme] = calls;
        }
        int b = res[1] < res[0];
        if (rank == 0)
            printf("  %10zu %8d %12.2f %12.3f ok\n", bytes, ncalls[b], res[b] * 1e6,
                   (double)bytes / res[b] / 1e9);
        fflush(stdout);
    }
    close(fd);
    if (rank == 0) {
        int st;
        waitpid(child, &st, 0);
        return WIFEXITED(st) ? WEXITSTATUS(st) : 1;
    }
    return 0;
}
