#!/usr/bin/env python3
"""The house's floors (DESIGN §2, docs/architecture.md): kernels → data → model → checkpoints →
trainer, bottom up. A C++/CUDA file includes headers of its own layer and the layers below, never
one above; a program's main() sits in its layer's tools/ folder. Prints every violation as
"FILE:LINE: ..." and exits 1 when there is one.

usage: check_layers.py REPO_ROOT
"""
import os
import re
import sys

LAYERS = ["kernels", "data", "model", "checkpoints", "trainer"]
SOURCES = (".h", ".hpp", ".cpp", ".cu", ".cuh")
INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"/]+)/[^"]*"', re.M)
MAIN = re.compile(r"^[ \t]*int[ \t]+main[ \t]*\(", re.M)


def violations(root):
    for layer in LAYERS:
        rank = LAYERS.index(layer)
        for dirpath, dirnames, files in os.walk(os.path.join(root, layer)):
            dirnames[:] = [d for d in dirnames if d not in ("python", "__pycache__")]
            for name in sorted(files):
                if not name.endswith(SOURCES):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root)
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
                for m in INCLUDE.finditer(text):
                    top = m.group(1)
                    if top in LAYERS and LAYERS.index(top) > rank:
                        line = text.count("\n", 0, m.start()) + 1
                        yield f"{rel}:{line}: includes {top}/, a layer above {layer}/"
                    elif top == "tests":
                        line = text.count("\n", 0, m.start()) + 1
                        yield f"{rel}:{line}: includes tests/ from {layer}/"
                if MAIN.search(text) and "tools" not in rel.split(os.sep)[:-1]:
                    yield f"{rel}: a main() outside {layer}/'s tools/ folders"


def main(argv):
    root = os.path.abspath(argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(__file__), "..", ".."))
    bad = list(violations(root))
    for b in bad:
        print(b)
    print(f"check_layers: {len(bad)} violation(s)" if bad else "check_layers: every include runs downward")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
