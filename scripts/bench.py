"""Thin wrapper: ``python scripts/bench.py [--quick] ...`` = ``posformer-bench``."""

from posformer.cli.bench import main

if __name__ == "__main__":
    main()
