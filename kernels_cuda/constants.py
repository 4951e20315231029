"""The kernels' constants, parsed from csrc/params/constants.h (the single source of truth).

Each `constexpr <integer type> kName = <integer>;` line of the header becomes an attribute here
(`kMaxRanks` -> `MAX_RANKS`), so the Python mirror of the config validation and the CPU protocol
model use exactly the values the kernels are compiled with.
"""
from __future__ import annotations

import re
from pathlib import Path

HEADER = Path(__file__).resolve().parent / "csrc" / "params" / "constants.h"
_LINE = re.compile(r"^\s*constexpr\s+(?:int|long long|int64_t)\s+k(\w+)\s*=\s*(-?\d+)(?:LL)?\s*;", re.MULTILINE)


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).upper()


def parse_constants(text: str) -> dict[str, int]:
    """{'MAX_RANKS': 8, ...} from the text of params/constants.h."""
    return {_snake(name): int(value) for name, value in _LINE.findall(text)}


CONSTANTS = parse_constants(HEADER.read_text())
MAX_RANKS = CONSTANTS["MAX_RANKS"]
WARP_SIZE = CONSTANTS["WARP_SIZE"]
DISPATCH_WARPS = CONSTANTS["DISPATCH_WARPS"]
COMBINE_WARPS = CONSTANTS["COMBINE_WARPS"]
COMBINE_KEEPER_WARPS = CONSTANTS["COMBINE_KEEPER_WARPS"]
MAX_TOPK = CONSTANTS["MAX_TOPK"]
MAX_LOCAL_EXPERTS = CONSTANTS["MAX_LOCAL_EXPERTS"]
RECORD_ALIGN = CONSTANTS["RECORD_ALIGN"]
BUFFER_ALIGN = CONSTANTS["BUFFER_ALIGN"]
FP8_BLOCK_SIZE = CONSTANTS["FP8_BLOCK_SIZE"]
MAX_CHANNELS = CONSTANTS["MAX_CHANNELS"]
MAX_NVL_PEERS = CONSTANTS["MAX_NVL_PEERS"]
MAX_RDMA_PEERS = CONSTANTS["MAX_RDMA_PEERS"]
RDMA_SENDER_WARPS = CONSTANTS["RDMA_SENDER_WARPS"]
RDMA_RECEIVER_WARPS = CONSTANTS["RDMA_RECEIVER_WARPS"]
MAX_EMULATED_RANKS = CONSTANTS["MAX_EMULATED_RANKS"]
RDMA_META_INTS = CONSTANTS["RDMA_META_INTS"]
DEFAULT_TIMEOUT_CYCLES = CONSTANTS["DEFAULT_TIMEOUT_CYCLES"]

# Timeout diagnostics: role ids of csrc/params/diag.h ("kRoleRdmaSender = 9," -> {9: "RdmaSender"}).
ROLES = {int(value): name for name, value in
         re.findall(r"^\s*kRole(\w+)\s*=\s*(\d+),", (HEADER.parent / "diag.h").read_text(), re.MULTILINE)}
ERROR_KEYS = ("code", "role", "rank", "channel", "peer", "head", "tail", "expected")


def error_record(values: list[int]) -> dict:
    """A runtime's ErrorRecord (code 0: none, 1: a timeout, 2: num_worst_tokens too small) as a dict, with
    the role's name."""
    record = dict(zip(ERROR_KEYS, values))
    return {**record, "role_name": ROLES.get(record["role"], "none")}


def describe_error(record: dict) -> str:
    """One line for a user: what the first failing device role waited for (the record of `error_record`)."""
    if record["code"] == 0:
        return "no device error was recorded"
    if record["code"] == 2:
        return (f"num_worst_tokens too small: rank {record['rank']} receives {record['tail']} rows (or RDMA records), "
                f"more than num_worst_tokens={record['expected']}")
    # Barriers belong to no channel (the device records channel -1 for them).
    where = f" (channel {record['channel']})" if record["channel"] >= 0 else ""
    return (f"device timeout: role {record['role_name']} of rank {record['rank']}{where} "
            f"waited for peer {record['peer']}: head={record['head']} tail={record['tail']} "
            f"expected={record['expected']} (a peer died, stalled, or ran other ops)")
