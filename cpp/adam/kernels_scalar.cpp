// Portable kernels (compiled without ISA flags).
// The shared headers' helpers are this file's own (an inline namespace per instruction set): the linker must
// never keep an AVX-512 build of one for the AVX2 or scalar kernels to call.
#define ZINF_ISA isa_scalar
#include "kernel_scalar_body.h"

namespace zinf::adam {
namespace {

template <DType G, DType O, DType S>
struct ScalarRange {
  static void run(const AdamArgs& a, size_t b, size_t e) { adam_scalar_range<G, O, S>(a, b, e); }
};

void adam(const AdamArgs& a, size_t b, size_t e) { dispatch_adam<ScalarRange>(a, b, e); }

double sumsq(const void* d, DType t, size_t b, size_t e) {
  switch (t) {
    case DType::kBFloat16: return sumsq_scalar_range<DType::kBFloat16>(d, b, e);
    case DType::kFloat16: return sumsq_scalar_range<DType::kFloat16>(d, b, e);
    default: return sumsq_scalar_range<DType::kFloat32>(d, b, e);
  }
}

}  // namespace

Kernels kernels_scalar() { return {adam, sumsq, stream_scalar_range}; }

}  // namespace zinf::adam
