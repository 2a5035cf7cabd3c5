#include "data/packed_dataset.h"

#include <algorithm>
#include <unordered_set>

#include "data/tokenizer/sha256.h"
#include "kernels/base/atomic_file.h"
#include "kernels/base/error.h"
#include "kernels/ops.h"

namespace retain::data {

namespace {

formats::h5::Handle open_2d(hid_t file, const char* name, bool want_signed, size_t want_size, const std::string& path,
                   hsize_t dims[2]) {
  if (H5Lexists(file, name, H5P_DEFAULT) <= 0) fail("{}: missing dataset '/{}'", path, name);
  formats::h5::Handle d = formats::h5::checked(H5Dopen2(file, name, H5P_DEFAULT), H5Dclose, path, std::string("opening /") + name);
  formats::h5::Handle type = formats::h5::checked(H5Dget_type(d.get()), H5Tclose, path, "reading a dataset type");
  const bool is_signed = H5Tget_sign(type.get()) == H5T_SGN_2;
  if (H5Tget_class(type.get()) != H5T_INTEGER || H5Tget_size(type.get()) != want_size || is_signed != want_signed)
    fail("{}: dataset '/{}' must be {}{} (integer, {} bytes)", path, name, want_signed ? "int" : "uint", want_size * 8,
         want_size);
  formats::h5::Handle space = formats::h5::checked(H5Dget_space(d.get()), H5Sclose, path, "reading a dataspace");
  if (H5Sget_simple_extent_ndims(space.get()) != 2)
    fail("{}: dataset '/{}' must have rank 2 [sequences, seq_len]", path, name);
  H5Sget_simple_extent_dims(space.get(), dims, nullptr);
  return d;
}

void read_rows(hid_t dset, hid_t mem_type, void* out, int64_t row, int64_t S, const std::string& path,
               const char* name) {
  formats::h5::Handle fspace = formats::h5::checked(H5Dget_space(dset), H5Sclose, path, "reading a dataspace");
  const hsize_t start[2] = {static_cast<hsize_t>(row), 0};
  const hsize_t count[2] = {1, static_cast<hsize_t>(S)};
  formats::h5::check(H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, start, nullptr, count, nullptr), path,
            "selecting a row");
  formats::h5::Handle mspace = formats::h5::checked(H5Screate_simple(2, count, nullptr), H5Sclose, path, "creating a dataspace");
  if (H5Dread(dset, mem_type, mspace.get(), fspace.get(), H5P_DEFAULT, out) < 0)
    fail("{}: cannot read row {} of '/{}' (corrupt file?)", path, row, name);
}

}  // namespace

PackedDataset PackedDataset::open(const std::filesystem::path& path) {
  formats::h5::silence_hdf5_errors();
  PackedDataset ds;
  ds.path_ = path;
  ds.name_ = path.string();
  const std::string& p = ds.name_;
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) fail("{}: no such file", p);
  require_regular_file(p);  // libhdf5 would block on a FIFO
  if (H5Fis_hdf5(p.c_str()) <= 0) fail("{}: not an HDF5 file", p);
  ds.file_ = formats::h5::Handle(H5Fopen(p.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (!ds.file_.valid()) fail("{}: cannot open as HDF5", p);
  hsize_t d_ids[2], d_docs[2], d_mask[2];
  ds.ids_ = open_2d(ds.file_.get(), "input_ids", true, 4, p, d_ids);
  ds.docs_ = open_2d(ds.file_.get(), "doc_ids", true, 4, p, d_docs);
  ds.mask_ = open_2d(ds.file_.get(), "target_mask", false, 1, p, d_mask);
  for (const hsize_t* d : {d_docs, d_mask})
    if (d[0] != d_ids[0] || d[1] != d_ids[1])
      fail("{}: datasets disagree in shape: input_ids [{}, {}], doc_ids [{}, {}], target_mask [{}, {}]", p,
           d_ids[0], d_ids[1], d_docs[0], d_docs[1], d_mask[0], d_mask[1]);
  const hid_t root = ds.file_.get();
  ds.seq_len_ = formats::h5::read_attr_int(root, "seq_len", p);
  ds.vocab_size_ = formats::h5::read_attr_int(root, "vocab_size", p);
  ds.eos_token_id_ = formats::h5::read_attr_int(root, "eos_token_id", p);
  ds.tokenizer_sha256_ = formats::h5::read_attr_str(root, "tokenizer_sha256", p);
  ds.packing_ = formats::h5::read_attr_str(root, "packing", p);
  ds.n_ = static_cast<int64_t>(d_ids[0]);
  if (ds.seq_len_ < 2) fail("{}: attribute seq_len = {} (must be >= 2)", p, ds.seq_len_);
  if (static_cast<hsize_t>(ds.seq_len_) != d_ids[1])
    fail("{}: attribute seq_len = {} but the datasets have {} columns", p, ds.seq_len_, d_ids[1]);
  if (ds.vocab_size_ < 1 || ds.vocab_size_ > INT32_MAX) fail("{}: attribute vocab_size = {} is invalid", p, ds.vocab_size_);
  if (ds.eos_token_id_ < 0 || ds.eos_token_id_ >= ds.vocab_size_)
    fail("{}: attribute eos_token_id = {} is outside [0, vocab_size = {})", p, ds.eos_token_id_, ds.vocab_size_);
  if (ds.packing_ != "concat" && ds.packing_ != "bfd")
    fail("{}: attribute packing = '{}' (expected concat or bfd)", p, ds.packing_);
  if (ds.tokenizer_sha256_.size() != 64) fail("{}: attribute tokenizer_sha256 is not a SHA-256 hex digest", p);
  if (ds.n_ == 0) fail("{}: holds no sequences", p);
  return ds;
}

void PackedDataset::read_row(int64_t i, int32_t* ids, int32_t* docs, uint8_t* mask) const {
  if (i < 0 || i >= n_) fail("{}: sequence {} is out of range [0, {})", name_, i, n_);
  const int64_t S = seq_len_;
  read_rows(ids_.get(), H5T_NATIVE_INT32, ids, i, S, name_, "input_ids");
  read_rows(docs_.get(), H5T_NATIVE_INT32, docs, i, S, name_, "doc_ids");
  read_rows(mask_.get(), H5T_NATIVE_UINT8, mask, i, S, name_, "target_mask");
  std::unordered_set<int32_t> seen;  // doc ids of runs already ended in this row
  for (int64_t t = 0; t < S; ++t) {
    if (ids[t] < 0 || ids[t] >= vocab_size_)
      fail("{}: sequence {} position {}: token id {} is outside [0, vocab_size = {})", name_, i, t, ids[t], vocab_size_);
    if (docs[t] < -1) fail("{}: sequence {} position {}: doc id {} (must be >= -1)", name_, i, t, docs[t]);
    if (mask[t] > 1 || (docs[t] == -1 && mask[t] != 0))
      fail("{}: sequence {} position {}: target_mask {} (must be 0/1, and 0 on padding)", name_, i, t, mask[t]);
    if (t > 0 && docs[t] != docs[t - 1] && docs[t] >= 0) {
      if (docs[t - 1] >= 0) seen.insert(docs[t - 1]);
      if (seen.count(docs[t]))
        fail("{}: sequence {}: document {} is not one contiguous run (again at position {})", name_, i, docs[t], t);
    }
  }
}

PackedSequence PackedDataset::read(int64_t i) const {
  PackedSequence s;
  const auto S = static_cast<size_t>(seq_len_);
  s.input_ids.resize(S);
  s.doc_ids.resize(S);
  s.target_mask.resize(S);
  read_row(i, s.input_ids.data(), s.doc_ids.data(), s.target_mask.data());
  const Tensor pos = ops::document_positions(Tensor::from_vector(s.doc_ids, {seq_len_}));
  s.positions.assign(pos.data<int32_t>(), pos.data<int32_t>() + S);
  return s;
}

PackedBatch PackedDataset::read_batch(std::span<const int64_t> rows) const {
  const auto B = static_cast<int64_t>(rows.size());
  const int64_t S = seq_len_;
  PackedBatch b;
  b.input_ids = Tensor::empty({B, S}, DType::I32);
  b.doc_ids = Tensor::empty({B, S}, DType::I32);
  b.positions = Tensor::empty({B, S}, DType::I32);
  b.target_mask = Tensor::empty({B, S}, DType::U8);
  b.rows.assign(rows.begin(), rows.end());
  for (int64_t r = 0; r < B; ++r) {
    int32_t* docs = b.doc_ids.data<int32_t>() + r * S;
    read_row(rows[static_cast<size_t>(r)], b.input_ids.data<int32_t>() + r * S, docs,
             b.target_mask.data<uint8_t>() + r * S);
    const Tensor pos = ops::document_positions(Tensor::from_vector(std::vector<int32_t>(docs, docs + S), {S}));
    std::copy_n(pos.data<int32_t>(), S, b.positions.data<int32_t>() + r * S);
  }
  return b;
}

void check_dataset_matches_model(const PackedDataset& ds, const std::filesystem::path& model_dir,
                                 int64_t model_vocab_size) {
  const auto cfg = (model_dir / "config.json").string();
  if (ds.vocab_size() > model_vocab_size)
    fail("{}: vocab_size {} exceeds the model's vocab_size {} ({}); pack with the model's tokenizer",
         ds.path().string(), ds.vocab_size(), model_vocab_size, cfg);
  const auto tok = model_dir / "tokenizer.json";
  std::error_code ec;
  if (std::filesystem::exists(tok, ec)) {
    const std::string sha = sha256_file(tok);
    if (sha != ds.tokenizer_sha256())
      fail("{}: was packed with a tokenizer (sha256 {}) other than the model's {} (sha256 {}); re-pack with "
           "--tokenizer {}",
           ds.path().string(), ds.tokenizer_sha256(), tok.string(), sha, tok.string());
  }
}

}  // namespace retain::data
