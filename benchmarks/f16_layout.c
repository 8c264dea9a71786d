/* float16 weights at one row, two layouts, outside MAX: does the order of a
 * block's bytes in memory, not the kernel's arithmetic, hold float16's decode
 * step below float32's streaming rate? (benchmarks/README.md, "float16's
 * layout").
 *
 *   gcc -O3 -march=native -fopenmp benchmarks/f16_layout.c -o /tmp/f16_layout
 *   OMP_NUM_THREADS=2 /tmp/f16_layout 768 12 30      # gpt2-small's blocks, 30 rounds
 *
 * Weights: every layer's c_attn [3d, d], attn c_proj [d, d], c_fc [4d, d] and
 * mlp c_proj [d, 4d] (no head), each in huge-page-advised buffers. Every variant
 * multiplies four weight rows at a time, one 64-byte line of each row an
 * iteration, as `gpt2_max/kernels/mojo/skinny.mojo` does; each thread takes half
 * of each matrix's blocks of four rows, then waits at a barrier. The variants:
 *
 * - `f32 rows`: float32, row-major (the package's float32 layout), the next
 *   block's lines requested as it streams: the rate to hold float16 against.
 * - `f16 rows`: float16, row-major (the layout an F16 GGUF gives and the
 *   package keeps), the next block requested one or two blocks ahead.
 * - `f16 lines`: float16, each block of four rows stored line by line (row 0's
 *   first 32 values, row 1's, row 2's, row 3's, then every row's next 32), so a
 *   block is one sequential stream instead of four; requested 256 B, 1 KiB or
 *   2 KiB ahead.
 *
 * The variants run in turns within each round (drift hits them alike); every
 * float16 variant sums in the same order, so their outputs must agree exactly,
 * which the last line checks.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define HUGE (2u << 20)
#define LINE16 32 /* float16 values in a 64-byte line */

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *huge_alloc(size_t bytes) {
  size_t len = (bytes + HUGE - 1) / HUGE * HUGE;
  void *p = aligned_alloc(HUGE, len);
  madvise(p, len, MADV_HUGEPAGE);
  return p;
}

static void store4(float *y, int n0, __m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  y[n0] = _mm512_reduce_add_ps(a0);
  y[n0 + 1] = _mm512_reduce_add_ps(a1);
  y[n0 + 2] = _mm512_reduce_add_ps(a2);
  y[n0 + 3] = _mm512_reduce_add_ps(a3);
}

static void f32_rows(const float *w, const float *x, float *y, int n0, int K) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const float *r = w + (size_t)n0 * K;
  for (int k = 0; k < K; k += 16) {
    for (int j = 0; j < 4; j++) _mm_prefetch((const char *)(r + (4 + j) * K + k), _MM_HINT_T1);
    __m512 xv = _mm512_loadu_ps(x + k);
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(r + k), xv, a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(r + K + k), xv, a1);
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(r + 2 * K + k), xv, a2);
    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(r + 3 * K + k), xv, a3);
  }
  store4(y, n0, a0, a1, a2, a3);
}

/* 16 float16 values at p, widened to float32. */
#define WIDEN(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))

/* One line (32 values) of each of four rows at r[0..3] + k, into a0..a3. */
#define LINE4(r0, r1, r2, r3)                                         \
  do {                                                                \
    __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16); \
    a0 = _mm512_fmadd_ps(WIDEN(r0), x0, a0);                          \
    a0 = _mm512_fmadd_ps(WIDEN((r0) + 16), x1, a0);                   \
    a1 = _mm512_fmadd_ps(WIDEN(r1), x0, a1);                          \
    a1 = _mm512_fmadd_ps(WIDEN((r1) + 16), x1, a1);                   \
    a2 = _mm512_fmadd_ps(WIDEN(r2), x0, a2);                          \
    a2 = _mm512_fmadd_ps(WIDEN((r2) + 16), x1, a2);                   \
    a3 = _mm512_fmadd_ps(WIDEN(r3), x0, a3);                          \
    a3 = _mm512_fmadd_ps(WIDEN((r3) + 16), x1, a3);                   \
  } while (0)

static void f16_rows(const uint16_t *w, const float *x, float *y, int n0, int K, int ahead) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const uint16_t *r = w + (size_t)n0 * K;
  for (int k = 0; k < K; k += LINE16) {
    for (int j = 0; j < 4; j++)
      _mm_prefetch((const char *)(r + (4 * ahead + j) * K + k), _MM_HINT_T1);
    LINE4(r + k, r + K + k, r + 2 * K + k, r + 3 * K + k);
  }
  store4(y, n0, a0, a1, a2, a3);
}

static void f16_lines(const uint16_t *w, const float *x, float *y, int n0, int K, int ahead) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const uint16_t *b = w + (size_t)n0 * K;
  for (int k = 0; k < K; k += LINE16) {
    const uint16_t *p = b + 4 * k;
    for (int j = 0; j < 4; j++) _mm_prefetch((const char *)(p + j * LINE16) + ahead, _MM_HINT_T1);
    LINE4(p, p + LINE16, p + 2 * LINE16, p + 3 * LINE16);
  }
  store4(y, n0, a0, a1, a2, a3);
}

enum { F32_ROWS, F16_ROWS_1, F16_ROWS_2, F16_LINES_256, F16_LINES_1K, F16_LINES_2K, VARIANTS };
static const char *NAMES[VARIANTS] = {
    "f32 rows", "f16 rows, 1 block ahead", "f16 rows, 2 blocks ahead",
    "f16 lines, 256 B ahead", "f16 lines, 1 KiB ahead", "f16 lines, 2 KiB ahead"};

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s HIDDEN LAYERS ROUNDS\n", argv[0]);
    return 2;
  }
  int d = atoi(argv[1]), layers = atoi(argv[2]), rounds = atoi(argv[3]);
  if (d % LINE16) {
    fprintf(stderr, "HIDDEN must be a multiple of %d\n", LINE16);
    return 2;
  }
  int count = 4 * layers, outs = 0;
  int *Ns = malloc(count * sizeof(int)), *Ks = malloc(count * sizeof(int));
  float **w32 = malloc(count * sizeof(float *));
  uint16_t **w16 = malloc(count * sizeof(uint16_t *)), **w16l = malloc(count * sizeof(uint16_t *));
  size_t bytes32 = 0, bytes16 = 0;
  for (int i = 0; i < count; i++) {
    int part = i % 4;
    Ns[i] = (int[]){3 * d, d, 4 * d, d}[part];
    Ks[i] = part == 3 ? 4 * d : d;
    int N = Ns[i], K = Ks[i];
    size_t n = (size_t)N * K;
    w32[i] = huge_alloc(n * 4);
    w16[i] = huge_alloc(n * 2);
    w16l[i] = huge_alloc(n * 2);
    for (size_t j = 0; j < n; j++) {
      w16[i][j] = _cvtss_sh((float)((int)(j % 13) - 6) * 1e-2f, 0);
      w32[i][j] = _cvtsh_ss(w16[i][j]);
    }
    for (int n0 = 0; n0 < N; n0 += 4)  /* N is a multiple of 4 for every block matrix */
      for (int k = 0; k < K; k += LINE16)
        for (int j = 0; j < 4; j++)
          memcpy(w16l[i] + (size_t)n0 * K + 4 * k + j * LINE16,
                 w16[i] + (size_t)(n0 + j) * K + k, LINE16 * sizeof(uint16_t));
    bytes32 += n * 4;
    bytes16 += n * 2;
    if (N > outs) outs = N;
  }
  float *x = aligned_alloc(64, 4 * 4 * d);
  for (int k = 0; k < 4 * d; k++) x[k] = (float)(k % 7) * 1e-2f;
  float *ys[VARIANTS];
  for (int v = 0; v < VARIANTS; v++) ys[v] = calloc(outs, sizeof(float));
  double total[VARIANTS] = {0};
  for (int r = 0; r <= rounds; r++) {  /* round 0 warms up */
    for (int v = 0; v < VARIANTS; v++) {
      float *y = ys[v];
      double t0 = now();
#pragma omp parallel
      {
        int t = omp_get_thread_num(), T = omp_get_num_threads();
        for (int i = 0; i < count; i++) {
          int N = Ns[i], K = Ks[i], blocks = N / 4;
          int b0 = blocks * t / T * 4, b1 = blocks * (t + 1) / T * 4;
          for (int n = b0; n < b1; n += 4) {
            switch (v) {
              case F32_ROWS: f32_rows(w32[i], x, y, n, K); break;
              case F16_ROWS_1: f16_rows(w16[i], x, y, n, K, 1); break;
              case F16_ROWS_2: f16_rows(w16[i], x, y, n, K, 2); break;
              case F16_LINES_256: f16_lines(w16l[i], x, y, n, K, 256); break;
              case F16_LINES_1K: f16_lines(w16l[i], x, y, n, K, 1024); break;
              default: f16_lines(w16l[i], x, y, n, K, 2048); break;
            }
          }
#pragma omp barrier
        }
      }
      if (r > 0) total[v] += now() - t0;
    }
  }
  for (int v = 0; v < VARIANTS; v++) {
    size_t bytes = v == F32_ROWS ? bytes32 : bytes16;
    double mean = total[v] / rounds;
    printf("%-26s %5.0f MB  mean %7.2f ms  %5.1f GB/s  %.2f of f32's rate\n", NAMES[v],
           bytes / 1e6, mean * 1e3, bytes / mean / 1e9,
           (bytes / mean) / (bytes32 / (total[F32_ROWS] / rounds)));
  }
  int same = 1;
  for (int v = F16_ROWS_2; v < VARIANTS; v++)
    same &= memcmp(ys[v], ys[F16_ROWS_1], outs * sizeof(float)) == 0;
  printf("d=%d layers=%d threads=%d; float16 variants' outputs %s\n", d, layers,
         omp_get_max_threads(), same ? "identical" : "DIFFER");
  return !same;
}
