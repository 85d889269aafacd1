#include "internal.h"

/* ===========================================================================
 * The profiler's recording: phases, steps, collectives, batches
 *
 * What the layers call while they work, so it sits with the bottom layer:
 * the compute thread's public calls mark phases (prof_begin/prof_end around
 * dt_loader_next, dt_backward, the DDP's wait, blocking collectives,
 * dt_optim_step); the gaps between them are forward (before a backward) or
 * idle, so a step's phases add up to its wall time by construction.  Only
 * the outermost call counts: a collective inside dt_ddp_step is the step's
 * comm wait, not a second one.  The comm thread and the loader's thread
 * add events under the state's mutex.  The exchange between ranks, the
 * trace and the report are src/profile.c's.
 * ======================================================================== */

static const char *const phase_names[PH_COUNT] = {"data wait", "forward", "backward",
                                                  "comm wait", "optimizer", "idle"};

static int prof_measuring(const dt_ctx *ctx)
{
    return ctx && __atomic_load_n(&ctx->prof.measure, __ATOMIC_RELAXED);
}

DT_PRIVATE int prof_recording(const dt_ctx *ctx)
{
    return ctx && __atomic_load_n(&ctx->prof.record, __ATOMIC_RELAXED);
}

/* the recorder's straggler check period, 0 when it is not recording */
DT_PRIVATE int prof_check_every(const dt_ctx *ctx)
{
    return prof_recording(ctx) ? ctx->prof.cfg.check_every : 0;
}

/* DDP's load balancing needs step times even when the profiler is off:
 * on, they are measured; off, measuring goes back to what recording wants */
DT_PRIVATE void prof_balancing(dt_ctx *ctx, int on)
{
    ctx->prof.balancing = on;
    __atomic_store_n(&ctx->prof.measure, on ? 1 : ctx->prof.record, __ATOMIC_RELAXED);
}

/* Steps that are not training steps (dt_profile_layer_times): measuring stops and
 * resumes where it was (prof_pause returns what prof_resume takes) */
DT_PRIVATE int prof_pause(dt_ctx *ctx)
{
    int measure = ctx->prof.measure;
    ctx->prof.measure = 0;
    return measure;
}

DT_PRIVATE void prof_resume(dt_ctx *ctx, int measure) { ctx->prof.measure = measure; }

/* A pipeline stage's wait on its neighbours since t0 (prof_begin), within
 * the open step only */
DT_PRIVATE void prof_pipe_wait(dt_ctx *ctx, double t0)
{
    if (t0 > 0 && ctx->prof.open)
        ctx->prof.cur_pipe += dt_now() - t0;
}

/* the pipeline's ideal bubble share, (stages - 1) / (micro-batches + stages - 1) */
DT_PRIVATE void prof_pipe_bubble(dt_ctx *ctx, double ideal)
{
    pthread_mutex_lock(&ctx->prof.mu);
    ctx->prof.tot.pipe_bubble_ideal = ideal;
    pthread_mutex_unlock(&ctx->prof.mu);
}

DT_PRIVATE void prof_init(dt_ctx *ctx)
{
    prof_state *p = &ctx->prof;
    pthread_mutex_init(&p->mu, NULL);
    p->straggler = p->warned_rank = -1;
    const char *env = getenv("DTRAIN_PROFILE");
    if (env && *env && strcmp(env, "0") != 0)
        dt_profile_start(ctx, NULL);   /* a failure (no memory) leaves it off, said in ctx */
}

DT_PRIVATE void prof_release(dt_ctx *ctx)
{
    prof_state *p = &ctx->prof;
    host_free(ctx, p->ev);
    host_free(ctx, p->srv_lat_s);
    host_free(ctx, p->srv_calls);
    pthread_mutex_destroy(&p->mu);
}

/* Keep an event (under p->mu); past the buffer's end it is only counted. */
DT_PRIVATE void prof_push(prof_state *p, prof_event e)
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
DT_PRIVATE double prof_begin(dt_ctx *ctx)
{
    if (!prof_measuring(ctx))
        return 0;
    prof_state *p = &ctx->prof;
    if (p->depth++ > 0)
        return -1;
    return dt_now();
}

DT_PRIVATE void prof_end(dt_ctx *ctx, int phase, double t0)
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
        if (phase != PH_DATA && phase != PH_BACKWARD && phase != PH_FORWARD)   /* (a pipeline's stages time it) */
            return;
        p->open = 1;
        p->step_t0 = p->mark = t0;
    }
    int gap = phase == PH_BACKWARD ? PH_FORWARD : PH_IDLE;   /* the caller's own time */
    if (t0 > p->mark)
        p->cur[gap] += t0 - p->mark;
    p->cur[phase] += t1 - t0;
    pthread_mutex_lock(&p->mu);
    /* the caller's own time since the last phase is a phase of the timeline
     * too (forward before a backward, else idle): the step's phases tile it */
    if (t0 > p->mark)
        prof_push(p, (prof_event){.t0 = p->mark, .t1 = t0, .type = EV_PHASE, .tid = TID_COMPUTE,
                                  .what = (uint8_t)gap, .a = p->step_index});
    prof_push(p, (prof_event){.t0 = t0, .t1 = t1, .type = EV_PHASE, .tid = TID_COMPUTE,
                              .what = (uint8_t)phase, .a = p->step_index});
    pthread_mutex_unlock(&p->mu);
    p->mark = t1;
    if (phase == PH_BACKWARD)
        p->had_backward = 1;
}

DT_PRIVATE void prof_samples(dt_ctx *ctx, int64_t n)
{
    if (prof_measuring(ctx))
        ctx->prof.cur_samples += n;
}

/* dt_ctx_step_reset: the step ends if it ran a backward (an evaluation's steps
 * stay inside the training step they interrupt, as idle time). */
DT_PRIVATE void prof_step_end(dt_ctx *ctx)
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
    if (t > p->mark)   /* the idle end of the step */
        prof_push(p, (prof_event){.t0 = p->mark, .t1 = t, .type = EV_PHASE, .tid = TID_COMPUTE,
                                  .what = PH_IDLE, .a = p->step_index});
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

/* The names of an event's phase and of a collective's algorithm, for the
 * trace and the report ("backward", "ring"). */
DT_PRIVATE const char *prof_phase_name(int phase)
{
    return phase_names[phase >= 0 && phase < PH_COUNT ? phase : PH_IDLE];
}


/* The comm thread ran a collective (kind, the algorithm it chose, bytes
 * per rank, bytes over the busiest link, ranks) from t0 to t1. */
DT_PRIVATE void prof_coll(dt_ctx *ctx, double t0, double t1, int kind, int alg, int64_t bytes,
                          double bus_bytes, int world)
{
    if (!prof_recording(ctx))
        return;
    prof_state *p = &ctx->prof;
    pthread_mutex_lock(&p->mu);
    p->tot.collectives++;
    p->tot.coll_bytes += (uint64_t)bytes;
    p->tot.comm_s += t1 - t0;
    p->bus_bytes += bus_bytes;
    p->coll_s += t1 - t0;
    prof_push(p, (prof_event){.t0 = t0, .t1 = t1, .type = EV_COLL, .tid = TID_COMM,
                              .what = (uint8_t)kind, .alg = (uint8_t)alg, .a = bytes, .b = world});
    pthread_mutex_unlock(&p->mu);
}

/* The comm thread ran an extension's request (a parameter server's: what,
 * n floats) from t0 to t1; a read answered with the given staleness (-1:
 * not a read), ok when it succeeded. */
DT_PRIVATE void prof_ext(dt_ctx *ctx, double t0, double t1, int what, int64_t n, int64_t stale,
                         int ok)
{
    if (!prof_recording(ctx))
        return;
    prof_state *p = &ctx->prof;
    pthread_mutex_lock(&p->mu);
    p->tot.ps_calls++;
    p->tot.ps_latency_s += t1 - t0;
    p->tot.comm_s += t1 - t0;
    if (stale >= 0 && ok) {
        p->stale_sum += (double)stale;
        p->stale_n++;
        if (stale > p->tot.ps_max_staleness)
            p->tot.ps_max_staleness = stale;
    }
    prof_push(p, (prof_event){.t0 = t0, .t1 = t1, .type = EV_PS, .tid = TID_COMM,
                              .what = (uint8_t)what, .a = n, .b = stale});
    pthread_mutex_unlock(&p->mu);
}

DT_PRIVATE void prof_batch(dt_ctx *ctx, int64_t samples, double t0, double t1, int on_thread)
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

/* --- the public side ---------------------------------------------------- */

void dt_profile_config_init(dt_profile_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->struct_size = sizeof *cfg;
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

/* --- the CPU a process got --------------------------------------------------
 * CPU time from getrusage; the run queue's wait (runnable, not running:
 * an oversubscribed host, a noisy neighbour) from each thread's schedstat;
 * a CPU quota's throttling from the cgroup's cpu.stat (v2 throttled_usec,
 * v1 throttled_time in ns), found through /proc/self/cgroup.  What a
 * machine does not offer stays 0. */

/* The cpu.stat of this process's cgroup into out, or "" (none readable). */
static void prof_find_cpu_stat(char *out, size_t cap)
{
    out[0] = '\0';
    FILE *f = fopen("/proc/self/cgroup", "r");
    char line[512];
    while (f && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2)
            continue;
        *c1 = *c2 = '\0';
        const char *ctl = c1 + 1, *path = c2 + 1;
        char try[400] = "";
        if (!strcmp(line, "0") && !*ctl)   /* v2: the unified hierarchy */
            snprintf(try, sizeof try, "/sys/fs/cgroup%s/cpu.stat", strcmp(path, "/") ? path : "");
        else if (!strcmp(ctl, "cpu") || !strncmp(ctl, "cpu,", 4) || strstr(ctl, ",cpu,") ||
                 (strlen(ctl) > 4 && !strcmp(ctl + strlen(ctl) - 4, ",cpu")))
            snprintf(try, sizeof try, "/sys/fs/cgroup/%s%s/cpu.stat", ctl, strcmp(path, "/") ? path : "");
        if (try[0] && access(try, R_OK) == 0 && strlen(try) < cap) {
            snprintf(out, cap, "%s", try);
            if (strcmp(line, "0") != 0)
                break;   /* v1's cpu controller: the one that throttles */
        }
    }
    if (f)
        fclose(f);
}

/* The runnable-but-waiting time of every thread of this process, s. */
static double prof_run_queue_wait(void)
{
    DIR *d = opendir("/proc/self/task");
    double wait = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        char path[64];
        snprintf(path, sizeof path, "/proc/self/task/%.20s/schedstat", e->d_name);
        FILE *f = fopen(path, "r");
        unsigned long long run = 0, waited = 0;
        if (f && fscanf(f, "%llu %llu", &run, &waited) == 2)
            wait += (double)waited * 1e-9;
        if (f)
            fclose(f);
    }
    if (d)
        closedir(d);
    return wait;
}

static void prof_cpu_sample(const char *cpu_stat, prof_cpu *out)
{
    memset(out, 0, sizeof *out);
    out->wall = dt_now();
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) == 0)
        out->cpu = (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 +
                   (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec * 1e-6;
    out->wait = prof_run_queue_wait();
    FILE *f = cpu_stat[0] ? fopen(cpu_stat, "r") : NULL;
    char key[64];
    unsigned long long v;
    while (f && fscanf(f, "%63s %llu", key, &v) == 2) {
        if (!strcmp(key, "nr_periods"))
            out->periods = (int64_t)v;
        else if (!strcmp(key, "nr_throttled"))
            out->nr_throttled = (int64_t)v;
        else if (!strcmp(key, "throttled_usec"))   /* v2 */
            out->throttled = (double)v * 1e-6;
        else if (!strcmp(key, "throttled_time"))   /* v1, ns */
            out->throttled = (double)v * 1e-9;
    }
    if (f)
        fclose(f);
}

dt_status dt_profile_start(dt_ctx *ctx, const dt_profile_config *cfg)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    prof_state *p = &ctx->prof;
    dt_profile_config c;
    dt_profile_config_init(&c);
    if (cfg && ctx_config_in(ctx, &c, sizeof c, cfg, "profile_start", "dt_profile_config") != DT_OK)
        return ctx->last_status;
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
    p->tot.longest_wait_rank = -1;
    p->long_wait[0] = '\0';
    for (int r = 0; r < p->srv_n; r++)
        p->srv_lat_s[r] = 0, p->srv_calls[r] = 0;
    p->bus_bytes = p->coll_s = p->stale_sum = p->batch_s = 0;
    p->stale_n = p->batches = p->batches_prefetched = 0;
    p->win_compute = 0;
    p->win_steps = p->win_samples = 0;
    p->straggler = p->warned_rank = -1;
    memset(p->cur, 0, sizeof p->cur);
    p->cur_pipe = 0;
    p->cur_samples = 0;
    p->open = p->had_backward = 0;
    prof_find_cpu_stat(p->cpu_stat, sizeof p->cpu_stat);
    p->eval0 = ctx_aside_s(ctx, ACT_EVAL);
    p->ckpt0 = ctx_aside_s(ctx, ACT_CKPT_SAVE) + ctx_aside_s(ctx, ACT_CKPT_LOAD);
    prof_cpu_sample(p->cpu_stat, &p->cpu0);
    __atomic_store_n(&p->measure, 1, __ATOMIC_RELAXED);
    __atomic_store_n(&p->record, 1, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&p->mu);
    host_free(ctx, old);
    return DT_OK;
}

int dt_profile_active(const dt_ctx *ctx) { return prof_recording(ctx); }

DT_PRIVATE double prof_median(double *v, int n)
{
    for (int i = 1; i < n; i++)   /* insertion sort: few ranks */
        for (int j = i; j > 0 && v[j] < v[j - 1]; j--) {
            double t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    return n ? v[(n - 1) / 2] : 0;
}

/* The slowest server by mean latency and the median of the means. */
static void prof_fill_servers(const prof_state *p, dt_profile_stats *out)
{
    double means[64];
    int n = 0;
    out->ps_slowest_server = -1;
    for (int r = 0; r < p->srv_n; r++) {
        if (!p->srv_calls[r])
            continue;
        double m = p->srv_lat_s[r] / (double)p->srv_calls[r] * 1e3;
        if (out->ps_slowest_server < 0 || m > out->ps_slowest_server_ms) {
            out->ps_slowest_server = r;
            out->ps_slowest_server_ms = m;
        }
        if (n < 64)
            means[n++] = m;
    }
    out->ps_server_median_ms = prof_median(means, n);
}

DT_PRIVATE void prof_fill(const prof_state *p, dt_profile_stats *out)
{
    *out = p->tot;
    out->busbw = p->coll_s > 0 ? p->bus_bytes / p->coll_s / 1e9 : 0;
    out->ps_mean_staleness = p->stale_n ? p->stale_sum / (double)p->stale_n : 0;
    out->events = p->nev;
    out->dropped = p->dropped;
    prof_fill_servers(p, out);
    if (p->cpu0.wall > 0) {   /* since dt_profile_start */
        prof_cpu now;
        prof_cpu_sample(p->cpu_stat, &now);
        out->wall_s = now.wall - p->cpu0.wall;
        out->cpu_s = now.cpu - p->cpu0.cpu;
        out->cpu_wait_s = now.wait > p->cpu0.wait ? now.wait - p->cpu0.wait : 0;
        out->throttled_s = now.throttled - p->cpu0.throttled;
        out->cpu_periods = now.periods - p->cpu0.periods;
        out->cpu_throttled_periods = now.nr_throttled - p->cpu0.nr_throttled;
    }
}

DT_PRIVATE void prof_snapshot_begin(dt_ctx *ctx, prof_snapshot *out)
{
    prof_state *p = &ctx->prof;
    pthread_mutex_lock(&p->mu);
    prof_fill(p, &out->st);
    out->batch_s = p->batch_s;
    out->batches = p->batches;
    out->batches_prefetched = p->batches_prefetched;
    snprintf(out->long_wait, sizeof out->long_wait, "%s", p->long_wait);
    out->ev = p->ev;
    out->nev = p->nev;
}

DT_PRIVATE void prof_snapshot_end(dt_ctx *ctx) { pthread_mutex_unlock(&ctx->prof.mu); }

DT_PRIVATE void prof_window(const dt_ctx *ctx, float out[3])
{
    const prof_state *p = &ctx->prof;
    out[0] = (float)p->win_compute;
    out[1] = (float)p->win_steps;
    out[2] = (float)p->win_samples;
}

DT_PRIVATE void prof_window_reset(dt_ctx *ctx)
{
    ctx->prof.win_compute = 0;
    ctx->prof.win_steps = ctx->prof.win_samples = 0;
}

DT_PRIVATE double prof_threshold(const dt_ctx *ctx)
{
    double t = ctx->prof.cfg.straggler_threshold;
    return t > 0 ? t : PROF_DEFAULT_THRESHOLD;
}

DT_PRIVATE int prof_straggler_found(dt_ctx *ctx, int s, int mine, int64_t per_ns)
{
    prof_state *p = &ctx->prof;
    p->straggler = s;
    int warn = 0;
    if (s >= 0) {
        double now = dt_now();
        pthread_mutex_lock(&p->mu);
        if (mine)
            p->tot.straggler_warnings++;
        prof_push(p, (prof_event){.t0 = now, .t1 = now, .type = EV_STRAGGLER,
                                  .tid = TID_COMPUTE, .a = s, .b = per_ns});
        pthread_mutex_unlock(&p->mu);
        warn = s != p->warned_rank;
    }
    p->warned_rank = s;
    return warn;
}

int dt_profile_straggler(const dt_ctx *ctx) { return ctx ? ctx->prof.straggler : -1; }

DT_PRIVATE void prof_stop_recording(dt_ctx *ctx)
{
    /* (the gathers of dt_profile_stop are not part of the job) */
    __atomic_store_n(&ctx->prof.record, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&ctx->prof.measure, ctx->prof.balancing, __ATOMIC_RELAXED);
}

DT_PRIVATE void prof_fill_ctx(dt_ctx *ctx, dt_profile_stats *out)
{
    const prof_state *p = &ctx->prof;
    out->threads = ctx->threads;
    if (!(p->cpu0.wall > 0))   /* never started */
        return;
    out->eval_s = ctx_aside_s(ctx, ACT_EVAL) - p->eval0;
    out->ckpt_s = ctx_aside_s(ctx, ACT_CKPT_SAVE) + ctx_aside_s(ctx, ACT_CKPT_LOAD) - p->ckpt0;
}

/* A sharded DDP's parameter all-gathers (src/zero.c): ran s, the training
 * thread waited exposed_s of it. */
DT_PRIVATE void prof_gather(dt_ctx *ctx, double ran_s, double exposed_s)
{
    if (!prof_measuring(ctx))
        return;
    prof_state *p = &ctx->prof;
    pthread_mutex_lock(&p->mu);
    p->tot.gather_s += ran_s;
    p->tot.gather_exposed_s += exposed_s;
    pthread_mutex_unlock(&p->mu);
}

DT_PRIVATE void prof_long_wait(dt_ctx *ctx, double s, int peer, const char *what, const char *doing)
{
    if (!prof_measuring(ctx))
        return;
    prof_state *p = &ctx->prof;
    pthread_mutex_lock(&p->mu);
    if (s > p->tot.longest_wait_s) {
        p->tot.longest_wait_s = s;
        p->tot.longest_wait_rank = peer;
        snprintf(p->long_wait, sizeof p->long_wait, "%s waited %.1f s for rank %d%s%s", what, s,
                 peer, doing && doing[0] ? ", which was " : " (alive: its heartbeat went on)",
                 doing ? doing : "");
    }
    pthread_mutex_unlock(&p->mu);
}

DT_PRIVATE void prof_ext_server(dt_ctx *ctx, int server, int world, double s)
{
    if (!prof_recording(ctx) || server < 0 || server >= world)
        return;
    prof_state *p = &ctx->prof;
    pthread_mutex_lock(&p->mu);
    if (!p->srv_lat_s) {
        p->srv_lat_s = host_calloc(ctx, sizeof *p->srv_lat_s * (size_t)world);
        p->srv_calls = host_calloc(ctx, sizeof *p->srv_calls * (size_t)world);
        p->srv_n = p->srv_lat_s && p->srv_calls ? world : 0;
    }
    if (server < p->srv_n) {
        p->srv_lat_s[server] += s;
        p->srv_calls[server]++;
    }
    pthread_mutex_unlock(&p->mu);
}

/* Zero 3 made a unit whole: prefetched, or on demand (src/zero.c). */
DT_PRIVATE void prof_gather_unit(dt_ctx *ctx, int on_demand)
{
    if (!prof_measuring(ctx))
        return;
    prof_state *p = &ctx->prof;
    pthread_mutex_lock(&p->mu);
    p->tot.gathers++;
    p->tot.gathers_on_demand += on_demand != 0;
    pthread_mutex_unlock(&p->mu);
}

/* A parameter server's own figures so far (src/ps_server.c's loop), into
 * the totals: what the report and the monitor say of each server. */
DT_PRIVATE void prof_ps_serving(dt_ctx *ctx, const dt_profile_stats *sv)
{
    prof_state *p = &ctx->prof;
    pthread_mutex_lock(&p->mu);
    p->tot.ps_serve_s = sv->ps_serve_s;
    p->tot.ps_busy_s = sv->ps_busy_s;
    p->tot.ps_stalled_s = sv->ps_stalled_s;
    p->tot.ps_served = sv->ps_served;
    p->tot.ps_bytes_in = sv->ps_bytes_in;
    p->tot.ps_bytes_out = sv->ps_bytes_out;
    p->tot.ps_queue_max = sv->ps_queue_max;
    p->tot.ps_keys = sv->ps_keys;
    pthread_mutex_unlock(&p->mu);
}

dt_status dt_profile_stats_get(const dt_ctx *ctx, dt_profile_stats *out)
{
    if (!ctx || !out)
        return DT_EINVAL;
    prof_state *p = (prof_state *)&ctx->prof;
    pthread_mutex_lock(&p->mu);
    prof_fill(p, out);
    pthread_mutex_unlock(&p->mu);
    prof_fill_ctx((dt_ctx *)ctx, out);
    return DT_OK;
}
