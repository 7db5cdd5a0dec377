// Boxed kernels for the ops: TORCH_BOX's job, with a cheaper Tensor[].
//
// The dispatcher hands a stable kernel each Tensor[] item as a new owning
// handle. TORCH_BOX unboxes the list into std::vector<torch::stable::Tensor>,
// which wraps every handle in a shared_ptr: one heap control block, atomic
// reference counts and a free per tensor per call, which showed up as the
// largest part of the binding's per-tensor cost (docs/stable-abi.md,
// "Overhead"). TensorList keeps the handles in one vector and deletes them
// when the call ends; box<&fn> unboxes `const TensorList&` parameters into
// it and everything else as TORCH_BOX does (torch::stable::detail::to/from).
#pragma once

#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "handles.h"
#include "stable.h"

namespace gradacc {

// A Tensor[] argument: the items' handles, owned for the call.
class TensorList {
 public:
  TensorList() = default;
  // Takes the list the dispatcher passed in `list` (a StableListHandle) and its items.
  explicit TensorList(StableIValue list) {
    const auto handle = torch::stable::detail::to<StableListHandle>(list);
    size_t size = 0;
    AOTITorchError err = torch_list_size(handle, &size);
    if (err == AOTI_TORCH_SUCCESS) handles_.reserve(size);
    for (size_t i = 0; i < size && err == AOTI_TORCH_SUCCESS; ++i) {
      StableIValue item = 0;
      err = torch_list_get_item(handle, i, &item);
      if (err == AOTI_TORCH_SUCCESS) handles_.push_back(torch::stable::detail::to<AtenTensorHandle>(item));
    }
    torch_delete_list(handle);  // the list only: its items are ours now
    if (err != AOTI_TORCH_SUCCESS) {
      release();
      fail("gradacc: could not read a Tensor[] argument (C shim error ", err, ")");
    }
  }
  TensorList(TensorList&& other) noexcept : handles_(std::move(other.handles_)) { other.handles_.clear(); }
  TensorList& operator=(TensorList&& other) noexcept {
    std::swap(handles_, other.handles_);  // ours go with `other`
    return *this;
  }
  TensorList(const TensorList&) = delete;
  TensorList& operator=(const TensorList&) = delete;
  ~TensorList() { release(); }

  size_t size() const { return handles_.size(); }
  bool empty() const { return handles_.empty(); }
  TensorRef operator[](size_t i) const { return handles_[i]; }

 private:
  void release() {
    delete_tensor_handles(handles_.data(), handles_.size());
    handles_.clear();
  }

  std::vector<AtenTensorHandle> handles_;
};

namespace detail {

template <typename T>
T unbox(StableIValue v) {
  return torch::stable::detail::to<T>(v);
}
template <>
inline TensorList unbox<TensorList>(StableIValue v) {
  return TensorList(v);
}

template <typename R>
struct Outputs {
  static constexpr uint64_t kCount = 1;
  static void put(StableIValue* stack, const R& value) { stack[0] = torch::stable::detail::from(value); }
};
template <>
struct Outputs<void> {
  static constexpr uint64_t kCount = 0;
};
template <typename... Rs>
struct Outputs<std::tuple<Rs...>> {
  static constexpr uint64_t kCount = sizeof...(Rs);
  static void put(StableIValue* stack, const std::tuple<Rs...>& values) {
    std::apply([&](const auto&... v) {
      uint64_t i = 0;
      ((stack[i++] = torch::stable::detail::from(v)), ...);
    }, values);
  }
};

template <auto Fn>
struct Boxed;

template <typename R, typename... Args, R (*Fn)(Args...)>
struct Boxed<Fn> {
  static void call(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
    // TORCH_BOX's checks and messages.
    STD_TORCH_CHECK(num_args == sizeof...(Args), "Registered schema has ", num_args,
                    " args, but the kernel to box has ", sizeof...(Args));
    STD_TORCH_CHECK(num_outputs == Outputs<R>::kCount, "Registered schema has ", num_outputs,
                    " outputs, but the kernel to box has ", Outputs<R>::kCount);
    run(stack, std::index_sequence_for<Args...>());
  }

 private:
  template <size_t... I>
  static void run(StableIValue* stack, std::index_sequence<I...>) {
    // Braced initialisation: the arguments are unboxed in order, and those
    // already unboxed are released if a later one throws.
    std::tuple<std::decay_t<Args>...> args{unbox<std::decay_t<Args>>(stack[I])...};
    if constexpr (std::is_void_v<R>) {
      std::apply(Fn, args);
    } else {
      Outputs<R>::put(stack, std::apply(Fn, args));
    }
  }
};

}  // namespace detail

// The boxed form of `Fn` for m.impl, like TORCH_BOX(Fn).
template <auto Fn>
constexpr auto box = &detail::Boxed<Fn>::call;

}  // namespace gradacc
