"""Refit benchmark (issues 4 and 10): delta against dense over bandwidth-limited
loopback links through real relay and receiver processes. Same as
`dcr bench refit`; see dcr/benchrefit.py for what is measured."""

import argparse
import sys

from dcr import benchrefit

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    benchrefit.add_arguments(parser)
    sys.exit(benchrefit.run(parser.parse_args()))
