#include "internal.h"

/* ===========================================================================
 * Errors and the context
 *
 * Every failure goes through set_error, which keeps the status and a message
 * in the context (never a global).  Functions that return a handle return
 * NULL and leave the message; ops given a NULL input return NULL without
 * overwriting the message of the op that failed first.
 * ======================================================================== */

int dt_version(void)
{
    return DTRAIN_VERSION_MAJOR * 10000 + DTRAIN_VERSION_MINOR * 100 + DTRAIN_VERSION_PATCH;
}

const char *dt_version_string(void) { return DTRAIN_VERSION_STRING; }

size_t dt_struct_size(const char *name)
{
    static const struct {
        const char *name;
        size_t size;
    } sizes[] = {
        {"dt_allocator", sizeof(dt_allocator)},
        {"dt_ctx_config", sizeof(dt_ctx_config)},
        {"dt_mem_stats", sizeof(dt_mem_stats)},
        {"dt_optim_config", sizeof(dt_optim_config)},
        {"dt_param_group", sizeof(dt_param_group)},
        {"dt_schedule", sizeof(dt_schedule)},
        {"dt_loss_scale_config", sizeof(dt_loss_scale_config)},
        {"dt_checkpoint_config", sizeof(dt_checkpoint_config)},
        {"dt_checkpoint_report", sizeof(dt_checkpoint_report)},
        {"dt_sample_field", sizeof(dt_sample_field)},
        {"dt_csv_config", sizeof(dt_csv_config)},
        {"dt_token_config", sizeof(dt_token_config)},
        {"dt_loader_config", sizeof(dt_loader_config)},
        {"dt_dist_env", sizeof(dt_dist_env)},
        {"dt_store_config", sizeof(dt_store_config)},
        {"dt_comm_config", sizeof(dt_comm_config)},
        {"dt_spawn_config", sizeof(dt_spawn_config)},
        {"dt_preempt_config", sizeof(dt_preempt_config)},
        {"dt_ddp_config", sizeof(dt_ddp_config)},
        {"dt_ddp_stats", sizeof(dt_ddp_stats)},
        {"dt_dp_config", sizeof(dt_dp_config)},
        {"dt_hogwild_config", sizeof(dt_hogwild_config)},
        {"dt_hogwild_stats", sizeof(dt_hogwild_stats)},
        {"dt_eval_config", sizeof(dt_eval_config)},
        {"dt_metrics", sizeof(dt_metrics)},
        {"dt_ps_table", sizeof(dt_ps_table)},
        {"dt_ps_config", sizeof(dt_ps_config)},
        {"dt_ps_stats", sizeof(dt_ps_stats)},
        {"dt_profile_config", sizeof(dt_profile_config)},
        {"dt_profile_stats", sizeof(dt_profile_stats)},
        {"dt_pipe_config", sizeof(dt_pipe_config)},
        {"dt_pipe_stats", sizeof(dt_pipe_stats)},
        {"dt_monitor_config", sizeof(dt_monitor_config)}};
    for (size_t i = 0; name && i < sizeof sizes / sizeof sizes[0]; i++)
        if (strcmp(name, sizes[i].name) == 0)
            return sizes[i].size;
    return 0;
}

const char *dt_strerror(dt_status s)
{
    switch (s) {
    case DT_OK: return "ok";
    case DT_EINVAL: return "invalid argument";
    case DT_ENOMEM: return "out of memory";
    case DT_EIO: return "input/output error";
    case DT_ECORRUPT: return "corrupt or truncated data";
    case DT_EMISMATCH: return "mismatch";
    case DT_ENOTSUP: return "not supported";
    case DT_ESTATE: return "invalid state";
    case DT_ETIMEDOUT: return "timed out";
    case DT_EPEER: return "peer failure";
    case DT_EOF: return "end of data";
    case DT_EPREEMPTED: return "pre-empted";
    }
    return "unknown status";
}

DT_PRIVATE dt_status set_error(dt_ctx *ctx, dt_status s, const char *fmt, ...)
{
    if (!ctx)
        return s;
    char msg[sizeof ctx->err];   /* not in place: callers wrap the last error ("%s", ctx->err) */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    memcpy(ctx->err, msg, sizeof msg);
    ctx->last_status = s;
    ctx->errors++;
    return s;
}

const char *dt_last_error(const dt_ctx *ctx) { return ctx ? ctx->err : "context is NULL"; }
const char *dt_last_warning(const dt_ctx *ctx) { return ctx ? ctx->warning : ""; }

void dt_ctx_set_log(dt_ctx *ctx, dt_log_fn fn, void *user)
{
    if (!ctx)
        return;
    ctx->log_fn = fn;
    ctx->log_user = user;
}
DT_PRIVATE void ctx_warn(dt_ctx *ctx, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    pthread_mutex_lock(&ctx->warn_mu);
    vsnprintf(ctx->warning, sizeof ctx->warning, fmt, ap);
    ctx->warnings++;
    pthread_mutex_unlock(&ctx->warn_mu);
    va_end(ap);
    if (ctx->log_fn)
        ctx->log_fn(ctx->log_user, ctx->warning);
    else if (getenv("DTRAIN_LOG") && *getenv("DTRAIN_LOG"))
        fprintf(stderr, "dtrain: warning: %s\n", ctx->warning);
}
DT_PRIVATE int64_t ctx_warning_copy(dt_ctx *ctx, char *out, size_t cap)
{
    pthread_mutex_lock(&ctx->warn_mu);
    size_t len = cap ? strnlen(ctx->warning, cap - 1) : 0;   /* cut to cap: the caller's choice */
    if (cap) {
        memcpy(out, ctx->warning, len);
        out[len] = '\0';
    }
    int64_t n = ctx->warnings;
    pthread_mutex_unlock(&ctx->warn_mu);
    return n;
}

/* (here, the bottom layer: the context's own activity clock reads it) */
double dt_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static const char *const act_names[ACT_COUNT] = {
    "computing", "waiting for its data loader", "in backward", "in its optimizer step",
    "in a collective", "writing a checkpoint", "reading a checkpoint", "evaluating"};

DT_PRIVATE int ctx_doing(dt_ctx *ctx, int act)
{
    if (!ctx)
        return ACT_COMPUTE;
    int prev = ctx->act;
    if ((prev != ACT_COMPUTE && act == ACT_COLLECTIVE) || prev >= ACT_CKPT_SAVE)
        return prev;   /* a save's (or an evaluation's) own collectives, batches and
                          steps are the save: what peers see, and ctx->aside_s */
    pthread_mutex_lock(&ctx->warn_mu);
    ctx->act = act;
    ctx->act_since = dt_now();
    pthread_mutex_unlock(&ctx->warn_mu);
    return prev;
}

DT_PRIVATE void ctx_done(dt_ctx *ctx, int prev)
{
    if (!ctx || ctx->act == prev)
        return;
    pthread_mutex_lock(&ctx->warn_mu);
    double now = dt_now();
    ctx->aside_s[ctx->act] += now - ctx->act_since;
    ctx->act = prev;
    ctx->act_since = now;
    pthread_mutex_unlock(&ctx->warn_mu);
}

DT_PRIVATE double ctx_aside_s(dt_ctx *ctx, int act)
{
    pthread_mutex_lock(&ctx->warn_mu);
    double s = ctx->aside_s[act];
    pthread_mutex_unlock(&ctx->warn_mu);
    return s;
}

DT_PRIVATE void ctx_activity_copy(dt_ctx *ctx, char *out, size_t cap)
{
    pthread_mutex_lock(&ctx->warn_mu);
    const char *what = ctx->act_user[0] ? ctx->act_user : act_names[ctx->act];
    double s = dt_now() - ctx->act_since;
    if (ctx->act == ACT_COMPUTE && !ctx->act_user[0])
        snprintf(out, cap, "%s", what);
    else
        snprintf(out, cap, "%s for %.0f s", what, s < 0 ? 0.0 : s);
    pthread_mutex_unlock(&ctx->warn_mu);
}

dt_status dt_ctx_set_activity(dt_ctx *ctx, const char *what)
{
    if (!ctx)
        return DT_EINVAL;
    pthread_mutex_lock(&ctx->warn_mu);
    size_t n = what ? strnlen(what, sizeof ctx->act_user - 1) : 0;
    memcpy(ctx->act_user, what ? what : "", n);
    ctx->act_user[n] = '\0';
    for (size_t i = 0; i < n; i++)   /* one line: peers and the monitor print it */
        if ((unsigned char)ctx->act_user[i] < ' ')
            ctx->act_user[i] = ' ';
    ctx->act_since = dt_now();
    pthread_mutex_unlock(&ctx->warn_mu);
    return DT_OK;
}

const char *dt_ctx_activity(dt_ctx *ctx)
{
    if (!ctx)
        return "";
    ctx_activity_copy(ctx, ctx->act_text, sizeof ctx->act_text);
    return ctx->act_text;
}

dt_status dt_last_status(const dt_ctx *ctx) { return ctx ? ctx->last_status : DT_EINVAL; }
dt_status dt_ctx_status(const dt_ctx *ctx) { return ctx ? ctx->init_status : DT_EINVAL; }

void dt_clear_error(dt_ctx *ctx)
{
    if (!ctx)
        return;
    ctx->err[0] = '\0';
    ctx->last_status = DT_OK;
}

static void *libc_malloc(size_t n, void *u) { (void)u; return malloc(n); }
static void *libc_realloc(void *p, size_t n, void *u) { (void)u; return realloc(p, n); }
static void libc_free(void *p, void *u) { (void)u; free(p); }

DT_PRIVATE void *host_alloc(dt_ctx *ctx, size_t n) { return ctx->al.malloc_fn(n ? n : 1, ctx->al.user); }

/* Large blocks were just freed (an arena consolidated, a sharded DDP's
 * memory given up): with the C library's allocator, hand the free pages
 * inside its heap back to the system, which glibc otherwise keeps mapped
 * (measured: a 256 MiB arena chunk freed in the heap stayed resident for
 * the whole run of tests/bench/zero.sh).  A caller's own allocator is its
 * business. */
DT_PRIVATE void host_give_back(dt_ctx *ctx)
{
#ifdef __GLIBC__
    if (ctx->al.malloc_fn == libc_malloc)
        malloc_trim(0);
#else
    (void)ctx;
#endif
}
DT_PRIVATE void host_free(dt_ctx *ctx, void *p) { if (p) ctx->al.free_fn(p, ctx->al.user); }

DT_PRIVATE void *host_calloc(dt_ctx *ctx, size_t n)
{
    void *p = host_alloc(ctx, n);
    if (p)
        memset(p, 0, n);
    return p;
}

DT_PRIVATE char *host_strdup(dt_ctx *ctx, const char *s)
{
    size_t n = strlen(s) + 1;
    char *p = host_alloc(ctx, n);
    if (p)
        memcpy(p, s, n);
    return p;
}

void dt_ctx_config_init(dt_ctx_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->struct_size = sizeof *cfg;
    cfg->backend = "cpu";
    cfg->threads = 1;
    cfg->seed = 0;
    cfg->arena_bytes = DT_DEFAULT_ARENA_BYTES;
}

/* Read a caller's config struct (cfg) into own (own_size bytes, holding
 * the *_init defaults) by the rule in dtrain.h ("Config structs"): its
 * first struct_size bytes replace the defaults; 0 (said in why, for fn
 * and the struct's type name) when it skipped its *_init, or comes from a
 * newer header with fields set past own_size.  Beyond own_size + 4096
 * bytes no header could have grown: refused unread, as corrupt. */
DT_PRIVATE int ctx_config_read(void *own, size_t own_size, const void *cfg, const char *fn,
                               const char *type, char *why, size_t cap)
{
    size_t given;
    memcpy(&given, cfg, sizeof given);
    if (given < sizeof given || given > own_size + 4096) {
        snprintf(why, cap, "%s: the %s's struct_size is %zu: fill it with %s_init first (this "
                 "library's %s is %zu bytes)", fn, type, given, type, type, own_size);
        return 0;
    }
    for (size_t i = own_size; i < given; i++)
        if (((const unsigned char *)cfg)[i]) {
            snprintf(why, cap, "%s: the %s is %zu bytes with fields set past this library's %zu "
                     "(dtrain %s): the program was built against a newer dtrain.h; build it "
                     "against this one, or use the newer library", fn, type, given, own_size,
                     DTRAIN_VERSION_STRING);
            return 0;
        }
    memcpy(own, cfg, given < own_size ? given : own_size);
    memcpy(own, &own_size, sizeof own_size);   /* the struct is now this library's size */
    return 1;
}

/* ctx_config_read for a function with a context: the refusal is its error. */
DT_PRIVATE dt_status ctx_config_in(dt_ctx *ctx, void *own, size_t own_size, const void *cfg,
                                   const char *fn, const char *type)
{
    char why[320];
    if (!ctx_config_read(own, own_size, cfg, fn, type, why, sizeof why))
        return set_error(ctx, DT_EINVAL, "%s", why);
    return DT_OK;
}

/* The backends compiled into this build.  The list is const: choosing one is
 * a lookup, not a registration, so there is no global mutable state. */
DT_PRIVATE const dt_backend_iface *ctx_find_backend(const char *name)
{
#ifdef DT_WITH_CPU
    if (strcmp(name, "cpu") == 0)
        return dt_backend_cpu_iface();
    if (strcmp(name, "cpu-staged") == 0)
        return dt_backend_cpu_staged_iface();
#endif
#ifdef DT_WITH_CUDA
    if (strcmp(name, "cuda") == 0)
        return dt_backend_cuda_iface();
#endif
    (void)name;
    return NULL;
}

static const char *compiled_backends(void)
{
#if defined(DT_WITH_CPU) && defined(DT_WITH_CUDA)
    return "cpu, cuda";
#elif defined(DT_WITH_CPU)
    return "cpu; cuda loads from " DT_CUDA_PLUGIN " when asked for";
#elif defined(DT_WITH_CUDA)
    return "cuda";
#else
    return "none: build with backends/cpu.c and -DDT_WITH_CPU";
#endif
}

/* The CUDA backend, when it is not compiled in, is a shared object loaded
 * when a context asks for "cuda" (as ggml loads its backends): a CPU program
 * never maps cuBLAS and the CUDA runtime (~150 MB of its RSS), and starts
 * on a machine without them.  Tried in order: $DTRAIN_CUDA_LIB; the
 * directory of the library or program this code is in; the loader's own
 * search (LD_LIBRARY_PATH, RUNPATH, the system's directories).  Each
 * context holds its own handle (dlopen counts them), closed in
 * dt_ctx_free.  NULL with the reasons in why when none loads. */
static void *open_plugin(const char *path, char *why, size_t len)
{
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);   /* CUDA does not unload */
    if (!h) {
        size_t used = strlen(why);
        const char *e = dlerror();
        snprintf(why + used, len - used, "%s%s", used ? "; " : "", e ? e : path);
    }
    return h;
}

static void *load_cuda_plugin(char *why, size_t len)
{
    const char *env = getenv("DTRAIN_CUDA_LIB");
    if (env && *env)
        return open_plugin(env, why, len);
    void *h = NULL;
    Dl_info self;
    char path[PATH_MAX];
    if (dladdr((void *)load_cuda_plugin, &self) && self.dli_fname && strchr(self.dli_fname, '/')) {
        const char *slash = strrchr(self.dli_fname, '/');
        snprintf(path, sizeof path, "%.*s/%s", (int)(slash - self.dli_fname), self.dli_fname,
                 DT_CUDA_PLUGIN);
        h = open_plugin(path, why, len);
    }
    return h ? h : open_plugin(DT_CUDA_PLUGIN, why, len);
}

static const dt_backend_iface *load_backend(dt_ctx *ctx, const char *name, char *why, size_t len)
{
    why[0] = '\0';
    if (strcmp(name, "cuda") != 0)
        return NULL;
    void *h = load_cuda_plugin(why, len);
    if (!h)
        return NULL;
    const dt_backend_iface *(*get)(void) =
        (const dt_backend_iface *(*)(void))dlsym(h, "dt_backend_cuda_iface");
    if (!get) {
        snprintf(why, len, "%s has no dt_backend_cuda_iface", DT_CUDA_PLUGIN);
        dlclose(h);
        return NULL;
    }
    ctx->be_plugin = h;
    return get();
}

DT_PRIVATE void ctx_arena_init(dt_arena *a, int on_device, size_t min_chunk)
{
    memset(a, 0, sizeof *a);
    a->on_device = on_device;
    a->min_chunk = min_chunk;
}
void dt_ctx_seed(dt_ctx *ctx, uint64_t seed);

dt_ctx *dt_ctx_new(const dt_ctx_config *cfg_in)
{
    dt_ctx_config cfg;
    dt_ctx_config_init(&cfg);
    char bad_cfg[320] = "";   /* a refused cfg_in: a context of defaults that says why */
    if (cfg_in && !ctx_config_read(&cfg, sizeof cfg, cfg_in, "ctx_new", "dt_ctx_config", bad_cfg,
                                   sizeof bad_cfg))
        dt_ctx_config_init(&cfg);
    dt_allocator al = cfg.allocator;
    if (!al.malloc_fn || !al.free_fn || !al.realloc_fn) {
        /* all three hooks or none: mixing allocators would free foreign memory */
        if (!(al.malloc_fn && al.free_fn && al.realloc_fn)) {
            al.malloc_fn = libc_malloc;
            al.realloc_fn = libc_realloc;
            al.free_fn = libc_free;
            al.user = NULL;
        }
    }
    dt_ctx *ctx = al.malloc_fn(sizeof *ctx, al.user);
    if (!ctx)
        return NULL;
    memset(ctx, 0, sizeof *ctx);
    pthread_mutex_init(&ctx->warn_mu, NULL);
    ctx->act_since = dt_now();
    ctx->al = al;
    ctx->threads = cfg.threads > 0 ? cfg.threads : 1;
    ctx->grad_enabled = 1;
    ctx->training = 1;
    size_t arena_bytes = cfg.arena_bytes ? cfg.arena_bytes : DT_DEFAULT_ARENA_BYTES;
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    ctx->arena_max = cfg.arena_max_bytes ? cfg.arena_max_bytes
                     : pages > 0 && page > 0 ? (size_t)pages * (size_t)page : SIZE_MAX;
    ctx_arena_init(&ctx->dev, 1, arena_bytes);
    ctx_arena_init(&ctx->host, 0, (size_t)256 << 10);
    ctx_arena_init(&ctx->scratch_dev, 1, arena_bytes / 4 + DT_ARENA_ALIGN);
    ctx_arena_init(&ctx->scratch_host, 0, (size_t)64 << 10);
    ctx->cur_dev = &ctx->dev;
    ctx->cur_host = &ctx->host;
    dt_ctx_seed(ctx, cfg.seed);
    prof_init(ctx);

    if (bad_cfg[0]) {
        ctx->init_status = set_error(ctx, DT_EINVAL, "%s", bad_cfg);
        return ctx;
    }
    /* DTRAIN_BACKEND runs an unchanged program on another backend (e.g. the
     * test suite on cpu-staged); a custom backend is never replaced */
    const char *env = getenv("DTRAIN_BACKEND");
    if (env && *env && !cfg.custom_backend)
        cfg.backend = env;
    const char *name = cfg.custom_backend && cfg.custom_backend->name ? cfg.custom_backend->name
                       : cfg.backend                                    ? cfg.backend
                                                                        : "cpu";
    ctx->be_iface = cfg.custom_backend ? cfg.custom_backend : ctx_find_backend(name);
    char why[512] = "";
    if (!ctx->be_iface)
        ctx->be_iface = load_backend(ctx, name, why, sizeof why);
    if (!ctx->be_iface) {
        ctx->init_status =
            why[0] ? set_error(ctx, DT_ENOTSUP, "ctx: backend '%s' cannot be loaded (%s); build "
                               "it with nvcc (./build.sh) or point DTRAIN_CUDA_LIB at it", name, why)
                   : set_error(ctx, DT_ENOTSUP, "ctx: backend '%s' is not compiled in (compiled "
                               "in: %s)", name, compiled_backends());
        return ctx;
    }
    if (ctx->be_iface->version != DT_BACKEND_IFACE_VERSION) {
        ctx->init_status = set_error(ctx, DT_ENOTSUP,
                                     "ctx: backend '%s' has interface version %d, core expects %d",
                                     name, ctx->be_iface->version, DT_BACKEND_IFACE_VERSION);
        return ctx;
    }
    dt_backend_params bp = {ctx->threads, cfg.device, al};
    char msg[256] = "";
    dt_status s = ctx->be_iface->init(&bp, &ctx->be, msg, sizeof msg);
    if (s != DT_OK) {
        ctx->be = NULL;
        ctx->init_status = set_error(ctx, s, "ctx: backend '%s' failed to start: %s", name, msg);
    }
    return ctx;
}

void dt_ctx_free(dt_ctx *ctx)
{
    if (!ctx)
        return;
    if (ctx->hook_user)
        ctx->grad_hooks->ctx_freed(ctx->hook_user);   /* DDP gives the gradients their buffers back */
    prof_release(ctx);
    ctx->tape = NULL;   /* nothing will read the tensors now */
    tensor_free_doomed(ctx);
    while (ctx->persist) {
        dt_tensor *t = ctx->persist;
        t->flags &= ~(unsigned)T_PARAM;   /* the context may free its own */
        dt_tensor_free(t);
    }
    host_free(ctx, ctx->params);
    for (int i = 0; i < CTX_EXT_COUNT; i++) {
        if (ctx->ext[i] && ctx->ext_fini[i])
            ctx->ext_fini[i](ctx, ctx->ext[i]);
        host_free(ctx, ctx->ext[i]);
    }
    arena_destroy(ctx, &ctx->dev);
    arena_destroy(ctx, &ctx->host);
    arena_destroy(ctx, &ctx->scratch_dev);
    arena_destroy(ctx, &ctx->scratch_host);
    if (ctx->be)
        ctx->be_iface->shutdown(ctx->be);
    if (ctx->be_plugin)
        dlclose(ctx->be_plugin);
    pthread_mutex_destroy(&ctx->warn_mu);
    dt_allocator al = ctx->al;
    al.free_fn(ctx, al.user);
}

/* Usable context: not NULL and its backend started. */
DT_PRIVATE void ctx_step_arena_capacity(const dt_ctx *ctx, size_t *dev, size_t *host)
{
    *dev = arena_capacity(&ctx->dev);
    *host = arena_capacity(&ctx->host);
}

DT_PRIVATE void ctx_set_ckpt_extra(dt_ctx *ctx, dt_tensor **list, int n)
{
    ctx->ckpt_extra = list;
    ctx->n_ckpt_extra = n;
}

DT_PRIVATE void ctx_shrink_step_arenas(dt_ctx *ctx, size_t dev, size_t host)
{
    arena_shrink(ctx, &ctx->dev, dev);
    arena_shrink(ctx, &ctx->host, host);
}

DT_PRIVATE dt_ctx *ctx_new_sink(dt_ctx *ctx)
{
    dt_ctx *sink = host_calloc(ctx, sizeof *sink);
    if (sink)
        sink->al = ctx->al;
    return sink;
}

DT_PRIVATE void ctx_set_grad_hooks(dt_ctx *ctx, const dt_grad_hooks *hooks, void *user)
{
    ctx->grad_hooks = hooks;
    ctx->hook_user = user;
}

DT_PRIVATE void *ctx_swap_hook_user(dt_ctx *ctx, void *user)
{
    void *was = ctx->hook_user;
    ctx->hook_user = user;
    return was;
}

DT_PRIVATE void *ctx_ext(const dt_ctx *ctx, int slot) { return ctx->ext[slot]; }

DT_PRIVATE void *ctx_ext_make(dt_ctx *ctx, int slot, size_t size,
                              void (*fini)(dt_ctx *ctx, void *state))
{
    if (ctx->ext[slot])
        return ctx->ext[slot];
    if (!(ctx->ext[slot] = host_calloc(ctx, size)))
        set_error(ctx, DT_ENOMEM, "out of host memory for the context's state");
    else
        ctx->ext_fini[slot] = fini;
    return ctx->ext[slot];
}

DT_PRIVATE dt_node *ctx_swap_tape(dt_ctx *ctx, dt_node *tape)
{
    dt_node *was = ctx->tape;
    ctx->tape = tape;
    return was;
}

DT_PRIVATE int ctx_swap_grad_enabled(dt_ctx *ctx, int on)
{
    int was = ctx->grad_enabled;
    ctx->grad_enabled = on;
    return was;
}

DT_PRIVATE dt_precision ctx_swap_autocast(dt_ctx *ctx, dt_precision p)
{
    dt_precision was = ctx->autocast;
    ctx->autocast = p;
    return was;
}

DT_PRIVATE uint64_t ctx_swap_dropout_counter(dt_ctx *ctx, uint64_t counter)
{
    uint64_t was = ctx->dropout_counter;
    ctx->dropout_counter = counter;
    return was;
}

DT_PRIVATE void ctx_swap_arenas(dt_ctx *ctx, dt_arena **dev, dt_arena **host)
{
    dt_arena *d = ctx->cur_dev, *h = ctx->cur_host;
    ctx->cur_dev = *dev;
    ctx->cur_host = *host;
    *dev = d;
    *host = h;
}

DT_PRIVATE void ctx_scratch_arenas(dt_ctx *ctx, dt_arena **dev, dt_arena **host)
{
    *dev = &ctx->scratch_dev;
    *host = &ctx->scratch_host;
}

DT_PRIVATE uint64_t ctx_dropout_next(dt_ctx *ctx) { return ctx->dropout_counter++; }

DT_PRIVATE void ctx_backward_begun(dt_ctx *ctx) { ctx->backwards++; }

DT_PRIVATE int ctx_note_params(dt_ctx *ctx, dt_tensor **list)
{
    int n = ctx->n_noted;
    ctx->noted = list;
    ctx->n_noted = 0;
    return n;
}

DT_PRIVATE void ctx_note_param(dt_ctx *ctx, const dt_tensor *p)
{
    if (!ctx->noted)
        return;
    for (int i = 0; i < ctx->n_noted; i++)
        if (ctx->noted[i] == p)
            return;
    if (ctx->n_noted < ctx->n_params)
        ctx->noted[ctx->n_noted++] = (dt_tensor *)p;
}

DT_PRIVATE int ctx_ok(dt_ctx *ctx)
{
    return ctx && ctx->init_status == DT_OK;
}

const char *dt_backend_name(const dt_ctx *ctx)
{
    return ctx && ctx->be_iface ? ctx->be_iface->name : "";
}
int dt_ctx_threads(const dt_ctx *ctx) { return ctx ? ctx->threads : 0; }
void dt_ctx_set_grad_enabled(dt_ctx *ctx, int e) { if (ctx) ctx->grad_enabled = e != 0; }
int dt_ctx_grad_enabled(const dt_ctx *ctx) { return ctx ? ctx->grad_enabled : 0; }
void dt_ctx_set_training(dt_ctx *ctx, int t) { if (ctx) ctx->training = t != 0; }
int dt_ctx_training(const dt_ctx *ctx) { return ctx ? ctx->training : 0; }

dt_status dt_ctx_set_autocast(dt_ctx *ctx, dt_precision p)
{
    if (!ctx_ok(ctx))   /* a failed context has no backend to ask */
        return DT_EINVAL;
    if (p < DT_PREC_F32 || p > DT_PREC_F16)
        return set_error(ctx, DT_EINVAL, "set_autocast: %d is not a dt_precision", (int)p);
    if (p != DT_PREC_F32 && !ctx->be_iface->gemm_ex && !ctx->be_iface->round_prec)
        return set_error(ctx, DT_ENOTSUP, "set_autocast: the %s backend has neither gemm_ex nor "
                         "round_prec", ctx->be_iface->name);
    ctx->autocast = p;
    return DT_OK;
}

dt_precision dt_ctx_autocast(const dt_ctx *ctx) { return ctx ? ctx->autocast : DT_PREC_F32; }

/* --- the backend, as the other modules reach it ---------------------------- */

/* The backend can stage asynchronously (all three entries, or none used). */
DT_PRIVATE int be_stages(const dt_backend_iface *b)
{
    return b->copy_async && b->copy_wait && b->copy_join;
}

/* Tensor memory to and from host memory: a plain copy where they are the
 * same memory, the backend's transfer where not. */
DT_PRIVATE void be_to_host(dt_ctx *ctx, void *host, const void *src, size_t bytes)
{
    if (BE(ctx)->host_visible)
        BE(ctx)->copy(BEI(ctx), host, src, bytes);
    else
        BE(ctx)->to_host(BEI(ctx), host, src, bytes);
}

DT_PRIVATE void be_to_device(dt_ctx *ctx, void *dst, const void *host, size_t bytes)
{
    if (BE(ctx)->host_visible)
        BE(ctx)->copy(BEI(ctx), dst, host, bytes);
    else
        BE(ctx)->to_device(BEI(ctx), dst, host, bytes);
}

/* A failure underneath the backend (backend.h, fault: a refused launch, a
 * cuBLAS error, a lost device) as this context's error, "what: message";
 * DT_OK when there is none.  Polled wherever results reach the user (a
 * tensor read, a loss, a count, the end of backward and of a step), so a
 * dead GPU is an error there, never a silent zero. */
DT_PRIVATE dt_status be_fault(dt_ctx *ctx, const char *what)
{
    if (!BE(ctx)->fault)
        return DT_OK;
    char msg[200] = "";
    dt_status s = BE(ctx)->fault(BEI(ctx), msg, sizeof msg);
    if (s == DT_OK)
        return DT_OK;
    return set_error(ctx, s, "%s: device failure: %s", what, msg[0] ? msg : "no message");
}
