#!/usr/bin/env python3
"""Optional live cross-check of the student (retention-gated) forward against float64 torch.

Random tiny Qwen3 models (`retain-make-tiny`: 1-3 layers, GQA 1/2/4, head_dim 16/32, YaRN or
not, tied or not) get random retention gates of both kinds: mostly written here in Python
with the DESIGN §4 names (weights N(0, (1.5/√fan_in)²), logit biases U(0, 3) so the decay
matters, a dbtrimkv shared tensor under every layer's name, stored as F32, BF16 or F16),
sometimes made by `retain-make-tiny --gates` (training init, random bias). Random
document-masked inputs (several documents of random lengths, sometimes padding runs, doc id
−1) go through `retain-forward --gates`, and its logits are compared on every non-padding
row with the float64 reference of tests/fixtures/gates/make_fixtures.py (transformers'
Qwen3ForCausalLM in float64, gates in float64 torch, a custom gated attention; each document
run on its own), imported from that script: ‖retain − ref‖ / ‖ref‖ ≤ 1e-4. The teacher
(`retain-forward` without --gates) is compared with the reference's teacher the same way,
which proves the reference wiring on the same inputs; padding rows must be finite.

Needs torch, transformers and safetensors; without them it prints what is missing and
exits 77, which CTest reports as skipped. Exit 0: all cases match; exit 1: a mismatch
(printed with the options and the seed that reproduce it).
"""

import argparse
import importlib.util
import os
import random
import shutil
import sys
import tempfile
import time

from live_common import import_or_skip, quiet_transformers, run_tool, tools_present

REL_TOL = 1e-4
HERE = os.path.dirname(os.path.abspath(__file__))
REFERENCE_SCRIPT = os.path.join(os.path.dirname(HERE), "fixtures", "gates", "make_fixtures.py")


def load_reference():
    """The float64 reference of the committed gate fixtures, imported from its script."""
    spec = importlib.util.spec_from_file_location("retain_gate_fixture_reference", REFERENCE_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def draw_options(rng):
    kv = rng.choice([1, 2, 4])
    return {
        "layers": rng.randint(1, 3),
        "hidden": rng.choice([32, 48, 64]),
        "kv-heads": kv,
        "heads": kv * rng.choice([1, 2, 4]),
        "head-dim": rng.choice([16, 32]),
        "intermediate": rng.randint(16, 128),
        "vocab": rng.randint(259, 500),
        "tie": rng.random() < 0.5,
        "yarn-factor": rng.choice([0, 0, 2, 4]),
        "seed": rng.randrange(2**31),
    }


def draw_gates(rng):
    return {
        "kind": rng.choice(["trimkv", "dbtrimkv"]),
        "G": rng.choice([4, 8, 16, 24]),
        # 1 in 4 from retain-make-tiny --gates (training init, logit bias U(0, 3)).
        "source": "make-tiny" if rng.random() < 0.25 else "python",
        "dtype": rng.choice(["F32", "F32", "BF16", "F16"]),
        "bias-init": round(rng.uniform(0.0, 3.0), 3),
        "seed": rng.randrange(2**31),
        "pass-kind": rng.random() < 0.5,  # also pass --gate-kind (the right one)
    }


def draw_segments(rng, max_doc_len):
    """Runs of (label, length): 1-4 documents with distinct labels, sometimes padding runs
    (label −1) before, between and after them. Long documents now and then, so that the
    op's full 64×64 tiles and its tile skipping are exercised too."""
    n = rng.randint(1, 4)
    labels = rng.sample(range(1000), n)
    segments = []
    for label in labels:
        if rng.random() < 0.2:
            segments.append((-1, rng.randint(1, 5)))
        length = rng.randint(1, max_doc_len) if rng.random() < 0.2 else rng.randint(1, 40)
        segments.append((label, length))
    if rng.random() < 0.2:
        segments.append((-1, rng.randint(1, 5)))
    return segments


def make_tiny_args(bin_dir, out, o, g):
    args = [os.path.join(bin_dir, "retain-make-tiny"), "--out", out]
    for k in ("layers", "hidden", "heads", "kv-heads", "head-dim", "intermediate", "vocab", "yarn-factor", "seed"):
        args += [f"--{k}", str(o[k])]
    args.append("--tie" if o["tie"] else "--no-tie")
    if g["source"] == "make-tiny":
        args += ["--gates", g["kind"], "--gate-hidden", str(g["G"]), "--bias-init", str(g["bias-init"])]
    return args


def write_python_gates(ref, path, g, L, D, K):
    """Random gates with the DESIGN names (ref.random_gates), stored in g's dtype."""
    import torch
    from safetensors.torch import save_file

    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    gen = torch.Generator().manual_seed(g["seed"])
    tensors = ref.random_gates(g["kind"], L, D, g["G"], K, gen)
    stored = {k: v.to(dtypes[g["dtype"]]).contiguous() for k, v in tensors.items()}
    meta = {"format": "pt", "gate_kind": g["kind"], "gate_hidden": str(g["G"]), "num_hidden_layers": str(L),
            "num_key_value_heads": str(K), "hidden_size": str(D), "producer": "tests/live/student_crosscheck.py"}
    save_file(stored, path, metadata=meta)


def rel(a, b):
    den = b.norm().item()
    return (a - b).norm().item() / den if den > 0 else (a - b).norm().item()


def check_case(k, rng, ref, bin_dir, work, max_doc_len):
    import torch
    from safetensors.torch import load_file

    o, g = draw_options(rng), draw_gates(rng)
    segments = draw_segments(rng, max_doc_len)
    model_dir = os.path.join(work, f"case{k}")
    make_cmd = make_tiny_args(bin_dir, model_dir, o, g)
    run_tool(make_cmd)
    L, D, K = o["layers"], o["hidden"], o["kv-heads"]
    gates_path = os.path.join(model_dir, "gates.safetensors")
    if g["source"] == "python":
        write_python_gates(ref, gates_path, g, L, D, K)
    # The reference reads the file back: it uses the stored (possibly rounded) values.
    P = {name: v.to(torch.float64) for name, v in load_file(gates_path).items()}
    if g["kind"] == "dbtrimkv":  # the shared tensors really are shared in the file
        for l in range(1, L):
            for s in ("linear3.weight", "bias"):
                assert torch.equal(P[ref.name(l, s)], P[ref.name(0, s)]), (l, s)

    ids, doc_ids = [], []
    for label, n in segments:
        ids += [rng.randrange(o["vocab"]) for _ in range(n)]
        doc_ids += [label] * n
    T = len(ids)
    keep = [t for t in range(T) if doc_ids[t] >= 0]
    doc_lens = [n for label, n in segments if label >= 0]

    student_model = ref.Student(model_dir)
    kept_ids = torch.tensor([ids[t] for t in keep], dtype=torch.long)
    want = student_model.logits(kept_ids, doc_lens, (g["kind"], P))
    want_teacher = student_model.logits(kept_ids, doc_lens, None)

    pass_doc_ids = len(segments) > 1 or rng.random() < 0.5  # one document: sometimes the default
    base = [os.path.join(bin_dir, "retain-forward"), "--model", model_dir, "--ids", " ".join(map(str, ids))]
    if pass_doc_ids:
        base += ["--doc-ids", " ".join(map(str, doc_ids))]
    out_s, out_t = os.path.join(work, f"case{k}.student.safetensors"), os.path.join(work, f"case{k}.teacher.safetensors")
    fwd_cmd = base + ["--out", out_s, "--gates", gates_path] + (["--gate-kind", g["kind"]] if g["pass-kind"] else [])
    run_tool(fwd_cmd)
    run_tool(base + ["--out", out_t])

    desc = (f"L={L} D={D} heads={o['heads']}/{K}kv head_dim={o['head-dim']} {'tied' if o['tie'] else 'untied'} "
            f"yarn={o['yarn-factor']} | {g['kind']} G={g['G']} "
            f"{'make-tiny bias ' + str(g['bias-init']) if g['source'] == 'make-tiny' else 'python ' + g['dtype']} | "
            f"T={T} runs={[n if label >= 0 else f'pad{n}' for label, n in segments]}")
    results = {}
    for what, path, ref_logits in (("student", out_s, want), ("teacher", out_t, want_teacher)):
        got_all = load_file(path).get("logits")
        if got_all is None or got_all.dtype != torch.float32 or tuple(got_all.shape) != (T, o["vocab"]):
            shape = "none" if got_all is None else f"{got_all.dtype} {tuple(got_all.shape)}"
            print(f"case {k}: {desc}: MISMATCH: {what} logits {shape}, want float32 {(T, o['vocab'])}", flush=True)
            return None
        if not torch.isfinite(got_all).all():
            print(f"case {k}: {desc}: MISMATCH: non-finite {what} logits (padding rows included)", flush=True)
            return None
        got = got_all.double()[keep]
        results[what] = (rel(got, ref_logits), got)
    err, err_t = results["student"][0], results["teacher"][0]
    # Every document on its own too: a wrong mask or position in one short document must not
    # hide in the norm of the others.
    got, start, doc_errs = results["student"][1], 0, []
    for n in doc_lens:
        doc_errs.append(rel(got[start:start + n], want[start:start + n]))
        start += n
    effect = rel(want, want_teacher)
    ok = err <= REL_TOL and err_t <= REL_TOL and max(doc_errs) <= REL_TOL
    print(f"case {k}: {desc}: student rel {err:.2e} (worst document {max(doc_errs):.2e}), teacher rel {err_t:.2e}, "
          f"gating effect {effect:.3f} "
          f"{'ok' if ok else 'MISMATCH'}", flush=True)
    if not ok:
        for d, (n, e) in enumerate(zip(doc_lens, doc_errs)):
            print(f"  document {d} ({n} tokens): student rel {e:.2e}")
        print(f"  reproduce: {' '.join(make_cmd)}")
        if g["source"] == "python":
            print(f"             gates: random_gates({g['kind']!r}, {L}, {D}, {g['G']}, {K}, "
                  f"torch.Generator().manual_seed({g['seed']})) stored as {g['dtype']}")
        print(f"             {' '.join(repr(a) if ' ' in a else a for a in fwd_cmd)}", flush=True)
    return max(err, *doc_errs), err_t, effect, ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", required=True, help="directory with retain-make-tiny and retain-forward")
    ap.add_argument("--cases", type=int, default=6, help="random cases (default 6)")
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: from the current time)")
    ap.add_argument("--max-doc-len", type=int, default=200, help="longest document drawn (default 200)")
    ap.add_argument("--work", default=None, help="working directory, kept (default: a temporary one, removed)")
    a = ap.parse_args()

    start = time.monotonic()
    import_or_skip("student_crosscheck", ("torch", "transformers", "safetensors"))
    torch, transformers = quiet_transformers()
    torch.set_num_threads(1)
    ref = load_reference()

    if not tools_present("student_crosscheck", a.bin_dir, ("retain-make-tiny", "retain-forward")):
        return 1

    seed = a.seed if a.seed is not None else time.time_ns() % 1_000_000_007
    print(f"student_crosscheck: seed {seed} (reproduce with --seed {seed}); torch {torch.__version__}, "
          f"transformers {transformers.__version__}; tolerance ||retain - ref|| / ||ref|| <= {REL_TOL:g}", flush=True)
    rng = random.Random(seed)
    work = a.work or tempfile.mkdtemp(prefix="retain_student_crosscheck.")
    os.makedirs(work, exist_ok=True)
    failures, worst, worst_t, effects = 0, 0.0, 0.0, []
    try:
        for k in range(a.cases):
            try:
                r = check_case(k, rng, ref, a.bin_dir, work, a.max_doc_len)
            except Exception as e:  # a tool or transformers failure is a mismatch too
                print(f"case {k}: MISMATCH: {type(e).__name__}: {e}", flush=True)
                r = None
            if r is None or not r[3]:
                failures += 1
            if r is not None:
                worst, worst_t = max(worst, r[0]), max(worst_t, r[1])
                effects.append(r[2])
    finally:
        if a.work is None:
            shutil.rmtree(work, ignore_errors=True)

    took = time.monotonic() - start
    # The check can fail only if gating changes the logits: most cases must show it.
    moved = sum(e > 0.01 for e in effects)
    summary = (f"max student rel {worst:.2e} (per document or overall), max teacher rel {worst_t:.2e}; gating moved the logits by > 1 % "
               f"in {moved} of {len(effects)} case(s)")
    if effects and moved * 2 < len(effects):
        print(f"student_crosscheck: FAILED: gating barely matters, the check proves little ({summary})", flush=True)
        return 1
    if failures:
        print(f"student_crosscheck: FAILED ({failures} of {a.cases} case(s)) in {took:.1f} s; {summary}; seed {seed}",
              flush=True)
        return 1
    print(f"student_crosscheck: all {a.cases} case(s) match in {took:.1f} s; {summary}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
