/*
 * backends/cuda.cu - the CUDA compute backend: cuBLAS for GEMM, own kernels
 * for everything else.
 *
 * Device pointers are cudaMalloc'd memory, or for blocks of a granule or
 * more memory mapped with the driver's virtual memory calls so that part of
 * it can be given back (section 3b) (host_visible = 0; never managed
 * memory).  All work is queued on one non-blocking compute stream, so kernels
 * run in call order and the host only waits where the interface returns a
 * value (sumsq, xent_forward, index_check, count_correct) or copies to or
 * from pageable host memory (to_host, to_device).  A second stream carries
 * the staging copies (copy_async), ordered against the compute stream with
 * events.
 *
 * Every kernel computes what backends/cpu.c computes, with the same argument
 * conventions and accumulate flags.  Bit-identical results run to run
 * (backend.h, "Determinism contract"): there is no float atomicAdd anywhere;
 * every sum is done by a fixed thread in a fixed order, or by a fixed-shape
 * tree whose shape depends only on the problem's sizes, never on timing.
 * Gathers replace scatters where the CPU adds into shared outputs (col2im,
 * pool backward: each output element sums its own contributions in the CPU's
 * order).  Integer atomics (label checks, hit counts) are exact.  Results can
 * differ from the CPU backend in the last bits: sums are associated
 * differently, nvcc contracts a*b+c into FMAs, and exp/tanh/erfc are CUDA's.
 *
 * Kernels use grid-stride loops over int64 indices with a capped grid
 * (grid_for); kernels assume valid arguments (the core validates shapes).
 * What can still fail underneath (a launch, a cuBLAS call, a copy, a kernel's
 * fault found at a sync) is checked where it is issued and kept as the
 * instance's sticky first fault, which fault() reports (section 2, "the
 * fault record"); nothing here prints or aborts.
 * Written as C-like CUDA C++ (no exceptions, new/delete, STL or iostream) so
 * the object links into C programs with -lcudart -lcublas.
 *
 * Sections:
 *   1. Tunables and small helpers
 *   2. The instance
 *   3. Device memory pool
 *   3b. Blocks that give memory back (discard, commit)
 *   4. Lifetime
 *   5. Copies and staging
 *   6. Dense linear algebra (cuBLAS) and mixed precision
 *   7. Elementwise
 *   8. Strided index spaces: binary, copy_strided
 *   9. Deterministic sums: sum, sumsq, sum_to, reduce_axis, bias_grad
 *  10. Softmax and cross entropy
 *  11. Convolution helpers
 *  12. Pooling
 *  13. Embedding and index checks
 *  14. Layer norm
 *  15. Dropout
 *  16. Optimizers
 *  17. Metrics
 *  17b. Attention
 *  18. The interface table
 */
#include <stddef.h>
#include <stdint.h>

/* In the repository the interfaces are beside this file; vendored, this file
   sits beside dtrain.h and dtrain.c, which carries them (src/amalgamate.awk). */
#if __has_include("backend.h")
#include "backend.h"   /* extern "C" inside */
#include "half.h"
#include "shape.h"
#else
#define DT_INTERFACES_ONLY
#include "dtrain.c"
#endif

#include <cublas_v2.h>
#include <cuda.h>   /* the driver's virtual memory calls (section 3b): types only */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------
 * 1. Tunables and small helpers
 * ------------------------------------------------------------------------- */
#define DT_CUDA_THREADS 256        /* threads per block everywhere */
#define DT_CUDA_MAX_GRID 8192      /* grid cap; grid-stride loops cover the rest
                                      (an H100 holds 132 SMs x 8 such blocks) */
#define DT_CUDA_TICKETS 256        /* ring of copy-ticket events */
#define DT_CUDA_MIN_BLOCK 512      /* smallest pool size class, bytes */
#define DT_CUDA_CLASSES 256        /* size classes: 4 per power of two */
#define DT_CUDA_RED_SLOTS 65536    /* double partials for two-pass sums (512 KB) */
#define DT_CUDA_RED_CHUNK 4096     /* elements per partial, at least */
#define DT_CUDA_RED_PARTS 1024     /* partials per output, at most */
#define DT_CUDA_ROW_LONG 2048      /* rows this long get a block each, else a warp */
#define DT_CUDA_MIN_CC 8           /* kernels are built for sm_80 and sm_90 */
#define DT_CUDA_FAULT_MSG 320      /* bytes kept of the first fault's message */
#define DT_CUDA_PACK_ALIGN 8       /* gemm_ex's packed rows and entries, elements */
#define DT_CUDA_TF32_DIRECT_MIN 128   /* TF32 products unpacked from this size (section 6) */

/* init's message when there is nothing to run on (no driver, no device).  The
 * tests match this prefix to report "skipped: no GPU", so no other failure
 * may begin with it (device_check). */
#define DT_CUDA_NO_DEVICE_MSG "cuda: no CUDA device is visible"

#define DT_GRID_LOOP(i, n)                                                          \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);      \
         i += (int64_t)blockDim.x * gridDim.x)

/* Blocks for n units of `per_block` each, capped: kernels loop over the rest. */
static unsigned grid_for(int64_t n, int64_t per_block)
{
    int64_t b = (n + per_block - 1) / per_block;
    if (b < 1) b = 1;
    return (unsigned)(b < DT_CUDA_MAX_GRID ? b : DT_CUDA_MAX_GRID);
}

static __host__ __device__ inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static __host__ __device__ inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Start of part i of `parts` contiguous ranges over [0, n), as cpu.c's. */
static __host__ __device__ inline int64_t part_start(int64_t n, int64_t parts, int64_t i)
{
    return (n / parts) * i + (n % parts) * i / parts;
}

/* NaN-propagating max, as torch.amax (cpu.c's max_nan) */
static __device__ inline float max_nan(float m, float v) { return (v > m || v != v) ? v : m; }

/* Sums across a warp by a fixed butterfly: every lane ends with the same
 * bits (each step adds a pair commutatively), the same on every run. */
static __device__ inline double warp_sum(double v)
{
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

static __device__ inline float warp_max(float v)
{
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = max_nan(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

/* Whole-block sum: warp butterflies, then every thread adds the warp totals
 * in warp order.  All threads must call it; all get the same value.  sh holds
 * 32 doubles; the first barrier lets a previous call's readers finish. */
static __device__ double block_sum(double v, double *sh)
{
    v = warp_sum(v);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    double t = 0.0;
    for (unsigned w = 0; w < (blockDim.x >> 5); w++) t += sh[w];
    return t;
}

static __device__ float block_max(float v, float *sh)
{
    v = warp_max(v);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = sh[0];
    for (unsigned w = 1; w < (blockDim.x >> 5); w++) t = max_nan(t, sh[w]);
    return t;
}

/* Row kernels run a group of g threads per row: a warp (g = 32, eight rows
 * per block) for short rows, the whole block (g = 256) for long ones.  g is a
 * kernel argument, not a template parameter: nvcc's host stubs for template
 * kernels need the C++ runtime (guarded statics), and C programs link this. */
static __device__ inline double group_sum(double v, double *sh, int g)
{
    return g == 32 ? warp_sum(v) : block_sum(v, sh);
}

static __device__ inline float group_max(float v, float *sh, int g)
{
    return g == 32 ? warp_max(v) : block_max(v, sh);
}

/* threads per row for rows of length len */
static int row_group(int64_t len) { return len >= DT_CUDA_ROW_LONG ? DT_CUDA_THREADS : 32; }

/* Blocks for a row kernel with g threads per row. */
static unsigned grid_rows(int64_t rows, int g) { return grid_for(rows, DT_CUDA_THREADS / g); }

/* ---------------------------------------------------------------------------
 * 2. The instance
 * ------------------------------------------------------------------------- */

/* cached blocks of one size class, a stack */
typedef struct dt_cuda_freelist {
    void **ptrs;
    int64_t count, cap;
} dt_cuda_freelist;

/* A block made with the driver's virtual memory calls (section 3b): its
 * reserved range and, per granule, the physical allocation mapped there (0:
 * given back). */
typedef struct dt_cuda_vblock {
    uintptr_t base;
    size_t size;                  /* reserved: a multiple of the granule */
    size_t used;                  /* what its holder asked for; the rest is the pool's padding */
    CUmemGenericAllocationHandle *h;
} dt_cuda_vblock;

/* The driver's entry points, through the runtime (no link to libcuda). */
typedef struct dt_cuda_vmm_calls {
    CUresult (*create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                       unsigned long long);
    CUresult (*release)(CUmemGenericAllocationHandle);
    CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
    CUresult (*unmap)(CUdeviceptr, size_t);
    CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    CUresult (*reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*unreserve)(CUdeviceptr, size_t);
    CUresult (*granularity)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
} dt_cuda_vmm_calls;

struct dt_backend {
    dt_allocator al;
    int device;
    cudaStream_t compute;         /* every kernel, cuBLAS call and plain copy */
    cudaStream_t copy;            /* copy_async only */
    cublasHandle_t blas;          /* bound to `compute` */
    cudaEvent_t fence;            /* compute-stream point a staging copy waits for */
    cudaEvent_t tickets[DT_CUDA_TICKETS];
    int ntickets;                 /* events created (for a partial init) */
    pthread_mutex_t mu;           /* the pool, the scratch and the tickets */
    pthread_mutex_t fault_mu;     /* writers of the fault record; a leaf lock */
    int mu_ready;                 /* both mutexes exist */
    /* the first failure underneath, sticky (backend.h, "faults") */
    int faulted;                  /* 1 once fault_status and fault_msg are final */
    dt_status fault_status;
    char fault_msg[DT_CUDA_FAULT_MSG];
    uint64_t ticket_last;         /* last ticket issued */
    uint64_t ticket_fenced;       /* compute stream already waits for these */
    /* device memory pool (section 3) */
    dt_cuda_freelist cached[DT_CUDA_CLASSES];
    uintptr_t *live_key;          /* open-addressing map: block -> size class */
    uint8_t *live_cls;
    size_t live_cap, live_count;
    /* two-pass sums: DT_CUDA_RED_SLOTS partials, then a u64 flag and a double */
    double *red;
    /* gemm_ex operand copies, grow-only (section 6) */
    void *scratch;
    size_t scratch_bytes;
    int tf32_direct;              /* cuBLAS rounds f32 to TF32 as round_tf32 (section 6) */
    /* blocks that give memory back (section 3b) */
    int vmm;                      /* blocks of a granule or more are made that way */
    size_t granule;
    dt_cuda_vmm_calls vc;
    CUmemAllocationProp vprop;
    CUmemAccessDesc vaccess;
    dt_cuda_vblock *vblocks;      /* live and cached ones, unordered */
    int64_t nvblocks, vblocks_cap;
};

static unsigned long long *red_flag(dt_backend *be)
{
    return (unsigned long long *)(be->red + DT_CUDA_RED_SLOTS);
}
static double *red_result(dt_backend *be) { return be->red + DT_CUDA_RED_SLOTS + 1; }

/* ---- the fault record -----------------------------------------------------
 * Every kernel launch, cuBLAS call, copy, memset, event and stream operation
 * is checked where it is issued; the first failure is kept with where it
 * happened, later ones are dropped (they are mostly its echoes: a context
 * that saw an illegal address fails every call after it).  A fault found at
 * a synchronization may come from any kernel queued before it; the location
 * is where it surfaced (CUDA_LAUNCH_BLOCKING=1 makes the two the same).
 * Writers take fault_mu, which is never held while taking another lock, so
 * code that holds mu can record.  Readers only load `faulted`, stored with
 * release after the record is complete and never changed again, so fault()
 * and the hot-path checks take no lock. */
static dt_status status_of(cudaError_t e)
{
    return e == cudaErrorMemoryAllocation ? DT_ENOMEM : DT_EIO;
}

static int cuda_faulted(const dt_backend *be)
{
    return __atomic_load_n(&be->faulted, __ATOMIC_ACQUIRE);
}

static void fault_record(dt_backend *be, dt_status s, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void fault_record(dt_backend *be, dt_status s, const char *fmt, ...)
{
    if (!be->mu_ready || cuda_faulted(be)) return;
    pthread_mutex_lock(&be->fault_mu);
    if (!be->faulted) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(be->fault_msg, sizeof be->fault_msg, fmt, ap);
        va_end(ap);
        be->fault_status = s;
        __atomic_store_n(&be->faulted, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&be->fault_mu);
}

/* call is the call's source text (named up to its '('); fn and line say
 * where it was issued */
static void fault_cuda(dt_backend *be, cudaError_t e, const char *call, const char *fn, int line)
{
    fault_record(be, status_of(e), "cuda: %.*s failed: %s (%s, %s:%d)",
                 (int)strcspn(call, "("), call, cudaGetErrorString(e), fn, __FILE__, line);
}

static inline int cuda_ok(dt_backend *be, cudaError_t e, const char *call, const char *fn,
                          int line)
{
    if (e != cudaSuccess) fault_cuda(be, e, call, fn, line);
    return e == cudaSuccess;
}

static inline int blas_ok(dt_backend *be, cublasStatus_t b, const char *call, const char *fn,
                          int line)
{
    if (b == CUBLAS_STATUS_SUCCESS) return 1;
    fault_record(be, b == CUBLAS_STATUS_ALLOC_FAILED ? DT_ENOMEM : DT_EIO,
                 "cuda: %.*s failed: %s (%s, %s:%d)", (int)strcspn(call, "("), call,
                 cublasGetStatusString(b), fn, __FILE__, line);
    return 0;
}

/* 1 if the CUDA runtime call succeeded, else 0 with the fault recorded */
#define DT_CUDA_OK(be, call) cuda_ok((be), (call), #call, __func__, __LINE__)
/* the same for a cuBLAS call */
#define DT_BLAS_OK(be, call) blas_ok((be), (call), #call, __func__, __LINE__)
/* Right after every <<<>>>: a refused launch (bad configuration, no code for
 * this device, a context already lost) shows only in cudaGetLastError, which
 * also clears it, so the error is recorded here or lost. */
#define DT_LAUNCHED(be) cuda_ok((be), cudaGetLastError(), "kernel launch", __func__, __LINE__)

/* The CUDA runtime keeps the current device per host thread, and a kernel
 * launched onto another device's stream fails (cudaMalloc would allocate on
 * the wrong device).  Entries may be called from threads other than init's
 * (the staging copies, a loader thread), and one thread may drive instances
 * on several devices (init selects its device on the calling thread, so a
 * program that starts contexts on devices 0 and 1 is left on 1), so each
 * entry selects this instance's device whenever the thread's current one
 * differs: device 0 is not a safe default once the thread has selected
 * another. */
static inline void cuda_enter(dt_backend *be)
{
    int cur = -1;
    if (cudaGetDevice(&cur) != cudaSuccess || cur != be->device)
        DT_CUDA_OK(be, cudaSetDevice(be->device));
}

/* ---------------------------------------------------------------------------
 * 3. Device memory pool
 *
 * cudaMalloc and cudaFree are slow (and cudaFree synchronizes the device), so
 * freed blocks are kept for reuse.  Requests round up to size classes: 512
 * bytes, then four steps per power of two (512, 640, 768, 896, 1024, 1280,
 * ...), wasting at most a fifth.  A freed block goes on its class's stack; a
 * map from block address to class finds the class in free().
 *
 * Reuse is safe without waiting: every kernel and copy that touches pool
 * memory is queued on the compute stream, so work queued for a block's next
 * owner runs after all work queued for its last one (stream order).  The one
 * exception is copy_async, which runs on the copy stream: free() therefore
 * makes the compute stream wait for every staging copy issued so far before
 * the block can be handed out again (copy_fence), and a copy into a freshly
 * allocated block waits for the compute stream (section 5).  cudaMalloc
 * memory is aligned to 256 bytes (backend.h asks for 64).
 * ------------------------------------------------------------------------- */

/* Size class of a request and its rounded size; -1 if absurdly large. */
static int pool_class(size_t bytes, size_t *rounded)
{
    if (bytes <= DT_CUDA_MIN_BLOCK) {
        *rounded = DT_CUDA_MIN_BLOCK;
        return 0;
    }
    if (bytes > ((size_t)1 << 60)) return -1;
    int e = 63 - __builtin_clzll((unsigned long long)bytes);   /* 2^e <= bytes */
    size_t base = (size_t)1 << e, step = base >> 2;
    size_t q = (bytes - base + step - 1) / step;               /* 0..4 */
    if (q == 4) {
        e++;
        q = 0;
    }
    *rounded = ((size_t)1 << e) + q * ((size_t)1 << (e - 2));
    return (e - 9) * 4 + (int)q;
}

static size_t live_home(const dt_backend *be, uintptr_t key)
{
    uint64_t h = (uint64_t)key * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 20) & (be->live_cap - 1);
}

/* slot of key, or (size_t)-1 */
static size_t live_find(const dt_backend *be, uintptr_t key)
{
    if (!be->live_cap) return (size_t)-1;
    for (size_t i = live_home(be, key);; i = (i + 1) & (be->live_cap - 1)) {
        if (be->live_key[i] == key) return i;
        if (be->live_key[i] == 0) return (size_t)-1;
    }
}

static void live_put(dt_backend *be, uintptr_t key, uint8_t cls)
{
    size_t i = live_home(be, key);
    while (be->live_key[i]) i = (i + 1) & (be->live_cap - 1);
    be->live_key[i] = key;
    be->live_cls[i] = cls;
    be->live_count++;
}

/* Double the map (load stays <= 1/2).  0 if host memory ran out. */
static int live_grow(dt_backend *be)
{
    size_t cap = be->live_cap ? be->live_cap * 2 : 1024;
    uintptr_t *keys = (uintptr_t *)be->al.malloc_fn(cap * sizeof *keys, be->al.user);
    uint8_t *cls = (uint8_t *)be->al.malloc_fn(cap, be->al.user);
    if (!keys || !cls) {
        if (keys) be->al.free_fn(keys, be->al.user);
        if (cls) be->al.free_fn(cls, be->al.user);
        return 0;
    }
    memset(keys, 0, cap * sizeof *keys);
    uintptr_t *old_keys = be->live_key;
    uint8_t *old_cls = be->live_cls;
    size_t old_cap = be->live_cap;
    be->live_key = keys;
    be->live_cls = cls;
    be->live_cap = cap;
    be->live_count = 0;
    for (size_t i = 0; i < old_cap; i++)
        if (old_keys[i]) live_put(be, old_keys[i], old_cls[i]);
    if (old_keys) be->al.free_fn(old_keys, be->al.user);
    if (old_cls) be->al.free_fn(old_cls, be->al.user);
    return 1;
}

static int live_insert(dt_backend *be, void *p, int cls)
{
    if (2 * (be->live_count + 1) > be->live_cap && !live_grow(be)) return 0;
    live_put(be, (uintptr_t)p, (uint8_t)cls);
    return 1;
}

/* Linear-probing delete by backward shift: later entries of the probe run
 * move up so lookups never stop early at the hole. */
static void live_remove(dt_backend *be, size_t i)
{
    size_t mask = be->live_cap - 1;
    be->live_count--;
    for (;;) {
        be->live_key[i] = 0;
        size_t j = i;
        for (;;) {
            j = (j + 1) & mask;
            if (!be->live_key[j]) return;
            size_t k = live_home(be, be->live_key[j]);
            int stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
            if (!stays) break;
        }
        be->live_key[i] = be->live_key[j];
        be->live_cls[i] = be->live_cls[j];
        i = j;
    }
}

static int freelist_push(dt_backend *be, int cls, void *p)
{
    dt_cuda_freelist *fl = &be->cached[cls];
    if (fl->count == fl->cap) {
        int64_t cap = fl->cap ? fl->cap * 2 : 16;
        void **g = (void **)be->al.realloc_fn(fl->ptrs, (size_t)cap * sizeof *g, be->al.user);
        if (!g) return 0;
        fl->ptrs = g;
        fl->cap = cap;
    }
    fl->ptrs[fl->count++] = p;
    return 1;
}

static void device_release(dt_backend *be, void *p);

/* Give every cached block back to CUDA.  Queued kernels may still use a
 * cached block's last contents only as garbage, but cudaFree must not race
 * them, so both streams drain first. */
static void pool_release_cached(dt_backend *be)
{
    if (be->compute) DT_CUDA_OK(be, cudaStreamSynchronize(be->compute));
    if (be->copy) DT_CUDA_OK(be, cudaStreamSynchronize(be->copy));
    for (int c = 0; c < DT_CUDA_CLASSES; c++) {
        dt_cuda_freelist *fl = &be->cached[c];
        for (int64_t i = 0; i < fl->count; i++) device_release(be, fl->ptrs[i]);
        fl->count = 0;
    }
}

/* ---------------------------------------------------------------------------
 * 3b. Blocks that give memory back (discard, commit)
 *
 * Zero 3 gives back the memory of a parameter outside this rank's shard
 * (backend.h, discard) and asks for it again before a gather writes it
 * (commit).  cudaMalloc memory cannot be given back in part, so a block of
 * a granule or more (the driver's mapping unit, 2 MiB on current GPUs) is
 * made with the virtual memory calls instead: its address range is
 * reserved, and each granule gets a physical allocation of its own mapped
 * there.  discard unmaps and releases the granules wholly inside its range
 * (after both streams drain: nothing queued may still touch them), commit
 * creates and maps them again; the address never changes.  Smaller blocks
 * stay cudaMalloc memory, which discard leaves alone, as it leaves a block's
 * partly covered granules (but takes the pool's padding behind a range that
 * reaches the end of what the holder asked for).  Only the granules that
 * cover what a block's holder asked for are mapped when it is handed out,
 * new or again from the cache.  A discard drains both streams, so on a GPU
 * it stalls the queue: a list of granules to unmap once an event passes
 * would not (not built).  The entry points come through the runtime
 * (cudaGetDriverEntryPointByVersion), so nothing links libcuda; where they
 * are missing or a trial block fails (or DTRAIN_CUDA_VMM=0), every block is
 * cudaMalloc memory and discard gives nothing back.  All under mu.
 * ------------------------------------------------------------------------- */

static int vmm_sym(const char *name, void **fn)
{
    *fn = NULL;
#if CUDART_VERSION >= 12050   /* cudaGetDriverEntryPointByVersion's first release */
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion(name, fn, 12000, cudaEnableDefault, &q) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return q == cudaDriverEntryPointSuccess && *fn;
#else
    (void)name;
    return 0;
#endif
}

/* Granule i of b: a physical allocation, mapped, readable and writable. */
static CUresult vmm_map(dt_backend *be, dt_cuda_vblock *b, size_t i)
{
    CUmemGenericAllocationHandle h = 0;
    CUdeviceptr at = (CUdeviceptr)(b->base + i * be->granule);
    CUresult r = be->vc.create(&h, be->granule, &be->vprop, 0);
    if (r != CUDA_SUCCESS) return r;
    if ((r = be->vc.map(at, be->granule, 0, h, 0)) != CUDA_SUCCESS) {
        (void)be->vc.release(h);
        return r;
    }
    if ((r = be->vc.set_access(at, be->granule, &be->vaccess, 1)) != CUDA_SUCCESS) {
        (void)be->vc.unmap(at, be->granule);
        (void)be->vc.release(h);
        return r;
    }
    b->h[i] = h;
    return CUDA_SUCCESS;
}

/* Granule i of b given back; a granule whose unmap fails stays as it was
 * (still mapped: a later map of it would be refused). */
static CUresult vmm_unmap(dt_backend *be, dt_cuda_vblock *b, size_t i)
{
    if (!b->h[i]) return CUDA_SUCCESS;
    CUresult r = be->vc.unmap((CUdeviceptr)(b->base + i * be->granule), be->granule);
    if (r != CUDA_SUCCESS) return r;
    r = be->vc.release(b->h[i]);
    b->h[i] = 0;
    return r;
}

/* Unmap everything of b and give its range back; the first failure. */
static CUresult vmm_destroy(dt_backend *be, dt_cuda_vblock *b)
{
    size_t n = b->size / be->granule;
    CUresult first = CUDA_SUCCESS;
    for (size_t i = 0; b->h && i < n; i++) {
        CUresult r = vmm_unmap(be, b, i);
        first = first == CUDA_SUCCESS ? r : first;
    }
    CUresult r = first == CUDA_SUCCESS ? be->vc.unreserve((CUdeviceptr)b->base, b->size) : first;
    if (b->h) be->al.free_fn(b->h, be->al.user);   /* a failed unmap: the range is lost */
    return r;
}

static void vmm_fault(dt_backend *be, CUresult r, const char *what)
{
    if (r != CUDA_SUCCESS)
        fault_record(be, DT_EIO, "cuda: %s failed (driver error %d); DTRAIN_CUDA_VMM=0 makes "
                     "every block cudaMalloc memory", what, (int)r);
}

/* A block reserving `reserve` bytes (rounded up to granules), the granules
 * that cover its first `need` bytes mapped (the rest is the pool's padding,
 * mapped only if a commit asks); NULL on any failure, nothing left behind. */
static void *vmm_alloc(dt_backend *be, size_t reserve, size_t need)
{
    if (be->nvblocks == be->vblocks_cap) {
        int64_t cap = be->vblocks_cap ? 2 * be->vblocks_cap : 64;
        void *g = be->al.realloc_fn(be->vblocks, (size_t)cap * sizeof *be->vblocks, be->al.user);
        if (!g) return NULL;
        be->vblocks = (dt_cuda_vblock *)g;
        be->vblocks_cap = cap;
    }
    dt_cuda_vblock b;
    b.size = (reserve + be->granule - 1) / be->granule * be->granule;
    size_t n = b.size / be->granule, mapped = (need + be->granule - 1) / be->granule;
    b.h = (CUmemGenericAllocationHandle *)be->al.malloc_fn(n * sizeof *b.h, be->al.user);
    if (!b.h) return NULL;
    memset(b.h, 0, n * sizeof *b.h);
    CUdeviceptr base = 0;
    if (be->vc.reserve(&base, b.size, be->granule, 0, 0) != CUDA_SUCCESS) {
        be->al.free_fn(b.h, be->al.user);
        return NULL;
    }
    b.base = (uintptr_t)base;
    for (size_t i = 0; i < mapped && i < n; i++)
        if (vmm_map(be, &b, i) != CUDA_SUCCESS) {
            vmm_fault(be, vmm_destroy(be, &b), "giving back a part-made block");
            return NULL;
        }
    b.used = need;
    be->vblocks[be->nvblocks++] = b;
    return (void *)b.base;
}

/* The block holding address p (exact: p is its base), or NULL.  A linear
 * scan: a model's blocks of 2 MiB or more are a few hundred. */
static dt_cuda_vblock *vmm_find(dt_backend *be, const void *p, int exact)
{
    uintptr_t a = (uintptr_t)p;
    for (int64_t i = 0; i < be->nvblocks; i++) {
        dt_cuda_vblock *b = &be->vblocks[i];
        if (exact ? a == b->base : a >= b->base && a < b->base + b->size) return b;
    }
    return NULL;
}

/* Map b's granules that cover [lo, hi) of its range; CUDA_SUCCESS or the
 * first failure. */
static CUresult vmm_fill(dt_backend *be, dt_cuda_vblock *b, uintptr_t lo, uintptr_t hi)
{
    size_t n = b->size / be->granule;
    uintptr_t end = b->base + b->size;
    hi = hi < lo || hi > end ? end : hi;
    size_t i0 = (lo - b->base) / be->granule, i1 = (hi - b->base + be->granule - 1) / be->granule;
    for (size_t i = i0; i < i1 && i < n; i++)
        if (!b->h[i]) {
            CUresult r = vmm_map(be, b, i);
            if (r != CUDA_SUCCESS) return r;
        }
    return CUDA_SUCCESS;
}

static void pool_release_cached(dt_backend *be);

/* Where the calls are there and a trial block of two granules maps,
 * unmaps one and maps it again, blocks of a granule or more are made this
 * way.  The trial records nothing: a failure only leaves vmm off. */
static void vmm_start(dt_backend *be)
{
    const char *off = getenv("DTRAIN_CUDA_VMM");
    if (off && strcmp(off, "0") == 0) return;
    dt_cuda_vmm_calls *c = &be->vc;
    if (!vmm_sym("cuMemCreate", (void **)&c->create) || !vmm_sym("cuMemRelease", (void **)&c->release) ||
        !vmm_sym("cuMemMap", (void **)&c->map) || !vmm_sym("cuMemUnmap", (void **)&c->unmap) ||
        !vmm_sym("cuMemSetAccess", (void **)&c->set_access) ||
        !vmm_sym("cuMemAddressReserve", (void **)&c->reserve) ||
        !vmm_sym("cuMemAddressFree", (void **)&c->unreserve) ||
        !vmm_sym("cuMemGetAllocationGranularity", (void **)&c->granularity))
        return;
    memset(&be->vprop, 0, sizeof be->vprop);
    be->vprop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    be->vprop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    be->vprop.location.id = be->device;
    memset(&be->vaccess, 0, sizeof be->vaccess);
    be->vaccess.location = be->vprop.location;
    be->vaccess.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    size_t g = 0;
    if (c->granularity(&g, &be->vprop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS || g == 0)
        return;
    be->granule = g;
    void *p = vmm_alloc(be, 2 * g, 2 * g);
    dt_cuda_vblock *b = p ? vmm_find(be, p, 1) : NULL;
    if (!b) return;
    int ok = vmm_unmap(be, b, 1) == CUDA_SUCCESS &&
             vmm_fill(be, b, b->base, b->base + b->size) == CUDA_SUCCESS;
    ok = vmm_destroy(be, b) == CUDA_SUCCESS && ok;
    be->nvblocks--;
    be->vmm = ok;
}

/* A block of a granule or more from the virtual memory calls (failing,
 * the cache released, once more), else NULL: cudaMalloc's then. */
static void *vmm_malloc(dt_backend *be, size_t reserve, size_t need)
{
    if (!be->vmm || reserve < be->granule) return NULL;
    void *p = vmm_alloc(be, reserve, need);
    if (!p) {
        pool_release_cached(be);
        p = vmm_alloc(be, reserve, need);
    }
    return p;
}

/* Give a block back, whichever way it was made (both streams drained). */
static void device_release(dt_backend *be, void *p)
{
    dt_cuda_vblock *b = be->nvblocks ? vmm_find(be, p, 1) : NULL;
    if (!b) {
        DT_CUDA_OK(be, cudaFree(p));
        return;
    }
    vmm_fault(be, vmm_destroy(be, b), "giving back device memory");
    *b = be->vblocks[--be->nvblocks];
}

/* A block about to be handed out for `need` bytes: the granules they
 * cover mapped (a cached block may have had them given back; out of
 * memory, the cache released once).  0 if they cannot be. */
static int vmm_ready(dt_backend *be, void *p, size_t need)
{
    dt_cuda_vblock *b = be->nvblocks ? vmm_find(be, p, 1) : NULL;
    if (!b) return 1;
    b->used = need;
    CUresult r = vmm_fill(be, b, b->base, b->base + need);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) {   /* p itself is not in the cache: it stays */
        pool_release_cached(be);
        b = vmm_find(be, p, 1);
        r = b ? vmm_fill(be, b, b->base, b->base + need) : r;
    }
    if (r != CUDA_SUCCESS && r != CUDA_ERROR_OUT_OF_MEMORY) vmm_fault(be, r, "mapping device memory");
    return r == CUDA_SUCCESS;
}

static void cuda_discard(dt_backend *be, void *ptr, size_t bytes)
{
    cuda_enter(be);
    pthread_mutex_lock(&be->mu);
    dt_cuda_vblock *b = be->nvblocks && bytes ? vmm_find(be, ptr, 0) : NULL;
    if (b) {
        /* a range that reaches the end of what the block holds takes the
         * pool's padding behind it too */
        uintptr_t lo = (uintptr_t)ptr, hi = lo + bytes, end = b->base + b->size;
        size_t n = b->size / be->granule, i0 = (lo - b->base + be->granule - 1) / be->granule;
        size_t i1 = hi < lo || hi >= b->base + b->used || hi >= end ? n : (hi - b->base) / be->granule;
        int drained = 0;
        for (size_t i = i0; i < i1 && i < n; i++) {
            if (!b->h[i]) continue;
            if (!drained) {   /* no queued kernel or copy may still touch it */
                DT_CUDA_OK(be, cudaStreamSynchronize(be->compute));
                DT_CUDA_OK(be, cudaStreamSynchronize(be->copy));
                drained = 1;
            }
            vmm_fault(be, vmm_unmap(be, b, i), "giving back device memory");
        }
    }
    pthread_mutex_unlock(&be->mu);
}

static dt_status cuda_commit(dt_backend *be, void *ptr, size_t bytes)
{
    cuda_enter(be);
    pthread_mutex_lock(&be->mu);
    dt_cuda_vblock *b = be->nvblocks && bytes ? vmm_find(be, ptr, 0) : NULL;
    uintptr_t lo = (uintptr_t)ptr, hi = lo + bytes;
    CUresult r = b ? vmm_fill(be, b, lo, hi) : CUDA_SUCCESS;
    if (r == CUDA_ERROR_OUT_OF_MEMORY) {   /* the cache's blocks first */
        pool_release_cached(be);
        b = vmm_find(be, ptr, 0);
        r = b ? vmm_fill(be, b, lo, hi) : CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&be->mu);
    if (r == CUDA_SUCCESS) return DT_OK;
    if (r != CUDA_ERROR_OUT_OF_MEMORY) vmm_fault(be, r, "mapping device memory again");
    return r == CUDA_ERROR_OUT_OF_MEMORY ? DT_ENOMEM : DT_EIO;
}

/* cudaMalloc; when out of memory release the cache and try once more.  Out
 * of memory is the caller's DT_ENOMEM, not a fault; any other failure (a lost
 * context) is.  Blocks of a granule or more come from vmm_malloc where it
 * can. */
static void *device_malloc(dt_backend *be, size_t bytes, size_t need)
{
    void *p = vmm_malloc(be, bytes, need);
    if (p) return p;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();   /* not sticky: clear it */
        pool_release_cached(be);
        e = cudaMalloc(&p, bytes);
    }
    if (e == cudaSuccess) return p;
    (void)cudaGetLastError();
    if (e != cudaErrorMemoryAllocation) fault_cuda(be, e, "cudaMalloc", __func__, __LINE__);
    return NULL;
}

/* Later compute-stream work waits for every staging copy issued so far
 * (caller holds mu).  free() calls it so a block a copy may still read or
 * write cannot be handed to new compute work too early. */
static void copy_fence(dt_backend *be)
{
    if (be->ticket_last <= be->ticket_fenced) return;
    cudaEvent_t last = be->tickets[be->ticket_last % DT_CUDA_TICKETS];
    DT_CUDA_OK(be, cudaStreamWaitEvent(be->compute, last, 0));
    be->ticket_fenced = be->ticket_last;
}

/* bytes of device memory aligned to 256, not zeroed; NULL on failure */
static void *cuda_alloc(dt_backend *be, size_t bytes)
{
    size_t rounded;
    int cls = pool_class(bytes, &rounded);
    if (cls < 0) return NULL;
    cuda_enter(be);
    pthread_mutex_lock(&be->mu);
    dt_cuda_freelist *fl = &be->cached[cls];
    int reused = fl->count > 0;
    void *p = reused ? fl->ptrs[--fl->count] : device_malloc(be, rounded, bytes);
    if (p && ((reused && !vmm_ready(be, p, bytes)) || !live_insert(be, p, cls))) {
        /* what discard gave back cannot be had again, or host memory ran out */
        if (reused)
            fl->count++;                   /* still in the stack's array */
        else
            device_release(be, p);
        p = NULL;
    }
    pthread_mutex_unlock(&be->mu);
    return p;
}

static void cuda_free(dt_backend *be, void *ptr)
{
    if (!ptr) return;
    cuda_enter(be);
    pthread_mutex_lock(&be->mu);
    size_t slot = live_find(be, (uintptr_t)ptr);
    if (slot != (size_t)-1) {
        int cls = be->live_cls[slot];
        live_remove(be, slot);
        copy_fence(be);
        if (!freelist_push(be, cls, ptr)) {   /* no host memory for the cache */
            DT_CUDA_OK(be, cudaStreamSynchronize(be->compute));
            device_release(be, ptr);
        }
    }
    pthread_mutex_unlock(&be->mu);
}

/* The gemm_ex operand scratch: grow-only, so steady-state training never
 * allocates.  The old block goes back to the pool while kernels may still
 * read it; stream order makes that safe (see above).  0 if it cannot grow. */
static int scratch_reserve(dt_backend *be, size_t bytes)
{
    if (bytes <= be->scratch_bytes) return 1;
    void *fresh = cuda_alloc(be, bytes);
    if (!fresh) return 0;
    cuda_free(be, be->scratch);
    be->scratch = fresh;
    be->scratch_bytes = bytes;
    return 1;
}

/* ---------------------------------------------------------------------------
 * 4. Lifetime
 * ------------------------------------------------------------------------- */
static void set_err(char *err, size_t err_len, const char *fmt, ...)
{
    if (!err || !err_len) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_len, fmt, ap);
    va_end(ap);
}

static __global__ void fill_kernel(int64_t n, float v, float *y);

static void cuda_shutdown(dt_backend *be)
{
    if (!be) return;
    cuda_enter(be);
    if (be->compute) (void)cudaStreamSynchronize(be->compute);
    if (be->copy) (void)cudaStreamSynchronize(be->copy);
    if (be->scratch) cuda_free(be, be->scratch);
    pool_release_cached(be);
    for (size_t i = 0; i < be->live_cap; i++)   /* blocks the core did not free */
        if (be->live_key[i]) device_release(be, (void *)be->live_key[i]);
    for (int64_t i = 0; i < be->nvblocks; i++) (void)vmm_destroy(be, &be->vblocks[i]);
    if (be->vblocks) be->al.free_fn(be->vblocks, be->al.user);
    for (int c = 0; c < DT_CUDA_CLASSES; c++)
        if (be->cached[c].ptrs) be->al.free_fn(be->cached[c].ptrs, be->al.user);
    if (be->live_key) be->al.free_fn(be->live_key, be->al.user);
    if (be->live_cls) be->al.free_fn(be->live_cls, be->al.user);
    if (be->red) (void)cudaFree(be->red);
    if (be->blas) (void)cublasDestroy(be->blas);
    for (int i = 0; i < be->ntickets; i++) (void)cudaEventDestroy(be->tickets[i]);
    if (be->fence) (void)cudaEventDestroy(be->fence);
    if (be->copy) (void)cudaStreamDestroy(be->copy);
    if (be->compute) (void)cudaStreamDestroy(be->compute);
    if (be->mu_ready) {
        pthread_mutex_destroy(&be->mu);
        pthread_mutex_destroy(&be->fault_mu);
    }
    be->al.free_fn(be, be->al.user);
}

/* The number of visible devices.  DT_ENOTSUP with DT_CUDA_NO_DEVICE_MSG only
 * when there is nothing to run on: no NVIDIA driver (driver version 0, or
 * the link-time stub library standing in for it), or a driver that sees no
 * device.  Everything else is DT_EIO: a driver too old for this build's
 * runtime, or one that cannot start, means a GPU is there but broken, and a
 * test that reported "skipped: no GPU" would hide it.  cudaGetDeviceCount
 * alone cannot tell the two apart: with no driver installed it answers
 * cudaErrorInsufficientDriver, as it does for an old one. */
static dt_status device_count(int *count, char *err, size_t err_len)
{
    int drv = 0, rt = 0;
    cudaError_t e = cudaDriverGetVersion(&drv);
    if (e == cudaErrorStubLibrary || (e == cudaSuccess && drv == 0)) {
        set_err(err, err_len, DT_CUDA_NO_DEVICE_MSG " (no NVIDIA driver is installed)");
        (void)cudaGetLastError();
        return DT_ENOTSUP;
    }
    if (e != cudaSuccess) {
        set_err(err, err_len, "cuda: cannot read the NVIDIA driver's version (%s)",
                cudaGetErrorString(e));
        (void)cudaGetLastError();
        return DT_EIO;
    }
    e = cudaGetDeviceCount(count);
    (void)cudaGetLastError();
    if (e == cudaErrorNoDevice || (e == cudaSuccess && *count <= 0)) {
        const char *vis = getenv("CUDA_VISIBLE_DEVICES");
        set_err(err, err_len, DT_CUDA_NO_DEVICE_MSG " (NVIDIA driver %d.%d sees none%s%s%s)",
                drv / 1000, drv % 1000 / 10, vis ? "; CUDA_VISIBLE_DEVICES=\"" : "",
                vis ? vis : "", vis ? "\"" : "");
        return DT_ENOTSUP;
    }
    if (e == cudaErrorInsufficientDriver) {
        (void)cudaRuntimeGetVersion(&rt);
        set_err(err, err_len,
                "cuda: the NVIDIA driver (version %d.%d) is older than this build's CUDA "
                "runtime (%d.%d); update the driver",
                drv / 1000, drv % 1000 / 10, rt / 1000, rt % 1000 / 10);
        return DT_EIO;
    }
    if (e != cudaSuccess) {
        set_err(err, err_len, "cuda: cannot start CUDA with NVIDIA driver %d.%d (%s: %s)",
                drv / 1000, drv % 1000 / 10, cudaGetErrorName(e), cudaGetErrorString(e));
        return DT_EIO;
    }
    return DT_OK;
}

/* Is there a usable device `device`?  Selects it. */
static dt_status device_check(int device, char *err, size_t err_len)
{
    int count = 0, major = 0, minor = 0;
    cudaError_t e;
    dt_status s = device_count(&count, err, err_len);
    if (s != DT_OK) return s;
    if (device < 0 || device >= count) {
        set_err(err, err_len, "cuda: device %d does not exist (%d visible: 0..%d)", device, count,
                count - 1);
        return DT_EINVAL;
    }
    if ((e = cudaSetDevice(device)) != cudaSuccess ||
        (e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device)) !=
            cudaSuccess ||
        (e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device)) !=
            cudaSuccess) {
        /* the classic cause: CUDA was started in a parent, then fork()ed */
        set_err(err, err_len, "cuda: cannot select device %d (%s)%s", device, cudaGetErrorString(e),
                e == cudaErrorInitializationError
                    ? "; a process forked after its parent started CUDA cannot use it: start "
                      "GPU contexts after dt_spawn or fork, or launch ranks with dtrun"
                    : "");
        (void)cudaGetLastError();
        return DT_EIO;
    }
    if (major < DT_CUDA_MIN_CC) {
        set_err(err, err_len,
                "cuda: device %d has compute capability %d.%d; this build needs %d.0 or newer",
                device, major, minor, DT_CUDA_MIN_CC);
        return DT_EIO;   /* a GPU is there: not "no device" */
    }
    return DT_OK;
}

/* streams, events, cuBLAS, the reduction scratch */
static dt_status start_device(dt_backend *be, char *err, size_t err_len)
{
    cudaError_t e;
    const char *what = "streams";
    if ((e = cudaStreamCreateWithFlags(&be->compute, cudaStreamNonBlocking)) != cudaSuccess ||
        (e = cudaStreamCreateWithFlags(&be->copy, cudaStreamNonBlocking)) != cudaSuccess)
        goto fail;
    what = "events";
    if ((e = cudaEventCreateWithFlags(&be->fence, cudaEventDisableTiming)) != cudaSuccess)
        goto fail;
    for (; be->ntickets < DT_CUDA_TICKETS; be->ntickets++)
        if ((e = cudaEventCreateWithFlags(&be->tickets[be->ntickets], cudaEventDisableTiming)) !=
            cudaSuccess)
            goto fail;
    what = "reduction scratch";
    if ((e = cudaMalloc(&be->red, (DT_CUDA_RED_SLOTS + 8) * sizeof(double))) != cudaSuccess)
        goto fail;
    /* A first launch shows whether this device can run the kernels built in
     * (sm_80 / sm_90 code, compute_90 PTX). */
    what = "a test kernel";
    fill_kernel<<<1, 32, 0, be->compute>>>(1, 0.0f, (float *)be->red);
    if ((e = cudaGetLastError()) != cudaSuccess || (e = cudaStreamSynchronize(be->compute)) !=
                                                        cudaSuccess) {
        set_err(err, err_len, "cuda: device %d cannot run this build's kernels (%s)", be->device,
                cudaGetErrorString(e));
        (void)cudaGetLastError();
        return DT_EIO;
    }
    return DT_OK;
fail:
    set_err(err, err_len, "cuda: cannot create %s on device %d (%s)", what, be->device,
            cudaGetErrorString(e));
    (void)cudaGetLastError();
    return status_of(e);
}

/* cuBLAS on the compute stream.  f32 GEMMs run CUBLAS_COMPUTE_32F under
 * CUBLAS_DEFAULT_MATH, which never uses TF32: cuBLAS converts f32 inputs to
 * TF32 only under CUBLAS_TF32_TENSOR_OP_MATH or with the compute type
 * CUBLAS_COMPUTE_32F_FAST_TF32 (section 6 asks for the latter for
 * DT_PREC_TF32 only), and NVIDIA_TF32_OVERRIDE can only turn TF32 off.  Not
 * CUBLAS_COMPUTE_32F_PEDANTIC, which also rules out kernels that are exact
 * f32 but faster.  No atomics, so GEMMs are reproducible run to run. */
static dt_status start_blas(dt_backend *be, char *err, size_t err_len)
{
    cublasStatus_t b = cublasCreate(&be->blas);
    if (b != CUBLAS_STATUS_SUCCESS) {
        be->blas = NULL;
        set_err(err, err_len, "cuda: cannot start cuBLAS on device %d (%s)", be->device,
                cublasGetStatusString(b));
        return b == CUBLAS_STATUS_ALLOC_FAILED ? DT_ENOMEM : DT_EIO;
    }
    if ((b = cublasSetStream(be->blas, be->compute)) != CUBLAS_STATUS_SUCCESS ||
        (b = cublasSetMathMode(be->blas, CUBLAS_DEFAULT_MATH)) != CUBLAS_STATUS_SUCCESS ||
        (b = cublasSetAtomicsMode(be->blas, CUBLAS_ATOMICS_NOT_ALLOWED)) !=
            CUBLAS_STATUS_SUCCESS ||
        (b = cublasSetPointerMode(be->blas, CUBLAS_POINTER_MODE_HOST)) != CUBLAS_STATUS_SUCCESS) {
        set_err(err, err_len, "cuda: cannot configure cuBLAS (%s)", cublasGetStatusString(b));
        return DT_EIO;
    }
    return DT_OK;
}

/* ---- Does cuBLAS round f32 operands to TF32 exactly as round_tf32? -------
 * With CUBLAS_COMPUTE_32F_FAST_TF32 on f32 operands the GEMM kernels convert
 * them themselves.  On an H100 with cuBLAS 13 that conversion is round to
 * nearest even, the same bits as round_tf32: random 256^2 to 4096^2 products
 * from raw operands and from operands rounded first were identical in every
 * element, ties included, and truncated operands differed in nearly all.
 * Skipping gemm_ex's packing pass then saves two full reads and writes of
 * the operands (1.3x on a 4096^3 TF32 product).  NVIDIA does not document
 * the conversion, so init checks it on this device: identity times X and X
 * times identity (TF32_PROBE_N^2, so cuBLAS picks tensor-core kernels) must
 * give the same bits from raw X as from X rounded by round_kernel, for X
 * holding values that round every way (ties to even and to odd, just above
 * and below half, subnormals, large).  Otherwise gemm_ex keeps packing. */
#define TF32_PROBE_N 256
static __global__ void round_kernel(int prec, int64_t n, const float *x, float *y);

static void tf32_probe_values(float *x, float *eye)
{
    uint32_t h = 0x9e3779b9u;
    for (int i = 0; i < TF32_PROBE_N * TF32_PROBE_N; i++) {
        h = h * 1664525u + 1013904223u;
        uint32_t exp = 1 + (h >> 8) % 253u, low = (h >> 3) & 0x1fffu;   /* normal, finite */
        if (i % 7 == 0) low = 0x1000u;                    /* a tie: even or odd kept bit */
        if (i % 11 == 0) low = (i & 1) ? 0x0fffu : 0x1001u;
        if (i % 13 == 0) exp = 0;                         /* subnormal */
        uint32_t u = (h & 0x80000000u) | (exp << 23) | (h & 0x7fe000u) | low;
        memcpy(&x[i], &u, sizeof u);
        eye[i] = (i / TF32_PROBE_N == i % TF32_PROBE_N) ? 1.0f : 0.0f;
    }
}

/* c = a b (row-major, n x n) with FAST_TF32 */
static int tf32_probe_gemm(dt_backend *be, const float *a, const float *b, float *c)
{
    const float one = 1.0f, zero = 0.0f;
    const int n = TF32_PROBE_N;
    return cublasGemmEx(be->blas, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, b, CUDA_R_32F, n, a,
                        CUDA_R_32F, n, &zero, c, CUDA_R_32F, n, CUBLAS_COMPUTE_32F_FAST_TF32,
                        CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS;
}

/* sets be->tf32_direct; any failure leaves it 0 (the safe, packing path) */
static void tf32_probe(dt_backend *be)
{
    const size_t n2 = (size_t)TF32_PROBE_N * TF32_PROBE_N, bytes = n2 * sizeof(float);
    float *h = (float *)be->al.malloc_fn(6 * bytes, be->al.user), *d = NULL;
    if (!h) return;
    if (cudaMalloc(&d, 7 * bytes) == cudaSuccess) {
        float *x = d, *r = d + n2, *eye = d + 2 * n2, *c = d + 3 * n2;   /* c: 4 results */
        tf32_probe_values(h, h + n2);
        /* on the compute stream: a plain cudaMemcpy from pageable memory
         * may return before its copy lands, and this stream does not wait
         * for the legacy one */
        int ok = cudaMemcpyAsync(x, h, bytes, cudaMemcpyHostToDevice, be->compute) == cudaSuccess &&
                 cudaMemcpyAsync(eye, h + n2, bytes, cudaMemcpyHostToDevice, be->compute) ==
                     cudaSuccess &&
                 cudaStreamSynchronize(be->compute) == cudaSuccess;
        if (ok) {
            round_kernel<<<grid_for((int64_t)n2, DT_CUDA_THREADS), DT_CUDA_THREADS, 0,
                           be->compute>>>((int)DT_PREC_TF32, (int64_t)n2, x, r);
            ok = cudaGetLastError() == cudaSuccess && tf32_probe_gemm(be, eye, x, c) &&
                 tf32_probe_gemm(be, eye, r, c + n2) && tf32_probe_gemm(be, x, eye, c + 2 * n2) &&
                 tf32_probe_gemm(be, r, eye, c + 3 * n2) &&
                 cudaMemcpyAsync(h + 2 * n2, c, 4 * bytes, cudaMemcpyDeviceToHost, be->compute) ==
                     cudaSuccess &&
                 cudaStreamSynchronize(be->compute) == cudaSuccess;
        }
        be->tf32_direct = ok && !memcmp(h + 2 * n2, h + 3 * n2, bytes) &&
                          !memcmp(h + 4 * n2, h + 5 * n2, bytes);
        (void)cudaFree(d);
    }
    (void)cudaGetLastError();   /* a failed probe is not the instance's fault */
    be->al.free_fn(h, be->al.user);
}

static dt_status cuda_init(const dt_backend_params *p, dt_backend **out, char *err, size_t err_len)
{
    *out = NULL;
    dt_status s = device_check(p->device, err, err_len);
    if (s != DT_OK) return s;
    dt_backend *be = (dt_backend *)p->allocator.malloc_fn(sizeof *be, p->allocator.user);
    if (!be) {
        set_err(err, err_len, "cuda: out of host memory");
        return DT_ENOMEM;
    }
    memset(be, 0, sizeof *be);
    be->al = p->allocator;
    be->device = p->device;
    if (pthread_mutex_init(&be->mu, NULL) != 0) {
        set_err(err, err_len, "cuda: cannot create a mutex");
        s = DT_ENOMEM;
        goto fail;
    }
    if (pthread_mutex_init(&be->fault_mu, NULL) != 0) {
        pthread_mutex_destroy(&be->mu);
        set_err(err, err_len, "cuda: cannot create a mutex");
        s = DT_ENOMEM;
        goto fail;
    }
    be->mu_ready = 1;
    if ((s = start_device(be, err, err_len)) != DT_OK) goto fail;
    if ((s = start_blas(be, err, err_len)) != DT_OK) goto fail;
    tf32_probe(be);
    pthread_mutex_lock(&be->mu);
    vmm_start(be);
    pthread_mutex_unlock(&be->mu);
    *out = be;
    return DT_OK;
fail:
    cuda_shutdown(be);
    return s;
}

/* The first failure underneath since init, or DT_OK; reads the flag only
 * (see "the fault record", section 2). */
static dt_status cuda_fault(dt_backend *be, char *err, size_t err_len)
{
    if (!cuda_faulted(be)) return DT_OK;
    set_err(err, err_len, "%s", be->fault_msg);
    return be->fault_status;
}

/* ---------------------------------------------------------------------------
 * 5. Copies and staging
 *
 * to_device / to_host take pageable host memory the caller may reuse as soon
 * as they return, so they wait for the copy (and for the compute work queued
 * before it, which a copy to the host must see anyway).
 * ------------------------------------------------------------------------- */
static void cuda_to_device(dt_backend *be, void *dst, const void *host_src, size_t bytes)
{
    if (!bytes) return;
    cuda_enter(be);
    DT_CUDA_OK(be, cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, be->compute));
    DT_CUDA_OK(be, cudaStreamSynchronize(be->compute));
}

static void cuda_to_host(dt_backend *be, void *host_dst, const void *src, size_t bytes)
{
    if (!bytes) return;
    cuda_enter(be);
    DT_CUDA_OK(be, cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, be->compute));
    DT_CUDA_OK(be, cudaStreamSynchronize(be->compute));
}

static void cuda_copy(dt_backend *be, void *dst, const void *src, size_t bytes)
{
    if (!bytes || dst == src) return;
    cuda_enter(be);
    DT_CUDA_OK(be, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, be->compute));
}

static void cuda_memset0(dt_backend *be, void *dst, size_t bytes)
{
    if (!bytes) return;
    cuda_enter(be);
    DT_CUDA_OK(be, cudaMemsetAsync(dst, 0, bytes, be->compute));
}

static void cuda_sync(dt_backend *be)
{
    cuda_enter(be);
    DT_CUDA_OK(be, cudaStreamSynchronize(be->compute));
}

/* page-locked host memory, NULL if it cannot be had (the core then uses its
 * allocator); a failure other than running out is a fault, as in
 * device_malloc */
static void *cuda_host_alloc(dt_backend *be, size_t bytes)
{
    void *p = NULL;
    cuda_enter(be);
    cudaError_t e = cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocPortable);
    if (e == cudaSuccess) return p;
    (void)cudaGetLastError();
    if (e != cudaErrorMemoryAllocation) fault_cuda(be, e, "cudaHostAlloc", __func__, __LINE__);
    return NULL;
}

static void cuda_host_free(dt_backend *be, void *ptr)
{
    if (!ptr) return;
    cuda_enter(be);
    DT_CUDA_OK(be, cudaFreeHost(ptr));
}

/* Ticket t's completion is recorded in tickets[t % DT_CUDA_TICKETS].  A later
 * ticket may have re-recorded that event by the time t is waited for; the
 * copy stream runs in order, so waiting for the later copy still covers t. */
static uint64_t cuda_copy_async(dt_backend *be, void *dst, const void *src, size_t bytes, int dir)
{
    if (!bytes) return 0;
    cudaMemcpyKind kind = dir == DT_COPY_D2H ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
    cuda_enter(be);
    pthread_mutex_lock(&be->mu);   /* ticket order == copy-stream order */
    uint64_t t = ++be->ticket_last;
    DT_CUDA_OK(be, cudaEventRecord(be->fence, be->compute));
    DT_CUDA_OK(be, cudaStreamWaitEvent(be->copy, be->fence, 0));
    DT_CUDA_OK(be, cudaMemcpyAsync(dst, src, bytes, kind, be->copy));
    DT_CUDA_OK(be, cudaEventRecord(be->tickets[t % DT_CUDA_TICKETS], be->copy));
    pthread_mutex_unlock(&be->mu);
    return t;
}

/* the event to wait on for ticket t, or NULL if there is nothing to wait for */
static cudaEvent_t ticket_event(dt_backend *be, uint64_t t)
{
    cudaEvent_t ev = NULL;
    pthread_mutex_lock(&be->mu);
    if (t && t <= be->ticket_last) ev = be->tickets[t % DT_CUDA_TICKETS];
    pthread_mutex_unlock(&be->mu);
    return ev;
}

static void cuda_copy_wait(dt_backend *be, uint64_t ticket)
{
    cuda_enter(be);
    cudaEvent_t ev = ticket_event(be, ticket);
    if (ev) DT_CUDA_OK(be, cudaEventSynchronize(ev));
}

static void cuda_copy_join(dt_backend *be, uint64_t ticket)
{
    cuda_enter(be);
    cudaEvent_t ev = ticket_event(be, ticket);
    if (!ev) return;
    DT_CUDA_OK(be, cudaStreamWaitEvent(be->compute, ev, 0));
    pthread_mutex_lock(&be->mu);
    if (ticket > be->ticket_fenced) be->ticket_fenced = ticket;
    pthread_mutex_unlock(&be->mu);
}

/* ---------------------------------------------------------------------------
 * 6. Dense linear algebra (cuBLAS) and mixed precision
 *
 * cuBLAS is column-major; a row-major (R,C) matrix with leading dimension ld
 * is the column-major (C,R) matrix with the same ld.  So row-major
 * C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands
 * and M with N, keep the transpose flags.
 * ------------------------------------------------------------------------- */
typedef struct gemm_args {
    int ta, tb;
    int64_t batch, m, n, k;
    float alpha, beta;
    const float *a, *b;
    float *c;
    int64_t lda, ldb, ldc, sa, sb, sc;
} gemm_args;

/* C (M,N) = beta*C for K == 0 (cpu.c's gemm_scale_c); beta 0 does not read C */
static __global__ void gemm_scale_kernel(int64_t batch, int64_t m, int64_t n, float beta, float *c,
                                         int64_t ldc, int64_t sc)
{
    DT_GRID_LOOP(i, batch * m * n) {
        int64_t j = i % n, t = i / n, r = t % m, b = t / m;
        float *p = c + b * sc + r * ldc + j;
        *p = beta == 0.0f ? 0.0f : beta * *p;
    }
}

/* One cuBLAS call for the whole batch; a and b are G's operands or rounded
 * copies of them (type t, batch strides sa, sb). */
static void blas_run(dt_backend *be, const gemm_args *G, const void *a, int64_t sa, const void *b,
                     int64_t sb, cudaDataType_t t, cublasComputeType_t compute)
{
    cublasOperation_t oa = G->ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t ob = G->tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    if (G->batch == 1)
        DT_BLAS_OK(be, cublasGemmEx_64(be->blas, ob, oa, G->n, G->m, G->k, &G->alpha, b, t,
                                       G->ldb, a, t, G->lda, &G->beta, G->c, CUDA_R_32F, G->ldc,
                                       compute, CUBLAS_GEMM_DEFAULT));
    else
        DT_BLAS_OK(be, cublasGemmStridedBatchedEx_64(
                           be->blas, ob, oa, G->n, G->m, G->k, &G->alpha, b, t, G->ldb, sb, a, t,
                           G->lda, sa, &G->beta, G->c, CUDA_R_32F, G->ldc, G->sc, G->batch,
                           compute, CUBLAS_GEMM_DEFAULT));
}

/* 1 if there is nothing to multiply (done here), 0 if cuBLAS should run */
static int gemm_trivial(dt_backend *be, const gemm_args *G)
{
    if (G->batch <= 0 || G->m <= 0 || G->n <= 0) return 1;
    if (G->k > 0) return 0;
    int64_t total = G->batch * G->m * G->n;
    gemm_scale_kernel<<<grid_for(total, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>(
        G->batch, G->m, G->n, G->beta, G->c, G->ldc, G->sc);
    DT_LAUNCHED(be);
    return 1;
}

static void gemm_f32(dt_backend *be, const gemm_args *G)
{
    if (gemm_trivial(be, G)) return;
    blas_run(be, G, G->a, G->sa, G->b, G->sb, CUDA_R_32F, CUBLAS_COMPUTE_32F);
}

/* batch x [C_i (M,N) = alpha op(A_i) op(B_i) + beta C_i]; stride_b may be 0 */
static void cuda_gemm_batched(dt_backend *be, int64_t batch, int ta, int tb, int64_t m, int64_t n,
                              int64_t k, float alpha, const float *a, int64_t lda,
                              int64_t stride_a, const float *b, int64_t ldb, int64_t stride_b,
                              float beta, float *c, int64_t ldc, int64_t stride_c)
{
    gemm_args G = {ta, tb, batch, m, n, k, alpha, beta, a, b, c, lda, ldb, ldc,
                   stride_a, stride_b, stride_c};
    cuda_enter(be);
    gemm_f32(be, &G);
}

/* C (M,N) = alpha op(A) op(B) + beta C, row-major */
static void cuda_gemm(dt_backend *be, int ta, int tb, int64_t m, int64_t n, int64_t k,
                      float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
                      float beta, float *c, int64_t ldc)
{
    cuda_gemm_batched(be, 1, ta, tb, m, n, k, alpha, a, lda, 0, b, ldb, 0, beta, c, ldc, 0);
}

/* ---- rounding to a precision, kept as f32, bit for bit as cpu.c's -------
 * round_tf32, round_bf16, round_f16: half.h, compiled for the device too */
static __device__ inline float round_to(int prec, float x)
{
    switch (prec) {
    case DT_PREC_TF32: return round_tf32(x);
    case DT_PREC_BF16: return round_bf16(x);
    case DT_PREC_F16: return round_f16(x);
    default: return x;
    }
}

static __global__ void round_kernel(int prec, int64_t n, const float *x, float *y)
{
    DT_GRID_LOOP(i, n) y[i] = round_to(prec, x[i]);
}

/* y (n) = x rounded to prec; y may be x */
static void cuda_round_prec(dt_backend *be, dt_precision prec, int64_t n, const float *x, float *y)
{
    if (n <= 0) return;
    cuda_enter(be);
    if (prec == DT_PREC_F32) {
        if (x != y)
            DT_CUDA_OK(be, cudaMemcpyAsync(y, x, (size_t)n * sizeof(float),
                                           cudaMemcpyDeviceToDevice, be->compute));
        return;
    }
    round_kernel<<<grid_for(n, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>((int)prec, n,
                                                                                    x, y);
    DT_LAUNCHED(be);
}

/* ---- 16-bit storage, bit for bit as cpu.c's (half.h) ------------------- */
static __global__ void to_half_kernel(int prec, int64_t n, const float *x, uint16_t *y)
{
    DT_GRID_LOOP(i, n) y[i] = prec == DT_PREC_BF16 ? f32_to_bf16(x[i]) : f32_to_f16(x[i]);
}

static __global__ void from_half_kernel(int prec, int64_t n, const uint16_t *x, float *y)
{
    DT_GRID_LOOP(i, n) y[i] = prec == DT_PREC_BF16 ? bf16_to_f32(x[i]) : f16_to_f32(x[i]);
}

static void cuda_to_half(dt_backend *be, dt_precision prec, int64_t n, const float *x, uint16_t *y)
{
    if (n <= 0) return;
    cuda_enter(be);
    to_half_kernel<<<grid_for(n, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>((int)prec, n,
                                                                                      x, y);
    DT_LAUNCHED(be);
}

static void cuda_from_half(dt_backend *be, dt_precision prec, int64_t n, const uint16_t *x,
                           float *y)
{
    if (n <= 0) return;
    cuda_enter(be);
    from_half_kernel<<<grid_for(n, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>((int)prec,
                                                                                        n, x, y);
    DT_LAUNCHED(be);
}

/* ---- gemm_ex: operands rounded into scratch, then one cuBLAS call --------
 * Each operand is packed entry after entry (a stride of 0, one shared
 * operand, is packed once) as rows of DT_CUDA_PACK_ALIGN-rounded length: the
 * packed ld, so every row and every batch entry, starts at a multiple of 8
 * elements (16 bytes of bf16 / f16), and B's copy starts 256-byte aligned
 * like A's (the pool's blocks are).  cuBLAS picks its tensor-core kernels
 * only for such aligned pointers, ld and batch strides; the caller's ld and
 * strides are whatever the tensors had (a slice, an odd K), and the gaps
 * between rows are not copied.  BF16 / F16 become __nv_bfloat16 / __half
 * (round to nearest even, out of range to inf) for tensor cores with f32
 * accumulation.  TF32 is rounded to nearest even in f32 and then run with
 * CUBLAS_COMPUTE_32F_FAST_TF32: the tensor cores' own f32->tf32 conversion
 * is not guaranteed to round to nearest even, but values that are already
 * TF32 convert exactly, so the result rounds as the CPU backend's does.
 *
 * gemm_ex cannot fail (void), so when the scratch cannot grow it falls back:
 * first one batch entry at a time (scratch for one entry), then, with no
 * scratch at all, TF32 runs FAST_TF32 on the raw operands (the hardware's
 * rounding) and BF16 / F16 run in plain f32 (more accurate than asked). */

/* one row-major operand as stored: nb entries of (rows, cols) with leading
 * dimension ld, stride elements apart; pld is its packed leading dimension */
typedef struct pack_shape {
    int64_t nb, rows, cols, ld, stride, pld;
} pack_shape;

/* element o of the packed copy = v rounded to prec, stored as f32 (TF32),
 * __nv_bfloat16 or __half */
static __device__ inline void pack_store(int prec, void *dst, int64_t o, float v)
{
    if (prec == DT_PREC_TF32)
        ((float *)dst)[o] = round_tf32(v);
    else if (prec == DT_PREC_BF16)
        ((__nv_bfloat16 *)dst)[o] = __float2bfloat16_rn(v);
    else
        ((__half *)dst)[o] = __float2half_rn(v);
}

/* four of them from one 16-byte load, in one 16- or 8-byte store (o is a
 * multiple of 4 and the packed rows start 16-byte aligned) */
static __device__ inline void pack_store4(int prec, void *dst, int64_t o, float4 v)
{
    if (prec == DT_PREC_TF32) {
        float4 r = make_float4(round_tf32(v.x), round_tf32(v.y), round_tf32(v.z), round_tf32(v.w));
        *(float4 *)((float *)dst + o) = r;
    } else if (prec == DT_PREC_BF16) {
        __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
        uint2 u = make_uint2(*(uint32_t *)&lo, *(uint32_t *)&hi);
        *(uint2 *)((__nv_bfloat16 *)dst + o) = u;
    } else {
        __half2 lo = __floats2half2_rn(v.x, v.y), hi = __floats2half2_rn(v.z, v.w);
        uint2 u = make_uint2(*(uint32_t *)&lo, *(uint32_t *)&hi);
        *(uint2 *)((__half *)dst + o) = u;
    }
}

/* dst (nb, rows, pld) = src (nb, rows, cols) rounded to prec; columns
 * cols..pld-1 are left as they are (cuBLAS never reads them).  Packing is
 * pure bandwidth, on every mixed-precision GEMM: a row per grid row (one
 * 64-bit division a row, none an element), 16-byte loads when vec (the
 * source rows are 16-byte aligned and cols a multiple of 4). */
static __global__ void pack_kernel(int prec, pack_shape S, const float *src, void *dst, int vec)
{
    int64_t nrows = S.nb * S.rows, step = (int64_t)gridDim.x * blockDim.x;
    int64_t first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (int64_t rr = blockIdx.y; rr < nrows; rr += gridDim.y) {
        int64_t b = rr / S.rows, r = rr - b * S.rows;
        const float *row = src + b * S.stride + r * S.ld;
        int64_t o = rr * S.pld;
        if (vec) {
            for (int64_t e4 = first; e4 < S.cols / 4; e4 += step)
                pack_store4(prec, dst, o + 4 * e4, ((const float4 *)row)[e4]);
        } else {
            for (int64_t e = first; e < S.cols; e += step) pack_store(prec, dst, o + e, row[e]);
        }
    }
}

static void pack_operand(dt_backend *be, dt_precision prec, const pack_shape *S, const float *src,
                         void *dst)
{
    int vec = S->cols % 4 == 0 && S->ld % 4 == 0 && (S->nb == 1 || S->stride % 4 == 0) &&
              (uintptr_t)src % 16 == 0;
    int64_t per_row = vec ? S->cols / 4 : S->cols, nrows = S->nb * S->rows;
    unsigned across = grid_for(per_row, DT_CUDA_THREADS);   /* blocks along a row, <= 16 */
    dim3 grid(across < 16 ? across : 16, (unsigned)min64(nrows, 65535));
    pack_kernel<<<grid, DT_CUDA_THREADS, 0, be->compute>>>((int)prec, *S, src, dst, vec);
    DT_LAUNCHED(be);
}

/* Operand (rows, cols, ld, stride) of G, entries to pack, packed ld.  One
 * entry when the batch is 1 or the operand is shared (stride 0). */
static pack_shape pack_shape_of(const gemm_args *G, int64_t rows, int64_t cols, int64_t ld,
                                int64_t stride)
{
    pack_shape S = {(G->batch == 1 || stride == 0) ? 1 : G->batch, rows, cols, ld, stride,
                    (cols + DT_CUDA_PACK_ALIGN - 1) / DT_CUDA_PACK_ALIGN * DT_CUDA_PACK_ALIGN};
    return S;
}

/* Run G at prec through rounded copies in the scratch; 0 (nothing queued) if
 * the scratch cannot be had. */
static int gemm_ex_scratch(dt_backend *be, dt_precision prec, const gemm_args *G)
{
    pack_shape A = G->ta ? pack_shape_of(G, G->k, G->m, G->lda, G->sa)
                         : pack_shape_of(G, G->m, G->k, G->lda, G->sa);
    pack_shape B = G->tb ? pack_shape_of(G, G->n, G->k, G->ldb, G->sb)
                         : pack_shape_of(G, G->k, G->n, G->ldb, G->sb);
    int64_t ea = A.rows * A.pld, eb = B.rows * B.pld;   /* packed entry sizes */
    size_t es = prec == DT_PREC_TF32 ? sizeof(float) : sizeof(__half);
    size_t a_bytes = ((size_t)(A.nb * ea) * es + 255) & ~(size_t)255;
    if (!scratch_reserve(be, a_bytes + (size_t)(B.nb * eb) * es)) return 0;
    void *pa = be->scratch, *pb = (char *)be->scratch + a_bytes;
    pack_operand(be, prec, &A, G->a, pa);
    pack_operand(be, prec, &B, G->b, pb);
    gemm_args P = *G;   /* the packed operands' leading dimensions */
    P.lda = A.pld;
    P.ldb = B.pld;
    int64_t psa = A.nb > 1 ? ea : 0, psb = B.nb > 1 ? eb : 0;
    if (prec == DT_PREC_TF32)
        blas_run(be, &P, pa, psa, pb, psb, CUDA_R_32F, CUBLAS_COMPUTE_32F_FAST_TF32);
    else
        blas_run(be, &P, pa, psa, pb, psb, prec == DT_PREC_BF16 ? CUDA_R_16BF : CUDA_R_16F,
                 CUBLAS_COMPUTE_32F);
    return 1;
}

/* no scratch at all: the nearest thing cuBLAS does without copies */
static void gemm_ex_direct(dt_backend *be, dt_precision prec, const gemm_args *G)
{
    if (prec == DT_PREC_TF32)
        blas_run(be, G, G->a, G->sa, G->b, G->sb, CUDA_R_32F, CUBLAS_COMPUTE_32F_FAST_TF32);
    else
        blas_run(be, G, G->a, G->sa, G->b, G->sb, CUDA_R_32F, CUBLAS_COMPUTE_32F);
}

/* TF32 straight from the f32 operands (tf32_probe): only where this device
 * rounds as round_tf32, and only where cuBLAS surely runs tensor-core
 * kernels, which read the operands as TF32: 16-byte aligned operands,
 * leading dimensions and batch strides, and every dimension at least
 * DT_CUDA_TF32_DIRECT_MIN (a skinny product may get a plain f32 kernel,
 * which would not round).  Smaller products gain little from skipping the
 * pack anyway. */
static int tf32_direct_ok(const dt_backend *be, const gemm_args *G)
{
    const int64_t q = 4;   /* floats in 16 bytes */
    return be->tf32_direct && G->m >= DT_CUDA_TF32_DIRECT_MIN && G->n >= DT_CUDA_TF32_DIRECT_MIN &&
           G->k >= DT_CUDA_TF32_DIRECT_MIN && (uintptr_t)G->a % 16 == 0 &&
           (uintptr_t)G->b % 16 == 0 && (uintptr_t)G->c % 16 == 0 && G->lda % q == 0 &&
           G->ldb % q == 0 && G->ldc % q == 0 &&
           (G->batch == 1 || (G->sa % q == 0 && G->sb % q == 0 && G->sc % q == 0));
}

/* gemm_batched with A and B rounded to prec, products summed in f32 */
static void cuda_gemm_ex(dt_backend *be, dt_precision prec, int64_t batch, int ta, int tb,
                         int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                         int64_t lda, int64_t stride_a, const float *b, int64_t ldb,
                         int64_t stride_b, float beta, float *c, int64_t ldc, int64_t stride_c)
{
    gemm_args G = {ta, tb, batch, m, n, k, alpha, beta, a, b, c, lda, ldb, ldc,
                   stride_a, stride_b, stride_c};
    cuda_enter(be);
    if (prec != DT_PREC_TF32 && prec != DT_PREC_BF16 && prec != DT_PREC_F16) {
        gemm_f32(be, &G);
        return;
    }
    if (gemm_trivial(be, &G)) return;
    if (prec == DT_PREC_TF32 && tf32_direct_ok(be, &G)) {
        blas_run(be, &G, a, stride_a, b, stride_b, CUDA_R_32F, CUBLAS_COMPUTE_32F_FAST_TF32);
        return;
    }
    if (gemm_ex_scratch(be, prec, &G)) return;
    gemm_args one = G;   /* too little memory for the batch: one entry at a time */
    one.batch = 1;
    for (int64_t i = 0; i < batch; i++) {
        one.a = a + i * stride_a;
        one.b = b + i * stride_b;
        one.c = c + i * stride_c;
        if (!gemm_ex_scratch(be, prec, &one)) gemm_ex_direct(be, prec, &one);
    }
}

/* ---------------------------------------------------------------------------
 * 7. Elementwise
 * ------------------------------------------------------------------------- */
static __global__ void fill_kernel(int64_t n, float v, float *y)
{
    DT_GRID_LOOP(i, n) y[i] = v;
}

/* y (n) = value */
static void cuda_fill(dt_backend *be, int64_t n, float value, float *y)
{
    if (n <= 0) return;
    cuda_enter(be);
    fill_kernel<<<grid_for(n, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>(n, value, y);
    DT_LAUNCHED(be);
}

/* y (n) = alpha x + beta y; beta == 0 does not read y (it may hold NaN) */
static __global__ void axpby_kernel(int64_t n, float a, const float *x, float b, float *y)
{
    DT_GRID_LOOP(i, n) {
        if (b == 0.0f)
            y[i] = a * x[i];
        else if (b == 1.0f)
            y[i] = a * x[i] + y[i];
        else
            y[i] = a * x[i] + b * y[i];
    }
}

static void cuda_axpby(dt_backend *be, int64_t n, float alpha, const float *x, float beta, float *y)
{
    if (n <= 0) return;
    cuda_enter(be);
    axpby_kernel<<<grid_for(n, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>(n, alpha, x,
                                                                                    beta, y);
    DT_LAUNCHED(be);
}

#define DT_INV_SQRT_2PI 0.39894228040143267794f

/* exact gelu x Phi(x) = 0.5 x (1 + erf(x / sqrt 2)); normcdff computes Phi
 * from erfc, accurate in the negative tail where 1 + erf cancels (as cpu.c) */
static __device__ inline float gelu_f(float x) { return x * normcdff(x); }
static __device__ inline float gelu_grad(float x)
{
    return normcdff(x) + x * DT_INV_SQRT_2PI * expf(-0.5f * x * x);
}
static __device__ inline float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

/* GPT-2's tanh form of gelu, and its derivative (as cpu.c) */
#define DT_GELU_K 0.7978845608028654f   /* sqrt(2/pi) */
static __device__ inline float gelu_tanh_f(float x)
{
    return 0.5f * x * (1.0f + tanhf(DT_GELU_K * (x + 0.044715f * x * x * x)));
}
static __device__ inline float gelu_tanh_grad(float x)
{
    float t = tanhf(DT_GELU_K * (x + 0.044715f * x * x * x));
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * DT_GELU_K * (1.0f + 0.134145f * x * x);
}

static __device__ inline float unary_f(int op, float x)
{
    switch (op) {
    case DT_UNARY_RELU: return x < 0.0f ? 0.0f : x;   /* NaN propagates, as torch.relu */
    case DT_UNARY_GELU: return gelu_f(x);
    case DT_UNARY_TANH: return tanhf(x);
    case DT_UNARY_GELU_TANH: return gelu_tanh_f(x);
    case DT_UNARY_EXP: return expf(x);
    case DT_UNARY_LOG: return logf(x);
    case DT_UNARY_SQRT: return sqrtf(x);
    default: return sigmoid_f(x);
    }
}

/* dy * op'(x), from y = op(x) where that is cheaper */
static __device__ inline float unary_grad(int op, float x, float y, float dy)
{
    switch (op) {
    case DT_UNARY_RELU: return y > 0.0f ? dy : 0.0f;
    case DT_UNARY_GELU: return dy * gelu_grad(x);
    case DT_UNARY_TANH: return dy * (1.0f - y * y);
    case DT_UNARY_GELU_TANH: return dy * gelu_tanh_grad(x);
    case DT_UNARY_EXP: return dy * y;
    case DT_UNARY_LOG: return dy / x;
    case DT_UNARY_SQRT: return dy * 0.5f / y;
    default: return dy * y * (1.0f - y);
    }
}

/* y (n) = op(x); y may be x */
static __global__ void unary_kernel(int op, int64_t n, const float *x, float *y)
{
    DT_GRID_LOOP(i, n) y[i] = unary_f(op, x[i]);
}

static void cuda_unary(dt_backend *be, dt_unary_op op, int64_t n, const float *x, float *y)
{
    if (n <= 0) return;
    cuda_enter(be);
    unary_kernel<<<grid_for(n, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>((int)op, n, x,
                                                                                    y);
    DT_LAUNCHED(be);
}

/* dx (n) (+)= dy * op'(x) */
static __global__ void unary_bwd_kernel(int op, int64_t n, const float *x, const float *y,
                                        const float *dy, float *dx, int acc)
{
    DT_GRID_LOOP(i, n) {
        float g = unary_grad(op, x ? x[i] : 0.0f, y ? y[i] : 0.0f, dy[i]);
        dx[i] = acc ? dx[i] + g : g;
    }
}

static void cuda_unary_backward(dt_backend *be, dt_unary_op op, int64_t n, const float *x,
                                const float *y, const float *dy, float *dx, int accumulate)
{
    if (n <= 0) return;
    cuda_enter(be);
    unary_bwd_kernel<<<grid_for(n, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>(
        (int)op, n, x, y, dy, dx, accumulate);
    DT_LAUNCHED(be);
}

/* ---------------------------------------------------------------------------
 * 8. Strided index spaces: binary, copy_strided
 *
 * An index space is coalesced on the host as cpu.c does (size-1 dims dropped,
 * neighbours merged where both operands walk them as one dim) and passed by
 * value; each thread turns its flat index into the two operand offsets.
 * ------------------------------------------------------------------------- */
typedef struct dt_cuda_dims {
    int nd;
    int64_t shape[DT_MAX_DIMS];
    int64_t st[2][DT_MAX_DIMS];
} dt_cuda_dims;

/* Offsets of the lin-th point (row-major) in both operands.  The loop is
 * unrolled so the struct stays in the kernel's parameter space. */
static __device__ __forceinline__ void dims_offsets(const dt_cuda_dims &D, int64_t lin,
                                                    int64_t *o0, int64_t *o1)
{
    int64_t a = 0, b = 0;
#pragma unroll
    for (int d = DT_MAX_DIMS - 1; d >= 0; d--) {
        if (d >= D.nd) continue;
        int64_t i = lin;
        if (d > 0) { /* the outermost dim takes what is left, no division */
            i = lin % D.shape[d];
            lin /= D.shape[d];
        }
        a += i * D.st[0][d];
        b += i * D.st[1][d];
    }
    *o0 = a;
    *o1 = b;
}

static dt_cuda_dims dims_make(int ndim, const int64_t *shape, const int64_t *s0, const int64_t *s1)
{
    dt_cuda_dims D;
    memset(&D, 0, sizeof D);
    D.nd = coalesce2(ndim, shape, s0, s1, D.shape, D.st[0], D.st[1]);
    return D;
}

/* ---- binary: out = a op b ------------------------------------------------ */
static __device__ inline float bin_f(int op, float u, float v)
{
    switch (op) {
    case DT_BIN_ADD: return u + v;
    case DT_BIN_SUB: return u - v;
    case DT_BIN_MUL: return u * v;
    case DT_BIN_KEEP: return v != 0.0f ? u : 0.0f;
    case DT_BIN_DROP: return v != 0.0f ? 0.0f : u;
    case DT_BIN_POW: return powf(u, v);
    default: return u / v;
    }
}

/* out (n, contiguous) = a[ia] op b[ib] over the space D (st[0] a, st[1] b) */
static __global__ void binary_kernel(int op, int64_t n, dt_cuda_dims D, const float *a,
                                     const float *b, float *out)
{
    DT_GRID_LOOP(i, n) {
        int64_t ia, ib;
        dims_offsets(D, i, &ia, &ib);
        out[i] = bin_f(op, a[ia], b[ib]);
    }
}

/* one run: out[i] = a[i*sa] op b[i*sb] (contiguous and scalar broadcasts) */
static __global__ void binary_flat_kernel(int op, int64_t n, const float *a, int64_t sa,
                                          const float *b, int64_t sb, float *out)
{
    DT_GRID_LOOP(i, n) out[i] = bin_f(op, a[i * sa], b[i * sb]);
}

static void cuda_binary(dt_backend *be, dt_binary_op op, int ndim, const int64_t *shape,
                        const float *a, const int64_t *a_strides, const float *b,
                        const int64_t *b_strides, float *out)
{
    int64_t n = shape_numel(ndim, shape);
    if (n <= 0) return;
    cuda_enter(be);
    dt_cuda_dims D = dims_make(ndim, shape, a_strides, b_strides);
    unsigned grid = grid_for(n, DT_CUDA_THREADS);
    if (D.nd == 1)
        binary_flat_kernel<<<grid, DT_CUDA_THREADS, 0, be->compute>>>(
            (int)op, n, a, D.st[0][0], b, D.st[1][0], out);
    else
        binary_kernel<<<grid, DT_CUDA_THREADS, 0, be->compute>>>((int)op, n, D, a, b, out);
    DT_LAUNCHED(be);
}

/* ---- copy_strided: dst[..] (+)= src[..] (st[0] dst, st[1] src) ---------- */
/* elements of es bytes; the switch is uniform across the grid */
static __global__ void copy_kernel(int64_t n, dt_cuda_dims D, int64_t es, void *dst,
                                   const void *src)
{
    DT_GRID_LOOP(i, n) {
        int64_t id, is;
        dims_offsets(D, i, &id, &is);
        switch (es) {
        case 1: ((uint8_t *)dst)[id] = ((const uint8_t *)src)[is]; break;
        case 2: ((uint16_t *)dst)[id] = ((const uint16_t *)src)[is]; break;
        case 4: ((uint32_t *)dst)[id] = ((const uint32_t *)src)[is]; break;
        case 8: ((uint64_t *)dst)[id] = ((const uint64_t *)src)[is]; break;
        default:
            for (int64_t k = 0; k < es; k++)
                ((char *)dst)[id * es + k] = ((const char *)src)[is * es + k];
            break;
        }
    }
}

static __global__ void copy_acc_kernel(int64_t n, dt_cuda_dims D, float *dst, const float *src)
{
    DT_GRID_LOOP(i, n) {
        int64_t id, is;
        dims_offsets(D, i, &id, &is);
        dst[id] += src[is];
    }
}

static void cuda_copy_strided(dt_backend *be, int ndim, const int64_t *shape, size_t elem_bytes,
                              void *dst, const int64_t *dst_strides, const void *src,
                              const int64_t *src_strides, int accumulate)
{
    int64_t n = shape_numel(ndim, shape);
    if (n <= 0) return;
    cuda_enter(be);
    dt_cuda_dims D = dims_make(ndim, shape, dst_strides, src_strides);
    unsigned grid = grid_for(n, DT_CUDA_THREADS);
    cudaStream_t s = be->compute;
    if (accumulate) { /* f32 only */
        copy_acc_kernel<<<grid, DT_CUDA_THREADS, 0, s>>>(n, D, (float *)dst, (const float *)src);
        DT_LAUNCHED(be);
        return;
    }
    if (D.nd == 1 && D.st[0][0] == 1 && D.st[1][0] == 1) {
        DT_CUDA_OK(be,
                   cudaMemcpyAsync(dst, src, (size_t)n * elem_bytes, cudaMemcpyDeviceToDevice, s));
        return;
    }
    copy_kernel<<<grid, DT_CUDA_THREADS, 0, s>>>(n, D, (int64_t)elem_bytes, dst, src);
    DT_LAUNCHED(be);
}

/* ---------------------------------------------------------------------------
 * 9. Deterministic sums: sum, sumsq, sum_to, reduce_axis, bias_grad
 *
 * A reduction is a set K of kept points (outputs) and a set R of reduced
 * points summed into each, both strided index spaces over the contiguous
 * source.  All sums are in double.  Two shapes of work, chosen from the sizes
 * alone, so the same problem always sums in the same order:
 *  - thread mode (many outputs, short sums): one thread per output adds R in
 *    row-major order;
 *  - parts mode (few outputs, long sums): each output's R is cut into
 *    `nparts` fixed contiguous parts, one block each (threads stride through
 *    the part, then a fixed tree); a second kernel adds each output's parts
 *    with a fixed tree.  Partials live in the instance's `red` scratch.
 * ------------------------------------------------------------------------- */
static __device__ inline void store_acc(float *d, double v, int acc)
{
    *d = acc ? *d + (float)v : (float)v;
}

/* K: st[0] source, st[1] destination; R: st[0] source */
static __global__ void sum_thread_kernel(int64_t nk, dt_cuda_dims K, int64_t nr, dt_cuda_dims R,
                                         const float *src, float *dst, int acc)
{
    DT_GRID_LOOP(o, nk) {
        int64_t base, doff;
        dims_offsets(K, o, &base, &doff);
        int64_t idx[DT_MAX_DIMS] = {0}, off = 0;
        double s = 0.0;
        for (int64_t r = 0; r < nr; r++) {
            s += (double)src[base + off];
#pragma unroll
            for (int d = DT_MAX_DIMS - 1; d >= 0; d--) { /* odometer over R */
                if (d >= R.nd) continue;
                off += R.st[0][d];
                if (++idx[d] < R.shape[d]) break;
                off -= R.st[0][d] * R.shape[d];
                idx[d] = 0;
            }
        }
        store_acc(dst + doff, s, acc);
    }
}

/* grid (nparts, nk): part p of output o's R -> part[o*nparts + p] */
static __global__ void sum_parts_kernel(dt_cuda_dims K, int64_t nr, dt_cuda_dims R, int nparts,
                                        int sq, const float *src, double *part)
{
    __shared__ double sh[32];
    int64_t o = blockIdx.y, p = blockIdx.x, base, unused;
    dims_offsets(K, o, &base, &unused);
    int64_t lo = part_start(nr, nparts, p), hi = part_start(nr, nparts, p + 1);
    double s = 0.0;
    for (int64_t r = lo + threadIdx.x; r < hi; r += blockDim.x) {
        int64_t off, u;
        dims_offsets(R, r, &off, &u);
        double v = (double)src[base + off];
        s += sq ? v * v : v;
    }
    s = block_sum(s, sh);
    if (threadIdx.x == 0) part[o * nparts + p] = s;
}

/* per output o: t = (sum of its parts) / div; dst[o] (+)= t and/or *dout = t */
static __global__ void sum_finish_kernel(int64_t nk, dt_cuda_dims K, int nparts,
                                         const double *part, double div, float *dst, int acc,
                                         double *dout)
{
    __shared__ double sh[32];
    for (int64_t o = blockIdx.x; o < nk; o += gridDim.x) {
        double s = 0.0;
        for (int q = threadIdx.x; q < nparts; q += blockDim.x) s += part[o * nparts + q];
        s = block_sum(s, sh);
        if (threadIdx.x == 0) {
            double t = s / div;
            if (dout) *dout = t;
            if (dst) {
                int64_t u, doff;
                dims_offsets(K, o, &u, &doff);
                store_acc(dst + doff, t, acc);
            }
        }
    }
}

/* parts per output for parts mode, or 0 for thread mode */
static int sum_parts_for(int64_t nk, int64_t nr)
{
    if (nk > DT_CUDA_RED_SLOTS / 2 || nr < DT_CUDA_THREADS) return 0;
    if (nk >= 1024 && nr < 2 * DT_CUDA_RED_CHUNK) return 0;   /* enough outputs to fill the GPU */
    int64_t np = (nr + DT_CUDA_RED_CHUNK - 1) / DT_CUDA_RED_CHUNK;
    np = min64(np, min64(DT_CUDA_RED_SLOTS / nk, DT_CUDA_RED_PARTS));
    return (int)max64(1, np);
}

static void sum_parts_run(dt_backend *be, const dt_cuda_dims *K, int64_t nk, const dt_cuda_dims *R,
                          int64_t nr, int np, int sq, const float *src, double div, float *dst,
                          int acc, double *dout)
{
    dim3 grid((unsigned)np, (unsigned)nk);
    sum_parts_kernel<<<grid, DT_CUDA_THREADS, 0, be->compute>>>(*K, nr, *R, np, sq, src, be->red);
    DT_LAUNCHED(be);
    sum_finish_kernel<<<grid_for(nk, 1), DT_CUDA_THREADS, 0, be->compute>>>(
        nk, *K, np, be->red, div, dst, acc, dout);
    DT_LAUNCHED(be);
}

/* src (shape, contiguous) summed into dst[dst_strides], 0 strides reduced */
static void sum_to_impl(dt_backend *be, int ndim, const int64_t *shape, const float *src,
                        float *dst, const int64_t *dst_strides, int acc)
{
    int64_t sst[DT_MAX_DIMS], shp[DT_MAX_DIMS], s0[DT_MAX_DIMS], s1[DT_MAX_DIMS];
    contiguous_strides(ndim, shape, sst);
    int nd = coalesce2(ndim, shape, sst, dst_strides, shp, s0, s1);
    dt_cuda_dims K, R;
    memset(&K, 0, sizeof K);
    memset(&R, 0, sizeof R);
    for (int d = 0; d < nd; d++) {
        dt_cuda_dims *D = s1[d] != 0 ? &K : &R;
        D->shape[D->nd] = shp[d];
        D->st[0][D->nd] = s0[d];
        D->st[1][D->nd] = s1[d];
        D->nd++;
    }
    int64_t nk = shape_numel(K.nd, K.shape), nr = shape_numel(R.nd, R.shape);
    if (nk <= 0 || (nr <= 0 && acc)) return;   /* nothing to write, or += 0 */
    int np = nr > 0 ? sum_parts_for(nk, nr) : 0;
    if (np > 0) {
        sum_parts_run(be, &K, nk, &R, nr, np, 0, src, 1.0, dst, acc, NULL);
        return;
    }
    sum_thread_kernel<<<grid_for(nk, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>(
        nk, K, nr, R, src, dst, acc);
    DT_LAUNCHED(be);
}

static void cuda_sum_to(dt_backend *be, int ndim, const int64_t *shape, const float *src,
                        float *dst, const int64_t *dst_strides, int accumulate)
{
    cuda_enter(be);
    sum_to_impl(be, ndim, shape, src, dst, dst_strides, accumulate);
}

/* dbias (C) (+)= sum over N and inner of dy (N, C, inner) */
static void cuda_bias_grad(dt_backend *be, int64_t n, int64_t c, int64_t inner, const float *dy,
                           float *dbias, int accumulate)
{
    int64_t shape[3] = {n, c, inner}, st[3] = {0, 1, 0};
    cuda_enter(be);
    sum_to_impl(be, 3, shape, dy, dbias, st, accumulate);
}

/* *y (device scalar) = sum of x (n) */
static void cuda_sum(dt_backend *be, int64_t n, const float *x, float *y)
{
    int64_t shape[1] = {n}, st[1] = {0};
    cuda_enter(be);
    sum_to_impl(be, 1, shape, x, y, st, 0);
}

/* Sum of squares of x (n), to the host (waits).  NaN once the instance has a
 * fault (an earlier one, or one in this call: the launches record theirs, the
 * sync surfaces the kernels'), so gradient clipping and the fp16 loss scaler
 * see an overflow rather than a clean 0. */
static double cuda_sumsq(dt_backend *be, int64_t n, const float *x)
{
    if (cuda_faulted(be)) return NAN;
    if (n <= 0) return 0.0;
    cuda_enter(be);
    dt_cuda_dims K, R;
    memset(&K, 0, sizeof K);
    memset(&R, 0, sizeof R);
    R.nd = 1;
    R.shape[0] = n;
    R.st[0][0] = 1;
    int64_t np = min64((n + DT_CUDA_RED_CHUNK - 1) / DT_CUDA_RED_CHUNK, DT_CUDA_RED_PARTS);
    sum_parts_run(be, &K, 1, &R, n, (int)np, 1, x, 1.0, NULL, 0, red_result(be));
    double s = 0.0;
    DT_CUDA_OK(be, cudaMemcpyAsync(&s, red_result(be), sizeof s, cudaMemcpyDeviceToHost,
                                   be->compute));
    DT_CUDA_OK(be, cudaStreamSynchronize(be->compute));
    return cuda_faulted(be) ? NAN : s;
}

/* y (outer, inner) = max over len of x (outer, len, inner); -inf if len 0 */
static __global__ void rmax_kernel(int64_t outer, int64_t len, int64_t inner, const float *x,
                                   float *y)
{
    DT_GRID_LOOP(i, outer * inner) {
        int64_t o = i / inner, j = i - o * inner;
        const float *p = x + o * len * inner + j;
        float m = len > 0 ? p[0] : -INFINITY;
        for (int64_t l = 1; l < len; l++) m = max_nan(m, p[l * inner]);
        y[i] = m;
    }
}

static void cuda_reduce_axis(dt_backend *be, dt_axis_op op, int64_t outer, int64_t len,
                             int64_t inner, const float *x, float *y)
{
    cuda_enter(be);
    if (op == DT_RED_SUM) {
        int64_t shape[3] = {outer, len, inner}, st[3] = {inner, 0, 1};
        sum_to_impl(be, 3, shape, x, y, st, 0);
        return;
    }
    if (outer * inner <= 0) return;
    rmax_kernel<<<grid_for(outer * inner, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>(
        outer, len, inner, x, y);
    DT_LAUNCHED(be);
}

/* ---------------------------------------------------------------------------
 * 10. Softmax and cross entropy
 *
 * Rows (inner == 1) run a thread group per row (section 1); other axes run a
 * thread per (outer, inner) column walking len with stride inner, which keeps
 * neighbouring threads on neighbouring addresses.
 * ------------------------------------------------------------------------- */

/* x, y (rows, len): softmax or log_softmax of each row */
static __global__ void softmax_rows_kernel(int g, int64_t rows, int64_t len, const float *x,
                                           float *y, int is_log)
{
    __shared__ double shd[32];
    __shared__ float shf[32];
    const int rpb = DT_CUDA_THREADS / g, lane = threadIdx.x % g;
    for (int64_t r = (int64_t)blockIdx.x * rpb + threadIdx.x / g; r < rows;
         r += (int64_t)gridDim.x * rpb) {
        const float *xr = x + r * len;
        float *yr = y + r * len, m = -INFINITY;
        for (int64_t j = lane; j < len; j += g) m = max_nan(m, xr[j]);
        m = group_max(m, shf, g);
        double s = 0.0;
        for (int64_t j = lane; j < len; j += g) {
            float e = expf(xr[j] - m);
            if (!is_log) yr[j] = e;
            s += (double)e;
        }
        s = group_sum(s, shd, g);
        if (is_log) {
            float shift = m + (float)log(s);
            for (int64_t j = lane; j < len; j += g) yr[j] = xr[j] - shift;
        } else {
            float inv = (float)(1.0 / s);
            for (int64_t j = lane; j < len; j += g) yr[j] *= inv;   /* this thread's own */
        }
    }
}

/* x, y (outer, len, inner), inner > 1: one thread per column */
static __global__ void softmax_cols_kernel(int64_t outer, int64_t len, int64_t inner,
                                           const float *x, float *y, int is_log)
{
    DT_GRID_LOOP(c, outer * inner) {
        int64_t o = c / inner, base = o * len * inner + (c - o * inner);
        const float *xc = x + base;
        float *yc = y + base, m = xc[0];
        for (int64_t l = 1; l < len; l++) m = max_nan(m, xc[l * inner]);
        double s = 0.0;
        for (int64_t l = 0; l < len; l++) {
            float e = expf(xc[l * inner] - m);
            if (!is_log) yc[l * inner] = e;
            s += (double)e;
        }
        if (is_log) {
            float shift = m + (float)log(s);
            for (int64_t l = 0; l < len; l++) yc[l * inner] = xc[l * inner] - shift;
        } else {
            float inv = (float)(1.0 / s);
            for (int64_t l = 0; l < len; l++) yc[l * inner] *= inv;
        }
    }
}

static void cuda_softmax(dt_backend *be, int64_t outer, int64_t len, int64_t inner, const float *x,
                         float *y, int is_log)
{
    if (outer <= 0 || len <= 0 || inner <= 0) return;
    cuda_enter(be);
    cudaStream_t s = be->compute;
    int g = row_group(len);
    if (inner > 1)
        softmax_cols_kernel<<<grid_for(outer * inner, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, s>>>(
            outer, len, inner, x, y, is_log);
    else
        softmax_rows_kernel<<<grid_rows(outer, g), DT_CUDA_THREADS, 0, s>>>(g, outer, len, x, y,
                                                                           is_log);
    DT_LAUNCHED(be);
}

/* softmax: dx = y (dy - <dy, y>);  log_softmax: dx = dy - exp(y) sum(dy) */
static __device__ inline float softmax_grad(int is_log, float y, float dy, float d)
{
    return is_log ? dy - expf(y) * d : y * (dy - d);
}

static __global__ void softmax_bwd_rows_kernel(int g, int64_t rows, int64_t len, const float *y,
                                               const float *dy, float *dx, int is_log, int acc)
{
    __shared__ double shd[32];
    const int rpb = DT_CUDA_THREADS / g, lane = threadIdx.x % g;
    for (int64_t r = (int64_t)blockIdx.x * rpb + threadIdx.x / g; r < rows;
         r += (int64_t)gridDim.x * rpb) {
        const float *yr = y + r * len, *gr = dy + r * len;
        float *dr = dx + r * len;
        double dot = 0.0;
        for (int64_t j = lane; j < len; j += g)
            dot += is_log ? (double)gr[j] : (double)gr[j] * (double)yr[j];
        float d = (float)group_sum(dot, shd, g);
        for (int64_t j = lane; j < len; j += g) {
            float v = softmax_grad(is_log, yr[j], gr[j], d);
            dr[j] = acc ? dr[j] + v : v;
        }
    }
}

static __global__ void softmax_bwd_cols_kernel(int64_t outer, int64_t len, int64_t inner,
                                               const float *y, const float *dy, float *dx,
                                               int is_log, int acc)
{
    DT_GRID_LOOP(c, outer * inner) {
        int64_t o = c / inner, base = o * len * inner + (c - o * inner);
        double dot = 0.0;
        for (int64_t l = 0; l < len; l++) {
            int64_t i = base + l * inner;
            dot += is_log ? (double)dy[i] : (double)dy[i] * (double)y[i];
        }
        float d = (float)dot;
        for (int64_t l = 0; l < len; l++) {
            int64_t i = base + l * inner;
            float g = softmax_grad(is_log, y[i], dy[i], d);
            dx[i] = acc ? dx[i] + g : g;
        }
    }
}

static void cuda_softmax_backward(dt_backend *be, int64_t outer, int64_t len, int64_t inner,
                                  const float *y, const float *dy, float *dx, int is_log,
                                  int accumulate)
{
    if (outer <= 0 || len <= 0 || inner <= 0) return;
    cuda_enter(be);
    cudaStream_t s = be->compute;
    int g = row_group(len);
    if (inner > 1)
        softmax_bwd_cols_kernel<<<grid_for(outer * inner, DT_CUDA_THREADS), DT_CUDA_THREADS, 0,
                                  s>>>(outer, len, inner, y, dy, dx, is_log, accumulate);
    else
        softmax_bwd_rows_kernel<<<grid_rows(outer, g), DT_CUDA_THREADS, 0, s>>>(
            g, outer, len, y, dy, dx, is_log, accumulate);
    DT_LAUNCHED(be);
}

/* ---- index checks (labels, embedding indices) ----------------------------
 * The first bad index is the minimum over threads: an integer atomicMin, exact
 * whatever the order. */
static __global__ void index_check_kernel(int64_t n, const int32_t *idx, int64_t limit,
                                          int64_t ignore, unsigned long long *first)
{
    DT_GRID_LOOP(i, n)
        if ((idx[i] < 0 || (int64_t)idx[i] >= limit) && (int64_t)idx[i] != ignore)
            atomicMin(first, (unsigned long long)i);
}

/* First i with idx[i] outside [0, limit), or -1; waits for the answer.
 * Also -1 when the instance has a fault (then `first` was never read back):
 * backend.h has the caller ask fault() before it trusts "all valid", and the
 * fault is recorded before this returns (a failed launch at once, a kernel's
 * fault at the sync). */
static int64_t index_check_run(dt_backend *be, int64_t n, const int32_t *idx, int64_t limit,
                               int64_t ignore)
{
    if (cuda_faulted(be) || n <= 0) return -1;
    unsigned long long *flag = red_flag(be), first = 0;
    DT_CUDA_OK(be, cudaMemsetAsync(flag, 0xff, sizeof *flag, be->compute));
    index_check_kernel<<<grid_for(n, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>(
        n, idx, limit, ignore, flag);
    DT_LAUNCHED(be);
    DT_CUDA_OK(be, cudaMemcpyAsync(&first, flag, sizeof first, cudaMemcpyDeviceToHost,
                                   be->compute));
    DT_CUDA_OK(be, cudaStreamSynchronize(be->compute));
    if (cuda_faulted(be)) return -1;
    return first == ~0ull ? -1 : (int64_t)first;
}

/* ---- cross entropy ---------------------------------------------------------
 * Block p owns rows [part_start(n, nparts, p), ...); its 8 warps take rows in
 * turn, each warp adding its rows' losses in order; the block adds the warps'
 * sums in warp order into part[p]; sum_finish adds the parts (fixed tree). */
static __global__ void xent_rows_kernel(int64_t n, int64_t c, const float *logits,
                                        const int32_t *labels, int64_t ignore, float *rows,
                                        int nparts, double *part)
{
    __shared__ double wsum[DT_CUDA_THREADS / 32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = DT_CUDA_THREADS / 32;
    int64_t lo = part_start(n, nparts, blockIdx.x), hi = part_start(n, nparts, blockIdx.x + 1);
    double acc = 0.0;
    for (int64_t r = lo + w; r < hi; r += nw) {
        const float *x = logits + r * c;
        float m = -INFINITY;
        for (int64_t j = lane; j < c; j += 32) m = max_nan(m, x[j]);
        m = warp_max(m);
        double s = 0.0;
        for (int64_t j = lane; j < c; j += 32) s += (double)expf(x[j] - m);
        s = warp_sum(s);
        if (lane == 0) {   /* the row's max and 1/sum: backward rebuilds the softmax */
            rows[2 * r] = m;
            rows[2 * r + 1] = (float)(1.0 / s);
        }
        if ((int64_t)labels[r] != ignore)   /* logsumexp - logit[label] */
            acc += log(s) + (double)m - (double)x[labels[r]];
    }
    if (lane == 0) wsum[w] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (int i = 0; i < nw; i++) t += wsum[i];
        part[blockIdx.x] = t;
    }
}

/* logits (n,c), labels (n) -> rows (2n: max, 1/sum), *loss = mean_r (logsumexp - logit[label]).
 * Labels are checked first (one wait), as the CPU does, so nothing is
 * written when one is out of range. */
static int64_t cuda_xent_forward(dt_backend *be, int64_t n, int64_t c, const float *logits,
                                 const int32_t *labels, int64_t ignore, int64_t kept, float *rows,
                                 float *loss)
{
    if (cuda_faulted(be)) return -1;   /* the caller asks fault() */
    cuda_enter(be);
    int64_t bad = index_check_run(be, n, labels, c, ignore);
    if (bad >= 0) return bad;
    if (cuda_faulted(be)) return -1;   /* the check itself failed: queue nothing more */
    if (n <= 0 || c <= 0) {
        fill_kernel<<<1, 32, 0, be->compute>>>(1, 0.0f, loss);
        DT_LAUNCHED(be);
        return -1;
    }
    int np = (int)min64((n + 63) / 64, DT_CUDA_RED_PARTS);
    dt_cuda_dims K;
    memset(&K, 0, sizeof K);
    xent_rows_kernel<<<np, DT_CUDA_THREADS, 0, be->compute>>>(n, c, logits, labels, ignore, rows,
                                                             np, be->red);
    DT_LAUNCHED(be);
    sum_finish_kernel<<<1, DT_CUDA_THREADS, 0, be->compute>>>(1, K, np, be->red, (double)kept,
                                                              loss, 0, NULL);
    DT_LAUNCHED(be);
    return -1;
}

/* dlogits (n,c) (+)= (softmax - onehot(labels)) * dloss / n, in cpu.c's
 * order; softmax = exp(logit - max) * (1/sum) from the forward's rows */
static __global__ void xent_bwd_kernel(int64_t n, int64_t c, const float *logits,
                                       const float *rows, const int32_t *labels, int64_t ignore,
                                       int64_t kept, const float *dloss, float *dlogits, int acc)
{
    float s = *dloss / (float)kept;
    DT_GRID_LOOP(i, n * c) {
        int64_t r = i / c, j = i - r * c;
        if ((int64_t)labels[r] == ignore) {   /* no gradient */
            if (!acc) dlogits[i] = 0.0f;
            continue;
        }
        float p = expf(logits[i] - rows[2 * r]) * rows[2 * r + 1];
        float v = acc ? dlogits[i] + p * s : p * s;
        if (j == (int64_t)labels[r]) v -= s;
        dlogits[i] = v;
    }
}

static void cuda_xent_backward(dt_backend *be, int64_t n, int64_t c, const float *logits,
                               const float *rows, const int32_t *labels, int64_t ignore,
                               int64_t kept, const float *dloss, float *dlogits, int accumulate)
{
    if (n <= 0 || c <= 0) return;
    cuda_enter(be);
    xent_bwd_kernel<<<grid_for(n * c, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>(
        n, c, logits, rows, labels, ignore, kept, dloss, dlogits, accumulate);
    DT_LAUNCHED(be);
}

/* ---------------------------------------------------------------------------
 * 11. Convolution helpers
 *
 * col (C*KH*KW, N*OH*OW): row r = (c*KH + ki)*KW + kj, column
 * j = n*OH*OW + oh*OW + ow, holding x[n, c, oh*s - pad + ki, ow*s - pad + kj]
 * (0 in the padding).  col2im gathers: each dx element adds the col entries
 * that fold onto it in (ki, kj) order, the order cpu.c adds them in.
 * ------------------------------------------------------------------------- */

/* x (N,C,H,W) -> col (C*KH*KW, N*OH*OW) */
static __global__ void im2col_kernel(dt_conv_geom g, const float *x, float *col)
{
    int64_t P = g.oh * g.ow, ncols = g.n * P;
    DT_GRID_LOOP(i, g.c * g.kh * g.kw * ncols) {
        int64_t r = i / ncols, j = i - r * ncols;
        int64_t kj = r % g.kw, t = r / g.kw, ki = t % g.kh, c = t / g.kh;
        int64_t n = j / P, p = j - n * P, oh = p / g.ow, ow = p - oh * g.ow;
        int64_t ih = oh * g.stride - g.pad + ki, iw = ow * g.stride - g.pad + kj;
        int inside = ih >= 0 && ih < g.h && iw >= 0 && iw < g.w;
        col[i] = inside ? x[((n * g.c + c) * g.h + ih) * g.w + iw] : 0.0f;
    }
}

static void cuda_im2col(dt_backend *be, const dt_conv_geom *g, const float *x, float *col)
{
    int64_t total = g->c * g->kh * g->kw * g->n * g->oh * g->ow;
    if (total <= 0) return;
    cuda_enter(be);
    im2col_kernel<<<grid_for(total, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>(*g, x,
                                                                                         col);
    DT_LAUNCHED(be);
}

/* dx (N,C,H,W) (+)= fold of col (C*KH*KW, N*OH*OW) */
static __global__ void col2im_kernel(dt_conv_geom g, const float *col, float *dx, int acc)
{
    int64_t P = g.oh * g.ow, ncols = g.n * P, s = g.stride;
    DT_GRID_LOOP(i, g.n * g.c * g.h * g.w) {
        int64_t iw = i % g.w, t = i / g.w, ih = t % g.h;
        t /= g.h;
        int64_t c = t % g.c, n = t / g.c;
        float v = acc ? dx[i] : 0.0f;
        for (int64_t ki = 0; ki < g.kh; ki++) {
            int64_t th = ih + g.pad - ki;   /* = oh * s */
            if (th < 0 || th % s != 0 || th / s >= g.oh) continue;
            for (int64_t kj = 0; kj < g.kw; kj++) {
                int64_t tw = iw + g.pad - kj;
                if (tw < 0 || tw % s != 0 || tw / s >= g.ow) continue;
                int64_t r = (c * g.kh + ki) * g.kw + kj;
                v += col[r * ncols + n * P + (th / s) * g.ow + tw / s];
            }
        }
        dx[i] = v;
    }
}

static void cuda_col2im(dt_backend *be, const dt_conv_geom *g, const float *col, float *dx,
                        int accumulate)
{
    int64_t total = g->n * g->c * g->h * g->w;
    if (total <= 0) return;
    cuda_enter(be);
    col2im_kernel<<<grid_for(total, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>(
        *g, col, dx, accumulate);
    DT_LAUNCHED(be);
}

/* y (N, C, inner) += bias (C) */
static __global__ void bias_add_kernel(int64_t total, int64_t c, int64_t inner, const float *bias,
                                       float *y)
{
    DT_GRID_LOOP(i, total) y[i] += bias[(i / inner) % c];
}

static void cuda_bias_add(dt_backend *be, int64_t n, int64_t c, int64_t inner, const float *bias,
                          float *y)
{
    int64_t total = n * c * inner;
    if (total <= 0) return;
    cuda_enter(be);
    bias_add_kernel<<<grid_for(total, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>(
        total, c, inner, bias, y);
    DT_LAUNCHED(be);
}

/* to_ncp: src (C, N*P) -> dst (N, C, P); else dst (C, N*P) <- src (N, C, P).
 * i walks (n, c, p) in NCP order either way. */
static __global__ void permute_cnp_kernel(int64_t n, int64_t c, int64_t p, const float *src,
                                          float *dst, int to_ncp)
{
    DT_GRID_LOOP(i, n * c * p) {
        int64_t q = i % p, t = i / p, ch = t % c, im = t / c;
        int64_t cnp = (ch * n + im) * p + q;
        if (to_ncp)
            dst[i] = src[cnp];
        else
            dst[cnp] = src[i];
    }
}

static void cuda_cnp_to_ncp(dt_backend *be, int64_t c, int64_t n, int64_t p, const float *src,
                            float *dst)
{
    if (n * c * p <= 0) return;
    cuda_enter(be);
    permute_cnp_kernel<<<grid_for(n * c * p, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>(
        n, c, p, src, dst, 1);
    DT_LAUNCHED(be);
}

static void cuda_ncp_to_cnp(dt_backend *be, int64_t n, int64_t c, int64_t p, const float *src,
                            float *dst)
{
    if (n * c * p <= 0) return;
    cuda_enter(be);
    permute_cnp_kernel<<<grid_for(n * c * p, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>(
        n, c, p, src, dst, 0);
    DT_LAUNCHED(be);
}

/* ---------------------------------------------------------------------------
 * 12. Pooling, NCHW, square kernel k = g->kh
 *
 * Forward: a thread per output visits its window in row-major order, first
 * maximum kept, a NaN takes over (PyTorch's and cpu.c's rule).  Backward
 * gathers: a thread per input element adds the outputs that route to it, in
 * the order cpu.c's scatter adds them (output index order for max, (ki, kj)
 * order for avg).
 * ------------------------------------------------------------------------- */

/* first oh (or ow) whose window [oh*s - pad, oh*s - pad + k) holds i */
static __device__ inline int64_t first_window(int64_t i, int64_t pad, int64_t k, int64_t s)
{
    int64_t t = i + pad - k + 1;
    return t <= 0 ? 0 : (t + s - 1) / s;
}

/* y, argmax (N,C,OH,OW) from x (N,C,H,W); argmax = h*W+w in the plane, -1
 * (and y -inf) if the window is all padding */
static __global__ void maxpool_fwd_kernel(dt_conv_geom g, const float *x, float *y, int32_t *am)
{
    int64_t k = g.kh, s = g.stride, W = g.w;
    DT_GRID_LOOP(i, g.n * g.c * g.oh * g.ow) {
        int64_t ow = i % g.ow, t = i / g.ow, oh = t % g.oh, plane = t / g.oh;
        const float *xp = x + plane * g.h * W;
        int64_t h0 = max64(0, oh * s - g.pad), h1 = min64(g.h, oh * s - g.pad + k);
        int64_t w0 = max64(0, ow * s - g.pad), w1 = min64(W, ow * s - g.pad + k);
        float best = -INFINITY;
        int64_t at = -1;
        if (h0 < h1 && w0 < w1) {
            at = h0 * W + w0;
            best = xp[at];
        }
        for (int64_t ih = h0; ih < h1; ih++)
            for (int64_t iw = w0; iw < w1; iw++) {
                float v = xp[ih * W + iw];
                if (v > best || v != v) {
                    best = v;
                    at = ih * W + iw;
                }
            }
        y[i] = best;
        am[i] = (int32_t)at;
    }
}

static void cuda_maxpool_forward(dt_backend *be, const dt_conv_geom *g, const float *x, float *y,
                                 int32_t *argmax)
{
    int64_t total = g->n * g->c * g->oh * g->ow;
    if (total <= 0) return;
    cuda_enter(be);
    maxpool_fwd_kernel<<<grid_for(total, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>(
        *g, x, y, argmax);
    DT_LAUNCHED(be);
}

/* dx (N,C,H,W) (+)= dy routed by argmax */
static __global__ void maxpool_bwd_kernel(dt_conv_geom g, const float *dy, const int32_t *am,
                                          float *dx, int acc)
{
    int64_t k = g.kh, s = g.stride, P = g.oh * g.ow;
    DT_GRID_LOOP(i, g.n * g.c * g.h * g.w) {
        int64_t iw = i % g.w, t = i / g.w, ih = t % g.h, plane = t / g.h;
        const float *dyp = dy + plane * P;
        const int32_t *amp = am + plane * P;
        int32_t flat = (int32_t)(ih * g.w + iw);
        int64_t oh1 = min64(g.oh - 1, (ih + g.pad) / s), ow1 = min64(g.ow - 1, (iw + g.pad) / s);
        int64_t ow0 = first_window(iw, g.pad, k, s);
        float v = acc ? dx[i] : 0.0f;
        for (int64_t oh = first_window(ih, g.pad, k, s); oh <= oh1; oh++)
            for (int64_t ow = ow0; ow <= ow1; ow++)
                if (amp[oh * g.ow + ow] == flat) v += dyp[oh * g.ow + ow];
        dx[i] = v;
    }
}

static void cuda_maxpool_backward(dt_backend *be, const dt_conv_geom *g, const float *dy,
                                  const int32_t *argmax, float *dx, int accumulate)
{
    int64_t total = g->n * g->c * g->h * g->w;
    if (total <= 0) return;
    cuda_enter(be);
    maxpool_bwd_kernel<<<grid_for(total, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>(
        *g, dy, argmax, dx, accumulate);
    DT_LAUNCHED(be);
}

/* y (N,C,OH,OW) = window sum / (k*k), padding counted (count_include_pad) */
static __global__ void avgpool_fwd_kernel(dt_conv_geom g, const float *x, float *y)
{
    int64_t k = g.kh, s = g.stride, W = g.w;
    float div = (float)(k * k);   /* divide, as PyTorch does, rather than scale */
    DT_GRID_LOOP(i, g.n * g.c * g.oh * g.ow) {
        int64_t ow = i % g.ow, t = i / g.ow, oh = t % g.oh, plane = t / g.oh;
        const float *xp = x + plane * g.h * W;
        float v = 0.0f;
        for (int64_t ki = 0; ki < k; ki++) {
            int64_t ih = oh * s - g.pad + ki;
            if (ih < 0 || ih >= g.h) continue;
            for (int64_t kj = 0; kj < k; kj++) {
                int64_t iw = ow * s - g.pad + kj;
                if (iw >= 0 && iw < W) v += xp[ih * W + iw];
            }
        }
        y[i] = v / div;
    }
}

static void cuda_avgpool_forward(dt_backend *be, const dt_conv_geom *g, const float *x, float *y)
{
    int64_t total = g->n * g->c * g->oh * g->ow;
    if (total <= 0) return;
    cuda_enter(be);
    avgpool_fwd_kernel<<<grid_for(total, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>(
        *g, x, y);
    DT_LAUNCHED(be);
}

/* dx (N,C,H,W) (+)= dy / (k*k) over the windows holding each element */
static __global__ void avgpool_bwd_kernel(dt_conv_geom g, const float *dy, float *dx, int acc)
{
    int64_t k = g.kh, s = g.stride, P = g.oh * g.ow;
    float div = (float)(k * k);
    DT_GRID_LOOP(i, g.n * g.c * g.h * g.w) {
        int64_t iw = i % g.w, t = i / g.w, ih = t % g.h, plane = t / g.h;
        const float *dyp = dy + plane * P;
        float v = acc ? dx[i] : 0.0f;
        for (int64_t ki = 0; ki < k; ki++) {
            int64_t th = ih + g.pad - ki;   /* = oh * s */
            if (th < 0 || th % s != 0 || th / s >= g.oh) continue;
            for (int64_t kj = 0; kj < k; kj++) {
                int64_t tw = iw + g.pad - kj;
                if (tw < 0 || tw % s != 0 || tw / s >= g.ow) continue;
                v += dyp[(th / s) * g.ow + tw / s] / div;
            }
        }
        dx[i] = v;
    }
}

static void cuda_avgpool_backward(dt_backend *be, const dt_conv_geom *g, const float *dy, float *dx,
                                  int accumulate)
{
    int64_t total = g->n * g->c * g->h * g->w;
    if (total <= 0) return;
    cuda_enter(be);
    avgpool_bwd_kernel<<<grid_for(total, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>(
        *g, dy, dx, accumulate);
    DT_LAUNCHED(be);
}

/* ---------------------------------------------------------------------------
 * 13. Embedding and index checks
 * ------------------------------------------------------------------------- */

/* y (n, d) = weight[idx[i]] rows */
static __global__ void emb_fwd_kernel(int64_t n, int64_t d, const float *weight,
                                      const int32_t *idx, float *y)
{
    DT_GRID_LOOP(i, n * d) {
        int64_t r = i / d, j = i - r * d;
        y[i] = weight[(int64_t)idx[r] * d + j];
    }
}

static void cuda_embedding_forward(dt_backend *be, int64_t n, int64_t d, const float *weight,
                                   const int32_t *idx, float *y)
{
    if (n * d <= 0) return;
    cuda_enter(be);
    emb_fwd_kernel<<<grid_for(n * d, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>(
        n, d, weight, idx, y);
    DT_LAUNCHED(be);
}

/* ---- embedding backward ----------------------------------------------------
 * dweight[idx[i]] += dy[i] for i in order.  cpu.c gives each thread columns
 * that walk i in order, so each row's updates land in increasing i.  A GPU
 * thread per column doing the same is serial over n, so instead the
 * positions are grouped by index: a stable LSD radix sort of the pairs
 * (idx[i], i), 8 bits a pass, keeps each index's positions in increasing i.
 * Then a warp per (run of equal indices, 32 columns) starts from dweight's
 * value and adds the run's dy rows in that order: cpu.c's additions in
 * cpu.c's order, with no float atomics.  Integer atomics only count digits
 * in shared memory and list the runs (the list's order changes no sum).
 *
 * The sort needs 16 bytes of pool scratch per position.  Without it, for
 * small n (launch overhead) or for n >= 2^31 (32-bit positions) the
 * thread-per-column kernel runs; both paths give the same bits. */
#define DT_EMB_SORT_MIN 64      /* n from which the sort runs (a guess: not yet measured) */
#define DT_EMB_TILE 4096        /* positions per block and per digit count */
#define DT_EMB_RADIX 256        /* 8-bit digits; one thread per digit */
#define DT_EMB_PASSES 4         /* 32-bit keys (the core has checked idx >= 0) */
#define DT_EMB_SCAN_THREADS 1024

static_assert(DT_CUDA_THREADS == DT_EMB_RADIX, "the sort's blocks have a thread per digit");
static_assert(DT_EMB_PASSES % 2 == 0, "the sorted pairs end in the second buffer");

/* a thread owns column j and walks i in order (the fallback) */
static __global__ void emb_bwd_cols_kernel(int64_t n, int64_t d, const int32_t *idx,
                                           const float *dy, float *dweight)
{
    DT_GRID_LOOP(j, d) {
        for (int64_t i = 0; i < n; i++) dweight[(int64_t)idx[i] * d + j] += dy[i * d + j];
    }
}

/* hist[digit * ntiles + tile] = the tile's keys with that digit */
static __global__ void emb_hist_kernel(int64_t n, int64_t ntiles, int shift, const uint32_t *keys,
                                       uint32_t *hist)
{
    __shared__ uint32_t cnt[DT_EMB_RADIX];
    for (int64_t t = blockIdx.x; t < ntiles; t += gridDim.x) {
        cnt[threadIdx.x] = 0;
        __syncthreads();
        int64_t lo = t * DT_EMB_TILE, hi = min64(n, lo + DT_EMB_TILE);
        for (int64_t i = lo + threadIdx.x; i < hi; i += DT_EMB_RADIX)
            atomicAdd(&cnt[(keys[i] >> shift) & (DT_EMB_RADIX - 1)], 1u);
        __syncthreads();
        hist[threadIdx.x * ntiles + t] = cnt[threadIdx.x];   /* then cleared by this thread */
    }
}

/* v (m) = its exclusive prefix sums, in one block: each thread sums a
 * contiguous part, the part totals are scanned across the block (warp
 * shuffles, then the warp totals), and each part is rewritten */
static __global__ void emb_scan_kernel(int64_t m, uint32_t *v)
{
    __shared__ uint32_t wtot[32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int64_t lo = part_start(m, blockDim.x, threadIdx.x);
    int64_t hi = part_start(m, blockDim.x, threadIdx.x + 1);
    uint32_t own = 0;
    for (int64_t i = lo; i < hi; i++) own += v[i];
    uint32_t x = own;   /* inclusive scan of the warp's parts */
    for (int off = 1; off < 32; off <<= 1) {
        uint32_t y = __shfl_up_sync(0xffffffffu, x, off);
        if (lane >= off) x += y;
    }
    if (lane == 31) wtot[w] = x;
    __syncthreads();
    if (w == 0) {   /* inclusive scan of the warp totals */
        uint32_t y = lane < nw ? wtot[lane] : 0;
        for (int off = 1; off < 32; off <<= 1) {
            uint32_t z = __shfl_up_sync(0xffffffffu, y, off);
            if (lane >= off) y += z;
        }
        wtot[lane] = y;
    }
    __syncthreads();
    uint32_t run = x - own + (w > 0 ? wtot[w - 1] : 0);
    for (int64_t i = lo; i < hi; i++) {
        uint32_t c = v[i];
        v[i] = run;
        run += c;
    }
}

/* One stable pass: a tile's pairs go, in tile order, to off[digit * ntiles +
 * tile] (the scanned counts) plus the same-digit keys before them in the
 * tile.  The tile goes in rounds of 256; a key's rank in its round is the
 * same-digit keys of earlier warps (wcnt) plus those of earlier lanes of its
 * own warp (__match_any_sync).  vals NULL: the values are the positions. */
static __global__ void emb_scatter_kernel(int64_t n, int64_t ntiles, int shift,
                                          const uint32_t *keys, const uint32_t *vals,
                                          const uint32_t *off, uint32_t *okeys, uint32_t *ovals)
{
    const int nw = DT_EMB_RADIX / 32, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    __shared__ uint32_t base[DT_EMB_RADIX];   /* next slot of each digit */
    __shared__ uint32_t wcnt[DT_EMB_RADIX / 32][DT_EMB_RADIX];
    const unsigned before = (1u << lane) - 1u;
    for (int64_t t = blockIdx.x; t < ntiles; t += gridDim.x) {
        base[threadIdx.x] = off[threadIdx.x * ntiles + t];
        int64_t lo = t * DT_EMB_TILE, hi = min64(n, lo + DT_EMB_TILE);
        for (int64_t r0 = lo; r0 < hi; r0 += DT_EMB_RADIX) {
            for (int q = 0; q < nw; q++) wcnt[q][threadIdx.x] = 0;   /* this thread's column */
            __syncthreads();
            int64_t i = r0 + threadIdx.x;
            int ok = i < hi;
            uint32_t key = ok ? keys[i] : 0;
            uint32_t dig = ok ? (key >> shift) & (DT_EMB_RADIX - 1) : DT_EMB_RADIX;
            unsigned peers = __match_any_sync(0xffffffffu, dig);
            if (ok && lane == __ffs(peers) - 1) wcnt[w][dig] = __popc(peers);
            __syncthreads();
            if (ok) {
                uint32_t p = base[dig] + __popc(peers & before);
                for (int q = 0; q < w; q++) p += wcnt[q][dig];
                okeys[p] = key;
                ovals[p] = vals ? vals[i] : (uint32_t)i;
            }
            __syncthreads();
            uint32_t round = 0;   /* column threadIdx.x again: no barrier before clearing */
            for (int q = 0; q < nw; q++) round += wcnt[q][threadIdx.x];
            base[threadIdx.x] += round;
        }
    }
}

/* runs[(*nruns)++] = s for each s where a run of equal sorted keys starts */
static __global__ void emb_runs_kernel(int64_t n, const uint32_t *keys, uint32_t *runs,
                                       uint32_t *nruns)
{
    DT_GRID_LOOP(s, n)
        if (s == 0 || keys[s] != keys[s - 1]) runs[atomicAdd(nruns, 1u)] = (uint32_t)s;
}

/* A warp per (run, 32 columns): lane j adds, in sorted order (increasing i),
 * the dy rows of the run's positions to dweight's row.  The warp reads 32
 * keys and positions at a time; the run ends at the first other key. */
static __global__ void emb_apply_kernel(int64_t n, int64_t d, const uint32_t *keys,
                                        const uint32_t *pos, const uint32_t *runs,
                                        const uint32_t *nruns, const float *dy, float *dweight)
{
    const int lane = threadIdx.x & 31;
    int64_t chunks = (d + 31) / 32, items = (int64_t)*nruns * chunks;
    int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t it = warp; it < items; it += nwarps) {
        int64_t s = runs[it / chunks], j = (it % chunks) * 32 + lane;
        uint32_t key = keys[s];
        float *wr = dweight + (int64_t)key * d;
        float v = j < d ? wr[j] : 0.0f;
        for (int64_t t0 = s;; t0 += 32) {
            int64_t t = t0 + lane;
            int same = t < n && keys[t] == key;
            int cnt = __popc(__ballot_sync(0xffffffffu, same));   /* keys sorted: a prefix */
            uint32_t p = same ? pos[t] : 0;
#pragma unroll 8
            for (int q = 0; q < cnt; q++) {
                int64_t i = __shfl_sync(0xffffffffu, p, q);
                if (j < d) v += dy[i * d + j];
            }
            if (cnt < 32) break;
        }
        if (j < d) wr[j] = v;
    }
}

/* The sorted path; 0 (nothing queued) if its scratch cannot be had. */
static int emb_bwd_sorted(dt_backend *be, int64_t n, int64_t d, const int32_t *idx,
                          const float *dy, float *dweight)
{
    int64_t ntiles = (n + DT_EMB_TILE - 1) / DT_EMB_TILE, m = DT_EMB_RADIX * ntiles;
    size_t vec = ((size_t)n * sizeof(uint32_t) + 255) & ~(size_t)255;
    size_t hist_bytes = ((size_t)m * sizeof(uint32_t) + 255) & ~(size_t)255;
    char *buf = (char *)cuda_alloc(be, 4 * vec + hist_bytes + sizeof(uint32_t));
    if (!buf) return 0;
    uint32_t *key[2] = {(uint32_t *)buf, (uint32_t *)(buf + 2 * vec)};
    uint32_t *pos[2] = {(uint32_t *)(buf + vec), (uint32_t *)(buf + 3 * vec)};
    uint32_t *hist = (uint32_t *)(buf + 4 * vec), *nruns = (uint32_t *)(buf + 4 * vec + hist_bytes);
    cudaStream_t s = be->compute;
    unsigned tiles = grid_for(ntiles, 1);
    const uint32_t *kin = (const uint32_t *)idx, *pin = NULL;   /* pass 0 reads idx itself */
    for (int pass = 0; pass < DT_EMB_PASSES; pass++) {
        int shift = 8 * pass, o = pass & 1;
        emb_hist_kernel<<<tiles, DT_EMB_RADIX, 0, s>>>(n, ntiles, shift, kin, hist);
        DT_LAUNCHED(be);
        emb_scan_kernel<<<1, DT_EMB_SCAN_THREADS, 0, s>>>(m, hist);
        DT_LAUNCHED(be);
        emb_scatter_kernel<<<tiles, DT_EMB_RADIX, 0, s>>>(n, ntiles, shift, kin, pin, hist, key[o],
                                                          pos[o]);
        DT_LAUNCHED(be);
        kin = key[o];
        pin = pos[o];
    }
    /* the sorted pairs are in key[1], pos[1]; key[0] holds the run list */
    DT_CUDA_OK(be, cudaMemsetAsync(nruns, 0, sizeof *nruns, s));
    emb_runs_kernel<<<grid_for(n, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, s>>>(n, kin, key[0],
                                                                            nruns);
    DT_LAUNCHED(be);
    int64_t chunks = (d + 31) / 32;
    emb_apply_kernel<<<grid_for(n * chunks, DT_CUDA_THREADS / 32), DT_CUDA_THREADS, 0, s>>>(
        n, d, kin, pin, key[0], nruns, dy, dweight);
    DT_LAUNCHED(be);
    cuda_free(be, buf);   /* stream order: its next owner's work runs after these kernels */
    return 1;
}

/* dweight[idx[i]] += dy[i] for i in order (rows not in idx untouched) */
static void cuda_embedding_backward(dt_backend *be, int64_t n, int64_t d, const int32_t *idx,
                                    const float *dy, float *dweight)
{
    if (n <= 0 || d <= 0) return;
    cuda_enter(be);
    if (n >= DT_EMB_SORT_MIN && n <= INT32_MAX && emb_bwd_sorted(be, n, d, idx, dy, dweight))
        return;
    emb_bwd_cols_kernel<<<grid_for(d, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>(
        n, d, idx, dy, dweight);
    DT_LAUNCHED(be);
}

static int64_t cuda_index_check(dt_backend *be, int64_t n, const int32_t *idx, int64_t limit)
{
    cuda_enter(be);
    return index_check_run(be, n, idx, limit, DT_XENT_KEEP_ALL);
}

/* ---------------------------------------------------------------------------
 * 14. Layer norm over rows of length d (biased variance, as PyTorch)
 *
 * A thread group per row (section 1) for the row statistics and dx; dw, db
 * are column sums: a block takes 32 columns, its 8 thread rows each walk
 * every 8th row in order, and the 8 partials are added in order.
 * ------------------------------------------------------------------------- */

/* x (rows, d) -> y (rows, d), mean (rows), rstd (rows) */
static __global__ void ln_fwd_kernel(int g, int64_t rows, int64_t d, const float *x,
                                     const float *w, const float *b, float eps, float *y,
                                     float *mean, float *rstd)
{
    __shared__ double shd[32];
    const int rpb = DT_CUDA_THREADS / g, lane = threadIdx.x % g;
    for (int64_t r = (int64_t)blockIdx.x * rpb + threadIdx.x / g; r < rows;
         r += (int64_t)gridDim.x * rpb) {
        const float *xr = x + r * d;
        float *yr = y + r * d;
        double s = 0.0;
        for (int64_t j = lane; j < d; j += g) s += (double)xr[j];
        double mu = group_sum(s, shd, g) / (double)d;
        double q = 0.0;
        for (int64_t j = lane; j < d; j += g) q += ((double)xr[j] - mu) * ((double)xr[j] - mu);
        double var = group_sum(q, shd, g) / (double)d;
        float m = (float)mu, rs = (float)(1.0 / sqrt(var + (double)eps));
        if (lane == 0) {
            mean[r] = m;
            rstd[r] = rs;
        }
        for (int64_t j = lane; j < d; j += g) {
            float v = (xr[j] - m) * rs;
            if (w) v = v * w[j];
            if (b) v = v + b[j];
            yr[j] = v;
        }
    }
}

static void cuda_layernorm_forward(dt_backend *be, int64_t rows, int64_t d, const float *x,
                                   const float *w, const float *b, float eps, float *y,
                                   float *mean, float *rstd)
{
    if (rows <= 0 || d <= 0) return;
    cuda_enter(be);
    int g = row_group(d);
    ln_fwd_kernel<<<grid_rows(rows, g), DT_CUDA_THREADS, 0, be->compute>>>(g, rows, d, x, w, b,
                                                                          eps, y, mean, rstd);
    DT_LAUNCHED(be);
}

/* per row, xhat = (x-mean)*rstd, g = dy*w:
 * dx (+)= rstd * (g - mean(g) - xhat * mean(g*xhat)) */
static __global__ void ln_bwd_rows_kernel(int g, int64_t rows, int64_t d, const float *x,
                                          const float *w, const float *mean, const float *rstd,
                                          const float *dy, float *dx, int acc)
{
    __shared__ double shd[32];
    const int rpb = DT_CUDA_THREADS / g, lane = threadIdx.x % g;
    for (int64_t r = (int64_t)blockIdx.x * rpb + threadIdx.x / g; r < rows;
         r += (int64_t)gridDim.x * rpb) {
        const float *xr = x + r * d, *gr = dy + r * d;
        float *dr = dx + r * d, m = mean[r], rs = rstd[r];
        double sg = 0.0, sgx = 0.0;
        for (int64_t j = lane; j < d; j += g) {
            float gj = w ? gr[j] * w[j] : gr[j];
            sg += (double)gj;
            sgx += (double)(gj * ((xr[j] - m) * rs));
        }
        float mg = (float)(group_sum(sg, shd, g) / (double)d);
        float mgx = (float)(group_sum(sgx, shd, g) / (double)d);
        for (int64_t j = lane; j < d; j += g) {
            float gj = w ? gr[j] * w[j] : gr[j];
            float v = rs * (gj - mg - (xr[j] - m) * rs * mgx);
            dr[j] = acc ? dr[j] + v : v;
        }
    }
}

/* dw (d) += sum_r dy*xhat, db (d) += sum_r dy; block (32, 8) */
static __global__ void ln_bwd_cols_kernel(int64_t rows, int64_t d, const float *x,
                                          const float *mean, const float *rstd, const float *dy,
                                          float *dw, float *db)
{
    __shared__ double sw[8][32], sb[8][32];
    const int tx = threadIdx.x, ty = threadIdx.y;
    for (int64_t j0 = (int64_t)blockIdx.x * 32; j0 < d; j0 += (int64_t)gridDim.x * 32) {
        int64_t j = j0 + tx;
        double aw = 0.0, ab = 0.0;
        if (j < d)
            for (int64_t r = ty; r < rows; r += 8) {
                float g = dy[r * d + j];
                aw += (double)(g * ((x[r * d + j] - mean[r]) * rstd[r]));
                ab += (double)g;
            }
        sw[ty][tx] = aw;
        sb[ty][tx] = ab;
        __syncthreads();
        if (ty == 0 && j < d) {
            double tw = 0.0, tb = 0.0;
            for (int q = 0; q < 8; q++) {
                tw += sw[q][tx];
                tb += sb[q][tx];
            }
            if (dw) dw[j] += (float)tw;
            if (db) db[j] += (float)tb;
        }
        __syncthreads();
    }
}

static void cuda_layernorm_backward(dt_backend *be, int64_t rows, int64_t d, const float *x,
                                    const float *w, const float *mean, const float *rstd,
                                    const float *dy, float *dx, float *dw, float *db,
                                    int accumulate)
{
    if (rows <= 0 || d <= 0) return;
    cuda_enter(be);
    cudaStream_t s = be->compute;
    int g = row_group(d);
    ln_bwd_rows_kernel<<<grid_rows(rows, g), DT_CUDA_THREADS, 0, s>>>(g, rows, d, x, w, mean,
                                                                     rstd, dy, dx, accumulate);
    DT_LAUNCHED(be);
    if (dw || db) {
        ln_bwd_cols_kernel<<<grid_for(d, 32), dim3(32, 8), 0, s>>>(rows, d, x, mean, rstd, dy, dw,
                                                                   db);
        DT_LAUNCHED(be);
    }
}

/* ---------------------------------------------------------------------------
 * 15. Dropout
 *
 * cpu.c's counter-based hash, bit for bit, so a seed gives the same mask on
 * either backend: u_i from two murmur3 finalizer rounds keyed by
 * splitmix64(seed ^ splitmix64(i >> 32)).  The key for the first 2^32
 * elements is computed once on the host.
 * ------------------------------------------------------------------------- */
static __host__ __device__ inline uint64_t splitmix64(uint64_t z)
{
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static __host__ __device__ inline uint32_t fmix32(uint32_t h)
{
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return h;
}

static __host__ __device__ inline uint64_t dropout_key(uint64_t seed, uint64_t hi32)
{
    return splitmix64(seed ^ splitmix64(hi32));
}

/* mask (n) = u_i >= p ? scale : 0; y (n) = x * mask; key0 is dropout_key(seed, 0) */
static __global__ void dropout_kernel(int64_t n, float p, float scale, uint64_t seed,
                                      uint64_t key0, const float *x, float *y, float *mask)
{
    DT_GRID_LOOP(i, n) {
        uint64_t hi32 = (uint64_t)i >> 32;
        uint64_t key = hi32 ? dropout_key(seed, hi32) : key0;
        uint32_t h = fmix32(fmix32((uint32_t)i ^ (uint32_t)key) + (uint32_t)(key >> 32));
        float u = (float)(h >> 8) * 0x1p-24f;
        float m = u >= p ? scale : 0.0f;
        mask[i] = m;
        y[i] = x[i] * m;
    }
}

static void cuda_dropout_forward(dt_backend *be, int64_t n, float p, uint64_t seed, const float *x,
                                 float *y, float *mask)
{
    if (n <= 0) return;
    cuda_enter(be);
    float scale = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
    dropout_kernel<<<grid_for(n, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>(
        n, p, scale, seed, dropout_key(seed, 0), x, y, mask);
    DT_LAUNCHED(be);
}

/* ---------------------------------------------------------------------------
 * 16. Optimizers, in place over n elements (torch.optim semantics, cpu.c's
 * formulas and operation order)
 * ------------------------------------------------------------------------- */

/* g' = g + wd w; buf = first ? g' : mom buf + (1-damp) g';
 * step = nesterov ? g' + mom buf : buf (g' without momentum); w -= lr step */
static __global__ void sgd_kernel(int64_t n, float *w, const float *g, float *buf, float lr,
                                  float mom, float keep, int nesterov, float wd, int first)
{
    DT_GRID_LOOP(i, n) {
        if (mom == 0.0f) {
            w[i] -= lr * (g[i] + wd * w[i]);
            continue;
        }
        float gi = g[i] + wd * w[i];
        float b = first ? gi : mom * buf[i] + keep * gi;
        buf[i] = b;
        w[i] -= lr * (nesterov ? gi + mom * b : b);
    }
}

static void cuda_sgd_update(dt_backend *be, int64_t n, float *w, const float *g, float *buf,
                            float lr, float momentum, float dampening, int nesterov,
                            float weight_decay, int first)
{
    if (n <= 0) return;
    cuda_enter(be);
    sgd_kernel<<<grid_for(n, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>(
        n, w, g, buf, lr, momentum, 1.0f - dampening, nesterov, weight_decay, first);
    DT_LAUNCHED(be);
}

/* AdamW: w *= 1 - lr wd; Adam: g += wd w.  m = m + (1-b1)(g-m) (torch's lerp);
 * v = b2 v + (1-b2) g g; w -= (lr/bc1) m / (sqrt(v)/sqrt(bc2) + eps) */
static __global__ void adam_kernel(int64_t n, float *w, const float *g, float *m, float *v,
                                   float decay, float l2, float b1c, float b2, float b2c,
                                   float eps, float step, float bcs)
{
    DT_GRID_LOOP(i, n) {
        float gi = g[i] + l2 * (w[i] * decay);
        float mi = m[i] + b1c * (gi - m[i]);
        float vi = b2 * v[i] + b2c * gi * gi;
        m[i] = mi;
        v[i] = vi;
        w[i] = w[i] * decay - step * mi / (sqrtf(vi) / bcs + eps);
    }
}

static void cuda_adam_update(dt_backend *be, int64_t n, float *w, const float *g, float *m,
                             float *v, float lr, float beta1, float beta2, float eps,
                             float weight_decay, int decoupled, float bc1, float bc2)
{
    if (n <= 0) return;
    cuda_enter(be);
    float decay = decoupled ? 1.0f - lr * weight_decay : 1.0f;
    float l2 = decoupled ? 0.0f : weight_decay;
    float step = (float)((double)lr / (double)bc1), bcs = (float)sqrt((double)bc2);
    adam_kernel<<<grid_for(n, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>(
        n, w, g, m, v, decay, l2, 1.0f - beta1, beta2, 1.0f - beta2, eps, step, bcs);
    DT_LAUNCHED(be);
}

/* g' = g + wd w; sum += g' g'; w -= lr g' / (sqrt(sum) + eps) */
static __global__ void adagrad_kernel(int64_t n, float *w, const float *g, float *sum, float lr,
                                      float eps, float wd)
{
    DT_GRID_LOOP(i, n) {
        float gi = g[i] + wd * w[i];
        float s = sum[i] + gi * gi;
        sum[i] = s;
        w[i] -= lr * gi / (sqrtf(s) + eps);
    }
}

static void cuda_adagrad_update(dt_backend *be, int64_t n, float *w, const float *g, float *sum,
                                float lr, float eps, float weight_decay)
{
    if (n <= 0) return;
    cuda_enter(be);
    adagrad_kernel<<<grid_for(n, DT_CUDA_THREADS), DT_CUDA_THREADS, 0, be->compute>>>(
        n, w, g, sum, lr, eps, weight_decay);
    DT_LAUNCHED(be);
}

/* ---------------------------------------------------------------------------
 * 17. Metrics
 *
 * cpu.c takes best = 0 and moves on x[j] > x[best]: with a NaN at x[0]
 * nothing beats it; otherwise NaNs never win and ties keep the first.  A warp
 * per row finds the first maximum among the non-NaN entries (a total order:
 * larger value, then smaller index, so the butterfly gives every lane the
 * same answer), then applies the x[0] rule.
 * ------------------------------------------------------------------------- */
static __global__ void count_correct_kernel(int64_t n, int64_t c, const float *logits,
                                            const int32_t *labels, unsigned long long *hits)
{
    const int lane = threadIdx.x & 31;
    int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t r = warp; r < n; r += nwarps) {
        const float *x = logits + r * c;
        float bv = 0.0f;
        int64_t bi = -1;
        for (int64_t j = lane; j < c; j += 32) {
            float v = x[j];
            if (v == v && (bi < 0 || v > bv)) {
                bv = v;
                bi = j;
            }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, off);
            int64_t oi = __shfl_xor_sync(0xffffffffu, bi, off);
            if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) {
                bv = ov;
                bi = oi;
            }
        }
        if (bi < 0 || x[0] != x[0]) bi = 0;
        if (lane == 0 && bi == (int64_t)labels[r]) atomicAdd(hits, 1ull);
    }
}

/* rows of logits (n,c) whose first argmax equals the label; waits.  -1 once
 * the instance has a fault, never a count read from a failed copy. */
static int64_t cuda_count_correct(dt_backend *be, int64_t n, int64_t c, const float *logits,
                                  const int32_t *labels)
{
    if (cuda_faulted(be)) return -1;
    if (n <= 0 || c <= 0) return 0;
    cuda_enter(be);
    unsigned long long *hits = red_flag(be), h = 0;
    DT_CUDA_OK(be, cudaMemsetAsync(hits, 0, sizeof *hits, be->compute));
    count_correct_kernel<<<grid_rows(n, 32), DT_CUDA_THREADS, 0, be->compute>>>(n, c, logits,
                                                                                labels, hits);
    DT_LAUNCHED(be);
    DT_CUDA_OK(be, cudaMemcpyAsync(&h, hits, sizeof h, cudaMemcpyDeviceToHost, be->compute));
    DT_CUDA_OK(be, cudaStreamSynchronize(be->compute));
    return cuda_faulted(be) ? -1 : (int64_t)h;
}

/* ---------------------------------------------------------------------------
 * 17b. Attention: the (t, t) scores of every head in pool scratch for the
 *      call, cuBLAS strided-batched GEMMs, a warp per score row; only the
 *      row log-sum-exps outlive the call (backward recomputes the scores)
 * ------------------------------------------------------------------------- */

/* Row r of bh*t: s = s + mask, -inf past the diagonal when causal; with
 * have_lse 0 its log-sum-exp goes to lse[r] first; then s = exp(s - lse). */
static __global__ void attn_probs_kernel(int64_t rows, int64_t t, int causal, const float *mask,
                                         float *s, float *lse, int have_lse)
{
    int lane = threadIdx.x & 31;
    int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int64_t warps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t r = warp; r < rows; r += warps) {
        int64_t i = r % t;
        float *row = s + r * t;
        float m = -INFINITY;
        for (int64_t j = lane; j < t; j += 32) {
            float v = row[j] + (mask ? mask[i * t + j] : 0.0f);
            v = causal && j > i ? -INFINITY : v;
            row[j] = v;
            m = max_nan(m, v);
        }
        float l;
        if (have_lse) {
            l = lse[r];
        } else {
            m = warp_max(m);
            double sum = 0.0;
            for (int64_t j = lane; j < t; j += 32)
                sum += (double)expf(row[j] - m);
            sum = warp_sum(sum);
            l = m + logf((float)sum);
            if (lane == 0)
                lse[r] = l;
        }
        __syncwarp();
        for (int64_t j = lane; j < t; j += 32)
            row[j] = expf(row[j] - l);
    }
}

/* Row r: ds = p (ds - <dout, o>) over the row's keys. */
static __global__ void attn_ds_kernel(int64_t rows, int64_t t, int64_t d, const float *p,
                                      const float *dout, const float *o, float *ds)
{
    int lane = threadIdx.x & 31;
    int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int64_t warps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t r = warp; r < rows; r += warps) {
        double di = 0.0;
        for (int64_t e = lane; e < d; e += 32)
            di += (double)dout[r * d + e] * (double)o[r * d + e];
        float dif = (float)warp_sum(di);
        for (int64_t j = lane; j < t; j += 32)
            ds[r * t + j] = p[r * t + j] * (ds[r * t + j] - dif);
    }
}

static unsigned attn_grid(int64_t rows) { return grid_for(rows, DT_CUDA_THREADS / 32); }

/* p (bh, t, t) = the probabilities of every head (lse given, or computed) */
static void attn_probs(dt_backend *be, int64_t bh, int64_t t, int64_t d, float scale, int causal,
                       const float *mask, const float *q, const float *k, float *p, float *lse,
                       int have_lse)
{
    gemm_args S = {0, 1, bh, t, t, d, scale, 0.0f, q, k, p, d, d, t, t * d, t * d, t * t};
    gemm_f32(be, &S);
    attn_probs_kernel<<<attn_grid(bh * t), DT_CUDA_THREADS, 0, be->compute>>>(
        bh * t, t, causal, mask, p, lse, have_lse);
    DT_LAUNCHED(be);
}

/* The scores of at most this many bytes exist at a time: heads go through
 * in chunks (every head alone is a batch entry, so a chunk's results are
 * the whole batch's; the mask is per (t, t), the same for every head). */
#define DT_CUDA_ATTN_CHUNK_BYTES ((size_t)64 << 20)

/* Heads a chunk holds when each needs `per_head` floats of scores. */
static int64_t attn_chunk_heads(int64_t bh, int64_t per_head)
{
    int64_t h = (int64_t)(DT_CUDA_ATTN_CHUNK_BYTES / sizeof(float)) / (per_head > 0 ? per_head : 1);
    return h < 1 ? 1 : h < bh ? h : bh;
}

static dt_status cuda_attention_forward(dt_backend *be, int64_t bh, int64_t t, int64_t d,
                                        float scale, int causal, const float *mask,
                                        const float *q, const float *k, const float *v, float *o,
                                        float *lse)
{
    if (bh <= 0 || t <= 0 || d <= 0) return DT_OK;
    cuda_enter(be);
    int64_t hc = attn_chunk_heads(bh, t * t);
    float *p = (float *)cuda_alloc(be, sizeof(float) * (size_t)(hc * t * t));
    if (!p) return DT_ENOMEM;
    for (int64_t h0 = 0; h0 < bh; h0 += hc) {
        int64_t n = bh - h0 < hc ? bh - h0 : hc, off = h0 * t * d;
        attn_probs(be, n, t, d, scale, causal, mask, q + off, k + off, p, lse + h0 * t, 0);
        gemm_args O = {0, 0, n, t, d, t, 1.0f, 0.0f, p, v + off, o + off, t, d, d, t * t, t * d,
                       t * d};
        gemm_f32(be, &O);
    }
    cuda_free(be, p);
    return DT_OK;
}

static dt_status cuda_attention_backward(dt_backend *be, int64_t bh, int64_t t, int64_t d,
                                         float scale, int causal, const float *mask,
                                         const float *q, const float *k, const float *v,
                                         const float *o, const float *lse, const float *dout,
                                         float *dq, float *dk, float *dv)
{
    if (bh <= 0 || t <= 0 || d <= 0) return DT_OK;
    cuda_enter(be);
    int64_t hc = attn_chunk_heads(bh, 2 * t * t);
    float *p = (float *)cuda_alloc(be, sizeof(float) * (size_t)(2 * hc * t * t));
    if (!p) return DT_ENOMEM;
    float *ds = p + hc * t * t;
    for (int64_t h0 = 0; h0 < bh; h0 += hc) {
        int64_t n = bh - h0 < hc ? bh - h0 : hc, off = h0 * t * d;
        const float *qc = q + off, *kc = k + off, *vc = v + off, *oc = o + off, *gc = dout + off;
        attn_probs(be, n, t, d, scale, causal, mask, qc, kc, p, (float *)lse + h0 * t, 1);
        gemm_args dV = {1, 0, n, t, d, t, 1.0f, 0.0f, p, gc, dv + off, t, d, d, t * t, t * d, t * d};
        gemm_args dP = {0, 1, n, t, t, d, 1.0f, 0.0f, gc, vc, ds, d, d, t, t * d, t * d, t * t};
        gemm_f32(be, &dV);
        gemm_f32(be, &dP);
        attn_ds_kernel<<<attn_grid(n * t), DT_CUDA_THREADS, 0, be->compute>>>(n * t, t, d, p, gc,
                                                                            oc, ds);
        DT_LAUNCHED(be);
        gemm_args dQ = {0, 0, n, t, d, t, scale, 0.0f, ds, kc, dq + off, t, d, d, t * t, t * d, t * d};
        gemm_args dK = {1, 0, n, t, d, t, scale, 0.0f, ds, qc, dk + off, t, d, d, t * t, t * d, t * d};
        gemm_f32(be, &dQ);
        gemm_f32(be, &dK);
    }
    cuda_free(be, p);
    return DT_OK;
}

/* ---------------------------------------------------------------------------
 * 18. The interface table
 *
 * conv2d_forward / conv2d_backward are left NULL: the core lowers convolution
 * to im2col + one batched cuBLAS GEMM + cnp_to_ncp, which on a GPU is already
 * a single large GEMM (the per-image fusion helps the CPU's caches).
 * ------------------------------------------------------------------------- */
static const dt_backend_iface dt_cuda_iface = {
    .version = DT_BACKEND_IFACE_VERSION,
    .name = "cuda",
    .init = cuda_init,
    .shutdown = cuda_shutdown,
    .alloc = cuda_alloc,
    .free = cuda_free,
    .to_device = cuda_to_device,
    .to_host = cuda_to_host,
    .copy = cuda_copy,
    .memset0 = cuda_memset0,
    .sync = cuda_sync,
    .host_visible = 0,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .copy_async = cuda_copy_async,
    .copy_wait = cuda_copy_wait,
    .copy_join = cuda_copy_join,
    .gemm = cuda_gemm,
    .gemm_batched = cuda_gemm_batched,
    .gemm_ex = cuda_gemm_ex,
    .round_prec = cuda_round_prec,
    .fill = cuda_fill,
    .axpby = cuda_axpby,
    .unary = cuda_unary,
    .unary_backward = cuda_unary_backward,
    .binary = cuda_binary,
    .copy_strided = cuda_copy_strided,
    .sum_to = cuda_sum_to,
    .reduce_axis = cuda_reduce_axis,
    .sum = cuda_sum,
    .sumsq = cuda_sumsq,
    .softmax = cuda_softmax,
    .softmax_backward = cuda_softmax_backward,
    .xent_forward = cuda_xent_forward,
    .xent_backward = cuda_xent_backward,
    .im2col = cuda_im2col,
    .col2im = cuda_col2im,
    .bias_add = cuda_bias_add,
    .bias_grad = cuda_bias_grad,
    .cnp_to_ncp = cuda_cnp_to_ncp,
    .ncp_to_cnp = cuda_ncp_to_cnp,
    .conv2d_forward = NULL,
    .conv2d_backward = NULL,
    .maxpool_forward = cuda_maxpool_forward,
    .maxpool_backward = cuda_maxpool_backward,
    .avgpool_forward = cuda_avgpool_forward,
    .avgpool_backward = cuda_avgpool_backward,
    .embedding_forward = cuda_embedding_forward,
    .embedding_backward = cuda_embedding_backward,
    .index_check = cuda_index_check,
    .layernorm_forward = cuda_layernorm_forward,
    .layernorm_backward = cuda_layernorm_backward,
    .dropout_forward = cuda_dropout_forward,
    .sgd_update = cuda_sgd_update,
    .adam_update = cuda_adam_update,
    .adagrad_update = cuda_adagrad_update,
    .count_correct = cuda_count_correct,
    .fault = cuda_fault,
    .attention_forward = cuda_attention_forward,
    .attention_backward = cuda_attention_backward,
    .discard = cuda_discard,
    .to_half = cuda_to_half,
    .from_half = cuda_from_half,
    .commit = cuda_commit,
};

extern "C" const dt_backend_iface *dt_backend_cuda_iface(void) { return &dt_cuda_iface; }
