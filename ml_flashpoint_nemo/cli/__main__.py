"""`python -m ml_flashpoint_nemo.cli ...`: the same as the `flashpoint` console script."""

import sys

from ml_flashpoint_nemo.cli import main

if __name__ == "__main__":
    sys.exit(main())
