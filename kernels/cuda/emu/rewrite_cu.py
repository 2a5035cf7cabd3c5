#!/usr/bin/env python3
"""Rewrites a .cu file into C++ the host compiler reads, for the CUDA emulator
(kernels/cuda/emu/README.md). Only what C++ cannot parse changes; every line keeps its number
(a #line directive names the original file, so compiler messages point at the .cu):

  kernel<<<grid, block[, smem[, stream]]>>>(args)
      -> ::retain::cuda_emu::launch(kernel, "kernel", ::retain::cuda_emu::LaunchConfig(grid, block[, ...]), args)
  extern __shared__ [__align__(n)] T name[];
      -> T* name = static_cast<T*>(::retain::cuda_emu::dynamic_shared());
  #include <cub/...>
      -> #include "kernels/cuda/emu/cub.h"

Usage: rewrite_cu.py IN.cu OUT.cpp
"""
import os
import re
import sys


def code_mask(src):
    """True for each character outside comments, string and character literals."""
    mask = [True] * len(src)
    i, n = 0, len(src)
    while i < n:
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif src[i] in "\"'":
            q, j = src[i], i + 1
            while j < n and src[j] != q:
                j += 2 if src[j] == "\\" else 1
            j += 1
        else:
            i += 1
            continue
        for k in range(i, min(j, n)):
            mask[k] = False
        i = j
    return mask


def callee_start(src, end):
    """Start of the kernel expression ending at `end` (an identifier, maybe qualified, maybe
    with template arguments)."""
    i = end
    while True:
        while i > 0 and src[i - 1].isspace():
            i -= 1
        if i > 0 and src[i - 1] == ">":  # template arguments: back to the matching '<'
            depth, i = 0, i - 1
            while i >= 0:
                if src[i] == ">":
                    depth += 1
                elif src[i] == "<":
                    depth -= 1
                    if depth == 0:
                        break
                i -= 1
        while i > 0 and (src[i - 1].isalnum() or src[i - 1] == "_"):
            i -= 1
        if i > 1 and src[i - 2 : i] == "::":
            i -= 2
            continue
        return i


def balanced(src, start, open_ch, close_ch):
    """Index just past the bracket closing the one at `start`."""
    depth = 0
    for i in range(start, len(src)):
        if src[i] == open_ch:
            depth += 1
        elif src[i] == close_ch:
            depth -= 1
            if depth == 0:
                return i + 1
    raise SystemExit(f"rewrite_cu.py: unbalanced {open_ch}{close_ch} from offset {start}")


def rewrite_launches(src, path):
    mask = code_mask(src)
    out, pos = [], 0
    for m in re.finditer(r"<<<", src):
        s = m.start()
        if not mask[s] or s < pos:
            continue
        begin = callee_start(src, s)
        callee = src[begin:s].strip()
        if not callee:
            raise SystemExit(f"{path}: a <<< launch without a kernel name at offset {s}")
        cfg_end = src.find(">>>", s + 3)
        config = src[s + 3 : cfg_end]
        p = cfg_end + 3
        while src[p].isspace():
            p += 1
        if src[p] != "(":
            raise SystemExit(f"{path}: a <<< launch of {callee} without arguments")
        args_end = balanced(src, p, "(", ")")
        args = src[p + 1 : args_end - 1]
        name = " ".join(callee.split())
        call = (f'::retain::cuda_emu::launch({callee}, "{name}", ::retain::cuda_emu::LaunchConfig({config})'
                + (f", {args})" if args.strip() else ")"))
        out.append(src[pos:begin])
        out.append(call)
        pos = args_end
    out.append(src[pos:])
    return "".join(out)


EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\s*\d+\s*\)\s+)?([A-Za-z_][\w:\s]*?)\s+(\w+)\s*\[\s*\]\s*;")
CUB_INCLUDE = re.compile(r"#include\s*<cub/[^>]*>")


def main():
    if len(sys.argv) != 3:
        raise SystemExit("usage: rewrite_cu.py IN.cu OUT.cpp")
    src_path, out_path = sys.argv[1], sys.argv[2]
    with open(src_path, encoding="utf-8") as f:
        src = f.read()
    src = rewrite_launches(src, src_path)
    src = EXTERN_SHARED.sub(
        lambda m: f"{m.group(1)}* {m.group(2)} = static_cast<{m.group(1)}*>(::retain::cuda_emu::dynamic_shared());", src)
    src = CUB_INCLUDE.sub('#include "kernels/cuda/emu/cub.h"', src)
    text = f'#line 1 "{src_path}"\n' + src
    tmp = out_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, out_path)


if __name__ == "__main__":
    main()
