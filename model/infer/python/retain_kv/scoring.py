"""What the policies rank tokens by, computed from the stock model's own tensors:
- gates (trimkv, dbtrimkv, DESIGN §4): logβ = logsigmoid(MLP(h)) of the input-RMSNorm output h,
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
    a = F.silu(F.linear(h.float(), p["linear1.weight"], p["linear1.bias"]))
    if policy.kind == "dbtrimkv":
        a = F.silu(F.linear(a, p["linear2.weight"], p["linear2.bias"]))
        z = F.linear(a, p["linear3.weight"], p["bias"])
    else:
        z = F.linear(a, p["linear2.weight"], p["bias"])
    return F.logsigmoid(z)


def log_gamma(theta):
    """log γ(θ) = log 0.999 + (log 0.999999 − log 0.999)·σ(θ), float64."""
    a, b = math.log(0.999), math.log(0.999999)
    return a + (b - a) / (1.0 + torch.exp(-theta.double()))


def _hedgehog(z):
    """φ(z) = [softmax(z); softmax(−z)] over the last dimension."""
    return torch.cat([torch.softmax(z, -1), torch.softmax(-z, -1)], -1)


class KvpopLayerState:
    """One layer's scorers, all KV heads at once: C [K, d, r], n [K, d], m [K] (float64)."""

    CHUNK = 64  # tokens per closed-form step: O(K·CHUNK²·d) work and memory

    def __init__(self, params, window, device):
        p = {k: v.to(device) for k, v in params.items()}
        self.Wq, self.Wk, self.Wv = (p[k].double() for k in ("q_proj.weight", "k_proj.weight", "v_proj.weight"))
        self.wi, self.wf = p["igate.weight"].double(), p["fgate.weight"].double()
        self.bi, self.bf = p["igate.bias"].double(), p["fgate.bias"].double()
        self.wo, self.bo = p["out.weight"].double(), p["out.bias"].double()
        self.log_gamma = log_gamma(p["decay"])
        K, r, x = self.Wq.shape
        self.d, self.r, self.w = x // 2, r, window
        self.C = torch.zeros(K, self.d, r, dtype=torch.float64, device=device)
        self.n = torch.zeros(K, self.d, dtype=torch.float64, device=device)
        self.m = torch.zeros(K, dtype=torch.float64, device=device)
        self.recent_q = None  # q̃ [≤ w, K, d] (float32 values) of the last w tokens, oldest first
        self.fed = 0

    def _project(self, x):
        """x F64 [T, K, 2d] → q̃, k̃ [T, K, d], ṽ [T, K, r], ĩ, log f [T, K], each rounded to float32."""
        f32 = lambda t: t.float().double()  # noqa: E731  (the C++ stores the projections as float)
        q = f32(_hedgehog(torch.einsum("krx,tkx->tkr", self.Wq, x)))
        k = f32(_hedgehog(torch.einsum("krx,tkx->tkr", self.Wk, x)))
        v = f32(torch.einsum("krx,tkx->tkr", self.Wv, x))
        ig = f32(GATE_CAP * torch.tanh(((x * self.wi).sum(-1) + self.bi) / GATE_CAP))
        lf = f32(F.logsigmoid(GATE_CAP * torch.tanh(((x * self.wf).sum(-1) + self.bf) / GATE_CAP)))
        return q, k, v, ig, lf

    def feed(self, k, v):
        """Feeds the next tokens' k, v [T, K, d]. Returns (u0, keys F32 [U, K]): the rank keys
        score_u − u·log γ of the tokens u0 … u0 + U − 1 that left the window (U may be 0).

        Chunks of CHUNK tokens in closed form (the recurrence unrolled, as mLSTM's chunkwise
        kernels do): with F_t = Σ_{s≤t} log f_s inside the chunk and (C₀, n₀, m₀) the state before it,
        m_t = F_t + max(m₀, max_{s≤t}(ĩ_s − F_s)), and C_t = e^{F_t+m₀−m_t}·C₀ + Σ_{s≤t} e^{F_t−F_s+ĩ_s−m_t}
        k̃_s ṽ_sᵀ (n_t likewise) — the sequential recurrence of kvpop_state.cpp, summed in another order."""
        x = torch.cat([k, v], -1).double()
        q, kt, vt, ig, lf = self._project(x)
        T, dev = x.shape[0], x.device
        queries = torch.cat([self.recent_q, q]) if self.recent_q is not None else q  # tokens base … fed + T − 1
        base = self.fed - (self.recent_q.shape[0] if self.recent_q is not None else 0)
        u0, keys = max(self.fed - self.w + 1, 0), []
        inv_sqrt_d = 1.0 / math.sqrt(self.d)
        for c0 in range(0, T, self.CHUNK):
            n = min(self.CHUNK, T - c0)
            lfc, igc = lf[c0:c0 + n].t(), ig[c0:c0 + n].t()               # [K, n]
            kc, vc = kt[c0:c0 + n].transpose(0, 1), vt[c0:c0 + n].transpose(0, 1)  # [K, n, d], [K, n, r]
            F = torch.cumsum(lfc, 1)
            m = F + torch.maximum(self.m[:, None], torch.cummax(igc - F, 1).values)
            causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
            expo = F[:, :, None] - F[:, None, :] + igc[:, None, :] - m[:, :, None]
            W = torch.exp(torch.where(causal, expo, torch.full_like(expo, -math.inf)))  # [K, t, s]
            e0 = torch.exp(F + self.m[:, None] - m)                          # weight of the state before
            u = torch.arange(self.fed, self.fed + n, device=dev) - self.w + 1  # who leaves the window at t
            ts = (u >= 0).nonzero().flatten()
            if ts.numel():
                Q = queries[u[ts] - base].transpose(0, 1) * inv_sqrt_d      # [K, nt, d]
                A = torch.einsum("kid,ksd->kis", Q, kc) * W[:, ts, :]
                num = e0[:, ts, None] * torch.einsum("kdr,kid->kir", self.C, Q) + torch.einsum("kis,ksr->kir", A, vc)
                nq = e0[:, ts] * torch.einsum("kd,kid->ki", self.n, Q) + A.sum(-1)
                den = torch.maximum(nq.abs(), torch.exp(-m[:, ts])) + READOUT_EPS
                h = num / den[..., None]
                score = self.bo[:, None] + (self.wo[:, None, :] * h * torch.sigmoid(h)).sum(-1)  # [K, nt]
                keys.append((score - u[ts].double()[None, :] * self.log_gamma[:, None]).float().t())
            last = W[:, -1, :]
            self.C = e0[:, -1, None, None] * self.C + torch.einsum("ks,ksd,ksr->kdr", last, kc, vc)
            self.n = e0[:, -1, None] * self.n + torch.einsum("ks,ksd->kd", last, kc)
            self.m = m[:, -1]
            self.fed += n
        self.recent_q = queries[-self.w:]
        return u0, (torch.cat(keys) if keys else torch.empty(0, self.m.shape[0], device=dev))
