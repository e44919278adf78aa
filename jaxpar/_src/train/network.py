"""The network a ``Model`` trains, in one functional form.

A Flax NNX module is split into its parameters (``nnx.Param``: differentiated and updated) and
the rest of its state (RNG counters, batch statistics: threaded through each call); a
``(params, apply_fn)`` pair is used as it is.  Either way the model calls
``apply(params, rest, *inputs) -> (outputs, rest)``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

from jaxpar._src.errors import ContextError


@dataclasses.dataclass
class Network:
    params: Any
    rest: Any
    apply: Callable[..., tuple[Any, Any]]
    module: Any = None  # the NNX module, updated when training ends
    graphdef: Any = None

    @classmethod
    def of(cls, network: Any) -> Network:
        nnx = sys.modules.get("flax.nnx")
        if nnx is not None and isinstance(network, nnx.Module):
            graphdef, params, rest = nnx.split(network, nnx.Param, ...)

            def apply(params: Any, rest: Any, *inputs: Any) -> tuple[Any, Any]:
                module = nnx.merge(graphdef, params, rest)
                out = module(*inputs)
                _, _, new_rest = nnx.split(module, nnx.Param, ...)
                return out, new_rest

            return cls(params, rest, apply, network, graphdef)
        if isinstance(network, (tuple, list)) and len(network) == 2 and callable(network[1]):
            params, fn = network

            def apply_pair(params: Any, rest: Any, *inputs: Any) -> tuple[Any, Any]:
                return fn(params, *inputs), rest

            return cls(params, (), apply_pair)
        raise ContextError(
            f"jaxpar.Model: network must be a Flax NNX module or a (params, apply_fn) pair with "
            f"apply_fn(params, *inputs) -> outputs; got {type(network).__name__}.")

    def write_back(self, params: Any, rest: Any) -> None:
        """Puts trained values into the NNX module (a pair keeps them in ``Model.params``)."""
        self.params, self.rest = params, rest
        if self.module is not None:
            from flax import nnx

            nnx.update(self.module, params, rest)
