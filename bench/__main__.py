"""python -m bench: the tpp-bench command line."""
import sys

from bench.cli import main

sys.exit(main())
