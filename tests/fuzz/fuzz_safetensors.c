/*
 * tests/fuzz/fuzz_safetensors.c - dt_checkpoint_load (strict, with Adam's
 * state; and non-strict) and dt_checkpoint_metadata on any bytes, into a
 * model of "fc.weight" (3,4) and "fc.bias" (3).  A load that is refused
 * must leave the parameters as they were.
 */
#include "fuzz_util.h"

static dt_tensor *w, *b;
static dt_optim *opt;

static void model(dt_ctx *ctx)
{
    if (w)
        return;
    int64_t sw[2] = {3, 4}, sb[1] = {3};
    w = dt_param_new(ctx, "fc.weight", 2, sw);
    b = dt_param_new(ctx, "fc.bias", 1, sb);
    dt_optim_config oc;
    dt_optim_config_init(&oc, DT_ADAM);
    opt = dt_optim_new(ctx, &oc, NULL, 0);
    if (!w || !b || !opt)
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    dt_ctx *ctx = fz_ctx();
    model(ctx);
    const char *path = fz_file(0, data, size);
    float before[15], after[15];
    dt_tensor_fill(w, 0.5f);
    dt_tensor_fill(b, -0.5f);
    dt_tensor_get(w, before, 12);
    dt_tensor_get(b, before + 12, 3);
    int64_t step = 0;
    if (dt_checkpoint_load(ctx, opt, path, NULL, &step, NULL) != DT_OK) {
        dt_tensor_get(w, after, 12);
        dt_tensor_get(b, after + 12, 3);
        if (memcmp(before, after, sizeof before) != 0)
            abort();   /* a refused load changed the model */
    }
    dt_checkpoint_config cfg;
    dt_checkpoint_config_init(&cfg);
    cfg.strict = 0;
    dt_checkpoint_report rep;
    dt_checkpoint_load(ctx, NULL, path, &cfg, &step, &rep);
    char val[64];
    dt_checkpoint_metadata(ctx, path, "dtrain.step", val, sizeof val);
    return 0;
}
