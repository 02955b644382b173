// Where this process sits: the variables of torchrun, Open MPI and Slurm.

#include "ampx/dist.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

namespace ampx {
namespace dist {
namespace {

// The value of `name`, or nullptr when unset or empty.
const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

struct Reader {
  std::vector<std::string> missing, malformed;
  int64_t integer(const char* name, int64_t min) {
    const char* v = env(name);
    if (v == nullptr) {
      missing.emplace_back(name);
      return 0;
    }
    char* end = nullptr;
    const long long x = std::strtoll(v, &end, 10);
    if (*end != '\0' || x < min) {
      malformed.push_back(std::string(name) + "='" + v + "'");
      return 0;
    }
    return x;
  }
  std::string text(const char* name) {
    const char* v = env(name);
    if (v == nullptr) missing.emplace_back(name);
    return v != nullptr ? v : "";
  }
};

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ", ") + s;
  return out;
}

// Slurm's tasks per node ("2(x3),1": 2 on each of the first three nodes,
// then 1) at node `node`; 0 when `spec` is malformed or too short.
int64_t slurm_tasks_on_node(const std::string& spec, int64_t node) {
  int64_t seen = 0;
  size_t pos = 0;
  while (pos < spec.size()) {
    const size_t comma = std::min(spec.find(',', pos), spec.size());
    const std::string part = spec.substr(pos, comma - pos);
    char* end = nullptr;
    const long long tasks = std::strtoll(part.c_str(), &end, 10);
    long long repeat = 1;
    if (end == part.c_str() || tasks < 1) return 0;
    if (*end == '(') {
      if (end[1] != 'x') return 0;
      char* close = nullptr;
      repeat = std::strtoll(end + 2, &close, 10);
      if (repeat < 1 || *close != ')' || close[1] != '\0') return 0;
    } else if (*end != '\0') {
      return 0;
    }
    if (node < seen + repeat) return tasks;
    seen += repeat;
    pos = comma + 1;
  }
  return 0;
}

}  // namespace

bool launched_as_rank() {
  auto above_one = [](const char* name) {
    const char* v = env(name);
    return v != nullptr && std::atoll(v) > 1;
  };
  return env("RANK") != nullptr || env("WORLD_SIZE") != nullptr ||
         (env("OMPI_COMM_WORLD_RANK") != nullptr && above_one("OMPI_COMM_WORLD_SIZE")) ||
         (env("SLURM_PROCID") != nullptr && above_one("SLURM_NTASKS"));
}

LaunchEnv launch_env_from_environment() {
  Reader r;
  LaunchEnv e;
  if (env("RANK") || env("WORLD_SIZE")) {
    e.launcher = "torchrun";
    e.rank = r.integer("RANK", 0);
    e.world_size = r.integer("WORLD_SIZE", 1);
    e.local_rank = env("LOCAL_RANK") ? r.integer("LOCAL_RANK", 0) : 0;
    e.local_world_size = env("LOCAL_WORLD_SIZE") ? r.integer("LOCAL_WORLD_SIZE", 1) : 1;
    if (env("GROUP_RANK")) {
      e.node_rank = r.integer("GROUP_RANK", 0);
    } else if (env("NODE_RANK")) {
      e.node_rank = r.integer("NODE_RANK", 0);
    }
    const char* agent = env("TORCHELASTIC_USE_AGENT_STORE");
    e.agent_store = agent != nullptr && std::string(agent) == "True";
    if (e.agent_store) {
      e.restart_count =
          env("TORCHELASTIC_RESTART_COUNT") ? r.integer("TORCHELASTIC_RESTART_COUNT", 0) : 0;
    }
  } else if (env("OMPI_COMM_WORLD_RANK")) {
    e.launcher = "Open MPI";
    e.rank = r.integer("OMPI_COMM_WORLD_RANK", 0);
    e.world_size = r.integer("OMPI_COMM_WORLD_SIZE", 1);
    e.local_rank =
        env("OMPI_COMM_WORLD_LOCAL_RANK") ? r.integer("OMPI_COMM_WORLD_LOCAL_RANK", 0) : 0;
    e.local_world_size =
        env("OMPI_COMM_WORLD_LOCAL_SIZE") ? r.integer("OMPI_COMM_WORLD_LOCAL_SIZE", 1) : 1;
  } else if (env("SLURM_PROCID")) {
    e.launcher = "Slurm";
    e.rank = r.integer("SLURM_PROCID", 0);
    e.world_size = r.integer("SLURM_NTASKS", 1);
    e.local_rank = env("SLURM_LOCALID") ? r.integer("SLURM_LOCALID", 0) : 0;
    if (env("SLURM_NODEID")) e.node_rank = r.integer("SLURM_NODEID", 0);
    const char* per_node = env("SLURM_STEP_TASKS_PER_NODE") ? "SLURM_STEP_TASKS_PER_NODE"
                           : env("SLURM_TASKS_PER_NODE")    ? "SLURM_TASKS_PER_NODE"
                                                            : nullptr;
    if (per_node != nullptr) {
      const int64_t tasks = slurm_tasks_on_node(env(per_node), std::max<int64_t>(0, e.node_rank));
      if (tasks > 0) {
        e.local_world_size = tasks;
      } else {
        r.malformed.push_back(std::string(per_node) + "='" + env(per_node) + "' at SLURM_NODEID=" +
                              std::to_string(std::max<int64_t>(0, e.node_rank)));
      }
    }
  } else {
    TORCH_CHECK(false,
                "ampx::dist: no launcher environment: set RANK and WORLD_SIZE (torchrun), or run "
                "under Open MPI (OMPI_COMM_WORLD_RANK) or Slurm (SLURM_PROCID), with "
                "MASTER_ADDR and MASTER_PORT");
  }
  e.master_addr = r.text("MASTER_ADDR");
  e.master_port = r.integer("MASTER_PORT", 1);
  TORCH_CHECK(r.missing.empty() && r.malformed.empty(), "ampx::dist: incomplete ", e.launcher,
              " environment:", r.missing.empty() ? "" : " missing " + join(r.missing) + ";",
              r.malformed.empty() ? "" : " malformed " + join(r.malformed) + ";",
              " needed: rank, world size, MASTER_ADDR, MASTER_PORT");
  TORCH_CHECK(e.rank < e.world_size, "ampx::dist: rank ", e.rank, " is not below the world size ",
              e.world_size, " (", e.launcher, ")");
  TORCH_CHECK(e.master_port <= 65535, "ampx::dist: MASTER_PORT=", e.master_port,
              " is not a TCP port");
  return e;
}

}  // namespace dist
}  // namespace ampx
