"""``jaxpar.recompute``: MindSpore's ``Cell.recompute()`` as ``jax.checkpoint``.

MindSpore's ``Cell.recompute()`` (``mindspore/nn/cell.py``) marks every primitive of a cell,
except the cell's outputs, as recomputed: the backward pass runs the cell's forward again
instead of keeping its activations.  ``jax.checkpoint`` does the same for a function (its
inputs are saved; its outputs are the next block's inputs, so they are kept as MindSpore keeps
a cell's outputs), and jaxpar keeps that recomputation through its plans (``trace.py`` records
each checkpoint body, ``lower.py`` lowers it behind an optimization barrier as JAX does).

A policy says what is kept inside the block: ``"full"`` (nothing: MindSpore's recompute),
``"dots"`` (``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``: the outputs of
matrix products without batch dimensions, i.e. a layer's products with its weights, are kept;
the rest, attention's batched products included, is recomputed), ``"none"`` (no
recomputation), any ``jax.checkpoint`` policy, or ``"auto"``: in ``auto_parallel`` the plan
chooses one of ``none``/``dots``/``full`` per block under ``HardwareProfile.memory_per_device``
(``recompute_choice.py``); elsewhere ``"auto"`` recomputes nothing.

While a function is traced, every call of an ``"auto"`` block asks :func:`choosing` which
policy the k-th such call gets, and the context records the calls: the *layers* of the choice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from jaxpar._src.errors import ContextError
from jaxpar._src.modules import reclass_call

POLICIES = ("none", "dots", "full")  # the automatic choice's menu, least recomputation first


def checkpoint_policy(policy: str | Callable) -> Callable | None:
    """The ``jax.checkpoint`` policy of a name (``None``: keep nothing, recompute all).

    >>> checkpoint_policy("dots") is jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    True
    """
    if callable(policy):
        return policy
    if policy == "full":
        return jax.checkpoint_policies.nothing_saveable
    if policy == "dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    raise ContextError(_bad_policy(policy))


def _bad_policy(policy: Any) -> str:
    return (f"jaxpar.recompute: policy must be 'full', 'dots', 'none', 'auto' or a "
            f"jax.checkpoint policy (e.g. jax.checkpoint_policies.dots_saveable), got "
            f"{policy!r}.")


@dataclasses.dataclass
class Choosing:
    """What one trace decides for its ``"auto"`` blocks and what it saw of them."""

    policies: tuple[str, ...] | None  # per auto call, in call order; None: every one "none"
    seen: list[str] = dataclasses.field(default_factory=list)  # each auto call's name

    def policy(self, name: str) -> str:
        k = len(self.seen)
        self.seen.append(name)
        if self.policies is None or k >= len(self.policies):
            return "none"
        return self.policies[k]


_state = threading.local()


@contextlib.contextmanager
def choosing(policies: Sequence[str] | None = None) -> Iterator[Choosing]:
    """Traces inside it give the k-th ``"auto"`` block ``policies[k]`` and are recorded.

    >>> block = recompute(lambda x: jax.numpy.sin(x) * 2, policy="auto")
    >>> with choosing(["full"]) as c:
    ...     _ = jax.make_jaxpr(jax.grad(block))(1.0)
    >>> len(c.seen)
    1
    """
    record = Choosing(None if policies is None else tuple(policies))
    stack = _state.__dict__.setdefault("stack", [])
    stack.append(record)
    try:
        yield record
    finally:
        stack.pop()


def _auto_policy(name: str) -> str:
    stack = getattr(_state, "stack", None)
    return stack[-1].policy(name) if stack else "none"


def recompute(target: Any, *, policy: str | Callable = "full", mp_comm_recompute: bool = True,
              parallel_optimizer_comm_recompute: bool = False) -> Any:
    """Recomputes ``target``'s forward pass in the backward pass instead of keeping its
    activations (MindSpore's ``Cell.recompute()`` / ``mindspore.recompute``).

    Args:
      target: a function (returns ``jax.checkpoint`` of it), a Flax NNX module (marked in
        place, as MindSpore marks a cell, and returned; the mark survives ``nnx.split`` /
        ``merge``) or a Flax Linen module *class* (returns ``flax.linen.remat`` of it).
      policy: what the block keeps: ``"full"`` (nothing; default, MindSpore's recompute),
        ``"dots"`` (products with weights, ``dots_with_no_batch_dims_saveable``), ``"none"``,
        a ``jax.checkpoint`` policy, or ``"auto"`` (chosen per block by the ``auto_parallel``
        search to fit ``HardwareProfile.memory_per_device``; nothing recomputed elsewhere).
      mp_comm_recompute: MindSpore's default ``True``: the collectives of a recomputed block
        run again with it.  XLA inserts them after recomputation is decided, so ``False``
        (keep their results) cannot be honoured and raises.
      parallel_optimizer_comm_recompute: MindSpore's default ``False``: optimizer-parallel
        all-gathers of parameters are not recomputed (a block's parameters are its inputs,
        which ``jax.checkpoint`` keeps).  ``True`` raises, for the same reason.

    >>> import jax.numpy as jnp
    >>> def block(w, x):
    ...     return jnp.tanh(jnp.tanh(x @ w) @ w)
    >>> w, x = jnp.eye(4) * 0.5, jnp.ones((2, 4))
    >>> g = jax.grad(lambda w, x: recompute(block)(w, x).sum())(w, x)
    >>> bool(jnp.allclose(g, jax.grad(lambda w, x: block(w, x).sum())(w, x)))
    True
    """
    if not mp_comm_recompute or parallel_optimizer_comm_recompute:
        raise ContextError(
            "jaxpar.recompute: mp_comm_recompute=False and parallel_optimizer_comm_recompute="
            "True are not supported: XLA's SPMD partitioner inserts the collectives after "
            "recomputation is decided, so a recomputed block always runs its collectives again "
            "and keeps its parameters (its inputs). Leave both at MindSpore's defaults.")
    if not (callable(policy) or policy in (*POLICIES, "auto")):
        raise ContextError(_bad_policy(policy))
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(target, nnx.Module):
        return _mark_module(target, policy)
    linen = sys.modules.get("flax.linen")
    if linen is not None and isinstance(target, type) and issubclass(target, linen.Module):
        if policy == "auto":
            raise ContextError("jaxpar.recompute: policy='auto' needs a function or an NNX "
                               "module; a Linen class takes a fixed policy.")
        return target if policy == "none" else linen.remat(target,
                                                           policy=checkpoint_policy(policy))
    if linen is not None and isinstance(target, linen.Module):
        raise ContextError(
            f"jaxpar.recompute: a Linen module instance ({type(target).__name__}) cannot be "
            f"changed in place; pass its class, jaxpar.recompute({type(target).__name__}), "
            f"and build the module from what it returns.")
    if not callable(target):
        raise ContextError(f"jaxpar.recompute: target must be a function, a Flax NNX module "
                           f"or a Linen module class, got {type(target).__name__}.")
    name = _name(target)

    @functools.wraps(target)
    def recomputed(*args: Any, **kwargs: Any) -> Any:
        chosen = _auto_policy(name) if policy == "auto" else policy
        if chosen == "none":
            return target(*args, **kwargs)
        return jax.checkpoint(target, policy=checkpoint_policy(chosen))(*args, **kwargs)

    recomputed.recompute_policy = policy  # type: ignore[attr-defined]
    return recomputed


def _name(target: Any) -> str:
    code = getattr(target, "__code__", None)
    where = f" ({code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno})" if code else ""
    return f"{getattr(target, '__qualname__', type(target).__name__)}{where}"


_RECOMPUTED: dict[type, type] = {}


def _mark_module(module: Any, policy: str | Callable) -> Any:
    """Gives ``module`` a subclass whose ``__call__`` runs under ``nnx.remat``; the policy is a
    static attribute, so ``nnx.split``/``merge`` keep it.  As MindSpore's interface, a module
    is configured once (again with the same policy is a no-op)."""
    from flax import nnx

    current = getattr(module, "recompute_policy", None)
    if hasattr(type(module), "_jaxpar_unrecomputed"):
        if current == policy:
            return module
        raise ContextError(
            f"jaxpar.recompute: this {type(module).__name__} is already recomputed with "
            f"policy {current!r}; like MindSpore's Cell.recompute() a module is configured "
            f"once. Build a new module to use policy {policy!r}.")
    def wrap(base: type) -> Callable:
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
            chosen = self.recompute_policy
            if chosen == "auto":
                chosen = _auto_policy(f"{base.__qualname__} (NNX module)")
            if chosen == "none":
                return base.__call__(self, *args, **kwargs)
            return nnx.remat(base.__call__, policy=checkpoint_policy(chosen))(
                self, *args, **kwargs)
        return __call__

    reclass_call(module, _RECOMPUTED, "_jaxpar_unrecomputed", wrap)
    module.recompute_policy = policy
    return module
