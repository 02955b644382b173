// Data parallelism's set-up without workers: the launchers' variables
// (torchrun, Open MPI, Slurm), the rendezvous' errors, and which backend
// (Gloo, NCCL) carries CPU and CUDA tensors.

#include <ampx/ampx.h>
#include <ampx/dist.h>
#include <ampx/fsdp.h>
#include <ampx/zero.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

using ::testing::HasSubstr;

// A rank whose rank 0 never comes: the error says that nothing listens on
// MASTER_PORT (found by connecting once more after the store's timeout).
TEST(DistRendezvousTest, ARankWithoutRankZeroFailsSayingNothingListensThere) {
  if (!ampx::dist::is_available()) GTEST_SKIP() << "ampx built without c10d/Gloo";
  ampx::dist::LaunchEnv env;
  env.rank = 1;
  env.world_size = 2;
  env.master_addr = "127.0.0.1";
  env.master_port = ampx::dist::free_loopback_port();
  const std::string where = "127.0.0.1:" + std::to_string(env.master_port);
  const auto start = std::chrono::steady_clock::now();
  std::string error;
  try {
    ampx::dist::init_process_group(env, ampx::dist::InitOptions().timeout(std::chrono::seconds(2)));
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_THAT(error, HasSubstr("ampx::dist: rank 1 could not reach the rendezvous at " + where));
  EXPECT_THAT(error, HasSubstr("; nothing listens on " + where +
                               " (connection refused): rank 0 has not started, has failed, or "
                               "was given another MASTER_ADDR or MASTER_PORT"));
  EXPECT_LT(seconds, 20.0);
}

TEST(DistEnvTest, ReadsTorchrunOpenMpiAndSlurmVariablesAndNamesWhatIsMissing) {
  const char* vars[] = {"RANK",
                        "WORLD_SIZE",
                        "LOCAL_RANK",
                        "MASTER_ADDR",
                        "MASTER_PORT",
                        "OMPI_COMM_WORLD_RANK",
                        "OMPI_COMM_WORLD_SIZE",
                        "OMPI_COMM_WORLD_LOCAL_RANK",
                        "SLURM_PROCID",
                        "SLURM_NTASKS",
                        "SLURM_LOCALID",
                        "TORCHELASTIC_USE_AGENT_STORE",
                        "TORCHELASTIC_RESTART_COUNT"};
  std::vector<std::pair<std::string, std::string>> saved;
  for (const char* v : vars) {
    if (const char* x = std::getenv(v)) saved.emplace_back(v, x);
    ::unsetenv(v);
  }
  auto error = [] {
    try {
      ampx::dist::launch_env_from_environment();
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string();
  };
  EXPECT_THAT(error(), HasSubstr("no launcher environment"));
  EXPECT_FALSE(ampx::dist::launched_as_rank());
  // A partial torchrun environment is a launch, reported, never a lone run.
  ::setenv("RANK", "1", 1);
  EXPECT_TRUE(ampx::dist::launched_as_rank());
  EXPECT_THAT(error(), HasSubstr("incomplete torchrun environment: missing WORLD_SIZE"));
  ::setenv("WORLD_SIZE", "2", 1);
  EXPECT_THAT(error(),
              HasSubstr("incomplete torchrun environment: missing MASTER_ADDR, MASTER_PORT"));
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", "29x", 1);
  EXPECT_THAT(error(), HasSubstr("malformed MASTER_PORT='29x'"));
  ::setenv("MASTER_PORT", "29500", 1);
  auto e = ampx::dist::launch_env_from_environment();
  EXPECT_EQ(e.launcher, "torchrun");
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.world_size, 2);
  EXPECT_FALSE(e.agent_store);
  // torchrun's agent serves the store itself; a restarted group has its prefix.
  ::setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
  ::setenv("TORCHELASTIC_RESTART_COUNT", "2", 1);
  e = ampx::dist::launch_env_from_environment();
  EXPECT_TRUE(e.agent_store);
  EXPECT_EQ(e.restart_count, 2);
  ::setenv("TORCHELASTIC_RESTART_COUNT", "x", 1);
  EXPECT_THAT(error(), HasSubstr("malformed TORCHELASTIC_RESTART_COUNT='x'"));
  ::unsetenv("TORCHELASTIC_USE_AGENT_STORE");
  ::unsetenv("TORCHELASTIC_RESTART_COUNT");
  ::setenv("RANK", "2", 1);
  EXPECT_THAT(error(), HasSubstr("rank 2 is not below the world size 2"));
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
  EXPECT_FALSE(ampx::dist::launched_as_rank());
  ::setenv("OMPI_COMM_WORLD_RANK", "0", 1);
  ::setenv("OMPI_COMM_WORLD_SIZE", "1", 1);
  EXPECT_FALSE(ampx::dist::launched_as_rank()) << "mpirun -n 1: one process, no group";
  ::setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
  EXPECT_TRUE(ampx::dist::launched_as_rank());
  EXPECT_EQ(ampx::dist::launch_env_from_environment().launcher, "Open MPI");
  ::unsetenv("OMPI_COMM_WORLD_RANK");
  ::unsetenv("OMPI_COMM_WORLD_SIZE");
  ::setenv("SLURM_PROCID", "0", 1);
  ::setenv("SLURM_NTASKS", "1", 1);
  EXPECT_FALSE(ampx::dist::launched_as_rank()) << "a batch job's lone task";
  ::setenv("SLURM_PROCID", "3", 1);
  ::setenv("SLURM_NTASKS", "4", 1);
  EXPECT_TRUE(ampx::dist::launched_as_rank());
  e = ampx::dist::launch_env_from_environment();
  EXPECT_EQ(e.launcher, "Slurm");
  EXPECT_EQ(e.rank, 3);
  for (const char* v : vars) ::unsetenv(v);
  for (const auto& [k, v] : saved) ::setenv(k.c_str(), v.c_str(), 1);
}

TEST(DistEnvTest, ReadsEachLaunchersLocalWorldSizeAndNodeRank) {
  const char* vars[] = {"RANK",
                        "WORLD_SIZE",
                        "LOCAL_RANK",
                        "LOCAL_WORLD_SIZE",
                        "GROUP_RANK",
                        "NODE_RANK",
                        "MASTER_ADDR",
                        "MASTER_PORT",
                        "OMPI_COMM_WORLD_RANK",
                        "OMPI_COMM_WORLD_SIZE",
                        "OMPI_COMM_WORLD_LOCAL_SIZE",
                        "SLURM_PROCID",
                        "SLURM_NTASKS",
                        "SLURM_LOCALID",
                        "SLURM_NODEID",
                        "SLURM_TASKS_PER_NODE",
                        "SLURM_STEP_TASKS_PER_NODE"};
  std::vector<std::pair<std::string, std::string>> saved;
  for (const char* v : vars) {
    if (const char* x = std::getenv(v)) saved.emplace_back(v, x);
    ::unsetenv(v);
  }
  ::setenv("MASTER_ADDR", "10.0.0.1", 1);
  ::setenv("MASTER_PORT", "29500", 1);
  // torchrun: its own variables; a launch without them is one process per host.
  ::setenv("RANK", "5", 1);
  ::setenv("WORLD_SIZE", "8", 1);
  auto e = ampx::dist::launch_env_from_environment();
  EXPECT_EQ(e.local_world_size, 1);
  EXPECT_EQ(e.node_rank, -1);
  ::setenv("LOCAL_WORLD_SIZE", "4", 1);
  ::setenv("NODE_RANK", "3", 1);
  EXPECT_EQ(ampx::dist::launch_env_from_environment().node_rank, 3);
  ::setenv("GROUP_RANK", "1", 1);  // torchrun's own name wins
  e = ampx::dist::launch_env_from_environment();
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.node_rank, 1);
  for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK"}) {
    ::unsetenv(v);
  }
  // Open MPI
  ::setenv("OMPI_COMM_WORLD_RANK", "2", 1);
  ::setenv("OMPI_COMM_WORLD_SIZE", "6", 1);
  ::setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "3", 1);
  EXPECT_EQ(ampx::dist::launch_env_from_environment().local_world_size, 3);
  ::unsetenv("OMPI_COMM_WORLD_RANK");
  // Slurm: tasks per node in srun's compressed form, at this node's index;
  // the step's count wins over the job's.
  ::setenv("SLURM_PROCID", "5", 1);
  ::setenv("SLURM_NTASKS", "7", 1);
  ::setenv("SLURM_NODEID", "2", 1);
  ::setenv("SLURM_TASKS_PER_NODE", "2(x2),3", 1);
  e = ampx::dist::launch_env_from_environment();
  EXPECT_EQ(e.node_rank, 2);
  EXPECT_EQ(e.local_world_size, 3);
  ::setenv("SLURM_NODEID", "1", 1);
  EXPECT_EQ(ampx::dist::launch_env_from_environment().local_world_size, 2);
  ::setenv("SLURM_STEP_TASKS_PER_NODE", "1,4", 1);
  EXPECT_EQ(ampx::dist::launch_env_from_environment().local_world_size, 4);
  ::setenv("SLURM_STEP_TASKS_PER_NODE", "2(3)", 1);
  std::string error;
  try {
    ampx::dist::launch_env_from_environment();
  } catch (const c10::Error& err) {
    error = err.what_without_backtrace();
  }
  EXPECT_THAT(error, HasSubstr("malformed SLURM_STEP_TASKS_PER_NODE='2(3)' at SLURM_NODEID=1"));
  for (const char* v : vars) ::unsetenv(v);
  for (const auto& [k, v] : saved) ::setenv(k.c_str(), v.c_str(), 1);
}

// A group of one, in this process: what the backends carry.
ampx::dist::ProcessGroup group_of_one(bool nccl = true) {
  ampx::dist::LaunchEnv env;
  env.master_addr = "127.0.0.1";
  env.master_port = ampx::dist::free_loopback_port();
  return ampx::dist::init_process_group(
      env, ampx::dist::InitOptions().timeout(std::chrono::seconds(60)).nccl(nccl));
}

// Gloo writes to a lost peer's socket with writev(2): with SIGPIPE at its
// default the rank died of the signal, silently, instead of failing the
// collective (DistTest.AKilledRankMakesTheOthersFailWithinTheTimeout, once
// in ctest -j2: status "killed", an empty log). init_process_group ignores
// it, as Python does, and keeps a handler the program set.
void count_sigpipe(int) {
  static volatile sig_atomic_t seen = 0;
  seen = seen + 1;
}

TEST(DistBackendTest, IgnoresSigpipeLeftAtTheDefaultAndKeepsAProgramsHandler) {
  if (!ampx::dist::is_available()) GTEST_SKIP() << "ampx built without c10d/Gloo";
  struct sigaction saved {};
  ASSERT_EQ(::sigaction(SIGPIPE, nullptr, &saved), 0);
  const auto set = [](void (*handler)(int)) {
    struct sigaction a {};
    a.sa_handler = handler;
    sigemptyset(&a.sa_mask);
    ASSERT_EQ(::sigaction(SIGPIPE, &a, nullptr), 0);
  };
  const auto handler_now = [] {
    struct sigaction a {};
    ::sigaction(SIGPIPE, nullptr, &a);
    return a.sa_handler;
  };
  set(SIG_DFL);
  (void)group_of_one(/*nccl=*/false);
  EXPECT_EQ(handler_now(), SIG_IGN);
  // A write to a socket whose peer has closed is then EPIPE, not the end of this process.
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  ::close(fds[1]);
  const char byte = 0;
  EXPECT_EQ(::write(fds[0], &byte, 1), -1);
  EXPECT_EQ(errno, EPIPE);
  ::close(fds[0]);
  set(&count_sigpipe);
  (void)group_of_one(/*nccl=*/false);
  EXPECT_EQ(handler_now(), &count_sigpipe);
  ASSERT_EQ(::sigaction(SIGPIPE, &saved, nullptr), 0);
}

TEST(DistBackendTest, CpuTensorsGoThroughGlooAndNcclOnlyWhereBuiltAndAsked) {
  if (!ampx::dist::is_available()) GTEST_SKIP() << "ampx built without c10d/Gloo";
  auto pg = group_of_one();
  const bool nccl = ampx::dist::is_nccl_available() && torch::cuda::is_available();
  EXPECT_EQ(pg.has_nccl(), nccl);
  EXPECT_EQ(pg.backends(), nccl ? "gloo+nccl" : "gloo");
  EXPECT_FALSE(group_of_one(/*nccl=*/false).has_nccl());
  auto t = torch::arange(6, torch::kFloat);
  pg.all_reduce_sum(t);
  EXPECT_TRUE(torch::equal(t, torch::arange(6, torch::kFloat)));
  auto out = torch::empty({6}, torch::kBFloat16);
  pg.all_gather(out, torch::arange(6, torch::kBFloat16));
  EXPECT_TRUE(torch::equal(out, torch::arange(6, torch::kBFloat16)));
}

// Only on a CUDA build with NCCL and a GPU (the GPU machine's
// scripts/device-test.sh); skipped elsewhere.
TEST(DistBackendTest, CudaTensorsGoThroughNcclForCollectivesDdpAndZero) {
  if (!ampx::dist::is_nccl_available() || !torch::cuda::is_available()) {
    GTEST_SKIP() << "no NCCL in this build or no CUDA device";
  }
  auto pg = group_of_one();
  ASSERT_TRUE(pg.has_nccl());
  const auto cuda = torch::Device(torch::kCUDA, 0);
  auto t = torch::arange(8, torch::TensorOptions().dtype(torch::kFloat).device(cuda));
  pg.all_reduce_max(t);
  auto scattered = torch::empty({8}, t.options());
  pg.reduce_scatter_sum(scattered, t);
  auto gathered = torch::empty({8}, t.options().dtype(torch::kBFloat16));
  pg.all_gather(gathered, t.to(torch::kBFloat16));
  pg.broadcast(t, 0);
  EXPECT_TRUE(torch::equal(scattered.cpu(), torch::arange(8, torch::kFloat)));
  EXPECT_TRUE(torch::equal(gathered.cpu(), torch::arange(8, torch::kBFloat16)));

  // DDP over NCCL (one rank: the average is the gradient itself) and ZeRO on
  // CUDA parameters train as a plain ampx AdamW does.
  auto make = [&] {
    torch::manual_seed(3);
    auto m = torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Tanh(),
                                   torch::nn::Linear(16, 4));
    m->to(cuda);
    return m;
  };
  torch::manual_seed(4);
  const auto x = torch::randn({6, 8}).to(cuda), y = torch::randn({6, 4}).to(cuda);
  const auto options = ampx::optim::AdamWOptions(1e-2);
  auto plain = make(), ddp_model = make(), zero_model = make();
  ampx::optim::AdamW plain_opt(plain->parameters(), options);
  ampx::dist::DistributedDataParallel ddp(ddp_model.ptr(), pg);
  ampx::optim::AdamW ddp_opt(ddp_model->parameters(), options);
  ampx::dist::ZeroRedundancyOptimizer zero(
      zero_model->parameters(), pg, [&](std::vector<torch::Tensor> shard) {
        return std::make_unique<ampx::optim::AdamW>(std::move(shard), options);
      });
  ampx::GradScaler scaler(ampx::GradScalerOptions().init_scale(1024.0));
  ampx::dist::synchronize_found_inf(scaler, pg);  // a CUDA flag: reduced by NCCL
  for (int step = 0; step < 5; ++step) {
    for (auto* opt : {static_cast<torch::optim::Optimizer*>(&plain_opt),
                      static_cast<torch::optim::Optimizer*>(&ddp_opt),
                      static_cast<torch::optim::Optimizer*>(&zero)}) {
      opt->zero_grad();
    }
    torch::mse_loss(plain->forward(x), y).backward();
    torch::mse_loss(ddp_model->forward(x), y).backward();
    ddp.synchronize();
    if (step != 2) {  // the step ZeRO's scaler skips
      plain_opt.step();
      ddp_opt.step();
    }
    auto loss = torch::mse_loss(zero_model->forward(x), y);
    if (step == 2) loss = loss * INFINITY;
    scaler.scale(loss).backward();
    EXPECT_EQ(static_cast<bool>(scaler.step(zero)), step != 2) << "step " << step;
    scaler.update();
  }
  auto a = plain->parameters(), b = ddp_model->parameters(), c = zero_model->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::equal(a[i], b[i])) << "DDP parameter " << i;
    EXPECT_TRUE(b[i].is_cuda());
  }
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(c[i].is_cuda());
    EXPECT_LT((a[i] - c[i]).abs().max().item<float>(), 1e-6f) << "ZeRO parameter " << i;
  }
  EXPECT_FALSE(torch::equal(a[0], make()->parameters()[0]));  // it trained
  EXPECT_EQ(scaler.get_scale(), 512.0);
}

// Two blocks sharded as units, and a head in the root's space.
struct TwoBlocksImpl : torch::nn::Module {
  TwoBlocksImpl()
      : a(register_module("a", torch::nn::Linear(16, 32))),
        b(register_module("b", torch::nn::Linear(32, 32))),
        head(register_module("head", torch::nn::Linear(32, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::tanh(ampx::dist::sharded_forward(a, x));
    h = torch::tanh(ampx::dist::sharded_forward(b, h));
    return head->forward(h);
  }
  torch::nn::Linear a, b, head;
};
TORCH_MODULE(TwoBlocks);

// Only on a CUDA build with NCCL and a GPU, as above. A model sharded on
// CUDA gathers and reduces on side streams (FSDP2's): on one rank its
// training in float32 is a plain AdamW's, in ZeRO-3 (prefetching, or not)
// and ZeRO-2, the last step's gradients in .grad on the compute stream when
// backward returns, an evaluation with gradients between backward and the
// step (ZeRO-2 keeps the units gathered) changing nothing; in bfloat16
// (casts on the gather stream) the three train alike bit for bit.
TEST(DistBackendTest, FsdpOnCudaGathersAndReducesOnSideStreamsAsPlainTraining) {
  if (!ampx::dist::is_nccl_available() || !torch::cuda::is_available()) {
    GTEST_SKIP() << "no NCCL in this build or no CUDA device";
  }
  auto pg = group_of_one();
  ASSERT_TRUE(pg.has_nccl());
  const auto cuda = torch::Device(torch::kCUDA, 0);
  const auto make = [&] {
    torch::manual_seed(5);
    TwoBlocks m;
    m->to(cuda);
    return m;
  };
  torch::manual_seed(6);
  const auto x = torch::randn({64, 16}).to(cuda), y = torch::randn({64, 4}).to(cuda);
  const auto options = ampx::optim::AdamWOptions(1e-2);
  auto plain = make();
  ampx::optim::AdamW plain_opt(plain->parameters(), options);
  std::vector<double> plain_losses;
  for (int step = 0; step < 5; ++step) {
    plain_opt.zero_grad();
    auto loss = torch::mse_loss(plain->forward(x), y);
    loss.backward();
    plain_opt.step();
    plain_losses.push_back(loss.item<double>());
  }
  const std::vector<std::pair<bool, bool>> ways{{true, true}, {true, false}, {false, true}};
  std::vector<std::vector<double>> bf16_losses;
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    for (const auto& [zero3, prefetch] : ways) {
      SCOPED_TRACE(std::string(zero3 ? "ZeRO-3" : "ZeRO-2") + (prefetch ? "" : ", no prefetch") +
                   (dtype == torch::kFloat ? ", float32" : ", bfloat16"));
      auto model = make();
      ampx::dist::FullyShardedDataParallel fsdp(model.ptr(), pg, {model->a.ptr(), model->b.ptr()},
                                                ampx::dist::FullyShardedDataParallelOptions()
                                                    .param_dtype(dtype)
                                                    .reshard_after_forward(zero3)
                                                    .prefetch(prefetch));
      ampx::optim::AdamW opt(fsdp.parameters(), options);
      std::vector<double> losses;
      for (int step = 0; step < 5; ++step) {
        opt.zero_grad();
        ampx::AutocastGuard autocast(torch::kCUDA, torch::kBFloat16, dtype == torch::kBFloat16);
        auto loss = torch::mse_loss(ampx::dist::sharded_forward(model, x).to(torch::kFloat), y);
        loss.backward();
        (void)ampx::dist::sharded_forward(model, x);  // an evaluation with gradients
        opt.step();
        losses.push_back(loss.item<double>());
      }
      if (dtype == torch::kBFloat16) {
        bf16_losses.push_back(losses);
        EXPECT_EQ(losses, bf16_losses.front());
        EXPECT_LT(losses.back(), losses.front());
        continue;
      }
      for (int step = 0; step < 5; ++step) {
        EXPECT_NEAR(losses[step], plain_losses[step], 1e-5 * std::abs(plain_losses[step]))
            << "step " << step;
      }
      const auto plain_params = plain->named_parameters();
      for (const auto& item : fsdp.full_state_dict()) {
        const auto gap = (item.value().cpu() - plain_params[item.key()].cpu()).abs().max();
        EXPECT_LT(gap.item<float>(), 1e-5f) << item.key();
      }
    }
  }
}

}  // namespace
