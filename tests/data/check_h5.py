#!/usr/bin/env python3
"""Live check of retain-pack's output against docs/data-format.md, reading ONLY through h5py.

Packs a mixed corpus (JSON lines with text / messages / input_ids, a plain-text file, a gzip
file) with retain-pack (concat and bfd, input order and shuffled, --targets all and assistant)
and verifies every documented invariant: dtypes, shapes, chunking, filters, attributes, each
document's tokens once and in order under its doc id followed by the separator, contiguous doc
runs, padding values and accounting, bfd never splitting a document that fits, and the target
masks. The expected token ids come from Hugging Face `tokenizers` (an independent tokenizer);
assistant-only masks from its character offsets. Tokenizers: the tiny one (retain-make-tiny)
and, when present, Qwen3's (--qwen3-tokenizer). Exits 77 (skipped) without h5py or tokenizers.
"""
import argparse
import gzip
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile

try:
    import h5py
    import numpy as np
    from tokenizers import Tokenizer
except ImportError as e:  # CI without the Python packages
    print(f"check_h5: skipped ({e})")
    sys.exit(77)

FAILURES = []


def check(cond, what):
    if not cond:
        FAILURES.append(what)
        print("FAIL:", what)


def corpus(rng):
    """Records in input order: (kind, payload). Kinds: text, messages, ids (ids, mask), skip."""
    words = ["the", "retention", "gate", "ca\u0301fe\u0301", "na\u00efve", "\u4e2d\u6587", "\U0001F600",
             "def f(x):\n    return x*2", "  ", "\t", "1234", "KV-cache", "<|endoftext|>", "\n\n"]
    def text(n):
        return " ".join(rng.choice(words) for _ in range(n))
    a, b = [], []
    for i in range(60):
        k = i % 6
        if k in (0, 1):
            a.append(("text", text(rng.randint(1, 40))))
        elif k == 2:
            msgs = [{"role": "system", "content": text(3)}] if rng.random() < 0.5 else []
            for t in range(rng.randint(1, 3)):
                msgs.append({"role": "user", "content": text(rng.randint(0, 10))})
                msgs.append({"role": "assistant", "content": text(rng.randint(0, 15))})
            a.append(("messages", msgs))
        elif k == 3:
            n = rng.randint(1, 70)
            ids = [rng.randrange(0, 256) for _ in range(n)]
            mask = [rng.randint(0, 1) for _ in range(n)] if rng.random() < 0.5 else None
            a.append(("ids", (ids, mask)))
        elif k == 4:
            a.append(("skip", ""))  # a blank line
        else:
            a.append(("skip", {"text": ""}))  # an empty document
    for i in range(30):
        b.append(("text", text(rng.randint(1, 60)).replace("\n", " ")))
    return a, b


def write_inputs(d, a, b):
    lines = []
    for kind, p in a:
        if kind == "text":
            lines.append(json.dumps({"text": p}))
        elif kind == "messages":
            lines.append(json.dumps({"messages": p}))
        elif kind == "ids":
            ids, mask = p
            lines.append(json.dumps({"input_ids": ids, **({"target_mask": mask} if mask else {})}))
        else:
            lines.append(json.dumps(p) if p else "")
    half = len(lines) // 2
    with open(os.path.join(d, "a.jsonl"), "w") as f:
        f.write("\n".join(lines[:half]) + "\n")
    with gzip.open(os.path.join(d, "a2.jsonl.gz"), "wt") as f:
        f.write("\n".join(lines[half:]) + "\n")
    with open(os.path.join(d, "b.txt"), "w") as f:
        f.write("\n".join(t for _, t in b) + "\n")
    return [os.path.join(d, "a.jsonl"), os.path.join(d, "a2.jsonl.gz"), os.path.join(d, "b.txt")]


def expected_docs(tok, eos, a, b, assistant):
    """Token ids and masks of every document, in doc-id order, from HF tokenizers."""
    docs = []
    for kind, p in list(a) + list(b):
        if kind == "text":
            ids = tok.encode(p, add_special_tokens=False).ids
            docs.append((ids + [eos], [1] * (len(ids) + 1)))
        elif kind == "messages":
            rendered, spans = "", []
            for m in p:
                head = f"<|im_start|>{m['role']}\n"
                cs = len(rendered) + len(head)
                rendered += head + m["content"] + "<|im_end|>\n"
                if m["role"] == "assistant":  # content and its <|im_end|>
                    spans.append((cs, cs + len(m["content"]) + len("<|im_end|>")))
            enc = tok.encode(rendered, add_special_tokens=False)
            if assistant:
                mask = [int(any(s < hi and e > lo for lo, hi in spans)) for s, e in enc.offsets]
            else:
                mask = [1] * len(enc.ids)
            docs.append((enc.ids + [eos], mask + [mask[-1]]))
        elif kind == "ids":
            ids, m = p
            m = m or [1] * len(ids)
            docs.append((ids + [eos], m + [m[-1]]))
    return docs


def verify(path, S, packing, docs, tok_file, eos, vocab, sorted_order):
    f = h5py.File(path, "r")
    ids, dids, mask = f["input_ids"], f["doc_ids"], f["target_mask"]
    N = ids.shape[0]
    check(ids.dtype == np.dtype("<i4") and dids.dtype == np.dtype("<i4") and mask.dtype == np.dtype("u1"),
          f"{path}: dtypes {ids.dtype} {dids.dtype} {mask.dtype}")
    for d in (ids, dids, mask):
        check(d.shape == (N, S), f"{path}: {d.name} shape {d.shape}")
        check(d.chunks == (1, min(S, 65536)), f"{path}: {d.name} chunks {d.chunks}")
        check(d.compression == "gzip" and d.shuffle, f"{path}: {d.name} filters {d.compression} {d.shuffle}")
        check(d.maxshape == (None, S), f"{path}: {d.name} maxshape {d.maxshape}")
    at = f.attrs
    sha = hashlib.sha256(open(tok_file, "rb").read()).hexdigest()
    want = {"seq_len": S, "vocab_size": vocab, "eos_token_id": eos, "pad_token_id": eos, "tokenizer_sha256": sha,
            "packing": packing, "format_version": 1, "num_sequences": N, "num_documents": len(docs),
            "num_tokens": sum(len(d[0]) for d in docs), "created_by": "retain-pack"}
    for k, v in want.items():
        check(k in at and at[k] == v, f"{path}: attribute {k} = {at.get(k)!r}, want {v!r}")
    # The attribute types of docs/data-format.md: scalar int64 LE, seed uint64 LE, strings
    # variable-length UTF-8; shuffle, then deflate at the default level 4 (no --compression here).
    for k in at:
        a = at.get_id(k)
        check(a.shape == (), f"{path}: attribute {k} is not a scalar")
        if k in ("tokenizer_sha256", "packing", "order", "targets", "created_by"):
            t = a.get_type()
            check(t.is_variable_str() and t.get_cset() == h5py.h5t.CSET_UTF8, f"{path}: attribute {k} string type")
        else:
            check(a.dtype == np.dtype("<u8" if k == "seed" else "<i8"), f"{path}: attribute {k} type {a.dtype}")
    for d in (ids, dids, mask):
        plist = d.id.get_create_plist()
        filters = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
        check(filters == [h5py.h5z.FILTER_SHUFFLE, h5py.h5z.FILTER_DEFLATE] and d.compression_opts == 4,
              f"{path}: {d.name} filter pipeline {filters} level {d.compression_opts}")
    I, D, M = ids[...], dids[...], mask[...]
    pad = D == -1
    check(int(pad.sum()) == at["padding_tokens"], f"{path}: padding {pad.sum()} vs {at['padding_tokens']}")
    check(bool((I[pad] == eos).all() and (M[pad] == 0).all()), f"{path}: padding values")
    check(set(np.unique(M).tolist()) <= {0, 1}, f"{path}: mask values")
    got_ids, got_mask, rows_of = {}, {}, {}
    for r in range(N):
        row = D[r]
        npad = int((row == -1).sum())
        check(bool((row[S - npad:] == -1).all()), f"{path}: row {r} has padding before a document")
        if packing == "concat" and r < N - 1:
            check(npad == 0, f"{path}: concat row {r} is padded")
        seen = set()
        for t in range(S - npad):
            d = int(row[t])
            if t == 0 or d != row[t - 1]:
                check(d not in seen, f"{path}: row {r}: document {d} is not one run")
                seen.add(d)
                rows_of.setdefault(d, []).append(r)
            got_ids.setdefault(d, []).append(int(I[r, t]))
            got_mask.setdefault(d, []).append(int(M[r, t]))
    check(sorted(got_ids) == list(range(len(docs))), f"{path}: doc ids {sorted(got_ids)[:5]}...")
    split = 0
    for i, (want_ids, want_mask) in enumerate(docs):
        check(got_ids.get(i) == want_ids, f"{path}: document {i} ids differ: {got_ids.get(i)} vs {want_ids}")
        check(got_mask.get(i) == want_mask, f"{path}: document {i} mask differs: {got_mask.get(i)} vs {want_mask}")
        n = len(rows_of.get(i, []))
        split += n > 1
        if packing == "bfd":
            check(n == -(-len(want_ids) // S), f"{path}: bfd document {i} of {len(want_ids)} tokens in {n} rows")
    check(split == at["split_documents"], f"{path}: split documents {split} vs {at['split_documents']}")
    if sorted_order:  # --order input with concat: doc ids ascend through the rows
        flat = D[D >= 0]
        check(bool((np.diff(flat) >= 0).all()), f"{path}: input order not kept")
    print(f"ok: {os.path.basename(path)}: {N} x {S}, {len(docs)} documents, {int(pad.sum())} padding")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--qwen3-tokenizer", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                    "../../../shared/data/qwen3-tokenizer/tokenizer.json"))
    args = ap.parse_args()
    pack = os.path.join(args.bin_dir, "retain-pack")
    rng = random.Random(20261121)
    a, b = corpus(rng)
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([os.path.join(args.bin_dir, "retain-make-tiny"), "--out", os.path.join(d, "tiny")],
                       check=True, stdout=subprocess.DEVNULL)
        toks = [os.path.join(d, "tiny", "tokenizer.json")]
        if os.path.exists(args.qwen3_tokenizer):
            toks.append(args.qwen3_tokenizer)
        inputs = write_inputs(d, a, b)
        for tok_file in toks:
            tok = Tokenizer.from_file(tok_file)
            eos = tok.token_to_id("<|endoftext|>")
            vocab = tok.get_vocab_size(with_added_tokens=True)
            for S, packing, order, targets in [(64, "concat", "input", "all"), (64, "bfd", "shuffle", "assistant"),
                                               (37, "concat", "shuffle", "assistant"), (200, "bfd", "input", "all")]:
                out = os.path.join(d, f"out_{packing}_{S}.h5")
                cmd = [pack, "--tokenizer", tok_file, "--out", out, "--seq-len", str(S), "--packing", packing,
                       "--order", order, "--targets", targets, "--txt-mode", "line", "--seed", "5", "-q", *inputs]
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    check(False, f"retain-pack failed: {r.stderr.strip()}")
                    continue
                docs = expected_docs(tok, eos, a, b, targets == "assistant")
                verify(out, S, packing, docs, tok_file, eos, vocab, order == "input" and packing == "concat")
    if FAILURES:
        print(f"check_h5: {len(FAILURES)} failures")
        return 1
    print("check_h5: all invariants hold")
    return 0


if __name__ == "__main__":
    sys.exit(main())
