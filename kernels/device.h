// Which device a tool computes on, and which GPU a rank takes.
#pragma once
#include <string>

#include "kernels/tensor.h"

namespace retain {

// The device named by a tool's --device flag: "cpu" or "cuda"; "" takes the default, which
// is $RETAIN_DEVICE when set (the test suite pins it to cpu), else cuda when a GPU is visible,
// else cpu. Asking for cuda without one is a retain::Error in one line saying why (no CUDA in
// this build, or no device visible). Anything else: an Error naming `flag_name`.
Device resolve_device(const std::string& flag, const std::string& flag_name = "--device");

// This process's node-local rank as its launcher exported it: OMPI_COMM_WORLD_LOCAL_RANK
// (OpenMPI's mpirun), else SLURM_LOCALID (srun), else MPI_LOCALRANKID (MPICH/Hydra, Intel MPI);
// `fallback` when none is set (an empty value counts as unset). A value that is not a
// non-negative integer is a retain::Error naming the variable.
int local_rank_from_env(int fallback);

// Binds this process to a GPU: local_rank_from_env(fallback_local_rank) modulo the visible
// devices, so that `mpirun -np 8` on an 8-GPU node gives each rank its own. Multi-rank
// programs pass dist::node_local_rank(comm) (a count of the ranks on the same host, for
// launchers that export no local rank); single-process tools leave it 0. Returns the ordinal.
int bind_local_gpu(int fallback_local_rank = 0);

}  // namespace retain
