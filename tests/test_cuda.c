/*
 * tests/test_cuda.c - the CUDA backend against the CPU backend, op by op.
 *
 * Every entry of the CUDA backend's interface (backends/cuda.cu) runs on the
 * same seeded inputs as the CPU backend's (backends/cpu.c, the reference),
 * called directly through struct dt_backend_iface: inputs made on the host
 * by our own generator (tu_rng), copied to the device with alloc +
 * to_device, the op run, sync, to_host, and the result compared with the
 * CPU's under the tolerances of section 1, each with the reason for its
 * size.  Outputs start as 0xFF bytes (NaN, -1) on both backends, so a kernel
 * that reads an output it should only write shows up as a difference, and
 * one that never runs leaves NaN where the CPU has a value.  Where the CPU
 * backend could share a bug with the CUDA one (rounding to bf16/fp16/tf32,
 * mixed-precision GEMM), a reference computed here from first principles is
 * checked too.  The last test runs three SGD steps of a small MLP and a
 * small CNN through the public API on a "cuda" and a "cpu" context and
 * compares the parameters.
 *
 * Every CUDA result is read back only after asking the backend's fault()
 * (backend.h, "faults"): a launch or cuBLAS call that failed underneath
 * leaves outputs unwritten and makes index_check / xent_forward answer "all
 * valid", so a fault fails the test with the backend's message (function
 * cu_check_fault, called from cu_fetch_ptr and cu_expect_int).
 *
 * Without a GPU -- a build without DT_WITH_CUDA, or the CUDA backend's init
 * returning DT_ENOTSUP with a message that starts "cuda: no CUDA device is
 * visible" (no driver, or no device) -- each test prints "skipped: no GPU"
 * (the reason once) and counts as skipped: the group never fails or touches
 * a backend on a machine without one.  Any other init failure (a device
 * that cannot run the kernels built in, cuBLAS failing to start, a wrong
 * interface version) fails every test with the backend's message: a
 * machine with a GPU must not pass by skipping.
 *
 * Sections:
 *   1. Tolerances
 *   2. Fixture: a CPU and a CUDA instance per test
 *   3. Buffers on both backends, running an op on both
 *   4. Comparisons
 *   5. GEMM                          test_cuda_gemm
 *   6. Precision: round_prec, gemm_ex test_cuda_precision
 *   7. Elementwise and strided       test_cuda_elementwise
 *   8. Reductions                    test_cuda_reductions
 *   9. Softmax, cross entropy, count test_cuda_softmax_xent
 *  10. Convolution and pooling       test_cuda_conv_pool
 *  11. Embedding, layer norm, dropout test_cuda_embedding_layernorm_dropout
 *  12. Optimizers                    test_cuda_optimizers
 *  13. Memory (discard, commit too) and staging  test_cuda_memory_staging
 *  14. Determinism                   test_cuda_determinism
 *  15. Training steps, public API    test_cuda_train_steps
 */
#include "test_util.h"

#include <float.h>

#include "backends/backend.h"

/* ---------------------------------------------------------------------------
 * 1. Tolerances
 *
 * A CUDA value g passes against the CPU value c when both are NaN, when they
 * are equal (infinities included, +0 == -0), or when both are finite and
 * |g - c| <= atol + rtol * scale, where scale is |c| unless the check passes
 * a magnitude (the sum of the absolute values of the terms, for GEMMs and
 * sums, whose signed results cancel).
 * ------------------------------------------------------------------------- */
typedef struct cu_tol {
    double rtol, atol;
} cu_tol;

/* Data movement (copies, im2col, embedding rows, max pooling, argmax,
 * dropout masks) and single IEEE operations (one add, one multiply): the
 * same correctly rounded float on both. */
static const cu_tol TOL_EXACT = {0.0, 0.0};

/* A few arithmetic operations on O(1) values: each rounding is <= 2^-24
 * relative, and nvcc contracts a*b + c into one FMA (one rounding fewer)
 * where gcc -O1 does not, so results differ by a few ulps; near
 * cancellation (1 - y*y of tanh' at |y| ~ 1, a*x + b*y) by a few ulps of
 * the O(1) operands, which 2.5e-7 absolute (4 ulps of 1) covers.  Division
 * is here too (correctly rounded: build.sh passes no -use_fast_math, under
 * which it would be 2 ulps). */
static const cu_tol TOL_ARITH = {1e-6, 2.5e-7};

/* exp, erf, tanh, log: the CPU uses its own polynomials (exp < 1 ulp, tanh
 * 1.2 ulp, the normal CDF of gelu 4.2e-6 relative in its tail; see
 * backends/cpu.c), CUDA its libdevice functions (1-4 ulps): 1e-5 relative
 * covers the gelu tail, 1e-6 absolute the values near zero (sigmoid far
 * left, gelu' at its zero near x = -0.75, softmax of very negative logits). */
static const cu_tol TOL_TRANSC = {1e-5, 1e-6};

/* Layer norm: mean and variance over d <= 1000 values (double on the CPU,
 * f32 partials on a GPU: ~1e-7 relative), a reciprocal square root (rsqrtf:
 * 2 ulps), then O(1) arithmetic; the backward adds two row sums and the
 * weight gradients a sum over rows.  Values are O(1): 1e-5 both ways. */
static const cu_tol TOL_NORM = {1e-5, 1e-5};

/* Optimizer updates (section 12), compared after each of 3 steps.  Every
 * state is a chain of linear combinations per step (g' = g + wd w; buf =
 * mom buf + (1-d) g'; Adam's m + (1-b1)(g' - m); w - lr step), and nvcc
 * contracts a*b + c into one FMA where the CPU rounds a*b first: each
 * combination may differ by a few ulps of its OPERANDS, not of its result.
 * Near cancellation (w - lr*step landing near 0, a momentum changing sign)
 * that is far more than the ulps of the result, and a difference made at
 * step 1 is carried into steps 2 and 3, by when the value may have moved
 * to near zero: with |w| ~ 1 one ulp is 6e-8, which an absolute 1e-8 does
 * not cover.  So each value v is allowed
 *     OPT_RTOL |v_cpu| + OPT_ULPS * M
 * with M an error budget carried along in double from the CPU's states
 * (cu_opt_sgd, cu_opt_adam, cu_opt_adagrad): for s = a x + b y,
 *     M_s = |a| M_x + |b| M_y + |a x| + |b y|
 * (what x and y bring along, plus the operands of this combination), inputs
 * (g, the starting w and states) having M = 0.  OPT_ULPS = 2.5e-7 is 4
 * ulps of 1 (4 * 2^-24) per unit of operand magnitude, as TOL_ARITH: each
 * backend rounds each combination at most twice (product, then sum), each
 * rounding <= 2^-24 of its operands.  A quotient q = a / (sqrt(v) + eps)
 * (Adam, AdaGrad) brings M_a / (sqrt(v) + eps), half of v's relative budget
 * (sqrt halves it), and its own roundings: sqrt, / sqrt(bc2), + eps, the
 * product with lr and the division, correctly rounded on both (nvcc's
 * default -prec-div / -prec-sqrt; build.sh passes no -use_fast_math): 5
 * per backend, 10 ulps of |q|, counted as OPT_QUOT_UNITS = 4 units of 4
 * ulps.  OPT_RTOL (2e-6, ~34 ulps of the value over three steps) stays the
 * tight relative bound away from cancellation, and Adam's v and AdaGrad's
 * sum, which add positive terms, get it too.  A wrong formula moves a value
 * by ~lr |g| >= 1e-3, far above OPT_ULPS * M (M is a few units: ~1e-6). */
#define OPT_RTOL 2e-6
#define OPT_ULPS 2.5e-7
#define OPT_QUOT_UNITS 4.0

/* Sums (sum, sum_to, reduce_axis sum, bias_grad), relative to the sum of
 * the magnitudes of the terms: the CPU sums in double, a GPU tree in f32
 * with an error <= log2(n) * 2^-24 of that magnitude (< 1.4e-6 for
 * n <= 2^23).  sumsq (positive terms) is relative to its value. */
#define RED_RTOL 1e-5

/* GEMM in f32: |error| <= gamma_k |A||B| for any order of the k products
 * (Higham), gamma_k ~ k * 2^-24 at worst and ~ 2^-24 for random signs.
 * Allowed: GEMM_RTOL * sqrt(k) times the magnitude |alpha||op(A)||op(B)| +
 * |beta||C|: 1.1e-5 at k = 29, above the worst case of both backends
 * together for k <= 29, and ~9x below the ~1e-4 of the magnitude that TF32
 * tensor cores (10-bit operands) leave at k = 29, which an f32 GEMM must
 * not use.  Convolutions are GEMMs over k = C*KH*KW (forward), O*KH*KW
 * (dx) or N*OH*OW (dw) and use the same bound. */
#define GEMM_RTOL 2e-6

/* Mixed-precision GEMM (gemm_ex) against the CPU's f32 GEMM on operands
 * rounded with round_prec: the products are the same, but tensor cores add
 * them in blocks whose f32 partial sums may be truncated rather than
 * rounded; 1e-4 * sqrt(k) of the magnitude bounds that with a wide margin.
 * It cannot tell which precision the operands were rounded to: the grid
 * test below does. */
#define GEMMEX_RTOL 1e-4

/* gemm_ex on a grid: operands that round, at the requested precision, to
 * v / 8 with v an integer in [-63, 63], so every product and every partial
 * sum is exact in f32 and any summation order gives the exact result,
 * computed here in double.  1e-6 of the magnitude allows nothing but
 * slack; operands rounded at a finer precision (or not at all) keep their
 * perturbations (>= 2^-14 relative each), ~1.6e-5 of the magnitude at
 * k = 29. */
#define GEMMEX_GRID_RTOL 1e-6

/* Three whole SGD steps through the public API: the per-op differences
 * above (a few 1e-7 relative) compound over ~20 ops and 3 steps; 1e-4
 * relative, and 1e-6 absolute for the parameters that land near zero. */
#define TRAIN_RTOL 1e-4
#define TRAIN_ATOL 1e-6

/* ---------------------------------------------------------------------------
 * 2. Fixture: a CPU and a CUDA instance per test, both started as the core
 *    starts its backend (dtrain.c, dt_ctx_new: {threads, device, allocator}
 *    with the allocator defaulted to libc), and every buffer the test made,
 *    freed in teardown so a failing test leaks nothing.
 * ------------------------------------------------------------------------- */
enum { CU_HOST = 0, CU_CPU_MEM, CU_GPU_MEM, CU_PINNED, CU_CTX, CU_OPTIM };

typedef struct cu_mem {
    void *p;
    int kind;
} cu_mem;

typedef struct cu_fix {
    const dt_backend_iface *C, *G;  /* cpu, cuda */
    dt_backend *cb, *gb;
    char why[320];                   /* why there is no GPU: the skip */
    char broken[320];                /* a setup failure: fails the test */
    int fault_failed;                /* the test already failed on a fault */
    cu_mem *mem;
    int nmem, capmem;
} cu_fix;

#ifdef DT_WITH_CUDA
static void *cu_malloc(size_t n, void *u)
{
    (void)u;
    return malloc(n);
}
static void *cu_realloc(void *p, size_t n, void *u)
{
    (void)u;
    return realloc(p, n);
}
static void cu_libc_free(void *p, void *u)
{
    (void)u;
    free(p);
}

/* How the CUDA backend's init begins its message when there is no device
 * to run on (no driver, or no device visible): the only failure that skips. */
#define CU_NO_DEVICE "cuda: no CUDA device is visible"

/* Start the CUDA instance; only when it is up, the CPU one. */
static void cu_start(cu_fix *f)
{
    dt_backend_params p;
    memset(&p, 0, sizeof p);
    p.threads = 1;
    p.device = 0;
    p.allocator.malloc_fn = cu_malloc;
    p.allocator.realloc_fn = cu_realloc;
    p.allocator.free_fn = cu_libc_free;
    p.allocator.user = NULL;
    char err[256] = "";

    f->G = dt_backend_cuda_iface();
    if (!f->G) {
        snprintf(f->broken, sizeof f->broken, "dt_backend_cuda_iface() returned NULL");
        return;
    }
    if (f->G->version != DT_BACKEND_IFACE_VERSION) {
        snprintf(f->broken, sizeof f->broken,
                 "cuda backend has interface version %d, core expects %d", f->G->version,
                 DT_BACKEND_IFACE_VERSION);
        return;
    }
    dt_status s = f->G->init(&p, &f->gb, err, sizeof err);
    if (s != DT_OK) {
        f->gb = NULL;
        int no_device = s == DT_ENOTSUP && strncmp(err, CU_NO_DEVICE, strlen(CU_NO_DEVICE)) == 0;
        snprintf(no_device ? f->why : f->broken, sizeof f->why, "cuda backend init: %s (%s)",
                 err[0] ? err : "no message", dt_strerror(s));
        return;
    }
    if (!f->gb) {
        snprintf(f->broken, sizeof f->broken, "cuda backend init returned DT_OK and no instance");
        return;
    }
    f->C = dt_backend_cpu_iface();
    err[0] = '\0';
    s = f->C->init(&p, &f->cb, err, sizeof err);
    if (s != DT_OK) {
        f->cb = NULL;
        snprintf(f->broken, sizeof f->broken, "cpu backend init: %s", err);
    }
}
#endif

static int cu_setup(void **state)
{
    cu_fix *f = calloc(1, sizeof *f);
    if (!f) return -1;
    *state = f;
#ifdef DT_WITH_CUDA
    cu_start(f);
#else
    snprintf(f->why, sizeof f->why,
             "this build has no CUDA backend (backends/cuda.cu with -DDT_WITH_CUDA)");
#endif
    return 0;
}

/* Frees everything; returns -1 (cmocka counts the test as failed) when the
 * CUDA backend reports a fault that the test has not failed on already:
 * work queued after the last read-back that failed underneath. */
static int cu_teardown(void **state)
{
    cu_fix *f = *state;
    if (!f) return 0;
    int rc = 0;
    if (f->gb) {
        f->G->sync(f->gb);
        char err[256] = "";
        dt_status s = f->G->fault ? f->G->fault(f->gb, err, sizeof err) : DT_OK;
        if (s != DT_OK && !f->fault_failed) {
            print_error("cuda backend fault after the test's last check: %s (%s)\n",
                        err[0] ? err : "no message", dt_strerror(s));
            rc = -1;
        }
    }
    for (int i = f->nmem - 1; i >= 0; i--) {
        void *p = f->mem[i].p;
        switch (f->mem[i].kind) {
        case CU_HOST: free(p); break;
        case CU_CPU_MEM: f->C->free(f->cb, p); break;
        case CU_GPU_MEM: f->G->free(f->gb, p); break;
        case CU_PINNED: f->G->host_free(f->gb, p); break;
        case CU_CTX: dt_ctx_free(p); break;
        case CU_OPTIM: dt_optim_free(p); break;
        }
    }
    free(f->mem);
    if (f->gb) f->G->shutdown(f->gb);
    if (f->cb) f->C->shutdown(f->cb);
    free(f);
    *state = NULL;
    return rc;
}

/* 1 when both backends are up; otherwise the test is skipped (no GPU) or
 * failed (a broken setup). */
static int cu_ready(cu_fix *f)
{
    static int told;
    if (f->broken[0]) fail_msg("cuda: %s", f->broken);
    if (!f->gb || !f->cb) {
        if (!told) {
            told = 1;
            print_message("cuda: %s\n", f->why);
        }
        TU_SKIP("skipped: no GPU\n");
        return 0;
    }
    return 1;
}

#define CU_START(f)                                                           \
    cu_fix *f = *state;                                                       \
    if (!cu_ready(f)) return

/* ---------------------------------------------------------------------------
 * 3. Buffers on both backends, and running an op on both
 * ------------------------------------------------------------------------- */
static void cu_track(cu_fix *f, void *p, int kind)
{
    if (f->nmem == f->capmem) {
        int cap = f->capmem ? 2 * f->capmem : 64;
        cu_mem *m = realloc(f->mem, sizeof *m * (size_t)cap);
        if (!m) fail_msg("out of host memory for the buffer list");
        f->mem = m;
        f->capmem = cap;
    }
    f->mem[f->nmem].p = p;
    f->mem[f->nmem].kind = kind;
    f->nmem++;
}

/* forget p (the test freed it itself); the others keep their order, so
 * teardown still frees an optimizer before its context */
static void cu_untrack(cu_fix *f, void *p)
{
    for (int i = f->nmem - 1; i >= 0; i--)
        if (f->mem[i].p == p) {
            memmove(&f->mem[i], &f->mem[i + 1], sizeof *f->mem * (size_t)(f->nmem - i - 1));
            f->nmem--;
            return;
        }
}

/* zeroed host memory, freed in teardown */
static void *cu_host(cu_fix *f, size_t bytes)
{
    void *p = calloc(bytes ? bytes : 1, 1);
    if (!p) fail_msg("cannot allocate %zu host bytes", bytes);
    cu_track(f, p, CU_HOST);
    return p;
}
static float *cu_hf(cu_fix *f, int64_t n) { return cu_host(f, sizeof(float) * (size_t)n); }
static double *cu_hd(cu_fix *f, int64_t n) { return cu_host(f, sizeof(double) * (size_t)n); }
static int32_t *cu_hi(cu_fix *f, int64_t n) { return cu_host(f, sizeof(int32_t) * (size_t)n); }

static float *cu_rand(cu_fix *f, tu_rng *r, int64_t n, float lo, float hi)
{
    float *p = cu_hf(f, n);
    tu_fill_uniform(r, p, n, lo, hi);
    return p;
}

/* |v| in [0.1, 1], random sign: divisors, and B operands times infinity */
static float *cu_rand_away(cu_fix *f, tu_rng *r, int64_t n)
{
    float *p = cu_hf(f, n);
    tu_fill_away_from_zero(r, p, n);
    return p;
}

static int32_t *cu_rand_idx(cu_fix *f, tu_rng *r, int64_t n, int64_t limit)
{
    int32_t *p = cu_hi(f, n);
    for (int64_t i = 0; i < n; i++) p[i] = (int32_t)(tu_next(r) % (uint64_t)limit);
    return p;
}

static float *cu_abs(cu_fix *f, const float *x, int64_t n)
{
    float *p = cu_hf(f, n);
    for (int64_t i = 0; i < n; i++) p[i] = fabsf(x[i]);
    return p;
}

static void *cu_gpu_alloc(cu_fix *f, size_t bytes)
{
    void *p = f->G->alloc(f->gb, bytes ? bytes : 1);
    if (!p) fail_msg("cuda alloc(%zu) returned NULL", bytes);
    cu_track(f, p, CU_GPU_MEM);
    return p;
}

/* One buffer on each backend.  The CPU backend is host visible: c is a
 * host pointer the checks read directly. */
typedef struct cu_buf {
    void *c, *g;
    size_t bytes;
} cu_buf;

#define CF(b) ((float *)(b).c)
#define CI(b) ((int32_t *)(b).c)

/* upload the same bytes to both (host NULL: 0xFF bytes, NaN as f32 and -1
 * as i32, for outputs the op must write) */
static void cu_set(cu_fix *f, cu_buf b, const void *host)
{
    const void *src = host;
    if (!host) {
        void *junk = cu_host(f, b.bytes);
        memset(junk, 0xFF, b.bytes);
        src = junk;
    }
    f->C->to_device(f->cb, b.c, src, b.bytes);
    f->G->to_device(f->gb, b.g, src, b.bytes);
}

static cu_buf cu_put(cu_fix *f, const void *host, size_t bytes)
{
    cu_buf b = {NULL, NULL, bytes};
    b.c = f->C->alloc(f->cb, bytes ? bytes : 1);
    if (!b.c) fail_msg("cpu alloc(%zu) returned NULL", bytes);
    cu_track(f, b.c, CU_CPU_MEM);
    b.g = cu_gpu_alloc(f, bytes);
    cu_set(f, b, host);
    return b;
}
static cu_buf cu_putf(cu_fix *f, const float *host, int64_t n)
{
    return cu_put(f, host, sizeof(float) * (size_t)n);
}
static cu_buf cu_puti(cu_fix *f, const int32_t *host, int64_t n)
{
    return cu_put(f, host, sizeof(int32_t) * (size_t)n);
}
static cu_buf cu_junk(cu_fix *f, int64_t n) { return cu_put(f, NULL, 4 * (size_t)n); }

/* Wait for the CUDA instance, then fail the test if it reports a fault
 * (backend.h, "faults": sticky, found at a sync at the latest).  Called
 * wherever a CUDA result reaches the host, before it is trusted. */
static int cu_fault_text(cu_fix *f, const char *where, char *msg, size_t len)
{
    f->G->sync(f->gb);
    if (!f->G->fault) return 0;
    char err[256] = "";
    dt_status s = f->G->fault(f->gb, err, sizeof err);
    if (s == DT_OK) return 0;
    f->fault_failed = 1;
    snprintf(msg, len, "cuda backend fault (found at %s): %s (%s)", where,
             err[0] ? err : "no message", dt_strerror(s));
    return 1;
}
static void cu_check_fault(cu_fix *f, const char *where)
{
    char msg[400];
    if (cu_fault_text(f, where, msg, sizeof msg)) fail_msg("%s", msg);
}

/* the CUDA buffer's bytes, after sync, in new host memory (first filled
 * with 0xA5, which no check expects, so a to_host that copies nothing
 * shows) */
static void *cu_fetch_ptr(cu_fix *f, const void *dev, size_t bytes)
{
    void *h = cu_host(f, bytes);
    memset(h, 0xA5, bytes);
    f->G->sync(f->gb);
    f->G->to_host(f->gb, h, dev, bytes);
    cu_check_fault(f, "a read-back");
    return h;
}

/* bytes copies of `byte` into CUDA memory */
static void cu_gpu_fill(cu_fix *f, void *dev, size_t bytes, int byte)
{
    void *h = cu_host(f, bytes);
    memset(h, byte, bytes);
    f->G->to_device(f->gb, dev, h, bytes);
}

/* The two outputs of a "twice, bit-identical" check start different (0xFF:
 * NaN / -1; 0x7F: 3.39e38 / 2139062143), so a kernel that writes nothing,
 * or not all of its output, fails the comparison. */
static void cu_gpu_pair(cu_fix *f, void *run1, void *run2, size_t bytes)
{
    cu_gpu_fill(f, run1, bytes, 0xFF);
    cu_gpu_fill(f, run2, bytes, 0x7F);
}
static void *cu_fetch(cu_fix *f, cu_buf b) { return cu_fetch_ptr(f, b.g, b.bytes); }

/* BOTH(fn, args...) runs f->C->fn(cb, args...) then f->G->fn(gb, args...);
 * in the arguments, P(buf) is the buffer on the backend being called. */
#define CU_BE(s) ((s) ? f->G : f->C)
#define CU_INST(s) ((s) ? f->gb : f->cb)
#define BOTH(fn, ...)                                                         \
    do {                                                                      \
        for (int cu_side_ = 0; cu_side_ < 2; cu_side_++)                      \
            CU_BE(cu_side_)->fn(CU_INST(cu_side_), __VA_ARGS__);              \
    } while (0)
#define BOTH_RET(out, fn, ...)                                                \
    do {                                                                      \
        for (int cu_side_ = 0; cu_side_ < 2; cu_side_++)                      \
            (out)[cu_side_] = CU_BE(cu_side_)->fn(CU_INST(cu_side_), __VA_ARGS__); \
    } while (0)
#define P(b) (cu_side_ ? (b).g : (b).c)

/* "(5,7,9)" */
static const char *cu_dims(char *buf, size_t len, int nd, const int64_t *v)
{
    size_t k = 0;
    buf[0] = '\0';
    for (int i = 0; i < nd && k + 24 < len; i++)
        k += (size_t)snprintf(buf + k, len - k, "%s%lld", i ? "," : "(", (long long)v[i]);
    snprintf(buf + k, len - k, ")");
    return buf;
}

/* ---------------------------------------------------------------------------
 * 4. Comparisons.  Each names the op and its arguments, prints the first
 *    mismatches (index, CPU value, CUDA value), then fails.
 * ------------------------------------------------------------------------- */
static int cu_differs(float want, float got, double tol)
{
    if (isnan(want) || isnan(got)) return !(isnan(want) && isnan(got));
    if (want == got) return 0;
    if (isinf(want) || isinf(got)) return 1;
    return !(fabs((double)got - (double)want) <= tol);
}

/* want: the reference (CPU unless said), got: CUDA; scale NULL: |want| */
static void cu_compare(const char *what, const char *ref, const float *want, const float *got,
                       const double *scale, int64_t n, double rtol, double atol)
{
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < n; i++) {
        double s = scale ? scale[i] : fabs((double)want[i]);
        double tol = atol + rtol * (isfinite(s) ? s : 0.0);
        if (!cu_differs(want[i], got[i], tol)) continue;
        if (bad < 8)
            print_error("%s[%lld]: %s %.9g, cuda %.9g (|diff| %.3g, allowed %.3g)\n", what,
                        (long long)i, ref, (double)want[i], (double)got[i],
                        fabs((double)got[i] - (double)want[i]), tol);
        if (first < 0) first = i;
        bad++;
    }
    if (bad)
        fail_msg("%s: %lld of %lld values differ (rtol %g, atol %g); first [%lld]: %s %.9g, "
                 "cuda %.9g",
                 what, (long long)bad, (long long)n, rtol, atol, (long long)first, ref,
                 (double)want[first], (double)got[first]);
}

/* CUDA buffer b against the CPU buffer, tolerance t relative to |cpu| */
static __attribute__((format(printf, 5, 6))) void
cu_expect(cu_fix *f, cu_buf b, int64_t n, cu_tol t, const char *fmt, ...)
{
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    cu_compare(what, "cpu", CF(b), cu_fetch(f, b), NULL, n, t.rtol, t.atol);
}

/* the same, tolerance rtol * scale[i] + atol */
static __attribute__((format(printf, 7, 8))) void
cu_expect_scaled(cu_fix *f, cu_buf b, int64_t n, const double *scale, double rtol, double atol,
                 const char *fmt, ...)
{
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    cu_compare(what, "cpu", CF(b), cu_fetch(f, b), scale, n, rtol, atol);
}

enum { CU_F32 = 0, CU_I32, CU_U8 };

/* bit-identical elements (f32 bits, i32, or bytes), NaN payloads included */
static __attribute__((format(printf, 5, 6))) void
cu_expect_same(cu_fix *f, cu_buf b, int64_t n, int kind, const char *fmt, ...)
{
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    const unsigned char *got = cu_fetch(f, b), *want = b.c;
    size_t es = kind == CU_U8 ? 1 : 4;
    int64_t bad = 0, first = -1;
    char line[160];
    for (int64_t i = 0; i < n; i++) {
        if (memcmp(want + (size_t)i * es, got + (size_t)i * es, es) == 0) continue;
        if (kind == CU_U8) {
            snprintf(line, sizeof line, "cpu %u, cuda %u", want[i], got[i]);
        } else {
            uint32_t w, g;
            memcpy(&w, want + (size_t)i * 4, 4);
            memcpy(&g, got + (size_t)i * 4, 4);
            if (kind == CU_I32)
                snprintf(line, sizeof line, "cpu %d, cuda %d", (int)(int32_t)w, (int)(int32_t)g);
            else {
                float wf, gf;
                memcpy(&wf, &w, 4);
                memcpy(&gf, &g, 4);
                snprintf(line, sizeof line, "cpu %.9g (0x%08x), cuda %.9g (0x%08x)", (double)wf,
                         (unsigned)w, (double)gf, (unsigned)g);
            }
        }
        if (bad < 8) print_error("%s[%lld]: %s\n", what, (long long)i, line);
        if (first < 0) first = i;
        bad++;
    }
    if (bad)
        fail_msg("%s: %lld of %lld elements not bit-identical; first [%lld]", what,
                 (long long)bad, (long long)n, (long long)first);
}

/* a value returned to the host (a status, a count, an index), after the
 * fault check: a faulted backend returns -1, "all labels valid" */
static __attribute__((format(printf, 4, 5))) void cu_expect_int(cu_fix *f, int64_t cpu,
                                                                int64_t cuda, const char *fmt,
                                                                ...)
{
    cu_check_fault(f, "a value returned to the host");
    if (cpu == cuda) return;
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    fail_msg("%s: cpu %lld, cuda %lld", what, (long long)cpu, (long long)cuda);
}

/* two CUDA runs of one op must agree bit for bit */
static __attribute__((format(printf, 5, 6))) void
cu_expect_repeat(cu_fix *f, const void *dev1, const void *dev2, size_t bytes, const char *fmt,
                 ...)
{
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    const float *a = cu_fetch_ptr(f, dev1, bytes), *b = cu_fetch_ptr(f, dev2, bytes);
    for (size_t i = 0; i < bytes / 4; i++)
        if (memcmp(&a[i], &b[i], 4) != 0)
            fail_msg("%s: run 1 and run 2 differ at [%zu]: %.9g vs %.9g", what, i, (double)a[i],
                     (double)b[i]);
}

/* ---------------------------------------------------------------------------
 * 5. GEMM: gemm (all four ta/tb, odd sizes, leading dimensions larger than
 *    the rows) and gemm_batched (strided batches, a shared B).  Padding
 *    between rows and gaps between batches are NaN in A, B and C: a kernel
 *    that reads A's or B's turns the result into NaN, one that writes C's
 *    replaces the NaN.  beta 0 starts C as NaN too: C must not be read.
 * ------------------------------------------------------------------------- */
typedef struct cu_gemm {
    int64_t batch;
    int ta, tb;
    int64_t m, n, k;
    float alpha, beta;
    int shared_b;    /* stride_b 0 */
    int batched;     /* call gemm_batched (else gemm, batch 1) */
    int aligned;     /* no padding: leading dimensions and strides as dense
                      * (multiples of 4 here), so the CUDA backend's direct
                      * TF32 path (tf32_direct_ok) is taken */
    /* made by cu_gemm_make: host operands and their layout */
    float *a, *b, *c;
    int64_t na, nb, nc, lda, ldb, ldc, sa, sb, sc;
} cu_gemm;

static float cu_opa(const float *a, int ta, int64_t lda, int64_t i, int64_t p)
{
    return ta ? a[p * lda + i] : a[i * lda + p];
}
static float cu_opb(const float *b, int tb, int64_t ldb, int64_t p, int64_t j)
{
    return tb ? b[j * ldb + p] : b[p * ldb + j];
}

/* count blocks of rows x cols values, leading dimension ld, block q at
 * q * stride; everything else NaN.  values NULL: the blocks are NaN too. */
static float *cu_blocks(cu_fix *f, tu_rng *r, int64_t count, int64_t rows, int64_t cols,
                        int64_t ld, int64_t stride, int64_t *len, int nan_values)
{
    int64_t n = (count - 1) * stride + rows * ld;
    float *h = cu_hf(f, n);
    for (int64_t i = 0; i < n; i++) h[i] = NAN;
    for (int64_t q = 0; q < count; q++)
        for (int64_t i = 0; i < rows; i++)
            for (int64_t j = 0; j < cols; j++)
                h[q * stride + i * ld + j] = nan_values ? NAN : tu_uniform(r, -1.0f, 1.0f);
    *len = n;
    return h;
}

static void cu_gemm_make(cu_fix *f, tu_rng *r, cu_gemm *s)
{
    int64_t ar = s->ta ? s->k : s->m, ac = s->ta ? s->m : s->k;
    int64_t br = s->tb ? s->n : s->k, bc = s->tb ? s->k : s->n;
    int pad = !s->aligned;
    s->lda = ac + 3 * pad;
    s->ldb = bc + 2 * pad;
    s->ldc = s->n + 5 * pad;
    s->sa = ar * s->lda + 7 * pad;
    s->sb = s->shared_b ? 0 : br * s->ldb + 5 * pad;
    s->sc = s->m * s->ldc + 3 * pad;
    s->a = cu_blocks(f, r, s->batch, ar, ac, s->lda, s->sa, &s->na, 0);
    s->b = cu_blocks(f, r, s->shared_b ? 1 : s->batch, br, bc, s->ldb, s->sb, &s->nb, 0);
    s->c = cu_blocks(f, r, s->batch, s->m, s->n, s->ldc, s->sc, &s->nc, s->beta == 0.0f);
}

/* per element of C: |alpha| sum |op(A)||op(B)| + |beta||C0| (exact NULL), or
 * into exact the signed sum alpha op(A) op(B) + beta C0 (in double: exact
 * for the grid operands); 0 for the padding. */
static void cu_gemm_ref(const cu_gemm *s, const float *a, const float *b, double *mag,
                        float *exact)
{
    for (int64_t q = 0; q < s->batch; q++) {
        const float *aq = a + q * s->sa, *bq = b + q * s->sb, *cq = s->c + q * s->sc;
        for (int64_t i = 0; i < s->m; i++)
            for (int64_t j = 0; j < s->n; j++) {
                double sm = 0, sv = 0;
                for (int64_t p = 0; p < s->k; p++) {
                    double t = (double)cu_opa(aq, s->ta, s->lda, i, p) *
                               (double)cu_opb(bq, s->tb, s->ldb, p, j);
                    sm += fabs(t);
                    sv += t;
                }
                int64_t o = q * s->sc + i * s->ldc + j;
                double c0 = s->beta != 0.0f ? (double)cq[i * s->ldc + j] : 0.0;
                mag[o] = fabs((double)s->alpha) * sm + fabs((double)s->beta * c0);
                if (exact) exact[o] = (float)((double)s->alpha * sv + (double)s->beta * c0);
            }
    }
}

static const char *cu_gemm_desc(char *buf, size_t len, const char *op, const cu_gemm *s)
{
    snprintf(buf, len, "%s ta=%d tb=%d m=%lld n=%lld k=%lld batch=%lld%s alpha=%g beta=%g", op,
             s->ta, s->tb, (long long)s->m, (long long)s->n, (long long)s->k,
             (long long)s->batch, s->shared_b ? " stride_b=0" : "", (double)s->alpha,
             (double)s->beta);
    return buf;
}

static void cu_run_gemm(cu_fix *f, tu_rng *r, cu_gemm s)
{
    cu_gemm_make(f, r, &s);
    double *mag = cu_hd(f, s.nc);
    cu_gemm_ref(&s, s.a, s.b, mag, NULL);
    cu_buf a = cu_putf(f, s.a, s.na), b = cu_putf(f, s.b, s.nb), c = cu_putf(f, s.c, s.nc);
    if (s.batched)
        BOTH(gemm_batched, s.batch, s.ta, s.tb, s.m, s.n, s.k, s.alpha, P(a), s.lda, s.sa, P(b),
             s.ldb, s.sb, s.beta, P(c), s.ldc, s.sc);
    else
        BOTH(gemm, s.ta, s.tb, s.m, s.n, s.k, s.alpha, P(a), s.lda, P(b), s.ldb, s.beta, P(c),
             s.ldc);
    char d[200];
    cu_expect_scaled(f, c, s.nc, mag, GEMM_RTOL * sqrt((double)s.k), 0.0, "%s",
                     cu_gemm_desc(d, sizeof d, s.batched ? "gemm_batched" : "gemm", &s));
}

static void test_cuda_gemm(void **state)
{
    CU_START(f);
    tu_rng r = {0x6E33};
    static const int64_t sizes[][3] = {{37, 53, 29}, {1, 53, 29}, {37, 1, 29}, {64, 64, 64},
                                       {5, 3, 1}};
    static const float betas[] = {0.0f, 1.0f, -0.5f};
    for (int z = 0; z < TU_ARRAY_LEN(sizes); z++)
        for (int t = 0; t < 4; t++)
            for (int bi = 0; bi < TU_ARRAY_LEN(betas); bi++) {
                cu_gemm s = {.batch = 1, .ta = t >> 1, .tb = t & 1, .m = sizes[z][0],
                             .n = sizes[z][1], .k = sizes[z][2], .alpha = bi == 2 ? -1.0f : 0.75f,
                             .beta = betas[bi]};
                cu_run_gemm(f, &r, s);
            }
    for (int t = 0; t < 4; t++)
        for (int shared = 0; shared < 2; shared++)
            for (int bi = 0; bi < 2; bi++) {
                cu_gemm s = {.batch = 3, .ta = t >> 1, .tb = t & 1, .m = 13, .n = 17, .k = 29,
                             .alpha = 1.25f, .beta = betas[bi], .shared_b = shared, .batched = 1};
                cu_run_gemm(f, &r, s);
            }
    cu_gemm one = {.batch = 1, .ta = 0, .tb = 1, .m = 7, .n = 9, .k = 11, .alpha = 1.0f,
                   .beta = 0.0f, .batched = 1};
    cu_run_gemm(f, &r, one);
}

/* ---------------------------------------------------------------------------
 * 6. Precision: round_prec bit for bit (against the CPU and against the
 *    rounding defined here), gemm_ex at each precision.
 * ------------------------------------------------------------------------- */
static const char *cu_prec_name(dt_precision p)
{
    return p == DT_PREC_F32 ? "F32" : p == DT_PREC_TF32 ? "TF32" : p == DT_PREC_BF16 ? "BF16"
                                                                                   : "F16";
}

/* x rounded to nearest even at prec, from first principles: `bits`
 * explicit mantissa bits, spacing fixed at 2^(emin - bits) below 2^emin
 * (subnormals), infinity beyond the largest finite value.  In double, a / q
 * is exact (q a power of two) and nearbyint rounds ties to even. */
static float cu_round_ref(dt_precision prec, float x)
{
    if (prec == DT_PREC_F32 || isnan(x) || isinf(x) || x == 0.0f) return x;
    int bits = prec == DT_PREC_BF16 ? 7 : 10;
    int emin = prec == DT_PREC_F16 ? -14 : -126;
    double maxv = prec == DT_PREC_F16 ? 65504.0 : (double)FLT_MAX;
    double a = fabs((double)x);
    int e;
    frexp(a, &e); /* a = m 2^e, m in [0.5, 1): leading bit 2^(e-1) */
    int lead = e - 1 < emin ? emin : e - 1;
    double q = ldexp(1.0, lead - bits);
    double v = nearbyint(a / q) * q;
    if (v > maxv) return x < 0 ? -INFINITY : INFINITY;
    return (float)(x < 0 ? -v : v);
}

static float cu_from_bits(uint32_t u)
{
    float x;
    memcpy(&x, &u, 4);
    return x;
}
static uint32_t cu_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

/* Values that exercise rounding: specials, fp16's edges (65504, the 65520
 * tie that overflows, subnormals down to 2^-24 and their ties, underflow
 * to +-0), f32 subnormals, exact ties of each precision, then random bit
 * patterns (NaNs, infinities and subnormals among them) and random values
 * around fp16's range. */
static float *cu_round_inputs(cu_fix *f, tu_rng *r, int64_t *n_out)
{
    static const float special[] = {
        0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 1.0f, -1.0f, 0.1f, 3.14159265f,
        65504.0f, -65504.0f, 65519.0f, 65519.996f, 65520.0f, -65520.0f, 65536.0f, 1e5f, -1e5f,
        3e38f, FLT_MAX, -FLT_MAX, 0x1p-14f, 0x1.ffcp-15f, 0x1.ffep-15f, 0x1.fffp-15f, 0x1p-24f,
        0x1p-25f, -0x1p-25f, 0x1.000002p-25f, 0x1.8p-24f, 0x1.4p-23f, 0x1.cp-23f, 3e-8f, 6e-8f,
        1e-10f, -1e-10f, FLT_MIN, -FLT_MIN, 1e-40f, -1e-39f, 0x1p-149f, 0x1.002p0f,
        0x1.006p0f, 0x1.01p0f, 0x1.03p0f, 0x1.fffffep0f, -0x1.801p3f, 0x1.fffp127f,
    };
    const int64_t nties = 3 * 512, nrand = 40000;
    int64_t n = TU_ARRAY_LEN(special) + nties + nrand, k = 0;
    float *x = cu_hf(f, n);
    for (int i = 0; i < TU_ARRAY_LEN(special); i++) x[k++] = special[i];
    for (int i = 0; i < 512; i++) {
        uint32_t sign = (uint32_t)(tu_next(r) & 1) << 31, man = (uint32_t)tu_next(r) & 0x7FFFFF;
        uint32_t ex16 = 113 + (uint32_t)(tu_next(r) % 30); /* fp16's normal range */
        uint32_t ex = 1 + (uint32_t)(tu_next(r) % 253);
        /* a tie at 10 bits (TF32, and F16 in its normal range) and at 7 (BF16) */
        x[k++] = cu_from_bits(sign | ex16 << 23 | (man & ~0x1FFFu) | 0x1000u);
        x[k++] = cu_from_bits(sign | ex << 23 | (man & ~0xFFFFu) | 0x8000u);
        /* an fp16 subnormal tie: (2j + 1) 2^-25 */
        x[k++] = (float)ldexp(2.0 * (double)(tu_next(r) % 1024) + 1.0, -25) * (sign ? -1.0f : 1.0f);
    }
    for (int64_t i = 0; i < nrand; i++) {
        if (i & 1) {
            x[k++] = cu_from_bits((uint32_t)tu_next(r));
        } else {
            uint32_t ex = 95 + (uint32_t)(tu_next(r) % 50);
            x[k++] = cu_from_bits((uint32_t)(tu_next(r) & 0x807FFFFFu) | ex << 23);
        }
    }
    *n_out = k;
    return x;
}

/* bit for bit, except that any NaN matches any NaN */
static void cu_compare_rounded(const char *what, const char *ref, const float *want,
                               const float *got, const float *in, int64_t n)
{
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(want[i]) && isnan(got[i])) continue;
        if (cu_bits(want[i]) == cu_bits(got[i])) continue;
        if (bad < 8)
            print_error("%s[%lld]: input %a (0x%08x): %s %a (0x%08x), cuda %a (0x%08x)\n", what,
                        (long long)i, (double)in[i], (unsigned)cu_bits(in[i]), ref,
                        (double)want[i], (unsigned)cu_bits(want[i]), (double)got[i],
                        (unsigned)cu_bits(got[i]));
        if (first < 0) first = i;
        bad++;
    }
    if (bad)
        fail_msg("%s: %lld of %lld values not bit-identical to the %s's; first [%lld]: input %a, "
                 "%s %a, cuda %a",
                 what, (long long)bad, (long long)n, ref, (long long)first, (double)in[first], ref,
                 (double)want[first], (double)got[first]);
}

/* x rounded on the host: the CPU backend's round_prec (what the core uses
 * when gemm_ex is NULL), or the definition above if it has none */
static float *cu_round_host(cu_fix *f, dt_precision prec, const float *x, int64_t n)
{
    float *y = cu_hf(f, n);
    if (prec == DT_PREC_F32)
        memcpy(y, x, sizeof(float) * (size_t)n);
    else if (f->C->round_prec)
        f->C->round_prec(f->cb, prec, n, x, y);
    else
        for (int64_t i = 0; i < n; i++) y[i] = cu_round_ref(prec, x[i]);
    return y;
}

/* gemm_ex against the CPU's gemm_batched on rounded operands */
static void cu_run_gemm_ex(cu_fix *f, tu_rng *r, dt_precision prec, cu_gemm s,
                           void (*edit)(cu_gemm *))
{
    cu_gemm_make(f, r, &s);
    if (edit) edit(&s);
    float *ra = cu_round_host(f, prec, s.a, s.na), *rb = cu_round_host(f, prec, s.b, s.nb);
    double *mag = cu_hd(f, s.nc);
    cu_gemm_ref(&s, ra, rb, mag, NULL);
    cu_buf a = cu_putf(f, s.a, s.na), b = cu_putf(f, s.b, s.nb), c = cu_putf(f, s.c, s.nc);
    f->C->gemm_batched(f->cb, s.batch, s.ta, s.tb, s.m, s.n, s.k, s.alpha, ra, s.lda, s.sa, rb,
                       s.ldb, s.sb, s.beta, CF(c), s.ldc, s.sc);
    f->G->gemm_ex(f->gb, prec, s.batch, s.ta, s.tb, s.m, s.n, s.k, s.alpha, a.g, s.lda, s.sa, b.g,
                  s.ldb, s.sb, s.beta, c.g, s.ldc, s.sc);
    char d[200], op[32];
    snprintf(op, sizeof op, "gemm_ex(%s)", cu_prec_name(prec));
    double rtol = (prec == DT_PREC_F32 ? GEMM_RTOL : GEMMEX_RTOL) * sqrt((double)s.k);
    cu_expect_scaled(f, c, s.nc, mag, rtol, 0.0, "%s", cu_gemm_desc(d, sizeof d, op, &s));
}

/* fp16's range inside a product: 70000 and -1e5 overflow to +-inf (the
 * rows of C become +-inf: B has no zeros), 1e-9 underflows to 0, 3e-6 is
 * subnormal */
static void cu_edit_f16_range(cu_gemm *s)
{
    for (int64_t i = 0; i < s->nb; i++)
        if (!isnan(s->b[i]) && fabsf(s->b[i]) < 0.1f) s->b[i] = s->b[i] < 0 ? -0.1f : 0.1f;
    s->a[0 * s->lda + 0] = 70000.0f;
    s->a[1 * s->lda + 3] = -1e5f;
    s->a[2 * s->lda + 1] = 1e-9f;
    s->a[2 * s->lda + 2] = 3e-6f;
}

/* v / 8 with v a nonzero integer in [-63, 63] (6 bits: exact at every
 * precision), times 1 + d with |d| below half an ulp at prec, so rounding
 * at prec gives v / 8 back: |d| < 2^-12 for 10 mantissa bits, < 2^-10 for
 * bf16's 7 (at least 2^-14 and 2^-12: a finer rounding keeps some of it). */
static float cu_grid_value(tu_rng *r, dt_precision prec, float *exact)
{
    int v = 1 + (int)(tu_next(r) % 63);
    if (tu_next(r) & 1) v = -v;
    double e = v / 8.0;
    double d = tu_uniform(r, 0.25f, 0.9f) * (prec == DT_PREC_BF16 ? 0x1p-10 : 0x1p-12);
    if (tu_next(r) & 1) d = -d;
    *exact = (float)e;
    return (float)(e * (1.0 + d));
}

static void cu_grid_fill(tu_rng *r, dt_precision prec, float *h, float *exact, int64_t count,
                         int64_t rows, int64_t cols, int64_t ld, int64_t stride)
{
    for (int64_t q = 0; q < count; q++)
        for (int64_t i = 0; i < rows; i++)
            for (int64_t j = 0; j < cols; j++) {
                int64_t o = q * stride + i * ld + j;
                h[o] = cu_grid_value(r, prec, &exact[o]);
            }
}

/* gemm_ex on grid operands against the exact result: the small padded shape,
 * or (size > 0) size^3 dense, where the CUDA backend may skip packing (TF32
 * read by the tensor cores straight from f32: the grid shows whether they
 * rounded to nearest even).  With k <= 256 every partial sum of grid
 * products (multiples of 1/64 below 2^14) is exact in f32. */
static void cu_run_gemm_ex_grid(cu_fix *f, tu_rng *r, dt_precision prec, int ta, int tb,
                                float beta, int64_t size)
{
    cu_gemm s = {.batch = 2, .ta = ta, .tb = tb, .m = 13, .n = 11, .k = 29, .alpha = 1.0f,
                 .beta = beta, .batched = 1};
    if (size > 0) {
        s.batch = 1;
        s.m = s.n = s.k = size;
        s.aligned = 1;
    }
    cu_gemm_make(f, r, &s);
    float *ea = cu_hf(f, s.na), *eb = cu_hf(f, s.nb);
    cu_grid_fill(r, prec, s.a, ea, s.batch, ta ? s.k : s.m, ta ? s.m : s.k, s.lda, s.sa);
    cu_grid_fill(r, prec, s.b, eb, s.batch, tb ? s.n : s.k, tb ? s.k : s.n, s.ldb, s.sb);
    if (beta != 0.0f) /* C: integers / 64, exact */
        for (int64_t q = 0; q < s.batch; q++)
            for (int64_t i = 0; i < s.m; i++)
                for (int64_t j = 0; j < s.n; j++)
                    s.c[q * s.sc + i * s.ldc + j] =
                        (float)((int)(tu_next(r) % 201) - 100) / 64.0f;
    float *want = cu_hf(f, s.nc);
    memcpy(want, s.c, sizeof(float) * (size_t)s.nc); /* padding: untouched */
    double *mag = cu_hd(f, s.nc);
    cu_gemm_ref(&s, ea, eb, mag, want);
    cu_buf a = cu_putf(f, s.a, s.na), b = cu_putf(f, s.b, s.nb), c = cu_putf(f, s.c, s.nc);
    f->G->gemm_ex(f->gb, prec, s.batch, s.ta, s.tb, s.m, s.n, s.k, s.alpha, a.g, s.lda, s.sa, b.g,
                  s.ldb, s.sb, s.beta, c.g, s.ldc, s.sc);
    char d[200], op[48];
    snprintf(op, sizeof op, "gemm_ex(%s) on the grid", cu_prec_name(prec));
    cu_compare(cu_gemm_desc(d, sizeof d, op, &s), "exact", want, cu_fetch(f, c), mag, s.nc,
               GEMMEX_GRID_RTOL, 0.0);
}

static void test_cuda_precision(void **state)
{
    CU_START(f);
    tu_rng r = {0xB16};
    static const dt_precision precs[] = {DT_PREC_F32, DT_PREC_TF32, DT_PREC_BF16, DT_PREC_F16};
    if (!f->G->round_prec) fail_msg("cuda backend has no round_prec (a required entry)");
    if (!f->C->round_prec)
        print_message("cuda: the cpu backend has no round_prec; round_prec and gemm_ex are checked "
                      "against the rounding defined in this test only\n");

    /* round_prec: bit-identical to the CPU and to the definition; in place too */
    int64_t n;
    float *in = cu_round_inputs(f, &r, &n);
    for (int pi = 0; pi < TU_ARRAY_LEN(precs); pi++) {
        dt_precision p = precs[pi];
        char what[64];
        float *ref = cu_hf(f, n);
        for (int64_t i = 0; i < n; i++) ref[i] = cu_round_ref(p, in[i]);
        cu_buf x = cu_putf(f, in, n), y = cu_junk(f, n);
        if (f->C->round_prec) f->C->round_prec(f->cb, p, n, CF(x), CF(y));
        f->G->round_prec(f->gb, p, n, x.g, y.g);
        float *got = cu_fetch(f, y);
        snprintf(what, sizeof what, "round_prec(%s)", cu_prec_name(p));
        if (f->C->round_prec) cu_compare_rounded(what, "cpu", CF(y), got, in, n);
        cu_compare_rounded(what, "definition", ref, got, in, n);
        f->G->round_prec(f->gb, p, n, x.g, x.g);
        snprintf(what, sizeof what, "round_prec(%s) in place", cu_prec_name(p));
        cu_compare_rounded(what, "definition", ref, cu_fetch(f, x), in, n);
    }

    if (!f->G->gemm_ex) {
        print_message("cuda: gemm_ex is NULL (optional: the core rounds with round_prec and "
                      "calls gemm); not checked\n");
        return;
    }
    for (int pi = 0; pi < TU_ARRAY_LEN(precs); pi++) {
        for (int t = 0; t < 4; t++) {
            cu_gemm s = {.batch = 1, .ta = t >> 1, .tb = t & 1, .m = 37, .n = 53, .k = 29,
                         .alpha = 0.75f, .beta = t == 3 ? 1.0f : 0.0f, .batched = 1};
            cu_run_gemm_ex(f, &r, precs[pi], s, NULL);
        }
        cu_gemm bs = {.batch = 3, .ta = 0, .tb = 1, .m = 13, .n = 17, .k = 29, .alpha = 1.0f,
                      .beta = 0.5f, .shared_b = 1, .batched = 1};
        cu_run_gemm_ex(f, &r, precs[pi], bs, NULL);
        bs.shared_b = 0;
        bs.ta = 1;
        bs.beta = 0.0f;
        cu_run_gemm_ex(f, &r, precs[pi], bs, NULL);
        if (precs[pi] == DT_PREC_F32) continue;
        cu_run_gemm_ex_grid(f, &r, precs[pi], 0, 0, 0.0f, 0);
        cu_run_gemm_ex_grid(f, &r, precs[pi], 1, 0, 1.0f, 0);
        cu_run_gemm_ex_grid(f, &r, precs[pi], 0, 1, 1.0f, 0);
        cu_run_gemm_ex_grid(f, &r, precs[pi], 1, 1, 0.0f, 0);
        cu_run_gemm_ex_grid(f, &r, precs[pi], 0, 0, 0.0f, 256);
        cu_run_gemm_ex_grid(f, &r, precs[pi], 1, 1, 1.0f, 256);
    }
    cu_gemm range = {.batch = 1, .m = 3, .n = 4, .k = 5, .alpha = 1.0f, .beta = 0.0f,
                     .batched = 1};
    cu_run_gemm_ex(f, &r, DT_PREC_F16, range, cu_edit_f16_range);
}

/* ---------------------------------------------------------------------------
 * 7. Elementwise and strided: fill, axpby, unary (+ backward), binary with
 *    broadcasting, copy_strided
 * ------------------------------------------------------------------------- */
static const char *const cu_unary_names[] = {"relu", "gelu", "tanh", "sigmoid", "gelu_tanh",
                                             "exp", "log", "sqrt"};
static const char *const cu_binary_names[] = {"add", "sub", "mul", "div", "keep", "drop", "pow"};

static void cu_binary_case(cu_fix *f, tu_rng *r, int ndim, const int64_t *shape,
                           const int64_t *as, int64_t na, const int64_t *bs, int64_t nb)
{
    int64_t n = tu_numel(ndim, shape);
    float *ha = cu_rand(f, r, na, -2.0f, 2.0f), *hb = cu_rand_away(f, r, nb);
    cu_buf a = cu_putf(f, ha, na), b = cu_putf(f, hb, nb);
    char s0[64], s1[64], s2[64];
    float *hm = cu_rand(f, r, nb, 0, 1);   /* keep/drop: a 0/1 mask */
    for (int64_t i = 0; i < nb; i++) hm[i] = hm[i] < 0.5f ? 0.0f : 1.0f;
    cu_buf m = cu_putf(f, hm, nb);
    for (int op = 0; op < 7; op++) {
        cu_buf out = cu_junk(f, n);
        int masked = op == DT_BIN_KEEP || op == DT_BIN_DROP;
        BOTH(binary, (dt_binary_op)op, ndim, shape, P(a), as, masked ? P(m) : P(b), bs, P(out));
        cu_expect(f, out, n, op == DT_BIN_DIV ? TOL_ARITH : op == DT_BIN_POW ? TOL_TRANSC : TOL_EXACT,
                  "binary(%s) shape %s a_strides %s b_strides %s", cu_binary_names[op],
                  cu_dims(s0, sizeof s0, ndim, shape), cu_dims(s1, sizeof s1, ndim, as),
                  cu_dims(s2, sizeof s2, ndim, bs));
    }
}

static void test_cuda_elementwise(void **state)
{
    CU_START(f);
    tu_rng r = {0xE1E};
    const int64_t n = 100003;

    /* fill, -0.0 kept */
    cu_buf y = cu_junk(f, n);
    BOTH(fill, n, 3.25f, P(y));
    cu_expect_same(f, y, n, CU_F32, "fill(3.25) n=%lld", (long long)n);
    BOTH(fill, 7, -0.0f, P(y));
    cu_expect_same(f, y, n, CU_F32, "fill(-0.0) n=7 over fill(3.25)");

    /* axpby; beta 0 must not read y (NaN there) */
    {
        float *hx = cu_rand(f, &r, n, -1, 1), *hy = cu_rand(f, &r, n, -1, 1);
        static const float ab[][2] = {{0.5f, 0.0f}, {1.5f, 1.0f}, {-0.75f, 0.25f}, {1.0f, -1.0f}};
        cu_buf x = cu_putf(f, hx, n);
        for (int i = 0; i < TU_ARRAY_LEN(ab); i++) {
            cu_buf yy = ab[i][1] == 0.0f ? cu_junk(f, n) : cu_putf(f, hy, n);
            BOTH(axpby, n, ab[i][0], P(x), ab[i][1], P(yy));
            cu_expect(f, yy, n, TOL_ARITH, "axpby alpha=%g beta=%g", (double)ab[i][0],
                      (double)ab[i][1]);
        }
    }

    /* unary and unary_backward, accumulate 0 and 1 */
    for (int op = 0; op < 8; op++) {
        int positive = op == DT_UNARY_LOG || op == DT_UNARY_SQRT;
        float *hx = positive ? cu_rand(f, &r, n, 0.01f, 6) : cu_rand(f, &r, n, -6, 6);
        if (op == DT_UNARY_RELU) { /* NaN propagates, as torch.relu (backends/cpu.c) */
            hx[0] = NAN;
            hx[1] = INFINITY;
            hx[2] = -INFINITY;
            hx[3] = 0.0f;
            hx[4] = -0.0f;
            hx[5] = 1e-40f;
        }
        cu_buf x = cu_putf(f, hx, n), yo = cu_junk(f, n);
        BOTH(unary, (dt_unary_op)op, n, P(x), P(yo));
        cu_expect(f, yo, n, op == DT_UNARY_RELU ? TOL_EXACT : TOL_TRANSC, "unary(%s) n=%lld",
                  cu_unary_names[op], (long long)n);
        /* both differentiate at the CPU's y */
        cu_buf yc = cu_putf(f, CF(yo), n), dy = cu_putf(f, cu_rand(f, &r, n, -1, 1), n);
        float *dx0 = cu_rand(f, &r, n, -1, 1);
        cu_tol bt = op == DT_UNARY_RELU ? TOL_EXACT
                    : op == DT_UNARY_GELU || op == DT_UNARY_GELU_TANH ? TOL_TRANSC : TOL_ARITH;
        for (int acc = 0; acc < 2; acc++) {
            cu_buf dx = acc ? cu_putf(f, dx0, n) : cu_junk(f, n);
            BOTH(unary_backward, (dt_unary_op)op, n, P(x), P(yc), P(dy), P(dx), acc);
            cu_expect(f, dx, n, bt, "unary_backward(%s) accumulate=%d", cu_unary_names[op], acc);
        }
    }

    /* binary: a transposed view of a (6,5,4,3) buffer op b (1,4,1,6) broadcast */
    {
        static const int64_t shape[4] = {3, 4, 5, 6}, as[4] = {1, 3, 12, 60}, bs[4] = {0, 6, 0, 1};
        cu_binary_case(f, &r, 4, shape, as, 360, bs, 24);
        /* a long contiguous run op a scalar, and a scalar op a run */
        static const int64_t s1[1] = {1}, s0[1] = {0};
        int64_t shp[1] = {n};
        cu_binary_case(f, &r, 1, shp, s1, n, s0, 1);
        cu_binary_case(f, &r, 1, shp, s0, 1, s1, n);
        /* 6 dims: a (2,1,2,4,1,3) broadcast on two dims, b stored dims reversed */
        static const int64_t shape6[6] = {2, 3, 2, 4, 2, 3}, as6[6] = {24, 0, 12, 3, 0, 1},
                             bs6[6] = {1, 2, 6, 12, 48, 96};
        cu_binary_case(f, &r, 6, shape6, as6, 48, bs6, 288);
    }

    /* copy_strided */
    {
        char s0[64];
        /* transpose (37,53) -> (53,37): f32 bit patterns (NaNs kept bit for bit), bytes */
        static const int64_t tshape[2] = {37, 53}, src_st[2] = {53, 1}, dst_st[2] = {1, 37};
        const int64_t nt = 37 * 53;
        uint32_t *bits = cu_host(f, 4 * (size_t)nt);
        for (int64_t i = 0; i < nt; i++) bits[i] = (uint32_t)tu_next(&r);
        cu_buf src = cu_put(f, bits, 4 * (size_t)nt), dst = cu_junk(f, nt);
        BOTH(copy_strided, 2, tshape, 4, P(dst), dst_st, P(src), src_st, 0);
        cu_expect_same(f, dst, nt, CU_F32, "copy_strided transpose (37,53) elem_bytes=4");
        uint8_t *bytes = cu_host(f, (size_t)nt);
        for (int64_t i = 0; i < nt; i++) bytes[i] = (uint8_t)tu_next(&r);
        cu_buf src8 = cu_put(f, bytes, (size_t)nt), dst8 = cu_put(f, NULL, (size_t)nt);
        BOTH(copy_strided, 2, tshape, 1, P(dst8), dst_st, P(src8), src_st, 0);
        cu_expect_same(f, dst8, nt, CU_U8, "copy_strided transpose (37,53) elem_bytes=1");
        /* bytes (5,6,7) -> (7,5,6) */
        static const int64_t pshape[3] = {5, 6, 7}, psrc[3] = {42, 7, 1}, pdst[3] = {6, 1, 30};
        cu_buf p8 = cu_put(f, NULL, 210);
        BOTH(copy_strided, 3, pshape, 1, P(p8), pdst, P(src8), psrc, 0);
        cu_expect_same(f, p8, 210, CU_U8, "copy_strided permute %s -> (7,5,6) elem_bytes=1",
                       cu_dims(s0, sizeof s0, 3, pshape));
        /* accumulate: dst (53,37) += transpose of src */
        float *hs = cu_rand(f, &r, nt, -1, 1), *hd = cu_rand(f, &r, nt, -1, 1);
        cu_buf fs = cu_putf(f, hs, nt), fd = cu_putf(f, hd, nt);
        BOTH(copy_strided, 2, tshape, 4, P(fd), dst_st, P(fs), src_st, 1);
        cu_expect(f, fd, nt, TOL_EXACT, "copy_strided transpose (37,53) accumulate=1");
        /* a broadcast source (stride 0) into rows 2..8 of a (10,9) buffer */
        static const int64_t bshape[2] = {7, 9}, bsrc[2] = {1, 0}, bdst[2] = {9, 1};
        cu_buf bd = cu_putf(f, cu_rand(f, &r, 90, -1, 1), 90);
        BOTH(copy_strided, 2, bshape, 4, (float *)P(bd) + 18, bdst, P(fs), bsrc, 0);
        cu_expect(f, bd, 90, TOL_EXACT, "copy_strided broadcast (7)->(7,9) at row 2 of (10,9)");
    }
}

/* ---------------------------------------------------------------------------
 * 8. Reductions: sum_to, reduce_axis (sum, max), sum, sumsq, bias_grad.
 *    Sizes around the CPU's 4096-element blocks and far beyond any one
 *    CUDA block.
 * ------------------------------------------------------------------------- */

/* src (shape, contiguous) summed into dst[dst_st] (dst_len floats,
 * contiguous in its kept dims) */
static void cu_sum_to_case(cu_fix *f, tu_rng *r, int ndim, const int64_t *shape,
                           const int64_t *dst_st, int64_t dst_len, int acc)
{
    int64_t n = tu_numel(ndim, shape), idx[DT_MAX_DIMS] = {0};
    float *hs = cu_rand(f, r, n, -1, 1), *hd = cu_rand(f, r, dst_len, -1, 1);
    double *mag = cu_hd(f, dst_len);
    for (int64_t lin = 0; lin < n; lin++) {
        int64_t off = 0;
        for (int d = 0; d < ndim; d++) off += idx[d] * dst_st[d];
        mag[off] += fabs((double)hs[lin]);
        for (int d = ndim - 1; d >= 0 && ++idx[d] == shape[d]; d--) idx[d] = 0;
    }
    if (acc)
        for (int64_t o = 0; o < dst_len; o++) mag[o] += fabs((double)hd[o]);
    cu_buf s = cu_putf(f, hs, n), d = acc ? cu_putf(f, hd, dst_len) : cu_junk(f, dst_len);
    BOTH(sum_to, ndim, shape, P(s), P(d), dst_st, acc);
    char s0[64], s1[64];
    cu_expect_scaled(
        f, d, dst_len, mag, RED_RTOL, 0.0, "sum_to shape %s dst_strides %s accumulate=%d",
        cu_dims(s0, sizeof s0, ndim, shape), cu_dims(s1, sizeof s1, ndim, dst_st), acc);
}

static void cu_bias_grad_case(cu_fix *f, tu_rng *r, int64_t n, int64_t c, int64_t inner, int acc)
{
    int64_t total = n * c * inner;
    float *hy = cu_rand(f, r, total, -1, 1), *h0 = cu_rand(f, r, c, -1, 1);
    double *mag = cu_hd(f, c);
    for (int64_t i = 0; i < total; i++) mag[(i / inner) % c] += fabs((double)hy[i]);
    if (acc)
        for (int64_t j = 0; j < c; j++) mag[j] += fabs((double)h0[j]);
    cu_buf dy = cu_putf(f, hy, total), db = acc ? cu_putf(f, h0, c) : cu_junk(f, c);
    BOTH(bias_grad, n, c, inner, P(dy), P(db), acc);
    cu_expect_scaled(f, db, c, mag, RED_RTOL, 0.0,
                     "bias_grad n=%lld c=%lld inner=%lld accumulate=%d", (long long)n, (long long)c,
                     (long long)inner, acc);
}

static void test_cuda_reductions(void **state)
{
    CU_START(f);
    tu_rng r = {0x5E1};

    for (int acc = 0; acc < 2; acc++) {
        static const int64_t shp[3] = {5, 7, 9};
        static const int64_t d0[3] = {0, 1, 0}, d1[3] = {9, 0, 1}, d2[3] = {0, 0, 0},
                             d3[3] = {63, 9, 1}, d4[3] = {0, 9, 1};
        cu_sum_to_case(f, &r, 3, shp, d0, 7, acc);
        cu_sum_to_case(f, &r, 3, shp, d1, 45, acc);
        cu_sum_to_case(f, &r, 3, shp, d2, 1, acc);
        cu_sum_to_case(f, &r, 3, shp, d3, 315, acc);
        cu_sum_to_case(f, &r, 3, shp, d4, 63, acc);
        static const int64_t rows[2] = {3, 100003}, rows_st[2] = {1, 0};
        static const int64_t cols[2] = {100003, 3}, cols_st[2] = {0, 1};
        cu_sum_to_case(f, &r, 2, rows, rows_st, 3, acc);
        cu_sum_to_case(f, &r, 2, cols, cols_st, 3, acc);
    }

    /* reduce_axis over the middle of (outer, len, inner) */
    static const int64_t ax[][3] = {{7, 33, 1}, {7, 33, 5}, {3, 5000, 2}, {1, 100003, 1},
                                    {2, 1, 9}, {300, 7, 3}};
    for (int i = 0; i < TU_ARRAY_LEN(ax); i++) {
        int64_t outer = ax[i][0], len = ax[i][1], inner = ax[i][2], nx = outer * len * inner;
        float *hx = cu_rand(f, &r, nx, -1, 1);
        double *mag = cu_hd(f, outer * inner);
        for (int64_t j = 0; j < nx; j++)
            mag[(j / (len * inner)) * inner + j % inner] += fabs((double)hx[j]);
        cu_buf x = cu_putf(f, hx, nx);
        cu_buf ys = cu_junk(f, outer * inner), ym = cu_junk(f, outer * inner);
        BOTH(reduce_axis, DT_RED_SUM, outer, len, inner, P(x), P(ys));
        BOTH(reduce_axis, DT_RED_MAX, outer, len, inner, P(x), P(ym));
        cu_expect_scaled(f, ys, outer * inner, mag, RED_RTOL, 0.0,
                         "reduce_axis(sum) outer=%lld len=%lld inner=%lld", (long long)outer,
                         (long long)len, (long long)inner);
        cu_expect(f, ym, outer * inner, TOL_EXACT,
                  "reduce_axis(max) outer=%lld len=%lld inner=%lld", (long long)outer,
                  (long long)len, (long long)inner);
    }

    /* sum (a device scalar) and sumsq (to the host) */
    static const int64_t sizes[] = {1, 7, 1023, 4095, 4096, 4097, 65537, 100003, (1 << 20) + 12345};
    for (int i = 0; i < TU_ARRAY_LEN(sizes); i++) {
        int64_t n = sizes[i];
        float *hx = cu_rand(f, &r, n, -1, 1);
        double mag = 0, ss[2];
        for (int64_t j = 0; j < n; j++) mag += fabs((double)hx[j]);
        cu_buf x = cu_putf(f, hx, n), s = cu_junk(f, 1);
        BOTH(sum, n, P(x), P(s));
        cu_expect_scaled(f, s, 1, &mag, RED_RTOL, 0.0, "sum n=%lld", (long long)n);
        BOTH_RET(ss, sumsq, n, P(x));
        cu_check_fault(f, "sumsq");
        if (!(fabs(ss[1] - ss[0]) <= RED_RTOL * ss[0]))
            fail_msg("sumsq n=%lld: cpu %.17g, cuda %.17g", (long long)n, ss[0], ss[1]);
    }

    for (int acc = 0; acc < 2; acc++) {
        cu_bias_grad_case(f, &r, 5, 7, 9, acc);
        cu_bias_grad_case(f, &r, 64, 10, 1, acc);
        cu_bias_grad_case(f, &r, 3, 4, 1000, acc);
        cu_bias_grad_case(f, &r, 1000, 3, 37, acc);
    }
}

/* ---------------------------------------------------------------------------
 * 9. Softmax (rows and an inner axis), cross entropy, count_correct
 * ------------------------------------------------------------------------- */
static void cu_softmax_case(cu_fix *f, tu_rng *r, int64_t outer, int64_t len, int64_t inner,
                            int is_log)
{
    int64_t nx = outer * len * inner;
    const char *name = is_log ? "log_softmax" : "softmax";
    float *hx = cu_rand(f, r, nx, -8, 8);
    cu_buf x = cu_putf(f, hx, nx), y = cu_junk(f, nx);
    BOTH(softmax, outer, len, inner, P(x), P(y), is_log);
    if (is_log) { /* x - (max + log sum): relative to the terms, |x| + |y| */
        double *sc = cu_hd(f, nx);
        for (int64_t i = 0; i < nx; i++) sc[i] = fabs((double)hx[i]) + fabs((double)CF(y)[i]);
        cu_expect_scaled(f, y, nx, sc, TOL_TRANSC.rtol, TOL_TRANSC.atol,
                         "%s forward outer=%lld len=%lld inner=%lld", name, (long long)outer,
                         (long long)len, (long long)inner);
    } else {
        cu_expect(f, y, nx, TOL_TRANSC, "%s forward outer=%lld len=%lld inner=%lld", name,
                  (long long)outer, (long long)len, (long long)inner);
    }
    /* backward from the CPU's y; the scale is each term's magnitude:
     * log: |dy| + exp(y) sum|dy|; softmax: |y| (|dy| + sum|dy y|) */
    const float *yc = CF(y);
    cu_buf yb = cu_putf(f, yc, nx);
    float *hdy = cu_rand(f, r, nx, -1, 1), *h0 = cu_rand(f, r, nx, -1, 1);
    cu_buf dy = cu_putf(f, hdy, nx);
    double *sc = cu_hd(f, nx);
    for (int64_t o = 0; o < outer; o++)
        for (int64_t i = 0; i < inner; i++) {
            int64_t base = o * len * inner + i;
            double s = 0;
            for (int64_t l = 0; l < len; l++) {
                int64_t q = base + l * inner;
                s += is_log ? fabs((double)hdy[q]) : fabs((double)hdy[q] * (double)yc[q]);
            }
            for (int64_t l = 0; l < len; l++) {
                int64_t q = base + l * inner;
                sc[q] = is_log ? fabs((double)hdy[q]) + exp((double)yc[q]) * s
                               : fabs((double)yc[q]) * (fabs((double)hdy[q]) + s);
            }
        }
    for (int acc = 0; acc < 2; acc++) {
        double *sa = sc;
        if (acc) {
            sa = cu_hd(f, nx);
            for (int64_t i = 0; i < nx; i++) sa[i] = sc[i] + fabs((double)h0[i]);
        }
        cu_buf dx = acc ? cu_putf(f, h0, nx) : cu_junk(f, nx);
        BOTH(softmax_backward, outer, len, inner, P(yb), P(dy), P(dx), is_log, acc);
        cu_expect_scaled(f, dx, nx, sa, TOL_TRANSC.rtol, TOL_TRANSC.atol,
                         "%s backward outer=%lld len=%lld inner=%lld accumulate=%d", name,
                         (long long)outer, (long long)len, (long long)inner, acc);
    }
}

static void cu_xent_case(cu_fix *f, tu_rng *r, int64_t n, int64_t c)
{
    float *hl = cu_rand(f, r, n * c, -4, 4);
    int32_t *lab = cu_rand_idx(f, r, n, c);
    cu_buf lg = cu_putf(f, hl, n * c), lb = cu_puti(f, lab, n);
    cu_buf pr = cu_junk(f, 2 * n), loss = cu_junk(f, 1);   /* each row's max and 1/sum */
    int64_t ret[2];
    BOTH_RET(ret, xent_forward, n, c, P(lg), P(lb), DT_XENT_KEEP_ALL, n, P(pr), P(loss));
    if (ret[0] != -1) fail_msg("xent_forward n=%lld c=%lld: cpu returned %lld for valid labels",
                               (long long)n, (long long)c, (long long)ret[0]);
    cu_expect_int(f, ret[0], ret[1], "xent_forward n=%lld c=%lld return (valid labels)",
                  (long long)n, (long long)c);
    cu_expect(f, pr, 2 * n, TOL_TRANSC, "xent_forward n=%lld c=%lld rows (max, 1/sum)", (long long)n,
              (long long)c);
    cu_expect(f, loss, 1, TOL_TRANSC, "xent_forward n=%lld c=%lld loss", (long long)n,
              (long long)c);

    /* backward from the CPU's rows, dloss a device scalar */
    cu_buf pb = cu_putf(f, CF(pr), 2 * n);
    float *h0 = cu_rand(f, r, n * c, -1, 1);
    static const float dls[2] = {1.0f, 0.7f};
    for (int acc = 0; acc < 2; acc++) {
        cu_buf dl = cu_putf(f, &dls[acc], 1);
        cu_buf dx = acc ? cu_putf(f, h0, n * c) : cu_junk(f, n * c);
        BOTH(xent_backward, n, c, P(lg), P(pb), P(lb), DT_XENT_KEEP_ALL, n, P(dl), P(dx), acc);
        cu_expect(f, dx, n * c, TOL_ARITH, "xent_backward n=%lld c=%lld dloss=%g accumulate=%d",
                  (long long)n, (long long)c, (double)dls[acc], acc);
    }

    /* out-of-range labels: the first bad index, whatever follows */
    static const struct { int64_t at, value, at2, value2; } bad[] = {
        {5, 0, 9, -1}, {0, -1, 1, 0}, {-1, 0, -1, 0}, {3, -7, 12, 1000000}};
    for (int i = 0; i < TU_ARRAY_LEN(bad); i++) {
        int32_t *l2 = cu_hi(f, n);
        memcpy(l2, lab, sizeof(int32_t) * (size_t)n);
        int64_t first = bad[i].at < 0 ? n - 1 : bad[i].at;
        l2[first] = (int32_t)(bad[i].value ? bad[i].value : c);
        if (bad[i].at2 >= 0 && bad[i].at2 < n)
            l2[bad[i].at2] = (int32_t)(bad[i].value2 ? bad[i].value2 : c);
        cu_buf lb2 = cu_puti(f, l2, n), pr2 = cu_junk(f, 2 * n), loss2 = cu_junk(f, 1);
        BOTH_RET(ret, xent_forward, n, c, P(lg), P(lb2), DT_XENT_KEEP_ALL, n, P(pr2), P(loss2));
        if (ret[0] != first)
            fail_msg("xent_forward: cpu returned %lld, label %lld is the first bad",
                     (long long)ret[0], (long long)first);
        cu_expect_int(f, ret[0], ret[1], "xent_forward n=%lld c=%lld return (label[%lld] = %d)",
                      (long long)n, (long long)c, (long long)first, (int)l2[first]);
    }
    /* an ignored label (-100, outside the range) on every third row */
    int32_t *li = cu_hi(f, n);
    int64_t kept = 0;
    for (int64_t i = 0; i < n; i++) {
        li[i] = i % 3 == 1 ? -100 : lab[i];
        kept += li[i] != -100;
    }
    cu_buf lbi = cu_puti(f, li, n), pri = cu_junk(f, 2 * n), lossi = cu_junk(f, 1);
    BOTH_RET(ret, xent_forward, n, c, P(lg), P(lbi), -100, kept, P(pri), P(lossi));
    assert_int_equal(ret[0], -1);
    cu_expect_int(f, ret[0], ret[1], "xent_forward ignore -100 return");
    cu_expect(f, lossi, 1, TOL_TRANSC, "xent_forward n=%lld c=%lld ignore -100 loss", (long long)n,
              (long long)c);
    cu_buf pbi = cu_putf(f, CF(pri), 2 * n);
    for (int acc = 0; acc < 2; acc++) {
        cu_buf dl = cu_putf(f, &dls[acc], 1);
        cu_buf dx = acc ? cu_putf(f, h0, n * c) : cu_junk(f, n * c);
        BOTH(xent_backward, n, c, P(lg), P(pbi), P(lbi), -100, kept, P(dl), P(dx), acc);
        cu_expect(f, dx, n * c, TOL_ARITH, "xent_backward ignore -100 accumulate=%d", acc);
    }
}

static void test_cuda_softmax_xent(void **state)
{
    CU_START(f);
    tu_rng r = {0x50F7};
    static const int64_t cases[][3] = {{7, 33, 1}, {7, 33, 5}, {3, 1000, 1}, {2, 1000, 3},
                                       {5, 1, 4}};
    for (int i = 0; i < TU_ARRAY_LEN(cases); i++)
        for (int lg = 0; lg < 2; lg++)
            cu_softmax_case(f, &r, cases[i][0], cases[i][1], cases[i][2], lg);
    cu_xent_case(f, &r, 17, 11);
    cu_xent_case(f, &r, 64, 1000);
    cu_xent_case(f, &r, 2000, 3);

    /* count_correct: first maximum on ties */
    const int64_t n = 300, c = 10;
    float *hl = cu_rand(f, &r, n * c, -1, 1);
    int32_t *lab = cu_rand_idx(f, &r, n, c);
    for (int64_t i = 0; i < 20; i++) { /* all equal: argmax 0 */
        for (int64_t j = 0; j < c; j++) hl[i * c + j] = 0.5f;
        lab[i] = (int32_t)(i % 2 ? 0 : 1 + i % 9);
    }
    for (int64_t i = 20; i < 40; i++) { /* the max at 3 and 7: argmax 3 */
        hl[i * c + 3] = hl[i * c + 7] = 2.0f;
        lab[i] = i % 2 ? 3 : 7;
    }
    for (int64_t i = 40; i < 150; i++) { /* hits among the random rows */
        int64_t best = 0;
        for (int64_t j = 1; j < c; j++)
            if (hl[i * c + j] > hl[i * c + best]) best = j;
        lab[i] = (int32_t)best;
    }
    cu_buf lg = cu_putf(f, hl, n * c), lb = cu_puti(f, lab, n);
    int64_t hits[2];
    BOTH_RET(hits, count_correct, n, c, P(lg), P(lb));
    cu_expect_int(f, hits[0], hits[1], "count_correct n=%lld c=%lld", (long long)n, (long long)c);
}

/* ---------------------------------------------------------------------------
 * 10. Convolution helpers, fused convolution (if the CUDA backend has it),
 *     pooling
 * ------------------------------------------------------------------------- */
static dt_conv_geom cu_geom(int64_t n, int64_t c, int64_t h, int64_t w, int64_t k, int64_t s,
                            int64_t p)
{
    dt_conv_geom g = {.n = n, .c = c, .h = h, .w = w, .kh = k, .kw = k, .stride = s, .pad = p,
                      .oh = (h + 2 * p - k) / s + 1, .ow = (w + 2 * p - k) / s + 1};
    return g;
}

static const char *cu_geom_desc(char *buf, size_t len, const dt_conv_geom *g)
{
    snprintf(buf, len, "x (%lld,%lld,%lld,%lld) k=%lld stride=%lld pad=%lld", (long long)g->n,
             (long long)g->c, (long long)g->h, (long long)g->w, (long long)g->kh,
             (long long)g->stride, (long long)g->pad);
    return buf;
}

static double *cu_to_double(cu_fix *f, const float *x, int64_t n, const float *plus)
{
    double *d = cu_hd(f, n);
    for (int64_t i = 0; i < n; i++) d[i] = (double)x[i] + (plus ? fabs((double)plus[i]) : 0.0);
    return d;
}

static void cu_conv_case(cu_fix *f, tu_rng *r, const dt_conv_geom *g, int64_t o)
{
    char gd[128];
    cu_geom_desc(gd, sizeof gd, g);
    int64_t nx = g->n * g->c * g->h * g->w, nw = o * g->c * g->kh * g->kw;
    int64_t ny = g->n * o * g->oh * g->ow;
    int64_t ckk = g->c * g->kh * g->kw, okk = o * g->kh * g->kw, npix = g->n * g->oh * g->ow;
    float *hx = cu_rand(f, r, nx, -1, 1), *hw = cu_rand(f, r, nw, -1, 1),
          *hb = cu_rand(f, r, o, -1, 1);
    float *ax = cu_abs(f, hx, nx), *aw = cu_abs(f, hw, nw), *ab = cu_abs(f, hb, o);
    cu_buf x = cu_putf(f, hx, nx), w = cu_putf(f, hw, nw), b = cu_putf(f, hb, o);
    dt_status st[2];
    for (int with_b = 0; with_b < 2; with_b++) {
        float *m = cu_hf(f, ny); /* magnitudes: the CPU's conv of |x|, |w|, |b| */
        if (f->C->conv2d_forward(f->cb, g, o, ax, aw, with_b ? ab : NULL, m) != DT_OK)
            fail_msg("cpu conv2d_forward failed");
        cu_buf y = cu_junk(f, ny);
        BOTH_RET(st, conv2d_forward, g, o, P(x), P(w), with_b ? P(b) : NULL, P(y));
        cu_expect_int(f, st[0], st[1], "conv2d_forward %s o=%lld status", gd, (long long)o);
        cu_expect_scaled(f, y, ny, cu_to_double(f, m, ny, NULL), GEMM_RTOL * sqrt((double)ckk), 0.0,
                         "conv2d_forward %s o=%lld bias=%d", gd, (long long)o, with_b);
    }
    if (!f->G->conv2d_backward) return;
    float *hdy = cu_rand(f, r, ny, -1, 1), *ady = cu_abs(f, hdy, ny);
    float *mx = cu_hf(f, nx), *mw = cu_hf(f, nw), *mb = cu_hf(f, o);
    if (f->C->conv2d_backward(f->cb, g, o, ax, aw, ady, mx, 0, mw, 0, mb, 0) != DT_OK)
        fail_msg("cpu conv2d_backward failed");
    cu_buf dy = cu_putf(f, hdy, ny);
    float *x0 = cu_rand(f, r, nx, -1, 1), *w0 = cu_rand(f, r, nw, -1, 1),
          *b0 = cu_rand(f, r, o, -1, 1);
    /* which outputs are wanted (0 none, 1 written, 2 accumulated) */
    static const int modes[][3] = {{1, 1, 1}, {2, 2, 2}, {0, 1, 0}, {1, 0, 2}, {0, 0, 1}};
    for (int i = 0; i < TU_ARRAY_LEN(modes); i++) {
        int mdx = modes[i][0], mdw = modes[i][1], mdb = modes[i][2];
        cu_buf dx = mdx == 2 ? cu_putf(f, x0, nx) : cu_junk(f, nx);
        cu_buf dw = mdw == 2 ? cu_putf(f, w0, nw) : cu_junk(f, nw);
        cu_buf db = mdb == 2 ? cu_putf(f, b0, o) : cu_junk(f, o);
        BOTH_RET(st, conv2d_backward, g, o, P(x), P(w), P(dy), mdx ? P(dx) : NULL, mdx == 2,
                 mdw ? P(dw) : NULL, mdw == 2, mdb ? P(db) : NULL, mdb == 2);
        cu_expect_int(f, st[0], st[1], "conv2d_backward %s o=%lld status", gd, (long long)o);
        if (mdx)
            cu_expect_scaled(f, dx, nx, cu_to_double(f, mx, nx, mdx == 2 ? x0 : NULL),
                             GEMM_RTOL * sqrt((double)okk), 0.0,
                             "conv2d_backward dx %s o=%lld acc_dx=%d", gd, (long long)o, mdx == 2);
        if (mdw)
            cu_expect_scaled(f, dw, nw, cu_to_double(f, mw, nw, mdw == 2 ? w0 : NULL),
                             GEMM_RTOL * sqrt((double)npix), 0.0,
                             "conv2d_backward dw %s o=%lld acc_dw=%d", gd, (long long)o, mdw == 2);
        if (mdb)
            cu_expect_scaled(f, db, o, cu_to_double(f, mb, o, mdb == 2 ? b0 : NULL), RED_RTOL, 0.0,
                             "conv2d_backward db %s o=%lld acc_db=%d", gd, (long long)o, mdb == 2);
        /* outputs not wanted stay untouched */
        if (!mdx) cu_expect_same(f, dx, nx, CU_F32, "conv2d_backward: dx (NULL) buffer");
    }
}

/* x with many exact ties: post-relu zeros and multiples of 1/4 */
static float *cu_ties(cu_fix *f, tu_rng *r, int64_t n)
{
    float *x = cu_hf(f, n);
    for (int64_t i = 0; i < n; i++)
        x[i] = tu_uniform(r, 0, 1) < 0.6f ? 0.0f : (float)(1 + (int)(tu_next(r) % 4)) / 4.0f;
    return x;
}

static void cu_pool_case(cu_fix *f, tu_rng *r, const dt_conv_geom *g, int ties)
{
    char gd[128];
    cu_geom_desc(gd, sizeof gd, g);
    int64_t nx = g->n * g->c * g->h * g->w, ny = g->n * g->c * g->oh * g->ow;
    float *hx;
    if (ties) {
        hx = cu_ties(f, r, nx);
    } else {
        hx = cu_hf(f, nx);
        tu_fill_distinct(r, hx, nx, 0.01f);
    }
    cu_buf x = cu_putf(f, hx, nx), y = cu_junk(f, ny), am = cu_junk(f, ny);
    BOTH(maxpool_forward, g, P(x), P(y), P(am));
    cu_expect(f, y, ny, TOL_EXACT, "maxpool_forward %s%s", gd, ties ? " (ties)" : "");
    cu_expect_same(f, am, ny, CU_I32, "maxpool_forward argmax %s%s", gd,
                   ties ? " (ties: first max)" : "");
    cu_buf amc = cu_puti(f, CI(am), ny), dy = cu_putf(f, cu_rand(f, r, ny, -1, 1), ny);
    float *x0 = cu_rand(f, r, nx, -1, 1);
    /* The backward passes and the average are sums (of the dy of every
     * window an input is the max of / lies in; of a window's x), added in
     * an order of each backend's own and cancelling to near zero at times:
     * compared as sums, relative to the same computation on magnitudes
     * (the CPU's, on |dy| and |x|). */
    float *ady = cu_abs(f, CF(dy), ny);
    float *mmax = cu_hf(f, nx), *mavg = cu_hf(f, ny), *mavgb = cu_hf(f, nx);
    f->C->maxpool_backward(f->cb, g, ady, CI(amc), mmax, 0);
    f->C->avgpool_forward(f->cb, g, cu_abs(f, hx, nx), mavg);
    f->C->avgpool_backward(f->cb, g, ady, mavgb, 0);
    for (int acc = 0; acc < 2; acc++) {
        cu_buf dx = acc ? cu_putf(f, x0, nx) : cu_junk(f, nx);
        BOTH(maxpool_backward, g, P(dy), P(amc), P(dx), acc);
        cu_expect_scaled(f, dx, nx, cu_to_double(f, mmax, nx, acc ? x0 : NULL), RED_RTOL, 0.0,
                         "maxpool_backward %s accumulate=%d", gd, acc);
    }
    cu_buf ya = cu_junk(f, ny);
    BOTH(avgpool_forward, g, P(x), P(ya));
    cu_expect_scaled(f, ya, ny, cu_to_double(f, mavg, ny, NULL), RED_RTOL, 0.0,
                     "avgpool_forward %s", gd);
    for (int acc = 0; acc < 2; acc++) {
        cu_buf dx = acc ? cu_putf(f, x0, nx) : cu_junk(f, nx);
        BOTH(avgpool_backward, g, P(dy), P(dx), acc);
        cu_expect_scaled(f, dx, nx, cu_to_double(f, mavgb, nx, acc ? x0 : NULL), RED_RTOL, 0.0,
                         "avgpool_backward %s accumulate=%d", gd, acc);
    }
}

static void test_cuda_conv_pool(void **state)
{
    CU_START(f);
    tu_rng r = {0xC0117};
    const dt_conv_geom geoms[] = {cu_geom(2, 3, 9, 8, 3, 2, 1), cu_geom(2, 3, 7, 7, 3, 1, 1),
                                  cu_geom(3, 2, 6, 5, 2, 2, 0), cu_geom(2, 5, 4, 6, 1, 1, 0),
                                  cu_geom(1, 2, 11, 10, 5, 2, 2)};
    for (int i = 0; i < TU_ARRAY_LEN(geoms); i++) {
        const dt_conv_geom *g = &geoms[i];
        char gd[128];
        cu_geom_desc(gd, sizeof gd, g);
        int64_t nx = g->n * g->c * g->h * g->w, ckk = g->c * g->kh * g->kw;
        int64_t ncol = ckk * g->n * g->oh * g->ow;
        cu_buf x = cu_putf(f, cu_rand(f, &r, nx, -1, 1), nx), col = cu_junk(f, ncol);
        BOTH(im2col, g, P(x), P(col));
        cu_expect(f, col, ncol, TOL_EXACT, "im2col %s", gd);
        cu_buf colr = cu_putf(f, cu_rand(f, &r, ncol, -1, 1), ncol);
        float *x0 = cu_rand(f, &r, nx, -1, 1);
        /* each dx sums up to KH*KW column entries in an order of its own:
         * relative to their magnitudes (the CPU's fold of |col|), as sums */
        float *mcol = cu_hf(f, nx);
        f->C->col2im(f->cb, g, cu_abs(f, CF(colr), ncol), mcol, 0);
        for (int acc = 0; acc < 2; acc++) {
            cu_buf dx = acc ? cu_putf(f, x0, nx) : cu_junk(f, nx);
            BOTH(col2im, g, P(colr), P(dx), acc);
            cu_expect_scaled(f, dx, nx, cu_to_double(f, mcol, nx, acc ? x0 : NULL), RED_RTOL, 0.0,
                             "col2im %s accumulate=%d", gd, acc);
        }
    }

    /* bias_add: y (N, C, inner) += bias (C), one add */
    static const int64_t ba[][3] = {{5, 7, 1}, {3, 4, 35}, {2, 1, 5}};
    for (int i = 0; i < TU_ARRAY_LEN(ba); i++) {
        int64_t n = ba[i][0], c = ba[i][1], inner = ba[i][2];
        cu_buf b = cu_putf(f, cu_rand(f, &r, c, -1, 1), c);
        cu_buf y = cu_putf(f, cu_rand(f, &r, n * c * inner, -1, 1), n * c * inner);
        BOTH(bias_add, n, c, inner, P(b), P(y));
        cu_expect(f, y, n * c * inner, TOL_EXACT, "bias_add n=%lld c=%lld inner=%lld", (long long)n,
                  (long long)c, (long long)inner);
    }

    /* (C, N*P) <-> (N, C, P) */
    {
        const int64_t c = 5, n = 3, p = 7, t = c * n * p;
        cu_buf src = cu_putf(f, cu_rand(f, &r, t, -1, 1), t), d1 = cu_junk(f, t),
               d2 = cu_junk(f, t);
        BOTH(cnp_to_ncp, c, n, p, P(src), P(d1));
        cu_expect(f, d1, t, TOL_EXACT, "cnp_to_ncp c=%lld n=%lld p=%lld", (long long)c,
                  (long long)n, (long long)p);
        BOTH(ncp_to_cnp, n, c, p, P(src), P(d2));
        cu_expect(f, d2, t, TOL_EXACT, "ncp_to_cnp n=%lld c=%lld p=%lld", (long long)n,
                  (long long)c, (long long)p);
    }

    if (f->G->conv2d_forward) {
        for (int i = 0; i < TU_ARRAY_LEN(geoms); i++) cu_conv_case(f, &r, &geoms[i], 4);
    } else {
        print_message("cuda: conv2d_forward is NULL (optional: the core composes im2col + gemm); "
                      "not checked\n");
        if (f->G->conv2d_backward)
            fail_msg("cuda backend has conv2d_backward but no conv2d_forward");
    }

    const dt_conv_geom pools[] = {cu_geom(2, 3, 9, 8, 3, 2, 1), cu_geom(2, 3, 8, 6, 2, 2, 0),
                                  cu_geom(1, 2, 7, 7, 3, 1, 1), cu_geom(2, 2, 9, 7, 2, 2, 1)};
    for (int i = 0; i < TU_ARRAY_LEN(pools); i++) cu_pool_case(f, &r, &pools[i], 0);
    cu_pool_case(f, &r, &pools[2], 1);
    cu_pool_case(f, &r, &pools[1], 1);
}

/* ---------------------------------------------------------------------------
 * 11. Embedding (repeated indices), index_check, layer norm (with and
 *     without w/b), dropout (masks bit for bit)
 * ------------------------------------------------------------------------- */
static void cu_embedding_case(cu_fix *f, tu_rng *r, int64_t vocab, int64_t d, int64_t n)
{
    int32_t *idx = cu_rand_idx(f, r, n, vocab);
    idx[0] = idx[1] = idx[n - 1] = (int32_t)(vocab - 1);
    cu_buf w = cu_putf(f, cu_rand(f, r, vocab * d, -1, 1), vocab * d), ix = cu_puti(f, idx, n);
    cu_buf y = cu_junk(f, n * d);
    BOTH(embedding_forward, n, d, P(w), P(ix), P(y));
    cu_expect(f, y, n * d, TOL_EXACT, "embedding_forward vocab=%lld d=%lld n=%lld",
              (long long)vocab, (long long)d, (long long)n);
    /* dweight[idx[i]] += dy[i] "for i in order": the same float adds */
    cu_buf dy = cu_putf(f, cu_rand(f, r, n * d, -1, 1), n * d);
    cu_buf dw = cu_putf(f, cu_rand(f, r, vocab * d, -1, 1), vocab * d);
    BOTH(embedding_backward, n, d, P(ix), P(dy), P(dw));
    cu_expect(f, dw, vocab * d, TOL_EXACT, "embedding_backward vocab=%lld d=%lld n=%lld (in order)",
              (long long)vocab, (long long)d, (long long)n);
}

static void cu_index_check_case(cu_fix *f, tu_rng *r, int64_t n, int64_t limit, int64_t bad1,
                                int32_t v1, int64_t bad2, int32_t v2)
{
    int32_t *idx = cu_rand_idx(f, r, n, limit);
    if (bad1 >= 0) idx[bad1] = v1;
    if (bad2 >= 0) idx[bad2] = v2;
    cu_buf ix = cu_puti(f, idx, n);
    int64_t res[2];
    BOTH_RET(res, index_check, n, P(ix), limit);
    int64_t want = bad1 >= 0 ? bad1 : -1;
    if (res[0] != want) fail_msg("index_check: cpu returned %lld, expected %lld", (long long)res[0],
                                 (long long)want);
    cu_expect_int(f, res[0], res[1], "index_check n=%lld limit=%lld bad at %lld (%d) and %lld (%d)",
                  (long long)n, (long long)limit, (long long)bad1, (int)v1, (long long)bad2,
                  (int)v2);
}

/* Magnitudes of layernorm_backward's sums over rows, for cu_expect_scaled:
 * dw[j] (+)= sum of dy x^ and db[j] (+)= sum of dy, with x^ = (x - mean)
 * rstd from the given (CPU's) mean and rstd, plus |w0|, |b0| (NULL: 0),
 * the values they are added to.  A GPU sums the rows in f32 in an order of
 * its own: its error is relative to these, not to a result that may cancel
 * to near zero. */
static void cu_ln_grad_mag(cu_fix *f, int64_t rows, int64_t d, const float *x, const float *mean,
                           const float *rstd, const float *dy, const float *w0, const float *b0,
                           double **mdw, double **mdb)
{
    double *mw = cu_hd(f, d), *mb = cu_hd(f, d);
    for (int64_t j = 0; j < d; j++) {
        mw[j] = w0 ? fabs((double)w0[j]) : 0.0;
        mb[j] = b0 ? fabs((double)b0[j]) : 0.0;
    }
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < d; j++) {
            double xh = ((double)x[i * d + j] - (double)mean[i]) * (double)rstd[i];
            mw[j] += fabs((double)dy[i * d + j] * xh);
            mb[j] += fabs((double)dy[i * d + j]);
        }
    *mdw = mw;
    *mdb = mb;
}

static void cu_layernorm_case(cu_fix *f, tu_rng *r, int64_t rows, int64_t d, int affine)
{
    int64_t nx = rows * d;
    float *hx = cu_rand(f, r, nx, -2, 2);
    for (int64_t i = 0; i < rows; i++) {
        float off = tu_uniform(r, -1, 1);
        for (int64_t j = 0; j < d; j++) hx[i * d + j] += off;
    }
    cu_buf x = cu_putf(f, hx, nx), w = cu_putf(f, cu_rand(f, r, d, 0.5f, 1.5f), d);
    cu_buf b = cu_putf(f, cu_rand(f, r, d, -0.5f, 0.5f), d);
    cu_buf y = cu_junk(f, nx), mean = cu_junk(f, rows), rstd = cu_junk(f, rows);
    const float eps = 1e-5f;
    BOTH(layernorm_forward, rows, d, P(x), affine ? P(w) : NULL, affine ? P(b) : NULL, eps, P(y),
         P(mean), P(rstd));
    cu_expect(f, y, nx, TOL_NORM, "layernorm_forward rows=%lld d=%lld affine=%d y", (long long)rows,
              (long long)d, affine);
    cu_expect(f, mean, rows, TOL_NORM, "layernorm_forward rows=%lld d=%lld affine=%d mean",
              (long long)rows, (long long)d, affine);
    cu_expect(f, rstd, rows, TOL_NORM, "layernorm_forward rows=%lld d=%lld affine=%d rstd",
              (long long)rows, (long long)d, affine);
    /* backward from the CPU's mean and rstd; dw, db always add */
    cu_buf mc = cu_putf(f, CF(mean), rows), rc = cu_putf(f, CF(rstd), rows);
    cu_buf dy = cu_putf(f, cu_rand(f, r, nx, -1, 1), nx);
    float *x0 = cu_rand(f, r, nx, -1, 1), *w0 = cu_rand(f, r, d, -1, 1),
          *b0 = cu_rand(f, r, d, -1, 1);
    double *mdw, *mdb;
    cu_ln_grad_mag(f, rows, d, hx, CF(mc), CF(rc), CF(dy), w0, b0, &mdw, &mdb);
    for (int acc = 0; acc < 2; acc++) {
        cu_buf dx = acc ? cu_putf(f, x0, nx) : cu_junk(f, nx);
        cu_buf dw = cu_putf(f, w0, d), db = cu_putf(f, b0, d);
        BOTH(layernorm_backward, rows, d, P(x), affine ? P(w) : NULL, P(mc), P(rc), P(dy), P(dx),
             affine ? P(dw) : NULL, affine ? P(db) : NULL, acc);
        cu_expect(f, dx, nx, TOL_NORM,
                  "layernorm_backward rows=%lld d=%lld affine=%d accumulate=%d dx", (long long)rows,
                  (long long)d, affine, acc);
        if (!affine) continue;
        cu_expect_scaled(f, dw, d, mdw, TOL_NORM.rtol, TOL_NORM.atol,
                         "layernorm_backward rows=%lld d=%lld dw (+=)", (long long)rows,
                         (long long)d);
        cu_expect_scaled(f, db, d, mdb, TOL_NORM.rtol, TOL_NORM.atol,
                         "layernorm_backward rows=%lld d=%lld db (+=)", (long long)rows,
                         (long long)d);
    }
}

/* Attention: each score is a d-term dot product, each output a t-term sum
 * of probabilities (exp of differences) times values, and backward adds
 * two more such sums; cuBLAS and OpenBLAS sum in other orders and the exp
 * differs by a few ulps (TOL_TRANSC): 1e-4 relative, 2e-5 absolute on O(1)
 * values. */
static const cu_tol TOL_ATTN = {1e-4, 2e-5};

static void cu_attention_case(cu_fix *f, tu_rng *r, int64_t bh, int64_t t, int64_t d, int causal,
                              int masked)
{
    int64_t n = bh * t * d;
    cu_buf q = cu_putf(f, cu_rand(f, r, n, -1, 1), n), k = cu_putf(f, cu_rand(f, r, n, -1, 1), n);
    cu_buf v = cu_putf(f, cu_rand(f, r, n, -1, 1), n);
    float *hm = cu_rand(f, r, t * t, -1, 1);
    hm[t + 0] = -INFINITY;   /* query 1 never sees key 0 */
    cu_buf m = cu_putf(f, hm, t * t);
    cu_buf o = cu_junk(f, n), lse = cu_junk(f, bh * t);
    float scale = 1.0f / sqrtf((float)d);
    dt_status st[2];
    BOTH_RET(st, attention_forward, bh, t, d, scale, causal, masked ? P(m) : NULL, P(q), P(k),
             P(v), P(o), P(lse));
    assert_int_equal(st[0], DT_OK);
    assert_int_equal(st[1], DT_OK);
    cu_expect(f, o, n, TOL_ATTN, "attention_forward bh=%lld t=%lld d=%lld causal=%d mask=%d o",
              (long long)bh, (long long)t, (long long)d, causal, masked);
    cu_expect(f, lse, bh * t, TOL_ATTN, "attention_forward t=%lld causal=%d lse", (long long)t,
              causal);
    /* backward from the CPU's o and lse */
    cu_buf oc = cu_putf(f, CF(o), n), lc = cu_putf(f, CF(lse), bh * t);
    cu_buf dout = cu_putf(f, cu_rand(f, r, n, -1, 1), n);
    cu_buf dq = cu_junk(f, n), dk = cu_junk(f, n), dv = cu_junk(f, n);
    BOTH_RET(st, attention_backward, bh, t, d, scale, causal, masked ? P(m) : NULL, P(q), P(k),
             P(v), P(oc), P(lc), P(dout), P(dq), P(dk), P(dv));
    assert_int_equal(st[0], DT_OK);
    assert_int_equal(st[1], DT_OK);
    cu_expect(f, dq, n, TOL_ATTN, "attention_backward t=%lld d=%lld causal=%d dq", (long long)t,
              (long long)d, causal);
    cu_expect(f, dk, n, TOL_ATTN, "attention_backward t=%lld d=%lld causal=%d dk", (long long)t,
              (long long)d, causal);
    cu_expect(f, dv, n, TOL_ATTN, "attention_backward t=%lld d=%lld causal=%d dv", (long long)t,
              (long long)d, causal);
}

static void test_cuda_embedding_layernorm_dropout(void **state)
{
    CU_START(f);
    tu_rng r = {0xE3B};
    cu_embedding_case(f, &r, 11, 37, 50);
    cu_embedding_case(f, &r, 3, 5, 3000);
    cu_embedding_case(f, &r, 1000, 64, 257);

    cu_index_check_case(f, &r, 50, 11, -1, 0, -1, 0);
    cu_index_check_case(f, &r, 50, 11, 13, 11, 20, -1);
    cu_index_check_case(f, &r, 50, 11, 0, -5, 49, 11);
    cu_index_check_case(f, &r, 100003, 1000, 70001, 1000, 99999, -1);
    cu_index_check_case(f, &r, 100003, 1000, 100002, INT32_MIN, -1, 0);
    cu_index_check_case(f, &r, 100003, 1000, -1, 0, -1, 0);

    cu_attention_case(f, &r, 6, 37, 16, 1, 1);
    cu_attention_case(f, &r, 2, 130, 64, 0, 0);
    cu_attention_case(f, &r, 48, 64, 32, 1, 0);
    /* more scores than DT_CUDA_ATTN_CHUNK_BYTES (64 MiB): forward in chunks of
     * 16 heads and 4, backward in 8, 8 and 4 */
    cu_attention_case(f, &r, 20, 1024, 16, 1, 1);

    for (int affine = 0; affine < 2; affine++) {
        cu_layernorm_case(f, &r, 13, 67, affine);
        cu_layernorm_case(f, &r, 4, 1000, affine);
        cu_layernorm_case(f, &r, 300, 8, affine);
    }

    /* dropout: counter-based masks, the same bits on both */
    static const float ps[] = {0.0f, 0.25f, 0.3f, 0.5f, 0.9f};
    static const uint64_t seeds[] = {1, 0x0123456789ABCDEFull};
    const int64_t n = 100003;
    cu_buf x = cu_putf(f, cu_rand(f, &r, n, -1, 1), n);
    for (int i = 0; i < TU_ARRAY_LEN(ps); i++)
        for (int s = 0; s < TU_ARRAY_LEN(seeds); s++) {
            cu_buf y = cu_junk(f, n), m = cu_junk(f, n);
            BOTH(dropout_forward, n, ps[i], seeds[s], P(x), P(y), P(m));
            cu_expect_same(f, m, n, CU_F32, "dropout_forward p=%g seed=0x%llx mask", (double)ps[i],
                           (unsigned long long)seeds[s]);
            cu_expect(f, y, n, TOL_EXACT, "dropout_forward p=%g seed=0x%llx y", (double)ps[i],
                      (unsigned long long)seeds[s]);
        }
}

/* ---------------------------------------------------------------------------
 * 12. Optimizers: 3 steps each, compared after every step, each value
 *     within OPT_RTOL |cpu| + OPT_ULPS M (section 1), the budget M carried
 *     along by cu_opt_* from the CPU's states before and after each step,
 *     following the operations in the order both backends do them
 *     (backends/cpu.c and backends/cuda.cu, "optimizers").
 * ------------------------------------------------------------------------- */
static float *cu_copyf(cu_fix *f, const float *x, int64_t n)
{
    float *p = cu_hf(f, n);
    memcpy(p, x, sizeof(float) * (size_t)n);
    return p;
}

/* |cuda - cpu| <= rtol |cpu| + OPT_ULPS M[i] */
static __attribute__((format(printf, 6, 7))) void
cu_expect_opt(cu_fix *f, cu_buf b, int64_t n, const double *M, double rtol, const char *fmt, ...)
{
    char what[320];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    if (k >= 0 && (size_t)k < sizeof what)
        snprintf(what + k, sizeof what - (size_t)k, " (allowed %g |cpu| + %g M)", rtol, OPT_ULPS);
    const float *want = CF(b);
    double *allowed = cu_hd(f, n);
    for (int64_t i = 0; i < n; i++) allowed[i] = rtol * fabs((double)want[i]) + OPT_ULPS * M[i];
    cu_compare(what, "cpu", want, cu_fetch(f, b), allowed, n, 1.0, 0.0);
}

/* SGD, one step; wp, bp: w and buf before it, w, b: after.
 *   g' = g + wd w
 *   b  = first ? g' : mom b + (1-damp) g'       (no momentum: no b)
 *   s  = nesterov ? g' + mom b : b              (no momentum: g')
 *   w  = w - lr s                                                        */
static void cu_opt_sgd(int64_t n, double *Mw, double *Mb, const float *wp, const float *bp,
                       const float *w, const float *b, const float *g, float lr, float mom,
                       float damp, int nesterov, float wd, int first)
{
    const double keep = 1.0 - (double)damp, dwd = wd, dmom = mom;
    for (int64_t i = 0; i < n; i++) {
        double aw = fabs((double)wp[i]), gi = (double)g[i] + dwd * wp[i];
        double Mg = dwd * Mw[i] + fabs((double)g[i]) + dwd * aw, Ms;
        if (mom == 0.0f) {
            Ms = Mg;
        } else {
            Mb[i] = first ? Mg : dmom * (Mb[i] + fabs((double)bp[i])) + keep * (Mg + fabs(gi));
            Ms = nesterov ? Mg + fabs(gi) + dmom * (Mb[i] + fabs((double)b[i])) : Mb[i];
        }
        Mw[i] += (double)lr * Ms + aw + fabs((double)wp[i] - (double)w[i]);
    }
}

/* Adam / AdamW, one step; wp, mp, vp before it, m, v after.
 *   decay = 1 - lr wd (AdamW) or 1,  l2 = 0 (AdamW) or wd
 *   g' = g + l2 (w decay)
 *   m  = m + (1-b1) (g' - m)
 *   v  = b2 v + (1-b2) g' g'
 *   q  = (lr/bc1) m / (sqrt(v) / sqrt(bc2) + eps)
 *   w  = w decay - q                                                     */
static void cu_opt_adam(int64_t n, double *Mw, double *Mm, double *Mv, const float *wp,
                        const float *mp, const float *vp, const float *m, const float *v,
                        const float *g, float lr, float b1, float b2, float eps, float wd,
                        int decoupled, float bc1, float bc2)
{
    const double decay = decoupled ? 1.0 - (double)lr * wd : 1.0, l2 = decoupled ? 0.0 : wd;
    const double b1c = 1.0 - (double)b1, b2c = 1.0 - (double)b2, db2 = b2;
    const double step = (double)lr / bc1, bcs = sqrt((double)bc2);
    for (int64_t i = 0; i < n; i++) {
        double awd = fabs((double)wp[i]) * decay, gi = (double)g[i] + l2 * wp[i] * decay;
        double Mg = l2 * (decay * Mw[i] + awd) + fabs((double)g[i]) + l2 * awd;
        double d = gi - mp[i], Md = Mg + Mm[i] + fabs(gi) + fabs((double)mp[i]);
        Mm[i] += b1c * Md + fabs((double)mp[i]) + b1c * fabs(d);
        Mv[i] = db2 * (Mv[i] + fabs((double)vp[i])) + b2c * (2.0 * fabs(gi) * Mg + 2.0 * gi * gi);
        double den = sqrt((double)v[i]) / bcs + eps, q = step * m[i] / den;
        double relv = v[i] > 0.0f ? 0.5 * Mv[i] / v[i] : 0.0;
        double Mq = step * Mm[i] / den + fabs(q) * (relv + OPT_QUOT_UNITS);
        /* w decay rounds once more (AdamW; exact for decay 1), then - q */
        Mw[i] = decay * Mw[i] + (decoupled ? 2.0 : 1.0) * awd + Mq + fabs(q);
    }
}

/* AdaGrad, one step; wp, sp before it, s after.
 *   g' = g + wd w;  s = s + g' g';  w = w - lr g' / (sqrt(s) + eps)       */
static void cu_opt_adagrad(int64_t n, double *Mw, double *Ms, const float *wp, const float *sp,
                           const float *s, const float *g, float lr, float eps, float wd)
{
    const double dwd = wd;
    for (int64_t i = 0; i < n; i++) {
        double aw = fabs((double)wp[i]), gi = (double)g[i] + dwd * wp[i];
        double Mg = dwd * Mw[i] + fabs((double)g[i]) + dwd * aw;
        Ms[i] += fabs((double)sp[i]) + 2.0 * gi * gi + 2.0 * fabs(gi) * Mg;
        double den = sqrt((double)s[i]) + eps, q = (double)lr * gi / den;
        double rels = s[i] > 0.0f ? 0.5 * Ms[i] / s[i] : 0.0;
        double Mq = (double)lr * Mg / den + fabs(q) * (rels + OPT_QUOT_UNITS);
        Mw[i] += aw + fabs(q) + Mq;
    }
}

static void test_cuda_optimizers(void **state)
{
    CU_START(f);
    tu_rng r = {0x0971};
    const int64_t n = 10007;
    float *w0 = cu_rand(f, &r, n, -1, 1), *g[3];
    for (int t = 0; t < 3; t++) g[t] = cu_rand(f, &r, n, -1, 1);
    float *zeros = cu_hf(f, n);

    static const struct { float lr, mom, damp; int nesterov; float wd; } sgd[] = {
        {0.1f, 0.0f, 0.0f, 0, 0.0f},   {0.1f, 0.0f, 0.0f, 0, 1e-2f}, {0.1f, 0.9f, 0.1f, 0, 1e-2f},
        {0.05f, 0.9f, 0.0f, 1, 1e-2f}, {0.05f, 0.5f, 0.0f, 0, 0.0f}};
    for (int i = 0; i < TU_ARRAY_LEN(sgd); i++) {
        cu_buf w = cu_putf(f, w0, n), buf = cu_junk(f, n); /* first step must not read buf */
        int mom = sgd[i].mom != 0.0f;
        double *Mw = cu_hd(f, n), *Mb = cu_hd(f, n);
        for (int t = 0; t < 3; t++) {
            float *wp = cu_copyf(f, CF(w), n), *bp = cu_copyf(f, CF(buf), n);
            cu_buf gb = cu_putf(f, g[t], n);
            BOTH(sgd_update, n, P(w), P(gb), mom ? P(buf) : NULL, sgd[i].lr, sgd[i].mom,
                 sgd[i].damp, sgd[i].nesterov, sgd[i].wd, t == 0);
            cu_opt_sgd(n, Mw, Mb, wp, bp, CF(w), CF(buf), g[t], sgd[i].lr, sgd[i].mom,
                       sgd[i].damp, sgd[i].nesterov, sgd[i].wd, t == 0);
            cu_expect_opt(f, w, n, Mw, OPT_RTOL,
                          "sgd_update lr=%g momentum=%g dampening=%g nesterov=%d wd=%g step %d w",
                          (double)sgd[i].lr, (double)sgd[i].mom, (double)sgd[i].damp,
                          sgd[i].nesterov, (double)sgd[i].wd, t + 1);
            if (mom)
                cu_expect_opt(f, buf, n, Mb, OPT_RTOL,
                              "sgd_update momentum=%g nesterov=%d step %d buf",
                              (double)sgd[i].mom, sgd[i].nesterov, t + 1);
        }
    }

    for (int decoupled = 0; decoupled < 2; decoupled++)
        for (int wdi = 0; wdi < 2; wdi++) {
            const float lr = 1e-2f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = wdi ? 1e-2f : 0.0f;
            cu_buf w = cu_putf(f, w0, n), m = cu_putf(f, zeros, n), v = cu_putf(f, zeros, n);
            double *Mw = cu_hd(f, n), *Mm = cu_hd(f, n), *Mv = cu_hd(f, n);
            for (int t = 1; t <= 3; t++) {
                float bc1 = (float)(1.0 - pow((double)b1, t)),
                      bc2 = (float)(1.0 - pow((double)b2, t));
                float *wp = cu_copyf(f, CF(w), n), *mp = cu_copyf(f, CF(m), n),
                      *vp = cu_copyf(f, CF(v), n);
                cu_buf gb = cu_putf(f, g[t - 1], n);
                BOTH(adam_update, n, P(w), P(gb), P(m), P(v), lr, b1, b2, eps, wd, decoupled, bc1,
                     bc2);
                cu_opt_adam(n, Mw, Mm, Mv, wp, mp, vp, CF(m), CF(v), g[t - 1], lr, b1, b2, eps, wd,
                            decoupled, bc1, bc2);
                const char *kind = decoupled ? "adamw" : "adam";
                cu_expect_opt(f, w, n, Mw, OPT_RTOL, "adam_update (%s, wd %g) step %d w", kind,
                              (double)wd, t);
                cu_expect_opt(f, m, n, Mm, OPT_RTOL, "adam_update (%s, wd %g) step %d m", kind,
                              (double)wd, t);
                cu_expect_opt(f, v, n, Mv, OPT_RTOL, "adam_update (%s, wd %g) step %d v", kind,
                              (double)wd, t);
            }
        }

    if (!f->G->adagrad_update) {
        print_message("cuda: adagrad_update is NULL (optional: no AdaGrad); not checked\n");
        return;
    }
    for (int wdi = 0; wdi < 2; wdi++) {
        const float lr = 0.1f, eps = 1e-10f, wd = wdi ? 1e-2f : 0.0f;
        cu_buf w = cu_putf(f, w0, n), s = cu_putf(f, zeros, n);
        double *Mw = cu_hd(f, n), *Ms = cu_hd(f, n);
        for (int t = 0; t < 3; t++) {
            float *wp = cu_copyf(f, CF(w), n), *sp = cu_copyf(f, CF(s), n);
            cu_buf gb = cu_putf(f, g[t], n);
            BOTH(adagrad_update, n, P(w), P(gb), P(s), lr, eps, wd);
            cu_opt_adagrad(n, Mw, Ms, wp, sp, CF(s), g[t], lr, eps, wd);
            cu_expect_opt(f, w, n, Mw, OPT_RTOL, "adagrad_update wd=%g step %d w", (double)wd,
                          t + 1);
            cu_expect_opt(f, s, n, Ms, OPT_RTOL, "adagrad_update wd=%g step %d sum", (double)wd,
                          t + 1);
        }
    }
}

/* ---------------------------------------------------------------------------
 * 13. Memory (alloc/free of many sizes, alignment, no overlap, reuse, copy,
 *     memset0) and the staging entries (pinned memory, copies on the copy
 *     stream, tickets waited and joined out of order).  CUDA only.
 * ------------------------------------------------------------------------- */
static void cu_pattern(uint8_t *p, size_t n, uint32_t tag)
{
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)((i * 2654435761u) >> 13 ^ tag);
}

/* every byte of the device block equals the pattern */
static void cu_check_block(cu_fix *f, const void *dev, size_t n, uint32_t tag, const char *what)
{
    uint8_t *h = malloc(n), *want = malloc(n);
    if (!h || !want) {
        free(h);
        free(want);
        fail_msg("out of host memory");
    }
    char fm[400];
    f->G->sync(f->gb);
    f->G->to_host(f->gb, h, dev, n);
    if (cu_fault_text(f, what, fm, sizeof fm)) {
        free(h);
        free(want);
        fail_msg("%s", fm);
    }
    cu_pattern(want, n, tag);
    for (size_t i = 0; i < n; i++)
        if (h[i] != want[i]) {
            unsigned gw = h[i], ww = want[i];
            free(h);
            free(want);
            fail_msg("%s: byte %zu of %zu is %u, expected %u", what, i, n, gw, ww);
        }
    free(h);
    free(want);
}

static void cu_upload_pattern(cu_fix *f, void *dev, size_t n, uint32_t tag)
{
    uint8_t *h = malloc(n ? n : 1);
    if (!h) fail_msg("out of host memory");
    cu_pattern(h, n, tag);
    f->G->to_device(f->gb, dev, h, n);
    free(h);
}

/* memset0 of bytes 1 .. n-2 of a block holding the pattern `tag` */
static void cu_check_memset0(cu_fix *f, void *dev, size_t n, uint32_t tag)
{
    f->G->memset0(f->gb, (char *)dev + 1, n - 2);
    uint8_t *h = malloc(n), *want = malloc(n);
    if (!h || !want) {
        free(h);
        free(want);
        fail_msg("out of host memory");
    }
    char fm[400];
    f->G->sync(f->gb);
    f->G->to_host(f->gb, h, dev, n);
    if (cu_fault_text(f, "memset0", fm, sizeof fm)) {
        free(h);
        free(want);
        fail_msg("%s", fm);
    }
    cu_pattern(want, n, tag);
    size_t bad = n;
    for (size_t j = 1; j + 1 < n && bad == n; j++)
        if (h[j] != 0) bad = j;
    int outside = h[0] != want[0] || h[n - 1] != want[n - 1];
    unsigned v = bad < n ? h[bad] : 0;
    free(h);
    free(want);
    if (outside)
        fail_msg("memset0 of bytes 1..%zu of a %zu-byte block wrote outside its range", n - 2, n);
    if (bad < n) fail_msg("memset0 of bytes 1..%zu: byte %zu is %u, expected 0", n - 2, bad, v);
}

#define CU_NBLOCKS 300

/* Memory given back and asked for again (discard, commit: zero 3's
 * parameters).  A 16 MiB block holds a pattern; discard gives back all but
 * its first and last 1 MiB + 100 bytes; commit asks for bytes 1 MiB ..
 * 9 MiB again, which are then written.  The kept bytes must be intact and
 * the written ones readable; a commit that maps nothing makes the write an
 * illegal address, which faults.  Then the rest is committed, the block
 * freed and allocated again from the pool (given-back granules refilled
 * before it is handed out) and written whole. */
static void cu_check_discard_commit(cu_fix *f)
{
    const dt_backend_iface *G = f->G;
    if (!G->discard || !G->commit)
        fail_msg("cuda backend: discard %s, commit %s (zero 3 needs both)",
                 G->discard ? "ok" : "NULL", G->commit ? "ok" : "NULL");
    const size_t n = (size_t)16 << 20, mib = (size_t)1 << 20, keep = mib + 100;
    uint8_t *want = malloc(n), *mid = malloc(8 * mib);
    if (!want || !mid) fail_msg("out of host memory");
    char *p = cu_gpu_alloc(f, n);
    cu_upload_pattern(f, p, n, 0x21);
    cu_pattern(want, n, 0x21);
    G->discard(f->gb, p + keep, n - 2 * keep);
    if (G->commit(f->gb, p + mib, 8 * mib) != DT_OK) fail_msg("commit of 8 MiB failed");
    cu_pattern(mid, 8 * mib, 0x77);
    memcpy(want + mib, mid, 8 * mib);
    G->to_device(f->gb, p + mib, mid, 8 * mib);
    const uint8_t *got = cu_fetch_ptr(f, p, 9 * mib);   /* only what is mapped for sure */
    for (size_t i = 0; i < 9 * mib; i++)
        if (got[i] != want[i])
            fail_msg("discard/commit: byte %zu is %u, expected %u (kept: bytes below %zu)", i,
                     (unsigned)got[i], (unsigned)want[i], keep);
    if (G->commit(f->gb, p + 9 * mib, n - 9 * mib) != DT_OK) fail_msg("commit of the rest failed");
    const uint8_t *tail = cu_fetch_ptr(f, p + n - keep, keep);
    for (size_t i = 0; i < keep; i++)
        if (tail[i] != want[n - keep + i])
            fail_msg("discard/commit: byte %zu of the kept tail is %u, expected %u", i,
                     (unsigned)tail[i], (unsigned)want[n - keep + i]);
    G->discard(f->gb, p, n);   /* all of it given back, then freed: the pool refills it */
    cu_untrack(f, p);
    G->free(f->gb, p);
    p = cu_gpu_alloc(f, n);
    cu_upload_pattern(f, p, n, 0x33);
    cu_check_block(f, p, n, 0x33, "a discarded block freed and allocated again");
    cu_untrack(f, p);
    G->free(f->gb, p);
    free(want);
    free(mid);
}

static void test_cuda_memory_staging(void **state)
{
    CU_START(f);
    tu_rng r = {0x3E3};
    const dt_backend_iface *G = f->G;
    if (G->host_visible != 0)
        fail_msg("cuda backend: host_visible is %d, expected 0", G->host_visible);

    /* sizes from 1 byte to 64 MiB: aligned to 64, round trip, copy, memset0 */
    static const size_t sizes[] = {1, 3, 4, 63, 64, 65, 1000, 4096, 65537, (size_t)1 << 20,
                                   ((size_t)1 << 24) + 4, (size_t)64 << 20};
    for (int round = 0; round < 2; round++)
        for (int i = 0; i < TU_ARRAY_LEN(sizes); i++) {
            size_t n = sizes[i];
            char what[96];
            void *p = cu_gpu_alloc(f, n), *q = cu_gpu_alloc(f, n);
            if ((uintptr_t)p % 64 != 0)
                fail_msg("alloc(%zu) = %p is not aligned to 64 bytes", n, p);
            snprintf(what, sizeof what, "alloc(%zu) round %d: to_device/to_host", n, round);
            cu_upload_pattern(f, p, n, (uint32_t)i);
            cu_check_block(f, p, n, (uint32_t)i, what);
            cu_upload_pattern(f, q, n, (uint32_t)i ^ 0x5Au); /* a copy that does nothing fails */
            G->copy(f->gb, q, p, n);
            snprintf(what, sizeof what, "alloc(%zu) round %d: copy", n, round);
            cu_check_block(f, q, n, (uint32_t)i, what);
            if (n > 2) cu_check_memset0(f, p, n, (uint32_t)i);
            cu_untrack(f, p);
            cu_untrack(f, q);
            G->free(f->gb, q);
            G->free(f->gb, p);
        }

    /* many live blocks: distinct, no overlap (each keeps its own pattern);
     * free half, allocate again (reuse), check all again */
    void *blk[CU_NBLOCKS];
    size_t len[CU_NBLOCKS];
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < CU_NBLOCKS; i++) {
            if (round == 1 && i % 2 == 0) continue; /* kept from round 0 */
            len[i] = 1 + (size_t)(tu_next(&r) % 20000);
            blk[i] = cu_gpu_alloc(f, len[i]);
            cu_upload_pattern(f, blk[i], len[i], (uint32_t)(i * 7 + round));
        }
        for (int i = 0; i < CU_NBLOCKS; i++) {
            char what[96];
            int tag_round = round == 1 && i % 2 == 0 ? 0 : round;
            snprintf(what, sizeof what, "block %d of %d (%zu bytes), round %d", i, CU_NBLOCKS,
                     len[i], round);
            cu_check_block(f, blk[i], len[i], (uint32_t)(i * 7 + tag_round), what);
            for (int j = 0; j < i; j++) {
                uintptr_t a0 = (uintptr_t)blk[i], a1 = a0 + len[i];
                uintptr_t b0 = (uintptr_t)blk[j], b1 = b0 + len[j];
                if (a0 < b1 && b0 < a1) fail_msg("blocks %d and %d overlap", i, j);
            }
        }
        if (round == 0)
            for (int i = 1; i < CU_NBLOCKS; i += 2) {
                cu_untrack(f, blk[i]);
                G->free(f->gb, blk[i]);
            }
    }

    cu_check_discard_commit(f);

    /* staging */
    if (!G->host_alloc || !G->host_free || !G->copy_async || !G->copy_wait || !G->copy_join)
        fail_msg(
            "cuda backend (host_visible 0) lacks staging entries: host_alloc %s, host_free %s, "
            "copy_async %s, copy_wait %s, copy_join %s",
            G->host_alloc ? "ok" : "NULL", G->host_free ? "ok" : "NULL",
            G->copy_async ? "ok" : "NULL", G->copy_wait ? "ok" : "NULL",
            G->copy_join ? "ok" : "NULL");
    const int64_t n = (int64_t)1 << 22; /* 16 MiB: copies take long enough to race */
    const size_t bytes = sizeof(float) * (size_t)n;
    float *h[4];
    for (int i = 0; i < 4; i++) {
        h[i] = G->host_alloc(f->gb, bytes);
        if (h[i]) {
            cu_track(f, h[i], CU_PINNED);
        } else {
            print_message("cuda: host_alloc(%zu) returned NULL; staging through malloc'd memory\n",
                          bytes);
            h[i] = cu_hf(f, n);
        }
    }
    float *ha = h[0], *hb = h[1], *out1 = h[2], *out2 = h[3];
    memset(out1, 0xA5, bytes); /* no value below: a copy that does nothing fails */
    memset(out2, 0xA5, bytes);
    tu_fill_uniform(&r, ha, n, -1, 1);
    tu_fill_uniform(&r, hb, n, -1, 1);
    float *old_a = cu_hf(f, n), *old_b = cu_hf(f, n);
    memcpy(old_a, ha, bytes);
    memcpy(old_b, hb, bytes);
    float *da = cu_gpu_alloc(f, bytes), *db = cu_gpu_alloc(f, bytes), *dc = cu_gpu_alloc(f, bytes);

    /* H2D twice, joined out of order, then compute on the compute stream */
    uint64_t t1 = G->copy_async(f->gb, da, ha, bytes, DT_COPY_H2D);
    uint64_t t2 = G->copy_async(f->gb, db, hb, bytes, DT_COPY_H2D);
    G->copy_join(f->gb, t2);
    G->copy_join(f->gb, t1);
    G->axpby(f->gb, n, 2.0f, da, 1.0f, db); /* db = 2a + b (2a exact: one rounding) */
    G->axpby(f->gb, n, -1.0f, da, 0.0f, dc); /* dc = -a */
    /* D2H: the copy stream first waits for the compute stream; waited out of order */
    uint64_t t3 = G->copy_async(f->gb, out1, db, bytes, DT_COPY_D2H);
    uint64_t t4 = G->copy_async(f->gb, out2, dc, bytes, DT_COPY_D2H);
    G->copy_wait(f->gb, t4);
    G->copy_wait(f->gb, t3);
    cu_check_fault(f, "copy_wait");
    for (int64_t i = 0; i < n; i++) {
        float want1 = 2.0f * old_a[i] + old_b[i], want2 = -old_a[i];
        if (out1[i] != want1)
            fail_msg("staging: copy_async D2H of 2a + b [%lld]: expected %.9g, got %.9g (tickets "
                     "%llu %llu joined, %llu %llu waited)",
                     (long long)i, (double)want1, (double)out1[i], (unsigned long long)t1,
                     (unsigned long long)t2, (unsigned long long)t3, (unsigned long long)t4);
        if (out2[i] != want2)
            fail_msg("staging: copy_async D2H of -a [%lld]: expected %.9g, got %.9g", (long long)i,
                     (double)want2, (double)out2[i]);
    }

    /* an H2D copy must not overwrite memory a queued kernel still reads */
    G->axpby(f->gb, n, 1.0f, da, 0.0f, dc); /* dc = a, queued */
    tu_fill_uniform(&r, hb, n, 2, 3);       /* hb's copy (t2) is done: t4 was waited */
    uint64_t t5 = G->copy_async(f->gb, da, hb, bytes, DT_COPY_H2D);
    G->copy_wait(f->gb, t5);
    const float *gc = cu_fetch_ptr(f, dc, bytes), *ga = cu_fetch_ptr(f, da, bytes);
    for (int64_t i = 0; i < n; i++) {
        if (gc[i] != old_a[i])
            fail_msg("staging: a kernel queued before copy_async H2D read the new data at [%lld]: "
                     "expected %.9g, got %.9g",
                     (long long)i, (double)old_a[i], (double)gc[i]);
        if (ga[i] != hb[i])
            fail_msg("staging: copy_async H2D [%lld]: expected %.9g, got %.9g", (long long)i,
                     (double)hb[i], (double)ga[i]);
    }

    /* small copies at odd offsets, a ticket 0 (already done) waits fine */
    uint64_t t6 = G->copy_async(f->gb, out1 + 3, da + 5, 37 * sizeof(float), DT_COPY_D2H);
    G->copy_wait(f->gb, t6);
    cu_check_fault(f, "copy_wait");
    for (int i = 0; i < 37; i++)
        if (out1[3 + i] != hb[5 + i])
            fail_msg(
                "staging: copy_async D2H of 37 floats at offset 5 [%d]: expected %.9g, got %.9g", i,
                (double)hb[5 + i], (double)out1[3 + i]);
    G->copy_wait(f->gb, 0);
    G->copy_join(f->gb, 0);
    cu_check_fault(f, "copy_wait / copy_join of ticket 0");
}

/* ---------------------------------------------------------------------------
 * 14. Determinism: the same op twice gives the same bits (backend.h's
 *     contract), and reductions at sizes around block boundaries agree
 *     with the CPU.  The two outputs of each pair start different
 *     (cu_gpu_pair), so a kernel that writes nothing fails; an output that
 *     is added to (embedding_backward, layernorm's dw) starts equal in both
 *     runs, and the first run is also compared with the CPU, which shows
 *     that the kernel ran.
 * ------------------------------------------------------------------------- */
static void test_cuda_determinism(void **state)
{
    CU_START(f);
    tu_rng r = {0xDE7};
    const dt_backend_iface *G = f->G;
    dt_backend *gb = f->gb;

    /* gemm 200 x 300 x 256 (B transposed), twice, and against the CPU */
    {
        const int64_t m = 200, n = 300, k = 256;
        float *ha = cu_rand(f, &r, m * k, -1, 1), *hb = cu_rand(f, &r, n * k, -1, 1);
        cu_buf a = cu_putf(f, ha, m * k), b = cu_putf(f, hb, n * k);
        cu_buf c1 = cu_junk(f, m * n);
        float *c2 = cu_gpu_alloc(f, c1.bytes);
        cu_gpu_pair(f, c1.g, c2, c1.bytes);
        f->C->gemm(f->cb, 0, 1, m, n, k, 1.0f, CF(a), k, CF(b), k, 0.0f, CF(c1), n);
        G->gemm(gb, 0, 1, m, n, k, 1.0f, a.g, k, b.g, k, 0.0f, c1.g, n);
        G->gemm(gb, 0, 1, m, n, k, 1.0f, a.g, k, b.g, k, 0.0f, c2, n);
        cu_expect_repeat(f, c1.g, c2, c1.bytes, "gemm 200x300x256 twice");
        cu_gemm s = {.batch = 1, .ta = 0, .tb = 1, .m = m, .n = n, .k = k, .alpha = 1.0f,
                     .beta = 0.0f, .lda = k, .ldb = k, .ldc = n, .c = CF(c1)};
        double *mag = cu_hd(f, m * n);
        cu_gemm_ref(&s, ha, hb, mag, NULL);
        cu_expect_scaled(f, c1, m * n, mag, GEMM_RTOL * sqrt((double)k), 0.0, "gemm 200x300x256");
    }

    /* sum and sumsq twice at two sizes (one past 37 CPU blocks, one past
     * 2^22), against the CPU too */
    static const int64_t sizes[] = {4096 * 37 + 1, ((int64_t)1 << 22) + 3};
    for (int i = 0; i < TU_ARRAY_LEN(sizes); i++) {
        int64_t n = sizes[i];
        float *hx = cu_rand(f, &r, n, -1, 1);
        double mag = 0;
        for (int64_t j = 0; j < n; j++) mag += fabs((double)hx[j]);
        cu_buf x = cu_putf(f, hx, n), s1 = cu_junk(f, 1);
        float *s2 = cu_gpu_alloc(f, 4);
        cu_gpu_pair(f, s1.g, s2, 4);
        f->C->sum(f->cb, n, CF(x), CF(s1));
        G->sum(gb, n, x.g, s1.g);
        G->sum(gb, n, x.g, s2);
        cu_expect_repeat(f, s1.g, s2, 4, "sum n=%lld twice", (long long)n);
        cu_expect_scaled(f, s1, 1, &mag, RED_RTOL, 0.0, "sum n=%lld", (long long)n);
        double q1 = G->sumsq(gb, n, x.g), q2 = G->sumsq(gb, n, x.g);
        double qc = f->C->sumsq(f->cb, n, CF(x));
        cu_check_fault(f, "sumsq"); /* a faulted sumsq is NaN twice, the same bits */
        if (memcmp(&q1, &q2, sizeof q1) != 0)
            fail_msg("sumsq n=%lld twice: %.17g vs %.17g", (long long)n, q1, q2);
        if (!(fabs(q1 - qc) <= RED_RTOL * qc))
            fail_msg("sumsq n=%lld: cpu %.17g, cuda %.17g", (long long)n, qc, q1);
    }

    /* the other reductions and scatter-adds, twice each */
    {
        const int64_t outer = 8, len = 5000, inner = 3, nx = outer * len * inner;
        const size_t no = 4 * (size_t)(outer * inner), nb = 4 * (size_t)len;
        float *hx = cu_rand(f, &r, nx, -1, 1);
        float *x = cu_gpu_alloc(f, 4 * (size_t)nx);
        G->to_device(gb, x, hx, 4 * (size_t)nx);
        float *o1 = cu_gpu_alloc(f, no), *o2 = cu_gpu_alloc(f, no);
        cu_gpu_pair(f, o1, o2, no);
        G->reduce_axis(gb, DT_RED_SUM, outer, len, inner, x, o1);
        G->reduce_axis(gb, DT_RED_SUM, outer, len, inner, x, o2);
        cu_expect_repeat(f, o1, o2, no, "reduce_axis(sum) (8,5000,3) twice");
        /* dbias (5000) over dy (8, 5000, 3) */
        float *b1 = cu_gpu_alloc(f, nb), *b2 = cu_gpu_alloc(f, nb);
        cu_gpu_pair(f, b1, b2, nb);
        G->bias_grad(gb, outer, len, inner, x, b1, 0);
        G->bias_grad(gb, outer, len, inner, x, b2, 0);
        cu_expect_repeat(f, b1, b2, nb, "bias_grad (8,5000,3) twice");
        static const int64_t shp[3] = {8, 5000, 3}, dst[3] = {0, 0, 1};
        cu_gpu_pair(f, o1, o2, 4 * 3); /* they hold reduce_axis's equal results */
        G->sum_to(gb, 3, shp, x, o1, dst, 0);
        G->sum_to(gb, 3, shp, x, o2, dst, 0);
        cu_expect_repeat(f, o1, o2, 4 * 3, "sum_to (8,5000,3) -> (3) twice");
    }
    {
        /* dweight += dy rows: both runs start from the same weights; the
         * first is compared with the CPU (exact: the same adds in order) */
        const int64_t vocab = 3, d = 5, n = 3000;
        int32_t *idx = cu_rand_idx(f, &r, n, vocab);
        float *hdy = cu_rand(f, &r, n * d, -1, 1), *hw = cu_rand(f, &r, vocab * d, -1, 1);
        cu_buf ix = cu_puti(f, idx, n), dy = cu_putf(f, hdy, n * d), w1 = cu_putf(f, hw, vocab * d);
        float *w2 = cu_gpu_alloc(f, w1.bytes);
        G->to_device(gb, w2, hw, w1.bytes);
        f->C->embedding_backward(f->cb, n, d, CI(ix), CF(dy), CF(w1));
        G->embedding_backward(gb, n, d, ix.g, dy.g, w1.g);
        G->embedding_backward(gb, n, d, ix.g, dy.g, w2);
        cu_expect_repeat(f, w1.g, w2, w1.bytes, "embedding_backward (3000 rows into 3) twice");
        cu_expect(f, w1, vocab * d, TOL_EXACT, "embedding_backward (3000 rows into 3), run 1");
    }
    {
        dt_conv_geom g = cu_geom(4, 8, 15, 13, 3, 2, 1);
        int64_t nx = g.n * g.c * g.h * g.w, ny = g.n * g.c * g.oh * g.ow;
        int64_t ncol = g.c * g.kh * g.kw * g.n * g.oh * g.ow;
        const size_t bx = 4 * (size_t)nx;
        float *x = cu_gpu_alloc(f, bx), *y = cu_gpu_alloc(f, 4 * (size_t)ny);
        int32_t *am = cu_gpu_alloc(f, 4 * (size_t)ny);
        float *dy = cu_gpu_alloc(f, 4 * (size_t)ny), *col = cu_gpu_alloc(f, 4 * (size_t)ncol);
        float *dx1 = cu_gpu_alloc(f, bx), *dx2 = cu_gpu_alloc(f, bx);
        float *hx = cu_hf(f, nx);
        tu_fill_distinct(&r, hx, nx, 0.01f);
        G->to_device(gb, x, hx, bx);
        G->to_device(gb, dy, cu_rand(f, &r, ny, -1, 1), 4 * (size_t)ny);
        G->to_device(gb, col, cu_rand(f, &r, ncol, -1, 1), 4 * (size_t)ncol);
        G->maxpool_forward(gb, &g, x, y, am);
        cu_gpu_pair(f, dx1, dx2, bx);
        G->maxpool_backward(gb, &g, dy, am, dx1, 0);
        G->maxpool_backward(gb, &g, dy, am, dx2, 0);
        cu_expect_repeat(f, dx1, dx2, bx, "maxpool_backward (overlapping windows) twice");
        cu_gpu_pair(f, dx1, dx2, bx);
        G->col2im(gb, &g, col, dx1, 0);
        G->col2im(gb, &g, col, dx2, 0);
        cu_expect_repeat(f, dx1, dx2, bx, "col2im twice");
        if (G->conv2d_backward) {
            const int64_t o = 6, nw = o * g.c * g.kh * g.kw, nyo = g.n * o * g.oh * g.ow;
            const size_t bw = 4 * (size_t)nw, bb = 4 * (size_t)o;
            float *w = cu_gpu_alloc(f, bw), *dyo = cu_gpu_alloc(f, 4 * (size_t)nyo);
            float *dw1 = cu_gpu_alloc(f, bw), *dw2 = cu_gpu_alloc(f, bw);
            float *db1 = cu_gpu_alloc(f, bb), *db2 = cu_gpu_alloc(f, bb);
            G->to_device(gb, w, cu_rand(f, &r, nw, -1, 1), bw);
            G->to_device(gb, dyo, cu_rand(f, &r, nyo, -1, 1), 4 * (size_t)nyo);
            cu_gpu_pair(f, dx1, dx2, bx);
            cu_gpu_pair(f, dw1, dw2, bw);
            cu_gpu_pair(f, db1, db2, bb);
            if (G->conv2d_backward(gb, &g, o, x, w, dyo, dx1, 0, dw1, 0, db1, 0) != DT_OK ||
                G->conv2d_backward(gb, &g, o, x, w, dyo, dx2, 0, dw2, 0, db2, 0) != DT_OK)
                fail_msg("cuda conv2d_backward failed");
            cu_expect_repeat(f, dx1, dx2, bx, "conv2d_backward dx twice");
            cu_expect_repeat(f, dw1, dw2, bw, "conv2d_backward dw twice");
            cu_expect_repeat(f, db1, db2, bb, "conv2d_backward db twice");
        }
    }
    {
        /* dw += over 64 rows, from the CPU's mean and rstd: both runs
         * start from zeros; run 1 is compared with the CPU's dw too */
        const int64_t rows = 64, d = 768, nx = rows * d;
        cu_buf x = cu_putf(f, cu_rand(f, &r, nx, -1, 1), nx);
        cu_buf dy = cu_putf(f, cu_rand(f, &r, nx, -1, 1), nx);
        cu_buf w = cu_putf(f, cu_rand(f, &r, d, 0.5f, 1.5f), d);
        float *y = cu_hf(f, nx), *mean = cu_hf(f, rows), *rstd = cu_hf(f, rows);
        float *dxc = cu_hf(f, nx);
        f->C->layernorm_forward(f->cb, rows, d, CF(x), CF(w), NULL, 1e-5f, y, mean, rstd);
        cu_buf mc = cu_putf(f, mean, rows), rc = cu_putf(f, rstd, rows);
        cu_buf dw1 = cu_putf(f, cu_hf(f, d), d); /* zeros on both */
        float *dw2 = cu_gpu_alloc(f, dw1.bytes), *dx1 = cu_gpu_alloc(f, 4 * (size_t)nx),
              *dx2 = cu_gpu_alloc(f, 4 * (size_t)nx);
        G->memset0(gb, dw2, dw1.bytes);
        cu_gpu_pair(f, dx1, dx2, 4 * (size_t)nx);
        f->C->layernorm_backward(f->cb, rows, d, CF(x), CF(w), CF(mc), CF(rc), CF(dy), dxc,
                                 CF(dw1), NULL, 0);
        G->layernorm_backward(gb, rows, d, x.g, w.g, mc.g, rc.g, dy.g, dx1, dw1.g, NULL, 0);
        G->layernorm_backward(gb, rows, d, x.g, w.g, mc.g, rc.g, dy.g, dx2, dw2, NULL, 0);
        cu_expect_repeat(f, dw1.g, dw2, dw1.bytes, "layernorm_backward dw (64 rows) twice");
        cu_expect_repeat(f, dx1, dx2, 4 * (size_t)nx, "layernorm_backward dx (64 rows) twice");
        double *mdw, *mdb;
        cu_ln_grad_mag(f, rows, d, CF(x), mean, rstd, CF(dy), NULL, NULL, &mdw, &mdb);
        cu_expect_scaled(f, dw1, d, mdw, TOL_NORM.rtol, TOL_NORM.atol,
                         "layernorm_backward dw (64 rows), run 1");
    }
    {
        const int64_t n = 4096, c = 37;
        float *lg = cu_gpu_alloc(f, 4 * (size_t)(n * c)),
              *pr = cu_gpu_alloc(f, 4 * (size_t)(n * c));
        int32_t *lb = cu_gpu_alloc(f, 4 * (size_t)n);
        float *l1 = cu_gpu_alloc(f, 4), *l2 = cu_gpu_alloc(f, 4);
        G->to_device(gb, lg, cu_rand(f, &r, n * c, -4, 4), 4 * (size_t)(n * c));
        G->to_device(gb, lb, cu_rand_idx(f, &r, n, c), 4 * (size_t)n);
        cu_gpu_pair(f, l1, l2, 4);
        int64_t ret1 = G->xent_forward(gb, n, c, lg, lb, DT_XENT_KEEP_ALL, n, pr, l1);
        int64_t ret2 = G->xent_forward(gb, n, c, lg, lb, DT_XENT_KEEP_ALL, n, pr, l2);
        cu_check_fault(f, "xent_forward"); /* a faulted one answers -1, "valid" */
        if (ret1 != -1 || ret2 != -1)
            fail_msg("cuda xent_forward rejected valid labels (returned %lld, %lld)",
                     (long long)ret1, (long long)ret2);
        cu_expect_repeat(f, l1, l2, 4, "xent_forward loss (4096 rows) twice");
    }
}

/* ---------------------------------------------------------------------------
 * 15. Three SGD steps through the public API on a "cuda" and a "cpu"
 *     context: a small MLP and a small CNN (conv2d + max_pool2d + linear).
 *     Each context is given its backend as cfg.custom_backend, never by
 *     name: dt_ctx_new replaces a named backend with $DTRAIN_BACKEND (the
 *     suite may run under DTRAIN_BACKEND=cuda or cpu-staged), which would
 *     compare a backend with itself; a custom backend it keeps.  Each
 *     context's dt_backend_name is checked too.
 * ------------------------------------------------------------------------- */
#define CU_TRAIN_STEPS 3

typedef struct cu_trained {
    char backend[32]; /* dt_backend_name of the context */
    int np;
    const char *names[4];
    float *params[4];
    int64_t numel[4];
    float loss[CU_TRAIN_STEPS];
} cu_trained;

/* be: the backend (f->C or f->G); the context and the optimizer are
 * freed in teardown if a check fails on the way */
static void cu_train(cu_fix *f, const dt_backend_iface *be, int cnn, cu_trained *out)
{
    dt_ctx_config cfg;
    dt_ctx_config_init(&cfg);
    cfg.backend = be->name;
    cfg.custom_backend = be;
    cfg.threads = 1;
    cfg.seed = 7;
    dt_ctx *ctx = dt_ctx_new(&cfg);
    assert_non_null(ctx);
    cu_track(f, ctx, CU_CTX);
    if (dt_ctx_status(ctx) != DT_OK)
        fail_msg("dt_ctx_new(backend \"%s\"): %s", be->name, dt_last_error(ctx));
    snprintf(out->backend, sizeof out->backend, "%s", dt_backend_name(ctx));
    if (strcmp(out->backend, be->name) != 0)
        fail_msg("dt_ctx_new with custom_backend \"%s\": the context runs on \"%s\"", be->name,
                 out->backend);
    tu_rng r = {cnn ? 0xC77u : 0x3A9u}; /* the same parameters and data on both */
    dt_tensor *ps[4], *x, *y;
    static const char *mlp_names[4] = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};
    static const char *cnn_names[4] = {"conv.weight", "conv.bias", "fc.weight", "fc.bias"};
    const char *const *names = cnn ? cnn_names : mlp_names;
    int32_t labels[16];
    if (!cnn) {
        ps[0] = tu_param_rand(ctx, &r, names[0], SHP(32, 20), -0.3f, 0.3f);
        ps[1] = tu_param_rand(ctx, &r, names[1], SHP(32), -0.1f, 0.1f);
        ps[2] = tu_param_rand(ctx, &r, names[2], SHP(10, 32), -0.3f, 0.3f);
        ps[3] = tu_param_rand(ctx, &r, names[3], SHP(10), -0.1f, 0.1f);
        float *xv = cu_rand(f, &r, 16 * 20, -1, 1);
        x = tu_tensor(ctx, SHP(16, 20), xv);
        for (int i = 0; i < 16; i++) labels[i] = (int32_t)(tu_next(&r) % 10);
        y = tu_tensor_i32(ctx, SHP(16), labels);
    } else {
        ps[0] = tu_param_rand(ctx, &r, names[0], SHP(3, 2, 3, 3), -0.3f, 0.3f);
        ps[1] = tu_param_rand(ctx, &r, names[1], SHP(3), -0.1f, 0.1f);
        ps[2] = tu_param_rand(ctx, &r, names[2], SHP(5, 48), -0.2f, 0.2f);
        ps[3] = tu_param_rand(ctx, &r, names[3], SHP(5), -0.1f, 0.1f);
        float *xv = cu_rand(f, &r, 4 * 2 * 8 * 8, -1, 1);
        x = tu_tensor(ctx, SHP(4, 2, 8, 8), xv);
        for (int i = 0; i < 4; i++) labels[i] = (int32_t)(tu_next(&r) % 5);
        y = tu_tensor_i32(ctx, SHP(4), labels);
    }
    dt_optim_config oc;
    dt_optim_config_init(&oc, DT_SGD);
    oc.lr = 0.1f;
    oc.momentum = 0.9f;
    dt_optim *opt = dt_optim_new(ctx, &oc, NULL, 0);
    tu_check(ctx, opt, "dt_optim_new");
    cu_track(f, opt, CU_OPTIM);
    for (int step = 0; step < CU_TRAIN_STEPS; step++) {
        dt_optim_zero_grad(opt);
        dt_tensor *logits;
        if (!cnn) {
            logits = dt_linear(ctx, dt_relu(ctx, dt_linear(ctx, x, ps[0], ps[1])), ps[2], ps[3]);
        } else { /* (4,2,8,8) -> conv (4,3,8,8) -> pool (4,3,4,4) -> (4,48) -> (4,5) */
            dt_tensor *h = dt_relu(ctx, dt_conv2d(ctx, x, ps[0], ps[1], 1, 1));
            h = dt_flatten(ctx, dt_max_pool2d(ctx, h, 2, 2, 0), 1);
            logits = dt_linear(ctx, h, ps[2], ps[3]);
        }
        dt_tensor *loss = dt_cross_entropy(ctx, logits, y);
        tu_check(ctx, loss, cnn ? "cnn forward" : "mlp forward");
        out->loss[step] = dt_tensor_item(loss);
        tu_check_status(ctx, dt_backward(ctx, loss), "dt_backward");
        tu_check_status(ctx, dt_optim_step(opt), "dt_optim_step");
        dt_ctx_step_reset(ctx);
    }
    out->np = 4;
    for (int i = 0; i < 4; i++) {
        int64_t n;
        float *v = tu_read(ctx, ps[i], &n);
        out->params[i] = cu_hf(f, n);
        memcpy(out->params[i], v, sizeof(float) * (size_t)n);
        free(v);
        out->numel[i] = n;
        out->names[i] = names[i];
    }
    cu_untrack(f, opt);
    dt_optim_free(opt);
    cu_untrack(f, ctx);
    dt_ctx_free(ctx);
}

static void test_cuda_train_steps(void **state)
{
    CU_START(f);
    for (int cnn = 0; cnn < 2; cnn++) {
        cu_trained c, g;
        memset(&c, 0, sizeof c);
        memset(&g, 0, sizeof g);
        cu_train(f, f->C, cnn, &c);
        cu_train(f, f->G, cnn, &g);
        if (strcmp(c.backend, g.backend) == 0)
            fail_msg("the reference and the tested context both run on \"%s\"", c.backend);
        const char *model = cnn ? "cnn" : "mlp";
        char what[128];
        snprintf(what, sizeof what, "%s: loss of steps 1..%d", model, CU_TRAIN_STEPS);
        cu_compare(what, "cpu", c.loss, g.loss, NULL, CU_TRAIN_STEPS, TRAIN_RTOL, TRAIN_ATOL);
        for (int i = 0; i < c.np; i++) {
            snprintf(what, sizeof what, "%s: %s after %d SGD steps", model, c.names[i],
                     CU_TRAIN_STEPS);
            if (c.numel[i] != g.numel[i]) fail_msg("%s: numel differs", what);
            cu_compare(what, "cpu", c.params[i], g.params[i], NULL, c.numel[i], TRAIN_RTOL,
                       TRAIN_ATOL);
        }
    }
}

/* ------------------------------------------------------------------------- */
#define CU_TEST(fn) cmocka_unit_test_setup_teardown(fn, cu_setup, cu_teardown)

static const struct CMUnitTest tests[] = {
    CU_TEST(test_cuda_gemm),
    CU_TEST(test_cuda_precision),
    CU_TEST(test_cuda_elementwise),
    CU_TEST(test_cuda_reductions),
    CU_TEST(test_cuda_softmax_xent),
    CU_TEST(test_cuda_conv_pool),
    CU_TEST(test_cuda_embedding_layernorm_dropout),
    CU_TEST(test_cuda_optimizers),
    CU_TEST(test_cuda_memory_staging),
    CU_TEST(test_cuda_determinism),
    CU_TEST(test_cuda_train_steps),
};

DT_TEST_GROUP(cuda, tests)
