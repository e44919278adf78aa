"""A Flax NNX module computing under an AMP policy (imported only when Flax is in use)."""

from __future__ import annotations

from typing import Any

from flax import nnx

from jaxpar._src.amp.precision import Policy, mixed_precision_fn


class MixedPrecision(nnx.Module):
    """``module`` called at an AMP level; its parameters (and their gradients) stay float32.

    The wrapped module's state is read and written back around each call, so layers with state
    (batch statistics, RNG counters) keep working.
    """

    def __init__(self, module: nnx.Module, policy: Policy) -> None:
        self.module = module
        self.amp_level = policy.level
        self.amp_dtype = str(policy.dtype)
        self._policy = policy

    def __call__(self, *args: Any) -> Any:
        graphdef, state = nnx.split(self.module)

        def apply(state: Any, *args: Any) -> Any:
            module = nnx.merge(graphdef, state)
            out = module(*args)
            return out, nnx.state(module)

        out, new_state = mixed_precision_fn(apply, self._policy)(state, *args)
        nnx.update(self.module, new_state)
        return out
