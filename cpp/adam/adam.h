// CPU Adam/AdamW on fp32 master weights with runtime SIMD dispatch and OpenMP.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace zinf::adam {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kNone = 3, kInt8 = 4 };
enum class SimdLevel : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// int8 moments: blocks of this many elements, each with a power-of-two scale ([Note: int8 moments]).
constexpr size_t kMomentBlock = 256;

// Everything one Adam step needs, with the per-step scalars already derived.
struct AdamArgs {
  float* param = nullptr;
  const void* grad = nullptr;
  DType grad_dtype = DType::kFloat32;
  void* exp_avg = nullptr;       // float32, bfloat16, or uint8 codes with state_dtype kInt8
  void* exp_avg_sq = nullptr;
  int8_t* exp_avg_scale = nullptr;     // kInt8: one power-of-two exponent per kMomentBlock elements
  int8_t* exp_avg_sq_scale = nullptr;
  DType state_dtype = DType::kFloat32;
  uint32_t seed = 0;            // bf16 moments: stochastic rounding bits are sr_bits(seed, index_base + i)
  uint32_t index_base = 0;
  void* param_out = nullptr;
  DType out_dtype = DType::kNone;
  float* grad_zero = nullptr;   // the fp32 gradient itself when the pass also zeroes it (else null)
  float grad_mul = 1.0f;        // clip_coef / grad_scale
  float one_minus_beta1 = 0.1f; // lerp weight of exp_avg
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  float eps = 1e-8f;
  float l2_decay = 0.0f;        // Adam: grad += l2_decay * param
  float decay_mul = 1.0f;       // AdamW: param *= decay_mul (1 - lr * wd)
  bool decoupled = false;
  float step_size = 1e-3f;      // lr / (1 - beta1^step)
  float bc2_sqrt = 1.0f;        // sqrt(1 - beta2^step)
};

// Kernels of one ISA: each processes elements [begin, end).
struct Kernels {
  void (*adam)(const AdamArgs&, size_t begin, size_t end);  // elements [begin, end) of every array
  double (*sumsq)(const void* data, DType dtype, size_t begin, size_t end);
  void (*stream)(float* p, const float* g, float* m, float* v, size_t begin, size_t end);
};

Kernels kernels_scalar();
Kernels kernels_avx2();
Kernels kernels_avx512();

// Best level this CPU supports (and this build compiled).
SimdLevel detect_simd_level();
SimdLevel simd_level();
void set_simd_level(SimdLevel level);  // throws std::invalid_argument if unsupported here
std::string simd_level_name(SimdLevel level);
SimdLevel parse_simd_level(const std::string& name);  // "scalar" | "avx2" | "avx512"

DType parse_dtype(const std::string& name);  // float32 | bfloat16 | float16 | none | int8

int num_threads();
void set_num_threads(int n);

// One param group's Adam/AdamW hyper-parameters. Exposed to Python as zinf._native.adam.AdamHyper
// (zinf.native.AdamHyper; pure-Python twin zinf.native.PythonAdamHyper with the same fields, order
// and defaults). Defaults are torch.optim.Adam's.
struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled = false;  // true: AdamW, param *= 1 - lr * wd; false: Adam, grad += wd * param (L2)

  bool operator==(const AdamHyper& o) const {
    return lr == o.lr && beta1 == o.beta1 && beta2 == o.beta2 && eps == o.eps &&
           weight_decay == o.weight_decay && decoupled == o.decoupled;
  }
  bool operator!=(const AdamHyper& o) const { return !(*this == o); }
};

// One step of one tensor: the group's hyper-parameters plus what changes per step.
struct StepConfig {
  AdamHyper hyper;
  int64_t step = 1;         // step count including this update (>= 1)
  double grad_scale = 1.0;  // the gradient is multiplied by float(clip_coef / grad_scale)
  double clip_coef = 1.0;
};

// Fills the derived scalars the way torch.optim.Adam(W) (single-tensor path) computes them.
// Throws std::invalid_argument if step < 1.
AdamArgs make_args(const StepConfig& cfg);

void adam_step(const AdamArgs& args, size_t numel);

// [Note: checksums in the Adam pass]
// adam_step that also takes the CRC32C (zinf/checksum) of the master and both moments, and of the gradient
// where `grad_in_crc`, before each tile of kCheckTileNumel elements is stepped, and of the master and moments
// after, while the tile is in cache: what an offloaded record's trailer is checked against and what its write
// is stamped with, without passes of their own over memory. in_crc[0..3]: master, exp_avg, exp_avg_sq,
// gradient; out_crc[0..2]: master, exp_avg, exp_avg_sq; each the CRC32C of the whole array, whatever the
// threads' slices. float32 or bfloat16 moments only, and no param_out: nothing computed from inputs not yet
// known good leaves the pass but the arrays it steps in place, which the caller writes back only once the
// input checksums match.
constexpr size_t kCheckTileNumel = 4096;
void adam_step_checked(const AdamArgs& args, size_t numel, bool grad_in_crc, uint32_t* in_crc, uint32_t* out_crc);
// Sum of squares accumulated in double per SIMD lane and per thread; non-finite if any element is.
double grad_norm_sq(const void* data, DType dtype, size_t numel);
// Moves Adam's 28 bytes/param with trivial math: the memory bandwidth bound of a step.
void stream_bound(float* p, const float* g, float* m, float* v, size_t numel);

}  // namespace zinf::adam
