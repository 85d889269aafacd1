/*
 * tests/fuzz/fuzz_comm.c - what a collective believes of its neighbour's
 * bytes: the 32-byte call header (comm_header_check, src/comm.c) and the
 * failure reason a rank publishes in the store (comm_fail_with_reason).
 * The first 16 bytes choose our own call (kind, n, root, op); the rest is
 * the peer's header, of whatever length came.  Checked, not only run: a
 * header is accepted exactly when it is well formed and names our call;
 * every refusal leaves a terminated, non-empty message and a failure
 * status; a reason never turns into success.  It includes dtrain.c to
 * reach the internal functions.
 */
#include "../../dtrain.c"

#include <stdlib.h>

static uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

static void check_message(const dt_work *w)
{
    if (w->status == DT_OK || w->msg[0] == '\0' || memchr(w->msg, '\0', sizeof w->msg) == NULL)
        abort();
}

static void fuzz_header(const uint8_t *data, size_t size)
{
    dt_work w;
    memset(&w, 0, sizeof w);
    w.kind = 1 + (int)(data[0] % COLL_P2P);
    w.seq = rd32(data + 1);
    memcpy(&w.n, data + 5, sizeof w.n);
    w.root = (int)(data[13] % 8);
    w.op = (dt_reduce_op)(data[14] % 4);
    coll_header h;
    size_t len = size - 16;
    memset(&h, 0, sizeof h);
    memcpy(&h, data + 16, len < sizeof h ? len : sizeof h);
    if (data[15] & 1) {   /* half the inputs start from our own header: mismatches of one field */
        coll_header mine = {0x44545243u, (uint32_t)w.kind, w.seq, (uint32_t)w.root, (uint32_t)w.op, 0, w.n};
        for (size_t i = 0; i < sizeof h && 16 + i < size; i++)
            ((uint8_t *)&h)[i] = ((uint8_t *)&mine)[i] ^ data[16 + i];
        len = sizeof h;
    }
    dt_status s = comm_header_check(&w, 3, 2, &h, len);
    int good = len == sizeof h && h.magic == 0x44545243u && h.kind == (uint32_t)w.kind &&
               h.n == w.n && h.root == (uint32_t)w.root && h.op == (uint32_t)w.op;
    if ((s == DT_OK) != good || s != w.status)
        abort();
    if (s != DT_OK)
        check_message(&w);
}

static void fuzz_reason(const uint8_t *data, size_t size)
{
    char *why = malloc(size + 1);
    if (!why)
        abort();
    memcpy(why, data, size);
    why[size] = '\0';
    dt_work w;
    memset(&w, 0, sizeof w);
    dt_status s = comm_fail_with_reason(&w, why);
    if (s <= DT_OK || s > DT_EPEER || s != w.status)
        abort();
    check_message(&w);
    free(why);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > 4096)
        return 0;
    if (data[0] & 0x80)
        fuzz_reason(data + 1, size - 1);
    else if (size >= 16)
        fuzz_header(data, size);
    return 0;
}
