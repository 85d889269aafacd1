/*
 * tests/fuzz/fuzz_csv.c - dt_dataset_load_csv on any bytes; the first byte
 * chooses the settings (header mode, delimiter, target column, classify).
 */
#include "fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    dt_ctx *ctx = fz_ctx();
    dt_csv_config cfg;
    dt_csv_config_init(&cfg);
    uint8_t k = data[0];
    cfg.header = (k & 3) == 3 ? -1 : (k & 1);
    cfg.delimiter = k & 4 ? ';' : ',';
    cfg.target_column = k & 8 ? 0 : -1;
    cfg.classify = (k & 16) != 0;
    cfg.target_name = k & 32 ? "label" : NULL;
    const char *path = fz_file(0, data + 1, size - 1);
    dt_dataset_free(dt_dataset_load_csv(ctx, path, &cfg));
    return 0;
}
