/*
 * tests/test_core_ckpt.c - checkpoints: round trip into a fresh context, the
 * safetensors layout read back by hand, files written by hand (as PyTorch's
 * safetensors would write them) loaded, and corrupt files refused without
 * touching the parameters.
 */
#include "test_util.h"

#include <sys/stat.h>

enum { NW = 12, NB = 3 };

typedef struct fixture {
    dt_ctx *ctx;
    dt_tensor *w, *b;   /* "fc.weight" (3,4), "fc.bias" (3) */
    dt_tensor *cw, *cb; /* gradient constants */
    dt_optim *opt;
} fixture;

static void fx_init(fixture *f, uint64_t seed, int with_opt)
{
    f->ctx = tu_ctx_new();
    tu_rng r = {seed};
    f->w = tu_param_rand(f->ctx, &r, "fc.weight", SHP(3, 4), -1, 1);
    f->b = tu_param_rand(f->ctx, &r, "fc.bias", SHP(NB), -1, 1);
    f->cw = tu_tensor(f->ctx, SHP(3, 4), NULL);
    f->cb = tu_tensor(f->ctx, SHP(NB), NULL);
    f->opt = NULL;
    if (with_opt) {
        dt_optim_config c;
        dt_optim_config_init(&c, DT_ADAM);
        c.lr = 0.05f;
        f->opt = dt_optim_new(f->ctx, &c, NULL, 0);
        tu_check(f->ctx, f->opt, "dt_optim_new");
    }
}

static void fx_free(fixture *f)
{
    dt_optim_free(f->opt);
    dt_tensor_free(f->cw);
    dt_tensor_free(f->cb);
    dt_ctx_free(f->ctx);
}

/* One optimizer step with gradients drawn from r. */
static void fx_step(fixture *f, tu_rng *r)
{
    float gw[NW], gb[NB];
    tu_fill_uniform(r, gw, NW, -1, 1);
    tu_fill_uniform(r, gb, NB, -1, 1);
    dt_ctx *ctx = f->ctx;
    dt_tensor_set(f->cw, gw, NW);
    dt_tensor_set(f->cb, gb, NB);
    dt_optim_zero_grad(f->opt);
    dt_tensor *loss = dt_add(ctx, dt_sum(ctx, dt_mul(ctx, f->w, f->cw)),
                             dt_sum(ctx, dt_mul(ctx, f->b, f->cb)));
    tu_check_status(ctx, dt_backward(ctx, loss), "backward");
    tu_check_status(ctx, dt_optim_step(f->opt), "optim step");
    dt_step_reset(ctx);
}

static void fx_get(fixture *f, float *w, float *b)
{
    assert_int_equal(dt_tensor_get(f->w, w, NW), DT_OK);
    assert_int_equal(dt_tensor_get(f->b, b, NB), DT_OK);
}

static dt_tensor *state_find(const dt_optim *opt, const char *name)
{
    for (int i = 0; i < dt_optim_state_count(opt); i++)
        if (strcmp(dt_tensor_name(dt_optim_state_at(opt, i)), name) == 0) return dt_optim_state_at(opt, i);
    return NULL;
}

static int dir_entries(const char *dir)
{
    int n = 0;
    DIR *d = opendir(dir);
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    if (d) closedir(d);
    return n;
}

static uint64_t le64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static void put_le64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

/* ---------------------------------------------------------------------------
 * A minimal safetensors reader and writer of our own.
 * ------------------------------------------------------------------------- */

/* JSON header without whitespace (names here contain none). */
static char *squeeze_json(const unsigned char *p, size_t n)
{
    char *s = malloc(n + 1);
    assert_non_null(s);
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (p[i] != ' ' && p[i] != '\n' && p[i] != '\t' && p[i] != '\r') s[k++] = (char)p[i];
    s[k] = 0;
    return s;
}

/* Find `"name":{...}` in a squeezed header and read its dtype, shape and
 * offsets.  With suffix set, a key that ends in ".name" matches too (the
 * file may prefix optimizer state, e.g. "optim.fc.weight.exp_avg").
 * Returns 0 if absent. */
static int st_entry_parse_ex(const char *json, const char *name, int suffix, char *dtype,
                             int64_t *shape, int *ndim, int64_t *off)
{
    char key[160];
    snprintf(key, sizeof key, "%s\":{", name);
    const char *p = json;
    for (;;) {
        p = strstr(p, key);
        if (!p) return 0;
        if (p > json && (p[-1] == '"' || (suffix && p[-1] == '.'))) break;
        p++;
    }
    p += strlen(key);
    const char *end = strchr(p, '}');
    assert_non_null(end);
    const char *q = strstr(p, "\"dtype\":\"");
    assert_true(q && q < end);
    q += 9;
    int i = 0;
    while (*q != '"' && i < 15) dtype[i++] = *q++;
    dtype[i] = 0;
    q = strstr(p, "\"shape\":[");
    assert_true(q && q < end);
    q += 9;
    *ndim = 0;
    while (*q != ']') {
        shape[(*ndim)++] = strtoll(q, (char **)&q, 10);
        if (*q == ',') q++;
    }
    q = strstr(p, "\"data_offsets\":[");
    assert_true(q && q < end);
    q += 16;
    off[0] = strtoll(q, (char **)&q, 10);
    assert_int_equal(*q, ',');
    off[1] = strtoll(q + 1, NULL, 10);
    return 1;
}

static int st_entry_parse(const char *json, const char *name, char *dtype, int64_t *shape,
                          int *ndim, int64_t *off)
{
    return st_entry_parse_ex(json, name, 0, dtype, shape, ndim, off);
}

typedef struct st_entry {
    const char *name;
    const char *dtype;       /* "F32" */
    int ndim;
    int64_t shape[4];
    const float *data;
    int64_t n;               /* elements written to the data region */
    int bad_offsets;         /* use off[] instead of the natural offsets */
    int64_t off[2];
} st_entry;

/* Write a safetensors file: 8-byte LE header length, JSON (space-padded to
 * 8 bytes), then each entry's data in order. */
static void st_write(const char *path, const st_entry *e, int n, const char *metadata)
{
    char json[4096];
    size_t k = 0;
    int64_t pos = 0;
    k += (size_t)snprintf(json + k, sizeof json - k, "{");
    if (metadata) k += (size_t)snprintf(json + k, sizeof json - k, "\"__metadata__\":%s", metadata);
    for (int i = 0; i < n; i++) {
        int64_t a = pos, b = pos + e[i].n * 4;
        if (e[i].bad_offsets) {
            a = e[i].off[0];
            b = e[i].off[1];
        }
        pos += e[i].n * 4;
        k += (size_t)snprintf(json + k, sizeof json - k, "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[",
                              (i || metadata) ? "," : "", e[i].name, e[i].dtype);
        for (int d = 0; d < e[i].ndim; d++)
            k += (size_t)snprintf(json + k, sizeof json - k, "%s%lld", d ? "," : "",
                                  (long long)e[i].shape[d]);
        k += (size_t)snprintf(json + k, sizeof json - k, "],\"data_offsets\":[%lld,%lld]}",
                              (long long)a, (long long)b);
    }
    k += (size_t)snprintf(json + k, sizeof json - k, "}");
    while (k % 8) json[k++] = ' ';
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    unsigned char hdr[8];
    put_le64(hdr, k);
    fwrite(hdr, 1, 8, fp);
    fwrite(json, 1, k, fp);
    for (int i = 0; i < n; i++) fwrite(e[i].data, 4, (size_t)e[i].n, fp);
    fclose(fp);
}

/* ---------------------------------------------------------------------------
 * Round trip and layout
 * ------------------------------------------------------------------------- */
static void test_ckpt_roundtrip(void **state)
{
    (void)state;
    char dir[64], path[128], tmp[160];
    tu_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);

    fixture a, b;
    fx_init(&a, 1, 1);
    tu_rng ra = {500};
    fx_step(&a, &ra);
    fx_step(&a, &ra);
    tu_check_status(a.ctx, dt_checkpoint_save(a.ctx, a.opt, path, 7), "dt_checkpoint_save");
    assert_int_not_equal(access(path, F_OK), -1);
    if (access(tmp, F_OK) == 0) fail_msg("%s left behind after a successful save", tmp);
    assert_int_equal(dir_entries(dir), 1);

    /* Fresh context, different initial values, fresh optimizer. */
    fx_init(&b, 2, 1);
    int64_t step = -1;
    tu_check_status(b.ctx, dt_checkpoint_load(b.ctx, b.opt, path, &step), "dt_checkpoint_load");
    assert_int_equal(step, 7);
    float wa[NW], ba[NB], wb[NW], bb[NB], wsaved[NW], bsaved[NB];
    fx_get(&a, wa, ba);
    fx_get(&b, wb, bb);
    memcpy(wsaved, wa, sizeof wa);
    memcpy(bsaved, ba, sizeof ba);
    assert_memory_equal(wa, wb, sizeof wa);
    assert_memory_equal(ba, bb, sizeof ba);

    /* Optimizer state: same names, same values. */
    assert_int_equal(dt_optim_state_count(b.opt), dt_optim_state_count(a.opt));
    assert_true(dt_optim_state_count(a.opt) >= 4); /* exp_avg, exp_avg_sq for 2 params */
    for (int i = 0; i < dt_optim_state_count(a.opt); i++) {
        dt_tensor *sa = dt_optim_state_at(a.opt, i);
        dt_tensor *sb = state_find(b.opt, dt_tensor_name(sa));
        if (!sb) fail_msg("state %s missing after load", dt_tensor_name(sa));
        int64_t na, nb;
        float *va = tu_read(a.ctx, sa, &na), *vb = tu_read(b.ctx, sb, &nb);
        assert_int_equal(na, nb);
        if (memcmp(va, vb, sizeof(float) * (size_t)na) != 0)
            fail_msg("state %s differs after load", dt_tensor_name(sa));
        free(va);
        free(vb);
    }
    assert_int_equal(dt_optim_steps(b.opt), dt_optim_steps(a.opt));

    /* The next step is identical too (Adam's step count was restored: its
     * bias correction depends on it). */
    tu_rng r1 = {501}, r2 = {501};
    fx_step(&a, &r1);
    fx_step(&b, &r2);
    fx_get(&a, wa, ba);
    fx_get(&b, wb, bb);
    assert_memory_equal(wa, wb, sizeof wa);
    assert_memory_equal(ba, bb, sizeof ba);

    /* Parameters only: loads into a context without an optimizer. */
    fixture c;
    fx_init(&c, 3, 0);
    tu_check_status(c.ctx, dt_checkpoint_load(c.ctx, NULL, path, NULL), "load without optimizer");
    float wc[NW], bc[NB];
    fx_get(&c, wc, bc);
    assert_memory_equal(wc, wsaved, sizeof wc);
    assert_memory_equal(bc, bsaved, sizeof bc);
    fx_free(&c);

    /* Saving again over an existing file replaces it. */
    tu_check_status(a.ctx, dt_checkpoint_save(a.ctx, NULL, path, 8), "save again");
    assert_int_equal(dir_entries(dir), 1);
    fixture d;
    fx_init(&d, 4, 0);
    tu_check_status(d.ctx, dt_checkpoint_load(d.ctx, NULL, path, &step), "load again");
    assert_int_equal(step, 8);
    float wd[NW], bd[NB];
    fx_get(&d, wd, bd);
    assert_memory_equal(wa, wd, sizeof wa);
    assert_memory_equal(ba, bd, sizeof ba);
    fx_free(&d);

    fx_free(&a);
    fx_free(&b);
    tu_rmdir(dir);
}

static void test_ckpt_file_layout(void **state)
{
    (void)state;
    char dir[64], path[128];
    tu_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/m.safetensors", dir);
    fixture a;
    fx_init(&a, 5, 1);
    tu_rng r = {502};
    fx_step(&a, &r);
    tu_check_status(a.ctx, dt_checkpoint_save(a.ctx, a.opt, path, 1), "save");

    size_t len = 0;
    unsigned char *buf = tu_read_file(path, &len);
    assert_non_null(buf);
    assert_true(len > 8);
    uint64_t n = le64(buf);
    assert_true(n > 2 && 8 + n <= len);
    char *json = squeeze_json(buf + 8, n);
    assert_int_equal(json[0], '{');
    assert_int_equal(json[strlen(json) - 1], '}');
    if (!strstr(json, "\"dtype\":\"F32\"")) fail_msg("no \"dtype\":\"F32\" in %s", json);

    float w[NW], b[NB];
    fx_get(&a, w, b);
    const struct {
        const char *name;
        const float *v;
        int n;
        int ndim;
        int64_t shape[2];
    } want[2] = {{"fc.weight", w, NW, 2, {3, 4}}, {"fc.bias", b, NB, 1, {3}}};
    int64_t data_end = 0;
    for (int i = 0; i < 2; i++) {
        char dtype[16];
        int64_t shape[8] = {0}, off[2] = {0, 0};
        int nd = 0;
        if (!st_entry_parse(json, want[i].name, dtype, shape, &nd, off))
            fail_msg("no entry \"%s\" in %s", want[i].name, json);
        assert_string_equal(dtype, "F32");
        assert_int_equal(nd, want[i].ndim);
        for (int d = 0; d < nd; d++) assert_int_equal(shape[d], want[i].shape[d]);
        assert_int_equal(off[1] - off[0], want[i].n * 4);
        assert_true(off[0] >= 0 && 8 + n + (uint64_t)off[1] <= len);
        /* little-endian f32 bytes of the parameter */
        if (memcmp(buf + 8 + n + off[0], want[i].v, (size_t)want[i].n * 4) != 0)
            fail_msg("data of %s in the file differs from the parameter", want[i].name);
        if (off[1] > data_end) data_end = off[1];
    }
    /* Adam's state is saved under its state names (a prefix is allowed),
     * with the state's values. */
    for (int i = 0; i < dt_optim_state_count(a.opt); i++) {
        dt_tensor *st = dt_optim_state_at(a.opt, i);
        const char *sname = dt_tensor_name(st);
        char dtype[16];
        int64_t shape[8] = {0}, off[2] = {0, 0};
        int nd = 0;
        if (!st_entry_parse_ex(json, sname, 1, dtype, shape, &nd, off))
            fail_msg("no optimizer state %s in %s", sname, json);
        assert_string_equal(dtype, "F32");
        int64_t sn;
        float *sv = tu_read(a.ctx, st, &sn);
        assert_int_equal(off[1] - off[0], sn * 4);
        assert_true(8 + n + (uint64_t)off[1] <= len);
        if (memcmp(buf + 8 + n + off[0], sv, (size_t)sn * 4) != 0)
            fail_msg("data of state %s in the file differs from the optimizer's", sname);
        free(sv);
        if (off[1] > data_end) data_end = off[1];
    }
    assert_true(dt_optim_state_count(a.opt) >= 2);
    /* the data region is exactly what the entries index: no trailing bytes */
    assert_int_equal(len, 8 + n + (uint64_t)data_end);
    free(json);
    free(buf);
    fx_free(&a);
    tu_rmdir(dir);
}

/* A file written by hand, as PyTorch's safetensors would: entries in
 * another order than the registration order, no dtrain metadata. */
static void test_ckpt_load_foreign_file(void **state)
{
    (void)state;
    char dir[64], path[128];
    tu_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/foreign.safetensors", dir);
    float w[NW], b[NB];
    for (int i = 0; i < NW; i++) w[i] = (float)i * 0.25f - 1;
    for (int i = 0; i < NB; i++) b[i] = 10.0f + (float)i;
    st_entry e[2] = {{"fc.bias", "F32", 1, {3}, b, NB, 0, {0}},
                     {"fc.weight", "F32", 2, {3, 4}, w, NW, 0, {0}}};
    st_write(path, e, 2, NULL);
    fixture f;
    fx_init(&f, 6, 0);
    tu_check_status(f.ctx, dt_checkpoint_load(f.ctx, NULL, path, NULL), "load foreign file");
    float gw[NW], gb[NB];
    fx_get(&f, gw, gb);
    assert_memory_equal(gw, w, sizeof w);
    assert_memory_equal(gb, b, sizeof b);
    fx_free(&f);
    tu_rmdir(dir);
}

/* ---------------------------------------------------------------------------
 * Corrupt files: an error status, and nothing changes.
 * ------------------------------------------------------------------------- */
/* A load that must be refused: an error status and message, and the
 * parameters untouched.  Prints the problem and returns 0 if not. */
static int check_refused(fixture *f, dt_optim *opt, const char *path, const char *what)
{
    float w0[NW], b0[NB], w1[NW], b1[NB];
    fx_get(f, w0, b0);
    int64_t step = 12345;
    int ok = 1;
    dt_status s = dt_checkpoint_load(f->ctx, opt, path, &step);
    if (s == DT_OK) {
        print_error("%s (optimizer %s): dt_checkpoint_load returned DT_OK\n", what,
                    opt ? "given" : "NULL");
        ok = 0;
    } else if (dt_last_error(f->ctx)[0] == '\0') {
        print_error("%s: no error message\n", what);
        ok = 0;
    }
    fx_get(f, w1, b1);
    if (s != DT_OK && (memcmp(w0, w1, sizeof w0) || memcmp(b0, b1, sizeof b0))) {
        print_error("%s: parameters changed by a refused load\n", what);
        ok = 0;
    }
    /* restore whatever a wrong load did, so the next case starts clean */
    dt_tensor_set(f->w, w0, NW);
    dt_tensor_set(f->b, b0, NB);
    dt_clear_error(f->ctx);
    return ok;
}

static void expect_refused(fixture *f, dt_optim *opt, const char *path, const char *what)
{
    if (!check_refused(f, opt, path, what)) fail_msg("%s: not refused cleanly", what);
}

static void test_ckpt_corrupt_truncated(void **state)
{
    (void)state;
    char dir[64], path[128], bad[160];
    tu_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/good.safetensors", dir);
    snprintf(bad, sizeof bad, "%s/bad.safetensors", dir);
    fixture a, f;
    fx_init(&a, 7, 1);
    tu_rng r = {503};
    fx_step(&a, &r);
    tu_check_status(a.ctx, dt_checkpoint_save(a.ctx, a.opt, path, 3), "save");
    size_t len = 0;
    unsigned char *buf = tu_read_file(path, &len);
    assert_non_null(buf);
    size_t n = (size_t)le64(buf);
    fx_init(&f, 8, 1);
    const size_t cuts[] = {0, 1, 4, 7, 8, 9, 8 + n / 2, 8 + n - 1, 8 + n, 8 + n + 1,
                           8 + n + 4 * NW, len / 2 + n / 2, len - 4, len - 1};
    int bad_cuts = 0;
    for (int i = 0; i < TU_ARRAY_LEN(cuts); i++) {
        if (cuts[i] >= len) continue;
        tu_write_file(bad, buf, cuts[i]);
        char what[128];
        snprintf(what, sizeof what, "file cut to %zu of %zu bytes (header %zu)", cuts[i], len, n);
        bad_cuts += !check_refused(&f, NULL, bad, what);
        bad_cuts += !check_refused(&f, f.opt, bad, what);
    }
    if (bad_cuts) fail_msg("%d truncated files were not refused cleanly", bad_cuts);
    /* The untouched file still loads. */
    tu_check_status(f.ctx, dt_checkpoint_load(f.ctx, f.opt, path, NULL), "load good file");
    free(buf);
    fx_free(&a);
    fx_free(&f);
    tu_rmdir(dir);
}

static void test_ckpt_corrupt_header(void **state)
{
    (void)state;
    char dir[64], path[128], bad[160];
    tu_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/good.safetensors", dir);
    snprintf(bad, sizeof bad, "%s/bad.safetensors", dir);
    fixture a, f;
    fx_init(&a, 9, 0);
    tu_check_status(a.ctx, dt_checkpoint_save(a.ctx, NULL, path, 3), "save");
    size_t len = 0;
    unsigned char *buf = tu_read_file(path, &len);
    assert_non_null(buf);
    size_t n = (size_t)le64(buf);
    unsigned char *mod = malloc(len);
    assert_non_null(mod);
    fx_init(&f, 10, 0);

    /* header length larger than the file, absurdly large, zero */
    const uint64_t lens[] = {len - 7, len, (uint64_t)len * 2, UINT64_MAX, UINT64_MAX / 2,
                             (uint64_t)1 << 40, 0, 1};
    for (int i = 0; i < TU_ARRAY_LEN(lens); i++) {
        memcpy(mod, buf, len);
        put_le64(mod, lens[i]);
        tu_write_file(bad, mod, len);
        char what[128];
        snprintf(what, sizeof what, "header length %llu in a %zu-byte file",
                 (unsigned long long)lens[i], len);
        expect_refused(&f, NULL, bad, what);
    }

    /* garbage JSON of the same length */
    static const char *garbage[] = {"{\"fc.weight\":{\"dtype\":\"F32\",\"shape\":[3,", "not json at all",
                                    "{\"fc.weight\":[1,2,3]}", "]]]]{{{{\"\"\"\":::,,,", "{\"a\":\"\\"};
    for (int i = 0; i < TU_ARRAY_LEN(garbage); i++) {
        memcpy(mod, buf, len);
        memset(mod + 8, ' ', n);
        size_t gl = strlen(garbage[i]);
        memcpy(mod + 8, garbage[i], gl < n ? gl : n);
        tu_write_file(bad, mod, len);
        char what[128];
        snprintf(what, sizeof what, "garbage JSON \"%s\"", garbage[i]);
        expect_refused(&f, NULL, bad, what);
    }
    /* a NUL byte and random bytes inside the header */
    memcpy(mod, buf, len);
    mod[8 + n / 2] = 0;
    tu_write_file(bad, mod, len);
    expect_refused(&f, NULL, bad, "NUL inside the JSON header");
    tu_rng r = {504};
    for (int k = 0; k < 5; k++) {
        memcpy(mod, buf, len);
        for (size_t i = 8; i < 8 + n; i++) mod[i] = (unsigned char)tu_next(&r);
        tu_write_file(bad, mod, len);
        expect_refused(&f, NULL, bad, "random bytes as the JSON header");
    }
    free(mod);
    free(buf);
    fx_free(&a);
    fx_free(&f);
    tu_rmdir(dir);
}

static void test_ckpt_corrupt_entries(void **state)
{
    (void)state;
    char dir[64], bad[128];
    tu_tmpdir(dir, sizeof dir);
    snprintf(bad, sizeof bad, "%s/bad.safetensors", dir);
    fixture f;
    fx_init(&f, 11, 0);
    float w[NW], b[NB];
    for (int i = 0; i < NW; i++) w[i] = 100.0f + (float)i;
    for (int i = 0; i < NB; i++) b[i] = -100.0f - (float)i;
    const st_entry good_w = {"fc.weight", "F32", 2, {3, 4}, w, NW, 0, {0}};
    const st_entry good_b = {"fc.bias", "F32", 1, {3}, b, NB, 0, {0}};

    /* The baseline file is accepted (so each refusal below is due to its
     * one defect); restore the fixture's values afterwards. */
    {
        st_entry e[2] = {good_w, good_b};
        float w0[NW], b0[NB];
        fx_get(&f, w0, b0);
        st_write(bad, e, 2, NULL);
        tu_check_status(f.ctx, dt_checkpoint_load(f.ctx, NULL, bad, NULL), "baseline file");
        dt_tensor_set(f.w, w0, NW);
        dt_tensor_set(f.b, b0, NB);
    }
    struct {
        const char *what;
        st_entry e[2];
        int n;
    } cases[] = {
        {"data_offsets past the end", {good_w, good_b}, 2},
        {"data_offsets far past the end", {good_w, good_b}, 2},
        {"data_offsets begin > end", {good_w, good_b}, 2},
        {"data_offsets size != numel * 4", {good_w, good_b}, 2},
        {"negative data_offsets", {good_w, good_b}, 2},
        {"wrong shape for fc.weight", {good_w, good_b}, 2},
        {"wrong rank for fc.bias", {good_w, good_b}, 2},
        {"dtype I64 for fc.weight", {good_w, good_b}, 2},
        {"missing fc.bias", {good_w}, 1},
        {"missing fc.weight", {good_b}, 1},
    };
    cases[0].e[1].bad_offsets = 1;
    cases[0].e[1].off[0] = 48;
    cases[0].e[1].off[1] = 48 + 16; /* 4 bytes past the data */
    cases[1].e[0].bad_offsets = 1;
    cases[1].e[0].off[0] = 1000000;
    cases[1].e[0].off[1] = 1000048;
    cases[2].e[0].bad_offsets = 1;
    cases[2].e[0].off[0] = 48;
    cases[2].e[0].off[1] = 0;
    cases[3].e[0].bad_offsets = 1;
    cases[3].e[0].off[0] = 0;
    cases[3].e[0].off[1] = 44;
    cases[4].e[0].bad_offsets = 1;
    cases[4].e[0].off[0] = -48;
    cases[4].e[0].off[1] = 0;
    cases[5].e[0].shape[0] = 4;
    cases[5].e[0].shape[1] = 3;
    cases[6].e[1].ndim = 2;
    cases[6].e[1].shape[0] = 1;
    cases[6].e[1].shape[1] = 3;
    cases[7].e[0].dtype = "I64";
    /* (its data keeps the F32 size: an unknown dtype is refused before sizes matter) */
    for (int i = 0; i < TU_ARRAY_LEN(cases); i++) {
        st_write(bad, cases[i].e, cases[i].n, NULL);
        expect_refused(&f, NULL, bad, cases[i].what);
    }

    /* Zero-length and nonexistent files. */
    tu_write_file(bad, "", 0);
    expect_refused(&f, NULL, bad, "zero-length file");
    char missing[160];
    snprintf(missing, sizeof missing, "%s/does-not-exist.safetensors", dir);
    expect_refused(&f, NULL, missing, "nonexistent file");

    /* Saving where it cannot be written fails cleanly. */
    char nodir[160];
    snprintf(nodir, sizeof nodir, "%s/no/such/dir/x.safetensors", dir);
    assert_int_not_equal(dt_checkpoint_save(f.ctx, NULL, nodir, 0), DT_OK);
    assert_true(dt_last_error(f.ctx)[0] != '\0');

    fx_free(&f);
    tu_rmdir(dir);
}

/* A directory given as the checkpoint path: fopen succeeds on Linux, so
 * the size must be checked (it is not a regular file). */
static void test_ckpt_load_directory(void **state)
{
    (void)state;
    char dir[64];
    tu_tmpdir(dir, sizeof dir);
    fixture f;
    fx_init(&f, 14, 1);
    expect_refused(&f, NULL, dir, "a directory");
    expect_refused(&f, f.opt, dir, "a directory");
    fx_free(&f);
    tu_rmdir(dir);
}

/* A checkpoint of a context with other parameters: mismatch, no change. */
static void test_ckpt_mismatched_model(void **state)
{
    (void)state;
    char dir[64], path[128];
    tu_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/m.safetensors", dir);
    fixture a;
    fx_init(&a, 12, 0);
    tu_check_status(a.ctx, dt_checkpoint_save(a.ctx, NULL, path, 0), "save");

    /* same names, one more parameter in the loading context */
    fixture f;
    fx_init(&f, 13, 0);
    dt_tensor *extra = tu_param(f.ctx, "fc2.weight", SHP(2), (const float[]){5, 6});
    expect_refused(&f, NULL, path, "context has a parameter the file lacks");
    TU_EXPECT(f.ctx, extra, 0, 0, 5, 6);
    fx_free(&f);

    /* same names, other shape */
    dt_ctx *ctx = tu_ctx_new();
    dt_tensor *w = tu_param(ctx, "fc.weight", SHP(4, 3), NULL);
    dt_tensor *b = tu_param(ctx, "fc.bias", SHP(3), NULL);
    dt_tensor_fill(w, 1.5f);
    dt_tensor_fill(b, 2.5f);
    assert_int_not_equal(dt_checkpoint_load(ctx, NULL, path, NULL), DT_OK);
    TU_EXPECT(ctx, w, 0, 0, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5);
    TU_EXPECT(ctx, b, 0, 0, 2.5, 2.5, 2.5);
    dt_ctx_free(ctx);

    fx_free(&a);
    tu_rmdir(dir);
}

/* bf16 by hand: round to nearest even on the bits (finite values) */
static float ref_bf16(float v)
{
    uint32_t u;
    memcpy(&u, &v, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1)) & 0xffff0000u;
    memcpy(&v, &u, 4);
    return v;
}

/* Parameters stored as bf16 or f16: the file says so and is half the
 * size, a load gives the rounded values (f16: within its 2^-11 relative
 * step), and the optimizer's state stays f32, bit for bit. */
static void test_ckpt_16bit(void **state)
{
    (void)state;
    char dir[64], path[128];
    tu_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/h.safetensors", dir);
    for (int k = 0; k < 2; k++) {
        dt_dtype dt = k ? DT_F16 : DT_BF16;
        fixture a;
        fx_init(&a, 21, 1);
        tu_rng r = {5};
        fx_step(&a, &r);
        dt_checkpoint_config cc;
        dt_checkpoint_config_init(&cc);
        cc.dtype = dt;
        tu_check_status(a.ctx, dt_checkpoint_save_ex(a.ctx, a.opt, path, 1, &cc), "save 16-bit");
        size_t len;
        unsigned char *raw = tu_read_file(path, &len);
        assert_non_null(strstr((const char *)raw + 8, k ? "\"F16\"" : "\"BF16\""));
        free(raw);
        fixture b;
        fx_init(&b, 22, 1);
        tu_check_status(b.ctx, dt_checkpoint_load(b.ctx, b.opt, path, NULL), "load 16-bit");
        float *wa = tu_read(a.ctx, a.w, NULL), *wb = tu_read(b.ctx, b.w, NULL);
        for (int i = 0; i < NW; i++)
            assert_true(k ? fabs(wb[i] - wa[i]) <= fabs(wa[i]) * 0x1p-11 : wb[i] == ref_bf16(wa[i]));
        free(wa);
        free(wb);
        float *ma = tu_read(a.ctx, dt_optim_state_at(a.opt, 0), NULL);
        float *mb = tu_read(b.ctx, dt_optim_state_at(b.opt, 0), NULL);
        assert_memory_equal(ma, mb, sizeof(float) * NW);
        free(ma);
        free(mb);
        fx_free(&a);
        fx_free(&b);
    }
    dt_ctx *ctx = tu_ctx_new();
    dt_checkpoint_config cc;
    dt_checkpoint_config_init(&cc);
    cc.dtype = DT_I32;
    assert_int_equal(dt_checkpoint_save_ex(ctx, NULL, path, 0, &cc), DT_EINVAL);
    dt_ctx_free(ctx);
    tu_rmdir(dir);
}

/* The caller's metadata is written and read back; reserved and repeated
 * keys are refused. */
static void test_ckpt_metadata(void **state)
{
    (void)state;
    char dir[64], path[128], val[64];
    tu_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/m.safetensors", dir);
    fixture a;
    fx_init(&a, 23, 0);
    const char *keys[2] = {"model", "note"}, *vals[2] = {"gpt-4x128", "a \"quoted\" note"};
    dt_checkpoint_config cc;
    dt_checkpoint_config_init(&cc);
    cc.n_meta = 2;
    cc.meta_keys = keys;
    cc.meta_values = vals;
    tu_check_status(a.ctx, dt_checkpoint_save_ex(a.ctx, NULL, path, 7, &cc), "save");
    tu_check_status(a.ctx, dt_checkpoint_metadata(a.ctx, path, "note", val, sizeof val), "note");
    assert_string_equal(val, "a \"quoted\" note");
    tu_check_status(a.ctx, dt_checkpoint_metadata(a.ctx, path, "model", val, sizeof val), "model");
    assert_string_equal(val, "gpt-4x128");
    tu_check_status(a.ctx, dt_checkpoint_metadata(a.ctx, path, "dtrain.step", val, sizeof val), "");
    assert_string_equal(val, "7");
    assert_int_equal(dt_checkpoint_metadata(a.ctx, path, "nope", val, sizeof val), DT_EMISMATCH);
    keys[1] = "dtrain.x";
    assert_int_equal(dt_checkpoint_save_ex(a.ctx, NULL, path, 0, &cc), DT_EINVAL);
    keys[1] = "model";
    assert_int_equal(dt_checkpoint_save_ex(a.ctx, NULL, path, 0, &cc), DT_EINVAL);
    tu_assert_error_mentions(a.ctx, "twice");
    fx_free(&a);
    tu_rmdir(dir);
}

/* Non-strict: what fits by name and shape loads, the rest is reported and
 * left alone. */
static void test_ckpt_non_strict(void **state)
{
    (void)state;
    char dir[64], path[128];
    tu_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/n.safetensors", dir);
    fixture a;
    fx_init(&a, 24, 0);
    dt_tensor *head = tu_param(a.ctx, "head.weight", SHP(2), (const float[]){7, 8});
    (void)head;
    tu_check_status(a.ctx, dt_checkpoint_save(a.ctx, NULL, path, 0), "save");
    dt_ctx *ctx = tu_ctx_new();
    dt_tensor *w = tu_param(ctx, "fc.weight", SHP(3, 4), NULL);       /* fits */
    dt_tensor *b = tu_param(ctx, "fc.bias", SHP(5), NULL);            /* another shape */
    dt_tensor *n = tu_param(ctx, "new.weight", SHP(2), (const float[]){1, 2});   /* missing */
    dt_tensor_fill(b, 3.0f);
    dt_checkpoint_config cc;
    dt_checkpoint_config_init(&cc);
    cc.strict = 0;
    dt_checkpoint_report rep;
    tu_check_status(ctx, dt_checkpoint_load_ex(ctx, NULL, path, &cc, NULL, &rep), "non-strict");
    assert_int_equal(rep.loaded, 1);
    assert_int_equal(rep.missing, 1);
    assert_int_equal(rep.mismatched, 1);
    assert_int_equal(rep.unexpected, 1);
    assert_string_equal(rep.names, "mismatched: fc.bias; missing: new.weight; unexpected: head.weight");
    float *wa = tu_read(a.ctx, a.w, NULL), *wb = tu_read(ctx, w, NULL);
    assert_memory_equal(wa, wb, sizeof(float) * NW);
    free(wa);
    free(wb);
    TU_EXPECT(ctx, b, 0, 0, 3, 3, 3, 3, 3);
    TU_EXPECT(ctx, n, 0, 0, 1, 2);
    /* strict refuses the same file; a non-strict load takes no optimizer */
    assert_int_equal(dt_checkpoint_load(ctx, NULL, path, NULL), DT_EMISMATCH);
    dt_optim_config oc;
    dt_optim_config_init(&oc, DT_SGD);
    dt_optim *opt = dt_optim_new(ctx, &oc, NULL, 0);
    assert_int_equal(dt_checkpoint_load_ex(ctx, opt, path, &cc, NULL, NULL), DT_EINVAL);
    dt_optim_free(opt);
    dt_ctx_free(ctx);
    fx_free(&a);
    tu_rmdir(dir);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_ckpt_roundtrip),
    cmocka_unit_test(test_ckpt_file_layout),
    cmocka_unit_test(test_ckpt_load_foreign_file),
    cmocka_unit_test(test_ckpt_corrupt_truncated),
    cmocka_unit_test(test_ckpt_corrupt_header),
    cmocka_unit_test(test_ckpt_corrupt_entries),
    cmocka_unit_test(test_ckpt_mismatched_model),
    cmocka_unit_test(test_ckpt_load_directory),
    cmocka_unit_test(test_ckpt_16bit),
    cmocka_unit_test(test_ckpt_metadata),
    cmocka_unit_test(test_ckpt_non_strict),
};

DT_TEST_GROUP(core_ckpt, tests)
