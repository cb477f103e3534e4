"""python -m trainscale.bench (the package's docstring says what it runs; --help its options)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
