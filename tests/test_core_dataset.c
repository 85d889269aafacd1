/*
 * tests/test_core_dataset.c - datasets of every kind (memory, raw and .npy
 * files, CSV, token streams, callbacks, subsets) through the loader:
 * shuffling, shards, prefetch and evaluation against a direct reference
 * computed here; malformed files refused with a message naming the fault.
 */
#include "test_util.h"

#include <sys/stat.h>

/* Sample i of the synthetic sets: input element k is i * 16 + k (exact in
 * f32, bf16 for small i, and u8 below 16), its label i % 5. */
#define N_SAMPLES 37
#define ELEMS 6
static float sample_value(int64_t i, int64_t k) { return (float)(i * 16 + k); }
static int sample_label(int64_t i) { return (int)(i % 5); }

/* The sample a batch row holds, found from its first element. */
static int64_t row_sample(const float *row) { return (int64_t)row[0] / 16; }

/* One epoch of ld: every row's input must be expect(i, k) and its label
 * sample_label(i); seen[i] counts the rows of sample i.  Returns rows. */
static int64_t drain(dt_ctx *ctx, dt_loader *ld, float (*expect)(int64_t, int64_t),
                     int64_t elems, int *seen)
{
    dt_tensor *x, *y;
    dt_status s;
    int64_t rows = 0;
    while ((s = dt_loader_next(ld, &x, &y)) == DT_OK) {
        int64_t b = dt_tensor_dim(x, 0);
        assert_int_equal(dt_tensor_dtype(x), DT_F32);
        assert_int_equal(dt_tensor_dtype(y), DT_I32);
        assert_int_equal(dt_tensor_dim(y, 0), b);
        float *xv = tu_read(ctx, x, NULL);
        int32_t *yv = malloc(sizeof *yv * (size_t)b);
        tu_check_status(ctx, dt_tensor_get(y, yv, b), "labels");
        for (int64_t r = 0; r < b; r++) {
            int64_t i = row_sample(xv + r * elems);
            assert_true(i >= 0 && i < N_SAMPLES);
            for (int64_t k = 0; k < elems; k++)
                assert_true(xv[r * elems + k] == expect(i, k));
            assert_int_equal(yv[r], sample_label(i));
            seen[i]++;
        }
        free(xv);
        free(yv);
        rows += b;
    }
    assert_int_equal(s, DT_EOF);
    return rows;
}

static void make_arrays(float *x, int32_t *y)
{
    for (int64_t i = 0; i < N_SAMPLES; i++) {
        for (int64_t k = 0; k < ELEMS; k++)
            x[i * ELEMS + k] = sample_value(i, k);
        y[i] = sample_label(i);
    }
}

static dt_loader *loader_for(dt_ctx *ctx, const dt_dataset *ds, int batch, int shuffle,
                             int prefetch, int rank, int shards)
{
    dt_loader_config c;
    dt_loader_config_init(&c);
    c.batch = batch;
    c.shuffle = shuffle;
    c.prefetch = prefetch;
    c.seed = 3;
    c.shard_rank = rank;
    c.shard_count = shards;
    c.shard_no_pad = 1;
    dt_loader *ld = dt_loader_new(ctx, ds, &c);
    tu_check(ctx, ld, "loader");
    return ld;
}

/* Every sample once per epoch, shuffled or not, prefetched or not, and
 * across shards together. */
static void check_epochs(dt_ctx *ctx, const dt_dataset *ds, float (*expect)(int64_t, int64_t))
{
    for (int shuffle = 0; shuffle < 2; shuffle++)
        for (int prefetch = 0; prefetch < 2; prefetch++) {
            int seen[N_SAMPLES] = {0};
            dt_loader *ld = loader_for(ctx, ds, 8, shuffle, prefetch, 0, 1);
            assert_int_equal(drain(ctx, ld, expect, ELEMS, seen), N_SAMPLES);
            for (int i = 0; i < N_SAMPLES; i++)
                assert_int_equal(seen[i], 1);
            dt_loader_free(ld);
        }
    int seen[N_SAMPLES] = {0};
    for (int r = 0; r < 3; r++) {
        dt_loader *ld = loader_for(ctx, ds, 5, 1, 1, r, 3);
        drain(ctx, ld, expect, ELEMS, seen);
        dt_loader_free(ld);
    }
    for (int i = 0; i < N_SAMPLES; i++)
        assert_int_equal(seen[i], 1);
}

static const dt_sample_field VEC_F32 = {DT_F32, 2, {2, 3}};
static const dt_sample_field LABEL = {DT_I32, 0, {0}};

static void test_dataset_memory(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    float x[N_SAMPLES * ELEMS];
    int32_t y[N_SAMPLES];
    make_arrays(x, y);
    for (int copy = 0; copy < 2; copy++) {
        dt_dataset *ds = dt_dataset_from_memory(ctx, N_SAMPLES, &VEC_F32, x, &LABEL, y, copy);
        tu_check(ctx, ds, "from_memory");
        assert_int_equal(dt_dataset_size(ds), N_SAMPLES);
        assert_int_equal(dt_dataset_classes(ds), 5);
        int64_t shape[DT_MAX_DIMS];
        assert_int_equal(dt_dataset_sample_shape(ds, shape), 2);
        assert_int_equal(shape[1], 3);
        check_epochs(ctx, ds, sample_value);
        /* zero copy: the loader reads the caller's array as it is now */
        x[4 * ELEMS + 1] = -1.0f;
        float got[ELEMS];
        int32_t lab;
        tu_check_status(ctx, dt_dataset_sample(ds, 4, got, &lab), "sample");
        assert_true(got[1] == (copy ? sample_value(4, 1) : -1.0f));
        assert_int_equal(lab, 4);
        x[4 * ELEMS + 1] = sample_value(4, 1);
        dt_dataset_free(ds);
    }
    /* a batch has the field's shape */
    dt_dataset *ds = dt_dataset_from_memory(ctx, N_SAMPLES, &VEC_F32, x, &LABEL, y, 0);
    dt_loader *ld = loader_for(ctx, ds, 4, 0, 0, 0, 1);
    dt_tensor *bx, *by;
    tu_check_status(ctx, dt_loader_next(ld, &bx, &by), "next");
    tu_assert_shape(bx, SHP(4, 2, 3));
    tu_assert_shape(by, SHP(4));
    dt_loader_free(ld);
    dt_dataset_free(ds);
    /* bad fields */
    dt_sample_field bad = VEC_F32;
    bad.shape[0] = 0;
    assert_null(dt_dataset_from_memory(ctx, N_SAMPLES, &bad, x, &LABEL, y, 0));
    tu_assert_error_mentions(ctx, "dim 0");
    bad = VEC_F32;
    bad.dtype = (dt_dtype)42;
    assert_null(dt_dataset_from_memory(ctx, N_SAMPLES, &bad, x, &LABEL, y, 0));
    tu_assert_error_mentions(ctx, "dtype");
    assert_null(dt_dataset_from_memory(ctx, 0, &VEC_F32, x, &LABEL, y, 0));
    assert_int_equal(dt_last_status(ctx), DT_EINVAL);
    dt_ctx_free(ctx);
}

/* bf16, f16 and u8 inputs widen to f32; float and u8 targets */
static uint16_t to_bf16(float f)   /* truncated: the reference below widens these bits */
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

/* sample_value(i, k) through to_bf16 and back (i * 16 itself is exact) */
static float bf16_value(int64_t i, int64_t k)
{
    uint32_t u = (uint32_t)to_bf16((float)(i * 16 + k)) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t to_f16(float f)   /* integers 0 to 2047: exact in f16 */
{
    int e = 0;
    float m = frexpf(f, &e);   /* f = m 2^e, 0.5 <= m < 1 */
    if (f == 0)
        return 0;
    uint32_t mant = (uint32_t)((m * 2 - 1) * 1024.0f);
    return (uint16_t)((uint32_t)(e - 1 + 15) << 10 | mant);
}

static float small_value(int64_t i, int64_t k) { return (float)(i * 16 + k); }

static void test_dataset_dtypes(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    uint16_t xb[N_SAMPLES * ELEMS], xh[N_SAMPLES * ELEMS];
    uint8_t lab[N_SAMPLES];
    for (int64_t i = 0; i < N_SAMPLES; i++) {
        for (int64_t k = 0; k < ELEMS; k++) {
            xb[i * ELEMS + k] = to_bf16(small_value(i, k));
            xh[i * ELEMS + k] = to_f16(small_value(i, k));
        }
        lab[i] = (uint8_t)sample_label(i);
    }
    dt_sample_field fb = {DT_BF16, 1, {ELEMS}}, fh = {DT_F16, 1, {ELEMS}}, fl = {DT_U8, 0, {0}};
    dt_dataset *ds = dt_dataset_from_memory(ctx, N_SAMPLES, &fb, xb, &fl, lab, 1);
    tu_check(ctx, ds, "bf16");
    check_epochs(ctx, ds, bf16_value);
    dt_dataset_free(ds);
    ds = dt_dataset_from_memory(ctx, N_SAMPLES, &fh, xh, &fl, lab, 1);
    tu_check(ctx, ds, "f16");
    check_epochs(ctx, ds, small_value);
    dt_dataset_free(ds);

    /* u8 images with per-channel normalisation, against the formula */
    enum { C = 2, HW = 3 };
    uint8_t img[N_SAMPLES * C * HW];
    for (int i = 0; i < N_SAMPLES * C * HW; i++)
        img[i] = (uint8_t)((i * 37) % 256);
    dt_sample_field fi = {DT_U8, 3, {C, 1, HW}};
    ds = dt_dataset_from_memory(ctx, N_SAMPLES, &fi, img, &fl, lab, 0);
    tu_check(ctx, ds, "u8");
    float mean[C] = {0.25f, 0.5f}, sd[C] = {0.5f, 2.0f};
    tu_check_status(ctx, dt_dataset_normalize(ds, 1, C, mean, sd), "normalize");
    dt_loader *ld = loader_for(ctx, ds, N_SAMPLES, 0, 1, 0, 1);
    dt_tensor *x, *y;
    tu_check_status(ctx, dt_loader_next(ld, &x, &y), "next");
    float *xv = tu_read(ctx, x, NULL);
    for (int i = 0; i < N_SAMPLES * C * HW; i++) {
        int c = (i / HW) % C;
        double want = ((double)img[i] / 255.0 - mean[c]) / sd[c];
        assert_true(tu_close(xv[i], want, 1e-6, 1e-6));
    }
    free(xv);
    dt_loader_free(ld);
    /* stats per channel, after the /255 */
    float m2[C], s2[C];
    tu_check_status(ctx, dt_dataset_stats(ds, C, m2, s2), "stats");
    for (int c = 0; c < C; c++) {
        double sum = 0, sq = 0, cnt = 0;
        for (int i = 0; i < N_SAMPLES * C * HW; i++)
            if ((i / HW) % C == c) {
                double v = img[i] / 255.0;
                sum += v;
                sq += v * v;
                cnt++;
            }
        double m = sum / cnt;
        assert_true(tu_close(m2[c], m, 1e-5, 1e-6));
        assert_true(tu_close(s2[c], sqrt(sq / cnt - m * m), 1e-4, 1e-6));
    }
    /* counts that fit no axis, a std of 0 */
    assert_int_equal(dt_dataset_normalize(ds, 1, 4, mean, sd), DT_EINVAL);
    float zero[C] = {1, 0};
    assert_int_equal(dt_dataset_normalize(ds, 1, C, mean, zero), DT_EINVAL);
    dt_dataset_free(ds);
    dt_ctx_free(ctx);
}

static void write_bytes(const char *path, const void *data, size_t len)
{
    tu_write_file(path, data, len);
}

static void test_dataset_raw_files(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    char dir[256], px[300], py[300];
    tu_tmpdir(dir, sizeof dir);
    snprintf(px, sizeof px, "%s/x.bin", dir);
    snprintf(py, sizeof py, "%s/y.bin", dir);
    float x[N_SAMPLES * ELEMS];
    int32_t y[N_SAMPLES];
    make_arrays(x, y);
    write_bytes(px, x, sizeof x);
    write_bytes(py, y, sizeof y);
    dt_dataset *ds = dt_dataset_load_raw(ctx, px, &VEC_F32, py, &LABEL);
    tu_check(ctx, ds, "load_raw");
    assert_int_equal(dt_dataset_size(ds), N_SAMPLES);
    check_epochs(ctx, ds, sample_value);
    dt_dataset_free(ds);
    /* one float too many; fewer labels than inputs */
    write_bytes(px, x, sizeof x - 4);
    assert_null(dt_dataset_load_raw(ctx, px, &VEC_F32, py, &LABEL));
    assert_int_equal(dt_last_status(ctx), DT_ECORRUPT);
    tu_assert_error_mentions(ctx, "whole number");
    write_bytes(px, x, sizeof x);
    write_bytes(py, y, sizeof y - 4);
    assert_null(dt_dataset_load_raw(ctx, px, &VEC_F32, py, &LABEL));
    tu_assert_error_mentions(ctx, "targets");
    assert_null(dt_dataset_load_raw(ctx, "/nonexistent/x.bin", &VEC_F32, py, &LABEL));
    assert_int_equal(dt_last_status(ctx), DT_EIO);
    tu_rmdir(dir);
    dt_ctx_free(ctx);
}

/* A .npy file as NumPy writes version 1.0: magic, version, header length,
 * the dict padded with spaces to 64 bytes and a newline, the data. */
static size_t npy_bytes(uint8_t *out, const char *dict, const void *data, size_t len)
{
    size_t hl = strlen(dict), total = (10 + hl + 1 + 63) / 64 * 64;
    memcpy(out, "\x93NUMPY\x01\x00", 8);
    out[8] = (uint8_t)((total - 10) & 0xff);
    out[9] = (uint8_t)((total - 10) >> 8);
    memcpy(out + 10, dict, hl);
    memset(out + 10 + hl, ' ', total - 10 - hl - 1);
    out[total - 1] = '\n';
    memcpy(out + total, data, len);
    return total + len;
}

static void write_npy(const char *path, const char *dict, const void *data, size_t len)
{
    uint8_t *buf = malloc(len + 4096);
    size_t n = npy_bytes(buf, dict, data, len);
    write_bytes(path, buf, n);
    free(buf);
}

static void test_dataset_npy(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    char dir[256], px[300], py[300];
    tu_tmpdir(dir, sizeof dir);
    snprintf(px, sizeof px, "%s/x.npy", dir);
    snprintf(py, sizeof py, "%s/y.npy", dir);
    float x[N_SAMPLES * ELEMS];
    int32_t y32[N_SAMPLES];
    int64_t y64[N_SAMPLES];
    make_arrays(x, y32);
    for (int i = 0; i < N_SAMPLES; i++)
        y64[i] = y32[i];
    char dict[256];
    snprintf(dict, sizeof dict, "{'descr': '<f4', 'fortran_order': False, 'shape': (%d, 2, 3), }",
             N_SAMPLES);
    write_npy(px, dict, x, sizeof x);
    snprintf(dict, sizeof dict, "{'descr': '<i8', 'fortran_order': False, 'shape': (%d,), }",
             N_SAMPLES);
    write_npy(py, dict, y64, sizeof y64);   /* NumPy's default int: converted to i32 */
    dt_dataset *ds = dt_dataset_load_npy(ctx, px, py);
    tu_check(ctx, ds, "load_npy");
    dt_sample_field fin, ftg;
    tu_check_status(ctx, dt_dataset_fields(ds, &fin, &ftg), "fields");
    assert_int_equal(fin.ndim, 2);
    assert_int_equal(fin.shape[0], 2);
    assert_int_equal(ftg.dtype, DT_I32);
    assert_int_equal(ftg.ndim, 0);
    check_epochs(ctx, ds, sample_value);
    dt_dataset_free(ds);

    /* each field malformed in turn: the error names it */
    static const struct { const char *dict; const char *names; } bad[] = {
        {"{'descr': '>f4', 'fortran_order': False, 'shape': (37, 2, 3), }", "descr"},
        {"{'descr': '<c8', 'fortran_order': False, 'shape': (37, 2, 3), }", "descr"},
        {"{'descr': '<f4', 'fortran_order': True, 'shape': (37, 2, 3), }", "fortran_order"},
        {"{'descr': '<f4', 'shape': (37, 2, 3), }", "fortran_order"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': [37, 2, 3], }", "shape"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (37, x, 3), }", "shape"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (), }", "shape"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (37, 2, 4), }", "bytes of data"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (36, 2, 3), }", "bytes of data"},
        {"'descr': '<f4', 'fortran_order': False, 'shape': (37, 2, 3)", "not a dict"},
    };
    for (int t = 0; t < TU_ARRAY_LEN(bad); t++) {
        write_npy(px, bad[t].dict, x, sizeof x);
        assert_null(dt_dataset_load_npy(ctx, px, py));
        assert_int_equal(dt_last_status(ctx), DT_ECORRUPT);
        tu_assert_error_mentions(ctx, bad[t].names);
    }
    /* magic, version, a header length past the end */
    uint8_t buf[4096];
    snprintf(dict, sizeof dict, "{'descr': '<f4', 'fortran_order': False, 'shape': (%d, 2, 3), }",
             N_SAMPLES);
    size_t n = npy_bytes(buf, dict, x, sizeof x);
    buf[1] = 'X';
    write_bytes(px, buf, n);
    assert_null(dt_dataset_load_npy(ctx, px, py));
    tu_assert_error_mentions(ctx, "magic");
    buf[1] = 'N';
    buf[6] = 9;
    write_bytes(px, buf, n);
    assert_null(dt_dataset_load_npy(ctx, px, py));
    tu_assert_error_mentions(ctx, "version");
    buf[6] = 1;
    buf[9] = 0x7f;
    write_bytes(px, buf, 128);
    assert_null(dt_dataset_load_npy(ctx, px, py));
    tu_assert_error_mentions(ctx, "header length");
    /* input and target counts differ */
    write_npy(px, dict, x, sizeof x);
    snprintf(dict, sizeof dict, "{'descr': '<i4', 'fortran_order': False, 'shape': (%d,), }",
             N_SAMPLES - 1);
    write_npy(py, dict, y32, sizeof y32 - 4);
    assert_null(dt_dataset_load_npy(ctx, px, py));
    tu_assert_error_mentions(ctx, "samples");
    tu_rmdir(dir);
    dt_ctx_free(ctx);
}

static void test_dataset_csv(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    char dir[256], p[300];
    tu_tmpdir(dir, sizeof dir);
    snprintf(p, sizeof p, "%s/d.csv", dir);
    /* a header, the label in the middle, a CRLF line and a blank line */
    const char *text = "a,label,b\n1.5,2,-3\n4,0,5e-1\r\n\n7,1,8\n";
    write_bytes(p, text, strlen(text));
    dt_csv_config cfg;
    dt_csv_config_init(&cfg);
    cfg.target_name = "label";
    dt_dataset *ds = dt_dataset_load_csv(ctx, p, &cfg);
    tu_check(ctx, ds, "csv");
    assert_int_equal(dt_dataset_size(ds), 3);
    assert_int_equal(dt_dataset_classes(ds), 3);
    float want[3][2] = {{1.5f, -3.0f}, {4.0f, 0.5f}, {7.0f, 8.0f}};
    int labels[3] = {2, 0, 1};
    for (int i = 0; i < 3; i++) {
        float got[2];
        int32_t lab;
        tu_check_status(ctx, dt_dataset_sample(ds, i, got, &lab), "sample");
        assert_true(got[0] == want[i][0] && got[1] == want[i][1]);
        assert_int_equal(lab, labels[i]);
    }
    dt_dataset_free(ds);
    /* no header (detected), regression on the last column */
    text = "1,2,3.25\n4,5,6.5\n";
    write_bytes(p, text, strlen(text));
    dt_csv_config_init(&cfg);
    cfg.classify = 0;
    ds = dt_dataset_load_csv(ctx, p, &cfg);
    tu_check(ctx, ds, "csv regression");
    assert_int_equal(dt_dataset_size(ds), 2);
    float got[2], tv;
    tu_check_status(ctx, dt_dataset_sample(ds, 1, got, &tv), "sample");
    assert_true(got[0] == 4.0f && got[1] == 5.0f && tv == 6.5f);
    dt_dataset_free(ds);
    /* malformed: each refused, naming where */
    static const struct { const char *text; const char *names; } bad[] = {
        {"a,b\n1,2\n3,x\n", "line 3, column 2"},
        {"a,b\n1,2\n3,4,5\n", "line 3 has 3 fields"},
        {"a,b\n1,-1\n", "label -1"},
        {"a,b\n1,2.5\n", "label 2.5"},
        {"a,b\n", "no data rows"},
        {"", "no rows"},
    };
    dt_csv_config_init(&cfg);
    for (int t = 0; t < TU_ARRAY_LEN(bad); t++) {
        write_bytes(p, bad[t].text, strlen(bad[t].text));
        assert_null(dt_dataset_load_csv(ctx, p, &cfg));
        assert_int_equal(dt_last_status(ctx), DT_ECORRUPT);
        tu_assert_error_mentions(ctx, bad[t].names);
    }
    text = "a,b\n1,2\n";
    write_bytes(p, text, strlen(text));
    cfg.target_name = "c";
    assert_null(dt_dataset_load_csv(ctx, p, &cfg));
    tu_assert_error_mentions(ctx, "no column named 'c'");
    cfg.target_name = NULL;
    cfg.target_column = 5;
    assert_null(dt_dataset_load_csv(ctx, p, &cfg));
    assert_int_equal(dt_last_status(ctx), DT_EINVAL);
    tu_rmdir(dir);
    dt_ctx_free(ctx);
}

/* What a real data set brings (issue 35): a UTF-8 byte-order mark before
 * data rows (it used to make the first row a header, silently lost), an
 * error after a blank line naming the file's line (it named the line's
 * index among the non-blank ones, "row 3"), a binary file (it got "has a
 * header and no data rows"), and a constant feature, whose std was 0 and
 * which dt_dataset_normalize then refused. */
static void test_dataset_csv_real_files(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    char dir[256], p[300];
    tu_tmpdir(dir, sizeof dir);
    snprintf(p, sizeof p, "%s/d.csv", dir);
    dt_csv_config cfg;
    dt_csv_config_init(&cfg);
    const char *bom = "\xEF\xBB\xBF" "1,0\n2,1\n";
    write_bytes(p, bom, strlen(bom));
    dt_dataset *ds = dt_dataset_load_csv(ctx, p, &cfg);
    tu_check(ctx, ds, "csv with a byte-order mark");
    assert_int_equal(dt_dataset_size(ds), 2);
    float x;
    int32_t lab;
    tu_check_status(ctx, dt_dataset_sample(ds, 0, &x, &lab), "sample");
    assert_true(x == 1.0f && lab == 0);
    dt_dataset_free(ds);
    const char *named = "\xEF\xBB\xBF" "a,label\n1,0\n";   /* and a header's first name */
    write_bytes(p, named, strlen(named));
    cfg.target_name = "a";
    ds = dt_dataset_load_csv(ctx, p, &cfg);
    tu_check(ctx, ds, "csv with a byte-order mark and a header");
    assert_int_equal(dt_dataset_size(ds), 1);
    dt_dataset_free(ds);
    dt_csv_config_init(&cfg);
    const char *gap = "a,b\n1,2\n\n3,x\n";
    write_bytes(p, gap, strlen(gap));
    assert_null(dt_dataset_load_csv(ctx, p, &cfg));
    tu_assert_error_mentions(ctx, "line 4, column 2");
    const char bin[] = {0x7f, 'E', 'L', 'F', 2, 1, 1, 0, 0, 0, '\n', 3, 0, 0x3e, 0};
    write_bytes(p, bin, sizeof bin);
    assert_null(dt_dataset_load_csv(ctx, p, &cfg));
    assert_int_equal(dt_last_status(ctx), DT_ECORRUPT);
    tu_assert_error_mentions(ctx, "not text");
    /* a constant feature: std 1 (sklearn's StandardScaler), so it normalises to 0 */
    const char *flat = "c,v,label\n5,1,0\n5,3,1\n5,2,0\n";
    write_bytes(p, flat, strlen(flat));
    cfg.target_name = "label";
    ds = dt_dataset_load_csv(ctx, p, &cfg);
    tu_check(ctx, ds, "csv with a constant column");
    float mean[2], sd[2];
    tu_check_status(ctx, dt_dataset_stats(ds, 2, mean, sd), "stats");
    assert_true(mean[0] == 5.0f && sd[0] == 1.0f);
    assert_true(fabsf(mean[1] - 2.0f) < 1e-6f && fabsf(sd[1] - sqrtf(2.0f / 3.0f)) < 1e-6f);
    tu_check_status(ctx, dt_dataset_normalize(ds, 0, 2, mean, sd), "normalize");
    dt_loader *ld = loader_for(ctx, ds, 3, 0, 0, 0, 1);
    dt_tensor *bx, *by;
    float b[6];
    tu_check_status(ctx, dt_loader_next(ld, &bx, &by), "next");
    tu_check_status(ctx, dt_tensor_get(bx, b, 6), "batch");
    assert_true(b[0] == 0.0f && b[2] == 0.0f && b[4] == 0.0f);
    assert_true(fabsf(b[3] - 1.0f / sqrtf(2.0f / 3.0f)) < 1e-5f);
    dt_loader_free(ld);
    dt_dataset_free(ds);
    tu_rmdir(dir);
    dt_ctx_free(ctx);
}

static void read_i32(dt_ctx *ctx, dt_tensor *t, int32_t *out, int64_t n)
{
    tu_check_status(ctx, dt_tensor_get(t, out, n), "read i32");
}

static void test_dataset_tokens(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    enum { NT = 100, T = 8 };
    uint8_t tok[NT];
    for (int j = 0; j < NT; j++)
        tok[j] = (uint8_t)((j * 7) % 251);
    dt_token_config tc;
    dt_token_config_init(&tc);
    tc.context = T;
    tc.stride = 4;
    dt_dataset *ds = dt_dataset_from_tokens(ctx, tok, NT, 1, 0, &tc);
    tu_check(ctx, ds, "tokens");
    assert_int_equal(dt_dataset_size(ds), (NT - T - 1) / 4 + 1);
    /* unshuffled batches: window i starts at 4 i; the target is shifted by one */
    dt_loader *ld = loader_for(ctx, ds, 5, 0, 1, 0, 1);
    dt_tensor *x, *y;
    int64_t i = 0;
    while (dt_loader_next(ld, &x, &y) == DT_OK) {
        assert_int_equal(dt_tensor_dtype(x), DT_I32);
        assert_int_equal(dt_tensor_dim(x, 1), T);
        int64_t b = dt_tensor_dim(x, 0);
        int32_t xv[5 * T], yv[5 * T];
        read_i32(ctx, x, xv, b * T);
        read_i32(ctx, y, yv, b * T);
        for (int64_t r = 0; r < b; r++, i++)
            for (int t = 0; t < T; t++) {
                assert_int_equal(xv[r * T + t], tok[4 * i + t]);
                assert_int_equal(yv[r * T + t], tok[4 * i + t + 1]);
            }
    }
    assert_int_equal(i, dt_dataset_size(ds));
    dt_loader_free(ld);
    dt_dataset_free(ds);

    /* random windows inside [first, first + count), the same for a seed;
     * the range ends before the tokens do, so an ignored count is seen */
    tc.stride = 0;
    tc.samples = 50;
    tc.first = 40;
    tc.count = 40;
    tc.seed = 9;
    ds = dt_dataset_from_tokens(ctx, tok, NT, 1, 1, &tc);
    dt_dataset *again = dt_dataset_from_tokens(ctx, tok, NT, 1, 1, &tc);
    tu_check(ctx, ds, "random windows");
    int starts[40] = {0};
    for (int64_t k = 0; k < 50; k++) {
        int32_t a[T], b[T], a2[T];
        tu_check_status(ctx, dt_dataset_sample(ds, k, a, b), "sample");
        tu_check_status(ctx, dt_dataset_sample(again, k, a2, NULL), "sample");
        assert_memory_equal(a, a2, sizeof a);
        int o = -1;
        for (int s = 0; s + T + 1 <= NT && o < 0; s++) {   /* anywhere in the tokens */
            int match = 1;
            for (int t = 0; t < T; t++)
                match &= a[t] == tok[s + t] && b[t] == tok[s + t + 1];
            o = match ? s : -1;
        }
        if (o < 40 || o + T + 1 > 80)
            fail_msg("sample %lld: a window at %d, outside tokens [40, 80)", (long long)k, o);
        starts[o - 40]++;
    }
    int distinct = 0;
    for (int s = 0; s < 40; s++)
        distinct += starts[s] > 0;
    assert_true(distinct > 10);   /* spread over the range, not one place */
    dt_dataset_free(ds);
    dt_dataset_free(again);

    /* a file of u16 ids */
    char dir[256], p[300];
    tu_tmpdir(dir, sizeof dir);
    snprintf(p, sizeof p, "%s/tok.bin", dir);
    uint16_t t16[NT];
    for (int j = 0; j < NT; j++)
        t16[j] = (uint16_t)(j * 613);
    write_bytes(p, t16, sizeof t16);
    dt_token_config_init(&tc);
    tc.context = T;
    tc.stride = 1;
    ds = dt_dataset_load_tokens(ctx, p, 2, &tc);
    tu_check(ctx, ds, "load_tokens");
    assert_int_equal(dt_dataset_size(ds), NT - T);
    int32_t a[T], b[T];
    tu_check_status(ctx, dt_dataset_sample(ds, NT - T - 1, a, b), "last window");
    assert_int_equal(a[0], t16[NT - T - 1]);
    assert_int_equal(b[T - 1], t16[NT - 1]);
    dt_dataset_free(ds);
    write_bytes(p, t16, 7);
    assert_null(dt_dataset_load_tokens(ctx, p, 2, &tc));
    assert_int_equal(dt_last_status(ctx), DT_ECORRUPT);
    tc.context = NT;
    assert_null(dt_dataset_from_tokens(ctx, tok, NT, 1, 0, &tc));
    tu_assert_error_mentions(ctx, "context + 1");
    int32_t neg[16] = {1, 2, -3};
    tc.context = 4;
    assert_null(dt_dataset_from_tokens(ctx, neg, 16, 4, 0, &tc));
    tu_assert_error_mentions(ctx, "token 2");
    /* token ids are not normalised, and a loader refuses mean and std */
    ds = dt_dataset_from_tokens(ctx, tok, NT, 1, 0, &tc);
    float m = 0.5f, s = 1.0f;
    assert_int_equal(dt_dataset_normalize(ds, 0, 1, &m, &s), DT_ENOTSUP);
    dt_loader_config lc;
    dt_loader_config_init(&lc);
    lc.mean = 0.5f;
    assert_null(dt_loader_new(ctx, ds, &lc));
    tu_assert_error_mentions(ctx, "i32");
    dt_dataset_free(ds);
    tu_rmdir(dir);
    dt_ctx_free(ctx);
}

/* Callback datasets: sample i made on demand; failing on one sample. */
typedef struct gen_state {
    int64_t fail_at;
    int calls;
} gen_state;

static int gen_sample(void *user, int64_t i, void *input, void *target)
{
    gen_state *g = user;
    __atomic_add_fetch(&g->calls, 1, __ATOMIC_RELAXED);
    if (i == g->fail_at)
        return 7;
    for (int64_t k = 0; k < ELEMS; k++)
        ((float *)input)[k] = sample_value(i, k);
    *(int32_t *)target = sample_label(i);
    return 0;
}

/* dt_loader_new starts epoch 0 and a loop starts it again: each sample is
 * read once (the Python binding's epoch() does this), on either path; the
 * epoch started again after its batches were taken reads them again. */
static void test_loader_restart_reads_once(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    gen_state g = {-1, 0};
    dt_dataset *ds = dt_dataset_from_callback(ctx, N_SAMPLES, &VEC_F32, &LABEL, gen_sample, &g);
    tu_check(ctx, ds, "callback");
    for (int prefetch = 0; prefetch < 2; prefetch++) {
        for (int wait = 0; wait < 2; wait++) {   /* the first batch read already, or not yet */
            g.calls = 0;
            dt_loader *ld = loader_for(ctx, ds, 8, 1, prefetch, 0, 1);
            if (wait)
                usleep(20000);
            tu_check_status(ctx, dt_loader_start_epoch(ld, 0), "start");
            int seen[N_SAMPLES] = {0};
            assert_int_equal(drain(ctx, ld, sample_value, ELEMS, seen), N_SAMPLES);
            assert_int_equal(__atomic_load_n(&g.calls, __ATOMIC_RELAXED), N_SAMPLES);
            tu_check_status(ctx, dt_loader_start_epoch(ld, 0), "again");
            memset(seen, 0, sizeof seen);
            assert_int_equal(drain(ctx, ld, sample_value, ELEMS, seen), N_SAMPLES);
            assert_int_equal(__atomic_load_n(&g.calls, __ATOMIC_RELAXED), 2 * N_SAMPLES);
            dt_loader_free(ld);
        }
    }
    dt_dataset_free(ds);
    dt_ctx_free(ctx);
}

static void test_dataset_callback(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    gen_state g = {-1, 0};
    dt_dataset *ds = dt_dataset_from_callback(ctx, N_SAMPLES, &VEC_F32, &LABEL, gen_sample, &g);
    tu_check(ctx, ds, "callback");
    check_epochs(ctx, ds, sample_value);
    assert_true(g.calls >= N_SAMPLES);
    /* a failure ends the epoch with the callback's message, on either path */
    g.fail_at = 20;
    for (int prefetch = 0; prefetch < 2; prefetch++) {
        dt_loader *ld = loader_for(ctx, ds, 8, 0, prefetch, 0, 1);
        dt_tensor *x, *y;
        dt_status s;
        int ok = 0;
        while ((s = dt_loader_next(ld, &x, &y)) == DT_OK)
            ok++;
        assert_int_equal(s, DT_EIO);
        assert_int_equal(ok, 2);   /* batches 0 and 1 hold samples 0..15 */
        tu_assert_error_mentions(ctx, "sample 20");
        assert_int_equal(dt_loader_next(ld, &x, &y), DT_EOF);
        g.fail_at = -1;   /* the next epoch reads again */
        tu_check_status(ctx, dt_loader_start_epoch(ld, 1), "start");
        int seen[N_SAMPLES] = {0};
        assert_int_equal(drain(ctx, ld, sample_value, ELEMS, seen), N_SAMPLES);
        g.fail_at = 20;
        dt_loader_free(ld);
    }
    dt_dataset_free(ds);
    assert_null(dt_dataset_from_callback(ctx, N_SAMPLES, &VEC_F32, &LABEL, NULL, NULL));
    dt_ctx_free(ctx);
}

static float shifted_value(int64_t i, int64_t k) { return sample_value(i, k); }

static void test_dataset_subset(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    float x[N_SAMPLES * ELEMS];
    int32_t y[N_SAMPLES];
    make_arrays(x, y);
    dt_dataset *ds = dt_dataset_from_memory(ctx, N_SAMPLES, &VEC_F32, x, &LABEL, y, 0);
    /* from 31: not a multiple of the labels' period 5, so a target read
     * without the subset's offset has another label than its input's */
    dt_dataset *tail = dt_dataset_subset(ctx, ds, 31, 6);
    tu_check(ctx, tail, "subset");
    assert_int_equal(dt_dataset_size(tail), 6);
    int seen[N_SAMPLES] = {0};
    dt_loader *ld = loader_for(ctx, tail, 3, 1, 1, 0, 1);
    assert_int_equal(drain(ctx, ld, shifted_value, ELEMS, seen), 6);
    for (int i = 0; i < N_SAMPLES; i++)
        assert_int_equal(seen[i], i >= 31);
    for (int j = 0; j < 6; j++)
        assert_int_equal(dt_dataset_label(tail, j), sample_label(31 + j));
    dt_loader_free(ld);
    assert_null(dt_dataset_subset(ctx, ds, 31, 7));
    assert_int_equal(dt_last_status(ctx), DT_EINVAL);
    dt_dataset_free(tail);
    dt_dataset_free(ds);
    dt_ctx_free(ctx);
}

/* dt_evaluate over a memory dataset: a fixed linear classifier's accuracy
 * and loss against the same computed here. */
typedef struct lin_model {
    dt_tensor *w;
} lin_model;

static dt_tensor *lin_forward(dt_ctx *ctx, dt_tensor *x, void *user)
{
    lin_model *m = user;
    dt_tensor *flat = dt_reshape(ctx, x, 2, (const int64_t[]){dt_tensor_dim(x, 0), ELEMS});
    return dt_matmul(ctx, flat, m->w, 0, 0);
}

static dt_status odd_labels(dt_ctx *ctx, dt_tensor *out, dt_tensor *y, void *user, double *sum,
                            double *count)
{
    (void)ctx;
    (void)out;
    (void)user;
    int32_t lab[64];
    int64_t b = dt_tensor_dim(y, 0);
    dt_status st = dt_tensor_get(y, lab, b);
    for (int64_t i = 0; st == DT_OK && i < b; i++)
        *sum += lab[i] % 2;
    *count += (double)b;
    return st;
}

/* the classifier, after a large scratch tensor (the arena grows) */
static dt_tensor *big_forward(dt_ctx *ctx, dt_tensor *x, void *user)
{
    return dt_tensor_temp(ctx, DT_F32, 1, (const int64_t[]){4 << 20}) ? lin_forward(ctx, x, user)
                                                                       : NULL;
}

/* column 0 of the classifier's logits, as a (B) prediction */
static dt_tensor *first_output(dt_ctx *ctx, dt_tensor *x, void *user)
{
    dt_tensor *z = lin_forward(ctx, x, user);
    return dt_reshape(ctx, dt_slice(ctx, z, 1, 0, 1), 1, (const int64_t[]){dt_tensor_dim(z, 0)});
}

static void test_dataset_evaluate(void **state)
{
    (void)state;
    dt_ctx *ctx = tu_ctx_new();
    float x[N_SAMPLES * ELEMS];
    int32_t y[N_SAMPLES];
    make_arrays(x, y);
    for (int i = 0; i < N_SAMPLES * ELEMS; i++)
        x[i] /= 600.0f;   /* small logits */
    float wv[ELEMS * 5];
    tu_rng r = {11};
    tu_fill_uniform(&r, wv, ELEMS * 5, -1, 1);
    lin_model m = {tu_tensor(ctx, SHP(ELEMS, 5), wv)};
    dt_dataset *ds = dt_dataset_from_memory(ctx, N_SAMPLES, &VEC_F32, x, &LABEL, y, 0);
    dt_eval_config ec;
    dt_eval_config_init(&ec);
    ec.batch = 10;
    dt_metrics out;
    tu_check_status(ctx, dt_evaluate(ctx, NULL, ds, &ec, lin_forward, &m, &out), "evaluate");
    int64_t correct = 0;
    double loss = 0;
    for (int i = 0; i < N_SAMPLES; i++) {
        double z[5], mx = -1e30, se = 0;
        int best = 0;
        for (int c = 0; c < 5; c++) {
            z[c] = 0;
            for (int k = 0; k < ELEMS; k++)
                z[c] += (double)x[i * ELEMS + k] * wv[k * 5 + c];
            if (z[c] > mx) {
                mx = z[c];
                best = c;
            }
        }
        for (int c = 0; c < 5; c++)
            se += exp(z[c] - mx);
        loss += log(se) + mx - z[y[i]];
        correct += best == y[i];
    }
    assert_int_equal(out.samples, N_SAMPLES);
    assert_int_equal(out.correct, correct);
    assert_true(tu_close(out.loss, loss / N_SAMPLES, 1e-5, 1e-6));
    assert_true(out.value == out.accuracy);
    /* the mean loss as the metric: the same cross entropy */
    ec.metric = DT_METRIC_LOSS;
    tu_check_status(ctx, dt_evaluate(ctx, NULL, ds, &ec, lin_forward, &m, &out), "loss metric");
    assert_true(tu_close(out.value, loss / N_SAMPLES, 1e-5, 1e-6));
    /* the user's: the share of samples whose label is odd, from y alone */
    ec.metric = DT_METRIC_USER;
    ec.metric_fn = odd_labels;
    tu_check_status(ctx, dt_evaluate(ctx, NULL, ds, &ec, lin_forward, &m, &out), "user metric");
    int odd = 0;
    for (int i = 0; i < N_SAMPLES; i++)
        odd += y[i] % 2;
    assert_true(fabs(out.value - (double)odd / N_SAMPLES) < 1e-12);
    ec.metric_fn = NULL;
    assert_int_equal(dt_evaluate(ctx, NULL, ds, &ec, lin_forward, &m, &out), DT_EINVAL);
    /* evaluation's larger steps do not stay in the arena */
    ec.metric = DT_METRIC_CLASSIFY;
    dt_ctx_step_reset(ctx);
    dt_mem_stats before, after;
    dt_mem_stats_get(ctx, &before);
    tu_check_status(ctx, dt_evaluate(ctx, NULL, ds, &ec, big_forward, &m, &out), "big steps");
    dt_mem_stats_get(ctx, &after);
    assert_true(after.arena_peak >= ((size_t)16 << 20));   /* it did grow meanwhile */
    assert_true(after.arena_capacity <= before.arena_capacity);
    assert_int_equal(out.correct, correct);
    dt_dataset_free(ds);
    /* regression: MSE against f32 targets */
    float t[N_SAMPLES];
    double mse = 0;
    for (int i = 0; i < N_SAMPLES; i++) {
        t[i] = (float)i * 0.01f;
        double z = 0;
        for (int k = 0; k < ELEMS; k++)
            z += (double)x[i * ELEMS + k] * wv[k * 5];
        mse += (z - t[i]) * (z - t[i]);
    }
    dt_sample_field scalar = {DT_F32, 0, {0}};
    ds = dt_dataset_from_memory(ctx, N_SAMPLES, &VEC_F32, x, &scalar, t, 0);
    ec.metric = DT_METRIC_LOSS;
    tu_check_status(ctx, dt_evaluate(ctx, NULL, ds, &ec, first_output, &m, &out), "mse metric");
    assert_true(tu_close(out.value, mse / N_SAMPLES, 1e-5, 1e-7));
    dt_dataset_free(ds);
    dt_ctx_free(ctx);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_dataset_memory),
    cmocka_unit_test(test_dataset_dtypes),
    cmocka_unit_test(test_dataset_raw_files),
    cmocka_unit_test(test_dataset_npy),
    cmocka_unit_test(test_dataset_csv),
    cmocka_unit_test(test_dataset_csv_real_files),
    cmocka_unit_test(test_dataset_tokens),
    cmocka_unit_test(test_dataset_callback),
    cmocka_unit_test(test_loader_restart_reads_once),
    cmocka_unit_test(test_dataset_subset),
    cmocka_unit_test(test_dataset_evaluate),
};

DT_TEST_GROUP(core_dataset, tests)
