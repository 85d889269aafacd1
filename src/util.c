#include "internal.h"

/* ===========================================================================
 * Utilities
 * ======================================================================== */

/* --- a growing string (checkpoint headers, the profiler's report) --- */

/* Room for n more bytes and the NUL; 0 when out of memory. */
static int strbuf_reserve(strbuf *b, size_t n)
{
    if (b->oom)
        return 0;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 1024;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *p = b->ctx->al.realloc_fn(b->p, cap, b->ctx->al.user);
        if (!p) {
            b->oom = 1;
            return 0;
        }
        b->p = p;
        b->cap = cap;
    }
    return 1;
}

DT_PRIVATE void strbuf_clear(strbuf *b) { b->len = 0; }

DT_PRIVATE void strbuf_putn(strbuf *b, const char *s, size_t n)
{
    if (!strbuf_reserve(b, n))
        return;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

DT_PRIVATE void strbuf_puts(strbuf *b, const char *s)
{
    strbuf_putn(b, s, strlen(s));
}

DT_PRIVATE void strbuf_printf(strbuf *b, const char *fmt, ...)
{
    va_list ap, again;
    va_start(ap, fmt);
    va_copy(again, ap);
    int n = vsnprintf(NULL, 0, fmt, ap);   /* the length, then the text in place */
    if (n > 0 && strbuf_reserve(b, (size_t)n)) {
        vsnprintf(b->p + b->len, (size_t)n + 1, fmt, again);
        b->len += (size_t)n;
    }
    va_end(again);
    va_end(ap);
}


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


