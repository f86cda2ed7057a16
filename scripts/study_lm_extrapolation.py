#!/usr/bin/env python
"""Study 1: language-model length extrapolation of every PE
(posformer/studies/lm.py).

The same as ``posformer-study lm``, with defaults relative to this
repository; ``--help`` lists the options.
"""

import sys

from posformer.cli.study import script_main

if __name__ == "__main__":
    sys.exit(script_main("lm", __file__))
