/*
 * examples/dtrun.c - run a program as N ranks on this host (like torchrun
 * or mpirun):
 *
 *   build/dtrun -n 4 [--transport shm|tcp] [--grace MS] [--max-restarts N] [--min-ranks M]
 *               [--no-prefix] [--no-bind] prog args...
 *
 * Each rank gets DTRAIN_RANK, DTRAIN_WORLD_SIZE, DTRAIN_MASTER, a random
 * DTRAIN_JOB_TOKEN (unless one is set) and DTRAIN_TRANSPORT, so the program's
 * dt_comm_new(ctx, NULL, NULL) finds its peers.  Output lines are prefixed
 * with "[rank] "; Ctrl-C and SIGTERM are forwarded; when a rank fails the
 * others are stopped and dtrun exits non-zero naming it.  With
 * --max-restarts N the whole job is started again instead, up to N times
 * (each rank sees DTRAIN_RESTART), and dtrun says which rank failed and
 * which restart this is; the program resumes from its newest checkpoint
 * (e.g. fashion_mnist --save DIR/ --resume auto).  --min-ranks M: a rank
 * that failed first twice in a row is left out of the next run (down to M
 * ranks; the program keeps its global batch: fashion_mnist --global-batch).
 */
#include "dtrain.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The launcher's notes (a restart: which rank failed, which restart). */
static void say(void *user, const char *msg)
{
    (void)user;
    fprintf(stderr, "dtrun: %s\n", msg);
}

static void usage(FILE *f)
{
    fprintf(f, "usage: dtrun -n N [--transport shm|tcp|verbs] [--grace MS] [--max-restarts N] "
               "[--min-ranks M] [--no-prefix] [--no-bind] [--] prog [args...]\n");
}

int main(int argc, char **argv)
{
    dt_spawn_config cfg;
    dt_spawn_config_init(&cfg);
    cfg.nranks = 0;
    int i = 1;
    for (; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--")) {
            i++;
            break;
        }
        if (a[0] != '-')
            break;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--no-prefix")) {
            cfg.prefix_output = 0;
            continue;
        }
        if (!strcmp(a, "--no-bind")) {   /* let the scheduler place the ranks */
            cfg.bind_cpus = 0;
            continue;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "dtrun: %s needs a value\n", a);
            return 2;
        }
        const char *v = argv[++i];
        char *end;
        if (!strcmp(a, "-n") || !strcmp(a, "--nproc")) {
            long n = strtol(v, &end, 10);
            if (*end || n < 1 || n > 1024) {
                fprintf(stderr, "dtrun: -n needs 1..1024, got '%s'\n", v);
                return 2;
            }
            cfg.nranks = (int)n;
        } else if (!strcmp(a, "--transport")) {
            cfg.transport = v;
        } else if (!strcmp(a, "--grace")) {
            cfg.grace_ms = (int)strtol(v, &end, 10);
        } else if (!strcmp(a, "--max-restarts")) {
            long n = strtol(v, &end, 10);
            if (*end || n < 0 || n > 1000) {
                fprintf(stderr, "dtrun: --max-restarts needs 0..1000, got '%s'\n", v);
                return 2;
            }
            cfg.max_restarts = (int)n;
        } else if (!strcmp(a, "--min-ranks")) {
            long n = strtol(v, &end, 10);
            if (*end || n < 1 || n > 1024) {
                fprintf(stderr, "dtrun: --min-ranks needs 1..1024, got '%s'\n", v);
                return 2;
            }
            cfg.min_ranks = (int)n;
        } else {
            fprintf(stderr, "dtrun: unknown option '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (cfg.nranks < 1 || i >= argc) {
        usage(stderr);
        return 2;
    }
    dt_config c;
    dt_config_init(&c);
    dt_ctx *ctx = dt_ctx_new(&c);
    if (!ctx || dt_ctx_status(ctx) != DT_OK) {
        fprintf(stderr, "dtrun: %s\n", ctx ? dt_last_error(ctx) : "out of memory");
        dt_ctx_free(ctx);
        return 1;
    }
    dt_set_log(ctx, say, NULL);
    int failed = -1;
    dt_status st = dt_launch(ctx, &cfg, argv + i, &failed);
    if (st != DT_OK)
        fprintf(stderr, "dtrun: %s\n", dt_last_error(ctx));
    dt_ctx_free(ctx);
    return st == DT_OK ? 0 : 1;
}
