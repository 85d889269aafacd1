/*
 * dtrain.h - the whole public API of dtrain, a distributed deep-learning
 * training framework in C.
 * SPDX-License-Identifier: MIT (the LICENSE file; copy it with this file)
 *
 * Vendor dtrain.h + dtrain.c into your program (cc -DDT_WITH_CPU prog.c dtrain.c
 * -lopenblas -lz -lm -lpthread; -DDT_WITH_FABRIC -lfabric for several
 * processes, backends/cuda.cu for a GPU), or link libdtrain.
 * Platforms: Linux only (the core uses signalfd, futexes and /proc); tested
 * on x86-64 with glibc (aarch64 has kernels of its own, untested here).
 * Everything starts from a context:
 *
 *     dt_ctx_config cfg;
 *     dt_ctx_config_init(&cfg);            // defaults: cpu backend, 1 thread, seed 0
 *     dt_ctx *ctx = dt_ctx_new(&cfg);  // NULL only when out of memory
 *     if (dt_ctx_status(ctx) != DT_OK) puts(dt_last_error(ctx));
 *
 * Contents.  One header, in numbered parts; a one-process program needs
 * only the core's:
 *   core         1 status codes and errors, 2 the context, 3 tensors,
 *                4 parameters and initialisation, 5 ops, 6 autograd,
 *                7 optimizers and schedules, 8 checkpoints, 9 data,
 *                15 utilities
 *   distributed  10 processes (launcher environment, rendezvous store,
 *                communicators and collectives, dt_spawn, dt_launch),
 *                11 data parallelism (DDP, ZeRO, in-process replicas,
 *                Hogwild!), 12 parameter server, 13 profiler,
 *                14 model parallelism (pipelines, tensor-parallel layers),
 *                14b live monitoring
 * Both halves are in dtrain.c.  Several processes need the transport,
 * compiled in with DT_WITH_FABRIC (without it dt_comm_new gives
 * DT_ENOTSUP); the monitor's web server comes with DT_WITH_HTTP.
 *
 * Conventions (they hold for every function below):
 *  - Fallible functions return dt_status.  Functions that return a handle return
 *    NULL on failure and leave the reason in the context: dt_last_error(ctx).
 *  - Nothing here aborts, exits or prints.  Bad input (NULL, wrong shapes,
 *    wrong dtypes, corrupt files) gives a status and a message naming the
 *    object and the cause.
 *  - Ops accept NULL inputs and return NULL: the first failure's message is
 *    kept (a NULL input sets one only when no error is pending), so a chain
 *    of ops can be checked once at the end.
 *  - Ownership is written on each function: "borrows" (the caller keeps
 *    ownership), "new" (the caller frees it with the named function),
 *    "ctx-owned" (freed with the context), "step" (lives until
 *    dt_ctx_step_reset()).
 *  - A call whose first argument (the context or object it works on) is
 *    NULL gives DT_EINVAL (or a NULL, 0, -1, NAN or "" result) and no
 *    message: there is no context to keep one.  A context whose backend
 *    failed to start refuses calls the same way (dt_last_error says why).
 *  - Any call that allocates may fail with DT_ENOMEM; that is not repeated
 *    below.  Each function lists the other statuses it can give.
 *  - dt_*_config_init(cfg) fills *cfg with the defaults written at its fields
 *    (NULL is ignored).
 *  - Config structs (dt_*_config, dt_ctx_config) begin with struct_size, which
 *    their *_init sets to the struct's size in the header the program was
 *    built with.  The library reads the first struct_size bytes and gives
 *    the fields past them their *_init defaults, so a program built against
 *    an older dtrain.h keeps working with a newer library.  It refuses with
 *    DT_EINVAL, naming the struct and both sizes, a struct_size of 0 or
 *    below sizeof(size_t) (a struct that skipped its *_init) and one larger
 *    than its own with any byte past its own size not zero (a newer
 *    header's fields it cannot honour).  New fields are only ever appended,
 *    each starting at the previous release's size, and a config struct
 *    embedded in another (dt_comm_config.store, dt_ps_config.optim, ...)
 *    never grows: it is read whole, as part of its parent (its own
 *    struct_size is not looked at there).
 *  - Environment variables (DTRAIN_COMPRESS, DTRAIN_BUCKET_BYTES,
 *    DTRAIN_TIMEOUT_MS, DTRAIN_TRANSPORT, DTRAIN_PS_MODE, ...) fill only
 *    fields the program left unset: a field an environment variable may set
 *    starts, in its *_config_init, at a value that means "unset" (0 or NULL
 *    where those are no valid choice; DT_COMPRESS_AUTO, DT_PS_MODE_AUTO or -1
 *    where they are), and any value the program writes is kept whatever the
 *    environment says.  Variables that switch a feature on (DTRAIN_PROFILE,
 *    DTRAIN_LOG) only add what no call asked for.
 *  - Names.  A function that works on an object is named for it first,
 *    then the verb: dt_ctx_set_training, dt_tensor_init_normal,
 *    dt_comm_allreduce, dt_ddp_step.  Every kind of object has one
 *    lifecycle pair, dt_<kind>_new / dt_<kind>_free (a family of sources
 *    may name its makers by source, dt_dataset_load_csv, dt_optim_new_groups,
 *    freed the same way); the profiler, which is no object but records
 *    into its context, has dt_profile_start / dt_profile_stop; counters are
 *    read with dt_<kind>_stats_get.
 *    Options come in one way: a dt_<kind>_config filled by its
 *    dt_<kind>_config_init and passed as a const pointer, NULL meaning the
 *    defaults.  The exceptions are the ops that build the graph, named as
 *    PyTorch names them (dt_matmul, dt_softmax, dt_backward), the errors
 *    (dt_last_error, dt_last_status), and a few free functions (dt_now,
 *    dt_strerror, dt_spawn, dt_launch).
 *  - Free what you made with a context (optimizers, datasets, loaders,
 *    communicators, ...) before the context; its tensors go with it.
 *  - Threads.  No global mutable state: two contexts never share anything,
 *    and each may be driven by its own thread.  A context, and everything
 *    made with it, is used by one thread at a time; exceptions are noted
 *    where they apply.  Functions that take no handle (dt_strerror,
 *    dt_dtype_size, dt_dtype_name, dt_schedule_lr, dt_now, the
 *    *_config_init) are safe on any thread.  The threads the library starts
 *    for itself (a store's server, a communicator's comm thread, a loader's
 *    prefetch thread) never write a context's error, and of your code call
 *    only the allocator hooks and a custom backend's entries.
 */
#ifndef DTRAIN_H
#define DTRAIN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DTRAIN_VERSION_MAJOR 0
#define DTRAIN_VERSION_MINOR 1
#define DTRAIN_VERSION_PATCH 0
#define DTRAIN_VERSION_STRING "0.1.0"

#if defined(_WIN32) && defined(DT_BUILD_SHARED)
#define DT_API __declspec(dllexport)
#elif defined(__GNUC__)
#define DT_API __attribute__((visibility("default")))
#else
#define DT_API
#endif

/* Limits, named so callers can size their buffers. */
#define DT_MAX_DIMS 6        /* tensors have 0..DT_MAX_DIMS dimensions */
#define DT_MAX_NAME 128      /* parameter names, including the NUL */
#define DT_MAX_ERROR 512     /* dt_last_error() text, including the NUL */

/* ---------------------------------------------------------------------------
 * 1. Status codes and errors
 * ------------------------------------------------------------------------- */
typedef enum dt_status {
    DT_OK = 0,
    DT_EINVAL,     /* bad argument: NULL, wrong shape, out of range */
    DT_ENOMEM,     /* an allocation failed */
    DT_EIO,        /* a file or device could not be read or written */
    DT_ECORRUPT,   /* a file's contents are malformed or truncated */
    DT_EMISMATCH,  /* two things that must agree do not (shapes, names) */
    DT_ENOTSUP,    /* valid request this build or backend does not support */
    DT_ESTATE,     /* call not valid in the object's current state */
    DT_ETIMEDOUT,  /* an operation did not finish in time */
    DT_EPEER,      /* a remote rank failed or sent something unexpected */
    DT_EOF,        /* a loader has no more batches in this epoch */
    DT_EPREEMPTED  /* dt_launch: the job was pre-empted; its ranks saved a checkpoint and
                      exited DT_EXIT_PREEMPTED (dt_preempt_enable) */
} dt_status;

/* A static string describing a status ("invalid argument"); "unknown
 * status" for a value outside the enum.  Never NULL. */
DT_API const char *dt_strerror(dt_status s);

/* The library's own version, at run time (DTRAIN_VERSION_* above are the
 * header's, fixed when the caller was compiled): MAJOR * 10000 + MINOR *
 * 100 + PATCH, and "MAJOR.MINOR.PATCH" (a static string).  A program or a
 * binding that loads libdtrain.so compares them with what it was built for. */
DT_API int dt_version(void);
DT_API const char *dt_version_string(void);
/* sizeof the public struct named name ("dt_ctx_config", "dt_ddp_config", ...,
 * every struct this header defines) as this library was built, 0 for a
 * name it does not know: what a binding that mirrors the structs compares
 * its own layouts with when it loads the library. */
DT_API size_t dt_struct_size(const char *name);

/* ---------------------------------------------------------------------------
 * 2. The context
 * ------------------------------------------------------------------------- */
typedef struct dt_ctx dt_ctx;

/* Allocator hooks: all host memory the library takes goes through these (the
 * CPU backend's tensor memory too).  Set all three or none: with any left
 * NULL, all three are libc's.  They must be thread-safe once the library
 * runs threads (a store or communicator, a prefetching loader, dt_dp,
 * dt_hogwild_run): those call them too. */
typedef struct dt_allocator {
    void *(*malloc_fn)(size_t size, void *user);
    void *(*realloc_fn)(void *ptr, size_t size, void *user);
    void (*free_fn)(void *ptr, void *user);
    void *user;
} dt_allocator;

typedef struct dt_ctx_config {
    size_t struct_size;        /* set by its *_init (see "Config structs" above) */
    const char *backend;      /* "cpu" (default) or "cuda" */
    int threads;              /* compute threads; 0 means 1 */
    uint64_t seed;            /* seeds init and dropout (loaders have their own) */
    dt_allocator allocator;   /* host allocation hooks */
    size_t arena_bytes;       /* initial step arena; it grows during warm-up */
    int device;               /* device index for accelerator backends */
    /* Advanced: a backend that is not compiled in, e.g. your own accelerator
     * (the interface is struct dt_backend_iface in backends/backend.h).
     * Borrowed; must outlive the context.  NULL: pick `backend` by name. */
    const struct dt_backend_iface *custom_backend;
    /* The step arenas together grow to at most this many bytes (0: the
     * host's physical memory).  Past it a step tensor is refused with
     * DT_ENOMEM, saying so: step tensors live until dt_ctx_step_reset, and a
     * loop that never calls it grows without end.  When they grow after
     * DT_ARENA_WARN_BACKWARDS backward passes with no dt_ctx_step_reset,
     * dt_last_warning says so (once until the next reset). */
    size_t arena_max_bytes;
} dt_ctx_config;
#define DT_ARENA_WARN_BACKWARDS 8

/* Fill *cfg with the defaults. */
DT_API void dt_ctx_config_init(dt_ctx_config *cfg);

/* New context.  Returns NULL only if the context itself cannot be allocated;
 * otherwise check dt_ctx_status(): a context whose backend failed to start
 * keeps the message in dt_last_error() and refuses every other call
 * (DT_ENOTSUP: backend not compiled in, its shared object not loadable
 * ("cuda": libdtrain_cuda.so, see docs/GPU.md), or of another interface
 * version; or the backend's own status).  cfg may be NULL (defaults).  new: free with
 * dt_ctx_free.  Safe on any thread (it touches no other context). */
DT_API dt_ctx *dt_ctx_new(const dt_ctx_config *cfg);
/* Frees its tensors and parameters and detaches a DDP (waiting for a step
 * still being reduced).  NULL is fine. */
DT_API void dt_ctx_free(dt_ctx *ctx);
/* DT_OK, or why the backend failed to start (DT_EINVAL for NULL). */
DT_API dt_status dt_ctx_status(const dt_ctx *ctx);

/* The last error's message ("conv2d: input has 3 channels, weight expects
 * 1"), or "" when none.  ctx-owned; valid until the next failing call.
 * dt_last_status: that error's status.  Calls that succeed leave both as
 * they are; dt_clear_error resets them to "" and DT_OK. */
DT_API const char *dt_last_error(const dt_ctx *ctx);
DT_API dt_status dt_last_status(const dt_ctx *ctx);
DT_API void dt_clear_error(dt_ctx *ctx);
/* Device failures.  A GPU can fail underneath a call that queued work and
 * returned (a lost device, an illegal address, a refused launch).  The
 * calls that hand results back check for it and fail with DT_EIO (DT_ENOMEM
 * for device memory) and "device failure: ..." in the message:
 * dt_tensor_get, dt_tensor_item (NaN), dt_cross_entropy and dt_embedding
 * (NULL), dt_count_correct, dt_backward, dt_optim_step, dt_ctx_clip_grad_norm
 * and the loss scaler's calls.  Such a failure is sticky: the context's
 * device computes nothing trustworthy after it; free the context. */

/* Warnings: things that went wrong but did not stop the call (a parameter
 * server dropping a dead worker, a straggler).  The library prints nothing
 * itself: each warning goes to fn (called on the thread that met it, inside
 * dt_ps_serve, a DDP's sync or a checkpoint load, never a library thread;
 * user borrowed), or,
 * with no fn, to stderr only when DTRAIN_LOG is set.  fn NULL: back to that.
 * dt_last_warning: the latest one ("" if none), ctx-owned. */
typedef void (*dt_log_fn)(void *user, const char *msg);
DT_API void dt_ctx_set_log(dt_ctx *ctx, dt_log_fn fn, void *user);
DT_API const char *dt_last_warning(const dt_ctx *ctx);

/* What this rank is doing, in a few words ("compiling", "evaluating"):
 * what ranks waiting for it in a collective show in their errors, and
 * what the monitor shows.  The library says it itself while it waits
 * for a batch, runs backward, steps the optimizer, writes or reads a
 * checkpoint, evaluates or waits in a collective; a text set here is
 * shown instead until dt_ctx_set_activity(ctx, NULL).  Copied (at most 63
 * bytes).  DT_EINVAL: ctx NULL. */
DT_API dt_status dt_ctx_set_activity(dt_ctx *ctx, const char *what);
/* The activity as waiting peers see it: "waiting for its data loader for
 * 25 s" ("computing" between the library's own).  ctx-owned; "" for NULL. */
DT_API const char *dt_ctx_activity(dt_ctx *ctx);

/* The backend's name ("cpu"; "" if none) and its compute threads. */
DT_API const char *dt_backend_name(const dt_ctx *ctx);
DT_API int dt_ctx_threads(const dt_ctx *ctx);

/* Autograd switches.  grad enabled (default 1): ops record the tape.
 * training (default 1): dropout is active. */
DT_API void dt_ctx_set_grad_enabled(dt_ctx *ctx, int enabled);
DT_API int dt_ctx_grad_enabled(const dt_ctx *ctx);
DT_API void dt_ctx_set_training(dt_ctx *ctx, int training);
DT_API int dt_ctx_training(const dt_ctx *ctx);

/* Memory accounting of the step arena and persistent tensors, in bytes. */
typedef struct dt_mem_stats {
    size_t arena_capacity;    /* device bytes the step arena holds */
    size_t arena_used;        /* bytes in use now */
    size_t arena_peak;        /* high-water mark since the last reset_peak */
    size_t persistent_bytes;  /* parameters, gradients, optimizer state */
    uint64_t arena_grows;     /* times the arena had to allocate */
} dt_mem_stats;
/* Fill *out (zeros for a NULL ctx); reset_peak: arena_peak = arena_used. */
DT_API void dt_mem_stats_get(const dt_ctx *ctx, dt_mem_stats *out);
DT_API void dt_mem_peak_reset(dt_ctx *ctx);

/* Free every step tensor and the tape made since the last reset.  Call it
 * once per training step (after the optimizer step).  After the first few
 * steps the arena has its final size and a step allocates nothing. */
DT_API void dt_ctx_step_reset(dt_ctx *ctx);

/* ---------------------------------------------------------------------------
 * 3. Tensors
 * ------------------------------------------------------------------------- */
typedef struct dt_tensor dt_tensor;

typedef enum dt_dtype {
    DT_F32 = 0,   /* compute type */
    DT_I32,       /* labels and indices */
    DT_U8,        /* raw bytes (images as stored) */
    DT_BF16,      /* storage only for now: ops reject it with DT_ENOTSUP */
    DT_F16        /* storage only for now */
} dt_dtype;

/* Precision a matrix product reads its inputs at (mixed precision, 6). */
typedef enum dt_precision {
    DT_PREC_F32 = 0,   /* full f32 (the default) */
    DT_PREC_TF32,      /* inputs rounded to 10 mantissa bits (TF32 tensor cores) */
    DT_PREC_BF16,      /* bfloat16: f32's range, 7 mantissa bits */
    DT_PREC_F16        /* IEEE half: 10 mantissa bits, overflows above 65504 */
} dt_precision;

/* Bytes per element (0 for an unknown dtype) and name ("f32"; "?"). */
DT_API size_t dt_dtype_size(dt_dtype t);
DT_API const char *dt_dtype_name(dt_dtype t);

/* New persistent tensor, zero-filled.  new: free with dt_tensor_free (or it
 * is freed with the context).  DT_EINVAL: unknown dtype, ndim outside
 * 0..DT_MAX_DIMS, NULL shape, a negative or too large dimension. */
DT_API dt_tensor *dt_tensor_new(dt_ctx *ctx, dt_dtype dtype, int ndim,
                                const int64_t *shape);
/* NULL is fine; does nothing to parameters (freed with the context), step
 * tensors and a loader's batches.  The tensor is gone for the caller at
 * once; while the step's ops are recorded (before dt_backward), its memory
 * is kept until dt_ctx_step_reset, since backward may still read it. */
DT_API void dt_tensor_free(dt_tensor *t);

/* New step tensor (lives until dt_ctx_step_reset), zero-filled.  Errors as
 * dt_tensor_new. */
DT_API dt_tensor *dt_tensor_temp(dt_ctx *ctx, dt_dtype dtype, int ndim,
                                 const int64_t *shape);

/* Copy host data in or out.  count is in elements and must equal numel; the
 * host buffer's type must match the tensor's dtype.  Borrows both.
 * DT_EINVAL: host NULL or count != numel. */
DT_API dt_status dt_tensor_set(dt_tensor *t, const void *host, int64_t count);
DT_API dt_status dt_tensor_get(const dt_tensor *t, void *host, int64_t count);
/* Every element = value.  DT_EINVAL: not f32, or a non-contiguous view. */
DT_API dt_status dt_tensor_fill(dt_tensor *t, float value);
/* First element as a float (for scalar losses; i32 converted); NAN for
 * NULL, an empty tensor or another dtype. */
DT_API float dt_tensor_item(const dt_tensor *t);

/* Zero-copy access for bindings (NumPy) on backends that compute on host
 * memory (cpu); others give NULL / DT_ENOTSUP with a message.
 *
 * dt_tensor_wrap: a new persistent tensor over the caller's memory (host,
 * borrowed: it must stay valid and unmoved until dt_tensor_free, and is
 * never freed by dtrain), contiguous, aligned to the dtype's size.  new:
 * free with dt_tensor_free (or with the context).  DT_EINVAL: host NULL or
 * misaligned, or as dt_tensor_new.
 *
 * dt_tensor_data: the address of element (0,...,0); the tensor's strides
 * (dt_tensor_stride, in elements) say where the others are.  Valid while
 * the tensor lives (a step tensor until dt_ctx_step_reset).  A gradient that
 * dt_ctx_zero_grad zeroed lazily is written with zeros first, so call it again
 * after a zero_grad rather than keep an old pointer's view of one. */
DT_API dt_tensor *dt_tensor_wrap(dt_ctx *ctx, dt_dtype dtype, int ndim, const int64_t *shape,
                                 void *host);
DT_API void *dt_tensor_data(dt_tensor *t);
/* Stride of dim i in elements (i < 0 counts from the end); 0 when out of
 * range (any i, for a 0-dim tensor). */
DT_API int64_t dt_tensor_stride(const dt_tensor *t, int i);

/* Shape queries.  For NULL: ndim, dim and numel give -1, dtype DT_F32,
 * is_contiguous 0.  dt_tensor_dim: -1 when i is out of range. */
DT_API int dt_tensor_ndim(const dt_tensor *t);
DT_API int64_t dt_tensor_dim(const dt_tensor *t, int i);  /* i < 0 counts from the end */
DT_API int64_t dt_tensor_numel(const dt_tensor *t);
DT_API dt_dtype dt_tensor_dtype(const dt_tensor *t);
DT_API int dt_tensor_is_contiguous(const dt_tensor *t);
DT_API const char *dt_tensor_name(const dt_tensor *t);   /* "" if unnamed; borrowed */
/* Name a persistent tensor (name copied).  DT_EINVAL: name NULL or longer
 * than DT_MAX_NAME - 1, a step tensor, or another parameter's name. */
DT_API dt_status dt_tensor_set_name(dt_tensor *t, const char *name);

/* Gradient tensor after dt_backward, or NULL if none.  Borrowed: a
 * persistent tensor's lives with it, a step tensor's until dt_ctx_step_reset.  A
 * gradient zeroed lazily by dt_ctx_zero_grad is written with zeros first.  As in
 * PyTorch, an op's output (a tensor that is not a leaf) keeps its gradient
 * only after dt_tensor_retain_grad: backward reuses that memory once the op's
 * backward has run, so a step holds a few such gradients, not all. */
DT_API dt_tensor *dt_tensor_grad(const dt_tensor *t);
/* Keep t's gradient through dt_backward (PyTorch's retain_grad); call it
 * before the backward.  Leaves and parameters always keep theirs.
 * DT_EINVAL: t NULL. */
DT_API dt_status dt_tensor_retain_grad(dt_tensor *t);
DT_API int dt_tensor_requires_grad(const dt_tensor *t);
/* requires 1: backward gives t a gradient (a persistent tensor gets a
 * persistent buffer).  DT_EINVAL: t is not f32, or is a step tensor no op
 * made (dt_tensor_temp). */
DT_API dt_status dt_tensor_set_requires_grad(dt_tensor *t, int requires);

/* ---------------------------------------------------------------------------
 * 4. Parameters and initialisation
 * ------------------------------------------------------------------------- */
/* New parameter: a named, zero-filled tensor that requires grad, with a
 * persistent gradient of the same shape.  Parameters are kept in
 * registration order (optimizers, checkpoints and data parallelism use it).
 * ctx-owned.  Names must be unique.  DT_EINVAL: name empty, longer than
 * DT_MAX_NAME - 1 or taken; a bad shape (as dt_tensor_new). */
DT_API dt_tensor *dt_param_new(dt_ctx *ctx, const char *name, int ndim,
                               const int64_t *shape);
/* Parameters registered so far; the i-th, or the one named name (NULL when
 * there is none).  Borrowed. */
DT_API int dt_param_count(const dt_ctx *ctx);
DT_API dt_tensor *dt_param_at(const dt_ctx *ctx, int i);
DT_API dt_tensor *dt_param_find(const dt_ctx *ctx, const char *name);
/* Zero every parameter's gradient (lazily: a flag, written on first use).
 * With a DDP, a zero_grad before dt_ddp_sync discards that step. */
DT_API void dt_ctx_zero_grad(dt_ctx *ctx);

/* Initialisers draw from the context's seeded generator on the host.
 * fan_in = dim(1) * receptive field, as PyTorch counts it.  DT_EINVAL: t
 * NULL, of another context or not f32; kaiming and xavier: fewer than 2
 * dims or a zero one; init_bias: fan_in <= 0. */
DT_API dt_status dt_tensor_init_uniform(dt_ctx *ctx, dt_tensor *t, float lo, float hi);
DT_API dt_status dt_tensor_init_normal(dt_ctx *ctx, dt_tensor *t, float mean, float std);
/* Kaiming (He), gain sqrt(2/(1+a^2)) on fan_in: a = 0 for ReLU, a = sqrt(5)
 * gives PyTorch's nn.Linear / nn.Conv2d default. */
DT_API dt_status dt_tensor_init_kaiming_uniform(dt_ctx *ctx, dt_tensor *t, float a);
DT_API dt_status dt_tensor_init_kaiming_normal(dt_ctx *ctx, dt_tensor *t, float a);
DT_API dt_status dt_tensor_init_xavier_uniform(dt_ctx *ctx, dt_tensor *t, float gain);
DT_API dt_status dt_tensor_init_xavier_normal(dt_ctx *ctx, dt_tensor *t, float gain);
/* PyTorch's bias default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)). */
DT_API dt_status dt_tensor_init_bias(dt_ctx *ctx, dt_tensor *bias, int64_t fan_in);
/* Layers: a model in a few lines, without init constants.  Each makes
 * parameters named "<name>.weight" and "<name>.bias" (PyTorch's names, so
 * checkpoints line up) with PyTorch's default initialisation:
 *   linear: weight (out, in) kaiming_uniform(a = sqrt 5), bias (out)
 *     U(+-1/sqrt(in)), as nn.Linear (use with dt_linear);
 *   conv2d: weight (out, in, k, k), bias (out), the same with fan_in
 *     in*k*k, as nn.Conv2d;
 *   embedding: weight (num, dim) N(0, 1), as nn.Embedding;
 *   layer_norm: weight (dim) ones, bias (dim) zeros, as nn.LayerNorm.
 * bias 0: no bias (*b set NULL, b may be NULL).  The draws come from the
 * context's generator in this order.  DT_EINVAL: a name empty or too long,
 * taken, sizes < 1, NULL outputs. */
DT_API dt_status dt_linear_params(dt_ctx *ctx, const char *name, int64_t in, int64_t out,
                                  int bias, dt_tensor **w, dt_tensor **b);
DT_API dt_status dt_conv2d_params(dt_ctx *ctx, const char *name, int64_t in_channels,
                                  int64_t out_channels, int kernel, int bias, dt_tensor **w,
                                  dt_tensor **b);
DT_API dt_tensor *dt_embedding_params(dt_ctx *ctx, const char *name, int64_t num, int64_t dim);
DT_API dt_status dt_layer_norm_params(dt_ctx *ctx, const char *name, int64_t dim, int bias,
                                      dt_tensor **w, dt_tensor **b);
/* Reseed the context's generator (init and dropout derive from it; a
 * loader shuffles from its own seed); dropout's step counter restarts. */
DT_API void dt_ctx_seed(dt_ctx *ctx, uint64_t seed);

/* ---------------------------------------------------------------------------
 * 5. Ops (define-by-run autograd)
 *
 * Every op returns a new step tensor (freed by dt_ctx_step_reset) and records
 * itself on the tape when grad is enabled and an input requires grad.
 * Shapes are written as in PyTorch.  Inputs are borrowed.  On failure an op
 * returns NULL with the reason in the context: DT_EINVAL for an input of
 * another context, a shape, dim, index or argument out of range, or a
 * dtype the op does not take (DT_ENOTSUP for bf16 and f16).
 * ------------------------------------------------------------------------- */

/* Views: share memory with x (reshape and flatten copy a non-contiguous x
 * first).  reshape: one -1 allowed; flatten: dims >= start_dim merged. */
DT_API dt_tensor *dt_reshape(dt_ctx *ctx, dt_tensor *x, int ndim, const int64_t *shape);
DT_API dt_tensor *dt_flatten(dt_ctx *ctx, dt_tensor *x, int start_dim);
DT_API dt_tensor *dt_transpose(dt_ctx *ctx, dt_tensor *x, int d0, int d1);
DT_API dt_tensor *dt_slice(dt_ctx *ctx, dt_tensor *x, int dim, int64_t start, int64_t end);
/* view whose dim i is x's dim dims[i] (dims: a permutation of 0..ndim-1,
 * ndim = x's), as torch's permute.  DT_EINVAL: not a permutation. */
DT_API dt_tensor *dt_permute(dt_ctx *ctx, dt_tensor *x, int ndim, const int *dims);
/* Contiguous copy of a (possibly strided) view; returns x itself if it already is. */
DT_API dt_tensor *dt_contiguous(dt_ctx *ctx, dt_tensor *x);
DT_API dt_tensor *dt_concat(dt_ctx *ctx, dt_tensor *const *xs, int n, int dim);

/* Linear algebra.
 * matmul: a (M,K) b (K,N) -> (M,N); batched a (B,M,K) b (B,K,N) or b (K,N)
 * -> (B,M,N).  trans_a / trans_b use the transpose of that operand. */
DT_API dt_tensor *dt_matmul(dt_ctx *ctx, dt_tensor *a, dt_tensor *b, int trans_a, int trans_b);
/* linear: x (..., In), w (Out,In), b (Out) or NULL -> (..., Out) = x w^T + b
 * over the last dim, as torch.nn.functional.linear: (B, T, C) needs no
 * reshape (so do dt_tp_linear_col and dt_tp_linear_row). */
DT_API dt_tensor *dt_linear(dt_ctx *ctx, dt_tensor *x, dt_tensor *w, dt_tensor *b);

/* Elementwise with NumPy/PyTorch broadcasting. */
DT_API dt_tensor *dt_add(dt_ctx *ctx, dt_tensor *a, dt_tensor *b);
DT_API dt_tensor *dt_sub(dt_ctx *ctx, dt_tensor *a, dt_tensor *b);
DT_API dt_tensor *dt_mul(dt_ctx *ctx, dt_tensor *a, dt_tensor *b);
DT_API dt_tensor *dt_div(dt_ctx *ctx, dt_tensor *a, dt_tensor *b);
DT_API dt_tensor *dt_scale(dt_ctx *ctx, dt_tensor *x, float s);
/* a^b elementwise with broadcasting (gradients to both, as torch.pow;
 * log(a) in b's gradient: NaN for a < 0); pow_scalar: x^p. */
DT_API dt_tensor *dt_pow(dt_ctx *ctx, dt_tensor *a, dt_tensor *b);
DT_API dt_tensor *dt_pow_scalar(dt_ctx *ctx, dt_tensor *x, float p);
/* where: cond != 0 ? a : b, broadcasting the three (cond f32, e.g. 0/1);
 * masked_fill: value where mask != 0, x elsewhere.  They select rather
 * than multiply, so an infinite value (-INFINITY, an attention mask's)
 * never makes a NaN.  cond and mask get no gradient. */
DT_API dt_tensor *dt_where(dt_ctx *ctx, dt_tensor *cond, dt_tensor *a, dt_tensor *b);
DT_API dt_tensor *dt_masked_fill(dt_ctx *ctx, dt_tensor *x, dt_tensor *mask, float value);

/* Reductions.  dt_sum/dt_mean: all elements -> scalar (ndim 0).
 * *_dim: over one dim (negative counts from the end). */
DT_API dt_tensor *dt_sum(dt_ctx *ctx, dt_tensor *x);
DT_API dt_tensor *dt_mean(dt_ctx *ctx, dt_tensor *x);
DT_API dt_tensor *dt_sum_dim(dt_ctx *ctx, dt_tensor *x, int dim, int keepdim);
DT_API dt_tensor *dt_mean_dim(dt_ctx *ctx, dt_tensor *x, int dim, int keepdim);

/* Activations. gelu is the exact (erf) form, as torch.nn.GELU(). */
DT_API dt_tensor *dt_relu(dt_ctx *ctx, dt_tensor *x);
DT_API dt_tensor *dt_gelu(dt_ctx *ctx, dt_tensor *x);
DT_API dt_tensor *dt_tanh(dt_ctx *ctx, dt_tensor *x);
DT_API dt_tensor *dt_sigmoid(dt_ctx *ctx, dt_tensor *x);
/* GPT-2's gelu, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), as
 * torch's GELU(approximate="tanh"); and exp, log (-inf at 0, NaN below),
 * sqrt (NaN below 0), elementwise. */
DT_API dt_tensor *dt_gelu_tanh(dt_ctx *ctx, dt_tensor *x);
DT_API dt_tensor *dt_exp(dt_ctx *ctx, dt_tensor *x);
DT_API dt_tensor *dt_log(dt_ctx *ctx, dt_tensor *x);
DT_API dt_tensor *dt_sqrt(dt_ctx *ctx, dt_tensor *x);
DT_API dt_tensor *dt_softmax(dt_ctx *ctx, dt_tensor *x, int dim);
DT_API dt_tensor *dt_log_softmax(dt_ctx *ctx, dt_tensor *x, int dim);

/* Losses, mean over the batch -> scalar.
 * cross_entropy: logits (..., C) f32 (e.g. (N, C), or a language model's
 * (B, T, V)), labels (...) i32 in [0, C), as torch's F.cross_entropy.
 * _ignore: labels equal to ignore_index (e.g. -100, or a padding id) add
 * no loss and no gradient, and the mean is over the others (NaN when none
 * is left, as torch). */
DT_API dt_tensor *dt_cross_entropy(dt_ctx *ctx, dt_tensor *logits, dt_tensor *labels);
DT_API dt_tensor *dt_cross_entropy_ignore(dt_ctx *ctx, dt_tensor *logits, dt_tensor *labels,
                                          int ignore_index);
DT_API dt_tensor *dt_mse(dt_ctx *ctx, dt_tensor *pred, dt_tensor *target);

/* Convolution and pooling, NCHW.
 * conv2d: x (N,C,H,W), w (O,C,KH,KW), b (O) or NULL -> (N,O,OH,OW),
 * OH = (H + 2*pad - KH)/stride + 1. */
DT_API dt_tensor *dt_conv2d(dt_ctx *ctx, dt_tensor *x, dt_tensor *w, dt_tensor *b,
                            int stride, int pad);
/* Pooling: stride 0 means stride = kernel (PyTorch's default); pad <= kernel/2. */
DT_API dt_tensor *dt_max_pool2d(dt_ctx *ctx, dt_tensor *x, int kernel, int stride, int pad);
DT_API dt_tensor *dt_avg_pool2d(dt_ctx *ctx, dt_tensor *x, int kernel, int stride, int pad);

/* embedding: weight (V,D), idx i32 any shape -> (*idx.shape, D).  The
 * weight's gradient is written only in the rows idx uses. */
DT_API dt_tensor *dt_embedding(dt_ctx *ctx, dt_tensor *weight, dt_tensor *idx);
/* layer_norm over the last dim: x (..., D), w (D) or NULL, b (D) or NULL. */
DT_API dt_tensor *dt_layer_norm(dt_ctx *ctx, dt_tensor *x, dt_tensor *w, dt_tensor *b, float eps);
/* Your own op, with its own backward, from outside the library (as a
 * torch.autograd.Function).  dt_custom_op calls forward(ctx, inputs, n,
 * user) with gradients off: it computes the output any way it likes (ops,
 * or dt_tensor_set of host results) and returns it, a new step tensor (not
 * an input).  When some input needs a gradient the output is recorded on
 * the tape, and backward later gets the inputs, the output and its
 * gradient dout, and sets grads[i] (NULL on entry) to the gradient of input
 * i, an f32 tensor of its shape made with ops or dt_tensor_temp; it runs
 * with gradients off, and dtrain adds each grads[i] to input i's gradient
 * (one left NULL adds nothing; those of inputs needing none are ignored).
 * n is 1 to 3; name is copied; user is borrowed.  Returns the output, or
 * NULL: DT_EINVAL (NULLs, n out of range, forward returned NULL or an
 * input), or forward's own error; a failing backward, or a grads[i] of
 * another shape or type, stops dt_backward with that error. */
typedef dt_tensor *(*dt_custom_forward_fn)(dt_ctx *ctx, dt_tensor *const *inputs, int n,
                                           void *user);
typedef dt_status (*dt_custom_backward_fn)(dt_ctx *ctx, dt_tensor *const *inputs, int n,
                                           dt_tensor *out, dt_tensor *dout, dt_tensor **grads,
                                           void *user);
DT_API dt_tensor *dt_custom_op(dt_ctx *ctx, const char *name, dt_tensor *const *inputs, int n,
                               dt_custom_forward_fn forward, dt_custom_backward_fn backward,
                               void *user);
/* Scaled dot-product attention, as torch's F.scaled_dot_product_attention:
 * q, k, v of one shape (..., T, D) (e.g. (B, heads, T, D)) -> (..., T, D) =
 * softmax(scale q k^T + mask) v per leading index, scale 0 meaning
 * 1/sqrt(D); mask (T, T) f32 is added to the scores (-inf blocks; no
 * gradient) and may be NULL; causal blocks key j > query i.  Fused: the
 * (T, T) scores are never kept; backward recomputes them from the row
 * log-sum-exps.  DT_EINVAL: shapes; DT_ENOTSUP: a backend without it. */
DT_API dt_tensor *dt_attention(dt_ctx *ctx, dt_tensor *q, dt_tensor *k, dt_tensor *v,
                               dt_tensor *mask, int causal, float scale);
/* dropout with probability p, scaled by 1/(1-p); identity when not
 * training.  The mask comes from the context's seed and a step counter. */
DT_API dt_tensor *dt_dropout(dt_ctx *ctx, dt_tensor *x, float p);

/* Activation checkpointing: run fn(ctx, inputs, user) without keeping its
 * intermediate tensors; during backward it runs again to rebuild them.  fn
 * must be deterministic (dropout inside it is replayed with the same mask)
 * and return one tensor.  Returns that tensor (step).  fn runs on the
 * caller's thread, here and in dt_backward; the input tensors (not the
 * array) and user stay borrowed until then.  A rerun whose shape differs
 * fails that backward (DT_ESTATE). */
typedef dt_tensor *(*dt_segment_fn)(dt_ctx *ctx, dt_tensor *const *inputs, int n, void *user);
DT_API dt_tensor *dt_recompute(dt_ctx *ctx, dt_segment_fn fn, dt_tensor *const *inputs,
                               int n, void *user);

/* ---------------------------------------------------------------------------
 * 6. Autograd
 * ------------------------------------------------------------------------- */
/* Back-propagate from a scalar loss.  Parameter gradients accumulate (+=)
 * until dt_ctx_zero_grad, so several micro-batches can be summed before one
 * optimizer step.  The graph is used up: its tensors stay until
 * dt_ctx_step_reset, but a second backward through it gives DT_ESTATE (run the
 * forward again).  DT_EINVAL: loss NULL, of another context, not one f32
 * value, or not requiring grad.  With a DDP: DT_ESTATE for parameters
 * registered after dt_ddp_new, or a compressed DDP not synced since the
 * last backward; and the errors of finishing the previous step's
 * reduction, as dt_ddp_sync. */
DT_API dt_status dt_backward(dt_ctx *ctx, dt_tensor *loss);

/* Mixed precision, as torch.autocast: while autocast is p, matmul, linear
 * and conv2d read their inputs rounded to p and sum the products in f32
 * (tensor cores on CUDA; the CPU rounds the same way, so CPU runs show what
 * a GPU run's numerics will be).  Their outputs, every other op, the
 * parameters (the f32 master weights) and the optimizer stay f32.  Backward
 * runs each product at the precision its forward used.  DT_PREC_F32 turns it
 * off.  Per context; set it around the forward.  DT_EINVAL: p is not a
 * dt_precision; DT_ENOTSUP: the backend cannot round to it. */
DT_API dt_status dt_ctx_set_autocast(dt_ctx *ctx, dt_precision p);
DT_API dt_precision dt_ctx_autocast(const dt_ctx *ctx);


/* ---------------------------------------------------------------------------
 * 7. Optimizers and schedules
 * ------------------------------------------------------------------------- */
typedef struct dt_optim dt_optim;

typedef enum dt_optim_kind { DT_SGD = 0, DT_ADAM, DT_ADAMW, DT_ADAGRAD } dt_optim_kind;

typedef struct dt_optim_config {
    size_t struct_size;        /* set by its *_init (see "Config structs" above) */
    dt_optim_kind kind;
    float lr;
    float momentum;       /* SGD */
    float dampening;      /* SGD */
    int nesterov;         /* SGD */
    float weight_decay;   /* SGD/Adam/AdaGrad: L2 added to the gradient; AdamW: decoupled */
    float beta1, beta2;   /* Adam, AdamW */
    float eps;            /* Adam, AdamW (default 1e-8), AdaGrad (default 1e-10) */
    /* Mixed precision as large-model training does it (Megatron, DeepSpeed,
     * FSDP's MixedPrecision); see "16-bit parameters" in docs/DATA_PARALLEL.md.
     * param_dtype DT_BF16 or DT_F16: the parameters hold values of that
     * precision (rounded to nearest even) and the optimizer keeps the f32
     * master weights: whole, or with a sharded DDP (dt_ddp_config.zero)
     * only this rank's shard.  Each step updates the masters and writes
     * them, rounded, into the parameters.  DT_F32 (default): no masters.
     * state_dtype DT_BF16: the moments (momentum buffer, exp_avg,
     * exp_avg_sq, AdaGrad's sum) are stored in bf16 and updated in f32.
     * DT_F32 (default).  f16 state is refused (its range loses g*g). */
    dt_dtype param_dtype;
    dt_dtype state_dtype;
} dt_optim_config;

/* Defaults as PyTorch's: SGD lr 0.01; Adam lr 1e-3, betas (0.9, 0.999),
 * eps 1e-8; AdamW also weight_decay 0.01. */
DT_API void dt_optim_config_init(dt_optim_config *cfg, dt_optim_kind kind);

/* New optimizer over params[0..n) (borrowed), or over every parameter of
 * the context when params is NULL.  new: free with dt_optim_free.
 * DT_EINVAL: cfg NULL or out of range (kind, lr, weight_decay, momentum,
 * dampening, nesterov, betas, eps), n < 1, or an entry that is not a
 * parameter of ctx; DT_ENOTSUP: AdaGrad on a backend without it. */
DT_API dt_optim *dt_optim_new(dt_ctx *ctx, const dt_optim_config *cfg,
                              dt_tensor *const *params, int n);

/* Parameter groups, as torch.optim's param_groups: each group's parameters
 * and the hyper-parameters it sets differently from the optimizer's
 * dt_optim_config; a field left as dt_param_group_init made it (NaN,
 * nesterov -1) is the config's.  The usual recipe, no decay on biases and
 * norms:
 *
 *     dt_param_group g[2];
 *     dt_param_group_init(&g[0], matrices, n_matrices);   // the config's decay
 *     dt_param_group_init(&g[1], vectors, n_vectors);
 *     g[1].weight_decay = 0.0f;
 *     dt_optim *opt = dt_optim_new_groups(ctx, &cfg, g, 2);
 *
 * kind, param_dtype and state_dtype are the optimizer's, for all groups.
 * A schedule (dt_optim_set_schedule) scales each group's own base lr. */
#define DT_OPTIM_MAX_GROUPS 128
typedef struct dt_param_group {
    size_t struct_size;        /* set by dt_param_group_init */
    dt_tensor *const *params;  /* borrowed for the call (the optimizer keeps its own list) */
    int n;                     /* >= 0; an empty group is allowed, as in PyTorch */
    float lr, momentum, dampening, weight_decay, beta1, beta2, eps;
    int nesterov;
} dt_param_group;
DT_API void dt_param_group_init(dt_param_group *g, dt_tensor *const *params, int n);
/* New optimizer over groups[0..n_groups) (1 to DT_OPTIM_MAX_GROUPS); its
 * parameters are the groups' in order (dt_optim_state_at's order).  new:
 * free with dt_optim_free.  DT_EINVAL: as dt_optim_new, for any group's
 * values too, or a parameter in two groups, or no parameter in any. */
DT_API dt_optim *dt_optim_new_groups(dt_ctx *ctx, const dt_optim_config *cfg,
                                     const dt_param_group *groups, int n_groups);
DT_API int dt_optim_group_count(const dt_optim *opt);   /* 1 for dt_optim_new; 0: NULL */
/* The group param is in, or -1 (not one of opt's parameters, or NULL). */
DT_API int dt_optim_group_of(const dt_optim *opt, const dt_tensor *param);
/* The group's hyper-parameters as a full config (kind and dtypes the
 * optimizer's; lr the one its last step used).  DT_EINVAL: a group out of
 * range, out NULL. */
DT_API dt_status dt_optim_group_config(const dt_optim *opt, int group, dt_optim_config *out);
/* Set one group's lr (and its schedule base).  DT_EINVAL: group out of
 * range, lr < 0 or NaN. */
DT_API dt_status dt_optim_set_group_lr(dt_optim *opt, int group, float lr);
DT_API void dt_optim_free(dt_optim *opt);          /* NULL is fine */
/* One update from the current gradients; with a schedule, the update with
 * index t (0-based) uses dt_schedule_lr(s, base, t).  Parameters that got no
 * gradient since the last zero_grad are skipped (as PyTorch skips None).
 * Fails for NULL, or a device failure (section 2). */
DT_API dt_status dt_optim_step(dt_optim *opt);
/* dt_ctx_zero_grad for this optimizer's parameters only. */
DT_API void dt_optim_zero_grad(dt_optim *opt);
/* The learning rate the last step used (before any: the base); with
 * parameter groups, group 0's (dt_optim_group_config for the others). */
DT_API float dt_optim_lr(const dt_optim *opt);
/* Set the lr, and a schedule's base, of every group (dt_optim_set_group_lr
 * for one).  DT_EINVAL: lr < 0 or NaN. */
DT_API dt_status dt_optim_set_lr(dt_optim *opt, float lr);
DT_API int64_t dt_optim_steps(const dt_optim *opt);   /* steps taken */

/* Optimizer state as named tensors ("fc1.weight.exp_avg",
 * "fc1.weight.momentum_buffer"), for checkpoints.  Borrowed: owned by opt
 * (freed with it).  dt_optim_state_at: NULL when i is out of range. */
DT_API int dt_optim_state_count(const dt_optim *opt);
DT_API dt_tensor *dt_optim_state_at(const dt_optim *opt, int i);

typedef enum dt_sched_kind { DT_SCHED_CONSTANT = 0, DT_SCHED_STEP, DT_SCHED_COSINE } dt_sched_kind;
typedef struct dt_schedule {
    dt_sched_kind kind;
    int64_t step_size;     /* STEP: base * gamma^floor(step/step_size) */
    float gamma;
    int64_t warmup_steps;  /* COSINE: lr = base*(step+1)/warmup_steps while  */
    int64_t total_steps;   /*   step < warmup_steps, then min_lr + (base-min_lr)*
                            *   (1+cos(pi*q))/2, q = (step-warmup)/(total-warmup)
                            *   clamped to [0,1] */
    float min_lr;
} dt_schedule;
/* The learning rate at a step for a base rate (pure function; s NULL or
 * step < 0: base_lr). */
DT_API float dt_schedule_lr(const dt_schedule *s, float base_lr, int64_t step);
/* Attach a schedule (copied); base lr is the optimizer's lr at that moment.
 * DT_EINVAL: s NULL, an unknown kind, STEP with step_size or gamma <= 0,
 * COSINE without total_steps > 0 and 0 <= warmup_steps <= total_steps. */
DT_API dt_status dt_optim_set_schedule(dt_optim *opt, const dt_schedule *s);

/* Scale all gradients so their global L2 norm is at most max_norm.  The norm
 * before clipping goes to *norm_out if not NULL.  With a DDP, call it after
 * dt_ddp_sync.  DT_EINVAL: max_norm <= 0. */
DT_API dt_status dt_ctx_clip_grad_norm(dt_ctx *ctx, float max_norm, float *norm_out);

/* Dynamic loss scaling for fp16 (torch.cuda.amp.GradScaler): small
 * gradients that fp16 would flush to zero are kept by scaling the loss
 * before backward; a step whose gradients overflowed is skipped and the
 * scale halved, and after growth_interval good steps in a row it doubles.
 *
 *     dt_loss_scaler_backward(sc, loss);   // backward of loss * scale
 *     dt_ddp_sync(ddp);                    // with DDP: reduced first
 *     dt_loss_scaler_unscale(sc);          // optional: e.g. to clip norms
 *     dt_loss_scaler_step(sc, opt, &took); // unscale, check, step or skip
 *
 * Overflow is checked on the reduced gradients, so with DDP every rank
 * makes the same choice (unscale finishes the DDP's reduction itself).
 * One optimizer per scaler: unscale divides every parameter's gradient.
 * Refused (DT_ENOTSUP): a DDP that pushes to a parameter server (the
 * servers would step on scaled gradients) or uses top-k / int8 compression
 * (their error feedback would keep scaled values).  DT_ESTATE: a step or
 * unscale with no scaled backward since the last step, or a backward after
 * unscale. */
typedef struct dt_loss_scaler dt_loss_scaler;
typedef struct dt_loss_scale_config {
    size_t struct_size;        /* set by its *_init (see "Config structs" above) */
    float init_scale;        /* 65536 */
    float growth_factor;     /* 2 */
    float backoff_factor;    /* 0.5 */
    int growth_interval;     /* 2000 */
} dt_loss_scale_config;
DT_API void dt_loss_scale_config_init(dt_loss_scale_config *cfg);
/* cfg may be NULL (defaults).  new: free with dt_loss_scaler_free.
 * DT_EINVAL unless init_scale > 0, growth_factor >= 1, 0 < backoff_factor
 * < 1 and growth_interval >= 1. */
DT_API dt_loss_scaler *dt_loss_scaler_new(dt_ctx *ctx, const dt_loss_scale_config *cfg);
DT_API void dt_loss_scaler_free(dt_loss_scaler *sc);   /* NULL is fine */
/* dt_backward with the loss's gradient seeded with the scale; its errors. */
DT_API dt_status dt_loss_scaler_backward(dt_loss_scaler *sc, dt_tensor *loss);
/* Divide every parameter gradient by the scale (once per step) and note
 * whether any is inf or NaN; *found_inf (may be NULL) gets that.  With a
 * DDP, dt_ddp_sync's errors. */
DT_API dt_status dt_loss_scaler_unscale(dt_loss_scaler *sc, int *found_inf);
/* Unscale if not done yet; then opt's step unless a gradient overflowed,
 * and update the scale.  *stepped (may be NULL): 1 if the step was taken.
 * DT_EINVAL: opt NULL or of another context. */
DT_API dt_status dt_loss_scaler_step(dt_loss_scaler *sc, dt_optim *opt, int *stepped);
DT_API float dt_loss_scaler_scale(const dt_loss_scaler *sc);   /* now; NAN for NULL */
/* Steps skipped for overflow since dt_loss_scaler_new. */
DT_API int64_t dt_loss_scaler_skipped(const dt_loss_scaler *sc);

/* ---------------------------------------------------------------------------
 * 8. Checkpoints (safetensors)
 * ------------------------------------------------------------------------- */
/* Options of a save and a load (NULL: the defaults), as torch's save and
 * load_state_dict(strict=False) give. */
typedef struct dt_checkpoint_config {
    size_t struct_size;        /* set by its *_init (see "Config structs" above) */
    dt_dtype dtype;            /* save: parameters as DT_F32 (default), DT_BF16 or DT_F16
                                  (rounded to nearest even; optimizer state stays f32) */
    int n_meta;                /* save: your metadata, n_meta key/value strings (borrowed);
                                  keys other than "format" and those starting "dtrain." */
    const char *const *meta_keys;
    const char *const *meta_values;
    int strict;                /* load: 1 (default): every parameter, exactly; 0: load each
                                  parameter the file has with its shape, leave the others,
                                  ignore the file's extra tensors, and report them */
} dt_checkpoint_config;
/* What a non-strict load did: parameters loaded, the model's missing from
 * the file, the file's that the model lacks, those of another shape or a
 * non-float type; names lists them ("missing: a, b; unexpected: c; ..."),
 * cut at its size. */
typedef struct dt_checkpoint_report {
    int loaded, missing, unexpected, mismatched;
    char names[512];
} dt_checkpoint_report;
DT_API void dt_checkpoint_config_init(dt_checkpoint_config *cfg);

/* Save every parameter, the optimizer's state (if opt is not NULL) and the
 * step to path, in the safetensors format, with a CRC-32 (zlib's) of each
 * tensor's data and of the header in the metadata ("dtrain.crc32.<name>",
 * "dtrain.header_crc32").  Written to path.tmp, fsync'd, then renamed, so a
 * crash mid-write leaves the old file.  cfg may be NULL (f32, no metadata of
 * yours).  DT_EINVAL: path empty, opt of another context, a dtype other than
 * f32, bf16, f16; a metadata key NULL, empty, reserved or repeated, a value
 * NULL; DT_EIO: path.tmp cannot be written, synced or renamed.  Borrows all. */
DT_API dt_status dt_checkpoint_save(dt_ctx *ctx, const dt_optim *opt, const char *path,
                                    int64_t step, const dt_checkpoint_config *cfg);
/* Load a checkpoint into the parameters (and opt's state if not NULL); F32,
 * BF16 and F16 tensors are read (widened to f32).  cfg may be NULL (strict),
 * step_out and report may be NULL.  The file is checked whole before
 * anything is copied, and a refused file changes nothing (parameters,
 * optimizer, *step_out).  DT_ECORRUPT: truncated;
 * a malformed header; tensors whose data offsets do not tile the data
 * exactly (overlaps, holes, out of range) or that are named twice;
 * dtrain's metadata incomplete, unknown ("dtrain.*" keys this version does
 * not write), malformed or inconsistent; a checksum that does not match
 * (any flipped bit of a file dtrain wrote).  A file without checksums (from
 * another tool) loads, with a note through dt_ctx_set_log.  DT_EMISMATCH
 * (strict): a parameter missing, extra or of another shape; no state for
 * opt's kind.  DT_EIO: not a regular file (a FIFO, a directory, a device:
 * opened without blocking, never read) or unreadable; DT_EINVAL: path NULL,
 * opt of another context, a non-strict load with an optimizer.  path may
 * also be the directory of a sharded checkpoint (dt_ddp_checkpoint_save):
 * every parameter and opt's state are then loaded whole from its shards,
 * whatever the world size and sharding level it was saved at (each shard
 * checked first, as a file is; a shard missing, from another step or
 * corrupt: refused, naming it).  DT_EINVAL also: opt's state is sharded
 * (dt_ddp_checkpoint_load), or path is one shard file of such a checkpoint. */
DT_API dt_status dt_checkpoint_load(dt_ctx *ctx, dt_optim *opt, const char *path,
                                    const dt_checkpoint_config *cfg, int64_t *step_out,
                                    dt_checkpoint_report *report);
/* The newest complete checkpoint in dir: of its regular files named
 * "*.safetensors", the one with the highest "dtrain.step" among those that
 * pass every check of a load (layout, metadata, checksums), its path into
 * path (cut at cap: DT_EINVAL) and its step into *step (may be NULL).  None:
 * DT_OK with path "" and *step -1.  Files that fail the checks are skipped
 * with a note through dt_ctx_set_log.  What an elastic restart resumes from
 * (dtrun --max-restarts; the examples' --resume auto).  Subdirectories
 * that are sharded checkpoints (an index.json and every shard passing the
 * same checks) count too; path is then the directory.  DT_EINVAL: NULLs,
 * cap 0; DT_EIO: dir cannot be read. */
DT_API dt_status dt_checkpoint_latest(dt_ctx *ctx, const char *dir, char *path, size_t cap,
                                      int64_t *step);
/* The value of metadata key in the checkpoint at path (a NUL-terminated
 * string into value, cut at len); the file is read and checked whole, as
 * for a load.  DT_EINVAL:
 * NULLs, len 0; DT_EIO, DT_ECORRUPT as dt_checkpoint_load; DT_EMISMATCH:
 * no such key. */
DT_API dt_status dt_checkpoint_metadata(dt_ctx *ctx, const char *path, const char *key,
                                        char *value, size_t len);
/* A sharded checkpoint's directory (dt_ddp_checkpoint_save) written as the
 * one file dt_checkpoint_save would have written for the same model and
 * optimizer in one process (path, via path.tmp; safetensors, loadable by
 * dt_checkpoint_load and PyTorch's safetensors reader).  Needs no model: the
 * index names the tensors.  Holds the whole model and its state in memory
 * while it runs.  DT_EINVAL: NULLs, empty; DT_EIO, DT_ECORRUPT: a shard or
 * the index missing, from another step, truncated or corrupt (named). */
DT_API dt_status dt_checkpoint_consolidate(dt_ctx *ctx, const char *dir, const char *path);

/* ---------------------------------------------------------------------------
 * 9. Data
 *
 * A dataset is read-only once loaded: loaders of any context, on any
 * thread, may share it.  A loader is used by its context's thread; its
 * prefetch thread fills the next batch meanwhile.
 * ------------------------------------------------------------------------- */
typedef struct dt_dataset dt_dataset;
typedef struct dt_loader dt_loader;
typedef struct dt_comm dt_comm;     /* a communicator (section 10) */

/* Read an IDX image file and its label file (gzip or plain; zlib reads
 * both).  Images stay uint8 in memory.  new: free with dt_dataset_free.
 * DT_EINVAL: a path NULL; DT_EIO: a file cannot be opened; DT_ECORRUPT: not
 * a uint8 IDX file, or truncated; DT_EMISMATCH: image and label counts
 * differ. */
DT_API dt_dataset *dt_dataset_load_idx(dt_ctx *ctx, const char *images_path,
                                       const char *labels_path);
DT_API void dt_dataset_free(dt_dataset *ds);       /* NULL is fine */
DT_API int64_t dt_dataset_size(const dt_dataset *ds);   /* samples; 0 for NULL */
/* The input's shape without the batch dim, e.g. {1, 28, 28}, into
 * shape_out (room for DT_MAX_DIMS - 1 entries, may be NULL); returns its
 * ndim (0 for NULL). */
DT_API int dt_dataset_sample_shape(const dt_dataset *ds, int64_t *shape_out);
/* Scalar integer targets (labels): the largest + 1; 0 for other targets
 * and for callback datasets. */
DT_API int dt_dataset_classes(const dt_dataset *ds);
/* Raw access for u8 inputs held in memory (IDX, u8 arrays): sample i's
 * bytes (borrowed, valid while ds lives), NULL otherwise or when i is out
 * of range; and its label for a scalar integer target, -1 otherwise. */
DT_API const uint8_t *dt_dataset_image(const dt_dataset *ds, int64_t i);
DT_API int dt_dataset_label(const dt_dataset *ds, int64_t i);

/* Your own data.  A dataset is n samples, each an input and a target of
 * fixed shapes and element types (a dt_sample_field each, without the batch
 * dim; ndim 0 is a scalar, e.g. a class label).  Element types: DT_F32,
 * DT_I32, DT_U8, DT_BF16, DT_F16.  A loader's batches are x (B, input
 * shape) and y (B, target shape): i32 for DT_I32 inputs (token ids) and for
 * DT_I32 or DT_U8 targets (labels), f32 for everything else (bf16 and f16
 * widened, u8 inputs as their values, or value/255 with dt_dataset_normalize).
 * Everything a loader and dt_evaluate do works for every kind. */
typedef struct dt_sample_field {
    dt_dtype dtype;
    int ndim;                         /* 0..DT_MAX_DIMS-1 */
    int64_t shape[DT_MAX_DIMS - 1];
} dt_sample_field;

/* From your arrays: inputs holds n samples of `input`, targets n of
 * `target`, each contiguous and row-major.  copy 0: used in place, without
 * a copy (both arrays borrowed: keep them alive and unchanged until
 * dt_dataset_free); copy 1: copied now.  new: free with dt_dataset_free.
 * DT_EINVAL: NULLs, n < 1, a field with an unsupported dtype or a bad
 * shape; DT_ENOMEM. */
DT_API dt_dataset *dt_dataset_from_memory(dt_ctx *ctx, int64_t n, const dt_sample_field *input,
                                          const void *inputs, const dt_sample_field *target,
                                          const void *targets, int copy);
/* From raw binary files of samples back to back (little-endian, no
 * header), memory-mapped: n is the inputs file's size over one input's
 * bytes, and the targets file must hold as many.  DT_EIO: a file cannot
 * be opened or mapped; DT_ECORRUPT: a size that is not a whole number of
 * samples, or the two files disagree on n. */
DT_API dt_dataset *dt_dataset_load_raw(dt_ctx *ctx, const char *inputs_path,
                                       const dt_sample_field *input, const char *targets_path,
                                       const dt_sample_field *target);
/* From NumPy .npy files (format 1.0-3.0), memory-mapped and checked
 * against their headers: the first dim is the sample count (the same in
 * both), the rest a sample's shape.  dtypes <f4 <i4 |u1 <f2 map to DT_F32,
 * DT_I32, DT_U8, DT_F16; <f8 and <i8 (NumPy's defaults) are converted to
 * f32 and i32 on load (i8 values must fit).  DT_ECORRUPT, naming the
 * field: bad magic or version, a header that is not the dict NumPy writes,
 * an unsupported descr, fortran_order True, a shape that is not a tuple of
 * non-negative ints, data shorter or longer than the shape says. */
DT_API dt_dataset *dt_dataset_load_npy(dt_ctx *ctx, const char *inputs_path,
                                       const char *targets_path);
/* CSV: numeric columns, one sample a row.  The target is one column (by
 * name, which needs a header, or by number: 0 is the first, -1 the last);
 * the input is the other columns as f32, a vector.  classify 1: the
 * targets are class labels (whole numbers >= 0, y i32); 0: numbers (y f32,
 * a scalar per sample). */
typedef struct dt_csv_config {
    size_t struct_size;        /* set by its *_init (see "Config structs" above) */
    char delimiter;                   /* ',' */
    int header;                       /* 1: the first row names the columns; 0: none;
                                         -1: a header when the first row is not all numbers */
    const char *target_name;          /* NULL: use target_column */
    int target_column;                /* -1 (the last) */
    int classify;                     /* 1 */
} dt_csv_config;
DT_API void dt_csv_config_init(dt_csv_config *cfg);
/* DT_EIO: cannot read path; DT_ECORRUPT, naming line and column: a field
 * that is not a number, a row with another number of fields, no data rows,
 * a label that is not a whole number >= 0; DT_EINVAL: target_name not in
 * the header (or no header), target_column out of range, a single column. */
DT_API dt_dataset *dt_dataset_load_csv(dt_ctx *ctx, const char *path, const dt_csv_config *cfg);
/* A token stream for a language model: samples are windows of context + 1
 * consecutive tokens, input the first `context`, target the next
 * `context` (both i32).  Windows start every `stride` tokens, or, with
 * stride 0, `samples` windows start at random places (from seed).  Only
 * tokens [first, first + count) are used (count < 0: to the end), so one
 * array serves a training and a validation split. */
typedef struct dt_token_config {
    size_t struct_size;        /* set by its *_init (see "Config structs" above) */
    int64_t context;                  /* T; 64 */
    int64_t stride;                   /* 0: random windows; default `context` */
    int64_t samples;                  /* with stride 0: how many windows */
    uint64_t seed;
    int64_t first, count;             /* 0, -1 */
} dt_token_config;
DT_API void dt_token_config_init(dt_token_config *cfg);
/* tokens: ntokens ids of token_bytes bytes each (1: u8, 2: u16, 4: i32,
 * little-endian).  copy 0: borrowed (keep it alive), 1: copied.  DT_EINVAL:
 * token_bytes not 1, 2 or 4, context < 1, fewer than context + 1 tokens in
 * range, stride < 0, stride 0 with samples < 1, a negative i32 id. */
DT_API dt_dataset *dt_dataset_from_tokens(dt_ctx *ctx, const void *tokens, int64_t ntokens,
                                          int token_bytes, int copy, const dt_token_config *cfg);
/* The same from a file of raw token ids (memory-mapped).  DT_EIO: cannot
 * open or map it; DT_ECORRUPT: its size is not a whole number of ids. */
DT_API dt_dataset *dt_dataset_load_tokens(dt_ctx *ctx, const char *path, int token_bytes,
                                          const dt_token_config *cfg);
/* From a callback: fill(user, i, input, target) writes sample i (the
 * fields' bytes, row-major) and returns 0, or nonzero on failure, which the
 * loader reports (DT_EIO, naming the sample) from dt_loader_next.  It is
 * called from the loader's thread, for one sample at a time.  user is
 * borrowed. */
typedef int (*dt_sample_fn)(void *user, int64_t i, void *input, void *target);
DT_API dt_dataset *dt_dataset_from_callback(dt_ctx *ctx, int64_t n, const dt_sample_field *input,
                                            const dt_sample_field *target, dt_sample_fn fill,
                                            void *user);
/* Samples [first, first + count) of ds as a dataset of their own (a view:
 * ds is borrowed and must outlive it).  It starts with ds's normalisation
 * (dt_dataset_normalize's scale, means and stds, copied now: normalising
 * ds later does not change it, and it can be normalised on its own).
 * new: free with dt_dataset_free.
 * DT_EINVAL: ds NULL, the range outside ds. */
DT_API dt_dataset *dt_dataset_subset(dt_ctx *ctx, const dt_dataset *ds, int64_t first,
                                     int64_t count);
/* The input's and the target's field (either pointer may be NULL).
 * DT_EINVAL: ds NULL. */
DT_API dt_status dt_dataset_fields(const dt_dataset *ds, dt_sample_field *input,
                                   dt_sample_field *target);
/* Sample i's raw input and target bytes, copied into input and target
 * (room for one field each; either may be NULL).  DT_EINVAL: ds NULL, i
 * out of range; a callback's failure: DT_EIO. */
DT_API dt_status dt_dataset_sample(const dt_dataset *ds, int64_t i, void *input, void *target);

/* Normalisation, as torchvision's ToTensor and Normalize, applied by the
 * loaders and dt_evaluate made after the call: u8 inputs become value/255
 * when scale_u8 is 1, then x = (x - mean[k]) / std[k], where k is the
 * element's channel (n = the input's first dim), its feature (n = the
 * input's element count) or 0 (n = 1); n = 0: no mean and std.  mean and
 * std are copied.  IDX datasets start with scale_u8 1.  DT_EINVAL: ds
 * NULL, n another count, a std <= 0, mean or std NULL with n > 0;
 * DT_ENOTSUP: an i32 input (token ids are not normalised). */
DT_API dt_status dt_dataset_normalize(dt_dataset *ds, int scale_u8, int n, const float *mean,
                                      const float *std);
/* The inputs' mean and standard deviation (population) per channel (n =
 * the first dim), per feature (n = the element count) or over all (n = 1),
 * after the u8 scaling set by dt_dataset_normalize but before its mean and
 * std: what to pass it.  A constant one (its spread below f32's resolution
 * of its mean) gets std 1, as sklearn's StandardScaler does, so it
 * normalises to 0.  DT_EINVAL: as dt_dataset_normalize. */
DT_API dt_status dt_dataset_stats(const dt_dataset *ds, int n, float *mean, float *std);

typedef struct dt_loader_config {
    size_t struct_size;        /* set by its *_init (see "Config structs" above) */
    int batch;            /* samples per batch */
    int shuffle;          /* reshuffle every epoch */
    int drop_last;        /* drop a last partial batch */
    uint64_t seed;        /* shuffle seed; epoch e uses (seed, e) */
    float mean, std;      /* f32 inputs -> (x - mean)/std, after the dataset's own
                             normalisation (dt_dataset_normalize: IDX pixels are
                             pixel/255 then); 0 and 1 leave them as they are */
    int prefetch;         /* background thread fills the next batch */
    int shard_rank;       /* this rank's shard (distributed sampling) */
    int shard_count;      /* number of shards; 0 or 1 means all data */
    int shard_no_pad;     /* 0: shards padded to equal sizes by repeating samples, as
                             torch's DistributedSampler (every rank runs as many
                             batches); 1: each sample in exactly one shard, sizes
                             differing by at most one (evaluation) */
    int global_batches;   /* 1: shards slice global batches instead: the epoch is cut
                             into batches of batch * shard_count samples, in the order
                             an unsharded loader with that batch would give them, and
                             each shard takes its slice of every one (equal slices until
                             dt_loader_set_split), so the shards' batches together are
                             exactly the global batches.  A last global batch with
                             fewer samples than shards is dropped.  For load balancing
                             (dt_ddp_balance) */
} dt_loader_config;
/* Defaults: batch 64, shuffle 1, prefetch 1, mean 0, std 1, the rest 0. */
DT_API void dt_loader_config_init(dt_loader_config *cfg);

/* New loader over ds (borrowed; must outlive the loader).  Batches are
 * x (B, input shape) and y (B, target shape), typed as section 9 says
 * (Fashion-MNIST: x (B,1,28,28) f32, y (B) i32).  new: free with dt_loader_free.  It starts
 * epoch 0.  DT_EINVAL: ds or cfg NULL, batch < 1, std <= 0, shard_rank
 * outside [0, shard_count), global_batches with more than 64 shards. */
DT_API dt_loader *dt_loader_new(dt_ctx *ctx, const dt_dataset *ds, const dt_loader_config *cfg);
DT_API void dt_loader_free(dt_loader *ld);         /* NULL is fine; stops its thread */
/* Start epoch `epoch` (shuffled from seed and epoch); the batches given out
 * before are no longer valid.  Starting again the epoch just started, before
 * any batch was taken (dt_loader_new starts epoch 0), keeps what was read:
 * each sample is read once.  Fails only for NULL. */
DT_API dt_status dt_loader_start_epoch(dt_loader *ld, int64_t epoch);
/* Next batch: *x and *y are loader-owned and valid until the next call.
 * Returns DT_EOF at the end of the epoch.  DT_EINVAL: x or y NULL; with
 * work stealing, the store's error (DT_EPEER, DT_ETIMEDOUT). */
DT_API dt_status dt_loader_next(dt_loader *ld, dt_tensor **x, dt_tensor **y);
/* Batches per epoch (with work stealing: its own shard's). */
DT_API int64_t dt_loader_batches(const dt_loader *ld);
/* Seconds the caller spent waiting for batches since the epoch started. */
DT_API double dt_loader_wait_seconds(const dt_loader *ld);
/* global_batches loaders: from the next batch on, each global batch is cut
 * between the shards in proportion to weights[0..n) (n = shard_count, each
 * > 0; rounded so the slices add up, each at least one sample).  Every
 * shard must be given the same weights.  A batch already prefetched is
 * cut again.  weights borrowed.  DT_ESTATE: not a global_batches loader;
 * DT_EINVAL: n != shard_count, a weight that is not a finite number > 0. */
DT_API dt_status dt_loader_set_split(dt_loader *ld, const double *weights, int n);
/* The current batch's place in its global batch: this shard's first sample
 * and count, and the global batch's size (all may be NULL).  A loader
 * without global_batches: offset 0 and count = global = its batch. */
DT_API void dt_loader_batch_slice(const dt_loader *ld, int64_t *offset, int64_t *count,
                                  int64_t *global);
/* Work stealing for asynchronous training (a parameter server in ASP or SSP,
 * where workers need not run as many steps): every epoch, each shard is cut
 * into chunks of chunk_batches batches; a worker takes its own shard's
 * chunks from the front and, when they run out, takes the last untaken
 * chunk of another shard (trying them in turn), so fast workers process what slow
 * ones have not reached.  Every sample of the epoch is still processed
 * exactly once over all workers; an epoch ends (DT_EOF) when no chunk is
 * left anywhere.  Claims go through c's rendezvous store (one round trip a
 * chunk).  Call it on every worker, then start the same epochs in the same
 * order on every worker (each start claims afresh); it starts epoch 0
 * itself.  c is borrowed and must outlive the loader.  Not with
 * global_batches.  The loader opens a store connection of its own for
 * claims.  DT_EINVAL: c NULL, chunk_batches < 1; DT_ESTATE: global_batches
 * or already stealing; the store's errors when connecting. */
DT_API dt_status dt_loader_steal(dt_loader *ld, dt_comm *c, int chunk_batches);
/* Batches this loader has given out this epoch, and how many of those came
 * from other shards' chunks (work stealing). */
DT_API int64_t dt_loader_batches_done(const dt_loader *ld);
DT_API int64_t dt_loader_batches_stolen(const dt_loader *ld);

/* ---------------------------------------------------------------------------
 * 10. Processes: launcher environment and rendezvous
 * ------------------------------------------------------------------------- */
/* Where this process sits in a job, read from the launcher's environment,
 * first match wins:
 *   dtrain:   DTRAIN_RANK, DTRAIN_WORLD_SIZE, DTRAIN_LOCAL_RANK,
 *             DTRAIN_MASTER ("host:port")
 *   torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
 *             MASTER_PORT
 *   OpenMPI:  OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE,
 *             OMPI_COMM_WORLD_LOCAL_RANK (+ MASTER_ADDR/MASTER_PORT or
 *             DTRAIN_MASTER)
 *   Slurm:    SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID (+ the same)
 * and otherwise a single process (rank 0 of 1).  The master defaults to
 * 127.0.0.1:29500, as torchrun's. */
#define DT_MAX_HOST 256
typedef struct dt_dist_env {
    int rank, world_size;
    int local_rank;            /* -1 when the launcher does not say */
    int local_world_size;      /* -1 when the launcher does not say */
    char master_addr[DT_MAX_HOST];
    int master_port;
    const char *launcher;      /* "dtrain", "torchrun", "openmpi", "slurm", "none" */
} dt_dist_env;
/* Fill *out.  Malformed values (not a number, rank >= world size, a port
 * out of range, a rank without its world size) give DT_EINVAL naming the
 * variable; so does out NULL. */
DT_API dt_status dt_dist_env_detect(dt_ctx *ctx, dt_dist_env *out);

/* The rendezvous store: rank 0 serves a small TCP key-value store through
 * which ranks swap transport addresses and host names.  A job token, when
 * set, must be presented by every rank; a wrong or missing one is refused.
 * The store binds to loopback unless told otherwise. */
typedef struct dt_store dt_store;
typedef struct dt_store_config {
    size_t struct_size;        /* set by its *_init (see "Config structs" above) */
    const char *token;         /* NULL: DTRAIN_JOB_TOKEN, or none */
    const char *bind_addr;     /* rank 0's listen address; NULL: DTRAIN_STORE_BIND,
                                  else 127.0.0.1 ("0.0.0.0" for all interfaces) */
    int timeout_ms;            /* connect and get deadline; 0: 30000 */
} dt_store_config;
DT_API void dt_store_config_init(dt_store_config *cfg);
/* Rank 0 starts the server (on env->master_port; 0 picks a free port, see
 * dt_store_port) and every rank, 0 included, connects and presents the
 * token.  Connecting retries until the timeout, so ranks may start in any
 * order.  new: free with dt_store_free.  Allocator hooks must be
 * thread-safe: the server runs on its own thread.  DT_EINVAL: env invalid,
 * token over 256 bytes, bind_addr not IPv4; DT_EIO: rank 0 cannot listen;
 * DT_ETIMEDOUT: rank 0 not reached in time; DT_EPEER: refused (token).
 * The calls on one dt_store are not thread-safe (one connection); use it
 * on its context's thread. */
DT_API dt_store *dt_store_new(dt_ctx *ctx, const dt_dist_env *env, const dt_store_config *cfg);
/* NULL is fine.  On rank 0 this stops the server: the other ranks' calls
 * then fail (DT_EPEER). */
DT_API void dt_store_free(dt_store *s);
DT_API int dt_store_port(const dt_store *s);      /* rank 0's port; -1 for NULL */
#define DT_STORE_MAX_KEY 256
#define DT_STORE_MAX_VALUE ((size_t)1 << 20)
/* Set key to len bytes (copied; a later set replaces).  Errors of all
 * three: DT_EINVAL for a key not 1..DT_STORE_MAX_KEY bytes (set: a value
 * over DT_STORE_MAX_VALUE or NULL), DT_EPEER when rank 0's store is gone or
 * refuses, DT_ETIMEDOUT when it does not answer in time (the message says
 * rank 0 is silent; an answer that comes later is skipped, never taken for
 * a later call's). */
DT_API dt_status dt_store_set(dt_store *s, const char *key, const void *value, size_t len);
/* Add delta to key's counter (8 bytes; a missing key counts from 0) and
 * give the sum in *value (may be NULL): atomic, as torch's store.add.  A key
 * holding something else than a counter: DT_EINVAL. */
DT_API dt_status dt_store_add(dt_store *s, const char *key, int64_t delta, int64_t *value);
/* Wait until key is set (up to timeout_ms; 0 = the store's timeout), copy
 * at most cap bytes into buf and its full length into *len.  DT_ETIMEDOUT
 * names the key.  DT_EINVAL: len NULL, or buf NULL with cap > 0. */
DT_API dt_status dt_store_get(dt_store *s, const char *key, void *buf, size_t cap, size_t *len,
                              int timeout_ms);

/* Communicator: every rank of the job, connected through a transport
 * (libfabric shm, tcp or verbs).  One comm thread per communicator owns
 * the transport and runs collectives from a queue; the caller enqueues and
 * waits, so communication overlaps computation. */
typedef struct dt_comm_config {
    size_t struct_size;        /* set by its *_init (see "Config structs" above) */
    const char *transport;     /* "shm", "tcp", "verbs"; NULL: DTRAIN_TRANSPORT, else
                                  shm when every rank is on one host, tcp otherwise */
    const char *host;          /* tcp/verbs: this rank's address; NULL: DTRAIN_HOST */
    int timeout_ms;            /* liveness: a peer whose process gives no sign of life
                                  this long (not even the heartbeat its own thread sends
                                  every timeout/4, at most 1 s: stopped, hung, or cut off)
                                  fails the collective waiting on it, naming it (rank 0
                                  too: its store's silence says so); a dead one is named
                                  at once; a rank that itself did not run this long
                                  inside a wait (stopped) fails the collective it was in;
                                  0: DTRAIN_TIMEOUT_MS, else 30000 */
    const char *intra_host;    /* ranks on one host talk through "segment" (a shared-
                                  memory segment; collectives reduce straight from the
                                  other ranks' memory, and across hosts the allreduce is
                                  hierarchical) or "transport" (everything over the
                                  transport); NULL: DTRAIN_INTRA_HOST, else "segment" */
    const char *host_id;       /* ranks with the same id share a host; NULL:
                                  DTRAIN_HOST_ID, else the host name */
    dt_store_config store;
    int collective_timeout_ms; /* progress: how long a collective waits for a peer that is
                                  alive (its heartbeat goes on) but has not reached it (a
                                  slow data loader, evaluation or checkpoint, a first-step
                                  compilation, a page-cache miss); then it fails naming the
                                  peer and what it was doing (dt_ctx_set_activity).  0:
                                  DTRAIN_COLLECTIVE_TIMEOUT_MS, else 600000 (10 minutes,
                                  NCCL's default watchdog), and never below timeout_ms */
} dt_comm_config;
DT_API void dt_comm_config_init(dt_comm_config *cfg);
/* Join the job: rendezvous through the store, open the transport, swap
 * addresses.  env NULL: dt_dist_env_detect.  Collective over all ranks.
 * new: free with dt_comm_free.  Errors: dt_store_new's; DT_ENOTSUP: no
 * transport compiled in; DT_EIO (or the transport's own status): the
 * transport failed; DT_ETIMEDOUT, DT_EPEER: a rank did not join. */
DT_API dt_comm *dt_comm_new(dt_ctx *ctx, const dt_dist_env *env, const dt_comm_config *cfg);
/* NULL is fine.  Rank 0 keeps the store up until the other ranks have left
 * (at most 10 s, or the timeout if shorter), so its call may block. */
DT_API void dt_comm_free(dt_comm *c);
DT_API int dt_comm_rank(const dt_comm *c);        /* -1 for NULL */
DT_API int dt_comm_size(const dt_comm *c);        /* ranks; 0 for NULL */
DT_API const char *dt_comm_transport(const dt_comm *c);   /* provider in use */
DT_API int dt_comm_hosts(const dt_comm *c);                /* hosts the ranks span */
/* "segment", "transport", or why there is no segment (borrowed) */
DT_API const char *dt_comm_intra_host(const dt_comm *c);
/* Payload bytes this rank has sent to other ranks since dt_comm_new: over
 * the transport, plus what it wrote into the host segment for the other
 * ranks of its host to read.  Collective headers are not counted.  An
 * atomic counter: any thread may read it while c lives. */
DT_API uint64_t dt_comm_bytes_sent(const dt_comm *c);

/* Point to point, for pipelines (activations forward, their gradients
 * back): host float buffers, borrowed for the call.  dt_comm_send returns when
 * the message has left buf, which for a large one means once dst has posted
 * its receive (as MPI_Send may wait); dt_comm_recv when n floats from src have
 * arrived.  Messages between two ranks pair in order: the k-th send to a
 * rank meets its k-th receive from us.  dt_comm_sendrecv posts both together,
 * so two ranks exchanging with each other cannot deadlock.  Not
 * collectives: other ranks take no part and do not count them.  A dead or
 * silent peer fails the call naming it (and, as for collectives, the
 * communicator then refuses further work).  DT_EINVAL: a peer out of range
 * or this rank; DT_EMISMATCH: src sent a different number of floats. */
DT_API dt_status dt_comm_send(dt_comm *c, const float *buf, int64_t n, int dst);
DT_API dt_status dt_comm_recv(dt_comm *c, float *buf, int64_t n, int src);
DT_API dt_status dt_comm_sendrecv(dt_comm *c, const float *send, int64_t ns, int dst, float *recv,
                             int64_t nr, int src);

/* Process groups (sub-communicators), as MPI_Comm_split / ncclCommSplit:
 * collective over parent's ranks; the ranks that pass the same color (>= 0)
 * form one new communicator, ranked by key then parent rank.  It is a whole
 * dt_comm: every collective, DDP, dt_comm_send/dt_comm_recv work on it, in ranks
 * 0..size-1 of the group, with its own endpoint, comm thread and host
 * segment (a group's calls never wait for another group's).  Its errors
 * start "group [job ranks]: ", then name group ranks.  cfg NULL: the
 * environment's defaults (pass the parent's config if you gave it one;
 * its timeout_ms 0: the parent's).  The parent (and the job's rank 0 store)
 * must outlive it.  new: free with dt_comm_free (before the parent).
 * DT_EINVAL: color < 0; DT_ESTATE: parent failed earlier. */
DT_API dt_comm *dt_comm_split(dt_comm *parent, int color, int key, const dt_comm_config *cfg);
/* The rank in the whole job of this communicator's rank `rank` (itself for
 * the job's own communicator); -1 out of range. */
DT_API int dt_comm_job_rank(const dt_comm *c, int rank);

typedef enum dt_reduce_op { DT_REDUCE_SUM = 0, DT_REDUCE_AVG, DT_REDUCE_MAX, DT_REDUCE_MIN } dt_reduce_op;

/* Collectives on host float buffers (borrowed until the work completes).
 * Every rank must call the same collectives in the same order with the same
 * sizes: a rank that does not is detected and every rank's call fails with
 * DT_EMISMATCH naming both calls.  A dead or silent peer fails the call
 * with DT_ETIMEDOUT or DT_EPEER naming the rank; after that the
 * communicator refuses further work (DT_ESTATE) instead of hanging.  Bad
 * arguments (a NULL buffer, n < 0, a root or op out of range) give
 * DT_EINVAL on this rank alone, before anything is sent.  A transport call
 * that never returns (libfabric's shm provider, when a peer died holding a
 * lock in shared memory) fails the wait with DT_EPEER after twice the
 * timeout, saying "wedged"; the communicator is then abandoned (every call
 * fails at once, dt_comm_free still returns).  One thread (the context's)
 * issues a communicator's calls: the ranks' order depends on it. */
typedef struct dt_work dt_work;
/* Start an allreduce and return at once.  new: dt_work_wait frees it; NULL
 * on bad arguments.  The collective's own errors come from dt_work_wait. */
DT_API dt_work *dt_comm_allreduce_async(dt_comm *c, float *buf, int64_t n, dt_reduce_op op);
/* Wait for w, free it and return its status.  Call it once, on the
 * context's thread (it writes the context's error); DT_EINVAL for NULL. */
DT_API dt_status dt_work_wait(dt_work *w);
DT_API dt_status dt_comm_allreduce(dt_comm *c, float *buf, int64_t n, dt_reduce_op op);
DT_API dt_status dt_comm_broadcast(dt_comm *c, float *buf, int64_t n, int root);
/* out (world * n) = every rank's in (n), in rank order */
DT_API dt_status dt_comm_allgather(dt_comm *c, const float *in, int64_t n, float *out);
/* in (world * n) reduced over ranks; out (n) = this rank's block */
DT_API dt_status dt_comm_reduce_scatter(dt_comm *c, const float *in, int64_t n, float *out,
                                   dt_reduce_op op);
/* in (world * n): block q goes to rank q; out (world * n): block p came
 * from rank p (the personalised exchange of MPI_Alltoall) */
DT_API dt_status dt_comm_alltoall(dt_comm *c, const float *in, int64_t n, float *out);
DT_API dt_status dt_comm_barrier(dt_comm *c);

/* Launching ranks on one host, like torchrun / mpirun.  Each rank gets
 * DTRAIN_RANK, DTRAIN_WORLD_SIZE, DTRAIN_LOCAL_RANK, DTRAIN_LOCAL_WORLD_SIZE,
 * DTRAIN_MASTER (127.0.0.1 and a free port), DTRAIN_JOB_TOKEN (random, unless
 * already set) and DTRAIN_TRANSPORT (if given), so dt_comm_new(ctx, NULL, ..)
 * just works, plus IPATH_NO_BACKTRACE=1 and HFI_NO_BACKTRACE=1 (unless set),
 * which keep libfabric's PSM libraries from taking the signals (see
 * docs/DEPENDENCIES.md).  The supervisor prefixes each line the ranks print with
 * "[rank] ", forwards SIGINT and SIGTERM to them, and when one rank fails
 * stops the others (SIGTERM, then SIGKILL after grace_ms).  Each rank leads
 * its own process group and the signals go to the groups, so a rank that is
 * a shell wrapper stops with its children; once every rank has exited, the
 * output still in the pipes is read for at most 2 s. */
typedef struct dt_spawn_config {
    size_t struct_size;        /* set by its *_init (see "Config structs" above) */
    int nranks;                /* processes to start, >= 1 */
    const char *transport;     /* DTRAIN_TRANSPORT for the ranks, or NULL */
    int grace_ms;              /* SIGTERM -> SIGKILL delay; 0: 5000 */
    int max_restarts;          /* 0 (default): a failed rank ends the job; N: the job is
                                  started again (all ranks, a new rendezvous, each with
                                  DTRAIN_RESTART=1, 2, ...) up to N times, as torchrun's
                                  --max-restarts; each restart is told through dt_ctx_set_log.
                                  Not after SIGINT/SIGTERM, nor when the program cannot
                                  be started.  The program resumes from its newest
                                  checkpoint (dt_checkpoint_latest) */
    int min_ranks;             /* with max_restarts: 0 (default) restarts with all ranks;
                                  M: a rank that failed first in two runs in a row is
                                  taken for one that cannot run again, and the next run
                                  has one rank fewer (renumbered 0..n-2), down to M
                                  (torchrun's --nnodes MIN:MAX for ranks of one host).
                                  The program keeps its global batch (see --global-batch
                                  in examples/fashion_mnist.c) */
    int prefix_output;         /* 1: "[rank] " before every line of output */
    int bind_cpus;             /* 1 (default): when there are at least as many CPUs
                                  (of those this process may use) as ranks, rank i
                                  runs on its own contiguous share of them, like
                                  mpirun's --bind-to core; 0: the scheduler decides */
} dt_spawn_config;
/* Defaults: nranks 1, prefix_output 1, bind_cpus 1, the rest 0. */
DT_API void dt_spawn_config_init(dt_spawn_config *cfg);
/* Fork cfg->nranks workers of this program.  In each worker it returns
 * DT_OK with *rank = its rank (the worker then runs the job and exits).  In
 * the caller it supervises them and returns when all have ended: DT_OK with
 * *rank = -1 if every rank exited 0, else DT_EPEER naming the first rank
 * that failed (its exit code or signal; with max_restarts, of the last
 * run).  DT_EINVAL: nranks outside 1..1024, max_restarts < 0, min_ranks
 * outside 0..nranks, rank NULL;
 * DT_EIO: no free port, pipe or fork failed.  The
 * workers are fork()s of the caller: call it before anything starts a
 * thread (a store, communicator, prefetching loader, dt_dp). */
DT_API dt_status dt_spawn(dt_ctx *ctx, const dt_spawn_config *cfg, int *rank);
/* The same, each rank running argv (execvp); what build/dtrun does.
 * *failed_rank (may be NULL) gets the first failed rank or -1.  DT_EIO
 * naming the program and why when it cannot be run (the ranks started
 * before it are stopped); DT_EINVAL: argv empty. */
DT_API dt_status dt_launch(dt_ctx *ctx, const dt_spawn_config *cfg, char *const argv[],
                           int *failed_rank);

/* ---------------------------------------------------------------------------
 * Graceful pre-emption
 *
 * Schedulers stop jobs far more often than jobs crash: Slurm's pre-emption
 * and scancel send SIGTERM (with --signal=USR1@120, a warning first),
 * Kubernetes SIGTERM and then its grace period, spot instances a notice.
 * With dt_preempt_enable the library catches those signals (its handler
 * only records which came), and the training loop asks once a step, on
 * every rank at the same point, whether the job must stop:
 *
 *     dt_preempt_enable(ctx, NULL);                  every rank, once
 *     for (step = start; step < steps; step++) {
 *         ... forward, backward, dt_ddp_step(ddp) ...
 *         int stop;
 *         dt_preempt_agree(ctx, comm, step + 1, &stop);
 *         if (stop) {   every rank, after the same step
 *             save a checkpoint at step + 1 (dt_checkpoint_save on rank 0,
 *             or every rank's shard: dt_ddp_checkpoint_save);
 *             dt_preempt_saved(ctx, -1);
 *             puts(dt_preempt_report(ctx));   "pre-empted at step N (SIGTERM),
 *                                              checkpoint saved in S s"
 *             exit(DT_EXIT_PREEMPTED);
 *         }
 *     }
 *
 * A rank that received the signal during a step finishes it; the vote is a
 * one-float allreduce after the step, which dt_ddp_step already did (then
 * dt_preempt_agree costs nothing).  dtrun passes DT_EXIT_PREEMPTED on when
 * it was signalled itself (the scheduler then requeues the job: Slurm's
 * --requeue, a Kubernetes restart), and with --max-restarts restarts the
 * job from its newest checkpoint when only its ranks were.  A second signal
 * (2 s or more after the first: a repeat sooner, such as Slurm's signal to
 * every process that dtrun then passes on, is the same notice) ends the
 * process at once (the signal's default action); a rank that does
 * not exit within dtrun's grace period after the signal is killed and named.
 * docs/RELIABILITY.md, "Pre-emption".
 * ------------------------------------------------------------------------- */
#define DT_EXIT_PREEMPTED 75   /* sysexits' EX_TEMPFAIL: the state is saved, run it again */
#define DT_PREEMPT_SIGTERM 1u
#define DT_PREEMPT_SIGUSR1 2u
#define DT_PREEMPT_SIGUSR2 4u
#define DT_PREEMPT_SIGINT 8u
typedef struct dt_preempt_config {
    size_t struct_size;        /* set by its *_init (see "Config structs" above) */
    unsigned signals;          /* DT_PREEMPT_SIG* caught; default TERM | USR1 | USR2.
                                  DTRAIN_PREEMPT_SIGNALS=TERM,USR1 (or none) overrides */
} dt_preempt_config;
DT_API void dt_preempt_config_init(dt_preempt_config *cfg);
/* Catch cfg's signals (NULL: the defaults) in this process from now on:
 * each only records that it came; the first of them asks the job to stop,
 * a second ends the process.  Call it on every rank, before the first
 * step (the ranks' votes must match).  The handlers stay installed for the
 * process's life; a communicator made later takes them back from a
 * transport library that installed its own.  DT_EINVAL: unknown bits or a
 * malformed DTRAIN_PREEMPT_SIGNALS; DT_EIO: sigaction failed. */
DT_API dt_status dt_preempt_enable(dt_ctx *ctx, const dt_preempt_config *cfg);
/* The signal this process received (SIGTERM, ...), 0: none or not enabled.
 * Rank-local: the job's decision is dt_preempt_agree's. */
DT_API int dt_preempt_signal(const dt_ctx *ctx);
/* Collective over c (NULL or one rank: this process alone), at the same
 * point of every step on every rank: *stop = 1 on every rank when any rank
 * received a signal before its vote.  step: the steps done, recorded for
 * the report at the first stop.  The DDP's step already voted (dt_ddp_step
 * and dt_ddp_sync): then no message is sent.  A parameter server's worker
 * (BSP without prefetch): each step's pushes carry its vote and the pull's
 * answer the servers' verdict, so dt_preempt_agree after dt_ps_push_pull or
 * dt_ddp_step sends nothing either (the servers stop in dt_ps_serve).  Not
 * enabled: *stop = 0, no collective.  DT_EINVAL: stop NULL; DT_ENOTSUP: a
 * parameter-server worker in SSP/ASP or with prefetch (no step every
 * worker shares); the allreduce's errors. */
DT_API dt_status dt_preempt_agree(dt_ctx *ctx, dt_comm *c, int64_t step, int *stop);
/* The checkpoint of the agreed stop is written, in seconds (< 0: the time
 * since the agreement).  DT_ESTATE: no stop was agreed. */
DT_API dt_status dt_preempt_saved(dt_ctx *ctx, double seconds);
/* "pre-empted at step N (SIGTERM), checkpoint saved in S s" (or "..., no
 * checkpoint saved"); "" before a stop.  Borrowed: valid until the next
 * call; dt_profile_report ends with the same line. */
DT_API const char *dt_preempt_report(dt_ctx *ctx);

/* ---------------------------------------------------------------------------
 * 11. Data parallelism (DDP)
 *
 * Wrap a context's parameters and its optimizer; every rank runs the same
 * model on its own shard of each batch:
 *
 *     dt_ddp *ddp = dt_ddp_new(ctx, comm, opt, NULL);   // rank 0's weights
 *     for (...) {                                        //   go to every rank
 *         dt_tensor *loss = dt_cross_entropy(ctx, model(ctx, x), y);
 *         dt_backward(ctx, loss);   // buckets' allreduces start as they fill
 *         dt_ddp_step(ddp);         // wait for the rest, average, optimizer step
 *         dt_ctx_zero_grad(ctx);
 *         dt_ctx_step_reset(ctx);
 *     }
 *
 * While a DDP is attached, each parameter's gradient lives in a
 * communication bucket (buckets are filled in reverse registration order,
 * the order backward produces them).  dt_backward starts a bucket's
 * allreduce on the comm thread the moment the last of its gradients is
 * final and goes on with backward; buckets start in the same order on
 * every rank.  Two sets of bucket memory alternate between steps.  A
 * parameter that got no gradient on some rank counts as zero there; one
 * that got none on any rank keeps no gradient (the optimizer skips it, as
 * a single process would).  The comm thread reads and writes the buckets
 * until dt_ddp_sync (or dt_ddp_step) returns: gradients are final only then.
 * Calls that finish a step (dt_ddp_sync, dt_ddp_step, the next dt_backward)
 * give its reduction's errors: DT_EMISMATCH, DT_ETIMEDOUT, DT_EPEER, and
 * DT_ESTATE once the communicator has failed.
 *
 * Sharded (dt_ddp_config.zero 1 or 2): the same loop.  Rank r owns floats
 * [r*N/world, (r+1)*N/world) of the N gradients laid out as the buckets lay
 * them (reverse registration order; the first N % world ranks one more).
 * dt_ddp_sync leaves each rank only its shard of the averaged gradients:
 * the parameters' gradients read as zero after it.  dt_ctx_clip_grad_norm and
 * the loss scaler work on the shards (collective then: every rank calls
 * them).  dt_optim_step (or dt_ddp_step) steps this rank's shard and
 * all-gathers the parameters (collective).  The optimizer's state tensors
 * (dt_optim_state_at) are this rank's shard, 1-D: save and resume with
 * dt_ddp_checkpoint_save / dt_ddp_checkpoint_load.  Once the DDP
 * is freed its optimizer refuses to step.  With no_sync, zero 2 keeps the
 * accumulated gradients whole until the synchronised backward.  Zero 3
 * also holds each parameter as a shard: the forward's and backward's ops
 * gather what they read (buckets are the units), and a parameter read from
 * outside them needs dt_ddp_full_params first.
 * ------------------------------------------------------------------------- */
typedef struct dt_ddp dt_ddp;

/* Gradient compression on the wire; every rank still gets identical
 * gradients (sums are taken in rank order from the same encoded bytes).
 *   BF16, FP16: 2 bytes per gradient (round to nearest even), reduced by a
 *         16-bit allreduce (alltoall of encoded blocks, fp32 sum of each
 *         block by its owner, allgather): half the fp32 bytes at any size.
 * TOPK and INT8 buckets are gathered (each rank's encoding to every rank)
 * and decoded and summed in rank order.
 *   TOPK: the largest topk_ratio of each bucket's gradients by magnitude,
 *         as (index, bf16 value) pairs: 6 bytes each.
 *   INT8: 1 byte per gradient plus one fp32 scale per 256.
 * TOPK and INT8 keep what they did not send (error feedback) and add it to
 * the next step's gradients, as Deep Gradient Compression does. */
typedef enum dt_compress {
    DT_COMPRESS_AUTO = -1,     /* unset: DTRAIN_COMPRESS, else none (dt_ddp_config_init's) */
    DT_COMPRESS_NONE = 0, DT_COMPRESS_BF16, DT_COMPRESS_FP16, DT_COMPRESS_TOPK, DT_COMPRESS_INT8
} dt_compress;

typedef struct dt_ps dt_ps;          /* a parameter-server job (section 12) */

typedef struct dt_ddp_config {
    size_t struct_size;        /* set by its *_init (see "Config structs" above) */
    size_t bucket_bytes;       /* gradient bytes per bucket; 0: DTRAIN_BUCKET_BYTES, else
                                  the default (docs/DATA_PARALLEL.md says how it was
                                  chosen).  Buckets cut the gradients every this many
                                  bytes, so a large parameter may span several */
    int overlap;               /* 1: allreduce during backward; 0: after backward, in
                                  dt_ddp_sync, as one call when uncompressed; -1 (default):
                                  1 when ranks span hosts (the comm thread waits on the
                                  network) or this rank has a CPU beyond its compute
                                  threads, else 0: on one host the allreduce is memory
                                  copies, and on the compute threads' own CPU they would
                                  only take turns with backward (docs/DATA_PARALLEL.md) */
    int broadcast_params;      /* 1 (default): dt_ddp_new copies rank 0's parameters to
                                  every rank */
    dt_compress compress;      /* DT_COMPRESS_AUTO (default): DTRAIN_COMPRESS=none|bf16|
                                  fp16|topk|int8, else none; any other value is the
                                  program's, which the environment does not change */
    float topk_ratio;          /* TOPK: fraction of each parameter's gradients sent; 0: 0.01 */
    int topk_warmup_steps;     /* TOPK: over the first this many steps the fraction falls
                                  geometrically from 25% to topk_ratio (DGC's warm-up);
                                  0: none; -1 (default): DTRAIN_TOPK_WARMUP, else none */
    int error_feedback;        /* TOPK, INT8: 1 (default) carries the unsent rest over */
    dt_ps *ps;                 /* not NULL: push buckets to the parameter servers and
                                  pull the parameters back instead of allreducing
                                  (section 12; workers only, no optimizer needed) */
    int zero;                  /* sharding of the training state across the ranks, as
                                  DeepSpeed's ZeRO stages (docs/DATA_PARALLEL.md, "Sharded
                                  data parallelism"):
                                  0 (default): none, every rank holds everything;
                                  1: optimizer state: gradients are reduce-scattered, each
                                     rank steps its contiguous 1/world of the flattened
                                     parameters with its shard of the optimizer's state,
                                     and the ranks all-gather the parameters;
                                  2: also gradients: a bucket's memory is lent when its
                                     first gradient is written and taken back once its
                                     reduce-scatter is done; a rank keeps only its shard.
                                  3: also parameters (FSDP): each rank keeps its shard of
                                     every parameter; the others' parts are gathered into
                                     the parameter's own memory just before an op reads it
                                     (the next unit prefetched) and given back once later
                                     units need the room (the backend's discard: cpu).
                                     Every rank must run the same ops in the same order.
                                  Needs an optimizer, no compression, no parameter
                                  server, a backend computing in host memory */
} dt_ddp_config;
DT_API void dt_ddp_config_init(dt_ddp_config *cfg);

/* Wrap every parameter of ctx (registered before this call) for data
 * parallelism over c (made with the same ctx).  Collective: every rank
 * calls it.  Ranks whose models differ (number, names, shapes or order of
 * parameters) or whose DDP settings differ (bucket size, overlap,
 * compression) all fail with DT_EMISMATCH naming the first difference.
 * opt (borrowed, may be NULL) is what dt_ddp_step steps; freeing it first
 * is allowed (dt_ddp_step then refuses).  ctx and c are borrowed and must
 * outlive the DDP.  new: free with dt_ddp_free (the gradients move back
 * into the parameters' own buffers).  DT_EINVAL: c NULL or of another
 * context, opt of another context, bad compression settings; DT_ESTATE: ctx
 * already has a DDP; DT_ENOTSUP: a device backend without asynchronous
 * copies; and the collectives' errors. */
DT_API dt_ddp *dt_ddp_new(dt_ctx *ctx, dt_comm *c, dt_optim *opt, const dt_ddp_config *cfg);
/* NULL is fine.  Waits for a step still being reduced.  Sharded: the
 * optimizer refuses to step afterwards (its state is a shard); zero 3
 * leaves each rank only its shard of the parameters (the rest reads as
 * zeros) unless dt_ddp_full_params ran since the last step. */
DT_API void dt_ddp_free(dt_ddp *d);

/* sync 0 (no_sync, like PyTorch's DDP.no_sync()): backward only
 * accumulates gradients locally; the next backward with sync 1 reduces the
 * accumulated sum.  Default 1.  Fails only for NULL. */
DT_API dt_status dt_ddp_set_sync(dt_ddp *d, int sync);
/* Wait until every bucket of this step is reduced: gradients are then the
 * average over ranks (e.g. for dt_ctx_clip_grad_norm).  Nothing to do: DT_OK.
 * A dt_ctx_zero_grad between dt_backward and this call discards the step's
 * gradients (e.g. to skip a bad batch).  With compression, call this (or
 * dt_ddp_step) before the next dt_backward; accumulate with no_sync. */
DT_API dt_status dt_ddp_sync(dt_ddp *d);
/* dt_ddp_sync, then the optimizer's step.  DT_ESTATE without an optimizer.
 * With a parameter server, no local step: the servers step. */
DT_API dt_status dt_ddp_step(dt_ddp *d);

typedef struct dt_ddp_stats {
    int64_t steps;             /* synchronised steps */
    int buckets;               /* number of buckets */
    size_t bucket_bytes;       /* the size cap in use */
    double backward_s;         /* time inside dt_backward on the caller's thread */
    double comm_s;             /* time the gradient allreduces ran (comm thread) */
    double exposed_s;          /* time the caller waited for them in dt_ddp_sync:
                                  communication not hidden behind backward */
    uint64_t grad_bytes;       /* fp32 gradient bytes reduced (what dense would carry) */
    uint64_t payload_bytes;    /* bytes of this rank's encoded buckets (= grad_bytes
                                  without compression) */
    uint64_t bytes_sent;       /* bytes this rank sent for them (dt_comm_bytes_sent) */
    int64_t block_launches;    /* buckets started from inside a layer's backward: a large
                                  linear weight's gradient is made in row blocks, and each
                                  finished block travels while the next computes */
    int overlap;               /* the overlap in use (cfg's, -1 resolved) */
    int zero;                  /* the sharding level in use (dt_ddp_config.zero) */
    int64_t shard_floats;      /* zero >= 1: this rank's shard of the flattened parameters */
    size_t grad_bytes_peak;    /* the most gradient memory this DDP held at once: its
                                  gradient set (and used-flags), or with zero 2 the buckets lent plus the
                                  shard */
    double gather_s;           /* zero >= 1: time the parameter all-gathers ran (zero 1
                                  and 2: after each step; zero 3: before a unit's use) */
    double gather_exposed_s;   /* the part of it the caller waited for: zero 1-2 all of it
                                  (after the step); zero 3 what prefetch did not hide (a
                                  wait counts up to the gather's own time, not the
                                  reduce-scatters queued before it) */
    int64_t gathers;           /* zero 3: units gathered */
    int64_t gathers_on_demand; /* zero 3: of those, gathered when an op needed them, no
                                  prefetch having started them (the first step, whose
                                  order of units is not known yet; ops that changed) */
} dt_ddp_stats;
/* Zero 3: every parameter whole on every rank (gathered) until the next
 * optimizer step, e.g. to read them, evaluate or save a checkpoint; a
 * parameter held as a shard is refused by dt_tensor_get, dt_tensor_data
 * and dt_checkpoint_save (DT_ESTATE).  Collective.  Other levels: nothing
 * to do.  DT_EINVAL: NULL; the all-gathers' errors. */
DT_API dt_status dt_ddp_full_params(dt_ddp *d);
/* Sharded checkpoints: every rank writes its own shard into the directory
 * dir (created if missing; its parent must exist), then rank 0 writes
 * dir/index.json, which makes it a checkpoint.  Rank r's shard holds floats
 * [r*N/world, (r+1)*N/world) of the N parameter floats laid out as the
 * buckets lay them, of the parameters and of opt's state (opt may be NULL),
 * so no rank gathers the model, at any zero level (0 too).  Files:
 * shard-RRRRR-of-WWWWW.safetensors (slices named "<param>@<first float>",
 * "optim.<param>.<state>@<first float>", the single file's checksums,
 * "dtrain.step", "dtrain.shard" "R/W") and index.json (step, world, zero,
 * the parameters' names and shapes, the optimizer's kind, steps, learning
 * rate and steps per parameter, a CRC-32).  Save each step into a directory
 * of its own to keep the previous one whole until the new one is (the index
 * is removed first).  Collective: every rank returns the first failure of
 * any (its message names the rank).  DT_EINVAL: NULL, dir empty or over
 * 3800 bytes, opt not this DDP's; DT_EIO. */
DT_API dt_status dt_ddp_checkpoint_save(dt_ddp *d, const dt_optim *opt, const char *dir,
                                        int64_t step);
/* Load a sharded checkpoint (any world size, any zero level it was saved
 * at) into this DDP's parameters and opt's state (opt may be NULL): each
 * rank reads only the shards that hold its floats (zero 3: its shard of
 * each parameter; otherwise the parameters whole, and opt's state or its
 * shard of it).  Every rank checks the index and every shard (rank, step,
 * checksums, pieces tiling each tensor) and the ranks agree before
 * anything is copied, so a refused checkpoint changes nothing on any rank.
 * Training then continues as if it had not stopped (the same floats; with
 * another world size, sums in another order: DDP's tolerance).  Collective.
 * Errors as dt_checkpoint_load (a shard missing, stale or corrupt named);
 * DT_EMISMATCH: another model or optimizer kind. */
DT_API dt_status dt_ddp_checkpoint_load(dt_ddp *d, dt_optim *opt, const char *dir,
                                        int64_t *step_out);
/* Totals since dt_ddp_new or the last reset (which keeps the settings:
 * buckets, bucket_bytes, overlap, zero, shard_floats, grad_bytes_peak).  DT_EINVAL: NULL. */
DT_API dt_status dt_ddp_stats_get(const dt_ddp *d, dt_ddp_stats *out);
DT_API void dt_ddp_stats_reset(dt_ddp *d);

/* Dynamic load balancing for ranks of unequal speed.  ld (borrowed; made
 * with global_batches, shard_rank = this rank, shard_count = the world) is
 * the loader this DDP's steps read.  Every `every` steps (0: 10) the ranks
 * swap their measured compute rates (samples per second of forward,
 * backward and optimizer) and each global batch is cut in proportion to
 * them (dt_loader_set_split), so a slow rank gets fewer samples and no rank
 * waits for it.  Each rank's gradient is weighted by its share of the
 * global batch (count * world / global) before the average, so a step
 * computes the gradient of the whole global batch, whatever the cut:
 * results equal those of one process with the global batch, up to float
 * rounding (the cut, being measured, differs from run to run, so runs are
 * not bit-identical).  Collective: every rank calls it, with the same
 * every, before its first step.  Not with a parameter server.  A bad call
 * on any rank fails it on all: DT_EINVAL (loader NULL, of another context,
 * without global_batches or with other shards; a PS; over 64 ranks;
 * already balancing), DT_EMISMATCH (every differs). */
DT_API dt_status dt_ddp_balance(dt_ddp *d, dt_loader *ld, int every);
/* This rank's share of the global batch in use (1 / world without
 * balancing). */
DT_API double dt_ddp_balance_share(const dt_ddp *d);

/* In-process data parallelism, like PyTorch's DataParallel: one process, K
 * replicas of the model, each with its own context (its own compute
 * threads, or device replica.device + k on an accelerator backend) driven
 * by its own thread.  Every step splits the batch between the replicas,
 * averages their gradients (each replica reducing a slice, in parallel;
 * the sum is taken in replica order, so runs are reproducible), and every
 * replica applies the same optimizer step, so they stay identical.
 * Parameters no replica gave a gradient are skipped, as in one process. */
typedef struct dt_dp dt_dp;
/* Build one replica's model in ctx (register its parameters, same names and
 * shapes in every replica) and return its handle for the loss function;
 * NULL: failure (say why with ctx's error).  Called for each replica in
 * turn, on the caller's thread.  free_model (may be NULL) gets every handle
 * back in dt_dp_free, or when dt_dp_new fails after building some. */
typedef void *(*dt_dp_build_fn)(dt_ctx *ctx, int replica, void *user);
typedef void (*dt_dp_free_fn)(void *model, void *user);
/* The scalar loss of batch x, y on one replica (runs on its thread; the
 * replicas' calls overlap, so what user points to is shared by K threads). */
typedef dt_tensor *(*dt_dp_loss_fn)(dt_ctx *ctx, void *model, dt_tensor *x, dt_tensor *y,
                                    void *user);
typedef struct dt_dp_config {
    size_t struct_size;        /* set by its *_init (see "Config structs" above) */
    int replicas;              /* K >= 1 (default 2) */
    dt_ctx_config replica;         /* each replica's context; replica k is seeded seed + k (its
                                  dropout differs), then all copy replica 0's weights */
    dt_optim_config optim;     /* each replica's optimizer (default SGD) */
} dt_dp_config;
DT_API void dt_dp_config_init(dt_dp_config *cfg);
/* Errors of this and every dt_dp call go to ctx (borrowed; must outlive the
 * dt_dp).  user is borrowed.  new: free with dt_dp_free.  The caller's
 * thread drives replica 0 and K - 1 threads the others; the replicas'
 * allocator hooks are called from all of them.  DT_EINVAL: replicas
 * outside 1..1024, build or loss NULL, a build that failed; DT_ENOTSUP: a
 * backend without host memory; DT_EMISMATCH: replicas' parameters differ;
 * a replica context's or optimizer's own error. */
DT_API dt_dp *dt_dp_new(dt_ctx *ctx, const dt_dp_config *cfg, dt_dp_build_fn build,
                        dt_dp_loss_fn loss, dt_dp_free_fn free_model, void *user);
/* NULL is fine.  Stops the threads, frees the replicas (free_model gets
 * each model back) and their contexts. */
DT_API void dt_dp_free(dt_dp *dp);
/* One training step on x (B, ...) f32 and y (B) i32 (borrowed, in any
 * context with host-visible memory): replica k takes rows
 * [k B / K, (k + 1) B / K), the gradients are averaged with weights
 * rows_k / B, and every replica steps.  *loss_out (may be NULL): the mean
 * loss over the whole batch.  DT_EINVAL: x, y not as above; a replica's
 * failure (its status, the message naming it): no replica steps. */
DT_API dt_status dt_dp_step(dt_dp *dp, const dt_tensor *x, const dt_tensor *y, float *loss_out);
DT_API int dt_dp_replicas(const dt_dp *dp);       /* K; 0 for NULL */
/* Replica k's context and model (borrowed; NULL when k is out of range),
 * e.g. replica 0's to evaluate or save a checkpoint; use them only between
 * steps, on the caller's thread. */
DT_API dt_ctx *dt_dp_replica(const dt_dp *dp, int k);
DT_API void *dt_dp_model(const dt_dp *dp, int k);

/* Hogwild! (Niu et al., 2011): K threads run plain SGD on one set of
 * parameters with no locks, for sparse problems where two steps rarely
 * touch the same weights.  ctx's registered parameters are the shared
 * ones; build (dt_dp_build_fn, called for each thread on the caller's
 * thread) registers the same names and shapes in the thread's own
 * context, and those then use ctx's memory.  Thread k runs steps k, k + K,
 * ... < steps: loss(thread ctx, model, k, step, user) returns that step's
 * scalar loss; the runner does backward and the update.  A 2-D parameter
 * whose gradient only dt_embedding writes is updated in the rows the step
 * used and no others, so a step costs the rows it touches, not the table.
 * With threads = 1 the run is deterministic; with more, the interleaving
 * (and so the bits) depend on timing, as Hogwild! intends. */
typedef dt_tensor *(*dt_hogwild_loss_fn)(dt_ctx *ctx, void *model, int thread, int64_t step,
                                         void *user);
typedef struct dt_hogwild_config {
    size_t struct_size;        /* set by its *_init (see "Config structs" above) */
    int threads;               /* K >= 1 (default 2) */
    int64_t steps;             /* over all threads (default 1000) */
    float lr;                  /* SGD learning rate (default 0.01) */
    dt_ctx_config thread;          /* each thread's context (1 compute thread); thread k's is
                                  seeded seed + k */
} dt_hogwild_config;
DT_API void dt_hogwild_config_init(dt_hogwild_config *cfg);
typedef struct dt_hogwild_stats {
    int64_t steps;             /* steps run */
    double mean_loss;          /* over those steps */
    int64_t rows_updated;      /* rows updated through a row log (embedding tables) */
    int64_t dense_updates;     /* whole-tensor updates */
} dt_hogwild_stats;
/* Blocks until every step ran or a thread failed (the first error is
 * returned and said in ctx; the other threads stop).  out (may be NULL):
 * what ran.  ctx, user: borrowed; free_model (may be NULL) gets every
 * model back before returning.  loss runs on K threads at once (thread 0
 * is the caller's), each on its own context; build and free_model on the
 * caller's.  DT_EINVAL: threads outside 1..1024, steps < 0, lr < 0, build
 * or loss NULL, ctx without parameters, a thread context or build that
 * failed; DT_ENOTSUP: parameters not in host memory; DT_EMISMATCH: a
 * thread's model differs; a failing step's status. */
DT_API dt_status dt_hogwild_run(dt_ctx *ctx, const dt_hogwild_config *cfg, dt_dp_build_fn build,
                                dt_hogwild_loss_fn loss, dt_dp_free_fn free_model, void *user,
                                dt_hogwild_stats *out);

/* Distributed evaluation and batch inference.  forward(ctx, x, user)
 * returns logits (B, classes) for a batch x (B, C, H, W); it runs with grad
 * and training off (restored afterwards).  With a communicator, rank r
 * takes samples r, r + P, r + 2P, ... (each sample once), and the results
 * are combined over ranks; c NULL: this process does the whole dataset. */
typedef dt_tensor *(*dt_forward_fn)(dt_ctx *ctx, dt_tensor *x, void *user);
/* What dt_evaluate measures.  CLASSIFY (the default): forward returns
 * (B, classes) logits for scalar labels; accuracy and mean cross entropy.
 * LOSS: the mean loss per target element: cross entropy of (..., C) logits
 * against i32 targets (labels -100 ignored, as torch), MSE against f32
 * targets.  USER: metric_fn adds each batch's part to a sum and a count;
 * the value is their ratio over the dataset (and the ranks). */
typedef enum dt_metric { DT_METRIC_CLASSIFY = 0, DT_METRIC_LOSS, DT_METRIC_USER } dt_metric;
typedef dt_status (*dt_metric_fn)(dt_ctx *ctx, dt_tensor *out, dt_tensor *y, void *user,
                                  double *sum, double *count);
typedef struct dt_eval_config {
    size_t struct_size;        /* set by its *_init (see "Config structs" above) */
    int batch;                 /* samples per forward; 0: 128 */
    float mean, std;           /* input normalisation, as dt_loader_config (default 0, 1) */
    dt_metric metric;
    dt_metric_fn metric_fn;    /* DT_METRIC_USER: called per batch; borrows metric_user */
    void *metric_user;
} dt_eval_config;
DT_API void dt_eval_config_init(dt_eval_config *cfg);
typedef struct dt_metrics {
    int64_t samples;           /* the whole dataset's, summed over ranks */
    int64_t correct;           /* argmax equals the label */
    double accuracy;           /* correct / samples (CLASSIFY) */
    double loss;               /* mean cross-entropy (CLASSIFY), mean loss (LOSS) */
    double value;              /* the metric: accuracy, mean loss, or the user's sum / count */
} dt_metrics;
/* Collective when c is not NULL: every rank gets the whole dataset's
 * metrics.  ds and forward's user data are borrowed.  It runs a loader of
 * its own and calls dt_ctx_step_reset(ctx) after each batch, so step tensors
 * made before the call are gone after it.  DT_EINVAL: ds, forward or out
 * NULL, std <= 0, c of another context, an unknown metric or USER without
 * metric_fn, forward returned NULL or (CLASSIFY) not (B, classes) f32;
 * the loss's and metric_fn's errors; DT_EPEER: another rank failed its
 * part; and the collectives' errors. */
DT_API dt_status dt_evaluate(dt_ctx *ctx, dt_comm *c, const dt_dataset *ds,
                             const dt_eval_config *cfg, dt_forward_fn forward, void *user,
                             dt_metrics *out);
/* The predicted class (argmax of the logits) of every sample of ds, in
 * dataset order, gathered on rank 0 into pred (dt_dataset_size(ds) int32s,
 * borrowed; other ranks may pass NULL).  Collective when c is not NULL.
 * As dt_evaluate otherwise (rank 0's pred NULL: DT_EINVAL). */
DT_API dt_status dt_predict(dt_ctx *ctx, dt_comm *c, const dt_dataset *ds,
                            const dt_eval_config *cfg, dt_forward_fn forward, void *user,
                            int32_t *pred);

/* ---------------------------------------------------------------------------
 * 12. Parameter server
 *
 * Some ranks are servers, the rest workers (ranks 0..W-1 work, the last
 * `servers` ranks serve).  The parameters, laid out flat in DDP's bucket
 * order, are cut into one contiguous key range per server, balanced by
 * bytes (a large tensor may span servers).  Servers hold their range and
 * apply the optimizer to it as pushes arrive; workers push gradients and
 * pull parameters.  A DDP made with dt_ddp_config.ps pushes its buckets to
 * the servers and pulls the new parameters back instead of allreducing:
 * the same buckets, overlap and statistics (docs/PARAMETER_SERVER.md).
 *
 * Consistency: BSP (the servers average all workers' gradients of a step
 * before stepping; a pull waits for that), ASP (Downpour: each worker's
 * gradient is applied when it arrives, scaled by 1/W; pulls never wait),
 * SSP (as ASP, but a worker more than `staleness` steps ahead of the
 * slowest waits in its pull).
 *
 * A worker's requests run on its communicator's comm thread; the dt_ps
 * itself is used on its context's thread.  Worker calls on a server give
 * DT_ESTATE; a failed request gives DT_EPEER or DT_ETIMEDOUT naming the
 * server (or the status the server answered with).
 * ------------------------------------------------------------------------- */
typedef enum dt_ps_mode {
    DT_PS_MODE_AUTO = -1,      /* unset: DTRAIN_PS_MODE, else BSP (dt_ps_config_init's) */
    DT_PS_BSP = 0, DT_PS_ASP, DT_PS_SSP
} dt_ps_mode;

/* A sparse embedding table, held only by the servers (row r on server
 * r % servers) and moved by rows: a worker pulls the rows a batch uses and
 * pushes their gradients, so a table of millions of rows costs a step only
 * the rows it touches. */
typedef struct dt_ps_table {
    const char *name;          /* unique among the tables (borrowed during dt_ps_new) */
    int64_t rows, dim;         /* >= 1 each */
    float init_scale;          /* rows start uniform in [-init_scale, init_scale) (0: zeros), */
    uint64_t seed;             /* drawn from a hash of (seed, row, column): the same table
                                  whatever the number of servers */
} dt_ps_table;

typedef struct dt_ps_config {
    size_t struct_size;        /* set by its *_init (see "Config structs" above) */
    int servers;               /* server ranks; 0: DTRAIN_NUM_SERVERS, else 1 */
    dt_ps_mode mode;           /* DT_PS_MODE_AUTO (default): DTRAIN_PS_MODE=bsp|asp|ssp,
                                  else BSP; a mode the program sets is kept */
    int staleness;             /* SSP: the bound s >= 0; -1 (default): DTRAIN_PS_STALENESS,
                                  else 0 */
    dt_optim_config optim;     /* the servers' optimizer (dt_optim_config_init(DT_SGD)
                                  by default), for the parameters and the tables */
    dt_schedule schedule;      /* its learning-rate schedule (default constant); a step is
                                  one optimizer step: BSP one per step of all workers, ASP
                                  and SSP one per worker's push */
    const dt_ps_table *tables; /* workers: the sparse tables (every worker the same ones; */
    int ntables;               /* servers take worker 0's).  Borrowed during dt_ps_new. */
    int replicate;             /* 1: servers pair up, server s and s + servers/2 holding the
                                  same shard (servers must be even); workers push to both and
                                  pull from the first alive, so training goes on when a
                                  server dies, or stays silent (no heartbeat) for the
                                  timeout: then it is fenced off, and dt_ps_serve fails
                                  with DT_EPEER should it wake */
    const char *checkpoint_dir; /* servers: save the shard (parameters, tables, optimizer
                                  state) to <dir>/ps-server-<s>.safetensors every
                                  checkpoint_every optimizer steps and when serving ends
                                  (written whole, then renamed); a server that finds its
                                  file at dt_ps_new resumes from it (workers then start
                                  from the saved weights).  Borrowed during dt_ps_new. */
    int checkpoint_every;
    int rejoin_ms;             /* workers: how long to wait for a dead server (without a live
                                  replica) to be restarted before failing: 0 = 60000, < 0 =
                                  fail at once.  The restarted process (same rank, started by
                                  the launcher) finds its predecessor dead, rejoins through
                                  dt_comm_new, resumes from its checkpoint in dt_ps_new (it
                                  needs checkpoint_dir) and serves; workers send it their
                                  current requests again.  Updates it applied after its last
                                  checkpoint are lost, none older. */
    size_t chunk_bytes;        /* workers: messages' data travels in pieces of at most this
                                  many bytes (and so do the answers to them); 0: the
                                  transport's largest message, except on shm when a server
                                  death must not stop the job (replicate, or a
                                  checkpoint_dir to rejoin from): 4096, libfabric shm's
                                  inject size (docs/PARAMETER_SERVER.md, "Messages").
                                  DTRAIN_PS_CHUNK overrides 0.  At least 64. */
    int prefetch;              /* workers: 1 pulls a step's parameters in the background
                                  while the next step computes (double-buffered): steps
                                  compute on parameters one step stale, and never wait for
                                  a pull unless the servers fall behind */
} dt_ps_config;
DT_API void dt_ps_config_init(dt_ps_config *cfg);

/* Join the parameter-server job on c (made with ctx).  Collective: every
 * rank calls it.  On workers, ctx's registered parameters are the model
 * (every worker must register the same ones: a difference fails with
 * DT_EMISMATCH); worker 0's values are the servers' starting point and
 * every worker starts from them.  On servers ctx needs no model: the
 * layout comes from worker 0.  Fewer than 1 worker or server: DT_EINVAL.
 * ctx and c are borrowed and must outlive the PS.  new: free with
 * dt_ps_free.  Also DT_EINVAL for bad settings or tables (the ranks' must
 * agree: DT_EMISMATCH); DT_ENOTSUP: a restarted worker or replicated
 * server; and the store's and requests' errors. */
DT_API dt_ps *dt_ps_new(dt_ctx *ctx, dt_comm *c, const dt_ps_config *cfg);
/* NULL is fine.  A worker that did not finish tells the servers it left. */
DT_API void dt_ps_free(dt_ps *ps);
/* This rank's role, and the job's worker and server counts (0 for NULL). */
DT_API int dt_ps_is_server(const dt_ps *ps);
DT_API int dt_ps_workers(const dt_ps *ps);
DT_API int dt_ps_servers(const dt_ps *ps);
/* Servers: serve pushes and pulls until every worker has called
 * dt_ps_finish (or died: it is dropped after the communicator's timeout,
 * and the statistics count it; a warning, dt_ctx_set_log).  Takes the
 * transport from the comm thread meanwhile.  DT_ESTATE: a worker, or the
 * communicator failed earlier; DT_EPEER: the transport failed or a worker
 * sent a malformed request; checkpoint writing: DT_EIO.  DT_EPREEMPTED:
 * the job agreed to stop after a step (BSP: a worker's push or this server
 * caught a pre-emption signal, "Graceful pre-emption"), the workers
 * finished, and that step's state is saved with a checkpoint_dir (the
 * message and dt_preempt_report say where and how long it took): exit
 * DT_EXIT_PREEMPTED, and the job started again resumes from it. */
DT_API dt_status dt_ps_serve(dt_ps *ps);
/* Workers: push every parameter's gradient (absent ones as absent) as this
 * worker's next step, then pull the parameters into the parameter
 * tensors, waiting as the consistency model says.  The whole model; a DDP
 * with .ps does the same per bucket, overlapped with backward.  With
 * prefetch, the pull is the one started after the previous push. */
DT_API dt_status dt_ps_push_pull(dt_ps *ps);
/* Workers: push without pulling, e.g. Downpour's n_push < n_fetch (pull
 * every few steps with dt_ps_pull).  BSP: a worker's next request is read
 * once every worker's step is in (it runs at most one step ahead). */
DT_API dt_status dt_ps_push(dt_ps *ps);
/* Workers: pull the parameters without pushing (e.g. before evaluating). */
DT_API dt_status dt_ps_pull(dt_ps *ps);
/* Workers: this worker is done; servers stop waiting for it.  A prefetched
 * pull is waited for first (its weights kept). */
DT_API dt_status dt_ps_finish(dt_ps *ps);

/* Workers, sparse tables.  Table t's rows ids[0..n) go to rows_out (n * dim
 * floats, row i for ids[i]), as they stand after this worker's pushed steps
 * under the consistency model (a pull waits as dt_ps_pull does).  Ids may
 * repeat (each distinct row moves once) and must be in [0, rows).  ids and
 * rows_out are borrowed.  DT_EINVAL: no such table, n < 0, NULL arrays, an
 * id out of range (also for the two below). */
DT_API dt_status dt_ps_sparse_pull(dt_ps *ps, int table, const int64_t *ids, int64_t n,
                                   float *rows_out);
/* The same pull started in the background, e.g. the next batch's rows
 * while this batch computes: rows_out is written by the time dt_work_wait
 * returns; ids are copied now, rows_out stays borrowed until then.  new:
 * dt_work_wait frees it.  NULL: failure (dt_last_error). */
DT_API dt_work *dt_ps_sparse_pull_async(dt_ps *ps, int table, const int64_t *ids, int64_t n,
                                        float *rows_out);
/* Push gradient rows grads (n * dim floats, row i for ids[i]; repeated ids
 * are summed) to table t as part of this worker's current step.  The
 * servers' optimizer updates those rows only (their optimizer state too,
 * like torch's sparse gradients): BSP with the step's dense push, once
 * every worker's step is in; ASP and SSP at once, scaled by 1/workers.
 * Call it before the step's dt_ps_push_pull (or DDP sync).  Borrowed. */
DT_API dt_status dt_ps_sparse_push(dt_ps *ps, int table, const int64_t *ids, int64_t n,
                                   const float *grads);

typedef struct dt_ps_stats {
    int64_t pushes, pulls;     /* requests this rank sent (worker) or served (server) */
    int64_t steps;             /* worker: steps pushed; server: optimizer steps applied */
    int64_t max_staleness;     /* largest (the asking worker's step - the slowest worker's
                                  step) a dense pull was answered at: this worker's pulls,
                                  or (server) every worker's */
    double mean_staleness;
    double wait_s;             /* worker: time spent waiting for pulls */
    int dropped_workers;       /* server: workers that died and were dropped */
    int64_t rows_pushed;       /* distinct sparse rows pushed (worker: sent; server: got) */
    int64_t rows_pulled;       /* distinct sparse rows pulled (worker: got; server: sent) */
    int64_t rows_updated;      /* server: row updates its optimizer applied */
    int64_t checkpoints;       /* server: checkpoints written */
    int resumed;               /* server: it started from its checkpoint */
    int64_t resumed_step;      /* server: the optimizer step that checkpoint was taken at */
    int rejoined;              /* server: a restarted process that rejoined a running job */
    int rejoins;               /* worker: restarted servers it went on with */
} dt_ps_stats;
/* This rank's totals since dt_ps_new.  DT_EINVAL: NULL. */
DT_API dt_status dt_ps_stats_get(const dt_ps *ps, dt_ps_stats *out);

/* ---------------------------------------------------------------------------
 * 13. Profiler: where a step's time goes, timelines, stragglers
 *
 * Off by default; dt_profile_start(ctx, NULL) or DTRAIN_PROFILE=1 in the
 * environment (read by dt_ctx_new) turns it on.  It then measures each
 * training step of the context, on the thread that drives it:
 *   data wait    inside dt_loader_next
 *   forward      from the end of the previous phase to the start of dt_backward
 *   backward     inside dt_backward (a DDP's buckets start their allreduces here)
 *   comm wait    waiting for communication: the buckets still in flight in
 *                dt_ddp_sync / dt_ddp_step (exposed communication), blocking
 *                collectives, dt_work_wait, parameter-server pulls
 *   optimizer    inside dt_optim_step
 *   idle         the rest: the caller's own code between dtrain's calls
 * and these add up to the step's wall time.  A step ends at the
 * dt_ctx_step_reset after a dt_backward.  The comm thread times every
 * collective (bytes, algorithm, algbw, busbw) and parameter-server call
 * (latency, staleness of the answer), the loader's thread every batch it
 * prepares; with the phases they make a timeline kept in memory.
 *
 * Phases are host time: on an accelerator backend, whose kernels run
 * asynchronously, a phase ends when its work is queued, and the wait for it
 * shows up where the host next waits for the device.
 *
 * With a DDP made after the profiler started, the ranks swap their compute
 * times every check_every steps; a rank whose compute per step exceeds the
 * median by more than straggler_threshold is a straggler, told as a warning
 * (dt_ctx_set_log) naming it.
 *
 * The comm and loader threads add their events under the profiler's mutex,
 * so dt_profile_active and dt_profile_stats_get may be called from any thread while
 * the context lives; the other calls belong to the context's thread.
 * ------------------------------------------------------------------------- */
typedef struct dt_profile_config {
    size_t struct_size;        /* set by its *_init (see "Config structs" above) */
    int max_events;            /* timeline events kept on this rank; 0: 262144 (later ones
                                  are counted as dropped) */
    double straggler_threshold; /* 0: DTRAIN_STRAGGLER, else 0.15 (15% above the median) */
    int check_every;           /* steps between the ranks' checks; 0: 20 */
} dt_profile_config;
DT_API void dt_profile_config_init(dt_profile_config *cfg);
/* Start (or restart, clearing what was recorded) profiling ctx.  cfg may be
 * NULL (defaults).  DT_ENOMEM when the event buffer cannot be had. */
DT_API dt_status dt_profile_start(dt_ctx *ctx, const dt_profile_config *cfg);
DT_API int dt_profile_active(const dt_ctx *ctx);       /* 1 while recording */

typedef struct dt_profile_stats {
    int rank;                  /* the communicator's, 0 without one */
    int64_t steps;             /* training steps measured */
    double step_s;             /* their wall time; the six phases below add up to it */
    double data_s, forward_s, backward_s, comm_wait_s, optimizer_s, idle_s;
    double comm_s;             /* time collectives ran on the comm thread, hidden or not */
    int64_t collectives;       /* collectives run (parameter-server calls not included) */
    uint64_t coll_bytes;       /* their payload bytes */
    double busbw;              /* bytes-weighted bus bandwidth they ran at, GB/s */
    int64_t ps_calls;          /* parameter-server calls (pushes and pulls) */
    double ps_latency_s;       /* their total latency */
    int64_t ps_max_staleness;  /* pulls: the largest staleness answered */
    double ps_mean_staleness;
    int64_t samples;           /* samples the loaders gave this context's steps */
    int64_t events, dropped;   /* timeline events kept and not kept */
    int straggler_warnings;    /* checks that found this rank a straggler */
    double pipe_wait_s;        /* of comm_wait_s: a pipeline stage waiting for its
                                  neighbours (the bubble, 14) */
    double pipe_bubble_ideal;  /* the latest pipeline step's (stages-1)/(m+stages-1) */
    /* a parameter server's own rank, while in dt_ps_serve: */
    double ps_serve_s;         /* wall time serving */
    double ps_busy_s;          /* of it, handling requests and applying steps */
    double ps_stalled_s;       /* of it, not running when it should have: gaps in its loop
                                  beyond its 20 ms poll and 50 ms of slack (a stopped
                                  process, or a host that starves it) */
    int64_t ps_served;         /* requests it answered or applied */
    double ps_bytes_in, ps_bytes_out;
    int64_t ps_queue_max;      /* the most requests waiting at once (held pulls, parked
                                  workers) */
    int64_t ps_keys;           /* floats it holds (its shard, the step flags, its rows of
                                  the sparse tables) */
    /* a sharded DDP (dt_ddp_config.zero), as dt_ddp_stats: */
    double gather_s;           /* time the parameters' all-gathers ran */
    double gather_exposed_s;   /* of it, what the training thread waited for (zero 1-2: all
                                  of it, after the step; zero 3: what prefetch did not hide) */
    int64_t gathers;           /* zero 3: units gathered */
    int64_t gathers_on_demand; /* of them, those no prefetch had started */
    /* the CPU this process got, since profiling started (docs/PROFILING.md, "CPU"): */
    double wall_s;             /* wall time since dt_profile_start */
    double cpu_s;              /* CPU time its threads used (getrusage) */
    double cpu_wait_s;         /* time its threads were runnable but waited for a CPU (the
                                  scheduler's run queue, /proc/self/task/N/schedstat; 0 where
                                  the kernel keeps none) */
    double throttled_s;        /* time its cgroup's CPU quota held it back (cpu.stat: v2
                                  throttled_usec, v1 throttled_time; 0 without a quota) */
    int64_t cpu_periods;       /* the quota's periods, and of them those throttled */
    int64_t cpu_throttled_periods;
    /* the longest wait for a living rank past the peer timeout (its heartbeat on): */
    double longest_wait_s;     /* 0: none that long */
    int longest_wait_rank;     /* the rank waited for (the communicator's), -1: none */
    /* a parameter-server worker: its requests' latency to each server separately */
    int ps_slowest_server;     /* the rank of the server it waited longest for per request
                                  (mean), -1: no requests */
    double ps_slowest_server_ms;   /* that server's mean latency */
    double ps_server_median_ms;    /* the median of the servers' mean latencies */
    /* what kept the training thread from its steps, since dt_profile_start: */
    double eval_s;             /* time in dt_evaluate */
    double ckpt_s;             /* time saving and loading checkpoints (dt_checkpoint_*,
                                  dt_ddp_checkpoint_*) */
    int threads;               /* the context's compute threads (dt_ctx_config.threads) */
} dt_profile_stats;
/* This rank's totals so far.  ctx borrowed.  DT_EINVAL: ctx or out NULL. */
DT_API dt_status dt_profile_stats_get(const dt_ctx *ctx, dt_profile_stats *out);

/* End of the job, collective over c (NULL: this process alone): every
 * rank's totals and timeline go to rank 0, which writes the merged
 * timeline to trace_path (NULL: DTRAIN_TRACE, else no file) as Chrome
 * trace events (chrome://tracing, ui.perfetto.dev): one process row per
 * rank, threads for compute, comm and loader, every rank's clock moved onto
 * rank 0's by the offset estimated at rendezvous.  Rank 0 then builds the
 * report: a breakdown table per rank, the slowest rank and phase, the
 * stragglers, communication efficiency against the link's bandwidth
 * (measured here with a few large allreduces), and hints.  Profiling stops.
 * A no-op (DT_OK) when ctx is not profiling, so programs may always call
 * it; every rank must then be off.  After a failed job (a rank died, the
 * communicator broke) the exchange cannot run: each rank then puts its
 * part in the store, rank 0 waits for the others' (up to the timeout, at
 * most 3 s) and reports on all it got, naming what each was doing and the
 * ranks that sent nothing; its trace has its own timeline; the others
 * report on themselves; the call still fails with the exchange's error.
 * DT_EINVAL: c of another context; DT_EIO: the trace cannot be written;
 * DT_EPEER: a rank's profile is missing or malformed; and the collectives'
 * errors. */
DT_API dt_status dt_profile_stop(dt_ctx *ctx, dt_comm *c, const char *trace_path);
/* Rank 0, after dt_profile_stop: the report (ctx-owned text, "" before or
 * elsewhere), and rank r's totals (DT_ESTATE where there are none). */
DT_API const char *dt_profile_report(const dt_ctx *ctx);
DT_API dt_status dt_profile_rank_stats_get(const dt_ctx *ctx, int rank, dt_profile_stats *out);
/* The rank the latest check named a straggler (the slowest, if several), or
 * -1.  Every rank gets the same answer. */
DT_API int dt_profile_straggler(const dt_ctx *ctx);

/* ---------------------------------------------------------------------------
 * 14. Model parallelism: pipelines and tensor-parallel layers
 *
 * For a model too large or too slow for one rank.  Both work over a
 * communicator (usually a group from dt_comm_split) and compose with DDP
 * over another group: with 4 ranks, pipe = split(color rank / 2) and dp =
 * split(color rank % 2) give 2 stages x 2 data-parallel replicas.
 *
 * A pipeline puts consecutive stages of a sequential model on the ranks of
 * its communicator (stage = rank), splits each batch into micro-batches and
 * runs them so that stages work at once: activations go forward and their
 * gradients back with dt_comm_send/dt_comm_recv.  Two schedules:
 *   DT_PIPE_GPIPE  fill-drain: all forwards, then all backwards; a stage
 *                  holds every micro-batch's activations.
 *   DT_PIPE_1F1B   one forward, one backward in the steady state (PipeDream-
 *                  flush, as Megatron-LM): stage s holds at most stages - s
 *                  micro-batches' activations, whatever their number.
 * Both run backwards in micro-batch order and give the same gradients, which
 * are the whole batch's (each micro-batch's loss is weighted by its share of
 * the batch): a pipelined model trains like the unsplit one.  The idle time
 * while a stage waits for its neighbours is the bubble, ideally
 * (stages - 1) / (micro_batches + stages - 1) of a step.
 * ------------------------------------------------------------------------- */
typedef struct dt_pipe dt_pipe;

typedef enum { DT_PIPE_GPIPE = 0, DT_PIPE_1F1B = 1 } dt_pipe_schedule;

/* One stage's forward of one micro-batch.  x: stage 0, its rows of the
 * batch given to dt_pipe_step (a view); later stages, the previous stage's
 * output (a leaf that requires grad).  y: on the last stage, the micro-
 * batch's rows of the targets (a view); NULL elsewhere.  Returns the
 * stage's output (f32, the micro-batch in dim 0, other dims the same for
 * every micro-batch), or on the last stage the micro-batch's mean loss (one
 * f32), made with ops in ctx; NULL fails the step with ctx's error.  Its
 * step tensors live until the micro-batch's backward. */
typedef dt_tensor *(*dt_stage_fn)(dt_ctx *ctx, dt_tensor *x, dt_tensor *y, void *user);

typedef struct dt_pipe_config {
    size_t struct_size;        /* set by its *_init (see "Config structs" above) */
    int micro_batches;         /* m >= 1 (default 4); a batch of B rows splits into m parts
                                  of B/m rows (the first B%m one more); B >= m */
    dt_pipe_schedule schedule; /* default DT_PIPE_1F1B */
} dt_pipe_config;
DT_API void dt_pipe_config_init(dt_pipe_config *cfg);

/* This rank's stage (its rank in c, of dt_comm_size(c) stages) running fn
 * with user.  cfg NULL: defaults; every stage must pass the same
 * micro_batches and schedule (checked at the first step: DT_EMISMATCH).
 * ctx and c (of ctx) borrowed, must outlive it; with a DDP on ctx (over
 * other ranks), its gradients are reduced during the last micro-batch's
 * backward.  new: free with dt_pipe_free.  NULL and ctx's error:
 * DT_EINVAL (NULL ctx, c or fn, c of another context, micro_batches < 1). */
DT_API dt_pipe *dt_pipe_new(dt_ctx *ctx, dt_comm *c, const dt_pipe_config *cfg, dt_stage_fn fn,
                            void *user);
DT_API void dt_pipe_free(dt_pipe *p);              /* NULL is fine */
/* One training step's forward and backward through every stage, collective
 * over the pipeline's ranks: afterwards each stage's parameters hold the
 * batch's gradients (added to what they held), for dt_optim_step or
 * dt_ddp_step.  x: the batch's inputs on stage 0 (ignored elsewhere); y: its
 * targets on the last stage (ignored elsewhere); both borrowed, rows in dim
 * 0.  loss_out (may be NULL): the last stage's batch mean loss; NAN on the
 * others.  Needs grad enabled.  The micro-batches' memory is the pipeline's
 * and is reused next step (call dt_ctx_step_reset between steps as usual).
 * DT_EINVAL: x or y missing where needed, B < m, a stage output of the wrong
 * kind or shape; DT_EMISMATCH: the stages disagree on B, m or the schedule;
 * a neighbour's failure or death fails the step naming it (a stage that
 * fails publishes why, so its neighbours do not wait for the timeout). */
DT_API dt_status dt_pipe_step(dt_pipe *p, const dt_tensor *x, const dt_tensor *y, float *loss_out);
DT_API int dt_pipe_stage(const dt_pipe *p);       /* this rank's stage; -1 for NULL */
DT_API int dt_pipe_stages(const dt_pipe *p);      /* 0 for NULL */

typedef struct dt_pipe_stats {
    int64_t steps;             /* dt_pipe_step calls that succeeded */
    int64_t micro_batches;     /* their micro-batches */
    double step_s;             /* wall time inside those steps */
    double compute_s;          /* this stage's forwards and backwards */
    double wait_s;             /* blocked on a neighbour: the bubble plus transfers */
    double bubble;             /* wait_s / step_s, measured */
    double bubble_ideal;       /* (stages - 1) / (m + stages - 1) */
    uint64_t bytes_sent;       /* activations and gradients sent */
    int in_flight_peak;        /* most micro-batches whose activations were held at once */
    size_t act_bytes_peak;     /* their memory then (step tensors of the stage) */
} dt_pipe_stats;
/* Totals since dt_pipe_new or the last reset.  DT_EINVAL: p or out NULL. */
DT_API dt_status dt_pipe_stats_get(const dt_pipe *p, dt_pipe_stats *out);
DT_API void dt_pipe_stats_reset(dt_pipe *p);

/* Balanced partitioning.  dt_profile_layer_times measures, on this rank, each
 * layer of a sequential model (layer i maps the previous one's output to
 * its own): forward and backward of each alone, on its input computed
 * from sample, in milliseconds (ms_out[i], n entries): the median of reps
 * runs, taken round robin over the layers after one warm-up round.
 * With c (may be NULL) the times are averaged over its ranks, so every rank
 * gets the same numbers and so the same partition (a DDP on ctx takes no
 * part).  The parameters' gradients are zeroed afterwards, and step memory
 * reset.  DT_EINVAL: a
 * NULL argument, n < 1, reps < 1; a layer's failure with its error. */
typedef dt_tensor *(*dt_layer_fn)(dt_ctx *ctx, dt_tensor *x, void *user);
DT_API dt_status dt_profile_layer_times(dt_ctx *ctx, dt_comm *c, dt_layer_fn const *layers,
                                void *const *users, int n, const dt_tensor *sample, int reps,
                                double *ms_out);
/* Split n layers of costs cost[0..n-1] (>= 0) into `stages` consecutive
 * runs minimising the largest run's total (ties: the earliest boundaries);
 * stage s gets layers first[s] .. first[s+1]-1, first has stages + 1
 * entries (first[0] = 0, first[stages] = n), each stage at least one
 * layer.  Deterministic: the same costs give the same split on every rank.
 * DT_EINVAL: NULL, stages < 1, n < stages, a negative or non-finite cost. */
DT_API dt_status dt_pipe_partition(const double *cost, int n, int stages, int *first);

/* Tensor parallelism (Megatron-LM) over the ranks of c (of ctx), as autograd
 * ops; every rank of c runs the same ops in the same order (they are
 * collectives) on tensors of the same shapes.
 *   dt_tp_copy    forward x; backward allreduce-sums the gradient ("f")
 *   dt_tp_reduce  forward allreduce-sum of x; backward the gradient ("g")
 *   dt_tp_gather  forward the ranks' x concatenated along the last dim;
 *                 backward this rank's slice of the gradient
 *   dt_tp_split   forward this rank's slice of the last dim (size/ranks);
 *                 backward gathers the gradient
 * Layers: a column-parallel linear holds rows [r*O/p, (r+1)*O/p) of the
 * full weight (O, I) and of its bias: w (O/p, I), b (O/p) or NULL; its
 * output is this rank's columns, or all of them with gather_output.  A
 * row-parallel linear holds columns [r*I/p, (r+1)*I/p): w (O, I/p), and the
 * whole bias b (O) or NULL, added once after the sum; its input is this
 * rank's columns (input_is_split, as a column-parallel layer gives them) or
 * the whole input.  Column then row is Megatron's MLP: one allreduce
 * forward and one backward.  Errors as for the ops and collectives. */
DT_API dt_tensor *dt_tp_copy(dt_ctx *ctx, dt_comm *c, dt_tensor *x);
DT_API dt_tensor *dt_tp_reduce(dt_ctx *ctx, dt_comm *c, dt_tensor *x);
DT_API dt_tensor *dt_tp_gather(dt_ctx *ctx, dt_comm *c, dt_tensor *x);
DT_API dt_tensor *dt_tp_split(dt_ctx *ctx, dt_comm *c, dt_tensor *x);
DT_API dt_tensor *dt_tp_linear_col(dt_ctx *ctx, dt_comm *c, dt_tensor *x, dt_tensor *w,
                                   dt_tensor *b, int gather_output);
DT_API dt_tensor *dt_tp_linear_row(dt_ctx *ctx, dt_comm *c, dt_tensor *x, dt_tensor *w,
                                   dt_tensor *b, int input_is_split);
/* Copy this rank's block of `full` along dim (size / ranks of c) into
 * shard, e.g. to start tensor-parallel weights from an unsplit model's.
 * full and shard may be in different contexts; borrowed.  Local (no
 * communication).  DT_EINVAL: NULL, dim out of range, size not divisible by
 * the ranks, or shard's shape not the block's. */
DT_API dt_status dt_tp_shard(const dt_comm *c, const dt_tensor *full, int dim, dt_tensor *shard);

/* ---------------------------------------------------------------------------
 * 14b. Live monitoring: a web page and Prometheus metrics of a running job
 *
 * Opt-in.  Every rank calls dt_monitor_new (not collective: no rank waits
 * for another); each starts a thread that, every interval, reads its
 * profiler's totals (dt_profile_stats_get; the profiler is started if it was not)
 * and the scalars given to dt_monitor_log, and publishes a small summary
 * through the rendezvous store on a connection of its own.  Rank 0's thread
 * gathers the summaries, works out each rank's step phases, throughput and
 * liveness over the last interval, the slowest rank and why (as the
 * profiler's end-of-job report), and serves over HTTP from the server's own
 * threads (backends/http.c, libmicrohttpd):
 *   /            a self-contained page (no network fetches), live
 *   /api/state   the current state as JSON
 *   /events      Server-Sent Events: the state, each interval
 *   /metrics     Prometheus text exposition (dtrain_* families)
 * The training loop never waits for the monitor or a browser: both threads
 * only take the monitor's lock for copies.  Read-only (GET and HEAD);
 * requests over 16 KiB and more than 16 connections are refused.  Bound to
 * loopback unless told otherwise; bound elsewhere, every request needs the
 * job's token ("Authorization: Bearer T" or ?token=T).
 * ------------------------------------------------------------------------- */
typedef struct dt_monitor dt_monitor;
typedef struct dt_monitor_config {
    size_t struct_size;        /* set by its *_init (see "Config structs" above) */
    const char *listen;        /* rank 0: "[host:]port" to serve on; NULL: DTRAIN_MONITOR, else
                                  "127.0.0.1:0" (any free port; dt_monitor_port says which) */
    double interval_s;         /* how often ranks publish and the page updates; 0: 1 s */
    const char *token;         /* needed by requests when not on loopback; NULL: the job's
                                  (DTRAIN_JOB_TOKEN), else "" (then only loopback is allowed) */
} dt_monitor_config;
DT_API void dt_monitor_config_init(dt_monitor_config *cfg);
/* Start monitoring ctx (and c's ranks; c NULL: this process alone).  cfg
 * may be NULL.  Returns a new monitor, freed by dt_monitor_free, or NULL
 * with ctx's error: DT_ENOTSUP when dtrain was built without an HTTP server
 * (rank 0 only); DT_EINVAL: a bad listen address, or one off loopback
 * without a token; DT_EIO: the address cannot be bound; the store's errors. */
DT_API dt_monitor *dt_monitor_new(dt_ctx *ctx, dt_comm *c, const dt_monitor_config *cfg);
/* Record a scalar of this rank at step (a training loss, a learning rate,
 * a validation loss...): the page plots its history, /metrics gives the
 * latest.  name: letters, digits and '_' (at most 23); "loss", "lr" and
 * "val_loss" become dtrain_loss, dtrain_learning_rate and
 * dtrain_validation_loss, others dtrain_metric{name="..."}.  At most 8
 * names.  Cheap: a copy under the monitor's lock.  DT_EINVAL: NULL, a bad
 * name, a 9th name. */
DT_API dt_status dt_monitor_log(dt_monitor *m, const char *name, int64_t step, double value);
/* Rank 0: the port it serves on; -1 elsewhere or for NULL. */
DT_API int dt_monitor_port(const dt_monitor *m);
/* Stop the threads and the server; closes open streams.  NULL is a no-op. */
DT_API void dt_monitor_free(dt_monitor *m);

/* ---------------------------------------------------------------------------
 * 15. Utilities
 * ------------------------------------------------------------------------- */
/* Number of rows of logits (N,C) whose argmax equals labels (N).
 * DT_EINVAL: an argument NULL, or not contiguous f32 (N,C) and i32 (N). */
DT_API dt_status dt_count_correct(dt_ctx *ctx, const dt_tensor *logits, const dt_tensor *labels,
                                  int64_t *correct_out);
/* Monotonic clock in seconds (CLOCK_MONOTONIC).  Thread-safe. */
DT_API double dt_now(void);

#ifdef __cplusplus
}
#endif
#endif /* DTRAIN_H */
