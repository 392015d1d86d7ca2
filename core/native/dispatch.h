/*
 * How a CPU primitive's work reaches its stream: the inputs and outputs named to MLX's CPU encoder (which keeps
 * them alive until the task has run) and the task given weak copies of them, so that it holds no reference of its
 * own. Every primitive of mlxchat._kernels and mlxchat._quantized dispatches through these two.
 */
#pragma once

#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"

namespace mlxchat_dispatch {

namespace mx = mlx::core;

/* Runs `run(held, made)` on `stream`'s CPU encoder: `held` the inputs as they are, `made` the outputs (allocated
 * by the caller). */
template <typename Run>
void dispatch_all(mx::Stream stream, const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs, Run run) {
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& a : inputs) encoder.set_input_array(a);
  for (auto& a : outputs) encoder.set_output_array(a);
  std::vector<mx::array> held, made;
  for (const auto& a : inputs) held.push_back(mx::array::unsafe_weak_copy(a));
  for (const auto& a : outputs) made.push_back(mx::array::unsafe_weak_copy(a));
  encoder.dispatch([held = std::move(held), made = std::move(made), run]() mutable { run(held, made); });
}

/* Runs `run(held, out)` on `stream`'s CPU encoder: `out` allocated here, `held` the inputs as they are. */
template <typename Run>
void dispatch_held(mx::Stream stream, const std::vector<mx::array>& inputs, mx::array& out, Run run) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  std::vector<mx::array> held;
  for (const auto& a : inputs) held.push_back(mx::array::unsafe_weak_copy(a));
  encoder.dispatch([held = std::move(held), out = mx::array::unsafe_weak_copy(out), run]() mutable {
    run(held, out);
  });
}

}  // namespace mlxchat_dispatch
