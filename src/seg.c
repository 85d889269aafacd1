#include "dist.h"

struct seg_rank {
    _Alignas(128) _Atomic uint32_t phase;   /* phases this rank has published */
    _Atomic uint32_t sleepers;              /* ranks asleep on `phase` */
    _Atomic uint32_t call_phase;            /* first phase of the call described below */
    _Atomic uint32_t progress;              /* a leader's transfers completing between hosts */
    _Atomic uint32_t kind, seq, root, op;
    _Atomic int64_t n;
};

/* ===========================================================================
 * The host segment: collectives between the ranks of one host
 *
 * Ranks on one host share a segment of POSIX shared memory, the way MPI's
 * vader and NCCL's SHM transport do.  Every local rank owns two slots of
 * seg_slot bytes; a collective copies a chunk into its slot, publishes a
 * phase counter, and reduces straight from the other ranks' slots.  A phase
 * costs one store and one cache-line read instead of a libfabric message.
 * A waiter spins for SEG_SPIN_S and then sleeps on a futex on the counter,
 * so an idle rank gives its core back to compute.  A collective run on the
 * caller's own thread (run_inline) spins up to SEG_SPIN_INLINE_S when the
 * host has a CPU for every local rank, as MPI's vader and NCCL busy-poll:
 * that thread has nothing else to do, and being woken from a futex costs
 * more than the typical wait for the other ranks (DDP's one allreduce a
 * step, 2 ranks of the benchmark MLP, medians of 8 interleaved runs: 6.71
 * ms a step with a 1 ms spin, 6.20 with 20 ms).  It still yields the CPU
 * every few iterations, and sleeps once the spin is over.
 *
 * Block k of a chunk is reduced by local rank k alone, always in local-rank
 * order, so every rank gets bit-identical results.  Slot reuse needs no
 * extra phase: a rank writes slot (g & 1) for chunk g only after passing
 * chunk g-1's first wait, and every rank publishes chunk g-1's first phase
 * after it finished reading chunk g-2.
 *
 * Mismatch detection: each rank writes a descriptor of its call next to its
 * counter before the call's first phase; after the first wait every rank
 * compares the others' with its own.  Failure: a rank that fails sets the
 * segment's abort word (with its message), which every waiter checks, and
 * waiters ask the store who died every DT_COMM_WATCH_S, as transfers do.
 */
#define SEG_ONE_PHASE ((size_t)16 << 10)   /* allreduce: one phase, every rank reduces all */

DT_PRIVATE size_t seg_ranks_offset(void) { return (sizeof(seg_head) + 127) & ~(size_t)127; }
DT_PRIVATE size_t seg_data_offset(int nlocal)
{
    return (seg_ranks_offset() + (size_t)nlocal * sizeof(seg_rank) + 4095) & ~(size_t)4095;
}

static void futex_wait_ms(_Atomic uint32_t *addr, uint32_t val, int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT, val, &ts, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *addr)
{
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int phase_reached(uint32_t have, uint32_t want) { return (int32_t)(have - want) >= 0; }

DT_PRIVATE float *seg_slot_at(dt_comm *c, int q, uint32_t chunk)
{
    return (float *)(c->seg_data + ((size_t)q * 2 + (chunk & 1)) * c->seg_slot);
}

/* A leader's transfers between hosts completed: the host's other ranks,
 * waiting for its result, see it alive. */
DT_PRIVATE void seg_heartbeat(dt_comm *c)
{
    if (c->seg && c->local_index == 0)
        atomic_fetch_add_explicit(&c->seg_ranks[0].progress, 1, memory_order_relaxed);
}

/* Tell the other local ranks this call failed, and why. */
DT_PRIVATE void seg_abort(dt_comm *c, const dt_work *w)
{
    seg_head *h = c->seg;
    uint32_t none = 0;
    if (!h || !atomic_compare_exchange_strong(&h->aborted, &none, 2))
        return;   /* another rank's reason is there (or being written) */
    snprintf(h->why, sizeof h->why, "%d|@%u|%s", (int)w->status, w->seq, w->msg);
    atomic_store(&h->aborted, 1);   /* 1: the reason is complete */
    for (int q = 0; q < c->nlocal; q++)
        futex_wake_all(&c->seg_ranks[q].phase);
}

static dt_status seg_aborted(dt_comm *c, dt_work *w)
{
    for (int i = 0; i < 100000 && atomic_load(&c->seg->aborted) == 2; i++)
        cpu_relax();   /* its writer is a few instructions from done */
    if (atomic_load(&c->seg->aborted) != 1)
        return comm_work_fail(w, DT_EPEER, "%s #%u: a rank on this host failed", comm_coll_name(w->kind),
                              w->seq);
    return comm_fail_with_reason(w, c->seg->why);
}

/* Wait until local rank q has published phase `want`.  The collective
 * timeout counts from q's last progress: a phase, or (a leader busy
 * between hosts) a completed transfer; q's process falling silent (its
 * heartbeat) fails the wait after the shorter timeout_ms
 * (comm_check_dead).  `patience` scales the collective timeout: a rank
 * waiting on its leader's inter-host step allows more, so the leader's
 * own, more precise error comes first. */
static dt_status seg_wait(dt_comm *c, dt_work *w, int q, uint32_t want, double patience)
{
    seg_rank *r = &c->seg_ranks[q];
    double limit_s = patience * c->collective_timeout_ms / 1000.0;   /* q alive: its heartbeat */
    double start = dt_now(), deadline = start + limit_s, turn = start;
    uint32_t seen = atomic_load_explicit(&r->progress, memory_order_relaxed);
    for (unsigned spin = 1;; spin++) {
        if (phase_reached(atomic_load_explicit(&r->phase, memory_order_acquire), want)) {
            comm_note_long_wait(c, w, start);
            return DT_OK;
        }
        /* (q may have published the phase, then failed a later call: the
         * abort's acquire makes that phase visible, and it stands) */
        if (atomic_load_explicit(&c->seg->aborted, memory_order_acquire))
            return phase_reached(atomic_load_explicit(&r->phase, memory_order_acquire), want)
                       ? DT_OK
                       : seg_aborted(c, w);
        if (spin % 16) {
            cpu_relax();
            continue;
        }
        double now = dt_now();
        if (now - start < (w->spin_s > 0 ? w->spin_s : SEG_SPIN_S)) {
            sched_yield();   /* several ranks per core: let the one we wait for run */
            continue;
        }
        if (comm_check_stall(c, w, &turn) != DT_OK)
            return w->status;
        c->waiting_on = c->local_ranks[q];
        if (comm_check_dead(c, w, deadline) != DT_OK) {
            /* A rank that finished this phase and then died (or we were
             * descheduled past its death) does not spoil a phase we have:
             * the next wait that needs it will fail. */
            if (phase_reached(atomic_load_explicit(&r->phase, memory_order_acquire), want) &&
                !atomic_load_explicit(&c->seg->aborted, memory_order_acquire) &&
                w->status == DT_EPEER && strstr(w->msg, "died")) {
                w->status = DT_OK;
                w->msg[0] = '\0';
                return DT_OK;
            }
            return w->status;
        }
        uint32_t prog = atomic_load_explicit(&r->progress, memory_order_relaxed);
        if (prog != seen) {
            seen = prog;
            deadline = now + limit_s;
        }
        if (now >= deadline)
            return comm_blame_silent(w, c->local_ranks[q], (int)(limit_s * 1000.0));
        atomic_fetch_add(&r->sleepers, 1);
        uint32_t v = atomic_load(&r->phase);
        if (!phase_reached(v, want) && !atomic_load(&c->seg->aborted))
            futex_wait_ms(&r->phase, v, 20);
        atomic_fetch_sub(&r->sleepers, 1);
    }
}

/* Describe this rank's call next to its counter, before its first phase.
 * call_phase 0 means "being written", so a call never starts at phase 0:
 * every rank skips it the same way, their counters being in step. */
DT_PRIVATE uint32_t seg_announce(dt_comm *c, const dt_work *w)
{
    seg_rank *me = &c->seg_ranks[c->local_index];
    if (c->seg_phase + 1 == 0)
        atomic_store(&me->phase, ++c->seg_phase);
    uint32_t p0 = c->seg_phase + 1;
    atomic_store_explicit(&me->call_phase, 0, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);   /* 0 ("being written") before the fields */
    atomic_store_explicit(&me->kind, (uint32_t)w->kind, memory_order_relaxed);
    atomic_store_explicit(&me->seq, w->seq, memory_order_relaxed);
    atomic_store_explicit(&me->root, (uint32_t)w->root, memory_order_relaxed);
    atomic_store_explicit(&me->op, (uint32_t)w->op, memory_order_relaxed);
    atomic_store_explicit(&me->n, w->n, memory_order_relaxed);
    atomic_store_explicit(&me->call_phase, p0, memory_order_release);
    return p0;
}

/* After the first wait: does every local rank's call match ours?  A rank
 * whose descriptor is already newer found us consistent and moved on. */
static dt_status seg_check(dt_comm *c, dt_work *w, uint32_t p0)
{
    for (int q = 0; q < c->nlocal; q++) {
        seg_rank *r = &c->seg_ranks[q];
        if (q == c->local_index || atomic_load_explicit(&r->call_phase, memory_order_acquire) != p0)
            continue;
        int kind = (int)atomic_load_explicit(&r->kind, memory_order_relaxed);
        uint32_t seq = atomic_load_explicit(&r->seq, memory_order_relaxed);
        int root = (int)atomic_load_explicit(&r->root, memory_order_relaxed);
        int op = (int)atomic_load_explicit(&r->op, memory_order_relaxed);
        int64_t n = atomic_load_explicit(&r->n, memory_order_relaxed);
        atomic_thread_fence(memory_order_acquire);   /* the fields before the re-check */
        if (atomic_load_explicit(&r->call_phase, memory_order_relaxed) != p0)
            continue;
        if (kind != w->kind || seq != w->seq || n != w->n || root != w->root || op != (int)w->op) {
            char mine[96], theirs[96];
            comm_describe_call(mine, sizeof mine, w->kind, w->n, w->root, (int)w->op);
            comm_describe_call(theirs, sizeof theirs, kind, n, root, op);
            if (seq != w->seq)
                return comm_work_fail(w, DT_EMISMATCH, "collective #%u: rank %d called %s, rank %d is "
                                      "at collective #%u, %s", w->seq, c->rank, mine,
                                      c->local_ranks[q], seq, theirs);
            return comm_work_fail(w, DT_EMISMATCH, "collective #%u: rank %d called %s, rank %d called %s",
                                  w->seq, c->rank, mine, c->local_ranks[q], theirs);
        }
    }
    return DT_OK;
}

/* Publish our next phase and wait for every local rank to reach it; p0
 * nonzero: this is the call's first phase (seg_announce never returns 0),
 * check the descriptors. */
DT_PRIVATE dt_status seg_sync(dt_comm *c, dt_work *w, uint32_t p0, double patience)
{
    seg_rank *me = &c->seg_ranks[c->local_index];
    uint32_t ph = ++c->seg_phase;
    atomic_store_explicit(&me->phase, ph, memory_order_seq_cst);
    if (atomic_load_explicit(&me->sleepers, memory_order_seq_cst))
        futex_wake_all(&me->phase);
    for (int q = 0; q < c->nlocal; q++)
        if (q != c->local_index && seg_wait(c, w, q, ph, patience) != DT_OK)
            return w->status;
    return p0 ? seg_check(c, w, p0) : DT_OK;
}

/* dst = a op b, elementwise; nothing aliases. */
static void reduce2(float *restrict dst, const float *restrict a, const float *restrict b, int64_t n,
                    dt_reduce_op op)
{
    if (op == DT_REDUCE_MAX)
        for (int64_t i = 0; i < n; i++)
            dst[i] = b[i] > a[i] ? b[i] : a[i];
    else if (op == DT_REDUCE_MIN)
        for (int64_t i = 0; i < n; i++)
            dst[i] = b[i] < a[i] ? b[i] : a[i];
    else
        for (int64_t i = 0; i < n; i++)
            dst[i] = a[i] + b[i];
}

/* Floats per chunk for a buffer of n floats.  Up to 4 MiB, chunks as large
 * as the caches allow (seg_chunk_small: a quarter of the L2, at most a
 * slot): fewer phases while the chunk being reduced still sits in cache.
 * Above, 256 KiB chunks: every rank's two slots stay in cache while the
 * user buffers stream (bench_allreduce, 2 ranks: 1 MiB chunks ran 16 MiB
 * at 5.7 GB/s and 256 KiB chunks at 9).  On a core with 1 MiB of L2,
 * whole 1 MiB slots ran 1 and 4 MiB at 4.5 GB/s and 256 KiB chunks at
 * 11.  Chunking never changes the arithmetic, only where the phases fall. */
static int64_t seg_chunk_floats(const dt_comm *c, int64_t n)
{
    size_t bytes = (size_t)n * sizeof(float) > SEG_LARGE && c->seg_slot > SEG_CHUNK_LARGE
                       ? SEG_CHUNK_LARGE : c->seg_chunk_small;
    return (int64_t)(bytes / sizeof(float));
}

/* dst (outside the segment) = every local rank's [lo, lo+cnt) of chunk g,
 * reduced in local-rank order. */
static void seg_reduce_block(dt_comm *c, float *dst, uint32_t g, int64_t lo, int64_t cnt,
                             dt_reduce_op op)
{
    reduce2(dst, seg_slot_at(c, 0, g) + lo, seg_slot_at(c, 1, g) + lo, cnt, op);
    for (int q = 2; q < c->nlocal; q++)
        comm_reduce_into(dst, seg_slot_at(c, q, g) + lo, cnt, op);
}

/* Copy into our own slot for the other local ranks to read, counting the
 * bytes as sent (dt_comm_bytes_sent). */
static void seg_put(dt_comm *c, void *slot, const void *src, size_t bytes)
{
    memcpy(slot, src, bytes);
    __atomic_fetch_add(&c->bytes_sent, (uint64_t)bytes, __ATOMIC_RELAXED);
}

/* Allreduce over the host's ranks (to_all) or reduce to local rank 0 (the
 * leader, for the hierarchical allreduce); scale: apply the average. */
DT_PRIVATE dt_status seg_allreduce(dt_comm *c, dt_work *w, int to_all, int scale)
{
    int L = c->nlocal, me = c->local_index;
    size_t bytes = (size_t)w->n * sizeof(float);
    uint32_t p0 = seg_announce(c, w);
    if (bytes <= SEG_ONE_PHASE && bytes <= c->seg_slot) {   /* every rank (or the leader) reduces it all */
        uint32_t g = c->seg_chunk++;
        if (bytes)
            seg_put(c, seg_slot_at(c, me, g), w->buf, bytes);
        if (seg_sync(c, w, p0, 1.0) != DT_OK)
            return w->status;
        if (w->n > 0 && (to_all || me == 0))
            seg_reduce_block(c, w->buf, g, 0, w->n, w->op);
        if (scale)
            comm_finish_avg(c, w, w->buf, w->n);
        return DT_OK;
    }
    int64_t per = seg_chunk_floats(c, w->n);
    for (int64_t off = 0; off < w->n; off += per) {
        int64_t cnt = w->n - off < per ? w->n - off : per, lo, hi;
        uint32_t g = c->seg_chunk++;
        float *mine = seg_slot_at(c, me, g), *out = w->buf + off;
        seg_put(c, mine, out, (size_t)cnt * sizeof(float));
        if (seg_sync(c, w, off == 0 ? p0 : 0, 1.0) != DT_OK)
            return w->status;
        comm_block_range(cnt, L, me, &lo, &hi);
        seg_reduce_block(c, out + lo, g, lo, hi - lo, w->op);
        if (scale)
            comm_finish_avg(c, w, out + lo, hi - lo);
        seg_put(c, mine + lo, out + lo, (size_t)(hi - lo) * sizeof(float));
        if (seg_sync(c, w, 0, 1.0) != DT_OK)
            return w->status;
        for (int q = 0; q < L && (to_all || me == 0); q++) {
            if (q == me)
                continue;
            comm_block_range(cnt, L, q, &lo, &hi);
            memcpy(out + lo, seg_slot_at(c, q, g) + lo, (size_t)(hi - lo) * sizeof(float));
        }
    }
    return DT_OK;
}

/* Local rank `from` gives buf to the host's other ranks.  p0 nonzero: the
 * call's first phase (announced); patience: see seg_wait. */
DT_PRIVATE dt_status seg_broadcast(dt_comm *c, dt_work *w, int from, float *buf, int64_t n, uint32_t p0,
                               double patience)
{
    int64_t per = seg_chunk_floats(c, n), off = 0;
    do {
        int64_t cnt = n - off < per ? n - off : per;
        uint32_t g = c->seg_chunk++;
        if (c->local_index == from && cnt > 0)
            seg_put(c, seg_slot_at(c, from, g), buf + off, (size_t)cnt * sizeof(float));
        if (seg_sync(c, w, off == 0 ? p0 : 0, patience) != DT_OK)
            return w->status;
        if (c->local_index != from && cnt > 0)
            memcpy(buf + off, seg_slot_at(c, from, g), (size_t)cnt * sizeof(float));
        off += cnt;
    } while (off < n);
    return DT_OK;
}

/* Every rank's n floats into out[rank * n], ranks all on this host. */
DT_PRIVATE dt_status seg_allgather(dt_comm *c, dt_work *w)
{
    int64_t per = seg_chunk_floats(c, w->n), off = 0, n = w->n;
    uint32_t p0 = seg_announce(c, w);
    do {
        int64_t cnt = n - off < per ? n - off : per;
        uint32_t g = c->seg_chunk++;
        if (cnt > 0)
            seg_put(c, seg_slot_at(c, c->local_index, g), w->in + off, (size_t)cnt * sizeof(float));
        if (seg_sync(c, w, off == 0 ? p0 : 0, 1.0) != DT_OK)
            return w->status;
        for (int q = 0; q < c->nlocal && cnt > 0; q++)
            memcpy(w->buf + (int64_t)c->local_ranks[q] * n + off, seg_slot_at(c, q, g),
                   (size_t)cnt * sizeof(float));
        off += cnt;
    } while (off < n);
    return DT_OK;
}

/* out = block `rank` of every rank's in (world blocks of n), reduced. */
DT_PRIVATE dt_status seg_reduce_scatter(dt_comm *c, dt_work *w)
{
    int L = c->nlocal, me = c->local_index;
    int64_t per = seg_chunk_floats(c, w->n * L) / L, off = 0, n = w->n;
    per = per > 0 ? per : 1;
    uint32_t p0 = seg_announce(c, w);
    do {
        int64_t cnt = n - off < per ? n - off : per;
        uint32_t g = c->seg_chunk++;
        float *mine = seg_slot_at(c, me, g);
        for (int q = 0; q < L && cnt > 0; q++)   /* block of local rank q, at q * cnt */
            seg_put(c, mine + q * cnt, w->in + (int64_t)c->local_ranks[q] * n + off,
                   (size_t)cnt * sizeof(float));
        if (seg_sync(c, w, off == 0 ? p0 : 0, 1.0) != DT_OK)
            return w->status;
        if (cnt > 0)
            seg_reduce_block(c, w->buf + off, g, me * cnt, cnt, w->op);
        off += cnt;
    } while (off < n);
    comm_finish_avg(c, w, w->buf, n);
    return DT_OK;
}

/* The part of rank `rank`'s block (w->aux's offsets) in [off, off + cnt),
 * relative to off: [*lo, *hi), empty when they do not meet. */
static void seg_block_in_chunk(const dt_work *w, int rank, int64_t off, int64_t cnt, int64_t *lo,
                               int64_t *hi)
{
    const int64_t *at = w->aux;
    int64_t a = at[rank] > off ? at[rank] : off, e = at[rank + 1] < off + cnt ? at[rank + 1] : off + cnt;
    *lo = a - off;
    *hi = e > a ? e - off : a - off;
}

/* Reduce-scatter in place, ranks all on this host: chunk by chunk, every
 * rank puts its chunk in its slot and reduces its own block's part of it
 * from every slot in local-rank order (as seg_reduce_block always does). */
DT_PRIVATE dt_status seg_reduce_scatter_v(dt_comm *c, dt_work *w)
{
    int me = c->local_index;
    int64_t per = seg_chunk_floats(c, w->n), off = 0, n = w->n;
    uint32_t p0 = seg_announce(c, w);
    do {
        int64_t cnt = n - off < per ? n - off : per, lo, hi;
        uint32_t g = c->seg_chunk++;
        if (cnt > 0)
            seg_put(c, seg_slot_at(c, me, g), w->buf + off, (size_t)cnt * sizeof(float));
        if (seg_sync(c, w, off == 0 ? p0 : 0, 1.0) != DT_OK)
            return w->status;
        seg_block_in_chunk(w, c->rank, off, cnt, &lo, &hi);
        if (hi > lo) {
            seg_reduce_block(c, w->buf + off + lo, g, lo, hi - lo, w->op);
            comm_finish_avg(c, w, w->buf + off + lo, hi - lo);
        }
        off += cnt;
    } while (off < n);
    return DT_OK;
}

/* Allgather in place, ranks all on this host: chunk by chunk, every rank
 * puts its block's part in its slot and copies the others' parts out. */
DT_PRIVATE dt_status seg_allgather_v(dt_comm *c, dt_work *w)
{
    int64_t per = seg_chunk_floats(c, w->n), off = 0, n = w->n;
    uint32_t p0 = seg_announce(c, w);
    do {
        int64_t cnt = n - off < per ? n - off : per, lo, hi;
        uint32_t g = c->seg_chunk++;
        seg_block_in_chunk(w, c->rank, off, cnt, &lo, &hi);
        if (hi > lo)
            seg_put(c, seg_slot_at(c, c->local_index, g) + lo, w->buf + off + lo,
                    (size_t)(hi - lo) * sizeof(float));
        if (seg_sync(c, w, off == 0 ? p0 : 0, 1.0) != DT_OK)
            return w->status;
        for (int q = 0; q < c->nlocal; q++) {
            if (q == c->local_index)
                continue;
            seg_block_in_chunk(w, c->local_ranks[q], off, cnt, &lo, &hi);
            if (hi > lo)
                memcpy(w->buf + off + lo, seg_slot_at(c, q, g) + lo, (size_t)(hi - lo) * sizeof(float));
        }
        off += cnt;
    } while (off < n);
    return DT_OK;
}

/* Alltoall inside the host: each rank puts the blocks meant for the others
 * in its slot; each reads its own block from every slot. */
DT_PRIVATE dt_status seg_alltoall(dt_comm *c, dt_work *w)
{
    int L = c->nlocal, me = c->local_index;
    int64_t per = seg_chunk_floats(c, w->n * L) / L, off = 0, n = w->n;
    per = per > 0 ? per : 1;
    uint32_t p0 = seg_announce(c, w);
    int64_t mine_at = (int64_t)c->local_ranks[me] * n;
    if (n > 0)
        memcpy(w->buf + mine_at, w->in + mine_at, (size_t)n * sizeof(float));
    do {
        int64_t cnt = n - off < per ? n - off : per;
        uint32_t g = c->seg_chunk++;
        float *slot = seg_slot_at(c, me, g);
        for (int q = 0; q < L && cnt > 0; q++)   /* the block for local rank q, at q * cnt */
            if (q != me)
                seg_put(c, slot + q * cnt, w->in + (int64_t)c->local_ranks[q] * n + off,
                        (size_t)cnt * sizeof(float));
        if (seg_sync(c, w, off == 0 ? p0 : 0, 1.0) != DT_OK)
            return w->status;
        for (int q = 0; q < L && cnt > 0; q++)
            if (q != me)
                memcpy(w->buf + (int64_t)c->local_ranks[q] * n + off, seg_slot_at(c, q, g) + me * cnt,
                       (size_t)cnt * sizeof(float));
        off += cnt;
    } while (off < n);
    return DT_OK;
}
