// SPDX-License-Identifier: Apache-2.0
// MPI's initialisation and finalisation for a process (`mpi_environment`).
// stellatrain-component: mpi
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/transport/mpi/api.hpp>

namespace stellatrain {

/// Initialises MPI with `MPI_THREAD_MULTIPLE` unless it is initialised already, and
/// finalises it at destruction when it initialised it. One per process, in `main`.
///
/// \code
///   int main(int argc, char** argv) {
///     stellatrain::mpi_environment env(argc, argv);
///     stellatrain::mpi_transport t;          // MPI_COMM_WORLD
///     ...
///   }
/// \endcode
class mpi_environment {
 public:
  mpi_environment(int& argc, char**& argv) { init(&argc, &argv); }
  mpi_environment() { init(nullptr, nullptr); }
  mpi_environment(const mpi_environment&) = delete;
  mpi_environment& operator=(const mpi_environment&) = delete;
  ~mpi_environment() {
    int finalized = 0;
    (void)MPI_Finalized(&finalized);
    if (owner_ && finalized == 0) (void)MPI_Finalize();
  }

  /// The thread support MPI granted (MPI_THREAD_SINGLE ... MPI_THREAD_MULTIPLE).
  [[nodiscard]] int thread_level() const noexcept { return provided_; }

 private:
  void init(int* argc, char*** argv) {
    int initialized = 0;
    detail::mpi_check(MPI_Initialized(&initialized), "MPI_Initialized");
    if (initialized == 0) {
      detail::mpi_check(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided_),
                        "MPI_Init_thread");
      owner_ = true;
    } else {
      detail::mpi_check(MPI_Query_thread(&provided_), "MPI_Query_thread");
    }
  }

  bool owner_ = false;
  int provided_ = MPI_THREAD_SINGLE;
};

}  // namespace stellatrain
