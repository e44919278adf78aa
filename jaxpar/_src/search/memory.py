"""Per-device memory of a plan: what the compiled program holds.

:func:`lowered` models what XLA makes of a plan's program (the module docstring of
:mod:`jaxpar._src.program_memory` says how, and how close it comes): elementwise chains fused
and never stored, one copy per value and layout a reader takes it in, the outputs' own
allocations and the temporaries packed into one heap.  :func:`peak_memory` is what the
searches compare plans by; :func:`live_ranges` (values live from the node that produces them to
their last reader, in graph order, none fused) is the coarse form the exact search's linear
memory cuts and :func:`replicated_peak` use.
"""

from __future__ import annotations

import bisect
import dataclasses
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxpar._src.graph import Const, NodeKind, OpGraph
from jaxpar._src.rules import OpStrategy
from jaxpar._src.rules.elementwise import BINARY, UNARY
from jaxpar._src.spec import MeshShape, Spec

# Operators XLA fuses into the loop of their readers (loop fusion) and that fuse their
# operands in turn.
FUSIBLE = (frozenset(UNARY) | frozenset(BINARY) | {
    "select_n", "clamp", "integer_pow", "square", "convert_element_type", "broadcast_in_dim",
    "reshape", "squeeze", "expand_dims", "copy", "copy_p", "iota", "reduce_precision"}) - {
    "reshard", "mesh_cast"}
# Readers that take a fused operand besides FUSIBLE: reductions (XLA's reduce fusion).
_FUSING_READERS = FUSIBLE | {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax",
                             "argmin"}
# What XLA will not compute twice to fuse it into several readers (its ``IsExpensive``).
_EXPENSIVE = frozenset({"exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "erf",
                        "erfc", "erf_inv", "pow", "div", "sqrt", "rsqrt", "cbrt", "sin", "cos",
                        "tan", "atan2", "lgamma", "digamma", "integer_pow", "rem"})


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    peak: float  # bytes per device
    arguments: float  # bytes per device of the program's arguments
    at: int  # the graph position (node id) where the peak is reached


def live_ranges(graph: OpGraph) -> list[tuple[int, int, int]]:
    """``(value id, first position, last position)`` of every value."""
    end = len(graph.nodes)
    last = {v.id: v.producer for v in graph.values}
    for node in graph.nodes:
        for o in node.inputs:
            if isinstance(o, int):
                last[o] = max(last[o], node.id)
    out = []
    for v in graph.values:
        kind = graph.nodes[v.producer].kind
        held = kind in (NodeKind.INPUT, NodeKind.CONST)  # arguments live throughout
        first = 0 if held else v.producer
        stop = end if held else last[v.id]
        out.append((v.id, first, stop))
    return out


def peak_memory(graph: OpGraph, strategies: Mapping[int, OpStrategy], mesh: MeshShape, *,
                again: Callable[[int, int], bool] | None = None, packed: bool = True,
                temporaries: Sequence[tuple[float, int]] = ()) -> MemoryEstimate:
    """The memory per device of ``strategies`` compiled (:func:`lowered`): ``peak`` is its
    total (``packed=False``: the most bytes live at once, cheaper), ``at`` where the most
    bytes are live; ``temporaries``: ``(bytes, node)`` held while a node runs."""
    m = lowered(graph, strategies, mesh, again=again, packed=packed, temporaries=temporaries)
    return MemoryEstimate(m.total if packed else m.live_peak, m.arguments, m.at)


@dataclasses.dataclass(frozen=True)
class LoweredMemory:
    """Bytes per device of a compiled plan, as ``compiled.memory_analysis()`` counts them.

    Attributes:
      arguments: the arguments (held throughout; not donated).
      outputs: the results' allocations.
      heap: the temporaries that fit in no output allocation, packed.
      live_peak: the most bytes live at once (arguments included).
      at: the graph position (node id) of ``live_peak``.
    """

    arguments: float
    outputs: float
    heap: float
    live_peak: float
    at: int

    @property
    def total(self) -> float:
        """``arguments + outputs + heap``: ``memory_analysis()``'s arguments + outputs -
        aliased + temporaries."""
        return self.arguments + self.outputs + self.heap


def lowered(graph: OpGraph, specs: Mapping[int, Any] | Sequence[Any], mesh: MeshShape, *,
            again: Callable[[int, int], bool] | None = None,
            temporaries: Sequence[tuple[float, int]] = (), packed: bool = True
            ) -> LoweredMemory:
    """The memory of the program that gives each node ``specs[node id]``'s layouts
    (``.in_specs``, ``.out_specs``: a strategy or a plan's decision).  ``again(reader,
    operand)``: the reader's copy of the operand is one of its own (level 3's backward
    gathers); ``temporaries``: ``(bytes, node)`` held while a node runs; ``packed=False``:
    the live peak alone (``outputs`` and ``heap`` zero)."""
    structure = _structure(graph)
    if temporaries or not isinstance(specs, Mapping):
        arguments, buffers = _buffers(graph, structure, specs, mesh, again)
        buffers.extend((b, 2 * nid, 2 * nid, False, 2 * nid) for b, nid in temporaries)
        live_peak, at = _live_peak(buffers, 2 * len(graph.nodes) + 1)
    else:  # a plan compared before (the search's, then the plan made of it): its buffers
        for plan, mesh_of, again_of, found in structure.recent:
            if mesh_of == mesh and again_of is again and plan == specs:
                arguments, buffers, live_peak, at = found
                break
        else:
            arguments, buffers = _buffers(graph, structure, specs, mesh, again)
            live_peak, at = _live_peak(buffers, 2 * len(graph.nodes) + 1)
            if len(structure.recent) >= RECENT_PLANS:
                structure.recent.pop(0)
            structure.recent.append((dict(specs), mesh, again,
                                     (arguments, buffers, live_peak, at)))
    outs, heap = _assign(buffers) if packed else (0.0, 0.0)
    return LoweredMemory(arguments, outs, heap, arguments + live_peak, at // 2)


def _buffers(graph: OpGraph, structure: _Structure, specs: Any, mesh: MeshShape,
             again: Callable[[int, int], bool] | None
             ) -> tuple[float, list[tuple[float, int, int, bool, int]]]:
    """:func:`lowered`'s arguments (bytes) and buffers (``(bytes, first, last, an output, last
    for an output allocation)``, in half steps), temporaries left out."""
    fractions: dict[Spec, float] = {}

    def held(nbytes: int, spec: Spec) -> float:  # bytes per device
        f = fractions.get(spec)
        if f is None:
            f = fractions[spec] = spec.shard_fraction(mesh)
        return nbytes * f

    nodes = graph.nodes
    fused = _fused(graph, specs)
    end, soft = _ends(graph, fused)
    last = 2 * len(nodes)  # outputs live to here (positions in half steps: see _ends)
    outputs = set()
    for o in graph.outputs:
        x = nodes[o].inputs[0]
        if isinstance(x, int):
            v = graph.values[x]
            if specs[o].in_specs[0] == specs[v.producer].out_specs[v.index]:
                outputs.add(x)
    # a sharding constraint of an argument in its own layout is the argument: XLA's
    # partitioner drops the constraint and readers read the parameter's buffer
    same = {vid for vid, nid, arg in structure.pinned
            if vid not in outputs and specs[nid].in_specs[0] == specs[nid].out_specs[0]
            == specs[arg].out_specs[0]}
    arguments = 0.0
    buffers: list[tuple[float, int, int, bool, int]] = []
    for vid, producer, index, nbytes, argument in structure.values:
        if argument:
            arguments += held(nbytes, specs[producer].out_specs[index])
        elif vid not in fused and vid not in same:
            out = vid in outputs
            buffers.append((held(nbytes, specs[producer].out_specs[index]), 2 * producer,
                            last if out else end[vid], out, last if out else soft[vid]))
    # layout changes: one copy per value and layout (and per again(), its readers' own)
    spans: dict[tuple[int, Spec, bool], list[int]] = {}
    for nid, i, o, producer, index, output, outs in structure.reads:
        spec = specs[nid].in_specs[i]
        src = specs[producer].out_specs[index]
        if spec is src or spec == src:  # (most are the same object)
            continue
        at = 2 * nid - 1  # made just before its reader
        stop = last if output else max([2 * nid] + [end[x] for x in outs if x in fused])
        key = (o, spec, again is not None and again(nid, o))
        span = spans.setdefault(key, [at, stop])
        span[0], span[1] = min(span[0], at), max(span[1], stop)
    nbytes_of = structure.nbytes
    for (o, spec, _), (first, stop) in spans.items():
        buffers.append((held(nbytes_of[o], spec), first, stop, stop == last, stop))
    return arguments, buffers


def _lifetimes(graph: OpGraph) -> list[tuple[int, int, int, int, bool]]:
    """:func:`live_ranges` with each value's bytes and whether an input produces it, found
    once per graph: every plan compared is measured on the same graph (issue 14)."""
    found = _LIFETIMES.get(graph)
    if found is None:
        values, nodes = graph.values, graph.nodes
        found = _LIFETIMES[graph] = [
            (vid, first, stop, values[vid].nbytes,
             nodes[values[vid].producer].kind is NodeKind.INPUT)
            for vid, first, stop in live_ranges(graph)]
    return found


_LIFETIMES: weakref.WeakKeyDictionary[OpGraph, list] = weakref.WeakKeyDictionary()


def replicated_peak(graph: OpGraph) -> float:
    """Peak bytes per device if nothing were split: an upper bound for every plan."""
    n = len(graph.nodes) + 1
    delta = np.zeros(n + 1)
    for _, first, stop, b, _ in _lifetimes(graph):
        delta[first] += b
        delta[stop + 1] -= b
    return float(np.max(np.cumsum(delta)[:n]))


def _fused(graph: OpGraph, specs: Any) -> set[int]:
    """The values XLA fuses into their readers (never stored)."""
    fused = set()
    for nid, vid, uses in _structure(graph).fusible:
        spec = specs[nid].out_specs[0]
        if all(specs[c].in_specs[i] == spec for c, i in uses):
            fused.add(vid)
    return fused


def _ends(graph: OpGraph, fused: set[int]) -> tuple[dict[int, int], dict[int, int]]:
    """Where each value dies, in half steps (node ``p`` makes its results at ``2p``): at its
    last reader, or, read by a fused operator, where that operator's readers are (the fused
    loop reads it there).  And where it dies for an output allocation: at ``2p - 1`` when
    that reader is an elementwise loop, which may write its result over the operand (XLA's
    buffer assigner does not count an operand that dies where its reader's result is made,
    and that the reader can share, as interfering; its heap packing shares none)."""
    structure = _structure(graph)
    end: dict[int, int] = {}
    soft: dict[int, int] = {}
    every = fused.issuperset
    for vid, at, readers in structure.readers:
        e = f = at
        for at_reader, outs, fusible in readers:
            if outs and every(outs):
                e = max(e, *(end.get(o, at_reader) for o in outs))
                f = max(f, *(soft.get(o, at_reader) for o in outs))
            else:  # (the common case: comparisons, not calls of max)
                if at_reader > e:
                    e = at_reader
                if at_reader - fusible > f:
                    f = at_reader - fusible
        end[vid], soft[vid] = e, f
    return end, soft


# The plans one search compares (its own, the memory-lean one, data parallel), one of which
# the plan is then made of: their buffers are remembered (a graph holds them while it lives).
RECENT_PLANS = 3


@dataclasses.dataclass
class _Structure:
    """What :func:`_fused` and :func:`_ends` read of a graph, whatever the plan: found once
    per graph, as every plan compared is measured on the same graph (issue 14).

    Attributes:
      fusible: ``(node, its value, (reader, operand index) per use)`` of the operators that
        fuse into their readers when every reader takes the value in its producer's layout
        (the readers fuse operands, the operator is not too expensive to compute twice).
      readers: per value, in reverse graph order: ``(value, 2 * producer, readers)``, each
        reader ``(2 * reader, its outputs, 1 if an elementwise loop else 0)``.
      values: per value ``(value, producer, its result index, bytes, an argument)``.
      reads: per operand read (control nodes and constants left out), in graph order:
        ``(reader, operand index, value, producer, result index, an output, the reader's
        results)``.
      nbytes: per value, its bytes.
      pinned: ``(value, node, input node)`` of every sharding constraint of an argument.
      recent: the last plans :func:`lowered` measured (``(plan, mesh, again, (arguments,
        buffers, live peak, where))``): the plan a search chose is measured again when
        the plan is made.
    """

    fusible: list[tuple[int, int, tuple[tuple[int, int], ...]]]
    readers: list[tuple[int, int, list[tuple[int, tuple[int, ...], int]]]]
    values: list[tuple[int, int, int, int, bool]]
    reads: list[tuple[int, int, int, int, int, bool, tuple[int, ...]]]
    nbytes: list[int]
    pinned: list[tuple[int, int, int]]
    recent: list[tuple[dict, MeshShape, Any, tuple]]


def _structure(graph: OpGraph) -> _Structure:
    found = _STRUCTURES.get(graph)
    if found is not None:
        return found
    nodes = graph.nodes
    op = NodeKind.OP
    fusing = [node.kind is op and node.name in _FUSING_READERS for node in nodes]
    fusible = []
    for node in nodes:
        if node.kind is not op or node.name not in FUSIBLE or len(node.outputs) != 1:
            continue
        vid = node.outputs[0]
        uses = graph.consumers[vid]
        if not uses or (len(uses) > 1 and node.name in _EXPENSIVE):
            continue
        if all([fusing[c] for c, _ in uses]):
            fusible.append((node.id, vid, tuple([(c, i) for c, i in uses])))
    # what a value's reader is to :func:`_ends`, found once per reader (not once per read)
    reader = [(2 * node.id, tuple(node.outputs), int(node.kind is op and node.name in FUSIBLE))
              for node in nodes]
    consumers = graph.consumers
    readers = []
    for node in reversed(nodes):
        for vid in node.outputs:
            readers.append((vid, 2 * node.id, [reader[u.consumer] for u in consumers[vid]]))
    nbytes = [v.nbytes for v in graph.values]
    held = (NodeKind.INPUT, NodeKind.CONST)
    values = [(v.id, v.producer, v.index, nbytes[v.id], nodes[v.producer].kind in held)
              for v in graph.values]
    reads = [(node.id, i, o, graph.values[o].producer, graph.values[o].index,
              node.kind is NodeKind.OUTPUT, tuple(node.outputs))
             for node in nodes if node.kind is not NodeKind.CONTROL
             for i, o in enumerate(node.inputs) if not isinstance(o, Const)]
    pinned = []
    for node in nodes:
        if node.kind is NodeKind.OP and node.name == "sharding_constraint" and \
                len(node.inputs) == 1 and isinstance(node.inputs[0], int):
            arg = graph.values[node.inputs[0]].producer
            if nodes[arg].kind is NodeKind.INPUT:
                pinned.append((node.outputs[0], node.id, arg))
    found = _STRUCTURES[graph] = _Structure(fusible, readers, values, reads, nbytes, pinned,
                                            [])
    return found


_STRUCTURES: weakref.WeakKeyDictionary[OpGraph, _Structure] = weakref.WeakKeyDictionary()


def _live_peak(buffers: list[tuple[float, int, int, bool, int]], n: int
               ) -> tuple[float, int]:
    delta = np.zeros(n + 1)
    for b, first, stop, _, _ in buffers:
        delta[first] += b
        delta[stop + 1] -= b
    live = np.cumsum(delta)[:n]
    at = int(np.argmax(live))
    return float(live[at]), at


def _assign(buffers: list[tuple[float, int, int, bool, int]]) -> tuple[float, float]:
    """XLA's buffer assignment in outline: ``(output allocations, heap)`` bytes.

    Each output is an allocation of its own; every other buffer, largest first, goes into the
    first allocation at least its size (smallest first, the latest made first among equal
    sizes) whose spans it does not overlap, else onto the heap.  That first allocation is
    found for all allocations at once, over arrays of every span placed (:func:`_assign_scan`
    tries them one by one: issue 14, quadratic in the layers, 0.63 s at 96).

    An output made at 5 holds 4 bytes; of two 2-byte temporaries alive at once before it,
    one shares its allocation, the other goes onto the heap:

    >>> _assign([(4.0, 5, 9, True, 9), (2.0, 0, 3, False, 2), (2.0, 1, 5, False, 3)])
    (4.0, 2.0)
    """
    if any(b[1] > (b[2] if b[3] else b[4]) for b in buffers):  # pragma: no cover - no span
        return _assign_scan(buffers)  # ends before it starts; the arrays assume none does
    order = sorted(range(len(buffers)),
                   key=lambda i: (-buffers[i][0], not buffers[i][3], buffers[i][1]))
    n = len(buffers)
    sizes = np.empty(n)  # per allocation, in the order made (so largest first)
    smaller = np.empty(n)  # -sizes: ascending, for searchsorted
    starts = np.empty(n, dtype=np.int64)  # per span placed: start, end, allocation
    ends = np.empty(n, dtype=np.int64)
    owners = np.empty(n, dtype=np.int64)
    made = placed = 0
    heap: list[tuple[float, int, int]] = []
    for i in order:
        size, first, stop, out, shared = buffers[i]
        if size <= 0:
            continue
        if not out:
            # Outputs come largest first, so the allocations at least this size are the
            # first ``m`` made, and of those the smallest, latest made is the last: the
            # first in the scan's order is the last of them no placed span overlaps.
            m = int(np.searchsorted(smaller[:made], -size, side="right"))
            busy = np.zeros(m + 1, dtype=bool)
            overlap = (starts[:placed] <= shared) & (ends[:placed] >= first)
            busy[np.minimum(owners[:placed][overlap], m)] = True
            free = np.flatnonzero(~busy[:m])
            if not len(free):
                heap.append((size, first, stop))
                continue
            k = int(free[-1])
            stop = shared
        else:
            k = made
            sizes[made], smaller[made] = size, -size
            made += 1
        starts[placed], ends[placed], owners[placed] = first, stop, k
        placed += 1
    return float(sum(sorted(sizes[:made].tolist()))), _best_fit(heap)


def _assign_scan(buffers: list[tuple[float, int, int, bool, int]]) -> tuple[float, float]:
    """:func:`_assign` trying the allocations one by one (what it must equal: the tests
    compare them)."""
    order = sorted(range(len(buffers)),
                   key=lambda i: (-buffers[i][0], not buffers[i][3], buffers[i][1]))
    # output allocations, smallest first: size, and the (first, last) spans they hold, sorted
    sizes: list[float] = []
    held: list[list[tuple[int, int]]] = []
    heap: list[tuple[float, int, int]] = []
    for i in order:
        size, first, stop, out, shared = buffers[i]
        if size <= 0:
            continue
        if out:
            k = bisect.bisect_left(sizes, size)
            sizes.insert(k, size)
            held.insert(k, [(first, stop)])
            continue
        for k in range(bisect.bisect_left(sizes, size), len(sizes)):
            spans = held[k]
            j = bisect.bisect_left(spans, (first, shared))
            if (j == 0 or spans[j - 1][1] < first) and (j == len(spans) or spans[j][0] > shared):
                spans.insert(j, (first, shared))
                break
        else:
            heap.append((size, first, stop))
    return float(sum(sizes)), _best_fit(heap)


def _best_fit(heap: list[tuple[float, int, int]]) -> float:
    """The height of ``heap``'s buffers packed best fit: the smaller of two orders (largest
    first; longest-lived first), as XLA's ``ChooseBestHeapAlgorithm``."""
    if not heap:
        return 0.0
    size = np.array([b[0] for b in heap])
    first = np.array([b[1] for b in heap])
    stop = np.array([b[2] for b in heap])
    best = np.inf
    for order in (np.lexsort((first, -size)), np.lexsort((first, -size, first - stop))):
        offset = np.full(len(heap), np.nan)  # nan: not placed yet
        top = 0.0
        for i in order:
            near = ~np.isnan(offset) & (first <= stop[i]) & (stop >= first[i])
            lo = offset[near]
            hi = lo + size[near]
            at = 0.0
            if len(lo):
                k = np.argsort(lo)
                lo, hi = lo[k], np.maximum.accumulate(hi[k])
                starts = np.concatenate(([0.0], hi))  # each gap starts after all below it
                gaps = np.concatenate((lo, [np.inf])) - starts
                fit = np.nonzero(gaps >= size[i])[0]
                at = float(starts[fit[np.argmin(gaps[fit])]])
            offset[i] = at
            top = max(top, at + size[i])
        best = min(best, top)
    return float(best)
