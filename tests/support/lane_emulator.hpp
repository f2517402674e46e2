// Runs CUDA kernels on the host, lane by lane, so CI (which has no GPU) checks their logic: every
// thread of a block is a fiber; a warp intrinsic (shuffles, votes, __match_any_sync, __syncwarp)
// suspends its lane until all 32 lanes of the warp reach it, then hands each lane the result the
// hardware would; __syncthreads suspends it until every thread of the block reaches it. Blocks run
// one after another, so __shared__ arrays are static storage; dynamic shared memory
// (MRR_DYNAMIC_SHARED) is a buffer of the launch, refilled with 0xff bytes for each block.
//
// What it checks beyond the results: a warp intrinsic must be reached by all 32 lanes of the warp,
// with the full mask, at the same intrinsic, and __syncthreads by every thread of the block (a
// thread that returned early, or threads split over two intrinsics, hang or misbehave on a GPU):
// the launch throws std::logic_error naming the block, the warp and the intrinsics. Threads run in
// order up to their next intrinsic or barrier, so a missing barrier before reading what a later
// thread writes reads the fill, not the value. What it cannot check: timing, races a GPU's
// interleaving would show otherwise, and the device's own arithmetic (expf, the approximate
// reciprocal): the host's is used, so values compare with the CPU's, not with a GPU's last bits.
//
// Include it after every other header and before the mrr kernel headers it runs (it defines the
// CUDA keywords as macros: __global__, __device__, __shared__, threadIdx, ...; and the hooks of
// mrr/detail/kernel_launch.hpp). A header whose code changes under MRR_LANE_EMULATION
// (mrr/thrust/ppo.hpp) must then be included by that translation unit alone in its program.
#pragma once

#define MRR_LANE_EMULATION 1

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif

namespace mrr_emu {

struct Index3 {
  unsigned x = 0, y = 0, z = 0;
};

enum class Op { none, shfl_idx, shfl_xor, shfl_up, shfl_down, ballot, any, all, match_any, syncwarp, syncthreads };

inline const char* op_name(Op op) {
  switch (op) {
    case Op::shfl_idx:
      return "__shfl_sync";
    case Op::shfl_xor:
      return "__shfl_xor_sync";
    case Op::shfl_up:
      return "__shfl_up_sync";
    case Op::shfl_down:
      return "__shfl_down_sync";
    case Op::ballot:
      return "__ballot_sync";
    case Op::any:
      return "__any_sync";
    case Op::all:
      return "__all_sync";
    case Op::match_any:
      return "__match_any_sync";
    case Op::syncwarp:
      return "__syncwarp";
    case Op::syncthreads:
      return "__syncthreads";
    default:
      return "(none)";
  }
}

#if defined(__x86_64__)
// A minimal context switch: saves the callee-saved registers on the current stack, stores the stack
// pointer in *from, loads `to` and restores what that stack saved (System V x86-64).
extern "C" void mrr_emu_switch(void** from, void* to);
asm(R"(
  .text
  .weak mrr_emu_switch
  .type mrr_emu_switch, @function
mrr_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size mrr_emu_switch, .-mrr_emu_switch
)");
#endif

struct Lane {
  Index3 thread_idx, block_idx, block_dim, grid_dim;
  enum class State { ready, waiting, done } state = State::ready;
  Op op = Op::none;
  unsigned mask = 0;
  std::uint64_t value = 0, result = 0;
  int arg = 0, width = 32;
  void* fake_stack = nullptr;  // AddressSanitizer's, while the lane is switched out
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t context{};
#endif
};

// The running launch (one at a time per process: the kernels' __shared__ arrays are static).
struct Launch {
  std::vector<Lane> lanes;
  std::vector<std::unique_ptr<unsigned char[]>> stacks;
  std::function<void()> body;
  std::unique_ptr<std::max_align_t[]> dynamic_shared;  // the launch's dynamic shared memory
  std::size_t dynamic_shared_bytes = 0;
  Lane* current = nullptr;
  std::exception_ptr error;
  const void* scheduler_stack = nullptr;  // AddressSanitizer: the scheduler's stack, as a lane saw it
  std::size_t scheduler_stack_size = 0;
  void* scheduler_fake_stack = nullptr;
#if defined(__x86_64__)
  void* scheduler_sp = nullptr;
#else
  ucontext_t scheduler{};
#endif
};

inline Launch*& active() {
  static Launch* launch = nullptr;
  return launch;
}

inline Lane& current_lane() {
  return *active()->current;
}

// AddressSanitizer follows the switches between stacks (and keeps its fake stacks apart) when told.
inline void asan_start_switch([[maybe_unused]] void** fake_stack, [[maybe_unused]] const void* bottom,
                              [[maybe_unused]] std::size_t size) {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_start_switch_fiber(fake_stack, bottom, size);
#endif
}
inline void asan_finish_switch([[maybe_unused]] void* fake_stack, [[maybe_unused]] const void** from_bottom,
                               [[maybe_unused]] std::size_t* from_size) {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(fake_stack, from_bottom, from_size);
#endif
}

inline void to_scheduler(Lane& lane) {
  Launch& launch = *active();
  // A finished lane's fake stack is released (it never runs again).
  asan_start_switch(lane.state == Lane::State::done ? nullptr : &lane.fake_stack, launch.scheduler_stack,
                    launch.scheduler_stack_size);
#if defined(__x86_64__)
  mrr_emu_switch(&lane.sp, launch.scheduler_sp);
#else
  swapcontext(&lane.context, &launch.scheduler);
#endif
  asan_finish_switch(lane.fake_stack, &launch.scheduler_stack, &launch.scheduler_stack_size);
}

inline void lane_entry() {
  Launch& launch = *active();
  asan_finish_switch(nullptr, &launch.scheduler_stack, &launch.scheduler_stack_size);
  Lane& lane = *launch.current;
  try {
    launch.body();
  } catch (...) {
    if (!launch.error) launch.error = std::current_exception();
  }
  lane.state = Lane::State::done;
  to_scheduler(lane);
  std::abort();  // a finished lane is never resumed
}

inline constexpr std::size_t kStackBytes = 256 * 1024;

inline void start_lane(Launch& launch, std::size_t i) {
  Lane& lane = launch.lanes[i];
  unsigned char* top = launch.stacks[i].get() + kStackBytes;
#if defined(__x86_64__)
  // The first switch to this lane pops six zero registers and "returns" into lane_entry, with the
  // stack aligned as at a function's entry (rsp + 8 a multiple of 16).
  auto* sp = reinterpret_cast<void**>(reinterpret_cast<std::uintptr_t>(top) & ~std::uintptr_t{15});
  *--sp = nullptr;  // lane_entry's return address (it never returns)
  *--sp = reinterpret_cast<void*>(&lane_entry);
  for (int r = 0; r < 6; ++r)
    *--sp = nullptr;
  lane.sp = sp;
#else
  getcontext(&lane.context);
  lane.context.uc_stack.ss_sp = launch.stacks[i].get();
  lane.context.uc_stack.ss_size = kStackBytes;
  lane.context.uc_link = nullptr;
  makecontext(&lane.context, &lane_entry, 0);
#endif
}

inline void resume(Launch& launch, Lane& lane) {
  launch.current = &lane;
  const std::size_t i = static_cast<std::size_t>(&lane - launch.lanes.data());
  asan_start_switch(&launch.scheduler_fake_stack, launch.stacks[i].get(), kStackBytes);
#if defined(__x86_64__)
  mrr_emu_switch(&launch.scheduler_sp, lane.sp);
#else
  swapcontext(&launch.scheduler, &lane.context);
#endif
  asan_finish_switch(launch.scheduler_fake_stack, nullptr, nullptr);
  launch.current = nullptr;
}

[[noreturn]] inline void fail(unsigned block, unsigned warp, const std::string& what) {
  throw std::logic_error("lane emulator: block " + std::to_string(block) + ", warp " + std::to_string(warp) + ": " +
                         what);
}

// All 32 lanes of warp w wait at one intrinsic: the hardware's results.
inline void resolve(Launch& launch, unsigned block, unsigned w) {
  Lane* l = launch.lanes.data() + 32 * w;
  const Op op = l[0].op;
  for (int i = 0; i < 32; ++i) {
    if (l[i].op != op)
      fail(block, w,
           std::string("lanes wait at different intrinsics: lane 0 at ") + op_name(op) + ", lane " + std::to_string(i) +
               " at " + op_name(l[i].op));
    if (l[i].mask != 0xffffffffu) fail(block, w, std::string(op_name(op)) + " with a partial mask");
    if (l[i].width != l[0].width) fail(block, w, std::string(op_name(op)) + " with different widths");
  }
  const int width = l[0].width;
  if (width < 1 || width > 32 || (width & (width - 1)) != 0)
    fail(block, w, std::string(op_name(op)) + ": width not a power of two up to 32");
  std::uint64_t results[32];
  for (int i = 0; i < 32; ++i) {
    const int base = i & ~(width - 1), arg = l[i].arg;
    int src = i;
    switch (op) {
      case Op::shfl_idx:
        src = base + (arg & (width - 1));
        break;
      case Op::shfl_xor:
        src = i ^ arg;
        if (src < base || src >= base + width) src = i;
        break;
      case Op::shfl_up:
        src = (i - base) >= arg ? i - arg : i;
        break;
      case Op::shfl_down:
        src = (i - base) + arg < width ? i + arg : i;
        break;
      default:
        break;
    }
    std::uint64_t r = l[src].value;
    if (op == Op::ballot || op == Op::any || op == Op::all || op == Op::match_any) {
      unsigned bits = 0;
      for (int j = 0; j < 32; ++j) {
        const bool in = op == Op::match_any ? l[j].value == l[i].value : l[j].value != 0;
        bits |= in ? 1u << j : 0u;
      }
      r = op == Op::any ? (bits != 0u) : op == Op::all ? (bits == 0xffffffffu) : bits;
    }
    results[i] = r;
  }
  for (int i = 0; i < 32; ++i) {
    l[i].result = results[i];
    l[i].op = Op::none;
    l[i].state = Lane::State::ready;
  }
}

// Runs body() as every thread of a grid of `blocks` blocks of `threads` threads (a multiple of 32),
// with `shared_bytes` of dynamic shared memory a block (MRR_DYNAMIC_SHARED), filled with 0xff bytes
// (NaN as floats) at each block's start: a kernel that reads shared memory it did not write gets
// garbage, as on a GPU, not zeros.
inline void run(unsigned blocks, unsigned threads, std::size_t shared_bytes, std::function<void()> body) {
  if (threads == 0 || threads % 32 != 0 || threads > 1024)
    throw std::invalid_argument("lane emulator: threads per block must be a multiple of 32 up to 1024");
  if (active() != nullptr) throw std::logic_error("lane emulator: launches do not nest");
  Launch launch;
  launch.body = std::move(body);
  launch.lanes.resize(threads);
  for (unsigned i = 0; i < threads; ++i)
    launch.stacks.emplace_back(new unsigned char[kStackBytes]);
  const std::size_t words = (shared_bytes + sizeof(std::max_align_t) - 1) / sizeof(std::max_align_t);
  launch.dynamic_shared.reset(new std::max_align_t[words > 0 ? words : 1]);
  launch.dynamic_shared_bytes = shared_bytes;
  active() = &launch;
  struct Reset {
    ~Reset() { active() = nullptr; }
  } reset;
  const unsigned warps = threads / 32;
  for (unsigned b = 0; b < blocks; ++b) {
    std::memset(launch.dynamic_shared.get(), 0xff, shared_bytes);
    for (unsigned i = 0; i < threads; ++i) {
      Lane& lane = launch.lanes[i];
      lane = Lane{};
      lane.thread_idx = {i, 0, 0};
      lane.block_idx = {b, 0, 0};
      lane.block_dim = {threads, 1, 1};
      lane.grid_dim = {blocks, 1, 1};
      start_lane(launch, i);
    }
    for (;;) {
      for (Lane& lane : launch.lanes)
        if (lane.state == Lane::State::ready) resume(launch, lane);
      if (launch.error) std::rethrow_exception(launch.error);
      // Every lane now waits or is done. A warp whose 32 lanes wait at a warp intrinsic gets its
      // results; the block's barrier opens when every lane waits at it.
      bool all_done = true, progress = false;
      int at_barrier = 0, done_lanes = 0;
      for (unsigned w = 0; w < warps; ++w) {
        int done = 0, barrier = 0;
        Op at = Op::none;
        for (unsigned i = 32 * w; i < 32 * w + 32; ++i) {
          const Lane& lane = launch.lanes[i];
          done += lane.state == Lane::State::done ? 1 : 0;
          barrier += lane.state == Lane::State::waiting && lane.op == Op::syncthreads ? 1 : 0;
          if (lane.state == Lane::State::waiting && lane.op != Op::syncthreads) at = lane.op;
        }
        done_lanes += done;
        at_barrier += barrier;
        if (done == 32) continue;
        all_done = false;
        if (barrier > 0 && barrier + done < 32)
          fail(b, w, std::string("lanes wait at different intrinsics: __syncthreads and ") + op_name(at));
        if (barrier > 0) continue;  // the block's barrier, below
        if (done > 0)
          fail(b, w,
               std::to_string(32 - done) + " lanes wait at " + op_name(at) + " that " + std::to_string(done) +
                   " lanes of the warp never reach (they returned)");
        resolve(launch, b, w);
        progress = true;
      }
      if (all_done) break;
      if (!progress && at_barrier > 0) {
        if (done_lanes > 0)
          fail(b, 0,
               std::to_string(at_barrier) + " threads wait at __syncthreads that " + std::to_string(done_lanes) +
                   " threads of the block never reach (they returned)");
        for (Lane& lane : launch.lanes) {
          lane.op = Op::none;
          lane.state = Lane::State::ready;
        }
      }
    }
  }
}

inline void run(unsigned blocks, unsigned threads, std::function<void()> body) {
  run(blocks, threads, 0, std::move(body));
}

inline void* dynamic_shared() {
  return active()->dynamic_shared.get();
}

// A lane's side of an intrinsic: publish, wait for the warp, take the result.
template <class T>
std::uint64_t bits_of(T v) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "lane emulator: values up to 8 bytes");
  std::uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  return u;
}
template <class T>
T from_bits(std::uint64_t u) {
  T v;
  std::memcpy(&v, &u, sizeof(T));
  return v;
}

inline std::uint64_t warp_op(Op op, unsigned mask, std::uint64_t value, int arg = 0, int width = 32) {
  Lane& lane = current_lane();
  lane.op = op;
  lane.mask = mask;
  lane.value = value;
  lane.arg = arg;
  lane.width = width;
  lane.state = Lane::State::waiting;
  to_scheduler(lane);
  return lane.result;
}

}  // namespace mrr_emu

// The CUDA keywords and built-ins the kernels use, on the host. (Their `#pragma unroll`, a hint for
// nvcc, means nothing to the host compiler: build with -Wno-unknown-pragmas.)
#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define threadIdx (::mrr_emu::current_lane().thread_idx)
#define blockIdx (::mrr_emu::current_lane().block_idx)
#define blockDim (::mrr_emu::current_lane().block_dim)
#define gridDim (::mrr_emu::current_lane().grid_dim)

#if !defined(__VECTOR_TYPES_H__)
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
inline float4 make_float4(float x, float y, float z, float w) {
  return {x, y, z, w};
}
#endif

template <class T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  return mrr_emu::from_bits<T>(mrr_emu::warp_op(mrr_emu::Op::shfl_idx, mask, mrr_emu::bits_of(v), src, width));
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return mrr_emu::from_bits<T>(mrr_emu::warp_op(mrr_emu::Op::shfl_xor, mask, mrr_emu::bits_of(v), lane_mask, width));
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return mrr_emu::from_bits<T>(
      mrr_emu::warp_op(mrr_emu::Op::shfl_up, mask, mrr_emu::bits_of(v), static_cast<int>(delta), width));
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return mrr_emu::from_bits<T>(
      mrr_emu::warp_op(mrr_emu::Op::shfl_down, mask, mrr_emu::bits_of(v), static_cast<int>(delta), width));
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  return static_cast<unsigned>(mrr_emu::warp_op(mrr_emu::Op::ballot, mask, pred != 0));
}
inline int __any_sync(unsigned mask, int pred) {
  return static_cast<int>(mrr_emu::warp_op(mrr_emu::Op::any, mask, pred != 0));
}
inline int __all_sync(unsigned mask, int pred) {
  return static_cast<int>(mrr_emu::warp_op(mrr_emu::Op::all, mask, pred != 0));
}
template <class T>
unsigned __match_any_sync(unsigned mask, T v) {
  return static_cast<unsigned>(mrr_emu::warp_op(mrr_emu::Op::match_any, mask, mrr_emu::bits_of(v)));
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  mrr_emu::warp_op(mrr_emu::Op::syncwarp, mask, 0);
}
inline void __syncthreads() {
  mrr_emu::warp_op(mrr_emu::Op::syncthreads, 0xffffffffu, 0);
}

inline int __popc(unsigned x) {
  return std::popcount(x);
}
inline int __ffs(int x) {
  return __builtin_ffs(x);
}
inline float __int_as_float(int x) {
  return std::bit_cast<float>(x);
}
inline int __float_as_int(float x) {
  return std::bit_cast<int>(x);
}
inline float __uint_as_float(unsigned x) {
  return std::bit_cast<float>(x);
}
inline unsigned __float_as_uint(float x) {
  return std::bit_cast<unsigned>(x);
}
inline float __fmaf_rn(float a, float b, float c) {
  return std::fma(a, b, c);
}

namespace mrr_emu {

// The `launch` of mrr/cuda/routing_kernels.cuh's launchers: runs the kernel here.
struct HostLaunch {
  template <class... Params, class... Args>
  void operator()(void (*kernel)(Params...), unsigned blocks, unsigned threads, Args... args) const {
    run(blocks, threads, [&] { kernel(args...); });
  }
};

template <class... Params, class... Args>
void launch_kernel(void (*kernel)(Params...), unsigned blocks, unsigned threads, std::size_t shared_bytes,
                   Args... args) {
  run(blocks, threads, shared_bytes, [&] { kernel(args...); });
}

}  // namespace mrr_emu

// mrr/detail/kernel_launch.hpp's hooks: a launch (the stream is not used) and a kernel's dynamic
// shared memory.
#define MRR_KERNEL_LAUNCH(kernel, blocks, threads, shared_bytes, stream, ...) \
  ::mrr_emu::launch_kernel(kernel, blocks, threads, shared_bytes, __VA_ARGS__)
#define MRR_DYNAMIC_SHARED(type, name) type* const name = static_cast<type*>(::mrr_emu::dynamic_shared())
