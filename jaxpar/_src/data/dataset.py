"""The dataset pipeline: a source, then ``map``, ``shuffle``, ``batch`` and ``repeat`` stages.

Every stage is a :class:`Dataset`: iterating it runs one epoch and yields rows as tuples of NumPy
arrays in column order; ``len`` is the number of rows (batches after ``batch``).  Sources
(:class:`NumpySlicesDataset`, :class:`GeneratorDataset`) read their shard of the data
(``num_shards``/``shard_id``, see ``sampler.py``); :meth:`Dataset.global_batches` turns batches
into global ``jax.Array`` s laid out by the context's ``dataset_strategy``.

>>> import numpy as np
>>> from jaxpar import dataset as ds
>>> data = ds.NumpySlicesDataset((np.arange(10), np.arange(10) * 2), ["x", "y"])
>>> data = data.map(lambda x: x + 100, input_columns="x").batch(4)
>>> len(data), data.column_names
(3, ('x', 'y'))
>>> [x.tolist() for x, _ in data]
[[100, 101, 102, 103], [104, 105, 106, 107], [108, 109]]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from jaxpar._src.errors import DatasetError

Row = tuple[np.ndarray, ...]


class Dataset:
    """A stage of the pipeline; iterate it for one epoch of rows (tuples in column order).

    >>> import numpy as np
    >>> from jaxpar import dataset as ds
    >>> data = ds.NumpySlicesDataset(np.arange(10), column_names=["x"])
    >>> data = data.map(lambda x: x * 2).batch(4, drop_remainder=True)
    >>> [batch[0].tolist() for batch in data], len(data)
    ([[0, 2, 4, 6], [8, 10, 12, 14]], 2)
    """

    column_names: tuple[str, ...]
    num_shards: int | None = None  # of the source, for global_batches across processes

    def __iter__(self) -> Iterator[Row]:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def get_dataset_size(self) -> int:
        """MindSpore's name for ``len``: rows per epoch (batches after ``batch``)."""
        return len(self)

    # -- stages -------------------------------------------------------------------------------
    def map(self, operations: Callable | Sequence[Callable],
            input_columns: str | Sequence[str] | None = None,
            output_columns: str | Sequence[str] | None = None) -> Dataset:
        """Applies ``operations`` (one function, or several in turn) to ``input_columns`` (default:
        the first column) of every row; their results replace them (or become
        ``output_columns``)."""
        return MapDataset(self, operations, input_columns, output_columns)

    def batch(self, batch_size: int, drop_remainder: bool = False) -> Dataset:
        """Stacks ``batch_size`` consecutive rows; the last short batch is kept unless
        ``drop_remainder``."""
        return BatchDataset(self, batch_size, drop_remainder)

    def shuffle(self, buffer_size: int, seed: int | None = None) -> Dataset:
        """Shuffles rows through a buffer of ``buffer_size`` (MindSpore's buffered shuffle); the
        seed defaults to :func:`jaxpar.set_seed`'s."""
        return ShuffleDataset(self, buffer_size, seed)

    def repeat(self, count: int) -> Dataset:
        """``count`` epochs of this dataset as one."""
        return RepeatDataset(self, count)

    def create_tuple_iterator(self, num_epochs: int = 1) -> Iterator[Row]:
        """Rows of ``num_epochs`` epochs (MindSpore's name; rows are NumPy tuples)."""
        for _ in range(num_epochs):
            yield from self

    def global_batches(self, mesh: Any = None, *, strategy: Any = None
                       ) -> Iterator[tuple[Any, ...]]:
        """One epoch of batches as global ``jax.Array`` s (see :func:`jaxpar.dataset.to_global`)."""
        from jaxpar._src.data.placement import to_global

        for row in self:
            yield to_global(row, mesh, strategy=strategy, sharded=self.num_shards is not None)


class _Stage(Dataset):
    def __init__(self, parent: Dataset) -> None:
        self.parent = parent
        self.column_names = parent.column_names
        self.num_shards = parent.num_shards

    def __len__(self) -> int:
        return len(self.parent)


class MapDataset(_Stage):
    def __init__(self, parent: Dataset, operations: Callable | Sequence[Callable],
                 input_columns: Any, output_columns: Any) -> None:
        super().__init__(parent)
        self.operations: list[Callable] = [operations] if callable(operations) \
            else list(operations)
        if not self.operations or not all(callable(f) for f in self.operations):
            raise DatasetError(f"Dataset.map: operations must be callables, got {operations!r}.")
        inputs = _names(input_columns) or parent.column_names[:1]
        unknown = [c for c in inputs if c not in parent.column_names]
        if unknown:
            raise DatasetError(
                f"Dataset.map: input_columns {unknown} are not columns of this dataset "
                f"({list(parent.column_names)}).")
        outputs = _names(output_columns) or inputs
        self.inputs = [parent.column_names.index(c) for c in inputs]
        self.outputs = outputs
        if outputs == inputs:
            self.column_names = parent.column_names
        else:  # the inputs' columns are replaced by the outputs, at the first input's place
            names = list(parent.column_names)
            first = min(self.inputs)
            kept = [c for i, c in enumerate(names) if i not in self.inputs]
            before = [c for c in names[:first] if c in kept]
            self.column_names = tuple(before + list(outputs) + kept[len(before):])

    def __iter__(self) -> Iterator[Row]:
        for row in self.parent:
            values = tuple(row[i] for i in self.inputs)
            for f in self.operations:
                got = f(*values)
                values = tuple(got) if isinstance(got, tuple) else (got,)
            if len(values) != len(self.outputs):
                raise DatasetError(
                    f"Dataset.map: the operations return {len(values)} values for the "
                    f"{len(self.outputs)} output columns {list(self.outputs)}.")
            values = tuple(np.asarray(v) for v in values)
            if tuple(self.outputs) == tuple(self.parent.column_names[i] for i in self.inputs):
                out = list(row)
                for i, v in zip(self.inputs, values, strict=True):
                    out[i] = v
                yield tuple(out)
            else:
                named = dict(zip(self.parent.column_names, row, strict=True))
                for i in self.inputs:
                    named.pop(self.parent.column_names[i])
                named.update(zip(self.outputs, values, strict=True))
                yield tuple(named[c] for c in self.column_names)


class BatchDataset(_Stage):
    def __init__(self, parent: Dataset, batch_size: int, drop_remainder: bool) -> None:
        super().__init__(parent)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise DatasetError(f"Dataset.batch: batch_size must be a positive int, got "
                               f"{batch_size!r}.")
        self.batch_size = batch_size
        self.drop_remainder = drop_remainder

    def __len__(self) -> int:
        n = len(self.parent)
        return n // self.batch_size if self.drop_remainder else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[Row]:
        rows: list[Row] = []
        for row in self.parent:
            rows.append(row)
            if len(rows) == self.batch_size:
                yield _stack(rows)
                rows = []
        if rows and not self.drop_remainder:
            yield _stack(rows)


class ShuffleDataset(_Stage):
    def __init__(self, parent: Dataset, buffer_size: int, seed: int | None) -> None:
        super().__init__(parent)
        if not isinstance(buffer_size, int) or buffer_size < 1:
            raise DatasetError(f"Dataset.shuffle: buffer_size must be a positive int, got "
                               f"{buffer_size!r}.")
        self.buffer_size = buffer_size
        self.seed = seed
        self.epoch = 0

    def __iter__(self) -> Iterator[Row]:
        from jaxpar._src.train.seed import get_seed

        seed = self.seed if self.seed is not None else (get_seed() or 0)
        rng = np.random.default_rng(seed + self.epoch)
        self.epoch += 1
        buffer: list[Row] = []
        for row in self.parent:
            buffer.append(row)
            if len(buffer) == self.buffer_size:
                k = int(rng.integers(len(buffer)))
                buffer[k], buffer[-1] = buffer[-1], buffer[k]
                yield buffer.pop()
        while buffer:
            k = int(rng.integers(len(buffer)))
            buffer[k], buffer[-1] = buffer[-1], buffer[k]
            yield buffer.pop()


class RepeatDataset(_Stage):
    def __init__(self, parent: Dataset, count: int) -> None:
        super().__init__(parent)
        if not isinstance(count, int) or count < 1:
            raise DatasetError(f"Dataset.repeat: count must be a positive int, got {count!r}.")
        self.count = count

    def __len__(self) -> int:
        return self.count * len(self.parent)

    def __iter__(self) -> Iterator[Row]:
        for _ in range(self.count):
            yield from self.parent


def _names(columns: str | Sequence[str] | None) -> tuple[str, ...]:
    if columns is None:
        return ()
    return (columns,) if isinstance(columns, str) else tuple(columns)


def _stack(rows: list[Row]) -> Row:
    try:
        return tuple(np.stack(column) for column in zip(*rows, strict=True))
    except ValueError as e:
        shapes = sorted({tuple(np.shape(r[0])) for r in rows})
        raise DatasetError(
            f"Dataset.batch: rows of one batch differ in shape ({shapes}); pad or resize them "
            f"with map() first. ({e})") from None
