"""Factor rules: one description of an operator from which all its strategies follow.

As in Shardy's sharding rules, an operator is described by *factors*, the loop dimensions of its
computation.  Each tensor dimension of an operand or result is one factor, a compound of factors
(``reshape``: one dimension that is several factors, major to minor), or none (it must stay
whole).  A strategy assigns mesh axes to factors; every tensor dimension then splits over the
axes of its factors.  Consequences, for free:

* a factor that appears in operands but not in results is a *reduction*: splitting it leaves
  partial results that an all-reduce (sum, max, ...) combines;
* a factor that only a result has (``iota``, a new ``broadcast_in_dim`` dimension) splits the
  work without any communication;
* a *blocked* factor may not be split (a sort axis, a concatenation axis, a spatial convolution
  dimension); the rule stays correct by never offering a strategy that splits it.

>>> b = RuleBuilder()
>>> m, n, k = b.factor(8), b.factor(16), b.factor(4)
>>> rule = b.build(operands=[(m, k), (k, n)], results=[(m, n)], reductions={k: "sum"},
...                flops=2 * 8 * 16 * 4)
>>> len(enumerate_strategies(rule, MeshShape(("x",), (2,))))
4
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import math
from collections.abc import Mapping, Sequence

from jaxpar._src.spec import MeshShape, Spec

Dim = tuple[int, ...]  # the factors of one tensor dimension, major to minor; () = none


class OpCategory(enum.StrEnum):
    """What kind of work an operator is, as the searches and plans treat it.

    A rule's category comes from :func:`register_rule` (``category=``).  A ``contraction`` (a
    matrix product, a convolution) is the work worth splitting: ``fully_use_devices`` splits it
    over every device, recursive programming decides it first and prices its cuts, and a
    gradient's path to the optimizer stops at it.  ``indexing`` (gathers, scatters) and
    ``contraction`` operators are listed by ``ShardingPlan.explain``.

    >>> OpCategory("contraction") is OpCategory.CONTRACTION, OpCategory.INDEXING == "indexing"
    (True, True)
    """

    CONTRACTION = "contraction"
    INDEXING = "indexing"
    OTHER = "other"


@dataclasses.dataclass(frozen=True)
class FactorRule:
    """How an operator's tensor dimensions share loop factors (see module docstring).

    >>> b = RuleBuilder()
    >>> m, k, n = b.factor(8), b.factor(16), b.factor(4)  # x[m, k] @ w[k, n] -> y[m, n]
    >>> rule = b.build([[m, k], [k, n]], [[m, n]], reductions={k: "sum"}, flops=2 * 8 * 16 * 4)
    >>> rule.sizes, rule.reductions
    ((8, 16, 4), ((1, 'sum'),))
    """

    sizes: tuple[int, ...]  # size of each factor
    operands: tuple[tuple[Dim, ...], ...]  # per operand, per dimension
    results: tuple[tuple[Dim, ...], ...]  # per result, per dimension
    reductions: tuple[tuple[int, str], ...] = ()  # (factor, "sum" | "max" | ...) pairs
    blocked: frozenset[int] = frozenset()  # factors that must not be split
    flops: float = 0.0  # global floating-point operations of one application
    category: OpCategory = OpCategory.OTHER
    _hash: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.sizes, self.operands, self.results,
                                                self.reductions, self.blocked, self.flops,
                                                self.category)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def reduction_kinds(self) -> dict[int, str]:
        return dict(self.reductions)

    def splittable(self) -> tuple[int, ...]:
        return tuple(f for f, size in enumerate(self.sizes)
                     if size > 1 and f not in self.blocked)


class RuleBuilder:
    """Allocates factors and assembles a :class:`FactorRule`.

    >>> b = RuleBuilder()
    >>> rows, cols = b.factors((8, 4))  # one factor per dimension of an elementwise operand
    >>> rule = b.build([[rows, cols]] * 2, [[rows, cols]])
    >>> rule.sizes, len(rule.operands), rule.reductions
    ((8, 4), 2, ())
    """

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.blocked: set[int] = set()

    def factor(self, size: int, *, blocked: bool = False) -> int:
        self.sizes.append(int(size))
        fid = len(self.sizes) - 1
        if blocked:
            self.blocked.add(fid)
        return fid

    def factors(self, shape: Sequence[int]) -> list[int]:
        return [self.factor(s) for s in shape]

    def build(self, operands: Sequence[Sequence[int | Dim | None]],
              results: Sequence[Sequence[int | Dim | None]], *,
              reductions: Mapping[int, str] | None = None, flops: float = 0.0) -> FactorRule:
        def dims(t: Sequence[int | Dim | None]) -> tuple[Dim, ...]:
            out = []
            for d in t:
                if d is None:
                    out.append(())
                elif isinstance(d, int):
                    out.append((d,))
                else:
                    out.append(tuple(d))
            return tuple(out)

        ops = tuple(dims(t) for t in operands)
        res = tuple(dims(t) for t in results)
        blocked = set(self.blocked)
        # Only the major (first non-trivial) factor of a compound dimension may be split: a
        # split minor factor would give every device a strided, non-contiguous piece.
        for tensor in ops + res:
            for d in tensor:
                real = [f for f in d if self.sizes[f] > 1]
                blocked.update(real[1:])
        return FactorRule(tuple(self.sizes), ops, res,
                          tuple(sorted((reductions or {}).items())), frozenset(blocked),
                          float(flops))


@dataclasses.dataclass(frozen=True, slots=True)
class OpStrategy:
    """One way to run an operator: mesh axes per factor and the layouts that follow."""

    factor_axes: tuple[tuple[str, ...], ...]
    in_specs: tuple[Spec, ...]
    out_specs: tuple[Spec, ...]
    partial: tuple[tuple[str, str], ...] = ()  # (mesh axis, reduction) left to combine
    _hash: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Strategies key the search's caches by the million: hash them once.
        object.__setattr__(self, "_hash", hash((self.factor_axes, self.in_specs,
                                                self.out_specs, self.partial)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        # The dataclass's comparison, faster: the same object first, then the kept hashes
        # (the search's caches meet equal strategies that are distinct objects: issue 14).
        if self is other:
            return True
        if other.__class__ is not self.__class__:
            return NotImplemented
        return (self._hash == other._hash
                and self.factor_axes == other.factor_axes
                and self.in_specs == other.in_specs
                and self.out_specs == other.out_specs
                and self.partial == other.partial)

    @property
    def axes_used(self) -> int:
        return sum(len(a) for a in self.factor_axes)


def specs_for(rule: FactorRule, factor_axes: Sequence[tuple[str, ...]]) -> OpStrategy:
    def spec(tensor: tuple[Dim, ...]) -> Spec:
        return Spec(tuple(tuple(a for f in d for a in factor_axes[f]) for d in tensor))

    kinds = rule.reduction_kinds
    partial = tuple((a, kinds[f]) for f in sorted(kinds) for a in factor_axes[f])
    return OpStrategy(tuple(tuple(a) for a in factor_axes),
                      tuple(spec(t) for t in rule.operands),
                      tuple(spec(t) for t in rule.results), partial)


@functools.lru_cache(maxsize=4096)
def enumerate_strategies(rule: FactorRule, mesh: MeshShape) -> tuple[OpStrategy, ...]:
    """Every valid strategy of ``rule`` on ``mesh``; the replicated one comes first.

    Each mesh axis goes to at most one splittable factor; a factor's axes must multiply to a
    divisor of its size; a factor with several axes is offered in every axis order.

    A strategy names mesh axes and layouts, not sizes: rules that differ only in their sizes
    (and flops) but split alike (every splittable factor's size has the same greatest common
    divisor with the device count, hence the same divisors among the products of mesh axes)
    share one list (:func:`_strategies`): a program's operators repeat a few shapes of rule
    (issue 14: 154 rules of the 6-layer GPT step, 87 lists).
    """
    splittable = rule.splittable()
    devices = mesh.num_devices
    return _strategies(len(rule.sizes), rule.operands, rule.results, rule.reductions,
                       splittable,
                       tuple(math.gcd(rule.sizes[f], devices) for f in splittable), mesh)


@functools.lru_cache(maxsize=4096)
def _strategies(factors: int, operands: tuple[tuple[Dim, ...], ...],
                results: tuple[tuple[Dim, ...], ...], reductions: tuple[tuple[int, str], ...],
                choices: tuple[int, ...], divisors: tuple[int, ...], mesh: MeshShape
                ) -> tuple[OpStrategy, ...]:
    """:func:`enumerate_strategies` of a rule of ``factors`` factors with these tensors and
    reductions whose
    splittable factors ``choices`` have ``divisors`` (their sizes' gcd with ``mesh.size``: a
    product of mesh axes divides a size exactly when it divides that gcd)."""
    divisor = dict(zip(choices, divisors, strict=True))
    per_axis = [(None,) + choices for _ in mesh.names]
    seen: set[tuple[tuple[str, ...], ...]] = set()
    out: list[OpStrategy] = []
    make = _Maker(operands, results, dict(reductions))
    for pick in itertools.product(*per_axis):
        groups: dict[int, list[str]] = {}
        for axis, f in zip(mesh.names, pick, strict=True):
            if f is not None:
                groups.setdefault(f, []).append(axis)
        if any(divisor[f] % mesh.product(axes) for f, axes in groups.items()):
            continue
        multi = [f for f, axes in groups.items() if len(axes) > 1]
        orders = [list(itertools.permutations(groups[f])) for f in multi]
        for combo in itertools.product(*orders):
            assign = {f: tuple(axes) for f, axes in groups.items()}
            for f, order in zip(multi, combo, strict=True):
                assign[f] = tuple(order)
            key = tuple(assign.get(f, ()) for f in range(factors))
            if key in seen:
                continue
            seen.add(key)
            out.append(make(key))
    out.sort(key=lambda s: s.axes_used)
    return tuple(out)


class _Maker:
    """:func:`specs_for` for many strategies of one rule: its reductions sorted once, and
    each layout built once (a rule's strategies repeat a few layouts per tensor)."""

    def __init__(self, operands: tuple[tuple[Dim, ...], ...],
                 results: tuple[tuple[Dim, ...], ...], kinds: dict[int, str]) -> None:
        self.operands, self.results = operands, results
        self.kinds = sorted(kinds.items())
        self.specs: dict[tuple[tuple[str, ...], ...], Spec] = {}

    def spec(self, tensor: tuple[Dim, ...], factor_axes: Sequence[tuple[str, ...]]) -> Spec:
        dims = tuple(tuple(a for f in d for a in factor_axes[f]) for d in tensor)
        spec = self.specs.get(dims)
        if spec is None:
            spec = self.specs[dims] = Spec(dims)
        return spec

    def __call__(self, factor_axes: tuple[tuple[str, ...], ...]) -> OpStrategy:
        partial = tuple((a, kind) for f, kind in self.kinds for a in factor_axes[f])
        return OpStrategy(factor_axes, tuple(self.spec(t, factor_axes) for t in self.operands),
                          tuple(self.spec(t, factor_axes) for t in self.results), partial)


def strategy_for_specs(rule: FactorRule, specs: Mapping[tuple[str, int], Spec],
                       mesh: MeshShape) -> OpStrategy | None:
    """The strategy whose layouts equal ``specs`` (keys ``("in"|"out", index)``), if one exists.

    Used for identity-like pseudo-operators whose layout is given (pins, boundaries), and by
    propagation for every operator (so the answers are remembered: layers repeat).
    """
    key = (rule, tuple(sorted(specs.items())), mesh)
    if key in _FOR_SPECS:
        return _FOR_SPECS[key]
    if len(_FOR_SPECS) > 65536:
        _FOR_SPECS.clear()
    strategy = _FOR_SPECS[key] = _strategy_for_specs(rule, specs, mesh)
    return strategy


_FOR_SPECS: dict[tuple, OpStrategy | None] = {}


def _strategy_for_specs(rule: FactorRule, specs: Mapping[tuple[str, int], Spec],
                        mesh: MeshShape) -> OpStrategy | None:
    assign: dict[int, tuple[str, ...]] = {}
    for (side, idx), spec in specs.items():
        tensor = (rule.operands if side == "in" else rule.results)[idx]
        if len(tensor) != spec.ndim:
            return None
        for dim, axes in zip(tensor, spec.dims, strict=True):
            real = [f for f in dim if rule.sizes[f] > 1]
            if not real:
                if axes:
                    return None
                continue
            f = real[0]
            if assign.setdefault(f, axes) != axes:
                return None
    used = [a for axes in assign.values() for a in axes]
    if len(used) != len(set(used)):
        return None  # one mesh axis would split two different factors
    for f, axes in assign.items():
        if axes and (f in rule.blocked or rule.sizes[f] % mesh.product(axes) != 0):
            return None
    factor_axes = tuple(assign.get(f, ()) for f in range(len(rule.sizes)))
    strategy = specs_for(rule, factor_axes)
    for (side, idx), spec in specs.items():
        got = (strategy.in_specs if side == "in" else strategy.out_specs)[idx]
        if got != spec:
            return None
    return strategy

