"""NumPy float64 oracles for attention, written from the catalog's semantics (full score matrices: small sizes)."""

import numpy as np

from tests.support.numerics import f64  # noqa: F401  (oracles and their tests use it)


def allowed_mask(
    seq_q,
    n_prior,
    seq_k,
    *,
    prior_used=None,
    q_base=0,
    q_stride=1,
    causal=False,
    window=0,
    bound_min=None,
    bound_max=None,
):
    """[Sq, S_prior + Sk] booleans: key positions are prior j - prior_used (valid j < prior_used), then 0.."""
    q_pos = q_base + np.arange(seq_q) * q_stride
    used = n_prior if prior_used is None else prior_used
    k_pos = np.concatenate([np.arange(n_prior) - used, np.arange(seq_k)])
    valid = np.concatenate([np.arange(n_prior) < used, np.ones(seq_k, bool)])
    ok = np.broadcast_to(valid[None, :], (seq_q, n_prior + seq_k)).copy()
    if causal:
        ok &= k_pos[None, :] <= q_pos[:, None]
    if window:
        ok &= k_pos[None, :] > q_pos[:, None] - window
    if bound_min is not None:
        ok &= (np.asarray(bound_min).reshape(-1)[:, None] <= k_pos[None, :]) & (
            k_pos[None, :] < np.asarray(bound_max).reshape(-1)[:, None]
        )
    return ok


def softmax_rows(scores, ok, sink):
    """Row softmax over allowed entries plus optional sink logits; returns (P, P_sink, lse). Empty rows -> 0."""
    s = np.where(ok, scores, -np.inf)
    if sink is not None:
        s = np.concatenate([s, np.broadcast_to(sink[..., None, :], s.shape[:-1] + sink.shape[-1:])], axis=-1)
    m = s.max(-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m_safe)
    total = e.sum(-1, keepdims=True)
    p = np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)
    lse = np.where(total[..., 0] > 0, m_safe[..., 0] + np.log(np.where(total[..., 0] > 0, total[..., 0], 1.0)), np.inf)
    n_sink = 0 if sink is None else sink.shape[-1]
    return p[..., : s.shape[-1] - n_sink], p[..., s.shape[-1] - n_sink :], lse


def attention_rows(q, k, v, ok, scale, sink=None):
    """q [B, Sq, d], k/v [B_kv, Skv, d] (row b uses kv b // (B/B_kv)), sink [B, n] -> (o, P, P_sink, lse)."""
    q, k, v, sink = f64(q), f64(k), f64(v), f64(sink)
    groups = q.shape[0] // k.shape[0]
    k, v = np.repeat(k, groups, axis=0), np.repeat(v, groups, axis=0)
    p, p_sink, lse = softmax_rows(scale * q @ np.swapaxes(k, 1, 2), ok[None], sink)
    return p @ v, p, p_sink, lse


def attention_rows_grads(q, k, v, ok, scale, dy, sink=None):
    """Gradients of sum(o * dy) for :func:`attention_rows`: (dq, dk, dv, dsink) by the softmax-Jacobian formulas."""
    q, k, v, dy, sink = f64(q), f64(k), f64(v), f64(dy), f64(sink)
    groups = q.shape[0] // k.shape[0]
    kr, vr = np.repeat(k, groups, axis=0), np.repeat(v, groups, axis=0)
    o, p, p_sink, _ = attention_rows(q, k, v, ok, scale, sink)
    dp = dy @ np.swapaxes(vr, 1, 2)
    row = (p * dp).sum(-1, keepdims=True)  # sinks carry no value: their dp is 0
    ds = p * (dp - row)
    dq = scale * ds @ kr
    dk = scale * np.swapaxes(ds, 1, 2) @ q
    dv = np.swapaxes(p, 1, 2) @ dy
    fold = lambda x: x.reshape(k.shape[0], groups, *x.shape[1:]).sum(1)  # noqa: E731
    dsink = None if sink is None else (p_sink * -row).sum(1)
    return dq, fold(dk), fold(dv), dsink


def idiomatic_attention(q, k, v, *, causal=True, scale=None, sliding_window=None, sinks=None, prefix=None):
    """jax_nkilib.attention in [batch, S, heads, d] layouts; the prefix caches are [batch, kv_heads, max_prior, d]."""
    q, k, v = f64(q), f64(k), f64(v)
    batch, seq_q, heads, d = q.shape
    seq_k = k.shape[1]
    scale = 1 / np.sqrt(d) if scale is None else scale
    rows = lambda x: np.transpose(x, (0, 2, 1, 3)).reshape(-1, x.shape[1], d)  # noqa: E731
    n_prior, used, kr, vr = 0, None, rows(k), rows(v)
    if prefix is not None:
        n_prior, used = prefix[0].shape[2], int(prefix[2])
        cache_rows = lambda x: f64(x).reshape(-1, n_prior, d)  # noqa: E731
        kr = np.concatenate([cache_rows(prefix[0]), kr], axis=1)
        vr = np.concatenate([cache_rows(prefix[1]), vr], axis=1)
    ok = allowed_mask(seq_q, n_prior, seq_k, prior_used=used, causal=causal, window=sliding_window or 0)
    sink = None if sinks is None else np.broadcast_to(f64(sinks), (batch, heads)).reshape(-1, 1)
    o = attention_rows(rows(q), kr, vr, ok, scale, sink)[0]
    return np.transpose(o.reshape(batch, heads, seq_q, d), (0, 2, 1, 3))


def _rotate(x, theta):
    """Halves RoPE of vectors x [..., d] by angles theta [..., d/2] as complex multiplication."""
    half = x.shape[-1] // 2
    z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * theta)
    return np.concatenate([z.real, z.imag], axis=-1)


def attention_tkg_oracle(
    q,
    k_active,
    v_active,
    k_prior,
    v_prior,
    mask,
    inv_freqs=None,
    rope_pos_ids=None,
    start_pos_ids=None,
    sink=None,
    *,
    tp_k_prior=False,
    use_pos_id=False,
    fuse_rope=False,
    curr_sprior=None,
):
    """attention_tkg on a flat cache, one query at a time: (out [B, H, d, s_a], k_out [B, 1, d, s_a])."""
    q, ka, va, kp, vp = (f64(x) for x in (q, k_active, v_active, k_prior, v_prior))
    batch, heads, s_active, d = q.shape
    s_prior = curr_sprior if use_pos_id else mask.shape[0]
    ka = ka[:, 0]
    if fuse_rope:
        theta = f64(rope_pos_ids)[:, :, None] * f64(inv_freqs)[:, 0][None, None, :]  # [B, s_a, d/2]
        q = _rotate(q, theta[:, None]) / np.sqrt(d)
        ka = _rotate(ka, theta)
    keys = (kp[:batch, 0] if tp_k_prior else np.swapaxes(kp[:batch, 0], 1, 2))[:, :s_prior].copy()
    values = vp[:batch, 0, :s_prior].copy()
    keys[:, s_prior - s_active :], values[:, s_prior - s_active :] = ka, va[:, 0]
    out = np.zeros((batch, heads, d, s_active))
    for b in range(batch):
        for i in range(s_active):
            if use_pos_id:
                end = float(rope_pos_ids[b, i])
                slots = np.arange(s_prior)
                if start_pos_ids is None:
                    visible = slots < float(rope_pos_ids[b, 0])
                else:
                    start = float(start_pos_ids[b, i])
                    visible = ((slots >= start) & (slots < end)) if start <= end else ((slots >= start) | (slots < end))
                visible[s_prior - s_active :] = np.arange(s_active) <= i
            for h in range(heads):
                row_visible = visible if use_pos_id else np.asarray(mask)[:, b, h, i] != 0
                logits = list(keys[b][row_visible] @ q[b, h, i])
                values_b = list(values[b][row_visible])
                if sink is not None:
                    logits.append(float(f64(sink)[h, 0]))
                    values_b.append(np.zeros(d))
                if not row_visible.any() and sink is None:
                    continue  # nothing to attend to: 0
                logits = np.array(logits)
                p = np.exp(logits - logits.max())
                out[b, h, :, i] = (p / p.sum()) @ np.array(values_b)
    return out, np.swapaxes(ka, 1, 2)[:, None]


def decode_attention_oracle(
    q, k_new, v_new, k_cache, v_cache, cache_len, scale=None, *, sliding_window=None, sinks=None, block_table=None
):
    """New token i of sequence b (position p = cache_len[b] + i) sees cached positions < cache_len[b] and new tokens
    <= i, with a sliding window only positions > p - sliding_window; ``sinks`` [heads] or [batch, heads] are extra
    logits with zero value. With ``block_table`` the caches are pools [num_blocks, kv_heads, block_len, d]."""
    q, k_new, v_new, k_cache, v_cache = (f64(x) for x in (q, k_new, v_new, k_cache, v_cache))
    if block_table is not None:  # sequence b's flat cache: its blocks in table order
        table = np.asarray(block_table).astype(np.int64)
        k_cache, v_cache = (
            np.transpose(pool[table], (0, 2, 1, 3, 4)).reshape(table.shape[0], pool.shape[1], -1, pool.shape[3])
            for pool in (k_cache, v_cache)
        )
    batch, s_new, heads, d = q.shape
    groups = heads // k_new.shape[2]
    scale = 1 / np.sqrt(d) if scale is None else scale
    sinks = None if sinks is None else np.broadcast_to(f64(sinks), (batch, heads))
    out = np.zeros_like(q)
    for b in range(batch):
        n = int(cache_len[b])
        for h in range(heads):
            kv = h // groups
            for i in range(s_new):
                positions = np.arange(n + i + 1)
                keys = np.concatenate([k_cache[b, kv, :n], k_new[b, : i + 1, kv]])
                values = np.concatenate([v_cache[b, kv, :n], v_new[b, : i + 1, kv]])
                if sliding_window is not None:
                    seen = positions > n + i - sliding_window
                    keys, values = keys[seen], values[seen]
                logits = scale * keys @ q[b, i, h]
                if sinks is not None:
                    logits = np.append(logits, sinks[b, h])
                    values = np.concatenate([values, np.zeros((1, d))])
                p = np.exp(logits - logits.max())
                out[b, i, h] = (p / p.sum()) @ values
    return out


def segmented_cte_oracle(
    q,
    k_cache,
    v_cache,
    block_tables,
    prior_tokens,
    *,
    block_size,
    num_q_heads,
    scale=1.0,
    sliding_window=None,
    sink=None,
):
    """attention_segmented_cte per query row: the sequence's first (prior + Sq) / block_size pages, positions t;
    query i at prior + i sees t <= prior + i (and t > prior + i - window)."""
    q, k_cache, v_cache = f64(q), f64(k_cache), f64(v_cache)
    rows, seq_q, d = q.shape
    kv_heads = k_cache.shape[1]
    prior = int(np.asarray(prior_tokens).reshape(()))
    n_blocks = (prior + seq_q) // block_size
    out = np.zeros_like(q)
    for r in range(rows):
        b, kv = r // num_q_heads, (r % num_q_heads) * kv_heads // num_q_heads
        pages = np.asarray(block_tables)[b, :n_blocks]
        keys = k_cache[pages, kv].reshape(-1, d)
        values = v_cache[pages, kv].reshape(-1, d)
        for i in range(seq_q):
            t = np.arange(len(keys))
            seen = t <= prior + i
            if sliding_window:
                seen &= t > prior + i - sliding_window
            logits = list(scale * keys[seen] @ q[r, i])
            vals = list(values[seen])
            if sink is not None:
                logits.append(float(f64(sink)[r, 0]))
                vals.append(np.zeros(d))
            logits = np.array(logits)
            p = np.exp(logits - logits.max())
            out[r, i] = (p / p.sum()) @ np.array(vals)
    return out


def block_rows(natural, reduced_block_len):
    """A natural mask [B, H, s_a, S] in the TKG kernels' block-cache order [S, B, H, s_a]: with L the kernel's resized
    block length, slot k = fold * 128 * L + p * L + o (o < L) is row (fold * L + o) * 128 + p."""
    natural = np.asarray(natural)
    length = reduced_block_len
    rows = np.zeros((natural.shape[3],) + natural.shape[:3], natural.dtype)
    for k in range(natural.shape[3]):
        fold, rest = divmod(k, 128 * length)
        p, o = divmod(rest, length)
        rows[(fold * length + o) * 128 + p] = natural[..., k]
    return rows


def block_attention_tkg_oracle(q, k_active, v_active, k_pool, v_pool, table, mask_rows, reduced_block_len, sink=None):
    """attention_tkg on a block KV cache with a given mask in block order: row b's flat cache is its blocks
    table[b, :] concatenated; the mask rows are put back in slot order. Returns out [B, H, d, s_a]."""
    table = np.asarray(table).astype(np.int64)
    batch, d = table.shape[0], np.shape(k_pool)[-1]
    flat = [f64(pool)[table].reshape(batch, 1, -1, d) for pool in (k_pool, v_pool)]
    mask_rows = np.asarray(mask_rows)
    slot_of_row = block_rows(np.arange(mask_rows.shape[0])[None, None, None, :], reduced_block_len)[:, 0, 0, 0]
    natural = np.empty_like(mask_rows)
    natural[slot_of_row] = mask_rows
    return attention_tkg_oracle(q, k_active, v_active, *flat, natural, sink=sink, tp_k_prior=True)[0]
