"""``jax_nkilib.flax_attention_fn`` as the ``attention_fn`` of ``flax.nnx.MultiHeadAttention`` and
``flax.linen.MultiHeadDotProductAttention``.

Flax is an optional dependency (the ``flax`` extra; the ``test`` extra installs it): the tests that build Flax modules
skip without it, the adapter's own checks (extra batch axes, the errors) run either way.

Numerics: the module with our ``attention_fn`` (float32) against the same module with Flax's default
``attention_fn`` and the same parameters cast to float64 (a float64 oracle of the whole layer), by ``assert_close``.
The reduction length is the longest chain of sums feeding one output: the projections' ``features`` and the
attention's ``seq`` keys (and, for the parameter gradients, the ``batch * seq`` positions they are summed over).
"""

import inspect
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib._src.neuron import lowering as neuron_lowering
from jax_nkilib.neuron import NeuronFallbackWarning
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close, f64

fn = jax_nkilib.flax_attention_fn
BATCH, SEQ, FEATURES, HEADS = 2, 8, 16, 4
LENGTHS = np.array([5, 8])  # valid tokens per sequence (right padding)


@pytest.fixture(scope="module")
def nnx():
    return pytest.importorskip("flax.nnx")


@pytest.fixture(scope="module")
def linen():
    return pytest.importorskip("flax.linen")


def _x(dtype=jnp.float32, seed=0, batch=BATCH, seq=SEQ):
    return jax.random.normal(jax.random.key(seed), (batch, seq, FEATURES), dtype)


def _masks(nnx):
    """Flax's float32 1/0 masks ``[B, 1, T, S]``: causal; padding (query and key); keys-only padding (no empty
    query row) combined with causal."""
    valid = jnp.arange(SEQ)[None, :] < LENGTHS[:, None]
    causal = nnx.make_causal_mask(jnp.ones((BATCH, SEQ)))
    return {
        "causal": causal,
        "padding": nnx.make_attention_mask(valid, valid),
        "causal_key_padding": nnx.combine_masks(causal, nnx.make_attention_mask(jnp.ones((BATCH, SEQ)), valid)),
    }


def _valid_rows(out, mask_name):
    """Rows some key is visible to: where a query row sees no key (padded queries) the adapter gives attention 0,
    Flax's finite masking value the mean of the values (jax_nkilib.dot_product_attention's documented difference)."""
    return out[:, : LENGTHS.min()] if mask_name == "padding" else out


def _to64(tree):
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _require(function, parameter):
    """Skip where the installed Flax predates ``parameter`` (flax 0.11, which JAX 0.7 resolves to, has neither
    ``num_kv_heads`` nor ``MultiHeadAttention.__call__(is_causal=...)``)."""
    if parameter not in inspect.signature(function).parameters:
        pytest.skip(f"this Flax's {function.__qualname__} has no `{parameter}`")


def _nnx_pair(nnx, **kwargs):
    """Our module (float32) and the same parameters, in float64, in a module with Flax's default attention_fn."""
    ours = nnx.MultiHeadAttention(HEADS, FEATURES, attention_fn=fn, decode=False, rngs=nnx.Rngs(0), **kwargs)
    reference = nnx.MultiHeadAttention(HEADS, FEATURES, decode=False, rngs=nnx.Rngs(1), **kwargs)
    graphdef, _ = nnx.split(reference)
    return ours, nnx.merge(graphdef, _to64(nnx.state(ours)))


def _assert_gradients_close(grads, expected):
    """All parameter gradients as one vector, normwise: the key projection's bias has gradient 0 in exact
    arithmetic (it adds the same logit to every key of a row), so a per-leaf relative error would measure noise."""
    flat = lambda tree: jnp.concatenate([jnp.ravel(leaf) for leaf in jax.tree.leaves(tree)])  # noqa: E731
    assert jax.tree.structure(grads) == jax.tree.structure(expected)
    assert_close(flat(grads), flat(expected), jnp.float32, reduction=FEATURES * SEQ * BATCH * SEQ)


# ------------------------------------------------------------------------------------------------------ nnx
# GQA (num_kv_heads=2) with every mask runs with `-m slow`; CI: every mask without it, GQA causal
@pytest.mark.parametrize(
    "mask_name, num_kv_heads",
    [
        pytest.param(mask, kv, marks=[pytest.mark.slow] if kv and mask != "causal" else [])
        for kv in (None, 2)
        for mask in (None, "causal", "padding", "causal_key_padding")
    ],
)
def test_nnx_outputs_match_flax_in_float64(nnx, mask_name, num_kv_heads):
    if num_kv_heads is not None:  # grouped-query attention
        _require(nnx.MultiHeadAttention.__init__, "num_kv_heads")
    ours, reference = _nnx_pair(nnx, **({} if num_kv_heads is None else dict(num_kv_heads=num_kv_heads)))
    mask = None if mask_name is None else _masks(nnx)[mask_name]
    x = _x()
    out = ours(x, mask=mask)
    expected = reference(f64(x), mask=mask)
    assert out.dtype == jnp.float32 and out.shape == x.shape
    assert_close(_valid_rows(out, mask_name), _valid_rows(expected, mask_name), jnp.float32, reduction=FEATURES * SEQ)
    if mask_name == "padding":  # the padded query rows: attention 0, so the output projection's bias
        padded = out[0, LENGTHS[0] :]
        np.testing.assert_array_equal(padded, np.broadcast_to(ours.out.bias[...], padded.shape))


def test_nnx_is_causal_matches_the_causal_mask(nnx):
    _require(nnx.MultiHeadAttention.__call__, "is_causal")
    ours, reference = _nnx_pair(nnx)
    x = _x()
    expected = reference(f64(x), mask=_masks(nnx)["causal"])
    assert_close(ours(x, is_causal=True), expected, jnp.float32, reduction=FEATURES * SEQ)


@pytest.mark.parametrize("mask_name", [None, "causal_key_padding"])
def test_nnx_parameter_gradients_match_flax_in_float64(nnx, mask_name):
    ours, reference = _nnx_pair(nnx)
    mask = None if mask_name is None else _masks(nnx)[mask_name]
    x = _x()
    cotangent = jax.random.normal(jax.random.key(2), x.shape, jnp.float64)
    loss = lambda model, x: jnp.sum(model(x, mask=mask) * cotangent.astype(x.dtype))
    grads = nnx.jit(nnx.grad(loss))(ours, x)
    expected = nnx.jit(nnx.grad(loss))(reference, f64(x))
    assert len(jax.tree.leaves(grads)) == 8 and {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype("float32")}
    _assert_gradients_close(grads, expected)


def test_nnx_under_jit_with_grad_of_the_input(nnx):
    ours, reference = _nnx_pair(nnx)
    mask = _masks(nnx)["causal"]
    loss = lambda model, x: jnp.sum(jnp.sin(model(x, mask=mask)))
    got = nnx.jit(nnx.grad(loss, argnums=1))(ours, _x())
    assert_close(got, nnx.grad(loss, argnums=1)(reference, f64(_x())), jnp.float32, reduction=FEATURES * SEQ * SEQ)


def test_nnx_extra_batch_axes(nnx):
    """``[batch..., length, features]`` with two batch axes: Flax passes 5-d query/key/value and mask."""
    ours, reference = _nnx_pair(nnx)
    x = jax.random.normal(jax.random.key(3), (3, BATCH, SEQ, FEATURES), jnp.float32)
    mask = jnp.broadcast_to(_masks(nnx)["causal_key_padding"], (3, BATCH, 1, SEQ, SEQ))
    assert_close(ours(x, mask=mask), reference(f64(x), mask=mask), jnp.float32, reduction=FEATURES * SEQ)


def test_nnx_dropout_raises_unless_deterministic(nnx):
    ours = nnx.MultiHeadAttention(
        HEADS, FEATURES, attention_fn=fn, decode=False, dropout_rate=0.1, rngs=nnx.Rngs(0, dropout=1)
    )
    with pytest.raises(ValueError, match=r"flax_attention_fn: attention dropout is not supported.*dropout_rate=0.1"):
        ours(_x(), deterministic=False)
    reference = nnx.MultiHeadAttention(HEADS, FEATURES, decode=False, dropout_rate=0.1, rngs=nnx.Rngs(0, dropout=1))
    graphdef, _ = nnx.split(reference)
    reference = nnx.merge(graphdef, _to64(nnx.state(ours)))
    x = _x()
    expected = reference(f64(x), deterministic=True)
    assert_close(ours(x, deterministic=True), expected, jnp.float32, reduction=FEATURES * SEQ)


def test_nnx_sow_weights_raises(nnx):
    ours, _ = _nnx_pair(nnx)
    with pytest.raises(ValueError, match="cannot sow the attention weights"):
        ours(_x(), sow_weights=True)


def test_nnx_is_causal_is_the_attention_cte_kernel_on_neuron_and_a_mask_falls_back(nnx, monkeypatch):
    """``is_causal=True`` maps onto ``attention_cte`` (forward and backward kernels); a dense mask runs the
    blockwise engine, with the fallback warning naming it."""
    _require(nnx.MultiHeadAttention.__call__, "is_causal")
    monkeypatch.setattr(neuron_lowering, "_warned", set())  # the warning is once per process: not silenced, and kept
    model = nnx.MultiHeadAttention(4, 64, attention_fn=fn, decode=False, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    x = jnp.zeros((1, 128, 64), jnp.bfloat16)
    names = lambda f: [config["func_name"] for config in kernel_configs(neuron_text(f, params, x))]
    call = lambda params, x, **kw: nnx.merge(graphdef, params)(x, **kw).astype(jnp.float32).sum()
    with jax_nkilib.neuron.dry_run():
        assert names(lambda p, x: call(p, x, is_causal=True)) == ["attention_cte"]
        assert sorted(names(jax.grad(lambda p, x: call(p, x, is_causal=True)))) == ["attention_bwd", "attention_cte"]
        mask = nnx.make_causal_mask(jnp.ones((1, 128)))
        with pytest.warns(NeuronFallbackWarning, match="dense boolean `mask`"):
            assert names(lambda p, x: call(p, x, mask=mask)) == []


# ---------------------------------------------------------------------------------------------------- linen
@pytest.mark.parametrize("mask_name", [None, "causal", "padding"])
def test_linen_outputs_and_gradients_match_flax_in_float64(linen, nnx, mask_name):
    mask = None if mask_name is None else _masks(nnx)[mask_name]
    ours = linen.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=fn)
    reference = linen.MultiHeadDotProductAttention(num_heads=HEADS)
    x = _x()
    params = ours.init(jax.random.key(0), x)
    out = ours.apply(params, x, mask=mask)
    expected = reference.apply(_to64(params), f64(x), mask=mask)
    assert out.dtype == jnp.float32
    assert_close(_valid_rows(out, mask_name), _valid_rows(expected, mask_name), jnp.float32, reduction=FEATURES * SEQ)
    if mask_name == "padding":
        return  # the padded rows' documented difference reaches every parameter's gradient
    cotangent = jax.random.normal(jax.random.key(2), x.shape, jnp.float64)
    loss = lambda module, params, x: jnp.sum(module.apply(params, x, mask=mask) * cotangent.astype(x.dtype))
    grad = jax.jit(jax.grad(loss, argnums=1), static_argnums=0)
    grads, expected = grad(ours, params, x), grad(reference, _to64(params), f64(x))
    _assert_gradients_close(grads, expected)


def test_linen_dropout_and_sow_weights_raise(linen):
    x = _x()
    dropping = linen.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=fn, dropout_rate=0.1)
    params = dropping.init(jax.random.key(0), x, deterministic=True)
    dropping.apply(params, x, deterministic=True)  # dropout off: fine
    with pytest.raises(ValueError, match="attention dropout is not supported"):
        dropping.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
    plain = linen.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=fn)
    with pytest.raises(ValueError, match="cannot sow the attention weights"):
        plain.apply(params, x, sow_weights=True, mutable=["intermediates"])


# --------------------------------------------------------------------------------- the adapter, Flax or not
def _qkv(batch_shape=(BATCH,), seq=SEQ, heads=HEADS, kv_heads=2, d=8, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(4), 3)
    q = jax.random.normal(keys[0], (*batch_shape, seq, heads, d), dtype)
    k, v = (jax.random.normal(key, (*batch_shape, seq, kv_heads, d), dtype) for key in keys[1:])
    return q, k, v


@pytest.mark.parametrize("mask_batch", [(1, 1), (1, BATCH)])  # (3, BATCH): test_nnx_extra_batch_axes
def test_extra_batch_axes_are_flattened_and_restored(mask_batch):
    q, k, v = _qkv((3, BATCH))
    mask = jax.random.bernoulli(jax.random.key(5), 0.7, (*mask_batch, 1, SEQ, SEQ)).astype(jnp.float32)
    mask = mask.at[..., 0].set(1.0)  # every row sees a key
    out = fn(q, k, v, mask=mask)
    assert out.shape == q.shape
    flat = lambda x: x.reshape((3 * BATCH,) + x.shape[2:])  # noqa: E731
    full = jnp.broadcast_to(mask, (3, BATCH, 1, SEQ, SEQ)) != 0
    expected = jax_nkilib.dot_product_attention(flat(q), flat(k), flat(v), mask=flat(full))
    np.testing.assert_array_equal(flat(out), expected)


def test_dtype_casts_like_flax_and_unbatched_inputs_work():
    q, k, v = _qkv()
    out = fn(q, k, v, dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out, jax_nkilib.dot_product_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v))))
    assert fn(q, k.astype(jnp.float64), v).dtype == jnp.float64  # promoted, as flax's promote_dtype does
    np.testing.assert_array_equal(fn(q[0], k[0], v[0], is_causal=True), fn(q, k, v, is_causal=True)[0])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(dropout_rate=0.1), ValueError, "attention dropout is not supported"),  # Flax's default: not deterministic
        (dict(module=object()), ValueError, "cannot sow"),
        (dict(precision=jax.lax.Precision.HIGHEST), ValueError, "`precision` must be None"),
        (dict(precision=("default", "highest")), ValueError, "`precision` must be None"),
        (dict(qk_attn_weights_einsum=jnp.einsum), ValueError, "custom einsums"),
        (dict(dtype=jnp.int32), TypeError, "`dtype` must be a floating dtype"),
        (dict(mask=jnp.ones((2, 1, 1, SEQ, SEQ))), ValueError, "`mask`"),
    ],
)
def test_unsupported_arguments_raise_clear_errors(kwargs, error, match):
    q, k, v = _qkv()
    with pytest.raises(error, match=match):
        fn(q, k, v, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(dropout_rate=0.1, deterministic=True, dropout_rng=jax.random.key(0), broadcast_dropout=False),
        dict(precision=jax.lax.Precision.DEFAULT),
        dict(precision="default", force_fp32_for_softmax=True),
    ],
)
def test_inactive_or_satisfied_arguments_are_accepted(kwargs):
    q, k, v = _qkv()
    np.testing.assert_array_equal(fn(q, k, v, **kwargs), jax_nkilib.dot_product_attention(q, k, v))


def test_import_jax_nkilib_does_not_import_flax():
    code = "import sys, jax_nkilib; assert jax_nkilib.flax_attention_fn; assert 'flax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
