/* The float32 decode step's projections, one row, outside MAX: how fast this
 * machine streams them when nothing but an OpenMP barrier sits between two
 * projections. A ceiling to hold `bench_step.py`'s chain against, not a peer
 * engine (benchmarks/README.md, "The float32 ceiling").
 *
 *   gcc -O3 -march=native -fopenmp benchmarks/gemv_ceiling.c -o /tmp/gemv_ceiling
 *   OMP_NUM_THREADS=2 /tmp/gemv_ceiling 768 12 30     # gpt2-small shape, 30 rounds
 *   OMP_NUM_THREADS=2 /tmp/gemv_ceiling 1280 36 8     # gpt2-large shape
 *
 * Weights: every layer's c_attn [3d, d], attn c_proj [d, d], c_fc [4d, d] and
 * mlp c_proj [d, 4d], then the head [50257, d], each [N, K] row-major in its own
 * huge-page-advised buffer as the package holds them. Each thread takes half of
 * each matrix's rows (`matvec`: four rows at a time, one 64-byte line of each
 * row per iteration, the next four rows' lines prefetched, the access pattern
 * of `gpt2_max/kernels/mojo/skinny.mojo` at one row), then waits at a barrier.
 * `read` streams the same bytes with no arithmetic and a prefetch 1 KiB ahead:
 * what the memory gives a plain sequential read with the same barriers.
 * Written with GCC's vector types (16 floats, a cache line): one AVX-512
 * register each on the Xeons and Zen 4, two AVX2 registers on a Zen 3.
 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

#define HUGE (2u << 20)

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

static float sum16(const v16 *v) {
  float s = 0;
  for (int i = 0; i < 16; i++) s += (*v)[i];
  return s;
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void matvec4(const float *w, const float *x, float *y, int n0, int K, int N) {
  v16 a0 = {0}, a1 = a0, a2 = a0, a3 = a0;
  const float *r0 = w + (size_t)n0 * K, *r1 = r0 + K, *r2 = r1 + K, *r3 = r2 + K;
  for (int k = 0; k < K; k += 16) {
    if (n0 + 8 <= N) {
      __builtin_prefetch(r0 + 4 * K + k, 0, 2);
      __builtin_prefetch(r1 + 4 * K + k, 0, 2);
      __builtin_prefetch(r2 + 4 * K + k, 0, 2);
      __builtin_prefetch(r3 + 4 * K + k, 0, 2);
    }
    v16 xv = *(const v16u *)(x + k);
    a0 += *(const v16u *)(r0 + k) * xv;
    a1 += *(const v16u *)(r1 + k) * xv;
    a2 += *(const v16u *)(r2 + k) * xv;
    a3 += *(const v16u *)(r3 + k) * xv;
  }
  y[n0] = sum16(&a0);
  y[n0 + 1] = sum16(&a1);
  y[n0 + 2] = sum16(&a2);
  y[n0 + 3] = sum16(&a3);
}

static float read_stream(const float *a, size_t begin, size_t end) {
  v16 s0 = {0}, s1 = s0, s2 = s0, s3 = s0;
  for (size_t i = begin; i + 64 <= end; i += 64) {
    const char *p = (const char *)(a + i) + 1024;
    __builtin_prefetch(p, 0, 3);
    __builtin_prefetch(p + 64, 0, 3);
    __builtin_prefetch(p + 128, 0, 3);
    __builtin_prefetch(p + 192, 0, 3);
    s0 += *(const v16 *)(a + i);
    s1 += *(const v16 *)(a + i + 16);
    s2 += *(const v16 *)(a + i + 32);
    s3 += *(const v16 *)(a + i + 48);
  }
  v16 s = s0 + s1 + s2 + s3;
  return sum16(&s);
}

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s HIDDEN LAYERS ROUNDS\n", argv[0]);
    return 2;
  }
  int d = atoi(argv[1]), layers = atoi(argv[2]), rounds = atoi(argv[3]);
  int count = 4 * layers + 1;
  int *Ns = malloc(count * sizeof(int)), *Ks = malloc(count * sizeof(int));
  float **ws = malloc(count * sizeof(float *));
  size_t bytes = 0;
  for (int i = 0; i < count; i++) {
    int part = i % 4;
    Ns[i] = i == count - 1 ? 50257 : (int[]){3 * d, d, 4 * d, d}[part];
    Ks[i] = i == count - 1 ? d : (part == 3 ? 4 * d : d);
    size_t n = (size_t)Ns[i] * Ks[i], len = (n * 4 + HUGE - 1) / HUGE * HUGE;
    ws[i] = aligned_alloc(HUGE, len);
    madvise(ws[i], len, MADV_HUGEPAGE);
    for (size_t j = 0; j < n; j++) ws[i][j] = (float)(j % 13) * 1e-3f;
    bytes += n * 4;
  }
  float *x = aligned_alloc(64, 4 * 4 * d), *y = aligned_alloc(64, 4 * 50304);
  for (int k = 0; k < 4 * d; k++) x[k] = (float)(k % 7) * 1e-2f;
  const char *names[2] = {"matvec", "read"};
  for (int mode = 0; mode < 2; mode++) {
    double best = 1e9, total = 0;
    float sink = 0;
    for (int r = 0; r <= rounds; r++) {  // round 0 warms up
      double t0 = now();
#pragma omp parallel reduction(+ : sink)
      {
        int t = omp_get_thread_num(), T = omp_get_num_threads();
        for (int i = 0; i < count; i++) {
          int N = Ns[i], K = Ks[i], blocks = N / 4;
          int b0 = blocks * t / T * 4, b1 = blocks * (t + 1) / T * 4;
          if (mode == 0) {
            for (int n = b0; n < b1; n += 4) matvec4(ws[i], x, y, n, K, N);
            if (t == T - 1)
              for (int n = blocks * 4; n < N; n++) {  // the rows past the last four
                float s = 0;
                for (int k = 0; k < K; k++) s += ws[i][(size_t)n * K + k] * x[k];
                y[n] = s;
              }
          } else {
            sink += read_stream(ws[i], (size_t)b0 * K, (size_t)b1 * K);
          }
#pragma omp barrier
        }
      }
      double dt = now() - t0;
      if (r > 0) {
        total += dt;
        if (dt < best) best = dt;
      }
    }
    double mean = total / rounds;
    printf("%-6s d=%d layers=%d threads=%d: %.0f MB, mean %.2f ms (%.1f GB/s), best %.2f ms (%.1f GB/s) [%g]\n",
           names[mode], d, layers, omp_get_max_threads(), bytes / 1e6, mean * 1e3,
           bytes / mean / 1e9, best * 1e3, bytes / best / 1e9, mode ? sink : y[1]);
  }
  return 0;
}
