/* libmt_mpi: the few MPI calls mt-launch makes, as plain C functions.
 *
 * Compiled by launcher/build.rs with the machine's own `mpicc` (OpenMPI or MPICH), so the
 * MPI implementation's C ABI (handle types, constants) stays on this side; mt-launch
 * dlopens this library only when it runs under mpirun, and a build without MPI works as
 * before. Every function returns an MPI error code (0 = MPI_SUCCESS) unless said otherwise.
 * Counts are elements; callers split buffers so that a count fits an int.
 */
#include <mpi.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Element types, as mt-launch numbers them. */
enum { MT_F32 = 0, MT_BF16 = 1, MT_F64 = 2 };

static MPI_Op bf16_sum_op = MPI_OP_NULL;

/* The arrival messages' requests and buffers (mt_mpi_arrive_start). */
static MPI_Request *arrive_recv, *arrive_send;
static int *arrive_in, arrive_out;

/* bf16 add: widen both (exact), add in f32, round to nearest even; NaN stays NaN. */
static void bf16_sum(void *in, void *inout, int *len, MPI_Datatype *dt) {
  (void)dt;
  const uint16_t *a = (const uint16_t *)in;
  uint16_t *b = (uint16_t *)inout;
  for (int i = 0; i < *len; i++) {
    uint32_t ua = (uint32_t)a[i] << 16, ub = (uint32_t)b[i] << 16;
    float fa, fb;
    memcpy(&fa, &ua, 4);
    memcpy(&fb, &ub, 4);
    float s = fa + fb;
    uint32_t us;
    memcpy(&us, &s, 4);
    if ((us & 0x7fffffffu) > 0x7f800000u) {
      b[i] = (uint16_t)((us >> 16) | 0x40u);
    } else {
      b[i] = (uint16_t)((us + 0x7fffu + ((us >> 16) & 1u)) >> 16);
    }
  }
}

static MPI_Datatype type_of(int kind) {
  switch (kind) {
  case MT_F32: return MPI_FLOAT;
  case MT_BF16: return MPI_UINT16_T;
  default: return MPI_DOUBLE;
  }
}

static MPI_Op sum_of(int kind) { return kind == MT_BF16 ? bf16_sum_op : MPI_SUM; }

static int elem_size(int kind) { return kind == MT_F32 ? 4 : kind == MT_BF16 ? 2 : 8; }

/* MPI_Init_thread asking for MPI_THREAD_MULTIPLE: a watchdog thread may call
 * mt_mpi_abort while the main thread waits in a collective. `provided` gets the level. */
int mt_mpi_init(int *rank, int *size, int *provided) {
  int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, provided);
  if (rc != MPI_SUCCESS) return rc;
  /* Errors come back as codes, to be reported with the rank and host. */
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  if ((rc = MPI_Op_create(bf16_sum, 1, &bf16_sum_op)) != MPI_SUCCESS) return rc;
  if ((rc = MPI_Comm_rank(MPI_COMM_WORLD, rank)) != MPI_SUCCESS) return rc;
  return MPI_Comm_size(MPI_COMM_WORLD, size);
}

int mt_mpi_finalize(void) {
  if (bf16_sum_op != MPI_OP_NULL) MPI_Op_free(&bf16_sum_op);
  free(arrive_recv);
  free(arrive_send);
  free(arrive_in);
  return MPI_Finalize();
}

/* Ends every rank of the job (never returns on success). */
int mt_mpi_abort(int code) { return MPI_Abort(MPI_COMM_WORLD, code); }

int mt_mpi_barrier(void) { return MPI_Barrier(MPI_COMM_WORLD); }

/* The processor name MPI reports (the host), NUL-terminated into buf of len bytes. */
int mt_mpi_processor_name(char *buf, int len) {
  char name[MPI_MAX_PROCESSOR_NAME];
  int n = 0;
  int rc = MPI_Get_processor_name(name, &n);
  if (rc != MPI_SUCCESS || len <= 0) return rc;
  if (n >= len) n = len - 1;
  memcpy(buf, name, (size_t)n);
  buf[n] = 0;
  return MPI_SUCCESS;
}

/* Reduce-scatter by sum: rank r receives, in recv, the sum over ranks of
 * send[displ(r) .. displ(r) + counts[r]], where displ(r) = Σ counts[..r]. */
int mt_mpi_reduce_scatter(const void *send, void *recv, const int *counts, int kind) {
  return MPI_Reduce_scatter(send, recv, counts, type_of(kind), sum_of(kind), MPI_COMM_WORLD);
}

/* All-gather in place: every rank's part buf[displs[r] .. + counts[r]] goes to all ranks. */
int mt_mpi_allgather_inplace(void *buf, const int *counts, const int *displs, int kind) {
  return MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, counts, displs,
                        type_of(kind), MPI_COMM_WORLD);
}

/* In-place sum over ranks whose result is the same bits on every rank: a reduce-scatter
 * (each part summed once, by its owner) then an all-gather of the parts. MPI_Allreduce
 * leaves the order of additions to the implementation, which may differ between ranks
 * (recursive doubling over 3 ranks does), and replicas fed different bits would drift. */
int mt_mpi_allreduce_same(void *buf, long count, int kind) {
  int size, rank, rc;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int *counts = malloc(sizeof(int) * (size_t)size * 2);
  if (!counts) return MPI_ERR_NO_MEM;
  int *displs = counts + size;
  long at = 0;
  for (int r = 0; r < size; r++) {
    long c = count / size + (r < count % size ? 1 : 0);
    counts[r] = (int)c;
    displs[r] = (int)at;
    at += c;
  }
  size_t es = (size_t)elem_size(kind);
  void *mine = malloc(es * (size_t)(counts[rank] > 0 ? counts[rank] : 1));
  if (!mine) {
    free(counts);
    return MPI_ERR_NO_MEM;
  }
  rc = MPI_Reduce_scatter(buf, mine, counts, type_of(kind), sum_of(kind), MPI_COMM_WORLD);
  if (rc == MPI_SUCCESS) {
    memcpy((char *)buf + es * (size_t)displs[rank], mine, es * (size_t)counts[rank]);
    rc = mt_mpi_allgather_inplace(buf, counts, displs, kind);
  }
  free(mine);
  free(counts);
  return rc;
}

/* Gather to rank 0: each rank's `mine` (counts[rank] elements) lands in rank 0's `all` at
 * displs[r]; `all` is used on rank 0 only. */
int mt_mpi_gather_root(const void *mine, void *all, const int *counts, const int *displs,
                       int kind) {
  int rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return MPI_Gatherv(mine, counts[rank], type_of(kind), all, counts, displs, type_of(kind), 0,
                     MPI_COMM_WORLD);
}

/* MPI's own all-reduce (sum), for the bandwidth figure beside ours. */
int mt_mpi_allreduce_sum(void *buf, long count, int kind) {
  return MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, type_of(kind), sum_of(kind),
                       MPI_COMM_WORLD);
}

/* recv[r * n .. (r + 1) * n] = rank r's send[0 .. n], on every rank. */
int mt_mpi_allgather_f64(const double *send, int n, double *recv) {
  return MPI_Allgather(send, n, MPI_DOUBLE, recv, n, MPI_DOUBLE, MPI_COMM_WORLD);
}

/* The largest of every rank's value. */
int mt_mpi_allreduce_max_i64(int64_t *value) {
  return MPI_Allreduce(MPI_IN_PLACE, value, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
}

/* Every rank's processor name, NUL-padded to len bytes each, in rank order into all. */
int mt_mpi_host_names(char *all, int len) {
  char *mine = calloc(1, (size_t)len);
  if (!mine) return MPI_ERR_NO_MEM;
  mt_mpi_processor_name(mine, len);
  int rc = MPI_Allgather(mine, len, MPI_CHAR, all, len, MPI_CHAR, MPI_COMM_WORLD);
  free(mine);
  return rc;
}

/* Arrival before a collective: each rank sends one int to every other and posts a receive
 * from each; mt_mpi_arrive_test says which ranks have arrived. A rank that does not arrive
 * can then be named, where a blocking collective would only wait. Messages between two
 * ranks match in order (MPI's non-overtaking rule), and every rank makes the same sequence
 * of collectives, so one tag serves. */
#define ARRIVE_TAG 7

int mt_mpi_arrive_start(void) {
  int size, rank, rc;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (!arrive_recv) {
    arrive_recv = malloc(sizeof(MPI_Request) * (size_t)size);
    arrive_send = malloc(sizeof(MPI_Request) * (size_t)size);
    arrive_in = malloc(sizeof(int) * (size_t)size);
    if (!arrive_recv || !arrive_send || !arrive_in) return MPI_ERR_NO_MEM;
  }
  for (int r = 0; r < size; r++) {
    arrive_recv[r] = arrive_send[r] = MPI_REQUEST_NULL;
    if (r == rank) continue;
    rc = MPI_Irecv(&arrive_in[r], 1, MPI_INT, r, ARRIVE_TAG, MPI_COMM_WORLD, &arrive_recv[r]);
    if (rc != MPI_SUCCESS) return rc;
    rc = MPI_Isend(&arrive_out, 1, MPI_INT, r, ARRIVE_TAG, MPI_COMM_WORLD, &arrive_send[r]);
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_SUCCESS;
}

/* arrived[r] = 1 for each rank r heard from since mt_mpi_arrive_start (and this one);
 * *all = 1 once every rank is, the sends then completed. */
int mt_mpi_arrive_test(int *arrived, int *all) {
  int size, rc;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  *all = 1;
  for (int r = 0; r < size; r++) {
    if (arrive_recv[r] != MPI_REQUEST_NULL) {
      int flag = 0;
      rc = MPI_Test(&arrive_recv[r], &flag, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) return rc;
    }
    arrived[r] = arrive_recv[r] == MPI_REQUEST_NULL;
    if (!arrived[r]) *all = 0;
  }
  if (!*all) return MPI_SUCCESS;
  /* One wait per send (MPI_Waitall with MPICH's MPI_STATUSES_IGNORE, a pointer constant,
   * draws a false -Wstringop-overflow from GCC). */
  for (int r = 0; r < size; r++) {
    rc = MPI_Wait(&arrive_send[r], MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_SUCCESS;
}

/* The text of an MPI error code, NUL-terminated into buf of len bytes. */
void mt_mpi_error_string(int code, char *buf, int len) {
  char s[MPI_MAX_ERROR_STRING];
  int n = 0;
  if (len <= 0) return;
  if (MPI_Error_string(code, s, &n) != MPI_SUCCESS) n = 0;
  if (n >= len) n = len - 1;
  memcpy(buf, s, (size_t)n);
  buf[n] = 0;
}
