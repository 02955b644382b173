// Nobody else in: what a single-machine run (--nproc) listens on. Its ranks
// meet in a file (no rendezvous port), Gloo and each rank's liveness
// listener bind to 127.0.0.1; the test reads every listening TCP socket of
// the launcher and its ranks from /proc and asserts each is on loopback.

#include "test_support.h"

#include <ampx/dist.h>

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <signal.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

#ifdef AMPX_TRAIN_BINARY

/// The socket inodes process `pid` holds open.
std::set<std::string> socket_inodes(pid_t pid) {
  std::set<std::string> out;
  std::error_code ec;
  for (const auto& fd : fs::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec)) {
    const std::string target = fs::read_symlink(fd.path(), ec).string();
    if (!ec && target.rfind("socket:[", 0) == 0) {
      out.insert(target.substr(8, target.size() - 9));
    }
  }
  return out;
}

/// /proc/net/tcp{,6}'s "0100007F:1F90" (IPv4, each 32-bit word in host order)
/// as "127.0.0.1:8080".
std::string address_of(const std::string& hex) {
  const auto colon = hex.find(':');
  const std::string ip = hex.substr(0, colon);
  const int port = std::stoi(hex.substr(colon + 1), nullptr, 16);
  unsigned char bytes[16] = {0};
  for (size_t word = 0; word < ip.size() / 8; ++word) {
    const uint32_t v = static_cast<uint32_t>(std::stoul(ip.substr(word * 8, 8), nullptr, 16));
    std::memcpy(bytes + word * 4, &v, 4);  // the kernel printed the word as a host integer
  }
  char text[INET6_ADDRSTRLEN] = {0};
  ::inet_ntop(ip.size() == 8 ? AF_INET : AF_INET6, bytes, text, sizeof(text));
  return (ip.size() == 8 ? std::string(text) : "[" + std::string(text) + "]") + ":" +
         std::to_string(port);
}

/// Every listening TCP socket of this network namespace: inode -> address.
std::map<std::string, std::string> listening_sockets() {
  std::map<std::string, std::string> out;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >>
          timeout >> inode;
      if (state == "0A") out[inode] = address_of(local);  // TCP_LISTEN
    }
  }
  return out;
}

bool on_loopback(const std::string& address) {
  return address.rfind("127.", 0) == 0 || address.rfind("[::1]:", 0) == 0 ||
         address.rfind("[::ffff:127.", 0) == 0;
}

class ListeningTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (!ampx::dist::is_available()) GTEST_SKIP() << "ampx built without c10d/Gloo";
    ampx::train::test::write_text_data(dir_.path() / "data", "abcdefgh ", 20000, 5);
  }
  ampx::train::test::TempDir dir_;
};

TEST_P(ListeningTest, NprocRunListensOnLoopbackOnly) {
  const int nproc = GetParam();
  const fs::path out = dir_.path() / "run", log = dir_.path() / "run.log";
  const pid_t pid = ampx::train::test::spawn_train(
      ampx::train::test::tiny_gpt({{"--precision", "O2"},
                                   {"--data-dir", (dir_.path() / "data").string()},
                                   {"--out-dir", out.string()},
                                   {"--batch-size", "6"},
                                   {"--steps", "1000000"},
                                   {"--nproc", std::to_string(nproc)}}),
      log);
  const ampx::train::test::KillGroupGuard guard(pid);
  // Training is under way: every rank has made its store, Gloo and listener.
  ASSERT_TRUE(ampx::train::test::wait_for_lines(pid, out / "metrics-O2.jsonl", 2))
      << ampx::train::test::wait_train(pid, log).output;
  const auto ranks = ampx::train::test::ranks_of(pid, nproc);
  const auto listening = listening_sockets();
  std::vector<std::pair<std::string, pid_t>> processes{{"the launcher", pid}};
  for (int r = 0; r < nproc; ++r) processes.emplace_back("rank " + std::to_string(r), ranks[r]);
  for (const auto& [who, p] : processes) {
    ASSERT_NE(p, 0) << who << " not found";
    std::string addresses;
    int count = 0;
    for (const auto& inode : socket_inodes(p)) {
      const auto it = listening.find(inode);
      if (it == listening.end()) continue;
      ++count;
      addresses += (addresses.empty() ? "" : ", ") + it->second;
      EXPECT_TRUE(on_loopback(it->second)) << who << " listens on " << it->second;
    }
    std::printf("[ measured ] %s listens on: %s\n", who.c_str(),
                addresses.empty() ? "nothing" : addresses.c_str());
    // Each rank: its liveness listener at least (Gloo's listening socket
    // may be closed once its connections are made).
    if (p != pid) {
      EXPECT_GE(count, 1) << who << " listens on nothing";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, ListeningTest, ::testing::Values(2, 3),
                         [](const auto& info) { return "nproc" + std::to_string(info.param); });

#endif  // AMPX_TRAIN_BINARY

}  // namespace
