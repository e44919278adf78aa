"""``auto_mixed_precision``: MindSpore's AMP levels as a jaxpr transform.

The function is traced once per signature and evaluated equation by equation with casts chosen
by the level (``dtype`` is ``bfloat16`` or ``float16``):

* ``"O0"``: nothing changes (float32);
* ``"O1"``: matrix products and convolutions (MindSpore's white list) compute in ``dtype``, their
  results cast back to float32, everything else float32;
* ``"O2"``: everything computes in ``dtype`` except the numerically delicate operators, which
  stay float32: reductions, ``exp``/``log``, ``rsqrt``/``sqrt``, divisions, powers (MindSpore
  keeps its normalisation layers float32 at O2; these are what normalisation and softmax are
  made of);
* ``"O3"``: everything computes in ``dtype``.

Parameters stay float32 (master weights: their gradients are float32) and every result comes
back in its original dtype, so a loss and an optimizer around the network are unchanged.
Nested ``jit``, ``custom_jvp`` functions and ``scan`` bodies are transformed too; ``while``,
``cond`` and ``custom_vjp`` functions keep their precision (their inputs are cast back).

>>> import jax, jax.numpy as jnp, jaxpar
>>> f = jaxpar.auto_mixed_precision(lambda w, x: jnp.tanh(x @ w), "O2")
>>> jaxpr = jax.make_jaxpr(f)(jnp.ones((4, 4)), jnp.ones((2, 4))).jaxpr
>>> [(e.primitive.name, str(e.outvars[0].aval.dtype)) for e in jaxpr.eqns][2:]
[('dot_general', 'bfloat16'), ('tanh', 'bfloat16'), ('convert_element_type', 'float32')]
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np

from jaxpar._src.compat import bind_equation, scan_counts
from jaxpar._src.errors import ContextError

LEVELS = ("O0", "O1", "O2", "O3")
WHITE = frozenset({"dot_general", "conv_general_dilated"})  # O1: these in low precision
KEEP_FP32 = frozenset({  # O2: these stay float32
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin", "cumsum",
    "cumprod", "cummax", "cummin", "cumlogsumexp", "exp", "exp2", "log", "log1p", "expm1",
    "logistic", "rsqrt", "sqrt", "cbrt", "div", "rem", "pow", "erf", "erfc", "erf_inv", "lgamma",
    "digamma", "reduce_precision",
})
INLINE = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "custom_jvp_call": "call_jaxpr"}
REMAT = ("checkpoint", "remat")
UNCHANGED = frozenset({
    "convert_element_type", "bitcast_convert_type",  # the user's own casts
    # moving data, not computing: a float32 result of a kept operator stays float32 through them
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "slice", "rev", "copy",
    "copy_p", "stop_gradient", "sharding_constraint", "dynamic_slice", "gather",
})


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which dtype each operator computes in at one AMP level."""

    level: str
    dtype: Any  # the low-precision dtype

    def compute_dtype(self, name: str) -> Any:
        """The dtype float inputs are cast to, or ``None`` to leave them."""
        if self.level == "O0" or name in UNCHANGED:
            return None
        if self.level == "O1":
            return self.dtype if name in WHITE else jnp.float32
        if self.level == "O2" and name in KEEP_FP32:
            return jnp.float32
        return self.dtype


def auto_mixed_precision(network: Any, amp_level: str = "O2", dtype: Any = jnp.bfloat16) -> Any:
    """``network`` computing at ``amp_level`` (MindSpore's ``auto_mixed_precision``).

    Args:
      network: a function of arrays (pytrees), or a Flax NNX module (a module is returned that
        wraps it; its parameters stay float32 in the original module).
      amp_level: ``"O0"``, ``"O1"``, ``"O2"`` or ``"O3"`` (module docstring).
      dtype: ``jnp.bfloat16`` or ``jnp.float16``.

    >>> import jax.numpy as jnp, jaxpar
    >>> net = jaxpar.auto_mixed_precision(lambda w, x: x @ w, amp_level="O2")
    >>> net(jnp.ones((4, 2)), jnp.ones((3, 4))).dtype  # computed in bfloat16, returned in float32
    dtype('float32')
    """
    if amp_level not in LEVELS:
        raise ContextError(f"auto_mixed_precision: amp_level must be one of {list(LEVELS)}, got "
                           f"{amp_level!r}.")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ContextError(f"auto_mixed_precision: dtype must be jnp.bfloat16 or jnp.float16, got "
                           f"{dtype!r}.")
    policy = Policy(amp_level, jnp.dtype(dtype))
    if _is_nnx_module(network):
        from jaxpar._src.amp.nnx_module import MixedPrecision

        return MixedPrecision(network, policy)
    if not callable(network):
        raise ContextError(f"auto_mixed_precision: network must be a function or a Flax NNX "
                           f"module, got {type(network).__name__}.")
    return mixed_precision_fn(network, policy)


def mixed_precision_fn(fn: Callable, policy: Policy) -> Callable:
    """``fn`` evaluated under ``policy`` (its results in their original dtypes)."""
    if policy.level == "O0":
        return fn

    @functools.wraps(fn)
    def wrapped(*args: Any) -> Any:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        outs = evaluate(closed.jaxpr, closed.consts, jax.tree.leaves(args), policy)
        outs = [_cast(x, v.aval.dtype) for x, v in zip(outs, closed.jaxpr.outvars, strict=True)]
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return wrapped


def evaluate(jaxpr: jcore.Jaxpr, consts: Sequence[Any], args: Sequence[Any],
             policy: Policy) -> list[Any]:
    """Evaluates ``jaxpr`` with the casts of ``policy``."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for var, value in zip(jaxpr.constvars, consts, strict=True):
        env[var] = value
    for var, value in zip(jaxpr.invars, args, strict=True):
        env[var] = value
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs = _apply(eqn, ins, policy)
        for var, value in zip(eqn.outvars, outs, strict=True):
            env[var] = value
    return [read(v) for v in jaxpr.outvars]


def _apply(eqn: Any, ins: list[Any], policy: Policy) -> list[Any]:
    name = eqn.primitive.name
    key = INLINE.get(name)
    if key is not None and key in eqn.params:
        sub = eqn.params[key]
        inner, consts = (sub.jaxpr, sub.consts) if hasattr(sub, "consts") else (sub, ())
        return evaluate(inner, consts, ins, policy)
    if name in REMAT and "jaxpr" in eqn.params:
        body = eqn.params["jaxpr"]
        run = jax.checkpoint(lambda *a: evaluate(body, (), a, policy),
                             prevent_cse=eqn.params.get("prevent_cse", True),
                             policy=eqn.params.get("policy"))
        return list(run(*ins))
    if name == "scan":
        return _scan(eqn, ins, policy)
    if _has_subjaxpr(eqn):  # while, cond, custom_vjp: their own precision
        return bind_equation(eqn, [_cast(x, v.aval.dtype) for x, v in
                                   zip(ins, eqn.invars, strict=True)])
    compute = policy.compute_dtype(name)
    if compute is None:
        return bind_equation(eqn, ins)
    ins = [_cast(x, compute) if _is_float(x) else x for x in ins]
    params = eqn.params
    if "preferred_element_type" in params and params["preferred_element_type"] is not None \
            and jnp.issubdtype(params["preferred_element_type"], jnp.floating):
        params = dict(params, preferred_element_type=compute)
    outs = bind_equation(eqn, ins, params)
    if policy.level == "O1" and name in WHITE:
        outs = [_cast(x, v.aval.dtype) for x, v in zip(outs, eqn.outvars, strict=True)]
    return outs


def _scan(eqn: Any, ins: list[Any], policy: Policy) -> list[Any]:
    """``lax.scan`` rebuilt around the transformed body; carries keep their dtypes."""
    p = eqn.params
    body = p["jaxpr"]
    n_consts, n_carry = scan_counts(p)
    consts, carry, xs = ins[:n_consts], ins[n_consts:n_consts + n_carry], ins[n_consts + n_carry:]
    carry_avals = [v.aval for v in eqn.invars[n_consts:n_consts + n_carry]]
    carry = [_cast(c, a.dtype) for c, a in zip(carry, carry_avals, strict=True)]

    def step(c: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        outs = evaluate(body.jaxpr, body.consts, [*consts, *c, *x], policy)
        new = [_cast(o, a.dtype) for o, a in zip(outs[:n_carry], carry_avals, strict=True)]
        return new, outs[n_carry:]

    final, ys = jax.lax.scan(step, carry, xs, length=p["length"], reverse=p["reverse"],
                             unroll=p.get("unroll", 1))
    ys = [_cast(y, v.aval.dtype) for y, v in zip(ys, eqn.outvars[n_carry:], strict=True)]
    return [*final, *ys]


def _has_subjaxpr(eqn: Any) -> bool:
    return any(isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr)) or (
        isinstance(v, (tuple, list)) and v and isinstance(v[0], (jcore.Jaxpr, jcore.ClosedJaxpr)))
        for v in eqn.params.values())


def _is_float(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        dtype = np.result_type(x)
    return jnp.issubdtype(dtype, jnp.floating)


def _cast(x: Any, dtype: Any) -> Any:
    if not _is_float(x) or not jnp.issubdtype(dtype, jnp.floating):
        return x
    if getattr(x, "dtype", None) == dtype:
        return x
    return jax.lax.convert_element_type(x, dtype)


def _is_nnx_module(x: Any) -> bool:
    import sys

    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Module)
