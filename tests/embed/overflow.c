/*
 * tests/embed/overflow.c - a vendored program with a bug of its own: it
 * hands dt_tensor_set a buffer of 8 floats and says it holds 16.  Built with
 * AddressSanitizer from the two vendored files, the report must point into
 * src/tensor.c and backends/cpu.c, where the copy happens, not at a line of
 * dtrain.c (the #line directives of src/amalgamate.awk; build.sh's
 * embed_checks reads the report).  Exits 0 only if the overflow went
 * unnoticed, which the check counts as a failure.
 */
#include "dtrain.h"

#include <stdio.h>
#include <stdlib.h>

int main(void)
{
    dt_ctx_config cfg;
    dt_ctx_config_init(&cfg);
    dt_ctx *ctx = dt_ctx_new(&cfg);
    if (!ctx || dt_ctx_status(ctx) != DT_OK) {
        fprintf(stderr, "overflow: %s\n", ctx ? dt_last_error(ctx) : "out of memory");
        return 2;
    }
    dt_tensor *t = dt_tensor_new(ctx, DT_F32, 1, (int64_t[]){16});
    float *small = calloc(8, sizeof *small);
    if (!t || !small) {
        fprintf(stderr, "overflow: out of memory\n");
        return 2;
    }
    dt_tensor_set(t, small, 16);   /* the bug: 16 values claimed, 8 there */
    free(small);
    dt_tensor_free(t);
    dt_ctx_free(ctx);
    return 0;
}
