#include "dist.h"

/* ===========================================================================
 * Work stealing (the loader's chunks, claimed through the store)
 *
 * Chunk k of shard v is claimed by adding 1 to "steal/<id>/<g>/<v>/<k>" in
 * the rendezvous store (g counts the loader's epoch starts, so a restarted
 * epoch claims afresh): whoever gets 1 has it.  The owner claims its
 * chunks front to back; a thief draws from the shard's back counter
 * ("…/<v>/back") and claims the chunk that far from the end, so owner and
 * thieves meet in the middle and a failed claim means the rest of that
 * side is taken.
 * ======================================================================== */

/* Where a loader is in the chunks it claimed, through its own store
 * connection (the loader's thread claims): the loader's source state. */
typedef struct loader_steal {
    dt_store *store;
    dt_ctx *errors;            /* the connection's error sink (not the caller's ctx) */
    int id, chunk;             /* the job-wide loader number; batches per chunk */
    int64_t gen;               /* start_epoch calls so far: the claims' namespace (every
                                  worker starts the same epochs, so they agree) */
    int shard;                 /* the shard of the chunk in hand */
    int64_t first, left;       /* its next batch (in that shard) and batches left */
    int64_t own_next;          /* our shard's next chunk to claim */
    unsigned char *dry;        /* per shard: nothing left to take there */
    dt_status status;
    char msg[DT_MAX_ERROR];
} loader_steal;

static int64_t steal_batches_per_shard(const dt_loader *ld)
{
    const dt_loader_config *cfg = loader_config(ld);
    int64_t n = loader_local_samples(ld);
    return cfg->drop_last ? n / cfg->batch : (n + cfg->batch - 1) / cfg->batch;
}

static void steal_start_epoch(dt_loader *ld, int64_t epoch)
{
    loader_steal *st = loader_source_state(ld);
    (void)epoch;   /* the order is the epoch's; the claims are this start's */
    st->gen++;
    st->left = 0;
    st->own_next = 0;
    memset(st->dry, 0, (size_t)loader_config(ld)->shard_count);
}

/* Claim chunk k of shard v: 1 ours, 0 taken, -1 the store failed. */
static int steal_claim(dt_loader *ld, int v, int64_t k)
{
    loader_steal *st = loader_source_state(ld);
    char key[96];
    snprintf(key, sizeof key, "steal/%d/%lld/%d/%lld", st->id, (long long)st->gen, v,
             (long long)k);
    int64_t got = 0;
    if (dt_store_add(st->store, key, 1, &got) != DT_OK) {
        st->status = st->errors->last_status;
        snprintf(st->msg, sizeof st->msg, "loader: work stealing: %.400s", st->errors->err);
        return -1;
    }
    return got == 1;
}

/* The next batch to prepare: its shard and index in that shard, or -1. */
static int64_t steal_next(dt_loader *ld, int *shard, int *stolen)
{
    loader_steal *st = loader_source_state(ld);
    int W = loader_config(ld)->shard_count, me = loader_config(ld)->shard_rank;
    int64_t nb = steal_batches_per_shard(ld), chunks = (nb + st->chunk - 1) / st->chunk;
    while (st->left == 0 && st->status == DT_OK) {
        int v = -1;
        int64_t k = -1;
        if (!st->dry[me]) {   /* our own shard, front to back */
            k = st->own_next++;
            v = me;
        } else {              /* another's, from the back, trying the shards in turn */
            for (int i = 1; i < W && v < 0; i++) {
                int q = (me + i) % W;
                if (st->dry[q])
                    continue;
                char key[96];
                snprintf(key, sizeof key, "steal/%d/%lld/%d/back", st->id, (long long)st->gen, q);
                int64_t j = 0;
                if (dt_store_add(st->store, key, 1, &j) != DT_OK) {
                    st->status = st->errors->last_status;
                    snprintf(st->msg, sizeof st->msg, "loader: work stealing: %.400s",
                             st->errors->err);
                    return -1;
                }
                k = chunks - j;   /* j counts from 1 */
                v = q;
            }
            if (v < 0)
                return -1;   /* every shard is dry: the epoch is over */
        }
        int got = k >= 0 && k < chunks ? steal_claim(ld, v, k) : 0;
        if (got < 0)
            return -1;
        if (!got) {   /* owner and thieves met: nothing more on that side */
            st->dry[v] = 1;
            continue;
        }
        st->shard = v;
        st->first = k * st->chunk;
        st->left = nb - st->first < st->chunk ? nb - st->first : st->chunk;
    }
    if (st->status != DT_OK)
        return -1;
    *shard = st->shard;
    *stolen = st->shard != me;
    st->left--;
    return st->first++;
}

/* why steal_next found no batch: a failed claim, or none left (DT_OK) */
static dt_status steal_failed(const dt_loader *ld, const char **msg)
{
    const loader_steal *st = loader_source_state(ld);
    *msg = st->msg;
    return st->status;
}

/* the loader is being freed: its claims' connection and state */
static void steal_release(dt_loader *ld)
{
    dt_ctx *ctx = loader_ctx(ld);
    loader_steal *st = loader_source_state(ld);
    dt_store_free(st->store);
    host_free(ctx, st->errors);
    host_free(ctx, st->dry);
    host_free(ctx, st);
    loader_set_source(ld, NULL, NULL);
}

static const loader_source steal_source = {
    .next = steal_next,
    .failed = steal_failed,
    .start_epoch = steal_start_epoch,
    .release = steal_release,
};

dt_status dt_loader_steal(dt_loader *ld, dt_comm *c, int chunk_batches)
{
    if (!ld)
        return DT_EINVAL;
    dt_ctx *ctx = loader_ctx(ld);
    if (!c || chunk_batches < 1)
        return set_error(ctx, DT_EINVAL, "loader_steal: need a communicator and chunk_batches "
                         ">= 1 (got %d)", chunk_batches);
    int stealing = loader_source_state(ld) != NULL;
    if (loader_config(ld)->global_batches || stealing)
        return set_error(ctx, DT_ESTATE, "loader_steal: %s", stealing ? "already stealing"
                         : "not with global_batches");
    loader_quiesce(ld);
    loader_steal *st = host_calloc(ctx, sizeof *st);
    if (!st || !(st->dry = host_calloc(ctx, (size_t)loader_config(ld)->shard_count)) ||
        !(st->errors = ctx_new_sink(ctx))) {
        if (st) {
            host_free(ctx, st->dry);
            host_free(ctx, st);
        }
        return set_error(ctx, DT_ENOMEM, "loader_steal: out of memory");
    }
    st->chunk = chunk_batches;
    st->id = comm_serial(c, COMM_SERIAL_STEAL);
    /* the loader's thread claims: it needs a connection of its own */
    st->store = join_own_store(c, st->errors);
    if (!st->store) {
        dt_status s = set_error(ctx, st->errors->last_status, "loader_steal: %s", st->errors->err);
        host_free(ctx, st->errors);
        host_free(ctx, st->dry);
        host_free(ctx, st);
        return s;
    }
    loader_set_source(ld, &steal_source, st);
    return dt_loader_start_epoch(ld, 0);   /* the whole order, and chunks from 0 */
}

