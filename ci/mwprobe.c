// mwprobe: does this device's memory window do what a receive-bounded
// verbs transport needs? Two RC queue pairs on one port, connected to each
// other; a buffer registered with MW_BIND only (no remote access); a type 1
// window bound over 64 bytes of it with remote write. Then:
//   1. a write through the window's rkey inside it        -> must succeed
//   2. a write through the window's rkey outside it       -> must fail
//   3. a write through the region's own rkey              -> must fail
//   4. the window unbound, a write to where it was        -> must fail
// Prints one line per step and "mw: all as expected" (exit 0), or exits 1.
// Build: cc -O2 -o mwprobe ci/mwprobe.c -libverbs
// Run on soft-RoCE: ../shared/rxe/rxe-vm.sh -- ./mwprobe rxe0
// Each failed write moves its queue pair to the error state, so each step
// uses a fresh pair of queue pairs.
// On the soft-RoCE VM (Debian kernel 6.1.0-48, rxe) steps 1, 3 and 4 are as
// expected and step 2 is not: a write through the window's key lands 64
// bytes past the window (inside the region). rxe invalidates a window's key
// on unbinding but checks a write's range against the region, not the
// window: a receive-bounded transport can be tested there for keys that die
// with their receive, not for the window's bounds.
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static struct ibv_cq *cq;
static int gid_index = -1;
static union ibv_gid gid;
static enum ibv_mtu mtu;

static void die(const char *what) {
    perror(what);
    exit(1);
}

// A RoCE v2 IPv4-mapped GID, as the transport picks one.
static void pick_gid(void) {
    struct ibv_port_attr pa;
    if (ibv_query_port(ctx, 1, &pa)) die("ibv_query_port");
    mtu = pa.active_mtu;
    for (int i = 0; i < pa.gid_tbl_len; i++) {
        union ibv_gid g;
        if (ibv_query_gid(ctx, 1, i, &g)) continue;
        int v4 = g.raw[10] == 0xff && g.raw[11] == 0xff;
        for (int k = 0; k < 10; k++) v4 &= g.raw[k] == 0;
        if (v4) { gid = g; gid_index = i; }
    }
    if (gid_index < 0) { fprintf(stderr, "no IPv4 GID\n"); exit(1); }
}

static struct ibv_qp *make_qp(void) {
    struct ibv_qp_init_attr ia = {
        .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
        .cap = {.max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1},
    };
    struct ibv_qp *qp = ibv_create_qp(pd, &ia);
    if (!qp) die("ibv_create_qp");
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = 1,
                            .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE};
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
        die("modify INIT");
    return qp;
}

static void connect_to(struct ibv_qp *qp, uint32_t remote_qpn) {
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_RTR, .path_mtu = mtu, .dest_qp_num = remote_qpn,
                            .rq_psn = 0, .max_dest_rd_atomic = 1, .min_rnr_timer = 12};
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = gid;
    a.ah_attr.grh.sgid_index = gid_index;
    a.ah_attr.grh.hop_limit = 64;
    a.ah_attr.port_num = 1;
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                  IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
        die("modify RTR");
    struct ibv_qp_attr s = {.qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = 3, .rnr_retry = 3,
                            .sq_psn = 0, .max_rd_atomic = 1};
    if (ibv_modify_qp(qp, &s, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                  IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
        die("modify RTS");
}

// The status of the next completion of work request `id`.
static enum ibv_wc_status wait_for(uint64_t id) {
    for (;;) {
        struct ibv_wc wc;
        int n = ibv_poll_cq(cq, 1, &wc);
        if (n < 0) die("ibv_poll_cq");
        if (n == 1 && wc.wr_id == id) return wc.status;
    }
}

// Binds (len > 0) or unbinds (len 0) `mw` over `len` bytes at `addr` of `mr`, through `qp`.
static enum ibv_wc_status bind(struct ibv_qp *qp, struct ibv_mw *mw, struct ibv_mr *mr, void *addr,
                               size_t len) {
    struct ibv_mw_bind b = {.wr_id = 100, .send_flags = IBV_SEND_SIGNALED};
    b.bind_info.mr = mr;
    b.bind_info.addr = (uint64_t)addr;
    b.bind_info.length = len;
    b.bind_info.mw_access_flags = len ? IBV_ACCESS_REMOTE_WRITE : 0;
    if (ibv_bind_mw(qp, mw, &b)) die("ibv_bind_mw");
    return wait_for(100);
}

// RDMA-writes 64 bytes from `src` to `raddr` under `rkey`, through a fresh
// connected pair whose target side is `target` (already bound from).
static enum ibv_wc_status write64(struct ibv_mr *src, uint64_t raddr, uint32_t rkey) {
    struct ibv_qp *a = make_qp(), *b = make_qp();
    connect_to(a, b->qp_num);
    connect_to(b, a->qp_num);
    struct ibv_sge sge = {.addr = (uint64_t)src->addr, .length = 64, .lkey = src->lkey};
    struct ibv_send_wr wr = {.wr_id = 7, .sg_list = &sge, .num_sge = 1,
                             .opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED};
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
    struct ibv_send_wr *bad;
    if (ibv_post_send(a, &wr, &bad)) die("ibv_post_send");
    enum ibv_wc_status s = wait_for(7);
    ibv_destroy_qp(a);
    ibv_destroy_qp(b);
    return s;
}

static int failures;

static void expect(const char *what, enum ibv_wc_status got, int ok) {
    int as_expected = ok ? got == IBV_WC_SUCCESS : got != IBV_WC_SUCCESS;
    printf("%-58s %s (%s)\n", what, ibv_wc_status_str(got), as_expected ? "as expected" : "WRONG");
    failures += !as_expected;
}

int main(int argc, char **argv) {
    const char *name = argc > 1 ? argv[1] : "rxe0";
    struct ibv_device **list = ibv_get_device_list(NULL);
    for (int i = 0; list && list[i]; i++)
        if (!strcmp(ibv_get_device_name(list[i]), name)) ctx = ibv_open_device(list[i]);
    if (!ctx) { fprintf(stderr, "no device %s\n", name); return 1; }
    pick_gid();
    if (!(pd = ibv_alloc_pd(ctx))) die("ibv_alloc_pd");
    if (!(cq = ibv_create_cq(ctx, 64, NULL, NULL, 0))) die("ibv_create_cq");
    static char dst[4096] __attribute__((aligned(4096))), src[4096] __attribute__((aligned(4096)));
    memset(src, 0x5a, sizeof src);
    struct ibv_mr *dmr = ibv_reg_mr(pd, dst, sizeof dst, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
    struct ibv_mr *smr = ibv_reg_mr(pd, src, sizeof src, IBV_ACCESS_LOCAL_WRITE);
    if (!dmr || !smr) die("ibv_reg_mr");
    struct ibv_mw *mw = ibv_alloc_mw(pd, IBV_MW_TYPE_1);
    if (!mw) die("ibv_alloc_mw");
    // The window is bound through a queue pair of its own (type 1 windows
    // belong to the protection domain, not to a queue pair).
    struct ibv_qp *binder = make_qp(), *peer = make_qp();
    connect_to(binder, peer->qp_num);
    connect_to(peer, binder->qp_num);
    expect("bind a window over bytes 1024..1088", bind(binder, mw, dmr, dst + 1024, 64), 1);
    uint32_t rkey = mw->rkey;
    expect("1. write through the window, inside it", write64(smr, (uint64_t)(dst + 1024), rkey), 1);
    int landed = dst[1024] == 0x5a && dst[1087] == 0x5a && dst[1023] == 0 && dst[1088] == 0;
    printf("%-58s %s\n", "   the bytes landed inside the window only", landed ? "yes" : "NO");
    failures += !landed;
    expect("2. write through the window, 64 bytes past it", write64(smr, (uint64_t)(dst + 1088), rkey), 0);
    printf("%-58s %s\n", "   bytes past the window changed", dst[1088] == 0x5a ? "YES" : "no");
    expect("3. write through the region's own rkey", write64(smr, (uint64_t)(dst + 1024), dmr->rkey), 0);
    expect("unbind the window", bind(binder, mw, dmr, dst, 0), 1);
    expect("4. write through the old window key after unbinding", write64(smr, (uint64_t)(dst + 1024), rkey), 0);
    printf(failures ? "mw: %d step(s) not as expected\n" : "mw: all as expected\n", failures);
    return failures != 0;
}
