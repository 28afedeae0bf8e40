/* The C ABI from C, under mpirun (tests/capi.rs builds it with mpicc against
 * capi/include/collectives.h and target/release/libcollectives_c.so, and
 * runs it at 2 and 4 ranks): every call x every datatype, in and out of
 * place, AllToAllv with uneven counts (zeros included), send/recv, split
 * into two groups used at once from two threads, a bad argument of each
 * kind (the communicator stays usable), groups (AllToAll as grouped
 * send/recv, a 256 MiB ring exchange, fused AllReduces, a departed peer
 * reported at collGroupEnd), a non-blocking communicator polled with
 * collCommGetAsyncError, any call as a collCall_t (collCall, and collStart
 * with requests: polled, waited for, with a callback, revoked), and an
 * abort from another thread while a call is blocked. Prints "capi ok" on
 * success. */
#include <math.h>
#include <mpi.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "collectives.h"

static int rank, nranks, failures;

#define EXPECT(cond, ...)                                                      \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "rank %d: %s:%d: ", rank, __FILE__, __LINE__);           \
      fprintf(stderr, __VA_ARGS__);                                            \
      fprintf(stderr, "\n");                                                   \
      failures++;                                                              \
    }                                                                          \
  } while (0)

#define CHECK(comm, call)                                                      \
  do {                                                                         \
    collResult_t r_ = (call);                                                  \
    if (r_ != collSuccess) {                                                   \
      fprintf(stderr, "rank %d: %s:%d: %s: %s: %s\n", rank, __FILE__,          \
              __LINE__, #call, collGetErrorString(r_),                         \
              collGetLastError(comm));                                         \
      MPI_Abort(MPI_COMM_WORLD, 1);                                            \
    }                                                                          \
  } while (0)

/* ---- elements of every datatype, through doubles (values stay exact) ---- */

static const collDataType_t DTYPES[] = {
    collInt8,    collUint8,   collInt32,   collUint32,  collInt64,
    collUint64,  collFloat16, collFloat32, collFloat64, collBfloat16};
static const char *DTYPE_NAMES[] = {"int8",   "uint8",   "int32", "uint32",
                                    "int64",  "uint64",  "half",  "float",
                                    "double", "bfloat16"};
#define NDTYPES (sizeof DTYPES / sizeof DTYPES[0])

static size_t elem_size(collDataType_t dt) {
  switch (dt) {
  case collInt8: case collUint8: return 1;
  case collFloat16: case collBfloat16: return 2;
  case collInt32: case collUint32: case collFloat32: return 4;
  default: return 8;
  }
}

static int is_float(collDataType_t dt) {
  return dt == collFloat16 || dt == collBfloat16 || dt == collFloat32 || dt == collFloat64;
}

static uint16_t to_half(float f) { /* normal numbers and zero, rounded */
  uint32_t x;
  memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000;
  if ((x & 0x7fffffff) == 0) return (uint16_t)sign;
  int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
  uint32_t h = sign | ((uint32_t)exp << 10) | ((x & 0x7fffff) >> 13);
  return (uint16_t)(h + ((x >> 12) & 1));
}

static float from_half(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, x;
  if (exp == 0) x = sign; /* zero (no subnormals here) */
  else x = sign | ((exp - 15 + 127) << 23) | ((uint32_t)(h & 0x3ff) << 13);
  float f;
  memcpy(&f, &x, 4);
  return f;
}

static void set(collDataType_t dt, void *buf, size_t i, double v) {
  switch (dt) {
  case collInt8: ((int8_t *)buf)[i] = (int8_t)v; break;
  case collUint8: ((uint8_t *)buf)[i] = (uint8_t)v; break;
  case collInt32: ((int32_t *)buf)[i] = (int32_t)v; break;
  case collUint32: ((uint32_t *)buf)[i] = (uint32_t)v; break;
  case collInt64: ((int64_t *)buf)[i] = (int64_t)v; break;
  case collUint64: ((uint64_t *)buf)[i] = (uint64_t)v; break;
  case collFloat16: ((uint16_t *)buf)[i] = to_half((float)v); break;
  case collFloat32: ((float *)buf)[i] = (float)v; break;
  case collFloat64: ((double *)buf)[i] = v; break;
  case collBfloat16: {
    float f = (float)v;
    uint32_t x;
    memcpy(&x, &f, 4);
    ((uint16_t *)buf)[i] = (uint16_t)(x >> 16);
    break;
  }
  }
}

static double get(collDataType_t dt, const void *buf, size_t i) {
  switch (dt) {
  case collInt8: return ((const int8_t *)buf)[i];
  case collUint8: return ((const uint8_t *)buf)[i];
  case collInt32: return ((const int32_t *)buf)[i];
  case collUint32: return ((const uint32_t *)buf)[i];
  case collInt64: return (double)((const int64_t *)buf)[i];
  case collUint64: return (double)((const uint64_t *)buf)[i];
  case collFloat16: return from_half(((const uint16_t *)buf)[i]);
  case collFloat32: return ((const float *)buf)[i];
  case collFloat64: return ((const double *)buf)[i];
  case collBfloat16: {
    uint32_t x = (uint32_t)((const uint16_t *)buf)[i] << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
  }
  }
  return NAN;
}

/* Rank r's element i: small integers, exact in every type and every sum. */
static double value(collRedOp_t op, int r, size_t i) {
  return op == collProd ? 1 + (r + i) % 2 : r + 1 + (double)(i % 3);
}

static double reduced(collDataType_t dt, collRedOp_t op, size_t i) {
  double acc = op == collProd ? 1 : op == collMin ? INFINITY : op == collMax ? -INFINITY : 0;
  for (int r = 0; r < nranks; r++) {
    double v = value(op, r, i);
    switch (op) {
    case collProd: acc *= v; break;
    case collMin: acc = fmin(acc, v); break;
    case collMax: acc = fmax(acc, v); break;
    default: acc += v;
    }
  }
  if (op == collAvg) acc = is_float(dt) ? acc / nranks : trunc(acc / nranks);
  return acc;
}

static void *fill(collDataType_t dt, size_t count, collRedOp_t op, int r) {
  void *buf = malloc(count * elem_size(dt) + 1);
  for (size_t i = 0; i < count; i++) set(dt, buf, i, value(op, r, i));
  return buf;
}

/* ---- the calls ---- */

#define COUNT 1003 /* odd: blocks of uneven chunks */
#define BIG_COUNT ((1 << 18) + 3) /* 256 KiB and more: past the shared flags */

static void test_allreduce(collComm_t comm, int d) {
  collDataType_t dt = DTYPES[d];
  for (collRedOp_t op = collSum; op <= collAvg; op++) {
    for (int in_place = 0; in_place < 2; in_place++) {
      void *send = fill(dt, COUNT, op, rank);
      void *recv = in_place ? send : malloc(COUNT * elem_size(dt));
      CHECK(comm, collAllReduce(send, recv, COUNT, dt, op, comm));
      for (size_t i = 0; i < COUNT; i++) {
        double got = get(dt, recv, i), want = reduced(dt, op, i);
        if (got != want) {
          EXPECT(0, "allreduce %s op %d in_place %d: [%zu] = %g, want %g",
                 DTYPE_NAMES[d], op, in_place, i, got, want);
          break;
        }
      }
      if (!in_place) free(recv);
      free(send);
    }
  }
}

/* Broadcasts small (through shared flags on one host) and large (over
 * shared memory, two halves read from the root's memory, the second
 * written by the root when it broadcasts in place), with every rank in
 * place, none, and each half of the ranks either way: NCCL lets a non-root
 * pass any sendbuff, so the root's form and its peers' may differ. */
static void test_broadcast_reduce(collComm_t comm, int d) {
  collDataType_t dt = DTYPES[d];
  int root = nranks - 1;
  size_t counts[2] = {COUNT, BIG_COUNT};
  for (int c = 0; c < 2; c++)
    for (int form = 0; form < 4; form++) {
      int in_place = form < 2 ? form : (rank + form) % 2;
      size_t n = counts[c];
      void *send = fill(dt, n, collSum, rank);
      void *recv = in_place ? send : malloc(n * elem_size(dt));
      CHECK(comm, collBroadcast(send, recv, n, dt, root, comm));
      for (size_t i = 0; i < n; i++)
        if (get(dt, recv, i) != value(collSum, root, i)) {
          EXPECT(0, "broadcast %s of %zu, form %d (in place here: %d): [%zu] wrong", DTYPE_NAMES[d], n,
                 form, in_place, i);
          break;
        }
      if (!in_place) free(recv);
      free(send);
    }
  /* Reduce to rank 0, recvbuff NULL elsewhere (NCCL allows it). */
  void *send = fill(dt, COUNT, collMax, rank);
  void *recv = rank == 0 ? malloc(COUNT * elem_size(dt)) : NULL;
  CHECK(comm, collReduce(send, recv, COUNT, dt, collMax, 0, comm));
  for (size_t i = 0; rank == 0 && i < COUNT; i++)
    if (get(dt, recv, i) != reduced(dt, collMax, i)) {
      EXPECT(0, "reduce %s: [%zu] wrong", DTYPE_NAMES[d], i);
      break;
    }
  for (size_t i = 0; i < COUNT; i++)
    if (get(dt, send, i) != value(collMax, rank, i)) {
      EXPECT(0, "reduce %s changed its sendbuff", DTYPE_NAMES[d]);
      break;
    }
  free(recv);
  free(send);
}

static void test_gather_scatter(collComm_t comm, int d) {
  collDataType_t dt = DTYPES[d];
  size_t es = elem_size(dt), all = COUNT * (size_t)nranks;
  for (int in_place = 0; in_place < 2; in_place++) {
    /* AllGather: in place, rank's block already sits at block `rank`. */
    char *recv = malloc(all * es);
    char *send = in_place ? recv + rank * COUNT * es : malloc(COUNT * es);
    for (size_t i = 0; i < COUNT; i++) set(dt, send, i, value(collSum, rank, i));
    CHECK(comm, collAllGather(send, recv, COUNT, dt, comm));
    for (size_t i = 0; i < all; i++)
      if (get(dt, recv, i) != value(collSum, (int)(i / COUNT), i % COUNT)) {
        EXPECT(0, "allgather %s in_place %d: [%zu] wrong", DTYPE_NAMES[d], in_place, i);
        break;
      }
    if (!in_place) free(send);
    free(recv);

    /* ReduceScatter: in place, the result lands at block `rank`. */
    char *whole = malloc(all * es);
    for (size_t i = 0; i < all; i++) set(dt, whole, i, value(collSum, rank, i));
    char *mine = in_place ? whole + rank * COUNT * es : malloc(COUNT * es);
    CHECK(comm, collReduceScatter(whole, mine, COUNT, dt, collSum, comm));
    for (size_t k = 0; k < COUNT; k++)
      if (get(dt, mine, k) != reduced(dt, collSum, rank * COUNT + k)) {
        EXPECT(0, "reducescatter %s in_place %d: [%zu] wrong", DTYPE_NAMES[d], in_place, k);
        break;
      }
    if (!in_place) free(mine);
    free(whole);
  }
}

/* What rank `from` sends rank `to` in the AllToAllv: uneven, some zero. */
static size_t pair_count(int from, int to) { return (size_t)((from + 2 * to) % 3 + to); }

static void test_alltoall(collComm_t comm, int d) {
  collDataType_t dt = DTYPES[d];
  size_t es = elem_size(dt), block = 7, all = block * (size_t)nranks;
  char *send = calloc(all, es), *recv = calloc(all, es);
  /* Element k of the block for rank j: 10 * j + k % 10 + rank (exact). */
  for (size_t i = 0; i < all; i++) set(dt, send, i, (double)(10 * (i / block) % 100 + i % block + rank));
  CHECK(comm, collAllToAll(send, recv, block, dt, comm));
  for (size_t i = 0; i < all; i++) {
    double want = (double)(10 * rank % 100 + i % block + i / block);
    if (get(dt, recv, i) != want) {
      EXPECT(0, "alltoall %s: [%zu] = %g, want %g", DTYPE_NAMES[d], i, get(dt, recv, i), want);
      break;
    }
  }
  free(send);
  free(recv);

  size_t sc[64], sd[64], rc[64], rd[64], st = 0, rt = 0;
  for (int j = 0; j < nranks; j++) {
    sc[j] = pair_count(rank, j), sd[j] = st, st += sc[j];
    rc[j] = pair_count(j, rank), rd[j] = rt, rt += rc[j];
  }
  send = malloc(st * es + 1);
  recv = malloc(rt * es + 1);
  for (int j = 0; j < nranks; j++)
    for (size_t k = 0; k < sc[j]; k++) set(dt, send, sd[j] + k, (double)(rank * 10 + j + k));
  CHECK(comm, collAllToAllv(send, sc, sd, recv, rc, rd, dt, comm));
  for (int j = 0; j < nranks; j++)
    for (size_t k = 0; k < rc[j]; k++)
      if (get(dt, recv, rd[j] + k) != (double)(j * 10 + rank + k)) {
        EXPECT(0, "alltoallv %s: block from %d [%zu] wrong", DTYPE_NAMES[d], j, k);
        j = nranks;
        break;
      }
  free(send);
  free(recv);
}

static void test_sendrecv(collComm_t comm, int d) {
  collDataType_t dt = DTYPES[d];
  int next = (rank + 1) % nranks, prev = (rank + nranks - 1) % nranks;
  void *out = fill(dt, COUNT, collSum, rank), *in = malloc(COUNT * elem_size(dt));
  if (rank % 2 == 0) {
    CHECK(comm, collSend(out, COUNT, dt, next, comm));
    CHECK(comm, collRecv(in, COUNT, dt, prev, comm));
  } else {
    CHECK(comm, collRecv(in, COUNT, dt, prev, comm));
    CHECK(comm, collSend(out, COUNT, dt, next, comm));
  }
  for (size_t i = 0; i < COUNT; i++)
    if (get(dt, in, i) != value(collSum, prev, i)) {
      EXPECT(0, "send/recv %s: [%zu] wrong", DTYPE_NAMES[d], i);
      break;
    }
  free(out);
  free(in);
}

/* ---- two groups at once ---- */

struct group_job {
  collComm_t comm;
  double want;
  int wrong;
};

static void *allreduce_loop(void *arg) {
  struct group_job *job = arg;
  int me;
  collCommUserRank(job->comm, &me);
  for (int round = 0; round < 20; round++) {
    double x[513];
    for (int i = 0; i < 513; i++) x[i] = rank;
    if (collAllReduce(x, x, 513, collFloat64, collSum, job->comm) != collSuccess) {
      job->wrong++;
      return NULL;
    }
    for (int i = 0; i < 513; i++) job->wrong += x[i] != job->want;
  }
  return NULL;
}

static void test_split(collComm_t comm) {
  collComm_t child = NULL, none = (collComm_t)1;
  /* Keys reverse the order: the highest parent rank is the child's rank 0. */
  CHECK(comm, collCommSplit(comm, rank % 2, -rank, &child));
  CHECK(comm, collCommSplit(comm, COLL_SPLIT_NOCOLOR, 0, &none));
  EXPECT(none == NULL, "COLL_SPLIT_NOCOLOR gave a communicator");
  int size, me, members = 0, below = 0;
  double child_sum = 0, parent_sum = 0;
  for (int r = 0; r < nranks; r++) {
    parent_sum += r;
    if (r % 2 == rank % 2) child_sum += r, members++, below += r > rank;
  }
  CHECK(child, collCommCount(child, &size));
  CHECK(child, collCommUserRank(child, &me));
  EXPECT(size == members && me == below, "child: rank %d of %d, want %d of %d", me, size, below, members);
  struct group_job jobs[2] = {{comm, parent_sum, 0}, {child, child_sum, 0}};
  pthread_t t;
  pthread_create(&t, NULL, allreduce_loop, &jobs[1]);
  allreduce_loop(&jobs[0]);
  pthread_join(t, NULL);
  EXPECT(jobs[0].wrong == 0 && jobs[1].wrong == 0, "groups at once: %d / %d wrong", jobs[0].wrong, jobs[1].wrong);
  CHECK(child, collCommDestroy(child));
}

/* ---- bad arguments: an error each, the communicator still usable ---- */

static void expect_invalid(collComm_t comm, collResult_t r, const char *what) {
  EXPECT(r == collInvalidArgument, "%s: got %s, want invalid argument", what, collGetErrorString(r));
  const char *last = collGetLastError(comm);
  EXPECT(last && strlen(last) > 0, "%s: no last error", what);
}

/* Buffers from collMemAlloc, which peers map: a large AllReduce in place
 * and an AllGather out of place, checked; then freeing. */
static void test_mem_alloc(collComm_t comm) {
  size_t count = BIG_COUNT * 3;
  float *buf, *all;
  CHECK(comm, collMemAlloc((void **)&buf, count * sizeof(float)));
  CHECK(comm, collMemAlloc((void **)&all, count * nranks * sizeof(float)));
  for (size_t i = 0; i < count; i++) buf[i] = (float)(rank + 1) * (float)(i % 97);
  CHECK(comm, collAllReduce(buf, buf, count, collFloat32, collSum, comm));
  float ranks_sum = (float)(nranks * (nranks + 1) / 2);
  for (size_t i = 0; i < count; i++)
    if (buf[i] != ranks_sum * (float)(i % 97)) {
      EXPECT(0, "allreduce of collMemAlloc memory: [%zu] = %g", i, buf[i]);
      break;
    }
  CHECK(comm, collAllGather(buf, all, count, collFloat32, comm));
  for (size_t i = 0; i < count * nranks; i++)
    if (all[i] != buf[i % count]) {
      EXPECT(0, "allgather of collMemAlloc memory: [%zu] = %g", i, all[i]);
      break;
    }
  CHECK(comm, collMemFree(buf));
  CHECK(comm, collMemFree(all));
  CHECK(comm, collMemFree(NULL));
  EXPECT(collMemFree(buf) == collInvalidArgument, "a second free is refused");
  EXPECT(collMemAlloc((void **)&buf, 0) == collInvalidArgument, "size 0 is refused");
  EXPECT(collMemAlloc(NULL, 64) == collInvalidArgument, "a NULL ptr is refused");
}

static void test_bad_arguments(collComm_t comm) {
  float x[8] = {0}, y[8 * 64];
  collComm_t out;
  int n;
  expect_invalid(NULL, collAllReduce(x, x, 8, collFloat32, collSum, NULL), "NULL comm");
  expect_invalid(comm, collAllReduce(x, x, 8, (collDataType_t)42, collSum, comm), "bad datatype");
  expect_invalid(comm, collAllReduce(x, x, 8, collFloat32, (collRedOp_t)17, comm), "bad op");
  expect_invalid(comm, collAllReduce(NULL, x, 8, collFloat32, collSum, comm), "NULL sendbuff");
  expect_invalid(comm, collBroadcast(x, x, 8, collFloat32, nranks, comm), "root out of range");
  expect_invalid(comm, collReduce(x, x, 8, collFloat32, collSum, -1, comm), "negative root");
  expect_invalid(comm, collSend(x, 8, collFloat32, nranks + 3, comm), "peer out of range");
  expect_invalid(comm, collRecv(x, 8, collFloat32, -2, comm), "negative peer");
  expect_invalid(comm, collSend(x, 8, collFloat32, rank, comm), "send to itself");
  expect_invalid(comm, collAllToAll(x, y, SIZE_MAX / 2, collFloat32, comm), "count overflow");
  expect_invalid(comm, collAllToAllv(x, NULL, NULL, y, NULL, NULL, collFloat32, comm), "NULL counts");
  expect_invalid(comm, collAllReduce((char *)x + 1, (char *)x + 1, 4, collFloat32, collSum, comm), "misaligned");
  expect_invalid(comm, collCommCount(comm, NULL), "NULL count");
  expect_invalid(NULL, collCommInitRank(&out, 2, (collUniqueId){{0}}, 0), "a unique id of zeros");
  EXPECT(strstr(collGetLastError(NULL), "unique id") != NULL, "init error: %s", collGetLastError(NULL));
  expect_invalid(NULL, collCommInitRank(NULL, 2, (collUniqueId){{0}}, 0), "NULL comm pointer");
  for (int r = 0; r <= 8; r++) EXPECT(collGetErrorString((collResult_t)r) != NULL, "error string %d", r);
  /* Still usable. */
  CHECK(comm, collCommCount(comm, &n));
  CHECK(comm, collAllReduce(x, x, 8, collFloat32, collSum, comm));
  CHECK(comm, collBarrier(comm));
}

/* ---- groups (collGroupStart / collGroupEnd) ---- */

static void test_groups(collComm_t comm) {
  /* AllToAll as nccl-tests writes it: a send and a receive per rank, itself
   * included, in one group; it must equal collAllToAll. */
  size_t block = 1000, all = block * (size_t)nranks;
  int32_t *send = malloc(all * 4), *want = malloc(all * 4), *got = calloc(all, 4);
  for (size_t i = 0; i < all; i++) send[i] = (int32_t)(rank * 1000000 + i);
  CHECK(comm, collAllToAll(send, want, block, collInt32, comm));
  CHECK(comm, collGroupStart());
  for (int r = 0; r < nranks; r++) {
    CHECK(comm, collSend(send + r * block, block, collInt32, r, comm));
    CHECK(comm, collRecv(got + r * block, block, collInt32, r, comm));
  }
  CHECK(comm, collGroupEnd());
  EXPECT(memcmp(got, want, all * 4) == 0, "grouped send/recv AllToAll differs from collAllToAll");
  free(send), free(want), free(got);

  /* A ring exchange of 256 MiB per rank in one group: every rank sends
   * before anyone receives (one call at a time would deadlock). */
  size_t big = (256u << 20) / 8;
  uint64_t *out = malloc(big * 8), *in = malloc(big * 8);
  for (size_t i = 0; i < big; i++) out[i] = (uint64_t)rank << 40 | i;
  int next = (rank + 1) % nranks, prev = (rank + nranks - 1) % nranks;
  double t0 = MPI_Wtime();
  CHECK(comm, collGroupStart());
  CHECK(comm, collGroupStart()); /* nested: the outermost end counts */
  CHECK(comm, collSend(out, big, collUint64, next, comm));
  CHECK(comm, collGroupEnd());
  CHECK(comm, collRecv(in, big, collUint64, prev, comm));
  CHECK(comm, collGroupEnd());
  double took = MPI_Wtime() - t0;
  for (size_t i = 0; i < big; i += 4099)
    if (in[i] != ((uint64_t)prev << 40 | i)) {
      EXPECT(0, "ring exchange: word %zu wrong", i);
      break;
    }
  if (rank == 0) printf("ring exchange of 256 MiB per rank in a group: %.3f s (%.2f GB/s per rank)\n", took, 256.0 * 1.048576e6 / took / 1e9);
  free(out), free(in);

  /* 100 small AllReduces in a group (fused into one) and a broadcast. */
  float *bufs[100];
  for (int k = 0; k < 100; k++) {
    bufs[k] = malloc(1024 * sizeof(float));
    for (int i = 0; i < 1024; i++) bufs[k][i] = (float)(rank + k);
  }
  int root_value = rank == 0 ? 42 : 0;
  CHECK(comm, collGroupStart());
  for (int k = 0; k < 100; k++) CHECK(comm, collAllReduce(bufs[k], bufs[k], 1024, collFloat32, collSum, comm));
  CHECK(comm, collBroadcast(&root_value, &root_value, 1, collInt32, 0, comm));
  CHECK(comm, collGroupEnd());
  for (int k = 0; k < 100; k++) {
    float want_k = (float)(nranks * (nranks - 1) / 2 + nranks * k);
    EXPECT(bufs[k][0] == want_k && bufs[k][1023] == want_k, "grouped allreduce %d: %g, want %g", k, bufs[k][0], want_k);
    free(bufs[k]);
  }
  EXPECT(root_value == 42, "grouped broadcast: %d", root_value);
  EXPECT(collGroupEnd() == collInvalidUsage, "collGroupEnd without collGroupStart");

  /* A dead peer inside a group is reported at collGroupEnd: in a child of
   * two ranks, rank 1 destroys its communicator; rank 0's group fails. */
  collComm_t pair = NULL;
  CHECK(comm, collCommSplit(comm, rank < 2 ? 0 : COLL_SPLIT_NOCOLOR, rank, &pair));
  if (rank == 1) {
    CHECK(pair, collCommDestroy(pair));
  } else if (rank == 0) {
    char b[1 << 16], c2[1 << 16];
    memset(b, 1, sizeof b);
    CHECK(pair, collGroupStart());
    CHECK(pair, collSend(b, sizeof b, collUint8, 1, pair));
    CHECK(pair, collRecv(c2, sizeof c2, collUint8, 1, pair));
    collResult_t r = collGroupEnd();
    EXPECT(r == collRemoteError, "group with a departed peer: %s (%s)", collGetErrorString(r), collGetLastError(pair));
    EXPECT(strstr(collGetLastError(pair), "peer rank 1") != NULL, "group error: %s", collGetLastError(pair));
    CHECK(NULL, collCommDestroy(pair));
  }
  CHECK(comm, collBarrier(comm));
}

/* ---- a non-blocking communicator ---- */

static void test_nonblocking(void) {
  collUniqueId id;
  if (rank == 0) CHECK(NULL, collGetUniqueId(&id));
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
  collConfig_t config = COLL_CONFIG_INITIALIZER;
  config.blocking = 0;
  collComm_t nb;
  CHECK(NULL, collCommInitRankConfig(&nb, nranks, id, rank, &config));
  size_t count = 4 << 20;
  float *x = malloc(count * sizeof(float));
  for (size_t i = 0; i < count; i++) x[i] = 1.0f;
  collResult_t r = collAllReduce(x, x, count, collFloat32, collSum, nb);
  EXPECT(r == collInProgress, "non-blocking allreduce returned %s", collGetErrorString(r));
  /* The host thread computes meanwhile, polling now and then. */
  long polls = 0;
  double busy = 0;
  collResult_t state;
  do {
    for (int i = 0; i < 100000; i++) busy += i * 1e-9;
    CHECK(nb, collCommGetAsyncError(nb, &state));
    polls++;
  } while (state == collInProgress);
  EXPECT(state == collSuccess, "async state %s: %s", collGetErrorString(state), collGetLastError(nb));
  EXPECT(x[0] == nranks && x[count - 1] == nranks, "non-blocking allreduce: %g", x[0]);
  if (rank == 0) printf("non-blocking allreduce of 16 MiB done after %ld polls (busy %.3f)\n", polls, busy);
  /* A group on it returns collInProgress too. */
  CHECK(nb, collGroupStart());
  r = collAllReduce(x, x, 8, collFloat32, collMax, nb);
  EXPECT(r == collSuccess, "recorded call: %s", collGetErrorString(r));
  r = collGroupEnd();
  EXPECT(r == collInProgress, "non-blocking group end: %s", collGetErrorString(r));
  do CHECK(nb, collCommGetAsyncError(nb, &state)); while (state == collInProgress);
  EXPECT(state == collSuccess, "async group: %s", collGetErrorString(state));
  free(x);
  CHECK(NULL, collCommDestroy(nb));
}

/* ---- any call as a collCall_t, started with a request ---- */

static volatile int done_flag;
static volatile collResult_t done_result = collInProgress;

static void on_done(void *arg, collResult_t result) {
  done_result = result;
  done_flag = *(int *)arg;
}

static void test_requests(collComm_t comm) {
  /* A 16 MiB AllReduce started with a request: polled while computing,
   * told by a callback, waited for. */
  size_t count = 4 << 20;
  float *x = malloc(count * sizeof(float));
  for (size_t i = 0; i < count; i++) x[i] = (float)(rank + 1);
  collCall_t call = {0};
  call.call = collCallAllReduce;
  call.sendbuff = x;
  call.recvbuff = x;
  call.count = count;
  call.datatype = collFloat32;
  call.op = collSum;
  collRequest_t req = NULL;
  CHECK(comm, collStart(comm, &call, &req));
  int tag = 7;
  done_flag = 0;
  CHECK(comm, collRequestOnDone(req, on_done, &tag));
  EXPECT(collRequestOnDone(req, on_done, &tag) == collInvalidArgument, "a second callback was taken");
  int done = 0;
  long polls = 0;
  do {
    CHECK(comm, collRequestTest(req, &done));
    polls++;
  } while (!done);
  EXPECT(collRequestWait(req, -1) == collSuccess, "request: %s", collRequestGetError(req));
  EXPECT(done_flag == 7 && done_result == collSuccess, "callback: %d, %s", done_flag, collGetErrorString(done_result));
  EXPECT(strcmp(collRequestGetError(req), "") == 0, "error of a success: %s", collRequestGetError(req));
  float want = (float)(nranks * (nranks + 1) / 2);
  EXPECT(x[0] == want && x[count - 1] == want, "started allreduce: %g, expected %g", x[0], want);
  CHECK(comm, collRequestFree(req));

  /* A ring of send and receive started together completes at any size. */
  size_t big = 8 << 20;
  unsigned char *out = malloc(big), *in = malloc(big);
  memset(out, rank + 1, big);
  collCall_t send = {0}, recv = {0};
  send.call = collCallSend;
  send.sendbuff = out;
  send.count = big;
  send.datatype = collUint8;
  send.peer = (rank + 1) % nranks;
  recv.call = collCallRecv;
  recv.recvbuff = in;
  recv.count = big;
  recv.datatype = collUint8;
  recv.peer = (rank + nranks - 1) % nranks;
  collRequest_t rs, rr;
  CHECK(comm, collStart(comm, &send, &rs));
  CHECK(comm, collStart(comm, &recv, &rr));
  EXPECT(collRequestWait(rr, -1) == collSuccess && collRequestWait(rs, -1) == collSuccess, "ring");
  EXPECT(in[0] == (unsigned char)((rank + nranks - 1) % nranks + 1) && in[big - 1] == in[0], "ring got %d", in[0]);
  CHECK(comm, collRequestFree(rs));
  CHECK(comm, collRequestFree(rr));
  free(out);
  free(in);

  /* collCall runs any call in place of its function. */
  float mine[2] = {(float)rank, (float)rank}, all[2 * 64];
  collCall_t gather = {0};
  gather.call = collCallAllGather;
  gather.sendbuff = mine;
  gather.recvbuff = all;
  gather.count = 2;
  gather.datatype = collFloat32;
  CHECK(comm, collCall(comm, &gather));
  for (int r = 0; r < nranks; r++) EXPECT(all[2 * r] == r && all[2 * r + 1] == r, "collCall allgather block %d: %g", r, all[2 * r]);

  /* Bad calls fail before anything starts. */
  collCall_t bad = gather;
  bad.call = 42;
  expect_invalid(comm, collStart(comm, &bad, &req), "collStart of call type 42");
  expect_invalid(comm, collStart(comm, &gather, NULL), "collStart without a request");
  expect_invalid(comm, collCall(comm, NULL), "collCall of NULL");

  /* A request on a call that cannot finish: not done within its time, then
   * ended by collCommRevoke (on a child, so comm stays whole); the peer hears. */
  collComm_t child;
  CHECK(comm, collCommSplit(comm, rank < 2 ? 0 : COLL_SPLIT_NOCOLOR, rank, &child));
  char byte;
  collCall_t lone = {0};
  lone.call = collCallRecv;
  lone.recvbuff = &byte;
  lone.count = 1;
  lone.datatype = collUint8;
  lone.peer = 1 - rank;
  collRequest_t r1 = NULL;
  if (rank < 2) {
    CHECK(child, collStart(child, &lone, &r1));
    EXPECT(collRequestWait(r1, 50) == collInProgress, "a receive nobody sends finished");
  }
  MPI_Barrier(MPI_COMM_WORLD); /* both have waited before rank 0 revokes */
  if (rank < 2) {
    if (rank == 0) CHECK(child, collCommRevoke(child, "revoked by the test"));
    collResult_t got = collRequestWait(r1, -1);
    const char *why = collRequestGetError(r1);
    EXPECT(got == (rank == 0 ? collInvalidUsage : collRemoteError) && strstr(why, "revoked by the test"),
           "after the revoke: %s: %s", collGetErrorString(got), why);
    CHECK(child, collRequestFree(r1));
    CHECK(NULL, collCommDestroy(child));
  }
  free(x);
  CHECK(comm, collBarrier(comm));
}

/* ---- a rank leaves: agree on who failed, shrink, go on ---- */

static void test_shrink(collComm_t comm) {
  /* On a child (all ranks, one color), so the main comm stays whole. The
   * last rank destroys its child: to the others it has failed. */
  collComm_t child, small;
  CHECK(comm, collCommSplit(comm, 0, rank, &child));
  if (rank == nranks - 1) {
    CHECK(NULL, collCommDestroy(child));
    return;
  }
  float x = 1.0f;
  collResult_t r = collAllReduce(&x, &x, 1, collFloat32, collSum, child);
  EXPECT(r == collRemoteError, "allreduce with a rank gone: %s", collGetErrorString(r));
  int failed[8], count = -1;
  CHECK(child, collCommGetFailedRanks(child, failed, 8, &count));
  EXPECT(count == 1 && failed[0] == nranks - 1, "failed ranks: %d (first %d)", count, failed[0]);
  int none = 0;
  EXPECT(collCommGetFailedRanks(child, failed, 0, &none) == collInvalidArgument && none == 1,
         "a capacity too small: count %d", none);
  CHECK(child, collCommShrink(child, failed, count, &small, NULL, COLL_SHRINK_ABORT));
  int size = 0, me = -1;
  CHECK(small, collCommCount(small, &size));
  CHECK(small, collCommUserRank(small, &me));
  EXPECT(size == nranks - 1 && me == rank, "shrunk: rank %d of %d", me, size);
  float y = (float)(rank + 1);
  CHECK(small, collAllReduce(&y, &y, 1, collFloat32, collSum, small));
  float want = (float)((nranks - 1) * nranks / 2);
  EXPECT(y == want, "allreduce after the shrink: %g, expected %g", y, want);
  CHECK(NULL, collCommDestroy(small));
  CHECK(NULL, collCommDestroy(child));
}

/* ---- abort from another thread ---- */

static void *abort_later(void *comm) {
  usleep(300 * 1000);
  collCommAbort(comm);
  return NULL;
}

static void test_abort(collComm_t comm) {
  /* Rank 0 waits for a message rank 1 never sends; a thread aborts it.
   * Every other rank waits on rank 0 and must hear of the abort. */
  char byte;
  CHECK(comm, collBarrier(comm));
  if (rank == 0) {
    pthread_t t;
    pthread_create(&t, NULL, abort_later, comm);
    collResult_t r = collRecv(&byte, 1, collUint8, 1, comm);
    pthread_join(t, NULL); /* comm is freed now */
    EXPECT(r == collInvalidUsage, "aborted recv: %s", collGetErrorString(r));
  } else {
    collResult_t r = collRecv(&byte, 1, collUint8, 0, comm);
    EXPECT(r == collRemoteError, "recv from the aborted rank: %s", collGetErrorString(r));
    const char *last = collGetLastError(comm);
    EXPECT(strstr(last, "peer rank 0") && strstr(last, "collCommAbort"), "last error: %s", last);
    CHECK(NULL, collCommDestroy(comm));
  }
  /* The handle is stale now (aborted on rank 0, destroyed elsewhere): every
   * use is refused by name, none is followed (a second destroy, a call, a
   * query, an abort). */
  int count = -1;
  collResult_t r = collCommDestroy(comm);
  EXPECT(r == collInvalidArgument, "second destroy: %s", collGetErrorString(r));
  EXPECT(strstr(collGetLastError(NULL), "not a live communicator"), "last error: %s",
         collGetLastError(NULL));
  r = collAllReduce(&byte, &byte, 1, collUint8, collSum, comm);
  EXPECT(r == collInvalidArgument, "call on a stale handle: %s", collGetErrorString(r));
  r = collCommCount(comm, &count);
  EXPECT(r == collInvalidArgument && count == -1, "count of a stale handle: %s",
         collGetErrorString(r));
  r = collCommAbort(comm);
  EXPECT(r == collInvalidArgument, "abort of a stale handle: %s", collGetErrorString(r));
  /* Communicators made and destroyed one after another (each likely at
   * the address the last one freed) never get a handle given before: a
   * stale handle never reaches a newer communicator. */
  collComm_t made[4];
  for (int k = 0; k < 4; k++) {
    collUniqueId id;
    if (rank == 0) CHECK(NULL, collGetUniqueId(&id));
    MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
    CHECK(NULL, collCommInitRank(&made[k], nranks, id, rank));
    for (int j = 0; j < k; j++) EXPECT(made[k] != made[j], "communicator %d got %d's handle", k, j);
    EXPECT(made[k] != comm, "communicator %d got the stale handle", k);
    CHECK(made[k], collCommDestroy(made[k]));
  }
  r = collCommCount(made[0], &count);
  EXPECT(r == collInvalidArgument && count == -1, "a destroyed handle after new ones: %s",
         collGetErrorString(r));
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &nranks);
  collUniqueId id;
  collComm_t comm;
  if (rank == 0) CHECK(NULL, collGetUniqueId(&id));
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
  CHECK(NULL, collCommInitRank(&comm, nranks, id, rank));
  for (size_t d = 0; d < NDTYPES; d++) {
    test_allreduce(comm, (int)d);
    test_broadcast_reduce(comm, (int)d);
    test_gather_scatter(comm, (int)d);
    test_alltoall(comm, (int)d);
    test_sendrecv(comm, (int)d);
  }
  test_mem_alloc(comm);
  test_split(comm);
  test_groups(comm);
  test_nonblocking();
  test_requests(comm);
  test_bad_arguments(comm);
  test_shrink(comm);
  test_abort(comm);
  int total;
  MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) printf(total ? "capi FAILED (%d)\n" : "capi ok\n", total);
  MPI_Finalize();
  return total != 0;
}
