// Feed-forward activations on the host CPU: see host_activations.py for why and when.
//
// Elementwise over contiguous fp32 or bf16 tensors, every value computed in fp32 and rounded once:
//   gelu_tanh(x)                = x s,  s = sigmoid(2u) = (1 + tanh u) / 2,  u = c (x + a x^3)
//   gelu_tanh_backward(g, x)    = g (s + 2 x s (1 - s) c (1 + 3 a x^2))
//   silu_mul(gate, up)          = gate sigmoid(gate) up                       (SwiGLU's product)
//   silu_mul_backward(g, gate, up) = (g up sigmoid(gate) (1 + gate (1 - sigmoid(gate))),  g silu(gate))
// with c = sqrt(2 / pi), a = 0.044715. A sigmoid is taken from e = exp(-|z|) <= 1, never overflowing:
// sigmoid(z) = 1 / (1 + e) for z >= 0, e / (1 + e) below, and sigmoid(z) (1 - sigmoid(z)) = e / (1 + e)^2
// on both sides, so neither the small tail of the sigmoid nor 1 - s loses its digits to a cancellation
// (torch's 0.5 x (1 + tanh u) does, below x ~ -3).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "host_vectors.h"

namespace {

using host_vectors::exp_nonpositive;
using host_vectors::kLanes;
using host_vectors::load;
using host_vectors::store;
using host_vectors::Vec;

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCubic = 0.044715f;

// Elements a thread takes at least (~20 us of work): small tensors (a decoding step's one token)
// stay on the calling thread.
constexpr int64_t kGrain = int64_t{1} << 15;

struct Sigmoid {
  Vec s;        // sigmoid(z)
  Vec s_slope;  // sigmoid(z) (1 - sigmoid(z))
};

inline Sigmoid sigmoid(Vec z) {
  const Vec e = exp_nonpositive(z < 0 ? z : -z);  // exp(-|z|) in (0, 1]
  const Vec r = 1.0f / (1.0f + e);
  return {z < 0 ? e * r : r, e * r * r};
}

inline Vec gelu_inner(Vec x) { return kSqrt2OverPi * x * (1.0f + kCubic * x * x); }  // u

struct GeluForward {
  static constexpr int kIn = 1, kOut = 1;
  static void apply(const Vec* in, Vec* out) {
    const Vec x = in[0];
    out[0] = x * sigmoid(2.0f * gelu_inner(x)).s;
  }
};

struct GeluBackward {  // in: grad, x
  static constexpr int kIn = 2, kOut = 1;
  static void apply(const Vec* in, Vec* out) {
    const Vec g = in[0], x = in[1];
    const Sigmoid sg = sigmoid(2.0f * gelu_inner(x));
    // d/dx [x s(2u)] = s + x 2 s (1 - s) du/dx,  du/dx = c (1 + 3 a x^2)
    out[0] = g * (sg.s + x * sg.s_slope * (2.0f * kSqrt2OverPi) * (1.0f + 3.0f * kCubic * x * x));
  }
};

struct SiluMulForward {  // in: gate, up
  static constexpr int kIn = 2, kOut = 1;
  static void apply(const Vec* in, Vec* out) { out[0] = in[0] * sigmoid(in[0]).s * in[1]; }
};

struct SiluMulBackward {  // in: grad, gate, up; out: d gate, d up
  static constexpr int kIn = 3, kOut = 2;
  static void apply(const Vec* in, Vec* out) {
    const Vec g = in[0], gate = in[1], up = in[2];
    const Sigmoid sg = sigmoid(gate);
    // silu'(z) = s + z s (1 - s)
    out[0] = g * up * (sg.s + gate * sg.s_slope);
    out[1] = g * gate * sg.s;
  }
};

// out_k[i] = Op(in_0[i], ...) for i in [begin, end): whole vectors, then the tail through a padded
// vector (the same instructions, so a value's bits do not depend on where it lies).
template <typename Op, typename T>
void run_range(const T* const* in, T* const* out, int64_t begin, int64_t end) {
  Vec x[Op::kIn], y[Op::kOut];
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    for (int k = 0; k < Op::kIn; ++k) x[k] = load(in[k] + i);
    Op::apply(x, y);
    for (int k = 0; k < Op::kOut; ++k) store(y[k], out[k] + i);
  }
  if (i == end) return;
  const int64_t rest = end - i;
  T pad_in[Op::kIn][kLanes] = {}, pad_out[Op::kOut][kLanes];
  for (int k = 0; k < Op::kIn; ++k) std::memcpy(pad_in[k], in[k] + i, rest * sizeof(T));
  for (int k = 0; k < Op::kIn; ++k) x[k] = load(pad_in[k]);
  Op::apply(x, y);
  for (int k = 0; k < Op::kOut; ++k) store(y[k], pad_out[k]);
  for (int k = 0; k < Op::kOut; ++k) std::memcpy(out[k] + i, pad_out[k], rest * sizeof(T));
}

template <size_t N>
void check_operands(const char* op, const std::array<const at::Tensor*, N>& operands) {
  const at::Tensor& first = *operands[0];
  TORCH_CHECK(first.scalar_type() == at::kFloat || first.scalar_type() == at::kBFloat16, op,
              ": fp32 or bf16 tensors, not ", first.scalar_type());
  for (const at::Tensor* t : operands) {
    TORCH_CHECK(t->device().is_cpu(), op, ": host tensors only");
    TORCH_CHECK(t->is_contiguous(), op, ": contiguous tensors only");
    TORCH_CHECK(t->scalar_type() == first.scalar_type(), op, ": every operand in ", first.scalar_type());
    TORCH_CHECK(t->sizes() == first.sizes(), op, ": operands of one shape, not ", first.sizes(), " and ", t->sizes());
  }
}

template <typename Op>
std::array<at::Tensor, Op::kOut> elementwise(const char* name, std::array<const at::Tensor*, Op::kIn> in) {
  check_operands(name, in);
  std::array<at::Tensor, Op::kOut> out;
  for (auto& t : out) t = at::empty_like(*in[0]);
  const int64_t n = in[0]->numel();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* src[Op::kIn];
    T* dst[Op::kOut];
    for (int k = 0; k < Op::kIn; ++k) src[k] = in[k]->template const_data_ptr<T>();
    for (int k = 0; k < Op::kOut; ++k) dst[k] = out[k].template mutable_data_ptr<T>();
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) { run_range<Op, T>(src, dst, begin, end); });
  };
  if (in[0]->scalar_type() == at::kFloat) {
    run(float{});
  } else {
    run(c10::BFloat16{});
  }
  return out;
}

at::Tensor gelu_tanh(const at::Tensor& x) { return elementwise<GeluForward>("gelu_tanh", {&x})[0]; }

at::Tensor gelu_tanh_backward(const at::Tensor& grad, const at::Tensor& x) {
  return elementwise<GeluBackward>("gelu_tanh_backward", {&grad, &x})[0];
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  return elementwise<SiluMulForward>("silu_mul", {&gate, &up})[0];
}

std::tuple<at::Tensor, at::Tensor> silu_mul_backward(const at::Tensor& grad, const at::Tensor& gate,
                                                     const at::Tensor& up) {
  auto [d_gate, d_up] = elementwise<SiluMulBackward>("silu_mul_backward", {&grad, &gate, &up});
  return {d_gate, d_up};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(polytrain, m) {
  m.def("gelu_tanh(Tensor x) -> Tensor");
  m.def("gelu_tanh_backward(Tensor grad, Tensor x) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("silu_mul_backward(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(polytrain, CPU, m) {
  m.impl("gelu_tanh", &gelu_tanh);
  m.impl("gelu_tanh_backward", &gelu_tanh_backward);
  m.impl("silu_mul", &silu_mul);
  m.impl("silu_mul_backward", &silu_mul_backward);
}
