"""For the scripts that end in a device trap (each runs in its own process: a trap kills the context)."""
from __future__ import annotations

from typing import Any, Callable

import torch


def run_until_trap(group: Any, launch: Callable[[], Any]) -> int:
    """Runs `launch` (ops of `group` expected to trap), then prints the group's error record as
    `ERROR_RECORD key=value ...`; returns the exit status: 1 when a device error was recorded."""
    try:
        launch()
        torch.cuda.synchronize()
    except RuntimeError as error:
        print(f"failed as expected: {error}")
    record = group.error_record()
    print("ERROR_RECORD " + " ".join(f"{k}={v}" for k, v in record.items()), flush=True)
    return 1 if record["code"] else 0
