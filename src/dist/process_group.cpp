// Launcher environments, TCPStore rendezvous and the Gloo (and NCCL)
// process groups.

#include "ampx/dist.h"

#include "ampx/detail/compat.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#if defined(AMPX_WITH_DIST)
#if __has_include(<torch/csrc/distributed/c10d/FileStore.hpp>)
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#else  // newer PyTorch names them .h
#include <torch/csrc/distributed/c10d/FileStore.h>
#endif
#if __has_include(<torch/csrc/distributed/c10d/PrefixStore.hpp>)
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#else  // newer PyTorch names them .h
#include <torch/csrc/distributed/c10d/PrefixStore.h>
#endif
#if __has_include(<torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>)
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#else  // newer PyTorch names them .h
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.h>
#endif
#if __has_include(<torch/csrc/distributed/c10d/TCPStore.hpp>)
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#else  // newer PyTorch names them .h
#include <torch/csrc/distributed/c10d/TCPStore.h>
#endif
#endif

#include <arpa/inet.h>
#include <signal.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>
#include <vector>

#include "network.h"
#include "process_group_impl.h"
#include "rendezvous.h"

namespace ampx {
namespace dist {
bool is_available() {
#if defined(AMPX_WITH_DIST)
  return true;
#else
  return false;
#endif
}

bool is_nccl_available() {
#if defined(AMPX_WITH_DIST) && defined(AMPX_WITH_NCCL)
  return true;
#else
  return false;
#endif
}

int free_loopback_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  TORCH_CHECK(fd >= 0, "ampx::dist::free_loopback_port: socket() failed: ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int error = errno;
  ::close(fd);
  TORCH_CHECK(ok,
              "ampx::dist::free_loopback_port: no free port on 127.0.0.1: ", std::strerror(error));
  return ntohs(addr.sin_port);
}

ProcessGroup::Impl::~Impl() {
#if defined(AMPX_WITH_DIST) && defined(AMPX_WITH_NCCL) && AMPX_TORCH_AT_LEAST(2, 6)
  // What Python's destroy_process_group does: NCCL's communicators end
  // cleanly (otherwise 2.6+ warns and aborts them).
  if (nccl) {
    try {
      static_cast<c10d::ProcessGroupNCCL&>(*nccl).shutdown();
    } catch (const std::exception&) {
      // a destructor: the communicators die with the process anyway
    }
  }
#endif
}

ProcessGroup::ProcessGroup(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
int64_t ProcessGroup::rank() const {
  return impl_->rank;
}
int64_t ProcessGroup::world_size() const {
  return impl_->world_size;
}
std::chrono::milliseconds ProcessGroup::timeout() const {
  return impl_->timeout;
}
bool ProcessGroup::has_nccl() const {
#if defined(AMPX_WITH_DIST)
  return impl_->nccl != nullptr;
#else
  return false;
#endif
}
std::string ProcessGroup::backends() const {
  return has_nccl() ? "gloo+nccl" : "gloo";
}
std::string ProcessGroup::gloo_endpoint() const {
  return impl_->endpoint;
}

void ProcessGroup::Impl::fail(const std::string& what, const std::exception& e) const {
  const int64_t mine = collectives->load();
  std::ostringstream out;
  out << "ampx::dist: " << what << " failed on rank " << rank << " of " << world_size;
  if (rank < static_cast<int64_t>(peers.size())) out << " (" << peers[rank].address << ")";
  out << " within the timeout of " << timeout.count() << " ms";
  std::vector<std::pair<std::string, int>> targets;
  std::vector<int64_t> ranks;
  for (int64_t r = 0; r < static_cast<int64_t>(peers.size()); ++r) {
    if (r == rank || peers[r].port == 0) continue;
    targets.emplace_back(peers[r].address, peers[r].port);
    ranks.push_back(r);
  }
  // A process that was just killed closes its sockets one after the other:
  // the one Gloo saw close may go before its listener. Probing after a
  // moment's settling finds the whole of it gone.
  const auto settle = std::min(std::chrono::milliseconds(200), probe_budget / 2);
  std::this_thread::sleep_for(settle);
  const auto wait = probe_budget - settle;
  const auto states = net::probe(targets, wait);
  std::string lost, stopped, behind, answering;
  auto add = [](std::string& list, const std::string& item, const char* sep) {
    list += (list.empty() ? "" : sep) + item;
  };
  for (size_t k = 0; k < states.size(); ++k) {
    const auto& p = peers[ranks[k]];
    const std::string who =
        "rank " + std::to_string(ranks[k]) + " at " + p.address + " (host '" + p.host + "')";
    switch (states[k].state) {
      case net::PeerState::kAnswers:
        if (states[k].collectives < mine) {
          add(behind,
              who + " answers but has not reached this rank's collective #" + std::to_string(mine) +
                  " (it started " + std::to_string(states[k].collectives) +
                  "): it is still computing, or stuck outside the collectives",
              "; ");
        } else {
          add(answering, std::to_string(ranks[k]), ", ");
        }
        break;
      case net::PeerState::kNoReply:
        add(stopped,
            who + ": its host accepts the connection but the process did not reply within " +
                std::to_string(wait.count()) +
                " ms: it is stopped (SIGSTOP, Ctrl-Z, a debugger) or frozen",
            "; ");
        break;
      case net::PeerState::kRefused:
        add(lost, who + ": connection refused, its process is gone", "; ");
        break;
      case net::PeerState::kNoAnswer:
        add(lost,
            who + ": no answer within " + std::to_string(wait.count()) +
                " ms, its host is down or the network to it is cut",
            "; ");
        break;
    }
  }
  if (!stopped.empty()) out << "; not responding: " << stopped;
  if (!lost.empty()) out << "; unreachable peer(s): " << lost;
  if (!behind.empty()) out << "; behind: " << behind;
  if (stopped.empty() && lost.empty() && behind.empty() && !targets.empty()) {
    out << "; every peer still answers and has reached this collective (out of step?)";
  }
  if (!answering.empty()) out << "; answering: rank(s) " << answering;
  out << ". Gloo: " << message_of(e);
  TORCH_CHECK(false, out.str());
}

#if defined(AMPX_WITH_DIST)

c10::intrusive_ptr<c10d::Work> ProcessGroup::Impl::all_reduce_async(at::Tensor& t,
                                                                    c10d::ReduceOp op) {
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions o;
  o.reduceOp = op;
  o.timeout = collective_timeout;
  ++*collectives;
  return backend_for(t).allreduce(tensors, o);
}

void ProcessGroup::all_reduce_sum(at::Tensor& t) const {
  impl_->wait(impl_->all_reduce_async(t, c10d::ReduceOp::SUM), "all-reduce");
}

void ProcessGroup::all_reduce_max(at::Tensor& t) const {
  impl_->wait(impl_->all_reduce_async(t, c10d::ReduceOp::MAX), "all-reduce (max)");
}

void ProcessGroup::reduce_scatter_sum(at::Tensor& output, at::Tensor& input) const {
  auto rs = impl_->reduce_scatter_async(output, input);
  impl_->wait(rs);
}

void ProcessGroup::all_gather(at::Tensor& output, const at::Tensor& input) const {
  impl_->wait(impl_->all_gather_async(output, input), "all-gather");
}

std::vector<std::string> ProcessGroup::all_gather_bytes(const std::string& bytes) const {
  const int64_t world = world_size();
  auto length = torch::tensor({static_cast<int64_t>(bytes.size())}, torch::kLong);
  auto lengths = torch::empty({world}, torch::kLong);
  all_gather(lengths, length);
  const int64_t longest = lengths.max().item<int64_t>();
  if (longest == 0) return std::vector<std::string>(static_cast<size_t>(world));  // Gloo: SIGFPE
  auto mine = torch::zeros({longest}, torch::kByte);
  std::copy(bytes.begin(), bytes.end(), static_cast<char*>(mine.data_ptr()));
  auto all = torch::empty({longest * world}, torch::kByte);
  all_gather(all, mine);
  std::vector<std::string> out;
  const auto* data = static_cast<const char*>(all.data_ptr());
  for (int64_t r = 0; r < world; ++r) {
    out.emplace_back(data + r * longest, static_cast<size_t>(lengths[r].item<int64_t>()));
  }
  return out;
}

void ProcessGroup::broadcast(at::Tensor& t, int64_t root) const {
  std::vector<at::Tensor> tensors{t};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  o.timeout = impl_->collective_timeout;
  ++*impl_->collectives;
  impl_->wait(impl_->backend_for(t).broadcast(tensors, o), "broadcast");
}

void ProcessGroup::barrier() const {
  auto t = torch::zeros({1});
  all_reduce_sum(t);  // a barrier that also reports a dead rank
}

namespace {

// The ranks' rendezvous: InitOptions::store_file's file, else the TCP store at
// the master address (rank 0 serves it where no agent's store is there),
// under an agent's prefix for its restart attempt.
c10::intrusive_ptr<c10d::Store> open_store(const LaunchEnv& env, const InitOptions& options,
                                           bool serves_store) {
  c10::intrusive_ptr<c10d::Store> store;
  if (!options.store_file().empty()) {
    // No socket: the ranks of one machine meet in a file.
    store = c10::make_intrusive<c10d::FileStore>(options.store_file(),
                                                 static_cast<int>(env.world_size));
    store->setTimeout(options.timeout());
  } else {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(env.master_port);
    so.isServer = serves_store;
    so.numWorkers = static_cast<size_t>(env.world_size);
    so.waitWorkers = false;
    so.timeout = options.timeout();
#if AMPX_TORCH_AT_LEAST(2, 3)
    // 2.3 added a libuv server and 2.4 made it the default, which Debian's
    // build lacks; the classic server is the one every build has.
    so.useLibUV = false;
    // Where every rank meets on loopback, the store listens there alone:
    // nobody else in. (1.13's TCPStore always listens on every interface.)
    if (serves_store && net::is_loopback(env.master_addr)) {
      so.masterListenFd = net::listen_on(env.master_addr, static_cast<int>(env.master_port));
    }
#endif
    try {
      store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
    } catch (const std::exception& e) {
      TORCH_CHECK(!serves_store || !net::port_in_use(static_cast<int>(env.master_port)),
                  net::port_in_use_message(env.master_addr, static_cast<int>(env.master_port)),
                  ": ", message_of(e));
      // What is on that port decides what to do (a busy port, rank 0 gone).
      const std::string there = net::describe_rendezvous_port(
          env.master_addr, static_cast<int>(env.master_port),
          std::min(std::chrono::milliseconds(1000), options.timeout()));
      TORCH_CHECK(false, "ampx::dist: rank ", env.rank, " could not reach the rendezvous at ",
                  env.master_addr, ":", env.master_port, " within ", options.timeout().count(),
                  " ms: ", message_of(e), there.empty() ? "" : "; ", there);
    }
  }
  if (env.agent_store) {
    store = c10::make_intrusive<c10d::PrefixStore>(
        "/worker/attempt_" + std::to_string(env.restart_count), store);
  }
  return store;
}

// The Gloo group over `store`, on the devices of impl.endpoint.
c10::intrusive_ptr<c10d::ProcessGroupGloo> connect_gloo(
    const LaunchEnv& env, const InitOptions& options, const detail::ProcessGroupAccess::Impl& impl,
    const net::GlooEndpoint& endpoint, const c10::intrusive_ptr<c10d::Store>& store) {
  auto gloo_options = c10d::ProcessGroupGloo::Options::create(impl.collective_timeout);
  try {
    if (endpoint.interfaces.empty()) {
      gloo_options->devices.push_back(
          c10d::ProcessGroupGloo::createDeviceForHostname(endpoint.address));
    } else {
      for (const auto& iface : endpoint.interfaces) {
        gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(iface));
      }
    }
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "ampx::dist: rank ", env.rank, " cannot make a Gloo device on ",
                impl.endpoint, ": ", message_of(e));
  }
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
  try {
    gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>("ampx", store), static_cast<int>(env.rank),
        static_cast<int>(env.world_size), gloo_options);
  } catch (const std::exception& e) {
    std::string where;
    for (size_t r = 0; r < impl.peers.size(); ++r) {
      where += (where.empty() ? "" : ", ") + std::to_string(r) + " " + impl.peers[r].address;
    }
    TORCH_CHECK(false, "ampx::dist: rank ", env.rank, " of ", env.world_size,
                " could not connect the Gloo group within ", options.timeout().count(),
                " ms (ranks' Gloo addresses: ", where,
                "; every host must reach the others' on any TCP port: check firewalls, and "
                "GLOO_SOCKET_IFNAME where a host has several networks): ",
                message_of(e));
  }
  return gloo;
}

// Gloo writes to its sockets with writev(2), which raises SIGPIPE when the
// peer has gone; Gloo then expects EPIPE. Python ignores SIGPIPE at start-up,
// so torch.distributed never sees the signal; a C++ program left at the
// default would die of it, silently, where the collective should fail
// naming the lost rank. A disposition the program chose stays.
void ignore_sigpipe_left_at_default() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) != 0) return;
  const bool is_default =
      (current.sa_flags & SA_SIGINFO) == 0 && current.sa_handler == SIG_DFL;
  if (!is_default) return;
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  ::sigaction(SIGPIPE, &ignore, nullptr);
}

}  // namespace

ProcessGroup init_process_group(const LaunchEnv& env, const InitOptions& options) {
  ignore_sigpipe_left_at_default();
  TORCH_CHECK(env.world_size >= 1 && env.rank >= 0 && env.rank < env.world_size,
              "ampx::dist::init_process_group: rank ", env.rank, " of world size ", env.world_size,
              " is not a position in the group");
  TORCH_CHECK(!env.master_addr.empty() && ((env.master_port > 0 && env.master_port <= 65535) ||
                                           !options.store_file().empty()),
              "ampx::dist::init_process_group: master address '", env.master_addr, "' port ",
              env.master_port, " is not a rendezvous point");
  auto impl = std::make_shared<detail::ProcessGroupAccess::Impl>();
  impl->rank = env.rank;
  impl->world_size = env.world_size;
  impl->timeout = options.timeout();
  const bool serves_store = env.rank == 0 && !env.agent_store && options.store_file().empty();
  const c10::intrusive_ptr<c10d::Store> store = open_store(env, options, serves_store);
  // The probe that names lost peers comes out of the timeout.
  impl->probe_budget = std::min(std::chrono::milliseconds(1000),
                                std::max(std::chrono::milliseconds(1), options.timeout() / 10));
  impl->collective_timeout =
      std::max(std::chrono::milliseconds(1), options.timeout() - impl->probe_budget);
  const net::GlooEndpoint endpoint = choose_gloo_endpoint(env, options);
  impl->endpoint = endpoint.address + " (" + endpoint.chosen_by + ")";
  try {
    impl->listener = std::make_unique<net::LivenessListener>(endpoint.address, impl->collectives);
  } catch (const std::exception&) {
    // Only the names of lost peers depend on it: their probe then finds none.
  }
  impl->peers =
      exchange_endpoints(store, env, endpoint, impl->listener ? impl->listener->port() : 0,
                         options.timeout(), serves_store);
  check_loopback_reachable(impl->peers, env.rank);
  impl->gloo = connect_gloo(env, options, *impl, endpoint, store);
#if defined(AMPX_WITH_NCCL)
  // NCCL's communicators are made at the first collective, on the device of
  // its tensors; every rank must take part (the same on all ranks: the
  // options and the CUDA build are). Its own store prefix keeps its keys
  // apart from Gloo's.
  if (options.nccl() && torch::cuda::is_available()) {
    auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
    nccl_options->timeout = options.timeout();
    impl->nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(
        c10::make_intrusive<c10d::PrefixStore>("ampx-nccl", store), static_cast<int>(env.rank),
        static_cast<int>(env.world_size), nccl_options);
  }
#endif
  return detail::ProcessGroupAccess::make(std::move(impl));
}

#else  // !AMPX_WITH_DIST

namespace {
[[noreturn]] void unavailable() {
  TORCH_CHECK(false,
              "ampx::dist: this ampx was built without c10d/Gloo (LibTorch's distributed "
              "headers and Debian's libgloo-dev)");
}
}  // namespace

void ProcessGroup::all_reduce_sum(at::Tensor&) const {
  unavailable();
}
void ProcessGroup::all_reduce_max(at::Tensor&) const {
  unavailable();
}
void ProcessGroup::reduce_scatter_sum(at::Tensor&, at::Tensor&) const {
  unavailable();
}
void ProcessGroup::all_gather(at::Tensor&, const at::Tensor&) const {
  unavailable();
}
std::vector<std::string> ProcessGroup::all_gather_bytes(const std::string&) const {
  unavailable();
}
void ProcessGroup::broadcast(at::Tensor&, int64_t) const {
  unavailable();
}
void ProcessGroup::barrier() const {
  unavailable();
}
ProcessGroup init_process_group(const LaunchEnv&, const InitOptions&) {
  unavailable();
}

#endif

ProcessGroup init_process_group(const InitOptions& options) {
  return init_process_group(launch_env_from_environment(), options);
}

}  // namespace dist
}  // namespace ampx
