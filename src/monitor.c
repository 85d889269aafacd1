#include "dist.h"
/* mon_page: src/monitor_page.html as a C string */
#include "monitor_page.h"

/* ===========================================================================
 * The live monitor: a web page and Prometheus metrics of a running job
 *
 * Every rank runs a thread that, each interval, summarises its profiler's
 * totals (dt_profile_stats_get) and its scalars (dt_monitor_log) in one line of
 * text and publishes it in the store under "mon/<rank>" (overwritten: the
 * store keeps one line per rank), on a store connection of its own.  Rank
 * 0's thread reads the lines, turns two successive ones into the last
 * interval's per-step phases, throughput and bandwidth, notices ranks whose
 * line stopped changing (silent) or whose death the store recorded, names
 * the slowest rank as the end-of-job report does (prof_slowest), and
 * renders the JSON state and the /metrics text under the monitor's lock.
 * The HTTP server's threads (backends/http.h) copy those texts out; an
 * /events stream waits on the lock's condition for the next version.  The
 * training thread only takes the lock in dt_monitor_log.
 * ======================================================================== */

#define MON_SCALARS 8
#define MON_NAME 24
#define MON_HISTORY 600            /* job points kept for the page's curves */
#define MON_LINE 1536              /* a summary's text */
#define MON_WARNING 200            /* of its rank's latest warning, at most */
#define MON_MAX_REQUEST (16 << 10)
#define MON_MAX_CONNECTIONS 16

/* One rank's totals at one moment (what it publishes). */
typedef struct mon_summary {
    double t;                      /* its clock (dt_now) when taken */
    int64_t steps, samples, collectives, ps_calls, ps_max_stale;
    double step_s, phase[PH_COUNT], comm_s, busbw, ps_latency_s, ps_mean_stale;
    double coll_bytes;
    int straggler;                 /* the profiler's latest check named it */
    int pid;                       /* its process */
    dt_profile_stats sv;           /* a parameter server's ps_serve_s ... ps_keys */
    int nscalars;
    char name[MON_SCALARS][MON_NAME];
    int64_t at[MON_SCALARS];
    double value[MON_SCALARS];
    int64_t warnings;              /* the context's warnings so far (ctx_warning_copy) */
    char warning[MON_WARNING];     /* the latest, on one line */
    char doing[96];                /* what the rank is doing (ctx_activity_copy) */
} mon_summary;

/* Rank 0's view of one rank. */
typedef struct mon_rank {
    mon_summary cur, prev;         /* the latest line, and the one an interval before */
    int have, have_prev;
    double seen;                   /* rank 0's clock when its line last changed */
    int dead;
    /* over the last interval */
    double step_ms, phase_ms[PH_COUNT], samples_per_s, bytes_per_s;
} mon_rank;

typedef struct mon_point {
    double t;                      /* seconds since the monitor started */
    int64_t steps;                 /* rank 0's */
    double samples_per_s, step_ms, phase_ms[PH_COUNT];   /* job: sum; the ranks' median step */
    double loss, val_loss, lr;     /* rank 0's latest (NAN: none) */
} mon_point;

struct dt_monitor {
    dt_ctx *ctx;
    dt_comm *comm;
    int rank, world;
    dt_monitor_config cfg;
    dt_ctx *errors;                /* the threads' allocator and error sink (never ctx's state) */
    dt_store *store;
    pthread_t tid;
    int started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stop;
    int nscalars;                  /* dt_monitor_log's, under mu */
    char sname[MON_SCALARS][MON_NAME];
    int64_t sat[MON_SCALARS];
    double svalue[MON_SCALARS];
    /* rank 0 */
    const dt_http_iface *http;
    dt_http_server *srv;
    int port;
    char token[DT_STORE_MAX_TOKEN + 1];
    int need_token;
    double t0;
    mon_rank *ranks;
    mon_point *hist;
    int hist_n, hist_head;
    char *state, *live, *metrics;  /* the latest renders (under mu); live: the state with
                                      only the newest history point, for /events */
    uint64_t version;
    char why[320];                 /* the slowest rank and why */
    int slowest, straggler;
    char server_why[480];          /* the parameter server holding the job back, and why */
    int slow_server;
    char cpu_why[320];             /* the rank the CPU starves over the interval, and why */
    int cpu_starved;
    char loader_why[400];          /* the rank whose loader holds the others back, and why */
    int loader_bottleneck;
};

static const char *const mon_phase_key[PH_COUNT] = {"data", "forward", "backward", "comm_wait",
                                                    "optimizer", "idle"};

void dt_monitor_config_init(dt_monitor_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->struct_size = sizeof *cfg;
    cfg->interval_s = 1.0;
}

/* --- summaries ----------------------------------------------------------- */

static void mon_take(dt_monitor *m, mon_summary *s)
{
    dt_profile_stats st;
    memset(s, 0, sizeof *s);
    dt_profile_stats_get(m->ctx, &st);
    s->t = dt_now();
    s->steps = st.steps;
    s->samples = st.samples;
    s->collectives = st.collectives;
    s->ps_calls = st.ps_calls;
    s->ps_max_stale = st.ps_max_staleness;
    s->step_s = st.step_s;
    double ph[PH_COUNT] = {st.data_s, st.forward_s, st.backward_s, st.comm_wait_s, st.optimizer_s,
                           st.idle_s};
    memcpy(s->phase, ph, sizeof ph);
    s->comm_s = st.comm_s;
    s->busbw = st.busbw;
    s->ps_latency_s = st.ps_latency_s;
    s->ps_mean_stale = st.ps_mean_staleness;
    s->coll_bytes = (double)st.coll_bytes;
    s->straggler = dt_profile_straggler(m->ctx) == m->rank;
    s->pid = (int)getpid();
    s->sv = st;
    pthread_mutex_lock(&m->mu);
    s->nscalars = m->nscalars;
    memcpy(s->name, m->sname, sizeof s->name);
    memcpy(s->at, m->sat, sizeof s->at);
    memcpy(s->value, m->svalue, sizeof s->value);
    pthread_mutex_unlock(&m->mu);
    s->warnings = ctx_warning_copy(m->ctx, s->warning, sizeof s->warning);
    for (char *c = s->warning; *c; c++)   /* the line's: one line of text */
        if ((unsigned char)*c < ' ')
            *c = ' ';
    ctx_activity_copy(m->ctx, s->doing, sizeof s->doing);
}

/* One line: "dtmon1 t steps samples step_s 6 phases comm_s coll_bytes busbw
 * collectives ps_calls ps_latency ps_max ps_mean straggler pid, a server's
 * serve busy stalled served bytes_in bytes_out queue_max keys, a sharded
 * DDP's gather gather_exposed, the CPU's wall cpu wait throttled periods
 * throttled_periods, a worker's slowest_server its_ms median_server_ms,
 * n (name at value)*, warnings, the latest
 * warning's length and text, and what the rank is doing to the end" */
static int mon_encode(const mon_summary *s, char *out, size_t cap)
{
    int n = snprintf(out, cap, "dtmon1 %.6f %lld %lld %.9g", s->t, (long long)s->steps,
                     (long long)s->samples, s->step_s);
    for (int k = 0; k < PH_COUNT; k++)
        n += snprintf(out + n, cap - (size_t)n, " %.9g", s->phase[k]);
    n += snprintf(out + n, cap - (size_t)n, " %.9g %.17g %.9g %lld %lld %.9g %lld %.9g %d %d",
                  s->comm_s, s->coll_bytes, s->busbw, (long long)s->collectives,
                  (long long)s->ps_calls, s->ps_latency_s, (long long)s->ps_max_stale,
                  s->ps_mean_stale, s->straggler, s->pid);
    n += snprintf(out + n, cap - (size_t)n, " %.9g %.9g %.9g %lld %.17g %.17g %lld %lld %.9g %.9g",
                  s->sv.ps_serve_s, s->sv.ps_busy_s, s->sv.ps_stalled_s, (long long)s->sv.ps_served,
                  s->sv.ps_bytes_in, s->sv.ps_bytes_out, (long long)s->sv.ps_queue_max,
                  (long long)s->sv.ps_keys, s->sv.gather_s, s->sv.gather_exposed_s);
    n += snprintf(out + n, cap - (size_t)n, " %.9g %.9g %.9g %.9g %lld %lld %d %.9g %.9g %d",
                  s->sv.wall_s, s->sv.cpu_s, s->sv.cpu_wait_s, s->sv.throttled_s,
                  (long long)s->sv.cpu_periods, (long long)s->sv.cpu_throttled_periods,
                  s->sv.ps_slowest_server, s->sv.ps_slowest_server_ms, s->sv.ps_server_median_ms,
                  s->nscalars);
    for (int i = 0; i < s->nscalars; i++)
        n += snprintf(out + n, cap - (size_t)n, " %s %lld %.9g", s->name[i], (long long)s->at[i],
                      s->value[i]);
    n += snprintf(out + n, cap - (size_t)n, " %lld %d %s %s", (long long)s->warnings,
                  (int)strlen(s->warning), s->warning, s->doing);
    return n > 0 && (size_t)n < cap;
}

static int mon_name_ok(const char *name)
{
    size_t n = strlen(name);
    if (n == 0 || n >= MON_NAME)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (!((name[i] >= 'a' && name[i] <= 'z') || (name[i] >= 'A' && name[i] <= 'Z') ||
              (name[i] >= '0' && name[i] <= '9') || name[i] == '_'))
            return 0;
    return 1;
}

/* The line back; 0 when it is not one (another rank's bytes: checked). */
static int mon_decode(const char *line, mon_summary *s)
{
    memset(s, 0, sizeof *s);
    long long steps, samples, colls, ps_calls, ps_max;
    int used = 0;
    if (sscanf(line, "dtmon1 %lf %lld %lld %lf %lf %lf %lf %lf %lf %lf %lf %lf %lf %lld %lld %lf "
                     "%lld %lf %d %d%n",
               &s->t, &steps, &samples, &s->step_s, &s->phase[0], &s->phase[1], &s->phase[2],
               &s->phase[3], &s->phase[4], &s->phase[5], &s->comm_s, &s->coll_bytes, &s->busbw,
               &colls, &ps_calls, &s->ps_latency_s, &ps_max, &s->ps_mean_stale, &s->straggler,
               &s->pid, &used) != 20)
        return 0;
    s->steps = steps;
    s->samples = samples;
    s->collectives = colls;
    s->ps_calls = ps_calls;
    s->ps_max_stale = ps_max;
    const char *p = line + used;
    long long served, qmax, keys, periods, throttled;
    int k = 0;
    if (sscanf(p, " %lf %lf %lf %lld %lf %lf %lld %lld %lf %lf %lf %lf %lf %lf %lld %lld %d %lf "
                  "%lf %d%n",
               &s->sv.ps_serve_s, &s->sv.ps_busy_s, &s->sv.ps_stalled_s, &served,
               &s->sv.ps_bytes_in, &s->sv.ps_bytes_out, &qmax, &keys, &s->sv.gather_s,
               &s->sv.gather_exposed_s, &s->sv.wall_s, &s->sv.cpu_s, &s->sv.cpu_wait_s,
               &s->sv.throttled_s, &periods, &throttled, &s->sv.ps_slowest_server,
               &s->sv.ps_slowest_server_ms, &s->sv.ps_server_median_ms, &s->nscalars, &k) != 20 ||
        s->nscalars < 0 || s->nscalars > MON_SCALARS)
        return 0;
    s->sv.cpu_periods = periods;
    s->sv.cpu_throttled_periods = throttled;
    s->sv.ps_served = served;
    s->sv.ps_queue_max = qmax;
    s->sv.ps_keys = keys;
    p += k;
    for (int i = 0; i < s->nscalars; i++) {
        char name[MON_NAME];
        long long at;
        int used_here = 0;
        if (sscanf(p, " %23s %lld %lf%n", name, &at, &s->value[i], &used_here) != 3 ||
            !mon_name_ok(name))
            return 0;
        memcpy(s->name[i], name, sizeof name);
        s->at[i] = at;
        p += used_here;
    }
    long long warnings;
    int w = 0, wlen = 0;
    if (sscanf(p, " %lld %d%n", &warnings, &wlen, &w) != 2 || warnings < 0 || wlen < 0 ||
        wlen >= MON_WARNING || p[w] != ' ' || strnlen(p + w + 1, (size_t)wlen) < (size_t)wlen)
        return 0;
    s->warnings = warnings;
    p += w + 1;
    memcpy(s->warning, p, (size_t)wlen);
    s->warning[wlen] = '\0';
    p += wlen;
    snprintf(s->doing, sizeof s->doing, "%s", *p == ' ' ? p + 1 : p);
    return 1;
}

/* The latest value of scalar name in s, or NAN. */
static double mon_scalar(const mon_summary *s, const char *name)
{
    for (int i = 0; i < s->nscalars; i++)
        if (strcmp(s->name[i], name) == 0)
            return s->value[i];
    return NAN;
}

/* --- rank 0: the job's state ---------------------------------------------- */

/* Rank r's latest line (rank 0's own: taken here). */
static void mon_read_rank(dt_monitor *m, int r, double now)
{
    mon_rank *x = &m->ranks[r];
    mon_summary s;
    int got = 0;
    if (r == 0) {
        mon_take(m, &s);
        got = 1;
    } else if (m->store) {
        char key[32], line[MON_LINE];
        size_t len = 0;
        snprintf(key, sizeof key, "mon/%d", r);
        if (dt_store_get(m->store, key, line, sizeof line - 1, &len, 1) == DT_OK && len < sizeof line) {
            line[len] = '\0';
            got = mon_decode(line, &s);
        }
        if (!x->dead) {
            char val[16];
            store_dead_key(key, sizeof key, r, 0);
            x->dead = dt_store_get(m->store, key, val, sizeof val, &len, 1) == DT_OK;
        }
    }
    if (!got || (x->have && s.t == x->cur.t))
        return;
    if (x->have) {
        x->prev = x->cur;
        x->have_prev = 1;
    }
    x->cur = s;
    x->have = 1;
    x->seen = now;
    if (!x->have_prev)
        return;
    const mon_summary *a = &x->prev, *b = &x->cur;
    double dt = b->t - a->t;
    int64_t dn = b->steps - a->steps;
    x->step_ms = dn > 0 ? (b->step_s - a->step_s) / (double)dn * 1e3 : 0;
    for (int k = 0; k < PH_COUNT; k++)
        x->phase_ms[k] = dn > 0 ? (b->phase[k] - a->phase[k]) / (double)dn * 1e3 : 0;
    x->samples_per_s = dt > 0 ? (double)(b->samples - a->samples) / dt : 0;
    x->bytes_per_s = dt > 0 ? (b->coll_bytes - a->coll_bytes) / dt : 0;
}

/* "up", "silent" (no new line for 3 intervals, at least 3 s) or "died". */
static const char *mon_status(const dt_monitor *m, const mon_rank *x, double now)
{
    if (x->dead)
        return "died";
    double quiet = 3 * m->cfg.interval_s > 3 ? 3 * m->cfg.interval_s : 3;
    return x->have && now - x->seen <= quiet ? "up" : "silent";
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The slowest rank over the last interval (as the report does over the
 * run) and the straggler, from the intervals' deltas. */
static void mon_diagnose_cpu(dt_monitor *m, int P);

static void mon_diagnose(dt_monitor *m)
{
    int P = m->world < 64 ? m->world : 64;
    dt_profile_stats d[64];
    const dt_profile_stats *all[64];
    double per[64];
    for (int r = 0; r < P; r++) {
        const mon_rank *x = &m->ranks[r];
        memset(&d[r], 0, sizeof d[r]);
        all[r] = NULL;
        per[r] = 0;
        if (!x->have_prev || x->cur.steps <= x->prev.steps)
            continue;
        const mon_summary *a = &x->prev, *b = &x->cur;
        d[r].steps = b->steps - a->steps;
        d[r].step_s = b->step_s - a->step_s;
        d[r].data_s = b->phase[PH_DATA] - a->phase[PH_DATA];
        d[r].forward_s = b->phase[PH_FORWARD] - a->phase[PH_FORWARD];
        d[r].backward_s = b->phase[PH_BACKWARD] - a->phase[PH_BACKWARD];
        d[r].comm_wait_s = b->phase[PH_COMM_WAIT] - a->phase[PH_COMM_WAIT];
        d[r].optimizer_s = b->phase[PH_OPTIM] - a->phase[PH_OPTIM];
        d[r].idle_s = b->phase[PH_IDLE] - a->phase[PH_IDLE];
        d[r].samples = b->samples - a->samples;
        all[r] = &d[r];
        per[r] = d[r].samples ? (d[r].forward_s + d[r].backward_s) / (double)d[r].samples : 0;
    }
    m->slowest = P > 1 ? prof_slowest(all, P, m->why, sizeof m->why) : -1;
    if (P <= 1)
        snprintf(m->why, sizeof m->why, "one rank");
    double median = 0;
    m->straggler = prof_find_straggler(per, P, PROF_DEFAULT_THRESHOLD, &median);
    m->loader_bottleneck = prof_loader_bottleneck(all, P, m->loader_why, sizeof m->loader_why);
    /* the parameter servers over the interval */
    dt_profile_stats sv[64];
    const dt_profile_stats *servers[64] = {0};
    for (int r = 0; r < P; r++) {
        const mon_rank *x = &m->ranks[r];
        const dt_profile_stats *a = &x->prev.sv, *b = &x->cur.sv;
        servers[r] = NULL;
        if (!x->have_prev || !(b->ps_serve_s > a->ps_serve_s))
            continue;
        memset(&sv[r], 0, sizeof sv[r]);
        sv[r].ps_serve_s = b->ps_serve_s - a->ps_serve_s;
        sv[r].ps_busy_s = b->ps_busy_s - a->ps_busy_s;
        sv[r].ps_stalled_s = b->ps_stalled_s - a->ps_stalled_s;
        sv[r].ps_bytes_in = b->ps_bytes_in - a->ps_bytes_in;
        sv[r].ps_bytes_out = b->ps_bytes_out - a->ps_bytes_out;
        sv[r].ps_keys = b->ps_keys;
        servers[r] = &sv[r];
    }
    m->slow_server = prof_slow_server(servers, P, m->server_why, sizeof m->server_why);
    if (m->slow_server < 0) {   /* the workers' latency to each server, over the run */
        const dt_profile_stats *lat[64] = {0};
        dt_profile_stats wk[64];
        for (int r = 0; r < P; r++) {
            const mon_rank *x = &m->ranks[r];
            if (!x->have || !x->cur.ps_calls)
                continue;
            wk[r] = x->cur.sv;
            wk[r].ps_calls = x->cur.ps_calls;
            lat[r] = &wk[r];
        }
        m->slow_server = prof_slow_server_by_latency(lat, P, m->server_why, sizeof m->server_why);
    }
    mon_diagnose_cpu(m, P);
}

/* The CPU each rank got over the interval: the one it starves (prof_cpu_starved). */
static void mon_diagnose_cpu(dt_monitor *m, int P)
{
    dt_profile_stats cpu[64];
    const dt_profile_stats *cpus[64] = {0};
    for (int r = 0; r < P; r++) {
        const mon_rank *x = &m->ranks[r];
        const dt_profile_stats *a = &x->prev.sv, *b = &x->cur.sv;
        cpus[r] = NULL;
        if (!x->have_prev || !(b->wall_s > a->wall_s))
            continue;
        memset(&cpu[r], 0, sizeof cpu[r]);
        cpu[r].wall_s = b->wall_s - a->wall_s;
        cpu[r].cpu_s = b->cpu_s - a->cpu_s;
        cpu[r].cpu_wait_s = b->cpu_wait_s - a->cpu_wait_s;
        cpu[r].throttled_s = b->throttled_s - a->throttled_s;
        cpu[r].cpu_periods = b->cpu_periods - a->cpu_periods;
        cpu[r].cpu_throttled_periods = b->cpu_throttled_periods - a->cpu_throttled_periods;
        cpu[r].ps_serve_s = b->ps_serve_s;
        cpus[r] = &cpu[r];
    }
    m->cpu_starved = prof_cpu_starved(cpus, P, m->cpu_why, sizeof m->cpu_why);
}

static void mon_add_point(dt_monitor *m, double now)
{
    mon_point p = {.t = now - m->t0, .loss = NAN, .val_loss = NAN, .lr = NAN};
    double steps_ms[64], phase[PH_COUNT][64];
    int n = 0;
    for (int r = 0; r < m->world; r++) {
        const mon_rank *x = &m->ranks[r];
        p.samples_per_s += x->samples_per_s;
        if (x->step_ms > 0 && n < 64) {
            steps_ms[n] = x->step_ms;
            for (int k = 0; k < PH_COUNT; k++)
                phase[k][n] = x->phase_ms[k];
            n++;
        }
    }
    if (n) {   /* the median rank's step, and each phase's median */
        qsort(steps_ms, (size_t)n, sizeof(double), cmp_double);
        p.step_ms = steps_ms[n / 2];
        for (int k = 0; k < PH_COUNT; k++) {
            qsort(phase[k], (size_t)n, sizeof(double), cmp_double);
            p.phase_ms[k] = phase[k][n / 2];
        }
    }
    const mon_summary *s0 = &m->ranks[0].cur;
    p.steps = s0->steps;
    p.loss = mon_scalar(s0, "loss");
    p.val_loss = mon_scalar(s0, "val_loss");
    p.lr = mon_scalar(s0, "lr");
    m->hist[m->hist_head] = p;
    m->hist_head = (m->hist_head + 1) % MON_HISTORY;
    if (m->hist_n < MON_HISTORY)
        m->hist_n++;
}

/* JSON numbers: NAN and infinities are null */
static void jnum(strbuf *b, const char *key, double v)
{
    if (isfinite(v))
        strbuf_printf(b, "\"%s\":%.6g", key, v);
    else
        strbuf_printf(b, "\"%s\":null", key);
}

/* A JSON string of text (the diagnosis: ours, but escaped all the same). */
static void jstr(strbuf *b, const char *key, const char *text)
{
    strbuf_printf(b, "\"%s\":\"", key);
    for (const char *p = text; *p; p++) {
        if (*p == '"' || *p == '\\')
            strbuf_printf(b, "\\%c", *p);
        else if ((unsigned char)*p < 0x20)
            strbuf_printf(b, "\\u%04x", (unsigned char)*p);
        else
            strbuf_putn(b, p, 1);
    }
    strbuf_puts(b, "\"");
}

static void mon_render_rank(dt_monitor *m, strbuf *b, int r, double now)
{
    const mon_rank *x = &m->ranks[r];
    const mon_summary *s = &x->cur;
    strbuf_printf(b, "{\"rank\":%d,\"pid\":%d,\"status\":\"%s\",\"steps\":%lld,", r, s->pid,
                  mon_status(m, x, now), (long long)s->steps);
    jnum(b, "last_seen_s", x->have ? now - x->seen : NAN);
    strbuf_puts(b, ",");
    jnum(b, "step_ms", x->step_ms);
    strbuf_puts(b, ",\"phases_ms\":{");
    for (int k = 0; k < PH_COUNT; k++) {
        jnum(b, mon_phase_key[k], x->phase_ms[k]);
        strbuf_puts(b, k + 1 < PH_COUNT ? "," : "},");
    }
    jnum(b, "samples_per_s", x->samples_per_s);
    strbuf_puts(b, ",");
    jnum(b, "bytes_per_s", x->bytes_per_s);
    strbuf_puts(b, ",");
    jnum(b, "busbw_GBps", s->busbw);
    strbuf_printf(b, ",\"straggler\":%s,\"ps_calls\":%lld,",
                  r == m->straggler || s->straggler ? "true" : "false", (long long)s->ps_calls);
    jnum(b, "ps_latency_ms", s->ps_calls ? s->ps_latency_s / (double)s->ps_calls * 1e3 : NAN);
    strbuf_printf(b, ",\"ps_max_staleness\":%lld,", (long long)s->ps_max_stale);
    jnum(b, "ps_mean_staleness", s->ps_mean_stale);
    strbuf_puts(b, ",");
    jnum(b, "gather_s", s->sv.gather_s);
    strbuf_puts(b, ",");
    jnum(b, "gather_exposed_s", s->sv.gather_exposed_s);
    strbuf_puts(b, ",");
    jnum(b, "cpu_s", s->sv.wall_s > 0 ? s->sv.cpu_s : NAN);
    strbuf_puts(b, ",");
    jnum(b, "cpu_wait_s", s->sv.wall_s > 0 ? s->sv.cpu_wait_s : NAN);
    strbuf_puts(b, ",");
    jnum(b, "throttled_s", s->sv.wall_s > 0 ? s->sv.throttled_s : NAN);
    if (s->sv.ps_serve_s > 0) {   /* a parameter server's own figures, over the run */
        const dt_profile_stats *v = &s->sv;
        strbuf_printf(b, ",\"server\":{\"served\":%lld,\"keys\":%lld,\"queue_max\":%lld,",
                      (long long)v->ps_served, (long long)v->ps_keys, (long long)v->ps_queue_max);
        jnum(b, "busy", v->ps_busy_s / v->ps_serve_s);
        strbuf_puts(b, ",");
        jnum(b, "stalled", v->ps_stalled_s / v->ps_serve_s);
        strbuf_puts(b, ",");
        jnum(b, "bytes_in", v->ps_bytes_in);
        strbuf_puts(b, ",");
        jnum(b, "bytes_out", v->ps_bytes_out);
        strbuf_puts(b, "}");
    }
    strbuf_printf(b, ",\"warnings\":%lld,", (long long)s->warnings);
    jstr(b, "warning", s->warning);
    strbuf_puts(b, ",");
    jstr(b, "doing", s->doing);
    strbuf_puts(b, ",\"scalars\":{");
    for (int i = 0; i < s->nscalars; i++) {
        if (i)
            strbuf_puts(b, ",");
        jnum(b, s->name[i], s->value[i]);
    }
    strbuf_puts(b, "}}");
}

/* The state; with every point of the history, or (for the event stream)
 * only the newest. */
static char *mon_render_state(dt_monitor *m, double now, int whole)
{
    strbuf b = {.ctx = m->errors};
    strbuf_printf(&b, "{\"world\":%d,\"interval_s\":%.3f,", m->world, m->cfg.interval_s);
    jnum(&b, "uptime_s", now - m->t0);
    strbuf_printf(&b, ",\"slowest\":%d,", m->slowest);
    jstr(&b, "why", m->why);
    strbuf_printf(&b, ",\"straggler\":%d,\"slow_server\":%d,", m->straggler, m->slow_server);
    jstr(&b, "server_why", m->server_why);
    strbuf_printf(&b, ",\"cpu_starved\":%d,", m->cpu_starved);
    jstr(&b, "cpu_why", m->cpu_why);
    strbuf_printf(&b, ",\"loader_bottleneck\":%d,", m->loader_bottleneck);
    jstr(&b, "loader_why", m->loader_why);
    strbuf_puts(&b, ",\"ranks\":[");
    for (int r = 0; r < m->world; r++) {
        if (r)
            strbuf_puts(&b, ",");
        mon_render_rank(m, &b, r, now);
    }
    strbuf_puts(&b, "],\"history\":[");
    for (int i = whole ? 0 : (m->hist_n ? m->hist_n - 1 : 0); i < m->hist_n; i++) {
        const mon_point *p = &m->hist[(m->hist_head - m->hist_n + i + MON_HISTORY) % MON_HISTORY];
        strbuf_printf(&b, "%s{\"steps\":%lld,", i && whole ? "," : "", (long long)p->steps);
        jnum(&b, "t", p->t);
        strbuf_puts(&b, ",");
        jnum(&b, "samples_per_s", p->samples_per_s);
        strbuf_puts(&b, ",");
        jnum(&b, "step_ms", p->step_ms);
        for (int k = 0; k < PH_COUNT; k++) {
            strbuf_puts(&b, ",");
            jnum(&b, mon_phase_key[k], p->phase_ms[k]);
        }
        strbuf_puts(&b, ",");
        jnum(&b, "loss", p->loss);
        strbuf_puts(&b, ",");
        jnum(&b, "val_loss", p->val_loss);
        strbuf_puts(&b, ",");
        jnum(&b, "lr", p->lr);
        strbuf_puts(&b, "}");
    }
    strbuf_puts(&b, "]}");
    if (b.oom) {
        host_free(m->errors, b.p);
        return NULL;
    }
    return b.p;
}

/* --- /metrics: Prometheus text exposition format 0.0.4 -------------------- */

static void prom_head(strbuf *b, const char *name, const char *type, const char *help)
{
    strbuf_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* One sample per rank of v(rank). */
static void prom_per_rank(dt_monitor *m, strbuf *b, const char *name, const char *type,
                          const char *help, double (*v)(const dt_monitor *, int, double), double now)
{
    prom_head(b, name, type, help);
    for (int r = 0; r < m->world; r++) {
        double x = v(m, r, now);
        if (isfinite(x))
            strbuf_printf(b, "%s{rank=\"%d\"} %.9g\n", name, r, x);
    }
}

#define MON_FIELD(fn, expr)                                                   \
    static double fn(const dt_monitor *m, int r, double now)                  \
    {                                                                         \
        const mon_rank *x = &m->ranks[r];                                     \
        const mon_summary *s = &x->cur;                                       \
        (void)s;                                                              \
        (void)now;                                                            \
        return expr;                                                          \
    }
MON_FIELD(f_up, strcmp(mon_status(m, x, now), "up") == 0)
MON_FIELD(f_seen, x->have ? now - x->seen : NAN)
MON_FIELD(f_steps, (double)s->steps)
MON_FIELD(f_step_s, s->step_s)
MON_FIELD(f_samples, (double)s->samples)
MON_FIELD(f_sps, x->samples_per_s)
MON_FIELD(f_bytes, s->coll_bytes)
MON_FIELD(f_colls, (double)s->collectives)
MON_FIELD(f_busbw, s->busbw * 1e9)
MON_FIELD(f_exposed, s->phase[PH_COMM_WAIT])
MON_FIELD(f_comm, s->comm_s)
MON_FIELD(f_strag, (double)(r == m->straggler || s->straggler))
MON_FIELD(f_ps_calls, (double)s->ps_calls)
MON_FIELD(f_ps_lat, s->ps_latency_s)
MON_FIELD(f_ps_max, (double)s->ps_max_stale)
MON_FIELD(f_ps_mean, s->ps_mean_stale)
MON_FIELD(f_sv_serve, s->sv.ps_serve_s > 0 ? s->sv.ps_serve_s : NAN)
MON_FIELD(f_sv_busy, s->sv.ps_serve_s > 0 ? s->sv.ps_busy_s : NAN)
MON_FIELD(f_sv_stalled, s->sv.ps_serve_s > 0 ? s->sv.ps_stalled_s : NAN)
MON_FIELD(f_sv_served, s->sv.ps_serve_s > 0 ? (double)s->sv.ps_served : NAN)
MON_FIELD(f_sv_in, s->sv.ps_serve_s > 0 ? s->sv.ps_bytes_in : NAN)
MON_FIELD(f_sv_out, s->sv.ps_serve_s > 0 ? s->sv.ps_bytes_out : NAN)
MON_FIELD(f_sv_queue, s->sv.ps_serve_s > 0 ? (double)s->sv.ps_queue_max : NAN)
MON_FIELD(f_sv_keys, s->sv.ps_serve_s > 0 ? (double)s->sv.ps_keys : NAN)
MON_FIELD(f_gather, s->sv.gather_s > 0 ? s->sv.gather_s : NAN)
MON_FIELD(f_gather_exp, s->sv.gather_s > 0 ? s->sv.gather_exposed_s : NAN)
MON_FIELD(f_warnings, (double)s->warnings)
MON_FIELD(f_cpu, s->sv.wall_s > 0 ? s->sv.cpu_s : NAN)
MON_FIELD(f_cpu_wait, s->sv.wall_s > 0 ? s->sv.cpu_wait_s : NAN)
MON_FIELD(f_throttled, s->sv.wall_s > 0 ? s->sv.throttled_s : NAN)

static void prom_scalars(dt_monitor *m, strbuf *b)
{
    static const char *const known[3][3] = {
        {"loss", "dtrain_loss", "The latest training loss a rank gave dt_monitor_log."},
        {"lr", "dtrain_learning_rate", "The latest learning rate a rank gave dt_monitor_log."},
        {"val_loss", "dtrain_validation_loss", "The latest validation loss a rank gave dt_monitor_log."}};
    for (int k = 0; k < 3; k++) {
        prom_head(b, known[k][1], "gauge", known[k][2]);
        for (int r = 0; r < m->world; r++) {
            double v = mon_scalar(&m->ranks[r].cur, known[k][0]);
            if (isfinite(v))
                strbuf_printf(b, "%s{rank=\"%d\"} %.9g\n", known[k][1], r, v);
        }
    }
    prom_head(b, "dtrain_metric", "gauge", "Other scalars given to dt_monitor_log, by name.");
    for (int r = 0; r < m->world; r++) {
        const mon_summary *s = &m->ranks[r].cur;
        for (int i = 0; i < s->nscalars; i++)
            if (strcmp(s->name[i], "loss") && strcmp(s->name[i], "lr") && strcmp(s->name[i], "val_loss") &&
                isfinite(s->value[i]))
                strbuf_printf(b, "dtrain_metric{rank=\"%d\",name=\"%s\"} %.9g\n", r, s->name[i],
                              s->value[i]);
    }
}

static char *mon_render_metrics(dt_monitor *m, double now)
{
    strbuf b = {.ctx = m->errors};
    prom_head(&b, "dtrain_world_size", "gauge", "Ranks in the job.");
    strbuf_printf(&b, "dtrain_world_size %d\n", m->world);
    prom_per_rank(m, &b, "dtrain_up", "gauge",
                  "1 while the rank's summaries arrive; 0 when it went silent or died.", f_up, now);
    prom_per_rank(m, &b, "dtrain_last_seen_seconds", "gauge",
                  "Seconds since the rank's last new summary.", f_seen, now);
    prom_per_rank(m, &b, "dtrain_steps_total", "counter", "Training steps the rank completed.",
                  f_steps, now);
    prom_per_rank(m, &b, "dtrain_cpu_seconds_total", "counter",
                  "CPU time the rank's process used since profiling started.", f_cpu, now);
    prom_per_rank(m, &b, "dtrain_cpu_wait_seconds_total", "counter",
                  "Time its threads waited runnable for a CPU (the scheduler's run queue).",
                  f_cpu_wait, now);
    prom_per_rank(m, &b, "dtrain_cpu_throttled_seconds_total", "counter",
                  "Time its cgroup's CPU quota held it back (cpu.stat).", f_throttled, now);
    prom_per_rank(m, &b, "dtrain_warnings_total", "counter",
                  "Warnings the rank's context gave (dt_last_warning; the page shows the latest).",
                  f_warnings, now);
    prom_per_rank(m, &b, "dtrain_step_seconds_total", "counter",
                  "Wall time of the rank's training steps.", f_step_s, now);
    prom_head(&b, "dtrain_step_phase_seconds_total", "counter",
              "Time of the rank's training steps by phase; the phases add up to the steps.");
    for (int r = 0; r < m->world; r++)
        for (int k = 0; k < PH_COUNT; k++)
            strbuf_printf(&b, "dtrain_step_phase_seconds_total{rank=\"%d\",phase=\"%s\"} %.9g\n", r,
                          mon_phase_key[k], m->ranks[r].cur.phase[k]);
    prom_per_rank(m, &b, "dtrain_samples_total", "counter", "Samples the rank's loaders gave its steps.",
                  f_samples, now);
    prom_per_rank(m, &b, "dtrain_samples_per_second", "gauge",
                  "The rank's samples per second over the last interval.", f_sps, now);
    prom_per_rank(m, &b, "dtrain_collective_bytes_total", "counter",
                  "Payload bytes of the rank's collectives.", f_bytes, now);
    prom_per_rank(m, &b, "dtrain_collectives_total", "counter", "Collectives the rank ran.", f_colls,
                  now);
    prom_per_rank(m, &b, "dtrain_collective_bus_bandwidth_bytes_per_second", "gauge",
                  "Bytes-weighted bus bandwidth of the rank's collectives.", f_busbw, now);
    prom_per_rank(m, &b, "dtrain_communication_seconds_total", "counter",
                  "Time the rank's collectives ran on its comm thread, hidden or not.", f_comm, now);
    prom_per_rank(m, &b, "dtrain_exposed_communication_seconds_total", "counter",
                  "Time the rank's steps waited for communication.", f_exposed, now);
    prom_per_rank(m, &b, "dtrain_parameter_gather_seconds_total", "counter",
                  "Time a sharded DDP's parameter all-gathers ran (dt_ddp_config.zero).", f_gather,
                  now);
    prom_per_rank(m, &b, "dtrain_parameter_gather_exposed_seconds_total", "counter",
                  "Of it, the time the rank's training waited for (zero 3: what prefetch did not "
                  "hide).", f_gather_exp, now);
    prom_per_rank(m, &b, "dtrain_straggler", "gauge",
                  "1 when the rank computes more than 15% above the median per sample.", f_strag, now);
    prom_per_rank(m, &b, "dtrain_ps_requests_total", "counter",
                  "Parameter-server pushes and pulls of the rank.", f_ps_calls, now);
    prom_per_rank(m, &b, "dtrain_ps_latency_seconds_total", "counter",
                  "Total latency of the rank's parameter-server calls.", f_ps_lat, now);
    prom_per_rank(m, &b, "dtrain_ps_staleness_max", "gauge",
                  "The largest staleness (steps) of the parameters the rank pulled.", f_ps_max, now);
    prom_per_rank(m, &b, "dtrain_ps_staleness_mean", "gauge",
                  "The mean staleness (steps) of the parameters the rank pulled.", f_ps_mean, now);
    prom_per_rank(m, &b, "dtrain_ps_server_seconds_total", "counter",
                  "Wall time a parameter server rank has served.", f_sv_serve, now);
    prom_per_rank(m, &b, "dtrain_ps_server_busy_seconds_total", "counter",
                  "Of it, time handling requests and applying steps.", f_sv_busy, now);
    prom_per_rank(m, &b, "dtrain_ps_server_stalled_seconds_total", "counter",
                  "Of it, time the server did not run when it should have (stopped or starved).",
                  f_sv_stalled, now);
    prom_per_rank(m, &b, "dtrain_ps_server_requests_total", "counter",
                  "Requests a parameter server answered or applied.", f_sv_served, now);
    prom_per_rank(m, &b, "dtrain_ps_server_received_bytes_total", "counter",
                  "Bytes a parameter server received.", f_sv_in, now);
    prom_per_rank(m, &b, "dtrain_ps_server_sent_bytes_total", "counter",
                  "Bytes a parameter server sent.", f_sv_out, now);
    prom_per_rank(m, &b, "dtrain_ps_server_queue_max", "gauge",
                  "The most requests waiting at a parameter server at once.", f_sv_queue, now);
    prom_per_rank(m, &b, "dtrain_ps_server_keys", "gauge",
                  "Floats a parameter server holds.", f_sv_keys, now);
    prom_scalars(m, &b);
    if (b.oom) {
        host_free(m->errors, b.p);
        return NULL;
    }
    return b.p;
}

/* Rank 0, each interval: read, diagnose, render, wake the streams. */
static void mon_update(dt_monitor *m)
{
    double now = dt_now();
    for (int r = 0; r < m->world; r++)
        mon_read_rank(m, r, now);
    mon_diagnose(m);
    mon_add_point(m, now);
    char *state = mon_render_state(m, now, 1), *live = mon_render_state(m, now, 0);
    char *metrics = mon_render_metrics(m, now);
    pthread_mutex_lock(&m->mu);
    if (state && live) {
        host_free(m->errors, m->state);
        host_free(m->errors, m->live);
        m->state = state;
        m->live = live;
    } else {
        host_free(m->errors, state);
        host_free(m->errors, live);
    }
    if (metrics) {
        host_free(m->errors, m->metrics);
        m->metrics = metrics;
    }
    m->version++;
    pthread_cond_broadcast(&m->cv);
    pthread_mutex_unlock(&m->mu);
}

/* Every other rank, each interval: its line into the store. */
static void mon_publish(dt_monitor *m)
{
    mon_summary s;
    char key[32], line[MON_LINE];
    mon_take(m, &s);
    if (!m->store || !mon_encode(&s, line, sizeof line))
        return;
    snprintf(key, sizeof key, "mon/%d", m->rank);
    dt_store_set(m->store, key, line, strlen(line));   /* a failure: the next interval tries again */
}

static void *mon_thread(void *arg)
{
    dt_monitor *m = arg;
    for (;;) {
        if (m->rank == 0)
            mon_update(m);
        else
            mon_publish(m);
        pthread_mutex_lock(&m->mu);
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        double ns = until.tv_nsec + m->cfg.interval_s * 1e9;
        until.tv_sec += (time_t)(ns / 1e9);
        until.tv_nsec = (long)fmod(ns, 1e9);
        while (!m->stop && pthread_cond_timedwait(&m->cv, &m->mu, &until) == 0) {
        }
        int stop = m->stop;
        pthread_mutex_unlock(&m->mu);
        if (stop)
            return NULL;
    }
}

/* --- HTTP ------------------------------------------------------------------ */

/* A stream: the version it sent last, and what of it is still to go. */
typedef struct mon_stream {
    uint64_t sent;
    char *pending;
    size_t len, off, cap;
} mon_stream;

static char *mon_copy(dt_monitor *m, const char *text, size_t *len)
{
    *len = text ? strlen(text) : 0;
    char *c = host_alloc(m->errors, *len + 1);
    if (c)
        memcpy(c, text ? text : "", *len + 1);
    return c;
}

static void mon_request(void *user, const char *path, const char *token, dt_http_reply *out)
{
    dt_monitor *m = user;
    out->status = 200;
    if (m->need_token && (!token || strlen(token) != strlen(m->token) ||
                          memcmp(token, m->token, strlen(m->token)) != 0)) {
        out->status = 401;
        out->type = "text/plain; charset=utf-8";
        out->body = mon_copy(m, "the job token is required (Authorization: Bearer T, or ?token=T)\n",
                             &out->len);
        return;
    }
    pthread_mutex_lock(&m->mu);
    if (strcmp(path, "/") == 0) {
        out->type = "text/html; charset=utf-8";
        out->body = mon_copy(m, mon_page, &out->len);
    } else if (strcmp(path, "/api/state") == 0) {
        out->type = "application/json";
        out->body = mon_copy(m, m->state ? m->state : "{}", &out->len);
    } else if (strcmp(path, "/metrics") == 0) {
        out->type = "text/plain; version=0.0.4; charset=utf-8";
        out->body = mon_copy(m, m->metrics, &out->len);
    } else if (strcmp(path, "/events") == 0) {
        mon_stream *st = host_calloc(m->errors, sizeof *st);
        out->type = "text/event-stream";
        out->stream = st;
        if (!st) {
            out->status = 503;
            out->type = "text/plain";
        }
    } else {
        out->status = 404;
        out->type = "text/plain; charset=utf-8";
        out->body = mon_copy(m, "not found: /, /api/state, /events, /metrics\n", &out->len);
    }
    pthread_mutex_unlock(&m->mu);
    if (!out->stream && !out->body) {
        out->status = 503;
        out->type = "text/plain";
    }
}

static void mon_free_body(void *user, char *body) { host_free(((dt_monitor *)user)->errors, body); }

/* The rest of the event being sent; else the next state, as an event,
 * once it is newer than the last sent; a comment every 2 s meanwhile
 * (keeps the connection, finds a gone client); the end when the monitor
 * stops. */
static long mon_stream_next(void *user, void *stream, char *buf, size_t cap)
{
    dt_monitor *m = user;
    mon_stream *st = stream;
    if (st->off < st->len) {
        size_t n = st->len - st->off < cap ? st->len - st->off : cap;
        memcpy(buf, st->pending + st->off, n);
        st->off += n;
        return m->stop ? -1 : (long)n;
    }
    pthread_mutex_lock(&m->mu);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 2;
    while (!m->stop && (m->version == st->sent || !m->live) &&
           pthread_cond_timedwait(&m->cv, &m->mu, &until) == 0) {
    }
    long n = -1;
    if (!m->stop && (m->version == st->sent || !m->live)) {
        n = snprintf(buf, cap, ": waiting\n\n");
    } else if (!m->stop) {
        size_t len = strlen(m->live) + 9;
        char *ev = len > st->cap ? host_alloc(m->errors, len) : st->pending;
        if (ev) {
            if (ev != st->pending) {
                host_free(m->errors, st->pending);
                st->pending = ev;
                st->cap = len;
            }
            st->len = (size_t)snprintf(ev, len, "data: %s\n\n", m->live);
            st->off = 0;
            st->sent = m->version;
            n = 0;
        }
    }
    pthread_mutex_unlock(&m->mu);
    return n == 0 ? mon_stream_next(user, stream, buf, cap) : n;
}

static void mon_stream_close(void *user, void *stream)
{
    dt_monitor *m = user;
    mon_stream *st = stream;
    host_free(m->errors, st->pending);
    host_free(m->errors, st);
}

/* --- starting and stopping ------------------------------------------------ */

/* "[host:]port" into host (an IPv4 address; "localhost" is 127.0.0.1) and
 * port; 0 when it is not that. */
static int mon_parse_listen(const char *listen, char *host, size_t cap, int *port)
{
    const char *colon = strrchr(listen, ':');
    const char *ps = colon ? colon + 1 : listen;
    char *end;
    long p = strtol(ps, &end, 10);
    if (*ps == '\0' || *end != '\0' || p < 0 || p > 65535)
        return 0;
    *port = (int)p;
    size_t hl = colon ? (size_t)(colon - listen) : 0;
    if (hl >= cap)
        return 0;
    if (!colon || hl == 0 || (hl == 9 && strncmp(listen, "localhost", 9) == 0))
        snprintf(host, cap, "127.0.0.1");
    else
        snprintf(host, cap, "%.*s", (int)hl, listen);
    struct in_addr a;
    return inet_pton(AF_INET, host, &a) == 1;
}

static const dt_http_iface *mon_find_http(void)
{
#ifdef DT_WITH_HTTP
    return dt_http_mhd_iface();
#else
    return NULL;
#endif
}

/* Rank 0: the server, on cfg's address. */
static dt_status mon_serve(dt_monitor *m)
{
    dt_ctx *ctx = m->ctx;
    const char *listen = m->cfg.listen ? m->cfg.listen : getenv("DTRAIN_MONITOR");
    char host[64];
    int port = 0;
    if (!listen || !*listen)
        listen = "127.0.0.1:0";
    if (!mon_parse_listen(listen, host, sizeof host, &port))
        return set_error(ctx, DT_EINVAL, "monitor: '%s' is not [host:]port with an IPv4 host", listen);
    const char *token = m->cfg.token ? m->cfg.token : getenv("DTRAIN_JOB_TOKEN");
    snprintf(m->token, sizeof m->token, "%s", token ? token : "");
    m->need_token = strncmp(host, "127.", 4) != 0;
    if (m->need_token && !m->token[0])
        return set_error(ctx, DT_EINVAL, "monitor: serving on %s (not loopback) needs a token "
                         "(dt_monitor_config.token or DTRAIN_JOB_TOKEN)", host);
    if (!(m->http = mon_find_http()))
        return set_error(ctx, DT_ENOTSUP, "monitor: no HTTP server compiled in (build with "
                         "backends/http.c, -DDT_WITH_HTTP and -lmicrohttpd)");
    dt_http_params hp = {host, port, MON_MAX_CONNECTIONS, MON_MAX_REQUEST, 10};
    dt_http_handler h = {m, mon_request, mon_free_body, mon_stream_next, mon_stream_close};
    char err[256] = "";
    dt_status s = m->http->start(&hp, &h, &m->srv, err, sizeof err);
    if (s != DT_OK)
        return set_error(ctx, s, "monitor: %s", err);
    m->port = m->http->port(m->srv);
    return DT_OK;
}

/* A store connection of the monitor's own: its thread must not share the
 * communicator's. */
static dt_status mon_connect(dt_monitor *m)
{
    if (!(m->store = join_own_store(m->comm, m->errors)))
        return set_error(m->ctx, m->errors->last_status, "monitor: %s", m->errors->err);
    return DT_OK;
}

dt_monitor *dt_monitor_new(dt_ctx *ctx, dt_comm *c, const dt_monitor_config *cfg)
{
    if (!ctx_ok(ctx))
        return NULL;
    if (c && comm_ctx(c) != ctx) {
        set_error(ctx, DT_EINVAL, "monitor_start: the communicator belongs to another context");
        return NULL;
    }
    dt_monitor_config own;
    dt_monitor_config_init(&own);
    if (cfg && ctx_config_in(ctx, &own, sizeof own, cfg,
                             "monitor_start", "dt_monitor_config") != DT_OK)
        return NULL;
    dt_monitor *m = host_calloc(ctx, sizeof *m);
    if (!m) {
        set_error(ctx, DT_ENOMEM, "monitor_start: out of memory");
        return NULL;
    }
    m->ctx = ctx;
    m->comm = c;
    m->rank = c ? dt_comm_rank(c) : 0;
    m->world = c ? dt_comm_size(c) : 1;
    m->cfg = own;
    if (!(m->cfg.interval_s > 0))
        m->cfg.interval_s = 1.0;
    m->slowest = m->straggler = m->slow_server = m->cpu_starved = m->loader_bottleneck = -1;
    m->t0 = dt_now();
    pthread_mutex_init(&m->mu, NULL);
    pthread_cond_init(&m->cv, NULL);
    dt_status s = DT_OK;
    if (!(m->errors = ctx_new_sink(ctx)))
        s = set_error(ctx, DT_ENOMEM, "monitor_start: out of memory");
    if (s == DT_OK && m->rank == 0 &&
        (!(m->ranks = host_calloc(ctx, sizeof *m->ranks * (size_t)m->world)) ||
         !(m->hist = host_calloc(ctx, sizeof *m->hist * MON_HISTORY))))
        s = set_error(ctx, DT_ENOMEM, "monitor_start: out of memory");
    if (s == DT_OK && !dt_profile_active(ctx))
        s = dt_profile_start(ctx, NULL);
    if (s == DT_OK && c && dt_comm_size(c) > 1)
        s = mon_connect(m);
    if (s == DT_OK && m->rank == 0)
        s = mon_serve(m);
    if (s == DT_OK) {
        if (pthread_create(&m->tid, NULL, mon_thread, m) != 0)
            s = set_error(ctx, DT_ENOMEM, "monitor_start: cannot start its thread");
        else
            m->started = 1;
    }
    if (s != DT_OK) {
        dt_monitor_free(m);
        return NULL;
    }
    return m;
}

dt_status dt_monitor_log(dt_monitor *m, const char *name, int64_t step, double value)
{
    if (!m || !name)
        return DT_EINVAL;
    if (!mon_name_ok(name))
        return set_error(m->ctx, DT_EINVAL, "monitor_log: '%s' is not a name of letters, digits "
                         "and '_' (at most %d)", name, MON_NAME - 1);
    pthread_mutex_lock(&m->mu);
    int i = 0;
    while (i < m->nscalars && strcmp(m->sname[i], name) != 0)
        i++;
    dt_status s = DT_OK;
    if (i == MON_SCALARS) {
        s = DT_EINVAL;
    } else {
        if (i == m->nscalars) {
            snprintf(m->sname[i], MON_NAME, "%s", name);
            m->nscalars++;
        }
        m->sat[i] = step;
        m->svalue[i] = value;
    }
    pthread_mutex_unlock(&m->mu);
    if (s != DT_OK)
        return set_error(m->ctx, s, "monitor_log: at most %d names ('%s' is one more)", MON_SCALARS,
                         name);
    return DT_OK;
}

int dt_monitor_port(const dt_monitor *m) { return m && m->srv ? m->port : -1; }

void dt_monitor_free(dt_monitor *m)
{
    if (!m)
        return;
    pthread_mutex_lock(&m->mu);
    m->stop = 1;
    pthread_cond_broadcast(&m->cv);
    pthread_mutex_unlock(&m->mu);
    if (m->started)
        pthread_join(m->tid, NULL);
    if (m->srv)
        m->http->stop(m->srv);   /* its streams see stop and end */
    dt_store_free(m->store);
    dt_ctx *ctx = m->ctx;
    if (m->errors) {
        host_free(ctx, m->state);
        host_free(ctx, m->live);
        host_free(ctx, m->metrics);
    }
    host_free(ctx, m->errors);
    host_free(ctx, m->ranks);
    host_free(ctx, m->hist);
    pthread_cond_destroy(&m->cv);
    pthread_mutex_destroy(&m->mu);
    host_free(ctx, m);
}
