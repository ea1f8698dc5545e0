"""jax_nkilib.decode_block: a decoder layer's attention half for token generation, against a float64 NumPy oracle;
the cache update, jit loops with donated caches (aliased in the compiled HLO), vmap, gradients, the Neuron lowering
(one fused kernel per call with one kv head) and bad inputs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_nkilib
from tests.support.data import angles, random
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close, f64


def problem(batch=2, seq=1, hidden=128, heads=4, kv_heads=1, d=16, max_len=128, dtype=jnp.float32, extras=False):
    """``(x, (k_cache, v_cache), cache_len, weights)``; ``extras`` adds biases and per-head Q/K norms."""
    width = (heads + 2 * kv_heads) * d
    weights = dict(
        qkv_weight=random((hidden, width), dtype, 1, scale=hidden**-0.5),
        out_weight=random((heads * d, hidden), dtype, 2, scale=(heads * d) ** -0.5),
        norm_weight=random((hidden,), dtype, 3),
        rope=angles((batch, seq, d // 2), dtype, seed=4),
        num_q_heads=heads,
        num_kv_heads=kv_heads,
    )
    if extras:
        weights.update(
            qkv_bias=random((width,), dtype, 5, scale=0.1),
            out_bias=random((hidden,), dtype, 6, scale=0.1),
            qk_norm=(random((d,), dtype, 7), random((d,), dtype, 8)),
        )
    caches = random((batch, kv_heads, max_len, d), dtype, 9), random((batch, kv_heads, max_len, d), dtype, 10)
    cache_len = jnp.array([3, 11, 0, 7][:batch], jnp.int32)
    return random((batch, seq, hidden), dtype, 0), caches, cache_len, weights


def _rms(x, gain, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def oracle(x, caches, cache_len, weights, eps=1e-6, qk_norm_eps=1e-6):
    """The block in float64 NumPy, written from its math: ``(out, k_cache, v_cache)``."""
    w = {k: (tuple(f64(t) for t in v) if isinstance(v, tuple) else f64(v)) for k, v in weights.items()}
    nq, nkv = weights["num_q_heads"], weights["num_kv_heads"]
    x, k_cache, v_cache = f64(x), f64(caches[0]).copy(), f64(caches[1]).copy()
    batch, seq, _ = x.shape
    d = k_cache.shape[-1]
    h = _rms(x, w["norm_weight"], eps)
    proj = h @ w["qkv_weight"] + (0 if w.get("qkv_bias") is None else w["qkv_bias"])
    q = proj[..., : nq * d].reshape(batch, seq, nq, d)
    k = proj[..., nq * d : (nq + nkv) * d].reshape(batch, seq, nkv, d)
    v = proj[..., (nq + nkv) * d :].reshape(batch, seq, nkv, d)
    if w.get("qk_norm") is not None:
        q, k = _rms(q, w["qk_norm"][0], qk_norm_eps), _rms(k, w["qk_norm"][1], qk_norm_eps)
    cos, sin = (t[:, :, None, :] for t in w["rope"])

    def rotate(t):
        a, b = t[..., : d // 2], t[..., d // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    q, k = rotate(q), rotate(k)
    out = np.zeros((batch, seq, nq, d))
    for b in range(batch):
        n = int(cache_len[b])
        k_cache[b, :, n : n + seq] = np.swapaxes(k[b], 0, 1)
        v_cache[b, :, n : n + seq] = np.swapaxes(v[b], 0, 1)
        for i in range(seq):
            for head in range(nq):
                g = head // (nq // nkv)
                scores = k_cache[b, g, : n + i + 1] @ q[b, i, head] / np.sqrt(d)
                p = np.exp(scores - scores.max())
                out[b, i, head] = (p / p.sum()) @ v_cache[b, g, : n + i + 1]
    out = out.reshape(batch, seq, nq * d) @ w["out_weight"] + (0 if w.get("out_bias") is None else w["out_bias"])
    return out, k_cache, v_cache


def call(x, caches, cache_len, weights, **flags):
    return jax_nkilib.decode_block(x, caches, cache_len, **weights, **flags)


def fused(x, caches, cache_len, weights) -> bool:
    """Whether the block runs as the one fused kernel (its jaxpr binds attention_block_tkg)."""
    jaxpr = str(jax.make_jaxpr(lambda x, c, n: call(x, c, n, weights))(x, caches, cache_len))
    return "attention_block_tkg" in jaxpr


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "shape, one_kernel",
    [
        (dict(), True),  # one kv head: the fused block
        (dict(seq=3, batch=3, extras=True, d=128, heads=2, hidden=256, max_len=256), True),  # + biases, Q/K norms
        (dict(kv_heads=2, heads=6, seq=2), False),  # GQA with two kv heads: the composed ops
        (dict(hidden=72, heads=3, d=8, batch=3, seq=3, extras=True, max_len=32), False),  # odd sizes
    ],
)
def test_matches_the_oracle_and_updates_the_caches(dtype, shape, one_kernel):
    x, caches, cache_len, weights = problem(dtype=dtype, **shape)
    assert fused(x, caches, cache_len, weights) == one_kernel
    out, (k_cache, v_cache) = jax.jit(lambda x, c, n: call(x, c, n, weights))(x, caches, cache_len)
    want, k_want, v_want = oracle(x, caches, cache_len, weights)
    assert out.shape == x.shape and out.dtype == dtype and k_cache.dtype == dtype
    assert_close(out, want, dtype, reduction=x.shape[-1], ops=16)
    assert_close(k_cache, k_want, dtype, reduction=x.shape[-1], ops=8)
    assert_close(v_cache, v_want, dtype, reduction=x.shape[-1], ops=8)
    seq = x.shape[1]
    for b, n in enumerate(np.asarray(cache_len)):  # slots outside the new tokens are untouched
        np.testing.assert_array_equal(k_cache[b, :, :n], caches[0][b, :, :n])
        np.testing.assert_array_equal(v_cache[b, :, n + seq :], caches[1][b, :, n + seq :])


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_a_jitted_decode_loop_with_donated_caches_updates_them_in_place(kv_heads):
    x, caches, cache_len, weights = problem(kv_heads=kv_heads, heads=4)
    step = jax.jit(lambda caches, x, cache_len: call(x, caches, cache_len, weights), donate_argnums=0)
    compiled = step.lower(caches, x, cache_len).compile().as_text()
    aliases = re.findall(r"\{(\d+)\}: \((\d+), \{\}, may-alias\)", compiled)
    assert sorted(int(param) for _, param in aliases) == [0, 1], "both donated caches alias an output"
    cache_shape = "[" + ",".join(map(str, caches[0].shape)) + "]"
    copies = [line for line in compiled.splitlines() if re.search(re.escape(cache_shape) + r"\S* copy\(", line)]
    assert not copies, f"the step copies a whole cache: {copies}"
    want_caches = caches
    for _ in range(3):
        want, *want_caches = oracle(x, want_caches, cache_len, weights)
        out, caches = step(caches, x, cache_len)
        assert_close(out, want, jnp.float32, reduction=128, ops=16)
        cache_len = cache_len + 1
    assert_close(caches[0], want_caches[0], jnp.float32, reduction=128, ops=8)


def test_vmap_over_requests_with_shared_weights():
    x, caches, cache_len, weights = problem(batch=1)
    xs = jnp.stack([x, -x, 2 * x])
    stacked = jax.tree.map(lambda c: jnp.stack([c, c[..., ::-1], -c]), caches)
    lengths = jnp.stack([cache_len, cache_len + 2, cache_len + 5])
    outs, out_caches = jax.vmap(lambda x, c, n: call(x, c, n, weights))(xs, stacked, lengths)
    for i in range(3):
        want, k_want, _ = oracle(xs[i], jax.tree.map(lambda c: c[i], stacked), lengths[i], weights)
        assert_close(outs[i], want, jnp.float32, reduction=128, ops=16)
        assert_close(out_caches[0][i], k_want, jnp.float32, reduction=128, ops=8)


@pytest.mark.parametrize("kv_heads", [1, pytest.param(2, marks=pytest.mark.slow)])  # 2: the ops' own VJPs
def test_gradients_in_the_input_and_weights(kv_heads):
    x, caches, cache_len, weights = problem(dtype=jnp.float64, kv_heads=kv_heads, heads=2 * kv_heads, d=8, extras=True)
    del weights["qk_norm"]  # the kernel's Q/K norms need head_dim 128
    assert fused(x, caches, cache_len, weights) == (kv_heads == 1)
    names = ("qkv_weight", "out_weight", "norm_weight", "qkv_bias")

    def loss(x, *tensors):
        out, _ = call(x, caches, cache_len, dict(weights, **dict(zip(names, tensors))))
        return jnp.sum(jnp.sin(out))

    check_grads(loss, (x, *(weights[n] for n in names)), order=1, modes=("rev",), eps=1e-4)


def test_neuron_lowering_with_one_kv_head_is_one_fused_kernel_with_aliased_caches():
    x, caches, cache_len, weights = problem(max_len=256)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(lambda caches, x, n: call(x, caches, n, weights), caches, x, cache_len)
    configs = kernel_configs(text)
    assert [c["func_name"] for c in configs] == ["attention_block_tkg"]
    assert sorted(map(tuple, configs[0]["aliases"])) != []


def test_neuron_lowering_with_several_kv_heads_composes_the_kernels():
    x, caches, cache_len, weights = problem(kv_heads=2, heads=4, max_len=256)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(lambda caches, x, n: call(x, caches, n, weights), caches, x, cache_len)
    assert [c["func_name"] for c in kernel_configs(text)] == ["qkv", "attention_tkg", "output_projection_tkg"]


@pytest.mark.parametrize(
    "change, error, fragment",
    [
        (lambda a, w: ((a[0][0],) + a[1:], w), ValueError, "`x` must have layout [batch, seq, hidden]"),
        (
            lambda a, w: ((a[0], (jnp.concatenate([a[1][0]] * 2, 1), a[1][1]), a[2]), w),
            ValueError,
            "`k_cache` must have layout [batch, kv_heads, max_len, head_dim]",
        ),
        (lambda a, w: ((a[0], a[1][0], a[2]), w), TypeError, "`kv_cache` must be a pair"),
        (lambda a, w: (a, dict(w, out_weight=w["out_weight"][:-1])), ValueError, "`out_weight` must be"),
        (lambda a, w: (a, dict(w, num_q_heads=4.0)), TypeError, "`num_q_heads` must be an int in [1, "),
        (lambda a, w: (a, dict(w, num_q_heads=3, num_kv_heads=2)), ValueError, "must be a multiple of num_kv_heads"),
        (lambda a, w: (a, dict(w, qk_norm=w["norm_weight"])), TypeError, "`qk_norm` must be a pair"),
        (
            lambda a, w: (a, dict(w, qkv_weight=w["qkv_weight"].reshape(128, 1, 6, 16)[:, :, :5])),
            ValueError,
            "a grouped `qkv_weight` must be [hidden, num_kv_heads, num_q_heads / num_kv_heads + 2, head_dim]",
        ),
        (lambda a, w: ((a[0], a[1], a[2].astype(jnp.float32)), w), TypeError, "`cache_len` must be an integer"),
    ],
)
def test_bad_inputs_name_the_argument(change, error, fragment):
    x, caches, cache_len, weights = problem()
    args, weights = change((x, caches, cache_len), weights)
    with pytest.raises(error) as info:
        jax_nkilib.decode_block(*args, **weights)
    assert "jax_nkilib." in str(info.value) and fragment in str(info.value)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_an_invalid_cache_len_gives_nan_rows_and_keeps_the_valid_slots(kv_heads):
    x, caches, _, weights = problem(kv_heads=kv_heads, heads=2 * kv_heads, batch=3, seq=2)
    cache_len = jnp.array([4, 127, -1], jnp.int32)  # capacity 128 - 2 * seq = 124 is the largest valid length
    out, (k_cache, v_cache) = call(x, caches, cache_len, weights)
    want, k_want, _ = oracle(x[:1], jax.tree.map(lambda c: c[:1], caches), cache_len[:1], weights)
    assert_close(out[:1], want, jnp.float32, reduction=128, ops=16)
    assert_close(k_cache[:1], k_want, jnp.float32, reduction=128, ops=8)
    assert np.isnan(np.asarray(out[1:])).all()
    valid_slots = 128 - 2  # the scratch tail (the last seq slots) holds no valid position
    np.testing.assert_array_equal(k_cache[1:, :, :valid_slots], caches[0][1:, :, :valid_slots])
    np.testing.assert_array_equal(v_cache[1:, :, :valid_slots], caches[1][1:, :, :valid_slots])


def grouped(weights):
    """The weights with ``qkv_weight`` (and ``qkv_bias``) regrouped by kv head: ``[hidden, kv_heads, q_per_kv + 2,
    head_dim]``, kv head ``g``'s query heads, then its key, then its value (the same projection)."""
    nq, nkv = weights["num_q_heads"], weights["num_kv_heads"]
    w = weights["qkv_weight"]
    d = w.shape[1] // (nq + 2 * nkv)

    def regroup(t):  # [..., (nq + 2 nkv) d] -> [..., nkv, nq / nkv + 2, d]
        lead = t.shape[:-1]
        q = t[..., : nq * d].reshape(*lead, nkv, nq // nkv, d)
        k = t[..., nq * d : (nq + nkv) * d].reshape(*lead, nkv, 1, d)
        v = t[..., (nq + nkv) * d :].reshape(*lead, nkv, 1, d)
        return jnp.concatenate([q, k, v], axis=-2)

    out = dict(weights, qkv_weight=regroup(w))
    if weights.get("qkv_bias") is not None:
        out["qkv_bias"] = regroup(weights["qkv_bias"])
    return out


@pytest.mark.parametrize("kv_heads, heads", [(1, 4), (2, 6)])
def test_weights_grouped_by_kv_head_compute_the_same_block(kv_heads, heads):
    x, caches, cache_len, weights = problem(kv_heads=kv_heads, heads=heads, seq=2, extras=True)
    del weights["qk_norm"]
    out, (k_cache, _) = call(x, caches, cache_len, grouped(weights))
    want, k_want, _ = oracle(x, caches, cache_len, weights)
    assert fused(x, caches, cache_len, grouped(weights)) == (kv_heads == 1)
    assert_close(out, want, jnp.float32, reduction=128, ops=16)
    assert_close(k_cache, k_want, jnp.float32, reduction=128, ops=8)


def test_grouped_weights_reach_the_kernel_by_a_reshape():
    """With grouped weights, a one-kv-head block lowers to the kernel with no concatenate (the (w_q, w_k, w_v)
    form concatenates the layer's QKV weights on every call)."""
    x, caches, cache_len, weights = problem(max_len=256)
    regrouped = grouped(weights)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(lambda c, x, n: call(x, c, n, regrouped), caches, x, cache_len)
        split = dict(
            weights, qkv_weight=(weights["qkv_weight"][:, :64], *jnp.split(weights["qkv_weight"][:, 64:], 2, 1))
        )
        split_text = neuron_text(lambda c, x, n: call(x, c, n, split), caches, x, cache_len)
    assert "stablehlo.concatenate" not in text and "stablehlo.concatenate" in split_text
    assert [c["func_name"] for c in kernel_configs(text)] == ["attention_block_tkg"]
