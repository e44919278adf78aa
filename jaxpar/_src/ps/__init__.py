"""Parameter-server training on Ray Core (``jaxpar.ps``)."""
