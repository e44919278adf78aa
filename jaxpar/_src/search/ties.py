"""Ties the searches cannot see, resolved after them, each only when the cost stays the same.

**Names.** Two mesh axes of the same size with the same links are interchangeable: exchanging
them in every layout of a plan gives a plan of exactly the same cost, and a search picks between
the two by accident.  The user's names then decide: the batch belongs on an axis named like data
(``dp``, ``data``, ``batch``, ``fsdp``, ``replica``) and the parameters on one named like the
model (``mp``, ``tp``, ``model``, ``tensor``).  :func:`prefer_names` exchanges such axes in a
plan when that places fewer arguments against their names, never touching a user's pin, and
only when the exchanged plan costs the same.

**Whole arguments read split.** An argument held whole on every device but read by every reader
in one split layout (each device slices its part, for free) is the same plan as the argument
arriving split, with less memory; the searches' tie-break by bytes held is too small for the
integer program's tolerances, so :func:`split_inputs` does it.

>>> bool(DATA.match("dp")), bool(MODEL.match("tensor")), bool(DATA.match("mp"))
(True, True, False)
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Collection, Mapping

from jaxpar._src.rules import OpStrategy, strategy_for_specs
from jaxpar._src.search.common import SearchSpace
from jaxpar._src.spec import Spec

DATA = re.compile(r"^(dp|data|batch|fsdp|replica)", re.IGNORECASE)
MODEL = re.compile(r"^(mp|tp|model|tensor)", re.IGNORECASE)


def prefer_names(space: SearchSpace, strategies: Mapping[int, OpStrategy],
                 batch_inputs: Collection[int], pinned: Collection[int]
                 ) -> dict[int, OpStrategy]:
    """``strategies``, with interchangeable axes exchanged where that puts the batch
    (``batch_inputs``, the arguments data parallel splits) on data-named axes and the other
    arguments on model-named ones."""
    mesh, hw = space.model.mesh, space.model.hw
    graph = space.graph
    others = [n for n in graph.inputs if n not in batch_inputs]

    def misplaced(st: Mapping[int, OpStrategy]) -> int:
        wrong = sum(1 for n in batch_inputs for a in st[n].out_specs[0].axes if MODEL.match(a))
        return wrong + sum(1 for n in others for a in st[n].out_specs[0].axes if DATA.match(a))

    best, score = dict(strategies), misplaced(strategies)
    if not score:
        return best
    for a, b in itertools.combinations(mesh.names, 2):
        if mesh.size(a) != mesh.size(b) or hw.bandwidth(a, mesh) != hw.bandwidth(b, mesh) or \
                hw.latency(a, mesh) != hw.latency(b, mesh):
            continue
        swapped = {n: _exchange(s, a, b) for n, s in best.items()}
        if any(swapped[n] != best[n] for n in pinned):
            continue
        new = misplaced(swapped)
        if new < score and space.price(swapped).step_s <= space.price(best).step_s * (1 + 1e-9):
            best, score = swapped, new
    return best


def _exchange(s: OpStrategy, a: str, b: str) -> OpStrategy:
    def swap(axes: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(b if x == a else a if x == b else x for x in axes)

    def spec(sp: Spec) -> Spec:
        return Spec(tuple(swap(d) for d in sp.dims))

    return OpStrategy(tuple(swap(f) for f in s.factor_axes), tuple(spec(x) for x in s.in_specs),
                      tuple(spec(x) for x in s.out_specs),
                      tuple((swap((x,))[0], k) for x, k in s.partial))


def split_inputs(space: SearchSpace, strategies: Mapping[int, OpStrategy],
                 pinned: Collection[int]) -> dict[int, OpStrategy]:
    """``strategies`` with every whole argument that all its readers read in one split layout
    split that way (see the module docstring), if that costs no more."""
    graph = space.graph
    out = dict(strategies)
    for nid in graph.inputs:
        spec = out[nid].out_specs[0]
        if nid in pinned or not spec.is_replicated:
            continue
        readers = graph.consumers[graph.nodes[nid].outputs[0]]
        if any(c not in out for c, _ in readers):  # read by a loop itself: leave it
            continue
        reads = {out[c].in_specs[i] for c, i in readers}
        if len(reads) != 1:
            continue
        (want,) = reads
        if want.is_replicated:
            continue
        split = strategy_for_specs(space.rule(nid), {("out", 0): want}, space.model.mesh)
        if split is not None:
            out[nid] = split
    if out != strategies and \
            space.price(out).step_s > space.price(strategies).step_s * (1 + 1e-9):
        return dict(strategies)
    return out
