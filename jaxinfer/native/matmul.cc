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
//
// Work is split into blocks of output columns ("kn") or rows of w ("nk"), taken from one atomic
// counter by the calling thread and by tasks on XLA's intra-op thread pool. Every output element is
// summed in the same order whatever M, the block it falls in or the thread that computes it: "kn"
// in k order, one fused multiply-add at a time; "nk" in 16 lanes (lane = k mod 16), each in k order,
// then the lanes in a fixed tree. So a row's result does not depend on the other rows of its batch.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
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
constexpr int64_t kLanes = 16;

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
  const int64_t body = N - N % kLanes;
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    const uint16_t* w0 = p.w + (k0 + r) * N;
    const uint16_t *w1 = w0 + N, *w2 = w1 + N, *w3 = w2 + N;
    const bool prefetch = r + kPrefetchRows + 4 <= rows;
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j < body; j += kLanes) {
      if (prefetch && (j & 31) == 0) {  // once per 64-byte line of each of the four rows
        const char* ahead = reinterpret_cast<const char*>(w0 + kPrefetchRows * N + j);
        for (int64_t i = 0; i < 4; ++i) _mm_prefetch(ahead + i * N * sizeof(uint16_t), _MM_HINT_T0);
      }
      const __m512 v0 = load_bf16x16(w0 + j), v1 = load_bf16x16(w1 + j);
      const __m512 v2 = load_bf16x16(w2 + j), v3 = load_bf16x16(w3 + j);
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = xf.data() + m * rows + r;
        float* a = acc + m * N + j;
        __m512 s = _mm512_loadu_ps(a);
        s = _mm512_fmadd_ps(_mm512_set1_ps(xm[0]), v0, s);
        s = _mm512_fmadd_ps(_mm512_set1_ps(xm[1]), v1, s);
        s = _mm512_fmadd_ps(_mm512_set1_ps(xm[2]), v2, s);
        s = _mm512_fmadd_ps(_mm512_set1_ps(xm[3]), v3, s);
        _mm512_storeu_ps(a, s);
      }
    }
#endif
    for (; j < N; ++j) {
      const float f0 = bf16_to_f32(w0[j]), f1 = bf16_to_f32(w1[j]), f2 = bf16_to_f32(w2[j]), f3 = bf16_to_f32(w3[j]);
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = xf.data() + m * rows + r;
        float& a = acc[m * N + j];
        a = std::fma(xm[3], f3, std::fma(xm[2], f2, std::fma(xm[1], f1, std::fma(xm[0], f0, a))));
      }
    }
  }
  for (; r < rows; ++r) {
    const uint16_t* wr = p.w + (k0 + r) * N;
    for (int64_t j = 0; j < N; ++j) {
      const float f = bf16_to_f32(wr[j]);
      for (int64_t m = 0; m < M; ++m) acc[m * N + j] = std::fma(xf[m * rows + r], f, acc[m * N + j]);
    }
  }
}

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
  for (int64_t n = n0; n < n1; ++n) {
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

void drain(Shared& s) {
  const Problem& p = s.problem;
  for (int64_t i; (i = s.next.fetch_add(1, std::memory_order_relaxed)) < p.items;) {
    if (p.kn) {
      const int64_t k0 = i * kChunkRows;
      kn_chunk(p, k0, std::min(kChunkRows, p.K - k0), p.partials + i * p.M * p.N);
    } else {
      nk_block(p, i * p.block, std::min(p.N, (i + 1) * p.block));
    }
    if (s.done.fetch_add(1, std::memory_order_acq_rel) + 1 == p.items) {
      std::lock_guard<std::mutex> lock(s.mu);
      s.all_done.notify_all();
    }
  }
}

void run(ffi::ThreadPool& pool, const std::shared_ptr<Shared>& shared) {
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), shared->problem.items - 1);
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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferBf16Matmul, Bf16MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // x
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // w
                                  .Ret<ffi::Buffer<ffi::F32>>()    // out
                                  .Attr<bool>("kn"));
