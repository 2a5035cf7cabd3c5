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

// Binds this process to a GPU: its node-local rank (OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID
// or MPI_LOCALRANKID; 0 when none is set) modulo the visible devices, so that `mpirun -np 8`
// on an 8-GPU node gives each rank its own. Returns the ordinal.
int bind_local_gpu();

}  // namespace retain
