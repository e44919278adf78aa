"""``jaxpar.metrics``: what ``Model.eval`` measures.

>>> import jaxpar
>>> sorted(m for m in jaxpar.metrics.__all__)
['Accuracy', 'Loss', 'MAE', 'MSE', 'Metric']
"""

from jaxpar._src.train.metrics import MAE as MAE
from jaxpar._src.train.metrics import MSE as MSE
from jaxpar._src.train.metrics import Accuracy as Accuracy
from jaxpar._src.train.metrics import Loss as Loss
from jaxpar._src.train.metrics import Metric as Metric

__all__ = ["MAE", "MSE", "Accuracy", "Loss", "Metric"]
