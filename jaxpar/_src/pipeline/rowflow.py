"""How a micro-batch's row dimension flows through one operator: the step of the row groups'
proof (``groups.py``) and of the ends' (``ends.py``, ``tail.py``).

:func:`row_step` takes an operator of the whole micro-batch's trace and the row dimension of
each value it reads, and gives the row dimensions of its results, the values from outside the
layer it reads a group's slice of, or why it may mix rows of two groups.  It checks the same
operator in the trace at a group's rows (``rows / G``): the same primitive with the same
parameters but for sizes, results shaped as the rows say (a value with rows ``G`` times smaller
on its row dimension, any other the same), so what is proven is what runs.  A trace at 1 row
per group may squeeze that dimension away (``take_along_axis`` takes a dimension of 1 for a
broadcast): only the gather that rewrite makes may read such a value (:func:`_one_row`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax.extend.core as jcore

from jaxpar._src.graph import Const, NodeKind, OpGraph

# (dim, minor): the row dimension of a value and the elements of that dimension per row (a
# reshape may merge the rows with a dimension after them: [rows, seq] -> [rows * seq]).
RowDim = tuple[int, int]
MIXED = (-1, -1)  # the state of a value that depends on rows of two groups (ends.py's tail)
# the ``minor`` of a value whose row dimension (of 1 row per group) the trace at ``rows / G``
# rows squeezed away (a size-1 dimension taken for a broadcast): only a gather may read it
SQUEEZED = 0

ELEMENTWISE = frozenset("""
    abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type copy
    copy_p cos cosh div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow
    is_finite le log log1p logistic lt max min mul ne neg nextafter not or pow real
    reduce_precision rem round rsqrt select_n sharding_constraint sign sin sinh sqrt square
    stop_gradient sub tan tanh xor""".split())
REDUCTIONS = frozenset("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or "
                       "reduce_xor argmax argmin".split())
CUMULATIVE = frozenset("cumsum cumprod cummax cummin cumlogsumexp".split())


def row_step(graph: OpGraph, small: OpGraph, nid: int, state: dict[int, RowDim],
             made: set[int], sliced: dict[int, RowDim], local: dict[int, RowDim],
             cut: dict[int, RowDim], rows: int, groups: int) -> str | None:
    """One operator of the proof (:func:`_mixes_rows`, and ``ends.py``'s): its results' row
    dimensions into ``local``, the values from outside (not ``made`` here) it reads a group's
    slice of into ``cut`` (:func:`_row_broadcast`), or why it may mix rows of two groups."""
    node = graph.nodes[nid]
    for o in node.inputs:
        if isinstance(o, Const):
            continue
        if state.get(o) == MIXED:
            return f"{node.name} reads mixed rows"
        if o not in made and o not in state and o not in sliced and \
                small.values[o].shape != graph.values[o].shape:
            c = _row_broadcast(graph, small, o)
            if c is None:
                return f"{node.name} ({node.source}) reads a value shaped by the row count"
            cut[o] = c
    ins = [None if isinstance(o, Const) else state.get(o) for o in node.inputs]
    if any(s is not None and s[1] == 0 for s in ins):  # a value the 1-row trace squeezed
        outs = _one_row(node, small.nodes[nid], ins, graph, rows, small)
    elif node.kind is NodeKind.OP:
        why = _same_operator(node, small.nodes[nid])
        if why is not None:
            return f"{why} ({node.source})"
        outs = _through(node, ins, graph, rows, small)
    elif any(s is not None for s in ins):
        return f"rows enter a {node.name} region ({node.source})"
    else:
        outs = [None] * len(node.outputs)
    if isinstance(outs, str):
        return f"{outs} ({node.source})"
    for vid, s in zip(node.outputs, outs, strict=True):
        want = list(graph.values[vid].shape)
        if s is not None:
            if want[s[0]] % groups:
                return f"{node.name} makes a row dimension of {want[s[0]]}"
            want[s[0]] //= groups
            local[vid] = s
        if tuple(small.values[vid].shape) != tuple(want):
            if s is not None and _squeezed(node, s, want, small.values[vid].shape):
                local[vid] = (s[0], SQUEEZED)
                continue
            return f"{node.name} ({node.source}) is shaped by the row count without carrying rows"
    return None


def _same_operator(node: Any, little: Any) -> str | None:
    """Why the group's trace runs another operator than the whole micro-batch's (which the
    proof reads), or ``None``: the same primitive with the same parameters but for sizes
    (tuples of integers of one length, or a reshape's, which the shapes checked after
    follow) and nested jaxprs (their operators are nodes of their own).  A function that
    branches on the row count (``mode="clip"`` in a gather only at a group's rows, say)
    would otherwise be proven on one program and run as another."""
    if little.name != node.name:
        return f"{node.name} is traced as {little.name} at a group's rows"
    mine, theirs = node.eqn.params, little.eqn.params
    if mine.keys() != theirs.keys():
        return f"{node.name} is traced with other parameters at a group's rows"
    for key, a in mine.items():
        b = theirs[key]
        if _sizes(a) and _sizes(b) and (len(a) == len(b) or key == "new_sizes"):
            continue  # sizes (a reshape's may drop a row dimension of 1: _squeezed checks)
        if isinstance(a, (jcore.ClosedJaxpr, jcore.Jaxpr)):
            continue
        if not _equal(a, b):
            return f"{node.name}'s {key} is {b!r} at a group's rows, {a!r} at the whole"
    return None


def _equal(a: Any, b: Any) -> bool:
    """Two operator parameters equal (a NaN fill value equals itself; parameters that do not
    compare are not equal)."""
    try:
        return bool(a == b) or (a != a and b != b)
    except Exception:  # noqa: BLE001 - e.g. arrays of several elements
        return False


def _sizes(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def _squeezed(node: Any, s: RowDim, want: list[int], got: Sequence[int]) -> bool:
    """A reshape that, traced at 1 row, drops the row dimension (of size 1) its whole-batch
    trace keeps: ``take_along_axis`` takes a dimension of 1 for a broadcast and reshapes the
    indices without it.  Row-major data is the same with or without a dimension of 1, so
    the 1-row value is the group's slice of the whole one, squeezed."""
    d, minor = s
    return node.name == "reshape" and minor == 1 and want[d] == 1 and \
        tuple(got) == tuple(want[:d] + want[d + 1:])


def _one_row(node: Any, little: Any, ins: list[RowDim | None], graph: OpGraph, rows: int,
             small: OpGraph) -> list[RowDim | None] | str:
    """The row dimensions of an operator reading a value the 1-row trace squeezed
    (:func:`_squeezed`): only the gather that pairs the rows of its operand and indices as
    batching dimensions, which at 1 row the trace writes with the operand's row dimension as
    an offset dimension (its whole size, 1) and the indices without it; the same elements
    (a batching index and an offset of a dimension of 1 both read its entry 0).  Anything
    else reading a squeezed value is refused."""
    why = f"{node.name} reads a value whose row dimension the trace at 1 row squeezed"
    if node.name != "gather" or ins[0] is None or ins[1] is None or ins[1][1] != 0 or \
            ins[0][1] == 0:
        return why
    whole: list[RowDim | None] = [ins[0], (ins[1][0], 1)]
    outs = _through(node, whole, graph, rows, small)
    if isinstance(outs, str):
        return outs
    p, q = node.eqn.params, little.eqn.params
    b, t = p["dimension_numbers"], q["dimension_numbers"]
    od, i = ins[0][0], ins[1][0]
    if i not in b.start_indices_batching_dims:
        return why
    assert od == b.operand_batching_dims[b.start_indices_batching_dims.index(i)]
    e = outs[0][0]  # type: ignore[index]
    rank = len(graph.operand_shape(node.inputs[0]))
    kept = [k for k in range(rank) if k not in b.collapsed_slice_dims
            and k not in b.operand_batching_dims]
    at = dict(zip(kept, b.offset_dims, strict=True)) | {od: e}
    expect = (tuple(at[k] for k in sorted(at)), tuple(b.collapsed_slice_dims),
              tuple(b.start_index_map), tuple(k for k in b.operand_batching_dims if k != od),
              tuple(k - (k > i) for k in b.start_indices_batching_dims if k != i))
    got = (tuple(t.offset_dims), tuple(t.collapsed_slice_dims), tuple(t.start_index_map),
           tuple(t.operand_batching_dims), tuple(t.start_indices_batching_dims))
    same = all(_equal(p[k], q[k]) for k in p if k not in ("dimension_numbers", "slice_sizes"))
    if got != expect or not same or tuple(p["slice_sizes"]) != tuple(q["slice_sizes"]):
        return f"{why}, traced there as another gather"
    return outs


def _row_broadcast(graph: OpGraph, small: OpGraph, vid: int) -> tuple[int, int] | None:
    """A value made outside the layer by broadcasting along a dimension the row count sizes
    (a causal mask stretched over the batch): the same along it, so each group may read its own
    ``small`` entries.  ``(dimension, entries)``, or ``None`` if it is not such a value."""
    big, little = graph.values[vid].shape, small.values[vid].shape
    diff = [e for e, (a, b) in enumerate(zip(big, little, strict=True)) if a != b]
    producer = graph.nodes[graph.values[vid].producer]
    if len(diff) != 1 or producer.name != "broadcast_in_dim" or \
            diff[0] in producer.eqn.params["broadcast_dimensions"]:
        return None
    return diff[0], little[diff[0]]


def _through(node: Any, ins: list[RowDim | None], graph: OpGraph, rows: int, small: OpGraph
             ) -> list[RowDim | None] | str:
    """The row dimensions of an operator's results, or why it mixes rows."""
    name, p = node.name, (node.eqn.params if node.eqn is not None else {})
    n_out = len(node.outputs)
    live = [s for s in ins if s is not None]
    if not live:
        if name == "broadcast_in_dim":  # constant along a new row dimension: any slice is it
            return [_broadcast_rows(node, graph, small, rows)]
        return [None] * n_out
    shapes = [graph.operand_shape(o) for o in node.inputs]
    out_shape = graph.values[node.outputs[0]].shape
    if name == "optimization_barrier":
        return list(ins)
    if name in ELEMENTWISE:  # operands broadcast as in numpy (the graph folds size-1 dims)
        moved = set()
        for s, shape in zip(ins, shapes, strict=True):
            if s is not None:
                e = s[0] + len(out_shape) - len(shape)
                if shape[s[0]] != out_shape[e]:
                    return f"{name} broadcasts its row operand"
                moved.add((e, s[1]))
        if len(moved) > 1:
            return f"{name} lines up rows on different dimensions"
        return [moved.pop()] * n_out
    s = live[0]
    d, minor = s
    if name == "broadcast_in_dim":
        bd = p["broadcast_dimensions"]
        if out_shape[bd[d]] != shapes[0][d]:
            return "broadcast_in_dim stretches the rows"
        return [(bd[d], minor)]
    if name == "transpose":
        return [(list(p["permutation"]).index(d), minor)]
    if name == "reshape":
        if p.get("dimensions") is not None:
            return "a reshape with dimensions"
        prefix = math.prod(shapes[0][:d])
        acc = 1
        for e, size in enumerate(out_shape):
            if acc == prefix and size % rows == 0 and size // rows >= 1:
                return [(e, size // rows)]
            acc *= size
        return "reshape splits the rows"
    if name in REDUCTIONS:
        axes = tuple(p["axes"])
        if d in axes:
            return f"{name} reduces over the rows"
        return [(d - sum(a < d for a in axes), minor)] * n_out
    if name in CUMULATIVE:
        return f"{name} runs along the rows" if p["axis"] == d else [s]
    if name == "squeeze":
        dims = tuple(p["dimensions"])
        return "squeeze drops the rows" if d in dims else [(d - sum(a < d for a in dims), minor)]
    if name == "rev":
        return "rev reverses the rows" if d in p["dimensions"] else [s]
    if name in ("concatenate", "sort"):
        key = "dimension"
        if len(set(live)) > 1 or any(x is None for x in ins):
            return f"{name} mixes operands with and without rows"
        return f"{name} runs along the rows" if p[key] == d else [s] * n_out
    if name == "split":  # jnp.split: each piece keeps the rows unless it cuts along them
        return "split cuts the rows" if p["axis"] % len(shapes[0]) == d else [s] * n_out
    if name == "stack":  # jnp.stack: a new dimension of one operand per index
        if len(set(live)) > 1 or any(x is None for x in ins):
            return "stack mixes operands with and without rows"
        axis = p["axis"] % len(out_shape)
        return [(d + (axis <= d), minor)]
    if name == "unstack":  # its transpose: the dimension cut into results
        axis = p["axis"] % len(shapes[0])
        return "unstack cuts the rows" if axis == d else [(d - (axis < d), minor)] * n_out
    if name == "pad":
        if ins[1] is not None or tuple(p["padding_config"][d]) != (0, 0, 0):
            return "pad pads the rows"
        return [s]
    if name == "slice":
        full = p["start_indices"][d] == 0 and p["limit_indices"][d] == shapes[0][d] and (
            p["strides"] is None or p["strides"][d] == 1)
        return [s] if full and ins[0] is not None else "slice cuts the rows"
    if name == "dynamic_slice":
        if any(x is not None for x in ins[1:]) or p["slice_sizes"][d] != shapes[0][d]:
            return "dynamic_slice cuts the rows"
        return [s]
    if name == "dynamic_update_slice":
        if any(x is not None for x in ins[2:]) or ins[0] != ins[1] or \
                shapes[1][d] != shapes[0][d]:
            return "dynamic_update_slice writes across rows"
        return [s]
    if name == "dot_general":
        return _dot(p, ins, shapes)
    if name == "gather":
        return _gather(p, ins, shapes, out_shape)
    return f"{name} is not known to keep rows apart"


def _broadcast_rows(node: Any, graph: OpGraph, small: OpGraph, rows: int) -> RowDim | None:
    """A broadcast of a row-free value whose shape is the row count's: rows along that
    dimension (constant along it); ``None`` when its shape does not follow the rows."""
    big = graph.values[node.outputs[0]].shape
    little = small.values[node.outputs[0]].shape
    diff = [e for e, (a, b) in enumerate(zip(big, little, strict=True)) if a != b]
    if len(diff) == 1 and big[diff[0]] % rows == 0:
        return (diff[0], big[diff[0]] // rows)
    return None


def _gather(p: dict, ins: list[RowDim | None], shapes: list, out_shape: Sequence[int]
            ) -> list[RowDim | None] | str:
    """A gather keeps rows apart when it indexes with the rows as a batch dimension of its
    indices (an embedding lookup: each row reads the table for its own tokens), reads the
    operand's rows whole (the offset dimension, every row kept), or pairs the operand's rows
    with the indices' as batching dimensions (a row picks its own label's logit).

    >>> from jax.lax import GatherDimensionNumbers as D
    >>> lookup = {"dimension_numbers": D(offset_dims=(2,), collapsed_slice_dims=(0,),
    ...     start_index_map=(0,), operand_batching_dims=(), start_indices_batching_dims=()),
    ...     "slice_sizes": (1, 64)}
    >>> _gather(lookup, [None, (0, 1)], [(50, 64), (4, 16, 1)], (4, 16, 64))
    [(0, 1)]
    >>> _gather(lookup, [None, (2, 1)], [(50, 64), (4, 16, 1)], (4, 16, 64))
    'gather indexes with the rows'
    """
    dn = p["dimension_numbers"]
    offset, collapsed = tuple(dn.offset_dims), tuple(dn.collapsed_slice_dims)
    index_map, op_batch = tuple(dn.start_index_map), tuple(dn.operand_batching_dims)
    idx_batch = tuple(dn.start_indices_batching_dims)
    batch_out = [e for e in range(len(out_shape)) if e not in offset]  # the indices' dims
    op, idx = ins[0], ins[1]
    if idx is not None:
        d, minor = idx
        if d == len(shapes[1]) - 1:  # the index vector dimension
            return "gather indexes with the rows"
        if op is not None:
            if d not in idx_batch or op != (op_batch[idx_batch.index(d)], minor):
                return "gather pairs the rows with another dimension"
        elif d in idx_batch:
            return "gather pairs the rows with another dimension"
        e = batch_out[d]
        return [(e, minor)] if out_shape[e] == shapes[1][d] else "gather cuts the rows"
    assert op is not None
    d, minor = op
    if d in collapsed or d in index_map or d in op_batch or \
            p["slice_sizes"][d] != shapes[0][d]:
        return "gather cuts the rows"
    kept = [i for i in range(len(shapes[0])) if i not in collapsed and i not in op_batch]
    return [(offset[kept.index(d)], minor)]


def _dot(p: dict, ins: list[RowDim | None], shapes: list) -> list[RowDim | None] | str:
    (lc, rc), (lb, rb) = p["dimension_numbers"]
    out: list[RowDim] = []
    for side, (s, c, b) in enumerate(((ins[0], lc, lb), (ins[1], rc, rb))):
        if s is None:
            continue
        d, minor = s
        if d in c:
            return "dot_general contracts over the rows"
        if d in b:
            pos = list(b).index(d)
            other = ins[1 - side]
            other_b = (rb if side == 0 else lb)[pos]
            if other is None or other != (other_b, minor):
                return "dot_general pairs the rows with another dimension"
            out.append((pos, minor))
            continue
        free_l = [i for i in range(len(shapes[0])) if i not in lc and i not in lb]
        free_r = [i for i in range(len(shapes[1])) if i not in rc and i not in rb]
        if side == 0:
            out.append((len(lb) + free_l.index(d), minor))
        else:
            out.append((len(lb) + len(free_l) + free_r.index(d), minor))
    if len(set(out)) != 1:
        return "dot_general pairs rows of its two operands"
    return [out[0]]
