"""`python -m kernels_cuda.build [--device cuda | --device cpu [--asan] [--jobs N]]`: builds one of the
extensions in place, the CUDA one (`--device cuda`, the default: kernels_cuda/build_cuda.py, also setup.py's
hook) or the CPU emulation (`--device cpu`: kernels_cuda/build_cpu.py)."""
from __future__ import annotations

import sys

from kernels_cuda import build_cpu, build_cuda

USAGE = "usage: python -m kernels_cuda.build [--device cuda | --device cpu [--asan] [--jobs N]]"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    device = "cuda"
    if "--device" in args:
        at = args.index("--device")
        device = args[at + 1] if at + 1 < len(args) else ""
        del args[at:at + 2]
    if device == "cpu":
        return build_cpu.main(args)
    if device != "cuda" or args:
        print(USAGE, file=sys.stderr)
        return 2
    build_cuda.build_inplace()
    return 0


if __name__ == "__main__":
    sys.exit(main())
