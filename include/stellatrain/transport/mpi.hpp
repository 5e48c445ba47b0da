// SPDX-License-Identifier: Apache-2.0
// The MPI backend (MPI-3 C API, e.g. Open MPI): ranks launched by mpirun, variable-length
// receives by matched probe, optional native collectives. Needs MPI (CMake target
// stellatrain::mpi); not part of <stellatrain/stellatrain.hpp>. The entry point of the
// backend, whose parts are the headers of transport/mpi/.
// stellatrain-component: mpi
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/transport/mpi/environment.hpp>
#include <stellatrain/transport/mpi/options.hpp>
#include <stellatrain/transport/mpi/request.hpp>
#include <stellatrain/transport/mpi/transport.hpp>
