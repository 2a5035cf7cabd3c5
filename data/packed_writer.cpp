#include "data/packed_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "kernels/base/error.h"

namespace retain::data {

namespace {

formats::h5::Handle create_dataset(hid_t file, const char* name, hid_t type, int64_t seq_len, int level,
                          const std::string& path) {
  const hsize_t dims[2] = {0, static_cast<hsize_t>(seq_len)};
  const hsize_t maxdims[2] = {H5S_UNLIMITED, static_cast<hsize_t>(seq_len)};
  const hsize_t chunk[2] = {1, static_cast<hsize_t>(std::min(seq_len, kMaxChunkColumns))};
  formats::h5::Handle space = formats::h5::checked(H5Screate_simple(2, dims, maxdims), H5Sclose, path, "creating a dataspace");
  formats::h5::Handle dcpl = formats::h5::checked(H5Pcreate(H5P_DATASET_CREATE), H5Pclose, path, "creating dataset properties");
  formats::h5::check(H5Pset_chunk(dcpl.get(), 2, chunk), path, "setting the chunk shape");
  // No modification times in object headers: the same inputs give a byte-identical file.
  formats::h5::check(H5Pset_obj_track_times(dcpl.get(), false), path, "disabling time tracking");
  if (level > 0) {
    formats::h5::check(H5Pset_shuffle(dcpl.get()), path, "enabling the shuffle filter");
    formats::h5::check(H5Pset_deflate(dcpl.get(), static_cast<unsigned>(level)), path, "enabling deflate");
  }
  return formats::h5::checked(H5Dcreate2(file, name, type, space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT), H5Dclose,
                     path, std::string("creating dataset ") + name);
}

void append_rows(hid_t dset, hid_t mem_type, const void* data, int64_t first, int64_t rows, int64_t seq_len,
                 const std::string& path, const char* name) {
  const hsize_t new_dims[2] = {static_cast<hsize_t>(first + rows), static_cast<hsize_t>(seq_len)};
  formats::h5::check(H5Dset_extent(dset, new_dims), path, std::string("growing ") + name);
  formats::h5::Handle fspace = formats::h5::checked(H5Dget_space(dset), H5Sclose, path, "reading a dataspace");
  const hsize_t start[2] = {static_cast<hsize_t>(first), 0};
  const hsize_t count[2] = {static_cast<hsize_t>(rows), static_cast<hsize_t>(seq_len)};
  formats::h5::check(H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, start, nullptr, count, nullptr), path,
            "selecting rows");
  formats::h5::Handle mspace = formats::h5::checked(H5Screate_simple(2, count, nullptr), H5Sclose, path, "creating a dataspace");
  formats::h5::check(H5Dwrite(dset, mem_type, mspace.get(), fspace.get(), H5P_DEFAULT, data), path,
            std::string("writing ") + name);
}

void fsync_path(const std::filesystem::path& p, bool directory, const std::string& name) {
  const int fd = ::open(p.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) fail("{}: cannot open for fsync: {}", name, std::strerror(errno));
  const int r = ::fsync(fd);
  const int saved = errno;
  ::close(fd);
  if (r != 0 && !directory) fail("{}: fsync failed: {}", name, std::strerror(saved));
}

}  // namespace

PackedWriter::PackedWriter(std::filesystem::path out, int64_t seq_len, int compression_level)
    : out_(std::move(out)), name_(out_.string()), seq_len_(seq_len) {
  formats::h5::silence_hdf5_errors();
  tmp_ = out_;
  tmp_ += ".tmp." + std::to_string(::getpid());
  const std::string tmp = tmp_.string();
  std::error_code ec;
  // Checked now, not at the final rename: a bad name fails before any work is done.
  if (!out_.has_filename()) fail("'{}': the output must name a file", name_);
  if (std::filesystem::is_directory(out_, ec)) fail("{}: is a directory; the output must name a file", name_);
  const auto dir = out_.has_parent_path() ? out_.parent_path() : std::filesystem::path(".");
  if (!std::filesystem::is_directory(dir, ec)) fail("{}: the directory {} does not exist", name_, dir.string());
  formats::h5::Handle fcpl = formats::h5::checked(H5Pcreate(H5P_FILE_CREATE), H5Pclose, name_, "creating file properties");
  formats::h5::check(H5Pset_obj_track_times(fcpl.get(), false), name_, "disabling time tracking");
  file_ = formats::h5::Handle(H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, fcpl.get(), H5P_DEFAULT), H5Fclose);
  if (!file_.valid()) {
    std::filesystem::remove(tmp_, ec);  // HDF5 may have made it before failing (a full disk)
    fail("{}: cannot create {} (is the directory writable? is the disk full?)", name_, tmp);
  }
  try {  // a constructor that throws runs no destructor: the temporary goes here
    ids_ = create_dataset(file_.get(), "input_ids", H5T_STD_I32LE, seq_len, compression_level, name_);
    docs_ = create_dataset(file_.get(), "doc_ids", H5T_STD_I32LE, seq_len, compression_level, name_);
    mask_ = create_dataset(file_.get(), "target_mask", H5T_STD_U8LE, seq_len, compression_level, name_);
  } catch (...) {
    mask_.reset();
    docs_.reset();
    ids_.reset();
    file_.reset();
    std::filesystem::remove(tmp_, ec);
    throw;
  }
}

PackedWriter::~PackedWriter() {
  if (committed_) return;
  mask_.reset();
  docs_.reset();
  ids_.reset();
  file_.reset();
  std::error_code ec;
  std::filesystem::remove(tmp_, ec);
}

void PackedWriter::append(const int32_t* input_ids, const int32_t* doc_ids, const uint8_t* target_mask,
                          int64_t rows) {
  if (rows <= 0) return;
  append_rows(ids_.get(), H5T_NATIVE_INT32, input_ids, rows_, rows, seq_len_, name_, "input_ids");
  append_rows(docs_.get(), H5T_NATIVE_INT32, doc_ids, rows_, rows, seq_len_, name_, "doc_ids");
  append_rows(mask_.get(), H5T_NATIVE_UINT8, target_mask, rows_, rows, seq_len_, name_, "target_mask");
  rows_ += rows;
}

void PackedWriter::commit(const PackedAttributes& a) {
  const hid_t root = file_.get();
  formats::h5::write_attr_i64(root, "format_version", kPackedFormatVersion, name_);
  formats::h5::write_attr_i64(root, "seq_len", a.seq_len, name_);
  formats::h5::write_attr_i64(root, "vocab_size", a.vocab_size, name_);
  formats::h5::write_attr_i64(root, "eos_token_id", a.eos_token_id, name_);
  formats::h5::write_attr_i64(root, "pad_token_id", a.pad_token_id, name_);
  formats::h5::write_attr_str(root, "tokenizer_sha256", a.tokenizer_sha256, name_);
  formats::h5::write_attr_str(root, "packing", a.packing, name_);
  formats::h5::write_attr_str(root, "order", a.order, name_);
  formats::h5::write_attr_str(root, "targets", a.targets, name_);
  formats::h5::write_attr_u64(root, "seed", a.seed, name_);
  formats::h5::write_attr_i64(root, "num_sequences", rows_, name_);
  formats::h5::write_attr_i64(root, "num_documents", a.num_documents, name_);
  formats::h5::write_attr_i64(root, "num_tokens", a.num_tokens, name_);
  formats::h5::write_attr_i64(root, "padding_tokens", a.padding_tokens, name_);
  formats::h5::write_attr_i64(root, "split_documents", a.split_documents, name_);
  formats::h5::write_attr_str(root, "created_by", a.created_by, name_);
  mask_.reset();
  docs_.reset();
  ids_.reset();
  formats::h5::check(H5Fflush(root, H5F_SCOPE_GLOBAL), name_, "flushing the file");
  if (!file_.close()) fail("{}: HDF5: closing {} failed", name_, tmp_.string());
  fsync_path(tmp_, false, name_);
  std::error_code ec;
  std::filesystem::rename(tmp_, out_, ec);
  if (ec) fail("{}: cannot rename {} onto it: {}", name_, tmp_.string(), ec.message());
  committed_ = true;
  fsync_path(out_.has_parent_path() ? out_.parent_path() : std::filesystem::path("."), true, name_);
}

}  // namespace retain::data
