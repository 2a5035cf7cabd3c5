"""What the policies rank tokens by, computed from the stock model's own tensors:
- gates (trimkv, dbtrimkv, DESIGN §4): logβ = logsigmoid(MLP(h)) of the input-RMSNorm output h
  (or logsigmoid(W·h + b) for a linear trimkv gate, G = 0),
  float32, as model/gates/gates.cpp;
- KVPOP (DESIGN §5): the running stabilized mLSTM of every (layer, KV head) over x = [k; v] (the
  cached key after k_norm and RoPE, and the value), a token's score read out when it leaves the
  window. Mirrors model/infer/kvpop_state.cpp: projections in float64 rounded to float32 (as the
  C++ stores them), the recurrence and readout in float64, the rank key score_u − u·log γ
  rounded to float32 — so that the rankings, not just the scores, agree with retain-generate."""
import math

import torch
import torch.nn.functional as F

GATE_CAP = 15.0       # c of the soft-capped KVPOP gates
READOUT_EPS = float(torch.tensor(1e-6, dtype=torch.float32))  # the C++ constant is the float 1e-6f


def gate_log_beta(policy, layer, h):
    """logβ F32 [T, K] of layer `layer` for h [T, D] (any float dtype)."""
    p = policy.layers[layer]
    if "linear.weight" in p:  # the linear gate (G = 0)
        return F.logsigmoid(F.linear(h.float(), p["linear.weight"], p["bias"]))
    a = F.silu(F.linear(h.float(), p["linear1.weight"], p["linear1.bias"]))
    if policy.kind == "dbtrimkv":
        a = F.silu(F.linear(a, p["linear2.weight"], p["linear2.bias"]))
        z = F.linear(a, p["linear3.weight"], p["bias"])
    else:
        z = F.linear(a, p["linear2.weight"], p["bias"])
    return F.logsigmoid(z)


class GateStep:
    """A decoding step's gate MLP for every layer, run after the last layer's attention with the
    fewest torch calls: a small torch call costs 5–10 µs here, and several times that when it is
    the first of its kind since the model's own ops ran — so the layers' calls run back to back,
    not one layer's in each pre-hook. Layer l's logβ [1, K] goes to row l of out [L, 1, K] (rows
    l·K + h of out_np: the eviction table's order, no concatenation), the hidden activations to
    buffers reused by every layer. The ops are gate_log_beta's (addmm and silu on the same shapes,
    logsigmoid on all layers' at once): the same kernels, the same bits."""

    def __init__(self, policy, device):
        L, K, G = len(policy.layers), policy.kv_heads, policy.gate_hidden
        pairs = [("linear.weight", "bias")] if G == 0 else [("linear1.weight", "linear1.bias"), ("linear2.weight", "bias")] if policy.kind == "trimkv" else [
            ("linear1.weight", "linear1.bias"), ("linear2.weight", "linear2.bias"), ("linear3.weight", "bias")]
        # Per layer [(Wᵀ, bias)] of each linear: Wᵀ the transposed view F.linear hands addmm.
        self.weights = [[(p[w].t(), p[b]) for w, b in pairs] for p in policy.layers]
        self.h = [None] * L                                   # each layer's gate input [1, 1, D]
        self.H = torch.empty(L, 1, policy.hidden, device=device)
        self.inputs = list(self.H)                            # [1, D] views, made once
        self.hidden = torch.empty(1, G, device=device), torch.empty(1, G, device=device)
        self.z = torch.empty(L, 1, K, device=device)  # each layer's last linear, then one logsigmoid for all
        self.rows = list(self.z)
        self.out = torch.empty(L, 1, K, device=device)
        self.out_np = self.out.numpy().reshape(L * K, 1) if device.type == "cpu" else None

    def keep(self, l, h):
        """Layer l's gate input h F32 [1, 1, D]: the input-RMSNorm output, which Qwen3's decoder
        layer only reads (the residual sum is a new tensor), so a reference is enough."""
        self.h[l] = h

    def run(self):
        """Every layer's logβ; returns them [L·K, 1] on the host (a view on the CPU)."""
        with torch.no_grad():  # (kvpress's pipeline runs with grad on; out= takes no autograd)
            torch.cat(self.h, out=self.H)
            for a, layer, row in zip(self.inputs, self.weights, self.rows):
                *inner, (w, b) = layer
                for (wi, bi), buf in zip(inner, self.hidden):
                    torch.addmm(bi, a, wi, out=buf)
                    a = F.silu(buf, inplace=True)  # per layer: silu's last G mod 16 elements take a scalar path
                torch.addmm(b, a, w, out=row)
            # F.logsigmoid's kernel, with an output, for all layers at once: it computes every
            # element the same way wherever it sits (tested), unlike silu.
            torch._C._nn.log_sigmoid(self.z, out=self.out)
        self.h = [None] * len(self.h)
        return self.out_np if self.out_np is not None else self.out.reshape(-1, 1).cpu().numpy()


def log_gamma(theta, decay_min=0.999, decay_max=0.999999):
    """log γ(θ) = log γ_min + (log γ_max − log γ_min)·σ(θ), float64 (default: [0.999, 0.999999])."""
    a, b = math.log(decay_min), math.log(decay_max)
    return a + (b - a) / (1.0 + torch.exp(-theta.double()))


def _hedgehog(z):
    """φ(z) = [softmax(z); softmax(−z)] over the last dimension."""
    return torch.cat([torch.softmax(z, -1), torch.softmax(-z, -1)], -1)


class KvpopState:
    """All layers' scorers: C and n in one tensor Cn [L, K, d, r + 1] (C = Cn[..., :r], n =
    Cn[..., r]), m [L, K] (float64), and q̂ = q̃/√d of the last w tokens in a ring [w, L, K, d]
    (token p in slot p mod w; q̃ rounded to float32). A forward of several tokens advances one
    layer at a time in the chunk closed form (feed); a decoding step advances every layer at once
    (kvpop_step.py: numpy on the CPU, torch ops elsewhere), on the same memory."""

    CHUNK = 64  # tokens per closed-form step: O(K·CHUNK²·d) work and memory

    def __init__(self, policy, device):
        L, K, self.w = len(policy.layers), policy.kv_heads, policy.window
        self.L, self.K = L, K
        names = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "igate.weight", "fgate.weight", "igate.bias",
                 "fgate.bias", "out.weight", "out.bias")
        p = {n: torch.stack([layer[n] for layer in policy.layers]).to(device).double() for n in names}
        self.Wq, self.Wk, self.Wv = p["q_proj.weight"], p["k_proj.weight"], p["v_proj.weight"]  # [L, K, r, 2d]
        self.wi, self.wf, self.bi, self.bf = p["igate.weight"], p["fgate.weight"], p["igate.bias"], p["fgate.bias"]
        self.wo, self.bo = p["out.weight"], p["out.bias"]
        self.log_gamma = torch.stack([log_gamma(layer["decay"].to(device), policy.decay_min, policy.decay_max)
                                      for layer in policy.layers])  # [L, K]
        self.every = policy.decay_every  # rank keys score_u − ⌊u/n⌋·log γ (kvpop_state.cpp)
        r = self.Wq.shape[2]
        self.d, self.r = 2 * r, r
        f64 = dict(dtype=torch.float64, device=device)
        self.Cn = torch.zeros(L, K, self.d, r + 1, **f64)
        self.m = torch.zeros(L, K, **f64)
        self.ring = torch.zeros(self.w, L, K, self.d, **f64)
        self.fed = [0] * L
        self.host = device.type == "cpu"

    def _project(self, l, x):
        """x F64 [T, K, 2d] → q̃, k̃ [T, K, d], ṽ [T, K, r], ĩ, log f [T, K] of layer l, rounded to float32."""
        f32 = lambda t: t.float().double()  # noqa: E731  (the C++ stores the projections as float)
        q = f32(_hedgehog(torch.einsum("krx,tkx->tkr", self.Wq[l], x)))
        k = f32(_hedgehog(torch.einsum("krx,tkx->tkr", self.Wk[l], x)))
        v = f32(torch.einsum("krx,tkx->tkr", self.Wv[l], x))
        ig = f32(GATE_CAP * torch.tanh(((x * self.wi[l]).sum(-1) + self.bi[l]) / GATE_CAP))
        lf = f32(F.logsigmoid(GATE_CAP * torch.tanh(((x * self.wf[l]).sum(-1) + self.bf[l]) / GATE_CAP)))
        return q, k, v, ig, lf

    def feed(self, l, k, v):
        """Feeds layer l's next tokens' k, v [T, K, d]. Returns (u0, keys F32 [U, K]): the rank keys
        score_u − ⌊u/n⌋·log γ of the tokens u0 … u0 + U − 1 that left the window (U may be 0).

        Chunks of CHUNK tokens in closed form (the recurrence unrolled, as mLSTM's chunkwise
        kernels do): with F_t = Σ_{s≤t} log f_s inside the chunk and (C₀, n₀, m₀) the state before it,
        m_t = F_t + max(m₀, max_{s≤t}(ĩ_s − F_s)), and C_t = e^{F_t+m₀−m_t}·C₀ + Σ_{s≤t} e^{F_t−F_s+ĩ_s−m_t}
        k̃_s ṽ_sᵀ (n_t likewise) — the sequential recurrence of kvpop_state.cpp, summed in another order."""
        x = torch.cat([k, v], -1).double()
        q, kt, vt, ig, lf = self._project(l, x)
        T, dev, fed, w = x.shape[0], x.device, self.fed[l], self.w
        base = max(fed - w, 0)
        inv_sqrt_d = 1.0 / math.sqrt(self.d)
        q = q * inv_sqrt_d  # q̂, the readout's query
        queries = torch.cat([self.ring[torch.arange(base, fed, device=dev) % w, l], q])  # tokens base … fed + T − 1
        u0, keys = max(fed - w + 1, 0), []
        C, n_, m_ = self.Cn[l, :, :, :-1].contiguous(), self.Cn[l, :, :, -1].contiguous(), self.m[l]
        for c0 in range(0, T, self.CHUNK):
            n = min(self.CHUNK, T - c0)
            lfc, igc = lf[c0:c0 + n].t(), ig[c0:c0 + n].t()               # [K, n]
            kc, vc = kt[c0:c0 + n].transpose(0, 1), vt[c0:c0 + n].transpose(0, 1)  # [K, n, d], [K, n, r]
            F = torch.cumsum(lfc, 1)
            m = F + torch.maximum(m_[:, None], torch.cummax(igc - F, 1).values)
            causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
            expo = F[:, :, None] - F[:, None, :] + igc[:, None, :] - m[:, :, None]
            W = torch.exp(torch.where(causal, expo, torch.full_like(expo, -math.inf)))  # [K, t, s]
            e0 = torch.exp(F + m_[:, None] - m)                              # weight of the state before
            u = torch.arange(fed, fed + n, device=dev) - w + 1               # who leaves the window at t
            ts = (u >= 0).nonzero().flatten()
            if ts.numel():
                Q = queries[u[ts] - base].transpose(0, 1)                   # [K, nt, d]
                A = torch.einsum("kid,ksd->kis", Q, kc) * W[:, ts, :]
                num = e0[:, ts, None] * torch.einsum("kdr,kid->kir", C, Q) + torch.einsum("kis,ksr->kir", A, vc)
                nq = e0[:, ts] * torch.einsum("kd,kid->ki", n_, Q) + A.sum(-1)
                den = torch.maximum(nq.abs(), torch.exp(-m[:, ts])) + READOUT_EPS
                h = num / den[..., None]
                score = self.bo[l, :, None] + (self.wo[l, :, None, :] * h * torch.sigmoid(h)).sum(-1)  # [K, nt]
                steps = torch.div(u[ts], self.every, rounding_mode="floor")  # ⌊u/n⌋ (u ≥ 0)
                keys.append((score - steps.double()[None, :] * self.log_gamma[l, :, None]).float().t())
            last = W[:, -1, :]
            C = e0[:, -1, None, None] * C + torch.einsum("ks,ksd,ksr->kdr", last, kc, vc)
            n_ = e0[:, -1, None] * n_ + torch.einsum("ks,ksd->kd", last, kc)
            m_.copy_(m[:, -1])
            fed += n
        self.Cn[l, :, :, :-1], self.Cn[l, :, :, -1] = C, n_
        keep = min(T, w)  # the last w queries stay in the ring
        self.ring[torch.arange(fed - keep, fed, device=dev) % w, l] = q[-keep:]
        self.fed[l] = fed
        return u0, (torch.cat(keys) if keys else torch.empty(0, self.K, device=dev))
