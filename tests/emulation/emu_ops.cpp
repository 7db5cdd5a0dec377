// C entry points of the host-emulated CUDA launchers (csrc/cuda/kernels.cu
// built with shim/cuda_runtime_api.h), for tests/test_emulation.py (ctypes).
// Each builds the launcher's params from raw spans exactly as the binding
// would after its checks, runs the launcher, and returns 0 or copies the
// emulator's error into `err`.
#include "../kernels/multi_tensor.cuh"  // resolved through -I csrc/cuda
#include "emu_common.h"
#include "launch.h"

using emu_entry::EmuSpan;
using emu_entry::finish;
using emu_entry::spans;
using emu_entry::workspace;
using gradacc::DType;
using gradacc::NormKind;

extern "C" {

int emu_meta_capacity(int depth) {
  return depth == 1 ? gradacc::cuda::ListMeta<1>::kCapacity : gradacc::cuda::ListMeta<2>::kCapacity;
}

int emu_accumulate(const EmuSpan* bufs, const EmuSpan* grads, int64_t n, float alpha, const float* alpha_ptr,
                   int assign, int final_step, float* found_inf, float* norm_acc, int norm_kind, char* err,
                   size_t err_len) {
  gradacc::AccumulateParams p;
  p.bufs = spans(bufs, n);
  p.grads = spans(grads, n);
  p.alpha = alpha;
  p.alpha_ptr = alpha_ptr;
  p.assign = assign != 0;
  p.final_step = final_step != 0;
  p.found_inf = found_inf;
  p.norm_acc = norm_acc;
  p.norm_kind = NormKind(norm_kind);
  auto ws = workspace(gradacc::cuda::accumulate_workspace_bytes(p));
  return finish(gradacc::cuda::launch_accumulate(p, ws.data(), nullptr), err, err_len);
}

int emu_norm(const EmuSpan* tensors, int64_t n, int norm_kind, double order, int wide, void* total_out,
             void* per_tensor_out, char* err, size_t err_len) {
  gradacc::NormParams p;
  p.tensors = spans(tensors, n);
  p.norm_kind = NormKind(norm_kind);
  p.p = order;
  p.wide = wide != 0;
  p.total_out = total_out;
  p.per_tensor_out = per_tensor_out;
  auto ws = workspace(gradacc::cuda::norm_workspace_bytes(p));
  return finish(gradacc::cuda::launch_norm(p, ws.data(), nullptr), err, err_len);
}

int emu_scale(const EmuSpan* tensors, int64_t n, int mode, const float* inv_scale_ptr, float* found_inf,
              const void* norm_ptr, int norm_dtype, double max_norm, double eps, double clip_value, char* err,
              size_t err_len) {
  gradacc::ScaleParams p;
  p.tensors = spans(tensors, n);
  p.mode = gradacc::ScaleMode(mode);
  p.inv_scale_ptr = inv_scale_ptr;
  p.found_inf = found_inf;
  p.norm_ptr = norm_ptr;
  p.norm_dtype = DType(norm_dtype);
  p.max_norm = max_norm;
  p.eps = eps;
  p.clip_value = clip_value;
  return finish(gradacc::cuda::launch_scale(p, nullptr), err, err_len);
}

}  // extern "C"

// ---- Self-tests of the shim: it must catch what a GPU would punish. ----

namespace {

// Half the block waits at a barrier the other half never reaches.
__global__ void divergent_barrier_kernel(int* out) {
  if (threadIdx.x < blockDim.x / 2) __syncthreads();
  out[threadIdx.x] = 1;
}

// Each warp's sum by a shuffle tree, and the block's OR of "value < 0".
__global__ void warp_sum_kernel(const float* in, float* warp_sums, int* any_negative) {
  const float x = in[blockIdx.x * blockDim.x + threadIdx.x];
  float v = x;
  for (unsigned off = 16; off > 0; off /= 2) v += __shfl_down_sync(0xFFFFFFFFu, v, off);
  if (threadIdx.x % 32 == 0) warp_sums[(blockIdx.x * blockDim.x + threadIdx.x) / 32] = v;
  const int neg = __syncthreads_or(x < 0.0f);
  if (threadIdx.x == 0) any_negative[blockIdx.x] = neg;
}

// A 16-byte load from `in + offset` (floats): misaligned unless offset % 4 == 0.
__global__ void vector_load_kernel(const float* in, int offset, float* out) {
  const uint4 u = *reinterpret_cast<const uint4*>(in + offset);
  if (threadIdx.x == 0) out[0] = float(u.x != 0);
}

}  // namespace

extern "C" {

int emu_selftest_vector_load(const float* in, int offset, float* out, char* err, size_t err_len) {
  emu::launch(vector_load_kernel, 1, 32, 0, nullptr)(in, offset, out);
  return finish(cudaSuccess, err, err_len);
}

int emu_selftest_divergent_barrier(int* out, unsigned threads, char* err, size_t err_len) {
  emu::launch(divergent_barrier_kernel, 1, threads, 0, nullptr)(out);
  return finish(cudaSuccess, err, err_len);
}

int emu_selftest_warp_sum(const float* in, float* warp_sums, int* any_negative, unsigned blocks, unsigned threads,
                          char* err, size_t err_len) {
  emu::launch(warp_sum_kernel, blocks, threads, 0, nullptr)(in, warp_sums, any_negative);
  return finish(cudaSuccess, err, err_len);
}

}  // extern "C"
