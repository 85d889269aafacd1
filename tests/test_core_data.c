/*
 * tests/test_core_data.c - IDX datasets written here by hand (plain and
 * gzip), the loader's batches, shuffling, prefetch and sharding, corrupt
 * files, and Fashion-MNIST checked against our own zlib read of the files.
 */
#include "test_util.h"

#include <zlib.h>

#define FMNIST_DIR "/usr/share/datasets/fashion-mnist"

enum { N = 20, ROWS = 2, COLS = 3, PIX = ROWS * COLS, CLASSES = 4 };

/* Sample k: pixel 0 is k (an id the loader's output can be traced back
 * by), the others a fixed pattern; label k % 4. */
static uint8_t pixel(int k, int i) { return i == 0 ? (uint8_t)k : (uint8_t)((k * 37 + i * 53) % 256); }
static int label(int k) { return (k * 3) % CLASSES; }

static void put_be32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

/* Write bytes plainly or gzip-compressed. */
static void write_bytes(const char *path, int gz, const uint8_t *buf, size_t len)
{
    if (!gz) {
        tu_write_file(path, buf, len);
        return;
    }
    gzFile f = gzopen(path, "wb");
    assert_non_null(f);
    if (len) assert_int_equal(gzwrite(f, buf, (unsigned)len), (int)len);
    assert_int_equal(gzclose(f), Z_OK);
}

/* IDX images (magic 0x803: n, rows, cols) of n samples; `keep` bytes of
 * the full file are written (SIZE_MAX: all). */
static void write_images(const char *path, int gz, int n, uint32_t magic, size_t keep)
{
    size_t len = 16 + (size_t)n * PIX;
    uint8_t *buf = malloc(len);
    assert_non_null(buf);
    put_be32(buf, magic);
    put_be32(buf + 4, (uint32_t)n);
    put_be32(buf + 8, ROWS);
    put_be32(buf + 12, COLS);
    for (int k = 0; k < n; k++)
        for (int i = 0; i < PIX; i++) buf[16 + k * PIX + i] = pixel(k, i);
    write_bytes(path, gz, buf, keep < len ? keep : len);
    free(buf);
}

static void write_labels(const char *path, int gz, int n, uint32_t magic, size_t keep)
{
    size_t len = 8 + (size_t)n;
    uint8_t *buf = malloc(len);
    assert_non_null(buf);
    put_be32(buf, magic);
    put_be32(buf + 4, (uint32_t)n);
    for (int k = 0; k < n; k++) buf[8 + k] = (uint8_t)label(k);
    write_bytes(path, gz, buf, keep < len ? keep : len);
    free(buf);
}

typedef struct fixture {
    char dir[64], img[128], lab[128];
    dt_ctx *ctx;
    dt_dataset *ds;
} fixture;

static void fx_init(fixture *f, int gz)
{
    tu_tmpdir(f->dir, sizeof f->dir);
    snprintf(f->img, sizeof f->img, "%s/images-idx3-ubyte%s", f->dir, gz ? ".gz" : "");
    snprintf(f->lab, sizeof f->lab, "%s/labels-idx1-ubyte%s", f->dir, gz ? ".gz" : "");
    write_images(f->img, gz, N, 0x803, SIZE_MAX);
    write_labels(f->lab, gz, N, 0x801, SIZE_MAX);
    f->ctx = tu_ctx_new();
    f->ds = dt_dataset_load_idx(f->ctx, f->img, f->lab);
    tu_check(f->ctx, f->ds, "dt_dataset_load_idx");
}

static void fx_free(fixture *f)
{
    dt_dataset_free(f->ds);
    dt_ctx_free(f->ctx);
    tu_rmdir(f->dir);
}

static void check_dataset(const dt_dataset *ds)
{
    assert_int_equal(dt_dataset_size(ds), N);
    int64_t shape[DT_MAX_DIMS] = {0};
    assert_int_equal(dt_dataset_sample_shape(ds, shape), 3);
    assert_int_equal(shape[0], 1);
    assert_int_equal(shape[1], ROWS);
    assert_int_equal(shape[2], COLS);
    assert_int_equal(dt_dataset_classes(ds), CLASSES);
    for (int k = 0; k < N; k++) {
        assert_int_equal(dt_dataset_label(ds, k), label(k));
        const uint8_t *p = dt_dataset_image(ds, k);
        assert_non_null(p);
        for (int i = 0; i < PIX; i++)
            if (p[i] != pixel(k, i))
                fail_msg("sample %d pixel %d: expected %d, got %d", k, i, pixel(k, i), p[i]);
    }
}

static void test_data_idx_plain(void **state)
{
    (void)state;
    fixture f;
    fx_init(&f, 0);
    check_dataset(f.ds);
    fx_free(&f);
}

static void test_data_idx_gzip(void **state)
{
    (void)state;
    fixture f;
    fx_init(&f, 1);
    check_dataset(f.ds);
    fx_free(&f);
}

static dt_loader *make_loader(fixture *f, int batch, int shuffle, int drop_last, uint64_t seed,
                              float mean, float std, int prefetch, int rank, int count)
{
    dt_loader_config c;
    dt_loader_config_init(&c);
    c.batch = batch;
    c.shuffle = shuffle;
    c.drop_last = drop_last;
    c.seed = seed;
    c.mean = mean;
    c.std = std;
    c.prefetch = prefetch;
    c.shard_rank = rank;
    c.shard_count = count;
    dt_loader *ld = dt_loader_new(f->ctx, f->ds, &c);
    tu_check(f->ctx, ld, "dt_loader_new");
    return ld;
}

/* Run one epoch; append the sample ids (pixel 0 with mean 0, std 1) to
 * ids, check labels against the ids and return the count.  sizes gets the
 * batch sizes. */
static int run_epoch(fixture *f, dt_loader *ld, int64_t epoch, int *ids, int *sizes, int *nbatches)
{
    tu_check_status(f->ctx, dt_loader_start_epoch(ld, epoch), "dt_loader_start_epoch");
    int n = 0, nb = 0;
    dt_tensor *x, *y;
    dt_status s;
    while ((s = dt_loader_next(ld, &x, &y)) == DT_OK) {
        assert_non_null(x);
        assert_non_null(y);
        int64_t b = dt_tensor_dim(x, 0);
        tu_assert_shape(x, 4, (const int64_t[]){b, 1, ROWS, COLS});
        tu_assert_shape(y, 1, (const int64_t[]){b});
        assert_int_equal(dt_tensor_dtype(x), DT_F32);
        assert_int_equal(dt_tensor_dtype(y), DT_I32);
        float *xv = tu_read(f->ctx, x, NULL);
        int32_t yv[N];
        assert_true(b <= N);
        assert_int_equal(dt_tensor_get(y, yv, b), DT_OK);
        for (int64_t i = 0; i < b; i++) {
            int id = (int)lrintf(xv[i * PIX] * 255.0f);
            assert_true(id >= 0 && id < N);
            if (yv[i] != label(id)) fail_msg("sample %d came with label %d, not %d", id, yv[i], label(id));
            ids[n++] = id;
        }
        free(xv);
        if (sizes) sizes[nb] = (int)b;
        nb++;
        assert_true(nb <= N);
    }
    assert_int_equal(s, DT_EOF);
    if (nbatches) *nbatches = nb;
    return n;
}

static void test_data_loader_batches(void **state)
{
    (void)state;
    fixture f;
    fx_init(&f, 0);
    /* In order, batch 8: sizes 8, 8, 4; values (p/255 - 0.5)/0.25. */
    dt_loader *ld = make_loader(&f, 8, 0, 0, 0, 0.5f, 0.25f, 0, 0, 0);
    assert_int_equal(dt_loader_batches(ld), 3);
    tu_check_status(f.ctx, dt_loader_start_epoch(ld, 0), "start_epoch");
    static const int sizes[3] = {8, 8, 4};
    dt_tensor *x, *y;
    for (int bi = 0; bi < 3; bi++) {
        tu_check_status(f.ctx, dt_loader_next(ld, &x, &y), "dt_loader_next");
        tu_assert_shape(x, 4, (const int64_t[]){sizes[bi], 1, ROWS, COLS});
        tu_assert_shape(y, 1, (const int64_t[]){sizes[bi]});
        int64_t n;
        float *xv = tu_read(f.ctx, x, &n);
        double want[8 * PIX];
        for (int s = 0; s < sizes[bi]; s++)
            for (int i = 0; i < PIX; i++)
                want[s * PIX + i] = ((double)pixel(bi * 8 + s, i) / 255.0 - 0.5) / 0.25;
        tu_assert_close_arr("normalized pixels", xv, want, n, 1e-5, 1e-6);
        free(xv);
        int32_t yv[8];
        assert_int_equal(dt_tensor_get(y, yv, sizes[bi]), DT_OK);
        for (int s = 0; s < sizes[bi]; s++) assert_int_equal(yv[s], label(bi * 8 + s));
    }
    /* One known value: sample 1, pixel 1 = (37 + 53) = 90 -> (90/255 - 0.5)/0.25 */
    assert_int_equal(pixel(1, 1), 90);
    assert_int_equal(dt_loader_next(ld, &x, &y), DT_EOF);
    assert_true(dt_loader_wait_seconds(ld) >= 0);
    dt_loader_free(ld);

    /* drop_last: the partial batch of 4 is dropped. */
    ld = make_loader(&f, 8, 1, 1, 3, 0, 1, 0, 0, 0);
    assert_int_equal(dt_loader_batches(ld), 2);
    int ids[N], nb, bs[N];
    int n = run_epoch(&f, ld, 0, ids, bs, &nb);
    assert_int_equal(nb, 2);
    assert_int_equal(n, 16);
    assert_int_equal(bs[0], 8);
    assert_int_equal(bs[1], 8);
    dt_loader_free(ld);

    /* Batch dividing the data exactly, and a batch larger than the data. */
    ld = make_loader(&f, 5, 0, 1, 0, 0, 1, 0, 0, 0);
    assert_int_equal(dt_loader_batches(ld), 4);
    dt_loader_free(ld);
    ld = make_loader(&f, 32, 0, 0, 0, 0, 1, 0, 0, 0);
    assert_int_equal(dt_loader_batches(ld), 1);
    n = run_epoch(&f, ld, 0, ids, bs, &nb);
    assert_int_equal(n, N);
    assert_int_equal(bs[0], N);
    dt_loader_free(ld);
    ld = make_loader(&f, 32, 0, 1, 0, 0, 1, 0, 0, 0);
    assert_int_equal(dt_loader_batches(ld), 0);
    n = run_epoch(&f, ld, 0, ids, bs, &nb);
    assert_int_equal(n, 0);
    dt_loader_free(ld);
    fx_free(&f);
}

static void assert_permutation(const int *ids, int n, const char *what)
{
    int seen[N] = {0};
    assert_int_equal(n, N);
    for (int i = 0; i < n; i++) seen[ids[i]]++;
    for (int k = 0; k < N; k++)
        if (seen[k] != 1) fail_msg("%s: sample %d seen %d times in one epoch", what, k, seen[k]);
}

static void test_data_loader_shuffle(void **state)
{
    (void)state;
    fixture f;
    fx_init(&f, 0);
    int e0[N], e0b[N], e0c[N], e1[N];
    dt_loader *ld = make_loader(&f, 6, 1, 0, 42, 0, 1, 0, 0, 0);
    assert_int_equal(dt_loader_batches(ld), 4);
    int nb;
    assert_permutation(e0, run_epoch(&f, ld, 0, e0, NULL, &nb), "epoch 0");
    assert_int_equal(nb, 4);
    assert_permutation(e1, run_epoch(&f, ld, 1, e1, NULL, NULL), "epoch 1");
    assert_permutation(e0b, run_epoch(&f, ld, 0, e0b, NULL, NULL), "epoch 0 again");
    dt_loader_free(ld);
    /* A second loader with the same seed. */
    ld = make_loader(&f, 6, 1, 0, 42, 0, 1, 0, 0, 0);
    assert_permutation(e0c, run_epoch(&f, ld, 0, e0c, NULL, NULL), "epoch 0, new loader");
    dt_loader_free(ld);

    assert_memory_equal(e0, e0b, sizeof e0);
    assert_memory_equal(e0, e0c, sizeof e0);
    assert_memory_not_equal(e0, e1, sizeof e0);
    int identity = 1;
    for (int i = 0; i < N; i++) identity &= (e0[i] == i);
    assert_false(identity);

    /* A different seed gives a different order. */
    int s2[N];
    ld = make_loader(&f, 6, 1, 0, 43, 0, 1, 0, 0, 0);
    assert_permutation(s2, run_epoch(&f, ld, 0, s2, NULL, NULL), "seed 43");
    assert_memory_not_equal(e0, s2, sizeof e0);
    dt_loader_free(ld);

    /* No shuffle: in order every epoch. */
    ld = make_loader(&f, 6, 0, 0, 42, 0, 1, 0, 0, 0);
    run_epoch(&f, ld, 5, e1, NULL, NULL);
    for (int i = 0; i < N; i++) assert_int_equal(e1[i], i);
    dt_loader_free(ld);
    fx_free(&f);
}

/* Prefetch on and off give bit-identical batches. */
static void test_data_loader_prefetch(void **state)
{
    (void)state;
    fixture f;
    fx_init(&f, 1);
    dt_loader *a = make_loader(&f, 7, 1, 0, 9, 0.3f, 0.7f, 0, 0, 0);
    dt_loader *b = make_loader(&f, 7, 1, 0, 9, 0.3f, 0.7f, 1, 0, 0);
    for (int64_t epoch = 0; epoch < 3; epoch++) {
        tu_check_status(f.ctx, dt_loader_start_epoch(a, epoch), "start a");
        tu_check_status(f.ctx, dt_loader_start_epoch(b, epoch), "start b");
        int batches = 0;
        for (;;) {
            dt_tensor *xa, *ya, *xb, *yb;
            dt_status sa = dt_loader_next(a, &xa, &ya);
            dt_status sb = dt_loader_next(b, &xb, &yb);
            assert_int_equal(sa, sb);
            if (sa != DT_OK) {
                assert_int_equal(sa, DT_EOF);
                break;
            }
            int64_t na, nb;
            float *va = tu_read(f.ctx, xa, &na), *vb = tu_read(f.ctx, xb, &nb);
            assert_int_equal(na, nb);
            assert_memory_equal(va, vb, sizeof(float) * (size_t)na);
            free(va);
            free(vb);
            int32_t la[N], lb[N];
            int64_t m = dt_tensor_numel(ya);
            assert_int_equal(m, dt_tensor_numel(yb));
            dt_tensor_get(ya, la, m);
            dt_tensor_get(yb, lb, m);
            assert_memory_equal(la, lb, sizeof(int32_t) * (size_t)m);
            batches++;
        }
        assert_int_equal(batches, 3);
    }
    /* Abandoning an epoch half way and freeing a prefetching loader is fine. */
    tu_check_status(f.ctx, dt_loader_start_epoch(b, 7), "start");
    dt_tensor *x, *y;
    tu_check_status(f.ctx, dt_loader_next(b, &x, &y), "next");
    tu_check_status(f.ctx, dt_loader_start_epoch(b, 8), "restart mid-epoch");
    tu_check_status(f.ctx, dt_loader_next(b, &x, &y), "next");
    dt_loader_free(a);
    dt_loader_free(b);
    fx_free(&f);
}

/* Two shards are disjoint and cover the data, shuffled or not. */
static void test_data_loader_shards(void **state)
{
    (void)state;
    fixture f;
    fx_init(&f, 0);
    for (int shuffle = 0; shuffle < 2; shuffle++) {
        int first[N / 2];   /* rank 0's samples in epoch 0 */
        for (int64_t epoch = 0; epoch < 2; epoch++) {
            int ids[2][N], n[2];
            for (int rank = 0; rank < 2; rank++) {
                dt_loader *ld = make_loader(&f, 3, shuffle, 0, 11, 0, 1, 0, rank, 2);
                /* 10 samples per shard in batches of 3: 4 batches */
                assert_int_equal(dt_loader_batches(ld), 4);
                n[rank] = run_epoch(&f, ld, epoch, ids[rank], NULL, NULL);
                dt_loader_free(ld);
            }
            assert_int_equal(n[0], N / 2);
            assert_int_equal(n[1], N / 2);
            int all[N];
            memcpy(all, ids[0], sizeof(int) * N / 2);
            memcpy(all + N / 2, ids[1], sizeof(int) * N / 2);
            assert_permutation(all, N, "two shards together");
            /* reshuffled every epoch from the shared seed: rank 0's shard
             * changes (order and membership) when shuffling, not otherwise */
            if (epoch == 0)
                memcpy(first, ids[0], sizeof first);
            else
                assert_int_equal(memcmp(first, ids[0], sizeof first) != 0, shuffle);
        }
    }
    /* shard_count 1 is all the data. */
    dt_loader *ld = make_loader(&f, 4, 1, 0, 11, 0, 1, 0, 0, 1);
    int ids[N];
    assert_permutation(ids, run_epoch(&f, ld, 0, ids, NULL, NULL), "shard_count 1");
    dt_loader_free(ld);
    fx_free(&f);
}

/* ---------------------------------------------------------------------------
 * Corrupt files: NULL, a message, no crash.
 * ------------------------------------------------------------------------- */
static void expect_load_fails(dt_ctx *ctx, const char *img, const char *lab, const char *what)
{
    dt_clear_error(ctx);
    dt_dataset *ds = dt_dataset_load_idx(ctx, img, lab);
    if (ds) {
        dt_dataset_free(ds);
        fail_msg("%s: dt_dataset_load_idx succeeded", what);
    }
    if (dt_last_status(ctx) == DT_OK || dt_last_error(ctx)[0] == '\0')
        fail_msg("%s: no error status or message", what);
}

static void test_data_corrupt_idx(void **state)
{
    (void)state;
    char dir[64], img[128], lab[128], bad[128];
    tu_tmpdir(dir, sizeof dir);
    snprintf(img, sizeof img, "%s/img", dir);
    snprintf(lab, sizeof lab, "%s/lab", dir);
    snprintf(bad, sizeof bad, "%s/bad", dir);
    write_images(img, 0, N, 0x803, SIZE_MAX);
    write_labels(lab, 0, N, 0x801, SIZE_MAX);
    dt_ctx *ctx = tu_ctx_new();
    dt_dataset *ds = dt_dataset_load_idx(ctx, img, lab);
    tu_check(ctx, ds, "good files");
    dt_dataset_free(ds);

    for (int gz = 0; gz < 2; gz++) {
        write_images(bad, gz, N, 0x804, SIZE_MAX);
        expect_load_fails(ctx, bad, lab, "bad image magic");
        write_images(bad, gz, N, 0x801, SIZE_MAX);
        expect_load_fails(ctx, bad, lab, "label magic in the image file");
        write_labels(bad, gz, N, 0x803, SIZE_MAX);
        expect_load_fails(ctx, img, bad, "bad label magic");
        write_images(bad, gz, N, 0x803, 16 + 10 * PIX + 3);
        expect_load_fails(ctx, bad, lab, "truncated image data");
        write_images(bad, gz, N, 0x803, 10);
        expect_load_fails(ctx, bad, lab, "truncated image header");
        write_labels(bad, gz, N, 0x801, 8 + N / 2);
        expect_load_fails(ctx, img, bad, "truncated labels");
        write_labels(bad, gz, N - 1, 0x801, SIZE_MAX);
        expect_load_fails(ctx, img, bad, "fewer labels than images");
        write_images(bad, gz, N, 0x803, 0);
        expect_load_fails(ctx, bad, lab, "empty image file");
    }
    /* a gzip stream cut in the middle */
    char gzp[128];
    snprintf(gzp, sizeof gzp, "%s/img.gz", dir);
    write_images(gzp, 1, N, 0x803, SIZE_MAX);
    size_t len = 0;
    unsigned char *buf = tu_read_file(gzp, &len);
    assert_non_null(buf);
    tu_write_file(bad, buf, len / 2);
    free(buf);
    expect_load_fails(ctx, bad, lab, "gzip stream cut in half");
    /* absurd dimensions in the header (4 G samples claimed) */
    uint8_t hdr[16 + PIX];
    put_be32(hdr, 0x803);
    put_be32(hdr + 4, 0xFFFFFFFFu);
    put_be32(hdr + 8, 0xFFFFFFFFu);
    put_be32(hdr + 12, 0xFFFFFFFFu);
    memset(hdr + 16, 0, PIX);
    tu_write_file(bad, hdr, sizeof hdr);
    expect_load_fails(ctx, bad, lab, "absurd dimensions");
    char missing[128];
    snprintf(missing, sizeof missing, "%s/nope", dir);
    expect_load_fails(ctx, missing, lab, "nonexistent image file");
    expect_load_fails(ctx, img, missing, "nonexistent label file");
    expect_load_fails(ctx, dir, lab, "a directory as image file");
    dt_ctx_free(ctx);
    tu_rmdir(dir);
}

/* An allocator that refuses anything over 64 MiB, so a load that trusts a
 * header's claim fails with DT_ENOMEM instead of DT_ECORRUPT. */
static void *small_malloc(size_t n, void *u) { (void)u; return n > ((size_t)64 << 20) ? NULL : malloc(n); }
static void *small_realloc(void *p, size_t n, void *u)
{
    (void)u;
    return n > ((size_t)64 << 20) ? NULL : realloc(p, n);
}
static void small_free(void *p, void *u) { (void)u; free(p); }

/* Found by tests/fuzz/fuzz_idx.c (its corpus keeps the input as
 * regress-huge-count): a 40-byte file whose header claims 587 M images of
 * 2x2 was given 2.3 GB before a byte of data was read.  The memory now
 * grows with the data the file holds: the file is refused as truncated. */
static void test_data_idx_header_claims_too_much(void **state)
{
    (void)state;
    char dir[64], img[128], lab[128];
    tu_tmpdir(dir, sizeof dir);
    snprintf(img, sizeof img, "%s/img", dir);
    snprintf(lab, sizeof lab, "%s/lab", dir);
    uint8_t hdr[16 + 24];
    put_be32(hdr, 0x803);
    put_be32(hdr + 4, 0x23000003u);
    put_be32(hdr + 8, 2);
    put_be32(hdr + 12, 2);
    memset(hdr + 16, 0xff, sizeof hdr - 16);
    for (int gz = 0; gz < 2; gz++) {
        write_bytes(img, gz, hdr, sizeof hdr);
        write_labels(lab, gz, N, 0x801, SIZE_MAX);
        dt_ctx_config cfg;
        dt_ctx_config_init(&cfg);
        cfg.allocator = (dt_allocator){small_malloc, small_realloc, small_free, NULL};
        dt_ctx *ctx = dt_ctx_new(&cfg);
        assert_non_null(ctx);
        assert_null(dt_dataset_load_idx(ctx, img, lab));
        if (dt_last_status(ctx) != DT_ECORRUPT || !strstr(dt_last_error(ctx), "truncated"))
            fail_msg("gz %d: %s (%s)", gz, dt_last_error(ctx), dt_strerror(dt_last_status(ctx)));
        dt_ctx_free(ctx);
    }
    tu_rmdir(dir);
}

/* ---------------------------------------------------------------------------
 * Fashion-MNIST, checked against our own read of the gzip files.
 * ------------------------------------------------------------------------- */
static uint8_t *gz_read_all(const char *path, size_t *len)
{
    gzFile f = gzopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 20, n = 0;
    uint8_t *buf = malloc(cap);
    int r;
    while (buf && (r = gzread(f, buf + n, (unsigned)(cap - n))) > 0) {
        n += (size_t)r;
        if (n == cap) buf = realloc(buf, cap *= 2);
    }
    gzclose(f);
    *len = n;
    return buf;
}

static void test_data_fashion_mnist(void **state)
{
    (void)state;
    if (access(FMNIST_DIR "/t10k-images-idx3-ubyte.gz", R_OK) != 0)
        TU_SKIP("%s not installed\n", FMNIST_DIR);
    size_t ilen, llen;
    uint8_t *img = gz_read_all(FMNIST_DIR "/t10k-images-idx3-ubyte.gz", &ilen);
    uint8_t *lab = gz_read_all(FMNIST_DIR "/t10k-labels-idx1-ubyte.gz", &llen);
    assert_non_null(img);
    assert_non_null(lab);
    assert_int_equal(ilen, 16 + 10000 * 784);
    assert_int_equal(llen, 8 + 10000);

    dt_ctx *ctx = tu_ctx_new();
    dt_dataset *ds = dt_dataset_load_idx(ctx, FMNIST_DIR "/t10k-images-idx3-ubyte.gz",
                                         FMNIST_DIR "/t10k-labels-idx1-ubyte.gz");
    tu_check(ctx, ds, "dt_dataset_load_idx(fashion-mnist test)");
    assert_int_equal(dt_dataset_size(ds), 10000);
    assert_int_equal(dt_dataset_classes(ds), 10);
    int64_t shape[DT_MAX_DIMS];
    assert_int_equal(dt_dataset_sample_shape(ds, shape), 3);
    assert_int_equal(shape[0], 1);
    assert_int_equal(shape[1], 28);
    assert_int_equal(shape[2], 28);
    static const int64_t probe[] = {0, 1, 2, 4999, 9999};
    for (int i = 0; i < TU_ARRAY_LEN(probe); i++) {
        int64_t k = probe[i];
        assert_int_equal(dt_dataset_label(ds, k), lab[8 + k]);
        assert_memory_equal(dt_dataset_image(ds, k), img + 16 + k * 784, 784);
    }
    int counts[10] = {0};
    for (int64_t k = 0; k < 10000; k++) {
        int l = dt_dataset_label(ds, k);
        assert_true(l >= 0 && l < 10);
        counts[l]++;
    }
    for (int c = 0; c < 10; c++) assert_int_equal(counts[c], 1000); /* balanced test split */

    /* A loader over it: first in-order batch, pixel (0, 14, 14) normalized. */
    dt_loader_config c;
    dt_loader_config_init(&c);
    c.batch = 64;
    c.shuffle = 0;
    c.drop_last = 0;
    c.mean = 0.2860f;
    c.std = 0.3530f;
    c.prefetch = 1;
    c.shard_count = 0;
    dt_loader *ld = dt_loader_new(ctx, ds, &c);
    tu_check(ctx, ld, "loader");
    assert_int_equal(dt_loader_batches(ld), (10000 + 63) / 64);
    tu_check_status(ctx, dt_loader_start_epoch(ld, 0), "start");
    dt_tensor *x, *y;
    tu_check_status(ctx, dt_loader_next(ld, &x, &y), "next");
    tu_assert_shape(x, SHP(64, 1, 28, 28));
    float *xv = tu_read(ctx, x, NULL);
    double want = ((double)img[16 + 14 * 28 + 14] / 255.0 - 0.2860) / 0.3530;
    assert_true(tu_close(xv[14 * 28 + 14], want, 1e-5, 1e-6));
    free(xv);
    dt_loader_free(ld);
    dt_dataset_free(ds);

    /* the train split has 60000 */
    ds = dt_dataset_load_idx(ctx, FMNIST_DIR "/train-images-idx3-ubyte.gz",
                             FMNIST_DIR "/train-labels-idx1-ubyte.gz");
    tu_check(ctx, ds, "fashion-mnist train");
    assert_int_equal(dt_dataset_size(ds), 60000);
    dt_dataset_free(ds);
    /* files that are not there */
    assert_null(dt_dataset_load_idx(ctx, "/nonexistent-dir/images", "/nonexistent-dir/labels"));
    assert_int_equal(dt_last_status(ctx), DT_EIO);
    assert_true(dt_last_error(ctx)[0] != '\0');
    dt_ctx_free(ctx);
    free(img);
    free(lab);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_data_idx_plain),
    cmocka_unit_test(test_data_idx_gzip),
    cmocka_unit_test(test_data_loader_batches),
    cmocka_unit_test(test_data_loader_shuffle),
    cmocka_unit_test(test_data_loader_prefetch),
    cmocka_unit_test(test_data_loader_shards),
    cmocka_unit_test(test_data_corrupt_idx),
    cmocka_unit_test(test_data_idx_header_claims_too_much),
    cmocka_unit_test(test_data_fashion_mnist),
};

DT_TEST_GROUP(core_data, tests)
