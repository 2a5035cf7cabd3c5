// Restricted pickle machine for torch.save state dicts, and the matching writer
// (opcodes: Python's Lib/pickletools.py; torch's layout: docs/formats.md).
#include "data/formats/torch_pickle.h"

#include <cstring>
#include <functional>
#include <optional>
#include <memory>
#include <algorithm>
#include <set>
#include <unordered_map>

#include <fmt/format.h>

namespace retain::formats::torchfile {

namespace {

struct Value;
using ValuePtr = std::shared_ptr<Value>;

// Limits that hold for every pickle, however hostile, below what any state dict needs: a state
// dict nests 4 deep (dict → the rebuild's argument tuple → the persistent id or a size tuple →
// an int) and creates ~15 objects per tensor.
constexpr int kMaxDepth = 64;              // containers inside containers
constexpr int64_t kMaxObjects = 1 << 20;   // values pushed on the machine's stack, in all (~120 MB)

// What the machine's stack can hold. Globals are names, never resolved to anything callable.
struct Value {
  enum Kind { None, Bool, Int, Str, Tuple, List, Dict, Global, Storage, Tensor, Mark } kind = None;
  int64_t i = 0;                 // Int, Bool
  std::string s;                 // Str; Global: "module.name"
  std::vector<ValuePtr> items;   // Tuple, List; Dict: key, value, key, value, …
  TensorRecord rec;              // Storage (key, dtype, numel) and Tensor
  int depth = 0;                 // 1 + the deepest item's, as built (kMaxDepth)

  Value() = default;
  Value(const Value&) = delete;
  Value& operator=(const Value&) = delete;
  // Iterative: a chain of nested containers is freed with a loop, not one stack frame per level
  // (a recursive destructor overflows the stack on a hostile pickle, whatever the depth check
  // saw: memo references can nest a container after it was checked).
  ~Value() {
    std::vector<ValuePtr> pending = std::move(items);
    while (!pending.empty()) {
      ValuePtr v = std::move(pending.back());
      pending.pop_back();
      if (v.use_count() == 1) {  // the last owner: take its items before it dies, childless
        for (ValuePtr& c : v->items) pending.push_back(std::move(c));
        v->items.clear();
      }
    }
  }
};

ValuePtr make(Value::Kind k) {
  auto v = std::make_shared<Value>();
  v->kind = k;
  return v;
}

std::string_view kind_name(Value::Kind k) {
  static const char* const names[] = {"None", "bool", "int",  "str",     "tuple",  "list",
                                      "dict", "global", "storage", "tensor", "mark"};
  return names[k];
}

const std::set<std::string>& allowed_globals() {
  static const std::set<std::string> g = {
      "collections.OrderedDict",    "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_parameter",
      "torch.FloatStorage",         "torch.BFloat16Storage",           "torch.HalfStorage",
      "torch.DoubleStorage"};
  return g;
}

std::optional<DType> storage_dtype(const std::string& global) {
  if (global == "torch.FloatStorage") return DType::F32;
  if (global == "torch.BFloat16Storage") return DType::BF16;
  if (global == "torch.HalfStorage") return DType::F16;
  if (global == "torch.DoubleStorage") return DType::F64;
  return std::nullopt;
}

class Machine {
 public:
  Machine(std::string_view data, const std::string& what) : p_(data), what_(what) {}

  ValuePtr run() {
    while (true) {
      const size_t at = pos_;
      const uint8_t op = byte();
      switch (op) {
        case 0x80: {  // PROTO
          const uint8_t proto = byte();
          if (proto < 2 || proto > 5) err(at, fmt::format("pickle protocol {} (2 to 5 are read)", proto));
          break;
        }
        case 0x95: take(8); break;  // FRAME: a length hint only
        case '.': {                 // STOP
          if (stack_.size() != 1) err(at, fmt::format("STOP with {} values on the stack", stack_.size()));
          if (pos_ != p_.size()) err(pos_, fmt::format("{} bytes after STOP", p_.size() - pos_));
          return stack_.back();
        }
        case '(': push(make(Value::Mark)); break;
        case ')': push(make(Value::Tuple)); break;
        case 't': push(tuple_of(pop_mark(at), at)); break;
        case 0x85: case 0x86: case 0x87: {  // TUPLE1..3
          const size_t n = op - 0x84u;
          if (stack_.size() < n) err(at, "TUPLE with too few values");
          std::vector<ValuePtr> items(stack_.end() - static_cast<long>(n), stack_.end());
          stack_.resize(stack_.size() - n);
          for (const ValuePtr& x : items) check_not_mark(x, at);
          push(tuple_of(std::move(items), at));
          break;
        }
        case '}': push(make(Value::Dict)); break;
        case ']': push(make(Value::List)); break;
        case 's': {  // SETITEM
          ValuePtr v = pop(at), k = pop(at);
          set_items(top(at), {k, v}, at);
          break;
        }
        case 'u': {  // SETITEMS
          std::vector<ValuePtr> kv = pop_mark(at);
          if (kv.size() % 2) err(at, "SETITEMS with an odd number of values");
          set_items(top(at), kv, at);
          break;
        }
        case 'a': {  // APPEND
          ValuePtr v = pop(at);
          append(top(at), {v}, at);
          break;
        }
        case 'e': {  // APPENDS
          std::vector<ValuePtr> vs = pop_mark(at);
          append(top(at), vs, at);
          break;
        }
        case 'J': push(integer(static_cast<int32_t>(le(4)))); break;      // BININT
        case 'K': push(integer(byte())); break;                          // BININT1
        case 'M': push(integer(static_cast<int64_t>(le(2)))); break;     // BININT2
        case 0x8a: {                                                     // LONG1
          const uint8_t n = byte();
          if (n > 8) err(at, fmt::format("LONG1 of {} bytes (at most 8 are read)", n));
          uint64_t u = le(n);
          if (n > 0 && n < 8 && (u >> (8 * n - 1)) & 1) u |= ~uint64_t{0} << (8 * n);  // sign-extend
          push(integer(static_cast<int64_t>(u)));
          break;
        }
        case 'X': push(str(take(le(4)))); break;     // BINUNICODE
        case 0x8c: push(str(take(byte()))); break;   // SHORT_BINUNICODE
        case 0x8d: push(str(take(le(8)))); break;    // BINUNICODE8
        case 'N': push(make(Value::None)); break;
        case 0x88: case 0x89: {                      // NEWTRUE, NEWFALSE
          ValuePtr b = make(Value::Bool);
          b->i = op == 0x88;
          push(b);
          break;
        }
        case 'c': {  // GLOBAL "module\nname\n"
          const std::string module = line(at), name = line(at);
          push(global(module + "." + name, at));
          break;
        }
        case 0x93: {  // STACK_GLOBAL
          ValuePtr name = pop(at), module = pop(at);
          if (module->kind != Value::Str || name->kind != Value::Str) err(at, "STACK_GLOBAL needs two strings");
          push(global(module->s + "." + name->s, at));
          break;
        }
        case 'q': memo_[byte()] = top(at); break;                            // BINPUT
        case 'r': memo_[static_cast<uint32_t>(le(4))] = top(at); break;      // LONG_BINPUT
        case 0x94: memo_[static_cast<uint32_t>(memo_.size())] = top(at); break;  // MEMOIZE
        case 'h': push(get(byte(), at)); break;                              // BINGET
        case 'j': push(get(static_cast<uint32_t>(le(4)), at)); break;        // LONG_BINGET
        case 'R': {  // REDUCE
          ValuePtr args = pop(at), fn = pop(at);
          push(reduce(fn, args, at));
          break;
        }
        case 'Q': push(persistent(pop(at), at)); break;  // BINPERSID
        default:
          err(at, fmt::format("unsupported pickle opcode 0x{:02x} (only torch.save state dicts of tensors are read)", op));
      }
    }
  }

 private:
  [[noreturn]] void err(size_t at, const std::string& msg) const { fail("{}: byte {}: {}", what_, at, msg); }

  uint8_t byte() {
    if (pos_ >= p_.size()) err(pos_, "truncated pickle (no STOP)");
    return static_cast<uint8_t>(p_[pos_++]);
  }
  std::string_view take(uint64_t n) {
    if (n > p_.size() - pos_) err(pos_, fmt::format("a {}-byte field runs past the end of the pickle", n));
    std::string_view s = p_.substr(pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return s;
  }
  uint64_t le(int n) {
    const std::string_view b = take(static_cast<uint64_t>(n));
    uint64_t u = 0;
    for (int i = n - 1; i >= 0; --i) u = (u << 8) | static_cast<uint8_t>(b[static_cast<size_t>(i)]);
    return u;
  }
  std::string line(size_t at) {
    const size_t nl = p_.find('\n', pos_);
    if (nl == std::string_view::npos || nl - pos_ > 256) err(at, "GLOBAL without a newline-terminated name");
    std::string s(p_.substr(pos_, nl - pos_));
    pos_ = nl + 1;
    return s;
  }

  void push(ValuePtr v) {
    if (stack_.size() > 100000) err(pos_, "pickle stack deeper than 100000");
    if (++pushed_ > kMaxObjects) err(pos_, fmt::format("more than {} objects (a state dict needs ~15 per tensor)", kMaxObjects));
    stack_.push_back(std::move(v));
  }
  ValuePtr pop(size_t at) {
    if (stack_.empty()) err(at, "pop from an empty stack");
    ValuePtr v = stack_.back();
    stack_.pop_back();
    check_not_mark(v, at);
    return v;
  }
  ValuePtr top(size_t at) {
    if (stack_.empty()) err(at, "empty stack");
    check_not_mark(stack_.back(), at);
    return stack_.back();
  }
  void check_not_mark(const ValuePtr& v, size_t at) const {
    if (v->kind == Value::Mark) err(at, "unexpected MARK");
  }
  std::vector<ValuePtr> pop_mark(size_t at) {
    size_t m = stack_.size();
    while (m > 0 && stack_[m - 1]->kind != Value::Mark) --m;
    if (m == 0) err(at, "no MARK on the stack");
    std::vector<ValuePtr> items(stack_.begin() + static_cast<long>(m), stack_.end());
    stack_.resize(m - 1);
    return items;
  }
  ValuePtr get(uint32_t idx, size_t at) {
    auto it = memo_.find(idx);
    if (it == memo_.end()) err(at, fmt::format("memo entry {} was never stored", idx));
    return it->second;
  }
  ValuePtr tuple_of(std::vector<ValuePtr> items, size_t at) {
    ValuePtr t = make(Value::Tuple);
    deepen(*t, items, at);
    t->items = std::move(items);
    return t;
  }
  static ValuePtr integer(int64_t i) {
    ValuePtr v = make(Value::Int);
    v->i = i;
    return v;
  }
  static ValuePtr str(std::string_view s) {
    ValuePtr v = make(Value::Str);
    v->s = std::string(s);
    return v;
  }
  ValuePtr global(const std::string& name, size_t at) {
    if (!allowed_globals().count(name))
      err(at, fmt::format("global '{}' is not allowed (a state dict of tensors needs only torch's tensor "
                          "rebuild functions, storage types and collections.OrderedDict)",
                          printable(name)));
    ValuePtr v = make(Value::Global);
    v->s = name;
    return v;
  }
  // Whether `target` is `from` or inside it, walked with an explicit stack (no recursion).
  // Containers hold shared_ptrs, so putting a container into itself (a memo lookup makes that
  // possible) would be a reference cycle that is never freed; no state dict has one, so it is
  // an error.
  static bool contains(const ValuePtr& from, const Value* target, std::set<const Value*>& seen) {
    std::vector<const Value*> todo{from.get()};
    while (!todo.empty()) {
      const Value* v = todo.back();
      todo.pop_back();
      if (v == target) return true;
      if (!seen.insert(v).second) continue;
      for (const ValuePtr& x : v->items) todo.push_back(x.get());
    }
    return false;
  }
  void check_no_cycle(const ValuePtr& container, const std::vector<ValuePtr>& vs, size_t at) {
    std::set<const Value*> seen;
    for (const ValuePtr& x : vs)
      if (contains(x, container.get(), seen)) err(at, fmt::format("a {} that contains itself", kind_name(container->kind)));
  }
  // A container gaining `items` nests one deeper than its deepest item: refused past kMaxDepth.
  void deepen(Value& container, const std::vector<ValuePtr>& items, size_t at) {
    for (const ValuePtr& x : items) container.depth = std::max(container.depth, x->depth + 1);
    if (container.depth > kMaxDepth)
      err(at, fmt::format("containers nested more than {} deep (a state dict nests 4)", kMaxDepth));
  }
  void set_items(const ValuePtr& dict, const std::vector<ValuePtr>& kv, size_t at) {
    if (dict->kind != Value::Dict) err(at, fmt::format("SETITEM on a {}", kind_name(dict->kind)));
    for (const ValuePtr& x : kv) check_not_mark(x, at);
    check_no_cycle(dict, kv, at);
    deepen(*dict, kv, at);
    dict->items.insert(dict->items.end(), kv.begin(), kv.end());
  }
  void append(const ValuePtr& list, const std::vector<ValuePtr>& vs, size_t at) {
    if (list->kind != Value::List) err(at, fmt::format("APPEND on a {}", kind_name(list->kind)));
    check_no_cycle(list, vs, at);
    deepen(*list, vs, at);
    list->items.insert(list->items.end(), vs.begin(), vs.end());
  }
  // A tuple or list of ints (a size or stride).
  std::vector<int64_t> ints(const ValuePtr& v, const char* what, size_t at) {
    if (v->kind != Value::Tuple && v->kind != Value::List) err(at, fmt::format("tensor {} is a {}", what, kind_name(v->kind)));
    std::vector<int64_t> out;
    for (const ValuePtr& x : v->items) {
      if (x->kind != Value::Int) err(at, fmt::format("tensor {} holds a {}", what, kind_name(x->kind)));
      out.push_back(x->i);
    }
    return out;
  }
  ValuePtr reduce(const ValuePtr& fn, const ValuePtr& args, size_t at) {
    if (fn->kind != Value::Global) err(at, fmt::format("REDUCE of a {} (not a global)", kind_name(fn->kind)));
    if (args->kind != Value::Tuple) err(at, fmt::format("REDUCE arguments are a {}", kind_name(args->kind)));
    const auto& a = args->items;
    if (fn->s == "collections.OrderedDict") {
      if (!a.empty()) err(at, "OrderedDict() with arguments");
      return make(Value::Dict);
    }
    if (fn->s == "torch._utils._rebuild_tensor_v2") {
      // (storage, storage_offset, size, stride, requires_grad, backward_hooks[, metadata])
      if (a.size() != 6 && a.size() != 7) err(at, fmt::format("_rebuild_tensor_v2 with {} arguments", a.size()));
      if (a[0]->kind != Value::Storage) err(at, "_rebuild_tensor_v2 without a storage");
      if (a[1]->kind != Value::Int) err(at, "_rebuild_tensor_v2: storage offset is not an int");
      ValuePtr t = make(Value::Tensor);
      t->rec = a[0]->rec;
      t->rec.storage_offset = a[1]->i;
      t->rec.shape = ints(a[2], "size", at);
      t->rec.stride = ints(a[3], "stride", at);
      if (t->rec.shape.size() != t->rec.stride.size()) err(at, "tensor size and stride differ in length");
      return t;
    }
    if (fn->s == "torch._utils._rebuild_parameter") {  // (tensor, requires_grad, backward_hooks)
      if (a.size() != 3 || a[0]->kind != Value::Tensor) err(at, "_rebuild_parameter without a tensor");
      return a[0];
    }
    err(at, fmt::format("'{}' cannot be called (it names a storage type)", printable(fn->s)));
  }
  // ('storage', StorageType, key, location, numel)
  ValuePtr persistent(const ValuePtr& pid, size_t at) {
    if (pid->kind != Value::Tuple || pid->items.size() != 5 || pid->items[0]->kind != Value::Str ||
        pid->items[0]->s != "storage")
      err(at, "persistent id is not a ('storage', type, key, location, numel) tuple");
    const auto& a = pid->items;
    if (a[1]->kind != Value::Global || !storage_dtype(a[1]->s)) err(at, "persistent id without a storage type");
    if (a[2]->kind != Value::Str || a[3]->kind != Value::Str || a[4]->kind != Value::Int || a[4]->i < 0)
      err(at, "persistent id with a bad key, location or size");
    ValuePtr s = make(Value::Storage);
    s->rec.dtype = *storage_dtype(a[1]->s);
    s->rec.storage_key = a[2]->s;
    s->rec.storage_numel = a[4]->i;
    return s;
  }

  std::string_view p_;
  const std::string& what_;
  size_t pos_ = 0;
  std::vector<ValuePtr> stack_;
  std::unordered_map<uint32_t, ValuePtr> memo_;
  int64_t pushed_ = 0;
};

}  // namespace

std::vector<TensorRecord> parse_state_dict(std::string_view pickle, const std::string& what) {
  const ValuePtr root = Machine(pickle, what).run();
  if (root->kind != Value::Dict) fail("{}: holds a {}, not a dict of tensors", what, kind_name(root->kind));
  std::vector<TensorRecord> out;
  std::set<std::string> seen;
  for (size_t x = 0; x < root->items.size(); x += 2) {
    const ValuePtr &k = root->items[x], &v = root->items[x + 1];
    if (k->kind != Value::Str) fail("{}: a key is a {}, not a str", what, kind_name(k->kind));
    if (v->kind != Value::Tensor) fail("{}: '{}' is a {}, not a tensor", what, printable(k->s), kind_name(v->kind));
    if (!seen.insert(k->s).second) fail("{}: key '{}' appears twice", what, printable(k->s));
    TensorRecord r = v->rec;
    r.name = k->s;
    out.push_back(std::move(r));
  }
  return out;
}

std::string_view storage_class(DType dtype) {
  switch (dtype) {
    case DType::F32: return "FloatStorage";
    case DType::BF16: return "BFloat16Storage";
    case DType::F16: return "HalfStorage";
    case DType::F64: return "DoubleStorage";
    default: fail("torch.save: dtype {} has no storage type here (F32, BF16, F16, F64)", dtype_name(dtype));
  }
}

namespace {

// Python's pickler (protocol 2) as torch.save drives it: every str, global and non-empty
// tuple is stored in the memo when first written and fetched with BINGET when the same
// object recurs ('storage', 'cpu', the rebuild function, the storage types, OrderedDict).
class Writer {
 public:
  std::string out;

  void op(char c) { out.push_back(c); }
  void u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  void put() {  // BINPUT / LONG_BINPUT of the next memo index
    if (next_ < 256) {
      op('q');
      out.push_back(static_cast<char>(next_));
    } else {
      op('r');
      u32(next_);
    }
    ++next_;
  }
  void get(uint32_t idx) {
    if (idx < 256) {
      op('h');
      out.push_back(static_cast<char>(idx));
    } else {
      op('j');
      u32(idx);
    }
  }
  // A memoized object (global or shared string): written once, then fetched.
  void shared(const std::string& key, const std::function<void()>& write) {
    if (auto it = shared_.find(key); it != shared_.end()) return get(it->second);
    write();
    shared_[key] = next_;
    put();
  }
  void global(const std::string& module, const std::string& name) {
    shared("global:" + module + "." + name, [&] {
      op('c');
      out += module + "\n" + name + "\n";
    });
  }
  void fresh_str(const std::string& s) {  // a new str object
    op('X');
    u32(static_cast<uint32_t>(s.size()));
    out += s;
    put();
  }
  void interned_str(const std::string& s) {  // one str object used everywhere ('storage', 'cpu')
    shared("str:" + s, [&] {
      op('X');
      u32(static_cast<uint32_t>(s.size()));
      out += s;
    });
  }
  void integer(int64_t v) {
    if (v >= 0 && v < 256) {
      op('K');
      out.push_back(static_cast<char>(v));
    } else if (v >= 0 && v < 65536) {
      op('M');
      out.push_back(static_cast<char>(v & 0xff));
      out.push_back(static_cast<char>(v >> 8));
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      op('J');
      u32(static_cast<uint32_t>(static_cast<int32_t>(v)));
    } else {  // LONG1, 8 bytes two's complement (torch's sizes never get here)
      op(static_cast<char>(0x8a));
      out.push_back(8);
      for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff));
    }
  }
  void int_tuple(const std::vector<int64_t>& v) {
    if (v.empty()) return op(')');  // the empty tuple is a singleton: never memoized
    if (v.size() > 3) op('(');
    for (int64_t x : v) integer(x);
    op(v.size() > 3 ? 't' : static_cast<char>(0x84 + v.size()));
    put();
  }

 private:
  uint32_t next_ = 0;
  std::unordered_map<std::string, uint32_t> shared_;
};

}  // namespace

std::string write_state_dict(const std::vector<TensorSpec>& tensors) {
  Writer w;
  w.out += "\x80\x02";
  w.global("collections", "OrderedDict");
  w.op(')');
  w.op('R');
  w.put();
  if (tensors.size() > 1) w.op('(');
  for (size_t x = 0; x < tensors.size(); ++x) {
    const TensorSpec& t = tensors[x];
    w.fresh_str(t.name);
    w.global("torch._utils", "_rebuild_tensor_v2");
    w.op('(');  // the 6 arguments
    w.op('(');  // the persistent id
    w.interned_str("storage");
    w.global("torch", std::string(storage_class(t.dtype)));
    w.fresh_str(std::to_string(x));
    w.interned_str("cpu");
    w.integer(shape_numel(t.shape));
    w.op('t');
    w.put();
    w.op('Q');
    w.integer(0);
    w.int_tuple(t.shape);
    std::vector<int64_t> stride(t.shape.size(), 1);
    for (size_t d = t.shape.size(); d-- > 1;) stride[d - 1] = stride[d] * t.shape[d];
    w.int_tuple(stride);
    w.op(static_cast<char>(0x89));  // requires_grad False
    w.global("collections", "OrderedDict");
    w.op(')');
    w.op('R');
    w.put();  // backward_hooks: a fresh OrderedDict()
    w.op('t');
    w.put();
    w.op('R');
    w.put();
    // Python batches dict items 1000 at a time: MARK … SETITEMS, or SETITEM for a lone item.
    const bool last = x + 1 == tensors.size();
    if ((x + 1) % 1000 == 0 || last) {
      const size_t batch = (x % 1000) + 1;
      w.op(batch > 1 ? 'u' : 's');
      if (!last && tensors.size() - (x + 1) > 1) w.op('(');
    }
  }
  w.op('.');
  return w.out;
}

}  // namespace retain::formats::torchfile
