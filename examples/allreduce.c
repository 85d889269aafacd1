/*
 * examples/allreduce.c - the smallest distributed program:
 *
 *   build/dtrun -n 4 build/allreduce
 *
 * Every rank joins the job from the launcher's environment (dtrun, torchrun,
 * mpirun or srun), sums a vector across ranks and prints the result.
 */
#include "dtrain.h"

#include <stdio.h>

int main(void)
{
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
    int ok = dt_allreduce(comm, v, 4, DT_REDUCE_SUM) == DT_OK;
    if (ok)
        printf("rank %d of %d over %s: sums %.0f %.0f %.0f %.0f\n", rank, world,
               dt_comm_transport(comm), v[0], v[1], v[2], v[3]);
    else
        fprintf(stderr, "allreduce: %s\n", dt_last_error(ctx));
    dt_comm_free(comm);
    dt_ctx_free(ctx);
    return ok ? 0 : 1;
}
