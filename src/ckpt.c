#include "internal.h"

/* ===========================================================================
 * Checkpoints (safetensors)
 *
 * Layout: 8-byte little-endian header length, a JSON header mapping each
 * tensor name to {"dtype","shape","data_offsets"} plus "__metadata__"
 * (string values only), padded with spaces to 8 bytes, then the raw
 * little-endian data in header order.  Parameters keep their names;
 * optimizer state is stored as "optim.<param>.<state>".  Loading reads and
 * checks the whole file before it copies anything into the model.
 * ======================================================================== */

/* The checkpoint's own types: nothing outside this file sees them. */

typedef struct ckpt_item {
    const char *name;    /* safetensors key */
    dt_tensor *t;
    dt_dtype store;      /* as stored: DT_F32, DT_BF16 or DT_F16 */
    int64_t off, cnt;    /* cnt >= 0: only floats [off, off + cnt) of t, stored 1-D (a
                            shard's slice); cnt < 0: all of t, in its shape */
} ckpt_item;

/* --- a small strict JSON reader for the safetensors header -------------- */

typedef struct json {
    const char *p, *end;
    int depth;
} json;

/* The longest tensor name a checkpoint holds: "optim.", a parameter's name
 * (DT_MAX_NAME with its NUL), "." and a state's name, and in a shard "@"
 * and a float offset (20 digits). */
#define ST_MAX_KEY (DT_MAX_NAME + 48)

typedef struct st_entry {
    char name[ST_MAX_KEY];
    int dtype;           /* DT_F32, DT_BF16, DT_F16, or -1 for another type */
    int ndim;
    int64_t shape[DT_MAX_DIMS];
    uint64_t begin, end;
    int used;
    int has_crc;         /* dtrain.crc32.<name> gave crc */
    uint32_t crc;
} st_entry;

/* The dtrain.* metadata keys a checkpoint may hold (st_file.seen). */
enum {
    ST_STEP = 1, ST_OPT_KIND = 2, ST_OPT_STEPS = 4, ST_OPT_LR = 8, ST_OPT_PSTEPS = 16,
    ST_CHECKSUM = 32, ST_HEADER_CRC = 64, ST_SHARD = 128,
    ST_OPT_ALL = ST_OPT_KIND | ST_OPT_STEPS | ST_OPT_LR | ST_OPT_PSTEPS
};

/* A dtrain.crc32.<name> key, kept until the entries are known. */
typedef struct st_crc {
    char name[ST_MAX_KEY];
    uint32_t crc;
} st_crc;

typedef struct st_file {
    dt_ctx *ctx;               /* its allocator */
    st_entry *e;
    int n, cap;
    unsigned seen;             /* ST_* keys present */
    int64_t step, optim_steps;
    int shard_rank, shard_world;   /* dtrain.shard "r/N": one shard of a sharded checkpoint */
    int optim_kind;
    int optim_nlr;             /* dtrain.optim.lr: each parameter group's base lr */
    float optim_lr[DT_OPTIM_MAX_GROUPS];
    uint32_t header_crc;       /* dtrain.header_crc32 */
    char *param_steps;         /* host_alloc'ed: any length */
    st_crc *crc;
    int n_crc, cap_crc;
    char *val;                 /* scratch for one metadata value (the header's length) */
    size_t val_cap;
    char why[ST_MAX_KEY + 96];    /* what was wrong with the metadata */
    const char *want_key;      /* dt_checkpoint_metadata: the key looked for, its value */
    char want_val[4096];
    int found;
} st_file;

#define DT_CKPT_MAX_HEADER ((uint64_t)100 << 20)   /* safetensors' own limit */
#define DT_CKPT_MAX_FILE ((uint64_t)1 << 40)
#define DT_JSON_MAX_DEPTH 8

/* s escaped for inside a JSON string, without the quotes. */
static void strbuf_json_body(strbuf *b, const char *s)
{
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\') {
            char e[3] = {'\\', (char)ch, 0};
            strbuf_puts(b, e);
        } else if (ch < 0x20) {
            strbuf_printf(b, "\\u%04x", ch);
        } else {
            strbuf_putn(b, s, 1);
        }
    }
}

static void strbuf_json_string(strbuf *b, const char *s)
{
    strbuf_puts(b, "\"");
    strbuf_json_body(b, s);
    strbuf_puts(b, "\"");
}

static const char *st_dtype_name(dt_dtype t)
{
    return t == DT_BF16 ? "BF16" : t == DT_F16 ? "F16" : "F32";
}

/* What a checkpoint holds: the parameters (stored as `store`), the extra
 * tensors and the optimizer's state (f32), each whole. */
static int ckpt_items(dt_ctx *ctx, const dt_optim *opt, dt_dtype store, ckpt_item *items,
                      char **names)
{
    int n = 0;
    for (int i = 0; i < ctx->n_params; i++) {   /* a parameter's master when it has one */
        dt_tensor *m = optim_master_of(opt, ctx->params[i]);
        items[n++] = (ckpt_item){ctx->params[i]->name, m ? m : ctx->params[i], store, 0, -1};
    }
    for (int i = 0; i < ctx->n_ckpt_extra; i++)
        items[n++] = (ckpt_item){ctx->ckpt_extra[i]->name, ctx->ckpt_extra[i], DT_F32, 0, -1};
    if (opt) {
        for (int i = 0; i < dt_optim_state_count(opt); i++) {
            const dt_tensor *t = dt_optim_state_at(opt, i);
            size_t len = strlen(t->name) + 7;
            names[i] = host_alloc(ctx, len);
            if (!names[i])
                return -1;
            snprintf(names[i], len, "optim.%s", t->name);
            items[n++] = (ckpt_item){names[i], dt_optim_state_at(opt, i), DT_F32, 0, -1};
        }
    }
    return n;
}

static int64_t item_numel(const ckpt_item *it)
{
    return it->cnt >= 0 ? it->cnt : dt_tensor_numel(it->t);
}

static uint64_t item_bytes(const ckpt_item *it)
{
    return (uint64_t)item_numel(it) * (it->store == DT_F32 ? 4 : 2);
}

/* What a file's dtrain metadata says besides the checksums. */
typedef struct ckpt_meta {
    int64_t step;
    int has_optim;                 /* the optimizer's four fields below */
    int kind;
    int64_t steps;
    int nlr;                       /* each parameter group's base lr */
    float lr[DT_OPTIM_MAX_GROUPS];
    int n;                         /* param_steps[n] */
    const int64_t *param_steps;
    int shard_rank, shard_world;   /* shard_world > 0: "dtrain.shard" */
    const dt_checkpoint_config *cfg;   /* the caller's metadata */
} ckpt_meta;

static ckpt_meta ckpt_meta_of(const dt_optim *opt, int64_t step, const dt_checkpoint_config *cfg)
{
    ckpt_meta m = {.step = step, .cfg = cfg};
    if (!opt)
        return m;
    m.has_optim = 1;
    m.kind = optim_kind(opt);
    m.steps = dt_optim_steps(opt);
    m.nlr = dt_optim_group_count(opt);
    for (int g = 0; g < m.nlr; g++)
        m.lr[g] = optim_base_lr(opt, g);
    m.n = optim_param_count(opt);
    m.param_steps = optim_param_steps(opt);
    return m;
}

/* The checksum of text h whose field key ("...":") is followed by 8 hex
 * digits taken as 00000000 (h is changed while it runs, and restored);
 * 0 when it has no such field. */
static uint32_t crc_zeroed_field(unsigned char *h, size_t len, const char *key)
{
    size_t kl = strlen(key);
    unsigned char *at = memmem(h, len, key, kl), keep[8];
    if (!at || (size_t)(at - h) + kl + 8 > len)
        return 0;
    at += kl;
    memcpy(keep, at, 8);
    memset(at, '0', 8);
    uint32_t crc = (uint32_t)crc32_z(0, h, len);
    memcpy(at, keep, 8);
    return crc;
}

/* A header's checksum, its dtrain.header_crc32 field taken as 00000000. */
static uint32_t st_header_crc(unsigned char *h, size_t len)
{
    return crc_zeroed_field(h, len, "\"dtrain.header_crc32\":\"");
}

#define ST_HEADER_CRC_KEY "\"dtrain.header_crc32\":\""

/* Parameter groups' lrs as "a,b,...": "dtrain.optim.lr" (one group: one
 * number, as files before groups), and a sharded index's "lr". */
static void ckpt_put_lrs(strbuf *b, const float *lr, int n)
{
    for (int g = 0; g < n; g++)
        strbuf_printf(b, "%s%.9g", g ? "," : "", (double)lr[g]);
}

/* ckpt_put_lrs' text back: 1 to DT_OPTIM_MAX_GROUPS finite rates >= 0. */
static int ckpt_parse_lrs(const char *s, float *lr, int *n)
{
    *n = 0;
    for (;;) {
        char *endp;
        float v = strtof(s, &endp);
        if (endp == s || !isfinite(v) || !(v >= 0) || *n == DT_OPTIM_MAX_GROUPS)
            return 0;
        lr[(*n)++] = v;
        if (!*endp)
            return 1;
        if (*endp != ',')
            return 0;
        s = endp + 1;
    }
}

/* The JSON header; crc: each item's data checksum (NULL: zeros, the same
 * length, for a first pass written before the data); hcrc: the header's
 * own, computed with this field 00000000 (st_header_crc). */
static void ckpt_header(strbuf *b, const ckpt_meta *m, const ckpt_item *items, int n,
                        const uint32_t *crc, uint32_t hcrc)
{
    strbuf_printf(b, "{\"__metadata__\":{\"format\":\"pt\",\"dtrain.step\":\"%lld\","
                  "\"dtrain.checksum\":\"crc32\"," ST_HEADER_CRC_KEY "%08x\"", (long long)m->step,
                  (unsigned)hcrc);
    if (m->shard_world > 0)
        strbuf_printf(b, ",\"dtrain.shard\":\"%d/%d\"", m->shard_rank, m->shard_world);
    for (int i = 0; i < n; i++) {
        strbuf_puts(b, ",\"dtrain.crc32.");
        strbuf_json_body(b, items[i].name);
        strbuf_printf(b, "\":\"%08x\"", crc ? (unsigned)crc[i] : 0u);
    }
    for (int i = 0; m->cfg && i < m->cfg->n_meta; i++) {
        strbuf_puts(b, ",");
        strbuf_json_string(b, m->cfg->meta_keys[i]);
        strbuf_puts(b, ":");
        strbuf_json_string(b, m->cfg->meta_values[i]);
    }
    if (m->has_optim) {
        strbuf_printf(b, ",\"dtrain.optim.kind\":\"%d\",\"dtrain.optim.steps\":\"%lld\","
                     "\"dtrain.optim.lr\":\"", m->kind, (long long)m->steps);
        ckpt_put_lrs(b, m->lr, m->nlr);
        strbuf_puts(b, "\",\"dtrain.optim.param_steps\":\"");
        for (int i = 0; i < m->n; i++)
            strbuf_printf(b, "%s%lld", i ? "," : "", (long long)m->param_steps[i]);
        strbuf_puts(b, "\"");
    }
    strbuf_puts(b, "}");
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        dt_tensor *t = items[i].t;
        strbuf_puts(b, ",");
        strbuf_json_string(b, items[i].name);
        strbuf_printf(b, ":{\"dtype\":\"%s\",\"shape\":[", st_dtype_name(items[i].store));
        if (items[i].cnt >= 0)
            strbuf_printf(b, "%lld", (long long)items[i].cnt);
        for (int d = 0; items[i].cnt < 0 && d < t->ndim; d++)
            strbuf_printf(b, "%s%lld", d ? "," : "", (long long)t->shape[d]);
        uint64_t bytes = item_bytes(&items[i]);
        strbuf_printf(b, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off,
                      (unsigned long long)(off + bytes));
        off += bytes;
    }
    strbuf_puts(b, "}");
    while (!b->oom && b->len % 8)
        strbuf_puts(b, " ");
}

static dt_status write_all(dt_ctx *ctx, FILE *f, const void *p, size_t n, const char *path)
{
    if (n && fwrite(p, 1, n, f) != n)
        return set_error(ctx, DT_EIO, "checkpoint_save: writing %s: %s", path, strerror(errno));
    return DT_OK;
}

/* The length, the header and the data; crc[i]: item i's data checksum. */
/* Elements [at, at + n) of t as f32 into stage (4n bytes, f32 LE on
 * x86/arm): a 16-bit tensor (bf16 optimizer state) is copied, then
 * widened in place from the back, where no value is overwritten before it
 * is read. */
static void ckpt_get(dt_ctx *ctx, dt_tensor *t, int64_t at, int64_t n, void *stage)
{
    tensor_materialize(t);
    size_t es = dt_dtype_size(t->dtype);
    BE(ctx)->to_host(BEI(ctx), stage, (char *)t->data + (size_t)at * es, (size_t)n * es);
    if (t->dtype == DT_F32)
        return;
    const uint16_t *h = stage;
    float *f = stage;
    for (int64_t k = n - 1; k >= 0; k--)
        f[k] = t->dtype == DT_BF16 ? bf16_to_f32(h[k]) : f16_to_f32(h[k]);
}

/* n f32 values at src (any alignment) into t's elements [at, at + n), in
 * t's dtype (rounded to nearest even for 16-bit state). */
static dt_status ckpt_put(dt_ctx *ctx, dt_tensor *t, int64_t at, const unsigned char *src, int64_t n)
{
    if (t->dtype == DT_F32) {
        BE(ctx)->to_device(BEI(ctx), FP(t) + at, src, (size_t)n * 4);
        return DT_OK;
    }
    uint16_t *h = host_alloc(ctx, sizeof *h * (size_t)(n ? n : 1));
    if (!h)
        return set_error(ctx, DT_ENOMEM, "checkpoint_load: out of memory");
    for (int64_t k = 0; k < n; k++) {
        float v;
        memcpy(&v, src + 4 * k, 4);
        h[k] = t->dtype == DT_BF16 ? f32_to_bf16(v) : f32_to_f16(v);
    }
    BE(ctx)->to_device(BEI(ctx), (uint16_t *)t->data + at, h, (size_t)n * 2);
    host_free(ctx, h);
    return DT_OK;
}

static dt_status ckpt_write(dt_ctx *ctx, FILE *f, const char *tmp, const strbuf *hdr,
                            const ckpt_item *items, int n, uint32_t *crc)
{
    unsigned char len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (unsigned char)((uint64_t)hdr->len >> (8 * i));
    dt_status s = write_all(ctx, f, len8, 8, tmp);
    if (s == DT_OK)
        s = write_all(ctx, f, hdr->p, hdr->len, tmp);
    size_t biggest = 4;
    for (int i = 0; i < n; i++)
        if ((size_t)item_numel(&items[i]) * 4 > biggest)
            biggest = (size_t)item_numel(&items[i]) * 4;
    void *stage = s == DT_OK ? host_alloc(ctx, biggest) : NULL;
    if (s == DT_OK && !stage)
        s = set_error(ctx, DT_ENOMEM, "checkpoint_save: out of memory");
    for (int i = 0; s == DT_OK && i < n; i++) {
        dt_tensor *t = items[i].t;
        int64_t cnt = item_numel(&items[i]);
        ckpt_get(ctx, t, items[i].cnt >= 0 ? items[i].off : 0, cnt, stage);
        uint16_t *h = stage;   /* 16-bit storage: rounded in place, front to back */
        for (int64_t k = 0; items[i].store != DT_F32 && k < cnt; k++)
            h[k] = items[i].store == DT_BF16 ? f32_to_bf16(((float *)stage)[k])
                                             : f32_to_f16(((float *)stage)[k]);
        size_t bytes = (size_t)item_bytes(&items[i]);
        crc[i] = (uint32_t)crc32_z(0, stage, bytes);
        s = write_all(ctx, f, stage, bytes, tmp);
    }
    host_free(ctx, stage);
    return s;
}

/* The header again, now with the checksums (the same length: 8 hex digits
 * each), then everything to disk. */
static dt_status ckpt_finish(dt_ctx *ctx, FILE *f, const char *tmp, const strbuf *first,
                             const ckpt_meta *m, const ckpt_item *items, int n, const uint32_t *crc)
{
    strbuf hdr = {ctx, NULL, 0, 0, 0};
    ckpt_header(&hdr, m, items, n, crc, 0);
    uint32_t hcrc = hdr.oom ? 0 : st_header_crc((unsigned char *)hdr.p, hdr.len);
    strbuf_clear(&hdr);
    ckpt_header(&hdr, m, items, n, crc, hcrc);
    dt_status s = DT_OK;
    if (hdr.oom || hdr.len != first->len)
        s = set_error(ctx, hdr.oom ? DT_ENOMEM : DT_EIO, "checkpoint_save: %s",
                      hdr.oom ? "out of memory for the header" : "the header changed length");
    else if (fseek(f, 8, SEEK_SET) != 0)
        s = set_error(ctx, DT_EIO, "checkpoint_save: seeking in %s: %s", tmp, strerror(errno));
    else
        s = write_all(ctx, f, hdr.p, hdr.len, tmp);
    host_free(ctx, hdr.p);
    if (s == DT_OK && (fflush(f) != 0 || fsync(fileno(f)) != 0))
        s = set_error(ctx, DT_EIO, "checkpoint_save: syncing %s: %s", tmp, strerror(errno));
    return s;
}

/* Sync the directory so the rename itself survives a crash. */
static void sync_parent_dir(const char *path)
{
    char dir[4096];
    const char *slash = strrchr(path, '/');
    if (!slash)
        snprintf(dir, sizeof dir, ".");
    else
        snprintf(dir, sizeof dir, "%.*s", (int)(slash - path) ? (int)(slash - path) : 1, path);
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
}

/* items to path: written to path.tmp, synced, renamed over path, the
 * directory synced; a failure leaves path as it was. */
static dt_status ckpt_write_file(dt_ctx *ctx, const char *path, const ckpt_meta *m,
                                 const ckpt_item *items, int total)
{
    uint32_t *crc = host_calloc(ctx, sizeof *crc * (size_t)(total + 1));
    size_t plen = strlen(path) + 5;
    char *tmp = host_alloc(ctx, plen);
    strbuf hdr = {ctx, NULL, 0, 0, 0};
    FILE *f = NULL;
    dt_status s = DT_OK;
    if (!crc || !tmp) {
        s = set_error(ctx, DT_ENOMEM, "checkpoint_save: out of memory");
        goto done;
    }
    snprintf(tmp, plen, "%s.tmp", path);
    ckpt_header(&hdr, m, items, total, NULL, 0);
    if (hdr.oom) {
        s = set_error(ctx, DT_ENOMEM, "checkpoint_save: out of memory for the header");
        goto done;
    }
    if (!(f = fopen(tmp, "wb"))) {
        s = set_error(ctx, DT_EIO, "checkpoint_save: cannot create %s: %s", tmp, strerror(errno));
        goto done;
    }
    s = ckpt_write(ctx, f, tmp, &hdr, items, total, crc);
    if (s == DT_OK)
        s = ckpt_finish(ctx, f, tmp, &hdr, m, items, total, crc);
    if (fclose(f) != 0 && s == DT_OK)
        s = set_error(ctx, DT_EIO, "checkpoint_save: closing %s: %s", tmp, strerror(errno));
    if (s == DT_OK && rename(tmp, path) != 0)
        s = set_error(ctx, DT_EIO, "checkpoint_save: renaming %s to %s: %s", tmp, path,
                      strerror(errno));
    if (s == DT_OK)
        sync_parent_dir(path);
    else
        unlink(tmp);
done:
    host_free(ctx, crc);
    host_free(ctx, tmp);
    host_free(ctx, hdr.p);
    return s;
}

void dt_checkpoint_config_init(dt_checkpoint_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->struct_size = sizeof *cfg;
    cfg->dtype = DT_F32;
    cfg->strict = 1;
}

/* Keys of the caller's metadata: present, not ours, not repeated. */
static dt_status ckpt_meta_ok(dt_ctx *ctx, const dt_checkpoint_config *cfg)
{
    if (cfg->n_meta < 0 || (cfg->n_meta > 0 && (!cfg->meta_keys || !cfg->meta_values)))
        return set_error(ctx, DT_EINVAL, "checkpoint_save: %d metadata pairs without their arrays",
                         cfg->n_meta);
    for (int i = 0; i < cfg->n_meta; i++) {
        const char *k = cfg->meta_keys[i];
        if (!k || !*k || !cfg->meta_values[i] || strcmp(k, "format") == 0 ||
            strncmp(k, "dtrain.", 7) == 0)
            return set_error(ctx, DT_EINVAL, "checkpoint_save: metadata %d: a key (not \"format\" "
                             "nor \"dtrain.*\") and a value are required", i);
        for (int j = 0; j < i; j++)
            if (strcmp(cfg->meta_keys[j], k) == 0)
                return set_error(ctx, DT_EINVAL, "checkpoint_save: metadata key '%s' twice", k);
    }
    return DT_OK;
}

static dt_status ckpt_save_run(dt_ctx *ctx, const dt_optim *opt, const char *path, int64_t step,
                                const dt_checkpoint_config *cfg)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    dt_checkpoint_config def;
    dt_checkpoint_config_init(&def);
    if (cfg && ctx_config_in(ctx, &def, sizeof def, cfg,
                             "checkpoint_save", "dt_checkpoint_config") != DT_OK)
        return ctx->last_status;
    cfg = &def;
    if (!path || !path[0])
        return set_error(ctx, DT_EINVAL, "checkpoint_save: path is empty");
    if (cfg->dtype != DT_F32 && cfg->dtype != DT_BF16 && cfg->dtype != DT_F16)
        return set_error(ctx, DT_EINVAL, "checkpoint_save: parameters are stored as f32, bf16 or "
                         "f16, not %s", dt_dtype_name(cfg->dtype));
    if (ckpt_meta_ok(ctx, cfg) != DT_OK)
        return ctx->last_status;
    if (opt && optim_ctx(opt) != ctx)
        return set_error(ctx, DT_EINVAL, "checkpoint_save: optimizer belongs to another context");
    for (int i = 0; i < ctx->n_params; i++)
        if (tensor_readable(ctx->params[i], "checkpoint_save") != DT_OK)
            return ctx->last_status;
    if (opt && optim_is_sharded(opt))
        return set_error(ctx, DT_ENOTSUP, "checkpoint_save: the optimizer's state is sharded across "
                         "the ranks (dt_ddp_config.zero): save with dt_ddp_checkpoint_save (each "
                         "rank its shard), or the parameters alone (optimizer NULL)");
    int nstate = dt_optim_state_count(opt), total = ctx->n_params + ctx->n_ckpt_extra + nstate;
    ckpt_item *items = host_calloc(ctx, sizeof *items * (size_t)(total + 1));
    char **names = host_calloc(ctx, sizeof *names * (size_t)(nstate + 1));
    dt_status s = DT_OK;
    if (!items || !names || ckpt_items(ctx, opt, cfg->dtype, items, names) < 0)
        s = set_error(ctx, DT_ENOMEM, "checkpoint_save: out of memory");
    ckpt_meta m = ckpt_meta_of(opt, step, cfg);
    if (s == DT_OK)
        s = ckpt_write_file(ctx, path, &m, items, total);
    if (names)
        for (int i = 0; i < nstate; i++)
            host_free(ctx, names[i]);
    host_free(ctx, names);
    host_free(ctx, items);
    return s;
}

/* (what peers waiting on this rank see: dt_ctx_activity) */
dt_status dt_checkpoint_save(dt_ctx *ctx, const dt_optim *opt, const char *path, int64_t step,
                                const dt_checkpoint_config *cfg)
{
    dt_ctx *actx = ctx_ok(ctx) ? ctx : NULL;
    int act = ctx_doing(actx, ACT_CKPT_SAVE);
    dt_status s = ckpt_save_run(ctx, opt, path, step, cfg);
    ctx_done(actx, act);
    return s;
}

static void js_ws(json *j)
{
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r'))
        j->p++;
}

static int js_char(json *j, char c)
{
    js_ws(j);
    if (j->p < j->end && *j->p == c) {
        j->p++;
        return 1;
    }
    return 0;
}

/* A string into out (truncation is an error); \uXXXX only below 0x80. */
static int js_string(json *j, char *out, size_t cap)
{
    if (!js_char(j, '"'))
        return 0;
    size_t n = 0;
    while (j->p < j->end && *j->p != '"') {
        char c = *j->p++;
        if (c == '\\') {
            if (j->p >= j->end)
                return 0;
            char e = *j->p++;
            switch (e) {
            case '"': case '\\': case '/': c = e; break;
            case 'n': c = '\n'; break;
            case 't': c = '\t'; break;
            case 'r': c = '\r'; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'u': {
                if (j->end - j->p < 4)
                    return 0;
                unsigned v = 0;
                for (int i = 0; i < 4; i++) {
                    char h = *j->p++;
                    v = v * 16 + (unsigned)(h >= '0' && h <= '9' ? h - '0'
                                            : h >= 'a' && h <= 'f' ? h - 'a' + 10
                                            : h >= 'A' && h <= 'F' ? h - 'A' + 10 : 99);
                    if (v > 0xFFFF)
                        return 0;
                }
                if (v >= 0x80 || v == 0)
                    return 0;
                c = (char)v;
                break;
            }
            default: return 0;
            }
        } else if ((unsigned char)c < 0x20) {
            return 0;
        }
        if (n + 1 >= cap)
            return 0;
        out[n++] = c;
    }
    if (j->p >= j->end)
        return 0;
    j->p++;
    out[n] = '\0';
    return 1;
}

static int js_uint(json *j, uint64_t *v)
{
    js_ws(j);
    if (j->p >= j->end || *j->p < '0' || *j->p > '9')
        return 0;
    uint64_t x = 0;
    while (j->p < j->end && *j->p >= '0' && *j->p <= '9') {
        unsigned d = (unsigned)(*j->p++ - '0');
        if (x > (UINT64_MAX - d) / 10)
            return 0;
        x = x * 10 + d;
    }
    *v = x;
    return 1;
}

static int js_skip(json *j)
{
    js_ws(j);
    if (j->p >= j->end || ++j->depth > DT_JSON_MAX_DEPTH)
        return 0;
    int ok = 1;
    char c = *j->p;
    if (c == '"') {
        char tmp[4096];
        ok = js_string(j, tmp, sizeof tmp);
    } else if (c == '{' || c == '[') {
        char close = c == '{' ? '}' : ']';
        j->p++;
        if (!js_char(j, close)) {
            do {
                if (c == '{') {
                    char key[4096];
                    ok = js_string(j, key, sizeof key) && js_char(j, ':');
                }
                ok = ok && js_skip(j);
            } while (ok && js_char(j, ','));
            ok = ok && js_char(j, close);
        }
    } else {
        const char *s = j->p;
        while (j->p < j->end && (strchr("-+.eE", *j->p) || (*j->p >= '0' && *j->p <= '9') ||
                                 (*j->p >= 'a' && *j->p <= 'z')))
            j->p++;
        ok = j->p > s;
    }
    j->depth--;
    return ok;
}

/* [d0, d1, ...]: at most DT_MAX_DIMS sizes, each at most 2^40. */
static int js_shape(json *j, int *ndim, int64_t *shape)
{
    if (!js_char(j, '['))
        return 0;
    *ndim = 0;
    if (js_char(j, ']'))
        return 1;
    do {
        uint64_t v;
        if (*ndim >= DT_MAX_DIMS || !js_uint(j, &v) || v > ((uint64_t)1 << 40))
            return 0;
        shape[(*ndim)++] = (int64_t)v;
    } while (js_char(j, ','));
    return js_char(j, ']');
}

static int st_tensor_entry(json *j, st_entry *e)
{
    int have_dtype = 0, have_shape = 0, have_off = 0;
    if (!js_char(j, '{'))
        return 0;
    if (js_char(j, '}'))
        return 0;
    do {
        char key[64];
        if (!js_string(j, key, sizeof key) || !js_char(j, ':'))
            return 0;
        if (strcmp(key, "dtype") == 0) {
            char dt[16];
            if (!js_string(j, dt, sizeof dt))
                return 0;
            e->dtype = strcmp(dt, "F32") == 0 ? DT_F32 : strcmp(dt, "BF16") == 0 ? DT_BF16
                       : strcmp(dt, "F16") == 0 ? DT_F16 : -1;
            have_dtype = 1;
        } else if (strcmp(key, "shape") == 0) {
            if (!js_shape(j, &e->ndim, e->shape))
                return 0;
            have_shape = 1;
        } else if (strcmp(key, "data_offsets") == 0) {
            if (!js_char(j, '[') || !js_uint(j, &e->begin) || !js_char(j, ',') ||
                !js_uint(j, &e->end) || !js_char(j, ']'))
                return 0;
            have_off = 1;
        } else if (!js_skip(j)) {
            return 0;
        }
    } while (js_char(j, ','));
    return js_char(j, '}') && have_dtype && have_shape && have_off;
}

/* A decimal integer >= 0 that is all of s. */
static int meta_i64(const char *s, int64_t *out)
{
    if (*s < '0' || *s > '9')
        return 0;
    char *endp;
    errno = 0;
    long long v = strtoll(s, &endp, 10);
    if (errno || *endp)
        return 0;
    *out = v;
    return 1;
}

/* Exactly 8 hex digits. */
static int meta_crc(const char *s, uint32_t *out)
{
    uint32_t v = 0;
    for (int i = 0; i < 8; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0)
            return 0;
        v = v << 4 | (uint32_t)d;
    }
    *out = v;
    return s[8] == '\0';
}

static int meta_bad(st_file *f, const char *key, const char *what)
{
    snprintf(f->why, sizeof f->why, "metadata '%.*s' %s", ST_MAX_KEY + 16, key, what);
    return 0;
}

static int meta_keep_crc(st_file *f, const char *name, uint32_t crc)
{
    if (f->n_crc == f->cap_crc) {
        int cap = f->cap_crc ? f->cap_crc * 2 : 32;
        st_crc *c = f->ctx->al.realloc_fn(f->crc, sizeof *c * (size_t)cap, f->ctx->al.user);
        if (!c)
            return -1;
        f->crc = c;
        f->cap_crc = cap;
    }
    size_t len = strlen(name);
    if (len >= sizeof f->crc[0].name)   /* longer than any entry's name */
        return meta_bad(f, name, "is a checksum for a name no tensor can have");
    memcpy(f->crc[f->n_crc].name, name, len + 1);
    f->crc[f->n_crc++].crc = crc;
    return 1;
}

/* One dtrain.* key: known, well formed, given once.  1 ok, 0 bad (f->why),
 * -1 out of memory. */
static int meta_dtrain(st_file *f, const char *key, const char *val)
{
    static const struct { const char *key; unsigned bit; } known[] = {
        {"dtrain.step", ST_STEP},           {"dtrain.optim.kind", ST_OPT_KIND},
        {"dtrain.optim.steps", ST_OPT_STEPS}, {"dtrain.optim.lr", ST_OPT_LR},
        {"dtrain.optim.param_steps", ST_OPT_PSTEPS}, {"dtrain.checksum", ST_CHECKSUM},
        {"dtrain.header_crc32", ST_HEADER_CRC}, {"dtrain.shard", ST_SHARD}};
    if (strncmp(key, "dtrain.crc32.", 13) == 0) {
        uint32_t crc;
        if (!meta_crc(val, &crc))
            return meta_bad(f, key, "is not 8 hex digits");
        return meta_keep_crc(f, key + 13, crc);
    }
    unsigned bit = 0;
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
        if (strcmp(key, known[i].key) == 0)
            bit = known[i].bit;
    if (!bit)
        return meta_bad(f, key, "is not a key dtrain writes");
    if (f->seen & bit)
        return meta_bad(f, key, "is given twice");
    f->seen |= bit;
    int64_t v = 0;
    switch (bit) {
    case ST_STEP:
        return meta_i64(val, &f->step) || meta_bad(f, key, "is not an integer >= 0");
    case ST_OPT_STEPS:
        return meta_i64(val, &f->optim_steps) || meta_bad(f, key, "is not an integer >= 0");
    case ST_OPT_KIND:
        if (!meta_i64(val, &v) || v > DT_ADAGRAD)
            return meta_bad(f, key, "is not an optimizer kind");
        f->optim_kind = (int)v;
        return 1;
    case ST_OPT_LR:
        return ckpt_parse_lrs(val, f->optim_lr, &f->optim_nlr) ||
               meta_bad(f, key, "is not learning rates >= 0, one per parameter group");
    case ST_OPT_PSTEPS:
        if (!(f->param_steps = host_alloc(f->ctx, strlen(val) + 1)))
            return -1;
        strcpy(f->param_steps, val);
        return 1;
    case ST_HEADER_CRC:
        return meta_crc(val, &f->header_crc) || meta_bad(f, key, "is not 8 hex digits");
    case ST_SHARD: {
        int r = -1, w = 0, used = 0;
        return (sscanf(val, "%d/%d%n", &r, &w, &used) == 2 && (size_t)used == strlen(val) &&
                w > 0 && r >= 0 && r < w && (f->shard_rank = r, f->shard_world = w)) ||
               meta_bad(f, key, "is not \"rank/world\"");
    }
    default:   /* ST_CHECKSUM */
        return strcmp(val, "crc32") == 0 || meta_bad(f, key, "names no checksum dtrain knows");
    }
}

/* "__metadata__": string values; dtrain's own keys checked (meta_dtrain). */
static int st_metadata(json *j, st_file *f)
{
    if (!js_char(j, '{'))
        return 0;
    if (js_char(j, '}'))
        return 1;
    do {
        char key[ST_MAX_KEY + 16];   /* "dtrain.crc32." and a tensor's name */
        if (!js_string(j, key, sizeof key) || !js_char(j, ':') ||
            !js_string(j, f->val, f->val_cap))
            return 0;
        if (f->want_key && strcmp(key, f->want_key) == 0) {
            snprintf(f->want_val, sizeof f->want_val, "%s", f->val);
            f->found = 1;
        }
        if (strncmp(key, "dtrain.", 7) == 0) {
            int r = meta_dtrain(f, key, f->val);
            if (r <= 0)
                return r;
        }
    } while (js_char(j, ','));
    return js_char(j, '}');
}

static int st_parse(dt_ctx *ctx, const char *hdr, size_t len, st_file *f)
{
    json j = {hdr, hdr + len, 0};
    if (!js_char(&j, '{'))
        return 0;
    if (js_char(&j, '}'))
        goto tail;
    do {
        char key[ST_MAX_KEY];
        if (!js_string(&j, key, sizeof key) || !js_char(&j, ':'))
            return 0;
        if (strcmp(key, "__metadata__") == 0) {
            if (!st_metadata(&j, f))
                return 0;
            continue;
        }
        if (f->n == f->cap) {
            int cap = f->cap ? f->cap * 2 : 32;
            st_entry *e = ctx->al.realloc_fn(f->e, sizeof *e * (size_t)cap, ctx->al.user);
            if (!e)
                return -1;
            f->e = e;
            f->cap = cap;
        }
        st_entry *e = &f->e[f->n];
        memset(e, 0, sizeof *e);
        snprintf(e->name, sizeof e->name, "%s", key);
        if (!st_tensor_entry(&j, e))
            return 0;
        f->n++;
    } while (js_char(&j, ','));
    if (!js_char(&j, '}'))
        return 0;
tail:
    js_ws(&j);
    return j.p == j.end;
}

static st_entry *st_find(st_file *f, const char *name)
{
    for (int i = 0; i < f->n; i++)
        if (strcmp(f->e[i].name, name) == 0)
            return &f->e[i];
    return NULL;
}

/* Read a whole regular file.  Opened without blocking and checked before
 * any read, so a FIFO, a device or a directory is refused instead of
 * waited on.  *out is allocated with the context's allocator. */
static dt_status read_file(dt_ctx *ctx, const char *op, const char *path, unsigned char **out,
                           size_t *len)
{
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        return set_error(ctx, DT_EIO, "%s: cannot open %s: %s", op, path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return set_error(ctx, DT_EIO, "%s: %s is not a regular file", op, path);
    }
    if ((uint64_t)st.st_size > DT_CKPT_MAX_FILE) {
        close(fd);
        return set_error(ctx, DT_EIO, "%s: %s is larger than %llu bytes", op, path,
                         (unsigned long long)DT_CKPT_MAX_FILE);
    }
    size_t size = (size_t)st.st_size, got = 0;
    unsigned char *buf = host_alloc(ctx, size + 1);
    dt_status s = buf ? DT_OK : set_error(ctx, DT_ENOMEM, "%s: out of memory for %zu bytes", op,
                                          size);
    while (s == DT_OK && got < size) {
        ssize_t r = read(fd, buf + got, size - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            s = set_error(ctx, DT_EIO, "%s: reading %s failed%s%s", op, path, r ? ": " : "",
                          r ? strerror(errno) : " (it shrank)");
        else
            got += (size_t)r;
    }
    close(fd);
    if (s != DT_OK) {
        host_free(ctx, buf);
        return s;
    }
    *out = buf;
    *len = size;
    return DT_OK;
}

static uint64_t st_entry_esize(const st_entry *e)
{
    return e->dtype == DT_F32 ? 4 : e->dtype == DT_BF16 || e->dtype == DT_F16 ? 2 : 0;
}

/* How a destination tensor fits the file's entry key. */
enum { ST_FITS, ST_MISSING, ST_MISMATCHED };

static int st_fit(st_file *f, const char *key, const dt_tensor *t, st_entry **out)
{
    st_entry *e = st_find(f, key);
    *out = e;
    if (!e)
        return ST_MISSING;
    int same = e->ndim == t->ndim && e->dtype >= 0;
    for (int d = 0; same && d < e->ndim; d++)
        same = e->shape[d] == t->shape[d];
    return same ? ST_FITS : ST_MISMATCHED;
}

/* Check one destination tensor against its entry (strict: any misfit is an
 * error). */
static dt_status st_check(dt_ctx *ctx, st_file *f, const char *key, const dt_tensor *t,
                          uint64_t data_len, const st_entry **out)
{
    st_entry *e;
    int fit = st_fit(f, key, t, &e);
    if (fit == ST_MISSING)
        return set_error(ctx, DT_EMISMATCH, "checkpoint_load: '%s' is missing from the file", key);
    char sb[96];
    if (e->dtype < 0)
        return set_error(ctx, DT_EMISMATCH, "checkpoint_load: '%s' is not F32, BF16 or F16", key);
    if (fit == ST_MISMATCHED) {
        char fs[96];
        size_t o = 0;
        o += (size_t)snprintf(fs + o, sizeof fs - o, "(");
        for (int d = 0; d < e->ndim && o < sizeof fs; d++)
            o += (size_t)snprintf(fs + o, sizeof fs - o, "%s%lld", d ? ", " : "",
                                  (long long)e->shape[d]);
        if (o < sizeof fs)
            snprintf(fs + o, sizeof fs - o, ")");
        return set_error(ctx, DT_EMISMATCH, "checkpoint_load: '%s' has shape %s in the file, "
                                            "the model has %s", key, fs, SHAPE(t, sb));
    }
    if (e->end < e->begin || e->end > data_len ||
        e->end - e->begin != (uint64_t)dt_tensor_numel(t) * st_entry_esize(e))
        return set_error(ctx, DT_ECORRUPT, "checkpoint_load: '%s' has data offsets [%llu, %llu] "
                                           "outside the %llu data bytes or of the wrong size",
                         key, (unsigned long long)e->begin, (unsigned long long)e->end,
                         (unsigned long long)data_len);
    e->used = 1;
    *out = e;
    return DT_OK;
}

/* "missing: a, b; unexpected: c" grows one name at a time, cut at its size */
static void report_name(dt_checkpoint_report *r, const char *kind, const char *name)
{
    size_t l = strlen(r->names);
    const char *last = strrchr(r->names, ';');
    int same_kind = l && strncmp(last ? last + 2 : r->names, kind, strlen(kind)) == 0;
    snprintf(r->names + l, sizeof r->names - l, "%s%s%s%s", l ? (same_kind ? ", " : "; ") : "",
             same_kind ? "" : kind, same_kind ? "" : ": ", name);
}

static dt_status st_parse_param_steps(dt_ctx *ctx, const st_file *f, int64_t *steps, int n)
{
    const char *p = f->param_steps ? f->param_steps : "";
    for (int i = 0; i < n; i++) {
        char *endp;
        errno = 0;
        long long v = strtoll(p, &endp, 10);
        if (endp == p || errno || v < 0 || v > f->optim_steps || *p < '0' || *p > '9' ||
            (*endp != ',' && *endp != '\0') || (i == n - 1 && *endp != '\0'))
            return set_error(ctx, DT_ECORRUPT, "checkpoint_load: bad optimizer step list");
        steps[i] = v;
        p = endp + (*endp == ',');
    }
    return DT_OK;
}

static int entry_by_begin(const void *x, const void *y)
{
    const st_entry *a = *(const st_entry *const *)x, *b = *(const st_entry *const *)y;
    return a->begin < b->begin ? -1 : a->begin > b->begin ? 1 : a->end < b->end ? -1 : a->end > b->end;
}

static int entry_by_name(const void *x, const void *y)
{
    return strcmp((*(const st_entry *const *)x)->name, (*(const st_entry *const *)y)->name);
}

/* Each entry: a known size that fits the data; together, names unique and
 * offsets that tile the data exactly (no overlap, no hole), as the
 * safetensors library requires. */
static dt_status st_check_layout(dt_ctx *ctx, const char *path, st_file *f, uint64_t data_len)
{
    for (int i = 0; i < f->n; i++) {
        st_entry *e = &f->e[i];
        uint64_t want = st_entry_esize(e);
        for (int d = 0; d < e->ndim; d++)
            want *= (uint64_t)e->shape[d];
        if (e->end < e->begin || e->end > data_len || (e->dtype >= 0 && e->end - e->begin != want))
            return set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s: '%s' has data offsets [%llu, "
                             "%llu] outside the %llu data bytes or of the wrong size", path,
                             e->name, (unsigned long long)e->begin, (unsigned long long)e->end,
                             (unsigned long long)data_len);
    }
    st_entry **order = host_alloc(ctx, sizeof *order * (size_t)(f->n + 1));
    if (!order)
        return set_error(ctx, DT_ENOMEM, "checkpoint_load: out of memory");
    for (int i = 0; i < f->n; i++)
        order[i] = &f->e[i];
    dt_status s = DT_OK;
    qsort(order, (size_t)f->n, sizeof *order, entry_by_name);
    for (int i = 1; s == DT_OK && i < f->n; i++)
        if (strcmp(order[i - 1]->name, order[i]->name) == 0)
            s = set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s names '%s' twice", path,
                          order[i]->name);
    qsort(order, (size_t)f->n, sizeof *order, entry_by_begin);
    uint64_t at = 0;
    for (int i = 0; s == DT_OK && i < f->n; i++) {
        if (order[i]->begin != at)
            s = set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s: '%s' starts at data byte %llu, "
                          "where the previous tensor ends at %llu (%s)", path, order[i]->name,
                          (unsigned long long)order[i]->begin, (unsigned long long)at,
                          order[i]->begin < at ? "overlapping" : "a hole");
        at = order[i]->end;
    }
    host_free(ctx, order);
    if (s == DT_OK && at != data_len)
        s = set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s has %llu data bytes, its header "
                      "describes %llu", path, (unsigned long long)data_len, (unsigned long long)at);
    return s;
}

static int by_string(const void *x, const void *y)
{
    return strcmp(*(const char *const *)x, *(const char *const *)y);
}

/* How many parameters have optimizer state ("optim.<param>.<state>"). */
static int st_state_params(dt_ctx *ctx, const st_file *f)
{
    const char **names = host_alloc(ctx, sizeof *names * (size_t)(f->n + 1));
    if (!names)
        return -1;
    int k = 0, distinct = 0;
    for (int i = 0; i < f->n; i++)
        if (strncmp(f->e[i].name, "optim.", 6) == 0 && strrchr(f->e[i].name, '.') > f->e[i].name + 5)
            names[k++] = f->e[i].name + 6;
    qsort(names, (size_t)k, sizeof *names, by_string);
    for (int i = 0; i < k; i++) {   /* the same <param>: the same text up to the last '.' */
        size_t li = (size_t)(strrchr(names[i], '.') - names[i]);
        distinct += !i || li != (size_t)(strrchr(names[i - 1], '.') - names[i - 1]) ||
                    strncmp(names[i], names[i - 1], li) != 0;
    }
    host_free(ctx, names);
    return distinct;
}

/* dtrain.optim.param_steps: integers in [0, optim.steps], one for each
 * parameter that has state in the file (when any has). */
static dt_status st_check_param_steps(dt_ctx *ctx, const char *path, const st_file *f)
{
    int count = 0;
    for (const char *p = f->param_steps; p && *p; count++) {
        char *endp;
        errno = 0;
        long long v = strtoll(p, &endp, 10);
        if (*p < '0' || *p > '9' || errno || v > f->optim_steps || (*endp != ',' && *endp) ||
            (*endp == ',' && !endp[1]))
            return set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s: dtrain.optim.param_steps "
                             "is not a list of step counts up to dtrain.optim.steps (%lld)", path,
                             (long long)f->optim_steps);
        p = endp + (*endp == ',');
    }
    int with_state = st_state_params(ctx, f);
    if (with_state < 0)
        return set_error(ctx, DT_ENOMEM, "checkpoint_load: out of memory");
    if (with_state > 0 && count != with_state)
        return set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s: dtrain.optim.param_steps has %d "
                         "entries, the file has state for %d parameters", path, count, with_state);
    return DT_OK;
}

/* dtrain's metadata: what a file dtrain wrote must hold, consistent with
 * its tensors; checksums attached to their entries. */
static dt_status st_check_meta(dt_ctx *ctx, const char *path, st_file *f)
{
    int has_optim_state = 0;
    for (int i = 0; i < f->n; i++)
        has_optim_state |= strncmp(f->e[i].name, "optim.", 6) == 0;
    if ((f->seen || f->n_crc) && !(f->seen & ST_STEP))
        return set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s has dtrain metadata without "
                         "'dtrain.step'", path);
    unsigned opt = f->seen & ST_OPT_ALL;
    if (f->seen & ST_SHARD)   /* a shard's optimizer metadata is in its index */
        has_optim_state = 0;
    if ((opt && opt != ST_OPT_ALL) || (has_optim_state && !opt))
        return set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s: the optimizer's metadata "
                         "(dtrain.optim.kind, .steps, .lr, .param_steps) is incomplete", path);
    dt_status s = opt ? st_check_param_steps(ctx, path, f) : DT_OK;
    if (s != DT_OK)
        return s;
    if ((f->n_crc || (f->seen & ST_HEADER_CRC)) && !(f->seen & ST_CHECKSUM))
        return set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s has checksums without "
                         "'dtrain.checksum'", path);
    if ((f->seen & ST_CHECKSUM) && !(f->seen & ST_HEADER_CRC))
        return set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s has no 'dtrain.header_crc32'",
                         path);
    for (int i = 0; i < f->n_crc; i++) {
        st_entry *e = st_find(f, f->crc[i].name);
        if (!e || e->has_crc)
            return set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s: checksum key for '%s', %s",
                             path, f->crc[i].name, e ? "given twice" : "which it does not hold");
        e->has_crc = 1;
        e->crc = f->crc[i].crc;
    }
    for (int i = 0; (f->seen & ST_CHECKSUM) && i < f->n; i++)
        if (!f->e[i].has_crc)
            return set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s: '%s' has no checksum "
                             "(dtrain.crc32.%s)", path, f->e[i].name, f->e[i].name);
    return DT_OK;
}

/* Read path whole, parse and check its header, the data's layout and
 * dtrain's metadata. */
static dt_status st_open(dt_ctx *ctx, const char *path, unsigned char **buf, size_t *len,
                         st_file *f, uint64_t *hlen_out)
{
    dt_status s = read_file(ctx, "checkpoint_load", path, buf, len);
    if (s != DT_OK)
        return s;
    uint64_t hlen = 0;
    for (int i = 0; i < 8 && *len >= 8; i++)
        hlen |= (uint64_t)(*buf)[i] << (8 * i);
    if (*len < 8 || hlen > DT_CKPT_MAX_HEADER || hlen > *len - 8)
        return set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s is truncated or not safetensors "
                         "(%zu bytes, header length %llu)", path, *len, (unsigned long long)hlen);
    f->ctx = ctx;
    f->val_cap = (size_t)hlen + 1;
    if (!(f->val = host_alloc(ctx, f->val_cap)))
        return set_error(ctx, DT_ENOMEM, "checkpoint_load: out of memory");
    int pr = st_parse(ctx, (const char *)*buf + 8, (size_t)hlen, f);
    if (pr <= 0)
        return pr < 0 ? set_error(ctx, DT_ENOMEM, "checkpoint_load: out of memory")
                      : set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s has a malformed header%s%s",
                                  path, f->why[0] ? ": " : "", f->why);
    if ((s = st_check_layout(ctx, path, f, *len - 8 - hlen)) != DT_OK ||
        (s = st_check_meta(ctx, path, f)) != DT_OK)
        return s;
    uint32_t hcrc = (f->seen & ST_HEADER_CRC) ? st_header_crc(*buf + 8, (size_t)hlen) : 0;
    if (hcrc != f->header_crc)
        return set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s: the header does not match its "
                         "checksum (%08x, the file says %08x): the file is corrupt", path,
                         (unsigned)hcrc, (unsigned)f->header_crc);
    *hlen_out = hlen;
    return DT_OK;
}

/* Every entry's data against its checksum; a file without any (another
 * tool's) is loaded with a note (dt_ctx_set_log). */
static dt_status st_verify(dt_ctx *ctx, const char *path, const st_file *f,
                           const unsigned char *data)
{
    if (!(f->seen & ST_CHECKSUM)) {
        ctx_warn(ctx, "checkpoint_load: %s has no checksums (not written by this dtrain): its data "
                  "cannot be verified", path);
        return DT_OK;
    }
    for (int i = 0; i < f->n; i++) {
        const st_entry *e = &f->e[i];
        uint32_t crc = (uint32_t)crc32_z(0, data + e->begin, (size_t)(e->end - e->begin));
        if (crc != e->crc)
            return set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s: the data of '%s' does not "
                             "match its checksum (%08x, the file says %08x): the file is corrupt",
                             path, e->name, (unsigned)crc, (unsigned)e->crc);
    }
    return DT_OK;
}

static void st_file_free(dt_ctx *ctx, st_file *f)
{
    host_free(ctx, f->e);
    host_free(ctx, f->crc);
    host_free(ctx, f->val);
    host_free(ctx, f->param_steps);
}

/* The parameters: strict, each must fit; otherwise those that fit, the
 * rest reported. */
static dt_status st_map_params(dt_ctx *ctx, st_file *f, uint64_t data_len, int strict,
                               const st_entry **map, dt_checkpoint_report *r)
{
    dt_status s = DT_OK;
    for (int i = 0; s == DT_OK && i < ctx->n_params; i++) {
        dt_tensor *t = ctx->params[i];
        st_entry *e = NULL;
        int fit = strict ? ST_FITS : st_fit(f, t->name, t, &e);
        if (fit == ST_FITS) {
            s = st_check(ctx, f, t->name, t, data_len, &map[i]);
            r->loaded += s == DT_OK;
        } else if (fit == ST_MISSING) {
            r->missing++;
            report_name(r, "missing", t->name);
        } else {
            e->used = 1;
            r->mismatched++;
            report_name(r, "mismatched", t->name);
        }
    }
    for (int i = 0; s == DT_OK && i < f->n; i++) {
        if (f->e[i].used || strncmp(f->e[i].name, "optim.", 6) == 0)
            continue;
        if (strict)
            return set_error(ctx, DT_EMISMATCH, "checkpoint_load: the file has '%s', which is not "
                             "a parameter of the model", f->e[i].name);
        r->unexpected++;
        report_name(r, "unexpected", f->e[i].name);
    }
    return s;
}

/* One entry's data into t: f32 as it is, 16-bit widened on the host. */
static dt_status st_copy(dt_ctx *ctx, dt_tensor *t, const st_entry *e, const unsigned char *data)
{
    const unsigned char *src = data + e->begin;
    int64_t n = dt_tensor_numel(t);
    float *wide = NULL;
    if (e->dtype != DT_F32) {
        if (!(wide = host_alloc(ctx, sizeof *wide * (size_t)(n ? n : 1))))
            return set_error(ctx, DT_ENOMEM, "checkpoint_load: out of memory");
        for (int64_t k = 0; k < n; k++) {
            uint16_t h;
            memcpy(&h, src + 2 * k, 2);
            wide[k] = e->dtype == DT_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
        }
        src = (const unsigned char *)wide;
    }
    dt_status s = ckpt_put(ctx, t, 0, src, n);
    tensor_mark_zero(t, 0);
    host_free(ctx, wide);
    return s;
}

static dt_status ckpt_load_sharded(dt_ctx *ctx, dt_optim *opt, const char *dir, int64_t *step_out);
static int ckpt_sharded_complete(dt_ctx *ctx, const char *dir, int64_t *step);

static dt_status ckpt_load_run(dt_ctx *ctx, dt_optim *opt, const char *path,
                                const dt_checkpoint_config *cfg, int64_t *step_out,
                                dt_checkpoint_report *report)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    dt_checkpoint_config def;
    dt_checkpoint_config_init(&def);
    if (cfg && ctx_config_in(ctx, &def, sizeof def, cfg,
                             "checkpoint_load", "dt_checkpoint_config") != DT_OK)
        return ctx->last_status;
    cfg = &def;
    int strict = cfg->strict;
    dt_checkpoint_report rep;
    memset(&rep, 0, sizeof rep);
    if (!path)
        return set_error(ctx, DT_EINVAL, "checkpoint_load: path is NULL");
    if (opt && optim_ctx(opt) != ctx)
        return set_error(ctx, DT_EINVAL, "checkpoint_load: optimizer belongs to another context");
    if (opt && !strict)
        return set_error(ctx, DT_EINVAL, "checkpoint_load: a non-strict load takes no optimizer");
    struct stat st;
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {   /* a sharded checkpoint */
        if (!strict)
            return set_error(ctx, DT_ENOTSUP, "checkpoint_load: a sharded checkpoint (%s) loads "
                             "strictly; consolidate it (dt_checkpoint_consolidate) first", path);
        if (report)
            memset(report, 0, sizeof *report);
        dt_status ds = ckpt_load_sharded(ctx, opt, path, step_out);
        if (ds == DT_OK && report)
            report->loaded = ctx->n_params;
        return ds;
    }
    if (opt && optim_is_sharded(opt))
        return set_error(ctx, DT_EINVAL, "checkpoint_load: the optimizer's state is sharded across "
                         "the ranks (dt_ddp_config.zero): load with dt_ddp_checkpoint_load");
    unsigned char *buf = NULL;
    size_t len = 0;
    uint64_t hlen = 0;
    st_file f;
    memset(&f, 0, sizeof f);
    int nstate = dt_optim_state_count(opt), nx = ctx->n_ckpt_extra;
    int total = ctx->n_params + nx + nstate;
    const st_entry **map = NULL;
    int64_t *psteps = NULL;
    char key[ST_MAX_KEY];
    dt_status s = st_open(ctx, path, &buf, &len, &f, &hlen);
    if (s != DT_OK)
        goto done;
    if (f.seen & ST_SHARD) {
        s = set_error(ctx, DT_EINVAL, "checkpoint_load: %s is shard %d of %d of a sharded "
                      "checkpoint: load its directory", path, f.shard_rank, f.shard_world);
        goto done;
    }
    uint64_t data_len = len - 8 - hlen;
    map = host_calloc(ctx, sizeof *map * (size_t)(total + 1));
    psteps = host_calloc(ctx, sizeof *psteps * (size_t)(opt ? optim_param_count(opt) + 1 : 1));
    if (!map || !psteps) {
        s = set_error(ctx, DT_ENOMEM, "checkpoint_load: out of memory");
        goto done;
    }
    for (int i = 0; s == DT_OK && i < nx; i++)
        s = st_check(ctx, &f, ctx->ckpt_extra[i]->name, ctx->ckpt_extra[i], data_len,
                     &map[ctx->n_params + i]);
    for (int i = 0; s == DT_OK && i < nstate; i++) {
        dt_tensor *t = dt_optim_state_at(opt, i);
        snprintf(key, sizeof key, "optim.%s", t->name);
        s = st_check(ctx, &f, key, t, data_len, &map[ctx->n_params + nx + i]);
    }
    if (s != DT_OK || (s = st_map_params(ctx, &f, data_len, strict, map, &rep)) != DT_OK)
        goto done;
    if (opt) {
        if ((f.seen & ST_OPT_ALL) != ST_OPT_ALL || f.optim_kind != optim_kind(opt)) {
            s = set_error(ctx, DT_EMISMATCH, "checkpoint_load: the file has no state for this "
                                             "kind of optimizer");
            goto done;
        }
        if ((s = st_parse_param_steps(ctx, &f, psteps, optim_param_count(opt))) != DT_OK ||
            (s = optim_check_lrs(opt, f.optim_nlr, path)) != DT_OK)
            goto done;
    }
    const unsigned char *data = buf + 8 + hlen;
    if ((s = st_verify(ctx, path, &f, data)) != DT_OK)
        goto done;
    /* everything checked: now copy */
    for (int i = 0; s == DT_OK && i < total; i++) {
        dt_tensor *t = i < ctx->n_params ? ctx->params[i]
                       : i < ctx->n_params + nx ? ctx->ckpt_extra[i - ctx->n_params]
                                                : dt_optim_state_at(opt, i - ctx->n_params - nx);
        if (map[i])
            s = st_copy(ctx, t, map[i], data);
    }
    if (s == DT_OK && opt) {
        optim_restore_steps(opt, f.optim_steps, psteps);
        optim_set_lrs(opt, f.optim_lr);
        optim_masters_from_params(opt, 1);
    }
    if (s == DT_OK && step_out)
        *step_out = f.step;
    if (s == DT_OK && report)
        *report = rep;
done:
    host_free(ctx, map);
    host_free(ctx, psteps);
    st_file_free(ctx, &f);
    host_free(ctx, buf);
    return s;
}

/* (what peers waiting on this rank see: dt_ctx_activity) */
dt_status dt_checkpoint_load(dt_ctx *ctx, dt_optim *opt, const char *path,
                                const dt_checkpoint_config *cfg, int64_t *step_out,
                                dt_checkpoint_report *report)
{
    dt_ctx *actx = ctx_ok(ctx) ? ctx : NULL;
    int act = ctx_doing(actx, ACT_CKPT_LOAD);
    dt_status s = ckpt_load_run(ctx, opt, path, cfg, step_out, report);
    ctx_done(actx, act);
    return s;
}

dt_status dt_checkpoint_metadata(dt_ctx *ctx, const char *path, const char *key, char *value,
                                 size_t len)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (!path || !key || !value || len == 0)
        return set_error(ctx, DT_EINVAL, "checkpoint_metadata: path, key and a value buffer are "
                         "required");
    unsigned char *buf = NULL;
    size_t flen = 0;
    uint64_t hlen = 0;
    st_file f;
    memset(&f, 0, sizeof f);
    f.want_key = key;
    dt_status s = st_open(ctx, path, &buf, &flen, &f, &hlen);
    if (s == DT_OK && !f.found)
        s = set_error(ctx, DT_EMISMATCH, "checkpoint_metadata: %s has no metadata '%s'", path, key);
    if (s == DT_OK)
        snprintf(value, len, "%s", f.want_val);
    st_file_free(ctx, &f);
    host_free(ctx, buf);
    return s;
}

/* Whether path is a dtrain checkpoint that passes every check of a load;
 * its step then. */
static int ckpt_complete(dt_ctx *ctx, const char *path, int64_t *step)
{
    unsigned char *buf = NULL;
    size_t len = 0;
    uint64_t hlen = 0;
    st_file f;
    memset(&f, 0, sizeof f);
    dt_status s = st_open(ctx, path, &buf, &len, &f, &hlen);
    if (s == DT_OK && !(f.seen & ST_STEP))
        s = set_error(ctx, DT_ECORRUPT, "checkpoint_latest: %s has no dtrain.step", path);
    if (s == DT_OK && (f.seen & ST_SHARD))
        s = set_error(ctx, DT_EINVAL, "checkpoint_latest: %s is one shard of a checkpoint", path);
    if (s == DT_OK && (f.seen & ST_CHECKSUM))
        s = st_verify(ctx, path, &f, buf + 8 + hlen);
    *step = f.step;
    st_file_free(ctx, &f);
    host_free(ctx, buf);
    return s == DT_OK;
}

dt_status dt_checkpoint_latest(dt_ctx *ctx, const char *dir, char *path, size_t cap, int64_t *step)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (!dir || !path || cap == 0)
        return set_error(ctx, DT_EINVAL, "checkpoint_latest: dir and a path buffer are required");
    path[0] = '\0';
    if (step)
        *step = -1;
    DIR *d = opendir(dir);
    if (!d)
        return set_error(ctx, DT_EIO, "checkpoint_latest: cannot read %s: %s", dir,
                         strerror(errno));
    int64_t best = -1;
    size_t dl = strlen(dir);
    dt_status s = DT_OK;
    struct dirent *e;
    while (s == DT_OK && (e = readdir(d)) != NULL) {
        size_t nl = strlen(e->d_name);
        int is_dir = e->d_type == DT_DIR;
        if (e->d_type == DT_UNKNOWN || e->d_type == DT_LNK) {
            struct stat st;
            char probe[4096];
            snprintf(probe, sizeof probe, "%s/%s", dir, e->d_name);
            is_dir = stat(probe, &st) == 0 && S_ISDIR(st.st_mode);
        }
        if (is_dir && e->d_name[0] == '.')
            continue;
        if (!is_dir && (nl < 12 || strcmp(e->d_name + nl - 12, ".safetensors") != 0))
            continue;
        char *full = host_alloc(ctx, dl + nl + 2);
        if (!full) {
            s = set_error(ctx, DT_ENOMEM, "checkpoint_latest: out of memory");
            break;
        }
        snprintf(full, dl + nl + 2, "%s%s%s", dir, dl && dir[dl - 1] == '/' ? "" : "/", e->d_name);
        int64_t at = -1;
        if (is_dir && !ckpt_sharded_complete(ctx, full, &at))
            continue;   /* not a checkpoint, or one not whole: said by its own load */
        if (!is_dir && !ckpt_complete(ctx, full, &at))
            ctx_warn(ctx, "checkpoint_latest: skipping %s: %s", full, dt_last_error(ctx));
        else if (at > best && dl + nl + 2 > cap)
            s = set_error(ctx, DT_EINVAL, "checkpoint_latest: %s does not fit in %zu bytes", full,
                          cap);
        else if (at > best) {
            best = at;
            snprintf(path, cap, "%s", full);
        }
        host_free(ctx, full);
    }
    closedir(d);
    if (s == DT_OK) {
        dt_clear_error(ctx);
        if (step)
            *step = best;
    }
    return s;
}

/* ===========================================================================
 * Sharded checkpoints (a directory; dt_ddp_checkpoint_save in src/zero.c)
 *
 * dir/shard-RRRRR-of-WWWWW.safetensors: rank R's floats of each parameter
 * ("<name>@<lo>", 1-D f32: floats [lo, lo + n) of the flattened tensor) and
 * of its optimizer state ("optim.<param>.<state>@<lo>"), with the single
 * file's checksums, "dtrain.step" and "dtrain.shard" = "R/W".
 * dir/index.json, written last by rank 0: the step, the world, the
 * parameters' names and shapes, the optimizer's kind, steps, learning rate
 * and steps per parameter, and its own CRC-32.  A load reads the index,
 * checks every shard (rank, step, checksums, the pieces tiling each tensor
 * exactly) before it copies anything, then copies into each destination
 * only the floats it wants: any world size, any sharding level.
 * ======================================================================== */

#define SHARD_INDEX "index.json"
#define SHARD_CRC_KEY "\"crc32\":\""
#define SHARD_MAX_INDEX ((size_t)64 << 20)
#define SHARD_MAX_DIR 3800   /* room for "/shard-RRRRR-of-WWWWW.safetensors.tmp" in 4096 */

typedef struct shard_param {
    char name[DT_MAX_NAME];
    int ndim;
    int64_t shape[DT_MAX_DIMS];
    int64_t numel;
} shard_param;

/* index.json */
typedef struct shard_index {
    int64_t step;
    int world, zero;
    int has_optim, kind;
    int64_t steps;
    int nlr;                   /* each parameter group's base lr */
    float lr[DT_OPTIM_MAX_GROUPS];
    int nopt;                  /* the optimizer's parameters, in its order: */
    int64_t *opt_param;        /* their positions in p */
    int64_t *opt_steps;        /* the steps each took */
    int n, cap;
    shard_param *p;
} shard_index;

/* A tensor the shards hold pieces of: a parameter or an optimizer state
 * ("optim.<state name>"), and where a load puts it. */
typedef struct shard_base {
    char name[ST_MAX_KEY];
    int64_t numel;
    dt_tensor *t;              /* destination, or NULL: not loaded */
    int64_t lo, hi;            /* the floats of the whole wanted there */
    int64_t at;                /* the whole's float at t's element 0 */
} shard_base;

typedef struct shard_piece {
    int base, file;
    int64_t lo, n;
    uint64_t begin;            /* in the file's data */
} shard_piece;

struct ckpt_plan {
    dt_ctx *ctx;
    dt_optim *opt;
    char dir[SHARD_MAX_DIR + 1];
    shard_index ix;
    shard_base *base;
    int nbase, capbase;
    shard_piece *pc;
    int npc, cappc;
    uint32_t *hcrc;            /* each file's header checksum, as checked */
    int64_t *opt_steps;        /* per opt parameter, as the load sets them */
    dt_tensor **own;           /* dt_checkpoint_consolidate's tensors (one a base) */
};

static int grow(dt_ctx *ctx, void **p, int *cap, int need, size_t elem)
{
    if (need <= *cap)
        return 1;
    int c = *cap ? *cap * 2 : 16;
    while (c < need)
        c *= 2;
    void *q = ctx->al.realloc_fn(*p, elem * (size_t)c, ctx->al.user);
    if (!q)
        return 0;
    *p = q;
    *cap = c;
    return 1;
}

static void shard_file_name(char *out, size_t cap, const char *dir, int rank, int world)
{
    snprintf(out, cap, "%s/shard-%05d-of-%05d.safetensors", dir, rank, world);
}

static dt_status shard_dir_ok(dt_ctx *ctx, const char *op, const char *dir)
{
    if (!dir || !dir[0])
        return set_error(ctx, DT_EINVAL, "%s: the directory is empty", op);
    if (strlen(dir) > SHARD_MAX_DIR)
        return set_error(ctx, DT_EINVAL, "%s: the directory's name is longer than %d bytes", op,
                         SHARD_MAX_DIR);
    return DT_OK;
}

/* --- writing ---------------------------------------------------------- */

/* This rank's shard file: floats [lo[k], lo[k] + n[k]) of each of ctx's
 * parameters k, and the same floats of each one's optimizer state (whole
 * state, or a sharded optimizer's: its shard must hold them). */
DT_PRIVATE dt_status ckpt_shard_save(dt_ctx *ctx, const dt_optim *opt, const char *dir,
                                     int64_t step, int rank, int world, const int64_t *lo,
                                     const int64_t *n)
{
    if (shard_dir_ok(ctx, "ddp_checkpoint_save", dir) != DT_OK)
        return ctx->last_status;
    if (mkdir(dir, 0777) != 0 && errno != EEXIST)
        return set_error(ctx, DT_EIO, "ddp_checkpoint_save: cannot create %s: %s", dir,
                         strerror(errno));
    char path[4096];
    if (rank == 0) {   /* a crash from here on leaves no index: the directory is not a checkpoint */
        snprintf(path, sizeof path, "%s/" SHARD_INDEX, dir);
        if (unlink(path) != 0 && errno != ENOENT)
            return set_error(ctx, DT_EIO, "ddp_checkpoint_save: cannot remove the old %s: %s",
                             path, strerror(errno));
    }
    int per = opt ? optim_state_per(opt) : 0, cap = ctx->n_params * (1 + per) + 1, total = 0;
    ckpt_item *items = host_calloc(ctx, sizeof *items * (size_t)cap);
    char **names = host_calloc(ctx, sizeof *names * (size_t)cap);
    dt_status s = items && names ? DT_OK : set_error(ctx, DT_ENOMEM, "ddp_checkpoint_save: out of memory");
    for (int k = 0; s == DT_OK && k < ctx->n_params; k++) {
        if (n[k] <= 0)
            continue;
        dt_tensor *p = ctx->params[k];
        int oi = -1;
        for (int i = 0; opt && i < optim_param_count(opt) && oi < 0; i++)
            oi = optim_param_at(opt, i) == p ? i : -1;
        dt_tensor *m = optim_master_of(opt, p);   /* saved in its parameter's place */
        for (int j = -1; s == DT_OK && j < (oi >= 0 ? per : 0); j++) {
            dt_tensor *t = j < 0 ? (m ? m : p) : dt_optim_state_at(opt, oi * per + j);
            int64_t off = lo[k] - ((j >= 0 || m) ? optim_shard_lo(opt, oi) : 0);
            size_t len = strlen(t->name) + 32;
            if (off < 0 || off + n[k] > dt_tensor_numel(t)) {
                s = set_error(ctx, DT_EINVAL, "ddp_checkpoint_save: the optimizer's shard of '%s' "
                              "is not this rank's", p->name);
            } else if (!(names[total] = host_alloc(ctx, len))) {
                s = set_error(ctx, DT_ENOMEM, "ddp_checkpoint_save: out of memory");
            } else {
                snprintf(names[total], len, "%s%s@%lld", j < 0 ? "" : "optim.",
                         j < 0 ? p->name : t->name, (long long)lo[k]);
                items[total] = (ckpt_item){names[total], t, DT_F32, off, n[k]};
                total++;
            }
        }
    }
    ckpt_meta m = {.step = step, .shard_rank = rank, .shard_world = world};
    shard_file_name(path, sizeof path, dir, rank, world);
    if (s == DT_OK)
        s = ckpt_write_file(ctx, path, &m, items, total);
    for (int i = 0; names && i < total; i++)
        host_free(ctx, names[i]);
    host_free(ctx, names);
    host_free(ctx, items);
    return s;
}

static void index_json(strbuf *b, const dt_ctx *ctx, const dt_optim *opt, int64_t step, int world,
                       int zero)
{
    strbuf_printf(b, "{\"format\":\"dtrain-sharded\",\"version\":1,\"step\":%lld,\"world\":%d,"
                  "\"zero\":%d,\n\"params\":[", (long long)step, world, zero);
    for (int k = 0; k < ctx->n_params; k++) {
        const dt_tensor *p = ctx->params[k];
        strbuf_printf(b, "%s\n {\"name\":", k ? "," : "");
        strbuf_json_string(b, p->name);
        strbuf_puts(b, ",\"shape\":[");
        for (int d = 0; d < p->ndim; d++)
            strbuf_printf(b, "%s%lld", d ? "," : "", (long long)p->shape[d]);
        strbuf_puts(b, "]}");
    }
    strbuf_puts(b, "],\n");
    if (opt) {
        ckpt_meta m = ckpt_meta_of(opt, step, NULL);
        strbuf_printf(b, "\"optimizer\":{\"kind\":%d,\"steps\":%lld,\"lr\":\"",
                      optim_kind(opt), (long long)dt_optim_steps(opt));
        ckpt_put_lrs(b, m.lr, m.nlr);
        strbuf_puts(b, "\",\"params\":[");
        for (int i = 0; i < optim_param_count(opt); i++)
            strbuf_printf(b, "%s%d", i ? "," : "", optim_param_at(opt, i)->param_index);
        strbuf_puts(b, "],\"param_steps\":[");
        for (int i = 0; i < optim_param_count(opt); i++)
            strbuf_printf(b, "%s%lld", i ? "," : "", (long long)optim_param_steps(opt)[i]);
        strbuf_puts(b, "]},\n");
    }
    strbuf_puts(b, "\"files\":[");
    for (int r = 0; r < world; r++)
        strbuf_printf(b, "%s\"shard-%05d-of-%05d.safetensors\"", r ? "," : "", r, world);
    strbuf_puts(b, "],\n" SHARD_CRC_KEY "00000000\"}\n");
}

/* dir/index.json, last: what makes dir a checkpoint. */
DT_PRIVATE dt_status ckpt_shard_index_save(dt_ctx *ctx, const dt_optim *opt, const char *dir,
                                           int64_t step, int world, int zero)
{
    strbuf b = {ctx, NULL, 0, 0, 0};
    index_json(&b, ctx, opt, step, world, zero);
    if (b.oom) {
        host_free(ctx, b.p);
        return set_error(ctx, DT_ENOMEM, "ddp_checkpoint_save: out of memory for the index");
    }
    uint32_t crc = crc_zeroed_field((unsigned char *)b.p, b.len, SHARD_CRC_KEY);
    char hex[9];
    snprintf(hex, sizeof hex, "%08x", (unsigned)crc);
    memcpy(strstr(b.p, SHARD_CRC_KEY) + strlen(SHARD_CRC_KEY), hex, 8);
    char path[4096], tmp[4100];
    snprintf(path, sizeof path, "%s/" SHARD_INDEX, dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    dt_status s = f ? write_all(ctx, f, b.p, b.len, tmp)
                    : set_error(ctx, DT_EIO, "ddp_checkpoint_save: cannot create %s: %s", tmp,
                                strerror(errno));
    if (f && s == DT_OK && (fflush(f) != 0 || fsync(fileno(f)) != 0))
        s = set_error(ctx, DT_EIO, "ddp_checkpoint_save: syncing %s: %s", tmp, strerror(errno));
    if (f && fclose(f) != 0 && s == DT_OK)
        s = set_error(ctx, DT_EIO, "ddp_checkpoint_save: closing %s: %s", tmp, strerror(errno));
    if (s == DT_OK && rename(tmp, path) != 0)
        s = set_error(ctx, DT_EIO, "ddp_checkpoint_save: renaming %s: %s", tmp, strerror(errno));
    if (s == DT_OK)
        sync_parent_dir(path);
    else if (f)
        unlink(tmp);
    host_free(ctx, b.p);
    return s;
}

/* --- reading the index ---------------------------------------------------- */

static int js_uint_list(json *j, dt_ctx *ctx, int64_t **out, int *n)
{
    int cap = 0;
    *n = 0;
    if (!js_char(j, '['))
        return 0;
    if (js_char(j, ']'))
        return 1;
    do {
        uint64_t v;
        if (!js_uint(j, &v) || v > ((uint64_t)1 << 62))
            return 0;
        if (!grow(ctx, (void **)out, &cap, *n + 1, sizeof **out))
            return -1;
        (*out)[(*n)++] = (int64_t)v;
    } while (js_char(j, ','));
    return js_char(j, ']');
}

static int index_param(json *j, shard_param *p)
{
    int have_name = 0, have_shape = 0;
    if (!js_char(j, '{'))
        return 0;
    do {
        char key[16];
        if (!js_string(j, key, sizeof key) || !js_char(j, ':'))
            return 0;
        if (strcmp(key, "name") == 0) {
            if (!js_string(j, p->name, sizeof p->name) || !p->name[0])
                return 0;
            have_name = 1;
        } else if (strcmp(key, "shape") == 0) {
            if (!js_shape(j, &p->ndim, p->shape))
                return 0;
            p->numel = 1;
            for (int d = 0; d < p->ndim; d++)
                if ((p->numel *= p->shape[d]) > ((int64_t)1 << 40))
                    return 0;
            have_shape = 1;
        } else {
            return 0;
        }
    } while (js_char(j, ','));
    return js_char(j, '}') && have_name && have_shape;
}

static int index_optim(json *j, dt_ctx *ctx, shard_index *ix)
{
    int n_steps = -1, seen = 0;
    if (!js_char(j, '{'))
        return 0;
    do {
        char key[16], lr[DT_OPTIM_MAX_GROUPS * 20];
        uint64_t v;
        int r = 1;
        if (!js_string(j, key, sizeof key) || !js_char(j, ':'))
            return 0;
        if (strcmp(key, "kind") == 0 && (r = js_uint(j, &v)) && v <= DT_ADAGRAD)
            ix->kind = (int)v, seen |= 1;
        else if (strcmp(key, "steps") == 0 && (r = js_uint(j, &v)) && v < ((uint64_t)1 << 62))
            ix->steps = (int64_t)v, seen |= 2;
        else if (strcmp(key, "lr") == 0 && (r = js_string(j, lr, sizeof lr))) {
            r = ckpt_parse_lrs(lr, ix->lr, &ix->nlr);
            seen |= 4;
        } else if (strcmp(key, "params") == 0 && (r = js_uint_list(j, ctx, &ix->opt_param, &ix->nopt)) > 0)
            seen |= 8;
        else if (strcmp(key, "param_steps") == 0 && (r = js_uint_list(j, ctx, &ix->opt_steps, &n_steps)) > 0)
            seen |= 16;
        else
            return r < 0 ? -1 : 0;
        if (r <= 0)
            return r;
    } while (js_char(j, ','));
    ix->has_optim = 1;
    return js_char(j, '}') && seen == 31 && n_steps == ix->nopt;
}

static int index_files(json *j, int world)
{
    int r = 0;
    if (!js_char(j, '['))
        return 0;
    do {
        char name[64], want[64];
        snprintf(want, sizeof want, "shard-%05d-of-%05d.safetensors", r, world);
        if (!js_string(j, name, sizeof name) || strcmp(name, want) != 0)
            return 0;
        r++;
    } while (js_char(j, ','));
    return js_char(j, ']') && r == world;
}

/* The index's text, parsed: 1 ok, 0 malformed, -1 out of memory. */
static int index_parse(dt_ctx *ctx, const char *text, size_t len, shard_index *ix, uint32_t *crc)
{
    json j = {text, text + len, 0};
    unsigned seen = 0;
    int r = 1;
    if (!js_char(&j, '{'))
        return 0;
    do {
        char key[16], val[32];
        uint64_t v = 0;
        if (!js_string(&j, key, sizeof key) || !js_char(&j, ':'))
            return 0;
        if (strcmp(key, "format") == 0)
            r = js_string(&j, val, sizeof val) && strcmp(val, "dtrain-sharded") == 0, seen |= 1;
        else if (strcmp(key, "version") == 0)
            r = js_uint(&j, &v) && v == 1, seen |= 2;
        else if (strcmp(key, "step") == 0)
            r = js_uint(&j, &v) && v < ((uint64_t)1 << 62), ix->step = (int64_t)v, seen |= 4;
        else if (strcmp(key, "world") == 0)
            r = js_uint(&j, &v) && v >= 1 && v <= 99999, ix->world = (int)v, seen |= 8;
        else if (strcmp(key, "zero") == 0)
            r = js_uint(&j, &v) && v <= 3, ix->zero = (int)v, seen |= 16;
        else if (strcmp(key, "optimizer") == 0)
            r = index_optim(&j, ctx, ix);
        else if (strcmp(key, "files") == 0)
            r = (seen & 8) && index_files(&j, ix->world), seen |= 32;
        else if (strcmp(key, "crc32") == 0)
            r = js_string(&j, val, sizeof val) && meta_crc(val, crc), seen |= 64;
        else if (strcmp(key, "params") == 0) {
            seen |= 128;
            if (!js_char(&j, '['))
                return 0;
            if (js_char(&j, ']'))
                continue;
            do {
                if (!grow(ctx, (void **)&ix->p, &ix->cap, ix->n + 1, sizeof *ix->p))
                    return -1;
                memset(&ix->p[ix->n], 0, sizeof ix->p[0]);
                if (!index_param(&j, &ix->p[ix->n++]))
                    return 0;
            } while (js_char(&j, ','));
            r = js_char(&j, ']');
        } else {
            return 0;
        }
        if (r <= 0)
            return r;
    } while (js_char(&j, ','));
    if (!js_char(&j, '}') || seen != 255)
        return 0;
    js_ws(&j);
    for (int i = 0; i < ix->nopt; i++)
        if (ix->opt_param[i] >= ix->n || ix->opt_steps[i] > ix->steps)
            return 0;
    return j.p == j.end;
}

static dt_status index_read(dt_ctx *ctx, const char *op, const char *dir, shard_index *ix)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/" SHARD_INDEX, dir);
    struct stat st;
    if (stat(path, &st) != 0)
        return set_error(ctx, DT_EIO, "%s: %s has no %s (%s): not a sharded checkpoint, or one "
                         "whose saving did not finish", op, dir, SHARD_INDEX, strerror(errno));
    if ((size_t)st.st_size > SHARD_MAX_INDEX)
        return set_error(ctx, DT_ECORRUPT, "%s: %s is larger than %zu bytes", op, path,
                         SHARD_MAX_INDEX);
    unsigned char *buf = NULL;
    size_t len = 0;
    dt_status s = read_file(ctx, op, path, &buf, &len);
    if (s != DT_OK)
        return s;
    uint32_t want = 0, got = crc_zeroed_field(buf, len, SHARD_CRC_KEY);
    int r = index_parse(ctx, (const char *)buf, len, ix, &want);
    if (r < 0)
        s = set_error(ctx, DT_ENOMEM, "%s: out of memory", op);
    else if (r == 0)
        s = set_error(ctx, DT_ECORRUPT, "%s: %s is malformed", op, path);
    else if (want != got)
        s = set_error(ctx, DT_ECORRUPT, "%s: %s does not match its checksum (%08x, it says "
                      "%08x): the file is corrupt", op, path, (unsigned)got, (unsigned)want);
    host_free(ctx, buf);
    return s;
}

/* --- checking the shards -------------------------------------------------- */

static int plan_base_find(const ckpt_plan *pl, const char *name)
{
    for (int b = 0; b < pl->nbase; b++)
        if (strcmp(pl->base[b].name, name) == 0)
            return b;
    return -1;
}

static int plan_base_add(ckpt_plan *pl, const char *name, int64_t numel)
{
    if (!grow(pl->ctx, (void **)&pl->base, &pl->capbase, pl->nbase + 1, sizeof *pl->base))
        return -1;
    shard_base *b = &pl->base[pl->nbase];
    memset(b, 0, sizeof *b);
    snprintf(b->name, sizeof b->name, "%s", name);
    b->numel = numel;
    return pl->nbase++;
}

/* The base a shard's entry belongs to: "<param>@<lo>" or
 * "optim.<param>.<state>@<lo>" with <param> in the index; -1 none. */
static int plan_entry_base(ckpt_plan *pl, const st_entry *e, int64_t *lo, int *oom)
{
    char name[sizeof e->name];
    snprintf(name, sizeof name, "%s", e->name);
    char *at = strrchr(name, '@');
    if (!at || !meta_i64(at + 1, lo))
        return -1;
    *at = '\0';
    int b = plan_base_find(pl, name);
    if (b >= 0 || strncmp(name, "optim.", 6) != 0)
        return b;
    char *dot = strrchr(name + 6, '.');
    if (!dot)
        return -1;
    *dot = '\0';   /* <param> */
    int p = plan_base_find(pl, name + 6);
    *dot = '.';
    if (p < 0 || p >= pl->ix.n)
        return -1;
    b = plan_base_add(pl, name, pl->base[p].numel);
    *oom = b < 0;
    return b;
}

static dt_status plan_file_pieces(ckpt_plan *pl, int r, const char *path, const st_file *f)
{
    dt_ctx *ctx = pl->ctx;
    for (int i = 0; i < f->n; i++) {
        const st_entry *e = &f->e[i];
        int64_t lo = 0;
        int oom = 0, b = plan_entry_base(pl, e, &lo, &oom);
        if (oom)
            return set_error(ctx, DT_ENOMEM, "checkpoint_load: out of memory");
        if (b < 0)
            return set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s holds '%s', which is no piece "
                             "of a parameter in %s or of its optimizer state", path, e->name,
                             SHARD_INDEX);
        if (e->dtype != DT_F32 || e->ndim != 1 || lo + e->shape[0] > pl->base[b].numel)
            return set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s: '%s' is not an F32 piece "
                             "within the %lld floats of '%s'", path, e->name,
                             (long long)pl->base[b].numel, pl->base[b].name);
        if (!grow(ctx, (void **)&pl->pc, &pl->cappc, pl->npc + 1, sizeof *pl->pc))
            return set_error(ctx, DT_ENOMEM, "checkpoint_load: out of memory");
        pl->pc[pl->npc++] = (shard_piece){b, r, lo, e->shape[0], e->begin};
    }
    return DT_OK;
}

/* Shard r, read and checked whole: f and its buffer for the caller. */
static dt_status plan_open(ckpt_plan *pl, int r, st_file *f, unsigned char **buf, uint64_t *hlen)
{
    dt_ctx *ctx = pl->ctx;
    char path[4096];
    size_t len = 0;
    shard_file_name(path, sizeof path, pl->dir, r, pl->ix.world);
    memset(f, 0, sizeof *f);
    if (access(path, F_OK) != 0)
        return set_error(ctx, DT_EIO, "checkpoint_load: shard %d of %d, %s, is missing", r,
                         pl->ix.world, path);
    dt_status s = st_open(ctx, path, buf, &len, f, hlen);
    if (s == DT_OK)
        s = st_verify(ctx, path, f, *buf + 8 + *hlen);
    if (s != DT_OK)
        return s;
    if (!(f->seen & ST_SHARD) || f->shard_rank != r || f->shard_world != pl->ix.world)
        return set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s is not shard %d of %d (%s)", path,
                         r, pl->ix.world, (f->seen & ST_SHARD) ? "it says another" : "it says none");
    if (f->step != pl->ix.step)
        return set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s is from step %lld, %s from step "
                         "%lld: a stale shard (a save that did not finish?)", path,
                         (long long)f->step, SHARD_INDEX, (long long)pl->ix.step);
    if (pl->hcrc[r] && pl->hcrc[r] != f->header_crc)
        return set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s changed while it was loaded", path);
    pl->hcrc[r] = f->header_crc;
    return DT_OK;
}

static int piece_order(const void *x, const void *y)
{
    const shard_piece *a = x, *b = y;
    return a->base != b->base ? (a->base < b->base ? -1 : 1) : a->lo < b->lo ? -1 : a->lo > b->lo;
}

/* Every base's pieces tile it: from 0 to its end, no gap, no overlap. */
static dt_status plan_tiles(ckpt_plan *pl)
{
    qsort(pl->pc, (size_t)pl->npc, sizeof *pl->pc, piece_order);
    for (int b = 0, i = 0; b < pl->nbase; b++) {
        int64_t at = 0;
        for (; i < pl->npc && pl->pc[i].base == b; i++) {
            if (pl->pc[i].lo != at)
                return set_error(pl->ctx, DT_ECORRUPT, "checkpoint_load: %s: the shards' pieces of "
                                 "'%s' %s at float %lld", pl->dir, pl->base[b].name,
                                 pl->pc[i].lo < at ? "overlap" : "leave a gap", (long long)at);
            at += pl->pc[i].n;
        }
        if (at != pl->base[b].numel)
            return set_error(pl->ctx, DT_ECORRUPT, "checkpoint_load: %s: the shards hold %lld of "
                             "the %lld floats of '%s'", pl->dir, (long long)at,
                             (long long)pl->base[b].numel, pl->base[b].name);
    }
    return DT_OK;
}

/* Where the model's parameters (plo/pn: the floats each wants, NULL all)
 * and opt's state go. */
static dt_status plan_dests(ckpt_plan *pl, const int64_t *plo, const int64_t *pn)
{
    dt_ctx *ctx = pl->ctx;
    char sb[96];
    for (int k = 0; k < ctx->n_params; k++) {
        dt_tensor *p = ctx->params[k];
        int b = plan_base_find(pl, p->name);
        if (b < 0 || b >= pl->ix.n)
            return set_error(ctx, DT_EMISMATCH, "checkpoint_load: '%s' is missing from %s",
                             p->name, pl->dir);
        const shard_param *q = &pl->ix.p[b];
        int same = q->ndim == p->ndim;
        for (int d = 0; same && d < p->ndim; d++)
            same = q->shape[d] == p->shape[d];
        if (!same)
            return set_error(ctx, DT_EMISMATCH, "checkpoint_load: '%s' has another shape in %s "
                             "than the model's %s", p->name, pl->dir, SHAPE(p, sb));
        int64_t lo = plo ? plo[k] : 0, hi = plo ? plo[k] + pn[k] : q->numel;
        pl->base[b] = (shard_base){.numel = q->numel, .t = p, .lo = lo, .hi = hi, .at = 0};
        snprintf(pl->base[b].name, sizeof pl->base[b].name, "%s", p->name);
    }
    if (pl->ix.n != ctx->n_params)
        return set_error(ctx, DT_EMISMATCH, "checkpoint_load: %s has %d parameters, the model %d",
                         pl->dir, pl->ix.n, ctx->n_params);
    dt_optim *o = pl->opt;
    if (!o)
        return DT_OK;
    if (!pl->ix.has_optim || pl->ix.kind != optim_kind(o))
        return set_error(ctx, DT_EMISMATCH, "checkpoint_load: %s has no state for this kind of "
                         "optimizer", pl->dir);
    if (optim_check_lrs(o, pl->ix.nlr, pl->dir) != DT_OK)
        return ctx->last_status;
    for (int i = 0; i < optim_param_count(o); i++) {
        const char *pname = optim_param_at(o, i)->name;
        int found = -1;
        for (int q = 0; q < pl->ix.nopt && found < 0; q++)
            found = strcmp(pl->ix.p[pl->ix.opt_param[q]].name, pname) == 0 ? q : -1;
        if (found < 0)
            return set_error(ctx, DT_EMISMATCH, "checkpoint_load: %s has no optimizer state for "
                             "'%s'", pl->dir, pname);
        pl->opt_steps[i] = pl->ix.opt_steps[found];
        for (int j = 0; j < optim_state_per(o); j++) {
            dt_tensor *t = dt_optim_state_at(o, i * optim_state_per(o) + j);
            char name[ST_MAX_KEY];
            snprintf(name, sizeof name, "optim.%s", t->name);
            int b = plan_base_find(pl, name);
            if (b < 0)
                return set_error(ctx, DT_EMISMATCH, "checkpoint_load: %s has no '%s'", pl->dir, name);
            int64_t at = optim_shard_lo(o, i);
            pl->base[b].t = t;
            pl->base[b].at = at;
            pl->base[b].lo = at;
            pl->base[b].hi = at + dt_tensor_numel(t);
        }
    }
    return DT_OK;
}

DT_PRIVATE void ckpt_plan_free(ckpt_plan *pl)
{
    if (!pl)
        return;
    dt_ctx *ctx = pl->ctx;
    for (int b = 0; pl->own && b < pl->nbase; b++)
        if (pl->own[b])
            tensor_destroy(ctx, pl->own[b]);
    host_free(ctx, pl->own);
    host_free(ctx, pl->ix.p);
    host_free(ctx, pl->ix.opt_param);
    host_free(ctx, pl->ix.opt_steps);
    host_free(ctx, pl->base);
    host_free(ctx, pl->pc);
    host_free(ctx, pl->hcrc);
    host_free(ctx, pl->opt_steps);
    host_free(ctx, pl);
}

/* The index and every shard checked (layout, checksums, rank, step, the
 * pieces tiling every tensor), nothing copied yet.  model: the context's
 * parameters (plo/pn the floats each wants, NULL all of each) and opt's
 * state are the destinations; else none yet (consolidation).  NULL on
 * failure (the context's error). */
static ckpt_plan *plan_make(dt_ctx *ctx, dt_optim *opt, const char *dir, int model,
                            const int64_t *plo, const int64_t *pn)
{
    if (shard_dir_ok(ctx, "checkpoint_load", dir) != DT_OK)
        return NULL;
    ckpt_plan *pl = host_calloc(ctx, sizeof *pl);
    if (!pl) {
        set_error(ctx, DT_ENOMEM, "checkpoint_load: out of memory");
        return NULL;
    }
    pl->ctx = ctx;
    pl->opt = opt;
    snprintf(pl->dir, sizeof pl->dir, "%s", dir);
    dt_status s = index_read(ctx, "checkpoint_load", dir, &pl->ix);
    if (s == DT_OK && (!(pl->hcrc = host_calloc(ctx, sizeof *pl->hcrc * (size_t)pl->ix.world)) ||
                       !(pl->opt_steps = host_calloc(ctx, sizeof(int64_t) * (size_t)(opt ? optim_param_count(opt) + 1 : 1)))))
        s = set_error(ctx, DT_ENOMEM, "checkpoint_load: out of memory");
    for (int q = 0; s == DT_OK && q < pl->ix.n; q++) {
        if (plan_base_find(pl, pl->ix.p[q].name) >= 0)
            s = set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s/%s names '%s' twice", dir,
                          SHARD_INDEX, pl->ix.p[q].name);
        else if (plan_base_add(pl, pl->ix.p[q].name, pl->ix.p[q].numel) < 0)
            s = set_error(ctx, DT_ENOMEM, "checkpoint_load: out of memory");
    }
    for (int r = 0; s == DT_OK && r < pl->ix.world; r++) {
        st_file f;
        unsigned char *buf = NULL;
        uint64_t hlen = 0;
        char path[4096];
        shard_file_name(path, sizeof path, dir, r, pl->ix.world);
        s = plan_open(pl, r, &f, &buf, &hlen);
        if (s == DT_OK)
            s = plan_file_pieces(pl, r, path, &f);
        st_file_free(ctx, &f);
        host_free(ctx, buf);
    }
    if (s == DT_OK)
        s = plan_tiles(pl);
    if (s == DT_OK && model)
        s = plan_dests(pl, plo, pn);
    if (s != DT_OK) {
        ckpt_plan_free(pl);
        return NULL;
    }
    return pl;
}

DT_PRIVATE ckpt_plan *ckpt_plan_make(dt_ctx *ctx, dt_optim *opt, const char *dir,
                                     const int64_t *plo, const int64_t *pn)
{
    return plan_make(ctx, opt, dir, 1, plo, pn);
}

/* --- copying ---------------------------------------------------------------- */

static int plan_file_needed(const ckpt_plan *pl, int r)
{
    for (int i = 0; i < pl->npc; i++) {
        const shard_piece *c = &pl->pc[i];
        const shard_base *b = &pl->base[c->base];
        if (c->file == r && b->t && c->lo < b->hi && c->lo + c->n > b->lo)
            return 1;
    }
    return 0;
}

static dt_status plan_copy_file(ckpt_plan *pl, int r, const unsigned char *data)
{
    dt_status s = DT_OK;
    for (int i = 0; s == DT_OK && i < pl->npc; i++) {
        const shard_piece *c = &pl->pc[i];
        const shard_base *b = &pl->base[c->base];
        int64_t a = c->lo > b->lo ? c->lo : b->lo, e = c->lo + c->n < b->hi ? c->lo + c->n : b->hi;
        if (c->file != r || !b->t || e <= a)
            continue;
        s = ckpt_put(pl->ctx, b->t, a - b->at, data + c->begin + (uint64_t)(a - c->lo) * 4, e - a);
    }
    return s;
}

/* Copy what the plan found into its destinations; each shard a rank needs
 * is read and checked again (it must be the file checked before). */
DT_PRIVATE dt_status ckpt_plan_apply(ckpt_plan *pl, int64_t *step_out)
{
    dt_ctx *ctx = pl->ctx;
    for (int b = 0; b < pl->nbase; b++)
        if (pl->base[b].t) {   /* a lazy state's other floats are its zeros */
            tensor_materialize(pl->base[b].t);
            tensor_mark_zero(pl->base[b].t, 0);
        }
    dt_status s = DT_OK;
    for (int r = 0; s == DT_OK && r < pl->ix.world; r++) {
        if (!plan_file_needed(pl, r))
            continue;
        st_file f;
        unsigned char *buf = NULL;
        uint64_t hlen = 0;
        s = plan_open(pl, r, &f, &buf, &hlen);
        if (s == DT_OK)
            s = plan_copy_file(pl, r, buf + 8 + hlen);
        st_file_free(ctx, &f);
        host_free(ctx, buf);
    }
    dt_optim *o = pl->opt;
    if (s == DT_OK && o) {
        optim_restore_steps(o, pl->ix.steps, pl->opt_steps);
        optim_set_lrs(o, pl->ix.lr);
    }
    if (s == DT_OK && step_out)
        *step_out = pl->ix.step;
    return s;
}

/* dt_checkpoint_load of a directory: every parameter and opt's state whole. */
static dt_status ckpt_load_sharded(dt_ctx *ctx, dt_optim *opt, const char *dir, int64_t *step_out)
{
    if (opt && optim_is_sharded(opt))
        return set_error(ctx, DT_EINVAL, "checkpoint_load: the optimizer's state is sharded "
                         "(dt_ddp_config.zero): load with dt_ddp_checkpoint_load");
    ckpt_plan *pl = ckpt_plan_make(ctx, opt, dir, NULL, NULL);
    if (!pl)
        return ctx->last_status;
    dt_status s = ckpt_plan_apply(pl, step_out);
    ckpt_plan_free(pl);
    if (s == DT_OK)
        optim_masters_from_params(opt, 1);
    return s;
}

/* --- consolidation ------------------------------------------------------ */

static dt_status consolidate_tensors(ckpt_plan *pl)
{
    dt_ctx *ctx = pl->ctx;
    if (!(pl->own = host_calloc(ctx, sizeof *pl->own * (size_t)(pl->nbase + 1))))
        return set_error(ctx, DT_ENOMEM, "checkpoint_consolidate: out of memory");
    for (int b = 0; b < pl->nbase; b++) {
        const shard_param *q = b < pl->ix.n ? &pl->ix.p[b] : NULL;
        if (!q) {   /* a state: its parameter's shape */
            char name[ST_MAX_KEY];
            snprintf(name, sizeof name, "%s", pl->base[b].name + 6);
            *strrchr(name, '.') = '\0';
            q = &pl->ix.p[plan_base_find(pl, name)];
        }
        if (!(pl->own[b] = tensor_owned_new(ctx, q->ndim, q->shape, pl->base[b].name, "", 1)))
            return set_error(ctx, DT_ENOMEM, "checkpoint_consolidate: out of memory for '%s'",
                             pl->base[b].name);
        pl->base[b].t = pl->own[b];
        pl->base[b].hi = pl->base[b].numel;
    }
    return DT_OK;
}

/* The load's checks name the load; a consolidation that failed in them
 * says it was the consolidation. */
static dt_status ckpt_consolidate_failed(dt_ctx *ctx)
{
    static const char load[] = "checkpoint_load: ";
    if (strncmp(ctx->err, load, sizeof load - 1) != 0)
        return ctx->last_status;
    char why[DT_MAX_ERROR];
    snprintf(why, sizeof why, "%s", ctx->err + sizeof load - 1);
    return set_error(ctx, ctx->last_status, "checkpoint_consolidate: %s", why);
}

dt_status dt_checkpoint_consolidate(dt_ctx *ctx, const char *dir, const char *path)
{
    if (!ctx_ok(ctx))
        return DT_EINVAL;
    if (!path || !path[0])
        return set_error(ctx, DT_EINVAL, "checkpoint_consolidate: path is empty");
    ckpt_plan *pl = plan_make(ctx, NULL, dir, 0, NULL, NULL);
    if (!pl)
        return ckpt_consolidate_failed(ctx);
    ckpt_item *items = host_calloc(ctx, sizeof *items * (size_t)(pl->nbase + 1));
    int64_t *psteps = host_calloc(ctx, sizeof *psteps * (size_t)(pl->ix.nopt + 1));
    dt_status s = items && psteps ? consolidate_tensors(pl)
                                  : set_error(ctx, DT_ENOMEM, "checkpoint_consolidate: out of memory");
    if (s == DT_OK)
        s = ckpt_plan_apply(pl, NULL);
    for (int b = 0; s == DT_OK && b < pl->nbase; b++)   /* a state's base name is its key */
        items[b] = (ckpt_item){pl->base[b].name, pl->own[b], DT_F32, 0, -1};
    for (int i = 0; s == DT_OK && i < pl->ix.nopt; i++)
        psteps[i] = pl->ix.opt_steps[i];
    ckpt_meta m = {.step = pl->ix.step, .has_optim = pl->ix.has_optim, .kind = pl->ix.kind,
                   .steps = pl->ix.steps, .nlr = pl->ix.nlr, .n = pl->ix.nopt, .param_steps = psteps};
    memcpy(m.lr, pl->ix.lr, sizeof m.lr);
    if (s == DT_OK)
        s = ckpt_write_file(ctx, path, &m, items, pl->nbase);
    host_free(ctx, items);
    host_free(ctx, psteps);
    ckpt_plan_free(pl);
    return s == DT_OK ? DT_OK : ckpt_consolidate_failed(ctx);
}

/* Whether dir is a sharded checkpoint that passes every check of a load
 * (a directory without an index is no checkpoint, and says nothing). */
static int ckpt_sharded_complete(dt_ctx *ctx, const char *dir, int64_t *step)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/" SHARD_INDEX, dir);
    if (strlen(dir) > SHARD_MAX_DIR || access(path, F_OK) != 0)
        return 0;
    ckpt_plan *pl = plan_make(ctx, NULL, dir, 0, NULL, NULL);
    if (!pl) {
        ctx_warn(ctx, "checkpoint_latest: skipping %s: %s", dir, dt_last_error(ctx));
        return 0;
    }
    *step = pl->ix.step;
    ckpt_plan_free(pl);
    return 1;
}
