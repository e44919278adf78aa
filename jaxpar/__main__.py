"""``python -m jaxpar run ...`` / ``python -m jaxpar k8s ...`` / ``python -m jaxpar plan ...``."""

import sys

from jaxpar._src.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
