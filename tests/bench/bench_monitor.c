/*
 * tests/bench/bench_monitor.c - what the live monitor (dtrain.h section 14b)
 * costs a data-parallel training step.  Written against dtrain.h only.
 *
 *   bench_monitor [--model mlp|cnn] [--ranks N] [--pairs P] [--block-steps S]
 *                 [--warmup W] [--data DIR]
 *
 * N ranks (default 2, forked by dt_spawn, 1 thread each, DDP over shm) train
 * the models of bench_models.h on Fashion-MNIST.  The steps are timed in
 * blocks of S steps, the monitor off in one block of a pair and on in the
 * other, the order alternating from pair to pair.  "On" is what a user who
 * watches has: every rank's monitor (dt_monitor_new, which turns the
 * profiler on), and on rank 0 a client thread that holds the page's /events
 * stream open and scrapes /metrics every second, as a browser and a
 * Prometheus on the same host would.  Starting and stopping (and the
 * profiler's finish) happen outside the timed steps.
 *
 * One result line, from rank 0:
 *   monitor impl=dtrain model=mlp ranks=2 off_ms=.. on_ms=.. ratio=.. pooled_ratio=..
 *           steps=.. scrapes=.. events=..
 * (ratio: the median over the pairs of (median step on) / (median step
 * off); scrapes and events: what the client got over the "on" blocks).
 */
#define _GNU_SOURCE

#include <arpa/inet.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "dtrain.h"

#include "bench_models.h"
#include "../../examples/fmnist.h"

enum { MODEL_MLP, MODEL_CNN };

typedef struct bench {
    dt_ctx *ctx;
    dt_comm *comm;
    dt_loader *ld;
    dt_optim *opt;
    dt_ddp *ddp;
    int model, rank;
    mlp mm;
    cnn cm;
    int64_t epoch;
    float last;
} bench;

/* --- the watcher: an /events stream and a /metrics scrape per second ------ */

typedef struct watcher {
    int port;
    volatile int stop;
    long scrapes, events;
    pthread_t tid;
} watcher;

static int http_open(int port, const char *path)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        if (fd >= 0) close(fd);
        return -1;
    }
    char req[128];
    int n = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", path);
    if (write(fd, req, (size_t)n) != n) {
        close(fd);
        return -1;
    }
    return fd;
}

static void *watch(void *arg)
{
    watcher *w = arg;
    char buf[1 << 16];
    int ev = http_open(w->port, "/events");
    double next = now_s();
    while (!w->stop) {
        if (now_s() >= next) {   /* a scrape, read to the end */
            int fd = http_open(w->port, "/metrics");
            ssize_t k;
            while (fd >= 0 && (k = read(fd, buf, sizeof buf)) > 0) {
            }
            if (fd >= 0) close(fd);
            w->scrapes++;
            next += 1.0;
        }
        struct pollfd p = {ev, POLLIN, 0};
        if (ev >= 0 && poll(&p, 1, 100) > 0) {
            ssize_t k = read(ev, buf, sizeof buf);
            if (k <= 0) {
                close(ev);
                ev = -1;
            } else if (memmem(buf, (size_t)k, "data: ", 6)) {
                w->events++;
            }
        } else if (ev < 0) {
            usleep(100 * 1000);
        }
    }
    if (ev >= 0) close(ev);
    return NULL;
}

/* --- training -------------------------------------------------------------- */

static void step(bench *b)
{
    dt_tensor *x, *y;
    dt_status s = dt_loader_next(b->ld, &x, &y);
    if (s == DT_EOF) {
        check(b->ctx, dt_loader_start_epoch(b->ld, ++b->epoch), "dt_loader_start_epoch");
        s = dt_loader_next(b->ld, &x, &y);
    }
    check(b->ctx, s, "dt_loader_next");
    dt_optim_zero_grad(b->opt);
    dt_tensor *logits = b->model == MODEL_MLP ? mlp_forward(b->ctx, &b->mm, dt_flatten(b->ctx, x, 1))
                                              : cnn_forward(b->ctx, &b->cm, x);
    dt_tensor *loss = dt_cross_entropy(b->ctx, logits, y);
    if (!loss) die_ctx(b->ctx, "forward");
    check(b->ctx, dt_backward(b->ctx, loss), "dt_backward");
    check(b->ctx, dt_ddp_step(b->ddp), "dt_ddp_step");
    b->last = dt_tensor_item(loss);
    dt_ctx_step_reset(b->ctx);
}

/* S timed steps into t[0..S), with the monitor (and on rank 0 the watcher)
 * on when mon; the watcher's counts added to *scrapes, *events. */
static void block(bench *b, int S, int mon, double *t, long *scrapes, long *events)
{
    dt_monitor *m = NULL;
    watcher w = {0};
    if (mon) {
        dt_monitor_config mc;
        dt_monitor_config_init(&mc);
        mc.listen = "127.0.0.1:0";
        if (!(m = dt_monitor_new(b->ctx, b->comm, &mc))) die_ctx(b->ctx, "dt_monitor_new");
        if (b->rank == 0) {
            w.port = dt_monitor_port(m);
            pthread_create(&w.tid, NULL, watch, &w);
        }
    }
    check(b->ctx, dt_comm_barrier(b->comm), "dt_comm_barrier");   /* every rank's block starts together */
    for (int i = 0; i < S; i++) {
        double t0 = now_s();
        step(b);
        t[i] = now_s() - t0;
    }
    if (mon) {
        if (b->rank == 0) {
            w.stop = 1;
            pthread_join(w.tid, NULL);
            if (scrapes) *scrapes += w.scrapes;
            if (events) *events += w.events;
        }
        dt_monitor_free(m);
        check(b->ctx, dt_profile_stop(b->ctx, NULL, NULL), "dt_profile_stop");   /* off again */
    }
}

static void usage(void)
{
    fprintf(stderr, "usage: bench_monitor [--model mlp|cnn] [--ranks N] [--pairs P]\n"
                    "                     [--block-steps S] [--warmup W] [--data DIR]\n");
    exit(2);
}

static int run_rank(int model, int pairs, int S, int warmup, const char *data)
{
    bench b = {.model = model};
    b.ctx = make_ctx(1, 1234);
    dt_dist_env env;
    check(b.ctx, dt_dist_env_detect(b.ctx, &env), "dt_dist_env_detect");
    if (!(b.comm = dt_comm_new(b.ctx, &env, NULL))) die_ctx(b.ctx, "dt_comm_new");
    b.rank = dt_comm_rank(b.comm);
    dt_dataset *ds = fmnist_load(b.ctx, data, 0);
    if (!ds) die_ctx(b.ctx, "loading Fashion-MNIST");
    dt_loader_config lc;
    dt_loader_config_init(&lc);
    lc.batch = model == MODEL_MLP ? 128 : 64;
    lc.shuffle = 1;
    lc.drop_last = 1;
    lc.seed = 1;
    lc.mean = 0.2860f;
    lc.std = 0.3530f;
    lc.prefetch = 1;
    lc.shard_rank = b.rank;
    lc.shard_count = dt_comm_size(b.comm);
    if (!(b.ld = dt_loader_new(b.ctx, ds, &lc))) die_ctx(b.ctx, "dt_loader_new");
    if (model == MODEL_MLP) mlp_init(b.ctx, &b.mm);
    else cnn_init(b.ctx, &b.cm);
    b.opt = make_sgd(b.ctx);
    if (!(b.ddp = dt_ddp_new(b.ctx, b.comm, b.opt, NULL))) die_ctx(b.ctx, "dt_ddp_new");
    check(b.ctx, dt_loader_start_epoch(b.ld, 0), "dt_loader_start_epoch");

    double *scratch = malloc((size_t)(S > warmup ? S : warmup) * sizeof *scratch);
    double *off = malloc((size_t)pairs * (size_t)S * sizeof *off);
    double *on = malloc((size_t)pairs * (size_t)S * sizeof *on);
    double *pr = malloc((size_t)pairs * sizeof *pr), *tmp = malloc((size_t)S * sizeof *tmp);
    if (!scratch || !off || !on || !pr || !tmp) return 1;
    block(&b, warmup, 0, scratch, NULL, NULL);
    block(&b, S, 1, scratch, NULL, NULL);   /* the first start allocates the profiler's buffer */
    block(&b, S, 0, scratch, NULL, NULL);
    long scrapes = 0, events = 0;
    for (int p = 0; p < pairs; p++) {
        int on_first = p & 1;
        block(&b, S, on_first, on_first ? on + p * S : off + p * S, &scrapes, &events);
        block(&b, S, !on_first, on_first ? off + p * S : on + p * S, &scrapes, &events);
        memcpy(tmp, on + p * S, (size_t)S * sizeof *tmp);
        double mon = median(tmp, S);
        memcpy(tmp, off + p * S, (size_t)S * sizeof *tmp);
        pr[p] = mon / median(tmp, S);
    }
    if (!isfinite(b.last)) {
        fprintf(stderr, "bench_monitor: loss is %f\n", b.last);
        return 1;
    }
    int n = pairs * S;
    double m_off = median(off, n), m_on = median(on, n), ratio = median(pr, pairs);
    if (b.rank == 0) {
        printf("monitor impl=dtrain model=%s ranks=%d off_ms=%.4f on_ms=%.4f ratio=%.4f "
               "pooled_ratio=%.4f steps=%d scrapes=%ld events=%ld\n",
               model == MODEL_MLP ? "mlp" : "cnn", dt_comm_size(b.comm), m_off * 1e3, m_on * 1e3,
               ratio, m_on / m_off, n, scrapes, events);
        fflush(stdout);
    }
    free(pr); free(tmp); free(scratch); free(off); free(on);
    dt_ddp_free(b.ddp);
    dt_optim_free(b.opt);
    dt_loader_free(b.ld);
    dt_dataset_free(ds);
    dt_comm_free(b.comm);
    dt_ctx_free(b.ctx);
    return 0;
}

int main(int argc, char **argv)
{
    const char *model = "mlp", *data = NULL;
    int pairs = 0, S = 0, warmup = -1, ranks = 2;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) usage();
        if (!strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "--ranks")) ranks = atoi(v);
        else if (!strcmp(a, "--pairs")) pairs = atoi(v);
        else if (!strcmp(a, "--block-steps")) S = atoi(v);
        else if (!strcmp(a, "--warmup")) warmup = atoi(v);
        else if (!strcmp(a, "--data")) data = v;
        else usage();
        i++;
    }
    int m = !strcmp(model, "mlp") ? MODEL_MLP : !strcmp(model, "cnn") ? MODEL_CNN : -1;
    if (m < 0 || ranks < 2) usage();
    /* blocks of a few seconds: the monitor's 1 s interval and the scrapes fall in them */
    if (pairs <= 0) pairs = 8;
    if (S <= 0) S = m == MODEL_MLP ? 200 : 30;
    if (warmup < 0) warmup = m == MODEL_MLP ? 50 : 8;
    if (getenv("DTRAIN_PROFILE") || getenv("DTRAIN_MONITOR")) {
        fprintf(stderr, "bench_monitor: unset DTRAIN_PROFILE and DTRAIN_MONITOR\n");
        return 2;
    }
    dt_ctx *sup = dt_ctx_new(NULL);
    dt_spawn_config sc;
    dt_spawn_config_init(&sc);
    sc.nranks = ranks;
    sc.prefix_output = 0;   /* rank 0's result line as it is */
    int rank = -1;
    dt_status st = sup ? dt_spawn(sup, &sc, &rank) : DT_ENOMEM;
    if (st == DT_OK && rank >= 0) {
        dt_ctx_free(sup);
        return run_rank(m, pairs, S, warmup, data);
    }
    if (st != DT_OK) fprintf(stderr, "bench_monitor: %s\n", sup ? dt_last_error(sup) : "out of memory");
    dt_ctx_free(sup);
    return st == DT_OK ? 0 : 1;
}
