/*
 * tests/test_core_ckpt.c - checkpoints: round trip into a fresh context, the
 * safetensors layout read back by hand, files written by hand (as PyTorch's
 * safetensors would write them) loaded, and corrupt files refused without
 * touching the parameters.
 */
#include "test_util.h"

#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

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
    dt_ctx_step_reset(ctx);
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
    tu_check_status(a.ctx, dt_checkpoint_save(a.ctx, a.opt, path, 7, NULL), "dt_checkpoint_save");
    assert_int_not_equal(access(path, F_OK), -1);
    if (access(tmp, F_OK) == 0) fail_msg("%s left behind after a successful save", tmp);
    assert_int_equal(dir_entries(dir), 1);

    /* Fresh context, different initial values, fresh optimizer. */
    fx_init(&b, 2, 1);
    int64_t step = -1;
    tu_check_status(b.ctx, dt_checkpoint_load(b.ctx, b.opt, path, NULL, &step, NULL), "dt_checkpoint_load");
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
    tu_check_status(c.ctx, dt_checkpoint_load(c.ctx, NULL, path, NULL, NULL, NULL), "load without optimizer");
    float wc[NW], bc[NB];
    fx_get(&c, wc, bc);
    assert_memory_equal(wc, wsaved, sizeof wc);
    assert_memory_equal(bc, bsaved, sizeof bc);
    fx_free(&c);

    /* Saving again over an existing file replaces it. */
    tu_check_status(a.ctx, dt_checkpoint_save(a.ctx, NULL, path, 8, NULL), "save again");
    assert_int_equal(dir_entries(dir), 1);
    fixture d;
    fx_init(&d, 4, 0);
    tu_check_status(d.ctx, dt_checkpoint_load(d.ctx, NULL, path, NULL, &step, NULL), "load again");
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
    tu_check_status(a.ctx, dt_checkpoint_save(a.ctx, a.opt, path, 1, NULL), "save");

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

static void keep_note(void *user, const char *msg) { snprintf(user, 512, "%s", msg); }

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
    char note[512] = "";
    dt_ctx_set_log(f.ctx, keep_note, note);
    tu_check_status(f.ctx, dt_checkpoint_load(f.ctx, NULL, path, NULL, NULL, NULL), "load foreign file");
    /* loaded, with a note that nothing could verify its data */
    if (!strstr(note, "no checksums") || !strstr(note, path)) fail_msg("note: '%s'", note);
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
/* The optimizer's state and step counts, flattened (for "untouched"). */
static float *opt_snapshot(dt_optim *opt, size_t *n_out)
{
    size_t n = 0;
    for (int i = 0; opt && i < dt_optim_state_count(opt); i++)
        n += (size_t)dt_tensor_numel(dt_optim_state_at(opt, i));
    float *v = malloc(sizeof *v * (n + 2));
    assert_non_null(v);
    size_t k = 0;
    for (int i = 0; opt && i < dt_optim_state_count(opt); i++) {
        dt_tensor *t = dt_optim_state_at(opt, i);
        assert_int_equal(dt_tensor_get(t, v + k, dt_tensor_numel(t)), DT_OK);
        k += (size_t)dt_tensor_numel(t);
    }
    v[k++] = opt ? (float)dt_optim_steps(opt) : 0;
    v[k++] = opt ? dt_optim_lr(opt) : 0;
    *n_out = k;
    return v;
}

static int check_refused(fixture *f, dt_optim *opt, const char *path, const char *what)
{
    float w0[NW], b0[NB], w1[NW], b1[NB];
    fx_get(f, w0, b0);
    size_t ns0, ns1;
    float *s0 = opt_snapshot(opt, &ns0);
    int64_t step = 12345;
    int ok = 1;
    dt_status s = dt_checkpoint_load(f->ctx, opt, path, NULL, &step, NULL);
    if (s == DT_OK) {
        print_error("%s (optimizer %s): dt_checkpoint_load returned DT_OK\n", what,
                    opt ? "given" : "NULL");
        ok = 0;
    } else if (dt_last_error(f->ctx)[0] == '\0') {
        print_error("%s: no error message\n", what);
        ok = 0;
    }
    fx_get(f, w1, b1);
    float *s1 = opt_snapshot(opt, &ns1);
    if (s != DT_OK && (memcmp(w0, w1, sizeof w0) || memcmp(b0, b1, sizeof b0))) {
        print_error("%s: parameters changed by a refused load\n", what);
        ok = 0;
    }
    if (s != DT_OK && (ns0 != ns1 || memcmp(s0, s1, ns0 * sizeof *s0) || step != 12345)) {
        print_error("%s: optimizer or step changed by a refused load\n", what);
        ok = 0;
    }
    free(s0);
    free(s1);
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
    tu_check_status(a.ctx, dt_checkpoint_save(a.ctx, a.opt, path, 3, NULL), "save");
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
    tu_check_status(f.ctx, dt_checkpoint_load(f.ctx, f.opt, path, NULL, NULL, NULL), "load good file");
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
    tu_check_status(a.ctx, dt_checkpoint_save(a.ctx, NULL, path, 3, NULL), "save");
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
        tu_check_status(f.ctx, dt_checkpoint_load(f.ctx, NULL, bad, NULL, NULL, NULL), "baseline file");
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
    assert_int_not_equal(dt_checkpoint_save(f.ctx, NULL, nodir, 0, NULL), DT_OK);
    assert_true(dt_last_error(f.ctx)[0] != '\0');

    fx_free(&f);
    tu_rmdir(dir);
}

/* ---------------------------------------------------------------------------
 * The corruption sweep: a real checkpoint (parameters and Adam's state)
 * changed one way at a time, each refused with a message and nothing
 * changed.  Header edits are tried twice: as they are (the header checksum
 * no longer matches) and with dtrain.header_crc32 recomputed, so each check
 * behind the checksum (layout, keys, values) is shown to hold on its own.
 * ------------------------------------------------------------------------- */
typedef struct sweep {
    fixture *f;
    const unsigned char *buf;   /* the good file */
    size_t len, n;              /* its length, its header's */
    const char *bad;            /* where each case is written */
    int failures, cases;
} sweep;

/* The header checksum as dtrain computes it (its own field as zeros). */
static void fix_header_crc(char *h, size_t len)
{
    static const char key[] = "\"dtrain.header_crc32\":\"";
    char *at = strstr(h, key);
    if (!at) return;
    at += sizeof key - 1;
    memset(at, '0', 8);
    char hex[9];
    snprintf(hex, sizeof hex, "%08lx", crc32(0, (const unsigned char *)h, (uInt)len));
    memcpy(at, hex, 8);
}

/* Write header h (any length) followed by the good file's data, with `extra`
 * zero bytes after it; then expect the load refused, with and without the
 * optimizer. */
static void sweep_try(sweep *w, const char *h, size_t extra, const char *what)
{
    size_t hl = strlen(h), dl = w->len - 8 - w->n;
    unsigned char *out = calloc(8 + hl + dl + extra, 1);
    assert_non_null(out);
    put_le64(out, hl);
    memcpy(out + 8, h, hl);
    memcpy(out + 8 + hl, w->buf + 8 + w->n, dl);
    tu_write_file(w->bad, out, 8 + hl + dl + extra);
    free(out);
    w->cases++;
    w->failures += !check_refused(w->f, NULL, w->bad, what);
    w->failures += !check_refused(w->f, w->f->opt, w->bad, what);
}

/* The header with the first `from` replaced by `to` (NULL if absent). */
static char *header_edit(const sweep *w, const char *from, const char *to)
{
    char *h = malloc(w->n + 1);
    assert_non_null(h);
    memcpy(h, w->buf + 8, w->n);
    h[w->n] = 0;
    char *at = strstr(h, from);
    if (!at) {
        free(h);
        return NULL;
    }
    size_t fl = strlen(from), tl = strlen(to), hl = strlen(h);
    char *out = malloc(hl - fl + tl + 1);
    assert_non_null(out);
    memcpy(out, h, (size_t)(at - h));
    memcpy(out + (at - h), to, tl);
    strcpy(out + (at - h) + tl, at + fl);
    free(h);
    return out;
}

/* One edit, tried stale and with the header checksum fixed. */
static void sweep_edit(sweep *w, const char *from, const char *to, size_t extra, const char *what)
{
    char *h = header_edit(w, from, to);
    if (!h) fail_msg("%s: '%s' is not in the header", what, from);
    char label[256];
    snprintf(label, sizeof label, "%s (header checksum stale)", what);
    sweep_try(w, h, extra, label);
    fix_header_crc(h, strlen(h));
    snprintf(label, sizeof label, "%s (header checksum recomputed)", what);
    sweep_try(w, h, extra, label);
    free(h);
}

/* The k-th "data_offsets":[b,e] of the header, as text and numbers. */
static int nth_offsets(const sweep *w, int k, char *text, size_t cap, uint64_t *b, uint64_t *e)
{
    char *h = malloc(w->n + 1);
    assert_non_null(h);
    memcpy(h, w->buf + 8, w->n);
    h[w->n] = 0;
    const char *at = h;
    for (int i = 0; at && i <= k; i++) {
        at = strstr(at, "\"data_offsets\":[");
        if (at && i < k) at++;
    }
    int ok = at && sscanf(at, "\"data_offsets\":[%" SCNu64 ",%" SCNu64 "]", b, e) == 2;
    if (ok) snprintf(text, cap, "\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]", *b, *e);
    free(h);
    return ok;
}

static void sweep_offsets(sweep *w)
{
    char from[96], to[96];
    uint64_t b, e, last_b = 0, last_e = 0;
    int k = 0, last = -1;
    while (nth_offsets(w, k, from, sizeof from, &b, &e)) {
        if (e > last_e) last = k, last_b = b, last_e = e;
        k++;
    }
    assert_true(k >= 4 && last >= 0);
    nth_offsets(w, last, from, sizeof from, &b, &e);
    snprintf(to, sizeof to, "\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]", last_b - 4, last_e - 4);
    sweep_edit(w, from, to, 0, "the last tensor overlapping the one before it");
    snprintf(to, sizeof to, "\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]", last_b + 4, last_e + 4);
    sweep_edit(w, from, to, 4, "a 4-byte hole before the last tensor");
    snprintf(to, sizeof to, "\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]", last_b + 8, last_e + 8);
    sweep_edit(w, from, to, 0, "the last tensor past the end of the data");
    snprintf(to, sizeof to, "\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]", last_b, last_e + 4);
    sweep_edit(w, from, to, 4, "the last tensor 4 bytes longer than its shape");
    snprintf(to, sizeof to, "\"data_offsets\":[0,%" PRIu64 "]", last_e - last_b);
    sweep_edit(w, from, to, 0, "the last tensor at offset 0, over the first");
    /* two tensors swapping places: each still in range, the checksums catch it */
    char from0[96];
    uint64_t b0, e0;
    nth_offsets(w, 0, from0, sizeof from0, &b0, &e0);
    if (e0 - b0 == last_e - last_b && last != 0) {
        char *h = header_edit(w, from0, "@@FIRST@@");
        assert_non_null(h);
        char *at = strstr(h, from);
        assert_non_null(at);
        char to0[96];
        snprintf(to0, sizeof to0, "\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]", last_b, last_e);
        /* (rebuilt by hand: two replacements) */
        size_t need = strlen(h) + 2 * sizeof to0;
        char *out = malloc(need);
        assert_non_null(out);
        snprintf(out, need, "%.*s%s%s", (int)(at - h), h, from0, at + strlen(from));
        char *mark = strstr(out, "@@FIRST@@");
        assert_non_null(mark);
        char *fin = malloc(need);
        assert_non_null(fin);
        snprintf(fin, need, "%.*s%s%s", (int)(mark - out), out, to0, mark + 9);
        fix_header_crc(fin, strlen(fin));
        sweep_try(w, fin, 0, "two same-size tensors' offsets swapped (checksums recomputed)");
        free(fin);
        free(out);
        free(h);
    }
}

static void sweep_types_and_shapes(sweep *w)
{
    static const char *dtypes[] = {"\"dtype\":\"F16\"", "\"dtype\":\"BF16\"", "\"dtype\":\"I32\"",
                                   "\"dtype\":\"F64\"", "\"dtype\":\"f32\"", "\"dtype\":\"\""};
    for (int i = 0; i < TU_ARRAY_LEN(dtypes); i++) {
        char what[96];
        snprintf(what, sizeof what, "the first tensor's dtype as %s", dtypes[i]);
        sweep_edit(w, "\"dtype\":\"F32\"", dtypes[i], 0, what);
    }
    static const char *shapes[] = {"\"shape\":[4,3]", "\"shape\":[12]", "\"shape\":[3,4,1]",
                                   "\"shape\":[2,6]", "\"shape\":[3,5]", "\"shape\":[]"};
    for (int i = 0; i < TU_ARRAY_LEN(shapes); i++) {
        char what[96];
        snprintf(what, sizeof what, "fc.weight's shape as %s", shapes[i]);
        sweep_edit(w, "\"shape\":[3,4]", shapes[i], 0, what);
    }
}

/* Every dtrain.* key of the file: removed, renamed (last letter, prefix). */
static void sweep_keys(sweep *w)
{
    char *h = malloc(w->n + 1);
    assert_non_null(h);
    memcpy(h, w->buf + 8, w->n);
    h[w->n] = 0;
    int keys = 0;
    for (const char *at = strstr(h, ",\"dtrain."); at; at = strstr(at + 1, ",\"dtrain.")) {
        const char *kend = strstr(at + 2, "\":\"");
        const char *vend = kend ? strchr(kend + 3, '"') : NULL;
        assert_non_null(vend);
        char pair[512], key[256], what[400], to[512];
        snprintf(pair, sizeof pair, "%.*s", (int)(vend + 1 - at), at);
        snprintf(key, sizeof key, "%.*s", (int)(kend + 1 - (at + 1)), at + 1);
        snprintf(what, sizeof what, "metadata %s removed", key);
        sweep_edit(w, pair, "", 0, what);
        snprintf(to, sizeof to, "%s", pair);
        char *last = to + 1 + strlen(key) - 2;          /* the key's last letter */
        *last = *last == 'x' ? 'y' : 'x';
        snprintf(what, sizeof what, "metadata %s renamed (last letter)", key);
        sweep_edit(w, pair, to, 0, what);
        snprintf(to, sizeof to, "%s", pair);
        memcpy(to + 2, "dtrajn", 6);
        snprintf(what, sizeof what, "metadata %s renamed (prefix)", key);
        sweep_edit(w, pair, to, 0, what);
        keys++;
    }
    free(h);
    assert_true(keys >= 10);   /* step, checksum, header crc, 4 optimizer keys, a crc per tensor */
    sweep_edit(w, "\"dtrain.step\":\"", "\"dtrain.unknown\":\"1\",\"dtrain.step\":\"", 0,
               "an unknown dtrain.* key");
    sweep_edit(w, "\"dtrain.step\":\"", "\"dtrain.step\":\"1\",\"dtrain.step\":\"", 0,
               "dtrain.step twice");
    sweep_edit(w, "\"dtrain.step\":\"", "\"dtrain.step\":\"-", 0, "a negative step");
    sweep_edit(w, "\"dtrain.step\":\"", "\"dtrain.step\":\"x", 0, "a step that is not a number");
    sweep_edit(w, "\"dtrain.optim.lr\":\"", "\"dtrain.optim.lr\":\"-", 0, "a negative lr");
    sweep_edit(w, "\"dtrain.optim.kind\":\"", "\"dtrain.optim.kind\":\"9", 0, "optimizer kind 9x");
    sweep_edit(w, "\"dtrain.optim.param_steps\":\"", "\"dtrain.optim.param_steps\":\"9", 0,
               "a parameter with more steps than the optimizer");
    sweep_edit(w, "\"dtrain.optim.param_steps\":\"", "\"dtrain.optim.param_steps\":\"1,", 0,
               "one parameter step too many");
    sweep_edit(w, "\"dtrain.checksum\":\"crc32\"", "\"dtrain.checksum\":\"md5\"", 0,
               "an unknown checksum");
    sweep_edit(w, "\"dtrain.crc32.fc.bias\":\"", "\"dtrain.crc32.fc.bias\":\"0", 0,
               "a 9-digit checksum");
    sweep_edit(w, "\"dtrain.crc32.fc.bias\":\"", "\"dtrain.crc32.nothing\":\"00000000\","
               "\"dtrain.crc32.fc.bias\":\"", 0, "a checksum for a tensor the file lacks");
}

static void sweep_flips(sweep *w)
{
    tu_rng r = {7041};
    unsigned char *mod = malloc(w->len);
    assert_non_null(mod);
    int bad = 0;
    for (int k = 0; k < 300; k++) {   /* one bit of the length or the header */
        memcpy(mod, w->buf, w->len);
        size_t at = (size_t)(tu_next(&r) % (8 + w->n));
        mod[at] ^= (unsigned char)(1u << (tu_next(&r) % 8));
        tu_write_file(w->bad, mod, w->len);
        char what[96];
        snprintf(what, sizeof what, "a bit flipped in header byte %zu", at);
        bad += !check_refused(w->f, w->f->opt, w->bad, what);
    }
    for (int k = 0; k < 200; k++) {   /* one bit of the data */
        memcpy(mod, w->buf, w->len);
        size_t at = 8 + w->n + (size_t)(tu_next(&r) % (w->len - 8 - w->n));
        mod[at] ^= (unsigned char)(1u << (tu_next(&r) % 8));
        tu_write_file(w->bad, mod, w->len);
        char what[96];
        snprintf(what, sizeof what, "a bit flipped in data byte %zu", at - 8 - w->n);
        bad += !check_refused(w->f, k % 2 ? w->f->opt : NULL, w->bad, what);
    }
    free(mod);
    w->failures += bad;
}

static void sweep_paths(sweep *w, const char *dir)
{
    char p[200], q[200];
    snprintf(p, sizeof p, "%s/fifo", dir);
    assert_int_equal(mkfifo(p, 0600), 0);
    w->failures += !check_refused(w->f, w->f->opt, p, "a FIFO (nobody writing)");
    snprintf(p, sizeof p, "%s/loop_a", dir);
    snprintf(q, sizeof q, "%s/loop_b", dir);
    assert_int_equal(symlink(q, p), 0);
    assert_int_equal(symlink(p, q), 0);
    w->failures += !check_refused(w->f, w->f->opt, p, "a symlink loop");
    snprintf(p, sizeof p, "%s/dangling", dir);
    assert_int_equal(symlink("/nonexistent/x.safetensors", p), 0);
    w->failures += !check_refused(w->f, w->f->opt, p, "a dangling symlink");
    w->failures += !check_refused(w->f, w->f->opt, dir, "a directory");
    w->failures += !check_refused(w->f, w->f->opt, "/dev/zero", "a character device");
    tu_write_file(w->bad, "", 0);
    w->failures += !check_refused(w->f, w->f->opt, w->bad, "an empty file");
    for (size_t cut = 1; cut < w->len; cut += cut < 16 ? 1 : (cut < 8 + w->n ? 97 : 13)) {
        tu_write_file(w->bad, w->buf, cut);
        char what[96];
        snprintf(what, sizeof what, "the file cut to %zu of %zu bytes", cut, w->len);
        w->failures += !check_refused(w->f, w->f->opt, w->bad, what);
    }
    const uint64_t lens[] = {w->n - 1, w->n + 1, w->n - 8, w->n + 8, w->n * 2, 0};
    unsigned char *mod = malloc(w->len);
    assert_non_null(mod);
    for (int i = 0; i < TU_ARRAY_LEN(lens); i++) {
        memcpy(mod, w->buf, w->len);
        put_le64(mod, lens[i]);
        tu_write_file(w->bad, mod, w->len);
        char what[96];
        snprintf(what, sizeof what, "header length %llu for %zu", (unsigned long long)lens[i], w->n);
        w->failures += !check_refused(w->f, w->f->opt, w->bad, what);
    }
    free(mod);
}

static void test_ckpt_corruption_sweep(void **state)
{
    (void)state;
    char dir[64], path[128], bad[160];
    tu_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/good.safetensors", dir);
    snprintf(bad, sizeof bad, "%s/bad.safetensors", dir);
    fixture a, f;
    fx_init(&a, 21, 1);
    tu_rng r = {505};
    fx_step(&a, &r);
    fx_step(&a, &r);
    tu_check_status(a.ctx, dt_checkpoint_save(a.ctx, a.opt, path, 2, NULL), "save");
    size_t len = 0;
    unsigned char *buf = tu_read_file(path, &len);
    assert_non_null(buf);
    fx_init(&f, 22, 1);
    fx_step(&f, &r);   /* f's optimizer has state of its own to keep */
    sweep w = {&f, buf, len, (size_t)le64(buf), bad, 0, 0};
    sweep_offsets(&w);
    sweep_types_and_shapes(&w);
    sweep_keys(&w);
    sweep_flips(&w);
    sweep_paths(&w, dir);
    print_message("corruption sweep: %d header edits (x2), 500 bit flips, paths, cuts: "
                  "%d not refused cleanly\n", w.cases, w.failures);
    if (w.failures) fail_msg("%d corrupt checkpoints were not refused cleanly", w.failures);
    /* nothing was trained: the good file still loads, and training goes on */
    int64_t step = 0;
    tu_check_status(f.ctx, dt_checkpoint_load(f.ctx, f.opt, path, NULL, &step, NULL), "load the good file");
    assert_int_equal(step, 2);
    float w0[NW], b0[NB], w1[NW], b1[NB];
    fx_get(&a, w0, b0);
    fx_get(&f, w1, b1);
    assert_memory_equal(w0, w1, sizeof w0);
    assert_memory_equal(b0, b1, sizeof b0);
    assert_int_equal(dt_optim_steps(f.opt), 2);
    fx_step(&f, &r);
    free(buf);
    fx_free(&a);
    fx_free(&f);
    tu_rmdir(dir);
}

/* dt_checkpoint_latest: the highest step among the files that pass every
 * check; a corrupt newer one is skipped with a note. */
static void test_ckpt_latest(void **state)
{
    (void)state;
    char dir[64], p[160], got[256];
    tu_tmpdir(dir, sizeof dir);
    fixture f;
    fx_init(&f, 31, 1);
    char note[512] = "";
    dt_ctx_set_log(f.ctx, keep_note, note);
    int64_t step = 99;
    tu_check_status(f.ctx, dt_checkpoint_latest(f.ctx, dir, got, sizeof got, &step), "empty dir");
    assert_string_equal(got, "");
    assert_int_equal(step, -1);
    /* saved in this order: the newest file (mtime) of the whole ones is
     * step 7, the last name in sorted order "step-7" too; the highest step
     * of the whole ones is 10 */
    const int steps[] = {2, 10, 7, 30};
    for (int i = 0; i < 4; i++) {
        snprintf(p, sizeof p, "%s/step-%d.safetensors", dir, steps[i]);
        tu_check_status(f.ctx, dt_checkpoint_save(f.ctx, f.opt, p, steps[i], NULL), "save");
        usleep(20 * 1000);   /* mtimes apart */
    }
    snprintf(p, sizeof p, "%s/notes.txt", dir);
    tu_write_file(p, "not a checkpoint", 16);
    snprintf(p, sizeof p, "%s/step-30.safetensors", dir);   /* the highest, flipped */
    size_t len = 0;
    unsigned char *buf = tu_read_file(p, &len);
    assert_non_null(buf);
    buf[len - 3] ^= 0x10;
    tu_write_file(p, buf, len);
    free(buf);
    tu_check_status(f.ctx, dt_checkpoint_latest(f.ctx, dir, got, sizeof got, &step), "latest");
    snprintf(p, sizeof p, "%s/step-10.safetensors", dir);
    assert_string_equal(got, p);
    assert_int_equal(step, 10);
    if (!strstr(note, "step-30.safetensors") || !strstr(note, "checksum")) fail_msg("note: %s", note);
    assert_int_equal(dt_checkpoint_latest(f.ctx, dir, got, 8, &step), DT_EINVAL);   /* too small */
    snprintf(p, sizeof p, "%s/nope", dir);
    assert_int_equal(dt_checkpoint_latest(f.ctx, p, got, sizeof got, &step), DT_EIO);
    assert_int_equal(dt_checkpoint_latest(f.ctx, NULL, got, sizeof got, &step), DT_EINVAL);
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

/* The longest name a parameter may have (127 characters), with Adam's
 * state ("optim.<name>.exp_avg_sq", 144 characters): saved and loaded. */
static void test_ckpt_long_names(void **state)
{
    (void)state;
    char dir[64], path[128], name[DT_MAX_NAME];
    tu_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/long.safetensors", dir);
    memset(name, 'p', sizeof name - 1);
    name[sizeof name - 1] = '\0';
    float want[4] = {1, -2, 3, -4}, got[4];
    dt_ctx *ctx[2];
    dt_optim *opt[2];
    dt_tensor *w[2];
    for (int k = 0; k < 2; k++) {
        ctx[k] = tu_ctx_new();
        w[k] = tu_param(ctx[k], name, SHP(4), k ? NULL : want);
        dt_optim_config oc;
        dt_optim_config_init(&oc, DT_ADAM);
        opt[k] = dt_optim_new(ctx[k], &oc, NULL, 0);
        tu_check(ctx[k], opt[k], "optim");
    }
    tu_check_status(ctx[0], dt_backward(ctx[0], dt_sum(ctx[0], w[0])), "backward");
    tu_check_status(ctx[0], dt_optim_step(opt[0]), "step");
    tu_check_status(ctx[0], dt_tensor_get(w[0], want, 4), "get");
    tu_check_status(ctx[0], dt_checkpoint_save(ctx[0], opt[0], path, 1, NULL), "save");
    tu_check_status(ctx[1], dt_checkpoint_load(ctx[1], opt[1], path, NULL, NULL, NULL), "load");
    tu_check_status(ctx[1], dt_tensor_get(w[1], got, 4), "get");
    assert_memory_equal(want, got, sizeof want);
    assert_int_equal(dt_optim_steps(opt[1]), 1);
    for (int k = 0; k < 2; k++) {
        dt_optim_free(opt[k]);
        dt_ctx_free(ctx[k]);
    }
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
    tu_check_status(a.ctx, dt_checkpoint_save(a.ctx, NULL, path, 0, NULL), "save");

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
    assert_int_not_equal(dt_checkpoint_load(ctx, NULL, path, NULL, NULL, NULL), DT_OK);
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
        tu_check_status(a.ctx, dt_checkpoint_save(a.ctx, a.opt, path, 1, &cc), "save 16-bit");
        size_t len;
        unsigned char *raw = tu_read_file(path, &len);
        assert_non_null(strstr((const char *)raw + 8, k ? "\"F16\"" : "\"BF16\""));
        free(raw);
        fixture b;
        fx_init(&b, 22, 1);
        tu_check_status(b.ctx, dt_checkpoint_load(b.ctx, b.opt, path, NULL, NULL, NULL), "load 16-bit");
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
    assert_int_equal(dt_checkpoint_save(ctx, NULL, path, 0, &cc), DT_EINVAL);
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
    tu_check_status(a.ctx, dt_checkpoint_save(a.ctx, NULL, path, 7, &cc), "save");
    tu_check_status(a.ctx, dt_checkpoint_metadata(a.ctx, path, "note", val, sizeof val), "note");
    assert_string_equal(val, "a \"quoted\" note");
    tu_check_status(a.ctx, dt_checkpoint_metadata(a.ctx, path, "model", val, sizeof val), "model");
    assert_string_equal(val, "gpt-4x128");
    tu_check_status(a.ctx, dt_checkpoint_metadata(a.ctx, path, "dtrain.step", val, sizeof val), "");
    assert_string_equal(val, "7");
    assert_int_equal(dt_checkpoint_metadata(a.ctx, path, "nope", val, sizeof val), DT_EMISMATCH);
    keys[1] = "dtrain.x";
    assert_int_equal(dt_checkpoint_save(a.ctx, NULL, path, 0, &cc), DT_EINVAL);
    keys[1] = "model";
    assert_int_equal(dt_checkpoint_save(a.ctx, NULL, path, 0, &cc), DT_EINVAL);
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
    tu_check_status(a.ctx, dt_checkpoint_save(a.ctx, NULL, path, 0, NULL), "save");
    dt_ctx *ctx = tu_ctx_new();
    dt_tensor *w = tu_param(ctx, "fc.weight", SHP(3, 4), NULL);       /* fits */
    dt_tensor *b = tu_param(ctx, "fc.bias", SHP(5), NULL);            /* another shape */
    dt_tensor *n = tu_param(ctx, "new.weight", SHP(2), (const float[]){1, 2});   /* missing */
    dt_tensor_fill(b, 3.0f);
    dt_checkpoint_config cc;
    dt_checkpoint_config_init(&cc);
    cc.strict = 0;
    dt_checkpoint_report rep;
    tu_check_status(ctx, dt_checkpoint_load(ctx, NULL, path, &cc, NULL, &rep), "non-strict");
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
    assert_int_equal(dt_checkpoint_load(ctx, NULL, path, NULL, NULL, NULL), DT_EMISMATCH);
    dt_optim_config oc;
    dt_optim_config_init(&oc, DT_SGD);
    dt_optim *opt = dt_optim_new(ctx, &oc, NULL, 0);
    assert_int_equal(dt_checkpoint_load(ctx, opt, path, &cc, NULL, NULL), DT_EINVAL);
    dt_optim_free(opt);
    dt_ctx_free(ctx);
    fx_free(&a);
    tu_rmdir(dir);
}

/* --- kill -9 during a save ---------------------------------------------- */

enum { KILL_N = 1 << 22 };   /* 16 MiB of parameter: a save takes milliseconds */

/* A process that saves to path again and again, save j with every
 * element and the step value * 1000 + j (each save's bytes differ from
 * the last, so one written over another in place is seen torn), writing
 * a byte to `ready` before each save starts.  Never returns. */
static void kill_saver(const char *path, int value, int ready)
{
    dt_ctx *ctx = tu_ctx_new();
    dt_tensor *p = ctx ? dt_param_new(ctx, "big", 1, (const int64_t[]){KILL_N}) : NULL;
    if (!p)
        _exit(2);
    for (int j = 0;; j++) {
        int v = value * 1000 + j;
        if (dt_tensor_fill(p, (float)v) != DT_OK || write(ready, "s", 1) != 1 ||
            dt_checkpoint_save(ctx, NULL, path, v, NULL) != DT_OK)
            _exit(3);
    }
}

/* What path holds now: every element the same value, the file's step that
 * value; returns it (the test fails on anything else). */
static int kill_loaded_value(dt_ctx *ctx, dt_tensor *p, float *buf, const char *path)
{
    int64_t step = -1;
    tu_check_status(ctx, dt_checkpoint_load(ctx, NULL, path, NULL, &step, NULL), "load after the kill");
    assert_int_equal(dt_tensor_get(p, buf, KILL_N), DT_OK);
    for (int64_t i = 1; i < KILL_N; i++)
        if (buf[i] != buf[0])
            fail_msg("a torn checkpoint: element %lld is %g, element 0 %g", (long long)i,
                     (double)buf[i], (double)buf[0]);
    assert_true(buf[0] == (float)step);
    return (int)step;
}

/* SIGKILL a process at random moments inside its saves: the checkpoint at
 * the path is always a whole earlier save (the first, or one that
 * completed), never a torn or empty file, and a save's leftover .tmp
 * neither breaks the next save nor counts as a checkpoint. */
static void test_ckpt_kill_during_save(void **state)
{
    (void)state;
    char dir[64], path[160], tmp[176], got[256];
    tu_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/ckpt.safetensors", dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    dt_ctx *ctx = tu_ctx_new();
    dt_tensor *p = dt_param_new(ctx, "big", 1, (const int64_t[]){KILL_N});
    tu_check(ctx, p, "param");
    dt_tensor_fill(p, 1.0f);
    double t0 = dt_now();
    tu_check_status(ctx, dt_checkpoint_save(ctx, NULL, path, 1, NULL), "first save");
    double save_s = dt_now() - t0;
    float *buf = malloc(sizeof(float) * KILL_N);
    assert_non_null(buf);
    tu_rng r = {77};
    int mid = 0, newest = 1, kills = 12;   /* newest: the last whole save's value */
    for (int k = 0; k < kills; k++) {
        int ready[2];
        assert_int_equal(pipe(ready), 0);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            close(ready[0]);
            kill_saver(path, 2 + k, ready[1]);
        }
        close(ready[1]);
        char c;
        for (int starts = 0; starts < 2; starts++)   /* into its second save */
            assert_int_equal(read(ready[0], &c, 1), 1);
        usleep((useconds_t)(tu_uniform(&r, 0, 1.2f) * save_s * 1e6));   /* inside save 2 mostly */
        kill(pid, SIGKILL);
        int st;
        waitpid(pid, &st, 0);
        assert_true(WIFSIGNALED(st));
        close(ready[0]);
        mid += access(tmp, F_OK) == 0;   /* it died between creating .tmp and renaming it */
        int v = kill_loaded_value(ctx, p, buf, path);
        assert_int_equal(v / 1000, 2 + k);   /* one of its saves, whole (its first was whole
                                                before its second began) */
        newest = v;
    }
    print_message("kill -9 during a save: %d of %d kills left a .tmp (a save of %.0f ms); every "
                  "load was a whole save\n", mid, kills, save_s * 1e3);
    assert_true(mid >= 2);   /* the kills did land inside saves */
    int64_t step = -1;
    tu_check_status(ctx, dt_checkpoint_latest(ctx, dir, got, sizeof got, &step), "latest");
    assert_string_equal(got, path);
    assert_int_equal(step, newest);
    dt_tensor_fill(p, 5.0f);   /* a save over a leftover .tmp */
    tu_check_status(ctx, dt_checkpoint_save(ctx, NULL, path, 5, NULL), "save after the kills");
    assert_int_equal(kill_loaded_value(ctx, p, buf, path), 5);
    assert_int_equal(access(tmp, F_OK), -1);
    free(buf);
    dt_ctx_free(ctx);
    tu_rmdir(dir);
}

/* What peers waiting on this rank see while it saves (dt_ctx_activity): a
 * save into a FIFO blocks until the reader thread opens it, 300 ms in. */
typedef struct activity_probe {
    dt_ctx *ctx;
    char fifo[128], seen[96];
} activity_probe;

static void *probe_then_drain(void *arg)
{
    activity_probe *a = arg;
    usleep(300 * 1000);
    snprintf(a->seen, sizeof a->seen, "%s", dt_ctx_activity(a->ctx));
    int fd = open(a->fifo, O_RDONLY);
    char buf[4096];
    while (fd >= 0 && read(fd, buf, sizeof buf) > 0)
        ;
    if (fd >= 0)
        close(fd);
    return NULL;
}

static void test_activity_during_save(void **state)
{
    (void)state;
    char dir[64], path[96];
    tu_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/ck.safetensors", dir);
    dt_ctx *ctx = tu_ctx_new();
    tu_param(ctx, "w", SHP(4), NULL);
    activity_probe a = {.ctx = ctx};
    snprintf(a.fifo, sizeof a.fifo, "%s.tmp", path);
    assert_int_equal(mkfifo(a.fifo, 0600), 0);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, probe_then_drain, &a), 0);
    dt_checkpoint_save(ctx, NULL, path, 1, NULL);   /* (a FIFO cannot be synced: it may fail) */
    pthread_join(th, NULL);
    if (!strstr(a.seen, "writing a checkpoint for "))
        fail_msg("during the save, dt_ctx_activity said '%s'", a.seen);
    assert_string_equal(dt_ctx_activity(ctx), "computing");   /* and after */
    dt_ctx_free(ctx);
    tu_rmdir(dir);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_activity_during_save),
    cmocka_unit_test(test_ckpt_roundtrip),
    cmocka_unit_test(test_ckpt_file_layout),
    cmocka_unit_test(test_ckpt_load_foreign_file),
    cmocka_unit_test(test_ckpt_corrupt_truncated),
    cmocka_unit_test(test_ckpt_corrupt_header),
    cmocka_unit_test(test_ckpt_corruption_sweep),
    cmocka_unit_test(test_ckpt_latest),
    cmocka_unit_test(test_ckpt_corrupt_entries),
    cmocka_unit_test(test_ckpt_mismatched_model),
    cmocka_unit_test(test_ckpt_load_directory),
    cmocka_unit_test(test_ckpt_long_names),
    cmocka_unit_test(test_ckpt_16bit),
    cmocka_unit_test(test_ckpt_metadata),
    cmocka_unit_test(test_ckpt_non_strict),
    cmocka_unit_test(test_ckpt_kill_during_save),
};

DT_TEST_GROUP(core_ckpt, tests)
