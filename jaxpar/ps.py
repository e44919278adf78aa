"""``jaxpar.ps``: parameter-server training on Ray Core (``pip install 'jaxpar[ps]'``).

Servers hold the parameters (split by size) and apply optax updates; workers compute gradients
with JAX on their part of each batch; synchronous or asynchronous, elastic, fault tolerant.
See :class:`ParameterServerTrainer`.

>>> from jaxpar import ps
>>> ps.current_role()
'MS_SCHED'
"""

from jaxpar._src.errors import PSError as PSError
from jaxpar._src.ps.context import PSConfig as PSConfig
from jaxpar._src.ps.context import current_role as current_role
from jaxpar._src.ps.context import get_ps_context as get_ps_context
from jaxpar._src.ps.context import reset_ps_context as reset_ps_context
from jaxpar._src.ps.context import set_ps_context as set_ps_context
from jaxpar._src.ps.partition import assign_by_size as assign_by_size
from jaxpar._src.ps.reader import WorkerReader as WorkerReader
from jaxpar._src.ps.reader import part_slice as part_slice
from jaxpar._src.ps.reader import read_on_workers as read_on_workers
from jaxpar._src.ps.trainer import ParameterServerTrainer as ParameterServerTrainer
from jaxpar._src.ps.trainer import PSReport as PSReport
from jaxpar._src.ps.trainer import StepInfo as StepInfo

__all__ = ["PSConfig", "PSError", "PSReport", "ParameterServerTrainer", "StepInfo",
           "WorkerReader", "assign_by_size", "current_role", "get_ps_context", "part_slice",
           "read_on_workers", "reset_ps_context", "set_ps_context"]
