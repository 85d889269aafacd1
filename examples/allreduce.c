/*
 * examples/allreduce.c - the smallest distributed program:
 *
 *   build/dtrun -n 4 build/allreduce
 *
 * Every rank joins the job from the launcher's environment (dtrun, torchrun,
 * mpirun or srun), sums a vector across ranks and prints the result, then
 * sums 16 MiB (several chunks on every path) and checks every element.
 */
#include "dtrain.h"
#include "args.h"

#include <stdio.h>
#include <stdlib.h>

/* 16 MiB of small integers: their sums are exact in float */
static int big_sum_ok(dt_comm *comm, int rank, int world)
{
    int64_t n = (int64_t)4 << 20;
    float *b = malloc((size_t)n * sizeof *b);
    if (!b)
        return 0;
    for (int64_t i = 0; i < n; i++)
        b[i] = (float)((i % 13) * (rank + 1));
    int ok = dt_comm_allreduce(comm, b, n, DT_REDUCE_SUM) == DT_OK;
    for (int64_t i = 0; ok && i < n; i++)
        ok = b[i] == (float)((i % 13) * world * (world + 1) / 2);
    free(b);
    return ok;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: dtrun -n N allreduce (no options: the ranks come from the launcher)\n");
}

int main(int argc, char **argv)
{
    if (args_parse("allreduce", argc, argv, NULL, 0, ARGS_NO_OPERANDS, usage) < 0)
        return 2;
    dt_ctx *ctx = dt_ctx_new(NULL);
    if (!ctx || dt_ctx_status(ctx) != DT_OK) {
        fprintf(stderr, "allreduce: %s\n", ctx ? dt_last_error(ctx) : "out of memory");
        return 1;
    }
    dt_comm *comm = dt_comm_new(ctx, NULL, NULL);   /* environment, store, transport */
    if (!comm) {
        fprintf(stderr, "allreduce: %s\n", dt_last_error(ctx));
        dt_ctx_free(ctx);
        return 1;
    }
    int rank = dt_comm_rank(comm), world = dt_comm_size(comm);
    float v[4] = {(float)rank, 1.0f, (float)(rank * rank), 2.0f};
    int ok = dt_comm_allreduce(comm, v, 4, DT_REDUCE_SUM) == DT_OK;
    if (ok)
        printf("rank %d of %d over %s: sums %.0f %.0f %.0f %.0f (%d host%s; inside a host: %s)\n",
               rank, world, dt_comm_transport(comm), v[0], v[1], v[2], v[3], dt_comm_hosts(comm),
               dt_comm_hosts(comm) == 1 ? "" : "s", dt_comm_intra_host(comm));
    ok = ok && big_sum_ok(comm, rank, world);
    if (ok)
        printf("rank %d: 16 MiB allreduce checked\n", rank);
    else
        fprintf(stderr, "allreduce: %s\n", dt_last_error(ctx));
    dt_comm_free(comm);
    dt_ctx_free(ctx);
    return ok ? 0 : 1;
}
