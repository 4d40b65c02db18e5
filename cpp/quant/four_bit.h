// 4-bit block quantization as bitsandbytes does it on the CPU (NF4 / FP4 codes, one scale per block), and its
// decoding: see [Note: 4-bit shards] in core/zinf/param/four_bit.py.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zinf::quant {

// out[i] = code[nibble i] * scales[i / blocksize] in fp32, written as fp32 (out_bf16 false) or rounded to nearest
// even bf16 (as torch casts). Nibble i is the high half of byte i / 2 when i is even. n is a multiple of blocksize.
void decode_four_bit(const uint8_t* codes, const float* scales, void* out, size_t n, size_t blocksize,
                     const float* code, bool out_bf16, int threads);

// bitsandbytes' quantize_4bit (its CPU path, backends/default/ops.py) of n fp32 values: absmax per block of
// blocksize (the last, partial block's clamped to 1e-38 and divided by, as there), each value scaled into [-1, 1]
// and given the index of the first of the 15 midpoints not below it, mapped through order[16]; codes packed two a
// byte, high nibble first, an odd count padded with the code of 0.
void encode_four_bit(const float* values, size_t n, size_t blocksize, const float* midpoints, const uint8_t* order,
                     uint8_t* codes, float* absmax, int threads);

// The absmax of each block (the same rule as encode_four_bit), without encoding.
void block_absmax(const float* values, size_t n, size_t blocksize, float* absmax, int threads);

}  // namespace zinf::quant
