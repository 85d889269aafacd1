/*
 * tests/test_profile.c - the profiler and load balancing: a step's phases
 * add up to the wall time measured around the loop; the merged trace of a
 * 2-rank DDP run is valid JSON with both ranks' events; a slowed rank is
 * named a straggler (warning and report); global batches cut between
 * shards are exactly an unsharded loader's batches; balanced DDP with a
 * slow rank ends with the parameters of one process on the global batch;
 * work stealing processes every sample exactly once and the fast worker
 * takes the slow one's chunks; the store's counters; the parameter-server
 * diagnosis on made-up figures (each of its verdicts).
 */
#include "test_util.h"
#include "test_ranks.h"
#include "src/dist.h"   /* prof_slow_server: the diagnosis, tested on made-up figures */

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <sys/stat.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

enum { SIDE = 8, PIXELS = SIDE * SIDE, NSAMPLES = 600, CLASSES = 10, HID = 32 };

/* --- a dataset whose pixels say which sample they are ---------------------- */

static void put_be32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

static uint8_t pixel(int k, int i)
{
    if (i == 0)
        return (uint8_t)(k & 255);
    if (i == 1)
        return (uint8_t)(k >> 8);
    return (uint8_t)((k * 131 + i * 71 + (k * i) % 17) & 255);
}

static void write_file(const char *path, const uint8_t *buf, size_t len)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(buf, 1, len, f), len);
    fclose(f);
}

typedef struct data {
    char dir[64], img[128], lab[128];
} data;

static void data_make(data *d, int n)
{
    tu_tmpdir(d->dir, sizeof d->dir);
    snprintf(d->img, sizeof d->img, "%s/img", d->dir);
    snprintf(d->lab, sizeof d->lab, "%s/lab", d->dir);
    size_t il = 16 + (size_t)n * PIXELS, ll = 8 + (size_t)n;
    uint8_t *im = malloc(il), *lb = malloc(ll);
    assert_true(im && lb);
    put_be32(im, 0x803);
    put_be32(im + 4, (uint32_t)n);
    put_be32(im + 8, SIDE);
    put_be32(im + 12, SIDE);
    put_be32(lb, 0x801);
    put_be32(lb + 4, (uint32_t)n);
    for (int k = 0; k < n; k++) {
        for (int i = 0; i < PIXELS; i++)
            im[16 + (size_t)k * PIXELS + i] = pixel(k, i);
        lb[8 + k] = (uint8_t)((k * 7) % CLASSES);
    }
    write_file(d->img, im, il);
    write_file(d->lab, lb, ll);
    free(im);
    free(lb);
}

/* The sample a loaded row is (the loader maps pixel b to b / 255). */
static int sample_of(const float *row)
{
    return (int)lrintf(row[0] * 255.0f) + 256 * (int)lrintf(row[1] * 255.0f);
}

/* --- a small MLP ------------------------------------------------------------ */

typedef struct mlp {
    dt_tensor *w1, *b1, *w2, *b2;
} mlp;

static int mlp_build(dt_ctx *ctx, mlp *m)
{
    m->w1 = dt_param_new(ctx, "fc1.weight", SHP(HID, PIXELS));
    m->b1 = dt_param_new(ctx, "fc1.bias", SHP(HID));
    m->w2 = dt_param_new(ctx, "fc2.weight", SHP(CLASSES, HID));
    m->b2 = dt_param_new(ctx, "fc2.bias", SHP(CLASSES));
    if (!m->w1 || !m->b1 || !m->w2 || !m->b2)
        return 1;
    return dt_tensor_init_kaiming_uniform(ctx, m->w1, 2.2360679775f) != DT_OK ||
           dt_tensor_init_bias(ctx, m->b1, PIXELS) != DT_OK ||
           dt_tensor_init_kaiming_uniform(ctx, m->w2, 2.2360679775f) != DT_OK ||
           dt_tensor_init_bias(ctx, m->b2, HID) != DT_OK;
}

static dt_tensor *mlp_loss(dt_ctx *ctx, const mlp *m, dt_tensor *x, dt_tensor *y)
{
    dt_tensor *h = dt_flatten(ctx, x, 1);
    h = dt_relu(ctx, dt_linear(ctx, h, m->w1, m->b1));
    return dt_cross_entropy(ctx, dt_linear(ctx, h, m->w2, m->b2), y);
}

/* Burn CPU for s seconds: a slower rank, as far as the profiler can tell. */
static void spin(double s)
{
    double end = dt_now() + s;
    volatile double x = 0;
    while (dt_now() < end)
        x += 1.0;
}

/* --- a minimal JSON checker (RFC 8259's grammar, no semantics) --------------- */

typedef struct jp {
    const char *p, *end;
} jp;

static void j_ws(jp *j)
{
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\n' || *j->p == '\r' || *j->p == '\t'))
        j->p++;
}

static int j_value(jp *j, int depth);

static int j_string(jp *j)
{
    if (j->p >= j->end || *j->p != '"')
        return 0;
    for (j->p++; j->p < j->end; j->p++) {
        if (*j->p == '"') {
            j->p++;
            return 1;
        }
        if ((unsigned char)*j->p < 0x20)
            return 0;
        if (*j->p == '\\')
            j->p++;
    }
    return 0;
}

static int j_number(jp *j)
{
    const char *s = j->p;
    if (j->p < j->end && *j->p == '-')
        j->p++;
    while (j->p < j->end && (isdigit((unsigned char)*j->p) || *j->p == '.' || *j->p == 'e' ||
                             *j->p == 'E' || *j->p == '+' || *j->p == '-'))
        j->p++;
    return j->p > s && isdigit((unsigned char)j->p[-1]);
}

static int j_seq(jp *j, char close, int object, int depth)
{
    j->p++;
    j_ws(j);
    if (j->p < j->end && *j->p == close) {
        j->p++;
        return 1;
    }
    for (;;) {
        j_ws(j);
        if (object) {
            if (!j_string(j))
                return 0;
            j_ws(j);
            if (j->p >= j->end || *j->p++ != ':')
                return 0;
        }
        if (!j_value(j, depth + 1))
            return 0;
        j_ws(j);
        if (j->p < j->end && *j->p == ',') {
            j->p++;
            continue;
        }
        if (j->p < j->end && *j->p == close) {
            j->p++;
            return 1;
        }
        return 0;
    }
}

static int j_value(jp *j, int depth)
{
    j_ws(j);
    if (j->p >= j->end || depth > 64)
        return 0;
    switch (*j->p) {
    case '{': return j_seq(j, '}', 1, depth);
    case '[': return j_seq(j, ']', 0, depth);
    case '"': return j_string(j);
    case 't': return (j->p += 4) <= j->end && !strncmp(j->p - 4, "true", 4);
    case 'f': return (j->p += 5) <= j->end && !strncmp(j->p - 5, "false", 5);
    case 'n': return (j->p += 4) <= j->end && !strncmp(j->p - 4, "null", 4);
    default: return j_number(j);
    }
}

static char *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    buf[n] = 0;
    fclose(f);
    *len = (size_t)n;
    return buf;
}

static int count_of(const char *hay, const char *needle)
{
    int n = 0;
    for (const char *p = strstr(hay, needle); p; p = strstr(p + 1, needle))
        n++;
    return n;
}

static int json_valid(const char *s, size_t len)
{
    jp j = {s, s + len};
    if (!j_value(&j, 0))
        return 0;
    j_ws(&j);
    return j.p == j.end;
}

/* --- one process: the phases add up to the measured loop -------------------- */

static void test_phases_single(void **state)
{
    (void)state;
    data d;
    data_make(&d, NSAMPLES);
    dt_ctx *ctx = tu_ctx_new();
    assert_int_equal(dt_profile_start(ctx, NULL), DT_OK);
    assert_true(dt_profile_active(ctx));
    dt_dataset *ds = dt_dataset_load_idx(ctx, d.img, d.lab);
    tu_check(ctx, ds, "load");
    dt_loader_config lc;
    dt_loader_config_init(&lc);
    lc.batch = 32;
    dt_loader *ld = dt_loader_new(ctx, ds, &lc);
    tu_check(ctx, ld, "loader");
    mlp m;
    assert_int_equal(mlp_build(ctx, &m), 0);
    dt_optim_config oc;
    dt_optim_config_init(&oc, DT_SGD);
    dt_optim *opt = dt_optim_new(ctx, &oc, NULL, 0);
    enum { STEPS = 15 };
    double t0 = dt_now();
    dt_tensor *x, *y;
    for (int s = 0; s < STEPS; s++) {
        assert_int_equal(dt_loader_next(ld, &x, &y), DT_OK);
        dt_tensor *loss = mlp_loss(ctx, &m, x, y);
        assert_int_equal(dt_backward(ctx, loss), DT_OK);
        assert_int_equal(dt_optim_step(opt), DT_OK);
        dt_optim_zero_grad(opt);
        dt_ctx_step_reset(ctx);
    }
    double loop = dt_now() - t0;
    dt_profile_stats st;
    assert_int_equal(dt_profile_stats_get(ctx, &st), DT_OK);
    assert_int_equal(st.steps, STEPS);
    assert_int_equal(st.samples, STEPS * 32);
    double sum = st.data_s + st.forward_s + st.backward_s + st.comm_wait_s + st.optimizer_s +
                 st.idle_s;
    assert_true(fabs(sum - st.step_s) <= 1e-9 * STEPS + 1e-6 * st.step_s);
    /* the steps cover the loop: only the first loader_next's entry is
     * outside.  The loop is ~10 ms: 5% of it is shorter than one time slice
     * of a loaded machine (CI's run saw the test descheduled), hence 2 ms */
    if (!(fabs(st.step_s - loop) <= 0.05 * loop + 2e-3))
        fail_msg("steps %.6f s, loop %.6f s", st.step_s, loop);
    assert_true(st.forward_s > 0 && st.backward_s > 0 && st.optimizer_s > 0 && st.data_s > 0);
    assert_true(st.comm_wait_s == 0);
    /* the trace of one process: valid JSON, each step's phases and batches */
    char path[160];
    snprintf(path, sizeof path, "%s/trace.json", d.dir);
    assert_int_equal(dt_profile_stop(ctx, NULL, path), DT_OK);
    assert_false(dt_profile_active(ctx));
    size_t len = 0;
    char *js = read_all(path, &len);
    assert_non_null(js);
    assert_true(json_valid(js, len));
    assert_int_equal(count_of(js, "\"name\":\"backward\""), STEPS);
    assert_int_equal(count_of(js, "\"name\":\"optimizer\""), STEPS);
    assert_int_equal(count_of(js, "\"name\":\"forward\""), STEPS);
    assert_int_equal(count_of(js, "\"cat\":\"step\""), STEPS);
    assert_true(count_of(js, "\"name\":\"batch\"") >= STEPS);
    free(js);
    const char *rep = dt_profile_report(ctx);
    assert_non_null(strstr(rep, "dtrain profile: 1 rank"));
    assert_non_null(strstr(rep, "backward"));
    dt_profile_stats r0;
    assert_int_equal(dt_profile_rank_stats_get(ctx, 0, &r0), DT_OK);
    assert_int_equal(r0.steps, STEPS);
    assert_int_equal(dt_profile_rank_stats_get(ctx, 1, &r0), DT_ESTATE);
    /* off: finish is a no-op, nothing is measured */
    assert_int_equal(dt_profile_stop(ctx, NULL, path), DT_OK);
    dt_optim_free(opt);
    dt_loader_free(ld);
    dt_dataset_free(ds);
    dt_ctx_free(ctx);
    tu_rmdir(d.dir);
}

/* The data hint says what to do: with prefetch off, turn it on; with it on
 * (its thread still too slow for a step that does almost nothing), give the
 * thread a CPU. */
static void test_data_hint(void **state)
{
    (void)state;
    data d;
    data_make(&d, NSAMPLES);
    for (int prefetch = 0; prefetch < 2; prefetch++) {
        dt_ctx *ctx = tu_ctx_new();
        assert_int_equal(dt_profile_start(ctx, NULL), DT_OK);
        dt_dataset *ds = dt_dataset_load_idx(ctx, d.img, d.lab);
        tu_check(ctx, ds, "load");
        dt_loader_config lc;
        dt_loader_config_init(&lc);
        lc.batch = 64;
        lc.prefetch = prefetch;
        dt_loader *ld = dt_loader_new(ctx, ds, &lc);
        tu_check(ctx, ld, "loader");
        dt_tensor *w = tu_param(ctx, "w", SHP(1), NULL);
        dt_tensor *x, *y;
        for (int s = 0; s < 12; s++) {   /* a step of nothing but its data: 8 batches (one
                                            of 4 KiB weighed about 5% of the step, the hint's
                                            threshold, and flaked) */
            for (int k = 0; k < 8; k++) {
                if (dt_loader_next(ld, &x, &y) == DT_EOF) {
                    dt_loader_start_epoch(ld, s * 8 + k);
                    assert_int_equal(dt_loader_next(ld, &x, &y), DT_OK);
                }
            }
            assert_int_equal(dt_backward(ctx, dt_sum(ctx, w)), DT_OK);
            dt_ctx_step_reset(ctx);
        }
        assert_int_equal(dt_profile_stop(ctx, NULL, NULL), DT_OK);
        const char *rep = dt_profile_report(ctx);
        const char *want = prefetch ? "prefetch is on, so its thread cannot keep up"
                                    : "turn on prefetch (dt_loader_config.prefetch)";
        if (!strstr(rep, want))
            fail_msg("prefetch %d: the report lacks \"%s\":\n%s", prefetch, want, rep);
        dt_loader_free(ld);
        dt_dataset_free(ds);
        dt_ctx_free(ctx);
    }
    tu_rmdir(d.dir);
}

/* --- forked ranks --------------------------------------------------------------- */

typedef int (*rank_fn)(dt_ctx *ctx, dt_comm *c, int rank, int world);
static data job_data;           /* set before forking: inherited */
static char job_trace[192];
static int job_timeout_ms = 20000;   /* the ranks' dt_comm_config.timeout_ms */
static int job_threads[8];           /* the ranks' dt_ctx_config.threads (0: 1) */

static void rank_main(int rank, int world, int port, rank_fn fn)
{
    alarm(100);
    dt_ctx_config cfg;
    dt_ctx_config_init(&cfg);
    cfg.seed = 7;
    cfg.threads = job_threads[rank];
    dt_ctx *ctx = dt_ctx_new(&cfg);
    dt_dist_env e = tr_env(rank, world, port);
    dt_comm_config cc;
    dt_comm_config_init(&cc);
    cc.transport = "shm";
    cc.host = "127.0.0.1";
    cc.timeout_ms = job_timeout_ms;
    cc.store.timeout_ms = 20000;
    dt_comm *c = ctx ? dt_comm_new(ctx, &e, &cc) : NULL;
    if (!c) {
        fprintf(stderr, "rank %d: %s\n", rank, ctx ? dt_last_error(ctx) : "no ctx");
        _exit(90);
    }
    int code = fn(ctx, c, rank, world);
    if (code)
        fprintf(stderr, "rank %d: check %d failed: %s\n", rank, code, dt_last_error(ctx));
    struct timespec linger = {0, 300 * 1000 * 1000};
    nanosleep(&linger, NULL);
    dt_comm_free(c);
    dt_ctx_free(ctx);
    _exit(code);
}

static void run_ranks(int world, rank_fn fn)
{
    pid_t pids[8];
    int codes[8], port = tr_free_port();
    fflush(NULL);
    for (int r = 0; r < world; r++) {
        pids[r] = fork();
        assert_true(pids[r] >= 0);
        if (pids[r] == 0)
            rank_main(r, world, port, fn);
    }
    tr_reap(pids, world, codes, 110);
    for (int r = 0; r < world; r++) {
        if (codes[r] != 0)
            print_error("rank %d of %d exited with %d\n", r, world, codes[r]);
        assert_int_equal(codes[r], 0);
    }
}

/* Train `steps` DDP steps on a sharded loader; rank `slow_rank` burns
 * `slow` times its forward and backward time more before its backward.
 * The loop time goes to *loop. */
static int ddp_train(dt_ctx *ctx, dt_comm *c, dt_loader *ld, dt_ddp *ddp, dt_optim *opt,
                     const mlp *m, int steps, int slow_rank, double slow, double *loop)
{
    double t0 = dt_now();
    dt_tensor *x, *y;
    for (int s = 0; s < steps; s++) {
        if (dt_loader_next(ld, &x, &y) != DT_OK)
            return 10;
        double f0 = dt_now();
        dt_tensor *loss = mlp_loss(ctx, m, x, y);
        if (dt_comm_rank(c) == slow_rank)
            spin(slow * (dt_now() - f0) + 0.0004 * slow * (double)dt_tensor_dim(x, 0) / 16);
        if (dt_backward(ctx, loss) != DT_OK || dt_ddp_step(ddp) != DT_OK)
            return 11;
        (void)opt;
        dt_ctx_zero_grad(ctx);
        dt_ctx_step_reset(ctx);
    }
    *loop = dt_now() - t0;
    return 0;
}

/* A profiled DDP job's pieces: profiler (checks every 5 steps), this
 * rank's shard of job_data, the MLP, SGD and the DDP. */
typedef struct job {
    dt_dataset *ds;
    dt_loader *ld;
    mlp m;
    dt_optim *opt;
    dt_ddp *ddp;
} job;

static int job_zero;   /* the DDP's sharding level (dt_ddp_config.zero) */

static int job_start(dt_ctx *ctx, dt_comm *c, int profile, job *j)
{
    memset(j, 0, sizeof *j);
    dt_profile_config pc;
    dt_profile_config_init(&pc);
    pc.check_every = 5;
    if (profile && dt_profile_start(ctx, &pc) != DT_OK)
        return 1;
    j->ds = dt_dataset_load_idx(ctx, job_data.img, job_data.lab);
    dt_loader_config lc;
    dt_loader_config_init(&lc);
    lc.batch = 16;
    lc.shard_rank = dt_comm_rank(c);
    lc.shard_count = dt_comm_size(c);
    j->ld = j->ds ? dt_loader_new(ctx, j->ds, &lc) : NULL;
    if (!j->ld || mlp_build(ctx, &j->m))
        return 2;
    dt_optim_config oc;
    dt_optim_config_init(&oc, DT_SGD);
    j->opt = dt_optim_new(ctx, &oc, NULL, 0);
    dt_ddp_config dc;
    dt_ddp_config_init(&dc);
    dc.zero = job_zero;
    dc.bucket_bytes = 4096;   /* zero 3: several units, prefetched one after another */
    j->ddp = j->opt ? dt_ddp_new(ctx, c, j->opt, job_zero ? &dc : NULL) : NULL;
    return j->ddp ? 0 : 3;
}

static void job_end(job *j)
{
    dt_ddp_free(j->ddp);
    dt_optim_free(j->opt);
    dt_loader_free(j->ld);
    dt_dataset_free(j->ds);
}

static int trace_rank(dt_ctx *ctx, dt_comm *c, int rank, int world)
{
    (void)world;
    job j;
    double loop = 0;
    if (job_start(ctx, c, 1, &j) || ddp_train(ctx, c, j.ld, j.ddp, j.opt, &j.m, 15, -1, 0, &loop))
        return 3;
    /* every rank's own loop time, for rank 0 to compare with its phases */
    float mine = (float)loop, loops[2] = {0, 0};
    if (dt_comm_allgather(c, &mine, 1, loops) != DT_OK)
        return 4;
    if (dt_profile_stop(ctx, c, rank == 0 ? job_trace : NULL) != DT_OK)
        return 5;
    if (rank == 0) {
        for (int r = 0; r < 2; r++) {
            dt_profile_stats st;
            if (dt_profile_rank_stats_get(ctx, r, &st) != DT_OK)
                return 6;
            double sum = st.data_s + st.forward_s + st.backward_s + st.comm_wait_s +
                         st.optimizer_s + st.idle_s;
            if (st.steps != 15 || fabs(sum - st.step_s) > 1e-6 * st.step_s + 1e-9)
                return 7;
            if (fabs(st.step_s - loops[r]) > 0.05 * loops[r]) {
                fprintf(stderr, "rank %d: phases %.4f s, loop %.4f s\n", r, st.step_s,
                        (double)loops[r]);
                return 8;
            }
            if (st.collectives < 15 || st.coll_bytes == 0 || !(st.busbw > 0))
                return 9;
        }
        const char *rep = dt_profile_report(ctx);
        if (!strstr(rep, "dtrain profile: 2 ranks") || !strstr(rep, "communication:") ||
            !strstr(rep, "link's")) {
            fprintf(stderr, "report:\n%s\n", rep);
            return 12;
        }
    }
    job_end(&j);
    return 0;
}

/* The report's lines that start with one of the prefixes, to stderr: the
 * verdicts a real run gave, in the test's log. */
static void show_lines(const char *rep, const char *const *prefixes, int n)
{
    for (const char *line = rep; line && *line;) {
        const char *end = strchr(line, '\n');
        int len = end ? (int)(end - line) : (int)strlen(line);
        for (int k = 0; k < n; k++)
            if (!strncmp(line, prefixes[k], strlen(prefixes[k])))
                fprintf(stderr, "  %.*s\n", len, line);
        line = end ? end + 1 : NULL;
    }
}

/* --- slow is not dead: a loader slower than the peer timeout --------------
 * Rank 1's samples come from a callback that takes 0.5 s over each of 3
 * samples in batches 3 and 4: 1.5 s per batch, past the 1 s peer timeout.
 * Its heartbeat keeps it alive to rank 0, which waits in its DDP step; the
 * job finishes, and the report names rank 1's data wait. */
static int slow_fill(void *user, int64_t i, void *input, void *target)
{
    int rank = *(const int *)user;
    float *x = input;
    for (int k = 0; k < PIXELS; k++)
        x[k] = (float)((i * 31 + k) % 17) / 17.0f;
    *(int32_t *)target = (int32_t)(i % CLASSES);
    if (rank == 1 && i >= 3 * 16 && i < 5 * 16 && i % 16 < 3)
        usleep(500 * 1000);
    return 0;
}

static int slow_loader_rank(dt_ctx *ctx, dt_comm *c, int rank, int world)
{
    (void)world;
    dt_profile_config pc;
    dt_profile_config_init(&pc);
    if (dt_profile_start(ctx, &pc) != DT_OK)
        return 1;
    dt_sample_field fi = {DT_F32, 1, {PIXELS}}, ft = {DT_I32, 0, {0}};
    dt_dataset *ds = dt_dataset_from_callback(ctx, 8 * 16, &fi, &ft, slow_fill, &rank);
    dt_loader_config lc;
    dt_loader_config_init(&lc);
    lc.batch = 16;
    lc.shuffle = 0;
    dt_loader *ld = ds ? dt_loader_new(ctx, ds, &lc) : NULL;
    mlp m;
    if (!ld || mlp_build(ctx, &m))
        return 2;
    dt_optim_config oc;
    dt_optim_config_init(&oc, DT_SGD);
    dt_optim *opt = dt_optim_new(ctx, &oc, NULL, 0);
    dt_ddp *ddp = opt ? dt_ddp_new(ctx, c, opt, NULL) : NULL;
    double loop = 0;
    if (!ddp || dt_loader_start_epoch(ld, 0) != DT_OK ||
        ddp_train(ctx, c, ld, ddp, opt, &m, 8, -1, 0, &loop) != 0)
        return 3;
    if (loop < 3.0)   /* the two slow batches were there */
        return 4;
    if (dt_profile_stop(ctx, c, NULL) != DT_OK)
        return 5;
    const char *rep = dt_profile_report(ctx);
    if (rank == 0 && (!strstr(rep, "slowest rank: 1") || !strstr(rep, "largest phase: data wait") ||
                      !strstr(rep, "data: rank 1's data loader holds the job back"))) {
        fprintf(stderr, "report:\n%s\n", rep);
        return 6;
    }
    if (rank == 0)
        show_lines(rep, (const char *const[]){"data:", "long wait"}, 2);
    dt_ddp_free(ddp);
    dt_optim_free(opt);
    dt_loader_free(ld);
    dt_dataset_free(ds);
    return 0;
}

static void test_slow_loader_is_waited_on(void **state)
{
    (void)state;
    job_timeout_ms = 1000;
    run_ranks(2, slow_loader_rank);
    job_timeout_ms = 20000;
}

/* --- slow is not dead: an evaluation on one rank past the peer timeout ------
 * Rank 0 evaluates the dataset alone (dt_evaluate without the comm) after
 * step 4, a forward of 300 ms per batch of 128: 1.5 s, past the 1 s peer
 * timeout, while rank 1 waits in its next DDP step.  No failure; rank 0's
 * report names the stall and rank 1's wait for "evaluating". */
static dt_tensor *slow_logits(dt_ctx *ctx, dt_tensor *x, void *user)
{
    const mlp *m = user;
    usleep(300 * 1000);
    dt_tensor *h = dt_relu(ctx, dt_linear(ctx, dt_flatten(ctx, x, 1), m->w1, m->b1));
    return dt_linear(ctx, h, m->w2, m->b2);
}

static int eval_stall_rank(dt_ctx *ctx, dt_comm *c, int rank, int world)
{
    (void)world;
    job j;
    double loop = 0;
    if (job_start(ctx, c, 1, &j) || ddp_train(ctx, c, j.ld, j.ddp, j.opt, &j.m, 4, -1, 0, &loop))
        return 1;
    if (rank == 0) {
        dt_metrics mt;
        if (dt_evaluate(ctx, NULL, j.ds, NULL, slow_logits, &j.m, &mt) != DT_OK ||
            mt.samples != NSAMPLES)
            return 2;
    }
    if (ddp_train(ctx, c, j.ld, j.ddp, j.opt, &j.m, 8, -1, 0, &loop))
        return 3;   /* (a failure here: the wait was taken for death) */
    dt_profile_stats st;
    dt_profile_stats_get(ctx, &st);
    if (rank == 0 && !(st.eval_s >= 1.4))
        return 4;
    if (dt_profile_stop(ctx, c, NULL) != DT_OK)
        return 5;
    const char *rep = dt_profile_report(ctx);
    if (rank == 0 && (!strstr(rep, "stall: rank 0 kept the others waiting while it evaluated") ||
                      !strstr(rep, "for rank 0, which was evaluating"))) {
        fprintf(stderr, "report:\n%s\n", rep);
        return 6;
    }
    if (rank == 0)
        show_lines(rep, (const char *const[]){"stall:", "long wait"}, 2);
    job_end(&j);
    return 0;
}

static void test_evaluation_stall(void **state)
{
    (void)state;
    data_make(&job_data, NSAMPLES);
    job_timeout_ms = 1000;
    run_ranks(2, eval_stall_rank);
    job_timeout_ms = 20000;
    tu_rmdir(job_data.dir);
}

/* --- ranks with different thread counts ------------------------------------
 * Rank 0 computes with 2 threads, rank 1 with 1, on the same work (a
 * 64-1024-1024-10 MLP, batches of 128, GEMMs split over the pool).  With 3
 * CPUs or more, rank 0 gets two of them and rank 1 one (sched_setaffinity):
 * rank 1 is the straggler, and the report says its thread count against
 * the others' and what dt_ddp_balance would gain.  With fewer (2 cores:
 * CI), the 3 threads share 2 cores: rank 0's second thread only waits for
 * a CPU, and the report's cpu line says so, naming its threads. */
static int threads_cpus;   /* CPUs this process may run on */

static int threads_pin(int rank)
{
    cpu_set_t mine, want;
    if (sched_getaffinity(0, sizeof mine, &mine) != 0)
        return -1;
    CPU_ZERO(&want);
    for (int cpu = 0, k = 0; cpu < CPU_SETSIZE && k < 3; cpu++)
        if (CPU_ISSET(cpu, &mine)) {
            if ((rank == 0 && k < 2) || (rank == 1 && k == 2))
                CPU_SET(cpu, &want);
            k++;
        }
    return sched_setaffinity(0, sizeof want, &want);
}

static int threads_rank(dt_ctx *ctx, dt_comm *c, int rank, int world)
{
    (void)world;
    if (threads_cpus >= 3 && threads_pin(rank) != 0)
        return 8;
    if (dt_ctx_threads(ctx) != (rank ? 1 : 2) || dt_profile_start(ctx, NULL) != DT_OK)
        return 1;
    dt_tensor *w[3], *b[3];
    int64_t dims[4] = {PIXELS, 1024, 1024, CLASSES};
    for (int l = 0; l < 3; l++) {
        char name[16];
        snprintf(name, sizeof name, "w%d", l);
        w[l] = dt_param_new(ctx, name, 2, (const int64_t[]){dims[l + 1], dims[l]});
        snprintf(name, sizeof name, "b%d", l);
        b[l] = dt_param_new(ctx, name, 1, (const int64_t[]){dims[l + 1]});
        if (!w[l] || !b[l] || dt_tensor_init_kaiming_uniform(ctx, w[l], 2.2360679775f) != DT_OK)
            return 2;
    }
    dt_dataset *ds = dt_dataset_load_idx(ctx, job_data.img, job_data.lab);
    dt_loader_config lc;
    dt_loader_config_init(&lc);
    lc.batch = 128;
    lc.shard_rank = rank;
    lc.shard_count = 2;
    dt_loader *ld = ds ? dt_loader_new(ctx, ds, &lc) : NULL;
    dt_optim_config oc;
    dt_optim_config_init(&oc, DT_SGD);
    dt_optim *opt = ld ? dt_optim_new(ctx, &oc, NULL, 0) : NULL;
    dt_ddp *ddp = opt ? dt_ddp_new(ctx, c, opt, NULL) : NULL;
    if (!ddp)
        return 3;
    dt_tensor *x, *y;
    for (int s = 0; s < 16; s++) {
        dt_status st = dt_loader_next(ld, &x, &y);
        if (st == DT_EOF && dt_loader_start_epoch(ld, s) == DT_OK)
            st = dt_loader_next(ld, &x, &y);
        if (st != DT_OK)
            return 4;
        dt_tensor *h = dt_flatten(ctx, x, 1);
        for (int l = 0; l < 3; l++)
            h = l < 2 ? dt_relu(ctx, dt_linear(ctx, h, w[l], b[l])) : dt_linear(ctx, h, w[l], b[l]);
        if (dt_backward(ctx, dt_cross_entropy(ctx, h, y)) != DT_OK || dt_ddp_step(ddp) != DT_OK)
            return 5;
        dt_ctx_zero_grad(ctx);
        dt_ctx_step_reset(ctx);
    }
    if (dt_profile_stop(ctx, c, NULL) != DT_OK)
        return 6;
    const char *rep = dt_profile_report(ctx);
    if (rank == 0) {
        show_lines(rep, (const char *const[]){"straggler", "hint: dt_ddp_balance", "cpu:",
                                              "hint: rank"}, 4);
        int named = threads_cpus >= 3
                    ? strstr(rep, "straggler: rank 1 computes") &&
                          strstr(rep, "it computes with 1 thread against 2 on the others") &&
                          strstr(rep, "hint: dt_ddp_balance(ddp, loader, 50)")
                    : strstr(rep, "cpu: rank 0 (2 compute threads) got") &&
                          strstr(rep, "more runnable threads than cores");
        if (!named) {
            fprintf(stderr, "report:\n%s\n", rep);
            return 7;
        }
    }
    dt_ddp_free(ddp);
    dt_optim_free(opt);
    dt_loader_free(ld);
    dt_dataset_free(ds);
    return 0;
}

static void test_thread_counts(void **state)
{
    (void)state;
    data_make(&job_data, NSAMPLES);
    cpu_set_t mine;
    threads_cpus = sched_getaffinity(0, sizeof mine, &mine) == 0 ? CPU_COUNT(&mine) : 1;
    fprintf(stderr, "%d CPUs: %s\n", threads_cpus,
            threads_cpus >= 3 ? "rank 0 on two, rank 1 on one: the straggler's line"
                              : "3 threads on them: the cpu line (the straggler's needs 3 CPUs)");
    job_threads[0] = 2, job_threads[1] = 1;
    run_ranks(2, threads_rank);
    job_threads[0] = job_threads[1] = 0;
    tu_rmdir(job_data.dir);
}

/* --- a report even when the job fails ---------------------------------------
 * 3 ranks train with DDP; rank 2 is killed (SIGKILL) after 4 steps.  The
 * survivors' steps fail; dt_profile_stop cannot exchange, and says so,
 * but rank 0's report covers both survivors (what each was doing: its
 * error) and names rank 2's missing part, and its trace is written. */
static int failed_job_rank(dt_ctx *ctx, dt_comm *c, int rank, int world)
{
    (void)world;
    job j;
    if (job_start(ctx, c, 1, &j))
        return 1;
    dt_tensor *x, *y;
    dt_status st = DT_OK;
    for (int s = 0; s < 40 && st == DT_OK; s++) {
        if (rank == 2 && s == 4)
            raise(SIGKILL);
        st = dt_loader_next(j.ld, &x, &y);
        dt_tensor *loss = st == DT_OK ? mlp_loss(ctx, &j.m, x, y) : NULL;
        st = loss ? dt_backward(ctx, loss) : dt_last_status(ctx);
        if (st == DT_OK)
            st = dt_ddp_step(j.ddp);
        dt_ctx_zero_grad(ctx);
        dt_ctx_step_reset(ctx);
    }
    if (st == DT_OK)
        return 2;   /* the death must have failed a step */
    if (dt_profile_stop(ctx, c, rank == 0 ? job_trace : NULL) == DT_OK)
        return 3;
    const char *rep = dt_profile_report(ctx), *m = dt_last_error(ctx);
    if (!strstr(m, "could not exchange") || !strstr(rep, "dtrain profile of a failed job")) {
        fprintf(stderr, "rank %d: %s\nreport:\n%s\n", rank, m, rep);
        return 4;
    }
    if (rank == 0 && (!strstr(rep, "2 of 3 ranks reported") || !strstr(rep, "rank 1 was: ") ||
                      !strstr(rep, "rank 2: no part") || !strstr(rep, "rank 2 died"))) {
        fprintf(stderr, "report:\n%s\n", rep);
        return 5;
    }
    size_t len = 0;
    char *js = rank == 0 ? read_all(job_trace, &len) : NULL;
    int bad_trace = rank == 0 && (!js || !json_valid(js, len));
    free(js);
    if (bad_trace)
        return 6;
    fprintf(stderr, "rank %d's report of the failed job:\n%s", rank, rep);
    job_end(&j);
    return 0;
}

static void test_report_of_a_failed_job(void **state)
{
    (void)state;
    data_make(&job_data, NSAMPLES);
    snprintf(job_trace, sizeof job_trace, "%s/trace.json", job_data.dir);
    pid_t pids[3];
    int codes[3], port = tr_free_port();
    fflush(NULL);
    for (int r = 0; r < 3; r++) {
        pids[r] = fork();
        assert_true(pids[r] >= 0);
        if (pids[r] == 0)
            rank_main(r, 3, port, failed_job_rank);
    }
    tr_reap(pids, 3, codes, 110);
    assert_int_equal(codes[0], 0);
    assert_int_equal(codes[1], 0);
    assert_int_equal(codes[2], 200 + SIGKILL);
    tu_rmdir(job_data.dir);
}

static void test_trace_two_ranks(void **state)
{
    (void)state;
    data_make(&job_data, NSAMPLES);
    snprintf(job_trace, sizeof job_trace, "%s/trace.json", job_data.dir);
    run_ranks(2, trace_rank);
    size_t len = 0;
    char *js = read_all(job_trace, &len);
    assert_non_null(js);
    assert_true(json_valid(js, len));
    assert_non_null(strstr(js, "\"traceEvents\""));
    /* both ranks' rows, each with phases on compute and collectives on comm */
    for (int r = 0; r < 2; r++) {
        char k[64];
        snprintf(k, sizeof k, "{\"ph\":\"X\",\"pid\":%d,\"tid\":1,", r);
        assert_true(count_of(js, k) >= 15 * 4);
        snprintf(k, sizeof k, "{\"ph\":\"X\",\"pid\":%d,\"tid\":2,", r);
        assert_true(count_of(js, k) >= 15);
        snprintf(k, sizeof k, "\"name\":\"rank %d\"", r);
        assert_int_equal(count_of(js, k), 1);
    }
    assert_int_equal(count_of(js, "\"name\":\"backward\""), 30);
    assert_true(count_of(js, "\"busbw_GBps\"") >= 30);
    free(js);
    tu_rmdir(job_data.dir);
}

/* A sharded job's report says how long the parameters' all-gathers ran and
 * how much of that the step waited for: the profile's figures are the
 * DDP's own (dt_ddp_stats), on every rank. */
static int zero_report_rank(dt_ctx *ctx, dt_comm *c, int rank, int world)
{
    (void)world;
    job j;
    double loop;
    if (job_start(ctx, c, 1, &j) || ddp_train(ctx, c, j.ld, j.ddp, j.opt, &j.m, 12, -1, 0, &loop))
        return 3;
    dt_ddp_stats ds;
    dt_profile_stats ps;
    if (dt_ddp_stats_get(j.ddp, &ds) || dt_profile_stats_get(ctx, &ps))
        return 4;
    if (!(ds.gather_s > 0) || ps.gather_s != ds.gather_s || ps.gather_exposed_s != ds.gather_exposed_s ||
        ds.gathers < 12 || ps.gathers != ds.gathers || ps.gathers_on_demand != ds.gathers_on_demand) {
        fprintf(stderr, "rank %d: ddp %g s (%g exposed, %lld gathers), profile %g s (%g)\n", rank,
                ds.gather_s, ds.gather_exposed_s, (long long)ds.gathers, ps.gather_s,
                ps.gather_exposed_s);
        return 5;
    }
    if (dt_profile_stop(ctx, c, NULL) != DT_OK)
        return 6;
    const char *rep = dt_profile_report(ctx);
    char units[96];
    snprintf(units, sizeof units, "of its %lld units gathered on demand", (long long)ds.gathers);
    if (rank == 0 && (!strstr(rep, "sharded parameters: all-gathers ran") || !strstr(rep, "exposed") ||
                      (ds.gathers > 0 && !strstr(rep, units)))) {
        fprintf(stderr, "report:\n%s\n", rep);
        return 7;
    }
    job_end(&j);
    return 0;
}

static void test_zero_gathers_reported(void **state)
{
    (void)state;
    data_make(&job_data, NSAMPLES);
    job_zero = 3;
    run_ranks(2, zero_report_rank);
    job_zero = 0;
    tu_rmdir(job_data.dir);
}

/* --- stragglers ----------------------------------------------------------------- */

static char last_warning[512];
static void keep_warning(void *user, const char *msg)
{
    (void)user;
    if (strstr(msg, "straggler"))
        snprintf(last_warning, sizeof last_warning, "%s", msg);
}

static int straggler_rank(dt_ctx *ctx, dt_comm *c, int rank, int world)
{
    (void)world;
    dt_ctx_set_log(ctx, keep_warning, NULL);
    job j;
    double loop;
    if (job_start(ctx, c, 1, &j) || ddp_train(ctx, c, j.ld, j.ddp, j.opt, &j.m, 16, 1, 2.0, &loop))
        return 3;
    /* every rank heard the same verdict, and was told */
    if (dt_profile_straggler(ctx) != 1 || !strstr(last_warning, "straggler: rank 1 ")) {
        fprintf(stderr, "straggler %d, warning '%s'\n", dt_profile_straggler(ctx), last_warning);
        return 4;
    }
    if (dt_profile_stop(ctx, c, NULL) != DT_OK)
        return 5;
    if (rank == 0 && (!strstr(dt_profile_report(ctx), "straggler: rank 1 computes") ||
                      !strstr(dt_profile_report(ctx), "hint: dt_ddp_balance(ddp, loader, 50)") ||
                      strstr(dt_profile_report(ctx), "straggler: rank 0"))) {
        fprintf(stderr, "report:\n%s\n", dt_profile_report(ctx));
        return 6;
    }
    dt_profile_stats st;
    dt_profile_stats_get(ctx, &st);
    if ((rank == 1) != (st.straggler_warnings > 0))
        return 7;
    job_end(&j);
    return 0;
}

static void test_straggler(void **state)
{
    (void)state;
    data_make(&job_data, NSAMPLES);
    run_ranks(2, straggler_rank);
    tu_rmdir(job_data.dir);
}

/* --- global batches ---------------------------------------------------------------- */

/* Every sample index of the loader's next batch, into out; returns count. */
static int64_t batch_samples(dt_loader *ld, int *out)
{
    dt_tensor *x, *y;
    if (dt_loader_next(ld, &x, &y) != DT_OK)
        return -1;
    int64_t n = dt_tensor_dim(x, 0);
    float *p = malloc(sizeof(float) * (size_t)(n * PIXELS));
    assert_non_null(p);
    assert_int_equal(dt_tensor_get(x, p, n * PIXELS), DT_OK);
    for (int64_t i = 0; i < n; i++)
        out[i] = sample_of(p + i * PIXELS);
    free(p);
    return n;
}

static void test_global_batches(void **state)
{
    (void)state;
    data d;
    data_make(&d, 250);
    dt_ctx *ctx = tu_ctx_new();
    dt_dataset *ds = dt_dataset_load_idx(ctx, d.img, d.lab);
    tu_check(ctx, ds, "load");
    dt_loader_config lc;
    dt_loader_config_init(&lc);
    lc.batch = 24;
    lc.seed = 5;
    dt_loader *whole = dt_loader_new(ctx, ds, &lc);   /* batch 24 */
    lc.batch = 8;
    lc.shard_count = 3;
    lc.global_batches = 1;
    dt_loader *sh[3];
    for (int r = 0; r < 3; r++) {
        lc.shard_rank = r;
        lc.prefetch = r != 1;   /* with and without the prefetch thread */
        sh[r] = dt_loader_new(ctx, ds, &lc);
        tu_check(ctx, sh[r], "loader");
    }
    /* 250 = 10 x 24 + 10: the last global batch has 10 >= 3 samples */
    assert_int_equal(dt_loader_batches(sh[0]), 11);
    assert_int_equal(dt_loader_batches(whole), 11);
    const double w[2][3] = {{1, 1, 1}, {3, 1, 0.5}};
    int got[72], want[24];
    for (int b = 0; b < 11; b++) {
        if (b == 4)   /* a new split from batch 5 on (batch 4 already prefetched: re-cut) */
            for (int r = 0; r < 3; r++)
                assert_int_equal(dt_loader_set_split(sh[r], w[1], 3), DT_OK);
        int64_t nw = batch_samples(whole, want), k = 0;
        for (int r = 0; r < 3; r++) {
            int64_t off, cnt, glob;
            int64_t n = batch_samples(sh[r], got + k);
            dt_loader_batch_slice(sh[r], &off, &cnt, &glob);
            assert_int_equal(off, k);
            assert_int_equal(cnt, n);
            assert_int_equal(glob, nw);
            assert_true(n >= 1);
            k += n;
        }
        assert_int_equal(k, nw);
        for (int64_t i = 0; i < nw; i++)
            assert_int_equal(got[i], want[i]);
        if (b >= 4 && b < 10) {   /* 24 cut 3 : 1 : 0.5 */
            int64_t cnt;
            dt_loader_batch_slice(sh[0], NULL, &cnt, NULL);
            assert_int_equal(cnt, 16);
        }
    }
    dt_tensor *x, *y;
    assert_int_equal(dt_loader_next(sh[0], &x, &y), DT_EOF);
    /* misuse */
    const double bad[3] = {1, 0, 1};
    assert_int_equal(dt_loader_set_split(sh[0], bad, 3), DT_EINVAL);
    assert_non_null(strstr(dt_last_error(ctx), "weight 1"));
    assert_int_equal(dt_loader_set_split(sh[0], w[0], 2), DT_EINVAL);
    assert_int_equal(dt_loader_set_split(whole, w[0], 1), DT_ESTATE);
    for (int r = 0; r < 3; r++)
        dt_loader_free(sh[r]);
    dt_loader_free(whole);
    dt_dataset_free(ds);
    dt_ctx_free(ctx);
    tu_rmdir(d.dir);
}

/* --- balanced DDP equals one process on the global batch ------------------------- */

enum { BAL_STEPS = 18, BAL_BATCH = 16 };

static int train_reference(float *out, int64_t nfloats)
{
    dt_ctx_config cfg;
    dt_ctx_config_init(&cfg);
    cfg.seed = 7;
    dt_ctx *ctx = dt_ctx_new(&cfg);
    dt_dataset *ds = dt_dataset_load_idx(ctx, job_data.img, job_data.lab);
    dt_loader_config lc;
    dt_loader_config_init(&lc);
    lc.batch = 2 * BAL_BATCH;
    lc.seed = 3;
    dt_loader *ld = ds ? dt_loader_new(ctx, ds, &lc) : NULL;
    mlp m;
    if (!ld || mlp_build(ctx, &m))
        return 1;
    dt_optim_config oc;
    dt_optim_config_init(&oc, DT_SGD);
    oc.lr = 0.1f;
    dt_optim *opt = dt_optim_new(ctx, &oc, NULL, 0);
    dt_tensor *x, *y;
    for (int s = 0; s < BAL_STEPS; s++) {
        if (dt_loader_next(ld, &x, &y) != DT_OK || dt_backward(ctx, mlp_loss(ctx, &m, x, y)) ||
            dt_optim_step(opt))
            return 2;
        dt_optim_zero_grad(opt);
        dt_ctx_step_reset(ctx);
    }
    int64_t k = 0;
    for (int i = 0; i < dt_param_count(ctx); i++) {
        const dt_tensor *p = dt_param_at(ctx, i);
        int64_t n = dt_tensor_numel(p);
        if (k + n > nfloats)
            return 3;
        if (dt_tensor_get(p, out + k, n) != DT_OK)
            return 4;
        k += n;
    }
    dt_optim_free(opt);
    dt_loader_free(ld);
    dt_dataset_free(ds);
    dt_ctx_free(ctx);
    return 0;
}

static int balance_rank(dt_ctx *ctx, dt_comm *c, int rank, int world)
{
    dt_dataset *ds = dt_dataset_load_idx(ctx, job_data.img, job_data.lab);
    dt_loader_config lc;
    dt_loader_config_init(&lc);
    lc.batch = BAL_BATCH;
    lc.seed = 3;
    lc.shard_rank = rank;
    lc.shard_count = world;
    lc.global_batches = 1;
    dt_loader *ld = ds ? dt_loader_new(ctx, ds, &lc) : NULL;
    mlp m;
    if (!ld || mlp_build(ctx, &m))
        return 1;
    dt_optim_config oc;
    dt_optim_config_init(&oc, DT_SGD);
    oc.lr = 0.1f;
    dt_optim *opt = dt_optim_new(ctx, &oc, NULL, 0);
    dt_ddp *ddp = opt ? dt_ddp_new(ctx, c, opt, NULL) : NULL;
    if (!ddp || dt_ddp_balance(ddp, ld, 4) != DT_OK)
        return 2;
    double loop;
    if (ddp_train(ctx, c, ld, ddp, opt, &m, BAL_STEPS, 1, 3.0, &loop))
        return 3;
    /* the slow rank now gets the smaller slice, and the slices add up */
    double share = dt_ddp_balance_share(ddp);
    int64_t cnt, glob;
    dt_loader_batch_slice(ld, NULL, &cnt, &glob);
    float mine[2] = {(float)share, (float)cnt}, all[4];
    if (dt_comm_allgather(c, mine, 2, all) != DT_OK)
        return 4;
    if (!(all[0] > 0.55f) || all[1] + all[3] != (float)glob) {
        fprintf(stderr, "shares %.3f %.3f, counts %g + %g of %lld\n", (double)all[0],
                (double)all[2], (double)all[1], (double)all[3], (long long)glob);
        return 5;
    }
    float ref[HID * PIXELS + HID + CLASSES * HID + CLASSES];
    if (train_reference(ref, (int64_t)(sizeof ref / sizeof ref[0])))
        return 6;
    int64_t k = 0;
    double worst = 0;
    for (int i = 0; i < dt_param_count(ctx); i++) {
        const dt_tensor *p = dt_param_at(ctx, i);
        float v[HID * PIXELS];
        if (dt_tensor_numel(p) > HID * PIXELS || dt_tensor_get(p, v, dt_tensor_numel(p)) != DT_OK)
            return 9;
        for (int64_t j = 0; j < dt_tensor_numel(p); j++, k++) {
            double e = fabs((double)v[j] - ref[k]) / (fabs((double)ref[k]) + 1e-3);
            worst = e > worst ? e : worst;
        }
    }
    if (worst > 1e-5) {
        fprintf(stderr, "rank %d: largest relative difference from one process %.3g\n", rank,
                worst);
        return 7;
    }
    /* misuse: a second balance, and a loader without global batches */
    if (dt_ddp_balance(ddp, ld, 4) != DT_EINVAL || !strstr(dt_last_error(ctx), "already"))
        return 8;
    dt_ddp_free(ddp);
    dt_optim_free(opt);
    dt_loader_free(ld);
    dt_dataset_free(ds);
    return 0;
}

static void test_balance_equivalence(void **state)
{
    (void)state;
    data_make(&job_data, NSAMPLES);
    run_ranks(2, balance_rank);
    tu_rmdir(job_data.dir);
}

/* --- work stealing ------------------------------------------------------------------ */

static int steal_rank(dt_ctx *ctx, dt_comm *c, int rank, int world)
{
    dt_dataset *ds = dt_dataset_load_idx(ctx, job_data.img, job_data.lab);
    dt_loader_config lc;
    dt_loader_config_init(&lc);
    lc.batch = 10;
    lc.seed = 9;
    lc.shard_rank = rank;
    lc.shard_count = world;
    dt_loader *ld = ds ? dt_loader_new(ctx, ds, &lc) : NULL;
    if (!ld || dt_loader_steal(ld, c, 2) != DT_OK)
        return 1;
    /* every sample of the epoch: counted here, summed over the ranks */
    float seen[NSAMPLES + 1];
    memset(seen, 0, sizeof seen);
    for (int epoch = 0; epoch < 2; epoch++) {
        if (epoch && dt_loader_start_epoch(ld, epoch) != DT_OK)
            return 2;
        int ids[10];
        int64_t n;
        while ((n = batch_samples(ld, ids)) > 0) {
            for (int64_t i = 0; i < n; i++)
                seen[ids[i]] += 1;
            if (rank == 1)   /* the slow worker */
                spin(0.004);
        }
        if (n != -1 || dt_last_status(ctx) != DT_OK)
            return 3;
    }
    seen[NSAMPLES] = (float)dt_loader_batches_stolen(ld);
    float all[3 * (NSAMPLES + 1)];
    if (dt_comm_allgather(c, seen, NSAMPLES + 1, all) != DT_OK)
        return 4;
    for (int k = 0; k < NSAMPLES; k++) {
        float tot = 0;
        for (int r = 0; r < world; r++)
            tot += all[r * (NSAMPLES + 1) + k];
        if (tot != 2.0f) {   /* once per epoch: 600 = 3 x 200, no padding */
            fprintf(stderr, "sample %d seen %g times in 2 epochs\n", k, (double)tot);
            return 5;
        }
    }
    /* the fast workers took chunks of the slow one's shard */
    if (!(all[NSAMPLES] + all[2 * (NSAMPLES + 1) + NSAMPLES] > 0) ||
        all[1 * (NSAMPLES + 1) + NSAMPLES] > all[NSAMPLES]) {
        fprintf(stderr, "stolen: %g %g %g\n", (double)all[NSAMPLES],
                (double)all[2 * NSAMPLES + 1], (double)all[3 * NSAMPLES + 2]);
        return 6;
    }
    dt_loader_free(ld);
    dt_dataset_free(ds);
    return 0;
}

static void test_work_stealing(void **state)
{
    (void)state;
    data_make(&job_data, NSAMPLES);
    run_ranks(3, steal_rank);
    tu_rmdir(job_data.dir);
}

/* --- misuse ------------------------------------------------------------------------------ */

static int misuse_rank(dt_ctx *ctx, dt_comm *c, int rank, int world)
{
    (void)world;
    job j;
    if (job_start(ctx, c, 0, &j))
        return 1;
    /* the loader has no global batches: every rank refuses, none hangs */
    if (dt_ddp_balance(j.ddp, j.ld, 4) != DT_EINVAL || !strstr(dt_last_error(ctx), "global_batches"))
        return 2;
    /* one rank's bad call: the other, whose call was good, hears of it */
    dt_loader_config lc;
    dt_loader_config_init(&lc);
    lc.batch = 8;
    lc.shard_rank = rank;
    lc.shard_count = 2;
    lc.global_batches = 1;
    dt_loader *gl = dt_loader_new(ctx, j.ds, &lc);
    if (!gl || dt_ddp_balance(j.ddp, rank == 1 ? NULL : gl, 4) != DT_EINVAL ||
        !strstr(dt_last_error(ctx), rank == 1 ? "NULL" : "rank 1 refused"))
        return 3;
    dt_loader_free(gl);
    if (dt_loader_steal(j.ld, c, 0) != DT_EINVAL || dt_loader_steal(j.ld, NULL, 2) != DT_EINVAL)
        return 4;
    /* profiling off: finish is a no-op on every rank */
    if (dt_profile_stop(ctx, c, "/nonexistent/x.json") != DT_OK || dt_profile_active(ctx))
        return 5;
    /* on, a trace path rank 0 cannot write: rank 0 fails, saying so */
    if (dt_profile_start(ctx, NULL) != DT_OK)
        return 6;
    dt_status st = dt_profile_stop(ctx, c, rank == 0 ? "/nonexistent/dir/x.json" : NULL);
    if (rank == 0 && (st != DT_EIO || !strstr(dt_last_error(ctx), "/nonexistent/dir/x.json")))
        return 7;
    if (rank == 1 && st != DT_OK)
        return 8;
    job_end(&j);
    return 0;
}

static void test_misuse(void **state)
{
    (void)state;
    data_make(&job_data, 200);
    run_ranks(2, misuse_rank);
    /* arguments */
    assert_int_equal(dt_profile_stats_get(NULL, NULL), DT_EINVAL);
    assert_int_equal(dt_profile_start(NULL, NULL), DT_EINVAL);
    assert_int_equal(dt_profile_straggler(NULL), -1);
    assert_string_equal(dt_profile_report(NULL), "");
    assert_int_equal(dt_ddp_balance(NULL, NULL, 1), DT_EINVAL);
    assert_int_equal(dt_loader_set_split(NULL, NULL, 0), DT_EINVAL);
    tu_rmdir(job_data.dir);
}

/* --- the parameter server's calls ------------------------------------------------------------ */

/* Make directory dir with its quota file set to text; 0 (nothing left
 * behind) when this process may not. */
static int try_quota(const char *dir, const char *file, const char *text)
{
    if (mkdir(dir, 0755) != 0)
        return 0;
    char q[192];
    snprintf(q, sizeof q, "%s/%s", dir, file);
    FILE *f = fopen(q, "w");
    int ok = f && fprintf(f, "%s\n", text) > 0;
    if (f && fclose(f) != 0)
        ok = 0;
    if (!ok)
        rmdir(dir);
    return ok;
}

/* A cgroup with a CPU quota of quota_us per 100 ms (v1's cpu controller,
 * else v2); its procs file into procs, its directory into dir; 0 when this
 * process may not make one (the reason printed). */
static int make_quota_cgroup(char *dir, size_t dcap, char *procs, size_t pcap, int quota_us)
{
    char v1[32], v2[48];
    snprintf(v1, sizeof v1, "%d", quota_us);
    snprintf(v2, sizeof v2, "%d 100000", quota_us);
    snprintf(dir, dcap, "/sys/fs/cgroup/cpu/dtrain_test_%d", (int)getpid());
    int ok = try_quota(dir, "cpu.cfs_quota_us", v1);
    if (!ok && access("/sys/fs/cgroup/cgroup.controllers", F_OK) == 0) {
        snprintf(dir, dcap, "/sys/fs/cgroup/dtrain_test_%d", (int)getpid());
        ok = try_quota(dir, "cpu.max", v2);
    }
    if (!ok) {
        fprintf(stderr, "skipped: the cgroup CPU quota case (cannot make a cgroup with a quota "
                        "here: %s)\n", strerror(errno));
        return 0;
    }
    snprintf(procs, pcap, "%s/cgroup.procs", dir);
    return 1;
}

/* The server's cgroup (test_ps_server_throttled): it enters it first. */
static char ps_quota_procs[160];
static int http_get(int port, const char *path, char *out, size_t cap);

/* Rank 0 of the throttled job: /api/state names the throttled server
 * within 15 s (the monitor's interval verdict, prof_cpu_starved). */
static int state_names_throttled(dt_monitor *mon)
{
    char *body = malloc(1 << 16);
    int named = 0;
    for (int k = 0; body && k < 60 && !named; k++) {
        usleep(250 * 1000);
        named = http_get(dt_monitor_port(mon), "/api/state", body, 1 << 16) == 200 &&
                strstr(body, "\"cpu_starved\":2,") &&
                strstr(body, "rank 2 (parameter server) was throttled");
    }
    if (named) {
        const char *why = strstr(body, "\"cpu_why\":");
        fprintf(stderr, "/api/state cpu_why: %.*s\n", why ? (int)strcspn(why + 11, "\"") : 0,
                why ? why + 11 : "");
    }
    free(body);
    return named;
}

static int ps_profile_rank(dt_ctx *ctx, dt_comm *c, int rank, int world)
{
    int W = world - 1;
    if (rank == W && ps_quota_procs[0]) {   /* the server, under the CPU quota */
        FILE *f = fopen(ps_quota_procs, "w");
        if (!f || fprintf(f, "%d\n", (int)getpid()) < 0 || fclose(f) != 0)
            return 11;
    }
    mlp m;
    if (rank < W && mlp_build(ctx, &m))
        return 1;
    if (dt_profile_start(ctx, NULL) != DT_OK)
        return 2;
    dt_monitor *mon = NULL;
    if (ps_quota_procs[0]) {   /* the live view too */
        dt_monitor_config mc;
        dt_monitor_config_init(&mc);
        mc.interval_s = 0.25;
        if (!(mon = dt_monitor_new(ctx, c, &mc)))
            return 13;
    }
    dt_ps_config pc;
    dt_ps_config_init(&pc);
    pc.servers = 1;
    pc.mode = DT_PS_ASP;
    dt_ps *ps = dt_ps_new(ctx, c, &pc);
    if (!ps)
        return 3;
    if (dt_ps_is_server(ps)) {
        if (dt_ps_serve(ps) != DT_OK)
            return 4;
    } else {
        dt_dataset *ds = dt_dataset_load_idx(ctx, job_data.img, job_data.lab);
        dt_loader_config lc;
        dt_loader_config_init(&lc);
        lc.batch = 16;
        lc.shard_rank = rank;
        lc.shard_count = W;
        dt_loader *ld = ds ? dt_loader_new(ctx, ds, &lc) : NULL;
        dt_tensor *x, *y;
        for (int s = 0; ld && s < 12; s++) {
            if (dt_loader_next(ld, &x, &y) != DT_OK ||
                dt_backward(ctx, mlp_loss(ctx, &m, x, y)) != DT_OK || dt_ps_push_pull(ps) != DT_OK)
                return 5;
            if (rank == 1)
                spin(0.002);
            dt_ctx_zero_grad(ctx);
            dt_ctx_step_reset(ctx);
        }
        dt_profile_stats st;
        dt_profile_stats_get(ctx, &st);
        if (!ld || st.steps != 12 || st.ps_calls < 24 || !(st.ps_latency_s > 0) ||
            st.ps_max_staleness < 0)
            return 6;
        /* each server's latency apart: the one server, rank W */
        if (st.ps_slowest_server != W || !(st.ps_slowest_server_ms > 0) ||
            st.ps_server_median_ms != st.ps_slowest_server_ms)
            return 16;
        dt_loader_free(ld);
        dt_dataset_free(ds);
        if (rank == 0 && mon && !state_names_throttled(mon))
            return 14;
        if (dt_ps_finish(ps) != DT_OK)
            return 7;
    }
    dt_monitor_free(mon);
    if (dt_profile_stop(ctx, c, rank == 0 ? job_trace : NULL) != DT_OK)
        return 8;
    if (rank == 0 && (!strstr(dt_profile_report(ctx), "parameter server, rank 0:") ||
                      !strstr(dt_profile_report(ctx), "no training steps")))
        return 9;
    if (rank == 0 && ps_quota_procs[0] &&
        !strstr(dt_profile_report(ctx), "cpu: rank 2 (parameter server) was throttled")) {
        fprintf(stderr, "report:\n%s\n", dt_profile_report(ctx));
        return 12;
    }
    dt_ps_free(ps);
    return dt_comm_barrier(c) != DT_OK ? 10 : 0;
}

/* --- a hot shard from skewed keys ----------------------------------------------
 * 2 workers pull and push 2048 sparse rows (dim 64) per step whose items
 * follow a Zipf law (s = 1.1 over 65536 items, drawn by inverting its
 * CDF), on 2 servers (ranks 2 and 3).  Rows go to server id % 2.  Item k
 * as id k spreads the rows over both: no hot shard.  Item k as id 2k (a
 * feature space whose ids are all even: a hash with a stride, one category
 * of two) puts every row on server rank 2: its shard is hot, and the
 * report names it. */
enum { ZIPF_ITEMS = 65536, ZIPF_IDS = 2048, ZIPF_DIM = 64, ZIPF_STEPS = 40 };
static int zipf_stride;   /* id = item * zipf_stride */

static int64_t zipf_draw(const double *cdf, uint64_t *rng)
{
    *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
    double u = (double)(*rng >> 11) * (1.0 / 9007199254740992.0);
    int64_t lo = 0, hi = ZIPF_ITEMS - 1;
    while (lo < hi) {   /* the first item whose CDF reaches u */
        int64_t mid = (lo + hi) / 2;
        if (cdf[mid] < u)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static int zipf_worker(dt_ctx *ctx, dt_ps *ps, int rank, dt_tensor *w)
{
    double *cdf = malloc(sizeof(double) * ZIPF_ITEMS), sum = 0;
    int64_t *ids = malloc(sizeof(int64_t) * ZIPF_IDS);
    float *rows = malloc(sizeof(float) * ZIPF_IDS * ZIPF_DIM);
    int bad = !cdf || !ids || !rows;
    for (int64_t k = 0; !bad && k < ZIPF_ITEMS; k++)
        cdf[k] = sum += pow((double)(k + 1), -1.1);
    for (int64_t k = 0; !bad && k < ZIPF_ITEMS; k++)
        cdf[k] /= sum;
    uint64_t rng = 12345 + (uint64_t)rank;
    for (int s = 0; !bad && s < ZIPF_STEPS; s++) {
        for (int i = 0; i < ZIPF_IDS; i++)
            ids[i] = zipf_draw(cdf, &rng) * zipf_stride;
        bad = dt_ps_sparse_pull(ps, 0, ids, ZIPF_IDS, rows) != DT_OK ||
              dt_ps_sparse_push(ps, 0, ids, ZIPF_IDS, rows) != DT_OK ||
              dt_backward(ctx, dt_sum(ctx, w)) != DT_OK || dt_ps_push_pull(ps) != DT_OK;
        dt_ctx_zero_grad(ctx);
        dt_ctx_step_reset(ctx);
    }
    free(cdf);
    free(ids);
    free(rows);
    return bad || dt_ps_finish(ps) != DT_OK;
}

static int zipf_rank(dt_ctx *ctx, dt_comm *c, int rank, int world)
{
    dt_tensor *w = dt_param_new(ctx, "w", 1, (const int64_t[]){64});
    if (!w || dt_profile_start(ctx, NULL) != DT_OK)
        return 1;
    dt_ps_table tab = {.name = "items", .rows = 2 * ZIPF_ITEMS, .dim = ZIPF_DIM,
                       .init_scale = 0.01f, .seed = 3};
    dt_ps_config pc;
    dt_ps_config_init(&pc);
    pc.servers = 2;
    pc.mode = DT_PS_ASP;
    pc.tables = &tab;
    pc.ntables = 1;
    dt_ps *ps = dt_ps_new(ctx, c, &pc);
    if (!ps)
        return 2;
    if (dt_ps_is_server(ps) ? dt_ps_serve(ps) != DT_OK : zipf_worker(ctx, ps, rank, w) != 0)
        return 3;
    if (dt_profile_stop(ctx, c, NULL) != DT_OK)
        return 4;
    const char *rep = dt_profile_report(ctx);
    if (rank == 0) {
        fprintf(stderr, "ids = %d x item:\n", zipf_stride);
        show_lines(rep, (const char *const[]){"parameter server, rank 2 serving",
                                              "parameter server, rank 3 serving",
                                              "slowest parameter server"}, 3);
        int hot = strstr(rep, "slowest parameter server: parameter server rank 2 is busy") &&
                  strstr(rep, "its shard is hot");
        if (hot != (zipf_stride == 2)) {
            fprintf(stderr, "report:\n%s\n", rep);
            return 5;
        }
    }
    dt_ps_free(ps);
    (void)world;
    return dt_comm_barrier(c) != DT_OK ? 6 : 0;
}

static void test_zipf_hot_shard(void **state)
{
    (void)state;
    for (zipf_stride = 1; zipf_stride <= 2; zipf_stride++)
        run_ranks(4, zipf_rank);
}

/* The server of that job under a 1% CPU quota (1 ms per 100 ms period):
 * the report names it as a throttled parameter server. */
static void test_ps_server_throttled(void **state)
{
    (void)state;
    char dir[128];
    if (!make_quota_cgroup(dir, sizeof dir, ps_quota_procs, sizeof ps_quota_procs, 1000)) {
        ps_quota_procs[0] = '\0';
        return;
    }
    fflush(NULL);
    pid_t probe = fork();   /* may a process enter it here? */
    assert_true(probe >= 0);
    if (probe == 0) {
        FILE *f = fopen(ps_quota_procs, "w");
        _exit(f && fprintf(f, "%d\n", (int)getpid()) > 0 && fclose(f) == 0 ? 0 : 1);
    }
    int status = 0;
    waitpid(probe, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "skipped: a process cannot enter the cgroup here\n");
        ps_quota_procs[0] = '\0';
        rmdir(dir);
        return;
    }
    data_make(&job_data, NSAMPLES);
    snprintf(job_trace, sizeof job_trace, "%s/trace.json", job_data.dir);
    run_ranks(3, ps_profile_rank);
    ps_quota_procs[0] = '\0';
    tu_rmdir(job_data.dir);
    rmdir(dir);
}

static void test_ps_calls(void **state)
{
    (void)state;
    data_make(&job_data, NSAMPLES);
    snprintf(job_trace, sizeof job_trace, "%s/trace.json", job_data.dir);
    run_ranks(3, ps_profile_rank);
    size_t len = 0;
    char *js = read_all(job_trace, &len);
    assert_non_null(js);
    assert_true(json_valid(js, len));
    assert_true(count_of(js, "\"name\":\"ps pull\"") >= 24);
    assert_true(count_of(js, "\"staleness\":") >= 24);
    assert_true(count_of(js, "\"latency_ms\":") >= 48);
    free(js);
    tu_rmdir(job_data.dir);
}

/* --- the store's counters -------------------------------------------------------------- */

static void test_store_add(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    dt_dist_env e = tr_env(0, 1, 0);
    dt_store *s = dt_store_new(ctx, &e, NULL);
    tu_check(ctx, s, "store");
    int64_t v = 0;
    assert_int_equal(dt_store_add(s, "n", 5, &v), DT_OK);
    assert_int_equal(v, 5);
    assert_int_equal(dt_store_add(s, "n", -7, &v), DT_OK);
    assert_int_equal(v, -2);
    int64_t raw = 0;
    size_t len = 0;
    assert_int_equal(dt_store_get(s, "n", &raw, sizeof raw, &len, 100), DT_OK);
    assert_int_equal(len, 8);
    assert_int_equal(raw, -2);
    assert_int_equal(dt_store_set(s, "text", "abc", 3), DT_OK);
    assert_int_equal(dt_store_add(s, "text", 1, &v), DT_EINVAL);
    assert_non_null(strstr(dt_last_error(ctx), "not a counter"));
    /* refused, not dropped: the connection still works */
    assert_int_equal(dt_store_add(s, "n", 2, NULL), DT_OK);
    assert_int_equal(dt_store_add(s, "", 1, &v), DT_EINVAL);
    dt_store_free(s);
    dt_ctx_free(ctx);
}

/* --- the live monitor, one process (the 2-rank job: monitor_checks) ------- */

/* GET path from 127.0.0.1:port; the status, the body into out. */
static int http_get(int port, const char *path, char *out, size_t cap)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        if (fd >= 0)
            close(fd);
        return -1;
    }
    char req[256];
    int n = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", path);
    if (write(fd, req, (size_t)n) != n) {
        close(fd);
        return -1;
    }
    size_t got = 0;
    ssize_t k;
    while (got + 1 < cap && (k = read(fd, out + got, cap - 1 - got)) > 0)
        got += (size_t)k;
    out[got] = '\0';
    close(fd);
    int status = -1;
    sscanf(out, "HTTP/1.1 %d", &status);
    return status;
}

/* GET path (status 200) and find want in the body (1 << 16 bytes). */
static void assert_served(int port, const char *path, char *body, const char *want)
{
    assert_int_equal(http_get(port, path, body, 1 << 16), 200);
    if (!strstr(body, want))
        fail_msg("%s lacks '%s'", path, want);
}

static void test_monitor_one_process(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    dt_monitor_config mc;
    dt_monitor_config_init(&mc);
    assert_true(mc.interval_s == 1.0 && mc.listen == NULL);
    const char *bad[] = {"http://x", "127.0.0.1:99999", "nohost:80"};
    for (int i = 0; i < 3; i++) {   /* not [host:]port with an IPv4 host */
        mc.listen = bad[i];
        assert_null(dt_monitor_new(ctx, NULL, &mc));
        assert_int_equal(dt_last_status(ctx), DT_EINVAL);
    }
    mc.listen = "0.0.0.0:0";   /* off loopback, no token */
    mc.token = "";
    assert_null(dt_monitor_new(ctx, NULL, &mc));
    assert_non_null(strstr(dt_last_error(ctx), "needs a token"));
    mc.listen = "127.0.0.1:0";
    mc.token = NULL;
    mc.interval_s = 0.2;
    dt_monitor *m = dt_monitor_new(ctx, NULL, &mc);
    tu_check(ctx, m, "monitor_start");
    assert_true(dt_profile_active(ctx));   /* started for it */
    int port = dt_monitor_port(m);
    assert_true(port > 0);
    assert_int_equal(dt_monitor_port(NULL), -1);
    /* names: letters, digits, '_', at most 23; at most 8 of them */
    assert_int_equal(dt_monitor_log(m, "has space", 0, 1), DT_EINVAL);
    assert_int_equal(dt_monitor_log(m, "a_name_of_24_characters_", 0, 1), DT_EINVAL);
    assert_int_equal(dt_monitor_log(NULL, "loss", 0, 1), DT_EINVAL);
    char name[16];
    for (int i = 0; i < 8; i++) {
        snprintf(name, sizeof name, "m%d", i);
        tu_check_status(ctx, dt_monitor_log(m, name, i, 0.5 * i), "monitor_log");
    }
    tu_check_status(ctx, dt_monitor_log(m, "m3", 9, 7.25), "monitor_log again");   /* updates */
    assert_int_equal(dt_monitor_log(m, "ninth", 0, 1), DT_EINVAL);
    usleep(500 * 1000);   /* two intervals */
    char *body = malloc(1 << 16);
    assert_non_null(body);
    assert_served(port, "/api/state", body, "\"world\":1");
    assert_served(port, "/api/state", body, "\"m3\":7.25");
    assert_served(port, "/metrics", body, "dtrain_metric{rank=\"0\",name=\"m3\"} 7.25");
    assert_served(port, "/metrics", body, "# TYPE dtrain_steps_total counter");
    assert_served(port, "/", body, "<title>dtrain monitor</title>");
    assert_int_equal(http_get(port, "/nothing", body, 1 << 16), 404);
    dt_monitor_free(m);
    assert_int_equal(http_get(port, "/metrics", body, 1 << 16), -1);   /* nobody listens */
    dt_monitor_free(NULL);
    free(body);
    dt_ctx_free(ctx);
}

/* A loop that forgets dt_ctx_step_reset: the arena's warning (dt_last_warning)
 * reaches the monitor's state, its page's data, and /metrics. */
static void test_monitor_shows_warnings(void **state)
{
    (void)state;
    dt_ctx_config cfg;
    dt_ctx_config_init(&cfg);
    cfg.arena_bytes = (size_t)256 << 10;
    dt_ctx *ctx = dt_ctx_new(&cfg);
    tu_check_status(ctx, dt_ctx_status(ctx), "context");
    dt_monitor_config mc;
    dt_monitor_config_init(&mc);
    mc.listen = "127.0.0.1:0";
    mc.interval_s = 0.1;
    dt_monitor *m = dt_monitor_new(ctx, NULL, &mc);
    tu_check(ctx, m, "monitor_start");
    int port = dt_monitor_port(m);
    char *body = malloc(1 << 16);
    assert_non_null(body);
    usleep(300 * 1000);
    assert_served(port, "/api/state", body, "\"warnings\":0,\"warning\":\"\"");   /* none yet */
    dt_tensor *w = tu_param(ctx, "w", SHP(64, 64), NULL);
    for (int i = 0; i < 2 * DT_ARENA_WARN_BACKWARDS; i++) {   /* never reset */
        dt_tensor *loss = dt_sum(ctx, dt_relu(ctx, dt_matmul(ctx, w, w, 0, 0)));
        tu_check_status(ctx, loss ? dt_backward(ctx, loss) : dt_last_status(ctx), "backward");
    }
    assert_non_null(strstr(dt_last_warning(ctx), "without dt_ctx_step_reset"));
    usleep(400 * 1000);
    assert_served(port, "/api/state", body, "\"warnings\":1,\"warning\":\"the step arena grew");
    assert_served(port, "/api/state", body, "without dt_ctx_step_reset");
    assert_served(port, "/metrics", body, "# TYPE dtrain_warnings_total counter");
    assert_served(port, "/metrics", body, "dtrain_warnings_total{rank=\"0\"} 1\n");
    dt_ctx_step_reset(ctx);
    dt_monitor_free(m);
    free(body);
    dt_ctx_free(ctx);
}

/* --- the diagnosis itself, on figures made up to cover each case ----------- */

/* A server's figures: serve seconds, busy, not running, keys, bytes. */
static dt_profile_stats server_figures(double serve, double busy, double stalled, int64_t keys,
                                       double bytes)
{
    dt_profile_stats s = {0};
    s.ps_serve_s = serve;
    s.ps_busy_s = busy;
    s.ps_stalled_s = stalled;
    s.ps_keys = keys;
    s.ps_bytes_in = s.ps_bytes_out = bytes / 2;
    return s;
}

/* prof_slow_server (src/profile.c), the report's and the monitor's verdict
 * on the servers: a stopped server beats a busy one; a busy server with
 * its fair share of keys and bytes means too many workers, with more than
 * its share (keys or bytes) a hot shard; nobody busy or stopped: none.
 * Workers (no serve time) and missing ranks are not servers. */
static void test_server_diagnosis(void **state)
{
    (void)state;
    char why[320];
    dt_profile_stats worker = {.steps = 10, .step_s = 1}, a, b;
    const dt_profile_stats *st[4] = {&worker, NULL, &a, &b};
    /* calm: 30% and 20% busy, balanced */
    a = server_figures(10, 3, 0, 500, 1e9), b = server_figures(10, 2, 0, 500, 1e9);
    assert_int_equal(prof_slow_server(st, 4, why, sizeof why), -1);
    assert_string_equal(why, "");
    /* rank 3 stopped 40% of its time, rank 2 busier: the stopped one */
    a = server_figures(10, 9, 0, 500, 1e9), b = server_figures(10, 2, 4, 500, 1e9);
    assert_int_equal(prof_slow_server(st, 4, why, sizeof why), 3);
    assert_non_null(strstr(why, "rank 3 did not run for 40%"));
    /* both busy, balanced: the busier, and too many workers */
    a = server_figures(10, 7, 0, 500, 1e9), b = server_figures(10, 8, 0, 500, 1e9);
    assert_int_equal(prof_slow_server(st, 4, why, sizeof why), 3);
    assert_non_null(strstr(why, "busy 80%"));
    assert_non_null(strstr(why, "too many workers per server"));
    /* rank 2 busy with 80% of the bytes (sparse rows hot), keys even: hot */
    a = server_figures(10, 7, 0, 500, 4e9), b = server_figures(10, 2, 0, 500, 1e9);
    assert_int_equal(prof_slow_server(st, 4, why, sizeof why), 2);
    assert_non_null(strstr(why, "50% of the keys, 80% of the traffic: its shard is hot"));
    /* not saturated yet, but 35% busy against 5% with 90% of the bytes: hot */
    a = server_figures(10, 3.5, 0, 500, 9e9), b = server_figures(10, 0.5, 0, 500, 1e9);
    assert_int_equal(prof_slow_server(st, 4, why, sizeof why), 2);
    assert_non_null(strstr(why, "busy 35% of its time (the busiest by far)"));
    assert_non_null(strstr(why, "90% of the traffic: its shard is hot"));
    /* the same traffic, the other server nearly as busy: not the shard */
    b = server_figures(10, 2.5, 0, 500, 1e9);
    assert_int_equal(prof_slow_server(st, 4, why, sizeof why), -1);
    /* rank 2 busy with 90% of the keys: hot too */
    a = server_figures(10, 7, 0, 900, 1e9), b = server_figures(10, 2, 0, 100, 1e9);
    assert_int_equal(prof_slow_server(st, 4, why, sizeof why), 2);
    assert_non_null(strstr(why, "its shard is hot"));
    /* one server holds everything by design: busy means too many workers */
    const dt_profile_stats *one[2] = {&worker, &a};
    assert_int_equal(prof_slow_server(one, 2, why, sizeof why), 1);
    assert_non_null(strstr(why, "100% of the keys, 100% of the traffic: too many workers"));
    /* a short buffer is cut, not overrun (ASan would see it) */
    char tiny[16];
    assert_int_equal(prof_slow_server(one, 2, tiny, sizeof tiny), 1);
    assert_int_equal(strlen(tiny), sizeof tiny - 1);
}

/* prof_slow_server_by_latency on made-up figures: a server most workers
 * wait 1.5x the median for is named; one worker's complaint is not enough. */
static void test_server_latency_diagnosis(void **state)
{
    (void)state;
    char why[320];
    dt_profile_stats w[3] = {{.ps_calls = 10, .ps_slowest_server = 4, .ps_slowest_server_ms = 9,
                              .ps_server_median_ms = 3},
                             {.ps_calls = 10, .ps_slowest_server = 4, .ps_slowest_server_ms = 12,
                              .ps_server_median_ms = 3},
                             {.ps_calls = 10, .ps_slowest_server = 5, .ps_slowest_server_ms = 4,
                              .ps_server_median_ms = 3}};
    dt_profile_stats server = {.ps_slowest_server = -1};
    const dt_profile_stats *st[6] = {&w[0], &w[1], &w[2], NULL, &server, &server};
    assert_int_equal(prof_slow_server_by_latency(st, 6, why, sizeof why), 4);
    assert_non_null(strstr(why, "rank 4 by the workers' requests: 2 of 3 workers wait longest for "
                                "it, 10.50 ms per request against a median server's 3.00 ms"));
    w[1].ps_slowest_server_ms = 4;   /* one of three: not the job's verdict */
    assert_int_equal(prof_slow_server_by_latency(st, 6, why, sizeof why), -1);
    assert_string_equal(why, "");
}

/* prof_cpu_starved on made-up figures: a quota's throttling beats the run
 * queue; under 10% of either is nothing; a server is named as one. */
static void test_cpu_diagnosis(void **state)
{
    (void)state;
    char why[320];
    dt_profile_stats a = {.wall_s = 10, .cpu_s = 9}, b = {.wall_s = 10, .cpu_s = 9};
    const dt_profile_stats *st[3] = {&a, NULL, &b};
    assert_int_equal(prof_cpu_starved(st, 3, why, sizeof why), -1);   /* calm */
    assert_string_equal(why, "");
    b.cpu_wait_s = 0.5;                                                 /* 5%: not yet */
    assert_int_equal(prof_cpu_starved(st, 3, why, sizeof why), -1);
    b.cpu_wait_s = 6, b.cpu_s = 4;                                     /* got 40% */
    assert_int_equal(prof_cpu_starved(st, 3, why, sizeof why), 2);
    assert_non_null(strstr(why, "rank 2 got 40% of the CPU its threads were ready to use"));
    a.throttled_s = 4.8, a.cpu_periods = 100, a.cpu_throttled_periods = 48;
    a.ps_serve_s = 10;                                                  /* a throttled server */
    assert_int_equal(prof_cpu_starved(st, 3, why, sizeof why), 0);
    assert_non_null(strstr(why, "rank 0 (parameter server) was throttled 48% of the time by its "
                                "CPU quota (cgroup cpu.stat: 48 of 100 periods throttled)"));
    a.throttled_s = 0.5;                                                /* 5%: the run queue's */
    assert_int_equal(prof_cpu_starved(st, 3, why, sizeof why), 2);
    char tiny[16];
    assert_int_equal(prof_cpu_starved(st, 3, tiny, sizeof tiny), 2);
    assert_int_equal(strlen(tiny), sizeof tiny - 1);
}

/* The report's verdicts on made-up heads (prof_build_report): a loader
 * that holds the others back, a rank that evaluates or saves on its own
 * while the others wait, a straggler with fewer threads (and what
 * dt_ddp_balance would gain); each against a case it must not name. */
static prof_blob_head made_up_rank(int steps, double step_s, double data_s, double wait_s)
{
    prof_blob_head h = {0};
    h.st.steps = steps, h.st.step_s = step_s, h.st.data_s = data_s, h.st.comm_wait_s = wait_s;
    h.st.forward_s = h.st.backward_s = (step_s - data_s - wait_s) / 2;
    h.st.samples = 16 * steps, h.st.wall_s = step_s, h.st.threads = 2;
    h.st.longest_wait_rank = h.st.ps_slowest_server = -1;
    return h;
}

static char *report_of(dt_ctx *ctx, prof_blob_head *h, int P)
{
    const prof_blob_head *hp[4];
    for (int r = 0; r < P; r++)
        hp[r] = &h[r];
    char *rep = prof_build_report(ctx, hp, P, 0, NULL);
    assert_non_null(rep);
    return rep;
}

static void expect_in(dt_ctx *ctx, char *rep, const char *want, int present)
{
    if (!strstr(rep, want) != !present)
        fail_msg("the report should%s say \"%s\":\n%s", present ? "" : " not", want, rep);
    host_free(ctx, rep);
}

static void test_report_verdicts(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    /* rank 1 waits 50 ms per step for its batches, the others wait for it */
    prof_blob_head h[3] = {made_up_rank(10, 1, 0.01, 0.5), made_up_rank(10, 1, 0.5, 0.01),
                           made_up_rank(10, 1, 0.02, 0.49)};
    expect_in(ctx, report_of(ctx, h, 3), "data: rank 1's data loader holds the job back: it waits "
                                    "50.00 ms per step for its batches (50% of its step) against "
                                    "the median rank's 2.00 ms", 1);
    h[0].st.data_s = h[2].st.data_s = 0.5;   /* every loader slow: the data hint's, not a rank */
    expect_in(ctx, report_of(ctx, h, 3), "data: rank", 0);
    /* rank 0 evaluates 2 s of its 10 alone; the others wait 1.8 s */
    for (int r = 0; r < 3; r++)
        h[r] = made_up_rank(10, 10, 0.1, r ? 1.8 : 0.1);
    h[0].st.eval_s = 2;
    expect_in(ctx, report_of(ctx, h, 3), "stall: rank 0 kept the others waiting while it evaluated on "
                                    "its own: 2.00 s evaluating and 0.00 s on checkpoints, 2.00 s "
                                    "more than the median rank, while the others waited 1.80 s", 1);
    h[0].st.eval_s = 0, h[0].st.ckpt_s = 2;
    expect_in(ctx, report_of(ctx, h, 3), "while it saved or loaded checkpoints on its own", 1);
    h[0].st.ckpt_s = 2, h[1].st.ckpt_s = h[2].st.ckpt_s = 2;   /* every rank saves its shard */
    expect_in(ctx, report_of(ctx, h, 3), "stall:", 0);
    h[1].st.ckpt_s = h[2].st.ckpt_s = 0, h[1].st.comm_wait_s = h[2].st.comm_wait_s = 0.2;
    expect_in(ctx, report_of(ctx, h, 3), "stall:", 0);   /* nobody waited for it */
    /* rank 1 computes with 1 thread at 2 ms per sample, rank 0 with 4 at 1 ms */
    prof_blob_head t[2] = {made_up_rank(10, 0.32, 0, 0.16), made_up_rank(10, 0.32, 0, 0)};
    t[0].st.threads = 4, t[1].st.threads = 1;
    char *rep = report_of(ctx, t, 2);
    if (!strstr(rep, "straggler: rank 1 computes 2.000 ms per sample, 100% above the median 1.000 "
                     "ms") ||
        !strstr(rep, "it computes with 1 thread against 4 on the others") ||
        !strstr(rep, "would go from 32.00 ms to 21.33 ms (33% less)"))
        fail_msg("threads:\n%s", rep);
    host_free(ctx, rep);
    t[1].st.threads = 4;   /* as many threads: a straggler still, no word of threads */
    expect_in(ctx, report_of(ctx, t, 2), "thread against", 0);
    /* 3x per sample, but 0.2 ms of compute over a 3.2 s run: no one waits for it */
    prof_blob_head u[2] = {made_up_rank(10, 0.32, 0, 0.3199), made_up_rank(10, 0.32, 0, 0.3197)};
    expect_in(ctx, report_of(ctx, u, 2), "straggler: rank", 0);
    t[1].st.cpu_s = 0.1, t[1].st.cpu_wait_s = 0.2;   /* slow for want of CPU: fix that first */
    rep = report_of(ctx, t, 2);
    if (!strstr(rep, "hint: rank 1 is a straggler because the CPU starves it") ||
        strstr(rep, "dt_ddp_balance(ddp"))
        fail_msg("a starved straggler:\n%s", rep);
    host_free(ctx, rep);
    dt_ctx_free(ctx);
}

/* The measures themselves, in a child this test starves: two threads
 * spinning on one CPU (sched_setaffinity) wait in the run queue about half
 * the time; with a cgroup CPU quota of 20% (v1 cfs_quota_us or v2 cpu.max,
 * made here when this process may), it is throttled most of the time.
 * Each child's report names it. */
static void *spin_thread(void *arg)
{
    spin(*(const double *)arg);
    return NULL;
}

static int starved_child(int threads)
{
    dt_ctx *ctx = dt_ctx_new(NULL);
    if (!ctx || dt_profile_start(ctx, NULL) != DT_OK)
        return 1;
    double s = 1.0;
    pthread_t th[4];
    for (int i = 0; i < threads; i++)
        if (pthread_create(&th[i], NULL, spin_thread, &s) != 0)
            return 2;
    spin(s);
    for (int i = 0; i < threads; i++)
        pthread_join(th[i], NULL);
    dt_profile_stats st;
    if (dt_profile_stats_get(ctx, &st) != DT_OK || dt_profile_stop(ctx, NULL, NULL) != DT_OK)
        return 3;
    fprintf(stderr, "child: wall %.2f s, cpu %.2f s, run-queue wait %.2f s, throttled %.2f s "
            "(%lld of %lld periods)\n%s", st.wall_s, st.cpu_s, st.cpu_wait_s, st.throttled_s,
            (long long)st.cpu_throttled_periods, (long long)st.cpu_periods, dt_profile_report(ctx));
    int code = strstr(dt_profile_report(ctx), "cpu: rank 0 ") ? 0 : 4;
    dt_ctx_free(ctx);
    return code;
}

/* A child: pinned to one CPU with two spinning threads (quota_dir NULL), or
 * moved into the cgroup at quota_dir first. */
static int run_starved(const char *procs)
{
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        alarm(30);
        if (!procs) {
            cpu_set_t one;
            CPU_ZERO(&one);
            CPU_SET(sched_getcpu() >= 0 ? sched_getcpu() : 0, &one);
            if (sched_setaffinity(0, sizeof one, &one) != 0)
                _exit(10);
        } else {
            FILE *f = fopen(procs, "w");
            if (!f || fprintf(f, "%d\n", (int)getpid()) < 0 || fclose(f) != 0)
                _exit(11);
        }
        _exit(starved_child(procs ? 0 : 1));
    }
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 100;
}

/* A child's code: 0, or a failed check; 10 and 11 (it could not pin
 * itself, or enter the cgroup) skip the case, saying so. */
static void expect_starved(int code, const char *what)
{
    if (code == 10 || code == 11)
        fprintf(stderr, "skipped: the %s case (the child could not %s)\n", what,
                code == 10 ? "pin itself to one CPU" : "enter the cgroup");
    else if (code != 0)
        fail_msg("the %s case: the child exited with %d", what, code);
}

static void test_cpu_starvation_measured(void **state)
{
    (void)state;
    if (access("/proc/self/schedstat", R_OK) == 0)
        expect_starved(run_starved(NULL), "run-queue");
    else
        fprintf(stderr, "skipped: the run-queue case (no /proc/self/schedstat)\n");
    char dir[128], procs[160];
    if (make_quota_cgroup(dir, sizeof dir, procs, sizeof procs, 20000)) {
        int code = run_starved(procs);
        rmdir(dir);
        expect_starved(code, "cgroup quota");
    }
}

static const struct CMUnitTest profile_tests[] = {
    cmocka_unit_test(test_phases_single),
    cmocka_unit_test(test_data_hint),
    cmocka_unit_test(test_trace_two_ranks),
    cmocka_unit_test(test_zero_gathers_reported),
    cmocka_unit_test(test_straggler),
    cmocka_unit_test(test_global_batches),
    cmocka_unit_test(test_balance_equivalence),
    cmocka_unit_test(test_work_stealing),
    cmocka_unit_test(test_misuse),
    cmocka_unit_test(test_ps_calls),
    cmocka_unit_test(test_zipf_hot_shard),
    cmocka_unit_test(test_store_add),
    cmocka_unit_test(test_monitor_one_process),
    cmocka_unit_test(test_monitor_shows_warnings),
    cmocka_unit_test(test_slow_loader_is_waited_on),
    cmocka_unit_test(test_evaluation_stall),
    cmocka_unit_test(test_thread_counts),
    cmocka_unit_test(test_report_of_a_failed_job),
    cmocka_unit_test(test_cpu_diagnosis),
    cmocka_unit_test(test_report_verdicts),
    cmocka_unit_test(test_server_latency_diagnosis),
    cmocka_unit_test(test_ps_server_throttled),
    cmocka_unit_test(test_cpu_starvation_measured),
    cmocka_unit_test(test_server_diagnosis),
};

DT_TEST_GROUP(profile, profile_tests)
