"""KVPOP's decoding step on the CPU: one new token of every layer and KV head (rows s = l·K + h)
through DESIGN §5's projections, one step of the stabilized mLSTM and the readout of the token
leaving the window — numpy on the memory of scoring.KvpopState's tensors.

Why numpy, all layers at once, into preallocated buffers: a step of this work is ~40 tiny array
operations, and on a CPU their cost is the calls, not the arithmetic (a small torch call costs
5–10 µs, a numpy call ~1–3 µs, several times more when its code was pushed out of the caches by
the model's forward). The chunk closed form that prefill uses costs ~60 torch calls per layer.

Numerics, as kvpop_state.cpp (the reference): float64 throughout, the projections, the input and
forget gates rounded to float32 as the C++ stores them, the rank key score_u − u·log γ rounded to
float32. m, C and n are the C++'s expressions term for term (m = max(log f + m₋₁, ĩ), a =
e^{log f + m₋₁ − m}, b = e^{ĩ − m}, C = a·C + (b·k̃)·ṽᵀ); logsigmoid is numpy's logaddexp, the
C++'s two branches. The dot products (projections, readout, w_o·silu(h)) sum in another order —
the ~1e-16 relative differences, as the chunk form's, vanish in the float32 roundings."""
import math

import numpy as np
import torch

from .scoring import GATE_CAP, READOUT_EPS


class KvpopStep:
    def __init__(self, state):
        L, K, r, d, w = state.L, state.K, state.r, state.d, state.w
        S = self.S = L * K
        self.state, self.r, self.d, self.w = state, r, d, w
        rows = lambda t: t.numpy().reshape(S, *t.shape[2:])  # noqa: E731  (views: the state's memory)
        self.Cn, self.m, self.ring = rows(state.Cn), rows(state.m), state.ring.numpy().reshape(w, S, d)
        # One matmul for all projections, rows [W_q; W_k; W_v; w_i; w_f] (float64: the C++ sums in
        # double; read once a step, cold after the model's forward, so no padding rows).
        W = [state.Wq, state.Wk, state.Wv, state.wi[:, :, None], state.wf[:, :, None]]
        self.W = torch.cat(W, 2).reshape(S, 3 * r + 2, 2 * d).numpy()
        self.gate_bias = np.stack([rows(state.bi), rows(state.bf)], 1)             # [S, 2]
        self.gate_sign = np.array([GATE_CAP, -GATE_CAP])                           # → ĩ, −f̃
        # w_o·silu(h) + b_o − ⌊u/n⌋·log γ as one dot product: [silu(h), 1, −⌊u/n⌋] · [w_o, b_o, log γ].
        self.out = np.concatenate([rows(state.wo), rows(state.bo)[:, None], rows(state.log_gamma)[:, None]], 1)
        self.y = np.empty((S, 2, 2, r))               # z and −z of q and k side by side: [S, (q, k), (±), r]
        self.qk = np.empty((S, 2, 2, r), np.float32)  # φ(z) = q̃, k̃ as the C++ stores them
        self.q, self.k = self.qk[:, 0].reshape(S, d), self.qk[:, 1].reshape(S, d)
        self.v = np.ones((S, r + 1), np.float32)      # [ṽ, 1]: n's update rides on C's
        self.ig, self.lf = np.empty(S, np.float32), np.empty(S, np.float32)
        self.g3 = np.zeros((3, S))                    # log f + m₋₁, ĩ, 0 (minus m, exponentiated: a, b, e^{−m})
        self.e3 = np.empty((3, S))
        self.bk = np.empty((S, d))
        self.silu = np.ones((S, r + 2))               # [silu(h), 1, −u]
        self.x = np.zeros((L, K, 2 * d), np.float32)  # the new token's [k; v], when not read from a cache store

    def __call__(self, x):
        """x F32 [S, 2d]: the new token's [k; v] per row. Returns (u, keys F32 [S]) for the token u
        that leaves the window, or None while none does (the first w − 1 tokens)."""
        st, r, w = self.state, self.r, self.w
        t = st.fed[0]
        z = np.matmul(self.W, x[:, :, None])[:, :, 0]           # [S, 3r + 2] float64 (x is cast)
        y = self.y
        y[:, :, 0] = z[:, :2 * r].reshape(-1, 2, r)
        np.negative(y[:, :, 0], out=y[:, :, 1])
        y -= y.max(-1, keepdims=True)                            # the C++'s z − max and min − z
        np.exp(y, out=y)
        np.divide(y, y.sum(-1, keepdims=True), out=self.qk)     # φ(z) = [softmax(z); softmax(−z)]
        self.v[:, :r] = z[:, 2 * r:3 * r]
        g = z[:, 3 * r:]
        g += self.gate_bias
        g /= GATE_CAP
        np.tanh(g, out=g)
        g *= self.gate_sign                                      # ĩ = c·tanh(·/c), −f̃
        self.ig[:] = g[:, 0]
        np.negative(np.logaddexp(0.0, g[:, 1]), out=self.lf)    # log f = logsigmoid(f̃) = −log(1 + e^{−f̃})
        g3, e3, m = self.g3, self.e3, self.m
        np.add(self.lf, m, out=g3[0])
        g3[1] = self.ig
        np.maximum(g3[0], g3[1], out=m)                          # m = max(log f + m₋₁, ĩ)
        np.subtract(g3, m, out=e3)
        np.exp(e3, out=e3)                                       # a, b, e^{−m}
        np.multiply(e3[1][:, None], self.k, out=self.bk)
        self.Cn *= e3[0][:, None, None]
        self.Cn += self.bk[:, :, None] * self.v[:, None, :]     # C = a·C + (b·k̃)ṽᵀ, n = a·n + b·k̃
        np.multiply(self.q, 1.0 / math.sqrt(self.d), out=self.ring[t % w], dtype=np.float64)  # q̂, as feed's
        st.fed = [t + 1] * st.L
        u = t - w + 1
        if u < 0:
            return None
        num = np.matmul(self.ring[u % w][:, None, :], self.Cn)[:, 0]  # [S, r + 1]: Cᵀq̂_u, nᵀq̂_u
        den = np.abs(num[:, r])
        np.maximum(den, e3[2], out=den)
        den += READOUT_EPS
        h = num[:, :r]
        h /= den[:, None]
        silu = self.silu[:, :r]
        np.negative(h, out=silu)
        np.exp(silu, out=silu)
        silu += 1.0
        np.divide(h, silu, out=silu)                             # h / (1 + e^{−h}), the C++'s silu
        self.silu[:, r + 1] = -(u // st.every)                  # −⌊u/n⌋: the rank key's decay steps
        return u, np.matmul(self.silu[:, None, :], self.out[:, :, None])[:, 0, 0].astype(np.float32)
