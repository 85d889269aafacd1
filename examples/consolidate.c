/*
 * examples/consolidate.c - a sharded checkpoint as one file:
 *
 *   build/consolidate CKPT_DIR OUT.safetensors
 *
 * CKPT_DIR is what dt_ddp_checkpoint_save wrote (every rank its shard, plus
 * index.json); OUT is the single safetensors file dt_checkpoint_save would
 * have written for the same model and optimizer in one process: what
 * dt_checkpoint_load, PyTorch's safetensors reader or another tool reads.
 * Every shard is checked first (index, rank, step, checksums); a missing,
 * stale or corrupt one is refused by name and OUT is not written.
 */
#include "dtrain.h"

#include <stdio.h>

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: consolidate CKPT_DIR OUT.safetensors\n");
        return 2;
    }
    dt_ctx *ctx = dt_ctx_new(NULL);
    if (!ctx) {
        fprintf(stderr, "consolidate: no context\n");
        return 1;
    }
    char step[32];
    int ok = dt_checkpoint_consolidate(ctx, argv[1], argv[2]) == DT_OK &&
             dt_checkpoint_metadata(ctx, argv[2], "dtrain.step", step, sizeof step) == DT_OK;
    if (ok)
        printf("consolidate: wrote %s (step %s) from %s\n", argv[2], step, argv[1]);
    else
        fprintf(stderr, "consolidate: %s\n", dt_last_error(ctx));
    dt_ctx_free(ctx);
    return ok ? 0 : 1;
}
