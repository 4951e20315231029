"""The training application: config, data, optimizer and schedules, loop, checkpoints, logs, CLI."""
