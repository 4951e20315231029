"""The exit statuses of the trainer and the data tools; each non-zero one comes with one line saying why."""

EXIT_BAD_INPUT = 2  # a bad config value, argument, input, output, layout or run directory, named in one line
EXIT_DIVERGED = 3  # non-finite steps or state: the run stopped, the last good checkpoint is kept
EXIT_WRITE_FAILED = 4  # a log or checkpoint could not be written during the run (disk full, read-only, ...)
EXIT_PEER_FAILED = 5  # a collective failed during training (a peer process died, the network broke, a timeout)
OWN_EXIT_STATUSES = (EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_WRITE_FAILED, EXIT_PEER_FAILED)
