"""`python -m specjax ...` (and the `specjax` console script): see `specjax.cli`."""
import sys

from specjax.cli import main

if __name__ == "__main__":
    sys.exit(main())
