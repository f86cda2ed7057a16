#!/usr/bin/env python
"""Study 4: RoPE context extension, zero-shot and fine-tuned
(posformer/studies/rope_extension.py).

The same as ``posformer-study rope-extension``, with defaults relative to this
repository; ``--help`` lists the options.
"""

import sys

from posformer.cli.study import script_main

if __name__ == "__main__":
    sys.exit(script_main("rope-extension", __file__))
