#pragma once

// Simulated hosts for the multi-host tests: one Linux network namespace per
// host, each with its own address on "eth0", all plugged into a bridge that
// lives in a namespace of its own (the "switch"). Nothing is added to the
// machine's own network namespace, and no route leads off the machine: the
// addresses exist only inside the namespaces made here, which are deleted
// with everything in them (and the processes started in them killed) when
// the object goes, also when a test fails. Namespaces left by a run that
// crashed are removed by the next one.
//
//   SimulatedHosts hosts(2);                      // 10.77.0.1 and 10.77.0.2
//   pid_t p = hosts.start(0, {"RANK=0", ...}, {binary, args...}, log, cwd);
//   hosts.cut(1);                                 // host 1's cable out of the switch
//
// Needs root, the `ip` tool (iproute2) and nsenter (util-linux);
// unavailable_reason() says why not.

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace ampx::train::test {

class SimulatedHosts {
 public:
  /// Why hosts cannot be simulated here ("" when they can).
  static std::string unavailable_reason() {
    if (::geteuid() != 0) return "needs root to make network namespaces (ip netns)";
    if (std::system("ip -V >/dev/null 2>&1") != 0) return "no `ip` tool (iproute2)";
    if (std::system("nsenter --version >/dev/null 2>&1") != 0) return "no nsenter (util-linux)";
    const std::string probe = "ampxnetprobe" + std::to_string(::getpid());
    if (std::system(("ip netns add " + probe + " >/dev/null 2>&1").c_str()) != 0) {
      return "this system cannot make network namespaces (ip netns add failed)";
    }
    std::system(("ip netns del " + probe + " >/dev/null 2>&1").c_str());
    return "";
  }

  explicit SimulatedHosts(int hosts) : prefix_("ampxnet" + std::to_string(::getpid()) + "x") {
    remove_stale();
    try {
      sh("ip netns add " + switch_ns());
      ip_in(switch_ns(), "link add br0 type bridge");
      ip_in(switch_ns(), "link set br0 up");
      for (int h = 0; h < hosts; ++h) add_host();
    } catch (...) {
      remove();
      throw;
    }
  }
  ~SimulatedHosts() { remove(); }
  SimulatedHosts(const SimulatedHosts&) = delete;
  SimulatedHosts& operator=(const SimulatedHosts&) = delete;

  int size() const { return hosts_; }
  std::string address(int host) const { return "10.77.0." + std::to_string(host + 1); }
  std::string ns(int host) const { return prefix_ + "h" + std::to_string(host); }

  /// Host `host`'s /etc/hosts, as its processes see it.
  void set_hosts_file(int host, const std::string& content) {
    const auto path = std::filesystem::temp_directory_path() / (ns(host) + ".hosts");
    std::ofstream(path) << content;
    hosts_files_.resize(static_cast<size_t>(hosts_));
    hosts_files_[static_cast<size_t>(host)] = path.string();
  }

  /// Starts `argv` on host `host` with `env` added to this process's
  /// environment (`NAME=` alone removes NAME), in `cwd`, stdout and stderr
  /// to `log`. The process is killed when this object goes, at the latest.
  pid_t start(int host, const std::vector<std::string>& env, const std::vector<std::string>& argv,
              const std::filesystem::path& log, const std::filesystem::path& cwd) {
    const std::string netns = "/run/netns/" + ns(host);
    const std::string hosts_file = static_cast<size_t>(host) < hosts_files_.size()
                                       ? hosts_files_[static_cast<size_t>(host)]
                                       : std::string();
    std::filesystem::create_directories(cwd);
    const pid_t pid = ::fork();
    TORCH_CHECK(pid >= 0, "fork failed");
    if (pid == 0) {
      const int fd = ::open(netns.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0 || ::setns(fd, CLONE_NEWNET) != 0) ::_exit(125);
      if (!hosts_file.empty()) {
        // What `ip netns exec` does with /etc/netns/<ns>/hosts: a private
        // mount namespace in which the host's own file covers /etc/hosts.
        if (::unshare(CLONE_NEWNS) != 0) ::_exit(124);
        ::mount(nullptr, "/", nullptr, MS_REC | MS_SLAVE, nullptr);  // fails where / is no mount
        if (::mount(hosts_file.c_str(), "/etc/hosts", nullptr, MS_BIND, nullptr) != 0) ::_exit(123);
      }
      for (const auto& e : env) {
        const auto eq = e.find('=');
        if (eq == e.size() - 1) {
          ::unsetenv(e.substr(0, eq).c_str());
        } else {
          ::setenv(e.substr(0, eq).c_str(), e.substr(eq + 1).c_str(), 1);
        }
      }
      if (::chdir(cwd.c_str()) != 0) ::_exit(122);
      const int out = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (out < 0) ::_exit(121);
      ::dup2(out, 1);
      ::dup2(out, 2);
      const int in = ::open("/dev/null", O_RDONLY);
      ::dup2(in, 0);
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      ::_exit(127);
    }
    pids_.push_back(pid);
    return pid;
  }

  /// Waits for `pid` until `deadline`; its exit code, 128 + signal, or
  /// nullopt when it is still running then.
  std::optional<int> wait(pid_t pid, std::chrono::steady_clock::time_point deadline) {
    for (;;) {
      int status = 0;
      const pid_t r = ::waitpid(pid, &status, WNOHANG);
      if (r == pid) {
        forget(pid);
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      if (r < 0) return -1;
      if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  /// SIGKILL to every one of `pids` at once, then reaps them.
  void kill(const std::vector<pid_t>& pids) {
    for (const pid_t pid : pids) ::kill(pid, SIGKILL);
    for (const pid_t pid : pids) {
      int status = 0;
      ::waitpid(pid, &status, 0);
      forget(pid);
    }
  }
  void kill(pid_t pid) { kill(std::vector<pid_t>{pid}); }

  /// Pulls host `host`'s cable out of the switch: its link goes down, and
  /// nothing it sends arrives anywhere (and nothing reaches it).
  void cut(int host) { ip_in(switch_ns(), "link set p" + std::to_string(host) + " down"); }

 private:
  std::string switch_ns() const { return prefix_ + "s"; }

  /// `ip <args>` inside namespace `ns`. Not `ip -n`, which remounts / as
  /// `ip netns exec` does, and cannot in a chroot (the 2.6 leg's): nsenter
  /// enters the network namespace alone.
  static void ip_in(const std::string& ns, const std::string& args) {
    sh("nsenter --net=/run/netns/" + ns + " ip " + args);
  }

  static void sh(const std::string& cmd) {
    const int rc = std::system((cmd + " 2>&1").c_str());
    TORCH_CHECK(rc == 0, "simulated hosts: `", cmd, "` failed (status ", rc, ")");
  }

  void add_host() {
    const int h = hosts_++;
    const std::string host = ns(h), port = "p" + std::to_string(h);
    sh("ip netns add " + host);
    // The veth pair is made inside the two namespaces: the machine's own
    // namespace never holds either end.
    ip_in(host, "link add eth0 type veth peer name " + port + " netns " + switch_ns());
    ip_in(host, "addr add " + address(h) + "/24 dev eth0");
    ip_in(host, "link set eth0 up");
    ip_in(host, "link set lo up");
    ip_in(switch_ns(), "link set " + port + " master br0");
    ip_in(switch_ns(), "link set " + port + " up");
  }

  void forget(pid_t pid) {
    for (auto it = pids_.begin(); it != pids_.end(); ++it) {
      if (*it == pid) {
        pids_.erase(it);
        return;
      }
    }
  }

  void remove() {
    kill(std::vector<pid_t>(pids_));
    for (int h = 0; h < hosts_; ++h) {
      std::system(("ip netns del " + ns(h) + " >/dev/null 2>&1").c_str());
    }
    std::system(("ip netns del " + switch_ns() + " >/dev/null 2>&1").c_str());
    for (const auto& f : hosts_files_) {
      std::error_code ec;
      if (!f.empty()) std::filesystem::remove(f, ec);
    }
  }

  /// Namespaces of this naming whose process is gone (a crashed run).
  static void remove_stale() {
    FILE* list = ::popen("ip netns list 2>/dev/null", "r");
    if (list == nullptr) return;
    char line[256];
    std::vector<std::string> stale;
    while (std::fgets(line, sizeof(line), list) != nullptr) {
      std::istringstream in(line);
      std::string name;
      in >> name;
      if (name.rfind("ampxnet", 0) != 0) continue;
      const long pid = std::atol(name.c_str() + 7);
      if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
        stale.push_back(name);
      }
    }
    ::pclose(list);
    for (const auto& name : stale) {
      std::system(("ip netns pids " + name + " 2>/dev/null | xargs -r kill -9").c_str());
      std::system(("ip netns del " + name + " >/dev/null 2>&1").c_str());
      std::error_code ec;
      std::filesystem::remove(std::filesystem::temp_directory_path() / (name + ".hosts"), ec);
    }
  }

  std::string prefix_;
  int hosts_ = 0;
  std::vector<pid_t> pids_;
  std::vector<std::string> hosts_files_;
};

}  // namespace ampx::train::test
