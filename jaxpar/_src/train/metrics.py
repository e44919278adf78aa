"""Metrics for ``Model.eval`` (MindSpore's ``nn.Metric``: ``clear``, ``update``, ``eval``).

>>> import numpy as np
>>> acc = Accuracy()
>>> acc.update(np.array([[0.1, 0.9], [0.8, 0.2]]), np.array([1, 1]))
>>> acc.eval()
0.5
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxpar._src.errors import DatasetError


class Metric:
    """Accumulates over batches; ``update(logits, labels)``, then ``eval()``.

    >>> import numpy as np
    >>> from jaxpar import metrics
    >>> class MaxError(metrics.Metric):
    ...     def clear(self):
    ...         self.worst = 0.0
    ...     def update(self, logits, labels, loss=None):
    ...         self.worst = max(self.worst, float(np.max(np.abs(logits - labels))))
    ...     def eval(self):
    ...         return self.worst
    >>> m = MaxError()
    >>> m.update(np.array([1.0, 2.5]), np.array([1.0, 2.0]))
    >>> m.eval()
    0.5
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        raise NotImplementedError

    def update(self, logits: Any, labels: Any, loss: Any = None) -> None:
        raise NotImplementedError

    def eval(self) -> float:
        raise NotImplementedError


class Accuracy(Metric):
    """The fraction of rows whose largest logit is the label (or, for one output column, whose
    logit rounds to it).

    >>> import numpy as np
    >>> from jaxpar import metrics
    >>> acc = metrics.Accuracy()
    >>> acc.update(np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]]), np.array([0, 1, 1]))
    >>> round(acc.eval(), 3)
    0.667
    """

    def clear(self) -> None:
        self.correct = 0
        self.total = 0

    def update(self, logits: Any, labels: Any, loss: Any = None) -> None:
        logits, labels = np.asarray(logits), np.asarray(labels)
        if logits.ndim == labels.ndim + 1 and logits.shape[-1] > 1:
            predicted = np.argmax(logits, axis=-1)
        else:
            predicted = np.round(logits.reshape(labels.shape))
        if labels.ndim == logits.ndim and labels.shape[-1] == logits.shape[-1] > 1:
            labels = np.argmax(labels, axis=-1)  # one-hot labels
        self.correct += int(np.sum(predicted == labels))
        self.total += int(labels.size)

    def eval(self) -> float:
        if self.total == 0:
            raise DatasetError("Accuracy.eval: no batch was seen; call update first.")
        return self.correct / self.total


class Loss(Metric):
    """The mean of the loss over the batches, weighted by their sizes.

    >>> import numpy as np
    >>> from jaxpar import metrics
    >>> m = metrics.Loss()
    >>> m.update(None, np.zeros(2), loss=1.0)   # a batch of 2
    >>> m.update(None, np.zeros(6), loss=3.0)   # a batch of 6
    >>> m.eval()
    2.5
    """

    def clear(self) -> None:
        self.total = 0.0
        self.count = 0

    def update(self, logits: Any, labels: Any, loss: Any = None) -> None:
        n = int(np.shape(labels)[0]) if np.ndim(labels) else 1
        self.total += float(np.mean(np.asarray(loss))) * n
        self.count += n

    def eval(self) -> float:
        if self.count == 0:
            raise DatasetError("Loss.eval: no batch was seen; call update first.")
        return self.total / self.count


class MAE(Metric):
    """Mean absolute error between outputs and targets.

    >>> import numpy as np
    >>> from jaxpar import metrics
    >>> m = metrics.MAE()
    >>> m.update(np.array([1.0, 3.0]), np.array([2.0, 2.0]))
    >>> m.eval()
    1.0
    """

    def clear(self) -> None:
        self.total = 0.0
        self.count = 0

    def update(self, logits: Any, labels: Any, loss: Any = None) -> None:
        diff = np.abs(np.asarray(logits, np.float64).reshape(np.shape(labels)) - labels)
        self.total += float(np.sum(diff))
        self.count += int(diff.size)

    def eval(self) -> float:
        return self.total / max(self.count, 1)


class MSE(MAE):
    """Mean squared error between outputs and targets.

    >>> import numpy as np
    >>> from jaxpar import metrics
    >>> m = metrics.MSE()
    >>> m.update(np.array([1.0, 4.0]), np.array([2.0, 2.0]))
    >>> m.eval()
    2.5
    """

    def update(self, logits: Any, labels: Any, loss: Any = None) -> None:
        diff = np.asarray(logits, np.float64).reshape(np.shape(labels)) - labels
        self.total += float(np.sum(diff ** 2))
        self.count += int(diff.size)
