/*
 * src/internal.h - what the core's modules share: the system headers, the
 * internal types, the macros and each module's functions for the others.
 * Included by every module (src/NAME.c); pasted once at the top of the generated
 * dtrain.c (./build.sh amalgamate).
 */
#ifndef DTRAIN_INTERNAL_H
#define DTRAIN_INTERNAL_H
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "../dtrain.h"
#include "../backends/backend.h"
#include "../backends/transport.h"
#include "../backends/http.h"
#include "../backends/shape.h"   /* shape_numel, contiguous_strides: one home with the backends */
#include "../backends/half.h"    /* f32_to_bf16, f16_to_f32, ...: the same bits as the backends */

#include <dirent.h>
#include <sys/resource.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <malloc.h>
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

/* Internal functions: extern while the modules are compiled one by one (the
 * development build), static in the generated dtrain.c, which defines
 * DT_PRIVATE as static before it pastes this header. */
#ifndef DT_PRIVATE
#define DT_PRIVATE
#endif

/* The CUDA backend as a shared object (src/context.c, load_cuda_plugin) */
#define DT_CUDA_PLUGIN "libdtrain_cuda.so"
/* ===========================================================================
 * Internal types
 *
 * A tensor is a header (shape, strides, data pointer) plus flags.  Step
 * tensors live in the context's arenas and die at dt_ctx_step_reset; persistent
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
    T_GRADBUF = 1u << 6,    /* persistent gradient owned by its tensor */
    T_RETAIN = 1u << 7      /* dt_tensor_retain_grad: backward keeps this op output's gradient */
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
    struct row_log *rowlog;        /* Hogwild! (src/hogwild.c): the gradient rows embedding wrote */
};

typedef struct row_log row_log;

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
    void *state;                   /* what the op keeps for its backward: its own struct
                                      (transpose_state, matmul_state, ... in its module),
                                      copied in by tape_record_op (host arena) */
    dt_precision prec;             /* autocast when recorded: backward's GEMMs use it */
    /* what the node reads beyond in[] (tape_node_reads): concat's inputs,
     * kept aside as there may be any number; a recompute segment's parameters */
    dt_tensor *const *reads;
    int n_reads, reads_aside;      /* reads_aside: reads, not in[], is what it reads */
};


typedef struct dt_chunk dt_chunk;

/* A block given back to its arena before the reset (arena_give_back). */
typedef struct dt_arena_hole {
    dt_chunk *chunk;
    size_t offset, size;
} dt_arena_hole;

#define DT_ARENA_HOLES 64

typedef struct dt_arena {
    int on_device;                 /* 1: backend memory, 0: host allocator */
    dt_chunk *first, *cur;
    dt_arena_hole holes[DT_ARENA_HOLES];   /* reusable blocks, in no order */
    int n_holes;
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

/* The profiler's state (src/profile.c), one per context.  The phases and the step
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

/* What the CPU gave this process so far (prof_cpu_sample). */
typedef struct prof_cpu {
    double wall, cpu, wait, throttled;
    int64_t periods, nr_throttled;
} prof_cpu;

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
    double cur_pipe;           /* of cur[PH_COMM_WAIT]: waiting for pipeline neighbours (src/parallel.c) */
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
    int balancing;             /* a DDP balances the load: keep measuring (src/ddp.c) */
    int straggler;             /* the latest check's, -1: none */
    int warned_rank;           /* the straggler last warned of, -1: none */
    prof_cpu cpu0;             /* at dt_profile_start */
    double eval0, ckpt0;       /* ctx_aside_s's at dt_profile_start */
    char long_wait[200];       /* the longest wait's story: "allreduce #2 waited 3.0 s for rank 1,
                                  writing a checkpoint for 3 s" (under mu) */
    double *srv_lat_s;         /* a worker's requests: latency summed per server rank */
    int64_t *srv_calls;        /* and their count (srv_n ranks, allocated at the first) */
    int srv_n;
    char cpu_stat[160];        /* this process's cgroup cpu.stat ("": none found) */
} prof_state;

/* What one rank recorded, consistent: its totals, the loader's batches, the
 * longest wait's story and its events (the recorder's own buffer, read
 * between prof_snapshot_begin and prof_snapshot_end, under its lock). */
typedef struct prof_snapshot {
    dt_profile_stats st;
    double batch_s;
    int64_t batches, batches_prefetched;
    char long_wait[200];
    const prof_event *ev;
    int64_t nev;
} prof_snapshot;

/* What the lower layers let a higher one do inside their work, instead of
 * calling up: DDP registers these while it is attached (src/ddp.c,
 * ddp_grad_hooks), as PyTorch's autograd offers gradient hooks to its DDP
 * reducer.  Each gets ctx->hook_user (the attached DDP) as its user pointer
 * and runs only while it is set (a pipeline clears it around a layer's
 * timing runs). */
typedef struct dt_grad_hooks {
    /* autograd: a backward starts; every node of the top-level walk is done
     * (its gradients may be final); it ended with s (returns what to report) */
    dt_status (*backward_begin)(void *user);
    void (*node_done)(void *user, const dt_node *n);
    dt_status (*backward_end)(void *user, dt_status s);
    /* ops (linear's backward): rows of w's gradient to make per block, 0 for
     * all at once; rows 0..rows_done of it are final */
    int64_t (*grad_chunk_rows)(void *user, const dt_tensor *w, int64_t rows, int64_t cols);
    void (*grad_rows_done)(void *user, const dt_tensor *w, int64_t rows_done, int64_t cols);
    /* optim: the loss scaler wants the reduced gradients (finish: wait for
     * them); an optimizer is being freed */
    dt_status (*before_unscale)(void *user, int finish);
    void (*optim_freed)(void *user, const dt_optim *o);
    /* context: it is being freed */
    void (*ctx_freed)(void *user);
    /* Sharded data parallelism (src/zero.c).  autograd: parameter p's
     * gradient is about to be written for the first time since it was
     * zeroed (its memory may be lent only from now on).  optim: are the
     * gradients sharded (then each rank holds only its shard of the
     * averaged gradient, and clipping and unscaling go through these)?
     * grad_scale: multiply this rank's shard by k; grad_sumsq (collective):
     * the sum of squares over every rank's shard; after_step: an optimizer
     * that steps a shard has stepped (the ranks swap their shards). */
    dt_status (*grad_memory)(void *user, dt_tensor *p);
    /* Sharded parameters (zero 3).  param_use: ops (each input of an op
     * about to compute, backward 0) and autograd (node n about to run its
     * backward, backward 1) read memory at data: if it lies in a parameter
     * held as a shard, the ranks gather it first (collective: every rank
     * reaches the same calls in the same order).  param_whole: may a caller
     * read memory at data now (not collective)? */
    dt_status (*param_use)(void *user, const void *data, int backward);
    dt_status (*node_params)(void *user, const dt_node *n);
    int (*param_whole)(void *user, const void *data);
    int (*grads_sharded)(void *user);
    void (*grad_scale)(void *user, float k);
    dt_status (*grad_sumsq)(void *user, double *total);
    dt_status (*after_step)(void *user, dt_optim *o);
} dt_grad_hooks;

/* What a rank is doing, for peers that wait on it (dt_ctx_set_activity): the
 * ones from ACT_CKPT_SAVE on are outer (ctx_doing keeps them). */
enum { ACT_COMPUTE = 0, ACT_DATA, ACT_BACKWARD, ACT_OPTIM, ACT_COLLECTIVE, ACT_CKPT_SAVE,
       ACT_CKPT_LOAD, ACT_EVAL, ACT_COUNT };

/* The slots of dt_ctx.ext: a higher layer's state per context, made on
 * first use (ctx_ext_make) by the module named. */
enum { CTX_EXT_PREEMPT,        /* src/preempt.c: the pre-emption vote and its agreed stop */
       CTX_EXT_RECOMPUTE,      /* src/recompute.c: which segment run is in progress */
       CTX_EXT_PROFILE,        /* src/profile.c: rank 0's report and every rank's totals */
       CTX_EXT_COUNT };

struct dt_ctx {
    dt_allocator al;
    const dt_backend_iface *be_iface;
    dt_backend *be;
    void *be_plugin;               /* dlopen handle of a loaded backend, or NULL */
    dt_status init_status;
    dt_status last_status;
    char err[DT_MAX_ERROR];
    char warning[DT_MAX_ERROR];    /* the latest warning (dt_last_warning) */
    int64_t warnings;              /* ctx_warn calls so far */
    int act;                       /* what the caller's thread is doing (ctx_doing: ACT_*) */
    double act_since;              /* since when (dt_now) */
    char act_user[64];             /* dt_ctx_set_activity's text ("": none) */
    double aside_s[ACT_COUNT];     /* time each activity took, summed as it ends (ctx_done):
                                      the profile's eval_s and ckpt_s read it */
    char act_text[96];             /* dt_ctx_activity's answer */
    pthread_mutex_t warn_mu;       /* the warning and the activity: the monitor's and
                                      heartbeat's threads read them (ctx_warning_copy,
                                      ctx_activity_copy) while the caller's may write */
    uint64_t errors;               /* set_error calls so far (was this error set just now?) */
    dt_log_fn log_fn;
    void *log_user;
    /* state a higher layer keeps with this context (CTX_EXT_*: ctx_ext),
     * plain memory freed with it */
    void *ext[CTX_EXT_COUNT];
    void (*ext_fini[CTX_EXT_COUNT])(dt_ctx *ctx, void *state);   /* NULL: plain memory */
    int threads;
    uint64_t seed;
    uint64_t rng[4];               /* xoshiro256** state for init */
    uint64_t dropout_counter;
    int grad_enabled, training;
    dt_precision autocast;         /* matmul, linear, conv2d inputs (src/autograd.c) */

    dt_arena dev, host;            /* step memory */
    dt_arena scratch_dev, scratch_host; /* recompute segments */
    dt_arena *cur_dev, *cur_host;
    dt_tensor **noted;             /* the parameters ops read, while a caller notes them */
    int n_noted;                   /* (ctx_note_params; noted NULL: nobody does) */

    dt_node *tape;                 /* newest node */
    dt_tensor *persist;            /* persistent tensors */
    dt_tensor *doomed;             /* freed while the tape may read them: at dt_ctx_step_reset */
    size_t persistent_bytes;
    size_t arena_max;              /* dt_ctx_config.arena_max_bytes resolved */
    int backwards;                 /* backward passes since the last dt_ctx_step_reset */
    int arena_warned;              /* the growth warning given since then */
    int arena_refused;             /* the cap refused the last allocation; its message is set */
    dt_tensor **params;
    int n_params, cap_params;
    dt_tensor **ckpt_extra;        /* saved and loaded with the parameters (src/ckpt.c): */
    int n_ckpt_extra;              /* a parameter server's tables; borrowed, NULL normally */
    /* the hooks a higher layer registered (DDP: src/ddp.c, ddp_grad_hooks)
     * and their user pointer; they run only while hook_user is set */
    void *hook_user;
    const dt_grad_hooks *grad_hooks;
    uint64_t zero_gen;             /* bumped by every zero_grad (DDP notices one mid-step) */
    prof_state prof;               /* the profiler (src/profile.c) */
};

#define DT_DEFAULT_ARENA_BYTES ((size_t)8 << 20)
#define DT_ARENA_ALIGN 64

/* The parameter server (src/ps.c) runs its workers' requests on the comm thread (src/comm.c). */
struct dt_work;
struct xfers;
struct ps_call;

/* The profiler (src/profile.c) hears of phases, steps, collectives and batches. */
#define PROF_DEFAULT_EVENTS 262144
#define PROF_DEFAULT_THRESHOLD 0.15   /* a straggler: 15% above the median */
#define PROF_DEFAULT_EVERY 20
enum { PH_DATA, PH_FORWARD, PH_BACKWARD, PH_COMM_WAIT, PH_OPTIM, PH_IDLE, PH_COUNT };

/* ===========================================================================
 * Types and macros of the modules that others use
 * ======================================================================== */

/* --- src/tensor.c --- */

#define SHAPE(t, buf) tensor_shape_str((t), (buf), sizeof(buf))
/* --- src/param.c --- */

/* Fill t from a host generator, one value per element in index order. */
typedef float (*sample_fn)(uint64_t s[4], float a, float b);
/* --- src/autograd.c --- */

#define BE(ctx) ((ctx)->be_iface)
#define BEI(ctx) ((ctx)->be)
#define FP(t) ((float *)(t)->data)
#define IP(t) ((int32_t *)(t)->data)
/* --- src/ops.c --- */

typedef struct gemm_operand gemm_operand;
typedef struct arena_switch arena_switch;
/* --- src/optim.c --- */

typedef struct optim_shard optim_shard;

#define OPTIM_CHUNK 65536   /* 16-bit state: floats widened at a time */

typedef struct optim_group optim_group;

struct dt_optim {
    dt_ctx *ctx;
    dt_optim_config cfg;        /* the optimizer's own: kind, dtypes, and the groups' defaults */
    int n, per;                 /* parameters, state tensors per parameter */
    dt_tensor **params;
    dt_tensor **state;          /* n * per */
    int64_t *param_steps;       /* updates each parameter received */
    int64_t steps;
    int ngroups;
    optim_group *groups;        /* ngroups; group 0 is dt_optim_lr's */
    int *group_of;              /* n: the group of params[i] */
    int has_sched;
    dt_schedule sched;
    int momentum_by_ddp;        /* top-k DDP applies SGD's momentum before sparsifying
                                   (momentum correction, src/ddp.c); the step must not again */
    dt_tensor **master;         /* param_dtype 16-bit: each parameter's f32 master (whole, or
                                   with shard its [lo, lo + n) as 1-D), else NULL */
    float *scratch;             /* OPTIM_CHUNK floats per state tensor with 16-bit state, and
                                   one more with masters (optim_master_adopt) */
    optim_shard *shard;         /* not NULL: a sharded DDP (src/zero.c) lent it; one per
                                   parameter: the range this rank steps */
    int orphaned;               /* its sharded DDP was freed: its state is a shard of a
                                   job that no longer exists */
};

struct dt_loss_scaler;
/* A checkpoint's parameter groups' base lrs (n of them) into o's groups:
 * DT_EMISMATCH, nothing changed, when o has another number of groups. */
/* The latest warning into out (cap bytes) and the number of warnings so
 * far, from any thread (the monitor's). */
DT_PRIVATE int64_t ctx_warning_copy(dt_ctx *ctx, char *out, size_t cap);
/* Enter activity act (the caller's thread); the one it replaces, for
 * ctx_done.  Nested calls keep the outer one (a collective inside a
 * checkpoint's save is the save; inside a save or an evaluation anything
 * is). */
DT_PRIVATE int ctx_doing(dt_ctx *ctx, int act);
DT_PRIVATE void ctx_done(dt_ctx *ctx, int prev);
/* The time activity act has taken so far, summed over its ends. */
DT_PRIVATE double ctx_aside_s(dt_ctx *ctx, int act);
/* "writing a checkpoint for 12 s" into out, from any thread. */
DT_PRIVATE void ctx_activity_copy(dt_ctx *ctx, char *out, size_t cap);
DT_PRIVATE dt_status optim_check_lrs(dt_optim *o, int n, const char *path);
DT_PRIVATE void optim_set_lrs(dt_optim *o, const float *lrs);
/* --- src/ckpt.c --- */

typedef struct strbuf {
    dt_ctx *ctx;
    char *p;
    size_t len, cap;
    int oom;
} strbuf;

/* --- src/data.c --- */

/* A sample's input or target (src/dataset.c): the caller's field, its
 * element count and bytes. */
typedef struct ds_field {
    dt_sample_field f;
    int64_t elems;
    size_t esize, bytes;
} ds_field;

enum { DS_ARRAYS = 1, DS_TOKENS, DS_CALLBACK, DS_SUBSET };

struct dt_dataset {
    dt_ctx *ctx;
    int kind;                  /* DS_* */
    int64_t n;
    ds_field in, tgt;
    const uint8_t *x, *y;      /* DS_ARRAYS: sample i at x + i * in.bytes, y + i * tgt.bytes */
    void *own[2];              /* memory this dataset frees */
    void *map[2];              /* files it mapped, and their sizes */
    size_t map_len[2];
    /* DS_TOKENS: windows of tok[first, first + count), token_bytes each */
    const uint8_t *tok;
    int tok_bytes;
    int64_t first, count, context, stride;
    uint64_t seed;
    /* DS_CALLBACK */
    dt_sample_fn fill;
    void *user;
    /* DS_SUBSET: samples offset.. of parent */
    const dt_dataset *parent;
    int64_t offset;
    /* normalisation (dt_dataset_normalize) */
    int scale_u8, nstat;
    float *mean, *std;
    int classes;
};

/* How a loader turns raw inputs into its batch (dataset_xform_init): the
 * loader's own mean and std; u8 inputs through a 256-entry table per stat. */
typedef struct ds_xform {
    float mean, std;
    int64_t group;             /* elements per stat */
    float *lut;                /* u8: 256 per stat, or NULL */
    uint8_t *raw;              /* one raw sample (tokens, callbacks): the reader's own */
} ds_xform;

/* --- the loader ---------------------------------------------------------- */

typedef struct loader_slot {
    dt_tensor *x, *y;          /* full-batch tensors (persistent) */
    dt_tensor xv, yv;          /* headers for a short last batch */
    void *hx, *hy;             /* host staging (== x->data, y->data when host-visible) */
    dt_status status;          /* a sample that could not be read (a callback failed) */
    char msg[DT_MAX_ERROR];
    int pinned;                /* hx, hy from the backend's host_alloc */
    uint64_t ticket;           /* the backend's copy of hx, hy to x, y (0: none) */
    int64_t batch_index;       /* which batch the slot holds, -1 if none */
    int count;                 /* samples in it; -1: work stealing found none left */
    int ready;
    uint64_t gen;              /* global batches: the split it was cut with */
    int64_t offset, global;    /* its place in its global batch */
    int stolen;                /* it came from another shard's chunk */
} loader_slot;

/* What the loader lets a higher layer decide, instead of calling it: work
 * stealing registers these in dt_loader_steal (src/steal.c, steal_source)
 * with its state (loader_set_source), which the loader never reads.
 * next: the batch of the chunk in hand (its shard, whether stolen), -1 when
 * none is left anywhere (then failed says whether that was an error);
 * start_epoch: a new epoch's chunks; release: the loader is being freed. */
typedef struct loader_source {
    int64_t (*next)(dt_loader *ld, int *shard, int *stolen);
    dt_status (*failed)(const dt_loader *ld, const char **msg);
    void (*start_epoch)(dt_loader *ld, int64_t epoch);
    void (*release)(dt_loader *ld);
} loader_source;

struct dt_loader {
    dt_ctx *ctx;
    const dt_dataset *ds;
    dt_loader_config cfg;
    int64_t x_elems, y_elems;  /* per sample, 4 bytes each (f32 or i32) */
    dt_dtype x_dtype, y_dtype;
    int64_t *order;            /* this shard's sample indices for the epoch */
    int64_t n_local, n_batches, next;
    int64_t epoch;             /* the epoch last started */
    int untouched;             /* it started and gave out nothing yet (loader_keeps_epoch) */
    ds_xform xf;
    loader_slot slot[2];
    int host_visible;
    double wait_s;
    int64_t cap;               /* samples a slot holds: batch, or a whole global batch */
    /* global batches (dt_loader_set_split): the weights, under mu */
    double *split;
    uint64_t split_gen;
    int64_t cur_offset, cur_count, cur_global;   /* the batch last given out */
    const loader_source *source;   /* NULL, or where batches come from (work stealing) */
    void *source_state;        /* the source's, opaque to the loader */
    int64_t source_done, source_stolen;   /* batches given out this epoch, from other shards */
    /* background thread */
    pthread_t thread;
    int has_thread, stop;
    int64_t request;           /* batch the worker should fill, -1 if none */
    int request_slot, busy;
    pthread_mutex_t mu;
    pthread_cond_t cv;
};
/* The profiler's events (src/record.c records them, src/profile.c reads) */
enum { TID_COMPUTE = 1, TID_COMM = 2, TID_LOADER = 3 };
enum { EV_PHASE = 1, EV_STEP, EV_COLL, EV_PS, EV_BATCH, EV_STRAGGLER };

/* ===========================================================================
 * What each module offers the others
 * ======================================================================== */

/* src/record.c */
DT_PRIVATE int prof_recording(const dt_ctx *ctx);
DT_PRIVATE int prof_check_every(const dt_ctx *ctx);
DT_PRIVATE void prof_balancing(dt_ctx *ctx, int on);
DT_PRIVATE int prof_pause(dt_ctx *ctx);
DT_PRIVATE void prof_resume(dt_ctx *ctx, int measure);
DT_PRIVATE void prof_pipe_wait(dt_ctx *ctx, double t0);
DT_PRIVATE void prof_pipe_bubble(dt_ctx *ctx, double ideal);
DT_PRIVATE void prof_init(dt_ctx *ctx);
DT_PRIVATE void prof_release(dt_ctx *ctx);
DT_PRIVATE double prof_begin(dt_ctx *ctx);
DT_PRIVATE void prof_end(dt_ctx *ctx, int phase, double t0);
DT_PRIVATE void prof_samples(dt_ctx *ctx, int64_t n);
DT_PRIVATE void prof_step_end(dt_ctx *ctx);
DT_PRIVATE void prof_coll(dt_ctx *ctx, double t0, double t1, int kind, int alg, int64_t bytes,
                          double bus_bytes, int world);
DT_PRIVATE void prof_ext(dt_ctx *ctx, double t0, double t1, int what, int64_t n, int64_t stale,
                         int ok);
DT_PRIVATE void prof_batch(dt_ctx *ctx, int64_t samples, double t0, double t1, int on_thread);
DT_PRIVATE void prof_push(prof_state *p, prof_event e);
DT_PRIVATE void prof_fill(const prof_state *p, dt_profile_stats *out);
DT_PRIVATE void prof_snapshot_begin(dt_ctx *ctx, prof_snapshot *out);
DT_PRIVATE void prof_snapshot_end(dt_ctx *ctx);
/* The cross-rank check (src/profile.c, prof_exchange): this rank's window
 * since the last check (compute seconds, steps, samples), a new window
 * begun once the ranks have them (prof_window_reset); the straggler
 * threshold in force; the check's finding, straggler s (-1: none) that
 * computes per_ns per sample (mine: this rank), which returns 1 when s is
 * new to warn of.  prof_stop_recording: dt_profile_stop's first act. */
DT_PRIVATE void prof_window(const dt_ctx *ctx, float out[3]);
DT_PRIVATE void prof_window_reset(dt_ctx *ctx);
DT_PRIVATE double prof_threshold(const dt_ctx *ctx);
DT_PRIVATE int prof_straggler_found(dt_ctx *ctx, int s, int mine, int64_t per_ns);
DT_PRIVATE void prof_stop_recording(dt_ctx *ctx);
/* The median of the n values v (the lower middle one; v sorted in place);
 * 0 when n is 0. */
DT_PRIVATE double prof_median(double *v, int n);
/* The context's part of out (eval_s, ckpt_s, threads): without prof.mu held
 * (it takes the context's warn_mu). */
DT_PRIVATE void prof_fill_ctx(dt_ctx *ctx, dt_profile_stats *out);
DT_PRIVATE const char *prof_phase_name(int phase);
DT_PRIVATE void prof_ps_serving(dt_ctx *ctx, const dt_profile_stats *sv);
DT_PRIVATE void prof_gather(dt_ctx *ctx, double ran_s, double exposed_s);
DT_PRIVATE void prof_gather_unit(dt_ctx *ctx, int on_demand);
/* A wait of s seconds for living rank `peer` (past the peer timeout) ended
 * well; what (the collective) and doing (what its heartbeat said) tell it.
 * Keeps the longest (any thread). */
DT_PRIVATE void prof_long_wait(dt_ctx *ctx, double s, int peer, const char *what, const char *doing);
/* A parameter-server request's latency to server rank `server` of world
 * (the comm thread, as its reply came). */
DT_PRIVATE void prof_ext_server(dt_ctx *ctx, int server, int world, double s);

/* src/context.c */
DT_PRIVATE int be_stages(const dt_backend_iface *b);
DT_PRIVATE void be_to_host(dt_ctx *ctx, void *host, const void *src, size_t bytes);
DT_PRIVATE void be_to_device(dt_ctx *ctx, void *dst, const void *host, size_t bytes);
DT_PRIVATE dt_status be_fault(dt_ctx *ctx, const char *what);
DT_PRIVATE dt_status set_error(dt_ctx *ctx, dt_status s, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* A warning: kept for dt_last_warning, and told as dt_ctx_set_log says. */
DT_PRIVATE void ctx_warn(dt_ctx *ctx, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
DT_PRIVATE void *host_alloc(dt_ctx *ctx, size_t n);
DT_PRIVATE void host_free(dt_ctx *ctx, void *p);
DT_PRIVATE void *host_calloc(dt_ctx *ctx, size_t n);
DT_PRIVATE char *host_strdup(dt_ctx *ctx, const char *s);
/* A caller's config struct read by dtrain.h's rule ("Config structs") */
DT_PRIVATE int ctx_config_read(void *own, size_t own_size, const void *cfg, const char *fn,
                               const char *type, char *why, size_t cap);
DT_PRIVATE dt_status ctx_config_in(dt_ctx *ctx, void *own, size_t own_size, const void *cfg,
                                   const char *fn, const char *type);
DT_PRIVATE const dt_backend_iface *ctx_find_backend(const char *name);
DT_PRIVATE void ctx_arena_init(dt_arena *a, int on_device, size_t min_chunk);
DT_PRIVATE int ctx_ok(dt_ctx *ctx);
/* The hooks a higher layer (DDP) registers with the context, and its
 * pointer; ctx_swap_hook_user sets the pointer (NULL: hooks off) and
 * returns the one before. */
/* An error sink for another thread of ctx's work (a store connection's):
 * a context that only collects errors, with ctx's allocator; NULL when out
 * of memory; freed with host_free(ctx, sink). */
DT_PRIVATE dt_ctx *ctx_new_sink(dt_ctx *ctx);
/* the step arenas (device, host) back to at most these capacities, after a
 * phase whose steps were larger (evaluation) */
DT_PRIVATE void ctx_shrink_step_arenas(dt_ctx *ctx, size_t dev, size_t host);
/* The tensors a checkpoint of ctx saves besides its parameters (a
 * parameter server's tables): list[n], the caller's (NULL, 0: none). */
DT_PRIVATE void ctx_set_ckpt_extra(dt_ctx *ctx, dt_tensor **list, int n);
DT_PRIVATE void ctx_step_arena_capacity(const dt_ctx *ctx, size_t *dev, size_t *host);
DT_PRIVATE void ctx_set_grad_hooks(dt_ctx *ctx, const dt_grad_hooks *hooks, void *user);
DT_PRIVATE void *ctx_swap_hook_user(dt_ctx *ctx, void *user);
/* A higher layer's state kept with ctx (slot CTX_EXT_*): NULL until made;
 * ctx_ext_make makes it zeroed, size bytes, once (NULL: out of memory,
 * with the error set); freed with the context, after fini(ctx, state)
 * has freed what it holds (fini NULL: nothing). */
DT_PRIVATE void *ctx_ext(const dt_ctx *ctx, int slot);
DT_PRIVATE void *ctx_ext_make(dt_ctx *ctx, int slot, size_t size,
                              void (*fini)(dt_ctx *ctx, void *state));
/* What a recompute segment and a pipeline's micro-batch change while they
 * run and put back after (src/recompute.c, src/parallel.c); each returns
 * the value it replaced.  ctx_swap_arenas: the arenas step tensors come
 * from, *dev and *host in, the ones before out. */
DT_PRIVATE dt_node *ctx_swap_tape(dt_ctx *ctx, dt_node *tape);
DT_PRIVATE int ctx_swap_grad_enabled(dt_ctx *ctx, int on);
DT_PRIVATE dt_precision ctx_swap_autocast(dt_ctx *ctx, dt_precision p);
DT_PRIVATE uint64_t ctx_swap_dropout_counter(dt_ctx *ctx, uint64_t counter);
DT_PRIVATE void ctx_swap_arenas(dt_ctx *ctx, dt_arena **dev, dt_arena **host);
/* the arenas a recompute segment's first run and rerun allocate from */
DT_PRIVATE void ctx_scratch_arenas(dt_ctx *ctx, dt_arena **dev, dt_arena **host);
/* The next dropout mask's number (each dt_dropout takes one). */
DT_PRIVATE uint64_t ctx_dropout_next(dt_ctx *ctx);
/* A backward pass began (the step arena's growth warning counts them). */
DT_PRIVATE void ctx_backward_begun(dt_ctx *ctx);
/* Note every parameter the ops read (ctx_note_param, from op_input_ok)
 * into list, room for every parameter of ctx, until ctx_note_params(ctx,
 * NULL), which returns how many were noted: a recompute segment's node
 * says which parameters its backward finishes. */
DT_PRIVATE int ctx_note_params(dt_ctx *ctx, dt_tensor **list);
DT_PRIVATE void ctx_note_param(dt_ctx *ctx, const dt_tensor *p);

/* src/arena.c */
DT_PRIVATE void arena_destroy(dt_ctx *ctx, dt_arena *a);
DT_PRIVATE void *arena_alloc(dt_ctx *ctx, dt_arena *a, size_t n);
DT_PRIVATE void arena_reset(dt_ctx *ctx, dt_arena *a);
DT_PRIVATE void arena_shrink(dt_ctx *ctx, dt_arena *a, size_t cap);
DT_PRIVATE size_t arena_capacity(const dt_arena *a);
DT_PRIVATE dt_arena_mark arena_mark(const dt_arena *a);
DT_PRIVATE void arena_release(dt_arena *a, dt_arena_mark m);
DT_PRIVATE int arena_give_back(dt_arena *a, void *p, size_t n);
DT_PRIVATE size_t arena_used(const dt_arena *a);
/* A gradient's memory back to the step or scratch arena it came from
 * (0: from neither, kept). */
DT_PRIVATE int arena_step_give_back(dt_ctx *ctx, void *p, size_t n);
/* Did the cap refuse the last allocation (its message is then the
 * context's error)?  Asking forgets it. */
DT_PRIVATE int arena_refused_take(dt_ctx *ctx);
DT_PRIVATE void *arena_alloc_reuse(dt_ctx *ctx, dt_arena *a, size_t n);

/* src/tensor.c */
DT_PRIVATE const char *tensor_shape_str(const dt_tensor *t, char *buf, size_t len);
DT_PRIVATE dt_status tensor_check_shape(dt_ctx *ctx, const char *op, int ndim, const int64_t *shape);
DT_PRIVATE void tensor_header_init(dt_tensor *t, dt_ctx *ctx, dt_dtype dtype, int ndim, const int64_t *shape);
DT_PRIVATE size_t tensor_bytes(const dt_tensor *t);
DT_PRIVATE dt_tensor *tensor_step_new_reusing(dt_ctx *ctx, dt_dtype dtype, int ndim,
                                              const int64_t *shape);
DT_PRIVATE dt_tensor *tensor_step_new(dt_ctx *ctx, dt_dtype dtype, int ndim, const int64_t *shape);
DT_PRIVATE dt_tensor *tensor_view_header(dt_ctx *ctx, const dt_tensor *x);
/* A view of x's memory with a geometry of its own: ndim dims of shape and
 * stride (elements), starting at data (NULL: where x starts). */
DT_PRIVATE dt_tensor *tensor_view_as(dt_ctx *ctx, const dt_tensor *x, int ndim, const int64_t *shape,
                                     const int64_t *stride, void *data);
/* A loader's batch: *view becomes full's first count rows, outside the
 * context's lists (the loader owns full). */
DT_PRIVATE void tensor_batch_view(dt_tensor *view, const dt_tensor *full, int64_t count);
/* Autograd's marks on a tensor: its gradient (NULL: none), the tape node
 * that made it (NULL: none, a leaf or a consumed tape), and that
 * gradients flow to it. */
DT_PRIVATE void tensor_set_grad(dt_tensor *t, dt_tensor *grad);
DT_PRIVATE void tensor_set_node(dt_tensor *t, dt_node *n);
DT_PRIVATE void tensor_require_grad(dt_tensor *t);
DT_PRIVATE dt_tensor *tensor_persistent_new(dt_ctx *ctx, dt_dtype dtype, int ndim, const int64_t *shape);
DT_PRIVATE void tensor_destroy(dt_ctx *ctx, dt_tensor *t);
DT_PRIVATE dt_status tensor_attach_grad(dt_ctx *ctx, dt_tensor *t);
DT_PRIVATE void tensor_free_doomed(dt_ctx *ctx);
DT_PRIVATE void tensor_materialize(dt_tensor *t);
/* zero: t's contents count as zero, not yet written (T_ZERO, a fresh
 * gradient), or as written; tensor_point_at: t's data is memory another
 * module owns (DDP's buckets), or back at its own */
DT_PRIVATE void tensor_mark_zero(dt_tensor *t, int zero);
/* every gradient was zeroed (dt_ctx_zero_grad, an optimizer's): a DDP step
 * that started before sees it (dt_ctx.zero_gen) */
DT_PRIVATE void param_grads_zeroed(dt_ctx *ctx);
/* A persistent tensor owned by an object other than the context (an
 * optimizer's state, a server's table, a load's staging), named name +
 * suffix; lazy: left unwritten, logically zero.  Freed with tensor_destroy. */
DT_PRIVATE dt_tensor *tensor_owned_new_as(dt_ctx *ctx, dt_dtype dtype, int ndim,
                                        const int64_t *shape, const char *name,
                                        const char *suffix, int lazy);
DT_PRIVATE dt_tensor *tensor_owned_new(dt_ctx *ctx, int ndim, const int64_t *shape, const char *name,
                                       const char *suffix, int lazy);
DT_PRIVATE void tensor_point_at(dt_tensor *t, void *data);
/* Row logs (Hogwild!): start logging the gradient rows of a 2-D parameter
 * t; log the rows idx[n] an embedding writes (0: no log, or it is dense or
 * cannot grow: write densely); a dense write (tensor_rows_all); the rows
 * logged since the reset, each once (0: none logged, update densely; *st
 * an error, with ctx's message); tensor_rows_reset for the next step.
 * tensor_share_data: t's data is with's (its own freed). */
DT_PRIVATE dt_status tensor_rows_log_start(dt_ctx *ctx, dt_tensor *t);
DT_PRIVATE int tensor_rows_log(dt_ctx *ctx, dt_tensor *t, const int32_t *idx, int64_t n);
DT_PRIVATE void tensor_rows_all(dt_tensor *t);
DT_PRIVATE int tensor_rows_logged(dt_ctx *ctx, dt_tensor *t, const int64_t **rows, int64_t *n,
                                  dt_status *st);
DT_PRIVATE void tensor_rows_reset(dt_tensor *t);
DT_PRIVATE void tensor_share_data(dt_ctx *ctx, dt_tensor *t, const dt_tensor *with);
/* memory a module took for or gave back from the context's tensors (a
 * gradient's own buffer, ZeRO): the context's persistent byte count */
DT_PRIVATE void tensor_count_persistent(dt_ctx *ctx, int64_t bytes);
DT_PRIVATE void host_give_back(dt_ctx *ctx);
DT_PRIVATE dt_status tensor_readable(const dt_tensor *t, const char *op);
DT_PRIVATE dt_status tensor_check(dt_ctx *ctx, const char *op, const dt_tensor *t, const char *what);

/* src/param.c */
DT_PRIVATE uint64_t param_splitmix64(uint64_t *s);
DT_PRIVATE uint64_t param_rng_next(uint64_t s[4]);
DT_PRIVATE void param_rng_seed(uint64_t s[4], uint64_t seed);

/* src/util.c */
DT_PRIVATE void strbuf_putn(strbuf *b, const char *s, size_t n);
DT_PRIVATE void strbuf_clear(strbuf *b);   /* empty again, its memory kept */
DT_PRIVATE void strbuf_puts(strbuf *b, const char *s);
DT_PRIVATE void strbuf_printf(strbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* src/autograd.c */
DT_PRIVATE int tape_tracks(const dt_ctx *ctx, const dt_tensor *t);
/* The tensors a recorded node reads (its in[], or its reads when it has
 * them), as DDP's hooks count a parameter's last use: the count, *out the
 * array.  tape_param_uses adds each recorded node's reads of ctx's
 * parameters into uses[param_index] (nparams of them). */
DT_PRIVATE int tape_node_reads(const dt_node *n, dt_tensor *const **out);
DT_PRIVATE void tape_param_uses(const dt_ctx *ctx, int *uses, int nparams);
/* A node that reads other tensors than its in[] (any number of them,
 * reads[count]); the precision its backward runs at, when not the one
 * recorded (a recompute segment's, as its forward ran). */
DT_PRIVATE void tape_set_reads(dt_node *n, dt_tensor *const *reads, int count);
DT_PRIVATE void tape_set_prec(dt_node *n, dt_precision prec);
DT_PRIVATE dt_node *tape_record(dt_ctx *ctx, const char *op, dt_backward_fn bw, dt_tensor *out,
                       dt_tensor *a, dt_tensor *b, dt_tensor *c);
/* tape_record, and a copy of the op's state (size bytes of the op's own
 * struct, named fields) as the node's state for its backward: an op
 * records with one call, tape_record_op(ctx, "slice", slice_backward, y, x,
 * NULL, NULL, &(slice_state){dim, start}, sizeof(slice_state)).  NULL,
 * with the context's error set, when the tape has no room. */
DT_PRIVATE dt_node *tape_record_op(dt_ctx *ctx, const char *op, dt_backward_fn bw, dt_tensor *out,
                           dt_tensor *a, dt_tensor *b, dt_tensor *c, const void *state,
                           size_t size);
DT_PRIVATE float *grad_target(dt_ctx *ctx, dt_tensor *t, int *acc);
DT_PRIVATE float *grad_target_zeroed(dt_ctx *ctx, dt_tensor *t);
DT_PRIVATE int grad_needed(const dt_tensor *t);
DT_PRIVATE dt_status tape_run(dt_ctx *ctx, dt_node *tail, dt_node *stop, int hooked);
DT_PRIVATE dt_status tape_backward_seeded(dt_ctx *ctx, dt_tensor *loss, float seed);
DT_PRIVATE dt_status tape_backward(dt_ctx *ctx, dt_tensor *out, const float *seed_grad, float seed);

/* src/ops.c */
DT_PRIVATE int op_input_ok(dt_ctx *ctx, const char *op, const dt_tensor *x, const char *what);
DT_PRIVATE int op_f32_ok(dt_ctx *ctx, const char *op, const dt_tensor *x, const char *what);
DT_PRIVATE dt_tensor *op_like(dt_ctx *ctx, const dt_tensor *x);
DT_PRIVATE float *op_temp_floats(dt_ctx *ctx, int64_t n);
DT_PRIVATE dt_status op_acc_grad(dt_ctx *ctx, dt_tensor *x, const float *src, float alpha);
DT_PRIVATE dt_tensor *op_need_contig(dt_ctx *ctx, dt_tensor *x);
DT_PRIVATE dt_status op_gemm(dt_ctx *ctx, dt_precision prec, int64_t batch, int ta, int tb,
                             int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                             int64_t lda, int64_t stride_a, const float *b, int64_t ldb,
                             int64_t stride_b, float beta, float *c, int64_t ldc, int64_t stride_c);
/* One GEMM at a node's precision; returns from the caller on failure. */
#define GEMM(ctx, prec, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)                   \
    do {                                                                                       \
        if (op_gemm(ctx, prec, 1, ta, tb, m, n, k, alpha, a, lda, 0, b, ldb, 0, beta, c, ldc, \
                    0) != DT_OK)                                                             \
            return ctx->last_status;                                                           \
    } while (0)

/* src/recompute.c: is a segment's own backward running (DDP may not call
 * a parameter's gradient final inside it: the segment may read it again)? */
DT_PRIVATE int recompute_in_backward(const dt_ctx *ctx);

/* src/optim.c */
DT_PRIVATE dt_status optim_shard_state(dt_optim *o, const int64_t *lo, const int64_t *n);
DT_PRIVATE dt_tensor *optim_master_of(const dt_optim *o, const dt_tensor *p);
/* parameter i's f32 master (16-bit parameters), NULL when it has none */
DT_PRIVATE dt_tensor *optim_master_at(const dt_optim *o, int i);
/* on: SGD's momentum is applied before the optimizer sees the gradient
 * (top-k DDP keeps the velocity before sparsifying), so its step has none */
DT_PRIVATE void optim_momentum_elsewhere(dt_optim *o, int on);
/* What a checkpoint reads of an optimizer (src/ckpt.c): the parameters it
 * steps, in order, each with per state tensors (dt_optim_state_at(o, i * per
 * + j)), each parameter's steps, its kind, each group's base lr, whether
 * its state is sharded across ranks (then parameter i's state starts at
 * element optim_shard_lo of the parameter), and the context it is of;
 * optim_restore_steps puts a loaded file's steps back. */
DT_PRIVATE int optim_param_count(const dt_optim *o);
/* the optimizer's settings; the rate group's schedule gives at its step now
 * (rows stepped between dense steps: a parameter server's sparse tables) */
DT_PRIVATE const dt_optim_config *optim_config(const dt_optim *o);
DT_PRIVATE float optim_scheduled_lr(const dt_optim *o, int group);
DT_PRIVATE dt_tensor *optim_param_at(const dt_optim *o, int i);
DT_PRIVATE int optim_state_per(const dt_optim *o);
DT_PRIVATE const int64_t *optim_param_steps(const dt_optim *o);
DT_PRIVATE int optim_kind(const dt_optim *o);
DT_PRIVATE float optim_base_lr(const dt_optim *o, int group);
DT_PRIVATE int optim_is_sharded(const dt_optim *o);
DT_PRIVATE int64_t optim_shard_lo(const dt_optim *o, int i);
/* ZeRO's side of a sharded optimizer (src/zero.c): parameter i's shard of
 * elements (optim_shard_count of them from optim_shard_lo), the gradient
 * its step reads (master_only: it updates the master alone), whether this
 * step reduced it (used), and a shard whose DDP was freed (orphaned: its
 * state is no longer whole anywhere). */
DT_PRIVATE int64_t optim_shard_count(const dt_optim *o, int i);
DT_PRIVATE void optim_shard_grad(dt_optim *o, int i, const float *grad, int master_only);
DT_PRIVATE void optim_shard_used(dt_optim *o, int i, int used);
DT_PRIVATE void optim_orphan(dt_optim *o);
DT_PRIVATE int optim_is_orphaned(const dt_optim *o);
DT_PRIVATE dt_ctx *optim_ctx(const dt_optim *o);
DT_PRIVATE void optim_restore_steps(dt_optim *o, int64_t steps, const int64_t *param_steps);
DT_PRIVATE void optim_masters_from_params(dt_optim *o, int whole);

/* src/ckpt.c: sharded checkpoints (a directory of shards and an index) */
typedef struct ckpt_plan ckpt_plan;   /* a load checked and not yet copied */
DT_PRIVATE dt_status ckpt_shard_save(dt_ctx *ctx, const dt_optim *opt, const char *dir,
                                     int64_t step, int rank, int world, const int64_t *lo,
                                     const int64_t *n);
DT_PRIVATE dt_status ckpt_shard_index_save(dt_ctx *ctx, const dt_optim *opt, const char *dir,
                                           int64_t step, int world, int zero);
DT_PRIVATE ckpt_plan *ckpt_plan_make(dt_ctx *ctx, dt_optim *opt, const char *dir,
                                     const int64_t *plo, const int64_t *pn);
DT_PRIVATE dt_status ckpt_plan_apply(ckpt_plan *pl, int64_t *step_out);
DT_PRIVATE void ckpt_plan_free(ckpt_plan *pl);

/* src/codec.c */
DT_PRIVATE size_t codec_bytes(dt_compress kind, int64_t numel, int64_t topk);
DT_PRIVATE void codec_encode(dt_compress kind, const float *g, int64_t n, const int64_t *pieces,
                        int npieces, int64_t k, float *scratch, unsigned char *picked, char *out,
                        float *sent);
DT_PRIVATE void codec_decode_add(dt_compress kind, const char *code, int64_t n, int64_t k, float *acc);

/* src/dataset.c, src/dataset_io.c */
DT_PRIVATE size_t dataset_dtype_size(dt_dtype t);
DT_PRIVATE dt_dataset *dataset_arrays(dt_ctx *ctx, const char *what, int64_t n,
                                      const dt_sample_field *input, const void *x,
                                      const dt_sample_field *target, const void *y);
DT_PRIVATE dt_status dataset_map(dt_ctx *ctx, const char *what, const char *path, void **p,
                                 size_t *len);
DT_PRIVATE dt_status dataset_raw(const dt_dataset *ds, int64_t i, void *x, void *y, char *err,
                                 size_t err_len);
DT_PRIVATE dt_status dataset_xform_init(const dt_dataset *ds, float mean, float std, ds_xform *xf);
DT_PRIVATE void dataset_xform_free(dt_ctx *ctx, ds_xform *xf);
DT_PRIVATE dt_dtype dataset_batch_dtype(const dt_sample_field *f, int target);
DT_PRIVATE dt_status dataset_read(const dt_dataset *ds, const ds_xform *xf, int64_t i, void *x,
                                  void *y, char *err, size_t err_len);
DT_PRIVATE void dataset_token_window(const dt_dataset *ds, int64_t i, void *x, void *y);

/* src/data.c */
DT_PRIVATE void loader_quiesce(dt_loader *ld);
/* A batch source for a higher layer (work stealing): the loader asks it for
 * batches from the next epoch started on; state is the source's, freed by
 * its release.  The accessors are what a source may read of the loader. */
DT_PRIVATE void loader_set_source(dt_loader *ld, const loader_source *src, void *state);
DT_PRIVATE void *loader_source_state(const dt_loader *ld);
DT_PRIVATE dt_ctx *loader_ctx(const dt_loader *ld);
DT_PRIVATE const dt_loader_config *loader_config(const dt_loader *ld);
DT_PRIVATE int64_t loader_local_samples(const dt_loader *ld);

#endif /* DTRAIN_INTERNAL_H */
