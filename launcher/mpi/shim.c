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

/* The reduce-scatter ring's two message buffers (ring_reduce_scatter), kept between calls. */
static char *ring_buf;

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
  free(ring_buf);
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

/* acc[i] += own[i] for n elements of `kind`, as the MPI op of that kind sums them (the two
 * never overlap: acc is a ring buffer). */
static void add_into(void *acc, const void *own, int n, int kind) {
  if (kind == MT_BF16) {
    bf16_sum((void *)own, acc, &n, NULL);
  } else if (kind == MT_F32) {
    float *restrict a = (float *)acc;
    const float *restrict b = (const float *)own;
    for (int i = 0; i < n; i++) a[i] += b[i];
  } else {
    double *restrict a = (double *)acc;
    const double *restrict b = (const double *)own;
    for (int i = 0; i < n; i++) a[i] += b[i];
  }
}

#define RING_TAG 8

/* Elements per ring message: 2^20 (the ring's two buffers, 16 MiB at 8 bytes), or the
 * test hook MT_MPI_RING_CHUNK, so that small models' parts span several chunks. */
static long ring_chunk(void) {
  static long chunk = 0;
  if (chunk == 0) {
    const char *v = getenv("MT_MPI_RING_CHUNK");
    long c = v ? atol(v) : 0;
    chunk = c > 0 ? c : 1L << 20;
  }
  return chunk;
}

/* Elements of a part of `count` in the ring's chunk at `off` (0 past its end). */
static int chunk_len(long count, long off, long chunk) {
  long rest = count - off;
  return rest <= 0 ? 0 : (int)(rest < chunk ? rest : chunk);
}

/* Whether the reduce-scatter and the all-gather run over the rings below (the default) or
 * as MPI's own MPI_Reduce_scatter and MPI_Allgatherv (MT_MPI_RING=0, for comparison):
 * OpenMPI 4.1's reduce-scatter moves about 0.7 GB/s over shared memory, a third of its own
 * all-reduce, where the ring's messages are plain transfers and the sums are a pass of
 * this library's. */
static int use_ring(void) {
  static int ring = -1;
  if (ring < 0) {
    const char *v = getenv("MT_MPI_RING");
    ring = !(v && strcmp(v, "0") == 0);
  }
  return ring;
}

/* Reduce-scatter by sum over a ring, a chunk of every part at a time: in step s of
 * size - 1, rank r sends its running sum of part (r - s - 1) to rank r + 1 and receives
 * the running sum of part (r - s - 2) from rank r - 1, adding its own values; after the
 * last step it holds part r summed over every rank. Each element's sum runs in the same
 * order on every run (it depends on the ranks only), and only its owner keeps it. */
static int ring_reduce_scatter(const char *send, char *recv, const int *counts, int kind) {
  int size, rank, rc;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  size_t es = (size_t)elem_size(kind);
  long *displ = malloc(sizeof(long) * (size_t)size);
  if (!displ) return MPI_ERR_NO_MEM;
  long at = 0, longest = 0;
  for (int p = 0; p < size; p++) {
    displ[p] = at;
    at += counts[p];
    if (counts[p] > longest) longest = counts[p];
  }
  if (size == 1) {
    memmove(recv, send, es * (size_t)counts[0]);
    free(displ);
    return MPI_SUCCESS;
  }
  const long chunk = ring_chunk();
  if (!ring_buf && !(ring_buf = malloc(2 * (size_t)chunk * sizeof(double)))) {
    free(displ);
    return MPI_ERR_NO_MEM;
  }
  char *bufs[2] = {ring_buf, ring_buf + (size_t)chunk * sizeof(double)};
  int right = (rank + 1) % size, left = (rank + size - 1) % size;
  MPI_Datatype t = type_of(kind);
  rc = MPI_SUCCESS;
  for (long off = 0; off < longest && rc == MPI_SUCCESS; off += chunk) {
    int p_send = (rank + size - 1) % size;
    int n_send = chunk_len(counts[p_send], off, chunk);
    const char *out = send + es * (size_t)(displ[p_send] + (n_send ? off : 0));
    for (int s = 0; s < size - 1 && rc == MPI_SUCCESS; s++) {
      int p_recv = ((rank - s - 2) % size + size) % size;
      int n_recv = chunk_len(counts[p_recv], off, chunk);
      char *in = bufs[s % 2];
      rc = MPI_Sendrecv(out, n_send, t, right, RING_TAG, in, n_recv, t, left, RING_TAG,
                        MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) break;
      add_into(in, send + es * (size_t)(displ[p_recv] + (n_recv ? off : 0)), n_recv, kind);
      /* The last step's sum is part r: into recv, which may be send's own part r (read
       * just above, so an in-place reduce-scatter needs no copy of the buffer). */
      if (s == size - 2 && n_recv) memcpy(recv + es * (size_t)off, in, es * (size_t)n_recv);
      out = in;
      n_send = n_recv;
    }
  }
  free(displ);
  return rc;
}

/* Reduce-scatter by sum: rank r receives, in recv, the sum over ranks of
 * send[displ(r) .. displ(r) + counts[r]], where displ(r) = Σ counts[..r]. recv may be
 * that part of send itself (in place): the ring sums into it directly; MPI's
 * MPI_Reduce_scatter, which takes no such buffer, goes through a copy. */
int mt_mpi_reduce_scatter(const void *send, void *recv, const int *counts, int kind) {
  if (use_ring()) return ring_reduce_scatter(send, recv, counts, kind);
  int size, rank;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  size_t es = (size_t)elem_size(kind), total = 0;
  for (int p = 0; p < size; p++) total += (size_t)counts[p];
  const char *lo = send, *hi = lo + es * total, *at = recv;
  if (!(at >= lo && at < hi))
    return MPI_Reduce_scatter(send, recv, counts, type_of(kind), sum_of(kind), MPI_COMM_WORLD);
  void *sum = malloc(es * (size_t)(counts[rank] > 0 ? counts[rank] : 1));
  if (!sum) return MPI_ERR_NO_MEM;
  int rc = MPI_Reduce_scatter(send, sum, counts, type_of(kind), sum_of(kind), MPI_COMM_WORLD);
  if (rc == MPI_SUCCESS) memcpy(recv, sum, es * (size_t)counts[rank]);
  free(sum);
  return rc;
}

/* All-gather in place over a ring, a chunk of every part at a time: in step s of
 * size - 1, rank r sends part (r - s) to rank r + 1 and receives part (r - s - 1) from
 * rank r - 1, each straight from and into its place in buf. */
static int ring_allgather(char *buf, const int *counts, const int *displs, int kind) {
  int size, rank, rc = MPI_SUCCESS;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  size_t es = (size_t)elem_size(kind);
  long longest = 0, chunk = ring_chunk();
  for (int p = 0; p < size; p++)
    if (counts[p] > longest) longest = counts[p];
  int right = (rank + 1) % size, left = (rank + size - 1) % size;
  for (long off = 0; off < longest && rc == MPI_SUCCESS; off += chunk) {
    for (int s = 0; s < size - 1 && rc == MPI_SUCCESS; s++) {
      int p_send = ((rank - s) % size + size) % size;
      int p_recv = ((rank - s - 1) % size + size) % size;
      int n_send = chunk_len(counts[p_send], off, chunk);
      int n_recv = chunk_len(counts[p_recv], off, chunk);
      char *out = buf + es * (size_t)(displs[p_send] + (n_send ? off : 0));
      char *in = buf + es * (size_t)(displs[p_recv] + (n_recv ? off : 0));
      rc = MPI_Sendrecv(out, n_send, type_of(kind), right, RING_TAG, in, n_recv, type_of(kind),
                        left, RING_TAG, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    }
  }
  return rc;
}

/* All-gather in place: every rank's part buf[displs[r] .. + counts[r]] goes to all ranks. */
int mt_mpi_allgather_inplace(void *buf, const int *counts, const int *displs, int kind) {
  if (use_ring()) return ring_allgather(buf, counts, displs, kind);
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
  /* Each part summed into its place in buf (through a copy where MPI's own runs). */
  rc = mt_mpi_reduce_scatter(buf, (char *)buf + es * (size_t)displs[rank], counts, kind);
  if (rc == MPI_SUCCESS) rc = mt_mpi_allgather_inplace(buf, counts, displs, kind);
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
