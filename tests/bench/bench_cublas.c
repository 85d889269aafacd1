/*
 * tests/bench/bench_cublas.c - matmul throughput of dtrain's dt_matmul on the
 * CUDA backend as a fraction of the raw cuBLAS call for the same product, in
 * the same process on the same device.
 *
 *   bench_cublas [--device D] [--shapes 1024x1024x1024,...] [--precs fp32,fp32p,tf32,bf16]
 *                [--rounds R] [--round-ms T]
 *   bench_cublas --probe          exit 0 when a CUDA device is usable
 *
 * Shapes are MxKxN: A (M,K) times B (K,N), row-major, as in bench_train.c.
 * The raw calls, on row-major data (C^T = B^T A^T in cuBLAS's column-major):
 *   fp32   cublasSgemm, CUBLAS_DEFAULT_MATH (no TF32 unless
 *          NVIDIA_TF32_OVERRIDE=1, which is warned about)
 *   fp32p  cublasSgemm, CUBLAS_PEDANTIC_MATH
 *   tf32   cublasGemmEx, f32 A B C, CUBLAS_COMPUTE_32F_FAST_TF32
 *   bf16   cublasGemmEx, bf16 A B (converted once, before timing), f32 C,
 *          CUBLAS_COMPUTE_32F
 * dtrain's side: dt_matmul(a, b) of persistent f32 tensors with grad off,
 * under dt_ctx_set_autocast (fp32 and fp32p: DT_PREC_F32; tf32: DT_PREC_TF32;
 * bf16: DT_PREC_BF16, so dtrain also rounds its f32 inputs on every call),
 * dt_ctx_step_reset after each product.
 *
 * Timing: rounds of `per` back-to-back calls (about round_ms of work), the
 * host clock stopped after the device finished (cudaDeviceSynchronize for
 * raw, reading one element of the last product for dtrain).  Raw and dtrain
 * rounds alternate; the median round of each side is kept.
 *
 * Output, one line per shape and precision ("key value" pairs after the id):
 *   matmul 1024x1024x1024 fp32 raw_tflops 48.10 dtrain_tflops 46.90 ratio 0.975 maxrel 1.2e-07 ok 1 per 40 rounds 11
 * maxrel: largest |dtrain - raw| / max|raw|; ok 0 when over 2e-5 for fp32
 * (f32 sums in another order stay near 1e-6; TF32 inputs give ~1e-4, so an
 * fp32 product that quietly ran on TF32 is caught) or 2e-2 for tf32, bf16.  Built with -DBENCH_RAW_ONLY (no dtrain), or
 * when dtrain fails, dtrain_tflops and ratio are nan.  Other lines start
 * with '#'.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* clock_gettime */
#endif

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#ifndef BENCH_RAW_ONLY
#include "dtrain.h"
#endif

enum { MAX_ROUNDS = 64, MAX_SHAPES = 16, MAX_PRECS = 8 };

typedef enum prec { P_FP32, P_FP32P, P_TF32, P_BF16 } prec;
static const char *const prec_names[] = {"fp32", "fp32p", "tf32", "bf16"};

typedef struct opts {
    int device;
    int rounds;
    double round_ms;
    int64_t shapes[MAX_SHAPES][3];
    int nshapes;
    prec precs[MAX_PRECS];
    int nprecs;
} opts;

/* ------------------------------------------------------------------------ */
/* helpers                                                                   */
/* ------------------------------------------------------------------------ */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return (n % 2) ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* splitmix64: fixed-seed data, uniform in [-1, 1) */
static uint64_t rng_state = 0x5eedcb1a5ULL;
static float rng_sym(void)
{
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return (float)(z >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

/* f32 -> bf16 bits, round to nearest even (inputs here are finite) */
static uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static int cuda_ok(cudaError_t e, const char *what)
{
    if (e == cudaSuccess) return 1;
    fprintf(stderr, "bench_cublas: %s: %s\n", what, cudaGetErrorString(e));
    return 0;
}

static int cublas_ok(cublasStatus_t s, const char *what)
{
    if (s == CUBLAS_STATUS_SUCCESS) return 1;
    fprintf(stderr, "bench_cublas: %s: cuBLAS status %d\n", what, (int)s);
    return 0;
}

/* ------------------------------------------------------------------------ */
/* one shape: device buffers, the raw call, dtrain's call                    */
/* ------------------------------------------------------------------------ */

typedef struct shape_bufs {
    int64_t m, k, n;
    float *ha, *hb;           /* host f32 A (M,K), B (K,N) */
    float *hc_raw, *hc_dt;    /* host copies of the products, for the check */
    float *da, *db, *dc;      /* device f32 */
    uint16_t *da16, *db16;    /* device bf16 */
#ifndef BENCH_RAW_ONLY
    dt_tensor *ta, *tb;       /* dtrain's persistent copies of A and B */
#endif
} shape_bufs;

static void shape_free(shape_bufs *s)
{
    free(s->ha);
    free(s->hb);
    free(s->hc_raw);
    free(s->hc_dt);
    cudaFree(s->da);
    cudaFree(s->db);
    cudaFree(s->dc);
    cudaFree(s->da16);
    cudaFree(s->db16);
#ifndef BENCH_RAW_ONLY
    dt_tensor_free(s->ta);
    dt_tensor_free(s->tb);
#endif
    memset(s, 0, sizeof *s);
}

/* Returns 1 on success; on failure everything allocated is freed. */
static int shape_init(shape_bufs *s, int64_t m, int64_t k, int64_t n)
{
    memset(s, 0, sizeof *s);
    s->m = m, s->k = k, s->n = n;
    size_t na = (size_t)(m * k), nb = (size_t)(k * n), nc = (size_t)(m * n);
    uint16_t *h16 = NULL;
    s->ha = malloc(na * sizeof(float));
    s->hb = malloc(nb * sizeof(float));
    s->hc_raw = malloc(nc * sizeof(float));
    s->hc_dt = malloc(nc * sizeof(float));
    h16 = malloc((na > nb ? na : nb) * sizeof(uint16_t));
    if (!s->ha || !s->hb || !s->hc_raw || !s->hc_dt || !h16) {
        fprintf(stderr, "bench_cublas: out of host memory\n");
        goto fail;
    }
    for (size_t i = 0; i < na; i++) s->ha[i] = rng_sym();
    for (size_t i = 0; i < nb; i++) s->hb[i] = rng_sym();
    if (!cuda_ok(cudaMalloc((void **)&s->da, na * sizeof(float)), "cudaMalloc") ||
        !cuda_ok(cudaMalloc((void **)&s->db, nb * sizeof(float)), "cudaMalloc") ||
        !cuda_ok(cudaMalloc((void **)&s->dc, nc * sizeof(float)), "cudaMalloc") ||
        !cuda_ok(cudaMalloc((void **)&s->da16, na * sizeof(uint16_t)), "cudaMalloc") ||
        !cuda_ok(cudaMalloc((void **)&s->db16, nb * sizeof(uint16_t)), "cudaMalloc"))
        goto fail;
    if (!cuda_ok(cudaMemcpy(s->da, s->ha, na * sizeof(float), cudaMemcpyHostToDevice), "copy A") ||
        !cuda_ok(cudaMemcpy(s->db, s->hb, nb * sizeof(float), cudaMemcpyHostToDevice), "copy B"))
        goto fail;
    for (size_t i = 0; i < na; i++) h16[i] = f32_to_bf16(s->ha[i]);
    if (!cuda_ok(cudaMemcpy(s->da16, h16, na * sizeof(uint16_t), cudaMemcpyHostToDevice), "copy A16"))
        goto fail;
    for (size_t i = 0; i < nb; i++) h16[i] = f32_to_bf16(s->hb[i]);
    if (!cuda_ok(cudaMemcpy(s->db16, h16, nb * sizeof(uint16_t), cudaMemcpyHostToDevice), "copy B16"))
        goto fail;
    free(h16);
    return 1;
fail:
    free(h16);
    shape_free(s);
    return 0;
}

/* One raw product C = A B (row-major) at precision p, queued on the default
 * stream.  Row-major C (M,N) is column-major C^T (N,M) = B^T A^T, so B goes
 * first with the dims swapped. */
static int raw_gemm(cublasHandle_t h, prec p, const shape_bufs *s)
{
    const float one = 1.0f, zero = 0.0f;
    int m = (int)s->m, n = (int)s->n, k = (int)s->k;
    cublasStatus_t st;
    switch (p) {
    case P_FP32:
    case P_FP32P:
        st = cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, n, m, k, &one, s->db, n, s->da, k, &zero,
                         s->dc, n);
        break;
    case P_TF32:
        st = cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, m, k, &one, s->db, CUDA_R_32F, n, s->da,
                          CUDA_R_32F, k, &zero, s->dc, CUDA_R_32F, n,
                          CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT);
        break;
    default:
        st = cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, m, k, &one, s->db16, CUDA_R_16BF, n,
                          s->da16, CUDA_R_16BF, k, &zero, s->dc, CUDA_R_32F, n, CUBLAS_COMPUTE_32F,
                          CUBLAS_GEMM_DEFAULT);
        break;
    }
    return cublas_ok(st, "raw gemm");
}

/* `per` raw products and a device sync; seconds per product, < 0 on error. */
static double raw_round(cublasHandle_t h, prec p, const shape_bufs *s, int per)
{
    if (!cublas_ok(cublasSetMathMode(h, p == P_FP32P ? CUBLAS_PEDANTIC_MATH : CUBLAS_DEFAULT_MATH),
                   "cublasSetMathMode"))
        return -1;
    double t0 = now_s();
    for (int i = 0; i < per; i++)
        if (!raw_gemm(h, p, s)) return -1;
    if (!cuda_ok(cudaDeviceSynchronize(), "raw gemm")) return -1;
    return (now_s() - t0) / per;
}

#ifndef BENCH_RAW_ONLY
static dt_precision dt_prec_of(prec p)
{
    return p == P_TF32 ? DT_PREC_TF32 : p == P_BF16 ? DT_PREC_BF16 : DT_PREC_F32;
}

/* `per` dt_matmul products, each followed by dt_ctx_step_reset except the
 * last, whose first element is read (that waits for the device).  Seconds
 * per product, < 0 on error.  keep: copy the last product to s->hc_dt. */
static double dt_round(dt_ctx *ctx, const shape_bufs *s, int per, int keep)
{
    double t0 = now_s();
    dt_tensor *c = NULL;
    for (int i = 0; i < per; i++) {
        if (c) dt_ctx_step_reset(ctx);
        c = dt_matmul(ctx, s->ta, s->tb, 0, 0);
        if (!c) {
            fprintf(stderr, "bench_cublas: dt_matmul: %s\n", dt_last_error(ctx));
            dt_ctx_step_reset(ctx);
            return -1;
        }
    }
    float v = dt_tensor_item(c);
    double t = (now_s() - t0) / per;
    int bad = !isfinite(v);
    if (!bad && keep && dt_tensor_get(c, s->hc_dt, s->m * s->n) != DT_OK) bad = 1;
    if (bad) fprintf(stderr, "bench_cublas: dt_matmul result: %s\n", dt_last_error(ctx));
    dt_ctx_step_reset(ctx);
    return bad ? -1 : t;
}
#endif

/* Measure shape s at precision p and print its line.  ctx may be NULL (no
 * dtrain side).  Returns 1 when both sides (or raw alone without ctx) ran. */
static int bench_one(const opts *o, cublasHandle_t h, void *ctx_v, shape_bufs *s, prec p)
{
    double flop = 2.0 * (double)s->m * (double)s->n * (double)s->k;
    double tr[MAX_ROUNDS], td[MAX_ROUNDS];
    int ok_raw = 1, ok_dt = ctx_v != NULL;
    double maxrel = NAN;
    int ok_check = 0;

    /* warm-up and the per-round count, from the raw call */
    for (int i = 0; i < 3 && ok_raw; i++) ok_raw = raw_round(h, p, s, 1) >= 0;
    double t1 = ok_raw ? raw_round(h, p, s, 3) : -1;
    if (t1 <= 0) ok_raw = 0;
    int per = ok_raw ? (int)ceil(o->round_ms * 1e-3 / t1) : 1;
    if (per < 1) per = 1;
    if (per > 5000) per = 5000;
    if (ok_raw)
        ok_raw = cuda_ok(cudaMemcpy(s->hc_raw, s->dc, (size_t)(s->m * s->n) * sizeof(float),
                                    cudaMemcpyDeviceToHost),
                         "copy C");

#ifndef BENCH_RAW_ONLY
    dt_ctx *ctx = ctx_v;
    if (ok_dt) {
        if (dt_ctx_set_autocast(ctx, dt_prec_of(p)) != DT_OK) {
            fprintf(stderr, "bench_cublas: dt_ctx_set_autocast(%s): %s\n", prec_names[p],
                    dt_last_error(ctx));
            ok_dt = 0;
        }
        for (int i = 0; i < 3 && ok_dt; i++) ok_dt = dt_round(ctx, s, 1, i == 2) >= 0;
    }
    if (ok_dt && ok_raw) {
        double maxdiff = 0, maxref = 0;
        for (int64_t i = 0; i < s->m * s->n; i++) {
            double d = fabs((double)s->hc_raw[i] - (double)s->hc_dt[i]);
            if (!(d <= maxdiff)) maxdiff = d; /* NaN sticks */
            if (fabs(s->hc_raw[i]) > maxref) maxref = fabs(s->hc_raw[i]);
        }
        maxrel = maxdiff / (maxref > 0 ? maxref : 1);
        ok_check = maxrel <= (p == P_FP32 || p == P_FP32P ? 2e-5 : 2e-2);
        if (!ok_check)
            fprintf(stderr, "bench_cublas: %lldx%lldx%lld %s: dt_matmul differs from cuBLAS: "
                            "maxrel %g\n",
                    (long long)s->m, (long long)s->k, (long long)s->n, prec_names[p], maxrel);
    }
#endif

    int rounds = 0;
    for (; rounds < o->rounds && rounds < MAX_ROUNDS && (ok_raw || ok_dt); rounds++) {
        tr[rounds] = ok_raw ? raw_round(h, p, s, per) : NAN;
        if (ok_raw && tr[rounds] < 0) ok_raw = 0;
#ifndef BENCH_RAW_ONLY
        td[rounds] = ok_dt ? dt_round(ctx, s, per, 0) : NAN;
        if (ok_dt && td[rounds] < 0) ok_dt = 0;
#else
        td[rounds] = NAN;
#endif
    }
    double traw = ok_raw && rounds ? median(tr, rounds) : NAN;
    double tdt = ok_dt && rounds ? median(td, rounds) : NAN;
    double graw = flop / traw / 1e12, gdt = flop / tdt / 1e12;
    printf("matmul %lldx%lldx%lld %s raw_tflops %.2f dtrain_tflops %.2f ratio %.3f maxrel %.2g "
           "ok %d per %d rounds %d\n",
           (long long)s->m, (long long)s->k, (long long)s->n, prec_names[p], graw, gdt, gdt / graw,
           maxrel, ok_check, per, rounds);
    fflush(stdout);
    return ok_raw && (ctx_v == NULL || ok_dt);
}

/* ------------------------------------------------------------------------ */
/* command line                                                              */
/* ------------------------------------------------------------------------ */

static _Noreturn void usage(void)
{
    fprintf(stderr, "usage: bench_cublas [--device D] [--shapes MxKxN,...] "
                    "[--precs fp32,fp32p,tf32,bf16] [--rounds R] [--round-ms T]\n"
                    "       bench_cublas --probe\n");
    exit(2);
}

static int probe(void)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n < 1) {
        printf("gpus 0 (%s)\n", e != cudaSuccess ? cudaGetErrorString(e) : "no device");
        return 1;
    }
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
        printf("gpus %d (device 0 unreadable)\n", n);
        return 1;
    }
    printf("gpus %d %s sm_%d%d\n", n, prop.name, prop.major, prop.minor);
    return 0;
}

int main(int argc, char **argv)
{
    opts o = {.device = 0, .rounds = 11, .round_ms = 25.0};
    const char *shapes = "1024x1024x1024,2048x2048x2048,4096x4096x4096,1024x4096x1024";
    const char *precs = "fp32,fp32p,tf32,bf16";
    for (int i = 1; i < argc; i += 2) {
        const char *a = argv[i];
        if (!strcmp(a, "--probe")) return probe();
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) usage();
        if (!strcmp(a, "--device")) o.device = atoi(v);
        else if (!strcmp(a, "--shapes")) shapes = v;
        else if (!strcmp(a, "--precs")) precs = v;
        else if (!strcmp(a, "--rounds")) o.rounds = atoi(v);
        else if (!strcmp(a, "--round-ms")) o.round_ms = atof(v);
        else usage();
    }
    if (o.rounds < 1 || o.round_ms <= 0) usage();
    for (const char *p = shapes; *p;) {
        long long m, k, n;
        int used = 0;
        if (o.nshapes == MAX_SHAPES || sscanf(p, "%lldx%lldx%lld%n", &m, &k, &n, &used) != 3 ||
            m < 1 || k < 1 || n < 1 || m * k > INT32_MAX || k * n > INT32_MAX || m * n > INT32_MAX)
            usage();
        o.shapes[o.nshapes][0] = m, o.shapes[o.nshapes][1] = k, o.shapes[o.nshapes][2] = n;
        o.nshapes++;
        p += used;
        if (*p == ',') p++;
        else if (*p) usage();
    }
    for (const char *p = precs; *p;) {
        size_t len = strcspn(p, ",");
        int found = -1;
        for (int j = 0; j < 4; j++)
            if (strlen(prec_names[j]) == len && !strncmp(p, prec_names[j], len)) found = j;
        if (found < 0 || o.nprecs == MAX_PRECS) usage();
        o.precs[o.nprecs++] = (prec)found;
        p += len;
        if (*p == ',') p++;
    }

    int status = 1;
    cublasHandle_t h = NULL;
    void *ctx_v = NULL;
    struct cudaDeviceProp prop;
    if (!cuda_ok(cudaSetDevice(o.device), "cudaSetDevice") ||
        !cuda_ok(cudaGetDeviceProperties(&prop, o.device), "cudaGetDeviceProperties"))
        return 1;
    int rt = 0, drv = 0, cbv = 0;
    cudaRuntimeGetVersion(&rt);
    cudaDriverGetVersion(&drv);
    if (!cublas_ok(cublasCreate(&h), "cublasCreate")) return 1;
    cublasGetVersion(h, &cbv);
    printf("# bench_cublas: device %d %s (sm_%d%d, %d SMs), CUDA runtime %d, driver %d, "
           "cuBLAS %d; rounds %d of ~%.0f ms\n",
           o.device, prop.name, prop.major, prop.minor, prop.multiProcessorCount, rt, drv, cbv,
           o.rounds, o.round_ms);
    const char *ovr = getenv("NVIDIA_TF32_OVERRIDE");
    if (ovr && strcmp(ovr, "0") != 0)
        printf("# WARNING: NVIDIA_TF32_OVERRIDE=%s: fp32 may run on TF32 tensor cores\n", ovr);

#ifndef BENCH_RAW_ONLY
    dt_ctx_config cfg;
    dt_ctx_config_init(&cfg);
    cfg.backend = "cuda";
    cfg.device = o.device;
    cfg.seed = 1;
    dt_ctx *ctx = dt_ctx_new(&cfg);
    if (!ctx || dt_ctx_status(ctx) != DT_OK) {
        printf("# dtrain: no cuda context (%s): raw cuBLAS only\n",
               ctx ? dt_last_error(ctx) : "out of memory");
        dt_ctx_free(ctx);
        ctx = NULL;
    } else {
        dt_ctx_set_grad_enabled(ctx, 0);
        printf("# dtrain %s, backend %s\n", DTRAIN_VERSION_STRING, dt_backend_name(ctx));
    }
    ctx_v = ctx;
#else
    printf("# built with BENCH_RAW_ONLY: raw cuBLAS only\n");
#endif

    int failed = 0;
#ifndef BENCH_RAW_ONLY
    if (!ctx) failed++; /* no dtrain side: the raw numbers alone are not the benchmark */
#endif
    for (int i = 0; i < o.nshapes; i++) {
        shape_bufs s;
        if (!shape_init(&s, o.shapes[i][0], o.shapes[i][1], o.shapes[i][2])) {
            failed++;
            continue;
        }
#ifndef BENCH_RAW_ONLY
        if (ctx) {
            int64_t as[2] = {s.m, s.k}, bs[2] = {s.k, s.n};
            s.ta = dt_tensor_new(ctx, DT_F32, 2, as);
            s.tb = dt_tensor_new(ctx, DT_F32, 2, bs);
            if (!s.ta || !s.tb || dt_tensor_set(s.ta, s.ha, s.m * s.k) != DT_OK ||
                dt_tensor_set(s.tb, s.hb, s.k * s.n) != DT_OK) {
                fprintf(stderr, "bench_cublas: dtrain tensors: %s\n", dt_last_error(ctx));
                failed++;
                shape_free(&s);
                continue;
            }
        }
#endif
        for (int j = 0; j < o.nprecs; j++)
            if (!bench_one(&o, h, ctx_v, &s, o.precs[j])) failed++;
        shape_free(&s);
    }
    status = failed ? 1 : 0;
    if (failed) printf("# %d failure(s)\n", failed);

#ifndef BENCH_RAW_ONLY
    dt_ctx_free(ctx);
#endif
    cublasDestroy(h);
    return status;
}
