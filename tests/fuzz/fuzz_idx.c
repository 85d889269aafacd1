/*
 * tests/fuzz/fuzz_idx.c - dt_dataset_load_idx on any bytes: the input cut
 * in two (its first byte says where) is the image file and the label file.
 */
#include "fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    dt_ctx *ctx = fz_ctx();
    size_t cut = fz_split(data, size);
    const char *img = fz_file(0, data + (size ? 1 : 0), cut ? cut - 1 : 0);
    const char *lab = fz_file(1, data + cut, size - cut);
    dt_dataset *ds = dt_dataset_load_idx(ctx, img, lab);
    if (ds && dt_dataset_size(ds) > 0) {   /* what was accepted can be read */
        int64_t last = dt_dataset_size(ds) - 1;
        if (!dt_dataset_image(ds, last) || dt_dataset_label(ds, last) < 0)
            abort();
    }
    dt_dataset_free(ds);
    return 0;
}
