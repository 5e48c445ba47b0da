// SPDX-License-Identifier: Apache-2.0
// Helpers of the multi-process transport tests: spawning and supervising worker processes
// with a deadline (never a hang), and exchanging endpoints through files in a private folder.
#pragma once

#include <stellatrain/core/error.hpp>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <spawn.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace stellatrain::test {

using steady = std::chrono::steady_clock;

struct child {
  pid_t pid = -1;
  std::optional<int> status;  // raw waitpid status once ended
  steady::time_point ended{};
};

inline pid_t spawn(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0) {
    throw std::runtime_error("cannot start " + args[0]);
  }
  return pid;
}

/// Polls the children until all ended or `deadline`; returns false on timeout (then kills
/// every child still running, so that a failing test never leaves processes behind).
inline bool wait_all(std::vector<child>& kids, steady::time_point deadline) {
  for (;;) {
    bool running = false;
    for (auto& k : kids) {
      if (k.status) continue;
      int st = 0;
      const pid_t r = waitpid(k.pid, &st, WNOHANG);
      if (r == k.pid) {
        k.status = st;
        k.ended = steady::now();
      } else {
        running = true;
      }
    }
    if (!running) return true;
    if (steady::now() >= deadline) {
      for (auto& k : kids) {
        if (!k.status) {
          kill(k.pid, SIGKILL);
          int st = 0;
          waitpid(k.pid, &st, 0);
          k.status = st;
          k.ended = steady::now();
        }
      }
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

inline std::string describe(int status) {
  if (WIFEXITED(status)) return "exit " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("signal ") + strsignal(WTERMSIG(status));
  return "status " + std::to_string(status);
}

inline int exit_code(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : -1; }

/// Writes `text` to `path` atomically (write a temporary, then rename).
inline void publish(const std::filesystem::path& path, const std::string& text) {
  const auto tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp);
    out << text;
  }
  std::filesystem::rename(tmp, path);
}

/// Waits for `path` to exist (published by another process) and returns its contents.
inline std::string await_file(const std::filesystem::path& path, steady::time_point deadline) {
  while (!std::filesystem::exists(path)) {
    if (steady::now() >= deadline) throw error(errc::timeout, "no file " + path.string());
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/// A fresh private folder under the system's temporary directory, removed at destruction.
struct temp_dir {
  std::filesystem::path path;
  temp_dir() {
    std::string templ = (std::filesystem::temp_directory_path() / "stellatrain-XXXXXX").string();
    if (mkdtemp(templ.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path = templ;
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

}  // namespace stellatrain::test
