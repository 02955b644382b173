// The rendezvous of a process group across hosts: where each rank's Gloo
// binds, the table of every rank's address exchanged through the store, and
// the check that no rank other hosts must reach sits on loopback.

#include "rendezvous.h"

#include <c10/util/Exception.h>

#if __has_include(<torch/csrc/distributed/c10d/PrefixStore.hpp>)
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#else  // newer PyTorch names them .h
#include <torch/csrc/distributed/c10d/PrefixStore.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "process_group_impl.h"  // message_of

namespace ampx {
namespace dist {

/// Where this rank's Gloo binds: InitOptions::interfaces, else
/// InitOptions::hostname, else GLOO_SOCKET_IFNAME (PyTorch's variable, the
/// same comma-separated list), else the source address of the route to
/// MASTER_ADDR.
net::GlooEndpoint choose_gloo_endpoint(const LaunchEnv& env, const InitOptions& options) {
  net::GlooEndpoint out;
  std::string list, setting;
  if (!options.interfaces().empty()) {
    list = options.interfaces();
    setting = "InitOptions::interfaces '" + list + "'";
  } else if (options.hostname().empty()) {
    const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
    if (ifname != nullptr && *ifname != '\0') {
      list = ifname;
      setting = "GLOO_SOCKET_IFNAME=" + list;
    }
  }
  if (!setting.empty()) {
    out.interfaces = net::split_interfaces(list);
    TORCH_CHECK(!out.interfaces.empty(), "ampx::dist: ", setting, " names no interface");
    for (const auto& iface : out.interfaces) {
      const std::string address = net::interface_address(iface, setting);
      if (out.address.empty()) out.address = address;
    }
    out.chosen_by = setting;
    return out;
  }
  if (!options.hostname().empty()) {
    out.address = net::source_address_towards(options.hostname());
    out.chosen_by = "InitOptions::hostname '" + options.hostname() + "'";
    return out;
  }
  out.address = net::source_address_towards(env.master_addr);
  out.chosen_by = "the route to MASTER_ADDR " + env.master_addr;
  return out;
}

namespace {

std::vector<uint8_t> bytes_of(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

std::string text_of(const std::vector<uint8_t>& b) {
  return std::string(b.begin(), b.end());
}

/// The variable that gave this launcher's world size.
std::string world_size_variable(const LaunchEnv& env) {
  if (env.launcher == "Slurm") return "SLURM_NTASKS";
  if (env.launcher == "Open MPI") return "OMPI_COMM_WORLD_SIZE";
  return "WORLD_SIZE";
}

/// A rendezvous that fails: `message` goes to the store ("error"), where
/// every waiting rank finds it and fails with it at once rather than at the
/// timeout. The store's server (rank 0) stays until every rank (as many as
/// it counts, or more that arrived) has failed too, at most 10 s, so that
/// they read the message rather than lose the store.
[[noreturn]] void fail_rendezvous(c10d::Store& store, bool serves_store, int64_t world_size,
                                  std::chrono::milliseconds timeout, const std::string& message) {
  try {
    store.compareSet("error", {}, bytes_of(message));
    const int64_t failed = store.add("failed", 1);
    if (serves_store) {
      const auto deadline =
          std::chrono::steady_clock::now() + std::min(timeout, std::chrono::milliseconds(10000));
      int64_t gone = failed;
      while (gone < std::max(world_size, store.add("arrived", 0)) &&
             std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        gone = store.add("failed", 0);
      }
    }
  } catch (const std::exception&) {
    // the store went away: each rank fails on its own then
  }
  TORCH_CHECK(false, message);
}

// The first rank to arrive sets the world size; a rank started with
// another fails every rank at once (otherwise those of the smaller world
// go on to Gloo and the others wait for ranks that never come). `me` names
// this rank, `where` the rendezvous.
void agree_on_world_size(c10d::Store& store, const LaunchEnv& env, const std::string& me,
                         const std::string& where, std::chrono::milliseconds timeout,
                         bool serves_store) {
  const std::string mine_ws = std::to_string(env.world_size) + "\n" + me;
  std::string first_ws;
  try {
    first_ws = text_of(store.compareSet("world-size", {}, bytes_of(mine_ws)));
    store.add("arrived", 1);
  } catch (const std::exception& e) {
    // What is on that port decides what to do (a busy port, rank 0 gone).
    const std::string there =
        serves_store ? std::string()
                     : net::describe_rendezvous_port(
                            env.master_addr, static_cast<int>(env.master_port),
                            std::min(std::chrono::milliseconds(1000), timeout));
    TORCH_CHECK(false, "ampx::dist: rank ", env.rank, " of ", env.world_size, " cannot use ", where,
                " (if rank 0 could not serve it, its message says why): ", message_of(e),
                there.empty() ? "" : "; ", there);
  }
  if (first_ws != mine_ws) {
    const auto newline = first_ws.find('\n');
    const std::string theirs = first_ws.substr(0, newline);
    const std::string who = newline == std::string::npos ? "?" : first_ws.substr(newline + 1);
    if (theirs != std::to_string(env.world_size)) {
      fail_rendezvous(store, serves_store, env.world_size, timeout,
                      "ampx::dist: ranks were started with different world sizes: " + me +
                          " with " + world_size_variable(env) + "=" +
                          std::to_string(env.world_size) + ", " + who + " with " +
                          world_size_variable(env) + "=" + theirs +
                          ". Start every rank of a run with the same world size");
    }
  }
}

// The peers' table: each rank's entry under its number in `keys`.
std::vector<net::Peer> read_peers(c10d::Store& store, const std::vector<std::string>& keys) {
  std::vector<net::Peer> peers;
  for (const auto& k : keys) {
    std::istringstream in(text_of(store.get(k)));
    net::Peer p;
    std::string port_text;
    std::getline(in, p.address);
    std::getline(in, port_text);
    std::getline(in, p.stack);
    std::getline(in, p.host);
    std::getline(in, p.chosen_by);
    std::getline(in, p.interfaces);
    p.port = std::atoi(port_text.c_str());
    peers.push_back(std::move(p));
  }
  return peers;
}

}  // namespace

/// Every rank's Gloo address, liveness port and host, through the store;
/// fails naming the ranks that did not arrive within `timeout`, and at once
/// when ranks were started with different world sizes.
std::vector<net::Peer> exchange_endpoints(const c10::intrusive_ptr<c10d::Store>& root,
                                          const LaunchEnv& env, const net::GlooEndpoint& endpoint,
                                          int port, std::chrono::milliseconds timeout,
                                          bool serves_store) {
  auto store = c10::make_intrusive<c10d::PrefixStore>("ampx-net", root);
  const std::string me = "rank " + std::to_string(env.rank) + " (host '" + net::host_name() + "')";
  const std::string where =
      "the rendezvous at MASTER_ADDR " + env.master_addr + ":" + std::to_string(env.master_port);
  agree_on_world_size(*store, env, me, where, timeout, serves_store);
  const std::string mine = endpoint.address + "\n" + std::to_string(port) + "\n" +
                           net::network_stack_id() + "\n" + net::host_name() + "\n" +
                           endpoint.chosen_by + "\n" + net::interface_summary();
  std::vector<std::string> keys;
  for (int64_t r = 0; r < env.world_size; ++r) keys.push_back(std::to_string(r));
  // Waits in short polls: an error another rank posts ends the wait at once.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string why;  // another rank's failure
  try {
    store->set(std::to_string(env.rank), bytes_of(mine));
    while (!store->check(keys)) {
      if (store->check({"error"})) {
        why = text_of(store->get("error"));
        break;
      }
      if (std::chrono::steady_clock::now() > deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "ampx::dist: rank ", env.rank, " of ", env.world_size,
                " lost the rendezvous store at MASTER_ADDR ", env.master_addr, ":", env.master_port,
                " (its server, rank 0 or the launcher's agent, ended: see its "
                "message): ",
                message_of(e));
  }
  if (!why.empty()) {
    fail_rendezvous(*store, serves_store, env.world_size, timeout,
                    "ampx::dist: rank " + std::to_string(env.rank) + " of " +
                        std::to_string(env.world_size) + ": the rendezvous failed: " + why);
  }
  std::string missing;
  for (const auto& k : keys) {
    if (!store->check({k})) missing += (missing.empty() ? "" : ", ") + k;
  }
  TORCH_CHECK(missing.empty(), "ampx::dist: rank ", env.rank, " of ", env.world_size, ": rank(s) ",
              missing, " did not reach ", where, " within ", timeout.count(),
              " ms (did every rank start, and does every host reach that address?)");
  std::vector<net::Peer> peers = read_peers(*store, keys);
  // The store's server (rank 0, unless the launcher's agent serves it) stays
  // until every rank has the table: a rank that fails on what it says must
  // not take the store away from the others' reading of it.
  if (store->add("read", 1) == env.world_size) store->set("all-read", std::vector<uint8_t>{1});
  if (serves_store) {
    try {
      store->wait({"all-read"}, timeout);
    } catch (const std::exception&) {
      // a rank that stopped reading fails on its own; this one goes on
    }
  }
  return peers;
}

/// Loopback reaches only the ranks of the same network stack: a rank bound
/// to it that ranks elsewhere must connect to fails every rank here, the
/// same on all, before Gloo waits the whole timeout for connections that
/// cannot come.
void check_loopback_reachable(const std::vector<net::Peer>& peers, int64_t rank) {
  for (size_t p = 0; p < peers.size(); ++p) {
    if (!net::is_loopback(peers[p].address)) continue;
    std::string others;
    for (size_t q = 0; q < peers.size(); ++q) {
      if (peers[q].stack != peers[p].stack) {
        others += (others.empty() ? "" : ", ") + std::to_string(q) + " (" + peers[q].address + ")";
      }
    }
    if (others.empty()) continue;
    TORCH_CHECK(false, "ampx::dist: rank ", p, " on host '", peers[p].host,
                "' would serve Gloo on ", peers[p].address, ", chosen by ", peers[p].chosen_by,
                ": a loopback address, which rank(s) ", others,
                " on other hosts cannot reach (this is rank ", rank,
                "). Set GLOO_SOCKET_IFNAME on that host to the network interface the other "
                "hosts reach it through (its interfaces: ",
                peers[p].interfaces,
                "), as for PyTorch. The usual cause: MASTER_ADDR there is a name that resolves "
                "to loopback on that host (e.g. its hostname mapped to 127.0.1.1 in /etc/hosts)");
  }
}

}  // namespace dist
}  // namespace ampx
