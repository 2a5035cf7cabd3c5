// Reads the log tests/trainer/nvtx_recorder.cpp writes (one line per NVTX range event) into what
// the tests check: each "step" range's child ranges, counted; the pushes by name; the start/end
// spans by name; and every inconsistency (a pop with nothing open, a range left open, a step
// inside another range, an end of a span never started, a step not closing on reduce, optimizer).
#pragma once
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "tests/trainer/train_helpers.h"

namespace retain::trainer::test {

struct NvtxLog {
  std::vector<std::map<std::string, int>> steps;  // each step's direct child ranges, counted
  std::map<std::string, int> pushes;              // every push range by name
  std::map<std::string, int> spans;               // every start/end span by name
  int spans_started = 0;
  std::vector<std::string> problems;
};

// The one log a process wrote under `dir` ("<prefix>.<pid>"), or "" with none or several.
inline std::string nvtx_log_file(const std::filesystem::path& dir, const std::string& prefix) {
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().filename().string().rfind(prefix + ".", 0) == 0) files.push_back(e.path().string());
  return files.size() == 1 ? files[0] : std::string();
}

inline NvtxLog read_nvtx_log(const std::string& file) {
  NvtxLog log;
  std::map<std::string, std::vector<std::string>> stacks;  // thread → its open push ranges
  std::vector<std::string> children;                       // of the step being read, in order
  std::map<std::string, std::string> open_spans;           // id → name
  std::istringstream in(slurp(file));
  for (std::string line; std::getline(in, line);) {
    std::istringstream words(line);
    std::string thread, event, rest;
    words >> thread >> event;
    std::getline(words >> std::ws, rest);
    std::vector<std::string>& stack = stacks[thread];
    if (event == "push") {
      if (rest == "step" && !stack.empty()) log.problems.push_back("a step inside " + stack.back());
      if (rest == "step") children.clear();
      if (stack.size() == 1 && stack[0] == "step") children.push_back(rest);
      stack.push_back(rest);
      ++log.pushes[rest];
    } else if (event == "pop") {
      if (stack.empty()) {
        log.problems.push_back("a pop with no range open on thread " + thread);
        continue;
      }
      if (stack.back() == "step") {
        std::map<std::string, int> counted;
        for (const std::string& c : children) ++counted[c];
        log.steps.push_back(counted);
        if (children.size() < 2 || children[children.size() - 2] != "reduce" || children.back() != "optimizer")
          log.problems.push_back("step " + std::to_string(log.steps.size()) + " does not end on reduce, optimizer");
      }
      stack.pop_back();
    } else if (event == "start") {
      const auto space = rest.find(' ');
      const std::string id = rest.substr(0, space), name = space == std::string::npos ? "" : rest.substr(space + 1);
      if (!open_spans.emplace(id, name).second) log.problems.push_back("span id reused: " + line);
      ++log.spans[name];
      ++log.spans_started;
    } else if (event == "end") {
      if (open_spans.erase(rest) != 1) log.problems.push_back("an end of a span never started: " + line);
    } else {
      log.problems.push_back("unknown event: " + line);
    }
  }
  for (const auto& [thread, stack] : stacks)
    if (!stack.empty()) log.problems.push_back(std::to_string(stack.size()) + " ranges left open on thread " + thread);
  if (!open_spans.empty()) log.problems.push_back(std::to_string(open_spans.size()) + " spans left open");
  return log;
}

// Runs `command` with the recorder `library` injected (NVTX_INJECTION64_PATH) and reads back
// the log it wrote under `dir`; the run's exit status and output in *result. A run that wrote no
// log, or several, has that among the problems.
inline NvtxLog run_recorded(const std::string& library, const std::string& command, const TempDir& dir,
                            Result* result) {
  *result = run("env NVTX_INJECTION64_PATH=" + library + " RETAIN_NVTX_LOG=" + (dir / "nvtx") + " " + command, dir);
  const std::string file = nvtx_log_file(dir.path(), "nvtx");
  if (!file.empty()) return read_nvtx_log(file);
  NvtxLog none;
  none.problems.push_back("no NVTX log, or several, under " + dir.path().string() + " (was " + library + " loaded?)");
  return none;
}

}  // namespace retain::trainer::test
