"""Starting and stopping processes: the torchrun wrapper (`torchrun`), the worker it starts
(`worker`), stop signals and the agreed stop (`stop_signals`, `stop`), exit statuses
(`exit_codes`) and the run directory's lock (`run_dir`). Importing this package imports nothing,
so a worker notes stop signals from its first instant.
"""
