"""Dataset sources: NumPy arrays and Python generators (MindSpore's names and sharding).

>>> import numpy as np
>>> from jaxpar import dataset as ds
>>> data = ds.NumpySlicesDataset(np.arange(10), num_shards=4, shard_id=1)
>>> [int(x) for (x,) in data]  # rows 1, 5, 9
[1, 5, 9]
>>> gen = ds.GeneratorDataset(lambda: ((i, -i) for i in range(6)), ["a", "b"],
...                           num_shards=2, shard_id=0)
>>> [(int(a), int(b)) for a, b in gen]
[(0, 0), (2, -2), (4, -4)]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from jaxpar._src.data.dataset import Dataset, Row
from jaxpar._src.data.sampler import check_shards, shard_indices
from jaxpar._src.errors import DatasetError


class _Source(Dataset):
    def __init__(self, column_names: Sequence[str], num_shards: int | None,
                 shard_id: int | None, shuffle: bool, seed: int | None, where: str) -> None:
        check_shards(num_shards, shard_id, where)
        self.column_names = tuple(column_names)
        self.num_shards = num_shards
        self.shard_id = shard_id
        self.shuffle_rows = bool(shuffle)
        self.seed = seed
        self.epoch = 0

    def _indices(self, n: int) -> np.ndarray:
        from jaxpar._src.train.seed import get_seed

        seed = self.seed if self.seed is not None else (get_seed() or 0)
        out = shard_indices(n, self.num_shards, self.shard_id, shuffle=self.shuffle_rows,
                            seed=seed, epoch=self.epoch)
        self.epoch += 1
        return out


class NumpySlicesDataset(_Source):
    """Rows sliced from arrays along their first dimension.

    Args:
      data: one array (one column), a tuple or list of arrays (one column each), or a dict of
        them (its keys name the columns).
      column_names: the columns' names; default ``column_0``, ``column_1``, ...
      num_shards, shard_id: read only shard ``shard_id`` of ``num_shards`` (MindSpore's
        distributed sampler: ``ceil(N / num_shards)`` rows, a short shard wraps around).
      shuffle: a new order every epoch (the same in every shard, so they stay disjoint).
      seed: the shuffle's seed; default :func:`jaxpar.set_seed`'s (else 0).

    >>> import numpy as np
    >>> from jaxpar import dataset as ds
    >>> data = ds.NumpySlicesDataset({"x": np.zeros((6, 2)), "y": np.arange(6)},
    ...                              num_shards=2, shard_id=1)
    >>> data.column_names, [int(y) for _, y in data]
    (('x', 'y'), [1, 3, 5])
    """

    def __init__(self, data: Any, column_names: Sequence[str] | None = None,
                 num_shards: int | None = None, shard_id: int | None = None,
                 shuffle: bool = False, seed: int | None = None) -> None:
        where = "NumpySlicesDataset"
        if isinstance(data, Mapping):
            names, columns = list(data), [np.asarray(v) for v in data.values()]
        elif isinstance(data, (tuple, list)):
            names, columns = None, [np.asarray(v) for v in data]
        else:
            names, columns = None, [np.asarray(data)]
        if not columns or any(c.ndim == 0 for c in columns):
            raise DatasetError(f"{where}: data must be arrays with a first (row) dimension.")
        lengths = {len(c) for c in columns}
        if len(lengths) != 1:
            raise DatasetError(
                f"{where}: every column needs the same number of rows, got "
                f"{[len(c) for c in columns]}.")
        names = list(column_names) if column_names is not None else (
            names or [f"column_{i}" for i in range(len(columns))])
        if len(names) != len(columns):
            raise DatasetError(
                f"{where}: {len(names)} column names for {len(columns)} columns.")
        super().__init__(names, num_shards, shard_id, shuffle, seed, where)
        self.columns = columns

    def __len__(self) -> int:
        n = len(self.columns[0])
        return n if self.num_shards is None else -(-n // self.num_shards)

    def __iter__(self) -> Iterator[Row]:
        for i in self._indices(len(self.columns[0])):
            yield tuple(c[i] for c in self.columns)


class GeneratorDataset(_Source):
    """Rows from Python: a random-access source (``__getitem__`` and ``__len__``, such as a
    ``grain.MapDataset``), or a generator function / iterable.

    A random-access source is sharded and shuffled like :class:`NumpySlicesDataset`. A generator
    is read in order; its shard keeps every ``num_shards``-th row (without wrap-around: its
    length is unknown until it ends), and it cannot be shuffled here (use ``.shuffle(buffer)``).
    Each item is a tuple (one value per column) or a single value (one column).

    >>> import numpy as np
    >>> from jaxpar import dataset as ds
    >>> def rows():
    ...     for i in range(5):
    ...         yield np.float32(i), np.int32(i % 2)
    >>> data = ds.GeneratorDataset(rows, column_names=["x", "label"]).batch(2)
    >>> [b[1].tolist() for b in data]
    [[0, 1], [0, 1], [0]]
    """

    def __init__(self, source: Any, column_names: str | Sequence[str] = ("column_0",),
                 num_shards: int | None = None, shard_id: int | None = None,
                 shuffle: bool = False, seed: int | None = None) -> None:
        where = "GeneratorDataset"
        names = [column_names] if isinstance(column_names, str) else list(column_names)
        super().__init__(names, num_shards, shard_id, shuffle, seed, where)
        self.source = source
        self.random_access = hasattr(source, "__getitem__") and hasattr(source, "__len__")
        if shuffle and not self.random_access:
            raise DatasetError(
                f"{where}: shuffle=True needs a random-access source (with __getitem__ and "
                f"__len__); for a generator, shuffle through a buffer: .shuffle(buffer_size).")
        if not self.random_access and not (callable(source) or isinstance(source, Iterable)):
            raise DatasetError(
                f"{where}: source must have __getitem__ and __len__, be a generator function, "
                f"or be iterable; got {type(source).__name__}.")

    def __len__(self) -> int:
        if self.random_access:
            n = len(self.source)
            return n if self.num_shards is None else -(-n // self.num_shards)
        n = sum(1 for _ in self._items())  # a generator: count it
        if self.num_shards is None:
            return n
        return len(range(self.shard_id or 0, n, self.num_shards))

    def _items(self) -> Iterator[Any]:
        source = self.source
        return iter(source() if callable(source) and not isinstance(source, Iterable)
                    else source)

    def __iter__(self) -> Iterator[Row]:
        if self.random_access:
            for i in self._indices(len(self.source)):
                yield self._row(self.source[int(i)])
            return
        for k, item in enumerate(self._items()):
            if self.num_shards is None or k % self.num_shards == self.shard_id:
                yield self._row(item)

    def _row(self, item: Any) -> Row:
        values = tuple(item) if isinstance(item, (tuple, list)) else (item,)
        if len(values) != len(self.column_names):
            raise DatasetError(
                f"GeneratorDataset: an item has {len(values)} values for the "
                f"{len(self.column_names)} columns {list(self.column_names)}.")
        return tuple(np.asarray(v) for v in values)

