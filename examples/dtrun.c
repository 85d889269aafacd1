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
#include "args.h"

#include <stdio.h>

/* The launcher's notes (a restart: which rank failed, which restart). */
static void say(void *user, const char *msg)
{
    (void)user;
    fprintf(stderr, "dtrun: %s\n", msg);
}

static void usage(FILE *f)
{
    fprintf(f, "usage: dtrun -n N [--transport shm|tcp|verbs] [--grace MS] [--max-restarts N] "
               "[--min-ranks M] [--no-prefix] [--no-bind] [--] prog [args...]\n"
               "  -n, --nproc N       ranks to start, 1..1024\n"
               "  --transport T       DTRAIN_TRANSPORT for the ranks\n"
               "  --grace MS          after a rank failed, a signal dtrun passed on, or a rank's\n"
               "                      pre-emption exit, ranks still running after MS are killed\n"
               "                      (default 5000)\n"
               "Exit status: 0, 1 (a rank failed), 2 (usage), 75 (pre-empted: the ranks saved\n"
               "a checkpoint and exited 75; run the job again to resume it)\n"
               "  --max-restarts N    start the job again after a failure, up to N times\n"
               "  --min-ranks M       with --max-restarts: leave out a rank that failed first\n"
               "                      twice in a row, down to M ranks\n"
               "  --no-prefix         no \"[rank] \" before each line of output\n"
               "  --no-bind           let the scheduler place the ranks (no CPU binding)\n"
               "Options end at prog: its arguments go to it as they are.\n");
}

/* dtrun's options into cfg; the index of the program in argv, or -1. */
static int parse_args(int argc, char **argv, dt_spawn_config *cfg)
{
    int no_prefix = 0, no_bind = 0;
    const args_opt opts[] = {
        {"nproc", 'n', ARGS_K_INT, &cfg->nranks, 1, 1024, NULL},
        ARG_STR("transport", &cfg->transport),
        ARG_INT("grace", &cfg->grace_ms, 0, 3600000),
        ARG_INT("max-restarts", &cfg->max_restarts, 0, 1000),
        ARG_INT("min-ranks", &cfg->min_ranks, 1, 1024),
        ARG_FLAG("no-prefix", &no_prefix),
        ARG_FLAG("no-bind", &no_bind),
    };
    int prog = args_parse("dtrun", argc, argv, opts, sizeof opts / sizeof opts[0], ARGS_STOP, usage);
    if (prog < 0)
        return -1;
    if (cfg->nranks < 1 || prog >= argc) {
        fprintf(stderr, "dtrun: %s\n", cfg->nranks < 1 ? "-n N is required" : "no program to run");
        usage(stderr);
        return -1;
    }
    if (no_prefix)
        cfg->prefix_output = 0;
    if (no_bind)   /* let the scheduler place the ranks */
        cfg->bind_cpus = 0;
    return prog;
}

int main(int argc, char **argv)
{
    dt_spawn_config cfg;
    dt_spawn_config_init(&cfg);
    cfg.nranks = 0;
    int i = parse_args(argc, argv, &cfg);
    if (i < 0)
        return 2;
    dt_ctx_config c;
    dt_ctx_config_init(&c);
    dt_ctx *ctx = dt_ctx_new(&c);
    if (!ctx || dt_ctx_status(ctx) != DT_OK) {
        fprintf(stderr, "dtrun: %s\n", ctx ? dt_last_error(ctx) : "out of memory");
        dt_ctx_free(ctx);
        return 1;
    }
    dt_ctx_set_log(ctx, say, NULL);
    int failed = -1;
    dt_status st = dt_launch(ctx, &cfg, argv + i, &failed);
    if (st != DT_OK)
        fprintf(stderr, "dtrun: %s\n", dt_last_error(ctx));
    dt_ctx_free(ctx);
    /* pre-empted: the job's state is saved; the scheduler may run it again */
    return st == DT_OK ? 0 : st == DT_EPREEMPTED ? DT_EXIT_PREEMPTED : 1;
}
