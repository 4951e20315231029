"""`parallel.flat_range`: an element range of a tensor as the boxes DCP writes and reads.

The boxes of a range must tile exactly its elements, in order, each a contiguous run of the
flattening (so a box is a view of the range's values). Checked against an arange tensor's slices,
for random shapes (scalars and up to 4 dimensions) and ranges. A checkpoint of ranges written from
a 1-D view is read back into a plain tensor and into other ranges (tests/distributed/test_training.py
does it across ZeRO-1 layouts)."""
import math
import random

import torch
import torch.distributed.checkpoint as dcp

from moe_train.checkpoint.dcp import quiet_dcp
from parallel.flat_range import FlatRange, boxes


def test_boxes_tile_the_range_in_order():
    seed = random.SystemRandom().randrange(2 ** 32)
    print(f"seed {seed}")
    gen = random.Random(seed)
    for _ in range(500):
        shape = tuple(gen.randint(1, 5) for _ in range(gen.randint(0, 4)))
        numel = math.prod(shape)
        start = gen.randint(0, numel)
        stop = gen.randint(start, numel)
        flat = torch.arange(numel)
        tensor = flat.view(shape)
        covered = []
        for offsets, sizes, first in boxes(shape, start, stop):
            box = tensor[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
            assert box.tolist() == list(range(first, first + math.prod(sizes))), (shape, start, stop)
            covered += box.tolist()
        assert covered == list(range(start, stop)), (shape, start, stop)
        assert len(boxes(shape, start, stop)) <= 2 * max(len(shape) - 1, 0) + 1


def test_ranges_saved_by_dcp_load_into_a_whole_tensor_and_other_ranges(tmp_path):
    seed = random.SystemRandom().randrange(2 ** 32)
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    whole = torch.randn(5, 7, 3, generator=gen)
    flat = whole.reshape(-1)
    cut = int(torch.randint(1, flat.numel() - 1, (), generator=gen))
    for index, (start, stop) in enumerate([(0, cut), (cut, flat.numel())]):  # as two ranks would, one file each
        quiet_dcp(dcp.save, {"w": FlatRange(whole.shape, start, flat[start:stop].clone())},
                  storage_writer=dcp.FileSystemWriter(tmp_path / str(index)))
    for index, (start, stop) in enumerate([(0, cut), (cut, flat.numel())]):
        loaded = torch.zeros(stop - start)
        quiet_dcp(dcp.load, {"w": FlatRange(whole.shape, start, loaded)}, storage_reader=dcp.FileSystemReader(tmp_path / str(index)))
        assert torch.equal(loaded, flat[start:stop])
        other = torch.zeros(stop - start)  # a range of a plain saved tensor
        quiet_dcp(dcp.save, {"w": whole}, storage_writer=dcp.FileSystemWriter(tmp_path / "whole"))
        quiet_dcp(dcp.load, {"w": FlatRange(whole.shape, start, other)}, storage_reader=dcp.FileSystemReader(tmp_path / "whole"))
        assert torch.equal(other, flat[start:stop])
