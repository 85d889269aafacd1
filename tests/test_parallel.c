/*
 * tests/test_parallel.c - model parallelism (issue 9): pipelines (GPipe and
 * 1F1B), tensor-parallel layers, the 2x2 hybrid with DDP, and balanced
 * partitioning.
 *
 * Every rank builds the unsplit model in a context of its own and trains it
 * on the whole batch, alone, as the reference; the parallel model starts
 * from the same weights (its rank's layers, or shards of them) and must end
 * within 1e-5 of the reference after 20 steps, relative to the largest
 * entry of each parameter.
 */
#include "test_util.h"
#include "test_ranks.h"

typedef int (*rank_fn)(dt_comm *c, int rank, int world);

/* One rank's process: join over shm, run fn, leave; exits with fn's code
 * (90: could not join).  Never returns. */
static dt_ctx *rank_ctx;   /* the rank's context: its communicator's, the stages' */

static void rank_main(int rank, int world, int port, int timeout_ms, rank_fn fn)
{
    alarm(90);
    dt_ctx *ctx = dt_ctx_new(NULL);
    rank_ctx = ctx;
    dt_dist_env e = tr_env(rank, world, port);
    dt_comm_config cfg;
    dt_comm_config_init(&cfg);
    cfg.transport = "shm";
    cfg.host = "127.0.0.1";
    cfg.timeout_ms = timeout_ms;
    cfg.store.timeout_ms = 20000;
    dt_comm *c = ctx ? dt_comm_new(ctx, &e, &cfg) : NULL;
    if (!c) {
        fprintf(stderr, "rank %d: %s\n", rank, ctx ? dt_last_error(ctx) : "no ctx");
        _exit(90);
    }
    int code = fn(c, rank, world);
    if (code)
        fprintf(stderr, "rank %d: code %d: %s\n", rank, code, dt_last_error(ctx));
    struct timespec linger = {1, 0};
    nanosleep(&linger, NULL);
    dt_comm_free(c);
    dt_ctx_free(ctx);
    fflush(NULL);
    _exit(code);
}

static void run_job(int world, int timeout_ms, rank_fn fn, int *codes, double seconds)
{
    int port = tr_free_port();
    pid_t pids[8];
    fflush(NULL);
    for (int r = 0; r < world; r++) {
        pids[r] = fork();
        assert_true(pids[r] >= 0);
        if (pids[r] == 0)
            rank_main(r, world, port, timeout_ms, fn);
    }
    tr_reap(pids, world, codes, seconds);
}

static void expect_all_zero(int world, const int *codes, const char *what)
{
    for (int r = 0; r < world; r++)
        if (codes[r] != 0)
            fail_msg("%s: rank %d of %d exited with %d", what, r, world, codes[r]);
}

/* --- the model: an MLP, layer i = linear (+ relu but the last) ------------- */

#define NL 4
static const int64_t widths[NL + 1] = {12, 24, 20, 16, 5};
#define BATCH 12
#define STEPS 20
#define WMAX (24 * 24)

typedef struct mlp {
    dt_tensor *w[NL], *b[NL];
    int lo, hi;                /* the layers held: [lo, hi) */
} mlp;

static int mlp_params(const mlp *m, dt_tensor **out)
{
    int n = 0;
    for (int i = m->lo; i < m->hi; i++) {
        out[n++] = m->w[i];
        out[n++] = m->b[i];
    }
    return n;
}

/* Layers [lo, hi) as parameters of ctx named "<tag>.w<i>", from `from` (a
 * full model) or seeded values. */
static int mlp_make(dt_ctx *ctx, const char *tag, mlp *m, int lo, int hi, const mlp *from)
{
    memset(m, 0, sizeof *m);
    m->lo = lo;
    m->hi = hi;
    for (int i = lo; i < hi; i++) {
        char name[32];
        snprintf(name, sizeof name, "%s.w%d", tag, i);
        m->w[i] = dt_param_new(ctx, name, 2, (const int64_t[]){widths[i + 1], widths[i]});
        snprintf(name, sizeof name, "%s.b%d", tag, i);
        m->b[i] = dt_param_new(ctx, name, 1, (const int64_t[]){widths[i + 1]});
        if (!m->w[i] || !m->b[i])
            return 1;
        if (from) {
            float buf[WMAX];
            if (dt_tensor_get(from->w[i], buf, dt_tensor_numel(m->w[i])) != DT_OK ||
                dt_tensor_set(m->w[i], buf, dt_tensor_numel(m->w[i])) != DT_OK ||
                dt_tensor_get(from->b[i], buf, widths[i + 1]) != DT_OK ||
                dt_tensor_set(m->b[i], buf, widths[i + 1]) != DT_OK)
                return 2;
        } else if (dt_tensor_init_kaiming_uniform(ctx, m->w[i], sqrtf(5.0f)) != DT_OK ||
                   dt_tensor_init_uniform(ctx, m->b[i], -0.3f, 0.3f) != DT_OK) {
            return 3;
        }
    }
    return 0;
}

static dt_tensor *mlp_layers(dt_ctx *ctx, const mlp *m, dt_tensor *x)
{
    for (int i = m->lo; i < m->hi && x; i++) {
        x = dt_linear(ctx, x, m->w[i], m->b[i]);
        if (i < NL - 1)
            x = dt_relu(ctx, x);
    }
    return x;
}

/* A pipeline stage: its layers, and the loss on the last stage. */
static dt_tensor *mlp_stage(dt_ctx *ctx, dt_tensor *x, dt_tensor *y, void *user)
{
    const mlp *m = user;
    dt_tensor *out = mlp_layers(ctx, m, x);
    return m->hi == NL ? dt_cross_entropy(ctx, out, y) : out;
}

/* Step k's batch: inputs (BATCH, 12) and labels, the same on every rank. */
static void batch_data(int k, float *x, int32_t *y)
{
    uint64_t s = 0x9E3779B97F4A7C15ull * (uint64_t)(k + 1);
    for (int i = 0; i < BATCH * (int)widths[0]; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = (float)((s >> 40) & 0xFFFF) / 32768.0f - 1.0f;
    }
    for (int i = 0; i < BATCH; i++)
        y[i] = (int32_t)((i * 7 + k) % (int)widths[NL]);
}

static dt_optim *sgd(dt_ctx *ctx, const mlp *m)
{
    dt_optim_config oc;
    dt_optim_config_init(&oc, DT_SGD);
    oc.lr = 0.05f;
    oc.momentum = 0.9f;
    dt_tensor *ps[2 * NL];
    return dt_optim_new(ctx, &oc, ps, mlp_params(m, ps));
}

/* The reference: the whole model, seeded, in a context of its own; init
 * holds its starting weights, full is trained STEPS steps on whole batches. */
static int reference(dt_ctx *ref, mlp *init, mlp *full)
{
    dt_ctx_seed(ref, 42);
    if (mlp_make(ref, "init", init, 0, NL, NULL) || mlp_make(ref, "full", full, 0, NL, init))
        return 1;
    dt_optim *opt = sgd(ref, full);
    float xb[BATCH * 12];
    int32_t yb[BATCH];
    dt_tensor *x = dt_tensor_new(ref, DT_F32, 2, (const int64_t[]){BATCH, widths[0]});
    dt_tensor *y = dt_tensor_new(ref, DT_I32, 1, (const int64_t[]){BATCH});
    if (!opt || !x || !y)
        return 2;
    for (int k = 0; k < STEPS; k++) {
        batch_data(k, xb, yb);
        dt_tensor_set(x, xb, BATCH * widths[0]);
        dt_tensor_set(y, yb, BATCH);
        dt_tensor *loss = dt_cross_entropy(ref, mlp_layers(ref, full, x), y);
        if (!loss || dt_backward(ref, loss) != DT_OK || dt_optim_step(opt) != DT_OK)
            return 3;
        dt_ctx_zero_grad(ref);
        dt_ctx_step_reset(ref);
    }
    dt_optim_free(opt);
    dt_tensor_free(x);
    dt_tensor_free(y);
    return 0;
}

/* |a - b| <= 1e-5 * max |b| over the tensor. */
static int close_rel(const dt_tensor *a, const dt_tensor *b, const char *what)
{
    int64_t n = dt_tensor_numel(b);
    float va[WMAX], vb[WMAX];
    if (n > WMAX || dt_tensor_numel(a) != n || dt_tensor_get(a, va, n) != DT_OK ||
        dt_tensor_get(b, vb, n) != DT_OK)
        return 1;
    double worst = 0, scale = 0;
    for (int64_t i = 0; i < n; i++) {
        scale = fmax(scale, fabs(vb[i]));
        worst = fmax(worst, fabs((double)va[i] - vb[i]));
    }
    if (!(worst <= 1e-5 * scale)) {
        fprintf(stderr, "%s: differs from the reference by %.3g (largest entry %.3g)\n", what,
                worst, scale);
        return 1;
    }
    return 0;
}

/* --- pipelines --------------------------------------------------------------- */

typedef struct pipe_run {
    const int *first;          /* stage s holds layers [first[s], first[s+1]) */
    dt_pipe_config cfg;
    dt_comm *dp;               /* a DDP over these ranks (the hybrid), or NULL */
    int zero;                  /* that DDP's sharding level (dt_ddp_config.zero) */
    int replica, replicas;     /* this one trains on its share of each batch */
    int profile;               /* profile the run and check the pipeline's part */
    dt_pipe_stats st;
    float loss;                /* the last step's (last stage) */
} pipe_run;

/* The profiler saw every step, the pipeline's wait as part of comm wait,
 * and its ideal bubble; rank 0's report has a line per stage. */
static int check_profile(dt_comm *c, const pipe_run *r)
{
    dt_ctx *ctx = rank_ctx;
    dt_profile_stats ps;
    int m = r->cfg.micro_batches;
    if (dt_profile_stats_get(ctx, &ps) != DT_OK || ps.steps != STEPS || !(ps.pipe_wait_s > 0) ||
        ps.pipe_wait_s > ps.comm_wait_s + 1e-9 || !(ps.forward_s > 0) || !(ps.backward_s > 0) ||
        fabs(ps.pipe_bubble_ideal - 1.0 / (m + 1)) > 1e-12) {
        fprintf(stderr, "profile: %lld steps, pipe wait %.4f of comm wait %.4f s, ideal %.4f\n",
                (long long)ps.steps, ps.pipe_wait_s, ps.comm_wait_s, ps.pipe_bubble_ideal);
        return 1;
    }
    if (dt_profile_stop(ctx, c, NULL) != DT_OK)
        return 2;
    if (dt_comm_rank(c) == 0 && (!strstr(dt_profile_report(ctx), "pipeline, rank 0: waits") ||
                                 !strstr(dt_profile_report(ctx), "pipeline, rank 1: waits"))) {
        fprintf(stderr, "%s", dt_profile_report(ctx));
        return 3;
    }
    return 0;
}

/* Stage rank(c) trains STEPS steps in rank_ctx under parameters named tag,
 * then checks them against the reference.  1x: a failure, with a message. */
static int pipe_train(dt_comm *c, pipe_run *r, const char *tag, mlp *part)
{
    dt_ctx *ctx = rank_ctx, *ref = dt_ctx_new(NULL);
    int s = dt_comm_rank(c), S = dt_comm_size(c), code = 0;
    mlp init, full;
    if (!ref || reference(ref, &init, &full))
        return 10;
    if (mlp_make(ctx, tag, part, r->first[s], r->first[s + 1], &init))
        return 11;
    dt_optim *opt = sgd(ctx, part);
    dt_pipe *p = opt ? dt_pipe_new(ctx, c, &r->cfg, mlp_stage, part) : NULL;
    dt_ddp_config dc;
    dt_ddp_config_init(&dc);
    dc.zero = r->zero;
    dc.bucket_bytes = 1024;   /* zero 3: several units a stage */
    dt_ddp *ddp = p && r->dp ? dt_ddp_new(ctx, r->dp, opt, r->zero ? &dc : NULL) : NULL;
    if (!p || (r->dp && !ddp))
        return 12;
    int rows = BATCH / r->replicas, r0 = r->replica * rows;
    if (r->profile && dt_profile_start(ctx, NULL) != DT_OK)
        return 17;
    float xb[BATCH * 12];
    int32_t yb[BATCH];
    dt_tensor *x = dt_tensor_new(ctx, DT_F32, 2, (const int64_t[]){rows, widths[0]});
    dt_tensor *y = dt_tensor_new(ctx, DT_I32, 1, (const int64_t[]){rows});
    for (int k = 0; k < STEPS && code == 0; k++) {
        batch_data(k, xb, yb);
        dt_tensor_set(x, xb + r0 * widths[0], rows * widths[0]);
        dt_tensor_set(y, yb + r0, rows);
        if (dt_pipe_step(p, s == 0 ? x : NULL, s == S - 1 ? y : NULL, &r->loss) != DT_OK)
            code = 13;
        else if ((ddp ? dt_ddp_step(ddp) : dt_optim_step(opt)) != DT_OK)
            code = 14;
        dt_ctx_zero_grad(ctx);
        dt_ctx_step_reset(ctx);
    }
    if (code == 0 && (s == S - 1) != !isnan(r->loss))
        code = 15;   /* the loss is the last stage's */
    if (code == 0 && ddp && dt_ddp_full_params(ddp) != DT_OK)
        code = 19;   /* zero 3: whole to be read */
    for (int i = part->lo; i < part->hi && code == 0; i++) {
        char what[48];
        snprintf(what, sizeof what, "%s stage %d w%d", tag, s, i);
        if (close_rel(part->w[i], full.w[i], what) || close_rel(part->b[i], full.b[i], what))
            code = 16;
    }
    dt_pipe_stats_get(p, &r->st);
    if (code == 0 && r->profile && check_profile(c, r))
        code = 18;
    dt_ddp_free(ddp);
    dt_pipe_free(p);
    dt_optim_free(opt);
    dt_tensor_free(x);
    dt_tensor_free(y);
    dt_ctx_free(ref);
    return code;
}

/* The same parameters, bit for bit. */
static int same_bits(const mlp *a, const mlp *b)
{
    for (int i = a->lo; i < a->hi; i++) {
        float va[WMAX], vb[WMAX];
        int64_t n = dt_tensor_numel(a->w[i]);
        if (dt_tensor_get(a->w[i], va, n) != DT_OK || dt_tensor_get(b->w[i], vb, n) != DT_OK ||
            memcmp(va, vb, sizeof(float) * (size_t)n))
            return 1;
    }
    return 0;
}

/* 2 stages (layers 0-1 | 2-3): GPipe and 1F1B with 1, 4 and 5 micro-batches
 * (5: uneven, 12 rows = 3+3+2+2+2) match the reference; the two schedules
 * give the same bits; 1F1B holds at most 2 micro-batches on stage 0 and 1
 * on stage 1, GPipe all of them. */
static int job_pipe2(dt_comm *c, int rank, int world)
{
    (void)world;
    static const int first[] = {0, 2, NL};
    static const int ms[] = {1, 4, 5};
    for (int k = 0; k < 3; k++) {
        mlp parts[2];
        pipe_run runs[2];
        for (int sch = 0; sch < 2; sch++) {
            char tag[32];
            snprintf(tag, sizeof tag, "p%d%d", k, sch);
            pipe_run *r = &runs[sch];
            memset(r, 0, sizeof *r);
            r->first = first;
            dt_pipe_config_init(&r->cfg);
            r->cfg.micro_batches = ms[k];
            r->cfg.schedule = sch ? DT_PIPE_1F1B : DT_PIPE_GPIPE;
            r->replicas = 1;
            r->profile = k == 1 && sch == 1;
            int code = pipe_train(c, r, tag, &parts[sch]);
            if (code)
                return code;
            int hold = sch ? (ms[k] < 2 - rank ? ms[k] : 2 - rank) : ms[k];
            if (r->st.in_flight_peak != hold || r->st.steps != STEPS ||
                r->st.micro_batches != (int64_t)STEPS * ms[k]) {
                fprintf(stderr, "m=%d %s: held %d micro-batches (expected %d), %lld steps\n", ms[k],
                        sch ? "1F1B" : "GPipe", r->st.in_flight_peak, hold, (long long)r->st.steps);
                return 20;
            }
            if (fabs(r->st.bubble_ideal - 1.0 / (ms[k] + 1)) > 1e-12 || !(r->st.wait_s > 0) ||
                !(r->st.compute_s > 0) || !(r->st.bubble > 0 && r->st.bubble < 1) ||
                r->st.bytes_sent == 0)
                return 21;
        }
        if (same_bits(&parts[0], &parts[1]))
            return 22;   /* GPipe and 1F1B add the same gradients in the same order */
        if (ms[k] == 5 && rank == 0 && !(runs[1].st.act_bytes_peak < runs[0].st.act_bytes_peak))
            return 23;   /* 1F1B holds 2 micro-batches of 5 */
    }
    return 0;
}

static void test_pipeline_two_stages(void **state)
{
    (void)state;
    int codes[2];
    run_job(2, 20000, job_pipe2, codes, 120);
    expect_all_zero(2, codes, "2-stage pipeline");
}

/* 4 stages, one layer each, 1F1B and GPipe with 6 micro-batches: the
 * reference again, and 1F1B's stage s holds at most 4 - s. */
static int job_pipe4(dt_comm *c, int rank, int world)
{
    (void)world;
    static const int first[] = {0, 1, 2, 3, 4};
    for (int sch = 0; sch < 2; sch++) {
        mlp part;
        pipe_run r;
        memset(&r, 0, sizeof r);
        r.first = first;
        dt_pipe_config_init(&r.cfg);
        r.cfg.micro_batches = 6;
        r.cfg.schedule = sch ? DT_PIPE_1F1B : DT_PIPE_GPIPE;
        r.replicas = 1;
        int code = pipe_train(c, &r, sch ? "f" : "g", &part);
        if (code)
            return code;
        if (r.st.in_flight_peak != (sch ? 4 - rank : 6))
            return 30;
    }
    return 0;
}

static void test_pipeline_four_stages(void **state)
{
    (void)state;
    int codes[4];
    run_job(4, 20000, job_pipe4, codes, 120);
    expect_all_zero(4, codes, "4-stage pipeline");
}

/* 2 stages x 2 data-parallel replicas on 4 ranks: pipelines {0,1} and
 * {2,3}, DDP groups {0,2} and {1,3}; each replica trains on half of each
 * batch, and the whole matches one rank on the whole batch.  With
 * hybrid_zero the replicas of each stage shard its state (process groups
 * under ZeRO). */
static int hybrid_zero;
static int job_hybrid(dt_comm *c, int rank, int world)
{
    (void)world;
    static const int first[] = {0, 2, NL};
    dt_comm *pipe = dt_comm_split(c, rank / 2, rank % 2, NULL);
    dt_comm *dp = dt_comm_split(c, rank % 2, rank / 2, NULL);
    if (!pipe || !dp || dt_comm_rank(pipe) != rank % 2 || dt_comm_rank(dp) != rank / 2)
        return 40;
    mlp part;
    pipe_run r;
    memset(&r, 0, sizeof r);
    r.first = first;
    dt_pipe_config_init(&r.cfg);
    r.cfg.micro_batches = 3;
    r.dp = dp;
    r.zero = hybrid_zero;
    r.replica = rank / 2;
    r.replicas = 2;
    int code = pipe_train(pipe, &r, "h", &part);
    dt_comm_free(dp);
    dt_comm_free(pipe);
    return code;
}

static void test_hybrid_pipeline_ddp(void **state)
{
    (void)state;
    int codes[4];
    run_job(4, 20000, job_hybrid, codes, 120);
    expect_all_zero(4, codes, "2x2 hybrid");
}

static void test_hybrid_pipeline_zero(void **state)
{
    (void)state;
    int codes[4];
    for (hybrid_zero = 1; hybrid_zero <= 3; hybrid_zero++) {
        run_job(4, 20000, job_hybrid, codes, 120);
        expect_all_zero(4, codes, hybrid_zero == 1 ? "2x2 hybrid, zero 1"
                                  : hybrid_zero == 2 ? "2x2 hybrid, zero 2" : "2x2 hybrid, zero 3");
    }
    hybrid_zero = 0;
}

/* --- pipeline errors ------------------------------------------------------- */

static int fail_at_step = -1;
static int steps_seen;

static dt_tensor *failing_stage(dt_ctx *ctx, dt_tensor *x, dt_tensor *y, void *user)
{
    if (steps_seen++ == fail_at_step)
        return NULL;   /* without an error of its own: the pipeline names the NULL */
    return mlp_stage(ctx, x, y, user);
}

/* This rank's half of the seeded model (layers 0-1 or 2-3) in rank_ctx. */
static int half_model(int rank, mlp *part)
{
    static const int first[] = {0, 2, NL};
    mlp init;
    dt_ctx *ref = dt_ctx_new(NULL);
    if (!ref)
        return 1;
    dt_ctx_seed(ref, 42);
    int bad = mlp_make(ref, "i", &init, 0, NL, NULL) ||
              mlp_make(rank_ctx, "e", part, first[rank], first[rank + 1], &init);
    dt_ctx_free(ref);
    return bad;
}

/* Bad arguments fail on this rank alone, before anything is sent; a stage
 * whose function fails makes its neighbour fail quickly with its words. */
static int job_pipe_errors(dt_comm *c, int rank, int world)
{
    (void)world;
    dt_ctx *ctx = rank_ctx;
    mlp part;
    dt_pipe_config pc;
    dt_pipe_config_init(&pc);
    if (pc.micro_batches != 4 || pc.schedule != DT_PIPE_1F1B)
        return 50;
    pc.micro_batches = 0;
    if (dt_pipe_new(ctx, c, &pc, mlp_stage, NULL) || dt_last_status(ctx) != DT_EINVAL)
        return 51;
    if (dt_pipe_new(ctx, NULL, NULL, mlp_stage, NULL) || dt_pipe_new(ctx, c, NULL, NULL, NULL) ||
        dt_pipe_step(NULL, NULL, NULL, NULL) != DT_EINVAL || dt_pipe_stage(NULL) != -1 ||
        dt_pipe_stages(NULL) != 0)
        return 52;
    if (half_model(rank, &part))
        return 53;
    dt_pipe *p = dt_pipe_new(ctx, c, NULL, failing_stage, &part);
    if (!p || dt_pipe_stage(p) != rank || dt_pipe_stages(p) != 2)
        return 54;
    dt_tensor *x = dt_tensor_new(ctx, DT_F32, 2, (const int64_t[]){BATCH, widths[0]});
    dt_tensor *y = dt_tensor_new(ctx, DT_I32, 1, (const int64_t[]){BATCH});
    dt_tensor *x3 = NULL;
    float xb[BATCH * 12];
    int32_t yb[BATCH];
    batch_data(0, xb, yb);
    dt_tensor_set(x, xb, BATCH * widths[0]);
    dt_tensor_set(y, yb, BATCH);
    int code = 0;
    float loss = 0;
    (void)x3;
    dt_pipe_free(p);
    /* a failing stage function: step 2 of stage 1 */
    p = dt_pipe_new(ctx, c, NULL, failing_stage, &part);
    fail_at_step = rank == 1 ? 2 * 4 + 1 : -1;   /* its 3rd step's 2nd micro-batch */
    steps_seen = 0;
    for (int k = 0; k < 4 && code == 0; k++) {
        double t0 = dt_now();
        dt_status st = dt_pipe_step(p, rank == 0 ? x : NULL, rank == 1 ? y : NULL, &loss);
        double took = dt_now() - t0;
        dt_ctx_step_reset(ctx);
        dt_ctx_zero_grad(ctx);
        if (k < 2 && st != DT_OK)
            code = 56;
        if (k == 2) {
            const char *m = dt_last_error(ctx);
            if (st == DT_OK)
                code = 57;
            else if (rank == 0 && !strstr(m, "pipeline stage 1 failed"))
                code = 58;
            else if (rank == 1 && !strstr(m, "returned NULL for micro-batch 1"))
                code = 59;
            else if (took > 5.0)   /* "quickly": the 20 s timeout must not be what ended it */
                code = 55;
        }
        if (k == 3 && (st != DT_ESTATE || !strstr(dt_last_error(ctx), "earlier step failed")))
            code = 60;
    }
    dt_pipe_free(p);
    return code;
}

/* Only stage 0 is given bad arguments; stage 1 learns of it from the
 * store and fails in well under the 20 s timeout. */
static int job_pipe_bad_args(dt_comm *c, int rank, int world)
{
    (void)world;
    dt_ctx *ctx = rank_ctx;
    mlp part;
    if (half_model(rank, &part))
        return 61;
    dt_pipe_config pc;
    dt_pipe_config_init(&pc);
    pc.micro_batches = 4;
    dt_pipe *p = dt_pipe_new(ctx, c, &pc, mlp_stage, &part);
    dt_tensor *x3 = dt_tensor_new(ctx, DT_F32, 2, (const int64_t[]){3, widths[0]});
    dt_tensor *y = dt_tensor_new(ctx, DT_I32, 1, (const int64_t[]){BATCH});
    dt_tensor_fill(x3, 0.5f);
    dt_tensor_fill(y, 1);
    double t0 = dt_now();
    dt_status st = dt_pipe_step(p, rank == 0 ? x3 : NULL, rank == 1 ? y : NULL, NULL);
    double took = dt_now() - t0;
    const char *m = dt_last_error(ctx);
    int code = 0;
    if (rank == 0 && (st != DT_EINVAL || !strstr(m, "3 rows cannot split into 4")))
        code = 62;
    if (rank == 1 && (st == DT_OK || !strstr(m, "pipeline stage 0 failed") || took > 10))
        code = 63;
    dt_pipe_free(p);
    return code;
}

/* Stage 1 is killed in its third step: stage 0 fails naming rank 1, in
 * far less than the 20 s timeout. */
static dt_tensor *dying_stage(dt_ctx *ctx, dt_tensor *x, dt_tensor *y, void *user)
{
    if (steps_seen++ == 2 * 4 + 2)
        kill(getpid(), SIGKILL);
    return mlp_stage(ctx, x, y, user);
}

static int job_pipe_death(dt_comm *c, int rank, int world)
{
    (void)world;
    dt_ctx *ctx = rank_ctx;
    mlp part;
    if (half_model(rank, &part))
        return 64;
    steps_seen = 0;
    dt_pipe *p = dt_pipe_new(ctx, c, NULL, rank == 1 ? dying_stage : mlp_stage, &part);
    dt_tensor *x = dt_tensor_new(ctx, DT_F32, 2, (const int64_t[]){BATCH, widths[0]});
    dt_tensor *y = dt_tensor_new(ctx, DT_I32, 1, (const int64_t[]){BATCH});
    dt_tensor_fill(x, 0.5f);
    dt_tensor_fill(y, 1);
    int code = 0;
    for (int k = 0; k < 4 && code == 0; k++) {
        double t0 = dt_now();
        dt_status st = dt_pipe_step(p, rank == 0 ? x : NULL, rank == 1 ? y : NULL, NULL);
        dt_ctx_step_reset(ctx);
        dt_ctx_zero_grad(ctx);
        if (k < 2 && st != DT_OK)
            code = 65;
        if (k == 2) {
            fprintf(stderr, "stage 0 noticed in %.2f s: %s\n", dt_now() - t0, dt_last_error(ctx));
            if (st == DT_OK || !strstr(dt_last_error(ctx), "rank 1") || dt_now() - t0 > 10)
                code = 66;
            break;
        }
    }
    dt_pipe_free(p);
    return code;
}

static void test_pipeline_errors(void **state)
{
    (void)state;
    int codes[2];
    run_job(2, 20000, job_pipe_errors, codes, 120);
    expect_all_zero(2, codes, "pipeline errors");
    run_job(2, 20000, job_pipe_bad_args, codes, 120);
    expect_all_zero(2, codes, "pipeline: stage 0's bad arguments");
    run_job(2, 20000, job_pipe_death, codes, 120);
    if (codes[0] != 0)
        fail_msg("pipeline: stage 0 exited with %d after stage 1 died", codes[0]);
    assert_int_equal(codes[1], 200 + SIGKILL);
}

/* --- tensor parallelism ----------------------------------------------------- */

/* A replicated layer 12 -> 12 -> tanh, then the MLP 12 -> 24 -> relu -> 20
 * -> (cross entropy over 20 classes),
 * split 2 ways: layer 0 by columns (rows of w0), layer 1 by rows (columns
 * of w1).  variant 0: column (split output) then row (split input), the
 * Megatron MLP; variant 1: column with gather_output then row splitting
 * its whole input, through dt_tp_gather and dt_tp_split.  Variants 2 and
 * 3 are 0 and 1 over (BATCH/2, 2, 12) inputs: the layers over the last dim,
 * as a transformer's (B, T, C), the logits back to (BATCH, 20). */
static dt_tensor *as_3d(dt_ctx *ctx, dt_tensor *x, int variant)
{
    if (variant < 2)
        return x;
    return dt_reshape(ctx, x, 3, (const int64_t[]){BATCH / 2, 2, dt_tensor_dim(x, 1)});
}

static dt_tensor *as_2d(dt_ctx *ctx, dt_tensor *x, int variant)
{
    return variant < 2 ? x : dt_reshape(ctx, x, 2, (const int64_t[]){BATCH, -1});
}

static dt_tensor *tp_forward(dt_ctx *ctx, dt_comm *c, dt_tensor *const *w, dt_tensor *x,
                             int variant)
{
    x = dt_tanh(ctx, dt_linear(ctx, as_3d(ctx, x, variant), w[4], NULL));   /* replicated */
    dt_tensor *h = dt_tp_linear_col(ctx, c, x, w[0], w[1], variant % 2 == 1);
    return as_2d(ctx, dt_tp_linear_row(ctx, c, dt_relu(ctx, h), w[2], w[3], variant % 2 == 0),
                 variant);
}

static dt_tensor *full_forward(dt_ctx *ctx, dt_tensor *const *w, dt_tensor *x, int variant)
{
    x = dt_tanh(ctx, dt_linear(ctx, as_3d(ctx, x, variant), w[4], NULL));
    return as_2d(ctx, dt_linear(ctx, dt_relu(ctx, dt_linear(ctx, x, w[0], w[1])), w[2], w[3]),
                 variant);
}

static int job_tp(dt_comm *c, int rank, int world)
{
    dt_ctx *ctx = rank_ctx, *ref = dt_ctx_new(NULL);
    static const int64_t shp[5][2] = {{24, 12}, {24, 0}, {20, 24}, {20, 0}, {12, 12}};
    static const int dims[5] = {0, 0, 1, -1, -1};   /* the dim each is split along; -1 whole */
    dt_ctx_seed(ref, 7);
    for (int variant = 0; variant < 4; variant++) {
        dt_tensor *full[5], *init[5], *part[5];
        for (int i = 0; i < 5; i++) {
            char name[48];
            int nd = shp[i][1] ? 2 : 1;
            snprintf(name, sizeof name, "v%d.full%d", variant, i);
            full[i] = dt_param_new(ref, name, nd, shp[i]);
            snprintf(name, sizeof name, "v%d.init%d", variant, i);
            init[i] = dt_param_new(ref, name, nd, shp[i]);
            int64_t ps[2] = {shp[i][0], shp[i][1]};
            if (dims[i] >= 0)
                ps[dims[i]] /= world;
            snprintf(name, sizeof name, "v%d.part%d", variant, i);
            part[i] = dt_param_new(ctx, name, nd, ps);
            if (!full[i] || !init[i] || !part[i] || dt_tensor_init_uniform(ref, init[i], -0.4f, 0.4f) ||
                dt_tp_shard(c, init[i], dims[i] >= 0 ? dims[i] : 0, part[i]) != (dims[i] >= 0 ? DT_OK : DT_EINVAL))
                return 70;
            float buf[WMAX];
            dt_tensor_get(init[i], buf, dt_tensor_numel(init[i]));
            dt_tensor_set(full[i], buf, dt_tensor_numel(full[i]));
            if (dims[i] < 0)
                dt_tensor_set(part[i], buf, dt_tensor_numel(part[i]));
        }
        dt_optim_config oc;
        dt_optim_config_init(&oc, DT_SGD);
        oc.lr = 0.1f;
        oc.momentum = 0.9f;
        dt_optim *o_ref = dt_optim_new(ref, &oc, full, 5), *o_tp = dt_optim_new(ctx, &oc, part, 5);
        dt_tensor *x = dt_tensor_new(ctx, DT_F32, 2, (const int64_t[]){BATCH, 12});
        dt_tensor *y = dt_tensor_new(ctx, DT_I32, 1, (const int64_t[]){BATCH});
        dt_tensor *xr = dt_tensor_new(ref, DT_F32, 2, (const int64_t[]){BATCH, 12});
        dt_tensor *yr = dt_tensor_new(ref, DT_I32, 1, (const int64_t[]){BATCH});
        if (!o_ref || !o_tp || !x || !y || !xr || !yr)
            return 71;
        for (int k = 0; k < STEPS; k++) {
            float xb[BATCH * 12];
            int32_t yb[BATCH];
            batch_data(k, xb, yb);
            for (int i = 0; i < BATCH; i++)
                yb[i] = (yb[i] * 3 + i) % 20;
            dt_tensor_set(x, xb, BATCH * 12);
            dt_tensor_set(y, yb, BATCH);
            dt_tensor_set(xr, xb, BATCH * 12);
            dt_tensor_set(yr, yb, BATCH);
            dt_tensor *l1 = dt_cross_entropy(ctx, tp_forward(ctx, c, part, x, variant), y);
            dt_tensor *l0 = dt_cross_entropy(ref, full_forward(ref, full, xr, variant), yr);
            if (!l1 || !l0 || dt_backward(ctx, l1) || dt_backward(ref, l0) ||
                dt_optim_step(o_tp) || dt_optim_step(o_ref))
                return 72;
            if (k == 0 && fabsf(dt_tensor_item(l1) - dt_tensor_item(l0)) > 1e-5f * fabsf(dt_tensor_item(l0)))
                return 73;
            dt_ctx_zero_grad(ctx);
            dt_ctx_zero_grad(ref);
            dt_ctx_step_reset(ctx);
            dt_ctx_step_reset(ref);
        }
        for (int i = 0; i < 5; i++) {
            char name[48];
            snprintf(name, sizeof name, "v%d.shard%d", variant, i);
            dt_tensor *want = dt_tensor_new(ctx, DT_F32, dt_tensor_ndim(part[i]),
                                            (const int64_t[]){dt_tensor_dim(part[i], 0),
                                                              dt_tensor_ndim(part[i]) > 1 ? dt_tensor_dim(part[i], 1) : 1});
            if (!want)
                return 74;
            if (dims[i] >= 0)
                dt_tp_shard(c, full[i], dims[i], want);
            else
                dt_tensor_get(full[i], (float[WMAX]){0}, 0);
            if (dims[i] < 0) {
                float buf[WMAX];
                dt_tensor_get(full[i], buf, dt_tensor_numel(full[i]));
                dt_tensor_set(want, buf, dt_tensor_numel(want));
            }
            snprintf(name, sizeof name, "variant %d param %d", variant, i);
            int bad = close_rel(part[i], want, name);
            dt_tensor_free(want);
            if (bad)
                return 75;
        }
        dt_optim_free(o_ref);
        dt_optim_free(o_tp);
        dt_tensor_free(x);
        dt_tensor_free(y);
        dt_tensor_free(xr);
        dt_tensor_free(yr);
    }
    /* errors: another context's communicator, a split that does not divide */
    dt_tensor *odd = dt_tensor_new(ctx, DT_F32, 2, (const int64_t[]){2, 3});
    dt_tensor_fill(odd, 1);
    if (dt_tp_split(ctx, c, odd) || dt_last_status(ctx) != DT_EINVAL ||
        dt_tp_copy(ref, c, odd) || dt_tp_reduce(ctx, NULL, odd))
        return 76;
    dt_tensor_free(odd);
    (void)rank;
    dt_ctx_free(ref);
    return 0;
}

static void test_tensor_parallel_mlp(void **state)
{
    (void)state;
    int codes[2];
    run_job(2, 20000, job_tp, codes, 120);
    expect_all_zero(2, codes, "2-way tensor-parallel MLP");
}

/* --- balanced partitioning --------------------------------------------------- */

/* The largest run of the best split, by trying every split. */
static double brute_best(const double *cost, int n, int stages, int start)
{
    if (stages == 1) {
        double s = 0;
        for (int i = start; i < n; i++)
            s += cost[i];
        return s;
    }
    double best = INFINITY, run = 0;
    for (int j = start + 1; j <= n - (stages - 1); j++) {
        run += cost[j - 1];
        double rest = brute_best(cost, n, stages - 1, j);
        best = fmin(best, fmax(run, rest));
    }
    return best;
}

static void test_partition(void **state)
{
    (void)state;
    int first[13];
    /* by time, not count: one heavy layer gets a stage of its own */
    const double c1[] = {1, 1, 1, 1, 1, 1, 8, 1};
    assert_int_equal(dt_pipe_partition(c1, 8, 2, first), DT_OK);
    assert_int_equal(first[0], 0);
    assert_int_equal(first[1], 6);   /* 6 | 9, where 4 layers each would be 4 | 11 */
    assert_int_equal(first[2], 8);
    assert_int_equal(dt_pipe_partition(c1, 8, 3, first), DT_OK);
    assert_int_equal(first[1], 6);   /* 6 | 8 | 1 */
    assert_int_equal(first[2], 7);
    /* random costs: the split's largest run is the best possible; every
     * stage has a layer; the same costs give the same split */
    uint64_t s = 12345;
    for (int trial = 0; trial < 300; trial++) {
        double cost[12];
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        int n = 1 + (int)((s >> 33) % 12), stages = 1 + (int)((s >> 45) % (uint64_t)n);
        for (int i = 0; i < n; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            cost[i] = (double)((s >> 40) % 1000) / 100.0 + (trial % 3 == 0 ? 0 : 1e-3 * i);
        }
        int f2[13];
        assert_int_equal(dt_pipe_partition(cost, n, stages, first), DT_OK);
        assert_int_equal(dt_pipe_partition(cost, n, stages, f2), DT_OK);
        assert_memory_equal(first, f2, sizeof(int) * (size_t)(stages + 1));
        assert_int_equal(first[0], 0);
        assert_int_equal(first[stages], n);
        double worst = 0;
        for (int k = 0; k < stages; k++) {
            assert_true(first[k + 1] > first[k]);
            double run = 0;
            for (int i = first[k]; i < first[k + 1]; i++)
                run += cost[i];
            worst = fmax(worst, run);
        }
        double best = brute_best(cost, n, stages, 0);
        if (worst > best * (1 + 1e-12))
            fail_msg("trial %d: largest stage %.6f, best possible %.6f", trial, worst, best);
    }
    /* bad input */
    const double neg[] = {1, -1};
    assert_int_equal(dt_pipe_partition(neg, 2, 1, first), DT_EINVAL);
    assert_int_equal(dt_pipe_partition(c1, 2, 3, first), DT_EINVAL);
    assert_int_equal(dt_pipe_partition(NULL, 2, 1, first), DT_EINVAL);
    assert_int_equal(dt_pipe_partition(c1, 8, 0, first), DT_EINVAL);
}

/* dt_profile_layer_times on a model whose layers 1 and 2 each do 16 times layer
 * 0's matrix work: measured as more than 3 times as long.  On a GPU
 * (DTRAIN_BACKEND=cuda) the CPU's sizes are a few microseconds of work
 * under ~10 us launches each, so there every dimension is 8 times larger
 * (layer 0 ~25 GFLOP forward and backward, ~0.5 ms on an H100). */
typedef struct lin { dt_tensor *w; } lin;

static dt_tensor *lin_layer(dt_ctx *ctx, dt_tensor *x, void *user)
{
    return dt_relu(ctx, dt_linear(ctx, x, ((lin *)user)->w, NULL));
}

static void test_layer_times(void **state)
{
    (void)state;
    dt_ctx *ctx = dt_ctx_new(NULL);
    assert_non_null(ctx);
    int64_t u = strcmp(dt_backend_name(ctx), "cuda") == 0 ? 8 : 1;   /* size unit */
    lin l[3];
    const int64_t shapes[3][2] = {{128 * u, 128 * u}, {2048 * u, 128 * u}, {128 * u, 2048 * u}};
    for (int i = 0; i < 3; i++) {
        char name[48];
        snprintf(name, sizeof name, "l%d", i);
        l[i].w = dt_param_new(ctx, name, 2, shapes[i]);
        assert_int_equal(dt_tensor_init_uniform(ctx, l[i].w, -0.1f, 0.1f), DT_OK);
    }
    /* layer 1 maps 128 -> 2048, layer 2 2048 -> 128: 16x layer 0's work each */
    dt_layer_fn fns[3] = {lin_layer, lin_layer, lin_layer};
    void *users[3] = {&l[0], &l[1], &l[2]};
    dt_tensor *x = dt_tensor_new(ctx, DT_F32, 2, (const int64_t[]){512 * u, 128 * u});
    dt_tensor_fill(x, 0.5f);
    double ms[3];
    assert_int_equal(dt_profile_layer_times(ctx, NULL, fns, users, 3, x, 5, ms), DT_OK);
    for (int i = 0; i < 3; i++)
        assert_true(ms[i] > 0);
    /* gradients are left zero (the optimizer sees none of this) */
    int64_t ng = shapes[1][0] * shapes[1][1];
    float *g = malloc(sizeof *g * (size_t)ng);
    assert_non_null(g);
    g[7] = 1;
    assert_int_equal(dt_tensor_get(dt_tensor_grad(l[1].w), g, ng), DT_OK);
    int64_t nonzero = 0;
    for (int64_t i = 0; i < ng; i++)
        nonzero += g[i] != 0;
    free(g);
    assert_int_equal(nonzero, 0);
    fprintf(stderr, "layer times (ms): %.3f %.3f %.3f\n", ms[0], ms[1], ms[2]);
    if (!(ms[1] > 3 * ms[0] && ms[2] > 3 * ms[0]))
        fail_msg("layers with 16x the work measured %.3f and %.3f ms against %.3f", ms[1], ms[2], ms[0]);
    /* errors */
    assert_int_equal(dt_profile_layer_times(ctx, NULL, fns, users, 0, x, 5, ms), DT_EINVAL);
    assert_int_equal(dt_profile_layer_times(ctx, NULL, NULL, users, 3, x, 5, ms), DT_EINVAL);
    assert_int_equal(dt_profile_layer_times(ctx, NULL, fns, users, 3, x, 0, ms), DT_EINVAL);
    dt_tensor_free(x);
    dt_ctx_free(ctx);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_partition),
    cmocka_unit_test(test_pipeline_two_stages),
    cmocka_unit_test(test_pipeline_four_stages),
    cmocka_unit_test(test_hybrid_pipeline_ddp),
    cmocka_unit_test(test_hybrid_pipeline_zero),
    cmocka_unit_test(test_tensor_parallel_mlp),
    cmocka_unit_test(test_pipeline_errors),
    /* last: with DTRAIN_BACKEND=cuda it starts CUDA in this process, and the
     * tests above fork ranks, which cannot use CUDA after that */
    cmocka_unit_test(test_layer_times),
};

DT_TEST_GROUP(parallel, tests)
