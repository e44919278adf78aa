"""Batches as global ``jax.Array`` s, laid out by ``dataset_strategy``.

* ``"data_parallel"``: dimension 0 split over every mesh axis (each device its rows);
* ``"full_batch"``: every device holds the whole batch;
* a tuple with one layout per column: slice counts, those dimensions split (e.g. height and
  width of large images, ``((1, 2, 4, 1),)`` on 8 devices, by jaxpar's slice-count rule), or a
  ``jaxpar.Layout`` called on the column's dimensions (MindSpore's
  ``dataset_strategy=(layout("dp", "mp"),)``).  Without a mesh the batch goes on the mesh these
  layouts describe (a Layout's own, or MindSpore's device matrix of the slice counts).

In one process the batch is placed with ``jax.device_put``.  Across processes each process
passes what it read: its shard of the rows when its dataset is sharded
(``jax.make_array_from_process_local_data``), else the whole batch, of which each device takes
its tile (``jax.make_array_from_callback``).

>>> import numpy as np, jaxpar
>>> from jaxpar import dataset as ds
>>> mesh = jaxpar.make_mesh((8,), ("dp",))
>>> (x,) = ds.to_global((np.zeros((16, 3)),), mesh)
>>> x.sharding.shard_shape(x.shape)
(2, 3)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar._src.context import check_dataset_strategy, current_context
from jaxpar._src.errors import DatasetError, StrategyError
from jaxpar._src.mesh import make_mesh


def _mesh(mesh: Mesh | None, strategy: Any = None) -> Mesh:
    if mesh is not None:
        return mesh
    ctx = current_context()
    if ctx.mesh is not None:
        return ctx.mesh
    n = ctx.device_num or len(jax.devices())
    if isinstance(strategy, tuple):
        from jaxpar._src.implicit_mesh import implicit_mesh, strategy_requests

        found = [r for i, e in enumerate(strategy)
                 for r in strategy_requests(e, f"dataset_strategy[{i}]")]
        implicit = implicit_mesh(found, n)
        if implicit is not None:
            return implicit
    return make_mesh((n,), ("devices",))


def column_sharding(shape: Sequence[int], mesh: Mesh, strategy: Any, column: int,
                    global_rows: int | None = None) -> NamedSharding:
    """The sharding of one batch column under ``strategy``.

    >>> import jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> from jaxpar import dataset as ds
    >>> mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    >>> ds.column_sharding((16, 3), mesh, "data_parallel", 0).spec == P(("dp", "mp"))
    True
    >>> ds.column_sharding((16, 3), mesh, "full_batch", 0).spec == P()
    True
    """
    from jaxpar._src.strategy import normalize

    shape = tuple(shape)
    if strategy == "full_batch" or not shape:
        return NamedSharding(mesh, P())
    if strategy == "data_parallel":
        n = int(mesh.devices.size)
        rows = global_rows if global_rows is not None else shape[0]
        if rows % n:
            raise StrategyError(
                f"dataset_strategy 'data_parallel' splits column {column}'s batch dimension "
                f"(shape {list(shape)}, {rows} rows in all) over the {n} devices of mesh "
                f"{dict(mesh.shape)}, but {rows} is not divisible by {n}. Use a batch size that "
                f"is a multiple of {n} (batch(..., drop_remainder=True)).")
        return NamedSharding(mesh, P(tuple(mesh.axis_names)))
    if column >= len(strategy):
        raise StrategyError(
            f"dataset_strategy {strategy!r} gives {len(strategy)} layouts, but the batch has at "
            f"least {column + 1} columns: give one layout (slice counts or a Layout) per "
            f"column.")
    spec = normalize(strategy[column], shape, mesh,
                     where=f"dataset_strategy for batch column {column}")
    return NamedSharding(mesh, spec.to_partition_spec() if spec is not None else P())


def to_global(batch: Any, mesh: Mesh | None = None, *, strategy: Any = None,
              sharded: bool = False) -> Any:
    """``batch`` (one array or a tuple of them) as global arrays on ``mesh``.

    Args:
      batch: NumPy (or array-like) columns.
      mesh: default the context's mesh, else every device on one axis.
      strategy: default the context's ``dataset_strategy``.
      sharded: across processes, whether each process holds only its own rows (its dataset was
        built with ``num_shards``/``shard_id``) rather than the whole batch.

    >>> import numpy as np
    >>> from jaxpar import dataset as ds
    >>> x, y = ds.to_global((np.zeros((16, 3)), np.zeros(16)))  # the context's dataset_strategy
    >>> x.shape, len(x.sharding.device_set)
    ((16, 3), 8)
    """
    strategy = check_dataset_strategy(
        strategy if strategy is not None else current_context().dataset_strategy)
    mesh = _mesh(mesh, strategy)
    single = not isinstance(batch, (tuple, list))
    columns = (batch,) if single else tuple(batch)
    processes = jax.process_count()
    out = []
    for k, column in enumerate(columns):
        local = np.asarray(column)
        if processes == 1:
            out.append(jax.device_put(local, column_sharding(local.shape, mesh, strategy, k)))
        elif sharded and strategy == "data_parallel" and local.ndim:
            sharding = column_sharding(local.shape, mesh, strategy, k,
                                       global_rows=local.shape[0] * processes)
            out.append(jax.make_array_from_process_local_data(sharding, local))
        elif sharded:
            raise DatasetError(
                f"to_global: with dataset_strategy {strategy!r} every process must read the "
                f"whole batch; build the dataset without num_shards/shard_id.")
        else:
            sharding = column_sharding(local.shape, mesh, strategy, k)
            out.append(jax.make_array_from_callback(local.shape, sharding,
                                                    local.__getitem__))
    return out[0] if single else tuple(out)


def process_shard(mesh: Mesh | None = None, *, strategy: Any = None) -> dict[str, int | None]:
    """``num_shards`` and ``shard_id`` for this process's dataset (keyword arguments).

    Under ``"data_parallel"`` each process reads the rows its own devices hold: processes whose
    devices hold the same rows (replicas of one model split across processes) read the same
    shard. Under ``"full_batch"`` or a spatial strategy every process reads everything. In one
    process there is nothing to shard (both ``None``).

    >>> from jaxpar import dataset as ds
    >>> ds.process_shard()
    {'num_shards': None, 'shard_id': None}
    """
    strategy = check_dataset_strategy(
        strategy if strategy is not None else current_context().dataset_strategy)
    mesh = _mesh(mesh, strategy)
    if jax.process_count() == 1 or strategy != "data_parallel":
        return {"num_shards": None, "shard_id": None}
    n = int(mesh.devices.size)
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    blocks: dict[int, set[int]] = {}
    indices: Mapping[Any, Any] = sharding.devices_indices_map((n,))  # jax.Device -> slices
    for device, index in indices.items():
        blocks.setdefault(device.process_index, set()).add(index[0].start or 0)
    groups = sorted({tuple(sorted(b)) for b in blocks.values()})
    mine = tuple(sorted(blocks[jax.process_index()]))
    return {"num_shards": len(groups), "shard_id": groups.index(mine)}
