#pragma once

// What the sources of ampx_fsdp_worker share: the scenarios that main()
// (fsdp_worker.cpp) runs from the other files, and the exact text of a
// number that every scenario writes its results in.

#include <ampx/dist.h>
#include <ampx/fsdp.h>

#include <torch/nn/module.h>

#include <ostream>
#include <string>

namespace fsdp_worker {

/// `v` exactly, as C's %a writes it.
std::string hex(double v);
/// This rank's gradient pieces, a "<tag> <hex>" line an element.
void log_grads(std::ostream& log, const std::string& tag,
               const ampx::dist::FullyShardedDataParallel& fsdp);
/// Rank 0: the model's full parameters (collective), a "param <hex>" line an element.
void log_params(std::ostream& log, const torch::nn::Module& model,
                ampx::dist::FullyShardedDataParallel& fsdp, const ampx::dist::ProcessGroup& pg);

/// The export scenario (fsdp_worker_export.cpp).
int run_export(const std::string& out, ampx::dist::ProcessGroup& pg);
/// The zero-pieces scenario (fsdp_worker_zero_pieces.cpp).
int run_zero_pieces(const std::string& out, ampx::dist::ProcessGroup& pg);
/// The fp8-gather scenario (fsdp_worker_fp8.cpp).
int run_fp8_gather(const std::string& out, ampx::dist::ProcessGroup& pg);
/// The block-gather scenario (fsdp_worker_block.cpp).
int run_block_gather(const std::string& out, ampx::dist::ProcessGroup& pg);

}  // namespace fsdp_worker
