#!/usr/bin/env python3
"""Live cross-check: retain-tokenize vs Hugging Face `tokenizers` on random text nobody chose.

Generates --texts random texts from --seed (mixes of Unicode blocks, combining marks, emoji
and ZWJ, random bytes including invalid UTF-8, whitespace runs, special tokens dropped in,
and word salad that looks like prose and code) or, with --files, random slices of existing
files (source, documentation, binaries), encodes them with `tokenizers` (invalid
UTF-8 replaced as bytes.decode("utf-8", errors="replace") does) and with retain-tokenize
--jsonl, and compares the ids. Exits 77 (skipped) when `tokenizers` is not importable.
"""
import argparse
import base64
import glob
import json
import os
import random
import subprocess
import sys
import unicodedata

try:
    import tokenizers
except ImportError:
    print("tokenizers is not importable; skipping", file=sys.stderr)
    sys.exit(77)

BLOCKS = [  # (first, last) code points
    (0x20, 0x7E), (0x20, 0x7E), (0x20, 0x7E), (0xA0, 0xFF), (0x100, 0x24F), (0x300, 0x36F),
    (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x5FF), (0x600, 0x6FF), (0x900, 0x97F), (0xE00, 0xE7F),
    (0x1100, 0x11FF), (0x1E00, 0x1EFF), (0x2000, 0x206F), (0x2100, 0x214F), (0x2190, 0x22FF),
    (0x2460, 0x24FF), (0x3000, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0xFE00, 0xFE0F),
    (0xFF00, 0xFFEF), (0x1F300, 0x1FAFF), (0x1F1E6, 0x1F1FF), (0x10000, 0x1007F), (0xE0000, 0xE007F),
]
SPACES = [" ", "  ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2028", "\u0085", "\u180e", "\u200b", "\v", "\f"]
WORDS = ("the of and to in is it that was he for on are as with his they at be this from I have or by one had "
         "not but what all were when we there can an your which their said if do will each about how up out them "
         "then she many some so these would other into has more her two like him see time could no make than first "
         "been its who now people my made over did down only way find use may water long little very after words "
         "called just where most know Hello World Python C++ naïve café Straße résumé 東京 日本 北京 서울 Москва "
         "def return class import self None True False null undefined function const let var int float "
         "x y z i j k foo bar baz __init__ main() printf(\"%d\\n\") std::vector<int> a.b.c 3.14 42 1e9 0xFF "
         "don't I'm you're we've they'll she'd IT'S WE'LL can't").split()
CONTRACTIONS = ["'s", "'S", "'t", "'re", "'RE", "'ve", "'m", "'M", "'ll", "'LL", "'d", "'D", "'ſ"]


def random_block_text(rng):
    out = []
    for _ in range(rng.randint(1, 60)):
        lo, hi = rng.choice(BLOCKS)
        out.append(chr(rng.randint(lo, hi)))
        if rng.random() < 0.1:
            out.append("\u200d")  # ZWJ
        if rng.random() < 0.1:
            out.append(rng.choice(SPACES) * rng.randint(1, 4))
    return "".join(out)


def word_salad(rng):
    out = []
    for _ in range(rng.randint(1, 80)):
        w = rng.choice(WORDS)
        r = rng.random()
        if r < 0.1:
            w = w.upper()
        elif r < 0.2:
            w += rng.choice(CONTRACTIONS)
        elif r < 0.3:
            w = str(rng.randint(0, 10 ** rng.randint(1, 12)))
        out.append(w)
        out.append(rng.choice([" "] * 12 + [", ", ". ", "\n", "\n\n", "    ", "\t", "; ", "(", ")", " - "]))
    return "".join(out)


def random_bytes(rng):
    b = bytearray()
    for _ in range(rng.randint(1, 40)):
        r = rng.random()
        if r < 0.4:
            b += bytes([rng.randint(0, 255)])
        elif r < 0.6:
            b += bytes([rng.choice([0xC2, 0xE0, 0xE2, 0xED, 0xF0, 0xF4, 0xF5, 0xC0])]) + bytes(
                rng.randint(0x80, 0xBF) for _ in range(rng.randint(0, 3)))
        else:
            b += word_salad(rng)[:10].encode()
    return bytes(b)


def make_texts(rng, n, specials):
    texts = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            t = random_block_text(rng).encode()
        elif kind == 1:
            t = word_salad(rng).encode()
        elif kind == 2:
            t = random_bytes(rng)
        elif kind == 3:
            t = "".join(rng.choice(SPACES) for _ in range(rng.randint(1, 30))).encode() + word_salad(rng)[:30].encode()
        else:
            parts = [random_block_text(rng) if rng.random() < 0.3 else word_salad(rng)[:60]
                     for _ in range(rng.randint(1, 5))]
            t = "".join(p + rng.choice(specials + [" ", "\n", " " + rng.choice(specials) + " "]) for p in parts).encode()
        texts.append(drop_new_characters(t))
    return texts


def drop_new_characters(b):
    """Replaces characters unassigned in Python's Unicode tables by '?'. The C++ side takes
    character properties from the system PCRE2 (10.42: Unicode 14, as Python 3.11), HF from
    newer tables; characters assigned since split differently (a documented limitation)."""
    s = b.decode("utf-8", errors="surrogateescape")
    s = "".join("?" if unicodedata.category(c) == "Cn" else c for c in s)
    return s.encode("utf-8", errors="surrogateescape")


def file_texts(rng, patterns, n):
    """Text nobody chose: n random slices (1 byte to 1 MiB or the whole file, any offset, so
    multi-byte characters get cut) of the files matching the glob patterns (source, docs, binaries)."""
    files = sorted({f for p in patterns for f in glob.glob(p, recursive=True) if os.path.isfile(f)})
    files = [f for f in files if os.path.getsize(f) > 0]
    if not files:
        return []
    texts = []
    for _ in range(n):
        f = rng.choice(files)
        size = os.path.getsize(f)
        length = min(size, rng.choice([rng.randint(1, 256), rng.randint(1, 65536), 1 << 20]))
        with open(f, "rb") as fh:
            fh.seek(rng.randint(0, size - length))
            texts.append(drop_new_characters(fh.read(length)))
    return texts


def check(name, tok_path, bin_dir, texts):
    tok = tokenizers.Tokenizer.from_file(tok_path)
    expected = [tok.encode(t.decode("utf-8", errors="replace"), add_special_tokens=False).ids for t in texts]
    stdin = "".join(json.dumps({"text_b64": base64.b64encode(t).decode()}) + "\n" for t in texts)
    res = subprocess.run([os.path.join(bin_dir, "retain-tokenize"), "--tokenizer", tok_path, "--jsonl"],
                         input=stdin.encode(), capture_output=True)
    if res.returncode != 0:
        print(f"{name}: retain-tokenize failed: {res.stderr.decode()}", file=sys.stderr)
        return False
    got = [[int(x) for x in line.split()] for line in res.stdout.decode().split("\n")[: len(texts)]]
    bad = [i for i in range(len(texts)) if got[i] != expected[i]]
    for i in bad[:5]:
        print(f"{name}: MISMATCH text={texts[i]!r}\n  hf    ={expected[i]}\n  retain={got[i]}", file=sys.stderr)
    print(f"{name}: {len(texts) - len(bad)}/{len(texts)} texts agree "
          f"({sum(len(e) for e in expected)} tokens)")
    return not bad


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--qwen3", help="Qwen3 tokenizer.json (skipped if absent)")
    ap.add_argument("--tiny", help="the tiny model's tokenizer.json")
    ap.add_argument("--variant", action="append", default=[],
                    help="more tokenizer.json files to check (e.g. tests/fixtures/tokenizer/variants/*.json)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--texts", type=int, default=400)
    ap.add_argument("--files", action="append", default=[],
                    help="glob (recursive **) of files to take --texts random slices from instead of "
                         "generated text, e.g. '/usr/lib/python3*/**/*.py' or '/usr/bin/*'")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    if a.files:
        texts = file_texts(rng, a.files, a.texts)
        if not texts:
            print("no files match --files; skipping", file=sys.stderr)
            sys.exit(77)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|im_start|>user\n",
                "<sw>", "[L]", "[R]", "[LR]", "n\u0303am"]  # the last five: the variants' added tokens
    if not a.files:
        texts = make_texts(rng, a.texts, specials)
    ok, ran = True, 0
    for name, path in [("qwen3", a.qwen3), ("tiny", a.tiny)] + [(os.path.basename(v), v) for v in a.variant]:
        if path and os.path.exists(path):
            ok = check(name, path, a.bin_dir, texts) and ok
            ran += 1
    if ran == 0:
        print("no tokenizer.json found; skipping", file=sys.stderr)
        sys.exit(77)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
