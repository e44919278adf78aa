"""Tracing a function to an :class:`OpGraph`.

``jax.make_jaxpr`` gives the program; nested ``jit``, ``custom_jvp_call``, ``custom_vjp_call``,
``closed_call`` and ``jax.checkpoint`` (``remat2``) bodies are inlined (the jaxpr is already
differentiated, so their custom rules have done their work; a checkpoint body is also recorded
as a :class:`RematBlock`, so that lowering keeps its recomputation), while ``scan``, ``while``
and ``cond`` stay units whose bodies join the graph behind ``enter``/``exit`` pseudo-operators.
Dead equations are dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import numpy as np

from jaxpar._src.compat import scan_counts, source_location, transposed
from jaxpar._src.graph import (
    CondRegion,
    Const,
    Crossing,
    Node,
    NodeKind,
    Operand,
    OpGraph,
    RematBlock,
    Role,
    ScanRegion,
    Value,
    WhileRegion,
    build_consumers,
)

# Call-like primitives whose body is inlined, and where their body lives in ``eqn.params``.
_INLINE = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}
# ``jax.checkpoint``: ``remat2`` in JAX 0.10 and 0.11 (``checkpoint`` in older releases).
_REMAT = ("remat2", "checkpoint", "remat")

WHILE_TRIP_ESTIMATE = 1.0  # a while loop's trip count is unknown when planning


@dataclasses.dataclass(frozen=True, eq=False)
class TracedProgram:
    """A traced function: its graph plus what is needed to call it with pytrees."""

    graph: OpGraph
    jaxpr: jcore.ClosedJaxpr
    in_tree: Any  # treedef of the tuple of dynamic (non-static) positional arguments
    out_tree: Any
    in_paths: tuple[str, ...]  # per flattened input, e.g. "params.w1"
    out_paths: tuple[str, ...]
    arg_index: tuple[int, ...]  # per flattened input, which positional argument it came from
    out_shapes: Any  # pytree of ShapeDtypeStruct


def trace(fn: Callable, args: Sequence[Any], *, static_argnums: Sequence[int] = (),
          arg_names: Sequence[str] | None = None) -> TracedProgram:
    """Traces ``fn(*args)`` (abstractly: only shapes and dtypes are used)."""
    static = set(static_argnums)
    abstract = [a if i in static else jax.tree.map(_abstract, a) for i, a in enumerate(args)]
    closed, out_shapes = jax.make_jaxpr(fn, static_argnums=tuple(static_argnums),
                                        return_shape=True)(*abstract)
    dyn = tuple(a for i, a in enumerate(args) if i not in static)
    dyn_index = [i for i in range(len(args)) if i not in static]
    leaves_with_path, in_tree = jax.tree_util.tree_flatten_with_path(dyn)
    names = list(arg_names) if arg_names is not None else [f"arg{i}" for i in range(len(args))]
    in_paths, arg_index = [], []
    for path, _ in leaves_with_path:
        pos = dyn_index[path[0].idx]
        rest = dotted(path[1:])
        in_paths.append(f"{names[pos]}.{rest}" if rest else names[pos])
        arg_index.append(pos)
    out_leaves, out_tree = jax.tree_util.tree_flatten_with_path(out_shapes)
    out_paths = [f"out.{dotted(p)}" if p else "out" for p, _ in out_leaves]
    graph = _Builder().build(closed, in_paths, out_paths)
    return TracedProgram(graph, closed, in_tree, out_tree, tuple(in_paths), tuple(out_paths),
                         tuple(arg_index), out_shapes)


def dotted(path: Sequence[Any]) -> str:
    """A pytree key path as ``"params.layers.0.kernel"``."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def _abstract(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return abstract_value(x)


def wider_than_canonical(dtype: Any) -> bool:
    """Whether JAX would canonicalize ``dtype`` to another (a 64-bit dtype outside
    ``jax_enable_x64``); never for an extended dtype (a PRNG key's), which JAX keeps as it is.

    >>> import numpy as np
    >>> wider_than_canonical(np.float32), wider_than_canonical(jax.random.key(0).dtype)
    (False, False)
    """
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return False
    return bool(np.dtype(dtype) != jax.dtypes.canonicalize_dtype(dtype))


def abstract_value(x: Any) -> Any:
    """The abstract value ``jax.jit`` traces an array argument ``x`` with (else ``x``).

    A ``ShapeDtypeStruct`` canonicalizes its dtype, but ``jax.jit`` traces a ``jax.Array`` with
    its own: a float64 array made under ``jax.enable_x64(True)`` and passed outside it is a
    float64 input (the program's first promotion converts it to float32, with JAX's warning).
    Traced as float32, the program would be handed float64 data.  NumPy arrays and Python
    numbers are canonicalized by ``jax.jit`` too, so their struct is theirs.

    >>> import jax.numpy as jnp
    >>> with jax.enable_x64(True):
    ...     x = jnp.zeros(2, jnp.float64)
    >>> traced = jax.make_jaxpr(lambda v: v)  # outside x64, as jax.jit(lambda v: v)(x) traces
    >>> traced(abstract_value(x)).in_avals, traced(jax.ShapeDtypeStruct((2,), "float64")).in_avals
    ([ShapedArray(float64[2])], [ShapedArray(float32[2])])
    """
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        return x
    weak = getattr(x, "weak_type", False)
    if isinstance(x, jax.Array) and wider_than_canonical(x.dtype):
        return jax.core.ShapedArray(x.shape, x.dtype, weak_type=weak)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=weak)


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[dict[str, Any]] = []
        self.values: list[Value] = []
        self.remats: list[RematBlock] = []
        self._backward = False  # walking an equation JAX's transpose made (or its body)
        self._shapes: dict[tuple[Any, ...], tuple[int, ...]] = {}

    # -- construction -------------------------------------------------------------------------
    # Nodes are dicts of Node's fields until _finish renumbers them; a control node's region
    # is a dict of lists (its exits are added as they are made), an enter or exit node's
    # crossing a (control, role, index) triple.
    def _node(self, kind: NodeKind, name: str, inputs: Sequence[Operand],
              out_avals: Sequence[Any], seq: list[int], **fields: Any) -> tuple[int, list[int]]:
        nid = len(self.nodes)
        outs = []
        values, shapes = self.values, self._shapes
        for j, aval in enumerate(out_avals):
            vid = len(values)
            shape = aval.shape
            # Every layer repeats a few shapes: each converted once (and then shared).
            kept = shapes.get(shape)
            if kept is None:
                kept = shapes[shape] = tuple(int(d) for d in shape)
            values.append(Value(vid, kept, aval.dtype, nid, j))
            outs.append(vid)
        fields.setdefault("backward", self._backward)
        self.nodes.append(dict(id=nid, kind=kind, name=name, inputs=list(inputs), outputs=outs,
                               **fields))
        seq.append(nid)
        return nid, outs

    def build(self, closed: jcore.ClosedJaxpr, in_paths: Sequence[str],
              out_paths: Sequence[str]) -> OpGraph:
        order: list[int] = []
        env: dict[Any, Operand] = {}
        jaxpr = closed.jaxpr
        inputs = []
        for var, path in zip(jaxpr.invars, in_paths, strict=True):
            nid, (vid,) = self._node(NodeKind.INPUT, "input", (), [var.aval], order,
                                     label=path)
            env[var] = vid
            inputs.append(nid)
        self._bind_consts(jaxpr.constvars, closed.consts, env, order, 1.0, None)
        self._walk(jaxpr, env, order, 1.0, None)
        outputs = []
        for var, path in zip(jaxpr.outvars, out_paths, strict=True):
            nid, _ = self._node(NodeKind.OUTPUT, "output", [self._read(env, var)], (), order,
                                label=path)
            outputs.append(nid)
        return self._finish(order, inputs, outputs)

    def _bind_consts(self, constvars: Sequence[Any], consts: Sequence[Any], env: dict,
                     seq: list[int], weight: float, region: int | None,
                     remat: int | None = None) -> None:
        for var, val in zip(constvars, consts, strict=True):
            nid, (vid,) = self._node(NodeKind.CONST, "const", (), [var.aval], seq, weight=weight,
                                     region=region, constant=val, remat=remat)
            env[var] = vid

    @staticmethod
    def _read(env: dict, var: Any) -> Operand:
        if isinstance(var, jcore.Literal):
            aval = var.aval
            return Const(var.val, tuple(aval.shape), aval.dtype)
        return env[var]

    def _walk(self, jaxpr: jcore.Jaxpr, env: dict, seq: list[int], weight: float,
              region: int | None, remat: int | None = None) -> None:
        """Adds ``jaxpr``'s equations to ``seq``; ``remat``: the checkpoint block they are in
        (nodes of loop bodies are not: their sequence is the body's)."""
        outer = self._backward
        for eqn in jaxpr.eqns:
            # A body inlined below inherits its equation's mark (JAX marks only the outer one).
            self._backward = outer or transposed(eqn)
            self._eqn(eqn, env, seq, weight, region, remat)
        self._backward = outer

    def _eqn(self, eqn: Any, env: dict, seq: list[int], weight: float, region: int | None,
             remat: int | None) -> None:
        name = eqn.primitive.name
        ins = [self._read(env, v) for v in eqn.invars]
        key = _INLINE.get(name)
        if key is not None and key in eqn.params:
            self._inline(eqn.params[key], ins, eqn.outvars, env, seq, weight, region, remat)
        elif name in _REMAT and "jaxpr" in eqn.params:
            block = self._remat_block(eqn, ins, remat)
            self._inline(eqn.params["jaxpr"], ins, eqn.outvars, env, seq, weight, region,
                         block)
        elif name == "scan":
            self._scan(eqn, ins, env, seq, weight, region, remat)
        elif name == "while":
            self._while(eqn, ins, env, seq, weight, region, remat)
        elif name == "cond":
            self._cond(eqn, ins, env, seq, weight, region, remat)
        else:
            _, outs = self._node(NodeKind.OP, name, ins, [v.aval for v in eqn.outvars], seq,
                                 eqn=eqn, source=source_location(eqn), weight=weight,
                                 region=region, remat=remat)
            for var, vid in zip(eqn.outvars, outs, strict=True):
                env[var] = vid

    def _inline(self, sub: Any, ins: Sequence[Operand], outvars: Sequence[Any], env: dict,
                seq: list[int], weight: float, region: int | None, remat: int | None) -> None:
        inner, consts = (sub.jaxpr, sub.consts) if isinstance(sub, jcore.ClosedJaxpr) else (sub, ())
        sub_env: dict[Any, Operand] = dict(zip(inner.invars, ins, strict=True))
        self._bind_consts(inner.constvars, consts, sub_env, seq, weight, region, remat)
        self._walk(inner, sub_env, seq, weight, region, remat)
        for var, inner_var in zip(outvars, inner.outvars, strict=True):
            env[var] = self._read(sub_env, inner_var)

    def _remat_block(self, eqn: Any, ins: Sequence[Operand], parent: int | None) -> int:
        """Records a checkpoint body: which of its inputs JAX's lowering puts behind an
        optimization barrier (``prevent_cse``, once differentiated)."""
        p = eqn.params
        prevent = p.get("prevent_cse", True)
        if not isinstance(prevent, tuple):
            prevent = (prevent,) * len(ins)
        differentiated = bool(p.get("differentiated", False))
        block = len(self.remats)
        self.remats.append(RematBlock(block, tuple(ins),
                                      tuple(differentiated and bool(x) for x in prevent),
                                      parent))
        return block

    # -- control flow -------------------------------------------------------------------------
    def _control(self, eqn: Any, ins: Sequence[Operand], seq: list[int], weight: float,
                 region: int | None, remat: int | None, **structure: Any) -> int:
        nid, _ = self._node(NodeKind.CONTROL, eqn.primitive.name, ins, (), seq, eqn=eqn,
                            source=source_location(eqn), weight=weight, region=region,
                            remat=remat, structure=dict(structure, exits=[]))
        return nid

    def _enter(self, role: Role, operand: Operand, aval: Any, cid: int, seq: list[int],
               weight: float, index: int, group: str) -> int:
        """An enter node, listed in its control node's region under ``group``."""
        nid, (vid,) = self._node(NodeKind.ENTER, role, [operand], [aval], seq, weight=weight,
                                 region=cid, crossing=(cid, role, index),
                                 source=self.nodes[cid]["source"])
        self.nodes[cid]["structure"][group].append(nid)
        return vid

    def _exit(self, role: Role, operands: Sequence[Operand], aval: Any, cid: int,
              outer_seq: list[int], weight: float, index: int) -> int:
        control = self.nodes[cid]
        nid, (vid,) = self._node(NodeKind.EXIT, role, operands, [aval], outer_seq, weight=weight,
                                 crossing=(cid, role, index), source=control["source"],
                                 region=control.get("region"), remat=control.get("remat"))
        control["structure"]["exits"].append(nid)
        return vid

    def _scan(self, eqn: Any, ins: list[Operand], env: dict, seq: list[int], weight: float,
              region: int | None, remat: int | None) -> None:
        p = eqn.params
        body = p["jaxpr"]
        nc, nk = scan_counts(p)
        body_seq: list[int] = []
        cid = self._control(eqn, ins, seq, weight, region, remat, kind="scan", body=body_seq,
                            consts=[], carries=[], xs=[])
        inner_w = weight * max(int(p["length"]), 1)
        benv: dict[Any, Operand] = {}
        for i, var in enumerate(body.jaxpr.invars):
            role, group = ((Role.CONST, "consts") if i < nc else
                           (Role.CARRY, "carries") if i < nc + nk else (Role.XS, "xs"))
            benv[var] = self._enter(role, ins[i], var.aval, cid, body_seq, inner_w, i, group)
        self._bind_consts(body.jaxpr.constvars, body.consts, benv, body_seq, inner_w, cid)
        self._walk(body.jaxpr, benv, body_seq, inner_w, cid)
        outs = [self._read(benv, v) for v in body.jaxpr.outvars]
        for k, node_id in enumerate(self.nodes[cid]["structure"]["carries"]):
            self.nodes[node_id]["inputs"].append(outs[k])  # the back edge
        for j, var in enumerate(eqn.outvars):
            role = Role.CARRY_OUT if j < nk else Role.YS
            env[var] = self._exit(role, [outs[j]], var.aval, cid, seq, weight, j)

    def _while(self, eqn: Any, ins: list[Operand], env: dict, seq: list[int], weight: float,
               region: int | None, remat: int | None) -> None:
        p = eqn.params
        cj, bj = p["cond_jaxpr"], p["body_jaxpr"]
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        enter_seq: list[int] = []
        cond_seq: list[int] = []
        body_seq: list[int] = []
        cid = self._control(eqn, ins, seq, weight, region, remat, kind="while", cond=cond_seq,
                            body=body_seq, carries=[], cond_consts=[], body_consts=[])
        inner_w = weight * WHILE_TRIP_ESTIMATE
        carries = ins[cn + bn:]
        carry_vals = [self._enter(Role.CARRY, operand, var.aval, cid, enter_seq, inner_w,
                                  cn + bn + k, "carries")
                      for k, (operand, var) in enumerate(zip(carries, bj.jaxpr.invars[bn:],
                                                             strict=True))]
        cenv: dict[Any, Operand] = {}
        for i, var in enumerate(cj.jaxpr.invars[:cn]):
            cenv[var] = self._enter(Role.CONST, ins[i], var.aval, cid, cond_seq, inner_w, i,
                                    "cond_consts")
        cenv.update(zip(cj.jaxpr.invars[cn:], carry_vals, strict=True))
        self._bind_consts(cj.jaxpr.constvars, cj.consts, cenv, cond_seq, inner_w, cid)
        self._walk(cj.jaxpr, cenv, cond_seq, inner_w, cid)
        self.nodes[cid]["structure"]["predicate"] = self._read(cenv, cj.jaxpr.outvars[0])
        benv: dict[Any, Operand] = {}
        for i, var in enumerate(bj.jaxpr.invars[:bn]):
            benv[var] = self._enter(Role.CONST, ins[cn + i], var.aval, cid, body_seq, inner_w,
                                    cn + i, "body_consts")
        benv.update(zip(bj.jaxpr.invars[bn:], carry_vals, strict=True))
        self._bind_consts(bj.jaxpr.constvars, bj.consts, benv, body_seq, inner_w, cid)
        self._walk(bj.jaxpr, benv, body_seq, inner_w, cid)
        outs = [self._read(benv, v) for v in bj.jaxpr.outvars]
        for k, node_id in enumerate(self.nodes[cid]["structure"]["carries"]):
            self.nodes[node_id]["inputs"].append(outs[k])  # the back edge
        for j, var in enumerate(eqn.outvars):
            env[var] = self._exit(Role.CARRY_OUT, [outs[j]], var.aval, cid, seq, weight, j)

    def _cond(self, eqn: Any, ins: list[Operand], env: dict, seq: list[int], weight: float,
              region: int | None, remat: int | None) -> None:
        branches = eqn.params["branches"]
        branch_seqs: list[list[int]] = [[] for _ in branches]
        cid = self._control(eqn, ins, seq, weight, region, remat, kind="cond",
                            branches=branch_seqs, operands=[])
        enter_seq: list[int] = []
        operands = [self._enter(Role.OPERAND, op, var.aval, cid, enter_seq, weight, i + 1,
                                "operands")
                    for i, (op, var) in enumerate(zip(ins[1:], branches[0].jaxpr.invars,
                                                      strict=True))]
        branch_outs = []
        for br, bseq in zip(branches, branch_seqs, strict=True):
            benv: dict[Any, Operand] = dict(zip(br.jaxpr.invars, operands, strict=True))
            self._bind_consts(br.jaxpr.constvars, br.consts, benv, bseq, weight, cid)
            self._walk(br.jaxpr, benv, bseq, weight, cid)
            branch_outs.append([self._read(benv, v) for v in br.jaxpr.outvars])
        for j, var in enumerate(eqn.outvars):
            merged = [outs[j] for outs in branch_outs]
            env[var] = self._exit(Role.MERGE, merged, var.aval, cid, seq, weight, j)

    # -- dead-code elimination and freezing ---------------------------------------------------
    def _finish(self, order: list[int], inputs: list[int], outputs: list[int]) -> OpGraph:
        live = self._live()
        remap = {old: new for new, old in enumerate(sorted(live))}
        vmap: dict[int, int] = {}
        values: list[Value] = []
        for v in self.values:
            producer = remap.get(v.producer)
            if producer is not None:  # (Value's constructor: dataclasses.replace is slower)
                vmap[v.id] = vid = len(values)
                values.append(Value(vid, v.shape, v.dtype, producer, v.index))

        def operand(o: Operand) -> Operand:
            return o if isinstance(o, Const) else vmap[o]

        def ids(seq: Sequence[int]) -> list[int]:
            return [remap[i] for i in seq if i in remap]

        nodes = []
        for old, new in remap.items():
            d = dict(self.nodes[old])
            d["id"] = new
            d["inputs"] = tuple(operand(o) for o in d["inputs"])
            d["outputs"] = tuple(vmap[v] for v in d["outputs"])
            if d.get("region") is not None:
                d["region"] = remap[d["region"]]
            if d.get("crossing") is not None:
                control, role, index = d["crossing"]
                d["crossing"] = Crossing(remap[control], role, index)
            if d.get("structure") is not None:
                d["structure"] = _freeze_region(d["structure"], ids, operand, self.nodes)
            nodes.append(Node(**d))
        remats = []
        for block in self.remats:  # inputs that only dead code read are gone
            kept = [(o, b) for o, b in zip(block.inputs, block.barrier, strict=True)
                    if isinstance(o, Const) or o in vmap]
            remats.append(dataclasses.replace(block, inputs=tuple(operand(o) for o, _ in kept),
                                              barrier=tuple(b for _, b in kept)))
        return OpGraph(tuple(nodes), tuple(values), tuple(ids(order)), tuple(ids(inputs)),
                       tuple(ids(outputs)), build_consumers(nodes, len(values)), tuple(remats))

    def _live(self) -> set[int]:
        """Nodes that an output, an effect or a kept structure depends on."""
        keep = set()
        work = []
        for n in self.nodes:
            eqn = n.get("eqn")
            effectful = eqn is not None and bool(getattr(eqn, "effects", None))
            if n["kind"] is not NodeKind.OP and n["kind"] is not NodeKind.CONST or effectful:
                work.append(n["id"])  # the boundary and control structure always stay
        while work:
            nid = work.pop()
            if nid in keep:
                continue
            keep.add(nid)
            n = self.nodes[nid]
            deps = list(n["inputs"])
            if n["kind"] is NodeKind.CONTROL and "predicate" in n["structure"]:
                deps.append(n["structure"]["predicate"])
            for o in deps:
                if isinstance(o, int):
                    work.append(self.values[o].producer)
        return keep



def _freeze_region(region: dict[str, Any], ids: Callable[[Sequence[int]], list[int]],
                   operand: Callable[[Operand], Operand], nodes: list[dict[str, Any]]
                   ) -> ScanRegion | WhileRegion | CondRegion:
    """A control node's region, renumbered, its exits by result position."""
    def seq(key: str) -> tuple[int, ...]:
        return tuple(ids(region[key]))

    exits = tuple(ids(sorted(region["exits"], key=lambda e: nodes[e]["crossing"][2])))
    if region["kind"] == "scan":
        return ScanRegion(seq("body"), seq("consts"), seq("carries"), seq("xs"), exits)
    if region["kind"] == "while":
        return WhileRegion(seq("carries"), seq("cond_consts"), seq("body_consts"), seq("cond"),
                           seq("body"), operand(region["predicate"]), exits)
    return CondRegion(seq("operands"), tuple(tuple(ids(b)) for b in region["branches"]), exits)
