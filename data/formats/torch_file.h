// torch.save files (`.pth`, `.pt`): a zip archive (libzip) holding `<archive>/data.pkl` (the
// pickled state dict, checkpoints/export/torch_pickle.h) and one `<archive>/data/<key>`
// record of raw little-endian values per storage. Layout byte by byte: docs/formats.md,
// "trimkv_weights.pth".
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "kernels/tensor.h"

namespace retain::formats::torchfile {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// Every tensor of a torch.save state dict (dict or OrderedDict of str → tensor), in the
// dict's order, as CPU tensors of their stored dtype (F32, BF16, F16 or F64). Views into a
// shared storage (a tied parameter saved under several names) each get their own copy.
// Any problem — not a zip, no data.pkl, a disallowed pickle, a storage record of the wrong
// size, a view outside its storage — is one retain::Error "<path>: ...".
NamedTensors read_torch_file(const std::string& path);

// Writes `tensors` (CPU; F32, BF16, F16 or F64) as torch.save does, atomically: records
// stored uncompressed, each record's data 64-byte aligned, fixed timestamps, so equal
// inputs give identical bytes. The archive folder is the file name without its extension.
// torch.load(path, weights_only=True) returns an OrderedDict of the tensors.
void write_torch_file(const std::string& path, const NamedTensors& tensors);

}  // namespace retain::formats::torchfile
