"""KVPOP's decoding step: one new token of every layer and KV head (rows s = l·K + h) through
DESIGN §5's projections, one step of the stabilized mLSTM and the readout of the token leaving the
window — numpy on the memory of scoring.KvpopState's tensors on the CPU (KvpopStep), the same in
torch ops on a GPU (TorchKvpopStep, at the end).

Why numpy, all layers at once, into preallocated buffers: a step of this work is ~30 tiny array
operations, and on a CPU their cost is the calls, not the arithmetic (a small torch call costs
5–10 µs, a numpy call ~1–3 µs, several times more when its code was pushed out of the caches by
the model's forward). The chunk closed form that prefill uses costs ~250 torch ops per layer.
So the step is laid out for the fewest calls, each on one dtype (a call that mixes float32 and
float64 goes through numpy's buffered casting, several times the cost of a plain loop):

- one matmul gives every row's [W_q x; W_k x; −W_q x; −W_k x; W_v x; 1; (w_i·x + b_i)/c;
  −(w_f·x + b_f)/c; 0] from x = [k; v; 1] (float64, as the C++ sums; the biases ride on x's 1,
  the signs and the 1/c of the gates' soft cap on the weights);
- φ = [softmax(z); softmax(−z)] of q and k in place (5 calls: ufunc reduces, not np.max and
  np.sum, whose Python wrappers cost more than the work), the gates in place (3);
- one round trip through float32 rounds q̃, k̃, ṽ, ĩ and log f as the C++ stores them;
- then float64 only: m, a, b, e^{−m} (4 calls), C and n (4), q̂ into the ring (1), the readout (9).

Numerics, as kvpop_state.cpp (the reference): float64 throughout, the projections, the input and
forget gates rounded to float32 as the C++ stores them, the rank key score_u − ⌊u/n⌋·log γ rounded to
float32. m, C and n are the C++'s expressions term for term (m =
max(log f + m₋₁, ĩ), a = e^{log f + m₋₁ − m}, b = e^{ĩ − m}, C = a·C + (b·k̃)·ṽᵀ); logsigmoid is
numpy's logaddexp, the C++'s two branches; softmax(−z) is e^{min z − z} over its sum, as the C++;
|nᵀq̂| is nᵀq̂ (n and q̂ are sums and products of positive terms); silu(h) is h/(1 + e^{−h}), as
the C++, computed as −(−h/(1 + e^{−h})) (negations are exact). The dot products (projections
with their biases, the gates' with 1/c folded into their weights, readout, w_o·silu(h)) sum in
another order or round once more — the ~1e-16 relative differences, as the chunk form's, vanish
in the float32 roundings (tested against a loop-for-loop copy of the C++)."""
import math

import numpy as np
import torch

from .scoring import GATE_CAP, READOUT_EPS


def _projection(state):
    """Every row's weights of z = W·[k; v; 1], float64 [L·K, 5r + 4, 2d + 1] on the state's device:
    rows [W_q; W_k; −W_q; −W_k; W_v; (1); [w_i, b_i]/c; −[w_f, b_f]/c; (0)]. (1) gives ṽ's 1 (n's
    update rides on C's), (0) the 0 of e^{0 − m}; φ's groups are q, k, −q, −k (q̃ = [softmax(q);
    softmax(−q)] every other group, as the C++ orders it); the gates come out as the arguments of
    their tanh, f̃ negated."""
    L, K, r, x = state.L, state.K, state.r, 2 * state.d
    W = torch.zeros(L, K, 5 * r + 4, x + 1, dtype=torch.float64, device=state.Cn.device)
    qk = torch.cat([state.Wq, state.Wk], 2)
    W[:, :, :2 * r, :x], W[:, :, 2 * r:4 * r, :x], W[:, :, 4 * r:5 * r, :x] = qk, -qk, state.Wv
    W[:, :, 5 * r, x] = 1.0
    W[:, :, 5 * r + 1, :x], W[:, :, 5 * r + 1, x] = state.wi / GATE_CAP, state.bi / GATE_CAP
    W[:, :, 5 * r + 2, :x], W[:, :, 5 * r + 2, x] = -state.wf / GATE_CAP, -state.bf / GATE_CAP
    return W.view(L * K, 5 * r + 4, x + 1)


def _readout(state):
    """[−w_o, b_o, log γ] per row, float64 [L·K, r + 2, 1]: the rank key b_o + w_o·silu(h) − ⌊u/n⌋·log γ
    as one dot product with [−silu(h), 1, −⌊u/n⌋] (the products are w_o·silu(h) exactly)."""
    S = state.L * state.K
    rows = lambda t: t.reshape(S, *t.shape[2:])  # noqa: E731
    return torch.cat([-rows(state.wo), rows(state.bo)[:, None], rows(state.log_gamma)[:, None]], 1)[:, :, None]


class KvpopStep:
    def __init__(self, state):
        L, K, r, d, w = state.L, state.K, state.r, state.d, state.w
        S = self.S = L * K
        self.state, self.r, self.d, self.w = state, r, d, w
        rows = lambda t: t.numpy().reshape(S, *t.shape[2:])  # noqa: E731  (views: the state's memory)
        self.Cn, self.m, self.ring = rows(state.Cn), rows(state.m), state.ring.numpy().reshape(w, S, d)
        self.ring2 = self.ring.reshape(w, S, 2, r)
        # One matmul for every projection (float64: the C++ sums in double; read once a step, cold
        # after the model's forward)
        x = 2 * d
        self.W = _projection(state).numpy()
        self.xa = np.ones((S, x + 1))                  # [k; v; 1] per row
        self.x = self.xa.reshape(L, K, x + 1)          # per layer, for hooks that write it layer by layer
        self.kv = self.xa[:, :x].reshape(S, 2, d)      # k and v, for a read from [2, S, d]
        self._read = (None, None)
        self.xa3 = self.xa[:, :, None]
        self.z = np.empty((S, 5 * r + 4))
        self.z3, self.z32 = self.z[:, :, None], np.empty((S, 5 * r + 4), np.float32)
        self.phi = phi = self.z[:, :4 * r].reshape(S, 4, r)  # z of q, k, −q, −k → their softmax
        self.top = np.empty((S, 4, 1))                 # their max, then their sum
        # q̃ = [softmax(q); softmax(−q)], k̃ likewise (the C++'s order), as views [S, 2, r]
        self.q, self.k, self.v1 = phi[:, 0::2], phi[:, 1::2], self.z[:, 4 * r:5 * r + 1]
        self.g = self.z[:, 5 * r + 1:]                 # ĩ/c, −f̃/c, 0 → ĩ, −f̃, 0 → ĩ, −log f, 0 → ĩ, log f + m₋₁, 0
        self.nlf = self.g[:, 1]
        self.ig = self.g[:, 0]
        self.e = np.empty((S, 3))                      # b, a, e^{−m}
        self.b, self.a = self.e[:, 0, None, None], self.e[:, 1, None, None]
        self.m1 = self.m[:, None]
        self.bk = np.empty((S, d))
        self.bk3, self.bk2 = self.bk[:, :, None], self.bk.reshape(S, 2, r)
        self.v13 = self.v1[:, None, :]
        self.upd = np.empty((S, d, r + 1))
        self.inv_sqrt_d = 1.0 / math.sqrt(d)
        self.out = _readout(state).numpy()
        self.num = np.empty((S, 1, r + 1))             # Cᵀq̂_u, nᵀq̂_u
        self.h, self.den = self.num[:, 0, :r], np.empty((S, 1))
        self.nq = self.num[:, 0, r:]
        self.em1 = self.e[:, 2:]
        self.silu = np.ones((S, 1, r + 2))             # [−silu(h), 1, −⌊u/n⌋]
        self.s, self.neg_u = self.silu[:, 0, :r], self.silu[:, 0, r + 1]
        self.ex = np.empty((S, r))
        self.key = np.empty((S, 1, 1))
        self.keys = np.empty(S, np.float32)
        self.neg_eps = -float(READOUT_EPS)

    def read(self, kv):
        """The new token's k, v of every row from kv [2, S, d] (numpy, any float dtype, any strides;
        or a float32 torch tensor on the CPU)."""
        if isinstance(kv, torch.Tensor):
            kv = kv.numpy()
        if kv is not self._read[0]:  # (the transposed view, made once for the same source)
            self._read = kv, kv.transpose(1, 0, 2)
        np.copyto(self.kv, self._read[1])

    def write(self, l, k, v):
        """Layer l's new token's k, v [K, d] (torch, float32), for a cache without a store."""
        x, d = self.x[l], self.d
        x[:, :d], x[:, d:2 * d] = k.numpy(force=True), v.numpy(force=True)

    def __call__(self, x=None):
        """x F32 [S, 2d]: the new token's [k; v] per row (None: already in place, by read() or
        through self.x). Returns (u, keys F32 [S]) for the token u that leaves the window, or None
        while none does (the first w − 1 tokens); keys is a buffer the next step overwrites."""
        if x is not None:
            self.xa[:, :2 * self.d] = x
        st, w = self.state, self.w
        t = st.fed[0]
        z, phi, top, g, e = self.z, self.phi, self.top, self.g, self.e
        np.matmul(self.W, self.xa3, out=self.z3)
        np.maximum.reduce(phi, 2, keepdims=True, out=top)      # (the ufunc's reduce: np.max's wrapper costs µs)
        np.subtract(phi, top, out=phi)                           # the C++'s z − max and min − z
        np.exp(phi, out=phi)
        np.add.reduce(phi, 2, keepdims=True, out=top)
        np.divide(phi, top, out=phi)                             # φ(z) = [softmax(z); softmax(−z)]
        np.tanh(g, out=g)
        g *= GATE_CAP                                            # ĩ = c·tanh(·/c), −f̃ (tanh is odd), 0
        np.logaddexp(0.0, self.nlf, out=self.nlf)                # −log f = −logsigmoid(f̃) = log(1 + e^{−f̃})
        np.copyto(self.z32, z)                                   # q̃, k̃, ṽ, ĩ, log f as the C++ stores them
        np.copyto(z, self.z32)
        m = self.m
        np.subtract(m, self.nlf, out=self.nlf)                   # log f + m₋₁
        np.maximum(self.nlf, self.ig, out=m)                     # m = max(log f + m₋₁, ĩ)
        np.subtract(g, self.m1, out=e)
        np.exp(e, out=e)                                         # b, a, e^{−m}
        np.multiply(self.b, self.k, out=self.bk2)
        Cn = self.Cn
        Cn *= self.a
        np.multiply(self.bk3, self.v13, out=self.upd)
        Cn += self.upd                                           # C = a·C + (b·k̃)ṽᵀ, n = a·n + b·k̃
        np.multiply(self.q, self.inv_sqrt_d, out=self.ring2[t % w])  # q̂, as feed's
        st.fed = [t + 1] * st.L
        u = t - w + 1
        if u < 0:
            return None
        np.matmul(self.ring[u % w][:, None, :], Cn, out=self.num)
        den, s, ex = self.den, self.s, self.ex
        np.maximum(self.nq, self.em1, out=den)                   # max(|nᵀq̂|, e^{−m}): nᵀq̂ ≥ 0
        np.subtract(self.neg_eps, den, out=den)                  # −(max(·) + ε)
        np.divide(self.h, den, out=s)                            # −h
        np.exp(s, out=ex)
        ex += 1.0
        np.divide(s, ex, out=s)                                  # −h / (1 + e^{−h}): −silu(h), the C++'s silu
        self.neg_u[...] = -(u // st.every)                     # −⌊u/n⌋: the rank key's decay steps
        np.matmul(self.silu, self.out, out=self.key)
        np.copyto(self.keys, self.key.reshape(-1))              # rounded to float32 (a contiguous cast: cheaper
        return u, self.keys                                      # than one inside the table's fancy assignment)


class TorchKvpopStep:
    """KvpopStep's decoding step in torch ops on the state's device: what KVPOP decodes with on a
    GPU (unverified there: no GPU has run it; the tests run it on the CPU). On a GPU each op is a
    kernel launch, and the chunk form that prefill uses dispatches ~250 ops per layer and syncs
    with the host once per layer (its nonzero); this step dispatches 57 for all layers at once
    (Qwen3-4B's 36 layers: 8,964) and copies the rank keys to the host once. The same numerics as
    KvpopStep (float64, the same roundings to float32); on the CPU KvpopStep is faster (numpy's
    calls cost less than torch's)."""

    def __init__(self, state):
        L, K, r, d, w = state.L, state.K, state.r, state.d, state.w
        S = self.S = L * K
        self.state, self.r, self.d, self.w = state, r, d, w
        dev = state.Cn.device
        f64 = dict(dtype=torch.float64, device=dev)
        self.Cn, self.m = state.Cn.view(S, d, r + 1), state.m.view(S)  # (views: the state's memory)
        self.ring = state.ring.view(w, S, d)
        x = 2 * d
        self.W = _projection(state)
        self.xa = torch.ones(S, x + 1, **f64)
        self.x = self.xa.view(L, K, x + 1)
        self.kv = self.xa[:, :x].view(S, 2, d)
        self.z = torch.empty(S, 5 * r + 4, **f64)
        self.z3, self.z32 = self.z[:, :, None], torch.empty(S, 5 * r + 4, dtype=torch.float32, device=dev)
        self.phi = phi = self.z[:, :4 * r].view(S, 4, r)   # z of q, k, −q, −k → their softmax
        self.top = torch.empty(S, 4, 1, **f64)
        self.q, self.k, self.v1 = phi[:, 0::2], phi[:, 1::2], self.z[:, 4 * r:5 * r + 1]  # q̃ = [softmax(q); softmax(−q)]
        self.g = self.z[:, 5 * r + 1:]
        self.nlf, self.ig = self.g[:, 1], self.g[:, 0]
        self.zero = torch.zeros(S, **f64)
        self.e = torch.empty(S, 3, **f64)
        self.b, self.a = self.e[:, 0, None, None], self.e[:, 1, None, None]
        self.m1 = self.m[:, None]
        self.bk = torch.empty(S, d, **f64)
        self.bk2 = self.bk.view(S, 2, r)
        self.upd = torch.empty(S, d, r + 1, **f64)
        self.inv_sqrt_d = 1.0 / math.sqrt(d)
        self.out = _readout(state)
        self.num = torch.empty(S, 1, r + 1, **f64)
        self.h, self.nq = self.num[:, 0, :r], self.num[:, 0, r:]
        self.den = torch.empty(S, 1, **f64)
        self.em1 = self.e[:, 2:]
        self.silu = torch.ones(S, 1, r + 2, **f64)       # [−silu(h), 1, −⌊u/n⌋]
        self.s, self.neg_u = self.silu[:, 0, :r], self.silu[:, 0, r + 1]
        self.ex = torch.empty(S, r, **f64)
        self.key = torch.empty(S, 1, 1, **f64)
        self.keys = torch.empty(S, dtype=torch.float32, device=dev)
        self.eps = float(READOUT_EPS)

    def read(self, kv):
        """The new token's k, v of every row from kv [2, S, d] (any float dtype, any strides)."""
        self.kv.copy_(kv.transpose(0, 1))

    def write(self, l, k, v):
        """Layer l's new token's k, v [K, d] (any float dtype), for a cache without a store."""
        x, d = self.x[l], self.d
        x[:, :d].copy_(k)
        x[:, d:2 * d].copy_(v)

    def __call__(self):
        """As KvpopStep's (the input in place, by read() or through self.x); the keys come back on
        the host, as numpy float32 [S]."""
        st, w = self.state, self.w
        t = st.fed[0]
        z, phi, top, g, e = self.z, self.phi, self.top, self.g, self.e
        with torch.no_grad():
            torch.matmul(self.W, self.xa[:, :, None], out=self.z3)
            torch.amax(phi, 2, keepdim=True, out=top)
            phi.sub_(top).exp_()                                    # the C++'s z − max and min − z
            torch.sum(phi, 2, keepdim=True, out=top)
            phi.div_(top)                                           # φ(z) = [softmax(z); softmax(−z)]
            g.tanh_().mul_(GATE_CAP)                                # ĩ = c·tanh(·/c), −f̃ (tanh is odd), 0
            torch.logaddexp(self.zero, self.nlf, out=self.nlf)      # −log f = log(1 + e^{−f̃})
            self.z32.copy_(z)                                       # q̃, k̃, ṽ, ĩ, log f as the C++ stores them
            z.copy_(self.z32)
            m = self.m
            torch.sub(m, self.nlf, out=self.nlf)                    # log f + m₋₁
            torch.maximum(self.nlf, self.ig, out=m)                 # m = max(log f + m₋₁, ĩ)
            torch.sub(g, self.m1, out=e).exp_()                     # b, a, e^{−m}
            torch.mul(self.b, self.k, out=self.bk2)
            Cn = self.Cn
            Cn.mul_(self.a)
            torch.mul(self.bk[:, :, None], self.v1[:, None, :], out=self.upd)
            Cn.add_(self.upd)                                       # C = a·C + (b·k̃)ṽᵀ, n = a·n + b·k̃
            torch.mul(self.q, self.inv_sqrt_d, out=self.ring[t % w].view(self.S, 2, self.r))  # q̂
            st.fed = [t + 1] * st.L
            u = t - w + 1
            if u < 0:
                return None
            torch.matmul(self.ring[u % w][:, None, :], Cn, out=self.num)
            den, s, ex = self.den, self.s, self.ex
            torch.maximum(self.nq, self.em1, out=den)                # max(|nᵀq̂|, e^{−m}): nᵀq̂ ≥ 0
            den.neg_().sub_(self.eps)                               # −(max(·) + ε)
            torch.div(self.h, den, out=s)                           # −h
            torch.exp(s, out=ex).add_(1.0)
            s.div_(ex)                                              # −silu(h)
            self.neg_u.fill_(-(u // st.every))
            torch.matmul(self.silu, self.out, out=self.key)
            self.keys.copy_(self.key.view(-1))                      # rounded to float32
        return u, self.keys.cpu().numpy()
