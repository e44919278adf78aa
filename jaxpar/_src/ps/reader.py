"""Batches the workers read themselves, instead of receiving them from the scheduler.

By default the scheduler cuts each global batch into the workers' parts and ships them (fine
for data that fits the scheduler).  With :func:`read_on_workers` each worker calls
``fn(step, part, num_parts)`` and reads its part where the data lives (a file system, a bucket,
a grain loader on its host).  ``fn`` must return the same samples for the same arguments, so a
part computed again after a failure is the same part; :func:`part_slice` gives the rows of a
part as the scheduler would cut them.

>>> part_slice(10, 0, 3), part_slice(10, 2, 3)
(slice(0, 4, None), slice(7, 10, None))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxpar._src.errors import PSError

Batch = Sequence[np.ndarray]


@dataclasses.dataclass(frozen=True)
class WorkerReader:
    """Batches the workers read themselves (see :func:`read_on_workers`).

    >>> import numpy as np
    >>> from jaxpar import ps
    >>> reader = ps.read_on_workers(lambda step, part, n: (np.zeros((4, 2)),), batch_size=8)
    >>> reader.batch_size
    8
    """
    fn: Callable[[int, int, int], Batch]  # (step, part, num_parts) -> that part of the batch
    batch_size: int  # samples in one global batch


def read_on_workers(fn: Callable[[int, int, int], Batch], batch_size: int) -> WorkerReader:
    """Global batches of ``batch_size`` samples that the workers read part by part with
    ``fn(step, part, num_parts)``; ``step`` counts from 0 in each ``train`` call.

    >>> import numpy as np
    >>> from jaxpar import ps
    >>> x = np.arange(16.0).reshape(8, 2)
    >>> def read(step, part, num_parts):  # runs on the worker, where the data lives
    ...     return (x[ps.part_slice(8, part, num_parts)],)
    >>> reader = ps.read_on_workers(read, batch_size=8)  # trainer.train(reader, steps=...)
    >>> reader.fn(0, 1, 2)[0].shape
    (4, 2)
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise PSError(f"read_on_workers: batch_size={batch_size!r} must be a positive int.")
    return WorkerReader(fn, batch_size)


@dataclasses.dataclass(frozen=True)
class ReadPart:
    """What a worker gets in place of its data: read it with :meth:`read`."""

    fn: Callable[[int, int, int], Batch]
    step: int
    part: int
    num_parts: int

    def read(self) -> tuple[np.ndarray, ...]:
        return tuple(np.asarray(column) for column in self.fn(self.step, self.part,
                                                              self.num_parts))


def part_slice(batch_size: int, part: int, num_parts: int) -> slice:
    """The rows of part ``part`` of ``num_parts`` of a batch (``np.array_split``'s cut).

    >>> from jaxpar import ps
    >>> [ps.part_slice(10, p, 3) for p in range(3)]
    [slice(0, 4, None), slice(4, 7, None), slice(7, 10, None)]
    """
    base, extra = divmod(batch_size, num_parts)
    start = part * base + min(part, extra)
    return slice(start, start + base + (part < extra))


def resolve(data: Any) -> Batch:
    """A worker's batch: read it if it is a :class:`ReadPart`."""
    return data.read() if isinstance(data, ReadPart) else data
