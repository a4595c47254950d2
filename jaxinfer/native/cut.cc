// The sampler's top-k and top-p cuts on the CPU, as an XLA FFI custom call (jaxinfer.native.cut_thresholds,
// used by jaxinfer.sampling.keep_mask).
//
// A cut is a per-row threshold on the tokens' order keys (uint32 keys whose unsigned order is their
// logits' float order): the largest key m such that the tokens with key >= m still weigh at least
// the row's target - k tokens for top-k (each weighs 1), p of the probability for top-p. The
// pure-JAX search (sampling._largest_threshold) finds m one bit at a time: 32 passes over the row,
// ~38 ms for [48, 32000] flat logits on 2 cores of an Intel Xeon, where the candidate blocks that
// shorten a peaked row's search cannot hold a nucleus of thousands of tokens. Here it is found in
// three radix passes (11, 11 and 10 bits of the key): each pass weighs the tokens that share the
// digits found so far into one bin per value of the next digit, and the largest digit whose bins
// from the top still reach the target is the threshold's next digit. Two passes read the row; the
// third reads only the keys the second kept. Weights are summed in double (counts
// in integers), so a top-p cut is the float64 cut of the float32 probabilities, where the pure-JAX
// search sums them in float32: the two differ only where a cut's mass is within float32 rounding of p.
//
// Rows are work items taken from one atomic counter by the calling thread and by tasks on XLA's
// intra-op thread pool; a row's threshold depends on nothing but its row.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Problem {
  const uint32_t* keys = nullptr;  // [B, V]
  const float* weights = nullptr;  // [B, V] (top-p: the probabilities), or null: every token weighs 1
  const float* target = nullptr;   // [B]: k or p
  uint32_t* out = nullptr;         // [B]
  int64_t B = 0, V = 0;
};

struct Shared {
  Problem problem;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable all_done;
};

constexpr int kShifts[] = {21, 10, 0};  // the digits: key bits 31..21, 20..10, 9..0
constexpr int kBits[] = {11, 11, 10};
// Rows of fewer keys than this in all run on the calling thread only (a helper's wake-up costs more).
constexpr int64_t kSmallProblem = 1 << 16;

// The largest digit d with base + bins[d..] >= target, and base + bins[d + 1..]. Where rounding
// leaves none (the level above found the prefix reaching the target), the digit is 0, as the
// bit-by-bit search leaves a bit it cannot set.
template <class Sum>
std::pair<uint32_t, Sum> pick_digit(const Sum* bins, int64_t width, Sum base, Sum target) {
  Sum acc = base;
  for (int64_t d = width - 1; d > 0; --d) {
    if (acc + bins[d] >= target) return {static_cast<uint32_t>(d), acc};
    acc += bins[d];
  }
  return {0, acc};
}

// What one thread keeps between rows: the bins, and the keys (with their weights) that share the
// first two digits found.
template <class Sum>
struct Scratch {
  std::vector<Sum> bins;
  std::vector<uint32_t> keys;
  std::vector<float> weights;
};

// The largest m with weight(keys >= m) >= target for one row (Sum int64_t: every token weighs 1,
// `weights` unread; double: the tokens' `weights`); 0 where even the whole row falls short.
// Two passes over the row (the first digit; the second, keeping the keys that share both), then one
// over the keys kept. A token of weight 0 weighs nothing and is skipped.
template <class Sum>
uint32_t row_threshold(const uint32_t* keys, const float* weights, int64_t V, Sum target, Scratch<Sum>& s) {
  constexpr bool kCounts = std::is_same_v<Sum, int64_t>;
  // Pass 1: the top digit. Four interleaved sets of bins break the chains of adds to one bin (a
  // row's keys crowd into a few values of their exponent).
  constexpr int kSets = 4;
  const int64_t w0 = int64_t{1} << kBits[0];
  s.bins.assign(kSets * w0, Sum(0));
  Sum* bins = s.bins.data();
  int64_t v = 0;
  for (; v + kSets <= V; v += kSets) {
    for (int j = 0; j < kSets; ++j) {
      if constexpr (kCounts) {
        bins[j * w0 + (keys[v + j] >> kShifts[0])] += 1;
      } else {
        bins[j * w0 + (keys[v + j] >> kShifts[0])] += weights[v + j];
      }
    }
  }
  for (; v < V; ++v) bins[keys[v] >> kShifts[0]] += kCounts ? Sum(1) : Sum(weights[v]);
  for (int j = 1; j < kSets; ++j) {
    for (int64_t d = 0; d < w0; ++d) bins[d] += bins[j * w0 + d];
  }
  auto [d0, base0] = pick_digit<Sum>(bins, w0, Sum(0), target);
  // Pass 2: the second digit among the keys of that first digit, which are kept for pass 3.
  const int64_t w1 = int64_t{1} << kBits[1];
  s.bins.assign(w1, Sum(0));
  bins = s.bins.data();
  s.keys.clear();
  s.weights.clear();
  const uint32_t mask1 = static_cast<uint32_t>(w1 - 1);
  for (v = 0; v < V; ++v) {
    const uint32_t key = keys[v];
    if ((key >> kShifts[0]) != d0) continue;
    if constexpr (kCounts) {
      bins[(key >> kShifts[1]) & mask1] += 1;
      s.keys.push_back(key);
    } else {
      const float w = weights[v];
      if (w == 0.0f) continue;
      bins[(key >> kShifts[1]) & mask1] += w;
      s.keys.push_back(key);
      s.weights.push_back(w);
    }
  }
  auto [d1, base1] = pick_digit<Sum>(bins, w1, base0, target);
  // Pass 3: the last digit among the kept keys of both digits.
  const int64_t w2 = int64_t{1} << kBits[2];
  s.bins.assign(w2, Sum(0));
  bins = s.bins.data();
  const uint32_t high = (d0 << kShifts[0]) | (d1 << kShifts[1]);
  const uint32_t mask2 = static_cast<uint32_t>(w2 - 1);
  for (size_t i = 0; i < s.keys.size(); ++i) {
    const uint32_t key = s.keys[i];
    if ((key >> kShifts[1]) != (high >> kShifts[1])) continue;
    bins[key & mask2] += kCounts ? Sum(1) : Sum(s.weights[i]);
  }
  auto [d2, base2] = pick_digit<Sum>(bins, w2, base1, target);
  (void)base2;
  return high | d2;
}

void drain(Shared& s) {
  const Problem& p = s.problem;
  thread_local Scratch<double> masses;
  thread_local Scratch<int64_t> counts;
  for (int64_t b; (b = s.next.fetch_add(1, std::memory_order_relaxed)) < p.B;) {
    const uint32_t* keys = p.keys + b * p.V;
    if (!(p.target[b] > 0.0f)) {
      // Nothing to reach: even the empty set of keys >= the largest one weighs that much. (How a
      // caller marks the rows that do not use the cut: they cost no pass.)
      p.out[b] = 0xFFFFFFFFu;
    } else if (p.weights != nullptr) {
      p.out[b] = row_threshold<double>(keys, p.weights + b * p.V, p.V, double{p.target[b]}, masses);
    } else {
      // A count of k tokens: k is a whole number in float32 up to 2^24, far past any vocabulary.
      p.out[b] = row_threshold<int64_t>(keys, nullptr, p.V, static_cast<int64_t>(p.target[b]), counts);
    }
    if (s.done.fetch_add(1, std::memory_order_acq_rel) + 1 == p.B) {
      std::lock_guard<std::mutex> lock(s.mu);
      s.all_done.notify_all();
    }
  }
}

ffi::Error CutImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> keys, ffi::Buffer<ffi::F32> weights,
                   ffi::Buffer<ffi::F32> target, ffi::Result<ffi::Buffer<ffi::U32>> out, bool counts) {
  auto kd = keys.dimensions();
  auto wd = weights.dimensions();
  if (kd.size() != 2 || target.dimensions().size() != 1 || target.dimensions()[0] != kd[0] ||
      out->dimensions().size() != 1 || out->dimensions()[0] != kd[0]) {
    return ffi::Error::InvalidArgument("keys [B, V], target [B] and out [B] expected");
  }
  if (!counts && (wd.size() != 2 || wd[0] != kd[0] || wd[1] != kd[1])) {
    return ffi::Error::InvalidArgument("weights must be [B, V], as keys, for a cut by weight");
  }
  auto shared = std::make_shared<Shared>();
  Problem& p = shared->problem;
  p.B = kd[0], p.V = kd[1];
  p.keys = keys.typed_data();
  p.weights = counts ? nullptr : weights.typed_data();
  p.target = target.typed_data();
  p.out = out->typed_data();
  if (p.B == 0) return ffi::Error::Success();
  const int64_t helpers =
      p.B * p.V < kSmallProblem ? 0 : std::clamp<int64_t>(pool.num_threads() - 1, 0, p.B - 1);
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([shared] { drain(*shared); });
  }
  drain(*shared);
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->all_done.wait(lock, [&] { return shared->done.load(std::memory_order_acquire) == shared->problem.B; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferCut, CutImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U32>>()  // keys
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weights ([1] for counts)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // target
                                  .Ret<ffi::Buffer<ffi::U32>>()  // out
                                  .Attr<bool>("counts"));
