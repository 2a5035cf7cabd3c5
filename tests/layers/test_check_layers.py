#!/usr/bin/env python3
"""check_layers.py on the repository (no include runs upward, every main() in a tools/ folder)
and on scratch trees where it must object: an include one floor up, a main() outside tools/.

usage: test_check_layers.py REPO_ROOT
"""
import os
import subprocess
import sys
import tempfile

REPO = os.path.abspath(sys.argv[1])
CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "check_layers.py")


def run(root):
    p = subprocess.run([sys.executable, CHECK, root], capture_output=True, text=True)
    return p.returncode, p.stdout


def scratch(files):
    d = tempfile.mkdtemp()
    for rel, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
        with open(os.path.join(d, rel), "w") as f:
            f.write(text)
    return d


fails = 0


def check(what, ok):
    global fails
    print(("ok: " if ok else "FAILED: ") + what)
    fails += not ok


rc, out = run(REPO)
check("the repository: every include runs downward\n" + out, rc == 0)
rc, out = run(scratch({"kernels/a.h": '#include "kernels/b.h"\n', "model/m.cpp": '#include "kernels/a.h"\n#include "data/d.h"\n'}))
check("downward and same-layer includes pass", rc == 0)
rc, out = run(scratch({"data/x.cpp": '#include <vector>\n\n#include "model/config.h"\n'}))
check("data/ including model/ is named with its line", rc == 1 and "data/x.cpp:3: includes model/, a layer above data/" in out)
rc, out = run(scratch({"checkpoints/c.h": '#  include "trainer/dist/comm.h"\n'}))
check("checkpoints/ including trainer/ is named", rc == 1 and "checkpoints/c.h:1: includes trainer/" in out)
rc, out = run(scratch({"model/run.cpp": "int main(int argc, char** argv) { return 0; }\n",
                       "model/tools/ok.cpp": "int main() { return 0; }\n"}))
check("a main() outside tools/ is named, one inside is not",
      rc == 1 and "model/run.cpp: a main() outside" in out and "ok.cpp" not in out)
print("test_check_layers: all checks passed" if fails == 0 else f"test_check_layers: {fails} failed")
sys.exit(1 if fails else 0)
