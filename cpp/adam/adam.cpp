// Runtime SIMD dispatch and OpenMP partitioning for the Adam kernels.
#include "adam.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <vector>

#include "../checksum/crc32c.h"

namespace zinf::adam {
namespace {

constexpr size_t kSerialBelowNumel = size_t{1} << 16;  // not worth waking threads
constexpr size_t kChunkAlignNumel = 64;                 // 256 B of fp32: whole cache lines per thread

SimdLevel initial_level() {
  const SimdLevel best = detect_simd_level();
  if (const char* env = std::getenv("ZINF_SIMD")) {
    try {
      const SimdLevel wanted = parse_simd_level(env);
      if (static_cast<int>(wanted) <= static_cast<int>(best)) return wanted;
    } catch (const std::invalid_argument&) {
    }
  }
  return best;
}

std::atomic<int>& level_state() {
  static std::atomic<int> level{static_cast<int>(initial_level())};
  return level;
}

std::atomic<int>& threads_state() {
  static std::atomic<int> n{omp_get_max_threads()};
  return n;
}

Kernels current_kernels() {
  switch (simd_level()) {
    case SimdLevel::kAvx512: return kernels_avx512();
    case SimdLevel::kAvx2: return kernels_avx2();
    default: return kernels_scalar();
  }
}

// Calls fn(tid, begin, end) on contiguous slices, one per thread, each a multiple of ``align`` elements long
// (cache lines; whole blocks of int8 moments).
template <class Fn>
void parallel_slices(size_t numel, int max_threads, Fn&& fn, size_t align = kChunkAlignNumel) {
  if (numel < kSerialBelowNumel || max_threads <= 1) {
    fn(0, size_t{0}, numel);
    return;
  }
  const int nt = max_threads;
  size_t chunk = (numel + nt - 1) / nt;
  chunk = (chunk + align - 1) / align * align;
  // the slices are a loop over OpenMP's threads: fewer threads than asked for (a thread limit, a nested region) still
  // run every slice, each with its own index
#pragma omp parallel num_threads(nt)
  {
    for (int tid = omp_get_thread_num(); tid < nt; tid += omp_get_num_threads()) {
      const size_t begin = std::min(numel, chunk * static_cast<size_t>(tid));
      const size_t end = std::min(numel, begin + chunk);
      fn(tid, begin, end);
    }
  }
}

}  // namespace

SimdLevel detect_simd_level() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return SimdLevel::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return SimdLevel::kAvx2;
  return SimdLevel::kScalar;
}

SimdLevel simd_level() { return static_cast<SimdLevel>(level_state().load()); }

void set_simd_level(SimdLevel level) {
  if (static_cast<int>(level) > static_cast<int>(detect_simd_level()))
    throw std::invalid_argument("SIMD level '" + simd_level_name(level) +
                                "' is not supported by this CPU (best: '" +
                                simd_level_name(detect_simd_level()) + "')");
  level_state().store(static_cast<int>(level));
}

std::string simd_level_name(SimdLevel level) {
  switch (level) {
    case SimdLevel::kAvx512: return "avx512";
    case SimdLevel::kAvx2: return "avx2";
    default: return "scalar";
  }
}

SimdLevel parse_simd_level(const std::string& name) {
  if (name == "avx512") return SimdLevel::kAvx512;
  if (name == "avx2") return SimdLevel::kAvx2;
  if (name == "scalar") return SimdLevel::kScalar;
  throw std::invalid_argument("unknown SIMD level '" + name + "'; expected 'avx512', 'avx2' or 'scalar'");
}

DType parse_dtype(const std::string& name) {
  if (name == "float32") return DType::kFloat32;
  if (name == "bfloat16") return DType::kBFloat16;
  if (name == "float16") return DType::kFloat16;
  if (name == "none") return DType::kNone;
  if (name == "int8") return DType::kInt8;
  throw std::invalid_argument("unknown dtype '" + name + "'; expected float32, bfloat16, float16, int8 or none");
}

int num_threads() { return threads_state().load(); }

void set_num_threads(int n) {
  if (n < 1) throw std::invalid_argument("num_threads must be >= 1, got " + std::to_string(n));
  threads_state().store(n);
}

AdamArgs make_args(const StepConfig& c) {
  if (c.step < 1) throw std::invalid_argument("step must be >= 1, got " + std::to_string(c.step));
  const AdamHyper& h = c.hyper;
  AdamArgs a;
  const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(c.step));
  const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(c.step));
  a.grad_mul = static_cast<float>(c.clip_coef / c.grad_scale);
  a.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  a.beta2 = static_cast<float>(h.beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  a.eps = static_cast<float>(h.eps);
  a.decoupled = h.decoupled;
  a.l2_decay = h.decoupled ? 0.0f : static_cast<float>(h.weight_decay);
  a.decay_mul = h.decoupled ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  a.step_size = static_cast<float>(h.lr / bc1);
  a.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  return a;
}

void adam_step(const AdamArgs& args, size_t numel) {
  const Kernels k = current_kernels();
  const size_t align = args.state_dtype == DType::kInt8 ? kMomentBlock : kChunkAlignNumel;
  parallel_slices(numel, num_threads(), [&](int, size_t b, size_t e) { k.adam(args, b, e); }, align);
}

namespace {

size_t dtype_bytes(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kBFloat16:
    case DType::kFloat16: return 2;
    default: return 1;
  }
}

}  // namespace

void adam_step_checked(const AdamArgs& a, size_t numel, bool grad_in_crc, uint32_t* in_crc, uint32_t* out_crc) {
  if (a.state_dtype != DType::kFloat32 && a.state_dtype != DType::kBFloat16)
    throw std::invalid_argument("a checked Adam pass needs float32 or bfloat16 moments");
  if (a.param_out != nullptr)
    throw std::invalid_argument("a checked Adam pass writes no param_out: copy the parameter once the checksums match");
  const Kernels k = current_kernels();
  const int nt = num_threads();
  const int n_in = grad_in_crc ? 4 : 3;
  const std::array<const uint8_t*, 4> base = {
      reinterpret_cast<const uint8_t*>(a.param), static_cast<const uint8_t*>(a.exp_avg),
      static_cast<const uint8_t*>(a.exp_avg_sq), static_cast<const uint8_t*>(a.grad)};
  const std::array<size_t, 4> width = {4, dtype_bytes(a.state_dtype), dtype_bytes(a.state_dtype),
                                       dtype_bytes(a.grad_dtype)};
  std::vector<std::array<uint32_t, 7>> part(static_cast<size_t>(nt));  // each slice's CRCs: 4 in, 3 out
  std::vector<size_t> len(static_cast<size_t>(nt), 0);
  parallel_slices(numel, nt, [&](int tid, size_t b, size_t e) {
    std::array<uint32_t, 7> state;
    state.fill(~0u);
    for (size_t t = b; t < e; t += kCheckTileNumel) {
      const size_t te = std::min(e, t + kCheckTileNumel);
      const uint8_t* p[4];
      size_t n[4];
      for (int i = 0; i < 4; ++i) {
        p[i] = base[i] + t * width[i];
        n[i] = (te - t) * width[i];
      }
      checksum::raw_update_streams(state.data(), p, n, n_in);
      k.adam(a, t, te);
      checksum::raw_update_streams(state.data() + 4, p, n, 3);
    }
    for (auto& s : state) s = ~s;
    part[tid] = state;
    len[tid] = e - b;
  });
  for (int i = 0; i < 7; ++i) {
    if (i < 4 && i >= n_in) continue;
    const size_t w = width[i < 4 ? i : i - 4];
    uint32_t crc = 0;
    for (int t = 0; t < nt; ++t)
      if (len[t]) crc = checksum::crc32c_combine(crc, part[t][i], len[t] * w);
    (i < 4 ? in_crc[i] : out_crc[i - 4]) = crc;
  }
}

double grad_norm_sq(const void* data, DType dtype, size_t numel) {
  const Kernels k = current_kernels();
  const int nt = num_threads();
  std::vector<double> partial(static_cast<size_t>(nt), 0.0);
  parallel_slices(numel, nt, [&](int tid, size_t b, size_t e) { partial[tid] = k.sumsq(data, dtype, b, e); });
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

void stream_bound(float* p, const float* g, float* m, float* v, size_t numel) {
  const Kernels k = current_kernels();
  parallel_slices(numel, num_threads(), [&](int, size_t b, size_t e) { k.stream(p, g, m, v, b, e); });
}

}  // namespace zinf::adam
