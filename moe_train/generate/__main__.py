"""`python -m moe_train.generate`: see `moe_train.generate.cli`."""
import sys

from moe_train.generate.cli import main

sys.exit(main())
