// A bfloat16 matrix product for few rows, as an XLA FFI custom call: what a bfloat16 model's
// decode step is made of on the CPU (jaxinfer.native.bf16_matmul).
//
// out [M, N] float32 = x [M, K] bfloat16 . w, with w either [K, N] ("kn": every projection of the
// model) or [N, K] ("nk": a tied LM head, the embedding table). Products are summed in float32.
//
// Why it exists: XLA CPU has no fast bfloat16 matrix-vector product. A [1, 1024] x [1024, 5632]
// product read its weights at ~1.4 GB/s here, against ~25 GB/s for the same product in float32
// (WORKSPACE.md, 2026-12-01), so a bfloat16 model decoded ~10x slower than a float32 one though it
// reads half the bytes. This kernel streams the weights once, converting 16 at a time to float32
// in registers, and is bound by memory bandwidth at the few rows of a decode step.
// Where the CPU has AMX, 9..64 rows run on its tiles instead (the AMX path, below), or on AVX-512
// BF16 dot products. Without AVX-512 (AMD Zen 3) the same loops run in AVX2's 8-lane vectors, and
// 9..64 rows of "kn" in column strips (avx2_kn_strip) in the few-row path's order; with AVX-512 but
// neither AMX nor its BF16 dot products, the same strips in 16 lanes (avx512_kn_strip).
//
// Work is split into blocks of output columns ("kn") or rows of w ("nk"), taken from one atomic
// counter by the calling thread and by tasks on XLA's intra-op thread pool. Every output element is
// summed in the same order whatever M, the block it falls in or the thread that computes it: "kn"
// in k order, one fused multiply-add at a time; "nk" in 16 lanes (lane = k mod 16), each in k order,
// then the lanes in a fixed tree. So a row's result does not depend on the other rows of its batch.
//
// The same file holds the float32 product on weights stored in column strips (jaxinfer.native
// .f32_matmul, "the float32 strips" below): a float32 model's every product, at any M, where the
// CPU has AVX-512 or AVX2.

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define JAXINFER_AVX2 1  // the few-row loops in 8-lane vectors, where there is no AVX-512 (AMD Zen 3)
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__linux__)
#define JAXINFER_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define JAXINFER_DOT 1
#endif
#if defined(JAXINFER_AMX) || defined(JAXINFER_DOT)
#define JAXINFER_WIDE 1
#endif
#if defined(__AVX512F__) && !defined(JAXINFER_DOT)
// 9..64 rows of "kn" in column strips, the few-row path's bits, where AVX-512 has no bfloat16 dot
// products (an Intel Xeon whose VM shows neither AMX nor AVX-512 BF16): the last wide path.
#define JAXINFER_AVX512 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Problem {
  const uint16_t* x = nullptr;  // [M, K]
  const uint16_t* w = nullptr;  // [K, N] or [N, K]
  float* out = nullptr;         // [M, N]
  float* partials = nullptr;    // "kn": [chunks, M, N], one sum per chunk of kChunkRows rows of w
  int64_t M = 0, K = 0, N = 0;
  bool kn = true;
  int64_t block = 0;  // "nk": rows of w per work item
  int64_t items = 0;
  // The wide paths (AMX tiles or AVX-512 BF16 dot products): x zero-padded to [Mp, Kp] ("kn") or
  // packed in pairs of k as [Kp/2][Mp][2] ("nk"), Mp and Kp rounded up to 16 rows and 32 columns.
  enum class Wide { kNone, kAmx, kDot, kAvx2, kAvx512, kF32Strips } wide = Wide::kNone;
  const uint16_t* xp = nullptr;
  int64_t Mp = 0, Kp = 0;
  const float* xf = nullptr;  // the AVX2 and AVX-512 strips' "kn": x in float32, [M, K]; the float32 strips' x
  const float* wf = nullptr;  // the float32 strips' w: [N / kF32StripCols][K][kF32StripCols]
};

struct Shared {
  Problem problem;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;  // guards nothing but the wake-up of the calling thread: see run()
  std::condition_variable all_done;
};

// "kn" splits w into chunks of this many rows: each work item streams one chunk (contiguous in
// memory) into its own partial sums, and the chunks' sums are then added in chunk order. The chunk
// size depends on nothing but this constant, so neither M nor the thread count changes a sum.
constexpr int64_t kChunkRows = 64;
// Rows of w asked for this far ahead of the four being read: ~13% faster from memory than the
// hardware prefetcher alone (median step 12.2-13.4 against 13.7-15.8 ms for the 150M Llama's 246 MB
// of bfloat16 products, three alternating pairs, 2026-12-01); 16 rows ahead was slower.
constexpr int64_t kPrefetchRows = 8;
// Products of fewer weights than this run on the calling thread only: a dependent chain of [1024,
// 256] products (k and v of a layer) took 25 against 45 us per call with a helper (2026-12-02).
constexpr int64_t kSmallProduct = 1 << 19;
// Columns of w a pass of "kn" covers where M > 1 (x rows' partial sums for them: 16 KB at 8 rows).
constexpr int64_t kColBlock = 512;
// Rows of w one pass of "kn" reads together: each pass loads and stores the partial sums once.
constexpr int64_t kPassRows = 8;
constexpr int64_t kLanes = 16;
// Rows of x a wide path takes, where there is one: from kWideMinRows (below it the AVX-512 loops
// are faster: the whole 150M model's products took 10 ms at one row there, AMX tiles ~24 ms at 16)
// to kWideMaxRows (a decode step's largest bucket; prompts go to XLA; the AVX-512 strips take more,
// kAvx512MaxRows). jaxinfer.native reads both.
constexpr int64_t kWideMinRows = 9;
constexpr int64_t kWideMaxRows = 64;

inline float bf16_to_f32(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

#if defined(__AVX512F__)
inline __m512 load_bf16x16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif
#if defined(JAXINFER_AVX2)
constexpr int64_t kHalf = 8;  // an AVX2 vector's float32 lanes: half of kLanes

inline __m256 load_bf16x8(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// The 16 lanes lo (0..7) and hi (8..15) added in the scalar fallback's tree (nk_block): lane l plus
// lane l + 8, then + 4, + 2, + 1. So the AVX2 loops give that fallback's bits.
inline float reduce_lanes(__m256 lo, __m256 hi) {
  const __m256 s8 = _mm256_add_ps(lo, hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#endif

// acc[m, :] += x[m, k0 + r] * w[k0 + r, :] for r in [0, rows), one fused multiply-add per row in
// row order; acc [M, N] float32.
void kn_chunk(const Problem& p, int64_t k0, int64_t rows, float* acc) {
  const int64_t M = p.M, K = p.K, N = p.N;
  thread_local std::vector<float> xf;
  xf.resize(M * rows);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t r = 0; r < rows; ++r) xf[m * rows + r] = bf16_to_f32(p.x[m * K + k0 + r]);
  }
  std::fill(acc, acc + M * N, 0.0f);
  // Several rows of x: a block of columns at a time, so that its partial sums stay in L1 across the
  // chunk's passes (the whole [M, N] round-tripped through L2 once per pass).
  const int64_t width = M > 1 ? kColBlock : N;
  for (int64_t c0 = 0; c0 < N; c0 += width) {
    const int64_t c1 = std::min(N, c0 + width);
    [[maybe_unused]] const int64_t body = std::min(c1, N - N % kLanes);
    int64_t r = 0;
    for (; r + kPassRows <= rows; r += kPassRows) {
      const uint16_t* w0 = p.w + (k0 + r) * N;
      const bool prefetch = k0 + r + kPrefetchRows + kPassRows <= K;  // into the next chunk too
      int64_t j = c0;
#if defined(__AVX512F__)
      // Two vectors of columns at a time where M > 1, so each row of x's broadcasts serve both.
      for (; M > 1 && j + 2 * kLanes <= body; j += 2 * kLanes) {
        if (prefetch) {  // one 64-byte line of each row of the pass
          const char* ahead = reinterpret_cast<const char*>(w0 + kPrefetchRows * N + j);
          for (int64_t i = 0; i < kPassRows; ++i) _mm_prefetch(ahead + i * N * sizeof(uint16_t), _MM_HINT_T0);
        }
        __m512 v[kPassRows], u[kPassRows];
        for (int64_t i = 0; i < kPassRows; ++i) {
          v[i] = load_bf16x16(w0 + i * N + j);
          u[i] = load_bf16x16(w0 + i * N + j + kLanes);
        }
        for (int64_t m = 0; m < M; ++m) {
          const float* xm = xf.data() + m * rows + r;
          float* a = acc + m * N + j;
          __m512 s = _mm512_loadu_ps(a), t = _mm512_loadu_ps(a + kLanes);
          for (int64_t i = 0; i < kPassRows; ++i) {
            const __m512 xi = _mm512_set1_ps(xm[i]);
            s = _mm512_fmadd_ps(xi, v[i], s);
            t = _mm512_fmadd_ps(xi, u[i], t);
          }
          _mm512_storeu_ps(a, s);
          _mm512_storeu_ps(a + kLanes, t);
        }
      }
      for (; j < body; j += kLanes) {
        if (prefetch && (j & 31) == 0) {  // once per 64-byte line of each row of the pass
          const char* ahead = reinterpret_cast<const char*>(w0 + kPrefetchRows * N + j);
          for (int64_t i = 0; i < kPassRows; ++i) _mm_prefetch(ahead + i * N * sizeof(uint16_t), _MM_HINT_T0);
        }
        __m512 v[kPassRows];
        for (int64_t i = 0; i < kPassRows; ++i) v[i] = load_bf16x16(w0 + i * N + j);
        for (int64_t m = 0; m < M; ++m) {
          const float* xm = xf.data() + m * rows + r;
          float* a = acc + m * N + j;
          __m512 s = _mm512_loadu_ps(a);
          for (int64_t i = 0; i < kPassRows; ++i) s = _mm512_fmadd_ps(_mm512_set1_ps(xm[i]), v[i], s);
          _mm512_storeu_ps(a, s);
        }
      }
#elif defined(JAXINFER_AVX2)
      // AVX2 has half the registers, of half the width: one vector of 8 columns per row of the pass.
      for (; j + kHalf <= c1; j += kHalf) {
        if (prefetch && (j & 31) == 0) {
          const char* ahead = reinterpret_cast<const char*>(w0 + kPrefetchRows * N + j);
          for (int64_t i = 0; i < kPassRows; ++i) _mm_prefetch(ahead + i * N * sizeof(uint16_t), _MM_HINT_T0);
        }
        __m256 v[kPassRows];
        for (int64_t i = 0; i < kPassRows; ++i) v[i] = load_bf16x8(w0 + i * N + j);
        for (int64_t m = 0; m < M; ++m) {
          const float* xm = xf.data() + m * rows + r;
          float* a = acc + m * N + j;
          __m256 s = _mm256_loadu_ps(a);
          for (int64_t i = 0; i < kPassRows; ++i) s = _mm256_fmadd_ps(_mm256_set1_ps(xm[i]), v[i], s);
          _mm256_storeu_ps(a, s);
        }
      }
#endif
      for (; j < c1; ++j) {
        for (int64_t m = 0; m < M; ++m) {
          const float* xm = xf.data() + m * rows + r;
          float& a = acc[m * N + j];
          for (int64_t i = 0; i < kPassRows; ++i) a = std::fma(xm[i], bf16_to_f32(w0[i * N + j]), a);
        }
      }
    }
    for (; r < rows; ++r) {
      const uint16_t* wr = p.w + (k0 + r) * N;
      for (int64_t j = c0; j < c1; ++j) {
        const float f = bf16_to_f32(wr[j]);
        for (int64_t m = 0; m < M; ++m) acc[m * N + j] = std::fma(xf[m * rows + r], f, acc[m * N + j]);
      }
    }
  }
}

#if defined(__AVX512F__)
// nk_block's sums for rows [m0, m0 + G) of x (G <= 8) and rows [n, n + R) of w, K a multiple of 16: the same
// chains, R rows of w at a time (G x R <= 16 accumulators), so that few rows of x keep several FMA
// chains in flight and each loaded piece of x serves R rows of w. A tied head [32000, 1024] at 2, 4
// rows: 2.50 -> 2.08, 3.67 -> 2.46 ms (2026-12-02).
template <int G, int R>
void nk_rows(const Problem& p, const float* xf, int64_t m0, int64_t n) {
  const int64_t K = p.K, N = p.N;
  const uint16_t* wn = p.w + n * K;
  xf += m0 * K;
  __m512 s[R][G];
  for (int j = 0; j < R; ++j) {
    for (int i = 0; i < G; ++i) s[j][i] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; k += kLanes) {
    __m512 v[R];
    for (int j = 0; j < R; ++j) v[j] = load_bf16x16(wn + j * K + k);
    for (int i = 0; i < G; ++i) {
      const __m512 xi = _mm512_loadu_ps(xf + i * K + k);
      for (int j = 0; j < R; ++j) s[j][i] = _mm512_fmadd_ps(xi, v[j], s[j][i]);
    }
  }
  for (int j = 0; j < R; ++j) {
    for (int i = 0; i < G; ++i) p.out[(m0 + i) * N + n + j] = _mm512_reduce_add_ps(s[j][i]);
  }
}
#endif

#if defined(JAXINFER_AVX2)
// nk_rows in AVX2: rows [m0, m0 + G) of x (G <= 4) and rows [n, n + R) of w, K a multiple of 16,
// each of the 16 lane chains in two vectors (lanes 0..7, 8..15) and reduced in the fallback's tree.
// 2 x G x R accumulators, R pieces of w and one of x fit AVX2's 16 registers for G x R <= 6.
template <int G, int R>
void nk_rows8(const Problem& p, const float* xf, int64_t m0, int64_t n) {
  const int64_t K = p.K, N = p.N;
  const uint16_t* wn = p.w + n * K;
  __m256 s[R][G][2];
  for (int j = 0; j < R; ++j) {
    for (int i = 0; i < G; ++i) s[j][i][0] = s[j][i][1] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; k += kLanes) {
    for (int h = 0; h < 2; ++h) {
      __m256 v[R];
      for (int j = 0; j < R; ++j) v[j] = load_bf16x8(wn + j * K + k + h * kHalf);
      for (int i = 0; i < G; ++i) {
        const __m256 xi = _mm256_loadu_ps(xf + (m0 + i) * K + k + h * kHalf);
        for (int j = 0; j < R; ++j) s[j][i][h] = _mm256_fmadd_ps(xi, v[j], s[j][i][h]);
      }
    }
  }
  for (int j = 0; j < R; ++j) {
    for (int i = 0; i < G; ++i) p.out[(m0 + i) * N + n + j] = reduce_lanes(s[j][i][0], s[j][i][1]);
  }
}

// Rows [n0, n1) of w for up to 8 rows of x, in groups of up to 4 (a row's sums do not depend on
// its group).
void nk_rows8_block(const Problem& p, const float* xf, int64_t n0, int64_t n1) {
  using Rows = void (*)(const Problem&, const float*, int64_t, int64_t);
  constexpr Rows kWide[] = {nk_rows8<1, 4>, nk_rows8<2, 3>, nk_rows8<3, 2>, nk_rows8<4, 1>};
  constexpr Rows kOne[] = {nk_rows8<1, 1>, nk_rows8<2, 1>, nk_rows8<3, 1>, nk_rows8<4, 1>};
  constexpr int64_t kStep[] = {4, 3, 2, 1};
  for (int64_t m0 = 0; m0 < p.M; m0 += 4) {
    const int64_t g = std::min<int64_t>(4, p.M - m0);
    int64_t n = n0;
    for (; n + kStep[g - 1] <= n1; n += kStep[g - 1]) kWide[g - 1](p, xf, m0, n);
    for (; n < n1; ++n) kOne[g - 1](p, xf, m0, n);
  }
}

// "kn" for 9..64 rows on AVX2, where kn_chunk's partial sums ([K / 64, M, N]) would outweigh w: a
// work item is a strip of columns over the whole of K, in kn_chunk's order - each chunk of
// kChunkRows rows of w summed from zero in k order, one FMA at a time, the chunks' sums added in
// chunk order - so a row gets the few-row path's bits in any batch. Each chunk of the strip is
// converted to float32 once (16 KB), then register tiles of up to 6 rows of x x 16 columns
// (12 accumulators, one chain per output) run down it, and add into the strip's sums ([M, 64]).
constexpr int64_t kAvx2StripCols = 64;
constexpr int kAvx2TileRows = 5;

// total[m0 + i, c + 8v + l] (+)= sum over the chunk's rows r of x[m0 + i, k0 + r] * wf[r, c + 8v + l].
template <int R, int V>
void avx2_tile(const Problem& p, int64_t k0, int64_t rows, const float* wf, int64_t m0, int64_t c, float* total,
               bool first) {
  __m256 acc[R][V];
  for (int i = 0; i < R; ++i) {
    for (int v = 0; v < V; ++v) acc[i][v] = _mm256_setzero_ps();
  }
  const int64_t K = p.K;
  const float* x0 = p.xf + m0 * K + k0;
  for (int64_t r = 0; r < rows; ++r) {
    __m256 w[V];
    for (int v = 0; v < V; ++v) w[v] = _mm256_loadu_ps(wf + r * kAvx2StripCols + c + v * kHalf);
    for (int i = 0; i < R; ++i) {
      const __m256 b = _mm256_set1_ps(x0[i * K + r]);
      for (int v = 0; v < V; ++v) acc[i][v] = _mm256_fmadd_ps(b, w[v], acc[i][v]);
    }
  }
  // (A chain from +0 is never -0, so the first chunk's 0 + acc is acc's bits.)
  for (int i = 0; i < R; ++i) {
    for (int v = 0; v < V; ++v) {
      float* t = total + (m0 + i) * kAvx2StripCols + c + v * kHalf;
      _mm256_storeu_ps(t, _mm256_add_ps(first ? _mm256_setzero_ps() : _mm256_loadu_ps(t), acc[i][v]));
    }
  }
}

template <int V, int... R>
constexpr auto avx2_tiles(std::integer_sequence<int, R...>) {
  using Tile = void (*)(const Problem&, int64_t, int64_t, const float*, int64_t, int64_t, float*, bool);
  return std::array<Tile, sizeof...(R)>{avx2_tile<R + 1, V>...};
}

void avx2_kn_strip(const Problem& p, int64_t n0) {
  const int64_t M = p.M, K = p.K, N = p.N;
  const int64_t cols = std::min(kAvx2StripCols, N - n0);
  static constexpr auto kTwo = avx2_tiles<2>(std::make_integer_sequence<int, kAvx2TileRows>{});
  static constexpr auto kOne = avx2_tiles<1>(std::make_integer_sequence<int, kAvx2TileRows>{});
  thread_local std::vector<float> wf, total;
  wf.resize(kChunkRows * kAvx2StripCols);
  total.resize(M * kAvx2StripCols);
  const int64_t two = cols - cols % (2 * kHalf), one = cols - cols % kHalf;
  for (int64_t k0 = 0; k0 < K; k0 += kChunkRows) {
    const int64_t rows = std::min(kChunkRows, K - k0);
    const bool first = k0 == 0;
    for (int64_t r = 0; r < rows; ++r) {
      const uint16_t* wr = p.w + (k0 + r) * N + n0;
      if (k0 + r + kPrefetchRows < K) {
        const char* ahead = reinterpret_cast<const char*>(wr + kPrefetchRows * N);
        for (int64_t line = 0; line < cols * 2; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      }
      int64_t j = 0;
      for (; j < one; j += kHalf) _mm256_storeu_ps(wf.data() + r * kAvx2StripCols + j, load_bf16x8(wr + j));
      for (; j < cols; ++j) wf[r * kAvx2StripCols + j] = bf16_to_f32(wr[j]);
    }
    for (int64_t m0 = 0; m0 < M; m0 += kAvx2TileRows) {
      const int64_t g = std::min<int64_t>(kAvx2TileRows, M - m0);
      int64_t c = 0;
      for (; c < two; c += 2 * kHalf) kTwo[g - 1](p, k0, rows, wf.data(), m0, c, total.data(), first);
      for (; c < one; c += kHalf) kOne[g - 1](p, k0, rows, wf.data(), m0, c, total.data(), first);
      for (; c < cols; ++c) {  // the last columns of w, one at a time, in the same order
        for (int64_t m = m0; m < m0 + g; ++m) {
          float a = 0.0f;
          for (int64_t r = 0; r < rows; ++r) a = std::fma(p.xf[m * K + k0 + r], wf[r * kAvx2StripCols + c], a);
          float& t = total[m * kAvx2StripCols + c];
          t = first ? a : t + a;
        }
      }
    }
  }
  for (int64_t m = 0; m < M; ++m) std::copy_n(total.data() + m * kAvx2StripCols, cols, p.out + m * N + n0);
}
#endif

#if defined(JAXINFER_AVX512)
// avx2_kn_strip in AVX-512's 16 lanes, for 9..64 rows of "kn" on a CPU with AVX-512 but no bfloat16
// dot products, where XLA's own bfloat16 dot is Eigen's (a 47-row step of the 150M Llama took 184
// against float32's 108 ms). The same order as kn_chunk - each chunk of kChunkRows rows of w summed
// from zero in k order, one FMA per row, the chunks' sums added in chunk order - so a row is the
// few-row path's bits in any batch. A chunk of the strip is converted to float32 once (32 KB), then
// register tiles of up to 6 rows of x x 64 columns (24 accumulators of AVX-512's 32) run down each
// 64-column slab of it in turn, so the slab (16 KB) stays in L1 while every row of x passes.
constexpr int64_t kAvx512StripCols = 128;  // 256-byte runs of each row of w (64 and 256: no better)
// Unlike the other wide paths it also takes prompt chunks: the 150M Llama's 33 products, one call
// each, 2 threads, 2026-12-03 (Intel Xeon model 207 without AMX or AVX-512 BF16): 61-66 against
// 124-129 ms at 48 rows, 133 against 238 at 128, 255 against 339 at 256, 567 against 557 at 512
// (XLA's bfloat16 dot), and a tied head [32000, 1024] "nk" 65 against 303 ms at 128 rows. A chunk
// then gets the decode rows' bits too.
constexpr int64_t kAvx512MaxRows = 512;
constexpr int kAvx512TileRows = 6;
constexpr int kAvx512TileVectors = 4;

// total[m0 + i, c + 16v + l] (+)= sum over the chunk's rows r of x[m0 + i, k0 + r] * wf[r, c + 16v + l].
template <int R, int V>
void avx512_tile(const Problem& p, int64_t k0, int64_t rows, const float* wf, int64_t m0, int64_t c, float* total,
                 bool first) {
  __m512 acc[R][V];
  for (int i = 0; i < R; ++i) {
    for (int v = 0; v < V; ++v) acc[i][v] = _mm512_setzero_ps();
  }
  const int64_t K = p.K;
  const float* x0 = p.xf + m0 * K + k0;
  for (int64_t r = 0; r < rows; ++r) {
    __m512 w[V];
    for (int v = 0; v < V; ++v) w[v] = _mm512_loadu_ps(wf + r * kAvx512StripCols + c + v * kLanes);
    for (int i = 0; i < R; ++i) {
      const __m512 b = _mm512_set1_ps(x0[i * K + r]);
      for (int v = 0; v < V; ++v) acc[i][v] = _mm512_fmadd_ps(b, w[v], acc[i][v]);
    }
  }
  // (A chain from +0 is never -0, so the first chunk's 0 + acc is acc's bits.)
  for (int i = 0; i < R; ++i) {
    for (int v = 0; v < V; ++v) {
      float* t = total + (m0 + i) * kAvx512StripCols + c + v * kLanes;
      _mm512_storeu_ps(t, first ? acc[i][v] : _mm512_add_ps(_mm512_loadu_ps(t), acc[i][v]));
    }
  }
}

template <int V, int... R>
constexpr auto avx512_tiles(std::integer_sequence<int, R...>) {
  using Tile = void (*)(const Problem&, int64_t, int64_t, const float*, int64_t, int64_t, float*, bool);
  return std::array<Tile, sizeof...(R)>{avx512_tile<R + 1, V>...};
}

void avx512_kn_strip(const Problem& p, int64_t n0) {
  const int64_t M = p.M, K = p.K, N = p.N;
  const int64_t cols = std::min(kAvx512StripCols, N - n0);
  constexpr int64_t kSlab = kAvx512TileVectors * kLanes;
  static constexpr auto kWide = avx512_tiles<kAvx512TileVectors>(std::make_integer_sequence<int, kAvx512TileRows>{});
  static constexpr auto kOne = avx512_tiles<1>(std::make_integer_sequence<int, kAvx512TileRows>{});
  thread_local std::vector<float> wf, total;
  wf.resize(kChunkRows * kAvx512StripCols);
  total.resize(M * kAvx512StripCols);
  const int64_t slabs = cols - cols % kSlab, one = cols - cols % kLanes;
  for (int64_t k0 = 0; k0 < K; k0 += kChunkRows) {
    const int64_t rows = std::min(kChunkRows, K - k0);
    const bool first = k0 == 0;
    for (int64_t r = 0; r < rows; ++r) {
      const uint16_t* wr = p.w + (k0 + r) * N + n0;
      if (k0 + r + kPrefetchRows < K) {
        const char* ahead = reinterpret_cast<const char*>(wr + kPrefetchRows * N);
        for (int64_t line = 0; line < cols * 2; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      }
      int64_t j = 0;
      for (; j < one; j += kLanes) _mm512_storeu_ps(wf.data() + r * kAvx512StripCols + j, load_bf16x16(wr + j));
      for (; j < cols; ++j) wf[r * kAvx512StripCols + j] = bf16_to_f32(wr[j]);
    }
    for (int64_t c = 0; c < slabs; c += kSlab) {
      for (int64_t m0 = 0; m0 < M; m0 += kAvx512TileRows) {
        const int64_t g = std::min<int64_t>(kAvx512TileRows, M - m0);
        kWide[g - 1](p, k0, rows, wf.data(), m0, c, total.data(), first);
      }
    }
    for (int64_t m0 = 0; m0 < M; m0 += kAvx512TileRows) {
      const int64_t g = std::min<int64_t>(kAvx512TileRows, M - m0);
      for (int64_t c = slabs; c < one; c += kLanes) kOne[g - 1](p, k0, rows, wf.data(), m0, c, total.data(), first);
      for (int64_t c = one; c < cols; ++c) {  // the last columns of w, one at a time, in the same order
        for (int64_t m = m0; m < m0 + g; ++m) {
          float a = 0.0f;
          for (int64_t r = 0; r < rows; ++r) a = std::fma(p.xf[m * K + k0 + r], wf[r * kAvx512StripCols + c], a);
          float& t = total[m * kAvx512StripCols + c];
          t = first ? a : t + a;
        }
      }
    }
  }
  for (int64_t m = 0; m < M; ++m) std::copy_n(total.data() + m * kAvx512StripCols, cols, p.out + m * N + n0);
}
#endif

// out[m, n] = x[m, :] . w[n, :] for n in [n0, n1): 16 lanes (lane = k mod 16), each summed in k
// order, then the lanes in a fixed tree. Up to 8 rows of x share each converted piece of w.
void nk_block(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t M = p.M, K = p.K, N = p.N;
  const int64_t body = K - K % kLanes;
  thread_local std::vector<float> xf;
  xf.resize(M * K);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = bf16_to_f32(p.x[i]);
  constexpr int64_t kGroup = 8;
  float lanes[kGroup][kLanes];
  int64_t n = n0;
#if defined(__AVX512F__)
  if (K % kLanes == 0) {  // any M, eight rows of x at a time (a row's sums do not depend on its group)
    using Rows = void (*)(const Problem&, const float*, int64_t, int64_t);
    constexpr Rows kRows[] = {nk_rows<1, 4>, nk_rows<2, 4>, nk_rows<3, 4>, nk_rows<4, 4>,
                              nk_rows<5, 2>, nk_rows<6, 2>, nk_rows<7, 2>, nk_rows<8, 2>};
    constexpr Rows kOne[] = {nk_rows<1, 1>, nk_rows<2, 1>, nk_rows<3, 1>, nk_rows<4, 1>,
                             nk_rows<5, 1>, nk_rows<6, 1>, nk_rows<7, 1>, nk_rows<8, 1>};
    for (int64_t m0 = 0; m0 < M; m0 += kGroup) {
      const int64_t g = std::min(kGroup, M - m0), r = g <= 4 ? 4 : 2;
      n = n0;
      for (; n + r <= n1; n += r) kRows[g - 1](p, xf.data(), m0, n);
      for (; n < n1; ++n) kOne[g - 1](p, xf.data(), m0, n);
    }
    return;
  }
#elif defined(JAXINFER_AVX2)
  if (K % kLanes == 0) {  // any M, four rows at a time
    nk_rows8_block(p, xf.data(), n0, n1);
    return;
  }
#endif
  for (; n < n1; ++n) {
    const uint16_t* wn = p.w + n * K;
    for (int64_t m0 = 0; m0 < M; m0 += kGroup) {
      const int64_t g = std::min(kGroup, M - m0);
      int64_t k = 0;
#if defined(__AVX512F__)
      __m512 s[kGroup];
      for (int64_t i = 0; i < g; ++i) s[i] = _mm512_setzero_ps();
      for (; k < body; k += kLanes) {
        const __m512 v = load_bf16x16(wn + k);
        for (int64_t i = 0; i < g; ++i) s[i] = _mm512_fmadd_ps(_mm512_loadu_ps(xf.data() + (m0 + i) * K + k), v, s[i]);
      }
      if (k == K) {  // no tail: the lanes in the compiler's fixed shuffle tree
        for (int64_t i = 0; i < g; ++i) p.out[(m0 + i) * N + n] = _mm512_reduce_add_ps(s[i]);
        continue;
      }
      for (int64_t i = 0; i < g; ++i) _mm512_storeu_ps(lanes[i], s[i]);
#else
      for (int64_t i = 0; i < g; ++i) std::fill(lanes[i], lanes[i] + kLanes, 0.0f);
      for (; k < body; k += kLanes) {
        for (int64_t l = 0; l < kLanes; ++l) {
          const float f = bf16_to_f32(wn[k + l]);
          for (int64_t i = 0; i < g; ++i) lanes[i][l] = std::fma(xf[(m0 + i) * K + k + l], f, lanes[i][l]);
        }
      }
#endif
      for (; k < K; ++k) {
        const float f = bf16_to_f32(wn[k]);
        for (int64_t i = 0; i < g; ++i) lanes[i][k - body] = std::fma(xf[(m0 + i) * K + k], f, lanes[i][k - body]);
      }
      for (int64_t i = 0; i < g; ++i) {
        float* lane = lanes[i];
        for (int64_t width = kLanes / 2; width > 0; width /= 2) {
          for (int64_t l = 0; l < width; ++l) lane[l] += lane[l + width];
        }
        p.out[(m0 + i) * N + n] = lane[0];
      }
    }
  }
}

#if defined(JAXINFER_WIDE)
// The wide paths, for the 9..64 rows of a batched decode step, where the AVX-512 loops above run
// out of registers: products of bfloat16 pairs summed into float32, (x[m, k], x[m, k+1]) against
// (w[k, n], w[k+1, n]), on Intel's AMX tiles where the CPU has them (TDPBF16PS: a [16, 32] x
// [32, 16] product per instruction), else on AVX-512 BF16 dot products (VDPBF16PS: 16 columns of
// one row per instruction; AMD Zen 4 and later). Both read w in pairs of rows, packed per strip of
// columns into one layout, and x padded (or packed, "nk") the same way.
//
// Each output element is accumulated over k in ascending steps (a tile's 32, a dot product's 2),
// starting from zero, from its row of x alone. So, as on the other path, no sum depends on M, on
// the row's place in the batch or on the thread: a row is the same bits alone and in any batch on
// a wide path. (The paths differ from each other in the last bits: which one runs depends on the
// machine and M, never on the other rows: see kWideMinRows.)
constexpr int64_t kWideRowAlign = 16;  // Mp: a tile's rows, a vector's float32 lanes
constexpr int64_t kWideKAlign = 32;    // Kp: a tile's k step
// "kn": a work item's columns of w (512 bytes of each row). Strips of 128, 256 and 512 columns ran
// within the measuring machine's spread of each other (AMX, whole-model products at 16 and 48 rows,
// 2026-12-02); runs of 256 bytes read memory slower than longer ones (~10 against ~18 GB/s on 2
// threads), wider strips leave fewer items to share out.
constexpr int64_t kStripCols = 256;
constexpr int64_t kNkRows = 64;  // "nk": rows of w per work item

// Rows [kb, kb + rows) of w's columns [n0, n0 + cols) ("kn", rows even) into dst [rows/2][kStripCols][2]:
// (w[k, c], w[k+1, c]) side by side, zeros past w's last row and past cols.
void pack_pairs(const Problem& p, int64_t n0, int64_t cols, int64_t kb, int64_t rows, uint16_t* packed) {
  const int64_t N = p.N, K = p.K;
  const __m512i lo_idx = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
  const __m512i hi_idx = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  const int64_t body = cols - cols % 32;
  for (int64_t i = 0; i < rows / 2; ++i) {
    const int64_t r0 = kb + 2 * i, r1 = r0 + 1;
    uint16_t* dst = packed + i * kStripCols * 2;
    int64_t c = 0;
    if (r1 < K) {
      const uint16_t* a = p.w + r0 * N + n0;
      const uint16_t* b = a + N;
      if (r1 + kPrefetchRows < K) {
        const char* ahead = reinterpret_cast<const char*>(a + kPrefetchRows * N);
        for (int64_t line = 0; line < cols * 2; line += 64) {
          _mm_prefetch(ahead + line, _MM_HINT_T0);
          _mm_prefetch(ahead + N * sizeof(uint16_t) + line, _MM_HINT_T0);
        }
      }
      for (; c < body; c += 32) {
        const __m512i va = _mm512_loadu_si512(a + c), vb = _mm512_loadu_si512(b + c);
        const __m512i lo = _mm512_unpacklo_epi16(va, vb), hi = _mm512_unpackhi_epi16(va, vb);
        _mm512_storeu_si512(dst + 2 * c, _mm512_permutex2var_epi64(lo, lo_idx, hi));
        _mm512_storeu_si512(dst + 2 * c + 32, _mm512_permutex2var_epi64(lo, hi_idx, hi));
      }
    }
    for (; c < kStripCols; ++c) {  // columns past a multiple of 32, K's last odd row, K's padding
      dst[2 * c] = (r0 < K && c < cols) ? p.w[r0 * N + n0 + c] : 0;
      dst[2 * c + 1] = (r1 < K && c < cols) ? p.w[r1 * N + n0 + c] : 0;
    }
  }
}

// The wide paths' copies of x: "kn" x zero-padded to [Mp, Kp]; "nk" x packed in pairs of k, [Kp/2][Mp][2].
void prepare_x(Problem& p, std::vector<uint16_t>& buf) {
  p.Mp = (p.M + kWideRowAlign - 1) / kWideRowAlign * kWideRowAlign;
  p.Kp = (p.K + kWideKAlign - 1) / kWideKAlign * kWideKAlign;
  buf.assign(p.Mp * p.Kp, 0);
  // "kn" row by row: element by element, this copy and the call's other work outside the packs and
  // tiles took ~5 ms of the 150M model's ~35 ms of products at 48 rows, row by row ~2 (2026-12-06).
  if (p.kn) {
    for (int64_t m = 0; m < p.M; ++m) std::memcpy(buf.data() + m * p.Kp, p.x + m * p.K, p.K * sizeof(uint16_t));
  } else {
    for (int64_t m = 0; m < p.M; ++m) {
      for (int64_t k = 0; k < p.K; ++k) buf[((k / 2) * p.Mp + m) * 2 + (k & 1)] = p.x[m * p.K + k];
    }
  }
  p.xp = buf.data();
}
#endif  // JAXINFER_WIDE

#if defined(JAXINFER_AMX)
// The AMX path. The tiles' loads bound it (~22 ns per 1 KB tile on the machine measured, one per
// product at best with 8 tile registers), not memory: WORKSPACE.md, design decisions, 2026-12-02.
// XLA's YNNPACK GEMM reached ~230 GFLOP/s at 48 rows there.
constexpr int64_t kTileRows = 16;   // rows of every tile
constexpr int64_t kTileK = 32;      // bfloat16 per row of an A tile: one k step
constexpr int64_t kTileCols = 16;   // float32 columns of a C tile
constexpr int64_t kBlockRows = 2048;  // "kn": rows of w packed at a time (1 MB: in L2)

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3 accumulate, 4-5 hold B, 6-7 hold A: all 16 rows of 64 bytes.
inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Whether this process may use the tile registers (Linux asks each process to request them).
bool amx_permitted() {
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  static const bool ok = syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  return ok;
}

// "kn", columns [n0, n0 + kStripCols) of w over all of K, in blocks of kBlockRows rows: each block
// is packed in pairs of rows (the B tiles' layout) and multiplied by every row of x from that copy;
// the float32 sums carry from block to block in `sums` ([Mp][kStripCols]), so every element is
// still one chain in k order.
void amx_kn_strip(const Problem& p, int64_t n0) {
  const int64_t N = p.N, K = p.K, Kp = p.Kp;
  const int64_t cols = std::min(kStripCols, N - n0);
  thread_local std::vector<uint16_t> packed;
  thread_local std::vector<float> sums;
  packed.resize(kBlockRows * kStripCols);
  sums.resize(p.Mp * kStripCols);
  const int64_t bstride = kStripCols * 2 * sizeof(uint16_t), astride = Kp * sizeof(uint16_t);
  const int64_t cstride = kStripCols * sizeof(float);
  for (int64_t kb = 0; kb < Kp; kb += kBlockRows) {
    const int64_t rows = std::min(kBlockRows, Kp - kb);
    pack_pairs(p, n0, cols, kb, rows, packed.data());
    configure_tiles();
    for (int64_t s = 0; s < cols; s += 2 * kTileCols) {
      const bool two = cols - s > kTileCols;
      for (int64_t m0 = 0; m0 < p.Mp; m0 += 2 * kTileRows) {
        const bool pair = p.Mp - m0 > kTileRows;
        float* c0 = sums.data() + m0 * kStripCols + s;
        float* c1 = c0 + kTileRows * kStripCols;
        if (kb == 0) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        } else {
          _tile_loadd(0, c0, cstride);
          if (two) _tile_loadd(1, c0 + kTileCols, cstride);
          if (pair) _tile_loadd(2, c1, cstride);
          if (pair && two) _tile_loadd(3, c1 + kTileCols, cstride);
        }
        for (int64_t k = 0; k < rows; k += kTileK) {
          const uint16_t* b = packed.data() + (k / 2) * kStripCols * 2 + 2 * s;
          const uint16_t* a = p.xp + m0 * Kp + kb + k;
          _tile_loadd(4, b, bstride);
          _tile_loadd(6, a, astride);
          if (two) _tile_loadd(5, b + 2 * kTileCols, bstride);
          if (pair) _tile_loadd(7, a + kTileRows * Kp, astride);
          _tile_dpbf16ps(0, 6, 4);
          if (two) _tile_dpbf16ps(1, 6, 5);
          if (pair) _tile_dpbf16ps(2, 7, 4);
          if (pair && two) _tile_dpbf16ps(3, 7, 5);
        }
        _tile_stored(0, c0, cstride);
        if (two) _tile_stored(1, c0 + kTileCols, cstride);
        if (pair) _tile_stored(2, c1, cstride);
        if (pair && two) _tile_stored(3, c1 + kTileCols, cstride);
      }
    }
    _tile_release();
  }
  for (int64_t m = 0; m < p.M; ++m) {
    std::memcpy(p.out + m * N + n0, sums.data() + m * kStripCols, cols * sizeof(float));
  }
}

// "nk": rows [n0, n1) of w [N, K] are the A operand as they lie (16 rows of 32 k per tile); x was
// packed once as B ([Kp/2][Mp][2]); each C tile is out's [16 m, 16 n] block transposed.
void amx_nk_block(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t K = p.K, Kp = p.Kp, Mp = p.Mp;
  alignas(64) uint16_t a_tail[kTileRows * kTileK];
  configure_tiles();
  for (int64_t n = n0; n < n1; n += kTileRows) {
    const int64_t rows = std::min(kTileRows, n1 - n);
    for (int64_t m0 = 0; m0 < Mp; m0 += 4 * kTileRows) {
      const int64_t mt = std::min<int64_t>(4, (Mp - m0) / kTileRows);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t k = 0; k < Kp; k += kTileK) {
        if (rows == kTileRows && k + kTileK <= K) {
          _tile_loadd(6, p.w + n * K + k, K * sizeof(uint16_t));
        } else {  // past w's last row or column: zeros
          for (int64_t r = 0; r < kTileRows; ++r) {
            for (int64_t c = 0; c < kTileK; ++c) {
              a_tail[r * kTileK + c] = (r < rows && k + c < K) ? p.w[(n + r) * K + k + c] : 0;
            }
          }
          _tile_loadd(6, a_tail, kTileK * sizeof(uint16_t));
        }
        const uint16_t* b = p.xp + (k / 2) * Mp * 2 + m0 * 2;
        const int64_t bstride = Mp * 2 * sizeof(uint16_t);
        _tile_loadd(4, b, bstride);
        _tile_dpbf16ps(0, 6, 4);
        if (mt > 1) {
          _tile_loadd(5, b + 2 * kTileRows, bstride);
          _tile_dpbf16ps(1, 6, 5);
        }
        if (mt > 2) {
          _tile_loadd(4, b + 4 * kTileRows, bstride);
          _tile_dpbf16ps(2, 6, 4);
        }
        if (mt > 3) {
          _tile_loadd(5, b + 6 * kTileRows, bstride);
          _tile_dpbf16ps(3, 6, 5);
        }
      }
      alignas(64) float c[kTileRows * kTileCols];  // [n][m]
      for (int64_t t = 0; t < mt; ++t) {
        switch (t) {
          case 0: _tile_stored(0, c, kTileCols * sizeof(float)); break;
          case 1: _tile_stored(1, c, kTileCols * sizeof(float)); break;
          case 2: _tile_stored(2, c, kTileCols * sizeof(float)); break;
          default: _tile_stored(3, c, kTileCols * sizeof(float)); break;
        }
        for (int64_t m = 0; m < kTileCols && m0 + t * kTileCols + m < p.M; ++m) {
          for (int64_t r = 0; r < rows; ++r) p.out[(m0 + t * kTileCols + m) * p.N + n + r] = c[r * kTileCols + m];
        }
      }
    }
  }
  _tile_release();
}

#endif  // JAXINFER_AMX

#if defined(JAXINFER_DOT)
// The AVX-512 BF16 path: VDPBF16PS adds (a[2i] b[2i] + a[2i+1] b[2i+1]) into float32 lane i, 32
// products per instruction, twice the float32 FMA's. A register tile of kDotRows x kDotVecs
// accumulators (24 of the 32 vector registers) takes one pair of x per row as a broadcast and 16
// columns' pairs of w per vector, so each step issues 24 dot products for 10 loads.
constexpr int64_t kDotRows = 6;
constexpr int64_t kDotVecs = 4;
// "kn": rows of w packed at a time: 512 KB at 256 columns, half of a Zen 5 core's L2.
constexpr int64_t kDotBlockRows = 1024;

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

inline __m512i broadcast_pair(const uint16_t* at) {
  int32_t v;
  std::memcpy(&v, at, sizeof(v));
  return _mm512_set1_epi32(v);
}

// "kn": c[r, 16 j + l] (+)= sum over pairs i of x[r] pair i . packed pair i, for R rows of x (a,
// row stride astride, pairs from 0) and V vectors of columns (b, pair stride kStripCols * 2); c has
// row stride kStripCols and starts from zero where `zero`.
template <int R, int V>
void dot_kn_tile(const uint16_t* b, int64_t pairs, const uint16_t* a, int64_t astride, float* c, bool zero) {
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < V; ++j) acc[r][j] = zero ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * kStripCols + 16 * j);
  }
  for (int64_t i = 0; i < pairs; ++i) {
    const uint16_t* bi = b + i * kStripCols * 2;
    __m512i bv[V];
    for (int j = 0; j < V; ++j) bv[j] = _mm512_loadu_si512(bi + 32 * j);
    for (int r = 0; r < R; ++r) {
      const __m512i av = broadcast_pair(a + r * astride + 2 * i);
      for (int j = 0; j < V; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], as_bh(av), as_bh(bv[j]));
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < V; ++j) _mm512_storeu_ps(c + r * kStripCols + 16 * j, acc[r][j]);
  }
}

// "nk": out[m0 + 16 j + l, n + r] = sum over pairs i of w[n + r] pair i . x's packed pair i, for R
// rows of w (w, row stride K) and V vectors of 16 rows of x (b = xp + 2 m0, pair stride 2 Mp); the
// last pair of an odd K is (w[K-1], 0), x's padding being zero.
template <int R, int V>
void dot_nk_tile(const Problem& p, const uint16_t* w, const uint16_t* b, int64_t n, int64_t m0) {
  const int64_t K = p.K, bstride = 2 * p.Mp;
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < V; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < (K + 1) / 2; ++i) {
    const uint16_t* bi = b + i * bstride;
    __m512i bv[V];
    for (int j = 0; j < V; ++j) bv[j] = _mm512_loadu_si512(bi + 32 * j);
    for (int r = 0; r < R; ++r) {
      const __m512i av = 2 * i + 1 < K ? broadcast_pair(w + r * K + 2 * i) : _mm512_set1_epi32(w[r * K + 2 * i]);
      for (int j = 0; j < V; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], as_bh(av), as_bh(bv[j]));
    }
  }
  alignas(64) float lanes[16];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < V; ++j) {
      _mm512_store_ps(lanes, acc[r][j]);
      for (int64_t l = 0, m = m0 + 16 * j; l < 16 && m < p.M; ++l, ++m) p.out[m * p.N + n + r] = lanes[l];
    }
  }
}

// The instantiations for every tile shape up to kDotRows x kDotVecs, indexed [R - 1][V - 1].
struct KnTile {
  template <int R, int V>
  static constexpr auto fn = &dot_kn_tile<R, V>;
};
struct NkTile {
  template <int R, int V>
  static constexpr auto fn = &dot_nk_tile<R, V>;
};
template <class Tile, int R, int... V>
constexpr auto tile_row(std::integer_sequence<int, V...>) {
  return std::array{Tile::template fn<R, V + 1>...};
}
template <class Tile, int... R>
constexpr auto tile_table(std::integer_sequence<int, R...>) {
  return std::array{tile_row<Tile, R + 1>(std::make_integer_sequence<int, kDotVecs>())...};
}
constexpr auto kDotKn = tile_table<KnTile>(std::make_integer_sequence<int, kDotRows>());
constexpr auto kDotNk = tile_table<NkTile>(std::make_integer_sequence<int, kDotRows>());

// "kn", columns [n0, n0 + kStripCols) of w over all of K, packed kDotBlockRows rows at a time; the
// float32 sums carry from block to block in `sums` ([M][kStripCols]), one chain in k order each.
void dot_kn_strip(const Problem& p, int64_t n0) {
  const int64_t Kp = p.Kp;
  const int64_t cols = std::min(kStripCols, p.N - n0);
  thread_local std::vector<uint16_t> packed;
  thread_local std::vector<float> sums;
  packed.resize(kDotBlockRows * kStripCols);
  sums.resize(p.M * kStripCols);
  for (int64_t kb = 0; kb < Kp; kb += kDotBlockRows) {
    const int64_t rows = std::min(kDotBlockRows, Kp - kb);
    pack_pairs(p, n0, cols, kb, rows, packed.data());
    for (int64_t s = 0; s < cols; s += 16 * kDotVecs) {
      const int64_t v = std::min<int64_t>(kDotVecs, (cols - s + 15) / 16);
      for (int64_t m0 = 0; m0 < p.M; m0 += kDotRows) {
        const int64_t r = std::min(kDotRows, p.M - m0);
        kDotKn[r - 1][v - 1](packed.data() + 2 * s, rows / 2, p.xp + m0 * Kp + kb, Kp, sums.data() + m0 * kStripCols + s,
                             kb == 0);
      }
    }
  }
  for (int64_t m = 0; m < p.M; ++m) {
    std::memcpy(p.out + m * p.N + n0, sums.data() + m * kStripCols, cols * sizeof(float));
  }
}

// "nk": rows [n0, n1) of w [N, K] against x packed in pairs of k ([Kp/2][Mp][2]).
void dot_nk_block(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += kDotRows) {
    const int64_t r = std::min(kDotRows, n1 - n);
    for (int64_t m0 = 0; m0 < p.M; m0 += 16 * kDotVecs) {
      const int64_t v = std::min<int64_t>(kDotVecs, (p.M - m0 + 15) / 16);
      kDotNk[r - 1][v - 1](p, p.w + n * p.K, p.xp + 2 * m0, n, m0);
    }
  }
}
#endif  // JAXINFER_DOT

// The float32 strips: out [M, N] = x [M, K] . w for a float32 w stored in strips of 64 columns,
// [N / 64][K][64] (each strip's K rows of 256 bytes one after another; jaxinfer.native.pack_f32 lays
// a [K, N] weight out so, once, at load time), for every M - a decode step's rows and a prompt
// chunk's alike.
//
// Why: XLA CPU's float32 dot streamed the 150M Llama's [K, N] weights at ~23 GB/s at one row and ran
// ~150 GFLOP/s at a batched step's 32-48 rows; chained as in a step (2026-12-06, Intel Xeon model
// 207, 49 products), these strips took 22.3 against 25.2 ms at one row, 41 against 64 at 8 rows, 65
// against 102 at 32 and 93 against 154 at 48, and were level at 512. A strip is one contiguous
// stream the prefetcher follows (a [K, N] weight's 64 columns are K runs of 256 bytes, N * 4 bytes
// apart), and its blocks of kF32BlockRows rows (64 KB; kF32WideBlockRows, 256 KB, from
// kF32WideBlockFrom rows of x) stay in L1/L2 while every register tile of x
// passes over them. Copying strips out of a [K, N] weight per call instead (tried 2026-12-05) cost
// as much as the tiles: hence the layout, paid once.
//
// Every output element is one chain of fused multiply-adds from +0 in k order, whatever M, the tile
// shape, the K block or the thread (a chain paused at a block's end is stored and reloaded exactly):
// a row is the same bits alone and in any batch, and AVX-512 and AVX2 give the same bits.
constexpr int64_t kF32StripCols = 64;
constexpr int64_t kF32BlockRows = 256;
// From kF32WideBlockFrom rows of x, where the products are bound by arithmetic rather than memory,
// blocks of kF32WideBlockRows rows: the 150M model's 33 products and its head on two threads (a C++
// harness running drain, the two heights alternating round by round in one process on the same
// weights, 6-12 rounds, 2026-12-07, AMD EPYC Zen 4) ran 1.04x faster at 12 rows, 1.05x at 16,
// 1.08x at 24-64, 1.06-1.07x at 256-512 with 1024-row blocks (4096: no better); at 7-9 rows
// 0.965-0.994x, at 1-4 level. Each output is still one chain in k order (the same bits). Earlier
// harness runs on the Intel Xeon model 207 (each height its own library, the weights apart) read
// 128-4096 rows within +-4% of 256, their sign changing between runs: not measured the way above.
constexpr int64_t kF32WideBlockRows = 1024;
constexpr int64_t kF32WideBlockFrom = 12;
// Rows of a strip (2 KB) asked for ahead of the tile reading it from memory: the hardware prefetcher
// alone stops at each 4 KB page. Chained as a 150M step, against XLA in the same process (two
// alternating pairs, 2026-12-06): 1.18-1.20x XLA at one row with, 1.06-1.14x without; 1.34-1.48x
// against 1.04-1.22x at 4 rows, 1.53x against 1.30x at 16.
constexpr int64_t kF32PrefetchRows = 8;
// What a tile asks memory for while it computes. The tiles over a block share out the `far_lines`
// cache lines from `far` (the strip's next block) and ask for them into L2, a few per row of
// theirs, so that the next block is there when they reach it: memory and arithmetic overlap. The
// first tile also asks for the strip's rows kF32PrefetchRows ahead of its own, into L1: up to
// `near` rows past its block where it is the only tile (M <= kF32TileRows), else within the block.
// The 150M model's products chained at 48 rows, against XLA in the same process, three alternating pairs (2026-12-06):
// 1.38x, 1.40x, 1.23x XLA with the far requests, 1.20x, 1.24x, 1.13x without; level at 16 rows.
// Until 2026-12-07 the first tile took no share of them, and a tile alone made none: at 7-12 rows
// (two tiles) the second then waited on memory for the whole next block while the first only
// computed, and at 2-6 rows the near requests, 2 KB ahead, could not hide memory's latency behind
// the tile's longer rows. With every tile taking a share, the 33 products chained in drain on two
// threads (a C++ harness, each form its own library, called in turn in one process, 7-9 rounds):
// 1.03x at 1 row, 1.05x at 2, 1.12-1.16x at 3-6, 1.28x at 7, 1.18-1.23x at 8, 1.15-1.19x at 10-24,
// 1.02-1.05x at 16, level at 48-64.
// A strip's last block asks for the first block of the strip its thread does next (claimed before
// the last block starts, see drain), which otherwise came cold from memory: the same chain 1.025x,
// 1.03-1.04x and 1.03x faster at 16, 48 and 96 rows, level at 1-8 (alternating calls in one
// process, 12-16 pairs, 2026-12-06 night).
struct F32Fetch {
  int64_t near = -kF32WideBlockRows;  // (none: below any block's first row)
  const char* far = nullptr;
  int64_t far_lines = 0;
};
#if defined(__AVX512F__)
#define JAXINFER_F32_STRIPS 1
constexpr int kF32TileRows = 6;  // 6 x 4 accumulators of AVX-512's 32 registers, 4 for w, 1 for x
// out[m0 + i, n0 + 16v + l] (+)= sum over k in [k0, k0 + kn) of x[m0 + i, k] * strip[k, 16v + l].
template <int R>
void f32_tile(const Problem& p, const float* strip, int64_t k0, int64_t kn, int64_t m0, int64_t n0, F32Fetch f) {
  constexpr int V = kF32StripCols / 16;
  __m512 acc[R][V];
  float* o = p.out + m0 * p.N + n0;
  for (int i = 0; i < R; ++i) {
    for (int v = 0; v < V; ++v) acc[i][v] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(o + i * p.N + 16 * v);
  }
  const float* x = p.xf + m0 * p.K + k0;
  const float* w = strip + k0 * kF32StripCols;
  const int64_t fetched = std::min(kn, kn + f.near - kF32PrefetchRows);  // the k with k + kF32PrefetchRows in reach
  const int64_t per_row = (f.far_lines + kn - 1) / kn;
  for (int64_t k = 0; k < kn; ++k) {
    if (k < fetched) {
      const char* next = reinterpret_cast<const char*>(w + (k + kF32PrefetchRows) * kF32StripCols);
      for (int line = 0; line < V; ++line) _mm_prefetch(next + 64 * line, _MM_HINT_T0);
    }
    for (int64_t j = k * per_row; j < std::min(f.far_lines, (k + 1) * per_row); ++j) {
      _mm_prefetch(f.far + 64 * j, _MM_HINT_T1);
    }
    __m512 wk[V];
    for (int v = 0; v < V; ++v) wk[v] = _mm512_loadu_ps(w + k * kF32StripCols + 16 * v);
    for (int i = 0; i < R; ++i) {
      const __m512 b = _mm512_set1_ps(x[i * p.K + k]);
      for (int v = 0; v < V; ++v) acc[i][v] = _mm512_fmadd_ps(b, wk[v], acc[i][v]);
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(o + i * p.N + 16 * v, acc[i][v]);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
#define JAXINFER_F32_STRIPS 1
constexpr int kF32TileRows = 3;  // 3 x 4 accumulators of AVX2's 16 registers; a strip in two halves
template <int R>
void f32_tile(const Problem& p, const float* strip, int64_t k0, int64_t kn, int64_t m0, int64_t n0, F32Fetch f) {
  constexpr int V = 4;
  const int64_t fetched = std::min(kn, kn + f.near - kF32PrefetchRows);  // as in the AVX-512 tile
  const int64_t per_row = (f.far_lines + kn - 1) / kn;
  for (int half = 0; half < kF32StripCols; half += 8 * V) {
    __m256 acc[R][V];
    float* o = p.out + m0 * p.N + n0 + half;
    for (int i = 0; i < R; ++i) {
      for (int v = 0; v < V; ++v) acc[i][v] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(o + i * p.N + 8 * v);
    }
    const float* x = p.xf + m0 * p.K + k0;
    const float* w = strip + k0 * kF32StripCols + half;
    for (int64_t k = 0; k < kn; ++k) {
      if (half == 0 && k < fetched) {  // the whole row (both halves) from the first pass
        const char* next = reinterpret_cast<const char*>(strip + (k0 + k + kF32PrefetchRows) * kF32StripCols);
        for (int line = 0; line < 4; ++line) _mm_prefetch(next + 64 * line, _MM_HINT_T0);
      }
      for (int64_t j = k * per_row; half == 0 && j < std::min(f.far_lines, (k + 1) * per_row); ++j) {
        _mm_prefetch(f.far + 64 * j, _MM_HINT_T1);
      }
      for (int i = 0; i < R; ++i) {
        const __m256 b = _mm256_broadcast_ss(x + i * p.K + k);
        for (int v = 0; v < V; ++v) {
          acc[i][v] = _mm256_fmadd_ps(b, _mm256_loadu_ps(w + k * kF32StripCols + 8 * v), acc[i][v]);
        }
      }
    }
    for (int i = 0; i < R; ++i) {
      for (int v = 0; v < V; ++v) _mm256_storeu_ps(o + i * p.N + 8 * v, acc[i][v]);
    }
  }
}
#endif

#if defined(JAXINFER_F32_STRIPS)
// Whether a tile alone over its block (M <= kF32TileRows) makes F32Fetch's requests: on Intel, not
// on AMD. On 2 vCPUs of an Intel Xeon (model 207) they made one-row steps of the 150M model 1.18-1.20x
// faster than without, and 1.165x at 4 rows (2026-12-06/07). On 2 vCPUs of an AMD EPYC Zen 4 (family 25
// model 17) the same requests cost more than they hid: decode steps of the 150M model with none,
// against with them, alternating step by step in one process (2026-12-07, 80 pairs each): 1.14x and
// 1.15x at 1 row, 1.14x at 2, 1.06x at 3 and 4, 1.01x at 6; the 33 products alone in a C++ harness
// 1.10x at 1 and 2 rows, 1.05x at 4 (the hardware prefetchers alone streamed them at ~33 GB/s, the
// machine's two-core read). With two tiles or more (7 rows up) the requests for the next block stay
// on AMD too: without any requests, 8 rows ran at 0.82-0.87x the speed. Zen 3 and Zen 5 were not
// measured; they take the AMD choice.
bool f32_alone_fetches() {
  static const bool amd = (__builtin_cpu_init(), __builtin_cpu_is("amd"));
  return !amd;
}

template <int... R>
constexpr auto f32_tiles(std::integer_sequence<int, R...>) {
  using Tile = void (*)(const Problem&, const float*, int64_t, int64_t, int64_t, int64_t, F32Fetch);
  return std::array<Tile, sizeof...(R)>{f32_tile<R + 1>...};
}

// Work item s: strip s of w against every row of x, block by block of kF32BlockRows rows of w
// (kF32WideBlockRows from kF32WideBlockFrom rows of x), the
// rows of x in as few register tiles as fit, of near-equal heights.
void f32_strip(const Problem& p, int64_t s, int64_t after) {
  static constexpr auto kTiles = f32_tiles(std::make_integer_sequence<int, kF32TileRows>{});
  const float* strip = p.wf + s * p.K * kF32StripCols;
  const int64_t tiles = (p.M + kF32TileRows - 1) / kF32TileRows;
  const bool quiet = tiles == 1 && !f32_alone_fetches();  // AMD: the hardware prefetchers alone (above)
  const int64_t block = p.M >= kF32WideBlockFrom ? kF32WideBlockRows : kF32BlockRows;
  for (int64_t k0 = 0; k0 < p.K; k0 += block) {
    const int64_t kn = std::min(block, p.K - k0);
    const bool last = k0 + kn == p.K;
    // The next block: the strip's own, or after its last, the first of the strip this thread does next.
    const float* next_rows = last ? (after >= 0 ? p.wf + after * p.K * kF32StripCols : nullptr) : strip + (k0 + kn) * kF32StripCols;
    const int64_t next_lines = next_rows == nullptr ? 0 : std::min(block, last ? p.K : p.K - k0 - kn) * kF32StripCols * 4 / 64;
    const char* next = reinterpret_cast<const char*>(next_rows);
    for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
      const int64_t rows = (p.M - m0 + tiles - t - 1) / (tiles - t);
      F32Fetch f;
      if (t == 0) {
        // Alone, the tile asks for the rows ahead of its own, past its block to the strip's end
        // (and into the strip that follows it in memory, where this thread does that one next).
        f.near = tiles == 1 ? p.K - k0 - kn + (after == s + 1 ? kF32PrefetchRows : 0) : 0;
      }
      // Every tile asks for its share of the next block.
      const int64_t lo = next_lines * t / tiles, hi = next_lines * (t + 1) / tiles;
      f.far = next + 64 * lo;
      f.far_lines = hi - lo;
      if (quiet) f = F32Fetch{};
      kTiles[rows - 1](p, strip, k0, kn, m0, s * kF32StripCols, f);
      m0 += rows;
    }
  }
}
#endif

// Which wide path runs 9..64 rows here: AMX where it was built for a CPU with AMX and the OS grants
// the tiles, else the AVX-512 BF16 dot products where the CPU has them, else the AVX2 strips (no
// AVX-512) or the AVX-512 ones (AVX-512 without BF16), else none.
Problem::Wide wide_path() {
#if defined(JAXINFER_AMX)
  if (amx_permitted()) return Problem::Wide::kAmx;
#endif
#if defined(JAXINFER_DOT)
  return Problem::Wide::kDot;
#elif defined(JAXINFER_AVX2)
  return Problem::Wide::kAvx2;
#elif defined(JAXINFER_AVX512)
  return Problem::Wide::kAvx512;
#else
  return Problem::Wide::kNone;
#endif
}

// One work item finished: the last one wakes the calling thread (see run()).
void item_done(Shared& s) {
  if (s.done.fetch_add(1, std::memory_order_acq_rel) + 1 == s.problem.items) {
    std::lock_guard<std::mutex> lock(s.mu);
    s.all_done.notify_all();
  }
}

void drain(Shared& s) {
  const Problem& p = s.problem;
  for (int64_t i; (i = s.next.fetch_add(1, std::memory_order_relaxed)) < p.items;) {
#if defined(JAXINFER_F32_STRIPS)
    if (p.wide == Problem::Wide::kF32Strips) {
      // This thread's next item is claimed now, so that the end of this one can ask for its start.
      for (int64_t after;; i = after) {
        after = s.next.fetch_add(1, std::memory_order_relaxed);
        f32_strip(p, i, after < p.items ? after : -1);
        item_done(s);
        if (after >= p.items) return;
      }
    } else
#endif
#if defined(JAXINFER_AMX)
    if (p.wide == Problem::Wide::kAmx && p.kn) {
      amx_kn_strip(p, i * kStripCols);
    } else if (p.wide == Problem::Wide::kAmx) {
      amx_nk_block(p, i * kNkRows, std::min(p.N, (i + 1) * kNkRows));
    } else
#endif
#if defined(JAXINFER_DOT)
    if (p.wide == Problem::Wide::kDot && p.kn) {
      dot_kn_strip(p, i * kStripCols);
    } else if (p.wide == Problem::Wide::kDot) {
      dot_nk_block(p, i * kNkRows, std::min(p.N, (i + 1) * kNkRows));
    } else
#endif
#if defined(JAXINFER_AVX2)
    if (p.wide == Problem::Wide::kAvx2 && p.kn) {
      avx2_kn_strip(p, i * kAvx2StripCols);
    } else
#endif
#if defined(JAXINFER_AVX512)
    if (p.wide == Problem::Wide::kAvx512 && p.kn) {
      avx512_kn_strip(p, i * kAvx512StripCols);
    } else
#endif
    if (p.kn) {
      const int64_t k0 = i * kChunkRows;
      kn_chunk(p, k0, std::min(kChunkRows, p.K - k0), p.partials + i * p.M * p.N);
    } else {
      nk_block(p, i * p.block, std::min(p.N, (i + 1) * p.block));
    }
    item_done(s);
  }
}

void run(ffi::ThreadPool& pool, const std::shared_ptr<Shared>& shared) {
  const Problem& p = shared->problem;
  // A small product runs on the calling thread alone: waking a helper cost more than it saved.
  // (The float32 strips do M times the work at the same weight: a small weight is small at few rows.)
  const bool small = p.K * p.N < kSmallProduct && (p.wide != Problem::Wide::kF32Strips || p.M <= 8);
  // The calling thread drains too, so num_threads - 1 helpers make one drainer per thread of XLA's
  // pool (as many as cores). One helper more put three threads on two cores: the OS then preempts a
  // drainer mid-item and the call waits for it - a [1024, 32000] product at one row read 18.9 GB/s
  // with two helpers, 30.6 with one, on 2 cores of an Intel Xeon (2026-12-06).
  const int64_t helpers = small ? 0 : std::clamp<int64_t>(pool.num_threads() - 1, 0, p.items - 1);
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([shared] { drain(*shared); });
  }
  drain(*shared);
  // Items a helper took may still be in progress: sleep until the last one is done. (Spinning here
  // starved the helpers when XLA ran several of these calls at once - a step's q, k and v
  // projections are independent - on a pool with as many threads as cores.)
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->all_done.wait(lock, [&] { return shared->done.load(std::memory_order_acquire) == shared->problem.items; });
}

ffi::Error Bf16MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                          ffi::Result<ffi::Buffer<ffi::F32>> out, bool kn) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || od.size() != 2) {
    return ffi::Error::InvalidArgument("x [M, K], w [K, N] or [N, K] and out [M, N] expected");
  }
  auto shared = std::make_shared<Shared>();
  Problem& p = shared->problem;
  p.M = xd[0], p.K = xd[1], p.N = kn ? wd[1] : wd[0];
  p.kn = kn;
  if ((kn ? wd[0] : wd[1]) != p.K || od[0] != p.M || od[1] != p.N) {
    return ffi::Error::InvalidArgument("x, w and out disagree on M, K or N");
  }
  p.x = reinterpret_cast<const uint16_t*>(x.untyped_data());
  p.w = reinterpret_cast<const uint16_t*>(w.untyped_data());
  p.out = out->typed_data();
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  if (p.K == 0) {
    std::fill(p.out, p.out + p.M * p.N, 0.0f);
    return ffi::Error::Success();
  }
#if defined(JAXINFER_WIDE)
  const Problem::Wide tiles = wide_path();  // AMX or the dot products; else kAvx512 or kNone (below)
  if (p.M >= kWideMinRows && p.M <= kWideMaxRows && (tiles == Problem::Wide::kAmx || tiles == Problem::Wide::kDot)) {
    thread_local std::vector<uint16_t> xbuf;
    p.wide = tiles;
    prepare_x(p, xbuf);
    p.items = kn ? (p.N + kStripCols - 1) / kStripCols : (p.N + kNkRows - 1) / kNkRows;
    run(pool, shared);
    return ffi::Error::Success();
  }
#endif
#if defined(JAXINFER_AVX2)
  if (kn && p.M >= kWideMinRows && p.M <= kWideMaxRows) {
    thread_local std::vector<float> xbuf;
    xbuf.resize(p.M * p.K);
    for (int64_t i = 0; i < p.M * p.K; ++i) xbuf[i] = bf16_to_f32(p.x[i]);
    p.wide = Problem::Wide::kAvx2;
    p.xf = xbuf.data();
    p.items = (p.N + kAvx2StripCols - 1) / kAvx2StripCols;
    run(pool, shared);
    return ffi::Error::Success();
  }
#endif
#if defined(JAXINFER_AVX512)
  if (kn && p.M >= kWideMinRows && p.M <= kAvx512MaxRows && wide_path() == Problem::Wide::kAvx512) {
    thread_local std::vector<float> xbuf;
    xbuf.resize(p.M * p.K);
    for (int64_t i = 0; i < p.M * p.K; ++i) xbuf[i] = bf16_to_f32(p.x[i]);
    p.wide = Problem::Wide::kAvx512;
    p.xf = xbuf.data();
    p.items = (p.N + kAvx512StripCols - 1) / kAvx512StripCols;
    run(pool, shared);
    return ffi::Error::Success();
  }
#endif
  if (kn) {
    // Partial sums in a buffer the calling thread keeps (it waits for every item before returning).
    thread_local std::vector<float> partials;
    p.items = (p.K + kChunkRows - 1) / kChunkRows;
    partials.resize(p.items * p.M * p.N);
    p.partials = partials.data();
    run(pool, shared);
    const int64_t size = p.M * p.N;
    std::memcpy(p.out, p.partials, size * sizeof(float));
    for (int64_t c = 1; c < p.items; ++c) {
      const float* part = p.partials + c * size;
#pragma omp simd
      for (int64_t i = 0; i < size; ++i) p.out[i] += part[i];
    }
  } else {
    p.block = std::max<int64_t>(1, (p.N + 4 * (pool.num_threads() + 1) - 1) / (4 * (pool.num_threads() + 1)));
    p.items = (p.N + p.block - 1) / p.block;
    run(pool, shared);
  }
  return ffi::Error::Success();
}

ffi::Error F32MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                         ffi::Result<ffi::Buffer<ffi::F32>> out) {
#if defined(JAXINFER_F32_STRIPS)
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || od.size() != 2) {
    return ffi::Error::InvalidArgument("x [M, K], w [K, N] (in strips) and out [M, N] expected");
  }
  auto shared = std::make_shared<Shared>();
  Problem& p = shared->problem;
  p.M = xd[0], p.K = xd[1], p.N = wd[1];
  if (wd[0] != p.K || od[0] != p.M || od[1] != p.N || p.N % kF32StripCols != 0) {
    return ffi::Error::InvalidArgument("x, w and out disagree on M, K or N, or N is not a multiple of 64");
  }
  p.xf = x.typed_data();
  p.wf = w.typed_data();
  p.out = out->typed_data();
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  if (p.K == 0) {
    std::fill(p.out, p.out + p.M * p.N, 0.0f);
    return ffi::Error::Success();
  }
  p.wide = Problem::Wide::kF32Strips;
  p.items = p.N / kF32StripCols;
  run(pool, shared);
  return ffi::Error::Success();
#else
  return ffi::Error(ffi::ErrorCode::kUnimplemented, "the float32 strips need AVX-512 or AVX2 with FMA");
#endif
}

}  // namespace

// For jaxinfer.native: the float32 strips' (f32_matmul) width, 0 where this build has none; and in
// `isa` 2 where they run in AVX-512, 1 in AVX2.
extern "C" int64_t JaxinferF32Strips(int64_t* isa) {
#if defined(JAXINFER_F32_STRIPS) && defined(__AVX512F__)
  *isa = 2;
  return kF32StripCols;
#elif defined(JAXINFER_F32_STRIPS)
  *isa = 1;
  return kF32StripCols;
#else
  *isa = 0;
  return 0;
#endif
}

// For jaxinfer.native: the wide path here (0 none, 1 AMX, 2 AVX-512 BF16, 3 AVX2, 4 AVX-512) and its
// [from, to] rows.
extern "C" int JaxinferMatmulWidePath(int64_t* from, int64_t* to) {
  const Problem::Wide wide = wide_path();
  *from = wide == Problem::Wide::kNone ? 0 : kWideMinRows;
#if defined(JAXINFER_AVX512)
  if (wide == Problem::Wide::kAvx512) {
    *to = kAvx512MaxRows;
    return static_cast<int>(wide);
  }
#endif
  *to = wide == Problem::Wide::kNone ? 0 : kWideMaxRows;
  return static_cast<int>(wide);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferBf16Matmul, Bf16MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // x
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // w
                                  .Ret<ffi::Buffer<ffi::F32>>()    // out
                                  .Attr<bool>("kn"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferF32Matmul, F32MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w [K, N], in strips
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [M, N]
