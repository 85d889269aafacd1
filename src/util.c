#include "internal.h"

/* ===========================================================================
 * Utilities
 * ======================================================================== */

dt_status dt_count_correct(dt_ctx *ctx, const dt_tensor *logits, const dt_tensor *labels,
                           int64_t *correct)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (!logits || !labels || !correct)
        return set_error(ctx, DT_EINVAL, "count_correct: logits, labels and output are required");
    char s1[96], s2[96];
    if (logits->dtype != DT_F32 || labels->dtype != DT_I32 || logits->ndim != 2 ||
        labels->ndim != 1 || labels->shape[0] != logits->shape[0] ||
        !dt_tensor_is_contiguous(logits) || !dt_tensor_is_contiguous(labels))
        return set_error(ctx, DT_EINVAL, "count_correct: logits %s f32 and labels %s i32 must be "
                         "contiguous (N,C) and (N)", SHAPE(logits, s1), SHAPE(labels, s2));
    int64_t got = BE(ctx)->count_correct(BEI(ctx), logits->shape[0], logits->shape[1], FP(logits),
                                         IP(labels));
    dt_status s = be_fault(ctx, "count_correct");
    if (s != DT_OK)
        return s;
    *correct = got;
    return DT_OK;
}

double dt_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

