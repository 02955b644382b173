#pragma once

// What a process group needs to know about the network of its host: which
// address Gloo binds to (PyTorch's GLOO_SOCKET_IFNAME, or the source address
// of the route to MASTER_ADDR), whether two ranks share a network stack
// (loopback reaches only those that do), and whether a peer still answers.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace ampx {
namespace dist {
namespace net {

/// How Gloo's device(s) of this rank were chosen, and the address each binds.
struct GlooEndpoint {
  std::vector<std::string> interfaces;  // empty: bound by address (hostname)
  std::string address;                  // the first device's address
  std::string chosen_by;                // "GLOO_SOCKET_IFNAME=eth0", "the route to MASTER_ADDR ..."
};

/// A rank as the others see it, exchanged through the store at rendezvous.
struct Peer {
  std::string address;     // where its Gloo (and its liveness listener) is
  int port = 0;            // its liveness listener; 0: none
  std::string host;        // its hostname
  std::string stack;       // network_stack_id()
  std::string chosen_by;   // how its address was chosen
  std::string interfaces;  // its host's interfaces, for messages
};

/// `list` split at commas, empty parts dropped ("eth0,eth1" -> {eth0, eth1}).
std::vector<std::string> split_interfaces(const std::string& list);

/// The first IPv4 address of interface `name` (else its first IPv6 one).
/// Throws naming `setting` (e.g. "GLOO_SOCKET_IFNAME='eth9'") and the
/// interfaces this host has when there is no such interface or it has no
/// address.
std::string interface_address(const std::string& name, const std::string& setting);

/// The local address the kernel sends from to reach `host` (resolved:
/// an IP address or a name), without sending anything. Throws when `host`
/// does not resolve or no route leads there.
std::string source_address_towards(const std::string& host);

/// Whether `address` (numeric IPv4 or IPv6) is a loopback address.
bool is_loopback(const std::string& address);

/// This process's network stack: two processes reach each other over
/// loopback exactly when they share it (same kernel boot, same network
/// namespace).
std::string network_stack_id();

/// This host's interfaces with an address, for messages: "eth0 10.0.0.1, lo 127.0.0.1".
std::string interface_summary();

/// This host's name (gethostname), for messages.
std::string host_name();

/// A TCP socket listening on numeric `address`:`port`, for a TCPStore
/// server to take over (LibTorch 2.3+'s TCPStoreOptions::masterListenFd).
/// Throws naming the port and MASTER_PORT when the port is in use.
int listen_on(const std::string& address, int port);

/// Whether another socket of this host holds TCP `port` (a bind to the
/// wildcard address fails with EADDRINUSE).
bool port_in_use(int port);

/// The message for a rendezvous port another process holds.
std::string port_in_use_message(const std::string& address, int port);

/// What listens at MASTER_ADDR:MASTER_PORT, for the message of a rank that
/// could not join the store there: one connection, at most `budget`.
/// A c10d store's server accepts and waits for its client to speak, so a
/// peer that closes at once or speaks first is another program; nothing
/// listening means rank 0 is not (yet, or any more) serving; a silent one is
/// a store or another program. E.g. "something there accepts connections and
/// closes them without a word, as no c10d store does: ...".
std::string describe_rendezvous_port(const std::string& host, int port,
                                     std::chrono::milliseconds budget);

/// A TCP socket listening on `address`, port chosen by the kernel, served by
/// a thread of this process for as long as it lives: to each connection it
/// replies "ampx-alive <n>\n", n the collectives this rank has started
/// (`collectives`), and closes it. Peers probe it to tell a lost rank (no
/// answer, or refused once its process is gone), a stopped one (the kernel
/// accepts the connection, but no thread of a SIGSTOPped process replies)
/// and one that answers but has not reached the collective the others wait
/// in.
class LivenessListener {
 public:
  LivenessListener(const std::string& address,
                   std::shared_ptr<const std::atomic<int64_t>> collectives);
  ~LivenessListener();
  LivenessListener(const LivenessListener&) = delete;
  LivenessListener& operator=(const LivenessListener&) = delete;
  int port() const { return port_; }

 private:
  void serve();
  int fd_ = -1;
  int port_ = 0;
  int wake_[2] = {-1, -1};  // a pipe: a byte (or its closing) ends serve()
  std::shared_ptr<const std::atomic<int64_t>> collectives_;
  std::thread thread_;
};

enum class PeerState {
  kAnswers,   // replied: the process runs
  kRefused,   // connection refused (or closed unanswered): its process is gone
  kNoAnswer,  // no TCP answer: its host is down or the network to it is cut
  kNoReply,   // the kernel accepted, no thread replied: the process is stopped
};

struct ProbeResult {
  PeerState state = PeerState::kNoAnswer;
  int64_t collectives = -1;  // what a kAnswers peer said it has started
};

/// Connects to every (address, port) at once, reads each reply, and waits
/// at most `budget` in all.
std::vector<ProbeResult> probe(const std::vector<std::pair<std::string, int>>& peers,
                               std::chrono::milliseconds budget);

}  // namespace net
}  // namespace dist
}  // namespace ampx
