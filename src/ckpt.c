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

static uint64_t st_bytes(const dt_tensor *t, dt_dtype store)
{
    return (uint64_t)dt_tensor_numel(t) * (store == DT_F32 ? 4 : 2);
}

/* What a checkpoint holds: the parameters (stored as `store`), the extra
 * tensors and the optimizer's state (f32). */
static int ckpt_items(dt_ctx *ctx, const dt_optim *opt, dt_dtype store, ckpt_item *items,
                      char **names)
{
    int n = 0;
    for (int i = 0; i < ctx->n_params; i++)
        items[n++] = (ckpt_item){ctx->params[i]->name, ctx->params[i], store};
    for (int i = 0; i < ctx->n_ckpt_extra; i++)
        items[n++] = (ckpt_item){ctx->ckpt_extra[i]->name, ctx->ckpt_extra[i], DT_F32};
    if (opt) {
        for (int i = 0; i < opt->n * opt->per; i++) {
            size_t len = strlen(opt->state[i]->name) + 7;
            names[i] = host_alloc(ctx, len);
            if (!names[i])
                return -1;
            snprintf(names[i], len, "optim.%s", opt->state[i]->name);
            items[n++] = (ckpt_item){names[i], opt->state[i], DT_F32};
        }
    }
    return n;
}

/* The checksum of a header whose dtrain.header_crc32 field is taken as
 * 00000000 (h is changed while it runs, and restored). */
static uint32_t st_header_crc(unsigned char *h, size_t len)
{
    static const char key[] = "\"dtrain.header_crc32\":\"";
    unsigned char *at = memmem(h, len, key, sizeof key - 1), keep[8];
    if (!at || (size_t)(at - h) + sizeof key - 1 + 8 > len)
        return 0;
    at += sizeof key - 1;
    memcpy(keep, at, 8);
    memset(at, '0', 8);
    uint32_t crc = (uint32_t)crc32_z(0, h, len);
    memcpy(at, keep, 8);
    return crc;
}

#define ST_HEADER_CRC_KEY "\"dtrain.header_crc32\":\""

/* The JSON header; crc: each item's data checksum (NULL: zeros, the same
 * length, for a first pass written before the data); hcrc: the header's
 * own, computed with this field 00000000 (st_header_crc). */
static void ckpt_header(strbuf *b, const dt_optim *opt, int64_t step, const ckpt_item *items, int n,
                        const dt_checkpoint_config *cfg, const uint32_t *crc, uint32_t hcrc)
{
    strbuf_printf(b, "{\"__metadata__\":{\"format\":\"pt\",\"dtrain.step\":\"%lld\","
                  "\"dtrain.checksum\":\"crc32\"," ST_HEADER_CRC_KEY "%08x\"", (long long)step,
                  (unsigned)hcrc);
    for (int i = 0; i < n; i++) {
        strbuf_puts(b, ",\"dtrain.crc32.");
        strbuf_json_body(b, items[i].name);
        strbuf_printf(b, "\":\"%08x\"", crc ? (unsigned)crc[i] : 0u);
    }
    for (int i = 0; i < cfg->n_meta; i++) {
        strbuf_puts(b, ",");
        strbuf_json_string(b, cfg->meta_keys[i]);
        strbuf_puts(b, ":");
        strbuf_json_string(b, cfg->meta_values[i]);
    }
    if (opt) {
        strbuf_printf(b, ",\"dtrain.optim.kind\":\"%d\",\"dtrain.optim.steps\":\"%lld\","
                     "\"dtrain.optim.lr\":\"%.9g\",\"dtrain.optim.param_steps\":\"",
                      (int)opt->cfg.kind, (long long)opt->steps, (double)opt->base_lr);
        for (int i = 0; i < opt->n; i++)
            strbuf_printf(b, "%s%lld", i ? "," : "", (long long)opt->param_steps[i]);
        strbuf_puts(b, "\"");
    }
    strbuf_puts(b, "}");
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        dt_tensor *t = items[i].t;
        strbuf_puts(b, ",");
        strbuf_json_string(b, items[i].name);
        strbuf_printf(b, ":{\"dtype\":\"%s\",\"shape\":[", st_dtype_name(items[i].store));
        for (int d = 0; d < t->ndim; d++)
            strbuf_printf(b, "%s%lld", d ? "," : "", (long long)t->shape[d]);
        uint64_t bytes = st_bytes(t, items[i].store);
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
static dt_status ckpt_write(dt_ctx *ctx, FILE *f, const char *tmp, const strbuf *hdr,
                            const ckpt_item *items, int n, uint32_t *crc)
{
    unsigned char len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (unsigned char)((uint64_t)hdr->len >> (8 * i));
    dt_status s = write_all(ctx, f, len8, 8, tmp);
    if (s == DT_OK)
        s = write_all(ctx, f, hdr->p, hdr->len, tmp);
    size_t biggest = 0;
    for (int i = 0; i < n; i++)
        if (tensor_bytes(items[i].t) > biggest)
            biggest = tensor_bytes(items[i].t);
    void *stage = s == DT_OK ? host_alloc(ctx, biggest) : NULL;
    if (s == DT_OK && !stage)
        s = set_error(ctx, DT_ENOMEM, "checkpoint_save: out of memory");
    for (int i = 0; s == DT_OK && i < n; i++) {
        dt_tensor *t = items[i].t;
        tensor_materialize(t);
        BE(ctx)->to_host(BEI(ctx), stage, t->data, tensor_bytes(t));  /* f32 LE on x86/arm */
        int64_t cnt = dt_tensor_numel(t);
        uint16_t *h = stage;   /* 16-bit storage: rounded in place, front to back */
        for (int64_t k = 0; items[i].store != DT_F32 && k < cnt; k++)
            h[k] = items[i].store == DT_BF16 ? f32_to_bf16(((float *)stage)[k])
                                             : f32_to_f16(((float *)stage)[k]);
        size_t bytes = (size_t)st_bytes(t, items[i].store);
        crc[i] = (uint32_t)crc32_z(0, stage, bytes);
        s = write_all(ctx, f, stage, bytes, tmp);
    }
    host_free(ctx, stage);
    return s;
}

/* The header again, now with the checksums (the same length: 8 hex digits
 * each), then everything to disk. */
static dt_status ckpt_finish(dt_ctx *ctx, FILE *f, const char *tmp, const strbuf *first,
                             const dt_optim *opt, int64_t step, const ckpt_item *items, int n,
                             const dt_checkpoint_config *cfg, const uint32_t *crc)
{
    strbuf hdr = {ctx, NULL, 0, 0, 0};
    ckpt_header(&hdr, opt, step, items, n, cfg, crc, 0);
    uint32_t hcrc = hdr.oom ? 0 : st_header_crc((unsigned char *)hdr.p, hdr.len);
    hdr.len = 0;
    ckpt_header(&hdr, opt, step, items, n, cfg, crc, hcrc);
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

dt_status dt_checkpoint_save(dt_ctx *ctx, const dt_optim *opt, const char *path, int64_t step)
{
    return dt_checkpoint_save_ex(ctx, opt, path, step, NULL);
}

dt_status dt_checkpoint_save_ex(dt_ctx *ctx, const dt_optim *opt, const char *path, int64_t step,
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
    if (opt && opt->ctx != ctx)
        return set_error(ctx, DT_EINVAL, "checkpoint_save: optimizer belongs to another context");
    for (int i = 0; i < ctx->n_params; i++)
        if (tensor_readable(ctx->params[i], "checkpoint_save") != DT_OK)
            return ctx->last_status;
    if (opt && (opt->shard || opt->orphaned))
        return set_error(ctx, DT_ENOTSUP, "checkpoint_save: the optimizer's state is sharded across "
                         "the ranks (dt_ddp_config.zero); sharded checkpoints are not built yet: "
                         "save the parameters alone (optimizer NULL)");
    int nstate = opt ? opt->n * opt->per : 0, total = ctx->n_params + ctx->n_ckpt_extra + nstate;
    ckpt_item *items = host_calloc(ctx, sizeof *items * (size_t)(total + 1));
    uint32_t *crc = host_calloc(ctx, sizeof *crc * (size_t)(total + 1));
    char **names = host_calloc(ctx, sizeof *names * (size_t)(nstate + 1));
    size_t plen = strlen(path) + 5;
    char *tmp = host_alloc(ctx, plen);
    strbuf hdr = {ctx, NULL, 0, 0, 0};
    FILE *f = NULL;
    dt_status s = DT_OK;
    if (!items || !crc || !names || !tmp || ckpt_items(ctx, opt, cfg->dtype, items, names) < 0) {
        s = set_error(ctx, DT_ENOMEM, "checkpoint_save: out of memory");
        goto done;
    }
    snprintf(tmp, plen, "%s.tmp", path);
    ckpt_header(&hdr, opt, step, items, total, cfg, NULL, 0);
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
        s = ckpt_finish(ctx, f, tmp, &hdr, opt, step, items, total, cfg, crc);
    if (fclose(f) != 0 && s == DT_OK)
        s = set_error(ctx, DT_EIO, "checkpoint_save: closing %s: %s", tmp, strerror(errno));
    f = NULL;
    if (s == DT_OK && rename(tmp, path) != 0)
        s = set_error(ctx, DT_EIO, "checkpoint_save: renaming %s to %s: %s", tmp, path,
                      strerror(errno));
    if (s == DT_OK)
        sync_parent_dir(path);
    else
        unlink(tmp);
done:
    if (names)
        for (int i = 0; i < nstate; i++)
            host_free(ctx, names[i]);
    host_free(ctx, names);
    host_free(ctx, items);
    host_free(ctx, crc);
    host_free(ctx, tmp);
    host_free(ctx, hdr.p);
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
            if (!js_char(j, '['))
                return 0;
            e->ndim = 0;
            if (!js_char(j, ']')) {
                do {
                    uint64_t v;
                    if (e->ndim >= DT_MAX_DIMS || !js_uint(j, &v) || v > ((uint64_t)1 << 40))
                        return 0;
                    e->shape[e->ndim++] = (int64_t)v;
                } while (js_char(j, ','));
                if (!js_char(j, ']'))
                    return 0;
            }
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
    snprintf(f->why, sizeof f->why, "metadata '%.*s' %s", DT_MAX_NAME + 16, key, what);
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
        {"dtrain.header_crc32", ST_HEADER_CRC}};
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
    char *endp;
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
        f->optim_lr = strtof(val, &endp);
        return (endp != val && !*endp && isfinite(f->optim_lr) && f->optim_lr >= 0) ||
               meta_bad(f, key, "is not a learning rate >= 0");
    case ST_OPT_PSTEPS:
        if (!(f->param_steps = host_alloc(f->ctx, strlen(val) + 1)))
            return -1;
        strcpy(f->param_steps, val);
        return 1;
    case ST_HEADER_CRC:
        return meta_crc(val, &f->header_crc) || meta_bad(f, key, "is not 8 hex digits");
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
        char key[DT_MAX_NAME + 48];
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
        char key[DT_MAX_NAME + 16];
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
 * tool's) is loaded with a note (dt_set_log). */
static dt_status st_verify(dt_ctx *ctx, const char *path, const st_file *f,
                           const unsigned char *data)
{
    if (!(f->seen & ST_CHECKSUM)) {
        warn(ctx, "checkpoint_load: %s has no checksums (not written by this dtrain): its data "
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
    BE(ctx)->to_device(BEI(ctx), t->data, src, tensor_bytes(t));
    t->flags &= ~(unsigned)T_ZERO;
    host_free(ctx, wide);
    return DT_OK;
}

dt_status dt_checkpoint_load(dt_ctx *ctx, dt_optim *opt, const char *path, int64_t *step_out)
{
    return dt_checkpoint_load_ex(ctx, opt, path, NULL, step_out, NULL);
}

dt_status dt_checkpoint_load_ex(dt_ctx *ctx, dt_optim *opt, const char *path,
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
    if (opt && opt->ctx != ctx)
        return set_error(ctx, DT_EINVAL, "checkpoint_load: optimizer belongs to another context");
    if (opt && !strict)
        return set_error(ctx, DT_EINVAL, "checkpoint_load: a non-strict load takes no optimizer");
    if (opt && (opt->shard || opt->orphaned))
        return set_error(ctx, DT_ENOTSUP, "checkpoint_load: the optimizer's state is sharded across "
                         "the ranks (dt_ddp_config.zero); sharded checkpoints are not built yet");
    unsigned char *buf = NULL;
    size_t len = 0;
    uint64_t hlen = 0;
    st_file f;
    memset(&f, 0, sizeof f);
    int nstate = opt ? opt->n * opt->per : 0, nx = ctx->n_ckpt_extra;
    int total = ctx->n_params + nx + nstate;
    const st_entry **map = NULL;
    int64_t *psteps = NULL;
    char key[DT_MAX_NAME + 16];
    dt_status s = st_open(ctx, path, &buf, &len, &f, &hlen);
    if (s != DT_OK)
        goto done;
    uint64_t data_len = len - 8 - hlen;
    map = host_calloc(ctx, sizeof *map * (size_t)(total + 1));
    psteps = host_calloc(ctx, sizeof *psteps * (size_t)(opt ? opt->n + 1 : 1));
    if (!map || !psteps) {
        s = set_error(ctx, DT_ENOMEM, "checkpoint_load: out of memory");
        goto done;
    }
    for (int i = 0; s == DT_OK && i < nx; i++)
        s = st_check(ctx, &f, ctx->ckpt_extra[i]->name, ctx->ckpt_extra[i], data_len,
                     &map[ctx->n_params + i]);
    for (int i = 0; s == DT_OK && i < nstate; i++) {
        snprintf(key, sizeof key, "optim.%s", opt->state[i]->name);
        s = st_check(ctx, &f, key, opt->state[i], data_len, &map[ctx->n_params + nx + i]);
    }
    if (s != DT_OK || (s = st_map_params(ctx, &f, data_len, strict, map, &rep)) != DT_OK)
        goto done;
    if (opt) {
        if ((f.seen & ST_OPT_ALL) != ST_OPT_ALL || f.optim_kind != (int)opt->cfg.kind) {
            s = set_error(ctx, DT_EMISMATCH, "checkpoint_load: the file has no state for this "
                                             "kind of optimizer");
            goto done;
        }
        if ((s = st_parse_param_steps(ctx, &f, psteps, opt->n)) != DT_OK)
            goto done;
    }
    const unsigned char *data = buf + 8 + hlen;
    if ((s = st_verify(ctx, path, &f, data)) != DT_OK)
        goto done;
    /* everything checked: now copy */
    for (int i = 0; s == DT_OK && i < total; i++) {
        dt_tensor *t = i < ctx->n_params ? ctx->params[i]
                       : i < ctx->n_params + nx ? ctx->ckpt_extra[i - ctx->n_params]
                                                : opt->state[i - ctx->n_params - nx];
        if (map[i])
            s = st_copy(ctx, t, map[i], data);
    }
    if (s == DT_OK && opt) {
        opt->steps = f.optim_steps;
        memcpy(opt->param_steps, psteps, sizeof *psteps * (size_t)opt->n);
        opt->lr = opt->base_lr = f.optim_lr;
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
        if (nl < 12 || strcmp(e->d_name + nl - 12, ".safetensors") != 0)
            continue;
        char *full = host_alloc(ctx, dl + nl + 2);
        if (!full) {
            s = set_error(ctx, DT_ENOMEM, "checkpoint_latest: out of memory");
            break;
        }
        snprintf(full, dl + nl + 2, "%s%s%s", dir, dl && dir[dl - 1] == '/' ? "" : "/", e->d_name);
        int64_t at = -1;
        if (!ckpt_complete(ctx, full, &at))
            warn(ctx, "checkpoint_latest: skipping %s: %s", full, dt_last_error(ctx));
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
