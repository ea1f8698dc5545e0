"""``adam_kernel`` / ``adamw_kernel`` (catalog row 82, docs-only: NKI Library 2.32 API reference
``nki/library/api/fused-adam.rst``; source ``nkilib/experimental/optimizer/fused_adam.py``, absent from the local
mirror's 2.29 and main, read in a newer version in the public code index): one fused ``torch.optim.Adam`` /
``AdamW`` step over a flat parameter and its state.

Operands (flat ``[N]``, one float dtype): ``param_ptr``, ``grad_ptr``, ``exp_avg_ptr`` (m), ``exp_avg_sq_ptr`` (v),
``max_exp_avg_sq_ptr`` (v_max; read and written only with ``amsgrad``, any ``[M]`` placeholder otherwise: the kernel
signature requires the argument). Host-side scalars as ``[128, 1]`` float32 tensors (see :mod:`.flat`):
``step_size_ptr = lr / (1 - beta1^t)``, ``inv_bc2_sqrt_ptr = 1 / sqrt(1 - beta2^t)`` and ``wd_factor_ptr``
(``adam_kernel``: lambda; ``adamw_kernel``: ``1 - lr * lambda``). Static: ``numel = N``, ``beta1``, ``beta2``,
``eps``, ``amsgrad``.

Math (float32, float64 for float64 operands; each output rounded to its operand's dtype), torch.optim's::

    g      = grad + lambda * param                     (adam_kernel: L2 regularization; adamw_kernel: g = grad)
    m      = beta1 * m + (1 - beta1) * g
    v      = beta2 * v + (1 - beta2) * g^2
    v_max  = max(v_max, v)                             (amsgrad)
    denom  = sqrt(v_max if amsgrad else v) * inv_bc2_sqrt + eps
    param  = param - step_size * m / denom             (adam_kernel)
    param  = param * wd_factor - step_size * m / denom (adamw_kernel: decoupled weight decay)

Outputs ``(param, exp_avg, exp_avg_sq[, max_exp_avg_sq])``, all ``[N]`` in ``param_ptr``'s dtype. The kernel
(``@nki.jit``; its source in the public code index) writes them to freshly allocated HBM tensors, not into its
operands, so the custom call declares no operand aliases: to reuse the buffers in place, donate the state to the
jitted step (``jax.jit(..., donate_argnums=...)``) and XLA reuses them. On the device each operation rounds to the
operands' dtype (the reference rounds once); the SPMD grid splits N over the cores, so any LNC works. Reverse mode
differentiates the reference (no backward kernel).
"""

from __future__ import annotations

import jax.numpy as jnp

from ..framework.primitive import make_kernel, reference_vjp
from ..framework.spec import CallInfo, KernelSpec, Operand, Param, accumulation_dtype
from .flat import NUMEL, SCALAR_LAYOUT, check_numel, scalar_value

MODULE = "nkilib.experimental.optimizer.fused_adam"
FLAT = ("param_ptr", "grad_ptr", "exp_avg_ptr", "exp_avg_sq_ptr")
STATE_OUTPUTS = {
    "param_ptr": "param",
    "exp_avg_ptr": "exp_avg",
    "exp_avg_sq_ptr": "exp_avg_sq",
    "max_exp_avg_sq_ptr": "max_exp_avg_sq",
}


def _adam_step(decoupled: bool):
    def reference(
        param_ptr,
        grad_ptr,
        exp_avg_ptr,
        exp_avg_sq_ptr,
        max_exp_avg_sq_ptr,
        step_size_ptr,
        inv_bc2_sqrt_ptr,
        wd_factor_ptr,
        *,
        numel,
        beta1,
        beta2,
        eps,
        amsgrad,
    ):
        del numel  # checked equal to N
        wide = accumulation_dtype(param_ptr.dtype)
        p, g, m, v = (x.astype(wide) for x in (param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr))
        step, inv_bc2_sqrt, wd = (
            scalar_value(s).astype(wide) for s in (step_size_ptr, inv_bc2_sqrt_ptr, wd_factor_ptr)
        )
        if not decoupled:
            g = g + wd * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * (g * g)
        outs = ()
        if amsgrad:
            v_max = jnp.maximum(max_exp_avg_sq_ptr.astype(wide), v)
            outs = (v_max.astype(max_exp_avg_sq_ptr.dtype),)
        denom = jnp.sqrt(v_max if amsgrad else v) * inv_bc2_sqrt + eps
        update = step * m / denom
        p = p * wd - update if decoupled else p - update
        return (
            p.astype(param_ptr.dtype),
            m.astype(exp_avg_ptr.dtype),
            v.astype(exp_avg_sq_ptr.dtype),
            *outs,
        )

    return reference


def _outputs(call: CallInfo):
    names = ("param_ptr", "exp_avg_ptr", "exp_avg_sq_ptr") + (("max_exp_avg_sq_ptr",) if call.params["amsgrad"] else ())
    return tuple((STATE_OUTPUTS[name], (call.dims["N"],), call.avals["param_ptr"].dtype) for name in names)


def _check(call: CallInfo) -> None:
    check_numel(call, FLAT + (("max_exp_avg_sq_ptr",) if call.params["amsgrad"] else ()))
    p, function = call.params, call.function
    for name in ("beta1", "beta2"):
        if not 0.0 <= p[name] < 1.0:
            raise ValueError(f"{function}: parameter `{name}` must be in [0, 1); got {p[name]}")
    if not p["eps"] >= 0.0:
        raise ValueError(f"{function}: parameter `eps` must be >= 0; got {p['eps']}")


def _spec(name: str, decoupled: bool, wd_doc: str) -> KernelSpec:
    flat = tuple(Operand.of(n, "N", doc=doc) for n, doc in zip(FLAT, ("parameter", "gradient", "m", "v")))
    scalars = tuple(
        Operand.of(n, SCALAR_LAYOUT, dtypes=(jnp.float32, jnp.float64), doc=doc)
        for n, doc in (
            ("step_size_ptr", "lr / (1 - beta1^t)"),
            ("inv_bc2_sqrt_ptr", "1 / sqrt(1 - beta2^t)"),
            ("wd_factor_ptr", wd_doc),
        )
    )
    v_max = Operand.switched(
        "max_exp_avg_sq_ptr", "amsgrad", {True: "N", False: "M"}, doc="v_max (amsgrad; else an unread placeholder)"
    )
    return KernelSpec(
        name=name,
        entry_point=f"{MODULE}:{name}",
        operands=flat + (v_max,) + scalars,
        params=(
            NUMEL,
            Param("beta1", None, float, "first-moment decay", required=True),
            Param("beta2", None, float, "second-moment decay", required=True),
            Param("eps", None, float, "added to the bias-corrected sqrt(v)", required=True),
            Param("amsgrad", False, bool, "use max(v_max, v) in the denominator and return v_max"),
        ),
        outputs=(),
        output_avals=_outputs,
        reference=_adam_step(decoupled),
        check=_check,
        mac_count=lambda call: 10 * call.dims["N"],
        family="optimizer",
        catalog="row 82",
        support={
            "idiomatic": f"jax_nkilib.optim.{'adamw' if decoupled else 'adam'}",
            "vjp": "JAX (differentiates the reference; no backward kernel)",
            "notes": "flat [N] param/grad/m/v -> new (param, m, v[, v_max]) (fresh outputs, no aliases: donate the "
            "state); host-side bias correction as "
            f"[128, 1] scalars; wd_factor = {wd_doc}",
        },
    )


adam_kernel = make_kernel(_spec("adam_kernel", False, "lambda (L2: grad += lambda * param)"), reference_vjp)
adamw_kernel = make_kernel(_spec("adamw_kernel", True, "1 - lr * lambda (decoupled)"), reference_vjp)
