"""A reader for the GGUF v3 adapters retain-export writes (docs/formats.md, "GGUF adapter"):
typed metadata and F32/F16/BF16 tensors. Every count, string and offset is checked against the
file; a problem is one ValueError naming the file."""
import struct

import torch

# ggml tensor types retain writes, with their torch dtype and element size.
_TENSOR_TYPES = {0: (torch.float32, 4), 1: (torch.float16, 2), 30: (torch.bfloat16, 2)}
# GGUF scalar value types: struct format.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Reader:
    def __init__(self, path, data):
        self.path, self.data, self.at = path, data, 0

    def fail(self, what):
        raise ValueError(f"{self.path}: {what}")

    def take(self, n):
        if n < 0 or self.at + n > len(self.data):
            self.fail(f"truncated GGUF file (needs {n} bytes at offset {self.at}, has {len(self.data) - self.at})")
        out = self.data[self.at:self.at + n]
        self.at += n
        return out

    def scalar(self, fmt):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self):
        raw = self.take(self.scalar("<Q"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"a GGUF string at offset {self.at - len(raw)} is not UTF-8")

    def value(self, vtype, depth=0):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY and depth == 0:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if count > len(self.data):
                self.fail(f"GGUF array of {count} elements is longer than the file")
            return [self.value(etype, 1) for _ in range(count)]
        self.fail(f"unknown GGUF value type {vtype}")


def read_gguf(path):
    """(metadata dict, {name: tensor in torch shape order}) of a GGUF v3 file."""
    with open(path, "rb") as f:
        data = f.read()
    r = _Reader(path, data)
    if r.take(4) != b"GGUF":
        r.fail("not a GGUF file (no 'GGUF' magic)")
    version = r.scalar("<I")
    if version != 3:
        r.fail(f"GGUF version {version}, expected 3")
    n_tensors, n_meta = r.scalar("<Q"), r.scalar("<Q")
    if n_tensors > len(data) or n_meta > len(data):
        r.fail(f"GGUF counts ({n_tensors} tensors, {n_meta} metadata) are larger than the file")
    meta = {}
    for _ in range(n_meta):
        key = r.string()
        meta[key] = r.value(r.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = r.string()
        ndim = r.scalar("<I")
        if ndim > 8:
            r.fail(f"tensor '{name}' has {ndim} dimensions")
        ne = [r.scalar("<Q") for _ in range(ndim)]
        ttype, offset = r.scalar("<I"), r.scalar("<Q")
        if ttype not in _TENSOR_TYPES:
            r.fail(f"tensor '{name}' has ggml type {ttype} (retain writes F32 = 0, F16 = 1, BF16 = 30)")
        infos.append((name, ne, ttype, offset))
    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        r.fail(f"general.alignment {align!r} is not a power of two")
    base = (r.at + align - 1) // align * align
    tensors, spans = {}, []
    for name, ne, ttype, offset in infos:
        dtype, size = _TENSOR_TYPES[ttype]
        numel = 1
        for n in ne:
            numel *= n
        begin, end = base + offset, base + offset + numel * size
        if offset % align or end > len(data):
            r.fail(f"tensor '{name}' at data offset {offset} ({numel * size} bytes) is misaligned or outside the file (a truncated GGUF file?)")
        spans.append((begin, end, name))
        if name in tensors:
            r.fail(f"tensor '{name}' appears twice")
        shape = list(reversed(ne))  # ne[0] is the innermost dimension
        tensors[name] = torch.frombuffer(bytearray(data[begin:end]), dtype=dtype).reshape(shape) if numel else \
            torch.empty(shape, dtype=dtype)
    spans.sort()
    for (b0, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            r.fail(f"tensors '{n0}' and '{n1}' overlap")
    return meta, tensors
