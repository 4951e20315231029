#!/usr/bin/env python
"""Prepare a Megatron-compatible indexed dataset; see ``python scripts/prepare_data.py --help``."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_train.data.prepare import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
