/*
 * tests/test_cpu_kernels.c - the CPU backend's kernels against independent
 * references: naive loops with double accumulation written here, finite
 * differences in double for the backward passes that have a closed form in
 * the backend (gelu, layer norm), and hand-worked numbers for the optimizers.
 *
 * Shapes are small and odd (3x5x7 and friends) so that no kernel can hide a
 * stride or an off-by-one behind a power of two; a few larger cases run the
 * pool and check that 1 and 3 threads give bit-identical results where the
 * backend promises it (reductions, dropout).
 *
 * Entry points, called by tests/test_main.c: dt_test_cpu_kernels() runs the
 * group and returns the number of failed tests; dt_test_cpu_kernels_count()
 * is the number of tests in it.
 */
#include "test_util.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <unistd.h>
#include <string.h>

#include "backends/backend.h"

int dt_test_cpu_kernels(void);
int dt_test_cpu_kernels_count(void);

/* ---------------------------------------------------------------------------
 * 1. Fixture: one instance with 1 thread and one with 3
 * ------------------------------------------------------------------------- */
typedef struct fix {
    const dt_backend_iface *I;
    dt_backend *be1, *be3;
} fix;

static void *t_malloc(size_t n, void *u) { (void)u; return malloc(n); }
static void *t_realloc(void *p, size_t n, void *u) { (void)u; return realloc(p, n); }
static void t_free(void *p, void *u) { (void)u; free(p); }

static dt_backend *start(const dt_backend_iface *I, int threads)
{
    dt_backend_params p;
    memset(&p, 0, sizeof p);
    p.threads = threads;
    p.allocator.malloc_fn = t_malloc;
    p.allocator.realloc_fn = t_realloc;
    p.allocator.free_fn = t_free;
    char err[256] = "";
    dt_backend *be = NULL;
    assert_int_equal(I->init(&p, &be, err, sizeof err), DT_OK);
    assert_non_null(be);
    return be;
}

static int setup(void **state)
{
    fix *f = calloc(1, sizeof *f);
    if (!f) return -1;
    f->I = dt_backend_cpu_iface();
    f->be1 = start(f->I, 1);
    f->be3 = start(f->I, 3);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fix *f = *state;
    f->I->shutdown(f->be1);
    f->I->shutdown(f->be3);
    free(f);
    return 0;
}

/* ---------------------------------------------------------------------------
 * 2. Helpers
 * ------------------------------------------------------------------------- */
static float *fvec(int64_t n)
{
    float *p = calloc((size_t)(n > 0 ? n : 1), sizeof(float));
    assert_non_null(p);
    return p;
}

static double *dvec(int64_t n)
{
    double *p = calloc((size_t)(n > 0 ? n : 1), sizeof(double));
    assert_non_null(p);
    return p;
}

/* deterministic uniform in [-1, 1) */
static void rfill(float *x, int64_t n, uint32_t seed)
{
    uint32_t s = seed * 2654435761u + 12345u;
    for (int64_t i = 0; i < n; i++) {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        x[i] = (float)((double)(s >> 8) / 8388608.0 - 1.0);
    }
}

static void check_close(const float *got, const double *want, int64_t n, double tol,
                        const char *what)
{
    for (int64_t i = 0; i < n; i++) {
        double err = fabs((double)got[i] - want[i]);
        if (!(err <= tol * (1.0 + fabs(want[i]))))
            fail_msg("%s[%lld]: got %.9g want %.9g", what, (long long)i, (double)got[i], want[i]);
    }
}

/* The two outputs of a "1 and 3 threads, bit-identical" pair start
 * different (0xFF: NaN; 0x7F: 3.39e38), so a kernel that leaves any of its
 * output unwritten fails check_same. */
static void poison_pair(float *a, float *b, int64_t n)
{
    memset(a, 0xFF, (size_t)n * sizeof(float));
    memset(b, 0x7F, (size_t)n * sizeof(float));
}

static void check_same(const float *a, const float *b, int64_t n, const char *what)
{
    if (memcmp(a, b, (size_t)n * sizeof(float)) != 0) {
        for (int64_t i = 0; i < n; i++)
            if (memcmp(&a[i], &b[i], sizeof(float)) != 0)
                fail_msg("%s[%lld]: %.9g vs %.9g not bit-identical", what, (long long)i,
                         (double)a[i], (double)b[i]);
    }
}

static void to_d(const float *x, double *y, int64_t n)
{
    for (int64_t i = 0; i < n; i++) y[i] = x[i];
}

/* ---------------------------------------------------------------------------
 * 3. Memory
 * ------------------------------------------------------------------------- */
static void test_memory(void **state)
{
    fix *f = *state;
    const dt_backend_iface *I = f->I;
    assert_int_equal(I->version, DT_BACKEND_IFACE_VERSION);
    assert_string_equal(I->name, "cpu");
    assert_int_equal(I->host_visible, 1);
    size_t sizes[] = {0, 1, 3, 64, 1000, 4097};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        unsigned char *p = I->alloc(f->be1, sizes[s]);
        assert_non_null(p);
        assert_int_equal((uintptr_t)p % 64, 0);
        memset(p, 0xAB, sizes[s]);
        I->free(f->be1, p);
    }
    I->free(f->be1, NULL);
    float host[5] = {1, 2, 3, 4, 5}, back[5] = {0};
    float *d = I->alloc(f->be3, sizeof host), *e = I->alloc(f->be3, sizeof host);
    I->to_device(f->be3, d, host, sizeof host);
    I->copy(f->be3, e, d, sizeof host);
    I->to_host(f->be3, back, e, sizeof host);
    assert_memory_equal(back, host, sizeof host);
    I->memset0(f->be3, e, sizeof host);
    I->sync(f->be3);
    for (int i = 0; i < 5; i++) assert_true(e[i] == 0.0f);
    I->free(f->be3, d);
    I->free(f->be3, e);
}

/* This process's resident bytes (/proc/self/statm), or 0 if unknown. */
static size_t resident_bytes(void)
{
    FILE *fp = fopen("/proc/self/statm", "r");
    unsigned long size = 0, res = 0;
    int ok = fp && fscanf(fp, "%lu %lu", &size, &res) == 2;
    if (fp)
        fclose(fp);
    return ok ? (size_t)res * (size_t)sysconf(_SC_PAGESIZE) : 0;
}

/* discard gives the memory back to the system (the resident set shrinks
 * by it, not only some accounting), both the first time and after the
 * pages came back (as huge pages where THP allows), and keeps every byte
 * outside the range: a part of a huge page discarded frees that part. */
static void test_discard_frees_memory(void **state)
{
    fix *f = *state;
    const dt_backend_iface *I = f->I;
    const size_t MB = (size_t)1 << 20, n = 32 * MB;
    unsigned char *p = I->alloc(f->be1, n);
    assert_non_null(p);
    if (resident_bytes() == 0)
        skip();
    for (int round = 0; round < 2; round++) {
        memset(p, 0x5A, n);
        size_t before = resident_bytes();
        I->discard(f->be1, p, n);
        size_t after = resident_bytes();
        if (before < after + 30 * MB)
            fail_msg("round %d: resident %zu -> %zu bytes: 32 MiB discarded, under 30 left",
                     round, before, after);
        size_t first = (size_t)(-(uintptr_t)p & 4095);   /* the whole pages read as zeros */
        for (size_t i = first; i + 4096 <= n; i += 4096)
            assert_int_equal(p[i], 0);
    }
    memset(p, 0x5A, n);   /* part of it: [8 MiB + 100, 24 MiB - 100) */
    size_t before = resident_bytes();
    I->discard(f->be1, p + 8 * MB + 100, 16 * MB - 200);
    size_t after = resident_bytes();
    if (before < after + 15 * MB)
        fail_msg("resident %zu -> %zu bytes: 16 MiB discarded, under 15 left", before, after);
    for (size_t i = 0; i < 8 * MB + 100; i++)
        if (p[i] != 0x5A || p[n - 1 - i] != 0x5A)
            fail_msg("byte %zu outside the discarded range changed", i);
    I->free(f->be1, p);
}

/* ---------------------------------------------------------------------------
 * 4. GEMM
 * ------------------------------------------------------------------------- */
static void ref_gemm(int ta, int tb, int m, int n, int k, double alpha, const float *a, int lda,
                     const float *b, int ldb, double beta, const float *c0, int ldc, double *out)
{
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double s = 0;
            for (int p = 0; p < k; p++) {
                double av = ta ? a[p * lda + i] : a[i * lda + p];
                double bv = tb ? b[j * ldb + p] : b[p * ldb + j];
                s += av * bv;
            }
            out[i * n + j] = alpha * s + beta * c0[i * ldc + j];
        }
}

static void test_gemm(void **state)
{
    fix *f = *state;
    const int m = 3, n = 5, k = 7;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            int lda = (ta ? m : k) + 2, ldb = (tb ? k : n) + 1, ldc = n + 3;
            float *a = fvec((ta ? k : m) * lda), *b = fvec((tb ? n : k) * ldb), *c = fvec(m * ldc);
            float *c0 = fvec(m * ldc), *got = fvec(m * n);
            double *want = dvec(m * n);
            rfill(a, (ta ? k : m) * lda, 1);
            rfill(b, (tb ? n : k) * ldb, 2);
            rfill(c0, m * ldc, 3);
            memcpy(c, c0, sizeof(float) * (size_t)(m * ldc));
            f->I->gemm(f->be1, ta, tb, m, n, k, 0.7f, a, lda, b, ldb, 0.3f, c, ldc);
            ref_gemm(ta, tb, m, n, k, 0.7f, a, lda, b, ldb, 0.3f, c0, ldc, want);
            for (int i = 0; i < m; i++) memcpy(got + i * n, c + i * ldc, sizeof(float) * n);
            check_close(got, want, m * n, 1e-5, "gemm");
            /* padding columns of C untouched */
            for (int i = 0; i < m; i++)
                for (int j = n; j < ldc; j++) assert_true(c[i * ldc + j] == c0[i * ldc + j]);
            free(a); free(b); free(c); free(c0); free(got); free(want);
        }
    /* K = 0: C = beta C */
    float c[6] = {1, 2, 3, 4, 5, 6};
    f->I->gemm(f->be1, 0, 0, 2, 3, 0, 1.0f, NULL, 1, NULL, 3, 0.5f, c, 3);
    assert_true(c[0] == 0.5f && c[5] == 3.0f);
}

static void test_gemm_batched(void **state)
{
    fix *f = *state;
    const int batch = 3, m = 3, n = 5, k = 7;
    float *a = fvec(batch * k * m), *b = fvec(n * k), *c = fvec(batch * m * n);
    double *want = dvec(m * n);
    rfill(a, batch * k * m, 4);
    rfill(b, n * k, 5);
    /* A_i (K,M) transposed, one shared B (N,K) transposed, beta = 0 over NaN */
    for (int i = 0; i < batch * m * n; i++) c[i] = NAN;
    f->I->gemm_batched(f->be3, batch, 1, 1, m, n, k, 1.5f, a, m, k * m, b, k, 0, 0.0f, c, n, m * n);
    float zero[15] = {0};
    for (int i = 0; i < batch; i++) {
        ref_gemm(1, 1, m, n, k, 1.5, a + i * k * m, m, b, k, 0.0, zero, n, want);
        check_close(c + i * m * n, want, m * n, 1e-5, "gemm_batched");
    }
    free(a); free(b); free(c); free(want);

    /* small GEMMs are split over the pool: 4 x 64^3 with 3 threads, beta = 1 */
    const int B4 = 4, S = 64;
    float *a4 = fvec(B4 * S * S), *b4 = fvec(S * S);
    float *c4 = fvec(B4 * S * S), *c40 = fvec(B4 * S * S);
    double *w4 = dvec(S * S);
    rfill(a4, B4 * S * S, 50);
    rfill(b4, S * S, 51);
    rfill(c40, B4 * S * S, 52);
    memcpy(c4, c40, sizeof(float) * B4 * S * S);
    f->I->gemm_batched(f->be3, B4, 0, 0, S, S, S, 1.0f, a4, S, S * S, b4, S, 0, 1.0f, c4, S, S * S);
    for (int i = 0; i < B4; i++) {
        ref_gemm(0, 0, S, S, S, 1.0, a4 + i * S * S, S, b4, S, 1.0, c40 + i * S * S, S, w4);
        check_close(c4 + i * S * S, w4, S * S, 1e-5, "gemm_batched split");
    }
    free(a4); free(b4); free(c4); free(c40); free(w4);
}

/* ---------------------------------------------------------------------------
 * 5. Elementwise
 * ------------------------------------------------------------------------- */
static void test_fill_axpby(void **state)
{
    fix *f = *state;
    const int n = 105;
    float *x = fvec(n), *y = fvec(n), *y0 = fvec(n);
    double *want = dvec(n);
    f->I->fill(f->be1, n, 2.5f, y);
    for (int i = 0; i < n; i++) assert_true(y[i] == 2.5f);
    rfill(x, n, 6);
    rfill(y0, n, 7);
    memcpy(y, y0, sizeof(float) * n);
    f->I->axpby(f->be1, n, 0.5f, x, -2.0f, y);
    for (int i = 0; i < n; i++) want[i] = 0.5 * x[i] - 2.0 * y0[i];
    check_close(y, want, n, 1e-6, "axpby");
    memcpy(y, y0, sizeof(float) * n);
    f->I->axpby(f->be1, n, 1.0f, x, 1.0f, y);
    for (int i = 0; i < n; i++) want[i] = (double)x[i] + y0[i];
    check_close(y, want, n, 1e-6, "axpby beta=1");
    for (int i = 0; i < n; i++) y[i] = NAN; /* beta = 0 must not read y */
    f->I->axpby(f->be1, n, 3.0f, x, 0.0f, y);
    for (int i = 0; i < n; i++) want[i] = 3.0 * x[i];
    check_close(y, want, n, 1e-6, "axpby beta=0");
    free(x); free(y); free(y0); free(want);
}

static double ref_unary(dt_unary_op op, double x)
{
    switch (op) {
    case DT_UNARY_RELU: return x > 0 ? x : 0;
    case DT_UNARY_GELU: return 0.5 * x * (1.0 + erf(x / sqrt(2.0)));
    case DT_UNARY_TANH: return tanh(x);
    case DT_UNARY_SIGMOID: return 1.0 / (1.0 + exp(-x));
    case DT_UNARY_GELU_TANH:
        return 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
    case DT_UNARY_EXP: return exp(x);
    case DT_UNARY_LOG: return log(x);
    case DT_UNARY_SQRT: return sqrt(x);
    }
    return 0;
}

static void test_unary(void **state)
{
    fix *f = *state;
    const int n = 3 * 5 * 7;
    float *x = fvec(n), *y = fvec(n), *dy = fvec(n), *dx = fvec(n), *dx0 = fvec(n);
    double *want = dvec(n);
    rfill(x, n, 8);
    for (int i = 0; i < n; i++) x[i] *= 4.0f; /* [-4, 4): gelu/tanh/sigmoid tails */
    x[0] = 0.0f;
    rfill(dy, n, 9);
    rfill(dx0, n, 10);
    float *xpos = fvec(n);   /* log, sqrt: (0.25, 4.25) */
    for (int i = 0; i < n; i++) xpos[i] = fabsf(x[i]) + 0.25f;
    for (int op = 0; op < 8; op++) {
        float *xs = x;
        if (op == DT_UNARY_LOG || op == DT_UNARY_SQRT) {
            x = xpos;
        }
        f->I->unary(f->be1, (dt_unary_op)op, n, x, y);
        for (int i = 0; i < n; i++) want[i] = ref_unary((dt_unary_op)op, x[i]);
        check_close(y, want, n, 2e-6, "unary");
        /* derivative by central differences in double (relu: its definition) */
        for (int acc = 0; acc < 2; acc++) {
            memcpy(dx, dx0, sizeof(float) * n);
            f->I->unary_backward(f->be1, (dt_unary_op)op, n, x, y, dy, dx, acc);
            for (int i = 0; i < n; i++) {
                double h = 1e-5, d;
                if (op == DT_UNARY_RELU)
                    d = x[i] > 0 ? 1.0 : 0.0;
                else
                    d = (ref_unary((dt_unary_op)op, x[i] + h) -
                         ref_unary((dt_unary_op)op, x[i] - h)) / (2 * h);
                want[i] = dy[i] * d + (acc ? dx0[i] : 0.0);
            }
            check_close(dx, want, n, 1e-5, "unary_backward");
        }
        x = xs;
    }
    free(xpos);
    /* in place, and the pool: 1 and 3 threads agree */
    const int big = 200003;
    float *a = fvec(big), *b = fvec(big);
    rfill(a, big, 11);
    memcpy(b, a, sizeof(float) * big);
    f->I->unary(f->be1, DT_UNARY_GELU, big, a, a);
    f->I->unary(f->be3, DT_UNARY_GELU, big, b, b);
    check_same(a, b, big, "gelu threads");
    rfill(b, big, 11);   /* in place: both must also be GELU of the input */
    for (int i = 0; i < big; i += 997)
        assert_true(fabs(a[i] - ref_unary(DT_UNARY_GELU, b[i])) < 1e-6);
    free(a); free(b);
    free(x); free(y); free(dy); free(dx); free(dx0); free(want);
}

/* ---------------------------------------------------------------------------
 * 6. Strided: binary, copy_strided, sum_to
 * ------------------------------------------------------------------------- */
static double ref_bin(dt_binary_op op, double a, double b)
{
    switch (op) {
    case DT_BIN_ADD: return a + b;
    case DT_BIN_SUB: return a - b;
    case DT_BIN_MUL: return a * b;
    case DT_BIN_DIV: return a / b;
    case DT_BIN_KEEP: return b != 0 ? a : 0;
    case DT_BIN_DROP: return b != 0 ? 0 : a;
    case DT_BIN_POW: return pow(a, b);
    }
    return 0;
}

static void test_binary(void **state)
{
    fix *f = *state;
    const int64_t shape[3] = {3, 5, 7};
    const int n = 105;
    float *a = fvec(n), *b = fvec(n), *out = fvec(n);
    double *want = dvec(n);
    rfill(a, n, 12);
    rfill(b, n, 13);
    for (int i = 0; i < n; i++) b[i] += 2.0f; /* safe divisor */
    float *apos = fvec(n), *mask = fvec(n);   /* pow's bases > 0; keep/drop's 0/1 masks */
    for (int i = 0; i < n; i++) {
        apos[i] = fabsf(a[i]) + 0.1f;
        mask[i] = (float)(i % 3 == 0);
    }
    /* a stored as (7,5,3) read transposed; b cases: contiguous, (1,5,1), scalar, (3,1,7) */
    const int64_t at[3] = {1, 3, 15}, ac[3] = {35, 7, 1};
    const int64_t bs[4][3] = {{35, 7, 1}, {0, 1, 0}, {0, 0, 0}, {7, 0, 1}};
    for (int op = 0; op < 7; op++)
        for (int bc = 0; bc < 4; bc++)
            for (int t = 0; t < 2; t++) {
                const int64_t *as = t ? at : ac;
                const float *av = op == DT_BIN_POW ? apos : a;
                const float *bv = op == DT_BIN_KEEP || op == DT_BIN_DROP ? mask : b;
                f->I->binary(f->be1, (dt_binary_op)op, 3, shape, av, as, bv, bs[bc], out);
                for (int i = 0; i < 3; i++)
                    for (int j = 0; j < 5; j++)
                        for (int k = 0; k < 7; k++)
                            want[(i * 5 + j) * 7 + k] = ref_bin(
                                (dt_binary_op)op, av[i * as[0] + j * as[1] + k * as[2]],
                                bv[i * bs[bc][0] + j * bs[bc][1] + k * bs[bc][2]]);
                check_close(out, want, n, op == DT_BIN_POW ? 2e-6 : 1e-6, "binary");
            }
    free(apos);
    free(mask);
    /* large row broadcast through the pool */
    const int64_t big[2] = {1000, 257};
    const int64_t cs[2] = {257, 1}, rs[2] = {0, 1};
    float *x = fvec(1000 * 257), *row = fvec(257), *o1 = fvec(1000 * 257), *o3 = fvec(1000 * 257);
    rfill(x, 1000 * 257, 14);
    rfill(row, 257, 15);
    poison_pair(o1, o3, 1000 * 257);
    f->I->binary(f->be1, DT_BIN_MUL, 2, big, x, cs, row, rs, o1);
    f->I->binary(f->be3, DT_BIN_MUL, 2, big, x, cs, row, rs, o3);
    check_same(o1, o3, 1000 * 257, "binary threads");
    for (int i = 0; i < 1000 * 257; i++) assert_true(o3[i] == x[i] * row[i % 257]);
    free(x); free(row); free(o1); free(o3);
    free(a); free(b); free(out); free(want);
}

static void test_copy_strided(void **state)
{
    fix *f = *state;
    const int64_t shape[3] = {3, 5, 7};
    const int n = 105;
    float *src = fvec(n), *dst = fvec(n), *dst0 = fvec(n);
    double *want = dvec(n);
    rfill(src, n, 15);
    rfill(dst0, n, 16);
    /* permute (3,5,7) -> dst (7,3,5) contiguous: dst strides (5, 1, 15) */
    const int64_t ss[3] = {35, 7, 1}, ds[3] = {5, 1, 15};
    for (int acc = 0; acc < 2; acc++) {
        memcpy(dst, dst0, sizeof(float) * n);
        f->I->copy_strided(f->be1, 3, shape, 4, dst, ds, src, ss, acc);
        for (int i = 0; i < 3; i++)
            for (int j = 0; j < 5; j++)
                for (int k = 0; k < 7; k++) {
                    int d = i * 5 + j + k * 15;
                    want[d] = (double)src[(i * 5 + j) * 7 + k] + (acc ? (double)dst0[d] : 0.0);
                }
        check_close(dst, want, n, 1e-6, "copy_strided");
    }
    /* u8 slice: every 2nd column of a (2, 10) buffer into (2, 3) */
    uint8_t bytes[20], out8[6];
    for (int i = 0; i < 20; i++) bytes[i] = (uint8_t)(i * 7);
    const int64_t s8[2] = {2, 3}, st8[2] = {10, 2}, d8[2] = {3, 1};
    f->I->copy_strided(f->be1, 2, s8, 1, out8, d8, bytes + 1, st8, 0);
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 3; j++) assert_int_equal(out8[i * 3 + j], bytes[1 + i * 10 + j * 2]);
    /* batched transposes (4, 300, 201) -> (4, 201, 300), both thread counts */
    const int64_t ts[3] = {4, 300, 201};
    const int64_t tsrc[3] = {300 * 201, 201, 1}, tdst[3] = {300 * 201, 1, 300};
    int64_t tn = 4 * 300 * 201;
    float *t = fvec(tn), *u1 = fvec(tn), *u3 = fvec(tn);
    rfill(t, tn, 17);
    f->I->copy_strided(f->be1, 3, ts, 4, u1, tdst, t, tsrc, 0);
    f->I->copy_strided(f->be3, 3, ts, 4, u3, tdst, t, tsrc, 0);
    f->I->copy_strided(f->be3, 3, ts, 4, u3, tdst, t, tsrc, 1); /* accumulate: 2x */
    for (int b = 0; b < 4; b++)
        for (int i = 0; i < 300; i++)
            for (int j = 0; j < 201; j++) {
                float v = t[(b * 300 + i) * 201 + j];
                assert_true(u1[(b * 201 + j) * 300 + i] == v);
                assert_true(u3[(b * 201 + j) * 300 + i] == 2.0f * v);
            }
    free(t); free(u1); free(u3);
    free(src); free(dst); free(dst0); free(want);
}

/* dst[dst_strides] (+)= sum over dims with stride 0, the dumb way */
static void ref_sum_to(const int64_t *shape, const float *src, const int64_t *dst_strides,
                       int64_t dst_n, const float *dst0, int acc, double *want)
{
    for (int64_t i = 0; i < dst_n; i++) want[i] = acc ? dst0[i] : 0.0;
    int64_t n = shape[0] * shape[1] * shape[2];
    for (int64_t e = 0; e < n; e++) {
        int64_t i = e / (shape[1] * shape[2]), j = (e / shape[2]) % shape[1], k = e % shape[2];
        want[i * dst_strides[0] + j * dst_strides[1] + k * dst_strides[2]] += src[e];
    }
}

static void test_sum_to(void **state)
{
    fix *f = *state;
    const int64_t shape[3] = {3, 5, 7};
    const int n = 105;
    float *src = fvec(n), *dst = fvec(n), *dst0 = fvec(n);
    double *want = dvec(n);
    rfill(src, n, 18);
    rfill(dst0, n, 19);
    struct { int64_t st[3]; int64_t n; } cases[] = {
        {{0, 1, 0}, 5}, {{7, 0, 1}, 21}, {{0, 0, 0}, 1}, {{5, 1, 0}, 15}, {{35, 7, 1}, 105},
        {{1, 0, 0}, 3}, {{0, 7, 1}, 35}, {{1, 3, 0}, 15} /* (3,5,1) stored transposed */,
        {{0, 1, 5}, 35} /* (5,7) stored transposed */};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int acc = 0; acc < 2; acc++) {
            memcpy(dst, dst0, sizeof(float) * n);
            f->I->sum_to(f->be1, 3, shape, src, dst, cases[c].st, acc);
            ref_sum_to(shape, src, cases[c].st, cases[c].n, dst0, acc, want);
            check_close(dst, want, cases[c].n, 1e-6, "sum_to");
        }
    free(src); free(dst); free(dst0); free(want);
}

/* ---------------------------------------------------------------------------
 * 7. Reductions and their thread-count independence
 * ------------------------------------------------------------------------- */
static void test_reduce_axis(void **state)
{
    fix *f = *state;
    const int n = 105;
    float *x = fvec(n), *y = fvec(n);
    double *want = dvec(n);
    rfill(x, n, 20);
    const int64_t splits[4][3] = {{3, 5, 7}, {1, 3, 35}, {15, 7, 1}, {105, 1, 1}};
    for (int s = 0; s < 4; s++) {
        int64_t O = splits[s][0], L = splits[s][1], In = splits[s][2];
        for (int op = 0; op < 2; op++) {
            f->I->reduce_axis(f->be1, (dt_axis_op)op, O, L, In, x, y);
            for (int64_t o = 0; o < O; o++)
                for (int64_t i = 0; i < In; i++) {
                    double acc = op == DT_RED_SUM ? 0.0 : -INFINITY;
                    for (int64_t l = 0; l < L; l++) {
                        double v = x[(o * L + l) * In + i];
                        acc = op == DT_RED_SUM ? acc + v : (v > acc ? v : acc);
                    }
                    want[o * In + i] = acc;
                }
            check_close(y, want, O * In, 1e-6, op ? "reduce max" : "reduce sum");
        }
    }
    free(x); free(y); free(want);
}

static void test_sum_sumsq_threads(void **state)
{
    fix *f = *state;
    const int64_t n = 1000003;
    float *x = fvec(n), s1, s3;
    rfill(x, n, 21);
    double want = 0, want_sq = 0;
    for (int64_t i = 0; i < n; i++) {
        want += x[i];
        want_sq += (double)x[i] * x[i];
    }
    f->I->sum(f->be1, n, x, &s1);
    f->I->sum(f->be3, n, x, &s3);
    assert_memory_equal(&s1, &s3, sizeof s1);
    assert_true(fabs(s1 - want) <= 1e-6 * fabs(want) + 1e-3);
    double q1 = f->I->sumsq(f->be1, n, x), q3 = f->I->sumsq(f->be3, n, x);
    assert_memory_equal(&q1, &q3, sizeof q1);
    assert_true(fabs(q1 - want_sq) <= 1e-9 * want_sq);
    /* small and empty */
    float z = 7.0f;
    f->I->sum(f->be1, 0, x, &z);
    assert_true(z == 0.0f);
    f->I->sum(f->be1, 3, x, &z);
    assert_true(fabs(z - ((double)x[0] + x[1] + x[2])) < 1e-6);
    free(x);
}

/* big reductions with the pool: 1 and 3 threads bit-identical, and right */
static void test_reductions_threads(void **state)
{
    fix *f = *state;
    const int64_t N = 64, C = 33, P = 500, n = N * C * P;
    float *x = fvec(n), *a = fvec(C * P), *b = fvec(C * P);
    double *want = dvec(C * P);
    rfill(x, n, 22);
    /* bias_grad over (N, C, P) */
    poison_pair(a, b, C * P);
    f->I->bias_grad(f->be1, N, C, P, x, a, 0);
    f->I->bias_grad(f->be3, N, C, P, x, b, 0);
    check_same(a, b, C, "bias_grad threads");
    for (int64_t c = 0; c < C; c++) {
        want[c] = 0;
        for (int64_t i = 0; i < N; i++)
            for (int64_t p = 0; p < P; p++) want[c] += x[(i * C + c) * P + p];
    }
    check_close(a, want, C, 1e-6, "bias_grad");
    /* reduce over the outer dim (column sums) and the inner dim (row sums) */
    poison_pair(a, b, C * P);
    f->I->reduce_axis(f->be1, DT_RED_SUM, 1, N, C * P, x, a);
    f->I->reduce_axis(f->be3, DT_RED_SUM, 1, N, C * P, x, b);
    check_same(a, b, C * P, "reduce cols threads");
    poison_pair(a, b, C * P);
    f->I->reduce_axis(f->be1, DT_RED_SUM, N * C, P, 1, x, a);
    f->I->reduce_axis(f->be3, DT_RED_SUM, N * C, P, 1, x, b);
    check_same(a, b, N * C, "reduce rows threads");
    /* one long sum_to into a scalar */
    const int64_t shp[3] = {N, C, P}, zero[3] = {0, 0, 0};
    poison_pair(a, b, C * P);
    f->I->sum_to(f->be1, 3, shp, x, a, zero, 0);
    f->I->sum_to(f->be3, 3, shp, x, b, zero, 0);
    check_same(a, b, 1, "sum_to scalar threads");
    float s;
    f->I->sum(f->be3, n, x, &s);
    assert_memory_equal(&s, a, sizeof s); /* same blocks, same order */
    free(x); free(a); free(b); free(want);
}

/* ---------------------------------------------------------------------------
 * 8. Softmax and cross entropy
 * ------------------------------------------------------------------------- */
static void test_softmax(void **state)
{
    fix *f = *state;
    const int n = 105;
    float *x = fvec(n), *y = fvec(n), *dy = fvec(n), *dx = fvec(n), *dx0 = fvec(n);
    double *want = dvec(n), *p = dvec(n);
    rfill(x, n, 23);
    for (int i = 0; i < n; i++) x[i] *= 5.0f;
    rfill(dy, n, 24);
    rfill(dx0, n, 25);
    const int64_t splits[2][3] = {{3, 5, 7}, {15, 7, 1}};
    for (int s = 0; s < 2; s++) {
        int64_t O = splits[s][0], L = splits[s][1], In = splits[s][2];
        for (int o = 0; o < O; o++) /* reference probabilities in double */
            for (int i = 0; i < In; i++) {
                double z = 0;
                for (int l = 0; l < L; l++) z += exp(x[(o * L + l) * In + i]);
                for (int l = 0; l < L; l++)
                    p[(o * L + l) * In + i] = exp(x[(o * L + l) * In + i]) / z;
            }
        for (int lg = 0; lg < 2; lg++) {
            f->I->softmax(f->be1, O, L, In, x, y, lg);
            for (int i = 0; i < n; i++) want[i] = lg ? log(p[i]) : p[i];
            check_close(y, want, n, 1e-5, "softmax");
            for (int acc = 0; acc < 2; acc++) {
                memcpy(dx, dx0, sizeof(float) * n);
                f->I->softmax_backward(f->be1, O, L, In, y, dy, dx, lg, acc);
                /* Jacobian-vector product from the reference probabilities */
                for (int o = 0; o < O; o++)
                    for (int i = 0; i < In; i++)
                        for (int l = 0; l < L; l++) {
                            int e = (o * L + l) * In + i;
                            double g = 0;
                            for (int m = 0; m < L; m++) {
                                int q = (o * L + m) * In + i;
                                double jac = lg ? (l == m) - p[e] : p[q] * ((l == m) - p[e]);
                                g += dy[q] * jac; /* d out_q / d x_e */
                            }
                            want[e] = g + (acc ? dx0[e] : 0.0);
                        }
                check_close(dx, want, n, 1e-5, "softmax_backward");
            }
        }
    }
    free(x); free(y); free(dy); free(dx); free(dx0); free(want); free(p);
}

/* xent over n rows of c classes (large logits: they need the max shift):
 * each row's max and 1/sum, the loss and the gradient against fp64 */
static void xent_case(fix *f, int n, int c, uint32_t seed)
{
    float *x = fvec(n * c), *rows = fvec(2 * n), *d = fvec(n * c), *d0 = fvec(n * c), loss;
    double *p = dvec(n * c), *want = dvec(n * c);
    int32_t *labels = malloc(sizeof(int32_t) * (size_t)n);
    rfill(x, n * c, seed);
    for (int i = 0; i < n * c; i++) x[i] = x[i] * 30.0f + 50.0f;
    for (int r = 0; r < n; r++) labels[r] = (int32_t)((r * 5 + 3) % c);
    assert_int_equal(f->I->xent_forward(f->be1, n, c, x, labels, DT_XENT_KEEP_ALL, n, rows, &loss), -1);
    double total = 0;
    for (int r = 0; r < n; r++) {
        double m = -INFINITY, z = 0;
        for (int j = 0; j < c; j++) m = fmax(m, x[r * c + j]);
        for (int j = 0; j < c; j++) z += exp(x[r * c + j] - m);
        for (int j = 0; j < c; j++) p[r * c + j] = exp(x[r * c + j] - m) / z;
        total += log(z) + m - x[r * c + labels[r]];
        if (rows[2 * r] != (float)m) fail_msg("xent row %d: max %g, want %g", r, rows[2 * r], m);
        want[r] = 1.0 / z;
    }
    for (int r = 0; r < n; r++)   /* 1/sum, rows[2r + 1], against want[0..n) */
        if (fabs(rows[2 * r + 1] - want[r]) > 1e-5 * fabs(want[r]))
            fail_msg("xent row %d (c %d): 1/sum %g, want %g", r, c, rows[2 * r + 1], want[r]);
    assert_true(fabs(loss - total / n) < 1e-5 * (1 + total / n));
    /* backward: (p - onehot) * dloss / n, the softmax rebuilt from rows */
    float dloss = 2.0f;
    rfill(d0, n * c, seed + 1);
    for (int acc = 0; acc < 2; acc++) {
        memcpy(d, d0, sizeof(float) * n * c);
        f->I->xent_backward(f->be1, n, c, x, rows, labels, DT_XENT_KEEP_ALL, n, &dloss, d, acc);
        for (int r = 0; r < n; r++)
            for (int j = 0; j < c; j++)
                want[r * c + j] = (p[r * c + j] - (j == labels[r])) * 2.0 / n +
                                  (acc ? d0[r * c + j] : 0.0);
        check_close(d, want, n * c, 1e-6, "xent_backward");
    }
    free(x); free(rows); free(d); free(d0); free(p); free(want); free(labels);
}

static void test_xent(void **state)
{
    fix *f = *state;
    xent_case(f, 5, 7, 26);
    xent_case(f, 3, 5000, 28);   /* rows longer than a summation block (DT_CPU_RED_BLOCK) */
    /* bad labels: the first one is reported */
    const int n = 5, c = 7;
    float *x = fvec(n * c), *rows = fvec(2 * n), loss;
    rfill(x, n * c, 26);
    int32_t bad[5] = {0, -1, 7, 3, 1};
    assert_int_equal(f->I->xent_forward(f->be1, n, c, x, bad, DT_XENT_KEEP_ALL, n, rows, &loss), 1);
    bad[1] = 2;
    assert_int_equal(f->I->xent_forward(f->be1, n, c, x, bad, DT_XENT_KEEP_ALL, n, rows, &loss), 2);
    free(x); free(rows);
}

/* ---------------------------------------------------------------------------
 * 9. Convolution helpers
 * ------------------------------------------------------------------------- */
static dt_conv_geom geom(int64_t n, int64_t c, int64_t h, int64_t w, int64_t kh, int64_t kw,
                         int64_t s, int64_t p)
{
    dt_conv_geom g = {n, c, h, w, kh, kw, s, p, (h + 2 * p - kh) / s + 1, (w + 2 * p - kw) / s + 1};
    return g;
}

/* value of col[r, j] by the definition */
static float ref_col(const dt_conv_geom *g, const float *x, int64_t r, int64_t j)
{
    int64_t kj = r % g->kw, ki = (r / g->kw) % g->kh, c = r / (g->kw * g->kh);
    int64_t P = g->oh * g->ow, n = j / P, oh = (j % P) / g->ow, ow = j % g->ow;
    int64_t ih = oh * g->stride - g->pad + ki, iw = ow * g->stride - g->pad + kj;
    if (ih < 0 || ih >= g->h || iw < 0 || iw >= g->w) return 0.0f;
    return x[((n * g->c + c) * g->h + ih) * g->w + iw];
}

static void check_im2col(fix *f, dt_backend *be, dt_conv_geom g)
{
    int64_t xn = g.n * g.c * g.h * g.w, rows = g.c * g.kh * g.kw, cols = g.n * g.oh * g.ow;
    float *x = fvec(xn), *col = fvec(rows * cols), *dx = fvec(xn), *dx0 = fvec(xn);
    double *want = dvec(xn);
    rfill(x, xn, 28);
    f->I->im2col(be, &g, x, col);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < cols; j++)
            if (col[r * cols + j] != ref_col(&g, x, r, j))
                fail_msg("im2col[%lld,%lld]", (long long)r, (long long)j);
    /* col2im is the adjoint: dx[e] = sum of the col entries that read e */
    rfill(col, rows * cols, 29);
    rfill(dx0, xn, 30);
    for (int acc = 0; acc < 2; acc++) {
        memcpy(dx, dx0, sizeof(float) * (size_t)xn);
        f->I->col2im(be, &g, col, dx, acc);
        for (int64_t e = 0; e < xn; e++) want[e] = acc ? dx0[e] : 0.0;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < cols; j++) {
                int64_t kj = r % g.kw, ki = (r / g.kw) % g.kh, c = r / (g.kw * g.kh);
                int64_t P = g.oh * g.ow, n = j / P, oh = (j % P) / g.ow, ow = j % g.ow;
                int64_t ih = oh * g.stride - g.pad + ki, iw = ow * g.stride - g.pad + kj;
                if (ih >= 0 && ih < g.h && iw >= 0 && iw < g.w)
                    want[((n * g.c + c) * g.h + ih) * g.w + iw] += col[r * cols + j];
            }
        check_close(dx, want, xn, 1e-6, "col2im");
    }
    free(x); free(col); free(dx); free(dx0); free(want);
}

static void test_im2col(void **state)
{
    fix *f = *state;
    check_im2col(f, f->be1, geom(2, 3, 7, 6, 3, 3, 2, 1)); /* stride 2 pad 1 */
    check_im2col(f, f->be1, geom(2, 3, 7, 6, 3, 3, 1, 1));
    check_im2col(f, f->be1, geom(1, 2, 5, 8, 3, 2, 1, 1)); /* kh != kw */
    check_im2col(f, f->be1, geom(2, 1, 9, 9, 5, 5, 3, 2));
    check_im2col(f, f->be3, geom(16, 32, 14, 14, 3, 3, 1, 1)); /* the CNN shape, pooled */
}

static void test_layout_and_bias(void **state)
{
    fix *f = *state;
    const int C = 3, N = 5, P = 7;
    float *src = fvec(C * N * P), *mid = fvec(C * N * P), *back = fvec(C * N * P);
    rfill(src, C * N * P, 31);
    f->I->cnp_to_ncp(f->be1, C, N, P, src, mid); /* (C, N*P) -> (N, C, P) */
    for (int c = 0; c < C; c++)
        for (int n = 0; n < N; n++)
            for (int p = 0; p < P; p++)
                assert_true(mid[(n * C + c) * P + p] == src[c * N * P + n * P + p]);
    f->I->ncp_to_cnp(f->be1, N, C, P, mid, back);
    assert_memory_equal(back, src, sizeof(float) * C * N * P);
    /* bias_add / bias_grad on (N, C, P) and (N, C, 1) */
    float bias[3] = {0.5f, -1.0f, 2.0f}, db[3], db0[3] = {1, 2, 3};
    double want[3];
    for (int inner = 1; inner <= P; inner += P - 1) {
        memcpy(mid, src, sizeof(float) * C * N * P);
        f->I->bias_add(f->be1, N, C, inner, bias, mid);
        for (int i = 0; i < N * C * inner; i++)
            assert_true(mid[i] == src[i] + bias[(i / inner) % C]);
        for (int acc = 0; acc < 2; acc++) {
            memcpy(db, db0, sizeof db);
            f->I->bias_grad(f->be1, N, C, inner, src, db, acc);
            for (int c = 0; c < C; c++) {
                want[c] = acc ? db0[c] : 0.0;
                for (int n = 0; n < N; n++)
                    for (int p = 0; p < inner; p++) want[c] += src[(n * C + c) * inner + p];
            }
            check_close(db, want, C, 1e-6, "bias_grad");
        }
    }
    free(src); free(mid); free(back);
}

/* ---------------------------------------------------------------------------
 * 10. Pooling
 * ------------------------------------------------------------------------- */
/* maxpool by the definition: first maximum in row-major window order */
static void check_maxpool(fix *f, dt_backend *be, dt_conv_geom g, uint32_t seed)
{
    int64_t HW = g.h * g.w, P = g.oh * g.ow, planes = g.n * g.c, xn = planes * HW, yn = planes * P;
    float *x = fvec(xn), *y = fvec(yn), *dy = fvec(yn), *dx = fvec(xn), *dx0 = fvec(xn);
    int32_t *am = calloc((size_t)yn, sizeof *am);
    double *want = dvec(xn);
    rfill(x, xn, seed);
    for (int64_t i = 0; i < xn; i++) x[i] = floorf(x[i] * 3.0f); /* ties: first max wins */
    f->I->maxpool_forward(be, &g, x, y, am);
    for (int64_t pl = 0; pl < planes; pl++)
        for (int64_t oh = 0; oh < g.oh; oh++)
            for (int64_t ow = 0; ow < g.ow; ow++) {
                int64_t best = -1;
                for (int64_t ki = 0; ki < g.kh; ki++)
                    for (int64_t kj = 0; kj < g.kh; kj++) {
                        int64_t ih = oh * g.stride - g.pad + ki, iw = ow * g.stride - g.pad + kj;
                        if (ih < 0 || ih >= g.h || iw < 0 || iw >= g.w) continue;
                        if (best < 0 || x[pl * HW + ih * g.w + iw] > x[pl * HW + best])
                            best = ih * g.w + iw;
                    }
                int64_t o = pl * P + oh * g.ow + ow;
                if (am[o] != best)
                    fail_msg("maxpool argmax[%lld]: %d want %lld", (long long)o, am[o],
                             (long long)best);
                assert_true(y[o] == x[pl * HW + best]);
            }
    rfill(dy, yn, seed + 1);
    rfill(dx0, xn, seed + 2);
    for (int acc = 0; acc < 2; acc++) {
        memcpy(dx, dx0, sizeof(float) * (size_t)xn);
        f->I->maxpool_backward(be, &g, dy, am, dx, acc);
        for (int64_t i = 0; i < xn; i++) want[i] = acc ? dx0[i] : 0.0;
        for (int64_t o = 0; o < yn; o++) want[(o / P) * HW + am[o]] += dy[o];
        check_close(dx, want, xn, 1e-6, "maxpool_backward");
    }
    free(x); free(y); free(dy); free(dx); free(dx0); free(am); free(want);
}

static void test_maxpool(void **state)
{
    fix *f = *state;
    check_maxpool(f, f->be1, geom(2, 3, 7, 6, 3, 3, 2, 1), 32); /* k3 with padding */
    check_maxpool(f, f->be1, geom(2, 3, 8, 6, 2, 2, 2, 0), 33); /* k2 s2, the CNN case */
    check_maxpool(f, f->be1, geom(1, 2, 9, 11, 4, 4, 3, 2), 34); /* generic k, clipped */
    check_maxpool(f, f->be3, geom(16, 16, 28, 28, 2, 2, 2, 0), 35); /* through the pool */
    /* windows entirely in the padding report -1 and are skipped backward */
    dt_conv_geom pg = geom(1, 1, 2, 2, 1, 1, 1, 1); /* 4x4 output, border all padding */
    float px[4] = {1, 2, 3, 4}, py[16], pdy[16], pdx[4];
    int32_t pam[16];
    f->I->maxpool_forward(f->be1, &pg, px, py, pam);
    for (int i = 0; i < 16; i++) {
        int oh = i / 4, ow = i % 4, inside = oh >= 1 && oh <= 2 && ow >= 1 && ow <= 2;
        assert_int_equal(pam[i], inside ? (oh - 1) * 2 + (ow - 1) : -1);
        pdy[i] = 1.0f;
    }
    f->I->maxpool_backward(f->be1, &pg, pdy, pam, pdx, 0);
    for (int i = 0; i < 4; i++) assert_true(pdx[i] == 1.0f);
    /* a NaN in the window wins, as in PyTorch */
    dt_conv_geom ng = geom(1, 1, 2, 2, 2, 2, 2, 0);
    float nx[4] = {1, NAN, 5, 2}, ny[1];
    int32_t nam[1];
    f->I->maxpool_forward(f->be1, &ng, nx, ny, nam);
    assert_true(isnan(ny[0]));
    assert_int_equal(nam[0], 1);
}

static void check_avgpool(fix *f, dt_conv_geom g, uint32_t seed)
{
    int64_t HW = g.h * g.w, P = g.oh * g.ow, planes = g.n * g.c, xn = planes * HW, yn = planes * P;
    int64_t k = g.kh;
    float *x = fvec(xn), *y = fvec(yn), *dy = fvec(yn), *dx = fvec(xn), *dx0 = fvec(xn);
    double *want = dvec(xn > yn ? xn : yn);
    rfill(x, xn, seed);
    f->I->avgpool_forward(f->be1, &g, x, y);
    for (int64_t pl = 0; pl < planes; pl++)
        for (int64_t oh = 0; oh < g.oh; oh++)
            for (int64_t ow = 0; ow < g.ow; ow++) {
                double s = 0;
                for (int64_t ki = 0; ki < k; ki++)
                    for (int64_t kj = 0; kj < k; kj++) {
                        int64_t ih = oh * g.stride - g.pad + ki, iw = ow * g.stride - g.pad + kj;
                        if (ih >= 0 && ih < g.h && iw >= 0 && iw < g.w)
                            s += x[pl * HW + ih * g.w + iw];
                    }
                want[pl * P + oh * g.ow + ow] = s / (double)(k * k); /* padding counts */
            }
    check_close(y, want, yn, 1e-6, "avgpool");
    rfill(dy, yn, seed + 1);
    rfill(dx0, xn, seed + 2);
    for (int acc = 0; acc < 2; acc++) {
        memcpy(dx, dx0, sizeof(float) * (size_t)xn);
        f->I->avgpool_backward(f->be1, &g, dy, dx, acc);
        for (int64_t i = 0; i < xn; i++) want[i] = acc ? dx0[i] : 0.0;
        for (int64_t pl = 0; pl < planes; pl++)
            for (int64_t oh = 0; oh < g.oh; oh++)
                for (int64_t ow = 0; ow < g.ow; ow++)
                    for (int64_t ki = 0; ki < k; ki++)
                        for (int64_t kj = 0; kj < k; kj++) {
                            int64_t ih = oh * g.stride - g.pad + ki;
                            int64_t iw = ow * g.stride - g.pad + kj;
                            double v = dy[pl * P + oh * g.ow + ow] / (double)(k * k);
                            if (ih >= 0 && ih < g.h && iw >= 0 && iw < g.w)
                                want[pl * HW + ih * g.w + iw] += v;
                        }
        check_close(dx, want, xn, 1e-6, "avgpool_backward");
    }
    free(x); free(y); free(dy); free(dx); free(dx0); free(want);
}

static void test_avgpool(void **state)
{
    fix *f = *state;
    check_avgpool(f, geom(2, 3, 7, 6, 3, 3, 2, 1), 36);
    check_avgpool(f, geom(2, 3, 8, 6, 2, 2, 2, 0), 37);
    check_avgpool(f, geom(1, 2, 7, 7, 3, 3, 1, 1), 38); /* overlapping windows */
}

/* ---------------------------------------------------------------------------
 * 11. Embedding
 * ------------------------------------------------------------------------- */
static void test_embedding(void **state)
{
    fix *f = *state;
    const int V = 6, D = 7, N = 5;
    int32_t idx[5] = {2, 0, 2, 5, 2};
    float *w = fvec(V * D), *y = fvec(N * D), *dy = fvec(N * D);
    float *dw = fvec(V * D), *dw0 = fvec(V * D);
    double *want = dvec(V * D);
    rfill(w, V * D, 38);
    f->I->embedding_forward(f->be1, N, D, w, idx, y);
    for (int i = 0; i < N; i++) assert_memory_equal(y + i * D, w + idx[i] * D, sizeof(float) * D);
    rfill(dy, N * D, 39);
    rfill(dw0, V * D, 40);
    memcpy(dw, dw0, sizeof(float) * V * D);
    f->I->embedding_backward(f->be1, N, D, idx, dy, dw);
    to_d(dw0, want, V * D);
    for (int i = 0; i < N; i++)
        for (int j = 0; j < D; j++) want[idx[i] * D + j] += dy[i * D + j];
    check_close(dw, want, V * D, 1e-6, "embedding_backward"); /* rows 1, 3, 4 untouched too */
    assert_int_equal(f->I->index_check(f->be1, N, idx, V), -1);
    int32_t bad[4] = {0, -1, 6, 1};
    assert_int_equal(f->I->index_check(f->be1, 4, bad, V), 1);
    assert_int_equal(f->I->index_check(f->be1, 4, bad + 2, V), 0);
    free(w); free(y); free(dy); free(dw); free(dw0); free(want);
}

/* ---------------------------------------------------------------------------
 * 12. Layer norm: forward by definition, backward by central differences of
 *     L = sum(dy * y) computed in double
 * ------------------------------------------------------------------------- */
static double ln_loss(int rows, int d, const double *x, const double *w, const double *b,
                      double eps, const float *dy)
{
    double L = 0;
    for (int r = 0; r < rows; r++) {
        double mu = 0, var = 0;
        for (int j = 0; j < d; j++) mu += x[r * d + j];
        mu /= d;
        for (int j = 0; j < d; j++) var += (x[r * d + j] - mu) * (x[r * d + j] - mu);
        var /= d;
        for (int j = 0; j < d; j++) {
            double yv = (x[r * d + j] - mu) / sqrt(var + eps) * (w ? w[j] : 1.0) + (b ? b[j] : 0.0);
            L += dy[r * d + j] * yv;
        }
    }
    return L;
}

static void test_layernorm(void **state)
{
    fix *f = *state;
    const int R = 5, D = 7, n = R * D;
    const float eps = 1e-5f;
    float *x = fvec(n), *w = fvec(D), *b = fvec(D), *y = fvec(n), *mean = fvec(R), *rstd = fvec(R);
    float *dy = fvec(n), *dx = fvec(n), *dx0 = fvec(n), *dw = fvec(D), *db = fvec(D);
    double *xd = dvec(n), *wd = dvec(D), *bd = dvec(D), *want = dvec(n);
    rfill(x, n, 41);
    rfill(w, D, 42);
    rfill(b, D, 43);
    rfill(dy, n, 44);
    rfill(dx0, n, 45);
    for (int i = 0; i < n; i++) x[i] = x[i] * 2.0f + 1.0f;
    to_d(x, xd, n);
    to_d(w, wd, D);
    to_d(b, bd, D);
    for (int affine = 0; affine < 2; affine++) {
        const float *wp = affine ? w : NULL, *bp = affine ? b : NULL;
        const double *wq = affine ? wd : NULL, *bq = affine ? bd : NULL;
        f->I->layernorm_forward(f->be1, R, D, x, wp, bp, eps, y, mean, rstd);
        for (int r = 0; r < R; r++) {
            double mu = 0, var = 0;
            for (int j = 0; j < D; j++) mu += xd[r * D + j];
            mu /= D;
            for (int j = 0; j < D; j++) var += (xd[r * D + j] - mu) * (xd[r * D + j] - mu);
            var /= D;
            assert_true(fabs(mean[r] - mu) < 1e-6);
            assert_true(fabs(rstd[r] - 1.0 / sqrt(var + eps)) < 1e-5 * rstd[r]);
            for (int j = 0; j < D; j++)
                want[r * D + j] = (xd[r * D + j] - mu) / sqrt(var + eps) * (wq ? wq[j] : 1.0) +
                                  (bq ? bq[j] : 0.0);
        }
        check_close(y, want, n, 1e-5, "layernorm");
        for (int acc = 0; acc < 2; acc++) {
            memcpy(dx, dx0, sizeof(float) * n);
            for (int j = 0; j < D; j++) dw[j] = db[j] = 0.5f;
            f->I->layernorm_backward(f->be1, R, D, x, wp, mean, rstd, dy, dx, affine ? dw : NULL,
                                     affine ? db : NULL, acc);
            const double h = 1e-6;
            for (int i = 0; i < n; i++) {
                double keep = xd[i];
                xd[i] = keep + h;
                double lp = ln_loss(R, D, xd, wq, bq, eps, dy);
                xd[i] = keep - h;
                double lm = ln_loss(R, D, xd, wq, bq, eps, dy);
                xd[i] = keep;
                want[i] = (lp - lm) / (2 * h) + (acc ? dx0[i] : 0.0);
            }
            check_close(dx, want, n, 1e-4, "layernorm dx");
            if (!affine) continue;
            double gw[7], gb[7];
            for (int j = 0; j < D; j++) {
                double keep = wd[j];
                wd[j] = keep + h;
                double lp = ln_loss(R, D, xd, wd, bd, eps, dy);
                wd[j] = keep - h;
                double lm = ln_loss(R, D, xd, wd, bd, eps, dy);
                wd[j] = keep;
                gw[j] = (lp - lm) / (2 * h) + 0.5;
                gb[j] = 0.5;
                for (int r = 0; r < R; r++) gb[j] += dy[r * D + j];
            }
            check_close(dw, gw, D, 1e-4, "layernorm dw");
            check_close(db, gb, D, 1e-6, "layernorm db");
        }
    }
    free(x); free(w); free(b); free(y); free(mean); free(rstd); free(dy); free(dx); free(dx0);
    free(dw); free(db); free(xd); free(wd); free(bd); free(want);
}

/* ---------------------------------------------------------------------------
 * 13. Dropout
 * ------------------------------------------------------------------------- */
static void test_dropout(void **state)
{
    fix *f = *state;
    const int64_t n = 300001;
    const float p = 0.3f, scale = 1.0f / (1.0f - p);
    float *x = fvec(n), *y1 = fvec(n), *m1 = fvec(n), *y3 = fvec(n), *m3 = fvec(n);
    rfill(x, n, 46);
    poison_pair(y1, y3, n);
    poison_pair(m1, m3, n);
    f->I->dropout_forward(f->be1, n, p, 1234, x, y1, m1);
    f->I->dropout_forward(f->be3, n, p, 1234, x, y3, m3);
    check_same(m1, m3, n, "dropout mask threads");
    check_same(y1, y3, n, "dropout y threads");
    int64_t kept = 0;
    for (int64_t i = 0; i < n; i++) {
        assert_true(m1[i] == 0.0f || m1[i] == scale);
        assert_true(y1[i] == x[i] * m1[i]);
        kept += m1[i] != 0.0f;
    }
    double frac = (double)kept / n; /* 0.7, sd ~ 0.0008 */
    assert_true(fabs(frac - 0.7) < 0.005);
    /* another seed, another mask; the same seed, the same mask */
    f->I->dropout_forward(f->be1, n, p, 1235, x, y3, m3);
    int64_t differ = 0;
    for (int64_t i = 0; i < n; i++) differ += m1[i] != m3[i];
    assert_true(differ > n / 4);
    memset(m3, 0x7F, 1001 * sizeof(float));
    f->I->dropout_forward(f->be3, 1001, p, 1234, x, y3, m3); /* a prefix: same elements */
    check_same(m1, m3, 1001, "dropout prefix");
    /* p = 0 keeps everything with scale 1 */
    f->I->dropout_forward(f->be1, 1001, 0.0f, 9, x, y3, m3);
    for (int i = 0; i < 1001; i++) assert_true(m3[i] == 1.0f && y3[i] == x[i]);
    free(x); free(y1); free(m1); free(y3); free(m3);
}

/* ---------------------------------------------------------------------------
 * 14. Optimizers against hand-worked steps
 * ------------------------------------------------------------------------- */
static void test_sgd(void **state)
{
    fix *f = *state;
    /* w=1, g=0.5, lr=0.1, momentum 0.9, wd 0.01:
     * step 1 (first): g' = 0.51, buf = 0.51, w = 1 - 0.051 = 0.949
     * step 2: g' = 0.5 + 0.00949 = 0.50949, buf = 0.459 + 0.50949 = 0.96849,
     *         w = 0.949 - 0.096849 = 0.852151 */
    float w[2] = {1.0f, -2.0f}, g[2] = {0.5f, 0.25f}, buf[2] = {99, 99};
    f->I->sgd_update(f->be1, 2, w, g, buf, 0.1f, 0.9f, 0.0f, 0, 0.01f, 1);
    assert_float_equal(buf[0], 0.51f, 1e-6);
    assert_float_equal(w[0], 0.949f, 1e-6);
    /* element 2: g' = 0.25 - 0.02 = 0.23, w = -2 - 0.023 = -2.023 */
    assert_float_equal(w[1], -2.023f, 1e-6);
    f->I->sgd_update(f->be1, 2, w, g, buf, 0.1f, 0.9f, 0.0f, 0, 0.01f, 0);
    assert_float_equal(buf[0], 0.96849f, 1e-6);
    assert_float_equal(w[0], 0.852151f, 1e-6);
    /* nesterov, dampening 0.5, no wd: step 1 buf = g = 0.5, step = 0.5 + 0.45 = 0.95,
     * w = 1 - 0.095 = 0.905; step 2 buf = 0.45 + 0.25 = 0.7, step = 0.5 + 0.63 = 1.13,
     * w = 0.905 - 0.113 = 0.792 */
    w[0] = 1.0f;
    f->I->sgd_update(f->be1, 1, w, g, buf, 0.1f, 0.9f, 0.5f, 1, 0.0f, 1);
    assert_float_equal(w[0], 0.905f, 1e-6);
    f->I->sgd_update(f->be1, 1, w, g, buf, 0.1f, 0.9f, 0.5f, 1, 0.0f, 0);
    assert_float_equal(buf[0], 0.7f, 1e-6);
    assert_float_equal(w[0], 0.792f, 1e-6);
    /* plain SGD, no buffer: w = 1 - 0.1 * (0.5 + 0.01) = 0.949 */
    w[0] = 1.0f;
    f->I->sgd_update(f->be1, 1, w, g, NULL, 0.1f, 0.0f, 0.0f, 0, 0.01f, 1);
    assert_float_equal(w[0], 0.949f, 1e-6);
}

/* |a - b| <= rel * |b|: beta2 arrives as a float, so 1 - 0.999f is off by 1e-5 relative */
#define assert_rel(a, b, rel) \
    assert_true(fabs((double)(a) - (double)(b)) <= (rel) * fabs((double)(b)))

static void test_adam(void **state)
{
    fix *f = *state;
    const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, lr = 0.01f;
    /* Adam, w=1, g=0.5 then -0.25:
     * t=1: m = 0.05, v = 0.00025, bc1 = 0.1, bc2 = 0.001,
     *      w = 1 - 0.1 * 0.05 / (0.5 + 1e-8) = 0.99 (first step moves lr * sign g)
     * t=2: m = 0.045 - 0.025 = 0.02, v = 0.00024975 + 0.0000625 = 0.00031225,
     *      bc1 = 0.19, bc2 = 0.001999, mhat = 0.1052632, sqrt(vhat) = 0.3952246,
     *      w = 0.99 - 0.01 * 0.1052632 / 0.3952246 = 0.9873366 */
    float w = 1.0f, m = 0.0f, v = 0.0f, g = 0.5f;
    f->I->adam_update(f->be1, 1, &w, &g, &m, &v, lr, b1, b2, eps, 0.0f, 0, 0.1f, 0.001f);
    assert_float_equal(m, 0.05f, 1e-7);
    assert_rel(v, 0.00025, 1e-4);
    assert_float_equal(w, 0.99f, 1e-6);
    g = -0.25f;
    f->I->adam_update(f->be1, 1, &w, &g, &m, &v, lr, b1, b2, eps, 0.0f, 0, 1.0f - b1 * b1,
                      1.0f - b2 * b2);
    assert_float_equal(m, 0.02f, 1e-7);
    assert_rel(v, 0.00031225, 1e-4);
    assert_float_equal(w, 0.9873366f, 2e-6);
    /* AdamW wd 0.1: w = 1 * (1 - 0.001) = 0.999, then -0.01 -> 0.989 */
    w = 1.0f; m = v = 0.0f; g = 0.5f;
    f->I->adam_update(f->be1, 1, &w, &g, &m, &v, lr, b1, b2, eps, 0.1f, 1, 0.1f, 0.001f);
    assert_float_equal(w, 0.989f, 1e-6);
    assert_float_equal(m, 0.05f, 1e-7); /* the gradient itself is not decayed */
    /* Adam L2 wd 0.1: g = 0.5 + 0.1 = 0.6, m = 0.06, v = 0.00036, w = 1 - 0.01 = 0.99 */
    w = 1.0f; m = v = 0.0f;
    f->I->adam_update(f->be1, 1, &w, &g, &m, &v, lr, b1, b2, eps, 0.1f, 0, 0.1f, 0.001f);
    assert_float_equal(m, 0.06f, 1e-7);
    assert_rel(v, 0.00036, 1e-4);
    assert_float_equal(w, 0.99f, 1e-6);
}

/* ---------------------------------------------------------------------------
 * 15. Metrics
 * ------------------------------------------------------------------------- */
static void test_count_correct(void **state)
{
    fix *f = *state;
    float logits[4 * 3] = {1, 3, 3,  /* tie: first max (1) */
                           5, 0, 1,
                           0, 0, 9,
                           -1, -2, -3};
    int32_t labels[4] = {1, 0, 1, 0};
    assert_int_equal(f->I->count_correct(f->be1, 4, 3, logits, labels), 3);
    labels[0] = 2;
    assert_int_equal(f->I->count_correct(f->be1, 4, 3, logits, labels), 2);
}

/* ---------------------------------------------------------------------------
 * 16. The group
 * ------------------------------------------------------------------------- */
#define T(fn) cmocka_unit_test_setup_teardown(fn, setup, teardown)

static const struct CMUnitTest cpu_kernel_tests[] = {
    T(test_memory),          T(test_discard_frees_memory), T(test_gemm), T(test_gemm_batched),
    T(test_fill_axpby),      T(test_unary),          T(test_binary),
    T(test_copy_strided),    T(test_sum_to),         T(test_reduce_axis),
    T(test_sum_sumsq_threads), T(test_reductions_threads), T(test_softmax),
    T(test_xent),            T(test_im2col),         T(test_layout_and_bias),
    T(test_maxpool),         T(test_avgpool),        T(test_embedding),
    T(test_layernorm),       T(test_dropout),        T(test_sgd),
    T(test_adam),            T(test_count_correct),
};

/* (test_util.h's: DT_TEST_ONLY and DT_TEST_SHARD pick from the list) */
DT_TEST_GROUP(cpu_kernels, cpu_kernel_tests)
