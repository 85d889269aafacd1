/*
 * tests/test_util.h - helpers shared by the core test groups (test_core_*.c).
 *
 * Everything here is static inline so each test file compiles alone and an
 * unused helper costs nothing.  The references the tests compare against are
 * built here from first principles (a seeded RNG of our own, central finite
 * differences in double precision), never from the library's own output.
 *
 * Each group file exports two functions that tests/test_main.c calls:
 *     int dt_test_<group>(void);        runs the group, returns failures
 *     int dt_test_<group>_count(void);  number of tests in the group
 * DT_TEST_GROUP(group, tests) defines both from a CMUnitTest array.
 */
#ifndef DT_TEST_UTIL_H
#define DT_TEST_UTIL_H

/* mkdtemp, M_PI: include this header first in every test file. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dtrain.h"

#define TU_ARRAY_LEN(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* SHP(2, 3, 4) expands to "3, (const int64_t[]){2, 3, 4}": an ndim, shape
 * pair for dt_tensor_new / dt_param_new and the helpers below. */
#define SHP(...)                                                              \
    (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)),               \
        (const int64_t[]){__VA_ARGS__}

/* DT_TEST_ONLY=name,name runs only the tests whose names contain one of
 * them (while developing); unset, every test. */
/* DT_TEST_SHARD=k/n (0 <= k < n): this process runs a group's tests i with
 * i % n == k, so n processes run the whole suite at once (build.sh's
 * unit_suite); a group's slow tests lie apart in its list, so they land in
 * different shards.  Unset or malformed: every test. */
static inline int tu_in_shard(size_t i)
{
    const char *sh = getenv("DT_TEST_SHARD");
    unsigned k, n;
    if (!sh || sscanf(sh, "%u/%u", &k, &n) != 2 || n == 0 || k >= n)
        return 1;
    return i % n == k;
}

static inline size_t tu_pick_tests(const struct CMUnitTest *all, size_t n, struct CMUnitTest *out)
{
    const char *only = getenv("DT_TEST_ONLY");
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        int take = !only || !*only;
        for (const char *p = only; !take && p && *p;) {
            const char *end = strchr(p, ',');
            size_t len = end ? (size_t)(end - p) : strlen(p);
            char word[128];
            snprintf(word, sizeof word, "%.*s", (int)(len < sizeof word ? len : sizeof word - 1), p);
            take = len > 0 && strstr(all[i].name, word) != NULL;
            p = end ? end + 1 : NULL;
        }
        if (take && tu_in_shard(i))
            out[k++] = all[i];
    }
    return k;
}

#define DT_TEST_GROUP(group, tests)                                           \
    int dt_test_##group(void)                                                 \
    {                                                                         \
        struct CMUnitTest pick[TU_ARRAY_LEN(tests)];                          \
        size_t n = tu_pick_tests(tests, TU_ARRAY_LEN(tests), pick);           \
        return n ? _cmocka_run_group_tests(#group, pick, n, NULL, NULL) : 0;  \
    }                                                                         \
    int dt_test_##group##_count(void)                                         \
    {                                                                         \
        struct CMUnitTest pick[TU_ARRAY_LEN(tests)];                          \
        return (int)tu_pick_tests(tests, TU_ARRAY_LEN(tests), pick);          \
    }

/* Skipped tests are counted here so test_main can report them apart from
 * the passes (cmocka's group runner returns only the failure count). */
extern int dt_test_skipped;
#define TU_SKIP(...)                                                          \
    do {                                                                      \
        print_message("[   SKIP   ] " __VA_ARGS__);                           \
        dt_test_skipped++;                                                    \
        skip();                                                               \
    } while (0)

/* ---------------------------------------------------------------------------
 * A seeded generator of our own (splitmix64), so test inputs never depend on
 * the library's generator.
 * ------------------------------------------------------------------------- */
typedef struct tu_rng {
    uint64_t s;
} tu_rng;

static inline uint64_t tu_next(tu_rng *r)
{
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform in [lo, hi). */
static inline float tu_uniform(tu_rng *r, float lo, float hi)
{
    double u = (double)(tu_next(r) >> 11) * (1.0 / 9007199254740992.0);
    return (float)(lo + (hi - lo) * u);
}

static inline void tu_fill_uniform(tu_rng *r, float *x, int64_t n, float lo, float hi)
{
    for (int64_t i = 0; i < n; i++) x[i] = tu_uniform(r, lo, hi);
}

/* Values with |x| in [0.1, 1] and a random sign: keeps relu away from its
 * kink by far more than any finite-difference step used here. */
static inline void tu_fill_away_from_zero(tu_rng *r, float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        float m = tu_uniform(r, 0.1f, 1.0f);
        x[i] = (tu_next(r) & 1) ? m : -m;
    }
}

/* Distinct values spaced by `gap` in a random order (pooling windows then
 * have a unique maximum with a margin of at least gap). */
static inline void tu_fill_distinct(tu_rng *r, float *x, int64_t n, float gap)
{
    for (int64_t i = 0; i < n; i++) x[i] = (float)((double)i - (double)n / 2) * gap;
    for (int64_t i = n - 1; i > 0; i--) {
        int64_t j = (int64_t)(tu_next(r) % (uint64_t)(i + 1));
        float t = x[i];
        x[i] = x[j];
        x[j] = t;
    }
}

/* ---------------------------------------------------------------------------
 * Context and tensor helpers.  They fail the current test (with the
 * library's message) rather than return errors.
 * ------------------------------------------------------------------------- */
static inline dt_ctx *tu_ctx_new_with(uint64_t seed, int threads)
{
    dt_ctx_config cfg;
    dt_ctx_config_init(&cfg);
    cfg.seed = seed;
    cfg.threads = threads;
    dt_ctx *ctx = dt_ctx_new(&cfg);
    assert_non_null(ctx);
    if (dt_ctx_status(ctx) != DT_OK)
        fail_msg("dt_ctx_new: %s", dt_last_error(ctx));
    return ctx;
}

static inline dt_ctx *tu_ctx_new(void) { return tu_ctx_new_with(1, 1); }

static inline int64_t tu_numel(int ndim, const int64_t *shape)
{
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    return n;
}

static inline void tu_check(dt_ctx *ctx, const void *p, const char *what)
{
    if (p == NULL) fail_msg("%s returned NULL: %s", what, dt_last_error(ctx));
}

static inline void tu_check_status(dt_ctx *ctx, dt_status s, const char *what)
{
    if (s != DT_OK) fail_msg("%s: %s (%s)", what, dt_strerror(s), dt_last_error(ctx));
}

/* Persistent f32 tensor with the given values (NULL: zeros). */
static inline dt_tensor *tu_tensor(dt_ctx *ctx, int ndim, const int64_t *shape,
                                   const float *values)
{
    dt_tensor *t = dt_tensor_new(ctx, DT_F32, ndim, shape);
    tu_check(ctx, t, "dt_tensor_new");
    if (values) tu_check_status(ctx, dt_tensor_set(t, values, tu_numel(ndim, shape)), "dt_tensor_set");
    return t;
}

static inline dt_tensor *tu_tensor_i32(dt_ctx *ctx, int ndim, const int64_t *shape,
                                       const int32_t *values)
{
    dt_tensor *t = dt_tensor_new(ctx, DT_I32, ndim, shape);
    tu_check(ctx, t, "dt_tensor_new(i32)");
    if (values) tu_check_status(ctx, dt_tensor_set(t, values, tu_numel(ndim, shape)), "dt_tensor_set(i32)");
    return t;
}

static inline dt_tensor *tu_param(dt_ctx *ctx, const char *name, int ndim, const int64_t *shape,
                                  const float *values)
{
    dt_tensor *t = dt_param_new(ctx, name, ndim, shape);
    tu_check(ctx, t, "dt_param_new");
    if (values) tu_check_status(ctx, dt_tensor_set(t, values, tu_numel(ndim, shape)), "dt_tensor_set");
    return t;
}

/* Param with uniform random values from r. */
static inline dt_tensor *tu_param_rand(dt_ctx *ctx, tu_rng *r, const char *name, int ndim,
                                       const int64_t *shape, float lo, float hi)
{
    int64_t n = tu_numel(ndim, shape);
    float *v = malloc(sizeof(float) * (size_t)(n ? n : 1));
    assert_non_null(v);
    tu_fill_uniform(r, v, n, lo, hi);
    dt_tensor *t = tu_param(ctx, name, ndim, shape, v);
    free(v);
    return t;
}

/* Copy a (possibly strided) f32 tensor to a new host buffer; n_out gets numel. */
static inline float *tu_read(dt_ctx *ctx, dt_tensor *t, int64_t *n_out)
{
    tu_check(ctx, t, "tensor to read");
    dt_tensor *c = dt_tensor_is_contiguous(t) ? t : dt_contiguous(ctx, t);
    tu_check(ctx, c, "dt_contiguous");
    int64_t n = dt_tensor_numel(c);
    float *buf = malloc(sizeof(float) * (size_t)(n ? n : 1));
    assert_non_null(buf);
    tu_check_status(ctx, dt_tensor_get(c, buf, n), "dt_tensor_get");
    if (n_out) *n_out = n;
    return buf;
}

static inline void tu_assert_shape(const dt_tensor *t, int ndim, const int64_t *shape)
{
    assert_non_null(t);
    assert_int_equal(dt_tensor_ndim(t), ndim);
    for (int i = 0; i < ndim; i++) {
        if (dt_tensor_dim(t, i) != shape[i])
            fail_msg("dim %d: expected %lld, got %lld", i, (long long)shape[i],
                     (long long)dt_tensor_dim(t, i));
    }
}

static inline int tu_close(double got, double exp, double rtol, double atol)
{
    return fabs(got - exp) <= atol + rtol * fabs(exp);
}

/* Compare n floats against double references; prints the first mismatches
 * with expected and got, then fails. */
static inline void tu_assert_close_arr(const char *what, const float *got, const double *exp,
                                       int64_t n, double rtol, double atol)
{
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!tu_close(got[i], exp[i], rtol, atol) || isnan(got[i])) {
            if (bad < 8)
                print_error("%s[%lld]: expected %.9g, got %.9g\n", what, (long long)i, exp[i],
                            (double)got[i]);
            bad++;
        }
    }
    if (bad) fail_msg("%s: %d of %lld values differ (rtol %g, atol %g)", what, bad, (long long)n,
                      rtol, atol);
}

/* Same, for a literal list of expected values: TU_EXPECT(t, ctx, rtol, atol, 1.0, 2.0). */
#define TU_EXPECT(ctx, t, rtol, atol, ...)                                    \
    do {                                                                      \
        static const double tu_exp_[] = {__VA_ARGS__};                        \
        int64_t tu_n_;                                                        \
        float *tu_got_ = tu_read((ctx), (t), &tu_n_);                         \
        if (tu_n_ != TU_ARRAY_LEN(tu_exp_)) {                                 \
            free(tu_got_);                                                    \
            fail_msg("%s: expected %d values, got %lld", #t,                  \
                     TU_ARRAY_LEN(tu_exp_), (long long)tu_n_);                \
        }                                                                     \
        tu_assert_close_arr(#t, tu_got_, tu_exp_, tu_n_, (rtol), (atol));    \
        free(tu_got_);                                                        \
    } while (0)

/* The last error must be set and name `op`. */
static inline void tu_assert_error_mentions(dt_ctx *ctx, const char *op)
{
    const char *msg = dt_last_error(ctx);
    assert_non_null(msg);
    if (msg[0] == '\0') fail_msg("expected an error message naming \"%s\", got none", op);
    if (strstr(msg, op) == NULL)
        fail_msg("error message \"%s\" does not name \"%s\"", msg, op);
}

/* ---------------------------------------------------------------------------
 * Gradient check against central finite differences.
 *
 * fn builds an output from inputs in[0..n) (params, or leaf tensors with
 * requires_grad).  The scalar checked is L = sum(fn(in) * R) with a fixed
 * random R of the output's shape, so every output element gets its own
 * upstream gradient.  The analytic gradient comes from dt_backward on
 * dt_sum(dt_mul(out, R)); the numeric one perturbs each input element by
 * +-eps through dt_tensor_set, re-runs fn with grad disabled and sums
 * out * R on the host in double.
 * ------------------------------------------------------------------------- */
typedef dt_tensor *(*tu_fn)(dt_ctx *ctx, dt_tensor *const *in, void *user);

static inline double tu_eval_loss(dt_ctx *ctx, tu_fn fn, dt_tensor *const *in, void *user,
                                  const float *R, int64_t nout)
{
    dt_tensor *out = fn(ctx, in, user);
    tu_check(ctx, out, "forward (finite differences)");
    int64_t n;
    float *y = tu_read(ctx, out, &n);
    if (n != nout) {
        free(y);
        fail_msg("output size changed between runs: %lld vs %lld", (long long)n, (long long)nout);
    }
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += (double)y[i] * (double)R[i];
    free(y);
    dt_ctx_step_reset(ctx);
    return s;
}

static inline void tu_grad_check(dt_ctx *ctx, const char *what, tu_fn fn, void *user,
                                 dt_tensor *const *in, int n_in, double eps, double rtol,
                                 double atol)
{
    tu_rng rng = {0xC0FFEEull};
    dt_ctx_set_grad_enabled(ctx, 1);
    dt_ctx_zero_grad(ctx);

    dt_tensor *out = fn(ctx, in, user);
    tu_check(ctx, out, what);
    int ndim = dt_tensor_ndim(out);
    int64_t shape[DT_MAX_DIMS] = {1};
    for (int i = 0; i < ndim; i++) shape[i] = dt_tensor_dim(out, i);
    int64_t nout = dt_tensor_numel(out);
    float *R = malloc(sizeof(float) * (size_t)(nout ? nout : 1));
    assert_non_null(R);
    tu_fill_uniform(&rng, R, nout, -1.0f, 1.0f);
    dt_tensor *Rt = tu_tensor(ctx, ndim, shape, R);

    dt_tensor *loss = dt_sum(ctx, dt_mul(ctx, out, Rt));
    tu_check(ctx, loss, "sum(out * R)");
    tu_check_status(ctx, dt_backward(ctx, loss), "dt_backward");

    float *grads[8] = {0};
    assert_true(n_in <= 8);
    for (int i = 0; i < n_in; i++) {
        dt_tensor *g = dt_tensor_grad(in[i]);
        if (g == NULL) fail_msg("%s: input %d has no gradient after dt_backward", what, i);
        int64_t ng;
        grads[i] = tu_read(ctx, g, &ng);
        assert_int_equal(ng, dt_tensor_numel(in[i]));
    }
    dt_ctx_step_reset(ctx);

    dt_ctx_set_grad_enabled(ctx, 0);
    int bad = 0;
    double worst = 0;
    for (int i = 0; i < n_in; i++) {
        int64_t n = dt_tensor_numel(in[i]);
        float *x = malloc(sizeof(float) * (size_t)n);
        assert_non_null(x);
        tu_check_status(ctx, dt_tensor_get(in[i], x, n), "dt_tensor_get(input)");
        for (int64_t j = 0; j < n; j++) {
            float x0 = x[j];
            float xp = (float)(x0 + eps), xm = (float)(x0 - eps);
            x[j] = xp;
            dt_tensor_set(in[i], x, n);
            double lp = tu_eval_loss(ctx, fn, in, user, R, nout);
            x[j] = xm;
            dt_tensor_set(in[i], x, n);
            double lm = tu_eval_loss(ctx, fn, in, user, R, nout);
            x[j] = x0;
            dt_tensor_set(in[i], x, n);
            double fd = (lp - lm) / ((double)xp - (double)xm);
            double g = grads[i][j];
            double err = fabs(g - fd) / (atol + rtol * fabs(fd));
            if (err > worst) worst = err;
            if (!(err <= 1.0)) {
                if (bad < 8)
                    print_error("%s: d/d in%d[%lld]: finite difference %.7g, backward %.7g\n",
                                what, i, (long long)j, fd, g);
                bad++;
            }
        }
        free(x);
    }
    dt_ctx_set_grad_enabled(ctx, 1);
    for (int i = 0; i < n_in; i++) free(grads[i]);
    free(R);
    dt_tensor_free(Rt);
    if (bad) fail_msg("%s: %d gradient elements differ from finite differences", what, bad);
}

/* ---------------------------------------------------------------------------
 * Temporary directories and files.
 * ------------------------------------------------------------------------- */
static inline char *tu_tmpdir(char *buf, size_t len)
{
    snprintf(buf, len, "/tmp/dtrain_test_XXXXXX");
    if (mkdtemp(buf) == NULL) fail_msg("mkdtemp failed");
    return buf;
}

/* Remove a flat directory and the files in it. */
static inline void tu_rmdir(const char *dir)
{
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *e;
        char p[4096];
        while ((e = readdir(d)) != NULL) {
            if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
            snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
            unlink(p);
        }
        closedir(d);
    }
    rmdir(dir);
}

static inline void tu_write_file(const char *path, const void *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    if (!f) fail_msg("cannot write %s", path);
    if (len && fwrite(data, 1, len, f) != len) {
        fclose(f);
        fail_msg("short write to %s", path);
    }
    fclose(f);
}

/* Whole file into a new buffer; NULL if it cannot be read. */
static inline unsigned char *tu_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *buf = malloc((size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) {
        buf[n] = 0;
        *len = (size_t)n;
    }
    return buf;
}

#endif /* DT_TEST_UTIL_H */
