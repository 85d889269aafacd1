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

static void strbuf_json_string(strbuf *b, const char *s)
{
    strbuf_puts(b, "\"");
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

static void ckpt_header(strbuf *b, const dt_optim *opt, int64_t step, const ckpt_item *items, int n,
                        const dt_checkpoint_config *cfg)
{
    strbuf_printf(b, "{\"__metadata__\":{\"format\":\"pt\",\"dtrain.step\":\"%lld\"", (long long)step);
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

static dt_status ckpt_write(dt_ctx *ctx, FILE *f, const char *tmp, const strbuf *hdr,
                            const ckpt_item *items, int n)
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
        s = write_all(ctx, f, stage, st_bytes(t, items[i].store), tmp);
    }
    host_free(ctx, stage);
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
    if (!cfg)
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
    int nstate = opt ? opt->n * opt->per : 0, total = ctx->n_params + ctx->n_ckpt_extra + nstate;
    ckpt_item *items = host_calloc(ctx, sizeof *items * (size_t)(total + 1));
    char **names = host_calloc(ctx, sizeof *names * (size_t)(nstate + 1));
    size_t plen = strlen(path) + 5;
    char *tmp = host_alloc(ctx, plen);
    strbuf hdr = {ctx, NULL, 0, 0, 0};
    FILE *f = NULL;
    dt_status s = DT_OK;
    if (!items || !names || !tmp || ckpt_items(ctx, opt, cfg->dtype, items, names) < 0) {
        s = set_error(ctx, DT_ENOMEM, "checkpoint_save: out of memory");
        goto done;
    }
    snprintf(tmp, plen, "%s.tmp", path);
    ckpt_header(&hdr, opt, step, items, total, cfg);
    if (hdr.oom) {
        s = set_error(ctx, DT_ENOMEM, "checkpoint_save: out of memory for the header");
        goto done;
    }
    if (!(f = fopen(tmp, "wb"))) {
        s = set_error(ctx, DT_EIO, "checkpoint_save: cannot create %s: %s", tmp, strerror(errno));
        goto done;
    }
    s = ckpt_write(ctx, f, tmp, &hdr, items, total);
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

static int st_metadata(json *j, st_file *f)
{
    if (!js_char(j, '{'))
        return 0;
    if (js_char(j, '}'))
        return 1;
    do {
        char key[128], val[4096];
        if (!js_string(j, key, sizeof key) || !js_char(j, ':') || !js_string(j, val, sizeof val))
            return 0;
        char *endp = NULL;
        if (f->want_key && strcmp(key, f->want_key) == 0) {
            snprintf(f->want_val, sizeof f->want_val, "%s", val);
            f->found = 1;
        }
        if (strcmp(key, "dtrain.step") == 0)
            f->step = strtoll(val, &endp, 10);
        else if (strcmp(key, "dtrain.optim.steps") == 0)
            f->optim_steps = strtoll(val, &endp, 10), f->has_optim = 1;
        else if (strcmp(key, "dtrain.optim.kind") == 0)
            f->optim_kind = (int)strtol(val, &endp, 10);
        else if (strcmp(key, "dtrain.optim.lr") == 0)
            f->optim_lr = strtof(val, &endp);
        else if (strcmp(key, "dtrain.optim.param_steps") == 0)
            snprintf(f->param_steps, sizeof f->param_steps, "%s", val);
        if (endp && *endp)
            return 0;
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

/* Read a whole file.  *out is allocated with the context's allocator. */
static dt_status read_file(dt_ctx *ctx, const char *op, const char *path, unsigned char **out,
                           size_t *len)
{
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return set_error(ctx, DT_EIO, "%s: cannot open %s: %s", op, path, strerror(errno));
    dt_status s = DT_OK;
    struct stat st;
    if (fstat(fileno(fp), &st) != 0 || !S_ISREG(st.st_mode)) {
        fclose(fp);
        return set_error(ctx, DT_EIO, "%s: %s is not a regular file", op, path);
    }
    if ((uint64_t)st.st_size > DT_CKPT_MAX_FILE) {
        fclose(fp);
        return set_error(ctx, DT_EIO, "%s: %s is larger than %llu bytes", op, path,
                         (unsigned long long)DT_CKPT_MAX_FILE);
    }
    long size = (long)st.st_size;
    unsigned char *buf = host_alloc(ctx, (size_t)size + 1);
    if (!buf)
        s = set_error(ctx, DT_ENOMEM, "%s: out of memory for %ld bytes", op, size);
    else if (size > 0 && fread(buf, 1, (size_t)size, fp) != (size_t)size)
        s = set_error(ctx, DT_EIO, "%s: reading %s failed", op, path);
    fclose(fp);
    if (s != DT_OK) {
        host_free(ctx, buf);
        return s;
    }
    *out = buf;
    *len = (size_t)size;
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
    const char *p = f->param_steps;
    for (int i = 0; i < n; i++) {
        char *endp;
        errno = 0;
        long long v = strtoll(p, &endp, 10);
        if (endp == p || errno || v < 0 || (*endp != ',' && *endp != '\0') ||
            (i == n - 1 && *endp != '\0'))
            return set_error(ctx, DT_ECORRUPT, "checkpoint_load: bad optimizer step list");
        steps[i] = v;
        p = endp + (*endp == ',');
    }
    return DT_OK;
}

/* Read path whole, parse and check its header and the data's extent. */
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
    int pr = st_parse(ctx, (const char *)*buf + 8, (size_t)hlen, f);
    if (pr <= 0)
        return pr < 0 ? set_error(ctx, DT_ENOMEM, "checkpoint_load: out of memory")
                      : set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s has a malformed header",
                                  path);
    uint64_t data_len = *len - 8 - hlen, data_end = 0;
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
        if (e->end > data_end)
            data_end = e->end;
    }
    if (data_end != data_len)
        return set_error(ctx, DT_ECORRUPT, "checkpoint_load: %s has %llu data bytes, its header "
                         "describes %llu", path, (unsigned long long)data_len,
                         (unsigned long long)data_end);
    *hlen_out = hlen;
    return DT_OK;
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
    int strict = !cfg || cfg->strict;
    dt_checkpoint_report rep;
    memset(&rep, 0, sizeof rep);
    if (!path)
        return set_error(ctx, DT_EINVAL, "checkpoint_load: path is NULL");
    if (opt && opt->ctx != ctx)
        return set_error(ctx, DT_EINVAL, "checkpoint_load: optimizer belongs to another context");
    if (opt && !strict)
        return set_error(ctx, DT_EINVAL, "checkpoint_load: a non-strict load takes no optimizer");
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
        if (!f.has_optim || f.optim_kind != (int)opt->cfg.kind) {
            s = set_error(ctx, DT_EMISMATCH, "checkpoint_load: the file has no state for this "
                                             "kind of optimizer");
            goto done;
        }
        if ((s = st_parse_param_steps(ctx, &f, psteps, opt->n)) != DT_OK)
            goto done;
    }
    /* everything checked: now copy */
    const unsigned char *data = buf + 8 + hlen;
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
    host_free(ctx, f.e);
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
    host_free(ctx, f.e);
    host_free(ctx, buf);
    return s;
}
