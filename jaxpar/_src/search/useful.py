"""Which factors are worth splitting.

Tensor dimensions that share a factor in some operator are one *class* (a union-find over
``(value, dimension)``): splitting one of them is what lets the others stay split without a
layout change.  A class is *useful* when a contraction (or a gather or scatter, or a user's pin)
can split it.  An operator that is none of these is offered no strategy splitting a factor whose
dimensions are all in useless classes: such a split (the height or width of an activation
between convolutions, which no convolution splits) only ever pays a layout change back to what
its neighbours hold.  On conv nets those options made every elementwise operator of a batch norm
several times larger in the search's problem, and its linear relaxation fractional (the ILP and
the dynamic programming's final graph then branched for minutes).

>>> from jaxpar._src.rules.factors import RuleBuilder
>>> b = RuleBuilder()
>>> n, h = b.factor(8), b.factor(4)
>>> rule = b.build(operands=[(n, h)], results=[(n, h)])
>>> sorted(_splittable_dims(rule, operands=(0,), results=(0,)))
[(0, 0, 0, 0), (0, 0, 1, 1), (1, 0, 0, 0), (1, 0, 1, 1)]
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from jaxpar._src.rules import FactorRule, OpCategory
from jaxpar._src.search.common import Pin, SearchSpace

# Seeds: operators whose rule is a contraction or indexing (gathers, scatters, dynamic slices).
SEEDS = (OpCategory.CONTRACTION, OpCategory.INDEXING)


def useless_factors(space: SearchSpace, pins: Iterable[Pin]) -> dict[int, frozenset[int]]:
    """Per node (not a seed, not pinned), the splittable factors of its rule whose dimensions
    no seed can split.  Empty when the program has no seed at all (then every split stays)."""
    graph = space.graph
    # (value, dimension) numbered: ``first[value] + dimension`` (a flat union-find is what
    # keeps this pass cheap on deep models: issue 14)
    first = [0] * (len(graph.values) + 1)
    for v in graph.values:
        first[v.id + 1] = first[v.id] + len(v.shape)
    parent = list(range(first[-1]))
    beyond: dict[tuple[int, int], int] = {}  # a rule's dimension the value lacks: its own id

    def numbered(vid: int, d: int) -> int:
        k = beyond.get((vid, d))
        if k is None:
            k = beyond[(vid, d)] = len(parent)
            parent.append(k)
        return k

    def find(x: int) -> int:
        root = x
        while parent[root] != root:
            root = parent[root]
        while parent[x] != root:
            parent[x], x = root, parent[x]
        return root

    # Per node, each factor with dimensions and one of them: a factor's dimensions are joined
    # into one class here, so one of them stands for all (issue 14: asking the class of every
    # dimension again was most of this pass).
    # (A dimension no other joined yet is its own root: found without a call, as most are.)
    factors_of: dict[int, list[tuple[int, int]]] = {}
    rule = space.rule
    for node in graph.searchable():
        inputs, outputs = node.inputs, node.outputs
        per_factor: list[tuple[int, int]] = []
        for f, dims in _factor_dims(rule(node.id)):
            root = head = -1
            for side, index, d in dims:
                vid = inputs[index] if side == 0 else outputs[index]
                if vid.__class__ is not int and not isinstance(vid, int):
                    continue  # (a constant operand has no value)
                m = first[vid] + d
                if m >= first[vid + 1]:
                    m = numbered(vid, d)
                other = m if parent[m] == m else find(m)
                if head < 0:
                    head = root = other
                    per_factor.append((f, m))
                elif other != root:
                    parent[root] = other
                    root = other
        factors_of[node.id] = per_factor
    useful: set[int] = set()
    pinned = {p.node: p for p in pins}
    seeds = space.in_category(*SEEDS)
    for node in graph.searchable():
        per_factor = factors_of[node.id]
        if node.id in seeds:
            useful.update(find(m) for _, m in per_factor)
        elif node.id in pinned:
            strategy = pinned[node.id].strategy
            useful.update(find(m) for f, m in per_factor if strategy.factor_axes[f])
    if not useful:
        return {}
    out: dict[int, frozenset[int]] = {}
    for node in graph.searchable():
        if node.id in pinned or node.id in seeds:
            continue
        dead = frozenset(f for f, m in factors_of[node.id] if find(m) not in useful)
        if dead:
            out[node.id] = dead
    return out


@functools.lru_cache(maxsize=4096)
def _factor_dims(rule: FactorRule) -> tuple[tuple[int, tuple[tuple[int, int, int], ...]], ...]:
    """:func:`_all_splittable_dims` of ``rule`` by factor, ``(factor, ((side, tensor index,
    dimension), ...))`` in order of each factor's first dimension: what a node's pass of
    :func:`useless_factors` walks, grouped once per rule (repeated layers share their rules).

    >>> from jaxpar._src.rules.factors import RuleBuilder
    >>> b = RuleBuilder()
    >>> n, h = b.factor(8), b.factor(4)
    >>> _factor_dims(b.build(operands=[(n, h)], results=[(n, h)]))
    ((0, ((0, 0, 0), (1, 0, 0))), (1, ((0, 0, 1), (1, 0, 1))))
    """
    by_factor: dict[int, list[tuple[int, int, int]]] = {}
    for side, index, d, f in _all_splittable_dims(rule):
        by_factor.setdefault(f, []).append((side, index, d))
    return tuple((f, tuple(dims)) for f, dims in by_factor.items())


@functools.lru_cache(maxsize=4096)
def _all_splittable_dims(rule: FactorRule) -> tuple[tuple[int, int, int, int], ...]:
    return tuple(_splittable_dims(rule, tuple(range(len(rule.operands))),
                                  tuple(range(len(rule.results)))))


def _splittable_dims(rule: FactorRule, operands: tuple[int, ...], results: tuple[int, ...]
                     ) -> Iterable[tuple[int, int, int, int]]:
    """``(side, tensor index, dimension, factor)`` for every splittable factor of each
    dimension (side 0: operands, 1: results)."""
    splittable = set(rule.splittable())
    for side, tensors, which in ((0, rule.operands, operands), (1, rule.results, results)):
        for index in which:
            for d, dim in enumerate(tensors[index]):
                for f in dim:
                    if f in splittable:
                        yield side, index, d, f


def prune(options: tuple, dead: frozenset[int]) -> tuple:
    """The options that give no mesh axis to a ``dead`` factor (all of them if none would
    remain)."""
    kept = tuple(c for c in options if not any(c.factor_axes[f] for f in dead))
    return kept or options

