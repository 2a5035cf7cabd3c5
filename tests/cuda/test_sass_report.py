#!/usr/bin/env python3
"""Tests of kernels/cuda/sass_report.py.

Without arguments: the parser and the loop/path counts on hand-written SASS listings whose
counts are worked out by hand below (exit 0 or 1).

With --object OBJ (the compiled gated_attention.cu): the attention kernels' tile loops, read
from the real sm_90a SASS, hold the mma.sync count their tile math implies, no register spills,
no global load in front of a tile but the prefetched row, and stay below the instruction
budget per HMMA they were tuned to, with no register spills in the innermost tile loop
(kernels/cuda/gated_attention.cu; docs/benchmarks.md).
No loop may overwrite a register that one of its HGMMA reads as an operand held from before the
loop (sass_report.carried_a_operands: wrong code that no emulator sees).
Exits 77 (skipped) when no cuobjdump is found (PATH, /usr/local/cuda/bin, --cuobjdump, --tools-dir).
"""
import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "kernels", "cuda"))
import sass_report  # noqa: E402

# A loop at 0x20 whose iteration either copies (0x40, 0x50) or branches over the copy, with an
# inner loop at 0x70..0x80 walked once; a self-loop at 0xc0. Counted by hand:
#   with the copy:    0x20 0x30 | 0x40 0x50 | 0x60 | 0x70 0x80 | 0x90 0xa0  = 9 instructions,
#                     HMMA at 0x20, 0x60, 0x90 → 3, LDGSTS 1
#   without:          0x20 0x30 | 0x60 | 0x70 0x80 | 0x90 0xa0             = 7 instructions,
#                     HMMA 3, LDGSTS 0
#   inner loop:       0x70 0x80 = 2 instructions, no HMMA; depth 1.
TOY = """
\tcode for sm_90a
\t\tFunction : _Z3toyv
\t.headerflags\t@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
        /*0010*/                   S2R R0, SR_TID.X ;                     /* 0x0000000000007919 */
        /*0020*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;  /* 0x0000000c0804723c */
        /*0030*/              @P0 BRA 0x60 ;                              /* 0x0000000000080947 */
        /*0040*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R6.64] ;
        /*0050*/                   IADD3 R2, R2, 0x10, RZ ;
        /*0060*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0070*/                   FADD R3, R3, 1 ;
        /*0080*/              @!P2 BRA 0x70 ;
        /*0090*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*00a0*/                   BRA.U !UP0, 0x20 ;
        /*00b0*/                   EXIT ;
        /*00c0*/                   BRA 0xc0;
"""
TOY_RES = """
Resource usage:
 Common:
  GLOBAL:0
 Function _Z3toyv:
  REG:40 STACK:8 SHARED:0 LOCAL:16 CONSTANT[0]:896 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def check(cond, what, failures):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def fixture_tests():
    failures = []
    funcs = sass_report.parse_functions(TOY)
    check(list(funcs) == ["_Z3toyv"], f"one function parsed, got {list(funcs)}", failures)
    ins = funcs.get("_Z3toyv", [])
    check(len(ins) == 13, f"13 instructions, got {len(ins)}", failures)
    check(ins[3].pred == "@P0" and ins[3].conditional(), "@P0 BRA is conditional", failures)
    check(ins[10].conditional(), "BRA.U !UP0 is conditional", failures)
    check(not ins[12].conditional(), "BRA 0xc0 is not", failures)
    res = sass_report.parse_resources(TOY_RES)
    check(res == {"_Z3toyv": {"regs": 40, "stack": 8, "shared": 0, "local": 16}}, f"resources {res}", failures)

    r = sass_report.analyse("_Z3toyv", ins, res)
    loops = {l["address"]: l for l in r["loops"]}
    check(set(loops) == {"0x20", "0x70", "0xc0"}, f"loops at 0x20, 0x70, 0xc0, got {sorted(loops)}", failures)
    if "0x20" in loops:
        paths = {(p["hmma"], p["ldgsts"]): (p["fewest"], p["most"]) for p in loops["0x20"]["paths"]}
        check(paths == {(3, 1): (9, 9), (3, 0): (7, 7)}, f"outer loop paths {paths}", failures)
        check(loops["0x20"]["depth"] == 0, "outer loop depth 0", failures)
        top = loops["0x20"]["paths"][0]
        check(top["per_hmma"] == 3.0 and top["mix"].get("LDGSTS") == 1,
              f"steady path per HMMA and mix {top}", failures)
    if "0x70" in loops:
        l = loops["0x70"]
        check(l["depth"] == 1 and [(p["hmma"], p["fewest"]) for p in l["paths"]] == [(0, 2)],
              f"inner loop {l}", failures)
    check(r["hmma"] == 3 and r["regs"] == 40 and r["local"] == 16, f"totals {r}", failures)
    # A warpgroup product counts as its m16n8k16 share per warp (N/8 for HGMMA.64xNx16).
    hg = sass_report.parse_functions(
        "\t\tFunction : _Z2hgv\n"
        "        /*0000*/                   HGMMA.64x128x16.F32.BF16 R24, R120, gdesc[UR8].tnspB, R24 ;\n"
        "        /*0010*/                   HGMMA.64x64x16.F32.BF16 R88, gdesc[UR8], R88, gsb0 ;\n"
        "        /*0020*/                   EXIT ;\n")
    units = [sass_report.tensor_units(i) for i in hg.get("_Z2hgv", [])]
    check(units == [16, 8, 0], f"HGMMA units {units}, want [16, 8, 0]", failures)
    # A loop whose warpgroup product reads R100..R103 as its register A operand. Held: loaded
    # before the loop (0x10) and overwritten after the product (0x40), as ptxas 13.0 compiled
    # forward_wgmma_kernel<64> (every trip after the first multiplied what 0x40 wrote): found.
    # Computed per trip before the product (0x20): not. Never written in the loop: not.
    def carried(listing):
        f = sass_report.parse_functions("\t\tFunction : _Z4loopv\n" + listing)
        return sass_report.carried_a_operands(f["_Z4loopv"])
    head = ("        /*0000*/                   S2R R0, SR_TID.X ;\n"
            "        /*0010*/                   LDS.128 R100, [R0] ;\n")
    product = "        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, R100, gdesc[UR8], R24, gsb0 ;\n"
    tail = ("        /*0050*/              @P0 BRA 0x20 ;\n"
            "        /*0060*/                   EXIT ;\n")
    nop = "        /*0020*/                   NOP ;\n"
    clobber = "        /*0040*/                   F2FP.BF16.F32.PACK_AB R101, R25, R24 ;\n"
    found = carried(head + nop + product + clobber + tail)
    check(found == [(0x30, 101, 0x40)], f"a held A operand the loop overwrites: {found}", failures)
    per_trip = "        /*0020*/                   LDS.128 R100, [R0+0x10] ;\n"
    found = carried(head + per_trip + product + clobber + tail)
    check(found == [], f"an A operand loaded on every trip: {found}", failures)
    found = carried(head + nop + product + "        /*0040*/                   FADD R26, R25, R24 ;\n" + tail)
    check(found == [], f"a held A operand nothing overwrites: {found}", failures)
    check(sass_report.defined_registers(sass_report.parse_functions(
        "\t\tFunction : _Z1fv\n        /*0000*/                   SHFL.BFLY PT, R3, R20, 0x1, 0x1f ;\n")["_Z1fv"][0])
          == {3}, "SHFL's register destination follows its predicate", failures)
    for mangled, short in (
            ("_ZN6retain4cuda51_GLOBAL__N__89fe8727_18_gated_attention_cu_c214ada59dq_kernelILi128EEEvNS1_6ParamsE",
             "dq_kernel<128>"),
            ("_ZN6retain4cuda51_GLOBAL__N__89fe8727_18_gated_attention_cu_c214ada514forward_kernelILi64EEEvNS1_6ParamsE",
             "forward_kernel<64>"),
            ("_ZN6retain4cuda51_GLOBAL__N__89fe8727_18_gated_attention_cu_c214ada512delta_kernelEPK13__nv_bfloat16S4_Pfli",
             "delta_kernel"),
            ("_Z3toyv", "_Z3toyv")):
        check(sass_report.demangle_short(mangled) == short,
              f"{mangled} → {sass_report.demangle_short(mangled)}, not {short}", failures)
    return failures


def find_cuobjdump(given, tools_dir):
    extra = [os.path.join(tools_dir, "cuobjdump")] if tools_dir else []
    for c in ([given] if given else []) + ["cuobjdump", "/usr/local/cuda/bin/cuobjdump"] + extra:
        path = shutil.which(c) or (c if os.access(c, os.X_OK) else None)
        if path:
            return path
    return None


# The kernels' tile loops: HMMA per iteration from the tile math (64-row tiles, 4 warps of 16
# rows, m16n8k16: a 16 × 64 × d product is 8 n-tiles × d/16 k-steps), and the instruction
# budget per HMMA on the steady-state unmasked path (the fewest instructions over the paths
# that issue every copy): the values measured when these kernels were tuned (nvcc 13.0),
# plus 15 % for other compiler versions (before tuning, forward<128> issued ≥ 10 per HMMA).
KERNELS = {
    # kernel: (HMMA per iteration of its innermost tile loop, budget per HMMA)
    "forward_kernelILi128": (2 * 8 * 8, 4.91),        # S = Q·Kᵀ, O += P·V
    "forward_kernelILi64": (2 * 8 * 4, 8.11),
    "dq_kernelILi128": (3 * 8 * 8, 3.74),             # Q·Kᵀ, dO·Vᵀ, dS·K
    "dq_kernelILi64": (3 * 8 * 4, 5.76),
    "dkdv_kernelILi128": (4 * 2 * 8, 3.44),           # per 16-query sub-tile: 4 products
    "dkdv_kernelILi64": (4 * 4 * 4, 4.55),            # per 32-query sub-tile
    # The wgmma kernels: the same products as HGMMA.64xNx16 (N/8 HMMA each per warp),
    # descriptors built once per tile, dk/dv on whole 64-query tiles; forward and dq read Q (and
    # dO) from shared memory since 2026-11-28 (nvcc 13.0; held in registers they issued 4 to 10 %
    # fewer instructions, and at d = 64 ptxas gave those registers away: carried_a_operands).
    "forward_wgmma_kernelILi128": (2 * 8 * 8, 3.52),
    "forward_wgmma_kernelILi64": (2 * 8 * 4, 7.47),
    "dq_wgmma_kernelILi128": (3 * 8 * 8, 2.47),
    "dq_wgmma_kernelILi64": (3 * 8 * 4, 4.41),
    "dkdv_wgmma_kernelILi128": (4 * 8 * 8, 2.25),
    "dkdv_wgmma_kernelILi64": (4 * 8 * 4, 4.13),
}

# Local-memory accesses (LDL + STL) allowed per iteration of a kernel's innermost tile loop
# (0 for every kernel not named). dkdv_wgmma<128> keeps dk, dv (128 fp32 registers), Sᵀ and
# dPᵀ (64) at ptxas' 255-register cap, which moves the two fp64 dlogβ sums (one load and one
# store each per tile) and one loop-invariant pointer (one load) to the stack: 5 accesses to
# L1-resident memory per 256 HMMA. A variant keeping the dlogβ sums in shared memory spilled
# other invariants instead (4 loads) and issued more instructions; FlashAttention-3's backward
# holds the same 192 accumulators per thread.
SPILLS_ALLOWED = {"dkdv_wgmma_kernelILi128": 5}


def object_tests(obj, cuobjdump):
    import subprocess
    failures = []
    texts = {}
    env = dict(os.environ, PATH=os.path.dirname(cuobjdump) + os.pathsep + os.environ.get("PATH", ""))  # its nvdisasm
    for flag in ("-sass", "-res-usage"):
        p = subprocess.run([cuobjdump, "-arch", "sm_90a", flag, obj], capture_output=True, text=True, env=env)
        if p.returncode != 0:
            return [f"cuobjdump {flag} {obj}: {p.stderr.strip()}"]
        texts[flag] = p.stdout
    funcs = sass_report.parse_functions(texts["-sass"])
    res = sass_report.parse_resources(texts["-res-usage"])
    for key, (hmma, budget) in KERNELS.items():
        names = [n for n in funcs if key in n]
        if len(names) != 1:
            failures.append(f"{key}: {len(names)} kernels match")
            continue
        r = sass_report.analyse(names[0], funcs[names[0]], res)
        check(not r["carried_a_operands"], f"{key}: a loop overwrites a register its HGMMA reads as held from "
              f"before the loop (wrong code, as ptxas 13.0 made of a Q held in registers): {r['carried_a_operands']}",
              failures)
        check(r.get("local") == 0, f"{key}: no local memory ({r.get('local')} B)", failures)
        tile_loops = [l for l in r["loops"] if l["paths"] and l["paths"][0]["hmma"]]
        innermost = max(tile_loops, key=lambda l: l["depth"]) if tile_loops else None
        if innermost is None:
            failures.append(f"{key}: no loop with HMMA")
            continue
        top = innermost["paths"][0]
        spills = sum(top["mix"].get(op, 0) for op in ("LDL", "STL"))
        allowed = SPILLS_ALLOWED.get(key, 0)
        check(spills <= allowed, f"{key}: {spills} register spill loads/stores in the innermost tile loop "
              f"(allowed {allowed})", failures)
        check(top["hmma"] == hmma, f"{key}: {top['hmma']} HMMA per iteration, the tile math gives {hmma}", failures)
        outer = min(tile_loops, key=lambda l: l["depth"])
        steady = outer["paths"][0]
        check(steady["ldgsts"] > 0, f"{key}: the tile loop's steady state issues the next tile's copies", failures)
        check(steady["mix"].get("LDG", 0) <= 3,
              f"{key}: {steady['mix'].get('LDG', 0)} global loads per tile (the prefetched row is ≤ 3)", failures)
        per_hmma = innermost["paths"][0]["per_hmma"] if innermost is not outer else steady["per_hmma"]
        check(per_hmma <= budget * 1.15, f"{key}: {per_hmma} instructions per HMMA, budget {budget} + 15 %",
              failures)
        print(f"{key}: {top['hmma']} HMMA per iteration, {per_hmma} instructions per HMMA (budget {budget}), "
              f"{r['regs']} registers, stack {r['stack']} B")
    return failures


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--object", help="gated_attention.cu's object file (sm_90a SASS)")
    ap.add_argument("--cuobjdump", help="the cuobjdump to use")
    ap.add_argument("--tools-dir", help="where launch/cuda-tools.sh puts cuobjdump and nvdisasm (BUILD_DIR/tools)")
    args = ap.parse_args()
    if args.object:
        cuobjdump = find_cuobjdump(args.cuobjdump, args.tools_dir)
        if not cuobjdump:
            print("skipped: no cuobjdump (PATH, /usr/local/cuda/bin, --tools-dir); launch/cuda-tools.sh fetches one")
            sys.exit(77)
        failures = object_tests(args.object, cuobjdump)
    else:
        failures = fixture_tests()
    print(f"{len(failures)} failures" if failures else "all passed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
