#include "dist.h"

/* ===========================================================================
 * Graceful pre-emption
 *
 * A scheduler that takes the machines back sends SIGTERM (Slurm's
 * pre-emption and scancel, Kubernetes, a spot notice), or with Slurm's
 * --signal=USR1@120 a warning first.  dt_preempt_enable catches those
 * signals; the handler only records which one came (preempt_got).  Each
 * step then votes (preempt_vote, a one-float MAX allreduce: the DDP does it
 * after the step's gradients, dt_preempt_agree for other loops), so every
 * rank learns at the same step that the job must stop, saves its part of
 * the checkpoint and leaves with DT_EXIT_PREEMPTED (75, sysexits'
 * EX_TEMPFAIL: "try again"), which dtrun passes on and restarts from.
 *
 * A signal's arrival is process state by nature (the kernel keeps one
 * disposition per signal for the whole process), so the one word the
 * handler writes is the library's only static mutable state; a context
 * reads it only once pre-emption is enabled on it.  A second signal of
 * the set (2 s or more after the first: PREEMPT_SAME_NOTICE_MS) takes the
 * default action at once: a user's second Ctrl-C, or a scheduler that has
 * waited long enough, still ends the process promptly.
 * ======================================================================== */

static volatile sig_atomic_t preempt_got;   /* the first signal received; 0: none */
static volatile sig_atomic_t preempt_got_ms; /* when (CLOCK_MONOTONIC ms, 30 bits) */

/* One notice often arrives twice: Slurm's scancel signals every process
 * of the step, dtrun included, which passes it on to its ranks.  A repeat
 * within this long is the same notice; a later one is a second signal. */
#define PREEMPT_SAME_NOTICE_MS 2000

static int preempt_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);   /* async-signal-safe */
    return (int)(((int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000) & 0x3fffffff);
}

static void preempt_on_signal(int sig)
{
    int now = preempt_now_ms();
    if (preempt_got == 0) {
        preempt_got_ms = now;
        preempt_got = sig;
        return;
    }
    if (((now - preempt_got_ms) & 0x3fffffff) < PREEMPT_SAME_NOTICE_MS)
        return;
    signal(sig, SIG_DFL);   /* the second: what the signal does without us */
    raise(sig);
}

/* A context's pre-emption state (its CTX_EXT_PREEMPT slot), made by
 * dt_preempt_enable, by a parameter server's worker, or by a server that
 * agrees a stop without enabling; none: nothing enabled or agreed. */
typedef struct preempt_state {
    int on;                    /* dt_preempt_enable was called */
    unsigned signals;          /* DT_PREEMPT_SIG* caught */
    int voted, verdict;        /* this step's vote is in (the DDP's, or the parameter
                                  servers' answer), and its result: the largest signal
                                  number any rank received, 0: none */
    int via_ps;                /* a parameter-server worker: the servers count the vote
                                  (src/ps.c); no allreduce over the communicator */
    int agreed;                /* the job agreed to stop after step */
    int signal;                /* the agreed stop's signal */
    int64_t step;
    double since, saved_s;     /* when it agreed; the checkpoint's seconds (-1: none) */
    char line[128];            /* dt_preempt_report's text */
} preempt_state;

static preempt_state *preempt_of(const dt_ctx *ctx) { return ctx_ext(ctx, CTX_EXT_PREEMPT); }

/* The state, made on first use (NULL: out of memory, the error set). */
static preempt_state *preempt_made(dt_ctx *ctx)
{
    preempt_state *st = preempt_of(ctx);
    if (st)
        return st;
    if (!(st = ctx_ext_make(ctx, CTX_EXT_PREEMPT, sizeof *st, NULL)))
        return NULL;
    st->saved_s = -1;
    return st;
}

static int preempt_on(const dt_ctx *ctx)
{
    const preempt_state *st = preempt_of(ctx);
    return st && st->on;
}

static const int preempt_signals[] = {SIGTERM, SIGUSR1, SIGUSR2, SIGINT};
static const unsigned preempt_bits[] = {DT_PREEMPT_SIGTERM, DT_PREEMPT_SIGUSR1,
                                        DT_PREEMPT_SIGUSR2, DT_PREEMPT_SIGINT};

void dt_preempt_config_init(dt_preempt_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->struct_size = sizeof *cfg;
    cfg->signals = DT_PREEMPT_SIGTERM | DT_PREEMPT_SIGUSR1 | DT_PREEMPT_SIGUSR2;
}

/* DTRAIN_PREEMPT_SIGNALS=TERM,USR1 (names without SIG, or "none"): the
 * operator's choice over the program's. */
static int preempt_signals_from_env(unsigned *out)
{
    const char *e = getenv("DTRAIN_PREEMPT_SIGNALS");
    if (!e || !*e)
        return 1;
    unsigned bits = 0;
    char buf[128];
    snprintf(buf, sizeof buf, "%s", e);
    for (char *save = NULL, *w = strtok_r(buf, ", ", &save); w; w = strtok_r(NULL, ", ", &save)) {
        if (!strncmp(w, "SIG", 3))
            w += 3;
        if (!strcmp(w, "none"))
            continue;
        int known = 0;
        for (size_t i = 0; i < sizeof preempt_bits / sizeof preempt_bits[0]; i++)
            if (!strcmp(w, sigabbrev_np(preempt_signals[i]))) {
                bits |= preempt_bits[i];
                known = 1;
            }
        if (!known)
            return 0;
    }
    *out = bits;
    return 1;
}

/* Our handler for the signal, unless it is already ours. */
static dt_status preempt_install(dt_ctx *ctx, int sig)
{
    struct sigaction sa;
    if (sigaction(sig, NULL, &sa) == 0 && !(sa.sa_flags & SA_SIGINFO) &&
        sa.sa_handler == preempt_on_signal)
        return DT_OK;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = preempt_on_signal;
    sa.sa_flags = SA_RESTART;   /* a read or poll the signal interrupts goes on */
    sigemptyset(&sa.sa_mask);   /* the handlers never nest: preempt_got_ms is written whole */
    for (size_t i = 0; i < sizeof preempt_signals / sizeof preempt_signals[0]; i++)
        sigaddset(&sa.sa_mask, preempt_signals[i]);
    if (sigaction(sig, &sa, NULL) != 0)
        return set_error(ctx, DT_EIO, "preempt_enable: sigaction(%s): %s", sigabbrev_np(sig),
                         strerror(errno));
    return DT_OK;
}

dt_status dt_preempt_enable(dt_ctx *ctx, const dt_preempt_config *cfg_in)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    dt_preempt_config cfg;
    dt_preempt_config_init(&cfg);
    if (cfg_in && ctx_config_in(ctx, &cfg, sizeof cfg, cfg_in, "preempt_enable",
                                "dt_preempt_config") != DT_OK)
        return ctx->last_status;
    unsigned all = DT_PREEMPT_SIGTERM | DT_PREEMPT_SIGUSR1 | DT_PREEMPT_SIGUSR2 | DT_PREEMPT_SIGINT;
    if (cfg.signals & ~all)
        return set_error(ctx, DT_EINVAL, "preempt_enable: signals 0x%x: only DT_PREEMPT_SIG* bits",
                         cfg.signals);
    if (!preempt_signals_from_env(&cfg.signals))
        return set_error(ctx, DT_EINVAL, "preempt_enable: DTRAIN_PREEMPT_SIGNALS='%s': a list of "
                         "TERM, USR1, USR2, INT or none", getenv("DTRAIN_PREEMPT_SIGNALS"));
    for (size_t i = 0; i < sizeof preempt_bits / sizeof preempt_bits[0]; i++)
        if ((cfg.signals & preempt_bits[i]) && preempt_install(ctx, preempt_signals[i]) != DT_OK)
            return ctx->last_status;
    preempt_state *st = preempt_made(ctx);
    if (!st)
        return ctx->last_status;
    st->signals = cfg.signals;
    st->on = 1;
    return DT_OK;
}

/* The transports' libraries may install handlers of their own when they
 * start (libfabric's PSM providers do: backends/fabric.c), after
 * dt_preempt_enable; a new communicator takes the signals back. */
DT_PRIVATE void preempt_reclaim(dt_ctx *ctx)
{
    if (!ctx || !preempt_on(ctx))
        return;
    for (size_t i = 0; i < sizeof preempt_bits / sizeof preempt_bits[0]; i++)
        if (preempt_of(ctx)->signals & preempt_bits[i])
            (void)preempt_install(ctx, preempt_signals[i]);
}

int dt_preempt_signal(const dt_ctx *ctx)
{
    return ctx && preempt_on(ctx) ? (int)preempt_got : 0;
}

/* This rank's own vote: the signal it caught, 0: none (or not enabled). */
DT_PRIVATE int preempt_local(const dt_ctx *ctx)
{
    return preempt_on(ctx) ? (int)preempt_got : 0;
}

/* The step's verdict, counted elsewhere (a parameter server's answer). */
DT_PRIVATE void preempt_take(dt_ctx *ctx, int verdict)
{
    preempt_state *st = preempt_of(ctx);   /* (a worker's: preempt_set_via_ps made it) */
    if (!st)
        return;
    st->voted = 1;
    st->verdict = verdict;
}

DT_PRIVATE dt_status preempt_set_via_ps(dt_ctx *ctx, int on)
{
    preempt_state *st = on ? preempt_made(ctx) : preempt_of(ctx);
    if (!st)
        return on ? ctx->last_status : DT_OK;
    st->via_ps = on;
    return DT_OK;
}

DT_PRIVATE int64_t preempt_stop_step(const dt_ctx *ctx)
{
    const preempt_state *st = preempt_of(ctx);
    return st && st->agreed ? st->step : -1;
}

/* The job agreed to stop after `step` (the first agreement stands). */
DT_PRIVATE dt_status preempt_decide(dt_ctx *ctx, int64_t step, int verdict)
{
    if (verdict <= 0 || preempt_stop_step(ctx) >= 0)
        return DT_OK;
    preempt_state *st = preempt_made(ctx);   /* a server may agree without enabling */
    if (!st)
        return ctx->last_status;
    st->agreed = 1;
    st->step = step;
    st->signal = verdict;
    st->since = dt_now();
    return DT_OK;
}

/* The step's vote: every rank's signal (0: none), the largest kept; after
 * it every rank has the same verdict.  Collective over c. */
DT_PRIVATE dt_status preempt_vote(dt_ctx *ctx, dt_comm *c)
{
    preempt_state *st = preempt_of(ctx);
    if (!st || !st->on)
        return DT_OK;
    if (st->via_ps)   /* the servers are in dt_ps_serve: no allreduce with them */
        return set_error(ctx, DT_ENOTSUP, "preempt_agree: with a parameter server the vote rides "
                         "on each step's push and pull: BSP without prefetch, dt_preempt_agree "
                         "after dt_ps_push_pull or dt_ddp_step");
    float v = (float)preempt_got;
    if (c && dt_comm_size(c) > 1 && dt_comm_allreduce(c, &v, 1, DT_REDUCE_MAX) != DT_OK)
        return set_error(ctx, ctx->last_status, "preempt: the step's vote failed: %s", ctx->err);
    st->voted = 1;
    st->verdict = (int)v;
    return DT_OK;
}

dt_status dt_preempt_agree(dt_ctx *ctx, dt_comm *c, int64_t step, int *stop)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (!stop)
        return set_error(ctx, DT_EINVAL, "preempt_agree: stop is NULL");
    *stop = 0;
    preempt_state *st = preempt_of(ctx);
    if (!st || !st->on)
        return DT_OK;
    if (!st->voted && preempt_vote(ctx, c) != DT_OK)
        return ctx->last_status;
    st->voted = 0;   /* the next step votes again */
    *stop = st->verdict > 0;
    return preempt_decide(ctx, step, st->verdict);
}

dt_status dt_preempt_saved(dt_ctx *ctx, double seconds)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    preempt_state *st = preempt_of(ctx);
    if (preempt_stop_step(ctx) < 0)
        return set_error(ctx, DT_ESTATE, "preempt_saved: the job has not agreed to stop "
                         "(dt_preempt_agree)");
    st->saved_s = seconds >= 0 ? seconds : dt_now() - st->since;
    return DT_OK;
}

/* "pre-empted at step N (SIGTERM), checkpoint saved in S s"; "" when the
 * job was not pre-empted.  The profile's report ends with it. */
DT_PRIVATE void preempt_line(const dt_ctx *ctx, char *out, size_t cap)
{
    out[0] = '\0';
    const preempt_state *st = preempt_of(ctx);
    if (preempt_stop_step(ctx) < 0)
        return;
    const char *name = sigabbrev_np(st->signal);
    if (st->saved_s >= 0)
        snprintf(out, cap, "pre-empted at step %lld (SIG%s), checkpoint saved in %.2f s",
                 (long long)st->step, name ? name : "?", st->saved_s);
    else
        snprintf(out, cap, "pre-empted at step %lld (SIG%s), no checkpoint saved",
                 (long long)st->step, name ? name : "?");
}

const char *dt_preempt_report(dt_ctx *ctx)
{
    preempt_state *st = ctx ? preempt_of(ctx) : NULL;
    if (!st)
        return "";
    preempt_line(ctx, st->line, sizeof st->line);
    return st->line;
}
