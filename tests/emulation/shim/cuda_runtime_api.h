// Host emulation of the CUDA subset that csrc/kernels/*.cuh and csrc/cuda/*.cu use.
//
// Found before the toolkit's header (-I tests/emulation/shim), so the real
// kernel sources compile with g++. A launch runs every block in turn; inside
// a block each CUDA thread is a fiber (ucontext) that runs until it reaches a
// barrier. __syncthreads* release when every thread of the block waits there,
// __shfl_*_sync when all 32 lanes of the warp do; a barrier that cannot be
// released (divergent __syncthreads, a lane that left early) is reported as
// an error instead of hanging, and so is a 16-byte (uint4) or 8-byte (uint2)
// access at a misaligned address. Fibers run one at a time on one OS thread, so
// the schedule is deterministic; this is evidence about the device code's
// logic and arithmetic, not GPU verification (no memory model, no timing).
#pragma once

#include <setjmp.h>
#include <ucontext.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#ifndef CUDART_VERSION
#define CUDART_VERSION 12080  // -DCUDART_VERSION=12000 builds the 4 KB-parameter variant
#endif

// inline: a kernel defined in a header links once although both the launcher's
// translation unit and the test's entry points (which read its constants) see it
#define __global__ inline
#define __device__
#define __host__
#define __forceinline__ inline
#define __grid_constant__
#define __launch_bounds__(...)
#define __shared__ static  // one block runs at a time: a function-local static is its shared memory

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
namespace emu {
inline void fail(const std::string& what);
inline void check_aligned16(const void* p) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) fail("misaligned 16-byte access (a GPU faults: misaligned address)");
}
inline void check_aligned8(const void* p) {
  if (reinterpret_cast<uintptr_t>(p) % 8 != 0) fail("misaligned 8-byte access (a GPU faults: misaligned address)");
}
}  // namespace emu

// CUDA's uint4 is 16-byte aligned and moves as one 16-byte access, which
// faults on a GPU at an address that is not a multiple of 16 (x86 would
// silently do it): reading or overwriting one through a misaligned pointer
// is reported, so the vector paths' alignment checks are really tested. No
// alignas(16) here: g++ would then use aligned SSE moves, and a misaligned
// access would crash the test process instead of being reported.
struct uint4 {
  unsigned x, y, z, w;
  uint4() = default;
  uint4(unsigned a, unsigned b, unsigned c, unsigned d) : x(a), y(b), z(c), w(d) {}
  uint4(const uint4& o) : x(o.x), y(o.y), z(o.z), w(o.w) { emu::check_aligned16(&o); }
  uint4& operator=(const uint4& o) {
    emu::check_aligned16(this);
    x = o.x, y = o.y, z = o.z, w = o.w;
    return *this;
  }
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4(x, y, z, w); }

// uint2: one 8-byte access (4 elements of a 16-bit type), checked the same way.
struct uint2 {
  unsigned x, y;
  uint2() = default;
  uint2(unsigned a, unsigned b) : x(a), y(b) {}
  uint2(const uint2& o) : x(o.x), y(o.y) { emu::check_aligned8(&o); }
  uint2& operator=(const uint2& o) {
    emu::check_aligned8(this);
    x = o.x, y = o.y;
    return *this;
  }
};
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2(x, y); }

enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInvalidConfiguration = 9, cudaErrorLaunchFailure = 719 };
using cudaStream_t = struct CUstream_st*;

inline dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace emu {

constexpr int kWarp = 32;
constexpr size_t kStackBytes = 256 * 1024;  // a 32 KB by-value parameter plus the kernel's frames

// The first error of the process: a launch that failed, or a barrier that
// could not be released. Read (and cleared) by cudaGetLastError().
inline std::string& last_error() {
  static std::string e;
  return e;
}
inline cudaError_t& last_status() {
  static cudaError_t s = cudaSuccess;
  return s;
}
inline void fail(const std::string& what) {
  if (last_status() == cudaSuccess) {
    last_status() = cudaErrorLaunchFailure;
    last_error() = what;
  }
}

enum class Wait : uint8_t { kNone, kBlock, kWarp, kDone };

class Block {
 public:
  explicit Block(int threads) : threads_(threads), fibers_(size_t(threads)) {
    for (Fiber& f : fibers_) f.stack.reset(new char[kStackBytes]);
  }

  // Runs body() once per thread of the current block; false on a barrier error.
  template <typename Body>
  bool run(Body& body) {
    body_ = &body;
    invoke_ = [](void* b) { (*static_cast<Body*>(b))(); };
    for (Fiber& f : fibers_) f.wait = Wait::kNone;
    block_gen_ = 0;
    warp_gen_.assign(size_t((threads_ + kWarp - 1) / kWarp), 0);
    votes_[0] = votes_[1] = 0;
    for (;;) {
      bool ran = false;
      for (int t = 0; t < threads_; ++t) {
        if (fibers_[size_t(t)].wait != Wait::kNone) continue;
        ran = true;
        resume(t);
      }
      if (release()) continue;
      if (!ran) break;
    }
    for (Fiber& f : fibers_) {
      if (f.wait != Wait::kDone) {
        for (Fiber& stuck : fibers_) stuck.started = stuck.wait == Wait::kDone;  // the rest restart afresh
        fail("block " + std::to_string(blockIdx.x) + ": a barrier was never released (divergent __syncthreads " +
             "or a warp shuffle with an exited lane)");
        return false;
      }
    }
    return true;
  }

  // ---- called from inside a fiber ----
  void block_barrier() { park(Wait::kBlock); }
  void warp_barrier() { park(Wait::kWarp); }
  unsigned block_generation() const { return block_gen_; }
  unsigned warp_generation() const { return warp_gen_[size_t(current_ / kWarp)]; }
  int& vote(unsigned gen) { return votes_[gen & 1u]; }
  uint64_t* lanes(unsigned gen) { return shfl_[size_t(current_ / kWarp)][gen & 1u]; }

  // Fibers and stacks are made once per block size and reused by every launch.
  static Block* of_size(unsigned threads) {
    static std::vector<std::unique_ptr<Block>> blocks;
    for (auto& b : blocks) {
      if (b->threads_ == int(threads)) return b.get();
    }
    blocks.emplace_back(new Block(int(threads)));
    return blocks.back().get();
  }

  static Block*& active() {
    static Block* b = nullptr;
    return b;
  }

 private:
  // A fiber starts once through makecontext/setcontext, then every switch
  // is _setjmp/_longjmp: no signal-mask system call per switch (swapcontext
  // makes one, which made the emulation ten times slower).
  struct Fiber {
    std::unique_ptr<char[]> stack;
    ucontext_t start;
    jmp_buf ctx;
    bool started = false;
    Wait wait = Wait::kNone;
  };

  // A fiber's whole life: run the body for each block, park as done.
  static void entry() {
    Block* b = active();
    const int me = b->current_;
    for (;;) {
      b->invoke_(b->body_);
      b->park_as(me, Wait::kDone);
    }
  }

  void resume(int t) {
    current_ = t;
    threadIdx.x = unsigned(t);
    Fiber& f = fibers_[size_t(t)];
    if (_setjmp(main_) != 0) return;  // the fiber parked
    if (f.started) _longjmp(f.ctx, 1);
    f.started = true;
    getcontext(&f.start);
    f.start.uc_stack.ss_sp = f.stack.get();
    f.start.uc_stack.ss_size = kStackBytes;
    f.start.uc_link = nullptr;
    makecontext(&f.start, &Block::entry, 0);
    setcontext(&f.start);
  }

  void park_as(int t, Wait w) {
    Fiber& f = fibers_[size_t(t)];
    f.wait = w;
    if (_setjmp(f.ctx) == 0) _longjmp(main_, 1);
    threadIdx.x = unsigned(t);  // resumed by the scheduler
  }
  void park(Wait w) { park_as(current_, w); }

  // Releases the block barrier when every thread waits at it, and each warp
  // barrier whose 32 lanes all wait at it. True when something was released.
  bool release() {
    bool all_block = true;
    for (const Fiber& f : fibers_) all_block &= f.wait == Wait::kBlock;
    if (all_block) {
      for (Fiber& f : fibers_) f.wait = Wait::kNone;
      ++block_gen_;
      votes_[block_gen_ & 1u] = 0;  // the next vote's slot: its last readers (two barriers ago) have all passed
      return true;
    }
    bool released = false;
    for (size_t w = 0; w < warp_gen_.size(); ++w) {
      bool all_warp = true;
      for (int l = 0; l < kWarp; ++l) all_warp &= fibers_[w * kWarp + size_t(l)].wait == Wait::kWarp;
      if (!all_warp) continue;
      for (int l = 0; l < kWarp; ++l) fibers_[w * kWarp + size_t(l)].wait = Wait::kNone;
      ++warp_gen_[w];
      released = true;
    }
    return released;
  }

  int threads_;
  std::vector<Fiber> fibers_;
  jmp_buf main_;
  int current_ = 0;
  void* body_ = nullptr;
  void (*invoke_)(void*) = nullptr;
  unsigned block_gen_ = 0;
  std::vector<unsigned> warp_gen_;
  int votes_[2] = {0, 0};
  uint64_t shfl_[32][2][kWarp] = {};  // per warp, double-buffered by barrier generation
};

// kernel<<<grid, block, shmem, stream>>>(args...) becomes
// emu::launch(kernel, grid, block, shmem, stream)(args...): the test's build
// rewrites the launch syntax, and passes `const __grid_constant__ T x`
// parameters by const reference (what __grid_constant__ means: no per-thread
// copy), nothing else.
template <typename Kernel>
struct Launch {
  Kernel kernel;
  unsigned grid, threads;

  template <typename... Args>
  void operator()(const Args&... args) const {
    if (threads == 0 || threads > 1024 || threads % kWarp != 0 || grid == 0) {  // whole warps only
      if (last_status() == cudaSuccess) last_status() = cudaErrorInvalidConfiguration;
      return;
    }
    Block* block = Block::of_size(threads);
    Block::active() = block;
    gridDim.x = grid;
    blockDim.x = threads;
    auto body = [&] { kernel(args...); };
    for (unsigned b = 0; b < grid; ++b) {
      blockIdx.x = b;
      if (!block->run(body)) return;
    }
  }
};

template <typename Kernel>
Launch<Kernel> launch(Kernel kernel, unsigned grid, unsigned threads, size_t /*shmem*/, cudaStream_t /*stream*/) {
  return Launch<Kernel>{kernel, grid, threads};
}

}  // namespace emu

inline cudaError_t cudaGetLastError() {
  const cudaError_t s = emu::last_status();
  emu::last_status() = cudaSuccess;
  return s;
}

inline void __syncthreads() { emu::Block::active()->block_barrier(); }

inline int __syncthreads_or(int predicate) {
  emu::Block* b = emu::Block::active();
  const unsigned gen = b->block_generation();
  b->vote(gen) |= predicate ? 1 : 0;
  b->block_barrier();
  return b->vote(gen);
}

namespace emu {
// Every lane of the warp publishes `value`, then reads lane `src`'s (its own where src is past the warp).
template <typename T>
inline T warp_exchange(const char* what, unsigned mask, T value, unsigned src) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "shuffle of a register-sized value");
  if (mask != 0xFFFFFFFFu) fail(std::string(what) + ": only the full-warp mask is emulated");
  Block* b = Block::active();
  const unsigned gen = b->warp_generation();
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  b->lanes(gen)[threadIdx.x % kWarp] = bits;
  b->warp_barrier();
  if (src >= unsigned(kWarp)) return value;  // out of range: the lane keeps its own value
  T out;
  const uint64_t from = b->lanes(gen)[src];
  std::memcpy(&out, &from, sizeof(T));
  return out;
}
}  // namespace emu

template <typename T>
inline T __shfl_down_sync(unsigned mask, T value, unsigned delta) {
  return emu::warp_exchange("__shfl_down_sync", mask, value, threadIdx.x % emu::kWarp + delta);
}

// The butterfly: lane l reads lane l ^ lane_mask's value (the int8 states' warp absmax, optim_quant.cuh).
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T value, int lane_mask) {
  return emu::warp_exchange("__shfl_xor_sync", mask, value, (threadIdx.x % emu::kWarp) ^ unsigned(lane_mask));
}
