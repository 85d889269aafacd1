/*
 * tests/fuzz/fuzz_util.h - what the libFuzzer harnesses share: one context
 * for the process (quiet), and the input as a file (a memfd, so nothing
 * touches the disk), named /proc/self/fd/N for the loaders that take paths.
 */
#ifndef DT_FUZZ_UTIL_H
#define DT_FUZZ_UTIL_H

#include "dtrain.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static inline void fz_quiet(void *user, const char *msg)
{
    (void)user;
    (void)msg;
}

static inline dt_ctx *fz_ctx(void)
{
    static dt_ctx *ctx;
    if (!ctx) {
        dt_ctx_config cfg;
        dt_ctx_config_init(&cfg);
        cfg.threads = 1;
        ctx = dt_ctx_new(&cfg);
        if (!ctx || dt_ctx_status(ctx) != DT_OK)
            abort();
        dt_ctx_set_log(ctx, fz_quiet, NULL);
    }
    dt_clear_error(ctx);
    return ctx;
}

/* bytes as file number `slot` (0..3); returns its path, valid until the
 * next call with that slot. */
static inline const char *fz_file(int slot, const uint8_t *data, size_t n)
{
    static int fd[4] = {-1, -1, -1, -1};
    static char path[4][32];
    if (fd[slot] < 0) {
        fd[slot] = memfd_create("dtrain-fuzz", 0);
        if (fd[slot] < 0)
            abort();
        snprintf(path[slot], sizeof path[slot], "/proc/self/fd/%d", fd[slot]);
    }
    if (ftruncate(fd[slot], 0) != 0 || (n && pwrite(fd[slot], data, n, 0) != (ssize_t)n))
        abort();
    return path[slot];
}

/* Up to n batches of `batch` from ds through a loader (no prefetch
 * thread), as training would read them. */
static inline void fz_read_batches(dt_ctx *ctx, dt_dataset *ds, int batch, int n)
{
    dt_loader_config lc;
    dt_loader_config_init(&lc);
    lc.batch = batch;
    lc.prefetch = 0;
    dt_loader *ld = dt_loader_new(ctx, ds, &lc);
    dt_tensor *x, *y;
    for (int i = 0; ld && i < n && dt_loader_next(ld, &x, &y) == DT_OK; i++)
        dt_ctx_step_reset(ctx);
    dt_loader_free(ld);
    dt_ctx_step_reset(ctx);
}

/* The input cut in two at a place its first byte chooses. */
static inline size_t fz_split(const uint8_t *data, size_t size)
{
    return size ? 1 + (size_t)data[0] * (size - 1) / 255 : 0;
}

#endif
