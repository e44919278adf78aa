"""The arguments of ``jaxpar.parallelize``, checked once into a frozen record.

As ``jax.jit`` turns its arguments into a ``PjitInfo`` before the first call, ``parallelize``
turns its own into a :class:`ParallelizeInfo`: the mode and search names parsed, argument numbers
normalised and checked against the function's signature, option types checked.  Everything after
that (planning, pins, lowering) reads the record and never re-validates.  What depends on the
arguments of a call (shapes, trees) is checked when the call comes.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jax.sharding import Mesh

from jaxpar._src.context import ParallelMode
from jaxpar._src.errors import ContextError, PlanError
from jaxpar._src.hardware import PRESETS, HardwareProfile
from jaxpar._src.mesh import check_auto_axes
from jaxpar._src.search import search_modes

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@dataclasses.dataclass(frozen=True)
class ParallelizeInfo:
    """What ``parallelize(fn, ...)`` was given, validated (see :func:`parallelize_info`).

    ``None`` for ``mesh``, ``mode``, ``search_mode`` and ``hardware`` means "from the context at
    call time"; ``batch_argnums=None`` means "inferred".

    >>> info = parallelize_info(lambda x, y: x @ y, static_argnums=-1)
    >>> info.static_argnums, info.positional_names
    ((1,), ('x', 'y'))
    """

    fn: Callable
    api: str  # "jaxpar.parallelize(fn)": how errors name this function
    mesh: Mesh | None
    mode: ParallelMode | None
    search_mode: str | None
    in_strategy: Any
    out_strategy: Any
    hardware: HardwareProfile | str | None  # a profile, a preset name or 'calibrated'
    batch_argnums: tuple[int, ...] | None
    donate_argnums: tuple[int, ...]
    static_argnums: tuple[int, ...]
    parameter_plan: Mapping[str, Any] | None
    signature: inspect.Signature | None
    positional_names: tuple[str, ...]  # names of fn's positional parameters, in order
    varargs: bool  # fn takes *args: any number of positional arguments
    micro_batches: int | None = None  # pipeline micro-batches; None: the context's

    def arg_names(self, n: int) -> list[str]:
        """Names of ``n`` positional arguments: the parameter's name, else ``arg<i>``."""
        names = self.positional_names
        return [names[i] if i < len(names) else f"arg{i}" for i in range(n)]

    def bind(self, args: tuple, kwargs: Mapping[str, Any]) -> tuple:
        """The positional arguments of one call (keywords bound by name), checked against the
        argument numbers."""
        if kwargs:
            if self.signature is None:
                raise PlanError(f"{self.api}: this function has no signature to bind keyword "
                                f"arguments {sorted(kwargs)} to; pass them positionally.")
            try:
                bound = self.signature.bind(*args, **kwargs)
            except TypeError as e:
                raise PlanError(f"{self.api}: {e}.") from None
            if bound.kwargs:
                raise PlanError(f"{self.api}: keyword-only arguments {sorted(bound.kwargs)} are "
                                f"not supported; make them positional.")
            args = tuple(bound.args)
        used = {"static_argnums": self.static_argnums, "donate_argnums": self.donate_argnums,
                "batch_argnums": self.batch_argnums or ()}
        for what, nums in used.items():
            if nums and max(nums) >= len(args):
                raise PlanError(
                    f"{self.api}: {what}={nums}, but it was called with {len(args)} positional "
                    f"argument(s). Pass the argument, or drop {max(nums)} from {what}.")
        return args


def parallelize_info(fn: Callable, *, mesh: Mesh | None = None, parallel_mode: Any = None,
                     search_mode: str | None = None, in_strategy: Any = None,
                     out_strategy: Any = None, hardware: HardwareProfile | str | None = None,
                     batch_argnums: Sequence[int] | int | None = None,
                     donate_argnums: Sequence[int] | int = (),
                     static_argnums: Sequence[int] | int = (),
                     parameter_plan: Mapping[str, Any] | None = None,
                     api: str = "jaxpar.parallelize",
                     micro_batches: int | None = None) -> ParallelizeInfo:
    """Checks ``parallelize``'s arguments once; every problem is a :class:`JaxparError`.

    >>> parallelize_info(lambda x: x, donate_argnums=3)
    Traceback (most recent call last):
    ...
    jaxpar._src.errors.PlanError: jaxpar.parallelize(<lambda>): donate_argnums=(3,) names \
argument 3, but the function takes 1 positional argument(s) (x). Use numbers from 0 to 0 (or \
-1 to -1).
    """
    if not callable(fn):
        raise PlanError(f"{api}: expected a function to parallelize, got {fn!r}.")
    api = f"{api}({getattr(fn, '__name__', 'fn')})"
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise ContextError(f"{api}: mesh must be a jax.sharding.Mesh (see "
                               f"jaxpar.make_mesh), got {type(mesh).__name__}.")
        check_auto_axes(mesh, api)
    mode = None if parallel_mode is None else parse_mode(parallel_mode)
    if search_mode is not None and search_mode not in search_modes():
        raise ContextError(f"{api}: search_mode {search_mode!r} is not one of "
                           f"{list(search_modes())}.")
    if hardware is not None and not isinstance(hardware, HardwareProfile) and not (
            isinstance(hardware, str) and (hardware in PRESETS or hardware == "calibrated")):
        raise ContextError(f"{api}: hardware must be a jaxpar.HardwareProfile, a preset name "
                           f"({', '.join(sorted(PRESETS))}) or 'calibrated', e.g. "
                           f"HardwareProfile(preset='h100'); got {hardware!r}.")
    if parameter_plan is not None:
        if not isinstance(parameter_plan, Mapping) or not all(
                isinstance(k, str) for k in parameter_plan):
            raise ContextError(f"{api}: parameter_plan must be a dict from parameter names (or "
                               f"glob patterns) to strategies, e.g. {{'*.kernel': (1, 4)}}, got "
                               f"{parameter_plan!r}.")
        parameter_plan = types.MappingProxyType(dict(parameter_plan))
    if micro_batches is not None:
        from jaxpar._src.pipeline.config import check_micro_batches

        micro_batches = check_micro_batches(micro_batches, api)
    signature = _signature(fn)
    names, varargs = _positional(signature)
    batch, donate, static = check_argnums(fn, api, batch_argnums=batch_argnums,
                                          donate_argnums=donate_argnums,
                                          static_argnums=static_argnums)
    return ParallelizeInfo(fn, api, mesh, mode, search_mode, in_strategy, out_strategy, hardware,
                           batch, donate, static, parameter_plan, signature, names, varargs,
                           micro_batches)


def check_argnums(fn: Callable, api: str, *, batch_argnums: Sequence[int] | int | None,
                  donate_argnums: Sequence[int] | int, static_argnums: Sequence[int] | int
                  ) -> tuple[tuple[int, ...] | None, tuple[int, ...], tuple[int, ...]]:
    """``(batch, donate, static)`` argument numbers, normalised and checked against ``fn``'s
    signature as ``jax.jit`` checks them (``per_replica`` uses it too); ``batch`` stays ``None``
    when not given.

    >>> check_argnums(lambda x, y, n: x, "f", batch_argnums=1, donate_argnums=(),
    ...               static_argnums=-1)
    ((1,), (), (2,))
    """
    names, varargs = _positional(_signature(fn))
    count = None if varargs else len(names)
    static = _argnums(static_argnums, "static_argnums", count, names, api) or ()
    donate = _argnums(donate_argnums, "donate_argnums", count, names, api) or ()
    batch = _argnums(batch_argnums, "batch_argnums", count, names, api)
    for what, nums in (("donate_argnums", donate), ("batch_argnums", batch or ())):
        both = sorted(set(nums) & set(static))
        if both:
            raise PlanError(f"{api}: argument(s) {both} are in both static_argnums and {what}; "
                            f"a static argument is a Python value, not an array. Drop them from "
                            f"one of the two.")
    return batch, donate, static


def _positional(signature: inspect.Signature | None) -> tuple[tuple[str, ...], bool]:
    """Names of the positional parameters, and whether ``*args`` takes any number more."""
    if signature is None:
        return (), True
    names = tuple(n for n, p in signature.parameters.items() if p.kind in _POSITIONAL)
    varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL
                  for p in signature.parameters.values())
    return names, varargs


def parse_mode(mode: Any) -> ParallelMode:
    """A :class:`ParallelMode` from the enum or its string value."""
    try:
        return ParallelMode(str(mode.value if isinstance(mode, ParallelMode) else mode))
    except ValueError:
        raise ContextError(f"jaxpar: parallel_mode {mode!r} is not one of "
                           f"{[m.value for m in ParallelMode]}.") from None


def _argnums(x: Sequence[int] | int | None, what: str, count: int | None,
             names: Sequence[str], api: str) -> tuple[int, ...] | None:
    """Argument numbers as a sorted tuple of non-negative ints, in range when ``count`` is
    known (as ``jax.jit`` checks them against the signature)."""
    if x is None:
        return None
    nums: Any = (x,) if isinstance(x, int) else x
    try:
        nums = tuple(nums)
    except TypeError:
        nums = (x,)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in nums):
        raise PlanError(f"{api}: {what} must be an int or a sequence of ints, got {x!r}.")
    out = []
    for i in nums:
        if count is None:
            if i < 0:
                raise PlanError(f"{api}: {what}={nums} counts from the end, but the function "
                                f"takes any number of positional arguments (*args). Use "
                                f"non-negative argument numbers.")
        elif not -count <= i < count:
            shown = f" ({', '.join(names)})" if names else ""
            raise PlanError(f"{api}: {what}={nums} names argument {i}, but the function takes "
                            f"{count} positional argument(s){shown}. Use numbers from 0 to "
                            f"{count - 1} (or {-count} to -1).")
        out.append(i % count if count and i < 0 else i)
    return tuple(sorted(set(out)))


def _signature(fn: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None

