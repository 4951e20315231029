"""`python -m moe_train.plan`: the cluster planner, `moe_train.preflight.plan`."""
import sys

from moe_train.preflight.plan import main

if __name__ == "__main__":
    sys.exit(main())
