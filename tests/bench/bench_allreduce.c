/*
 * tests/bench/bench_allreduce.c - dt_comm_allreduce(SUM) latency and bus bandwidth.
 *
 *   bench_allreduce [--ranks 2] [--min-time 0.5] [--min-iters 5]
 *                   [--min-bytes 4096] [--max-bytes 67108864] [--no-memcpy]
 *                   [--late-us G]
 *
 * Forks the ranks itself with dt_spawn (or, when started by a launcher that
 * set DTRAIN_RANK, e.g. build/dtrun -n 2, runs as the rank it was given).
 * The transport comes from DTRAIN_TRANSPORT=shm|tcp (tcp also wants
 * DTRAIN_HOST=127.0.0.1).  For each size (4 KiB .. 64 MiB of float32) every
 * rank checks one allreduce of integer-valued data exactly, warms up, then
 * times single calls until about --min-time seconds have gone (at least
 * --min-iters); rank 0 prints the median time of one call and the bus
 * bandwidth 2 (P-1)/P * bytes / time, as nccl-tests and the OSU benchmarks
 * define it.  Before spawning, the parent measures single-thread memcpy
 * bandwidth of 64 MiB buffers (the median of several copies) for reference.
 *
 * Output (tests/bench/allreduce.sh parses it; bench_allreduce_mpi.c and
 * bench_allreduce_gloo.py print the same):
 *   # comment lines
 *   # memcpy_64MiB_GBps <GB/s>            (bytes copied / time, 1 GB = 1e9 B)
 *   <bytes> <iters> <median_us> <busbw_GBps> <ok|FAIL>
 * Exit status 0 only when every check passed.
 */
#include "dtrain.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* --late-us: rank 0 busy-waits this long before each timed call, outside its
 * timing, so the other ranks have already waited (spun, then slept) when it
 * arrives: its time shows what waking them costs. */
static double late_us;

static const size_t SIZES[] = {4u << 10, 16u << 10, 64u << 10, 256u << 10,
                               1u << 20, 4u << 20, 16u << 20, 64u << 20};
#define NSIZES (sizeof SIZES / sizeof SIZES[0])

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, size_t n)
{
    qsort(v, n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* Single-thread memcpy of 64 MiB buffers: median GB/s of several copies. */
static double memcpy_gbps(void)
{
    const size_t bytes = (size_t)64 << 20;
    enum { REPS = 11 };
    char *a = malloc(bytes), *b = malloc(bytes);
    if (!a || !b) {
        free(a);
        free(b);
        return 0;
    }
    memset(a, 1, bytes);   /* touch every page of both buffers */
    memset(b, 2, bytes);
    double t[REPS];
    for (int i = -2; i < REPS; i++) {   /* two copies of warm-up */
        double t0 = dt_now();
        memcpy(i % 2 ? a : b, i % 2 ? b : a, bytes);
        __asm__ __volatile__("" ::"r"(a), "r"(b) : "memory");   /* the copy is not dead */
        double dt = dt_now() - t0;
        if (i >= 0)
            t[i] = dt;
    }
    free(a);
    free(b);
    return bytes / median(t, REPS) / 1e9;
}

/* Rank r's integer-valued input; the sum over ranks is exact in float32. */
static float input(int64_t i, int r)
{
    return (float)((i * 7 + (int64_t)r * 131) % 1024) - 512.0f;
}

static int run_rank(int min_iters, double min_time, size_t min_bytes, size_t max_bytes)
{
    dt_ctx *ctx = dt_ctx_new(NULL);
    if (!ctx) {
        fprintf(stderr, "bench_allreduce: no context\n");
        return 1;
    }
    dt_comm *c = dt_comm_new(ctx, NULL, NULL);
    if (!c) {
        fprintf(stderr, "bench_allreduce: dt_comm_new: %s\n", dt_last_error(ctx));
        dt_ctx_free(ctx);
        return 1;
    }
    int rank = dt_comm_rank(c), P = dt_comm_size(c);
    const char *tp = getenv("DTRAIN_TRANSPORT");
    if (rank == 0) {
        printf("# dtrain allreduce(sum, float32): ranks=%d transport=%s provider=%s\n", P,
               tp ? tp : "(auto)", dt_comm_transport(c));
        if (late_us > 0)
            printf("# rank 0 arrives %.0f us late to every timed call; its times below\n", late_us);
        printf("# %10s %8s %12s %12s %s\n", "bytes", "iters", "median_us", "busbw_GBps", "check");
        fflush(stdout);
    }
    size_t cap = 0;
    for (size_t k = 0; k < NSIZES; k++)
        if (SIZES[k] <= max_bytes && SIZES[k] > cap)
            cap = SIZES[k];
    float *buf = malloc(cap ? cap : 4);
    double *times = NULL;
    size_t times_cap = 0;
    int rc = 0;
    if (!buf) {
        fprintf(stderr, "bench_allreduce: out of memory\n");
        rc = 1;
        goto out;
    }
    for (size_t k = 0; k < NSIZES && rc == 0; k++) {
        size_t bytes = SIZES[k];
        if (bytes < min_bytes || bytes > max_bytes)
            continue;
        int64_t n = (int64_t)(bytes / sizeof(float));
        dt_status st;

        /* 1. correctness, once per size: every rank checks its result */
        for (int64_t i = 0; i < n; i++)
            buf[i] = input(i, rank);
        if ((st = dt_comm_allreduce(c, buf, n, DT_REDUCE_SUM)) != DT_OK) {
            fprintf(stderr, "bench_allreduce: rank %d: %s\n", rank, dt_last_error(ctx));
            rc = 1;
            break;
        }
        int64_t bad = 0, first_bad = -1;
        for (int64_t i = 0; i < n; i++) {
            float want = 0;
            for (int r = 0; r < P; r++)
                want += input(i, r);
            if (buf[i] != want && bad++ == 0)
                first_bad = i;
        }
        if (bad)
            fprintf(stderr, "bench_allreduce: rank %d, %zu bytes: %lld wrong elements (first at %lld)\n",
                    rank, bytes, (long long)bad, (long long)first_bad);
        /* every rank learns whether any rank failed (the count, summed) */
        float nbad = (float)(bad > 0);
        if (dt_comm_allreduce(c, &nbad, 1, DT_REDUCE_SUM) != DT_OK) {
            rc = 1;
            break;
        }

        /* 2. warm-up (first touches, lazy connections), then as many calls
         * again timed: rank 0 picks the iteration count from those */
        int warm = bytes <= (256u << 10) ? 50 : bytes <= (4u << 20) ? 10 : 3;
        for (int i = 0; i < warm && st == DT_OK; i++)
            st = dt_comm_allreduce(c, buf, n, DT_REDUCE_SUM);
        dt_comm_barrier(c);
        double t0 = dt_now();
        for (int i = 0; i < warm && st == DT_OK; i++)
            st = dt_comm_allreduce(c, buf, n, DT_REDUCE_SUM);
        double per = (dt_now() - t0) / warm + late_us * 1e-6;
        float iters_f = (float)(per > 0 ? min_time / per : 1e6);
        if (iters_f < (float)min_iters)
            iters_f = (float)min_iters;
        if (iters_f > 1e6f)
            iters_f = 1e6f;
        iters_f = (float)(int64_t)iters_f;
        if (st != DT_OK || dt_comm_broadcast(c, &iters_f, 1, 0) != DT_OK) {
            fprintf(stderr, "bench_allreduce: rank %d: %s\n", rank, dt_last_error(ctx));
            rc = 1;
            break;
        }
        size_t iters = (size_t)iters_f;
        if (iters > times_cap) {
            double *p = realloc(times, iters * sizeof *times);
            if (!p) {
                rc = 1;
                break;
            }
            times = p;
            times_cap = iters;
        }

        /* 3. timed: each call on its own, the median reported */
        dt_comm_barrier(c);
        for (size_t i = 0; i < iters && st == DT_OK; i++) {
            if (rank == 0 && late_us > 0) {   /* busy, so this CPU stays awake and warm */
                double until = dt_now() + late_us * 1e-6;
                while (dt_now() < until)
                    ;
            }
            double a = dt_now();
            st = dt_comm_allreduce(c, buf, n, DT_REDUCE_SUM);
            times[i] = dt_now() - a;
        }
        if (st != DT_OK) {
            fprintf(stderr, "bench_allreduce: rank %d: %s\n", rank, dt_last_error(ctx));
            rc = 1;
            break;
        }
        double med = median(times, iters);
        double busbw = 2.0 * (P - 1) / P * (double)bytes / med / 1e9;
        if (rank == 0) {
            printf("  %10zu %8zu %12.2f %12.3f %s\n", bytes, iters, med * 1e6, busbw,
                   nbad == 0 ? "ok" : "FAIL");
            fflush(stdout);
        }
        if (nbad != 0)
            rc = 1;
    }
    if (rc == 0 && dt_comm_barrier(c) != DT_OK)
        rc = 1;
out:
    free(times);
    free(buf);
    dt_comm_free(c);
    dt_ctx_free(ctx);
    return rc;
}

static int usage(void)
{
    fprintf(stderr, "usage: bench_allreduce [--ranks N] [--min-time S] [--min-iters N] "
                    "[--min-bytes B] [--max-bytes B] [--no-memcpy] [--late-us G]\n");
    return 2;
}

int main(int argc, char **argv)
{
    int ranks = 2, min_iters = 5, do_memcpy = 1;
    double min_time = 0.5;
    size_t min_bytes = 0, max_bytes = (size_t)64 << 20;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--no-memcpy")) {
            do_memcpy = 0;
        } else if (i + 1 < argc && !strcmp(a, "--ranks")) {
            ranks = atoi(argv[++i]);
        } else if (i + 1 < argc && !strcmp(a, "--min-time")) {
            min_time = atof(argv[++i]);
        } else if (i + 1 < argc && !strcmp(a, "--min-iters")) {
            min_iters = atoi(argv[++i]);
        } else if (i + 1 < argc && !strcmp(a, "--min-bytes")) {
            min_bytes = (size_t)strtoull(argv[++i], NULL, 10);
        } else if (i + 1 < argc && !strcmp(a, "--max-bytes")) {
            max_bytes = (size_t)strtoull(argv[++i], NULL, 10);
        } else if (i + 1 < argc && !strcmp(a, "--late-us")) {
            late_us = atof(argv[++i]);
            if (late_us < 0 || late_us >= 1e6)
                return usage();
        } else {
            return usage();
        }
    }
    if (ranks < 1 || min_iters < 1 || min_time < 0)
        return usage();

    if (getenv("DTRAIN_RANK"))   /* started by dtrun or another dtrain launcher */
        return run_rank(min_iters, min_time, min_bytes, max_bytes);

    if (do_memcpy) {
        printf("# memcpy_64MiB_GBps %.3f\n", memcpy_gbps());
        fflush(stdout);
    }
    dt_ctx *ctx = dt_ctx_new(NULL);
    if (!ctx)
        return 1;
    dt_spawn_config cfg;
    dt_spawn_config_init(&cfg);
    cfg.nranks = ranks;
    cfg.prefix_output = 0;
    int rank = -1;
    dt_status st = dt_spawn(ctx, &cfg, &rank);
    if (st == DT_OK && rank >= 0) {   /* a worker */
        dt_ctx_free(ctx);
        exit(run_rank(min_iters, min_time, min_bytes, max_bytes));
    }
    if (st != DT_OK)
        fprintf(stderr, "bench_allreduce: %s\n", dt_last_error(ctx));
    dt_ctx_free(ctx);
    return st == DT_OK ? 0 : 1;
}
