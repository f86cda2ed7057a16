#!/usr/bin/env python
"""Study 3: Multi30k de->en BLEU mean ± std over seeds per PE
(posformer/studies/multi30k.py).

The same as ``posformer-study multi30k``, with defaults relative to this
repository; ``--help`` lists the options.
"""

import sys

from posformer.cli.study import script_main

if __name__ == "__main__":
    sys.exit(script_main("multi30k", __file__))
