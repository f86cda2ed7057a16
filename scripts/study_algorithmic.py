#!/usr/bin/env python
"""Study 2: algorithmic length generalization, with and without randomized positions
(posformer/studies/algorithmic.py).

The same as ``posformer-study algorithmic``, with defaults relative to this
repository; ``--help`` lists the options.
"""

import sys

from posformer.cli.study import script_main

if __name__ == "__main__":
    sys.exit(script_main("algorithmic", __file__))
