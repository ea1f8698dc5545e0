"""The Neuron op census (``jax_nkilib.neuron.op_census``) and the graph economy of a Llama-style layer.

The census tests pin the exact glue around the kernels, so that a change that adds a transpose, a slice or a
fallback between kernels fails here. Numbers are for LNC 1 (the suite's setting) unless a test says LNC 2.

What the layers' remaining glue is, and why no kernel flag removes it (see the report of issue 15, item 5):
- ``rms_norm``: ``rmsnorm_tkg`` writes ``[128, B*S, H/128]`` (no row-layout flag): one transpose back to rows.
- ``qkv``: its ``BSD`` output ``[B, S, (nq + 2 nkv) d]`` is split into q, k, v by three (strided) slices;
  with ``d_head == 128`` its ``NBSd`` output ``[heads, B, S, d]`` by three contiguous ones.
- ``RoPE``: ``x_in`` is ``[d_head, B, n_heads, S]`` (no other layout): one transpose in and one out per call, and
  one per ``[S, d_head/2]`` table to ``[d_head/2, 1, S]`` (the batch folds into the kernel's heads: no broadcast).
- ``attention_cte`` folds heads into its batch (rows ``b * H + h``). Its rows ``[B*H, S, d]`` (``tp_q``,
  ``tp_k``) are ``NBSd``'s heads at batch 1, a transpose of only the unit batch axis; ``BSD``'s heads, or ``NBSd``'s
  at a larger batch, need one transpose per q (and k, v with several kv heads). Its ``tp_out=True`` output
  ``[B*H, d, S]`` is ``output_projection_cte``'s ``[B, N, D, S]`` as it is, so the transpose back to ``[batch,
  seq, heads, d]`` and the one into the projection cancel (the census counts that chain as not moving data). When
  differentiated, q and k take attention_bwd's layout ``[B*H, d, S]`` instead (one transpose each).
"""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import pytest

import jax_nkilib
from jax_nkilib.neuron import OpCensus, op_census

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"


def quickstart():
    spec = importlib.util.spec_from_file_location("quickstart", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def block_args(qs, seq):
    x = jnp.zeros((qs.BATCH, seq, qs.MODEL), jnp.float32)
    return (qs.init_params(jax.random.key(0)), x, *qs.rotary_tables(seq, qs.HEAD_DIM))


def fused_llama_layer(qs):
    """The quickstart block written with the fusions the ops offer: RMSNorm and RoPE inside ``qkv``, the attention
    residual add and the second RMSNorm inside ``mlp`` (which also returns the sum for the last residual add)."""

    def layer(params, x, cos, sin):
        q, k, v = jax_nkilib.qkv_projection(
            x,
            params["qkv"],
            num_q_heads=qs.HEADS,
            num_kv_heads=qs.KV_HEADS,
            norm="rms",
            norm_weight=params["attn_norm"],
            rope=(cos, sin),
        )
        attn = jax_nkilib.output_projection(jax_nkilib.attention(q, k, v, causal=True), params["out"])
        out, h = jax_nkilib.mlp(
            attn,
            params["gate"],
            params["up"],
            params["down"],
            norm="rms",
            norm_weight=params["mlp_norm"],
            residual=x,
            return_residual=True,
        )
        return h + out

    return layer


# --------------------------------------------------------------------------------------------- the census itself
def test_census_counts_glue_and_judges_transpose_chains():
    def fn(x, y):
        back_and_forth = jnp.transpose(jnp.transpose(x, (1, 0)).reshape(4, 2, 3), (1, 0, 2)).reshape(2, 12)
        unit_axes = jnp.transpose(y, (1, 0, 2))  # [1, 5, 3] -> [5, 1, 3]: only a size-1 axis moves
        return back_and_forth + 1.0, jnp.transpose(x, (1, 0)), unit_axes

    census = op_census(fn, jnp.zeros((12, 2)), jnp.zeros((1, 5, 3)))
    assert census.kernels == ()
    assert census.ops == {"transpose": 4, "reshape": 2, "constant": 1, "broadcast_in_dim": 1, "add": 1}
    assert census.glue == {"transpose": 4, "broadcast_in_dim": 1, "add": 1}
    # the transpose-reshape-transpose-reshape chain reorders x, and so does the lone transpose of x; the transpose
    # that moves only a size-1 axis does not
    assert census.moving_transposes == 2


def test_census_of_an_inverse_pair_is_free():
    fn = lambda x: jnp.transpose(jnp.transpose(x, (0, 2, 1)), (0, 2, 1)) * 2.0
    census = op_census(fn, jnp.zeros((2, 3, 4)))
    assert census.ops["transpose"] == 2 and census.moving_transposes == 0


def test_census_of_large_arrays_judges_each_transpose():
    """Past MAX_TRACKED elements a chain moves data when one of its transposes moves an axis longer than 1."""
    big = jax.ShapeDtypeStruct((1, 1 << 12, 1 << 13), jnp.float32)
    fn = lambda x: (jnp.transpose(x, (1, 0, 2)), jnp.transpose(jnp.transpose(x, (0, 2, 1)), (0, 2, 1)))
    census = op_census(fn, big)
    assert census.ops["transpose"] == 3 and census.moving_transposes == 1  # the inverse pair, conservatively


def test_census_names_the_kernel_calls():
    census = op_census(jax_nkilib.rms_norm, jnp.ones((2, 3, 256), jnp.float32), jnp.ones((256,), jnp.float32))
    assert isinstance(census, OpCensus)
    assert census.kernels == ("rmsnorm_tkg",)
    assert census.glue == {"transpose": 1}  # the kernel's [128, B*S, H/128] back to rows
    assert "1 kernel call(s) (rmsnorm_tkg)" in str(census)


# ------------------------------------------------------------------------------------------- a Llama-style layer
QUICKSTART_KERNELS = ("rmsnorm_tkg", "qkv", "RoPE", "RoPE", "attention_cte", "output_projection_cte", "rmsnorm_tkg")


def test_quickstart_block_forward_census():
    """Before issue 15: 39 ops (15 transposes, 15 reshapes, 3 slices, 4 broadcasts, 2 adds), of which 12 transpose
    chains moved data. Now attention_cte's output feeds output_projection_cte with no data movement (tp_out), and
    RoPE folds the batch into its heads, so its shared tables need no broadcast (more reshapes, which are free)."""
    qs = quickstart()
    census = op_census(qs.transformer_block, *block_args(qs, qs.SEQ))
    assert census.kernels == (*QUICKSTART_KERNELS, "mlp")
    assert census.ops == {"reshape": 23, "transpose": 15, "slice": 3, "add": 2}
    assert census.moving_transposes == 11


def test_quickstart_block_forward_census_at_lnc2():
    """At LNC 2 the norm's output is one transpose (two before) and the decode step's RoPE runs its kernel on one
    core (before, ``lnc_shard`` with S=1 fell back to the reference: 72 ops, 6 kernels)."""
    qs = quickstart()
    with jax_nkilib.config(lnc=2):
        prefill = op_census(qs.transformer_block, *block_args(qs, qs.SEQ))
        decode = op_census(qs.transformer_block, *block_args(qs, 1))
    assert prefill.kernels == (*QUICKSTART_KERNELS, "mlp")
    assert prefill.ops == {"reshape": 25, "transpose": 15, "slice": 3, "add": 2}
    assert decode.kernels == (*QUICKSTART_KERNELS[:5], "output_projection_tkg", "rmsnorm_tkg", "mlp")
    assert decode.ops == {"reshape": 24, "transpose": 15, "slice": 3, "add": 2}
    assert decode.moving_transposes == 7  # with S=1 the RoPE transposes of the tables move only unit axes


def test_fused_llama_layer_forward_census():
    """Four kernels; between them only the q/k/v split (3 slices, 3 transposes to attention's rows), the
    cancelling attention -> projection pair and the last residual add; the RoPE tables' widening (concatenate)
    and batch broadcast feed qkv."""
    qs = quickstart()
    layer = fused_llama_layer(qs)
    prefill = op_census(layer, *block_args(qs, qs.SEQ))
    assert prefill.kernels == ("qkv", "attention_cte", "output_projection_cte", "mlp")
    assert prefill.ops == {
        "reshape": 9,
        "concatenate": 2,
        "broadcast_in_dim": 2,
        "slice": 3,
        "transpose": 5,
        "add": 1,
    }
    assert prefill.moving_transposes == 3
    decode = op_census(layer, *block_args(qs, 1))
    assert decode.kernels == ("qkv", "attention_cte", "output_projection_tkg", "mlp")
    assert decode.ops == {
        "reshape": 10,
        "concatenate": 2,
        "broadcast_in_dim": 2,
        "slice": 3,
        "transpose": 5,
        "add": 1,
    }
    assert decode.moving_transposes == 1  # the projection's [D, B, N, S]; q/k/v rows of S=1 move nothing


def test_quickstart_gradient_runs_attention_bwd_without_layout_transposes():
    """The backward of the prefill block: attention_bwd takes q, k, o, dy in the layouts attention_cte was given
    (before: 42 transposes, 27 moving chains)."""
    qs = quickstart()
    loss = lambda params, x, cos, sin: qs.transformer_block(params, x, cos, sin).sum()
    census = op_census(jax.grad(loss, argnums=(0, 1)), *block_args(qs, qs.SEQ))
    assert "attention_bwd" in census.kernels
    assert census.ops["transpose"] == 36
    assert census.moving_transposes == 23


def llama_census(step, heads):
    """The census of a 1-layer and a 2-layer Llama (hidden 256, one kv head) running ``step(llama, config) ->
    (fn(params, *args), args)``, and what the second layer adds: ``(one, two, ops per layer, moving transposes per
    layer; constants left out: how many a program names differs between JAX versions)``."""
    from jax_nkilib.models import llama

    def census(layers):
        config = llama.LlamaConfig(
            vocab=256, hidden=256, layers=layers, heads=heads, kv_heads=1, intermediate=512, max_len=256
        )
        fn, args = step(llama, config)
        return op_census(fn, llama.init_params(config, jax.random.key(0)), *args)

    one, two = census(1), census(2)
    per_layer = {name: two.ops.get(name, 0) - one.ops.get(name, 0) for name in two.ops if name != "constant"}
    return one, two, {name: n for name, n in per_layer.items() if n}, two.moving_transposes - one.moving_transposes


def test_llama_decode_step_census_per_layer():
    """A Llama decode step whose layers hold one kv head: each layer adds one attention_block_tkg and one mlp (its
    RMSNorm fused), the two residual adds, free reshapes of the activations and caches, and the kernel's position
    inputs built from the step's cache lengths and RoPE tables (the [S_ctx, B, q, S] mask: iota, compare, and,
    broadcast, convert; the tables' [B, S, d/2] -> [d/2, B, S] transposes, of B * d/2 elements each) — the same
    values in every layer. No cache is copied, sliced, concatenated or scattered outside the kernel."""

    def step(llama, config):
        run = lambda p, t, n, c: llama.decode_step(p, config, t, n, c)  # noqa: E731
        return run, (jnp.zeros(2, jnp.int32), jnp.array([5, 9]), llama.init_cache(config, 2))

    one, two, per_layer, _ = llama_census(step, heads=4)
    assert one.kernels == ("attention_block_tkg", "mlp", "rmsnorm_tkg")
    assert two.kernels == ("attention_block_tkg", "mlp") * 2 + ("rmsnorm_tkg",)
    assert {name: n for name, n in per_layer.items() if n} == {
        "add": 2,  # the residual adds
        "reshape": 8,
        "transpose": 2,  # cos, sin to the kernel's [d/2, B, S]
        "iota": 2,
        "compare": 6,
        "and": 2,
        "broadcast_in_dim": 15,
        "convert": 2,
        "subtract": 1,
    }, per_layer
    assert not {"concatenate", "slice", "dynamic_update_slice", "scatter", "copy"} & set(two.ops)


@pytest.mark.parametrize("batch", [1, 2])
def test_llama_prefill_census_per_layer(batch):
    """A Llama prefill whose layers have head_dim 128 and one kv head (a tensor-parallel shard): each layer adds
    qkv (RMSNorm and RoPE fused; its weight is the grouped w_qkv by a reshape), attention_cte, output_projection_cte
    and mlp (RMSNorm fused); between them only q/k/v's three contiguous slices of qkv's NBSd output (attention_cte
    takes them as three tensors), the cache writes of the new keys and values (dynamic_update_slice), the two
    residual adds and free reshapes and transposes. At batch 1 no transpose moves data (before: 2 per layer, q and k
    to attention_cte's [batch * heads, d, seq]; 6 slices, 3 of them the weight's, and the weight's concatenate). At
    batch 2 one does: q's [heads, batch, ...] to attention_cte's rows [batch * heads, ...], which no qkv layout
    writes. The RoPE tables' widening to the kernel's [batch, seq, head_dim] (2 concatenate, 2 broadcast of [seq,
    head_dim/2] tables) is position input, the same values in every layer."""

    def step(llama, config):
        run = lambda p, t, c: llama.prefill(p, config, t, c)  # noqa: E731
        return run, (jnp.zeros((batch, 128), jnp.int32), llama.init_cache(config, batch))

    one, two, per_layer, moving = llama_census(step, heads=2)
    layer = ("qkv", "attention_cte", "output_projection_cte", "mlp")
    assert one.kernels == (*layer, "rmsnorm_tkg") and two.kernels == (*layer * 2, "rmsnorm_tkg")
    assert per_layer == {
        "add": 2,  # the residual adds
        "slice": 3,  # q, k, v: contiguous ranges of qkv's [heads, batch, seq, d]
        "dynamic_update_slice": 2,  # the cache writes
        "reshape": 7,
        "transpose": 10,  # in chains that cancel or move only unit axes (batch 1)
        "concatenate": 2,  # the RoPE tables, [t | t]
        "broadcast_in_dim": 2,  # ... over the batch
    }, per_layer
    assert moving == batch - 1
