// A streaming read of a buffer at the kernels' own prefetch distance, on torch's threads: the
// read-bandwidth bound the roofline divides by (cascade/timing.py: ReadProbe). Each thread reads
// one contiguous range, as the linear kernels' threads read their panels, 256 bytes per step with
// a prefetch PREFETCH_BYTES ahead of every cache line, into L1 (T0, as the fp16 / int4 kernels
// prefetch) or into L2 (T1, as gguf_q8's tiles do; a stream of T0 prefetches can hold the core's
// few L1 miss buffers): the probe times both and the bound is the faster. The loads are folded by
// XOR so that they cannot be dropped. Nothing the kernels do reads memory with less work per byte, so a kernel's
// "% of bound" above ~100% means the probe is wrong, not that the kernel beat memory.

#include <atomic>

#include "kernels.h"
#include "ops.h"

namespace cascade_native {
namespace {

template <int HINT>
__attribute__((target("avx512f"))) uint64_t fold_avx512(const uint8_t* p, int64_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 256 <= n; i += 256) {
    for (int line = 0; line < 256; line += 64) prefetch_ahead<HINT>(p + i + line);
    a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(p + i));
    a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(p + i + 64));
    a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(p + i + 128));
    a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(p + i + 192));
  }
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
  uint64_t folded = 0;
  for (uint64_t v : lanes) folded ^= v;
  for (; i < n; ++i) folded ^= p[i];
  return folded;
}

template <int HINT>
__attribute__((target("avx2"))) uint64_t fold_avx2(const uint8_t* p, int64_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 128 <= n; i += 128) {
    prefetch_ahead<HINT>(p + i);
    prefetch_ahead<HINT>(p + i + 64);
    a0 = _mm256_xor_si256(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_xor_si256(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    a2 = _mm256_xor_si256(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    a3 = _mm256_xor_si256(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3)));
  uint64_t folded = lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
  for (; i < n; ++i) folded ^= p[i];
  return folded;
}

}  // namespace

int64_t stream_read(const torch::Tensor& buffer, bool into_l2) {
  TORCH_CHECK(isa() != Isa::none, "cascade native kernels need AVX2 + FMA + F16C or AVX-512");
  expect(buffer, "stream_read", "buffer", torch::kUInt8, Layout::contiguous);
  const uint8_t* p = buffer.data_ptr<uint8_t>();
  const int64_t n = buffer.numel();
  const bool wide = isa() == Isa::avx512;
  std::atomic<uint64_t> folded{0};
  at::parallel_for(0, n, 1 << 20, [&](int64_t begin, int64_t end) {  // one contiguous range per thread
    const int64_t len = end - begin;
    folded.fetch_xor(wide ? (into_l2 ? fold_avx512<_MM_HINT_T1>(p + begin, len) : fold_avx512<_MM_HINT_T0>(p + begin, len))
                          : (into_l2 ? fold_avx2<_MM_HINT_T1>(p + begin, len) : fold_avx2<_MM_HINT_T0>(p + begin, len)));
  });
  return static_cast<int64_t>(folded.load());
}

}  // namespace cascade_native
