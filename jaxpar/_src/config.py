"""``jaxpar.config``: jaxpar's process-wide settings, read and set like ``jax.config``.

One option so far, ``plan_cache_dir``: the directory of the persistent plan cache
(``plan_cache.py``).  Its default comes from the environment variable
``JAXPAR_PLAN_CACHE_DIR`` (unset: no cache), so a launcher can turn the cache on for every rank
without touching the script.  Unlike the auto-parallel context it is not part of any plan: it
says where plans are kept, not what they are.
"""

from __future__ import annotations

import os
from typing import Any

from jaxpar._src.errors import ContextError

_ENV = {"plan_cache_dir": "JAXPAR_PLAN_CACHE_DIR"}


class Config:
    """jaxpar's process-wide settings (see :data:`config`).

    >>> import jaxpar
    >>> jaxpar.config.update("plan_cache_dir", "/tmp/jaxpar-plans")
    >>> jaxpar.config.plan_cache_dir
    '/tmp/jaxpar-plans'
    >>> jaxpar.config.plan_cache_dir = None       # attribute assignment works too
    >>> jaxpar.config.update("plan_dir", "/tmp")
    Traceback (most recent call last):
    ...
    jaxpar._src.errors.ContextError: jaxpar.config: unknown option 'plan_dir'. Known options: \
plan_cache_dir.
    """

    plan_cache_dir: str | None  # where plans are kept between processes; None: nowhere

    def __init__(self) -> None:
        for name, env in _ENV.items():
            self.update(name, os.environ.get(env) or None)

    def update(self, name: str, value: Any) -> None:
        """Sets option ``name`` (as ``jax.config.update`` does for JAX's options)."""
        if name not in _ENV:
            raise ContextError(f"jaxpar.config: unknown option {name!r}. Known options: "
                               f"{', '.join(sorted(_ENV))}.")
        if name == "plan_cache_dir" and value is not None:
            if not isinstance(value, (str, os.PathLike)):
                raise ContextError(f"jaxpar.config: plan_cache_dir must be a directory path or "
                                   f"None, got {value!r}.")
            value = os.path.expanduser(os.fspath(value))
        object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        self.update(name, value)

    def __repr__(self) -> str:
        return "jaxpar.config(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in _ENV) + ")"


config = Config()
