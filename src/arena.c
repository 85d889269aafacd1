#include "internal.h"

/* ===========================================================================
 * Arenas
 *
 * Step tensors and tape nodes are bump-allocated from chunked arenas.  When
 * a step needs more than the arena holds, a new chunk is added (a heap
 * allocation); at dt_ctx_step_reset an arena with several chunks is replaced by
 * one chunk of the combined size.  After a step or two the arena fits the
 * whole step and training allocates nothing (tests/ checks this with a
 * counting allocator).
 *
 * Backward gives the gradient of each op output back once its op has run
 * (tape_run): arena_give_back keeps the block as a hole and
 * arena_alloc_reuse hands holes out again (best fit, split), so a backward
 * holds a few live gradients rather than all of them.
 * ======================================================================== */

struct dt_chunk {
    struct dt_chunk *next;
    char *base;
    size_t size, used;
};

static void *raw_alloc(dt_ctx *ctx, dt_arena *a, size_t n)
{
    return a->on_device ? ctx->be_iface->alloc(ctx->be, n) : host_alloc(ctx, n);
}

static void raw_free(dt_ctx *ctx, dt_arena *a, void *p)
{
    if (!p)
        return;
    if (a->on_device)
        ctx->be_iface->free(ctx->be, p);
    else
        host_free(ctx, p);
}

static dt_chunk *chunk_new(dt_ctx *ctx, dt_arena *a, size_t size)
{
    dt_chunk *c = host_alloc(ctx, sizeof *c);
    if (!c)
        return NULL;
    c->base = raw_alloc(ctx, a, size);
    if (!c->base) {
        host_free(ctx, c);
        return NULL;
    }
    c->size = size;
    c->used = 0;
    c->next = NULL;
    a->capacity += size;
    a->grows++;
    return c;
}

DT_PRIVATE void arena_destroy(dt_ctx *ctx, dt_arena *a)
{
    dt_chunk *c = a->first;
    while (c) {
        dt_chunk *next = c->next;
        raw_free(ctx, a, c->base);
        host_free(ctx, c);
        c = next;
    }
    a->first = a->cur = NULL;
    a->capacity = a->used = 0;
    a->n_holes = 0;
}

static size_t align_up(size_t n) { return (n + DT_ARENA_ALIGN - 1) & ~(size_t)(DT_ARENA_ALIGN - 1); }

/* The step arenas' bytes together. */
static size_t arena_total(const dt_ctx *ctx)
{
    return ctx->dev.capacity + ctx->host.capacity + ctx->scratch_dev.capacity +
           ctx->scratch_host.capacity;
}

/* Growing by *want bytes (n at least) would pass dt_ctx_config.arena_max_bytes:
 * less if n fits, else refused with the reason as the context's error
 * (ctx->arena_refused: step_new keeps it) -- 1. */
static int arena_over_cap(dt_ctx *ctx, size_t *want, size_t n)
{
    size_t total = arena_total(ctx), max = ctx->arena_max;
    if (total <= max && *want <= max - total)
        return 0;
    if (total <= max && n <= max - total) {
        *want = max - total;
        return 0;
    }
    set_error(ctx, DT_ENOMEM, "step arena: %zu MiB more of step tensors would pass its cap of %zu "
              "MiB (dt_ctx_config.arena_max_bytes); %d backward passes since the last dt_ctx_step_reset: "
              "step tensors live until dt_ctx_step_reset, so call it after each step",
              (n + ((size_t)1 << 20) - 1) >> 20, max >> 20, ctx->backwards);
    ctx->arena_refused = 1;
    return 1;
}

/* The arena grew: after many backward passes with no dt_ctx_step_reset, that is
 * most likely a loop that never calls it. */
static void arena_grew(dt_ctx *ctx)
{
    if (ctx->backwards < DT_ARENA_WARN_BACKWARDS || ctx->arena_warned)
        return;
    ctx->arena_warned = 1;
    ctx_warn(ctx, "the step arena grew to %zu MiB over %d backward passes without dt_ctx_step_reset: "
         "step tensors live until dt_ctx_step_reset, so call it after each step",
         arena_total(ctx) >> 20, ctx->backwards);
}

DT_PRIVATE void *arena_alloc(dt_ctx *ctx, dt_arena *a, size_t n)
{
    n = align_up(n ? n : 1);
    for (;;) {
        dt_chunk *c = a->cur;
        if (c && c->size - c->used >= n) {
            void *p = c->base + c->used;
            c->used += n;
            a->used += n;
            if (a->used > a->peak)
                a->peak = a->used;
            return p;
        }
        if (c && c->next) {          /* a spare chunk kept from a release */
            a->cur = c->next;
            a->cur->used = 0;
            continue;
        }
        size_t want = a->capacity > a->min_chunk ? a->capacity : a->min_chunk;
        if (want < n)
            want = n;
        if (arena_over_cap(ctx, &want, n))
            return NULL;
        dt_chunk *fresh = chunk_new(ctx, a, want);
        if (!fresh)
            return NULL;
        arena_grew(ctx);
        if (c)
            c->next = fresh;
        else
            a->first = fresh;
        a->cur = fresh;
    }
}

/* Forget everything; coalesce several chunks into one of the total size. */
DT_PRIVATE void arena_reset(dt_ctx *ctx, dt_arena *a)
{
    if (a->first && a->first->next) {
        size_t total = a->capacity;
        arena_destroy(ctx, a);
        a->first = a->cur = chunk_new(ctx, a, total);
        /* if that fails, the next alloc simply grows again */
        host_give_back(ctx);
    }
    if (a->first)
        a->first->used = 0;
    a->cur = a->first;
    a->used = 0;
    a->n_holes = 0;
}

/* An empty arena back to at most `cap` bytes in one chunk (after work with
 * larger steps, such as evaluation's batches, so training does not keep
 * their memory).  Does nothing when it is not larger or holds data. */
DT_PRIVATE size_t arena_capacity(const dt_arena *a) { return a->capacity; }

DT_PRIVATE void arena_shrink(dt_ctx *ctx, dt_arena *a, size_t cap)
{
    if (a->used || a->capacity <= cap)
        return;
    arena_destroy(ctx, a);
    if (cap)
        a->first = a->cur = chunk_new(ctx, a, cap);   /* on failure: grows again on use */
    host_give_back(ctx);
}

DT_PRIVATE dt_arena_mark arena_mark(const dt_arena *a)
{
    dt_arena_mark m = {a->cur, a->cur ? a->cur->used : 0, a->used};
    return m;
}

/* Whether the hole lies at or after the mark (allocated after it). */
static int hole_after(const dt_arena_hole *h, dt_arena_mark m)
{
    if (!m.chunk)
        return 1;
    if (h->chunk == m.chunk)
        return h->offset >= m.chunk_used;
    for (const dt_chunk *c = m.chunk->next; c; c = c->next)
        if (c == h->chunk)
            return 1;
    return 0;
}

DT_PRIVATE void arena_release(dt_arena *a, dt_arena_mark m)
{
    for (int i = 0; i < a->n_holes;)   /* holes above the mark are free space again */
        if (hole_after(&a->holes[i], m))
            a->holes[i] = a->holes[--a->n_holes];
        else
            i++;
    if (!m.chunk) {
        if (a->first)
            a->first->used = 0;
        a->cur = a->first;
        a->used = 0;
        return;
    }
    a->cur = m.chunk;
    a->cur->used = m.chunk_used;
    a->used = m.used;
}

/* Keep [p, p+n) of a's current step for arena_alloc_reuse.  Returns 0 (the
 * block simply stays used until the reset) when p is not in a or the table
 * is full. */
DT_PRIVATE int arena_give_back(dt_arena *a, void *p, size_t n)
{
    if (!p || a->n_holes == DT_ARENA_HOLES)
        return 0;
    for (dt_chunk *c = a->first; c; c = c->next) {
        char *b = p;
        if (b >= c->base && b < c->base + c->used) {
            a->holes[a->n_holes++] = (dt_arena_hole){c, (size_t)(b - c->base), align_up(n)};
            return 1;
        }
        if (c == a->cur)
            break;
    }
    return 0;
}

DT_PRIVATE size_t arena_used(const dt_arena *a) { return a->used; }

DT_PRIVATE int arena_step_give_back(dt_ctx *ctx, void *p, size_t n)
{
    return arena_give_back(&ctx->dev, p, n) || arena_give_back(&ctx->scratch_dev, p, n);
}

DT_PRIVATE int arena_refused_take(dt_ctx *ctx)
{
    int refused = ctx->arena_refused;
    ctx->arena_refused = 0;
    return refused;
}

/* n bytes from the smallest hole that holds them (its rest stays a hole),
 * else from the bump pointer as arena_alloc. */
DT_PRIVATE void *arena_alloc_reuse(dt_ctx *ctx, dt_arena *a, size_t n)
{
    n = align_up(n ? n : 1);
    int best = -1;
    for (int i = 0; i < a->n_holes; i++)
        if (a->holes[i].size >= n && (best < 0 || a->holes[i].size < a->holes[best].size))
            best = i;
    if (best < 0)
        return arena_alloc(ctx, a, n);
    dt_arena_hole *h = &a->holes[best];
    void *p = h->chunk->base + h->offset;
    h->offset += n;
    h->size -= n;
    if (!h->size)
        *h = a->holes[--a->n_holes];
    return p;   /* a->used (the bump extent, what the step touched) is unchanged */
}

void dt_ctx_step_reset(dt_ctx *ctx)
{
    if (!ctx)
        return;
    prof_step_end(ctx);
    ctx->tape = NULL;
    ctx->backwards = 0;
    ctx->arena_warned = 0;
    ctx->arena_refused = 0;
    tensor_free_doomed(ctx);
    arena_reset(ctx, &ctx->dev);
    arena_reset(ctx, &ctx->host);
    arena_reset(ctx, &ctx->scratch_dev);
    arena_reset(ctx, &ctx->scratch_host);
}

void dt_mem_stats_get(const dt_ctx *ctx, dt_mem_stats *out)
{
    if (!out)
        return;
    memset(out, 0, sizeof *out);
    if (!ctx)
        return;
    out->arena_capacity = ctx->dev.capacity + ctx->scratch_dev.capacity;
    out->arena_used = ctx->dev.used + ctx->scratch_dev.used;
    out->arena_peak = ctx->dev.peak + ctx->scratch_dev.peak;
    out->persistent_bytes = ctx->persistent_bytes;
    out->arena_grows = ctx->dev.grows + ctx->host.grows + ctx->scratch_dev.grows +
                       ctx->scratch_host.grows;
}

void dt_mem_peak_reset(dt_ctx *ctx)
{
    if (!ctx)
        return;
    ctx->dev.peak = ctx->dev.used;
    ctx->scratch_dev.peak = ctx->scratch_dev.used;
}

