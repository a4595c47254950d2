// Paged attention for the CPU, as an XLA FFI custom call: the "native" attention backend.
//
// Same contract as jaxinfer.attention.reference_paged_attention: queries [B, T, N, H] over each
// row's cached pages (the new K/V already written), causal, with an optional sliding window and
// logit soft cap. As in the Pallas kernels, a row's q_lens[b] new tokens are the last of its
// kv_lens[b] cached ones (query t sits at position kv_lens - q_lens + t); query tokens past q_lens
// are padding and come back as zeros. Pools are head-major [K, P, S, H] in float32, bfloat16 or int8 (int8 with one
// float32 scale per token and KV head, [K, P, S]).
//
// Why it exists: XLA CPU runs a page gather as an element-by-element loop (~12 GB/s on these cores)
// and a batched dot of decode's tiny [G, H] x [H, S] matrices as one Eigen call per (row, KV head).
// Here each (row, query token, KV head) item reads its keys and values straight out of their pages
// (a page holds S x H contiguous values per KV head) once, with the G query heads of the group kept
// in registers, so decode attention streams the cache at memory speed.
//
// Work is split into (row, KV head, query token) items, taken from one atomic counter by the
// calling thread and by tasks scheduled on XLA's intra-op thread pool. Every item is computed the
// same way whatever else is in the batch, so a row's result does not depend on its neighbours.
//
// Numerics: float32 throughout; a two-pass softmax over the visible keys (scores, then max, exp,
// sum), so there is no online rescaling. A query that sees no key (a padding row, length 0) gives 0.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float bf16_to_f32(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept quiet
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

enum class Kind { kF32, kBF16, kI8 };

using PageScoresFn = void (*)(const float* q, const float* k, int64_t ns, float* out, int64_t stride, int64_t G,
                              int64_t H);
using PageAccumulateFn = void (*)(const float* w, int64_t stride, const float* v, int64_t ns, float* acc, int64_t G,
                                  int64_t H);

struct Problem {
  int64_t B, T, N, H, K, P, S, MP, G;
  Kind q_kind, kv_kind;
  const void* q;
  const void* k_pages;
  const void* v_pages;
  const float* k_scales;
  const float* v_scales;
  const int32_t* page_table;
  const int32_t* kv_lens;
  const int32_t* q_lens;
  void* out;
  float scale;
  int64_t window;  // 0: none
  float soft_cap;  // 0: none
  PageScoresFn page_scores;
  PageAccumulateFn page_accumulate;
};

// The two inner loops, over the rows of one page (ns tokens, float32, [ns, H] contiguous):
//   page_scores:     out[g * stride + s] = q_g . k_s                      (q [G, H], scale folded in)
//   page_accumulate: acc[g] += sum_s w[g * stride + s] * v_s             (acc [G, H])
// Generic versions for any G and H, and vectorised ones for the common head sizes (a multiple of 16
// floats, one 64-byte vector each) and group sizes, where the compiler keeps the row and a tile of
// accumulators in registers. GCC/Clang vector extensions: AVX-512 where the CPU has it, pairs of
// AVX2 registers or NEON quads elsewhere.

void page_scores_any(const float* q, const float* k, int64_t ns, float* out, int64_t stride, int64_t G, int64_t H) {
  for (int64_t s = 0; s < ns; ++s) {
    for (int64_t g = 0; g < G; ++g) {
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t h = 0; h < H; ++h) dot += q[g * H + h] * k[s * H + h];
      out[g * stride + s] = dot;
    }
  }
}

void page_accumulate_any(const float* w, int64_t stride, const float* v, int64_t ns, float* acc, int64_t G,
                         int64_t H) {
  for (int64_t s = 0; s < ns; ++s) {
    for (int64_t g = 0; g < G; ++g) {
      const float wg = w[g * stride + s];
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) acc[g * H + h] += wg * v[s * H + h];
    }
  }
}

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

inline f32x16 load16(const float* p) {
  f32x16 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, f32x16 v) { __builtin_memcpy(p, &v, sizeof(v)); }

inline f32x16 splat16(float x) { return f32x16{} + x; }

inline float sum16(f32x16 v) {
  v += __builtin_shuffle(v, i32x16{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, i32x16{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v += __builtin_shuffle(v, i32x16{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v += __builtin_shuffle(v, i32x16{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return v[0];
}

// e^x for 16 floats at once (x <= 0 here: logits minus their max): 2^n * e^f with n = round(x / ln 2)
// and |f| <= ln(2) / 2, e^f by its degree-6 Taylor polynomial (relative error < 2e-7, about 2 ulp).
// Below -87 (e^x under float32's normal range) it gives 0, so padding set to -inf weighs nothing.
inline f32x16 exp16(f32x16 x) {
  const f32x16 clamped = x < -87.0f ? splat16(-87.0f) : x;
  const f32x16 magic = splat16(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const f32x16 n = (clamped * 1.44269504088896341f + magic) - magic;
  const f32x16 f = clamped - n * 0.693145751953125f - n * 1.428606765330187e-06f;  // ln 2 in two parts
  f32x16 poly = splat16(1.0f / 720);
  poly = poly * f + 1.0f / 120;
  poly = poly * f + 1.0f / 24;
  poly = poly * f + 1.0f / 6;
  poly = poly * f + 0.5f;
  poly = poly * f + 1.0f;
  poly = poly * f + 1.0f;
  i32x16 bits;
  __builtin_memcpy(&bits, &poly, sizeof(bits));
  bits += __builtin_convertvector(n, i32x16) << 23;
  f32x16 result;
  __builtin_memcpy(&result, &bits, sizeof(result));
  return x < -87.0f ? splat16(0.0f) : result;
}

// Softmax of one query head's scores in place: s holds n16 (a multiple of 16) values, those past
// the visible keys set to -inf.
void softmax16(float* s, int64_t n16) {
  f32x16 m = splat16(-INFINITY);
  for (int64_t j = 0; j < n16; j += 16) {
    const f32x16 x = load16(s + j);
    m = x > m ? x : m;
  }
  float mx = m[0];
  for (int64_t l = 1; l < 16; ++l) mx = std::max(mx, m[l]);
  f32x16 sum = splat16(0.0f);
  for (int64_t j = 0; j < n16; j += 16) {
    const f32x16 e = exp16(load16(s + j) - mx);
    store16(s + j, e);
    sum += e;
  }
  const float inv = 1.0f / sum16(sum);
  for (int64_t j = 0; j < n16; j += 16) store16(s + j, load16(s + j) * inv);
}

template <int64_t GG, int64_t HH>
void page_scores_fixed(const float* q, const float* k, int64_t ns, float* out, int64_t stride, int64_t, int64_t) {
  constexpr int64_t C = HH / 16;
  for (int64_t s = 0; s < ns; ++s) {
    f32x16 row[C];
    for (int64_t c = 0; c < C; ++c) row[c] = load16(k + s * HH + c * 16);
    for (int64_t g = 0; g < GG; ++g) {
      f32x16 dot = load16(q + g * HH) * row[0];
      for (int64_t c = 1; c < C; ++c) dot += load16(q + g * HH + c * 16) * row[c];
      out[g * stride + s] = sum16(dot);
    }
  }
}

template <int64_t GG, int64_t HH>
void page_accumulate_fixed(const float* w, int64_t stride, const float* v, int64_t ns, float* acc, int64_t, int64_t) {
  constexpr int64_t C = HH / 16;
  constexpr int64_t kTile = 16;  // accumulator vectors held in registers at once
  constexpr int64_t GB = C >= kTile ? 1 : (GG < kTile / C ? GG : kTile / C);  // query heads per tile
  for (int64_t g0 = 0; g0 < GG; g0 += GB) {
    f32x16 a[GB][C];
    for (int64_t g = 0; g < GB; ++g)
      for (int64_t c = 0; c < C; ++c) a[g][c] = load16(acc + (g0 + g) * HH + c * 16);
    for (int64_t s = 0; s < ns; ++s) {
      for (int64_t g = 0; g < GB; ++g) {
        const f32x16 wg = splat16(w[(g0 + g) * stride + s]);
        for (int64_t c = 0; c < C; ++c) a[g][c] += wg * load16(v + s * HH + c * 16);
      }
    }
    for (int64_t g = 0; g < GB; ++g)
      for (int64_t c = 0; c < C; ++c) store16(acc + (g0 + g) * HH + c * 16, a[g][c]);
  }
}

template <int64_t HH>
bool fixed_for_head_size(int64_t G, PageScoresFn* scores, PageAccumulateFn* accumulate) {
  switch (G) {
    case 1:
      *scores = page_scores_fixed<1, HH>, *accumulate = page_accumulate_fixed<1, HH>;
      return true;
    case 2:
      *scores = page_scores_fixed<2, HH>, *accumulate = page_accumulate_fixed<2, HH>;
      return true;
    case 4:
      *scores = page_scores_fixed<4, HH>, *accumulate = page_accumulate_fixed<4, HH>;
      return true;
    case 8:
      *scores = page_scores_fixed<8, HH>, *accumulate = page_accumulate_fixed<8, HH>;
      return true;
    default:
      return false;
  }
}

void choose_page_kernels(int64_t G, int64_t H, PageScoresFn* scores, PageAccumulateFn* accumulate) {
  bool fixed = false;
  switch (H) {
    case 64:
      fixed = fixed_for_head_size<64>(G, scores, accumulate);
      break;
    case 128:
      fixed = fixed_for_head_size<128>(G, scores, accumulate);
      break;
    case 256:
      fixed = fixed_for_head_size<256>(G, scores, accumulate);
      break;
    default:
      break;
  }
  if (!fixed) *scores = page_scores_any, *accumulate = page_accumulate_any;
}

// Rows of one page of KV head kh as float32: a pointer into the pool for float32 pools, else the
// slots [s0, s1) converted into buf (laid out as the page is: slot s at buf + s * H).
template <Kind KV>
inline const float* page_rows(const Problem& p, const void* pool, const float* scales, int32_t page, int64_t kh,
                              int64_t s0, int64_t s1, int64_t H, float* buf) {
  const int64_t base = (kh * p.P + page) * p.S;
  if constexpr (KV == Kind::kF32) {
    return static_cast<const float*>(pool) + base * H;
  } else if constexpr (KV == Kind::kBF16) {
    const uint16_t* src = static_cast<const uint16_t*>(pool) + base * H;
    for (int64_t i = s0 * H; i < s1 * H; ++i) buf[i] = bf16_to_f32(src[i]);
    return buf;
  } else {
    const int8_t* src = static_cast<const int8_t*>(pool) + base * H;
    for (int64_t s = s0; s < s1; ++s) {
      const float scale = scales[base + s];
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) buf[s * H + h] = static_cast<float>(src[s * H + h]) * scale;
    }
    return buf;
  }
}

// Asks for the page `ahead` pages past `first` (context position) to be brought into cache while the
// current one is computed: rows' pages lie anywhere in the pool, so the hardware prefetcher, which
// stops at 4 KiB boundaries, cannot run ahead across them.
template <Kind KV>
inline void prefetch_page(const Problem& p, const void* pool, const int32_t* table, int64_t kh, int64_t first,
                          int64_t hi, int64_t H, int64_t ahead) {
  const int64_t next = first + ahead * p.S;
  if (next >= hi) return;
  const int64_t width = KV == Kind::kF32 ? 4 : KV == Kind::kBF16 ? 2 : 1;
  const char* start = static_cast<const char*>(pool) + ((kh * p.P + table[next / p.S]) * p.S) * H * width;
  for (int64_t off = 0; off < p.S * H * width; off += 64) __builtin_prefetch(start + off);
}

// How far ahead of pass 1's page its prefetches run, in pages, for keys and for values.
constexpr int64_t kKeyPagesAhead = 8;
constexpr int64_t kValuePagesAhead = 4;

// Attention of the G query heads of KV head kh, for query token t of row b. HH is the head size when
// it is one of the common ones (the loops over it then unroll), 0 for any other (read from p.H).
template <Kind KV>
void attend(const Problem& p, int64_t b, int64_t kh, int64_t t, std::vector<float>& scores, std::vector<float>& work) {
  const int64_t G = p.G, S = p.S, H = p.H;
  const int64_t q_base = ((b * p.T + t) * p.N + kh * G) * H;  // [G, H] block of this group
  float* qf = work.data();                                     // G * H
  float* acc = qf + G * H;                                     // G * H
  float* buf = acc + G * H;                                    // S * H: one converted page
  for (int64_t i = 0; i < G * H; ++i) {
    if (p.q_kind == Kind::kF32) {
      qf[i] = static_cast<const float*>(p.q)[q_base + i] * p.scale;
    } else {
      qf[i] = bf16_to_f32(static_cast<const uint16_t*>(p.q)[q_base + i]) * p.scale;
    }
    acc[i] = 0.0f;
  }

  const int64_t pos = p.kv_lens[b] - p.q_lens[b] + t;  // the row's new tokens end its context
  const int64_t hi = std::min<int64_t>({static_cast<int64_t>(p.kv_lens[b]), pos + 1, p.MP * S});
  const int64_t lo = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
  const int64_t n = hi - lo;
  const int64_t n16 = (n + 15) / 16 * 16;  // each query head's scores, padded to whole vectors
  const int32_t* table = p.page_table + b * p.MP;

  if (n > 0) {
    if (static_cast<int64_t>(scores.size()) < G * n16) scores.resize(G * n16);
    // The pages the loop below never asks for: the first kKeyPagesAhead of keys and the first
    // kValuePagesAhead of values. Without these, half the key pages of a 256-token row came from
    // memory on demand (asking for them here: 1.07-1.10x for 8 layers at 48 rows x 256 tokens,
    // level at 1 x 192 and 4 x 1024; same bits; alternating calls in one process, 2026-12-07).
    for (int64_t ahead = 0; ahead < kKeyPagesAhead; ++ahead) {
      prefetch_page<KV>(p, p.k_pages, table, kh, lo - lo % S, hi, H, ahead);
    }
    for (int64_t ahead = 0; ahead < kValuePagesAhead; ++ahead) {
      prefetch_page<KV>(p, p.v_pages, table, kh, lo - lo % S, hi, H, ahead);
    }
    // Pass 1: scores[g, j] = q_g . k_j (the scale folded into q), page by page.
    for (int64_t first = lo - lo % S; first < hi; first += S) {
      const int64_t s0 = std::max(lo, first) - first, s1 = std::min(hi, first + S) - first;
      prefetch_page<KV>(p, p.k_pages, table, kh, first, hi, H, kKeyPagesAhead);
      prefetch_page<KV>(p, p.v_pages, table, kh, first, hi, H, kValuePagesAhead);  // in cache by pass 2
      const float* rows = page_rows<KV>(p, p.k_pages, p.k_scales, table[first / S], kh, s0, s1, H, buf);
      p.page_scores(qf, rows + s0 * H, s1 - s0, scores.data() + (first + s0 - lo), n16, G, H);
    }
    // Softmax per query head, in place (soft-capped first); the padding up to n16 weighs nothing.
    for (int64_t g = 0; g < G; ++g) {
      float* s = scores.data() + g * n16;
      if (p.soft_cap > 0.0f) {
        for (int64_t j = 0; j < n; ++j) s[j] = p.soft_cap * std::tanh(s[j] / p.soft_cap);
      }
      for (int64_t j = n; j < n16; ++j) s[j] = -INFINITY;
      softmax16(s, n16);
    }
    // Pass 2: acc[g] = sum_j p[g, j] v_j.
    for (int64_t first = lo - lo % S; first < hi; first += S) {
      const int64_t s0 = std::max(lo, first) - first, s1 = std::min(hi, first + S) - first;
      const float* rows = page_rows<KV>(p, p.v_pages, p.v_scales, table[first / S], kh, s0, s1, H, buf);
      p.page_accumulate(scores.data() + (first + s0 - lo), n16, rows + s0 * H, s1 - s0, acc, G, H);
    }
  }

  for (int64_t i = 0; i < G * H; ++i) {
    if (p.q_kind == Kind::kF32) {
      static_cast<float*>(p.out)[q_base + i] = acc[i];
    } else {
      static_cast<uint16_t*>(p.out)[q_base + i] = f32_to_bf16(acc[i]);
    }
  }
}

using AttendFn = void (*)(const Problem&, int64_t, int64_t, int64_t, std::vector<float>&, std::vector<float>&);

AttendFn attend_for(const Problem& p) {
  switch (p.kv_kind) {
    case Kind::kF32:
      return attend<Kind::kF32>;
    case Kind::kBF16:
      return attend<Kind::kBF16>;
    default:
      return attend<Kind::kI8>;
  }
}

struct Shared {
  Problem problem;
  int64_t items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Takes items off the shared counter until none is left. Item i is (b, kh, t) with t fastest, so a
// worker's consecutive items of a prompt chunk reuse the same pages from cache.
void drain(Shared& shared) {
  const Problem& p = shared.problem;
  const AttendFn attend_one = attend_for(p);
  thread_local std::vector<float> scores;
  thread_local std::vector<float> work;
  const int64_t need = (2 * p.G + p.S) * p.H;
  if (static_cast<int64_t>(work.size()) < need) work.resize(need);
  for (;;) {
    const int64_t i = shared.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= shared.items) return;
    const int64_t t = i % p.T;
    const int64_t kh = (i / p.T) % p.K;
    const int64_t b = i / (p.T * p.K);
    if (t < p.q_lens[b]) {
      attend_one(p, b, kh, t, scores, work);
    } else {  // a padding query token: zeros, never read
      const int64_t base = ((b * p.T + t) * p.N + kh * p.G) * p.H;
      const size_t width = p.q_kind == Kind::kF32 ? sizeof(float) : sizeof(uint16_t);
      std::memset(static_cast<char*>(p.out) + base * width, 0, p.G * p.H * width);
    }
    shared.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error kind_of(ffi::DataType dtype, bool allow_int8, const char* name, Kind* kind) {
  switch (dtype) {
    case ffi::DataType::F32:
      *kind = Kind::kF32;
      return ffi::Error::Success();
    case ffi::DataType::BF16:
      *kind = Kind::kBF16;
      return ffi::Error::Success();
    case ffi::DataType::S8:
      if (allow_int8) {
        *kind = Kind::kI8;
        return ffi::Error::Success();
      }
      break;
    default:
      break;
  }
  return ffi::Error::InvalidArgument(std::string(name) + ": unsupported dtype (float32, bfloat16" +
                                     (allow_int8 ? ", int8)" : ")"));
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                              ffi::Buffer<ffi::F32> k_scales, ffi::Buffer<ffi::F32> v_scales,
                              ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> q_lens,
                              ffi::Result<ffi::AnyBuffer> out, float scale, int64_t window, float soft_cap) {
  auto qd = q.dimensions();
  auto kd = k_pages.dimensions();
  auto td = page_table.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("q [B, T, N, H], pools [K, P, S, H] and page_table [B, MP] expected");
  }
  auto shared = std::make_shared<Shared>();
  Problem& p = shared->problem;
  p.B = qd[0], p.T = qd[1], p.N = qd[2], p.H = qd[3];
  p.K = kd[0], p.P = kd[1], p.S = kd[2], p.MP = td[1];
  if (kd[3] != p.H || p.K == 0 || p.N % p.K != 0 || td[0] != p.B) {
    return ffi::Error::InvalidArgument("q heads must be a multiple of the pools' KV heads, with the same head size");
  }
  p.G = p.N / p.K;
  if (auto e = kind_of(q.element_type(), false, "q", &p.q_kind); e.failure()) return e;
  if (auto e = kind_of(k_pages.element_type(), true, "k_pages", &p.kv_kind); e.failure()) return e;
  if (v_pages.element_type() != k_pages.element_type() || out->element_type() != q.element_type()) {
    return ffi::Error::InvalidArgument("v_pages must match k_pages, and the output q, in dtype");
  }
  p.q = q.untyped_data();
  p.k_pages = k_pages.untyped_data();
  p.v_pages = v_pages.untyped_data();
  p.k_scales = k_scales.typed_data();
  p.v_scales = v_scales.typed_data();
  p.page_table = page_table.typed_data();
  p.kv_lens = kv_lens.typed_data();
  p.q_lens = q_lens.typed_data();
  p.out = out->untyped_data();
  p.scale = scale;
  p.window = window;
  p.soft_cap = soft_cap;
  choose_page_kernels(p.G, p.H, &p.page_scores, &p.page_accumulate);

  // Never read outside the pools: every page a visible key lies in must be a real page. (The
  // engine's tables only hold such pages; a bad one here is a bug upstream, reported, not read.)
  for (int64_t b = 0; b < p.B; ++b) {
    int64_t hi = std::min<int64_t>(p.kv_lens[b], p.MP * p.S);
    for (int64_t i = 0; i * p.S < hi; ++i) {
      const int32_t page = p.page_table[b * p.MP + i];
      if (page < 0 || page >= p.P) {
        return ffi::Error::InvalidArgument("page_table[" + std::to_string(b) + ", " + std::to_string(i) +
                                           "] = " + std::to_string(page) + " is outside the pool's " +
                                           std::to_string(p.P) + " pages");
      }
    }
  }

  shared->items = p.B * p.K * p.T;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), shared->items - 1);
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([shared] { drain(*shared); });
  }
  drain(*shared);
  // Items another thread took are in progress; wait for them (a helper that starts late finds the
  // counter spent and touches nothing but `shared`, which it keeps alive).
  while (shared->done.load(std::memory_order_acquire) < shared->items) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()        // q
                                  .Arg<ffi::AnyBuffer>()        // k_pages
                                  .Arg<ffi::AnyBuffer>()        // v_pages
                                  .Arg<ffi::Buffer<ffi::F32>>() // k_scales
                                  .Arg<ffi::Buffer<ffi::F32>>() // v_scales
                                  .Arg<ffi::Buffer<ffi::S32>>() // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>() // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>() // q_lens
                                  .Ret<ffi::AnyBuffer>()        // out
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("soft_cap"));
