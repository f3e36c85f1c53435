"""`python -m graphidx`: the `graphidx` command."""

import sys

from graphidx.cli import main

if __name__ == "__main__":
    sys.exit(main())
