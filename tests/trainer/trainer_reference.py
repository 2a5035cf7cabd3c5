"""Float64 PyTorch reference of retain-train's loss and gate gradients (DESIGN §4), built on
transformers' Qwen3ForCausalLM: the gated student of tests/fixtures/gates/make_fixtures.py
(gates hooked into every layer, a custom float64 gated attention, each document run on its
own with positions 0..n−1) and the teacher (the same model without gates). Autograd gives
the gradient of

  total = w_kl·KL + w_ntp·NTP + λ·L_cap

with respect to every gate tensor (a dbtrimkv shared tensor is one leaf, so its gradient is
the sum over layers). Nothing here is shared with the C++ code: sequences are split into
document runs directly from the doc ids, KL/NTP use full-vocabulary log_softmax, the capacity
sums are explicit T×T float64 sums.
"""
import importlib.util
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
GATES_REFERENCE = os.path.join(os.path.dirname(HERE), "fixtures", "gates", "make_fixtures.py")


def load_gate_reference():
    spec = importlib.util.spec_from_file_location("retain_gate_fixture_reference", GATES_REFERENCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def document_runs(doc_row):
    """[(start, length)] of the contiguous runs of equal doc ids ≥ 0 in one sequence."""
    runs, t, T = [], 0, len(doc_row)
    while t < T:
        if doc_row[t] < 0:
            t += 1
            continue
        s = t
        while t < T and doc_row[t] == doc_row[s]:
            t += 1
        runs.append((s, t - s))
    return runs


def capacity_terms(log_betas, memory, mode):
    """ℓ entries of one document run. log_betas: L tensors [n, K] (float64, autograd).
    local: ℓ[l,κ,t] = relu((S − M) / max(t − M, 1)); global: ℓ[t] = relu((Σ_{l,κ} S − M·N) /
    max(t·N − M·N, 1)), N = L·K; S[l,κ](t) = Σ_{i≤t} exp((t − i)·logβ[l,i,κ])."""
    n = log_betas[0].shape[0]
    t = torch.arange(n, dtype=torch.float64)
    dist = t[:, None] - t[None, :]  # [t, i]
    causal = dist >= 0
    sums = []
    for lb in log_betas:  # [n, K]
        # exp(dist·logβ_i) for i ≤ t; masked entries set to 0 (dist·logβ could be -inf·0 = nan).
        e = torch.where(causal[:, :, None], torch.exp(torch.where(causal[:, :, None], dist[:, :, None] * lb[None, :, :],
                                                                   torch.zeros(()))), torch.zeros(()))
        sums.append(e.sum(dim=1))  # [n(t), K]
    S = torch.stack(sums)  # [L, n, K]
    L, _, K = S.shape
    if mode == "local":
        den = torch.clamp(t - memory, min=1.0)[None, :, None]
        return torch.relu((S - memory) / den).flatten()
    N = L * K
    den = torch.clamp(t * N - memory * N, min=1.0)
    return torch.relu((S.sum(dim=(0, 2)) - memory * N) / den)


def loss_and_grads(student, kind, P, ids, docs, mask, memory, w_kl, w_ntp, lam, kl_direction="forward",
                   capacity=None, gate_input="hidden"):
    """ids/docs/mask: [B, S] int tensors (the global batch). P: name → float64 tensor (gate
    values). Returns (dict of losses, dict name → gradient), float64."""
    names = sorted(P)
    shared = ("linear3.weight", "bias") if kind == "dbtrimkv" else ()

    def leaf_key(name):  # a shared tensor is one leaf under all its layer names
        suffix = name.split("retention_gate.")[1]
        return suffix if suffix in shared else name

    leaves = {}
    for n in names:
        if leaf_key(n) not in leaves:
            leaves[leaf_key(n)] = P[n].clone().requires_grad_(True)
    params = {n: leaves[leaf_key(n)] for n in names}

    kl_sum = torch.zeros((), dtype=torch.float64)
    ntp_sum = torch.zeros((), dtype=torch.float64)
    positions = 0
    cap_terms = []
    B, S = ids.shape
    student.gate_input = gate_input  # "kv": the gates read [k ‖ v] after RoPE (autograd reaches k, v)
    for b in range(B):
        for start, n in document_runs(docs[b].tolist()):
            seg = ids[b, start:start + n].long().unsqueeze(0)
            pos = torch.arange(n, dtype=torch.long).unsqueeze(0)
            student.gates = None
            with torch.no_grad():
                teacher_logits = student.model(input_ids=seg, position_ids=pos, use_cache=False).logits[0]
            student.gates = (kind, params)
            student.seen_log_beta = []
            student_logits = student.model(input_ids=seg, position_ids=pos, use_cache=False).logits[0]
            mode = capacity or ("global" if kind == "dbtrimkv" else "local")  # retain-train --capacity
            cap_terms.append(capacity_terms(student.seen_log_beta, memory, mode))
            # Loss positions: t + 1 in the same run and a target.
            sel = [t for t in range(n - 1) if mask[b, start + t + 1] != 0]
            if not sel:
                continue
            sel_t = torch.tensor(sel, dtype=torch.long)
            logp = torch.log_softmax(teacher_logits[sel_t], dim=-1)
            logq = torch.log_softmax(student_logits[sel_t], dim=-1)
            if kl_direction == "reverse":  # retain-train --kl reverse: KL(student‖teacher)
                kl_sum = kl_sum + (logq.exp() * (logq - logp)).sum()
            else:
                kl_sum = kl_sum + (logp.exp() * (logp - logq)).sum()
            targets = seg[0, sel_t + 1]
            ntp_sum = ntp_sum - logq.gather(1, targets[:, None]).sum()
            positions += len(sel)
    terms = torch.cat(cap_terms)
    positive = int((terms > 0).sum().item())
    cap = terms.sum() / positive if positive else torch.zeros((), dtype=torch.float64)
    kl = kl_sum / positions if positions else kl_sum * 0
    ntp = ntp_sum / positions if positions else ntp_sum * 0
    total = w_kl * kl + w_ntp * ntp + lam * cap
    total.backward()
    grads = {n: params[n].grad.detach().clone() for n in names}
    losses = {"total": total.item(), "kl": kl.item(), "ntp": ntp.item(), "cap": cap.item(),
              "positions": positions, "cap_positive": positive}
    return losses, grads


class Reference:
    """The float64 student/teacher of one model directory."""

    def __init__(self, model_dir):
        self.ref = load_gate_reference()
        self.student = self.ref.Student(model_dir)

    def run(self, kind, P, ids, docs, mask, memory, w_kl, w_ntp, lam, kl_direction="forward", capacity=None,
            gate_input="hidden"):
        return loss_and_grads(self.student, kind, P, ids, docs, mask, memory, w_kl, w_ntp, lam, kl_direction, capacity,
                              gate_input)
