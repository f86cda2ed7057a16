#!/usr/bin/env python
"""Tables and figures of docs/leaderboard.md from the studies' outputs or records
(posformer/studies/leaderboard.py).

The same as ``posformer-study leaderboard``, with defaults relative to this
repository; ``--help`` lists the options.
"""

import sys

from posformer.cli.study import script_main

if __name__ == "__main__":
    sys.exit(script_main("leaderboard", __file__))
