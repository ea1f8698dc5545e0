"""Float64 NumPy oracles of the blockwise MoE kernels, written from the catalog and the kernels' goldens
(``test_moe_cte_common.generate_blockwise_numpy_golden``, ``test_bwmm_bwd_common._generate_bwd_golden``): plain
loops over blocks and tokens, and the dense MoE ``sum_k w_k * down(act(gate) * up)``."""

import math

import numpy as np

_erf = np.vectorize(math.erf)

SWISH_BETA = 1.702


def act(x, name):
    if name == "SiLU":
        return x / (1.0 + np.exp(-x))
    if name == "Swish":
        return x / (1.0 + np.exp(-SWISH_BETA * x))
    if name == "GELU":
        return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))
    if name == "GELU_Tanh_Approx":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    raise ValueError(name)


def act_slope(x, name):
    if name == "SiLU":
        s = 1.0 / (1.0 + np.exp(-x))
        return s * (1.0 + x * (1.0 - s))
    if name == "Swish":
        s = 1.0 / (1.0 + np.exp(-SWISH_BETA * x))
        return s + SWISH_BETA * x * s * (1.0 - s)
    raise ValueError(name)


def clip(x, upper, lower):
    if upper is not None:
        x = np.minimum(x, upper)
    if lower is not None:
        x = np.maximum(x, lower)
    return x


def dense_moe(x, index, weights, gate_up, down, activation="SiLU"):
    """``y[t] = sum_k weights[t, k] * (act(x W_g[e]) * (x W_u[e])) W_down[e]`` with ``e = index[t, k]``."""
    tokens, top_k = index.shape
    y = np.zeros((tokens, x.shape[1]))
    for t in range(tokens):
        for k in range(top_k):
            e = index[t, k]
            g, u = x[t] @ gate_up[e, :, 0], x[t] @ gate_up[e, :, 1]
            y[t] += weights[t, k] * ((act(g, activation) * u) @ down[e])
    return y


def routing(index, weights, experts, block):
    """The routing metadata by loops: ``(affinities [(T+1)*E, 1], token_position_to_id, block_to_expert [N, 1],
    conditions)`` with ``N = m + ceil((T*K - m) / B)``, ``m = min(T*K, E - 1)``."""
    tokens, top_k = index.shape
    singles = min(tokens * top_k, experts - 1)
    n_blocks = max(1, singles + math.ceil((tokens * top_k - singles) / block))
    affinities = np.zeros((tokens + 1, experts))
    slots, owners = [], []
    for e in range(experts):
        mine = [t for t in range(tokens) if e in index[t]]
        for t in mine:
            affinities[t, e] = weights[t, list(index[t]).index(e)]
        for start in range(0, len(mine), block):
            chunk = mine[start : start + block]
            slots += chunk + [tokens] * (block - len(chunk))
            owners.append(e)
    used = len(owners)
    assert used <= n_blocks
    slots += [tokens] * block * (n_blocks - used)
    owners += [experts - 1] * (n_blocks - used)
    conditions = (np.arange(n_blocks + 1) < used).astype(np.int32)
    return affinities.reshape(-1, 1), np.array(slots), np.array(owners).reshape(-1, 1), conditions


def blockwise_forward(
    x,
    affinities,
    gate_up,
    down,
    slots,
    owners,
    block,
    *,
    activation="SiLU",
    mode="POST_SCALE",
    prescale_on_projections=False,
    multiply_on_I=False,
    gate_up_bias=None,
    down_bias=None,
    gate_clamp=(None, None),
    up_clamp=(None, None),
    active=None,
    accumulate=True,
):
    """``(out [rows, H], gate_up_T [N, 2, I, B], down [N, B, H])`` block by block, in float64."""
    rows, hidden = x.shape
    experts, _, _, inter = gate_up.shape
    a_rows = affinities.reshape(rows, experts)
    ids = slots.reshape(-1, block)
    n_blocks = ids.shape[0]
    out = np.zeros((rows, hidden))
    ckpt_gu, ckpt_down = np.zeros((n_blocks, 2, inter, block)), np.zeros((n_blocks, block, hidden))
    prescale = mode in ("PRE_SCALE", "PRE_SCALE_DELAYED")
    for b in range(n_blocks):
        if active is not None and not active[b]:
            continue
        e = int(owners.reshape(-1)[b])
        xb, a = x[ids[b]], a_rows[ids[b], e][:, None]
        if prescale and not prescale_on_projections:
            xb = a * xb
        g, u = xb @ gate_up[e, :, 0], xb @ gate_up[e, :, 1]
        if gate_up_bias is not None:
            g, u = g + gate_up_bias[e, 0], u + gate_up_bias[e, 1]
        g, u = clip(g, *gate_clamp), clip(u, *up_clamp)
        ckpt_gu[b, 0], ckpt_gu[b, 1] = g.T, u.T
        if prescale and prescale_on_projections and not multiply_on_I:
            g, u = a * g, a * u
        h = act(g, activation) * u
        if multiply_on_I:
            h = a * h
        d = h @ down[e]
        if down_bias is not None:
            d = d + down_bias[e].reshape(-1)
        ckpt_down[b] = d
        y = a * d if mode == "POST_SCALE" and not multiply_on_I else d
        for slot, row in enumerate(ids[b]):
            out[row] = out[row] + y[slot] if accumulate else y[slot]
    return out, ckpt_gu, ckpt_down


def blockwise_backward(
    x,
    affinities,
    gate_up,
    down,
    ckpt_gu,
    ckpt_down,
    slots,
    owners,
    dy,
    block,
    *,
    activation="SiLU",
    linear_clamp=(None, None),
    non_linear_clamp=(None, None),
):
    """``(dx, daffinities [rows*E, 1], dW_gu, dW_down, db_gu [E, 2, I], db_down [E, H])`` of a POST_SCALE forward,
    from its checkpoints (clamp limits as ``(upper, lower)``; a clamped value gets no gradient)."""
    rows, hidden = x.shape
    experts, _, _, inter = gate_up.shape
    a_rows = affinities.reshape(rows, experts)
    ids = slots.reshape(-1, block)
    dx, da = np.zeros_like(x), np.zeros((rows, experts))
    dgu, ddown = np.zeros_like(gate_up), np.zeros_like(down)
    db_gu, db_down = np.zeros((experts, 2, inter)), np.zeros((experts, hidden))

    def keep(v, limits):
        upper, lower = limits
        mask = np.ones_like(v)
        if upper is not None:
            mask *= v < upper
        if lower is not None:
            mask *= v > lower
        return mask

    for b in range(ids.shape[0]):
        e = int(owners.reshape(-1)[b])
        for slot, row in enumerate(ids[b]):
            g, u, d = ckpt_gu[b, 0, :, slot], ckpt_gu[b, 1, :, slot], ckpt_down[b, slot]
            a = a_rows[row, e]
            da[row, e] += dy[row] @ d
            dd = a * dy[row]
            ddown[e] += np.outer(act(g, activation) * u, dd)
            db_down[e] += dd
            dh = down[e] @ dd
            dg = dh * u * act_slope(g, activation) * keep(g, non_linear_clamp)
            du = dh * act(g, activation) * keep(u, linear_clamp)
            dgu[e, :, 0] += np.outer(x[row], dg)
            dgu[e, :, 1] += np.outer(x[row], du)
            db_gu[e, 0] += dg
            db_gu[e, 1] += du
            dx[row] += gate_up[e, :, 0] @ dg + gate_up[e, :, 1] @ du
    return dx, da.reshape(-1, 1), dgu, ddown, db_gu, db_down
