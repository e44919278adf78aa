"""``jaxpar.dataset``: MindSpore-style datasets that feed sharded JAX programs.

Sources read their shard (``num_shards``/``shard_id``; :func:`process_shard` gives this
process's); ``map``, ``shuffle``, ``batch`` and ``repeat`` stages follow; batches become global
``jax.Array`` s laid out by the context's ``dataset_strategy`` (:func:`to_global`). grain users
pass a ``grain.MapDataset`` to :class:`GeneratorDataset`, or their own loader's batches to
:func:`to_global`.

>>> import numpy as np
>>> from jaxpar import dataset as ds
>>> data = ds.NumpySlicesDataset((np.zeros((32, 4)), np.zeros(32)), ["x", "y"]).batch(16)
>>> [x.shape for x, y in data.global_batches()]
[(16, 4), (16, 4)]
"""

from jaxpar._src.data.dataset import Dataset as Dataset
from jaxpar._src.data.placement import column_sharding as column_sharding
from jaxpar._src.data.placement import process_shard as process_shard
from jaxpar._src.data.placement import to_global as to_global
from jaxpar._src.data.sampler import shard_indices as shard_indices
from jaxpar._src.data.sources import GeneratorDataset as GeneratorDataset
from jaxpar._src.data.sources import NumpySlicesDataset as NumpySlicesDataset

__all__ = ["Dataset", "GeneratorDataset", "NumpySlicesDataset", "column_sharding",
           "process_shard", "shard_indices", "to_global"]
