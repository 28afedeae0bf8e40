/* AllReduce from C, the way nccl-tests sets NCCL up: rank 0 makes a unique
 * id, MPI_Bcast hands it to every rank, each joins with collCommInitRank.
 *
 *   cargo build --release -p collectives-c
 *   mpicc capi/examples/allreduce_mpi.c -I capi/include -L target/release \
 *         -lcollectives_c -Wl,-rpath,$PWD/target/release -o allreduce_mpi
 *   mpirun -n 4 ./allreduce_mpi
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

#include "collectives.h"

#define COLL_CHECK(call)                                                       \
  do {                                                                         \
    collResult_t r_ = (call);                                                  \
    if (r_ != collSuccess) {                                                   \
      fprintf(stderr, "%s failed: %s: %s\n", #call, collGetErrorString(r_),    \
              collGetLastError(comm));                                         \
      MPI_Abort(MPI_COMM_WORLD, 1);                                            \
    }                                                                          \
  } while (0)

int main(int argc, char **argv) {
  int rank, nranks;
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &nranks);

  collComm_t comm = NULL;
  collUniqueId id;
  if (rank == 0) COLL_CHECK(collGetUniqueId(&id));
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
  COLL_CHECK(collCommInitRank(&comm, nranks, id, rank));

  size_t count = 1 << 20;
  float *grads = malloc(count * sizeof *grads);
  for (size_t i = 0; i < count; i++) grads[i] = (float)rank;
  /* In place: sendbuff == recvbuff, as in NCCL. */
  COLL_CHECK(collAllReduce(grads, grads, count, collFloat32, collAvg, comm));
  float want = (nranks - 1) / 2.0f;
  int wrong = 0;
  for (size_t i = 0; i < count; i++) wrong += grads[i] != want;
  printf("rank %d of %d: averaged %zu floats, %d wrong\n", rank, nranks, count, wrong);

  free(grads);
  COLL_CHECK(collCommDestroy(comm));
  MPI_Finalize();
  return wrong != 0;
}
