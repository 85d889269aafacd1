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
    if (ds && dt_dataset_size(ds) > 0) {   /* what was accepted can be read: every byte of
                                              the first and last images (ASan sees a read
                                              past the file's bytes), their labels */
        int64_t last = dt_dataset_size(ds) - 1;
        int64_t shape[DT_MAX_DIMS], bytes = 1;
        int nd = dt_dataset_sample_shape(ds, shape);
        for (int d = 0; d < nd; d++)
            bytes *= shape[d];
        for (int64_t i = 0; i <= last; i += last > 0 ? last : 1) {
            const uint8_t *im = dt_dataset_image(ds, i);
            if (!im || bytes < 1 || dt_dataset_label(ds, i) < 0)
                abort();
            volatile unsigned sum = 0;
            for (int64_t k = 0; k < bytes; k++)
                sum += im[k];
            (void)sum;
        }
    }
    dt_dataset_free(ds);
    return 0;
}
