#!/usr/bin/env python3
"""Pretrains retain's built-in recall model (models/recall-qwen3) with PyTorch + transformers on
the CPU: a 2-layer Qwen3 (hidden 128, 4 query / 2 KV heads of head_dim 64, RoPE θ = 1e6) on
the mixture of recall_data.py, with a context curriculum: dense records, then 128 → 256 → 512 →
1024 → 1536 tokens. Writes the Hugging Face layout: config.json, BF16 model.safetensors (tied
embeddings), and tokenizer.json copied from --tokenizer-from (the byte-level tokenizer of
`retain-make-tiny`, whose <|endoftext|> is 256; the committed model's own is that one).

    python3 models/recall-qwen3/make/pretrain.py --tokenizer-from models/recall-qwen3 --out /tmp/recall-qwen3

The defaults are the committed model's recipe (seed 1, 5000 steps; models/recall-qwen3/README.md
gives its runtime on 2 CPU cores).
"""
import argparse, json, math, os, shutil, sys, time

import numpy as np
import torch
import transformers
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import recall_data as rd

CONFIG = dict(vocab_size=272, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
              rope_theta=1e6, max_position_embeddings=4096, rms_norm_eps=1e-6)
# (first step, context, rows per step): the curriculum.
# Context 0: dense records (2-10 of them, at most 16 filler tokens) — the short attention spans
# that make the recall circuit form quickly; then filler grows.
PHASES = [(0, 0, 64), (600, 128, 48), (1200, 256, 32), (1800, 512, 16), (2600, 1024, 8), (3400, 1536, 6)]


def phase(step):
    return [p for p in PHASES if p[0] <= step][-1]


def batch(rng, text, step):
    _, context, rows = phase(step)
    out = []
    for _ in range(rows):
        kind = rng.random()
        c = int(rng.integers(context // 2, context + 1))
        if context == 0:
            pairs = int(rng.integers(2, 11))
            out.append(rd.recall_row(rng, 6 * pairs + int(rng.integers(0, 17)), pairs, pairs))
        elif kind < 0.8:
            pairs = int(rng.integers(1, min(16, c // 24) + 1))
            out.append(rd.recall_row(rng, c, pairs, pairs))  # every key asked
        elif kind < 0.9:
            out.append(rd.copy_row(rng, c))
        else:
            out.append(text.row(rng, c))
    T = max(len(ids) for ids, _ in out)
    x = torch.full((len(out), T), rd.EOT, dtype=torch.long)
    valid = torch.zeros((len(out), T), dtype=torch.bool)
    focus = torch.zeros((len(out), T), dtype=torch.bool)
    for i, (ids, mask) in enumerate(out):
        x[i, :len(ids)] = torch.tensor(ids)
        valid[i, :len(ids)] = True
        focus[i, :len(ids)] = torch.tensor(mask, dtype=torch.bool)
    return x, valid, focus


def loss_fn(model, x, valid, focus):
    logits = model(input_ids=x).logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")
    v, f = valid[:, 1:], focus[:, 1:]
    # The answers (recall values, copied spans) carry the loss; every token counts a tenth (the
    # filler, uniform noise, only needs its marginal; a larger share drowns the answers' signal).
    answers = (nll * f).sum() / f.sum().clamp(min=1)
    return answers + 0.1 * (nll * v).sum() / v.sum(), answers


@torch.no_grad()
def recall_accuracy(model, seed, samples=128, context=1024, pairs=8):
    rng = np.random.Generator(np.random.PCG64(seed))
    hits = 0
    for _ in range(samples // 8):
        rows = [rd.recall_row(rng, context, pairs, 1) for _ in range(8)]
        x = torch.tensor([ids[:-1] for ids, _ in rows])
        pred = model(input_ids=x).logits.argmax(-1)
        hits += int((pred[:, -3:-1] == x[:, -2:]).all(dim=1).sum())
    return hits / samples


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer-from", required=True, help="a directory with tokenizer.json (retain-make-tiny's)")
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=CONFIG["hidden_size"])
    ap.add_argument("--head-dim", type=int, default=CONFIG["head_dim"])
    ap.add_argument("--intermediate", type=int, default=CONFIG["intermediate_size"])
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--rope-theta", type=float, default=CONFIG["rope_theta"])
    ap.add_argument("--init", help="continue from this model directory (its weights; fresh optimizer)")
    ap.add_argument("--first-step", type=int, default=0, help="curriculum step to start at (with --init)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = np.random.Generator(np.random.PCG64(a.seed))
    text = rd.BigramText()
    CONFIG.update(hidden_size=a.hidden, head_dim=a.head_dim, intermediate_size=a.intermediate, rope_theta=a.rope_theta)
    cfg = transformers.Qwen3Config(**CONFIG, bos_token_id=rd.EOT, eos_token_id=rd.EOT)
    cfg._attn_implementation = "sdpa"
    model = transformers.Qwen3ForCausalLM(cfg)
    if a.init:
        from safetensors.torch import load_file
        missing, unexpected = model.load_state_dict(
            {k: v.float() for k, v in load_file(os.path.join(a.init, "model.safetensors")).items()}, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        model.tie_weights()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay}, {"params": other, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.98))
    warm = 200
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / a.steps)))))
    t0, ema = time.time(), None
    for step in range(a.first_step, a.steps):
        x, valid, focus = batch(rng, text, step)
        loss, answers = loss_fn(model, x, valid, focus)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        ema = answers.item() if ema is None else 0.98 * ema + 0.02 * answers.item()
        if (step + 1) % 100 == 0 or step + 1 == a.steps:
            msg = f"step {step + 1}/{a.steps} context {phase(step)[1]} answer loss {ema:.4f} lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s"
            if (step + 1) % 200 == 0 or step + 1 == a.steps:
                model.eval()
                c = phase(step)[1] or 64
                msg += f" recall@{c} {recall_accuracy(model, 10_000 + step, 64, c, max(1, min(8, c // 64))):.3f}"
                msg += f" recall@1024 {recall_accuracy(model, 20_000 + step, 64):.3f}"
                model.train()
            print(msg, flush=True)
    model.eval()
    # BF16 on disk: check that the rounded weights still recall.
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    with torch.no_grad():
        for k, v in model.state_dict().items():
            if k in state:
                v.copy_(state[k].float())
    acc = recall_accuracy(model, 999, samples=256)
    print(f"bf16 weights: recall@1024 (256 held-out samples, 8 pairs) {acc:.3f}; {time.time() - t0:.0f}s", flush=True)
    os.makedirs(a.out, exist_ok=True)
    save_file(state, os.path.join(a.out, "model.safetensors"), metadata={"format": "pt"})
    conf = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
            "hidden_act": "silu", "dtype": "bfloat16", "torch_dtype": "bfloat16", "use_sliding_window": False,
            "rope_scaling": None, "rope_parameters": {"rope_theta": CONFIG["rope_theta"], "rope_type": "default"},
            "bos_token_id": rd.EOT, "eos_token_id": rd.EOT, **CONFIG}
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(dict(sorted(conf.items())), f, indent=2)
        f.write("\n")
    shutil.copy(os.path.join(a.tokenizer_from, "tokenizer.json"), os.path.join(a.out, "tokenizer.json"))


if __name__ == "__main__":
    main()
