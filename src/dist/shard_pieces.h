#pragma once

// The sharded checkpoint's format, shared by FullyShardedDataParallel and
// ZeroRedundancyOptimizer: each rank saves its pieces of the parameters,
// keyed by parameter name and element range, never by rank layout, so that
// any number of ranks, under either, can load them (resharding).
//
// A shard's archive (version 2; version 1, fp32 moments only, is read too):
//   ampx_fsdp_shard_version 2        rank, world_size      ints
//   num_params K                     param<k>.name         str
//   param<k>.numel   the whole parameter's elements
//   param<k>.begin   the element of the parameter where this piece starts
//   param<k>.value   fp32 [length]: the piece (the masters)
//   param<k>.step, param<k>.exp_avg, param<k>.exp_avg_sq   the optimizer's, when given
//   num_buffers B                    buffer<j>.name, buffer<j>.value
//   optimizer.type, optimizer.seed, optimizer.num_groups, optimizer.group<g>.lr
//   optimizer.state_format "fp32" | "bf16" | "fp8" | "8bit"   optimizer.state_block,
//   optimizer.kahan_summation   ints (version 2)
//   optimizer.layout, optimizer.local   with coded moments (state_format other
//       than fp32): the wrapper's description of this rank's layout, and the
//       optimizer's own save() as bytes (uint8), which a load on the same
//       layout restores bit for bit; the pieces' exp_avg and exp_avg_sq hold
//       the moments decoded to fp32, which a load on another layout encodes
//       again in its own blocks

#include "ampx/dist.h"
#include "ampx/optim/optimizer.h"

#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace ampx {
namespace dist {
namespace shard {

#if defined(AMPX_WITH_DIST)

/// `o` as one of ampx::optim's optimizers (null: none); another kind is
/// refused naming `who`.
const ampx::optim::MixedPrecisionOptimizer* checkpointable(const torch::optim::Optimizer* o,
                                                           const char* who);
ampx::optim::MixedPrecisionOptimizer* checkpointable(torch::optim::Optimizer* o, const char* who);

/// One piece this rank saves.
struct SavedPiece {
  std::string name;
  int64_t numel = 0;    // the whole parameter's
  int64_t begin = 0;    // where the piece starts in it
  at::Tensor value;     // fp32 [length]
  bool trains = false;  // saves the optimizer's step and moments
  int64_t step = 0;
  at::Tensor exp_avg, exp_avg_sq;  // fp32 [length] (decoded) or undefined
};

/// Writes a shard: `pieces`, `buffers` and, when `optimizer` is given, its
/// type, seed, learning rates and state format, and with coded moments its
/// own state and `layout` (a text that is equal on a load exactly when the
/// optimizer's params are the same pieces in the same places).
void write_shard(torch::serialize::OutputArchive& archive, int64_t rank, int64_t world,
                 const std::vector<SavedPiece>& pieces,
                 const std::vector<std::pair<std::string, at::Tensor>>& buffers,
                 const ampx::optim::MixedPrecisionOptimizer* optimizer, const std::string& layout);

/// One piece this rank loads: elements [begin, begin + length) of parameter `name`.
struct PieceTarget {
  std::string name;
  int64_t numel = 0, begin = 0, length = 0;
  bool trains = false;  // its optimizer state is read (when loading one)
};

/// A target as the saved shards rebuild it.
struct Rebuilt {
  at::Tensor value, exp_avg, exp_avg_sq;  // fp32 [length]
  int64_t step = -1;                      // -1: no saved piece carried optimizer state yet
  bool has_exp_avg = false, has_exp_avg_sq = false;
  std::vector<std::pair<int64_t, int64_t>> spans;  // [from, to) in the parameter, filled
};

/// The optimizer-wide part of a shard.
struct OptimizerHeader {
  std::string type;
  int64_t seed = 0;
  std::vector<double> lrs;
  std::string state_format = "fp32";
  int64_t state_block = 0;  // as saved (0: version 1, fp32 moments)
  bool kahan_summation = false;
  bool operator==(const OptimizerHeader& o) const {
    return type == o.type && seed == o.seed && lrs == o.lrs && state_format == o.state_format &&
           state_block == o.state_block && kahan_summation == o.kahan_summation;
  }
};

/// Every saved shard read into the targets.
struct Loaded {
  std::vector<Rebuilt> pieces;  // by target
  std::map<std::string, at::Tensor> buffers;
  OptimizerHeader optimizer;
  /// The optimizer's own state as saved by the rank of this one's number,
  /// when the saved world and that rank's layout are this rank's and it has
  /// coded moments (write_shard); empty otherwise.
  std::string same_layout_state;
};

/// Who reads: this rank, its world and its layout (write_shard's `layout`).
struct Reader {
  int64_t rank = 0, world = 1;
  std::string layout;
};

using ShardReader = std::function<void(int64_t rank, torch::serialize::InputArchive& archive)>;

/// Reads saved ranks 0 .. saved_world - 1 through `read` into `targets`,
/// checking that every target element comes from exactly one saved piece,
/// that the saved buffers are `model_buffers` (names, dtypes, shapes) and
/// that the ranks' optimizer headers agree. Errors start with `who`.
Loaded read_shards(const char* who, int64_t saved_world, const ShardReader& read,
                   const std::vector<PieceTarget>& targets, bool with_optimizer,
                   const std::vector<std::pair<std::string, at::Tensor>>& model_buffers,
                   const Reader& reader);

/// Loads `loaded`'s optimizer state into `optimizer`: the saved state
/// itself where `loaded.same_layout_state` has it (bit for bit), otherwise
/// the state ampx::optim's own load() reads (its position keys), whose
/// parameter `p` of group `g` is filled by `fill(g, p)` (step, and exp_avg,
/// exp_avg_sq in fp32, encoded here in the optimizer's state format:
/// undefined tensors are left out), after checking the saved header
/// (type, groups, state format) against it.
struct OptimizerSlot {
  int64_t step = 0;
  at::Tensor exp_avg, exp_avg_sq;
};
void load_optimizer(const char* who, ampx::optim::MixedPrecisionOptimizer& optimizer,
                    const Loaded& loaded,
                    const std::function<OptimizerSlot(size_t group, size_t param)>& fill);

/// `model`'s buffers by name, as shards save them.
std::vector<std::pair<std::string, at::Tensor>> buffers_of(const torch::nn::Module& model);

/// Every rank commits a load, or none: `error` ("" if this rank's reading
/// and checking went well) is gathered from every rank; if any failed,
/// `roll_back` undoes what this rank changed and every rank throws, naming
/// the first failed rank and its error after "<who>: nothing was loaded".
/// Collective.
void commit_everywhere(const char* who, const ProcessGroup& group, const std::string& error,
                       const std::function<void()>& roll_back);

/// A full-state export's dtype: float32, bfloat16 or float16, else an error
/// after "<who>: ". (FullyShardedDataParallel's and ZeroRedundancyOptimizer's
/// save_full_safetensors.)
void check_export_dtype(const char* who, c10::ScalarType dtype);

/// Every rank learns rank 0's `error` ("" if none) and, if there is one,
/// throws it after "<who>: rank 0 failed: ". Collective.
void throw_rank0_error(const char* who, const ProcessGroup& group, const std::string& error);

/// `optimizer`'s state as bytes (for a rollback), and back.
std::string optimizer_bytes(const torch::optim::Optimizer& optimizer);
void restore_optimizer(torch::optim::Optimizer& optimizer, const std::string& bytes);

#endif  // AMPX_WITH_DIST

}  // namespace shard
}  // namespace dist
}  // namespace ampx
