#!/usr/bin/env python3
"""Optional live cross-check of retain's tools against independent implementations.

Random tiny Qwen3 models made by `retain-make-tiny` are loaded with Hugging Face
transformers (which independently checks our config.json and safetensors writer) and
their logits are compared with those of `retain-forward`, including packed documents
(attention within each document, RoPE positions restarting per document). The made
tokenizer.json is checked with Hugging Face tokenizers against the GPT-2 byte-level
mapping written out below from its definition.

Needs torch, transformers, safetensors and tokenizers; without them it prints what is
missing and exits 77, which CTest reports as skipped. Exit 0: all checks passed;
exit 1: a mismatch (printed with the options and the seed that reproduce it).
"""

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
import unicodedata

from live_common import import_or_skip, quiet_transformers, run_tool, tools_present

REL_TOL = 1e-4


# --------------------------------------------------------------------------- tokenizer


def gpt2_byte_order():
    """GPT-2's bytes_to_unicode, as the list of (byte, code point) in vocabulary order.

    Printable bytes ('!'..'~', U+00A1..U+00AC, U+00AE..U+00FF) map to themselves and come
    first, in byte order; every other byte then gets 256, 257, ... in byte order.
    """
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) +
                 list(range(0xAE, 0xFF + 1)))
    order = [(b, b) for b in printable]
    n = 0
    for b in range(256):
        if b not in printable:
            order.append((b, 256 + n))
            n += 1
    return order


SPECIALS = {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258}

TOKENIZER_TEXTS = [
    "",
    "Hello, world! It's 2024 -- isn't it? (x+y)*3 = 42.",
    "héllo wörld",
    "日本語のテキスト 中文 한국어",
    "emoji 😀👍🏽 ok 🇫🇷",
    "line1\n\n   indented\t\ttabs   \r\n  trailing  \n\n\n",
    "\x00\x01\x1f\x7f control bytes",
    "<|endoftext|>",
    "before<|endoftext|>after",
    "<|im_start|>user\nhé 😀<|im_end|>\n<|im_start|>assistant\n<|endoftext|>",
    " <|endoftext|><|endoftext|> x<|im_start|>",
]


def expected_ids(text, byte_to_id):
    """Special tokens by id; everything else as UTF-8 bytes through the GPT-2 order."""
    ids = []
    i = 0
    while i < len(text):
        for s, sid in SPECIALS.items():
            if text.startswith(s, i):
                ids.append(sid)
                i += len(s)
                break
        else:
            ids.extend(byte_to_id[b] for b in text[i].encode("utf-8"))
            i += 1
    return ids


def check_tokenizer(model_dir):
    from tokenizers import Tokenizer

    failures = []
    path = os.path.join(model_dir, "tokenizer.json")
    tok = Tokenizer.from_file(path)
    order = gpt2_byte_order()
    byte_to_id = {b: i for i, (b, _) in enumerate(order)}

    # The vocabulary itself: 256 byte tokens in GPT-2 order, then the specials.
    if tok.get_vocab_size(with_added_tokens=True) != 259:
        failures.append(f"vocabulary size {tok.get_vocab_size(with_added_tokens=True)}, want 259")
    for i, (_, cp) in enumerate(order):
        if tok.id_to_token(i) != chr(cp):
            failures.append(f"id {i}: token {tok.id_to_token(i)!r}, want {chr(cp)!r}")
    for s, sid in SPECIALS.items():
        if tok.token_to_id(s) != sid:
            failures.append(f"special {s}: id {tok.token_to_id(s)}, want {sid}")

    for text in TOKENIZER_TEXTS:
        assert unicodedata.is_normalized("NFC", text), text  # the tokenizer normalizes to NFC
        got = tok.encode(text).ids
        want = expected_ids(text, byte_to_id)
        if got != want:
            at = next((k for k in range(min(len(got), len(want))) if got[k] != want[k]),
                      min(len(got), len(want)))
            failures.append(f"encode({text!r}): first difference at index {at}: "
                            f"got {got[at:at + 8]}, want {want[at:at + 8]} (lengths {len(got)}, {len(want)})")
        back = tok.decode(got, skip_special_tokens=False)
        if back != text:
            failures.append(f"decode(encode({text!r})) = {back!r}")
    status = "ok" if not failures else f"{len(failures)} FAILURE(S)"
    print(f"tokenizer: {len(TOKENIZER_TEXTS)} strings + vocabulary of {path}: {status}", flush=True)
    for f in failures[:20]:
        print(f"  tokenizer MISMATCH: {f}", flush=True)
    if len(failures) > 20:
        print(f"  ... and {len(failures) - 20} more", flush=True)
    return not failures


# --------------------------------------------------------------------------- logits


def draw_options(rng):
    kv = rng.choice([1, 2, 4])
    return {
        "layers": rng.randint(1, 3),
        "hidden": rng.choice([32, 48, 64, 96]),
        "kv-heads": kv,
        "heads": kv * rng.choice([1, 2, 4]),
        "head-dim": rng.choice([8, 16, 32]),
        "intermediate": rng.randint(16, 160),
        "vocab": rng.randint(259, 600),
        "tie": rng.random() < 0.5,
        "yarn-factor": rng.choice([0, 0, 2, 4]),
        "seed": rng.randrange(2**31),
    }


def make_tiny_args(bin_dir, out, o):
    args = [os.path.join(bin_dir, "retain-make-tiny"), "--out", out]
    for k in ("layers", "hidden", "heads", "kv-heads", "head-dim", "intermediate", "vocab", "yarn-factor", "seed"):
        args += [f"--{k}", str(o[k])]
    args.append("--tie" if o["tie"] else "--no-tie")
    return args


def draw_documents(rng, T):
    """Contiguous documents (1-4, never more than T) with distinct, unordered labels."""
    n = rng.randint(1, min(4, T))
    cuts = sorted(rng.sample(range(1, T), n - 1))
    bounds = list(zip([0] + cuts, cuts + [T]))
    labels = rng.sample(range(100), n)
    doc_ids = []
    for (a, b), label in zip(bounds, labels):
        doc_ids += [label] * (b - a)
    return bounds, doc_ids


def load_hf(model_dir):
    import torch
    import transformers
    from transformers import Qwen3ForCausalLM

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    # `dtype` replaced `torch_dtype` in transformers 4.56.
    kw = {"dtype": torch.float32} if (major, minor) >= (4, 56) else {"torch_dtype": torch.float32}
    model, info = Qwen3ForCausalLM.from_pretrained(model_dir, attn_implementation="eager",
                                                   output_loading_info=True, **kw)
    model = model.float().eval()  # BF16 -> F32 is exact, whatever dtype the load used
    problems = {k: v for k, v in info.items() if v}
    if problems:
        raise RuntimeError(f"transformers loaded {model_dir} with problems: {problems}")
    return model


def hf_rope_type(config):
    for attr in ("rope_parameters", "rope_scaling"):
        p = getattr(config, attr, None)
        if isinstance(p, dict) and (p.get("rope_type") or p.get("type")):
            return p.get("rope_type") or p.get("type")
    return "default"


def check_case(k, rng, bin_dir, work):
    import torch
    from safetensors.torch import load_file

    o = draw_options(rng)
    model_dir = os.path.join(work, f"case{k}")
    make_cmd = make_tiny_args(bin_dir, model_dir, o)
    run_tool(make_cmd)
    model = load_hf(model_dir)

    c = model.config
    want_cfg = {"num_hidden_layers": o["layers"], "hidden_size": o["hidden"], "num_attention_heads": o["heads"],
                "num_key_value_heads": o["kv-heads"], "head_dim": o["head-dim"],
                "intermediate_size": o["intermediate"], "vocab_size": o["vocab"], "tie_word_embeddings": o["tie"]}
    bad = {key: (getattr(c, key, None), v) for key, v in want_cfg.items() if getattr(c, key, None) != v}
    want_rope = "yarn" if o["yarn-factor"] > 1 else "default"
    if hf_rope_type(c) != want_rope:
        bad["rope type"] = (hf_rope_type(c), want_rope)
    if bad:
        raise RuntimeError(f"transformers reads config.json differently (got, want): {bad}")

    T = rng.randint(1, 48)
    ids = [rng.randrange(o["vocab"]) for _ in range(T)]
    bounds, doc_ids = draw_documents(rng, T)

    with torch.inference_mode():
        x = torch.tensor(ids, dtype=torch.long)[None]
        ref = torch.cat([model(input_ids=x[:, a:b]).logits[0] for a, b in bounds]).double()

    out = os.path.join(work, f"case{k}.logits.safetensors")
    fwd_cmd = [os.path.join(bin_dir, "retain-forward"), "--model", model_dir, "--ids", " ".join(map(str, ids)),
               "--out", out]
    if len(bounds) > 1:
        fwd_cmd += ["--doc-ids", " ".join(map(str, doc_ids))]
    run_tool(fwd_cmd)
    got_t = load_file(out).get("logits")

    desc = (f"layers={o['layers']} hidden={o['hidden']} heads={o['heads']}/{o['kv-heads']}kv "
            f"head_dim={o['head-dim']} inter={o['intermediate']} vocab={o['vocab']} "
            f"{'tied' if o['tie'] else 'untied'} yarn={o['yarn-factor']} T={T} docs={[b - a for a, b in bounds]}")
    if got_t is None or got_t.dtype != torch.float32 or tuple(got_t.shape) != (T, o["vocab"]):
        what = "no tensor `logits`" if got_t is None else f"logits {got_t.dtype} {tuple(got_t.shape)}"
        print(f"case {k}: {desc}: MISMATCH: {what}, want float32 {(T, o['vocab'])}", flush=True)
        return False
    got = got_t.double()
    if not torch.isfinite(got).all():
        print(f"case {k}: {desc}: MISMATCH: non-finite logits from retain-forward", flush=True)
        return False
    rel = ((got - ref).norm() / ref.norm()).item()
    ok = rel <= REL_TOL
    print(f"case {k}: {desc}: rel diff {rel:.2e} {'ok' if ok else 'MISMATCH'}", flush=True)
    if not ok:
        for d, (a, b) in enumerate(bounds):
            r = ((got[a:b] - ref[a:b]).norm() / ref[a:b].norm()).item()
            print(f"  document {d} (tokens {a}..{b - 1}, label {doc_ids[a]}): rel diff {r:.2e}")
        err = (got - ref).abs()
        t, v = divmod(int(err.argmax()), o["vocab"])
        print(f"  worst element: position {t} (position {t - max(a for a, _ in bounds if a <= t)} in its document), "
              f"vocab {v}: retain {got[t, v].item():.6f}, HF {ref[t, v].item():.6f}")
        per_pos = ((got - ref).norm(dim=1) / ref.norm(dim=1)).tolist()
        print("  rel diff per position: " + " ".join(f"{p:.1e}" for p in per_pos))
        print(f"  reproduce: {' '.join(make_cmd)}")
        print(f"             {' '.join(repr(a) if ' ' in a else a for a in fwd_cmd)}", flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", required=True, help="directory with retain-make-tiny and retain-forward")
    ap.add_argument("--cases", type=int, default=4, help="random models to compare (default 4)")
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: from the current time)")
    ap.add_argument("--work", default=None, help="working directory, kept (default: a temporary one, removed)")
    a = ap.parse_args()

    start = time.monotonic()
    import_or_skip("hf_crosscheck", ("torch", "transformers", "safetensors", "tokenizers"))
    torch, transformers = quiet_transformers()

    if not tools_present("hf_crosscheck", a.bin_dir, ("retain-make-tiny", "retain-forward")):
        return 1

    seed = a.seed if a.seed is not None else time.time_ns() % 1_000_000_007
    print(f"hf_crosscheck: seed {seed} (reproduce with --seed {seed}); torch {torch.__version__}, "
          f"transformers {transformers.__version__}; tolerance ||retain - HF|| / ||HF|| <= {REL_TOL:g}", flush=True)
    rng = random.Random(seed)

    work = a.work or tempfile.mkdtemp(prefix="retain_hf_crosscheck.")
    os.makedirs(work, exist_ok=True)
    failures = 0
    try:
        for k in range(a.cases):
            try:
                if not check_case(k, rng, a.bin_dir, work):
                    failures += 1
            except Exception as e:  # a tool or transformers failure is a mismatch too
                print(f"case {k}: MISMATCH: {type(e).__name__}: {e}", flush=True)
                failures += 1

        tok_dir = os.path.join(work, "case0") if a.cases > 0 else os.path.join(work, "tokenizer")
        try:
            if a.cases == 0 or not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
                tok_dir = os.path.join(work, "tokenizer")
                run_tool([os.path.join(a.bin_dir, "retain-make-tiny"), "--out", tok_dir, "--layers", "1"])
            if not check_tokenizer(tok_dir):
                failures += 1
        except Exception as e:
            print(f"tokenizer: MISMATCH: {type(e).__name__}: {e}", flush=True)
            failures += 1
    finally:
        if a.work is None:
            shutil.rmtree(work, ignore_errors=True)

    took = time.monotonic() - start
    if failures:
        print(f"hf_crosscheck: FAILED ({failures} check(s)) in {took:.1f} s; seed {seed}", flush=True)
        return 1
    print(f"hf_crosscheck: all {a.cases} model case(s) and the tokenizer match ({took:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
