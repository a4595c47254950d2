// Writes new keys or values into their cache slots in place, as an XLA FFI custom call whose
// output aliases the pool (jaxinfer.native.kv_write).
//
// pool [K, P, S, H] and new [K, N, H] of one whole-byte dtype (the bytes are copied, no arithmetic;
// sub-byte dtypes, which XLA packs, are refused in Python), page [N] and offset [N] int32: new[:, n]
// goes to pool[:, page[n], offset[n]].
//
// Why it exists: XLA CPU computes a scatter into a 16-bit float pool in float32 - the whole pool
// converted to float32 and back around the update, every step, ~2-6 ms per layer's 16 MB pool
// where the update is a few hundred bytes (WORKSPACE.md, 2026-12-01). A float32 pool is updated in
// place by XLA itself and does not come here.

#include <cstdint>
#include <cstring>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error KvWriteImpl(ffi::AnyBuffer pool, ffi::AnyBuffer values, ffi::Buffer<ffi::S32> page,
                       ffi::Buffer<ffi::S32> offset, ffi::Result<ffi::AnyBuffer> out) {
  auto pd = pool.dimensions();
  auto vd = values.dimensions();
  if (pd.size() != 4 || vd.size() != 3 || page.element_count() != offset.element_count()) {
    return ffi::Error::InvalidArgument("pool [K, P, S, H], values [K, N, H], page [N] and offset [N] expected");
  }
  const int64_t K = pd[0], P = pd[1], S = pd[2], H = pd[3], N = vd[1];
  if (vd[0] != K || vd[2] != H || static_cast<int64_t>(page.element_count()) != N ||
      values.element_type() != pool.element_type() || out->element_type() != pool.element_type()) {
    return ffi::Error::InvalidArgument("values must be [K, N, H] in the pool's dtype, with N pages and offsets");
  }
  const int64_t row = H * static_cast<int64_t>(ffi::ByteWidth(pool.element_type()));
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != pool.untyped_data()) std::memcpy(dst, pool.untyped_data(), pool.size_bytes());
  const char* src = static_cast<const char*>(values.untyped_data());
  const int32_t* pages = page.typed_data();
  const int32_t* offsets = offset.typed_data();
  for (int64_t n = 0; n < N; ++n) {  // checked first: a bad slot writes nothing at all
    if (pages[n] < 0 || pages[n] >= P || offsets[n] < 0 || offsets[n] >= S) {
      return ffi::Error::InvalidArgument("slot " + std::to_string(n) + " is page " + std::to_string(pages[n]) +
                                         ", offset " + std::to_string(offsets[n]) + ": outside the pool's " +
                                         std::to_string(P) + " pages of " + std::to_string(S));
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t n = 0; n < N; ++n) {
      std::memcpy(dst + ((k * P + pages[n]) * S + offsets[n]) * row, src + (k * N + n) * row, row);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferKvWrite, KvWriteImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // pool
                                  .Arg<ffi::AnyBuffer>()         // values
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page
                                  .Arg<ffi::Buffer<ffi::S32>>()  // offset
                                  .Ret<ffi::AnyBuffer>());       // out (aliases pool)
