"""Pipeline parallelism: schedule IR, builders, lowering, validators, simulator, runtime."""
