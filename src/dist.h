/*
 * src/dist.h - what only the distributed modules share (private): the
 * rendezvous store's, the communicator's and the comm thread's types, the
 * parameter server's, DDP's, in-process replicas', Hogwild!'s, the
 * profiler's exchange and the pipelines', and the functions those modules
 * offer each other.  src/internal.h (the core's types and helpers) comes
 * first; the modules below the communicator (context to data) include
 * only that.
 */
#ifndef DTRAIN_DIST_H
#define DTRAIN_DIST_H
#include "internal.h"

/* --- src/store.c --- */
#define DT_STORE_MAX_TOKEN 256

enum { OP_HELLO = 1, OP_SET = 2, OP_GET = 3, OP_BYE = 4, OP_TIME = 5, OP_ADD = 6, OP_REPLY = 0x80 };

typedef struct store_server store_server;   /* src/store.c */


struct dt_store {
    dt_ctx *ctx;
    int fd;                    /* this rank's connection */
    int rank, timeout_ms;
    uint32_t inc;              /* our process's incarnation, said in the hello */
    char token[DT_STORE_MAX_TOKEN + 1];   /* the job's, for a second connection */
    store_server *server;      /* rank 0 only */
    char addr[DT_MAX_HOST];
    int port;
    char prefix[64];           /* a process group's namespace, put before every key but
                                  those written "/key" (the job's own: "/dead") */
    int owed;                  /* replies rank 0 still owes to calls that gave up on them
                                  (store_call skips them first, so none passes for another's) */
    int broken;                /* a call gave up mid-frame: the stream cannot be followed */
    int silent_ms;             /* > 0: the last call got nothing from rank 0, which last
                                  answered this long before */
    double last_answer;        /* when rank 0 last answered */
    double until;              /* > 0: no call waits past this time (store_limit) */
};
/* --- src/comm.c --- */
/* allreduce: recursive doubling up to this many bytes, ring above.  On tcp
 * one round of whole-buffer exchange beats the ring's two rounds up to
 * 256 KiB (bench_allreduce, 2 ranks, 256 KiB: 2.0-2.4 GB/s against 1.8);
 * on libfabric shm the ring wins from 64 KiB on. */
#define DT_COMM_SMALL ((size_t)64 << 10)
#define DT_COMM_SMALL_TCP ((size_t)256 << 10)
#define DT_COMM_CHUNK ((size_t)4 << 20)    /* largest single message */
#define DT_COMM_DEFAULT_TIMEOUT_MS 30000
#define DT_COMM_DEFAULT_COLLECTIVE_TIMEOUT_MS 600000
#define DT_COMM_BEAT_MAX_MS 1000           /* a heartbeat at least this often (timeout/4 if less) */
#define TAG_CHECK_SHIFT 52
#define DT_COMM_DRAIN_MS 10000
#define SEG_MAGIC 0x44545347u
#define SEG_SLOT_DEFAULT ((size_t)1 << 20)
#define SEG_CHUNK_LARGE ((size_t)256 << 10)   /* chunk of buffers above SEG_LARGE */
#define SEG_LARGE ((size_t)4 << 20)
#define SEG_SPIN_S 50e-6                   /* spin this long before sleeping */
#define SEG_SPIN_INLINE_S 20e-3

#define DT_COMM_MAX_XFERS 64               /* transfers in flight per step */

/* COLL_REDUCE_SCATTER_V and COLL_ALLGATHER_V work in place on buf (n floats)
 * cut into one block per rank at the offsets in aux (world + 1 int64s,
 * comm_blocks): the sharded data parallelism of src/zero.c. */
enum { COLL_ALLREDUCE = 1, COLL_BROADCAST, COLL_ALLGATHER, COLL_REDUCE_SCATTER, COLL_BARRIER,
       COLL_ALLTOALL, COLL_ALLREDUCE16, COLL_REDUCE_SCATTER_V,
       COLL_ALLGATHER_V, COLL_EXT, COLL_P2P };

/* The algorithm a work ran with, as run_work chose it (src/comm.c); the
 * profiler gets it with the rest of the record (comm_record, comm_alg_name). */
/* comm_serial's kinds: numbers every rank draws in the same order, so they
 * agree without a message (store keys of splits and stealing loaders) */
enum { COMM_SERIAL_SPLIT, COMM_SERIAL_STEAL, COMM_SERIALS };
enum { COMM_ALG_NONE, COMM_ALG_SEGMENT, COMM_ALG_HIERARCHICAL, COMM_ALG_DOUBLING, COMM_ALG_RING,
       COMM_ALG_TREE, COMM_ALG_PAIRWISE, COMM_ALG_RING16, COMM_ALG_EXT, COMM_ALG_P2P };

struct dt_work {
    dt_comm *comm;
    int kind, root;
    dt_reduce_op op;
    float *buf;                /* allreduce, broadcast: in place; others: output */
    const float *in;
    const void *aux;           /* COLL_EXT: the extension's request (a ps_call);
                                  the _V kinds: the blocks' offsets (int64_t[world + 1]) */
    double spin_s;             /* segment waits spin this long before sleeping (0: SEG_SPIN_S) */
    void *owned;               /* freed with the work (a background request's memory) */
    int64_t n;
    uint32_t seq;
    int blame, blame_ms;       /* a timeout: the silent rank and how long it was */
    int blame_gone;            /* the blamed rank's process fell silent (no heartbeat): the
                                  end of its waits is not the cause (follow_waits skipped) */
    int done;
    int orphaned;              /* under mu: its waiter gave up on a wedged transport
                                  (comm_work_finish); the comm thread frees it, if ever done */
    double run_s;              /* seconds the work ran (comm thread or inline) */
    /* its record, for the profiler: the algorithm (COMM_ALG_*); COLL_EXT:
     * what the extension did (its op code) and how stale its answer was
     * (-1: not a read) */
    uint8_t alg;
    int ext_what;
    int64_t ext_stale;
    uint64_t ticket;           /* backend copy to wait for before running (0: none) */
    dt_status status;
    char msg[DT_MAX_ERROR];
    dt_work *next;
};

/* What one COLL_EXT work of the parameter server does: a worker's request to the parameter servers
 * (src/ps.c), run on its comm thread.  The headers live here, not on the
 * comm thread's stack: a failed request may leave posts behind it. */
enum { PS_INIT = 1, PS_PUSH, PS_PULL, PS_FINISH, PS_SPUSH, PS_SPULL, PS_HELLO, PS_CPUSH };
#define PS_MAX_SERVERS 8
typedef struct ps_msg {
    uint32_t magic, op, seq;
    int32_t status;            /* responses: DT_OK or the server's refusal */
    int64_t lo, n;             /* dense: key range; sparse: table, rows */
    int64_t clock;             /* the worker's completed steps */
    int32_t code;              /* a compressed push: its dt_compress */
    uint32_t chunk;            /* the request's data and its answer travel in pieces of
                                  this many bytes (18: "Messages") */
    int64_t k;                 /* and its entries (TOPK) */
    int32_t vote;              /* pre-emption: a push, its worker's signal (0: none); an
                                  answer, the last applied step's verdict (src/preempt.c) */
    int32_t unused;
    char err[160];
} ps_msg;
/* One message's data in pieces (src/ps.c): piece i of `pieces` is bytes
 * [i * chunk, ...) of buf, tagged ps_tag(type, seq, i). */
typedef struct ps_stream {
    int peer, via, sending, type;   /* via: the transport's peer (comm_post_via) */
    uint32_t seq, next, pieces;   /* next: the first piece not yet posted */
    char *buf;
    size_t bytes;
} ps_stream;
typedef struct ps_call {
    struct dt_ps *ps;
    int op;
    int64_t lo, n;             /* dense: keys; sparse: table, ids asked for */
    float *buf;                /* push: the floats of [lo, lo+n); pull: where they go */
    int64_t clock;             /* the worker's completed steps when the call was made */
    int64_t stale;             /* a pull: the most stale server's answer */
    /* sparse: each server's distinct rows (its local row numbers), as sent */
    int64_t cnt[PS_MAX_SERVERS];
    void *msg[PS_MAX_SERVERS];     /* push: ids then rows; pull: ids */
    float *rows[PS_MAX_SERVERS];   /* pull: the answers */
    int64_t *where;            /* pull: asked id i is row where[i] / 8 of server where[i] % 8 */
    ps_msg out[2 * PS_MAX_SERVERS], in[PS_MAX_SERVERS];   /* in: by server */
    unsigned char asked[PS_MAX_SERVERS];   /* an answer is expected from this server */
    /* restarted servers (src/ps.c): a round goes to `only` those; what was sent */
    unsigned char only[PS_MAX_SERVERS];
    int use_only;
    int64_t posted[PS_MAX_SERVERS];        /* push: floats sent to each server */
    ps_msg hello[PS_MAX_SERVERS];
    /* a compressed push: each shard's code in msg[], its entries in cnt[] */
    int code;
    size_t bytes[PS_MAX_SERVERS];
    ps_stream streams[3 * PS_MAX_SERVERS];   /* this round's data, posted as room allows */
    int nstreams;
} ps_call;

typedef struct seg_head seg_head;
typedef struct seg_rank seg_rank;

/* How the comm thread runs work of a kind defined above it: the parameter
 * server registers these with its communicator (src/ps.c, ps_comm_ops)
 * before its first request.  run: carry out w (COLL_EXT) with the transfers
 * in *xsp, and fill its record (ext_what, ext_stale); check_dead: the
 * periodic check while w waits on peers. */
typedef struct comm_ext_ops {
    dt_status (*run)(dt_comm *c, struct dt_work *w, struct xfers **xsp);
    dt_status (*check_dead)(dt_comm *c, struct dt_work *w);
    /* rank fell silent (no heartbeat for the timeout) while w waited on
     * it: 1 if w can go on without it (a twin serves for it) */
    int (*write_off_silent)(dt_comm *c, struct dt_work *w, int rank);
} comm_ext_ops;

struct dt_comm {
    dt_ctx *ctx;
    int rank, world;
    int timeout_ms;            /* liveness: a peer without a heartbeat this long is gone */
    int collective_timeout_ms; /* progress: how long a living peer may keep a collective */
    const dt_transport_iface *tp_iface;
    dt_transport *tp;
    int *alias, nalias;        /* transport peers world.. : the rank each is another
                                  endpoint of (comm_add_endpoint) */
    char provider[64];
    uint32_t next_seq;         /* caller's side: collectives issued */
    size_t max_msg;
    size_t doubling_max;       /* allreduce: recursive doubling up to here */
    float *scratch;            /* comm thread: reduction buffer */
    size_t scratch_floats;
    dt_store *watch;           /* comm thread's own store connection: who died */
    dt_ctx *watch_errors;      /* its error sink, so the comm thread never writes ctx */
    double last_watch;
    int broken;                /* comm thread: a failure poisons the communicator */
    int waiting_on;            /* the rank a stalled collective waits for, -1: none */
    int wait_published;        /* this collective wrote "wait/<rank>" (cleared when it ends well) */
    char broken_msg[DT_MAX_ERROR];
    int stop;
    int running;               /* a thread is inside run_work (it owns the transport) */
    /* The transport call the comm thread is in (comm_tp_poll and the rest):
     * since when (atomic; 0: none) and which.  A caller gives up on one that
     * outlasts comm_wedge_s (comm_wedged): wedged, under mu, then refuses all
     * work and dt_comm_free leaves the thread and its memory be. */
    double tp_since;
    const char *tp_call;
    int wedged;
    char wedge_msg[DT_MAX_ERROR];
    uint64_t stage_ticket;     /* the next work enqueued first waits for this backend copy
                                  (DDP on a device: its bucket's device-to-host copy) */
    int inline_small;          /* blocking calls run on the caller when the queue is empty */
    double inline_spin_s;      /* their segment waits' spin (see SEG_SPIN_INLINE_S) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    dt_work *head, *tail;
    /* hosts (src/join.c) and the host segment (src/seg.c) */
    int nhosts, nlocal, local_index;
    int *local_ranks;          /* global ranks on this host, ascending */
    int *leaders;              /* lowest rank of each host, ascending */
    int leader_index;          /* our index in leaders; -1: not a leader */
    int use_segment;           /* every rank agreed: collectives go through segments */
    seg_head *seg;             /* NULL: this host has one rank, or no segment */
    seg_rank *seg_ranks;
    char *seg_data;
    size_t seg_slot;
    size_t seg_chunk_small;    /* chunk of buffers up to SEG_LARGE (seg_chunk_floats) */
    uint32_t seg_phase, seg_chunk;
    char seg_why[200];
    int ext_jobs;              /* extension jobs (parameter servers) joined so far (their store keys) */
    const comm_ext_ops *ext_ops;  /* how to run COLL_EXT work (set by dt_ps_new) */
    uint32_t inc;              /* 0, or this rank's n-th restarted process (find_rejoin: rejoined,
                                  only the parameter server's requests work) */
    uint32_t ext_requests;     /* COLL_EXT requests issued (not collectives: no sequence) */
    uint64_t bytes_sent;       /* payload sent to other ranks (atomic; dt_comm_bytes_sent) */
    struct xfers *graveyard;   /* comm thread: records holding orphaned sends (src/comm.c) */
    /* process groups (src/join.c) */
    int *members;              /* a group's: the job rank of each group rank; NULL: the job */
    char label[96];            /* a group's: "group [1 3]: ", before its errors */
    int serials[COMM_SERIALS]; /* comm_serial: numbers handed out so far, per kind */
    uint32_t *p2p_sent, *p2p_recvd;   /* point-to-point messages to / from each rank so far
                                  (caller's side; the k-th send meets the k-th receive) */
    /* liveness apart from progress: the job communicator's heartbeat thread
     * (src/join.c, join_heartbeat) publishes "/hb/<job rank>" every beat_ms on
     * its own store connection; a wait watches its peer's (comm_check_heartbeat) */
    int has_hb, beat_ms;
    int hb_peer;               /* comm thread: the rank whose heartbeat it watches (-1: none) */
    unsigned long long hb_beat; /* its latest beat seen */
    double hb_seen;            /* when that beat last changed (or the watch began) */
    char hb_doing[96];         /* what its heartbeat said it was doing */
    double hb_due;             /* heartbeat thread: when its sleep should end (0: awake);
                                  a due time long past means this process is not running */
    double frozen_at;          /* when the heartbeat thread last found it had overslept past
                                  the timeout (this process stopped or starved), and by */
    int frozen_ms;             /* how long it had not run then (comm_frozen_ms) */
    double *ext_done_at;       /* comm thread: a parameter-server request's last completion
                                  from each rank (world; 0: none), for per-server latencies */
};

typedef struct coll_header {
    uint32_t magic, kind, seq, root, op, pad;
    int64_t n;
} coll_header;

/* The ranks a transport algorithm runs over: the whole world, or one
 * leader per host in a hierarchical allreduce.  Algorithms work in group
 * indices and post to rank[index] (NULL: index is the rank). */
typedef struct grp {
    int me, size;
    const int *rank;
} grp;

typedef struct xfers {
    grp g;
    double patience;           /* scales timeout_ms for waits; 0 means 1 */
    dt_xfer x[DT_COMM_MAX_XFERS];
    int n;
    coll_header hdr_out, hdr_in;
    dt_xfer hdr_send, hdr_recv;
    int hdr_checked, has_hdr;
    const unsigned char *gone; /* parameter server: ranks gone_base + i with gone[i] died; */
    int gone_base, gone_n;     /* their transfers are not waited for, then cancelled */
    /* a transfer with rank `peer` failed: 1 if the work goes on without it
     * (the peer is gone now), else 0 and the work fails */
    int (*write_off)(dt_comm *c, void *arg, int peer);
    void *write_off_arg;
    /* a wait that made no progress, its transfers with the dead cancelled:
     * the owner may post more (src/ps.c greets a restarted server at once,
     * ps_greet_restarted); not DT_OK fails the wait.  arg: write_off_arg */
    dt_status (*idle)(dt_comm *c, struct dt_work *w, struct xfers *xs, void *arg);
    unsigned char cancelled[DT_COMM_MAX_XFERS];   /* with a dead peer: never waited for again,
                                                     even once it is back (restarted) */
    int orphans;               /* sends to a dead peer the transport would not let go of:
                                  this record must outlive them (kept in c->graveyard) */
    struct xfers *next_dead;
} xfers;

/* A stalled collective asks rank 0's store every DT_COMM_WATCH_S whether a
 * rank died, so a killed process is named in about a second instead of
 * after the timeout (and by every survivor, not just its neighbours). */
#define DT_COMM_WATCH_S 0.5

struct seg_rank;

struct seg_head {
    uint32_t magic, nlocal;
    uint64_t slot_bytes, total_bytes;
    _Atomic uint32_t aborted;
    char why[DT_MAX_ERROR + 16];   /* "<status>|@<seq>|<message>": comm_fail_with_reason */
};

/* --- point to point ------------------------------------------------------- */

typedef struct p2p_call p2p_call;
/* --- src/launch.c --- */
/* --- src/ddp.c --- */

typedef struct ddp_bucket {
    int64_t offset;            /* its first gradient float in a set */
    int64_t numel;             /* gradient floats */
    int count;                 /* flags that follow them: every parameter's in the
                                  last bucket, none elsewhere */
    int64_t pending;           /* gradient floats not yet final in this backward */
    dt_work *work;             /* its allreduce (or gather), in flight */
    /* compression (src/ddp.c): this rank's encoded bucket, everyone's, and what
     * error feedback carries to the next step */
    int64_t topk;              /* TOPK: entries sent */
    int npieces;               /* TOPK: the parameters' parts in this bucket, each */
    int64_t *pieces;           /*   (start, end, k): k chosen per parameter, as DGC does,
                                    so small-gradient layers are not starved */
    size_t code_bytes;         /* encoded gradients, before the flags */
    int64_t payload_floats;    /* encoded gradients + flags, in floats */
    float *payload, *gathered, *residual;
    float *velocity;           /* TOPK with SGD momentum: the momentum, kept locally */
    ps_call pcall;             /* with a parameter server: its push (alive while in flight) */
    /* sharded (src/zero.c) */
    float *mem;                /* zero 2: the memory lent to it (NULL: none now) */
    int64_t *blocks;           /* world + 1: each rank's shard within it, from its start */
    int lent;                  /* zero 2: its pool buffer's index, -1: none */
} ddp_bucket;

typedef struct zero_buf zero_buf;

/* Sharded data parallelism: what a DDP with dt_ddp_config.zero keeps. */
typedef struct zero_state {
    int level, world, rank;
    int64_t *shard;            /* world + 1: rank q owns flat floats [shard[q], shard[q+1]) */
    int64_t lo, hi;            /* ours */
    float *shard_grad;         /* zero 2: our shard of the averaged gradients */
    float *park;               /* zero 2: where a gradient with no memory lent points;
                                  as long as the largest parameter, written only if a
                                  caller reads such a gradient */
    zero_buf *pool;            /* zero 2: bucket memory, lent and taken back */
    int npool, reaped;         /* buffers; buckets whose reduce-scatter is collected */
    size_t lent_bytes;         /* zero 2: lent now, plus the shard */
    float *used;               /* per parameter: a gradient came this step (any rank, after
                                  the step's allreduce of them) */
    float *flat;               /* zero 1: the set (gradients, then gathered parameters) */
    float *host;               /* staged (a device backend): the flat layout's host mirror,
                                  where the collectives run (zero_stage_out, zero_stage_in) */
    int host_pinned;           /* host came from the backend's host_alloc */
    dt_optim *opt;             /* whose state is sharded */
    /* zero 3: parameters held as shards.  A unit (a bucket: whole
     * parameters) is resident when every float of its parameters is valid;
     * otherwise only this rank's shard is, and the other pages are given
     * back (the backend's discard), the parameters keeping their addresses */
    int *unit_of;              /* parameter -> its bucket */
    int *by_addr;              /* parameters in order of their addresses */
    int *alone;                /* per bucket: its one parameter (gathered in place), or -1 */
    char *resident;            /* per bucket */
    uint64_t *last;            /* per bucket: the tick of its last use */
    uint64_t tick;             /* uses of parameter memory so far */
    int nresident;
    int pre_unit, pre_buf;     /* the unit whose gather is in flight (-1: none), its pool
                                  buffer (-1: none) */
    float *pre_mem;            /* where it is gathered (zero_gather_buf) */
    int pre_inplace;           /* into its parameter's own memory */
    dt_work *pre_work;
    int pinned;                /* dt_ddp_full_params: all resident until the next step */
    int first_unit;            /* the unit a step read first (-1: none yet), prefetched
                                  when the next one can start (zero_after_step) */
    int step_ended;            /* no unit read since the last step */
    /* The order units were read in: this step's so far (rec) and the last
     * whole step's (prev), one entry each time the unit read changes, up
     * to trace_cap.  Every rank runs the same ops, so every rank has the
     * same traces and prefetches the same units (zero_predict). */
    int *rec, *prev;
    int rec_n, prev_n, trace_cap;
    int cursor;                /* where in prev the step is (-1: not found) */
    int *opt_index;            /* zero 3 with f32 masters (param_dtype 16-bit): per parameter
                                  its index in opt, or -1; NULL without masters.  Then no
                                  float of a parameter is kept between its uses: this rank's
                                  part of a gather is its master rounded (zero_copy_part) */
} zero_state;

struct dt_ddp {
    dt_ctx *ctx;
    dt_comm *comm;
    dt_optim *opt;
    dt_ddp_config cfg;
    dt_allocator al;           /* the context's, kept for dt_ddp_free after a detach */
    const dt_backend_iface *be_iface;
    dt_backend *be;
    int nparams;
    dt_tensor **params;        /* registration order (a copy of the context's list) */
    int *order;                /* bucket order: reverse registration */
    int64_t *offset;           /* param -> float offset of its gradient in a set */
    int *uses;                 /* param -> uses left on the tape */
    int64_t *done;             /* param -> floats of its gradient final (a prefix) */
    void **own_grad;           /* param -> the grad buffer it had before */
    float *set;                /* the gradients and used-flags, host memory the collectives
                                  use (one set: a backward starts only after the last
                                  step's collectives finished, ddp_backward_begin) */
    float *dset;               /* staged (a device backend): the gradients, on the device;
                                  each bucket is copied to set to travel and back after */
    int staged, pinned;        /* pinned: set from the backend's host_alloc */
    uint64_t last_ticket;      /* staged: the latest copy; waited for before freeing */
    int64_t set_floats;        /* gradients, then one flag per parameter */
    int64_t grad_floats;       /* gradients: where the flags start */
    int64_t bucket_floats;     /* the cap: buckets cut every this many floats */
    ddp_bucket *buckets;
    int nbuckets, next_launch, ready_upto;
    int sync;                  /* 0: no_sync */
    int overlap;               /* cfg.overlap resolved (ddp_resolve_overlap) */
    int hooks;                 /* this backward launches buckets */
    int pending_sync;          /* buckets launched or owed; dt_ddp_sync finishes them */
    dt_status launch_status;
    char launch_msg[DT_MAX_ERROR];
    double t_backward;
    uint64_t sent_at_launch;
    uint64_t zero_gen;         /* ctx->zero_gen when this step's buckets started */
    float *scratch;            /* TOPK selection, numel of the largest bucket */
    unsigned char *picked;     /* TOPK: which entries were sent, same size */
    float momentum;            /* > 0: momentum correction (src/ddp.c) */
    int64_t topk_steps;        /* TOPK: steps sent so far (the warm-up's clock) */
    dt_ddp_stats st;
    /* the ranks' checks (src/profile.c) and load balancing (src/ddp.c) */
    int check_every;           /* profiling: steps between straggler checks; 0: none */
    dt_loader *bal_ld;         /* balancing: the loader whose global batches it cuts */
    int bal_every;
    double *bal_w;             /* the split in force, one weight a rank */
    zero_state *z;             /* dt_ddp_config.zero >= 1: sharded (src/zero.c) */
};

/* Run forward over this rank's part; per batch, visit(logits, labels,
 * first local index).  Grad and training are off meanwhile. */
typedef dt_status (*eval_visit)(dt_ctx *ctx, dt_tensor *logits, dt_tensor *y, int64_t first,
                                void *acc);

struct dt_dp;
/* --- src/ps.c --- */
#define PS_MAGIC 0x44545053u
/* Pieces.  A message of `bytes` is ceil(bytes / chunk) messages.  With
 * libfabric's shm provider a send of more than its inject size (4 KiB)
 * completes only when the receiver answers, and the sender handles those
 * answers in order, so one such send to a process that died holds back
 * every later one, to anyone: where a death must not stop the job
 * (replicated or checkpointing servers) pieces on shm are PS_SHM_CHUNK. */
#define PS_SHM_CHUNK ((size_t)4096)
#define PS_MIN_CHUNK ((size_t)64)
#define PS_MAX_PIECES ((uint32_t)1 << 24)
#define PS_MAX_KEYS ((int64_t)1 << 50)   /* parameters' floats a layout may give */

enum { PS_TAG_REQ = 1, PS_TAG_DATA, PS_TAG_RESP, PS_TAG_RDATA };
#define PS_WINDOW 16              /* a server's pieces in flight per message */
#define PS_POLL_S 0.02            /* a server waits this long for traffic per turn */
#define PS_STALL_SLACK_S 0.05     /* a longer gap between its turns: it did not run */

/* A server's view of one worker. */
typedef struct ps_peer {
    uint32_t seq;              /* its next request */
    int state;                 /* 0 live, 1 finished, 2 dropped (died) */
    int64_t clock;             /* steps completed here (-1: a rejoined server awaits its hello) */
    int64_t base;              /* rejoined server: its steps when it said hello */
    int64_t got;               /* floats of its current step received */
    float *push;               /* its current step: G_s gradients then P flags */
    ps_msg hdr;                /* the request being received */
    dt_xfer hdr_x;
    int64_t data_lo, data_n;   /* its data is being received, in pieces: */
    char *data_buf;
    size_t data_bytes;         /* what they must bring in all */
    uint32_t data_pieces, data_next, data_got;   /* pieces: all, posted, arrived */
    dt_xfer data_x[PS_WINDOW];
    uint32_t data_piece[PS_WINDOW];   /* the piece each receive was posted for */
    unsigned char data_busy[PS_WINDOW];
    int op;
    void *sdata;               /* a sparse request's ids (and rows) being received */
    int parked;                /* BSP: its step is in but not applied; its next request
                                  is not read until it is (a worker runs at most one step
                                  ahead of the slowest, its push buffer holds one step) */
    struct ps_sparse_msg *held; /* BSP: its sparse pushes not yet applied, oldest first */
    int vote;                  /* its current step's pre-emption vote (ps_msg.vote) */
    unsigned long long hb_beat;  /* its heartbeat as last read (ps_worker_alive), and when */
    double hb_seen;              /* that changed (0: not read yet) */
} ps_peer;

typedef struct ps_sparse_msg ps_sparse_msg;

/* A sparse table.  On a server: its rows r = i * S + server, i < count. */
typedef struct ps_tab {
    char *name;
    int64_t rows, dim;
    float scale;
    uint64_t seed;
    int64_t count;
    dt_tensor *w, *state[2];   /* count x dim each; state: the optimizer's, as its kind has */
    int64_t steps;             /* updates applied (Adam's bias correction) */
    dt_tensor *steps_t;        /* steps in a checkpoint: two floats, steps >> 24 and its low
                                  24 bits (each exact in a float) */
    float *acc;                /* count x dim: gradient rows being summed */
    int64_t *slot;             /* row -> its place in touched, or -1 */
    int64_t *touched, ntouched;
} ps_tab;

/* A response in flight (server side): its header, then its data in
 * pieces, PS_WINDOW at a time; freed when every send posted completed and
 * nothing is left to post. */
typedef struct ps_reply {
    ps_msg hdr;
    dt_xfer hdr_x;
    float *data;
    int worker;
    size_t bytes, chunk;       /* bytes 0 with pieces: an error's empty pieces */
    uint32_t pieces, posted, stopped;   /* stopped: no more pieces go out */
    dt_xfer data_x[PS_WINDOW];
    unsigned char busy[PS_WINDOW];
    struct ps_reply *next;
} ps_reply;

/* A pull waiting for the slow workers (server side). */
typedef struct ps_wait {
    int worker;
    ps_msg req;
    int64_t *ids;              /* a sparse pull's rows (owned) */
    struct ps_wait *next;
} ps_wait;

struct dt_ps {
    dt_ctx *ctx;
    dt_comm *comm;
    dt_ps_config cfg;
    int W, S, server;          /* server: this rank's server index, -1 on workers */
    int L, shard;              /* key shards (S, or S / 2 replicated); a server's shard */
    unsigned char *gone;       /* worker, per server: 1 dead and written off (its twin
                                  serves), 2 dead and awaited (src/ps_server.c) */
    uint32_t *inc;             /* worker, per server: its process's incarnation */
    double *down_since;        /* worker, per server: when it was found dead */
    int64_t *sent, *sent_clock; /* worker, per server: floats of step sent_clock it has
                                  (a restarted server counts them as come) */
    int job;                   /* which PS job of the communicator (store keys) */
    int finished;              /* worker: dt_ps_finish done */
    int nparams;
    int64_t G, P;              /* gradient floats, flags */
    int64_t *numel, *offset;   /* parameter (registration index) -> size, flat offset */
    int64_t *range;            /* S + 1 gradient-key boundaries */
    char *layout;              /* a header line, "name numel\n" per parameter in
                                  registration order, then a line per table */
    int ntables;
    ps_tab *tabs;
    /* worker */
    size_t chunk;              /* our messages' pieces, and the answers' (src/ps.c) */
    uint32_t *seq;             /* per server: our next request */
    int ans_via[PS_MAX_SERVERS]; /* per server: the transport peer its answers come from
                                  (its endpoint for us on shm, else its rank) */
    int64_t clock;             /* steps pushed */
    float *stage;              /* G + P floats: packing pushes, receiving pulls */
    float *stage2;             /* prefetch: G floats the next step's parameters arrive in */
    dt_work *prefetch;         /* that pull, in flight */
    ps_call prefetch_call;
    /* server */
    dt_ctx *sctx;              /* owns the pieces and their optimizer */
    dt_optim *opt;
    int npieces;
    dt_tensor **piece;         /* in key order */
    int64_t *piece_lo;         /* flat offset of its first float */
    int *piece_param;          /* which parameter (registration index) */
    ps_peer *peers;            /* W */
    dt_transport **ans;        /* shm: W endpoints, one per worker, its answers go out of
                                  (a dead worker's sends hold back only its own) */
    float *sum;                /* G_s gradient floats being applied */
    int64_t applied;           /* BSP: steps applied */
    int initialized;
    int64_t init_got;
    ps_reply *replies;
    ps_wait *waits;
    double stale_sum;
    int64_t stale_n;
    char *ckpt_path;           /* server: its checkpoint file, or NULL */
    dt_tensor **ckpt_tables;   /* server: what its checkpoint saves (ctx_set_ckpt_extra) */
    int resumed;               /* server: started from it (worker 0's init is not used) */
    int syncing;               /* server, rejoined: not every live worker has said hello */
    int vote;                  /* server: the last applied step's pre-emption verdict */
    dt_ps_stats st;
};

typedef struct ps_idpos ps_idpos;
typedef struct hw_thread hw_thread;

typedef struct hogwild hogwild;
/* --- src/profile.c --- */

/* --- the profiler at the end of the job: gather, trace, report ---------------------- */

/* (in the header: the tests build reports from made-up heads) */
typedef struct prof_blob_head {
    uint64_t magic;
    int64_t nev;
    double offset;             /* add to this rank's clock to get rank 0's */
    double batch_s;            /* the loader's time preparing batches */
    int64_t batches, batches_prefetched;
    dt_profile_stats st;
    char long_wait[200];       /* prof_state.long_wait */
} prof_blob_head;
/* Rank 0's report from the P ranks' heads (each rank's totals), link the
 * link's measured bus bandwidth (GB/s, 0: not measured), trace_path the
 * merged timeline's file or NULL: new text (host_free), NULL when out of
 * memory.  The tests build it from made-up heads too. */
DT_PRIVATE char *prof_build_report(dt_ctx *ctx, const prof_blob_head *const *h, int P, double link,
                                   const char *trace_path);
typedef struct pipe_slot pipe_slot;

typedef struct pipe_mb pipe_mb;

struct dt_pipe;

typedef struct pipe_arenas pipe_arenas;

/* ===========================================================================
 * What each distributed module offers the others
 * ======================================================================== */

/* src/store.c */
DT_PRIVATE void store_dead_key(char *key, size_t cap, int rank, uint32_t inc);
DT_PRIVATE int store_ms_left(double deadline);
DT_PRIVATE dt_store *store_open(dt_ctx *ctx, const dt_dist_env *env, const dt_store_config *cfg,
                            int serve, uint32_t inc);
DT_PRIVATE void store_close(dt_store *s, int drain_ms);
DT_PRIVATE void store_limit(dt_store *s, double until);
DT_PRIVATE int store_silent_ms(const dt_store *s);
DT_PRIVATE dt_status store_clock_offset(dt_store *s, int rounds, double *offset, double *rtt);

/* src/comm.c: the comm thread, transfers with a deadline, the collectives */
DT_PRIVATE const char *comm_coll_name(int kind);
/* The next number of a kind (COMM_SERIAL_*) on this communicator: 0, 1, ... */
DT_PRIVATE int comm_serial(dt_comm *c, int kind);
/* What a communicator is, for the modules above: its context, liveness and
 * progress timeouts, incarnation (0, or this process's restart), largest
 * message, transport endpoint, its own store connection that watches for
 * deaths (NULL: none), a group's label ("" for the job), ranks on this
 * host, and why it broke (NULL: it did not). */
DT_PRIVATE dt_ctx *comm_ctx(const dt_comm *c);
DT_PRIVATE int comm_timeout_ms(const dt_comm *c);
DT_PRIVATE int comm_collective_timeout_ms(const dt_comm *c);
DT_PRIVATE uint32_t comm_incarnation(const dt_comm *c);
DT_PRIVATE size_t comm_max_msg(const dt_comm *c);
DT_PRIVATE const dt_transport_iface *comm_tp_iface(const dt_comm *c);
DT_PRIVATE dt_transport *comm_tp(const dt_comm *c);
DT_PRIVATE dt_store *comm_watch(const dt_comm *c);
DT_PRIVATE const char *comm_label(const dt_comm *c);
DT_PRIVATE int comm_local_size(const dt_comm *c);
DT_PRIVATE const char *comm_broken_msg(const dt_comm *c);
/* An extension (the parameter server) runs its COLL_EXT work on the comm
 * thread with ops: the number of its job on this communicator (0, 1, ...). */
DT_PRIVATE int comm_attach_ext(dt_comm *c, const comm_ext_ops *ops);
/* The next work enqueued on c first waits for this backend copy (a staged
 * gradient's, src/ddp.c); returns the ticket set before, 0 once consumed
 * (set 0 after the enqueue: what it returns then was not consumed). */
DT_PRIVATE uint64_t comm_stage_next(dt_comm *c, uint64_t ticket);
/* *xsp holds orphaned sends (drain_gone): a fresh record with the same
 * settings replaces it, and the old one waits, buried, until the transport
 * that holds its sends is closed (comm_xfers_free_buried, at dt_comm_free). */
DT_PRIVATE dt_status comm_xfers_renew(dt_comm *c, dt_work *w, xfers **xsp);
DT_PRIVATE void comm_xfers_free_buried(dt_comm *c);
DT_PRIVATE const char *comm_alg_name(int alg);
DT_PRIVATE double comm_bus_factor(int kind, int P);
DT_PRIVATE dt_status comm_work_fail(dt_work *w, dt_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
DT_PRIVATE dt_status comm_blame_silent(dt_work *w, int who, int ms);
DT_PRIVATE dt_status comm_fail_with_reason(dt_work *w, const char *why);
DT_PRIVATE dt_status comm_check_dead(dt_comm *c, dt_work *w, double deadline);
DT_PRIVATE void comm_note_long_wait(dt_comm *c, const dt_work *w, double start);
DT_PRIVATE dt_status comm_check_stall(dt_comm *c, dt_work *w, double *last);
/* The comm thread's transport calls, watched for a wedge (comm_wedged) */
DT_PRIVATE int comm_tp_poll(dt_comm *c, dt_xfer **done, int max, char *err, size_t err_len);
DT_PRIVATE void comm_tp_wait(dt_comm *c, int timeout_ms);
DT_PRIVATE int comm_thread_stuck(dt_comm *c);
/* (the suite's fault injection only: unused in the generated dtrain.c) */
DT_PRIVATE __attribute__((unused)) const dt_transport_iface *comm_swap_transport(
    dt_comm *c, const dt_transport_iface *iface);
/* How long this process did not run (stopped, starved) at a time after
 * `since` (dt_now), as its heartbeat thread saw it oversleep (a freeze
 * still under way counts too); 0: none past c's timeout, or no heartbeat. */
DT_PRIVATE int comm_frozen_ms(dt_comm *c, double since);
DT_PRIVATE void comm_describe_call(char *out, size_t cap, int kind, int64_t n, int root, int op);
DT_PRIVATE dt_status comm_header_check(dt_work *w, int me, int left, const coll_header *h, size_t len);
DT_PRIVATE dt_status comm_post(dt_comm *c, dt_work *w, xfers *xs, int sending, int peer,
                               uint64_t tag, void *buf, size_t bytes);
DT_PRIVATE dt_status comm_post_via(dt_comm *c, dt_work *w, xfers *xs, int sending, int peer,
                                   int via, uint64_t tag, void *buf, size_t bytes);
DT_PRIVATE dt_status comm_add_endpoint(dt_comm *c, int rank, const void *addr, size_t len,
                                       int *via, char *err, size_t err_len);
DT_PRIVATE int comm_xfer_rank(const dt_comm *c, const dt_xfer *x);
/* What an extension's request (src/ps.c) reads and sets of its work and
 * of the work's transfer record, through comm: the work's status so far
 * and its request (aux); a first failure forgiven (the work goes on:
 * status DT_OK, no message); what the request did and how stale its
 * answer came (ext_what, ext_stale: the profiler's record); memory freed
 * with the work (owned).  Of the record: its transfers posted, and the
 * sends to the dead it must outlive (orphans); whether rank has a
 * transfer not yet done in it; the peers whose death the work survives
 * (gone[n] of ranks base + i, write_off asked when one fails, idle when a
 * wait makes no progress, both given arg); how much longer than the
 * timeout its waits may take (patience, 0 means 1). */
DT_PRIVATE dt_status comm_work_status(const dt_work *w);
DT_PRIVATE const void *comm_work_request(const dt_work *w);
DT_PRIVATE void comm_work_forgive(dt_work *w);
DT_PRIVATE void comm_work_record_ext(dt_work *w, int what, int64_t stale);
DT_PRIVATE void comm_work_own(dt_work *w, void *owned);
DT_PRIVATE int comm_xfers_count(const xfers *xs);
DT_PRIVATE int comm_xfers_orphans(const xfers *xs);
DT_PRIVATE int comm_xfers_pending_with(const dt_comm *c, const xfers *xs, int rank);
DT_PRIVATE void comm_xfers_survive(xfers *xs, const unsigned char *gone, int base, int n,
                                   int (*write_off)(dt_comm *c, void *arg, int peer),
                                   dt_status (*idle)(dt_comm *c, dt_work *w, xfers *xs, void *arg),
                                   void *arg);
DT_PRIVATE void comm_xfers_set_patience(xfers *xs, double patience);
DT_PRIVATE dt_status comm_wait_xfers(dt_comm *c, dt_work *w, xfers *xs);
DT_PRIVATE void comm_block_range(int64_t n, int parts, int b, int64_t *lo, int64_t *hi);
DT_PRIVATE void comm_reduce_into(float *restrict dst, const float *restrict src, int64_t n,
                                 dt_reduce_op op);
DT_PRIVATE void comm_finish_avg(dt_comm *c, dt_work *w, float *buf, int64_t n);
DT_PRIVATE const dt_transport_iface *comm_find_transport(void);
DT_PRIVATE void *comm_main(void *arg);
DT_PRIVATE dt_status comm_take_transport(dt_comm *c, char *why, size_t why_len);
DT_PRIVATE void comm_release_transport(dt_comm *c);
DT_PRIVATE void comm_break(dt_comm *c, const char *msg);
DT_PRIVATE dt_work *comm_enqueue_in(dt_comm *c, int kind, float *buf, const float *in, int64_t n,
                                    int root, dt_reduce_op op, const void *aux);
DT_PRIVATE dt_work *comm_enqueue(dt_comm *c, int kind, float *buf, const float *in, int64_t n,
                                 int root, dt_reduce_op op);
DT_PRIVATE dt_status comm_work_finish(dt_work *w, double *run_s);
DT_PRIVATE int comm_work_done(dt_work *w);
DT_PRIVATE dt_status comm_run_wait(dt_comm *c, int kind, float *buf, const float *in, int64_t n,
                                   int root, dt_reduce_op op, const void *aux);
DT_PRIVATE dt_status comm_run_in(dt_comm *c, int kind, float *buf, const float *in, int64_t n,
                                 int root, dt_reduce_op op, const void *aux);
DT_PRIVATE dt_status comm_p2p_run(dt_comm *c, const float *send, int64_t ns, int dst, float *recv,
                                  int64_t nr, int src);

/* src/seg.c: the host segment's collectives */
DT_PRIVATE size_t seg_ranks_offset(void);
DT_PRIVATE size_t seg_data_offset(int nlocal);
DT_PRIVATE float *seg_slot_at(dt_comm *c, int q, uint32_t chunk);
DT_PRIVATE void seg_heartbeat(dt_comm *c);
DT_PRIVATE void seg_abort(dt_comm *c, const dt_work *w);
DT_PRIVATE uint32_t seg_announce(dt_comm *c, const dt_work *w);
DT_PRIVATE dt_status seg_sync(dt_comm *c, dt_work *w, uint32_t p0, double patience);
DT_PRIVATE dt_status seg_allreduce(dt_comm *c, dt_work *w, int to_all, int scale);
DT_PRIVATE dt_status seg_broadcast(dt_comm *c, dt_work *w, int from, float *buf, int64_t n,
                                   uint32_t p0, double patience);
DT_PRIVATE dt_status seg_allgather(dt_comm *c, dt_work *w);
DT_PRIVATE dt_status seg_reduce_scatter(dt_comm *c, dt_work *w);
DT_PRIVATE dt_status seg_reduce_scatter_v(dt_comm *c, dt_work *w);
DT_PRIVATE dt_status seg_allgather_v(dt_comm *c, dt_work *w);
DT_PRIVATE dt_status seg_alltoall(dt_comm *c, dt_work *w);

/* src/preempt.c: graceful pre-emption */
DT_PRIVATE void preempt_reclaim(dt_ctx *ctx);
DT_PRIVATE dt_status preempt_vote(dt_ctx *ctx, dt_comm *c);
DT_PRIVATE int preempt_local(const dt_ctx *ctx);
DT_PRIVATE void preempt_take(dt_ctx *ctx, int verdict);
DT_PRIVATE dt_status preempt_decide(dt_ctx *ctx, int64_t step, int verdict);
DT_PRIVATE void preempt_line(const dt_ctx *ctx, char *out, size_t cap);
/* The step the job agreed to stop after, -1: none agreed. */
DT_PRIVATE int64_t preempt_stop_step(const dt_ctx *ctx);
/* A parameter-server worker (on) or not: the servers count its votes. */
DT_PRIVATE dt_status preempt_set_via_ps(dt_ctx *ctx, int on);

/* src/join.c: joining the job, a restarted rank */
DT_PRIVATE dt_status join_announce_rejoin(dt_comm *c);
DT_PRIVATE dt_status join_replace_peer(dt_comm *c, int peer, uint32_t inc, char *err, size_t err_len);

/* src/ddp.c */
DT_PRIVATE struct dt_ddp *ddp_attached(dt_ctx *ctx);
DT_PRIVATE int ddp_sync_of(const dt_ddp *d);   /* dt_ddp_set_sync's setting */
DT_PRIVATE int ddp_bucket_of(const dt_ddp *d, int64_t flat);

/* src/zero.c: the sharded mode of src/ddp.c (its hooks call these) */
DT_PRIVATE const char *zero_refuses(const dt_ddp_config *cfg, const dt_optim *opt, const dt_ctx *ctx,
                                    dt_status *code);
DT_PRIVATE dt_status zero_new(dt_ddp *d);
DT_PRIVATE void zero_forget_optim(dt_ddp *d, const dt_optim *o);
DT_PRIVATE dt_status zero_param_use(dt_ddp *d, const void *data, int backward);
DT_PRIVATE int zero_param_whole(const dt_ddp *d, const void *data);
DT_PRIVATE dt_status zero_full_params(dt_ddp *d);
DT_PRIVATE void zero_free(dt_ddp *d);
DT_PRIVATE dt_status zero_grad_memory(dt_ddp *d, int i);
DT_PRIVATE void zero_launch(dt_ddp *d, ddp_bucket *b);
DT_PRIVATE dt_status zero_finish(dt_ddp *d, double *exposed);
DT_PRIVATE void zero_grad_scale(dt_ddp *d, float k);
DT_PRIVATE dt_status zero_grad_sumsq(dt_ddp *d, double *total);
DT_PRIVATE dt_status zero_after_step(dt_ddp *d, dt_optim *o);

/* src/ps.c */
DT_PRIVATE size_t ps_encode_push(const dt_ps *ps, struct ps_call *pc, int kind, double ratio,
                             float *residual, float *scratch, char *out);
DT_PRIVATE dt_status ps_step_pull(dt_ps *ps);
DT_PRIVATE int64_t ps_clock(const dt_ps *ps);
DT_PRIVATE void ps_pushed(dt_ps *ps, int requests);
DT_PRIVATE dt_status ps_ddp_check(dt_ctx *ctx, dt_comm *c, const dt_ddp_config *cfg, const dt_optim *opt);
DT_PRIVATE const char *ps_op_name(int op);
DT_PRIVATE uint64_t ps_tag(int type, uint32_t seq, uint32_t piece);
DT_PRIVATE uint64_t ps_pieces(size_t bytes, size_t chunk);
DT_PRIVATE dt_status ps_check_request(dt_ps *ps, int w, const ps_msg *h, size_t len);
DT_PRIVATE dt_status ps_answer_check(dt_work *w, ps_msg *in);
DT_PRIVATE size_t ps_piece_len(size_t bytes, size_t chunk, uint32_t i);
DT_PRIVATE uint32_t ps_published_inc(dt_comm *c, int rank, int wait_ms);
DT_PRIVATE void ps_fence_key(char *key, size_t cap, int job, int rank, uint32_t inc);

/* src/ps_server.c */
DT_PRIVATE void ps_free_held(dt_ps *ps, ps_peer *p);
DT_PRIVATE dt_status ps_make_pieces(dt_ps *ps);
DT_PRIVATE dt_status ps_open_answer_endpoints(dt_ps *ps);
DT_PRIVATE void ps_close_answer_endpoints(dt_ps *ps);

/* src/join.c */
DT_PRIVATE dt_store *join_own_store(dt_comm *c, dt_ctx *errors);
/* The job's rendezvous store connection (the caller's thread's), and rank
 * 0's clock minus ours as measured at the rendezvous (src/profile.c). */
DT_PRIVATE dt_store *join_store(const dt_comm *c);
DT_PRIVATE double join_clock_offset(const dt_comm *c);


/* src/profile.c */
DT_PRIVATE dt_status prof_exchange(dt_ctx *ctx, dt_comm *c, double *rates);
DT_PRIVATE int prof_find_straggler(const double *per_sample, int P, double threshold, double *median);
DT_PRIVATE int prof_slowest(const dt_profile_stats *const *st, int P, char *why, size_t cap);
DT_PRIVATE int prof_slow_server(const dt_profile_stats *const *st, int P, char *why, size_t cap);
/* The server the workers' requests wait for longest (their per-server
 * latencies: at least 1.5x the median server's for half of the workers or
 * more), and why; -1 when none stands out. */
DT_PRIVATE int prof_slow_server_by_latency(const dt_profile_stats *const *st, int P, char *why,
                                           size_t cap);
/* The rank the CPU starves most (its cgroup's quota throttled it, or its
 * threads waited in the run queue), and why; -1 when none does. */
DT_PRIVATE int prof_cpu_starved(const dt_profile_stats *const *st, int P, char *why, size_t cap);
/* The rank whose data loader holds the others back (its data wait per step
 * well above the median rank's), and why; -1 when none does. */
DT_PRIVATE int prof_loader_bottleneck(const dt_profile_stats *const *st, int P, char *why,
                                      size_t cap);
/* The rank that evaluated or saved checkpoints on its own while the others
 * waited in their collectives, and why; -1 when none did. */
DT_PRIVATE int prof_aside_stall(const dt_profile_stats *const *st, int P, char *why, size_t cap);

/* src/steal.c */

#endif /* DTRAIN_DIST_H */
