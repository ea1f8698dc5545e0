"""Remat policies for jax_nkilib kernels: ``jax.checkpoint(f, policy=jax_nkilib.checkpoint_policies.<policy>)``.

Under ``jax.checkpoint`` the backward pass recomputes whatever the policy does not save; with no policy (or
``jax.checkpoint_policies.nothing_saveable``, or ``dots_saveable``, which saves no kernel call) every kernel's
forward runs twice. These policies save kernel results instead.

Residual names. What a differentiable kernel's forward saves for its backward carries a
``jax.ad_checkpoint.checkpoint_name``, given by the framework for every kernel alike:

* ``<kernel>.<operand>``: an input, e.g. ``attention_cte.q``, ``rmsnorm_tkg.gamma``;
* ``<kernel>.<output>``: an output of the forward's kernel call, statistics included: ``attention_cte.o`` and,
  when the ``attention_bwd`` kernel differentiates the call (the forward then runs with ``cache_softmax``),
  ``attention_cte.neg_max`` and ``attention_cte.recip``; ``mlp_forward_mxfp8_nki.gate_pre``, ``gate_act``, ``up``,
  ``intermediate``. An output named like an operand (the in-place ``k_cache`` / ``v_cache`` of ``qkv`` and
  ``swa_fused_cte``) is ``<kernel>.<output>_out``.

``<kernel>`` is the kernel's name in ``jax_nkilib.nki`` (as ``jax_nkilib.explain`` lists the calls), not the
idiomatic op's: ``jax_nkilib.attention`` saves ``attention_cte.*``, ``jax_nkilib.rms_norm`` ``rmsnorm_tkg.*``. The
named outputs are the values the rest of the program uses, so a saved output serves the layers after the kernel as
well. ``jax_nkilib.ring_attention`` (a JAX ring, not a kernel) names its residuals alike: ``ring_attention.q``,
``k``, ``v`` (inputs), ``ring_attention.out`` and ``lse`` (output and statistics).
``jax.ad_checkpoint.print_saved_residuals`` lists what a function saves.

Policies:

* :func:`save_kernel_outputs`: save every kernel's outputs and statistics, recompute everything else. The backward
  reruns no forward kernel, but reruns the JAX code between kernels (projections, reshapes, casts) where a
  kernel's backward needs its inputs. The least memory that keeps kernels from running twice.
* :func:`save_kernel_residuals`: save exactly the residuals of the kernels' VJPs (all the names above: inputs,
  outputs and statistics), recompute everything else. Also keeps the kernels' inputs, so the JAX code computing them
  is not rerun for the kernels' backward passes (JAX code whose own backward needs an intermediate still reruns).

For one layer of the idiomatic ops (``rms_norm``, a projection, ``attention``), ``jax.grad`` of the checkpointed
layer runs each forward kernel once under either policy, twice under ``nothing_saveable`` or ``dots_saveable``; the
projection's matmul runs again under ``save_kernel_outputs`` (and ``nothing_saveable``), not under
``save_kernel_residuals``.

Combine with JAX's policies (these return booleans, as ``save_from_both_policies`` requires)::

    policy = jax.checkpoint_policies.save_from_both_policies(
        jax_nkilib.checkpoint_policies.save_kernel_outputs, jax.checkpoint_policies.dots_saveable
    )

or pick residuals by name: ``jax.checkpoint_policies.save_only_these_names("attention_cte.o",
"attention_cte.neg_max", "attention_cte.recip")``. The policies match the ``checkpoint_name`` primitive, as JAX's
own name policies do (not the experimental ``jax_remat3`` mode).
"""

from jax_nkilib._src.framework.checkpoint_policies import save_kernel_outputs, save_kernel_residuals

__all__ = ["save_kernel_outputs", "save_kernel_residuals"]
