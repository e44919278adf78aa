"""``jaxpar.pipeline_stage(i)``: optional stage markers in a forward pass.

MindSpore marks cells with ``cell.pipeline_stage = i``; here a marker is a JAX name scope
(``jaxpar_pipeline_stage_<i>``) around the computation, so it survives tracing, nested ``jit``
and NNX's split/merge, and costs nothing when no pipeline runs.  Three spellings::

    with jaxpar.pipeline_stage(1):          # around a sub-computation
        x = block(x)

    block = jaxpar.pipeline_stage(1)(block)  # on a function, or on a Flax NNX module in place

Without markers, :class:`jaxpar.PipelineCell` finds the repeated layers itself and chooses the
split (see ``layers.py`` and ``split.py``).
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable
from typing import Any

import jax

from jaxpar._src.errors import ContextError
from jaxpar._src.modules import reclass_call

STAGE_SCOPE = "jaxpar_pipeline_stage_"
_STAGE_RE = re.compile(STAGE_SCOPE + r"(\d+)")


class pipeline_stage:  # noqa: N801 - a context manager named like a function, as jax.named_scope
    """Marks a sub-computation, function or NNX module as pipeline stage ``stage``.

    With ``pipeline_interleave`` (``v`` chunks per stage) the markers number the chunks,
    ``0 .. S*v - 1``; chunk ``c`` runs on stage ``c % S``.  Marked regions must follow one
    another in program order and have the same structure (one SPMD program runs every stage).

    Args:
      stage: the stage (or chunk) index, ``>= 0``.

    >>> import jax, jax.numpy as jnp
    >>> def forward(w, x):
    ...     for i in range(2):
    ...         with pipeline_stage(i):
    ...             x = jnp.tanh(x @ w[i])
    ...     return x.sum()
    >>> jaxpr = jax.make_jaxpr(forward)(jnp.ones((2, 4, 4)), jnp.ones((2, 4)))
    >>> sorted({stage_of(str(e.source_info.name_stack)) for e in jaxpr.eqns} - {None})
    [0, 1]
    """

    def __init__(self, stage: int) -> None:
        if not isinstance(stage, int) or isinstance(stage, bool) or stage < 0:
            raise ContextError(f"jaxpar.pipeline_stage: the stage must be an int >= 0, got "
                               f"{stage!r}.")
        self.stage = stage
        self._scopes: list[Any] = []

    def __enter__(self) -> pipeline_stage:
        scope = jax.named_scope(f"{STAGE_SCOPE}{self.stage}")
        scope.__enter__()
        self._scopes.append(scope)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._scopes.pop().__exit__(*exc)

    def __call__(self, target: Any) -> Any:
        """Marks a function (returns a wrapper) or a Flax NNX module (in place; returned)."""
        nnx = sys.modules.get("flax.nnx")
        if nnx is not None and isinstance(target, nnx.Module):
            return _mark_module(target, self.stage)
        if not callable(target):
            raise ContextError(f"jaxpar.pipeline_stage({self.stage}) marks a function or a "
                               f"Flax NNX module, got {type(target).__name__}.")
        stage = self.stage

        @functools.wraps(target)
        def staged(*args: Any, **kwargs: Any) -> Any:
            with pipeline_stage(stage):
                return target(*args, **kwargs)

        return staged

    def __repr__(self) -> str:
        return f"pipeline_stage({self.stage})"


def stage_of(name_stack: str) -> int | None:
    """The innermost stage marker in a name stack such as ``"jvp(jaxpar_pipeline_stage_1)"``.

    >>> stage_of("transpose(jvp(jaxpar_pipeline_stage_3/attn))"), stage_of("block")
    (3, None)
    """
    found = _STAGE_RE.findall(name_stack)
    return int(found[-1]) if found else None


_STAGED: dict[type, type] = {}


def _mark_module(module: Any, stage: int) -> Any:
    """Gives ``module`` a subclass whose ``__call__`` runs under the stage's scope; the stage
    is a static attribute, so ``nnx.split``/``merge`` keep it."""
    def wrap(base: type) -> Callable:
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
            with pipeline_stage(self.pipeline_stage):
                return base.__call__(self, *args, **kwargs)
        return __call__

    reclass_call(module, _STAGED, "_jaxpar_unstaged", wrap)
    module.pipeline_stage = stage
    return module

