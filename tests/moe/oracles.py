"""NumPy float64 oracles of the routing and top-k kernels, written from the NKI Library's semantics (nkilib_catalog.md
1.8, 1.17-1.19 and the kernels' sources), independently of jax_nkilib's JAX references."""

import numpy as np


def f64(x):
    return None if x is None else np.asarray(x).astype(np.float64)


def softmax(v):
    e = np.exp(v - v.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def descending(scores, k):
    """Column indices of the k largest per row, largest first (inputs are tie-free)."""
    return np.argsort(-scores, axis=-1, kind="stable")[:, :k]


def router_topk(x, w, bias, act, k, layout=1, pre_norm=True, norm=False):
    """``(router_logits, expert_index, expert_affinities, topk affinities or None)``: the kernel's pipeline
    ACT1 -> topK -> Norm -> scatter (pre_norm) or topK -> ACT2 -> scatter."""
    tokens = f64(x) if layout == 1 else f64(x).T
    logits = tokens @ f64(w)
    if bias is not None:
        logits = logits + f64(bias).reshape(1, -1)
    activation = softmax if act == "SOFTMAX" else sigmoid
    rows = np.arange(logits.shape[0])[:, None]
    if pre_norm:
        scores = activation(logits)
        index = descending(scores, k)
        if not norm:
            return logits, index, scores, None
        selected = scores[rows, index]
        eager = selected / selected.sum(axis=-1, keepdims=True)
    else:  # norm_topk_prob has no effect on this path
        index = descending(logits, k)
        eager = activation(logits[rows, index])
    affinities = np.zeros_like(logits)
    affinities[rows, index] = eager
    return logits, index, affinities, eager


def topk(x, k):
    x = f64(x)
    flat = x.reshape(-1, x.shape[-1])
    index = descending(flat, k)
    values = np.take_along_axis(flat, index, axis=-1)
    shape = x.shape[:-1] + (k,)
    return values.reshape(shape), index.reshape(shape)


def find_nonzero_indices(x, start=0, n_cols=None):
    x = np.asarray(x)
    columns = x.shape[1] if n_cols is None else n_cols
    tokens = x.shape[0]
    indices = np.full((columns, tokens), -1, np.int64)
    counts = np.zeros(columns, np.int64)
    for c in range(columns):
        rows = [t for t in range(tokens) if x[t, start + c] != 0]
        counts[c] = len(rows)
        indices[c, : len(rows)] = rows
    return indices, counts


def indexed_flatten(x, offsets, f_len, output_len, start=0, padding=-1):
    """The kernel's two cores: rows [0, ceil(E/2)) and the rest each written in order into a padded copy, the
    result their elementwise maximum."""
    x = np.asarray(x)
    rows, tokens = x.shape
    blocks = output_len // f_len
    first = -(-rows // 2)
    copies = []
    for part in (range(first), range(first, rows)):
        out = np.full((blocks, f_len), padding, np.int64)
        for r in part:
            for p in range(tokens // f_len):
                b = int(offsets[start + r]) + p
                if 0 <= b < blocks:
                    out[b] = x[r, p * f_len : (p + 1) * f_len]
        copies.append(out)
    return np.maximum(copies[0], copies[1]).reshape(output_len)
