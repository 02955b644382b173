// Interface addresses, routes, network stacks and liveness probes for the
// process group (network.h).

#include "network.h"

#include <c10/util/Exception.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>

namespace ampx {
namespace dist {
namespace net {
namespace {

std::string numeric(const sockaddr* sa) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (sa->sa_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(sa)->sin_addr, buf, sizeof(buf));
  } else if (sa->sa_family == AF_INET6) {
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr, buf, sizeof(buf));
  }
  return buf;
}

/// `address`:`port` as a sockaddr (numeric addresses only).
bool to_sockaddr(const std::string& address, int port, sockaddr_storage& out, socklen_t& len) {
  std::memset(&out, 0, sizeof(out));
  auto* v4 = reinterpret_cast<sockaddr_in*>(&out);
  if (::inet_pton(AF_INET, address.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(static_cast<uint16_t>(port));
    len = sizeof(sockaddr_in);
    return true;
  }
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&out);
  if (::inet_pton(AF_INET6, address.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(static_cast<uint16_t>(port));
    len = sizeof(sockaddr_in6);
    return true;
  }
  return false;
}

struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

std::vector<std::string> split_interfaces(const std::string& list) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = std::min(list.find(',', start), list.size());
    if (comma > start) out.push_back(list.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

std::string interface_address(const std::string& name, const std::string& setting) {
  ifaddrs* list = nullptr;
  TORCH_CHECK(::getifaddrs(&list) == 0, "ampx::dist: cannot list this host's interfaces for ",
              setting, ": ", std::strerror(errno));
  std::unique_ptr<ifaddrs, void (*)(ifaddrs*)> owner(list, ::freeifaddrs);
  std::string v4, v6, names;
  bool found = false;
  for (const ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (names.find(std::string(" ") + a->ifa_name + ",") == std::string::npos) {
      names += std::string(" ") + a->ifa_name + ",";
    }
    if (name != a->ifa_name) continue;
    found = true;
    if (a->ifa_addr == nullptr) continue;
    if (a->ifa_addr->sa_family == AF_INET && v4.empty()) v4 = numeric(a->ifa_addr);
    if (a->ifa_addr->sa_family == AF_INET6 && v6.empty()) v6 = numeric(a->ifa_addr);
  }
  if (!names.empty()) names = names.substr(1, names.size() - 2);
  TORCH_CHECK(found, "ampx::dist: ", setting, ": host '", host_name(), "' has no interface '", name,
              "' (it has: ", names, ")");
  TORCH_CHECK(!v4.empty() || !v6.empty(), "ampx::dist: ", setting, ": interface '", name,
              "' of host '", host_name(), "' has no IP address");
  return v4.empty() ? v6 : v4;
}

std::string source_address_towards(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), "9", &hints, &found);
  TORCH_CHECK(rc == 0 && found != nullptr, "ampx::dist: MASTER_ADDR '", host,
              "' does not resolve on host '", host_name(), "': ", ::gai_strerror(rc));
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> owner(found, ::freeaddrinfo);
  std::string error;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    FdCloser s{::socket(a->ai_family, SOCK_DGRAM, 0)};
    if (s.fd < 0) continue;
    // A datagram socket's connect() only picks the route and source address.
    if (::connect(s.fd, a->ai_addr, a->ai_addrlen) != 0) {
      error = std::strerror(errno);
      continue;
    }
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (::getsockname(s.fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      return numeric(reinterpret_cast<sockaddr*>(&local));
    }
  }
  TORCH_CHECK(false, "ampx::dist: no route from host '", host_name(), "' to MASTER_ADDR '", host,
              "': ", error);
}

bool is_loopback(const std::string& address) {
  in_addr v4{};
  if (::inet_pton(AF_INET, address.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (::inet_pton(AF_INET6, address.c_str(), &v6) == 1) {
    if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
    if (IN6_IS_ADDR_V4MAPPED(&v6)) return v6.s6_addr[12] == 127;
  }
  return false;
}

std::string network_stack_id() {
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  char ns[128] = {0};
  const ssize_t n = ::readlink("/proc/self/ns/net", ns, sizeof(ns) - 1);
  return boot + "/" + (n > 0 ? std::string(ns, static_cast<size_t>(n)) : "");
}

std::string interface_summary() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "?";
  std::unique_ptr<ifaddrs, void (*)(ifaddrs*)> owner(list, ::freeifaddrs);
  std::string out;
  for (const ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    out += (out.empty() ? "" : ", ") + std::string(a->ifa_name) + " " + numeric(a->ifa_addr);
  }
  return out.empty() ? "none with an IPv4 address" : out;
}

std::string host_name() {
  char name[256] = {0};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "?";
  return name;
}

std::string port_in_use_message(const std::string& address, int port) {
  const std::string p = std::to_string(port);
  return "ampx::dist: rank 0 cannot serve the rendezvous store on port " + p + " of " + address +
         " (MASTER_PORT=" + p +
         "): another process listens on that port (Address already in use). Give every rank "
         "another MASTER_PORT, or end that process (`ss -ltnp 'sport = :" +
         p + "'` names it)";
}

std::string describe_rendezvous_port(const std::string& host, int port,
                                     std::chrono::milliseconds budget) {
  const std::string where = host + ":" + std::to_string(port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 ||
      found == nullptr) {
    return "MASTER_ADDR '" + host + "' does not resolve here";
  }
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> owner(found, ::freeaddrinfo);
  FdCloser s{::socket(found->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)};
  if (s.fd < 0) return "";
  const auto deadline = std::chrono::steady_clock::now() + budget;
  const auto left = [&] {
    return static_cast<int>(std::max<int64_t>(
        0, std::chrono::duration_cast<std::chrono::milliseconds>(deadline -
                                                                 std::chrono::steady_clock::now())
               .count()));
  };
  const std::string nothing = "nothing listens on " + where +
                              " (connection refused): rank 0 has not started, has failed, or was "
                              "given another MASTER_ADDR or MASTER_PORT";
  if (::connect(s.fd, found->ai_addr, found->ai_addrlen) != 0) {
    if (errno == ECONNREFUSED) return nothing;
    if (errno != EINPROGRESS) return "";
    pollfd w{s.fd, POLLOUT, 0};
    if (::poll(&w, 1, left()) <= 0) {
      return "nothing answers at " + where + " within " + std::to_string(budget.count()) +
             " ms (no TCP answer: a host that is down, or a firewall dropping the port)";
    }
    int error = 0;
    socklen_t len = sizeof(error);
    ::getsockopt(s.fd, SOL_SOCKET, SO_ERROR, &error, &len);
    if (error == ECONNREFUSED) return nothing;
    if (error != 0) return "";
  }
  // Connected: a c10d store's server now waits for this client to speak.
  pollfd r{s.fd, POLLIN, 0};
  const int ready = ::poll(&r, 1, left());
  char byte = 0;
  const ssize_t got = ready > 0 ? ::recv(s.fd, &byte, 1, 0) : -1;
  const std::string other =
      ", as no c10d store does: another program holds MASTER_PORT=" + std::to_string(port) +
      " on that host (`ss -ltnp 'sport = :" + std::to_string(port) +
      "'` there names it); give every rank another MASTER_PORT";
  if (ready > 0 && got == 0) {
    return "something at " + where + " accepts connections and closes them without a word" + other;
  }
  if (ready > 0 && got > 0) return "something at " + where + " speaks first" + other;
  if (ready > 0) return "something at " + where + " accepts connections and resets them" + other;
  return "something at " + where +
         " accepts connections and stays silent: rank 0's store, stalled or busy, or another "
         "program on MASTER_PORT";
}

int listen_on(const std::string& address, int port) {
  sockaddr_storage addr{};
  socklen_t len = 0;
  TORCH_CHECK(to_sockaddr(address, port, addr, len), "ampx::dist: '", address,
              "' is not a numeric address");
  const int fd = ::socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  TORCH_CHECK(fd >= 0, "ampx::dist: socket() failed: ", std::strerror(errno));
  const int on = 1;  // as c10d's own listener: a port in TIME_WAIT is free
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || ::listen(fd, SOMAXCONN) != 0) {
    const int error = errno;
    ::close(fd);
    TORCH_CHECK(error != EADDRINUSE, port_in_use_message(address, port));
    TORCH_CHECK(false, "ampx::dist: rank 0 cannot serve the rendezvous store on ", address, ":",
                port, " (MASTER_ADDR, MASTER_PORT): ", std::strerror(error));
  }
  return fd;
}

bool port_in_use(int port) {
  for (const char* any : {"0.0.0.0", "::"}) {
    sockaddr_storage addr{};
    socklen_t len = 0;
    if (!to_sockaddr(any, port, addr, len)) continue;
    FdCloser s{::socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0)};
    if (s.fd < 0) continue;
    const int on = 1;
    ::setsockopt(s.fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
    if (::bind(s.fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 && errno == EADDRINUSE) {
      return true;
    }
  }
  return false;
}

LivenessListener::LivenessListener(const std::string& address,
                                   std::shared_ptr<const std::atomic<int64_t>> collectives)
    : collectives_(std::move(collectives)) {
  sockaddr_storage addr{};
  socklen_t len = 0;
  TORCH_CHECK(to_sockaddr(address, 0, addr, len), "ampx::dist: '", address,
              "' is not a numeric address");
  fd_ = ::socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  TORCH_CHECK(fd_ >= 0, "ampx::dist: socket() failed: ", std::strerror(errno));
  if (::bind(fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0 || ::listen(fd_, SOMAXCONN) != 0 ||
      ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0 ||
      ::pipe2(wake_, O_CLOEXEC) != 0) {
    const int error = errno;
    ::close(fd_);
    TORCH_CHECK(false, "ampx::dist: cannot listen on ", address, ": ", std::strerror(error));
  }
  port_ = ntohs(addr.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&addr)->sin_port
                                          : reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  thread_ = std::thread([this] { serve(); });
}

LivenessListener::~LivenessListener() {
  if (thread_.joinable()) {
    const char byte = 0;
    (void)!::write(wake_[1], &byte, 1);
    thread_.join();
  }
  for (const int fd : {fd_, wake_[0], wake_[1]}) {
    if (fd >= 0) ::close(fd);
  }
}

void LivenessListener::serve() {
  pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
  while (true) {
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (c < 0) continue;  // the peer gave up in between
    const std::string line = "ampx-alive " + std::to_string(collectives_->load()) + "\n";
    (void)!::send(c, line.data(), line.size(), MSG_NOSIGNAL);  // a few bytes: never blocks
    ::close(c);
  }
}

std::vector<ProbeResult> probe(const std::vector<std::pair<std::string, int>>& peers,
                               std::chrono::milliseconds budget) {
  std::vector<ProbeResult> result(peers.size());
  struct Pending {
    size_t peer;
    bool connected;
    std::string reply;
  };
  std::vector<pollfd> fds;
  std::vector<Pending> pending;
  for (size_t i = 0; i < peers.size(); ++i) {
    sockaddr_storage addr{};
    socklen_t len = 0;
    if (!to_sockaddr(peers[i].first, peers[i].second, addr, len)) continue;
    const int fd = ::socket(addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    const bool connected = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), len) == 0;
    if (!connected && errno != EINPROGRESS) {
      result[i].state = errno == ECONNREFUSED ? PeerState::kRefused : PeerState::kNoAnswer;
      ::close(fd);
      continue;
    }
    fds.push_back({fd, static_cast<short>(connected ? POLLIN : POLLOUT), 0});
    pending.push_back({i, connected, ""});
  }
  const auto deadline = std::chrono::steady_clock::now() + budget;
  auto finish = [&](size_t k, PeerState state) {
    result[pending[k].peer].state = state;
    ::close(fds[k].fd);
    fds[k].fd = -1;  // poll() skips negative descriptors
  };
  size_t open = fds.size();
  while (open > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    const int n = ::poll(fds.data(), fds.size(), static_cast<int>(left.count()));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    for (size_t k = 0; k < fds.size(); ++k) {
      if (fds[k].fd < 0 || fds[k].revents == 0) continue;
      auto& p = pending[k];
      if (!p.connected) {
        int error = 0;
        socklen_t len = sizeof(error);
        ::getsockopt(fds[k].fd, SOL_SOCKET, SO_ERROR, &error, &len);
        if (error != 0) {
          finish(k, error == ECONNREFUSED ? PeerState::kRefused : PeerState::kNoAnswer);
          --open;
          continue;
        }
        p.connected = true;  // the kernel answered; now the process must
        fds[k].events = POLLIN;
        fds[k].revents = 0;
        continue;
      }
      char buf[64];
      const ssize_t got = ::recv(fds[k].fd, buf, sizeof(buf), 0);
      if (got < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      if (got > 0) p.reply.append(buf, static_cast<size_t>(got));
      const bool line = p.reply.find('\n') != std::string::npos;
      if (!line && got > 0 && p.reply.size() < 256) continue;
      // A whole line, or the peer closed (an ending process's listener).
      if (p.reply.rfind("ampx-alive ", 0) == 0) {
        result[p.peer].collectives = std::atoll(p.reply.c_str() + 11);
        finish(k, PeerState::kAnswers);
      } else {
        finish(k, PeerState::kRefused);
      }
      --open;
    }
  }
  for (size_t k = 0; k < fds.size(); ++k) {
    if (fds[k].fd < 0) continue;
    finish(k, pending[k].connected ? PeerState::kNoReply : PeerState::kNoAnswer);
  }
  return result;
}

}  // namespace net
}  // namespace dist
}  // namespace ampx
