/*
 * tests/fuzz/fuzz_npy.c - dt_dataset_load_npy on any bytes: the input cut
 * in two (its first byte says where) is the inputs file and the targets
 * file.  What loads is read through a loader, batch by batch.
 */
#include "fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    dt_ctx *ctx = fz_ctx();
    size_t cut = fz_split(data, size);
    const char *in = fz_file(0, data + (size ? 1 : 0), cut ? cut - 1 : 0);
    const char *tg = fz_file(1, data + cut, size - cut);
    dt_dataset *ds = dt_dataset_load_npy(ctx, in, tg);
    if (ds)
        fz_read_batches(ctx, ds, 3, 4);
    dt_dataset_free(ds);
    return 0;
}
