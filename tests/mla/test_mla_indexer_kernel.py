"""``jax_nkilib.mla_attention``'s top-k indexer on ``sparse_attention_indexer_mx_bf16score`` where the inputs fit
the kernel: the keys it selects against a float64 NumPy oracle of the op's indexer score (DeepSeek-V3.2: rotary on
the last ``dr`` dims, affine-free LayerNorm keys), both RoPE pairings; the Neuron lowering calls the indexer kernel
for fitting inputs and keeps the XLA indexer for the others."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib._src.ops import mla_indexer
from tests.support.hlo import kernel_configs
from tests.support.numerics import assert_close, f64


def rotate_last(t, cos, sin, dr, interleaved):
    """float64 RoPE of the last ``dr`` dims of ``t [..., S, N, d]`` with tables ``[S, dr/2]``."""
    out = np.array(t)
    tail = t[..., -dr:]
    c, s = cos[:, None, :], sin[:, None, :]
    if interleaved:
        a, b = tail[..., 0::2], tail[..., 1::2]
        out[..., -dr::2], out[..., -dr + 1 :: 2] = a * c - b * s, b * c + a * s
    else:
        a, b = tail[..., : dr // 2], tail[..., dr // 2 :]
        out[..., -dr:] = np.concatenate([a * c - b * s, b * c + a * s], axis=-1)
    return out


def oracle_scores(x, q_latent, index_wq, index_wk, index_weights, cos, sin, dr, interleaved):
    """float64 ``[B, S, S]`` indexer scores, ``-inf`` above the diagonal."""
    x, q_latent, index_wq, index_wk, index_weights, cos, sin = map(
        f64, (x, q_latent, index_wq, index_wk, index_weights, cos, sin)
    )
    heads, head_dim = index_wq.shape[1:]
    qi = rotate_last(np.einsum("bsr,rhd->bshd", q_latent, index_wq), cos, sin, dr, interleaved)
    k = x @ index_wk
    k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + 1e-6)
    ki = rotate_last(k[:, :, None, :], cos, sin, dr, interleaved)[:, :, 0]
    w = x @ index_weights / np.sqrt(heads * head_dim)
    score = np.einsum("bsh,bsht->bst", w, np.maximum(np.einsum("bshd,btd->bsht", qi, ki), 0.0))
    seq = x.shape[1]
    return np.where(np.tril(np.ones((seq, seq), bool)), score, -np.inf)


def indexer_operands(b, s, d, rq, hi, di, dr, seed=0):
    rng = np.random.default_rng(seed)
    bf = lambda shape, scale=1.0: jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)  # noqa: E731
    theta = rng.uniform(-np.pi, np.pi, (s, dr // 2))
    return (
        bf((b, s, d)),
        bf((b, s, rq)),
        (bf((rq, hi, di), rq**-0.5), bf((d, di), d**-0.5), bf((d, hi), d**-0.5)),
        jnp.asarray(np.cos(theta), jnp.bfloat16),
        jnp.asarray(np.sin(theta), jnp.bfloat16),
    )


@pytest.mark.parametrize("interleaved", [False, True])
def test_kernel_indexer_keeps_the_oracles_best_keys_best_first(interleaved):
    b, s, k, dr = 2, 40, 16, 64
    x, q_latent, indexer, cos, sin = indexer_operands(b, s, 1024, 128, 2, 128, dr, seed=int(interleaved))
    assert mla_indexer.fits(x, q_latent, indexer[0], cos, k)
    chosen = np.asarray(mla_indexer.kernel_indexer_topk(x, q_latent, indexer, k, cos, sin, dr, interleaved))
    assert chosen.shape == (b, s, k) and chosen.dtype == np.int32
    scores = oracle_scores(x, q_latent, *indexer, cos, sin, dr, interleaved)
    rows = slice(k - 1, s)  # queries with at least k causal keys (the others pad with masked future keys)
    picked = np.take_along_axis(scores, chosen, axis=-1)[:, rows]
    best = -np.sort(-scores, axis=-1)[:, rows, :k]
    assert np.all(np.isfinite(picked))  # causal keys only
    # the kernel ranks bf16-rounded scores: its picks are the oracle's best up to bf16 ties
    assert_close(np.sort(picked, axis=-1), np.sort(best, axis=-1), jnp.bfloat16, ops=4)
    assert_close(picked, best, jnp.bfloat16, ops=4)  # best first


def _neuron_kernels(fn, shapes):
    with jax_nkilib.neuron.dry_run():
        text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("neuron",)).as_text()
    return [config["func_name"] for config in kernel_configs(text)]


def _mla_shapes(di):
    rng = np.random.default_rng(0)
    b, s, d, h, rq, rkv, dn, dr, dv, hi = 1, 256, 1024, 2, 256, 512, 64, 64, 128, 2
    shapes = [(b, s, d), (d, rq), (rq,), (rq, h, dn + dr), (d, rkv + dr), (rkv,), (rkv, h, dn + dv), (h, dv, d)]
    shapes += [(s, dr // 2), (s, dr // 2), (rq, hi, di), (d, di), (d, hi)]
    del rng
    return [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in shapes]


@pytest.mark.parametrize("di, uses_kernel", [(128, True), (64, False)])
def test_mla_attention_lowers_its_indexer_to_the_kernel_where_it_fits(di, uses_kernel):
    fn = lambda *a: jax_nkilib.mla_attention(*a[:10], indexer=a[10:], index_topk=128)  # noqa: E731
    kernels = _neuron_kernels(fn, _mla_shapes(di))
    assert kernels[-1] == "mla_sparse_attention_cte_kernel"
    assert ("sparse_attention_indexer_mx_bf16score" in kernels) == uses_kernel


def test_the_kernel_takes_hidden_sizes_from_1024():
    """The kernel's W projection (``w_projection_mx_batch``) asserts ``ceil(hidden / 128) >= 8``."""
    for hidden, fits in ((896, False), (1024, True)):
        x, q_latent, indexer, cos, _ = indexer_operands(1, 16, hidden, 128, 2, 128, 64)
        assert mla_indexer.fits(x, q_latent, indexer[0], cos, 16) == fits


def test_padding_slots_the_kernel_may_pick_become_a_masked_future_key(monkeypatch):
    """On the device a query with fewer causal keys than ``count`` may pick -inf padding slots past ``seq`` (the
    kernel ranks ``seq`` rounded up to 16); the op clamps them to ``seq - 1``, a future key of every such query."""
    b, s, k, dr = 1, 20, 16, 64
    x, q_latent, indexer, cos, sin = indexer_operands(b, s, 1024, 128, 2, 128, dr)

    def device_like(*args, index_topk, **kwargs):  # ascending top-k whose -inf slots are padding (>= s)
        rows = jnp.arange(b * s)[:, None]
        slot = jnp.arange(index_topk)[None, :]
        causal = rows - (index_topk - 1 - slot)  # the best (last) slots hold the causal keys rows, rows-1, ...
        ascending = jnp.where(causal >= 0, causal, s + slot).astype(jnp.int32)
        return jnp.zeros((b * s, s), jnp.float32), ascending, args[8]

    monkeypatch.setattr(mla_indexer, "sparse_attention_indexer_mx_bf16score", device_like)
    chosen = np.asarray(mla_indexer.kernel_indexer_topk(x, q_latent, indexer, k, cos, sin, dr, False))
    assert chosen.max() == s - 1 and chosen.min() >= 0
    for query in range(s):
        causal = chosen[0, query][chosen[0, query] <= query]
        assert sorted(causal) == list(range(max(0, query - k + 1), query + 1))  # every causal pick is kept
        assert np.all(chosen[0, query][chosen[0, query] > query] == s - 1)  # the rest: the last, future key
