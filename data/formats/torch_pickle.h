// The pickle inside a torch.save archive (`<archive>/data.pkl`), for state dicts of tensors
// only (docs/formats.md, "trimkv_weights.pth"). Reading runs a restricted pickle machine:
// a fixed set of opcodes, and a fixed allow-list of globals that are never imported or
// called — they only name how to build a dict or a tensor record. Anything else (another
// global, an unknown opcode, a value that is not a str → tensor mapping) is one
// retain::Error "<what>: ...". Nothing in the file is ever executed.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/tensor.h"

namespace retain::formats::torchfile {

// One tensor of the state dict as torch stores it: a view (offset, shape, strides in
// elements) into a storage record `<archive>/data/<storage_key>` of storage_numel elements.
struct TensorRecord {
  std::string name;
  std::string storage_key;
  DType dtype = DType::F32;
  int64_t storage_numel = 0;
  int64_t storage_offset = 0;
  Shape shape;
  std::vector<int64_t> stride;
};

// The tensors of a pickled dict / OrderedDict of str → tensor (or nn.Parameter), in the
// dict's order. `what` names the source in errors ("x.pth: data.pkl").
std::vector<TensorRecord> parse_state_dict(std::string_view pickle, const std::string& what);

// The pickle torch.save writes (protocol 2, its memo numbering) for an OrderedDict of the
// given tensors, each contiguous with its own storage keyed "0", "1", … in order.
struct TensorSpec {
  std::string name;
  DType dtype;
  Shape shape;
};
std::string write_state_dict(const std::vector<TensorSpec>& tensors);

// "FloatStorage" ↔ F32, "BFloat16Storage" ↔ BF16, "HalfStorage" ↔ F16, "DoubleStorage" ↔ F64.
std::string_view storage_class(DType dtype);  // throws for other dtypes

}  // namespace retain::formats::torchfile
