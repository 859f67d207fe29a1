// What the GGUF kernels (gguf.cpp: exact fp32; gguf_q8.cpp: int8 activations) share about the
// block formats: fp16 scales read exactly, Q4_K's 6-bit scales and mins unpacked, and the k-quant
// codes of weight k of a block as the scalar paths read them.
#pragma once

#include <cstdint>
#include <cstring>

#include <immintrin.h>

namespace cascade_native {

inline float half_to_float(uint16_t h) {  // exact (every fp16 is an fp32), subnormals included
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu, bits;
  if (exponent == 0x1Fu) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: mantissa * 2^-24, normalized
    exponent = 113u;
    while (!(mantissa & 0x400u)) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return half_to_float(h);
}

// The same value by F16C's conversion (exact too; every AVX2 / AVX-512 CPU the vector paths run on
// has it): the bit-level one above costs a dozen branchy instructions per scale on the hot path.
__attribute__((target("f16c"))) inline float f16_hw(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return _cvtsh_ss(h);
}

// Q4_K's 12 bytes of 6-bit fields -> four 32-bit words whose bytes are sc[0..7] then m[0..7]
// (ggml's get_scale_min_k4, as llama.cpp unpacks it). Kept in registers: a vector load of
// them from memory right after these scalar stores would wait on store forwarding.
struct ScalesMins {
  uint32_t word[4];
  uint8_t byte(int i) const { return static_cast<uint8_t>(word[i / 4] >> (8 * (i % 4))); }
};

inline ScalesMins q4k_scales_mins(const uint8_t* scales) {
  uint32_t u[3];
  std::memcpy(u, scales, 12);
  const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, low2 = 0x03030303u;
  return {{u[0] & low6, (u[2] & low4) | (((u[0] >> 6) & low2) << 4), u[1] & low6,
           ((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4)}};
}

// Q4_K: the 4-bit code of weight k (sub-block j = k / 32: low nibbles of the 32-byte chunk j / 2
// for even j, high nibbles for odd j). b is the block.
inline int q4k_code(const uint8_t* b, int k) {
  const int j = k / 32;
  return (b[16 + 32 * (j / 2) + k % 32] >> (4 * (j % 2))) & 0xF;
}

// Q6_K: the 6-bit code (0..63) of weight k = 128 h + 32 t + i: low bits from ql[64 h + 32 (t & 1)
// + i] (nibble t >> 1), high bits from qh[32 h + i] (bits 2t, 2t + 1). b is the block.
inline int q6k_code(const uint8_t* b, int k) {
  const int h = k / 128, t = (k % 128) / 32, i = k % 32;
  return ((b[64 * h + 32 * (t & 1) + i] >> (4 * (t >> 1))) & 0xF) | (((b[128 + 32 * h + i] >> (2 * t)) & 3) << 4);
}

}  // namespace cascade_native
