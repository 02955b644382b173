#pragma once

// The rendezvous of a process group across hosts (rendezvous.cpp).

#include "ampx/dist.h"

#include "network.h"

#if __has_include(<torch/csrc/distributed/c10d/Store.hpp>)
#include <torch/csrc/distributed/c10d/Store.hpp>
#else  // newer PyTorch names them .h
#include <torch/csrc/distributed/c10d/Store.h>
#endif

#include <chrono>
#include <cstdint>
#include <vector>

namespace ampx {
namespace dist {

/// Where this rank's Gloo binds: InitOptions::interfaces, else
/// InitOptions::hostname, else GLOO_SOCKET_IFNAME (PyTorch's variable, the
/// same comma-separated list), else the source address of the route to
/// MASTER_ADDR. Errors name the setting.
net::GlooEndpoint choose_gloo_endpoint(const LaunchEnv& env, const InitOptions& options);

/// Every rank's Gloo address, liveness port and host, through `store`;
/// fails naming the ranks that did not arrive within `timeout`, and at once,
/// on every rank that arrived, when ranks were started with different
/// world sizes. The rank that `serves_store` returns only when every rank
/// has read the table (or the timeout passed).
std::vector<net::Peer> exchange_endpoints(const c10::intrusive_ptr<c10d::Store>& store,
                                          const LaunchEnv& env, const net::GlooEndpoint& endpoint,
                                          int port, std::chrono::milliseconds timeout,
                                          bool serves_store);

/// Fails, on every rank alike, when a rank would serve Gloo on loopback
/// while ranks of other network stacks (hosts) must connect to it; the
/// message names GLOO_SOCKET_IFNAME and that host's interfaces.
void check_loopback_reachable(const std::vector<net::Peer>& peers, int64_t rank);

}  // namespace dist
}  // namespace ampx
