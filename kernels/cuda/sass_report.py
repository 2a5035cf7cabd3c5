#!/usr/bin/env python3
"""What the compiled CUDA kernels cost per loop iteration, read from their SASS.

Without a GPU nothing can be timed, but the machine code nvcc emits for sm_90a can be read:
a kernel whose inner loop issues many instructions per tensor-core instruction (HMMA) is
issue-bound, whatever the GPU does with it. This script parses `cuobjdump -sass` output,
builds each kernel's control-flow graph, finds its loops (back edges, natural loops), and
for every loop counts the instructions issued on each path through one iteration:

  kernel  regs  stack  loop  HMMA  instructions (fewest..most over paths with that many
  HMMA)  instructions per HMMA  the instruction mix of the shortest such path

Tensor-core work is counted in m16n8k16 units ("HMMA"): an HMMA.16816 is one, a Hopper
warpgroup HGMMA.64xNx16 is N/8 (the share of each of its 4 warps: 16 rows × N × 16), so
mma.sync and wgmma kernels read on one scale. A predicated instruction issues whether or not
its predicate holds, so it counts. Inner
loops are walked once (their own line gives their cost per trip). Registers, stack and
local (spill) bytes come from `cuobjdump -res-usage`.

    python3 kernels/cuda/sass_report.py [--cuobjdump PATH] [--arch sm_90a] OBJ.o [--kernel REGEX] [--json F]
    python3 kernels/cuda/sass_report.py --sass FILE.sass            (a saved listing)

Exit status: 0, 2 for usage errors, 1 when the input cannot be read or parsed.
"""
import argparse
import collections
import json
import os
import re
import subprocess
import sys

INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)\s*(.*?)\s*;")
FUNC = re.compile(r"^\s+Function : (\S+)")
RES = re.compile(r"^\s*Function (\S+):\s*$")
RES_LINE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
TARGET = re.compile(r"`?\(?\.?L?_?x?_?\d*\)?\s*0x([0-9a-f]+)\b")
ENDS_BLOCK = ("BRA", "BRX", "JMP", "JMX", "EXIT", "RET", "CALL", "KILL")


class Instr:
    __slots__ = ("addr", "pred", "op", "args")

    def __init__(self, addr, pred, op, args):
        self.addr, self.pred, self.op, self.args = addr, pred, op, args

    @property
    def base(self):
        return self.op.split(".")[0]

    def conditional(self):
        # A branch taken on a predicate: a guard (@P0 BRA) or a uniform predicate operand
        # (BRA.U !UP0, 0x…) other than the always-true UPT / PT.
        if self.pred and self.pred.strip() not in ("@PT",):
            return True
        first = self.args.split(",")[0].strip()
        return bool(re.fullmatch(r"!?U?P[0-6]", first))

    def target(self):
        m = re.search(r"0x([0-9a-f]+)", self.args)
        return int(m.group(1), 16) if m else None


def parse_functions(text):
    """{mangled name: [Instr]} from `cuobjdump -sass` text."""
    funcs, cur = {}, None
    for line in text.splitlines():
        m = FUNC.match(line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = INSTR.match(line)
        if m and cur is not None:
            pred = (m.group(2) or "").strip()
            cur.append(Instr(int(m.group(1), 16), pred, m.group(3), m.group(4)))
    return funcs


def parse_resources(text):
    """{mangled name: {regs, stack, shared, local}} from `cuobjdump -res-usage` text."""
    out, cur = {}, None
    for line in text.splitlines():
        m = RES.match(line)
        if m:
            cur = m.group(1)
            continue
        m = RES_LINE.search(line)
        if m and cur:
            out[cur] = dict(zip(("regs", "stack", "shared", "local"), map(int, m.groups())))
            cur = None
    return out


def basic_blocks(instrs):
    """(blocks as [start, end) index ranges, successors by block index)."""
    at = {ins.addr: i for i, ins in enumerate(instrs)}
    leaders = {0}
    for i, ins in enumerate(instrs):
        if ins.base in ENDS_BLOCK:
            if i + 1 < len(instrs):
                leaders.add(i + 1)
            t = ins.target() if ins.base in ("BRA", "JMP", "CALL") else None
            if t is not None and t in at:
                leaders.add(at[t])
    starts = sorted(leaders)
    blocks = [(s, (starts[k + 1] if k + 1 < len(starts) else len(instrs))) for k, s in enumerate(starts)]
    block_of = {s: k for k, (s, _) in enumerate(blocks)}
    succ = []
    for k, (s, e) in enumerate(blocks):
        last = instrs[e - 1]
        nxt = [k + 1] if k + 1 < len(blocks) else []
        if last.base == "BRA" or last.base == "JMP":
            t = last.target()
            tb = [block_of[at[t]]] if t is not None and t in at else []
            succ.append(sorted(set(tb + (nxt if last.conditional() else []))))
        elif last.base in ("EXIT", "RET", "KILL"):
            succ.append(nxt if last.conditional() else [])
        else:  # CALL returns; BRX/JMX targets are unknown: fall through only
            succ.append(nxt)
    return blocks, succ


def natural_loops(succ):
    """{header: set of blocks} for back edges latch → header with header ≤ latch."""
    pred = collections.defaultdict(list)
    for a, ss in enumerate(succ):
        for b in ss:
            pred[b].append(a)
    loops = {}
    for latch, ss in enumerate(succ):
        for header in ss:
            if header > latch:
                continue
            body = loops.setdefault(header, {header})
            stack = [latch]
            while stack:
                n = stack.pop()
                if n in body:
                    continue
                body.add(n)
                stack.extend(pred[n])
    return loops


def loop_paths(instrs, blocks, succ, header, body, loops):
    """{(HMMA, LDGSTS): (fewest, most instructions, mix of the fewest)} over the paths of one
    iteration, from the header back to it, inner back edges dropped (inner loops once). Paths
    with LDGSTS (cp.async) are the steady state that prefetches the next tile; those without
    are the last tile or a path that skips the copy."""
    inner_headers = {h for h in loops if h != header and h in body}

    def cost(b):  # (instructions, (HMMA units, LDGSTS)) of block b
        s, e = blocks[b]
        return e - s, (sum(tensor_units(ins) for ins in instrs[s:e]),
                       sum(1 for ins in instrs[s:e] if ins.base == "LDGSTS"))

    # DAG of the body without back edges (edges to the header, to inner headers from inside
    # their loops).
    def forward(b):
        for n in succ[b]:
            if n not in body or n == header:
                continue
            if n in inner_headers and b in loops[n]:
                continue
            yield n

    order, seen = [], set()

    def visit(b):  # iterative DFS post-order
        stack = [(b, iter(list(forward(b))))]
        seen.add(b)
        while stack:
            node, it = stack[-1]
            for n in it:
                if n not in seen:
                    seen.add(n)
                    stack.append((n, iter(list(forward(n)))))
                    break
            else:
                order.append(node)
                stack.pop()

    visit(header)
    # best[b]: {(hmma, ldgsts): (min_instr, max_instr, min_path)} for paths from b to a latch.
    best = {}
    for b in order:  # post-order: successors first
        n_instr, n_hmma = cost(b)
        table = {}
        ends_here = header in succ[b]
        if ends_here:
            table[n_hmma] = (n_instr, n_instr, [b])
        for n in forward(b):
            for h, (lo, hi, path) in best.get(n, {}).items():
                key = (h[0] + n_hmma[0], h[1] + n_hmma[1])
                cand = (lo + n_instr, hi + n_instr, [b] + path)
                if key not in table:
                    table[key] = cand
                else:
                    old = table[key]
                    table[key] = (min(old[0], cand[0]), max(old[1], cand[1]),
                                  cand[2] if cand[0] < old[0] else old[2])
        best[b] = table
    out = {}
    for h, (lo, hi, path) in best.get(header, {}).items():
        mix = collections.Counter()
        for b in path:
            s, e = blocks[b]
            mix.update(ins.base for ins in instrs[s:e])
        out[h] = (lo, hi, mix)
    return out


HGMMA_SHAPE = re.compile(r"^HGMMA\.64x(\d+)x16\b")


def tensor_units(ins):
    """m16n8k16 products an instruction does per warp: HMMA 1, HGMMA.64xNx16 N/8, else 0."""
    if ins.base == "HMMA":
        return 1
    if ins.base == "HGMMA":
        m = HGMMA_SHAPE.match(ins.op)
        if not m:
            raise ValueError(f"unexpected tensor instruction {ins.op}")
        return int(m.group(1)) // 8
    return 0


def analyse(name, instrs, res):
    blocks, succ = basic_blocks(instrs)
    loops = natural_loops(succ)
    result = {"kernel": name, "instructions": len(instrs),
              "hmma": sum(tensor_units(i) for i in instrs), "loops": []}
    result.update(res.get(name, {}))
    result["carried_a_operands"] = [{"hgmma": f"{a:#x}", "register": f"R{r}", "written_at": f"{w:#x}"}
                                    for a, r, w in carried_a_operands(instrs, (blocks, succ, loops))]
    for header in sorted(loops):
        body = loops[header]
        paths = loop_paths(instrs, blocks, succ, header, body, loops)
        if not paths:
            continue
        depth = sum(1 for h, b in loops.items() if h != header and header in b)
        entry = {"address": f"{instrs[blocks[header][0]].addr:#x}", "depth": depth,
                 "body_instructions": sum(blocks[b][1] - blocks[b][0] for b in body), "paths": []}
        for key in sorted(paths, reverse=True):
            lo, hi, mix = paths[key]
            h = key[0]
            entry["paths"].append({"hmma": h, "ldgsts": key[1], "fewest": lo, "most": hi,
                                   "per_hmma": round(lo / h, 2) if h else None,
                                   "mix": dict(mix.most_common())})
        result["loops"].append(entry)
    return result


# ---- registers a loop carries into a warpgroup product's A operand ------------------------

NO_REGISTER_DEST = {"ST", "STS", "STG", "STL", "RED", "LDGSTS", "BAR", "BRA", "BRX", "JMP", "JMX", "EXIT", "RET",
                    "CALL", "WARPSYNC", "DEPBAR", "LDGDEPBAR", "MEMBAR", "FENCE", "WARPGROUP", "NOP", "BSSY",
                    "BSYNC", "BPT", "ERRBAR", "CCTL", "KILL", "YIELD", "R2P", "FCHK"}
REGISTER = re.compile(r"^R(\d+)$")


def operands(ins):
    return [a.strip() for a in ins.args.split(",")] if ins.args else []


def defined_registers(ins):
    """The general registers an instruction writes (R0..R254; RZ, uniform registers and
    predicates are not), as a set of numbers. Over-approximates rather than misses: a
    destination's width comes from the opcode (.64 two registers, .128 four, an HGMMA.64xNx16
    its N/2 accumulators, an HMMA.16816.F32 four)."""
    base, op = ins.base, ins.op
    if base in NO_REGISTER_DEST or base.endswith("SETP") or base.startswith("U"):
        return set()
    ops = operands(ins)
    if base in ("SHFL", "LOP3", "PLOP3", "VOTE", "IADD3", "LEA", "IMAD") and ops and not REGISTER.match(ops[0]):
        ops = [o for o in ops if not re.fullmatch(r"!?U?P[T0-6]", o)]  # predicate outputs first
    m = REGISTER.match(ops[0]) if ops else None
    if not m:
        return set()
    first = int(m.group(1))
    if base == "HGMMA":
        shape = HGMMA_SHAPE.match(op)
        width = int(shape.group(1)) // 2 if shape else 64
    elif base == "HMMA":
        width = 4 if ".F32" in op else 2
    elif base == "LDSM":
        width = 4 if op.endswith(".4") else 2 if op.endswith(".2") else 1
    elif ".128" in op:
        width = 4
    elif ".64" in op or ".WIDE" in op or (base.startswith("D") and base not in ("DEPBAR",)) or ".F64" in op:
        width = 2
    else:
        width = 1
    return set(range(first, first + width))


def register_a_operand(ins):
    """The 4 registers of an HGMMA's A operand when it comes from registers (RS), else None."""
    if ins.base != "HGMMA":
        return None
    ops = operands(ins)
    m = REGISTER.match(ops[1]) if len(ops) > 1 else None
    return set(range(int(m.group(1)), int(m.group(1)) + 4)) if m else None


def carried_a_operands(instrs, cfg=None):
    """[(HGMMA address, register, address of the loop's write)]: registers an HGMMA reads as its
    register A operand that hold, on some path from the loop's head, the value they had when
    the loop was entered (nothing in the loop wrote them yet), while the loop also writes them.
    On the next trip the product then multiplies whatever the loop wrote, not the operand held
    for the whole loop: what ptxas did to a Q kept in registers by forward_wgmma_kernel<64>
    (kernels/cuda/gated_attention.cu, wgmma_rows_times_rows_t). `cfg`: the (blocks, successors,
    loops) of basic_blocks and natural_loops when the caller has them already."""
    if cfg is None:
        blocks, succ = basic_blocks(instrs)
        cfg = (blocks, succ, natural_loops(succ))
    blocks, succ, loops = cfg
    defs = [defined_registers(ins) for ins in instrs]  # each instruction's writes, read once
    found = set()
    for header, body in loops.items():
        writes = {}  # register → first address in the body that writes it
        for b in sorted(body):
            s, e = blocks[b]
            for i in range(s, e):
                for r in defs[i]:
                    writes.setdefault(r, instrs[i].addr)
        for b in body:
            s, e = blocks[b]
            for i in range(s, e):
                regs = register_a_operand(instrs[i])
                if not regs:
                    continue
                for r in sorted(regs & set(writes)):
                    if _reaches_unwritten(defs, blocks, succ, header, body, b, i, r):
                        found.add((instrs[i].addr, r, writes[r]))
    return sorted(found)


def _reaches_unwritten(defs, blocks, succ, header, body, target_block, target_index, reg):
    """Whether some path from the loop head to instruction target_index (in target_block),
    within the loop and without taking its back edges, writes no `reg` before it (defs: the
    registers each instruction writes)."""
    seen, stack = set(), [header]
    while stack:
        b = stack.pop()
        if b in seen:
            continue
        seen.add(b)
        s, e = blocks[b]
        stop = target_index if b == target_block else e
        if any(reg in defs[i] for i in range(s, stop)):
            continue
        if b == target_block:
            return True
        stack.extend(n for n in succ[b] if n in body and n != header)
    return False


def demangle_short(name):
    """forward_kernel<128> from an Itanium-mangled name: the <length><identifier> piece that
    ends in "kernel" (the nearest length prefix; the digits before it may belong to a hash)."""
    m = re.search(r"kernel(?=ILi|E|$)", name)
    if not m:
        return name
    end = m.end()
    for j in range(m.start() - 1, 0, -1):
        if name[j].isalpha() or name[j] == "_":
            if name[:j].endswith(str(end - j)) and not name[j].isdigit():
                t = re.match(r"ILi(\d+)E", name[end:])
                return f"{name[j:end]}<{t.group(1)}>" if t else name[j:end]
    return name


def print_report(results, min_hmma, out):
    for r in results:
        loops = [l for l in r["loops"] if any(p["hmma"] >= min_hmma for p in l["paths"])]
        if min_hmma and not loops:
            continue
        print(f"{demangle_short(r['kernel'])}: {r.get('regs', '?')} registers, stack {r.get('stack', '?')} B, "
              f"local {r.get('local', '?')} B, {r['instructions']} instructions, {r['hmma']} HMMA", file=out)
        for c in r.get("carried_a_operands", []):
            print(f"  WRONG CODE? the HGMMA at {c['hgmma']} reads {c['register']} as held from before its loop, "
                  f"which the loop overwrites at {c['written_at']}", file=out)
        for l in loops:
            top = l["paths"][0]
            head = f"  loop at {l['address']} (depth {l['depth']}): "
            if not top["hmma"]:
                print(head + f"no HMMA, {top['fewest']}..{top['most']} instructions per iteration", file=out)
                continue
            # The iterations with the most HMMA: the one issuing the most cp.async (the steady
            # state, prefetching the next tile) and the one issuing the fewest (the last tile).
            same = [p for p in l["paths"] if p["hmma"] == top["hmma"]]
            shown = [same[0]] + ([same[-1]] if same[-1] is not same[0] else [])
            for p in shown:
                mix = ", ".join(f"{k} {v}" for k, v in list(p["mix"].items())[:10])
                print(head + f"{p['hmma']} HMMA + {p['ldgsts']} LDGSTS per iteration, {p['fewest']}..{p['most']} "
                      f"instructions ({p['per_hmma']} per HMMA on the shortest): {mix}", file=out)
                head = " " * len(head)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("objects", nargs="*", default=[], help="object files or fatbins with sm_90a SASS")
    src.add_argument("--sass", help="a saved `cuobjdump -sass` listing instead of objects")
    ap.add_argument("--cuobjdump", default="cuobjdump", help="the cuobjdump to run (default: from PATH)")
    ap.add_argument("--arch", default="sm_90a", help="the SASS to read when an object holds several (default sm_90a)")
    ap.add_argument("--kernel", default="", help="only kernels whose mangled name matches this regex")
    ap.add_argument("--min-hmma", type=int, default=1,
                    help="only loops with at least this many HMMA per iteration (0: every loop)")
    ap.add_argument("--json", help="also write the full analysis here")
    args = ap.parse_args()
    if not args.sass and not args.objects:
        ap.error("give object files or --sass")
    texts, res_texts = [], []
    try:
        if args.sass:
            with open(args.sass) as f:
                texts.append(f.read())
        for obj in args.objects:
            for flag, dest in (("-sass", texts), ("-res-usage", res_texts)):
                p = subprocess.run([args.cuobjdump, "-arch", args.arch, flag, obj], capture_output=True, text=True)
                if p.returncode != 0:
                    msg = (p.stderr.strip().splitlines() or ["failed"])[-1]
                    sys.exit(f"sass_report: {obj}: cuobjdump {flag}: {msg}")
                dest.append(p.stdout)
    except OSError as e:
        sys.exit(f"sass_report: {e.filename or args.cuobjdump}: {e.strerror}")
    funcs, res = {}, {}
    for t in texts:
        funcs.update(parse_functions(t))
    for t in res_texts:
        res.update(parse_resources(t))
    if not funcs:
        sys.exit(f"sass_report: {args.sass or ' '.join(args.objects)}: no SASS functions found")
    pattern = re.compile(args.kernel)
    results = [analyse(n, ins, res) for n, ins in sorted(funcs.items()) if pattern.search(n)]
    if not results:
        sys.exit(f"sass_report: no kernel matches --kernel {args.kernel!r}")
    print_report(results, args.min_hmma, sys.stdout)
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":
    main()
