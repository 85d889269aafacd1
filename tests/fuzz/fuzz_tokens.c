/*
 * tests/fuzz/fuzz_tokens.c - dt_dataset_load_tokens on any bytes; the first
 * two bytes choose the token width (1, 2, 4), context, stride and window
 * range.  What loads is read through a loader.
 */
#include "fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2)
        return 0;
    dt_ctx *ctx = fz_ctx();
    static const int widths[4] = {1, 2, 4, 3};
    dt_token_config tc;
    dt_token_config_init(&tc);
    tc.context = 1 + (data[0] >> 2) % 16;
    tc.stride = data[1] % 4;
    tc.samples = data[1] % 4 ? 0 : 1 + data[1] / 4 % 8;
    tc.first = data[1] >> 6;
    const char *path = fz_file(0, data + 2, size - 2);
    dt_dataset *ds = dt_dataset_load_tokens(ctx, path, widths[data[0] & 3], &tc);
    if (ds)
        fz_read_batches(ctx, ds, 2, 3);
    dt_dataset_free(ds);
    return 0;
}
