// A seeded mutation fuzzer for ampx's readers of outside bytes (targets.h),
// for machines without libFuzzer in the build: random byte, bit, length-field
// (little- and big-endian "interesting" integers), truncation, insertion and
// splice mutations of a seed corpus, with a time limit per input and a cap on
// the process's memory, so that a hang or an unbounded allocation is a
// finding like a crash. Each mutated input runs in a child process of its
// own; the input that failed is written to a file.
//
//   ampx_fuzz run checkpoint tests/fuzz/corpus/checkpoint 60 [seed]  # 60 s
//   ampx_fuzz replay checkpoint tests/fuzz/corpus/checkpoint tests/fuzz/regressions/checkpoint
//   ampx_fuzz accept checkpoint tests/fuzz/corpus/checkpoint  # the seeds are valid
//   ampx_fuzz list  # each target and its folder of corpus/, a line each
//
// Exit status: 0 nothing found, 1 a finding (its input saved as
// fuzz-finding-<target>-<n>.bin in the working folder), 2 usage.

#include "targets.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <new>
#include <random>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using ampx::fuzz::NamedTarget;
using Bytes = std::vector<uint8_t>;

namespace {

constexpr unsigned kSecondsPerInput = 20;         // a hang past this is a finding
constexpr rlim_t kMemoryLimit = rlim_t{6} << 30;  // address space: LibTorch reserves a lot

// AddressSanitizer's and ThreadSanitizer's shadow memory alone reserves
// terabytes of address space, so there the cap is on each allocation instead:
// under ASan (make sanitize) one past kMemoryLimit throws std::bad_alloc, a
// finding as it is past the address-space cap (ASAN_OPTIONS can override).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kCapAddressSpace = false;
#else
constexpr bool kCapAddressSpace = true;
#endif

// The input under test, for the signal handlers.
const uint8_t* current_data = nullptr;
size_t current_size = 0;
char finding_path[256] = "fuzz-finding.bin";

void save_current() {
  const int fd = ::open(finding_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return;
  size_t done = 0;
  while (done < current_size) {
    const ssize_t n = ::write(fd, current_data + done, current_size - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  ::close(fd);
}

void on_fatal(int signal) {
  save_current();
  const char* what = signal == SIGALRM ? "fuzz: the input ran past its time limit (a hang); "
                                         "saved as "
                                       : "fuzz: the target crashed; input saved as ";
  (void)!::write(2, what, std::strlen(what));
  (void)!::write(2, finding_path, std::strlen(finding_path));
  (void)!::write(2, "\n", 1);
  ::signal(signal == SIGALRM ? SIGABRT : signal, SIG_DFL);
  ::raise(signal == SIGALRM ? SIGABRT : signal);
}

void install(const std::string& target) {
  std::snprintf(finding_path, sizeof(finding_path), "fuzz-finding-%s-%d.bin", target.c_str(),
                static_cast<int>(::getpid()));
  for (const int s : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGALRM}) ::signal(s, on_fatal);
  if (kCapAddressSpace) {
    const rlimit limit{kMemoryLimit, kMemoryLimit};
    ::setrlimit(RLIMIT_AS, &limit);
  }
}

/// Runs one input; false (after saving it) when it is a finding that did
/// not already end the process: an allocation past the limit. `refused`,
/// when given, gets the error of an input the target refused ("" if none).
bool run_one(const NamedTarget& target, const Bytes& input, std::string* refused = nullptr) {
  current_data = input.data();
  current_size = input.size();
  ::alarm(kSecondsPerInput);
  bool ok = true;
  try {
    target.run(input.data(), input.size());
  } catch (const std::bad_alloc&) {
    save_current();
    std::fprintf(stderr, "fuzz: %s tried to allocate past %llu GiB; input saved as %s\n",
                 target.name, static_cast<unsigned long long>(kMemoryLimit >> 30), finding_path);
    ok = false;
  } catch (const std::exception& e) {
    // Refused with an error: what a reader should do with bad bytes.
    if (refused) *refused = e.what();
  }
  ::alarm(0);
  return ok;
}

/// run_one in a child process of its own, as ampx's readers run (one file
/// per process): LibTorch keeps state between loads (TorchScript's type
/// registry), and a finding must replay from its input alone.
bool run_isolated(const NamedTarget& target, const Bytes& input) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(run_one(target, input) ? 0 : 1);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return true;
  current_data = input.data();
  current_size = input.size();
  save_current();  // (the child saved it too, unless it died before)
  std::fprintf(stderr, "fuzz: %s: finding (%s %d); input saved as %s\n", target.name,
               WIFSIGNALED(status) ? "signal" : "exit status",
               WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status), finding_path);
  return false;
}

Bytes read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::vector<Bytes> read_inputs(const std::vector<std::string>& paths) {
  std::vector<Bytes> out;
  for (const auto& p : paths) {
    if (fs::is_directory(p)) {
      std::vector<fs::path> files;
      for (const auto& e : fs::directory_iterator(p)) {
        if (e.is_regular_file()) files.push_back(e.path());
      }
      std::sort(files.begin(), files.end());
      for (const auto& f : files) out.push_back(read_file(f));
    } else if (fs::is_regular_file(p)) {
      out.push_back(read_file(p));
    }
  }
  return out;
}

/// One to four random mutations of `in`.
Bytes mutate(Bytes in, std::mt19937_64& rng, const std::vector<Bytes>& corpus) {
  static const uint64_t kInteresting[] = {
      0,          1,          2,          0x7f,       0x80,       0xff,       0x7fff,     0xffff,
      0x7fffffff, 0x80000000, 0xffffffff, 1ull << 32, 1ull << 40, 1ull << 62, ~0ull >> 1, ~0ull};
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % std::max<size_t>(n, 1)); };
  const int rounds = 1 + static_cast<int>(rng() % 4);
  for (int r = 0; r < rounds; ++r) {
    switch (rng() % 8) {
      case 0:  // flip a bit
        if (!in.empty()) in[pick(in.size())] ^= static_cast<uint8_t>(1u << (rng() % 8));
        break;
      case 1:  // a random byte
        if (!in.empty()) in[pick(in.size())] = static_cast<uint8_t>(rng());
        break;
      case 2:
      case 3: {  // an interesting 1/2/4/8-byte integer, either byte order
        const size_t width = size_t{1} << (rng() % 4);
        if (in.size() < width) break;
        uint64_t v = kInteresting[pick(std::size(kInteresting))];
        if (rng() % 4 == 0) v += in.size() - rng() % 3;  // near the file's length
        const size_t at = pick(in.size() - width + 1);
        const bool big = rng() % 2;
        for (size_t i = 0; i < width; ++i) {
          in[at + (big ? width - 1 - i : i)] = static_cast<uint8_t>(v >> (8 * i));
        }
        break;
      }
      case 4:  // truncate
        in.resize(pick(in.size() + 1));
        break;
      case 5: {  // insert random bytes
        const size_t at = pick(in.size() + 1);
        Bytes extra(1 + pick(16));
        for (auto& b : extra) b = static_cast<uint8_t>(rng());
        in.insert(in.begin() + static_cast<std::ptrdiff_t>(at), extra.begin(), extra.end());
        break;
      }
      case 6: {  // erase a run
        if (in.empty()) break;
        const size_t at = pick(in.size());
        const size_t n = 1 + pick(std::min<size_t>(64, in.size() - at));
        in.erase(in.begin() + static_cast<std::ptrdiff_t>(at),
                 in.begin() + static_cast<std::ptrdiff_t>(at + n));
        break;
      }
      default: {  // splice with another corpus input
        const Bytes& other = corpus[pick(corpus.size())];
        if (other.empty()) break;
        const size_t from = pick(other.size());
        const size_t at = pick(in.size() + 1);
        in.resize(at);
        in.insert(in.end(), other.begin() + static_cast<std::ptrdiff_t>(from), other.end());
        break;
      }
    }
  }
  return in;
}

const NamedTarget* find_target(const std::string& name) {
  for (const auto& t : ampx::fuzz::targets()) {
    if (name == t.name) return &t;
  }
  return nullptr;
}

int usage() {
  std::fprintf(stderr,
               "usage: ampx_fuzz run TARGET CORPUS_DIR SECONDS [SEED]\n"
               "       ampx_fuzz replay TARGET FILE_OR_DIR...  (no finding)\n"
               "       ampx_fuzz accept TARGET FILE_OR_DIR...  (each read without error)\n"
               "       ampx_fuzz seeds DIR   (a valid input per target, from ampx's writers)\n"
               "       ampx_fuzz list        (each target and its folder of corpus/)\n"
               "targets:\n");
  for (const auto& t : ampx::fuzz::targets()) std::fprintf(stderr, "  %-11s %s\n", t.name, t.what);
  return 2;
}

}  // namespace

#if defined(__SANITIZE_ADDRESS__)
// Read by AddressSanitizer at start, before ASAN_OPTIONS: kMemoryLimit per allocation.
static_assert(kMemoryLimit == rlim_t{6144} << 20, "max_allocation_size_mb below is kMemoryLimit");
extern "C" const char* __asan_default_options() {
  return "max_allocation_size_mb=6144:allocator_may_return_null=1";
}
#endif

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "seeds") {  // how the corpora were made
    ampx::fuzz::write_seeds(argv[2]);
    fs::remove_all(fs::path(ampx::fuzz::scratch_file("")).parent_path());
    return 0;
  }
  if (argc == 2 && std::string(argv[1]) == "list") {  // for ctest's tests and make fuzz
    for (const auto& t : ampx::fuzz::targets()) std::printf("%s %s\n", t.name, t.corpus());
    return 0;
  }
  if (argc < 4) return usage();
  const std::string mode = argv[1];
  const NamedTarget* target = find_target(argv[2]);
  if (target == nullptr || (mode != "run" && mode != "replay" && mode != "accept")) return usage();
  install(target->name);
  const auto scratch = fs::path(ampx::fuzz::scratch_file("")).parent_path();
  struct Cleanup {
    fs::path dir;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  } cleanup{scratch};

  if (mode == "accept") {  // every input must be read without error: the seeds
    const auto inputs = read_inputs(std::vector<std::string>(argv + 3, argv + argc));
    for (const auto& input : inputs) {
      std::string refused;
      if (!run_one(*target, input, &refused)) return 1;
      if (!refused.empty()) {
        std::fprintf(stderr, "%s refused a valid input: %s\n", target->name, refused.c_str());
        return 1;
      }
    }
    std::printf("%s: %zu valid inputs accepted\n", target->name, inputs.size());
    return inputs.empty() ? 2 : 0;
  }
  if (mode == "replay") {
    const auto inputs = read_inputs(std::vector<std::string>(argv + 3, argv + argc));
    if (inputs.empty()) {
      std::fprintf(stderr, "fuzz: no inputs in the paths given\n");
      return 2;
    }
    for (const auto& input : inputs) {
      if (!run_one(*target, input)) return 1;
    }
    std::printf("%s: %zu inputs replayed, no finding\n", target->name, inputs.size());
    return 0;
  }

  const std::vector<Bytes> corpus = read_inputs({argv[3]});
  if (corpus.empty()) {
    std::fprintf(stderr, "fuzz: no seed inputs in %s\n", argv[3]);
    return 2;
  }
  const double seconds = std::atof(argv[4 < argc ? 4 : 3]);
  const uint64_t seed = argc > 5 ? std::strtoull(argv[5], nullptr, 10) : std::random_device()();
  std::mt19937_64 rng(seed);
  std::fprintf(stderr, "%s: seed %llu (pass it as SEED to replay this run)\n", target->name,
               static_cast<unsigned long long>(seed));
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  uint64_t runs = 0;
  for (const auto& input : corpus) {  // the seeds themselves first
    if (!run_one(*target, input)) return 1;
    ++runs;
  }
  while (std::chrono::steady_clock::now() < end) {
    if (!run_isolated(*target, mutate(corpus[rng() % corpus.size()], rng, corpus))) return 1;
    ++runs;
  }
  std::printf("%s: %llu inputs in %.0f s (seed %llu), no finding\n", target->name,
              static_cast<unsigned long long>(runs), seconds,
              static_cast<unsigned long long>(seed));
  return 0;
}
