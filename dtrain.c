/*
 * dtrain.c - the core of dtrain.  See dtrain.h for the public API and
 * backends/backend.h for the compute-backend interface.
 *
 * The core never touches tensor memory directly: every byte of tensor data is
 * read and written by the compute backend (CPU, CUDA) through function
 * pointers, so this file compiles without OpenBLAS, CUDA or libfabric.
 *
 * Sections, top to bottom:
 *   1. Internal types
 *   2. Errors and the context
 *   3. Arenas (per-step memory, no malloc once warm)
 *   4. Tensors
 *   5. Parameters, random numbers and initialisation
 *   6. The autograd tape and backward
 *   7. Ops, each a forward/backward pair
 *   8. Activation checkpointing (recompute)
 *   9. Optimizers, schedules, gradient clipping
 *  10. Checkpoints (safetensors)
 *  11. Data: IDX files and the prefetching loader
 *  12. Utilities
 *  13. Processes: launcher environment and the rendezvous store
 *  14. Communicators and collectives
 *  15. Launching ranks on one host
 *  16. Data parallelism (DDP), load balancing
 *  17. In-process data parallelism
 *  18. Parameter server
 *  19. Hogwild!
 *  20. Profiler: step breakdowns, timelines, stragglers
 *  21. Work stealing
 *  22. Model parallelism: pipelines, balanced partitions, tensor-parallel layers
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "dtrain.h"
#include "backends/backend.h"
#include "backends/transport.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/wait.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

/* ===========================================================================
 * 1. Internal types
 *
 * A tensor is a header (shape, strides, data pointer) plus flags.  Step
 * tensors live in the context's arenas and die at dt_step_reset; persistent
 * tensors (parameters, optimizer state, loader batches) are allocated one by
 * one and kept on a list so the context can free them.  A node is one op on
 * the tape: its output, its inputs and what backward needs.
 * ======================================================================== */

enum {
    T_PERSIST = 1u << 0,    /* allocated individually, on ctx->persist list */
    T_PARAM = 1u << 1,      /* registered parameter (ctx-owned) */
    T_REQGRAD = 1u << 2,    /* gradients flow to/through this tensor */
    T_OWNS_DATA = 1u << 3,  /* data allocated with the tensor (not a view) */
    T_ZERO = 1u << 4,       /* contents are logically zero, not yet written */
    T_EXTERNAL = 1u << 5,   /* header owned by another object (loader) */
    T_GRADBUF = 1u << 6     /* persistent gradient owned by its tensor */
};

struct dt_node;

struct dt_tensor {
    dt_ctx *ctx;
    dt_dtype dtype;
    int ndim;
    int64_t shape[DT_MAX_DIMS];
    int64_t stride[DT_MAX_DIMS];   /* in elements */
    void *data;                    /* device pointer to element (0,...,0) */
    unsigned flags;
    dt_tensor *grad;               /* same shape, contiguous */
    struct dt_node *node;          /* op that made it (NULL for leaves) */
    char *name;                    /* persistent tensors only */
    int param_index;               /* T_PARAM: index in ctx->params */
    dt_tensor *next, *prev;        /* persistent list */
    struct row_log *rowlog;        /* Hogwild! (19): the gradient rows embedding wrote */
};

/* The rows of a 2-D parameter's gradient that backward wrote through
 * dt_embedding, while the gradient's memory is known to be zero elsewhere;
 * dense: another op wrote all of it this step. */
typedef struct row_log {
    int64_t *rows, n, cap;
    int dense;
    unsigned char *mark;       /* per row: already in rows (while applying) */
} row_log;

typedef struct dt_node dt_node;
typedef dt_status (*dt_backward_fn)(dt_ctx *ctx, dt_node *n);

#define NODE_MAX_IN 4
struct dt_node {
    dt_node *prev;                 /* tape: newest first */
    const char *op;
    dt_backward_fn backward;
    dt_tensor *out;
    dt_tensor *in[NODE_MAX_IN];
    int n_in;
    int64_t iarg[8];
    float farg[4];
    void *aux[4];                  /* saved buffers (arena) */
    dt_precision prec;             /* autocast when recorded: backward's GEMMs use it */
    dt_segment_fn seg_fn;          /* recompute: the segment function */
    void *user;                    /* recompute: its user pointer */
};

typedef struct dt_chunk {
    struct dt_chunk *next;
    char *base;
    size_t size, used;
} dt_chunk;

typedef struct dt_arena {
    int on_device;                 /* 1: backend memory, 0: host allocator */
    dt_chunk *first, *cur;
    size_t capacity;               /* sum of chunk sizes */
    size_t used;                   /* bytes handed out since reset */
    size_t peak;
    size_t min_chunk;
    uint64_t grows;
} dt_arena;

typedef struct dt_arena_mark {
    dt_chunk *chunk;
    size_t chunk_used, used;
} dt_arena_mark;

/* The profiler's state (20), one per context.  The phases and the step
 * are the compute thread's alone; the event buffer and the totals the comm
 * and loader threads add to are under mu. */
typedef struct prof_event {
    double t0, t1;             /* dt_now(), this rank's clock */
    int64_t a, b;              /* step: index, samples; collective: bytes, ranks; PS call:
                                  floats, staleness (-1: none); batch: samples; straggler:
                                  rank, per-sample compute in ns */
    uint8_t type, tid, what, alg;   /* what: phase, collective kind or PS op */
    uint32_t pad;
} prof_event;

typedef struct prof_state {
    pthread_mutex_t mu;
    int measure;               /* phases and steps are measured (profiling or balancing) */
    int record;                /* profiling: events kept, collectives timed */
    dt_profile_config cfg;
    prof_event *ev;
    int64_t nev, cap, dropped;
    /* the step under way (compute thread) */
    int depth, open, had_backward;
    double step_t0, mark, cur[6];
    double cur_pipe;           /* of cur[PH_COMM_WAIT]: waiting for pipeline neighbours (22) */
    int64_t cur_samples, step_index;
    /* totals */
    dt_profile_stats tot;
    double bus_bytes;          /* collectives' bytes times their bus factor */
    double coll_s;             /* their time (busbw = bus_bytes / coll_s) */
    double stale_sum;
    int64_t stale_n;
    double batch_s;            /* the loader's time preparing batches */
    int64_t batches;
    int64_t batches_prefetched; /* of them, made on a loader's own thread */
    /* since the last cross-rank check (16: balance, stragglers) */
    double win_compute;
    int64_t win_steps, win_samples;
    int balancing;             /* a DDP balances the load: keep measuring (16) */
    int straggler;             /* the latest check's, -1: none */
    int warned_rank;           /* the straggler last warned of, -1: none */
    /* rank 0 after dt_profile_finish */
    char *report;
    dt_profile_stats *ranks;
    int nranks;
} prof_state;

struct dt_ctx {
    dt_allocator al;
    const dt_backend_iface *be_iface;
    dt_backend *be;
    dt_status init_status;
    dt_status last_status;
    char err[DT_MAX_ERROR];
    char warning[DT_MAX_ERROR];    /* the latest warning (dt_last_warning) */
    uint64_t errors;               /* set_error calls so far (was this error set just now?) */
    dt_log_fn log_fn;
    void *log_user;
    int threads;
    uint64_t seed;
    uint64_t rng[4];               /* xoshiro256** state for init */
    uint64_t dropout_counter;
    int grad_enabled, training;
    dt_precision autocast;         /* matmul, linear, conv2d inputs (6.1) */

    dt_arena dev, host;            /* step memory */
    dt_arena scratch_dev, scratch_host; /* recompute segments */
    dt_arena *cur_dev, *cur_host;
    int in_recompute;

    dt_node *tape;                 /* newest node */
    dt_tensor *persist;            /* persistent tensors */
    dt_tensor *doomed;             /* freed while the tape may read them: at dt_step_reset */
    size_t persistent_bytes;
    dt_tensor **params;
    int n_params, cap_params;
    dt_tensor **ckpt_extra;        /* saved and loaded with the parameters (a parameter */
    int n_ckpt_extra;              /* server's tables, 18); borrowed, NULL normally */
    struct dt_ddp *ddp;            /* attached data parallelism (16), or NULL */
    uint64_t zero_gen;             /* bumped by every zero_grad (16 notices one mid-step) */
    prof_state prof;               /* the profiler (20) */
};

#define DT_DEFAULT_ARENA_BYTES ((size_t)8 << 20)
#define DT_ARENA_ALIGN 64

static dt_status set_error(dt_ctx *ctx, dt_status s, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static dt_status be_fault(dt_ctx *ctx, const char *what);   /* section 6 */

/* Data parallelism (16) hooks into backward (6) and the context's end. */
static dt_status ddp_backward_begin(struct dt_ddp *d);
static void ddp_node_done(struct dt_ddp *d, const dt_node *n);
static dt_status ddp_backward_end(struct dt_ddp *d, dt_status backward_status);
static void ddp_detach(struct dt_ddp *d);
static uint16_t f32_to_bf16(float f);
static float bf16_to_f32(uint16_t h);
static uint16_t f32_to_f16(float f);
static float f16_to_f32(uint16_t h);
static void ddp_forget_optim(struct dt_ddp *d, const dt_optim *opt);
static int64_t ddp_grad_chunk_rows(dt_ctx *ctx, const dt_tensor *w, int64_t rows, int64_t cols);
static void ddp_grad_rows_done(dt_ctx *ctx, const dt_tensor *w, int64_t rows_done, int64_t cols);

/* The parameter server (18) runs its workers' requests on the comm thread (14). */
struct dt_work;
struct xfers;
static dt_status ps_run(dt_comm *c, struct dt_work *w, struct xfers **xsp);
static dt_status ps_check_servers(dt_comm *c, struct dt_work *w);
struct ps_call;
static void ps_pushed(dt_ps *ps, int requests);
static size_t ps_encode_push(const dt_ps *ps, struct ps_call *pc, int kind, double ratio,
                             float *residual, float *scratch, char *out);
static dt_status ps_step_pull(dt_ps *ps);
static int64_t ps_clock(const dt_ps *ps);
static dt_status ddp_ps_check(dt_ctx *ctx, dt_comm *c, const dt_ddp_config *cfg, const dt_optim *opt);
static dt_status ddp_for_scaler(struct dt_ddp *d, int finish);

/* The profiler (20) hears of phases, steps, collectives and batches. */
enum { PH_DATA, PH_FORWARD, PH_BACKWARD, PH_COMM_WAIT, PH_OPTIM, PH_IDLE, PH_COUNT };
static double prof_begin(dt_ctx *ctx);
static void prof_end(dt_ctx *ctx, int phase, double t0);
static void prof_step_end(dt_ctx *ctx);
static void prof_samples(dt_ctx *ctx, int64_t n);
static void prof_coll(dt_comm *c, const struct dt_work *w, double t0, double t1);
static void prof_batch(dt_ctx *ctx, int64_t samples, double t0, double t1, int on_thread);
static void prof_init(dt_ctx *ctx);
static void prof_release(dt_ctx *ctx);
static int prof_recording(const dt_ctx *ctx);
static dt_status prof_exchange(dt_ctx *ctx, dt_comm *c, double *rates);

/* ===========================================================================
 * 2. Errors and the context
 *
 * Every failure goes through set_error, which keeps the status and a message
 * in the context (never a global).  Functions that return a handle return
 * NULL and leave the message; ops given a NULL input return NULL without
 * overwriting the message of the op that failed first.
 * ======================================================================== */

const char *dt_strerror(dt_status s)
{
    switch (s) {
    case DT_OK: return "ok";
    case DT_EINVAL: return "invalid argument";
    case DT_ENOMEM: return "out of memory";
    case DT_EIO: return "input/output error";
    case DT_ECORRUPT: return "corrupt or truncated data";
    case DT_EMISMATCH: return "mismatch";
    case DT_ENOTSUP: return "not supported";
    case DT_ESTATE: return "invalid state";
    case DT_ETIMEDOUT: return "timed out";
    case DT_EPEER: return "peer failure";
    case DT_EOF: return "end of data";
    }
    return "unknown status";
}

static dt_status set_error(dt_ctx *ctx, dt_status s, const char *fmt, ...)
{
    if (!ctx)
        return s;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ctx->err, sizeof ctx->err, fmt, ap);
    va_end(ap);
    ctx->last_status = s;
    ctx->errors++;
    return s;
}

const char *dt_last_error(const dt_ctx *ctx) { return ctx ? ctx->err : "context is NULL"; }
const char *dt_last_warning(const dt_ctx *ctx) { return ctx ? ctx->warning : ""; }

void dt_set_log(dt_ctx *ctx, dt_log_fn fn, void *user)
{
    if (!ctx)
        return;
    ctx->log_fn = fn;
    ctx->log_user = user;
}

/* A warning: kept for dt_last_warning, and told as dt_set_log says. */
static void warn(dt_ctx *ctx, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void warn(dt_ctx *ctx, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ctx->warning, sizeof ctx->warning, fmt, ap);
    va_end(ap);
    if (ctx->log_fn)
        ctx->log_fn(ctx->log_user, ctx->warning);
    else if (getenv("DTRAIN_LOG") && *getenv("DTRAIN_LOG"))
        fprintf(stderr, "dtrain: warning: %s\n", ctx->warning);
}
dt_status dt_last_status(const dt_ctx *ctx) { return ctx ? ctx->last_status : DT_EINVAL; }
dt_status dt_ctx_status(const dt_ctx *ctx) { return ctx ? ctx->init_status : DT_EINVAL; }

void dt_clear_error(dt_ctx *ctx)
{
    if (!ctx)
        return;
    ctx->err[0] = '\0';
    ctx->last_status = DT_OK;
}

static void *libc_malloc(size_t n, void *u) { (void)u; return malloc(n); }
static void *libc_realloc(void *p, size_t n, void *u) { (void)u; return realloc(p, n); }
static void libc_free(void *p, void *u) { (void)u; free(p); }

static void *host_alloc(dt_ctx *ctx, size_t n) { return ctx->al.malloc_fn(n ? n : 1, ctx->al.user); }
static void host_free(dt_ctx *ctx, void *p) { if (p) ctx->al.free_fn(p, ctx->al.user); }

static void *host_calloc(dt_ctx *ctx, size_t n)
{
    void *p = host_alloc(ctx, n);
    if (p)
        memset(p, 0, n);
    return p;
}

static char *host_strdup(dt_ctx *ctx, const char *s)
{
    size_t n = strlen(s) + 1;
    char *p = host_alloc(ctx, n);
    if (p)
        memcpy(p, s, n);
    return p;
}

void dt_config_init(dt_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->backend = "cpu";
    cfg->threads = 1;
    cfg->seed = 0;
    cfg->arena_bytes = DT_DEFAULT_ARENA_BYTES;
}

/* The backends compiled into this build.  The list is const: choosing one is
 * a lookup, not a registration, so there is no global mutable state. */
static const dt_backend_iface *find_backend(const char *name)
{
#ifdef DT_WITH_CPU
    if (strcmp(name, "cpu") == 0)
        return dt_backend_cpu_iface();
    if (strcmp(name, "cpu-staged") == 0)
        return dt_backend_cpu_staged_iface();
#endif
#ifdef DT_WITH_CUDA
    if (strcmp(name, "cuda") == 0)
        return dt_backend_cuda_iface();
#endif
    (void)name;
    return NULL;
}

static const char *compiled_backends(void)
{
#if defined(DT_WITH_CPU) && defined(DT_WITH_CUDA)
    return "cpu, cuda";
#elif defined(DT_WITH_CPU)
    return "cpu";
#elif defined(DT_WITH_CUDA)
    return "cuda";
#else
    return "none: build with backends/cpu.c and -DDT_WITH_CPU";
#endif
}

static void arena_init(dt_arena *a, int on_device, size_t min_chunk)
{
    memset(a, 0, sizeof *a);
    a->on_device = on_device;
    a->min_chunk = min_chunk;
}
static void arena_destroy(dt_ctx *ctx, dt_arena *a);
static void free_doomed(dt_ctx *ctx);
void dt_seed(dt_ctx *ctx, uint64_t seed);

dt_ctx *dt_ctx_new(const dt_config *cfg_in)
{
    dt_config cfg;
    if (cfg_in)
        cfg = *cfg_in;
    else
        dt_config_init(&cfg);
    dt_allocator al = cfg.allocator;
    if (!al.malloc_fn || !al.free_fn || !al.realloc_fn) {
        /* all three hooks or none: mixing allocators would free foreign memory */
        if (!(al.malloc_fn && al.free_fn && al.realloc_fn)) {
            al.malloc_fn = libc_malloc;
            al.realloc_fn = libc_realloc;
            al.free_fn = libc_free;
            al.user = NULL;
        }
    }
    dt_ctx *ctx = al.malloc_fn(sizeof *ctx, al.user);
    if (!ctx)
        return NULL;
    memset(ctx, 0, sizeof *ctx);
    ctx->al = al;
    ctx->threads = cfg.threads > 0 ? cfg.threads : 1;
    ctx->grad_enabled = 1;
    ctx->training = 1;
    size_t arena_bytes = cfg.arena_bytes ? cfg.arena_bytes : DT_DEFAULT_ARENA_BYTES;
    arena_init(&ctx->dev, 1, arena_bytes);
    arena_init(&ctx->host, 0, (size_t)256 << 10);
    arena_init(&ctx->scratch_dev, 1, arena_bytes / 4 + DT_ARENA_ALIGN);
    arena_init(&ctx->scratch_host, 0, (size_t)64 << 10);
    ctx->cur_dev = &ctx->dev;
    ctx->cur_host = &ctx->host;
    dt_seed(ctx, cfg.seed);
    prof_init(ctx);

    /* DTRAIN_BACKEND runs an unchanged program on another backend (e.g. the
     * test suite on cpu-staged); a custom backend is never replaced */
    const char *env = getenv("DTRAIN_BACKEND");
    if (env && *env && !cfg.custom_backend)
        cfg.backend = env;
    const char *name = cfg.custom_backend && cfg.custom_backend->name ? cfg.custom_backend->name
                       : cfg.backend                                    ? cfg.backend
                                                                        : "cpu";
    ctx->be_iface = cfg.custom_backend ? cfg.custom_backend : find_backend(name);
    if (!ctx->be_iface) {
        ctx->init_status = set_error(ctx, DT_ENOTSUP,
                                     "ctx: backend '%s' is not compiled in (compiled in: %s)",
                                     name, compiled_backends());
        return ctx;
    }
    if (ctx->be_iface->version != DT_BACKEND_IFACE_VERSION) {
        ctx->init_status = set_error(ctx, DT_ENOTSUP,
                                     "ctx: backend '%s' has interface version %d, core expects %d",
                                     name, ctx->be_iface->version, DT_BACKEND_IFACE_VERSION);
        return ctx;
    }
    dt_backend_params bp = {ctx->threads, cfg.device, al};
    char msg[256] = "";
    dt_status s = ctx->be_iface->init(&bp, &ctx->be, msg, sizeof msg);
    if (s != DT_OK) {
        ctx->be = NULL;
        ctx->init_status = set_error(ctx, s, "ctx: backend '%s' failed to start: %s", name, msg);
    }
    return ctx;
}

void dt_ctx_free(dt_ctx *ctx)
{
    if (!ctx)
        return;
    if (ctx->ddp)
        ddp_detach(ctx->ddp);   /* gradients back into their own buffers */
    prof_release(ctx);
    ctx->tape = NULL;   /* nothing will read the tensors now */
    free_doomed(ctx);
    while (ctx->persist) {
        dt_tensor *t = ctx->persist;
        t->flags &= ~(unsigned)T_PARAM;   /* the context may free its own */
        dt_tensor_free(t);
    }
    host_free(ctx, ctx->params);
    arena_destroy(ctx, &ctx->dev);
    arena_destroy(ctx, &ctx->host);
    arena_destroy(ctx, &ctx->scratch_dev);
    arena_destroy(ctx, &ctx->scratch_host);
    if (ctx->be)
        ctx->be_iface->shutdown(ctx->be);
    dt_allocator al = ctx->al;
    al.free_fn(ctx, al.user);
}

/* Usable context: not NULL and its backend started. */
static int ctx_ok(dt_ctx *ctx)
{
    return ctx && ctx->init_status == DT_OK;
}

const char *dt_backend_name(const dt_ctx *ctx)
{
    return ctx && ctx->be_iface ? ctx->be_iface->name : "";
}
int dt_ctx_threads(const dt_ctx *ctx) { return ctx ? ctx->threads : 0; }
void dt_set_grad_enabled(dt_ctx *ctx, int e) { if (ctx) ctx->grad_enabled = e != 0; }
int dt_grad_enabled(const dt_ctx *ctx) { return ctx ? ctx->grad_enabled : 0; }
void dt_set_training(dt_ctx *ctx, int t) { if (ctx) ctx->training = t != 0; }
int dt_training(const dt_ctx *ctx) { return ctx ? ctx->training : 0; }

dt_status dt_set_autocast(dt_ctx *ctx, dt_precision p)
{
    if (!ctx_ok(ctx))   /* a failed context has no backend to ask */
        return DT_EINVAL;
    if (p < DT_PREC_F32 || p > DT_PREC_F16)
        return set_error(ctx, DT_EINVAL, "set_autocast: %d is not a dt_precision", (int)p);
    if (p != DT_PREC_F32 && !ctx->be_iface->gemm_ex && !ctx->be_iface->round_prec)
        return set_error(ctx, DT_ENOTSUP, "set_autocast: the %s backend has neither gemm_ex nor "
                         "round_prec", ctx->be_iface->name);
    ctx->autocast = p;
    return DT_OK;
}

dt_precision dt_autocast(const dt_ctx *ctx) { return ctx ? ctx->autocast : DT_PREC_F32; }

/* ===========================================================================
 * 3. Arenas
 *
 * Step tensors and tape nodes are bump-allocated from chunked arenas.  When
 * a step needs more than the arena holds, a new chunk is added (a heap
 * allocation); at dt_step_reset an arena with several chunks is replaced by
 * one chunk of the combined size.  After a step or two the arena fits the
 * whole step and training allocates nothing (tests/ checks this with a
 * counting allocator).
 * ======================================================================== */

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

static void arena_destroy(dt_ctx *ctx, dt_arena *a)
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
}

static size_t align_up(size_t n) { return (n + DT_ARENA_ALIGN - 1) & ~(size_t)(DT_ARENA_ALIGN - 1); }

static void *arena_alloc(dt_ctx *ctx, dt_arena *a, size_t n)
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
        dt_chunk *fresh = chunk_new(ctx, a, want);
        if (!fresh)
            return NULL;
        if (c)
            c->next = fresh;
        else
            a->first = fresh;
        a->cur = fresh;
    }
}

/* Forget everything; coalesce several chunks into one of the total size. */
static void arena_reset(dt_ctx *ctx, dt_arena *a)
{
    if (a->first && a->first->next) {
        size_t total = a->capacity;
        arena_destroy(ctx, a);
        a->first = a->cur = chunk_new(ctx, a, total);
        /* if that fails, the next alloc simply grows again */
    }
    if (a->first)
        a->first->used = 0;
    a->cur = a->first;
    a->used = 0;
}

static dt_arena_mark arena_mark(const dt_arena *a)
{
    dt_arena_mark m = {a->cur, a->cur ? a->cur->used : 0, a->used};
    return m;
}

static void arena_release(dt_arena *a, dt_arena_mark m)
{
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

void dt_step_reset(dt_ctx *ctx)
{
    if (!ctx)
        return;
    prof_step_end(ctx);
    ctx->tape = NULL;
    free_doomed(ctx);
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

void dt_mem_reset_peak(dt_ctx *ctx)
{
    if (!ctx)
        return;
    ctx->dev.peak = ctx->dev.used;
    ctx->scratch_dev.peak = ctx->scratch_dev.used;
}

/* ===========================================================================
 * 4. Tensors
 *
 * Shapes are row-major with element strides.  Views (reshape, transpose,
 * slice) share data and only change the header.  Kernels want contiguous
 * data, so ops pass non-contiguous inputs through dt_contiguous first.
 * Gradient buffers are always contiguous in the tensor's logical shape.
 * ======================================================================== */

size_t dt_dtype_size(dt_dtype t)
{
    switch (t) {
    case DT_F32: case DT_I32: return 4;
    case DT_U8: return 1;
    case DT_BF16: case DT_F16: return 2;
    }
    return 0;
}

const char *dt_dtype_name(dt_dtype t)
{
    switch (t) {
    case DT_F32: return "f32";
    case DT_I32: return "i32";
    case DT_U8: return "u8";
    case DT_BF16: return "bf16";
    case DT_F16: return "f16";
    }
    return "?";
}

static int64_t shape_numel(int ndim, const int64_t *shape)
{
    int64_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= shape[i];
    return n;
}

static void contiguous_strides(int ndim, const int64_t *shape, int64_t *stride)
{
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        stride[i] = s;
        s *= shape[i];
    }
}

/* "(2, 3, 4)" into buf, for error messages. */
static const char *shape_str(const dt_tensor *t, char *buf, size_t len)
{
    size_t o = 0;
    o += (size_t)snprintf(buf + o, len - o, "(");
    for (int i = 0; i < t->ndim && o < len; i++)
        o += (size_t)snprintf(buf + o, len - o, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    if (o < len)
        snprintf(buf + o, len - o, ")");
    return buf;
}

#define SHAPE(t, buf) shape_str((t), (buf), sizeof(buf))

static dt_status check_shape(dt_ctx *ctx, const char *op, int ndim, const int64_t *shape)
{
    if (ndim < 0 || ndim > DT_MAX_DIMS)
        return set_error(ctx, DT_EINVAL, "%s: %d dimensions (at most %d)", op, ndim, DT_MAX_DIMS);
    if (ndim > 0 && !shape)
        return set_error(ctx, DT_EINVAL, "%s: shape is NULL", op);
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return set_error(ctx, DT_EINVAL, "%s: dimension %d is negative (%lld)", op, i,
                             (long long)shape[i]);
        if (shape[i] > 0 && n > INT64_MAX / 8 / shape[i])
            return set_error(ctx, DT_EINVAL, "%s: shape too large", op);
        n *= shape[i];
    }
    return DT_OK;
}

static void header_init(dt_tensor *t, dt_ctx *ctx, dt_dtype dtype, int ndim, const int64_t *shape)
{
    memset(t, 0, sizeof *t);
    t->ctx = ctx;
    t->dtype = dtype;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++)
        t->shape[i] = shape[i];
    contiguous_strides(ndim, t->shape, t->stride);
}

static size_t tensor_bytes(const dt_tensor *t)
{
    return (size_t)shape_numel(t->ndim, t->shape) * dt_dtype_size(t->dtype);
}

/* A step tensor with uninitialised data, in the current arenas. */
static dt_tensor *step_tensor(dt_ctx *ctx, dt_dtype dtype, int ndim, const int64_t *shape)
{
    dt_tensor *t = arena_alloc(ctx, ctx->cur_host, sizeof *t);
    if (!t) {
        set_error(ctx, DT_ENOMEM, "out of host memory for a tensor header");
        return NULL;
    }
    header_init(t, ctx, dtype, ndim, shape);
    t->data = arena_alloc(ctx, ctx->cur_dev, tensor_bytes(t));
    if (!t->data) {
        set_error(ctx, DT_ENOMEM, "out of device memory: step tensor of %zu bytes",
                  tensor_bytes(t));
        return NULL;
    }
    return t;
}

/* A header sharing x's data (for views), in the step arena. */
static dt_tensor *view_header(dt_ctx *ctx, const dt_tensor *x)
{
    dt_tensor *t = arena_alloc(ctx, ctx->cur_host, sizeof *t);
    if (!t) {
        set_error(ctx, DT_ENOMEM, "out of host memory for a view header");
        return NULL;
    }
    header_init(t, ctx, x->dtype, x->ndim, x->shape);
    memcpy(t->stride, x->stride, sizeof t->stride);
    t->data = x->data;
    return t;
}

static dt_tensor *persistent_tensor(dt_ctx *ctx, dt_dtype dtype, int ndim, const int64_t *shape)
{
    dt_tensor *t = host_alloc(ctx, sizeof *t);
    if (!t) {
        set_error(ctx, DT_ENOMEM, "tensor_new: out of host memory");
        return NULL;
    }
    header_init(t, ctx, dtype, ndim, shape);
    size_t bytes = tensor_bytes(t);
    t->data = ctx->be_iface->alloc(ctx->be, bytes ? bytes : DT_ARENA_ALIGN);
    if (!t->data) {
        host_free(ctx, t);
        set_error(ctx, DT_ENOMEM, "tensor_new: out of device memory (%zu bytes)", bytes);
        return NULL;
    }
    ctx->be_iface->memset0(ctx->be, t->data, bytes);
    t->flags = T_PERSIST | T_OWNS_DATA;
    t->next = ctx->persist;
    if (ctx->persist)
        ctx->persist->prev = t;
    ctx->persist = t;
    ctx->persistent_bytes += bytes;
    return t;
}

static int dtype_ok(dt_dtype d) { return d >= DT_F32 && d <= DT_F16; }

/* The checks every tensor constructor makes; 1: go on. */
static int new_tensor_ok(dt_ctx *ctx, const char *op, dt_dtype dtype, int ndim,
                         const int64_t *shape)
{
    if (!ctx_ok(ctx))
        return 0;
    if (!dtype_ok(dtype)) {
        set_error(ctx, DT_EINVAL, "%s: unknown dtype %d", op, (int)dtype);
        return 0;
    }
    return check_shape(ctx, op, ndim, shape) == DT_OK;
}

dt_tensor *dt_tensor_new(dt_ctx *ctx, dt_dtype dtype, int ndim, const int64_t *shape)
{
    if (!new_tensor_ok(ctx, "tensor_new", dtype, ndim, shape))
        return NULL;
    return persistent_tensor(ctx, dtype, ndim, shape);
}

dt_tensor *dt_tensor_temp(dt_ctx *ctx, dt_dtype dtype, int ndim, const int64_t *shape)
{
    if (!new_tensor_ok(ctx, "tensor_temp", dtype, ndim, shape))
        return NULL;
    dt_tensor *t = step_tensor(ctx, dtype, ndim, shape);
    if (t)
        ctx->be_iface->memset0(ctx->be, t->data, tensor_bytes(t));
    return t;
}

static void row_log_free(dt_ctx *ctx, row_log *l)
{
    if (!l)
        return;
    host_free(ctx, l->rows);
    host_free(ctx, l->mark);
    host_free(ctx, l);
}

static void tensor_destroy(dt_ctx *ctx, dt_tensor *t)
{
    row_log_free(ctx, t->rowlog);
    if (t->flags & T_OWNS_DATA) {
        ctx->persistent_bytes -= tensor_bytes(t);
        ctx->be_iface->free(ctx->be, t->data);
    }
    host_free(ctx, t->name);
    host_free(ctx, t);
}

/* A persistent gradient buffer for t: not on the persistent list, freed with
 * t, logically zero until first written. */
static dt_status attach_persistent_grad(dt_ctx *ctx, dt_tensor *t)
{
    if (t->grad)
        return DT_OK;
    dt_tensor *g = host_alloc(ctx, sizeof *g);
    if (!g)
        return set_error(ctx, DT_ENOMEM, "out of host memory for a gradient");
    header_init(g, ctx, DT_F32, t->ndim, t->shape);
    size_t bytes = tensor_bytes(g);
    g->data = ctx->be_iface->alloc(ctx->be, bytes ? bytes : DT_ARENA_ALIGN);
    if (!g->data) {
        host_free(ctx, g);
        return set_error(ctx, DT_ENOMEM, "out of device memory for a gradient (%zu bytes)", bytes);
    }
    ctx->be_iface->memset0(ctx->be, g->data, bytes);
    g->flags = T_OWNS_DATA | T_GRADBUF | T_ZERO;
    ctx->persistent_bytes += bytes;
    t->grad = g;
    return DT_OK;
}

static void persistent_destroy(dt_ctx *ctx, dt_tensor *t)
{
    if (t->grad && (t->grad->flags & T_GRADBUF))
        tensor_destroy(ctx, t->grad);
    tensor_destroy(ctx, t);
}

void dt_tensor_free(dt_tensor *t)
{
    if (!t || !(t->flags & T_PERSIST) || (t->flags & (T_PARAM | T_EXTERNAL)))
        return;   /* step tensors die at dt_step_reset; params with the ctx */
    dt_ctx *ctx = t->ctx;
    if (t->prev)
        t->prev->next = t->next;
    else
        ctx->persist = t->next;
    if (t->next)
        t->next->prev = t->prev;
    if (ctx->tape) {   /* a recorded op may read it in backward: keep it to the step's end */
        t->prev = NULL;
        t->next = ctx->doomed;
        ctx->doomed = t;
        return;
    }
    persistent_destroy(ctx, t);
}

static void free_doomed(dt_ctx *ctx)
{
    while (ctx->doomed) {
        dt_tensor *t = ctx->doomed;
        ctx->doomed = t->next;
        persistent_destroy(ctx, t);
    }
}

int dt_tensor_is_contiguous(const dt_tensor *t)
{
    if (!t)
        return 0;
    int64_t s = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->stride[i] != s)
            return 0;
        s *= t->shape[i];
    }
    return 1;
}

/* Write zeros into a tensor whose contents are only logically zero. */
static void materialize(dt_tensor *t)
{
    if (t && (t->flags & T_ZERO)) {
        t->ctx->be_iface->memset0(t->ctx->be, t->data, tensor_bytes(t));
        t->flags &= ~(unsigned)T_ZERO;
    }
}

/* A persistent tensor over the caller's memory (no T_OWNS_DATA: freeing
 * it leaves the memory alone).  Only where the backend computes on host
 * memory: a device backend would read a host pointer as its own. */
dt_tensor *dt_tensor_wrap(dt_ctx *ctx, dt_dtype dtype, int ndim, const int64_t *shape,
                          void *host)
{
    if (!new_tensor_ok(ctx, "tensor_wrap", dtype, ndim, shape))
        return NULL;
    if (!host || (uintptr_t)host % dt_dtype_size(dtype)) {
        set_error(ctx, DT_EINVAL, "tensor_wrap: host memory is %s", host ? "misaligned for its "
                  "dtype" : "NULL");
        return NULL;
    }
    if (!ctx->be_iface->host_visible) {
        set_error(ctx, DT_ENOTSUP, "tensor_wrap: the %s backend does not compute on host memory "
                  "(copy in with dt_tensor_set)", dt_backend_name(ctx));
        return NULL;
    }
    dt_tensor *t = host_alloc(ctx, sizeof *t);
    if (!t) {
        set_error(ctx, DT_ENOMEM, "tensor_wrap: out of host memory");
        return NULL;
    }
    header_init(t, ctx, dtype, ndim, shape);
    t->data = host;
    t->flags = T_PERSIST;
    t->next = ctx->persist;
    if (ctx->persist)
        ctx->persist->prev = t;
    ctx->persist = t;
    return t;
}

void *dt_tensor_data(dt_tensor *t)
{
    if (!t)
        return NULL;
    dt_ctx *ctx = t->ctx;
    if (!ctx->be_iface->host_visible) {
        set_error(ctx, DT_ENOTSUP, "tensor_data: the %s backend's memory is not host memory "
                  "(copy out with dt_tensor_get)", dt_backend_name(ctx));
        return NULL;
    }
    materialize(t);   /* a lazily zeroed gradient: the memory must say so */
    return t->data;
}

int64_t dt_tensor_stride(const dt_tensor *t, int i)
{
    if (!t)
        return 0;
    if (i < 0)
        i += t->ndim;
    return i >= 0 && i < t->ndim ? t->stride[i] : 0;
}

static dt_status check_tensor(dt_ctx *ctx, const char *op, const dt_tensor *t, const char *what)
{
    if (!t)
        return set_error(ctx, DT_EINVAL, "%s: %s is NULL", op, what);
    if (t->ctx != ctx)
        return set_error(ctx, DT_EINVAL, "%s: %s belongs to another context", op, what);
    return DT_OK;
}

/* Host <-> tensor copies handle strided views through a contiguous temp. */
dt_status dt_tensor_set(dt_tensor *t, const void *host, int64_t count)
{
    if (!t)
        return DT_EINVAL;
    dt_ctx *ctx = t->ctx;
    if (!host)
        return set_error(ctx, DT_EINVAL, "tensor_set: host buffer is NULL");
    int64_t n = shape_numel(t->ndim, t->shape);
    if (count != n)
        return set_error(ctx, DT_EINVAL, "tensor_set: %lld values given, tensor has %lld",
                         (long long)count, (long long)n);
    const dt_backend_iface *be = ctx->be_iface;
    size_t bytes = (size_t)n * dt_dtype_size(t->dtype);
    t->flags &= ~(unsigned)T_ZERO;
    if (dt_tensor_is_contiguous(t)) {
        be->to_device(ctx->be, t->data, host, bytes);
        return DT_OK;
    }
    dt_arena_mark m = arena_mark(ctx->cur_dev);
    void *tmp = arena_alloc(ctx, ctx->cur_dev, bytes);
    if (!tmp)
        return set_error(ctx, DT_ENOMEM, "tensor_set: out of memory");
    int64_t cs[DT_MAX_DIMS];
    contiguous_strides(t->ndim, t->shape, cs);
    be->to_device(ctx->be, tmp, host, bytes);
    be->copy_strided(ctx->be, t->ndim, t->shape, dt_dtype_size(t->dtype), t->data, t->stride, tmp,
                     cs, 0);
    arena_release(ctx->cur_dev, m);
    return DT_OK;
}

dt_status dt_tensor_get(const dt_tensor *tc, void *host, int64_t count)
{
    if (!tc)
        return DT_EINVAL;
    dt_tensor *t = (dt_tensor *)tc;
    dt_ctx *ctx = t->ctx;
    if (!host)
        return set_error(ctx, DT_EINVAL, "tensor_get: host buffer is NULL");
    int64_t n = shape_numel(t->ndim, t->shape);
    if (count != n)
        return set_error(ctx, DT_EINVAL, "tensor_get: room for %lld values, tensor has %lld",
                         (long long)count, (long long)n);
    materialize(t);
    const dt_backend_iface *be = ctx->be_iface;
    size_t bytes = (size_t)n * dt_dtype_size(t->dtype);
    if (dt_tensor_is_contiguous(t)) {
        be->to_host(ctx->be, host, t->data, bytes);
        return be_fault(ctx, "tensor_get");
    }
    dt_arena_mark m = arena_mark(ctx->cur_dev);
    void *tmp = arena_alloc(ctx, ctx->cur_dev, bytes);
    if (!tmp)
        return set_error(ctx, DT_ENOMEM, "tensor_get: out of memory");
    int64_t cs[DT_MAX_DIMS];
    contiguous_strides(t->ndim, t->shape, cs);
    be->copy_strided(ctx->be, t->ndim, t->shape, dt_dtype_size(t->dtype), tmp, cs, t->data,
                     t->stride, 0);
    be->to_host(ctx->be, host, tmp, bytes);
    arena_release(ctx->cur_dev, m);
    return be_fault(ctx, "tensor_get");
}

dt_status dt_tensor_fill(dt_tensor *t, float value)
{
    if (!t)
        return DT_EINVAL;
    dt_ctx *ctx = t->ctx;
    if (t->dtype != DT_F32)
        return set_error(ctx, DT_EINVAL, "tensor_fill: tensor is %s, fill needs f32",
                         dt_dtype_name(t->dtype));
    if (!dt_tensor_is_contiguous(t))
        return set_error(ctx, DT_EINVAL, "tensor_fill: tensor is a non-contiguous view");
    t->flags &= ~(unsigned)T_ZERO;
    ctx->be_iface->fill(ctx->be, shape_numel(t->ndim, t->shape), value, t->data);
    return DT_OK;
}

float dt_tensor_item(const dt_tensor *t)
{
    if (!t || shape_numel(t->ndim, t->shape) < 1)
        return NAN;
    materialize((dt_tensor *)t);
    if (t->dtype == DT_F32) {
        float v;
        t->ctx->be_iface->to_host(t->ctx->be, &v, t->data, sizeof v);
        return be_fault(t->ctx, "tensor_item") == DT_OK ? v : NAN;
    }
    if (t->dtype == DT_I32) {
        int32_t v;
        t->ctx->be_iface->to_host(t->ctx->be, &v, t->data, sizeof v);
        return be_fault(t->ctx, "tensor_item") == DT_OK ? (float)v : NAN;
    }
    return NAN;
}

int dt_tensor_ndim(const dt_tensor *t) { return t ? t->ndim : -1; }

int64_t dt_tensor_dim(const dt_tensor *t, int i)
{
    if (!t)
        return -1;
    if (i < 0)
        i += t->ndim;
    return (i >= 0 && i < t->ndim) ? t->shape[i] : -1;
}

int64_t dt_tensor_numel(const dt_tensor *t) { return t ? shape_numel(t->ndim, t->shape) : -1; }
dt_dtype dt_tensor_dtype(const dt_tensor *t) { return t ? t->dtype : DT_F32; }
const char *dt_tensor_name(const dt_tensor *t) { return t && t->name ? t->name : ""; }

dt_status dt_tensor_set_name(dt_tensor *t, const char *name)
{
    if (!t)
        return DT_EINVAL;
    dt_ctx *ctx = t->ctx;
    if (!name || strlen(name) >= DT_MAX_NAME)
        return set_error(ctx, DT_EINVAL, "tensor_set_name: name is NULL or longer than %d",
                         DT_MAX_NAME - 1);
    if (!(t->flags & T_PERSIST))
        return set_error(ctx, DT_EINVAL, "tensor_set_name: only persistent tensors have names");
    if ((t->flags & T_PARAM) && dt_param_find(ctx, name) && dt_param_find(ctx, name) != t)
        return set_error(ctx, DT_EINVAL, "tensor_set_name: a parameter named '%s' exists", name);
    char *copy = host_strdup(ctx, name);
    if (!copy)
        return set_error(ctx, DT_ENOMEM, "tensor_set_name: out of memory");
    host_free(ctx, t->name);
    t->name = copy;
    return DT_OK;
}

dt_tensor *dt_tensor_grad(const dt_tensor *t)
{
    if (!t || !t->grad)
        return NULL;
    materialize(t->grad);
    return t->grad;
}

int dt_tensor_requires_grad(const dt_tensor *t) { return t && (t->flags & T_REQGRAD) ? 1 : 0; }

dt_status dt_tensor_set_requires_grad(dt_tensor *t, int requires)
{
    if (!t)
        return DT_EINVAL;
    if (requires && t->dtype != DT_F32)
        return set_error(t->ctx, DT_EINVAL, "set_requires_grad: only f32 tensors have gradients");
    if (requires && t->node == NULL && !(t->flags & T_PERSIST))
        return set_error(t->ctx, DT_EINVAL,
                         "set_requires_grad: only leaves made by dt_tensor_new can require grad");
    if (requires && (t->flags & T_PERSIST) && attach_persistent_grad(t->ctx, t) != DT_OK)
        return t->ctx->last_status;
    if (requires)
        t->flags |= T_REQGRAD;
    else
        t->flags &= ~(unsigned)T_REQGRAD;
    return DT_OK;
}

/* ===========================================================================
 * 5. Parameters, random numbers and initialisation
 *
 * Parameters are persistent tensors with a name and a persistent gradient,
 * kept in registration order.  Random numbers come from the context's
 * xoshiro256** generator (seeded through splitmix64), drawn on the host so
 * every backend initialises identically.
 * ======================================================================== */

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint64_t rotl64(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t xoshiro_next(uint64_t s[4])
{
    uint64_t r = rotl64(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl64(s[3], 45);
    return r;
}

static void xoshiro_seed(uint64_t s[4], uint64_t seed)
{
    uint64_t sm = seed;
    for (int i = 0; i < 4; i++)
        s[i] = splitmix64(&sm);
}

/* uniform in [0, 1) with 24 random bits (exact in float) */
static float rng_uniform(uint64_t s[4]) { return (float)(xoshiro_next(s) >> 40) * 0x1.0p-24f; }

void dt_seed(dt_ctx *ctx, uint64_t seed)
{
    if (!ctx)
        return;
    ctx->seed = seed;
    xoshiro_seed(ctx->rng, seed);
    ctx->dropout_counter = 0;
}

dt_tensor *dt_param_new(dt_ctx *ctx, const char *name, int ndim, const int64_t *shape)
{
    if (!ctx_ok(ctx))
        return NULL;
    if (!name || !name[0] || strlen(name) >= DT_MAX_NAME) {
        set_error(ctx, DT_EINVAL, "param_new: name must be 1..%d characters", DT_MAX_NAME - 1);
        return NULL;
    }
    if (dt_param_find(ctx, name)) {
        set_error(ctx, DT_EINVAL, "param_new: a parameter named '%s' already exists", name);
        return NULL;
    }
    if (check_shape(ctx, "param_new", ndim, shape) != DT_OK)
        return NULL;
    if (ctx->n_params == ctx->cap_params) {
        int cap = ctx->cap_params ? ctx->cap_params * 2 : 16;
        dt_tensor **p = ctx->al.realloc_fn(ctx->params, (size_t)cap * sizeof *p, ctx->al.user);
        if (!p) {
            set_error(ctx, DT_ENOMEM, "param_new: out of memory");
            return NULL;
        }
        ctx->params = p;
        ctx->cap_params = cap;
    }
    dt_tensor *t = persistent_tensor(ctx, DT_F32, ndim, shape);
    if (!t)
        return NULL;
    t->name = host_strdup(ctx, name);
    if (!t->name || attach_persistent_grad(ctx, t) != DT_OK) {
        dt_tensor_free(t);
        set_error(ctx, DT_ENOMEM, "param_new: out of memory for '%s'", name);
        return NULL;
    }
    t->flags |= T_PARAM | T_REQGRAD;
    t->param_index = ctx->n_params;
    ctx->params[ctx->n_params++] = t;
    return t;
}

int dt_param_count(const dt_ctx *ctx) { return ctx ? ctx->n_params : 0; }

dt_tensor *dt_param_at(const dt_ctx *ctx, int i)
{
    return ctx && i >= 0 && i < ctx->n_params ? ctx->params[i] : NULL;
}

dt_tensor *dt_param_find(const dt_ctx *ctx, const char *name)
{
    if (!ctx || !name)
        return NULL;
    for (int i = 0; i < ctx->n_params; i++)
        if (strcmp(ctx->params[i]->name, name) == 0)
            return ctx->params[i];
    return NULL;
}

void dt_zero_grad(dt_ctx *ctx)
{
    if (!ctx)
        return;
    for (int i = 0; i < ctx->n_params; i++)
        if (ctx->params[i]->grad)
            ctx->params[i]->grad->flags |= T_ZERO;   /* written lazily */
    ctx->zero_gen++;
}

/* Fill t from a host generator, one value per element in index order. */
typedef float (*sample_fn)(uint64_t s[4], float a, float b);

static float sample_uniform(uint64_t s[4], float lo, float hi)
{
    return lo + (hi - lo) * rng_uniform(s);
}

static float sample_normal(uint64_t s[4], float mean, float std)
{
    /* Box-Muller; u1 in (0, 1] so log is finite */
    float u1 = 1.0f - rng_uniform(s), u2 = rng_uniform(s);
    return mean + std * sqrtf(-2.0f * logf(u1)) * cosf(6.28318530717958647692f * u2);
}

static dt_status init_fill(dt_ctx *ctx, dt_tensor *t, const char *op, sample_fn f, float a, float b)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (check_tensor(ctx, op, t, "tensor") != DT_OK)
        return DT_EINVAL;
    if (t->dtype != DT_F32)
        return set_error(ctx, DT_EINVAL, "%s: tensor is %s, needs f32", op, dt_dtype_name(t->dtype));
    int64_t n = shape_numel(t->ndim, t->shape);
    float *host = host_alloc(ctx, (size_t)n * sizeof(float));
    if (!host)
        return set_error(ctx, DT_ENOMEM, "%s: out of memory", op);
    for (int64_t i = 0; i < n; i++)
        host[i] = f(ctx->rng, a, b);
    dt_status s = dt_tensor_set(t, host, n);
    host_free(ctx, host);
    return s;
}

dt_status dt_init_uniform(dt_ctx *ctx, dt_tensor *t, float lo, float hi)
{
    return init_fill(ctx, t, "init_uniform", sample_uniform, lo, hi);
}

dt_status dt_init_normal(dt_ctx *ctx, dt_tensor *t, float mean, float std)
{
    return init_fill(ctx, t, "init_normal", sample_normal, mean, std);
}

/* fan_in = shape[1] * receptive field, fan_out = shape[0] * receptive field */
static dt_status fans(dt_ctx *ctx, const char *op, const dt_tensor *t, double *fin, double *fout)
{
    if (!t)
        return set_error(ctx, DT_EINVAL, "%s: tensor is NULL", op);
    if (t->ndim < 2)
        return set_error(ctx, DT_EINVAL, "%s: needs at least 2 dimensions, tensor has %d", op,
                         t->ndim);
    double rf = 1;
    for (int i = 2; i < t->ndim; i++)
        rf *= (double)t->shape[i];
    *fin = (double)t->shape[1] * rf;
    *fout = (double)t->shape[0] * rf;
    if (*fin <= 0 || *fout <= 0)
        return set_error(ctx, DT_EINVAL, "%s: tensor has a zero dimension", op);
    return DT_OK;
}

dt_status dt_init_kaiming_uniform(dt_ctx *ctx, dt_tensor *t, float a)
{
    double fin = 0, fout = 0;
    if (!ctx_ok(ctx) || fans(ctx, "init_kaiming_uniform", t, &fin, &fout) != DT_OK)
        return DT_EINVAL;
    double bound = sqrt(3.0) * sqrt(2.0 / (1.0 + (double)a * a)) / sqrt(fin);
    return init_fill(ctx, t, "init_kaiming_uniform", sample_uniform, (float)-bound, (float)bound);
}

dt_status dt_init_kaiming_normal(dt_ctx *ctx, dt_tensor *t, float a)
{
    double fin = 0, fout = 0;
    if (!ctx_ok(ctx) || fans(ctx, "init_kaiming_normal", t, &fin, &fout) != DT_OK)
        return DT_EINVAL;
    double std = sqrt(2.0 / (1.0 + (double)a * a)) / sqrt(fin);
    return init_fill(ctx, t, "init_kaiming_normal", sample_normal, 0.0f, (float)std);
}

dt_status dt_init_xavier_uniform(dt_ctx *ctx, dt_tensor *t, float gain)
{
    double fin = 0, fout = 0;
    if (!ctx_ok(ctx) || fans(ctx, "init_xavier_uniform", t, &fin, &fout) != DT_OK)
        return DT_EINVAL;
    double bound = gain * sqrt(6.0 / (fin + fout));
    return init_fill(ctx, t, "init_xavier_uniform", sample_uniform, (float)-bound, (float)bound);
}

dt_status dt_init_xavier_normal(dt_ctx *ctx, dt_tensor *t, float gain)
{
    double fin = 0, fout = 0;
    if (!ctx_ok(ctx) || fans(ctx, "init_xavier_normal", t, &fin, &fout) != DT_OK)
        return DT_EINVAL;
    double std = gain * sqrt(2.0 / (fin + fout));
    return init_fill(ctx, t, "init_xavier_normal", sample_normal, 0.0f, (float)std);
}

dt_status dt_init_bias(dt_ctx *ctx, dt_tensor *bias, int64_t fan_in)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (fan_in <= 0)
        return set_error(ctx, DT_EINVAL, "init_bias: fan_in must be positive, got %lld",
                         (long long)fan_in);
    float bound = (float)(1.0 / sqrt((double)fan_in));
    return init_fill(ctx, bias, "init_bias", sample_uniform, -bound, bound);
}

/* ===========================================================================
 * 6. The autograd tape and backward
 *
 * Define-by-run: each op that has an input requiring grad appends a node to
 * the tape.  Creation order is a topological order, so backward walks the
 * tape newest-first and runs each node whose output received a gradient.
 * Gradient buffers are written on first touch (acc = 0) and added to after
 * (acc = 1), so nothing needs zeroing up front.
 * ======================================================================== */

#define BE(ctx) ((ctx)->be_iface)
#define BEI(ctx) ((ctx)->be)
#define FP(t) ((float *)(t)->data)
#define IP(t) ((int32_t *)(t)->data)

/* The backend can stage asynchronously (all three entries, or none used). */
static int be_stages(const dt_backend_iface *b)
{
    return b->copy_async && b->copy_wait && b->copy_join;
}

/* Tensor memory to and from host memory: a plain copy where they are the
 * same memory, the backend's transfer where not. */
static void be_to_host(dt_ctx *ctx, void *host, const void *src, size_t bytes)
{
    if (BE(ctx)->host_visible)
        BE(ctx)->copy(BEI(ctx), host, src, bytes);
    else
        BE(ctx)->to_host(BEI(ctx), host, src, bytes);
}

static void be_to_device(dt_ctx *ctx, void *dst, const void *host, size_t bytes)
{
    if (BE(ctx)->host_visible)
        BE(ctx)->copy(BEI(ctx), dst, host, bytes);
    else
        BE(ctx)->to_device(BEI(ctx), dst, host, bytes);
}

/* A failure underneath the backend (backend.h, fault: a refused launch, a
 * cuBLAS error, a lost device) as this context's error, "what: message";
 * DT_OK when there is none.  Polled wherever results reach the user (a
 * tensor read, a loss, a count, the end of backward and of a step), so a
 * dead GPU is an error there, never a silent zero. */
static dt_status be_fault(dt_ctx *ctx, const char *what)
{
    if (!BE(ctx)->fault)
        return DT_OK;
    char msg[200] = "";
    dt_status s = BE(ctx)->fault(BEI(ctx), msg, sizeof msg);
    if (s == DT_OK)
        return DT_OK;
    return set_error(ctx, s, "%s: device failure: %s", what, msg[0] ? msg : "no message");
}

static int tracks(const dt_ctx *ctx, const dt_tensor *t)
{
    return ctx->grad_enabled && t && (t->flags & T_REQGRAD);
}

static dt_node *record(dt_ctx *ctx, const char *op, dt_backward_fn bw, dt_tensor *out,
                       dt_tensor *a, dt_tensor *b, dt_tensor *c)
{
    dt_node *n = arena_alloc(ctx, ctx->cur_host, sizeof *n);
    if (!n) {
        set_error(ctx, DT_ENOMEM, "%s: out of host memory for the tape", op);
        return NULL;
    }
    memset(n, 0, sizeof *n);
    n->op = op;
    n->backward = bw;
    n->prec = ctx->autocast;
    n->out = out;
    dt_tensor *ins[3] = {a, b, c};
    for (int i = 0; i < 3; i++)
        if (ins[i])
            n->in[n->n_in++] = ins[i];
    n->prev = ctx->tape;
    ctx->tape = n;
    out->node = n;
    out->flags |= T_REQGRAD;
    return n;
}

/* The gradient buffer of t for a backward to write; *acc says whether it
 * already holds values to add to. */
static float *grad_target(dt_ctx *ctx, dt_tensor *t, int *acc)
{
    if (t->rowlog)   /* this op may write every row */
        t->rowlog->dense = 1;
    if (!t->grad) {
        t->grad = step_tensor(ctx, DT_F32, t->ndim, t->shape);
        if (!t->grad)
            return NULL;
        t->grad->flags |= T_ZERO;
    }
    *acc = !(t->grad->flags & T_ZERO);
    t->grad->flags &= ~(unsigned)T_ZERO;
    return FP(t->grad);
}

/* Same, for kernels that can only add: the buffer is zeroed first if new. */
static float *grad_target_zeroed(dt_ctx *ctx, dt_tensor *t)
{
    int acc;
    float *g = grad_target(ctx, t, &acc);
    if (g && !acc)
        BE(ctx)->memset0(BEI(ctx), g, tensor_bytes(t->grad));
    return g;
}

static int needs_grad(const dt_tensor *t) { return t && (t->flags & T_REQGRAD); }

/* ddp (the top-level walk only) hears of every node once it is done, so
 * it can start a bucket's allreduce when its gradients are final. */
static dt_status run_tape(dt_ctx *ctx, dt_node *tail, dt_node *stop, struct dt_ddp *ddp)
{
    for (dt_node *n = tail; n && n != stop; n = n->prev) {
        dt_tensor *g = n->out->grad;
        if (g && !(g->flags & T_ZERO)) {   /* else no gradient reached this op */
            dt_status s = n->backward(ctx, n);
            if (s != DT_OK)
                return s;
        }
        if (ddp)
            ddp_node_done(ddp, n);
    }
    return DT_OK;
}

static dt_status backward_seeded(dt_ctx *ctx, dt_tensor *loss, float seed);

dt_status dt_backward(dt_ctx *ctx, dt_tensor *loss) { return backward_seeded(ctx, loss, 1.0f); }

static dt_status backward_run(dt_ctx *ctx, dt_tensor *loss, float seed);
static dt_status backward_tape(dt_ctx *ctx, dt_tensor *out, const float *seed_grad, float seed);

/* Backward from loss with d(loss) = seed (1, or a loss scale). */
static dt_status backward_seeded(dt_ctx *ctx, dt_tensor *loss, float seed)
{
    double t0 = ctx && ctx_ok(ctx) ? prof_begin(ctx) : 0;
    dt_status s = backward_run(ctx, loss, seed);
    if (s == DT_OK && ctx)
        s = be_fault(ctx, "backward");
    if (t0 != 0)
        prof_end(ctx, PH_BACKWARD, t0);
    return s;
}

static dt_status backward_run(dt_ctx *ctx, dt_tensor *loss, float seed)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (!loss)
        return set_error(ctx, DT_EINVAL, "backward: loss is NULL");
    if (loss->ctx != ctx)
        return set_error(ctx, DT_EINVAL, "backward: loss belongs to another context");
    if (shape_numel(loss->ndim, loss->shape) != 1 || loss->dtype != DT_F32) {
        char sb[96];
        return set_error(ctx, DT_EINVAL, "backward: loss must be one f32 value, got %s %s",
                         dt_dtype_name(loss->dtype), SHAPE(loss, sb));
    }
    if (!(loss->flags & T_REQGRAD))
        return set_error(ctx, DT_EINVAL, "backward: loss does not require grad "
                                         "(no parameter reached it, or grad was disabled)");
    if (!loss->node && !(loss->flags & T_PERSIST))
        return set_error(ctx, DT_ESTATE, "backward: this loss's graph was already used by "
                                         "dt_backward; run the forward again");
    return backward_tape(ctx, loss, NULL, seed);
}

/* Run ctx->tape backward from out, whose gradient is seed_grad (device
 * memory, out's shape, contiguous) or else the constant seed, and consume
 * the tape.  A pipeline (22) calls it with one micro-batch's tape. */
static dt_status backward_tape(dt_ctx *ctx, dt_tensor *out, const float *seed_grad, float seed)
{
    if (ctx->ddp) {
        dt_status s = ddp_backward_begin(ctx->ddp);
        if (s != DT_OK)
            return s;
    }
    int acc;
    float *g = grad_target(ctx, out, &acc);
    if (!g)
        return ctx->ddp ? ddp_backward_end(ctx->ddp, ctx->last_status) : ctx->last_status;
    int64_t n = shape_numel(out->ndim, out->shape);
    if (seed_grad) {
        BE(ctx)->axpby(BEI(ctx), n, 1.0f, seed_grad, acc ? 1.0f : 0.0f, g);
    } else if (acc) {
        float one = 1.0f;
        float *tmp = arena_alloc(ctx, ctx->cur_dev, sizeof one);
        if (!tmp) {
            set_error(ctx, DT_ENOMEM, "backward: out of memory");
            return ctx->ddp ? ddp_backward_end(ctx->ddp, DT_ENOMEM) : DT_ENOMEM;
        }
        BE(ctx)->to_device(BEI(ctx), tmp, &one, sizeof one);
        BE(ctx)->axpby(BEI(ctx), 1, seed, tmp, 1.0f, g);
    } else {
        BE(ctx)->fill(BEI(ctx), 1, seed, g);
    }
    dt_status s = run_tape(ctx, ctx->tape, NULL, ctx->ddp);
    /* The tape is consumed: its outputs become plain tensors, so a second
     * backward through the same graph is refused instead of double-counting. */
    for (dt_node *n = ctx->tape; n; n = n->prev)
        n->out->node = NULL;
    ctx->tape = NULL;
    return ctx->ddp ? ddp_backward_end(ctx->ddp, s) : s;
}

/* ===========================================================================
 * 7. Ops
 *
 * Each op validates its inputs (naming itself in the message), computes the
 * output through the backend, and records a node whose backward sits right
 * below it.  Shapes are in the comment at each op.
 * ======================================================================== */

/* Reports a NULL input unless an earlier op already failed (then its message
 * is the useful one). */
static int input_ok(dt_ctx *ctx, const char *op, const dt_tensor *x, const char *what)
{
    if (!ctx_ok(ctx))
        return 0;
    if (!x) {
        if (ctx->last_status == DT_OK)
            set_error(ctx, DT_EINVAL, "%s: %s is NULL", op, what);
        return 0;
    }
    if (x->ctx != ctx) {
        set_error(ctx, DT_EINVAL, "%s: %s belongs to another context", op, what);
        return 0;
    }
    return 1;
}

static int f32_ok(dt_ctx *ctx, const char *op, const dt_tensor *x, const char *what)
{
    if (!input_ok(ctx, op, x, what))
        return 0;
    if (x->dtype != DT_F32) {
        set_error(ctx, x->dtype == DT_BF16 || x->dtype == DT_F16 ? DT_ENOTSUP : DT_EINVAL,
                  "%s: %s is %s, this op computes in f32", op, what, dt_dtype_name(x->dtype));
        return 0;
    }
    return 1;
}

static int norm_dim(dt_ctx *ctx, const char *op, const dt_tensor *x, int *dim)
{
    int d = *dim < 0 ? *dim + x->ndim : *dim;
    if (d < 0 || d >= x->ndim) {
        set_error(ctx, DT_EINVAL, "%s: dim %d out of range for %d dimensions", op, *dim, x->ndim);
        return 0;
    }
    *dim = d;
    return 1;
}

static dt_tensor *like(dt_ctx *ctx, const dt_tensor *x)
{
    return step_tensor(ctx, x->dtype, x->ndim, x->shape);
}

static float *temp_floats(dt_ctx *ctx, int64_t n)
{
    float *p = arena_alloc(ctx, ctx->cur_dev, (size_t)n * sizeof(float));
    if (!p)
        set_error(ctx, DT_ENOMEM, "out of device memory for a %lld-float temporary", (long long)n);
    return p;
}

/* gx (+)= src, both contiguous over x's shape. */
static dt_status acc_grad(dt_ctx *ctx, dt_tensor *x, const float *src, float alpha)
{
    int acc;
    float *gx = grad_target(ctx, x, &acc);
    if (!gx)
        return ctx->last_status;
    BE(ctx)->axpby(BEI(ctx), shape_numel(x->ndim, x->shape), alpha, src, acc ? 1.0f : 0.0f, gx);
    return DT_OK;
}

/* --- 7.1 views: reshape, transpose, slice, contiguous, concat ----------- */

static dt_status contiguous_backward(dt_ctx *ctx, dt_node *n)
{
    return acc_grad(ctx, n->in[0], FP(n->out->grad), 1.0f);
}

/* x any strides -> y contiguous copy */
dt_tensor *dt_contiguous(dt_ctx *ctx, dt_tensor *x)
{
    if (!input_ok(ctx, "contiguous", x, "input"))
        return NULL;
    if (dt_tensor_is_contiguous(x))
        return x;
    dt_tensor *y = like(ctx, x);
    if (!y)
        return NULL;
    materialize(x);
    BE(ctx)->copy_strided(BEI(ctx), x->ndim, x->shape, dt_dtype_size(x->dtype), y->data, y->stride,
                          x->data, x->stride, 0);
    if (tracks(ctx, x) && !record(ctx, "contiguous", contiguous_backward, y, x, NULL, NULL))
        return NULL;
    return y;
}

static dt_tensor *need_contig(dt_ctx *ctx, dt_tensor *x)
{
    return dt_tensor_is_contiguous(x) ? x : dt_contiguous(ctx, x);
}

static dt_status reshape_backward(dt_ctx *ctx, dt_node *n)
{
    return acc_grad(ctx, n->in[0], FP(n->out->grad), 1.0f);
}

/* x (any) -> y (shape) sharing data; copies first if x is not contiguous */
dt_tensor *dt_reshape(dt_ctx *ctx, dt_tensor *x, int ndim, const int64_t *shape)
{
    if (!input_ok(ctx, "reshape", x, "input"))
        return NULL;
    if (ndim < 0 || ndim > DT_MAX_DIMS || (ndim > 0 && !shape)) {
        set_error(ctx, DT_EINVAL, "reshape: bad target (%d dimensions)", ndim);
        return NULL;
    }
    int64_t want[DT_MAX_DIMS], known = 1, n = shape_numel(x->ndim, x->shape);
    int infer = -1;
    for (int i = 0; i < ndim; i++) {
        want[i] = shape[i];
        if (shape[i] == -1 && infer < 0) {
            infer = i;
            continue;
        }
        if (shape[i] < 0) {
            set_error(ctx, DT_EINVAL, "reshape: dimension %d is %lld", i, (long long)shape[i]);
            return NULL;
        }
        known *= shape[i];
    }
    if (infer >= 0) {
        if (known == 0 || n % known != 0) {
            set_error(ctx, DT_EINVAL, "reshape: cannot infer dimension %d for %lld elements",
                      infer, (long long)n);
            return NULL;
        }
        want[infer] = n / known;
        known *= want[infer];
    }
    if (known != n) {
        char sb[96];
        set_error(ctx, DT_EINVAL, "reshape: %s has %lld elements, target has %lld", SHAPE(x, sb),
                  (long long)n, (long long)known);
        return NULL;
    }
    dt_tensor *c = need_contig(ctx, x);
    if (!c)
        return NULL;
    dt_tensor *y = view_header(ctx, c);
    if (!y)
        return NULL;
    y->ndim = ndim;
    memcpy(y->shape, want, sizeof(int64_t) * (size_t)ndim);
    contiguous_strides(ndim, y->shape, y->stride);
    if (tracks(ctx, c) && !record(ctx, "reshape", reshape_backward, y, c, NULL, NULL))
        return NULL;
    return y;
}

/* x (d0..d{k-1}, dk.., ) -> (d0..d{k-1}, prod(dk..)) */
dt_tensor *dt_flatten(dt_ctx *ctx, dt_tensor *x, int start_dim)
{
    if (!input_ok(ctx, "flatten", x, "input"))
        return NULL;
    if (x->ndim == 0)
        return dt_reshape(ctx, x, 1, (int64_t[]){1});
    if (!norm_dim(ctx, "flatten", x, &start_dim))
        return NULL;
    int64_t shape[DT_MAX_DIMS];
    for (int i = 0; i < start_dim; i++)
        shape[i] = x->shape[i];
    shape[start_dim] = shape_numel(x->ndim - start_dim, x->shape + start_dim);
    return dt_reshape(ctx, x, start_dim + 1, shape);
}

static dt_status transpose_backward(dt_ctx *ctx, dt_node *n)
{
    dt_tensor *x = n->in[0], *y = n->out;
    int d0 = (int)n->iarg[0], d1 = (int)n->iarg[1];
    int acc;
    float *gx = grad_target(ctx, x, &acc);
    if (!gx)
        return ctx->last_status;
    int64_t gs[DT_MAX_DIMS], xs[DT_MAX_DIMS];
    contiguous_strides(y->ndim, y->shape, gs);   /* gy is contiguous in y's shape */
    int64_t t = gs[d0];
    gs[d0] = gs[d1];
    gs[d1] = t;                                   /* ... read in x's index order */
    contiguous_strides(x->ndim, x->shape, xs);
    BE(ctx)->copy_strided(BEI(ctx), x->ndim, x->shape, 4, gx, xs, FP(y->grad), gs, acc);
    return DT_OK;
}

/* x (.., a, .., b, ..) -> view (.., b, .., a, ..) */
dt_tensor *dt_transpose(dt_ctx *ctx, dt_tensor *x, int d0, int d1)
{
    if (!input_ok(ctx, "transpose", x, "input"))
        return NULL;
    if (!norm_dim(ctx, "transpose", x, &d0) || !norm_dim(ctx, "transpose", x, &d1))
        return NULL;
    dt_tensor *y = view_header(ctx, x);
    if (!y)
        return NULL;
    int64_t t = y->shape[d0];
    y->shape[d0] = y->shape[d1];
    y->shape[d1] = t;
    t = y->stride[d0];
    y->stride[d0] = y->stride[d1];
    y->stride[d1] = t;
    if (tracks(ctx, x)) {
        dt_node *n = record(ctx, "transpose", transpose_backward, y, x, NULL, NULL);
        if (!n)
            return NULL;
        n->iarg[0] = d0;
        n->iarg[1] = d1;
    }
    return y;
}

static dt_status slice_backward(dt_ctx *ctx, dt_node *n)
{
    dt_tensor *x = n->in[0], *y = n->out;
    int dim = (int)n->iarg[0];
    float *gx = grad_target_zeroed(ctx, x);
    if (!gx)
        return ctx->last_status;
    int64_t xs[DT_MAX_DIMS], ys[DT_MAX_DIMS];
    contiguous_strides(x->ndim, x->shape, xs);
    contiguous_strides(y->ndim, y->shape, ys);
    BE(ctx)->copy_strided(BEI(ctx), y->ndim, y->shape, 4, gx + n->iarg[1] * xs[dim], xs,
                          FP(y->grad), ys, 1);
    return DT_OK;
}

/* x (.., D, ..) -> view (.., end-start, ..) */
dt_tensor *dt_slice(dt_ctx *ctx, dt_tensor *x, int dim, int64_t start, int64_t end)
{
    if (!input_ok(ctx, "slice", x, "input") || !norm_dim(ctx, "slice", x, &dim))
        return NULL;
    if (start < 0 || end < start || end > x->shape[dim]) {
        set_error(ctx, DT_EINVAL, "slice: [%lld, %lld) is outside dimension %d of size %lld",
                  (long long)start, (long long)end, dim, (long long)x->shape[dim]);
        return NULL;
    }
    dt_tensor *y = view_header(ctx, x);
    if (!y)
        return NULL;
    y->shape[dim] = end - start;
    y->data = (char *)x->data + (size_t)(start * x->stride[dim]) * dt_dtype_size(x->dtype);
    if (tracks(ctx, x)) {
        dt_node *n = record(ctx, "slice", slice_backward, y, x, NULL, NULL);
        if (!n)
            return NULL;
        n->iarg[0] = dim;
        n->iarg[1] = start;
    }
    return y;
}

static dt_status concat_backward(dt_ctx *ctx, dt_node *n)
{
    dt_tensor *y = n->out, **xs = n->aux[0];
    int count = (int)n->iarg[0], dim = (int)n->iarg[1];
    int64_t ys[DT_MAX_DIMS], off = 0;
    contiguous_strides(y->ndim, y->shape, ys);
    for (int i = 0; i < count; i++) {
        dt_tensor *x = xs[i];
        if (needs_grad(x)) {
            int acc;
            float *gx = grad_target(ctx, x, &acc);
            if (!gx)
                return ctx->last_status;
            int64_t cs[DT_MAX_DIMS];
            contiguous_strides(x->ndim, x->shape, cs);
            BE(ctx)->copy_strided(BEI(ctx), x->ndim, x->shape, 4, gx, cs,
                                  FP(y->grad) + off * ys[dim], ys, acc);
        }
        off += x->shape[dim];
    }
    return DT_OK;
}

/* xs[i] (.., d_i, ..) -> (.., sum d_i, ..) */
dt_tensor *dt_concat(dt_ctx *ctx, dt_tensor *const *xs, int n, int dim)
{
    if (!ctx_ok(ctx))
        return NULL;
    if (!xs || n < 1) {
        set_error(ctx, DT_EINVAL, "concat: needs at least one tensor");
        return NULL;
    }
    for (int i = 0; i < n; i++)
        if (!input_ok(ctx, "concat", xs[i], "an input"))
            return NULL;
    dt_tensor *x0 = xs[0];
    if (!norm_dim(ctx, "concat", x0, &dim))
        return NULL;
    int64_t shape[DT_MAX_DIMS];
    memcpy(shape, x0->shape, sizeof shape);
    shape[dim] = 0;
    int track = 0;
    for (int i = 0; i < n; i++) {
        dt_tensor *x = xs[i];
        int ok = x->ndim == x0->ndim && x->dtype == x0->dtype;
        for (int d = 0; ok && d < x->ndim; d++)
            ok = d == dim || x->shape[d] == x0->shape[d];
        if (!ok) {
            char s0[96], si[96];
            set_error(ctx, DT_EINVAL, "concat: input %d is %s %s, input 0 is %s %s (dim %d)", i,
                      dt_dtype_name(x->dtype), SHAPE(x, si), dt_dtype_name(x0->dtype),
                      SHAPE(x0, s0), dim);
            return NULL;
        }
        shape[dim] += x->shape[dim];
        track |= tracks(ctx, x);
    }
    dt_tensor *y = step_tensor(ctx, x0->dtype, x0->ndim, shape);
    if (!y)
        return NULL;
    size_t es = dt_dtype_size(x0->dtype);
    int64_t off = 0;
    for (int i = 0; i < n; i++) {
        materialize(xs[i]);
        BE(ctx)->copy_strided(BEI(ctx), xs[i]->ndim, xs[i]->shape, es,
                              (char *)y->data + (size_t)(off * y->stride[dim]) * es, y->stride,
                              xs[i]->data, xs[i]->stride, 0);
        off += xs[i]->shape[dim];
    }
    if (track) {
        dt_node *nd = record(ctx, "concat", concat_backward, y, NULL, NULL, NULL);
        dt_tensor **saved = arena_alloc(ctx, ctx->cur_host, sizeof(dt_tensor *) * (size_t)n);
        if (!nd || !saved) {
            set_error(ctx, DT_ENOMEM, "concat: out of memory for the tape");
            return NULL;
        }
        memcpy(saved, xs, sizeof(dt_tensor *) * (size_t)n);
        nd->aux[0] = saved;
        nd->iarg[0] = n;
        nd->iarg[1] = dim;
    }
    return y;
}

/* --- 7.2 matmul and linear ---------------------------------------------- */

/* Floats an operand of `batch` GEMMs spans: op(X) is rows x cols, stored
 * (rows, cols) with leading dimension ld, or (cols, rows) when t. */
static int64_t operand_extent(int t, int64_t rows, int64_t cols, int64_t ld, int64_t batch,
                              int64_t stride)
{
    int64_t r = t ? cols : rows, c = t ? rows : cols;
    if (r < 1 || c < 1)
        return 0;
    return (r - 1) * ld + c + (batch > 1 ? (batch - 1) * stride : 0);
}

/* Every GEMM of the ops goes through here.  At a reduced precision
 * (autocast, 6.1) the backend's mixed-precision GEMM runs it; a backend
 * without one gets operands rounded into temporaries and its f32 GEMM,
 * which gives the same numbers: inputs at prec, products summed in f32. */
static dt_status core_gemm(dt_ctx *ctx, dt_precision prec, int64_t batch, int ta, int tb,
                           int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                           int64_t lda, int64_t stride_a, const float *b, int64_t ldb,
                           int64_t stride_b, float beta, float *c, int64_t ldc, int64_t stride_c)
{
    if (prec != DT_PREC_F32 && BE(ctx)->gemm_ex) {
        BE(ctx)->gemm_ex(BEI(ctx), prec, batch, ta, tb, m, n, k, alpha, a, lda, stride_a, b, ldb,
                         stride_b, beta, c, ldc, stride_c);
        return DT_OK;
    }
    dt_arena_mark mark = arena_mark(ctx->cur_dev);
    if (prec != DT_PREC_F32) {
        int64_t na = operand_extent(ta, m, k, lda, batch, stride_a);
        int64_t nb = operand_extent(tb, k, n, ldb, batch, stride_b);
        float *ra = temp_floats(ctx, na > 0 ? na : 1);
        float *rb = ra ? temp_floats(ctx, nb > 0 ? nb : 1) : NULL;
        if (!rb) {
            arena_release(ctx->cur_dev, mark);
            return ctx->last_status;
        }
        if (na > 0)
            BE(ctx)->round_prec(BEI(ctx), prec, na, a, ra);
        if (nb > 0)
            BE(ctx)->round_prec(BEI(ctx), prec, nb, b, rb);
        a = ra;
        b = rb;
    }
    if (batch > 1)
        BE(ctx)->gemm_batched(BEI(ctx), batch, ta, tb, m, n, k, alpha, a, lda, stride_a, b, ldb,
                              stride_b, beta, c, ldc, stride_c);
    else
        BE(ctx)->gemm(BEI(ctx), ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    arena_release(ctx->cur_dev, mark);   /* queued work is stream-ordered before reuse */
    return DT_OK;
}

/* One GEMM at a node's precision; returns from the caller on failure. */
#define GEMM(ctx, prec, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)                   \
    do {                                                                                       \
        if (core_gemm(ctx, prec, 1, ta, tb, m, n, k, alpha, a, lda, 0, b, ldb, 0, beta, c, ldc, \
                      0) != DT_OK)                                                             \
            return ctx->last_status;                                                           \
    } while (0)

/* The last two dims of x as a GEMM operand: row-major (t = 0) or
 * column-major (t = 1, a transposed view) with leading dimension ld. */
typedef struct gemm_operand {
    const float *p;
    int64_t ld, batch_stride;
    int t;
} gemm_operand;

static int gemm_operand_of(const dt_tensor *x, gemm_operand *g)
{
    int r = x->ndim - 2, c = x->ndim - 1;
    int64_t rows = x->shape[r], cols = x->shape[c], sr = x->stride[r], sc = x->stride[c];
    g->p = (const float *)x->data;
    g->batch_stride = x->ndim == 3 ? x->stride[0] : 0;
    if ((cols == 1 || sc == 1) && (rows == 1 || sr >= cols)) {
        g->t = 0;
        g->ld = rows == 1 ? (cols > 1 ? cols : 1) : sr;
        return g->ld >= 1;
    }
    if ((rows == 1 || sr == 1) && (cols == 1 || sc >= rows)) {
        g->t = 1;
        g->ld = cols == 1 ? (rows > 1 ? rows : 1) : sc;
        return g->ld >= 1;
    }
    return 0;
}

static dt_status matmul_backward(dt_ctx *ctx, dt_node *n)
{
    dt_tensor *a = n->in[0], *b = n->in[1], *y = n->out;
    int trans_a = (int)n->iarg[0], trans_b = (int)n->iarg[1];
    int64_t batch = n->iarg[2], m = n->iarg[3], k = n->iarg[4], nn = n->iarg[5];
    gemm_operand A, B;
    gemm_operand_of(a, &A);
    gemm_operand_of(b, &B);
    int ta = trans_a ^ A.t, tb = trans_b ^ B.t;
    const float *dc = FP(y->grad);
    if (needs_grad(a)) {
        int acc;
        float *ga = grad_target(ctx, a, &acc);
        if (!ga)
            return ctx->last_status;
        int a_batched = a->ndim == 3;
        for (int64_t i = 0; i < batch; i++) {
            float beta = (acc || (!a_batched && i > 0)) ? 1.0f : 0.0f;
            float *gi = ga + (a_batched ? i * m * k : 0);
            const float *bi = B.p + i * B.batch_stride, *ci = dc + i * m * nn;
            if (!trans_a)  /* dA (M,K) = dC (M,N) op(b)^T */
                GEMM(ctx, n->prec, 0, !tb, m, k, nn, 1.0f, ci, nn, bi, B.ld, beta, gi, k);
            else           /* dA (K,M) = op(b) (K,N) dC^T */
                GEMM(ctx, n->prec, tb, 1, k, m, nn, 1.0f, bi, B.ld, ci, nn, beta, gi, m);
        }
    }
    if (needs_grad(b)) {
        int acc;
        float *gb = grad_target(ctx, b, &acc);
        if (!gb)
            return ctx->last_status;
        int b_batched = b->ndim == 3;
        for (int64_t i = 0; i < batch; i++) {
            float beta = (acc || (!b_batched && i > 0)) ? 1.0f : 0.0f;
            float *gi = gb + (b_batched ? i * k * nn : 0);
            const float *ai = A.p + i * A.batch_stride, *ci = dc + i * m * nn;
            if (!trans_b)  /* dB (K,N) = op(a)^T dC */
                GEMM(ctx, n->prec, !ta, 0, k, nn, m, 1.0f, ai, A.ld, ci, nn, beta, gi, nn);
            else           /* dB (N,K) = dC^T op(a) */
                GEMM(ctx, n->prec, 1, ta, nn, k, m, 1.0f, ci, nn, ai, A.ld, beta, gi, k);
        }
    }
    return DT_OK;
}

/* a (M,K) b (K,N) -> (M,N); a (B,M,K) with b (B,K,N) or (K,N) -> (B,M,N);
 * trans_* read that operand transposed. */
dt_tensor *dt_matmul(dt_ctx *ctx, dt_tensor *a, dt_tensor *b, int trans_a, int trans_b)
{
    if (!f32_ok(ctx, "matmul", a, "a") || !f32_ok(ctx, "matmul", b, "b"))
        return NULL;
    char sa[96], sb[96];
    if (a->ndim < 2 || a->ndim > 3 || b->ndim < 2 || b->ndim > 3 ||
        (a->ndim == 3 && b->ndim == 3 && a->shape[0] != b->shape[0])) {
        set_error(ctx, DT_EINVAL, "matmul: a %s and b %s: need 2-D or 3-D with equal batch",
                  SHAPE(a, sa), SHAPE(b, sb));
        return NULL;
    }
    int ra = a->ndim - 2, rb = b->ndim - 2;
    int64_t m = trans_a ? a->shape[ra + 1] : a->shape[ra];
    int64_t k = trans_a ? a->shape[ra] : a->shape[ra + 1];
    int64_t kb = trans_b ? b->shape[rb + 1] : b->shape[rb];
    int64_t nn = trans_b ? b->shape[rb] : b->shape[rb + 1];
    if (k != kb) {
        set_error(ctx, DT_EINVAL, "matmul: inner dimensions differ: a %s%s has %lld, b %s%s has %lld",
                  SHAPE(a, sa), trans_a ? "^T" : "", (long long)k, SHAPE(b, sb),
                  trans_b ? "^T" : "", (long long)kb);
        return NULL;
    }
    gemm_operand A, B;
    if (!gemm_operand_of(a, &A)) {
        if (!(a = dt_contiguous(ctx, a)))
            return NULL;
        gemm_operand_of(a, &A);
    }
    if (!gemm_operand_of(b, &B)) {
        if (!(b = dt_contiguous(ctx, b)))
            return NULL;
        gemm_operand_of(b, &B);
    }
    materialize(a);
    materialize(b);
    int64_t batch = a->ndim == 3 ? a->shape[0] : (b->ndim == 3 ? b->shape[0] : 1);
    int64_t shape[3] = {batch, m, nn};
    int batched = a->ndim == 3 || b->ndim == 3;
    dt_tensor *y = batched ? step_tensor(ctx, DT_F32, 3, shape)
                           : step_tensor(ctx, DT_F32, 2, shape + 1);
    if (!y)
        return NULL;
    int ta = trans_a ^ A.t, tb = trans_b ^ B.t;
    if (core_gemm(ctx, ctx->autocast, batched ? batch : 1, ta, tb, m, nn, k, 1.0f, A.p, A.ld,
                  A.batch_stride, B.p, B.ld, B.batch_stride, 0.0f, FP(y), nn, m * nn) != DT_OK)
        return NULL;
    if (tracks(ctx, a) || tracks(ctx, b)) {
        dt_node *n = record(ctx, "matmul", matmul_backward, y, a, b, NULL);
        if (!n)
            return NULL;
        int64_t args[6] = {trans_a, trans_b, batch, m, k, nn};
        memcpy(n->iarg, args, sizeof args);
    }
    return y;
}

static dt_status linear_backward(dt_ctx *ctx, dt_node *n)
{
    dt_tensor *x = n->in[0], *w = n->in[1], *b = n->n_in > 2 ? n->in[2] : NULL;
    int64_t rows = n->iarg[0], in = n->iarg[1], out = n->iarg[2];
    const float *dy = FP(n->out->grad);
    int acc;
    if (needs_grad(x)) {          /* dx (N,In) = dy (N,Out) w (Out,In) */
        float *gx = grad_target(ctx, x, &acc);
        if (!gx)
            return ctx->last_status;
        GEMM(ctx, n->prec, 0, 0, rows, in, out, 1.0f, dy, out, FP(w), in, acc ? 1.0f : 0.0f,
             gx, in);
    }
    /* Under DDP a large weight's gradient is made in row blocks, each sent
     * while the next computes (16); the bias goes first so it never holds
     * back the bucket it shares with the weight's first rows. */
    int64_t step = needs_grad(w) ? ddp_grad_chunk_rows(ctx, w, out, in) : 0;
    if (b && needs_grad(b)) {     /* db (Out) = sum over N of dy */
        float *gb = grad_target(ctx, b, &acc);
        if (!gb)
            return ctx->last_status;
        BE(ctx)->bias_grad(BEI(ctx), rows, out, 1, dy, gb, acc);
        if (step > 0)
            ddp_grad_rows_done(ctx, b, out, 1);
    }
    if (needs_grad(w)) {          /* dw (Out,In) = dy^T (Out,N) x (N,In) */
        float *gw = grad_target(ctx, w, &acc);
        if (!gw)
            return ctx->last_status;
        for (int64_t r0 = 0; r0 < out; r0 += step > 0 ? step : out) {
            int64_t r1 = step > 0 && r0 + step < out ? r0 + step : out;
            GEMM(ctx, n->prec, 1, 0, r1 - r0, in, rows, 1.0f, dy + r0, out, FP(x), in,
                 acc ? 1.0f : 0.0f, gw + r0 * in, in);
            if (step > 0)
                ddp_grad_rows_done(ctx, w, r1, in);
        }
    }
    return DT_OK;
}

/* x (..., In), w (Out, In), b (Out) or NULL -> (..., Out) = x w^T + b */
dt_tensor *dt_linear(dt_ctx *ctx, dt_tensor *x, dt_tensor *w, dt_tensor *b)
{
    if (!f32_ok(ctx, "linear", x, "input") || !f32_ok(ctx, "linear", w, "weight"))
        return NULL;
    if (b && !f32_ok(ctx, "linear", b, "bias"))
        return NULL;
    char sx[96], sw[96];
    if (w->ndim != 2 || x->ndim < 1 || x->shape[x->ndim - 1] != w->shape[1]) {
        set_error(ctx, DT_EINVAL, "linear: input %s does not match weight %s (want (..., %lld))",
                  SHAPE(x, sx), SHAPE(w, sw), w->ndim == 2 ? (long long)w->shape[1] : -1LL);
        return NULL;
    }
    if (b && (b->ndim != 1 || b->shape[0] != w->shape[0])) {
        set_error(ctx, DT_EINVAL, "linear: bias %s does not match weight %s", SHAPE(b, sx),
                  SHAPE(w, sw));
        return NULL;
    }
    if (!(x = need_contig(ctx, x)) || !(w = need_contig(ctx, w)) || (b && !(b = need_contig(ctx, b))))
        return NULL;
    materialize(x);
    materialize(w);
    int64_t in = w->shape[1], out = w->shape[0];
    int64_t rows = shape_numel(x->ndim - 1, x->shape);
    int64_t shape[DT_MAX_DIMS];
    memcpy(shape, x->shape, sizeof shape);
    shape[x->ndim - 1] = out;
    dt_tensor *y = step_tensor(ctx, DT_F32, x->ndim, shape);
    if (!y)
        return NULL;
    if (core_gemm(ctx, ctx->autocast, 1, 0, 1, rows, out, in, 1.0f, FP(x), in, 0, FP(w), in, 0,
                  0.0f, FP(y), out, 0) != DT_OK)
        return NULL;
    if (b) {
        materialize(b);
        BE(ctx)->bias_add(BEI(ctx), rows, out, 1, FP(b), FP(y));
    }
    if (tracks(ctx, x) || tracks(ctx, w) || tracks(ctx, b)) {
        dt_node *n = record(ctx, "linear", linear_backward, y, x, w, b);
        if (!n)
            return NULL;
        n->iarg[0] = rows;
        n->iarg[1] = in;
        n->iarg[2] = out;
    }
    return y;
}

/* --- 7.3 elementwise binary ops with broadcasting ----------------------- */

/* Broadcast a and b (aligned at the last dim).  Fills the output shape and
 * each input's strides in the output's index space (0 where broadcast). */
static int broadcast(const dt_tensor *a, const dt_tensor *b, int *ndim, int64_t *shape,
                     int64_t *sa, int64_t *sb)
{
    int nd = a->ndim > b->ndim ? a->ndim : b->ndim;
    for (int i = 0; i < nd; i++) {
        int ia = i - (nd - a->ndim), ib = i - (nd - b->ndim);
        int64_t da = ia >= 0 ? a->shape[ia] : 1, db = ib >= 0 ? b->shape[ib] : 1;
        if (da != db && da != 1 && db != 1)
            return 0;
        shape[i] = da == 1 ? db : da;
        sa[i] = (ia >= 0 && da == shape[i]) ? a->stride[ia] : 0;
        sb[i] = (ib >= 0 && db == shape[i]) ? b->stride[ib] : 0;
    }
    *ndim = nd;
    return 1;
}

/* gx (+)= alpha * (src reduced over the dims x was broadcast along); src is
 * contiguous over the output shape. */
static dt_status acc_reduced(dt_ctx *ctx, dt_tensor *x, int nd, const int64_t *shape,
                             const float *src, float alpha)
{
    int64_t nx = shape_numel(x->ndim, x->shape), ny = shape_numel(nd, shape);
    if (nx == ny)
        return acc_grad(ctx, x, src, alpha);
    int64_t xs[DT_MAX_DIMS], ds[DT_MAX_DIMS];
    contiguous_strides(x->ndim, x->shape, xs);
    for (int i = 0; i < nd; i++) {
        int ix = i - (nd - x->ndim);
        ds[i] = (ix >= 0 && x->shape[ix] == shape[i]) ? xs[ix] : 0;
    }
    int acc;
    float *gx = grad_target(ctx, x, &acc);
    if (!gx)
        return ctx->last_status;
    if (alpha == 1.0f) {
        BE(ctx)->sum_to(BEI(ctx), nd, shape, src, gx, ds, acc);
        return DT_OK;
    }
    float *tmp = temp_floats(ctx, nx);
    if (!tmp)
        return ctx->last_status;
    BE(ctx)->sum_to(BEI(ctx), nd, shape, src, tmp, ds, 0);
    BE(ctx)->axpby(BEI(ctx), nx, alpha, tmp, acc ? 1.0f : 0.0f, gx);
    return DT_OK;
}

static dt_status binary_backward(dt_ctx *ctx, dt_node *n)
{
    dt_tensor *a = n->in[0], *b = n->in[1], *y = n->out;
    dt_binary_op op = (dt_binary_op)n->iarg[0];
    int nd;
    int64_t shape[DT_MAX_DIMS], sa[DT_MAX_DIMS], sb[DT_MAX_DIMS], sy[DT_MAX_DIMS];
    broadcast(a, b, &nd, shape, sa, sb);
    contiguous_strides(nd, shape, sy);
    const float *gy = FP(y->grad);
    int64_t ny = shape_numel(nd, shape);
    dt_status s = DT_OK;
    if (op == DT_BIN_ADD || op == DT_BIN_SUB) {
        if (needs_grad(a))
            s = acc_reduced(ctx, a, nd, shape, gy, 1.0f);
        if (s == DT_OK && needs_grad(b))
            s = acc_reduced(ctx, b, nd, shape, gy, op == DT_BIN_SUB ? -1.0f : 1.0f);
        return s;
    }
    float *tmp = temp_floats(ctx, ny);
    if (!tmp)
        return ctx->last_status;
    if (op == DT_BIN_MUL) {
        if (needs_grad(a)) {   /* da = dy * b */
            BE(ctx)->binary(BEI(ctx), DT_BIN_MUL, nd, shape, gy, sy, FP(b), sb, tmp);
            if ((s = acc_reduced(ctx, a, nd, shape, tmp, 1.0f)) != DT_OK)
                return s;
        }
        if (needs_grad(b)) {   /* db = dy * a */
            BE(ctx)->binary(BEI(ctx), DT_BIN_MUL, nd, shape, gy, sy, FP(a), sa, tmp);
            s = acc_reduced(ctx, b, nd, shape, tmp, 1.0f);
        }
        return s;
    }
    /* DIV: da = dy / b, db = -dy * y / b */
    if (needs_grad(a)) {
        BE(ctx)->binary(BEI(ctx), DT_BIN_DIV, nd, shape, gy, sy, FP(b), sb, tmp);
        if ((s = acc_reduced(ctx, a, nd, shape, tmp, 1.0f)) != DT_OK)
            return s;
    }
    if (needs_grad(b)) {
        BE(ctx)->binary(BEI(ctx), DT_BIN_MUL, nd, shape, gy, sy, FP(y), sy, tmp);
        BE(ctx)->binary(BEI(ctx), DT_BIN_DIV, nd, shape, tmp, sy, FP(b), sb, tmp);
        s = acc_reduced(ctx, b, nd, shape, tmp, -1.0f);
    }
    return s;
}

static dt_tensor *binary_op(dt_ctx *ctx, const char *name, dt_binary_op op, dt_tensor *a,
                            dt_tensor *b)
{
    if (!f32_ok(ctx, name, a, "a") || !f32_ok(ctx, name, b, "b"))
        return NULL;
    int nd;
    int64_t shape[DT_MAX_DIMS], sa[DT_MAX_DIMS], sb[DT_MAX_DIMS];
    if (!broadcast(a, b, &nd, shape, sa, sb)) {
        char s1[96], s2[96];
        set_error(ctx, DT_EINVAL, "%s: shapes %s and %s do not broadcast", name, SHAPE(a, s1),
                  SHAPE(b, s2));
        return NULL;
    }
    materialize(a);
    materialize(b);
    dt_tensor *y = step_tensor(ctx, DT_F32, nd, shape);
    if (!y)
        return NULL;
    BE(ctx)->binary(BEI(ctx), op, nd, shape, FP(a), sa, FP(b), sb, FP(y));
    if (tracks(ctx, a) || tracks(ctx, b)) {
        dt_node *n = record(ctx, name, binary_backward, y, a, b, NULL);
        if (!n)
            return NULL;
        n->iarg[0] = op;
    }
    return y;
}

dt_tensor *dt_add(dt_ctx *ctx, dt_tensor *a, dt_tensor *b) { return binary_op(ctx, "add", DT_BIN_ADD, a, b); }
dt_tensor *dt_sub(dt_ctx *ctx, dt_tensor *a, dt_tensor *b) { return binary_op(ctx, "sub", DT_BIN_SUB, a, b); }
dt_tensor *dt_mul(dt_ctx *ctx, dt_tensor *a, dt_tensor *b) { return binary_op(ctx, "mul", DT_BIN_MUL, a, b); }
dt_tensor *dt_div(dt_ctx *ctx, dt_tensor *a, dt_tensor *b) { return binary_op(ctx, "div", DT_BIN_DIV, a, b); }

static dt_status scale_backward(dt_ctx *ctx, dt_node *n)
{
    return acc_grad(ctx, n->in[0], FP(n->out->grad), n->farg[0]);
}

/* x -> s * x */
dt_tensor *dt_scale(dt_ctx *ctx, dt_tensor *x, float s)
{
    if (!f32_ok(ctx, "scale", x, "input") || !(x = need_contig(ctx, x)))
        return NULL;
    materialize(x);
    dt_tensor *y = like(ctx, x);
    if (!y)
        return NULL;
    BE(ctx)->axpby(BEI(ctx), shape_numel(x->ndim, x->shape), s, FP(x), 0.0f, FP(y));
    if (tracks(ctx, x)) {
        dt_node *n = record(ctx, "scale", scale_backward, y, x, NULL, NULL);
        if (!n)
            return NULL;
        n->farg[0] = s;
    }
    return y;
}

/* --- 7.4 reductions ----------------------------------------------------- */

/* gx (+)= broadcast of the scalar g * scale over x */
static dt_status broadcast_scalar_grad(dt_ctx *ctx, dt_tensor *x, const float *g, float scale)
{
    int64_t nx = shape_numel(x->ndim, x->shape);
    const float *src = g;
    if (scale != 1.0f) {
        float *tmp = temp_floats(ctx, 1);
        if (!tmp)
            return ctx->last_status;
        BE(ctx)->axpby(BEI(ctx), 1, scale, g, 0.0f, tmp);
        src = tmp;
    }
    int acc;
    float *gx = grad_target(ctx, x, &acc);
    if (!gx)
        return ctx->last_status;
    int64_t one[1] = {nx}, ds[1] = {1}, ss[1] = {0};
    BE(ctx)->copy_strided(BEI(ctx), 1, one, 4, gx, ds, src, ss, acc);
    return DT_OK;
}

static dt_status sum_backward(dt_ctx *ctx, dt_node *n)
{
    return broadcast_scalar_grad(ctx, n->in[0], FP(n->out->grad), n->farg[0]);
}

static dt_tensor *reduce_all(dt_ctx *ctx, const char *name, dt_tensor *x, int mean)
{
    if (!f32_ok(ctx, name, x, "input") || !(x = need_contig(ctx, x)))
        return NULL;
    materialize(x);
    dt_tensor *y = step_tensor(ctx, DT_F32, 0, NULL);
    if (!y)
        return NULL;
    int64_t nx = shape_numel(x->ndim, x->shape);
    float scale = mean ? 1.0f / (float)nx : 1.0f;
    BE(ctx)->sum(BEI(ctx), nx, FP(x), FP(y));
    if (mean)
        BE(ctx)->axpby(BEI(ctx), 1, scale, FP(y), 0.0f, FP(y));
    if (tracks(ctx, x)) {
        dt_node *n = record(ctx, name, sum_backward, y, x, NULL, NULL);
        if (!n)
            return NULL;
        n->farg[0] = scale;
    }
    return y;
}

/* x (any) -> scalar */
dt_tensor *dt_sum(dt_ctx *ctx, dt_tensor *x) { return reduce_all(ctx, "sum", x, 0); }
dt_tensor *dt_mean(dt_ctx *ctx, dt_tensor *x) { return reduce_all(ctx, "mean", x, 1); }

static dt_status sum_dim_backward(dt_ctx *ctx, dt_node *n)
{
    int64_t outer = n->iarg[0], len = n->iarg[1], inner = n->iarg[2];
    const float *g = FP(n->out->grad);
    if (n->farg[0] != 1.0f) {
        float *tmp = temp_floats(ctx, outer * inner);
        if (!tmp)
            return ctx->last_status;
        BE(ctx)->axpby(BEI(ctx), outer * inner, n->farg[0], g, 0.0f, tmp);
        g = tmp;
    }
    int acc;
    float *gx = grad_target(ctx, n->in[0], &acc);
    if (!gx)
        return ctx->last_status;
    int64_t shape[3] = {outer, len, inner}, ds[3] = {len * inner, inner, 1}, ss[3] = {inner, 0, 1};
    BE(ctx)->copy_strided(BEI(ctx), 3, shape, 4, gx, ds, g, ss, acc);
    return DT_OK;
}

static dt_tensor *reduce_dim(dt_ctx *ctx, const char *name, dt_tensor *x, int dim, int keepdim,
                             int mean)
{
    if (!f32_ok(ctx, name, x, "input") || !norm_dim(ctx, name, x, &dim) ||
        !(x = need_contig(ctx, x)))
        return NULL;
    materialize(x);
    int64_t outer = shape_numel(dim, x->shape), len = x->shape[dim];
    int64_t inner = shape_numel(x->ndim - dim - 1, x->shape + dim + 1);
    int64_t shape[DT_MAX_DIMS];
    int nd = 0;
    for (int i = 0; i < x->ndim; i++) {
        if (i != dim)
            shape[nd++] = x->shape[i];
        else if (keepdim)
            shape[nd++] = 1;
    }
    dt_tensor *y = step_tensor(ctx, DT_F32, nd, shape);
    if (!y)
        return NULL;
    BE(ctx)->reduce_axis(BEI(ctx), DT_RED_SUM, outer, len, inner, FP(x), FP(y));
    float scale = mean ? 1.0f / (float)len : 1.0f;
    if (mean)
        BE(ctx)->axpby(BEI(ctx), outer * inner, scale, FP(y), 0.0f, FP(y));
    if (tracks(ctx, x)) {
        dt_node *n = record(ctx, name, sum_dim_backward, y, x, NULL, NULL);
        if (!n)
            return NULL;
        n->iarg[0] = outer;
        n->iarg[1] = len;
        n->iarg[2] = inner;
        n->farg[0] = scale;
    }
    return y;
}

dt_tensor *dt_sum_dim(dt_ctx *ctx, dt_tensor *x, int dim, int keepdim)
{
    return reduce_dim(ctx, "sum_dim", x, dim, keepdim, 0);
}

dt_tensor *dt_mean_dim(dt_ctx *ctx, dt_tensor *x, int dim, int keepdim)
{
    return reduce_dim(ctx, "mean_dim", x, dim, keepdim, 1);
}

/* --- 7.5 activations and softmax ---------------------------------------- */

static dt_status unary_backward(dt_ctx *ctx, dt_node *n)
{
    dt_tensor *x = n->in[0], *y = n->out;
    int acc;
    float *gx = grad_target(ctx, x, &acc);
    if (!gx)
        return ctx->last_status;
    BE(ctx)->unary_backward(BEI(ctx), (dt_unary_op)n->iarg[0], shape_numel(x->ndim, x->shape),
                            FP(x), FP(y), FP(y->grad), gx, acc);
    return DT_OK;
}

/* x -> op(x), same shape */
static dt_tensor *unary_op(dt_ctx *ctx, const char *name, dt_unary_op op, dt_tensor *x)
{
    if (!f32_ok(ctx, name, x, "input") || !(x = need_contig(ctx, x)))
        return NULL;
    materialize(x);
    dt_tensor *y = like(ctx, x);
    if (!y)
        return NULL;
    BE(ctx)->unary(BEI(ctx), op, shape_numel(x->ndim, x->shape), FP(x), FP(y));
    if (tracks(ctx, x)) {
        dt_node *n = record(ctx, name, unary_backward, y, x, NULL, NULL);
        if (!n)
            return NULL;
        n->iarg[0] = op;
    }
    return y;
}

dt_tensor *dt_relu(dt_ctx *ctx, dt_tensor *x) { return unary_op(ctx, "relu", DT_UNARY_RELU, x); }
dt_tensor *dt_gelu(dt_ctx *ctx, dt_tensor *x) { return unary_op(ctx, "gelu", DT_UNARY_GELU, x); }
dt_tensor *dt_tanh(dt_ctx *ctx, dt_tensor *x) { return unary_op(ctx, "tanh", DT_UNARY_TANH, x); }
dt_tensor *dt_sigmoid(dt_ctx *ctx, dt_tensor *x) { return unary_op(ctx, "sigmoid", DT_UNARY_SIGMOID, x); }

static dt_status softmax_backward(dt_ctx *ctx, dt_node *n)
{
    int acc;
    float *gx = grad_target(ctx, n->in[0], &acc);
    if (!gx)
        return ctx->last_status;
    BE(ctx)->softmax_backward(BEI(ctx), n->iarg[0], n->iarg[1], n->iarg[2], FP(n->out),
                              FP(n->out->grad), gx, (int)n->iarg[3], acc);
    return DT_OK;
}

/* x (.., L, ..) -> softmax along dim L */
static dt_tensor *softmax_op(dt_ctx *ctx, const char *name, dt_tensor *x, int dim, int log)
{
    if (!f32_ok(ctx, name, x, "input") || !norm_dim(ctx, name, x, &dim) ||
        !(x = need_contig(ctx, x)))
        return NULL;
    materialize(x);
    int64_t outer = shape_numel(dim, x->shape), len = x->shape[dim];
    int64_t inner = shape_numel(x->ndim - dim - 1, x->shape + dim + 1);
    dt_tensor *y = like(ctx, x);
    if (!y)
        return NULL;
    BE(ctx)->softmax(BEI(ctx), outer, len, inner, FP(x), FP(y), log);
    if (tracks(ctx, x)) {
        dt_node *n = record(ctx, name, softmax_backward, y, x, NULL, NULL);
        if (!n)
            return NULL;
        int64_t args[4] = {outer, len, inner, log};
        memcpy(n->iarg, args, sizeof args);
    }
    return y;
}

dt_tensor *dt_softmax(dt_ctx *ctx, dt_tensor *x, int dim) { return softmax_op(ctx, "softmax", x, dim, 0); }
dt_tensor *dt_log_softmax(dt_ctx *ctx, dt_tensor *x, int dim) { return softmax_op(ctx, "log_softmax", x, dim, 1); }

/* --- 7.6 losses ----------------------------------------------------------- */

static dt_status xent_backward(dt_ctx *ctx, dt_node *n)
{
    int acc;
    float *gx = grad_target(ctx, n->in[0], &acc);
    if (!gx)
        return ctx->last_status;
    BE(ctx)->xent_backward(BEI(ctx), n->iarg[0], n->iarg[1], n->aux[0], IP(n->in[1]),
                           FP(n->out->grad), gx, acc);
    return DT_OK;
}

/* logits (N,C) f32, labels (N) i32 -> scalar mean cross entropy */
dt_tensor *dt_cross_entropy(dt_ctx *ctx, dt_tensor *logits, dt_tensor *labels)
{
    if (!f32_ok(ctx, "cross_entropy", logits, "logits") ||
        !input_ok(ctx, "cross_entropy", labels, "labels"))
        return NULL;
    char s1[96], s2[96];
    if (labels->dtype != DT_I32) {
        set_error(ctx, DT_EINVAL, "cross_entropy: labels are %s, need i32",
                  dt_dtype_name(labels->dtype));
        return NULL;
    }
    if (logits->ndim != 2 || labels->ndim != 1 || labels->shape[0] != logits->shape[0] ||
        logits->shape[0] == 0 || logits->shape[1] == 0) {
        set_error(ctx, DT_EINVAL, "cross_entropy: logits %s and labels %s: need (N,C) and (N), N,C > 0",
                  SHAPE(logits, s1), SHAPE(labels, s2));
        return NULL;
    }
    if (!(logits = need_contig(ctx, logits)) || !(labels = need_contig(ctx, labels)))
        return NULL;
    materialize(logits);
    materialize(labels);
    int64_t n = logits->shape[0], c = logits->shape[1];
    float *probs = temp_floats(ctx, n * c);
    dt_tensor *y = probs ? step_tensor(ctx, DT_F32, 0, NULL) : NULL;
    if (!y)
        return NULL;
    int64_t bad = BE(ctx)->xent_forward(BEI(ctx), n, c, FP(logits), IP(labels), probs, FP(y));
    if (be_fault(ctx, "cross_entropy") != DT_OK)
        return NULL;
    if (bad >= 0) {
        int32_t v = 0;
        BE(ctx)->to_host(BEI(ctx), &v, IP(labels) + bad, sizeof v);
        set_error(ctx, DT_EINVAL, "cross_entropy: label %d at index %lld is outside [0, %lld)",
                  (int)v, (long long)bad, (long long)c);
        return NULL;
    }
    if (tracks(ctx, logits)) {
        dt_node *nd = record(ctx, "cross_entropy", xent_backward, y, logits, labels, NULL);
        if (!nd)
            return NULL;
        nd->iarg[0] = n;
        nd->iarg[1] = c;
        nd->aux[0] = probs;
    }
    return y;
}

static dt_status mse_backward(dt_ctx *ctx, dt_node *n)
{
    dt_tensor *p = n->in[0], *t = n->in[1];
    int64_t cnt = shape_numel(p->ndim, p->shape);
    float *tmp = temp_floats(ctx, cnt);
    if (!tmp)
        return ctx->last_status;
    int64_t shape[1] = {cnt}, s1[1] = {1}, s0[1] = {0};
    /* tmp = diff * dloss; dpred = 2/n tmp, dtarget = -2/n tmp */
    BE(ctx)->binary(BEI(ctx), DT_BIN_MUL, 1, shape, n->aux[0], s1, FP(n->out->grad), s0, tmp);
    float k = 2.0f / (float)cnt;
    dt_status s = DT_OK;
    if (needs_grad(p))
        s = acc_grad(ctx, p, tmp, k);
    if (s == DT_OK && needs_grad(t))
        s = acc_grad(ctx, t, tmp, -k);
    return s;
}

/* pred, target same shape -> scalar mean((pred - target)^2) */
dt_tensor *dt_mse(dt_ctx *ctx, dt_tensor *pred, dt_tensor *target)
{
    if (!f32_ok(ctx, "mse", pred, "pred") || !f32_ok(ctx, "mse", target, "target"))
        return NULL;
    int same = pred->ndim == target->ndim;
    for (int i = 0; same && i < pred->ndim; i++)
        same = pred->shape[i] == target->shape[i];
    int64_t cnt = shape_numel(pred->ndim, pred->shape);
    if (!same || cnt == 0) {
        char s1[96], s2[96];
        set_error(ctx, DT_EINVAL, "mse: pred %s and target %s must have the same non-empty shape",
                  SHAPE(pred, s1), SHAPE(target, s2));
        return NULL;
    }
    materialize(pred);
    materialize(target);
    float *diff = temp_floats(ctx, cnt), *sq = diff ? temp_floats(ctx, cnt) : NULL;
    dt_tensor *y = sq ? step_tensor(ctx, DT_F32, 0, NULL) : NULL;
    if (!y)
        return NULL;
    int64_t cs[DT_MAX_DIMS];
    contiguous_strides(pred->ndim, pred->shape, cs);
    BE(ctx)->binary(BEI(ctx), DT_BIN_SUB, pred->ndim, pred->shape, FP(pred), pred->stride,
                    FP(target), target->stride, diff);
    BE(ctx)->binary(BEI(ctx), DT_BIN_MUL, pred->ndim, pred->shape, diff, cs, diff, cs, sq);
    BE(ctx)->sum(BEI(ctx), cnt, sq, FP(y));
    BE(ctx)->axpby(BEI(ctx), 1, 1.0f / (float)cnt, FP(y), 0.0f, FP(y));
    if (tracks(ctx, pred) || tracks(ctx, target)) {
        dt_node *n = record(ctx, "mse", mse_backward, y, pred, target, NULL);
        if (!n)
            return NULL;
        n->aux[0] = diff;
    }
    return y;
}

/* --- 7.7 convolution and pooling (NCHW) --------------------------------- */

static dt_status conv2d_backward(dt_ctx *ctx, dt_node *n)
{
    dt_tensor *x = n->in[0], *w = n->in[1], *b = n->n_in > 2 ? n->in[2] : NULL, *y = n->out;
    const dt_conv_geom *g = n->aux[1];
    const float *col = n->aux[0];
    int64_t o = w->shape[0], ckk = g->c * g->kh * g->kw, p = g->oh * g->ow, np = g->n * p;
    const float *gy = FP(y->grad), *dyt = gy;   /* dY' (O, N*P) */
    if (g->n > 1) {
        float *t = temp_floats(ctx, o * np);
        if (!t)
            return ctx->last_status;
        BE(ctx)->ncp_to_cnp(BEI(ctx), g->n, o, p, gy, t);
        dyt = t;
    }
    int acc;
    if (needs_grad(w)) {   /* dW (O, CKK) = dY' col^T */
        float *gw = grad_target(ctx, w, &acc);
        if (!gw)
            return ctx->last_status;
        GEMM(ctx, n->prec, 0, 1, o, ckk, np, 1.0f, dyt, np, col, np, acc ? 1.0f : 0.0f, gw, ckk);
    }
    if (b && needs_grad(b)) {
        float *gb = grad_target(ctx, b, &acc);
        if (!gb)
            return ctx->last_status;
        BE(ctx)->bias_grad(BEI(ctx), g->n, o, p, gy, gb, acc);
    }
    if (needs_grad(x)) {   /* dcol (CKK, N*P) = W^T dY', then fold */
        float *dcol = temp_floats(ctx, ckk * np);
        float *gx = dcol ? grad_target(ctx, x, &acc) : NULL;
        if (!gx)
            return ctx->last_status;
        GEMM(ctx, n->prec, 1, 0, ckk, np, o, 1.0f, FP(w), ckk, dyt, np, 0.0f, dcol, np);
        BE(ctx)->col2im(BEI(ctx), g, dcol, gx, acc);
    }
    return DT_OK;
}

static dt_status conv2d_fused_backward(dt_ctx *ctx, dt_node *n)
{
    dt_tensor *x = n->in[0], *w = n->in[1], *b = n->n_in > 2 ? n->in[2] : NULL;
    int ax = 0, aw = 0, ab = 0;
    float *gx = needs_grad(x) ? grad_target(ctx, x, &ax) : NULL;
    float *gw = needs_grad(w) ? grad_target(ctx, w, &aw) : NULL;
    float *gb = b && needs_grad(b) ? grad_target(ctx, b, &ab) : NULL;
    if ((needs_grad(x) && !gx) || (needs_grad(w) && !gw) || (b && needs_grad(b) && !gb))
        return ctx->last_status;
    dt_status s = BE(ctx)->conv2d_backward(BEI(ctx), n->aux[1], w->shape[0], FP(x), FP(w),
                                           FP(n->out->grad), gx, ax, gw, aw, gb, ab);
    return s == DT_OK ? s : set_error(ctx, s, "conv2d: backend out of scratch memory");
}

/* The backend's own convolution: nothing is kept for backward but x and w. */
static dt_tensor *conv2d_fused(dt_ctx *ctx, const dt_conv_geom *geom, dt_tensor *x, dt_tensor *w,
                               dt_tensor *b, dt_tensor *y, int track)
{
    if (b)
        materialize(b);
    dt_status s = BE(ctx)->conv2d_forward(BEI(ctx), geom, w->shape[0], FP(x), FP(w),
                                          b ? FP(b) : NULL, FP(y));
    if (s != DT_OK) {
        set_error(ctx, s, "conv2d: backend out of scratch memory");
        return NULL;
    }
    if (!track)
        return y;
    dt_conv_geom *g = arena_alloc(ctx, ctx->cur_host, sizeof *g);
    dt_node *n = g ? record(ctx, "conv2d", conv2d_fused_backward, y, x, w, b) : NULL;
    if (!n) {
        set_error(ctx, DT_ENOMEM, "conv2d: out of memory for the tape");
        return NULL;
    }
    *g = *geom;
    n->aux[1] = g;
    return y;
}

static int pool_geom(dt_ctx *ctx, const char *op, const dt_tensor *x, int64_t kh, int64_t kw,
                     int stride, int pad, dt_conv_geom *g)
{
    char sx[96];
    if (x->ndim != 4) {
        set_error(ctx, DT_EINVAL, "%s: input %s must be (N,C,H,W)", op, SHAPE(x, sx));
        return 0;
    }
    if (stride < 1 || pad < 0 || kh < 1 || kw < 1) {
        set_error(ctx, DT_EINVAL, "%s: kernel %lldx%lld, stride %d, pad %d: need kernel, stride >= 1 "
                  "and pad >= 0", op, (long long)kh, (long long)kw, stride, pad);
        return 0;
    }
    g->n = x->shape[0];
    g->c = x->shape[1];
    g->h = x->shape[2];
    g->w = x->shape[3];
    g->kh = kh;
    g->kw = kw;
    g->stride = stride;
    g->pad = pad;
    if (g->h + 2 * pad < kh || g->w + 2 * pad < kw) {
        set_error(ctx, DT_EINVAL, "%s: kernel %lldx%lld larger than padded input %s", op,
                  (long long)kh, (long long)kw, SHAPE(x, sx));
        return 0;
    }
    g->oh = (g->h + 2 * pad - kh) / stride + 1;
    g->ow = (g->w + 2 * pad - kw) / stride + 1;
    return 1;
}

/* x (N,C,H,W), w (O,C,KH,KW), b (O) -> (N,O,OH,OW) by im2col + one GEMM */
dt_tensor *dt_conv2d(dt_ctx *ctx, dt_tensor *x, dt_tensor *w, dt_tensor *b, int stride, int pad)
{
    if (!f32_ok(ctx, "conv2d", x, "input") || !f32_ok(ctx, "conv2d", w, "weight") ||
        (b && !f32_ok(ctx, "conv2d", b, "bias")))
        return NULL;
    char sx[96], sw[96];
    if (w->ndim != 4) {
        set_error(ctx, DT_EINVAL, "conv2d: weight %s must be (O,C,KH,KW)", SHAPE(w, sw));
        return NULL;
    }
    dt_conv_geom geom;
    if (!pool_geom(ctx, "conv2d", x, w->shape[2], w->shape[3], stride, pad, &geom))
        return NULL;
    if (x->shape[1] != w->shape[1]) {
        set_error(ctx, DT_EINVAL, "conv2d: input %s has %lld channels, weight %s expects %lld",
                  SHAPE(x, sx), (long long)x->shape[1], SHAPE(w, sw), (long long)w->shape[1]);
        return NULL;
    }
    if (b && (b->ndim != 1 || b->shape[0] != w->shape[0])) {
        set_error(ctx, DT_EINVAL, "conv2d: bias %s does not match %lld output channels",
                  SHAPE(b, sx), (long long)w->shape[0]);
        return NULL;
    }
    if (!(x = need_contig(ctx, x)) || !(w = need_contig(ctx, w)) || (b && !(b = need_contig(ctx, b))))
        return NULL;
    materialize(x);
    materialize(w);
    int64_t o = w->shape[0], ckk = geom.c * geom.kh * geom.kw, p = geom.oh * geom.ow;
    int64_t np = geom.n * p;
    int64_t shape[4] = {geom.n, o, geom.oh, geom.ow};
    dt_tensor *y = step_tensor(ctx, DT_F32, 4, shape);
    if (!y)
        return NULL;
    int track = tracks(ctx, x) || tracks(ctx, w) || tracks(ctx, b);
    /* autocast: the composed path, whose GEMMs run at the reduced precision */
    if (BE(ctx)->conv2d_forward && ctx->autocast == DT_PREC_F32)
        return conv2d_fused(ctx, &geom, x, w, b, y, track);
    dt_arena_mark mark = arena_mark(ctx->cur_dev);   /* temporaries, freed if no backward */
    dt_conv_geom *g = track ? arena_alloc(ctx, ctx->cur_host, sizeof *g) : &geom;
    float *col = g ? temp_floats(ctx, ckk * np) : NULL;
    float *yt = (col && geom.n > 1) ? temp_floats(ctx, o * np) : FP(y);
    if (!g || !col || !yt)
        return NULL;
    *g = geom;
    BE(ctx)->im2col(BEI(ctx), g, FP(x), col);
    if (core_gemm(ctx, ctx->autocast, 1, 0, 0, o, np, ckk, 1.0f, FP(w), ckk, 0, col, np, 0, 0.0f,
                  yt, np, 0) != DT_OK)
        return NULL;
    if (geom.n > 1)
        BE(ctx)->cnp_to_ncp(BEI(ctx), o, geom.n, p, yt, FP(y));
    if (b) {
        materialize(b);
        BE(ctx)->bias_add(BEI(ctx), geom.n, o, p, FP(b), FP(y));
    }
    if (!track) {
        arena_release(ctx->cur_dev, mark);
        return y;
    }
    dt_node *n = record(ctx, "conv2d", conv2d_backward, y, x, w, b);
    if (!n)
        return NULL;
    n->aux[0] = col;
    n->aux[1] = g;
    return y;
}

static dt_status maxpool_backward(dt_ctx *ctx, dt_node *n)
{
    int acc;
    float *gx = grad_target(ctx, n->in[0], &acc);
    if (!gx)
        return ctx->last_status;
    BE(ctx)->maxpool_backward(BEI(ctx), n->aux[1], FP(n->out->grad), n->aux[0], gx, acc);
    return DT_OK;
}

static dt_status avgpool_backward(dt_ctx *ctx, dt_node *n)
{
    int acc;
    float *gx = grad_target(ctx, n->in[0], &acc);
    if (!gx)
        return ctx->last_status;
    BE(ctx)->avgpool_backward(BEI(ctx), n->aux[1], FP(n->out->grad), gx, acc);
    return DT_OK;
}

/* x (N,C,H,W) -> (N,C,OH,OW); stride 0 means stride = kernel */
static dt_tensor *pool_op(dt_ctx *ctx, const char *name, dt_tensor *x, int kernel, int stride,
                          int pad, int is_max)
{
    if (!f32_ok(ctx, name, x, "input"))
        return NULL;
    if (stride == 0)
        stride = kernel;
    dt_conv_geom geom;
    if (!pool_geom(ctx, name, x, kernel, kernel, stride, pad, &geom))
        return NULL;
    if (pad > kernel / 2) {
        set_error(ctx, DT_EINVAL, "%s: pad %d must be at most half the kernel (%d)", name, pad,
                  kernel);
        return NULL;
    }
    if (!(x = need_contig(ctx, x)))
        return NULL;
    materialize(x);
    int64_t shape[4] = {geom.n, geom.c, geom.oh, geom.ow};
    dt_tensor *y = step_tensor(ctx, DT_F32, 4, shape);
    dt_conv_geom *g = y ? arena_alloc(ctx, ctx->cur_host, sizeof *g) : NULL;
    int32_t *argmax = NULL;
    if (!g)
        return NULL;
    *g = geom;
    if (is_max) {
        argmax = arena_alloc(ctx, ctx->cur_dev, (size_t)shape_numel(4, shape) * sizeof(int32_t));
        if (!argmax) {
            set_error(ctx, DT_ENOMEM, "%s: out of memory", name);
            return NULL;
        }
        BE(ctx)->maxpool_forward(BEI(ctx), g, FP(x), FP(y), argmax);
    } else {
        BE(ctx)->avgpool_forward(BEI(ctx), g, FP(x), FP(y));
    }
    if (tracks(ctx, x)) {
        dt_node *n = record(ctx, name, is_max ? maxpool_backward : avgpool_backward, y, x, NULL,
                            NULL);
        if (!n)
            return NULL;
        n->aux[0] = argmax;
        n->aux[1] = g;
    }
    return y;
}

dt_tensor *dt_max_pool2d(dt_ctx *ctx, dt_tensor *x, int kernel, int stride, int pad)
{
    return pool_op(ctx, "max_pool2d", x, kernel, stride, pad, 1);
}

dt_tensor *dt_avg_pool2d(dt_ctx *ctx, dt_tensor *x, int kernel, int stride, int pad)
{
    return pool_op(ctx, "avg_pool2d", x, kernel, stride, pad, 0);
}

/* --- 7.8 embedding, layer norm, dropout ----------------------------------- */

/* Hogwild!: log the rows idx uses instead of zeroing the whole gradient
 * (its memory is zero outside the logged rows), so a step costs the rows it
 * touches.  0: the log cannot grow (the caller goes dense). */
static int row_log_add(dt_ctx *ctx, row_log *l, const int32_t *idx, int64_t n)
{
    if (l->n + n > l->cap) {
        int64_t cap = (l->n + n) * 2;
        int64_t *r = ctx->al.realloc_fn(l->rows, (size_t)cap * sizeof *r, ctx->al.user);
        if (!r)
            return 0;
        l->rows = r;
        l->cap = cap;
    }
    for (int64_t i = 0; i < n; i++)
        l->rows[l->n++] = idx[i];
    return 1;
}

static dt_status embedding_backward(dt_ctx *ctx, dt_node *n)
{
    dt_tensor *w = n->in[0], *idx = n->in[1];
    int64_t count = shape_numel(idx->ndim, idx->shape);
    float *gw;
    if (w->rowlog && !w->rowlog->dense && w->grad && ctx->be_iface->host_visible &&
        row_log_add(ctx, w->rowlog, IP(idx), count)) {
        w->grad->flags &= ~(unsigned)T_ZERO;   /* zero already, outside the logged rows */
        gw = FP(w->grad);
    } else {
        gw = grad_target_zeroed(ctx, w);
    }
    if (!gw)
        return ctx->last_status;
    BE(ctx)->embedding_backward(BEI(ctx), shape_numel(idx->ndim, idx->shape), w->shape[1],
                                IP(idx), FP(n->out->grad), gw);
    return DT_OK;
}

/* weight (V,D), idx i32 (...) -> (..., D) */
dt_tensor *dt_embedding(dt_ctx *ctx, dt_tensor *weight, dt_tensor *idx)
{
    if (!f32_ok(ctx, "embedding", weight, "weight") || !input_ok(ctx, "embedding", idx, "indices"))
        return NULL;
    char sw[96];
    if (weight->ndim != 2 || idx->dtype != DT_I32 || idx->ndim + 1 > DT_MAX_DIMS) {
        set_error(ctx, DT_EINVAL, "embedding: weight %s must be (V,D) and indices i32 (got %s)",
                  SHAPE(weight, sw), dt_dtype_name(idx->dtype));
        return NULL;
    }
    if (!(weight = need_contig(ctx, weight)) || !(idx = need_contig(ctx, idx)))
        return NULL;
    materialize(weight);
    materialize(idx);
    int64_t n = shape_numel(idx->ndim, idx->shape), d = weight->shape[1];
    int64_t bad = BE(ctx)->index_check(BEI(ctx), n, IP(idx), weight->shape[0]);
    if (be_fault(ctx, "embedding") != DT_OK)
        return NULL;
    if (bad >= 0) {
        int32_t v = 0;
        BE(ctx)->to_host(BEI(ctx), &v, IP(idx) + bad, sizeof v);
        set_error(ctx, DT_EINVAL, "embedding: index %d at position %lld is outside [0, %lld)",
                  (int)v, (long long)bad, (long long)weight->shape[0]);
        return NULL;
    }
    int64_t shape[DT_MAX_DIMS];
    memcpy(shape, idx->shape, sizeof(int64_t) * (size_t)idx->ndim);
    shape[idx->ndim] = d;
    dt_tensor *y = step_tensor(ctx, DT_F32, idx->ndim + 1, shape);
    if (!y)
        return NULL;
    BE(ctx)->embedding_forward(BEI(ctx), n, d, FP(weight), IP(idx), FP(y));
    if (tracks(ctx, weight) && !record(ctx, "embedding", embedding_backward, y, weight, idx, NULL))
        return NULL;
    return y;
}

static dt_status layer_norm_backward(dt_ctx *ctx, dt_node *n)
{
    dt_tensor *x = n->in[0], *w = n->aux[2], *b = n->aux[3];
    int64_t rows = n->iarg[0], d = n->iarg[1];
    int acc = 0;
    float *gx = needs_grad(x) ? grad_target(ctx, x, &acc) : temp_floats(ctx, rows * d);
    float *gw = w && needs_grad(w) ? grad_target_zeroed(ctx, w) : NULL;
    float *gb = b && needs_grad(b) ? grad_target_zeroed(ctx, b) : NULL;
    if (!gx || (w && needs_grad(w) && !gw) || (b && needs_grad(b) && !gb))
        return ctx->last_status;
    BE(ctx)->layernorm_backward(BEI(ctx), rows, d, FP(x), w ? FP(w) : NULL, n->aux[0], n->aux[1],
                                FP(n->out->grad), gx, gw, gb, acc);
    return DT_OK;
}

/* x (..., D), w (D), b (D) -> (..., D) normalised over the last dim */
dt_tensor *dt_layer_norm(dt_ctx *ctx, dt_tensor *x, dt_tensor *w, dt_tensor *b, float eps)
{
    if (!f32_ok(ctx, "layer_norm", x, "input") || (w && !f32_ok(ctx, "layer_norm", w, "weight")) ||
        (b && !f32_ok(ctx, "layer_norm", b, "bias")))
        return NULL;
    char sx[96];
    if (x->ndim < 1 || x->shape[x->ndim - 1] == 0) {
        set_error(ctx, DT_EINVAL, "layer_norm: input %s needs a non-empty last dim", SHAPE(x, sx));
        return NULL;
    }
    int64_t d = x->shape[x->ndim - 1], rows = shape_numel(x->ndim - 1, x->shape);
    if ((w && (w->ndim != 1 || w->shape[0] != d)) || (b && (b->ndim != 1 || b->shape[0] != d))) {
        set_error(ctx, DT_EINVAL, "layer_norm: weight and bias must be (%lld) for input %s",
                  (long long)d, SHAPE(x, sx));
        return NULL;
    }
    if (!(x = need_contig(ctx, x)) || (w && !(w = need_contig(ctx, w))) ||
        (b && !(b = need_contig(ctx, b))))
        return NULL;
    materialize(x);
    materialize(w);
    materialize(b);
    dt_tensor *y = like(ctx, x);
    float *mean = y ? temp_floats(ctx, rows) : NULL, *rstd = mean ? temp_floats(ctx, rows) : NULL;
    if (!rstd)
        return NULL;
    BE(ctx)->layernorm_forward(BEI(ctx), rows, d, FP(x), w ? FP(w) : NULL, b ? FP(b) : NULL, eps,
                               FP(y), mean, rstd);
    if (tracks(ctx, x) || tracks(ctx, w) || tracks(ctx, b)) {
        dt_node *n = record(ctx, "layer_norm", layer_norm_backward, y, x, w, b);
        if (!n)
            return NULL;
        n->iarg[0] = rows;
        n->iarg[1] = d;
        n->aux[0] = mean;
        n->aux[1] = rstd;
        n->aux[2] = w;
        n->aux[3] = b;
    }
    return y;
}

static dt_status dropout_backward(dt_ctx *ctx, dt_node *n)
{
    dt_tensor *x = n->in[0];
    int64_t cnt = shape_numel(x->ndim, x->shape), shape[1] = {cnt}, s1[1] = {1};
    int acc;
    float *gx = grad_target(ctx, x, &acc);
    if (!gx)
        return ctx->last_status;
    float *dst = acc ? temp_floats(ctx, cnt) : gx;
    if (!dst)
        return ctx->last_status;
    BE(ctx)->binary(BEI(ctx), DT_BIN_MUL, 1, shape, FP(n->out->grad), s1, n->aux[0], s1, dst);
    if (acc)
        BE(ctx)->axpby(BEI(ctx), cnt, 1.0f, dst, 1.0f, gx);
    return DT_OK;
}

/* x -> x * mask / (1-p) while training; x itself otherwise */
dt_tensor *dt_dropout(dt_ctx *ctx, dt_tensor *x, float p)
{
    if (!f32_ok(ctx, "dropout", x, "input"))
        return NULL;
    if (!(p >= 0.0f && p < 1.0f)) {
        set_error(ctx, DT_EINVAL, "dropout: p = %g must be in [0, 1)", (double)p);
        return NULL;
    }
    if (!ctx->training || p == 0.0f)
        return x;
    if (!(x = need_contig(ctx, x)))
        return NULL;
    materialize(x);
    uint64_t sm = ctx->seed ^ 0xD1B54A32D192ED03ull;
    sm += 0x9E3779B97F4A7C15ull * (ctx->dropout_counter++ + 1);
    uint64_t seed = splitmix64(&sm);
    int64_t cnt = shape_numel(x->ndim, x->shape);
    dt_tensor *y = like(ctx, x);
    float *mask = y ? temp_floats(ctx, cnt) : NULL;
    if (!mask)
        return NULL;
    BE(ctx)->dropout_forward(BEI(ctx), cnt, p, seed, FP(x), FP(y), mask);
    if (tracks(ctx, x)) {
        dt_node *n = record(ctx, "dropout", dropout_backward, y, x, NULL, NULL);
        if (!n)
            return NULL;
        n->aux[0] = mask;
    }
    return y;
}

/* ===========================================================================
 * 8. Activation checkpointing (recompute)
 *
 * The segment runs once with grad off and its intermediates in a scratch
 * arena that is emptied right after; only the output is copied to the step
 * arena.  Backward runs the segment again with grad on (the same dropout
 * masks, from the saved counter), back-propagates through that sub-tape, and
 * empties the scratch arena again.  Peak memory drops by the segment's
 * activations; the cost is one more forward of the segment.
 * ======================================================================== */

typedef struct arena_switch {
    dt_arena *dev, *host;
    dt_arena_mark dev_mark, host_mark;
} arena_switch;

static arena_switch enter_scratch(dt_ctx *ctx)
{
    arena_switch sw = {ctx->cur_dev, ctx->cur_host, arena_mark(&ctx->scratch_dev),
                       arena_mark(&ctx->scratch_host)};
    ctx->cur_dev = &ctx->scratch_dev;
    ctx->cur_host = &ctx->scratch_host;
    return sw;
}

static void leave_scratch(dt_ctx *ctx, arena_switch sw, int release)
{
    ctx->cur_dev = sw.dev;
    ctx->cur_host = sw.host;
    if (release) {
        arena_release(&ctx->scratch_dev, sw.dev_mark);
        arena_release(&ctx->scratch_host, sw.host_mark);
    }
}

static dt_status recompute_backward(dt_ctx *ctx, dt_node *nd)
{
    dt_tensor **orig = nd->aux[0], *y = nd->out;
    int n = (int)nd->iarg[0];
    arena_switch sw = enter_scratch(ctx);
    dt_node *saved_tape = ctx->tape;
    uint64_t saved_counter = ctx->dropout_counter;
    int saved_grad = ctx->grad_enabled;
    dt_status s = DT_OK;
    dt_tensor **leaf = arena_alloc(ctx, ctx->cur_host, sizeof(dt_tensor *) * (size_t)(n ? n : 1));
    if (!leaf) {
        s = set_error(ctx, DT_ENOMEM, "recompute: out of memory");
        goto done;
    }
    for (int i = 0; i < n; i++) {
        /* leaves sharing the inputs' data, so the sub-tape stops at them */
        if (!(leaf[i] = view_header(ctx, orig[i]))) {
            s = ctx->last_status;
            goto done;
        }
        if (needs_grad(orig[i]))
            leaf[i]->flags |= T_REQGRAD;
    }
    ctx->tape = NULL;
    ctx->dropout_counter = (uint64_t)nd->iarg[1];
    ctx->grad_enabled = 1;
    ctx->in_recompute = 1;
    dt_precision saved_prec = ctx->autocast;   /* rerun as the forward ran */
    ctx->autocast = nd->prec;
    dt_tensor *y2 = nd->seg_fn(ctx, leaf, n, nd->user);
    ctx->autocast = saved_prec;
    ctx->in_recompute = 0;
    ctx->grad_enabled = saved_grad;
    ctx->dropout_counter = saved_counter;
    if (!y2 || y2->ndim != y->ndim || memcmp(y2->shape, y->shape, sizeof(int64_t) * (size_t)y->ndim)) {
        s = y2 ? set_error(ctx, DT_ESTATE, "recompute: the segment returned a different shape "
                                           "when run again (it must be deterministic)")
               : ctx->last_status;
        goto done;
    }
    y2->grad = y->grad;                    /* seed with the segment output's gradient */
    s = run_tape(ctx, ctx->tape, NULL, NULL);
    ctx->cur_dev = sw.dev;                 /* input gradients go to the step arena */
    ctx->cur_host = sw.host;
    for (int i = 0; s == DT_OK && i < n; i++) {
        dt_tensor *g = leaf[i]->grad;
        if (needs_grad(orig[i]) && g && !(g->flags & T_ZERO) && leaf[i] != y2)
            s = acc_grad(ctx, orig[i], FP(g), 1.0f);
        else if (needs_grad(orig[i]) && leaf[i] == y2)
            s = acc_grad(ctx, orig[i], FP(y->grad), 1.0f);
    }
done:
    ctx->tape = saved_tape;
    leave_scratch(ctx, sw, 1);
    return s;
}

dt_tensor *dt_recompute(dt_ctx *ctx, dt_segment_fn fn, dt_tensor *const *inputs, int n, void *user)
{
    if (!ctx_ok(ctx))
        return NULL;
    if (!fn || n < 0 || (n > 0 && !inputs)) {
        set_error(ctx, DT_EINVAL, "recompute: needs a function and %d inputs", n);
        return NULL;
    }
    if (!ctx->grad_enabled || ctx->in_recompute) {
        dt_tensor *y = fn(ctx, inputs, n, user);
        if (!y && ctx->last_status == DT_OK)
            set_error(ctx, DT_EINVAL, "recompute: the segment function returned NULL");
        return y;
    }
    int track = 0;
    for (int i = 0; i < n; i++) {
        if (!input_ok(ctx, "recompute", inputs[i], "an input"))
            return NULL;
        track |= tracks(ctx, inputs[i]);
    }
    uint64_t counter = ctx->dropout_counter;
    dt_precision prec = ctx->autocast;   /* the rerun starts as this run did */
    arena_switch sw = enter_scratch(ctx);
    ctx->grad_enabled = 0;
    dt_tensor *out = fn(ctx, inputs, n, user);
    ctx->grad_enabled = 1;
    ctx->cur_dev = sw.dev;
    ctx->cur_host = sw.host;
    if (!out && ctx->last_status == DT_OK)
        set_error(ctx, DT_EINVAL, "recompute: the segment function returned NULL");
    dt_tensor *y = out ? like(ctx, out) : NULL;
    if (y)
        BE(ctx)->copy_strided(BEI(ctx), out->ndim, out->shape, dt_dtype_size(out->dtype), y->data,
                              y->stride, out->data, out->stride, 0);
    leave_scratch(ctx, sw, 1);
    if (!y || y->dtype != DT_F32)
        return y;
    (void)track;   /* parameters inside fn may need grads even if no input does */
    dt_node *nd = record(ctx, "recompute", recompute_backward, y, NULL, NULL, NULL);
    dt_tensor **saved = arena_alloc(ctx, ctx->cur_host, sizeof(dt_tensor *) * (size_t)(n ? n : 1));
    if (!nd || !saved) {
        set_error(ctx, DT_ENOMEM, "recompute: out of memory for the tape");
        return NULL;
    }
    if (n)
        memcpy(saved, inputs, sizeof(dt_tensor *) * (size_t)n);
    nd->aux[0] = saved;
    nd->iarg[0] = n;
    nd->iarg[1] = (int64_t)counter;
    nd->prec = prec;
    nd->seg_fn = fn;
    nd->user = user;
    return y;
}

/* ===========================================================================
 * 9. Optimizers, schedules, gradient clipping
 *
 * Updates follow torch.optim exactly (the backend kernels implement the
 * formulas).  State tensors are named after their parameter so checkpoints
 * can store them.  A parameter whose gradient is still logically zero since
 * the last zero_grad got no gradient this step and is skipped, as PyTorch
 * skips parameters whose .grad is None.
 * ======================================================================== */

struct dt_optim {
    dt_ctx *ctx;
    dt_optim_config cfg;
    int n, per;                 /* parameters, state tensors per parameter */
    dt_tensor **params;
    dt_tensor **state;          /* n * per */
    int64_t *param_steps;       /* updates each parameter received */
    int64_t steps;
    float base_lr, lr;
    int has_sched;
    dt_schedule sched;
    int momentum_by_ddp;        /* top-k DDP applies SGD's momentum before sparsifying
                                   (momentum correction, 16.1); the step must not again */
};

void dt_optim_config_init(dt_optim_config *cfg, dt_optim_kind kind)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->kind = kind;
    cfg->lr = kind == DT_SGD || kind == DT_ADAGRAD ? 0.01f : 1e-3f;   /* torch's defaults */
    cfg->beta1 = 0.9f;
    cfg->beta2 = 0.999f;
    cfg->eps = kind == DT_ADAGRAD ? 1e-10f : 1e-8f;
    cfg->weight_decay = kind == DT_ADAMW ? 0.01f : 0.0f;
}

static dt_status check_optim_config(dt_ctx *ctx, const dt_optim_config *c)
{
    if (c->kind != DT_SGD && c->kind != DT_ADAM && c->kind != DT_ADAMW && c->kind != DT_ADAGRAD)
        return set_error(ctx, DT_EINVAL, "optim: unknown kind %d", (int)c->kind);
    if (!(c->lr >= 0) || !(c->weight_decay >= 0))
        return set_error(ctx, DT_EINVAL, "optim: lr (%g) and weight_decay (%g) must be >= 0",
                         (double)c->lr, (double)c->weight_decay);
    if (c->kind == DT_SGD) {
        if (!(c->momentum >= 0) || !(c->dampening >= 0 && c->dampening <= 1))
            return set_error(ctx, DT_EINVAL, "optim: sgd momentum %g / dampening %g out of range",
                             (double)c->momentum, (double)c->dampening);
        if (c->nesterov && (c->momentum <= 0 || c->dampening != 0))
            return set_error(ctx, DT_EINVAL, "optim: nesterov needs momentum > 0 and dampening 0");
        return DT_OK;
    }
    if (c->kind == DT_ADAGRAD) {
        if (!(c->eps >= 0))
            return set_error(ctx, DT_EINVAL, "optim: adagrad eps %g must be >= 0", (double)c->eps);
        if (!BE(ctx)->adagrad_update)
            return set_error(ctx, DT_ENOTSUP, "optim: the %s backend has no AdaGrad",
                             ctx->be_iface->name);
        return DT_OK;
    }
    if (!(c->beta1 >= 0 && c->beta1 < 1) || !(c->beta2 >= 0 && c->beta2 < 1) || !(c->eps >= 0))
        return set_error(ctx, DT_EINVAL, "optim: adam betas (%g, %g) must be in [0,1), eps >= 0",
                         (double)c->beta1, (double)c->beta2);
    return DT_OK;
}

/* A persistent tensor owned by an object other than the context. */
static dt_tensor *owned_tensor(dt_ctx *ctx, int ndim, const int64_t *shape, const char *name,
                               const char *suffix)
{
    dt_tensor *t = host_alloc(ctx, sizeof *t);
    if (!t)
        return NULL;
    header_init(t, ctx, DT_F32, ndim, shape);
    size_t bytes = tensor_bytes(t), nl = strlen(name) + strlen(suffix) + 1;
    t->data = ctx->be_iface->alloc(ctx->be, bytes ? bytes : DT_ARENA_ALIGN);
    t->name = host_alloc(ctx, nl);
    if (!t->data || !t->name) {
        if (t->data)
            ctx->be_iface->free(ctx->be, t->data);
        host_free(ctx, t->name);
        host_free(ctx, t);
        return NULL;
    }
    snprintf(t->name, nl, "%s%s", name, suffix);
    ctx->be_iface->memset0(ctx->be, t->data, bytes);
    t->flags = T_OWNS_DATA | T_EXTERNAL;
    ctx->persistent_bytes += bytes;
    return t;
}

dt_optim *dt_optim_new(dt_ctx *ctx, const dt_optim_config *cfg, dt_tensor *const *params, int n)
{
    if (!ctx_ok(ctx))
        return NULL;
    if (!cfg) {
        set_error(ctx, DT_EINVAL, "optim_new: config is NULL");
        return NULL;
    }
    if (check_optim_config(ctx, cfg) != DT_OK)
        return NULL;
    dt_tensor *const *src = params ? params : ctx->params;
    int count = params ? n : ctx->n_params;
    if (count < 0 || (params && n < 1)) {
        set_error(ctx, DT_EINVAL, "optim_new: %d parameters", n);
        return NULL;
    }
    for (int i = 0; i < count; i++) {
        if (!src[i] || src[i]->ctx != ctx || !(src[i]->flags & T_PARAM)) {
            set_error(ctx, DT_EINVAL, "optim_new: entry %d is not a parameter of this context", i);
            return NULL;
        }
    }
    dt_optim *o = host_calloc(ctx, sizeof *o);
    if (!o) {
        set_error(ctx, DT_ENOMEM, "optim_new: out of memory");
        return NULL;
    }
    o->ctx = ctx;
    o->cfg = *cfg;
    o->n = count;
    o->per = cfg->kind == DT_SGD ? (cfg->momentum != 0.0f) : cfg->kind == DT_ADAGRAD ? 1 : 2;
    o->base_lr = o->lr = cfg->lr;
    o->params = host_calloc(ctx, sizeof(dt_tensor *) * (size_t)(count ? count : 1));
    o->state = host_calloc(ctx, sizeof(dt_tensor *) * (size_t)(count * o->per + 1));
    o->param_steps = host_calloc(ctx, sizeof(int64_t) * (size_t)(count ? count : 1));
    if (!o->params || !o->state || !o->param_steps)
        goto fail;
    static const char *const suffix[3][2] = {{".momentum_buffer", ""}, {".exp_avg", ".exp_avg_sq"},
                                             {".sum", ""}};   /* torch's state names */
    for (int i = 0; i < count; i++) {
        o->params[i] = src[i];
        for (int j = 0; j < o->per; j++) {
            dt_tensor *p = src[i];
            dt_tensor *st = owned_tensor(ctx, p->ndim, p->shape, p->name,
                                         suffix[cfg->kind == DT_SGD ? 0 : cfg->kind == DT_ADAGRAD
                                                                               ? 2 : 1][j]);
            if (!st)
                goto fail;
            o->state[i * o->per + j] = st;
        }
    }
    return o;
fail:
    dt_optim_free(o);
    set_error(ctx, DT_ENOMEM, "optim_new: out of memory for optimizer state");
    return NULL;
}

void dt_optim_free(dt_optim *o)
{
    if (!o)
        return;
    dt_ctx *ctx = o->ctx;
    if (o->state)
        for (int i = 0; i < o->n * o->per; i++)
            if (o->state[i])
                tensor_destroy(ctx, o->state[i]);
    host_free(ctx, o->state);
    host_free(ctx, o->params);
    host_free(ctx, o->param_steps);
    if (ctx->ddp)
        ddp_forget_optim(ctx->ddp, o);
    host_free(ctx, o);
}

float dt_schedule_lr(const dt_schedule *s, float base, int64_t step)
{
    if (!s || step < 0)
        return base;
    switch (s->kind) {
    case DT_SCHED_STEP:
        if (s->step_size <= 0)
            return base;
        return base * powf(s->gamma, (float)(step / s->step_size));
    case DT_SCHED_COSINE: {
        if (step < s->warmup_steps)
            return base * (float)(step + 1) / (float)s->warmup_steps;
        int64_t span = s->total_steps - s->warmup_steps;
        double q = span > 0 ? (double)(step - s->warmup_steps) / (double)span : 1.0;
        if (q > 1)
            q = 1;
        return (float)(s->min_lr + (base - s->min_lr) * 0.5 * (1.0 + cos(M_PI * q)));
    }
    case DT_SCHED_CONSTANT:
        break;
    }
    return base;
}

dt_status dt_optim_set_schedule(dt_optim *o, const dt_schedule *s)
{
    if (!o)
        return DT_EINVAL;
    if (!s)
        return set_error(o->ctx, DT_EINVAL, "optim_set_schedule: schedule is NULL");
    if (s->kind == DT_SCHED_STEP && (s->step_size <= 0 || !(s->gamma > 0)))
        return set_error(o->ctx, DT_EINVAL, "optim_set_schedule: step schedule needs step_size > 0 "
                                            "and gamma > 0");
    /* total_steps 0 would train at min_lr from the first step: silently nothing */
    if (s->kind == DT_SCHED_COSINE &&
        (s->warmup_steps < 0 || s->total_steps <= 0 || s->total_steps < s->warmup_steps))
        return set_error(o->ctx, DT_EINVAL, "optim_set_schedule: cosine needs total_steps > 0 "
                                            "and 0 <= warmup_steps <= total_steps");
    if (s->kind < DT_SCHED_CONSTANT || s->kind > DT_SCHED_COSINE)
        return set_error(o->ctx, DT_EINVAL, "optim_set_schedule: unknown kind %d", (int)s->kind);
    o->sched = *s;
    o->has_sched = 1;
    o->base_lr = o->lr;
    return DT_OK;
}

static dt_status optim_step_run(dt_optim *o);

dt_status dt_optim_step(dt_optim *o)
{
    if (!o)
        return DT_EINVAL;
    double t0 = prof_begin(o->ctx);
    dt_status s = optim_step_run(o);
    if (s == DT_OK)
        s = be_fault(o->ctx, "optim_step");
    prof_end(o->ctx, PH_OPTIM, t0);
    return s;
}

static dt_status optim_step_run(dt_optim *o)
{
    dt_ctx *ctx = o->ctx;
    if (o->has_sched)
        o->lr = dt_schedule_lr(&o->sched, o->base_lr, o->steps);
    o->steps++;
    const dt_optim_config *c = &o->cfg;
    for (int i = 0; i < o->n; i++) {
        dt_tensor *p = o->params[i], *g = p->grad;
        if (!g || (g->flags & T_ZERO))
            continue;
        int64_t cnt = shape_numel(p->ndim, p->shape);
        int64_t t = ++o->param_steps[i];
        if (c->kind == DT_SGD) {
            float *buf = o->per ? FP(o->state[i]) : NULL;
            BE(ctx)->sgd_update(BEI(ctx), cnt, FP(p), FP(g), buf, o->lr,
                                o->momentum_by_ddp ? 0.0f : c->momentum, c->dampening,
                                c->nesterov, c->weight_decay, t == 1);
        } else if (c->kind == DT_ADAGRAD) {
            BE(ctx)->adagrad_update(BEI(ctx), cnt, FP(p), FP(g), FP(o->state[i]), o->lr, c->eps,
                                    c->weight_decay);
        } else {
            float bc1 = 1.0f - powf(c->beta1, (float)t), bc2 = 1.0f - powf(c->beta2, (float)t);
            BE(ctx)->adam_update(BEI(ctx), cnt, FP(p), FP(g), FP(o->state[2 * i]),
                                 FP(o->state[2 * i + 1]), o->lr, c->beta1, c->beta2, c->eps,
                                 c->weight_decay, c->kind == DT_ADAMW, bc1, bc2);
        }
    }
    return DT_OK;
}

void dt_optim_zero_grad(dt_optim *o)
{
    if (!o)
        return;
    for (int i = 0; i < o->n; i++)
        if (o->params[i]->grad)
            o->params[i]->grad->flags |= T_ZERO;
    o->ctx->zero_gen++;
}

float dt_optim_lr(const dt_optim *o) { return o ? o->lr : 0.0f; }
int64_t dt_optim_steps(const dt_optim *o) { return o ? o->steps : 0; }
int dt_optim_state_count(const dt_optim *o) { return o ? o->n * o->per : 0; }

dt_tensor *dt_optim_state_at(const dt_optim *o, int i)
{
    return o && i >= 0 && i < o->n * o->per ? o->state[i] : NULL;
}

dt_status dt_optim_set_lr(dt_optim *o, float lr)
{
    if (!o)
        return DT_EINVAL;
    if (!(lr >= 0))
        return set_error(o->ctx, DT_EINVAL, "optim_set_lr: lr %g must be >= 0", (double)lr);
    o->lr = o->base_lr = lr;
    return DT_OK;
}

dt_status dt_clip_grad_norm(dt_ctx *ctx, float max_norm, float *norm_out)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (!(max_norm > 0))
        return set_error(ctx, DT_EINVAL, "clip_grad_norm: max_norm %g must be > 0", (double)max_norm);
    double total = 0;
    for (int i = 0; i < ctx->n_params; i++) {
        dt_tensor *g = ctx->params[i]->grad;
        if (g && !(g->flags & T_ZERO))
            total += BE(ctx)->sumsq(BEI(ctx), shape_numel(g->ndim, g->shape), FP(g));
    }
    dt_status fs = be_fault(ctx, "clip_grad_norm");
    if (fs != DT_OK)
        return fs;
    double norm = sqrt(total);
    if (norm_out)
        *norm_out = (float)norm;
    double coef = max_norm / (norm + 1e-6);
    if (coef < 1.0) {
        for (int i = 0; i < ctx->n_params; i++) {
            dt_tensor *g = ctx->params[i]->grad;
            if (g && !(g->flags & T_ZERO))
                BE(ctx)->axpby(BEI(ctx), shape_numel(g->ndim, g->shape), (float)coef, FP(g), 0.0f,
                               FP(g));
        }
    }
    return DT_OK;
}

/* --- 9.1 dynamic loss scaling (fp16) --------------------------------------
 * As torch.cuda.amp.GradScaler.  The check for inf/NaN is the sum of
 * squares the backend already has (in double, so no finite f32 gradient
 * can overflow it; an inf or NaN anywhere makes it non-finite). */

struct dt_loss_scaler {
    dt_ctx *ctx;
    dt_loss_scale_config cfg;
    float scale;
    int good_steps;            /* in a row since the last overflow or growth */
    int pending;               /* a scaled backward ran since the last step */
    int unscaled, found_inf;   /* this step's gradients were divided by scale */
    int64_t skipped;
};

void dt_loss_scale_config_init(dt_loss_scale_config *cfg)
{
    if (!cfg)
        return;
    cfg->init_scale = 65536.0f;
    cfg->growth_factor = 2.0f;
    cfg->backoff_factor = 0.5f;
    cfg->growth_interval = 2000;
}

dt_loss_scaler *dt_loss_scaler_new(dt_ctx *ctx, const dt_loss_scale_config *cfg)
{
    if (!ctx_ok(ctx))
        return NULL;
    dt_loss_scale_config c;
    dt_loss_scale_config_init(&c);
    if (cfg)
        c = *cfg;
    if (!(c.init_scale > 0) || !isfinite(c.init_scale) || !(c.growth_factor >= 1) ||
        !(c.backoff_factor > 0 && c.backoff_factor < 1) || c.growth_interval < 1) {
        set_error(ctx, DT_EINVAL, "loss_scaler: init_scale %g, growth %g, backoff %g, interval %d: "
                  "need scale > 0, growth >= 1, 0 < backoff < 1, interval >= 1",
                  (double)c.init_scale, (double)c.growth_factor, (double)c.backoff_factor,
                  c.growth_interval);
        return NULL;
    }
    dt_loss_scaler *sc = host_calloc(ctx, sizeof *sc);
    if (!sc) {
        set_error(ctx, DT_ENOMEM, "loss_scaler: out of memory");
        return NULL;
    }
    sc->ctx = ctx;
    sc->cfg = c;
    sc->scale = c.init_scale;
    return sc;
}

void dt_loss_scaler_free(dt_loss_scaler *sc)
{
    if (sc)
        host_free(sc->ctx, sc);
}

float dt_loss_scaler_scale(const dt_loss_scaler *sc) { return sc ? sc->scale : NAN; }
int64_t dt_loss_scaler_skipped(const dt_loss_scaler *sc) { return sc ? sc->skipped : -1; }

dt_status dt_loss_scaler_backward(dt_loss_scaler *sc, dt_tensor *loss)
{
    if (!sc || !ctx_ok(sc->ctx))
        return DT_EINVAL;
    if (sc->unscaled)
        return set_error(sc->ctx, DT_ESTATE, "loss_scaler_backward: this step's gradients are "
                         "already unscaled; step first (scaled ones would be added to them)");
    dt_status s = sc->ctx->ddp ? ddp_for_scaler(sc->ctx->ddp, 0) : DT_OK;
    if (s != DT_OK)
        return s;
    if ((s = backward_seeded(sc->ctx, loss, sc->scale)) == DT_OK)
        sc->pending = 1;
    return s;
}

dt_status dt_loss_scaler_unscale(dt_loss_scaler *sc, int *found_inf)
{
    if (!sc || !ctx_ok(sc->ctx))
        return DT_EINVAL;
    dt_ctx *ctx = sc->ctx;
    if (!sc->pending)
        return set_error(ctx, DT_ESTATE, "loss_scaler: no dt_loss_scaler_backward since the last "
                         "step");
    dt_status s = ctx->ddp ? ddp_for_scaler(ctx->ddp, 1) : DT_OK;   /* reduced first */
    if (s != DT_OK)
        return s;
    if (!sc->unscaled) {
        double total = 0;
        for (int i = 0; i < ctx->n_params; i++) {
            dt_tensor *g = ctx->params[i]->grad;
            if (!g || (g->flags & T_ZERO))
                continue;
            int64_t n = shape_numel(g->ndim, g->shape);
            BE(ctx)->axpby(BEI(ctx), n, 1.0f / sc->scale, FP(g), 0.0f, FP(g));
            total += BE(ctx)->sumsq(BEI(ctx), n, FP(g));
        }
        dt_status fs = be_fault(ctx, "loss_scaler");
        if (fs != DT_OK)
            return fs;
        sc->found_inf = !isfinite(total);
        sc->unscaled = 1;
    }
    if (found_inf)
        *found_inf = sc->found_inf;
    return DT_OK;
}

dt_status dt_loss_scaler_step(dt_loss_scaler *sc, dt_optim *opt, int *stepped)
{
    if (stepped)
        *stepped = 0;
    if (!sc || !ctx_ok(sc->ctx))
        return DT_EINVAL;
    if (!opt || opt->ctx != sc->ctx)
        return set_error(sc->ctx, DT_EINVAL, "loss_scaler_step: %s",
                         opt ? "the optimizer belongs to another context" : "optimizer is NULL");
    int inf;
    dt_status s = dt_loss_scaler_unscale(sc, &inf);
    if (s != DT_OK)
        return s;
    sc->unscaled = sc->pending = 0;
    if (inf) {   /* skip: these gradients are garbage; a smaller scale next time */
        sc->scale *= sc->cfg.backoff_factor;
        sc->good_steps = 0;
        sc->skipped++;
        return DT_OK;
    }
    if ((s = dt_optim_step(opt)) != DT_OK)
        return s;
    if (stepped)
        *stepped = 1;
    if (++sc->good_steps >= sc->cfg.growth_interval) {
        float grown = sc->scale * sc->cfg.growth_factor;
        if (isfinite(grown))
            sc->scale = grown;
        sc->good_steps = 0;
    }
    return DT_OK;
}

/* ===========================================================================
 * 10. Checkpoints (safetensors)
 *
 * Layout: 8-byte little-endian header length, a JSON header mapping each
 * tensor name to {"dtype","shape","data_offsets"} plus "__metadata__"
 * (string values only), padded with spaces to 8 bytes, then the raw
 * little-endian data in header order.  Parameters keep their names;
 * optimizer state is stored as "optim.<param>.<state>".  Loading reads and
 * checks the whole file before it copies anything into the model.
 * ======================================================================== */

#define DT_CKPT_MAX_HEADER ((uint64_t)100 << 20)   /* safetensors' own limit */
#define DT_CKPT_MAX_FILE ((uint64_t)1 << 40)
#define DT_JSON_MAX_DEPTH 8

typedef struct strbuf {
    dt_ctx *ctx;
    char *p;
    size_t len, cap;
    int oom;
} strbuf;

/* Room for n more bytes and the NUL; 0 when out of memory. */
static int sb_reserve(strbuf *b, size_t n)
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

static void sb_putn(strbuf *b, const char *s, size_t n)
{
    if (!sb_reserve(b, n))
        return;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void sb_puts(strbuf *b, const char *s) { sb_putn(b, s, strlen(s)); }

static void sb_printf(strbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(strbuf *b, const char *fmt, ...)
{
    va_list ap, again;
    va_start(ap, fmt);
    va_copy(again, ap);
    int n = vsnprintf(NULL, 0, fmt, ap);   /* the length, then the text in place */
    if (n > 0 && sb_reserve(b, (size_t)n)) {
        vsnprintf(b->p + b->len, (size_t)n + 1, fmt, again);
        b->len += (size_t)n;
    }
    va_end(again);
    va_end(ap);
}

static void sb_json_string(strbuf *b, const char *s)
{
    sb_puts(b, "\"");
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\') {
            char e[3] = {'\\', (char)ch, 0};
            sb_puts(b, e);
        } else if (ch < 0x20) {
            sb_printf(b, "\\u%04x", ch);
        } else {
            sb_putn(b, s, 1);
        }
    }
    sb_puts(b, "\"");
}

typedef struct ckpt_item {
    const char *name;    /* safetensors key */
    dt_tensor *t;
} ckpt_item;

static int ckpt_items(dt_ctx *ctx, const dt_optim *opt, ckpt_item *items, char **names)
{
    int n = 0;
    for (int i = 0; i < ctx->n_params; i++)
        items[n++] = (ckpt_item){ctx->params[i]->name, ctx->params[i]};
    for (int i = 0; i < ctx->n_ckpt_extra; i++)
        items[n++] = (ckpt_item){ctx->ckpt_extra[i]->name, ctx->ckpt_extra[i]};
    if (opt) {
        for (int i = 0; i < opt->n * opt->per; i++) {
            size_t len = strlen(opt->state[i]->name) + 7;
            names[i] = host_alloc(ctx, len);
            if (!names[i])
                return -1;
            snprintf(names[i], len, "optim.%s", opt->state[i]->name);
            items[n++] = (ckpt_item){names[i], opt->state[i]};
        }
    }
    return n;
}

static void ckpt_header(strbuf *b, const dt_optim *opt, int64_t step, const ckpt_item *items, int n)
{
    sb_printf(b, "{\"__metadata__\":{\"format\":\"pt\",\"dtrain.step\":\"%lld\"", (long long)step);
    if (opt) {
        sb_printf(b, ",\"dtrain.optim.kind\":\"%d\",\"dtrain.optim.steps\":\"%lld\","
                     "\"dtrain.optim.lr\":\"%.9g\",\"dtrain.optim.param_steps\":\"",
                  (int)opt->cfg.kind, (long long)opt->steps, (double)opt->base_lr);
        for (int i = 0; i < opt->n; i++)
            sb_printf(b, "%s%lld", i ? "," : "", (long long)opt->param_steps[i]);
        sb_puts(b, "\"");
    }
    sb_puts(b, "}");
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        dt_tensor *t = items[i].t;
        sb_puts(b, ",");
        sb_json_string(b, items[i].name);
        sb_puts(b, ":{\"dtype\":\"F32\",\"shape\":[");
        for (int d = 0; d < t->ndim; d++)
            sb_printf(b, "%s%lld", d ? "," : "", (long long)t->shape[d]);
        uint64_t bytes = tensor_bytes(t);
        sb_printf(b, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off,
                  (unsigned long long)(off + bytes));
        off += bytes;
    }
    sb_puts(b, "}");
    while (!b->oom && b->len % 8)
        sb_puts(b, " ");
}

static dt_status write_all(dt_ctx *ctx, FILE *f, const void *p, size_t n, const char *path)
{
    if (n && fwrite(p, 1, n, f) != n)
        return set_error(ctx, DT_EIO, "checkpoint_save: writing %s: %s", path, strerror(errno));
    return DT_OK;
}

static dt_status ckpt_write(dt_ctx *ctx, FILE *f, const char *tmp, const strbuf *hdr,
                            const ckpt_item *items, int n)
{
    unsigned char len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (unsigned char)((uint64_t)hdr->len >> (8 * i));
    dt_status s = write_all(ctx, f, len8, 8, tmp);
    if (s == DT_OK)
        s = write_all(ctx, f, hdr->p, hdr->len, tmp);
    size_t biggest = 0;
    for (int i = 0; i < n; i++)
        if (tensor_bytes(items[i].t) > biggest)
            biggest = tensor_bytes(items[i].t);
    void *stage = s == DT_OK ? host_alloc(ctx, biggest) : NULL;
    if (s == DT_OK && !stage)
        s = set_error(ctx, DT_ENOMEM, "checkpoint_save: out of memory");
    for (int i = 0; s == DT_OK && i < n; i++) {
        dt_tensor *t = items[i].t;
        materialize(t);
        BE(ctx)->to_host(BEI(ctx), stage, t->data, tensor_bytes(t));  /* f32 LE on x86/arm */
        s = write_all(ctx, f, stage, tensor_bytes(t), tmp);
    }
    host_free(ctx, stage);
    if (s == DT_OK && (fflush(f) != 0 || fsync(fileno(f)) != 0))
        s = set_error(ctx, DT_EIO, "checkpoint_save: syncing %s: %s", tmp, strerror(errno));
    return s;
}

/* Sync the directory so the rename itself survives a crash. */
static void sync_parent_dir(const char *path)
{
    char dir[4096];
    const char *slash = strrchr(path, '/');
    if (!slash)
        snprintf(dir, sizeof dir, ".");
    else
        snprintf(dir, sizeof dir, "%.*s", (int)(slash - path) ? (int)(slash - path) : 1, path);
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
}

dt_status dt_checkpoint_save(dt_ctx *ctx, const dt_optim *opt, const char *path, int64_t step)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (!path || !path[0])
        return set_error(ctx, DT_EINVAL, "checkpoint_save: path is empty");
    if (opt && opt->ctx != ctx)
        return set_error(ctx, DT_EINVAL, "checkpoint_save: optimizer belongs to another context");
    int nstate = opt ? opt->n * opt->per : 0, total = ctx->n_params + ctx->n_ckpt_extra + nstate;
    ckpt_item *items = host_calloc(ctx, sizeof *items * (size_t)(total + 1));
    char **names = host_calloc(ctx, sizeof *names * (size_t)(nstate + 1));
    size_t plen = strlen(path) + 5;
    char *tmp = host_alloc(ctx, plen);
    strbuf hdr = {ctx, NULL, 0, 0, 0};
    FILE *f = NULL;
    dt_status s = DT_OK;
    if (!items || !names || !tmp || ckpt_items(ctx, opt, items, names) < 0) {
        s = set_error(ctx, DT_ENOMEM, "checkpoint_save: out of memory");
        goto done;
    }
    snprintf(tmp, plen, "%s.tmp", path);
    ckpt_header(&hdr, opt, step, items, total);
    if (hdr.oom) {
        s = set_error(ctx, DT_ENOMEM, "checkpoint_save: out of memory for the header");
        goto done;
    }
    if (!(f = fopen(tmp, "wb"))) {
        s = set_error(ctx, DT_EIO, "checkpoint_save: cannot create %s: %s", tmp, strerror(errno));
        goto done;
    }
    s = ckpt_write(ctx, f, tmp, &hdr, items, total);
    if (fclose(f) != 0 && s == DT_OK)
        s = set_error(ctx, DT_EIO, "checkpoint_save: closing %s: %s", tmp, strerror(errno));
    f = NULL;
    if (s == DT_OK && rename(tmp, path) != 0)
        s = set_error(ctx, DT_EIO, "checkpoint_save: renaming %s to %s: %s", tmp, path,
                      strerror(errno));
    if (s == DT_OK)
        sync_parent_dir(path);
    else
        unlink(tmp);
done:
    if (names)
        for (int i = 0; i < nstate; i++)
            host_free(ctx, names[i]);
    host_free(ctx, names);
    host_free(ctx, items);
    host_free(ctx, tmp);
    host_free(ctx, hdr.p);
    return s;
}

/* --- a small strict JSON reader for the safetensors header -------------- */

typedef struct json {
    const char *p, *end;
    int depth;
} json;

typedef struct st_entry {
    char name[DT_MAX_NAME + 16];
    int f32;
    int ndim;
    int64_t shape[DT_MAX_DIMS];
    uint64_t begin, end;
    int used;
} st_entry;

typedef struct st_file {
    st_entry *e;
    int n, cap;
    int64_t step, optim_steps;
    int optim_kind, has_optim;
    float optim_lr;
    char param_steps[4096];
} st_file;

static void js_ws(json *j)
{
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r'))
        j->p++;
}

static int js_char(json *j, char c)
{
    js_ws(j);
    if (j->p < j->end && *j->p == c) {
        j->p++;
        return 1;
    }
    return 0;
}

/* A string into out (truncation is an error); \uXXXX only below 0x80. */
static int js_string(json *j, char *out, size_t cap)
{
    if (!js_char(j, '"'))
        return 0;
    size_t n = 0;
    while (j->p < j->end && *j->p != '"') {
        char c = *j->p++;
        if (c == '\\') {
            if (j->p >= j->end)
                return 0;
            char e = *j->p++;
            switch (e) {
            case '"': case '\\': case '/': c = e; break;
            case 'n': c = '\n'; break;
            case 't': c = '\t'; break;
            case 'r': c = '\r'; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'u': {
                if (j->end - j->p < 4)
                    return 0;
                unsigned v = 0;
                for (int i = 0; i < 4; i++) {
                    char h = *j->p++;
                    v = v * 16 + (unsigned)(h >= '0' && h <= '9' ? h - '0'
                                            : h >= 'a' && h <= 'f' ? h - 'a' + 10
                                            : h >= 'A' && h <= 'F' ? h - 'A' + 10 : 99);
                    if (v > 0xFFFF)
                        return 0;
                }
                if (v >= 0x80 || v == 0)
                    return 0;
                c = (char)v;
                break;
            }
            default: return 0;
            }
        } else if ((unsigned char)c < 0x20) {
            return 0;
        }
        if (n + 1 >= cap)
            return 0;
        out[n++] = c;
    }
    if (j->p >= j->end)
        return 0;
    j->p++;
    out[n] = '\0';
    return 1;
}

static int js_uint(json *j, uint64_t *v)
{
    js_ws(j);
    if (j->p >= j->end || *j->p < '0' || *j->p > '9')
        return 0;
    uint64_t x = 0;
    while (j->p < j->end && *j->p >= '0' && *j->p <= '9') {
        unsigned d = (unsigned)(*j->p++ - '0');
        if (x > (UINT64_MAX - d) / 10)
            return 0;
        x = x * 10 + d;
    }
    *v = x;
    return 1;
}

static int js_skip(json *j)
{
    js_ws(j);
    if (j->p >= j->end || ++j->depth > DT_JSON_MAX_DEPTH)
        return 0;
    int ok = 1;
    char c = *j->p;
    if (c == '"') {
        char tmp[4096];
        ok = js_string(j, tmp, sizeof tmp);
    } else if (c == '{' || c == '[') {
        char close = c == '{' ? '}' : ']';
        j->p++;
        if (!js_char(j, close)) {
            do {
                if (c == '{') {
                    char key[4096];
                    ok = js_string(j, key, sizeof key) && js_char(j, ':');
                }
                ok = ok && js_skip(j);
            } while (ok && js_char(j, ','));
            ok = ok && js_char(j, close);
        }
    } else {
        const char *s = j->p;
        while (j->p < j->end && (strchr("-+.eE", *j->p) || (*j->p >= '0' && *j->p <= '9') ||
                                 (*j->p >= 'a' && *j->p <= 'z')))
            j->p++;
        ok = j->p > s;
    }
    j->depth--;
    return ok;
}

static int st_tensor_entry(json *j, st_entry *e)
{
    int have_dtype = 0, have_shape = 0, have_off = 0;
    if (!js_char(j, '{'))
        return 0;
    if (js_char(j, '}'))
        return 0;
    do {
        char key[64];
        if (!js_string(j, key, sizeof key) || !js_char(j, ':'))
            return 0;
        if (strcmp(key, "dtype") == 0) {
            char dt[16];
            if (!js_string(j, dt, sizeof dt))
                return 0;
            e->f32 = strcmp(dt, "F32") == 0;
            have_dtype = 1;
        } else if (strcmp(key, "shape") == 0) {
            if (!js_char(j, '['))
                return 0;
            e->ndim = 0;
            if (!js_char(j, ']')) {
                do {
                    uint64_t v;
                    if (e->ndim >= DT_MAX_DIMS || !js_uint(j, &v) || v > ((uint64_t)1 << 40))
                        return 0;
                    e->shape[e->ndim++] = (int64_t)v;
                } while (js_char(j, ','));
                if (!js_char(j, ']'))
                    return 0;
            }
            have_shape = 1;
        } else if (strcmp(key, "data_offsets") == 0) {
            if (!js_char(j, '[') || !js_uint(j, &e->begin) || !js_char(j, ',') ||
                !js_uint(j, &e->end) || !js_char(j, ']'))
                return 0;
            have_off = 1;
        } else if (!js_skip(j)) {
            return 0;
        }
    } while (js_char(j, ','));
    return js_char(j, '}') && have_dtype && have_shape && have_off;
}

static int st_metadata(json *j, st_file *f)
{
    if (!js_char(j, '{'))
        return 0;
    if (js_char(j, '}'))
        return 1;
    do {
        char key[128], val[4096];
        if (!js_string(j, key, sizeof key) || !js_char(j, ':') || !js_string(j, val, sizeof val))
            return 0;
        char *endp = NULL;
        if (strcmp(key, "dtrain.step") == 0)
            f->step = strtoll(val, &endp, 10);
        else if (strcmp(key, "dtrain.optim.steps") == 0)
            f->optim_steps = strtoll(val, &endp, 10), f->has_optim = 1;
        else if (strcmp(key, "dtrain.optim.kind") == 0)
            f->optim_kind = (int)strtol(val, &endp, 10);
        else if (strcmp(key, "dtrain.optim.lr") == 0)
            f->optim_lr = strtof(val, &endp);
        else if (strcmp(key, "dtrain.optim.param_steps") == 0)
            snprintf(f->param_steps, sizeof f->param_steps, "%s", val);
        if (endp && *endp)
            return 0;
    } while (js_char(j, ','));
    return js_char(j, '}');
}

static int st_parse(dt_ctx *ctx, const char *hdr, size_t len, st_file *f)
{
    json j = {hdr, hdr + len, 0};
    if (!js_char(&j, '{'))
        return 0;
    if (js_char(&j, '}'))
        goto tail;
    do {
        char key[DT_MAX_NAME + 16];
        if (!js_string(&j, key, sizeof key) || !js_char(&j, ':'))
            return 0;
        if (strcmp(key, "__metadata__") == 0) {
            if (!st_metadata(&j, f))
                return 0;
            continue;
        }
        if (f->n == f->cap) {
            int cap = f->cap ? f->cap * 2 : 32;
            st_entry *e = ctx->al.realloc_fn(f->e, sizeof *e * (size_t)cap, ctx->al.user);
            if (!e)
                return -1;
            f->e = e;
            f->cap = cap;
        }
        st_entry *e = &f->e[f->n];
        memset(e, 0, sizeof *e);
        snprintf(e->name, sizeof e->name, "%s", key);
        if (!st_tensor_entry(&j, e))
            return 0;
        f->n++;
    } while (js_char(&j, ','));
    if (!js_char(&j, '}'))
        return 0;
tail:
    js_ws(&j);
    return j.p == j.end;
}

static st_entry *st_find(st_file *f, const char *name)
{
    for (int i = 0; i < f->n; i++)
        if (strcmp(f->e[i].name, name) == 0)
            return &f->e[i];
    return NULL;
}

/* Read a whole file.  *out is allocated with the context's allocator. */
static dt_status read_file(dt_ctx *ctx, const char *op, const char *path, unsigned char **out,
                           size_t *len)
{
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return set_error(ctx, DT_EIO, "%s: cannot open %s: %s", op, path, strerror(errno));
    dt_status s = DT_OK;
    struct stat st;
    if (fstat(fileno(fp), &st) != 0 || !S_ISREG(st.st_mode)) {
        fclose(fp);
        return set_error(ctx, DT_EIO, "%s: %s is not a regular file", op, path);
    }
    if ((uint64_t)st.st_size > DT_CKPT_MAX_FILE) {
        fclose(fp);
        return set_error(ctx, DT_EIO, "%s: %s is larger than %llu bytes", op, path,
                         (unsigned long long)DT_CKPT_MAX_FILE);
    }
    long size = (long)st.st_size;
    unsigned char *buf = host_alloc(ctx, (size_t)size + 1);
    if (!buf)
        s = set_error(ctx, DT_ENOMEM, "%s: out of memory for %ld bytes", op, size);
    else if (size > 0 && fread(buf, 1, (size_t)size, fp) != (size_t)size)
        s = set_error(ctx, DT_EIO, "%s: reading %s failed", op, path);
    fclose(fp);
    if (s != DT_OK) {
        host_free(ctx, buf);
        return s;
    }
    *out = buf;
    *len = (size_t)size;
    return DT_OK;
}

/* Check one destination tensor against its entry. */
static dt_status st_check(dt_ctx *ctx, st_file *f, const char *key, const dt_tensor *t,
                          uint64_t data_len, const st_entry **out)
{
    st_entry *e = st_find(f, key);
    if (!e)
        return set_error(ctx, DT_EMISMATCH, "checkpoint_load: '%s' is missing from the file", key);
    char sb[96];
    int same = e->ndim == t->ndim;
    for (int d = 0; same && d < e->ndim; d++)
        same = e->shape[d] == t->shape[d];
    if (!e->f32)
        return set_error(ctx, DT_EMISMATCH, "checkpoint_load: '%s' is not F32", key);
    if (!same) {
        char fs[96];
        size_t o = 0;
        o += (size_t)snprintf(fs + o, sizeof fs - o, "(");
        for (int d = 0; d < e->ndim && o < sizeof fs; d++)
            o += (size_t)snprintf(fs + o, sizeof fs - o, "%s%lld", d ? ", " : "",
                                  (long long)e->shape[d]);
        if (o < sizeof fs)
            snprintf(fs + o, sizeof fs - o, ")");
        return set_error(ctx, DT_EMISMATCH, "checkpoint_load: '%s' has shape %s in the file, "
                                            "the model has %s", key, fs, SHAPE(t, sb));
    }
    if (e->end < e->begin || e->end > data_len || e->end - e->begin != tensor_bytes(t))
        return set_error(ctx, DT_ECORRUPT, "checkpoint_load: '%s' has data offsets [%llu, %llu] "
                                           "outside the %llu data bytes or of the wrong size",
                         key, (unsigned long long)e->begin, (unsigned long long)e->end,
                         (unsigned long long)data_len);
    e->used = 1;
    *out = e;
    return DT_OK;
}

static dt_status st_parse_param_steps(dt_ctx *ctx, const st_file *f, int64_t *steps, int n)
{
    const char *p = f->param_steps;
    for (int i = 0; i < n; i++) {
        char *endp;
        errno = 0;
        long long v = strtoll(p, &endp, 10);
        if (endp == p || errno || v < 0 || (*endp != ',' && *endp != '\0') ||
            (i == n - 1 && *endp != '\0'))
            return set_error(ctx, DT_ECORRUPT, "checkpoint_load: bad optimizer step list");
        steps[i] = v;
        p = endp + (*endp == ',');
    }
    return DT_OK;
}

dt_status dt_checkpoint_load(dt_ctx *ctx, dt_optim *opt, const char *path, int64_t *step_out)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (!path)
        return set_error(ctx, DT_EINVAL, "checkpoint_load: path is NULL");
    if (opt && opt->ctx != ctx)
        return set_error(ctx, DT_EINVAL, "checkpoint_load: optimizer belongs to another context");
    unsigned char *buf = NULL;
    size_t len = 0;
    st_file f;
    memset(&f, 0, sizeof f);
    int nstate = opt ? opt->n * opt->per : 0, nx = ctx->n_ckpt_extra;
    int total = ctx->n_params + nx + nstate;
    const st_entry **map = NULL;
    int64_t *psteps = NULL;
    char key[DT_MAX_NAME + 16];
    dt_status s = read_file(ctx, "checkpoint_load", path, &buf, &len);
    if (s != DT_OK)
        return s;
    uint64_t hlen = 0;
    for (int i = 0; i < 8 && len >= 8; i++)
        hlen |= (uint64_t)buf[i] << (8 * i);
    if (len < 8 || hlen > DT_CKPT_MAX_HEADER || hlen > len - 8) {
        s = set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s is truncated or not safetensors "
                      "(%zu bytes, header length %llu)", path, len, (unsigned long long)hlen);
        goto done;
    }
    int pr = st_parse(ctx, (const char *)buf + 8, (size_t)hlen, &f);
    if (pr <= 0) {
        s = pr < 0 ? set_error(ctx, DT_ENOMEM, "checkpoint_load: out of memory")
                   : set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s has a malformed header", path);
        goto done;
    }
    uint64_t data_len = len - 8 - hlen, data_end = 0;
    for (int i = 0; i < f.n; i++) {
        st_entry *e = &f.e[i];
        uint64_t want = e->f32 ? 4 : 0;
        for (int d = 0; d < e->ndim; d++)
            want *= (uint64_t)e->shape[d];
        if (e->end < e->begin || e->end > data_len || (e->f32 && e->end - e->begin != want)) {
            s = set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s: '%s' has data offsets [%llu, "
                          "%llu] outside the %llu data bytes or of the wrong size", path,
                          e->name, (unsigned long long)e->begin, (unsigned long long)e->end,
                          (unsigned long long)data_len);
            goto done;
        }
        if (e->end > data_end)
            data_end = e->end;
    }
    if (data_end != data_len) {
        s = set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s has %llu data bytes, its header "
                      "describes %llu", path, (unsigned long long)data_len,
                      (unsigned long long)data_end);
        goto done;
    }
    map = host_calloc(ctx, sizeof *map * (size_t)(total + 1));
    psteps = host_calloc(ctx, sizeof *psteps * (size_t)(opt ? opt->n + 1 : 1));
    if (!map || !psteps) {
        s = set_error(ctx, DT_ENOMEM, "checkpoint_load: out of memory");
        goto done;
    }
    for (int i = 0; s == DT_OK && i < ctx->n_params; i++)
        s = st_check(ctx, &f, ctx->params[i]->name, ctx->params[i], data_len, &map[i]);
    for (int i = 0; s == DT_OK && i < nx; i++)
        s = st_check(ctx, &f, ctx->ckpt_extra[i]->name, ctx->ckpt_extra[i], data_len,
                     &map[ctx->n_params + i]);
    for (int i = 0; s == DT_OK && i < nstate; i++) {
        snprintf(key, sizeof key, "optim.%s", opt->state[i]->name);
        s = st_check(ctx, &f, key, opt->state[i], data_len, &map[ctx->n_params + nx + i]);
    }
    if (s != DT_OK)
        goto done;
    for (int i = 0; i < f.n; i++) {
        if (!f.e[i].used && strncmp(f.e[i].name, "optim.", 6) != 0) {
            s = set_error(ctx, DT_EMISMATCH, "checkpoint_load: the file has '%s', which is not a "
                                             "parameter of the model", f.e[i].name);
            goto done;
        }
    }
    if (opt) {
        if (!f.has_optim || f.optim_kind != (int)opt->cfg.kind) {
            s = set_error(ctx, DT_EMISMATCH, "checkpoint_load: the file has no state for this "
                                             "kind of optimizer");
            goto done;
        }
        if ((s = st_parse_param_steps(ctx, &f, psteps, opt->n)) != DT_OK)
            goto done;
    }
    /* everything checked: now copy */
    const unsigned char *data = buf + 8 + hlen;
    for (int i = 0; i < total; i++) {
        dt_tensor *t = i < ctx->n_params ? ctx->params[i]
                       : i < ctx->n_params + nx ? ctx->ckpt_extra[i - ctx->n_params]
                                                : opt->state[i - ctx->n_params - nx];
        BE(ctx)->to_device(BEI(ctx), t->data, data + map[i]->begin, tensor_bytes(t));
        t->flags &= ~(unsigned)T_ZERO;
    }
    if (opt) {
        opt->steps = f.optim_steps;
        memcpy(opt->param_steps, psteps, sizeof *psteps * (size_t)opt->n);
        opt->lr = opt->base_lr = f.optim_lr;
    }
    if (step_out)
        *step_out = f.step;
done:
    host_free(ctx, map);
    host_free(ctx, psteps);
    host_free(ctx, f.e);
    host_free(ctx, buf);
    return s;
}

/* ===========================================================================
 * 11. Data: IDX files and the prefetching loader
 *
 * IDX files are read through zlib's gzread, which also reads uncompressed
 * files, so .gz and plain files take one path.  Images stay uint8 (47 MB for
 * Fashion-MNIST's training set instead of 188 MB as floats) and are
 * converted per batch through a 256-entry table.
 *
 * The loader's background thread converts batch k+1 into the spare half of
 * a double buffer while the caller computes on batch k.  On a host-visible
 * backend the halves are the batch tensors themselves (no copy); otherwise
 * the main thread copies the finished half to the device.
 * ======================================================================== */

#define DT_IDX_MAX_BYTES ((uint64_t)1 << 32)   /* refuse absurd headers */

struct dt_dataset {
    dt_ctx *ctx;
    int64_t n, c, h, w;
    uint8_t *images;     /* n * c*h*w */
    uint8_t *labels;     /* n */
    int classes;
};

static dt_status gz_read_all(dt_ctx *ctx, gzFile gz, void *dst, uint64_t n, const char *path)
{
    uint8_t *p = dst;
    while (n > 0) {
        unsigned chunk = n > (1u << 30) ? (1u << 30) : (unsigned)n;
        int got = gzread(gz, p, chunk);
        if (got <= 0 || (unsigned)got != chunk) {
            int zerr = 0;
            const char *msg = gzerror(gz, &zerr);
            return set_error(ctx, DT_ECORRUPT, "dataset: %s is truncated or corrupt (%s)", path,
                             zerr ? msg : "unexpected end of file");
        }
        p += chunk;
        n -= chunk;
    }
    return DT_OK;
}

/* Read an IDX header: magic 0x0000 08 ndim, then ndim big-endian u32 dims. */
static dt_status idx_header(dt_ctx *ctx, gzFile gz, const char *path, int want_ndim,
                            uint64_t *dims)
{
    unsigned char h[4];
    dt_status s = gz_read_all(ctx, gz, h, 4, path);
    if (s != DT_OK)
        return s;
    if (h[0] != 0 || h[1] != 0 || h[2] != 0x08 || h[3] != want_ndim)
        return set_error(ctx, DT_ECORRUPT, "dataset: %s is not a uint8 IDX file with %d dims "
                         "(magic %02x %02x %02x %02x)", path, want_ndim, h[0], h[1], h[2], h[3]);
    uint64_t total = 1;
    for (int i = 0; i < want_ndim; i++) {
        unsigned char d[4];
        if ((s = gz_read_all(ctx, gz, d, 4, path)) != DT_OK)
            return s;
        dims[i] = (uint64_t)d[0] << 24 | (uint64_t)d[1] << 16 | (uint64_t)d[2] << 8 | d[3];
        total *= dims[i] ? dims[i] : 1;
        if (dims[i] == 0 || total > DT_IDX_MAX_BYTES)
            return set_error(ctx, DT_ECORRUPT, "dataset: %s has an impossible dimension %d = %llu",
                             path, i, (unsigned long long)dims[i]);
    }
    return DT_OK;
}

static dt_status idx_load(dt_ctx *ctx, const char *path, int ndim, uint64_t *dims, uint8_t **out)
{
    gzFile gz = gzopen(path, "rb");
    if (!gz)
        return set_error(ctx, DT_EIO, "dataset: cannot open %s: %s", path, strerror(errno));
    dt_status s = idx_header(ctx, gz, path, ndim, dims);
    uint64_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= dims[i];
    uint8_t *buf = NULL;
    if (s == DT_OK && !(buf = host_alloc(ctx, (size_t)n)))
        s = set_error(ctx, DT_ENOMEM, "dataset: out of memory for %s", path);
    if (s == DT_OK)
        s = gz_read_all(ctx, gz, buf, n, path);
    gzclose(gz);
    if (s != DT_OK) {
        host_free(ctx, buf);
        return s;
    }
    *out = buf;
    return DT_OK;
}

dt_dataset *dt_dataset_load_idx(dt_ctx *ctx, const char *images_path, const char *labels_path)
{
    if (!ctx_ok(ctx))
        return NULL;
    if (!images_path || !labels_path) {
        set_error(ctx, DT_EINVAL, "dataset: image and label paths are required");
        return NULL;
    }
    dt_dataset *ds = host_calloc(ctx, sizeof *ds);
    if (!ds) {
        set_error(ctx, DT_ENOMEM, "dataset: out of memory");
        return NULL;
    }
    ds->ctx = ctx;
    uint64_t idim[3], ldim[1];
    if (idx_load(ctx, images_path, 3, idim, &ds->images) != DT_OK ||
        idx_load(ctx, labels_path, 1, ldim, &ds->labels) != DT_OK)
        goto fail;
    if (idim[0] != ldim[0]) {
        set_error(ctx, DT_EMISMATCH, "dataset: %s has %llu images but %s has %llu labels",
                  images_path, (unsigned long long)idim[0], labels_path,
                  (unsigned long long)ldim[0]);
        goto fail;
    }
    ds->n = (int64_t)idim[0];
    ds->c = 1;
    ds->h = (int64_t)idim[1];
    ds->w = (int64_t)idim[2];
    for (int64_t i = 0; i < ds->n; i++)
        if (ds->labels[i] + 1 > ds->classes)
            ds->classes = ds->labels[i] + 1;
    return ds;
fail:
    dt_dataset_free(ds);
    return NULL;
}

/* path of dir/name, preferring the .gz file when both could exist */
static void dataset_path(char *out, size_t cap, const char *dir, const char *name)
{
    snprintf(out, cap, "%s/%s.gz", dir, name);
    if (access(out, R_OK) != 0)
        snprintf(out, cap, "%s/%s", dir, name);
}

dt_dataset *dt_dataset_fashion_mnist(dt_ctx *ctx, const char *dir, int split)
{
    if (!ctx_ok(ctx))
        return NULL;
    if (split != 0 && split != 1) {
        set_error(ctx, DT_EINVAL, "dataset: split must be 0 (train) or 1 (test), got %d", split);
        return NULL;
    }
    if (!dir)
        dir = "/usr/share/datasets/fashion-mnist";
    char img[4096], lab[4096];
    const char *pre = split ? "t10k" : "train";
    char iname[64], lname[64];
    snprintf(iname, sizeof iname, "%s-images-idx3-ubyte", pre);
    snprintf(lname, sizeof lname, "%s-labels-idx1-ubyte", pre);
    dataset_path(img, sizeof img, dir, iname);
    dataset_path(lab, sizeof lab, dir, lname);
    if (access(img, R_OK) != 0) {
        set_error(ctx, DT_EIO, "dataset: Fashion-MNIST not found in %s (install Debian's "
                               "dataset-fashion-mnist: apt-get install dataset-fashion-mnist)", dir);
        return NULL;
    }
    return dt_dataset_load_idx(ctx, img, lab);
}

void dt_dataset_free(dt_dataset *ds)
{
    if (!ds)
        return;
    host_free(ds->ctx, ds->images);
    host_free(ds->ctx, ds->labels);
    host_free(ds->ctx, ds);
}

int64_t dt_dataset_size(const dt_dataset *ds) { return ds ? ds->n : 0; }
int dt_dataset_classes(const dt_dataset *ds) { return ds ? ds->classes : 0; }

int dt_dataset_sample_shape(const dt_dataset *ds, int64_t *shape)
{
    if (!ds)
        return 0;
    if (shape) {
        shape[0] = ds->c;
        shape[1] = ds->h;
        shape[2] = ds->w;
    }
    return 3;
}

const uint8_t *dt_dataset_image(const dt_dataset *ds, int64_t i)
{
    return ds && i >= 0 && i < ds->n ? ds->images + i * ds->c * ds->h * ds->w : NULL;
}

int dt_dataset_label(const dt_dataset *ds, int64_t i)
{
    return ds && i >= 0 && i < ds->n ? ds->labels[i] : -1;
}

/* --- the loader ---------------------------------------------------------- */

typedef struct loader_slot {
    dt_tensor *x, *y;          /* full-batch tensors (persistent) */
    dt_tensor xv, yv;          /* headers for a short last batch */
    float *hx;                 /* host staging (== x->data when host-visible) */
    int32_t *hy;
    int pinned;                /* hx, hy from the backend's host_alloc */
    uint64_t ticket;           /* the backend's copy of hx, hy to x, y (0: none) */
    int64_t batch_index;       /* which batch the slot holds, -1 if none */
    int count;                 /* samples in it; -1: work stealing found none left */
    int ready;
    uint64_t gen;              /* global batches: the split it was cut with */
    int64_t offset, global;    /* its place in its global batch */
    int stolen;                /* it came from another shard's chunk */
} loader_slot;

/* Work stealing (dt_loader_steal): where the loader is in the chunks it
 * claimed, through its own store connection (the loader's thread claims). */
typedef struct loader_steal {
    dt_store *store;
    dt_ctx *errors;            /* the connection's error sink (not the caller's ctx) */
    int id, chunk;             /* the job-wide loader number; batches per chunk */
    int64_t gen;               /* start_epoch calls so far: the claims' namespace (every
                                  worker starts the same epochs, so they agree) */
    int shard;                 /* the shard of the chunk in hand */
    int64_t first, left;       /* its next batch (in that shard) and batches left */
    int64_t own_next;          /* our shard's next chunk to claim */
    unsigned char *dry;        /* per shard: nothing left to take there */
    int64_t done, stolen;      /* batches given out this epoch, from other shards */
    dt_status status;
    char msg[DT_MAX_ERROR];
} loader_steal;

struct dt_loader {
    dt_ctx *ctx;
    const dt_dataset *ds;
    dt_loader_config cfg;
    int64_t sample_elems;
    int64_t *order;            /* this shard's sample indices for the epoch */
    int64_t n_local, n_batches, next;
    float lut[256];
    loader_slot slot[2];
    int host_visible;
    double wait_s;
    int64_t cap;               /* samples a slot holds: batch, or a whole global batch */
    /* global batches (dt_loader_set_split): the weights, under mu */
    double *split;
    uint64_t split_gen;
    int64_t cur_offset, cur_count, cur_global;   /* the batch last given out */
    loader_steal *steal;       /* NULL: no work stealing */
    /* background thread */
    pthread_t thread;
    int has_thread, stop;
    int64_t request;           /* batch the worker should fill, -1 if none */
    int request_slot, busy;
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

void dt_loader_config_init(dt_loader_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->batch = 64;
    cfg->shuffle = 1;
    cfg->mean = 0.0f;
    cfg->std = 1.0f;
    cfg->prefetch = 1;
}

/* Double buffering on a device: the thread that fills a slot's (pinned)
 * host buffers also starts their copy to the device, on the backend's copy
 * stream, while the current step computes; dt_loader_next makes the compute
 * stream wait for it.  Before a slot is filled again, its last copy must
 * have left the host buffers. */
static void upload_batch(dt_loader *ld, loader_slot *s)
{
    const dt_backend_iface *be = BE(ld->ctx);
    size_t xb = (size_t)(s->count * ld->sample_elems) * sizeof(float);
    be->copy_async(BEI(ld->ctx), s->x->data, s->hx, xb, DT_COPY_H2D);
    s->ticket = be->copy_async(BEI(ld->ctx), s->y->data, s->hy,
                               (size_t)s->count * sizeof(int32_t), DT_COPY_H2D);
}

static void upload_wait(dt_loader *ld, loader_slot *s)
{
    if (s->ticket)
        BE(ld->ctx)->copy_wait(BEI(ld->ctx), s->ticket);
    s->ticket = 0;
}

static int uploads_async(const dt_loader *ld)
{
    return !ld->host_visible && be_stages(BE(ld->ctx));
}

/* Cut `total` samples into P slices in proportion to w (largest
 * remainders; each slice at least one sample when total >= P). */
static void split_counts(const double *w, int P, int64_t total, int64_t *counts)
{
    double sum = 0;
    for (int r = 0; r < P; r++)
        sum += w[r];
    int64_t given = 0;
    for (int r = 0; r < P; r++) {
        counts[r] = (int64_t)((double)total * w[r] / sum);
        given += counts[r];
    }
    while (given < total) {   /* the largest remainders, lower ranks first on ties */
        int best = 0;
        double br = -1;
        for (int r = 0; r < P; r++) {
            double rem = (double)total * w[r] / sum - (double)counts[r];
            if (rem > br + 1e-12) {
                br = rem;
                best = r;
            }
        }
        counts[best]++;
        given++;
    }
    for (int r = 0; r < P && total >= P; r++)
        while (counts[r] < 1) {   /* from the largest slice */
            int big = 0;
            for (int q = 1; q < P; q++)
                big = counts[q] > counts[big] ? q : big;
            counts[big]--;
            counts[r]++;
        }
}

/* Global batches: this shard's slice of global batch b, cut by the split
 * now in force (read under mu: dt_loader_set_split may be changing it). */
static void global_slice(dt_loader *ld, int64_t b, int64_t *start, int64_t *count,
                         int64_t *offset, int64_t *global, uint64_t *gen)
{
    int P = ld->cfg.shard_count, me = ld->cfg.shard_rank;
    int64_t G = (int64_t)ld->cfg.batch * P, n = ld->ds->n;
    int64_t total = n - b * G < G ? n - b * G : G, counts[64];
    if (ld->has_thread)
        pthread_mutex_lock(&ld->mu);
    split_counts(ld->split, P, total, counts);
    *gen = ld->split_gen;
    if (ld->has_thread)
        pthread_mutex_unlock(&ld->mu);
    int64_t off = 0;
    for (int r = 0; r < me; r++)
        off += counts[r];
    *start = b * G + off;
    *count = counts[me];
    *offset = off;
    *global = total;
}

static int64_t steal_next(dt_loader *ld, int *shard, int *stolen);
static void steal_start_epoch(dt_loader *ld, int64_t epoch);

static void fill_batch(dt_loader *ld, loader_slot *s, int64_t b)
{
    double t0 = dt_now();
    int64_t start = b * ld->cfg.batch, count = ld->n_local - start, stride = 1;
    s->offset = 0;
    s->stolen = 0;
    if (ld->cfg.global_batches) {
        global_slice(ld, b, &start, &count, &s->offset, &s->global, &s->gen);
    } else if (ld->steal) {   /* the batch a claimed chunk gives; -1: none left anywhere */
        int shard = 0;
        int64_t j = steal_next(ld, &shard, &s->stolen);
        if (j < 0) {
            s->count = -1;
            s->batch_index = b;
            return;
        }
        /* shard v's samples are perm[v], perm[v + W], ... (DistributedSampler's) */
        start = shard + j * ld->cfg.batch * ld->cfg.shard_count;
        stride = ld->cfg.shard_count;
        count = ld->n_local - j * ld->cfg.batch;
    }
    if (count > ld->cap)
        count = ld->cap;
    if (!ld->cfg.global_batches)
        s->global = count;
    int64_t e = ld->sample_elems;
    upload_wait(ld, s);
    for (int64_t i = 0; i < count; i++) {
        int64_t idx = ld->order[start + i * stride];
        const uint8_t *src = ld->ds->images + idx * e;
        float *dst = s->hx + i * e;
        for (int64_t k = 0; k < e; k++)
            dst[k] = ld->lut[src[k]];
        s->hy[i] = ld->ds->labels[idx];
    }
    s->batch_index = b;
    s->count = (int)count;
    if (uploads_async(ld))
        upload_batch(ld, s);
    prof_batch(ld->ctx, count, t0, dt_now(), ld->has_thread);
}

static void *loader_main(void *arg)
{
    dt_loader *ld = arg;
    pthread_mutex_lock(&ld->mu);
    for (;;) {
        while (!ld->stop && ld->request < 0)
            pthread_cond_wait(&ld->cv, &ld->mu);
        if (ld->stop)
            break;
        int64_t b = ld->request;
        loader_slot *s = &ld->slot[ld->request_slot];
        ld->request = -1;
        ld->busy = 1;
        pthread_mutex_unlock(&ld->mu);
        fill_batch(ld, s, b);
        pthread_mutex_lock(&ld->mu);
        s->ready = 1;
        ld->busy = 0;
        pthread_cond_broadcast(&ld->cv);
    }
    pthread_mutex_unlock(&ld->mu);
    return NULL;
}

/* Ask for batch b in slot si: the worker if there is one, else right now. */
static void loader_request(dt_loader *ld, int si, int64_t b)
{
    loader_slot *s = &ld->slot[si];
    if (!ld->has_thread) {
        fill_batch(ld, s, b);
        s->ready = 1;
        return;
    }
    pthread_mutex_lock(&ld->mu);
    s->ready = 0;
    ld->request = b;
    ld->request_slot = si;
    pthread_cond_broadcast(&ld->cv);
    pthread_mutex_unlock(&ld->mu);
}

static void loader_quiesce(dt_loader *ld)
{
    if (!ld->has_thread)
        return;
    pthread_mutex_lock(&ld->mu);
    ld->request = -1;
    while (ld->busy)
        pthread_cond_wait(&ld->cv, &ld->mu);
    pthread_mutex_unlock(&ld->mu);
}

void dt_loader_free(dt_loader *ld)
{
    if (!ld)
        return;
    dt_ctx *ctx = ld->ctx;
    if (ld->has_thread) {
        pthread_mutex_lock(&ld->mu);
        ld->stop = 1;
        pthread_cond_broadcast(&ld->cv);
        pthread_mutex_unlock(&ld->mu);
        pthread_join(ld->thread, NULL);
    }
    if (ld->has_thread || ld->stop) {
        pthread_mutex_destroy(&ld->mu);
        pthread_cond_destroy(&ld->cv);
    }
    for (int i = 0; i < 2; i++) {
        loader_slot *s = &ld->slot[i];
        upload_wait(ld, s);
        if (s->pinned) {
            BE(ctx)->host_free(BEI(ctx), s->hx);
            BE(ctx)->host_free(BEI(ctx), s->hy);
        } else if (!ld->host_visible) {
            host_free(ctx, s->hx);
            host_free(ctx, s->hy);
        }
        dt_tensor_free(s->x);
        dt_tensor_free(s->y);
    }
    host_free(ctx, ld->order);
    host_free(ctx, ld->split);
    if (ld->steal) {
        dt_store_close(ld->steal->store);
        host_free(ctx, ld->steal->errors);
        host_free(ctx, ld->steal->dry);
        host_free(ctx, ld->steal);
    }
    host_free(ctx, ld);
}

/* Page-locked staging where the backend has it (copies from pageable
 * memory are not asynchronous); 0: use the allocator instead. */
static int loader_pin_slot(dt_loader *ld, loader_slot *s)
{
    dt_ctx *ctx = ld->ctx;
    if (!BE(ctx)->host_alloc)
        return 0;
    int64_t b = ld->cap;
    s->hx = BE(ctx)->host_alloc(BEI(ctx), (size_t)(b * ld->sample_elems) * sizeof(float));
    s->hy = BE(ctx)->host_alloc(BEI(ctx), (size_t)b * sizeof(int32_t));
    if (s->hx && s->hy)
        return s->pinned = 1;
    if (s->hx)
        BE(ctx)->host_free(BEI(ctx), s->hx);
    if (s->hy)
        BE(ctx)->host_free(BEI(ctx), s->hy);
    s->hx = NULL;
    s->hy = NULL;
    return 0;
}

static dt_status loader_alloc_slots(dt_loader *ld)
{
    dt_ctx *ctx = ld->ctx;
    int64_t b = ld->cap;
    int64_t xs[4] = {b, ld->ds->c, ld->ds->h, ld->ds->w}, ys[1] = {b};
    for (int i = 0; i < 2; i++) {
        loader_slot *s = &ld->slot[i];
        s->batch_index = -1;
        if (!(s->x = dt_tensor_new(ctx, DT_F32, 4, xs)) || !(s->y = dt_tensor_new(ctx, DT_I32, 1, ys)))
            return ctx->last_status;
        if (ld->host_visible) {
            s->hx = FP(s->x);
            s->hy = IP(s->y);
        } else if (!loader_pin_slot(ld, s)) {
            s->hx = host_alloc(ctx, (size_t)(b * ld->sample_elems) * sizeof(float));
            s->hy = host_alloc(ctx, (size_t)b * sizeof(int32_t));
            if (!s->hx || !s->hy)
                return set_error(ctx, DT_ENOMEM, "loader: out of memory");
        }
    }
    return DT_OK;
}

dt_loader *dt_loader_new(dt_ctx *ctx, const dt_dataset *ds, const dt_loader_config *cfg)
{
    if (!ctx_ok(ctx))
        return NULL;
    if (!ds || !cfg) {
        set_error(ctx, DT_EINVAL, "loader: dataset and config are required");
        return NULL;
    }
    int shards = cfg->shard_count > 1 ? cfg->shard_count : 1;
    if (cfg->batch < 1 || !(cfg->std > 0) || cfg->shard_rank < 0 || cfg->shard_rank >= shards) {
        set_error(ctx, DT_EINVAL, "loader: batch %d, std %g, shard %d of %d: need batch >= 1, "
                  "std > 0, 0 <= shard_rank < shard_count", cfg->batch, (double)cfg->std,
                  cfg->shard_rank, cfg->shard_count);
        return NULL;
    }
    dt_loader *ld = host_calloc(ctx, sizeof *ld);
    if (!ld) {
        set_error(ctx, DT_ENOMEM, "loader: out of memory");
        return NULL;
    }
    ld->ctx = ctx;
    ld->ds = ds;
    ld->cfg = *cfg;
    ld->cfg.shard_count = shards;
    ld->sample_elems = ds->c * ds->h * ds->w;
    ld->host_visible = BE(ctx)->host_visible;
    ld->request = -1;
    ld->cap = cfg->batch;
    if (cfg->global_batches) {   /* a slice may grow to the whole global batch */
        if (shards > 64) {
            set_error(ctx, DT_EINVAL, "loader: global_batches supports at most 64 shards, "
                      "got %d", shards);
            host_free(ctx, ld);
            return NULL;
        }
        ld->cap = (int64_t)cfg->batch * shards;
        ld->split = host_alloc(ctx, sizeof(double) * (size_t)shards);
        if (!ld->split) {
            set_error(ctx, DT_ENOMEM, "loader: out of memory");
            host_free(ctx, ld);
            return NULL;
        }
        for (int r = 0; r < shards; r++)
            ld->split[r] = 1.0;
    }
    for (int v = 0; v < 256; v++)
        ld->lut[v] = ((float)v / 255.0f - cfg->mean) / cfg->std;
    /* shards as torch's DistributedSampler: pad to a multiple of the count
     * (every rank runs as many batches), or for evaluation each sample once */
    ld->n_local = (ds->n + shards - 1) / shards;
    if (cfg->shard_no_pad)
        ld->n_local = (ds->n - cfg->shard_rank + shards - 1) / shards;
    ld->order = host_alloc(ctx, sizeof(int64_t) * (size_t)(ds->n + shards));
    if (!ld->order || loader_alloc_slots(ld) != DT_OK) {
        if (ctx->last_status == DT_OK)
            set_error(ctx, DT_ENOMEM, "loader: out of memory");
        dt_loader_free(ld);
        return NULL;
    }
    ld->n_batches = cfg->drop_last ? ld->n_local / cfg->batch
                                   : (ld->n_local + cfg->batch - 1) / cfg->batch;
    if (cfg->global_batches) {   /* whole global batches, and a last one with a sample a shard */
        int64_t G = ld->cap, rest = ds->n % G;
        ld->n_batches = ds->n / G + (!cfg->drop_last && rest >= shards ? 1 : 0);
    }
    if (cfg->prefetch) {
        if (pthread_mutex_init(&ld->mu, NULL) != 0 || pthread_cond_init(&ld->cv, NULL) != 0 ||
            pthread_create(&ld->thread, NULL, loader_main, ld) != 0) {
            set_error(ctx, DT_ENOMEM, "loader: cannot start the prefetch thread");
            ld->stop = 1;
            dt_loader_free(ld);
            return NULL;
        }
        ld->has_thread = 1;
    }
    if (dt_loader_start_epoch(ld, 0) != DT_OK) {
        dt_loader_free(ld);
        return NULL;
    }
    return ld;
}

dt_status dt_loader_start_epoch(dt_loader *ld, int64_t epoch)
{
    if (!ld)
        return DT_EINVAL;
    loader_quiesce(ld);
    int64_t n = ld->ds->n, shards = ld->cfg.shard_count;
    int64_t total = (n + shards - 1) / shards * shards;
    int64_t *perm = ld->order;   /* build the global order in place, then keep our shard */
    for (int64_t i = 0; i < n; i++)
        perm[i] = i;
    if (ld->cfg.shuffle) {
        uint64_t s[4];
        xoshiro_seed(s, ld->cfg.seed ^ (0x9E3779B97F4A7C15ull * (uint64_t)(epoch + 1)));
        for (int64_t i = n - 1; i > 0; i--) {
            int64_t j = (int64_t)(xoshiro_next(s) % (uint64_t)(i + 1));
            int64_t t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
    }
    for (int64_t i = n; i < total; i++)
        perm[i] = perm[i - n];
    /* global batches and work stealing read the whole order */
    for (int64_t i = 0; i < ld->n_local && !ld->cfg.global_batches && !ld->steal; i++)
        perm[i] = perm[ld->cfg.shard_rank + i * shards];
    if (ld->steal)
        steal_start_epoch(ld, epoch);
    ld->next = 0;
    ld->wait_s = 0;
    ld->slot[0].ready = ld->slot[1].ready = 0;
    if (ld->n_batches > 0)
        loader_request(ld, 0, 0);
    return DT_OK;
}

static void set_batch_view(dt_tensor *view, const dt_tensor *full, int count)
{
    *view = *full;
    view->shape[0] = count;
    view->flags = T_EXTERNAL;
    view->next = view->prev = NULL;
}

static dt_status loader_next_run(dt_loader *ld, dt_tensor **x, dt_tensor **y);

dt_status dt_loader_next(dt_loader *ld, dt_tensor **x, dt_tensor **y)
{
    if (!ld)
        return DT_EINVAL;
    double t0 = prof_begin(ld->ctx);
    dt_status s = loader_next_run(ld, x, y);
    if (s == DT_OK)
        prof_samples(ld->ctx, dt_tensor_dim(*x, 0));
    prof_end(ld->ctx, PH_DATA, t0);
    return s;
}

static dt_status loader_next_run(dt_loader *ld, dt_tensor **x, dt_tensor **y)
{
    dt_ctx *ctx = ld->ctx;
    if (!x || !y)
        return set_error(ctx, DT_EINVAL, "loader_next: output pointers are NULL");
    if (ld->next >= ld->n_batches)   /* (work stealing: set when no chunk was left) */
        return DT_EOF;
    int si = (int)(ld->next % 2);
    loader_slot *s = &ld->slot[si];
    double t0 = dt_now();
    if (ld->has_thread) {
        pthread_mutex_lock(&ld->mu);
        while (!s->ready)
            pthread_cond_wait(&ld->cv, &ld->mu);
        pthread_mutex_unlock(&ld->mu);
    }
    ld->wait_s += dt_now() - t0;
    if (s->count < 0) {   /* work stealing: no chunk left anywhere */
        ld->next = ld->n_batches;
        if (ld->steal->status != DT_OK)
            return set_error(ctx, ld->steal->status, "%s", ld->steal->msg);
        return DT_EOF;
    }
    if (ld->cfg.global_batches && s->gen != ld->split_gen)
        fill_batch(ld, s, s->batch_index);   /* cut before the split changed: again */
    ld->cur_offset = s->offset;
    ld->cur_count = s->count;
    ld->cur_global = s->global;
    if (ld->steal) {
        ld->steal->done++;
        ld->steal->stolen += s->stolen;
    }
    if (uploads_async(ld)) {   /* started by the filler: kernels from here on wait */
        BE(ctx)->copy_join(BEI(ctx), s->ticket);
    } else if (!ld->host_visible) {
        BE(ctx)->to_device(BEI(ctx), s->x->data, s->hx,
                           (size_t)(s->count * ld->sample_elems) * sizeof(float));
        BE(ctx)->to_device(BEI(ctx), s->y->data, s->hy, (size_t)s->count * sizeof(int32_t));
    }
    ld->next++;
    if (ld->next < ld->n_batches)    /* the other half fills while the caller computes */
        loader_request(ld, 1 - si, ld->next);
    if (s->count == ld->cap) {
        *x = s->x;
        *y = s->y;
    } else {
        set_batch_view(&s->xv, s->x, s->count);
        set_batch_view(&s->yv, s->y, s->count);
        *x = &s->xv;
        *y = &s->yv;
    }
    return DT_OK;
}

int64_t dt_loader_batches(const dt_loader *ld)
{
    if (ld && ld->steal)   /* its own shard's; stealing changes how many it runs */
        return ld->cfg.drop_last ? ld->n_local / ld->cfg.batch
                                 : (ld->n_local + ld->cfg.batch - 1) / ld->cfg.batch;
    return ld ? ld->n_batches : 0;
}

dt_status dt_loader_set_split(dt_loader *ld, const double *weights, int n)
{
    if (!ld)
        return DT_EINVAL;
    if (!ld->cfg.global_batches)
        return set_error(ld->ctx, DT_ESTATE, "loader_set_split: the loader was made without "
                         "global_batches");
    if (!weights || n != ld->cfg.shard_count)
        return set_error(ld->ctx, DT_EINVAL, "loader_set_split: need %d weights, got %d%s",
                         ld->cfg.shard_count, n, weights ? "" : " (NULL)");
    for (int r = 0; r < n; r++)
        if (!(weights[r] > 0) || !isfinite(weights[r]))
            return set_error(ld->ctx, DT_EINVAL, "loader_set_split: weight %d is %g; each must "
                             "be finite and > 0", r, weights[r]);
    if (ld->has_thread)
        pthread_mutex_lock(&ld->mu);
    memcpy(ld->split, weights, sizeof(double) * (size_t)n);
    ld->split_gen++;
    if (ld->has_thread)
        pthread_mutex_unlock(&ld->mu);
    return DT_OK;
}

void dt_loader_batch_slice(const dt_loader *ld, int64_t *offset, int64_t *count, int64_t *global)
{
    if (offset)
        *offset = ld ? ld->cur_offset : 0;
    if (count)
        *count = ld ? ld->cur_count : 0;
    if (global)
        *global = ld ? ld->cur_global : 0;
}

int64_t dt_loader_batches_done(const dt_loader *ld)
{
    return !ld ? 0 : ld->steal ? ld->steal->done : ld->next;
}

int64_t dt_loader_batches_stolen(const dt_loader *ld) { return ld && ld->steal ? ld->steal->stolen : 0; }

double dt_loader_wait_seconds(const dt_loader *ld) { return ld ? ld->wait_s : 0.0; }

/* ===========================================================================
 * 12. Utilities
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

/* ===========================================================================
 * 13. Processes: launcher environment and the rendezvous store
 *
 * Rank, world size and the master address come from whichever launcher
 * started us (dtrain's own, torchrun, mpirun, srun).  Rank 0 then serves a
 * tiny key-value store over TCP on its own thread; every rank (0 included)
 * connects, presents the job token, and swaps addresses through it.
 *
 * Wire format: frames of u32 little-endian length + payload; payload byte 0
 * is the operation.  HELLO (version, rank, token), SET (key, value), GET
 * (key, timeout), ADD (key, i64: the key's 8-byte counter plus it, answered
 * with the sum; work stealing's claims), TIME (answered with the server's
 * clock: the profiler's offsets, 20).  The server answers every request with one frame; a GET
 * for a missing key is parked until the key is set or its deadline passes.
 * A client that sends anything malformed, or anything before a good HELLO,
 * is answered with an error and disconnected; the server keeps serving the
 * others.
 * ======================================================================== */

#define DT_STORE_MAGIC 0x4454u          /* "DT" */
#define DT_STORE_VERSION 1
#define DT_STORE_MAX_FRAME (DT_STORE_MAX_VALUE + DT_STORE_MAX_KEY + 64)
#define DT_STORE_MAX_TOKEN 256
#define DT_STORE_MAX_CLIENTS 4096
#define DT_STORE_MAX_QUEUED ((size_t)8 << 20)   /* unsent replies before a client is dropped */
#define DT_DEFAULT_MASTER_PORT 29500
#define DT_STORE_DEFAULT_TIMEOUT_MS 30000

enum { OP_HELLO = 1, OP_SET = 2, OP_GET = 3, OP_BYE = 4, OP_TIME = 5, OP_ADD = 6, OP_REPLY = 0x80 };

/* The key a dead rank's process is recorded under: "dead/<rank>" for the
 * first, "dead/<rank>.<n>" for the n-th restart (14.6), so a restarted
 * rank is not taken for dead by its predecessor's record. */
static void dead_key(char *key, size_t cap, int rank, uint32_t inc)
{
    if (inc)
        snprintf(key, cap, "dead/%d.%u", rank, inc);
    else
        snprintf(key, cap, "dead/%d", rank);
}

/* --- 13.1 the launcher's environment ---------------------------------- */

static int env_int(dt_ctx *ctx, const char *name, int lo, int hi, int *out, dt_status *st)
{
    const char *v = getenv(name);
    if (!v)
        return 0;
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (!*v || *end || errno || x < lo || x > hi) {
        *st = set_error(ctx, DT_EINVAL, "dist_env: %s='%s' is not an integer in [%d, %d]", name, v,
                        lo, hi);
        return 0;
    }
    *out = (int)x;
    return 1;
}

/* "host:port" (the last colon splits, so "[::1]:p" style is not supported) */
static dt_status parse_master(dt_ctx *ctx, const char *var, const char *v, dt_dist_env *e)
{
    const char *colon = strrchr(v, ':');
    char *end;
    long port = colon ? strtol(colon + 1, &end, 10) : -1;
    if (!colon || colon == v || (size_t)(colon - v) >= sizeof e->master_addr || !colon[1] ||
        *end || port < 1 || port > 65535)
        return set_error(ctx, DT_EINVAL, "dist_env: %s='%s' must be host:port", var, v);
    snprintf(e->master_addr, sizeof e->master_addr, "%.*s", (int)(colon - v), v);
    e->master_port = (int)port;
    return DT_OK;
}

/* MASTER_ADDR / MASTER_PORT, or DTRAIN_MASTER, or the defaults */
static dt_status detect_master(dt_ctx *ctx, dt_dist_env *e)
{
    dt_status st = DT_OK;
    const char *dm = getenv("DTRAIN_MASTER");
    if (dm)
        return parse_master(ctx, "DTRAIN_MASTER", dm, e);
    const char *addr = getenv("MASTER_ADDR");
    if (addr) {
        if (!*addr || strlen(addr) >= sizeof e->master_addr)
            return set_error(ctx, DT_EINVAL, "dist_env: MASTER_ADDR is empty or too long");
        snprintf(e->master_addr, sizeof e->master_addr, "%s", addr);
    }
    env_int(ctx, "MASTER_PORT", 1, 65535, &e->master_port, &st);
    return st;
}

typedef struct launcher_vars {
    const char *name, *rank, *world, *local_rank, *local_world;
} launcher_vars;

static const launcher_vars launchers[] = {
    {"dtrain", "DTRAIN_RANK", "DTRAIN_WORLD_SIZE", "DTRAIN_LOCAL_RANK", "DTRAIN_LOCAL_WORLD_SIZE"},
    {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
    {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
};

dt_status dt_dist_env_detect(dt_ctx *ctx, dt_dist_env *e)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (!e)
        return set_error(ctx, DT_EINVAL, "dist_env: output is NULL");
    memset(e, 0, sizeof *e);
    e->world_size = 1;
    e->local_rank = e->local_world_size = -1;
    e->launcher = "none";
    snprintf(e->master_addr, sizeof e->master_addr, "127.0.0.1");
    e->master_port = DT_DEFAULT_MASTER_PORT;
    dt_status st = DT_OK;
    for (size_t i = 0; i < sizeof launchers / sizeof launchers[0]; i++) {
        const launcher_vars *l = &launchers[i];
        int have_rank = env_int(ctx, l->rank, 0, INT_MAX - 1, &e->rank, &st);
        int have_world = st == DT_OK && env_int(ctx, l->world, 1, INT_MAX, &e->world_size, &st);
        if (st != DT_OK)
            return st;
        if (!have_rank && !have_world)
            continue;
        if (!have_rank || !have_world)
            return set_error(ctx, DT_EINVAL, "dist_env: %s is set but %s is not", 
                             have_rank ? l->rank : l->world, have_rank ? l->world : l->rank);
        if (e->rank >= e->world_size)
            return set_error(ctx, DT_EINVAL, "dist_env: %s=%d is not below %s=%d", l->rank,
                             e->rank, l->world, e->world_size);
        env_int(ctx, l->local_rank, 0, INT_MAX - 1, &e->local_rank, &st);
        if (st == DT_OK && strcmp(l->name, "slurm") != 0)   /* Slurm's may be "2(x3)" */
            env_int(ctx, l->local_world, 1, INT_MAX, &e->local_world_size, &st);
        if (st != DT_OK)
            return st;
        e->launcher = l->name;
        break;
    }
    return detect_master(ctx, e);
}

/* --- 13.2 framing over blocking sockets with deadlines ------------------- */

static int ms_left(double deadline)
{
    double left = (deadline - dt_now()) * 1000.0;
    return left <= 0 ? 0 : left > INT_MAX ? INT_MAX : (int)left;
}

/* Move exactly n bytes, or fail at the deadline / on a closed socket. */
static int sock_io(int fd, void *buf, size_t n, int writing, double deadline)
{
    char *p = buf;
    while (n > 0) {
        struct pollfd pf = {fd, (short)(writing ? POLLOUT : POLLIN), 0};
        int r = poll(&pf, 1, ms_left(deadline));
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return r == 0 ? -2 : -1;   /* -2: timed out */
        ssize_t k = writing ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
        if (k < 0 && (errno == EINTR || errno == EAGAIN))
            continue;
        if (k <= 0)
            return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

static void put_u16(unsigned char *p, uint32_t v) { p[0] = (unsigned char)v; p[1] = (unsigned char)(v >> 8); }
static void put_u32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}
static uint32_t get_u16(const unsigned char *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8; }
static uint32_t get_u32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* --- 13.3 the server (rank 0, its own thread) ---------------------------- */

typedef struct kv_entry {
    char *key;
    unsigned char *val;
    uint32_t len;
} kv_entry;

typedef struct store_client {
    int fd;
    int hello;                 /* 1 once the token was accepted */
    int rank;                  /* from the hello */
    int bye;                   /* left cleanly: its close is not a death */
    uint32_t inc;              /* its process's incarnation (0: the first; see 14.6) */
    unsigned char *buf;        /* partial incoming frame */
    size_t have, cap;
    unsigned char *out;        /* replies the socket has not taken yet */
    size_t out_off, out_len, out_cap;
    char wait_key[DT_STORE_MAX_KEY + 1];   /* parked GET */
    double wait_deadline;
    int waiting;
} store_client;

typedef struct store_server {
    dt_allocator al;
    int listen_fd, port, world;
    int stop_pipe[2];
    char token[DT_STORE_MAX_TOKEN + 1];
    size_t token_len;
    kv_entry *kv;
    int nkv, cap_kv;
    store_client *cl;
    int ncl, cap_cl;
    double drain_until;        /* stopping: serve until the others leave or then */
    pthread_t thread;
} store_server;

struct dt_store {
    dt_ctx *ctx;
    int fd;                    /* this rank's connection */
    int rank, timeout_ms;
    uint32_t inc;              /* our process's incarnation, said in the hello */
    char token[DT_STORE_MAX_TOKEN + 1];   /* the job's, for a second connection */
    store_server *server;      /* rank 0 only */
    char addr[DT_MAX_HOST];
    int port;
    char prefix[64];           /* a process group's namespace, put before every key but
                                  those written "/key" (the job's own: "/dead") */
};

static void *sv_alloc(store_server *sv, size_t n) { return sv->al.malloc_fn(n ? n : 1, sv->al.user); }
static void sv_free(store_server *sv, void *p) { if (p) sv->al.free_fn(p, sv->al.user); }

static int token_equal(const char *a, size_t alen, const char *b, size_t blen)
{
    /* constant time in the token's length: no early exit on a mismatch */
    unsigned diff = alen != blen;
    for (size_t i = 0; i < alen && i < blen; i++)
        diff |= (unsigned char)a[i] ^ (unsigned char)b[i];
    return diff == 0;
}

static kv_entry *kv_find(store_server *sv, const char *key)
{
    for (int i = 0; i < sv->nkv; i++)
        if (strcmp(sv->kv[i].key, key) == 0)
            return &sv->kv[i];
    return NULL;
}

/* Send what the client's socket takes now, without blocking; the server
 * loop polls for room for the rest.  -1: the connection failed. */
static int sv_flush(store_client *c)
{
    while (c->out_off < c->out_len) {
        ssize_t k = send(c->fd, c->out + c->out_off, c->out_len - c->out_off,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return 0;
        if (k <= 0)
            return -1;
        c->out_off += (size_t)k;
    }
    c->out_off = c->out_len = 0;
    return 0;
}

/* Queue one reply frame (op | status byte | u32 len | bytes) and send what
 * fits.  Replies never block the server: a client that stops reading only
 * grows its own queue, and is dropped past DT_STORE_MAX_QUEUED, so the
 * other ranks' requests (and the failure detector) keep being served. */
static int sv_reply(store_server *sv, store_client *c, int op, int ok, const void *data, uint32_t len)
{
    size_t pending = c->out_len - c->out_off;
    if (pending + 10 + len > DT_STORE_MAX_QUEUED)
        return -1;
    if (c->out_off) {
        memmove(c->out, c->out + c->out_off, pending);
        c->out_off = 0;
        c->out_len = pending;
    }
    if (c->out_cap < pending + 10 + len) {
        size_t cap = pending + 10 + len + 4096;
        unsigned char *p = sv->al.realloc_fn(c->out, cap, sv->al.user);
        if (!p)
            return -1;
        c->out = p;
        c->out_cap = cap;
    }
    unsigned char *h = c->out + c->out_len;
    put_u32(h, 6 + len);
    h[4] = (unsigned char)(OP_REPLY | op);
    h[5] = (unsigned char)ok;
    put_u32(h + 6, len);
    if (len)
        memcpy(h + 10, data, len);
    c->out_len += 10 + (size_t)len;
    return sv_flush(c);
}

static int sv_error(store_server *sv, store_client *c, int op, const char *msg)
{
    sv_reply(sv, c, op, 0, msg, (uint32_t)strlen(msg));
    return -1;   /* the caller drops the client (the message is small: it fits the socket) */
}

static int kv_set(store_server *sv, const char *key, const unsigned char *val, uint32_t len)
{
    unsigned char *copy = sv_alloc(sv, len);
    if (!copy)
        return -1;
    memcpy(copy, val, len);
    kv_entry *e = kv_find(sv, key);
    if (e) {
        sv_free(sv, e->val);
        e->val = copy;
        e->len = len;
        return 0;
    }
    if (sv->nkv == sv->cap_kv) {
        int cap = sv->cap_kv ? sv->cap_kv * 2 : 64;
        kv_entry *k = sv->al.realloc_fn(sv->kv, sizeof *k * (size_t)cap, sv->al.user);
        if (!k) {
            sv_free(sv, copy);
            return -1;
        }
        sv->kv = k;
        sv->cap_kv = cap;
    }
    size_t kl = strlen(key) + 1;
    char *kc = sv_alloc(sv, kl);
    if (!kc) {
        sv_free(sv, copy);
        return -1;
    }
    memcpy(kc, key, kl);
    sv->kv[sv->nkv++] = (kv_entry){kc, copy, len};
    return 0;
}

/* Answer parked GETs whose key arrived or whose deadline passed. */
static void sv_serve_waiters(store_server *sv)
{
    double now = dt_now();
    for (int i = 0; i < sv->ncl; i++) {
        store_client *c = &sv->cl[i];
        if (!c->waiting)
            continue;
        kv_entry *e = kv_find(sv, c->wait_key);
        if (e || now >= c->wait_deadline) {
            c->waiting = 0;
            if (sv_reply(sv, c, OP_GET, e != NULL, e ? e->val : NULL, e ? e->len : 0) != 0) {
                close(c->fd);
                c->fd = -1;
            }
        }
    }
}

/* A key field: u16 length + bytes, NUL-free, 1..DT_STORE_MAX_KEY. */
static int take_key(const unsigned char **p, const unsigned char *end, char *key)
{
    if (end - *p < 2)
        return -1;
    uint32_t kl = get_u16(*p);
    *p += 2;
    if (kl == 0 || kl > DT_STORE_MAX_KEY || (uint32_t)(end - *p) < kl || memchr(*p, 0, kl))
        return -1;
    memcpy(key, *p, kl);
    key[kl] = '\0';
    *p += kl;
    return 0;
}

/* Handle one whole frame; -1 drops the client. */
static int sv_frame(store_server *sv, store_client *c, const unsigned char *f, size_t n)
{
    const unsigned char *p = f + 1, *end = f + n;
    char key[DT_STORE_MAX_KEY + 1];
    int op = n ? f[0] : 0;
    if (op == OP_HELLO) {
        if (n < 11 || get_u16(p) != DT_STORE_MAGIC || get_u16(p + 2) != DT_STORE_VERSION)
            return sv_error(sv, c, op, "not a dtrain rendezvous client of this version");
        uint32_t rank = get_u32(p + 4), tl = get_u16(p + 8);
        size_t rest = (size_t)(end - (p + 10));   /* the token, then maybe an incarnation */
        if (rest != tl && rest != (size_t)tl + 4)
            return sv_error(sv, c, op, "malformed hello");
        c->inc = rest == (size_t)tl + 4 ? get_u32(p + 10 + tl) : 0;
        if (!token_equal((const char *)p + 10, tl, sv->token, sv->token_len))
            return sv_error(sv, c, op, "wrong or missing job token (DTRAIN_JOB_TOKEN)");
        if (rank >= (uint32_t)sv->world)
            return sv_error(sv, c, op, "rank out of range for this job");
        c->hello = 1;
        c->rank = (int)rank;
        return sv_reply(sv, c, op, 1, NULL, 0);
    }
    if (op == OP_BYE) {
        c->bye = 1;
        return sv_reply(sv, c, op, 1, NULL, 0);
    }
    if (!c->hello)
        return sv_error(sv, c, op, "hello with the job token first");
    if (op == OP_SET) {
        if (take_key(&p, end, key) != 0 || end - p < 4)
            return sv_error(sv, c, op, "malformed set");
        uint32_t vl = get_u32(p);
        p += 4;
        if (vl > DT_STORE_MAX_VALUE || (uint32_t)(end - p) != vl)
            return sv_error(sv, c, op, "malformed set");
        if (kv_set(sv, key, p, vl) != 0)
            return sv_error(sv, c, op, "store out of memory");
        if (sv_reply(sv, c, op, 1, NULL, 0) != 0)
            return -1;
        sv_serve_waiters(sv);
        return 0;
    }
    if (op == OP_TIME) {   /* rank 0's clock, for the others' offsets (20) */
        if (n != 1)
            return sv_error(sv, c, op, "malformed time");
        double now = dt_now();
        unsigned char b[8];
        memcpy(b, &now, sizeof b);
        return sv_reply(sv, c, op, 1, b, sizeof b);
    }
    if (op == OP_ADD) {   /* an atomic counter: the server handles one frame at a time */
        if (take_key(&p, end, key) != 0 || end - p != 8)
            return sv_error(sv, c, op, "malformed add");
        int64_t delta, v = 0;
        memcpy(&delta, p, sizeof delta);
        kv_entry *e = kv_find(sv, key);
        if (e && e->len != sizeof v) {   /* the caller's mistake: refused, not dropped */
            const char *why = "the key holds a value that is not a counter";
            return sv_reply(sv, c, op, 0, why, (uint32_t)strlen(why));
        }
        if (e)
            memcpy(&v, e->val, sizeof v);
        v = (int64_t)((uint64_t)v + (uint64_t)delta);
        unsigned char b[8];
        memcpy(b, &v, sizeof b);
        if (kv_set(sv, key, b, sizeof b) != 0)
            return sv_error(sv, c, op, "store out of memory");
        if (sv_reply(sv, c, op, 1, b, sizeof b) != 0)
            return -1;
        sv_serve_waiters(sv);
        return 0;
    }
    if (op == OP_GET) {
        if (take_key(&p, end, key) != 0 || end - p != 4)
            return sv_error(sv, c, op, "malformed get");
        uint32_t timeout_ms = get_u32(p);
        kv_entry *e = kv_find(sv, key);
        if (e || timeout_ms <= 1)   /* <= 1 ms: a poll, answered at once */
            return sv_reply(sv, c, op, e != NULL, e ? e->val : NULL, e ? e->len : 0);
        snprintf(c->wait_key, sizeof c->wait_key, "%s", key);
        c->wait_deadline = dt_now() + timeout_ms / 1000.0;
        c->waiting = 1;
        return 0;
    }
    return sv_error(sv, c, op, "unknown operation");
}

/* Read what the client sent; handle every whole frame in it. */
static int sv_readable(store_server *sv, store_client *c)
{
    if (c->cap - c->have < 4096) {
        size_t cap = c->cap ? c->cap * 2 : 8192;
        if (cap > DT_STORE_MAX_FRAME + 8)
            cap = DT_STORE_MAX_FRAME + 8;
        if (cap <= c->have)
            return -1;
        unsigned char *b = sv->al.realloc_fn(c->buf, cap, sv->al.user);
        if (!b)
            return -1;
        c->buf = b;
        c->cap = cap;
    }
    ssize_t k = recv(c->fd, c->buf + c->have, c->cap - c->have, MSG_DONTWAIT);
    if (k < 0 && (errno == EAGAIN || errno == EINTR))
        return 0;
    if (k <= 0)
        return -1;
    c->have += (size_t)k;
    while (c->have >= 4) {
        uint32_t len = get_u32(c->buf);
        if (len == 0 || len > DT_STORE_MAX_FRAME)
            return sv_error(sv, c, 0, "frame too large");
        if (c->have < 4 + (size_t)len)
            break;
        if (c->waiting)
            return sv_error(sv, c, 0, "request while a get is pending");
        if (sv_frame(sv, c, c->buf + 4, len) != 0)
            return -1;
        memmove(c->buf, c->buf + 4 + len, c->have - 4 - len);
        c->have -= 4 + len;
    }
    return 0;
}

static void sv_accept(store_server *sv)
{
    int fd = accept(sv->listen_fd, NULL, NULL);
    if (fd < 0)
        return;
    if (sv->ncl == sv->cap_cl) {
        int cap = sv->cap_cl ? sv->cap_cl * 2 : 16;
        store_client *c = cap <= DT_STORE_MAX_CLIENTS
                              ? sv->al.realloc_fn(sv->cl, sizeof *c * (size_t)cap, sv->al.user)
                              : NULL;
        if (!c) {
            close(fd);
            return;
        }
        sv->cl = c;
        sv->cap_cl = cap;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    memset(&sv->cl[sv->ncl], 0, sizeof sv->cl[0]);
    sv->cl[sv->ncl++].fd = fd;
}

/* A rank whose connection closed without a goodbye died (its process
 * exited or was killed: the kernel closes its sockets).  Record it under
 * "dead/<rank>" ("dead/<rank>.<n>" for its n-th restarted process, 14.6)
 * and, first death only, "dead", which stalled collectives read to name
 * the rank that failed. */
static void sv_record_death(store_server *sv, int rank, uint32_t inc)
{
    char key[32], val[16];
    dead_key(key, sizeof key, rank, inc);
    snprintf(val, sizeof val, "%d", rank);
    kv_set(sv, key, (const unsigned char *)val, (uint32_t)strlen(val) + 1);
    if (!kv_find(sv, "dead"))
        kv_set(sv, "dead", (const unsigned char *)val, (uint32_t)strlen(val) + 1);
}

static void sv_drop_closed(store_server *sv)
{
    int j = 0, died = 0;
    for (int i = 0; i < sv->ncl; i++) {
        if (sv->cl[i].fd >= 0) {
            sv->cl[j++] = sv->cl[i];
        } else {
            /* (a restarted process that leaves, even saying goodbye, is gone
             * too: the next restart of its rank waits for this record) */
            if (sv->cl[i].hello && (!sv->cl[i].bye || sv->cl[i].inc > 0)) {
                sv_record_death(sv, sv->cl[i].rank, sv->cl[i].inc);
                died = 1;
            }
            sv_free(sv, sv->cl[i].buf);
            sv_free(sv, sv->cl[i].out);
        }
    }
    sv->ncl = j;
    if (died)
        sv_serve_waiters(sv);
}

/* Other ranks still connected (said hello, not goodbye)?  Rank 0's own
 * connections do not count: they are its own, closing. */
static int sv_others_connected(const store_server *sv)
{
    for (int i = 0; i < sv->ncl; i++)
        if (sv->cl[i].fd >= 0 && sv->cl[i].hello && !sv->cl[i].bye && sv->cl[i].rank != 0)
            return 1;
    return 0;
}

/* Asked to stop: at once, or (drain_until set) once the other ranks left. */
static int sv_done_draining(const store_server *sv)
{
    double until;
    __atomic_load(&sv->drain_until, &until, __ATOMIC_ACQUIRE);
    return until <= 0 || dt_now() >= until || !sv_others_connected(sv);
}

static void *store_server_main(void *arg)
{
    store_server *sv = arg;
    struct pollfd *pf = NULL;
    int cap_pf = 0, stopping = 0;
    for (;;) {
        if (cap_pf < sv->ncl + 2) {
            cap_pf = sv->ncl + 16;
            struct pollfd *n = sv->al.realloc_fn(pf, sizeof *pf * (size_t)cap_pf, sv->al.user);
            if (!n)
                break;
            pf = n;
        }
        pf[0] = (struct pollfd){sv->stop_pipe[0], POLLIN, 0};
        pf[1] = (struct pollfd){sv->listen_fd, POLLIN, 0};
        for (int i = 0; i < sv->ncl; i++)
            pf[i + 2] = (struct pollfd){sv->cl[i].fd,
                                        (short)(POLLIN | (sv->cl[i].out_len ? POLLOUT : 0)), 0};
        int r = poll(pf, (nfds_t)sv->ncl + 2, 50);   /* 50 ms: parked GET deadlines */
        if (r < 0 && errno != EINTR)
            break;
        if (pf[0].revents) {
            char x;
            stopping = 1;
            ssize_t k = read(sv->stop_pipe[0], &x, 1);
            (void)k;
        }
        if (stopping && sv_done_draining(sv))
            break;
        int n = sv->ncl;
        for (int i = 0; r > 0 && i < n; i++) {
            short ev = pf[i + 2].revents;
            if (!ev)
                continue;
            int bad = (ev & POLLOUT) && sv_flush(&sv->cl[i]) != 0;
            if (!bad && (ev & ~POLLOUT))
                bad = sv_readable(sv, &sv->cl[i]) != 0;
            if (bad) {
                close(sv->cl[i].fd);
                sv->cl[i].fd = -1;
            }
        }
        if (r > 0 && pf[1].revents)
            sv_accept(sv);
        sv_serve_waiters(sv);
        sv_drop_closed(sv);
    }
    sv_free(sv, pf);
    return NULL;
}

static void store_server_free(store_server *sv)
{
    if (!sv)
        return;
    for (int i = 0; i < sv->ncl; i++) {
        if (sv->cl[i].fd >= 0)
            close(sv->cl[i].fd);
        sv_free(sv, sv->cl[i].buf);
        sv_free(sv, sv->cl[i].out);
    }
    for (int i = 0; i < sv->nkv; i++) {
        sv_free(sv, sv->kv[i].key);
        sv_free(sv, sv->kv[i].val);
    }
    sv_free(sv, sv->cl);
    sv_free(sv, sv->kv);
    if (sv->listen_fd >= 0)
        close(sv->listen_fd);
    if (sv->stop_pipe[0] >= 0)
        close(sv->stop_pipe[0]);
    if (sv->stop_pipe[1] >= 0)
        close(sv->stop_pipe[1]);
    sv_free(sv, sv);
}

static dt_status store_server_start(dt_ctx *ctx, const char *bind_addr, int port, int world,
                                    const char *token, store_server **out)
{
    store_server *sv = host_calloc(ctx, sizeof *sv);
    if (!sv)
        return set_error(ctx, DT_ENOMEM, "store: out of memory");
    sv->al = ctx->al;
    sv->listen_fd = sv->stop_pipe[0] = sv->stop_pipe[1] = -1;
    sv->world = world;
    sv->token_len = strlen(token);
    memcpy(sv->token, token, sv->token_len + 1);
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    dt_status st = DT_OK;
    int one = 1;
    socklen_t sl = sizeof sa;
    if (inet_pton(AF_INET, bind_addr, &sa.sin_addr) != 1)
        st = set_error(ctx, DT_EINVAL, "store: bind address '%s' is not an IPv4 address", bind_addr);
    else if ((sv->listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) < 0 ||
             setsockopt(sv->listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
             bind(sv->listen_fd, (struct sockaddr *)&sa, sizeof sa) != 0 ||
             listen(sv->listen_fd, 1024) != 0 ||
             getsockname(sv->listen_fd, (struct sockaddr *)&sa, &sl) != 0)
        st = set_error(ctx, DT_EIO, "store: cannot listen on %s:%d: %s", bind_addr, port,
                       strerror(errno));
    else if (pipe(sv->stop_pipe) != 0)
        st = set_error(ctx, DT_EIO, "store: pipe: %s", strerror(errno));
    else if (pthread_create(&sv->thread, NULL, store_server_main, sv) != 0)
        st = set_error(ctx, DT_ENOMEM, "store: cannot start the server thread");
    if (st != DT_OK) {
        store_server_free(sv);
        return st;
    }
    sv->port = ntohs(sa.sin_port);
    *out = sv;
    return DT_OK;
}

/* drain_ms > 0: keep serving until every other rank has closed its
 * connections, up to drain_ms (see dt_comm_free for why). */
static void store_server_stop(store_server *sv, int drain_ms)
{
    if (!sv)
        return;
    if (drain_ms > 0) {
        double until = dt_now() + drain_ms / 1000.0;
        __atomic_store(&sv->drain_until, &until, __ATOMIC_RELEASE);
    }
    ssize_t w = write(sv->stop_pipe[1], "x", 1);
    (void)w;
    pthread_join(sv->thread, NULL);
    store_server_free(sv);
}

/* --- 13.4 the client (every rank) ---------------------------------------- */

void dt_store_config_init(dt_store_config *cfg)
{
    if (cfg)
        memset(cfg, 0, sizeof *cfg);
}

/* Connect to host:port, retrying until the deadline (rank 0 may be late). */
static int store_connect(const char *host, int port, double deadline, char *why, size_t wl)
{
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    struct addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    int gai = getaddrinfo(host, ps, &hints, &ai);
    if (gai != 0) {
        snprintf(why, wl, "cannot resolve '%s': %s", host, gai_strerror(gai));
        return -1;
    }
    int fd = -1;
    snprintf(why, wl, "no answer");
    do {
        fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) {
            snprintf(why, wl, "socket: %s", strerror(errno));
            break;
        }
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0)
            break;
        snprintf(why, wl, "%s", strerror(errno));
        close(fd);
        fd = -1;
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    } while (dt_now() < deadline);
    freeaddrinfo(ai);
    if (fd >= 0) {
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    }
    return fd;
}

/* Send one request frame and read its reply into buf (up to cap bytes).
 * Returns DT_OK with *ok and *len set, or a status with the ctx message. */
static dt_status store_call(dt_store *s, const unsigned char *req, size_t n, int op,
                            double deadline, void *buf, size_t cap, int *ok, size_t *len)
{
    dt_ctx *ctx = s->ctx;
    unsigned char hdr[10];
    put_u32(hdr, (uint32_t)n);
    if (sock_io(s->fd, hdr, 4, 1, deadline) != 0 || sock_io(s->fd, (void *)req, n, 1, deadline) != 0)
        return set_error(ctx, DT_EPEER, "store: lost the connection to rank 0 (%s:%d)", s->addr,
                         s->port);
    int r = sock_io(s->fd, hdr, sizeof hdr, 0, deadline);
    if (r != 0)
        return set_error(ctx, r == -2 ? DT_ETIMEDOUT : DT_EPEER,
                         "store: rank 0 (%s:%d) %s", s->addr, s->port,
                         r == -2 ? "did not answer in time" : "closed the connection");
    uint32_t flen = get_u32(hdr), vlen = get_u32(hdr + 6);
    if (hdr[4] != (OP_REPLY | op) || flen != 6 + vlen || vlen > DT_STORE_MAX_FRAME)
        return set_error(ctx, DT_EPEER, "store: malformed reply from rank 0");
    *ok = hdr[5];
    *len = vlen;
    unsigned char tmp[256];
    for (uint32_t got = 0; got < vlen;) {   /* what does not fit in buf is drained */
        uint32_t chunk = vlen - got;
        unsigned char *dst = tmp;
        if (got < cap) {
            dst = (unsigned char *)buf + got;
            if (chunk > cap - got)
                chunk = (uint32_t)(cap - got);
        } else if (chunk > sizeof tmp) {
            chunk = sizeof tmp;
        }
        if (sock_io(s->fd, dst, chunk, 0, deadline) != 0)
            return set_error(ctx, DT_EPEER, "store: reply from rank 0 cut short");
        got += chunk;
    }
    return DT_OK;
}

static const char *store_token(const dt_store_config *cfg)
{
    if (cfg && cfg->token)
        return cfg->token;
    const char *t = getenv("DTRAIN_JOB_TOKEN");
    return t ? t : "";
}

static dt_status store_hello(dt_store *s, const char *token)
{
    size_t tl = strlen(token);
    unsigned char req[15 + DT_STORE_MAX_TOKEN];
    req[0] = OP_HELLO;
    put_u16(req + 1, DT_STORE_MAGIC);
    put_u16(req + 3, DT_STORE_VERSION);
    put_u32(req + 5, (uint32_t)s->rank);
    put_u16(req + 9, (uint32_t)tl);
    memcpy(req + 11, token, tl);
    if (s->inc)   /* a restarted rank's process (14.6): its death has its own key */
        put_u32(req + 11 + tl, s->inc);
    char msg[256];
    size_t len = 0;
    int ok = 0;
    dt_status st = store_call(s, req, 11 + tl + (s->inc ? 4 : 0), OP_HELLO, dt_now() + s->timeout_ms / 1000.0, msg,
                              sizeof msg - 1, &ok, &len);
    if (st != DT_OK)
        return st;
    if (!ok) {
        msg[len < sizeof msg - 1 ? len : sizeof msg - 1] = '\0';
        return set_error(s->ctx, DT_EPEER, "store: rank 0 (%s:%d) refused rank %d: %s", s->addr,
                         s->port, s->rank, msg);
    }
    return DT_OK;
}

static dt_store *store_open(dt_ctx *ctx, const dt_dist_env *env, const dt_store_config *cfg,
                            int serve, uint32_t inc);

dt_store *dt_store_open(dt_ctx *ctx, const dt_dist_env *env, const dt_store_config *cfg)
{
    return store_open(ctx, env, cfg, 1, 0);
}

/* serve: rank 0 starts the store; inc: this process's incarnation (14.6) */
static dt_store *store_open(dt_ctx *ctx, const dt_dist_env *env, const dt_store_config *cfg,
                            int serve, uint32_t inc)
{
    if (!ctx_ok(ctx))
        return NULL;
    if (!env || env->world_size < 1 || env->rank < 0 || env->rank >= env->world_size ||
        env->master_port < 0 || env->master_port > 65535) {
        set_error(ctx, DT_EINVAL, "store: needs a valid dt_dist_env (rank < world size, port)");
        return NULL;
    }
    const char *token = store_token(cfg);
    if (strlen(token) > DT_STORE_MAX_TOKEN) {
        set_error(ctx, DT_EINVAL, "store: job token longer than %d bytes", DT_STORE_MAX_TOKEN);
        return NULL;
    }
    dt_store *s = host_calloc(ctx, sizeof *s);
    if (!s) {
        set_error(ctx, DT_ENOMEM, "store: out of memory");
        return NULL;
    }
    s->ctx = ctx;
    s->fd = -1;
    s->rank = env->rank;
    s->inc = inc;
    snprintf(s->token, sizeof s->token, "%s", token);
    s->timeout_ms = cfg && cfg->timeout_ms > 0 ? cfg->timeout_ms : DT_STORE_DEFAULT_TIMEOUT_MS;
    snprintf(s->addr, sizeof s->addr, "%s", env->master_addr);
    s->port = env->master_port;
    if (env->rank == 0 && serve) {
        const char *bind = cfg && cfg->bind_addr ? cfg->bind_addr : getenv("DTRAIN_STORE_BIND");
        if (store_server_start(ctx, bind ? bind : "127.0.0.1", env->master_port, env->world_size,
                               token, &s->server) != DT_OK) {
            host_free(ctx, s);
            return NULL;
        }
        s->port = s->server->port;
    }
    char why[DT_MAX_HOST + 128];
    s->fd = store_connect(s->addr, s->port, dt_now() + s->timeout_ms / 1000.0, why, sizeof why);
    if (s->fd < 0) {
        set_error(ctx, DT_ETIMEDOUT, "store: rank %d cannot reach rank 0 at %s:%d within %d ms: %s",
                  s->rank, s->addr, s->port, s->timeout_ms, why);
        dt_store_close(s);
        return NULL;
    }
    if (store_hello(s, token) != DT_OK) {
        dt_store_close(s);
        return NULL;
    }
    return s;
}

/* drain_ms: on rank 0, see store_server_stop. */
static void store_close(dt_store *s, int drain_ms)
{
    if (!s)
        return;
    if (s->fd >= 0) {
        unsigned char bye = OP_BYE, msg[64];
        int ok = 0;
        size_t len = 0;
        dt_status keep = s->ctx->last_status;
        char keep_msg[DT_MAX_ERROR];
        snprintf(keep_msg, sizeof keep_msg, "%s", s->ctx->err);
        store_call(s, &bye, 1, OP_BYE, dt_now() + 1.0, msg, sizeof msg, &ok, &len);
        set_error(s->ctx, keep, "%s", keep_msg);   /* closing leaves the last error alone */
        close(s->fd);
    }
    store_server_stop(s->server, drain_ms);
    host_free(s->ctx, s);
}

void dt_store_close(dt_store *s) { store_close(s, 0); }

int dt_store_port(const dt_store *s) { return s ? s->port : -1; }

static int store_key_ok(dt_store *s, const char *op, const char *key)
{
    size_t kl = key ? strlen(key) : 0;
    if (kl == 0 || kl > DT_STORE_MAX_KEY) {
        set_error(s->ctx, DT_EINVAL, "store_%s: key must be 1..%d bytes", op, DT_STORE_MAX_KEY);
        return 0;
    }
    return 1;
}

/* The key as the server stores it: in the store's namespace (a process
 * group's), or "/key": the job's.  NULL when too long (error set). */
static const char *store_wire_key(dt_store *s, const char *op, const char *key,
                                  char out[DT_STORE_MAX_KEY + 1])
{
    if (!store_key_ok(s, op, key))
        return NULL;
    if (key[0] == '/')
        return key + 1;
    if (!s->prefix[0])
        return key;
    if ((size_t)snprintf(out, DT_STORE_MAX_KEY + 1, "%s%s", s->prefix, key) > DT_STORE_MAX_KEY) {
        set_error(s->ctx, DT_EINVAL, "store_%s: key '%s' is too long in namespace '%s'", op, key,
                  s->prefix);
        return NULL;
    }
    return out;
}

dt_status dt_store_set(dt_store *s, const char *key_in, const void *value, size_t len)
{
    char full[DT_STORE_MAX_KEY + 1];
    if (!s)
        return DT_EINVAL;
    const char *key = store_wire_key(s, "set", key_in, full);
    if (!key)
        return DT_EINVAL;
    if (len > DT_STORE_MAX_VALUE || (len && !value))
        return set_error(s->ctx, DT_EINVAL, "store_set: value must be at most %zu bytes",
                         DT_STORE_MAX_VALUE);
    size_t kl = strlen(key), n = 1 + 2 + kl + 4 + len;
    unsigned char *req = host_alloc(s->ctx, n);
    if (!req)
        return set_error(s->ctx, DT_ENOMEM, "store_set: out of memory");
    req[0] = OP_SET;
    put_u16(req + 1, (uint32_t)kl);
    memcpy(req + 3, key, kl);
    put_u32(req + 3 + kl, (uint32_t)len);
    if (len)
        memcpy(req + 7 + kl, value, len);
    int ok = 0;
    size_t rl = 0;
    char msg[128];
    dt_status st = store_call(s, req, n, OP_SET, dt_now() + s->timeout_ms / 1000.0, msg,
                              sizeof msg, &ok, &rl);
    host_free(s->ctx, req);
    if (st == DT_OK && !ok)
        st = set_error(s->ctx, DT_EPEER, "store_set: rank 0 refused '%s'", key);
    return st;
}

dt_status dt_store_add(dt_store *s, const char *key_in, int64_t delta, int64_t *value)
{
    char full[DT_STORE_MAX_KEY + 1];
    if (!s)
        return DT_EINVAL;
    const char *key = store_wire_key(s, "add", key_in, full);
    if (!key)
        return DT_EINVAL;
    size_t kl = strlen(key);
    unsigned char req[1 + 2 + DT_STORE_MAX_KEY + 8], out[64];
    req[0] = OP_ADD;
    put_u16(req + 1, (uint32_t)kl);
    memcpy(req + 3, key, kl);
    memcpy(req + 3 + kl, &delta, sizeof delta);
    int ok = 0;
    size_t len = 0;
    dt_status st = store_call(s, req, 11 + kl, OP_ADD, dt_now() + s->timeout_ms / 1000.0, out,
                              sizeof out, &ok, &len);
    if (st != DT_OK)
        return st;
    if (!ok || len != 8)
        return set_error(s->ctx, DT_EINVAL, "store_add: rank 0 refused '%s': %.*s", key,
                         (int)(len < sizeof out ? len : sizeof out), (const char *)out);
    if (value)
        memcpy(value, out, sizeof *value);
    return DT_OK;
}

/* Rank 0's clock minus ours, by Cristian's method: the best of `rounds`
 * round trips (the least delay leaves the least doubt); *rtt its time. */
static dt_status store_clock_offset(dt_store *s, int rounds, double *offset, double *rtt)
{
    *offset = 0;
    *rtt = INFINITY;
    for (int i = 0; i < rounds; i++) {
        unsigned char req[1] = {OP_TIME}, out[64];
        int ok = 0;
        size_t len = 0;
        double t0 = dt_now();
        dt_status st = store_call(s, req, 1, OP_TIME, t0 + s->timeout_ms / 1000.0, out,
                                  sizeof out, &ok, &len);
        double t1 = dt_now();
        if (st != DT_OK)
            return st;
        if (!ok || len != 8)
            return set_error(s->ctx, DT_EPEER, "store: rank 0 did not answer the clock request");
        double server;
        memcpy(&server, out, sizeof server);
        if (t1 - t0 < *rtt) {
            *rtt = t1 - t0;
            *offset = server - (t0 + t1) / 2;
        }
    }
    return DT_OK;
}

dt_status dt_store_get(dt_store *s, const char *key_in, void *buf, size_t cap, size_t *len,
                       int timeout_ms)
{
    char full[DT_STORE_MAX_KEY + 1];
    if (!s)
        return DT_EINVAL;
    const char *key = store_wire_key(s, "get", key_in, full);
    if (!key)
        return DT_EINVAL;
    if ((cap && !buf) || !len)
        return set_error(s->ctx, DT_EINVAL, "store_get: buffer and length are required");
    if (timeout_ms <= 0)
        timeout_ms = s->timeout_ms;
    size_t kl = strlen(key);
    unsigned char req[1 + 2 + DT_STORE_MAX_KEY + 4];
    req[0] = OP_GET;
    put_u16(req + 1, (uint32_t)kl);
    memcpy(req + 3, key, kl);
    put_u32(req + 3 + kl, (uint32_t)timeout_ms);
    int ok = 0;
    /* the server parks the get up to timeout_ms; allow it 10 s more to answer */
    dt_status st = store_call(s, req, 7 + kl, OP_GET, dt_now() + (timeout_ms + 10000) / 1000.0,
                              buf, cap, &ok, len);
    if (st == DT_OK && !ok)
        st = set_error(s->ctx, DT_ETIMEDOUT, "store_get: '%s' was not set within %d ms", key,
                       timeout_ms);
    return st;
}

/* ===========================================================================
 * 14. Communicators and collectives
 *
 * A communicator owns one transport endpoint and one comm thread.  Callers
 * enqueue work items and wait on them; the thread runs them one after the
 * other with non-blocking sends and receives, driving the transport's
 * progress and sleeping on its completion queue.
 *
 * Every message's tag carries the collective's sequence number, the step and
 * the chunk; the top 12 bits of data tags carry the collective's kind and a
 * hash of its size, so mismatched data never matches a receive.  Each
 * collective also starts by sending a 32-byte header (kind, size, root, op)
 * to the right ring neighbour and receiving the left one's: ranks that call
 * different collectives see each other's header within one message latency
 * and fail with a message naming both calls, instead of hanging or mixing
 * data.  A peer silent for timeout_ms fails the call naming it.
 *
 * Algorithms: allreduce is recursive doubling (with the non-power-of-two
 * fold) up to doubling_max bytes and a ring (reduce-scatter, allgather)
 * above; broadcast is a binomial tree; allgather and reduce-scatter are the
 * ring's halves.  Messages above DT_COMM_CHUNK bytes go in chunks.
 * ======================================================================== */

/* allreduce: recursive doubling up to this many bytes, ring above.  On tcp
 * one round of whole-buffer exchange beats the ring's two rounds up to
 * 256 KiB (bench_allreduce, 2 ranks, 256 KiB: 2.0-2.4 GB/s against 1.8);
 * on libfabric shm the ring wins from 64 KiB on. */
#define DT_COMM_SMALL ((size_t)64 << 10)
#define DT_COMM_SMALL_TCP ((size_t)256 << 10)
#define DT_COMM_CHUNK ((size_t)4 << 20)    /* largest single message */
#define DT_COMM_DEFAULT_TIMEOUT_MS 30000
#define DT_COMM_MAX_XFERS 64               /* transfers in flight per step */

enum { COLL_ALLREDUCE = 1, COLL_BROADCAST, COLL_ALLGATHER, COLL_REDUCE_SCATTER, COLL_BARRIER,
       COLL_ALLTOALL, COLL_ALLREDUCE16, COLL_ALLREDUCE_SHARED, COLL_PS, COLL_P2P };
static const char *const coll_names[] = {"?", "allreduce", "broadcast", "allgather",
                                         "reduce_scatter", "barrier", "alltoall",
                                         "16-bit allreduce", "allreduce in shared memory",
                                         "parameter-server request", "send/recv"};

#define TAG_HEADER_STEP 0xFFFFu
#define TAG_CHECK_SHIFT 52

/* Memory every rank on the host maps (14.4): local rank q's part starts at
 * base + q * part.  DDP keeps its gradient buckets there, so the host's
 * allreduce reads the other ranks' gradients where backward wrote them. */
typedef struct shm_region {
    char *base;
    size_t part, total;
    int nlocal, me;
} shm_region;

struct dt_work {
    dt_comm *comm;
    int kind, root;
    dt_reduce_op op;
    float *buf;                /* allreduce, broadcast: in place; others: output */
    const float *in;
    const void *aux;           /* COLL_ALLREDUCE_SHARED: the shm_region buf lies in (our
                                  part); COLL_PS: the ps_call (18) */
    double spin_s;             /* segment waits spin this long before sleeping (0: SEG_SPIN_S) */
    void *owned;               /* freed with the work (a background request's memory) */
    int64_t n;
    uint32_t seq;
    int blame, blame_ms;       /* a timeout: the silent rank and how long it was */
    int done;
    double run_s;              /* seconds the work ran (comm thread or inline) */
    uint64_t ticket;           /* backend copy to wait for before running (0: none) */
    dt_status status;
    char msg[DT_MAX_ERROR];
    dt_work *next;
};

/* What one COLL_PS work does: a worker's request to the parameter servers
 * (section 18), run on its comm thread.  The headers live here, not on the
 * comm thread's stack: a failed request may leave posts behind it. */
enum { PS_INIT = 1, PS_PUSH, PS_PULL, PS_FINISH, PS_SPUSH, PS_SPULL, PS_HELLO, PS_CPUSH };
#define PS_MAX_SERVERS 8
typedef struct ps_msg {
    uint32_t magic, op, seq;
    int32_t status;            /* responses: DT_OK or the server's refusal */
    int64_t lo, n;             /* dense: key range; sparse: table, rows */
    int64_t clock;             /* the worker's completed steps */
    int32_t code;              /* a compressed push: its dt_compress */
    uint32_t chunk;            /* the request's data and its answer travel in pieces of
                                  this many bytes (18: "Messages") */
    int64_t k;                 /* and its entries (TOPK) */
    char err[160];
} ps_msg;
/* One message's data in pieces (18.2): piece i of `pieces` is bytes
 * [i * chunk, ...) of buf, tagged ps_tag(type, seq, i). */
typedef struct ps_stream {
    int peer, sending, type;
    uint32_t seq, next, pieces;   /* next: the first piece not yet posted */
    char *buf;
    size_t bytes;
} ps_stream;
typedef struct ps_call {
    struct dt_ps *ps;
    int op;
    int64_t lo, n;             /* dense: keys; sparse: table, ids asked for */
    float *buf;                /* push: the floats of [lo, lo+n); pull: where they go */
    int64_t clock;             /* the worker's completed steps when the call was made */
    int64_t stale;             /* a pull: the most stale server's answer */
    /* sparse: each server's distinct rows (its local row numbers), as sent */
    int64_t cnt[PS_MAX_SERVERS];
    void *msg[PS_MAX_SERVERS];     /* push: ids then rows; pull: ids */
    float *rows[PS_MAX_SERVERS];   /* pull: the answers */
    int64_t *where;            /* pull: asked id i is row where[i] / 8 of server where[i] % 8 */
    ps_msg out[2 * PS_MAX_SERVERS], in[PS_MAX_SERVERS];   /* in: by server */
    unsigned char asked[PS_MAX_SERVERS];   /* an answer is expected from this server */
    /* restarted servers (18.6): a round goes to `only` those; what was sent */
    unsigned char only[PS_MAX_SERVERS];
    int use_only;
    int64_t posted[PS_MAX_SERVERS];        /* push: floats sent to each server */
    ps_msg hello[PS_MAX_SERVERS];
    /* a compressed push: each shard's code in msg[], its entries in cnt[] */
    int code;
    size_t bytes[PS_MAX_SERVERS];
    ps_stream streams[3 * PS_MAX_SERVERS];   /* this round's data, posted as room allows */
    int nstreams;
} ps_call;

typedef struct seg_head seg_head;
typedef struct seg_rank seg_rank;

struct dt_comm {
    dt_ctx *ctx;
    int rank, world;
    int timeout_ms;
    const dt_transport_iface *tp_iface;
    dt_transport *tp;
    dt_store *store;
    char provider[64];
    uint32_t next_seq;         /* caller's side: collectives issued */
    size_t max_msg;
    size_t doubling_max;       /* allreduce: recursive doubling up to here */
    float *scratch;            /* comm thread: reduction buffer */
    size_t scratch_floats;
    dt_store *watch;           /* comm thread's own store connection: who died */
    dt_ctx *watch_errors;      /* its error sink, so the comm thread never writes ctx */
    double last_watch;
    int broken;                /* comm thread: a failure poisons the communicator */
    int waiting_on;            /* the rank a stalled collective waits for, -1: none */
    char broken_msg[DT_MAX_ERROR];
    pthread_t thread;
    int has_thread, stop;
    int running;               /* a thread is inside run_work (it owns the transport) */
    uint64_t stage_ticket;     /* the next work enqueued first waits for this backend copy
                                  (DDP on a device: its bucket's device-to-host copy) */
    int inline_small;          /* blocking calls run on the caller when the queue is empty */
    double inline_spin_s;      /* their segment waits' spin (see SEG_SPIN_INLINE_S) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    dt_work *head, *tail;
    /* hosts (14.6) and the host segment (14.4) */
    int nhosts, nlocal, local_index;
    int *local_ranks;          /* global ranks on this host, ascending */
    int *leaders;              /* lowest rank of each host, ascending */
    int leader_index;          /* our index in leaders; -1: not a leader */
    int use_segment;           /* every rank agreed: collectives go through segments */
    seg_head *seg;             /* NULL: this host has one rank, or no segment */
    seg_rank *seg_ranks;
    char *seg_data;
    size_t seg_bytes, seg_slot;
    uint32_t seg_phase, seg_chunk;
    char seg_name[64], seg_why[200];
    int seg_linked;            /* we created it and its name still exists */
    int regions_made;          /* shared regions set up so far (their store keys) */
    int ps_made;               /* parameter-server jobs joined so far (their store keys) */
    int steals_made;           /* work-stealing loaders made so far (their store keys) */
    uint32_t inc;              /* 0, or this rank's n-th restarted process (14.6: rejoined,
                                  only the parameter server's requests work) */
    int announced;             /* a restarted process told its peers it serves */
    uint32_t ps_requests;      /* parameter-server requests issued (not collectives) */
    uint64_t bytes_sent;       /* payload sent to other ranks (atomic; dt_comm_bytes_sent) */
    double clock_offset;       /* rank 0's clock minus ours, measured at rendezvous (20) */
    double clock_rtt;          /* the round trip that measured it (its uncertainty x2) */
    struct xfers *graveyard;   /* comm thread: records holding orphaned sends (14.2) */
    /* process groups (14.7) */
    dt_dist_env job;           /* this process in the whole job (rank, world, the store) */
    int *members;              /* a group's: the job rank of each group rank; NULL: the job */
    char label[96];            /* a group's: "group [1 3]: ", before its errors */
    int splits_made;           /* dt_comm_split calls so far (their store keys) */
    uint32_t *p2p_sent, *p2p_recvd;   /* point-to-point messages to / from each rank so far
                                  (caller's side; the k-th send meets the k-th receive) */
};

static const dt_transport_iface *find_transport(void)
{
#ifdef DT_WITH_FABRIC
    return dt_transport_fabric_iface();
#else
    return NULL;
#endif
}

/* --- 14.1 tags and the header --------------------------------------------- */

static uint32_t size_hash(int kind, int64_t n, int root, int op)
{
    uint64_t h = (uint64_t)n * 0x9E3779B97F4A7C15ull ^ (uint64_t)(root + 1) * 0xC2B2AE3D27D4EB4Full ^
                 (uint64_t)(op + 1) * 0x165667B19E3779F9ull;
    h ^= h >> 29;
    return (uint32_t)(((uint32_t)kind << 8) | (uint32_t)(h & 0xFF));
}

/* Receives match tags exactly: libfabric 1.17's shm provider ignores the
 * ignore mask for messages that arrive before their receive is posted.  The
 * header's tag therefore leaves the kind/size bits out, so a neighbour's
 * header always matches and its contents reveal a mismatch; data tags keep
 * them, so mismatched data can never be taken for ours. */
static uint64_t make_tag(const dt_work *w, uint32_t step, uint32_t chunk)
{
    uint64_t check = step == TAG_HEADER_STEP ? 0 : size_hash(w->kind, w->n, w->root, w->op) & 0xFFF;
    return check << TAG_CHECK_SHIFT | (uint64_t)(w->seq & 0xFFFFFF) << 28 |
           (uint64_t)(step & 0xFFFF) << 12 | (chunk & 0xFFF);
}

typedef struct coll_header {
    uint32_t magic, kind, seq, root, op, pad;
    int64_t n;
} coll_header;

static void describe_call(char *out, size_t cap, int kind, int64_t n, int root, int op)
{
    static const char *const ops[] = {"sum", "avg", "max", "min"};
    const char *name = kind >= 1 && kind <= COLL_P2P ? coll_names[kind] : "an unknown call";
    if (kind == COLL_BROADCAST)
        snprintf(out, cap, "%s(n=%lld, root=%d)", name, (long long)n, root);
    else if (kind == COLL_ALLREDUCE || kind == COLL_REDUCE_SCATTER)
        snprintf(out, cap, "%s(n=%lld, %s)", name, (long long)n, op >= 0 && op < 4 ? ops[op] : "?");
    else
        snprintf(out, cap, "%s(n=%lld)", name, (long long)n);
}

/* --- 14.2 transfers with a deadline -------------------------------------- */

static dt_status work_fail(dt_work *w, dt_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static dt_status work_fail(dt_work *w, dt_status st, const char *fmt, ...)
{
    if (w->status != DT_OK)
        return w->status;   /* keep the first cause */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->msg, sizeof w->msg, fmt, ap);
    va_end(ap);
    w->status = st;
    return st;
}

/* The ranks a transport algorithm runs over: the whole world, or one
 * leader per host in a hierarchical allreduce.  Algorithms work in group
 * indices and post to rank[index] (NULL: index is the rank). */
typedef struct grp {
    int me, size;
    const int *rank;
} grp;

static int grp_rank(const grp *g, int i) { return g->rank ? g->rank[i] : i; }

static dt_status blame_silent(dt_work *w, int who, int ms)
{
    w->blame = who;
    w->blame_ms = ms;
    return work_fail(w, DT_ETIMEDOUT, "%s #%u: rank %d sent nothing for %d ms (dead or hung?)",
                     coll_names[w->kind], w->seq, who, ms);
}

typedef struct xfers {
    grp g;
    double patience;           /* scales timeout_ms for waits; 0 means 1 */
    dt_xfer x[DT_COMM_MAX_XFERS];
    int n;
    coll_header hdr_out, hdr_in;
    dt_xfer hdr_send, hdr_recv;
    int hdr_checked, has_hdr;
    const unsigned char *gone; /* parameter server: ranks gone_base + i with gone[i] died; */
    int gone_base, gone_n;     /* their transfers are not waited for, then cancelled */
    /* a transfer with rank `peer` failed: 1 if the work goes on without it
     * (the peer is gone now), else 0 and the work fails */
    int (*write_off)(dt_comm *c, void *arg, int peer);
    void *write_off_arg;
    unsigned char cancelled[DT_COMM_MAX_XFERS];
    int orphans;               /* sends to a dead peer the transport would not let go of:
                                  this record must outlive them (kept in c->graveyard) */
    struct xfers *next_dead;
} xfers;

static int xfer_gone(const xfers *xs, int peer)
{
    return xs->gone && peer >= xs->gone_base && peer < xs->gone_base + xs->gone_n &&
           xs->gone[peer - xs->gone_base];
}

static dt_status check_dead(dt_comm *c, dt_work *w);
static void seg_heartbeat(dt_comm *c);

static dt_status post(dt_comm *c, dt_work *w, xfers *xs, int sending, int peer, uint64_t tag,
                      void *buf, size_t bytes)
{
    char err[256] = "";
    dt_status st;
    if (xs->n == DT_COMM_MAX_XFERS)
        return work_fail(w, DT_ENOTSUP, "%s: too many transfers in one step", coll_names[w->kind]);
    dt_xfer *x = &xs->x[xs->n];
    double deadline = dt_now() + c->timeout_ms / 1000.0;
    for (;;) {
        memset(x, 0, sizeof *x);
        x->peer = peer;
        st = sending ? c->tp_iface->send(c->tp, peer, tag, buf, bytes, x, err, sizeof err)
                     : c->tp_iface->recv(c->tp, peer, tag, 0, buf, bytes, x, err, sizeof err);
        if (st != DT_ETIMEDOUT || dt_now() >= deadline)
            break;
        /* back-pressured: the peer takes no data; is it alive? */
        c->last_watch = 0;
        if (check_dead(c, w) != DT_OK)
            return w->status;
        if (xfer_gone(xs, peer))   /* a dead server a parameter-server request can go without */
            return work_fail(w, DT_EPEER, "%s #%u: rank %d died", coll_names[w->kind], w->seq, peer);
    }
    if (st != DT_OK)
        return work_fail(w, st == DT_ETIMEDOUT ? st : DT_EPEER, "%s #%u: %s to rank %d failed: %s",
                         coll_names[w->kind], w->seq, sending ? "send" : "receive", peer, err);
    if (sending)
        __atomic_fetch_add(&c->bytes_sent, (uint64_t)bytes, __ATOMIC_RELAXED);
    xs->n++;
    return DT_OK;
}

/* Post a buffer in chunks of DT_COMM_CHUNK bytes, or larger where that
 * would need more than 24 (the transfer list holds DT_COMM_MAX_XFERS), and
 * never above the transport's max_msg. */
static dt_status post_chunked(dt_comm *c, dt_work *w, xfers *xs, int sending, int peer,
                              uint32_t step, void *buf, size_t bytes)
{
    size_t chunk = bytes / 24 + 1 > DT_COMM_CHUNK ? (bytes / 24 + 4) & ~(size_t)3 : DT_COMM_CHUNK;
    chunk = c->max_msg < chunk ? c->max_msg : chunk;
    uint32_t i = 0;
    size_t off = 0;
    do {
        size_t len = bytes - off < chunk ? bytes - off : chunk;
        dt_status st = post(c, w, xs, sending, peer, make_tag(w, step, i++), (char *)buf + off, len);
        if (st != DT_OK)
            return st;
        off += len;
    } while (off < bytes);
    return DT_OK;
}

/* The left neighbour's header arrived: does it describe our call? */
static dt_status check_header(dt_comm *c, dt_work *w, xfers *xs)
{
    xs->hdr_checked = 1;
    const coll_header *h = &xs->hdr_in;
    int left = grp_rank(&xs->g, (xs->g.me - 1 + xs->g.size) % xs->g.size);
    if (xs->hdr_recv.status != DT_OK)
        return work_fail(w, DT_EPEER, "%s #%u: rank %d: connection failed", coll_names[w->kind],
                         w->seq, left);
    if (xs->hdr_recv.len != sizeof *h || h->magic != 0x44545243u)
        return work_fail(w, DT_EPEER, "%s #%u: rank %d sent a malformed header",
                         coll_names[w->kind], w->seq, left);
    if ((int)h->kind != w->kind || h->n != w->n || (int)h->root != w->root || (int)h->op != (int)w->op) {
        char mine[96], theirs[96];
        describe_call(mine, sizeof mine, w->kind, w->n, w->root, (int)w->op);
        describe_call(theirs, sizeof theirs, (int)h->kind, h->n, (int)h->root, (int)h->op);
        return work_fail(w, DT_EMISMATCH, "collective #%u: rank %d called %s, rank %d called %s",
                         w->seq, c->rank, mine, left, theirs);
    }
    return DT_OK;
}

/* A stalled collective asks rank 0's store every DT_COMM_WATCH_S whether a
 * rank died, so a killed process is named in about a second instead of
 * after the timeout (and by every survivor, not just its neighbours). */
#define DT_COMM_WATCH_S 0.5

/* How long rank 0's dt_comm_free waits for the others to leave (13.3). */
#define DT_COMM_DRAIN_MS 10000

/* A failure reason as ranks publish it: "<status>|<message>". */
static dt_status fail_with_reason(dt_work *w, const char *why)
{
    char *end;
    long st = strtol(why, &end, 10);
    if (*end != '|' || st <= DT_OK || st > DT_EPEER)
        return work_fail(w, DT_EPEER, "%s", why);
    return work_fail(w, (dt_status)st, "%s", end + 1);
}

/* The first rank to fail publishes why ("abort" in the store), so ranks
 * that only see its consequences (a closed connection, silence) report the
 * cause instead.  DT_OK: nobody has. */
static dt_status published_failure(dt_comm *c, dt_work *w)
{
    char why[DT_MAX_ERROR + 8];
    size_t len = 0;
    if (!c->watch || dt_store_get(c->watch, "abort", why, sizeof why - 1, &len, 1) != DT_OK ||
        len < 3)
        return DT_OK;
    why[len < sizeof why ? len : sizeof why - 1] = '\0';
    w->status = DT_OK;   /* replace a consequence by the cause */
    return fail_with_reason(w, why);
}

/* A timed-out rank may have waited on a rank that was itself waiting on
 * another: a stalled collective publishes whom it waits for ("wait/<rank>",
 * every DT_COMM_WATCH_S), so follow that chain to the rank that is not
 * waiting in this collective, and blame it instead of a bystander. */
static void follow_waits(dt_comm *c, dt_work *w)
{
    int who = w->blame;
    for (int hops = 0; c->watch && hops < c->world; hops++) {
        char key[32], edge[32];
        size_t len = 0;
        snprintf(key, sizeof key, "wait/%d", who);
        if (dt_store_get(c->watch, key, edge, sizeof edge - 1, &len, 1) != DT_OK)
            break;
        edge[len < sizeof edge ? len : sizeof edge - 1] = '\0';
        unsigned seq;
        int next;
        if (sscanf(edge, "%u:%d", &seq, &next) != 2 || seq != w->seq || next < 0 ||
            next >= c->world || next == who)
            break;
        who = next;
    }
    if (who == w->blame)
        return;
    int waited_on = w->blame;
    w->status = DT_OK;
    work_fail(w, DT_ETIMEDOUT, "%s #%u: rank %d sent nothing for %d ms (dead or hung?); "
              "rank %d was waiting on it", coll_names[w->kind], w->seq, who, w->blame_ms, waited_on);
    w->blame = who;
}

static void publish_failure(dt_comm *c, const dt_work *w)
{
    char why[DT_MAX_ERROR + 8];
    size_t len = 0;
    if (!c->watch || dt_store_get(c->watch, "abort", why, sizeof why - 1, &len, 1) == DT_OK)
        return;   /* someone was first */
    int n = snprintf(why, sizeof why, "%d|%s", (int)w->status, w->msg);
    dt_store_set(c->watch, "abort", why, (size_t)(n < (int)sizeof why ? n : (int)sizeof why - 1) + 1);
}

/* A process group's check: deaths are recorded in the job's namespace
 * under job ranks ("/dead" the first, "/dead/<rank>" each); only a member's
 * death fails the group's work (others' the deadline still covers). */
static dt_status group_check_dead(dt_comm *c, dt_work *w)
{
    char val[16] = "", key[40];
    size_t len = 0;
    int dead = -1;
    dt_status st = dt_store_get(c->watch, "/dead", val, sizeof val - 1, &len, 1);
    if (st == DT_OK)
        dead = atoi(val);
    int g = -1;
    for (int i = 0; dead >= 0 && i < c->world; i++)
        if (c->members[i] == dead)
            g = i;
    if (g < 0 && st != DT_ETIMEDOUT && st != DT_OK)
        return c->waiting_on >= 0 && c->members[c->waiting_on] == 0
                   ? work_fail(w, DT_EPEER, "%s #%u: job rank 0 is unreachable (dead?): %s",
                               coll_names[w->kind], w->seq, c->watch_errors->err)
                   : DT_OK;
    if (g < 0 && c->waiting_on >= 0) {   /* the first death was not a member's: ours? */
        snprintf(key, sizeof key, "/dead/%d", c->members[c->waiting_on]);
        if (dt_store_get(c->watch, key, val, sizeof val - 1, &len, 1) == DT_OK)
            g = c->waiting_on;
    }
    if (g < 0)
        return DT_OK;
    return work_fail(w, DT_EPEER, "%s #%u: rank %d (job rank %d) died (its process exited "
                     "without leaving the job)", coll_names[w->kind], w->seq, g, c->members[g]);
}

static dt_status check_dead(dt_comm *c, dt_work *w)
{
    double now = dt_now();
    if (!c->watch || now - c->last_watch < DT_COMM_WATCH_S)
        return DT_OK;
    c->last_watch = now;
    if (w->kind == COLL_PS)   /* other workers may come and go: only servers matter */
        return ps_check_servers(c, w);
    char val[16] = "";
    size_t len = 0;
    /* a rank that failed published why: fail with its words */
    if (published_failure(c, w) != DT_OK)
        return w->status;
    dt_status st;
    if (c->members)
        return group_check_dead(c, w);
    st = dt_store_get(c->watch, "dead", val, sizeof val - 1, &len, 1);
    if (st == DT_ETIMEDOUT) {   /* nobody died: say whom we wait for (see follow_waits) */
        if (c->waiting_on >= 0) {
            char key[32], edge[32];
            snprintf(key, sizeof key, "wait/%d", c->rank);
            int n = snprintf(edge, sizeof edge, "%u:%d", w->seq, c->waiting_on);
            dt_store_set(c->watch, key, edge, (size_t)n + 1);
        }
        return DT_OK;
    }
    if (st == DT_OK)
        return work_fail(w, DT_EPEER, "%s #%u: rank %s died (its process exited without "
                         "leaving the job)", coll_names[w->kind], w->seq, val);
    return work_fail(w, DT_EPEER, "%s #%u: rank 0 is unreachable (dead?): %s",
                     coll_names[w->kind], w->seq, c->watch_errors->err);
}

/* Wait for every posted transfer (and the header), checking tags, until
 * the deadline; on failure cancel what is left so no buffer stays posted. */
/* Cancel the transfers to dead peers and wait (a second) until the
 * transport lets go of them; else fail, and the communicator closes its
 * endpoint rather than leave them pointing at freed memory. */
static int cancel_gone(dt_comm *c, xfers *xs)
{
    int left = 0;
    for (int i = 0; i < xs->n; i++)
        if (!xs->x[i].done && xfer_gone(xs, xs->x[i].peer)) {
            if (!xs->cancelled[i])   /* at once: a provider may hold other peers' */
                c->tp_iface->cancel(c->tp, &xs->x[i]);   /* completions behind it */
            xs->cancelled[i] = 1;
            left = 1;
        }
    return left;
}

/* Sends to a dead peer that neither complete nor cancel (a large message's
 * rendezvous on tcp;ofi_rxm, shm's answered sends) are orphaned: the
 * transport keeps them, and their records (this xfers) are kept until the
 * transport closes, so nothing it may still write is reused; the caller
 * (ps_run) goes on with a fresh record. */
static void drain_gone(dt_comm *c, xfers *xs)
{
    int left = cancel_gone(c, xs);
    for (double end = dt_now() + 1.0; left && dt_now() < end;) {
        dt_xfer *done[16];
        char err[256];
        if (c->tp_iface->poll(c->tp, done, 16, err, sizeof err) <= 0)
            c->tp_iface->wait(c->tp, 10);
        left = 0;
        for (int i = 0; i < xs->n; i++)
            left |= !xs->x[i].done && xfer_gone(xs, xs->x[i].peer);
    }
    xs->orphans = left;
}

/* Is x one of this record's transfers (not an orphan of an earlier one)? */
static int xfer_ours(const xfers *xs, const dt_xfer *x)
{
    return (x >= xs->x && x < xs->x + xs->n) || x == &xs->hdr_send || x == &xs->hdr_recv;
}

static dt_status wait_xfers(dt_comm *c, dt_work *w, xfers *xs)
{
    int limit_ms = (int)((xs->patience > 0 ? xs->patience : 1.0) * c->timeout_ms);
    double deadline = dt_now() + limit_ms / 1000.0;
    for (;;) {
        int pending = 0, silent_peer = -1;
        for (int i = 0; i < xs->n; i++) {
            if (!xs->x[i].done && !xfer_gone(xs, xs->x[i].peer)) {
                pending++;
                silent_peer = xs->x[i].peer;
            }
        }
        int hdr_pending = xs->has_hdr && (!xs->hdr_recv.done || !xs->hdr_send.done);
        if (xs->has_hdr && xs->hdr_recv.done && !xs->hdr_checked && check_header(c, w, xs) != DT_OK)
            break;
        if (!pending && !hdr_pending)
            break;
        dt_xfer *done[16];
        char err[256] = "";
        int k = c->tp_iface->poll(c->tp, done, 16, err, sizeof err);
        if (k < 0) {
            work_fail(w, DT_EPEER, "%s #%u: transport failure: %s", coll_names[w->kind], w->seq, err);
            break;
        }
        if (k > 0)
            seg_heartbeat(c);
        for (int i = 0; i < k; i++) {
            dt_xfer *x = done[i];
            if (!xfer_ours(xs, x))
                continue;   /* an orphaned send (drain_gone) let go at last */
            if (x->status != DT_OK && x != &xs->hdr_recv && !xfer_gone(xs, x->peer) &&
                !(xs->write_off && xs->write_off(c, xs->write_off_arg, x->peer)))
                work_fail(w, x->status == DT_EMISMATCH ? DT_EMISMATCH : DT_EPEER,
                          "%s #%u: transfer with rank %d failed (%s)", coll_names[w->kind], w->seq,
                          x->peer, dt_strerror(x->status));
        }
        if (w->status != DT_OK)
            break;
        int who = xs->has_hdr && !xs->hdr_recv.done
                      ? grp_rank(&xs->g, (xs->g.me - 1 + xs->g.size) % xs->g.size)
                      : silent_peer;
        c->waiting_on = who;
        if (k == 0 && check_dead(c, w) != DT_OK)
            break;
        if (k == 0 && xs->gone)
            cancel_gone(c, xs);
        if (k == 0) {
            if (dt_now() >= deadline) {
                blame_silent(w, who, limit_ms);
                break;
            }
            c->tp_iface->wait(c->tp, ms_left(deadline) < 50 ? ms_left(deadline) : 50);
        }
    }
    if (w->status != DT_OK) {
        for (int i = 0; i < xs->n; i++)
            if (!xs->x[i].done)
                c->tp_iface->cancel(c->tp, &xs->x[i]);
        if (xs->has_hdr && !xs->hdr_recv.done)
            c->tp_iface->cancel(c->tp, &xs->hdr_recv);
        if (xs->has_hdr && !xs->hdr_send.done)
            c->tp_iface->cancel(c->tp, &xs->hdr_send);
        return w->status;
    }
    if (xs->gone)
        drain_gone(c, xs);
    if (xs->orphans)
        return DT_OK;   /* the caller moves to a fresh record */
    memset(xs->cancelled, 0, (size_t)xs->n);
    xs->n = 0;
    return DT_OK;
}

/* Send our header right and receive the left one's; checked while the
 * collective's data moves. */
static dt_status start_header(dt_comm *c, dt_work *w, xfers *xs)
{
    grp g = xs->g;
    double patience = xs->patience;
    memset(xs, 0, sizeof *xs);
    xs->g = g;
    xs->patience = patience;
    if (g.size == 1)
        return DT_OK;
    xs->has_hdr = 1;
    xs->hdr_out = (coll_header){0x44545243u, (uint32_t)w->kind, w->seq, (uint32_t)w->root,
                                (uint32_t)w->op, 0, w->n};
    int right = grp_rank(&g, (g.me + 1) % g.size), left = grp_rank(&g, (g.me - 1 + g.size) % g.size);
    char err[256] = "";
    uint64_t tag = make_tag(w, TAG_HEADER_STEP, 0);
    double deadline = dt_now() + c->timeout_ms / 1000.0;
    dt_status st;
    if (c->tp_iface->recv(c->tp, left, tag, 0, &xs->hdr_in, sizeof xs->hdr_in,
                          &xs->hdr_recv, err, sizeof err) != DT_OK)
        return work_fail(w, DT_EPEER, "%s #%u: cannot post a receive from rank %d: %s",
                         coll_names[w->kind], w->seq, left, err);
    while ((st = c->tp_iface->send(c->tp, right, tag, &xs->hdr_out, sizeof xs->hdr_out,
                                   &xs->hdr_send, err, sizeof err)) == DT_ETIMEDOUT &&
           dt_now() < deadline) {
        c->last_watch = 0;   /* back-pressured: is rank `right` alive? */
        if (check_dead(c, w) != DT_OK)
            break;
    }
    if (w->status == DT_OK && st != DT_OK)
        work_fail(w, st == DT_ETIMEDOUT ? st : DT_EPEER, "%s #%u: cannot send to rank %d: %s",
                  coll_names[w->kind], w->seq, right, err);
    if (w->status != DT_OK) {
        c->tp_iface->cancel(c->tp, &xs->hdr_recv);
        xs->has_hdr = 0;
        return w->status;
    }
    return DT_OK;
}

/* --- 14.3 the algorithms ----------------------------------------------------- */

/* dst op= src; the two never overlap (restrict lets the loops vectorise) */
static void reduce_into(float *restrict dst, const float *restrict src, int64_t n, dt_reduce_op op)
{
    if (op == DT_REDUCE_MAX)
        for (int64_t i = 0; i < n; i++)
            dst[i] = src[i] > dst[i] ? src[i] : dst[i];
    else if (op == DT_REDUCE_MIN)
        for (int64_t i = 0; i < n; i++)
            dst[i] = src[i] < dst[i] ? src[i] : dst[i];
    else
        for (int64_t i = 0; i < n; i++)
            dst[i] += src[i];
}

static float *comm_scratch(dt_comm *c, dt_work *w, int64_t n)
{
    if ((size_t)n <= c->scratch_floats)
        return c->scratch;
    float *p = c->ctx->al.realloc_fn(c->scratch, (size_t)n * sizeof(float), c->ctx->al.user);
    if (!p) {
        work_fail(w, DT_ENOMEM, "%s: out of memory for %lld floats", coll_names[w->kind],
                  (long long)n);
        return NULL;
    }
    c->scratch = p;
    c->scratch_floats = (size_t)n;
    return p;
}

/* Exchange with one peer: send `out`, receive into `in`, same size. */
static dt_status exchange(dt_comm *c, dt_work *w, xfers *xs, int peer, uint32_t step, float *out,
                          float *in, int64_t n)
{
    size_t bytes = (size_t)n * sizeof(float);
    if (post_chunked(c, w, xs, 0, peer, step, in, bytes) != DT_OK ||
        post_chunked(c, w, xs, 1, peer, step, out, bytes) != DT_OK)
        return w->status;
    return wait_xfers(c, w, xs);
}

/* Recursive doubling; ranks beyond the largest power of two fold into it
 * first and get the result back at the end. */
static dt_status allreduce_doubling(dt_comm *c, dt_work *w, xfers *xs, float *buf, int64_t n)
{
    const grp *g = &xs->g;
    int p2 = 1;
    while (p2 * 2 <= g->size)
        p2 *= 2;
    int r = g->me, extra = g->size - p2;
    float *tmp = comm_scratch(c, w, n);
    if (!tmp)
        return w->status;
    size_t bytes = (size_t)n * sizeof(float);
    uint32_t step = 0;
    if (r >= p2) {          /* fold into r - p2, then wait for the answer */
        if (post_chunked(c, w, xs, 1, grp_rank(g, r - p2), step, buf, bytes) != DT_OK ||
            post_chunked(c, w, xs, 0, grp_rank(g, r - p2), step + 1000, buf, bytes) != DT_OK)
            return w->status;
        return wait_xfers(c, w, xs);
    }
    if (r < extra) {
        if (post_chunked(c, w, xs, 0, grp_rank(g, r + p2), step, tmp, bytes) != DT_OK ||
            wait_xfers(c, w, xs) != DT_OK)
            return w->status;
        reduce_into(buf, tmp, n, w->op);
    }
    for (int mask = 1; mask < p2; mask <<= 1) {
        step++;
        if (exchange(c, w, xs, grp_rank(g, r ^ mask), step, buf, tmp, n) != DT_OK)
            return w->status;
        /* the same order on both sides keeps every rank's result identical */
        if (r < (r ^ mask)) {
            reduce_into(buf, tmp, n, w->op);
        } else {
            reduce_into(tmp, buf, n, w->op);
            memcpy(buf, tmp, bytes);
        }
    }
    if (r < extra) {
        if (post_chunked(c, w, xs, 1, grp_rank(g, r + p2), 1000, buf, bytes) != DT_OK)
            return w->status;
        return wait_xfers(c, w, xs);
    }
    return DT_OK;
}

/* [lo, hi) of block b when n is cut into `parts` near-equal blocks */
static void block_range(int64_t n, int parts, int b, int64_t *lo, int64_t *hi)
{
    *lo = n / parts * b + (b < n % parts ? b : n % parts);
    *hi = *lo + n / parts + (b < n % parts);
}

/* Ring reduce-scatter over buf cut into world blocks: afterwards block
 * (rank + 1) % world holds the full reduction. */
static dt_status ring_reduce_scatter(dt_comm *c, dt_work *w, xfers *xs, float *buf, int64_t n)
{
    int P = xs->g.size, r = xs->g.me;
    int right = grp_rank(&xs->g, (r + 1) % P), left = grp_rank(&xs->g, (r - 1 + P) % P);
    int64_t blo, bhi;
    block_range(n, P, 0, &blo, &bhi);
    float *tmp = comm_scratch(c, w, bhi - blo + 1);
    if (!tmp)
        return w->status;
    for (int s = 0; s < P - 1; s++) {
        int send_b = (r - s + P) % P, recv_b = (r - s - 1 + 2 * P) % P;
        int64_t slo, shi, rlo, rhi;
        block_range(n, P, send_b, &slo, &shi);
        block_range(n, P, recv_b, &rlo, &rhi);
        if (post_chunked(c, w, xs, 0, left, (uint32_t)s, tmp, (size_t)(rhi - rlo) * sizeof(float)) != DT_OK ||
            post_chunked(c, w, xs, 1, right, (uint32_t)s, buf + slo, (size_t)(shi - slo) * sizeof(float)) != DT_OK ||
            wait_xfers(c, w, xs) != DT_OK)
            return w->status;
        reduce_into(buf + rlo, tmp, rhi - rlo, w->op);
    }
    return DT_OK;
}

/* Ring allgather: block (rank + 1 - first) % world is complete here at the
 * start; after P-1 steps every block is. */
static dt_status ring_allgather(dt_comm *c, dt_work *w, xfers *xs, float *buf, int64_t n, int first,
                                uint32_t step0)
{
    int P = xs->g.size, r = xs->g.me;
    int right = grp_rank(&xs->g, (r + 1) % P), left = grp_rank(&xs->g, (r - 1 + P) % P);
    for (int s = 0; s < P - 1; s++) {
        int send_b = (r + first - s + P) % P, recv_b = (r + first - s - 1 + 2 * P) % P;
        int64_t slo, shi, rlo, rhi;
        block_range(n, P, send_b, &slo, &shi);
        block_range(n, P, recv_b, &rlo, &rhi);
        if (post_chunked(c, w, xs, 0, left, step0 + (uint32_t)s, buf + rlo, (size_t)(rhi - rlo) * sizeof(float)) != DT_OK ||
            post_chunked(c, w, xs, 1, right, step0 + (uint32_t)s, buf + slo, (size_t)(shi - slo) * sizeof(float)) != DT_OK ||
            wait_xfers(c, w, xs) != DT_OK)
            return w->status;
    }
    return DT_OK;
}

static void finish_avg(dt_comm *c, dt_work *w, float *buf, int64_t n)
{
    if (w->op == DT_REDUCE_AVG) {
        float k = 1.0f / (float)c->world;
        for (int64_t i = 0; i < n; i++)
            buf[i] *= k;
    }
}

/* Allreduce over the group in xs, without the average's final scaling. */
static dt_status allreduce_transport(dt_comm *c, dt_work *w, xfers *xs)
{
    int P = xs->g.size;
    if (w->kind == COLL_BARRIER && P > 2) {
        /* The header ring only proves the left neighbour arrived; an
         * allreduce of one float proves everyone did. */
        float one = 0;
        return allreduce_doubling(c, w, xs, &one, 1);
    }
    if (P == 1 || w->n == 0)
        return DT_OK;
    if ((size_t)w->n * sizeof(float) <= c->doubling_max || w->n < P)
        return allreduce_doubling(c, w, xs, w->buf, w->n);
    if (ring_reduce_scatter(c, w, xs, w->buf, w->n) != DT_OK)
        return w->status;
    return ring_allgather(c, w, xs, w->buf, w->n, 1, (uint32_t)P);
}

static dt_status run_allreduce(dt_comm *c, dt_work *w, xfers *xs)
{
    if (allreduce_transport(c, w, xs) != DT_OK)
        return w->status;
    finish_avg(c, w, w->buf, w->n);
    return DT_OK;
}

/* binomial tree from root */
static dt_status run_broadcast(dt_comm *c, dt_work *w, xfers *xs)
{
    int P = c->world, vr = (c->rank - w->root + P) % P;
    size_t bytes = (size_t)w->n * sizeof(float);
    int mask = 1;
    while (mask < P) {                 /* receive from the parent */
        if (vr & mask) {
            int parent = (vr - mask + w->root) % P;
            if (post_chunked(c, w, xs, 0, parent, (uint32_t)mask, w->buf, bytes) != DT_OK ||
                wait_xfers(c, w, xs) != DT_OK)
                return w->status;
            break;
        }
        mask <<= 1;
    }
    for (mask >>= 1; mask > 0; mask >>= 1) {   /* send to the children */
        if (vr + mask < P && post_chunked(c, w, xs, 1, (vr + mask + w->root) % P, (uint32_t)mask,
                                          w->buf, bytes) != DT_OK)
            return w->status;
    }
    return wait_xfers(c, w, xs);
}

static dt_status run_allgather(dt_comm *c, dt_work *w, xfers *xs)
{
    if (w->n == 0)
        return DT_OK;
    memcpy(w->buf + (int64_t)c->rank * w->n, w->in, (size_t)w->n * sizeof(float));
    if (c->world == 1)
        return DT_OK;
    /* blocks are exactly n each: total world*n cut into world blocks */
    return ring_allgather(c, w, xs, w->buf, w->n * c->world, 0, 0);
}

static dt_status run_reduce_scatter(dt_comm *c, dt_work *w, xfers *xs)
{
    int64_t total = w->n * c->world;
    float *work = c->ctx->al.malloc_fn((size_t)(total ? total : 1) * sizeof(float), c->ctx->al.user);
    if (!work)
        return work_fail(w, DT_ENOMEM, "reduce_scatter: out of memory");
    memcpy(work, w->in, (size_t)total * sizeof(float));
    dt_status st = c->world > 1 && w->n > 0 ? ring_reduce_scatter(c, w, xs, work, total) : DT_OK;
    if (st == DT_OK) {
        /* the complete block here is (rank + 1) % world; one more ring step
         * would move it, so send it to its owner instead */
        int P = c->world, have = (c->rank + 1) % P, want_from = (c->rank - 1 + P) % P;
        if (P > 1 && w->n > 0) {
            if (post_chunked(c, w, xs, 0, want_from, 5000, w->buf, (size_t)w->n * sizeof(float)) == DT_OK &&
                post_chunked(c, w, xs, 1, have, 5000, work + (int64_t)have * w->n,
                             (size_t)w->n * sizeof(float)) == DT_OK)
                wait_xfers(c, w, xs);
            st = w->status;
        } else {
            memcpy(w->buf, work, (size_t)w->n * sizeof(float));
        }
        if (st == DT_OK)
            finish_avg(c, w, w->buf, w->n);
    }
    c->ctx->al.free_fn(work, c->ctx->al.user);
    return st;
}

/* Alltoall: block q of in goes to rank q, block p of buf comes from rank p.
 * Step s sends to rank + s and receives from rank - s, so every pair of
 * ranks exchanges once and no rank waits on two peers at a time. */
static dt_status run_alltoall(dt_comm *c, dt_work *w, xfers *xs)
{
    int P = c->world, r = c->rank;
    size_t bytes = (size_t)w->n * sizeof(float);
    if (w->n == 0)
        return DT_OK;
    memcpy(w->buf + (int64_t)r * w->n, w->in + (int64_t)r * w->n, bytes);
    for (int s = 1; s < P; s++) {
        int to = (r + s) % P, from = (r - s + P) % P;
        if (post_chunked(c, w, xs, 0, from, (uint32_t)s, w->buf + (int64_t)from * w->n, bytes) != DT_OK ||
            post_chunked(c, w, xs, 1, to, (uint32_t)s, (void *)(w->in + (int64_t)to * w->n), bytes) != DT_OK ||
            wait_xfers(c, w, xs) != DT_OK)
            return w->status;
    }
    return DT_OK;
}

/* --- 14.4 the host segment ------------------------------------------------ */
/*
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
#define SEG_MAGIC 0x44545347u
#define SEG_SLOT_DEFAULT ((size_t)1 << 20)
#define SEG_CHUNK_LARGE ((size_t)256 << 10)   /* chunk of buffers above SEG_LARGE */
#define SEG_LARGE ((size_t)4 << 20)
#define SEG_ONE_PHASE ((size_t)16 << 10)   /* allreduce: one phase, every rank reduces all */
#define SEG_SPIN_S 50e-6                   /* spin this long before sleeping */
#define SEG_SPIN_INLINE_S 20e-3

struct seg_rank {
    _Alignas(128) _Atomic uint32_t phase;   /* phases this rank has published */
    _Atomic uint32_t sleepers;              /* ranks asleep on `phase` */
    _Atomic uint32_t call_phase;            /* first phase of the call described below */
    _Atomic uint32_t progress;              /* a leader's transfers completing between hosts */
    _Atomic uint32_t kind, seq, root, op;
    _Atomic int64_t n;
};

struct seg_head {
    uint32_t magic, nlocal;
    uint64_t slot_bytes, total_bytes;
    _Atomic uint32_t aborted;
    char why[DT_MAX_ERROR + 4];             /* status digit, '|', message */
};

static size_t seg_ranks_offset(void) { return (sizeof(seg_head) + 127) & ~(size_t)127; }
static size_t seg_data_offset(int nlocal)
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

static float *seg_slot(dt_comm *c, int q, uint32_t chunk)
{
    return (float *)(c->seg_data + ((size_t)q * 2 + (chunk & 1)) * c->seg_slot);
}

/* A leader's transfers between hosts completed: the host's other ranks,
 * waiting for its result, see it alive. */
static void seg_heartbeat(dt_comm *c)
{
    if (c->seg && c->local_index == 0)
        atomic_fetch_add_explicit(&c->seg_ranks[0].progress, 1, memory_order_relaxed);
}

/* Tell the other local ranks this call failed, and why. */
static void seg_abort(dt_comm *c, const dt_work *w)
{
    seg_head *h = c->seg;
    uint32_t none = 0;
    if (!h || !atomic_compare_exchange_strong(&h->aborted, &none, 2))
        return;   /* another rank's reason is there (or being written) */
    snprintf(h->why, sizeof h->why, "%d|%s", (int)w->status, w->msg);
    atomic_store(&h->aborted, 1);   /* 1: the reason is complete */
    for (int q = 0; q < c->nlocal; q++)
        futex_wake_all(&c->seg_ranks[q].phase);
}

static dt_status seg_aborted(dt_comm *c, dt_work *w)
{
    for (int i = 0; i < 100000 && atomic_load(&c->seg->aborted) == 2; i++)
        cpu_relax();   /* its writer is a few instructions from done */
    if (atomic_load(&c->seg->aborted) != 1)
        return work_fail(w, DT_EPEER, "%s #%u: a rank on this host failed", coll_names[w->kind],
                         w->seq);
    return fail_with_reason(w, c->seg->why);
}

/* Wait until local rank q has published phase `want`.  The timeout counts
 * from q's last sign of life: a phase, or (a leader busy between hosts) a
 * completed transfer.  `patience` scales it: a rank waiting on its leader's
 * inter-host step allows more, so the leader's own, more precise error
 * comes first. */
static dt_status seg_wait(dt_comm *c, dt_work *w, int q, uint32_t want, double patience)
{
    seg_rank *r = &c->seg_ranks[q];
    double start = dt_now(), deadline = start + patience * c->timeout_ms / 1000.0;
    uint32_t seen = atomic_load_explicit(&r->progress, memory_order_relaxed);
    for (unsigned spin = 1;; spin++) {
        if (phase_reached(atomic_load_explicit(&r->phase, memory_order_acquire), want))
            return DT_OK;
        if (atomic_load_explicit(&c->seg->aborted, memory_order_acquire))
            return seg_aborted(c, w);
        if (spin % 16) {
            cpu_relax();
            continue;
        }
        double now = dt_now();
        if (now - start < (w->spin_s > 0 ? w->spin_s : SEG_SPIN_S)) {
            sched_yield();   /* several ranks per core: let the one we wait for run */
            continue;
        }
        c->waiting_on = c->local_ranks[q];
        if (check_dead(c, w) != DT_OK) {
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
            deadline = now + patience * c->timeout_ms / 1000.0;
        }
        if (now >= deadline)
            return blame_silent(w, c->local_ranks[q], (int)(patience * c->timeout_ms));
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
static uint32_t seg_announce(dt_comm *c, const dt_work *w)
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
            describe_call(mine, sizeof mine, w->kind, w->n, w->root, (int)w->op);
            describe_call(theirs, sizeof theirs, kind, n, root, op);
            if (seq != w->seq)
                return work_fail(w, DT_EMISMATCH, "collective #%u: rank %d called %s, rank %d is "
                                 "at collective #%u, %s", w->seq, c->rank, mine,
                                 c->local_ranks[q], seq, theirs);
            return work_fail(w, DT_EMISMATCH, "collective #%u: rank %d called %s, rank %d called %s",
                             w->seq, c->rank, mine, c->local_ranks[q], theirs);
        }
    }
    return DT_OK;
}

/* Publish our next phase and wait for every local rank to reach it; p0
 * nonzero: this is the call's first phase (seg_announce never returns 0),
 * check the descriptors. */
static dt_status seg_sync(dt_comm *c, dt_work *w, uint32_t p0, double patience)
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

/* Floats per chunk for a buffer of n floats.  Up to 4 MiB, whole slots:
 * fewer phases.  Above, 256 KiB chunks: every rank's two slots stay in
 * cache while the user buffers stream (bench_allreduce, 2 ranks: 1 MiB
 * chunks ran 16 MiB at 5.7 GB/s and 256 KiB chunks at 9).  Chunking never
 * changes the arithmetic, only where the phases fall. */
static int64_t seg_chunk_floats(const dt_comm *c, int64_t n)
{
    size_t bytes = (size_t)n * sizeof(float) > SEG_LARGE && c->seg_slot > SEG_CHUNK_LARGE
                       ? SEG_CHUNK_LARGE : c->seg_slot;
    return (int64_t)(bytes / sizeof(float));
}

/* dst (outside the segment) = every local rank's [lo, lo+cnt) of chunk g,
 * reduced in local-rank order. */
static void seg_reduce_block(dt_comm *c, float *dst, uint32_t g, int64_t lo, int64_t cnt,
                             dt_reduce_op op)
{
    reduce2(dst, seg_slot(c, 0, g) + lo, seg_slot(c, 1, g) + lo, cnt, op);
    for (int q = 2; q < c->nlocal; q++)
        reduce_into(dst, seg_slot(c, q, g) + lo, cnt, op);
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
static dt_status seg_allreduce(dt_comm *c, dt_work *w, int to_all, int scale)
{
    int L = c->nlocal, me = c->local_index;
    size_t bytes = (size_t)w->n * sizeof(float);
    uint32_t p0 = seg_announce(c, w);
    if (bytes <= SEG_ONE_PHASE && bytes <= c->seg_slot) {   /* every rank (or the leader) reduces it all */
        uint32_t g = c->seg_chunk++;
        if (bytes)
            seg_put(c, seg_slot(c, me, g), w->buf, bytes);
        if (seg_sync(c, w, p0, 1.0) != DT_OK)
            return w->status;
        if (w->n > 0 && (to_all || me == 0))
            seg_reduce_block(c, w->buf, g, 0, w->n, w->op);
        if (scale)
            finish_avg(c, w, w->buf, w->n);
        return DT_OK;
    }
    int64_t per = seg_chunk_floats(c, w->n);
    for (int64_t off = 0; off < w->n; off += per) {
        int64_t cnt = w->n - off < per ? w->n - off : per, lo, hi;
        uint32_t g = c->seg_chunk++;
        float *mine = seg_slot(c, me, g), *out = w->buf + off;
        seg_put(c, mine, out, (size_t)cnt * sizeof(float));
        if (seg_sync(c, w, off == 0 ? p0 : 0, 1.0) != DT_OK)
            return w->status;
        block_range(cnt, L, me, &lo, &hi);
        seg_reduce_block(c, out + lo, g, lo, hi - lo, w->op);
        if (scale)
            finish_avg(c, w, out + lo, hi - lo);
        seg_put(c, mine + lo, out + lo, (size_t)(hi - lo) * sizeof(float));
        if (seg_sync(c, w, 0, 1.0) != DT_OK)
            return w->status;
        for (int q = 0; q < L && (to_all || me == 0); q++) {
            if (q == me)
                continue;
            block_range(cnt, L, q, &lo, &hi);
            memcpy(out + lo, seg_slot(c, q, g) + lo, (size_t)(hi - lo) * sizeof(float));
        }
    }
    return DT_OK;
}

/* Local rank `from` gives buf to the host's other ranks.  p0 nonzero: the
 * call's first phase (announced); patience: see seg_wait. */
static dt_status seg_broadcast(dt_comm *c, dt_work *w, int from, float *buf, int64_t n, uint32_t p0,
                               double patience)
{
    int64_t per = seg_chunk_floats(c, n), off = 0;
    do {
        int64_t cnt = n - off < per ? n - off : per;
        uint32_t g = c->seg_chunk++;
        if (c->local_index == from && cnt > 0)
            seg_put(c, seg_slot(c, from, g), buf + off, (size_t)cnt * sizeof(float));
        if (seg_sync(c, w, off == 0 ? p0 : 0, patience) != DT_OK)
            return w->status;
        if (c->local_index != from && cnt > 0)
            memcpy(buf + off, seg_slot(c, from, g), (size_t)cnt * sizeof(float));
        off += cnt;
    } while (off < n);
    return DT_OK;
}

/* Every rank's n floats into out[rank * n], ranks all on this host. */
static dt_status seg_allgather(dt_comm *c, dt_work *w)
{
    int64_t per = seg_chunk_floats(c, w->n), off = 0, n = w->n;
    uint32_t p0 = seg_announce(c, w);
    do {
        int64_t cnt = n - off < per ? n - off : per;
        uint32_t g = c->seg_chunk++;
        if (cnt > 0)
            seg_put(c, seg_slot(c, c->local_index, g), w->in + off, (size_t)cnt * sizeof(float));
        if (seg_sync(c, w, off == 0 ? p0 : 0, 1.0) != DT_OK)
            return w->status;
        for (int q = 0; q < c->nlocal && cnt > 0; q++)
            memcpy(w->buf + (int64_t)c->local_ranks[q] * n + off, seg_slot(c, q, g),
                   (size_t)cnt * sizeof(float));
        off += cnt;
    } while (off < n);
    return DT_OK;
}

/* out = block `rank` of every rank's in (world blocks of n), reduced. */
static dt_status seg_reduce_scatter(dt_comm *c, dt_work *w)
{
    int L = c->nlocal, me = c->local_index;
    int64_t per = seg_chunk_floats(c, w->n * L) / L, off = 0, n = w->n;
    per = per > 0 ? per : 1;
    uint32_t p0 = seg_announce(c, w);
    do {
        int64_t cnt = n - off < per ? n - off : per;
        uint32_t g = c->seg_chunk++;
        float *mine = seg_slot(c, me, g);
        for (int q = 0; q < L && cnt > 0; q++)   /* block of local rank q, at q * cnt */
            seg_put(c, mine + q * cnt, w->in + (int64_t)c->local_ranks[q] * n + off,
                   (size_t)cnt * sizeof(float));
        if (seg_sync(c, w, off == 0 ? p0 : 0, 1.0) != DT_OK)
            return w->status;
        if (cnt > 0)
            seg_reduce_block(c, w->buf + off, g, me * cnt, cnt, w->op);
        off += cnt;
    } while (off < n);
    finish_avg(c, w, w->buf, n);
    return DT_OK;
}

/* Alltoall inside the host: each rank puts the blocks meant for the others
 * in its slot; each reads its own block from every slot. */
static dt_status seg_alltoall(dt_comm *c, dt_work *w)
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
        float *slot = seg_slot(c, me, g);
        for (int q = 0; q < L && cnt > 0; q++)   /* the block for local rank q, at q * cnt */
            if (q != me)
                seg_put(c, slot + q * cnt, w->in + (int64_t)c->local_ranks[q] * n + off,
                        (size_t)cnt * sizeof(float));
        if (seg_sync(c, w, off == 0 ? p0 : 0, 1.0) != DT_OK)
            return w->status;
        for (int q = 0; q < L && cnt > 0; q++)
            if (q != me)
                memcpy(w->buf + (int64_t)c->local_ranks[q] * n + off, seg_slot(c, q, g) + me * cnt,
                       (size_t)cnt * sizeof(float));
        off += cnt;
    } while (off < n);
    return DT_OK;
}

/* Allreduce of a buffer in a shared region (DDP's buckets): no copy into
 * slots.  Once every rank's buffer is final, local rank k reduces block k
 * of all of them, in local-rank order as seg_reduce_block does (so results
 * are bit-identical to the slot path), into its own buffer; then each rank
 * copies the other blocks from their owners' buffers.  A last phase keeps
 * every buffer unwritten until nobody reads it.  Per rank that moves
 * about 2(L-1)/L of the buffer, against 3 + (L-1)/L through the slots. */
static dt_status seg_allreduce_shared(dt_comm *c, dt_work *w)
{
    const shm_region *r = w->aux;
    int L = c->nlocal, me = c->local_index;
    size_t off = (size_t)((char *)w->buf - (r->base + (size_t)me * r->part));
    int64_t lo, hi, n = w->n;
    uint32_t p0 = seg_announce(c, w);
    if (seg_sync(c, w, p0, 1.0) != DT_OK)
        return w->status;
    block_range(n, L, me, &lo, &hi);
    float tile[2048];
    for (int64_t i = lo; i < hi; i += 2048) {
        int64_t cnt = hi - i < 2048 ? hi - i : 2048;
        const float *part0 = (const float *)(r->base + off) + i;
        reduce2(tile, part0, (const float *)(r->base + r->part + off) + i, cnt, w->op);
        for (int q = 2; q < L; q++)
            reduce_into(tile, (const float *)(r->base + (size_t)q * r->part + off) + i, cnt, w->op);
        finish_avg(c, w, tile, cnt);
        memcpy(w->buf + i, tile, (size_t)cnt * sizeof(float));
    }
    if (seg_sync(c, w, 0, 1.0) != DT_OK)
        return w->status;
    for (int q = 0; q < L; q++) {
        if (q == me)
            continue;
        int64_t qlo, qhi;
        block_range(n, L, q, &qlo, &qhi);
        memcpy(w->buf + qlo, (const float *)(r->base + (size_t)q * r->part + off) + qlo,
               (size_t)(qhi - qlo) * sizeof(float));
    }
    /* what the other ranks read of ours: our part of their blocks, and our block */
    uint64_t read_by_others = (uint64_t)(n - (hi - lo)) + (uint64_t)(L - 1) * (uint64_t)(hi - lo);
    __atomic_fetch_add(&c->bytes_sent, read_by_others * sizeof(float), __ATOMIC_RELAXED);
    return seg_sync(c, w, 0, 1.0);
}

/* --- 16-bit allreduce: bf16 or fp16 on the wire ---------------------------
 * root says which (1 bf16, 2 fp16).  Each rank encodes its buffer in
 * P blocks; an alltoall gives rank r every rank's block r; rank r sums them
 * in rank order in fp32 (and averages), encodes its block again, and an
 * allgather gives everyone every block.  All ranks decode the same bytes,
 * so all get the same values; each rank sends 2 x (P-1)/P x 2 bytes per
 * value, half of the fp32 ring's, at any P. */
static void enc16(int codec, const float *x, int64_t n, uint16_t *out)
{
    for (int64_t i = 0; i < n; i++)
        out[i] = codec == 1 ? f32_to_bf16(x[i]) : f32_to_f16(x[i]);
}

static float dec16(int codec, uint16_t h) { return codec == 1 ? bf16_to_f32(h) : f16_to_f32(h); }

/* A part of w run as its own kind of collective, same sequence number. */
static dt_work sub_work(const dt_work *w, int kind, const float *in, float *buf, int64_t n)
{
    dt_work sub = *w;
    sub.kind = kind;
    sub.in = in;
    sub.buf = buf;
    sub.n = n;
    return sub;
}

static dt_status sub_result(dt_work *w, const dt_work *sub)
{
    if (sub->status != DT_OK && w->status == DT_OK) {
        w->status = sub->status;
        snprintf(w->msg, sizeof w->msg, "%s", sub->msg);
        w->blame = sub->blame;
        w->blame_ms = sub->blame_ms;
    }
    return w->status;
}

static dt_status allreduce16(dt_comm *c, dt_work *w, xfers *xs, int on_segment)
{
    int P = c->world, r = c->rank, codec = w->root;
    int64_t n = w->n, B = (n + P - 1) / P, Bf = (B + 1) / 2;   /* Bf floats hold B halves */
    if (n == 0)
        return DT_OK;
    size_t bytes = (size_t)(2 * P * Bf + B) * sizeof(float);
    float *mem = c->ctx->al.malloc_fn(bytes, c->ctx->al.user);
    if (!mem)
        return work_fail(w, DT_ENOMEM, "16-bit allreduce: out of memory");
    memset(mem, 0, bytes);
    float *send = mem, *recv = mem + (int64_t)P * Bf, *acc = recv + (int64_t)P * Bf;
    for (int q = 0; q < P; q++) {
        int64_t lo = q * B < n ? q * B : n, hi = lo + B < n ? lo + B : n;
        enc16(codec, w->buf + lo, hi - lo, (uint16_t *)(send + (int64_t)q * Bf));
    }
    if (!on_segment && xs->has_hdr) {   /* the call's header first: the parts below have none */
        if (wait_xfers(c, w, xs) != DT_OK)
            goto out;
        xs->has_hdr = 0;
    }
    dt_work sub = sub_work(w, COLL_ALLTOALL, send, recv, Bf);
    if (sub_result(w, (on_segment ? seg_alltoall(c, &sub) : run_alltoall(c, &sub, xs), &sub)) != DT_OK)
        goto out;
    int64_t mlo = r * B < n ? r * B : n, mn = (mlo + B < n ? mlo + B : n) - mlo;
    for (int p = 0; p < P; p++) {   /* rank order: the same sum everywhere */
        const uint16_t *h = (const uint16_t *)(recv + (int64_t)p * Bf);
        for (int64_t i = 0; i < mn; i++)
            acc[i] += dec16(codec, h[i]);
    }
    if (w->op == DT_REDUCE_AVG)
        for (int64_t i = 0; i < mn; i++)
            acc[i] /= (float)P;
    memset(send, 0, (size_t)Bf * sizeof(float));
    enc16(codec, acc, mn, (uint16_t *)send);
    dt_work sub2 = sub_work(w, COLL_ALLGATHER, send, recv, Bf);
    if (sub_result(w, (on_segment ? seg_allgather(c, &sub2) : run_allgather(c, &sub2, xs), &sub2)) != DT_OK)
        goto out;
    for (int q = 0; q < P; q++) {
        int64_t lo = q * B < n ? q * B : n, hi = lo + B < n ? lo + B : n;
        const uint16_t *h = (const uint16_t *)(recv + (int64_t)q * Bf);
        for (int64_t i = lo; i < hi; i++)
            w->buf[i] = dec16(codec, h[i - lo]);
    }
out:
    c->ctx->al.free_fn(mem, c->ctx->al.user);
    return w->status;
}

/* Every rank on this host: the collective over the segment alone. */
static dt_status run_on_segment(dt_comm *c, dt_work *w)
{
    switch (w->kind) {
    case COLL_ALLREDUCE: case COLL_BARRIER: return seg_allreduce(c, w, 1, 1);
    case COLL_BROADCAST: {
        int from = 0;
        while (c->local_ranks[from] != w->root)
            from++;
        uint32_t p0 = seg_announce(c, w);
        return seg_broadcast(c, w, from, w->buf, w->n, p0, 1.0);
    }
    case COLL_ALLGATHER: return seg_allgather(c, w);
    case COLL_REDUCE_SCATTER: return seg_reduce_scatter(c, w);
    case COLL_ALLTOALL: return seg_alltoall(c, w);
    case COLL_ALLREDUCE16: return allreduce16(c, w, NULL, 1);
    case COLL_ALLREDUCE_SHARED: return seg_allreduce_shared(c, w);
    }
    return work_fail(w, DT_EINVAL, "unknown collective %d", w->kind);
}

static dt_status run_flat(dt_comm *c, dt_work *w, xfers *xs)
{
    switch (w->kind) {
    case COLL_ALLREDUCE: case COLL_BARRIER: case COLL_ALLREDUCE_SHARED: run_allreduce(c, w, xs); break;
    case COLL_BROADCAST: run_broadcast(c, w, xs); break;
    case COLL_ALLGATHER: run_allgather(c, w, xs); break;
    case COLL_REDUCE_SCATTER: run_reduce_scatter(c, w, xs); break;
    case COLL_ALLTOALL: run_alltoall(c, w, xs); break;
    case COLL_ALLREDUCE16: allreduce16(c, w, xs, 0); break;
    }
    if (w->status == DT_OK)
        wait_xfers(c, w, xs);   /* the header, if the data finished first */
    return w->status;
}

/* Ranks on several hosts.  Allreduce (and barrier): reduce inside the host
 * to its leader over the segment, allreduce between leaders over the
 * transport, give the result back over the segment.  The other collectives
 * run over the transport between all ranks; the segment and the leaders'
 * headers still check that every rank called the same thing. */
static dt_status run_hierarchical(dt_comm *c, dt_work *w, xfers *xs)
{
    int reduce = w->kind == COLL_ALLREDUCE || w->kind == COLL_BARRIER;
    if (c->seg) {
        if (reduce ? seg_allreduce(c, w, 0, 0) : seg_sync(c, w, seg_announce(c, w), 1.0))
            return w->status;
    }
    if (c->local_index == 0) {
        /* more patient than the waits inside a host, so a rank hung there is
         * named by its own leader before the other hosts blame the leader */
        xs->g = (grp){c->leader_index, c->nhosts, c->leaders};
        xs->patience = 1.5;
        if (start_header(c, w, xs) != DT_OK)
            return w->status;
        if (reduce && allreduce_transport(c, w, xs) == DT_OK)
            finish_avg(c, w, w->buf, w->n);
        if (w->status != DT_OK || wait_xfers(c, w, xs) != DT_OK)
            return w->status;
    }
    if (reduce)
        return c->seg ? seg_broadcast(c, w, 0, w->buf, w->n, 0, 2.0) : DT_OK;
    xs->g = (grp){c->rank, c->world, NULL};
    xs->has_hdr = 0;   /* checked above */
    xs->patience = 1.0;
    return run_flat(c, w, xs);
}

/* --- 14.4b point to point ------------------------------------------------- */

/* One dt_send / dt_recv / dt_sendrecv: a send to dst and a receive from src
 * (either may be absent), posted together so an exchange cannot deadlock.
 * Tags: the check bits say "point to point" (no collective has them), the
 * sequence is the pair's message count, so the k-th send from a rank meets
 * the k-th receive posted for it; large messages go in max_msg chunks. */
typedef struct p2p_call {
    const float *send;
    int64_t ns;
    int dst;
    float *recv;
    int64_t nr;
    int src;
    uint32_t sseq, rseq;
} p2p_call;

static uint64_t p2p_tag(uint32_t seq, uint32_t chunk)
{
    return (uint64_t)(COLL_P2P << 8) << TAG_CHECK_SHIFT | (uint64_t)(seq & 0xFFFFFF) << 28 |
           (uint64_t)(chunk & 0xFFFFFFu);
}

static void run_p2p(dt_comm *c, dt_work *w, xfers *xs)
{
    const p2p_call *p = w->aux;
    size_t chunk = c->max_msg, sb = (size_t)p->ns * sizeof(float), rb = (size_t)p->nr * sizeof(float);
    size_t rchunks = 0;
    for (size_t off = 0, k = 0; p->nr >= 0 && p->src >= 0 && (off < rb || k == 0); off += chunk, k++) {
        size_t len = rb - off < chunk ? rb - off : chunk;
        rchunks++;
        if (post(c, w, xs, 0, p->src, p2p_tag(p->rseq, (uint32_t)k), (char *)p->recv + off, len) !=
            DT_OK)
            return;
    }
    for (size_t off = 0, k = 0; p->dst >= 0 && (off < sb || k == 0); off += chunk, k++) {
        size_t len = sb - off < chunk ? sb - off : chunk;
        if (post(c, w, xs, 1, p->dst, p2p_tag(p->sseq, (uint32_t)k), (char *)p->send + off, len) !=
            DT_OK)
            return;
    }
    if (wait_xfers(c, w, xs) != DT_OK)
        return;
    size_t got = 0;   /* the receives came first in xs (wait_xfers keeps them) */
    for (size_t i = 0; p->src >= 0 && i < rchunks; i++)
        got += xs->x[i].len;
    if (p->src >= 0 && got != rb)
        work_fail(w, DT_EMISMATCH, "recv: rank %d sent %zu floats, %lld expected", p->src,
                  got / sizeof(float), (long long)p->nr);
}

static void run_work(dt_comm *c, dt_work *w)
{
    if (w->ticket)   /* its data is still on the way from the device (even if it won't go) */
        c->ctx->be_iface->copy_wait(c->ctx->be, w->ticket);
    if (c->broken) {
        work_fail(w, DT_ESTATE, "%s #%u: communicator failed earlier: %s", coll_names[w->kind],
                  w->seq, c->broken_msg);
        return;
    }

    c->waiting_on = -1;
    xfers *xs = c->ctx->al.malloc_fn(sizeof *xs, c->ctx->al.user);
    if (!xs) {
        work_fail(w, DT_ENOMEM, "%s: out of memory", coll_names[w->kind]);
    } else {
        memset(xs, 0, sizeof *xs);
        xs->g = (grp){c->rank, c->world, NULL};
        if (w->kind == COLL_PS)
            ps_run(c, w, &xs);
        else if (w->kind == COLL_P2P)
            run_p2p(c, w, xs);
        else if (c->use_segment && c->nhosts == 1)
            run_on_segment(c, w);
        else if (c->use_segment)
            run_hierarchical(c, w, xs);
        else if (start_header(c, w, xs) == DT_OK)
            run_flat(c, w, xs);
    }
    /* A lost connection or a silent peer is usually the consequence of
     * another rank's failure: report the cause if one was published, else
     * publish ours, so every rank of every host fails with the same words. */
    if (w->status == DT_EPEER || w->status == DT_ETIMEDOUT)
        published_failure(c, w);
    if (w->status == DT_ETIMEDOUT && w->blame >= 0)
        follow_waits(c, w);
    if (w->status != DT_OK)
        publish_failure(c, w);
    if (w->status != DT_OK) {
        /* Close the endpoint now: a cancelled receive must not land in
         * this record or in the caller's buffer after the call returned.
         * The communicator refuses all later work anyway. */
        c->broken = 1;
        snprintf(c->broken_msg, sizeof c->broken_msg, "%s", w->msg);
        seg_abort(c, w);
        c->tp_iface->close(c->tp);
        c->tp = NULL;
    }
    if (xs)
        c->ctx->al.free_fn(xs, c->ctx->al.user);
}

/* --- 14.5 the comm thread and the caller's side --------------------------- */

static void *comm_main(void *arg)
{
    dt_comm *c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->stop && !c->head)
            pthread_cond_wait(&c->cv, &c->mu);
        if (!c->head)
            break;   /* stop requested and the queue is drained */
        if (c->running) {   /* the caller runs one inline; wait for it to finish */
            pthread_cond_wait(&c->cv, &c->mu);
            continue;
        }
        dt_work *w = c->head;
        c->head = w->next;
        if (!c->head)
            c->tail = NULL;
        c->running = 1;
        pthread_mutex_unlock(&c->mu);
        double t0 = dt_now();
        run_work(c, w);
        double t1 = dt_now();
        w->run_s = t1 - t0;
        prof_coll(c, w, t0, t1);
        pthread_mutex_lock(&c->mu);
        c->running = 0;
        w->done = 1;
        pthread_cond_broadcast(&c->cv);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* A restarted rank's communicator (14.6) runs no collective: the others
 * are mid-job, and nothing would match. */
static dt_status rejoined_refuses(dt_comm *c, int kind)
{
    if (!c->inc || kind == COLL_PS)
        return DT_OK;
    return set_error(c->ctx, DT_ESTATE, "%s: rank %d is a restarted process that rejoined a "
                     "running job; only parameter-server requests work on its communicator",
                     coll_names[kind], c->rank);
}

static dt_work *enqueue_in(dt_comm *c, int kind, float *buf, const float *in, int64_t n, int root,
                           dt_reduce_op op, const void *aux)
{
    dt_ctx *ctx = c->ctx;
    if (rejoined_refuses(c, kind) != DT_OK)
        return NULL;
    dt_work *w = host_calloc(ctx, sizeof *w);
    if (!w) {
        set_error(ctx, DT_ENOMEM, "%s: out of memory", coll_names[kind]);
        return NULL;
    }
    *w = (dt_work){.comm = c, .kind = kind, .root = root, .op = op, .buf = buf, .in = in, .n = n,
                   .aux = aux, .blame = -1, .ticket = c->stage_ticket};
    c->stage_ticket = 0;
    pthread_mutex_lock(&c->mu);
    /* collectives' order only: requests and point-to-point messages have their own */
    w->seq = kind == COLL_PS ? c->ps_requests++ : kind == COLL_P2P ? 0 : c->next_seq++;
    if (c->tail)
        c->tail->next = w;
    else
        c->head = w;
    c->tail = w;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return w;
}

static dt_work *enqueue(dt_comm *c, int kind, float *buf, const float *in, int64_t n, int root,
                        dt_reduce_op op)
{
    return enqueue_in(c, kind, buf, in, n, root, op, NULL);
}

/* Wait for w, free it, and give the seconds it ran (run_s may be NULL). */
static dt_status work_finish(dt_work *w, double *run_s)
{
    dt_comm *c = w->comm;
    pthread_mutex_lock(&c->mu);
    while (!w->done)
        pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
    dt_status st = w->status;
    if (st != DT_OK)
        set_error(c->ctx, st, "%s%s", c->label, w->msg);
    if (run_s)
        *run_s = w->run_s;
    host_free(c->ctx, w->owned);
    host_free(c->ctx, w);
    return st;
}

dt_status dt_work_wait(dt_work *w)
{
    if (!w)
        return DT_EINVAL;
    dt_ctx *ctx = w->comm->ctx;
    double t0 = prof_begin(ctx);
    dt_status st = work_finish(w, NULL);
    prof_end(ctx, PH_COMM_WAIT, t0);
    return st;
}

static int coll_args_ok(dt_comm *c, const char *op, const void *buf, int64_t n)
{
    if (!c)
        return 0;
    if (n < 0 || (n > 0 && !buf) || n > INT64_MAX / 4 / (c->world ? c->world : 1)) {
        set_error(c->ctx, DT_EINVAL, "%s: buffer is NULL or n = %lld is out of range", op,
                  (long long)n);
        return 0;
    }
    return 1;
}

static int op_ok(dt_comm *c, const char *name, dt_reduce_op op)
{
    if (op < DT_REDUCE_SUM || op > DT_REDUCE_MIN) {
        set_error(c->ctx, DT_EINVAL, "%s: unknown reduction %d", name, (int)op);
        return 0;
    }
    return 1;
}

dt_work *dt_allreduce_async(dt_comm *c, float *buf, int64_t n, dt_reduce_op op)
{
    if (!coll_args_ok(c, "allreduce", buf, n) || !op_ok(c, "allreduce", op))
        return NULL;
    return enqueue(c, COLL_ALLREDUCE, buf, NULL, n, 0, op);
}

/* A blocking collective with nothing queued ahead of it runs right here on
 * the caller's thread: handing it to the sleeping comm thread and being
 * woken back costs two kernel wake-ups, two thirds of a 4 KiB allreduce
 * (tests/bench/allreduce.sh profile).  `running` keeps the comm thread off
 * the transport meanwhile. */
static dt_status run_inline(dt_comm *c, int kind, float *buf, const float *in, int64_t n,
                            int root, dt_reduce_op op, const void *aux)
{
    pthread_mutex_lock(&c->mu);
    if (c->head || c->running) {
        pthread_mutex_unlock(&c->mu);
        return DT_ESTATE;   /* busy: queue it instead */
    }
    c->running = 1;
    dt_work w = {.comm = c, .kind = kind, .root = root, .op = op, .buf = buf, .in = in, .n = n,
                 .aux = aux, .spin_s = c->inline_spin_s, .blame = -1};
    w.seq = kind == COLL_P2P ? 0 : c->next_seq++;
    pthread_mutex_unlock(&c->mu);
    double t0 = dt_now();
    run_work(c, &w);
    prof_coll(c, &w, t0, dt_now());
    pthread_mutex_lock(&c->mu);
    c->running = 0;
    if (c->head)   /* the comm thread waits for us only when work is queued */
        pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    if (w.status != DT_OK)
        set_error(c->ctx, w.status, "%s%s", c->label, w.msg);
    return w.status;
}

static dt_status run_collective_wait(dt_comm *c, int kind, float *buf, const float *in,
                                     int64_t n, int root, dt_reduce_op op, const void *aux)
{
    if (rejoined_refuses(c, kind) != DT_OK)
        return DT_ESTATE;
    if (c->inline_small) {
        dt_status st = run_inline(c, kind, buf, in, n, root, op, aux);
        if (st != DT_ESTATE || c->broken)
            return st;
    }
    dt_work *w = enqueue_in(c, kind, buf, in, n, root, op, aux);
    return w ? work_finish(w, NULL) : c->ctx->last_status;
}

/* A blocking collective: the caller's wait is communication it sees. */
static dt_status run_collective_in(dt_comm *c, int kind, float *buf, const float *in, int64_t n,
                                   int root, dt_reduce_op op, const void *aux)
{
    double t0 = prof_begin(c->ctx);
    dt_status st = run_collective_wait(c, kind, buf, in, n, root, op, aux);
    prof_end(c->ctx, PH_COMM_WAIT, t0);
    return st;
}

static dt_status run_collective(dt_comm *c, int kind, float *buf, const float *in, int64_t n,
                                int root, dt_reduce_op op)
{
    return run_collective_in(c, kind, buf, in, n, root, op, NULL);
}

dt_status dt_allreduce(dt_comm *c, float *buf, int64_t n, dt_reduce_op op)
{
    if (!c)
        return DT_EINVAL;
    if (!coll_args_ok(c, "allreduce", buf, n) || !op_ok(c, "allreduce", op))
        return DT_EINVAL;
    return run_collective(c, COLL_ALLREDUCE, buf, NULL, n, 0, op);
}

dt_status dt_broadcast(dt_comm *c, float *buf, int64_t n, int root)
{
    if (!coll_args_ok(c, "broadcast", buf, n))
        return DT_EINVAL;
    if (root < 0 || root >= c->world)
        return set_error(c->ctx, DT_EINVAL, "broadcast: root %d is not a rank of %d", root,
                         c->world);
    return run_collective(c, COLL_BROADCAST, buf, NULL, n, root, DT_REDUCE_SUM);
}

dt_status dt_allgather(dt_comm *c, const float *in, int64_t n, float *out)
{
    if (!coll_args_ok(c, "allgather", in, n) || !coll_args_ok(c, "allgather", out, n))
        return DT_EINVAL;
    return run_collective(c, COLL_ALLGATHER, out, in, n, 0, DT_REDUCE_SUM);
}

dt_status dt_reduce_scatter(dt_comm *c, const float *in, int64_t n, float *out, dt_reduce_op op)
{
    if (!coll_args_ok(c, "reduce_scatter", in, n) || !coll_args_ok(c, "reduce_scatter", out, n) ||
        !op_ok(c, "reduce_scatter", op))
        return DT_EINVAL;
    return run_collective(c, COLL_REDUCE_SCATTER, out, in, n, 0, op);
}

dt_status dt_alltoall(dt_comm *c, const float *in, int64_t n, float *out)
{
    if (!coll_args_ok(c, "alltoall", in, n) || !coll_args_ok(c, "alltoall", out, n))
        return DT_EINVAL;
    return run_collective(c, COLL_ALLTOALL, out, in, n, 0, DT_REDUCE_SUM);
}

dt_status dt_barrier(dt_comm *c)
{
    if (!c)
        return DT_EINVAL;
    float unused = 0;   /* n = 0: never read; the call blocks until done */
    return run_collective(c, COLL_BARRIER, &unused, NULL, 0, 0, DT_REDUCE_SUM);
}

static dt_status p2p_run(dt_comm *c, const float *send, int64_t ns, int dst, float *recv,
                         int64_t nr, int src)
{
    if (!c)
        return DT_EINVAL;
    const char *op = dst >= 0 && src >= 0 ? "sendrecv" : dst >= 0 ? "send" : "recv";
    if ((dst >= 0 && !coll_args_ok(c, op, send, ns)) || (src >= 0 && !coll_args_ok(c, op, recv, nr)))
        return DT_EINVAL;
    if (dst >= c->world || src >= c->world || dst == c->rank || src == c->rank)
        return set_error(c->ctx, DT_EINVAL, "%s: peer %d: must be another rank of 0..%d", op,
                         dst == c->rank || dst >= c->world ? dst : src, c->world - 1);
    if ((size_t)(ns > nr ? ns : nr) * sizeof(float) / (c->max_msg ? c->max_msg : 1) >= 0xFFFFFF)
        return set_error(c->ctx, DT_EINVAL, "%s: message too large", op);
    p2p_call call = {send, ns, dst, recv, nr, src, 0, 0};
    pthread_mutex_lock(&c->mu);   /* counted in call order, like the peer's */
    if (dst >= 0)
        call.sseq = c->p2p_sent[dst]++;
    if (src >= 0)
        call.rseq = c->p2p_recvd[src]++;
    pthread_mutex_unlock(&c->mu);
    return run_collective_in(c, COLL_P2P, recv, send, dst >= 0 ? ns : nr, dst >= 0 ? dst : src,
                             DT_REDUCE_SUM, &call);
}

dt_status dt_send(dt_comm *c, const float *buf, int64_t n, int dst)
{
    return p2p_run(c, buf, n, dst < 0 ? INT32_MAX : dst, NULL, 0, -1);
}

dt_status dt_recv(dt_comm *c, float *buf, int64_t n, int src)
{
    return p2p_run(c, NULL, 0, -1, buf, n, src < 0 ? INT32_MAX : src);
}

dt_status dt_sendrecv(dt_comm *c, const float *send, int64_t ns, int dst, float *recv, int64_t nr,
                      int src)
{
    return p2p_run(c, send, ns, dst < 0 ? INT32_MAX : dst, recv, nr, src < 0 ? INT32_MAX : src);
}

/* --- 14.6 joining the job ------------------------------------------------- */

void dt_comm_config_init(dt_comm_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    dt_store_config_init(&cfg->store);
}

int dt_comm_rank(const dt_comm *c) { return c ? c->rank : -1; }
int dt_comm_size(const dt_comm *c) { return c ? c->world : 0; }
const char *dt_comm_transport(const dt_comm *c) { return c ? c->provider : ""; }
int dt_comm_hosts(const dt_comm *c) { return c ? (c->nhosts > 0 ? c->nhosts : 1) : 0; }
uint64_t dt_comm_bytes_sent(const dt_comm *c)
{
    return c ? __atomic_load_n(&c->bytes_sent, __ATOMIC_RELAXED) : 0;
}

const char *dt_comm_intra_host(const dt_comm *c)
{
    return !c ? "" : c->use_segment ? "segment" : c->seg_why[0] ? c->seg_why : "transport";
}

/* A rank whose address is already in the store is a restarted process
 * whose predecessor died (a launcher restarting a failed parameter server):
 * it becomes incarnation n + 1 of its rank, says so in its store hellos
 * (so its own death is told apart from its predecessor's), swaps its new
 * address in without the collectives the first start runs (the others
 * are mid-job), and publishes "inc/<rank>" last, when it can be reached.
 * Peers that talk to it (18.6) read that key and swap the address in. */
static dt_status find_rejoin(dt_comm *c, const dt_dist_env *env, const dt_comm_config *cfg)
{
    dt_ctx *ctx = c->ctx;
    char key[48], val[16];
    unsigned char addr[512];
    size_t len = 0;
    if (c->world == 1)
        return DT_OK;
    snprintf(key, sizeof key, "addr/%d", c->rank);
    dt_status st = dt_store_get(c->store, key, addr, sizeof addr, &len, 1);
    if (st == DT_ETIMEDOUT) {   /* the first process of this rank (the usual case) */
        dt_clear_error(ctx);
        return DT_OK;
    }
    if (st != DT_OK)
        return st;
    uint32_t before = 0;   /* the last process started for this rank (0: the first) */
    snprintf(key, sizeof key, "tries/%d", c->rank);
    if (dt_store_get(c->store, key, val, sizeof val - 1, &len, 1) == DT_OK) {
        val[len < sizeof val ? len : sizeof val - 1] = '\0';
        before = (uint32_t)strtoul(val, NULL, 10);
    }
    dt_clear_error(ctx);
    dead_key(key, sizeof key, c->rank, before);
    st = dt_store_get(c->store, key, val, sizeof val, &len, c->timeout_ms);
    if (st == DT_ETIMEDOUT)
        return set_error(ctx, DT_ESTATE, "comm: rank %d is already in the job and alive (its "
                         "address is registered, its process has not died): two processes "
                         "started with one rank?", c->rank);
    if (st != DT_OK)
        return st;
    dt_dist_env e = *env;
    e.master_port = dt_store_port(c->store);
    dt_store *again = store_open(ctx, &e, &cfg->store, 0, before + 1);
    if (!again)
        return ctx->last_status;
    dt_store_close(c->store);
    c->store = again;
    c->inc = before + 1;
    /* counted once our hellos say who we are (so our end is recorded):
     * a number is never handed out twice */
    snprintf(key, sizeof key, "tries/%d", c->rank);
    snprintf(val, sizeof val, "%u", c->inc);
    return dt_store_set(c->store, key, val, strlen(val) + 1);
}

/* The rejoined process is ready (its receives are posted: 18.6 calls this
 * when it starts serving): tell its peers. */
static dt_status announce_rejoin(dt_comm *c)
{
    char key[32], val[16];
    if (!c->inc || c->announced)
        return DT_OK;
    c->announced = 1;
    snprintf(key, sizeof key, "inc/%d", c->rank);
    snprintf(val, sizeof val, "%u", c->inc);
    return dt_store_set(c->store, key, val, strlen(val) + 1);
}

/* Comm thread: rank `peer` restarted as incarnation inc; send to and
 * receive from its address (read from the store) from now on.  The caller has cancelled or
 * drained every transfer with the old one. */
static dt_status comm_replace_peer(dt_comm *c, int peer, uint32_t inc, char *err, size_t err_len)
{
    char key[32];
    unsigned char addr[512];
    size_t len = 0;
    snprintf(key, sizeof key, "addr/%d.%u", peer, inc);   /* that process's, not a later one's */
    if (!c->watch || dt_store_get(c->watch, key, addr, sizeof addr, &len, c->timeout_ms) != DT_OK) {
        snprintf(err, err_len, "rank %d's new address: %.200s", peer,
                 c->watch ? c->watch_errors->err : "no store");
        return DT_EPEER;
    }
    if (len > sizeof addr) {
        snprintf(err, err_len, "rank %d's new address is too long", peer);
        return DT_EPEER;
    }
    return c->tp_iface->replace_peer(c->tp, peer, addr, len, err, err_len);
}

/* Publish this rank's host name and read everyone's: ranks with the same
 * name share a host (its segment, and one leader in the hierarchy). */
static dt_status find_hosts(dt_comm *c, const dt_comm_config *cfg)
{
    dt_ctx *ctx = c->ctx;
    char me[DT_MAX_HOST] = "", key[32];
    const char *id = cfg->host_id ? cfg->host_id : getenv("DTRAIN_HOST_ID");
    if (id && *id)
        snprintf(me, sizeof me, "%s", id);
    else
        gethostname(me, sizeof me - 1);
    snprintf(key, sizeof key, "host/%d", c->rank);
    dt_status st = dt_store_set(c->store, key, me, strlen(me) + 1);
    char (*names)[DT_MAX_HOST] = host_calloc(ctx, sizeof *names * (size_t)c->world);
    c->local_ranks = host_alloc(ctx, sizeof(int) * (size_t)c->world);
    c->leaders = host_alloc(ctx, sizeof(int) * (size_t)c->world);
    if (st == DT_OK && (!names || !c->local_ranks || !c->leaders))
        st = set_error(ctx, DT_ENOMEM, "comm: out of memory");
    for (int r = 0; st == DT_OK && r < c->world; r++) {
        size_t len = 0;
        snprintf(key, sizeof key, "host/%d", r);
        st = dt_store_get(c->store, key, names[r], DT_MAX_HOST - 1, &len, 0);
        names[r][len < DT_MAX_HOST ? len : DT_MAX_HOST - 1] = '\0';
    }
    c->leader_index = -1;
    for (int r = 0; st == DT_OK && r < c->world; r++) {
        int first = 1;   /* lowest rank with this name: the host's leader */
        for (int q = 0; q < r && first; q++)
            first = strcmp(names[q], names[r]) != 0;
        if (first) {
            if (r == c->rank)
                c->leader_index = c->nhosts;
            c->leaders[c->nhosts++] = r;
        }
        if (strcmp(names[r], me) == 0) {
            if (r == c->rank)
                c->local_index = c->nlocal;
            c->local_ranks[c->nlocal++] = r;
        }
    }
    host_free(ctx, names);
    return st;
}

/* The host's leader creates the segment and publishes its name; the other
 * local ranks map it.  *ok: this rank has it (or needs none). */
static dt_status map_segment(dt_comm *c, int *ok)
{
    char key[32], why[160] = "";
    int L = c->nlocal, leader = c->local_ranks[0], fd = -1;
    *ok = 0;
    const char *sl = getenv("DTRAIN_SEGMENT_SLOT_KIB");
    c->seg_slot = sl && atoi(sl) >= 64 ? (size_t)atoi(sl) << 10 : SEG_SLOT_DEFAULT;
    c->seg_bytes = seg_data_offset(L) + (size_t)L * 2 * c->seg_slot;
    snprintf(key, sizeof key, "seg/%d", leader);
    if (c->local_index == 0) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        snprintf(c->seg_name, sizeof c->seg_name, "/dtrain-%d-%lx", (int)getpid(),
                 (unsigned long)ts.tv_nsec ^ (unsigned long)ts.tv_sec << 20);
        fd = shm_open(c->seg_name, O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd >= 0)
            c->seg_linked = 1;
        /* reserve the pages now: a full /dev/shm is an error here, not a
         * SIGBUS in the middle of a collective */
        int err = fd < 0 ? errno : posix_fallocate(fd, 0, (off_t)c->seg_bytes);
        if (err)
            snprintf(why, sizeof why, "%s", strerror(err));
        const char *val = err ? "" : c->seg_name;
        dt_status st = dt_store_set(c->store, key, val, strlen(val) + 1);
        if ((st != DT_OK || err) && fd >= 0) {
            close(fd);
            fd = -1;
        }
        if (st != DT_OK)
            return st;
    } else {
        size_t len = 0;
        dt_status st = dt_store_get(c->store, key, c->seg_name, sizeof c->seg_name - 1, &len, 0);
        if (st != DT_OK)
            return st;
        c->seg_name[len < sizeof c->seg_name ? len : sizeof c->seg_name - 1] = '\0';
        if (c->seg_name[0] && (fd = shm_open(c->seg_name, O_RDWR, 0)) < 0)
            snprintf(why, sizeof why, "%s", strerror(errno));
    }
    struct stat sb;
    if (fd >= 0 && (fstat(fd, &sb) != 0 || (size_t)sb.st_size != c->seg_bytes)) {
        if (!why[0])
            snprintf(why, sizeof why, "its size is not %zu bytes (ranks disagree on "
                     "DTRAIN_SEGMENT_SLOT_KIB?)", c->seg_bytes);
        close(fd);
        fd = -1;
    }
    if (fd >= 0) {
        void *p = mmap(NULL, c->seg_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        if (p == MAP_FAILED)
            snprintf(why, sizeof why, "mmap: %s", strerror(errno));
        else
            c->seg = p;
    }
    if (!c->seg) {   /* not an error: every rank falls back to the transport */
        snprintf(c->seg_why, sizeof c->seg_why, "no host segment: %s",
                 why[0] ? why : "the host's leader could not create one");
        return DT_OK;
    }
    c->seg_ranks = (seg_rank *)((char *)c->seg + seg_ranks_offset());
    c->seg_data = (char *)c->seg + seg_data_offset(L);
    if (c->local_index == 0) {
        c->seg->magic = SEG_MAGIC;
        c->seg->nlocal = (uint32_t)L;
        c->seg->slot_bytes = c->seg_slot;
        c->seg->total_bytes = c->seg_bytes;
    }
    *ok = 1;
    return DT_OK;
}

static void unmap_segment(dt_comm *c)
{
    if (c->seg)
        munmap(c->seg, c->seg_bytes);
    c->seg = NULL;
    if (c->seg_linked)
        shm_unlink(c->seg_name);
    c->seg_linked = 0;
}

/* A shared region (see shm_region): every local rank gets a part of
 * part_bytes, every rank maps all parts.  Collective over the communicator
 * when all its ranks share this host's segment; elsewhere, or if any rank
 * cannot map it or sets DTRAIN_SHARED_BUCKETS=0, *ok is 0 on every rank and
 * nothing is mapped (not an error: callers use private memory).  The name
 * is unlinked once every rank has it open, so nothing outlives the job.
 * Free with shared_region_free. */
static void shared_region_free(shm_region *r);
static dt_status shared_region_map(dt_comm *c, size_t part_bytes, shm_region *r, int *ok)
{
    *ok = 0;
    memset(r, 0, sizeof *r);
    if (!c->use_segment || !c->seg || c->nhosts != 1)
        return DT_OK;
    int L = c->nlocal, fd = -1, created = 0;
    size_t part = (part_bytes + 4095) & ~(size_t)4095, total = part * (size_t)L;
    char key[DT_STORE_MAX_KEY], name[80] = "";
    snprintf(key, sizeof key, "shared%s/%d", c->seg_name, c->regions_made++);
    dt_status st = DT_OK;
    if (c->local_index == 0) {
        snprintf(name, sizeof name, "%s-r%d", c->seg_name, c->regions_made);
        fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
        created = fd >= 0;
        if (fd >= 0 && posix_fallocate(fd, 0, (off_t)total) != 0) {   /* see map_segment */
            close(fd);
            fd = -1;
        }
        st = dt_store_set(c->store, key, fd >= 0 ? name : "", fd >= 0 ? strlen(name) + 1 : 1);
    } else {
        size_t len = 0;
        st = dt_store_get(c->store, key, name, sizeof name - 1, &len, c->timeout_ms);
        name[len < sizeof name ? len : sizeof name - 1] = '\0';
        if (st == DT_OK && name[0])
            fd = shm_open(name, O_RDWR, 0);
    }
    struct stat sb;
    if (fd >= 0 && fstat(fd, &sb) == 0 && (size_t)sb.st_size == total) {
        void *p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p != MAP_FAILED)
            *r = (shm_region){.base = p, .part = part, .total = total, .nlocal = L,
                              .me = c->local_index};
    }
    if (fd >= 0)
        close(fd);
    const char *env = getenv("DTRAIN_SHARED_BUCKETS");
    float agree = r->base && !(env && strcmp(env, "0") == 0) ? 1.0f : 0.0f;
    if (st == DT_OK)
        st = dt_allreduce(c, &agree, 1, DT_REDUCE_MIN);   /* also: every rank has it open */
    if (created)
        shm_unlink(name);
    if (st != DT_OK || agree < 1.0f)
        shared_region_free(r);
    *ok = st == DT_OK && r->base;
    return st;
}

static void shared_region_free(shm_region *r)
{
    if (r->base)
        munmap(r->base, r->total);
    memset(r, 0, sizeof *r);
}

/* Segments are used only if every rank wants them and got one: a rank that
 * could not map its host's would otherwise wait on the others forever. */
static dt_status setup_segments(dt_comm *c, const dt_comm_config *cfg)
{
    dt_ctx *ctx = c->ctx;
    const char *mode = cfg->intra_host ? cfg->intra_host : getenv("DTRAIN_INTRA_HOST");
    int want = 1;
    if (mode && strcmp(mode, "transport") == 0)
        want = 0;
    else if (mode && *mode && strcmp(mode, "segment") != 0)
        return set_error(ctx, DT_EINVAL, "comm: intra-host mode '%s' is neither 'segment' nor "
                         "'transport'", mode);
    if (c->world == 1)
        return DT_OK;
    int ok = want;
    if (want && c->nlocal > 1 && map_segment(c, &ok) != DT_OK)
        return ctx->last_status;
    char key[32], val[4];
    snprintf(key, sizeof key, "segok/%d", c->rank);
    dt_status st = dt_store_set(c->store, key, ok ? "1" : "0", 2);
    c->use_segment = 1;
    for (int r = 0; st == DT_OK && r < c->world; r++) {
        size_t len = 0;
        snprintf(key, sizeof key, "segok/%d", r);
        st = dt_store_get(c->store, key, val, sizeof val, &len, 0);
        if (st == DT_OK && val[0] != '1')
            c->use_segment = 0;
    }
    if (st == DT_OK && !c->use_segment)
        unmap_segment(c);
    return st;
}

static dt_status exchange_addresses(dt_comm *c)
{
    dt_ctx *ctx = c->ctx;
    char err[256] = "", key[32];
    unsigned char mine[512];
    size_t len = sizeof mine;
    if (c->tp_iface->get_addr(c->tp, mine, &len, err, sizeof err) != DT_OK)
        return set_error(ctx, DT_EIO, "comm: transport address: %s", err);
    snprintf(key, sizeof key, "addr/%d", c->rank);
    dt_status st = dt_store_set(c->store, key, mine, len);
    snprintf(key, sizeof key, "addr/%d.%u", c->rank, c->inc);   /* (a restart's, for 14.6) */
    if (st == DT_OK && c->inc)
        st = dt_store_set(c->store, key, mine, len);
    unsigned char *all = host_alloc(ctx, (size_t)c->world * sizeof mine);
    const void **ptrs = host_alloc(ctx, sizeof *ptrs * (size_t)c->world);
    size_t *lens = host_alloc(ctx, sizeof *lens * (size_t)c->world);
    if (st == DT_OK && (!all || !ptrs || !lens))
        st = set_error(ctx, DT_ENOMEM, "comm: out of memory");
    for (int r = 0; st == DT_OK && r < c->world; r++) {
        snprintf(key, sizeof key, "addr/%d", r);
        ptrs[r] = all + (size_t)r * sizeof mine;
        st = dt_store_get(c->store, key, all + (size_t)r * sizeof mine, sizeof mine, &lens[r], 0);
        if (st == DT_OK && lens[r] > sizeof mine)
            st = set_error(ctx, DT_EPEER, "comm: rank %d's address is too long", r);
    }
    if (st == DT_OK && c->tp_iface->insert_peers(c->tp, c->world, ptrs, lens, err, sizeof err) != DT_OK)
        st = set_error(ctx, DT_EIO, "comm: inserting peer addresses: %s", err);
    host_free(ctx, all);
    host_free(ctx, ptrs);
    host_free(ctx, lens);
    return st;
}

static dt_status open_transport(dt_comm *c, const dt_comm_config *cfg)
{
    dt_ctx *ctx = c->ctx;
    c->tp_iface = find_transport();
    if (!c->tp_iface)
        return set_error(ctx, DT_ENOTSUP, "comm: no transport compiled in (build with "
                                          "backends/fabric.c, -DDT_WITH_FABRIC and -lfabric)");
    const char *prov = cfg->transport ? cfg->transport : getenv("DTRAIN_TRANSPORT");
    if (!prov)
        prov = c->nhosts <= 1 ? "shm" : "tcp";
    dt_transport_params tp = {prov, cfg->host ? cfg->host : getenv("DTRAIN_HOST"), NULL, ctx->al};
    char err[256] = "";
    dt_status st = c->tp_iface->open(&tp, &c->tp, err, sizeof err);
    if (st != DT_OK)
        return set_error(ctx, st, "comm: transport '%s': %s", prov, err);
    snprintf(c->provider, sizeof c->provider, "%s", c->tp_iface->provider(c->tp));
    c->doubling_max = strncmp(c->provider, "tcp", 3) == 0 ? DT_COMM_SMALL_TCP : DT_COMM_SMALL;
    c->max_msg = c->tp_iface->max_message(c->tp);
    if (c->max_msg == 0)
        c->max_msg = DT_COMM_CHUNK;
    return DT_OK;
}

/* The comm thread's own connection to the store, with its own error sink
 * (a bare context that only holds the allocator and messages). */
static dt_status open_watch(dt_comm *c, const dt_comm_config *cfg)
{
    dt_ctx *ctx = c->ctx;
    if (c->world == 1)
        return DT_OK;
    c->watch_errors = host_calloc(ctx, sizeof *c->watch_errors);
    if (!c->watch_errors)
        return set_error(ctx, DT_ENOMEM, "comm: out of memory");
    c->watch_errors->al = ctx->al;
    dt_store_config sc = cfg->store;
    sc.token = c->store->token;   /* (a group's cfg may not carry the job's) */
    c->watch = store_open(c->watch_errors, &c->job, &sc, 0, c->inc);
    if (!c->watch)
        return set_error(ctx, c->watch_errors->last_status, "%s", c->watch_errors->err);
    snprintf(c->watch->prefix, sizeof c->watch->prefix, "%s", c->store->prefix);
    /* a hung rank 0 must not hold a collective longer than its own timeout */
    if (c->watch->timeout_ms > c->timeout_ms)
        c->watch->timeout_ms = c->timeout_ms;
    return DT_OK;
}

/* A communicator's memory and lock, before it connects. */
static dt_comm *comm_alloc(dt_ctx *ctx, int rank, int world, const dt_comm_config *cfg)
{
    dt_comm *c = host_calloc(ctx, sizeof *c);
    if (!c) {
        set_error(ctx, DT_ENOMEM, "comm: out of memory");
        return NULL;
    }
    c->ctx = ctx;
    c->rank = rank;
    c->world = world;
    c->inline_small = 1;
    c->waiting_on = -1;
    int t = cfg->timeout_ms;
    const char *te = getenv("DTRAIN_TIMEOUT_MS");
    if (t <= 0 && te)
        t = atoi(te);
    c->timeout_ms = t > 0 ? t : DT_COMM_DEFAULT_TIMEOUT_MS;
    if (pthread_mutex_init(&c->mu, NULL) != 0 || pthread_cond_init(&c->cv, NULL) != 0) {
        host_free(ctx, c);
        set_error(ctx, DT_ENOMEM, "comm: cannot create a mutex");
        return NULL;
    }
    return c;
}

/* Free a communicator that failed to connect, keeping the failure's message
 * (freeing it may set others); NULL. */
static dt_comm *comm_abandon(dt_comm *c, const char *what)
{
    dt_ctx *ctx = c->ctx;
    dt_status st = ctx->last_status;
    char msg[DT_MAX_ERROR];
    snprintf(msg, sizeof msg, "%s", ctx->err);
    dt_comm_free(c);
    set_error(ctx, st, "%s%.480s", what, msg);
    return NULL;
}

/* Everything after the store: hosts, the transport and its addresses, the
 * watch connection, the host segment, the comm thread; collective over the
 * communicator's ranks (the job's, or a group's through its namespace). */
static dt_status comm_connect(dt_comm *c, const dt_comm_config *cfg)
{
    dt_ctx *ctx = c->ctx;
    if (find_hosts(c, cfg) != DT_OK || open_transport(c, cfg) != DT_OK ||
        exchange_addresses(c) != DT_OK || open_watch(c, cfg) != DT_OK ||
        (!c->inc && setup_segments(c, cfg) != DT_OK))   /* (a collective) */
        return ctx->last_status;
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    c->inline_spin_s = online > 0 && c->nlocal <= online ? SEG_SPIN_INLINE_S : SEG_SPIN_S;
    c->p2p_sent = host_calloc(ctx, sizeof *c->p2p_sent * (size_t)c->world);
    c->p2p_recvd = host_calloc(ctx, sizeof *c->p2p_recvd * (size_t)c->world);
    if (!c->p2p_sent || !c->p2p_recvd)
        return set_error(ctx, DT_ENOMEM, "comm: out of memory");
    if (pthread_create(&c->thread, NULL, comm_main, c) != 0)
        return set_error(ctx, DT_ENOMEM, "comm: cannot start the comm thread");
    c->has_thread = 1;
    /* everyone's endpoint is ready before anyone sends (a rejoined rank's
     * peers are mid-job: it tells them when it serves, announce_rejoin) */
    if (!c->inc && dt_barrier(c) != DT_OK)
        return ctx->last_status;
    /* the profiler's offset to rank 0's clock (20), while the job is quiet */
    if (!c->members && store_clock_offset(c->store, 8, &c->clock_offset, &c->clock_rtt) != DT_OK)
        return ctx->last_status;
    /* every local rank has mapped the segment: its name can go, so no
     * file is left behind in /dev/shm whatever happens later */
    if (c->seg_linked) {
        shm_unlink(c->seg_name);
        c->seg_linked = 0;
    }
    return DT_OK;
}

dt_comm *dt_comm_new(dt_ctx *ctx, const dt_dist_env *env_in, const dt_comm_config *cfg_in)
{
    if (!ctx_ok(ctx))
        return NULL;
    dt_comm_config cfg;
    if (cfg_in)
        cfg = *cfg_in;
    else
        dt_comm_config_init(&cfg);
    dt_dist_env env;
    if (env_in)
        env = *env_in;
    else if (dt_dist_env_detect(ctx, &env) != DT_OK)
        return NULL;
    dt_comm *c = comm_alloc(ctx, env.rank, env.world_size, &cfg);
    if (!c)
        return NULL;
    if (!(c->store = dt_store_open(ctx, &env, &cfg.store)) || find_rejoin(c, &env, &cfg) != DT_OK)
        goto fail;
    c->job = env;
    c->job.master_port = dt_store_port(c->store);
    if (comm_connect(c, &cfg) != DT_OK)
        goto fail;
    return c;
fail:
    return comm_abandon(c, "");
}

void dt_comm_free(dt_comm *c)
{
    if (!c)
        return;
    if (c->has_thread) {
        pthread_mutex_lock(&c->mu);
        c->stop = 1;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->thread, NULL);
    }
    if (c->tp)
        c->tp_iface->close(c->tp);
    while (c->graveyard) {   /* (the transport that held their sends is closed) */
        xfers *x = c->graveyard;
        c->graveyard = x->next_dead;
        c->ctx->al.free_fn(x, c->ctx->al.user);
    }
    dt_store_close(c->watch);
    host_free(c->ctx, c->watch_errors);
    /* Rank 0 leaves its last collective as soon as its own part is done,
     * while others may still wait for each other's last messages and ask
     * the store about the dead meanwhile: a store gone then would read as
     * rank 0's death.  So the store stays until they have left (bounded). */
    store_close(c->store, c->timeout_ms < DT_COMM_DRAIN_MS ? c->timeout_ms : DT_COMM_DRAIN_MS);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    if (c->scratch)
        c->ctx->al.free_fn(c->scratch, c->ctx->al.user);
    unmap_segment(c);
    host_free(c->ctx, c->local_ranks);
    host_free(c->ctx, c->leaders);
    host_free(c->ctx, c->members);
    host_free(c->ctx, c->p2p_sent);
    host_free(c->ctx, c->p2p_recvd);
    host_free(c->ctx, c);
}

/* --- 14.7 process groups ------------------------------------------------- */

/* Every rank's (color, key) through the parent's store; the ranks of our
 * color in (key, parent rank) order, as job ranks, into members (n of them;
 * *me: our index). */
static dt_status split_members(dt_comm *p, int color, int key, int *members, int *n, int *me)
{
    dt_ctx *ctx = p->ctx;
    char k[48], v[32];
    int id = p->splits_made++;
    snprintf(k, sizeof k, "split/%d/%d", id, p->rank);
    int vl = snprintf(v, sizeof v, "%d %d", color, key);
    dt_status st = dt_store_set(p->store, k, v, (size_t)vl + 1);
    int *keys = host_alloc(ctx, sizeof *keys * (size_t)p->world);
    if (st == DT_OK && !keys)
        st = set_error(ctx, DT_ENOMEM, "comm_split: out of memory");
    *n = 0;
    for (int r = 0; st == DT_OK && r < p->world; r++) {
        size_t len = 0;
        int col = 0, ky = 0;
        snprintf(k, sizeof k, "split/%d/%d", id, r);
        st = dt_store_get(p->store, k, v, sizeof v - 1, &len, 0);
        v[len < sizeof v ? len : sizeof v - 1] = '\0';
        if (st == DT_OK && sscanf(v, "%d %d", &col, &ky) != 2)
            st = set_error(ctx, DT_EPEER, "comm_split: rank %d sent '%s'", r, v);
        if (st != DT_OK || col != color)
            continue;
        int i = (*n)++;   /* insertion sort by (key, rank): groups are small */
        while (i > 0 && keys[i - 1] > ky)
            keys[i] = keys[i - 1], members[i] = members[i - 1], i--;
        keys[i] = ky;
        members[i] = r;
    }
    for (int i = 0; st == DT_OK && i < *n; i++) {
        if (members[i] == p->rank)
            *me = i;
        members[i] = p->members ? p->members[members[i]] : members[i];   /* job ranks */
    }
    host_free(ctx, keys);
    return st;
}

static void group_label(dt_comm *c)
{
    int off = snprintf(c->label, sizeof c->label, "group [");
    for (int i = 0; i < c->world && off < (int)sizeof c->label - 24; i++)
        off += snprintf(c->label + off, sizeof c->label - (size_t)off, i ? " %d" : "%d",
                        c->members[i]);
    snprintf(c->label + off, sizeof c->label - (size_t)off, "%s]: ",
             off >= (int)sizeof c->label - 24 ? " ..." : "");
}

dt_comm *dt_comm_split(dt_comm *parent, int color, int key, const dt_comm_config *cfg_in)
{
    if (!parent)
        return NULL;
    dt_ctx *ctx = parent->ctx;
    if (color < 0) {
        set_error(ctx, DT_EINVAL, "comm_split: color %d: must be >= 0", color);
        return NULL;
    }
    if (parent->broken || parent->inc) {
        set_error(ctx, DT_ESTATE, "comm_split: %s", parent->broken ? parent->broken_msg :
                  "a restarted process's communicator makes no groups");
        return NULL;
    }
    dt_comm_config cfg;
    if (cfg_in)
        cfg = *cfg_in;
    else
        dt_comm_config_init(&cfg);
    if (!cfg.timeout_ms)
        cfg.timeout_ms = parent->timeout_ms;
    int id = parent->splits_made, n = 0, me = 0;
    int *members = host_alloc(ctx, sizeof *members * (size_t)parent->world);
    if (!members) {
        set_error(ctx, DT_ENOMEM, "comm_split: out of memory");
        return NULL;
    }
    if (split_members(parent, color, key, members, &n, &me) != DT_OK) {
        host_free(ctx, members);
        return NULL;
    }
    dt_comm *c = comm_alloc(ctx, me, n, &cfg);
    if (!c) {
        host_free(ctx, members);
        return NULL;
    }
    c->members = members;
    c->job = parent->job;
    c->clock_offset = parent->clock_offset;
    c->clock_rtt = parent->clock_rtt;
    group_label(c);
    cfg.store.token = parent->store->token;
    if (!(c->store = store_open(ctx, &c->job, &cfg.store, 0, 0)))
        goto fail;
    if ((size_t)snprintf(c->store->prefix, sizeof c->store->prefix, "%sg%d.%d/",
                         parent->store->prefix, id, color) >= sizeof c->store->prefix) {
        set_error(ctx, DT_ENOTSUP, "comm_split: groups nested too deep");
        goto fail;
    }
    if (comm_connect(c, &cfg) != DT_OK)
        goto fail;
    return c;
fail:
    return comm_abandon(c, "comm_split: ");
}

int dt_comm_job_rank(const dt_comm *c, int rank)
{
    if (!c || rank < 0 || rank >= c->world)
        return -1;
    return c->members ? c->members[rank] : rank;
}

/* ===========================================================================
 * 15. Launching ranks on one host
 *
 * The supervisor forks the ranks with their stdout and stderr on pipes,
 * then loops on poll(): copy complete lines out with a "[rank] " prefix,
 * reap exited ranks, forward SIGINT/SIGTERM (read from a signalfd while
 * those signals are blocked, so no handler and no global state), and after
 * the first failure terminate the others, then kill them after grace_ms.
 * ======================================================================== */

#define DT_SPAWN_MAX_RANKS 1024
#define DT_SPAWN_LINE 4096

typedef struct spawn_stream {
    int fd;                    /* read end, -1 once closed */
    int out;                   /* 1 or 2 */
    char buf[DT_SPAWN_LINE];
    size_t have;
} spawn_stream;

typedef struct spawn_rank {
    pid_t pid;
    int exited, status;
    spawn_stream s[2];
} spawn_rank;

void dt_spawn_config_init(dt_spawn_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->nranks = 1;
    cfg->prefix_output = 1;
    cfg->bind_cpus = 1;
}

/* Rank `rank` of `nranks` keeps its share of the CPUs it may use.  Why:
 * unbound, the scheduler's wake-up affinity tends to stack two ranks that
 * wake each other on one CPU, and a host-segment allreduce then runs 3-4x
 * slower for as long as they stay there (tests/bench/allreduce.sh). */
static void bind_rank(int rank, int nranks)
{
    cpu_set_t all, mine;
    if (sched_getaffinity(0, sizeof all, &all) != 0)
        return;
    int m = CPU_COUNT(&all);
    if (m < nranks)
        return;
    int share = m / nranks, seen = 0;
    CPU_ZERO(&mine);
    for (int cpu = 0; cpu < CPU_SETSIZE && seen < (rank + 1) * share; cpu++) {
        if (!CPU_ISSET(cpu, &all))
            continue;
        if (seen >= rank * share)
            CPU_SET(cpu, &mine);
        seen++;
    }
    sched_setaffinity(0, sizeof mine, &mine);
}

static int free_local_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t sl = sizeof sa;
    int port = -1;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0 &&
        getsockname(fd, (struct sockaddr *)&sa, &sl) == 0)
        port = ntohs(sa.sin_port);
    if (fd >= 0)
        close(fd);
    return port;
}

static void random_token(char *out, size_t cap)
{
    unsigned char r[16] = {0};
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0 || read(fd, r, sizeof r) != (ssize_t)sizeof r) {
        uint64_t s = (uint64_t)getpid() ^ (uint64_t)(dt_now() * 1e9);
        for (size_t i = 0; i < sizeof r; i++)
            r[i] = (unsigned char)splitmix64(&s);
    }
    if (fd >= 0)
        close(fd);
    for (size_t i = 0; i < sizeof r && 2 * i + 2 < cap; i++)
        snprintf(out + 2 * i, 3, "%02x", r[i]);
}

/* A rank killed by a signal cannot remove its shared-memory files: the
 * libfabric shm provider's region ("<pid>:<...>") and, if it died while
 * joining, a host segment ("dtrain-<pid>-<...>").  Its launcher does. */
static void remove_shm_of(pid_t pid)
{
    DIR *d = opendir("/dev/shm");
    if (!d)
        return;
    char fab[32], seg[40], path[300];
    int nf = snprintf(fab, sizeof fab, "%d:", (int)pid);
    int ns = snprintf(seg, sizeof seg, "dtrain-%d-", (int)pid);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, fab, (size_t)nf) == 0 || strncmp(e->d_name, seg, (size_t)ns) == 0) {
            snprintf(path, sizeof path, "/dev/shm/%.250s", e->d_name);
            unlink(path);
        }
    }
    closedir(d);
}

/* In a freshly forked rank: its environment, its output on the pipes. */
static void rank_setup(const dt_spawn_config *cfg, int rank, int port, const char *token,
                       int out_fd, int err_fd)
{
    char v[64];
    snprintf(v, sizeof v, "%d", rank);
    setenv("DTRAIN_RANK", v, 1);
    setenv("DTRAIN_LOCAL_RANK", v, 1);
    snprintf(v, sizeof v, "%d", cfg->nranks);
    setenv("DTRAIN_WORLD_SIZE", v, 1);
    setenv("DTRAIN_LOCAL_WORLD_SIZE", v, 1);
    snprintf(v, sizeof v, "127.0.0.1:%d", port);
    setenv("DTRAIN_MASTER", v, 1);
    setenv("DTRAIN_JOB_TOKEN", token, 1);
    if (cfg->transport)
        setenv("DTRAIN_TRANSPORT", cfg->transport, 1);
    /* keeps the PSM libraries under libfabric from installing signal
     * handlers that end the process from inside a signal (backends/fabric.c
     * says more) */
    setenv("IPATH_NO_BACKTRACE", "1", 0);
    setenv("HFI_NO_BACKTRACE", "1", 0);
    if (cfg->bind_cpus)
        bind_rank(rank, cfg->nranks);
    if (out_fd >= 0) {
        dup2(out_fd, STDOUT_FILENO);
        dup2(err_fd, STDERR_FILENO);
        close(out_fd);
        close(err_fd);
    }
}

static void write_all_fd(int fd, const char *p, size_t n)
{
    while (n > 0) {
        ssize_t k = write(fd, p, n);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return;
        p += k;
        n -= (size_t)k;
    }
}

/* Copy complete lines (or a full buffer, or the tail at EOF) with a prefix. */
static void stream_flush(spawn_stream *st, int rank, int at_eof)
{
    char prefix[24];
    int pl = snprintf(prefix, sizeof prefix, "[%d] ", rank);
    size_t start = 0;
    for (size_t i = 0; i < st->have; i++) {
        if (st->buf[i] == '\n') {
            write_all_fd(st->out, prefix, (size_t)pl);
            write_all_fd(st->out, st->buf + start, i + 1 - start);
            start = i + 1;
        }
    }
    if (start < st->have && (at_eof || (start == 0 && st->have == sizeof st->buf))) {
        write_all_fd(st->out, prefix, (size_t)pl);
        write_all_fd(st->out, st->buf + start, st->have - start);
        write_all_fd(st->out, "\n", 1);
        start = st->have;
    }
    memmove(st->buf, st->buf + start, st->have - start);
    st->have -= start;
}

static void stream_read(spawn_stream *st, int rank)
{
    ssize_t k = read(st->fd, st->buf + st->have, sizeof st->buf - st->have);
    if (k < 0 && (errno == EINTR || errno == EAGAIN))
        return;
    if (k <= 0) {
        stream_flush(st, rank, 1);
        close(st->fd);
        st->fd = -1;
        return;
    }
    st->have += (size_t)k;
    stream_flush(st, rank, 0);
}

static void signal_ranks(spawn_rank *r, int n, int sig)
{
    for (int i = 0; i < n; i++)
        if (!r[i].exited && r[i].pid > 0)
            kill(r[i].pid, sig);
}

/* Supervise until every rank exited and every pipe drained. */
static int supervise(dt_ctx *ctx, const dt_spawn_config *cfg, spawn_rank *r, int sfd,
                     int *first_failed)
{
    int n = cfg->nranks, live = 0, grace = cfg->grace_ms > 0 ? cfg->grace_ms : 5000;
    for (int i = 0; i < n; i++)   /* ranks that never started count as exited */
        live += !r[i].exited;
    double kill_at = 0;
    struct pollfd *pf = host_alloc(ctx, sizeof *pf * (size_t)(2 * n + 1));
    int *owner = host_alloc(ctx, sizeof *owner * (size_t)(2 * n + 1));
    if (!pf || !owner) {
        signal_ranks(r, n, SIGKILL);
        host_free(ctx, pf);
        host_free(ctx, owner);
        return -1;
    }
    for (;;) {
        int k = 0, open_streams = 0;
        pf[k++] = (struct pollfd){sfd, POLLIN, 0};
        for (int i = 0; i < n; i++)
            for (int j = 0; j < 2; j++)
                if (r[i].s[j].fd >= 0) {
                    owner[k] = i * 2 + j;
                    pf[k++] = (struct pollfd){r[i].s[j].fd, POLLIN, 0};
                    open_streams++;
                }
        if (live == 0 && open_streams == 0)
            break;
        poll(pf, (nfds_t)k, 50);
        for (int i = 1; i < k; i++)
            if (pf[i].revents)
                stream_read(&r[owner[i] / 2].s[owner[i] % 2], owner[i] / 2);
        if (sfd >= 0 && (pf[0].revents & POLLIN)) {
            struct signalfd_siginfo si;
            if (read(sfd, &si, sizeof si) == (ssize_t)sizeof si)
                signal_ranks(r, n, (int)si.ssi_signo);   /* forward Ctrl-C / TERM */
        }
        for (int i = 0; i < n; i++) {
            if (r[i].exited)
                continue;
            int status;
            if (waitpid(r[i].pid, &status, WNOHANG) == r[i].pid) {
                r[i].exited = 1;
                r[i].status = status;
                live--;
                if (WIFSIGNALED(status))
                    remove_shm_of(r[i].pid);
                int ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
                if (!ok && *first_failed < 0) {
                    *first_failed = i;
                    signal_ranks(r, n, SIGTERM);
                    kill_at = dt_now() + grace / 1000.0;
                }
            }
        }
        if (kill_at > 0 && live > 0 && dt_now() >= kill_at) {
            signal_ranks(r, n, SIGKILL);
            kill_at = 0;
        }
    }
    host_free(ctx, pf);
    host_free(ctx, owner);
    return 0;
}

static dt_status spawn_impl(dt_ctx *ctx, const dt_spawn_config *cfg, char *const argv[],
                            int *rank_out, int *failed_out)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (!cfg || cfg->nranks < 1 || cfg->nranks > DT_SPAWN_MAX_RANKS)
        return set_error(ctx, DT_EINVAL, "spawn: nranks must be 1..%d", DT_SPAWN_MAX_RANKS);
    int port = free_local_port();
    if (port < 0)
        return set_error(ctx, DT_EIO, "spawn: no free local port for the rendezvous");
    char token[40];
    const char *env_token = getenv("DTRAIN_JOB_TOKEN");
    if (env_token && strlen(env_token) < sizeof token)
        snprintf(token, sizeof token, "%s", env_token);
    else
        random_token(token, sizeof token);
    int n = cfg->nranks, first_failed = -1;
    spawn_rank *r = host_calloc(ctx, sizeof *r * (size_t)n);
    if (!r)
        return set_error(ctx, DT_ENOMEM, "spawn: out of memory");
    /* block the signals we forward; they are read from a signalfd */
    sigset_t fwd, old;
    sigemptyset(&fwd);
    sigaddset(&fwd, SIGINT);
    sigaddset(&fwd, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &fwd, &old);
    int sfd = signalfd(-1, &fwd, SFD_CLOEXEC | SFD_NONBLOCK);
    dt_status st = DT_OK;
    fflush(NULL);
    for (int i = 0; i < n && st == DT_OK; i++) {
        int po[2] = {-1, -1}, pe[2] = {-1, -1}, ep[2] = {-1, -1};
        if ((cfg->prefix_output && (pipe2(po, O_CLOEXEC) != 0 || pipe2(pe, O_CLOEXEC) != 0)) ||
            (argv && pipe2(ep, O_CLOEXEC) != 0)) {
            st = set_error(ctx, DT_EIO, "spawn: pipe: %s", strerror(errno));
            break;
        }
        pid_t pid = fork();
        if (pid < 0) {
            st = set_error(ctx, DT_EIO, "spawn: fork: %s", strerror(errno));
            break;
        }
        if (pid == 0) {
            pthread_sigmask(SIG_SETMASK, &old, NULL);
            if (sfd >= 0)
                close(sfd);
            rank_setup(cfg, i, port, token, po[1], pe[1]);
            if (argv) {   /* a failed exec's errno goes back through ep (closed by a good one) */
                close(ep[0]);
                execvp(argv[0], argv);
                int e = errno;
                ssize_t w = write(ep[1], &e, sizeof e);
                _exit(w == (ssize_t)sizeof e ? 127 : 126);
            }
            host_free(ctx, r);
            *rank_out = i;
            return DT_OK;   /* this process is rank i now */
        }
        if (argv) {
            int e = 0;
            close(ep[1]);
            ssize_t got;
            while ((got = read(ep[0], &e, sizeof e)) < 0 && errno == EINTR) {
            }
            close(ep[0]);
            if (got == (ssize_t)sizeof e) {   /* nothing ran: no rank to supervise */
                waitpid(pid, NULL, 0);
                pid = -1;
                for (int k = 0; k < 2; k++)
                    if ((k ? pe[0] : po[0]) >= 0)
                        close(k ? pe[0] : po[0]);
                po[0] = pe[0] = -1;
                first_failed = i;
                st = set_error(ctx, DT_EIO, "launch: cannot run %s: %s", argv[0], strerror(e));
            }
        }
        r[i].pid = pid;
        r[i].s[0] = (spawn_stream){.fd = po[0], .out = STDOUT_FILENO};
        r[i].s[1] = (spawn_stream){.fd = pe[0], .out = STDERR_FILENO};
        if (po[1] >= 0)
            close(po[1]);
        if (pe[1] >= 0)
            close(pe[1]);
    }
    if (st != DT_OK) {   /* could not start them all: stop the ones that run */
        signal_ranks(r, n, SIGKILL);
    }
    for (int i = 0; i < n; i++)
        if (r[i].pid <= 0) {
            r[i].exited = 1;
            r[i].s[0].fd = r[i].s[1].fd = -1;
        }
    if (supervise(ctx, cfg, r, sfd, &first_failed) != 0 && st == DT_OK)
        st = set_error(ctx, DT_ENOMEM, "spawn: out of memory while supervising");
    if (sfd >= 0)
        close(sfd);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (st == DT_OK && first_failed >= 0) {
        int s = r[first_failed].status;
        if (WIFEXITED(s))
            st = set_error(ctx, DT_EPEER, "spawn: rank %d exited with code %d; the other ranks "
                           "were stopped", first_failed, WEXITSTATUS(s));
        else
            st = set_error(ctx, DT_EPEER, "spawn: rank %d was killed by signal %d (%s); the other "
                           "ranks were stopped", first_failed, WTERMSIG(s), strsignal(WTERMSIG(s)));
    }
    host_free(ctx, r);
    if (failed_out)
        *failed_out = first_failed;
    if (rank_out)
        *rank_out = -1;
    return st;
}

dt_status dt_spawn(dt_ctx *ctx, const dt_spawn_config *cfg, int *rank)
{
    if (!rank)
        return ctx ? set_error(ctx, DT_EINVAL, "spawn: rank output is NULL") : DT_EINVAL;
    return spawn_impl(ctx, cfg, NULL, rank, NULL);
}

dt_status dt_launch(dt_ctx *ctx, const dt_spawn_config *cfg, char *const argv[], int *failed_rank)
{
    if (!argv || !argv[0])
        return ctx ? set_error(ctx, DT_EINVAL, "launch: no program given") : DT_EINVAL;
    int unused;
    return spawn_impl(ctx, cfg, argv, &unused, failed_rank);
}

/* ===========================================================================
 * 16. Data parallelism (DDP)
 *
 * The gradients of the wrapped parameters live in bucket memory: each
 * parameter's grad tensor points at its slot, so backward writes straight
 * into what the allreduce sends (no copy).  Buckets take parameters in
 * reverse registration order, the order backward finishes them.  Before a
 * backward, every parameter's uses on the tape are counted; as the walk
 * passes each node the count drops, and at zero the gradient is final.  A
 * bucket whose gradients are all final is handed to the comm thread, but
 * only after every lower-numbered bucket: all ranks then issue the same
 * allreduces in the same order even when their tapes differ.
 *
 * Each bucket carries one extra float per parameter, 1 when this rank
 * produced a gradient for it and 0 when not (its slot is zeroed then).
 * The allreduce averages them with the gradients, so afterwards a
 * parameter that no rank touched is marked gradient-less again and the
 * optimizer skips it, as it would in one process.
 *
 * Two sets of bucket memory alternate: a new step (every gradient zeroed)
 * repoints the gradients at the other set, so what the previous step's
 * allreduces left stays intact while the next backward writes.
 * ======================================================================== */

/* The default bucket: about an eighth of the gradients, within these bounds
 * (measured in docs/PERFORMANCE.md: 256 KiB buckets hid the most on 1 Gbit/s
 * for the benchmark MLP and CNN; large models want fewer, larger calls). */
#define DT_DDP_MIN_BUCKET_BYTES ((size_t)256 << 10)
#define DT_DDP_MAX_BUCKET_BYTES ((size_t)25 << 20)
#define DT_DDP_DIFF 240            /* chars of a model difference, as floats */

typedef struct ddp_bucket {
    int64_t offset;            /* its first gradient float in a set */
    int64_t numel;             /* gradient floats */
    int count;                 /* flags that follow them: every parameter's in the
                                  last bucket, none elsewhere */
    int64_t pending;           /* gradient floats not yet final in this backward */
    dt_work *work;             /* its allreduce (or gather), in flight */
    /* compression (16.1): this rank's encoded bucket, everyone's, and what
     * error feedback carries to the next step */
    int64_t topk;              /* TOPK: entries sent */
    int npieces;               /* TOPK: the parameters' parts in this bucket, each */
    int64_t *pieces;           /*   (start, end, k): k chosen per parameter, as DGC does,
                                    so small-gradient layers are not starved */
    size_t code_bytes;         /* encoded gradients, before the flags */
    int64_t payload_floats;    /* encoded gradients + flags, in floats */
    float *payload, *gathered, *residual;
    float *velocity;           /* TOPK with SGD momentum: the momentum, kept locally */
    ps_call pcall;             /* with a parameter server: its push (alive while in flight) */
} ddp_bucket;

struct dt_ddp {
    dt_ctx *ctx;
    dt_comm *comm;
    dt_optim *opt;
    dt_ddp_config cfg;
    dt_allocator al;           /* the context's, kept for dt_ddp_free after a detach */
    const dt_backend_iface *be_iface;
    dt_backend *be;
    int nparams;
    dt_tensor **params;        /* registration order (a copy of the context's list) */
    int *order;                /* bucket order: reverse registration */
    int64_t *offset;           /* param -> float offset of its gradient in a set */
    int *uses;                 /* param -> uses left on the tape */
    int64_t *done;             /* param -> floats of its gradient final (a prefix) */
    void **own_grad;           /* param -> the grad buffer it had before */
    float *set[2];             /* host memory the collectives use */
    float *dset[2];            /* staged (a device backend): the gradients, on the device;
                                  each bucket is copied to set[] to travel and back after */
    int staged, pinned;        /* pinned: set[] from the backend's host_alloc */
    uint64_t last_ticket;      /* staged: the latest copy; waited for before freeing */
    shm_region shared;         /* base set: the sets live in memory the host's ranks
                                  share (uncompressed, one host), else backend memory */
    int64_t set_floats;        /* gradients, then one flag per parameter */
    int64_t grad_floats;       /* gradients: where the flags start */
    int64_t bucket_floats;     /* the cap: buckets cut every this many floats */
    int cur;                   /* set the gradients point at */
    ddp_bucket *buckets;
    int nbuckets, next_launch, ready_upto;
    int recompute_left;        /* recompute nodes not yet walked */
    int sync;                  /* 0: no_sync */
    int overlap;               /* cfg.overlap resolved (ddp_resolve_overlap) */
    int hooks;                 /* this backward launches buckets */
    int pending_sync;          /* buckets launched or owed; dt_ddp_sync finishes them */
    dt_status launch_status;
    char launch_msg[DT_MAX_ERROR];
    double t_backward;
    uint64_t sent_at_launch;
    uint64_t zero_gen;         /* ctx->zero_gen when this step's buckets started */
    float *scratch;            /* TOPK selection, numel of the largest bucket */
    unsigned char *picked;     /* TOPK: which entries were sent, same size */
    float momentum;            /* > 0: momentum correction (16.1) */
    int64_t topk_steps;        /* TOPK: steps sent so far (the warm-up's clock) */
    dt_ddp_stats st;
    /* the ranks' checks (20) and load balancing (16.5) */
    int check_every;           /* profiling: steps between straggler checks; 0: none */
    dt_loader *bal_ld;         /* balancing: the loader whose global batches it cuts */
    int bal_every;
    double *bal_w;             /* the split in force, one weight a rank */
};

void dt_ddp_config_init(dt_ddp_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->overlap = -1;
    cfg->broadcast_params = 1;
    cfg->error_feedback = 1;
}

static float *ddp_flags(dt_ddp *d, int set, const ddp_bucket *b)
{
    return d->set[set] + b->offset + b->numel;
}

/* Where the gradients live: the bucket memory, or its device twin. */
static float *ddp_grads(const dt_ddp *d, int set) { return d->staged ? d->dset[set] : d->set[set]; }

static void ddp_point_grads(dt_ddp *d, int set)
{
    for (int i = 0; i < d->nparams; i++)
        d->params[i]->grad->data = ddp_grads(d, set) + d->offset[i];
    d->cur = set;
}

/* Staged: start copying floats [off, off + n) of the current set's
 * gradients to host memory; the copy stream first waits for the backward
 * kernels queued so far.  Returns its ticket. */
static uint64_t ddp_stage_out(dt_ddp *d, int64_t off, int64_t n)
{
    if (!d->staged || n <= 0)
        return 0;
    uint64_t t = d->be_iface->copy_async(d->be, d->set[d->cur] + off, d->dset[d->cur] + off,
                                         (size_t)n * sizeof(float), DT_COPY_D2H);
    if (t > d->last_ticket)
        d->last_ticket = t;
    return t;
}

/* Staged: the reduced gradients back to the device, before any later
 * kernel (the optimizer) reads them. */
static void ddp_stage_in(dt_ddp *d)
{
    if (!d->staged)
        return;
    uint64_t t = d->be_iface->copy_async(d->be, d->dset[d->cur], d->set[d->cur],
                                         (size_t)d->grad_floats * sizeof(float), DT_COPY_H2D);
    if (t)
        d->be_iface->copy_join(d->be, t);
    if (t > d->last_ticket)
        d->last_ticket = t;
}

/* --- 16.1 gradient compression ------------------------------------------- */

/* Round to nearest even; NaN stays NaN. */
static uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static float bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* IEEE half, round to nearest even: overflow to infinity, subnormals kept. */
static uint16_t f32_to_f16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u)
        return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0));
    if (ax >= 0x477ff000u)   /* 65520 and up round to infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (ax < 0x38800000u) {  /* below 2^-14: a subnormal half (or zero) */
        float v;
        memcpy(&v, &ax, 4);
        return (uint16_t)(sign | (uint32_t)lrintf(v * 16777216.0f));
    }
    uint32_t r = ax + 0xfffu + ((ax >> 13) & 1) - 0x38000000u;
    return (uint16_t)(sign | (r >> 13));
}

static float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, u;
    if (e == 0) {
        float v = (float)m * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    u = sign | (e == 31 ? 0x7f800000u : (e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#define DDP_INT8_BLOCK 256

/* Encoded size of a bucket's gradients in bytes (flags not included). */
static size_t ddp_code_bytes(dt_compress kind, int64_t numel, int64_t topk)
{
    switch (kind) {
    case DT_COMPRESS_BF16:
    case DT_COMPRESS_FP16: return (size_t)numel * 2;
    case DT_COMPRESS_TOPK: return (size_t)topk * 6;
    case DT_COMPRESS_INT8:
        return (size_t)(numel + DDP_INT8_BLOCK - 1) / DDP_INT8_BLOCK * 4 + (size_t)numel;
    default: return (size_t)numel * 4;
    }
}

/* The k-th smallest of v[0..n) (0-based), reordering v; deterministic. */
static float select_kth(float *v, int64_t n, int64_t k)
{
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        float a = v[lo], b = v[lo + (hi - lo) / 2], c = v[hi];
        float pivot = a < b ? (b < c ? b : (a < c ? c : a)) : (a < c ? a : (b < c ? c : b));
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (v[i] < pivot)
                i++;
            while (v[j] > pivot)
                j--;
            if (i <= j) {
                float t = v[i];
                v[i++] = v[j];
                v[j--] = t;
            }
        }
        if (k <= j)
            hi = j;
        else if (k >= i)
            lo = i;
        else
            return v[k];
    }
    return v[k];
}

/* Encode g[0..n) as `kind` into out; sent[i] gets what the receivers will
 * decode for element i (error feedback keeps g - sent).  TOPK keeps
 * pieces[3p + 2] entries of each piece [pieces[3p], pieces[3p + 1]), k in
 * all; scratch holds n floats; picked (may be NULL) marks what was sent.
 * DDP encodes buckets (16.1), a parameter-server push a server's part of
 * one (18). */
static void grad_encode(dt_compress kind, const float *g, int64_t n, const int64_t *pieces,
                        int npieces, int64_t k, float *scratch, unsigned char *picked, char *out,
                        float *sent)
{
    switch (kind) {
    case DT_COMPRESS_BF16:
    case DT_COMPRESS_FP16:
        for (int64_t i = 0; i < n; i++) {
            int bf = kind == DT_COMPRESS_BF16;
            uint16_t h = bf ? f32_to_bf16(g[i]) : f32_to_f16(g[i]);
            memcpy(out + 2 * i, &h, 2);
            sent[i] = bf ? bf16_to_f32(h) : f16_to_f32(h);
        }
        break;
    case DT_COMPRESS_INT8: {
        int64_t blocks = (n + DDP_INT8_BLOCK - 1) / DDP_INT8_BLOCK;
        for (int64_t k = 0; k < blocks; k++) {
            int64_t lo = k * DDP_INT8_BLOCK, hi = lo + DDP_INT8_BLOCK < n ? lo + DDP_INT8_BLOCK : n;
            float mx = 0;
            for (int64_t i = lo; i < hi; i++)
                mx = !(fabsf(g[i]) <= mx) ? fabsf(g[i]) : mx;   /* NaN wins */
            /* a NaN or infinity makes the block's scale NaN: it reaches every
             * rank, as it would dense */
            float scale = isfinite(mx) ? mx / 127.0f : NAN;
            memcpy(out + 4 * k, &scale, 4);
            for (int64_t i = lo; i < hi; i++) {
                int q = scale > 0 ? (int)lrintf(g[i] / scale) : 0;
                q = q > 127 ? 127 : q < -127 ? -127 : q;
                out[4 * blocks + i] = (char)(signed char)q;
                sent[i] = (float)q * scale;
            }
        }
        break;
    }
    case DT_COMPRESS_TOPK: {
        int64_t taken = 0;
        for (int p = 0; p < npieces; p++) {
            int64_t lo = pieces[3 * p], hi = pieces[3 * p + 1], kp = pieces[3 * p + 2];
            /* threshold: the kp-th largest magnitude; ties taken in index order */
            float *mag = scratch;   /* NaN ranks first: it reaches everyone, as dense */
            for (int64_t i = lo; i < hi; i++)
                mag[i - lo] = isnan(g[i]) ? INFINITY : fabsf(g[i]);
            float t = select_kth(mag, hi - lo, hi - lo - kp);
            int64_t above = 0, got = 0;
            for (int64_t i = lo; i < hi; i++) {
                above += (isnan(g[i]) ? INFINITY : fabsf(g[i])) > t;
                if (picked)
                    picked[i] = 0;
            }
            int64_t ties = kp - above;
            for (int64_t i = lo; i < hi; i++) {
                float a = isnan(g[i]) ? INFINITY : fabsf(g[i]);
                sent[i] = 0;
                if (got < kp && (a > t || (a == t && ties > 0))) {
                    if (!(a > t))
                        ties--;
                    uint32_t idx = (uint32_t)i;
                    uint16_t h = f32_to_bf16(g[i]);
                    memcpy(out + 4 * taken, &idx, 4);
                    memcpy(out + 4 * k + 2 * taken, &h, 2);
                    sent[i] = bf16_to_f32(h);
                    if (picked)
                        picked[i] = 1;
                    taken++;
                    got++;
                }
            }
        }
        for (; taken < k; taken++) {   /* never reached on finite input; no stale slots */
            uint32_t none = UINT32_MAX;
            memset(out + 4 * k + 2 * taken, 0, 2);
            memcpy(out + 4 * taken, &none, 4);
        }
        break;
    }
    default:
        break;
    }
}

static void ddp_encode(const dt_ddp *d, const ddp_bucket *b, const float *g, char *out, float *sent)
{
    grad_encode(d->cfg.compress, g, b->numel, b->pieces, b->npieces, b->topk, d->scratch,
                d->picked, out, sent);
}

/* acc[0..n) += what `code` (n gradients as `kind`, k entries if TOPK)
 * encodes. */
static void grad_decode_add(dt_compress kind, const char *code, int64_t n, int64_t k, float *acc)
{
    switch (kind) {
    case DT_COMPRESS_BF16:
    case DT_COMPRESS_FP16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, code + 2 * i, 2);
            acc[i] += kind == DT_COMPRESS_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
        }
        break;
    case DT_COMPRESS_INT8: {
        int64_t blocks = (n + DDP_INT8_BLOCK - 1) / DDP_INT8_BLOCK;
        for (int64_t k = 0; k < blocks; k++) {
            float scale;
            memcpy(&scale, code + 4 * k, 4);
            int64_t lo = k * DDP_INT8_BLOCK, hi = lo + DDP_INT8_BLOCK < n ? lo + DDP_INT8_BLOCK : n;
            for (int64_t i = lo; i < hi; i++)
                acc[i] += (float)(signed char)code[4 * blocks + i] * scale;
        }
        break;
    }
    case DT_COMPRESS_TOPK:
        for (int64_t j = 0; j < k; j++) {
            uint32_t idx;
            uint16_t h;
            memcpy(&idx, code + 4 * j, 4);
            memcpy(&h, code + 4 * k + 2 * j, 2);
            if (idx < (uint64_t)n)   /* a corrupt index is dropped, never written */
                acc[idx] += bf16_to_f32(h);
        }
        break;
    default:
        break;
    }
}

/* Encode bucket b (its gradients, plus what error feedback kept) and start
 * gathering every rank's encoding. */
/* Top-k's ratio at step t: during the warm-up it falls geometrically from
 * 25% to the configured ratio (DGC's warm-up), then stays there. */
static double ddp_topk_ratio(const dt_ddp *d, int64_t t)
{
    double r = d->cfg.topk_ratio > 0 ? d->cfg.topk_ratio : 0.01;
    int64_t w = d->cfg.topk_warmup_steps;
    if (w <= 0 || t >= w || r >= 0.25)
        return r;
    double q = (double)t / (double)w;
    return exp(log(0.25) * (1 - q) + log(r) * q);
}

/* This step's entries per piece and the payload's size. */
static void ddp_topk_size(const dt_ddp *d, ddp_bucket *b, double ratio)
{
    b->topk = 0;
    for (int p = 0; p < b->npieces; p++) {
        int64_t len = b->pieces[3 * p + 1] - b->pieces[3 * p];
        int64_t kp = (int64_t)ceil(ratio * (double)len);
        kp = kp < 1 ? 1 : kp > len ? len : kp;
        b->pieces[3 * p + 2] = kp;
        b->topk += kp;
    }
    b->code_bytes = ddp_code_bytes(d->cfg.compress, b->numel, b->topk);
    b->payload_floats = (int64_t)((b->code_bytes + 3) / 4) + b->count;
}

static dt_work *ddp_launch_compressed(dt_ddp *d, ddp_bucket *b, float *grads, const float *flags)
{
    if (d->cfg.compress == DT_COMPRESS_TOPK) {
        if (b == d->buckets)
            d->topk_steps++;
        ddp_topk_size(d, b, ddp_topk_ratio(d, d->topk_steps - 1));
    }
    int ef = d->cfg.error_feedback &&
             (d->cfg.compress == DT_COMPRESS_TOPK || d->cfg.compress == DT_COMPRESS_INT8);
    /* Momentum correction (Deep Gradient Compression): with SGD momentum m
     * the momentum is kept here, u = m u + g, and the residual accumulates u
     * rather than g; what is sent leaves both (momentum factor masking), and
     * the optimizer steps without momentum. */
    if (b->velocity)
        for (int64_t i = 0; i < b->numel; i++) {
            b->velocity[i] = d->momentum * b->velocity[i] + grads[i];
            grads[i] = b->velocity[i];
        }
    if (ef)
        for (int64_t i = 0; i < b->numel; i++)
            grads[i] += b->residual[i];
    float *sent = ef ? b->residual : d->scratch + b->numel;
    ddp_encode(d, b, grads, (char *)b->payload, sent);
    if (ef)
        for (int64_t i = 0; i < b->numel; i++)
            b->residual[i] = grads[i] - sent[i];
    if (b->velocity)
        for (int64_t i = 0; i < b->numel; i++)
            if (d->picked[i])
                b->velocity[i] = 0;
    memcpy((char *)b->payload + (b->payload_floats - b->count) * 4, flags,
           (size_t)b->count * sizeof(float));
    d->st.payload_bytes += (uint64_t)b->payload_floats * 4;
    return enqueue(d->comm, COLL_ALLGATHER, b->gathered, b->payload, b->payload_floats, 0,
                   DT_REDUCE_SUM);
}

/* A compressed push to the parameter servers: each server's part of the
 * bucket encoded on its own (18.2), error feedback as above; the servers
 * decode, so nothing comes back to decode here. */
static void ddp_ps_encode(dt_ddp *d, ddp_bucket *b)
{
    int ef = d->cfg.error_feedback &&
             (d->cfg.compress == DT_COMPRESS_TOPK || d->cfg.compress == DT_COMPRESS_INT8);
    if (d->cfg.compress == DT_COMPRESS_TOPK && b == d->buckets)
        d->topk_steps++;
    size_t bytes = ps_encode_push(d->cfg.ps, &b->pcall, d->cfg.compress,
                                  ddp_topk_ratio(d, d->topk_steps - 1), ef ? b->residual : NULL,
                                  d->scratch, (char *)b->payload);
    d->st.payload_bytes += bytes + (uint64_t)b->count * sizeof(float);
}

/* Buffers for compressed pushes: a bucket's codes (at most 6 bytes a
 * float, TOPK keeping all), its residual, and encoding scratch. */
static dt_status ddp_alloc_ps_code(dt_ddp *d)
{
    int64_t biggest = 1;
    for (int j = 0; j < d->nbuckets; j++) {
        ddp_bucket *b = &d->buckets[j];
        biggest = b->numel > biggest ? b->numel : biggest;
        b->payload = host_alloc(d->ctx, (size_t)b->numel * 6 + 16 * PS_MAX_SERVERS);
        b->residual = host_calloc(d->ctx, (size_t)(b->numel ? b->numel : 1) * sizeof(float));
        if (!b->payload || !b->residual)
            return DT_ENOMEM;
    }
    d->scratch = host_calloc(d->ctx, (size_t)biggest * 2 * sizeof(float));
    return d->scratch ? DT_OK : DT_ENOMEM;
}

/* Every rank's encoding of bucket b, decoded and summed in rank order into
 * its gradients and flags, then averaged: the same on every rank. */
static void ddp_finish_compressed(dt_ddp *d, ddp_bucket *b)
{
    int P = dt_comm_size(d->comm);
    float *grads = d->set[d->cur] + b->offset, *flags = grads + b->numel;
    memset(grads, 0, (size_t)(b->numel + b->count) * sizeof(float));
    for (int r = 0; r < P; r++) {
        const float *pl = b->gathered + (int64_t)r * b->payload_floats;
        grad_decode_add(d->cfg.compress, (const char *)pl, b->numel, b->topk, grads);
        for (int k = 0; k < b->count; k++)
            flags[k] += pl[b->payload_floats - b->count + k];
    }
    float inv = 1.0f / (float)P;
    for (int64_t i = 0; i < b->numel; i++)
        grads[i] *= inv;
}

/* Top-k's pieces of bucket b: each parameter's part of it sends
 * ceil(ratio * its length) entries (at least one). */
static dt_status ddp_plan_topk(dt_ddp *d, ddp_bucket *b, double ratio)
{
    b->pieces = host_calloc(d->ctx, sizeof(int64_t) * 3 * (size_t)(d->nparams ? d->nparams : 1));
    if (!b->pieces)
        return DT_ENOMEM;
    b->topk = 0;
    for (int k = 0; k < d->nparams; k++) {
        int i = d->order[k];
        int64_t lo = d->offset[i], hi = lo + dt_tensor_numel(d->params[i]);
        lo = lo > b->offset ? lo : b->offset;
        hi = hi < b->offset + b->numel ? hi : b->offset + b->numel;
        if (hi <= lo)
            continue;
        int64_t *pc = &b->pieces[3 * b->npieces++];
        pc[0] = lo - b->offset;
        pc[1] = hi - b->offset;
    }
    ddp_topk_size(d, b, ratio);
    return DT_OK;
}

/* Buffers for compression, per bucket; error feedback starts at zero. */
static dt_status ddp_alloc_compression(dt_ddp *d)
{
    int P = dt_comm_size(d->comm);
    int64_t biggest = 1;
    /* buffers for the largest ratio: the warm-up's first step */
    double ratio = ddp_topk_ratio(d, 0);
    const dt_optim *o = d->opt;
    if (d->cfg.compress == DT_COMPRESS_TOPK && d->cfg.error_feedback && o && o->cfg.kind == DT_SGD &&
        o->cfg.momentum > 0 && !o->cfg.nesterov && o->cfg.dampening == 0)
        d->momentum = o->cfg.momentum;
    for (int j = 0; j < d->nbuckets; j++) {
        ddp_bucket *b = &d->buckets[j];
        biggest = b->numel > biggest ? b->numel : biggest;
        if (d->cfg.compress == DT_COMPRESS_TOPK) {
            if (ddp_plan_topk(d, b, ratio) != DT_OK)
                return DT_ENOMEM;
        } else {
            b->code_bytes = ddp_code_bytes(d->cfg.compress, b->numel, 0);
            b->payload_floats = (int64_t)((b->code_bytes + 3) / 4) + b->count;
        }
        b->payload = host_calloc(d->ctx, (size_t)b->payload_floats * sizeof(float));
        b->gathered = host_calloc(d->ctx, (size_t)b->payload_floats * (size_t)P * sizeof(float));
        b->residual = host_calloc(d->ctx, (size_t)(b->numel ? b->numel : 1) * sizeof(float));
        if (!b->payload || !b->gathered || !b->residual)
            return DT_ENOMEM;
        if (d->momentum > 0 &&
            !(b->velocity = host_calloc(d->ctx, (size_t)(b->numel ? b->numel : 1) * sizeof(float))))
            return DT_ENOMEM;
    }
    d->scratch = host_calloc(d->ctx, (size_t)biggest * 2 * sizeof(float));
    d->picked = host_calloc(d->ctx, (size_t)biggest);
    return d->scratch && d->picked ? DT_OK : DT_ENOMEM;
}

/* --- 16.2 launching buckets during backward ------------------------------- */

/* Hand bucket b to the comm thread (the last one carries the used-flags)
 * and start the average. */
static void ddp_weigh(dt_ddp *d, int64_t offset, int64_t numel);

static void ddp_launch(dt_ddp *d, ddp_bucket *b)
{
    ddp_weigh(d, b->offset, b->numel);
    float *flags = ddp_flags(d, d->cur, b);   /* the last bucket's: all parameters' */
    for (int k = 0; k < b->count; k++)
        flags[k] = d->params[k]->grad->flags & T_ZERO ? 0.0f : 1.0f;
    /* Staged: the comm thread waits for the copy before it sends; encoders
     * read the gradients right here, so they wait now. */
    uint64_t ticket = ddp_stage_out(d, b->offset, b->numel);
    if (ticket && (d->cfg.compress == DT_COMPRESS_TOPK || d->cfg.compress == DT_COMPRESS_INT8 ||
                   (d->cfg.ps && d->cfg.compress != DT_COMPRESS_NONE)))
        d->be_iface->copy_wait(d->be, ticket);
    else
        d->comm->stage_ticket = ticket;
    if (b == d->buckets) {   /* the step's first */
        d->sent_at_launch = dt_comm_bytes_sent(d->comm);
        d->zero_gen = d->ctx->zero_gen;
    }
    if (d->cfg.ps) {   /* pushed to the servers (18); dt_ddp_sync pulls */
        b->pcall = (ps_call){.ps = d->cfg.ps, .op = PS_PUSH, .lo = b->offset,
                             .n = b->numel + b->count, .buf = d->set[d->cur] + b->offset,
                             .clock = ps_clock(d->cfg.ps)};
        if (d->cfg.compress != DT_COMPRESS_NONE)
            ddp_ps_encode(d, b);
        else
            d->st.payload_bytes += (uint64_t)b->numel * sizeof(float);
        b->work = enqueue_in(d->comm, COLL_PS, b->pcall.buf, NULL, b->pcall.n, 0, DT_REDUCE_SUM,
                             &b->pcall);
    } else if (d->cfg.compress == DT_COMPRESS_BF16 || d->cfg.compress == DT_COMPRESS_FP16) {
        /* reduced in 16 bits on the wire, in place (14.4's allreduce16) */
        b->work = enqueue(d->comm, COLL_ALLREDUCE16, d->set[d->cur] + b->offset, NULL,
                          b->numel + b->count, d->cfg.compress == DT_COMPRESS_BF16 ? 1 : 2,
                          DT_REDUCE_AVG);
        d->st.payload_bytes += (uint64_t)(b->numel + b->count) * 2;
    } else if (d->cfg.compress != DT_COMPRESS_NONE) {
        b->work = ddp_launch_compressed(d, b, d->set[d->cur] + b->offset, flags);
    } else if (d->shared.base) {   /* the other ranks read it where it is (14.4) */
        b->work = enqueue_in(d->comm, COLL_ALLREDUCE_SHARED, d->set[d->cur] + b->offset, NULL,
                             b->numel + b->count, 0, DT_REDUCE_AVG, &d->shared);
    } else {
        b->work = dt_allreduce_async(d->comm, d->set[d->cur] + b->offset, b->numel + b->count,
                                     DT_REDUCE_AVG);
        d->st.payload_bytes += (uint64_t)b->numel * sizeof(float);
    }
    if (d->comm->stage_ticket)   /* not consumed: the launch failed; let the copy land */
        d->be_iface->copy_wait(d->be, d->comm->stage_ticket);
    d->comm->stage_ticket = 0;
    if (!b->work && d->launch_status == DT_OK) {
        d->launch_status = d->ctx->last_status;
        snprintf(d->launch_msg, sizeof d->launch_msg, "%s", d->ctx->err);
    }
    d->st.grad_bytes += (uint64_t)b->numel * sizeof(float);
}

/* No overlap, no compression: every bucket is ready at once, and they are
 * contiguous; one allreduce of the whole set costs the host's ranks one
 * round of phases (or the transport one schedule) instead of one a bucket,
 * and it runs right here (the comm thread idle: no hand-over). */
static void ddp_reduce_whole(dt_ddp *d)
{
    ddp_bucket *last = &d->buckets[d->nbuckets - 1];
    float *flags = ddp_flags(d, d->cur, last);
    for (int k = 0; k < last->count; k++)
        flags[k] = d->params[k]->grad->flags & T_ZERO ? 0.0f : 1.0f;
    d->sent_at_launch = dt_comm_bytes_sent(d->comm);
    d->zero_gen = d->ctx->zero_gen;
    ddp_weigh(d, 0, d->grad_floats);
    double t0 = dt_now();
    uint64_t ticket = ddp_stage_out(d, 0, d->grad_floats);
    if (ticket)
        d->be_iface->copy_wait(d->be, ticket);
    dt_status s = d->shared.base
                      ? run_collective_in(d->comm, COLL_ALLREDUCE_SHARED, d->set[d->cur], NULL,
                                          d->set_floats, 0, DT_REDUCE_AVG, &d->shared)
                      : dt_allreduce(d->comm, d->set[d->cur], d->set_floats, DT_REDUCE_AVG);
    d->st.comm_s += dt_now() - t0;
    if (s != DT_OK && d->launch_status == DT_OK) {
        d->launch_status = s;
        snprintf(d->launch_msg, sizeof d->launch_msg, "%s", d->ctx->err);
    }
    d->st.grad_bytes += (uint64_t)d->grad_floats * sizeof(float);
    d->st.payload_bytes += (uint64_t)d->grad_floats * sizeof(float);
    d->next_launch = d->nbuckets;
}

/* Launch every ready bucket whose predecessors have all been launched. */
static void ddp_launch_ready(dt_ddp *d)
{
    while (d->next_launch < d->nbuckets && d->buckets[d->next_launch].pending == 0)
        ddp_launch(d, &d->buckets[d->next_launch++]);
}

/* Floats [done, upto) of parameter i's gradient are final: the buckets
 * they fall in have that many fewer to wait for. */
static void ddp_mark_final(dt_ddp *d, int i, int64_t upto)
{
    int64_t lo = d->offset[i] + d->done[i], hi = d->offset[i] + upto;
    if (hi <= lo)
        return;
    d->done[i] = upto;
    for (int64_t j = lo / d->bucket_floats; j < d->nbuckets && d->buckets[j].offset < hi; j++) {
        ddp_bucket *b = &d->buckets[j];
        int64_t a = lo > b->offset ? lo : b->offset;
        int64_t e = hi < b->offset + b->numel ? hi : b->offset + b->numel;
        if (e > a)
            b->pending -= e - a;
    }
}

/* Parameter i's whole gradient is final; one that got none is zeroed in its
 * slot (the other ranks may have one: this rank adds nothing). */
static void ddp_param_final(dt_ddp *d, int i)
{
    dt_tensor *g = d->params[i]->grad;
    int64_t n = dt_tensor_numel(g);
    if (d->done[i] == n)
        return;
    if (g->flags & T_ZERO)
        d->be_iface->memset0(d->be, (float *)g->data + d->done[i],
                             (size_t)(n - d->done[i]) * sizeof(float));
    ddp_mark_final(d, i, n);
}

/* For linear's backward (7.2): rows of w's gradient to compute per block so
 * each finished block can travel while the next computes; 0: all at once.
 * Only for a large weight whose last use on the tape this is. */
#define DDP_CHUNK_MIN_FLOATS 65536
static int64_t ddp_grad_chunk_rows(dt_ctx *ctx, const dt_tensor *w, int64_t rows, int64_t cols)
{
    dt_ddp *d = ctx->ddp;
    if (!d || !d->hooks || !(w->flags & T_PARAM) || w->ctx != ctx || cols <= 0 ||
        d->uses[w->param_index] != 1 || d->recompute_left > 0 ||
        rows * cols < 2 * DDP_CHUNK_MIN_FLOATS)
        return 0;
    int64_t target = rows * cols / 4;   /* at least four blocks, at most a bucket each */
    target = target < d->bucket_floats ? target : d->bucket_floats;
    target = target > DDP_CHUNK_MIN_FLOATS / 2 ? target : DDP_CHUNK_MIN_FLOATS / 2;
    int64_t step = target / cols > 0 ? target / cols : 1;
    return step < rows ? step : 0;
}

static void ddp_grad_rows_done(dt_ctx *ctx, const dt_tensor *w, int64_t rows_done, int64_t cols)
{
    dt_ddp *d = ctx->ddp;
    if (!d || !d->hooks || !(w->flags & T_PARAM) || w->ctx != ctx ||
        d->uses[w->param_index] != 1 || d->recompute_left > 0)
        return;   /* not this op's to declare final */
    ddp_mark_final(d, w->param_index, rows_done * cols);
    int before = d->next_launch;
    ddp_launch_ready(d);
    d->st.block_launches += d->next_launch - before;
}

/* Every parameter with no uses left is final (while a recompute segment is
 * still ahead on the tape, it may use any parameter: wait for it). */
static void ddp_finalize_unused(dt_ddp *d)
{
    for (int i = 0; i < d->nparams; i++)
        if (d->uses[i] == 0)
            ddp_param_final(d, i);
}

static dt_status ddp_finish(dt_ddp *d);

/* A node's inputs: concat keeps its (any number of) inputs aside. */
static int node_inputs(const dt_node *n, dt_tensor *const **out)
{
    if (n->backward == concat_backward) {
        *out = n->aux[0];
        return (int)n->iarg[0];
    }
    *out = n->in;
    return n->n_in;
}

static dt_status ddp_backward_begin(dt_ddp *d)
{
    dt_ctx *ctx = d->ctx;
    if (ctx->n_params != d->nparams)
        return set_error(ctx, DT_ESTATE, "backward: %d parameters were registered after "
                         "dt_ddp_new wrapped %d; wrap the whole model", ctx->n_params - d->nparams,
                         d->nparams);
    /* A second backward before dt_ddp_sync: let the first one's allreduces
     * finish before touching the memory they reduce.  Compressed, the
     * averaged gradient would go through error feedback a second time. */
    if (d->pending_sync && d->cfg.compress != DT_COMPRESS_NONE)
        return set_error(ctx, DT_ESTATE, "backward: with gradient compression, call dt_ddp_sync "
                         "(or dt_ddp_step) before the next backward; accumulate with "
                         "dt_ddp_set_sync(ddp, 0) instead");
    if (d->pending_sync) {
        dt_status s = ddp_finish(d);
        if (s != DT_OK)
            return s;
    }
    d->t_backward = dt_now();
    d->hooks = 0;
    int fresh = 1;
    for (int i = 0; i < d->nparams && fresh; i++)
        fresh = (d->params[i]->grad->flags & T_ZERO) != 0;
    if (fresh)
        ddp_point_grads(d, d->cur ^ 1);
    if (!d->sync)
        return DT_OK;
    d->pending_sync = 1;
    d->launch_status = DT_OK;
    d->next_launch = 0;
    if (!d->overlap)
        return DT_OK;   /* dt_ddp_sync launches everything */
    memset(d->uses, 0, (size_t)d->nparams * sizeof *d->uses);
    memset(d->done, 0, (size_t)d->nparams * sizeof *d->done);
    d->recompute_left = 0;
    for (const dt_node *n = ctx->tape; n; n = n->prev) {
        if (n->seg_fn)
            d->recompute_left++;
        dt_tensor *const *in;
        int nin = node_inputs(n, &in);
        for (int k = 0; k < nin; k++)
            if (in[k] && (in[k]->flags & T_PARAM) && in[k]->ctx == ctx)
                d->uses[in[k]->param_index]++;
    }
    for (int b = 0; b < d->nbuckets; b++)
        d->buckets[b].pending = d->buckets[b].numel;
    if (d->recompute_left == 0)
        ddp_finalize_unused(d);
    d->hooks = 1;
    ddp_launch_ready(d);
    return DT_OK;
}

static void ddp_node_done(dt_ddp *d, const dt_node *n)
{
    if (!d->hooks)
        return;
    int launch = 0;
    if (n->seg_fn && --d->recompute_left == 0) {
        ddp_finalize_unused(d);
        launch = 1;
    }
    dt_tensor *const *in;
    int nin = node_inputs(n, &in);
    for (int k = 0; k < nin; k++) {
        const dt_tensor *t = in[k];
        if (t && (t->flags & T_PARAM) && t->ctx == d->ctx && --d->uses[t->param_index] == 0 &&
            d->recompute_left == 0) {
            ddp_param_final(d, t->param_index);
            launch = 1;
        }
    }
    if (launch)
        ddp_launch_ready(d);
}

/* Whatever happened, every bucket is launched before backward returns (a
 * rank that stopped launching would leave the others waiting). */
static dt_status ddp_backward_end(dt_ddp *d, dt_status backward_status)
{
    if (d->hooks) {
        for (int i = 0; i < d->nparams; i++)
            ddp_param_final(d, i);
        ddp_launch_ready(d);
        d->hooks = 0;
    }
    d->st.backward_s += dt_now() - d->t_backward;
    return backward_status;
}

/* --- 16.3 finishing a step ------------------------------------------------ */

/* Launch what is owed (no-overlap mode), wait for every bucket in order,
 * and mark the gradients no rank produced as absent again. */
static dt_status ddp_finish_run(dt_ddp *d);
static dt_status ddp_check_ranks(dt_ddp *d);

/* The wait for the step's buckets is exposed communication. */
static dt_status ddp_finish(dt_ddp *d)
{
    if (!d->pending_sync)
        return DT_OK;
    double t0 = prof_begin(d->ctx);
    dt_status s = ddp_finish_run(d);
    if (s == DT_OK)
        s = ddp_check_ranks(d);
    prof_end(d->ctx, PH_COMM_WAIT, t0);
    return s;
}

static dt_status ddp_finish_run(dt_ddp *d)
{
    if (!d->pending_sync)
        return DT_OK;
    double t0 = dt_now();
    if (d->next_launch < d->nbuckets) {   /* no overlap: nothing was tracked */
        memset(d->done, 0, (size_t)d->nparams * sizeof *d->done);
        for (int i = 0; i < d->nparams; i++)
            ddp_param_final(d, i);
    }
    if (d->next_launch == 0 && d->cfg.compress == DT_COMPRESS_NONE && !d->cfg.ps)
        ddp_reduce_whole(d);
    while (d->next_launch < d->nbuckets)
        ddp_launch(d, &d->buckets[d->next_launch++]);
    dt_status first = d->launch_status;
    char msg[DT_MAX_ERROR];
    snprintf(msg, sizeof msg, "%s", d->launch_msg);
    for (int b = 0; b < d->nbuckets; b++) {
        if (!d->buckets[b].work)
            continue;
        double run = 0;
        dt_status s = work_finish(d->buckets[b].work, &run);
        d->buckets[b].work = NULL;
        d->st.comm_s += run;
        if (s == DT_OK && !d->cfg.ps &&
            (d->cfg.compress == DT_COMPRESS_TOPK || d->cfg.compress == DT_COMPRESS_INT8))
            ddp_finish_compressed(d, &d->buckets[b]);
        if (s != DT_OK && first == DT_OK) {
            first = s;
            snprintf(msg, sizeof msg, "%s", d->ctx->err);
        }
    }
    if (first == DT_OK && d->cfg.ps) {   /* the step is pushed: the new parameters */
        ps_pushed(d->cfg.ps, d->nbuckets);
        if ((first = ps_step_pull(d->cfg.ps)) != DT_OK)
            snprintf(msg, sizeof msg, "%s", d->ctx->err);
    }
    d->st.exposed_s += dt_now() - t0;
    d->pending_sync = 0;
    if (first != DT_OK)
        return set_error(d->ctx, first, "ddp: gradient %s failed: %s",
                         d->cfg.ps ? "push or parameter pull" : "allreduce", msg);
    if (!d->cfg.ps)
        ddp_stage_in(d);
    /* a zero_grad since the buckets started discards what they reduced */
    int zeroed = d->ctx->zero_gen != d->zero_gen;
    const float *flags = d->set[d->cur] + d->grad_floats;
    for (int i = 0; i < d->nparams; i++) {
        dt_tensor *g = d->params[i]->grad;
        if (flags[i] > 0 && !zeroed)
            g->flags &= ~(unsigned)T_ZERO;
        else
            g->flags |= T_ZERO;
    }
    d->st.steps++;
    d->st.bytes_sent += dt_comm_bytes_sent(d->comm) - d->sent_at_launch;
    return DT_OK;
}

/* The loss scaler (9.1) over a DDP: refuse what it cannot serve; finish:
 * the step's reduction first, so it unscales and checks averages. */
static dt_status ddp_for_scaler(dt_ddp *d, int finish)
{
    if (d->cfg.ps)
        return set_error(d->ctx, DT_ENOTSUP, "loss_scaler: with a parameter server the servers "
                         "step on the pushed gradients before they could be unscaled or skipped");
    if (d->cfg.compress == DT_COMPRESS_TOPK || d->cfg.compress == DT_COMPRESS_INT8)
        return set_error(d->ctx, DT_ENOTSUP, "loss_scaler: top-k and int8 compression keep "
                         "scaled gradients in their error feedback");
    return finish ? ddp_finish(d) : DT_OK;
}

dt_status dt_ddp_sync(dt_ddp *d)
{
    if (!d || !d->ctx)
        return DT_EINVAL;
    return ddp_finish(d);
}

dt_status dt_ddp_step(dt_ddp *d)
{
    if (!d || !d->ctx)
        return DT_EINVAL;
    if (!d->opt && !d->cfg.ps)
        return set_error(d->ctx, DT_ESTATE, "ddp_step: this DDP was made without an optimizer");
    dt_status s = ddp_finish(d);
    return s != DT_OK || d->cfg.ps ? s : dt_optim_step(d->opt);   /* servers step for a PS */
}

dt_status dt_ddp_set_sync(dt_ddp *d, int sync)
{
    if (!d || !d->ctx)
        return DT_EINVAL;
    d->sync = sync != 0;
    return DT_OK;
}

dt_status dt_ddp_stats_get(const dt_ddp *d, dt_ddp_stats *out)
{
    if (!d || !out)
        return DT_EINVAL;
    *out = d->st;
    return DT_OK;
}

/* --- 16.5 the ranks' checks and load balancing -------------------------------
 * A balanced step's gradient is the global batch's: each rank's mean over
 * its slice, times world * slice / global, averaged over the ranks, is the
 * mean over the whole global batch. */
static void ddp_weigh(dt_ddp *d, int64_t offset, int64_t numel)
{
    if (!d->bal_ld || numel <= 0)
        return;
    int64_t count, global;
    dt_loader_batch_slice(d->bal_ld, NULL, &count, &global);
    float w = global > 0 ? (float)((double)count * dt_comm_size(d->comm) / (double)global) : 1.0f;
    if (w == 1.0f)
        return;
    float *g = ddp_grads(d, d->cur) + offset;
    d->be_iface->axpby(d->be, numel, 0.0f, g, w, g);
}

/* After every `every` synchronised steps (the same step on every rank):
 * swap compute rates, name a straggler, and re-cut the global batch in
 * proportion to the rates when the shares move by more than 2 points
 * (smaller moves are noise, and each costs the loader a re-cut batch). */
static dt_status ddp_check_ranks(dt_ddp *d)
{
    int every = d->bal_ld ? d->bal_every : d->check_every;
    if (every <= 0 || d->cfg.ps || d->st.steps == 0 || d->st.steps % every)
        return DT_OK;
    int P = dt_comm_size(d->comm);
    double rates[64] = {0};
    if (P > 64)
        return DT_OK;
    dt_status s = prof_exchange(d->ctx, d->comm, rates);
    if (s != DT_OK || !d->bal_ld)
        return s;
    double sum = 0, old = 0, moved = 0;
    for (int r = 0; r < P; r++) {
        if (!(rates[r] > 0))
            return DT_OK;   /* a rank without a closed step yet: next time */
        sum += rates[r];
        old += d->bal_w[r];
    }
    for (int r = 0; r < P; r++) {
        double m = fabs(rates[r] / sum - d->bal_w[r] / old);
        moved = m > moved ? m : moved;
    }
    if (moved <= 0.02)
        return DT_OK;
    for (int r = 0; r < P; r++)
        d->bal_w[r] = rates[r] / sum;
    return dt_loader_set_split(d->bal_ld, d->bal_w, P);
}

dt_status dt_ddp_balance(dt_ddp *d, dt_loader *ld, int every)
{
    if (!d || !d->ctx)
        return DT_EINVAL;
    dt_ctx *ctx = d->ctx;
    int P = dt_comm_size(d->comm), me = dt_comm_rank(d->comm);
    if (every <= 0)
        every = 10;
    /* a bad call on one rank still joins the agreement below */
    const char *bad = !ld                             ? "the loader is NULL"
                      : ld->ctx != ctx                 ? "the loader belongs to another context"
                      : d->cfg.ps                      ? "not with a parameter server (its workers "
                                                         "need not agree on a step)"
                      : !ld->cfg.global_batches        ? "the loader needs global_batches"
                      : ld->cfg.shard_count != P || ld->cfg.shard_rank != me
                          ? "the loader's shards must be the ranks (shard_rank = rank, "
                            "shard_count = world)"
                      : P > 64                         ? "at most 64 ranks"
                      : d->bal_ld                      ? "already balancing"
                                                       : NULL;
    float mine[2] = {(float)every, bad ? 1.0f : 0.0f}, *all = host_alloc(ctx, sizeof(float) * 2 * (size_t)P);
    if (!all)
        return set_error(ctx, DT_ENOMEM, "ddp_balance: out of memory");
    dt_status s = run_collective_wait(d->comm, COLL_ALLGATHER, all, mine, 2, 0, DT_REDUCE_SUM, NULL);
    int differ = -1, failed = -1;
    for (int r = 0; s == DT_OK && r < P; r++) {
        if (all[2 * r] != mine[0] && differ < 0)
            differ = r;
        if (all[2 * r + 1] != 0 && failed < 0)
            failed = r;
    }
    float theirs = differ >= 0 ? all[2 * differ] : 0;
    host_free(ctx, all);
    if (s != DT_OK)
        return s;
    if (bad)
        return set_error(ctx, DT_EINVAL, "ddp_balance: %s", bad);
    if (failed >= 0)
        return set_error(ctx, DT_EINVAL, "ddp_balance: rank %d refused its call", failed);
    if (differ >= 0)
        return set_error(ctx, DT_EMISMATCH, "ddp_balance: rank %d balances every %g steps, this "
                         "rank every %d", differ, (double)theirs, every);
    if (!(d->bal_w = host_alloc(ctx, sizeof(double) * (size_t)P)))
        return set_error(ctx, DT_ENOMEM, "ddp_balance: out of memory");
    for (int r = 0; r < P; r++)
        d->bal_w[r] = 1.0 / P;
    d->bal_ld = ld;
    d->bal_every = every;
    ctx->prof.balancing = 1;
    __atomic_store_n(&ctx->prof.measure, 1, __ATOMIC_RELAXED);
    return dt_loader_set_split(ld, d->bal_w, P);
}

double dt_ddp_balance_share(const dt_ddp *d)
{
    if (!d || !d->comm)
        return 0;
    int P = dt_comm_size(d->comm);
    return d->bal_w ? d->bal_w[dt_comm_rank(d->comm)] : 1.0 / P;
}

void dt_ddp_stats_reset(dt_ddp *d)
{
    if (!d)
        return;
    dt_ddp_stats keep = d->st;
    memset(&d->st, 0, sizeof d->st);
    d->st.buckets = keep.buckets;
    d->st.bucket_bytes = keep.bucket_bytes;
    d->st.overlap = keep.overlap;
    d->st.shared_buckets = keep.shared_buckets;
}

/* --- 16.4 wrapping: the model check, buckets, rank 0's weights ------------ */

/* The DDP settings on line 0, then "name (d0, d1)" per parameter, in
 * registration order. */
static char *ddp_describe(dt_ctx *ctx, const char *settings, size_t *len_out)
{
    size_t cap = 64 + strlen(settings), len = 0;
    for (int i = 0; i < ctx->n_params; i++)
        cap += strlen(ctx->params[i]->name) + 24 * DT_MAX_DIMS + 8;
    char *s = host_alloc(ctx, cap);
    if (!s)
        return NULL;
    len = (size_t)snprintf(s, cap, "%s\n", settings);
    for (int i = 0; i < ctx->n_params; i++) {
        char sb[96];
        len += (size_t)snprintf(s + len, cap - len, "%s %s\n", ctx->params[i]->name,
                                SHAPE(ctx->params[i], sb));
    }
    *len_out = len;
    return s;
}

/* Line k of a description (without its newline) into out; "" past the end. */
static void ddp_line(const char *desc, int k, char *out, size_t cap)
{
    const char *p = desc;
    for (; k > 0 && p; k--) {
        p = strchr(p, '\n');
        if (p)
            p++;
    }
    size_t n = 0;
    while (p && p[n] && p[n] != '\n')
        n++;
    snprintf(out, cap, "%.*s", (int)(n < cap ? n : cap - 1), p ? p : "");
}

/* This rank's first difference from rank 0's description, or "". */
static void ddp_diff(const char *mine, const char *root, int rank, char *out, size_t cap)
{
    out[0] = '\0';
    for (int k = 0;; k++) {
        char a[DT_MAX_NAME + 128], b[DT_MAX_NAME + 128];
        ddp_line(root, k, a, sizeof a);
        ddp_line(mine, k, b, sizeof b);
        if (!a[0] && !b[0])
            return;
        if (strcmp(a, b) == 0)
            continue;
        if (k == 0) {
            snprintf(out, cap, "the DDP settings are '%.90s' on rank 0 but '%.90s' on rank %d",
                     a, b, rank);
            return;
        }
        k--;   /* parameters start on line 1 */
        if (!a[0])
            snprintf(out, cap, "rank %d has an extra parameter %d, '%.90s', that rank 0 lacks", rank,
                     k, b);
        else if (!b[0])
            snprintf(out, cap, "rank %d lacks parameter %d, '%.90s', that rank 0 has", rank, k, a);
        else
            snprintf(out, cap, "parameter %d is '%.90s' on rank 0 but '%.90s' on rank %d", k, a, b, rank);
        return;
    }
}

/* Every rank learns whether all models match rank 0's, and if not the
 * first difference (the lowest rank that has one), as an error. */
static dt_status ddp_check_models(dt_ctx *ctx, dt_comm *c, const char *settings)
{
    size_t len = 0;
    char *mine = ddp_describe(ctx, settings, &len);
    float *buf = NULL;
    char *root = NULL;
    dt_status s = DT_ENOMEM;
    int world = dt_comm_size(c), rank = dt_comm_rank(c);
    float flen = (float)len;
    if (!mine)
        goto out;
    if (len > (1u << 24))
        { s = set_error(ctx, DT_ENOTSUP, "ddp_new: model description too long"); goto out; }
    if ((s = dt_broadcast(c, &flen, 1, 0)) != DT_OK)
        goto out;
    size_t rlen = (size_t)flen;
    size_t nf = rlen > (size_t)DT_DDP_DIFF * (size_t)world ? rlen : (size_t)DT_DDP_DIFF * (size_t)world;
    buf = host_alloc(ctx, (nf + DT_DDP_DIFF) * sizeof(float));
    root = host_alloc(ctx, rlen + 1);
    s = DT_ENOMEM;
    if (!buf || !root)
        goto out;
    for (size_t i = 0; i < rlen; i++)
        buf[i] = rank == 0 ? (float)(unsigned char)mine[i] : 0.0f;
    if ((s = dt_broadcast(c, buf, (int64_t)rlen, 0)) != DT_OK)
        goto out;
    for (size_t i = 0; i < rlen; i++)
        root[i] = (char)(unsigned char)buf[i];
    root[rlen] = '\0';
    char diff[DT_DDP_DIFF];
    ddp_diff(mine, root, rank, diff, sizeof diff);
    float *my = buf + nf;
    for (int i = 0; i < DT_DDP_DIFF; i++)
        my[i] = (float)(unsigned char)diff[i];
    if ((s = dt_allgather(c, my, DT_DDP_DIFF, buf)) != DT_OK)
        goto out;
    for (int r = 0; r < world; r++) {
        if (buf[(size_t)r * DT_DDP_DIFF] == 0.0f)
            continue;
        for (int i = 0; i < DT_DDP_DIFF; i++)
            diff[i] = (char)(unsigned char)buf[(size_t)r * DT_DDP_DIFF + i];
        diff[DT_DDP_DIFF - 1] = '\0';
        s = set_error(ctx, DT_EMISMATCH, "ddp_new: the ranks' models differ: %s", diff);
        goto out;
    }
    s = DT_OK;
out:
    if (s == DT_ENOMEM && ctx->last_status != DT_ENOMEM)
        set_error(ctx, DT_ENOMEM, "ddp_new: out of memory");
    host_free(ctx, mine);
    host_free(ctx, buf);
    host_free(ctx, root);
    return s;
}

/* DTRAIN_COMPRESS picks the compression when the program left it at none. */
static dt_status ddp_compress_from_env(dt_ctx *ctx, dt_ddp_config *cfg)
{
    static const char *const names[] = {"none", "bf16", "fp16", "topk", "int8"};
    const char *e = getenv("DTRAIN_COMPRESS");
    if (cfg->compress != DT_COMPRESS_NONE || !e || !*e)
        return DT_OK;
    for (int k = 0; k < 5; k++)
        if (!strcmp(e, names[k])) {
            cfg->compress = (dt_compress)k;
            return DT_OK;
        }
    return set_error(ctx, DT_EINVAL, "ddp_new: DTRAIN_COMPRESS='%s': expected none, bf16, fp16, "
                     "topk or int8", e);
}

static size_t ddp_bucket_cap(const dt_ddp_config *cfg, const dt_ctx *ctx)
{
    if (cfg->bucket_bytes)
        return cfg->bucket_bytes;
    const char *e = getenv("DTRAIN_BUCKET_BYTES");
    char *end;
    unsigned long long v = e ? strtoull(e, &end, 10) : 0;
    if (e && *e && !*end && v > 0)
        return (size_t)v;
    size_t total = 0;
    for (int i = 0; i < ctx->n_params; i++)
        total += tensor_bytes(ctx->params[i]);
    size_t cap = total / 8;
    return cap < DT_DDP_MIN_BUCKET_BYTES ? DT_DDP_MIN_BUCKET_BYTES
         : cap > DT_DDP_MAX_BUCKET_BYTES ? DT_DDP_MAX_BUCKET_BYTES : cap;
}

/* Gradients lie contiguous in reverse registration order (the order
 * backward finishes them), then one flag per parameter; buckets cut that
 * every cap bytes, so a large parameter may span several (its row blocks
 * then travel as linear's backward makes them). */
static dt_status ddp_plan(dt_ddp *d, size_t cap)
{
    int64_t off = 0;
    for (int k = 0; k < d->nparams; k++) {
        int i = d->nparams - 1 - k;
        d->order[k] = i;
        d->offset[i] = off;
        off += dt_tensor_numel(d->params[i]);
    }
    d->grad_floats = off;
    d->bucket_floats = cap / sizeof(float) > 0 ? (int64_t)(cap / sizeof(float)) : 1;
    int64_t nb = off > 0 ? (off + d->bucket_floats - 1) / d->bucket_floats : 1;
    if (nb > INT32_MAX / 2)
        return set_error(d->ctx, DT_EINVAL, "ddp_new: bucket_bytes %zu makes %lld buckets",
                         cap, (long long)nb);
    d->buckets = host_calloc(d->ctx, sizeof *d->buckets * (size_t)nb);
    if (!d->buckets)
        return DT_ENOMEM;
    d->nbuckets = (int)nb;
    for (int j = 0; j < d->nbuckets; j++) {
        ddp_bucket *b = &d->buckets[j];
        b->offset = (int64_t)j * d->bucket_floats;
        b->numel = off - b->offset < d->bucket_floats ? off - b->offset : d->bucket_floats;
    }
    d->buckets[d->nbuckets - 1].count = d->nparams;
    d->set_floats = off + d->nparams > 0 ? off + d->nparams : 1;
    return DT_OK;
}

/* Uncompressed buckets on one host go in a region every local rank maps
 * (shared_region_map): the allreduce then reads them in place instead of
 * copying them through the segment's slots (docs/DATA_PARALLEL.md).  Both
 * sets in one part; host memory, which is what the backend's is here
 * (dt_ddp_new checks host_visible).  DT_OK with no region: private sets. */
static dt_status ddp_alloc_sets(dt_ddp *d)
{
    /* staged: the sets take device-to-host copies, which are asynchronous
     * only into page-locked memory, and the shared region is not */
    if (d->cfg.compress != DT_COMPRESS_NONE || d->cfg.ps || d->staged)
        return DT_OK;
    size_t stride = ((size_t)d->set_floats * sizeof(float) + 127) & ~(size_t)127;
    int ok = 0;
    dt_status s = shared_region_map(d->comm, 2 * stride, &d->shared, &ok);
    if (s != DT_OK || !ok)
        return s;
    char *mine = d->shared.base + (size_t)d->shared.me * d->shared.part;
    memset(mine, 0, 2 * stride);
    d->set[0] = (float *)mine;
    d->set[1] = (float *)(mine + stride);
    d->st.shared_buckets = 1;
    return DT_OK;
}

/* The sets, where not in shared memory: backend memory, or when staged
 * host memory (page-locked if the backend has it) plus device twins. */
static dt_status ddp_alloc_private_sets(dt_ddp *d)
{
    size_t bytes = (size_t)d->set_floats * sizeof(float);
    for (int k = 0; k < 2; k++) {
        float **mem = d->staged ? &d->dset[k] : d->shared.base ? NULL : &d->set[k];
        if (!mem)
            continue;
        if (!(*mem = d->be_iface->alloc(d->be, bytes)))
            return DT_ENOMEM;
        d->be_iface->memset0(d->be, *mem, bytes);
    }
    if (!d->staged || d->shared.base)
        return DT_OK;
    if (d->be_iface->host_alloc) {
        d->set[0] = d->be_iface->host_alloc(d->be, bytes);
        d->set[1] = d->be_iface->host_alloc(d->be, bytes);
        d->pinned = d->set[0] && d->set[1];
        for (int k = 0; k < 2 && !d->pinned; k++) {
            if (d->set[k])
                d->be_iface->host_free(d->be, d->set[k]);
            d->set[k] = NULL;
        }
    }
    for (int k = 0; k < 2 && !d->pinned; k++)   /* no page-locked memory: ordinary */
        if (!(d->set[k] = host_alloc(d->ctx, bytes)))
            return DT_ENOMEM;
    memset(d->set[0], 0, bytes);
    memset(d->set[1], 0, bytes);
    return DT_OK;
}

/* overlap -1: does the allreduce have something to run on while backward
 * computes?  Across hosts the comm thread mostly waits on the network.  On
 * one host it copies memory, and needs a CPU the compute threads do not
 * use: more CPUs in this process's affinity than compute threads (an
 * unbound rank counts its share of the online CPUs). */
static int ddp_auto_overlap(const dt_ddp *d)
{
    if (d->comm->nhosts > 1 || d->staged)   /* staged: the host CPUs are idle */
        return 1;
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    cpu_set_t set;
    long cpus = online > 0 ? online : 1;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) < cpus)
        cpus = CPU_COUNT(&set);
    else if (d->comm->nlocal > 1)
        cpus /= d->comm->nlocal;
    return cpus > d->ctx->threads;
}

/* Rank 0's parameter values to every rank, packed through set 0. */
static dt_status ddp_broadcast_params(dt_ddp *d)
{
    float *stage = d->set[0];
    for (int i = 0; i < d->nparams; i++)
        be_to_host(d->ctx, stage + d->offset[i], d->params[i]->data, tensor_bytes(d->params[i]));
    dt_status s = dt_broadcast(d->comm, stage, d->set_floats, 0);
    if (s != DT_OK)
        return s;
    for (int i = 0; i < d->nparams; i++)
        be_to_device(d->ctx, d->params[i]->data, stage + d->offset[i], tensor_bytes(d->params[i]));
    return DT_OK;
}

static void ddp_release(dt_ddp *d)
{
    if (d->bal_ld && d->ctx) {
        d->ctx->prof.balancing = 0;
        __atomic_store_n(&d->ctx->prof.measure, d->ctx->prof.record, __ATOMIC_RELAXED);
    }
    host_free(d->ctx, d->bal_w);
    d->bal_w = NULL;
    d->bal_ld = NULL;
    dt_ctx *ctx = d->ctx;
    if (d->last_ticket)   /* no copy may still read or write the sets */
        d->be_iface->copy_wait(d->be, d->last_ticket);
    for (int s = 0; s < 2; s++) {
        if (d->dset[s])
            d->be_iface->free(d->be, d->dset[s]);
        d->dset[s] = NULL;
        if (!d->set[s] || d->shared.base)
            continue;
        if (!d->staged)
            d->be_iface->free(d->be, d->set[s]);
        else if (d->pinned)
            d->be_iface->host_free(d->be, d->set[s]);
        else
            host_free(ctx, d->set[s]);
    }
    shared_region_free(&d->shared);
    host_free(ctx, d->order);
    host_free(ctx, d->offset);
    host_free(ctx, d->uses);
    host_free(ctx, d->done);
    host_free(ctx, d->own_grad);
    for (int b = 0; d->buckets && b < d->nbuckets; b++) {
        host_free(ctx, d->buckets[b].payload);
        host_free(ctx, d->buckets[b].gathered);
        host_free(ctx, d->buckets[b].residual);
        host_free(ctx, d->buckets[b].pieces);
        host_free(ctx, d->buckets[b].velocity);
    }
    host_free(ctx, d->scratch);
    host_free(ctx, d->picked);
    d->scratch = NULL;
    d->picked = NULL;
    host_free(ctx, d->buckets);
    host_free(ctx, d->params);
    d->params = NULL;
    d->set[0] = d->set[1] = NULL;
    d->order = NULL;
    d->offset = NULL;
    d->uses = NULL;
    d->done = NULL;
    d->own_grad = NULL;
    d->buckets = NULL;
}

dt_ddp *dt_ddp_new(dt_ctx *ctx, dt_comm *c, dt_optim *opt, const dt_ddp_config *cfg)
{
    if (!ctx_ok(ctx))
        return NULL;
    if (!c) {
        set_error(ctx, DT_EINVAL, "ddp_new: communicator is NULL");
        return NULL;
    }
    if (ctx->ddp) {
        set_error(ctx, DT_ESTATE, "ddp_new: this context already has a DDP; free it first");
        return NULL;
    }
    if (c->ctx != ctx) {
        set_error(ctx, DT_EINVAL, "ddp_new: the communicator belongs to another context");
        return NULL;
    }
    if (!ctx->be_iface->host_visible && !be_stages(ctx->be_iface)) {
        set_error(ctx, DT_ENOTSUP, "ddp_new: the %s backend's memory is not host memory and it "
                  "has no asynchronous copies to stage gradients through", ctx->be_iface->name);
        return NULL;
    }
    if (opt && opt->ctx != ctx) {
        set_error(ctx, DT_EINVAL, "ddp_new: the optimizer belongs to another context");
        return NULL;
    }
    dt_ddp_config conf;
    dt_ddp_config_init(&conf);
    if (cfg)
        conf = *cfg;
    /* A bad setting on one rank still joins the model check, as a
     * difference, so no rank is left waiting in a collective. */
    dt_status local = ddp_compress_from_env(ctx, &conf);
    if (local == DT_OK && (conf.compress < DT_COMPRESS_NONE || conf.compress > DT_COMPRESS_INT8 ||
                           conf.topk_ratio < 0 || conf.topk_ratio > 1))
        local = set_error(ctx, DT_EINVAL, "ddp_new: compress %d, topk_ratio %g: need a dt_compress "
                          "value and 0 <= topk_ratio <= 1", (int)conf.compress,
                          (double)conf.topk_ratio);
    const char *wu = getenv("DTRAIN_TOPK_WARMUP");
    if (conf.topk_warmup_steps <= 0 && wu && *wu)
        conf.topk_warmup_steps = atoi(wu);
    cfg = &conf;
    char settings[DT_MAX_ERROR + 64], local_msg[DT_MAX_ERROR];
    snprintf(local_msg, sizeof local_msg, "%s", ctx->err);
    if (local != DT_OK)
        snprintf(settings, sizeof settings, "invalid: %.200s", local_msg);
    else
        snprintf(settings, sizeof settings, "bucket_bytes %zu, overlap %d, compress %d, topk_ratio "
                 "%g, warmup %d, error_feedback %d, device memory %d, profiler checks every %d",
                 ddp_bucket_cap(cfg, ctx),
                 cfg->overlap < 0 ? -1 : cfg->overlap != 0, (int)cfg->compress,
                 (double)cfg->topk_ratio, cfg->topk_warmup_steps, cfg->error_feedback != 0,
                 !ctx->be_iface->host_visible, prof_recording(ctx) ? ctx->prof.cfg.check_every : 0);
    if (conf.ps) {   /* dt_ps_new checked the workers' models; servers are not here */
        if (ddp_ps_check(ctx, c, &conf, opt) != DT_OK)
            return NULL;
    } else if (ddp_check_models(ctx, c, settings) != DT_OK) {
        return NULL;
    }
    if (local != DT_OK) {   /* every rank has the same bad setting */
        set_error(ctx, local, "%s", local_msg);
        return NULL;
    }
    dt_ddp *d = host_calloc(ctx, sizeof *d);
    if (!d) {
        set_error(ctx, DT_ENOMEM, "ddp_new: out of memory");
        return NULL;
    }
    *d = (dt_ddp){.ctx = ctx, .comm = c, .opt = opt, .cfg = *cfg, .al = ctx->al,
                  .be_iface = ctx->be_iface, .be = ctx->be, .nparams = ctx->n_params,
                  .sync = 1, .staged = !ctx->be_iface->host_visible};
    size_t np = (size_t)(d->nparams ? d->nparams : 1);
    d->params = host_calloc(ctx, np * sizeof *d->params);
    if (d->params)
        memcpy(d->params, ctx->params, (size_t)d->nparams * sizeof *d->params);
    d->order = host_calloc(ctx, np * sizeof *d->order);
    d->offset = host_calloc(ctx, np * sizeof *d->offset);
    d->uses = host_calloc(ctx, np * sizeof *d->uses);
    d->done = host_calloc(ctx, np * sizeof *d->done);
    d->own_grad = host_calloc(ctx, np * sizeof *d->own_grad);
    size_t cap = ddp_bucket_cap(cfg, ctx);
    dt_status s = DT_ENOMEM;
    if (d->params && d->order && d->offset && d->uses && d->done && d->own_grad)
        s = ddp_plan(d, cap);
    if (s == DT_OK)
        s = ddp_alloc_sets(d);
    if (s == DT_OK)
        s = ddp_alloc_private_sets(d);
    if (s == DT_OK && d->cfg.ps && d->cfg.compress != DT_COMPRESS_NONE)
        s = ddp_alloc_ps_code(d);
    else if (s == DT_OK &&
             (d->cfg.compress == DT_COMPRESS_TOPK || d->cfg.compress == DT_COMPRESS_INT8))
        s = ddp_alloc_compression(d);
    if (s == DT_ENOMEM) {
        set_error(ctx, DT_ENOMEM, "ddp_new: out of memory for %lld gradient floats",
                  (long long)d->set_floats);
    } else if (s == DT_OK && cfg->broadcast_params && !cfg->ps) {
        s = ddp_broadcast_params(d);
    }
    if (s != DT_OK) {
        ddp_release(d);
        host_free(ctx, d);
        return NULL;
    }
    /* Gradients move into set 0 (what they hold so far comes along). */
    for (int i = 0; i < d->nparams; i++) {
        dt_tensor *g = d->params[i]->grad;
        d->own_grad[i] = g->data;
        if (!(g->flags & T_ZERO))
            d->be_iface->copy(d->be, ddp_grads(d, 0) + d->offset[i], g->data, tensor_bytes(g));
    }
    ddp_point_grads(d, 0);
    if (d->momentum > 0)
        d->opt->momentum_by_ddp = 1;
    d->overlap = cfg->overlap >= 0 ? cfg->overlap != 0 : ddp_auto_overlap(d);
    d->check_every = prof_recording(ctx) ? ctx->prof.cfg.check_every : 0;
    d->st.overlap = d->overlap;
    d->st.buckets = d->nbuckets;
    d->st.bucket_bytes = cap;
    ctx->ddp = d;
    return d;
}

static void ddp_forget_optim(dt_ddp *d, const dt_optim *opt)
{
    if (d->opt == opt)
        d->opt = NULL;   /* freed first: dt_ddp_step now refuses instead */
}

/* Give the gradients their own buffers back (current values copied) and
 * drop the bucket memory; the struct stays for dt_ddp_free. */
static void ddp_detach(dt_ddp *d)
{
    if (!d->ctx)
        return;
    if (d->pending_sync)
        ddp_finish_run(d);   /* no rank check: the others may be gone */
    for (int i = 0; i < d->nparams; i++) {
        dt_tensor *g = d->params[i]->grad;
        if (!(g->flags & T_ZERO))
            d->be_iface->copy(d->be, d->own_grad[i], g->data, tensor_bytes(g));
        g->data = d->own_grad[i];
    }
    if (d->momentum > 0 && d->opt)
        d->opt->momentum_by_ddp = 0;
    d->ctx->ddp = NULL;
    ddp_release(d);
    d->ctx = NULL;
}

void dt_ddp_free(dt_ddp *d)
{
    if (!d)
        return;
    ddp_detach(d);
    d->al.free_fn(d, d->al.user);
}

/* --- 16.5 distributed evaluation and inference --------------------------- */

void dt_eval_config_init(dt_eval_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->batch = 1000;
    cfg->std = 1.0f;
}

/* The part of ds this rank evaluates: samples rank, rank + P, ..., each
 * sample on exactly one rank; in order, never shuffled. */
static dt_loader *eval_loader(dt_ctx *ctx, dt_comm *c, const dt_dataset *ds,
                              const dt_eval_config *cfg)
{
    dt_loader_config lc;
    dt_loader_config_init(&lc);
    lc.batch = cfg->batch > 0 ? cfg->batch : 1000;
    lc.shuffle = 0;
    lc.mean = cfg->mean;
    lc.std = cfg->std;
    lc.shard_rank = c ? dt_comm_rank(c) : 0;
    lc.shard_count = c ? dt_comm_size(c) : 1;
    lc.shard_no_pad = 1;
    return dt_loader_new(ctx, ds, &lc);
}

/* Run forward over this rank's part; per batch, visit(logits, labels,
 * first local index).  Grad and training are off meanwhile. */
typedef dt_status (*eval_visit)(dt_ctx *ctx, dt_tensor *logits, dt_tensor *y, int64_t first,
                                void *acc);

static dt_status eval_run(dt_ctx *ctx, dt_comm *c, const dt_dataset *ds, const dt_eval_config *cfg,
                          dt_forward_fn forward, void *user, eval_visit visit, void *acc)
{
    dt_eval_config defaults;
    dt_eval_config_init(&defaults);
    if (!cfg)
        cfg = &defaults;
    if (!ds || !forward)
        return set_error(ctx, DT_EINVAL, "evaluate: dataset and forward function are required");
    if (!(cfg->std > 0))
        return set_error(ctx, DT_EINVAL, "evaluate: std must be > 0, got %g", (double)cfg->std);
    dt_loader *ld = eval_loader(ctx, c, ds, cfg);
    if (!ld)
        return ctx->last_status;
    int grad = ctx->grad_enabled, training = ctx->training;
    ctx->grad_enabled = ctx->training = 0;
    dt_status s;
    int64_t first = 0;
    dt_tensor *x, *y;
    while ((s = dt_loader_next(ld, &x, &y)) == DT_OK) {
        dt_tensor *logits = forward(ctx, x, user);
        char sb[96];
        if (!logits)
            s = ctx->last_status != DT_OK ? ctx->last_status
                                          : set_error(ctx, DT_EINVAL, "evaluate: forward returned NULL");
        else if (logits->ndim != 2 || logits->shape[0] != y->shape[0] || logits->dtype != DT_F32)
            s = set_error(ctx, DT_EINVAL, "evaluate: forward must return (%lld, classes) f32 "
                          "logits, got %s", (long long)y->shape[0], SHAPE(logits, sb));
        else if (!(logits = dt_contiguous(ctx, logits)))
            s = ctx->last_status;
        else
            s = visit(ctx, logits, y, first, acc);
        first += y->shape[0];
        dt_step_reset(ctx);
        if (s != DT_OK)
            break;
    }
    ctx->grad_enabled = grad;
    ctx->training = training;
    dt_loader_free(ld);
    return s == DT_EOF ? DT_OK : s;
}

typedef struct eval_sums {
    double samples, correct, loss;
} eval_sums;

static dt_status eval_metrics(dt_ctx *ctx, dt_tensor *logits, dt_tensor *y, int64_t first, void *acc)
{
    (void)first;
    eval_sums *e = acc;
    int64_t correct = 0;
    dt_tensor *loss = dt_cross_entropy(ctx, logits, y);
    if (!loss || dt_count_correct(ctx, logits, y, &correct) != DT_OK)
        return ctx->last_status;
    e->samples += (double)y->shape[0];
    e->correct += (double)correct;
    e->loss += (double)dt_tensor_item(loss) * (double)y->shape[0];
    return DT_OK;
}

/* Counts travel as two floats, n / 4096 and n % 4096, so their sums stay
 * exact far beyond float's 2^24. */
static int64_t count_join(const float *hl) { return (int64_t)hl[0] * 4096 + (int64_t)hl[1]; }

dt_status dt_evaluate(dt_ctx *ctx, dt_comm *c, const dt_dataset *ds, const dt_eval_config *cfg,
                      dt_forward_fn forward, void *user, dt_metrics *out)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (c && c->ctx != ctx)
        return set_error(ctx, DT_EINVAL, "evaluate: the communicator belongs to another context");
    eval_sums e = {0, 0, 0};
    dt_status s = out ? eval_run(ctx, c, ds, cfg, forward, user, eval_metrics, &e)
                      : set_error(ctx, DT_EINVAL, "evaluate: output is NULL");
    /* every rank joins the sum even after a local failure (the last float
     * counts failures), so a bad rank cannot leave the others waiting */
    int64_t n = (int64_t)e.samples, k = (int64_t)e.correct;
    float sums[6] = {(float)(n / 4096), (float)(n % 4096), (float)(k / 4096), (float)(k % 4096),
                     (float)e.loss, s == DT_OK ? 0.0f : 1.0f};
    if (c) {
        dt_status cs = dt_allreduce(c, sums, 6, DT_REDUCE_SUM);
        if (cs != DT_OK)
            return cs;
    }
    if (s != DT_OK)
        return s;
    if (sums[5] > 0)
        return set_error(ctx, DT_EPEER, "evaluate: %.0f other rank(s) failed to evaluate their "
                         "part", (double)sums[5]);
    out->samples = count_join(sums);
    out->correct = count_join(sums + 2);
    out->accuracy = out->samples > 0 ? (double)out->correct / (double)out->samples : 0;
    out->loss = out->samples > 0 ? (double)sums[4] / (double)out->samples : 0;
    return DT_OK;
}

typedef struct predict_acc {
    float *local;              /* this rank's predictions, in its sample order */
} predict_acc;

static dt_status eval_argmax(dt_ctx *ctx, dt_tensor *logits, dt_tensor *y, int64_t first, void *acc)
{
    predict_acc *p = acc;
    int64_t b = logits->shape[0], k = logits->shape[1];
    float *host = host_alloc(ctx, sizeof(float) * (size_t)(b * k));
    if (!host)
        return set_error(ctx, DT_ENOMEM, "predict: out of memory");
    (void)y;
    dt_status s = dt_tensor_get(logits, host, b * k);
    for (int64_t i = 0; s == DT_OK && i < b; i++) {
        int64_t best = 0;
        for (int64_t j = 1; j < k; j++)
            if (host[i * k + j] > host[i * k + best])
                best = j;
        p->local[first + i] = (float)best;
    }
    host_free(ctx, host);
    return s;
}

dt_status dt_predict(dt_ctx *ctx, dt_comm *c, const dt_dataset *ds, const dt_eval_config *cfg,
                     dt_forward_fn forward, void *user, int32_t *pred)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (c && c->ctx != ctx)
        return set_error(ctx, DT_EINVAL, "predict: the communicator belongs to another context");
    int P = c ? dt_comm_size(c) : 1, r = c ? dt_comm_rank(c) : 0;
    int64_t n = dt_dataset_size(ds), per = (n + P - 1) / P;
    /* per floats for each rank's predictions, then one for its status */
    float *mine = host_alloc(ctx, sizeof(float) * (size_t)(per + 1));
    float *all = host_alloc(ctx, sizeof(float) * (size_t)(per + 1) * (size_t)P);
    if (!mine || !all) {
        host_free(ctx, mine);
        host_free(ctx, all);
        return set_error(ctx, DT_ENOMEM, "predict: out of memory for %lld predictions", (long long)n);
    }
    for (int64_t i = 0; i <= per; i++)
        mine[i] = -1.0f;
    predict_acc acc = {mine};
    /* a missing output still joins the gather, so no rank waits */
    dt_status s = r == 0 && !pred ? set_error(ctx, DT_EINVAL, "predict: rank 0 needs an output array")
                                  : eval_run(ctx, c, ds, cfg, forward, user, eval_argmax, &acc);
    mine[per] = s == DT_OK ? 0.0f : 1.0f;
    dt_status cs = c ? dt_allgather(c, mine, per + 1, all) : DT_OK;
    if (!c)
        memcpy(all, mine, sizeof(float) * (size_t)(per + 1));
    int failed = 0;
    for (int q = 0; cs == DT_OK && q < P; q++)
        failed += all[(size_t)q * (size_t)(per + 1) + (size_t)per] > 0;
    if (cs == DT_OK && s == DT_OK && failed == 0 && r == 0)
        for (int64_t i = 0; i < n; i++)   /* sample i was rank i % P's (i / P)-th */
            pred[i] = (int32_t)all[(size_t)(i % P) * (size_t)(per + 1) + (size_t)(i / P)];
    host_free(ctx, mine);
    host_free(ctx, all);
    if (cs != DT_OK || s != DT_OK)
        return cs != DT_OK ? cs : s;
    if (failed)
        return set_error(ctx, DT_EPEER, "predict: %d other rank(s) failed to predict their part",
                         failed);
    return DT_OK;
}

/* ===========================================================================
 * 17. In-process data parallelism (replicas on threads)
 *
 * K replica contexts, each driven by its own thread (the caller drives
 * replica 0).  A step runs in three phases separated by barriers, so no
 * thread ever touches another replica's context while that one computes:
 *   1. each replica: zero its gradients, forward and backward on its rows;
 *   2. each replica: average slice k of the (flat) gradients straight from
 *      every replica's memory, in replica order; replica 0 also notes which
 *      parameters any replica used;
 *   3. each replica: copy the average into its gradients, optimizer step.
 * A replica that fails in phase 1 is seen by all after the barrier, and all
 * skip phases 2 and 3 together.
 * ======================================================================== */

struct dt_dp {
    dt_ctx *ctx;               /* the caller's: errors */
    int K;
    dt_ctx **rc;               /* replica contexts */
    void **model;
    dt_optim **opt;
    dt_dp_loss_fn loss;
    dt_dp_free_fn free_model;
    void *user;
    pthread_t *thread;
    struct dp_arg { struct dt_dp *dp; int k; } *args;   /* each worker's */
    int threads_started, stop;
    pthread_barrier_t bar;
    int has_bar;
    pthread_mutex_t mu;        /* start-up: workers wait for go (1) or abort (-1) */
    pthread_cond_t cv;
    int go, has_mu;
    /* the step's inputs, staged on the host */
    float *xh;
    int32_t *yh;
    size_t x_cap;
    int64_t B, feat, xshape[DT_MAX_DIMS];
    int xndim;
    /* the flat gradient: parameter p at poff[p], G floats in all */
    int np;
    int64_t *poff, G;
    float *avg;
    unsigned char *used;
    float *losses;
    dt_status *status;
    char (*msg)[DT_MAX_ERROR];
};

void dt_dp_config_init(dt_dp_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->replicas = 2;
    dt_config_init(&cfg->replica);
    dt_optim_config_init(&cfg->optim, DT_SGD);
}

static int64_t dp_row(const dt_dp *dp, int k) { return dp->B * k / dp->K; }

/* Phase 1 on replica k: its rows, forward and backward. */
static dt_status dp_compute(dt_dp *dp, int k)
{
    dt_ctx *c = dp->rc[k];
    dt_zero_grad(c);
    dp->losses[k] = 0;
    int64_t r0 = dp_row(dp, k), n = dp_row(dp, k + 1) - r0;
    if (n == 0)
        return DT_OK;   /* more replicas than rows: this one sits the step out */
    int64_t shape[DT_MAX_DIMS];
    memcpy(shape, dp->xshape, sizeof shape);
    shape[0] = n;
    dt_tensor *x = dt_tensor_temp(c, DT_F32, dp->xndim, shape);
    dt_tensor *y = dt_tensor_temp(c, DT_I32, 1, &n);
    if (!x || !y || dt_tensor_set(x, dp->xh + r0 * dp->feat, n * dp->feat) != DT_OK ||
        dt_tensor_set(y, dp->yh + r0, n) != DT_OK)
        return c->last_status;
    dt_tensor *loss = dp->loss(c, dp->model[k], x, y, dp->user);
    if (!loss)
        return c->last_status != DT_OK ? c->last_status
                                       : set_error(c, DT_EINVAL, "dp_step: the loss function "
                                                   "returned NULL on replica %d", k);
    dt_status s = dt_backward(c, loss);
    if (s == DT_OK)
        dp->losses[k] = dt_tensor_item(loss) * (float)n / (float)dp->B;
    return s;
}

/* Phase 2 on replica k: slice k of the averaged gradients. */
static void dp_reduce(dt_dp *dp, int k)
{
    int64_t lo = dp->G * k / dp->K, hi = dp->G * (k + 1) / dp->K;
    for (int p = 0; p < dp->np; p++) {
        int64_t a = dp->poff[p], e = dp->poff[p + 1];
        a = a > lo ? a : lo;
        e = e < hi ? e : hi;
        if (e <= a)
            continue;
        float *out = dp->avg + a;
        memset(out, 0, (size_t)(e - a) * sizeof(float));
        for (int r = 0; r < dp->K; r++) {
            const dt_tensor *g = dp->rc[r]->params[p]->grad;
            int64_t rows = dp_row(dp, r + 1) - dp_row(dp, r);
            if ((g->flags & T_ZERO) || rows == 0)
                continue;
            float w = (float)rows / (float)dp->B;
            const float *src = (const float *)g->data + (a - dp->poff[p]);
            for (int64_t i = 0; i < e - a; i++)
                out[i] += w * src[i];
        }
    }
    if (k == 0)
        for (int p = 0; p < dp->np; p++) {
            dp->used[p] = 0;
            for (int r = 0; r < dp->K; r++)
                dp->used[p] |= !(dp->rc[r]->params[p]->grad->flags & T_ZERO);
        }
}

/* Phase 3 on replica k: take the average, step. */
static dt_status dp_apply(dt_dp *dp, int k)
{
    dt_ctx *c = dp->rc[k];
    for (int p = 0; p < dp->np; p++) {
        dt_tensor *g = c->params[p]->grad;
        if (!dp->used[p]) {
            g->flags |= T_ZERO;
            continue;
        }
        c->be_iface->copy(c->be, g->data, dp->avg + dp->poff[p],
                          (size_t)(dp->poff[p + 1] - dp->poff[p]) * sizeof(float));
        g->flags &= ~(unsigned)T_ZERO;
    }
    dt_status s = dt_optim_step(dp->opt[k]);
    dt_step_reset(c);
    return s;
}

/* Replica k's whole step; every replica passes the same barriers. */
static void dp_replica_step(dt_dp *dp, int k)
{
    dt_status s = dp_compute(dp, k);
    dp->status[k] = s;
    if (s != DT_OK)
        snprintf(dp->msg[k], DT_MAX_ERROR, "%s", dp->rc[k]->err);
    if (dp->K > 1)
        pthread_barrier_wait(&dp->bar);
    int failed = 0;
    for (int r = 0; r < dp->K; r++)
        failed |= dp->status[r] != DT_OK;
    if (!failed)
        dp_reduce(dp, k);
    if (dp->K > 1)
        pthread_barrier_wait(&dp->bar);
    if (failed) {
        dt_step_reset(dp->rc[k]);
        return;
    }
    s = dp_apply(dp, k);
    if (s != DT_OK) {
        dp->status[k] = s;
        snprintf(dp->msg[k], DT_MAX_ERROR, "%s", dp->rc[k]->err);
    }
}

static void *dp_worker(void *arg)
{
    dt_dp *dp = ((struct dp_arg *)arg)->dp;
    int k = ((struct dp_arg *)arg)->k;
    pthread_mutex_lock(&dp->mu);
    while (dp->go == 0)
        pthread_cond_wait(&dp->cv, &dp->mu);
    int go = dp->go;
    pthread_mutex_unlock(&dp->mu);
    if (go < 0)
        return NULL;   /* start-up failed */
    for (;;) {
        pthread_barrier_wait(&dp->bar);   /* a step (or stop) was posted */
        if (dp->stop)
            return NULL;
        dp_replica_step(dp, k);
        pthread_barrier_wait(&dp->bar);   /* the step is over */
    }
}

dt_status dt_dp_step(dt_dp *dp, const dt_tensor *x, const dt_tensor *y, float *loss_out)
{
    if (!dp)
        return DT_EINVAL;
    dt_ctx *ctx = dp->ctx;
    char s1[96], s2[96];
    if (!x || !y || x->dtype != DT_F32 || y->dtype != DT_I32 || x->ndim < 1 || y->ndim != 1 ||
        x->shape[0] != y->shape[0] || x->shape[0] < 1)
        return set_error(ctx, DT_EINVAL, "dp_step: need x (B, ...) f32 and y (B) i32 with B >= 1, "
                         "got %s and %s", x ? SHAPE(x, s1) : "NULL", y ? SHAPE(y, s2) : "NULL");
    int64_t B = x->shape[0], feat = shape_numel(x->ndim, x->shape) / B;
    size_t need = (size_t)(B * feat) * sizeof(float) + (size_t)B * sizeof(int32_t);
    if (need > dp->x_cap) {
        float *nx = ctx->al.realloc_fn(dp->xh, need, ctx->al.user);
        if (!nx)
            return set_error(ctx, DT_ENOMEM, "dp_step: out of memory for the batch");
        dp->xh = nx;
        dp->x_cap = need;
    }
    dp->yh = (int32_t *)(dp->xh + B * feat);
    dt_status s = dt_tensor_get(x, dp->xh, B * feat);
    if (s == DT_OK)
        s = dt_tensor_get(y, dp->yh, B);
    if (s != DT_OK)
        return s;
    dp->B = B;
    dp->feat = feat;
    dp->xndim = x->ndim;
    memcpy(dp->xshape, x->shape, sizeof dp->xshape);
    if (dp->K > 1)
        pthread_barrier_wait(&dp->bar);   /* start the workers */
    dp_replica_step(dp, 0);
    if (dp->K > 1)
        pthread_barrier_wait(&dp->bar);   /* wait for them */
    float loss = 0;
    for (int k = 0; k < dp->K; k++) {
        if (dp->status[k] != DT_OK)
            return set_error(ctx, dp->status[k], "dp_step: replica %d: %s", k, dp->msg[k]);
        loss += dp->losses[k];
    }
    if (loss_out)
        *loss_out = loss;
    return DT_OK;
}

int dt_dp_replicas(const dt_dp *dp) { return dp ? dp->K : 0; }
dt_ctx *dt_dp_replica(const dt_dp *dp, int k) { return dp && k >= 0 && k < dp->K ? dp->rc[k] : NULL; }
void *dt_dp_model(const dt_dp *dp, int k) { return dp && k >= 0 && k < dp->K ? dp->model[k] : NULL; }

void dt_dp_free(dt_dp *dp)
{
    if (!dp)
        return;
    dt_ctx *ctx = dp->ctx;
    if (dp->go > 0) {   /* running: release the workers from their barrier */
        dp->stop = 1;
        pthread_barrier_wait(&dp->bar);
    } else if (dp->has_mu) {   /* never started: tell the ones waiting to go */
        pthread_mutex_lock(&dp->mu);
        dp->go = -1;
        pthread_cond_broadcast(&dp->cv);
        pthread_mutex_unlock(&dp->mu);
    }
    for (int k = 1; k <= dp->threads_started; k++)
        pthread_join(dp->thread[k], NULL);
    if (dp->has_bar)
        pthread_barrier_destroy(&dp->bar);
    if (dp->has_mu) {
        pthread_mutex_destroy(&dp->mu);
        pthread_cond_destroy(&dp->cv);
    }
    for (int k = 0; dp->rc && k < dp->K; k++) {
        if (dp->opt)
            dt_optim_free(dp->opt[k]);
        if (dp->model && dp->model[k] && dp->free_model)
            dp->free_model(dp->model[k], dp->user);
        dt_ctx_free(dp->rc[k]);
    }
    host_free(ctx, dp->rc);
    host_free(ctx, dp->model);
    host_free(ctx, dp->opt);
    host_free(ctx, dp->thread);
    host_free(ctx, dp->args);
    host_free(ctx, dp->xh);
    host_free(ctx, dp->poff);
    host_free(ctx, dp->avg);
    host_free(ctx, dp->used);
    host_free(ctx, dp->losses);
    host_free(ctx, dp->status);
    host_free(ctx, dp->msg);
    host_free(ctx, dp);
}

/* The replicas' models must match replica 0's; then they take its weights. */
static dt_status dp_align(dt_dp *dp)
{
    dt_ctx *c0 = dp->rc[0];
    dp->np = c0->n_params;
    for (int k = 1; k < dp->K; k++) {
        dt_ctx *c = dp->rc[k];
        if (c->n_params != dp->np)
            return set_error(dp->ctx, DT_EMISMATCH, "dp_new: replica %d built %d parameters, "
                             "replica 0 built %d", k, c->n_params, dp->np);
        for (int p = 0; p < dp->np; p++) {
            dt_tensor *a = c0->params[p], *b = c->params[p];
            char s1[96], s2[96];
            int same = a->ndim == b->ndim;
            for (int i = 0; same && i < a->ndim; i++)
                same = a->shape[i] == b->shape[i];
            if (strcmp(a->name, b->name) || !same)
                return set_error(dp->ctx, DT_EMISMATCH, "dp_new: parameter %d is '%s' %s on "
                                 "replica 0 but '%s' %s on replica %d", p, a->name, SHAPE(a, s1),
                                 b->name, SHAPE(b, s2), k);
            c->be_iface->copy(c->be, b->data, a->data, tensor_bytes(a));
        }
    }
    dp->poff = host_calloc(dp->ctx, sizeof(int64_t) * (size_t)(dp->np + 1));
    if (!dp->poff)
        return DT_ENOMEM;
    for (int p = 0; p < dp->np; p++)
        dp->poff[p + 1] = dp->poff[p] + dt_tensor_numel(c0->params[p]);
    dp->G = dp->poff[dp->np];
    dp->avg = host_calloc(dp->ctx, sizeof(float) * (size_t)(dp->G ? dp->G : 1));
    dp->used = host_calloc(dp->ctx, (size_t)(dp->np ? dp->np : 1));
    return dp->avg && dp->used ? DT_OK : DT_ENOMEM;
}

/* Workers wait for go; only when all started is the barrier made and go
 * set, so a failed start never leaves a thread in a barrier that cannot fill. */
static dt_status dp_start_threads(dt_dp *dp)
{
    if (pthread_mutex_init(&dp->mu, NULL) != 0)
        return set_error(dp->ctx, DT_ENOMEM, "dp_new: cannot make a mutex");
    if (pthread_cond_init(&dp->cv, NULL) != 0) {
        pthread_mutex_destroy(&dp->mu);
        return set_error(dp->ctx, DT_ENOMEM, "dp_new: cannot make a condition variable");
    }
    dp->has_mu = 1;
    for (int k = 1; k < dp->K; k++) {
        dp->args[k] = (struct dp_arg){dp, k};
        if (pthread_create(&dp->thread[k], NULL, dp_worker, &dp->args[k]) != 0)
            return set_error(dp->ctx, DT_ENOMEM, "dp_new: cannot start replica thread %d", k);
        dp->threads_started = k;
    }
    if (pthread_barrier_init(&dp->bar, NULL, (unsigned)dp->K) != 0)
        return set_error(dp->ctx, DT_ENOMEM, "dp_new: cannot make a barrier");
    dp->has_bar = 1;
    pthread_mutex_lock(&dp->mu);
    dp->go = 1;
    pthread_cond_broadcast(&dp->cv);
    pthread_mutex_unlock(&dp->mu);
    return DT_OK;
}

dt_dp *dt_dp_new(dt_ctx *ctx, const dt_dp_config *cfg, dt_dp_build_fn build, dt_dp_loss_fn loss,
                 dt_dp_free_fn free_model, void *user)
{
    if (!ctx_ok(ctx))
        return NULL;
    if (!cfg || !build || !loss || cfg->replicas < 1 || cfg->replicas > 1024) {
        set_error(ctx, DT_EINVAL, "dp_new: need a config with 1..1024 replicas, a build and a loss "
                  "function");
        return NULL;
    }
    dt_dp *dp = host_calloc(ctx, sizeof *dp);
    if (!dp) {
        set_error(ctx, DT_ENOMEM, "dp_new: out of memory");
        return NULL;
    }
    int K = cfg->replicas;
    *dp = (dt_dp){.ctx = ctx, .K = K, .loss = loss, .free_model = free_model, .user = user};
    dp->rc = host_calloc(ctx, sizeof *dp->rc * (size_t)K);
    dp->model = host_calloc(ctx, sizeof *dp->model * (size_t)K);
    dp->opt = host_calloc(ctx, sizeof *dp->opt * (size_t)K);
    dp->thread = host_calloc(ctx, sizeof *dp->thread * (size_t)K);
    dp->args = host_calloc(ctx, sizeof *dp->args * (size_t)K);
    dp->losses = host_calloc(ctx, sizeof *dp->losses * (size_t)K);
    dp->status = host_calloc(ctx, sizeof *dp->status * (size_t)K);
    dp->msg = host_calloc(ctx, sizeof *dp->msg * (size_t)K);
    dt_status s = dp->rc && dp->model && dp->opt && dp->thread && dp->args && dp->losses &&
                          dp->status && dp->msg
                      ? DT_OK : set_error(ctx, DT_ENOMEM, "dp_new: out of memory");
    for (int k = 0; s == DT_OK && k < K; k++) {
        dt_config rcfg = cfg->replica;
        rcfg.seed += (uint64_t)k;
        rcfg.device += k;
        dp->rc[k] = dt_ctx_new(&rcfg);
        if (!dp->rc[k] || dt_ctx_status(dp->rc[k]) != DT_OK) {
            s = set_error(ctx, dp->rc[k] ? dt_ctx_status(dp->rc[k]) : DT_ENOMEM,
                          "dp_new: replica %d's context: %s", k,
                          dp->rc[k] ? dp->rc[k]->err : "out of memory");
            break;
        }
        if (!dp->rc[k]->be_iface->host_visible) {
            s = set_error(ctx, DT_ENOTSUP, "dp_new: the %s backend's memory is not host memory; "
                          "in-process data parallelism needs host-visible gradients in this build",
                          dp->rc[k]->be_iface->name);
            break;
        }
        dp->model[k] = build(dp->rc[k], k, user);
        if (!dp->model[k]) {
            s = set_error(ctx, dt_last_status(dp->rc[k]) != DT_OK ? dt_last_status(dp->rc[k]) : DT_EINVAL,
                          "dp_new: building replica %d failed: %s", k, dp->rc[k]->err);
            break;
        }
        dp->opt[k] = dt_optim_new(dp->rc[k], &cfg->optim, NULL, 0);
        if (!dp->opt[k])
            s = set_error(ctx, dt_last_status(dp->rc[k]), "dp_new: replica %d's optimizer: %s", k,
                          dp->rc[k]->err);
    }
    if (s == DT_OK)
        s = dp_align(dp);
    if (s == DT_OK && K > 1)
        s = dp_start_threads(dp);
    if (s != DT_OK) {
        dt_dp_free(dp);
        return NULL;
    }
    return dp;
}

/* ===========================================================================
 * 18. Parameter server
 *
 * Workers are ranks 0..W-1, servers the last S ranks.  The key space is
 * DDP's flat layout: every parameter's floats in reverse registration
 * order (G floats), then one "used" flag per parameter (P floats).  Server
 * s owns the gradient keys [range[s], range[s+1]) (contiguous, balanced by
 * bytes) and receives every flag.  A server keeps its keys as pieces (a
 * parameter cut to its range), each a parameter of the server's own
 * context, so the same dt_optim that steps a model steps the shard: as in
 * one process, a parameter no worker used is skipped.
 *
 * Messages go over the communicator's transport, each request a ps_msg
 * header (tag PS_TAG_REQ) and, for pushes, the floats (PS_TAG_DATA); a pull
 * is answered with a header (PS_TAG_RESP) and the floats (PS_TAG_RDATA).
 * Data travels in pieces of at most the header's `chunk` bytes, a few in
 * flight at a time, so no message exceeds the transport's limit and, on
 * shm, none needs the receiver's answer to complete (18.2).  Tags carry a
 * per (worker, server) sequence number and the piece's index, so every
 * message is matched exactly; their top 12 bits are all ones, which no
 * collective's tag has (14.1).  A worker's requests run on its comm thread as work of
 * kind COLL_PS, like a bucket's allreduce; a server runs dt_ps_serve on
 * its own thread, owning the transport meanwhile (as run_inline does).
 *
 * A worker's step on a server completes when all of its G_s gradient
 * floats and the P flags have arrived (whatever the buckets were).  BSP:
 * when every live worker has completed step t, the server sums their
 * gradients in worker order, averages, and steps (bit-identical to DDP's
 * allreduce and step).  ASP/SSP: each worker's completed step is applied
 * on its own, scaled by 1/W.  A pull from a worker that has completed c
 * steps is answered once the slowest live worker has completed c - s
 * (BSP: s = 0; ASP: always).
 * ======================================================================== */

#define PS_MAGIC 0x44545053u
enum { PS_TAG_REQ = 1, PS_TAG_DATA, PS_TAG_RESP, PS_TAG_RDATA };
static const char *const ps_op_names[] = {"?", "init", "push", "pull", "finish", "sparse push",
                                          "sparse pull", "hello", "compressed push"};

/* Bits 52-63 all ones, 48-51 the type, 24-47 the piece, 0-23 the request's
 * number (it wraps; a pair never has 2^24 requests in flight). */
static uint64_t ps_tag(int type, uint32_t seq, uint32_t piece)
{
    return (uint64_t)0xFFF << 52 | (uint64_t)type << 48 | (uint64_t)(piece & 0xFFFFFF) << 24 |
           (seq & 0xFFFFFF);
}

/* Pieces.  A message of `bytes` is ceil(bytes / chunk) messages.  With
 * libfabric's shm provider a send of more than its inject size (4 KiB)
 * completes only when the receiver answers, and the sender handles those
 * answers in order, so one such send to a process that died holds back
 * every later one, to anyone: where a death must not stop the job
 * (replicated or checkpointing servers) pieces on shm are PS_SHM_CHUNK. */
#define PS_SHM_CHUNK ((size_t)4096)
#define PS_MIN_CHUNK ((size_t)64)
#define PS_MAX_PIECES ((uint32_t)1 << 24)
#define PS_WINDOW 16              /* a server's pieces in flight per message */

static uint64_t ps_pieces(size_t bytes, size_t chunk)
{
    return ((uint64_t)bytes + chunk - 1) / chunk;
}

static size_t ps_piece_len(size_t bytes, size_t chunk, uint32_t i)
{
    size_t off = (size_t)i * chunk;
    return bytes - off < chunk ? bytes - off : chunk;
}

/* A server's view of one worker. */
typedef struct ps_peer {
    uint32_t seq;              /* its next request */
    int state;                 /* 0 live, 1 finished, 2 dropped (died) */
    int64_t clock;             /* steps completed here (-1: a rejoined server awaits its hello) */
    int64_t base;              /* rejoined server: its steps when it said hello */
    int64_t got;               /* floats of its current step received */
    float *push;               /* its current step: G_s gradients then P flags */
    ps_msg hdr;                /* the request being received */
    dt_xfer hdr_x;
    int64_t data_lo, data_n;   /* its data is being received, in pieces: */
    char *data_buf;
    size_t data_bytes;         /* what they must bring in all */
    uint32_t data_pieces, data_next, data_got;   /* pieces: all, posted, arrived */
    dt_xfer data_x[PS_WINDOW];
    uint32_t data_piece[PS_WINDOW];   /* the piece each receive was posted for */
    unsigned char data_busy[PS_WINDOW];
    int op;
    void *sdata;               /* a sparse request's ids (and rows) being received */
    int parked;                /* BSP: its step is in but not applied; its next request
                                  is not read until it is (a worker runs at most one step
                                  ahead of the slowest, its push buffer holds one step) */
    struct ps_sparse_msg *held; /* BSP: its sparse pushes not yet applied, oldest first */
} ps_peer;

/* A sparse push kept until its step is applied (BSP). */
typedef struct ps_sparse_msg {
    int table;
    int64_t k, clock;
    void *data;                /* k local row numbers (int64), then k * dim floats */
    struct ps_sparse_msg *next;
} ps_sparse_msg;

/* A sparse table.  On a server: its rows r = i * S + server, i < count. */
typedef struct ps_tab {
    char *name;
    int64_t rows, dim;
    float scale;
    uint64_t seed;
    int64_t count;
    dt_tensor *w, *state[2];   /* count x dim each; state: the optimizer's, as its kind has */
    int64_t steps;             /* updates applied (Adam's bias correction) */
    dt_tensor *steps_t;        /* steps in a checkpoint: two floats, steps >> 24 and its low
                                  24 bits (each exact in a float) */
    float *acc;                /* count x dim: gradient rows being summed */
    int64_t *slot;             /* row -> its place in touched, or -1 */
    int64_t *touched, ntouched;
} ps_tab;

/* A response in flight (server side): its header, then its data in
 * pieces, PS_WINDOW at a time; freed when every send posted completed and
 * nothing is left to post. */
typedef struct ps_reply {
    ps_msg hdr;
    dt_xfer hdr_x;
    float *data;
    int worker;
    size_t bytes, chunk;       /* bytes 0 with pieces: an error's empty pieces */
    uint32_t pieces, posted, stopped;   /* stopped: no more pieces go out */
    dt_xfer data_x[PS_WINDOW];
    unsigned char busy[PS_WINDOW];
    struct ps_reply *next;
} ps_reply;

/* A pull waiting for the slow workers (server side). */
typedef struct ps_wait {
    int worker;
    ps_msg req;
    int64_t *ids;              /* a sparse pull's rows (owned) */
    struct ps_wait *next;
} ps_wait;

struct dt_ps {
    dt_ctx *ctx;
    dt_comm *comm;
    dt_ps_config cfg;
    int W, S, server;          /* server: this rank's server index, -1 on workers */
    int L, shard;              /* key shards (S, or S / 2 replicated); a server's shard */
    unsigned char *gone;       /* worker, per server: 1 dead and written off (its twin
                                  serves), 2 dead and awaited (18.6) */
    uint32_t *inc;             /* worker, per server: its process's incarnation */
    double *down_since;        /* worker, per server: when it was found dead */
    int64_t *sent, *sent_clock; /* worker, per server: floats of step sent_clock it has
                                  (18.6: a restarted server counts them as come) */
    int job;                   /* which PS job of the communicator (store keys) */
    int finished;              /* worker: dt_ps_finish done */
    int nparams;
    int64_t G, P;              /* gradient floats, flags */
    int64_t *numel, *offset;   /* parameter (registration index) -> size, flat offset */
    int64_t *range;            /* S + 1 gradient-key boundaries */
    char *layout;              /* a header line, "name numel\n" per parameter in
                                  registration order, then a line per table */
    int ntables;
    ps_tab *tabs;
    /* worker */
    size_t chunk;              /* our messages' pieces, and the answers' (18.2) */
    uint32_t *seq;             /* per server: our next request */
    int64_t clock;             /* steps pushed */
    float *stage;              /* G + P floats: packing pushes, receiving pulls */
    float *stage2;             /* prefetch: G floats the next step's parameters arrive in */
    dt_work *prefetch;         /* that pull, in flight */
    ps_call prefetch_call;
    /* server */
    dt_ctx *sctx;              /* owns the pieces and their optimizer */
    dt_optim *opt;
    int npieces;
    dt_tensor **piece;         /* in key order */
    int64_t *piece_lo;         /* flat offset of its first float */
    int *piece_param;          /* which parameter (registration index) */
    ps_peer *peers;            /* W */
    float *sum;                /* G_s gradient floats being applied */
    int64_t applied;           /* BSP: steps applied */
    int initialized;
    int64_t init_got;
    ps_reply *replies;
    ps_wait *waits;
    double stale_sum;
    int64_t stale_n;
    char *ckpt_path;           /* server: its checkpoint file, or NULL */
    int resumed;               /* server: started from it (worker 0's init is not used) */
    int syncing;               /* server, rejoined: not every live worker has said hello */
    dt_ps_stats st;
};

void dt_ps_config_init(dt_ps_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->mode = DT_PS_BSP;
    dt_optim_config_init(&cfg->optim, DT_SGD);
}

int dt_ps_is_server(const dt_ps *ps) { return ps && ps->server >= 0; }
int dt_ps_workers(const dt_ps *ps) { return ps ? ps->W : 0; }
int dt_ps_servers(const dt_ps *ps) { return ps ? ps->S : 0; }

dt_status dt_ps_stats_get(const dt_ps *ps, dt_ps_stats *out)
{
    if (!ps || !out)
        return DT_EINVAL;
    *out = ps->st;
    out->mean_staleness = ps->stale_n ? ps->stale_sum / (double)ps->stale_n : 0.0;
    return DT_OK;
}

/* --- 18.1 layout and sharding --------------------------------------------- */

/* The model as the servers see it: "dtrain-ps P T", every parameter's
 * "name numel" line in registration order, then every table's "rows dim
 * scale seed name" line (names last: they may hold spaces).  NULL: out of
 * memory, or a table is unusable (said in ctx). */
static char *ps_describe(dt_ctx *ctx, const dt_ps_config *cfg)
{
    if (cfg->ntables < 0 || (cfg->ntables > 0 && !cfg->tables)) {
        set_error(ctx, DT_EINVAL, "ps_new: %d tables at %p", cfg->ntables, (const void *)cfg->tables);
        return NULL;
    }
    size_t cap = 64;
    for (int i = 0; i < ctx->n_params; i++)
        cap += strlen(ctx->params[i]->name) + 24;
    for (int t = 0; t < cfg->ntables; t++) {
        const dt_ps_table *tb = &cfg->tables[t];
        static const char *const reserved[] = {".sum", ".exp_avg", ".exp_avg_sq", ".momentum_buffer",
                                               ".steps"};
        size_t nl = tb->name ? strlen(tb->name) : 0;
        int clash = 0;   /* a name ending like an optimizer state's would collide in checkpoints */
        for (int r = 0; r < 5; r++)
            clash |= nl >= strlen(reserved[r]) && !strcmp(tb->name + nl - strlen(reserved[r]), reserved[r]);
        int bad = !tb->name || !*tb->name || nl > DT_MAX_NAME - 32 || clash || strchr(tb->name, '\n') || tb->rows < 1 ||
                  tb->dim < 1 || tb->rows > INT64_MAX / 8 / tb->dim || !(tb->init_scale >= 0) ||
                  isinf(tb->init_scale);
        for (int u = 0; !bad && u < t; u++)
            bad = !strcmp(cfg->tables[u].name, tb->name);
        if (bad) {
            set_error(ctx, DT_EINVAL, "ps_new: table %d ('%.60s', %lld x %lld, scale %g): need a "
                      "unique name of at most %d characters, without newlines or an optimizer "
                      "state's suffix, rows and dim >= 1, a finite scale >= 0", t,
                      tb->name ? tb->name : "(null)", (long long)tb->rows, (long long)tb->dim,
                      (double)tb->init_scale, DT_MAX_NAME - 32);
            return NULL;
        }
        cap += strlen(tb->name) + 96;
    }
    char *s = host_alloc(ctx, cap), *p = s;
    if (!s) {
        set_error(ctx, DT_ENOMEM, "ps_new: out of memory");
        return NULL;
    }
    p += snprintf(p, cap, "dtrain-ps %d %d %d %d %d\n", ctx->n_params, cfg->ntables, cfg->servers,
                  cfg->replicate != 0, (int)cfg->mode);
    for (int i = 0; i < ctx->n_params; i++)
        p += snprintf(p, cap - (size_t)(p - s), "%s %lld\n", ctx->params[i]->name,
                      (long long)dt_tensor_numel(ctx->params[i]));
    for (int t = 0; t < cfg->ntables; t++) {
        const dt_ps_table *tb = &cfg->tables[t];
        p += snprintf(p, cap - (size_t)(p - s), "%lld %lld %a %llu %s\n", (long long)tb->rows,
                      (long long)tb->dim, (double)tb->init_scale, (unsigned long long)tb->seed,
                      tb->name);
    }
    return s;
}

/* One table line of the layout. */
static int ps_parse_table(dt_ctx *ctx, const char *line, const char *nl, ps_tab *tb)
{
    char *e;
    tb->rows = strtoll(line, &e, 10);
    tb->dim = strtoll(e, &e, 10);
    tb->scale = strtof(e, &e);
    tb->seed = strtoull(e, &e, 10);
    if (*e != ' ' || e >= nl || tb->rows < 1 || tb->dim < 1 || tb->rows > INT64_MAX / 8 / tb->dim)
        return 0;
    size_t len = (size_t)(nl - e - 1);
    if (!(tb->name = host_alloc(ctx, len + 1)))
        return 0;
    memcpy(tb->name, e + 1, len);
    tb->name[len] = '\0';
    return 1;
}

/* Sizes from a layout description; offsets in DDP's order (reverse
 * registration), ranges cut by bytes. */
static dt_status ps_plan(dt_ps *ps, const char *layout)
{
    dt_ctx *ctx = ps->ctx;
    int n = -1, nt = -1, servers = 0, repl = 0, mode = 0, used = 0;
    if (sscanf(layout, "dtrain-ps %d %d %d %d %d\n%n", &n, &nt, &servers, &repl, &mode, &used) != 5 ||
        used == 0 || n < 0 || nt < 0 || n > 1 << 24 || nt > 1 << 16)
        return set_error(ctx, DT_EPEER, "ps_new: worker 0's model layout is malformed");
    if (servers != ps->S || repl != (ps->cfg.replicate != 0) || mode != (int)ps->cfg.mode)
        return set_error(ctx, DT_EMISMATCH, "ps_new: rank %d has %d servers, replication %d, mode "
                         "%d; worker 0 has %d, %d, %d", ps->comm->rank, ps->S,
                         ps->cfg.replicate != 0, (int)ps->cfg.mode, servers, repl, mode);
    ps->nparams = n;
    ps->ntables = nt;
    ps->numel = host_calloc(ctx, sizeof(int64_t) * (size_t)(n + 1));
    ps->offset = host_calloc(ctx, sizeof(int64_t) * (size_t)(n + 1));
    ps->range = host_calloc(ctx, sizeof(int64_t) * (size_t)(ps->S + 1));
    ps->tabs = host_calloc(ctx, sizeof(ps_tab) * (size_t)(nt + 1));
    if (!ps->numel || !ps->offset || !ps->range || !ps->tabs)
        return set_error(ctx, DT_ENOMEM, "ps_new: out of memory");
    const char *p = layout + used;
    for (int i = 0; i < n + nt; i++) {
        const char *nl = strchr(p, '\n'), *sp = nl;
        while (sp && sp > p && *sp != ' ')   /* the number after the line's last space */
            sp--;
        int ok = nl && sp && *sp == ' ';
        if (ok && i < n)
            ok = (ps->numel[i] = strtoll(sp + 1, NULL, 10)) >= 0;
        else if (ok)
            ok = ps_parse_table(ctx, p, nl, &ps->tabs[i - n]);
        if (!ok)
            return set_error(ctx, DT_EPEER, "ps_new: worker 0's model layout is malformed "
                             "(line %d)", i + 2);
        p = nl + 1;
    }
    int64_t off = 0;
    for (int i = n - 1; i >= 0; i--) {
        ps->offset[i] = off;
        off += ps->numel[i];
    }
    ps->G = off;
    ps->P = n;
    for (int s = 0; s <= ps->L; s++)
        ps->range[s] = ps->G * s / ps->L;
    return DT_OK;
}

/* --- 18.2 the worker's side ----------------------------------------------- */

/* Replicated jobs: server s failed; if its shard's other server is alive,
 * s is written off and the request goes on without it. */
/* Write server s off: only in a replicated job whose twin of s is alive,
 * and only once the store says s died (a failed transfer alone may be a
 * live server's hiccup: writing it off would let the twins drift apart).
 * `known`: the caller saw the store say so. */
static int ps_write_off_server(dt_comm *c, dt_ps *ps, int s, int known)
{
    int twin = ps->L != ps->S && !ps->gone[(s + ps->L) % ps->S];
    if ((!twin && ps->cfg.rejoin_ms < 0) || !c->watch)
        return 0;
    if (!known) {   /* the death is usually published a moment after it shows */
        char key[32], val[16];
        size_t len = 0;
        dead_key(key, sizeof key, ps->W + s, ps->inc[s]);
        if (dt_store_get(c->watch, key, val, sizeof val, &len, c->timeout_ms / 2) != DT_OK)
            return 0;
    }
    ps->gone[s] = twin ? 1 : 2;   /* no twin: wait for a restarted process (18.6) */
    ps->down_since[s] = dt_now();
    return 1;
}

/* A post to server s failed (the work's first failure): go on without s
 * if it can be written off (or waited for). */
static dt_status ps_forgive(dt_comm *c, dt_work *w, dt_ps *ps, int s)
{
    if (!ps_write_off_server(c, ps, s, 0))
        return w->status;
    w->status = DT_OK;
    w->msg[0] = '\0';
    return DT_OK;
}

/* wait_xfers' hook: a transfer with a server failed. */
static int ps_write_off(dt_comm *c, void *arg, int peer)
{
    dt_ps *ps = arg;
    return peer >= ps->W && peer < ps->W + ps->S && ps_write_off_server(c, ps, peer - ps->W, 0);
}

/* A message's data, to go out (or come in) in pieces as ps_pump finds
 * room for them. */
static dt_status ps_add_stream(dt_work *w, ps_call *pc, int sending, int peer, int type,
                               uint32_t seq, void *buf, size_t bytes)
{
    size_t chunk = pc->ps->chunk;
    if (bytes == 0)
        return DT_OK;
    if (ps_pieces(bytes, chunk) > PS_MAX_PIECES || pc->nstreams == 3 * PS_MAX_SERVERS)
        return work_fail(w, DT_ENOTSUP, "parameter server: a message of %zu bytes is more than "
                         "%u pieces of %zu bytes (raise dt_ps_config.chunk_bytes)", bytes,
                         PS_MAX_PIECES, chunk);
    pc->streams[pc->nstreams++] = (ps_stream){.peer = peer, .sending = sending, .type = type,
                                              .seq = seq, .pieces = (uint32_t)ps_pieces(bytes, chunk),
                                              .buf = buf, .bytes = bytes};
    return DT_OK;
}

/* Post the header of one request to server s; its `bytes` of data (if
 * any) become a stream. */
static dt_status ps_post_request(dt_comm *c, dt_work *w, xfers *xs, ps_call *pc, int s,
                                 int op, int64_t lo, int64_t n, void *data, size_t bytes,
                                 ps_msg *hdr)
{
    dt_ps *ps = pc->ps;
    uint32_t seq = ps->seq[s]++;
    *hdr = (ps_msg){.magic = PS_MAGIC, .op = (uint32_t)op, .seq = seq, .lo = lo, .n = n,
                    .clock = pc->clock, .chunk = (uint32_t)ps->chunk};
    if (op == PS_CPUSH) {
        hdr->code = pc->code;
        hdr->k = pc->cnt[s % ps->L];
    }
    int peer = ps->W + s;
    if (post(c, w, xs, 1, peer, ps_tag(PS_TAG_REQ, seq, 0), hdr, sizeof *hdr) != DT_OK)
        return ps_forgive(c, w, ps, s);
    return data ? ps_add_stream(w, pc, 1, peer, PS_TAG_DATA, seq, data, bytes) : DT_OK;
}

/* Post the receive of server s's answer header to the request about to go
 * out; its data becomes a stream. */
static dt_status ps_post_answer(dt_comm *c, dt_work *w, xfers *xs, ps_call *pc, int s,
                                ps_msg *in, void *data, size_t bytes)
{
    dt_ps *ps = pc->ps;
    uint32_t seq = ps->seq[s];
    if (post(c, w, xs, 0, ps->W + s, ps_tag(PS_TAG_RESP, seq, 0), in, sizeof *in) != DT_OK)
        return ps_forgive(c, w, ps, s);
    return ps_add_stream(w, pc, 0, ps->W + s, PS_TAG_RDATA, seq, data, bytes);
}

/* Post the streams' next pieces, taking turns, while the transfer list
 * has room (a round's wait then sees them through); streams of servers
 * written off are dropped. */
static dt_status ps_pump(dt_comm *c, dt_work *w, xfers *xs, ps_call *pc)
{
    dt_ps *ps = pc->ps;
    for (int more = 1; more && xs->n < DT_COMM_MAX_XFERS;) {
        more = 0;
        for (int i = 0; i < pc->nstreams && xs->n < DT_COMM_MAX_XFERS; i++) {
            ps_stream *st = &pc->streams[i];
            int s = st->peer - ps->W;
            if (st->next == st->pieces || ps->gone[s])
                continue;
            size_t len = ps_piece_len(st->bytes, ps->chunk, st->next);
            if (post(c, w, xs, st->sending, st->peer, ps_tag(st->type, st->seq, st->next),
                     st->buf + (size_t)st->next * ps->chunk, len) != DT_OK &&
                ps_forgive(c, w, ps, s) != DT_OK)
                return w->status;
            st->next++;
            more = 1;
        }
    }
    return DT_OK;
}

/* Are pieces left to post (to servers not written off)? */
static int ps_streams_left(const ps_call *pc)
{
    for (int i = 0; i < pc->nstreams; i++)
        if (pc->streams[i].next < pc->streams[i].pieces &&
            !pc->ps->gone[pc->streams[i].peer - pc->ps->W])
            return 1;
    return 0;
}

/* The server shard j's pulls go to: the first of its servers alive. */
static int ps_reader(const dt_ps *ps, int j)
{
    return ps->L != ps->S && ps->gone[j] ? j + ps->L : j;
}

/* Post a dense request: every live server its shard's part (pushes go to
 * both servers of a replicated shard, pulls to one). */
static dt_status ps_post_dense(dt_comm *c, dt_work *w, xfers *xs, ps_call *pc, int *nout)
{
    dt_ps *ps = pc->ps;
    int64_t hi = pc->lo + pc->n, glo = pc->lo, ghi = hi < ps->G ? hi : ps->G;
    pc->nstreams = 0;
    for (int s = 0; s < ps->S; s++) {
        int j = s % ps->L;
        int64_t a = glo > ps->range[j] ? glo : ps->range[j];
        int64_t b = ghi < ps->range[j + 1] ? ghi : ps->range[j + 1];
        if (ps->gone[s] || (pc->use_only && !pc->only[s]))
            continue;
        if (pc->op == PS_FINISH) {
            if (ps_post_request(c, w, xs, pc, s, PS_FINISH, 0, 0, NULL, 0, &pc->out[(*nout)++]))
                return w->status;
            continue;
        }
        if (pc->op == PS_PULL) {
            if (a >= b || ps_reader(ps, j) != s)
                continue;
            if (ps_post_answer(c, w, xs, pc, s, &pc->in[s], pc->buf + (a - pc->lo),
                               (size_t)(b - a) * sizeof(float)) ||
                (!ps->gone[s] &&
                 ps_post_request(c, w, xs, pc, s, PS_PULL, a, b - a, NULL, 0, &pc->out[(*nout)++])))
                return w->status;
            pc->asked[s] = !ps->gone[s];
            continue;
        }
        /* init, push: this server's gradient keys (a compressed push: their
         * code), and every flag */
        if (pc->op == PS_CPUSH ? a < b && ps_post_request(c, w, xs, pc, s, PS_CPUSH, a, b - a,
                                                          pc->msg[j], pc->bytes[j],
                                                          &pc->out[(*nout)++])
                               : a < b && ps_post_request(c, w, xs, pc, s, pc->op, a, b - a,
                                                          pc->buf + (a - pc->lo),
                                                          (size_t)(b - a) * sizeof(float),
                                                          &pc->out[(*nout)++]))
            return w->status;
        pc->posted[s] += a < b ? b - a : 0;
        int64_t flo = pc->lo > ps->G ? pc->lo : ps->G;
        if ((pc->op == PS_PUSH || pc->op == PS_CPUSH) && hi > flo && !ps->gone[s] &&
            ps_post_request(c, w, xs, pc, s, PS_PUSH, flo, hi - flo, pc->buf + (flo - pc->lo),
                            (size_t)(hi - flo) * sizeof(float), &pc->out[(*nout)++]))
            return w->status;
        pc->posted[s] += (pc->op == PS_PUSH || pc->op == PS_CPUSH) && hi > flo ? hi - flo : 0;
    }
    return DT_OK;
}

/* Make pc (a push of gradients pc->buf, keys [lo, lo + n)) a compressed
 * one: each shard's part encoded on its own as `kind` (TOPK keeps `ratio`
 * of it), with error feedback when residual is given (g + residual is
 * sent, what was not stays in residual).  scratch: 2 n floats.  Returns
 * the code's bytes. */
static size_t ps_encode_push(const dt_ps *ps, ps_call *pc, int kind, double ratio,
                             float *residual, float *scratch, char *out)
{
    int64_t lo = pc->lo, hi = pc->lo + pc->n < ps->G ? pc->lo + pc->n : ps->G;
    float *g = pc->buf, *sent = residual ? residual : scratch + (hi - lo);
    size_t used = 0;
    for (int64_t i = 0; residual && i < hi - lo; i++)
        g[i] += residual[i];
    for (int j = 0; j < ps->L; j++) {
        int64_t a = lo > ps->range[j] ? lo : ps->range[j];
        int64_t b = hi < ps->range[j + 1] ? hi : ps->range[j + 1];
        pc->msg[j] = NULL;
        pc->cnt[j] = 0;
        pc->bytes[j] = 0;
        if (a >= b)
            continue;
        int64_t n = b - a, k = (int64_t)ceil(ratio * (double)n);
        k = kind != DT_COMPRESS_TOPK ? 0 : k < 1 ? 1 : k > n ? n : k;
        int64_t piece[3] = {0, n, k};
        grad_encode((dt_compress)kind, g + (a - lo), n, piece, 1, k, scratch, NULL, out + used,
                    sent + (a - lo));
        pc->msg[j] = out + used;
        pc->cnt[j] = k;
        pc->bytes[j] = ddp_code_bytes((dt_compress)kind, n, k);
        used += (pc->bytes[j] + 7) & ~(size_t)7;
    }
    for (int64_t i = 0; residual && i < hi - lo; i++)
        residual[i] = g[i] - sent[i];
    pc->op = PS_CPUSH;
    pc->code = kind;
    return used;
}

/* Post a sparse request: each live server its shard's distinct rows. */
static dt_status ps_post_sparse(dt_comm *c, dt_work *w, xfers *xs, ps_call *pc, int *nout)
{
    dt_ps *ps = pc->ps;
    int64_t dim = ps->tabs[pc->lo].dim;
    pc->nstreams = 0;
    for (int s = 0; s < ps->S; s++) {
        int j = s % ps->L;
        int64_t k = pc->cnt[j];
        if (k == 0 || ps->gone[s] || (pc->op == PS_SPULL && ps_reader(ps, j) != s) ||
            (pc->use_only && !pc->only[s]))
            continue;
        size_t idb = (size_t)k * sizeof(int64_t), rowb = (size_t)(k * dim) * sizeof(float);
        if (pc->op == PS_SPULL &&
            ps_post_answer(c, w, xs, pc, s, &pc->in[s], pc->rows[j], rowb) != DT_OK)
            return w->status;
        if (ps->gone[s])
            continue;
        pc->asked[s] = pc->op == PS_SPULL;
        if (ps_post_request(c, w, xs, pc, s, pc->op, pc->lo, k, pc->msg[j],
                            pc->op == PS_SPUSH ? idb + rowb : idb, &pc->out[(*nout)++]) != DT_OK)
            return w->status;
    }
    return DT_OK;
}

/* Did a server a pull of this round was answered from die? */
static int ps_lost_reader(const dt_ps *ps, const unsigned char *before)
{
    for (int s = 0; s < ps->S; s++)
        if (ps->gone[s] == 1 && !before[s])
            return 1;
    return 0;
}

/* How long workers wait for a dead server's restart (dt_ps_config.rejoin_ms). */
static int ps_rejoin_ms(const dt_ps *ps)
{
    return ps->cfg.rejoin_ms > 0 ? ps->cfg.rejoin_ms : 60000;
}

/* The incarnation rank's latest process published (0: none restarted). */
static uint32_t ps_published_inc(dt_comm *c, int rank, int wait_ms)
{
    char key[32], val[16];
    size_t len = 0;
    snprintf(key, sizeof key, "inc/%d", rank);
    if (dt_store_get(c->watch, key, val, sizeof val - 1, &len, wait_ms) != DT_OK)
        return 0;
    val[len < sizeof val ? len : sizeof val - 1] = '\0';
    return (uint32_t)strtoul(val, NULL, 10);
}

/* Servers found dead without a twin (gone 2): wait until a restarted
 * process of each has rejoined (14.6), swap its address in, and say hello
 * (our step, and how much of it its predecessor had); the request then
 * goes again to those servers `only` (their part of it was lost). */
static dt_status ps_await_rejoins(dt_comm *c, dt_work *w, xfers *xs, ps_call *pc)
{
    dt_ps *ps = pc->ps;
    pc->use_only = 0;
    memset(pc->only, 0, sizeof pc->only);
    for (int s = 0; s < ps->S; s++) {
        if (ps->gone[s] != 2)
            continue;
        int rank = ps->W + s;
        uint32_t inc;
        while ((inc = ps_published_inc(c, rank, 200)) <= ps->inc[s]) {
            if (dt_now() - ps->down_since[s] > ps_rejoin_ms(ps) / 1000.0)
                return work_fail(w, DT_EPEER, "parameter server: server rank %d died and no "
                                 "restarted process rejoined within %d ms (dt_ps_config.rejoin_ms)",
                                 rank, ps_rejoin_ms(ps));
            c->tp_iface->wait(c->tp, 50);   /* (the key may hold an older restart's number) */
        }
        char err[256] = "";
        if (comm_replace_peer(c, rank, inc, err, sizeof err) != DT_OK)
            return work_fail(w, DT_EPEER, "parameter server: server rank %d restarted, but: %s",
                             rank, err);
        ps->inc[s] = inc;
        ps->gone[s] = 0;
        ps->seq[s] = 0;   /* the new process numbers our requests from 0 */
        ps->st.rejoins++;
        int64_t had = ps->sent_clock[s] == pc->clock ? ps->sent[s] : 0;
        if (ps_post_request(c, w, xs, pc, s, PS_HELLO, 0, had, NULL, 0, &pc->hello[s]) != DT_OK)
            return w->status;
        pc->only[s] = 1;
        pc->use_only = 1;
        pc->posted[s] = 0;
        pc->asked[s] = 0;
    }
    return DT_OK;
}

/* A push went out whole: what each server now has of this step. */
static void ps_note_sent(dt_ps *ps, const ps_call *pc)
{
    for (int s = 0; (pc->op == PS_PUSH || pc->op == PS_CPUSH) && s < ps->S; s++) {
        if (!pc->posted[s])
            continue;
        if (ps->sent_clock[s] != pc->clock) {
            ps->sent_clock[s] = pc->clock;
            ps->sent[s] = 0;
        }
        ps->sent[s] += pc->posted[s];
    }
}

/* The comm thread runs a worker's request: split over the servers, post,
 * wait (within the communicator's timeout), check the answers; a sparse
 * pull's rows go where the caller asked.  Replicated: a server found dead
 * is written off, and a pull that was asking it asks again (pulls are
 * idempotent; pushes already went to both servers of the shard).  A dead
 * server without a twin is waited for (18.6) and asked again. */
/* The record after one that holds orphaned sends (drain_gone): a fresh
 * one with the same settings; the old one waits in the graveyard. */
static dt_status ps_fresh_xfers(dt_comm *c, dt_work *w, xfers **xsp)
{
    xfers *old = *xsp, *xs = c->ctx->al.malloc_fn(sizeof *xs, c->ctx->al.user);
    if (!xs)
        return work_fail(w, DT_ENOMEM, "%s: out of memory", coll_names[w->kind]);
    memset(xs, 0, sizeof *xs);
    xs->g = old->g;
    xs->gone = old->gone;
    xs->gone_base = old->gone_base;
    xs->gone_n = old->gone_n;
    xs->write_off = old->write_off;
    xs->write_off_arg = old->write_off_arg;
    old->next_dead = c->graveyard;
    c->graveyard = old;
    *xsp = xs;
    return DT_OK;
}

static dt_status ps_run(dt_comm *c, dt_work *w, xfers **xsp)
{
    xfers *xs = *xsp;
    ps_call *pc = (ps_call *)w->aux;
    dt_ps *ps = pc->ps;
    int nout = 0, sparse = pc->op == PS_SPUSH || pc->op == PS_SPULL;
    int pull = pc->op == PS_PULL || pc->op == PS_SPULL;
    if (ps->S > PS_MAX_SERVERS)
        return work_fail(w, DT_ENOTSUP, "parameter server: at most %d servers in this build",
                         PS_MAX_SERVERS);
    xs->gone = ps->gone;
    xs->gone_base = ps->W;
    xs->gone_n = ps->S;
    xs->write_off = ps_write_off;
    xs->write_off_arg = ps;
    memset(pc->asked, 0, sizeof pc->asked);
    memset(pc->posted, 0, sizeof pc->posted);
    pc->use_only = 0;
    unsigned char before[PS_MAX_SERVERS];   /* the servers gone when the pulls went out */
    memcpy(before, ps->gone, (size_t)ps->S);
    for (int round = 0, lost = 0;; round++) {
        nout = 0;
        if ((sparse ? ps_post_sparse : ps_post_dense)(c, w, xs, pc, &nout) != DT_OK)
            return w->status;
        do {   /* the data's pieces, as many at a time as the transfer list holds */
            if (ps_pump(c, w, xs, pc) != DT_OK)
                return w->status;
            /* a BSP pull waits for the slowest worker, and so may a parked push: the
             * server drops a silent worker after 1x, so we must outlast that */
            xs->patience = 2.0;
            if (wait_xfers(c, w, xs) != DT_OK)
                return w->status;
            if (xs->orphans) {
                if (ps_fresh_xfers(c, w, xsp) != DT_OK)
                    return w->status;
                xs = *xsp;
            }
        } while (ps_streams_left(pc));
        if (ps_await_rejoins(c, w, xs, pc) != DT_OK)
            return w->status;
        if (pc->use_only) {
            if (round > 16 * ps->S)
                return work_fail(w, DT_EPEER, "parameter server: servers keep dying");
            continue;
        }
        if (!pull || !ps_lost_reader(ps, before))
            break;
        if (++lost > ps->S)
            return work_fail(w, DT_EPEER, "parameter server: every server of a shard died");
        memset(pc->asked, 0, sizeof pc->asked);   /* every pull goes again */
        memcpy(before, ps->gone, (size_t)ps->S);
    }
    for (int s = 0; s < ps->S; s++) {
        if (!pc->asked[s])
            continue;
        pc->in[s].err[sizeof pc->in[s].err - 1] = '\0';   /* (a peer's text) */
        if (pc->in[s].magic != PS_MAGIC || pc->in[s].status != DT_OK)
            return work_fail(w, pc->in[s].magic != PS_MAGIC ? DT_EPEER : (dt_status)pc->in[s].status,
                             "parameter server: %s", pc->in[s].magic != PS_MAGIC
                                 ? "a server sent a malformed answer" : pc->in[s].err);
        pc->stale = pc->in[s].clock > pc->stale ? pc->in[s].clock : pc->stale;
    }
    ps_note_sent(ps, pc);
    if (pc->op == PS_SPULL) {
        int64_t dim = ps->tabs[pc->lo].dim;
        for (int64_t i = 0; i < pc->n; i++)
            memcpy(pc->buf + i * dim, pc->rows[pc->where[i] % 8] + (pc->where[i] / 8) * dim,
                   (size_t)dim * sizeof(float));
    }
    return DT_OK;
}

/* A worker's request stalls: is one of the servers dead? */
static dt_status ps_check_servers(dt_comm *c, dt_work *w)
{
    const ps_call *pc = w->aux;
    dt_ps *ps = pc->ps;
    for (int s = 0; s < ps->S; s++) {
        char key[32], val[16];
        size_t len = 0;
        dead_key(key, sizeof key, ps->W + s, ps->inc[s]);
        if (ps->gone[s] || dt_store_get(c->watch, key, val, sizeof val, &len, 1) != DT_OK)
            continue;
        if (!ps_write_off_server(c, ps, s, 1))   /* a twin serves on, or a restart is awaited */
            return work_fail(w, DT_EPEER, "parameter server: server rank %d died", ps->W + s);
    }
    return DT_OK;
}

/* Run one request on the comm thread and wait for it. */
/* A pull's answer was this many steps stale: the worker's statistics. */
static void ps_note_stale(dt_ps *ps, int64_t stale)
{
    ps->stale_sum += (double)stale;
    ps->stale_n++;
    if (stale > ps->st.max_staleness)
        ps->st.max_staleness = stale;
}

static dt_status ps_call_run(dt_ps *ps, int op, int64_t lo, int64_t n, float *buf)
{
    ps_call pc = {.ps = ps, .op = op, .lo = lo, .n = n, .buf = buf, .clock = ps->clock};
    dt_work *w = enqueue_in(ps->comm, COLL_PS, buf, NULL, n, 0, DT_REDUCE_SUM, &pc);
    dt_status s = w ? dt_work_wait(w) : ps->ctx->last_status;
    if (s == DT_OK && op == PS_PULL)
        ps_note_stale(ps, pc.stale);
    return s;
}

/* Pack every parameter's gradient (zeros where absent) and used flag into
 * stage, in the flat layout. */
static void ps_pack_grads(dt_ps *ps, float *stage)
{
    dt_ctx *ctx = ps->ctx;
    for (int i = 0; i < ps->nparams; i++) {
        dt_tensor *g = ctx->params[i]->grad;
        int used = g && !(g->flags & T_ZERO);
        if (used)
            be_to_host(ctx, stage + ps->offset[i], g->data, (size_t)ps->numel[i] * 4);
        else
            memset(stage + ps->offset[i], 0, (size_t)ps->numel[i] * sizeof(float));
        stage[ps->G + i] = used ? 1.0f : 0.0f;
    }
}

static void ps_unpack_params(dt_ps *ps, const float *stage)
{
    dt_ctx *ctx = ps->ctx;
    for (int i = 0; i < ps->nparams; i++)
        be_to_device(ctx, ctx->params[i]->data, stage + ps->offset[i],
                     (size_t)ps->numel[i] * sizeof(float));
}

static int ps_worker_ok(dt_ps *ps, const char *what)
{
    if (!ps)
        return 0;
    if (ps->server >= 0) {
        set_error(ps->ctx, DT_ESTATE, "%s: rank %d is a server (dt_ps_serve)", what, ps->comm->rank);
        return 0;
    }
    return 1;
}

dt_status dt_ps_pull(dt_ps *ps)
{
    if (!ps_worker_ok(ps, "ps_pull"))
        return ps ? DT_ESTATE : DT_EINVAL;
    double t0 = dt_now();
    dt_status s = ps_call_run(ps, PS_PULL, 0, ps->G, ps->stage);
    ps->st.wait_s += dt_now() - t0;
    if (s != DT_OK)
        return s;
    ps->st.pulls++;
    ps_unpack_params(ps, ps->stage);
    return DT_OK;
}

/* A step's parameters.  With prefetch, those of the pull started after the
 * previous step's push (the step computes while this step's pull runs in
 * the background, one step stale); else pulled now. */
static dt_status ps_step_pull(dt_ps *ps)
{
    if (!ps->cfg.prefetch)
        return dt_ps_pull(ps);
    if (ps->prefetch) {
        double t0 = dt_now();
        dt_status s = dt_work_wait(ps->prefetch);
        ps->prefetch = NULL;
        ps->st.wait_s += dt_now() - t0;
        if (s != DT_OK)
            return s;
        ps->st.pulls++;
        ps_note_stale(ps, ps->prefetch_call.stale);
        ps_unpack_params(ps, ps->stage2);
    }
    ps->prefetch_call = (ps_call){.ps = ps, .op = PS_PULL, .lo = 0, .n = ps->G, .buf = ps->stage2,
                                  .clock = ps->clock};
    ps->prefetch = enqueue_in(ps->comm, COLL_PS, ps->stage2, NULL, ps->G, 0, DT_REDUCE_SUM,
                              &ps->prefetch_call);
    return ps->prefetch ? DT_OK : ps->ctx->last_status;
}

/* Wait out a prefetch; `keep`: its weights (the servers' last) go into the
 * model, so a worker ends with every update. */
static dt_status ps_end_prefetch(dt_ps *ps, int keep)
{
    dt_status s = ps->prefetch ? dt_work_wait(ps->prefetch) : DT_OK;
    if (ps->prefetch && s == DT_OK && keep) {
        ps->st.pulls++;
        ps_unpack_params(ps, ps->stage2);
    }
    ps->prefetch = NULL;
    return s;
}

static int64_t ps_clock(const dt_ps *ps) { return ps->clock; }

/* A step's pushes all went out (DDP's buckets, or push_pull's one). */
static void ps_pushed(dt_ps *ps, int requests)
{
    ps->st.pushes += requests;
    ps->st.steps++;
    ps->clock++;
}

dt_status dt_ps_push(dt_ps *ps)
{
    if (!ps_worker_ok(ps, "ps_push"))
        return ps ? DT_ESTATE : DT_EINVAL;
    ps_pack_grads(ps, ps->stage);
    dt_status s = ps_call_run(ps, PS_PUSH, 0, ps->G + ps->P, ps->stage);
    if (s == DT_OK)
        ps_pushed(ps, 1);
    return s;
}

dt_status dt_ps_push_pull(dt_ps *ps)
{
    if (!ps_worker_ok(ps, "ps_push_pull"))
        return ps ? DT_ESTATE : DT_EINVAL;
    dt_status s = dt_ps_push(ps);
    return s != DT_OK ? s : ps_step_pull(ps);
}

dt_status dt_ps_finish(dt_ps *ps)
{
    if (!ps_worker_ok(ps, "ps_finish"))
        return ps ? DT_ESTATE : DT_EINVAL;
    dt_status s = ps_end_prefetch(ps, 1);
    if (s != DT_OK)
        return s;
    s = ps_call_run(ps, PS_FINISH, 0, 0, NULL);
    ps->finished = s == DT_OK;
    if (s == DT_OK) {   /* a server restarted later must not wait for our hello (18.6) */
        char key[64];
        snprintf(key, sizeof key, "ps%d/done/%d", ps->job, ps->comm->rank);
        s = dt_store_set(ps->comm->store, key, "1", 2);
    }
    return s;
}

/* Sparse requests.  The asked ids are sorted (by id, then position) so
 * each distinct row moves once and repeated rows' gradients are summed in
 * the caller's order: the same request gives the same bits. */
typedef struct ps_idpos {
    int64_t id, pos;
} ps_idpos;

static int ps_idpos_cmp(const void *a, const void *b)
{
    const ps_idpos *x = a, *y = b;
    return x->id != y->id ? (x->id < y->id ? -1 : 1) : (x->pos > y->pos) - (x->pos < y->pos);
}

/* One block holding the call and everything it sends and receives; the
 * caller frees it (host_free) once the call is done. */
static ps_call *ps_sparse_prepare(dt_ps *ps, const char *what, int op, int table,
                                  const int64_t *ids, int64_t n, const float *grads, float *out)
{
    dt_ctx *ctx = ps->ctx;
    if (!ps_worker_ok(ps, what))
        return NULL;
    if (table < 0 || table >= ps->ntables || n < 0 || (n > 0 && (!ids || (!grads && !out)))) {
        set_error(ctx, DT_EINVAL, "%s: table %d of %d, %lld ids at %p", what, table, ps->ntables,
                  (long long)n, (const void *)ids);
        return NULL;
    }
    const ps_tab *tb = &ps->tabs[table];
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= tb->rows) {
            set_error(ctx, DT_EINVAL, "%s: id %lld (entry %lld) is not a row of table '%s' "
                      "(%lld rows)", what, (long long)ids[i], (long long)i, tb->name,
                      (long long)tb->rows);
            return NULL;
        }
    ps_idpos *ip = host_alloc(ctx, sizeof *ip * (size_t)(n > 0 ? n : 1));
    if (!ip) {
        set_error(ctx, DT_ENOMEM, "%s: out of memory for %lld ids", what, (long long)n);
        return NULL;
    }
    for (int64_t i = 0; i < n; i++)
        ip[i] = (ps_idpos){ids[i], i};
    qsort(ip, (size_t)n, sizeof *ip, ps_idpos_cmp);
    int64_t cnt[PS_MAX_SERVERS] = {0}, S = ps->L, dim = tb->dim;
    for (int64_t i = 0; i < n; i++)
        if (i == 0 || ip[i].id != ip[i - 1].id)
            cnt[ip[i].id % S]++;
    /* the block: the call, each server's message (and answer rows), where[] */
    size_t bytes = sizeof(ps_call), at[PS_MAX_SERVERS], rat[PS_MAX_SERVERS];
    for (int s = 0; s < S; s++) {   /* (s: a shard; every part 8-byte aligned) */
        at[s] = bytes = (bytes + 7) & ~(size_t)7;
        bytes += (size_t)cnt[s] * (sizeof(int64_t) + (op == PS_SPUSH ? (size_t)dim * 4 : 0));
        rat[s] = bytes;
        bytes += op == PS_SPULL ? (size_t)(cnt[s] * dim) * sizeof(float) : 0;
    }
    size_t wat = bytes = (bytes + 7) & ~(size_t)7;
    bytes += op == PS_SPULL ? (size_t)n * sizeof(int64_t) : 0;
    char *blk = host_calloc(ctx, bytes);
    if (!blk) {
        host_free(ctx, ip);
        set_error(ctx, DT_ENOMEM, "%s: out of memory for %lld ids", what, (long long)n);
        return NULL;
    }
    ps_call *pc = (ps_call *)blk;
    *pc = (ps_call){.ps = ps, .op = op, .lo = table, .n = n, .buf = out, .clock = ps->clock,
                    .where = op == PS_SPULL ? (int64_t *)(blk + wat) : NULL};
    for (int s = 0; s < S; s++) {
        pc->msg[s] = blk + at[s];
        pc->rows[s] = (float *)(blk + rat[s]);
    }
    int64_t k[PS_MAX_SERVERS] = {0};
    for (int64_t i = 0; i < n; i++) {
        int s = (int)(ip[i].id % S);
        int fresh = i == 0 || ip[i].id != ip[i - 1].id;
        if (fresh)
            ((int64_t *)pc->msg[s])[k[s]++] = ip[i].id / S;
        int64_t row = k[s] - 1;
        if (op == PS_SPULL) {
            pc->where[ip[i].pos] = row * 8 + s;
            continue;
        }
        float *g = (float *)((int64_t *)pc->msg[s] + cnt[s]) + row * dim;
        const float *src = grads + ip[i].pos * dim;
        for (int64_t j = 0; j < dim; j++)
            g[j] = fresh ? src[j] : g[j] + src[j];
    }
    memcpy(pc->cnt, cnt, sizeof cnt);
    host_free(ctx, ip);
    return pc;
}

static int64_t ps_rows_in(const ps_call *pc)
{
    int64_t rows = 0;
    for (int s = 0; s < pc->ps->L; s++)
        rows += pc->cnt[s];
    return rows;
}

dt_status dt_ps_sparse_push(dt_ps *ps, int table, const int64_t *ids, int64_t n, const float *grads)
{
    if (!ps)
        return DT_EINVAL;
    ps_call *pc = ps_sparse_prepare(ps, "ps_sparse_push", PS_SPUSH, table, ids, n, grads, NULL);
    if (!pc)
        return ps->ctx->last_status;
    dt_work *w = enqueue_in(ps->comm, COLL_PS, NULL, NULL, n, 0, DT_REDUCE_SUM, pc);
    dt_status s = w ? dt_work_wait(w) : ps->ctx->last_status;
    if (s == DT_OK)
        ps->st.rows_pushed += ps_rows_in(pc);
    host_free(ps->ctx, pc);
    return s;
}

dt_work *dt_ps_sparse_pull_async(dt_ps *ps, int table, const int64_t *ids, int64_t n,
                                 float *rows_out)
{
    if (!ps)
        return NULL;
    ps_call *pc = ps_sparse_prepare(ps, "ps_sparse_pull", PS_SPULL, table, ids, n, NULL, rows_out);
    if (!pc)
        return NULL;
    dt_work *w = enqueue_in(ps->comm, COLL_PS, rows_out, NULL, n, 0, DT_REDUCE_SUM, pc);
    if (!w) {
        host_free(ps->ctx, pc);
        return NULL;
    }
    w->owned = pc;   /* freed by dt_work_wait */
    ps->st.pulls++;
    ps->st.rows_pulled += ps_rows_in(pc);
    return w;
}

dt_status dt_ps_sparse_pull(dt_ps *ps, int table, const int64_t *ids, int64_t n, float *rows_out)
{
    double t0 = dt_now();
    dt_work *w = dt_ps_sparse_pull_async(ps, table, ids, n, rows_out);
    dt_status s = w ? dt_work_wait(w) : ps ? ps->ctx->last_status : DT_EINVAL;
    if (ps)
        ps->st.wait_s += dt_now() - t0;
    return s;
}

/* --- 18.3 the server's side ----------------------------------------------- */

/* Optimizer state tensors a table row needs, by the servers' optimizer. */
static int ps_tab_states(const dt_optim_config *c)
{
    return c->kind == DT_SGD ? c->momentum != 0.0f : c->kind == DT_ADAGRAD ? 1 : 2;
}

/* This server's rows of a table, drawn as dt_ps_table says, with their
 * optimizer state and the buffers that sum pushed rows. */
static dt_status ps_make_table(dt_ps *ps, ps_tab *tb)
{
    dt_ctx *sx = ps->sctx;
    int64_t S = ps->L, s = ps->shard;
    tb->count = tb->rows > s ? (tb->rows - s + S - 1) / S : 0;
    int64_t shape[2] = {tb->count > 0 ? tb->count : 1, tb->dim};
    static const char *const suffix[3][2] = {{".momentum_buffer", ""}, {".exp_avg", ".exp_avg_sq"},
                                             {".sum", ""}};
    const dt_optim_config *oc = &ps->cfg.optim;
    int kind = oc->kind == DT_SGD ? 0 : oc->kind == DT_ADAGRAD ? 2 : 1;
    char name[DT_MAX_NAME];   /* (checkpoints name it; "table." keeps it off the pieces' names) */
    snprintf(name, sizeof name, "table.%s", tb->name);
    tb->w = owned_tensor(sx, 2, shape, name, "");
    for (int j = 0; j < ps_tab_states(oc); j++)
        tb->state[j] = owned_tensor(sx, 2, shape, name, suffix[kind][j]);
    int64_t two = 2;
    tb->steps_t = owned_tensor(sx, 1, &two, name, ".steps");
    size_t n = (size_t)(shape[0] * tb->dim);
    tb->acc = host_calloc(ps->ctx, n * sizeof(float));
    tb->slot = host_alloc(ps->ctx, (size_t)shape[0] * sizeof(int64_t));
    tb->touched = host_alloc(ps->ctx, (size_t)shape[0] * sizeof(int64_t));
    if (!tb->w || (ps_tab_states(oc) > 0 && !tb->state[0]) || (ps_tab_states(oc) > 1 && !tb->state[1]) ||
        !tb->steps_t || !tb->acc || !tb->slot || !tb->touched)
        return set_error(ps->ctx, DT_ENOMEM, "ps_new: out of memory for table '%s' (%lld x %lld "
                         "here)", tb->name, (long long)tb->count, (long long)tb->dim);
    float *w = tb->w->data;
    for (int64_t i = 0; i < tb->count; i++) {
        uint64_t r = (uint64_t)(i * S + s);   /* the global row */
        for (int64_t j = 0; j < tb->dim; j++) {
            uint64_t h = tb->seed ^ (0x9E3779B97F4A7C15ull * (r * (uint64_t)tb->dim + (uint64_t)j + 1));
            float u = (float)(splitmix64(&h) >> 40) * (1.0f / 16777216.0f);
            w[i * tb->dim + j] = tb->scale * (2.0f * u - 1.0f);
        }
    }
    for (int64_t i = 0; i < shape[0]; i++)
        tb->slot[i] = -1;
    return DT_OK;
}

/* Every server must start from the same step (or all fresh): files from
 * different steps (a crash between two servers' saves) would make a model
 * of two ages.  Each says its step in the store and reads the others'. */
static dt_status ps_agree_on_resume(dt_ps *ps)
{
    dt_comm *c = ps->comm;
    char key[64], mine[32], theirs[32];
    snprintf(mine, sizeof mine, "%lld", ps->resumed ? (long long)ps->opt->steps : -1LL);
    snprintf(key, sizeof key, "ps%d/resume/%d", ps->job, ps->server);
    dt_status s = dt_store_set(c->store, key, mine, strlen(mine) + 1);
    for (int q = 0; s == DT_OK && q < ps->S; q++) {
        size_t len = 0;
        snprintf(key, sizeof key, "ps%d/resume/%d", ps->job, q);
        s = dt_store_get(c->store, key, theirs, sizeof theirs - 1, &len, c->timeout_ms);
        theirs[s == DT_OK && len < sizeof theirs ? len : 0] = '\0';
        if (s == DT_OK && strcmp(theirs, mine) != 0)
            s = set_error(ps->ctx, DT_EMISMATCH, "ps_new: server %d starts from step %s, server %d "
                          "from step %s (-1: no checkpoint): their checkpoint files are from "
                          "different steps", ps->server, mine, q, theirs);
    }
    return s;
}

/* Checkpoints: the tables ride along with the pieces and the optimizer. */
static dt_status ps_resume(dt_ps *ps)
{
    dt_ctx *sx = ps->sctx;
    const char *dir = ps->cfg.checkpoint_dir;
    if (!dir || !*dir)
        return DT_OK;
    sx->ckpt_extra = host_calloc(ps->ctx, sizeof(dt_tensor *) * (size_t)(4 * ps->ntables + 1));
    size_t len = strlen(dir) + 48;
    ps->ckpt_path = host_alloc(ps->ctx, len);
    if (!sx->ckpt_extra || !ps->ckpt_path)
        return set_error(ps->ctx, DT_ENOMEM, "ps_new: out of memory");
    snprintf(ps->ckpt_path, len, "%s/ps-server-%d.safetensors", dir, ps->server);
    for (int t = 0; t < ps->ntables; t++) {
        sx->ckpt_extra[sx->n_ckpt_extra++] = ps->tabs[t].w;
        sx->ckpt_extra[sx->n_ckpt_extra++] = ps->tabs[t].steps_t;
        for (int j = 0; j < 2; j++)
            if (ps->tabs[t].state[j])
                sx->ckpt_extra[sx->n_ckpt_extra++] = ps->tabs[t].state[j];
    }
    if (access(ps->ckpt_path, F_OK) == 0) {
        if (dt_checkpoint_load(sx, ps->opt, ps->ckpt_path, NULL) != DT_OK)
            return set_error(ps->ctx, dt_last_status(sx), "ps_new: server %d cannot resume: %s",
                             ps->server, dt_last_error(sx));
        for (int t = 0; t < ps->ntables; t++) {   /* (Adam's bias correction goes on) */
            const float *f = ps->tabs[t].steps_t->data;
            ps->tabs[t].steps = (int64_t)f[0] * 16777216 + (int64_t)f[1];
        }
        ps->resumed = ps->initialized = 1;
        ps->st.resumed = 1;
        ps->st.resumed_step = ps->opt->steps;
    }
    if (ps->comm->inc)   /* rejoining a running job: the others started long ago */
        return ps->resumed ? DT_OK : set_error(ps->ctx, DT_ESTATE, "ps_new: server rank %d is a "
                                               "restarted process, and without its checkpoint "
                                               "(%s) it has nothing to rejoin with",
                                               ps->comm->rank, ps->ckpt_path);
    return ps_agree_on_resume(ps);
}

static dt_status ps_checkpoint(dt_ps *ps)
{
    if (!ps->ckpt_path)
        return DT_OK;
    for (int t = 0; t < ps->ntables; t++) {
        float *f = ps->tabs[t].steps_t->data;
        f[0] = (float)(ps->tabs[t].steps >> 24);
        f[1] = (float)(ps->tabs[t].steps & 0xFFFFFF);
    }
    if (dt_checkpoint_save(ps->sctx, ps->opt, ps->ckpt_path, ps->opt->steps) != DT_OK)
        return set_error(ps->ctx, dt_last_status(ps->sctx), "ps_serve: checkpoint: %s",
                         dt_last_error(ps->sctx));
    ps->st.checkpoints++;
    return DT_OK;
}

/* The pieces: every parameter cut to this server's keys, each a parameter
 * of the server's own context (named after it), with the optimizer over
 * them. */
static dt_status ps_make_pieces(dt_ps *ps)
{
    dt_config cc;
    dt_config_init(&cc);
    cc.allocator = ps->ctx->al;
    /* a server's shard is host memory whatever the workers compute on */
    cc.custom_backend = find_backend("cpu");
    if (!cc.custom_backend)
        return set_error(ps->ctx, DT_ENOTSUP, "ps_new: a parameter server needs the cpu backend "
                         "compiled in (-DDT_WITH_CPU)");
    ps->sctx = dt_ctx_new(&cc);
    if (!ps->sctx || dt_last_status(ps->sctx) != DT_OK)
        return set_error(ps->ctx, DT_ENOMEM, "ps_new: cannot make the server's context");
    int64_t lo = ps->range[ps->shard], hi = ps->range[ps->shard + 1];
    ps->piece = host_calloc(ps->ctx, sizeof *ps->piece * (size_t)(ps->nparams + 1));
    ps->piece_lo = host_calloc(ps->ctx, sizeof(int64_t) * (size_t)(ps->nparams + 1));
    ps->piece_param = host_calloc(ps->ctx, sizeof(int) * (size_t)(ps->nparams + 1));
    if (!ps->piece || !ps->piece_lo || !ps->piece_param)
        return set_error(ps->ctx, DT_ENOMEM, "ps_new: out of memory");
    for (int k = ps->nparams - 1; k >= 0; k--) {   /* key order: reverse registration */
        int64_t a = ps->offset[k] > lo ? ps->offset[k] : lo;
        int64_t b = ps->offset[k] + ps->numel[k] < hi ? ps->offset[k] + ps->numel[k] : hi;
        if (a >= b)
            continue;
        char name[48];
        snprintf(name, sizeof name, "p%d.%lld", k, (long long)(a - ps->offset[k]));
        int64_t len = b - a;
        dt_tensor *t = dt_param_new(ps->sctx, name, 1, &len);
        if (!t)
            return set_error(ps->ctx, dt_last_status(ps->sctx), "ps_new: %s", dt_last_error(ps->sctx));
        ps->piece[ps->npieces] = t;
        ps->piece_lo[ps->npieces] = a;
        ps->piece_param[ps->npieces++] = k;
    }
    ps->opt = dt_optim_new(ps->sctx, &ps->cfg.optim, NULL, 0);
    if (!ps->opt || (ps->cfg.schedule.kind != DT_SCHED_CONSTANT &&
                     dt_optim_set_schedule(ps->opt, &ps->cfg.schedule) != DT_OK))
        return set_error(ps->ctx, dt_last_status(ps->sctx), "ps_new: the servers' optimizer: %s",
                         dt_last_error(ps->sctx));
    for (int t = 0; t < ps->ntables; t++)
        if (ps_make_table(ps, &ps->tabs[t]) != DT_OK)
            return ps->ctx->last_status;
    if (ps->comm->inc && !(ps->cfg.checkpoint_dir && *ps->cfg.checkpoint_dir))
        return set_error(ps->ctx, DT_ESTATE, "ps_new: server rank %d is a restarted process; "
                         "it can rejoin only from a checkpoint (dt_ps_config.checkpoint_dir)",
                         ps->comm->rank);
    if (ps_resume(ps) != DT_OK)
        return ps->ctx->last_status;
    int64_t floats = hi - lo + ps->P;
    ps->initialized = ps->resumed || hi == lo;   /* resumed, or no keys here: nothing to wait for */
    ps->peers = host_calloc(ps->ctx, sizeof *ps->peers * (size_t)ps->W);
    ps->sum = host_alloc(ps->ctx, sizeof(float) * (size_t)(floats > 0 ? floats : 1));
    if (!ps->peers || !ps->sum)
        return set_error(ps->ctx, DT_ENOMEM, "ps_new: out of memory");
    for (int w = 0; w < ps->W; w++)
        if (!(ps->peers[w].push = host_calloc(ps->ctx, sizeof(float) * (size_t)(floats > 0 ? floats : 1))))
            return set_error(ps->ctx, DT_ENOMEM, "ps_new: out of memory for %d workers' pushes", ps->W);
    if (ps->comm->inc) {   /* 18.6: each worker's step is learnt from its hello */
        ps->syncing = 1;
        ps->st.rejoined = 1;
        for (int w = 0; w < ps->W; w++)
            ps->peers[w].clock = -1;
    }
    return DT_OK;
}

static int64_t ps_my_floats(const dt_ps *ps)
{
    return ps->range[ps->shard + 1] - ps->range[ps->shard] + ps->P;
}

/* Where key k lands in a peer's push buffer (gradients, then flags). */
static int64_t ps_slot(const dt_ps *ps, int64_t k)
{
    return k >= ps->G ? ps->range[ps->shard + 1] - ps->range[ps->shard] + (k - ps->G)
                      : k - ps->range[ps->shard];
}

/* Step the pieces with grads = sum (G_s floats) * scale, flags after them. */
static dt_status ps_step(dt_ps *ps, float *sum, float scale)
{
    int64_t lo = ps->range[ps->shard], gs = ps->range[ps->shard + 1] - lo;
    const float *flags = sum + gs;
    for (int64_t i = 0; i < gs; i++)
        sum[i] *= scale;
    for (int p = 0; p < ps->npieces; p++) {
        dt_tensor *t = ps->piece[p], *g = t->grad;
        if (!(flags[ps->piece_param[p]] > 0)) {
            g->flags |= T_ZERO;
            continue;
        }
        ps->sctx->be_iface->copy(ps->sctx->be, g->data, sum + (ps->piece_lo[p] - lo), tensor_bytes(g));
        g->flags &= ~(unsigned)T_ZERO;
    }
    dt_status s = dt_optim_step(ps->opt);
    dt_zero_grad(ps->sctx);
    if (s != DT_OK)
        return set_error(ps->ctx, s, "ps_serve: optimizer step: %s", dt_last_error(ps->sctx));
    ps->st.steps++;
    return DT_OK;
}

/* After a whole step (its sparse rows too): a checkpoint when one is due. */
static dt_status ps_checkpoint_due(dt_ps *ps)
{
    int every = ps->cfg.checkpoint_every;
    return every > 0 && ps->opt->steps % every == 0 ? ps_checkpoint(ps) : DT_OK;
}

/* Add k pushed rows (local row numbers ids, then k * dim floats) to the
 * table's sums. */
static void ps_tab_add(ps_tab *tb, int64_t k, const int64_t *ids)
{
    const float *g = (const float *)(ids + k);
    for (int64_t i = 0; i < k; i++) {
        int64_t r = ids[i];
        if (tb->slot[r] < 0) {
            tb->slot[r] = tb->ntouched;
            tb->touched[tb->ntouched++] = r;
        }
        float *a = tb->acc + r * tb->dim;
        for (int64_t j = 0; j < tb->dim; j++)
            a[j] += g[i * tb->dim + j];
    }
}

/* Step the summed rows (times scale) with the servers' optimizer, one row
 * at a time through the backend's update (lazily, as torch's sparse
 * gradients: rows not pushed and their state stay as they are). */
static void ps_tab_apply(dt_ps *ps, ps_tab *tb, float scale)
{
    if (!tb->ntouched)
        return;
    const dt_optim_config *c = &ps->opt->cfg;
    const dt_backend_iface *be = ps->sctx->be_iface;
    /* the rate the schedule gives now (ASP rows may arrive between dense steps) */
    float lr = ps->opt->has_sched ? dt_schedule_lr(&ps->opt->sched, ps->opt->base_lr, ps->opt->steps)
                                  : ps->opt->lr;
    float bc1 = 0, bc2 = 0;
    int64_t d = tb->dim;
    tb->steps++;
    if (c->kind == DT_ADAM || c->kind == DT_ADAMW) {
        bc1 = 1.0f - powf(c->beta1, (float)tb->steps);
        bc2 = 1.0f - powf(c->beta2, (float)tb->steps);
    }
    float *w = tb->w->data, *s0 = tb->state[0] ? tb->state[0]->data : NULL;
    float *s1 = tb->state[1] ? tb->state[1]->data : NULL;
    for (int64_t i = 0; i < tb->ntouched; i++) {
        int64_t r = tb->touched[i], o = r * d;
        float *g = tb->acc + o;
        for (int64_t j = 0; j < d; j++)
            g[j] *= scale;
        if (c->kind == DT_SGD)   /* momentum buffers start at zero (first = 0) */
            be->sgd_update(ps->sctx->be, d, w + o, g, s0 ? s0 + o : NULL, lr, c->momentum,
                           c->dampening, c->nesterov, c->weight_decay, 0);
        else if (c->kind == DT_ADAGRAD)
            be->adagrad_update(ps->sctx->be, d, w + o, g, s0 + o, lr, c->eps, c->weight_decay);
        else
            be->adam_update(ps->sctx->be, d, w + o, g, s0 + o, s1 + o, lr, c->beta1, c->beta2,
                            c->eps, c->weight_decay, c->kind == DT_ADAMW, bc1, bc2);
        memset(g, 0, (size_t)d * sizeof(float));
        tb->slot[r] = -1;
    }
    ps->st.rows_updated += tb->ntouched;
    tb->ntouched = 0;
}

/* BSP: the sparse pushes of step `step`, summed in worker order, applied
 * with the step (scaled as its dense gradients are). */
static void ps_apply_sparse_step(dt_ps *ps, int64_t step, float scale)
{
    for (int w = 0; w < ps->W; w++) {
        ps_peer *p = &ps->peers[w];
        for (ps_sparse_msg **mm = &p->held; *mm;) {
            ps_sparse_msg *m = *mm;
            if (m->clock != step || p->state != 0) {
                mm = &m->next;
                continue;
            }
            ps_tab_add(&ps->tabs[m->table], m->k, m->data);
            *mm = m->next;
            host_free(ps->ctx, m->data);
            host_free(ps->ctx, m);
        }
    }
    for (int t = 0; t < ps->ntables; t++)
        ps_tab_apply(ps, &ps->tabs[t], scale);
}

static void ps_free_held(dt_ps *ps, ps_peer *p)
{
    while (p->held) {
        ps_sparse_msg *m = p->held;
        p->held = m->next;
        host_free(ps->ctx, m->data);
        host_free(ps->ctx, m);
    }
}

/* The slowest live worker's completed steps (INT64_MAX: none live; -1: a
 * rejoined server has not heard from every live worker yet). */
static int64_t ps_min_clock(const dt_ps *ps)
{
    int64_t m = INT64_MAX;
    for (int w = 0; w < ps->W; w++)
        if (ps->peers[w].state == 0 && ps->peers[w].clock < m)
            m = ps->peers[w].clock;
    return m;
}

/* BSP: apply every step all live workers have completed, summing their
 * gradients in worker order (as the allreduce sums ranks). */
static dt_status ps_post_header(dt_ps *ps, int w);

static dt_status ps_apply_bsp(dt_ps *ps)
{
    int64_t n = ps_my_floats(ps), gs = n - ps->P;
    while (ps_min_clock(ps) != INT64_MAX && ps_min_clock(ps) > ps->applied) {
        int first = 1, live = 0;
        for (int w = 0; w < ps->W; w++) {
            if (ps->peers[w].state != 0)
                continue;
            live++;
            const float *v = ps->peers[w].push;
            if (first)
                memcpy(ps->sum, v, (size_t)n * sizeof(float));
            else {
                for (int64_t i = 0; i < gs; i++)
                    ps->sum[i] += v[i];
                for (int64_t i = gs; i < n; i++)
                    ps->sum[i] = ps->sum[i] > 0 || v[i] > 0 ? 1.0f : 0.0f;
            }
            first = 0;
        }
        dt_status s = ps_step(ps, ps->sum, 1.0f / (float)live);
        if (s != DT_OK)
            return s;
        ps_apply_sparse_step(ps, ps->applied, 1.0f / (float)live);
        ps->applied++;
        if ((s = ps_checkpoint_due(ps)) != DT_OK)
            return s;
        for (int w = 0; w < ps->W; w++)   /* their next requests may come in now */
            if (ps->peers[w].state == 0 && ps->peers[w].parked && ps->peers[w].clock <= ps->applied) {
                ps->peers[w].parked = 0;
                if (ps_post_header(ps, w) != DT_OK)
                    return ps->ctx->last_status;
            }
    }
    return DT_OK;
}

/* Send a pull's answer: the header, and the keys' current values. */
/* The values a pull asks for: dense keys [lo, lo+n) from the pieces, or a
 * table's rows ids. */
static void ps_gather(dt_ps *ps, const ps_msg *req, const int64_t *ids, float *out)
{
    if (req->op == PS_SPULL) {
        const ps_tab *tb = &ps->tabs[req->lo];
        for (int64_t i = 0; i < req->n; i++)
            memcpy(out + i * tb->dim, (const float *)tb->w->data + ids[i] * tb->dim,
                   (size_t)tb->dim * sizeof(float));
        return;
    }
    for (int p = 0; p < ps->npieces; p++) {   /* the pieces' values in [lo, lo+n) */
        int64_t plo = ps->piece_lo[p], phi = plo + dt_tensor_numel(ps->piece[p]);
        int64_t a = req->lo > plo ? req->lo : plo, b = req->lo + req->n < phi ? req->lo + req->n : phi;
        if (a < b)
            ps->sctx->be_iface->copy(ps->sctx->be, out + (a - req->lo),
                                     (const float *)ps->piece[p]->data + (a - plo),
                                     (size_t)(b - a) * sizeof(float));
    }
}

/* Post the next pieces of answer r while it has free slots (none once
 * its worker was dropped: nobody will take them). */
static dt_status ps_reply_fill(dt_ps *ps, ps_reply *r)
{
    dt_comm *c = ps->comm;
    char err[256] = "";
    for (int i = 0; i < PS_WINDOW && r->posted < r->pieces && !r->stopped; i++) {
        if (r->busy[i])
            continue;
        dt_xfer *x = &r->data_x[i];
        memset(x, 0, sizeof *x);
        x->user = r;
        size_t len = r->bytes ? ps_piece_len(r->bytes, r->chunk, r->posted) : 0;
        char *buf = (char *)r->data + (r->bytes ? (size_t)r->posted * r->chunk : 0);
        if (c->tp_iface->send(c->tp, r->worker, ps_tag(PS_TAG_RDATA, r->hdr.seq, r->posted), buf,
                              len, x, err, sizeof err) != DT_OK) {
            r->stopped = 1;
            return set_error(ps->ctx, DT_EPEER, "ps_serve: answering worker %d: %s", r->worker, err);
        }
        r->busy[i] = 1;
        r->posted++;
    }
    return DT_OK;
}

static dt_status ps_send_answer(dt_ps *ps, int worker, const ps_msg *req, const int64_t *ids,
                                dt_status status, const char *why)
{
    dt_comm *c = ps->comm;
    char err[256] = "";
    ps_reply *r = host_calloc(ps->ctx, sizeof *r);
    if (!r)
        return set_error(ps->ctx, DT_ENOMEM, "ps_serve: out of memory");
    r->hdr = (ps_msg){.magic = PS_MAGIC, .op = req->op, .seq = req->seq,
                      .status = (int32_t)status, .lo = req->lo, .n = req->n, .clock = req->clock,
                      .chunk = req->chunk};
    snprintf(r->hdr.err, sizeof r->hdr.err, "%s", why ? why : "");
    /* the worker waits for the pieces of what it asked for; a refusal sends
     * them empty (its header says why) */
    int64_t asked = req->op == PS_SPULL ? req->n * ps->tabs[req->lo].dim : req->n;
    asked = req->op == PS_SPULL || (asked >= 0 && asked <= ps->G + ps->P) ? asked : 1;
    int64_t n = status != DT_OK ? 0 : asked;
    r->worker = worker;
    r->chunk = req->chunk;
    r->bytes = (size_t)n * sizeof(float);
    r->pieces = (uint32_t)ps_pieces((size_t)asked * sizeof(float), req->chunk);
    r->data = host_alloc(ps->ctx, sizeof(float) * (size_t)(n > 0 ? n : 1));
    if (!r->data) {
        host_free(ps->ctx, r);
        return set_error(ps->ctx, DT_ENOMEM, "ps_serve: out of memory");
    }
    if (n > 0)
        ps_gather(ps, req, ids, r->data);
    r->hdr_x.user = r;
    dt_status s = c->tp_iface->send(c->tp, worker, ps_tag(PS_TAG_RESP, req->seq, 0), &r->hdr,
                                    sizeof r->hdr, &r->hdr_x, err, sizeof err);
    if (s != DT_OK) {   /* nothing posted */
        host_free(ps->ctx, r->data);
        host_free(ps->ctx, r);
        return set_error(ps->ctx, DT_EPEER, "ps_serve: answering worker %d: %s", worker, err);
    }
    r->next = ps->replies;   /* the transport holds the header now: swept when it completes */
    ps->replies = r;
    if ((s = ps_reply_fill(ps, r)) != DT_OK)
        return s;
    ps->st.pulls++;
    if (req->op == PS_SPULL && status == DT_OK)
        ps->st.rows_pulled += req->n;
    return DT_OK;
}

/* Can worker w's pull (it has completed `clock` steps) be answered? */
static int ps_pull_ready(dt_ps *ps, int64_t clock)
{
    if (!ps->initialized)
        return 0;
    int64_t slowest = ps_min_clock(ps);
    if (slowest == INT64_MAX || ps->cfg.mode == DT_PS_ASP)
        return 1;
    int64_t s = ps->cfg.mode == DT_PS_SSP ? ps->cfg.staleness : 0;
    return slowest >= clock - s && (ps->cfg.mode != DT_PS_BSP || ps->applied >= clock);
}

static dt_status ps_answer(dt_ps *ps, int worker, const ps_msg *req, const int64_t *ids)
{
    int64_t slowest = ps_min_clock(ps);
    int64_t stale = slowest == INT64_MAX || slowest < 0 ? 0 : req->clock - slowest;
    stale = stale > 0 ? stale : 0;
    ps->stale_sum += (double)stale;
    ps->stale_n++;
    if (stale > ps->st.max_staleness)
        ps->st.max_staleness = stale;
    ps_msg r = *req;   /* the answer tells the worker how stale it is */
    r.clock = stale;
    return ps_send_answer(ps, worker, &r, ids, DT_OK, NULL);
}

/* Answer the waiting pulls that can be answered now. */
static dt_status ps_answer_waiting(dt_ps *ps)
{
    for (ps_wait **pp = &ps->waits; *pp;) {
        ps_wait *q = *pp;
        if (!ps_pull_ready(ps, q->req.clock)) {
            pp = &q->next;
            continue;
        }
        *pp = q->next;
        dt_status s = ps_answer(ps, q->worker, &q->req, q->ids);
        host_free(ps->ctx, q->ids);
        host_free(ps->ctx, q);
        if (s != DT_OK)
            return s;
    }
    return DT_OK;
}

static dt_status ps_post_header(dt_ps *ps, int w)
{
    dt_comm *c = ps->comm;
    char err[256] = "";
    ps_peer *p = &ps->peers[w];
    memset(&p->hdr_x, 0, sizeof p->hdr_x);
    p->hdr_x.user = p;
    if (c->tp_iface->recv(c->tp, w, ps_tag(PS_TAG_REQ, p->seq, 0), 0, &p->hdr, sizeof p->hdr,
                          &p->hdr_x, err, sizeof err) != DT_OK)
        return set_error(ps->ctx, DT_EPEER, "ps_serve: receive from worker %d: %s", w, err);
    return DT_OK;
}

/* Queue a pull until the slow workers catch up (answered in arrival order);
 * ids (a sparse pull's, may be NULL) become the queue's. */
static dt_status ps_hold_pull(dt_ps *ps, int w, const ps_msg *h, int64_t *ids)
{
    ps_wait *q = host_calloc(ps->ctx, sizeof *q);
    if (!q) {
        host_free(ps->ctx, ids);
        return set_error(ps->ctx, DT_ENOMEM, "ps_serve: out of memory");
    }
    *q = (ps_wait){w, *h, ids, NULL};
    ps_wait **tail = &ps->waits;
    while (*tail)
        tail = &(*tail)->next;
    *tail = q;
    return DT_OK;
}

/* A sparse request's ids (and rows) from worker w arrived. */
static dt_status ps_on_sparse_data(dt_ps *ps, int w)
{
    ps_peer *p = &ps->peers[w];
    const ps_msg *h = &p->hdr;
    ps_tab *tb = &ps->tabs[h->lo];
    int64_t *ids = p->sdata;
    p->sdata = NULL;
    for (int64_t i = 0; i < h->n; i++)
        if (ids[i] < 0 || ids[i] >= tb->count) {
            host_free(ps->ctx, ids);
            return set_error(ps->ctx, DT_EPEER, "ps_serve: worker %d sent row %lld of table '%s', "
                             "which has %lld rows here", w, (long long)ids[i], tb->name,
                             (long long)tb->count);
        }
    if (h->op == PS_SPULL) {
        if (!ps_pull_ready(ps, h->clock))
            return ps_hold_pull(ps, w, h, ids);
        dt_status s = ps_answer(ps, w, h, ids);
        host_free(ps->ctx, ids);
        return s;
    }
    ps->st.pushes++;
    ps->st.rows_pushed += h->n;
    if (ps->cfg.mode != DT_PS_BSP) {   /* applied now, as the dense steps are */
        ps_tab_add(tb, h->n, ids);
        host_free(ps->ctx, ids);
        ps_tab_apply(ps, tb, 1.0f / (float)ps->W);
        return ps_answer_waiting(ps);
    }
    ps_sparse_msg *m = host_calloc(ps->ctx, sizeof *m);
    if (!m) {
        host_free(ps->ctx, ids);
        return set_error(ps->ctx, DT_ENOMEM, "ps_serve: out of memory");
    }
    *m = (ps_sparse_msg){(int)h->lo, h->n, h->clock, ids, NULL};
    ps_sparse_msg **tail = &p->held;   /* kept until its step is applied */
    while (*tail)
        tail = &(*tail)->next;
    *tail = m;
    return DT_OK;
}

/* Read worker w's next request, unless (BSP) its step waits for the others. */
static dt_status ps_next_request(dt_ps *ps, int w)
{
    ps_peer *p = &ps->peers[w];
    /* (a rejoined server that has not heard from everyone lets each finish
     * the step it was in: that may be what the others wait for) */
    if (ps->cfg.mode == DT_PS_BSP && p->clock > (ps->syncing ? p->base : ps->applied)) {
        p->parked = 1;
        return DT_OK;
    }
    return ps_post_header(ps, w);
}

/* Worker w's push (or init) data arrived. */
static dt_status ps_on_data(dt_ps *ps, int w)
{
    ps_peer *p = &ps->peers[w];
    if (p->op == PS_SPUSH || p->op == PS_SPULL)
        return ps_on_sparse_data(ps, w);
    ps->st.pushes++;
    int64_t n = ps_my_floats(ps), gs = n - ps->P;
    if (p->op == PS_CPUSH) {   /* decoded into its place */
        float *dst = p->push + ps_slot(ps, p->data_lo);
        memset(dst, 0, (size_t)p->data_n * sizeof(float));
        grad_decode_add((dt_compress)p->hdr.code, p->sdata, p->data_n, p->hdr.k, dst);
        host_free(ps->ctx, p->sdata);
        p->sdata = NULL;
    }
    if (p->op == PS_INIT) {   /* worker 0's starting values for our keys */
        for (int q = 0; q < ps->npieces && !ps->resumed; q++) {
            int64_t plo = ps->piece_lo[q], phi = plo + dt_tensor_numel(ps->piece[q]);
            int64_t a = p->data_lo > plo ? p->data_lo : plo;
            int64_t b = p->data_lo + p->data_n < phi ? p->data_lo + p->data_n : phi;
            if (a < b)
                ps->sctx->be_iface->copy(ps->sctx->be, (float *)ps->piece[q]->data + (a - plo),
                                         p->push + ps_slot(ps, a), (size_t)(b - a) * sizeof(float));
        }
        ps->init_got += p->data_n;
        ps->initialized = ps->resumed || ps->init_got >= gs;
        return ps_answer_waiting(ps);
    }
    p->got += p->data_n;
    if (p->got < n)
        return DT_OK;
    p->got = 0;
    p->clock++;
    dt_status s;
    if (ps->cfg.mode == DT_PS_BSP) {
        s = ps_apply_bsp(ps);
    } else {
        memcpy(ps->sum, p->push, (size_t)n * sizeof(float));
        s = ps_step(ps, ps->sum, 1.0f / (float)ps->W);
        if (s == DT_OK)
            s = ps_checkpoint_due(ps);
    }
    return s != DT_OK ? s : ps_answer_waiting(ps);
}

/* A sparse request's header arrived: receive its ids (and rows). */
static dt_status ps_recv_sdata(dt_ps *ps, int w, size_t bytes);

static dt_status ps_recv_sparse(dt_ps *ps, int w)
{
    ps_peer *p = &ps->peers[w];
    const ps_msg *h = &p->hdr;
    if (h->lo < 0 || h->lo >= ps->ntables || h->n < 1 || h->n > ps->tabs[h->lo].count)
        return set_error(ps->ctx, DT_EPEER, "ps_serve: worker %d sent a %s of %lld rows of table "
                         "%lld (%d tables)", w, ps_op_names[h->op], (long long)h->n,
                         (long long)h->lo, ps->ntables);
    size_t bytes = (size_t)h->n * (sizeof(int64_t) +
                   (h->op == PS_SPUSH ? (size_t)ps->tabs[h->lo].dim * sizeof(float) : 0));
    return ps_recv_sdata(ps, w, bytes);
}

/* A compressed push's header arrived: receive its code (decoded in
 * ps_on_data). */
static dt_status ps_recv_code(dt_ps *ps, int w)
{
    ps_peer *p = &ps->peers[w];
    const ps_msg *h = &p->hdr;
    int64_t lo = ps->range[ps->shard], hi = ps->range[ps->shard + 1];
    int kind = h->code;
    if (h->lo < lo || h->n < 1 || h->n > hi - h->lo || kind < DT_COMPRESS_BF16 ||
        kind > DT_COMPRESS_INT8 || (kind == DT_COMPRESS_TOPK ? h->k < 1 || h->k > h->n : h->k != 0))
        return set_error(ps->ctx, DT_EPEER, "ps_serve: worker %d sent a compressed push of keys "
                         "[%lld, +%lld) (code %d, %lld entries); this server holds [%lld, %lld)",
                         w, (long long)h->lo, (long long)h->n, kind, (long long)h->k,
                         (long long)lo, (long long)hi);
    p->data_lo = h->lo;
    p->data_n = h->n;
    return ps_recv_sdata(ps, w, ddp_code_bytes((dt_compress)kind, h->n, h->k));
}

/* Post receives for the next pieces of worker w's request data while
 * slots are free. */
static dt_status ps_fill_recv(dt_ps *ps, int w)
{
    dt_comm *c = ps->comm;
    ps_peer *p = &ps->peers[w];
    char err[256] = "";
    for (int i = 0; i < PS_WINDOW && p->data_next < p->data_pieces; i++) {
        if (p->data_busy[i])
            continue;
        dt_xfer *x = &p->data_x[i];
        memset(x, 0, sizeof *x);
        x->user = p;
        size_t off = (size_t)p->data_next * p->hdr.chunk;
        if (c->tp_iface->recv(c->tp, w, ps_tag(PS_TAG_DATA, p->hdr.seq, p->data_next), 0,
                              p->data_buf + off, ps_piece_len(p->data_bytes, p->hdr.chunk,
                                                              p->data_next),
                              x, err, sizeof err) != DT_OK)
            return set_error(ps->ctx, DT_EPEER, "ps_serve: receive from worker %d: %s", w, err);
        p->data_busy[i] = 1;
        p->data_piece[i] = p->data_next++;
    }
    return DT_OK;
}

/* Receive `bytes` of worker w's current request into buf, in pieces of
 * the request's chunk; ps_on_data runs when the last one is in. */
static dt_status ps_recv_pieces(dt_ps *ps, int w, void *buf, size_t bytes)
{
    ps_peer *p = &ps->peers[w];
    if (ps_pieces(bytes, p->hdr.chunk) > PS_MAX_PIECES)
        return set_error(ps->ctx, DT_EPEER, "ps_serve: worker %d sent a request of %zu bytes in "
                         "pieces of %u", w, bytes, p->hdr.chunk);
    p->data_buf = buf;
    p->data_bytes = bytes;
    p->data_pieces = (uint32_t)ps_pieces(bytes, p->hdr.chunk);
    p->data_next = p->data_got = 0;
    if (p->data_pieces == 0) {   /* nothing to wait for */
        dt_status s = ps_on_data(ps, w);
        return s != DT_OK ? s : ps_next_request(ps, w);
    }
    return ps_fill_recv(ps, w);
}

/* A piece of worker w's request data arrived in receive slot i. */
static dt_status ps_on_piece(dt_ps *ps, int w, int i)
{
    ps_peer *p = &ps->peers[w];
    size_t want = ps_piece_len(p->data_bytes, p->hdr.chunk, p->data_piece[i]);
    p->data_busy[i] = 0;
    if (p->data_x[i].len != want)
        return set_error(ps->ctx, DT_EPEER, "ps_serve: worker %d sent %zu bytes as piece %u of "
                         "its %s data, %zu expected", w, p->data_x[i].len, p->data_piece[i],
                         ps_op_names[p->op], want);
    if (++p->data_got < p->data_pieces)
        return ps_fill_recv(ps, w);
    dt_status s = ps_on_data(ps, w);
    return s != DT_OK ? s : ps_next_request(ps, w);
}

/* Receive `bytes` of worker w's current request into p->sdata. */
static dt_status ps_recv_sdata(dt_ps *ps, int w, size_t bytes)
{
    ps_peer *p = &ps->peers[w];
    if (!(p->sdata = host_alloc(ps->ctx, bytes)))
        return set_error(ps->ctx, DT_ENOMEM, "ps_serve: out of memory for %zu bytes", bytes);
    return ps_recv_pieces(ps, w, p->sdata, bytes);
}

/* A rejoined server (18.6) has heard from every live worker: its steps
 * count from the slowest one's, and the job goes on. */
static dt_status ps_sync(dt_ps *ps)
{
    if (!ps->syncing || ps_min_clock(ps) < 0)
        return DT_OK;
    ps->syncing = 0;
    ps->applied = INT64_MAX;   /* the slowest step any live worker said hello at */
    for (int w = 0; w < ps->W; w++)
        if (ps->peers[w].state == 0 && ps->peers[w].base < ps->applied)
            ps->applied = ps->peers[w].base;
    ps->applied = ps->applied == INT64_MAX ? 0 : ps->applied;
    for (int w = 0; w < ps->W; w++)   /* parked while we waited: their steps are in */
        if (ps->peers[w].state == 0 && ps->peers[w].parked && ps->peers[w].clock <= ps->applied) {
            ps->peers[w].parked = 0;
            if (ps_post_header(ps, w) != DT_OK)
                return ps->ctx->last_status;
        }
    dt_status s = ps->cfg.mode == DT_PS_BSP ? ps_apply_bsp(ps) : DT_OK;
    return s != DT_OK ? s : ps_answer_waiting(ps);
}

/* A worker's first request to a restarted server: the steps it has
 * completed, and how many floats of the next one our predecessor got
 * (lost with it: they count as zeros). */
static dt_status ps_on_hello(dt_ps *ps, int w)
{
    ps_peer *p = &ps->peers[w];
    const ps_msg *h = &p->hdr;
    if (!ps->comm->inc || p->clock >= 0 || h->clock < 0 || h->n < 0 || h->n >= ps_my_floats(ps))
        return set_error(ps->ctx, DT_EPEER, "ps_serve: worker %d said hello (step %lld, %lld "
                         "floats in) to a server that %s", w, (long long)h->clock,
                         (long long)h->n, ps->comm->inc ? "knows it already" : "never restarted");
    p->clock = p->base = h->clock;
    p->got = h->n;
    dt_status s = ps_sync(ps);
    return s != DT_OK ? s : ps_next_request(ps, w);
}

/* Worker w's request header arrived. */
static dt_status ps_on_header(dt_ps *ps, int w)
{
    ps_peer *p = &ps->peers[w];
    ps_msg *h = &p->hdr;
    if (p->hdr_x.status != DT_OK || p->hdr_x.len != sizeof *h || h->magic != PS_MAGIC ||
        h->seq != p->seq || h->op < PS_INIT || h->op > PS_CPUSH ||
        (p->clock < 0 && h->op != PS_HELLO) || h->chunk < PS_MIN_CHUNK ||
        h->chunk > ps->comm->max_msg)
        return set_error(ps->ctx, DT_EPEER, "ps_serve: worker %d sent a malformed request", w);
    p->seq++;
    p->op = (int)h->op;
    if (h->op == PS_HELLO)
        return ps_on_hello(ps, w);
    if (h->op == PS_FINISH) {
        p->state = 1;
        dt_status s = ps->cfg.mode == DT_PS_BSP ? ps_apply_bsp(ps) : DT_OK;
        if (s == DT_OK)
            s = ps_sync(ps);
        return s != DT_OK ? s : ps_answer_waiting(ps);
    }
    if (h->op == PS_SPUSH || h->op == PS_SPULL)
        return ps_recv_sparse(ps, w);
    if (h->op == PS_CPUSH)
        return ps_recv_code(ps, w);
    int64_t lo = ps->range[ps->shard], hi = ps->range[ps->shard + 1];
    int flags = h->lo >= ps->G;
    int in_range = h->n >= 0 && (flags ? h->lo + h->n <= ps->G + ps->P
                                       : h->lo >= lo && h->lo + h->n <= hi);
    if (h->op == PS_PULL) {
        dt_status s = DT_OK;
        if (!in_range || flags)
            s = ps_send_answer(ps, w, h, NULL, DT_EINVAL, "pull of keys this server does not hold");
        else if (ps_pull_ready(ps, h->clock))
            s = ps_answer(ps, w, h, NULL);
        else
            s = ps_hold_pull(ps, w, h, NULL);
        return s != DT_OK ? s : ps_post_header(ps, w);
    }
    if (!in_range || (h->op == PS_INIT && (flags || w != 0)))
        return set_error(ps->ctx, DT_EPEER, "ps_serve: worker %d sent %s of keys [%lld, %lld), "
                         "not this server's", w, ps_op_names[h->op], (long long)h->lo,
                         (long long)(h->lo + h->n));
    p->data_lo = h->lo;
    p->data_n = h->n;
    return ps_recv_pieces(ps, w, p->push + ps_slot(ps, h->lo), (size_t)h->n * sizeof(float));
}

/* Cancel the receives posted for worker p. */
static void ps_cancel_peer(dt_ps *ps, ps_peer *p)
{
    dt_comm *c = ps->comm;
    c->tp_iface->cancel(c->tp, &p->hdr_x);
    for (int i = 0; i < PS_WINDOW; i++)
        if (p->data_busy[i])
            c->tp_iface->cancel(c->tp, &p->data_x[i]);
}

/* Worker w died, left without finishing, or stays silent while others
 * wait for it: serve without it. */
static dt_status ps_drop(dt_ps *ps, int w, const char *why)
{
    ps_peer *p = &ps->peers[w];
    if (p->state != 0)
        return DT_OK;
    p->state = 2;
    ps->st.dropped_workers++;
    int live = 0;
    for (int k = 0; k < ps->W; k++)
        live += ps->peers[k].state == 0;
    warn(ps->ctx, "parameter server %d (rank %d): dropped worker %d after %lld steps: %s; "
         "going on with %d worker%s", ps->server, ps->comm->rank, w, (long long)p->clock, why, live,
         live == 1 ? "" : "s");
    for (ps_wait **pp = &ps->waits; *pp;) {   /* its waiting pull goes unanswered */
        ps_wait *q = *pp;
        if (q->worker != w) {
            pp = &q->next;
            continue;
        }
        *pp = q->next;
        host_free(ps->ctx, q->ids);
        host_free(ps->ctx, q);
    }
    ps_free_held(ps, p);
    ps_cancel_peer(ps, p);
    for (ps_reply *r = ps->replies; r; r = r->next)   /* nobody takes their other pieces */
        r->stopped |= r->worker == w;
    dt_status s = ps->cfg.mode == DT_PS_BSP ? ps_apply_bsp(ps) : DT_OK;
    if (s == DT_OK)
        s = ps_sync(ps);
    return s != DT_OK ? s : ps_answer_waiting(ps);
}

/* Is another server dead and not yet back?  Workers wait for its restart
 * (18.6), silent here meanwhile: no reason to drop them. */
static int ps_server_down(dt_ps *ps)
{
    dt_comm *c = ps->comm;
    for (int q = 0; q < ps->S && c->watch; q++) {
        char key[32], val[16];
        size_t len = 0;
        int rank = ps->W + q;
        if (q == ps->server)
            continue;
        dead_key(key, sizeof key, rank, ps_published_inc(c, rank, 1));
        if (dt_store_get(c->watch, key, val, sizeof val, &len, 1) == DT_OK)
            return 1;
    }
    return 0;
}

/* Every DT_COMM_WATCH_S: drop workers the store reports dead, and, while a
 * pull waits, live workers silent for the communicator's timeout. */
static dt_status ps_watch(dt_ps *ps, double *last_seen)
{
    dt_comm *c = ps->comm;
    double now = dt_now();
    int held = ps->waits != NULL;   /* does anyone wait for the others? */
    for (int w = 0; w < ps->W; w++)
        held |= ps->peers[w].state == 0 && ps->peers[w].parked;
    for (int w = 0; w < ps->W; w++) {
        if (ps->peers[w].state != 0)
            continue;
        char key[32], val[16];
        size_t len = 0;
        snprintf(key, sizeof key, "dead/%d", w);
        int dead = c->watch && dt_store_get(c->watch, key, val, sizeof val, &len, 1) == DT_OK;
        snprintf(key, sizeof key, "ps%d/gone/%d", ps->job, w);   /* left without finishing */
        dead = dead || (c->watch && dt_store_get(c->watch, key, val, sizeof val, &len, 1) == DT_OK);
        snprintf(key, sizeof key, "ps%d/done/%d", ps->job, w);   /* finished before we restarted */
        if (ps->peers[w].clock < 0 && c->watch &&
            dt_store_get(c->watch, key, val, sizeof val, &len, 1) == DT_OK) {
            ps->peers[w].state = 1;
            c->tp_iface->cancel(c->tp, &ps->peers[w].hdr_x);
            if (ps_sync(ps) != DT_OK)
                return ps->ctx->last_status;
            continue;
        }
        int waiting = ps->peers[w].parked;   /* one waiting for us is silent by design */
        for (const ps_wait *q = ps->waits; q && !waiting; q = q->next)
            waiting = q->worker == w;
        /* silent while others wait; or, restarted, never heard from (else we
         * would wait forever); but not while it waits for a restarting server */
        double quiet = now - last_seen[w], limit = c->timeout_ms / 1000.0;
        int silent = !waiting && ((held && quiet > limit) ||
                                  (ps->syncing && ps->peers[w].clock < 0 && quiet > 2 * limit)) &&
                     !ps_server_down(ps);
        char why[64];
        snprintf(why, sizeof why, "%s", dead ? "it died or left without finishing" : "");
        if (!dead)
            snprintf(why, sizeof why, "silent for %.1f s while others waited", now - last_seen[w]);
        if ((dead || silent) && ps_drop(ps, w, why) != DT_OK)
            return ps->ctx->last_status;
    }
    return DT_OK;
}

static int ps_is_peer(const dt_ps *ps, const void *user)
{
    return (const char *)user >= (const char *)ps->peers &&
           (const char *)user < (const char *)(ps->peers + ps->W);
}

/* Are sends of answer r still with the transport, or pieces left to go? */
static int ps_reply_busy(const ps_reply *r)
{
    if (!r->hdr_x.done || (r->posted < r->pieces && !r->stopped))
        return 1;
    for (int i = 0; i < PS_WINDOW; i++)
        if (r->busy[i] && !r->data_x[i].done)
            return 1;
    return 0;
}

/* A send of an answer completed: its slot takes the next piece.  (Only
 * ours: a cancelled transfer of an earlier collective may surface here.) */
static dt_status ps_on_sent(dt_ps *ps, dt_xfer *x)
{
    ps_reply *r = ps->replies;
    while (r && r != x->user)
        r = r->next;
    if (!r || x == &r->hdr_x)
        return DT_OK;
    r->busy[x - r->data_x] = 0;
    return ps_reply_fill(ps, r);
}

/* Free the answers whose sends all completed (after a poll's whole batch
 * was looked at: one batch may hold several of an answer's completions). */
static void ps_sweep_replies(dt_ps *ps)
{
    for (ps_reply **pp = &ps->replies; *pp;) {
        ps_reply *r = *pp;
        if (ps_reply_busy(r)) {
            pp = &r->next;
            continue;
        }
        *pp = r->next;
        host_free(ps->ctx, r->data);
        host_free(ps->ctx, r);
    }
}

static dt_status ps_serve_loop(dt_ps *ps, double *last_seen)
{
    dt_comm *c = ps->comm;
    for (int w = 0; w < ps->W; w++) {
        last_seen[w] = dt_now();
        if (ps_post_header(ps, w) != DT_OK)
            return ps->ctx->last_status;
    }
    if (announce_rejoin(c) != DT_OK)   /* a restarted server: workers may come now */
        return ps->ctx->last_status;
    double last_watch = dt_now();
    for (;;) {
        int live = 0;
        for (int w = 0; w < ps->W; w++)
            live += ps->peers[w].state == 0;
        if (!live && !ps->replies)
            return DT_OK;
        dt_xfer *done[16];
        char err[256] = "";
        int k = c->tp_iface->poll(c->tp, done, 16, err, sizeof err);
        if (k < 0)
            return set_error(ps->ctx, DT_EPEER, "ps_serve: transport failure: %s", err);
        for (int i = 0; i < k; i++) {
            dt_xfer *x = done[i];
            if (!ps_is_peer(ps, x->user)) {   /* a piece of an answer sent: the next one */
                if (ps_on_sent(ps, x) != DT_OK)
                    return ps->ctx->last_status;
                continue;   /* (answers are swept below) */
            }
            ps_peer *p = x->user;
            int w = (int)(p - ps->peers);
            last_seen[w] = dt_now();
            dt_status s = DT_OK;
            if (p->state != 0)
                continue;   /* a cancelled receive of a dropped worker */
            if (x->status != DT_OK)
                s = ps_drop(ps, w, "a transfer with it failed");
            else if (x == &p->hdr_x)
                s = ps_on_header(ps, w);
            else
                s = ps_on_piece(ps, w, (int)(x - p->data_x));
            if (s != DT_OK)
                return s;
        }
        ps_sweep_replies(ps);
        if (k == 0) {
            if (dt_now() - last_watch > DT_COMM_WATCH_S) {
                last_watch = dt_now();
                if (ps_watch(ps, last_seen) != DT_OK)
                    return ps->ctx->last_status;
            }
            c->tp_iface->wait(c->tp, 20);
        }
    }
}

/* Transfers of ours the transport still holds. */
static int ps_outstanding(const dt_ps *ps)
{
    for (int w = 0; w < ps->W; w++) {
        const ps_peer *p = &ps->peers[w];
        for (int i = 0; i < PS_WINDOW; i++)
            if (p->data_busy[i] && !p->data_x[i].done)
                return 1;
        if (!p->hdr_x.done)
            return 1;
    }
    return ps->replies != NULL;
}

dt_status dt_ps_serve(dt_ps *ps)
{
    if (!ps)
        return DT_EINVAL;
    if (ps->server < 0)
        return set_error(ps->ctx, DT_ESTATE, "ps_serve: rank %d is a worker", ps->comm->rank);
    dt_comm *c = ps->comm;
    double *last_seen = host_calloc(ps->ctx, sizeof(double) * (size_t)ps->W);
    if (!last_seen)
        return set_error(ps->ctx, DT_ENOMEM, "ps_serve: out of memory");
    pthread_mutex_lock(&c->mu);   /* take the transport from the comm thread */
    while (c->running || c->head)
        pthread_cond_wait(&c->cv, &c->mu);
    int broken = c->broken;
    c->running = !broken;
    pthread_mutex_unlock(&c->mu);
    dt_status s = broken ? set_error(ps->ctx, DT_ESTATE, "ps_serve: communicator failed earlier: %s",
                                     c->broken_msg)
                         : ps_serve_loop(ps, last_seen);
    if (s == DT_OK)   /* the final state, for a job that starts again */
        s = ps_checkpoint(ps);
    for (int w = 0; !broken && w < ps->W; w++)   /* nothing of ours stays posted */
        if (ps->peers[w].state == 0)
            ps_cancel_peer(ps, &ps->peers[w]);
    for (ps_reply *r = ps->replies; r; r = r->next)
        r->stopped = 1;
    /* Cancelled receives complete in a later poll, and after an error
     * answers may still be on their way: give them a second, then close the
     * transport rather than leave it holding what dt_ps_free frees. */
    for (double end = dt_now() + 1.0; !broken && ps_outstanding(ps) && dt_now() < end;) {
        dt_xfer *done[16];
        char err[256];
        int k = c->tp_iface->poll(c->tp, done, 16, err, sizeof err);
        for (int i = 0; i < k; i++)
            if (!ps_is_peer(ps, done[i]->user))
                ps_on_sent(ps, done[i]);   /* (stopped: posts nothing) */
        ps_sweep_replies(ps);
        if (k <= 0)
            c->tp_iface->wait(c->tp, 10);
    }
    if (!broken && ps_outstanding(ps)) {
        c->broken = 1;
        snprintf(c->broken_msg, sizeof c->broken_msg, "%s", ps->ctx->err);
        c->tp_iface->close(c->tp);
        c->tp = NULL;
    }
    pthread_mutex_lock(&c->mu);
    c->running = 0;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    host_free(ps->ctx, last_seen);
    return s;
}

/* With a parameter server (18) the workers alone wrap the model: the
 * servers' keys are the layout dt_ps_new agreed, which is this DDP's. */
static dt_status ddp_ps_check(dt_ctx *ctx, dt_comm *c, const dt_ddp_config *cfg, const dt_optim *opt)
{
    const dt_ps *ps = cfg->ps;
    if (ps->comm != c || ps->ctx != ctx)
        return set_error(ctx, DT_EINVAL, "ddp_new: the parameter server belongs to another "
                         "communicator or context");
    if (ps->server >= 0)
        return set_error(ctx, DT_EINVAL, "ddp_new: rank %d is a parameter server; workers wrap "
                         "the model, servers call dt_ps_serve", c->rank);
    if (ps->nparams != ctx->n_params)
        return set_error(ctx, DT_EMISMATCH, "ddp_new: %d parameters now, %d when dt_ps_new ran",
                         ctx->n_params, ps->nparams);
    if (opt)
        return set_error(ctx, DT_EINVAL, "ddp_new: with a parameter server the servers step "
                         "(dt_ps_config.optim); pass no optimizer");
    return DT_OK;
}

/* --- 18.4 joining and leaving ---------------------------------------------- */

static dt_status ps_settings(dt_ctx *ctx, dt_comm *c, dt_ps_config *cfg, int *W, int *S)
{
    const char *e = getenv("DTRAIN_NUM_SERVERS");
    if (cfg->servers <= 0)
        cfg->servers = e && atoi(e) > 0 ? atoi(e) : 1;
    const char *m = getenv("DTRAIN_PS_MODE");
    if (cfg->mode == DT_PS_BSP && m && *m) {
        if (!strcmp(m, "asp"))
            cfg->mode = DT_PS_ASP;
        else if (!strcmp(m, "ssp"))
            cfg->mode = DT_PS_SSP;
        else if (strcmp(m, "bsp"))
            return set_error(ctx, DT_EINVAL, "ps_new: DTRAIN_PS_MODE='%s' is not bsp, asp or ssp", m);
    }
    const char *st = getenv("DTRAIN_PS_STALENESS");
    if (cfg->staleness == 0 && st && *st)
        cfg->staleness = atoi(st);
    const char *ch = getenv("DTRAIN_PS_CHUNK");
    if (cfg->chunk_bytes == 0 && ch && *ch) {
        char *end;
        unsigned long long v = strtoull(ch, &end, 10);
        if (*end || ch[0] == '-')
            return set_error(ctx, DT_EINVAL, "ps_new: DTRAIN_PS_CHUNK='%s' is not a byte count", ch);
        cfg->chunk_bytes = (size_t)v;
    }
    if (cfg->chunk_bytes != 0 && cfg->chunk_bytes < PS_MIN_CHUNK)
        return set_error(ctx, DT_EINVAL, "ps_new: chunk_bytes %zu is below %zu", cfg->chunk_bytes,
                         PS_MIN_CHUNK);
    if (cfg->mode < DT_PS_BSP || cfg->mode > DT_PS_SSP || cfg->staleness < 0)
        return set_error(ctx, DT_EINVAL, "ps_new: mode %d, staleness %d: need a dt_ps_mode and "
                         "staleness >= 0", (int)cfg->mode, cfg->staleness);
    *S = cfg->servers;
    *W = c->world - *S;
    if (cfg->replicate && (*S < 2 || *S % 2))
        return set_error(ctx, DT_EINVAL, "ps_new: replication pairs the servers: %d servers is not "
                         "an even number >= 2", *S);
    if (*W < 1 || *S > 8)
        return set_error(ctx, *S > 8 ? DT_ENOTSUP : DT_EINVAL, "ps_new: %d servers among %d ranks: "
                         "need at least one worker and at most 8 servers", *S, c->world);
    return DT_OK;
}

/* The first line where two layouts differ, for the error. */
static void ps_first_difference(const char *a, const char *b, char *out, size_t cap)
{
    int line = 0;
    while (*a && *b) {
        const char *ea = strchr(a, '\n'), *eb = strchr(b, '\n');
        if (!ea || !eb || ea - a != eb - b || memcmp(a, b, (size_t)(ea - a)) != 0)
            break;
        a = ea + 1;
        b = eb + 1;
        line++;
    }
    int la = (int)strcspn(a, "\n"), lb = (int)strcspn(b, "\n");
    snprintf(out, cap, "model line %d is '%.*s' here but '%.*s' on worker 0", line + 1,
             la > 80 ? 80 : la, *a ? a : "(none)", lb > 80 ? 80 : lb, *b ? b : "(none)");
}

/* The pieces our messages travel in (dt_ps_config.chunk_bytes, checked
 * by ps_settings): by default the transport's limit, or on shm, where a
 * death must not stop the job, its inject size (18, "Pieces"). */
static void ps_choose_chunk(dt_ps *ps)
{
    dt_comm *c = ps->comm;
    size_t chunk = ps->cfg.chunk_bytes;
    if (chunk == 0)
        chunk = !strcmp(c->provider, "shm") && (ps->cfg.replicate || ps->cfg.checkpoint_dir)
                    ? PS_SHM_CHUNK : c->max_msg;
    chunk = chunk < c->max_msg ? chunk : c->max_msg;
    ps->chunk = chunk < UINT32_MAX ? chunk : (size_t)1 << 31;   /* (the header's field) */
}

static dt_status ps_join_worker(dt_ps *ps, int job)
{
    dt_ctx *ctx = ps->ctx;
    dt_comm *c = ps->comm;
    char key[64];
    if (ctx->n_params < 1)
        return set_error(ctx, DT_EINVAL, "ps_new: worker %d has no parameters (a step is "
                         "counted by its dense push)", c->rank);
    ps->layout = ps_describe(ctx, &ps->cfg);
    if (!ps->layout)
        return ctx->last_status;
    snprintf(key, sizeof key, "ps%d/layout/%d", job, c->rank);
    dt_status s = dt_store_set(c->store, key, ps->layout, strlen(ps->layout) + 1);
    if (s == DT_OK && c->rank != 0) {
        size_t len = 0;
        char *ref = host_alloc(ctx, DT_STORE_MAX_VALUE);
        snprintf(key, sizeof key, "ps%d/layout/0", job);
        s = ref ? dt_store_get(c->store, key, ref, DT_STORE_MAX_VALUE - 1, &len, c->timeout_ms)
                : set_error(ctx, DT_ENOMEM, "ps_new: out of memory");
        if (s == DT_OK) {
            ref[len < DT_STORE_MAX_VALUE ? len : DT_STORE_MAX_VALUE - 1] = '\0';
            if (strcmp(ref, ps->layout) != 0) {
                char diff[240];
                ps_first_difference(ps->layout, ref, diff, sizeof diff);
                s = set_error(ctx, DT_EMISMATCH, "ps_new: worker %d's model differs from worker "
                              "0's: %s", c->rank, diff);
            }
        }
        host_free(ctx, ref);
    }
    if (s == DT_OK)
        s = ps_plan(ps, ps->layout);
    for (int i = 0; s == DT_OK && i < ps->nparams; i++)   /* e.g. a newline in a name */
        if (i >= ctx->n_params || ps->numel[i] != dt_tensor_numel(ctx->params[i]))
            s = set_error(ctx, DT_EINVAL, "ps_new: parameter %d's name cannot be carried in the "
                          "layout (no newlines, please)", i);
    if (s == DT_OK && ps->nparams != ctx->n_params)
        s = set_error(ctx, DT_EINVAL, "ps_new: a parameter name holds a newline");
    if (s != DT_OK)
        return s;
    ps_choose_chunk(ps);
    ps->seq = host_calloc(ctx, sizeof(uint32_t) * (size_t)ps->S);
    ps->gone = host_calloc(ctx, (size_t)ps->S);
    ps->inc = host_calloc(ctx, sizeof(uint32_t) * (size_t)ps->S);
    ps->down_since = host_calloc(ctx, sizeof(double) * (size_t)ps->S);
    ps->sent = host_calloc(ctx, sizeof(int64_t) * (size_t)ps->S);
    ps->sent_clock = host_calloc(ctx, sizeof(int64_t) * (size_t)ps->S);
    ps->stage = host_alloc(ctx, sizeof(float) * (size_t)(ps->G + ps->P + 1));
    if (ps->cfg.prefetch)
        ps->stage2 = host_alloc(ctx, sizeof(float) * (size_t)(ps->G + 1));
    if (!ps->seq || !ps->gone || !ps->inc || !ps->down_since || !ps->sent || !ps->sent_clock ||
        !ps->stage || (ps->cfg.prefetch && !ps->stage2))
        return set_error(ctx, DT_ENOMEM, "ps_new: out of memory for %lld floats",
                         (long long)(ps->G + ps->P));
    if (c->rank == 0) {   /* our values are where everyone starts */
        for (int i = 0; i < ps->nparams; i++)
            be_to_host(ctx, ps->stage + ps->offset[i], ctx->params[i]->data,
                       (size_t)ps->numel[i] * sizeof(float));
        if ((s = ps_call_run(ps, PS_INIT, 0, ps->G, ps->stage)) != DT_OK)
            return s;
    }
    return dt_ps_pull(ps);
}

static dt_status ps_join_server(dt_ps *ps, int job)
{
    dt_ctx *ctx = ps->ctx;
    char key[64];
    size_t len = 0;
    ps->layout = host_alloc(ctx, DT_STORE_MAX_VALUE);
    if (!ps->layout)
        return set_error(ctx, DT_ENOMEM, "ps_new: out of memory");
    snprintf(key, sizeof key, "ps%d/layout/0", job);
    dt_status s = dt_store_get(ps->comm->store, key, ps->layout, DT_STORE_MAX_VALUE - 1, &len,
                               ps->comm->timeout_ms);
    if (s != DT_OK)
        return s;
    ps->layout[len < DT_STORE_MAX_VALUE ? len : DT_STORE_MAX_VALUE - 1] = '\0';
    if ((s = ps_plan(ps, ps->layout)) != DT_OK)
        return s;
    return ps_make_pieces(ps);
}

dt_ps *dt_ps_new(dt_ctx *ctx, dt_comm *c, const dt_ps_config *cfg)
{
    if (!ctx_ok(ctx))
        return NULL;
    if (!c || c->ctx != ctx) {
        set_error(ctx, DT_EINVAL, "ps_new: %s", c ? "the communicator belongs to another context"
                                                  : "communicator is NULL");
        return NULL;
    }
    dt_ps_config conf;
    dt_ps_config_init(&conf);
    if (cfg)
        conf = *cfg;
    int W = 0, S = 0;
    if (ps_settings(ctx, c, &conf, &W, &S) != DT_OK)
        return NULL;
    dt_ps *ps = host_calloc(ctx, sizeof *ps);
    if (!ps) {
        set_error(ctx, DT_ENOMEM, "ps_new: out of memory");
        return NULL;
    }
    int job = c->ps_made++;
    int L = conf.replicate ? S / 2 : S;
    *ps = (dt_ps){.ctx = ctx, .comm = c, .cfg = conf, .W = W, .S = S, .job = job, .L = L,
                  .server = c->rank >= W ? c->rank - W : -1,
                  .shard = c->rank >= W ? (c->rank - W) % L : -1};
    dt_status s = DT_OK;
    if (c->inc && (ps->server < 0 || conf.replicate))   /* 18.6 */
        s = set_error(ctx, DT_ENOTSUP, "ps_new: rank %d is a restarted process; only a server "
                      "without a replica can rejoin a running job (%s)", c->rank,
                      ps->server < 0 ? "a worker's restart is not supported"
                                     : "its twin serves on in its place");
    else
        s = ps->server >= 0 ? ps_join_server(ps, job) : ps_join_worker(ps, job);
    ps->cfg.tables = NULL;   /* borrowed until now */
    ps->cfg.checkpoint_dir = NULL;
    if (s != DT_OK) {
        dt_ps_free(ps);
        return NULL;
    }
    return ps;
}

void dt_ps_free(dt_ps *ps)
{
    if (!ps)
        return;
    dt_ctx *ctx = ps->ctx;
    ps_end_prefetch(ps, 0);
    if (ps->server < 0 && !ps->finished) {   /* (also a worker whose dt_ps_new failed) */
        char key[64];
        snprintf(key, sizeof key, "ps%d/gone/%d", ps->job, ps->comm->rank);
        dt_store_set(ps->comm->store, key, "1", 2);
    }
    for (int w = 0; ps->peers && w < ps->W; w++) {
        host_free(ctx, ps->peers[w].push);
        host_free(ctx, ps->peers[w].sdata);
        ps_free_held(ps, &ps->peers[w]);
    }
    for (int t = 0; ps->tabs && t < ps->ntables; t++) {
        ps_tab *tb = &ps->tabs[t];
        if (tb->w)
            tensor_destroy(ps->sctx, tb->w);
        if (tb->steps_t)
            tensor_destroy(ps->sctx, tb->steps_t);
        for (int j = 0; j < 2; j++)
            if (tb->state[j])
                tensor_destroy(ps->sctx, tb->state[j]);
        host_free(ctx, tb->name);
        host_free(ctx, tb->acc);
        host_free(ctx, tb->slot);
        host_free(ctx, tb->touched);
    }
    host_free(ctx, ps->tabs);
    while (ps->replies) {   /* sends still pending belong to a transport being closed */
        ps_reply *r = ps->replies;
        ps->replies = r->next;
        host_free(ctx, r->data);
        host_free(ctx, r);
    }
    while (ps->waits) {
        ps_wait *q = ps->waits;
        ps->waits = q->next;
        host_free(ctx, q->ids);
        host_free(ctx, q);
    }
    dt_optim_free(ps->opt);
    if (ps->sctx) {
        host_free(ctx, ps->sctx->ckpt_extra);
        ps->sctx->ckpt_extra = NULL;
        ps->sctx->n_ckpt_extra = 0;
    }
    dt_ctx_free(ps->sctx);
    host_free(ctx, ps->ckpt_path);
    host_free(ctx, ps->peers);
    host_free(ctx, ps->sum);
    host_free(ctx, ps->piece);
    host_free(ctx, ps->piece_lo);
    host_free(ctx, ps->piece_param);
    host_free(ctx, ps->numel);
    host_free(ctx, ps->offset);
    host_free(ctx, ps->range);
    host_free(ctx, ps->layout);
    host_free(ctx, ps->seq);
    host_free(ctx, ps->gone);
    host_free(ctx, ps->inc);
    host_free(ctx, ps->down_since);
    host_free(ctx, ps->sent);
    host_free(ctx, ps->sent_clock);
    host_free(ctx, ps->stage);
    host_free(ctx, ps->stage2);
    host_free(ctx, ps);
}

/* ===========================================================================
 * 19. Hogwild!
 *
 * Niu, Recht, Re and Wright's lock-free SGD: K threads, each with its own
 * context (tape, activations, gradients) whose parameters point at the
 * caller's, step the shared parameters with no locks.  Races are the
 * algorithm: on a sparse problem two steps rarely touch the same rows.
 * 2-D parameters get a row log (section 6's embedding backward writes it):
 * while only dt_embedding writes their gradient, a step updates and clears
 * just the rows it used, so a step over a table of millions of rows costs
 * the rows it touches.  Any other op's gradient makes the step dense.
 * ======================================================================== */

typedef struct hw_thread {
    struct hogwild *hw;
    int k;
    dt_ctx *ctx;
    void *model;
    pthread_t tid;
    int started;
    double loss_sum;
    int64_t steps, rows, dense;
} hw_thread;

typedef struct hogwild {
    dt_ctx *ctx;
    dt_hogwild_config cfg;
    dt_hogwild_loss_fn loss;
    void *user;
    hw_thread *t;
    int stop;                  /* atomic: a thread failed */
    pthread_mutex_t mu;
    dt_status status;
    char msg[DT_MAX_ERROR];
} hogwild;

void dt_hogwild_config_init(dt_hogwild_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->threads = 2;
    cfg->steps = 1000;
    cfg->lr = 0.01f;
    dt_config_init(&cfg->thread);
    cfg->thread.threads = 1;
}

/* Thread k's parameters become the caller's: same names and shapes, their
 * memory replaced by the shared one; gradients start at zero. */
static dt_status hw_share(hogwild *hw, hw_thread *t)
{
    dt_ctx *ctx = hw->ctx, *tc = t->ctx;
    if (tc->n_params != ctx->n_params)
        return set_error(ctx, DT_EMISMATCH, "hogwild: thread %d's model has %d parameters, the "
                         "context %d", t->k, tc->n_params, ctx->n_params);
    for (int i = 0; i < ctx->n_params; i++) {
        dt_tensor *p = tc->params[i], *m = ctx->params[i];
        if (strcmp(p->name, m->name) || p->ndim != m->ndim ||
            memcmp(p->shape, m->shape, sizeof(int64_t) * (size_t)p->ndim))
            return set_error(ctx, DT_EMISMATCH, "hogwild: thread %d's parameter %d is '%s', the "
                             "context's '%s' (or the shapes differ)", t->k, i, p->name, m->name);
        if (p->flags & T_OWNS_DATA) {
            tc->persistent_bytes -= tensor_bytes(p);
            tc->be_iface->free(tc->be, p->data);
        }
        p->data = m->data;
        p->flags &= ~(unsigned)T_OWNS_DATA;
        tc->be_iface->memset0(tc->be, p->grad->data, tensor_bytes(p->grad));
        p->grad->flags |= T_ZERO;
        if (p->ndim == 2 && !(p->rowlog = host_calloc(tc, sizeof *p->rowlog)))
            return set_error(ctx, DT_ENOMEM, "hogwild: out of memory");
    }
    return DT_OK;
}

/* SGD on the shared parameters with this step's gradients, then the
 * gradients back to zero: the logged rows only, or everything. */
static dt_status hw_apply(hogwild *hw, hw_thread *t)
{
    dt_ctx *tc = t->ctx;
    const dt_backend_iface *be = tc->be_iface;
    float lr = hw->cfg.lr;
    for (int i = 0; i < tc->n_params; i++) {
        dt_tensor *p = tc->params[i], *g = p->grad;
        row_log *l = p->rowlog;
        if (g->flags & T_ZERO) {
            if (l)
                l->dense = 0;   /* (an op that wrote nothing) */
            continue;
        }
        if (l && !l->dense) {
            int64_t d = p->shape[1];
            /* the error goes in the worker's own ctx: hw_fail reads it from
             * there, and the caller's ctx belongs to the caller's thread */
            if (!l->mark && !(l->mark = host_calloc(tc, (size_t)p->shape[0])))
                return set_error(tc, DT_ENOMEM, "out of memory for a row log's marks");
            for (int64_t j = 0; j < l->n; j++) {
                int64_t r = l->rows[j];
                if (l->mark[r])
                    continue;
                l->mark[r] = 1;
                be->sgd_update(tc->be, d, FP(p) + r * d, FP(g) + r * d, NULL, lr, 0, 0, 0, 0, 0);
                memset(FP(g) + r * d, 0, (size_t)d * sizeof(float));
                t->rows++;
            }
            for (int64_t j = 0; j < l->n; j++)
                l->mark[l->rows[j]] = 0;
        } else {
            int64_t n = shape_numel(p->ndim, p->shape);
            be->sgd_update(tc->be, n, FP(p), FP(g), NULL, lr, 0, 0, 0, 0, 0);
            be->memset0(tc->be, g->data, tensor_bytes(g));
            t->dense++;
        }
        if (l)
            l->n = 0, l->dense = 0;
        g->flags |= T_ZERO;
    }
    return DT_OK;
}

static void hw_fail(hogwild *hw, hw_thread *t, int64_t step)
{
    pthread_mutex_lock(&hw->mu);
    if (hw->status == DT_OK) {
        hw->status = dt_last_status(t->ctx) != DT_OK ? dt_last_status(t->ctx) : DT_EINVAL;
        snprintf(hw->msg, sizeof hw->msg, "hogwild: thread %d, step %lld: %.400s", t->k,
                 (long long)step, t->ctx->err[0] ? t->ctx->err : "the loss function returned NULL");
    }
    pthread_mutex_unlock(&hw->mu);
    __atomic_store_n(&hw->stop, 1, __ATOMIC_RELAXED);
}

static void *hw_main(void *arg)
{
    hw_thread *t = arg;
    hogwild *hw = t->hw;
    int K = hw->cfg.threads;
    for (int64_t s = t->k; s < hw->cfg.steps; s += K) {
        if (__atomic_load_n(&hw->stop, __ATOMIC_RELAXED))
            break;
        dt_tensor *loss = hw->loss(t->ctx, t->model, t->k, s, hw->user);
        if (!loss || dt_backward(t->ctx, loss) != DT_OK || hw_apply(hw, t) != DT_OK) {
            hw_fail(hw, t, s);
            break;
        }
        t->loss_sum += dt_tensor_item(loss);
        t->steps++;
        dt_step_reset(t->ctx);
    }
    return NULL;
}

static void hw_cleanup(hogwild *hw, dt_dp_free_fn free_model)
{
    for (int k = 0; hw->t && k < hw->cfg.threads; k++) {
        if (hw->t[k].model && free_model)
            free_model(hw->t[k].model, hw->user);
        dt_ctx_free(hw->t[k].ctx);
    }
    host_free(hw->ctx, hw->t);
    pthread_mutex_destroy(&hw->mu);
}

dt_status dt_hogwild_run(dt_ctx *ctx, const dt_hogwild_config *cfg, dt_dp_build_fn build,
                         dt_hogwild_loss_fn loss, dt_dp_free_fn free_model, void *user,
                         dt_hogwild_stats *out)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (!cfg || !build || !loss || cfg->threads < 1 || cfg->threads > 1024 || cfg->steps < 0 ||
        !(cfg->lr >= 0))
        return set_error(ctx, DT_EINVAL, "hogwild: need a config with 1..1024 threads, steps >= 0, "
                         "lr >= 0, a build and a loss function");
    if (!ctx->be_iface->host_visible || ctx->n_params < 1)
        return set_error(ctx, ctx->n_params < 1 ? DT_EINVAL : DT_ENOTSUP, "hogwild: %s",
                         ctx->n_params < 1 ? "the context has no parameters to train"
                                           : "the parameters must be in host memory");
    hogwild hw = {.ctx = ctx, .cfg = *cfg, .loss = loss, .user = user};
    pthread_mutex_init(&hw.mu, NULL);
    int K = cfg->threads;
    hw.t = host_calloc(ctx, sizeof *hw.t * (size_t)K);
    dt_status s = hw.t ? DT_OK : set_error(ctx, DT_ENOMEM, "hogwild: out of memory");
    for (int k = 0; s == DT_OK && k < K; k++) {
        dt_config tcfg = cfg->thread;
        tcfg.seed += (uint64_t)k;
        hw_thread *t = &hw.t[k];
        *t = (hw_thread){.hw = &hw, .k = k, .ctx = dt_ctx_new(&tcfg)};
        if (!t->ctx || dt_ctx_status(t->ctx) != DT_OK || !t->ctx->be_iface->host_visible) {
            s = set_error(ctx, DT_EINVAL, "hogwild: thread %d's context: %s", k,
                          t->ctx ? (t->ctx->err[0] ? t->ctx->err : "memory not host-visible")
                                 : "out of memory");
            break;
        }
        if (!(t->model = build(t->ctx, k, user))) {
            s = set_error(ctx, dt_last_status(t->ctx) != DT_OK ? dt_last_status(t->ctx) : DT_EINVAL,
                          "hogwild: building thread %d's model failed: %s", k, t->ctx->err);
            break;
        }
        s = hw_share(&hw, t);
    }
    for (int k = 1; s == DT_OK && k < K; k++) {   /* thread 0 is the caller */
        if (pthread_create(&hw.t[k].tid, NULL, hw_main, &hw.t[k]) != 0) {
            s = set_error(ctx, DT_ENOMEM, "hogwild: cannot start thread %d", k);
            __atomic_store_n(&hw.stop, 1, __ATOMIC_RELAXED);
            break;
        }
        hw.t[k].started = 1;
    }
    if (s == DT_OK)
        hw_main(&hw.t[0]);
    double sum = 0;
    dt_hogwild_stats st = {0};
    for (int k = 0; hw.t && k < K; k++) {
        if (hw.t[k].started)
            pthread_join(hw.t[k].tid, NULL);
        sum += hw.t[k].loss_sum;
        st.steps += hw.t[k].steps;
        st.rows_updated += hw.t[k].rows;
        st.dense_updates += hw.t[k].dense;
    }
    if (s == DT_OK && hw.status != DT_OK)
        s = set_error(ctx, hw.status, "%s", hw.msg);
    st.mean_loss = st.steps ? sum / (double)st.steps : 0.0;
    if (out)
        *out = st;
    hw_cleanup(&hw, free_model);
    return s;
}

/* ===========================================================================
 * 20. Profiler: step breakdowns, timelines, stragglers
 *
 * The compute thread's public calls mark phases (prof_begin/prof_end around
 * dt_loader_next, dt_backward, the DDP's wait, blocking collectives,
 * dt_optim_step); the gaps between them are forward (before a backward) or
 * idle, so a step's phases add up to its wall time by construction.  Only
 * the outermost call counts: a collective inside dt_ddp_step is the step's
 * comm wait, not a second one.  The comm thread and the loader's thread
 * add events under the state's mutex.
 *
 * At the end every rank's totals and events travel to rank 0 in one
 * allgather (each rank's block padded to the largest), which moves them
 * onto its own clock with the offsets the ranks measured against rank 0's
 * store at rendezvous (Cristian's method: the best of 8 round trips, off by
 * at most half that round trip, tens of microseconds on one host).
 * ======================================================================== */

#define PROF_DEFAULT_EVENTS 262144
#define PROF_DEFAULT_THRESHOLD 0.15
#define PROF_DEFAULT_EVERY 20
#define PROF_LINK_FLOATS ((int64_t)2 << 20)   /* the link test: 8 MiB allreduces */

enum { TID_COMPUTE = 1, TID_COMM = 2, TID_LOADER = 3 };
enum { EV_PHASE = 1, EV_STEP, EV_COLL, EV_PS, EV_BATCH, EV_STRAGGLER };
static const char *const phase_names[PH_COUNT] = {"data wait", "forward", "backward",
                                                  "comm wait", "optimizer", "idle"};

static int prof_measuring(const dt_ctx *ctx)
{
    return ctx && __atomic_load_n(&ctx->prof.measure, __ATOMIC_RELAXED);
}

static int prof_recording(const dt_ctx *ctx)
{
    return ctx && __atomic_load_n(&ctx->prof.record, __ATOMIC_RELAXED);
}

static void prof_init(dt_ctx *ctx)
{
    prof_state *p = &ctx->prof;
    pthread_mutex_init(&p->mu, NULL);
    p->straggler = p->warned_rank = -1;
    const char *env = getenv("DTRAIN_PROFILE");
    if (env && *env && strcmp(env, "0") != 0)
        dt_profile_start(ctx, NULL);   /* a failure (no memory) leaves it off, said in ctx */
}

static void prof_release(dt_ctx *ctx)
{
    prof_state *p = &ctx->prof;
    host_free(ctx, p->ev);
    host_free(ctx, p->report);
    host_free(ctx, p->ranks);
    pthread_mutex_destroy(&p->mu);
}

/* Keep an event (under p->mu); past the buffer's end it is only counted. */
static void prof_push(prof_state *p, prof_event e)
{
    if (!p->record)
        return;
    if (p->nev < p->cap)
        p->ev[p->nev++] = e;
    else
        p->dropped++;
}

/* Start of a phase: its start time, 0 when not measuring, -1 when nested
 * in another phase (not counted). */
static double prof_begin(dt_ctx *ctx)
{
    if (!prof_measuring(ctx))
        return 0;
    prof_state *p = &ctx->prof;
    if (p->depth++ > 0)
        return -1;
    return dt_now();
}

static void prof_end(dt_ctx *ctx, int phase, double t0)
{
    if (t0 == 0)
        return;
    prof_state *p = &ctx->prof;
    if (--p->depth > 0 || t0 < 0)
        return;
    double t1 = dt_now();
    if (!p->open) {
        /* a step starts with its data or its backward; what comes before the
         * first (set-up, a DDP's broadcast) belongs to no step */
        if (phase != PH_DATA && phase != PH_BACKWARD && phase != PH_FORWARD)   /* (22 times it) */
            return;
        p->open = 1;
        p->step_t0 = p->mark = t0;
    }
    int gap = phase == PH_BACKWARD ? PH_FORWARD : PH_IDLE;   /* the caller's own time */
    if (t0 > p->mark)
        p->cur[gap] += t0 - p->mark;
    p->cur[phase] += t1 - t0;
    pthread_mutex_lock(&p->mu);
    if (gap == PH_FORWARD && t0 > p->mark)
        prof_push(p, (prof_event){.t0 = p->mark, .t1 = t0, .type = EV_PHASE, .tid = TID_COMPUTE,
                                  .what = PH_FORWARD, .a = p->step_index});
    prof_push(p, (prof_event){.t0 = t0, .t1 = t1, .type = EV_PHASE, .tid = TID_COMPUTE,
                              .what = (uint8_t)phase, .a = p->step_index});
    pthread_mutex_unlock(&p->mu);
    p->mark = t1;
    if (phase == PH_BACKWARD)
        p->had_backward = 1;
}

static void prof_samples(dt_ctx *ctx, int64_t n)
{
    if (prof_measuring(ctx))
        ctx->prof.cur_samples += n;
}

/* dt_step_reset: the step ends if it ran a backward (an evaluation's steps
 * stay inside the training step they interrupt, as idle time). */
static void prof_step_end(dt_ctx *ctx)
{
    prof_state *p = &ctx->prof;
    if (!prof_measuring(ctx) || !p->open || !p->had_backward || p->depth)
        return;
    double t = dt_now();
    p->cur[PH_IDLE] += t - p->mark;
    /* compute, for the ranks' comparison: what grows with the batch (the
     * optimizer costs every rank the same, whatever its share) */
    double total = t - p->step_t0, compute = p->cur[PH_FORWARD] + p->cur[PH_BACKWARD];
    pthread_mutex_lock(&p->mu);
    dt_profile_stats *s = &p->tot;
    s->steps++;
    s->step_s += total;
    s->data_s += p->cur[PH_DATA];
    s->forward_s += p->cur[PH_FORWARD];
    s->backward_s += p->cur[PH_BACKWARD];
    s->comm_wait_s += p->cur[PH_COMM_WAIT];
    s->optimizer_s += p->cur[PH_OPTIM];
    s->idle_s += p->cur[PH_IDLE];
    s->pipe_wait_s += p->cur_pipe;
    s->samples += p->cur_samples;
    p->win_compute += compute;
    p->win_steps++;
    p->win_samples += p->cur_samples;
    prof_push(p, (prof_event){.t0 = p->step_t0, .t1 = t, .type = EV_STEP, .tid = TID_COMPUTE,
                              .a = p->step_index, .b = p->cur_samples});
    pthread_mutex_unlock(&p->mu);
    memset(p->cur, 0, sizeof p->cur);
    p->cur_pipe = 0;
    p->cur_samples = 0;
    p->step_index++;
    p->step_t0 = p->mark = t;
    p->had_backward = 0;
}

/* What the comm thread ran: the algorithm (as 14's dispatch picks it) and
 * the NCCL-style bus factor that turns algbw into busbw (the bytes each
 * link carries, comparable with the link's speed). */
static const char *const coll_algs[] = {"?", "shared segment", "hierarchical", "recursive doubling",
                                        "ring", "binomial tree", "pairwise", "16-bit ring",
                                        "parameter server"};
static int coll_alg(const dt_comm *c, const dt_work *w)
{
    if (w->kind == COLL_PS)
        return 8;
    if (c->use_segment && c->nhosts == 1)
        return 1;
    if (c->use_segment)
        return 2;
    switch (w->kind) {
    case COLL_ALLREDUCE: case COLL_BARRIER: case COLL_ALLREDUCE_SHARED:
        return (size_t)w->n * sizeof(float) <= c->doubling_max || w->n < c->world ? 3 : 4;
    case COLL_BROADCAST: return 5;
    case COLL_ALLTOALL: return 6;
    case COLL_ALLREDUCE16: return 7;
    default: return 4;
    }
}

static double coll_bus_factor(int kind, int P)
{
    if (P <= 1)
        return 0;
    switch (kind) {
    case COLL_ALLREDUCE: case COLL_ALLREDUCE16: case COLL_ALLREDUCE_SHARED:
        return 2.0 * (P - 1) / P;
    case COLL_BROADCAST: return 1.0;
    case COLL_BARRIER: return 0.0;
    default: return (double)(P - 1) / P;
    }
}

static int64_t coll_bytes(const dt_work *w)
{
    return w->kind == COLL_BARRIER ? 0 : w->n * (w->kind == COLL_ALLREDUCE16 ? 2 : 4);
}

static void prof_coll(dt_comm *c, const dt_work *w, double t0, double t1)
{
    dt_ctx *ctx = c->ctx;
    if (!prof_recording(ctx))
        return;
    prof_state *p = &ctx->prof;
    pthread_mutex_lock(&p->mu);
    if (w->kind == COLL_PS) {
        const ps_call *pc = w->aux;
        int pull = pc && (pc->op == PS_PULL || pc->op == PS_SPULL);
        p->tot.ps_calls++;
        p->tot.ps_latency_s += t1 - t0;
        p->tot.comm_s += t1 - t0;
        if (pull && w->status == DT_OK) {
            p->stale_sum += (double)pc->stale;
            p->stale_n++;
            if (pc->stale > p->tot.ps_max_staleness)
                p->tot.ps_max_staleness = pc->stale;
        }
        prof_push(p, (prof_event){.t0 = t0, .t1 = t1, .type = EV_PS, .tid = TID_COMM,
                                  .what = (uint8_t)(pc ? pc->op : 0), .a = w->n,
                                  .b = pull ? pc->stale : -1});
    } else {
        int64_t bytes = coll_bytes(w);
        p->tot.collectives++;
        p->tot.coll_bytes += (uint64_t)bytes;
        p->tot.comm_s += t1 - t0;
        p->bus_bytes += (double)bytes * coll_bus_factor(w->kind, c->world);
        p->coll_s += t1 - t0;
        prof_push(p, (prof_event){.t0 = t0, .t1 = t1, .type = EV_COLL, .tid = TID_COMM,
                                  .what = (uint8_t)w->kind, .alg = (uint8_t)coll_alg(c, w),
                                  .a = bytes, .b = c->world});
    }
    pthread_mutex_unlock(&p->mu);
}

static void prof_batch(dt_ctx *ctx, int64_t samples, double t0, double t1, int on_thread)
{
    if (!prof_recording(ctx))
        return;
    prof_state *p = &ctx->prof;
    pthread_mutex_lock(&p->mu);
    p->batch_s += t1 - t0;
    p->batches++;
    p->batches_prefetched += on_thread != 0;
    prof_push(p, (prof_event){.t0 = t0, .t1 = t1, .type = EV_BATCH,
                              .tid = on_thread ? TID_LOADER : TID_COMPUTE, .a = samples});
    pthread_mutex_unlock(&p->mu);
}

/* --- 20.1 the public side ---------------------------------------------------- */

void dt_profile_config_init(dt_profile_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
}

static void prof_resolve(dt_profile_config *c)
{
    if (c->max_events <= 0)
        c->max_events = PROF_DEFAULT_EVENTS;
    if (!(c->straggler_threshold > 0)) {
        const char *e = getenv("DTRAIN_STRAGGLER");
        double v = e && *e ? strtod(e, NULL) : 0;
        c->straggler_threshold = v > 0 ? v : PROF_DEFAULT_THRESHOLD;
    }
    if (c->check_every <= 0)
        c->check_every = PROF_DEFAULT_EVERY;
}

dt_status dt_profile_start(dt_ctx *ctx, const dt_profile_config *cfg)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    prof_state *p = &ctx->prof;
    dt_profile_config c;
    dt_profile_config_init(&c);
    if (cfg)
        c = *cfg;
    prof_resolve(&c);
    prof_event *ev = host_alloc(ctx, sizeof *ev * (size_t)c.max_events);
    if (!ev)
        return set_error(ctx, DT_ENOMEM, "profile_start: out of memory for %d events",
                         c.max_events);
    pthread_mutex_lock(&p->mu);
    prof_event *old = p->ev;
    p->ev = ev;
    p->cap = c.max_events;
    p->nev = p->dropped = 0;
    p->cfg = c;
    memset(&p->tot, 0, sizeof p->tot);
    p->bus_bytes = p->coll_s = p->stale_sum = p->batch_s = 0;
    p->stale_n = p->batches = p->batches_prefetched = 0;
    p->win_compute = 0;
    p->win_steps = p->win_samples = 0;
    p->straggler = p->warned_rank = -1;
    memset(p->cur, 0, sizeof p->cur);
    p->cur_pipe = 0;
    p->cur_samples = 0;
    p->open = p->had_backward = 0;
    __atomic_store_n(&p->measure, 1, __ATOMIC_RELAXED);
    __atomic_store_n(&p->record, 1, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&p->mu);
    host_free(ctx, old);
    return DT_OK;
}

int dt_profiling(const dt_ctx *ctx) { return prof_recording(ctx); }

static void prof_fill(const prof_state *p, dt_profile_stats *out)
{
    *out = p->tot;
    out->busbw = p->coll_s > 0 ? p->bus_bytes / p->coll_s / 1e9 : 0;
    out->ps_mean_staleness = p->stale_n ? p->stale_sum / (double)p->stale_n : 0;
    out->events = p->nev;
    out->dropped = p->dropped;
}

dt_status dt_profile_get(const dt_ctx *ctx, dt_profile_stats *out)
{
    if (!ctx || !out)
        return DT_EINVAL;
    prof_state *p = (prof_state *)&ctx->prof;
    pthread_mutex_lock(&p->mu);
    prof_fill(p, out);
    pthread_mutex_unlock(&p->mu);
    return DT_OK;
}

const char *dt_profile_report(const dt_ctx *ctx)
{
    return ctx && ctx->prof.report ? ctx->prof.report : "";
}

dt_status dt_profile_rank_stats(const dt_ctx *ctx, int rank, dt_profile_stats *out)
{
    if (!ctx || !out)
        return DT_EINVAL;
    if (!ctx->prof.ranks || rank < 0 || rank >= ctx->prof.nranks)
        return set_error((dt_ctx *)ctx, DT_ESTATE, "profile_rank_stats: no totals for rank %d "
                         "(they are on rank 0 after dt_profile_finish)", rank);
    *out = ctx->prof.ranks[rank];
    return DT_OK;
}

int dt_profile_straggler(const dt_ctx *ctx) { return ctx ? ctx->prof.straggler : -1; }

/* --- 20.2 the ranks' check during training (16 calls it) ------------------ */

/* Each rank's compute per sample over the window: the slowest is a
 * straggler if it is more than the threshold above the (lower) median.  Per sample,
 * so a rank that balancing gave fewer samples is still seen as slow. */
static int prof_find_straggler(const double *per_sample, int P, double threshold, double *median)
{
    double sorted[64];
    int n = 0;
    for (int r = 0; r < P && n < 64; r++)
        if (per_sample[r] > 0)
            sorted[n++] = per_sample[r];
    if (n < 2)
        return -1;
    for (int i = 1; i < n; i++)   /* insertion sort: P is small */
        for (int j = i; j > 0 && sorted[j] < sorted[j - 1]; j--) {
            double t = sorted[j];
            sorted[j] = sorted[j - 1];
            sorted[j - 1] = t;
        }
    /* the lower median: with two ranks, the faster one (the midpoint would
     * halve the gap a slow rank opens) */
    *median = n % 2 ? sorted[n / 2] : sorted[n / 2 - 1];
    int worst = -1;
    for (int r = 0; r < P; r++)
        if (per_sample[r] > *median * (1 + threshold) &&
            (worst < 0 || per_sample[r] > per_sample[worst]))
            worst = r;
    return worst;
}

/* Called by a DDP on every rank at the same step: swap the windows, name a
 * straggler, hand each rank's rate (samples per second of compute) back
 * for balancing (rates: P doubles, 0 where unknown).  DT_OK with nothing
 * done when no rank has a closed step yet. */
static dt_status prof_exchange(dt_ctx *ctx, dt_comm *c, double *rates)
{
    prof_state *p = &ctx->prof;
    int P = c->world;
    float mine[3] = {(float)p->win_compute, (float)p->win_steps, (float)p->win_samples};
    float *all = host_alloc(ctx, sizeof(float) * 3 * (size_t)P);
    double *per = host_alloc(ctx, sizeof(double) * (size_t)P);
    if (!all || !per) {
        host_free(ctx, all);
        host_free(ctx, per);
        return set_error(ctx, DT_ENOMEM, "profiler: out of memory");
    }
    dt_status st = run_collective_wait(c, COLL_ALLGATHER, all, mine, 3, 0, DT_REDUCE_SUM, NULL);
    if (st == DT_OK) {
        p->win_compute = 0;
        p->win_steps = p->win_samples = 0;
        for (int r = 0; r < P; r++) {
            double comp = all[3 * r], samples = all[3 * r + 2];
            per[r] = samples > 0 ? comp / samples : 0;
            rates[r] = comp > 0 ? samples / comp : 0;
        }
        double median = 0;
        int s = prof_find_straggler(per, P, p->cfg.straggler_threshold > 0
                                                ? p->cfg.straggler_threshold
                                                : PROF_DEFAULT_THRESHOLD, &median);
        p->straggler = s;
        if (s >= 0) {
            if (s == c->rank) {
                pthread_mutex_lock(&p->mu);
                p->tot.straggler_warnings++;
                pthread_mutex_unlock(&p->mu);
            }
            double now = dt_now();
            pthread_mutex_lock(&p->mu);
            prof_push(p, (prof_event){.t0 = now, .t1 = now, .type = EV_STRAGGLER,
                                      .tid = TID_COMPUTE, .a = s, .b = (int64_t)(per[s] * 1e9)});
            pthread_mutex_unlock(&p->mu);
            if (s != p->warned_rank)
                warn(ctx, "straggler: rank %d computes %.3f ms per sample, %.0f%% above the "
                     "median %.3f ms of %d ranks (dt_ddp_balance evens this out)", s,
                     per[s] * 1e3, 100 * (per[s] / median - 1), median * 1e3, P);
        }
        p->warned_rank = s;
    }
    host_free(ctx, all);
    host_free(ctx, per);
    return st;
}

/* --- 20.3 the end of the job: gather, trace, report ------------------------- */

typedef struct prof_blob_head {
    uint64_t magic;
    int64_t nev;
    double offset;             /* add to this rank's clock to get rank 0's */
    double batch_s;            /* the loader's time preparing batches */
    int64_t batches, batches_prefetched;
    dt_profile_stats st;
} prof_blob_head;
#define PROF_BLOB_MAGIC 0x50524F46444Eull

/* This rank's totals and events, laid out in floats for the allgather. */
static float *prof_pack(dt_ctx *ctx, double offset, int64_t *nfloats)
{
    prof_state *p = &ctx->prof;
    size_t bytes = sizeof(prof_blob_head) + (size_t)p->nev * sizeof(prof_event);
    *nfloats = (int64_t)((bytes + 3) / 4);
    float *buf = host_calloc(ctx, (size_t)*nfloats * sizeof(float));
    if (!buf)
        return NULL;
    prof_blob_head h = {.magic = PROF_BLOB_MAGIC, .nev = p->nev, .offset = offset,
                        .batch_s = p->batch_s, .batches = p->batches,
                        .batches_prefetched = p->batches_prefetched};
    prof_fill(p, &h.st);
    memcpy(buf, &h, sizeof h);
    if (p->nev)
        memcpy((char *)buf + sizeof h, p->ev, (size_t)p->nev * sizeof(prof_event));
    return buf;
}

/* The link's bandwidth as the profiler compares with: the best of three
 * 8 MiB allreduces (after one to warm up), as bus bandwidth in GB/s. */
static dt_status prof_link_test(dt_ctx *ctx, dt_comm *c, double *busbw)
{
    *busbw = 0;
    float *buf = host_calloc(ctx, (size_t)PROF_LINK_FLOATS * sizeof(float));
    if (!buf)
        return set_error(ctx, DT_ENOMEM, "profile_finish: out of memory for the link test");
    double best = INFINITY;
    dt_status st = DT_OK;
    for (int i = 0; i < 4 && st == DT_OK; i++) {
        double t0 = dt_now();
        st = run_collective_wait(c, COLL_ALLREDUCE, buf, NULL, PROF_LINK_FLOATS, 0,
                                 DT_REDUCE_SUM, NULL);
        double t = dt_now() - t0;
        if (i > 0 && t < best)
            best = t;
    }
    host_free(ctx, buf);
    if (st == DT_OK && best > 0 && best < INFINITY)
        *busbw = coll_bus_factor(COLL_ALLREDUCE, c->world) * (double)PROF_LINK_FLOATS * 4 / best / 1e9;
    return st;
}

static void json_event_head(FILE *f, int *first, const char *ph, int pid, int tid, double ts)
{
    fprintf(f, "%s\n{\"ph\":\"%s\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f", *first ? "" : ",", ph, pid,
            tid, ts);
    *first = 0;
}

static const char *ps_op_name(int op)
{
    switch (op) {
    case PS_PUSH: return "ps push";
    case PS_CPUSH: return "ps push (compressed)";
    case PS_PULL: return "ps pull";
    case PS_SPUSH: return "ps sparse push";
    case PS_SPULL: return "ps sparse pull";
    case PS_INIT: return "ps init";
    case PS_FINISH: return "ps finish";
    default: return "ps call";
    }
}

/* One event as trace-event JSON; ts and dur in microseconds since base. */
static void json_event(FILE *f, int *first, int rank, const prof_event *e, double shift)
{
    double ts = (e->t0 + shift) * 1e6, dur = (e->t1 - e->t0) * 1e6;
    if (e->type == EV_STRAGGLER) {
        json_event_head(f, first, "i", rank, TID_COMPUTE, ts);
        fprintf(f, ",\"s\":\"g\",\"name\":\"straggler: rank %lld\",\"cat\":\"straggler\","
                "\"args\":{\"rank\":%lld,\"compute_ms_per_sample\":%.4f}}",
                (long long)e->a, (long long)e->a, (double)e->b / 1e6);
        return;
    }
    json_event_head(f, first, "X", rank, e->tid, ts);
    fprintf(f, ",\"dur\":%.3f", dur);
    switch (e->type) {
    case EV_PHASE:
        fprintf(f, ",\"name\":\"%s\",\"cat\":\"phase\",\"args\":{\"step\":%lld}}",
                phase_names[e->what < PH_COUNT ? e->what : PH_IDLE], (long long)e->a);
        break;
    case EV_STEP:
        fprintf(f, ",\"name\":\"step %lld\",\"cat\":\"step\",\"args\":{\"step\":%lld,"
                "\"samples\":%lld}}", (long long)e->a, (long long)e->a, (long long)e->b);
        break;
    case EV_COLL: {
        double algbw = dur > 0 ? (double)e->a / (dur * 1e3) : 0;   /* bytes/us/1e3 = GB/s */
        fprintf(f, ",\"name\":\"%s\",\"cat\":\"comm\",\"args\":{\"bytes\":%lld,\"algorithm\":"
                "\"%s\",\"ranks\":%lld,\"algbw_GBps\":%.4f,\"busbw_GBps\":%.4f}}",
                e->what <= COLL_P2P ? coll_names[e->what] : "?", (long long)e->a,
                coll_algs[e->alg < 9 ? e->alg : 0], (long long)e->b, algbw,
                algbw * coll_bus_factor(e->what, (int)e->b));
        break;
    }
    case EV_PS:
        fprintf(f, ",\"name\":\"%s\",\"cat\":\"ps\",\"args\":{\"floats\":%lld,\"latency_ms\":%.4f",
                ps_op_name(e->what), (long long)e->a, dur / 1e3);
        if (e->b >= 0)
            fprintf(f, ",\"staleness\":%lld", (long long)e->b);
        fprintf(f, "}}");
        break;
    default:
        fprintf(f, ",\"name\":\"batch\",\"cat\":\"data\",\"args\":{\"samples\":%lld}}",
                (long long)e->a);
        break;
    }
}

/* Rank 0: the merged trace, every rank's clock moved onto rank 0's and
 * time counted from the earliest event. */
static dt_status prof_write_trace(dt_ctx *ctx, const char *path, float *all, int64_t stride,
                                  int P)
{
    double base = INFINITY;
    for (int r = 0; r < P; r++) {
        const prof_blob_head *h = (const prof_blob_head *)(all + r * stride);
        const prof_event *ev = (const prof_event *)(h + 1);
        for (int64_t i = 0; i < h->nev; i++)
            if (ev[i].t0 + h->offset < base)
                base = ev[i].t0 + h->offset;
    }
    if (!(base < INFINITY))
        base = 0;
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f)
        return set_error(ctx, DT_EIO, "profile_finish: cannot write the trace %s: %s", tmp,
                         strerror(errno));
    static const char *const tnames[] = {"", "compute", "comm", "loader"};
    int first = 1;
    fprintf(f, "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"producer\":\"dtrain %s\","
            "\"ranks\":%d},\"traceEvents\":[", DTRAIN_VERSION_STRING, P);
    for (int r = 0; r < P; r++) {
        const prof_blob_head *h = (const prof_blob_head *)(all + r * stride);
        json_event_head(f, &first, "M", r, 0, 0);
        fprintf(f, ",\"name\":\"process_name\",\"args\":{\"name\":\"rank %d\"}}", r);
        json_event_head(f, &first, "M", r, 0, 0);
        fprintf(f, ",\"name\":\"process_sort_index\",\"args\":{\"sort_index\":%d}}", r);
        for (int t = 1; t <= 3; t++) {
            json_event_head(f, &first, "M", r, t, 0);
            fprintf(f, ",\"name\":\"thread_name\",\"args\":{\"name\":\"%s\"}}", tnames[t]);
            json_event_head(f, &first, "M", r, t, 0);
            fprintf(f, ",\"name\":\"thread_sort_index\",\"args\":{\"sort_index\":%d}}", t);
        }
        const prof_event *ev = (const prof_event *)(h + 1);
        for (int64_t i = 0; i < h->nev; i++)
            json_event(f, &first, r, &ev[i], h->offset - base);
    }
    fprintf(f, "\n]}\n");
    int bad = ferror(f) != 0;
    bad |= fclose(f) != 0;
    if (bad || rename(tmp, path) != 0) {
        unlink(tmp);
        return set_error(ctx, DT_EIO, "profile_finish: writing the trace %s failed", path);
    }
    return DT_OK;
}

static double per_step(double s, int64_t steps) { return steps ? s / (double)steps * 1e3 : 0; }

/* Rank 0's report from every rank's totals. */
static char *prof_build_report(dt_ctx *ctx, const prof_blob_head *const *h, int P, double link,
                               const char *trace_path)
{
    strbuf t = {.ctx = ctx};
    const dt_profile_stats *s0 = &h[0]->st;
    sb_printf(&t, "dtrain profile: %d rank%s, %lld steps on rank 0", P, P > 1 ? "s" : "",
              (long long)s0->steps);
    if (trace_path)
        sb_printf(&t, ", timeline in %s", trace_path);
    sb_printf(&t, "\nper step, ms:\n rank  steps     step     data  forward backward comm wait "
              "optimizer    idle | comm ran  samples/s\n");
    int slow = 0;
    double sum_step = 0;
    for (int r = 0; r < P; r++) {
        const dt_profile_stats *s = &h[r]->st;
        int64_t n = s->steps;
        if (!n) {   /* a parameter server, or a rank that ran no training step */
            sb_printf(&t, "%5d      0   (no training steps%s)\n", r,
                      s->ps_calls ? "" : "; a parameter server serves on its own thread");
            continue;
        }
        sb_printf(&t, "%5d %6lld %8.2f %8.2f %8.2f %8.2f %9.2f %9.2f %7.2f | %8.2f %10.0f\n", r,
                  (long long)n, per_step(s->step_s, n), per_step(s->data_s, n),
                  per_step(s->forward_s, n), per_step(s->backward_s, n),
                  per_step(s->comm_wait_s, n), per_step(s->optimizer_s, n),
                  per_step(s->idle_s, n), per_step(s->comm_s, n),
                  s->step_s > 0 ? (double)s->samples / s->step_s : 0);
        /* in lockstep every rank's step is as long; the slowest is the one
         * busiest in it (the others spend the difference waiting) */
        if (per_step(s->step_s - s->comm_wait_s, n) >
            per_step(h[slow]->st.step_s - h[slow]->st.comm_wait_s, h[slow]->st.steps))
            slow = r;
        sum_step += per_step(s->step_s, n);
    }
    /* the slowest rank and its largest phase */
    const dt_profile_stats *ss = &h[slow]->st;
    double ph[PH_COUNT] = {ss->data_s, ss->forward_s, ss->backward_s, ss->comm_wait_s,
                           ss->optimizer_s, ss->idle_s};
    int big = 0;
    for (int k = 1; k < PH_COUNT; k++)
        big = ph[k] > ph[big] ? k : big;
    if (ss->steps)
        sb_printf(&t, "slowest rank: %d, busy %.2f ms of its %.2f ms step (the rest waiting on "
                  "communication); its largest phase: %s, %.2f ms (%.0f%%)\n", slow,
                  per_step(ss->step_s - ss->comm_wait_s, ss->steps),
                  per_step(ss->step_s, ss->steps), phase_names[big],
                  per_step(ph[big], ss->steps), ss->step_s > 0 ? 100 * ph[big] / ss->step_s : 0);
    /* stragglers: compute per sample against the median, over the whole run */
    double per[64] = {0}, median = 0;
    int Pm = P < 64 ? P : 64;
    for (int r = 0; r < Pm; r++) {
        const dt_profile_stats *s = &h[r]->st;
        per[r] = s->samples ? (s->forward_s + s->backward_s) / (double)s->samples : 0;
    }
    double thr = ctx->prof.cfg.straggler_threshold > 0 ? ctx->prof.cfg.straggler_threshold
                                                       : PROF_DEFAULT_THRESHOLD;
    int strag = prof_find_straggler(per, Pm, thr, &median);
    int any = 0;
    for (int r = 0; r < Pm; r++) {
        if (!(median > 0) || !(per[r] > median * (1 + thr)))
            continue;
        sb_printf(&t, "straggler: rank %d computes %.3f ms per sample, %.0f%% above the median "
                  "%.3f ms of forward and backward (threshold %.0f%%; named in %d checks during "
                  "training)\n", r,
                  per[r] * 1e3, 100 * (per[r] / median - 1), median * 1e3, 100 * thr,
                  h[r]->st.straggler_warnings);
        any = 1;
    }
    if (!any && P > 1)
        sb_printf(&t, "stragglers: none (no rank's compute per sample is %.0f%% above the "
                  "median)\n", 100 * thr);
    /* communication */
    uint64_t bytes = 0;
    double busbw = 0, comm_s = 0, exposed = 0, steps_s = 0;
    int64_t colls = 0, ps_calls = 0;
    for (int r = 0; r < P; r++) {
        bytes += h[r]->st.coll_bytes;
        colls += h[r]->st.collectives;
        comm_s += h[r]->st.comm_s;
        exposed += h[r]->st.comm_wait_s;
        steps_s += h[r]->st.step_s;
        ps_calls += h[r]->st.ps_calls;
    }
    busbw = s0->busbw;
    if (colls)
        sb_printf(&t, "communication: %lld collectives on rank 0, %.1f MB; bus bandwidth %.3f GB/s "
                  "= %.0f%% of the link's %.3f GB/s (8 MiB allreduces, measured at the end); "
                  "%.0f%% of the run's communication time was exposed\n",
                  (long long)s0->collectives, (double)s0->coll_bytes / 1e6, busbw,
                  link > 0 ? 100 * busbw / link : 0, link,
                  comm_s > 0 ? 100 * (exposed < comm_s ? exposed / comm_s : 1.0) : 0);
    if (ps_calls) {
        for (int r = 0; r < P; r++) {
            const dt_profile_stats *s = &h[r]->st;
            if (s->ps_calls)
                sb_printf(&t, "parameter server, rank %d: %lld calls, mean latency %.3f ms; pulls' "
                          "staleness mean %.2f, max %lld\n", r, (long long)s->ps_calls,
                          s->ps_latency_s * 1e3 / (double)s->ps_calls, s->ps_mean_staleness,
                          (long long)s->ps_max_staleness);
        }
    }
    for (int r = 0; r < P; r++) {
        const dt_profile_stats *s = &h[r]->st;
        if (s->pipe_wait_s > 0 && s->step_s > 0)
            sb_printf(&t, "pipeline, rank %d: waits for its neighbours %.1f%% of the step (the "
                      "bubble; ideally %.1f%%)\n", r, 100 * s->pipe_wait_s / s->step_s,
                      100 * s->pipe_bubble_ideal);
    }
    /* hints */
    double tot_step = 0, tot_data = 0, tot_wait = 0, tot_idle = 0;
    for (int r = 0; r < P; r++) {
        tot_step += h[r]->st.step_s;
        tot_data += h[r]->st.data_s;
        tot_wait += h[r]->st.comm_wait_s;
        tot_idle += h[r]->st.idle_s;
    }
    int hints = 0;
    if (tot_step > 0 && tot_wait / tot_step > 0.15) {
        sb_printf(&t, "hint: exposed communication is %.0f%% of the step time: %s%s\n",
                  100 * tot_wait / tot_step,
                  ps_calls ? "pull in the background (dt_ps_config.prefetch), more servers, or "
                             "compression (DTRAIN_COMPRESS=bf16 halves the bytes)"
                           : "larger buckets (dt_ddp_config.bucket_bytes) so fewer, bigger "
                             "allreduces overlap backward, or compression (DTRAIN_COMPRESS=bf16 "
                             "halves the bytes)",
                  strag >= 0 ? "; part of it is the others waiting for the straggler" : "");
        hints++;
    }
    if (tot_step > 0 && tot_data / tot_step > 0.05) {
        double mb = 0;
        int64_t nb = 0, pre = 0;
        for (int r = 0; r < P; r++) {
            mb += h[r]->batch_s;
            nb += h[r]->batches;
            pre += h[r]->batches_prefetched;
        }
        sb_printf(&t, "hint: data wait is %.0f%% of the step time: the loader prepares a batch in "
                  "%.2f ms against a step of %.2f ms; %s\n",
                  100 * tot_data / tot_step, nb ? mb / (double)nb * 1e3 : 0, sum_step / P,
                  nb && pre == nb
                      ? "prefetch is on, so its thread cannot keep up: give it a CPU of its own "
                        "(fewer compute threads per rank) or do less per sample"
                      : "turn on prefetch (dt_loader_config.prefetch) or give the loader more "
                        "CPU (fewer compute threads per rank)");
        hints++;
    }
    if (strag >= 0) {
        sb_printf(&t, "hint: rank %d is a straggler: check its host (CPU quota, other jobs, "
                  "thermal limits), or balance the load (%s)\n", strag,
                  ps_calls ? "dt_loader_steal: idle workers take the slow one's chunks"
                           : "dt_ddp_balance cuts each global batch by measured speed");
        hints++;
    }
    if (tot_step > 0 && tot_idle / tot_step > 0.10) {
        sb_printf(&t, "hint: idle is %.0f%% of the step time: time in the program's own code "
                  "between dtrain calls (evaluation, logging, reading the loss every step)\n",
                  100 * tot_idle / tot_step);
        hints++;
    }
    if (P > 1 && link > 0 && busbw > 0 && busbw < 0.3 * link && bytes > 0 && strag < 0) {
        sb_printf(&t, "hint: collectives ran at %.0f%% of the link's bandwidth: small buckets "
                  "are bound by latency (larger buckets move the same bytes in fewer calls), and "
                  "during training the allreduces share CPU and memory with compute\n",
                  100 * busbw / link);
        hints++;
    }
    double pipe_wait = 0, pipe_ideal = 0;
    for (int r = 0; r < P; r++) {
        pipe_wait += h[r]->st.pipe_wait_s;
        pipe_ideal = h[r]->st.pipe_bubble_ideal > pipe_ideal ? h[r]->st.pipe_bubble_ideal
                                                             : pipe_ideal;
    }
    if (tot_step > 0 && pipe_wait / tot_step > 0.15) {
        sb_printf(&t, "hint: pipeline stages wait for each other %.0f%% of the step time "
                  "(ideally %.0f%%): more micro-batches (dt_pipe_config.micro_batches) shrink the "
                  "bubble; %s\n", 100 * pipe_wait / tot_step, 100 * pipe_ideal,
                  pipe_wait / tot_step > pipe_ideal + 0.1
                      ? "beyond the ideal, the stages are unequal: split by measured time "
                        "(dt_layer_times, dt_pipe_partition)"
                      : "the rest is the schedule's fill and drain");
        hints++;
    }
    if (!hints)
        sb_printf(&t, "no hints: nothing stands out\n");
    if (t.oom) {
        host_free(ctx, t.p);
        return NULL;
    }
    return t.p;
}

dt_status dt_profile_finish(dt_ctx *ctx, dt_comm *c, const char *trace_path)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    prof_state *p = &ctx->prof;
    if (!prof_recording(ctx))
        return DT_OK;
    if (c && c->ctx != ctx)
        return set_error(ctx, DT_EINVAL, "profile_finish: the communicator belongs to another "
                         "context");
    /* stop recording first: the gathers below are not part of the job */
    __atomic_store_n(&p->record, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&p->measure, p->balancing, __ATOMIC_RELAXED);
    if (!trace_path) {
        const char *e = getenv("DTRAIN_TRACE");
        trace_path = e && *e ? e : NULL;
    }
    int P = c ? c->world : 1, rank = c ? c->rank : 0;
    double link = 0;
    dt_status st = c && P > 1 ? prof_link_test(ctx, c, &link) : DT_OK;
    int64_t n = 0;
    pthread_mutex_lock(&p->mu);
    float *mine = st == DT_OK ? prof_pack(ctx, c ? c->clock_offset : 0, &n) : NULL;
    pthread_mutex_unlock(&p->mu);
    if (st == DT_OK && !mine)
        st = set_error(ctx, DT_ENOMEM, "profile_finish: out of memory");
    /* everyone's size, then everyone's block padded to the largest; a rank
     * that failed above still joins, with an empty block (size 0) */
    float nf = (float)(mine ? n : 0), *sizes = host_calloc(ctx, sizeof(float) * (size_t)P);
    float *all = NULL;
    int64_t stride = 0;
    dt_status cs = DT_OK;
    if (!sizes)
        cs = set_error(ctx, DT_ENOMEM, "profile_finish: out of memory");
    else if (c && P > 1)
        cs = run_collective_wait(c, COLL_ALLGATHER, sizes, &nf, 1, 0, DT_REDUCE_SUM, NULL);
    else
        sizes[0] = nf;
    for (int r = 0; cs == DT_OK && r < P; r++)
        stride = (int64_t)sizes[r] > stride ? (int64_t)sizes[r] : stride;
    int ok_all = cs == DT_OK;
    for (int r = 0; ok_all && r < P; r++)
        ok_all = sizes[r] >= (float)(sizeof(prof_blob_head) / 4);
    float *pad = NULL;
    if (cs == DT_OK && stride > 0) {
        pad = host_calloc(ctx, (size_t)stride * sizeof(float));
        all = host_alloc(ctx, (size_t)stride * (size_t)P * sizeof(float));
        if (!pad || !all) {
            /* every rank must still run the allgather: this one sends zeros */
            cs = set_error(ctx, DT_ENOMEM, "profile_finish: out of memory for %lld floats",
                           (long long)(stride * P));
        }
        if (pad && mine)
            memcpy(pad, mine, (size_t)n * sizeof(float));
        if (c && P > 1 && pad && all)
            cs = run_collective_wait(c, COLL_ALLGATHER, all, pad, stride, 0, DT_REDUCE_SUM, NULL);
        else if (pad && all)
            memcpy(all, pad, (size_t)stride * sizeof(float));
    }
    if (st == DT_OK)
        st = cs;
    if (st == DT_OK && !ok_all)
        st = set_error(ctx, DT_EPEER, "profile_finish: a rank could not pack its profile");
    if (st == DT_OK && rank == 0) {
        const prof_blob_head **heads = host_alloc(ctx, sizeof *heads * (size_t)P);
        dt_profile_stats *ranks = host_alloc(ctx, sizeof *ranks * (size_t)P);
        if (!heads || !ranks)
            st = set_error(ctx, DT_ENOMEM, "profile_finish: out of memory");
        for (int r = 0; st == DT_OK && r < P; r++) {
            heads[r] = (const prof_blob_head *)(all + r * stride);
            if (heads[r]->magic != PROF_BLOB_MAGIC ||
                (int64_t)(sizeof(prof_blob_head) + (size_t)heads[r]->nev * sizeof(prof_event)) >
                    stride * 4)
                st = set_error(ctx, DT_EPEER, "profile_finish: rank %d's profile is malformed", r);
            else
                ranks[r] = heads[r]->st, ranks[r].rank = r;
        }
        if (st == DT_OK && trace_path)
            st = prof_write_trace(ctx, trace_path, all, stride, P);
        if (st == DT_OK) {
            char *rep = prof_build_report(ctx, heads, P, link, trace_path);
            if (!rep)
                st = set_error(ctx, DT_ENOMEM, "profile_finish: out of memory for the report");
            host_free(ctx, p->report);
            p->report = rep;
            host_free(ctx, p->ranks);
            p->ranks = ranks;
            p->nranks = P;
            ranks = NULL;
        }
        host_free(ctx, heads);
        host_free(ctx, ranks);
    }
    host_free(ctx, mine);
    host_free(ctx, sizes);
    host_free(ctx, pad);
    host_free(ctx, all);
    return st;
}

/* ===========================================================================
 * 21. Work stealing (the loader's chunks, claimed through the store)
 *
 * Chunk k of shard v is claimed by adding 1 to "steal/<id>/<g>/<v>/<k>" in
 * the rendezvous store (g counts the loader's epoch starts, so a restarted
 * epoch claims afresh): whoever gets 1 has it.  The owner claims its
 * chunks front to back; a thief draws from the shard's back counter
 * ("…/<v>/back") and claims the chunk that far from the end, so owner and
 * thieves meet in the middle and a failed claim means the rest of that
 * side is taken.
 * ======================================================================== */

static int64_t steal_batches_per_shard(const dt_loader *ld)
{
    return ld->cfg.drop_last ? ld->n_local / ld->cfg.batch
                             : (ld->n_local + ld->cfg.batch - 1) / ld->cfg.batch;
}

static void steal_start_epoch(dt_loader *ld, int64_t epoch)
{
    loader_steal *st = ld->steal;
    (void)epoch;   /* the order is the epoch's; the claims are this start's */
    st->gen++;
    st->left = 0;
    st->own_next = 0;
    st->done = st->stolen = 0;
    memset(st->dry, 0, (size_t)ld->cfg.shard_count);
    ld->n_batches = INT64_MAX;   /* until no chunk is left */
}

/* Claim chunk k of shard v: 1 ours, 0 taken, -1 the store failed. */
static int steal_claim(dt_loader *ld, int v, int64_t k)
{
    loader_steal *st = ld->steal;
    char key[96];
    snprintf(key, sizeof key, "steal/%d/%lld/%d/%lld", st->id, (long long)st->gen, v,
             (long long)k);
    int64_t got = 0;
    if (dt_store_add(st->store, key, 1, &got) != DT_OK) {
        st->status = st->errors->last_status;
        snprintf(st->msg, sizeof st->msg, "loader: work stealing: %.400s", st->errors->err);
        return -1;
    }
    return got == 1;
}

/* The next batch to prepare: its shard and index in that shard, or -1. */
static int64_t steal_next(dt_loader *ld, int *shard, int *stolen)
{
    loader_steal *st = ld->steal;
    int W = ld->cfg.shard_count, me = ld->cfg.shard_rank;
    int64_t nb = steal_batches_per_shard(ld), chunks = (nb + st->chunk - 1) / st->chunk;
    while (st->left == 0 && st->status == DT_OK) {
        int v = -1;
        int64_t k = -1;
        if (!st->dry[me]) {   /* our own shard, front to back */
            k = st->own_next++;
            v = me;
        } else {              /* another's, from the back, trying the shards in turn */
            for (int i = 1; i < W && v < 0; i++) {
                int q = (me + i) % W;
                if (st->dry[q])
                    continue;
                char key[96];
                snprintf(key, sizeof key, "steal/%d/%lld/%d/back", st->id, (long long)st->gen, q);
                int64_t j = 0;
                if (dt_store_add(st->store, key, 1, &j) != DT_OK) {
                    st->status = st->errors->last_status;
                    snprintf(st->msg, sizeof st->msg, "loader: work stealing: %.400s",
                             st->errors->err);
                    return -1;
                }
                k = chunks - j;   /* j counts from 1 */
                v = q;
            }
            if (v < 0)
                return -1;   /* every shard is dry: the epoch is over */
        }
        int got = k >= 0 && k < chunks ? steal_claim(ld, v, k) : 0;
        if (got < 0)
            return -1;
        if (!got) {   /* owner and thieves met: nothing more on that side */
            st->dry[v] = 1;
            continue;
        }
        st->shard = v;
        st->first = k * st->chunk;
        st->left = nb - st->first < st->chunk ? nb - st->first : st->chunk;
    }
    if (st->status != DT_OK)
        return -1;
    *shard = st->shard;
    *stolen = st->shard != me;
    st->left--;
    return st->first++;
}

dt_status dt_loader_steal(dt_loader *ld, dt_comm *c, int chunk_batches)
{
    if (!ld)
        return DT_EINVAL;
    dt_ctx *ctx = ld->ctx;
    if (!c || chunk_batches < 1)
        return set_error(ctx, DT_EINVAL, "loader_steal: need a communicator and chunk_batches "
                         ">= 1 (got %d)", chunk_batches);
    if (ld->cfg.global_batches || ld->steal)
        return set_error(ctx, DT_ESTATE, "loader_steal: %s", ld->steal ? "already stealing"
                         : "not with global_batches");
    loader_quiesce(ld);
    loader_steal *st = host_calloc(ctx, sizeof *st);
    if (!st || !(st->dry = host_calloc(ctx, (size_t)ld->cfg.shard_count)) ||
        !(st->errors = host_calloc(ctx, sizeof *st->errors))) {
        if (st) {
            host_free(ctx, st->dry);
            host_free(ctx, st);
        }
        return set_error(ctx, DT_ENOMEM, "loader_steal: out of memory");
    }
    st->errors->al = ctx->al;
    st->chunk = chunk_batches;
    st->id = c->steals_made++;
    /* the loader's thread claims: it needs a connection of its own */
    dt_dist_env e = {.rank = c->rank, .world_size = c->world, .local_rank = -1,
                     .local_world_size = -1, .master_port = dt_store_port(c->store),
                     .launcher = "dtrain"};
    snprintf(e.master_addr, sizeof e.master_addr, "%s", c->store->addr);
    dt_store_config sc;
    dt_store_config_init(&sc);
    sc.token = c->store->token;
    sc.timeout_ms = c->store->timeout_ms;
    st->store = store_open(st->errors, &e, &sc, 0, c->inc);
    if (!st->store) {
        dt_status s = set_error(ctx, st->errors->last_status, "loader_steal: %s", st->errors->err);
        host_free(ctx, st->errors);
        host_free(ctx, st->dry);
        host_free(ctx, st);
        return s;
    }
    ld->steal = st;
    return dt_loader_start_epoch(ld, 0);   /* the whole order, and chunks from 0 */
}

/* ===========================================================================
 * 22. Model parallelism: pipelines and tensor-parallel layers
 *
 * A pipeline stage runs each micro-batch's forward on an empty tape of its
 * own and in arenas of its own: one slot per micro-batch it may hold at once
 * (all m for GPipe, stages - stage for 1F1B), so a micro-batch's backward
 * runs its tape alone, and its memory is reused by a later micro-batch once
 * that backward is done.  Activations and gradients travel through two host
 * buffers of the pipeline's; a step's first activation is preceded by a
 * header (the batch, m, the schedule, the output's shape) so the next stage
 * knows what to receive.  Tensor-parallel ops are autograd ops whose forward
 * or backward is a collective on a host copy.
 * ======================================================================== */

/* --- 22.1 the pipeline's state ----------------------------------------------- */

#define PIPE_MAGIC 7919.0f
#define PIPE_HEADER (5 + DT_MAX_DIMS)   /* magic, B, m, schedule, ndim, shape */

typedef struct pipe_slot {
    dt_arena dev, host;
    int busy;                  /* holds a micro-batch whose backward has not run */
} pipe_slot;

typedef struct pipe_mb {
    int64_t off, rows;         /* its rows of the batch */
    dt_tensor *in;             /* stage > 0: the received activation (a leaf) */
    dt_tensor *out;            /* the stage's output, or the loss on the last stage */
    dt_node *tape;             /* its forward's tape, until its backward */
} pipe_mb;

struct dt_pipe {
    dt_ctx *ctx;
    dt_comm *comm;
    dt_pipe_config cfg;
    dt_stage_fn fn;
    void *user;
    int stage, stages;
    pipe_slot *slots;
    int nslots;
    pipe_mb *mb;
    int failed;                /* a step failed: the neighbours were told, no more steps */
    /* the step under way */
    int64_t batch;
    int in_ndim, out_ndim;     /* the input's (stage > 0) and output's (not last) shapes, */
    int64_t in_shape[DT_MAX_DIMS], out_shape[DT_MAX_DIMS];   /* dim 0: micro-batch 0's rows */
    int header_sent, header_recvd;
    float *sbuf, *rbuf;        /* host staging of what is sent and received */
    int64_t sbuf_n, rbuf_n;
    double loss, wait_s, compute_s;
    uint64_t bytes;
    dt_pipe_stats st;
};

void dt_pipe_config_init(dt_pipe_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->micro_batches = 4;
    cfg->schedule = DT_PIPE_1F1B;
}

static int pipe_last(const dt_pipe *p) { return p->stage == p->stages - 1; }

dt_pipe *dt_pipe_new(dt_ctx *ctx, dt_comm *c, const dt_pipe_config *cfg_in, dt_stage_fn fn,
                     void *user)
{
    if (!ctx_ok(ctx))
        return NULL;
    dt_pipe_config cfg;
    dt_pipe_config_init(&cfg);
    if (cfg_in)
        cfg = *cfg_in;
    if (!c || !fn || c->ctx != ctx) {
        set_error(ctx, DT_EINVAL, "pipe_new: %s", !c ? "communicator is NULL" : !fn
                  ? "stage function is NULL" : "the communicator belongs to another context");
        return NULL;
    }
    if (cfg.micro_batches < 1 || (cfg.schedule != DT_PIPE_GPIPE && cfg.schedule != DT_PIPE_1F1B)) {
        set_error(ctx, DT_EINVAL, "pipe_new: micro_batches %d (must be >= 1) or schedule %d "
                  "unknown", cfg.micro_batches, (int)cfg.schedule);
        return NULL;
    }
    dt_pipe *p = host_calloc(ctx, sizeof *p);
    if (!p) {
        set_error(ctx, DT_ENOMEM, "pipe_new: out of memory");
        return NULL;
    }
    p->ctx = ctx;
    p->comm = c;
    p->cfg = cfg;
    p->fn = fn;
    p->user = user;
    p->stage = c->rank;
    p->stages = c->world;
    int m = cfg.micro_batches, hold = p->stages - p->stage;
    p->nslots = cfg.schedule == DT_PIPE_GPIPE || m < hold ? m : hold;
    p->slots = host_calloc(ctx, sizeof *p->slots * (size_t)p->nslots);
    p->mb = host_calloc(ctx, sizeof *p->mb * (size_t)m);
    if (!p->slots || !p->mb) {
        dt_pipe_free(p);
        set_error(ctx, DT_ENOMEM, "pipe_new: out of memory");
        return NULL;
    }
    for (int i = 0; i < p->nslots; i++) {
        arena_init(&p->slots[i].dev, 1, (size_t)1 << 20);
        arena_init(&p->slots[i].host, 0, (size_t)64 << 10);
    }
    return p;
}

void dt_pipe_free(dt_pipe *p)
{
    if (!p)
        return;
    dt_ctx *ctx = p->ctx;
    for (int i = 0; p->slots && i < p->nslots; i++) {
        arena_destroy(ctx, &p->slots[i].dev);
        arena_destroy(ctx, &p->slots[i].host);
    }
    host_free(ctx, p->slots);
    host_free(ctx, p->mb);
    host_free(ctx, p->sbuf);
    host_free(ctx, p->rbuf);
    host_free(ctx, p);
}

int dt_pipe_stage(const dt_pipe *p) { return p ? p->stage : -1; }
int dt_pipe_stages(const dt_pipe *p) { return p ? p->stages : 0; }

dt_status dt_pipe_stats_get(const dt_pipe *p, dt_pipe_stats *out)
{
    if (!p || !out)
        return DT_EINVAL;
    *out = p->st;
    out->bubble = p->st.step_s > 0 ? p->st.wait_s / p->st.step_s : 0;
    int m = p->cfg.micro_batches;
    out->bubble_ideal = (double)(p->stages - 1) / (double)(m + p->stages - 1);
    return DT_OK;
}

void dt_pipe_stats_reset(dt_pipe *p)
{
    if (p)
        memset(&p->st, 0, sizeof p->st);
}

/* --- 22.2 messages between stages --------------------------------------------- */

static dt_status pipe_reserve(dt_pipe *p, float **buf, int64_t *cap, int64_t n)
{
    if (n <= *cap)
        return DT_OK;
    float *fresh = host_alloc(p->ctx, (size_t)n * sizeof(float));
    if (!fresh)
        return set_error(p->ctx, DT_ENOMEM, "pipe_step: out of host memory for a %lld-float "
                         "message", (long long)n);
    host_free(p->ctx, *buf);
    *buf = fresh;
    *cap = n;
    return DT_OK;
}

static int64_t shape_tail(int ndim, const int64_t *shape)   /* floats per row */
{
    return ndim > 1 ? shape_numel(ndim - 1, shape + 1) : 1;
}

/* Send ns floats of sbuf to dst and/or receive nr into rbuf from src (-1:
 * none), timed as waiting on a neighbour: the bubble. */
static dt_status pipe_p2p(dt_pipe *p, const float *send, int64_t ns, int dst, float *recv,
                          int64_t nr, int src)
{
    dt_ctx *ctx = p->ctx;
    double t0 = prof_begin(ctx), w0 = dt_now();
    dt_status s = p2p_run(p->comm, send, ns, dst, recv, nr, src);
    double w = dt_now() - w0;
    p->wait_s += w;
    if (t0 > 0 && ctx->prof.open)   /* (a wait before the first step opens counts nowhere) */
        ctx->prof.cur_pipe += dt_now() - t0;
    prof_end(ctx, PH_COMM_WAIT, t0);
    if (dst >= 0)
        p->bytes += (uint64_t)ns * sizeof(float);
    return s;
}

static dt_status pipe_xfer(dt_pipe *p, int64_t ns, int dst, int64_t nr, int src)
{
    if (src >= 0 && pipe_reserve(p, &p->rbuf, &p->rbuf_n, nr) != DT_OK)
        return p->ctx->last_status;
    return pipe_p2p(p, dst >= 0 ? p->sbuf : NULL, dst >= 0 ? ns : 0, dst,
                    src >= 0 ? p->rbuf : NULL, src >= 0 ? nr : 0, src);
}

static int64_t pipe_in_floats(const dt_pipe *p, int i)
{
    return p->mb[i].rows * shape_tail(p->in_ndim, p->in_shape);
}

static int64_t pipe_out_floats(const dt_pipe *p, int i)
{
    return p->mb[i].rows * shape_tail(p->out_ndim, p->out_shape);
}

/* The step's header, before its first activation: what follows. */
static dt_status pipe_send_header(dt_pipe *p)
{
    float h[PIPE_HEADER] = {PIPE_MAGIC, (float)p->batch, (float)p->cfg.micro_batches,
                            (float)p->cfg.schedule, (float)p->out_ndim};
    for (int d = 0; d < p->out_ndim; d++)
        h[5 + d] = (float)p->out_shape[d];
    p->header_sent = 1;
    return pipe_p2p(p, h, PIPE_HEADER, p->stage + 1, NULL, 0, -1);
}

static dt_status pipe_recv_header(dt_pipe *p)
{
    dt_ctx *ctx = p->ctx;
    float h[PIPE_HEADER];
    dt_status s = pipe_p2p(p, NULL, 0, -1, h, PIPE_HEADER, p->stage - 1);
    if (s != DT_OK)
        return s;
    p->header_recvd = 1;
    int ndim = (int)h[4];
    if (h[0] != PIPE_MAGIC || ndim < 1 || ndim > DT_MAX_DIMS || !(h[1] >= 1) || h[1] > 16777216.0f)
        return set_error(ctx, DT_EPEER, "pipe_step: stage %d sent a malformed header",
                         p->stage - 1);
    if ((int)h[2] != p->cfg.micro_batches || (int)h[3] != (int)p->cfg.schedule)
        return set_error(ctx, DT_EMISMATCH, "pipe_step: stage %d runs %d micro-batches (%s), "
                         "stage %d %d (%s)", p->stage - 1, (int)h[2], (int)h[3] ? "1F1B" : "GPipe",
                         p->stage, p->cfg.micro_batches, p->cfg.schedule ? "1F1B" : "GPipe");
    if (p->batch > 0 && (int64_t)h[1] != p->batch)
        return set_error(ctx, DT_EMISMATCH, "pipe_step: stage 0's batch has %lld rows, the "
                         "targets here %lld", (long long)h[1], (long long)p->batch);
    p->batch = (int64_t)h[1];
    p->in_ndim = ndim;
    for (int d = 0; d < ndim; d++)
        p->in_shape[d] = (int64_t)h[5 + d];
    return DT_OK;
}

/* --- 22.3 a micro-batch's forward and backward --------------------------------- */

typedef struct pipe_arenas {
    dt_arena *dev, *host;
    dt_node *tape;
} pipe_arenas;

/* Run on micro-batch i's slot and tape (its forward's, or a fresh one). */
static pipe_arenas pipe_enter(dt_pipe *p, int i, dt_node *tape)
{
    dt_ctx *ctx = p->ctx;
    pipe_arenas saved = {ctx->cur_dev, ctx->cur_host, ctx->tape};
    pipe_slot *sl = &p->slots[i % p->nslots];
    ctx->cur_dev = &sl->dev;
    ctx->cur_host = &sl->host;
    ctx->tape = tape;
    return saved;
}

static void pipe_leave(dt_pipe *p, pipe_arenas saved)
{
    p->ctx->cur_dev = saved.dev;
    p->ctx->cur_host = saved.host;
    p->ctx->tape = saved.tape;
}

static dt_status pipe_output_ok(dt_pipe *p, int i, dt_tensor *out, uint64_t errors_before)
{
    dt_ctx *ctx = p->ctx;
    char sb[96];
    if (!out)
        return ctx->errors != errors_before ? ctx->last_status
               : set_error(ctx, DT_EINVAL, "pipe_step: stage %d's function returned NULL for "
                           "micro-batch %d", p->stage, i);
    if (out->ctx != ctx || out->dtype != DT_F32 || !(out->flags & T_REQGRAD))
        return set_error(ctx, DT_EINVAL, "pipe_step: stage %d's output for micro-batch %d %s",
                         p->stage, i, out->ctx != ctx ? "belongs to another context"
                         : out->dtype != DT_F32 ? "is not f32"
                         : "does not require grad (no parameter or input reached it)");
    if (pipe_last(p)) {
        if (shape_numel(out->ndim, out->shape) != 1)
            return set_error(ctx, DT_EINVAL, "pipe_step: the last stage must return the "
                             "micro-batch's loss (one value), got %s", SHAPE(out, sb));
        return DT_OK;
    }
    int same = out->ndim >= 1 && out->shape[0] == p->mb[i].rows;
    if (same && i > 0)
        same = out->ndim == p->out_ndim && !memcmp(out->shape + 1, p->out_shape + 1,
                                                   sizeof(int64_t) * (size_t)(out->ndim - 1));
    if (!same)
        return set_error(ctx, DT_EINVAL, "pipe_step: stage %d's output for micro-batch %d is %s: "
                         "it must have the micro-batch's %lld rows in dim 0%s", p->stage, i,
                         SHAPE(out, sb), (long long)p->mb[i].rows,
                         i > 0 ? " and micro-batch 0's other dims" : "");
    if (i == 0) {
        p->out_ndim = out->ndim;
        memcpy(p->out_shape, out->shape, sizeof(int64_t) * (size_t)out->ndim);
    }
    return DT_OK;
}

static dt_status pipe_forward_run(dt_pipe *p, int i, const dt_tensor *x, const dt_tensor *y)
{
    dt_ctx *ctx = p->ctx;
    pipe_mb *mb = &p->mb[i];
    dt_tensor *xi, *yi = NULL;
    if (p->stage == 0) {
        xi = dt_slice(ctx, (dt_tensor *)x, 0, mb->off, mb->off + mb->rows);
    } else {
        int64_t shape[DT_MAX_DIMS];
        memcpy(shape, p->in_shape, sizeof shape);
        shape[0] = mb->rows;
        if ((xi = step_tensor(ctx, DT_F32, p->in_ndim, shape))) {
            be_to_device(ctx, xi->data, p->rbuf, tensor_bytes(xi));
            xi->flags |= T_REQGRAD;
        }
    }
    if (xi && pipe_last(p))
        yi = dt_slice(ctx, (dt_tensor *)y, 0, mb->off, mb->off + mb->rows);
    if (!xi || (pipe_last(p) && !yi))
        return ctx->last_status;
    mb->in = xi;
    double t0 = prof_begin(ctx), w0 = dt_now();
    uint64_t errors = ctx->errors;
    dt_tensor *out = p->fn(ctx, xi, yi, p->user);
    p->compute_s += dt_now() - w0;
    prof_end(ctx, PH_FORWARD, t0);
    dt_status s = pipe_output_ok(p, i, out, errors);
    if (s != DT_OK)
        return s;
    if (pipe_last(p)) {
        mb->out = out;
        p->loss += (double)dt_tensor_item(out) * (double)mb->rows / (double)p->batch;
        return DT_OK;
    }
    if (!(out = dt_contiguous(ctx, out)))
        return ctx->last_status;
    mb->out = out;
    materialize(out);
    if (pipe_reserve(p, &p->sbuf, &p->sbuf_n, pipe_out_floats(p, i)) != DT_OK)
        return ctx->last_status;
    be_to_host(ctx, p->sbuf, out->data, tensor_bytes(out));
    return DT_OK;
}

/* Account what the slots hold once a forward has added a micro-batch. */
static void pipe_count_held(dt_pipe *p)
{
    int held = 0;
    size_t bytes = 0;
    for (int k = 0; k < p->nslots; k++)
        if (p->slots[k].busy) {
            held++;
            bytes += p->slots[k].dev.used;
        }
    if (held > p->st.in_flight_peak)
        p->st.in_flight_peak = held;
    if (bytes > p->st.act_bytes_peak)
        p->st.act_bytes_peak = bytes;
}

/* Micro-batch i's forward; the input is in rbuf (stage > 0), the output
 * goes to sbuf (not the last stage). */
static dt_status pipe_forward(dt_pipe *p, int i, const dt_tensor *x, const dt_tensor *y)
{
    pipe_slot *sl = &p->slots[i % p->nslots];
    arena_reset(p->ctx, &sl->dev);
    arena_reset(p->ctx, &sl->host);
    sl->busy = 1;
    pipe_arenas saved = pipe_enter(p, i, NULL);
    dt_status s = pipe_forward_run(p, i, x, y);
    p->mb[i].tape = p->ctx->tape;
    pipe_leave(p, saved);
    pipe_count_held(p);
    return s;
}

/* Micro-batch i's backward from the gradient in rbuf (the last stage: from
 * its loss, weighted by its share of the batch); the input's gradient goes
 * to sbuf (stage > 0).  A DDP on the context reduces during the last one. */
static dt_status pipe_backward(dt_pipe *p, int i, int last_mb)
{
    dt_ctx *ctx = p->ctx;
    pipe_mb *mb = &p->mb[i];
    pipe_arenas saved = pipe_enter(p, i, mb->tape);
    const float *seed = NULL;
    dt_status s = DT_OK;
    if (!pipe_last(p)) {
        dt_tensor *g = like(ctx, mb->out);
        if (!g)
            s = ctx->last_status;
        else
            be_to_device(ctx, g->data, p->rbuf, tensor_bytes(g));
        seed = g ? FP(g) : NULL;
    }
    struct dt_ddp *d = ctx->ddp;
    int sync = d ? d->sync : 0;
    if (d)
        d->sync = sync && last_mb;
    double t0 = prof_begin(ctx), w0 = dt_now();
    if (s == DT_OK)
        s = backward_tape(ctx, mb->out, seed, (float)((double)mb->rows / (double)p->batch));
    p->compute_s += dt_now() - w0;
    prof_end(ctx, PH_BACKWARD, t0);
    if (d)
        d->sync = sync;
    mb->tape = NULL;
    if (s == DT_OK && p->stage > 0) {
        int64_t n = pipe_in_floats(p, i);
        dt_tensor *gx = mb->in->grad;
        if (pipe_reserve(p, &p->sbuf, &p->sbuf_n, n) != DT_OK)
            s = ctx->last_status;
        else if (!gx || (gx->flags & T_ZERO))   /* the output did not depend on the input */
            memset(p->sbuf, 0, (size_t)n * sizeof(float));
        else
            be_to_host(ctx, p->sbuf, gx->data, (size_t)n * sizeof(float));
    }
    pipe_leave(p, saved);
    p->slots[i % p->nslots].busy = 0;
    return s;
}

/* --- 22.4 the schedules ------------------------------------------------------ */

static dt_status pipe_recv_fwd(dt_pipe *p, int i)
{
    if (p->stage == 0)
        return DT_OK;
    if (!p->header_recvd) {
        dt_status s = pipe_recv_header(p);
        if (s != DT_OK)
            return s;
    }
    return pipe_xfer(p, 0, -1, pipe_in_floats(p, i), p->stage - 1);
}

static dt_status pipe_send_fwd(dt_pipe *p, int i)
{
    if (pipe_last(p))
        return DT_OK;
    if (!p->header_sent) {
        dt_status s = pipe_send_header(p);
        if (s != DT_OK)
            return s;
    }
    return pipe_xfer(p, pipe_out_floats(p, i), p->stage + 1, 0, -1);
}

static dt_status pipe_recv_bwd(dt_pipe *p, int i)
{
    return pipe_last(p) ? DT_OK : pipe_xfer(p, 0, -1, pipe_out_floats(p, i), p->stage + 1);
}

static dt_status pipe_send_bwd(dt_pipe *p, int i)
{
    return p->stage == 0 ? DT_OK : pipe_xfer(p, pipe_in_floats(p, i), p->stage - 1, 0, -1);
}

/* 1F1B's steady state exchanges with one neighbour in one call (Megatron's
 * send_forward_recv_backward, send_backward_recv_forward): two stages
 * sending to each other at once cannot wait on each other. */
static dt_status pipe_send_fwd_recv_bwd(dt_pipe *p, int f, int b)
{
    return pipe_last(p) ? DT_OK : pipe_xfer(p, pipe_out_floats(p, f), p->stage + 1,
                                            pipe_out_floats(p, b), p->stage + 1);
}

static dt_status pipe_send_bwd_recv_fwd(dt_pipe *p, int b, int f)
{
    return p->stage == 0 ? DT_OK : pipe_xfer(p, pipe_in_floats(p, b), p->stage - 1,
                                             pipe_in_floats(p, f), p->stage - 1);
}

#define PIPE_TRY(call)             \
    do {                           \
        dt_status s_ = (call);     \
        if (s_ != DT_OK)           \
            return s_;             \
    } while (0)

/* GPipe: every forward, then every backward (in the same order, so both
 * schedules add the micro-batches' gradients alike). */
static dt_status pipe_run_gpipe(dt_pipe *p, const dt_tensor *x, const dt_tensor *y)
{
    int m = p->cfg.micro_batches;
    for (int i = 0; i < m; i++) {
        PIPE_TRY(pipe_recv_fwd(p, i));
        PIPE_TRY(pipe_forward(p, i, x, y));
        PIPE_TRY(pipe_send_fwd(p, i));
    }
    for (int i = 0; i < m; i++) {
        PIPE_TRY(pipe_recv_bwd(p, i));
        PIPE_TRY(pipe_backward(p, i, i == m - 1));
        PIPE_TRY(pipe_send_bwd(p, i));
    }
    return DT_OK;
}

/* 1F1B: stage s runs stages-s-1 forwards to fill the pipe, then alternates
 * one forward and one backward, then drains the backwards left. */
static dt_status pipe_run_1f1b(dt_pipe *p, const dt_tensor *x, const dt_tensor *y)
{
    int m = p->cfg.micro_batches, warm = p->stages - p->stage - 1;
    if (warm > m)
        warm = m;
    int rem = m - warm;
    for (int i = 0; i < warm; i++) {
        PIPE_TRY(pipe_recv_fwd(p, i));
        PIPE_TRY(pipe_forward(p, i, x, y));
        PIPE_TRY(pipe_send_fwd(p, i));
    }
    if (rem > 0)
        PIPE_TRY(pipe_recv_fwd(p, warm));
    for (int k = 0; k < rem; k++) {
        int f = warm + k;
        PIPE_TRY(pipe_forward(p, f, x, y));
        PIPE_TRY(p->header_sent || pipe_last(p) ? pipe_send_fwd_recv_bwd(p, f, k)
                                                : DT_ESTATE);   /* warm >= 1 sent it */
        PIPE_TRY(pipe_backward(p, k, k == m - 1));
        if (k == rem - 1)
            PIPE_TRY(pipe_send_bwd(p, k));
        else
            PIPE_TRY(pipe_send_bwd_recv_fwd(p, k, f + 1));
    }
    for (int k = rem; k < m; k++) {
        PIPE_TRY(pipe_recv_bwd(p, k));
        PIPE_TRY(pipe_backward(p, k, k == m - 1));
        PIPE_TRY(pipe_send_bwd(p, k));
    }
    return DT_OK;
}

/* --- 22.5 a step ------------------------------------------------------------ */

static dt_status pipe_args_ok(dt_pipe *p, const dt_tensor *x, const dt_tensor *y)
{
    dt_ctx *ctx = p->ctx;
    if (!ctx->grad_enabled)
        return set_error(ctx, DT_ESTATE, "pipe_step: grad is disabled (a pipeline step trains)");
    p->batch = 0;
    if (p->stage == 0 && (!x || x->ctx != ctx || x->ndim < 1))
        return set_error(ctx, DT_EINVAL, "pipe_step: stage 0 needs the batch's inputs x%s",
                         x ? " (of this context, rows in dim 0)" : "");
    if (pipe_last(p) && (!y || y->ctx != ctx || y->ndim < 1))
        return set_error(ctx, DT_EINVAL, "pipe_step: the last stage needs the batch's targets y%s",
                         y ? " (of this context, rows in dim 0)" : "");
    if (p->stage == 0)
        p->batch = x->shape[0];
    if (pipe_last(p)) {
        if (p->batch && y->shape[0] != p->batch)
            return set_error(ctx, DT_EINVAL, "pipe_step: x has %lld rows, y %lld",
                             (long long)x->shape[0], (long long)y->shape[0]);
        p->batch = y->shape[0];
    }
    if (p->batch && (p->batch < p->cfg.micro_batches || p->batch > 16777216))
        return set_error(ctx, DT_EINVAL, "pipe_step: a batch of %lld rows cannot split into %d "
                         "micro-batches", (long long)p->batch, p->cfg.micro_batches);
    return DT_OK;
}

/* The micro-batches' rows, once the batch is known (stage 0 and the last
 * from their arguments, the others from the header). */
static void pipe_split_rows(dt_pipe *p)
{
    int m = p->cfg.micro_batches;
    int64_t base = p->batch / m, extra = p->batch % m, off = 0;
    for (int i = 0; i < m; i++) {
        p->mb[i].off = off;
        p->mb[i].rows = base + (i < extra);
        off += p->mb[i].rows;
    }
}

/* A failed stage tells the pipeline (as a failed collective does), so its
 * neighbours fail with its words within a watch period, not at the timeout. */
static void pipe_fail(dt_pipe *p, dt_status s)
{
    dt_comm *c = p->comm;
    dt_ctx *ctx = p->ctx;
    p->failed = 1;
    char why[DT_MAX_ERROR + 8], err[DT_MAX_ERROR];
    size_t len = 0;
    snprintf(err, sizeof err, "%s", ctx->err);   /* the store's calls report to ctx too */
    if (c->store && dt_store_get(c->store, "abort", why, sizeof why - 1, &len, 1) != DT_OK) {
        int n = snprintf(why, sizeof why, "%d|%spipeline stage %d failed: %s", (int)s, c->label,
                         p->stage, err);
        dt_store_set(c->store, "abort", why,
                     (size_t)(n < (int)sizeof why ? n : (int)sizeof why - 1) + 1);
    }
    set_error(ctx, s, "%s", err);
}

dt_status dt_pipe_step(dt_pipe *p, const dt_tensor *x, const dt_tensor *y, float *loss_out)
{
    if (loss_out)
        *loss_out = NAN;
    if (!p)
        return DT_EINVAL;
    dt_ctx *ctx = p->ctx;
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (p->failed)
        return set_error(ctx, DT_ESTATE, "pipe_step: an earlier step failed; make a new "
                         "communicator and pipeline");
    double t0 = dt_now();
    p->header_sent = p->header_recvd = 0;
    p->loss = p->wait_s = p->compute_s = 0;
    p->bytes = 0;
    for (int k = 0; k < p->nslots; k++)
        p->slots[k].busy = 0;
    dt_status s = pipe_args_ok(p, x, y);
    if (s == DT_OK && p->stage > 0) {   /* what stage 0 sends: the batch, the first shape */
        s = pipe_recv_header(p);
        if (s == DT_OK && (p->batch < p->cfg.micro_batches))
            s = set_error(ctx, DT_EINVAL, "pipe_step: a batch of %lld rows cannot split into %d "
                          "micro-batches", (long long)p->batch, p->cfg.micro_batches);
    }
    if (s == DT_OK) {
        pipe_split_rows(p);
        if (p->stage > 0 && p->in_shape[0] != p->mb[0].rows)
            s = set_error(ctx, DT_EPEER, "pipe_step: stage %d sent %lld rows for micro-batch 0, "
                          "%lld expected", p->stage - 1, (long long)p->in_shape[0],
                          (long long)p->mb[0].rows);
    }
    if (s == DT_OK)
        s = p->cfg.schedule == DT_PIPE_GPIPE ? pipe_run_gpipe(p, x, y) : pipe_run_1f1b(p, x, y);
    for (int i = 0; i < p->cfg.micro_batches; i++)   /* a failed step's tapes are gone */
        p->mb[i].tape = NULL;
    if (s != DT_OK) {
        pipe_fail(p, s);
        return s;
    }
    double step = dt_now() - t0;
    p->st.steps++;
    p->st.micro_batches += p->cfg.micro_batches;
    p->st.step_s += step;
    p->st.wait_s += p->wait_s;
    p->st.compute_s += p->compute_s;
    p->st.bytes_sent += p->bytes;
    int m = p->cfg.micro_batches;
    pthread_mutex_lock(&ctx->prof.mu);
    ctx->prof.tot.pipe_bubble_ideal = (double)(p->stages - 1) / (double)(m + p->stages - 1);
    pthread_mutex_unlock(&ctx->prof.mu);
    if (loss_out && pipe_last(p))
        *loss_out = (float)p->loss;
    return DT_OK;
}

/* --- 22.6 balanced partitioning ------------------------------------------------ */

/* Layer fn alone, forward and backward once, on a copy of its input that
 * requires grad; in seconds. */
static dt_status layer_time(dt_ctx *ctx, dt_layer_fn fn, void *user, dt_tensor *in, double *out_s)
{
    double t0 = dt_now();
    uint64_t errors = ctx->errors;
    dt_tensor *y = fn(ctx, in, user);
    dt_tensor *loss = y ? dt_sum(ctx, y) : NULL;
    dt_status s = loss ? dt_backward(ctx, loss) : DT_OK;
    if (!loss || s != DT_OK)
        return ctx->errors != errors ? ctx->last_status
               : set_error(ctx, DT_EINVAL, "layer_times: a layer returned NULL");
    float probe;   /* wait for an asynchronous backend's work */
    if (in->grad)
        BE(ctx)->to_host(BEI(ctx), &probe, in->grad->data, sizeof probe);
    else
        (void)dt_tensor_item(loss);
    *out_s = dt_now() - t0;
    dt_step_reset(ctx);
    return DT_OK;
}

static int cmp_double_asc(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Every layer's input, kept as persistent copies (each layer's is the
 * previous one's output, computed without grad). */
static dt_status layer_inputs(dt_ctx *ctx, dt_layer_fn const *layers, void *const *users, int n,
                              const dt_tensor *sample, dt_tensor **in)
{
    int grad = ctx->grad_enabled;
    ctx->grad_enabled = 0;
    dt_tensor *x = (dt_tensor *)sample;
    dt_status s = DT_OK;
    for (int i = 0; i < n && s == DT_OK; i++) {
        if (!(x = dt_contiguous(ctx, x)) ||
            !(in[i] = dt_tensor_new(ctx, x->dtype, x->ndim, x->shape))) {
            s = ctx->last_status;
            break;
        }
        materialize(x);
        BE(ctx)->copy(BEI(ctx), in[i]->data, x->data, tensor_bytes(x));
        if (x->dtype == DT_F32 && (s = dt_tensor_set_requires_grad(in[i], 1)) != DT_OK)
            break;
        uint64_t errors = ctx->errors;
        if (i + 1 < n && !(x = layers[i](ctx, in[i], users ? users[i] : NULL)))
            s = ctx->errors != errors ? ctx->last_status
                : set_error(ctx, DT_EINVAL, "layer_times: layer %d returned NULL", i);
    }
    ctx->grad_enabled = grad;
    return s;
}

dt_status dt_layer_times(dt_ctx *ctx, dt_comm *c, dt_layer_fn const *layers, void *const *users,
                         int n, const dt_tensor *sample, int reps, double *ms_out)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (!layers || !sample || !ms_out || n < 1 || reps < 1 || sample->ctx != ctx ||
        (c && c->ctx != ctx))
        return set_error(ctx, DT_EINVAL, "layer_times: needs layers, a sample of this context, "
                         "n >= 1, reps >= 1 and ms_out (%d layers, %d reps)", n, reps);
    for (int i = 0; i < n; i++)
        if (!layers[i])
            return set_error(ctx, DT_EINVAL, "layer_times: layer %d is NULL", i);
    dt_tensor **in = host_calloc(ctx, sizeof *in * (size_t)n);
    if (!in)
        return set_error(ctx, DT_ENOMEM, "layer_times: out of memory");
    int measure = ctx->prof.measure;   /* these are not training steps */
    struct dt_ddp *ddp = ctx->ddp;     /* nor are their backwards a DDP's */
    ctx->prof.measure = 0;
    ctx->ddp = NULL;
    dt_step_reset(ctx);
    dt_status s = layer_inputs(ctx, layers, users, n, sample, in);
    /* round robin over the layers, one warm-up round: a machine's slow
     * spells then touch every layer alike instead of one layer's runs */
    double *t = s == DT_OK ? host_alloc(ctx, sizeof *t * (size_t)n * (size_t)reps) : NULL;
    if (s == DT_OK && !t)
        s = set_error(ctx, DT_ENOMEM, "layer_times: out of memory");
    for (int r = 0; s == DT_OK && r <= reps; r++)
        for (int i = 0; s == DT_OK && i < n; i++) {
            double sec = 0;
            s = layer_time(ctx, layers[i], users ? users[i] : NULL, in[i], &sec);
            if (r > 0)
                t[(size_t)i * (size_t)reps + (size_t)(r - 1)] = sec;
        }
    for (int i = 0; s == DT_OK && i < n; i++) {
        double *ti = t + (size_t)i * (size_t)reps;
        qsort(ti, (size_t)reps, sizeof *ti, cmp_double_asc);
        ms_out[i] = (reps % 2 ? ti[reps / 2] : (ti[reps / 2 - 1] + ti[reps / 2]) / 2) * 1e3;
    }
    host_free(ctx, t);
    dt_step_reset(ctx);
    dt_zero_grad(ctx);
    for (int i = 0; i < n; i++)
        dt_tensor_free(in[i]);
    host_free(ctx, in);
    ctx->prof.measure = measure;
    ctx->ddp = ddp;
    if (s == DT_OK && c) {   /* the ranks' mean, the same on every rank */
        float *f = host_alloc(ctx, sizeof *f * (size_t)n);
        if (!f)
            return set_error(ctx, DT_ENOMEM, "layer_times: out of memory");
        for (int i = 0; i < n; i++)
            f[i] = (float)ms_out[i];
        s = dt_allreduce(c, f, n, DT_REDUCE_AVG);
        for (int i = 0; s == DT_OK && i < n; i++)
            ms_out[i] = f[i];
        host_free(ctx, f);
    }
    return s;
}

/* The fewest consecutive runs of cost, each totalling at most cap (summed
 * left to right, as everywhere here), starting at layer a. */
static int runs_needed(const double *cost, int a, int n, double cap)
{
    int runs = 0;
    for (int i = a; i < n;) {
        double sum = 0;
        int j = i;
        while (j < n && sum + cost[j] <= cap)
            sum += cost[j++];
        if (j == i)
            return INT_MAX;   /* one layer alone exceeds cap */
        runs++;
        i = j;
    }
    return runs;
}

dt_status dt_pipe_partition(const double *cost, int n, int stages, int *first)
{
    if (!cost || !first || stages < 1 || n < stages)
        return DT_EINVAL;
    double total = 0, big = 0;
    for (int i = 0; i < n; i++) {
        if (!(cost[i] >= 0) || !isfinite(cost[i]))
            return DT_EINVAL;
        total += cost[i];
        big = cost[i] > big ? cost[i] : big;
    }
    /* the least cap that `stages` runs can meet: bisect on doubles until
     * lo (infeasible) and hi (feasible) are neighbours */
    double lo = big, hi = total;
    if (runs_needed(cost, 0, n, lo) <= stages) {
        hi = lo;
    } else {
        for (;;) {
            double mid = lo + (hi - lo) / 2;
            if (!(mid > lo && mid < hi))
                break;
            if (runs_needed(cost, 0, n, mid) <= stages)
                hi = mid;
            else
                lo = mid;
        }
    }
    /* the earliest boundaries that keep every run within hi and leave
     * enough layers and capacity for the stages after */
    first[0] = 0;
    for (int s = 1; s < stages; s++) {
        int j = first[s - 1] + 1;
        while (n - j > stages - s && runs_needed(cost, j, n, hi) > stages - s)
            j++;
        first[s] = j;
    }
    first[stages] = n;
    return DT_OK;
}

/* --- 22.7 tensor parallelism -------------------------------------------------- */

static int tp_ok(dt_ctx *ctx, const char *op, dt_comm *c, const dt_tensor *x)
{
    if (!f32_ok(ctx, op, x, "input"))
        return 0;
    if (!c || c->ctx != ctx) {
        set_error(ctx, DT_EINVAL, "%s: %s", op, c ? "the communicator belongs to another context"
                                                  : "communicator is NULL");
        return 0;
    }
    return 1;
}

/* A host copy of contiguous f32 data (n floats), in the step's host arena. */
static float *tp_to_host(dt_ctx *ctx, const float *dev, int64_t n)
{
    float *h = arena_alloc(ctx, ctx->cur_host, (size_t)(n ? n : 1) * sizeof(float));
    if (!h)
        set_error(ctx, DT_ENOMEM, "out of host memory for a %lld-float message", (long long)n);
    else
        be_to_host(ctx, h, dev, (size_t)n * sizeof(float));
    return h;
}

/* Rows of width k from each of p ranks (rank-major, as allgather gives
 * them) side by side: (p, R, k) -> (R, p*k). */
static void tp_interleave(const float *in, float *out, int p, int64_t rows, int64_t k)
{
    for (int r = 0; r < p; r++)
        for (int64_t i = 0; i < rows; i++)
            memcpy(out + (i * p + r) * k, in + ((int64_t)r * rows + i) * k, (size_t)k * sizeof(float));
}

/* An allgather along the last dim of a (R, k) host matrix into a new step
 * tensor of shape `shape` (last dim p*k). */
static dt_tensor *tp_gather_rows(dt_ctx *ctx, dt_comm *c, const float *h, int64_t rows, int64_t k,
                                 int ndim, const int64_t *shape)
{
    int p = c->world;
    float *all = arena_alloc(ctx, ctx->cur_host, (size_t)(rows * k * p + 1) * sizeof(float));
    float *side = arena_alloc(ctx, ctx->cur_host, (size_t)(rows * k * p + 1) * sizeof(float));
    dt_tensor *y = step_tensor(ctx, DT_F32, ndim, shape);
    if (!all || !side || !y) {
        set_error(ctx, DT_ENOMEM, "tensor parallel: out of memory for a gather");
        return NULL;
    }
    if (dt_allgather(c, h, rows * k, all) != DT_OK)
        return NULL;
    tp_interleave(all, side, p, rows, k);
    be_to_device(ctx, y->data, side, (size_t)(rows * k * p) * sizeof(float));
    return y;
}

static dt_status tp_copy_backward(dt_ctx *ctx, dt_node *n)
{
    int64_t cnt = shape_numel(n->out->ndim, n->out->shape);
    float *h = tp_to_host(ctx, FP(n->out->grad), cnt);
    float *sum = h ? temp_floats(ctx, cnt) : NULL;
    if (!sum)
        return ctx->last_status;
    dt_status s = dt_allreduce(n->aux[0], h, cnt, DT_REDUCE_SUM);
    if (s != DT_OK)
        return s;
    be_to_device(ctx, sum, h, (size_t)cnt * sizeof(float));
    return acc_grad(ctx, n->in[0], sum, 1.0f);
}

dt_tensor *dt_tp_copy(dt_ctx *ctx, dt_comm *c, dt_tensor *x)
{
    if (!tp_ok(ctx, "tp_copy", c, x))
        return NULL;
    dt_tensor *y = view_header(ctx, x);
    if (y && tracks(ctx, x)) {
        dt_node *n = record(ctx, "tp_copy", tp_copy_backward, y, x, NULL, NULL);
        if (!n)
            return NULL;
        n->aux[0] = c;
    }
    return y;
}

static dt_status tp_reduce_backward(dt_ctx *ctx, dt_node *n)
{
    return acc_grad(ctx, n->in[0], FP(n->out->grad), 1.0f);
}

dt_tensor *dt_tp_reduce(dt_ctx *ctx, dt_comm *c, dt_tensor *x)
{
    if (!tp_ok(ctx, "tp_reduce", c, x) || !(x = need_contig(ctx, x)))
        return NULL;
    materialize(x);
    int64_t cnt = shape_numel(x->ndim, x->shape);
    float *h = tp_to_host(ctx, FP(x), cnt);
    dt_tensor *y = h ? like(ctx, x) : NULL;
    if (!y || dt_allreduce(c, h, cnt, DT_REDUCE_SUM) != DT_OK)
        return NULL;
    be_to_device(ctx, y->data, h, (size_t)cnt * sizeof(float));
    if (tracks(ctx, x) && !record(ctx, "tp_reduce", tp_reduce_backward, y, x, NULL, NULL))
        return NULL;
    return y;
}

/* The gradient's columns [rank*k, (rank+1)*k) of its last dim, added to x's. */
static dt_status tp_take_columns(dt_ctx *ctx, dt_tensor *x, const float *g, int rank, int p)
{
    int64_t k = x->shape[x->ndim - 1], rows = shape_numel(x->ndim, x->shape) / (k ? k : 1);
    int acc;
    float *gx = grad_target(ctx, x, &acc);
    if (!gx)
        return ctx->last_status;
    int64_t shape[2] = {rows, k}, ds[2] = {k, 1}, ss[2] = {k * p, 1};
    BE(ctx)->copy_strided(BEI(ctx), 2, shape, 4, gx, ds, g + (int64_t)rank * k, ss, acc);
    return DT_OK;
}

static dt_status tp_gather_backward(dt_ctx *ctx, dt_node *n)
{
    dt_comm *c = n->aux[0];
    return tp_take_columns(ctx, n->in[0], FP(n->out->grad), c->rank, c->world);
}

dt_tensor *dt_tp_gather(dt_ctx *ctx, dt_comm *c, dt_tensor *x)
{
    if (!tp_ok(ctx, "tp_gather", c, x) || !(x = need_contig(ctx, x)))
        return NULL;
    if (x->ndim < 1) {
        set_error(ctx, DT_EINVAL, "tp_gather: needs at least one dimension");
        return NULL;
    }
    materialize(x);
    int64_t k = x->shape[x->ndim - 1], cnt = shape_numel(x->ndim, x->shape);
    int64_t shape[DT_MAX_DIMS];
    memcpy(shape, x->shape, sizeof shape);
    shape[x->ndim - 1] = k * c->world;
    float *h = tp_to_host(ctx, FP(x), cnt);
    dt_tensor *y = h ? tp_gather_rows(ctx, c, h, k ? cnt / k : 0, k, x->ndim, shape) : NULL;
    if (!y)
        return NULL;
    if (tracks(ctx, x)) {
        dt_node *n = record(ctx, "tp_gather", tp_gather_backward, y, x, NULL, NULL);
        if (!n)
            return NULL;
        n->aux[0] = c;
    }
    return y;
}

static dt_status tp_split_backward(dt_ctx *ctx, dt_node *n)
{
    dt_comm *c = n->aux[0];
    dt_tensor *y = n->out, *x = n->in[0];
    int64_t k = y->shape[y->ndim - 1], cnt = shape_numel(y->ndim, y->shape);
    float *h = tp_to_host(ctx, FP(y->grad), cnt);
    dt_tensor *g = h ? tp_gather_rows(ctx, c, h, k ? cnt / k : 0, k, x->ndim, x->shape) : NULL;
    return g ? acc_grad(ctx, x, FP(g), 1.0f) : ctx->last_status;
}

dt_tensor *dt_tp_split(dt_ctx *ctx, dt_comm *c, dt_tensor *x)
{
    if (!tp_ok(ctx, "tp_split", c, x))
        return NULL;
    int64_t last = x->ndim ? x->shape[x->ndim - 1] : 0;
    if (x->ndim < 1 || last % c->world) {
        set_error(ctx, DT_EINVAL, "tp_split: the last dim (%lld) must split evenly over %d ranks",
                  (long long)last, c->world);
        return NULL;
    }
    dt_tensor *v = view_header(ctx, x);   /* this rank's columns, then a contiguous copy */
    if (!v)
        return NULL;
    int64_t k = last / c->world;
    v->shape[x->ndim - 1] = k;
    v->data = FP(x) + (int64_t)c->rank * k * x->stride[x->ndim - 1];
    materialize(x);
    dt_tensor *y = like(ctx, v);
    if (!y)
        return NULL;
    BE(ctx)->copy_strided(BEI(ctx), v->ndim, v->shape, 4, y->data, y->stride, v->data, v->stride, 0);
    if (tracks(ctx, x)) {
        dt_node *n = record(ctx, "tp_split", tp_split_backward, y, x, NULL, NULL);
        if (!n)
            return NULL;
        n->aux[0] = c;
    }
    return y;
}

dt_tensor *dt_tp_linear_col(dt_ctx *ctx, dt_comm *c, dt_tensor *x, dt_tensor *w, dt_tensor *b,
                            int gather_output)
{
    dt_tensor *y = dt_linear(ctx, dt_tp_copy(ctx, c, x), w, b);
    return y && gather_output ? dt_tp_gather(ctx, c, y) : y;
}

dt_tensor *dt_tp_linear_row(dt_ctx *ctx, dt_comm *c, dt_tensor *x, dt_tensor *w, dt_tensor *b,
                            int input_is_split)
{
    if (x && !input_is_split)
        x = dt_tp_split(ctx, c, x);
    dt_tensor *y = dt_tp_reduce(ctx, c, dt_linear(ctx, x, w, NULL));
    return y && b ? dt_add(ctx, y, b) : y;
}

dt_status dt_tp_shard(const dt_comm *c, const dt_tensor *full, int dim, dt_tensor *shard)
{
    if (!shard)
        return DT_EINVAL;
    dt_ctx *ctx = shard->ctx;
    if (!c || !full || full->dtype != shard->dtype || full->ndim != shard->ndim || dim < 0 ||
        dim >= full->ndim || full->shape[dim] % c->world)
        return set_error(ctx, DT_EINVAL, "tp_shard: needs a communicator, and a full tensor of "
                         "shard's dtype whose dim %d splits evenly over the ranks", dim);
    int64_t blk = full->shape[dim] / c->world;
    for (int d = 0; d < full->ndim; d++)
        if (shard->shape[d] != (d == dim ? blk : full->shape[d])) {
            char a[96], b[96];
            return set_error(ctx, DT_EINVAL, "tp_shard: shard is %s, rank %d's block of %s "
                             "along dim %d is not", SHAPE(shard, a), c->rank, SHAPE(full, b), dim);
        }
    size_t es = dt_dtype_size(full->dtype);
    int64_t outer = shape_numel(dim, full->shape);
    int64_t inner = shape_numel(full->ndim - dim - 1, full->shape + dim + 1);
    char *src = host_alloc(ctx, tensor_bytes(full) + 1), *dst = host_alloc(ctx, tensor_bytes(shard) + 1);
    dt_status s = src && dst ? dt_tensor_get(full, src, shape_numel(full->ndim, full->shape))
                             : set_error(ctx, DT_ENOMEM, "tp_shard: out of memory");
    if (s == DT_OK) {
        for (int64_t o = 0; o < outer; o++)
            memcpy(dst + (size_t)(o * blk * inner) * es,
                   src + (size_t)((o * full->shape[dim] + c->rank * blk) * inner) * es,
                   (size_t)(blk * inner) * es);
        s = dt_tensor_set(shard, dst, shape_numel(shard->ndim, shard->shape));
    } else if (src && dst) {
        s = set_error(ctx, s, "tp_shard: cannot read the full tensor: %s", dt_last_error(full->ctx));
    }
    host_free(ctx, src);
    host_free(ctx, dst);
    return s;
}
