/*
 * backends/cpu.c - the CPU compute backend: OpenBLAS for GEMM, a small
 * pthreads pool for every other kernel.
 *
 * Device pointers are host pointers (host_visible = 1).  Every kernel is a
 * "range function" over [lo, hi) of some unit (elements, rows, planes) that
 * parallel_for() either runs inline (small work: per-op overhead matters more
 * than cores) or splits into contiguous static ranges over the pool.  A static
 * partition keeps each output element computed by one fixed sequence of
 * operations, so results are bit-identical run to run; the reductions go
 * further and sum in fixed-size blocks combined in index order, so they do not
 * depend on the thread count either (backend.h, "Determinism contract").
 *
 * In-place calls (y == x) are allowed for the elementwise kernels, so those
 * loops use no `restrict` and rely on the compiler's runtime alias checks.
 *
 * Sections:
 *   1. Tunables
 *   2. The instance and its thread pool
 *   3. Lifetime and memory
 *   4. Dense linear algebra (OpenBLAS)
 *   5. Elementwise
 *   6. Strided index spaces: binary, copy_strided
 *   7. Deterministic sums: sum, sumsq, sum_to, reduce_axis, bias_grad
 *   8. Softmax and cross entropy
 *   9. Convolution helpers
 *  10. Pooling
 *  11. Embedding
 *  12. Layer norm
 *  13. Dropout
 *  14. Optimizers
 *  15. Metrics
 *  16. The interface table
 *
 * Section 1 also holds the run-time choice of instruction set for the
 * arithmetic-bound kernels (DT_CPU_KERNEL).
 */
#include "backend.h"
#include "half.h"
#include "shape.h"

#include <cblas.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* No a*b+c fused into an FMA where the ISA has one: every instruction-set
 * level must round the same (section 1).  GCC does not fuse under -std=c11
 * (and warns about this pragma); clang fuses within a statement unless told. */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#if defined(__SSE2__)
#include <immintrin.h>
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#endif

/* Not in every cblas.h; a compatible redeclaration is harmless where it is. */
void openblas_set_num_threads(int num_threads);

/* ---------------------------------------------------------------------------
 * 1. Tunables
 *
 * Grains are the least work (in elements) worth giving one thread: below two
 * grains an op runs inline on the caller, because waking a sleeping worker
 * costs several microseconds, while relu on 128x512 takes ~5 us inline
 * (measured) and an MLP step is ~30 ops in ~4 ms.
 * ------------------------------------------------------------------------- */
#define DT_CPU_ALIGN 64            /* alloc() alignment: one cache line, AVX-512 */
#define DT_CPU_GRAIN_MEM 65536     /* memory-bound loops (copy, relu, axpby) */
#define DT_CPU_GRAIN_MATH 8192     /* loops computing exp/erf per element, divisions */
#define DT_CPU_RED_BLOCK 4096      /* deterministic sums: fixed block length */
#define DT_CPU_RED_ROUND 1024      /* block partials held on the stack at once */
#define DT_CPU_TILE 256            /* column tile of double accumulators */
#define DT_CPU_SPIN 1000           /* pause-loop iterations before sleeping: ~25 us on
                                      Zen (pause ~26 ns, measured), ~40 us on Skylake */

#if defined(__x86_64__) || defined(__i386__)
#define DT_CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define DT_CPU_RELAX() __asm__ __volatile__("yield")
#else
#define DT_CPU_RELAX() ((void)0)
#endif

/* Kernels compiled for several instruction sets, one chosen at run time.
 *
 * The installed library is compiled for baseline x86-64 (SSE2) so that it
 * runs on any x86-64 CPU.  The kernels whose loops are bound by arithmetic,
 * not memory (the exp / tanh / erf polynomials of GELU, softmax, cross
 * entropy and attention; layer norm's and the sums' double lanes; AdamW's
 * square roots and divisions; the fused convolution's column and bias
 * loops) are also compiled for AVX2 and AVX-512, and the best level this
 * CPU and OS support is taken at the first backend init.  AVX-512 against
 * SSE2, measured: GELU 3.7-4.2x, softmax, cross entropy and layer norm 2x,
 * attention 1.6x, AdamW 1.4x; the small GPT's step 1.25x (docs/
 * PERFORMANCE.md, "The portable build").  Memory-bound loops (axpby,
 * copies, pooling) run as fast in SSE2 and are compiled once.  The exp
 * loops vectorize below AVX-512 only with -fno-trapping-math (build.sh).
 *
 * Every level computes the same bits: the same C arithmetic; no FMA fusion
 * (-ffp-contract=off in build.sh, GCC's default under -std=c11 anyway, and
 * the pragma above for clang); elementwise loops, whose results do not
 * depend on the vector width; and sums whose lanes and order are written
 * out.  DTRAIN_CPU_KERNELS=baseline or avx2 caps the level (tests compare
 * them); with DTRAIN_LOG set the level in use is printed to stderr once per
 * process.
 *
 * DT_CPU_KERNEL(name, p, lo, hi) { body } defines the range function name:
 * body is compiled as name_body, and again inside name_avx2 and
 * name_avx512 (flatten: everything it calls is inlined there, so it is
 * compiled for that ISA too); name calls the one for dt_cpu_level. */
enum { DT_CPU_BASELINE = 0, DT_CPU_AVX2, DT_CPU_AVX512, DT_CPU_LEVELS };
static const char *const dt_cpu_level_name[DT_CPU_LEVELS] = {"baseline", "avx2", "avx512"};
static int dt_cpu_level;   /* written once (cpu_level_once) before any kernel runs */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(DT_CPU_NO_DISPATCH)
#define DT_CPU_DISPATCH 1
#define DT_CPU_TARGET_AVX2 __attribute__((target("avx2"), flatten))
#define DT_CPU_TARGET_AVX512 \
    __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq"), flatten))
#define DT_CPU_KERNEL(name, p, lo, hi)                                                 \
    static void name##_body(void *p, int64_t lo, int64_t hi);                         \
    static DT_CPU_TARGET_AVX2 void name##_avx2(void *p, int64_t lo, int64_t hi)        \
    {                                                                                 \
        name##_body(p, lo, hi);                                                       \
    }                                                                                 \
    static DT_CPU_TARGET_AVX512 void name##_avx512(void *p, int64_t lo, int64_t hi)    \
    {                                                                                 \
        name##_body(p, lo, hi);                                                       \
    }                                                                                 \
    static void name(void *p, int64_t lo, int64_t hi)                                 \
    {                                                                                 \
        if (dt_cpu_level == DT_CPU_AVX512)                                            \
            name##_avx512(p, lo, hi);                                                 \
        else if (dt_cpu_level == DT_CPU_AVX2)                                         \
            name##_avx2(p, lo, hi);                                                   \
        else                                                                          \
            name##_body(p, lo, hi);                                                   \
    }                                                                                 \
    static void name##_body(void *p, int64_t lo, int64_t hi)
#else   /* one compilation, for whatever the compiler targets */
#define DT_CPU_KERNEL(name, p, lo, hi) static void name(void *p, int64_t lo, int64_t hi)
#endif

/* The highest level compiled in and supported by this CPU (and its OS's
 * saved register state: __builtin_cpu_supports checks both). */
static int cpu_best_level(void)
{
#ifdef DT_CPU_DISPATCH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq"))
        return DT_CPU_AVX512;
    if (__builtin_cpu_supports("avx2"))
        return DT_CPU_AVX2;
#endif
    return DT_CPU_BASELINE;
}

/* The level the compiler's own flags already give every copy (-march). */
static int cpu_compiled_level(void)
{
#if defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
    return DT_CPU_AVX512;
#elif defined(__AVX2__)
    return DT_CPU_AVX2;
#else
    return DT_CPU_BASELINE;
#endif
}

/* "dtrain: cpu kernels: avx512 (of baseline, avx2, avx512; best on this CPU:
 * avx512)": the code that runs, the copies there are (a -march=native build
 * has one, for its CPU) and the best of them this CPU runs. */
static void cpu_level_report(int level, int best, const char *cap)
{
    int built = cpu_compiled_level();
#ifdef DT_CPU_DISPATCH
    char list[64] = "";
    for (int l = built; l < DT_CPU_LEVELS; l++)
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", l > built ? ", " : "",
                 dt_cpu_level_name[l]);
    fprintf(stderr, "dtrain: cpu kernels: %s (of %s; best on this CPU: %s%s%s)\n",
            dt_cpu_level_name[level > built ? level : built], list,
            dt_cpu_level_name[best > built ? best : built], cap ? "; DTRAIN_CPU_KERNELS=" : "",
            cap ? cap : "");
#else
    (void)level, (void)best, (void)cap;
    fprintf(stderr, "dtrain: cpu kernels: %s (one copy: no run-time choice in this build)\n",
            dt_cpu_level_name[built]);
#endif
}

static void cpu_level_init(void)
{
    int best = cpu_best_level(), level = best;
    const char *cap = getenv("DTRAIN_CPU_KERNELS");
    for (int l = 0; cap && l < DT_CPU_LEVELS; l++)
        if (strcmp(cap, dt_cpu_level_name[l]) == 0 && l < best) level = l;
    dt_cpu_level = level;
    const char *log = getenv("DTRAIN_LOG");
    if (log && *log) cpu_level_report(level, best, cap);
}

static pthread_once_t cpu_level_once = PTHREAD_ONCE_INIT;

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* ---------------------------------------------------------------------------
 * 2. The instance and its thread pool
 *
 * threads-1 workers plus the caller.  A job is posted by bumping `gen`; each
 * worker runs its part (index + 1; the caller runs part 0) and decrements
 * `pending`.  Idle workers spin briefly, then sleep on `wake`: OpenBLAS's own
 * threads need the same cores between our jobs.
 * ------------------------------------------------------------------------- */
typedef void (*dt_cpu_range_fn)(void *arg, int64_t lo, int64_t hi);

typedef struct dt_cpu_worker {
    struct dt_backend *be;
    int index;
    pthread_t tid;
} dt_cpu_worker;

struct dt_backend {
    dt_allocator al;
    int threads;
    int nworkers;                 /* threads - 1 */
    dt_cpu_worker *workers;
    pthread_mutex_t mu;
    pthread_cond_t wake;          /* workers sleep here between jobs */
    pthread_cond_t done;          /* the caller sleeps here for the last worker */
    atomic_uint_fast64_t gen;     /* bumped to post a job (or the stop request) */
    atomic_int pending;           /* workers yet to finish the current job */
    atomic_int stop;
    /* the current job, written before gen is bumped */
    dt_cpu_range_fn fn;
    void *arg;
    int64_t n;
    int parts;
    /* scratch for the fused convolution: one block per pool part, grown on
     * the caller's thread (the allocator hooks need not be thread-safe) */
    float *scratch;
    size_t scratch_floats;
    /* cpu-staged only (3.1): copies queued until a wait or join runs them */
    pthread_mutex_t qmu;
    struct staged_copy *queue;
    size_t queued, queue_cap;
    uint64_t tickets;             /* last ticket handed out */
};

/* Start of part i of `parts` contiguous ranges over [0, n): floor(n*i/parts)
 * without overflow. */
static int64_t part_start(int64_t n, int parts, int i)
{
    return (n / parts) * i + (n % parts) * i / parts;
}

static uint_fast64_t pool_wait_job(dt_backend *be, uint_fast64_t seen)
{
    uint_fast64_t g;
    for (int s = 0; s < DT_CPU_SPIN; s++) {
        g = atomic_load_explicit(&be->gen, memory_order_acquire);
        if (g != seen) return g;
        DT_CPU_RELAX();
    }
    pthread_mutex_lock(&be->mu);
    while ((g = atomic_load(&be->gen)) == seen) pthread_cond_wait(&be->wake, &be->mu);
    pthread_mutex_unlock(&be->mu);
    return g;
}

static void *pool_worker_main(void *p)
{
    dt_cpu_worker *w = p;
    dt_backend *be = w->be;
    uint_fast64_t seen = 0;
    for (;;) {
        seen = pool_wait_job(be, seen);
        if (atomic_load(&be->stop)) break;
        int part = w->index + 1;
        if (part < be->parts) {
            be->fn(be->arg, part_start(be->n, be->parts, part),
                   part_start(be->n, be->parts, part + 1));
        }
        if (atomic_fetch_sub(&be->pending, 1) == 1) {
            /* signal under the lock: the caller checks `pending` holding it */
            pthread_mutex_lock(&be->mu);
            pthread_cond_signal(&be->done);
            pthread_mutex_unlock(&be->mu);
        }
    }
    return NULL;
}

/* Run fn over [0, n) in contiguous static parts of at least `grain` units;
 * inline when there is less than two grains of work or one thread. */
static void parallel_for(dt_backend *be, int64_t n, int64_t grain, dt_cpu_range_fn fn, void *arg)
{
    if (n <= 0) return;
    int64_t want = n / (grain > 0 ? grain : 1);
    int parts = want < be->threads ? (int)want : be->threads;
    if (parts <= 1) {
        fn(arg, 0, n);
        return;
    }
    be->fn = fn;
    be->arg = arg;
    be->n = n;
    be->parts = parts;
    atomic_store(&be->pending, be->nworkers);
    pthread_mutex_lock(&be->mu);
    atomic_fetch_add(&be->gen, 1);
    pthread_cond_broadcast(&be->wake);
    pthread_mutex_unlock(&be->mu);

    fn(arg, 0, part_start(n, parts, 1));

    for (int s = 0; s < DT_CPU_SPIN; s++) {
        if (atomic_load_explicit(&be->pending, memory_order_acquire) == 0) return;
        DT_CPU_RELAX();
    }
    pthread_mutex_lock(&be->mu);
    while (atomic_load(&be->pending) != 0) pthread_cond_wait(&be->done, &be->mu);
    pthread_mutex_unlock(&be->mu);
}

/* Parallel grain in units of `unit_work` elements each. */
static int64_t grain_units(int64_t grain_elems, int64_t unit_work)
{
    return max64(1, grain_elems / max64(1, unit_work));
}

/* ---------------------------------------------------------------------------
 * 3. Lifetime and memory
 * ------------------------------------------------------------------------- */
static void pool_stop(dt_backend *be, int started)
{
    pthread_mutex_lock(&be->mu);
    atomic_store(&be->stop, 1);
    atomic_fetch_add(&be->gen, 1);
    pthread_cond_broadcast(&be->wake);
    pthread_mutex_unlock(&be->mu);
    for (int i = 0; i < started; i++) pthread_join(be->workers[i].tid, NULL);
}

static void cpu_free(dt_backend *be, void *ptr);

static void cpu_shutdown(dt_backend *be)
{
    if (!be) return;
    if (be->workers) pool_stop(be, be->nworkers);
    pthread_cond_destroy(&be->done);
    pthread_cond_destroy(&be->wake);
    pthread_mutex_destroy(&be->mu);
    pthread_mutex_destroy(&be->qmu);
    if (be->queue) be->al.free_fn(be->queue, be->al.user);
    if (be->workers) be->al.free_fn(be->workers, be->al.user);
    cpu_free(be, be->scratch);
    be->al.free_fn(be, be->al.user);
}

static dt_status cpu_init(const dt_backend_params *p, dt_backend **out, char *err, size_t err_len)
{
    int threads = p->threads > 0 ? p->threads : 1;
    int started = 0;
    *out = NULL;
    pthread_once(&cpu_level_once, cpu_level_init);
    dt_backend *be = p->allocator.malloc_fn(sizeof *be, p->allocator.user);
    if (!be) {
        if (err_len) snprintf(err, err_len, "cpu backend: out of memory");
        return DT_ENOMEM;
    }
    memset(be, 0, sizeof *be);
    be->al = p->allocator;
    be->threads = threads;
    be->nworkers = threads - 1;
    atomic_init(&be->gen, 0);
    atomic_init(&be->pending, 0);
    atomic_init(&be->stop, 0);
    pthread_mutex_init(&be->mu, NULL);
    pthread_mutex_init(&be->qmu, NULL);
    pthread_cond_init(&be->wake, NULL);
    pthread_cond_init(&be->done, NULL);
    if (be->nworkers > 0) {
        be->workers = be->al.malloc_fn(sizeof(dt_cpu_worker) * (size_t)be->nworkers, be->al.user);
        if (!be->workers) {
            if (err_len)
                snprintf(err, err_len, "cpu backend: out of memory for %d threads", threads);
            goto fail;
        }
        for (; started < be->nworkers; started++) {
            dt_cpu_worker *w = &be->workers[started];
            w->be = be;
            w->index = started;
            if (pthread_create(&w->tid, NULL, pool_worker_main, w) != 0) {
                if (err_len)
                    snprintf(err, err_len, "cpu backend: cannot start worker thread %d of %d",
                             started + 1, be->nworkers);
                goto fail;
            }
        }
    }
    /* OpenBLAS runs single-threaded; large GEMMs are split over our own pool
     * (section 4).  OpenBLAS's pthread workers busy-wait in sched_yield
     * between calls, which on a 2-core machine took ~25% of the CPU from
     * our pool's elementwise work (perf, CNN step at 2 threads). */
    openblas_set_num_threads(1);
    *out = be;
    return DT_OK;

fail:
    if (be->workers) {
        pool_stop(be, started);
        be->al.free_fn(be->workers, be->al.user);
        be->workers = NULL;
    }
    cpu_shutdown(be);
    return DT_ENOMEM;
}

/* Over-allocate, align up, and stash the original pointer just before the
 * aligned block so free() can find it. */
static void *cpu_alloc(dt_backend *be, size_t bytes)
{
    size_t extra = DT_CPU_ALIGN + sizeof(void *);
    if (bytes > SIZE_MAX - extra) return NULL;
    char *raw = be->al.malloc_fn(bytes + extra, be->al.user);
    if (!raw) return NULL;
    uintptr_t a = (uintptr_t)raw + sizeof(void *) + DT_CPU_ALIGN - 1;
    void *aligned = (void *)(a & ~(uintptr_t)(DT_CPU_ALIGN - 1));
    memcpy((char *)aligned - sizeof(void *), &raw, sizeof raw);
    return aligned;
}

static void cpu_free(dt_backend *be, void *ptr)
{
    if (!ptr) return;
    void *raw;
    memcpy(&raw, (char *)ptr - sizeof(void *), sizeof raw);
    be->al.free_fn(raw, be->al.user);
}

/* The whole pages inside [ptr, ptr + bytes) go back to the system; they
 * read as zeros until written (MADV_DONTNEED on private memory).  Pages
 * the range only touches stay: other data may share them.  Memory given
 * back is written again soon (zero 3 gathers the same unit at its next
 * use), one fault a page: the 2 MiB-aligned middle is marked for
 * transparent huge pages, so it comes back in 2 MiB faults, 512 times
 * fewer (where THP is "madvise" or "always"; a huge page only partly
 * discarded is split and its discarded part still freed). */
static void cpu_discard(dt_backend *be, void *ptr, size_t bytes)
{
    (void)be;
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t p = page > 0 ? (uintptr_t)page : 4096, huge = (uintptr_t)2 << 20;
    uintptr_t lo = ((uintptr_t)ptr + p - 1) & ~(p - 1), hi = ((uintptr_t)ptr + bytes) & ~(p - 1);
    if (hi > lo)
        madvise((void *)lo, hi - lo, MADV_DONTNEED);
#ifdef MADV_HUGEPAGE
    uintptr_t hlo = ((uintptr_t)ptr + huge - 1) & ~(huge - 1), hhi = ((uintptr_t)ptr + bytes) & ~(huge - 1);
    if (hhi > hlo)
        madvise((void *)hlo, hhi - hlo, MADV_HUGEPAGE);
#endif
}

static void cpu_memcpy(dt_backend *be, void *dst, const void *src, size_t bytes)
{
    (void)be;
    if (bytes && dst != src) memcpy(dst, src, bytes);
}

/* --- 3.1 the staged variant ------------------------------------------------
 * "cpu-staged" is this backend with host_visible = 0: the core then takes
 * the paths a GPU needs (staging buffers, asynchronous copies, no direct
 * reads of tensor memory), and CI runs them without a GPU.  An asynchronous
 * copy is not made until someone waits for it (or for a later ticket), as
 * if the copy stream were very slow: a reader that forgets to wait sees
 * stale data, and a source freed before the wait is a use-after-free that
 * AddressSanitizer reports.  Copies run in ticket order, like one stream. */
typedef struct staged_copy {
    void *dst;
    const void *src;
    size_t bytes;
    uint64_t ticket;
} staged_copy;

static uint64_t staged_copy_async(dt_backend *be, void *dst, const void *src, size_t bytes,
                                  int dir)
{
    (void)dir;
    pthread_mutex_lock(&be->qmu);
    if (be->queued == be->queue_cap) {
        size_t cap = be->queue_cap ? 2 * be->queue_cap : 64;
        staged_copy *q = be->al.realloc_fn(be->queue, cap * sizeof *q, be->al.user);
        if (!q) {   /* no room to queue it: copy now (still correct, just not deferred) */
            pthread_mutex_unlock(&be->qmu);
            if (bytes) memcpy(dst, src, bytes);
            return 0;
        }
        be->queue = q;
        be->queue_cap = cap;
    }
    uint64_t t = ++be->tickets;
    be->queue[be->queued++] = (staged_copy){dst, src, bytes, t};
    pthread_mutex_unlock(&be->qmu);
    return t;
}

/* Device memory gives pages back by unmapping them (backend.h, discard and
 * commit): a touch before commit maps them again is a fault, not a page
 * coming back as on the CPU.  cpu-staged does the same with mprotect, so a
 * core path that reads or writes discarded memory without commit crashes
 * under test here instead of on a GPU.  Its blocks carry their size (at
 * aligned - 16; cpu_alloc's raw pointer stays at aligned - 8, so either
 * free works), and a block is made accessible again before it is freed. */
static void *staged_alloc(dt_backend *be, size_t bytes)
{
    size_t extra = DT_CPU_ALIGN + 2 * sizeof(void *);
    if (bytes > SIZE_MAX - extra) return NULL;
    char *raw = be->al.malloc_fn(bytes + extra, be->al.user);
    if (!raw) return NULL;
    uintptr_t a = (uintptr_t)raw + 2 * sizeof(void *) + DT_CPU_ALIGN - 1;
    char *aligned = (char *)(a & ~(uintptr_t)(DT_CPU_ALIGN - 1));
    memcpy(aligned - sizeof(void *), &raw, sizeof raw);
    memcpy(aligned - 2 * sizeof(void *), &bytes, sizeof bytes);
    return aligned;
}

/* The pages [ptr, ptr + bytes) touches accessible again. */
static dt_status staged_commit(dt_backend *be, void *ptr, size_t bytes)
{
    (void)be;
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t p = page > 0 ? (uintptr_t)page : 4096;
    uintptr_t lo = (uintptr_t)ptr & ~(p - 1), hi = ((uintptr_t)ptr + bytes + p - 1) & ~(p - 1);
    if (bytes && mprotect((void *)lo, hi - lo, PROT_READ | PROT_WRITE) != 0) return DT_ENOMEM;
    return DT_OK;
}

static void staged_free(dt_backend *be, void *ptr)
{
    if (!ptr) return;
    size_t bytes;
    memcpy(&bytes, (char *)ptr - 2 * sizeof(void *), sizeof bytes);
    if (bytes >= 4096)   /* smaller, no whole page inside: never made inaccessible */
        (void)staged_commit(be, ptr, bytes);
    cpu_free(be, ptr);
}

/* The CPU's discard, and the whole pages inside inaccessible until committed. */
static void staged_discard(dt_backend *be, void *ptr, size_t bytes)
{
    cpu_discard(be, ptr, bytes);
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t p = page > 0 ? (uintptr_t)page : 4096;
    uintptr_t lo = ((uintptr_t)ptr + p - 1) & ~(p - 1), hi = ((uintptr_t)ptr + bytes) & ~(p - 1);
    if (hi > lo)
        (void)mprotect((void *)lo, hi - lo, PROT_NONE);
}

/* Run every queued copy up to and including ticket t, in order. */
static void staged_copy_wait(dt_backend *be, uint64_t t)
{
    pthread_mutex_lock(&be->qmu);
    size_t k = 0;
    while (k < be->queued && be->queue[k].ticket <= t) {
        if (be->queue[k].bytes) memcpy(be->queue[k].dst, be->queue[k].src, be->queue[k].bytes);
        k++;
    }
    memmove(be->queue, be->queue + k, (be->queued - k) * sizeof *be->queue);
    be->queued -= k;
    pthread_mutex_unlock(&be->qmu);
}

/* The compute stream waits: here compute is synchronous, so the copy runs now. */
static void staged_copy_join(dt_backend *be, uint64_t t) { staged_copy_wait(be, t); }

static void cpu_memset0(dt_backend *be, void *dst, size_t bytes)
{
    (void)be;
    if (bytes) memset(dst, 0, bytes);
}

static void cpu_sync(dt_backend *be) { (void)be; }

/* ---------------------------------------------------------------------------
 * 4. Dense linear algebra (OpenBLAS)
 *
 * OpenBLAS threads the large GEMMs itself with the thread count set at init.
 * ------------------------------------------------------------------------- */

/* C (M,N) = beta*C for the K == 0 case, which cblas would reject (lda >= 1)
 * with a message on stderr. */
static void gemm_scale_c(int64_t m, int64_t n, float beta, float *c, int64_t ldc)
{
    for (int64_t i = 0; i < m; i++) {
        float *row = c + i * ldc;
        for (int64_t j = 0; j < n; j++) row[j] = beta == 0.0f ? 0.0f : beta * row[j];
    }
}

/* One single-threaded GEMM on the calling thread (safe inside pool jobs).
 * C (M,N) = alpha op(A) op(B) + beta C; A (M,K) or (K,M) if ta; B (K,N) or (N,K) if tb */
static void gemm_serial(int ta, int tb, int64_t m, int64_t n, int64_t k, float alpha,
                        const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                        float *c, int64_t ldc)
{
    if (m <= 0 || n <= 0) return;
    if (k <= 0) {
        gemm_scale_c(m, n, beta, c, ldc);
        return;
    }
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                (int)m, (int)n, (int)k, alpha, a, (int)lda, b, (int)ldb, beta, c, (int)ldc);
}

/* GEMMs below this many multiply-adds run on the caller: waking a worker
 * costs a few microseconds, about what 1M multiply-adds take on one core. */
#define DT_CPU_GEMM_SPLIT_MNK (1024.0 * 1024.0)
#define DT_CPU_GEMM_BLOCK 32      /* rows/columns per split unit */

typedef struct gemm_split_args {
    int ta, tb, by_rows;
    int64_t m, n, k, lda, ldb, ldc;
    float alpha, beta;
    const float *a, *b;
    float *c;
} gemm_split_args;

/* units of DT_CPU_GEMM_BLOCK rows (by_rows) or columns of C */
static void gemm_split_range(void *p, int64_t lo, int64_t hi)
{
    const gemm_split_args *G = p;
    int64_t dim = G->by_rows ? G->m : G->n;
    int64_t i0 = lo * DT_CPU_GEMM_BLOCK, i1 = min64(hi * DT_CPU_GEMM_BLOCK, dim);
    if (i1 <= i0) return;
    if (G->by_rows) /* rows i0..i1 of op(A) and C */
        gemm_serial(G->ta, G->tb, i1 - i0, G->n, G->k, G->alpha,
                    G->a + (G->ta ? i0 : i0 * G->lda), G->lda, G->b, G->ldb, G->beta,
                    G->c + i0 * G->ldc, G->ldc);
    else            /* columns i0..i1 of op(B) and C */
        gemm_serial(G->ta, G->tb, G->m, i1 - i0, G->k, G->alpha, G->a, G->lda,
                    G->b + (G->tb ? i0 * G->ldb : i0), G->ldb, G->beta, G->c + i0, G->ldc);
}

/* C (M,N) = alpha op(A) op(B) + beta C, split over the pool along the larger
 * of M and N.  Each element of C is computed by one single-threaded call
 * whose extent depends only on the thread count: deterministic. */
static void cpu_gemm(dt_backend *be, int ta, int tb, int64_t m, int64_t n, int64_t k, float alpha,
                     const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c,
                     int64_t ldc)
{
    double mnk = (double)m * (double)n * (double)k;
    if (be->threads <= 1 || mnk < DT_CPU_GEMM_SPLIT_MNK || k <= 0) {
        gemm_serial(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    gemm_split_args G = {.ta = ta, .tb = tb, .by_rows = m > n, .m = m, .n = n, .k = k,
                         .lda = lda, .ldb = ldb, .ldc = ldc, .alpha = alpha, .beta = beta,
                         .a = a, .b = b, .c = c};
    int64_t units = ((G.by_rows ? m : n) + DT_CPU_GEMM_BLOCK - 1) / DT_CPU_GEMM_BLOCK;
    parallel_for(be, units, 1, gemm_split_range, &G);
}

/* OpenBLAS runs a GEMM with m*n*k <= 65536 * 4 on the calling thread (its
 * GEMM_MULTITHREAD_THRESHOLD), so a batch of such GEMMs would leave the other
 * cores idle: split the batch over the pool instead (32 x 64^3 at 2 threads:
 * 120 us split vs 234 us looped, measured).  Larger GEMMs are threaded by
 * OpenBLAS itself and are looped (no gain from splitting, measured); that
 * also avoids changing OpenBLAS's thread count, which is process-wide. */
#define DT_CPU_GEMM_SERIAL_MNK (65536.0 * 4)

typedef struct gemm_args {
    int ta, tb;
    int64_t m, n, k, lda, ldb, ldc, stride_a, stride_b, stride_c;
    float alpha, beta;
    const float *a, *b;
    float *c;
} gemm_args;

static void gemm_batch_range(void *p, int64_t lo, int64_t hi)
{
    const gemm_args *G = p;
    for (int64_t i = lo; i < hi; i++)
        gemm_serial(G->ta, G->tb, G->m, G->n, G->k, G->alpha, G->a + i * G->stride_a, G->lda,
                    G->b + i * G->stride_b, G->ldb, G->beta, G->c + i * G->stride_c, G->ldc);
}

/* batch x [C_i (M,N) = alpha op(A_i) op(B_i) + beta C_i]; stride_b may be 0 */
static void cpu_gemm_batched(dt_backend *be, int64_t batch, int ta, int tb, int64_t m, int64_t n,
                             int64_t k, float alpha, const float *a, int64_t lda, int64_t stride_a,
                             const float *b, int64_t ldb, int64_t stride_b, float beta, float *c,
                             int64_t ldc, int64_t stride_c)
{
    gemm_args G = {.ta = ta, .tb = tb, .m = m, .n = n, .k = k, .lda = lda, .ldb = ldb,
                   .ldc = ldc, .stride_a = stride_a, .stride_b = stride_b, .stride_c = stride_c,
                   .alpha = alpha, .beta = beta, .a = a, .b = b, .c = c};
    double mnk = (double)m * (double)n * (double)k;
    if (mnk > DT_CPU_GEMM_SERIAL_MNK) {   /* big: each GEMM split over the pool */
        for (int64_t i = 0; i < batch; i++)
            cpu_gemm(be, ta, tb, m, n, k, alpha, a + i * stride_a, lda, b + i * stride_b, ldb,
                     beta, c + i * stride_c, ldc);
        return;
    }
    /* at least one 64^3-sized GEMM's work per part */
    int64_t grain = mnk > 0 ? (int64_t)(DT_CPU_GEMM_SERIAL_MNK / mnk) : batch;
    parallel_for(be, batch, max64(1, grain), gemm_batch_range, &G);
}

/* ---------------------------------------------------------------------------
 * 5. Elementwise
 * ------------------------------------------------------------------------- */
typedef struct ew_args {
    int op;
    float alpha, beta;
    const float *x, *y, *dy;
    float *out;
    int accumulate;
} ew_args;

/* y (n) = value */
static void fill_range(void *p, int64_t lo, int64_t hi)
{
    const ew_args *A = p;
    float v = A->alpha, *y = A->out;
    for (int64_t i = lo; i < hi; i++) y[i] = v;
}

static void cpu_fill(dt_backend *be, int64_t n, float value, float *y)
{
    ew_args A = {.alpha = value, .out = y};
    parallel_for(be, n, DT_CPU_GRAIN_MEM, fill_range, &A);
}

/* y (n) = alpha x + beta y; beta == 0 does not read y (it may hold NaN) */
static void axpby_range(void *p, int64_t lo, int64_t hi)
{
    const ew_args *A = p;
    const float *x = A->x;
    float *y = A->out, a = A->alpha, b = A->beta;
    if (b == 0.0f) {
        for (int64_t i = lo; i < hi; i++) y[i] = a * x[i];
    } else if (b == 1.0f) {
        for (int64_t i = lo; i < hi; i++) y[i] = a * x[i] + y[i];
    } else {
        for (int64_t i = lo; i < hi; i++) y[i] = a * x[i] + b * y[i];
    }
}

static void cpu_axpby(dt_backend *be, int64_t n, float alpha, const float *x, float beta, float *y)
{
    ew_args A = {.alpha = alpha, .beta = beta, .x = x, .out = y};
    parallel_for(be, n, DT_CPU_GRAIN_MEM, axpby_range, &A);
}

/* ---- branch-free float math ---------------------------------------------
 * libm's expf/erff/tanhf are calls that keep a loop from vectorizing (3-10 ns
 * an element, measured); these inline, branch-free versions let the loops
 * that call them vectorize (gelu 2.8x, tanh 10x, sigmoid 5x faster on
 * 128x512, measured).  They need IEEE semantics (no -ffast-math).
 * Accuracy against double libm, measured: exp < 1 ulp (Cephes polynomial),
 * tanh 1.2 ulp, sigmoid 1.1e-7 relative, normal CDF Phi 1.9e-7 absolute and
 * 4.2e-6 relative for |x| < 6 (Numerical Recipes' erfcc, accurate in the tail
 * where PyTorch's Abramowitz-Stegun erf has only 1.5e-7 absolute), gelu
 * 7e-8 * (1 + |gelu|). */
#define DT_SQRT1_2 0.70710678118654752440f
#define DT_INV_SQRT_2PI 0.39894228040143267794f

static inline uint32_t f2u(float f)
{
    union { float f; uint32_t u; } c = {.f = f};
    return c.u;
}
static inline float u2f(uint32_t u)
{
    union { uint32_t u; float f; } c = {.u = u};
    return c.f;
}

/* exp(x) = 2^n exp(r), n = round(x log2 e), |r| <= ln2/2.  Results below
 * exp(-85.9) ~ 5e-38 flush to 0 (so exp(-inf) = 0); above 88.72, inf. */
static inline float dt_expf(float x)
{
    const float magic = 0x1.8p23f; /* adding it rounds to an integer in the low bits */
    float xc = x > 88.72283f ? 88.72283f : x;
    xc = xc < -85.9f ? -85.9f : xc;
    float t = xc * 1.44269504088896341f + magic;
    float n = t - magic;
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    /* scale by 2^(n-1) in the exponent bits, then by 2: n in [-124, 128] keeps
     * every intermediate normal */
    uint32_t k = f2u(t) - f2u(magic);
    float y = u2f(f2u(p) + ((k - 1u) << 23)) * 2.0f;
    y = x < -85.9f ? 0.0f : y;
    y = x > 88.72283f ? INFINITY : y;
    return x != x ? x : y;
}

/* tanh: odd polynomial near 0 (no cancellation), 1 - 2/(e^2|x| + 1) beyond */
static inline float dt_tanhf(float x)
{
    float ax = fabsf(x), z = x * x;
    float p = -5.70498872745e-3f;
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    float small = p * z * x + x;
    float big = 1.0f - 2.0f / (dt_expf(2.0f * ax) + 1.0f);
    big = x < 0.0f ? -big : big;
    return ax < 0.625f ? small : big;
}

/* erfc(z) for z >= 0, Numerical Recipes' erfcc (Chebyshev fit) */
static inline float dt_erfc_pos(float z)
{
    float t = 1.0f / (1.0f + 0.5f * z);
    float p = 0.17087277f;
    p = p * t - 0.82215223f;
    p = p * t + 1.48851587f;
    p = p * t - 1.13520398f;
    p = p * t + 0.27886807f;
    p = p * t - 0.18628806f;
    p = p * t + 0.09678418f;
    p = p * t + 0.37409196f;
    p = p * t + 1.00002368f;
    p = p * t - 1.26551223f;
    return t * dt_expf(p - z * z);
}

/* standard normal CDF Phi(x) = erfc(-x / sqrt 2) / 2, from the tail that
 * keeps it well conditioned */
static inline float dt_normcdf(float x)
{
    float h = 0.5f * dt_erfc_pos(fabsf(x) * DT_SQRT1_2);
    return x < 0.0f ? h : 1.0f - h;
}

/* exact gelu x Phi(x) = 0.5 x (1 + erf(x / sqrt 2)), and its derivative
 * Phi(x) + x phi(x) */
static inline float gelu_f(float x) { return x * dt_normcdf(x); }
static inline float gelu_grad(float x)
{
    return dt_normcdf(x) + x * DT_INV_SQRT_2PI * dt_expf(-0.5f * x * x);
}
static inline float sigmoid_f(float x) { return 1.0f / (1.0f + dt_expf(-x)); }

/* GPT-2's tanh form of gelu, and its derivative */
#define DT_GELU_K 0.7978845608028654f   /* sqrt(2/pi) */
static inline float gelu_tanh_f(float x)
{
    return 0.5f * x * (1.0f + dt_tanhf(DT_GELU_K * (x + 0.044715f * x * x * x)));
}
static inline float gelu_tanh_grad(float x)
{
    float t = dt_tanhf(DT_GELU_K * (x + 0.044715f * x * x * x));
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * DT_GELU_K * (1.0f + 0.134145f * x * x);
}

/* NaN-propagating max, as torch.amax */
static inline float max_nan(float m, float v) { return ((v > m) | (v != v)) ? v : m; }

/* max of x (n >= 1) in 16 lanes: max is exact, so lanes change nothing but
 * let the loop vectorize */
static float row_max(const float *x, int64_t n)
{
    float lane[16];
    int64_t i = 0;
    for (int j = 0; j < 16; j++) lane[j] = x[0];
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) lane[j] = max_nan(lane[j], x[i + j]);
    float m = lane[0];
    for (int j = 1; j < 16; j++) m = max_nan(m, lane[j]);
    for (; i < n; i++) m = max_nan(m, x[i]);
    return m;
}

/* y (n) = op(x) */
DT_CPU_KERNEL(unary_range, p, lo, hi)
{
    const ew_args *A = p;
    const float *x = A->x;
    float *y = A->out;
    switch ((dt_unary_op)A->op) {
    case DT_UNARY_RELU: /* NaN propagates, as in torch.relu */
        for (int64_t i = lo; i < hi; i++) y[i] = x[i] < 0.0f ? 0.0f : x[i];
        break;
    case DT_UNARY_GELU:
        for (int64_t i = lo; i < hi; i++) y[i] = gelu_f(x[i]);
        break;
    case DT_UNARY_TANH:
        for (int64_t i = lo; i < hi; i++) y[i] = dt_tanhf(x[i]);
        break;
    case DT_UNARY_SIGMOID:
        for (int64_t i = lo; i < hi; i++) y[i] = sigmoid_f(x[i]);
        break;
    case DT_UNARY_GELU_TANH:
        for (int64_t i = lo; i < hi; i++) y[i] = gelu_tanh_f(x[i]);
        break;
    case DT_UNARY_EXP:
        for (int64_t i = lo; i < hi; i++) y[i] = dt_expf(x[i]);
        break;
    case DT_UNARY_LOG:
        for (int64_t i = lo; i < hi; i++) y[i] = logf(x[i]);
        break;
    case DT_UNARY_SQRT:
        for (int64_t i = lo; i < hi; i++) y[i] = sqrtf(x[i]);
        break;
    }
}

static int64_t unary_grain(dt_unary_op op)
{
    return op == DT_UNARY_RELU ? DT_CPU_GRAIN_MEM : DT_CPU_GRAIN_MATH;
}

static void cpu_unary(dt_backend *be, dt_unary_op op, int64_t n, const float *x, float *y)
{
    ew_args A = {.op = (int)op, .x = x, .out = y};
    parallel_for(be, n, unary_grain(op), unary_range, &A);
}

/* dx (n) (+)= dy * op'(x), y = op(x) given.  The accumulate test sits outside
 * the loops so each loop stays a simple vectorizable body. */
#define DT_UNARY_BWD_LOOP(EXPR)                                                  \
    do {                                                                         \
        if (acc) {                                                               \
            for (int64_t i = lo; i < hi; i++) dx[i] += (EXPR);                   \
        } else {                                                                 \
            for (int64_t i = lo; i < hi; i++) dx[i] = (EXPR);                    \
        }                                                                        \
    } while (0)

/* dy where relu passed it, else 0.  dy is read either way: a load made
 * conditional (y[i] > 0 ? dy[i] : 0) vectorizes only with masked loads
 * (AVX2 and up), and ran scalar and branchy in an SSE2 build, 5x slower. */
static inline float relu_pass(float y, float dy) { return y > 0.0f ? dy : 0.0f; }

DT_CPU_KERNEL(unary_bwd_range, p, lo, hi)
{
    const ew_args *A = p;
    const float *x = A->x, *y = A->y, *dy = A->dy;
    float *dx = A->out;
    int acc = A->accumulate;
    switch ((dt_unary_op)A->op) {
    case DT_UNARY_RELU:
        DT_UNARY_BWD_LOOP(relu_pass(y[i], dy[i]));
        break;
    case DT_UNARY_GELU:
        DT_UNARY_BWD_LOOP(dy[i] * gelu_grad(x[i]));
        break;
    case DT_UNARY_TANH:
        DT_UNARY_BWD_LOOP(dy[i] * (1.0f - y[i] * y[i]));
        break;
    case DT_UNARY_SIGMOID:
        DT_UNARY_BWD_LOOP(dy[i] * y[i] * (1.0f - y[i]));
        break;
    case DT_UNARY_GELU_TANH:
        DT_UNARY_BWD_LOOP(dy[i] * gelu_tanh_grad(x[i]));
        break;
    case DT_UNARY_EXP:
        DT_UNARY_BWD_LOOP(dy[i] * y[i]);
        break;
    case DT_UNARY_LOG:
        DT_UNARY_BWD_LOOP(dy[i] / x[i]);
        break;
    case DT_UNARY_SQRT:
        DT_UNARY_BWD_LOOP(dy[i] * 0.5f / y[i]);
        break;
    }
}

static void cpu_unary_backward(dt_backend *be, dt_unary_op op, int64_t n, const float *x,
                               const float *y, const float *dy, float *dx, int accumulate)
{
    ew_args A = {.op = (int)op, .x = x, .y = y, .dy = dy, .out = dx, .accumulate = accumulate};
    int64_t grain = op == DT_UNARY_GELU || op == DT_UNARY_GELU_TANH ? DT_CPU_GRAIN_MATH
                                                                      : DT_CPU_GRAIN_MEM;
    parallel_for(be, n, grain, unary_bwd_range, &A);
}

/* y = x rounded to nearest even at prec, kept as f32 (round_tf32,
 * round_bf16, round_f16: half.h, the bits the core and CUDA give too) */
typedef struct round_args {
    dt_precision prec;
    const float *x;
    float *y;
} round_args;

static void round_range(void *p, int64_t lo, int64_t hi)
{
    const round_args *A = p;
    float (*fn)(float) = A->prec == DT_PREC_TF32 ? round_tf32
                         : A->prec == DT_PREC_BF16 ? round_bf16 : round_f16;
    for (int64_t i = lo; i < hi; i++) A->y[i] = fn(A->x[i]);
}

typedef struct half_args {
    dt_precision prec;
    const void *x;
    void *y;
} half_args;

static void to_half_range(void *p, int64_t lo, int64_t hi)
{
    const half_args *A = p;
    const float *x = A->x;
    uint16_t *y = A->y;
    if (A->prec == DT_PREC_BF16)
        for (int64_t i = lo; i < hi; i++) y[i] = f32_to_bf16(x[i]);
    else
        for (int64_t i = lo; i < hi; i++) y[i] = f32_to_f16(x[i]);
}

static void from_half_range(void *p, int64_t lo, int64_t hi)
{
    const half_args *A = p;
    const uint16_t *x = A->x;
    float *y = A->y;
    if (A->prec == DT_PREC_BF16)
        for (int64_t i = lo; i < hi; i++) y[i] = bf16_to_f32(x[i]);
    else
        for (int64_t i = lo; i < hi; i++) y[i] = f16_to_f32(x[i]);
}

static void cpu_to_half(dt_backend *be, dt_precision prec, int64_t n, const float *x, uint16_t *y)
{
    half_args A = {prec, x, y};
    parallel_for(be, n, DT_CPU_GRAIN_MEM, to_half_range, &A);
}

static void cpu_from_half(dt_backend *be, dt_precision prec, int64_t n, const uint16_t *x, float *y)
{
    half_args A = {prec, x, y};
    parallel_for(be, n, DT_CPU_GRAIN_MEM, from_half_range, &A);
}

static void cpu_round_prec(dt_backend *be, dt_precision prec, int64_t n, const float *x, float *y)
{
    if (prec == DT_PREC_F32) {
        if (y != x && n > 0) memcpy(y, x, (size_t)n * sizeof(float));
        return;
    }
    round_args A = {prec, x, y};
    parallel_for(be, n, DT_CPU_GRAIN_MEM, round_range, &A);
}

/* ---------------------------------------------------------------------------
 * 6. Strided index spaces: binary, copy_strided
 *
 * An index space is first coalesced (size-1 dims dropped, neighbours merged
 * where every operand walks them as one dim), then walked as rows of its last
 * dim with an odometer carrying each operand's offset.
 * ------------------------------------------------------------------------- */

/* Row-major multi-index over nd dims (nd may be 0: one point) carrying the
 * element offsets of two strided operands. */
typedef struct dt_cpu_odo {
    int nd;
    int64_t shape[DT_MAX_DIMS];
    int64_t st[2][DT_MAX_DIMS];
    int64_t idx[DT_MAX_DIMS];
    int64_t off[2];
} dt_cpu_odo;

/* Jump to the lin-th point.  Requires every shape > 0. */
static void odo_seek(dt_cpu_odo *o, int64_t lin)
{
    o->off[0] = o->off[1] = 0;
    for (int d = o->nd - 1; d >= 0; d--) {
        int64_t i = lin % o->shape[d];
        lin /= o->shape[d];
        o->idx[d] = i;
        o->off[0] += i * o->st[0][d];
        o->off[1] += i * o->st[1][d];
    }
}

static void odo_next(dt_cpu_odo *o)
{
    for (int d = o->nd - 1; d >= 0; d--) {
        o->off[0] += o->st[0][d];
        o->off[1] += o->st[1][d];
        if (++o->idx[d] < o->shape[d]) return;
        o->off[0] -= o->st[0][d] * o->shape[d];
        o->off[1] -= o->st[1][d] * o->shape[d];
        o->idx[d] = 0;
    }
}

/* A coalesced space split into outer rows (odometer over dims 0..nd-2) and an
 * inner run of `inner` elements with strides s0, s1. */
typedef struct dt_cpu_space {
    dt_cpu_odo rows;
    int64_t nrows, inner, s0, s1;
} dt_cpu_space;

static void space_init(dt_cpu_space *sp, int ndim, const int64_t *shape, const int64_t *st0,
                       const int64_t *st1)
{
    int64_t shp[DT_MAX_DIMS], a[DT_MAX_DIMS], b[DT_MAX_DIMS];
    int nd = coalesce2(ndim, shape, st0, st1, shp, a, b);
    sp->rows.nd = nd - 1;
    for (int d = 0; d < nd - 1; d++) {
        sp->rows.shape[d] = shp[d];
        sp->rows.st[0][d] = a[d];
        sp->rows.st[1][d] = b[d];
    }
    sp->nrows = shape_numel(nd - 1, shp);
    sp->inner = shp[nd - 1];
    sp->s0 = a[nd - 1];
    sp->s1 = b[nd - 1];
}

/* ---- binary: out = a op b ------------------------------------------------ */

/* one run of n: out[i] = a[i*sa] op b[i*sb], with the common stride patterns
 * (contiguous, scalar broadcast) as plain loops the compiler vectorizes */
#define DT_BIN_RUN(EXPR)                                                           \
    do {                                                                           \
        if (sa == 1 && sb == 1) {                                                  \
            for (int64_t i = 0; i < n; i++) {                                      \
                float u = a[i], v = b[i];                                          \
                o[i] = (EXPR);                                                     \
            }                                                                      \
        } else if (sa == 1 && sb == 0) {                                           \
            float v = b[0];                                                        \
            for (int64_t i = 0; i < n; i++) { float u = a[i]; o[i] = (EXPR); }    \
        } else if (sa == 0 && sb == 1) {                                           \
            float u = a[0];                                                        \
            for (int64_t i = 0; i < n; i++) { float v = b[i]; o[i] = (EXPR); }    \
        } else {                                                                   \
            for (int64_t i = 0; i < n; i++) {                                      \
                float u = a[i * sa], v = b[i * sb];                                \
                o[i] = (EXPR);                                                     \
            }                                                                      \
        }                                                                          \
    } while (0)

static void bin_run(dt_binary_op op, int64_t n, const float *a, int64_t sa, const float *b,
                    int64_t sb, float *o)
{
    switch (op) {
    case DT_BIN_ADD: DT_BIN_RUN(u + v); break;
    case DT_BIN_SUB: DT_BIN_RUN(u - v); break;
    case DT_BIN_MUL: DT_BIN_RUN(u * v); break;
    case DT_BIN_DIV: DT_BIN_RUN(u / v); break;
    case DT_BIN_KEEP: DT_BIN_RUN(v != 0.0f ? u : 0.0f); break;
    case DT_BIN_DROP: DT_BIN_RUN(v != 0.0f ? 0.0f : u); break;
    case DT_BIN_POW: DT_BIN_RUN(powf(u, v)); break;
    }
}

typedef struct bin_args {
    dt_binary_op op;
    dt_cpu_space sp;
    const float *a, *b;
    float *out;
} bin_args;

/* over rows [lo, hi) of the coalesced space; out is contiguous */
static void bin_rows(void *p, int64_t lo, int64_t hi)
{
    const bin_args *A = p;
    dt_cpu_odo o = A->sp.rows;
    int64_t n = A->sp.inner;
    odo_seek(&o, lo);
    for (int64_t r = lo; r < hi; r++) {
        bin_run(A->op, n, A->a + o.off[0], A->sp.s0, A->b + o.off[1], A->sp.s1, A->out + r * n);
        odo_next(&o);
    }
}

/* a single run split by elements */
static void bin_flat(void *p, int64_t lo, int64_t hi)
{
    const bin_args *A = p;
    bin_run(A->op, hi - lo, A->a + lo * A->sp.s0, A->sp.s0, A->b + lo * A->sp.s1, A->sp.s1,
            A->out + lo);
}

/* out (shape, contiguous) = a[a_strides] op b[b_strides] */
static void cpu_binary(dt_backend *be, dt_binary_op op, int ndim, const int64_t *shape,
                       const float *a, const int64_t *a_strides, const float *b,
                       const int64_t *b_strides, float *out)
{
    if (shape_numel(ndim, shape) == 0) return;
    bin_args A = {.op = op, .a = a, .b = b, .out = out};
    space_init(&A.sp, ndim, shape, a_strides, b_strides);
    int64_t grain = op == DT_BIN_DIV || op == DT_BIN_POW ? DT_CPU_GRAIN_MATH : DT_CPU_GRAIN_MEM;
    if (A.sp.nrows == 1)
        parallel_for(be, A.sp.inner, grain, bin_flat, &A);
    else
        parallel_for(be, A.sp.nrows, grain_units(grain, A.sp.inner), bin_rows, &A);
}

/* ---- copy_strided: dst[..] (+)= src[..] ---------------------------------- */

typedef struct copy_args {
    dt_cpu_space sp;             /* st0 = dst, st1 = src */
    size_t es;
    char *dst;
    const char *src;
    int accumulate;
    int64_t tile_rows, tile_cols; /* transpose tiling (0: off) */
} copy_args;

/* one run of n elements of es bytes; strides in elements */
static void copy_run(size_t es, int64_t n, char *dst, int64_t sd, const char *src, int64_t ss,
                     int acc)
{
    if (acc) { /* f32 only */
        float *d = (float *)dst;
        const float *s = (const float *)src;
        if (sd == 1 && ss == 1)
            for (int64_t i = 0; i < n; i++) d[i] += s[i];
        else
            for (int64_t i = 0; i < n; i++) d[i * sd] += s[i * ss];
        return;
    }
    if (sd == 1 && ss == 1) {
        memmove(dst, src, (size_t)n * es);
    } else if (es == 4) {
        uint32_t *d = (uint32_t *)dst;
        const uint32_t *s = (const uint32_t *)src;
        if (ss == 0) {
            uint32_t v = s[0];
            for (int64_t i = 0; i < n; i++) d[i * sd] = v;
        } else {
            for (int64_t i = 0; i < n; i++) d[i * sd] = s[i * ss];
        }
    } else if (es == 1) {
        uint8_t *d = (uint8_t *)dst;
        const uint8_t *s = (const uint8_t *)src;
        for (int64_t i = 0; i < n; i++) d[i * sd] = s[i * ss];
    } else {
        for (int64_t i = 0; i < n; i++)
            memcpy(dst + i * sd * (int64_t)es, src + i * ss * (int64_t)es, es);
    }
}

static void copy_rows(void *p, int64_t lo, int64_t hi)
{
    const copy_args *A = p;
    dt_cpu_odo o = A->sp.rows;
    int64_t es = (int64_t)A->es;
    odo_seek(&o, lo);
    for (int64_t r = lo; r < hi; r++) {
        copy_run(A->es, A->sp.inner, A->dst + o.off[0] * es, A->sp.s0, A->src + o.off[1] * es,
                 A->sp.s1, A->accumulate);
        odo_next(&o);
    }
}

static void copy_flat(void *p, int64_t lo, int64_t hi)
{
    const copy_args *A = p;
    int64_t es = (int64_t)A->es;
    copy_run(A->es, hi - lo, A->dst + lo * A->sp.s0 * es, A->sp.s0, A->src + lo * A->sp.s1 * es,
             A->sp.s1, A->accumulate);
}

/* 2-D transposes (the last two coalesced dims swap which operand is unit
 * stride): copy 16x16 tiles so both sides stay in cache.  Unit u is one tile
 * row band of one outer matrix.  16, not 32: with a power-of-two row pitch
 * the strided side's lines fall in few L1 sets, and 32 of them thrash (512x1024
 * transpose: 0.51 ns/elem at 16, 1.24 at 32, 0.60 at 8; measured). */
#define DT_CPU_TT 16
static void copy_tiles(void *p, int64_t lo, int64_t hi)
{
    const copy_args *A = p;
    const dt_cpu_odo *R = &A->sp.rows;          /* last row dim is the matrix row */
    int nd = R->nd;
    int64_t rows = R->shape[nd - 1], cols = A->sp.inner;
    int64_t dr = R->st[0][nd - 1], sr = R->st[1][nd - 1], dc = A->sp.s0, sc = A->sp.s1;
    int64_t bands = (rows + DT_CPU_TT - 1) / DT_CPU_TT, es = (int64_t)A->es;
    dt_cpu_odo o = *R;
    o.nd = nd - 1;                               /* outer matrices */
    for (int64_t u = lo; u < hi; u++) {
        odo_seek(&o, u / bands);
        int64_t i0 = (u % bands) * DT_CPU_TT, i1 = min64(rows, i0 + DT_CPU_TT);
        for (int64_t j0 = 0; j0 < cols; j0 += DT_CPU_TT) {
            int64_t j1 = min64(cols, j0 + DT_CPU_TT);
            for (int64_t i = i0; i < i1; i++)
                copy_run(A->es, j1 - j0, A->dst + (o.off[0] + i * dr + j0 * dc) * es, dc,
                         A->src + (o.off[1] + i * sr + j0 * sc) * es, sc, A->accumulate);
        }
    }
}

static int is_transpose(const dt_cpu_space *sp)
{
    int nd = sp->rows.nd;
    if (nd < 1 || sp->inner < DT_CPU_TT / 2 || sp->rows.shape[nd - 1] < DT_CPU_TT / 2) return 0;
    return (sp->s0 == 1 && sp->rows.st[1][nd - 1] == 1) ||
           (sp->s1 == 1 && sp->rows.st[0][nd - 1] == 1);
}

/* dst[dst_strides] (+)= src[src_strides] over `shape`; accumulate: f32 only */
static void cpu_copy_strided(dt_backend *be, int ndim, const int64_t *shape, size_t elem_bytes,
                             void *dst, const int64_t *dst_strides, const void *src,
                             const int64_t *src_strides, int accumulate)
{
    if (shape_numel(ndim, shape) == 0) return;
    copy_args A = {.es = elem_bytes, .dst = dst, .src = src, .accumulate = accumulate};
    space_init(&A.sp, ndim, shape, dst_strides, src_strides);
    int64_t inner = A.sp.inner;
    if (A.sp.nrows == 1) {
        parallel_for(be, inner, DT_CPU_GRAIN_MEM, copy_flat, &A);
    } else if (is_transpose(&A.sp)) {
        int nd = A.sp.rows.nd;
        int64_t rows = A.sp.rows.shape[nd - 1];
        int64_t bands = (rows + DT_CPU_TT - 1) / DT_CPU_TT;
        int64_t units = (A.sp.nrows / rows) * bands;
        parallel_for(be, units, grain_units(DT_CPU_GRAIN_MEM, DT_CPU_TT * inner), copy_tiles, &A);
    } else {
        parallel_for(be, A.sp.nrows, grain_units(DT_CPU_GRAIN_MEM, inner), copy_rows, &A);
    }
}

/* ---------------------------------------------------------------------------
 * 7. Deterministic sums: sum, sumsq, sum_to, reduce_axis, bias_grad
 *
 * The unit of summation is a block of DT_CPU_RED_BLOCK consecutive elements,
 * summed in double with 16 fixed lanes (vectorizable, fixed order).  A long
 * run is the in-order sum of its block partials, whether those are computed
 * inline or by the pool, so the thread count never changes a bit.  Sums over
 * strided (outer) dims accumulate in double in index order per output.
 * ------------------------------------------------------------------------- */

/* sum (or sum of squares) of n <= DT_CPU_RED_BLOCK floats, fixed order */
static double block_sum(const float *x, int64_t n, int sq)
{
    double acc[16] = {0};
    int64_t i = 0;
    if (sq) {
        for (; i + 16 <= n; i += 16)
            for (int j = 0; j < 16; j++) acc[j] += (double)x[i + j] * (double)x[i + j];
    } else {
        for (; i + 16 <= n; i += 16)
            for (int j = 0; j < 16; j++) acc[j] += (double)x[i + j];
    }
    double tail = 0.0;
    for (; i < n; i++) tail += sq ? (double)x[i] * (double)x[i] : (double)x[i];
    for (int w = 8; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    return acc[0] + tail;
}

/* a run of any length: in-order sum of block partials */
static double run_sum(const float *x, int64_t n, int sq)
{
    double s = 0.0;
    for (int64_t b = 0; b < n; b += DT_CPU_RED_BLOCK)
        s += block_sum(x + b, min64(DT_CPU_RED_BLOCK, n - b), sq);
    return s;
}

typedef struct psum_args {
    const float *x;
    int64_t n, b0;   /* elements, first block of this round */
    int sq;
    double *part;
} psum_args;

DT_CPU_KERNEL(psum_blocks, p, lo, hi)
{
    const psum_args *A = p;
    for (int64_t b = lo; b < hi; b++) {
        int64_t start = (A->b0 + b) * DT_CPU_RED_BLOCK;
        A->part[b] = block_sum(A->x + start, min64(DT_CPU_RED_BLOCK, A->n - start), A->sq);
    }
}

/* run_sum() with the blocks spread over the pool; identical result */
static double par_run_sum(dt_backend *be, const float *x, int64_t n, int sq)
{
    double part[DT_CPU_RED_ROUND], s = 0.0;
    int64_t nblocks = (n + DT_CPU_RED_BLOCK - 1) / DT_CPU_RED_BLOCK;
    psum_args A = {.x = x, .n = n, .sq = sq, .part = part};
    for (A.b0 = 0; A.b0 < nblocks; A.b0 += DT_CPU_RED_ROUND) {
        int64_t nb = min64(DT_CPU_RED_ROUND, nblocks - A.b0);
        parallel_for(be, nb, grain_units(DT_CPU_GRAIN_MEM, DT_CPU_RED_BLOCK), psum_blocks, &A);
        for (int64_t b = 0; b < nb; b++) s += part[b];
    }
    return s;
}

/* *y (device scalar) = sum of x (n) */
static void cpu_sum(dt_backend *be, int64_t n, const float *x, float *y)
{
    *y = (float)par_run_sum(be, x, n, 0);
}

/* sum of squares of x (n), to the host */
static double cpu_sumsq(dt_backend *be, int64_t n, const float *x)
{
    return par_run_sum(be, x, n, 1);
}

/* ---- sum_to: dst (+)= src summed over the dims where dst_strides == 0 ---- */

/* The coalesced space is split into kept dims K (dst stride != 0) and reduced
 * dims R.  When the last dim is reduced, each output is a sum of contiguous
 * runs (run_sum); when it is kept, a tile of adjacent outputs accumulates
 * rows in double (column sums, vectorized across the tile). */
typedef struct sumto_args {
    dt_cpu_odo k;      /* kept dims: st[0] src, st[1] dst */
    dt_cpu_odo r;      /* reduced dims (last one excluded in run mode): st[0] src */
    int64_t nr;        /* points in r */
    int64_t len;       /* length of the last dim */
    int64_t dlast;     /* dst stride of the last dim (tile mode) */
    int64_t ntiles;
    const float *src;
    float *dst;
    int accumulate;
} sumto_args;

static void store(float *d, double v, int acc) { *d = acc ? *d + (float)v : (float)v; }

/* last dim reduced: outputs [lo, hi) over K */
DT_CPU_KERNEL(sumto_runs, p, lo, hi)
{
    const sumto_args *A = p;
    dt_cpu_odo k = A->k, r = A->r;
    odo_seek(&k, lo);
    for (int64_t o = lo; o < hi; o++) {
        double s = 0.0;
        odo_seek(&r, 0);
        for (int64_t q = 0; q < A->nr; q++) {
            s += run_sum(A->src + k.off[0] + r.off[0], A->len, 0);
            odo_next(&r);
        }
        store(A->dst + k.off[1], s, A->accumulate);
        odo_next(&k);
    }
}

/* last dim kept: units [lo, hi) = (outer kept point, tile of the last dim) */
DT_CPU_KERNEL(sumto_tiles, p, lo, hi)
{
    const sumto_args *A = p;
    dt_cpu_odo k = A->k, r = A->r;
    double acc[DT_CPU_TILE];
    for (int64_t u = lo; u < hi; u++) {
        int64_t j0 = (u % A->ntiles) * DT_CPU_TILE, w = min64(DT_CPU_TILE, A->len - j0);
        odo_seek(&k, u / A->ntiles);
        for (int64_t j = 0; j < w; j++) acc[j] = 0.0;
        odo_seek(&r, 0);
        for (int64_t q = 0; q < A->nr; q++) {
            const float *s = A->src + k.off[0] + r.off[0] + j0;
            for (int64_t j = 0; j < w; j++) acc[j] += (double)s[j];
            odo_next(&r);
        }
        float *d = A->dst + k.off[1] + j0 * A->dlast;
        for (int64_t j = 0; j < w; j++) store(d + j * A->dlast, acc[j], A->accumulate);
    }
}

/* dst (+)= 0 for the empty-sum case: walk only the kept dims */
static void sum_to_zero(int nd, const int64_t *shp, const int64_t *dst_st, float *dst)
{
    dt_cpu_odo z = {0};
    for (int d = 0; d < nd; d++) {
        if (dst_st[d] == 0) continue;
        z.shape[z.nd] = shp[d];
        z.st[1][z.nd] = dst_st[d];
        z.nd++;
    }
    int64_t nz = shape_numel(z.nd, z.shape);
    if (nz == 0) return;
    odo_seek(&z, 0);
    for (int64_t i = 0; i < nz; i++, odo_next(&z)) dst[z.off[1]] = 0.0f;
}

static void sum_to_impl(dt_backend *be, int ndim, const int64_t *shape, const float *src,
                        float *dst, const int64_t *dst_strides, int accumulate)
{
    int64_t sst[DT_MAX_DIMS], shp[DT_MAX_DIMS], s0[DT_MAX_DIMS], s1[DT_MAX_DIMS];
    contiguous_strides(ndim, shape, sst);
    int nd = coalesce2(ndim, shape, sst, dst_strides, shp, s0, s1);
    if (shape_numel(nd, shp) == 0) {
        if (!accumulate) sum_to_zero(nd, shp, s1, dst);
        return;
    }
    sumto_args A = {.src = src, .dst = dst, .accumulate = accumulate};
    /* a lone size-1 dim (scalar space) counts as kept: a plain copy */
    int last_kept = s1[nd - 1] != 0 || (nd == 1 && shp[0] == 1);
    A.len = shp[nd - 1];
    A.dlast = s1[nd - 1];
    for (int d = 0; d < nd - 1; d++) {
        dt_cpu_odo *o = s1[d] != 0 ? &A.k : &A.r;
        o->shape[o->nd] = shp[d];
        o->st[0][o->nd] = s0[d];
        o->st[1][o->nd] = s1[d];
        o->nd++;
    }
    int64_t nk = shape_numel(A.k.nd, A.k.shape);
    A.nr = shape_numel(A.r.nd, A.r.shape);
    if (last_kept) {
        A.ntiles = (A.len + DT_CPU_TILE - 1) / DT_CPU_TILE;
        int64_t w = min64(A.len, DT_CPU_TILE) * A.nr;
        parallel_for(be, nk * A.ntiles, grain_units(DT_CPU_GRAIN_MEM, w), sumto_tiles, &A);
    } else if (nk == 1 && A.nr == 1) {
        store(dst, par_run_sum(be, src, A.len, 0), accumulate); /* one long run */
    } else {
        parallel_for(be, nk, grain_units(DT_CPU_GRAIN_MEM, A.len * A.nr), sumto_runs, &A);
    }
}

/* src (shape, contiguous) summed into dst[dst_strides], 0 strides reduced */
static void cpu_sum_to(dt_backend *be, int ndim, const int64_t *shape, const float *src, float *dst,
                       const int64_t *dst_strides, int accumulate)
{
    sum_to_impl(be, ndim, shape, src, dst, dst_strides, accumulate);
}

/* dbias (C) (+)= sum over N and inner of dy (N, C, inner) */
static void cpu_bias_grad(dt_backend *be, int64_t n, int64_t c, int64_t inner, const float *dy,
                          float *dbias, int accumulate)
{
    int64_t shape[3] = {n, c, inner}, st[3] = {0, 1, 0};
    sum_to_impl(be, 3, shape, dy, dbias, st, accumulate);
}

/* ---- reduce_axis: x (outer, len, inner) -> y (outer, inner) -------------- */

typedef struct rmax_args {
    int64_t len, inner;
    const float *x;
    float *y;
} rmax_args;

/* units: outer rows (inner == 1) or (outer, tile of inner) */
static void rmax_units(void *p, int64_t lo, int64_t hi)
{
    const rmax_args *A = p;
    int64_t len = A->len, inner = A->inner;
    int64_t ntiles = (inner + DT_CPU_TILE - 1) / DT_CPU_TILE;
    for (int64_t u = lo; u < hi; u++) {
        int64_t o = u / ntiles, j0 = (u % ntiles) * DT_CPU_TILE, w = min64(DT_CPU_TILE, inner - j0);
        const float *x = A->x + o * len * inner + j0;
        float *y = A->y + o * inner + j0;
        for (int64_t j = 0; j < w; j++) y[j] = len > 0 ? x[j] : -INFINITY;
        for (int64_t l = 1; l < len; l++)
            for (int64_t j = 0; j < w; j++) y[j] = max_nan(y[j], x[l * inner + j]);
    }
}

static void cpu_reduce_axis(dt_backend *be, dt_axis_op op, int64_t outer, int64_t len,
                            int64_t inner, const float *x, float *y)
{
    if (op == DT_RED_SUM) {
        int64_t shape[3] = {outer, len, inner}, st[3] = {inner, 0, 1};
        sum_to_impl(be, 3, shape, x, y, st, 0);
        return;
    }
    rmax_args A = {.len = len, .inner = inner, .x = x, .y = y};
    int64_t ntiles = (inner + DT_CPU_TILE - 1) / DT_CPU_TILE;
    int64_t w = max64(1, len) * min64(inner, DT_CPU_TILE);
    parallel_for(be, outer * ntiles, grain_units(DT_CPU_GRAIN_MEM, w), rmax_units, &A);
}

/* ---------------------------------------------------------------------------
 * 8. Softmax and cross entropy
 *
 * Rows (inner == 1) are the hot case and get contiguous loops; other axes
 * walk each (outer, inner) column with stride inner.
 * ------------------------------------------------------------------------- */
typedef struct sm_args {
    int64_t len, inner;
    const float *x, *y, *dy;
    float *out;
    int is_log, accumulate;
} sm_args;

/* y (len, stride s) = softmax or log_softmax of x, one column */
static void softmax_col(const float *x, float *y, int64_t len, int64_t s, int is_log)
{
    if (len <= 0) return;
    double sum = 0.0;
    float m = x[0];
    if (s == 1) {
        m = row_max(x, len);
        for (int64_t l = 0; l < len; l++) y[l] = dt_expf(x[l] - m);
        sum = run_sum(y, len, 0);
    } else {
        for (int64_t l = 1; l < len; l++) m = max_nan(m, x[l * s]);
        for (int64_t l = 0; l < len; l++) {
            y[l * s] = dt_expf(x[l * s] - m);
            sum += y[l * s];
        }
    }
    if (is_log) {
        float shift = m + (float)log(sum);
        for (int64_t l = 0; l < len; l++) y[l * s] = x[l * s] - shift;
    } else {
        float r = (float)(1.0 / sum);
        for (int64_t l = 0; l < len; l++) y[l * s] *= r;
    }
}

/* columns [lo, hi) of (outer, inner) */
DT_CPU_KERNEL(softmax_cols, p, lo, hi)
{
    const sm_args *A = p;
    for (int64_t c = lo; c < hi; c++) {
        int64_t o = c / A->inner, i = c % A->inner, base = o * A->len * A->inner + i;
        softmax_col(A->x + base, A->out + base, A->len, A->inner, A->is_log);
    }
}

/* x, y (outer, len, inner): softmax over len */
static void cpu_softmax(dt_backend *be, int64_t outer, int64_t len, int64_t inner, const float *x,
                        float *y, int is_log)
{
    sm_args A = {.len = len, .inner = inner, .x = x, .out = y, .is_log = is_log};
    parallel_for(be, outer * inner, grain_units(DT_CPU_GRAIN_MATH, len), softmax_cols, &A);
}

/* one column: softmax  dx = y (dy - <dy, y>);  log_softmax  dx = dy - exp(y) sum(dy) */
static void softmax_bwd_col(const float *y, const float *dy, float *dx, int64_t len, int64_t s,
                            int is_log, int acc)
{
    double dot = 0.0;
    for (int64_t l = 0; l < len; l++)
        dot += is_log ? (double)dy[l * s] : (double)dy[l * s] * y[l * s];
    float d = (float)dot;
    /* a loop per case: with is_log tested inside, GCC may if-convert it and
     * compute the exp for softmax too (3x slower in SSE2) */
    if (is_log) {
        for (int64_t l = 0; l < len; l++) {
            float g = dy[l * s] - dt_expf(y[l * s]) * d;
            dx[l * s] = acc ? dx[l * s] + g : g;
        }
    } else {
        for (int64_t l = 0; l < len; l++) {
            float g = y[l * s] * (dy[l * s] - d);
            dx[l * s] = acc ? dx[l * s] + g : g;
        }
    }
}

DT_CPU_KERNEL(softmax_bwd_cols, p, lo, hi)
{
    const sm_args *A = p;
    for (int64_t c = lo; c < hi; c++) {
        int64_t o = c / A->inner, i = c % A->inner, base = o * A->len * A->inner + i;
        softmax_bwd_col(A->y + base, A->dy + base, A->out + base, A->len, A->inner, A->is_log,
                        A->accumulate);
    }
}

static void cpu_softmax_backward(dt_backend *be, int64_t outer, int64_t len, int64_t inner,
                                 const float *y, const float *dy, float *dx, int is_log,
                                 int accumulate)
{
    sm_args A = {.len = len, .inner = inner, .y = y, .dy = dy, .out = dx, .is_log = is_log,
                 .accumulate = accumulate};
    int64_t grain = is_log ? DT_CPU_GRAIN_MATH : DT_CPU_GRAIN_MEM;
    parallel_for(be, outer * inner, grain_units(grain, len), softmax_bwd_cols, &A);
}

/* ---- cross entropy ------------------------------------------------------- */
typedef struct xent_args {
    int64_t c, r0, ignore;
    const float *logits;
    const int32_t *labels;
    float *rows;        /* each row's max and 1/sum (backward rebuilds the softmax) */
    double *row_loss;   /* this round's rows, summed in order by the caller */
} xent_args;

/* rows [r0+lo, r0+hi): probs = softmax(logits), loss_r = logsumexp - logit[label] */
DT_CPU_KERNEL(xent_rows, p, lo, hi)
{
    const xent_args *A = p;
    int64_t c = A->c;
    for (int64_t i = lo; i < hi; i++) {
        int64_t r = A->r0 + i;
        const float *x = A->logits + r * c;
        float m = row_max(x, c), e[DT_CPU_RED_BLOCK];
        double sum = 0.0;   /* run_sum's blocks, each exp'd into e first */
        for (int64_t b = 0; b < c; b += DT_CPU_RED_BLOCK) {
            int64_t len = min64(DT_CPU_RED_BLOCK, c - b);
            for (int64_t j = 0; j < len; j++) e[j] = dt_expf(x[b + j] - m);
            sum += block_sum(e, len, 0);
        }
        float inv = (float)(1.0 / sum);
        A->rows[2 * r] = m;
        A->rows[2 * r + 1] = inv;
        A->row_loss[i] = A->labels[r] == A->ignore ? 0.0
                                                   : log(sum) + (double)m - (double)x[A->labels[r]];
    }
}

/* logits (n,c), labels (n) -> rows (2n: max, 1/sum), *loss = sum over kept
 * rows of (logsumexp - logit[label]) / kept */
static int64_t cpu_xent_forward(dt_backend *be, int64_t n, int64_t c, const float *logits,
                                const int32_t *labels, int64_t ignore, int64_t kept, float *rows,
                                float *loss)
{
    for (int64_t i = 0; i < n; i++)
        if ((labels[i] < 0 || labels[i] >= c) && labels[i] != ignore) return i;
    double row_loss[DT_CPU_RED_ROUND], total = 0.0;
    xent_args A = {.c = c, .ignore = ignore, .logits = logits, .labels = labels, .rows = rows,
                   .row_loss = row_loss};
    for (A.r0 = 0; A.r0 < n; A.r0 += DT_CPU_RED_ROUND) {
        int64_t nr = min64(DT_CPU_RED_ROUND, n - A.r0);
        parallel_for(be, nr, grain_units(DT_CPU_GRAIN_MATH, c), xent_rows, &A);
        for (int64_t i = 0; i < nr; i++) total += row_loss[i];
    }
    *loss = n > 0 ? (float)(total / (double)kept) : 0.0f;   /* kept 0: NaN, as torch */
    return -1;
}

typedef struct xentb_args {
    int64_t c, ignore;
    float scale;
    const float *logits, *rows;
    const int32_t *labels;
    float *dlogits;
    int accumulate;
} xentb_args;

static void xent_bwd_rows(void *p, int64_t lo, int64_t hi)
{
    const xentb_args *A = p;
    int64_t c = A->c;
    float s = A->scale;
    for (int64_t r = lo; r < hi; r++) {
        const float *x = A->logits + r * c;
        float *d = A->dlogits + r * c, m = A->rows[2 * r], inv = A->rows[2 * r + 1];
        if (A->labels[r] == A->ignore) {   /* no gradient */
            for (int64_t j = 0; !A->accumulate && j < c; j++) d[j] = 0.0f;
            continue;
        }
        /* the softmax as the forward made it: exp(x - m), then times 1/sum */
        if (A->accumulate)
            for (int64_t j = 0; j < c; j++) {
                float p = dt_expf(x[j] - m);
                p *= inv;
                d[j] += p * s;
            }
        else
            for (int64_t j = 0; j < c; j++) {
                float p = dt_expf(x[j] - m);
                p *= inv;
                d[j] = p * s;
            }
        d[A->labels[r]] -= s;
    }
}

/* dlogits (n,c) (+)= (softmax - onehot(labels)) * dloss / kept, kept rows only */
static void cpu_xent_backward(dt_backend *be, int64_t n, int64_t c, const float *logits,
                              const float *rows, const int32_t *labels, int64_t ignore,
                              int64_t kept, const float *dloss, float *dlogits, int accumulate)
{
    if (n <= 0) return;
    xentb_args A = {.c = c, .ignore = ignore, .scale = *dloss / (float)kept, .logits = logits,
                    .rows = rows, .labels = labels, .dlogits = dlogits, .accumulate = accumulate};
    parallel_for(be, n, grain_units(DT_CPU_GRAIN_MEM, c), xent_bwd_rows, &A);
}

/* ---------------------------------------------------------------------------
 * 9. Convolution helpers
 *
 * col (C*KH*KW, N*OH*OW): row r = (c*KH + ki)*KW + kj, column
 * j = n*OH*OW + oh*OW + ow, holding x[n, c, oh*s - pad + ki, ow*s - pad + kj]
 * (0 in the padding).
 * ------------------------------------------------------------------------- */
typedef struct conv_args {
    const dt_conv_geom *g;
    const float *x, *col;
    float *out;
    int accumulate;
} conv_args;

/* [lo, hi) of ow for which iw = ow*s - pad + kj lies in [0, W) */
static void valid_ow(const dt_conv_geom *g, int64_t kj, int64_t *lo, int64_t *hi)
{
    int64_t s = g->stride, off = kj - g->pad;       /* iw = ow*s + off */
    int64_t a = off >= 0 ? 0 : (-off + s - 1) / s;  /* first ow with iw >= 0 */
    int64_t b = g->w - off <= 0 ? 0 : (g->w - off + s - 1) / s; /* first ow with iw >= W */
    *lo = min64(a, g->ow);
    *hi = max64(*lo, min64(b, g->ow));
}

/* units (c, n): the KH*KW row segments of image n, channel c */
static void im2col_units(void *p, int64_t lo, int64_t hi)
{
    const conv_args *A = p;
    const dt_conv_geom *g = A->g;
    int64_t N = g->n, H = g->h, W = g->w, OH = g->oh, OW = g->ow, s = g->stride;
    int64_t P = OH * OW, ncols = N * P;
    for (int64_t u = lo; u < hi; u++) {
        int64_t c = u / N, n = u % N;
        const float *plane = A->x + (n * g->c + c) * H * W;
        for (int64_t ki = 0; ki < g->kh; ki++) {
            for (int64_t kj = 0; kj < g->kw; kj++) {
                float *restrict dst = A->out + ((c * g->kh + ki) * g->kw + kj) * ncols + n * P;
                int64_t w0, w1;
                valid_ow(g, kj, &w0, &w1);
                for (int64_t oh = 0; oh < OH; oh++, dst += OW) {
                    int64_t ih = oh * s - g->pad + ki;
                    if (ih < 0 || ih >= H) {
                        memset(dst, 0, (size_t)OW * sizeof(float));
                        continue;
                    }
                    const float *restrict src = plane + ih * W + kj - g->pad; /* + ow*s */
                    for (int64_t ow = 0; ow < w0; ow++) dst[ow] = 0.0f;
                    if (s == 1)
                        memcpy(dst + w0, src + w0, (size_t)(w1 - w0) * sizeof(float));
                    else
                        for (int64_t ow = w0; ow < w1; ow++) dst[ow] = src[ow * s];
                    for (int64_t ow = w1; ow < OW; ow++) dst[ow] = 0.0f;
                }
            }
        }
    }
}

/* x (N,C,H,W) -> col (C*KH*KW, N*OH*OW) */
static void cpu_im2col(dt_backend *be, const dt_conv_geom *g, const float *x, float *col)
{
    conv_args A = {.g = g, .x = x, .out = col};
    int64_t per_unit = g->kh * g->kw * g->oh * g->ow;
    parallel_for(be, g->c * g->n, grain_units(DT_CPU_GRAIN_MEM, per_unit), im2col_units, &A);
}

/* units (c, n): one input plane each, so no two threads add to one element.
 * c-major like im2col: consecutive units read the next segment of the same
 * KH*KW rows of col, streams the prefetcher follows (n-major order jumps
 * between rows and was 2x slower, measured). */
static void col2im_units(void *p, int64_t lo, int64_t hi)
{
    const conv_args *A = p;
    const dt_conv_geom *g = A->g;
    int64_t N = g->n, H = g->h, W = g->w, OH = g->oh, OW = g->ow, s = g->stride;
    int64_t P = OH * OW, ncols = N * P;
    for (int64_t u = lo; u < hi; u++) {
        int64_t c = u / N, n = u % N;
        float *plane = A->out + (n * g->c + c) * H * W;
        if (!A->accumulate) memset(plane, 0, (size_t)(H * W) * sizeof(float));
        for (int64_t ki = 0; ki < g->kh; ki++) {
            for (int64_t kj = 0; kj < g->kw; kj++) {
                int64_t r = (c * g->kh + ki) * g->kw + kj;
                const float *restrict src = A->col + r * ncols + n * P;
                int64_t w0, w1;
                valid_ow(g, kj, &w0, &w1);
                for (int64_t oh = 0; oh < OH; oh++, src += OW) {
                    int64_t ih = oh * s - g->pad + ki;
                    if (ih < 0 || ih >= H) continue;
                    float *restrict dst = plane + ih * W + kj - g->pad; /* + ow*s */
                    if (s == 1)
                        for (int64_t ow = w0; ow < w1; ow++) dst[ow] += src[ow];
                    else
                        for (int64_t ow = w0; ow < w1; ow++) dst[ow * s] += src[ow];
                }
            }
        }
    }
}

/* dx (N,C,H,W) (+)= fold of col (C*KH*KW, N*OH*OW) */
static void cpu_col2im(dt_backend *be, const dt_conv_geom *g, const float *col, float *dx,
                       int accumulate)
{
    conv_args A = {.g = g, .col = col, .out = dx, .accumulate = accumulate};
    int64_t per_unit = g->kh * g->kw * g->oh * g->ow;
    parallel_for(be, g->c * g->n, grain_units(DT_CPU_GRAIN_MEM, per_unit), col2im_units, &A);
}

/* Fused convolution, one image at a time.  The pool's parts each take a
 * contiguous run of images; per image, im2col writes a (C*KH*KW, P) column
 * block that stays in L2 (288 x 196 floats = 225 KB for the CNN's second
 * conv) and one single-threaded GEMM writes the NCHW output directly.  The
 * batched lowering in the core moved a 14 MB column buffer through memory
 * and needed two layout permutes per step.  Weight and bias gradients are
 * summed per part and the parts added in order: deterministic for a fixed
 * thread count. */
typedef struct fconv_args {
    dt_conv_geom g1;          /* geometry of one image */
    int64_t n, o, ckk, p, chw, parts;
    const float *x, *w, *b, *dy;
    float *y, *dx, *dw, *db;
    int acc_dx;
    size_t part_floats;       /* scratch floats per part */
    float *scratch;
} fconv_args;

static int is_pointwise(const dt_conv_geom *g)
{
    return g->kh == 1 && g->kw == 1 && g->stride == 1 && g->pad == 0;
}

/* "Same" convolutions (stride 1, output as large as the input) lower with
 * whole-plane copies: row (c, ki, kj) of col is plane c shifted by
 * (ki-pad)*W + (kj-pad) elements, with zeros where the shift leaves the
 * image.  One memcpy per row plus a column of fix-ups, instead of one short
 * copy per output row (14 per row for the CNN's second conv). */
static int is_same_conv(const dt_conv_geom *g)
{
    return g->stride == 1 && g->oh == g->h && g->ow == g->w;
}

/* valid j range [jlo, jhi) of a plane shifted by `shift`, and the column
 * offset dw whose wrapped-around entries must be skipped */
static void same_span(const dt_conv_geom *g, int64_t ki, int64_t kj, int64_t *shift, int64_t *jlo,
                      int64_t *jhi, int64_t *dw)
{
    int64_t P = g->h * g->w;
    *dw = kj - g->pad;
    *shift = (ki - g->pad) * g->w + *dw;
    *jlo = max64(0, -*shift);
    *jhi = max64(*jlo, min64(P, P - *shift));
}

/* entries of one col row whose column ow + dw falls outside [0, W) */
static void zero_wrapped(float *row, const dt_conv_geom *g, int64_t dw)
{
    for (int64_t oh = 0; oh < g->h; oh++) {
        float *r = row + oh * g->w;
        for (int64_t ow = 0; ow < -dw; ow++) r[ow] = 0.0f;
        for (int64_t ow = g->w - dw; ow < g->w; ow++) r[ow] = 0.0f;
    }
}

static void im2col_same(const dt_conv_geom *g, const float *x, float *col)
{
    int64_t P = g->h * g->w;
    for (int64_t c = 0; c < g->c; c++)
        for (int64_t ki = 0; ki < g->kh; ki++)
            for (int64_t kj = 0; kj < g->kw; kj++) {
                float *dst = col + ((c * g->kh + ki) * g->kw + kj) * P;
                int64_t shift, jlo, jhi, dw;
                same_span(g, ki, kj, &shift, &jlo, &jhi, &dw);
                const float *src = x + c * P;
                memset(dst, 0, (size_t)jlo * sizeof(float));
                memcpy(dst + jlo, src + jlo + shift, (size_t)(jhi - jlo) * sizeof(float));
                memset(dst + jhi, 0, (size_t)(P - jhi) * sizeof(float));
                if (dw) zero_wrapped(dst, g, dw);
            }
}

/* dx (C,H,W) (+)= fold of col (CKK, P); col's wrapped entries are zeroed
 * first (col is the caller's scratch), so each row is one contiguous add */
static void col2im_same(const dt_conv_geom *g, float *col, float *dx, int accumulate)
{
    int64_t P = g->h * g->w;
    if (!accumulate) memset(dx, 0, (size_t)(g->c * P) * sizeof(float));
    for (int64_t c = 0; c < g->c; c++)
        for (int64_t ki = 0; ki < g->kh; ki++)
            for (int64_t kj = 0; kj < g->kw; kj++) {
                float *src = col + ((c * g->kh + ki) * g->kw + kj) * P;
                int64_t shift, jlo, jhi, dw;
                same_span(g, ki, kj, &shift, &jlo, &jhi, &dw);
                if (dw) zero_wrapped(src, g, dw);
                float *restrict d = dx + c * P + shift;
                const float *restrict sr = src;
                for (int64_t j = jlo; j < jhi; j++) d[j] += sr[j];
            }
}

/* col (CKK, P) for image x_n (C,H,W); returns x_n itself for 1x1 convs */
static const float *image_columns(const fconv_args *A, const float *xn, float *col)
{
    if (is_pointwise(&A->g1)) return xn;
    if (is_same_conv(&A->g1)) {
        im2col_same(&A->g1, xn, col);
        return col;
    }
    conv_args C = {.g = &A->g1, .x = xn, .out = col};
    im2col_units(&C, 0, A->g1.c);
    return col;
}

DT_CPU_KERNEL(fconv_fwd_part, p, part, part_end)
{
    const fconv_args *A = p;
    (void)part_end;
    float *col = A->scratch + (size_t)part * A->part_floats;
    int64_t n0 = part_start(A->n, (int)A->parts, (int)part);
    int64_t n1 = part_start(A->n, (int)A->parts, (int)part + 1);
    for (int64_t i = n0; i < n1; i++) {
        const float *c = image_columns(A, A->x + i * A->chw, col);
        float *yi = A->y + i * A->o * A->p;
        /* y_i (O, P) = W (O, CKK) col (CKK, P) */
        gemm_serial(0, 0, A->o, A->p, A->ckk, 1.0f, A->w, A->ckk, c, A->p, 0.0f, yi, A->p);
        if (A->b)
            for (int64_t oc = 0; oc < A->o; oc++) {
                float *restrict row = yi + oc * A->p, bias = A->b[oc];
                for (int64_t j = 0; j < A->p; j++) row[j] += bias;
            }
    }
}

static int64_t fconv_parts(const dt_backend *be, int64_t n)
{
    return min64(be->threads, max64(1, n));
}

static int scratch_reserve(dt_backend *be, size_t floats)
{
    if (floats <= be->scratch_floats) return 1;
    float *fresh = cpu_alloc(be, floats * sizeof(float));
    if (!fresh) return 0;
    cpu_free(be, be->scratch);
    be->scratch = fresh;
    be->scratch_floats = floats;
    return 1;
}

static void fconv_init(fconv_args *A, dt_backend *be, const dt_conv_geom *g, int64_t o)
{
    memset(A, 0, sizeof *A);
    A->g1 = *g;
    A->g1.n = 1;
    A->n = g->n;
    A->o = o;
    A->ckk = g->c * g->kh * g->kw;
    A->p = g->oh * g->ow;
    A->chw = g->c * g->h * g->w;
    A->parts = fconv_parts(be, g->n);
}

/* y (N,O,OH,OW) = conv(x, w) + b */
static dt_status cpu_conv2d_forward(dt_backend *be, const dt_conv_geom *g, int64_t o,
                                    const float *x, const float *w, const float *b, float *y)
{
    fconv_args A;
    fconv_init(&A, be, g, o);
    A.x = x;
    A.w = w;
    A.b = b;
    A.y = y;
    A.part_floats = (size_t)(A.ckk * A.p);
    if (!scratch_reserve(be, A.part_floats * (size_t)A.parts)) return DT_ENOMEM;
    A.scratch = be->scratch;
    parallel_for(be, A.parts, 1, fconv_fwd_part, &A);
    return DT_OK;
}

/* Sum of n floats in 16 independent lanes added in a fixed order: one add
 * chain would wait on each add's latency (4 cycles) and cannot vectorise. */
static float lane_sum(const float *restrict x, int64_t n)
{
    float lane[16] = {0};
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        for (int l = 0; l < 16; l++) lane[l] += x[j + l];
    float t = 0.0f;
    for (; j < n; j++) t += x[j];
    for (int l = 0; l < 16; l++) t += lane[l];
    return t;
}

/* per part: col (CKK,P) | dcol (CKK,P) | dw partial (O,CKK) | db partial (O) */
DT_CPU_KERNEL(fconv_bwd_part, p, part, part_end)
{
    const fconv_args *A = p;
    (void)part_end;
    size_t cp = (size_t)(A->ckk * A->p);
    float *col = A->scratch + (size_t)part * A->part_floats, *dcol = col + cp;
    float *dwp = dcol + cp, *dbp = dwp + A->o * A->ckk;
    int64_t n0 = part_start(A->n, (int)A->parts, (int)part);
    int64_t n1 = part_start(A->n, (int)A->parts, (int)part + 1);
    for (int64_t i = n0; i < n1; i++) {
        const float *dyi = A->dy + i * A->o * A->p;
        if (A->dw) { /* dW_part (O, CKK) += dy_i (O, P) col_i^T (P, CKK) */
            const float *c = image_columns(A, A->x + i * A->chw, col);
            gemm_serial(0, 1, A->o, A->ckk, A->p, 1.0f, dyi, A->p, c, A->p,
                        i == n0 ? 0.0f : 1.0f, dwp, A->ckk);
        }
        if (A->db)
            for (int64_t oc = 0; oc < A->o; oc++) {
                float acc = lane_sum(dyi + oc * A->p, A->p);
                dbp[oc] = i == n0 ? acc : dbp[oc] + acc;
            }
        if (A->dx) { /* dcol (CKK, P) = W^T (CKK, O) dy_i (O, P), folded into dx_i */
            float *dxi = A->dx + i * A->chw;
            if (is_pointwise(&A->g1)) {
                gemm_serial(1, 0, A->ckk, A->p, A->o, 1.0f, A->w, A->ckk, dyi, A->p,
                            A->acc_dx ? 1.0f : 0.0f, dxi, A->p);
                continue;
            }
            gemm_serial(1, 0, A->ckk, A->p, A->o, 1.0f, A->w, A->ckk, dyi, A->p, 0.0f, dcol, A->p);
            if (is_same_conv(&A->g1)) {
                col2im_same(&A->g1, dcol, dxi, A->acc_dx);
                continue;
            }
            conv_args C = {.g = &A->g1, .col = dcol, .out = dxi, .accumulate = A->acc_dx};
            col2im_units(&C, 0, A->g1.c);
        }
    }
}

/* sum the parts' partial gradients in part order into dst (+)= */
static void fconv_reduce(const fconv_args *A, int64_t offset, int64_t len, float *dst, int acc)
{
    for (int64_t j = 0; j < len; j++) {
        float v = acc ? dst[j] : 0.0f;
        for (int64_t q = 0; q < A->parts; q++) {
            int64_t n0 = part_start(A->n, (int)A->parts, (int)q);
            if (part_start(A->n, (int)A->parts, (int)q + 1) > n0)
                v += A->scratch[(size_t)q * A->part_floats + (size_t)offset + (size_t)j];
        }
        dst[j] = v;
    }
}

static dt_status cpu_conv2d_backward(dt_backend *be, const dt_conv_geom *g, int64_t o,
                                     const float *x, const float *w, const float *dy, float *dx,
                                     int acc_dx, float *dw, int acc_dw, float *db, int acc_db)
{
    fconv_args A;
    fconv_init(&A, be, g, o);
    A.x = x;
    A.w = w;
    A.dy = dy;
    A.dx = dx;
    A.dw = dw;
    A.db = db;
    A.acc_dx = acc_dx;
    size_t cp = (size_t)(A.ckk * A.p);
    A.part_floats = 2 * cp + (size_t)(A.o * A.ckk + A.o);
    A.part_floats = (A.part_floats + 15) & ~(size_t)15;   /* parts on separate lines */
    if (!scratch_reserve(be, A.part_floats * (size_t)A.parts)) return DT_ENOMEM;
    A.scratch = be->scratch;
    parallel_for(be, A.parts, 1, fconv_bwd_part, &A);
    if (dw) fconv_reduce(&A, (int64_t)(2 * cp), A.o * A.ckk, dw, acc_dw);
    if (db) fconv_reduce(&A, (int64_t)(2 * cp) + A.o * A.ckk, A.o, db, acc_db);
    return DT_OK;
}

typedef struct chan_args {
    int64_t n, c, p;
    const float *src;
    float *dst;
} chan_args;

/* y (N, C, inner) += bias (C); units are (n, c) runs of inner */
static void bias_add_units(void *p, int64_t lo, int64_t hi)
{
    const chan_args *A = p;
    int64_t inner = A->p;
    if (inner == 1) { /* linear: rows of C */
        for (int64_t r = lo; r < hi; r++) {
            float *restrict y = A->dst + r * A->c;
            const float *restrict b = A->src;
            for (int64_t j = 0; j < A->c; j++) y[j] += b[j];
        }
        return;
    }
    for (int64_t u = lo; u < hi; u++) {
        float *y = A->dst + u * inner, b = A->src[u % A->c];
        for (int64_t i = 0; i < inner; i++) y[i] += b;
    }
}

static void cpu_bias_add(dt_backend *be, int64_t n, int64_t c, int64_t inner, const float *bias,
                         float *y)
{
    chan_args A = {.n = n, .c = c, .p = inner, .src = bias, .dst = y};
    if (inner == 1)
        parallel_for(be, n, grain_units(DT_CPU_GRAIN_MEM, c), bias_add_units, &A);
    else
        parallel_for(be, n * c, grain_units(DT_CPU_GRAIN_MEM, inner), bias_add_units, &A);
}

/* units (n, c): copy one run of P between (C, N*P) and (N, C, P) */
static void cnp_to_ncp_units(void *p, int64_t lo, int64_t hi)
{
    const chan_args *A = p;
    for (int64_t u = lo; u < hi; u++) {
        int64_t n = u / A->c, c = u % A->c;
        memcpy(A->dst + u * A->p, A->src + (c * A->n + n) * A->p, (size_t)A->p * sizeof(float));
    }
}

static void ncp_to_cnp_units(void *p, int64_t lo, int64_t hi)
{
    const chan_args *A = p;
    for (int64_t u = lo; u < hi; u++) {
        int64_t n = u / A->c, c = u % A->c;
        memcpy(A->dst + (c * A->n + n) * A->p, A->src + u * A->p, (size_t)A->p * sizeof(float));
    }
}

/* src (C, N*P) -> dst (N, C, P) */
static void cpu_cnp_to_ncp(dt_backend *be, int64_t c, int64_t n, int64_t p, const float *src,
                           float *dst)
{
    chan_args A = {.n = n, .c = c, .p = p, .src = src, .dst = dst};
    parallel_for(be, n * c, grain_units(DT_CPU_GRAIN_MEM, p), cnp_to_ncp_units, &A);
}

/* src (N, C, P) -> dst (C, N*P) */
static void cpu_ncp_to_cnp(dt_backend *be, int64_t n, int64_t c, int64_t p, const float *src,
                           float *dst)
{
    chan_args A = {.n = n, .c = c, .p = p, .src = src, .dst = dst};
    parallel_for(be, n * c, grain_units(DT_CPU_GRAIN_MEM, p), ncp_to_cnp_units, &A);
}

/* ---------------------------------------------------------------------------
 * 10. Pooling, NCHW, square kernel k = g->kh; units are (n, c) planes
 *
 * Each window offset (ki, kj) updates a whole output row at once: the loop
 * over ow is branch-free and vectorizes, and every output still sees its
 * window in (ki, kj) row-major order, as PyTorch visits it.
 * ------------------------------------------------------------------------- */
typedef struct pool_args {
    const dt_conv_geom *g;
    const float *x;       /* x (forward) or dy (backward) */
    const int32_t *argmax;
    float *y;             /* y (forward) or dx (backward) */
    int32_t *argmax_out;
    int accumulate;
} pool_args;

/* best, at <- v, i when v is larger or NaN (PyTorch's rule: a NaN takes
 * over).  Written with bit masks: GCC otherwise turns the select into a
 * data-dependent branch, which mispredicts on real activations. */
static inline void max_take(float v, int64_t i, float *best, uint32_t *at)
{
    uint32_t take = 0u - (uint32_t)((v > *best) | (v != v));
    *best = u2f((f2u(v) & take) | (f2u(*best) & ~take));
    *at = ((uint32_t)i & take) | (*at & ~take);
}

/* outputs [ow0, ow1) of one row whose k x k windows lie inside the image,
 * top-left input at ih0*W + ow*s - pad.  Inlined with k = 2 and 3 as
 * constants, so the window loops unroll. */
static inline void maxpool_row_inside(const float *x, int64_t W, int64_t ih0, int64_t s,
                                      int64_t pad, int64_t k, int64_t ow0, int64_t ow1,
                                      float *y, int32_t *am)
{
    for (int64_t ow = ow0; ow < ow1; ow++) {
        int64_t base = ih0 * W + ow * s - pad;
        float best = x[base];
        uint32_t at = (uint32_t)base;
        for (int64_t ki = 0; ki < k; ki++)
            for (int64_t kj = 0; kj < k; kj++) {
                int64_t i = base + ki * W + kj;
                max_take(x[i], i, &best, &at);
            }
        y[ow] = best;
        am[ow] = (int32_t)at;
    }
}

/* one output whose window may reach into the padding: -inf and -1 if it
 * holds only padding */
static void maxpool_one_clipped(const float *x, const dt_conv_geom *g, int64_t oh, int64_t ow,
                                float *y, int32_t *am)
{
    int64_t k = g->kh, s = g->stride, W = g->w;
    int64_t h0 = max64(0, oh * s - g->pad), h1 = min64(g->h, oh * s - g->pad + k);
    int64_t w0 = max64(0, ow * s - g->pad), w1 = min64(W, ow * s - g->pad + k);
    float best = -INFINITY;
    uint32_t at = (uint32_t)-1;
    if (h0 < h1 && w0 < w1) {
        at = (uint32_t)(h0 * W + w0);
        best = x[at];
    }
    for (int64_t ih = h0; ih < h1; ih++)
        for (int64_t iw = w0; iw < w1; iw++) max_take(x[ih * W + iw], ih * W + iw, &best, &at);
    y[ow] = best;
    am[ow] = (int32_t)at;
}

/* one (H,W) plane -> (OH,OW); both paths visit each window in row-major
 * order and keep the first maximum, as PyTorch does */
static inline void maxpool_plane(const float *x, const dt_conv_geom *g, int64_t k, float *y,
                                 int32_t *am)
{
    int64_t H = g->h, W = g->w, OW = g->ow, s = g->stride, pad = g->pad;
    /* ow whose windows are inside horizontally: ow*s >= pad, ow*s - pad + k <= W */
    int64_t owa = min64(OW, (pad + s - 1) / s);
    int64_t owb = W + pad - k < 0 ? 0 : min64(OW, (W + pad - k) / s + 1);
    owb = max64(owa, owb);
    for (int64_t oh = 0; oh < g->oh; oh++, y += OW, am += OW) {
        int64_t ih0 = oh * s - pad;
        if (ih0 < 0 || ih0 + k > H) {
            for (int64_t ow = 0; ow < OW; ow++) maxpool_one_clipped(x, g, oh, ow, y, am);
            continue;
        }
        for (int64_t ow = 0; ow < owa; ow++) maxpool_one_clipped(x, g, oh, ow, y, am);
        maxpool_row_inside(x, W, ih0, s, pad, k, owa, owb, y, am);
        for (int64_t ow = owb; ow < OW; ow++) maxpool_one_clipped(x, g, oh, ow, y, am);
    }
}

/* The CNN's pooling (2x2, stride 2, no padding) on one plane.  Output rows
 * are short (14 and 7 wide), too short for a vector loop per row, so each
 * chunk of windows is first gathered into four contiguous arrays (the
 * window's four corners) and then reduced by one select loop over the whole
 * chunk, which the compiler vectorises.  Same first-max and NaN rules as
 * max_take. */
#define DT_CPU_POOL_CHUNK 256

static void maxpool2x2_plane(const float *x, int64_t W, int64_t OH, int64_t OW, float *y,
                             int32_t *am)
{
    float c0[DT_CPU_POOL_CHUNK], c1[DT_CPU_POOL_CHUNK], c2[DT_CPU_POOL_CHUNK],
        c3[DT_CPU_POOL_CHUNK];
    int32_t at0[DT_CPU_POOL_CHUNK];
    int64_t total = OH * OW, w32 = W;
    for (int64_t j0 = 0; j0 < total; j0 += DT_CPU_POOL_CHUNK) {
        int64_t len = min64(DT_CPU_POOL_CHUNK, total - j0);
        for (int64_t j = 0; j < len; j++) {      /* gather the corners */
            int64_t oh = (j0 + j) / OW, ow = (j0 + j) - oh * OW;
            int64_t i = 2 * oh * W + 2 * ow;
            c0[j] = x[i];
            c1[j] = x[i + 1];
            c2[j] = x[i + W];
            c3[j] = x[i + W + 1];
            at0[j] = (int32_t)i;
        }
        float *restrict yo = y + j0;
        int32_t *restrict ao = am + j0;
        for (int64_t j = 0; j < len; j++) {      /* vectorised selects */
            float best = c0[j], v = c1[j];
            int32_t at = 0;
            int t = (v > best) | (v != v);
            best = t ? v : best;
            at = t ? 1 : at;
            v = c2[j];
            t = (v > best) | (v != v);
            best = t ? v : best;
            at = t ? (int32_t)w32 : at;
            v = c3[j];
            t = (v > best) | (v != v);
            best = t ? v : best;
            at = t ? (int32_t)w32 + 1 : at;
            yo[j] = best;
            ao[j] = at0[j] + at;
        }
    }
}

/* y (OH,OW) = window max of x (H,W), argmax = flat h*W+w index.  Units are
 * planes.  Register-held max with the window unrolled: 2.4x faster than
 * updating whole output rows per window offset, which was itself 3.5x
 * faster than a branchy per-output loop (64x64x14x14, k2: 0.87 / 2.1 /
 * 3.6 ms, measured). */
static void maxpool_fwd_units(void *p, int64_t lo, int64_t hi)
{
    const pool_args *A = p;
    const dt_conv_geom *g = A->g;
    int64_t in = g->h * g->w, out = g->oh * g->ow;
    for (int64_t u = lo; u < hi; u++) {
        const float *x = A->x + u * in;
        float *y = A->y + u * out;
        int32_t *am = A->argmax_out + u * out;
        if (g->kh == 2 && g->stride == 2 && g->pad == 0)
            maxpool2x2_plane(x, g->w, g->oh, g->ow, y, am);
        else if (g->kh == 2)
            maxpool_plane(x, g, 2, y, am);
        else if (g->kh == 3)
            maxpool_plane(x, g, 3, y, am);
        else
            maxpool_plane(x, g, g->kh, y, am);
    }
}

static void cpu_maxpool_forward(dt_backend *be, const dt_conv_geom *g, const float *x, float *y,
                                int32_t *argmax)
{
    pool_args A = {.g = g, .x = x, .y = y, .argmax_out = argmax};
    int64_t per = g->oh * g->ow * g->kh * g->kh;
    parallel_for(be, g->n * g->c, grain_units(DT_CPU_GRAIN_MEM, per), maxpool_fwd_units, &A);
}

/* dx (H,W) (+)= dy scattered to the argmax positions */
static void maxpool_bwd_units(void *p, int64_t lo, int64_t hi)
{
    const pool_args *A = p;
    const dt_conv_geom *g = A->g;
    int64_t HW = g->h * g->w, P = g->oh * g->ow;
    for (int64_t u = lo; u < hi; u++) {
        float *dx = A->y + u * HW;
        const float *dy = A->x + u * P;
        const int32_t *am = A->argmax + u * P;
        if (!A->accumulate) memset(dx, 0, (size_t)HW * sizeof(float));
        for (int64_t i = 0; i < P; i++)
            if (am[i] >= 0) dx[am[i]] += dy[i];
    }
}

static void cpu_maxpool_backward(dt_backend *be, const dt_conv_geom *g, const float *dy,
                                 const int32_t *argmax, float *dx, int accumulate)
{
    pool_args A = {.g = g, .x = dy, .argmax = argmax, .y = dx, .accumulate = accumulate};
    int64_t per = g->h * g->w + g->oh * g->ow;
    parallel_for(be, g->n * g->c, grain_units(DT_CPU_GRAIN_MEM, per), maxpool_bwd_units, &A);
}

/* y (OH,OW) = window sum / (k*k): padding counts (count_include_pad=True);
 * loop order as in maxpool, so each window sums in row-major order */
static void avgpool_fwd_units(void *p, int64_t lo, int64_t hi)
{
    const pool_args *A = p;
    const dt_conv_geom *g = A->g;
    int64_t H = g->h, W = g->w, OH = g->oh, OW = g->ow, k = g->kh, s = g->stride;
    float div = (float)(k * k); /* divide, as PyTorch does, rather than scale */
    for (int64_t u = lo; u < hi; u++) {
        const float *x = A->x + u * H * W;
        float *restrict y = A->y + u * OH * OW;
        for (int64_t i = 0; i < OH * OW; i++) y[i] = 0.0f;
        for (int64_t ki = 0; ki < k; ki++) {
            for (int64_t kj = 0; kj < k; kj++) {
                int64_t w0, w1;
                valid_ow(g, kj, &w0, &w1);
                for (int64_t oh = 0; oh < OH; oh++) {
                    int64_t ih = oh * s - g->pad + ki;
                    if (ih < 0 || ih >= H) continue;
                    const float *xr = x + ih * W + kj - g->pad;
                    float *restrict yr = y + oh * OW;
                    for (int64_t ow = w0; ow < w1; ow++) yr[ow] += xr[ow * s];
                }
            }
        }
        for (int64_t i = 0; i < OH * OW; i++) y[i] /= div;
    }
}

static void cpu_avgpool_forward(dt_backend *be, const dt_conv_geom *g, const float *x, float *y)
{
    pool_args A = {.g = g, .x = x, .y = y};
    int64_t per = g->oh * g->ow * g->kh * g->kh;
    parallel_for(be, g->n * g->c, grain_units(DT_CPU_GRAIN_MEM, per), avgpool_fwd_units, &A);
}

/* dx (H,W) (+)= dy / (k*k) over each window's in-image part */
static void avgpool_bwd_units(void *p, int64_t lo, int64_t hi)
{
    const pool_args *A = p;
    const dt_conv_geom *g = A->g;
    int64_t H = g->h, W = g->w, OH = g->oh, OW = g->ow, k = g->kh, s = g->stride;
    float div = (float)(k * k);
    for (int64_t u = lo; u < hi; u++) {
        float *dx = A->y + u * H * W;
        const float *dy = A->x + u * OH * OW;
        if (!A->accumulate) memset(dx, 0, (size_t)(H * W) * sizeof(float));
        for (int64_t ki = 0; ki < k; ki++) {
            for (int64_t kj = 0; kj < k; kj++) {
                int64_t w0, w1;
                valid_ow(g, kj, &w0, &w1);
                for (int64_t oh = 0; oh < OH; oh++) {
                    int64_t ih = oh * s - g->pad + ki;
                    if (ih < 0 || ih >= H) continue;
                    float *restrict dr = dx + ih * W + kj - g->pad;
                    const float *restrict dyr = dy + oh * OW;
                    /* distinct ow hit distinct columns: no conflicts in this loop */
                    for (int64_t ow = w0; ow < w1; ow++) dr[ow * s] += dyr[ow] / div;
                }
            }
        }
    }
}

static void cpu_avgpool_backward(dt_backend *be, const dt_conv_geom *g, const float *dy, float *dx,
                                 int accumulate)
{
    pool_args A = {.g = g, .x = dy, .y = dx, .accumulate = accumulate};
    int64_t per = g->oh * g->ow * g->kh * g->kh;
    parallel_for(be, g->n * g->c, grain_units(DT_CPU_GRAIN_MEM, per), avgpool_bwd_units, &A);
}

/* ---------------------------------------------------------------------------
 * 11. Embedding
 * ------------------------------------------------------------------------- */
typedef struct emb_args {
    int64_t n, d;
    const float *src;
    const int32_t *idx;
    float *dst;
} emb_args;

/* y (n, d) = weight[idx[i]] */
static void emb_fwd_rows(void *p, int64_t lo, int64_t hi)
{
    const emb_args *A = p;
    for (int64_t i = lo; i < hi; i++)
        memcpy(A->dst + i * A->d, A->src + (int64_t)A->idx[i] * A->d, (size_t)A->d * sizeof(float));
}

static void cpu_embedding_forward(dt_backend *be, int64_t n, int64_t d, const float *weight,
                                  const int32_t *idx, float *y)
{
    emb_args A = {.n = n, .d = d, .src = weight, .idx = idx, .dst = y};
    parallel_for(be, n, grain_units(DT_CPU_GRAIN_MEM, d), emb_fwd_rows, &A);
}

/* dweight[idx[i]] += dy[i] in order of i; threads split the columns [lo, hi)
 * so repeated indices never race and keep their order */
static void emb_bwd_cols(void *p, int64_t lo, int64_t hi)
{
    const emb_args *A = p;
    for (int64_t i = 0; i < A->n; i++) {
        float *restrict w = A->dst + (int64_t)A->idx[i] * A->d;
        const float *restrict g = A->src + i * A->d;
        for (int64_t j = lo; j < hi; j++) w[j] += g[j];
    }
}

static void cpu_embedding_backward(dt_backend *be, int64_t n, int64_t d, const int32_t *idx,
                                   const float *dy, float *dweight)
{
    emb_args A = {.n = n, .d = d, .src = dy, .idx = idx, .dst = dweight};
    /* column slices below 64 floats would share cache lines between threads */
    int64_t grain = max64(64, grain_units(DT_CPU_GRAIN_MEM, n));
    parallel_for(be, d, grain, emb_bwd_cols, &A);
}

/* first i with idx[i] outside [0, limit), or -1 */
static int64_t cpu_index_check(dt_backend *be, int64_t n, const int32_t *idx, int64_t limit)
{
    (void)be;
    for (int64_t i = 0; i < n; i++)
        if (idx[i] < 0 || idx[i] >= limit) return i;
    return -1;
}

/* ---------------------------------------------------------------------------
 * 12. Layer norm over rows of length d (biased variance, as PyTorch)
 * ------------------------------------------------------------------------- */
typedef struct ln_args {
    int64_t rows, d;
    float eps;
    const float *x, *w, *b, *dy, *mean_in, *rstd_in;
    float *y, *mean, *rstd, *dw, *db;
    int accumulate;
} ln_args;

/* sum of (x - mu)^2 over a row, 16 double lanes in fixed order */
static double row_sqdev(const float *x, int64_t n, double mu)
{
    double acc[16] = {0}, s = 0.0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += ((double)x[i + j] - mu) * ((double)x[i + j] - mu);
    for (; i < n; i++) s += ((double)x[i] - mu) * ((double)x[i] - mu);
    for (int j = 0; j < 16; j++) s += acc[j];
    return s;
}

/* x (rows, d) -> y (rows, d), mean (rows), rstd (rows) */
DT_CPU_KERNEL(ln_fwd_rows, p, lo, hi)
{
    const ln_args *A = p;
    int64_t d = A->d;
    for (int64_t r = lo; r < hi; r++) {
        const float *x = A->x + r * d;
        float *y = A->y + r * d;
        double mu = run_sum(x, d, 0) / (double)d, var = row_sqdev(x, d, mu) / (double)d;
        float m = (float)mu, rs = (float)(1.0 / sqrt(var + (double)A->eps));
        A->mean[r] = m;
        A->rstd[r] = rs;
        const float *w = A->w, *b = A->b;
        if (w && b)
            for (int64_t j = 0; j < d; j++) y[j] = (x[j] - m) * rs * w[j] + b[j];
        else if (w)
            for (int64_t j = 0; j < d; j++) y[j] = (x[j] - m) * rs * w[j];
        else if (b)
            for (int64_t j = 0; j < d; j++) y[j] = (x[j] - m) * rs + b[j];
        else
            for (int64_t j = 0; j < d; j++) y[j] = (x[j] - m) * rs;
    }
}

static void cpu_layernorm_forward(dt_backend *be, int64_t rows, int64_t d, const float *x,
                                  const float *w, const float *b, float eps, float *y, float *mean,
                                  float *rstd)
{
    ln_args A = {.rows = rows, .d = d, .eps = eps, .x = x, .w = w, .b = b, .y = y, .mean = mean,
                 .rstd = rstd};
    parallel_for(be, rows, grain_units(DT_CPU_GRAIN_MEM, 4 * d), ln_fwd_rows, &A);
}

/* per row, xhat = (x-mean)*rstd, g = dy*w:
 * dx (+)= rstd * (g - mean(g) - xhat * mean(g*xhat)).  g is formed into dx
 * first so the sums and the update are plain vectorizable loops. */
DT_CPU_KERNEL(ln_bwd_rows, p, lo, hi)
{
    const ln_args *A = p;
    int64_t d = A->d;
    const float *w = A->w;
    float gbuf[DT_CPU_TILE];
    for (int64_t r = lo; r < hi; r++) {
        const float *x = A->x + r * d, *dy = A->dy + r * d;
        float *dx = A->y + r * d, m = A->mean_in[r], rs = A->rstd_in[r];
        double sg[16] = {0}, sgx[16] = {0};
        for (int64_t j0 = 0; j0 < d; j0 += DT_CPU_TILE) { /* pass 1: the two sums */
            int64_t n = min64(DT_CPU_TILE, d - j0), j = 0;
            for (int64_t k = 0; k < n; k++) gbuf[k] = w ? dy[j0 + k] * w[j0 + k] : dy[j0 + k];
            for (; j + 16 <= n; j += 16)
                for (int k = 0; k < 16; k++) {
                    float g = gbuf[j + k];
                    sg[k] += g;
                    sgx[k] += (double)(g * ((x[j0 + j + k] - m) * rs));
                }
            for (; j < n; j++) {
                sg[0] += gbuf[j];
                sgx[0] += (double)(gbuf[j] * ((x[j0 + j] - m) * rs));
            }
        }
        double tg = 0.0, tgx = 0.0;
        for (int k = 0; k < 16; k++) {
            tg += sg[k];
            tgx += sgx[k];
        }
        float mg = (float)(tg / (double)d), mgx = (float)(tgx / (double)d);
        int acc = A->accumulate;
        for (int64_t j = 0; j < d; j++) { /* pass 2 */
            float g = w ? dy[j] * w[j] : dy[j];
            float v = rs * (g - mg - (x[j] - m) * rs * mgx);
            dx[j] = acc ? dx[j] + v : v;
        }
    }
}

/* dw (d) += sum_r dy*xhat, db (d) += sum_r dy; column tiles, rows in order */
DT_CPU_KERNEL(ln_bwd_cols, p, lo, hi)
{
    const ln_args *A = p;
    int64_t d = A->d;
    double aw[DT_CPU_TILE], ab[DT_CPU_TILE];
    for (int64_t t = lo; t < hi; t++) {
        int64_t j0 = t * DT_CPU_TILE, w = min64(DT_CPU_TILE, d - j0);
        for (int64_t j = 0; j < w; j++) aw[j] = ab[j] = 0.0;
        for (int64_t r = 0; r < A->rows; r++) {
            const float *x = A->x + r * d + j0, *dy = A->dy + r * d + j0;
            float m = A->mean_in[r], rs = A->rstd_in[r];
            for (int64_t j = 0; j < w; j++) {
                aw[j] += (double)(dy[j] * ((x[j] - m) * rs));
                ab[j] += (double)dy[j];
            }
        }
        for (int64_t j = 0; j < w; j++) {
            if (A->dw) A->dw[j0 + j] += (float)aw[j];
            if (A->db) A->db[j0 + j] += (float)ab[j];
        }
    }
}

static void cpu_layernorm_backward(dt_backend *be, int64_t rows, int64_t d, const float *x,
                                   const float *w, const float *mean, const float *rstd,
                                   const float *dy, float *dx, float *dw, float *db, int accumulate)
{
    ln_args A = {.rows = rows, .d = d, .x = x, .w = w, .dy = dy, .mean_in = mean, .rstd_in = rstd,
                 .y = dx, .dw = dw, .db = db, .accumulate = accumulate};
    parallel_for(be, rows, grain_units(DT_CPU_GRAIN_MEM, 4 * d), ln_bwd_rows, &A);
    if (dw || db) {
        int64_t ntiles = (d + DT_CPU_TILE - 1) / DT_CPU_TILE;
        int64_t grain = grain_units(DT_CPU_GRAIN_MEM, DT_CPU_TILE * rows);
        parallel_for(be, ntiles, grain, ln_bwd_cols, &A);
    }
}

/* ---------------------------------------------------------------------------
 * 13. Dropout
 *
 * u_i = hash(seed, i) in [0, 1) from a counter-based hash, so element i's
 * mask never depends on which thread computes it.  The hash is 32-bit
 * (two murmur3 finalizer rounds keyed by the seed) so the loop vectorizes
 * without 64-bit multiplies; the high 32 bits of i re-key it.
 * ------------------------------------------------------------------------- */
static uint64_t splitmix64(uint64_t z)
{
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint32_t fmix32(uint32_t h)
{
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return h;
}

/* the uniform the mask of element i is drawn from (24 bits) */
static float dropout_uniform(uint32_t k0, uint32_t k1, uint32_t i)
{
    uint32_t h = fmix32(fmix32(i ^ k0) + k1);
    return (float)(h >> 8) * 0x1p-24f;
}

typedef struct drop_args {
    float p, scale;
    uint64_t seed;
    const float *x;
    float *y, *mask;
} drop_args;

static void dropout_range(void *arg, int64_t lo, int64_t hi)
{
    const drop_args *A = arg;
    const float *x = A->x;
    float *y = A->y, *mask = A->mask, p = A->p, scale = A->scale;
    while (lo < hi) { /* segments sharing the high 32 bits of i */
        uint64_t hi32 = (uint64_t)lo >> 32;
        int64_t end = min64(hi, (int64_t)((hi32 + 1) << 32));
        uint64_t key = splitmix64(A->seed ^ splitmix64(hi32));
        uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
        for (int64_t i = lo; i < end; i++) {
            float m = dropout_uniform(k0, k1, (uint32_t)i) >= p ? scale : 0.0f;
            mask[i] = m;
            y[i] = x[i] * m;
        }
        lo = end;
    }
}

/* mask (n) = u_i >= p ? 1/(1-p) : 0; y (n) = x * mask */
static void cpu_dropout_forward(dt_backend *be, int64_t n, float p, uint64_t seed, const float *x,
                                float *y, float *mask)
{
    drop_args A = {.p = p, .scale = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f, .seed = seed, .x = x,
                   .y = y, .mask = mask};
    parallel_for(be, n, DT_CPU_GRAIN_MEM / 4, dropout_range, &A);
}

/* ---------------------------------------------------------------------------
 * 14. Optimizers, in place over n elements (torch.optim semantics)
 * ------------------------------------------------------------------------- */
typedef struct opt_args {
    float *w, *buf, *m, *v;
    const float *g;
    float lr, momentum, dampening, wd, beta1, beta2, eps, step_size, bc2_sqrt;
    int nesterov, first, decoupled;
} opt_args;

/* g' = g + wd w; buf = first ? g' : mom buf + (1-damp) g';
 * step = nesterov ? g' + mom buf : buf (g' without momentum); w -= lr step */
static void sgd_range(void *p, int64_t lo, int64_t hi)
{
    const opt_args *A = p;
    float *w = A->w, *buf = A->buf, lr = A->lr, mom = A->momentum, wd = A->wd;
    float keep = 1.0f - A->dampening;
    const float *g = A->g;
    if (mom == 0.0f) {
        for (int64_t i = lo; i < hi; i++) w[i] -= lr * (g[i] + wd * w[i]);
        return;
    }
    for (int64_t i = lo; i < hi; i++) {
        float gi = g[i] + wd * w[i];
        float b = A->first ? gi : mom * buf[i] + keep * gi;
        buf[i] = b;
        w[i] -= lr * (A->nesterov ? gi + mom * b : b);
    }
}

static void cpu_sgd_update(dt_backend *be, int64_t n, float *w, const float *g, float *buf,
                           float lr, float momentum, float dampening, int nesterov,
                           float weight_decay, int first)
{
    opt_args A = {.w = w, .buf = buf, .g = g, .lr = lr, .momentum = momentum,
                  .dampening = dampening, .wd = weight_decay, .nesterov = nesterov, .first = first};
    parallel_for(be, n, DT_CPU_GRAIN_MEM / 2, sgd_range, &A);
}

/* y = sqrt(x) (n), exact IEEE square roots.  GCC will not vectorize sqrtf
 * without a global -fno-math-errno (it may set errno on negative input), so
 * without it the vector instruction is named here where there is one.  With
 * it (build.sh), the plain loop vectorizes at the width of the copy it is
 * inlined into (DT_CPU_KERNEL), where the names would fix SSE2's. */
static void sqrt_run(const float *restrict x, float *restrict y, int64_t n)
{
    int64_t i = 0;
#if defined(__NO_MATH_ERRNO__)
    /* the loop below */
#elif defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_sqrt_ps(_mm512_loadu_ps(x + i)));
#elif defined(__AVX__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_sqrt_ps(_mm256_loadu_ps(x + i)));
#elif defined(__SSE2__)
    for (; i + 4 <= n; i += 4) _mm_storeu_ps(y + i, _mm_sqrt_ps(_mm_loadu_ps(x + i)));
#elif defined(__ARM_NEON) && defined(__aarch64__)
    for (; i + 4 <= n; i += 4) vst1q_f32(y + i, vsqrtq_f32(vld1q_f32(x + i)));
#endif
    for (; i < n; i++) y[i] = sqrtf(x[i]);
}

#define DT_CPU_ADAM_CHUNK 512   /* elements per pass; 3 passes stay in L1 */

/* AdamW: w *= 1 - lr wd; Adam: g += wd w.  m = m + (1-b1)(g-m) (torch's lerp);
 * v = b2 v + (1-b2) g g; w -= (lr/bc1) m / (sqrt(v)/sqrt(bc2) + eps).
 * Three vectorized passes per chunk: moments, square roots, weights. */
DT_CPU_KERNEL(adam_range, p, lo, hi)
{
    const opt_args *A = p;
    float *w = A->w, *m = A->m, *v = A->v;
    const float *g = A->g;
    float wd = A->wd;
    float decay = A->decoupled ? 1.0f - A->lr * wd : 1.0f, l2 = A->decoupled ? 0.0f : wd;
    float b1c = 1.0f - A->beta1, b2 = A->beta2, b2c = 1.0f - A->beta2, eps = A->eps;
    float step = A->step_size, bcs = A->bc2_sqrt;
    float root[DT_CPU_ADAM_CHUNK];
    for (int64_t c0 = lo; c0 < hi; c0 += DT_CPU_ADAM_CHUNK) {
        int64_t c1 = min64(hi, c0 + DT_CPU_ADAM_CHUNK);
        for (int64_t i = c0; i < c1; i++) {
            float gi = g[i] + l2 * (w[i] * decay);
            m[i] = m[i] + b1c * (gi - m[i]);
            v[i] = b2 * v[i] + b2c * gi * gi;
        }
        sqrt_run(v + c0, root, c1 - c0);
        for (int64_t i = c0; i < c1; i++)
            w[i] = w[i] * decay - step * m[i] / (root[i - c0] / bcs + eps);
    }
}

static void cpu_adam_update(dt_backend *be, int64_t n, float *w, const float *g, float *m, float *v,
                            float lr, float beta1, float beta2, float eps, float weight_decay,
                            int decoupled, float bc1, float bc2)
{
    opt_args A = {.w = w, .g = g, .m = m, .v = v, .lr = lr, .beta1 = beta1, .beta2 = beta2,
                  .eps = eps, .wd = weight_decay, .decoupled = decoupled,
                  .step_size = (float)((double)lr / (double)bc1),
                  .bc2_sqrt = (float)sqrt((double)bc2)};
    parallel_for(be, n, DT_CPU_GRAIN_MATH, adam_range, &A);
}

/* g' = g + wd w; sum += g' g'; w -= lr g' / (sqrt(sum) + eps), chunked as
 * Adam is so the square roots vectorize. */
DT_CPU_KERNEL(adagrad_range, p, lo, hi)
{
    const opt_args *A = p;
    float *w = A->w, *sum = A->m, lr = A->lr, eps = A->eps, wd = A->wd;
    const float *g = A->g;
    float root[DT_CPU_ADAM_CHUNK];
    for (int64_t c0 = lo; c0 < hi; c0 += DT_CPU_ADAM_CHUNK) {
        int64_t c1 = min64(hi, c0 + DT_CPU_ADAM_CHUNK);
        for (int64_t i = c0; i < c1; i++) {
            float gi = g[i] + wd * w[i];
            sum[i] += gi * gi;
        }
        sqrt_run(sum + c0, root, c1 - c0);
        for (int64_t i = c0; i < c1; i++)
            w[i] -= lr * (g[i] + wd * w[i]) / (root[i - c0] + eps);
    }
}

static void cpu_adagrad_update(dt_backend *be, int64_t n, float *w, const float *g, float *sum,
                               float lr, float eps, float weight_decay)
{
    opt_args A = {.w = w, .g = g, .m = sum, .lr = lr, .eps = eps, .wd = weight_decay};
    parallel_for(be, n, DT_CPU_GRAIN_MATH, adagrad_range, &A);
}

/* ---------------------------------------------------------------------------
 * 15. Metrics
 * ------------------------------------------------------------------------- */

/* rows of logits (n,c) whose first argmax equals the label */
static int64_t cpu_count_correct(dt_backend *be, int64_t n, int64_t c, const float *logits,
                                 const int32_t *labels)
{
    (void)be;
    int64_t hits = 0;
    for (int64_t r = 0; r < n; r++) {
        const float *x = logits + r * c;
        int64_t best = 0;
        for (int64_t j = 1; j < c; j++)
            if (x[j] > x[best]) best = j;
        hits += c > 0 && best == labels[r];
    }
    return hits;
}

/* ---------------------------------------------------------------------------
 * 15b. Attention: one head at a time over the pool, its scores in a (t, t)
 * scratch block of the calling part (two in backward); nothing but the
 * row log-sum-exp is kept between forward and backward.
 * ------------------------------------------------------------------------- */
typedef struct attn_args {
    int64_t t, d;
    float scale;
    int causal;
    const float *mask, *q, *k, *v, *o, *lse_in, *dout;
    float *out, *lse, *dq, *dk, *dv;
    float *scratch;            /* per part: 2 t*t floats */
    atomic_int next_slot;
} attn_args;

/* p (t, t) = exp(scores - lse) for head h; with lse NULL the row log-sum-
 * exps are computed (into lse_out) first.  Recomputed in backward from the
 * same calls, so forward's and backward's probabilities are the same bits. */
static void attn_probs(const attn_args *A, int64_t h, const float *lse, float *lse_out, float *p)
{
    int64_t t = A->t, d = A->d;
    gemm_serial(0, 1, t, t, d, A->scale, A->q + h * t * d, d, A->k + h * t * d, d, 0.0f, p, t);
    for (int64_t i = 0; i < t; i++) {
        float *row = p + i * t;
        for (int64_t j = 0; A->mask && j < t; j++)
            row[j] += A->mask[i * t + j];
        for (int64_t j = i + 1; A->causal && j < t; j++)
            row[j] = -INFINITY;
        float l;
        if (lse) {
            l = lse[i];
        } else {
            float m = -INFINITY, sum = 0.0f;
            for (int64_t j = 0; j < t; j++)
                m = row[j] > m ? row[j] : m;
            for (int64_t j = 0; j < t; j++)
                sum += dt_expf(row[j] - m);
            l = m + logf(sum);
            lse_out[i] = l;
        }
        for (int64_t j = 0; j < t; j++)
            row[j] = dt_expf(row[j] - l);
    }
}

DT_CPU_KERNEL(attn_fwd_range, arg, lo, hi)
{
    attn_args *A = arg;
    int64_t t = A->t, d = A->d;
    float *p = A->scratch + (size_t)atomic_fetch_add(&A->next_slot, 1) * 2 * (size_t)(t * t);
    for (int64_t h = lo; h < hi; h++) {
        attn_probs(A, h, NULL, A->lse + h * t, p);
        gemm_serial(0, 0, t, d, t, 1.0f, p, t, A->v + h * t * d, d, 0.0f, A->out + h * t * d, d);
    }
}

DT_CPU_KERNEL(attn_bwd_range, arg, lo, hi)
{
    attn_args *A = arg;
    int64_t t = A->t, d = A->d;
    float *p = A->scratch + (size_t)atomic_fetch_add(&A->next_slot, 1) * 2 * (size_t)(t * t);
    float *ds = p + t * t;
    for (int64_t h = lo; h < hi; h++) {
        const float *q = A->q + h * t * d, *k = A->k + h * t * d, *v = A->v + h * t * d;
        const float *o = A->o + h * t * d, *dout = A->dout + h * t * d;
        attn_probs(A, h, A->lse_in + h * t, NULL, p);
        gemm_serial(1, 0, t, d, t, 1.0f, p, t, dout, d, 0.0f, A->dv + h * t * d, d);   /* P^T dO */
        gemm_serial(0, 1, t, t, d, 1.0f, dout, d, v, d, 0.0f, ds, t);                  /* dO V^T */
        for (int64_t i = 0; i < t; i++) {   /* dS = P (dP - rowsum(dO o O)) */
            float di = 0.0f;
            for (int64_t e = 0; e < d; e++)
                di += dout[i * d + e] * o[i * d + e];
            for (int64_t j = 0; j < t; j++)
                ds[i * t + j] = p[i * t + j] * (ds[i * t + j] - di);
        }
        gemm_serial(0, 0, t, d, t, A->scale, ds, t, k, d, 0.0f, A->dq + h * t * d, d);
        gemm_serial(1, 0, t, d, t, A->scale, ds, t, q, d, 0.0f, A->dk + h * t * d, d);
    }
}

/* A part per thread at most, each with its own scratch. */
static dt_status attn_run(dt_backend *be, int64_t bh, attn_args *A, dt_cpu_range_fn fn)
{
    size_t per = 2 * (size_t)(A->t * A->t) * sizeof(float);
    A->scratch = be->al.malloc_fn(per * (size_t)(be->threads > 0 ? be->threads : 1), be->al.user);
    if (!A->scratch)
        return DT_ENOMEM;
    atomic_init(&A->next_slot, 0);
    parallel_for(be, bh, 1, fn, A);
    be->al.free_fn(A->scratch, be->al.user);
    return DT_OK;
}

static dt_status cpu_attention_forward(dt_backend *be, int64_t bh, int64_t t, int64_t d,
                                       float scale, int causal, const float *mask, const float *q,
                                       const float *k, const float *v, float *o, float *lse)
{
    attn_args A = {.t = t, .d = d, .scale = scale, .causal = causal, .mask = mask, .q = q,
                   .k = k, .v = v, .out = o, .lse = lse};
    return attn_run(be, bh, &A, attn_fwd_range);
}

static dt_status cpu_attention_backward(dt_backend *be, int64_t bh, int64_t t, int64_t d,
                                        float scale, int causal, const float *mask,
                                        const float *q, const float *k, const float *v,
                                        const float *o, const float *lse, const float *dout,
                                        float *dq, float *dk, float *dv)
{
    attn_args A = {.t = t, .d = d, .scale = scale, .causal = causal, .mask = mask, .q = q,
                   .k = k, .v = v, .o = o, .lse_in = lse, .dout = dout, .dq = dq, .dk = dk,
                   .dv = dv};
    return attn_run(be, bh, &A, attn_bwd_range);
}

/* The kernels both tables share. */
/* ---------------------------------------------------------------------------
 * 16. The interface table
 * ------------------------------------------------------------------------- */
#define DT_CPU_KERNELS \
    .gemm = cpu_gemm, \
    .gemm_batched = cpu_gemm_batched, \
    .fill = cpu_fill, \
    .axpby = cpu_axpby, \
    .unary = cpu_unary, \
    .unary_backward = cpu_unary_backward, \
    .binary = cpu_binary, \
    .copy_strided = cpu_copy_strided, \
    .sum_to = cpu_sum_to, \
    .reduce_axis = cpu_reduce_axis, \
    .sum = cpu_sum, \
    .sumsq = cpu_sumsq, \
    .softmax = cpu_softmax, \
    .softmax_backward = cpu_softmax_backward, \
    .xent_forward = cpu_xent_forward, \
    .xent_backward = cpu_xent_backward, \
    .im2col = cpu_im2col, \
    .col2im = cpu_col2im, \
    .conv2d_forward = cpu_conv2d_forward, \
    .conv2d_backward = cpu_conv2d_backward, \
    .bias_add = cpu_bias_add, \
    .bias_grad = cpu_bias_grad, \
    .cnp_to_ncp = cpu_cnp_to_ncp, \
    .ncp_to_cnp = cpu_ncp_to_cnp, \
    .maxpool_forward = cpu_maxpool_forward, \
    .maxpool_backward = cpu_maxpool_backward, \
    .avgpool_forward = cpu_avgpool_forward, \
    .avgpool_backward = cpu_avgpool_backward, \
    .embedding_forward = cpu_embedding_forward, \
    .embedding_backward = cpu_embedding_backward, \
    .index_check = cpu_index_check, \
    .layernorm_forward = cpu_layernorm_forward, \
    .layernorm_backward = cpu_layernorm_backward, \
    .dropout_forward = cpu_dropout_forward, \
    .sgd_update = cpu_sgd_update, \
    .adam_update = cpu_adam_update, \
    .adagrad_update = cpu_adagrad_update, \
    .count_correct = cpu_count_correct, \
    .round_prec = cpu_round_prec, \
    .to_half = cpu_to_half, \
    .from_half = cpu_from_half, \
    .attention_forward = cpu_attention_forward, \
    .attention_backward = cpu_attention_backward,

static const dt_backend_iface dt_cpu_iface = {
    .version = DT_BACKEND_IFACE_VERSION,
    .name = "cpu",
    .init = cpu_init,
    .shutdown = cpu_shutdown,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .to_device = cpu_memcpy,
    .to_host = cpu_memcpy,
    .copy = cpu_memcpy,
    .memset0 = cpu_memset0,
    .sync = cpu_sync,
    .host_visible = 1,
    .discard = cpu_discard,
    DT_CPU_KERNELS
};

/* 3.1: the same kernels behind device-memory semantics */
static const dt_backend_iface dt_cpu_staged_iface = {
    .version = DT_BACKEND_IFACE_VERSION,
    .name = "cpu-staged",
    .init = cpu_init,
    .shutdown = cpu_shutdown,
    .alloc = staged_alloc,
    .free = staged_free,
    .to_device = cpu_memcpy,
    .to_host = cpu_memcpy,
    .copy = cpu_memcpy,
    .memset0 = cpu_memset0,
    .sync = cpu_sync,
    .host_visible = 0,
    .host_alloc = cpu_alloc,
    .host_free = cpu_free,
    .copy_async = staged_copy_async,
    .copy_wait = staged_copy_wait,
    .copy_join = staged_copy_join,
    .discard = staged_discard,
    .commit = staged_commit,
    DT_CPU_KERNELS
};

const dt_backend_iface *dt_backend_cpu_iface(void) { return &dt_cpu_iface; }
const dt_backend_iface *dt_backend_cpu_staged_iface(void) { return &dt_cpu_staged_iface; }
