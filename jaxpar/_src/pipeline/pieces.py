"""The pieces a stage runs, evaluated from the planned micro-batch graph.

The loss is traced once at micro-batch size and planned by jaxpar on the mesh without ``"pp"``;
its nodes split into (see ``program.py``):

* weight work (what reads no batch input: a layer's slice of a stacked parameter, a causal
  mask): run before the loop by the enclosing program (:meth:`Pieces.weight_work`);
* the *prologue*: what the first layer needs from the batch (the embedding): stage 0, per
  micro-batch, at the start of chunk 0;
* the *layer*: one representative layer, run with each layer's stacked weights;
* the *epilogue*: the rest (final norm, head, loss; prologue work only the loss needs): the
  last stage, per micro-batch, at the end of the last chunk.

Each piece evaluates its nodes with the plan's sharding constraints over the non-``pp`` axes
(:func:`jaxpar._src.lower.evaluate_nodes` on the abstract mesh inside ``shard_map``), so the
layouts jaxpar chose for one micro-batch hold inside every stage.  What passes between pieces is
the *carried* list: the layer interface (the activation) followed by the batch-dependent
prologue values the layers or the epilogue read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxpar._src.graph import Const
from jaxpar._src.lower import evaluate_nodes
from jaxpar._src.spec import Spec


class Pieces:
    """Callables over lists of arrays for one :class:`PipelineProgram` (``program.py``)."""

    def __init__(self, program: Any, *, graph: Any = None, plan: Any = None) -> None:
        """``graph`` and ``plan``: another trace of the loss and its layouts (the same
        operators: ``groups.py``'s per-row-group one), else the program's."""
        self.p = program
        self.graph = program.graph if graph is None else graph
        self.plan = program.sub_plan if plan is None else plan

    # -- layouts ---------------------------------------------------------------------------
    def spec(self, vid: int) -> Spec:
        v = self.graph.values[vid]
        return self.plan.decisions[v.producer].out_specs[v.index]

    def mesh(self) -> Any:
        """The mesh constraints name: JAX's abstract mesh while one is set (inside
        ``shard_map`` it marks ``"pp"`` manual), else the program's."""
        mesh = jax.sharding.get_abstract_mesh()
        return self.p.mesh if mesh.empty else mesh

    def constrain(self, x: Any, spec: Spec) -> Any:
        sharding = NamedSharding(self.mesh(), spec.to_partition_spec())
        return jax.lax.with_sharding_constraint(x, sharding)

    def constrain_vids(self, xs: Sequence[Any], vids: Sequence[int]) -> list[Any]:
        return [self.constrain(x, self.spec(v)) for x, v in zip(xs, vids, strict=True)]

    def _run(self, seq: Sequence[int], env: dict) -> None:
        evaluate_nodes(self.graph, self.plan, self.mesh(), seq, env)

    def _seed(self, env: dict, vids: Sequence[int], xs: Sequence[Any]) -> None:
        for v, x in zip(vids, xs, strict=True):
            env[v] = self.constrain(x, self.spec(v))

    # -- the pieces ------------------------------------------------------------------------
    def weight_work(self, env: dict) -> None:
        """Runs the weight work into ``env`` (function inputs by value id), unconstrained:
        it runs in the enclosing step, whose own plan lays it out."""
        evaluate_nodes(self.graph, self.plan, self.mesh(), self.p.layers.weight_nodes, env,
                       constrain=False)

    def prologue(self, rest: Sequence[Any], batch: Sequence[Any]) -> list[Any]:
        """One micro-batch's carried values entering the first layer."""
        p = self.p
        env: dict = {}
        self._seed(env, p.rest, rest)
        self._seed(env, p.batch, batch)
        self._run(p.pro_nodes, env)
        return [env[v] for v in p.carried_in]

    def layer(self, weights: Sequence[Any], carried: Sequence[Any], rest: Sequence[Any],
              batch: Sequence[Any]) -> list[Any]:
        """One layer: the representative layer's nodes with this layer's stacked weights."""
        p = self.p
        rep = p.layers.layers[p.rep]
        n_act = len(rep.act_in)
        env: dict = {}
        self._seed(env, p.rest, rest)
        self._seed(env, [rep.weights[j] for j in p.stacked], weights)
        self._seed(env, rep.act_in, carried[:n_act])
        self._seed(env, p.carried_shared, carried[n_act:])
        self._seed(env, p.batch, batch)
        self._run(rep.nodes, env)
        out = [env[v] for v in rep.act_out] + list(carried[n_act:])
        return self.constrain_vids(out, p.carried_in)

    def epilogue(self, rest: Sequence[Any], carried: Sequence[Any], batch: Sequence[Any]
                 ) -> Any:
        """One micro-batch's loss from the last layer's carried values."""
        return self.epilogue_part(rest, carried, batch, self.p.epi_nodes,
                                  [self.p.out_operand])[0]

    def epilogue_part(self, rest: Sequence[Any], carried: Sequence[Any], batch: Sequence[Any],
                      nodes: Sequence[int], outs: Sequence[int], *,
                      bound: Sequence[int] = (), values: Sequence[Any] = ()) -> list[Any]:
        """Part of the epilogue (``ends.py``: the head a row group runs, or the tail on the
        whole micro-batch from the head's ``bound`` values): the values ``outs``."""
        p = self.p
        last = p.layers.layers[-1]
        n_act = len(last.act_out)
        env: dict = {}
        self._seed(env, p.rest, rest)
        self._seed(env, last.act_out, carried[:n_act])
        self._seed(env, p.carried_shared, carried[n_act:])
        self._seed(env, p.batch, batch)
        self._seed(env, bound, values)
        self._run(nodes, env)
        return [jnp.asarray(v.value) if isinstance(v, Const) else env[v] for v in outs]

    def chunk(self, weights: Sequence[Any], active: Any, carried: Sequence[Any],
              rest: Sequence[Any], batch: Sequence[Any]) -> list[Any]:
        """``k`` layer slots in a row (a scan over the chunk's stacked weights); an inactive
        slot (padding of a shorter chunk) passes its input through."""
        p = self.p
        k = p.split.slots
        if k == 1 and not p.split.padded:
            return self.layer([w[0] for w in weights], carried, rest, batch)

        def slot(c: list[Any], xs: tuple) -> tuple[list[Any], None]:
            w, on = xs
            if not p.split.padded:
                return self.layer(w, c, rest, batch), None
            out = jax.lax.cond(on, lambda c: self.layer(w, c, rest, batch),
                               lambda c: self.pass_through(w, c, on), c)
            return out, None

        out, _ = jax.lax.scan(slot, list(carried), (list(weights), active), length=k)
        return out


    def pass_through(self, weights: Sequence[Any], carried: Sequence[Any], on: Any
                     ) -> list[Any]:
        """An idle slot: its input, unchanged.  It reads its weights, laid out as the layer
        lays them out, through ``where(on, sum(w), 0)`` (0 here; a select, so a NaN-filled
        slot stays out): transposed, each weight's zero cotangent carries the layer's layout,
        where a weight not read gets an unconstrained zero and XLA refuses a conditional whose
        branches return one value laid out two ways (the grouped gradient ``[G, ...]``
        split over the row axes in the active branch)."""
        p = self.p
        rep = p.layers.layers[p.rep]
        out = list(carried)
        first = next((i for i, c in enumerate(out) if is_float(c)), None)
        if first is not None:
            ws = [self.constrain(w, self.spec(rep.weights[j]))
                  for w, j in zip(weights, p.stacked, strict=True) if is_float(w)]
            tie = sum((jnp.sum(w).astype(out[first].dtype) for w in ws),
                      jnp.zeros((), out[first].dtype))
            out[first] = out[first] + jnp.where(on, tie, jnp.zeros_like(tie))
        return self.constrain_vids(out, p.carried_in)


def is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def zero_cotangent(x: Any) -> Any:
    """The zero cotangent of ``x``: zeros, or ``float0`` for integers and booleans."""
    if is_float(x):
        return jnp.zeros(jnp.shape(x), jnp.result_type(x))
    return np.zeros(jnp.shape(x), jax.dtypes.float0)
