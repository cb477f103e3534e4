// The trainscale-bench executable: exit codes, usage errors, a small run, compare and report.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace {

namespace fs = std::filesystem;

struct Outcome {
  int exit_code;
  std::string output;  // stdout and stderr
};

Outcome run_cli(const std::string& args) {
  const std::string command = std::string(TRAINSCALE_BENCH_CLI) + " " + args + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) return {-1, "popen failed"};
  std::string output;
  char buf[512];
  while (std::fgets(buf, sizeof buf, pipe)) output += buf;
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

fs::path temp_dir() {
  const fs::path dir = fs::temp_directory_path() / ("trainscale-bench-test-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return dir;
}

TEST(BenchCli, UsageErrorsExit2WithAMessage) {
  const std::pair<const char*, const char*> cases[] = {
      {"--suite nope", "unknown suite 'nope'"},
      {"--ops nope", "unknown op 'nope'"},
      {"--dtype fp7", "unknown dtype 'fp7'"},
      {"--impl nope", "unknown implementation 'nope'"},
      {"--configs 12xx4", "bad --configs entry '12xx4'"},
      {"--no-such-flag", "--no-such-flag"},
      {"compare /nonexistent/a.json /nonexistent/b.json", "no such file: /nonexistent/a.json"},
      {"report /nonexistent-dir", "no such directory"},
      {"compare", "required"},
  };
  for (const auto& [args, message] : cases) {
    const Outcome o = run_cli(args);
    EXPECT_EQ(o.exit_code, 2) << args << "\n" << o.output;
    EXPECT_NE(o.output.find(message), std::string::npos) << args << "\n" << o.output;
  }
}

// Opt-in implementations are known names (run only when named); unknown ones stay errors.
TEST(BenchCli, OptInImplementationsAreAcceptedByName) {
  const Outcome unknown = run_cli("--impl trainscale-nope");
  EXPECT_EQ(unknown.exit_code, 2) << unknown.output;
  EXPECT_NE(unknown.output.find("trainscale-rows"), std::string::npos) << unknown.output;  // in the known list
  const Outcome o = run_cli("--suite smoke --ops rmsnorm_forward --dtype fp32 --impl trainscale,trainscale-rows --list");
  EXPECT_EQ(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("rmsnorm_forward 64x512 float32"), std::string::npos) << o.output;
  // On the CPU the GPU-only opt-in has nothing to run: no rows, no failure.
  const Outcome run = run_cli("--suite smoke --ops rmsnorm_forward --dtype fp32 --impl cpu-ref,trainscale-two-pass "
                              "--device cpu --timeout-ms 50 --quiet");
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("rmsnorm_forward 64x512 float32 [cpu-ref]"), std::string::npos) << run.output;
  EXPECT_EQ(run.output.find("trainscale-two-pass"), std::string::npos) << run.output;
}

TEST(BenchCli, ListPrintsCasesWithoutRunning) {
  const Outcome o = run_cli("--suite smoke --ops mse_forward --dtype fp32 --list");
  EXPECT_EQ(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("mse_forward 64x256 float32"), std::string::npos) << o.output;
  EXPECT_EQ(o.output.find("bfloat16"), std::string::npos) << o.output;
}

TEST(BenchCli, ListShowsTheFlceSuiteWithItsWorkspace) {
  const Outcome o = run_cli("--suite flce --list");
  EXPECT_EQ(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("fused_linear_cross_entropy_forward 8192x4096x128256 bfloat16"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("fused_linear_cross_entropy_forward 32768x4096x256000 bfloat16"), std::string::npos)
      << o.output;
  EXPECT_NE(o.output.find("Scratch"), std::string::npos) << o.output;
}

TEST(BenchCli, RunCompareAndReport) {
  const fs::path dir = temp_dir();
  const std::string json = (dir / "run.json").string();
  const Outcome run = run_cli("--suite smoke --ops mse_forward,mse_backward --dtype fp32 --timeout-ms 50 --quiet --device cpu --json " + json);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("mse_backward 64x256 float32 [cpu-ref]"), std::string::npos) << run.output;

  EXPECT_EQ(run_cli("compare " + json + " " + json).exit_code, 0);

  // The same run, every row twice as slow and quiet: SLOWER beyond the threshold -> exit 1.
  nlohmann::json slower;
  std::ifstream(json) >> slower;
  for (auto& row : slower["rows"]) {
    row["ms"]["median"] = row["ms"]["median"].get<double>() * 2;
    row["ms"]["rel_noise"] = 0.001;
  }
  const std::string slower_json = (dir / "slower.json").string();
  std::ofstream(slower_json) << slower.dump();
  const Outcome regressed = run_cli("compare " + json + " " + slower_json);
  EXPECT_EQ(regressed.exit_code, 1) << regressed.output;
  EXPECT_NE(regressed.output.find("SLOWER (regression)"), std::string::npos) << regressed.output;
  EXPECT_EQ(run_cli("compare " + slower_json + " " + json).exit_code, 0);  // faster is fine

  const Outcome report = run_cli("report " + dir.string());
  EXPECT_EQ(report.exit_code, 0) << report.output;
  EXPECT_NE(report.output.find("# TrainScale benchmark report"), std::string::npos) << report.output;
  EXPECT_NE(report.output.find("| slower |"), std::string::npos) << report.output;
  fs::remove_all(dir);
}

TEST(BenchCli, RooflineWithoutAGpuIsAnError) {
  const Outcome o = run_cli("roofline");
  if (o.exit_code == 0) GTEST_SKIP() << "a GPU is present";
  EXPECT_EQ(o.exit_code, 1) << o.output;
  EXPECT_NE(o.output.find("needs a CUDA device"), std::string::npos) << o.output;
}

}  // namespace
