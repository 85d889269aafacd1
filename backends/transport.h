/*
 * backends/transport.h - the transport interface (private to dtrain).
 *
 * A transport moves bytes between ranks: tagged, non-blocking sends and
 * receives, completion polling, address exchange.  Collectives, the DDP
 * reducer and the parameter server are algorithms in the core written once
 * on top of it.  backends/fabric.c implements it on libfabric (providers
 * shm, tcp = tcp;ofi_rxm, verbs = verbs;ofi_rxm, all FI_EP_RDM + FI_TAGGED).
 *
 * Threading: one thread (the core's comm thread) owns a transport instance
 * and makes every call on it.  Progress is manual: data moves only inside
 * poll() and wait(), so the owner must keep polling while transfers are
 * outstanding.
 *
 * Peers are numbered 0..n-1 in the order given to insert_peers (the core
 * uses ranks).  Tags are 64-bit; a receive matches a send from `peer` whose
 * tag equals `tag` on every bit not set in `ignore`.
 *
 * Errors: calls return dt_status and write a message into err (err_len
 * bytes) when they fail; they never print or abort.  A completion with an
 * error is reported through its dt_xfer (see status below).
 */
#ifndef DTRAIN_TRANSPORT_H
#define DTRAIN_TRANSPORT_H

#include "../dtrain.h"

#define DT_TRANSPORT_IFACE_VERSION 2

typedef struct dt_transport dt_transport;   /* an instance, opaque to the core */

typedef struct dt_transport_params {
    const char *provider;     /* "shm", "tcp" or "verbs" */
    const char *host;         /* tcp/verbs: local IPv4 address to bind, NULL = any */
    const char *iface;        /* tcp: network interface whose IPv4 address to bind, NULL = default */
    dt_allocator allocator;   /* host allocation hooks, already defaulted */
    int post_timeout_ms;      /* a post the peer keeps refusing (back-pressure) completes with
                                 DT_ETIMEDOUT after this long; 0: the transport's default.  The
                                 core passes its collective timeout: a living peer busy
                                 elsewhere stops taking data until it comes back */
} dt_transport_params;

/* One posted transfer.  The caller owns the storage and keeps it alive (and
 * unmoved) until the transfer completes or is cancelled.  The transport
 * writes the result fields before returning it from poll(). */
typedef struct dt_xfer {
    void *priv[8];            /* the transport's (libfabric's fi_context2); first */
    int done;                 /* set by poll() when complete (success or error) */
    dt_status status;         /* DT_OK, DT_EPEER (connection failed), DT_EIO,
                                 DT_EMISMATCH (truncated), DT_ESTATE (cancelled),
                                 DT_ETIMEDOUT (back-pressured 30 s).  A dead peer is
                                 NOT reliably reported: a receive from it simply never
                                 completes, so callers need their own deadlines. */
    size_t len;               /* bytes received (recv) or sent */
    uint64_t tag;             /* the matched message's tag (recv) */
    int peer;                 /* peer posted for */
    void *user;               /* the caller's */
} dt_xfer;

typedef struct dt_transport_iface {
    int version;              /* DT_TRANSPORT_IFACE_VERSION */
    const char *name;         /* "libfabric" */

    /* Open an endpoint on a provider.  Asking for a provider with no device
     * (verbs here) fails with DT_ENOTSUP and a message saying so. */
    dt_status (*open)(const dt_transport_params *p, dt_transport **out, char *err, size_t err_len);
    /* Close; outstanding transfers are cancelled first.  NULL is fine. */
    void (*close)(dt_transport *t);
    /* The provider actually in use ("shm", "tcp;ofi_rxm") */
    const char *(*provider)(const dt_transport *t);

    /* This endpoint's address as an opaque blob: *len in = room, out = size. */
    dt_status (*get_addr)(dt_transport *t, void *buf, size_t *len, char *err, size_t err_len);
    /* Insert every peer's address blob (peer i = addrs[i]; this endpoint's
     * own address is among them).  Called once, before any transfer. */
    dt_status (*insert_peers)(dt_transport *t, int n, const void *const *addrs,
                              const size_t *lens, char *err, size_t err_len);

    /* Largest message one send or recv may carry; the core chunks above it. */
    size_t (*max_message)(const dt_transport *t);

    /* Post a tagged send / receive.  DT_OK: accepted (completion comes from
     * poll); any other status: not posted, message in err.  Never blocks:
     * a post the provider refuses for back-pressure (FI_EAGAIN) is queued
     * per peer, in order, and retried inside poll()/wait(); one still
     * refused after 30 s completes with DT_ETIMEDOUT.  Messages between two
     * endpoints arrive in send order.  `ignore` may be unsupported (shm
     * ignores it for messages that arrived before the receive: DT_ENOTSUP),
     * so callers should match exact tags.  Registration of buf is the
     * transport's business (it caches; keep communication buffers alive). */
    dt_status (*send)(dt_transport *t, int peer, uint64_t tag, const void *buf, size_t len,
                      dt_xfer *x, char *err, size_t err_len);
    dt_status (*recv)(dt_transport *t, int peer, uint64_t tag, uint64_t ignore, void *buf,
                      size_t len, dt_xfer *x, char *err, size_t err_len);

    /* Drive progress and return up to max completed transfers in done[];
     * a transfer's `done` is set only here (or by close), and its dt_xfer
     * must not be reused or freed before.  Returns the count (0 if none),
     * or -1 on a transport-level failure (message in err). */
    int (*poll)(dt_transport *t, dt_xfer **done, int max, char *err, size_t err_len);
    /* Sleep until a completion may be ready or timeout_ms passes, on the
     * completion queue's wait object where the provider has one (otherwise
     * a short poll-then-sleep).  Returns DT_OK or DT_ETIMEDOUT. */
    dt_status (*wait)(dt_transport *t, int timeout_ms);
    /* Cancel a posted, uncompleted receive; it completes with status
     * DT_ESTATE (or normally if it raced).  Sends cannot be cancelled on
     * shm or tcp: they stay pending until they complete or close() drops
     * them.  Safe on completed transfers. */
    void (*cancel)(dt_transport *t, dt_xfer *x);
    /* Peer `peer` restarted at a new address: send to and receive from that
     * one from now on.  The caller first cancels (or sees complete) every
     * transfer it posted with the old one; posts still queued for it are
     * cancelled here. */
    dt_status (*replace_peer)(dt_transport *t, int peer, const void *addr, size_t len,
                              char *err, size_t err_len);
    /* One more peer, after insert_peers: an endpoint of a peer's beyond
     * its first (a parameter server answers each worker from its own, see
     * src/ps_server.c).  *peer is its number (the count of peers before the
     * call).  Added in version 2. */
    dt_status (*add_peer)(dt_transport *t, const void *addr, size_t len, int *peer,
                          char *err, size_t err_len);
} dt_transport_iface;

/* Transports compiled in expose their interface through these. */
const dt_transport_iface *dt_transport_fabric_iface(void);

#endif /* DTRAIN_TRANSPORT_H */
