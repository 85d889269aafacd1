#include "dist.h"

/* ===========================================================================
 * Profiler: step breakdowns, timelines, stragglers
 *
 * src/record.c records; this module compares the ranks during training
 * (stragglers), and at the end writes the trace and the report.  At the end every rank's totals and events travel to rank 0 in one
 * allgather (each rank's block padded to the largest), which moves them
 * onto its own clock with the offsets the ranks measured against rank 0's
 * store at rendezvous (Cristian's method: the best of 8 round trips, off by
 * at most half that round trip, tens of microseconds on one host).
 * ======================================================================== */

/* --- the profiler at the end of the job: gather, trace, report ---------------------- */

#define PROF_LINK_FLOATS ((int64_t)2 << 20)   /* the link test: 8 MiB allreduces */

/* What dt_profile_stop leaves (the context's CTX_EXT_PROFILE slot): rank
 * 0's report and every rank's totals, or a rank's own report when the
 * ranks could not exchange. */
typedef struct prof_result {
    char *report;
    dt_profile_stats *ranks;
    int nranks;
} prof_result;

static void prof_result_free(dt_ctx *ctx, void *state)
{
    prof_result *r = state;
    host_free(ctx, r->report);
    host_free(ctx, r->ranks);
}

static const prof_result *prof_result_of(const dt_ctx *ctx) { return ctx_ext(ctx, CTX_EXT_PROFILE); }

/* Keep rep as the report (NULL: none, out of memory), and ranks[n] as the
 * ranks' totals when given; both are taken over (freed here when they
 * cannot be kept). */
static void prof_result_keep(dt_ctx *ctx, char *rep, dt_profile_stats *ranks, int n)
{
    prof_result *r = ctx_ext_make(ctx, CTX_EXT_PROFILE, sizeof *r, prof_result_free);
    if (!r) {
        host_free(ctx, rep);
        host_free(ctx, ranks);
        return;
    }
    host_free(ctx, r->report);
    r->report = rep;
    if (ranks) {
        host_free(ctx, r->ranks);
        r->ranks = ranks;
        r->nranks = n;
    }
}


/* The report rep (freed) with the pre-emption's line after it, when the
 * job was pre-empted (src/preempt.c); NULL: out of memory. */
static char *prof_add_preempt(dt_ctx *ctx, char *rep)
{
    char line[128];
    preempt_line(ctx, line, sizeof line);
    if (!rep || !line[0])
        return rep;
    size_t a = strlen(rep), b = strlen(line);
    char *out = host_alloc(ctx, a + b + 2);
    if (out) {
        memcpy(out, rep, a);
        memcpy(out + a, line, b);
        out[a + b] = '\n';
        out[a + b + 1] = '\0';
    }
    host_free(ctx, rep);
    return out;
}

const char *dt_profile_report(const dt_ctx *ctx)
{
    const prof_result *r = ctx ? prof_result_of(ctx) : NULL;
    return r && r->report ? r->report : "";
}

dt_status dt_profile_rank_stats_get(const dt_ctx *ctx, int rank, dt_profile_stats *out)
{
    if (!ctx || !out)
        return DT_EINVAL;
    const prof_result *r = prof_result_of(ctx);
    if (!r || !r->ranks || rank < 0 || rank >= r->nranks)
        return set_error((dt_ctx *)ctx, DT_ESTATE, "profile_rank_stats: no totals for rank %d "
                         "(they are on rank 0 after dt_profile_stop)", rank);
    *out = r->ranks[rank];
    return DT_OK;
}

/* --- the ranks' check during training (DDP's step calls it) ----------- */

/* Each rank's compute per sample over the window: the slowest is a
 * straggler if it is more than the threshold above the (lower) median.  Per sample,
 * so a rank that balancing gave fewer samples is still seen as slow. */
DT_PRIVATE int prof_find_straggler(const double *per_sample, int P, double threshold, double *median)
{
    double sorted[64];
    int n = 0;
    for (int r = 0; r < P && n < 64; r++)
        if (per_sample[r] > 0)
            sorted[n++] = per_sample[r];
    if (n < 2)
        return -1;
    /* the lower median: with two ranks, the faster one (the midpoint would
     * halve the gap a slow rank opens) */
    *median = prof_median(sorted, n);
    int worst = -1;
    for (int r = 0; r < P; r++)
        if (per_sample[r] > *median * (1 + threshold) &&
            (worst < 0 || per_sample[r] > per_sample[worst]))
            worst = r;
    return worst;
}

/* Called by a DDP on every rank at the same step: swap the windows, name a
 * straggler, hand each rank's rate (samples per second of compute) back
 * for balancing (rates: P doubles, 0 where unknown).  DT_OK with nothing
 * done when no rank has a closed step yet. */
DT_PRIVATE dt_status prof_exchange(dt_ctx *ctx, dt_comm *c, double *rates)
{
    int P = dt_comm_size(c);
    float mine[3];
    prof_window(ctx, mine);
    float *all = host_alloc(ctx, sizeof(float) * 3 * (size_t)P);
    double *per = host_alloc(ctx, sizeof(double) * (size_t)P);
    if (!all || !per) {
        host_free(ctx, all);
        host_free(ctx, per);
        return set_error(ctx, DT_ENOMEM, "profiler: out of memory");
    }
    dt_status st = comm_run_wait(c, COLL_ALLGATHER, all, mine, 3, 0, DT_REDUCE_SUM, NULL);
    if (st == DT_OK) {
        prof_window_reset(ctx);
        for (int r = 0; r < P; r++) {
            double comp = all[3 * r], samples = all[3 * r + 2];
            per[r] = samples > 0 ? comp / samples : 0;
            rates[r] = comp > 0 ? samples / comp : 0;
        }
        double median = 0;
        int s = prof_find_straggler(per, P, prof_threshold(ctx), &median);
        if (prof_straggler_found(ctx, s, s == dt_comm_rank(c), s >= 0 ? (int64_t)(per[s] * 1e9) : 0))
            ctx_warn(ctx, "straggler: rank %d computes %.3f ms per sample, %.0f%% above the "
                     "median %.3f ms of %d ranks (dt_ddp_balance evens this out)", s,
                     per[s] * 1e3, 100 * (per[s] / median - 1), median * 1e3, P);
    }
    host_free(ctx, all);
    host_free(ctx, per);
    return st;
}
#define PROF_BLOB_MAGIC 0x50524F46444Eull

/* This rank's totals and events, laid out in floats for the allgather. */
static float *prof_pack(dt_ctx *ctx, double offset, int64_t *nfloats)
{
    prof_snapshot snap;
    prof_snapshot_begin(ctx, &snap);
    size_t bytes = sizeof(prof_blob_head) + (size_t)snap.nev * sizeof(prof_event);
    *nfloats = (int64_t)((bytes + 3) / 4);
    float *buf = host_calloc(ctx, (size_t)*nfloats * sizeof(float));
    if (!buf) {
        prof_snapshot_end(ctx);
        return NULL;
    }
    prof_blob_head h = {.magic = PROF_BLOB_MAGIC, .nev = snap.nev, .offset = offset,
                        .batch_s = snap.batch_s, .batches = snap.batches,
                        .batches_prefetched = snap.batches_prefetched, .st = snap.st};
    prof_fill_ctx(ctx, &h.st);
    snprintf(h.long_wait, sizeof h.long_wait, "%s", snap.long_wait);
    memcpy(buf, &h, sizeof h);
    if (snap.nev)
        memcpy((char *)buf + sizeof h, snap.ev, (size_t)snap.nev * sizeof(prof_event));
    prof_snapshot_end(ctx);
    return buf;
}

/* The link's bandwidth as the profiler compares with: the best of three
 * 8 MiB allreduces (after one to warm up), as bus bandwidth in GB/s. */
static dt_status prof_link_test(dt_ctx *ctx, dt_comm *c, double *busbw)
{
    *busbw = 0;
    float *buf = host_calloc(ctx, (size_t)PROF_LINK_FLOATS * sizeof(float));
    if (!buf)
        return set_error(ctx, DT_ENOMEM, "profile_finish: out of memory for the link test");
    double best = INFINITY;
    dt_status st = DT_OK;
    for (int i = 0; i < 4 && st == DT_OK; i++) {
        double t0 = dt_now();
        st = comm_run_wait(c, COLL_ALLREDUCE, buf, NULL, PROF_LINK_FLOATS, 0,
                                 DT_REDUCE_SUM, NULL);
        double t = dt_now() - t0;
        if (i > 0 && t < best)
            best = t;
    }
    host_free(ctx, buf);
    if (st == DT_OK && best > 0 && best < INFINITY)
        *busbw = comm_bus_factor(COLL_ALLREDUCE, dt_comm_size(c)) * (double)PROF_LINK_FLOATS * 4 / best / 1e9;
    return st;
}

static void json_event_head(FILE *f, int *first, const char *ph, int pid, int tid, double ts)
{
    fprintf(f, "%s\n{\"ph\":\"%s\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f", *first ? "" : ",", ph, pid,
            tid, ts);
    *first = 0;
}

static const char *trace_ps_name(int op)
{
    switch (op) {
    case PS_PUSH: return "ps push";
    case PS_CPUSH: return "ps push (compressed)";
    case PS_PULL: return "ps pull";
    case PS_SPUSH: return "ps sparse push";
    case PS_SPULL: return "ps sparse pull";
    case PS_INIT: return "ps init";
    case PS_FINISH: return "ps finish";
    default: return "ps call";
    }
}

/* One event as trace-event JSON; ts and dur in microseconds since base. */
static void json_event(FILE *f, int *first, int rank, const prof_event *e, double shift)
{
    double ts = (e->t0 + shift) * 1e6, dur = (e->t1 - e->t0) * 1e6;
    if (e->type == EV_STRAGGLER) {
        json_event_head(f, first, "i", rank, TID_COMPUTE, ts);
        fprintf(f, ",\"s\":\"g\",\"name\":\"straggler: rank %lld\",\"cat\":\"straggler\","
                "\"args\":{\"rank\":%lld,\"compute_ms_per_sample\":%.4f}}",
                (long long)e->a, (long long)e->a, (double)e->b / 1e6);
        return;
    }
    json_event_head(f, first, "X", rank, e->tid, ts);
    fprintf(f, ",\"dur\":%.3f", dur);
    switch (e->type) {
    case EV_PHASE:
        fprintf(f, ",\"name\":\"%s\",\"cat\":\"phase\",\"args\":{\"step\":%lld}}",
                prof_phase_name(e->what), (long long)e->a);
        break;
    case EV_STEP:
        fprintf(f, ",\"name\":\"step %lld\",\"cat\":\"step\",\"args\":{\"step\":%lld,"
                "\"samples\":%lld}}", (long long)e->a, (long long)e->a, (long long)e->b);
        break;
    case EV_COLL: {
        double algbw = dur > 0 ? (double)e->a / (dur * 1e3) : 0;   /* bytes/us/1e3 = GB/s */
        fprintf(f, ",\"name\":\"%s\",\"cat\":\"comm\",\"args\":{\"bytes\":%lld,\"algorithm\":"
                "\"%s\",\"ranks\":%lld,\"algbw_GBps\":%.4f,\"busbw_GBps\":%.4f}}",
                e->what <= COLL_P2P ? comm_coll_name(e->what) : "?", (long long)e->a,
                comm_alg_name(e->alg), (long long)e->b, algbw,
                algbw * comm_bus_factor(e->what, (int)e->b));
        break;
    }
    case EV_PS:
        fprintf(f, ",\"name\":\"%s\",\"cat\":\"ps\",\"args\":{\"floats\":%lld,\"latency_ms\":%.4f",
                trace_ps_name(e->what), (long long)e->a, dur / 1e3);
        if (e->b >= 0)
            fprintf(f, ",\"staleness\":%lld", (long long)e->b);
        fprintf(f, "}}");
        break;
    default:
        fprintf(f, ",\"name\":\"batch\",\"cat\":\"data\",\"args\":{\"samples\":%lld}}",
                (long long)e->a);
        break;
    }
}

/* Rank 0: the merged trace, every rank's clock moved onto rank 0's and
 * time counted from the earliest event. */
static dt_status prof_write_trace(dt_ctx *ctx, const char *path, float *all, int64_t stride,
                                  int P)
{
    double base = INFINITY;
    for (int r = 0; r < P; r++) {
        const prof_blob_head *h = (const prof_blob_head *)(all + r * stride);
        const prof_event *ev = (const prof_event *)(h + 1);
        for (int64_t i = 0; i < h->nev; i++)
            if (ev[i].t0 + h->offset < base)
                base = ev[i].t0 + h->offset;
    }
    if (!(base < INFINITY))
        base = 0;
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f)
        return set_error(ctx, DT_EIO, "profile_finish: cannot write the trace %s: %s", tmp,
                         strerror(errno));
    static const char *const tnames[] = {"", "compute", "comm", "loader"};
    int first = 1;
    fprintf(f, "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"producer\":\"dtrain %s\","
            "\"ranks\":%d},\"traceEvents\":[", DTRAIN_VERSION_STRING, P);
    for (int r = 0; r < P; r++) {
        const prof_blob_head *h = (const prof_blob_head *)(all + r * stride);
        json_event_head(f, &first, "M", r, 0, 0);
        fprintf(f, ",\"name\":\"process_name\",\"args\":{\"name\":\"rank %d\"}}", r);
        json_event_head(f, &first, "M", r, 0, 0);
        fprintf(f, ",\"name\":\"process_sort_index\",\"args\":{\"sort_index\":%d}}", r);
        for (int t = 1; t <= 3; t++) {
            json_event_head(f, &first, "M", r, t, 0);
            fprintf(f, ",\"name\":\"thread_name\",\"args\":{\"name\":\"%s\"}}", tnames[t]);
            json_event_head(f, &first, "M", r, t, 0);
            fprintf(f, ",\"name\":\"thread_sort_index\",\"args\":{\"sort_index\":%d}}", t);
        }
        const prof_event *ev = (const prof_event *)(h + 1);
        for (int64_t i = 0; i < h->nev; i++)
            json_event(f, &first, r, &ev[i], h->offset - base);
    }
    fprintf(f, "\n]}\n");
    int bad = ferror(f) != 0;
    bad |= fclose(f) != 0;
    if (bad || rename(tmp, path) != 0) {
        unlink(tmp);
        return set_error(ctx, DT_EIO, "profile_finish: writing the trace %s failed", path);
    }
    return DT_OK;
}

static double per_step(double s, int64_t steps) { return steps ? s / (double)steps * 1e3 : 0; }

/* The slowest of P ranks (their totals, or one interval's): in lockstep
 * every rank's step is as long, so it is the one busiest in its step (the
 * others spend the difference waiting); why gets the sentence the report
 * and the monitor (src/monitor.c) give, with its largest phase.  -1 (and
 * why "") when no rank ran a step. */
DT_PRIVATE int prof_slowest(const dt_profile_stats *const *st, int P, char *why, size_t cap)
{
    int slow = -1;
    for (int r = 0; r < P; r++)
        if (st[r] && st[r]->steps &&
            (slow < 0 || per_step(st[r]->step_s - st[r]->comm_wait_s, st[r]->steps) >
                             per_step(st[slow]->step_s - st[slow]->comm_wait_s, st[slow]->steps)))
            slow = r;
    why[0] = '\0';
    if (slow < 0)
        return -1;
    const dt_profile_stats *ss = st[slow];
    double ph[PH_COUNT] = {ss->data_s, ss->forward_s, ss->backward_s, ss->comm_wait_s,
                           ss->optimizer_s, ss->idle_s};
    int big = 0;
    for (int k = 1; k < PH_COUNT; k++)
        big = ph[k] > ph[big] ? k : big;
    snprintf(why, cap, "slowest rank: %d, busy %.2f ms of its %.2f ms step (the rest waiting on "
             "communication); its largest phase: %s, %.2f ms (%.0f%%)", slow,
             per_step(ss->step_s - ss->comm_wait_s, ss->steps), per_step(ss->step_s, ss->steps),
             prof_phase_name(big), per_step(ph[big], ss->steps),
             ss->step_s > 0 ? 100 * ph[big] / ss->step_s : 0);
    return slow;
}

DT_PRIVATE int prof_slow_server_by_latency(const dt_profile_stats *const *st, int P, char *why,
                                           size_t cap)
{
    int workers = 0, votes[64] = {0};
    double slow_ms[64] = {0}, median_ms[64] = {0};
    for (int r = 0; r < P && r < 64; r++) {
        const dt_profile_stats *s = st[r];
        if (!s || !s->ps_calls || s->ps_slowest_server < 0 || s->ps_slowest_server >= 64)
            continue;
        workers++;
        int v = s->ps_slowest_server;
        if (s->ps_server_median_ms > 0 && s->ps_slowest_server_ms >= 1.5 * s->ps_server_median_ms) {
            votes[v]++;
            slow_ms[v] += s->ps_slowest_server_ms;
            median_ms[v] += s->ps_server_median_ms;
        }
    }
    int best = -1;
    for (int v = 0; v < 64; v++)
        if (votes[v] && (best < 0 || votes[v] > votes[best]))
            best = v;
    why[0] = '\0';
    if (best < 0 || 2 * votes[best] < workers)
        return -1;
    snprintf(why, cap, "rank %d by the workers' requests: %d of %d workers wait longest for it, "
             "%.2f ms per request against a median server's %.2f ms", best, votes[best], workers,
             slow_ms[best] / votes[best], median_ms[best] / votes[best]);
    return best;
}

/* A CPU quota that held a rank back 10% of its time or more (cgroup
 * cpu.stat's throttled time over the wall time); else threads that waited
 * runnable for a CPU as long as 10% of the wall time and got at most 80% of
 * what they were ready to run (the run queue's wait: a host with more
 * runnable threads than cores).  The worst of either kind, quota first:
 * the fix differs (raise the quota; fewer threads or ranks per host).
 * Shared with the monitor (src/monitor.c), which passes an interval. */
DT_PRIVATE int prof_cpu_starved(const dt_profile_stats *const *st, int P, char *why, size_t cap)
{
    int worst = -1, quota = 0;
    double worst_share = 0;
    for (int r = 0; r < P; r++) {
        const dt_profile_stats *s = st[r];
        if (!s || !(s->wall_s > 0))
            continue;
        /* cpu.stat sums the throttled time of each CPU's run queue: over
         * the wall time on several CPUs; a share of time is at most 1 */
        double thr = s->throttled_s < s->wall_s ? s->throttled_s / s->wall_s : 1.0;
        double ready = s->cpu_s + s->cpu_wait_s, waited = s->cpu_wait_s / s->wall_s;
        int is_quota = thr >= 0.10;
        double share = is_quota ? thr : ready > 0 && waited >= 0.10 && s->cpu_s / ready <= 0.80
                                            ? 1 - s->cpu_s / ready : 0;
        if (share > 0 && (is_quota > quota || (is_quota == quota && share > worst_share))) {
            worst = r;
            quota = is_quota;
            worst_share = share;
        }
    }
    why[0] = '\0';
    if (worst < 0)
        return -1;
    const dt_profile_stats *s = st[worst];
    char role[48] = "";
    if (s->ps_serve_s > 0)
        snprintf(role, sizeof role, " (parameter server)");
    else if (s->threads > 1)
        snprintf(role, sizeof role, " (%d compute threads)", s->threads);
    if (quota)
        snprintf(why, cap, "rank %d%s was throttled %.0f%% of the time by its CPU quota (cgroup "
                 "cpu.stat: %lld of %lld periods throttled): raise its quota, or give it less "
                 "to do", worst, role, 100 * worst_share,
                 (long long)s->cpu_throttled_periods, (long long)s->cpu_periods);
    else
        snprintf(why, cap, "rank %d%s got %.0f%% of the CPU its threads were ready to use (they "
                 "waited %.1f s runnable in the scheduler's run queue over %.1f s): the host has "
                 "more runnable threads than cores; fewer ranks or compute threads per host",
                 worst, role, 100 * s->cpu_s / (s->cpu_s + s->cpu_wait_s), s->cpu_wait_s, s->wall_s);
    return worst;
}

/* One rank's data wait per step 10% of its step or more and above twice
 * the median rank's plus 1 ms: in lockstep the others wait for its batches
 * in their collectives (so theirs stays low), the job goes at its loader's
 * pace.  Every rank slow to load is the data hint's (one loader for all),
 * not this.  Shared with the monitor (src/monitor.c). */
DT_PRIVATE int prof_loader_bottleneck(const dt_profile_stats *const *st, int P, char *why,
                                      size_t cap)
{
    double waits[64];
    int n = 0, worst = -1;
    for (int r = 0; r < P && r < 64; r++)
        if (st[r] && st[r]->steps) {
            waits[n++] = per_step(st[r]->data_s, st[r]->steps);
            if (worst < 0 || per_step(st[r]->data_s, st[r]->steps) >
                                 per_step(st[worst]->data_s, st[worst]->steps))
                worst = r;
        }
    why[0] = '\0';
    if (n < 2)
        return -1;
    double median = prof_median(waits, n);
    const dt_profile_stats *s = st[worst];
    double mine = per_step(s->data_s, s->steps), step = per_step(s->step_s, s->steps);
    if (!(mine >= 0.10 * step) || !(mine > 2 * median + 1.0))
        return -1;
    snprintf(why, cap, "rank %d's data loader holds the job back: it waits %.2f ms per step for "
             "its batches (%.0f%% of its step) against the median rank's %.2f ms, and the others "
             "wait for it in their collectives: look at what that rank reads from (its storage, "
             "its host's CPU) and at its loader (dt_loader_config.prefetch, what the dataset "
             "does per sample)", worst, mine, 100 * mine / step, median);
    return worst;
}

/* A rank whose evaluation (dt_evaluate) and checkpoints took 5% of its
 * time or more (at least 10 ms) beyond the median rank's, while the median
 * of the others waited in their collectives at least half as long: the
 * work one rank does alone between steps is the others' lost time. */
DT_PRIVATE int prof_aside_stall(const dt_profile_stats *const *st, int P, char *why, size_t cap)
{
    double aside[64];
    int n = 0, worst = -1;
    for (int r = 0; r < P && r < 64; r++)
        if (st[r] && st[r]->steps) {
            aside[n++] = st[r]->eval_s + st[r]->ckpt_s;
            if (worst < 0 || st[r]->eval_s + st[r]->ckpt_s > st[worst]->eval_s + st[worst]->ckpt_s)
                worst = r;
        }
    why[0] = '\0';
    if (n < 2)
        return -1;
    double extra = st[worst]->eval_s + st[worst]->ckpt_s - prof_median(aside, n);
    double waits[64];
    int m = 0;
    for (int r = 0; r < P && r < 64; r++)
        if (st[r] && st[r]->steps && r != worst)
            waits[m++] = st[r]->comm_wait_s;
    const dt_profile_stats *s = st[worst];
    double span = s->wall_s > 0 ? s->wall_s : s->step_s, waited = prof_median(waits, m);
    if (!(extra >= 0.010) || !(extra >= 0.05 * span) || !(waited >= 0.5 * extra))
        return -1;
    int eval = s->eval_s >= s->ckpt_s;
    snprintf(why, cap, "rank %d kept the others waiting while it %s on its own: %.2f s evaluating "
             "and %.2f s on checkpoints, %.2f s more than the median rank, while the others "
             "waited %.2f s in their collectives (the median of them): %s", worst,
             eval ? "evaluated" : "saved or loaded checkpoints", s->eval_s, s->ckpt_s, extra,
             waited,
             eval ? "evaluate on every rank (dt_evaluate with the communicator gives each rank "
                    "its share of the data) or less often"
                  : "save from every rank (dt_ddp_checkpoint_save writes each rank's shard) or "
                    "less often");
    return worst;
}

/* A hot shard before its server is saturated: the server with the most
 * traffic, over 1.5 times its fair share, busy 20% of its time or more and
 * at least twice the median server's share; -1: none. */
static int prof_hot_server(const dt_profile_stats *const *st, int P, int servers, double keys,
                           double bytes)
{
    double busy[64];
    int n = 0, top = -1;
    for (int r = 0; r < P && r < 64; r++) {
        const dt_profile_stats *s = st[r];
        if (!s || !(s->ps_serve_s > 0))
            continue;
        busy[n++] = s->ps_busy_s / s->ps_serve_s;
        if (top < 0 || s->ps_bytes_in + s->ps_bytes_out >
                           st[top]->ps_bytes_in + st[top]->ps_bytes_out)
            top = r;
    }
    if (servers < 2 || top < 0 || !(bytes > 0))
        return -1;
    const dt_profile_stats *s = st[top];
    double share = (s->ps_bytes_in + s->ps_bytes_out) / bytes, mine = s->ps_busy_s / s->ps_serve_s;
    double kshare = keys > 0 ? (double)s->ps_keys / keys : 0;
    int over = share > 1.5 / servers || kshare > 1.5 / servers;
    return over && mine >= 0.2 && mine >= 2 * prof_median(busy, n) ? top : -1;
}

/* The parameter server that holds the job back, from the servers' own
 * figures (prof_ps_serving), and why, into why: one that did not run for
 * 10% of its time or more (the most of them: a stopped process, or a host
 * that starves it); else one busy 60% of its time or more.  Busy with a
 * share of the keys or of the bytes well above its fair one (1.5 / servers)
 * its shard is hot: dense keys are cut evenly (src/ps.c), so a hot shard
 * is mostly sparse rows that the data asks for more (rows go to server
 * id % servers); busy without, the servers have too many workers.  -1
 * when none stands out.  Shared with the monitor (src/monitor.c), which
 * passes one interval's figures. */
DT_PRIVATE int prof_slow_server(const dt_profile_stats *const *st, int P, char *why, size_t cap)
{
    int stalled = -1, busy = -1, servers = 0;
    double keys = 0, bytes = 0;
    why[0] = '\0';
    for (int r = 0; r < P; r++) {
        const dt_profile_stats *s = st[r];
        if (!s || !(s->ps_serve_s > 0))
            continue;
        servers++;
        keys += (double)s->ps_keys;
        bytes += s->ps_bytes_in + s->ps_bytes_out;
        if (s->ps_stalled_s >= 0.1 * s->ps_serve_s &&
            (stalled < 0 || s->ps_stalled_s / s->ps_serve_s >
                                st[stalled]->ps_stalled_s / st[stalled]->ps_serve_s))
            stalled = r;
        if (s->ps_busy_s >= 0.6 * s->ps_serve_s &&
            (busy < 0 || s->ps_busy_s / s->ps_serve_s > st[busy]->ps_busy_s / st[busy]->ps_serve_s))
            busy = r;
    }
    if (stalled >= 0) {
        const dt_profile_stats *s = st[stalled];
        snprintf(why, cap, "parameter server rank %d did not run for %.0f%% of its time (the "
                 "process was stopped, or its host starves it): every worker's pulls and pushes "
                 "wait for it; check that host, not the number of servers", stalled,
                 100 * s->ps_stalled_s / s->ps_serve_s);
        return stalled;
    }
    int hot_only = busy < 0;
    if (hot_only)
        busy = prof_hot_server(st, P, servers, keys, bytes);
    if (busy < 0)
        return -1;
    const dt_profile_stats *s = st[busy];
    double kshare = keys > 0 ? (double)s->ps_keys / keys : 0;
    double bshare = bytes > 0 ? (s->ps_bytes_in + s->ps_bytes_out) / bytes : 0;
    int hot = servers > 1 && (kshare > 1.5 / servers || bshare > 1.5 / servers);
    snprintf(why, cap, "parameter server rank %d is busy %.0f%% of its time%s and holds %.0f%% of "
             "the keys, %.0f%% of the traffic: %s", busy, 100 * s->ps_busy_s / s->ps_serve_s,
             hot_only ? " (the busiest by far)" : "", 100 * kshare, 100 * bshare,
             hot ? "its shard is hot (more than its share of the keys or of the traffic on one "
                   "server): sparse ids go to server id % servers, so the rows the data asks "
                   "for most share a remainder; renumber them (a hash of the id spreads them) "
                   "or split the largest tensors"
                 : "too many workers per server: more servers (dt_ps_config.servers)");
    return busy;
}

/* A sharded DDP's parameter all-gathers (dt_ddp_config.zero): their time
 * per step on the rank that spent the most, and the share of it exposed. */
static void prof_report_gathers(strbuf *t, const prof_blob_head *const *h, int P)
{
    int worst = -1;
    for (int r = 0; r < P; r++)
        if (h[r]->st.gather_s > 0 && h[r]->st.steps &&
            (worst < 0 || h[r]->st.gather_exposed_s > h[worst]->st.gather_exposed_s))
            worst = r;
    if (worst < 0)
        return;
    const dt_profile_stats *s = &h[worst]->st;
    double share = s->gather_exposed_s < s->gather_s ? s->gather_exposed_s / s->gather_s : 1.0;
    char units[160] = "";
    if (s->gathers > 0)   /* zero 3 */
        snprintf(units, sizeof units, ", %lld of its %lld units gathered on demand (no prefetch had "
                 "started them)%s", (long long)s->gathers_on_demand, (long long)s->gathers,
                 s->gathers_on_demand > s->steps ? ": the ops read units in an order that changes "
                                                   "between steps" : "");
    strbuf_printf(t, "sharded parameters: all-gathers ran %.2f ms per step on rank %d, %.0f%% of it "
                  "exposed (%.2f ms the step waited)%s, %.0f%% hidden behind compute%s\n",
                  per_step(s->gather_s, s->steps), worst, 100 * share,
                  per_step(s->gather_exposed_s, s->steps), units, 100 * (1 - share),
                  share > 0.5 ? "; zero 1 and 2 gather after the step (all exposed by design); zero "
                                "3 prefetches the next unit, whose copies need a core of their own "
                                "to run beside compute (not there with one core per rank)"
                              : "");
}

/* A straggler the step feels: its compute beyond the median rank's, per
 * step, 2% of its step or more.  A model whose compute is microseconds
 * (the step is the program's own time, or communication) has ranks tens of
 * percent apart per sample that no one waits for. */
static int prof_straggler_matters(const dt_profile_stats *s, double per, double median)
{
    if (!s->steps || !(s->step_s > 0))
        return 0;
    double extra = (per - median) * (double)s->samples;   /* over the run */
    return extra >= 0.02 * s->step_s;
}

/* The compute threads of the ranks other than r (their median; 0: none
 * known), for the straggler's line: a rank given fewer threads than the
 * others computes slower for it, which dt_ddp_balance evens out. */
static int prof_others_threads(const dt_profile_stats *const *st, int P, int r)
{
    double v[64];
    int n = 0;
    for (int k = 0; k < P && k < 64; k++)
        if (k != r && st[k] && st[k]->threads > 0)
            v[n++] = st[k]->threads;
    return (int)prof_median(v, n);
}

/* What dt_ddp_balance would give a job with a straggler: each rank's
 * share of the global batch in proportion to its speed, so the step's
 * compute goes from the slowest rank's (its per-sample time times its
 * samples) to the batch over the sum of the speeds. */
static void prof_report_balance_gain(strbuf *t, const prof_blob_head *const *h, int P,
                                     const double *per)
{
    double now = 0, speed = 0, samples = 0;
    for (int r = 0; r < P; r++) {
        const dt_profile_stats *s = &h[r]->st;
        if (!(per[r] > 0) || !s->steps)
            return;   /* (a rank without steps: not a DDP of equals) */
        double b = (double)s->samples / (double)s->steps;
        now = per[r] * b > now ? per[r] * b : now;
        speed += 1 / per[r];
        samples += b;
    }
    double then = samples / speed;
    if (now > 0 && then < now)
        strbuf_printf(t, "hint: dt_ddp_balance(ddp, loader, 50) gives each rank a share of the global "
                      "batch in proportion to its speed: the step's compute would go from %.2f ms to "
                      "%.2f ms (%.0f%% less), the global batch unchanged\n", now * 1e3, then * 1e3,
                      100 * (1 - then / now));
}

DT_PRIVATE char *prof_build_report(dt_ctx *ctx, const prof_blob_head *const *h, int P, double link,
                                   const char *trace_path)
{
    strbuf t = {.ctx = ctx};
    const dt_profile_stats *s0 = &h[0]->st;
    strbuf_printf(&t, "dtrain profile: %d rank%s, %lld steps on rank 0", P, P > 1 ? "s" : "",
                  (long long)s0->steps);
    if (trace_path)
        strbuf_printf(&t, ", timeline in %s", trace_path);
    strbuf_printf(&t, "\nper step, ms:\n rank  steps     step     data  forward backward comm wait "
                  "optimizer    idle | comm ran  samples/s\n");
    double sum_step = 0;
    for (int r = 0; r < P; r++) {
        const dt_profile_stats *s = &h[r]->st;
        int64_t n = s->steps;
        if (!n) {   /* a parameter server, or a rank that ran no training step */
            strbuf_printf(&t, "%5d      0   (no training steps%s)\n", r,
                          s->ps_calls ? "" : "; a parameter server serves on its own thread");
            continue;
        }
        strbuf_printf(&t, "%5d %6lld %8.2f %8.2f %8.2f %8.2f %9.2f %9.2f %7.2f | %8.2f %10.0f\n", r,
                      (long long)n, per_step(s->step_s, n), per_step(s->data_s, n),
                      per_step(s->forward_s, n), per_step(s->backward_s, n),
                      per_step(s->comm_wait_s, n), per_step(s->optimizer_s, n),
                      per_step(s->idle_s, n), per_step(s->comm_s, n),
                      s->step_s > 0 ? (double)s->samples / s->step_s : 0);
        sum_step += per_step(s->step_s, n);
    }
    const dt_profile_stats *all[64] = {0};
    int Ps = P < 64 ? P : 64;
    for (int r = 0; r < Ps; r++)
        all[r] = &h[r]->st;
    char why[320];
    if (prof_slowest(all, Ps, why, sizeof why) >= 0)
        strbuf_printf(&t, "%s\n", why);
    /* stragglers: compute per sample against the median, over the whole run */
    double per[64] = {0}, median = 0;
    int Pm = P < 64 ? P : 64;
    for (int r = 0; r < Pm; r++) {
        const dt_profile_stats *s = &h[r]->st;
        per[r] = s->samples ? (s->forward_s + s->backward_s) / (double)s->samples : 0;
    }
    double thr = prof_threshold(ctx);
    int strag = prof_find_straggler(per, Pm, thr, &median);
    if (strag >= 0 && !prof_straggler_matters(&h[strag]->st, per[strag], median))
        strag = -1;
    int any = 0;
    for (int r = 0; r < Pm; r++) {
        if (!(median > 0) || !(per[r] > median * (1 + thr)) ||
            !prof_straggler_matters(&h[r]->st, per[r], median))
            continue;
        char th[96] = "";
        int others = prof_others_threads(all, Pm, r);
        if (h[r]->st.threads > 0 && others > 0 && h[r]->st.threads != others)
            snprintf(th, sizeof th, "; it computes with %d thread%s against %d on the others",
                     h[r]->st.threads, h[r]->st.threads == 1 ? "" : "s", others);
        strbuf_printf(&t, "straggler: rank %d computes %.3f ms per sample, %.0f%% above the median "
                      "%.3f ms of forward and backward (threshold %.0f%%; named in %d checks during "
                      "training)%s\n", r,
                      per[r] * 1e3, 100 * (per[r] / median - 1), median * 1e3, 100 * thr,
                      h[r]->st.straggler_warnings, th);
        any = 1;
    }
    if (!any && P > 1)
        strbuf_printf(&t, "stragglers: none (no rank's compute per sample is %.0f%% above the "
                      "median by 2%% of its step or more)\n", 100 * thr);
    char starved[320];
    int starved_rank = prof_cpu_starved(all, Ps, starved, sizeof starved);
    if (any && (strag < 0 || strag != starved_rank))   /* short of CPU: balancing hides it */
        prof_report_balance_gain(&t, h, Pm, per);
    /* communication */
    uint64_t bytes = 0;
    double busbw = 0, comm_s = 0, exposed = 0;
    int64_t colls = 0, ps_calls = 0;
    for (int r = 0; r < P; r++) {
        bytes += h[r]->st.coll_bytes;
        colls += h[r]->st.collectives;
        comm_s += h[r]->st.comm_s;
        exposed += h[r]->st.comm_wait_s;
        ps_calls += h[r]->st.ps_calls;
    }
    busbw = s0->busbw;
    if (colls)
        strbuf_printf(&t, "communication: %lld collectives on rank 0, %.1f MB; bus bandwidth %.3f GB/s "
                      "= %.0f%% of the link's %.3f GB/s (8 MiB allreduces, measured at the end); "
                      "%.0f%% of the run's communication time was exposed\n",
                      (long long)s0->collectives, (double)s0->coll_bytes / 1e6, busbw,
                      link > 0 ? 100 * busbw / link : 0, link,
                      comm_s > 0 ? 100 * (exposed < comm_s ? exposed / comm_s : 1.0) : 0);
    prof_report_gathers(&t, h, P);
    char slow_server[480] = "";
    if (ps_calls) {
        for (int r = 0; r < P; r++) {
            const dt_profile_stats *s = &h[r]->st;
            if (s->ps_calls)
                strbuf_printf(&t, "parameter server, rank %d: %lld calls, mean latency %.3f ms; pulls' "
                              "staleness mean %.2f, max %lld; its slowest server rank %d, %.3f ms "
                              "per request (median server %.3f ms)\n", r, (long long)s->ps_calls,
                              s->ps_latency_s * 1e3 / (double)s->ps_calls, s->ps_mean_staleness,
                              (long long)s->ps_max_staleness, s->ps_slowest_server,
                              s->ps_slowest_server_ms, s->ps_server_median_ms);
            if (s->ps_serve_s > 0)
                strbuf_printf(&t, "parameter server, rank %d serving: %lld requests in %.1f s, busy "
                              "%.0f%%, not running %.0f%%, %.1f MB in, %.1f MB out, up to %lld "
                              "waiting, %lld keys\n", r, (long long)s->ps_served, s->ps_serve_s,
                              100 * s->ps_busy_s / s->ps_serve_s,
                              100 * s->ps_stalled_s / s->ps_serve_s, s->ps_bytes_in / 1e6,
                              s->ps_bytes_out / 1e6, (long long)s->ps_queue_max,
                              (long long)s->ps_keys);
        }
        if (prof_slow_server(all, Ps, slow_server, sizeof slow_server) >= 0 ||
            prof_slow_server_by_latency(all, Ps, slow_server, sizeof slow_server) >= 0)
            strbuf_printf(&t, "slowest parameter server: %s\n", slow_server);
    }
    if (starved_rank >= 0)
        strbuf_printf(&t, "cpu: %s\n", starved);
    char loader[400], stall[480];
    if (prof_loader_bottleneck(all, Ps, loader, sizeof loader) >= 0)
        strbuf_printf(&t, "data: %s\n", loader);
    int stall_rank = prof_aside_stall(all, Ps, stall, sizeof stall);
    if (stall_rank >= 0)
        strbuf_printf(&t, "stall: %s\n", stall);
    for (int r = 0; r < P; r++)   /* a living rank that kept the others past the peer timeout */
        if (h[r]->st.longest_wait_s > 0 && h[r]->long_wait[0])
            strbuf_printf(&t, "long wait, rank %d: %.*s\n", r, (int)sizeof h[r]->long_wait,
                          h[r]->long_wait);
    for (int r = 0; r < P; r++) {
        const dt_profile_stats *s = &h[r]->st;
        if (s->pipe_wait_s > 0 && s->step_s > 0)
            strbuf_printf(&t, "pipeline, rank %d: waits for its neighbours %.1f%% of the step (the "
                          "bubble; ideally %.1f%%)\n", r, 100 * s->pipe_wait_s / s->step_s,
                          100 * s->pipe_bubble_ideal);
    }
    /* hints */
    double tot_step = 0, tot_data = 0, tot_wait = 0, tot_idle = 0;
    for (int r = 0; r < P; r++) {
        tot_step += h[r]->st.step_s;
        tot_data += h[r]->st.data_s;
        tot_wait += h[r]->st.comm_wait_s;
        tot_idle += h[r]->st.idle_s;
    }
    int hints = 0;
    if (tot_step > 0 && tot_wait / tot_step > 0.15) {
        strbuf_printf(&t, "hint: exposed communication is %.0f%% of the step time: %s%s\n",
                      100 * tot_wait / tot_step,
                      slow_server[0] ? "mostly waiting for the slowest parameter server (above)"
                      : ps_calls ? "pull in the background (dt_ps_config.prefetch), more servers, or "
                             "compression (DTRAIN_COMPRESS=bf16 halves the bytes)"
                           : "larger buckets (dt_ddp_config.bucket_bytes) so fewer, bigger "
                             "allreduces overlap backward, or compression (DTRAIN_COMPRESS=bf16 "
                             "halves the bytes)",
                      stall_rank >= 0 ? "; most of it is the others waiting while one rank "
                                        "evaluated or saved alone (the stall line)"
                      : strag >= 0 ? "; part of it is the others waiting for the straggler" : "");
        hints++;
    }
    if (tot_step > 0 && tot_data / tot_step > 0.05) {
        double mb = 0;
        int64_t nb = 0, pre = 0;
        for (int r = 0; r < P; r++) {
            mb += h[r]->batch_s;
            nb += h[r]->batches;
            pre += h[r]->batches_prefetched;
        }
        strbuf_printf(&t, "hint: data wait is %.0f%% of the step time: the loader prepares a batch in "
                      "%.2f ms against a step of %.2f ms; %s\n",
                      100 * tot_data / tot_step, nb ? mb / (double)nb * 1e3 : 0, sum_step / P,
                      nb && pre == nb
                      ? "prefetch is on, so its thread cannot keep up: give it a CPU of its own "
                        "(fewer compute threads per rank) or do less per sample"
                      : "turn on prefetch (dt_loader_config.prefetch) or give the loader more "
                        "CPU (fewer compute threads per rank)");
        hints++;
    }
    if (strag >= 0 && strag == starved_rank) {
        strbuf_printf(&t, "hint: rank %d is a straggler because the CPU starves it (the cpu line): "
                      "fix that first (balancing the load would only hide it)\n", strag);
        hints++;
    } else if (strag >= 0) {
        strbuf_printf(&t, "hint: rank %d is a straggler: check its host (CPU quota, other jobs, "
                      "thermal limits), or balance the load (%s)\n", strag,
                      ps_calls ? "dt_loader_steal: idle workers take the slow one's chunks"
                           : "dt_ddp_balance cuts each global batch by measured speed");
        hints++;
    }
    if (tot_step > 0 && tot_idle / tot_step > 0.10) {
        strbuf_printf(&t, "hint: idle is %.0f%% of the step time: time in the program's own code "
                      "between dtrain calls (evaluation, logging, reading the loss every step)\n",
                      100 * tot_idle / tot_step);
        hints++;
    }
    if (P > 1 && link > 0 && busbw > 0 && busbw < 0.3 * link && bytes > 0 && strag < 0) {
        strbuf_printf(&t, "hint: collectives ran at %.0f%% of the link's bandwidth: small buckets "
                      "are bound by latency (larger buckets move the same bytes in fewer calls), and "
                      "during training the allreduces share CPU and memory with compute\n",
                      100 * busbw / link);
        hints++;
    }
    double pipe_wait = 0, pipe_ideal = 0;
    for (int r = 0; r < P; r++) {
        pipe_wait += h[r]->st.pipe_wait_s;
        pipe_ideal = h[r]->st.pipe_bubble_ideal > pipe_ideal ? h[r]->st.pipe_bubble_ideal
                                                             : pipe_ideal;
    }
    if (tot_step > 0 && pipe_wait / tot_step > 0.15) {
        strbuf_printf(&t, "hint: pipeline stages wait for each other %.0f%% of the step time "
                      "(ideally %.0f%%): more micro-batches (dt_pipe_config.micro_batches) shrink the "
                      "bubble; %s\n", 100 * pipe_wait / tot_step, 100 * pipe_ideal,
                      pipe_wait / tot_step > pipe_ideal + 0.1
                      ? "beyond the ideal, the stages are unequal: split by measured time "
                        "(dt_profile_layer_times, dt_pipe_partition)"
                      : "the rest is the schedule's fill and drain");
        hints++;
    }
    if (!hints)
        strbuf_printf(&t, "no hints: nothing stands out\n");
    if (t.oom) {
        host_free(ctx, t.p);
        return NULL;
    }
    return t.p;
}

/* --- a report even when the job failed ------------------------------------- */

/* One rank's part when the exchange could not run: its head and what it
 * was doing (its own last error: the collective that failed, and whom it
 * waited for), under "/prof/alone/<rank>" in the store. */
typedef struct prof_alone {
    prof_blob_head h;
    char said[DT_MAX_ERROR];
} prof_alone;

/* Rank 0's gathering of the parts that arrive within the patience: a rank
 * the store saw die is not waited for. */
static int prof_alone_collect(dt_comm *c, prof_alone *parts, int P, int patience_ms)
{
    double deadline = dt_now() + patience_ms / 1000.0;
    int got = 1;
    for (int r = 1; r < P; r++) {
        char key[48], dead[16];
        size_t len = 0;
        snprintf(key, sizeof key, "/dead/%d", r);
        if (dt_store_get(join_store(c), key, dead, sizeof dead, &len, 1) == DT_OK)
            continue;
        snprintf(key, sizeof key, "/prof/alone/%d", r);
        int left = (int)((deadline - dt_now()) * 1000.0);
        if (dt_store_get(join_store(c), key, &parts[r], sizeof parts[r], &len, left > 1 ? left : 1) ==
                DT_OK && len == sizeof parts[r] && parts[r].h.magic == PROF_BLOB_MAGIC) {
            parts[r].said[sizeof parts[r].said - 1] = '\0';
            got++;
        } else {
            memset(&parts[r], 0, sizeof parts[r]);
        }
    }
    dt_clear_error(comm_ctx(c));   /* (the parts that did not come are said in the report) */
    return got;
}

/* The report of a failed job: who reported and what each was doing, then
 * the usual report over the parts that came (the others' rows empty);
 * parts[0] is rank `first`'s. */
static char *prof_alone_report(dt_ctx *ctx, const prof_alone *parts, int P, int first, int got,
                               const char *why, const char *trace_path)
{
    const prof_blob_head **heads = host_calloc(ctx, sizeof *heads * (size_t)P);
    strbuf t = {.ctx = ctx};
    strbuf_printf(&t, "dtrain profile of a failed job (%s): %d of %d ranks reported\n", why, got, P);
    for (int r = 0; heads && r < P; r++) {
        heads[r] = &parts[r].h;
        if (parts[r].h.magic == PROF_BLOB_MAGIC)
            strbuf_printf(&t, "rank %d was: %s\n", first + r,
                          parts[r].said[0] ? parts[r].said : "running");
        else
            strbuf_printf(&t, "rank %d: no part (it died, or its store connection is gone)\n",
                          first + r);
    }
    char *rest = heads ? prof_build_report(ctx, heads, P, 0, trace_path) : NULL;
    if (rest)
        strbuf_puts(&t, rest);
    host_free(ctx, rest);
    host_free(ctx, heads);
    if (t.oom || !heads) {
        host_free(ctx, t.p);
        return NULL;
    }
    return t.p;
}

/* The exchange failed (a rank died, the communicator broke): every rank
 * still gets a report.  Each puts its part in the store; rank 0 waits up
 * to the timeout (at most 3 s) for the others' and reports on all it got,
 * the others (and anyone whose store is gone) on themselves.  Rank 0's
 * trace holds its own timeline.  why: the failure, for the header. */
static void prof_finish_alone(dt_ctx *ctx, dt_comm *c, const char *trace_path, const char *why)
{
    int P = dt_comm_size(c), rank = dt_comm_rank(c);
    prof_alone *parts = host_calloc(ctx, sizeof *parts * (size_t)P);
    int64_t n = 0;
    float *mine = prof_pack(ctx, join_clock_offset(c), &n);
    if (!parts || !mine) {
        host_free(ctx, parts);
        host_free(ctx, mine);
        return;
    }
    memcpy(&parts[rank].h, mine, sizeof parts[rank].h);
    snprintf(parts[rank].said, sizeof parts[rank].said, "%s", why);
    char key[48];
    snprintf(key, sizeof key, "/prof/alone/%d", rank);
    int stored = dt_store_set(join_store(c), key, &parts[rank], sizeof parts[rank]) == DT_OK;
    int got = 1;
    if (rank == 0 && stored)
        got = prof_alone_collect(c, parts, P, comm_timeout_ms(c) < 3000 ? comm_timeout_ms(c) : 3000);
    if (rank == 0 && trace_path && prof_write_trace(ctx, trace_path, mine, n, 1) != DT_OK)
        trace_path = NULL;
    char *rep = rank == 0 ? prof_alone_report(ctx, parts, P, 0, got, why, trace_path)
                          : prof_alone_report(ctx, parts + rank, 1, rank, 1, why, NULL);
    if (rep)
        prof_result_keep(ctx, rep, NULL, 0);
    host_free(ctx, parts);
    host_free(ctx, mine);
}

dt_status dt_profile_stop(dt_ctx *ctx, dt_comm *c, const char *trace_path)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (!prof_recording(ctx))
        return DT_OK;
    if (c && comm_ctx(c) != ctx)
        return set_error(ctx, DT_EINVAL, "profile_finish: the communicator belongs to another "
                         "context");
    prof_stop_recording(ctx);   /* first: the gathers below are not part of the job */
    if (!trace_path) {
        const char *e = getenv("DTRAIN_TRACE");
        trace_path = e && *e ? e : NULL;
    }
    int P = c ? dt_comm_size(c) : 1, rank = c ? dt_comm_rank(c) : 0;
    double link = 0;
    dt_status st = c && P > 1 ? prof_link_test(ctx, c, &link) : DT_OK;
    int64_t n = 0;
    float *mine = st == DT_OK ? prof_pack(ctx, c ? join_clock_offset(c) : 0, &n) : NULL;
    if (st == DT_OK && !mine)
        st = set_error(ctx, DT_ENOMEM, "profile_finish: out of memory");
    /* everyone's size, then everyone's block padded to the largest; a rank
     * that failed above still joins, with an empty block (size 0) */
    float nf = (float)(mine ? n : 0), *sizes = host_calloc(ctx, sizeof(float) * (size_t)P);
    float *all = NULL;
    int64_t stride = 0;
    dt_status cs = DT_OK;
    if (!sizes)
        cs = set_error(ctx, DT_ENOMEM, "profile_finish: out of memory");
    else if (c && P > 1)
        cs = comm_run_wait(c, COLL_ALLGATHER, sizes, &nf, 1, 0, DT_REDUCE_SUM, NULL);
    else
        sizes[0] = nf;
    for (int r = 0; cs == DT_OK && r < P; r++)
        stride = (int64_t)sizes[r] > stride ? (int64_t)sizes[r] : stride;
    int ok_all = cs == DT_OK;
    for (int r = 0; ok_all && r < P; r++)
        ok_all = sizes[r] >= (float)(sizeof(prof_blob_head) / 4);
    float *pad = NULL;
    if (cs == DT_OK && stride > 0) {
        pad = host_calloc(ctx, (size_t)stride * sizeof(float));
        all = host_alloc(ctx, (size_t)stride * (size_t)P * sizeof(float));
        if (!pad || !all) {
            /* every rank must still run the allgather: this one sends zeros */
            cs = set_error(ctx, DT_ENOMEM, "profile_finish: out of memory for %lld floats",
                           (long long)(stride * P));
        }
        if (pad && mine)
            memcpy(pad, mine, (size_t)n * sizeof(float));
        if (c && P > 1 && pad && all)
            cs = comm_run_wait(c, COLL_ALLGATHER, all, pad, stride, 0, DT_REDUCE_SUM, NULL);
        else if (pad && all)
            memcpy(all, pad, (size_t)stride * sizeof(float));
    }
    if (st == DT_OK)
        st = cs;
    if (st == DT_OK && !ok_all)
        st = set_error(ctx, DT_EPEER, "profile_finish: a rank could not pack its profile");
    if (st == DT_OK && rank == 0) {
        const prof_blob_head **heads = host_alloc(ctx, sizeof *heads * (size_t)P);
        dt_profile_stats *ranks = host_alloc(ctx, sizeof *ranks * (size_t)P);
        if (!heads || !ranks)
            st = set_error(ctx, DT_ENOMEM, "profile_finish: out of memory");
        for (int r = 0; st == DT_OK && r < P; r++) {
            heads[r] = (const prof_blob_head *)(all + r * stride);
            if (heads[r]->magic != PROF_BLOB_MAGIC ||
                (int64_t)(sizeof(prof_blob_head) + (size_t)heads[r]->nev * sizeof(prof_event)) >
                    stride * 4)
                st = set_error(ctx, DT_EPEER, "profile_finish: rank %d's profile is malformed", r);
            else
                ranks[r] = heads[r]->st, ranks[r].rank = r;
        }
        if (st == DT_OK && trace_path)
            st = prof_write_trace(ctx, trace_path, all, stride, P);
        if (st == DT_OK) {
            char *rep = prof_add_preempt(ctx, prof_build_report(ctx, heads, P, link, trace_path));
            if (!rep)
                st = set_error(ctx, DT_ENOMEM, "profile_finish: out of memory for the report");
            prof_result_keep(ctx, rep, ranks, P);
            ranks = NULL;
        }
        host_free(ctx, heads);
        host_free(ctx, ranks);
    }
    host_free(ctx, mine);
    host_free(ctx, sizes);
    host_free(ctx, pad);
    host_free(ctx, all);
    if (c && P > 1 && (cs != DT_OK || comm_broken_msg(c))) {   /* no exchange: a report all the same */
        char why[DT_MAX_ERROR];   /* the failure that broke the communicator, else the exchange's */
        snprintf(why, sizeof why, "%s", comm_broken_msg(c) ? comm_broken_msg(c) : ctx->err);
        dt_status keep = ctx->last_status;
        prof_finish_alone(ctx, c, trace_path, why);
        set_error(ctx, keep, "profile_finish: the ranks could not exchange their profiles (%s); "
                  "dt_profile_report has what this rank could gather", why);
    }
    return st;
}

