"""ZeRO in the plan: an assignment as the lowering runs it, reduce-scatters and all.

At levels 1-3 the lowering makes each split weight gradient by reduce-scatter where the
backward pass contracts over the batch (:mod:`jaxpar._src.scatter`).  For the plan to say what
the compiled program runs, the contractions are found when a plan is priced, not when it is
lowered: :func:`lowered` runs :func:`~jaxpar._src.scatter.find_scatters` on a search's
assignment and returns the strategies with the layouts as lowered (the gradient split from its
contraction on) and the contractions to reduce-scatter.  ``SearchSpace.price`` prices those
(``combine.py``: a reduce-scatter of the local result, ``(n - 1) / n`` of its bytes sent, where
an all-reduce sends twice that), and ``make_plan`` keeps them in the plan
(``ShardingPlan.scatters``), which the lowering reads.

>>> import jax, jax.numpy as jnp, optax, jaxpar
>>> tx, p = optax.adam(0.1), {"w": jnp.ones((16, 8))}
>>> def step(p, s, x):
...     g = jax.grad(lambda p: jnp.sum((x @ p["w"]) ** 2))(p)
...     u, s = tx.update(g, s, p)
...     return optax.apply_updates(p, u), s
>>> with jaxpar.auto_parallel_context(enable_parallel_optimizer=True, parallel_optimizer_config={
...         "optimizer_level": "level1", "parallel_optimizer_threshold": 0}):
...     f = jaxpar.parallelize(step, mesh=jaxpar.make_mesh((8,), ("dp",)),
...                            parallel_mode="data_parallel")
...     plan = f.plan(p, tx.init(p), jnp.ones((64, 16)))
>>> plan.optimizer_level, [(c.kind, c.nbytes) for c in plan.predicted_collectives()]
(1, [('reduce-scatter', 512.0), ('all-gather', 512.0)])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jaxpar._src.graph import NodeKind, OpGraph
from jaxpar._src.plan import OpDecision, ShardingPlan
from jaxpar._src.rules import OpStrategy
from jaxpar._src.scatter import Scatter, find_scatters, unstacked
from jaxpar._src.spec import MeshShape

LEVELS = (1, 2, 3)  # the parallel optimizer levels whose gradients are reduce-scattered


def lowered(graph: OpGraph, strategies: Mapping[int, OpStrategy], mesh: MeshShape
            ) -> tuple[Mapping[int, OpStrategy], dict[int, Scatter]]:
    """``strategies`` as the lowering of a level 1-3 plan runs them, and the contractions it
    lowers by reduce-scatter (``strategies`` itself and ``{}`` when there are none)."""
    draft = ShardingPlan(mesh, (), "", "", tuple(_layouts(graph, strategies)), graph.inputs,
                         graph.outputs)
    found, scatters = find_scatters(graph, draft)
    if not scatters:
        return strategies, {}
    found = unstacked(found, scatters)  # a partial sum in the layout of the graph's value
    out = dict(strategies)
    for before, after in zip(draft.decisions, found.decisions, strict=True):
        if (before.in_specs, before.out_specs) != (after.in_specs, after.out_specs):
            out[after.node] = dataclasses.replace(out[after.node], in_specs=after.in_specs,
                                                  out_specs=after.out_specs)
    return out, scatters


def _layouts(graph: OpGraph, strategies: Mapping[int, OpStrategy]) -> list[OpDecision]:
    """Decisions that hold only the layouts (what :func:`find_scatters` reads)."""
    out = []
    for node in graph.nodes:
        s = strategies.get(node.id) if node.kind is not NodeKind.CONTROL else None
        out.append(OpDecision(node.id, str(node.kind), node.name, "", "", (), (),
                              s.in_specs if s else (), s.out_specs if s else (), "",
                              node.weight, (), ()))
    return out
