#!/usr/bin/env python3
"""Prebuild dcr's CUDA kernels (CUBIN per GPU architecture) with NVRTC; no GPU needed.

    PYTHONPATH=python python tools/prebuild_cuda.py            # sm_80 and sm_90 into python/dcr/cuda/_prebuilt/
    PYTHONPATH=python python tools/prebuild_cuda.py 90 100 --out DIR

The loader tries python/dcr/cuda/_prebuilt/ before its cache and before
compiling, so a wheel that ships these needs no NVRTC at run time on those
GPUs (the driver must be new enough for this NVRTC's CUBINs; if it is not,
the loader falls back to compiling). Uses the current tuning
($DCR_CUDA_VECS / $DCR_CUDA_MIN_BLOCKS).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("archs", nargs="*", default=["80", "90"], help="e.g. 80 90 (sm_80, sm_90)")
    p.add_argument("--out", type=Path, default=None, help="folder (default: the package's _prebuilt/)")
    args = p.parse_args()
    import dcr.cuda as dc

    for path in dc.prebuild(args.archs, args.out):
        print(f"{path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
