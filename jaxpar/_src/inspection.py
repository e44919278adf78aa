"""``jaxpar.inspect``: what XLA actually did with a program.

On CPU, wall-clock time of emulated devices does not rank strategies; what the compiled program
does does: the collectives XLA inserted (:func:`collectives`), per-device memory (:func:`memory`)
and FLOPs (:func:`flops`).
"""

from __future__ import annotations

from typing import Any

import jax

from jaxpar._src.hlo import CollectiveRecord, Collectives, parse_collectives

__all__ = ["CollectiveRecord", "Collectives", "collectives", "flops", "hlo_text", "memory"]


def _compiled(obj: Any) -> Any:
    if isinstance(obj, jax.stages.Lowered):
        return obj.compile()
    return obj


def hlo_text(obj: Any) -> str:
    """The partitioned HLO of a ``Lowered`` (compiled here) or ``Compiled`` program, or ``obj``
    itself when it is already text.

    >>> import jax, jax.numpy as jnp, jaxpar
    >>> "HloModule" in jaxpar.inspect.hlo_text(jax.jit(jnp.sin).lower(jnp.ones(4)))
    True
    """
    if isinstance(obj, str):
        return obj
    return _compiled(obj).as_text()


def _mesh_of(obj: Any) -> Any:
    try:
        for s in jax.tree.leaves(obj.input_shardings):
            if hasattr(s, "mesh"):
                return s.mesh
    except Exception:  # noqa: BLE001 - labels are a convenience
        return None
    return None


def collectives(obj: Any, mesh: Any = None) -> Collectives:
    """The collectives of a compiled program, with kind, bytes, group size and loop counts.

    Args:
      obj: a ``jax.stages.Lowered`` (it is compiled), a ``jax.stages.Compiled``, or HLO text.
      mesh: the mesh, to name the axes each collective runs over; taken from the program's
        input shardings when omitted.

    Returns:
      A :class:`Collectives` tuple of records with ``.count(kind)``, ``.total_bytes(kind)``,
      ``.by_kind()`` and ``.table()``.

    >>> import jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from jaxpar import make_mesh, parallelize
    >>> mesh = make_mesh((2, 4), ("dp", "mp"))
    >>> f = parallelize(lambda x, w: x @ w, mesh=mesh, parallel_mode="semi_auto_parallel",
    ...                 in_strategy=(P("dp", "mp"), P("mp", None)))
    >>> colls = collectives(f.lower(jnp.ones((8, 16)), jnp.ones((16, 4))))
    >>> colls.count("all-reduce"), colls[0].axes
    (1, ('mp',))
    """
    compiled = None if isinstance(obj, str) else _compiled(obj)
    text = obj if compiled is None else compiled.as_text()
    if mesh is None and compiled is not None:
        mesh = _mesh_of(compiled)
    return parse_collectives(text, mesh)


def memory(obj: Any) -> dict[str, int]:
    """Per-device bytes of a compiled program: arguments, outputs, aliased, temporaries, total.

    ``total`` is ``argument + output - alias + temp``; XLA:CPU's own peak figure leaves
    temporaries out.

    >>> import jax, jax.numpy as jnp, jaxpar
    >>> mem = jaxpar.inspect.memory(jax.jit(lambda x: x * 2).lower(jnp.ones(256)))
    >>> mem["argument"], mem["output"]
    (1024, 1024)
    """
    stats = _compiled(obj).memory_analysis()
    out = {
        "argument": int(stats.argument_size_in_bytes),
        "output": int(stats.output_size_in_bytes),
        "alias": int(stats.alias_size_in_bytes),
        "temp": int(stats.temp_size_in_bytes),
    }
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def flops(obj: Any) -> float:
    """Per-device FLOPs XLA counts for a compiled program (a loop body counts once).

    >>> import jax, jax.numpy as jnp, jaxpar
    >>> jaxpar.inspect.flops(jax.jit(lambda a, b: a @ b).lower(jnp.ones((4, 8)), jnp.ones((8, 2))))
    128.0
    """
    cost = _compiled(obj).cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float(cost.get("flops", 0.0))


def saved_activations(fn: Any, *args: Any) -> int:
    """Bytes one device keeps from the forward pass for the backward pass of ``fn(*args)``.

    These are the residuals of ``jax.vjp`` (run eagerly on the given arrays), not counting the
    arguments themselves: the activation memory of training, which mixed precision halves.  Per
    device: a sharded residual counts its shard.

    >>> import jax.numpy as jnp
    >>> saved_activations(lambda w, x: jnp.sum(jnp.sin(x @ w)), jnp.ones((4, 4)), jnp.ones((2, 4)))
    32

    (``cos(x @ w)``, 2 x 4 float32, for the backward pass of ``sin``.)
    """
    _, vjp_fn = jax.vjp(fn, *args)
    inputs = {id(x) for x in jax.tree.leaves(args)}
    total = 0
    for leaf in jax.tree.leaves(vjp_fn):
        if isinstance(leaf, jax.Array) and id(leaf) not in inputs:
            shard = leaf.addressable_shards[0].data if leaf.addressable_shards else leaf
            total += int(shard.nbytes)
    return total
